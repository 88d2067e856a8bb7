"""Slot bookkeeping for running sequences over the general region: allocate, reuse cached
prefixes from the radix tree, and give everything back.

A sequence's KV state is a `SeqKV`: the slot of every token it has computed (or has been
scheduled to compute), of which the first `num_tree` belong to the radix tree and are locked
through `handle`, and the ranges in `borrowed` belong to the chunk cache; the rest are the
sequence's own. The scheduler deals in these and in integers; it never sees tree nodes.

The model side mirrors each running sequence's slots on the device (model/slot_table.py) and
copies only what changed since the last step. That mirror is kept right here: `slots` changes
only through SeqKV's methods (`append`, `borrow`, `replace`, `overwrite`), and each lowers
`num_mirrored` to the first entry it changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_pool import SlotAllocator
from .radix import RadixCache, RadixHandle


@dataclass(slots=True)
class SeqKV:
    slots: list[int] = field(default_factory=list)
    num_tree: int = 0
    handle: RadixHandle | None = None
    borrowed: list[tuple[int, int]] = field(default_factory=list)  # [start, end) in slots
    namespace: str = ""  # prefix-cache namespace: the request's cache salt
    # The device mirror's row of this sequence (0: none yet), and how many of the row's first
    # entries are known to equal `slots`.
    row: int = 0
    num_mirrored: int = 0
    # Own slots outside the flat token list: the chunk primer's KV when the chunk cache does
    # not hold it (engine/scheduler.py, `_primer`). Never in the slot table's row.
    extra: list[int] = field(default_factory=list)

    def append(self, slots: list[int]) -> None:
        """Own slots for the next tokens."""
        self.slots.extend(slots)

    def borrow(self, slots: list[int]) -> None:
        """The chunk cache's slots for the next tokens (a reused chunk's KV)."""
        start = len(self.slots)
        self.slots.extend(slots)
        self.borrowed.append((start, start + len(slots)))

    def overwrite(self, start: int, slots: list[int]) -> None:
        """Entries start .. start + len(slots) - 1 become `slots` (the radix tree's copies of
        the same tokens' KV)."""
        self.slots[start:start + len(slots)] = slots
        self.num_mirrored = min(self.num_mirrored, start)

    def borrowed_at(self, positions: list[int]) -> list[int]:
        """The entries of `positions` (ascending) that lie in borrowed ranges."""
        out, j = [], 0
        for start, end in sorted(self.borrowed):
            while j < len(positions) and positions[j] < start:
                j += 1
            while j < len(positions) and positions[j] < end:
                out.append(positions[j])
                j += 1
        return out

    def replace(self, positions: list[int], slots: list[int]) -> None:
        """Put own `slots` at borrowed `positions` (ascending): the borrowed ranges around
        them shrink or split (selective recompute's fresh K/V)."""
        if not positions:
            return
        taken = set(positions)
        ranges = []
        for start, end in self.borrowed:
            a = start
            for x in range(start, end):
                if x in taken:
                    if a < x:
                        ranges.append((a, x))
                    a = x + 1
            if a < end:
                ranges.append((a, end))
        self.borrowed = ranges
        for x, slot in zip(positions, slots, strict=True):
            self.slots[x] = slot
        self.num_mirrored = min(self.num_mirrored, positions[0])

    def own_slots(self) -> list[int]:
        if not self.borrowed:
            return self.slots[self.num_tree:] + self.extra
        own, pos = [], self.num_tree
        for start, end in sorted(self.borrowed):
            own.extend(self.slots[pos:start])
            pos = end
        own.extend(self.slots[pos:])
        return own + self.extra


class KVCacheManager:
    def __init__(self, allocator: SlotAllocator, enable_prefix_caching: bool,
                 on_release: Callable[[SeqKV], None] | None = None) -> None:
        """`on_release(seq)` is called for every sequence released (the device mirror
        takes its row back)."""
        self.allocator = allocator
        self.radix = RadixCache(allocator) if enable_prefix_caching else None
        self.on_release = on_release

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def num_available(self) -> int:
        """Slots obtainable now: free ones plus those held only by unlocked cache entries."""
        evictable = self.radix.evictable_size if self.radix else 0
        return self.allocator.num_free + evictable

    def match_prefix(self, seq: SeqKV, tokens: list[int]) -> int:
        """Point an empty `seq` at the longest cached prefix of `tokens`; returns its length."""
        assert not seq.slots and seq.handle is None, "match_prefix on a sequence that holds slots"
        if self.radix is None or not tokens:
            return 0
        match = self.radix.match_prefix(tokens, namespace=seq.namespace)
        self.radix.lock(match.handle)
        seq.append(list(match.slots))
        seq.num_tree = match.length
        seq.handle = match.handle
        return match.length

    def allocate(self, n: int) -> list[int] | None:
        """`n` free slots, evicting unlocked prefix-cache leaves if needed; None if impossible."""
        slots = self.allocator.alloc(n)
        if slots is None and self.radix is not None:
            self.radix.evict(n - self.allocator.num_free)
            slots = self.allocator.alloc(n)
        return slots

    def cache(self, seq: SeqKV, tokens: list[int]) -> None:
        """Hand the KV of `tokens` (the sequence's first len(tokens) tokens, all computed) to the
        radix tree, keep the sequence's reference to it locked, and drop duplicate slots."""
        if self.radix is None or len(tokens) <= seq.num_tree:
            return
        n = len(tokens)
        already = self.radix.insert(tokens, seq.slots[:n], seq.namespace)
        # Between num_tree and `already` the tree had its own copy: ours are duplicates.
        self.allocator.free(seq.slots[seq.num_tree:already])
        match = self.radix.match_prefix(tokens, count=False, namespace=seq.namespace)
        assert match.length == n, "radix: freshly inserted tokens not found"
        self.radix.lock(match.handle)
        if seq.handle is not None:
            self.radix.unlock(seq.handle)
        seq.overwrite(seq.num_tree, match.slots[seq.num_tree:])
        seq.num_tree = n
        seq.handle = match.handle

    def truncate(self, seq: SeqKV, n: int) -> None:
        """Give back the sequence's slots after its first `n` (its own: speculative drafts
        that were not kept)."""
        if n < seq.num_tree or any(end > n for _, end in seq.borrowed):
            raise ValueError(f"kv cache: cannot cut a sequence to {n} slots inside its cached "
                             "prefix or a borrowed chunk")
        if n < len(seq.slots):
            self.allocator.free(seq.slots[n:])
            del seq.slots[n:]
            seq.num_mirrored = min(seq.num_mirrored, n)

    def release(self, seq: SeqKV, computed_tokens: list[int] | None = None) -> None:
        """Give back all of `seq`'s slots. With `computed_tokens` (its first tokens, whose KV is
        valid) and prefix caching on, their KV stays in the tree for later requests."""
        if computed_tokens:
            self.cache(seq, computed_tokens)
        self.allocator.free(seq.own_slots())
        if seq.handle is not None:
            self.radix.unlock(seq.handle)
        seq.slots = []
        seq.num_tree = 0
        seq.handle = None
        seq.borrowed = []
        seq.extra = []
        if self.on_release is not None:
            self.on_release(seq)
        seq.num_mirrored = 0

    def check_integrity(self, live: list[SeqKV] = ()) -> None:
        """free + cached + held by live sequences == capacity, with no slot counted twice."""
        self.allocator.check_integrity()
        tree_slots = self.radix.all_slots() if self.radix else []
        if self.radix:
            self.radix.check_integrity()
        own: list[int] = []
        for seq in live:
            own.extend(seq.own_slots())
        everything = self.allocator.free_slots() + tree_slots + own
        if len(everything) != self.capacity or len(set(everything)) != self.capacity:
            raise AssertionError(
                f"kv cache: free {self.allocator.num_free} + cached {len(tree_slots)} + "
                f"in use {len(own)} != capacity {self.capacity} (or a slot is held twice)"
            )
        if self.radix and not live and self.radix.protected_size:
            raise AssertionError("kv cache: prefix entries still locked with nothing running")

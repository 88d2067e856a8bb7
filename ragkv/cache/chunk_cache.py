"""Chunk KV cache: the KV of a document chunk computed under a system prompt (or alone),
reusable by any request with that system prompt (any system prompt), at any place among its
chunks.

An entry is found by its `ChunkKey` (chunk_key.py: the hash of what the chunk's KV depends
on, with those tokens, which are compared on every hit so a hash collision can never serve
wrong KV). Its keys are stored rotated for the chunk's base positions; a request placing it
elsewhere turns them at attention time, never in the cache.

Entries live in their own region of the KV pool with their own allocator, so the chunk cache
cannot starve running requests nor be starved by them. Rules:
- `lookup` finds an entry (complete, or still being computed by its owner) and counts it;
- `pin` / `unpin` keep an entry alive while a request's KV list uses its slots;
- `reserve` creates an entry being computed, pinned once for its owner, evicting unpinned
  entries least recently used first; it returns None if the region cannot make room;
- `complete` marks the owner's computation done; `abandon` drops an unfinished entry whose
  owner stopped (its slots are freed once nobody pins it).

With a chunk store (store/tiered.py) behind it, a lookup that misses the pool asks the store's
tiers and promotes a verified hit into the pool (a hit for the request); a completed entry is
written through to the shared tiers, and an evicted one is demoted to the host tier. Reads of
the shared tiers (disk, Redis) never block planning: the lookup starts one on the store's
loader (and `prefetch` the request's other chunks) and answers `LOADING`; the request waits,
holding its place, while other work goes on. `poll_loads`, at the start of each step's
planning, collects what arrived; the request's next lookup promotes it into the pool.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from .chunk_key import ChunkKey
from .kv_pool import KVPool, SlotAllocator
from .store.format import ChunkMeta, ChunkRecord
from .store.tier import TierStats
from .store.tiered import TieredChunkStore

logger = logging.getLogger("ragkv")

# What a lookup answers while the chunk is being read from a shared tier of the store.
LOADING = object()
# A read that landed waits for its request's next lookup (normally in the next planning) for
# at most this many plannings, and at most this many at once: what a request aborted
# meanwhile read is dropped, not kept, and a read that found nothing is not trusted later.
_ARRIVED_POLLS = 4
_MAX_ARRIVED = 64


class ChunkEntry:
    """One chunk's KV in the chunk region: its `id`, its slots, and who pins it."""

    __slots__ = ("id", "key", "slots", "ref_count", "complete", "alive")

    def __init__(self, chunk: ChunkKey, slots: list[int]) -> None:
        self.id = chunk
        self.key = chunk.key
        self.slots = slots
        self.ref_count = 0
        self.complete = False
        self.alive = True

    def __len__(self) -> int:
        return len(self.id.tokens)


@dataclass(frozen=True, slots=True)
class ChunkCacheStats:
    lookups: int
    hits: int
    misses: int
    hit_tokens: int
    cached_chunks: int
    used_tokens: int
    capacity_tokens: int
    evictions: int
    evicted_tokens: int
    avg_lookup_ms: float
    # Chunk occurrences (and their tokens) used at positions other than the cached ones, so
    # that attention sees their keys rotated (sequential positions, standalone chunks).
    repositioned_chunks: int = 0
    repositioned_tokens: int = 0
    # Chunk tokens recomputed with full attention by selective recompute (their cached KV is
    # read but not used by those requests), and the requests that chose them.
    recomputed_requests: int = 0
    recomputed_tokens: int = 0
    # Lookups that missed the pool and were served from a chunk-store tier (also counted in
    # `hits`), the tiers' own counters in their order, and writes dropped because the store's
    # writer fell behind.
    store_hits: int = 0
    store_hit_tokens: int = 0
    store: tuple[TierStats, ...] = ()
    store_dropped_writes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def usage(self) -> float:
        return self.used_tokens / self.capacity_tokens if self.capacity_tokens else 0.0


class ChunkCache:
    def __init__(self, allocator: SlotAllocator | None, store: TieredChunkStore | None = None,
                 pool: KVPool | None = None, model: str = "") -> None:
        """`store` (with the `pool` whose chunk region `allocator` hands out, and the `model`
        fingerprint its entries must carry) backs the pool; None keeps chunks in the pool only."""
        self.allocator = allocator
        self._entries: dict[bytes, ChunkEntry] = {}
        # Complete entries nobody pins, least recently used first: the eviction order.
        self._lru: OrderedDict[bytes, ChunkEntry] = OrderedDict()
        self._lru_tokens = 0
        self._orphans: list[ChunkEntry] = []  # abandoned but still pinned
        self.lookups = self.hits = self.misses = self.hit_tokens = 0
        self.evictions = self.evicted_tokens = 0
        self.repositioned_chunks = self.repositioned_tokens = 0
        self.recomputed_requests = self.recomputed_tokens = 0
        self.store_hits = self.store_hit_tokens = 0
        self._lookup_seconds = 0.0
        self.store = store if allocator is not None else None
        self.pool = pool
        self.model = model
        # Reads of the store's shared tiers in flight (key -> the chunk, its Future), and
        # those that landed (key -> the chunk, its record or None, the poll they landed at).
        self._loads: dict[bytes, tuple[ChunkKey, Future]] = {}
        self._arrived: OrderedDict[bytes, tuple[ChunkKey, ChunkRecord | None, int]] = (
            OrderedDict())
        self._polls = 0

    @property
    def capacity(self) -> int:
        return self.allocator.capacity if self.allocator else 0

    def lookup(self, chunk: ChunkKey) -> ChunkEntry | None:
        """Find the entry for this chunk (complete or being computed); counts a hit or miss.
        `LOADING` (uncounted) while the store reads it: ask again on a later step."""
        start = time.perf_counter()
        entry = self.find_or_load(chunk)
        if entry is LOADING:
            return entry
        self.lookups += 1
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
            self.hit_tokens += len(chunk)
        self._lookup_seconds += time.perf_counter() - start
        return entry

    def count_repositioned(self, num_tokens: int) -> None:
        """A looked-up chunk of `num_tokens` is used away from its cached positions."""
        self.repositioned_chunks += 1
        self.repositioned_tokens += num_tokens

    def count_recomputed(self, num_tokens: int) -> None:
        """A request chose `num_tokens` chunk tokens to recompute."""
        self.recomputed_requests += 1
        self.recomputed_tokens += num_tokens

    def find(self, chunk: ChunkKey) -> ChunkEntry | None:
        """The entry under the chunk's key if it holds exactly its tokens (a hash collision
        never serves another chunk's KV); uncounted, for a request re-checking a chunk it
        waits for."""
        entry = self._entries.get(chunk.key)
        if entry is not None and (entry.id.tokens != chunk.tokens
                                  or entry.id.system != chunk.system):
            return None
        return entry

    def find_or_load(self, chunk: ChunkKey) -> ChunkEntry | None:
        """`find`, else the chunk promoted from the store (evicted to a tier since the request
        first looked it up), or `LOADING`; uncounted, like `find`."""
        entry = self.find(chunk)
        if entry is None and self.store is not None and chunk.key not in self._entries:
            entry = self._load(chunk)
        return entry

    def pin(self, entry: ChunkEntry) -> None:
        if entry.ref_count == 0 and self._lru.pop(entry.key, None) is not None:
            self._lru_tokens -= len(entry)
        entry.ref_count += 1

    def unpin(self, entry: ChunkEntry) -> None:
        if entry.ref_count <= 0:
            raise AssertionError("chunk cache: unpin of an unpinned entry")
        entry.ref_count -= 1
        if entry.ref_count:
            return
        if not entry.alive:
            self._orphans.remove(entry)
            self.allocator.free(entry.slots)
        elif entry.complete:
            self._lru[entry.key] = entry
            self._lru_tokens += len(entry)

    def reserve(self, chunk: ChunkKey) -> ChunkEntry | None:
        """A new entry to be computed by the caller, pinned once; None if it cannot fit."""
        if self.allocator is None or len(chunk) > self.allocator.capacity:
            return None
        if chunk.key in self._entries:
            return None  # another chunk holds this hash: compute this one uncached
        need = len(chunk) - self.allocator.num_free
        if need > self._lru_tokens:
            return None
        self.evict(need)
        entry = ChunkEntry(chunk, self.allocator.alloc(len(chunk)))
        entry.ref_count = 1
        self._entries[chunk.key] = entry
        return entry

    def pending_entries(self) -> list[ChunkEntry]:
        """Entries still being computed by their owner."""
        return [e for e in self._entries.values() if not e.complete]

    def complete(self, entry: ChunkEntry) -> None:
        entry.complete = True
        if entry.ref_count == 0:  # the owner already let go
            self._lru[entry.key] = entry
            self._lru_tokens += len(entry)
        if self.store is not None and self.store.has_shared_tier:
            self._write_through(entry)

    def _write_through(self, entry: ChunkEntry) -> None:
        """Queue the entry's KV for the shared tiers. A full queue, or a copy that fails
        (pinned memory exhausted), costs only the sharing of this chunk: a dropped write."""
        layers, heads, dim = self.pool.entry_shape()
        nbytes = len(entry) * 2 * layers * heads * dim * self.pool.dtype.itemsize
        if not self.store.has_room(nbytes):
            self.store.note_dropped()
            return
        try:
            record = self._record(entry)
        except Exception as e:
            self.store.note_dropped()
            logger.warning("chunk store: copying a chunk off the pool failed (%s: %s); it is "
                           "not shared", type(e).__name__, e)
            return
        self.store.put(record)

    def meta(self, chunk: ChunkKey) -> ChunkMeta:
        return ChunkMeta.describe(chunk.key, self.model, self.pool.dtype, chunk.namespace,
                                  chunk.system, chunk.tokens, self.pool.entry_shape())

    def _record(self, entry: ChunkEntry) -> ChunkRecord:
        kv, ready = self.pool.read(entry.slots)
        return ChunkRecord(self.meta(entry.id), kv, ready)

    def _load(self, chunk: ChunkKey) -> ChunkEntry | None:
        """Promote the chunk from the store into the pool: a complete, unpinned entry, None
        (not stored, or no room in the region), or `LOADING` while a shared tier reads it."""
        arrived = self._arrived.pop(chunk.key, None)
        if arrived is not None:
            read_for, record, _ = arrived
            if record is None or read_for != chunk:  # not stored (or another chunk's key)
                return None
            return self._promote(chunk, record.kv)
        if chunk.key in self._loads:
            return LOADING
        if not self._has_room(chunk):
            return None  # no room even after evicting every unused entry: do not read it
        meta = self.meta(chunk)
        found = self.store.get_local(meta)
        if found is not None:
            return self._promote(chunk, found[0].kv)
        if not self.store.has_remote_tier:
            return None
        self._loads[chunk.key] = (chunk, self.store.load(meta))
        return LOADING

    def prefetch(self, chunks: list[ChunkKey]) -> None:
        """Ask the store for those `chunks` that are neither in the pool nor asked already,
        and would fit: a request waiting for one of its chunks asks for the others at once,
        so that their shared tiers' reads overlap instead of taking a step each. The tiers
        are read as a lookup reads them (in place first, then on the loader), so each counts
        what it would have; the records wait for the request's lookups, which count them."""
        if self.store is None or not self.store.has_remote_tier:
            return
        for chunk in chunks:
            key = chunk.key
            if key in self._arrived:
                # Still wanted: the request asks again each step it waits, so a record that
                # landed before the read it waits for is not aged out meanwhile (to be read
                # again, and counted twice, when the request gets to it).
                read_for, record, _ = self._arrived[key]
                self._arrived[key] = (read_for, record, self._polls)
                self._arrived.move_to_end(key)
                continue
            if key in self._entries or key in self._loads or not self._has_room(chunk):
                continue
            meta = self.meta(chunk)
            found = self.store.get_local(meta)
            if found is not None:
                self._arrived[key] = (chunk, found[0], self._polls)
            else:
                self._loads[key] = (chunk, self.store.load(meta))

    def poll_loads(self) -> None:
        """Collect the store reads that finished, for their requests' next lookups (a read
        cancelled or failed counts as not found); drop those left unclaimed too long."""
        self._polls += 1
        for key, (chunk, future) in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[key]
            try:
                found = future.result()
            except BaseException as e:  # noqa: BLE001 (cancelled by close(): a miss)
                logger.warning("chunk store: a read of %s ended without a result (%s)",
                               chunk.hex[:16], type(e).__name__)
                found = None
            self._arrived[key] = (chunk, None if found is None else found[0], self._polls)
        oldest = self._polls - _ARRIVED_POLLS
        while self._arrived and (len(self._arrived) > _MAX_ARRIVED
                                 or next(iter(self._arrived.values()))[2] <= oldest):
            self._arrived.popitem(last=False)

    def wait_for_loads(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until a store read finishes, when nothing else
        can run; whether any is in flight."""
        if not self._loads:
            return False
        wait([f for _, f in self._loads.values()], timeout, return_when=FIRST_COMPLETED)
        return True

    def _has_room(self, chunk: ChunkKey) -> bool:
        return (self.allocator is not None
                and len(chunk) - self.allocator.num_free <= self._lru_tokens)

    def _forget_loads(self) -> None:
        """Reads in flight or landed count for nothing (a request still waiting reads
        again)."""
        self._loads.clear()
        self._arrived.clear()

    def _promote(self, chunk: ChunkKey, kv) -> ChunkEntry | None:
        entry = self.insert(chunk, kv)
        if entry is not None:
            self.store_hits += 1
            self.store_hit_tokens += len(chunk)
        return entry

    def insert(self, chunk: ChunkKey, kv) -> ChunkEntry | None:
        """A complete, unpinned entry holding `kv` (loaded, not computed: it is not written
        back to the store), or None if the region cannot make room."""
        entry = self.reserve(chunk)
        if entry is None:
            return None
        try:
            # Its keys sit at its base positions: after its system tokens (none if standalone).
            self.pool.write(entry.slots, kv, len(chunk.system))
        except BaseException:
            self.abandon(entry)  # never left reserved without an owner
            raise
        entry.complete = True
        self.unpin(entry)
        return entry

    def offload(self) -> list[tuple[ChunkEntry, ChunkRecord]]:
        """Every complete entry no request uses, least recently used first, with its KV
        copied to the host; they leave the pool (uncounted as evictions, not demoted)."""
        self._forget_loads()
        out = []
        for entry in list(self._lru.values()):
            out.append((entry, self._record(entry)))
            self._drop(entry)
        return out

    def abandon(self, entry: ChunkEntry) -> None:
        """The owner stops before finishing: drop the entry and release the owner's pin."""
        assert not entry.complete and entry.alive
        entry.alive = False
        del self._entries[entry.key]
        self._orphans.append(entry)
        self.unpin(entry)

    def evict(self, num_tokens: int, demote: bool = True) -> int:
        """Free at least `num_tokens` slots, least recently used entries first (demoted to the
        host tier when there is one and `demote`); returns the tokens freed."""
        freed = 0
        demote = demote and self.store is not None and self.store.has_host_tier
        while freed < num_tokens and self._lru:
            entry = next(iter(self._lru.values()))
            if demote and not self.store.host_contains(entry.key.hex()):
                try:
                    self.store.demote(self._record(entry))
                except Exception as e:  # the eviction goes on: the chunk is only lost
                    logger.warning("chunk store: demoting a chunk failed (%s: %s)",
                                   type(e).__name__, e)
            self._drop(entry)
            freed += len(entry)
            self.evictions += 1
        self.evicted_tokens += freed
        return freed

    def _drop(self, entry: ChunkEntry) -> None:
        """Take an unpinned complete entry out of the pool and free its slots."""
        del self._lru[entry.key]
        self._lru_tokens -= len(entry)
        del self._entries[entry.key]
        entry.alive = False
        self.allocator.free(entry.slots)

    def clear(self) -> int:
        """Drop every entry no request is using, and the host tier's copies (this process's
        memory); returns how many pool entries were dropped. Shared tiers (disk, Redis) keep
        theirs: other replicas use them."""
        n = len(self._lru)
        self._forget_loads()
        self.evict(self._lru_tokens, demote=False)
        if self.store is not None:
            self.store.clear_host()
        return n

    def stats(self) -> ChunkCacheStats:
        used = self.capacity - self.allocator.num_free if self.allocator else 0
        return ChunkCacheStats(
            lookups=self.lookups, hits=self.hits, misses=self.misses,
            hit_tokens=self.hit_tokens, cached_chunks=len(self._entries), used_tokens=used,
            capacity_tokens=self.capacity, evictions=self.evictions,
            evicted_tokens=self.evicted_tokens,
            avg_lookup_ms=1000 * self._lookup_seconds / self.lookups if self.lookups else 0.0,
            repositioned_chunks=self.repositioned_chunks,
            repositioned_tokens=self.repositioned_tokens,
            recomputed_requests=self.recomputed_requests,
            recomputed_tokens=self.recomputed_tokens,
            store_hits=self.store_hits, store_hit_tokens=self.store_hit_tokens,
            store=self.store.stats() if self.store else (),
            store_dropped_writes=self.store.dropped_writes if self.store else 0,
        )

    def check_integrity(self, pins: dict[int, int] | None = None) -> None:
        """free + entries' slots == capacity; pins match `pins` (id(entry) -> count) if given."""
        if self.allocator is None:
            if self._entries:
                raise AssertionError("chunk cache: entries without a region")
            return
        self.allocator.check_integrity()
        held = [s for e in self._entries.values() for s in e.slots]
        held += [s for e in self._orphans for s in e.slots]
        everything = held + self.allocator.free_slots()
        if len(everything) != self.capacity or len(set(everything)) != self.capacity:
            raise AssertionError(
                f"chunk cache: free {self.allocator.num_free} + held {len(held)} != "
                f"capacity {self.capacity} (or a slot is held twice)"
            )
        for key, entry in self._entries.items():
            if entry.key != key or not entry.alive or len(entry.slots) != len(entry):
                raise AssertionError("chunk cache: malformed entry")
            in_lru = key in self._lru
            if in_lru != (entry.ref_count == 0 and entry.complete):
                raise AssertionError("chunk cache: LRU membership disagrees with pins")
            if not entry.complete and entry.ref_count == 0:
                raise AssertionError("chunk cache: an unfinished entry has no owner")
        if self._lru_tokens != sum(len(e) for e in self._lru.values()):
            raise AssertionError("chunk cache: LRU token count drifted")
        if pins is not None:
            counted = {id(e): e.ref_count for e in [*self._entries.values(), *self._orphans]
                       if e.ref_count}
            if counted != {k: v for k, v in pins.items() if v}:
                raise AssertionError("chunk cache: pin counts disagree with live requests")


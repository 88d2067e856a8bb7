"""Radix prefix cache over token slots (SGLang's interface, page size 1).

Rules:
- `match_prefix` returns the slots of the longest cached prefix and an opaque handle. The caller
  must `lock(handle)` before using those slots and `unlock(handle)` when done; locked nodes and
  their ancestors are never evicted.
- `insert(tokens, slots)` takes ownership of the slots beyond the prefix already cached and
  returns that prefix's length; the caller frees its own copies of slots `[0, returned)` that
  are not the tree's.
- `evict(n)` frees at least `n` slots (if it can) to the allocator, least recently used
  unlocked leaves first, from a heap: no rescans of the tree.
- Every call takes a `namespace` (the request's cache salt): each namespace has its own root,
  so tenants never share entries.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from .kv_pool import SlotAllocator


class _Node:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "alive")

    def __init__(self, key: list[int], value: list[int], parent: _Node | None) -> None:
        self.key = key
        self.value = value
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.alive = True


class RadixHandle:
    """Opaque reference to a matched node; pass it back to lock / unlock."""

    __slots__ = ("_node",)

    def __init__(self, node: _Node) -> None:
        self._node = node


@dataclass(slots=True, frozen=True)
class MatchResult:
    slots: list[int]
    handle: RadixHandle

    @property
    def length(self) -> int:
        return len(self.slots)


class RadixCache:
    def __init__(self, allocator: SlotAllocator) -> None:
        self.allocator = allocator
        self._roots: dict[str, _Node] = {}
        self._clock = itertools.count(1)
        self._tiebreak = itertools.count()
        self._heap: list[tuple[int, int, _Node]] = []
        self._num_nodes = 0
        self.evictable_size = 0
        self.protected_size = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_tokens = 0

    def _root(self, namespace: str) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node([], [], None)
            root.lock_ref = 1  # roots are never evicted
            self._num_nodes += 1
        return root

    def match_prefix(self, tokens: list[int], count: bool = True,
                     namespace: str = "") -> MatchResult:
        """Longest cached prefix of `tokens`; splits an edge so the handle covers it exactly."""
        node = self._root(namespace)
        slots: list[int] = []
        pos = 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            slots.extend(child.value)
            pos += n
            node = child
            node.last_access = now
        if count:
            self.queried_tokens += len(tokens)
            self.hit_tokens += len(slots)
        self._touch_leaf(node)
        return MatchResult(slots, RadixHandle(node))

    def insert(self, tokens: list[int], slots: list[int], namespace: str = "") -> int:
        """Cache `tokens` -> `slots`; returns the length of the prefix that was already cached."""
        if len(tokens) != len(slots):
            raise ValueError("insert: tokens and slots differ in length")
        node = self._root(namespace)
        pos = 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = _Node(tokens[pos:], slots[pos:], node)
                new.last_access = now
                node.children[tokens[pos]] = new
                self._num_nodes += 1
                self.evictable_size += len(new.key)
                self._push_leaf(new)
                return pos
            n = _common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            pos += n
            node = child
            node.last_access = now
        self._touch_leaf(node)
        return pos

    def lock(self, handle: RadixHandle) -> None:
        node = handle._node
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: RadixHandle) -> None:
        node = handle._node
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise AssertionError("radix: unlock of an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
                self._push_leaf(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots if possible; returns how many were freed."""
        freed = 0
        while freed < num_tokens and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not self._is_evictable_leaf(node) or stamp != node.last_access:
                continue
            self.allocator.free(node.value)
            freed += len(node.value)
            self.evictable_size -= len(node.key)
            parent = node.parent
            del parent.children[node.key[0]]
            node.alive = False
            self._num_nodes -= 1
            self._push_leaf(parent)
        self.evicted_tokens += freed
        if len(self._heap) > 4 * self._num_nodes + 64:
            self._rebuild_heap()
        return freed

    def reset(self) -> None:
        """Drop every unlocked entry (all of them, when nothing is running)."""
        self.evict(self.evictable_size)

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def all_slots(self) -> list[int]:
        out: list[int] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            out.extend(node.value)
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        """Sizes add up, keys and values align, lock counts match children's, no slot twice."""
        evictable = protected = count = 0
        seen: set[int] = set()
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            count += 1
            if node.parent is not None:
                if len(node.key) != len(node.value) or not node.key:
                    raise AssertionError("radix: node key/value length mismatch or empty edge")
                if node.parent.children.get(node.key[0]) is not node:
                    raise AssertionError("radix: parent does not point back to child")
                if node.lock_ref < 0:
                    raise AssertionError("radix: negative lock count")
                if node.lock_ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
                for child in node.children.values():
                    if child.lock_ref > node.lock_ref:
                        raise AssertionError("radix: child locked more than its parent")
            for slot in node.value:
                if slot in seen:
                    raise AssertionError(f"radix: slot {slot} cached twice")
                seen.add(slot)
            stack.extend(node.children.values())
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise AssertionError(
                f"radix: sizes ({self.evictable_size}, {self.protected_size}) "
                f"!= counted ({evictable}, {protected})"
            )
        if count != self._num_nodes:
            raise AssertionError("radix: node count drifted")

    def _split(self, child: _Node, n: int) -> _Node:
        """Split `child`'s edge after `n` tokens; returns the new upper node."""
        upper = _Node(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        self._num_nodes += 1
        return upper

    def _is_evictable_leaf(self, node: _Node) -> bool:
        return (node.alive and node.parent is not None and not node.children
                and node.lock_ref == 0)

    def _push_leaf(self, node: _Node) -> None:
        if self._is_evictable_leaf(node):
            heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))

    def _touch_leaf(self, node: _Node) -> None:
        # A matched node's access time changed: its old heap entry is now stale.
        self._push_leaf(node)

    def _rebuild_heap(self) -> None:
        self._heap = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if self._is_evictable_leaf(node):
                self._heap.append((node.last_access, next(self._tiebreak), node))
        heapq.heapify(self._heap)


def _common_len(key: list[int], tokens: list[int], start: int) -> int:
    n = min(len(key), len(tokens) - start)
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i

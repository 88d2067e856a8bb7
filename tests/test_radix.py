"""Radix prefix cache and slot allocator, against a naive model of what they should hold."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ragkv.cache.kv_manager import KVCacheManager, SeqKV
from ragkv.cache.kv_pool import SlotAllocator
from ragkv.cache.radix import RadixCache


def test_allocator_alloc_free_and_exhaustion():
    alloc = SlotAllocator(1, 11)
    a = alloc.alloc(4)
    assert a == [1, 2, 3, 4]
    assert alloc.alloc(7) is None and alloc.num_free == 6  # nothing taken on failure
    b = alloc.alloc(6)
    assert alloc.num_free == 0 and not set(a) & set(b)
    alloc.free(a)
    assert alloc.alloc(4) == a  # freed slots come back in order
    alloc.check_integrity()


def test_match_insert_split_and_lock():
    alloc = SlotAllocator(1, 101)
    radix = RadixCache(alloc)
    slots = alloc.alloc(6)
    assert radix.insert([1, 2, 3, 4, 5, 6], slots) == 0
    m = radix.match_prefix([1, 2, 3, 9])
    assert m.slots == slots[:3]  # split at the divergence
    radix.lock(m.handle)
    assert radix.protected_size == 3 and radix.evictable_size == 3
    other = alloc.alloc(3)
    assert radix.insert([1, 2, 3, 7, 8, 9], slots[:3] + other) == 3
    # Locked [1,2,3] survives eviction of everything else.
    assert radix.evict(100) == 6
    assert radix.match_prefix([1, 2, 3, 4]).slots == slots[:3]
    radix.unlock(m.handle)
    assert radix.evict(100) == 3
    assert radix.total_size == 0
    radix.check_integrity()
    assert radix.hit_tokens == 6 and radix.queried_tokens == 8


def test_evict_is_lru():
    alloc = SlotAllocator(1, 101)
    radix = RadixCache(alloc)
    for first in (10, 20, 30):
        radix.insert([first, 1, 2], alloc.alloc(3))
    radix.match_prefix([10, 1, 2])  # 10 becomes most recent; 20 is the oldest now
    radix.evict(1)
    assert radix.match_prefix([20, 1, 2]).length == 0
    assert radix.match_prefix([30, 1, 2]).length == 3
    assert radix.match_prefix([10, 1, 2]).length == 3
    radix.check_integrity()


def test_manager_cache_dedupes_and_accounts():
    alloc = SlotAllocator(1, 65)
    kv = KVCacheManager(alloc, enable_prefix_caching=True)
    a, b = SeqKV(slots=kv.allocate(10)), SeqKV(slots=kv.allocate(10))
    tokens = list(range(10))
    kv.cache(a, tokens)
    kv.cache(b, tokens)  # b's slots were duplicates: freed, b now shares a's
    assert a.slots == b.slots
    kv.check_integrity([a, b])
    kv.release(a, tokens)
    kv.release(b, tokens)
    kv.check_integrity([])
    assert alloc.num_free == 64 - 10 and kv.num_available() == 64


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "match", "evict"]),
                          st.lists(st.integers(0, 3), min_size=1, max_size=8),
                          st.integers(0, 12)),
                max_size=40))
def test_radix_random_ops_match_naive_model(ops):
    """Whatever is matched is the longest inserted-and-not-evicted prefix; sizes add up."""
    alloc = SlotAllocator(1, 1 + 400)
    radix = RadixCache(alloc)
    slot_of: dict[tuple[int, ...], int] = {}  # naive: every cached prefix -> its last slot
    locked = []
    for op, tokens, n in ops:
        if op == "insert":
            slots = alloc.alloc(len(tokens))
            already = radix.insert(tokens, slots)
            alloc.free(slots[:already])
            for i in range(already, len(tokens)):
                slot_of[tuple(tokens[:i + 1])] = slots[i]
        elif op == "match":
            m = radix.match_prefix(tokens)
            expect = 0
            while expect < len(tokens) and tuple(tokens[:expect + 1]) in slot_of:
                expect += 1
            assert m.length == expect
            assert m.slots == [slot_of[tuple(tokens[:i + 1])] for i in range(expect)]
            if n % 3 == 0:
                radix.lock(m.handle)
                locked.append(m.handle)
        else:
            radix.evict(n)
            live = set(radix.all_slots())
            slot_of = {k: v for k, v in slot_of.items() if v in live}
        radix.check_integrity()
        assert alloc.num_free + radix.total_size == 400
    for handle in locked:
        radix.unlock(handle)
    radix.evict(10_000)
    assert radix.total_size == 0 and alloc.num_free == 400
    radix.check_integrity()

"""The device mirror of every sequence's KV slot list (model/slot_table.py), and the int packing
its transfers and the chunk keys use (host_ints.py)."""

from __future__ import annotations

import hashlib
import random
import struct
from array import array

import pytest
import torch

from ragkv.cache.chunk_key import ChunkKeys
from ragkv.cache.kv_manager import SeqKV
from ragkv.cache.store.format import token_hash
from ragkv.host_ints import int64_bytes, int64_tensor
from ragkv.model.slot_table import LONG_RUN, MAX_ROW_COPIES, PAD_ROW, SlotTable


@pytest.mark.parametrize("values", [[], [0], [1, -1, 2**63 - 1, -2**63], list(range(5000))])
def test_int64_packing_gives_array_q_bytes(values):
    """int64_bytes gives array("q")'s bytes and int64_tensor those values as int64; an int
    outside int64 on either side is refused with struct's out-of-range error, never wrapped
    or truncated."""
    assert int64_bytes(values) == array("q", values).tobytes()
    t = int64_tensor(values)
    assert t.dtype == torch.int64 and t.tolist() == values
    for beyond in (2**63, -2**63 - 1):
        with pytest.raises(struct.error, match="argument out of range"):
            int64_bytes(values + [beyond])


def test_chunk_keys_are_those_of_array_q():
    """Chunk keys name entries in stores other replicas and earlier versions wrote: the
    packing that builds them must not change a single byte."""
    keys = ChunkKeys("model", torch.float32)
    system, tokens = (1, 2, 3), tuple(range(7, 600))
    h = hashlib.sha256()
    for part in (b"ns", array("q", system).tobytes(), array("q", tokens).tobytes()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    assert keys.hash("ns", system, tokens) == h.digest()
    assert token_hash(tokens) == hashlib.sha256(array("q", tokens).tobytes()).hexdigest()


def test_sync_mirrors_long_and_short_runs_and_rewrites():
    """Random appends (one entry, as decode does, and whole lists, as a new request does) and
    in-place rewrites, up to 8 sequences per step (so that some steps have more long runs than
    are copied as row slices): after every sync each row equals its sequence's list, and rows
    of released sequences are handed out again."""
    rng = random.Random(0)
    width = 3 * LONG_RUN + 10
    table = SlotTable(num_rows=8, width=width, device=torch.device("cpu"))
    seqs = [SeqKV() for _ in range(8)]
    for step in range(400):
        batch = rng.sample(seqs, rng.randint(1, 8))
        for seq in batch:
            room = width - len(seq.slots)
            action = rng.random()
            if action < 0.1 and seq.slots:  # finished: its row goes back
                table.release(seq)
                seq.slots.clear()
            elif action < 0.3 and seq.slots:  # rewrite a tail in place (chunk take-over)
                at = rng.randrange(len(seq.slots))
                for i in range(at, len(seq.slots)):
                    seq.slots[i] = rng.randrange(1, 10**6)
                seq.num_mirrored = min(seq.num_mirrored, at)
            elif room:
                n = 1 if rng.random() < 0.5 else rng.randint(1, min(room, 2 * LONG_RUN))
                seq.slots.extend(rng.randrange(1, 10**6) for _ in range(min(n, room)))
        table.sync(batch)
        for seq in batch:
            if seq.slots:
                assert seq.row != PAD_ROW
                row = table.table[seq.row, :len(seq.slots)].tolist()
                assert row == seq.slots, step
        table.check_integrity(s for s in seqs if s.row != PAD_ROW)
    assert table.table[PAD_ROW].eq(0).all()


@pytest.mark.parametrize("new", [1, MAX_ROW_COPIES, MAX_ROW_COPIES + 1, 12])
def test_sync_of_many_new_lists_at_once(new):
    """A step admitting `new` requests (long lists: row slices up to MAX_ROW_COPIES of them,
    scattered beyond) beside decoding ones (one entry each)."""
    table = SlotTable(num_rows=16, width=300, device=torch.device("cpu"))
    old = [SeqKV(slots=list(range(100 * i + 1, 100 * i + 51))) for i in range(3)]
    table.sync(old)
    for i, seq in enumerate(old):
        seq.slots.append(5000 + i)
    fresh = [SeqKV(slots=list(range(10_000 * (i + 1), 10_000 * (i + 1) + 40 + 7 * i)))
             for i in range(new)]
    table.sync(fresh + old)
    for seq in fresh + old:
        assert table.table[seq.row, :len(seq.slots)].tolist() == seq.slots
    table.check_integrity(fresh + old)


def test_sync_refuses_a_list_longer_than_the_table():
    table = SlotTable(num_rows=2, width=8, device=torch.device("cpu"))
    seq = SeqKV(slots=list(range(1, 10)))
    with pytest.raises(RuntimeError, match="more than max_model_len=8"):
        table.sync([seq])

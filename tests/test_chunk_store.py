"""The chunk store (issue 12): chunk KV beyond the pool, in host memory, on disk and in Redis,
behind one `ChunkStore` interface (docs/architecture.md, "Beyond the pool").

- the entry format round-trips byte for byte and rejects every damaged or foreign entry;
- each tier keeps the interface's rules (write-once, bounded LRU, stats);
- a request served from any tier equals the one-pass reference, cold and warm, in this engine
  and in one started later or in another process;
- corrupted, truncated and foreign entries are detected, deleted and recomputed;
- a Redis outage degrades to local compute and recovers;
- `LLM.sleep()` / `wake_up()` keep cached chunks;
- bad `chunk_store` settings are clear ValueErrors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from conftest import random_prompt
from dependencies import require_redis_package
from test_rag import GREEDY, MAX_TOKENS, check_outputs, make_llm, plain, rag, run

from ragkv import LLM
from ragkv.cache.store import disk_tier, host_tier, redis_tier
from ragkv.cache.store import tiered as tiered_module
from ragkv.cache.store.disk_tier import DiskChunkStore
from ragkv.cache.store.format import (
    MAGIC,
    ChunkMeta,
    ChunkRecord,
    CorruptChunkError,
    decode,
    encode,
    token_hash,
)
from ragkv.cache.store.host_tier import HostChunkStore
from ragkv.cache.store.redis_tier import RedisChunkStore
from ragkv.cache.store.tier import LOAD_BUCKETS, ChunkStore
from ragkv.cache.store.tiered import TieredChunkStore, build_chunk_store
from ragkv.config import parse_size
from ragkv.model.loader import inspect_checkpoint

FILE_SUFFIX = ".ragkv-chunk"  # a disk tier's file is <hex key><suffix>
REDIS_PREFIX = "ragkv:chunk:"

S = random_prompt(6, seed=700)
DOCS = [random_prompt(20, seed=701 + i) for i in range(8)]
Q1, Q2 = random_prompt(5, seed=720), random_prompt(5, seed=721)


# ---------------------------------------------------------------------------------- helpers


def make_meta(dtype=torch.float32, key: bytes = bytes(range(32)), model: str = "model-a",
              namespace: str = "fp|float32|rotated|attention=isolated|salt=",
              system=(1, 2, 3), tokens=(4, 5, 6, 7), layer_shape=(2, 2, 8)) -> ChunkMeta:
    return ChunkMeta.describe(key, model, dtype, namespace, system, tokens, layer_shape)


def make_record(meta: ChunkMeta | None = None, seed: int = 0) -> ChunkRecord:
    meta = meta or make_meta()
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(meta.shape, generator=gen).to(getattr(torch, meta.dtype))
    return ChunkRecord(meta, kv)


def tier_record(i: int, tokens: int = 8) -> ChunkRecord:
    """Record i of a family of equally sized records (so byte capacities count entries)."""
    meta = make_meta(key=i.to_bytes(32, "big"), tokens=tuple(range(100 * i, 100 * i + tokens)))
    return make_record(meta, seed=i)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def header_len(data: bytes) -> int:
    return int.from_bytes(data[8:12], "little")


def header_of(data: bytes) -> dict:
    return json.loads(data[12:12 + header_len(data)])


def meta_of(data: bytes) -> ChunkMeta:
    """The meta an entry's own header claims (to verify its checksum and sizes)."""
    h = header_of(data)
    return ChunkMeta(key=h["key"], model=h["model"], dtype=h["dtype"], namespace=h["namespace"],
                     system=h["system"], tokens=h["tokens"], shape=tuple(h["shape"]))


def reencode(data: bytes, **changes) -> bytes:
    """A well-formed entry with the KV of `data` and header fields changed (a forgery)."""
    record = decode(data, meta_of(data))
    return encode(ChunkRecord(dataclasses.replace(record.meta, **changes), record.kv))


def raw_entry(header: dict, payload: bytes) -> bytes:
    """An entry with an arbitrary header and a correct checksum."""
    import zlib

    h = json.dumps(header).encode()
    body = MAGIC + len(h).to_bytes(4, "little") + h + payload
    return body + zlib.crc32(body).to_bytes(4, "little")


def flip(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x01
    return bytes(out)


def tier_stats(llm, name: str):
    matches = [t for t in llm.get_chunk_cache_stats().store if t.name == name]
    assert len(matches) == 1, llm.get_chunk_cache_stats().store
    return matches[0]


class RawDisk:
    """A disk tier's directory, read and written behind the engine's back."""

    def __init__(self, path: str) -> None:
        self.path = path

    def file(self, key: str) -> str:
        return os.path.join(self.path, key + FILE_SUFFIX)

    def read(self, key: str) -> bytes | None:
        try:
            with open(self.file(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write(self, key: str, data: bytes) -> None:
        with open(self.file(key), "wb") as f:
            f.write(data)

    def stored(self) -> set[str]:
        return {n[:-len(FILE_SUFFIX)] for n in os.listdir(self.path) if n.endswith(FILE_SUFFIX)}


class RawRedis:
    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=5)

    def read(self, key: str) -> bytes | None:
        return self.client.get(REDIS_PREFIX + key)

    def write(self, key: str, data: bytes) -> None:
        self.client.set(REDIS_PREFIX + key, data)

    def stored(self) -> set[str]:
        return {k.decode()[len(REDIS_PREFIX):] for k in self.client.keys(REDIS_PREFIX + "*")}


@pytest.fixture(scope="module")
def llama(checkpoint, hf_model):
    path = checkpoint("llama")
    return path, hf_model(path)


@pytest.fixture(params=["disk", "redis"])
def shared_tier(request, tmp_path):
    """(tier name, chunk_store spec, raw access to the backend) of a fresh shared tier."""
    if request.param == "disk":
        path = str(tmp_path / "chunks")
        return "disk", f"disk:{path}:1MiB", RawDisk(path)
    server = request.getfixturevalue("redis_server")
    return "redis", server.url, RawRedis(server.url)


@pytest.fixture(params=["host", "disk", "redis"])
def tier(request, tmp_path):
    """A fresh tier of each kind, with an unbounded (or large) capacity."""
    if request.param == "host":
        store = HostChunkStore(1 << 20)
    elif request.param == "disk":
        store = DiskChunkStore(str(tmp_path / "chunks"), 1 << 20)
    else:
        store = RedisChunkStore(request.getfixturevalue("redis_server").url)
    yield store
    store.close()


# --------------------------------------------------------------------------------- format


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_format_round_trip_is_byte_exact(dtype):
    meta = make_meta(dtype)
    record = make_record(meta, seed=1)
    record.kv.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    data = encode(record)
    assert data.startswith(MAGIC)
    assert len(data) == 8 + 4 + header_len(data) + meta.payload_bytes + 4
    for buffer in (data, bytearray(data), memoryview(data)):
        back = decode(buffer, meta)
        assert back.meta == meta
        assert same_bytes(back.kv, record.kv)
    assert record.nbytes == meta.payload_bytes == record.kv.numel() * record.kv.itemsize
    # Encoding is deterministic, and a non-contiguous tensor encodes as its contiguous copy.
    assert encode(record) == data
    wide = torch.zeros((*meta.shape[:-1], 2 * meta.shape[-1]), dtype=dtype)
    wide[..., ::2] = record.kv
    assert encode(ChunkRecord(meta, wide[..., ::2])) == data


def test_format_stores_hashes_not_secrets():
    meta = make_meta(namespace="fp|float32|rotated|attention=isolated|salt=tenant-secret")
    data = encode(make_record(meta))
    assert b"tenant-secret" not in data
    header = header_of(data)
    assert header["namespace"] == meta.namespace and len(meta.namespace) == 64
    assert header["tokens"] == token_hash((4, 5, 6, 7)) != token_hash((4, 5, 6))
    assert header["shape"] == [2, 2, 4, 2, 8] and header["dtype"] == "float32"


def test_cpu_readers_wait_for_an_asynchronous_copy(tmp_path):
    """A record filled by an asynchronous device-to-host copy (KVPool.read on CUDA) carries an
    event: encoding it (disk, Redis, a backfill) waits for the event first; the host tier keeps
    the event with the record. (On CUDA the real path runs in test_gpu.py.)"""
    order: list[str] = []

    class Event:
        def synchronize(self) -> None:
            order.append("synchronized")

    base = make_record(seed=3)
    record = ChunkRecord(base.meta, base.kv, Event())
    assert record == base  # the event is not part of the record's identity
    data = encode(record)
    assert order == ["synchronized"] and data == encode(base)
    host = HostChunkStore(1 << 20)
    assert host.put(record)
    assert host.get(base.meta.key, base.meta).ready is record.ready
    disk = DiskChunkStore(str(tmp_path), 1 << 20)
    assert disk.put(record) and order == ["synchronized"] * 2


def test_encode_refuses_a_tensor_unlike_its_header():
    meta = make_meta()
    with pytest.raises(ValueError, match="does not match its header"):
        encode(ChunkRecord(meta, torch.zeros(meta.shape, dtype=torch.float16)))
    with pytest.raises(ValueError, match="does not match its header"):
        encode(ChunkRecord(meta, torch.zeros((2, 2, 5, 2, 8))))


def _damaged_entries(data: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (damaged copy of `data`, the reason decode must give)."""
    n = header_len(data)
    header = data[12:12 + n]
    payload_start = 12 + n
    model_at = 12 + header.index(b'"model":"') + len(b'"model":"')
    crc_name_at = 12 + header.index(b'"crc32"') + 1
    return {
        "truncated by one byte": (data[:-1], "truncated or padded entry"),
        "truncated in the payload": (data[:payload_start + 10], "truncated or padded entry"),
        "truncated in the header": (data[:40], r"truncated entry: header of \d+ bytes in 40"),
        "too short": (data[:10], "bad magic or too short"),
        "empty": (b"", "bad magic or too short"),
        "padded": (data + b"\0", "truncated or padded entry"),
        "payload byte flipped": (flip(data, payload_start + 5), "checksum mismatch"),
        "checksum byte flipped": (flip(data, len(data) - 2), "checksum mismatch"),
        # A header byte no field check reads: only the checksum (over the header too) sees it.
        "unchecked header byte flipped": (flip(data, crc_name_at), "checksum mismatch"),
        "model byte flipped": (flip(data, model_at), "model mismatch"),
        "wrong magic": (b"RAGKVKX\0" + data[8:], "bad magic"),
        "huge header length": (data[:8] + (1 << 30).to_bytes(4, "little") + data[12:],
                               "truncated entry"),
        "header not JSON": (data[:12] + b"{" * n + data[payload_start:], "unreadable header"),
    }


_DAMAGES = list(_damaged_entries(encode(make_record())))


@pytest.mark.parametrize("damage", _DAMAGES)
def test_damaged_entries_are_rejected_with_a_reason(damage):
    meta = make_meta()
    data = encode(make_record(meta))
    damaged, reason = _damaged_entries(data)[damage]
    assert damaged != data
    with pytest.raises(CorruptChunkError, match=reason):
        decode(damaged, meta)


@pytest.mark.parametrize("field, value, reason", [
    ("key", "ab" * 32, "key mismatch"),
    ("model", "model-b", "model mismatch: entry has 'model-a', expected 'model-b'"),
    ("dtype", "bfloat16", "dtype mismatch"),
    ("namespace", "0" * 64, "namespace mismatch"),
    ("system", token_hash((1, 2)), "system mismatch"),
    ("tokens", token_hash((4, 5, 6, 8)), "tokens mismatch"),
    ("shape", (2, 2, 4, 2, 4), r"shape mismatch: entry has \[2, 2, 4, 2, 8\], expected "
                               r"\[2, 2, 4, 2, 4\]"),
])
def test_foreign_entries_are_rejected(field, value, reason):
    """An intact entry that describes another chunk, model, dtype, tenant or shape than the
    reader expects is never served."""
    meta = make_meta()
    data = encode(make_record(meta))
    with pytest.raises(CorruptChunkError, match=reason):
        decode(data, dataclasses.replace(meta, **{field: value}))


def test_other_format_versions_and_malformed_headers_are_rejected(monkeypatch):
    from ragkv.cache.store import format as chunk_format

    meta = make_meta()
    record = make_record(meta)
    with monkeypatch.context() as m:
        m.setattr(chunk_format, "FORMAT_VERSION", 2)
        newer = encode(record)
    with pytest.raises(CorruptChunkError, match=r"format version 2 \(this reader: 1\)"):
        decode(newer, meta)
    payload = record.kv.numpy().tobytes()
    good = header_of(encode(record))
    with pytest.raises(CorruptChunkError, match="header is not an object"):
        decode(raw_entry([1, 2], payload), meta)  # type: ignore[arg-type]
    # Forged headers (a correct checksum) with malformed fields: rejected, never a crash.
    for shape in (5, True, "22428", None, {"2": 1}):
        with pytest.raises(CorruptChunkError, match="shape mismatch"):
            decode(raw_entry({**good, "shape": shape}, payload), meta)
    with pytest.raises(CorruptChunkError, match="truncated or padded"):
        decode(raw_entry({**good, "payload_bytes": "256"}, payload), meta)
    assert same_bytes(decode(raw_entry(good, payload), meta).kv, record.kv)


def test_every_single_bit_flip_and_truncation_is_caught():
    """Exhaustively, on a small entry: no damaged copy is served, and none raises anything
    but CorruptChunkError."""
    meta = make_meta(tokens=(9,), layer_shape=(1, 1, 2))
    data = encode(make_record(meta))
    for i in range(len(data)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[i] ^= 1 << bit
            with pytest.raises(CorruptChunkError):
                decode(bytes(damaged), meta)
    for n in range(len(data)):
        with pytest.raises(CorruptChunkError):
            decode(data[:n], meta)


# ---------------------------------------------------------------------------------- tiers


def test_tier_round_trip_and_write_once(tier):
    a, b = tier_record(1), tier_record(2)
    assert not tier.contains(a.meta.key)
    assert tier.get(a.meta.key, a.meta) is None
    assert tier.put(a) is True
    assert tier.contains(a.meta.key) and not tier.contains(b.meta.key)
    got = tier.get(a.meta.key, a.meta)
    assert got.meta == a.meta and same_bytes(got.kv, a.kv)
    # Write-once: another value under the same key is refused and the first one stays.
    impostor = ChunkRecord(a.meta, torch.zeros_like(a.kv))
    assert tier.put(impostor) is False
    assert same_bytes(tier.get(a.meta.key, a.meta).kv, a.kv)
    # A reader expecting another chunk under this key gets an error, not the KV.
    with pytest.raises(CorruptChunkError):
        tier.get(a.meta.key, dataclasses.replace(a.meta, tokens=b.meta.tokens))
    assert tier.put(b) is True
    tier.delete(a.meta.key)
    tier.delete(a.meta.key)  # deleting what is gone is fine
    assert not tier.contains(a.meta.key) and tier.get(a.meta.key, a.meta) is None
    assert tier.put(a) is True  # deleted: writable again
    assert same_bytes(tier.get(b.meta.key, b.meta).kv, b.kv)

    st = tier.stats()
    assert st.name == tier.name and st.available
    assert (st.hits, st.misses, st.writes, st.corrupt, st.errors) == (3, 2, 3, 0, 0)
    if tier.name == "host":
        entry_bytes = a.nbytes
        assert (st.entries, st.used_bytes, st.capacity_bytes) == (2, 2 * entry_bytes, 1 << 20)
    else:
        entry_bytes = len(encode(a))
        assert st.used_bytes == (2 if tier.name == "disk" else 3) * entry_bytes
        assert st.entries == (2 if tier.name == "disk" else -1)
    assert st.bytes_written == 3 * entry_bytes
    # The read that found another chunk raised CorruptChunkError: counted by the caller
    # (TieredChunkStore), not as a hit or a load here.
    assert st.bytes_read == 3 * entry_bytes
    assert st.loads == st.hits == 3
    assert sum(st.load_buckets) <= st.loads and len(st.load_buckets) == len(LOAD_BUCKETS)
    assert st.load_seconds >= 0


def test_load_histogram_counts(monkeypatch):
    """Loads land in the first bucket that bounds them; slower ones only in `loads`."""
    clock = iter([0.0, 0.0002, 1.0, 1.003, 2.0, 2.003, 3.0, 8.0])
    monkeypatch.setattr(host_tier, "time",
                        types.SimpleNamespace(perf_counter=lambda: next(clock)))
    tier = HostChunkStore(1 << 20)
    record = tier_record(1)
    tier.put(record)
    for _ in range(4):
        tier.get(record.meta.key, record.meta)
    st = tier.stats()
    assert st.loads == st.hits == 4
    expected = [0] * len(LOAD_BUCKETS)
    expected[0] = 1  # 0.2 ms <= 0.5 ms
    expected[LOAD_BUCKETS.index(0.005)] = 2  # 3 ms
    assert list(st.load_buckets) == expected  # the 5 s load is in no bucket
    assert st.load_seconds == pytest.approx(0.0002 + 0.003 + 0.003 + 5.0)


def test_host_tier_is_a_bounded_lru():
    records = [tier_record(i) for i in range(5)]
    size = records[0].nbytes
    tier = HostChunkStore(2 * size + size // 2)
    assert tier.put(records[0]) and tier.put(records[1])
    assert tier.get(records[0].meta.key, records[0].meta) is not None  # 0 is now the newest
    assert tier.put(records[2])  # drops 1, the least recently used
    assert [tier.contains(r.meta.key) for r in records[:3]] == [True, False, True]
    assert tier.put(records[3])  # drops 0
    assert [tier.contains(r.meta.key) for r in records[:4]] == [False, False, True, True]
    st = tier.stats()
    assert (st.entries, st.used_bytes, st.writes) == (2, 2 * size, 4)
    assert not HostChunkStore(size - 1).put(records[4])  # larger than the whole tier


def test_disk_tier_is_a_bounded_lru_that_survives_a_restart(tmp_path):
    path = str(tmp_path / "chunks")
    raw = RawDisk(path)
    records = [tier_record(i) for i in range(5)]
    size = len(encode(records[0]))
    tier = DiskChunkStore(path, 2 * size + size // 2)
    assert tier.put(records[0]) and tier.put(records[1])
    assert tier.get(records[0].meta.key, records[0].meta) is not None  # 0 is now the newest
    assert tier.put(records[2])  # deletes 1's file
    assert raw.stored() == {records[0].meta.key, records[2].meta.key}
    assert sorted(os.listdir(path)) == sorted(k + FILE_SUFFIX for k in raw.stored())  # no temps
    st = tier.stats()
    assert (st.entries, st.used_bytes, st.capacity_bytes) == (2, 2 * size, 2 * size + size // 2)

    # A second store on the directory (a restart, or another replica) sees the entries...
    other = DiskChunkStore(path, 1 << 20)
    assert other.stats().entries == 2 and other.stats().used_bytes == 2 * size
    got = other.get(records[2].meta.key, records[2].meta)
    assert same_bytes(got.kv, records[2].kv)
    assert other.put(records[0]) is False  # present: write-once across stores
    # ... and a file the first store wrote later, or deleted, after it started.
    assert tier.put(records[3])  # deletes 0's file (the first store's LRU)
    assert other.get(records[3].meta.key, records[3].meta) is not None
    assert other.get(records[0].meta.key, records[0].meta) is None
    assert other.stats().entries == 2  # 2 and 3

    assert not DiskChunkStore(path, size - 1).put(records[4])  # larger than the whole tier


def test_disk_tier_restarts_in_lru_order(tmp_path):
    """On start, a store over capacity deletes the least recently used files first, by
    modification time, which a read refreshes."""
    path = str(tmp_path / "chunks")
    raw = RawDisk(path)
    records = [tier_record(i) for i in range(3)]
    size = len(encode(records[0]))
    tier = DiskChunkStore(path, 1 << 20)
    for record in records:
        assert tier.put(record)
    # Neither write order nor key order: 1 is the oldest, then 2, then 0.
    for i, seconds in ((0, 3), (1, 1), (2, 2)):
        os.utime(raw.file(records[i].meta.key), ns=(seconds * 10**9,) * 2)
    reader = DiskChunkStore(path, 1 << 20)
    assert reader.get(records[1].meta.key, records[1].meta) is not None  # refreshes 1
    small = DiskChunkStore(path, 2 * size + size // 2)
    assert raw.stored() == {records[0].meta.key, records[1].meta.key}
    assert small.stats().entries == 2 and small.stats().used_bytes == 2 * size


def test_redis_tier_uses_write_once_values(redis_server):
    raw = RawRedis(redis_server.url)
    tier = RedisChunkStore(redis_server.url)
    a = tier_record(1)
    assert tier.put(a)
    assert raw.read(a.meta.key) == encode(a)
    raw.write(a.meta.key, b"garbage")  # another writer's damage
    assert tier.put(a) is False and raw.read(a.meta.key) == b"garbage"
    with pytest.raises(CorruptChunkError, match="bad magic"):
        tier.get(a.meta.key, a.meta)
    tier.close()


def test_redis_refusals_are_failed_writes_not_outages(redis_server):
    """A full Redis (noeviction) or a value over its size limit fails the write alone: the
    tier stays up and keeps serving reads."""
    import redis

    tier = RedisChunkStore(redis_server.url)
    a, b = tier_record(1), tier_record(2)
    assert tier.put(a)
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", client.info("memory")["used_memory"] + 1)
    assert tier.put(b) is False
    stats = tier.stats()
    assert (stats.errors, stats.writes, stats.available) == (1, 1, True)
    assert torch.equal(tier.get(a.meta.key, a.meta).kv, a.kv)  # reads still served
    client.config_set("maxmemory", 0)
    tier.max_value_bytes = len(encode(b)) - 1
    assert tier.put(b) is False
    stats = tier.stats()
    assert (stats.errors, stats.writes, stats.available) == (2, 1, True)
    assert not tier.contains(b.meta.key)
    tier.max_value_bytes = len(encode(b))
    assert tier.put(b) and tier.stats().writes == 2
    client.close()
    tier.close()


def test_tiered_store_skips_damaged_entries_and_repairs_earlier_tiers(tmp_path):
    first, second = RawDisk(str(tmp_path / "a")), RawDisk(str(tmp_path / "b"))
    tiers = [DiskChunkStore(first.path, 1 << 20), DiskChunkStore(second.path, 1 << 20)]
    store = TieredChunkStore(tiers)
    a, b = tier_record(1), tier_record(2)
    store.put(a)
    store.flush()
    assert first.stored() == second.stored() == {a.meta.key}
    first.write(a.meta.key, flip(first.read(a.meta.key), -30))
    record, name = store.get(a.meta)
    assert name == "disk" and same_bytes(record.kv, a.kv)
    store.flush()
    assert first.read(a.meta.key) == encode(a)  # deleted, then refilled from the second tier
    assert [t.corrupt for t in store.stats()] == [1, 0]
    assert [t.hits for t in store.stats()] == [0, 1]
    assert store.get(b.meta) is None
    assert store.contains(a.meta.key) and not store.contains(b.meta.key)
    store.delete(a.meta.key)
    assert not store.contains(a.meta.key) and first.stored() == second.stored() == set()
    store.close()


class _BlockingTier(ChunkStore):
    name = "slow"

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()
        self.written: list[str] = []

    def get(self, key, expect):
        return None

    def put(self, record):
        if record.meta.key == "ff":
            raise RuntimeError("a bug in a tier")
        self.started.set()
        self.release.wait(10)
        self.written.append(record.meta.key)
        return True

    def contains(self, key):
        return key in self.written

    def delete(self, key):
        pass


def test_write_through_drops_writes_beyond_the_queue_and_survives_a_failing_tier(monkeypatch):
    monkeypatch.setattr(tiered_module, "MAX_PENDING_WRITES", 2)
    tier = _BlockingTier()
    store = TieredChunkStore([tier])
    meta = make_meta()

    def record(key):
        return ChunkRecord(dataclasses.replace(meta, key=key), torch.zeros(meta.shape))

    store.put(record("00"))
    assert tier.started.wait(10)  # the writer holds "00"; the queue is empty
    for key in ("01", "02", "03", "04"):
        store.put(record(key))
    assert store.dropped_writes == 2
    tier.release.set()
    store.flush()
    store.put(record("ff"))  # raises in the writer thread: counted, the writer goes on
    store.flush()
    store.put(record("05"))
    store.flush()
    assert tier.written == ["00", "01", "02", "05"]
    assert tier.stats().errors == 1


class _FailingTier(ChunkStore):
    """A tier whose backend raises what real ones can: an I/O error on read, a read-only
    directory on delete, garbage on read."""

    name = "failing"

    def __init__(self, data: bytes | None = None) -> None:
        super().__init__()
        self.data = data

    def get(self, key, expect):
        if self.data is None:
            raise OSError(5, "Input/output error")
        return decode(self.data, expect)

    def put(self, record):
        raise OSError(30, "Read-only file system")

    def contains(self, key):
        return False

    def delete(self, key):
        raise OSError(30, "Read-only file system")


def test_no_tier_problem_escapes_the_store(tmp_path, caplog):
    """Whatever a tier raises, the store answers a miss (or the next tier's entry) and counts
    it: a store problem never fails a request."""
    a = tier_record(1)
    behind = HostChunkStore(1 << 20)
    behind.put(a)
    # JSON too deeply nested to parse: RecursionError, not ValueError (deep enough for any
    # Python: 3.13 and late 3.12 releases parse 5,000 levels within their C recursion limit)
    nested = b"[" * 60_000  # under the 64 KiB header limit
    garbage = MAGIC + len(nested).to_bytes(4, "little") + nested + bytes(4)
    broken, damaged = _FailingTier(), _FailingTier(garbage)
    store = TieredChunkStore([broken, damaged, behind])
    with caplog.at_level(logging.WARNING, logger="ragkv"):
        record, name = store.get(a.meta)
        store.flush()  # the hit is copied back to both shared tiers: both writes fail
    assert name == "host" and torch.equal(record.kv, a.kv)
    assert (broken.stats().errors, broken.stats().misses) == (2, 1)
    # The damaged entry is counted corrupt; deleting it fails (read-only): an error.
    assert (damaged.stats().corrupt, damaged.stats().errors) == (1, 2)
    assert "unreadable header: RecursionError" in caplog.text
    assert "Input/output error" in caplog.text and "Read-only file system" in caplog.text
    store.delete(a.meta.key)
    assert not behind.contains(a.meta.key)
    assert broken.stats().errors == damaged.stats().errors == 3
    store.put(a)  # the writer thread counts the failing writes and goes on
    store.flush()
    assert broken.stats().errors == damaged.stats().errors == 4
    store.close()


def test_disk_tier_files_are_readable_by_other_users_and_counted_once(tmp_path, monkeypatch):
    tier = DiskChunkStore(str(tmp_path), 1 << 20)
    a = tier_record(1)
    size = len(encode(a))
    replace = os.replace

    def replace_then_read(src, dst):  # a reader lands between the rename and the index
        replace(src, dst)
        tier.get(a.meta.key, a.meta)

    monkeypatch.setattr(disk_tier.os, "replace", replace_then_read)
    assert tier.put(a)
    assert (tier.stats().used_bytes, tier.stats().entries) == (size, 1)
    assert os.stat(RawDisk(str(tmp_path)).file(a.meta.key)).st_mode & 0o777 == 0o644
    tier.delete(a.meta.key)
    assert (tier.stats().used_bytes, tier.stats().entries) == (0, 0)


def test_write_queue_is_bounded_in_bytes(monkeypatch):
    monkeypatch.setattr(tiered_module, "MAX_PENDING_BYTES", 2 * tier_record(0).nbytes)
    tier = _BlockingTier()
    store = TieredChunkStore([tier])
    store.put(tier_record(0))
    assert tier.started.wait(10)  # the writer holds record 0; nothing waits
    assert store.has_room(2 * tier_record(0).nbytes)
    for i in (1, 2, 3):
        store.put(tier_record(i))
    assert store.dropped_writes == 1 and not store.has_room(1)
    tier.release.set()
    store.flush()
    assert len(tier.written) == 3 and store.has_room(2 * tier_record(0).nbytes)


@pytest.mark.parametrize("url, message", [
    ("redis://127.0.0.1:6379/0?decode_responses=true", "decode_responses must be off"),
    ("redis://127.0.0.1:abc/0", "chunk_store: bad Redis URL 'redis://127.0.0.1:abc/0'"),
    ("redis://127.0.0.1:6379/x", "the database must be a number"),
])
def test_bad_redis_urls(url, message):
    require_redis_package()
    with pytest.raises(ValueError, match=re.escape(message)):
        RedisChunkStore(url)


def test_redis_retry_interval_doubles_while_it_stays_down(monkeypatch):
    """A dead (or hung) Redis is asked once per retry interval, and the interval doubles up to
    a bound, so the engine thread pays ever fewer timeouts; a success resets it."""
    require_redis_package()
    clock = [1000.0]
    monkeypatch.setattr(redis_tier.time, "monotonic", lambda: clock[0])
    tier = RedisChunkStore("redis://127.0.0.1:1/0", timeout_seconds=0.2, retry_seconds=2.0)
    a = tier_record(1)
    pauses = []
    for _ in range(8):
        assert tier.get(a.meta.key, a.meta) is None
        pauses.append(tier._down_until - clock[0])
        assert tier.get(a.meta.key, a.meta) is None  # resting: not asked
        assert tier.put(a) is False  # not even encoded
        clock[0] = tier._down_until + 0.001
    assert pauses == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert tier.stats().errors == 8 and not tier.stats().available
    tier.close()


def test_parse_size_and_build():
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size(" 1.5 KiB ") == 1536
    assert parse_size("1048576") == 1 << 20
    assert parse_size("2kb") == 2000
    for bad in ("abc", "-1", "1XB", "", "GiB"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)
    with pytest.raises(ValueError, match="must be positive"):
        parse_size("0.1")
    assert build_chunk_store(None) is None and build_chunk_store("  ") is None
    with pytest.raises(ValueError, match="no tier given"):
        TieredChunkStore([])


def test_build_chains_tiers_in_order(tmp_path):
    require_redis_package()
    # Building connects to nothing: the Redis tier connects on its first call.
    store = build_chunk_store(f"redis://127.0.0.1:1/0, disk:{tmp_path}/d:1MiB ,host:2MiB")
    assert [type(t) for t in store.tiers] == [RedisChunkStore, DiskChunkStore, HostChunkStore]
    assert [t.shared for t in store.tiers] == [True, True, False]
    assert store.tiers[1].capacity_bytes == 1 << 20 and store.tiers[2].capacity_bytes == 2 << 20
    assert store.tiers[1].path == str(tmp_path / "d") and os.path.isdir(tmp_path / "d")
    assert store.has_host_tier and store.has_shared_tier
    assert not build_chunk_store("host:1MiB").has_shared_tier
    store.close()


# ------------------------------------------------------------------- requests from the store


def test_host_tier_keeps_evicted_chunks(llama):
    """Chunks evicted from a small chunk region are demoted to the host tier and come back
    from it as hits, exactly."""
    path, hf = llama
    A, B, C, D, E = DOCS[:5]
    llm = make_llm(path, kv_cache_tokens=1024, chunk_cache_tokens=45, chunk_store="host:64MiB")
    run(llm, hf, [rag(S, [A, B], Q1)], ["MM"])
    run(llm, hf, [rag(S, [C, D], Q2)], ["MM"])  # evicts A and B into the host tier
    stats = llm.get_chunk_cache_stats()
    assert stats.evictions == 2 and stats.store_hits == 0
    host = tier_stats(llm, "host")
    assert (host.writes, host.entries, host.hits, host.misses) == (2, 2, 0, 4)
    assert host.used_bytes == 2 * 2 * 2 * 20 * 2 * 16 * 4  # 2 chunks of [2, 2, 20, 2, 16] fp32

    # Reordered, with another question: both come back from the host tier, evicting C and D.
    run(llm, hf, [rag(S, [B, A], Q1)], ["HH"])
    stats = llm.get_chunk_cache_stats()
    assert (stats.store_hits, stats.store_hit_tokens, stats.evictions) == (2, 40, 4)
    host = tier_stats(llm, "host")
    assert (host.writes, host.hits, host.loads) == (4, 2, 2)
    # Mixed: C from the host tier, E computed.
    run(llm, hf, [rag(S, [C, E], Q1)], ["HM"])
    stats = llm.get_chunk_cache_stats()
    assert stats.store_hits == 3 and stats.cached_chunks == 2
    # Only evictions reach the host tier (never write-through), and a chunk it holds is not
    # written again when evicted again.
    host = tier_stats(llm, "host")
    assert (host.writes, host.entries, host.hits, host.misses) == (4, 4, 3, 5)
    llm.check_integrity()
    # clear_chunk_cache() drops the host tier's copies too (it is this process's memory), and
    # does not demote what it drops: everything misses again.
    assert llm.clear_chunk_cache() == 2
    assert tier_stats(llm, "host").entries == 0
    run(llm, hf, [rag(S, [A, C], Q2)], ["MM"])
    llm.check_integrity()


def test_shared_tier_serves_a_later_engine(shared_tier, llama):
    name, spec, raw = shared_tier
    path, hf = llama
    A, B, C, D = DOCS[:4]
    first = make_llm(path, kv_cache_tokens=1024, chunk_store=spec)
    run(first, hf, [rag(S, [A, B], Q1), rag(S, [C], Q2)], ["MM", "M"])
    first.engine.flush_chunk_store()
    tier = tier_stats(first, name)
    assert (tier.writes, tier.hits, tier.misses, tier.corrupt, tier.errors) == (3, 0, 3, 0, 0)
    keys = first.engine.chunk_keys(rag(S, [A, B, C, D], Q1))
    assert raw.stored() == set(keys[:3])
    fingerprint = first.engine.checkpoint.fingerprint
    for key, doc in zip(keys[:3], (A, B, C), strict=True):
        data = raw.read(key)
        meta = meta_of(data)
        assert (meta.key, meta.model, meta.tokens) == (key, fingerprint, token_hash(tuple(doc)))
        assert decode(data, meta).kv.shape == (2, 2, 20, 2, 16)
    entry_bytes = sum(len(raw.read(k)) for k in keys[:3])
    assert tier.bytes_written == entry_bytes
    first.engine.close()
    first.check_integrity()

    # A fresh engine on the same store: stored chunks hit in any order and combination.
    second = make_llm(path, kv_cache_tokens=1024, chunk_store=spec)
    run(second, hf, [rag(S, [C, A], Q2), rag(S, [B, D], Q1)], ["HH", "HM"])
    stats = second.get_chunk_cache_stats()
    assert (stats.store_hits, stats.store_hit_tokens, stats.store_dropped_writes) == (3, 60, 0)
    tier = tier_stats(second, name)
    assert (tier.hits, tier.misses, tier.loads, tier.bytes_read) == (3, 1, 3, entry_bytes)
    # Now in the pool: plain pool hits, the store is not asked again.
    run(second, hf, [rag(S, [D, B, C, A], Q2)], ["HHHH"])
    assert tier_stats(second, name).hits == 3
    assert second.get_chunk_cache_stats().store_hits == 3
    # Only the computed chunk was written through; loaded ones are not written back.
    second.engine.flush_chunk_store()
    assert tier_stats(second, name).writes == 1 and raw.stored() == set(keys)
    # Another tenant (cache salt) or another system prompt shares nothing.
    run(second, hf, [rag(S, [A], Q1, salt="tenant"), rag(S[:5], [B], Q1)], ["M", "M"])
    assert second.get_chunk_cache_stats().store_hits == 3
    second.engine.close()
    second.check_integrity()


def held_read(llama, tmp_path, monkeypatch):
    """An engine on a disk tier where an earlier engine stored DOCS[0] (after S), whose read
    of that chunk hangs until `release` is set (`reading` is set when it starts; every other
    read goes through): (engine, reading, release)."""
    path, hf = llama
    spec = f"disk:{tmp_path / 'chunks'}:1MiB"
    first = make_llm(path, kv_cache_tokens=1024, chunk_store=spec)
    run(first, hf, [rag(S, [DOCS[0]], Q1)], ["M"])
    first.engine.close()

    llm = make_llm(path, kv_cache_tokens=1024, chunk_store=spec)
    disk = llm.engine.chunk_store.tiers[0]
    reading, release = threading.Event(), threading.Event()
    original = type(disk).get
    stored = llm.engine.chunk_keys(rag(S, [DOCS[0]], Q2))[0]

    def slow_get(self, key, expect):
        if key == stored:
            reading.set()
            assert release.wait(60), "the read was never released"
        return original(self, key, expect)

    monkeypatch.setattr(type(disk), "get", slow_get)
    return llm, reading, release


def test_a_slow_store_read_never_blocks_the_other_requests(llama, tmp_path, monkeypatch):
    """A shared tier's read runs off the engine thread: while it hangs, the request waiting
    for the chunk holds its place and every other request is planned, computed and finished;
    when the read lands, the waiting request gets the stored chunk (a store hit, no compute)
    and the same tokens as the reference."""
    _, hf = llama
    llm, reading, release = held_read(llama, tmp_path, monkeypatch)
    engine = llm.engine
    engine.add_request(rag(S, [DOCS[0]], Q2), GREEDY, request_id="stored")
    other = [rag(S, [DOCS[1]], Q1), plain(random_prompt(9, seed=730))]
    for i, prompt in enumerate(other):
        engine.add_request(prompt, GREEDY, request_id=f"other{i}")
    done = {}
    for _ in range(500):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        if {"other0", "other1"} <= set(done):
            break
    assert reading.is_set() and "stored" not in done and {"other0", "other1"} <= set(done)
    assert engine.has_unfinished_requests()
    release.set()
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    check_outputs(hf, [rag(S, [DOCS[0]], Q2), *other],
                  [done["stored"], done["other0"], done["other1"]], llm)
    assert done["stored"].metrics.num_chunk_hits == 1
    stats = llm.get_chunk_cache_stats()
    assert stats.store_hits == 1 and tier_stats(llm, "disk").loads == 1
    llm.engine.close()
    llm.check_integrity()


def test_a_missing_chunk_is_read_once_however_long_its_neighbour_takes(llama, tmp_path,
                                                                         monkeypatch):
    """A request waits on one chunk's slow read while the read of its other chunk (not
    stored) lands at once: that answer waits for the request as many steps as the slow read
    takes, so the missing chunk is asked for once and counted as one miss (seen on a loaded
    CI machine as a second miss when the answer aged out after a few steps)."""
    _, hf = llama
    llm, _, release = held_read(llama, tmp_path, monkeypatch)
    prompt = rag(S, [DOCS[0], DOCS[1]], Q2)
    engine = llm.engine
    engine.add_request(prompt, GREEDY, request_id="waiting")
    longer = dataclasses.replace(GREEDY, max_tokens=16)
    engine.add_request(plain(random_prompt(9, seed=731)), longer, request_id="other")
    done = {}
    steps = 0
    while "other" not in done:
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
    assert steps > 12 and "waiting" not in done  # many plannings while the read hangs
    release.set()
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    check_outputs(hf, [prompt], [done["waiting"]], llm)
    assert (done["waiting"].metrics.num_chunk_hits, done["waiting"].metrics.num_chunk_misses) \
        == (1, 1)
    tier = tier_stats(llm, "disk")
    assert (tier.hits, tier.misses, tier.loads) == (1, 1, 1)
    llm.engine.close()
    llm.check_integrity()


def test_a_request_reads_its_stored_chunks_at_once(llama, tmp_path, monkeypatch):
    """A request missing several chunks in the pool asks the shared tier for all of them when
    it first waits, so the reads overlap (each read here waits for the others to start: one
    at a time, none would finish); each is then promoted and counted once, at its lookup."""
    path, hf = llama
    spec = f"disk:{tmp_path / 'chunks'}:1MiB"
    first = make_llm(path, kv_cache_tokens=1024, chunk_store=spec)
    run(first, hf, [rag(S, DOCS[:3], Q1)], ["MMM"])
    first.engine.close()

    llm = make_llm(path, kv_cache_tokens=1024, chunk_store=spec)
    disk = llm.engine.chunk_store.tiers[0]
    together = threading.Barrier(3, timeout=30)
    original = type(disk).get

    def get_together(self, key, expect):
        together.wait()
        return original(self, key, expect)

    monkeypatch.setattr(type(disk), "get", get_together)
    run(llm, hf, [rag(S, DOCS[:3][::-1], Q2)], ["HHH"])
    stats = llm.get_chunk_cache_stats()
    assert (stats.lookups, stats.hits, stats.store_hits) == (3, 3, 3)
    assert tier_stats(llm, "disk").loads == 3
    llm.engine.close()


def test_a_read_cancelled_by_close_is_a_miss(llama, tmp_path, monkeypatch):
    """A store read that ends without a result (cancelled when the store closes) is a miss
    for the request that waited for it, never an error of the step."""
    from concurrent.futures import Future

    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024, chunk_store=f"disk:{tmp_path / 'c'}:1MiB")
    cancelled = Future()
    cancelled.cancel()
    monkeypatch.setattr(llm.engine.chunk_store, "load", lambda meta: cancelled)
    run(llm, hf, [rag(S, [DOCS[0]], Q1)], ["M"])
    assert llm.get_chunk_cache_stats().store_hits == 0
    llm.engine.close()


def test_a_redis_hit_fills_the_disk_tier_before_it(llama, redis_server, tmp_path):
    path, hf = llama
    A, B, C = DOCS[:3]
    disk = RawDisk(str(tmp_path / "chunks"))
    spec = f"host:64MiB,disk:{disk.path}:1MiB,{redis_server.url}"
    producer = make_llm(path, kv_cache_tokens=1024, chunk_store=redis_server.url)
    run(producer, hf, [rag(S, [A, B], Q1)], ["MM"])
    producer.engine.close()

    llm = make_llm(path, kv_cache_tokens=1024, chunk_store=spec)
    run(llm, hf, [rag(S, [B, A, C], Q2)], ["HHM"])
    llm.engine.flush_chunk_store()
    stats = llm.get_chunk_cache_stats()
    assert [t.name for t in stats.store] == ["host", "disk", "redis"]
    assert [t.hits for t in stats.store] == [0, 0, 2]
    assert [t.misses for t in stats.store] == [3, 3, 1]
    # The disk tier got copies of the Redis hits, and both shared tiers the computed chunk.
    keys = llm.engine.chunk_keys(rag(S, [A, B, C], Q1))
    assert disk.stored() == set(keys)
    assert RawRedis(redis_server.url).stored() == set(keys)
    assert [t.writes for t in stats.store] == [0, 3, 1]
    llm.engine.close()
    llm.check_integrity()

    disk_only = make_llm(path, kv_cache_tokens=1024, chunk_store=f"disk:{disk.path}:1MiB")
    run(disk_only, hf, [rag(S, [C, A, B], Q1)], ["HHH"])
    assert tier_stats(disk_only, "disk").hits == 3
    disk_only.check_integrity()


def test_damaged_and_foreign_entries_are_recomputed(shared_tier, llama, checkpoint, hf_model,
                                                    caplog):
    name, spec, raw = shared_tier
    path, hf = llama
    A, B, C, D, E = DOCS[:5]
    caplog.set_level(logging.WARNING, logger="ragkv")
    writer = make_llm(path, kv_cache_tokens=1024, chunk_store=spec)
    run(writer, hf, [rag(S, [A, B, C, D, E], Q1)], ["MMMMM"])
    writer.engine.close()
    keys = writer.engine.chunk_keys(rag(S, [A, B, C, D, E], Q1))
    original = {k: raw.read(k) for k in keys}

    # Another family of the same KV shape computes C and D into the same store.
    other_path = checkpoint("qwen2")
    other = make_llm(other_path, kv_cache_tokens=1024, chunk_store=spec)
    run(other, hf_model(other_path), [rag(S, [C, D], Q1)], ["MM"])
    other.engine.close()
    other_keys = other.engine.chunk_keys(rag(S, [C, D], Q1))
    assert not set(other_keys) & set(keys)  # the model fingerprint is in the key
    foreign_c = raw.read(other_keys[0])
    assert meta_of(foreign_c).shape == meta_of(original[keys[2]]).shape

    kA, kB, kC, kD, kE = keys
    raw.write(kA, flip(original[kA], len(original[kA]) - 100))  # a flipped payload byte
    raw.write(kB, original[kB][:len(original[kB]) // 2])  # truncated
    raw.write(kC, foreign_c)  # another model's entry under this key
    # Another model's KV forged under this key (it would even pass a checksum).
    raw.write(kD, reencode(raw.read(other_keys[1]), key=kD))

    reader = make_llm(path, kv_cache_tokens=1024, chunk_store=spec)
    out = run(reader, hf, [rag(S, [E, D, C, B, A], Q2)], ["HMMMM"])[0]
    assert out.num_cached_tokens == len(E)
    tier = tier_stats(reader, name)
    assert (tier.corrupt, tier.hits, tier.misses, tier.errors) == (4, 1, 0, 0)
    assert reader.get_chunk_cache_stats().store_hits == 1
    for reason in ("checksum mismatch", "truncated or padded entry",
                   "key mismatch", "model mismatch"):
        assert reason in caplog.text
    assert "unusable" in caplog.text

    # The damaged entries were deleted and the recomputed chunks written through again.
    reader.engine.flush_chunk_store()
    assert tier_stats(reader, name).writes == 4
    fingerprint = reader.engine.checkpoint.fingerprint
    for key in keys:
        data = raw.read(key)
        meta = meta_of(data)
        assert meta.key == key and meta.model == fingerprint
        assert torch.allclose(decode(data, meta).kv, decode(original[key], meta).kv, atol=1e-5)
    reader.engine.close()
    reader.check_integrity()

    # A third engine now finds every entry intact.
    again = make_llm(path, kv_cache_tokens=1024, chunk_store=spec)
    run(again, hf, [rag(S, [A, B, C, D], Q1)], ["HHHH"])
    assert tier_stats(again, name).corrupt == 0
    again.engine.close()
    again.check_integrity()


_PRODUCER = """
import json, sys
from ragkv import LLM, RAGPrompt, SamplingParams
path, url, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompts = [RAGPrompt(*p) for p in json.loads(sys.argv[4])]
llm = LLM(path, kv_cache_tokens=1024, chunk_store=url, position_strategy="shared")
params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
outs = llm.generate(prompts, params, use_tqdm=False)
llm.engine.flush_chunk_store()
stats = llm.get_chunk_cache_stats()
llm.engine.close()
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "misses": stats.misses,
                  "writes": stats.store[0].writes, "keys": llm.engine.chunk_keys(prompts[0])}))
"""


def test_two_engine_processes_share_redis(llama, redis_server):
    path, hf = llama
    A, B, C = DOCS[:3]
    produced = [(S, [A, B], Q1), (S, [C], Q2)]
    proc = subprocess.run(
        [sys.executable, "-c", _PRODUCER, path, redis_server.url, str(MAX_TOKENS),
         json.dumps(produced)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (report["misses"], report["writes"]) == (3, 3)

    llm = make_llm(path, kv_cache_tokens=1024, chunk_store=redis_server.url)
    # The same chunk keys in both processes: the fingerprint is over the weights' content.
    assert llm.engine.chunk_keys(rag(S, [A, B], Q1)) == report["keys"]
    outs = run(llm, hf, [rag(S, [A, B], Q1), rag(S, [C, A], Q2)], ["HH", "HH"])
    assert outs[0].outputs[0].token_ids == report["tokens"][0]
    stats = llm.get_chunk_cache_stats()
    assert stats.store_hits == 3 and tier_stats(llm, "redis").hits == 3
    # Only the computed chunk went into Redis: exactly the first process's three entries.
    assert len(RawRedis(redis_server.url).stored()) == 3
    llm.engine.close()
    llm.check_integrity()


def test_redis_outage_falls_back_to_local_compute(llama, redis_server, caplog):
    path, hf = llama
    A, B, C, D, E = DOCS[:5]
    caplog.set_level(logging.WARNING, logger="ragkv")
    llm = make_llm(path, kv_cache_tokens=1024, chunk_store=redis_server.url)
    redis_tier = llm.engine.chunk_store.tiers[0]
    redis_tier.retry_seconds = 0.1
    run(llm, hf, [rag(S, [A, B], Q1)], ["MM"])
    llm.engine.flush_chunk_store()
    assert tier_stats(llm, "redis").writes == 2

    redis_server.stop()
    # Requests still run: misses computed locally, pool hits unaffected.
    run(llm, hf, [rag(S, [C, A], Q2), rag(S, [D], Q1)], ["MH", "M"])
    llm.engine.flush_chunk_store()
    tier = tier_stats(llm, "redis")
    assert tier.errors > 0 and not tier.available
    assert tier.writes == 2 and tier.hits == 0
    assert "unavailable" in caplog.text
    llm.check_integrity()

    redis_server.start()  # empty again
    deadline = time.monotonic() + 30
    while not redis_tier.available:  # the next call after retry_seconds reconnects
        assert time.monotonic() < deadline, "the Redis tier did not reconnect"
        time.sleep(0.05)
        redis_tier.contains("00")
    assert "is back" in caplog.text
    run(llm, hf, [rag(S, [E, B], Q1)], ["MH"])
    llm.engine.flush_chunk_store()
    assert tier_stats(llm, "redis").writes == 3 and tier_stats(llm, "redis").available
    llm.engine.close()

    # A fresh engine gets hits again: E was written after the restart (C, computed during the
    # outage, and A, B, lost with the old server, are not there).
    fresh = make_llm(path, kv_cache_tokens=1024, chunk_store=redis_server.url)
    run(fresh, hf, [rag(S, [E, C], Q2)], ["HM"])
    assert fresh.get_chunk_cache_stats().store_hits == 1
    fresh.engine.close()
    fresh.check_integrity()


# ------------------------------------------------------------------------------ sleep/wake


@pytest.mark.parametrize("chunk_store", [None, "host:64MiB"])
def test_sleep_and_wake_up_keep_cached_chunks(chunk_store, llama, monkeypatch):
    path, hf = llama
    A, B, C, D = DOCS[:4]
    llm = make_llm(path, kv_cache_tokens=1024, chunk_store=chunk_store)
    prompts = [rag(S, [A, B], Q1), rag(S, [C], Q2)]
    outs = run(llm, hf, prompts, ["MM", "M"])
    warm = run(llm, hf, [rag(S, [B], Q1)], ["H"])[0]
    assert warm.metrics.num_prefix_cached_tokens == len(S)

    # Refused while a request is unfinished; then it finishes normally.
    llm.engine.add_request(rag(S, [D], Q1), GREEDY)
    with pytest.raises(RuntimeError, match="unfinished requests"):
        llm.sleep()
    assert not llm.is_sleeping()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    with pytest.raises(ValueError, match="sleep level 2 is not supported"):
        llm.sleep(level=2)
    assert not llm.is_sleeping()

    llm.sleep()
    assert llm.is_sleeping() and llm.engine.pool.released
    stats = llm.get_chunk_cache_stats()
    assert stats.cached_chunks == 0 and stats.used_tokens == 0
    llm.check_integrity()
    llm.sleep()  # already asleep: nothing happens
    with pytest.raises(RuntimeError, match=r"asleep: call wake_up\(\)"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="wake_up tags must be 'weights' or 'kv_cache'"):
        llm.wake_up(tags=["bogus"])
    llm.wake_up(tags=["weights"])  # the weights never left; the KV cache stays asleep
    assert llm.is_sleeping()

    # The pool comes back as NaN: only what wake_up restores may be read.
    pool = llm.engine.pool
    restore = pool.restore_memory

    def poisoned():
        restore()
        pool.kv.fill_(float("nan"))
        pool.kv[:, :, 0] = 0.0

    monkeypatch.setattr(pool, "restore_memory", poisoned)
    llm.wake_up(tags=["kv_cache", "weights"])
    assert not llm.is_sleeping() and not pool.released
    stats = llm.get_chunk_cache_stats()
    assert stats.cached_chunks == 4 and stats.used_tokens == 80
    llm.check_integrity()
    llm.wake_up()  # awake: nothing happens

    # Every chunk hits in the pool as before; the prefix cache was dropped.
    again = run(llm, hf, prompts[:1], ["HH"])[0]
    assert again.metrics.num_prefix_cached_tokens == 0
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    run(llm, hf, [prompts[1], rag(S, [D, A], Q2)], ["H", "HH"])
    stats = llm.get_chunk_cache_stats()
    assert stats.store_hits == 0 and stats.evictions == 0
    llm.check_integrity()


def test_a_planned_chunk_evicted_since_comes_back_from_the_store():
    """A request re-binding a chunk it looked up before (its plan rolled back, or preempted)
    finds it in the host tier if it was evicted meanwhile, instead of recomputing it."""
    from ragkv.cache.chunk_cache import ChunkCache
    from ragkv.cache.chunk_key import ChunkKey
    from ragkv.cache.kv_pool import KVPool, SlotAllocator

    pool = KVPool(2, 64, 2, 16, torch.float32, torch.device("cpu"))
    store = build_chunk_store("host:1MiB")
    cache = ChunkCache(SlotAllocator(1, 33), store=store, pool=pool, model="m")
    chunk = ChunkKey(b"k" * 32, "ns", (1, 2), tuple(range(20)))
    assert cache.lookup(chunk) is None
    entry = cache.reserve(chunk)
    pool.write(entry.slots, torch.randn(2, 2, 20, 2, 16), 0)
    kv = pool.read(entry.slots)[0]
    cache.complete(entry)
    cache.unpin(entry)
    assert cache.evict(20) == 20 and cache.find(chunk) is None
    back = cache.find_or_load(chunk)
    assert back is not None and torch.equal(pool.read(back.slots)[0], kv)
    assert cache.stats().store_hits == 1 and cache.stats().lookups == 1  # uncounted lookup
    cache.check_integrity()


def test_clear_while_asleep_sticks(llama):
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024)
    run(llm, hf, [rag(S, DOCS[:2], Q1)], ["MM"])
    llm.sleep()
    assert llm.clear_chunk_cache() == 2  # the offloaded chunks
    llm.wake_up()
    run(llm, hf, [rag(S, DOCS[:2], Q2)], ["MM"])
    llm.check_integrity()


def test_sleep_without_a_chunk_cache(llama):
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024, enable_chunk_cache=False)
    prompt = rag(S, [DOCS[0]], Q1)
    first = run(llm, hf, [prompt])[0]
    assert run(llm, hf, [prompt])[0].num_cached_tokens == len(S)  # from the prefix cache
    llm.sleep()
    assert llm.is_sleeping()
    llm.wake_up()
    again = run(llm, hf, [prompt])[0]
    assert again.num_cached_tokens == 0  # nothing survives: the prefix cache was dropped
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.check_integrity()


# ---------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("spec, message", [
    ("host:abc", "chunk_store: 'abc' is not a size (e.g. 8GiB, 500MB, 1048576)"),
    ("host:0", "chunk_store: size '0' must be positive"),
    ("disk:/tmp/x", "chunk_store: 'disk:/tmp/x' must be disk:PATH:SIZE"),
    ("disk:/tmp/x:", "chunk_store: '' is not a size"),
    ("ftp://x", "chunk_store: unknown tier 'ftp://x'; tiers are host:SIZE, disk:PATH:SIZE and "
                "redis://HOST:PORT/DB"),
    ("host:1GiB,host:2GiB", "chunk_store: at most one host tier"),
    ("host:1GiB,", "chunk_store: unknown tier ''"),
    (5, "chunk_store must be a string, got 5"),
])
def test_bad_chunk_store_settings(spec, message, llama):
    path, _ = llama
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(path, chunk_store=spec)


def test_unusable_disk_tier_directory(llama, tmp_path):
    path, _ = llama
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=re.escape(
            f"chunk_store: cannot use {blocker} as a disk tier: File exists")):
        LLM(path, chunk_store=f"disk:{blocker}:1MiB")
    with pytest.raises(ValueError, match=re.escape(
            f"chunk_store: cannot use {blocker}/sub as a disk tier: Not a directory")):
        LLM(path, chunk_store=f"disk:{blocker}/sub:1MiB")


def test_chunk_store_needs_the_chunk_cache(llama, tmp_path):
    path, _ = llama
    with pytest.raises(ValueError, match=re.escape(
            "chunk_store backs the chunk cache: it needs enable_chunk_cache=True")):
        LLM(path, chunk_store="host:1MiB", enable_chunk_cache=False)
    assert not os.path.exists(tmp_path / "never")
    with pytest.raises(ValueError, match="chunk_store"):
        LLM(path, chunk_store=f"disk:{tmp_path}/never:1MiB", enable_chunk_cache=False)
    assert not os.path.exists(tmp_path / "never")  # refused before anything was created


def test_inspect_checkpoint_fingerprints_content(checkpoint):
    """Two families (same KV shape) never share a namespace: the fingerprint is over the
    config and the weights' content."""
    a, b = checkpoint("llama"), checkpoint("qwen2")
    assert inspect_checkpoint(a).fingerprint == inspect_checkpoint(a).fingerprint
    assert inspect_checkpoint(a).fingerprint != inspect_checkpoint(b).fingerprint

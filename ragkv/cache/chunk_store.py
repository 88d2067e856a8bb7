"""Chunk KV beyond the pool: the `ChunkStore` interface and the chain of tiers behind the
chunk cache (DESIGN §3, "Beyond the pool").

A tier keeps chunk KV records (chunk_format.py) under the hex of their chunk-cache key, which
already hashes the namespace (model fingerprint, dtype, storage convention, attention scope,
cache salt), so tenants and models never share entries. Rules every tier keeps:
- `get(key, expect)` returns the record only if it is intact and exactly what `expect`
  describes, else raises `CorruptChunkError`; a miss (or an unreachable backend) is None;
- `put(record)` is write-once: a key already present is left as it is (two replicas computing
  the same chunk write the same bytes, so whichever lands first is right);
- a tier that cannot reach its backend (Redis down) answers as a miss and counts an error;
  the engine then computes locally.

`TieredChunkStore` chains tiers in the order configured (`chunk_store` =
"host:8GiB,disk:/var/cache/ragkv:50GiB,redis://127.0.0.1:6379/0"). The chunk cache asks it on
a pool miss and promotes a hit into the pool; chunks the engine computes are written through to
the shared tiers (disk, Redis) off the engine thread; chunks evicted from the pool are demoted
to the host tier.
"""

from __future__ import annotations

import atexit
import logging
import queue
import re
import threading
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass

from .chunk_format import ChunkMeta, ChunkRecord, CorruptChunkError

logger = logging.getLogger("ragkv")

# Load latency buckets (seconds) of the `ragkv:chunk_store_load_seconds` histogram.
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Writes waiting for the writer thread, at most this many and this many bytes; beyond
# either, new writes are dropped (and counted) rather than holding unbounded host memory
# while a slow backend catches up.
MAX_PENDING_WRITES = 256
MAX_PENDING_BYTES = 4 << 30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counters of one tier since start. `load_buckets[i]` counts loads that took at most
    LOAD_BUCKETS[i] seconds (not cumulative); loads slower than the last bucket count only in
    `loads`."""

    name: str
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    writes: int
    corrupt: int  # entries found damaged or foreign, deleted and recomputed
    errors: int  # backend failures (timeouts, connection refused)
    entries: int  # entries this process knows of (-1: the backend does not say)
    used_bytes: int
    capacity_bytes: int  # 0: unbounded (or bounded by the backend)
    available: bool
    loads: int
    load_seconds: float
    load_buckets: tuple[int, ...]


class ChunkStore(ABC):
    """One tier. `shared` tiers (disk, Redis) outlive the process and receive every computed
    chunk; the others (host) receive chunks evicted from the pool."""

    name: str = ""
    shared: bool = True

    def __init__(self) -> None:
        self.hits = self.misses = self.bytes_read = self.bytes_written = 0
        self.writes = self.corrupt = self.errors = 0
        self.loads = 0
        self.load_seconds = 0.0
        self.load_buckets = [0] * len(LOAD_BUCKETS)
        self._lock = threading.Lock()  # counters are bumped from the writer thread too

    @abstractmethod
    def get(self, key: str, expect: ChunkMeta) -> ChunkRecord | None: ...

    @abstractmethod
    def put(self, record: ChunkRecord) -> bool:
        """Store `record` unless its key is present; True if it was written."""

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def close(self) -> None:  # noqa: B027 (most tiers hold nothing to release)
        """Release backend resources (connections)."""

    def stats(self) -> TierStats:
        entries, used, capacity, available = self._usage()
        with self._lock:
            return TierStats(
                name=self.name, hits=self.hits, misses=self.misses,
                bytes_read=self.bytes_read, bytes_written=self.bytes_written,
                writes=self.writes, corrupt=self.corrupt, errors=self.errors, entries=entries,
                used_bytes=used, capacity_bytes=capacity, available=available,
                loads=self.loads, load_seconds=self.load_seconds,
                load_buckets=tuple(self.load_buckets))

    def _usage(self) -> tuple[int, int, int, bool]:
        """(entries, used bytes, capacity bytes, backend reachable)."""
        return -1, 0, 0, True

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def _count_load(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.hits += 1
            self.bytes_read += nbytes
            self.loads += 1
            self.load_seconds += seconds
            for i, bound in enumerate(LOAD_BUCKETS):
                if seconds <= bound:
                    self.load_buckets[i] += 1
                    break


class TieredChunkStore:
    """Tiers in order, one writer thread for the shared ones. No tier problem escapes `get`:
    a read that fails for any reason is counted and answered as a miss, so a store problem
    never fails a request, it only costs the computation of the chunk."""

    def __init__(self, tiers: list[ChunkStore]) -> None:
        if not tiers:
            raise ValueError("chunk_store: no tier given")
        self.tiers = tiers
        self._writes = _WriteQueue()
        # The writer is a daemon thread: a script that ends without close() would lose the
        # writes still queued, so they are flushed at exit (daemon threads still run then);
        # a store that is garbage collected stops its writer.
        atexit.register(_flush_at_exit, weakref.ref(self))
        # Not at exit: a thread ending while the interpreter (and torch) shut down can abort
        # the process ("terminate called without an active exception").
        weakref.finalize(self, self._writes.stop).atexit = False

    @property
    def has_host_tier(self) -> bool:
        return any(not t.shared for t in self.tiers)

    @property
    def has_shared_tier(self) -> bool:
        return any(t.shared for t in self.tiers)

    @property
    def dropped_writes(self) -> int:
        return self._writes.dropped

    def get(self, expect: ChunkMeta) -> tuple[ChunkRecord, str] | None:
        """The first intact record for `expect` and the name of the tier that held it; a
        damaged or foreign entry is counted, logged, deleted, and the next tier asked. Shared
        tiers before the one that hit get a copy (a disk tier fills from Redis)."""
        for i, tier in enumerate(self.tiers):
            try:
                record = tier.get(expect.key, expect)
            except CorruptChunkError as e:
                tier._count(corrupt=1)
                logger.warning("chunk store: %s entry %s is unusable (%s): deleted, the chunk "
                               "is recomputed", tier.name, expect.key[:16], e)
                _guarded(tier, "delete", tier.delete, expect.key)
                continue
            except Exception as e:  # a failing backend is a miss, never a failed request
                tier._count(errors=1, misses=1)
                logger.warning("chunk store: %s read of %s failed (%s: %s); the chunk is "
                               "computed", tier.name, expect.key[:16], type(e).__name__, e)
                continue
            if record is not None:
                for earlier in self.tiers[:i]:
                    if earlier.shared:
                        self._writes.put(earlier, record)
                return record, tier.name
        return None

    def contains(self, key: str) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def delete(self, key: str) -> None:
        for tier in self.tiers:
            _guarded(tier, "delete", tier.delete, key)

    def host_contains(self, key: str) -> bool:
        return any(not tier.shared and tier.contains(key) for tier in self.tiers)

    def shared_tiers(self) -> list[ChunkStore]:
        return [tier for tier in self.tiers if tier.shared]

    def copy_to_missing(self, expect: ChunkMeta) -> bool:
        """Copy a stored chunk into the shared tiers that lack it (a Redis emptied while the
        disk tier kept its copy); False if no tier holds an intact copy."""
        lacking = [t for t in self.shared_tiers() if not t.contains(expect.key)]
        found = self.get(expect)
        if found is None:
            return False
        for tier in lacking:
            self._writes.put(tier, found[0])
        return True

    def has_room(self, nbytes: int) -> bool:
        """Whether a write of `nbytes` to every shared tier would be queued (checked before
        copying the chunk off the pool, so a dropped write costs no copy)."""
        return self._writes.has_room(nbytes * sum(t.shared for t in self.tiers))

    def note_dropped(self) -> None:
        """A write-through given up before it reached the queue (counted with the others)."""
        self._writes.count_dropped()

    def put(self, record: ChunkRecord) -> None:
        """Write a freshly computed chunk to every shared tier, off the caller's thread."""
        for tier in self.tiers:
            if tier.shared:
                self._writes.put(tier, record)

    def demote(self, record: ChunkRecord) -> None:
        """Keep a chunk leaving the pool in the host tiers (synchronous: a memory copy)."""
        for tier in self.tiers:
            if not tier.shared:
                _guarded(tier, "write", tier.put, record)

    def clear_host(self) -> None:
        """Drop every entry of the host tiers (the shared ones are left to their owners)."""
        for tier in self.tiers:
            if not tier.shared:
                tier.clear()

    def flush(self) -> None:
        """Wait until every queued write has reached its tier."""
        self._writes.join()

    def close(self) -> None:
        self.flush()
        # The writer thread ends here, not while the interpreter shuts down: a daemon thread
        # woken during finalization (by the store's finalizer) can abort the process
        # ("terminate called without an active exception", seen once in the suite when a
        # precompute run exited). A later write starts a new one.
        self._writes.shutdown()
        for tier in self.tiers:
            tier.close()

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(tier.stats() for tier in self.tiers)


class _WriteQueue:
    """Writes waiting for the writer thread, bounded in count and bytes: past either bound a
    write is dropped (counted) rather than holding host memory while a slow backend catches
    up. The thread holds this queue, not the store, so the store can be collected."""

    def __init__(self) -> None:
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._count = self._bytes = 0
        self._thread: threading.Thread | None = None

    def has_room(self, nbytes: int) -> bool:
        with self._lock:
            return (self._count < MAX_PENDING_WRITES
                    and self._bytes + nbytes <= MAX_PENDING_BYTES)

    def put(self, tier: ChunkStore, record: ChunkRecord) -> None:
        size = record.nbytes
        with self._lock:
            if self._count >= MAX_PENDING_WRITES or self._bytes + size > MAX_PENDING_BYTES:
                self.dropped += 1
                logger.debug("chunk store: write queue full, %s write dropped", tier.name)
                return
            self._count += 1
            self._bytes += size
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ragkv-chunk-store",
                                                daemon=True)
                self._thread.start()
        self._queue.put((tier, record))

    def count_dropped(self) -> None:
        with self._lock:
            self.dropped += 1

    def join(self) -> None:
        self._queue.join()

    def stop(self) -> None:
        self._queue.put(None)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the writer thread and wait for it (the queue is empty: callers flush first)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            tier, record = item
            with self._lock:  # no longer waiting (the one being written is extra)
                self._count -= 1
                self._bytes -= record.nbytes
            _guarded(tier, "write", tier.put, record)
            self._queue.task_done()
        self._queue.task_done()


def _guarded(tier: ChunkStore, what: str, call, *args) -> None:
    """`call(*args)`, a failure counted on `tier` and logged: a store problem never stops the
    engine or the writer."""
    try:
        call(*args)
    except Exception as e:
        tier._count(errors=1)
        logger.warning("chunk store: %s %s failed (%s: %s)", tier.name, what,
                       type(e).__name__, e)


def _flush_at_exit(ref: weakref.ref) -> None:
    store = ref()
    if store is not None:
        store.flush()


def parse_size(text: str) -> int:
    """Bytes in "8GiB", "500MB", "1048576"."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"chunk_store: {text!r} is not a size (e.g. 8GiB, 500MB, 1048576)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"chunk_store: size {text!r} must be positive")
    return size


def check_chunk_store(spec: str | None) -> None:
    """A clear ValueError for a `chunk_store` setting that does not parse (no I/O)."""
    _tier_specs(spec)


def build_chunk_store(spec: str | None, pin_memory: bool = False) -> TieredChunkStore | None:
    """The tiers a `chunk_store` setting names, in order; None for no setting."""
    from .store_tiers import DiskChunkStore, HostChunkStore, RedisChunkStore

    tiers: list[ChunkStore] = []
    for kind, args in _tier_specs(spec):
        if kind == "host":
            tiers.append(HostChunkStore(args[0], pin_memory=pin_memory))
        elif kind == "disk":
            tiers.append(DiskChunkStore(*args))
        else:
            tiers.append(RedisChunkStore(args[0]))
    return TieredChunkStore(tiers) if tiers else None


def _tier_specs(spec: str | None) -> list[tuple[str, tuple]]:
    if spec is None:
        return []
    if not isinstance(spec, str):
        raise ValueError(f"chunk_store must be a string, got {spec!r}")
    if not spec.strip():
        return []
    out: list[tuple[str, tuple]] = []
    for part in (p.strip() for p in spec.split(",")):
        if part.startswith(("redis://", "rediss://", "unix://")):
            out.append(("redis", (part,)))
        elif part.startswith("host:"):
            out.append(("host", (parse_size(part[5:]),)))
        elif part.startswith("disk:"):
            path, sep, size = part[5:].rpartition(":")
            if not sep or not path:
                raise ValueError(f"chunk_store: {part!r} must be disk:PATH:SIZE "
                                 "(e.g. disk:/var/cache/ragkv:50GiB)")
            out.append(("disk", (path, parse_size(size))))
        else:
            raise ValueError(f"chunk_store: unknown tier {part!r}; tiers are host:SIZE, "
                             "disk:PATH:SIZE and redis://HOST:PORT/DB, comma-separated")
    kinds = [k for k, _ in out]
    if kinds.count("host") > 1:
        raise ValueError("chunk_store: at most one host tier")
    return out

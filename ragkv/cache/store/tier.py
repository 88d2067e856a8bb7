"""One tier of the chunk store: the `ChunkStore` interface and its counters.

A tier keeps chunk KV records (format.py) under the hex of their chunk-cache key, which already
hashes the namespace (model fingerprint, dtype, storage convention, attention scope, cache
salt), so tenants and models never share entries. Rules every tier keeps:
- `get(key, expect)` returns the record only if it is intact and exactly what `expect`
  describes, else raises `CorruptChunkError`; a miss (or an unreachable backend) is None;
- `put(record)` is write-once: a key already present is left as it is (two replicas computing
  the same chunk write the same bytes, so whichever lands first is right);
- a tier that cannot reach its backend (Redis down) answers as a miss and counts an error;
  the engine then computes locally.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

from .format import ChunkMeta, ChunkRecord

logger = logging.getLogger("ragkv")

# Load latency buckets (seconds) of the `ragkv:chunk_store_load_seconds` histogram.
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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


def guarded(tier: ChunkStore, what: str, call, *args) -> None:
    """`call(*args)`, a failure counted on `tier` and logged: a store problem never stops the
    engine or the writer."""
    try:
        call(*args)
    except Exception as e:
        tier._count(errors=1)
        logger.warning("chunk store: %s %s failed (%s: %s)", tier.name, what,
                       type(e).__name__, e)

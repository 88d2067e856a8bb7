"""The chain of tiers behind the chunk cache: `TieredChunkStore`, built from the
`chunk_store` setting ("host:8GiB,disk:/var/cache/ragkv:50GiB,redis://127.0.0.1:6379/0").

The chunk cache asks it on a pool miss and promotes a hit into the pool; chunks the engine
computes are written through to the shared tiers (disk, Redis) off the engine thread; chunks
evicted from the pool are demoted to the host tier. Tiers keep the rules of tier.py.

Reads never block the engine thread on I/O: the tiers that are not shared (host memory) are
read in place and first (`get_local`), the shared ones on loader threads (`load`), whose
results the chunk cache collects on a later step.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

from ...config import parse_chunk_store
from .disk_tier import DiskChunkStore
from .format import ChunkMeta, ChunkRecord, CorruptChunkError
from .host_tier import HostChunkStore
from .redis_tier import RedisChunkStore
from .tier import ChunkStore, TierStats, guarded

logger = logging.getLogger("ragkv")

# Threads reading the shared tiers for the chunk cache (each read is one disk file or one
# Redis GET: I/O that releases the interpreter).
LOADER_THREADS = 4
# Writes waiting for the writer thread, at most this many and this many bytes; beyond
# either, new writes are dropped (and counted) rather than holding unbounded host memory
# while a slow backend catches up.
MAX_PENDING_WRITES = 256
MAX_PENDING_BYTES = 4 << 30


def build_chunk_store(spec: str | None, pin_memory: bool = False) -> TieredChunkStore | None:
    """The tiers a `chunk_store` setting names, in order; None for no setting."""
    tiers: list[ChunkStore] = []
    for kind, args in parse_chunk_store(spec):
        if kind == "host":
            tiers.append(HostChunkStore(args[0], pin_memory=pin_memory))
        elif kind == "disk":
            tiers.append(DiskChunkStore(*args))
        else:
            tiers.append(RedisChunkStore(args[0]))
    return TieredChunkStore(tiers) if tiers else None


class TieredChunkStore:
    """Tiers in order, one writer thread for the shared ones. No tier problem escapes `get`:
    a read that fails for any reason is counted and answered as a miss, so a store problem
    never fails a request, it only costs the computation of the chunk."""

    def __init__(self, tiers: list[ChunkStore]) -> None:
        if not tiers:
            raise ValueError("chunk_store: no tier given")
        self.tiers = tiers
        # Tiers read in place (host memory) and on the loader threads, each in their order.
        self._local = [t for t in tiers if not t.shared]
        self._remote = [t for t in tiers if t.shared]
        self._loader: ThreadPoolExecutor | None = None
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
        return self._get(self.tiers, expect)

    def get_local(self, expect: ChunkMeta) -> tuple[ChunkRecord, str] | None:
        """`get` over the tiers read in place: those that are not shared (memory)."""
        return self._get(self._local, expect) if self._local else None

    @property
    def has_remote_tier(self) -> bool:
        """Whether some tiers are read on the loader thread (`load`)."""
        return bool(self._remote)

    def load(self, expect: ChunkMeta) -> Future:
        """`get` over the shared tiers on the loader threads: a Future of its result (a failing
        tier is a miss; the Future is cancelled by `close`). Called from the engine thread
        only."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(LOADER_THREADS,
                                              thread_name_prefix="ragkv-chunk-load")
        return self._loader.submit(self._get, self._remote, expect)

    def _get(self, tiers: list[ChunkStore],
             expect: ChunkMeta) -> tuple[ChunkRecord, str] | None:
        for tier in tiers:
            i = self.tiers.index(tier)
            try:
                record = tier.get(expect.key, expect)
            except CorruptChunkError as e:
                tier._count(corrupt=1)
                logger.warning("chunk store: %s entry %s is unusable (%s): deleted, the chunk "
                               "is recomputed", tier.name, expect.key[:16], e)
                guarded(tier, "delete", tier.delete, expect.key)
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
            guarded(tier, "delete", tier.delete, key)

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
                guarded(tier, "write", tier.put, record)

    def clear_host(self) -> None:
        """Drop every entry of the host tiers (the shared ones are left to their owners)."""
        for tier in self.tiers:
            if not tier.shared:
                tier.clear()

    def flush(self) -> None:
        """Wait until every queued write has reached its tier."""
        self._writes.join()

    def close(self) -> None:
        loader, self._loader = self._loader, None
        if loader is not None:  # a load's result would have nowhere to go
            loader.shutdown(wait=True, cancel_futures=True)
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
            guarded(tier, "write", tier.put, record)
            self._queue.task_done()
        self._queue.task_done()


def _flush_at_exit(ref: weakref.ref) -> None:
    store = ref()
    if store is not None:
        store.flush()

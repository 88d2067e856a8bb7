"""The chunk store's tiers: host memory, a directory on disk, Redis (chunk_store.py says the
rules they keep)."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
import urllib.parse
from collections import OrderedDict

import torch

from .chunk_format import ChunkMeta, ChunkRecord, CorruptChunkError, decode, encode
from .chunk_store import ChunkStore

logger = logging.getLogger("ragkv")

_SUFFIX = ".ragkv-chunk"


def _is_hex(key: str) -> bool:
    return bool(key) and all(c in "0123456789abcdef" for c in key)


class HostChunkStore(ChunkStore):
    """Records in host memory (pinned on CUDA machines, so loads into the pool are plain DMA),
    at most `capacity_bytes`, least recently used dropped first. Not shared: it holds what the
    pool evicted (`LLM.sleep()` keeps the chunks it offloads apart, whatever the tiers)."""

    name = "host"
    shared = False

    def __init__(self, capacity_bytes: int, pin_memory: bool = False) -> None:
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.pin_memory = pin_memory
        self._records: OrderedDict[str, ChunkRecord] = OrderedDict()
        self._used = 0
        self._guard = threading.Lock()

    def get(self, key: str, expect: ChunkMeta) -> ChunkRecord | None:
        start = time.perf_counter()
        with self._guard:
            record = self._records.get(key)
            if record is not None:
                self._records.move_to_end(key)
        if record is None:
            self._count(misses=1)
            return None
        if record.meta != expect:
            raise CorruptChunkError("host entry describes another chunk")
        self._count_load(time.perf_counter() - start, record.nbytes)
        return record

    def put(self, record: ChunkRecord) -> bool:
        size = record.nbytes
        if size > self.capacity_bytes:
            return False
        kv = record.kv.detach()
        if kv.device.type != "cpu" or (self.pin_memory and not kv.is_pinned()):
            host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=self.pin_memory)
            record = ChunkRecord(record.meta, host.copy_(record.wait()))
        with self._guard:
            if record.meta.key in self._records:
                return False
            while self._used + size > self.capacity_bytes:
                _, old = self._records.popitem(last=False)
                self._used -= old.nbytes
            # Kept with its `ready` event: a pool write from it is ordered after the copy on
            # the compute stream; a CPU reader (encode, for a shared tier) waits for it.
            self._records[record.meta.key] = record
            self._used += size
        self._count(writes=1, bytes_written=size)
        return True

    def contains(self, key: str) -> bool:
        return key in self._records

    def clear(self) -> None:
        with self._guard:
            self._records.clear()
            self._used = 0

    def delete(self, key: str) -> None:
        with self._guard:
            record = self._records.pop(key, None)
            if record is not None:
                self._used -= record.nbytes

    def _usage(self) -> tuple[int, int, int, bool]:
        return len(self._records), self._used, self.capacity_bytes, True


class DiskChunkStore(ChunkStore):
    """One file per entry in `path`, at most `capacity_bytes` in all: the least recently used
    files this process knows of are deleted first. Files are written to a temporary name and
    renamed, so a reader (another replica on the same directory) never sees half an entry."""

    name = "disk"

    def __init__(self, path: str, capacity_bytes: int) -> None:
        super().__init__()
        self.path = os.path.abspath(os.path.expanduser(path))
        self.capacity_bytes = capacity_bytes
        self._guard = threading.Lock()
        # key -> file size, least recently used first (by modification time at start).
        self._index: OrderedDict[str, int] = OrderedDict()
        found = []
        try:
            os.makedirs(self.path, exist_ok=True)
            for entry in os.scandir(self.path):
                key = entry.name[:-len(_SUFFIX)]
                if entry.name.endswith(_SUFFIX) and _is_hex(key) and entry.is_file():
                    st = entry.stat()
                    found.append((st.st_mtime_ns, key, st.st_size))
        except OSError as e:
            raise ValueError(f"chunk_store: cannot use {self.path} as a disk tier: "
                             f"{e.strerror or e}") from e
        for _, key, size in sorted(found):
            self._index[key] = size
        self._used = sum(self._index.values())
        self._evict()

    def _file(self, key: str) -> str:
        if not _is_hex(key):
            raise ValueError(f"chunk store key {key!r} is not a hex digest")
        return os.path.join(self.path, key + _SUFFIX)

    def get(self, key: str, expect: ChunkMeta) -> ChunkRecord | None:
        start = time.perf_counter()
        try:
            with open(self._file(key), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._count(misses=1)
            with self._guard:
                self._used -= self._index.pop(key, 0)  # deleted by another process
            return None
        except OSError as e:
            self._count(errors=1, misses=1)
            logger.warning("chunk store: cannot read %s: %s", self._file(key), e)
            return None
        record = decode(data, expect)
        with self._guard:
            # Written by another process on this directory, or by our writer thread between
            # its rename and its index update: counted once either way.
            self._used += len(data) - self._index.get(key, 0)
            self._index[key] = len(data)
            self._index.move_to_end(key)
        with contextlib.suppress(OSError):
            os.utime(self._file(key))  # recency survives a restart
        self._evict()
        self._count_load(time.perf_counter() - start, len(data))
        return record

    def put(self, record: ChunkRecord) -> bool:
        key = record.meta.key
        target = self._file(key)
        if key in self._index or os.path.exists(target):
            return False
        data = encode(record)
        if len(data) > self.capacity_bytes:
            return False
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX + ".part", dir=self.path)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                # mkstemp makes it private; replicas or precompute may run as other users.
                os.chmod(tmp, 0o644)
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as e:
            self._count(errors=1)
            logger.warning("chunk store: cannot write %s: %s", target, e)
            return False
        with self._guard:
            self._used += len(data) - self._index.get(key, 0)
            self._index[key] = len(data)
        self._count(writes=1, bytes_written=len(data))
        self._evict()
        return True

    def contains(self, key: str) -> bool:
        return key in self._index or os.path.exists(self._file(key))

    def delete(self, key: str) -> None:
        with self._guard:
            self._used -= self._index.pop(key, 0)
        with contextlib.suppress(FileNotFoundError):  # other errors: counted by the caller
            os.unlink(self._file(key))

    def _evict(self) -> None:
        while True:
            with self._guard:
                if self._used <= self.capacity_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._used -= size
            try:
                os.unlink(self._file(key))
            except FileNotFoundError:
                pass
            except OSError as e:  # read-only or foreign files: the bound is then best effort
                self._count(errors=1)
                logger.warning("chunk store: cannot delete %s: %s", self._file(key), e)

    def _usage(self) -> tuple[int, int, int, bool]:
        return len(self._index), self._used, self.capacity_bytes, True


class RedisChunkStore(ChunkStore):
    """Entries as Redis values under `ragkv:chunk:<key>`, written with SET NX (write-once).

    Every call has a timeout (`socket_timeout`, default 1 s; the URL's query may set it). A
    failure marks the tier down for `retry_seconds`, doubling with each failed retry up to
    MAX_RETRY_SECONDS: meanwhile it answers as a miss without trying (and skips writes), so a
    dead or hung Redis costs the engine one timeout per retry, not one per chunk; a success
    logs the reconnection. A command Redis refuses (out of memory under
    `noeviction`, a value over its size limit) is a failed call, not an outage: counted, logged
    once per kind of refusal, and the tier stays up for reads."""

    name = "redis"
    prefix = "ragkv:chunk:"
    max_value_bytes = 512 * 1024 * 1024  # Redis' default proto-max-bulk-len
    MAX_RETRY_SECONDS = 60.0

    def __init__(self, url: str, timeout_seconds: float = 1.0,
                 retry_seconds: float = 2.0) -> None:
        super().__init__()
        try:
            import redis
        except ImportError as e:
            raise ValueError("chunk_store: a redis:// tier needs the redis package "
                             "(pip install 'ragkv[redis]')") from e
        self.url = url
        self.retry_seconds = retry_seconds
        self._error_types = (redis.RedisError, OSError)
        self._refusal_type = redis.ResponseError
        self._refusals_logged: set[str] = set()
        db = urllib.parse.urlsplit(url).path.strip("/")
        if url.startswith(("redis://", "rediss://")) and db and not db.isdigit():
            raise ValueError(f"chunk_store: Redis URL {url!r}: the database must be a number "
                             "(redis://HOST:PORT/DB)")
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout_seconds,
                                               socket_connect_timeout=timeout_seconds)
        except (ValueError, redis.RedisError) as e:
            raise ValueError(f"chunk_store: bad Redis URL {url!r}: {e}") from e
        if self.client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError(f"chunk_store: Redis URL {url!r}: decode_responses must be off "
                             "(entries are bytes)")
        self.available = True
        self._down_until = 0.0
        self._failures = 0  # consecutive failed calls: the retry interval doubles with each

    def _call(self, method: str, *args, **kwargs):
        """The client's answer, or None while the tier is down (errors counted, logged once
        per outage)."""
        if self._resting():
            return None
        try:
            result = getattr(self.client, method)(*args, **kwargs)
        except self._refusal_type as e:
            self._count(errors=1)
            kind = str(e).split(" ", 1)[0]
            if kind not in self._refusals_logged:
                self._refusals_logged.add(kind)
                logger.warning("chunk store: Redis at %s refused %s (%s); the chunk stays "
                               "local", self.url, method.upper(), e)
            return None
        except self._error_types as e:
            self._count(errors=1)
            if self.available:
                logger.warning("chunk store: Redis at %s unavailable (%s); computing chunks "
                               "locally, retrying every %.0f s", self.url, e,
                               self.retry_seconds)
            self.available = False
            self._failures += 1
            pause = min(self.retry_seconds * 2 ** (self._failures - 1), self.MAX_RETRY_SECONDS)
            self._down_until = time.monotonic() + pause
            return None
        if not self.available:
            logger.warning("chunk store: Redis at %s is back", self.url)
            self.available = True
        self._failures = 0
        return result

    def _resting(self) -> bool:
        """Down, and not yet time to try again."""
        return not self.available and time.monotonic() < self._down_until

    def get(self, key: str, expect: ChunkMeta) -> ChunkRecord | None:
        start = time.perf_counter()
        data = self._call("get", self.prefix + key)
        if data is None:
            self._count(misses=1)
            return None
        record = decode(data, expect)
        self._count_load(time.perf_counter() - start, len(data))
        return record

    def put(self, record: ChunkRecord) -> bool:
        if self._resting():
            return False  # no encoding for a Redis that is down
        data = encode(record)
        if len(data) > self.max_value_bytes:
            # Redis drops the connection on a value over proto-max-bulk-len (512 MiB by
            # default): refuse it here instead of taking the tier down.
            self._count(errors=1)
            if "too-large" not in self._refusals_logged:
                self._refusals_logged.add("too-large")
                logger.warning("chunk store: a %d-byte entry exceeds Redis' value limit of %d "
                               "bytes; such chunks stay local (smaller max_chunk_tokens, or "
                               "raise proto-max-bulk-len and max_value_bytes)", len(data),
                               self.max_value_bytes)
            return False
        if not self._call("set", self.prefix + record.meta.key, data, nx=True):
            return False
        self._count(writes=1, bytes_written=len(data))
        return True

    def contains(self, key: str) -> bool:
        return bool(self._call("exists", self.prefix + key))

    def delete(self, key: str) -> None:
        self._call("delete", self.prefix + key)

    def close(self) -> None:
        self.client.close()

    def _usage(self) -> tuple[int, int, int, bool]:
        return -1, self.bytes_written, 0, self.available

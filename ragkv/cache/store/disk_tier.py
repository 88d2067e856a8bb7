"""The disk tier of the chunk store (tier.py states the rules every tier keeps)."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict

from .format import ChunkMeta, ChunkRecord, decode, encode
from .tier import ChunkStore

logger = logging.getLogger("ragkv")

_SUFFIX = ".ragkv-chunk"


def _is_hex(key: str) -> bool:
    return bool(key) and all(c in "0123456789abcdef" for c in key)


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

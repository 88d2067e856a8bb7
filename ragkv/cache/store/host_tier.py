"""The host-memory tier of the chunk store (tier.py states the rules every tier keeps)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import torch

from .format import ChunkMeta, ChunkRecord, CorruptChunkError
from .tier import ChunkStore


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

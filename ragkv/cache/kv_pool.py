"""KV memory and the allocators that hand out its token slots.

The pool is one buffer `[2, layers, slots, kv_heads, head_dim]`: K is `kv[0]`, V is `kv[1]`, and
each layer's `[slots, kv_heads, head_dim]` view is contiguous (layer-first), so one list of slot
indices addresses the same token in every layer. Slots are token-granular (page size 1): any
sequence's KV list may mix slots from any region.

Slot 0 is reserved as a padding target for batched gathers and is never handed out.

Where the KV pool is sized: `size_pool` (the general and chunk regions, and the longest
sequence they admit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_KV_FRACTION, EngineConfig
from ..host_ints import int64_tensor, to_device

logger = logging.getLogger("ragkv")

# Default pool size cap: the free list is a Python list, and a pool far larger than the
# workload only costs start-up time.
DEFAULT_MAX_KV_TOKENS = 262_144


@dataclass(frozen=True, slots=True)
class PoolSize:
    """Derived sizes of the KV pool: slot 0 (padding), the general region, the chunk region,
    and the longest sequence (prompt plus output) the engine admits."""

    general_tokens: int
    chunk_tokens: int
    max_model_len: int

    @property
    def num_slots(self) -> int:
        return 1 + self.general_tokens + self.chunk_tokens

    @property
    def general_end(self) -> int:
        """First slot after the general region (slots 1 .. general_end - 1)."""
        return 1 + self.general_tokens


def model_len_limit(config: EngineConfig, max_context_len: int) -> int:
    """max_model_len from the config (checked against the model's limit) or the model."""
    limit = max_context_len
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} tokens"
        )
    return config.max_model_len


def kv_tokens_for_utilization(utilization: float, free: int, total: int,
                              bytes_per_token: int) -> int:
    """KV tokens that fit in `utilization` of a device's `total` bytes once what is in use now
    (the loaded weights, other processes) is counted, keeping 1/16 of the rest for the steps'
    activations and CUDA graphs."""
    used = total - free
    room = int(utilization * total) - used
    tokens = room * 15 // 16 // bytes_per_token
    if tokens < 1:
        raise ValueError(f"gpu_memory_utilization={utilization:g} leaves no room for the KV "
                         f"cache: {used / 2**30:.1f} GiB of the device's {total / 2**30:.1f} GiB "
                         "are in use already (the model, other processes); raise it")
    return tokens


def size_pool(config: EngineConfig, bytes_per_token: int, device: torch.device,
              max_len: int) -> PoolSize:
    """Pool size from kv_cache_tokens, a memory budget or the device; the chunk region takes
    chunk_cache_tokens or chunk_cache_fraction of it, the general region the rest, which must
    hold one sequence of `max_len` tokens (lowered to fit when max_model_len was not set)."""
    if config.kv_cache_tokens is not None:
        tokens = config.kv_cache_tokens
    elif config.kv_cache_memory_bytes is not None:
        tokens = config.kv_cache_memory_bytes // bytes_per_token
    elif config.gpu_memory_utilization is not None:
        if device.type != "cuda":
            raise ValueError("gpu_memory_utilization sizes the KV cache from a GPU's memory; "
                             f"this engine runs on {device.type}: give kv_cache_tokens or "
                             "kv_cache_memory_bytes (--kv-cache-tokens, --kv-cache-memory-bytes)")
        torch.cuda.empty_cache()  # blocks the allocator kept from loading are not in use
        free, total = torch.cuda.mem_get_info(device)
        tokens = kv_tokens_for_utilization(config.gpu_memory_utilization, free, total,
                                           bytes_per_token)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        tokens = int(free * DEFAULT_GPU_KV_FRACTION) // bytes_per_token
    else:
        tokens = min(DEFAULT_CPU_KV_BYTES // bytes_per_token, DEFAULT_MAX_KV_TOKENS)
    chunk = 0
    if config.enable_chunk_cache:
        chunk = (config.chunk_cache_tokens if config.chunk_cache_tokens is not None
                 else int(tokens * config.chunk_cache_fraction))
        if chunk >= tokens:
            raise ValueError(f"chunk_cache_tokens={chunk} leaves no room in a KV pool of "
                             f"{tokens} tokens")
    general = tokens - chunk
    if general < 1:
        raise ValueError("the KV cache budget holds no token at all")
    if general < max_len:
        if config.max_model_len is not None:
            raise ValueError(
                f"the general KV region holds {general} tokens ({tokens} in the pool, {chunk} "
                f"for the chunk cache), fewer than max_model_len={max_len}: raise "
                "kv_cache_tokens or lower max_model_len or chunk_cache_tokens"
            )
        logger.warning("max_model_len lowered to %d: the general KV region holds no more",
                       general)
        max_len = general
    return PoolSize(general_tokens=general, chunk_tokens=chunk, max_model_len=max_len)


class KVPool:
    """The KV tensors. Holds no bookkeeping: allocators and indexes hold slot numbers only."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.kv = torch.empty(2, num_layers, num_slots, num_kv_heads, head_dim,
                              dtype=dtype, device=device)
        self.zero_padding_slot()
        self.k = self.kv[0]
        self.v = self.kv[1]
        # The position each slot's key is rotated for (written with the key by the runner
        # and by `write`'s callers): what a sliding window measures distances from.
        self.pos = torch.zeros(num_slots, dtype=torch.int32, device=device)

    def zero_padding_slot(self) -> None:
        """Padded gathers read slot 0 under a mask; uninitialised memory could hold NaN, and
        NaN * 0 is NaN, so it must hold finite values. Dummy steps (warm-up, graph capture)
        write it: they call this after."""
        self.kv[:, :, 0].zero_()

    def entry_shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) of a chunk entry read from or written to the pool."""
        _, layers, _, heads, dim = self.kv.shape
        return layers, heads, dim

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    def read(self, slots: list[int]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The K/V of `slots` as a CPU tensor [2, layers, len(slots), kv_heads, head_dim], and
        None, or on CUDA an event after which it holds them: the copy goes into pinned memory
        on the compute stream without a host sync, so the engine thread does not wait for it.
        Anything on that stream (a later write back into the pool) is ordered after it; a CPU
        reader must wait for the event (ChunkRecord.wait)."""
        gathered = self.kv.index_select(2, self._index(slots))
        if self.kv.device.type != "cuda":
            return gathered, None
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        host.copy_(gathered, non_blocking=True)
        # `gathered` may be freed now: the caching allocator reuses its memory only for work
        # queued on this stream after the copy.
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def write(self, slots: list[int], kv: torch.Tensor, first_position: int) -> None:
        """Put `kv` ([2, layers, len(slots), kv_heads, head_dim], any device), whose keys are
        rotated for positions first_position, first_position + 1, ..., into `slots`."""
        index = self._index(slots)
        self.kv.index_copy_(2, index, kv.to(self.kv.device, non_blocking=True))
        self.pos[index] = torch.arange(first_position, first_position + len(slots),
                                       dtype=torch.int32, device=self.pos.device)

    def _index(self, slots: list[int]) -> torch.Tensor:
        # Through pinned memory on a GPU: a copy from pageable memory waits for the stream.
        return to_device(int64_tensor(slots), self.kv.device)

    def release_memory(self) -> None:
        """Free the pool's memory (LLM.sleep); every slot's contents are lost. The tensor
        objects stay, so views held elsewhere remain the pool's."""
        self.kv.untyped_storage().resize_(0)
        if self.kv.device.type == "cuda":
            torch.cuda.empty_cache()

    def restore_memory(self) -> None:
        """Allocate the pool's memory again after `release_memory` (contents undefined but
        slot 0, which is zeroed)."""
        storage = self.kv.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.kv.numel() * self.kv.element_size())
            self.zero_padding_slot()

    @property
    def released(self) -> bool:
        return self.kv.untyped_storage().nbytes() == 0

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize


class SlotAllocator:
    """Free-list allocator over the slot range `[start, end)` of the pool.

    `alloc` returns None (allocating nothing) when fewer than `n` slots are free, so callers can
    evict or preempt and try again. Freed slots are reused first-in, last-out, which keeps a
    sequence's slots mostly contiguous.
    """

    def __init__(self, start: int, end: int) -> None:
        if not 0 < start <= end:
            raise ValueError(f"invalid slot range [{start}, {end})")
        self.start = start
        self.end = end
        # Stored descending so that pop() from the end hands out ascending slots.
        self._free: list[int] = list(range(end - 1, start - 1, -1))

    @property
    def capacity(self) -> int:
        return self.end - self.start

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def free(self, slots: list[int]) -> None:
        if slots:
            self._free.extend(reversed(slots))

    def check_integrity(self) -> None:
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("slot allocator: a slot is free twice")
        if free and (min(free) < self.start or max(free) >= self.end):
            raise AssertionError("slot allocator: a free slot lies outside its region")

    def free_slots(self) -> list[int]:
        return list(self._free)

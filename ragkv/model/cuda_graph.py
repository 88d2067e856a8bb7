"""CUDA graphs of the decode step.

A decode step of a large model is a thousand small kernels; launched one by one from Python
the GPU waits on the host. Captured once per batch size of a ladder (1, 2, 4, 8, then every 8
up to the largest), a step becomes one graph launch. The graph reads everything that changes
from persistent device buffers, which each step fills in place with one copy: token ids,
positions, each sequence's slot-table row and KV length. The slots to write and read come from
the slot table on the device (the new token's slot is `table[row, kv_len - 1]`), so nothing the
graph reads is rebuilt on the host. A batch is padded to the next captured size with entries
that point at the table's padding row (slot 0, never read unmasked).

Re-positioned chunks stay in graphs too: each batch size has a second graph whose decode
kernel turns keys (ranges of a sequence's list seen turned by a delta, at most MAX_RANGES per
sequence, and the cos/sin rows of the step's distinct deltas, at most MAX_TURNS, in two more
persistent buffers). Steps without any run the plain graph: the turning variant of the kernel
holds about three times the registers (measured from the compiled kernel), which would cost
every decode step occupancy.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from ..cache.kv_pool import KVPool
from ..cache.slot_table import PAD_ROW, SlotTable
from .attention import AttentionMetadata
from .llama import CausalLM
from .triton_attention import (
    DecodeBatch,
    KeyTurns,
    TritonAttentionBackend,
    _TritonState,
    decode_scratch,
    decode_splits,
    padded_ranges,
)

logger = logging.getLogger(__name__)

# Re-positioned ranges per sequence and distinct deltas per step a graph takes; a step with
# more runs eagerly (through the same kernels).
MAX_RANGES = 32
MAX_TURNS = 64


def batch_sizes(max_batch: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, 8, 16, 24, ... up to max_batch (always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model: CausalLM, pool: KVPool, backend: TritonAttentionBackend,
                 slot_table: SlotTable, max_batch: int, max_model_len: int) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.slot_table = slot_table
        self.sizes = batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        # Dynamic RoPE derives frequencies from each sequence's length on the host.
        self.dynamic_rope = model.rotary.dynamic
        self.max_positions = model.config.max_position_embeddings
        device = pool.kv.device
        # Rows: ids, positions, slot-table rows, KV lengths, re-positioned ranges; filled by
        # one copy per step.
        self.inputs = torch.zeros(5, self.max_batch, dtype=torch.long, device=device)
        self.inputs[2].fill_(PAD_ROW)
        self.inputs[3].fill_(1)
        # Each sequence's ranges (start, end, row of the turn tables), and the tables: cos,
        # sin turning a key forward by each delta of the step.
        self.ranges = torch.zeros(self.max_batch, MAX_RANGES, 3, dtype=torch.int32,
                                  device=device)
        head_dim = model.config.head_dim
        self.turn_cos = torch.ones(MAX_TURNS, head_dim, dtype=torch.float32, device=device)
        self.turn_sin = torch.zeros(MAX_TURNS, head_dim, dtype=torch.float32, device=device)
        self.q_rows = torch.arange(self.max_batch, dtype=torch.int32, device=device)
        self.logits_rows = torch.arange(self.max_batch, dtype=torch.long, device=device)
        # (batch size, turns re-positioned keys) -> (graph, its logits)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.graphs.clear()  # a re-capture (wake_up) drops graphs that address freed memory
        mempool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs reuse its memory from the shared pool.
        for size in reversed(self.sizes):
            for turning in (False, True):
                self.graphs[(size, turning)] = self._capture(size, turning, mempool)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured CUDA graphs for decode batch sizes %s in %.2f s", self.sizes,
                    self.capture_seconds)

    def _forward(self, size: int, turning: bool, splits: int,
                 scratch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, positions, rows, kv_lens, num_ranges = (t[:size] for t in self.inputs)
        meta = AttentionMetadata(
            q_lens=[1] * size, kv_lens=[1] * size, q_starts=list(range(size)), kv_indices=[],
            write_slots=self.slot_table.table[rows, kv_lens - 1].long(),
            self_only=[False] * size, seq_lens=[1] * size, table=self.slot_table.table,
            rows=[], prefix=[True] * size, num_heads=self.model.config.num_heads,
            num_kv_heads=self.pool.k.shape[2],
        )
        meta.backend_state = _TritonState(decode=DecodeBatch(
            rows=rows, kv_lens=kv_lens, q_rows=self.q_rows[:size], num_splits=splits,
            scratch=scratch, turns=KeyTurns(ranges=self.ranges[:size], cos=self.turn_cos,
                                            sin=self.turn_sin, index=num_ranges,
                                            max_ranges=MAX_RANGES) if turning else None))
        return self.model(ids, positions, self.logits_rows[:size], self.pool, meta, self.backend)

    def plan(self, size: int) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
        """KV splits and scratch buffers of the graph for `size` sequences: splits are chosen
        for the longest sequence the engine admits, since the graph serves every length."""
        device = self.inputs.device
        splits = decode_splits(size, self.pool.k.shape[2], self.max_model_len, device)
        mc = self.model.config
        return splits, decode_scratch(size, mc.num_heads, mc.head_dim, splits, device)

    def _capture(self, size: int, turning: bool,
                 mempool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        device = self.inputs.device
        splits, scratch = self.plan(size)
        # Warm up outside the graph (compiles the kernels, sets up cuBLAS), on a side stream
        # as capture requires.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(size, turning, splits, scratch)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            logits = self._forward(size, turning, splits, scratch)
        return graph, logits

    def can_run(self, works: Sequence) -> bool:
        """Only pure decode batches: one new token per sequence whose KV list is its whole
        row so far (the last entry being the new token's slot), with at most MAX_RANGES
        re-positioned ranges each and MAX_TURNS distinct deltas in all."""
        if not works or len(works) > self.max_batch:
            return False
        deltas = set()
        for w in works:
            spans = w.kv_spans
            if (len(w.token_ids) != 1 or len(spans) != 1 or spans[0][0] != 0
                    or not w.sample or len(w.kv_rotations) > MAX_RANGES):
                return False
            if self.dynamic_rope and w.positions[0] >= self.max_positions:
                return False
            deltas.update(d for _, _, d in w.kv_rotations)
        return len(deltas) <= MAX_TURNS

    def run(self, works: Sequence) -> torch.Tensor:
        n = len(works)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        pad = size - n
        host = torch.tensor([
            [w.token_ids[0] for w in works] + [0] * pad,
            [w.positions[0] for w in works] + [0] * pad,
            [w.request.kv.row for w in works] + [PAD_ROW] * pad,
            [w.kv_spans[0][1] for w in works] + [1] * pad,
            [len(w.kv_rotations) for w in works] + [0] * pad,
        ], dtype=torch.long)
        self.inputs[:, :size].copy_(host, non_blocking=True)
        turning = any(w.kv_rotations for w in works)
        if turning:
            self._fill_turns(works)
        graph, logits = self.graphs[(size, turning)]
        graph.replay()
        return logits[:n]

    def _fill_turns(self, works: Sequence) -> None:
        """The ranges of the step's re-positioned keys and the cos/sin of their deltas."""
        deltas: dict[int, int] = {}  # delta -> its row of the turn tables
        ranges = padded_ranges([[(start, end, deltas.setdefault(delta, len(deltas)))
                                 for start, end, delta in w.kv_rotations] for w in works])
        self.ranges[:len(works), :ranges.shape[1]].copy_(ranges, non_blocking=True)
        # rotation(d) turns a key rotated for position p into the key for p + d.
        cos, sin = self.model.rotary.rotation(list(deltas))
        self.turn_cos[:len(deltas)].copy_(cos)
        self.turn_sin[:len(deltas)].copy_(sin)

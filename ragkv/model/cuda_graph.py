"""CUDA graphs of the decode step.

A decode step of a large model is a thousand small kernels; launched one by one from Python
the GPU waits on the host. Captured once per batch size of a ladder (1, 2, 4, 8, then every 8
up to the largest), a step becomes one graph launch. The graph reads everything that changes
from persistent device buffers, which each step fills in place with one copy: token ids,
positions, each sequence's slot-table row and KV length. The slots to write and read come from
the slot table on the device (the new token's slot is `table[row, kv_len - 1]`), so nothing the
graph reads is rebuilt on the host. A batch is padded to the next captured size with entries
that point at the table's padding row (slot 0, never read unmasked).
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
    TritonAttentionBackend,
    _TritonState,
    decode_scratch,
    decode_splits,
)

logger = logging.getLogger(__name__)


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
        # Rows: ids, positions, slot-table rows, KV lengths; filled by one copy per step.
        self.inputs = torch.zeros(4, self.max_batch, dtype=torch.long, device=device)
        self.inputs[2].fill_(PAD_ROW)
        self.inputs[3].fill_(1)
        self.q_rows = torch.arange(self.max_batch, dtype=torch.int32, device=device)
        self.logits_rows = torch.arange(self.max_batch, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.graphs.clear()  # a re-capture (wake_up) drops graphs that address freed memory
        mempool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs reuse its memory from the shared pool.
        for size in reversed(self.sizes):
            self.graphs[size] = self._capture(size, mempool)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured CUDA graphs for decode batch sizes %s in %.2f s", self.sizes,
                    self.capture_seconds)

    def _forward(self, size: int, splits: int,
                 scratch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, positions, rows, kv_lens = (t[:size] for t in self.inputs)
        meta = AttentionMetadata(
            q_lens=[1] * size, kv_lens=[1] * size, q_starts=list(range(size)), kv_indices=[],
            write_slots=self.slot_table.table[rows, kv_lens - 1].long(),
            self_only=[False] * size, seq_lens=[1] * size, table=self.slot_table.table,
            rows=[], prefix=[True] * size, num_heads=self.model.config.num_heads,
            num_kv_heads=self.pool.k.shape[2],
        )
        meta.backend_state = _TritonState(decode=DecodeBatch(
            rows=rows, kv_lens=kv_lens, q_rows=self.q_rows[:size], num_splits=splits,
            scratch=scratch))
        return self.model(ids, positions, self.logits_rows[:size], self.pool, meta, self.backend)

    def _capture(self, size: int, mempool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        device = self.inputs.device
        splits = decode_splits(size, self.pool.k.shape[2], self.max_model_len, device)
        mc = self.model.config
        scratch = decode_scratch(size, mc.num_heads, mc.head_dim, splits, device)
        # Warm up outside the graph (compiles the kernels, sets up cuBLAS), on a side stream
        # as capture requires.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(size, splits, scratch)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            logits = self._forward(size, splits, scratch)
        return graph, logits

    def can_run(self, works: Sequence) -> bool:
        """Only pure decode batches: one new token per sequence whose KV list is its whole
        row so far (the last entry being the new token's slot), with no re-positioned keys."""
        if not works or len(works) > self.max_batch:
            return False
        for w in works:
            spans = w.kv_spans
            if (len(w.token_ids) != 1 or len(spans) != 1 or spans[0][0] != 0
                    or not w.sample or w.kv_rotations):
                return False
            if self.dynamic_rope and w.positions[0] >= self.max_positions:
                return False
        return True

    def run(self, works: Sequence) -> torch.Tensor:
        n = len(works)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        pad = size - n
        host = torch.tensor([
            [w.token_ids[0] for w in works] + [0] * pad,
            [w.positions[0] for w in works] + [0] * pad,
            [w.request.kv.row for w in works] + [PAD_ROW] * pad,
            [w.kv_spans[0][1] for w in works] + [1] * pad,
        ], dtype=torch.long)
        self.inputs[:, :size].copy_(host, non_blocking=True)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]

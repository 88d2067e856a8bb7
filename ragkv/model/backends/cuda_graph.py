"""CUDA graphs of the decode step and of short single-sequence extend steps.

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

A short extend step of one sequence (the question of a warm RAG request over its cached chunks,
a short prompt) streams all the weights too, and is as launch-bound: `ExtendGraphs` captures it
for a ladder of token counts (8, 16, ... 512), plain and turning re-positioned keys. The
sequence's KV list is copied into a persistent index buffer; a step of n tokens runs the graph
of the next size T >= n, the T - n padding tokens forming a second sequence whose list is T - n
entries of the padding slot 0 (each attends to finite values, writes only slot 0, and is never
read back). The new tokens' slots are then the contiguous entries k - n .. k + T - n - 1 of the
buffer, gathered inside the graph from one offset. KV splits are fixed at capture for the
longest list the engine admits; a slice with nothing to read costs one early exit.

A selectively recomputed request's last step (its chosen chunk tokens, scattered among the
cached ones, and its question; two works of one sequence) is as short, and runs a third graph
per size, "indexed": the two works as one sequence whose tokens sit at given entries of its
list (`query_index`: each writes its K/V there and sees the entries up to it), with keys at
their own RoPE positions (the chunk's base positions for recomputed tokens) and re-positioned
keys turned. Its entries, their last visible entries and the keys' positions are three more
persistent buffers.

A model whose layers come in several attention kinds (Gemma 3: sliding-window layers with
one RoPE base, full ones with another) runs each kind's layers with its own launch inputs in
the same graph: turn tables of its rotary (one set of persistent cos/sin buffers per kind, the
rows and their deltas shared) and its window. A windowed kind's kernels read the step's
positions buffer and `KVPool.pos`, which the graph itself writes for the new keys first, so a
window costs no variant and no host work.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...cache.kv_manager import SeqKV
from ...cache.kv_pool import KVPool
from ...host_ints import int64_tensor
from ..llama import CausalLM
from ..reposition import Turn, TurnTable, entry_turns
from ..slot_table import PAD_ROW, SlotTable
from ..step_work import join_recomputed
from .base import AttentionMetadata
from .triton_attention import (
    DecodeBatch,
    ExtendBatch,
    TritonAttentionBackend,
    TritonState,
    padded_ranges,
)
from .triton_kernels import (
    DecodeTurns,
    SlidingWindow,
    decode_scratch,
    decode_splits,
    extend_splits,
)

logger = logging.getLogger(__name__)

# Re-positioned ranges per sequence and distinct deltas per step a graph takes; a step with
# more runs eagerly (through the same kernels).
MAX_RANGES = 32
MAX_TURNS = 64


def capture_graph(forward, device: torch.device,
                  mempool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`forward` captured as a graph in `mempool`, and its output. Run twice first outside the
    graph (compiles the kernels, sets up cuBLAS), on a side stream as capture requires. Every
    tensor the graph reads or writes that `forward` does not allocate must be kept by the
    caller: a graph holds no reference to its memory."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        out = forward()
    return graph, out


def batch_sizes(max_batch: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, 8, 16, 24, ... up to max_batch (always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class _StepGraphs:
    """What the decode and the extend graphs share: the model and caches their steps run on,
    the turn tables of re-positioned keys (per attention kind, cos, sin turning a key forward
    by each distinct delta of the step, at most MAX_TURNS; the deltas themselves for sliding
    windows), each kind's window, and the capture of a graph per size of their ladder and
    variant of the step (`variants`: plain, turning re-positioned keys, ...)."""

    what: str  # the ladder's unit, for the capture log
    variants: tuple[str, ...] = ("plain", "turning")

    def __init__(self, model: CausalLM, pool: KVPool, backend: TritonAttentionBackend,
                 slot_table: SlotTable, sizes: list[int], max_model_len: int) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.slot_table = slot_table
        self.sizes = sizes
        self.max_model_len = max_model_len
        # Dynamic RoPE derives frequencies from each sequence's length on the host.
        self.dynamic_rope = model.rotary.dynamic
        self.max_positions = model.config.max_position_embeddings
        head_dim = model.config.head_dim
        device = pool.kv.device
        kinds = model.num_kinds
        self.turn_cos = torch.ones(kinds, MAX_TURNS, head_dim, dtype=torch.float32,
                                   device=device)
        self.turn_sin = torch.zeros(kinds, MAX_TURNS, head_dim, dtype=torch.float32,
                                    device=device)
        self.turn_deltas = torch.zeros(MAX_TURNS, dtype=torch.long, device=device)
        # (size, variant) -> (graph, its logits)
        self.graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def graph_forward(self, size: int, variant: str):
        """The step that the graph (size, variant) captures, as a call without arguments."""
        raise NotImplementedError

    def fill_turn_tables(self, deltas: list[int]) -> TurnTable:
        """The cos/sin rows of the step's distinct `deltas` into each kind's buffers, the
        deltas into theirs; returns the table (its rows are every kind's)."""
        for kind, rotary in enumerate(self.model.rotaries):
            table = TurnTable.build(rotary, deltas)
            table.fill(self.turn_cos[kind], self.turn_sin[kind])
        if self.model.has_windows:
            self.turn_deltas[:len(table)].copy_(table.deltas(self.turn_deltas.device)[:-1])
        return table

    def window(self, kind: int, positions: torch.Tensor) -> SlidingWindow | None:
        """Kind `kind`'s sliding window over a step whose query rows sit at `positions`."""
        size = self.model.windows[kind]
        if size is None:
            return None
        return SlidingWindow(size, positions, self.pool.pos, self.turn_deltas)

    def write_key_positions(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Where some layers have a window, the new keys' positions (`KVPool.pos`), written
        inside the graph: the eager runner writes them before its forward."""
        if self.model.has_windows:
            self.pool.pos[slots] = positions.to(torch.int32)

    def _prepare_capture(self, size: int) -> None:
        """Fills the inputs that the graphs of `size` are captured with."""

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.graphs.clear()  # a re-capture (wake_up) drops graphs that address freed memory
        mempool = torch.cuda.graph_pool_handle()
        device = self.pool.kv.device
        # Largest first: smaller graphs reuse its memory from the shared pool.
        for size in reversed(self.sizes):
            self._prepare_capture(size)
            for variant in self.variants:
                self.graphs[(size, variant)] = capture_graph(
                    self.graph_forward(size, variant), device, mempool)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured CUDA graphs for %s: %s in %.2f s", self.what, self.sizes,
                    self.capture_seconds)


class DecodeGraphs(_StepGraphs):
    what = "decode batch sizes"

    def __init__(self, model: CausalLM, pool: KVPool, backend: TritonAttentionBackend,
                 slot_table: SlotTable, max_batch: int, max_model_len: int) -> None:
        super().__init__(model, pool, backend, slot_table, batch_sizes(max_batch),
                         max_model_len)
        self.max_batch = self.sizes[-1]
        device = pool.kv.device
        # Rows: ids, positions, slot-table rows, KV lengths, re-positioned ranges; filled by
        # one copy per step.
        self.inputs = torch.zeros(5, self.max_batch, dtype=torch.long, device=device)
        self.inputs[2].fill_(PAD_ROW)
        self.inputs[3].fill_(1)
        # Each sequence's ranges (start, end, row of the turn tables).
        self.ranges = torch.zeros(self.max_batch, MAX_RANGES, 3, dtype=torch.int32,
                                  device=device)
        self.q_rows = torch.arange(self.max_batch, dtype=torch.int32, device=device)
        self.logits_rows = torch.arange(self.max_batch, dtype=torch.long, device=device)
        # Each graph's decode scratch, allocated before its capture: a graph holds no reference
        # to the memory it writes, so a freed scratch would be handed to other tensors and
        # overwritten at every replay.
        self.scratch: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        self.scratch.clear()
        super().capture()

    def _forward(self, size: int, turning: bool, splits: int,
                 scratch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, positions, rows, kv_lens, num_ranges = (t[:size] for t in self.inputs)
        write_slots = self.slot_table.table[rows, kv_lens - 1].long()
        self.write_key_positions(write_slots, positions)
        metas = []
        for kind in range(self.model.num_kinds):
            turns = (DecodeTurns(ranges=self.ranges[:size], cos=self.turn_cos[kind],
                                 sin=self.turn_sin[kind], index=num_ranges,
                                 max_ranges=MAX_RANGES) if turning else None)
            state = TritonState(table=self.slot_table.table, decode=DecodeBatch(
                rows=rows, kv_lens=kv_lens, q_rows=self.q_rows[:size], num_splits=splits,
                scratch=scratch, turns=turns, window=self.window(kind, positions)))
            metas.append(AttentionMetadata(write_slots=write_slots, state=state))
        return self.model(ids, positions, self.logits_rows[:size], self.pool, tuple(metas),
                          self.backend)

    def plan(self, size: int) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
        """KV splits and scratch buffers of the graph for `size` sequences: splits are chosen
        for the longest sequence the engine admits, since the graph serves every length."""
        device = self.inputs.device
        splits = decode_splits(size, self.pool.k.shape[2], self.max_model_len, device)
        mc = self.model.config
        return splits, decode_scratch(size, self.model.num_heads, mc.head_dim, splits, device)

    def graph_forward(self, size: int, variant: str):
        """The step that the graph (size, variant) captures, as a call without arguments;
        its scratch kept for the graph's life."""
        splits, scratch = self.plan(size)
        self.scratch[(size, variant)] = scratch
        return functools.partial(self._forward, size, variant == "turning", splits, scratch)

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
                    or not w.sample or len(w.turns) > MAX_RANGES):
                return False
            if self.dynamic_rope and w.positions[0] >= self.max_positions:
                return False
            deltas.update(d for _, _, d in w.turns)
        return len(deltas) <= MAX_TURNS

    def run(self, works: Sequence) -> torch.Tensor:
        n = len(works)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        pad = size - n
        host = int64_tensor(
            [w.token_ids[0] for w in works] + [0] * pad
            + [w.positions[0] for w in works] + [0] * pad
            + [w.kv.row for w in works] + [PAD_ROW] * pad
            + [w.kv_spans[0][1] for w in works] + [1] * pad
            + [len(w.turns) for w in works] + [0] * pad)
        self.inputs[:, :size].copy_(host.view(5, size), non_blocking=True)
        turning = any(w.turns for w in works)
        if turning:
            self._fill_turns(works)
        graph, logits = self.graphs[(size, "turning" if turning else "plain")]
        graph.replay()
        return logits[:n]

    def _fill_turns(self, works: Sequence) -> None:
        """The step's turns and the cos/sin of their deltas, into the graphs' buffers."""
        table = self.fill_turn_tables([d for w in works for _, _, d in w.turns])
        ranges = padded_ranges([table.by_row(w.turns) for w in works])
        self.ranges[:len(works), :ranges.shape[1]].copy_(ranges, non_blocking=True)


def token_sizes(max_tokens: int) -> list[int]:
    """Extend graphs' ladder: 8, 16, 32, ... 512, none above `max_tokens` (the step budget).
    Longer steps are compute-bound, where launches hide behind the matmuls."""
    return [1 << i for i in range(3, 10) if 1 << i <= max_tokens]


@dataclass(slots=True, frozen=True)
class GraphStep:
    """One sequence's step as an extend graph runs it: its new tokens, their positions and
    their keys' (None: the same), the entries of its KV list they are (None: the last ones)
    and the list's spans and turns."""

    kv: SeqKV
    kv_spans: tuple[tuple[int, int], ...]
    token_ids: list[int]
    positions: list[int]
    turns: tuple[Turn, ...]
    query_index: tuple[int, ...] | None = None
    key_positions: list[int] | None = None


def graph_step(works: Sequence) -> GraphStep | None:
    """The step of `works` as one sequence that samples from its last token only, or None:
    a single work, or a recomputed request's last step (its recompute work, which samples
    nothing, then its question), joined as the runner joins it for the torch backend
    (`step_work.join_recomputed`)."""
    w = works[-1]
    if not w.sample or w.end - w.logits_from != 1 or len(works) > 2:
        return None
    units = join_recomputed(works)
    if len(units) != 1:
        return None
    s = units[0][1]
    return GraphStep(s.kv, s.kv_spans, s.token_ids, s.positions, s.turns, s.query_index,
                     s.key_positions)


class ExtendGraphs(_StepGraphs):
    """Graphs of an extend step of one sequence of at most 512 new tokens that samples from
    its last one (see the module docstring). Like the decode graphs, each size has a second
    graph whose extend kernel turns re-positioned keys: each KV entry's row of the turn tables
    (-1: none) in a persistent buffer beside the index, the tables' cos/sin rows (one per
    distinct delta, at most MAX_TURNS) in two more; and a third, "indexed", for steps whose
    tokens sit at given entries of the list (recompute), which turns keys too (a step with
    no turn leaves every entry's row at -1)."""

    what = "extend token counts"
    variants = ("plain", "turning", "indexed")

    def __init__(self, model: CausalLM, pool: KVPool, backend: TritonAttentionBackend,
                 slot_table: SlotTable, max_tokens: int, max_model_len: int) -> None:
        super().__init__(model, pool, backend, slot_table, token_sizes(max_tokens),
                         max_model_len)
        device = pool.kv.device
        self.top = top = self.sizes[-1] if self.sizes else 0
        # ids, positions (padding: token 0 at position 0), the offset k - n of the new
        # tokens' entries and the row whose logits are returned; then, for the indexed
        # graphs, each token's entry of the list and its key's position.
        self.inputs = torch.zeros(4 * top + 2, dtype=torch.long, device=device)
        # kv_indptr (3), q_starts (2), q_lens (2): the sequence and the padding one; then,
        # for the indexed graphs, each token's last visible entry of its sequence's list.
        self.counts = torch.zeros(7 + top, dtype=torch.int32, device=device)
        self.kv_index = torch.zeros(max_model_len + top, dtype=torch.int32, device=device)
        self.arange = torch.arange(top, dtype=torch.long, device=device)
        self.rows32 = self.arange.to(torch.int32)  # the merge's output rows: every token
        self.entry_turns = torch.full((max_model_len + top,), -1, dtype=torch.int32,
                                      device=device)

    def _prepare_capture(self, size: int) -> None:
        # Valid lengths: one real token over one entry, the rest padding.
        index = torch.zeros(1, dtype=torch.int32, device=self.inputs.device)
        self._fill(index, GraphStep(None, ((0, 1),), [0], [0], (), (0,), [0]), size)

    @torch.inference_mode()
    def capture(self) -> None:
        super().capture()
        self.pool.zero_padding_slot()  # written by the dummy steps

    def plan(self, size: int) -> int:
        """KV splits of the graph for `size` tokens: for the longest list the engine admits."""
        return extend_splits([size], [self.max_model_len], self.model.num_heads,
                             self.model.num_kv_heads, self.inputs.device)

    def graph_forward(self, size: int, variant: str):
        """The step that the graph (size, variant) captures, as a call without arguments."""
        return functools.partial(self._forward, size, variant, self.plan(size))

    def _forward(self, size: int, variant: str, splits: int) -> torch.Tensor:
        top = self.top
        ids, positions = self.inputs[:size], self.inputs[top:top + size]
        offset, logits_row = self.inputs[2 * top:2 * top + 1], self.inputs[2 * top + 1:2 * top + 2]
        counts = self.counts
        indexed = variant == "indexed"
        turning = variant != "plain"
        keys = q_limit = None
        if indexed:
            entries = self.inputs[2 * top + 2:2 * top + 2 + size]
            keys = self.inputs[3 * top + 2:3 * top + 2 + size]
            q_limit = counts[7:7 + size]
            write_slots = self.kv_index[entries].long()
        else:
            write_slots = self.kv_index[offset + self.arange[:size]].long()
        self.write_key_positions(write_slots, positions if keys is None else keys)
        metas = []
        for kind in range(self.model.num_kinds):
            state = TritonState(table=self.slot_table.table, extend=ExtendBatch(
                kv_index=self.kv_index, kv_indptr=counts[0:3], q_starts=counts[3:5],
                q_lens=counts[5:7], max_q_len=size, splits=splits,
                tok_starts=counts[3:5], merge_rows=self.rows32[:size], q_limit=q_limit,
                entry_turns=self.entry_turns if turning else None,
                turn_tables=(self.turn_cos[kind], self.turn_sin[kind]) if turning else None,
                window=self.window(kind, positions)))
            metas.append(AttentionMetadata(write_slots=write_slots, state=state))
        return self.model(ids, positions, logits_row, self.pool, tuple(metas), self.backend,
                          key_positions=keys)

    def can_run(self, works: Sequence) -> bool:
        """One sequence (`graph_step`), at most the largest size of new tokens, at most
        MAX_TURNS distinct deltas."""
        if not works or not self.sizes:
            return False
        step = graph_step(works)
        if (step is None or len(step.token_ids) > self.sizes[-1]
                or len({d for _, _, d in step.turns}) > MAX_TURNS):
            return False
        return not (self.dynamic_rope and max(step.positions) >= self.max_positions)

    def _fill(self, index: torch.Tensor, step: GraphStep, size: int) -> None:
        k, n = index.numel(), len(step.token_ids)
        top = self.top
        pad = size - n
        zeros = [0] * (top - n)
        values = step.token_ids + zeros + step.positions + zeros + [k - n, n - 1]
        counts = [0, k, k + pad, 0, n, n, pad]
        if step.query_index is not None:
            # The padding tokens are the entries after the list, each its own last visible
            # entry of the padding sequence's list.
            values += (list(step.query_index) + list(range(k, k + pad)) + [0] * (top - size)
                       + (step.key_positions or step.positions) + zeros)
            counts += list(step.query_index) + list(range(pad))
            self.counts[:len(counts)].copy_(torch.tensor(counts, dtype=torch.int32),
                                            non_blocking=True)
        else:
            self.counts[:7].copy_(torch.tensor(counts, dtype=torch.int32), non_blocking=True)
        self.inputs[:len(values)].copy_(int64_tensor(values), non_blocking=True)
        self.kv_index[:k].copy_(index)
        self.kv_index[k:k + size].zero_()

    def run(self, works: Sequence) -> torch.Tensor:
        step = graph_step(works)
        n = len(step.token_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        index = self.slot_table.entries(step.kv.row, step.kv_spans)
        self._fill(index, step, size)
        variant = ("indexed" if step.query_index is not None
                   else "turning" if step.turns else "plain")
        if variant != "plain":
            k = index.numel()
            if step.turns:
                table = self.fill_turn_tables([d for _, _, d in step.turns])
                self.entry_turns[:k].copy_(entry_turns(table.by_row(step.turns), k,
                                                       index.device))
            else:
                self.entry_turns[:k].fill_(-1)
            self.entry_turns[k:k + size].fill_(-1)  # the padding sequence's entries
        graph, logits = self.graphs[(size, variant)]
        graph.replay()
        return logits

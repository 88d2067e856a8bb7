"""The Triton attention backend: plans each step's launches of the kernels in
triton_kernels.py (CUDA, or Triton's interpreter on CPU tensors in the tests).

Decode rows are sequences with one query token whose KV list is a prefix of their slot-table
row; every other sequence goes through one `extend` launch. The per-launch inputs are public
(`DecodeBatch`, `ExtendBatch`, `TritonState`): the CUDA graphs (cuda_graph.py) keep persistent
ones and fill them in place before each replay.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from ...cache.kv_pool import KVPool
from ..reposition import Turn, entry_turns
from .base import FUSED_OPS, AttentionBatch, AttentionMetadata
from .triton_kernels import (
    MAX_SPLITS,
    DecodeTurns,
    SlidingWindow,
    decode_attention,
    decode_splits,
    extend_attention,
    extend_splits,
    triton,
)


def padded_ranges(per_seq: list[tuple[Turn, ...]]) -> torch.Tensor:
    """[B, width, 3] int32 on the host: each sequence's (start, end, table row) turns, padded
    with empty ones to the longest (the decode kernel reads only the first `index[b]`)."""
    width = max(len(r) for r in per_seq)
    return torch.tensor([list(r) + [(0, 0, 0)] * (width - len(r)) for r in per_seq],
                        dtype=torch.int32)


@dataclass(slots=True)
class DecodeBatch:
    """Device inputs of the decode kernel; a CUDA graph keeps one per captured batch size and
    fills it in place before each replay."""

    rows: torch.Tensor  # [B] int32: each sequence's row of the slot table
    kv_lens: torch.Tensor  # [B] int32
    q_rows: torch.Tensor  # [B] int32: its query row in the step's tokens
    num_splits: int
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None
    turns: DecodeTurns | None = None
    window: SlidingWindow | None = None


@dataclass(slots=True)
class ExtendBatch:
    """Device inputs of one extend launch (see `extend_attention`)."""

    kv_index: torch.Tensor
    kv_indptr: torch.Tensor
    q_starts: torch.Tensor
    q_lens: torch.Tensor
    max_q_len: int
    splits: int = 1
    tok_starts: torch.Tensor | None = None
    merge_rows: torch.Tensor | None = None
    q_limit: torch.Tensor | None = None
    entry_turns: torch.Tensor | None = None
    turn_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin: keys forward
    window: SlidingWindow | None = None


@dataclass(slots=True)
class TritonState:
    """The backend's state for one step: at most one decode and one extend launch, plus the
    slot table the decode kernel reads its lists from."""

    table: torch.Tensor | None = None
    decode: DecodeBatch | None = None
    extend: ExtendBatch | None = None


def indptr_of(lengths: list[int]) -> list[int]:
    """[0, l0, l0 + l1, ...]: where each of a list of runs starts, and the total."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)


class TritonAttentionBackend:
    """Triton kernels for CUDA; on CUDA it runs with every fused model op (`fused_ops`)."""

    name = "triton"
    damps = False  # damped logits (AttentionBatch.damping) run on the torch backend

    def __init__(self, device: torch.device | None = None) -> None:
        if triton is None:
            raise ValueError("attention_backend='triton' needs Triton (it ships with CUDA "
                             "builds of PyTorch; `pip install triton`)")
        # The fused ops are CUDA kernels; the interpreter (tests on CPU) keeps the torch ops.
        cuda = device is not None and device.type == "cuda"
        self.fused_ops: frozenset[str] = FUSED_OPS if cuda else frozenset()

    def prepare(self, batch: AttentionBatch) -> TritonState:
        state = TritonState(table=batch.table)
        device = batch.write_slots.device
        decode, extend = [], []
        for i in range(batch.num_seqs):
            if batch.q_lens[i] == 1 and batch.prefix[i] and not batch.indexed(i):
                decode.append(i)
            else:
                extend.append(i)
        table = batch.turn_table if any(batch.turns) else None
        window = None
        if batch.window is not None:  # one for both launches: positions are the step's
            window = SlidingWindow(batch.window, batch.query_positions, batch.slot_positions,
                                   None if table is None else table.deltas(device))
        if decode:
            host = torch.tensor([[batch.rows[i] for i in decode],
                                 [batch.kv_lens[i] for i in decode],
                                 [batch.q_starts[i] for i in decode]], dtype=torch.int32)
            dev = host.to(device, non_blocking=True)
            max_kv = max(batch.kv_lens[i] for i in decode)
            state.decode = DecodeBatch(
                rows=dev[0], kv_lens=dev[1], q_rows=dev[2],
                num_splits=decode_splits(len(decode), batch.num_kv_heads, max_kv, device),
                window=window)
            if table is not None and any(batch.turned(i) for i in decode):
                per_seq = [batch.turns[i] for i in decode]
                ranges = padded_ranges(per_seq)
                state.decode.turns = DecodeTurns(
                    ranges=ranges.to(device, non_blocking=True), cos=table.cos, sin=table.sin,
                    index=_int32([len(r) for r in per_seq], device),
                    max_ranges=ranges.shape[1])
        if extend:
            state.extend = self._prepare_extend(batch, extend, device)
            state.extend.window = window
        return state

    @staticmethod
    def _prepare_extend(batch: AttentionBatch, extend: list[int],
                        device: torch.device) -> ExtendBatch:
        q_lens = [batch.q_lens[i] for i in extend]
        kv_lens = [batch.kv_lens[i] for i in extend]
        host = torch.tensor([indptr_of(kv_lens), [batch.q_starts[i] for i in extend] + [0],
                             q_lens + [0]], dtype=torch.int32)
        dev = host.to(device, non_blocking=True)
        launch = ExtendBatch(
            kv_index=torch.cat([batch.kv_indices[i] for i in extend]), kv_indptr=dev[0],
            q_starts=dev[1, :-1], q_lens=dev[2, :-1], max_q_len=max(q_lens),
            splits=extend_splits(q_lens, kv_lens, batch.num_heads, batch.num_kv_heads, device))
        indexed = any(batch.indexed(i) for i in extend)
        if launch.splits > 1 or indexed:
            rows = []
            if launch.splits > 1:
                rows = [t for i in extend
                        for t in range(batch.q_starts[i], batch.q_starts[i] + batch.q_lens[i])]
            dev = _int32(indptr_of(q_lens)[:-1] + rows, device)
            launch.tok_starts = dev[:len(extend)]
            launch.merge_rows = dev[len(extend):] if rows else None
        if indexed:
            # Each query's last visible entry: the diagonal's, kv_len - q_len + t, for all
            # sequences in three launches, then the given entries of the indexed ones.
            tok = indptr_of(q_lens)
            shift = _int32([k - q - t for k, q, t in zip(kv_lens, q_lens, tok, strict=False)],
                           device)
            limit = torch.repeat_interleave(shift, _int32(q_lens, device),
                                            output_size=tok[-1])
            limit += torch.arange(tok[-1], dtype=torch.int32, device=device)
            for j, i in enumerate(extend):
                if batch.indexed(i):
                    limit[tok[j]:tok[j + 1]] = batch.query_index[i]
            launch.q_limit = limit
        if any(batch.turned(i) for i in extend):
            starts = indptr_of(kv_lens)
            turns = [(starts[j] + a, starts[j] + b, row) for j, i in enumerate(extend)
                     if batch.turned(i) for a, b, row in batch.turns[i]]
            launch.entry_turns = entry_turns(turns, starts[-1], device)
            launch.turn_tables = (batch.turn_table.cos, batch.turn_table.sin)
        return launch

    @torch.inference_mode()
    def warmup(self, pool: KVPool, num_heads: int, table: torch.Tensor, pad_row: int,
               windows: bool = False) -> None:
        """Compile every variant of the kernels before the first request: the extend kernel
        with and without KV splits, turned keys, query entries and packed heads, the decode
        kernel with and without turned keys, each with a sliding window too where the model
        has `windows`, and the merge kernel at every tile of split counts. Lengths, counts,
        offsets and window sizes are run-time values, so these are all the variants a
        server meets. The dummy inputs read only the padding slot 0 (`pad_row` of the slot
        table) and write only a scratch output."""
        device = pool.kv.device
        k_cache, v_cache = pool.k[0], pool.v[0]
        head_dim = k_cache.shape[-1]
        i32 = functools.partial(torch.tensor, dtype=torch.int32, device=device)
        q = torch.zeros(2, num_heads, head_dim, dtype=k_cache.dtype, device=device)
        out = torch.empty_like(q)
        tables = (torch.ones(1, head_dim, dtype=torch.float32, device=device),
                  torch.zeros(1, head_dim, dtype=torch.float32, device=device))
        turns = DecodeTurns(ranges=i32([0, 1, 0]), cos=tables[0], sin=tables[1],
                            index=i32([0]), max_ranges=1)
        # Split counts are run-time values: one per tile of the merge kernel (BLOCK_S).
        splits_ladder = [1 << i for i in range(MAX_SPLITS.bit_length())]  # 1, 2, 4, ... 64
        packs = (False, True) if num_heads > k_cache.shape[1] else (False,)
        slid = SlidingWindow(1, torch.zeros(2, dtype=torch.long, device=device), pool.pos,
                             torch.zeros(1, dtype=torch.long, device=device))
        for splits, window in itertools.product(splits_ladder,
                                                (None, slid) if windows else (None,)):
            variants = (itertools.product((False, True), (False, True), packs) if splits <= 2
                        else [(False, False, False)])
            for turning, indexed, pack in variants:
                extend_attention(q, k_cache, v_cache, out, i32([0, 0]), i32([0, 2]), i32([0]),
                                 i32([2]), 2, 1.0, splits, i32([0]), i32([0, 1]),
                                 i32([0, 1]) if indexed else None,
                                 i32([0, -1]) if turning else None,
                                 tables if turning else None, pack=pack, window=window)
            for turning in (False, True):
                decode_attention(q, k_cache, v_cache, out, table, i32([pad_row]), i32([1]),
                                 i32([0]), splits, 1.0, turns=turns if turning else None,
                                 window=window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                pool: KVPool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        pool.k[layer].index_copy_(0, meta.write_slots, k)
        pool.v[layer].index_copy_(0, meta.write_slots, v)
        return self.attend(q, layer, pool, meta, scale)

    def attend(self, q: torch.Tensor, layer: int, pool: KVPool, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        k_cache, v_cache = pool.k[layer], pool.v[layer]
        state: TritonState = meta.state
        out = torch.empty_like(q)
        e = state.extend
        if e is not None:
            extend_attention(q, k_cache, v_cache, out, e.kv_index, e.kv_indptr, e.q_starts,
                             e.q_lens, e.max_q_len, scale, e.splits, e.tok_starts,
                             e.merge_rows, e.q_limit, e.entry_turns, e.turn_tables,
                             window=e.window)
        d = state.decode
        if d is not None:
            decode_attention(q, k_cache, v_cache, out, state.table, d.rows, d.kv_lens,
                             d.q_rows, d.num_splits, scale, d.scratch, d.turns, d.window)
        return out

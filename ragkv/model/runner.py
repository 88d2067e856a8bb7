"""Turns a step's sequence works into tensors, runs the model, returns the logits to sample."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..cache.kv_pool import KVPool
from ..cache.slot_table import PAD_ROW, SlotTable
from ..host_ints import int64_tensor
from ..sampling.noise import uniform_noise
from .attention import AttentionBackend, AttentionMetadata
from .llama import CausalLM


class Work(Protocol):
    """A sequence's share of a step (the scheduler's `SeqWork`): the KV list is the
    concatenation of the `kv_spans` ranges of `request.kv.slots`; its last
    len(token_ids) entries are the slots the new tokens are written to."""

    token_ids: list[int]
    positions: list[int]
    kv_spans: tuple[tuple[int, int], ...]
    sample: bool
    end: int  # flat index after the work's last token
    logits_from: int  # flat index of the first token whose logits are returned (end: none)
    kv_rotations: tuple[tuple[int, int, int], ...]  # (start, end, delta) of the KV list
    # Entries of the KV list the new tokens are (ascending; None: its last len(token_ids)),
    # and the RoPE positions of their keys where these differ from `positions` (recomputed
    # chunk tokens keep their keys at the chunk's base positions, like the cached ones).
    query_index: tuple[int, ...] | None
    key_positions: list[int] | None

    @property
    def request(self): ...


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, backend: AttentionBackend,
                 slot_table: SlotTable, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.slot_table = slot_table
        self.device = device
        self.graphs = None  # DecodeGraphs (cuda_graph.py) once captured
        self.extend_graphs = None  # ExtendGraphs (cuda_graph.py) once captured
        self.num_heads = model.config.num_heads
        self.num_kv_heads = pool.k.shape[2]

    @torch.inference_mode()
    def execute(self, works: Sequence[Work]) -> torch.Tensor:
        """Run one step; returns float32 logits for the tokens [logits_from, end) of each
        work in order ([number of works with sample=True, vocab] when nothing is scored)."""
        kvs = {id(w.request.kv): w.request.kv for w in works}
        self.slot_table.sync(kvs.values())
        if self.graphs is not None and self.graphs.can_run(works):
            return self.graphs.run(works)
        if self.extend_graphs is not None and self.extend_graphs.can_run(works):
            return self.extend_graphs.run(works)
        table = self.slot_table.table
        input_ids: list[int] = []
        positions: list[int] = []
        q_lens, kv_lens, q_starts, self_only, seq_lens = [], [], [], [], []
        rows, prefix = [], []
        kv_indices: list[torch.Tensor] = []
        logits_rows: list[int] = []
        rotations: list[tuple[tuple[int, int, int], ...]] = []
        deltas: dict[int, int] = {}  # delta -> its row in the step's rotation tables
        query_index: list[torch.Tensor | None] = []
        key_positions: list[int] | None = None
        write_parts: list[torch.Tensor] = []
        for w in works:
            row = w.request.kv.row
            spans = w.kv_spans
            index = self.slot_table.entries(row, spans)
            q, k = len(w.token_ids), index.numel()
            at = w.query_index
            if at is not None and at[0] == k - q and at[-1] == k - 1:
                at = None  # the last q entries: the ordinary bottom-right causal case
            if at is None:
                query_index.append(None)
                write_parts.append(index[k - q:])
            else:
                at_dev = torch.tensor(at, device=self.device)
                query_index.append(at_dev)
                write_parts.append(index[at_dev])
            if w.key_positions is not None and key_positions is None:
                key_positions = list(positions)
            if key_positions is not None:
                key_positions.extend(w.key_positions or w.positions)
            q_starts.append(len(input_ids))
            input_ids.extend(w.token_ids)
            positions.extend(w.positions)
            kv_indices.append(index)
            q_lens.append(q)
            kv_lens.append(k)
            self_only.append(q == k)
            seq_lens.append(max(w.positions) + 1)
            rows.append(row)
            prefix.append(len(spans) == 1 and spans[0][0] == 0)
            logits_rows.extend(range(len(input_ids) - (w.end - w.logits_from), len(input_ids)))
            rotations.append(tuple((a, b, deltas.setdefault(d, len(deltas)))
                                   for a, b, d in w.kv_rotations))
        dev = self.device
        write_slots = torch.cat(write_parts).long()
        meta = AttentionMetadata(
            q_lens=q_lens, kv_lens=kv_lens, q_starts=q_starts, kv_indices=kv_indices,
            write_slots=write_slots, self_only=self_only, seq_lens=seq_lens, table=table,
            rows=rows, prefix=prefix, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
        )
        if any(x is not None for x in query_index):
            meta.query_index = query_index
        if deltas:
            # Attention turns each query back by a rotated range's delta instead of turning
            # that range's keys forward: the same scores, for a handful of query rows.
            meta.rotations = rotations
            meta.rotation_cos, meta.rotation_sin = self.model.rotary.rotation(
                [-d for d in deltas])
        self.backend.prepare(meta)
        # One transfer for ids, positions and logits rows.
        n = len(input_ids)
        extra = key_positions or []
        dev_ids = int64_tensor(input_ids + positions + extra + logits_rows).to(dev)
        keys = dev_ids[2 * n:3 * n] if extra else None
        return self.model(dev_ids[:n], dev_ids[n:2 * n], dev_ids[2 * n + len(extra):],
                          self.pool, meta, self.backend, key_positions=keys)

    @torch.inference_mode()
    def warmup(self, num_tokens: int) -> None:
        """On CUDA, run the kernels of an extend and a decode step once at start-up, so that
        compiling them (Triton) or choosing their algorithms (cuBLAS) never delays a request,
        then every other variant of the attention kernels (the backend's `warmup`) and the
        sampler's. The kernels take every length as data, so one shape stands for all. The
        dummy steps read and write only the padding slot 0, which is zeroed again after."""
        if self.device.type != "cuda":
            return
        for q_len, kv_len in ((num_tokens, num_tokens), (1, 2)):
            index = torch.zeros(kv_len, dtype=torch.int32, device=self.device)
            meta = AttentionMetadata(
                q_lens=[q_len], kv_lens=[kv_len], q_starts=[0], kv_indices=[index],
                write_slots=index[kv_len - q_len:].long(), self_only=[q_len == kv_len],
                seq_lens=[kv_len], table=self.slot_table.table, rows=[0],
                prefix=[q_len < kv_len], num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
            )
            self.backend.prepare(meta)
            ids = torch.zeros(q_len, dtype=torch.long, device=self.device)
            positions = torch.arange(kv_len - q_len, kv_len, device=self.device)
            last = torch.tensor([q_len - 1], device=self.device)
            self.model(ids, positions, last, self.pool, meta, self.backend)
        warmup = getattr(self.backend, "warmup", None)
        if warmup is not None:  # every kernel variant, not only the two steps' ones
            warmup(self.pool, self.num_heads, self.slot_table.table, PAD_ROW)
        # The sampler's noise kernel.
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        uniform_noise(zero, zero, self.model.config.vocab_size)
        self.pool.kv[:, :, 0].zero_()
        torch.cuda.synchronize(self.device)

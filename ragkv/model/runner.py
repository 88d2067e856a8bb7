"""Turns a step's sequence works into tensors, runs the model, returns the logits to sample."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..cache.kv_manager import SeqKV
from ..cache.kv_pool import KVPool
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

    @property
    def request(self): ...


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, backend: AttentionBackend,
                 device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = device

    def slot_table(self, kv: SeqKV) -> torch.Tensor:
        """`kv.slots` as a device tensor, kept between steps: only the entries added (or
        rewritten) since the last step are copied, so a decode step costs O(1) per sequence
        here however long its context is."""
        n = len(kv.slots)
        table = kv.mirror
        if table is None or table.numel() < n:
            grown = torch.empty(max(n, 64, 2 * (0 if table is None else table.numel())),
                                dtype=torch.long, device=self.device)
            if table is not None and kv.num_mirrored:
                grown[:kv.num_mirrored] = table[:kv.num_mirrored]
            kv.mirror = table = grown
        if kv.num_mirrored < n:
            start = kv.num_mirrored
            table[start:n] = torch.tensor(kv.slots[start:n], dtype=torch.long).to(self.device)
            kv.num_mirrored = n
        return table

    @torch.inference_mode()
    def execute(self, works: Sequence[Work]) -> torch.Tensor:
        """Run one step; returns float32 logits [number of works with sample=True, vocab]."""
        input_ids: list[int] = []
        positions: list[int] = []
        q_lens, kv_lens, q_starts, self_only, seq_lens = [], [], [], [], []
        kv_indices: list[torch.Tensor] = []
        logits_rows: list[int] = []
        tables: dict[int, torch.Tensor] = {}
        for w in works:
            kv = w.request.kv
            table = tables.get(id(kv))
            if table is None:
                table = tables[id(kv)] = self.slot_table(kv)
            spans = w.kv_spans
            if len(spans) == 1:
                index = table[spans[0][0]:spans[0][1]]
            else:
                index = torch.cat([table[a:b] for a, b in spans])
            q, k = len(w.token_ids), index.numel()
            q_starts.append(len(input_ids))
            input_ids.extend(w.token_ids)
            positions.extend(w.positions)
            kv_indices.append(index)
            q_lens.append(q)
            kv_lens.append(k)
            self_only.append(q == k)
            seq_lens.append(max(w.positions) + 1)
            if w.sample:
                logits_rows.append(len(input_ids) - 1)
        dev = self.device
        write_slots = torch.cat([idx[k - q:] for idx, q, k in zip(kv_indices, q_lens, kv_lens,
                                                                   strict=True)])
        meta = AttentionMetadata(
            q_lens=q_lens, kv_lens=kv_lens, q_starts=q_starts, kv_indices=kv_indices,
            write_slots=write_slots, self_only=self_only, seq_lens=seq_lens,
        )
        self.backend.prepare(meta)
        return self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
            self.pool, meta, self.backend,
        )

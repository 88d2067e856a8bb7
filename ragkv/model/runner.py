"""Turns a step's sequence works into tensors, runs the model, returns the logits to sample."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..cache.kv_pool import KVPool
from .attention import AttentionBackend, AttentionMetadata
from .llama import CausalLM


class Work(Protocol):
    token_ids: list[int]
    positions: list[int]
    kv_indices: list[int]
    sample: bool


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, backend: AttentionBackend,
                 device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = device

    @torch.inference_mode()
    def execute(self, works: Sequence[Work]) -> torch.Tensor:
        """Run one step; returns float32 logits [number of works with sample=True, vocab]."""
        input_ids: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        q_lens, kv_lens, q_starts, self_only, seq_lens = [], [], [], [], []
        logits_rows: list[int] = []
        for w in works:
            q, k = len(w.token_ids), len(w.kv_indices)
            q_starts.append(len(input_ids))
            input_ids.extend(w.token_ids)
            positions.extend(w.positions)
            write_slots.extend(w.kv_indices[k - q:])
            q_lens.append(q)
            kv_lens.append(k)
            self_only.append(q == k)
            seq_lens.append(max(w.positions) + 1)
            if w.sample:
                logits_rows.append(len(input_ids) - 1)
        dev = self.device
        meta = AttentionMetadata(
            q_lens=q_lens, kv_lens=kv_lens, q_starts=q_starts,
            kv_lists=[w.kv_indices for w in works],
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=dev),
            self_only=self_only, seq_lens=seq_lens,
        )
        self.backend.prepare(meta)
        return self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
            self.pool, meta, self.backend,
        )

"""The attention contract and the protocol every backend implements.

Every attention call is the paged "extend" form. For each sequence in the batch:
- its `q` query tokens are consecutive in the flattened token tensor,
- it has a KV index list of length `k >= q` (slots of the KV pool) whose last `q` entries are
  the slots its own new tokens are written to,
- query `t` attends to entries `0 .. k-q+t` of its list (bottom-right causal).

Nothing else: chunk isolation, shared system prompts and decode are all just which slots are
in the list. Positions feed RoPE only and travel separately. A backend writes the step's new
K/V into the pool and computes attention.

Sliding-window layers (`window`) add one rule: a query at position p sees only the entries
of its list whose keys sit at positions > p - window, the key's position being the one its
RoPE rotation says (`KVPool.pos` of its slot, plus the turn of its range below). Attention
kinds with other windows or RoPE tables get their own `AttentionBatch` and prepared state.

Three RAG additions, all in the loads, never in the pool:
- turns (model/reposition.py): ranges of a sequence's list whose keys it sees turned forward
  by a position delta (a cached chunk placed elsewhere than its keys were rotated for);
- query entries (`query_index`): a sequence whose new tokens are not the last q entries of its
  list (selectively recomputed chunk tokens, scattered among cached ones); query t is entry
  query_index[t], writes its K/V there and attends to entries 0 .. query_index[t];
- damping: an offset added to every query's attention logit of given entries (stale chunk
  tokens read by the question and the answer, lowered). Backends without it (`damps`
  False) leave such steps to the torch backend.

The runner describes a step as an `AttentionBatch`; the backend turns it into its own state
once (`prepare`), and the model carries that state in the step's `AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ...cache.kv_pool import KVPool
from ..reposition import Turn, TurnTable, entry_turns, turned_positions

# The fused model ops a backend may offer (`AttentionBackend.fused_ops`): the residual add and
# RMSNorm, silu(gate) * up, and RoPE on q and k with the K/V store (then `attend`).
FUSED_OPS = frozenset({"rms_norm", "silu_mul", "rope_store"})


@dataclass(slots=True)
class AttentionBatch:
    """One step's sequences in the contract's terms, built by the runner for `prepare`."""

    q_lens: list[int]
    kv_lens: list[int]
    q_starts: list[int]  # each sequence's first row in the flattened tokens
    kv_indices: list[torch.Tensor]  # each sequence's KV slot list (on the device)
    write_slots: torch.Tensor  # [T] slot of each new token
    num_heads: int
    num_kv_heads: int
    # The persistent slot table (model/slot_table.py) and each sequence's row in it; where
    # `prefix[i]`, sequence i's KV list is the first kv_lens[i] entries of its row.
    table: torch.Tensor | None = None
    rows: list[int] = field(default_factory=list)
    prefix: list[bool] = field(default_factory=list)
    # Per sequence, its (start, end, row) turns (rows of `turn_table`); empty: none this step.
    turns: list[tuple[Turn, ...]] = field(default_factory=list)
    turn_table: TurnTable | None = None
    # Per sequence, its query entries (ascending, on the device) or None for bottom-right
    # causal; empty: none this step.
    query_index: list[torch.Tensor | None] = field(default_factory=list)
    # The sliding window of the layers this batch serves and what applying it needs: each
    # new token's position [T] and each slot's key position (KVPool.pos), on the device;
    # `windowed[i]`: whether the window may hide a key from sequence i (some query at a
    # position >= window). None: no window, or none that hides anything this step.
    window: int | None = None
    query_positions: torch.Tensor | None = None
    slot_positions: torch.Tensor | None = None
    windowed: list[bool] = field(default_factory=list)
    # Per sequence, the offsets [n] (float32, on the device) added to every query's logits of
    # the first n entries of its list (`damping_offsets`), or None; empty: none this step.
    damping: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    def turned(self, i: int) -> bool:
        """Whether sequence i sees some of its keys turned."""
        return bool(self.turns and self.turns[i])

    def indexed(self, i: int) -> bool:
        """Whether sequence i's queries sit at given entries of its list (`query_index`)."""
        return bool(self.query_index) and self.query_index[i] is not None

    def mask(self, i: int, device: torch.device) -> torch.Tensor | None:
        """[q, m] bool mask of sequence i over the last m entries of its KV list (the entries
        before them are seen by every query), None when every query sees the whole list."""
        q, k = self.q_lens[i], self.kv_lens[i]
        if self.indexed(i):
            index = self.query_index[i]
            first = int(index[0])  # ascending: no query sees less than the first one does
            return torch.arange(first, k, device=device)[None, :] <= index[:, None]
        return causal_mask(q, q, device) if q > 1 else None

    def damped(self, i: int) -> bool:
        """Whether sequence i's logits of some entries are offset (`damping`)."""
        return bool(self.damping) and self.damping[i] is not None

    def offsets(self, i: int, k: int | None = None) -> torch.Tensor:
        """[k] float32 logit offsets of sequence i over its whole list (k: its length)."""
        k = self.kv_lens[i] if k is None else k
        d = self.damping[i][:k]
        return d if d.shape[0] == k else torch.cat([d, d.new_zeros(k - d.shape[0])])

    def windows(self, i: int) -> bool:
        """Whether sequence i's attention is cut by the sliding window (`window_mask`)."""
        return self.window is not None and self.windowed[i]

    def key_positions(self, i: int) -> torch.Tensor:
        """[k] the position of each entry of sequence i's list as the sequence sees it: its
        slot's key position, turned forward by its range's delta."""
        return turned_positions(self.slot_positions[self.kv_indices[i].long()],
                                self.turns[i] if self.turned(i) else (), self.turn_table)

    def window_mask(self, i: int, device: torch.device) -> torch.Tensor:
        """[q, k] bool over sequence i's whole list: the contract's mask (`mask`) and the
        sliding window together."""
        q, k = self.q_lens[i], self.kv_lens[i]
        qs = self.q_starts[i]
        qpos = self.query_positions[qs:qs + q]
        visible = qpos[:, None] - self.key_positions(i)[None, :] < self.window
        tail = self.mask(i, device)
        if tail is not None:
            visible[:, k - tail.shape[1]:] &= tail
        return visible


@dataclass(slots=True)
class AttentionMetadata:
    """What the model carries through one step: where the new K/V go, the backend's prepared
    `state`, and for dynamic RoPE each sequence's length after the step and its token count
    (None: no sequence needs them)."""

    write_slots: torch.Tensor
    state: object = None
    seq_lens: list[int] | None = None
    q_lens: list[int] | None = None


class AttentionBackend(Protocol):
    name: str
    # The fused model ops (FUSED_OPS) this backend runs with; the runner switches them on.
    fused_ops: frozenset[str]
    # Whether it applies `AttentionBatch.damping` (else the runner runs such steps on torch).
    damps: bool

    def prepare(self, batch: AttentionBatch) -> object:
        """The backend's state for one step, derived once from `batch`."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                pool: KVPool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, heads, d], k/v: [T, kv_heads, d] -> [T, heads, d]. Writes k/v to the pool
        at `meta.write_slots` first."""

    def attend(self, q: torch.Tensor, layer: int, pool: KVPool, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """`forward` for a step whose new K/V are already in the pool (the fused
        `rope_store` wrote them)."""

    def warmup(self, pool: KVPool, num_heads: int, table: torch.Tensor, pad_row: int,
               windows: bool = False) -> None:
        """Compile or choose every kernel variant a server will meet, before the first
        request (`windows`: the model has sliding-window layers); reads only the padding
        slot and row."""


def causal_mask(q: int, k: int, device: torch.device) -> torch.Tensor:
    """[q, k] bool, bottom-right causal: query t sees entries 0 .. k-q+t."""
    rows = torch.arange(q, device=device)[:, None] + (k - q)
    return torch.arange(k, device=device)[None, :] <= rows


def damping_offsets(ranges: tuple[tuple[int, int], ...], damping: float,
                    device: torch.device) -> torch.Tensor:
    """[end of the last range] float32: -damping inside the (start, end) ranges, 0 between
    them; the ranges marked as turns' are (`entry_turns`, a few launches for any number)."""
    inside = entry_turns([(a, b, 0) for a, b in ranges], ranges[-1][1], device) >= 0
    return torch.where(inside, -float(damping), 0.0).to(torch.float32)

"""The attention contract and its backends.

Every attention call is the paged "extend" form. For each sequence in the batch:
- its `q` query tokens are consecutive in the flattened token tensor,
- it has a KV index list of length `k >= q` (slots of the KV pool) whose last `q` entries are
  the slots its own new tokens are written to,
- query `t` attends to entries `0 .. k-q+t` of its list (bottom-right causal).

Nothing else: chunk isolation, shared system prompts and decode are all just which slots are
in the list. Positions feed RoPE only and travel separately. A backend writes the step's new
K/V into the pool and computes attention; GPU kernels implement the same interface.

One addition for re-positioned chunks: a sequence may name ranges of its list whose keys it
sees rotated by a position delta (a cached chunk placed elsewhere than where its keys were
rotated; see engine/request.py). The pool is never modified for this, so a chunk's slots stay
one copy shared by every request, whatever position each gives it. RoPE makes a score depend
on the rotation of q against k only, so the backend may turn the query back by the delta
instead of turning the keys forward: (R(-d) q) . k = q . (R(d) k).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from ..cache.kv_pool import KVPool
from .layers import apply_rotary


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs, built by the runner and handed to the model for that step."""

    q_lens: list[int]
    kv_lens: list[int]
    q_starts: list[int]
    kv_indices: list[torch.Tensor]  # each sequence's KV slot list (long, on the device)
    write_slots: torch.Tensor  # [T] slot of each new token
    # True where a sequence's KV list is exactly its own new tokens (a fresh prefill): the
    # backend may then attend over the new K/V directly instead of gathering from the pool.
    self_only: list[bool]
    # For dynamic RoPE: each sequence's length after this step.
    seq_lens: list[int]
    # The persistent slot table (cache/slot_table.py) and each sequence's row in it; where
    # `prefix[i]`, sequence i's KV list is the first kv_lens[i] entries of its row.
    table: torch.Tensor | None = None
    rows: list[int] = field(default_factory=list)
    prefix: list[bool] = field(default_factory=list)
    num_heads: int = 0
    num_kv_heads: int = 0
    backend_state: object = field(default=None)
    # Re-positioned ranges: per sequence, (start, end, row) ranges of its KV list whose keys
    # are seen rotated by a delta; row r of `rotation_cos` / `rotation_sin` ([R, head_dim])
    # holds the rotation by minus that delta, to apply to the queries. Empty: none this step.
    rotations: list[tuple[tuple[int, int, int], ...]] = field(default_factory=list)
    rotation_cos: torch.Tensor | None = None
    rotation_sin: torch.Tensor | None = None
    # Sequences whose new tokens are not the last q entries of their KV list (selectively
    # recomputed chunk tokens, scattered among cached ones): query t is entry query_index[i][t]
    # of the list, writes its K/V there and attends to entries 0 .. query_index[i][t]. None
    # for the others (bottom-right causal); empty: none this step.
    query_index: list[torch.Tensor | None] = field(default_factory=list)

    def rotated(self, i: int) -> bool:
        """Whether sequence i sees some of its keys rotated."""
        return bool(self.rotations and self.rotations[i])

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

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Derive backend-specific tensors once per step (stored in meta.backend_state)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                pool: KVPool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, heads, d], k/v: [T, kv_heads, d] -> [T, heads, d]. Writes k/v to the pool."""


@dataclass(slots=True)
class _TorchState:
    # Sequences with one query token (decode) are attended in one padded call.
    decode_rows: torch.Tensor | None = None  # their token rows in the flattened batch
    all_decode: bool = False  # every row is a decode row, in order: no row gather needed
    decode_index: torch.Tensor | None = None  # [B, max_k] slots, padded with slot 0
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_k] True where attended
    # When decode rows have re-positioned keys: each entry's segment [B, max_k] (0: keys as
    # stored, j: the row's j-th rotated range) and each row's query turns [B, m, head_dim]
    # (cos, sin; turn 0 is the identity). See `turned_decode`.
    decode_turns: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    extend_seqs: list[int] = field(default_factory=list)
    # Slot index tensors of the extend sequences that read the pool (not self_only).
    extend_index: dict[int, torch.Tensor] = field(default_factory=dict)
    masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # Masks of sequences attended through `attend_rotated` (AttentionMetadata.mask).
    seq_masks: dict[int, torch.Tensor | None] = field(default_factory=dict)


def causal_mask(q: int, k: int, device: torch.device) -> torch.Tensor:
    """[q, k] bool, bottom-right causal: query t sees entries 0 .. k-q+t."""
    rows = torch.arange(q, device=device)[:, None] + (k - q)
    return torch.arange(k, device=device)[None, :] <= rows


def rotated_probs(q: torch.Tensor, ks: torch.Tensor,
                  rotations: tuple[tuple[int, int, int], ...], cos: torch.Tensor | None,
                  sin: torch.Tensor | None, scale: float,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """Attention weights of one sequence whose key ranges may be re-positioned, in float32:
    [kv_heads, group * q_len, k] (the query heads of each KV head, query-major).

    q: [q_len, heads, d]; ks: [k, kv_heads, d], its gathered KV list; `rotations`: (start,
    end, row) ranges, ascending and disjoint, whose scores use the queries turned by
    `cos[row]`, `sin[row]`; mask: [q_len, m] bool over the last m entries (True: attended;
    the entries before them are seen by every query) or None (all). The scores of each range
    come from one matmul against the queries turned for it, so the cost over plain attention
    is rotating q_len query rows per range, not the range's keys."""
    q_len, heads, d = q.shape
    k_len, kv_heads = ks.shape[0], ks.shape[1]
    group = heads // kv_heads
    # Scores and weights in float32 whatever the model dtype, as flash kernels keep them
    # (a no-op in float32).
    q, ks = q.float(), ks.float()

    def grouped(x: torch.Tensor) -> torch.Tensor:
        # [q_len, heads, d] -> [kv_heads, group * q_len, d]: the query heads of each KV head.
        return x.view(q_len, kv_heads, group, d).permute(1, 2, 0, 3).reshape(
            kv_heads, group * q_len, d)

    # A [kv_heads, d, k] view of the gathered [k, kv_heads, d] rows: a unit stride in one of
    # its last two dimensions, so matmul reads it in place.
    keys = ks.permute(1, 2, 0)
    plain = grouped(q)
    parts = []
    done = 0
    for start, end, row in rotations:
        if done < start:
            parts.append(plain @ keys[:, :, done:start])
        turned = apply_rotary(q, cos[row].expand(q_len, d), sin[row].expand(q_len, d))
        parts.append(grouped(turned) @ keys[:, :, start:end])
        done = end
    if done < k_len:
        parts.append(plain @ keys[:, :, done:])
    scores = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    scores.mul_(scale)
    if mask is not None:
        m = mask.shape[1]
        tail = scores.view(kv_heads, group, q_len, k_len)[..., k_len - m:]
        tail.masked_fill_(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


def rotated_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                      rotations: tuple[tuple[int, int, int], ...], cos: torch.Tensor | None,
                      sin: torch.Tensor | None, scale: float,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """One sequence's attention when ranges of its keys are re-positioned (or its mask is
    not bottom-right causal): `rotated_probs` times the values, [q_len, heads, d]."""
    q_len, heads, d = q.shape
    kv_heads = ks.shape[1]
    probs = rotated_probs(q, ks, rotations, cos, sin, scale, mask)
    out = probs @ vs.float().transpose(0, 1)  # [kv_heads, group * q_len, d]
    return out.view(kv_heads, heads // kv_heads, q_len, d).permute(2, 0, 1, 3).reshape(
        q_len, heads, d).to(q.dtype)


def build_decode_turns(meta: AttentionMetadata, decode: list[int], max_k: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_TorchState.decode_turns` of the decode rows `decode` (padded to `max_k` entries)."""
    m = 1 + max(len(meta.rotations[i]) for i in decode)
    segment = torch.zeros(len(decode), max_k, dtype=torch.long)
    turn = torch.zeros(len(decode), m, dtype=torch.long)  # row of the extended tables below
    for b, i in enumerate(decode):
        for j, (start, end, row) in enumerate(meta.rotations[i], 1):
            segment[b, start:end] = j
            turn[b, j] = row + 1
    d = meta.rotation_cos.shape[-1]
    cos = torch.cat([meta.rotation_cos.new_ones(1, d), meta.rotation_cos])
    sin = torch.cat([meta.rotation_sin.new_zeros(1, d), meta.rotation_sin])
    turn = turn.to(device)
    return segment.to(device), cos[turn], sin[turn]


def turned_decode(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, segment: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    """Batched decode attention with re-positioned key ranges, in float32.

    q: [B, heads, d]; ks, vs: [B, kv_heads, k, d]; segment: [B, k], which of the row's m
    query turns (cos, sin: [B, m, d]) each entry is scored with; mask: [B, 1, 1, k] or None.
    Every query is turned m ways and scored against all entries ([B, kv_heads, m * group,
    k]: m times the products of plain decode, which reads each key once either way), then
    each entry keeps the score of its own turn."""
    batch, heads, d = q.shape
    kv_heads, k_len = ks.shape[1], ks.shape[2]
    group, m = heads // kv_heads, cos.shape[1]
    # Each query turned m ways: [B * m, heads, d] rows with their own cos, sin.
    turned = apply_rotary(q.float()[:, None].expand(batch, m, heads, d).reshape(-1, heads, d),
                          cos.reshape(-1, d), sin.reshape(-1, d))
    turned = turned.view(batch, m, kv_heads, group, d)
    pick = segment[:, None, None, :].expand(batch, 1, group, k_len)
    ks, vs = ks.float(), vs.float()
    out = q.new_empty(batch, kv_heads, group, d, dtype=torch.float32)
    # One KV head at a time: ks[:, h] is a batch of row-major matrices that bmm reads in
    # place; the whole [B, kv_heads, k, d] view would be copied first.
    for h in range(kv_heads):
        rows = turned[:, :, h].reshape(batch, m * group, d)
        scores = torch.bmm(rows, ks[:, h].transpose(1, 2))  # [B, m * group, k]
        scores = scores.view(batch, m, group, k_len).gather(1, pick).squeeze(1)
        scores.mul_(scale)
        if mask is not None:
            scores.masked_fill_(~mask[:, 0], float("-inf"))
        torch.bmm(torch.softmax(scores, dim=-1), vs[:, h], out=out[:, h])
    return out.view(batch, heads, d).to(q.dtype)


def rotated_keys_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                           rotations: tuple[tuple[int, int, int], ...],
                           cos: torch.Tensor | None, sin: torch.Tensor | None, scale: float,
                           mask: torch.Tensor | None) -> torch.Tensor:
    """`rotated_attention` computed the other way round, for many queries: the gathered keys
    of each range are turned forward by its delta, in float32, then one fused SDPA call
    attends. `ks` must be the caller's own gathered copy (never a view of the pool): in
    float32 it is turned in place. Turning queries costs q_len rows per range and
    scores materialized range by range; turning keys costs the ranges' rows once, so it wins
    once a sequence has more than a few queries (selectively recomputed chunk tokens)."""
    q_len, heads, d = q.shape
    k_len = ks.shape[0]
    ks = ks.float()
    for start, end, row in rotations:
        end = min(end, k_len)
        if start < end:
            n = end - start
            # cos and sin turn by minus the delta (for queries); -sin turns by plus it.
            ks[start:end] = apply_rotary(ks[start:end], cos[row].expand(n, d),
                                         (-sin[row]).expand(n, d))
    full = None
    if mask is not None:
        seen = mask.new_ones(q_len, k_len - mask.shape[1])
        full = torch.cat([seen, mask], dim=1) if seen.shape[1] else mask
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
        vs.float().transpose(0, 1).unsqueeze(0), attn_mask=full, scale=scale,
        enable_gqa=heads != ks.shape[1])
    return o[0].transpose(0, 1).to(q.dtype)


# From this many queries on, a re-positioned sequence turns its keys instead of its queries.
_TURN_KEYS_FROM = 64


def attend_rotated(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, i: int, index: torch.Tensor,
                   mask: torch.Tensor | None, scale: float, out: torch.Tensor) -> None:
    """Sequence i of the step through `rotated_attention` (or `rotated_keys_attention` when
    it has many queries), written into its rows of `out`."""
    qs, ql = meta.q_starts[i], meta.q_lens[i]
    rotations = meta.rotations[i] if meta.rotated(i) else ()
    attend = rotated_keys_attention if ql >= _TURN_KEYS_FROM else rotated_attention
    out[qs:qs + ql] = attend(
        q[qs:qs + ql], k_cache.index_select(0, index), v_cache.index_select(0, index),
        rotations, meta.rotation_cos, meta.rotation_sin, scale, mask)


class TorchAttentionBackend:
    """Gather by slot index + torch SDPA. Works on any device; the CPU reference backend."""

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        state = _TorchState()
        decode = [i for i, q in enumerate(meta.q_lens) if q == 1]
        state.extend_seqs = [i for i, q in enumerate(meta.q_lens) if q != 1]
        device = meta.write_slots.device
        if decode:
            lens = [meta.kv_lens[i] for i in decode]
            max_k = max(lens)
            # Padded with slot 0, which always holds zeros (see KVPool).
            state.decode_index = pad_sequence([meta.kv_indices[i] for i in decode],
                                              batch_first=True, padding_value=0)
            if min(lens) != max_k:
                lengths = torch.tensor(lens, device=device)
                mask = torch.arange(max_k, device=device)[None, :] < lengths[:, None]
                state.decode_mask = mask[:, None, None, :]
            state.decode_rows = torch.tensor([meta.q_starts[i] for i in decode], device=device)
            state.all_decode = len(decode) == meta.num_seqs
            if any(meta.rotated(i) for i in decode):
                state.decode_turns = build_decode_turns(meta, decode, max_k, device)
        for i in state.extend_seqs:
            q, k = meta.q_lens[i], meta.kv_lens[i]
            if meta.rotated(i) or meta.indexed(i):
                # Gathered from the pool even when the list is only the new tokens (recomputed
                # chunk tokens with no S before them): the new K/V are written first.
                state.seq_masks[i] = meta.mask(i, device)
                state.extend_index[i] = meta.kv_indices[i]
                continue
            if not meta.self_only[i]:
                state.extend_index[i] = meta.kv_indices[i]
            if q != k and (q, k) not in state.masks:
                state.masks[(q, k)] = causal_mask(q, k, device)
        meta.backend_state = state

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                pool: KVPool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = pool.k[layer], pool.v[layer]  # contiguous [slots, kv_heads, d]
        k_cache.index_copy_(0, meta.write_slots, k)
        v_cache.index_copy_(0, meta.write_slots, v)
        state: _TorchState = meta.backend_state
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty_like(q)
        for i in state.extend_seqs:
            qs, ql, kl = meta.q_starts[i], meta.q_lens[i], meta.kv_lens[i]
            if i in state.seq_masks:
                attend_rotated(q, k_cache, v_cache, meta, i, state.extend_index[i],
                               state.seq_masks[i], scale, out)
                continue
            if meta.self_only[i]:
                ks, vs = k[qs:qs + ql], v[qs:qs + ql]
            else:
                idx = state.extend_index[i]
                ks, vs = k_cache.index_select(0, idx), v_cache.index_select(0, idx)
            o = F.scaled_dot_product_attention(
                q[qs:qs + ql].transpose(0, 1).unsqueeze(0),
                ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
                attn_mask=state.masks.get((ql, kl)),
                is_causal=ql == kl,
                scale=scale,
                enable_gqa=gqa,
            )
            out[qs:qs + ql] = o[0].transpose(0, 1)
        if state.decode_rows is not None:
            # Gather from the contiguous per-layer views: index_select over a strided view
            # of the whole pool falls back to a slow path.
            index = state.decode_index
            flat = index.view(-1)
            shape = (*index.shape, *k_cache.shape[1:])
            ks = k_cache.index_select(0, flat).view(shape).transpose(1, 2)  # [B, kvh, k, d]
            vs = v_cache.index_select(0, flat).view(shape).transpose(1, 2)
            qd = q if state.all_decode else q[state.decode_rows]
            if state.decode_turns is not None:
                o = turned_decode(qd, ks, vs, *state.decode_turns, state.decode_mask, scale)
            else:
                o = F.scaled_dot_product_attention(
                    qd.unsqueeze(2), ks, vs, attn_mask=state.decode_mask, scale=scale,
                    enable_gqa=gqa,
                )[:, :, 0]
            if state.all_decode:
                return o
            out[state.decode_rows] = o
        return out


def get_attention_backend(name: str = "torch",
                          device: torch.device | None = None) -> AttentionBackend:
    """The backend called `name`; "auto" is Triton on CUDA when it imports, else torch.
    Triton is imported only when asked for, so CPU machines never need it."""
    if name == "auto":
        if device is None or device.type != "cuda":
            return TorchAttentionBackend()
        from . import triton_attention

        name = "triton" if triton_attention.available() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from .triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: auto, torch, triton")

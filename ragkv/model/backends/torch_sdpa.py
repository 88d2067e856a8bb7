"""The torch attention backend: gather by slot index, then torch SDPA. Runs on any device and
is the CPU reference; the turned (re-positioned) and indexed (recomputed) sequences of the
contract (base.py) go through the helpers here, which the recompute probe uses too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from ...cache.kv_pool import KVPool
from ..layers import apply_rotary
from ..reposition import Turn, TurnTable
from .base import AttentionBatch, AttentionMetadata, causal_mask


@dataclass(slots=True)
class _TorchState:
    # Sequences with one query token (decode) are attended in one padded call.
    decode_rows: torch.Tensor | None = None  # their token rows in the flattened batch
    all_decode: bool = False  # every row is a decode row, in order: no row gather needed
    decode_index: torch.Tensor | None = None  # [B, max_k] slots, padded with slot 0
    # [B, 1, 1, max_k] True where attended; float (-inf where not, plus the logit offsets)
    # when some decode row is damped.
    decode_mask: torch.Tensor | None = None
    # When decode rows have turns: each entry's segment [B, max_k] (0: keys as stored, j:
    # the row's j-th turn) and each row's query turns [B, m, head_dim] (cos, sin turning the
    # query back; turn 0 is the identity). See `turned_decode`.
    decode_turns: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    extend_seqs: list[int] = field(default_factory=list)
    # Slot index tensors of the extend sequences that read the pool (not self_only).
    extend_index: dict[int, torch.Tensor] = field(default_factory=dict)
    masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # Masks of sequences attended through `attend_turned` (AttentionBatch.mask).
    seq_masks: dict[int, torch.Tensor | None] = field(default_factory=dict)
    # [k] logit offsets of the damped extend sequences (AttentionBatch.offsets).
    seq_offsets: dict[int, torch.Tensor] = field(default_factory=dict)
    # [q, k] masks of sequences whose sliding window cuts (`attend_windowed`).
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    batch: AttentionBatch | None = None


def turned_probs(q: torch.Tensor, ks: torch.Tensor, turns: tuple[Turn, ...],
                 table: TurnTable | None, scale: float,
                 mask: torch.Tensor | None, offsets: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Attention weights of one sequence whose keys may be turned, in float32:
    [kv_heads, group * q_len, k] (the query heads of each KV head, query-major).

    q: [q_len, heads, d]; ks: [k, kv_heads, d], its gathered KV list; `turns`: (start, end,
    row) ranges of `table`, ascending and disjoint; mask: [q_len, m] bool over the last m
    entries (True: attended; the entries before them are seen by every query) or None (all);
    offsets: [k] added to every query's scores (damping) or None. The scores of each turn
    come from one matmul against the queries turned back by its delta, so the cost over
    plain attention is rotating q_len query rows per turn, not the turn's keys."""
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
    cos, sin = table.for_queries() if turns else (None, None)
    for start, end, row in turns:
        if done < start:
            parts.append(plain @ keys[:, :, done:start])
        turned = apply_rotary(q, cos[row].expand(q_len, d), sin[row].expand(q_len, d))
        parts.append(grouped(turned) @ keys[:, :, start:end])
        done = end
    if done < k_len:
        parts.append(plain @ keys[:, :, done:])
    scores = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    scores.mul_(scale)
    if offsets is not None:
        scores.add_(offsets)
    if mask is not None:
        m = mask.shape[1]
        tail = scores.view(kv_heads, group, q_len, k_len)[..., k_len - m:]
        tail.masked_fill_(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


def turned_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                     turns: tuple[Turn, ...], table: TurnTable | None, scale: float,
                     mask: torch.Tensor | None, offsets: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """One sequence's attention when some of its keys are turned (or its mask is not
    bottom-right causal, or its logits offset): `turned_probs` times the values,
    [q_len, heads, d]."""
    q_len, heads, d = q.shape
    kv_heads = ks.shape[1]
    probs = turned_probs(q, ks, turns, table, scale, mask, offsets)
    out = probs @ vs.float().transpose(0, 1)  # [kv_heads, group * q_len, d]
    return out.view(kv_heads, heads // kv_heads, q_len, d).permute(2, 0, 1, 3).reshape(
        q_len, heads, d).to(q.dtype)


def build_decode_turns(batch: AttentionBatch, decode: list[int], max_k: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_TorchState.decode_turns` of the decode rows `decode` (padded to `max_k` entries)."""
    m = 1 + max(len(batch.turns[i]) for i in decode)
    segment = torch.zeros(len(decode), max_k, dtype=torch.long)
    turn = torch.zeros(len(decode), m, dtype=torch.long)  # row of the extended tables below
    for b, i in enumerate(decode):
        for j, (start, end, row) in enumerate(batch.turns[i], 1):
            segment[b, start:end] = j
            turn[b, j] = row + 1
    back_cos, back_sin = batch.turn_table.for_queries()
    d = back_cos.shape[-1]
    cos = torch.cat([back_cos.new_ones(1, d), back_cos])
    sin = torch.cat([back_sin.new_zeros(1, d), back_sin])
    turn = turn.to(device)
    return segment.to(device), cos[turn], sin[turn]


def turned_decode(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, segment: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    """Batched decode attention with turned keys, in float32.

    q: [B, heads, d]; ks, vs: [B, kv_heads, k, d]; segment: [B, k], which of the row's m
    query turns (cos, sin: [B, m, d]) each entry is scored with; mask: [B, 1, 1, k] or None.
    Every query is turned m ways and scored against all entries ([B, kv_heads, m * group,
    k]: m times the products of plain decode, which reads each key once either way), then
    each entry keeps the score of its own turn. A float mask is added (damped rows)."""
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
        if mask is not None and mask.dtype == torch.bool:
            scores.masked_fill_(~mask[:, 0], float("-inf"))
        elif mask is not None:
            scores.add_(mask[:, 0])
        torch.bmm(torch.softmax(scores, dim=-1), vs[:, h], out=out[:, h])
    return out.view(batch, heads, d).to(q.dtype)


def turn_keys(ks: torch.Tensor, turns: tuple[Turn, ...], table: TurnTable | None
              ) -> torch.Tensor:
    """Gathered keys [k, kv_heads, d] in float32, each turn's range turned forward by its
    delta: in place when `ks` is already float32 (so it must be the caller's own copy, never
    a view of the pool)."""
    ks = ks.float()
    k_len, d = ks.shape[0], ks.shape[-1]
    for start, end, row in turns:
        end = min(end, k_len)
        if start < end:
            n = end - start
            ks[start:end] = apply_rotary(ks[start:end], table.cos[row].expand(n, d),
                                         table.sin[row].expand(n, d))
    return ks


def turned_keys_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                          turns: tuple[Turn, ...], table: TurnTable | None, scale: float,
                          mask: torch.Tensor | None, offsets: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """`turned_attention` computed the other way round, for many queries: the gathered keys
    of each turn are turned forward by its delta, in float32, then one fused SDPA call
    attends. `ks` must be the caller's own gathered copy (never a view of the pool): in
    float32 it is turned in place. Turning queries costs q_len rows per range and
    scores materialized range by range; turning keys costs the ranges' rows once, so it wins
    once a sequence has more than a few queries (selectively recomputed chunk tokens)."""
    q_len, heads, d = q.shape
    k_len = ks.shape[0]
    ks = turn_keys(ks, turns, table)
    qf, vs = q.float(), vs.float()

    def sdpa(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             attn_mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        o = F.scaled_dot_product_attention(
            rows.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), attn_mask=attn_mask, is_causal=causal,
            scale=scale, enable_gqa=heads != keys.shape[1])
        return o[0].transpose(0, 1)

    if mask is None:
        return sdpa(qf, ks, vs, None if offsets is None else offsets[None]).to(q.dtype)
    m = mask.shape[1]
    seen = k_len - m  # entries every query sees
    if m == q_len and 2 * q_len > k_len and offsets is None:
        # Each row of a mask sees a prefix of its entries (queries ascend), so a square mask
        # is causal: the queries are the last q_len entries. Padded in front with `seen` zero
        # rows (their output dropped), it is SDPA's own causal case, whose kernel skips the
        # masked blocks: half the work of an explicit mask (r = 1 costs a full prefill).
        if seen:
            qf = torch.cat([qf.new_zeros(seen, heads, d), qf])
        return sdpa(qf, ks, vs, None, causal=True)[seen:].to(q.dtype)
    # Scattered queries (a selective recompute): row blocks, each over the entries up to the
    # widest view among its rows (its last), so the masked tail is not computed.
    out = torch.empty(q_len, heads, d, dtype=q.dtype, device=q.device)
    block = max(64, -(-q_len // 4))
    for t0 in range(0, q_len, block):
        t1 = min(q_len, t0 + block)
        width = int(mask[t1 - 1].sum())
        rows = mask[t0:t1, :width]
        if seen:
            rows = torch.cat([rows.new_ones(t1 - t0, seen), rows], dim=1)
        end = seen + width
        if offsets is not None:
            rows = offset_mask(rows, offsets[:end])
        out[t0:t1] = sdpa(qf[t0:t1], ks[:end], vs[:end], rows).to(q.dtype)
    return out


def attend_windowed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: AttentionBatch, i: int, mask: torch.Tensor, scale: float,
                    out: torch.Tensor, offsets: torch.Tensor | None = None) -> None:
    """Sequence i of the step under its [q, k] window mask (AttentionBatch.window_mask),
    keys turned first, in row blocks: each block attends over the span of entries some of
    its rows see (a window keeps that span about window + block wide in long prompts)."""
    qs, ql = batch.q_starts[i], batch.q_lens[i]
    index = batch.kv_indices[i]
    ks = k_cache.index_select(0, index)
    if batch.turned(i):
        ks = turn_keys(ks, batch.turns[i], batch.turn_table)  # a float32 copy, turned
    ks, vs = ks.float(), v_cache.index_select(0, index).float()
    qf = q[qs:qs + ql].float()
    heads = q.shape[1]
    for t0 in range(0, ql, _WINDOW_BLOCK):
        t1 = min(ql, t0 + _WINDOW_BLOCK)
        rows = mask[t0:t1]
        seen = rows.any(0).nonzero()
        a, b = int(seen[0]), int(seen[-1]) + 1
        rows = rows[:, a:b]
        if offsets is not None:
            rows = offset_mask(rows, offsets[a:b])
        o = F.scaled_dot_product_attention(
            qf[t0:t1].transpose(0, 1).unsqueeze(0), ks[a:b].transpose(0, 1).unsqueeze(0),
            vs[a:b].transpose(0, 1).unsqueeze(0), attn_mask=rows, scale=scale,
            enable_gqa=heads != ks.shape[1])
        out[qs + t0:qs + t1] = o[0].transpose(0, 1).to(q.dtype)


# Query rows per block of `attend_windowed`.
_WINDOW_BLOCK = 256


def decode_window_mask(batch: AttentionBatch, decode: list[int], max_k: int,
                       device: torch.device) -> torch.Tensor:
    """[B, 1, 1, max_k] bool for the decode rows `decode`: the entries each sees through the
    sliding window (True on the padding, which the length mask hides)."""
    rows = []
    for i in decode:
        k = batch.kv_lens[i]
        near = torch.ones(max_k, dtype=torch.bool, device=device)
        if batch.windows(i):
            qpos = batch.query_positions[batch.q_starts[i]]
            near[:k] = qpos - batch.key_positions(i) < batch.window
        rows.append(near)
    return torch.stack(rows)[:, None, None, :]


def decode_offsets(batch: AttentionBatch, decode: list[int], max_k: int,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """[B, 1, 1, max_k] float32 for the decode rows `decode`: each row's logit offsets
    (AttentionBatch.offsets; 0 past them), -inf where the bool `mask` hides an entry."""
    offsets = torch.zeros(len(decode), max_k, device=batch.write_slots.device)
    for b, i in enumerate(decode):
        if batch.damped(i):
            offsets[b] = batch.offsets(i, max_k)
    if mask is not None:
        offsets = offset_mask(mask[:, 0, 0], offsets)
    return offsets[:, None, None, :]


def offset_mask(visible: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A float mask from a bool one (`visible`) and logit offsets over its last dimension:
    the offset where visible, -inf elsewhere."""
    return offsets.expand(visible.shape).masked_fill(~visible, float("-inf"))


# A sequence with turns turns its keys instead of its queries from this many queries on, or
# from one query per this many of its entries if that comes first. Turning the queries costs a
# score matmul per turned range, turning the keys a rotation of every entry and a masked SDPA
# call, so the crossover grows with the entries: on a 2-core AVX-512 CPU (7 turns) near 12
# queries over 580 entries, 20 over 1,100 and 56 over 2,144 (docs/benchmarks.md).
_TURN_KEYS_FROM = 64
_ENTRIES_PER_QUERY = 40


def attend_turned(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  batch: AttentionBatch, i: int, index: torch.Tensor,
                  mask: torch.Tensor | None, scale: float, out: torch.Tensor,
                  offsets: torch.Tensor | None = None) -> None:
    """Sequence i of the step through `turned_attention` (or `turned_keys_attention` when
    it has many queries), written into its rows of `out`."""
    qs, ql = batch.q_starts[i], batch.q_lens[i]
    turns = batch.turns[i] if batch.turned(i) else ()
    keys_first = ql >= min(_TURN_KEYS_FROM, index.shape[0] / _ENTRIES_PER_QUERY)
    attend = turned_keys_attention if keys_first else turned_attention
    out[qs:qs + ql] = attend(
        q[qs:qs + ql], k_cache.index_select(0, index), v_cache.index_select(0, index),
        turns, batch.turn_table, scale, mask, offsets)


class TorchAttentionBackend:
    """Gather by slot index + torch SDPA. Works on any device; the CPU reference backend."""

    name = "torch"
    fused_ops: frozenset[str] = frozenset()
    damps = True

    def prepare(self, batch: AttentionBatch) -> _TorchState:
        state = _TorchState(batch=batch)
        decode = [i for i, q in enumerate(batch.q_lens) if q == 1]
        state.extend_seqs = [i for i, q in enumerate(batch.q_lens) if q != 1]
        device = batch.write_slots.device
        if decode:
            lens = [batch.kv_lens[i] for i in decode]
            max_k = max(lens)
            # Padded with slot 0, which always holds zeros (see KVPool).
            state.decode_index = pad_sequence([batch.kv_indices[i] for i in decode],
                                              batch_first=True, padding_value=0)
            if min(lens) != max_k:
                lengths = torch.tensor(lens, device=device)
                mask = torch.arange(max_k, device=device)[None, :] < lengths[:, None]
                state.decode_mask = mask[:, None, None, :]
            if any(batch.windows(i) for i in decode):
                near = decode_window_mask(batch, decode, max_k, device)
                state.decode_mask = (near if state.decode_mask is None
                                     else state.decode_mask & near)
            state.decode_rows = torch.tensor([batch.q_starts[i] for i in decode], device=device)
            state.all_decode = len(decode) == batch.num_seqs
            if any(batch.turned(i) for i in decode):
                state.decode_turns = build_decode_turns(batch, decode, max_k, device)
            if any(batch.damped(i) for i in decode):
                state.decode_mask = decode_offsets(batch, decode, max_k, state.decode_mask)
        for i in state.extend_seqs:
            q, k = batch.q_lens[i], batch.kv_lens[i]
            if batch.damped(i):
                state.seq_offsets[i] = batch.offsets(i)
            if batch.windows(i):
                state.window_masks[i] = batch.window_mask(i, device)
                continue
            if batch.turned(i) or batch.indexed(i) or batch.damped(i):
                # Gathered from the pool even when the list is only the new tokens (recomputed
                # chunk tokens with no S before them): the new K/V are written first.
                state.seq_masks[i] = batch.mask(i, device)
                state.extend_index[i] = batch.kv_indices[i]
                continue
            if q != k:
                state.extend_index[i] = batch.kv_indices[i]
                if (q, k) not in state.masks:
                    state.masks[(q, k)] = causal_mask(q, k, device)
        return state

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                pool: KVPool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = pool.k[layer], pool.v[layer]  # contiguous [slots, kv_heads, d]
        k_cache.index_copy_(0, meta.write_slots, k)
        v_cache.index_copy_(0, meta.write_slots, v)
        return self._attend(q, k_cache, v_cache, meta.state, scale, k, v)

    def attend(self, q: torch.Tensor, layer: int, pool: KVPool, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        return self._attend(q, pool.k[layer], pool.v[layer], meta.state, scale)

    def warmup(self, pool: KVPool, num_heads: int, table: torch.Tensor, pad_row: int,
               windows: bool = False) -> None:
        """Nothing to compile."""

    @staticmethod
    def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                state: _TorchState, scale: float, k: torch.Tensor | None = None,
                v: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the pool; a fresh prefill (a list of only its new tokens) reads the
        new `k`, `v` directly when given instead of gathering them back."""
        batch = state.batch
        gqa = q.shape[1] != k_cache.shape[1]
        out = torch.empty_like(q)
        for i in state.extend_seqs:
            qs, ql, kl = batch.q_starts[i], batch.q_lens[i], batch.kv_lens[i]
            if i in state.window_masks:
                attend_windowed(q, k_cache, v_cache, batch, i, state.window_masks[i], scale,
                                out, state.seq_offsets.get(i))
                continue
            if i in state.seq_masks:
                attend_turned(q, k_cache, v_cache, batch, i, state.extend_index[i],
                              state.seq_masks[i], scale, out, state.seq_offsets.get(i))
                continue
            if ql == kl and k is not None:
                ks, vs = k[qs:qs + ql], v[qs:qs + ql]
            else:
                idx = state.extend_index.get(i, batch.kv_indices[i])
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

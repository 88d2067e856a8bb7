"""The selective-recompute probe: a few layers of the model over a request's cached KV,
read-only, to score its chunk tokens. It is a kind of work of the step: the scheduler plans it
(planner.py) in the step that completes the request's chunks, the model runner executes it
after that step's forward, and its scores come back through the scheduler's update, which
chooses R from them (selection.py).

The probed tokens run through layers 0 .. max(check layers) of the model's own layer loop
(`CausalLM.run_layers`) as queries at their places in the prompt, attending (bottom-right
causal) to the request's KV list: S and the chunks as cached, turned like any reuse, plus — for
question tokens — their own fresh K/V. The question's tokens write theirs to the slots the
question will compute into later (`own_slots`, the request's own), so outside the check layers
a `query` probe is the model's step itself, through the attention backend (on a GPU, the
Triton kernels and fused ops); the cached KV is never written. Scores, one per chunk token:
- `blend`: the chunk tokens probe themselves; at a check layer, how far their fresh K and V
  (keys at the chunk's base positions, like the cached ones) lie from the cached K and V. At
  layer 0 both are the same function of the token, so the deviation starts at layer 1, after
  one layer of attention across chunks;
- `query`: the question tokens probe; at a check layer, the attention weight all their heads
  give each chunk token.
Each check layer's scores are divided by their total, so layers weigh alike when several are
checked. Each layer's gathered keys are turned forward in one rotation (a private float32 copy;
per-entry cos/sin built once per probe), whatever the number of chunks: a probe is a few dozen
operations per layer, which on a GPU are launched one by one. Attention whose weights are not
wanted is then one fused call; where they are, queries go in row blocks so the [heads, rows,
keys] weights stay bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.kv_manager import SeqKV
from ..cache.kv_pool import KVPool
from ..model.backends.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    causal_mask,
)
from ..model.backends.torch_sdpa import turned_keys_attention, turned_probs
from ..model.layers import apply_rotary
from ..model.llama import Attention, CausalLM
from ..model.reposition import Turn, TurnTable, turned_positions

# Bound on the attention weights one block of probe queries materializes (float32 elements).
_BLOCK_ELEMENTS = 1 << 25


@dataclass(slots=True)
class ProbeWork:
    """One request's probe in a step. `kind`: "blend" (`token_ids` are the chunk tokens) or
    "query" (the question tokens); `kv_slots`: the request's KV list up to the question (S and
    the chunks, flat order); `turns`: (start, end, delta) of its re-positioned chunks;
    `chunks`: [start, end) of the chunk tokens in that list; `skip`: the chunk tokens at its
    front a `blend` probe leaves out (`token_ids` starts after them; their scores stay 0)."""

    request: object  # the engine's Request, handed back with the scores
    kind: str
    token_ids: list[int]
    positions: list[int]
    key_positions: list[int]
    kv_slots: list[int]
    turns: tuple[Turn, ...]
    chunks: tuple[int, int]
    check_layers: tuple[int, ...]
    skip: int = 0
    # Chunk tokens a `blend` probe takes through the layers at a time (the step's token
    # budget): its activations stay one step's; only the keys it gathers grow with the
    # chunks' length (102 MB in all for 32k tokens of SmolLM2's shape, ~8 GB in one pass).
    block_tokens: int = 1 << 30
    # `query`: the request's slots for the probed tokens (the question's own), which the
    # probe's layers write; empty: the fresh K/V stay in the probe (any attention backend).
    own_slots: list[int] = field(default_factory=list)

    @property
    def kv(self) -> SeqKV:
        return self.request.kv

    @torch.inference_mode()
    def run(self, model: CausalLM, pool: KVPool,
            backend: AttentionBackend | None = None) -> torch.Tensor:
        """Scores [chunk tokens] (float32, CPU); `backend`: the runner's, for the layers a
        `query` probe with `own_slots` runs as a step."""
        device = pool.k.device
        index = torch.tensor(self.kv_slots, dtype=torch.long, device=device)
        deltas = sorted({d for _, _, d in self.turns})
        # Per attention kind (its RoPE), the turns' table and each entry's rotation.
        tables = [TurnTable.build(rotary, deltas) for rotary in model.rotaries]
        rows = tables[0].by_row(self.turns)  # the same rows in every table
        rotations = [t.per_entry(rows, len(self.kv_slots)) for t in tables]
        # Where the model has sliding windows: each list entry's position as the request
        # sees it (its slot's key position, turned).
        entry_pos = (turned_positions(pool.pos[index], rows, tables[0]) if model.has_windows
                     else None)
        first, last = self.chunks
        scores = torch.zeros(last - first, dtype=torch.float64, device=device)
        if self.kind != "blend":
            step = None
            if backend is not None and self.own_slots:
                step = self._step(model, pool, backend, index, tables, rows)
            self._probe(model, pool, index, rotations, entry_pos, 0, len(self.token_ids),
                        scores, step)
            return scores.float().cpu()
        # The chunk tokens attend to the cached KV alone, not to each other's fresh K/V, so
        # they go through the layers `block_tokens` at a time: memory stays within the step
        # budget whatever the chunks' length. Each check layer's deviations are divided by
        # their total over all the tokens at the end.
        deviations = {layer: torch.zeros_like(scores) for layer in self.check_layers}
        for t0 in range(self.skip, last - first, self.block_tokens):
            t1 = min(last - first, t0 + self.block_tokens)
            self._probe(model, pool, index, rotations, entry_pos, t0, t1, deviations)
        for layer in sorted(deviations):
            dev = deviations[layer]
            scores.add_(dev / dev.sum().clamp_min(1e-30))
        return scores.float().cpu()

    def _step(self, model: CausalLM, pool: KVPool, backend: AttentionBackend,
              index: torch.Tensor, tables: list[TurnTable], rows: tuple[Turn, ...]
              ) -> tuple[AttentionBackend, tuple[AttentionMetadata, ...]]:
        """The probed tokens as one step of the attention backend: a sequence whose list is
        the request's up to the question (`index`, on the device) plus the tokens' own
        slots, keys turned like any reuse; one metadata per attention kind."""
        device = index.device
        own = torch.tensor(self.own_slots, dtype=torch.long, device=device)
        entries = torch.cat([index, own]).to(torch.int32)
        positions = torch.tensor(self.positions, device=device)
        if model.has_windows:  # the keys the step writes, at their positions
            pool.pos[own] = torch.tensor(self.key_positions, dtype=torch.int32, device=device)
        metas = []
        for table, window in zip(tables, model.windows, strict=True):
            batch = AttentionBatch(
                q_lens=[len(self.own_slots)],
                kv_lens=[len(self.kv_slots) + len(self.own_slots)], q_starts=[0],
                kv_indices=[entries], write_slots=own, num_heads=model.num_heads,
                num_kv_heads=pool.k.shape[2], rows=[0], prefix=[False])
            if rows:
                batch.turns, batch.turn_table = [rows], table
            if window is not None and max(self.positions) >= window:
                batch.window, batch.windowed = window, [True]
                batch.query_positions, batch.slot_positions = positions, pool.pos
            metas.append(AttentionMetadata(write_slots=own, state=backend.prepare(batch)))
        return backend, tuple(metas)

    def _probe(self, model: CausalLM, pool: KVPool, index: torch.Tensor,
               rotations: list[tuple[torch.Tensor, torch.Tensor] | None],
               entry_pos: torch.Tensor | None, t0: int, t1: int, into,
               step: tuple[AttentionBackend, tuple[AttentionMetadata, ...]] | None = None
               ) -> None:
        """Probed tokens t0 .. t1-1 through the layers: `query` adds its normalized weights
        to the scores `into`; `blend` puts each check layer's deviations of its tokens
        (chunk tokens t0 .. t1-1) into `into[layer]`. `rotations`: per attention kind, each
        list entry's cos/sin turning its key forward (`TurnTable.per_entry`); `entry_pos`:
        each entry's position (None: no sliding window). `step` (a `query` probe with its
        own slots): the layers outside the check layers run as the backend's step."""
        device = pool.k.device
        p0, p1 = t0 - self.skip, t1 - self.skip  # blend: token_ids begin at `skip`
        positions = torch.tensor(self.positions[p0:p1], device=device)
        key_positions = torch.tensor(self.key_positions[p0:p1], device=device)
        ropes = [r.cos_sin(positions) for r in model.rotaries]
        key_ropes = [r.cos_sin(key_positions) for r in model.rotaries]
        first, last = self.chunks
        check_layers = self.check_layers
        final = max(check_layers)
        blend = self.kind == "blend"
        # What the block's queries attend to: for `blend` the cached list up to its last
        # token, for `query` all of it plus the question's own fresh K/V.
        visible = first + t1 if blend else len(self.kv_slots)
        # Per window, [n, entries] whether each query is near enough each entry to see it.
        near = {}
        if entry_pos is not None:
            keys_at = entry_pos[:visible]
            if not blend:
                keys_at = torch.cat([keys_at, key_positions])
            for w in set(model.windows) - {None}:
                near[w] = positions[:, None] - keys_at[None, :] < w

        def attend(i: int, attn: Attention, x: torch.Tensor) -> torch.Tensor | None:
            kind = model.layer_kind[i]
            cos, sin = ropes[kind]
            if step is not None and i not in check_layers:
                return attn.forward(x, cos, sin, i, pool, step[1][kind], step[0])
            rotation = rotations[kind]
            q, k, v = attn.qkv(x, cos, sin, key_ropes[kind])
            keys = pool.k[i].index_select(0, index[:visible])
            values = pool.v[i].index_select(0, index[:visible])
            if blend:
                if i in check_layers:
                    fresh = torch.cat([k, v], dim=1).float()
                    cached = torch.cat([keys[first + t0:first + t1],
                                        values[first + t0:first + t1]], dim=1).float()
                    # Squares summed over every rank's KV heads (tensor parallelism), then
                    # the root; a KV head held by several ranks scales every token's sum
                    # alike, which the layer's normalization takes out.
                    squares = (fresh - cached).square().sum(dim=(1, 2))
                    into[i][t0:t1] = model.tp.all_reduce(squares).sqrt().double()
                if i == final:
                    return None  # the deviation needs this layer's K/V only
            if rotation is not None:
                keys = apply_rotary(keys.float(), rotation[0][:visible], rotation[1][:visible])
            if not blend:
                keys, values = torch.cat([keys, k.to(keys.dtype)]), torch.cat([values, v])
            weigh = (first, last) if not blend and i in check_layers else None
            out, weight = _attend(q, keys, values, attn.scale, weigh,
                                  near.get(model.windows[kind]))
            if weight is not None:  # summed over every rank's heads
                weight = model.tp.all_reduce(weight)
                into.add_(weight / weight.sum().clamp_min(1e-30))
            if i == final:
                return None
            return attn.output(out)

        ids = torch.tensor(self.token_ids[p0:p1], device=device)
        model.run_layers(model.embed(ids), attend)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            weigh: tuple[int, int] | None, near: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bottom-right causal attention of q over keys (already turned) in row blocks (each
    block's scores stay within _BLOCK_ELEMENTS); with `weigh` = [a, b) also the attention
    weight of all queries and heads on each of entries a .. b-1 (float64). `near`: [n,
    k_len] the entries each query's sliding window lets it see."""
    n, heads, d = q.shape
    k_len, kv_heads = keys.shape[0], keys.shape[1]
    block = max(1, _BLOCK_ELEMENTS // (heads * k_len))
    plain = near is None and weigh is None  # no window, no weights: fused calls
    if plain and block >= n:  # one fused call over turned keys
        mask = causal_mask(n, n, q.device) if n > 1 else None
        return turned_keys_attention(q, keys, values, (), None, scale, mask), None
    if plain:
        # The same, block by block: each block of queries over the entries up to its last
        # one, the mask over its own rows.
        out = torch.empty_like(q)
        for t0 in range(0, n, block):
            t1 = min(n, t0 + block)
            seen = k_len - n + t1
            mask = causal_mask(t1 - t0, t1 - t0, q.device) if t1 - t0 > 1 else None
            out[t0:t1] = turned_keys_attention(q[t0:t1], keys[:seen], values[:seen], (),
                                               None, scale, mask)
        return out, None
    group = heads // kv_heads
    out = torch.empty_like(q)
    weight = None
    if weigh is not None:
        weight = torch.zeros(weigh[1] - weigh[0], dtype=torch.float64, device=q.device)
    vs = values.float().transpose(0, 1)
    for t0 in range(0, n, block):
        t1 = min(n, t0 + block)
        # Query t sees entries 0 .. k_len - n + t; the mask covers the entries after the
        # first query's last.
        seen = torch.arange(t0, t1, device=q.device)[:, None] + (k_len - n)
        mask = torch.arange(k_len - n + t0, k_len, device=q.device)[None, :] <= seen
        if near is not None:
            mask = torch.cat([mask.new_ones(t1 - t0, k_len - mask.shape[1]), mask], dim=1)
            mask &= near[t0:t1]
        probs = turned_probs(q[t0:t1], keys, (), None, scale, mask)
        if weight is not None:
            weight += probs[..., weigh[0]:weigh[1]].sum(dim=(0, 1)).double()
        o = probs @ vs  # [kv_heads, group * rows, d]
        out[t0:t1] = o.view(kv_heads, group, t1 - t0, d).permute(2, 0, 1, 3).reshape(
            t1 - t0, heads, d).to(q.dtype)
    return out, weight

"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3) over flattened, unpadded
tokens.

The families differ only in switches of `ModelConfig`: bias on q/k/v (Qwen2) or on all
projections (Llama's attention_bias), RMSNorm on q and k per head (Qwen3, Gemma 3), an explicit
head dimension, tied embeddings; Gemma 3's norms around attention and MLP, scaled embedding,
attention scale and final soft-capping. Layers come in attention *kinds* (`ModelConfig.
attention_kinds`): a sliding window and a RoPE of their own (Gemma 3: sliding layers with base
10k, full ones with 1M). Each kind has its rotary table and its attention metadata per step
(the window and the turn table are the kind's); most models have one kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..cache.kv_pool import KVPool
from .backends import triton_ops
from .backends.base import AttentionBackend, AttentionMetadata
from .layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rotary, empty_param
from .model_config import ModelConfig
from .parallel import SINGLE, Shard, TPGroup
from .quantized_linear import Int4Linear, RowRoute


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism); with
    it, o_proj's partial outputs are summed over the ranks."""

    def __init__(self, mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                 tp: TPGroup = SINGLE) -> None:
        super().__init__()
        shard = tp.heads(mc.num_heads, mc.num_kv_heads)
        self.tp = tp if tp.size > 1 else None
        self.num_heads = shard.q_count
        self.num_kv_heads = shard.kv_count
        self.head_dim = mc.head_dim
        self.q_size = self.num_heads * mc.head_dim
        self.kv_size = self.num_kv_heads * mc.head_dim
        self.scale = (mc.query_pre_attn_scalar or mc.head_dim) ** -0.5
        self.qkv_proj = Linear(mc.hidden_size, self.q_size + 2 * self.kv_size, mc.qkv_bias,
                               dtype, device)
        self.o_proj = Linear(self.q_size, mc.hidden_size, mc.o_bias, dtype, device)
        if mc.qk_norm:
            self.q_norm = RMSNorm(mc.head_dim, mc.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(mc.head_dim, mc.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        # RoPE on q and k plus the K/V store in one kernel (the backend's "rope_store").
        self.fused = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                pool: KVPool, meta: AttentionMetadata, backend: AttentionBackend,
                key_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`key_rope`: cos, sin for the keys where they differ from the queries'."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.fused:
            q = triton_ops.rope_store(self.qkv_proj.forward(x), cos, sin, heads, kv_heads,
                                      self.head_dim, pool.k[layer], pool.v[layer],
                                      meta.write_slots, key_rope)
            out = backend.attend(q, layer, pool, meta, self.scale)
            return self.output(out)
        if key_rope is not None:
            q, k, v = self.qkv(x, cos, sin, key_rope)
            out = backend.forward(q, k, v, layer, pool, meta, self.scale)
            return self.output(out)
        qkv = self.qkv_proj.forward(x).view(x.shape[0], heads + 2 * kv_heads, self.head_dim)
        v = qkv[:, heads + kv_heads:]
        if self.q_norm is None:
            # q and k rotate together: one set of kernels for both (decode is op-bound).
            qk = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q = apply_rotary(self.q_norm.forward(qkv[:, :heads]), cos, sin)
            k = apply_rotary(self.k_norm.forward(qkv[:, heads:heads + kv_heads]), cos, sin)
        out = backend.forward(q, k, v, layer, pool, meta, self.scale)
        return self.output(out)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj of the heads' outputs [T, heads, d], summed over the ranks."""
        out = self.o_proj.forward(out.reshape(-1, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            key_rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """q, k, v [T, heads or kv_heads, d] with q and k rotated by their own positions."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj.forward(x).view(x.shape[0], heads + 2 * kv_heads, self.head_dim)
        q, k = qkv[:, :heads], qkv[:, heads:heads + kv_heads]
        if self.q_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        return (apply_rotary(q, cos, sin), apply_rotary(k, *key_rope),
                qkv[:, heads + kv_heads:])


class DecoderLayer(nn.Module):
    def __init__(self, mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                 tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(mc, dtype, device, tp)
        self.mlp = GatedMLP(mc.hidden_size, tp.share(mc.intermediate_size)[1], mc.mlp_bias,
                            mc.hidden_act, dtype, device, tp if tp.size > 1 else None)
        self.input_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype, device)
        # The norm before the MLP (Llama's post_attention_layernorm, Gemma's
        # pre_feedforward_layernorm).
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype, device)
        # Gemma's norms of the attention and MLP outputs, before their residual adds.
        self.attn_output_norm = self.mlp_output_norm = None
        if mc.sandwich_norms:
            self.attn_output_norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype, device)
            self.mlp_output_norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype, device)


class CausalLM(nn.Module):
    """The whole model. `forward` computes hidden states for every token but runs the final
    norm and LM head only on the rows in `logits_indices` (the last token of each sequence that
    samples this step). With tensor parallelism (`tp`, model/parallel.py) each rank's model
    holds its heads and MLP slice; `num_heads` / `num_kv_heads` are this rank's."""

    def __init__(self, mc: ModelConfig, max_len: int, dtype: torch.dtype,
                 device: torch.device, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = mc
        self.tp = tp
        shard = tp.heads(mc.num_heads, mc.num_kv_heads)
        self.num_heads, self.num_kv_heads = shard.q_count, shard.kv_count
        self.embed_tokens = nn.Parameter(
            torch.empty(mc.vocab_size, mc.hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.layers = nn.ModuleList(DecoderLayer(mc, dtype, device, tp)
                                    for _ in range(mc.num_layers))
        self.norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype, device)
        # Rank 0 alone samples: a tensor-parallel worker holds no LM head and computes no
        # logits (its CUDA graphs neither), which spares it vocab x hidden weights.
        self.samples = tp.rank == 0
        self.lm_head = (None if mc.tie_word_embeddings or not self.samples
                        else empty_param(mc.vocab_size, mc.hidden_size, dtype=dtype, device=device))
        kinds, self.layer_kind = mc.attention_kinds
        # Per attention kind, its window and its rotary table.
        self.windows = tuple(window for window, _ in kinds)
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(mc.head_dim, rope, mc.max_position_embeddings, max_len, dtype,
                            device) for _, rope in kinds)
        self.rotary = self.rotaries[0]
        # The embedding and the LM head held packed (`--quantization gguf`), or None; with
        # packed layers, the path of each row (quantized_linear.RowRoute), set per forward.
        self.packed_embedding: Int4Linear | None = None
        self.packed_head: Int4Linear | None = None
        self.route: RowRoute | None = None
        self.dtype = dtype

    def pack_embedding(self, layer: Int4Linear) -> None:
        """Read token embeddings from `layer`'s packed rows (and, tied, the logits)."""
        self.packed_embedding = layer
        self.embed_tokens = None
        if self.config.tie_word_embeddings:
            self.packed_head = layer

    def pack_head(self, layer: Int4Linear) -> None:
        self.packed_head = layer
        self.lm_head = None

    @property
    def num_kinds(self) -> int:
        return len(self.windows)

    @property
    def has_windows(self) -> bool:
        """Whether some layers have a sliding window."""
        return any(w is not None for w in self.windows)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedded tokens [len(ids), hidden]: the residual stream's start."""
        if self.packed_embedding is not None:
            x = self.packed_embedding.rows(ids, self.dtype)
        else:
            x = self.embed_tokens[ids]
        if self.config.embed_scale is not None:
            # As HF: the scale rounded to the weights' dtype first.
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor, pool: KVPool,
                meta: AttentionMetadata | tuple[AttentionMetadata, ...],
                backend: AttentionBackend,
                key_positions: torch.Tensor | None = None,
                prompt_rows: int | None = None) -> torch.Tensor:
        """`meta`: the step's metadata, or one per attention kind (`num_kinds`) where they
        differ (a window that cuts, turns). `key_positions`: RoPE positions of the keys where
        they differ from `positions` (selectively recomputed chunk tokens); never with dynamic
        RoPE. `prompt_rows`: with packed layers, the first rows are that many prompt tokens,
        the rest generated ones (RowRoute)."""
        metas = meta if isinstance(meta, tuple) else (meta,) * self.num_kinds
        ropes = [r.cos_sin(positions, metas[0].seq_lens, metas[0].q_lens)
                 for r in self.rotaries]
        key_ropes = ([None] * self.num_kinds if key_positions is None
                     else [r.cos_sin(key_positions) for r in self.rotaries])
        kind_of = self.layer_kind

        def attend(i: int, attn: Attention, x: torch.Tensor) -> torch.Tensor:
            k = kind_of[i]
            return attn.forward(x, *ropes[k], i, pool, metas[k], backend, key_ropes[k])

        if self.route is not None:
            self.route.prompt_rows = prompt_rows
        try:
            h, residual = self.run_layers(self.embed(input_ids), attend)
        finally:
            if self.route is not None:
                self.route.prompt_rows = None  # the head and the probes go by size
        if not self.samples:
            return residual.new_empty(len(logits_indices), 0, dtype=torch.float32)
        h = self.norm.forward(residual[logits_indices] + h[logits_indices])
        if self.packed_head is not None:
            logits = self.packed_head.forward(h).float()
        else:
            head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
            logits = torch.nn.functional.linear(h, head).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def run_layers(self, residual: torch.Tensor,
                   attend: Callable[[int, Attention, torch.Tensor], torch.Tensor | None]
                   ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The decoder layers over the residual stream `residual` (the embedded tokens), as
        every caller runs them (the forward, the recompute probe): `attend(i, attention, x)`
        is layer i's attention output (after o_proj) for its normalized input x; None stops
        the loop there. Returns the last MLP output and the residual stream, whose sum is the
        hidden state (None and the stream so far when stopped).

        Sub-modules are called through .forward: no hooks are used, and skipping
        nn.Module.__call__ matters when a decode step is a few hundred tiny ops. The residual
        stream's adds happen inside the next norm (forward_add): the same arithmetic as
        h = h + f(h), one kernel fewer per add where the norm is fused."""
        h = None
        for i, layer in enumerate(self.layers):
            if h is None:
                x = layer.input_layernorm.forward(residual)
            else:
                x, residual = layer.input_layernorm.forward_add(h, residual)
            h = attend(i, layer.self_attn, x)
            if h is None:
                return None, residual
            if layer.attn_output_norm is not None:
                h = layer.attn_output_norm.forward(h)
            x, residual = layer.post_attention_layernorm.forward_add(h, residual)
            h = layer.mlp.forward(x)
            if layer.mlp_output_norm is not None:
                h = layer.mlp_output_norm.forward(h)
        return h, residual

    def use_fused_ops(self, ops: frozenset[str]) -> None:
        """Run the fused kernels `ops` (backends/base.py FUSED_OPS) that the attention
        backend offers: the norms' residual add, the MLP activation, RoPE + KV store."""
        norms = "rms_norm" in ops
        self.norm.fused = norms
        for layer in self.layers:
            layer.input_layernorm.fused = norms
            layer.post_attention_layernorm.fused = norms
            if layer.attn_output_norm is not None:
                layer.attn_output_norm.fused = layer.mlp_output_norm.fused = norms
            layer.mlp.fused = "silu_mul" in ops
            # Qwen3's q/k norms come before RoPE, which the fused kernel does not apply.
            attn = layer.self_attn
            attn.fused = "rope_store" in ops and attn.q_norm is None
            if attn.q_norm is not None:
                attn.q_norm.fused = attn.k_norm.fused = norms

    def weight_targets(self) -> Iterator[tuple[str, torch.Tensor, int, int, Shard | None]]:
        """(HF checkpoint name, destination parameter, row offset, rows, shard) for every
        weight; `shard`: the part of the checkpoint tensor this rank holds (None: all of it)."""
        mc = self.config
        yield "model.embed_tokens.weight", self.embed_tokens, 0, mc.vocab_size, None
        yield "model.norm.weight", self.norm.weight, 0, mc.hidden_size, None
        if self.lm_head is not None:
            yield "lm_head.weight", self.lm_head, 0, mc.vocab_size, None
        d = mc.head_dim
        heads = self.tp.heads(mc.num_heads, mc.num_kv_heads)
        q, kv = heads.q_count * d, heads.kv_count * d
        inter_start, inter = self.tp.share(mc.intermediate_size)
        parallel = self.tp.size > 1
        q_rows = Shard(0, heads.q_start * d, q) if parallel else None
        kv_rows = Shard(0, heads.kv_start * d, kv) if parallel else None
        q_cols = Shard(1, heads.q_start * d, q) if parallel else None
        i_rows = Shard(0, inter_start, inter) if parallel else None
        i_cols = Shard(1, inter_start, inter) if parallel else None
        # A row-parallel layer's bias is added once, by rank 0, before the sum over ranks.
        out_bias = Shard(0, 0, 0, zero=True) if self.tp.rank > 0 else None
        norm = mc.hidden_size
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            for suffix in ("weight", "bias") if mc.qkv_bias else ("weight",):
                dest = getattr(attn.qkv_proj, suffix)
                yield p + f"self_attn.q_proj.{suffix}", dest, 0, q, q_rows
                yield p + f"self_attn.k_proj.{suffix}", dest, q, kv, kv_rows
                yield p + f"self_attn.v_proj.{suffix}", dest, q + kv, kv, kv_rows
            yield p + "self_attn.o_proj.weight", attn.o_proj.weight, 0, norm, q_cols
            if mc.o_bias:
                yield p + "self_attn.o_proj.bias", attn.o_proj.bias, 0, norm, out_bias
            if mc.qk_norm:
                yield p + "self_attn.q_norm.weight", attn.q_norm.weight, 0, d, None
                yield p + "self_attn.k_norm.weight", attn.k_norm.weight, 0, d, None
            mlp = layer.mlp
            for suffix in ("weight", "bias") if mc.mlp_bias else ("weight",):
                gate_up = getattr(mlp.gate_up_proj, suffix)
                yield p + f"mlp.gate_proj.{suffix}", gate_up, 0, inter, i_rows
                yield p + f"mlp.up_proj.{suffix}", gate_up, inter, inter, i_rows
                down = getattr(mlp.down_proj, suffix)
                yield (p + f"mlp.down_proj.{suffix}", down, 0, norm,
                       i_cols if suffix == "weight" else out_bias)
            yield p + "input_layernorm.weight", layer.input_layernorm.weight, 0, norm, None
            if mc.sandwich_norms:  # HF's Gemma names
                yield (p + "post_attention_layernorm.weight", layer.attn_output_norm.weight, 0,
                       norm, None)
                yield (p + "pre_feedforward_layernorm.weight",
                       layer.post_attention_layernorm.weight, 0, norm, None)
                yield (p + "post_feedforward_layernorm.weight", layer.mlp_output_norm.weight,
                       0, norm, None)
            else:
                yield (p + "post_attention_layernorm.weight",
                       layer.post_attention_layernorm.weight, 0, norm, None)

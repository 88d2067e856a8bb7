"""Building blocks shared by the supported model families: RMSNorm, rotary embeddings, MLP.

Numerics follow HF transformers (norms in float32, RoPE tables computed in float32 and cast
to the model dtype) so that float32 outputs match it to rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .backends import triton_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised frozen parameter: weights always come from the checkpoint."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = empty_param(dim, dtype=dtype, device=device)
        self.eps = eps
        self.fused = False  # one fused kernel (CausalLM.use_fused_ops)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x): the residual stream's add fused in."""
        if self.fused:
            return triton_ops.rms_norm(x, self.weight, self.eps, residual)
        total = residual + x
        return self.forward(total), total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return triton_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            # One fused kernel; the same arithmetic as below when nothing needs casting.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


# On CPU, with weights streamed from memory (each read once per step, as in a forward pass),
# BLAS's `x @ W.T` costs about what one row costs up to a few rows, and `W @ x.T` twice that
# from 2 rows on; from about 10 to 32 rows `W @ x.T` is the faster one (up to 30% on
# builtin:small at 16 rows). Measured with torch 2.13 on the project's 2-core machine
# (docs/benchmarks.md: "Small matmuls, streamed").
_SMALL_BATCH_ROWS = range(9, 33)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (Not when compiled: the batch is a symbol there, and inductor picks its own GEMM.)
        if (x.dim() == 2 and x.device.type == "cpu" and not torch.compiler.is_compiling()
                and x.shape[0] in _SMALL_BATCH_ROWS):
            out = torch.mm(self.weight, x.t()).t().contiguous()
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul. With tensor
    parallelism (`tp`) `intermediate` is this rank's slice, and down's partial outputs are
    summed over the ranks."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str,
                 dtype: torch.dtype, device: torch.device, tp=None) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias, dtype, device)
        self.down_proj = Linear(intermediate, hidden, bias, dtype, device)
        self.act = _ACTIVATIONS[act]
        self.silu = act == "silu"
        self.fused = False  # silu(gate) * up in one fused kernel (CausalLM.use_fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if self.fused and self.silu:
            out = self.down_proj.forward(triton_ops.silu_mul(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            out = self.down_proj.forward(self.act(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
SUPPORTED_ACTIVATIONS = tuple(_ACTIVATIONS)


def rope_inv_freq(head_dim: int, rope: dict, max_position_embeddings: int,
                  seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scale for one RoPE variant.

    `rope` is the checkpoint's RoPE dict (`rope_type`, `rope_theta`, `factor`, ...).
    `seq_len` only matters for `dynamic`, whose frequencies depend on the sequence length.
    """
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    base = float(rope.get("rope_theta", 10000.0))
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    factor = rope.get("factor")
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "dynamic":
        length = max(seq_len or max_position_embeddings, max_position_embeddings)
        stretch = factor * length / max_position_embeddings - (factor - 1)
        scaled = base * stretch ** (dim / (dim - 2))
        return 1.0 / (scaled ** exponents), 1.0
    original = rope.get("original_max_position_embeddings", max_position_embeddings)
    if rope_type == "llama3":
        low_freq_factor = rope["low_freq_factor"]
        high_freq_factor = rope["high_freq_factor"]
        low_freq_wavelen = original / low_freq_factor
        high_freq_wavelen = original / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, base, rope, original, max_position_embeddings)
    raise ValueError(
        f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _yarn_inv_freq(dim: int, base: float, rope: dict, original: int,
                   max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = rope.get("factor") or max_position_embeddings / original
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_extrapolation = 1.0 / pos_freqs
    inv_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (inv_interpolation * (1 - extrapolation_factor)
                + inv_extrapolation * extrapolation_factor)
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position. Static variants use a cos/sin table built once; `dynamic`
    recomputes frequencies per sequence from that sequence's length (as HF does per forward)."""

    def __init__(self, head_dim: int, rope: dict, max_position_embeddings: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = dict(rope)
        self.max_position_embeddings = max_position_embeddings
        self.dtype = dtype
        self.dynamic = self.rope.get("rope_type", "default") == "dynamic"
        inv_freq, scale = rope_inv_freq(head_dim, self.rope, max_position_embeddings)
        cos, sin = _cos_sin(torch.arange(max_len, dtype=torch.float32), inv_freq, scale)
        self.register_buffer("cos_table", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin_table", sin.to(device=device, dtype=dtype), persistent=False)
        self.inv_freq = inv_freq.to(device)

    def rotation(self, deltas: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [len(deltas), head_dim] (float32) of the pure rotation by each position
        delta: `apply_rotary(x, cos, sin)` turns a vector rotated for position p into the same
        vector rotated for p + delta (RoPE angles are linear in the position, so R(p + d) =
        R(d)R(p); no attention factor: the vector already carries it). Angles in float64, so
        the composition adds no rounding beyond float32's. Not for `dynamic`, whose
        frequencies change with the sequence length."""
        if self.dynamic:
            raise ValueError("dynamic-NTK RoPE cannot re-position keys by rotation")
        angles = (torch.tensor(deltas, dtype=torch.float64, device=self.inv_freq.device)[:, None]
                  * self.inv_freq.double()[None, :])
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().float(), emb.sin().float()

    def cos_sin(self, positions: torch.Tensor, seq_lens: list[int] | None = None,
                q_lens: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] for the flattened tokens. For `dynamic`, `seq_lens[i]` is the
        length sequence i has reached this step and `q_lens[i]` how many of the tokens are its."""
        if not self.dynamic or seq_lens is None or all(
                s <= self.max_position_embeddings for s in seq_lens):
            return self.cos_table[positions], self.sin_table[positions]
        parts_cos, parts_sin = [], []
        start = 0
        for seq_len, n in zip(seq_lens, q_lens, strict=False):
            inv_freq, scale = rope_inv_freq(self.head_dim, self.rope,
                                            self.max_position_embeddings, seq_len)
            cos, sin = _cos_sin(positions[start:start + n].float().cpu(), inv_freq, scale)
            parts_cos.append(cos)
            parts_sin.append(sin)
            start += n
        device = positions.device
        return (torch.cat(parts_cos).to(device, self.dtype),
                torch.cat(parts_sin).to(device, self.dtype))


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim] (two equal halves).

    Works on the two halves separately: the same products and sums as HF's
    `x * cos + rotate_half(x) * sin`, so bit-identical, without materialising rotate_half."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :half], sin[:, None, :half]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

"""Fused Triton kernels for the small per-layer operations of a decoder on CUDA.

Decode runs a few dozen element-wise kernels per layer around its matmuls; each costs a launch
and a pass over memory. These fuse them, one kernel each:
- `rms_norm`: (residual add +) RMSNorm, the sum kept as the new residual;
- `silu_mul`: act(gate) * up from the fused gate_up projection;
- `rope_store`: RoPE on q and k from the fused qkv projection, the rotated q returned and the
  rotated k and v written straight into the KV pool at the step's slots;
Rounding follows the torch path in the model dtype (HF's order of operations: the residual sum,
the normalised value and the activation are rounded to the dtype where HF rounds them), so
bf16 outputs agree with it to bf16 rounding. They are used on CUDA only; CPU keeps the torch
ops, which are bit-exact against HF in float32.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without Triton use the torch ops
    triton = None
    tl = None


def available() -> bool:
    return triton is not None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, R, W, OUT, R_OUT, stride_x, stride_r, stride_o, stride_ro, n, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        valid = offs < n
        x = tl.load(X + row * stride_x + offs, mask=valid, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(R + row * stride_r + offs, mask=valid, other=0.0)
            tl.store(R_OUT + row * stride_ro + offs, x, mask=valid)
        h = x.to(tl.float32)
        var = tl.sum(h * h, 0) / n
        h = (h * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(W + offs, mask=valid, other=0.0)
        tl.store(OUT + row * stride_o + offs, w * h, mask=valid)

    @triton.jit
    def _silu_mul_kernel(GU, OUT, stride_gu, stride_o, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        gate = tl.load(GU + row * stride_gu + offs, mask=valid, other=0.0)
        up = tl.load(GU + row * stride_gu + n + offs, mask=valid, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        tl.store(OUT + row * stride_o + offs, act * up, mask=valid)

    @triton.jit
    def _rope_store_kernel(QKV, COS, SIN, KCOS, KSIN, Q_OUT, K_CACHE, V_CACHE, slots,
                           stride_qkv, stride_cos, stride_kcos, stride_qo, stride_kt,
                           HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_KV: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        dim = 2 * HALF
        offs = tl.arange(0, BLOCK_HALF)
        d_valid = offs < HALF
        c = tl.load(COS + t * stride_cos + offs, mask=d_valid, other=0.0)
        s = tl.load(SIN + t * stride_cos + offs, mask=d_valid, other=0.0)
        row = QKV + t * stride_qkv
        # q heads
        hq = tl.arange(0, BLOCK_H)
        mask = (hq < HEADS)[:, None] & d_valid[None, :]
        src = row + hq[:, None] * dim + offs[None, :]
        x1 = tl.load(src, mask=mask, other=0.0)
        x2 = tl.load(src + HALF, mask=mask, other=0.0)
        dst = Q_OUT + t * stride_qo + hq[:, None] * dim + offs[None, :]
        tl.store(dst, x1 * c - x2 * s, mask=mask)
        tl.store(dst + HALF, x2 * c + x1 * s, mask=mask)
        # k heads, rotated (by the keys' own positions where they differ), and v heads, into
        # the pool at this token's slot
        c = tl.load(KCOS + t * stride_kcos + offs, mask=d_valid, other=0.0)
        s = tl.load(KSIN + t * stride_kcos + offs, mask=d_valid, other=0.0)
        slot = tl.load(slots + t).to(tl.int64)
        hk = tl.arange(0, BLOCK_KV)
        mask = (hk < KV_HEADS)[:, None] & d_valid[None, :]
        src = row + HEADS * dim + hk[:, None] * dim + offs[None, :]
        x1 = tl.load(src, mask=mask, other=0.0)
        x2 = tl.load(src + HALF, mask=mask, other=0.0)
        dst = K_CACHE + slot * stride_kt + hk[:, None] * dim + offs[None, :]
        tl.store(dst, x1 * c - x2 * s, mask=mask)
        tl.store(dst + HALF, x2 * c + x1 * s, mask=mask)
        src = src + KV_HEADS * dim
        dst = V_CACHE + slot * stride_kt + hk[:, None] * dim + offs[None, :]
        tl.store(dst, tl.load(src, mask=mask, other=0.0), mask=mask)
        tl.store(dst + HALF, tl.load(src + HALF, mask=mask, other=0.0), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) * weight over the last dimension; with `residual`, RMSNorm(x + residual)
    and the sum."""
    if x.dim() != 2:  # per-head norms (Qwen3's q/k norm): rows of the last dimension
        return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    rows, n = x.shape
    out = torch.empty_like(x)
    block = _pow2(n)
    warps = 4 if block <= 2048 else 8
    if residual is None:
        _rms_norm_kernel[(rows,)](x, x, weight, out, out, x.stride(0), 0, out.stride(0), 0, n,
                                  eps, HAS_RESIDUAL=False, BLOCK=block, num_warps=warps)
        return out
    total = torch.empty_like(x)
    _rms_norm_kernel[(rows,)](x, residual, weight, out, total, x.stride(0), residual.stride(0),
                              out.stride(0), total.stride(0), n, eps, HAS_RESIDUAL=True,
                              BLOCK=block, num_warps=warps)
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0),
                                                    out.stride(0), n, BLOCK=block, num_warps=4)
    return out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
               kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slots: torch.Tensor,
               key_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q rotated [T, heads, head_dim]; rotated k and v written to the pool at `slots`.
    `key_rope`: cos, sin for the keys where their positions differ from the queries'
    (selectively recomputed chunk tokens keep their keys at the chunk's base positions)."""
    tokens = qkv.shape[0]
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    key_cos, key_sin = key_rope if key_rope is not None else (cos, sin)
    _rope_store_kernel[(tokens,)](
        qkv, cos, sin, key_cos, key_sin, q, k_cache, v_cache, slots,
        qkv.stride(0), cos.stride(0), key_cos.stride(0), q.stride(0), k_cache.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, HALF=half, BLOCK_HALF=_pow2(half),
        BLOCK_H=_pow2(heads), BLOCK_KV=_pow2(kv_heads), num_warps=4,
    )
    return q

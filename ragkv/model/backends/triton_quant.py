"""Triton kernels for linear layers held as int8 groups on CUDA (model/int8_linear.py).

A weight is W[n, k] = q[n, k] * scale[n, g] (+ offset[n, g]), g = k // 32: GGUF's Q8_0 is
exactly this (offset 0), and every other integer GGUF type decodes to it exactly (q in
-128..127, 0..31 or 0..15, scale and offset per 32-value group). Each kernel dequantizes a
tile in float32 and rounds it to the activations' dtype, so the weights it multiplies are bit
for bit those of the dequantized dense layer; only the float32 accumulation order differs.

- `int8_matmul`: y = x @ W.T for a few rows (decode, drafts, a batch of decodes), reading
  W's 1.06 bytes per value instead of bf16's 2: for one or two rows a GEMV that keeps a
  float32 accumulator per weight and reduces it once at the end; for more rows tl.dot over
  tiles of BLOCK_M rows. Both load each group's scale once and broadcast it in registers (a
  scale gathered per value costs a load per value: 10x slower in the dot kernel), and turn
  int8 into float32 by exponent bits rather than the quarter-rate conversion instruction;
- `int8_dequantize`: W in the activations' dtype, for steps of many rows (prefill), whose
  dense GEMM is compute-bound and faster than any fused kernel here.

All three build W's tiles with `_grouped_tile`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without Triton keep GGUF weights dense
    triton = None
    tl = None

GROUP_SIZE = 32  # values per scale (GGML's block, a K-quant's sub-block)


def available() -> bool:
    return triton is not None


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    """One launch shape of `int8_matmul`. dot False: the GEMV kernel, one program per block_n
    rows of W and block_m rows of x, each weight tile dequantized once for its block_m rows;
    dot True: the tl.dot kernel (block_m, block_n >= 16). GEMV only: `fast_cvt`, int8 to
    float32 by exponent bits (an integer add and a float subtract) rather than the conversion
    instruction, which runs at a quarter of the rate (the dot kernel always does); `round_w`
    False (measurement only) skips rounding each weight to the activations' dtype."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False
    fast_cvt: bool = True
    round_w: bool = True


def _block_k(k: int, most: int) -> int:
    """The largest power of two up to `most` that divides k (k is a multiple of 32)."""
    block = most
    while k % block:
        block //= 2
    return block


def default_config(m: int, n: int, k: int) -> MatmulConfig:
    """The launch for an [m, k] x [n, k].T product, from the tile sweeps on an H200
    (docs/benchmarks.md, "Q8_0 weights on the GPU")."""
    if m <= 2:
        # The GEMV: enough programs to keep every SM streaming, rows per program by n.
        return MatmulConfig(m, 4 if n <= 8192 else 8, _block_k(k, 512))
    # The dot kernel: wide layers take wider tiles of W; narrow ones more programs.
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if m <= 16 else 64 if n > 8192 else 16
    return MatmulConfig(block_m, block_n, _block_k(k, 128 if n > 8192 else 256), dot=True)


if triton is not None:

    @triton.jit
    def _int8_to_f32(q, FAST: tl.constexpr):
        if FAST:
            # 0x4B000080 is 2^23 + 128 as a float: adding q (sign-extended) to its bits gives
            # the float 2^23 + 128 + q exactly; subtracting 2^23 + 128 leaves q.
            return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        return q.to(tl.float32)

    @triton.jit
    def _grouped_tile(Q, S, OFF, rows, n_ok, k0, K, HAS_OFFSET: tl.constexpr,
                      GROUP: tl.constexpr, BLOCK_K: tl.constexpr, FAST_CVT: tl.constexpr):
        """W's rows `rows` (int64), columns k0 .. k0 + BLOCK_K as [rows, groups, GROUP] in
        float32: each group's scale (and offset) loaded once and broadcast along the group in
        registers (a scale gathered per value costs a load per value)."""
        G: tl.constexpr = BLOCK_K // GROUP
        rg = tl.arange(0, G)
        col = k0 + rg[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GROUP]
        q = tl.load(Q + rows[:, None, None] * K + col[None, :, :], mask=n_ok[:, None, None],
                    other=0)
        g = rows[:, None] * (K // GROUP) + (k0 // GROUP + rg)[None, :]
        s = tl.load(S + g, mask=n_ok[:, None], other=0.0)
        w = _int8_to_f32(q, FAST_CVT) * s.to(tl.float32)[:, :, None]
        if HAS_OFFSET:
            w += tl.load(OFF + g, mask=n_ok[:, None], other=0.0).to(tl.float32)[:, :, None]
        return w

    @triton.jit
    def _int8_gemv_kernel(X, Q, S, OFF, B, Y, M, N, K, stride_xm, stride_ym,
                          HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          FAST_CVT: tl.constexpr, ROUND_W: tl.constexpr):
        pid_n = tl.program_id(0)
        m0 = tl.program_id(1) * BLOCK_M
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        G: tl.constexpr = BLOCK_K // GROUP
        rg = tl.arange(0, G)
        rj = tl.arange(0, GROUP)
        rows = rn.to(tl.int64)
        rm = tl.arange(0, BLOCK_M)
        acc3 = tl.zeros((BLOCK_N, G, GROUP), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            col = k0 + rg[:, None] * GROUP + rj[None, :]  # [G, GROUP], x's columns
            w = _grouped_tile(Q, S, OFF, rows, n_ok, k0, K, HAS_OFFSET, GROUP, BLOCK_K,
                              FAST_CVT)
            if ROUND_W:
                # Rounded to x's dtype as the dense layer's weight is; each product below is
                # exact in float32 (two 8- or 11-bit mantissas).
                w = w.to(X.dtype.element_ty).to(tl.float32)
            if BLOCK_M == 1:
                x = tl.load(X + m0.to(tl.int64) * stride_xm + col).to(tl.float32)
                acc3 += w * x[None, :, :]
            else:
                for i in tl.static_range(BLOCK_M):
                    x = tl.load(X + (m0 + i).to(tl.int64) * stride_xm + col,
                                mask=col * 0 + m0 + i < M, other=0.0).to(tl.float32)
                    part = tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)
                    acc += tl.where(rm[:, None] == i, part[None, :], 0.0)
        if HAS_BIAS:  # added in float32 before the one rounding, as the dense GEMM does
            bias = tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)
        else:
            bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if BLOCK_M == 1:
            y = tl.sum(tl.sum(acc3, axis=2), axis=1) + bias
            tl.store(Y + m0.to(tl.int64) * stride_ym + rn, y.to(Y.dtype.element_ty), mask=n_ok)
        else:
            out = Y + (m0 + rm).to(tl.int64)[:, None] * stride_ym + rn[None, :]
            tl.store(out, (acc + bias[None, :]).to(Y.dtype.element_ty),
                     mask=(m0 + rm < M)[:, None] & n_ok[None, :])

    @triton.jit
    def _int8_mm_kernel(X, Q, S, OFF, B, Y, M, N, K, stride_xm, stride_ym,
                        HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr,
                        IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = X + rm.to(tl.int64)[:, None] * stride_xm
        rows = rn.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # The weight tile by groups, then flattened for the dot.
            w = _grouped_tile(Q, S, OFF, rows, n_ok, k0, K, HAS_OFFSET, GROUP, BLOCK_K, True)
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.reshape(w.to(x.dtype), (BLOCK_N, BLOCK_K))
            if IEEE:  # float32 activations: no TF32 rounding of x
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        tl.store(out, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _int8_dequant_kernel(Q, S, OFF, W, N, K, HAS_OFFSET: tl.constexpr, GROUP: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        n_ok = rn < N
        rows = rn.to(tl.int64)
        w = _grouped_tile(Q, S, OFF, rows, n_ok, k0, K, HAS_OFFSET, GROUP, BLOCK_K, True)
        G: tl.constexpr = BLOCK_K // GROUP
        col = k0 + tl.arange(0, G)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        out = W + rows[:, None, None] * K + col[None, :, :]
        tl.store(out, w.to(W.dtype.element_ty), mask=n_ok[:, None, None])


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                offset: torch.Tensor | None, config: MatmulConfig | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype, W = q [N, K] int8 * scale (+ offset),
    both [N, K // 32] (float16 or float32)."""
    m, k = x.shape
    n = q.shape[0]
    if m == 0:  # a step whose rows are all elsewhere (no logits rows, say)
        return x.new_empty(0, n)
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or default_config(m, n, k)
    if k % cfg.block_k or cfg.block_k % GROUP_SIZE:
        raise ValueError(f"block_k {cfg.block_k} must divide K={k} in whole groups")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    has_offset = offset is not None
    o = offset if has_offset else scale
    b = bias if bias is not None else scale
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    if not cfg.dot:
        _int8_gemv_kernel[grid](x, q, scale, o, b, y, m, n, k, x.stride(0), y.stride(0),
                                HAS_OFFSET=has_offset, HAS_BIAS=bias is not None,
                                GROUP=GROUP_SIZE, BLOCK_M=cfg.block_m,
                                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                FAST_CVT=cfg.fast_cvt, ROUND_W=cfg.round_w,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        _int8_mm_kernel[grid](x, q, scale, o, b, y, m, n, k, x.stride(0), y.stride(0),
                              HAS_OFFSET=has_offset, HAS_BIAS=bias is not None,
                              GROUP=GROUP_SIZE,
                              IEEE=x.dtype == torch.float32, BLOCK_M=cfg.block_m,
                              BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def int8_dequantize(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` (each value rounded once from float32)."""
    n, k = q.shape
    w = torch.empty(n, k, dtype=dtype, device=q.device)
    block_n, block_k = 16, _block_k(k, 256)
    has_offset = offset is not None
    _int8_dequant_kernel[(triton.cdiv(n, block_n), k // block_k)](
        q, scale, offset if has_offset else scale, w, n, k, HAS_OFFSET=has_offset,
        GROUP=GROUP_SIZE, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return w

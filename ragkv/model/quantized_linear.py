"""Linear layers that keep a GGUF file's quantized weights quantized (`--quantization gguf`).

GGUF's Q4_0, Q4_1 and Q4_K store, per group of 32 input values, 4-bit integers q with one scale
and one offset. That is the form torch's CPU int4 weight-only matmul takes
(`_weight_int4pack_mm_for_cpu`, the kernel torchao serves int4 with): w = (q - 8) * scale +
zero, q in 0..15. Q8_0, Q5_0, Q5_1 and Q5_K hold wider integers q = 16 h + l per group, which
split exactly into two such 4-bit planes, l (scale s) and h + 8 (scale 16 s), summed by running
the kernel over the input twice along K. So every value stays what the file says, at 0.625
bytes per 4-bit value (1.25 per 8-bit one) instead of 4, and a decode step streams a sixth of
the float32 bytes.

Numerics (docs/quantization.md): W is the file's values with each group's scale and zero
rounded to bfloat16. Generated tokens (decode, drafts) run the kernel: x and y rounded to
bfloat16, float32 products, a few bfloat16 roundings inside; within 2^-8 (|x| @ |W|.T + |y|)
of the float32 matmul. Prompt tokens dequantize the layer for the step and run a dense matmul
(2x faster than the kernel for prefill-sized steps); so do steps of more than
`KERNEL_MAX_ROWS` rows where no route is set (tests/test_quantized_linear.py). That matmul is
float32, or bfloat16 (x, W and y rounded to it, float32 sums) on a CPU that multiplies
bfloat16 natively, where it is about 4x faster (`prompt_dtype`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from .parallel import group_columns

GROUP_SIZE = 32  # values per scale/zero pair (GGML's block, a K-quant's sub-block)
BLOCK_ROWS = 64  # the packed layout interleaves rows in blocks of 64 (see `_unpacked`)
_INNER_K_TILES = 2  # the packed layout's tiling along K (the kernel's innerKTiles)
# Up to this many rows the int4 kernel is faster than dequantizing the layer for a dense
# matmul; above it, the other way round. Where they cross depends on the CPU: SmolLM2's
# prefill took the same time both ways between 64 and 96 tokens on a 2-core Intel AVX-512
# CPU (float32 dense), between 96 and 112 on a 2-core EPYC (bfloat16 dense; Gemma 3 270M,
# whose Q5_0 layers run the kernel twice, too), from 130 on a Zen 5 (docs/benchmarks.md,
# "Quantized weights"). Dequantizing costs ~0.7 ns per weight per step.
KERNEL_MAX_ROWS = 96

logger = logging.getLogger(__name__)
_prompt_dtype: torch.dtype | None = None  # prompt_dtype()'s choice, made on first use


def prompt_dtype() -> torch.dtype:
    """The dtype of the prompt rows' dense matmul when activations are float32: bfloat16 where
    this CPU multiplies bfloat16 at least 1.5x faster than float32 (AVX512-BF16 or AMX: 4x on
    a Zen 5 core; slower than float32 on CPUs without them) and its GEMM sums a row alike in
    steps of 2 rows or more (else a bfloat16 rounding would part warm steps from cold ones
    more often), else float32. Timed once per process on a prefill-sized GEMM, a margin wide
    enough that the choice does not flip with noise; RAGKV_PACKED_PROMPT_DTYPE=float32 or
    bfloat16 pins it."""
    global _prompt_dtype
    if _prompt_dtype is None:
        pinned = os.environ.get("RAGKV_PACKED_PROMPT_DTYPE")
        if pinned not in (None, "", "float32", "bfloat16"):
            raise ValueError(f"RAGKV_PACKED_PROMPT_DTYPE={pinned!r}: use float32 or bfloat16")
        if pinned:
            _prompt_dtype = getattr(torch, pinned)
        else:
            x, w = torch.randn(128, 576), torch.randn(576, 1536)
            xb, wb = x.bfloat16(), w.bfloat16()
            fp32, bf16 = _gemm_time(x, w), _gemm_time(xb, wb)
            alike = _rows_alike(xb, wb)
            _prompt_dtype = torch.bfloat16 if fp32 >= 1.5 * bf16 and alike else torch.float32
            logger.info("packed weights: prompt rows multiply in %s (a GEMM took %.2f ms in "
                        "float32, %.2f ms in bfloat16; bfloat16 rows %s in steps of any "
                        "size)", str(_prompt_dtype).split(".")[-1], fp32 * 1e3, bf16 * 1e3,
                        "sum alike" if alike else "do not sum alike")
    return _prompt_dtype


def takes_kernel(start: int, prompt_len: int, prompt_rows: int) -> bool:
    """Whether the rows of a work whose first new token is token `start` of its request take
    the int4 kernel: generated tokens (decode, drafts), and every row of a prompt short
    enough for the kernel to be the faster; the other prompt rows take the dense path.
    `prompt_rows`: the prompt rows the request computes where the work's tokens are (its
    prompt length, or fewer: `SeqWork.prompt_rows`). After its chunks a warm RAG request
    computes only its question (and its recomputed chunk tokens), a step of a few dozen rows
    that would otherwise pay for dequantizing every layer (1.5x the kernel's time for 80
    rows of SmolLM2, 2.4x for a 26-token question). A token's path thus depends on its
    request, never on the step."""
    return start >= prompt_len or prompt_rows <= KERNEL_MAX_ROWS


def pin_prompt_dtype(dtype: torch.dtype) -> None:
    """Take `dtype` as prompt_dtype()'s choice (a tensor-parallel worker takes rank 0's)."""
    global _prompt_dtype
    _prompt_dtype = dtype


def _rows_alike(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether rows of x @ w come out bit for bit the same in steps of 2, 3 and 17 rows as
    in one step of all of them."""
    whole = x @ w
    return all(torch.equal(x[i:i + n] @ w, whole[i:i + n]) for i in (0, 5, 40) for n in (2, 3, 17))


def _gemm_time(x: torch.Tensor, w: torch.Tensor) -> float:
    x @ w
    times = []
    for _ in range(3):
        start = time.perf_counter()
        x @ w
        times.append(time.perf_counter() - start)
    return min(times)


@dataclass(slots=True)
class RowRoute:
    """Which path each row of the current forward takes, shared by all packed layers of a
    model. `prompt_rows` None: by the step's size (at most KERNEL_MAX_ROWS rows: the kernel);
    n: the first n rows take the dequantized path (the prompt tokens of prompts longer than
    KERNEL_MAX_ROWS), the rest the kernel (generated tokens: decode, drafts; and every token
    of a shorter prompt; the runner orders them so). Routing by the token's kind keeps a
    token's path the same in whatever step computes it: a warm request's question (a small
    step) as in the cold one (a large step). Warm answers then stay close to cold ones, not
    bit-exact (docs/quantization.md)."""

    prompt_rows: int | None = None


@dataclass(frozen=True, slots=True)
class Int4Rows:
    """Rows of a weight as the kernel takes them: w = sum over planes p of (q_p - 8) * scale_p +
    zero_p, plane p being columns p*K .. (p+1)*K of `q` (and its groups of scale/zero)."""

    q: torch.Tensor  # uint8 [rows, planes * K], values 0..15
    scale: torch.Tensor  # float32 [rows, planes * K // GROUP_SIZE]
    zero: torch.Tensor  # float32 [rows, planes * K // GROUP_SIZE]
    planes: int = 1

    @classmethod
    def of_ints(cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                planes: int) -> Int4Rows:
        """The rows whose values are scale * q + offset per 32-value group, q integers in
        0..15 (planes 1) or -128..127 (planes 2: q = 16 h + l, h = q >> 4)."""
        rows, cols = q.shape
        s = scale.reshape(rows, -1)
        z = offset.reshape(rows, -1)
        if planes == 1:
            return cls(q.to(torch.uint8), s, z + 8 * s)
        q = q.to(torch.int16)
        low, high = q & 15, (q >> 4) + 8  # scale*l + 16*scale*h + offset
        return cls(torch.cat([low, high], dim=1).to(torch.uint8), torch.cat([s, 16 * s], dim=1),
                   torch.cat([z + 8 * s, torch.zeros_like(z)], dim=1), 2)

    def with_planes(self, planes: int) -> Int4Rows:
        """The same values over `planes` planes (an empty plane: q 8, scale 0, zero 0)."""
        if planes == self.planes:
            return self
        pad = planes - self.planes
        return Int4Rows(torch.cat([self.q, torch.full_like(self.q, 8).repeat(1, pad)], dim=1),
                        torch.cat([self.scale, torch.zeros_like(self.scale).repeat(1, pad)], 1),
                        torch.cat([self.zero, torch.zeros_like(self.zero).repeat(1, pad)], 1),
                        planes)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [rows, K] these rows stand for."""
        rows = self.q.shape[0]
        q = self.q.float().view(rows, -1, GROUP_SIZE) - 8
        w = q * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)
        return w.reshape(rows, self.planes, -1).sum(dim=1)

    def permute_rows(self, order: torch.Tensor) -> Int4Rows:
        return Int4Rows(self.q[order], self.scale[order], self.zero[order], self.planes)

    def narrow(self, dim: int, start: int, count: int) -> Int4Rows:
        """Rows start .. start + count - 1 (dim 0), or those inputs of every plane (dim 1,
        whole groups): a rank's part of the weight (tensor parallelism)."""
        if dim == 0:
            end = start + count
            return Int4Rows(self.q[start:end], self.scale[start:end], self.zero[start:end],
                            self.planes)
        k = self.q.shape[1] // self.planes
        q, scale, zero = (group_columns(t, self.planes, k, start, count, GROUP_SIZE)
                          for t in (self.q, self.scale, self.zero))
        return Int4Rows(q, scale, zero, self.planes)


def int4_supported(in_features: int, out_features: int, device: torch.device) -> bool:
    """Whether a layer of this shape can be held packed on `device` (whole groups of inputs,
    whole blocks of rows)."""
    return (device.type == "cpu" and in_features % GROUP_SIZE == 0
            and out_features % BLOCK_ROWS == 0)


class Int4Linear(nn.Module):
    """y = x @ W.T (+ bias) with W held as packed 4-bit planes and per-group scale/zero.

    Loaded in row ranges (`load`, as a fused q/k/v or gate/up destination is), then `pack()`ed
    once every range is in; the staging tensors are freed there. A tied embedding reads its
    rows from the same packed values (`rows`)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 planes: int, route: RowRoute | None = None) -> None:
        super().__init__()
        self.route = route or RowRoute()
        if not int4_supported(in_features, out_features, torch.device("cpu")):
            raise ValueError(f"no int4 kernel for a [{out_features}, {in_features}] layer")
        self.in_features, self.out_features, self.planes = in_features, out_features, planes
        self.bias = bias
        width = planes * in_features
        self._q: torch.Tensor | None = torch.empty(out_features, width, dtype=torch.uint8)
        self._scale_zero = torch.empty(width // GROUP_SIZE, out_features, 2)
        self._loaded = torch.zeros(out_features, dtype=torch.bool)
        self.register_buffer("packed", torch.empty(0, dtype=torch.uint8), persistent=False)
        self.register_buffer("scale_zero", torch.empty(0, dtype=torch.bfloat16),
                             persistent=False)

    def load(self, offset: int, rows: Int4Rows) -> None:
        if self._q is None:
            raise RuntimeError("Int4Linear is already packed")
        rows = rows.with_planes(self.planes)
        n = rows.q.shape[0]
        if rows.q.shape[1] != self._q.shape[1] or offset + n > self.out_features:
            raise ValueError(f"int4 rows of {rows.q.shape[1] // rows.planes} inputs at row "
                             f"{offset} do not fit a [{self.out_features}, {self.in_features}] "
                             "layer")
        self._q[offset:offset + n] = rows.q
        self._scale_zero[:, offset:offset + n, 0] = rows.scale.t()
        self._scale_zero[:, offset:offset + n, 1] = rows.zero.t()
        self._loaded[offset:offset + n] = True

    def pack(self) -> None:
        if self._q is None:
            return
        if not bool(self._loaded.all()):  # a row range no checkpoint tensor filled
            raise ValueError("Int4Linear packed before all of its rows were loaded")
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            self._q.to(torch.int32), _INNER_K_TILES)
        self.scale_zero = self._scale_zero.to(torch.bfloat16)
        self._q = self._scale_zero = self._loaded = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] (the model's flattened tokens) -> [T, out_features]."""
        split = self.route.prompt_rows
        if split is None:
            out = self._kernel(x) if x.shape[0] <= KERNEL_MAX_ROWS else self._dense(x)
        elif split == 0:
            out = self._kernel(x)
        elif split >= x.shape[0]:
            out = self._dense(x)
        else:
            out = torch.cat((self._dense(x[:split]), self._kernel(x[split:])))
        return out if self.bias is None else out + self.bias

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.planes > 1:
            xb = xb.repeat(1, self.planes)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb.contiguous(), self.packed, GROUP_SIZE, self.scale_zero).to(x.dtype)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 where bfloat16 is not faster: there, float32 GEMMs give a row slightly
        # different sums in steps of different sizes, which a bfloat16 rounding would blow up
        # to a whole bfloat16 step now and then. The bfloat16 GEMM of a Zen 5 CPU sums a row
        # alike in steps of any size from 2 rows (one row is padded to two).
        dtype = prompt_dtype() if x.dtype == torch.float32 else x.dtype
        xd = x.to(dtype)
        if dtype == torch.bfloat16 and x.shape[0] == 1:
            # One row takes a GEMV whose sums can differ in the last bit; two take the GEMM.
            xd = xd.expand(2, -1)
        return (xd @ self.dequantize_t(dtype))[:x.shape[0]].to(x.dtype)

    def _unpacked(self) -> torch.Tensor:
        """The 4-bit values, uint8 [planes * K, N] (W.T's layout). The packed bytes are
        [N / 64, planes * K, 32]: byte (b, k, j) holds row 64b + j's value at k in its low
        nibble and row 64b + 32 + j's in its high one."""
        width, n = self.planes * self.in_features, self.out_features
        packed = self.packed.view(n // BLOCK_ROWS, width, BLOCK_ROWS // 2).permute(1, 0, 2)
        # One stack (2.6x faster than two writes into the halves of a preallocated tensor).
        return torch.stack((packed & 15, packed >> 4), dim=2).view(width, n)

    def dequantize_t(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W.T [K, N] from the packed values and the held (bfloat16) scales: computed in
        float32, then rounded to `dtype`."""
        q = self._unpacked().view(-1, GROUP_SIZE, self.out_features)
        scale = self.scale_zero[..., 0].float().unsqueeze(1)
        zero = self.scale_zero[..., 1].float().unsqueeze(1)
        # uint8 q straight into the float32 product: no float copy of q (1.5x faster).
        w = torch.addcmul(zero - 8 * scale, q, scale)
        if self.planes == 1:
            w = w.view(self.in_features, self.out_features)
        else:
            w = w.view(self.planes, self.in_features, self.out_features).sum(dim=0)
        return w if dtype == torch.float32 else w.to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of W [len(ids), K] as `dtype` (an embedding lookup)."""
        width = self.planes * self.in_features
        blocks = self.packed.view(-1, width, BLOCK_ROWS // 2)
        inner = ids % BLOCK_ROWS
        packed = blocks[ids // BLOCK_ROWS, :, inner % (BLOCK_ROWS // 2)]  # [len(ids), width]
        shift = (inner >= BLOCK_ROWS // 2).to(torch.uint8).mul_(4).unsqueeze(1)
        q = ((packed >> shift) & 15).float().view(len(ids), -1, GROUP_SIZE)
        scale_zero = self.scale_zero[:, ids].float()  # [groups, len(ids), 2]
        scale = scale_zero[..., 0].t().unsqueeze(-1)
        zero = scale_zero[..., 1].t().unsqueeze(-1)
        w = torch.addcmul(zero - 8 * scale, q, scale)
        return w.reshape(len(ids), self.planes, self.in_features).sum(dim=1).to(dtype)

    def weight_bytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size()
                + self.scale_zero.numel() * self.scale_zero.element_size())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.planes} int4 plane(s), groups of "
                f"{GROUP_SIZE}")

"""Linear layers that keep a GGUF file's integer weights as int8 groups on CUDA
(`--quantization gguf` on a GPU).

Every integer GGUF type decodes exactly to W = q * scale + offset per 32-value group with q in
int8: Q8_0 (offset 0: held without one, 1.06 bytes per value as in the file), Q5_0/Q5_1/Q5_K
(0..31), Q4_0/Q4_1/Q4_K (0..15). A layer holds q as int8 [N, K] and scale (and offset) as
float16 where every value is exactly a float16 (Q8_0's scales are), float32 otherwise.

Numerics (docs/quantization.md): both paths multiply by the dense layer's weights bit for bit,
each value computed in float32 and rounded once to the activations' dtype; only the float32
accumulation order differs from the dense layer. Steps of at most `KERNEL_MAX_ROWS` rows
(decode, drafts, a batch of decodes) run the fused Triton kernel, which streams the int8
values; larger steps (prefill) dequantize the layer for the step and run the dense GEMM, which
is compute-bound there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .backends import triton_quant
from .parallel import group_columns

GROUP_SIZE = triton_quant.GROUP_SIZE
# Up to this many rows the fused kernels, above it dequantize + dense GEMM. On an H200, for the
# 8B shape's layers, the dot kernel at 64 rows takes 0.2-0.5x the time of dequantize + GEMM,
# which is 1.1-1.3x the bf16 GEMM's at 4,096 rows (docs/benchmarks.md, "Q8_0 weights on the
# GPU"); between 64 and 512 rows the crossover was not measured.
KERNEL_MAX_ROWS = 64


@dataclass(frozen=True, slots=True)
class Int8Rows:
    """Rows of a weight: w = q * scale + offset per 32-value group."""

    q: torch.Tensor  # int8 [rows, K]
    scale: torch.Tensor  # float32 [rows, K // GROUP_SIZE]
    offset: torch.Tensor  # float32 [rows, K // GROUP_SIZE]

    @classmethod
    def of_ints(cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> Int8Rows:
        rows = q.shape[0]
        return cls(q.to(torch.int8), scale.reshape(rows, -1).float(),
                   offset.reshape(rows, -1).float())

    def dequantize(self) -> torch.Tensor:
        rows = self.q.shape[0]
        w = self.q.float().view(rows, -1, GROUP_SIZE) * self.scale.unsqueeze(-1)
        return (w + self.offset.unsqueeze(-1)).view(rows, -1)

    def permute_rows(self, order: torch.Tensor) -> Int8Rows:
        return Int8Rows(self.q[order], self.scale[order], self.offset[order])

    def narrow(self, dim: int, start: int, count: int) -> Int8Rows:
        """Rows, or inputs in whole groups (dim 1): a rank's part (tensor parallelism)."""
        if dim == 0:
            end = start + count
            return Int8Rows(self.q[start:end], self.scale[start:end], self.offset[start:end])
        k = self.q.shape[1]
        q, scale, offset = (group_columns(t, 1, k, start, count, GROUP_SIZE)
                            for t in (self.q, self.scale, self.offset))
        return Int8Rows(q, scale, offset)


def int8_supported(in_features: int, device: torch.device) -> bool:
    """Whether a layer with this many inputs can be held as int8 groups on `device`."""
    return (device.type == "cuda" and triton_quant.available()
            and in_features % GROUP_SIZE == 0)


def _exact_half(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.half().float(), t))


class Int8Linear(nn.Module):
    """y = x @ W.T (+ bias) with W held as int8 groups on the GPU.

    Loaded in row ranges on the host (`load`, as a fused q/k/v or gate/up destination is),
    then `pack()`ed onto the device once every range is in. A tied embedding reads its rows
    from the same values (`rows`)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 device: torch.device) -> None:
        super().__init__()
        if in_features % GROUP_SIZE:
            raise ValueError(f"no int8 layer for {in_features} inputs (whole groups of "
                             f"{GROUP_SIZE} only)")
        self.in_features, self.out_features, self.device = in_features, out_features, device
        self.bias = bias
        groups = in_features // GROUP_SIZE
        self._q: torch.Tensor | None = torch.empty(out_features, in_features, dtype=torch.int8)
        self._scale = torch.empty(out_features, groups)
        self._offset = torch.empty(out_features, groups)
        self._loaded = torch.zeros(out_features, dtype=torch.bool)
        self.q = self.scale = self.offset = None

    def load(self, offset: int, rows: Int8Rows) -> None:
        if self._q is None:
            raise RuntimeError("Int8Linear is already packed")
        n = rows.q.shape[0]
        if rows.q.shape[1] != self.in_features or offset + n > self.out_features:
            raise ValueError(f"int8 rows of {rows.q.shape[1]} inputs at row {offset} do not "
                             f"fit a [{self.out_features}, {self.in_features}] layer")
        self._q[offset:offset + n] = rows.q
        self._scale[offset:offset + n] = rows.scale
        self._offset[offset:offset + n] = rows.offset
        self._loaded[offset:offset + n] = True

    def pack(self) -> None:
        if self._q is None:
            return
        if not bool(self._loaded.all()):  # a row range no checkpoint tensor filled
            raise ValueError("Int8Linear packed before all of its rows were loaded")
        offset = None if not bool(self._offset.any()) else self._offset
        exact = _exact_half(self._scale) and (offset is None or _exact_half(offset))
        dtype = torch.float16 if exact else torch.float32
        self.q = self._q.to(self.device)
        self.scale = self._scale.to(self.device, dtype)
        self.offset = None if offset is None else offset.to(self.device, dtype)
        self._q = self._scale = self._offset = self._loaded = None

    @classmethod
    def quantize_q8_0(cls, weight: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> Int8Linear:
        """A layer holding `weight` [N, K] quantized by GGML's reference Q8_0 rule (per 32
        values: d = max|w| / 127, q = w / d rounded half away from zero, d stored as float16),
        on the weight's device. For measuring and testing the int8 path on models with dense
        checkpoints."""
        n, k = weight.shape
        layer = cls(k, n, bias, weight.device)
        w = weight.detach().float().view(n, -1, GROUP_SIZE)
        d = w.abs().amax(dim=-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        v = w * inv.unsqueeze(-1)
        q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8)
        layer.q, layer.scale, layer.offset = q.view(n, k), d.half(), None
        layer._q = layer._scale = layer._offset = layer._loaded = None
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features] in x's dtype; the bias is added before the
        output's one rounding on both paths, as the dense layer's GEMM adds it."""
        if self.q is None:
            raise RuntimeError("Int8Linear used before pack()")
        if x.shape[0] <= KERNEL_MAX_ROWS:
            return triton_quant.int8_matmul(x, self.q, self.scale, self.offset, bias=self.bias)
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype`, as the dense layer would hold it."""
        return triton_quant.int8_dequantize(self.q, self.scale, self.offset, dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of W [len(ids), K] as `dtype` (an embedding lookup)."""
        w = self.q[ids].float().view(len(ids), -1, GROUP_SIZE) * self.scale[ids].float()[..., None]
        if self.offset is not None:
            w = w + self.offset[ids].float()[..., None]
        return w.view(len(ids), self.in_features).to(dtype)

    def weight_bytes(self) -> int:
        held = [self.q, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 groups of {GROUP_SIZE}, scales "
                f"{self.scale.dtype if self.scale is not None else 'not loaded'}")

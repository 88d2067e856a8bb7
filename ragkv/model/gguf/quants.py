"""GGML tensor encodings, decoded to float32 with torch.

A GGUF tensor is stored row by row; each row is a run of fixed-size blocks, and a block holds
`block_size` values in `type_size` bytes: one or two fp16 scales and packed small integers. The
layouts below are llama.cpp's (ggml-common.h); every decoder works on all blocks of a tensor at
once. Only little-endian files exist in practice, and the reader refuses the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..int8_linear import Int8Rows
from ..quantized_linear import Int4Rows

QK_K = 256  # values per K-quant super-block


@dataclass(frozen=True, slots=True)
class TensorType:
    name: str
    block_size: int  # values per block
    type_size: int  # bytes per block


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, m] bytes -> [n, 2m] values: all low nibbles, then all high nibbles (ggml's order
    within a 32-value group)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """[n, m] bytes -> [n, 8m] bits, least significant bit of each byte first."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # d (fp16) | 16 bytes of 4-bit q; x = d * (q - 8)
    return _f16(b, 0) * (_nibbles(b[:, 2:18]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # d, m (fp16) | 16 bytes of 4-bit q; x = d * q + m
    return _f16(b, 0) * _nibbles(b[:, 4:20]).float() + _f16(b, 2)


def _q5(low: torch.Tensor, high_bits: torch.Tensor) -> torch.Tensor:
    """5-bit values from 16 bytes of low nibbles and 4 bytes (32 bits) of fifth bits."""
    return _nibbles(low) | (_bits(high_bits) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # d | 32 high bits (uint32) | 16 bytes of low nibbles; x = d * (q - 16)
    return _f16(b, 0) * (_q5(b[:, 6:22], b[:, 2:6]).float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    # d, m | 32 high bits | 16 bytes of low nibbles; x = d * q + m
    return _f16(b, 0) * _q5(b[:, 8:24], b[:, 4:8]).float() + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # d | 32 int8
    return _f16(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight 6-bit scales and eight 6-bit mins packed in 12 bytes (Q4_K, Q5_K): bytes 0-3 and
    4-7 hold scales 0-3 and mins 0-3 in their low 6 bits; scales/mins 4-7 take their low 4 bits
    from bytes 8-11 and their top 2 bits from the spare top bits of bytes 0-3 / 4-7."""
    s = packed.long()
    low_sc, low_m, rest = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([low_sc & 63, (rest & 0x0F) | ((low_sc >> 6) << 4)], dim=-1)
    mins = torch.cat([low_m & 63, (rest >> 4) | ((low_m >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> [n, 8, 32]: each 32-byte group gives one sub-block of low nibbles and the
    next sub-block of high nibbles."""
    groups = qs.reshape(-1, 4, 32)
    return torch.stack([groups & 0x0F, groups >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # d, dmin | 12 bytes of scales/mins | 128 bytes of 4-bit q; 8 sub-blocks of 32
    scales, mins = _k_scales(b[:, 4:16])
    q = _k_low_nibbles(b[:, 16:144]).float()
    x = (_f16(b, 0) * scales).unsqueeze(-1) * q - (_f16(b, 2) * mins).unsqueeze(-1)
    return x.reshape(-1, QK_K)


def _q5_k_values(b: torch.Tensor) -> torch.Tensor:
    # 32 bytes of high bits | 128 bytes of low nibbles (from byte 16); bit i of high byte l is
    # the fifth bit of value l of sub-block i
    high = (b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    return _k_low_nibbles(b[:, 48:176]) | (high << 4)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # d, dmin | 12 bytes of scales/mins | the 5-bit values; 8 sub-blocks of 32
    scales, mins = _k_scales(b[:, 4:16])
    q = _q5_k_values(b).float()
    x = (_f16(b, 0) * scales).unsqueeze(-1) * q - (_f16(b, 2) * mins).unsqueeze(-1)
    return x.reshape(-1, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # 128 bytes of low nibbles | 64 bytes of 2-bit highs | 16 int8 scales | d; each half of
    # 128 values takes 64 low-nibble bytes (values 0-63 low, 64-127 high) and 32 high bytes
    # (bits 2s..2s+1 of byte l belong to value 32s + l)
    low = b[:, 0:128].reshape(-1, 2, 1, 64)
    low = torch.cat([low & 0x0F, low >> 4], dim=2).reshape(-1, QK_K)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, QK_K)
    q = (low | (high << 4)).float() - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    x = (_f16(b, 208) * scales).unsqueeze(-1) * q.reshape(-1, 16, 16)
    return x.reshape(-1, QK_K)


def _k_ints(b: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K/Q5_K sub-block j: x = (d sc_j) q - dmin m_j."""
    scales, mins = _k_scales(b[:, 4:16])
    return q.reshape(-1, 32), (_f16(b, 0) * scales).reshape(-1, 1), \
        (-_f16(b, 2) * mins).reshape(-1, 1)


# GGML type id -> (planes, decoder to (integers q, scale, offset) per 32-value group, the
# value being scale * q + offset): the types a layer keeps packed (quantized_linear.py).
_INT_DECODERS: dict[int, tuple[int, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]]] = {
    2: (1, lambda b: (_nibbles(b[:, 2:18]), _f16(b, 0), -8 * _f16(b, 0))),  # Q4_0
    3: (1, lambda b: (_nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2))),  # Q4_1
    6: (2, lambda b: (_q5(b[:, 6:22], b[:, 2:6]), _f16(b, 0), -16 * _f16(b, 0))),  # Q5_0
    7: (2, lambda b: (_q5(b[:, 8:24], b[:, 4:8]), _f16(b, 0), _f16(b, 2))),  # Q5_1
    8: (2, lambda b: (b[:, 2:34].contiguous().view(torch.int8), _f16(b, 0),  # Q8_0
                      torch.zeros(len(b), 1))),
    12: (1, lambda b: _k_ints(b, _k_low_nibbles(b[:, 16:144]))),  # Q4_K
    13: (2, lambda b: _k_ints(b, _q5_k_values(b))),  # Q5_K
}


def packed_planes(type_id: int) -> int:
    """How many 4-bit planes a layer needs to hold a tensor of this type; 0: it cannot
    (float types, Q6_K's 16-value groups)."""
    return _INT_DECODERS[type_id][0] if type_id in _INT_DECODERS else 0


def _int_groups(raw: torch.Tensor, type_id: int, shape: tuple[int, int]
                ) -> tuple[int, tuple[torch.Tensor, ...]]:
    if type_id not in _INT_DECODERS:
        raise ValueError(f"GGML type {type_id} cannot be held packed")
    tt = SUPPORTED_TENSOR_TYPES[type_id]
    if raw.numel() != tensor_nbytes(type_id, shape):
        raise ValueError(f"{tt.name} tensor of shape {shape} needs "
                         f"{tensor_nbytes(type_id, shape)} bytes, got {raw.numel()}")
    planes, decode = _INT_DECODERS[type_id]
    q, scale, offset = decode(raw.reshape(-1, tt.type_size))
    return planes, (q.reshape(shape), scale, offset)


def int4_rows(raw: torch.Tensor, type_id: int, shape: tuple[int, int]) -> Int4Rows:
    """Decode a tensor of a type with `packed_planes` into `Int4Rows` of `shape` [rows, K],
    nothing rounded: `.dequantize()` equals `dequantize()` up to float32 rounding of the zero
    (offset + 8 * scale)."""
    planes, (q, scale, offset) = _int_groups(raw, type_id, shape)
    return Int4Rows.of_ints(q, scale, offset, planes)


def int8_rows(raw: torch.Tensor, type_id: int, shape: tuple[int, int]) -> Int8Rows:
    """Decode a tensor of a type with `packed_planes` into `Int8Rows` of `shape` [rows, K]
    (every such type's integers fit in int8), nothing rounded."""
    _, (q, scale, offset) = _int_groups(raw, type_id, shape)
    return Int8Rows.of_ints(q, scale, offset)


def _float(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda b: b.contiguous().view(dtype).float()


# GGML type id -> (encoding, decoder over [n_blocks, type_size] uint8 -> [n_blocks, block_size]).
_DECODERS: dict[int, tuple[TensorType, Callable[[torch.Tensor], torch.Tensor]]] = {
    0: (TensorType("F32", 1, 4), _float(torch.float32)),
    1: (TensorType("F16", 1, 2), _float(torch.float16)),
    30: (TensorType("BF16", 1, 2), _float(torch.bfloat16)),
    2: (TensorType("Q4_0", 32, 18), _q4_0),
    3: (TensorType("Q4_1", 32, 20), _q4_1),
    6: (TensorType("Q5_0", 32, 22), _q5_0),
    7: (TensorType("Q5_1", 32, 24), _q5_1),
    8: (TensorType("Q8_0", 32, 34), _q8_0),
    12: (TensorType("Q4_K", QK_K, 144), _q4_k),
    13: (TensorType("Q5_K", QK_K, 176), _q5_k),
    14: (TensorType("Q6_K", QK_K, 210), _q6_k),
}

SUPPORTED_TENSOR_TYPES: dict[int, TensorType] = {k: t for k, (t, _) in _DECODERS.items()}


def supported_type_names() -> str:
    return ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES.values())


def tensor_nbytes(type_id: int, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of this type and (torch-order) shape occupies; rows must be whole blocks."""
    tt = SUPPORTED_TENSOR_TYPES[type_id]
    row = shape[-1] if shape else 1
    if row % tt.block_size:
        raise ValueError(f"a {tt.name} row of {row} values is not a whole number of "
                         f"{tt.block_size}-value blocks")
    count = 1
    for n in shape:
        count *= n
    return count // tt.block_size * tt.type_size


def dequantize(raw: torch.Tensor, type_id: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode `raw` (the tensor's bytes, uint8) into a float32 tensor of `shape` (torch order:
    the last dimension is the contiguous GGML row)."""
    if type_id not in _DECODERS:
        raise ValueError(f"unsupported GGML tensor type {type_id}; supported: "
                         f"{supported_type_names()}")
    tt, decode = _DECODERS[type_id]
    expected = tensor_nbytes(type_id, shape)
    if raw.numel() != expected:
        raise ValueError(f"{tt.name} tensor of shape {shape} needs {expected} bytes, "
                         f"got {raw.numel()}")
    blocks = raw.reshape(-1, tt.type_size)
    return decode(blocks).reshape(shape)

"""Counter-based random numbers for the sampler.

A row's draws come from a hash of (its sequence's 64-bit seed, how many tokens the sequence has
sampled, the vocabulary index), not from a generator with state; see `uniform_noise`. On CUDA
one Triton kernel computes the same bits as the torch ops, in one launch instead of ~35.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - machines without Triton use the torch ops
    triton = None
    tl = None

# Counter-based random numbers. A row's draws come from a hash of (its sequence's 64-bit seed,
# how many tokens the sequence has sampled, the vocabulary index), not from a generator with
# state: every row of a batch is drawn by the same few tensor operations, without a loop over
# rows or a device generator per request, and a seeded sequence gives the same tokens
# whatever else is in the batch and whatever the engine did before, and the same draws on any
# device (integer arithmetic is exact everywhere). The hash is Wellons' lowbias32, twice.
_MASK32 = 0xFFFFFFFF
_LOWBIAS = (0x7FEB352D, 0x846CA68B)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of each element of x (int64 holding values in [0, 2^32)), in place. A
    product of two 32-bit values may pass 2^63 and wrap in int64; its low 32 bits, all that
    is kept, are exact either way (the Triton kernel splits the constant instead; the tests
    check the two agree bit for bit)."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_LOWBIAS[0]).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_LOWBIAS[1]).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def noise_keys(seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from its seed (64 bits, as int64) and step. Rows whose first keys
    differ also differ in the second (a bijection of the first), so no two rows' draws are a
    permutation of each other's."""
    high = (seeds >> 32) & _MASK32  # the shift is arithmetic: keep the 32 bits, not the sign
    k1 = _mix32_(_mix32_(_mix32_(steps & _MASK32).bitwise_xor_(high)).bitwise_xor_(
        seeds & _MASK32))
    return k1, _mix32_(k1 ^ 0x9E3779B9)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 uniform in (0, 1): row b's draws for step `steps[b]` of the
    sequence seeded `seeds[b]` (int64 tensors; a seed is any 64-bit pattern). On CUDA one
    Triton kernel computes the same bits."""
    k1, k2 = noise_keys(seeds, steps)
    if seeds.is_cuda and triton is not None:
        return triton_uniform_noise(k1, k2, vocab)
    index = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    # In place after the first op: these passes over [B, vocab] are the sampler's main cost
    # on a CPU, and fresh tensors for each would double it.
    x = _mix32_(index[None, :] ^ k1[:, None]).bitwise_xor_(k2[:, None])
    return to_uniform_(_mix32_(x))


def to_uniform_(x: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64) to float32 uniforms in (0, 1): the top 23 bits, centred in
    their interval, so every value is exact in float32 and strictly between 0 and 1 (with 24
    bits the largest, 2^24 - 0.5, rounds to 2^24: u = 1, an exponential of 0 that made a
    token of probability 0 win the race as NaN)."""
    return x.bitwise_right_shift_(9).float().add_(0.5).mul_(1.0 / (1 << 23))


if triton is not None:

    @triton.jit
    def _mul32(x, c: tl.constexpr):
        # (x * c) mod 2^32 in int64, the constant in 16-bit halves so no product passes 2^49
        # (`_mix32_` lets the int64 product wrap instead: the same low 32 bits). The
        # reduction subtracts the bits above 32 (the products are non-negative) rather than
        # masking with 0xFFFFFFFF, a literal Triton would type as uint32.
        y = x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)
        return y - ((y >> 32) << 32)

    @triton.jit
    def _mix32(x):
        x = x ^ (x >> 16)
        x = _mul32(x, 0x7FEB352D)
        x = x ^ (x >> 15)
        x = _mul32(x, 0x846CA68B)
        return x ^ (x >> 16)

    @triton.jit
    def _uniform_noise_kernel(K1, K2, OUT, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        k1 = tl.load(K1 + row)
        k2 = tl.load(K2 + row)
        x = _mix32(_mix32(offs.to(tl.int64) ^ k1) ^ k2)
        u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # to_uniform_
        tl.store(OUT + row.to(tl.int64) * vocab + offs, u, mask=offs < vocab)


def triton_uniform_noise(k1: torch.Tensor, k2: torch.Tensor, vocab: int) -> torch.Tensor:
    """The sampler's counter-based uniforms [B, vocab] from each row's two keys, bit for bit
    the torch computation of `uniform_noise`, in one launch instead of ~35."""
    out = torch.empty(k1.numel(), vocab, dtype=torch.float32, device=k1.device)
    block = 1024
    _uniform_noise_kernel[(k1.numel(), triton.cdiv(vocab, block))](
        k1.contiguous(), k2.contiguous(), out, vocab, BLOCK=block,
        num_warps=4 if k1.is_cuda else 1)
    return out

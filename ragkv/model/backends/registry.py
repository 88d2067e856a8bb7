"""The attention backends by name; Triton is imported only when asked for, so CPU machines
never need it."""

from __future__ import annotations

import torch

from .base import AttentionBackend
from .torch_sdpa import TorchAttentionBackend


def get_attention_backend(name: str = "torch",
                          device: torch.device | None = None) -> AttentionBackend:
    """The backend called `name` for `device`; "auto" is Triton on CUDA when it imports,
    else torch."""
    if name == "auto":
        if device is None or device.type != "cuda":
            return TorchAttentionBackend()
        from . import triton_kernels

        name = "triton" if triton_kernels.available() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from .triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; available: auto, torch, triton")

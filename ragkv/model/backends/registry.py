"""The attention backends by name; Triton is imported only when asked for, so CPU machines
never need it."""

from __future__ import annotations

import torch

from .base import AttentionBackend
from .torch_sdpa import TorchAttentionBackend


def get_attention_backend(name: str = "torch", device: torch.device | None = None,
                          windows: bool = False) -> AttentionBackend:
    """The backend called `name` for `device`; "auto" is Triton on CUDA when it imports,
    else torch. `windows`: the model has sliding-window layers, which only the torch
    backend applies so far ("auto" picks it)."""
    if windows and name == "triton":
        raise ValueError("the triton attention backend does not apply sliding windows yet; "
                         "use --attention-backend torch (or auto) for this model")
    if name == "auto":
        if device is None or device.type != "cuda" or windows:
            return TorchAttentionBackend()
        from . import triton_kernels

        name = "triton" if triton_kernels.available() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from .triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; available: auto, torch, triton")

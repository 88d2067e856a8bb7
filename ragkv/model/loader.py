"""Load a local HF checkpoint directory: config.json, one or sharded *.safetensors, the
tokenizer (AutoTokenizer) and the EOS ids of generation_config.json. Nothing is downloaded."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

from .llama import CausalLM
from .model_config import SUPPORTED_ARCHITECTURES, ModelConfig


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint directory that has been checked and described, not yet loaded."""

    path: str
    model_config: ModelConfig
    weight_files: tuple[str, ...]
    torch_dtype: object
    eos_token_ids: tuple[int, ...]
    fingerprint: str


def resolve_model_path(model: str) -> str:
    if model.startswith("builtin:"):
        from .builtin import builtin_model_path

        return builtin_model_path(model)
    return model


def inspect_checkpoint(model: str) -> Checkpoint:
    path = resolve_model_path(model)
    if not os.path.isdir(path):
        raise ValueError(f"model path {model!r} does not exist or is not a directory "
                         "(ragkv loads local HF directories or 'builtin:tiny' / 'builtin:small')")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"model path {path!r} has no config.json")
    with open(config_file, "rb") as f:
        config_bytes = f.read()
    raw = json.loads(config_bytes)
    from transformers import AutoConfig

    if not (set(raw.get("architectures") or []) & set(SUPPORTED_ARCHITECTURES)):
        # Fail before AutoConfig, which would reject unknown model types less clearly.
        ModelConfig.from_hf(_Namespace(raw))
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    model_config = ModelConfig.from_hf(hf_config)
    weight_files = _weight_files(path)
    digest = hashlib.sha256(config_bytes)
    for name in weight_files:
        digest.update(f"{os.path.basename(name)}:{os.path.getsize(name)}".encode())
    return Checkpoint(
        path=path,
        model_config=model_config,
        weight_files=tuple(weight_files),
        torch_dtype=raw.get("torch_dtype", raw.get("dtype")),
        eos_token_ids=tuple(_eos_ids(path, raw)),
        fingerprint=digest.hexdigest()[:16],
    )


def load_weights(model: CausalLM, weight_files: tuple[str, ...]) -> None:
    """Copy every checkpoint tensor into its (possibly fused) destination; all must be found."""
    targets: dict[str, tuple[torch.Tensor, int, int]] = {}
    for name, dest, offset, rows in model.weight_targets():
        targets[name] = (dest, offset, rows)
    loaded: set[str] = set()
    for file in weight_files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                target = targets.get(name)
                if target is None:
                    # e.g. lm_head.weight of a tied model, rotary buffers of old checkpoints
                    continue
                dest, offset, rows = target
                tensor = f.get_tensor(name)
                if tensor.shape[0] != rows or tensor.shape[1:] != dest.shape[1:]:
                    raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected "
                                     f"{(rows, *dest.shape[1:])}")
                with torch.no_grad():
                    dest.data[offset:offset + rows].copy_(tensor)
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, n) for n in names]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise ValueError(f"model.safetensors.index.json names missing shards: {absent}")
        return files
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model path {path!r} has no *.safetensors weights")
    return files


def _eos_ids(path: str, raw_config: dict) -> list[int]:
    ids: list[int] = []
    gen_file = os.path.join(path, "generation_config.json")
    source = raw_config
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            source = json.load(f)
    eos = source.get("eos_token_id", raw_config.get("eos_token_id"))
    if isinstance(eos, int):
        ids.append(eos)
    elif isinstance(eos, list):
        ids.extend(int(e) for e in eos)
    return ids


class _Namespace:
    def __init__(self, d: dict) -> None:
        self.__dict__.update(d)

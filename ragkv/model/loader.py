"""Load a local checkpoint: an HF directory (config.json, one or sharded *.safetensors, the
tokenizer, the EOS ids of generation_config.json), a GGUF file (gguf/reader.py), or a
registered model name. Nothing is downloaded."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open

from ..config import EngineConfig
from .file_digest import file_digest
from .gguf.quants import packed_planes
from .gguf.reader import GGUFFile, find_gguf_file, gguf_weights, load_gguf_tokenizer, read_gguf
from .int8_linear import GROUP_SIZE, Int8Linear, int8_supported
from .layers import Linear
from .llama import CausalLM
from .model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from .parallel import Shard
from .quantized_linear import Int4Linear, RowRoute, int4_supported, prompt_dtype
from .real_models import REAL_MODELS, real_model_file

logger = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint that has been checked and described, not yet loaded.

    `format` is "hf" (`path` is the directory) or "gguf" (`path` is the .gguf file and `gguf`
    says where each tensor lives). `fingerprint` names the weights in chunk-cache namespaces: for
    HF directories a hash of config.json and the weight files' names and content digests, for
    GGUF files the file's content digest (file_digest.py; computed once, then remembered by
    size+mtime).
    """

    path: str
    model_config: ModelConfig
    weight_files: tuple[str, ...]
    torch_dtype: object
    eos_token_ids: tuple[int, ...]
    fingerprint: str
    format: str = "hf"
    gguf: GGUFFile | None = None


def resolve_model_path(model: str) -> str:
    """A local path for `model`: built-in models are materialised, registered names
    (REAL_MODELS) resolve to the installed file; an existing path wins over a name."""
    if model.startswith("builtin:"):
        from .builtin import builtin_model_path

        return builtin_model_path(model)
    if model.lower() in REAL_MODELS and not os.path.exists(model):
        return real_model_file(model.lower())
    if not os.path.exists(model) and _HUB_ID.match(model):
        return hf_cache_snapshot(model)
    return model


# A Hugging Face Hub id, "Org/Name": looked up in the local HF cache (never downloaded).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hf_cache_dirs() -> list[str]:
    """Where the Hugging Face cache keeps models, as huggingface_hub decides: $HF_HUB_CACHE,
    else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub or ~/.cache/huggingface/hub."""
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return [env[name]]
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    return [os.path.join(home, "hub")]


def hf_cache_snapshot(model_id: str) -> str:
    """The local snapshot of Hub model `model_id` ("Org/Name"): the revision `refs/main`
    names, else the newest snapshot. Offline: a model not in the cache is a clear error."""
    org, name = model_id.split("/")
    looked = []
    for root in hf_cache_dirs():
        repo = os.path.join(root, f"models--{org}--{name}")
        looked.append(repo)
        snapshots = os.path.join(repo, "snapshots")
        if not os.path.isdir(snapshots):
            continue
        ref = os.path.join(repo, "refs", "main")
        if os.path.isfile(ref):
            with open(ref, encoding="utf-8") as f:
                candidate = os.path.join(snapshots, f.read().strip())
            if os.path.isdir(candidate):
                return candidate
        found = [e for e in os.scandir(snapshots) if e.is_dir()]
        if found:
            return max(found, key=lambda e: e.stat().st_mtime).path
    raise ValueError(f"model {model_id!r} is not a local path, and the Hugging Face cache has no "
                     f"snapshot of it (looked in {', '.join(looked)}); ragkv never downloads: "
                     f"fetch it first (huggingface-cli download {model_id}) or give a local "
                     "directory")


def inspect_checkpoint(model: str) -> Checkpoint:
    path = resolve_model_path(model)
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return _inspect_gguf(gguf_file)
    if not os.path.isdir(path):
        raise ValueError(f"model path {model!r} does not exist or is not a directory or .gguf "
                         "file (ragkv loads local HF directories, GGUF files, "
                         f"{', '.join(REAL_MODELS)} or 'builtin:tiny' / 'builtin:small')")
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
    # Over the weights' content (each file's digest is remembered by size and mtime), so two
    # fine-tunes with equal file sizes never share chunk KV, in this process or a shared store.
    digest = hashlib.sha256(config_bytes)
    for name in weight_files:
        digest.update(f"{os.path.basename(name)}:{file_digest(name)}".encode())
    return Checkpoint(
        path=path,
        model_config=model_config,
        weight_files=tuple(weight_files),
        torch_dtype=raw.get("torch_dtype", raw.get("dtype")),
        eos_token_ids=tuple(_eos_ids(path, raw)),
        fingerprint=digest.hexdigest()[:16],
    )


def _inspect_gguf(path: str) -> Checkpoint:
    info = read_gguf(path)
    return Checkpoint(
        path=path,
        model_config=info.model_config,
        weight_files=(path,),
        torch_dtype=info.torch_dtype,
        eos_token_ids=info.eos_token_ids,
        fingerprint=file_digest(path)[:32],
        format="gguf",
        gguf=info,
    )


def load_hf_model(model: str, attn_implementation: str = "sdpa"):
    """The same checkpoint in HF transformers (float32), for the benchmarks' comparisons:
    an HF directory as it is, a GGUF file through transformers' own GGUF loader (which needs
    the gguf and accelerate packages)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    gguf_file = find_gguf_file(path)
    kwargs = {"dtype": torch.float32, "attn_implementation": attn_implementation}
    if gguf_file is not None:
        path, kwargs["gguf_file"] = os.path.split(gguf_file)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def use_packed(config: EngineConfig, checkpoint: Checkpoint, device: torch.device) -> bool:
    """Whether quantized GGUF weights stay packed (`--quantization`): "gguf" asks for it,
    "none" refuses it, None (auto) takes it where it is the faster measured path: a GGUF file
    with weights of a packable type, on CPU (4-bit planes), unless --dtype float32 asks for
    dense float32 weights (docs/benchmarks.md). On CUDA, "gguf" holds them as int8 groups
    (Triton kernels)."""
    quantization = config.quantization
    if quantization == "none":
        return False
    packable = checkpoint.gguf is not None and any(
        packed_planes(t.type_id) for t in checkpoint.gguf.tensors)
    if quantization is None:
        return packable and device.type == "cpu" and config.dtype != "float32"
    if checkpoint.gguf is None:
        raise ValueError(f"quantization='gguf' needs a GGUF checkpoint; {checkpoint.path!r} "
                         "is an HF directory")
    if device.type not in ("cpu", "cuda") or (
            device.type == "cuda" and not int8_supported(GROUP_SIZE, device)):
        raise ValueError(f"quantization='gguf' keeps weights packed on CPU, and on CUDA with "
                         f"Triton; on {device} use quantization='none' (weights dequantized "
                         "at load)")
    if not packable:
        logger.warning("quantization='gguf': %s has no weights of a packable type (Q4_0, Q4_1, "
                       "Q4_K, Q5_0, Q5_1, Q5_K, Q8_0); every weight is dequantized",
                       checkpoint.path)
    return packable


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    """What `load_weights` built: how many linear layers hold packed 4-bit weights (CPU), how
    many int8 groups (CUDA), how many dense ones, and the bytes of all weights as held."""

    int4_layers: int
    dense_layers: int
    weight_bytes: int
    int8_layers: int = 0

    @property
    def id_suffix(self) -> str:
        """What the weights' identity (chunk keys) adds to the checkpoint's fingerprint."""
        return "+int4" if self.int4_layers else "+int8" if self.int8_layers else ""

    def describe(self) -> str:
        held = f"{self.weight_bytes / 2**20:.0f} MiB"
        if self.int4_layers:
            packed = f"{self.int4_layers} linear layers packed 4-bit"
        elif self.int8_layers:
            packed = f"{self.int8_layers} linear layers held as int8 groups"
        else:
            return f"{held}, every linear layer dense"
        return f"{held}, {packed} (--quantization gguf), {self.dense_layers} dense"


PackedLinear = Int4Linear | Int8Linear


def load_weights(model: CausalLM, checkpoint: Checkpoint, packed: bool = False,
                 int8: bool | None = None) -> LoadedWeights:
    """Copy every checkpoint tensor into its (possibly fused) destination; all must be found.
    GGUF tensors arrive dequantized (float32) and are cast to the destination's dtype. With
    `packed`, the linear layers (embedding and LM head included) whose every source tensor has
    a packable type (Q4_0/1, Q4_K, Q5_0/1, Q5_K, Q8_0) hold the file's values: `Int4Linear`s on
    CPU (quantized_linear.py), `Int8Linear`s on CUDA (int8_linear.py; `int8` True: on any
    device, which on CPU runs the Triton kernels through Triton's interpreter, for tests)."""
    targets: dict[str, tuple[torch.Tensor | PackedLinear, int, int]] = {}
    shards: dict[str, Shard] = {}  # this rank's part of a tensor (tensor parallelism)
    for name, dest, offset, rows, shard in model.weight_targets():
        targets[name] = (dest, offset, rows)
        if shard is not None:
            shards[name] = shard
    if int8 is None:
        int8 = model.norm.weight.device.type == "cuda"
    layers_of = _packed_linears(model, checkpoint, targets, int8) if packed else {}
    if checkpoint.gguf is not None:
        tensors = gguf_weights(checkpoint.gguf, frozenset(layers_of), int8)
    else:
        tensors = _safetensors(checkpoint.weight_files, targets)
    loaded: set[str] = set()
    plus_one = model.config.norm_plus_one
    for name, tensor in tensors:
        dest, offset, rows = targets[name]
        if name in shards:
            tensor = shards[name].take(tensor)
        if plus_one and name.endswith("norm.weight"):
            tensor = 1.0 + tensor.float()  # Gemma applies 1 + w, computed as HF does
        if isinstance(dest, PackedLinear):
            dest.load(offset, tensor)
        elif tensor.shape[0] != rows or tensor.shape[1:] != dest.shape[1:]:
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected "
                             f"{(rows, *dest.shape[1:])}")
        else:
            with torch.no_grad():
                dest.data[offset:offset + rows].copy_(tensor)
        loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
    layers = {id(m): m for m in layers_of.values()}
    for layer in layers.values():
        layer.pack()
    if layers and not int8:
        prompt_dtype()  # chosen (and logged) now, not in the first request's time
    dense = sum(isinstance(m, Linear) for m in model.modules())
    held = sum(m.weight_bytes() for m in layers.values()) + sum(
        t.numel() * t.element_size() for t in model.parameters())
    result = (LoadedWeights(0, dense, held, len(layers)) if int8
              else LoadedWeights(len(layers), dense, held))
    logger.info("weights: %s", result.describe())
    return result


def _packed_linears(model: CausalLM, checkpoint: Checkpoint,
                    targets: dict[str, tuple[torch.Tensor | PackedLinear, int, int]],
                    int8: bool) -> dict[str, PackedLinear]:
    """Swap every `Linear` (and the embedding and LM head) whose weights all come from GGUF
    tensors of a packable type, in a shape the kernel takes, for an `Int4Linear` (CPU) or an
    `Int8Linear` (`int8`: CUDA), and point `targets` at it; returns those weight names."""
    if checkpoint.gguf is None:
        return {}
    planes = {t.hf_name: packed_planes(t.type_id) for t in checkpoint.gguf.tensors}
    mc = model.config
    device = model.norm.weight.device
    # (weight names, rows, inputs, bias, install) of every candidate destination.
    candidates = []
    for path, m in model.named_modules():
        if isinstance(m, Linear):
            names = [n for n, (dest, _, _) in targets.items() if dest is m.weight]
            parent, _, attr = path.rpartition(".")
            candidates.append((names, *m.weight.shape, m.bias, functools.partial(
                setattr, model.get_submodule(parent), attr)))
    candidates.append((["model.embed_tokens.weight"], mc.vocab_size, mc.hidden_size, None,
                       model.pack_embedding))
    if "lm_head.weight" in targets:
        candidates.append((["lm_head.weight"], mc.vocab_size, mc.hidden_size, None,
                           model.pack_head))
    packed: dict[str, PackedLinear] = {}
    route = RowRoute()
    for names, rows, inputs, bias, install in candidates:
        need = [planes.get(n, 0) for n in names]
        fits = inputs % GROUP_SIZE == 0 if int8 else int4_supported(inputs, rows, device)
        if not names or 0 in need or not fits:
            continue
        layer = (Int8Linear(inputs, rows, bias, device) if int8
                 else Int4Linear(inputs, rows, bias, max(need), route))
        install(layer)
        for name in names:
            _, offset, n = targets[name]
            targets[name] = (layer, offset, n)
            packed[name] = layer
    # Int4 layers route rows by the token's kind (quantized_linear.RowRoute); int8 layers by
    # the step's size alone, both of their paths multiplying by the same rounded weights.
    model.route = route if packed and not int8 else None
    return packed


def _safetensors(weight_files: tuple[str, ...],
                 wanted: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for file in weight_files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                # Others are skipped unread: e.g. lm_head.weight of a tied model, rotary
                # buffers of old checkpoints.
                if name in wanted:
                    yield name, f.get_tensor(name)


def load_tokenizer(path: str):
    """The tokenizer of an HF directory, or the one in a GGUF file's metadata (a .gguf path,
    a directory holding one .gguf, or a registered model name already resolved to its file)."""
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return load_gguf_tokenizer(gguf_file)
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

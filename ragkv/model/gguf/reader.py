"""GGUF checkpoints: llama.cpp's single-file format (metadata, tokenizer and weights in one file).

`read_gguf` checks a file completely before any model is built: readable header, a supported
architecture, every tensor of a supported type, inside the file, named and shaped as the model
config derived from the metadata expects. `gguf_weights` then yields the tensors dequantized to
float32 under the HF names `CausalLM.weight_targets()` uses, with llama.cpp's reordering of the
Q/K rows undone, so the ordinary loader copies them into the fused destinations.

The `gguf` package (llama.cpp's reader) is optional and imported only here, when a GGUF file is
actually opened; the dequantizers are ragkv's own (quants.py).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..file_digest import cache_root, file_digest
from ..int8_linear import Int8Rows
from ..layers import rope_inv_freq
from ..model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from ..quantized_linear import Int4Rows
from .quants import (
    SUPPORTED_TENSOR_TYPES,
    dequantize,
    int4_rows,
    int8_rows,
    supported_type_names,
    tensor_nbytes,
)

# GGUF general.architecture -> (HF architecture, whether llama.cpp's converter permuted the rows
# of Q and K). The converter reorders Llama/Mistral Q/K rows from HF's rotate-half layout to the
# interleaved one llama.cpp's RoPE uses; Qwen2/Qwen3 run llama.cpp's NeoX RoPE (= rotate-half)
# and are stored as in HF.
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "gemma3": ("Gemma3ForCausalLM", False),
}

_INSTALL_HINT = "pip install gguf (or pip install -e '.[gguf]')"
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3 frequency divisors, folded into the RoPE config

# GGUF tensor names -> HF names (blk.N.<part>.<weight|bias> -> model.layers.N.<part>.<...>).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's norms around attention and MLP (llama.cpp's names): ffn_norm is the norm before the
# MLP, HF's pre_feedforward_layernorm, and post_attention_norm the norm of the attention output.
_SANDWICH_PARTS = {
    **_BLOCK_PARTS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 3 as llama.cpp runs it when the file does not say otherwise: every sixth layer full
# attention, the others sliding with RoPE base 10k.
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_BASE = 10000.0


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """Where one weight lives in the file and what it becomes."""

    name: str  # GGUF name, e.g. blk.0.attn_q.weight
    hf_name: str  # e.g. model.layers.0.self_attn.q_proj.weight
    type_id: int  # GGML type
    shape: tuple[int, ...]  # torch order (the last dimension is the contiguous row)
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """A checked GGUF checkpoint: everything needed to build and load the model."""

    path: str
    model_config: ModelConfig
    tensors: tuple[GGUFTensor, ...]
    permuted_qk: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None  # the float type of the file's weights, None when quantized


def import_gguf():
    """The optional `gguf` package, or a ValueError saying how to install it."""
    try:
        import gguf
    except ImportError as e:
        raise ValueError(f"loading GGUF checkpoints needs the gguf package: {_INSTALL_HINT}"
                         ) from e
    return gguf


def find_gguf_file(path: str) -> str | None:
    """`path` itself when it is a .gguf file; the one .gguf of a directory without config.json;
    None for anything else (an HF directory). Several .gguf files are ambiguous: an error."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    files = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
    if len(files) > 1:
        raise ValueError(f"{path!r} holds {len(files)} .gguf files ({', '.join(files[:4])}); "
                         "pass the one to load")
    return os.path.join(path, files[0]) if files else None


def read_gguf(path: str) -> GGUFFile:
    """Read and check a GGUF checkpoint; every problem is a ValueError raised here."""
    gguf = import_gguf()
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader fails in many ways on damaged files
        raise ValueError(f"{path!r} is not a readable GGUF file (truncated or corrupt?): "
                         f"{type(e).__name__}: {e}") from e
    if reader.byte_order != "I":
        raise ValueError(f"{path!r} is a big-endian GGUF file; ragkv reads little-endian ones")
    meta = _Metadata(reader, path)
    if meta.get("split.count", 1) > 1:
        raise ValueError(f"{path!r} is one shard of a split GGUF; merge the shards first "
                         "(llama-gguf-split --merge)")
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; ragkv supports: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    table = _tensor_table(reader, path)
    model_config = _model_config(meta, arch, table, reader)
    expected = _expected_shapes(model_config)
    _check_names_and_shapes(table, expected, path)
    tensors = tuple(
        GGUFTensor(name, _hf_name(name, model_config.sandwich_norms), *table[name])
        for name in expected
    )
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return GGUFFile(
        path=path,
        model_config=model_config,
        tensors=tensors,
        permuted_qk=SUPPORTED_GGUF_ARCHITECTURES[arch][1],
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        torch_dtype=_float_type(t.type_id for t in tensors),
    )


def gguf_weights(ckpt: GGUFFile, packed: frozenset[str] = frozenset(), int8: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | Int4Rows | Int8Rows]]:
    """(HF name, float32 tensor) for every weight, dequantized one at a time; the weights named
    in `packed` (of a type with `packed_planes`) come as `Int4Rows` instead (`Int8Rows` with
    `int8`), nothing rounded."""
    mc = ckpt.model_config
    with open(ckpt.path, "rb") as f:
        for t in ckpt.tensors:
            f.seek(t.offset)
            buf = bytearray(t.nbytes)
            if f.readinto(buf) != t.nbytes:
                raise ValueError(f"{ckpt.path!r} ends inside tensor {t.name} (file truncated "
                                 "after it was inspected?)")
            raw = torch.frombuffer(buf, dtype=torch.uint8)
            if t.hf_name in packed:
                weight = (int8_rows if int8 else int4_rows)(raw, t.type_id, t.shape)
            else:
                weight = dequantize(raw, t.type_id, t.shape)
            if mc.norm_plus_one and t.name.endswith("norm.weight"):
                # llama.cpp's converter stored Gemma's norm weights as 1 + w; HF's are w
                # (and HF loading this file subtracts 1 as here).
                weight = weight - 1
            if ckpt.permuted_qk and ".attn_q." in t.name:
                weight = _unpermute_rows(weight, mc.num_heads)
            elif ckpt.permuted_qk and ".attn_k." in t.name:
                weight = _unpermute_rows(weight, mc.num_kv_heads)
            yield t.hf_name, weight


def load_gguf_tokenizer(path: str):
    """The tokenizer (and chat template) stored in the GGUF metadata, built by transformers.

    Building it from the metadata takes seconds (a 50k-entry vocabulary read entry by entry),
    so the result is saved under $RAGKV_CACHE_DIR/gguf-tokenizers/, keyed by the file's content
    digest, the transformers version and the build's own version (v2: the file's BOS/EOS
    flags applied), and later loads read that copy.
    """
    import transformers
    from transformers import AutoTokenizer

    import_gguf()  # transformers reads the metadata with it
    cached = (cache_root() / "gguf-tokenizers"
              / f"{file_digest(path)[:32]}-transformers-{transformers.__version__}-v2")
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
        except (OSError, ValueError):
            pass  # a damaged copy is rebuilt below
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                  gguf_file=os.path.basename(path),
                                                  local_files_only=True)
    except Exception as e:  # transformers raises many kinds on a vocabulary it cannot build
        raise ValueError(f"could not build a tokenizer from the metadata of {path!r} "
                         f"({type(e).__name__}: {e}); pass --tokenizer DIR with an HF tokenizer"
                         ) from e
    # Whether a BOS (EOS) token starts (ends) every encoding is the file's to say: transformers
    # releases disagree on it (5.17 ignores add_bos_token, 5.24 follows it).
    meta = _Metadata(import_gguf().GGUFReader(path), path)
    for flag in ("add_bos_token", "add_eos_token"):
        value = meta.get(f"tokenizer.ggml.{flag}")
        if value is not None and hasattr(tokenizer, flag):
            setattr(tokenizer, flag, bool(value))
    _save_tokenizer(tokenizer, cached)
    return tokenizer


def _save_tokenizer(tokenizer, final: Path) -> None:
    """Save into a sibling temp dir and rename into place, so readers never see half a copy;
    a cache that cannot be written only costs the rebuild next time."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    except OSError:
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        tmp.chmod(0o755)
        os.replace(tmp, final)
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Metadata:
    """Typed access to the GGUF key/value metadata."""

    def __init__(self, reader, path: str) -> None:
        self._fields = reader.fields
        self._path = path
        self._value_type = import_gguf().GGUFValueType

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        if field is None:
            return default
        kind = field.types[0]
        if kind == self._value_type.ARRAY:
            if field.types[-1] == self._value_type.STRING:
                return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            return [field.parts[i].item() for i in field.data]
        if kind == self._value_type.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        return field.parts[field.data[0]].item()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file {self._path!r} lacks the metadata key {key!r}")
        return value


def _tensor_table(reader, path: str) -> dict[str, tuple[int, tuple[int, ...], int, int]]:
    """name -> (type id, torch shape, absolute offset, bytes), after checking every tensor's
    type and that its bytes lie inside the file."""
    size = os.path.getsize(path)
    table = {}
    for t in reader.tensors:
        type_id = int(t.tensor_type)
        if type_id not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(f"tensor {t.name} of {path!r} has the unsupported type "
                             f"{t.tensor_type.name}; ragkv dequantizes: {supported_type_names()}")
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        nbytes = tensor_nbytes(type_id, shape)
        offset = int(t.data_offset)
        if offset + nbytes > size:
            raise ValueError(f"{path!r} is truncated: tensor {t.name} needs bytes up to "
                             f"{offset + nbytes}, the file has {size}")
        table[t.name] = (type_id, shape, offset, nbytes)
    return table


def _model_config(meta: _Metadata, arch: str, table: dict, reader) -> ModelConfig:
    def key(name: str) -> str:
        return f"{arch}.{name}"

    hidden = meta.require(key("embedding_length"))
    num_heads = meta.require(key("attention.head_count"))
    num_kv_heads = meta.get(key("attention.head_count_kv"), num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts: only uniform ones are supported
        if len(set(num_kv_heads)) != 1:
            raise ValueError(f"per-layer KV head counts {sorted(set(num_kv_heads))} are not "
                             "supported")
        num_kv_heads = num_kv_heads[0]
    head_dim = meta.get(key("attention.key_length"), hidden // num_heads)
    if meta.get(key("attention.value_length"), head_dim) != head_dim:
        raise ValueError("GGUF models whose value heads differ in size from key heads are not "
                         "supported")
    if meta.get(key("rope.dimension_count"), head_dim) != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    if "token_embd.weight" not in table:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    context_length = meta.require(key("context_length"))
    names = set(table)
    family = SUPPORTED_GGUF_ARCHITECTURES[arch][0]
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        family = "MistralForCausalLM"  # llama.cpp files Mistral under llama; only the name differs
    num_layers = meta.require(key("block_count"))
    window = meta.get(key("attention.sliding_window")) or None
    rope = _rope(meta, arch, head_dim, context_length, table, reader)
    gemma: dict = {}
    if arch == "gemma3":
        gemma = _gemma3(meta, num_layers, hidden, num_heads, head_dim, window)
    return ModelConfig(
        architecture=family,
        vocab_size=table["token_embd.weight"][1][0],
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=meta.require(key("feed_forward_length")),
        rms_norm_eps=float(meta.require(key("attention.layer_norm_rms_epsilon"))),
        max_position_embeddings=context_length,
        rope=rope,
        # Bias and norm tensors present in the file decide the variant, as in HF configs.
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_gate.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        tie_word_embeddings="output.weight" not in names,
        sliding_window=window,
        **gemma,
    )


def _gemma3(meta: _Metadata, num_layers: int, hidden: int, num_heads: int, head_dim: int,
            window: int | None) -> dict:
    """The ModelConfig fields of a Gemma 3 file beyond Llama's, as llama.cpp reads it: the
    layer pattern (`attention.sliding_window_pattern`: every n-th layer full, or one flag
    per layer; absent: every sixth), the sliding layers' RoPE base (`rope.freq_base_swa`,
    absent: 10k), the attention scale (1/sqrt(head_dim); 1/sqrt(hidden/heads) for the
    62-layer 27B) and the final soft-capping."""
    if not window:
        raise ValueError("GGUF gemma3 file without gemma3.attention.sliding_window: ragkv "
                         "cannot tell which positions its sliding layers see")
    pattern = meta.get("gemma3.attention.sliding_window_pattern", _GEMMA3_PATTERN)
    if isinstance(pattern, list) and len(pattern) == num_layers:
        sliding = [bool(p) for p in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        raise ValueError(f"unsupported gemma3.attention.sliding_window_pattern {pattern!r}: "
                         f"ragkv reads a period or one flag per layer ({num_layers})")
    local_base = float(meta.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_BASE))
    family = SUPPORTED_ARCHITECTURES["Gemma3ForCausalLM"]
    return dict(
        hidden_act="gelu_pytorch_tanh",
        layer_windows=tuple(int(window) if s else None for s in sliding),
        local_rope={"rope_type": "default", "rope_theta": local_base},
        query_pre_attn_scalar=hidden / num_heads if num_layers == 62 else head_dim,
        sandwich_norms=family["sandwich_norms"], norm_plus_one=family["norm_plus_one"],
        embed_scale=hidden ** 0.5,
        final_logit_softcapping=meta.get("gemma3.final_logit_softcapping") or None,
    )


def _rope(meta: _Metadata, arch: str, head_dim: int, context_length: int, table: dict,
          reader) -> dict:
    """RoPE parameters in the form ModelConfig uses (HF's `rope_parameters`)."""
    base = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    rope: dict = {"rope_type": "default", "rope_theta": base}
    if _ROPE_FREQS in table:
        tensor = next(t for t in reader.tensors if t.name == _ROPE_FREQS)
        type_id, shape, _, nbytes = table[_ROPE_FREQS]
        raw = torch.frombuffer(bytearray(tensor.data.tobytes()[:nbytes]), dtype=torch.uint8)
        divisors = dequantize(raw, type_id, shape).reshape(-1)
        if divisors.numel() != head_dim // 2:
            raise ValueError(f"rope_freqs has {divisors.numel()} entries, expected {head_dim // 2}")
        return _llama3_rope(divisors, head_dim, base, context_length)
    if scaling == "none" or factor in (None, 1.0):
        return rope
    if scaling == "linear":
        return {**rope, "rope_type": "linear", "factor": float(factor)}
    if scaling == "yarn":
        original = meta.get(f"{arch}.rope.scaling.original_context_length", context_length)
        rope.update(rope_type="yarn", factor=float(factor),
                    original_max_position_embeddings=int(original))
        for gguf_key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                               ("yarn_attn_factor", "attention_factor")):
            value = meta.get(f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                rope[name] = float(value)
        return rope
    raise ValueError(f"unsupported RoPE scaling {scaling!r} in the GGUF metadata; supported: "
                     "none, linear, yarn, and Llama 3 frequency factors (rope_freqs)")


def _llama3_rope(divisors: torch.Tensor, head_dim: int, base: float, original: int) -> dict:
    """Llama 3 RoPE parameters that reproduce llama.cpp's per-frequency divisors.

    The converter stores the divisors it computed (1 for short wavelengths, `factor` for long
    ones, a smooth blend between), not the parameters. With x = 1/wavelength, the blend weight
    is linear in x between the band edges a = low_freq_factor/original and b =
    high_freq_factor/original, so the edges are fitted from the blended frequencies; when fewer
    than two are blended, any edges that put every frequency in its band rotate identically.
    The result is checked against the divisors.
    """
    divisors = divisors.double()
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    x = inv_freq / (2 * math.pi)
    factor = float(divisors.max())
    if factor <= 1.0:
        return {"rope_type": "default", "rope_theta": base}
    blend = (1 / divisors - 1 / factor) / (1 - 1 / factor)  # 0: fully scaled, 1: untouched
    eps = 1e-6
    mid = (blend > eps) & (blend < 1 - eps)
    lo = float(x[blend <= eps].max())
    hi = float(x[blend >= 1 - eps].min()) if bool((blend >= 1 - eps).any()) else 2 * float(x.max())
    if int(mid.sum()) >= 2:
        xs, ws = x[mid], blend[mid]
        slope = float(((xs - xs.mean()) * (ws - ws.mean())).sum() / ((xs - xs.mean()) ** 2).sum())
        intercept = float(ws.mean()) - slope * float(xs.mean())
        a, b = -intercept / slope, (1 - intercept) / slope
    elif int(mid.sum()) == 1:
        xm, w = float(x[mid]), float(blend[mid])
        width = min((xm - lo) / w, (hi - xm) / (1 - w)) / 2
        a, b = xm - w * width, xm + (1 - w) * width
    else:
        a, b = lo + (hi - lo) / 3, lo + 2 * (hi - lo) / 3
    rope = {"rope_type": "llama3", "rope_theta": base, "factor": factor,
            "original_max_position_embeddings": original,
            "low_freq_factor": original * a, "high_freq_factor": original * b}
    got, _ = rope_inv_freq(head_dim, rope, original)
    want = (inv_freq / divisors).float()
    if not torch.allclose(got, want, rtol=1e-4, atol=0):
        raise ValueError("the GGUF's rope_freqs are not Llama 3 frequency scaling; "
                         "ragkv cannot reproduce them")
    return rope


def _expected_shapes(mc: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every GGUF tensor the model needs, with its torch-order shape."""
    h, v, d, inter = mc.hidden_size, mc.vocab_size, mc.head_dim, mc.intermediate_size
    q, kv = mc.num_heads * d, mc.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not mc.tie_word_embeddings:
        shapes["output.weight"] = (v, h)
    for i in range(mc.num_layers):
        p = f"blk.{i}."
        layer = {"attn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
                 "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_norm.weight": (h,),
                 "ffn_gate.weight": (inter, h), "ffn_up.weight": (inter, h),
                 "ffn_down.weight": (h, inter)}
        if mc.qkv_bias:
            layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
        if mc.o_bias:
            layer["attn_output.bias"] = (h,)
        if mc.qk_norm:
            layer.update({"attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,)})
        if mc.mlp_bias:
            layer.update({"ffn_gate.bias": (inter,), "ffn_up.bias": (inter,),
                          "ffn_down.bias": (h,)})
        if mc.sandwich_norms:
            layer.update({"post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)})
        shapes.update({p + name: shape for name, shape in layer.items()})
    return shapes


def _check_names_and_shapes(table: dict, expected: dict, path: str) -> None:
    missing = [n for n in expected if n not in table]
    if missing:
        raise ValueError(f"GGUF file {path!r} lacks {len(missing)} tensors the model needs, "
                         f"e.g. {missing[:3]}")
    unexpected = sorted(set(table) - set(expected) - {_ROPE_FREQS})
    if unexpected:
        raise ValueError(f"GGUF file {path!r} has {len(unexpected)} tensors ragkv's model has "
                         f"no place for, e.g. {unexpected[:3]}")
    for name, shape in expected.items():
        if table[name][1] != shape:
            raise ValueError(f"tensor {name} has shape {table[name][1]}, the GGUF metadata "
                             f"implies {shape}")


def _hf_name(name: str, sandwich: bool) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    _, layer, part, suffix = name.split(".")
    parts = _SANDWICH_PARTS if sandwich else _BLOCK_PARTS
    return f"model.layers.{layer}.{parts[part]}.{suffix}"


def _unpermute_rows(weight: torch.Tensor | Int4Rows | Int8Rows, num_heads: int
                    ) -> torch.Tensor | Int4Rows | Int8Rows:
    """Undo llama.cpp's `permute`, which within each head moved row pairs (i, i + d/2) next to
    each other (rotate-half -> interleaved RoPE layout)."""
    packed = isinstance(weight, Int4Rows | Int8Rows)
    rows = weight.q.shape[0] if packed else weight.shape[0]
    order = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2)
    order = order.transpose(1, 2).reshape(rows)
    if packed:
        return weight.permute_rows(order)
    return weight[order]


def _float_type(type_ids) -> str | None:
    """The float type the weights were written in; None (the engine's default) when any are
    quantized, whose values came from fp16 scales but were never a float tensor."""
    names = {SUPPORTED_TENSOR_TYPES[t].name for t in type_ids}
    if not names <= {"F32", "F16", "BF16"}:
        return None
    if "BF16" in names:
        return "bfloat16"
    return "float16" if "F16" in names else "float32"

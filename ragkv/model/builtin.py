"""Built-in random-weight Llama models that need no download.

They let the engine, tests and benchmarks run offline: the weights come from a fixed-seed
generator and the tokenizer is a byte-level BPE trained on a small bundled corpus, so every
machine materialises byte-identical checkpoints in a normal Hugging Face layout.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

FORMAT_VERSION = 1
"""Bump whenever the on-disk layout or the generation procedure changes, to invalidate caches."""

PREFIX = "builtin:"
SEED = 0
INIT_STD = 0.02
VOCAB_SIZE = 4096

UNK, BOS, EOS, PAD, IM_START, IM_END = (
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "<|im_start|>",
    "<|im_end|>",
)
SPECIAL_TOKENS: tuple[str, ...] = (UNK, BOS, EOS, PAD, IM_START, IM_END)
"""BPE training puts special tokens first, so their ids are their positions here."""

UNK_ID, BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The Qwen-family model's template: ChatML without a BOS, with tool calling in the Hermes style
# that Qwen2.5 and Qwen3 use (the tools as JSON lines in <tools> in the system turn, calls as
# <tool_call> JSON in the assistant's turn, results in <tool_response> in a user turn).
TOOLS_CHAT_TEMPLATE = (
    "{%- set first = messages[0] if messages else none %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if first and first.role == 'system' %}{{- first.content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call functions to answer. Their signatures, one JSON object a "
    "line:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, reply with a JSON object holding the function name and '"
    "'its arguments, inside <tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif first and first.role == 'system' %}"
    "{{- '<|im_start|>system\\n' + first.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if loop.first and not message.content %}{{- '<tool_call>\\n' }}"
    "{%- else %}{{- '\\n<tool_call>\\n' }}{%- endif %}"
    "{{- '{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_COMMON: dict = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}

BUILTIN_MODELS: dict[str, dict] = {
    "builtin:tiny": {
        **_COMMON,
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
    },
    "builtin:small": {
        **_COMMON,
        "num_hidden_layers": 8,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1408,
    },
    # builtin:tiny's shape in the Qwen2 family (bias on q, k and v), with a chat template
    # that calls tools: the family tool calling is written for.
    "builtin:tiny-qwen2": {
        **_COMMON,
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
    },
}
# Each model's chat template (CHAT_TEMPLATE unless named here).
_TEMPLATES = {"builtin:tiny-qwen2": TOOLS_CHAT_TEMPLATE}


def is_builtin(model: str) -> bool:
    """True for any ``builtin:`` name, so unknown ones reach a helpful ValueError, not the hub."""
    return isinstance(model, str) and model.startswith(PREFIX)


def _resolve_name(name: str) -> str:
    full = name if name.startswith(PREFIX) else PREFIX + name
    if full not in BUILTIN_MODELS:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise ValueError(f"unknown built-in model {name!r}; available: {known}")
    return full


@functools.lru_cache(maxsize=1)
def _corpus_bytes() -> bytes:
    return resources.files("ragkv.model").joinpath("data/builtin_corpus.txt").read_bytes()


def _fingerprint(spec: dict, chat_template: str) -> str:
    """Short hash of everything that determines the checkpoint, so stale caches are never reused."""
    h = hashlib.sha256()
    h.update(f"format={FORMAT_VERSION};seed={SEED};std={INIT_STD};".encode())
    h.update(json.dumps(spec, sort_keys=True).encode())
    h.update(json.dumps([SPECIAL_TOKENS, chat_template]).encode())
    h.update(_corpus_bytes())
    return h.hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def _trained_tokenizer() -> Tokenizer:
    """Train the byte-level BPE once per process; training is deterministic for a given corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One document keeps the paragraph breaks, so "\n\n" gets its own merge.
    tok.train_from_iterator([_corpus_bytes().decode("utf-8")], trainer=trainer)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"unexpected special token ids {ids}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, BOS_ID)],
    )
    return tok


def _fast_tokenizer(chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A fresh wrapper per call: PreTrainedTokenizerFast is mutable and callers may tweak it."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_trained_tokenizer().to_str())
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=chat_template,
        model_max_length=_COMMON["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def save_builtin_tokenizer(path: str, chat_template: str = CHAT_TEMPLATE
                           ) -> PreTrainedTokenizerFast:
    """Write the built-in tokenizer files into ``path`` so tests can build their own checkpoints."""
    os.makedirs(path, exist_ok=True)
    tokenizer = _fast_tokenizer(chat_template)
    tokenizer.save_pretrained(path)
    return tokenizer


def _random_state_dict(spec: dict) -> dict[str, torch.Tensor]:
    """Our own init (not transformers') so weights never change with library versions."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    hidden = spec["hidden_size"]
    head_dim = spec.get("head_dim") or hidden // spec["num_attention_heads"]
    q_dim = spec["num_attention_heads"] * head_dim
    kv_dim = spec["num_key_value_heads"] * head_dim
    inter = spec["intermediate_size"]
    vocab = spec["vocab_size"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float32)

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = normal(q_dim, hidden)
        sd[p + "self_attn.k_proj.weight"] = normal(kv_dim, hidden)
        sd[p + "self_attn.v_proj.weight"] = normal(kv_dim, hidden)
        sd[p + "self_attn.o_proj.weight"] = normal(hidden, q_dim)
        if spec.get("model_type") == "qwen2":  # Qwen2's bias on q, k and v
            sd[p + "self_attn.q_proj.bias"] = normal(q_dim)
            sd[p + "self_attn.k_proj.bias"] = normal(kv_dim)
            sd[p + "self_attn.v_proj.bias"] = normal(kv_dim)
        sd[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        sd[p + "input_layernorm.weight"] = ones(hidden)
        sd[p + "post_attention_layernorm.weight"] = ones(hidden)
    sd["model.norm.weight"] = ones(hidden)
    sd["lm_head.weight"] = normal(vocab, hidden)
    return sd


def _write_checkpoint(spec: dict, out: Path, chat_template: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    config = {k: v for k, v in spec.items() if k != "model_type"}
    AutoConfig.for_model(spec["model_type"], **config).save_pretrained(out)
    GenerationConfig(
        bos_token_id=BOS_ID,
        eos_token_id=[EOS_ID, IM_END_ID],
        pad_token_id=PAD_ID,
    ).save_pretrained(out)
    save_builtin_tokenizer(str(out), chat_template)
    save_file(_random_state_dict(spec), str(out / "model.safetensors"), metadata={"format": "pt"})


def _cache_root(cache_dir: str | None) -> Path:
    root = cache_dir or os.environ.get("RAGKV_CACHE_DIR") or os.path.join("~", ".cache", "ragkv")
    return Path(root).expanduser()


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def builtin_model_path(name: str, cache_dir: str | None = None) -> str:
    """Materialise ``name`` once as a normal HF model directory and return its path.

    The directory is built in a sibling temp dir and renamed into place, so concurrent
    processes either win the rename or discard their copy and use the winner's.
    """
    full = _resolve_name(name)
    spec = BUILTIN_MODELS[full]
    template = _TEMPLATES.get(full, CHAT_TEMPLATE)
    parent = _cache_root(cache_dir) / "builtin"
    final = parent / f"{full.removeprefix(PREFIX)}-{_fingerprint(spec, template)}"
    if _is_complete(final):
        return str(final)

    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
    try:
        _write_checkpoint(spec, tmp, template)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared between users.
        try:
            os.replace(tmp, final)
        except OSError:
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)

"""What the engine needs to know about a checkpoint, read once from its config.json."""

from __future__ import annotations

from dataclasses import dataclass

from .layers import SUPPORTED_ACTIVATIONS, SUPPORTED_ROPE_TYPES

# HF architecture name -> family switches that differ from plain Llama.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True, "o_bias": False},
    "Qwen3ForCausalLM": {"qk_norm": True},
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # Smallest sliding window any layer uses (None: full attention everywhere).
    sliding_window: int | None = None

    @property
    def max_context_len(self) -> int:
        """Longest sequence the checkpoint is meant for. Linear and dynamic scaling stretch
        max_position_embeddings by their factor; YaRN stretches the original length."""
        rope_type = self.rope["rope_type"]
        factor = self.rope.get("factor") or 1.0
        if rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * factor)
        if rope_type == "yarn":
            original = self.rope.get("original_max_position_embeddings")
            return max(self.max_position_embeddings, int(original * factor))
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        archs = list(getattr(hf_config, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or getattr(hf_config, 'model_type', '?')}; "
                f"ragkv supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        rope = _rope_dict(hf_config)
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {SUPPORTED_ACTIVATIONS}")
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            rope=rope,
            hidden_act=act,
            qkv_bias=family.get("qkv_bias", attention_bias),
            o_bias=family.get("o_bias", attention_bias),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=family.get("qk_norm", False),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            sliding_window=_sliding_window(hf_config),
        )


def _rope_dict(hf_config) -> dict:
    """RoPE parameters in one dict whatever the transformers version wrote: newer configs keep
    them in `rope_parameters`, older ones in `rope_theta` + `rope_scaling`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type in ("llama3", "yarn"):
        original = getattr(hf_config, "original_max_position_embeddings", None)
        params.setdefault("original_max_position_embeddings",
                          original or hf_config.max_position_embeddings)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    return params


def _sliding_window(hf_config) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    if hasattr(hf_config, "use_sliding_window") and not hf_config.use_sliding_window:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)

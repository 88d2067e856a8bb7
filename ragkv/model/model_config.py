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
    # Gemma 3 (text): RMSNorm on q and k, norms around attention and MLP ("sandwich"), norm
    # weights stored as w and applied as 1 + w, the embedding scaled by sqrt(hidden), tied
    # embeddings, and sliding-window layers with their own RoPE base.
    "Gemma3ForCausalLM": {"qk_norm": True, "sandwich_norms": True, "norm_plus_one": True,
                          "embed_scale": True},
}
# The layer types of HF configs (`layer_types`) that ragkv runs.
FULL, SLIDING = "full_attention", "sliding_attention"


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
    # Per layer, its window (a query at position p sees keys at positions > p - window) or
    # None (full attention); empty: every layer `sliding_window`.
    layer_windows: tuple[int | None, ...] = ()
    # RoPE of the sliding-window layers where it differs from `rope` (Gemma 3: base 10k).
    local_rope: dict | None = None
    # Attention scale 1/sqrt(query_pre_attn_scalar) where set, else 1/sqrt(head_dim).
    query_pre_attn_scalar: float | None = None
    sandwich_norms: bool = False  # Gemma: norms after attention and MLP, before their adds
    norm_plus_one: bool = False  # Gemma: RMSNorm weights are w, applied as 1 + w
    embed_scale: float | None = None  # Gemma: embeddings multiplied by sqrt(hidden)
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def attention_kinds(self) -> tuple[tuple[tuple[int | None, dict], ...], tuple[int, ...]]:
        """The distinct (window, RoPE dict) of the layers, and each layer's index in them:
        one kind for most models, two for Gemma 3 (sliding with its RoPE, full)."""
        kinds: list[tuple[int | None, dict]] = []
        of_layer = []
        for i in range(self.num_layers):
            window = self.window(i)
            rope = self.local_rope if window is not None and self.local_rope else self.rope
            kind = (window, rope)
            if kind not in kinds:
                kinds.append(kind)
            of_layer.append(kinds.index(kind))
        return tuple(kinds), tuple(of_layer)

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
        softcap = getattr(hf_config, "attn_logit_softcapping", None)
        if softcap:
            raise ValueError(f"attention logit soft-capping ({softcap}) is not supported")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("bidirectional attention (use_bidirectional_attention) is not "
                             "supported")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        rope, local_rope = _rope_dicts(hf_config)
        act = (getattr(hf_config, "hidden_activation", None)
               or getattr(hf_config, "hidden_act", "silu"))
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {SUPPORTED_ACTIVATIONS}")
        window, layer_windows = _windows(hf_config)
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
            sliding_window=window,
            layer_windows=layer_windows,
            local_rope=local_rope if local_rope != rope else None,
            query_pre_attn_scalar=getattr(hf_config, "query_pre_attn_scalar", None),
            sandwich_norms=family.get("sandwich_norms", False),
            norm_plus_one=family.get("norm_plus_one", False),
            embed_scale=hf_config.hidden_size ** 0.5 if family.get("embed_scale") else None,
            final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None) or None,
        )


def _rope_dicts(hf_config) -> tuple[dict, dict | None]:
    """RoPE parameters of the full-attention layers and of the sliding ones (None: the
    same). Gemma 3 configs keep one dict per layer type in `rope_parameters`; older ones
    `rope_theta` + `rope_local_base_freq`."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if FULL in params or SLIDING in params:
        full = _rope_dict(hf_config, params.get(FULL) or {})
        local = params.get(SLIDING)
        return full, None if local is None else _rope_dict(hf_config, local)
    rope = _rope_dict(hf_config, params)
    local_base = getattr(hf_config, "rope_local_base_freq", None)
    if local_base is None:
        return rope, None
    return rope, {"rope_type": "default", "rope_theta": float(local_base)}


def _rope_dict(hf_config, params: dict) -> dict:
    """RoPE parameters in one dict whatever the transformers version wrote: newer configs keep
    them in `rope_parameters`, older ones in `rope_theta` + `rope_scaling`."""
    params = dict(params)
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict) and FULL not in scaling:
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


def _windows(hf_config) -> tuple[int | None, tuple[int | None, ...]]:
    """The smallest window and each layer's (empty: every layer the same)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None, ()
    if hasattr(hf_config, "use_sliding_window") and not hf_config.use_sliding_window:
        return None, ()
    window = int(window)
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types:
        return window, ()
    unknown = sorted(set(layer_types) - {FULL, SLIDING})
    if unknown or len(layer_types) != hf_config.num_hidden_layers:
        raise ValueError(f"unsupported layer_types {list(layer_types)}: ragkv runs "
                         f"{FULL!r} and {SLIDING!r}, one per layer")
    if SLIDING not in layer_types:
        return None, ()
    return window, tuple(window if t == SLIDING else None for t in layer_types)

"""One frozen engine configuration, passed down whole.

Everything the user chooses lives in `EngineConfig`; values that follow from it and from the
checkpoint (the resolved device and dtype, the number of KV slots) are computed by functions
here and returned, never patched into the config.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

# When neither kv_cache_tokens nor kv_cache_memory_bytes is given on CPU, the pool takes this
# much memory. torch.empty does not touch the pages, so an unused pool costs little.
DEFAULT_CPU_KV_BYTES = 2 << 30
# Hashes of chunk-cache keys (cache/chunk_key.py).
SUPPORTED_HASHES = ("sha256", "xxh3_128")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
# Largest HTTP request body the server accepts by default.
DEFAULT_MAX_BODY_BYTES = 8 << 20
# Fraction of free accelerator memory (after the weights are loaded) given to the pool.
DEFAULT_GPU_KV_FRACTION = 0.85
# RAG layouts (docs/rag.md): where chunks sit, and what a chunk's tokens attend to.
POSITION_STRATEGIES = ("shared", "sequential")
CHUNK_ATTENTIONS = ("isolated", "standalone")
# Selective recompute (recompute/): which chunk tokens of a sequential layout are recomputed
# with full attention. "sink+X" takes each chunk's first tokens, then X's best to the budget;
# "query+blend" scores by both scorers, each's scores a share of its total.
RECOMPUTE_METHODS = ("none", "blend", "sink", "query", "sink+blend", "sink+query",
                     "query+blend")
# Sink tokens per chunk in a combination ("sink+blend", "sink+query") when none are given:
# EPIC finds a handful at each chunk start enough to remove the false attention sinks.
DEFAULT_SINK_TOKENS = 4


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`; engine/speculative.py). Method
    "ngram" (prompt lookup): up to `num_speculative_tokens` drafts copied from where the
    request's last `prompt_lookup_max` .. `prompt_lookup_min` tokens occurred before in its
    prompt or output, verified in one forward pass. Off while `disable_by_batch_size` or more
    requests run (None: never off by batch size). `adaptive`: in a step of generated tokens
    only, drafts are verified only where the engine's measured step times and each request's
    kept share say they pay (engine/speculative.py); False verifies every draft found."""

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config method must be 'ngram' (prompt lookup), got "
                             f"{self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got "
                                 f"{value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config prompt_lookup_min must be at most "
                             "prompt_lookup_max")
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                                  or limit < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be a positive "
                             f"integer or None, got {limit!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got "
                             f"{self.adaptive!r}")

    @classmethod
    def of(cls, spec: object) -> SpeculativeConfig | None:
        """A SpeculativeConfig from itself, a dict of its fields (vLLM's form) or None."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict of settings, got "
                             f"{type(spec).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown setting {unknown[0]!r} (known: "
                             f"{', '.join(sorted(known))})")
        return cls(**spec)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """User-facing engine settings; names follow vLLM where vLLM has one."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    # vLLM's flag: "gguf" keeps a GGUF file's quantized weights packed (CPU: 4-bit planes and
    # int4 kernels; CUDA: int8 groups and Triton kernels), "none" dequantizes every weight at
    # load; None picks the faster one for the device and file (model/loader.py: use_packed).
    quantization: str | None = None
    device: str = "auto"
    # vLLM's flag: ranks (processes, one GPU each on CUDA) the model's heads and MLP split
    # across (model/parallel.py, model/executor.py).
    tensor_parallel_size: int = 1
    seed: int = 0
    kv_cache_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    # vLLM's sizing on a GPU: the share of the device's total memory this engine may hold
    # (weights, activations, KV); the KV pool takes what the loaded model leaves of it.
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    max_n: int = 128  # largest `n` (completions per prompt) a request may ask for
    # Chunk cache (docs/rag.md): chunk-isolated RAG prompts with reusable chunk KV.
    enable_chunk_cache: bool = True
    # A plain string prompt is split at this text into system, chunks and question only when
    # it is set (here, `--chunk-separator`, or a request's `chunk_separator`): None never
    # reinterprets a prompt (a markdown "## " header stays text).
    chunk_separator: str | None = None
    chunk_cache_tokens: int | None = None
    chunk_cache_fraction: float = 0.3
    max_chunk_tokens: int = 4096
    oversize_chunk: str = "error"
    chunk_hash_algo: str = "sha256"
    # Token ids of system parts and documents sent as text, kept by their text (MiB; 0: off):
    # a document is tokenized once, not on every request that retrieves it.
    tokenizer_cache_mb: int = 64
    # Tiers behind the chunk region, in order (cache/store/tiered.py), comma-separated:
    # "host:8GiB,disk:/var/cache/ragkv:50GiB,redis://127.0.0.1:6379/0"; None: pool only.
    chunk_store: str | None = None
    # Default layout of a RAG prompt; a request may choose another (RAGPrompt, extra_body).
    # shared: every chunk at positions right after S; sequential: one after another, as in
    # an ordinary prompt. isolated: a chunk sees S and itself; standalone: itself only.
    # None: the quality default, sequential with selective recompute (below); shared for a
    # model whose RoPE cannot turn cached keys to new positions (dynamic NTK).
    position_strategy: str | None = None
    chunk_attention: str = "isolated"
    # Selective recompute of chunk tokens (sequential positions only; a request may choose
    # its own): the method, the fraction r of chunk tokens recomputed, k sink tokens per
    # chunk (None: ceil(r * len) for `sink` alone, DEFAULT_SINK_TOKENS in combinations), and
    # the layers whose K/V deviation (`blend`) or question attention (`query`) scores tokens
    # (None: each scorer's own, recompute/policy.py: check_layers_for).
    # `recompute` None: with sequential positions the model's calibrated profile
    # (recompute/profile.py), else the measured model-agnostic setting there; with shared
    # positions "none". The other settings left None come from the same place, else default
    # to ratio 0.15, min ratio 0 and a fixed budget.
    recompute: str | None = None
    recompute_ratio: float | None = None
    recompute_sink_tokens: int | None = None
    recompute_check_layers: tuple[int, ...] | None = None
    # Adaptive budget (None: every request recomputes recompute_ratio of its chunk tokens):
    # the fewest top-scored tokens that hold this share of the probe's score mass, at least
    # recompute_min_ratio and at most recompute_ratio of the chunk tokens.
    recompute_score_mass: float | None = None
    recompute_min_ratio: float | None = None
    # Damping of stale chunk tokens (None: the profile's, else 0): the question and the
    # generated tokens read each chunk token whose cached KV is not a full prefill's (a
    # document after the first, not recomputed) with its attention logit lowered by this
    # much, its weight times exp(-damping). Computed without the documents before them,
    # those tokens draw more of the question's attention than under a full prefill
    # (docs/fidelity.md). Applies with a recompute method only.
    recompute_damping: float | None = None
    # Chunk primer (inputs/primer.py): with sequential positions and isolated chunks, every
    # document but the first has its KV computed after S and this fixed passage P instead of
    # after S alone, as a document that follows another one; nothing after the documents
    # reads P. "default": the built-in passage; "none": off; else the passage's text; None:
    # the calibrated profile's, else the model-agnostic default's (recompute/profile.py: the
    # built-in passage), where that default applies. A request may turn it off
    # (or on) with `chunk_primer`. P's KV is one chunk-cache entry per system prompt (each
    # request's own without a chunk cache).
    chunk_primer: str | None = None
    # Where the calibrated recompute profile comes from: "auto" (the model's, from the ragkv
    # cache directory or the package), a path, or None (no profile).
    recompute_profile: str | None = "auto"
    # Check the scheduler's invariants after every step (also on with RAGKV_DEBUG_CHECKS=1).
    debug_checks: bool = False
    # Attention kernels: "auto" is "triton" on CUDA when Triton imports, else "torch".
    attention_backend: str = "auto"
    # Run every step eagerly: no CUDA graphs for decode or short single-sequence extend steps
    # (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # On the CPU, run decode steps through one torch.compile'd graph (SGLang's
    # --enable-torch-compile; inductor, which needs a C++ compiler): compiled at start-up,
    # about a minute per batch kind on 2 cores (model/compiled_decode.py).
    enable_torch_compile: bool = False
    # Speculative decoding (SpeculativeConfig, or a dict of its settings; None: off).
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        # vLLM takes the settings as a dict: the one input converted here.
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.of(self.speculative_config))
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_logprobs", "max_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        cache_mb = self.tokenizer_cache_mb
        if not isinstance(cache_mb, int) or isinstance(cache_mb, bool) or cache_mb < 0:
            raise ValueError(f"tokenizer_cache_mb must be an integer >= 0 (0: off), got "
                             f"{cache_mb!r}")
        for name in ("kv_cache_tokens", "kv_cache_memory_bytes", "max_model_len",
                     "chunk_cache_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        sizes = [name for name in ("kv_cache_tokens", "kv_cache_memory_bytes",
                                   "gpu_memory_utilization") if getattr(self, name) is not None]
        if len(sizes) > 1:
            raise ValueError(f"give at most one of kv_cache_tokens, kv_cache_memory_bytes and "
                             f"gpu_memory_utilization (got {' and '.join(sizes)})")
        util = self.gpu_memory_utilization
        if util is not None and (isinstance(util, bool) or not isinstance(util, (int, float))
                                 or not 0.0 < util <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got "
                             f"{self.tensor_parallel_size!r}")
        if self.quantization not in (None, "gguf", "none"):
            raise ValueError(f"quantization must be 'gguf', 'none' or None (auto), got "
                             f"{self.quantization!r}")
        if not isinstance(self.max_chunk_tokens, int) or self.max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be a positive integer, got "
                             f"{self.max_chunk_tokens!r}")
        if not 0.0 < self.chunk_cache_fraction < 1.0:
            raise ValueError(f"chunk_cache_fraction must be in (0, 1), got "
                             f"{self.chunk_cache_fraction!r}")
        if self.oversize_chunk not in ("error", "split"):
            raise ValueError(f"oversize_chunk must be 'error' or 'split', got "
                             f"{self.oversize_chunk!r}")
        check_layout(self.position_strategy or "sequential", self.chunk_attention)
        check_recompute(self.recompute, self.recompute_ratio, self.recompute_sink_tokens,
                        allow_default=True)
        check_adaptive(self.recompute_score_mass, self.recompute_min_ratio, allow_default=True)
        check_damping(self.recompute_damping, allow_default=True)
        check_chunk_primer(self.chunk_primer)
        if self.recompute_profile is not None and not isinstance(self.recompute_profile, str):
            raise ValueError(f"recompute_profile must be 'auto', a path or None, got "
                             f"{self.recompute_profile!r}")
        if self.recompute not in (None, "none") and self.position_strategy == "shared":
            raise ValueError(f"recompute={self.recompute!r} recomputes chunk tokens in the "
                             "sequential layout: set position_strategy='sequential'")
        layers = self.recompute_check_layers
        if layers is not None and (
                not isinstance(layers, tuple) or not layers
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                           for x in layers)):
            raise ValueError("recompute_check_layers must be None (each method's default) or "
                             f"a non-empty tuple of layer indices >= 0, got {layers!r}")
        if self.chunk_hash_algo not in SUPPORTED_HASHES:
            raise ValueError(f"chunk_hash_algo must be one of {SUPPORTED_HASHES}, got "
                             f"{self.chunk_hash_algo!r}")
        parse_chunk_store(self.chunk_store)
        if self.chunk_store and not self.enable_chunk_cache:
            raise ValueError("chunk_store backs the chunk cache: it needs "
                             "enable_chunk_cache=True")
        check_separator(self.chunk_separator)
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got "
                             f"{self.attention_backend!r}")
        if self.enable_torch_compile and self.enforce_eager:
            raise ValueError("enable_torch_compile compiles the decode step and enforce_eager "
                             "runs every step eagerly: give one of them")
        if self.enable_torch_compile and self.tensor_parallel_size > 1:
            raise ValueError("enable_torch_compile is not built for tensor parallelism")
        if self.enable_torch_compile and self.device.startswith("cuda"):
            raise ValueError("enable_torch_compile compiles the CPU's decode step; on CUDA, "
                             "decode runs in CUDA graphs (the default)")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def check_separator(separator: object) -> None:
    """A chunk separator is a non-blank string or None (no splitting)."""
    if separator is not None and (not isinstance(separator, str) or not separator.strip()):
        raise ValueError("chunk_separator must be a non-blank string or None")


def check_layout(position_strategy: object, chunk_attention: object,
                 allow_default: bool = False) -> None:
    """A clear ValueError for a layout name that does not exist; with `allow_default`, None
    (the engine's default, in a prompt) is accepted too."""
    for name, value, choices in (("position_strategy", position_strategy, POSITION_STRATEGIES),
                                 ("chunk_attention", chunk_attention, CHUNK_ATTENTIONS)):
        if value not in choices and not (allow_default and value is None):
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def check_recompute(method: object, ratio: object, sink_tokens: object,
                    allow_default: bool = False) -> None:
    """A clear ValueError for a recompute setting that does not exist; with `allow_default`,
    None (the engine's default, in a prompt) is accepted for each."""
    if method not in RECOMPUTE_METHODS and not (allow_default and method is None):
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_METHODS)}, got "
                         f"{method!r}")
    if not (allow_default and ratio is None):
        _check_fraction("recompute_ratio", ratio)
    if sink_tokens is not None and (isinstance(sink_tokens, bool)
                                    or not isinstance(sink_tokens, int) or sink_tokens < 0):
        raise ValueError(f"recompute_sink_tokens must be an integer >= 0 or None, got "
                         f"{sink_tokens!r}")


def check_adaptive(score_mass: object, min_ratio: object, allow_default: bool = False) -> None:
    """A clear ValueError for an adaptive recompute budget that does not exist; with
    `allow_default`, a min_ratio of None (the engine's default, in a prompt) is accepted."""
    if score_mass is not None and (isinstance(score_mass, bool)
                                   or not isinstance(score_mass, (int, float))
                                   or not 0.0 < score_mass <= 1.0):
        raise ValueError(f"recompute_score_mass must be a number in (0, 1] or None, got "
                         f"{score_mass!r}")
    if not (allow_default and min_ratio is None):
        _check_fraction("recompute_min_ratio", min_ratio)


# The largest damping accepted: exp(-20) is below float32's resolution next to any weight.
MAX_DAMPING = 20.0


def check_chunk_primer(value: object) -> None:
    """`chunk_primer`: None (unset), "none" (off), "default" (the built-in passage) or the
    text."""
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"chunk_primer must be 'default', 'none', a non-empty text or None, "
                         f"got {value!r}")


def check_damping(damping: object, allow_default: bool = False) -> None:
    """A clear ValueError for a recompute damping that does not exist; with `allow_default`,
    None (the engine's default) is accepted."""
    if allow_default and damping is None:
        return
    if (isinstance(damping, bool) or not isinstance(damping, (int, float))
            or not 0.0 <= damping <= MAX_DAMPING):
        raise ValueError(f"recompute_damping must be a number in [0, {MAX_DAMPING:g}], got "
                         f"{damping!r}")


def _check_fraction(name: str, value: object) -> None:
    """`value` must be a number (not a bool) in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def resolve_device(config: EngineConfig) -> torch.device:
    """`auto` is CUDA when present, else CPU; the environment variable RAGKV_DEVICE replaces
    `auto` (the test suite sets it to `cpu` so that only GPU tests touch a GPU)."""
    name = config.device
    if name == "auto":
        name = os.environ.get("RAGKV_DEVICE", "auto") or "auto"
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available on this machine")
    return device


def resolve_dtype(config: EngineConfig, device: torch.device,
                  checkpoint_dtype: object) -> torch.dtype:
    """`auto` is float32 on CPU (fast and exact there) and the checkpoint's dtype elsewhere
    (`checkpoint_dtype`: what its config names, parse_torch_dtype)."""
    checkpoint_dtype = parse_torch_dtype(checkpoint_dtype)
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype in (torch.bfloat16, torch.float16):
        return checkpoint_dtype
    return torch.bfloat16


def parse_torch_dtype(name: object) -> torch.dtype | None:
    """The dtype a checkpoint's config.json names (`torch_dtype` or `dtype`), if any."""
    if isinstance(name, torch.dtype):
        return name
    if isinstance(name, str):
        return _DTYPES.get(name.removeprefix("torch."))
    return None


def parse_size(text: str) -> int:
    """Bytes in "8GiB", "500MB", "1048576"."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"chunk_store: {text!r} is not a size (e.g. 8GiB, 500MB, 1048576)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"chunk_store: size {text!r} must be positive")
    return size


def parse_chunk_store(spec: str | None) -> list[tuple[str, tuple]]:
    """The tiers a `chunk_store` setting names, in order, as (kind, arguments): ("host",
    (bytes,)), ("disk", (path, bytes)), ("redis", (url,)); a clear ValueError for one that
    does not parse (no I/O: the store is built from this, cache/store/tiered.py)."""
    if spec is None:
        return []
    if not isinstance(spec, str):
        raise ValueError(f"chunk_store must be a string, got {spec!r}")
    if not spec.strip():
        return []
    out: list[tuple[str, tuple]] = []
    for part in (p.strip() for p in spec.split(",")):
        if part.startswith(("redis://", "rediss://", "unix://")):
            out.append(("redis", (part,)))
        elif part.startswith("host:"):
            out.append(("host", (parse_size(part[5:]),)))
        elif part.startswith("disk:"):
            path, sep, size = part[5:].rpartition(":")
            if not sep or not path:
                raise ValueError(f"chunk_store: {part!r} must be disk:PATH:SIZE "
                                 "(e.g. disk:/var/cache/ragkv:50GiB)")
            out.append(("disk", (path, parse_size(size))))
        else:
            raise ValueError(f"chunk_store: unknown tier {part!r}; tiers are host:SIZE, "
                             "disk:PATH:SIZE and redis://HOST:PORT/DB, comma-separated")
    kinds = [k for k, _ in out]
    if kinds.count("host") > 1:
        raise ValueError("chunk_store: at most one host tier")
    return out

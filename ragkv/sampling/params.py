"""Sampling parameters: vLLM's names and defaults, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..structured.params import StructuredOutputsParams

# Below this temperature sampling is greedy, as in vLLM.
_GREEDY_EPS = 1e-5
# Most logit_bias entries a request may give (OpenAI's limit); each costs host work per step.
MAX_LOGIT_BIAS = 300
# repetition_penalty range: beyond it a float32 logit divided or multiplied by the penalty can
# reach 0 or infinity (NaN after softmax); useful values are near 1.
REPETITION_PENALTY_RANGE = (1e-3, 1e3)


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings. Validated on construction; errors name the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's: each prompt token's log-probability given the tokens before it, with the k most
    # likely tokens there (RequestOutput.prompt_logprobs). In a RAG prompt, the question's
    # tokens after its first (the chunks' KV comes from the cache, without logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's (and OpenAI's) penalties, applied to the logits before any sampling, greedy
    # included: presence subtracts once per token already generated, frequency once per
    # occurrence, repetition divides positive logits (multiplies negative ones) of every token
    # in the prompt or the output. logit_bias adds to the given token ids' logits first.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # vLLM's: no stop token can be sampled, and no stop token or string ends the sample,
    # before this many tokens.
    min_tokens: int = 0
    # vLLM's: the output must be JSON following a schema, any JSON object, or one of a list
    # of strings; each step may only sample tokens that keep it so (structured/token_grammar.py).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, minimum=-1, hint="0 or -1 (disabled) or at least 1")
        if self.top_k == -1:
            self.top_k = 0
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        _check_int("seed", self.seed, optional=True)
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:
            raise ValueError(f"seed must be a 64-bit integer (from -2**63 to 2**64 - 1), got "
                             f"{self.seed!r}")
        # 0: no token is generated, the prompt only scored (prompt_logprobs; echo).
        _check_int("max_tokens", self.max_tokens, minimum=0, optional=True)
        _check_int("logprobs", self.logprobs, minimum=0, optional=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0, optional=True)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s
                                                      for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list, got {self.stop_token_ids!r}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids entry", token, minimum=0)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens="
                             f"{self.max_tokens}")
        low, high = REPETITION_PENALTY_RANGE
        if not _is_number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be a number in [{low:g}, {high:g}] "
                             f"(1: none), got {self.repetition_penalty!r}")
        if self.structured_outputs is not None and self.max_tokens == 0:
            raise ValueError("max_tokens=0 generates nothing for structured_outputs to "
                             "constrain")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id to bias, got "
                                 f"{self.logit_bias!r}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most "
                                 f"{MAX_LOGIT_BIAS}")
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias token id", token, minimum=0)
                if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias of token {token} must be a number in "
                                     f"[-100, 100], got {bias!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def counts_tokens(self) -> bool:
        """Whether a penalty reads the generated tokens (presence, frequency, repetition)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def changes_logits(self) -> bool:
        """Whether every step's logits are changed before sampling (penalties, bias)."""
        return self.counts_tokens or bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler needs the row's TokenHistory (penalties, logit_bias,
        min_tokens or structured outputs)."""
        return (self.changes_logits or bool(self.min_tokens)
                or self.structured_outputs is not None)

    def clone(self, **changes) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__slots__}
        values.update(changes)
        return SamplingParams(**values)


def _is_number(value: object) -> bool:
    """A real, finite number (NaN and infinities would poison the logits)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _check_int(name: str, value: object, minimum: int | None = None, optional: bool = False,
               hint: str | None = None) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or (
            minimum is not None and value < minimum):
        what = hint or ("an integer" if minimum is None else f"an integer >= {minimum}")
        raise ValueError(f"{name} must be {what}{' or None' if optional else ''}, got {value!r}")

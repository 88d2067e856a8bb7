"""Sampling parameters (vLLM's names and defaults) and the batched sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Below this temperature sampling is greedy, as in vLLM.
_GREEDY_EPS = 1e-5


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
    skip_special_tokens: bool = True

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
        _check_int("max_tokens", self.max_tokens, minimum=1, optional=True)
        _check_int("logprobs", self.logprobs, minimum=0, optional=True)
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

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


@dataclass(slots=True)
class SampleResult:
    """What the sampler returns for one batch: plain lists, one entry per sampled row."""

    token_ids: list[int]
    # Raw-model logprob of each sampled token (None for rows that did not ask for logprobs).
    token_logprobs: list[float | None]
    # For rows that asked: (top ids, top logprobs, rank of the sampled token).
    top_logprobs: list[tuple[list[int], list[float], int] | None] = field(default_factory=list)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> SampleResult:
    """Sample one token per row of `logits` [B, V] (float32).

    Each row draws from its own `torch.Generator`, so a seeded request gives the same tokens
    whatever else is in the batch. Logprobs are of the raw model distribution (vLLM's default).
    """
    logits = logits.float()
    batch = logits.shape[0]
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        chosen = _sample_rows(logits[rows], [params[i] for i in random_rows],
                              [generators[i] for i in random_rows])
        token_ids[rows] = chosen
    token_list = token_ids.tolist()

    token_logprobs: list[float | None] = [None] * batch
    top_logprobs: list[tuple[list[int], list[float], int] | None] = [None] * batch
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        rows = torch.tensor(want, device=logits.device)
        logp = torch.log_softmax(logits[rows], dim=-1)
        picked = token_ids[rows]
        picked_logp = logp.gather(1, picked[:, None])[:, 0]
        ranks = (logp > picked_logp[:, None]).sum(dim=-1) + 1
        k_max = max(params[i].logprobs for i in want)
        top_vals, top_ids = logp.topk(k_max, dim=-1)
        picked_logp_l, ranks_l = picked_logp.tolist(), ranks.tolist()
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(want):
            k = params[i].logprobs
            token_logprobs[i] = picked_logp_l[j]
            top_logprobs[i] = (top_ids_l[j][:k], top_vals_l[j][:k], ranks_l[j])
    return SampleResult(token_list, token_logprobs, top_logprobs)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator]) -> torch.Tensor:
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temps[:, None]
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in top_k):
        k_tensor = torch.tensor(top_k, device=device)
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k_tensor - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)
    if bool((top_p < 1.0).any()):
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p: drop a token when the mass strictly
        # before it already reaches top_p. The top token is always kept.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, sorted_idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=probs.dtype)
    if bool((min_p > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    chosen = torch.empty(len(params), dtype=torch.long, device=device)
    for i, gen in enumerate(generators):
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p exactly.
        noise = torch.empty(vocab, device=device, dtype=probs.dtype).exponential_(generator=gen)
        chosen[i] = (probs[i] / noise).argmax()
    return chosen

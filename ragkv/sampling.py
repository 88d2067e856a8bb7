"""Sampling parameters (vLLM's names and defaults) and the batched sampler."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .host_ints import int64_tensor, to_device
from .structured_output import StructuredOutputsParams

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
    # of strings; each step may only sample tokens that keep it so (structured_output.py).
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


@dataclass(slots=True)
class SampleResult:
    """What the sampler returns for one batch: plain lists, one entry per sampled row."""

    token_ids: list[int]
    # Raw-model logprob of each sampled token (None for rows that did not ask for logprobs).
    token_logprobs: list[float | None]
    # For rows that asked: (top ids, top logprobs, rank of the sampled token).
    top_logprobs: list[tuple[list[int], list[float], int] | None] = field(default_factory=list)


# Counter-based random numbers. A row's draws come from a hash of (its sequence's 64-bit seed,
# how many tokens the sequence has sampled, the vocabulary index), not from a generator with
# state: every row of a batch is drawn by the same few tensor operations, without a loop over
# rows or a device generator per request, and a seeded sequence gives the same tokens
# whatever else is in the batch and whatever the engine did before, and the same draws on any
# device (integer arithmetic is exact everywhere). The hash is Wellons' lowbias32, twice.
_MASK32 = 0xFFFFFFFF
_LOWBIAS = (0x7FEB352D, 0x846CA68B)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of each element of x (int64 holding values in [0, 2^32)), in place. A
    product of two 32-bit values may pass 2^63 and wrap in int64; its low 32 bits, all that
    is kept, are exact either way (the Triton kernel splits the constant instead; the tests
    check the two agree bit for bit)."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_LOWBIAS[0]).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_LOWBIAS[1]).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def noise_keys(seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from its seed (64 bits, as int64) and step. Rows whose first keys
    differ also differ in the second (a bijection of the first), so no two rows' draws are a
    permutation of each other's."""
    high = (seeds >> 32) & _MASK32  # the shift is arithmetic: keep the 32 bits, not the sign
    k1 = _mix32_(_mix32_(_mix32_(steps & _MASK32).bitwise_xor_(high)).bitwise_xor_(
        seeds & _MASK32))
    return k1, _mix32_(k1 ^ 0x9E3779B9)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 uniform in (0, 1): row b's draws for step `steps[b]` of the
    sequence seeded `seeds[b]` (int64 tensors; a seed is any 64-bit pattern). On CUDA one
    Triton kernel computes the same bits (triton_ops.uniform_noise)."""
    k1, k2 = noise_keys(seeds, steps)
    if seeds.is_cuda:
        from .model import triton_ops

        if triton_ops.available():
            return triton_ops.uniform_noise(k1, k2, vocab)
    index = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    # In place after the first op: these passes over [B, vocab] are the sampler's main cost
    # on a CPU, and fresh tensors for each would double it.
    x = _mix32_(index[None, :] ^ k1[:, None]).bitwise_xor_(k2[:, None])
    return to_uniform_(_mix32_(x))


def to_uniform_(x: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64) to float32 uniforms in (0, 1): the top 23 bits, centred in
    their interval, so every value is exact in float32 and strictly between 0 and 1 (with 24
    bits the largest, 2^24 - 0.5, rounds to 2^24: u = 1, an exponential of 0 that made a
    token of probability 0 win the race as NaN)."""
    return x.bitwise_right_shift_(9).float().add_(0.5).mul_(1.0 / (1 << 23))


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`, without waiting for the step's forward
    (host_ints.to_device), so the host queues the sampler's kernels behind it."""
    return to_device(torch.tensor(values, dtype=dtype), device)


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """What a row's penalties read: how often its sequence has generated each token (the
    engine keeps the counts as tokens are appended), its prompt's token ids on the logits'
    device (None unless it asks for a repetition penalty; repeats are harmless), the
    tokens it may not sample now (its stop tokens, before min_tokens), and with structured
    outputs the only tokens it may sample: a host bool mask (ids past its end are refused)
    plus `also_allowed` ids (its stop tokens where the output may end)."""

    counts: Mapping[int, int]
    prompt: torch.Tensor | None = None
    banned: Sequence[int] = ()
    allowed: torch.Tensor | None = None
    also_allowed: Sequence[int] = ()


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    history: list[TokenHistory | None] | None) -> torch.Tensor:
    """`logits` [B, V] (float32) after each row's logit_bias, then its repetition, frequency
    and presence penalties, in vLLM's order and with its formulas, and its banned tokens at
    -inf (min_tokens); rows that ask for none are unchanged. A new tensor when any row asks
    (the raw logits stay for logprobs). A row without a history has generated nothing; a
    repetition penalty needs its prompt.

    Every penalty touches only the tokens a row has seen, so each is a gather or scatter at
    (row, token) pairs, not a pass over [B, V]: the generated tokens' pairs and counts are
    built on the host (one transfer with the rest), the prompts are already on the device,
    and nothing waits for the device."""
    history = history or [None] * len(params)
    # A min_tokens row past its minimum has nothing to ban: it costs nothing here.
    rows = [i for i, p in enumerate(params) if p.changes_logits
            or (history[i] is not None and (history[i].banned
                                            or history[i].allowed is not None))]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    bias = [(i, t, b) for i in rows for t, b in (params[i].logit_bias or {}).items()]
    # Each row's distinct generated tokens and how often each occurs.
    seen_rows_host: list[int] = []
    seen_ids_host: list[int] = []
    seen_counts_host: list[int] = []
    repeat_seen: list[int] = []  # which of those pairs are in rows with a repetition penalty
    for i in rows:
        counts = history[i].counts if history[i] is not None else {}
        if params[i].repetition_penalty != 1.0:
            repeat_seen += range(len(seen_ids_host), len(seen_ids_host) + len(counts))
        seen_rows_host += [i] * len(counts)
        seen_ids_host += counts.keys()
        seen_counts_host += counts.values()
    repeat = [i for i in rows if params[i].repetition_penalty != 1.0]
    if any(history[i] is None or history[i].prompt is None for i in repeat):
        raise ValueError("a row with a repetition penalty needs its prompt's token ids")
    prompts = [history[i].prompt for i in repeat]
    # Ids past the logits (a checkpoint's EOS beyond its LM head) cannot be sampled anyway.
    banned = [i * vocab + t for i in rows if history[i] is not None
              for t in history[i].banned if t < vocab]
    masked = [i for i in rows if history[i] is not None and history[i].allowed is not None]
    # Ints in one transfer, floats in another (and the masks' bools in a third).
    ints = int64_tensor([i for i, _, _ in bias] + [t for _, t, _ in bias] + seen_rows_host
                        + seen_ids_host + repeat + [ids.numel() for ids in prompts]
                        + repeat_seen + banned + masked)
    ints = to_device(ints, device)
    floats = _to_device([b for _, _, b in bias] + seen_counts_host
                        + [p.repetition_penalty for p in params]
                        + [p.frequency_penalty for p in params]
                        + [p.presence_penalty for p in params], torch.float32, device)
    nb, ns, nr, batch = len(bias), len(seen_ids_host), len(repeat), len(params)
    bias_rows, bias_ids, seen_rows, seen_ids, rep_rows, rep_lens, rep_seen, ban, mask_rows = (
        ints.split([nb, nb, ns, ns, nr, nr, len(repeat_seen), len(banned), len(masked)]))
    bias_values, seen_counts, repetition, frequency, presence = floats.split(
        [nb, ns, batch, batch, batch])
    out = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    flat = out.view(-1)  # (row, token) pairs as flat indices: 1-D gathers are the cheap kind
    if bias:
        flat.index_add_(0, bias_rows * vocab + bias_ids, bias_values)
    seen_flat = seen_rows * vocab + seen_ids
    if repeat:
        # The prompts' tokens and the generated ones. A token listed twice gets the same
        # value written twice: both are computed from the logit before the penalty.
        prompt_ids = torch.cat(prompts)
        # output_size: the count is known here, so the device is not asked for it (a sync).
        prompt_rows = torch.repeat_interleave(rep_rows, rep_lens, output_size=prompt_ids.numel())
        pairs = torch.cat([prompt_rows * vocab + prompt_ids, seen_flat[rep_seen]])
        values = flat[pairs]
        factor = repetition[torch.cat([prompt_rows, seen_rows[rep_seen]])]
        # HF's and vLLM's rule: a positive logit is divided, a negative one multiplied.
        flat[pairs] = torch.where(values > 0, values / factor, values * factor)
    if ns:
        flat.index_add_(0, seen_flat, -(frequency[seen_rows] * seen_counts + presence[seen_rows]))
    if banned:
        flat.index_fill_(0, ban, float("-inf"))
    if masked:
        _mask_rows(out, mask_rows, [history[i] for i in masked])
    return out


def _mask_rows(logits: torch.Tensor, rows: torch.Tensor, history: list[TokenHistory]) -> None:
    """Every token outside its row's allowed set to -inf (structured outputs), in place:
    `rows` (on the logits' device) are the rows of `history`, whose masks are stacked on the
    host and sent in one transfer."""
    vocab = logits.shape[1]
    allow = torch.zeros(len(history), vocab, dtype=torch.bool)
    for j, h in enumerate(history):
        n = min(vocab, h.allowed.numel())
        allow[j, :n] = h.allowed[:n]
        extra = [t for t in h.also_allowed if t < vocab]
        if extra:
            allow[j, extra] = True
    allow = to_device(allow, logits.device)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allow,
                                                                         float("-inf")))


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           steps: list[int], history: list[TokenHistory | None] | None = None
           ) -> SampleResult:
    """Sample one token per row of `logits` [B, V] (float32).

    Row i draws from the counter-based stream of `seeds[i]` at position `steps[i]` (how many
    tokens its sequence has sampled so far). Rows whose params have penalties, a logit bias or
    min_tokens read `history[i]` (apply_penalties: its counts, prompt and banned stop tokens),
    greedy rows included. Logprobs are of the raw model distribution (vLLM's default).
    Everything stays on the logits' device until one transfer at the end.
    """
    raw = logits = logits.float()
    logits = apply_penalties(logits, params, history)
    batch = logits.shape[0]
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if len(random_rows) == batch:
        token_ids = _sample_rows(logits, params, seeds, steps)
    elif random_rows:
        rows = _to_device(random_rows, torch.int64, logits.device)
        token_ids[rows] = _sample_rows(logits[rows], [params[i] for i in random_rows],
                                       [seeds[i] for i in random_rows],
                                       [steps[i] for i in random_rows])
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return SampleResult(token_ids.tolist(), [None] * batch, [None] * batch)
    # Logprobs: the sampled token's, its rank and the top k, packed with the token ids into
    # one float64 tensor (ids and ranks are exact there) for a single transfer.
    rows = _to_device(want, torch.int64, logits.device)
    logp = torch.log_softmax(raw[rows], dim=-1)
    picked = token_ids[rows]
    picked_logp = logp.gather(1, picked[:, None])
    ranks = (logp > picked_logp).sum(dim=-1, keepdim=True) + 1
    k_max = max(params[i].logprobs for i in want)
    top_vals, top_ids = logp.topk(k_max, dim=-1)
    packed = torch.cat([picked_logp.double(), ranks.double(), top_ids.double(),
                        top_vals.double()], dim=1)
    host = torch.cat([token_ids.double(), packed.flatten()]).tolist()
    token_list = [int(t) for t in host[:batch]]
    width = 2 + 2 * k_max
    token_logprobs: list[float | None] = [None] * batch
    top_logprobs: list[tuple[list[int], list[float], int] | None] = [None] * batch
    for j, i in enumerate(want):
        row = host[batch + j * width:batch + (j + 1) * width]
        k = params[i].logprobs
        token_logprobs[i] = row[0]
        top_logprobs[i] = ([int(t) for t in row[2:2 + k]], row[2 + k_max:2 + k_max + k],
                           int(row[1]))
    return SampleResult(token_list, token_logprobs, top_logprobs)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 steps: list[int]) -> torch.Tensor:
    """Token ids drawn for each row of `logits` after temperature, top-k, top-p and min-p.
    Which truncations run is decided from the parameters on the host: no device sync."""
    device = logits.device
    vocab = logits.shape[-1]
    # One host-to-device transfer for the per-row settings.
    settings = _to_device([[p.temperature for p in params], [p.top_p for p in params],
                           [p.min_p for p in params]], torch.float32, device)
    temps, top_p, min_p = settings[0], settings[1], settings[2]
    logits = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        k_max = max(top_k)
        k_tensor = _to_device(top_k, torch.int64, device)
        # The k-th largest of each row; topk of the largest k asked is cheaper than a sort.
        best = logits.topk(k_max, dim=-1).values
        kth = best.gather(1, (k_tensor - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if any(p.top_p < 1.0 for p in params):
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p: drop a token when the mass strictly
        # before it already reaches top_p. The top token is always kept.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, sorted_idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if any(p.min_p > 0 for p in params):
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    keys = _to_device([seeds, steps], torch.int64, device)
    # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p exactly (no
    # renormalisation needed: it does not change the argmax).
    exponential = uniform_noise(keys[0], keys[1], vocab).log_().neg_()
    return probs.div_(exponential).argmax(dim=-1)

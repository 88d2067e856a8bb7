"""The batched sampler: penalties, then greedy or truncated random sampling per row, and the
raw model's logprobs, in one transfer back to the host."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..host_ints import list_to_device
from .noise import uniform_noise
from .params import SamplingParams
from .penalties import TokenHistory, apply_penalties


@dataclass(slots=True)
class SampleResult:
    """What the sampler returns for one batch: plain lists, one entry per sampled row."""

    token_ids: list[int]
    # Raw-model logprob of each sampled token (None for rows that did not ask for logprobs).
    token_logprobs: list[float | None]
    # For rows that asked: (top ids, top logprobs, rank of the sampled token).
    top_logprobs: list[tuple[list[int], list[float], int] | None] = field(default_factory=list)


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
        rows = list_to_device(random_rows, torch.int64, logits.device)
        token_ids[rows] = _sample_rows(logits[rows], [params[i] for i in random_rows],
                                       [seeds[i] for i in random_rows],
                                       [steps[i] for i in random_rows])
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return SampleResult(token_ids.tolist(), [None] * batch, [None] * batch)
    # Logprobs: the sampled token's, its rank and the top k, packed with the token ids into
    # one float64 tensor (ids and ranks are exact there) for a single transfer.
    rows = list_to_device(want, torch.int64, logits.device)
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
    settings = list_to_device([[p.temperature for p in params], [p.top_p for p in params],
                           [p.min_p for p in params]], torch.float32, device)
    temps, top_p, min_p = settings[0], settings[1], settings[2]
    logits = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        k_max = max(top_k)
        k_tensor = list_to_device(top_k, torch.int64, device)
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
    keys = list_to_device([seeds, steps], torch.int64, device)
    # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p exactly (no
    # renormalisation needed: it does not change the argmax).
    exponential = uniform_noise(keys[0], keys[1], vocab).log_().neg_()
    return probs.div_(exponential).argmax(dim=-1)

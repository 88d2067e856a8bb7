"""Selective recompute (DESIGN §1): which chunk tokens of a sequential-layout request are
computed afresh, attending to everything before them as in an ordinary prefill.

A request reuses its chunks' cached KV re-positioned (the sequential layout), then recomputes a
set R of chunk tokens at every layer: each token of R is a query at its place in the prompt
whose KV list is everything before it (S, earlier chunks, its own chunk so far, with the fresh
K/V of the tokens of R before it), and its fresh K/V go into the request's own slots, replacing
the cached ones in the request's KV list only. The cached entry is never written, so it stays
one copy shared by every request. |R| = 0 is the sequential layout itself; R = every chunk
token is an ordinary full prefill.

R is chosen once per request, after the chunks' KV is ready and before the question is computed:
- `sink` (EPIC's LegoLink): the first tokens of every chunk, where an isolated chunk puts the
  false attention sink its own start became;
- `blend` (CacheBlend): the tokens whose K/V at the check layers deviate most from the cached
  K/V, probing the chunk tokens through the first layers over the cached KV (layer 0's
  attention then is exactly the full prefill's: layer-0 K/V depend on the token alone);
- `query` (ProphetKV, A^3 style): the chunk tokens the question attends to most at the check
  layers, probing the question through the first layers over the cached KV;
- `sink+blend`, `sink+query`: the sink tokens first, the scorer's best for the rest.
The probes (model/probe.py) run batched per request; this module turns their scores (one per
chunk token) into R, and takes the sink tokens and the budget from the layout alone. A choice
that needs no probe is made by the scheduler as soon as the request reaches its question; one
that does, right after the forward of the step that completes the request's chunks.
Each of a request's n samples chooses (and recomputes) on its own: the choice is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import DEFAULT_SINK_TOKENS
from .request import PromptLayout

# Check layers of `query` when none are configured, as fractions of the model's depth. Its
# probe runs only the question's tokens, so deeper layers cost almost nothing, and there the
# question's attention points at the evidence rather than at positions: on SmolLM2-135M
# (docs/fidelity.md) layers 4, 8 and 12 of 30 close 90% of the gold-likelihood gap at
# r = 0.15, layer 1 41%. `blend` keeps CacheBlend's layer 1: its probe runs every chunk token
# through the layers up to the last check layer, so each deeper layer costs a prefill's share.
QUERY_CHECK_DEPTHS = (0.13, 0.27, 0.4)
BLEND_CHECK_LAYER = 1


def check_layers_for(method: str, configured: tuple[int, ...] | None,
                     num_layers: int) -> tuple[int, ...]:
    """The check layers a recompute method probes: the configured ones, else its scorer's
    default on a model of `num_layers` layers."""
    if configured is not None:
        return configured
    if method.endswith("query"):
        return tuple(sorted({min(num_layers - 1, round(f * num_layers))
                             for f in QUERY_CHECK_DEPTHS}))
    return (BLEND_CHECK_LAYER,)  # a one-layer model has no deviation to score


@dataclass(frozen=True, slots=True)
class RecomputeSpec:
    """One request's selective recompute: `method` (config.RECOMPUTE_METHODS, not "none"), the
    fraction `ratio` of chunk tokens recomputed, `sink_tokens` per chunk (None: ceil(ratio *
    len) for `sink` alone, DEFAULT_SINK_TOKENS in a combination) and the probe's check layers."""

    method: str
    ratio: float
    sink_tokens: int | None
    check_layers: tuple[int, ...]

    @property
    def scorer(self) -> str | None:
        """"blend" or "query" when the model scores tokens, else None."""
        last = self.method.rsplit("+", 1)[-1]
        return None if last == "sink" else last

    @property
    def probe_layers(self) -> int:
        """Layers the probe runs through."""
        return max(self.check_layers) + 1

    def budget(self, num_chunk_tokens: int) -> int:
        """Tokens recomputed in all: ceil(ratio * n) (the epsilon keeps 0.15 * 100 at 15)."""
        return min(num_chunk_tokens, math.ceil(self.ratio * num_chunk_tokens - 1e-9))

    def sink(self, layout: PromptLayout) -> list[int]:
        """Flat indices of the sink tokens, for the methods that take them."""
        if not self.method.startswith("sink"):
            return []
        if self.method == "sink":
            def count(n: int) -> int:  # alone, the ratio of each chunk unless k is given
                return self.budget(n) if self.sink_tokens is None else min(n, self.sink_tokens)

            return [x for a, b in layout.chunk_bounds for x in range(a, a + count(b - a))]
        k = DEFAULT_SINK_TOKENS if self.sink_tokens is None else self.sink_tokens
        # Within the budget, every chunk's first token before any chunk's second one.
        ranked = sorted((x - a, x) for a, b in layout.chunk_bounds
                        for x in range(a, min(b, a + k)))
        budget = self.budget(layout.question_start - layout.system_len)
        return sorted(x for _, x in ranked[:budget])

    def needs_probe(self, layout: PromptLayout) -> bool:
        """Whether choosing R needs the model (a scorer with budget left after the sinks)."""
        total = layout.question_start - layout.system_len
        return self.scorer is not None and self.budget(total) > len(self.sink(layout))

    def select(self, layout: PromptLayout, scores: torch.Tensor | None) -> tuple[int, ...]:
        """R as ascending flat indices. `scores`: one float per chunk token in flat order
        (higher: recompute first), from the probe when `needs_probe`. Ties go to the earlier
        token, so the choice is a function of the prompt and the cached KV alone."""
        chosen = self.sink(layout)
        s = layout.system_len
        total = layout.question_start - s
        rest = self.budget(total) - len(chosen) if self.scorer else 0
        if rest > 0:
            if scores is None or scores.numel() != total:
                raise ValueError(f"recompute={self.method!r} needs one score per chunk token "
                                 f"({total})")
            scores = scores.detach().double().cpu().clone()
            if chosen:
                scores[torch.tensor(chosen) - s] = -math.inf
            order = torch.sort(scores, descending=True, stable=True).indices[:rest]
            chosen = chosen + (order + s).tolist()
        return tuple(sorted(chosen))

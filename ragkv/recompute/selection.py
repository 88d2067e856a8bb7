"""Where recompute tokens are chosen: a request's `RecomputeSpec` and the set R it gives from
the layout (sink tokens, the budget) and the probe's scores (recompute/probe.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import DEFAULT_SINK_TOKENS
from ..inputs.layout import PromptLayout


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

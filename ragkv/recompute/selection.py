"""Where recompute tokens are chosen: a request's `RecomputeSpec` and the set R it gives from
the layout (sink tokens, the budget) and the probe's scores (recompute/probe.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import DEFAULT_SINK_TOKENS
from ..inputs.layout import PromptLayout

# CacheBlend's check layer: the first whose K/V deviation shows attention across chunks.
BLEND_CHECK_LAYER = 1


@dataclass(frozen=True, slots=True)
class RecomputeSpec:
    """One request's selective recompute: `method` (config.RECOMPUTE_METHODS, not "none"), the
    fraction `ratio` of chunk tokens recomputed (the most, with an adaptive budget),
    `sink_tokens` per chunk (None: ceil(ratio * len) for `sink` alone, DEFAULT_SINK_TOKENS in a
    combination) and the probe's check layers."""

    method: str
    ratio: float
    sink_tokens: int | None
    check_layers: tuple[int, ...]
    # Adaptive budget: the fewest tokens (sinks included) holding this share of the scores'
    # mass, within [min_ratio, ratio] of the chunk tokens; None: always `ratio`. Sink alone
    # has no scores, so its budget is always `ratio`.
    score_mass: float | None = None
    min_ratio: float = 0.0
    # Logit offset the question and generated tokens subtract from the stale tokens
    # (`stale`); 0: none.
    damping: float = 0.0

    @property
    def scorers(self) -> tuple[str, ...]:
        """The scorers ("blend", "query") whose probes rank the tokens; () for sink alone."""
        return method_scorers(self.method)

    @property
    def probes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(scorer, check layers) of each probe the method runs."""
        return probe_plan(self.method, self.check_layers)

    def combine(self, scores: list[torch.Tensor]) -> torch.Tensor:
        """One score per chunk token from each probe's (in `probes` order): one probe's as
        they are; several, each as a share of its total, summed, so each scorer weighs
        alike."""
        if len(scores) == 1:
            return scores[0]
        return sum(s.double() / s.double().sum().clamp_min(1e-30) for s in scores)

    def budget(self, num_chunk_tokens: int) -> int:
        """Tokens recomputed in all (the most, with an adaptive budget): ceil(ratio * n)."""
        return _share(self.ratio, num_chunk_tokens)

    def sink(self, layout: PromptLayout) -> list[int]:
        """Flat indices of the sink tokens, for the methods that take them."""
        if not self.method.startswith("sink"):
            return []
        # A chunk of the exact prefix (layout.exact_end) has the KV a recompute would give.
        chunks = [(a, b) for a, b in layout.chunk_bounds if a >= layout.exact_end]
        if self.method == "sink":
            def count(n: int) -> int:  # alone, the ratio of each chunk unless k is given
                return self.budget(n) if self.sink_tokens is None else min(n, self.sink_tokens)

            return [x for a, b in chunks for x in range(a, a + count(b - a))]
        k = DEFAULT_SINK_TOKENS if self.sink_tokens is None else self.sink_tokens
        # Within the budget, every chunk's first token before any chunk's second one.
        ranked = sorted((x - a, x) for a, b in chunks for x in range(a, min(b, a + k)))
        budget = self.budget(layout.question_start - layout.system_len)
        return sorted(x for _, x in ranked[:budget])

    def needs_probe(self, layout: PromptLayout) -> bool:
        """Whether choosing R needs the model: a scorer with budget left after the sinks, and
        a choice to make (not every chunk token, as at r = 1)."""
        total = layout.question_start - layout.system_len
        room = layout.question_start - layout.exact_end
        return (bool(self.scorers) and min(self.budget(total), room) > len(self.sink(layout))
                and self._least(total) < room)

    def _least(self, total: int) -> int:
        """The fewest chunk tokens recomputed: all of the budget unless it is adaptive."""
        if self.score_mass is None:
            return self.budget(total)
        return min(self.budget(total), _share(self.min_ratio, total))

    def stale(self, layout: PromptLayout, selected: tuple[int, ...]
              ) -> tuple[tuple[int, int], ...]:
        """The (start, end) ranges of flat chunk tokens the question and the generated tokens
        read damped: after the exact prefix, not recomputed (`selected`, ascending); () when
        the spec does not damp."""
        if not self.damping:
            return ()
        ranges, start = [], layout.exact_end
        for x in (*selected, layout.question_start):
            if x < start:
                continue
            if x > start:
                ranges.append((start, x))
            start = x + 1
        return tuple(ranges)

    def select(self, layout: PromptLayout, scores: torch.Tensor | None) -> tuple[int, ...]:
        """R as ascending flat indices. `scores`: one float per chunk token in flat order
        (higher: recompute first), from the probe when `needs_probe`. Ties go to the earlier
        token, so the choice is a function of the prompt and the cached KV alone."""
        chosen = self.sink(layout)
        s, e, qs = layout.system_len, layout.exact_end, layout.question_start
        total = qs - s
        # Only tokens after the exact prefix can change: the budget counts every chunk token
        # (r is a share of them all), R takes none before `e`.
        rest = min(self.budget(total), qs - e) - len(chosen) if self.scorers else 0
        if self.scorers and self._least(total) >= qs - e:
            return tuple(range(e, qs))  # every token that can change: no choice to make
        if rest > 0:
            if scores is None or scores.numel() != total:
                raise ValueError(f"recompute={self.method!r} needs one score per chunk token "
                                 f"({total})")
            scores = scores.detach().double().cpu().clone()
            scores[:e - s] = 0.0  # neither mass nor rank: a full prefill's KV already
            if self.score_mass is not None:
                rest = self._adaptive(scores, chosen, s, total, rest)
            scores[:e - s] = -math.inf
            if chosen:
                scores[torch.tensor(chosen) - s] = -math.inf
            order = torch.sort(scores, descending=True, stable=True).indices[:rest]
            chosen = chosen + (order + s).tolist()
        return tuple(sorted(chosen))

    def _adaptive(self, scores: torch.Tensor, chosen: list[int], start: int, total: int,
                  most: int) -> int:
        """How many scored tokens to add to the sinks `chosen`: the fewest, best first, that
        bring the chosen tokens' share of the (non-negative) score mass to `score_mass`, but
        at least min_ratio and at most `most`."""
        mass = scores.clamp_min(0.0)
        whole = float(mass.sum())
        need = 0
        if whole > 0.0:
            # Scores come in float32: a share equal to the target within its rounding holds.
            target = (self.score_mass - 1e-6) * whole
            if chosen:
                index = torch.tensor(chosen) - start
                covered = float(mass[index].sum())
                mass[index] = 0.0
            else:
                covered = 0.0
            if covered < target:
                ranked = torch.sort(mass, descending=True, stable=True).values
                held = covered + torch.cumsum(ranked, 0)
                need = int((held < target).sum()) + 1
        least = _share(self.min_ratio, total) - len(chosen)
        return max(0, min(most, max(need, least)))


def method_scorers(method: str) -> tuple[str, ...]:
    """The scorers of a recompute method (config.RECOMPUTE_METHODS): "sink+query" -> ("query",),
    "query+blend" -> ("query", "blend"), "sink" -> ()."""
    return tuple(x for x in method.split("+") if x not in ("sink", "none"))


def probe_plan(method: str, check_layers: tuple[int, ...] | None
               ) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(scorer, check layers) of each probe of `method` (none for `sink` alone): its scorer at
    `check_layers`; in "query+blend" those are the query's, and blend keeps BLEND_CHECK_LAYER
    (its probe runs every chunk token through the layers up to it, so a deep one costs a
    prefill's share)."""
    scorers = method_scorers(method)
    if len(scorers) == 1:
        return ((scorers[0], check_layers),)
    return tuple((x, check_layers if x == "query" else (BLEND_CHECK_LAYER,)) for x in scorers)


def _share(fraction: float, n: int) -> int:
    """ceil(fraction * n) tokens of n (the epsilon keeps 0.15 * 100 at 15)."""
    return min(n, math.ceil(fraction * n - 1e-9))

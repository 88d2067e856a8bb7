"""Speculative decoding from the request's own tokens (prompt lookup: vLLM's `ngram` method).

A RAG answer copies names, numbers and phrases from its documents. When a decoding request's
last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) occurred earlier in its
prompt or output, the tokens that followed them there are its drafts: appended to the request
for one step, they make its work an extend of k + 1 queries (the pending token and k drafts),
which returns k + 1 rows of logits.

Verification samples every row as an ordinary decode step would sample it (the same seeded
stream at the same output index, sampling/sampler.py) and keeps the drafts up to the first one
that differs from its row's sample, plus that row's sample. For a draft proposed with
certainty this is exact rejection sampling: a draft d is kept with probability p(d), and on a
mismatch the token kept is drawn from p restricted to the tokens other than d. So outputs keep
the target distribution, and with a given seed they are the tokens decoding without drafts
gives (greedy and sampled alike). The rejected drafts' KV slots are freed at once.

A row after drafts sees them as generated: penalties count them, min_tokens counts them, and a
structured output's grammar masks the row at the state the drafts before it lead to (the
output processor builds each row's history); a draft is cut where its grammar refuses a
token or the output is complete. A request whose drafts keep missing backs off (from the
second miss in a row it skips 1, then 3, 7 and at most 15 decode steps), so text without
copying costs little.

A verified row is not free where a step is bound by arithmetic (a CPU, or a large batch on a
GPU): a step of B decode rows and D drafts gives B + (drafts kept) tokens for the time of
B + D rows. With `adaptive` (the default), a step where every running request decodes
verifies only the drafts that pay by the engine's own measurements: the time of its past
steps of generated rows by their sequences and rows (`StepCost`), and each request's share of
drafted tokens kept so far. The drafts of the requests most likely to keep them are taken as
long as the tokens expected per second rise. A step whose cost is not known yet is measured:
without drafts at a batch size never timed, then with all of them (and again after a run of
steps without drafts, so one slow measurement does not end drafting).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineConfig, SpeculativeConfig
from .request import Request

# Longest back-off of a request whose drafts keep missing, in decode steps.
_MAX_BACKOFF = 15
# How far one measurement moves a step's estimated time: recent steps weigh most (the
# sequences' contexts grow).
_COST_WEIGHT = 0.25
# A request's expected kept share counts this many drafted tokens at the engine's share
# besides its own, and the engine's as many at _PRIOR_RATE.
_PRIOR_TOKENS = 8
_PRIOR_RATE = 0.5
# Steps of one batch size left without drafts before the best draft's is measured again.
_REMEASURE = 64
# A request's first draft, and the shortest after a miss: verifying 2 drafts (3 rows) costs
# about what a decode step costs where the step is bound by reading the weights (a GPU; this
# 2-core CPU up to 3 rows, docs/benchmarks.md "Small matmuls, streamed"), 4 and more twice
# that on the CPU; a draft kept whole doubles the next one.
SHORT_DRAFT = 2


class NgramIndex:
    """Where each n-gram (prompt_lookup_min <= n <= prompt_lookup_max) of a request's tokens
    last ended, over the n-grams that have a token after them. Grown as tokens come (each
    token is indexed once), so a lookup is O(max - min) per step, not a scan."""

    __slots__ = ("lo", "hi", "ends", "next_end")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo = lo
        self.hi = hi
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self.next_end = 1  # the next exclusive end to index

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` found (none: [])."""
        last = len(tokens)
        for end in range(self.next_end, last):  # every n-gram ending before the last token
            for n in range(self.lo, min(self.hi, end) + 1):
                self.ends[n][tuple(tokens[end - n:end])] = end
        self.next_end = max(self.next_end, last)
        for n in range(min(self.hi, last), self.lo - 1, -1):
            end = self.ends[n].get(tuple(tokens[last - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []


@dataclass(frozen=True, slots=True)
class SpecDecodeStats:
    """Counts over the engine's life (vLLM's spec_decode metrics): steps that verified drafts,
    the drafts verified and those kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting step gives on average: the kept drafts and the one after them."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class StepCost:
    """What a step of generated rows (decode rows and drafts, no prompt rows) takes on this
    engine, by its sequences and rows: measured, the latest times weighing most; between two
    row counts measured for as many sequences, interpolated. Sequences count apart from rows
    because each reads its whole context: on the CPU a RAG sequence's turned keys cost more
    than a few more rows of it (measured: 8 sequences with 4 drafts ran faster than 8 plain
    ones of longer contexts)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: dict[tuple[int, int], float] = {}

    def observe(self, sequences: int, rows: int, seconds: float) -> None:
        key = (sequences, rows)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + _COST_WEIGHT * (seconds - old)

    def at(self, sequences: int, rows: int) -> float | None:
        """The estimated time of a step of `rows` rows of `sequences` sequences: measured,
        interpolated between the row counts measured around it, or beyond the largest
        extended along the line through the two largest (never falling); None with fewer
        than two row counts measured for as many sequences."""
        known = self.seconds
        if (sequences, rows) in known:
            return known[sequences, rows]
        counts = sorted(n for b, n in known if b == sequences)
        if len(counts) < 2:
            return None
        above = [n for n in counts if n > rows]
        if above and above[0] != counts[0]:
            low, high = counts[counts.index(above[0]) - 1], above[0]
            return known[sequences, low] + (rows - low) / (high - low) * (
                known[sequences, high] - known[sequences, low])
        if above:
            return None  # fewer rows than any step measured
        low, high = counts[-2], counts[-1]
        slope = max(0.0, (known[sequences, high] - known[sequences, low]) / (high - low))
        return known[sequences, high] + (rows - high) * slope


def speculator_for(config: EngineConfig, max_model_len: int) -> Speculator | None:
    """The engine's Speculator (None: speculative decoding off)."""
    spec = config.speculative_config
    return None if spec is None else Speculator(spec, max_model_len)


class Speculator:
    """Proposes drafts for decoding requests (at scheduling) and verifies them (after
    sampling); the scheduler owns it, so slots and counts stay in one place."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()
        self.cost = StepCost()
        self._declined: dict[int, int] = {}  # sequences -> steps in a row without drafts

    def propose(self, decoding: list[Request], num_running: int, budget: int) -> None:
        """Append drafts to `decoding` requests (each's `num_drafts`), within the step's
        token budget after one token each; with `adaptive`, where every running request
        decodes, only the drafts that pay (`paying`)."""
        c = self.config
        if c.disable_by_batch_size is not None and num_running >= c.disable_by_batch_size:
            return
        proposals = self._drafts(decoding, budget - len(decoding))
        if c.adaptive and num_running == len(decoding):
            proposals.sort(key=lambda p: -self.rate(p[0]))  # stable: ties keep their order
            proposals = proposals[:self.paying(len(decoding), proposals)]
        for req, draft in proposals:
            req.token_ids.extend(draft)
            req.num_drafts = len(draft)

    def rate(self, req: Request) -> float:
        """The share of a request's next draft expected kept: the share of its drafted
        tokens kept so far, counting _PRIOR_TOKENS more at the engine's share (itself
        counting as many at _PRIOR_RATE), so that first misses rule nothing out."""
        t, m = self.stats, req.metrics
        engine = ((t.num_accepted_tokens + _PRIOR_TOKENS * _PRIOR_RATE)
                  / (t.num_draft_tokens + _PRIOR_TOKENS))
        return ((m.num_accepted_tokens + _PRIOR_TOKENS * engine)
                / (m.num_draft_tokens + _PRIOR_TOKENS))

    def paying(self, base: int, proposals: list[tuple[Request, list[int]]]) -> int:
        """How many of `proposals` (best expected first) to verify in a step of `base`
        decoding sequences: the number whose expected tokens per second, by `StepCost`, is
        the highest (0 when none beats the step without drafts). What is not measured yet
        is measured: the step without drafts, then one with all of them; and after
        _REMEASURE steps in a row without drafts the best draft is taken once, so one slow
        measurement does not end drafting for good."""
        if not proposals:
            return 0
        cost = self.cost
        plain = cost.at(base, base)
        if plain is None:
            return 0  # time the step without drafts first
        if cost.at(base, base + len(proposals[0][1])) is None:
            self._declined[base] = 0
            return len(proposals)  # time a step with drafts
        declined = self._declined.get(base, 0)
        if declined >= _REMEASURE:
            self._declined[base] = 0
            return 1  # time the best draft's step again
        best, best_rate = 0, base / plain
        tokens = float(base)
        rows = base
        for taken, (req, draft) in enumerate(proposals, 1):
            rows += len(draft)
            tokens += self.rate(req) * len(draft)
            rate = tokens / cost.at(base, rows)
            if rate > best_rate:
                best, best_rate = taken, rate
        self._declined[base] = declined + 1 if best == 0 else 0
        return best

    def _drafts(self, decoding: list[Request], spare: int) -> list[tuple[Request, list[int]]]:
        """Each decoding request's draft (those that find one), within `spare` tokens."""
        c = self.config
        proposals = []
        for req in decoding:
            if spare <= 0:
                break
            if req.num_drafts:
                continue
            if req.spec_backoff:
                req.spec_backoff -= 1
                continue
            # Drafts and the token after them must fit max_tokens and max_model_len.
            k = min(req.spec_length or min(SHORT_DRAFT, c.num_speculative_tokens), spare,
                    req.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1)
            if k <= 0:
                continue
            if req.ngram is None:
                req.ngram = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)
            draft = req.ngram.propose(req.token_ids, k)
            if draft and req.matcher is not None:  # what the grammar refuses cannot be kept
                draft = draft[:len(req.matcher.states_after(draft))]
            if draft:
                proposals.append((req, draft))
                spare -= len(draft)
        return proposals

    @staticmethod
    def drop(req: Request) -> list[int]:
        """Take a request's drafts out of its tokens; returns them."""
        k = req.num_drafts
        if not k:
            return []
        drafts = req.token_ids[-k:]
        del req.token_ids[-k:]
        req.num_drafts = 0
        return drafts

    def verify(self, req: Request, sampled: list[int]) -> tuple[list[int], int]:
        """The tokens to append from a drafting request's k + 1 sampled rows (the drafts that
        match, then the first row's own sample where one does not), and how many of its
        computed tokens stay valid. Drafts are taken out of its tokens and counted."""
        drafts = self.drop(req)
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        t = self.stats
        self.stats = SpecDecodeStats(t.num_drafts + 1, t.num_draft_tokens + len(drafts),
                                     t.num_accepted_tokens + accepted)
        m = req.metrics
        m.num_spec_steps += 1
        m.num_draft_tokens += len(drafts)
        m.num_accepted_tokens += accepted
        # The next draft's length follows this one's: as long as what was kept, plus one
        # (a draft kept whole: twice as long), from SHORT_DRAFT up to num_speculative_tokens.
        req.spec_length = min(self.config.num_speculative_tokens,
                              2 * len(drafts) if accepted == len(drafts)
                              else max(SHORT_DRAFT, accepted + 1))
        if accepted:
            req.spec_misses = 0
        else:
            req.spec_misses += 1
            req.spec_backoff = min(2 ** (req.spec_misses - 1) - 1, _MAX_BACKOFF)
        # The pending token's and the accepted drafts' K/V are valid.
        return sampled[:accepted + 1], req.num_tokens + accepted

"""The scheduler's side of selective recompute: what a request does when it reaches its question.

In order, once per request (the choice is kept over preemption; it depends only on the prompt):
- R needs no probe (`sink` alone): it is chosen at once;
- R needs a probe (one per scorer): each `ProbeWork` joins the step that completes the
  request's chunks (or the first step after), priced in budget tokens as the probed tokens
  times the fraction of layers probed; the runner executes them after the step's forward and
  `update` chooses R from their scores. The question waits for R's fresh KV;
- then the tokens of R are computed as works of their own (as many as the budget holds per
  step): each takes own slots in place of the borrowed cached ones in the request's KV list,
  attends to everything before it and writes its K/V there. The cached entry is not touched.
Only then is the question planned. Everything here is plain integers and lists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..cache.chunk_cache import ChunkCache
from ..engine.request import Request, RequestStatus
from ..engine.scheduler_output import SchedulerOutput, SeqWork
from .probe import ProbeWork

logger = logging.getLogger("ragkv")


class RecomputePlanner:
    def __init__(self, chunk_cache: ChunkCache | None, num_layers: int,
                 max_num_batched_tokens: int) -> None:
        self.chunk_cache = chunk_cache
        self.num_layers = num_layers  # prices a probe in tokens of budget
        # A probe takes at most a step's tokens through the layers at a time.
        self.block_tokens = max_num_batched_tokens

    def plan(self, req: Request, out: SchedulerOutput, room: int, computes_chunks: bool,
             alloc: Callable[[int], list[int]]) -> tuple[int, bool]:
        """Plan `req`'s recompute at its question with `room` budget tokens left; `alloc(n)`
        gives n general-region slots (or raises the scheduler's reason to stop). Returns the
        tokens used and whether the request's planning stops here for this step; (0, False)
        once every token of R has fresh KV planned: the question may follow."""
        spec, layout = req.recompute, req.layout
        planned = out.recomputed.get(id(req), (req, req.num_recomputed))[1]
        if req.selected is None and not spec.needs_probe(layout):
            self.choose(req, spec.select(layout, None))
        if req.selected is None:
            out.probes.extend(self._probes(req, alloc))
            return min(self._probe_cost(req), room), True
        if planned < len(req.selected):
            if computes_chunks:
                # Recomputed tokens take over chunk slots in the request's list, which this
                # step's chunk works still write through: next step.
                return 0, True
            return self._plan_tokens(req, planned, room, out, alloc), False
        return 0, False

    def choose(self, req: Request, selected: tuple[int, ...]) -> None:
        """Record the chunk tokens `req` recomputes and the stale ones it damps (once: kept
        over preemption)."""
        if req.selected is not None:
            return
        req.selected = selected
        req.stale = req.recompute.stale(req.layout, selected)
        req.metrics.num_recomputed_tokens = len(selected)
        if self.chunk_cache is not None:
            self.chunk_cache.count_recomputed(len(selected))

    def update(self, out: SchedulerOutput, scores: list) -> list[Request]:
        """After the step ran: the recomputed tokens' progress, and R from each probe's
        scores (an exception in place of scores, or one choosing from them, fails that
        request alone). Returns the requests that failed, finished with FINISHED_ERROR by
        the caller."""
        for req, n in out.recomputed.values():
            req.num_recomputed = n
        failed = []
        results: dict[int, tuple[Request, list]] = {}  # a request's probes, in order
        for probe, result in zip(out.probes, scores, strict=True):
            results.setdefault(id(probe.request), (probe.request, []))[1].append(result)
        for req, mine in results.values():
            if req.status.finished:
                continue
            try:
                for result in mine:
                    if isinstance(result, Exception):
                        raise result
                spec = req.recompute
                self.choose(req, spec.select(req.layout, spec.combine(mine)))
            except Exception as e:  # noqa: BLE001 (this request fails, not the step)
                logger.exception("choosing recomputed tokens for %s failed", req.request_id)
                req.error = f"recompute selection failed: {type(e).__name__}: {e}"
                failed.append(req)
        return failed

    def _probes(self, req: Request, alloc: Callable[[int], list[int]]) -> list[ProbeWork]:
        """The probes of `req` (one per scorer), whose chunks' KV is ready by the end of this
        step. A `query` probe writes its tokens' fresh K/V where the question's own will go:
        their slots are the request's from now on (the question, planned later, takes them
        instead of new ones), so the probe runs through the attention backend like any step
        and frees nothing."""
        spec, layout = req.recompute, req.layout
        s, qs = layout.system_len, layout.question_start
        works = []
        for kind, layers in spec.probes:
            if kind == "blend":
                # The exact prefix's chunk tokens deviate by nothing: they are not probed.
                probed = list(range(layout.exact_end, qs))
                key_positions, positions = layout.chunk_positions(probed)
            else:
                # Scored prompt tokens are an answer being scored (ragkv eval): choosing by
                # them would let the answer pick its own evidence.
                end = req.num_prompt_tokens - max(0, req.num_scored_tokens - 1)
                probed = list(range(qs, max(end, qs + 1)))
                positions = key_positions = layout.positions(qs, probed[-1] + 1)
                missing = probed[-1] + 1 - len(req.kv.slots)
                if missing > 0:
                    req.kv.append(alloc(missing))
            works.append(ProbeWork(
                request=req, kind=kind, token_ids=[req.token_ids[x] for x in probed],
                positions=positions, key_positions=key_positions, kv_slots=req.kv.slots[:qs],
                turns=layout.turns, chunks=(s, qs), check_layers=layers,
                skip=layout.exact_end - s if kind == "blend" else 0,
                block_tokens=self.block_tokens,
                own_slots=req.kv.slots[qs:probed[-1] + 1] if kind != "blend" else []))
        return works

    def _probe_cost(self, req: Request) -> int:
        """Budget for choosing R: each probe's tokens times the fraction of layers it runs."""
        spec, layout = req.recompute, req.layout
        cost = 0
        for kind, layers in spec.probes:
            probed = (layout.question_start - layout.exact_end if kind == "blend"
                      else req.num_prompt_tokens - layout.question_start)
            cost += -(-probed * (max(layers) + 1) // self.num_layers)
        return max(1, cost)

    @staticmethod
    def _plan_tokens(req: Request, planned: int, room: int, out: SchedulerOutput,
                     alloc: Callable[[int], list[int]]) -> int:
        """A work for the next selected chunk tokens (up to `room`): own slots replace the
        borrowed cached ones in the request's KV list (the chunk entry is not touched);
        tokens of an uncached chunk are rewritten in the slots they already own."""
        tokens = list(req.selected[planned:planned + room])
        borrowed = req.kv.borrowed_at(tokens)
        req.kv.replace(borrowed, alloc(len(borrowed)))
        layout = req.layout
        base, target = layout.chunk_positions(tokens)
        end = tokens[-1] + 1
        out.works.append(SeqWork(
            request=req, start=tokens[0], end=end, kv_spans=((0, end),),
            token_ids=[req.token_ids[x] for x in tokens], positions=target, sample=False,
            logits_from=end,
            turns=tuple((a, min(b, end), d) for a, b, d in layout.turns if a < end),
            query_index=tuple(tokens), key_positions=base,
        ))
        out.recomputed[id(req)] = (req, planned + len(tokens))
        return len(tokens)

    @staticmethod
    def check(out: SchedulerOutput, running: set[int]) -> None:
        """The recompute parts of the scheduler's invariants; raises AssertionError."""
        for w in out.works:
            if w.query_index is not None and w.request.kv.borrowed_at(list(w.query_index)):
                raise AssertionError("scheduler: a recompute work writes into chunk-cache "
                                     "slots")
        for req, n in out.recomputed.values():
            if id(req) not in running or not req.num_recomputed < n <= len(req.selected):
                raise AssertionError(f"scheduler: recompute progress for request "
                                     f"{req.request_id} that does not advance")
        for probe in out.probes:
            if probe.request.status is not RequestStatus.RUNNING:
                raise AssertionError("scheduler: a probe for a request that is not running")

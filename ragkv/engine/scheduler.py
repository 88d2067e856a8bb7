"""Continuous batching by token budget (vLLM v1 style), with chunk jobs for RAG requests.

Each step fills `max_num_batched_tokens` with work: running requests first, those decoding
before those still prefilling, then waiting requests in arrival order. A request advances
through its flat tokens (S, C_1..C_n, Q, generated) and a step may give it several works, one
per segment, each an extend in the attention contract's terms:
- system prompt: KV list = S so far (S is matched in the radix cache first);
- chunk C_i: KV list = [S, C_i so far] (`standalone`: [C_i so far]), at the chunk's base
  positions; skipped altogether when the chunk cache has it;
- question and decode: KV list = [S, C_1..C_n, Q so far], with the keys of chunks placed
  elsewhere than their base positions turned by the attention backend (`turns`).
A backend writes every new token's K/V of a step before it attends, so one step may hold a
whole cold RAG prompt, and a request may use a chunk that another request computes in the
same step. Long segments are split over steps (chunked prefill).

When the general KV region runs out, unlocked prefix-cache entries are evicted; if that is not
enough, the newest running request that is newer than the one asking and not yet scheduled
this step is preempted: its slots go back (its computed prefix into the radix cache, its
unfinished chunk entries dropped) and it is recomputed later. A running request that gets no
work for lack of slots preempts itself. No waiting request is admitted in a step that
preempted (vLLM's rule): the room just freed belongs to the running requests.

Rules that keep the bookkeeping consistent (`check_invariants` verifies them after every
`schedule()` when debug checks are on):
- everything a request took this step (works, progress, chunk entries it completes) is
  dropped together when it is preempted or fails, so a step never computes for a request that
  no longer holds its slots;
- planning stops for a stated reason (no free slots, a chunk another request computes, or a
  chunk the store is reading: reads never block planning); a waiting request is admitted only
  when its whole plan for the step fits (or it waits for such a chunk), otherwise everything
  it took is rolled back;
- an exception while planning or updating one request fails that request alone; an
  inconsistency `check_invariants` finds is no request's fault: it raises
  `InvariantViolation`, and the engine stops rather than serve from a corrupt state.
Everything here is plain integers and lists.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque

from ..cache.chunk_cache import LOADING, ChunkCache
from ..cache.kv_manager import KVCacheManager
from ..model.executor import EngineDeadError
from ..recompute.planner import RecomputePlanner
from .request import ChunkBinding, Request, RequestStatus
from .scheduler_output import SchedulerOutput, SeqWork
from .speculative import Speculator

logger = logging.getLogger("ragkv")


class InvariantViolation(EngineDeadError):
    """The scheduler's bookkeeping is inconsistent (`check_invariants`): no one request is at
    fault, so the engine cannot go on safely."""


class _Stop(enum.Enum):
    """Why planning for a request ended."""

    DONE = "done"  # all its pending tokens are planned, or the budget is spent
    NO_SLOTS = "no_slots"  # the general region has no room, even after preempting
    CHUNK_WAIT = "chunk_wait"  # another request is computing a chunk it needs
    LOADING = "loading"  # the chunk store is reading a chunk it needs
    FAILED = "failed"


# Reasons a request holds its place without work this step: what it waits for arrives later.
_WAITS = (_Stop.CHUNK_WAIT, _Stop.LOADING)


class _Blocked(Exception):
    def __init__(self, reason: _Stop) -> None:
        super().__init__(reason.value)
        self.reason = reason


class Scheduler:
    def __init__(self, kv: KVCacheManager, chunk_cache: ChunkCache | None, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_prefix_caching: bool,
                 debug_checks: bool = False, num_layers: int = 1,
                 speculator: Speculator | None = None) -> None:
        self.kv = kv
        self.chunk_cache = chunk_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.debug_checks = debug_checks
        self.recompute = RecomputePlanner(chunk_cache, num_layers, max_num_batched_tokens)
        self.speculator = speculator
        # The step being run: its sequences and rows if timed, its start.
        self._timed, self._started = (0, 0), 0.0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.chunk_cache is not None:
            self.chunk_cache.poll_loads()  # chunks read from the store since the last step
        budget = self.max_num_batched_tokens
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        if self.speculator is not None and decoding:
            # Drafts make a decoding request's work an extend of 1 + k tokens, planned first.
            self.speculator.propose(decoding, len(self.running), budget)
        for req in decoding + prefilling:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step to make room for an older request
            used, stop = self._plan(req, budget, out, may_preempt=True)
            if used == 0 and stop is _Stop.NO_SLOTS:
                self._preempt(req, out)  # nothing to run: give its room to the others
            budget -= used

        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and not out.preempted):
            req = self.waiting[0]
            used, stop = self._plan(req, budget, out, may_preempt=False)
            if stop is _Stop.FAILED:
                continue
            if stop is _Stop.NO_SLOTS or (used == 0 and stop not in _WAITS):
                # Its plan does not fit: roll back all of it and try again next step (taking
                # part of its prompt now would only be preempted again).
                out.discard(req)
                self._release(req)
                req.num_computed_tokens = 0
                break
            # Admitted: its plan fits, or it holds its place while another request computes
            # a chunk it shares or the store reads one.
            self.waiting.popleft()
            metrics = req.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = time.monotonic()
                metrics.time_in_queue = metrics.first_scheduled_time - metrics.arrival_time
                metrics.num_prefix_cached_tokens = req.kv.num_tree
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= used
        if self.debug_checks:
            try:
                self.check_invariants(out)
            except Exception as e:  # no one request's fault: the engine must stop
                raise InvariantViolation(f"{type(e).__name__}: {e}") from e
        if self.speculator is not None and self.speculator.config.adaptive:
            # A step of generated tokens only is timed for the cost gate's StepCost: from
            # here to `update`, the model's forward.
            generated = (not out.probes and all(w.end - len(w.token_ids) >= w.prompt_len
                                                 for w in out.works))
            rows = sum(len(w.token_ids) for w in out.works) if generated else 0
            self._timed = (len(out.works), rows)
            self._started = time.perf_counter()
        return out

    def _plan(self, req: Request, budget: int, out: SchedulerOutput,
              may_preempt: bool) -> tuple[int, _Stop]:
        """Add `req`'s works for this step within `budget`; returns the tokens used and why
        planning stopped. A failure is contained here: the request is finished with
        FINISHED_ERROR and reported in `out.failed`."""
        try:
            if not may_preempt and self.enable_prefix_caching and not req.kv.slots:
                self._match_prefix(req)  # a waiting request's cached prefix, first
            return self._plan_works(req, budget, out, may_preempt)
        except Exception as e:  # a bug or a bad request: it must not take the step down
            logger.exception("scheduling request %s failed", req.request_id)
            out.discard(req)
            req.error = f"scheduling failed: {type(e).__name__}: {e}"
            self.finish(req, RequestStatus.FINISHED_ERROR)
            out.failed.append(req)
            return 0, _Stop.FAILED

    def _match_prefix(self, req: Request) -> None:
        """Point a waiting request that holds nothing at its longest cached prefix. An
        ordinary prompt keeps one token to compute: its logits give the next token. A RAG
        prompt always computes its question, so S may match whole. Scored prompt tokens need
        their own logits, so they are never taken from the cache."""
        limit = req.layout.system_len if req.layout.is_rag else req.num_tokens - 1
        limit = min(limit, req.num_prompt_tokens - req.num_logit_tokens)
        req.num_computed_tokens = self.kv.match_prefix(req.kv, req.token_ids[:limit])

    def _plan_works(self, req: Request, budget: int, out: SchedulerOutput,
                    may_preempt: bool) -> tuple[int, _Stop]:
        x = req.num_computed_tokens
        layout = req.layout
        s = layout.system_len
        used = 0
        stop = _Stop.DONE
        computes_chunks = False  # this step computes some of the request's chunk tokens
        try:
            while x < req.num_tokens and used < budget:
                if x == layout.question_start and req.recompute is not None:
                    n, stop_here = self.recompute.plan(
                        req, out, budget - used, computes_chunks,
                        lambda k: self._alloc(req, k, out, may_preempt))
                    used += n
                    if stop_here:
                        break
                    if n:
                        continue  # the budget left decides whether the question follows
                chunk = layout.chunk_at(x)
                if chunk is None:
                    # System prompt or question/generated: own slots, allocated as computed.
                    end = s if x < s else req.num_tokens
                    n = min(end - x, budget - used)
                    # A `query` probe may hold the question's slots already (planner.py).
                    held = max(0, len(req.kv.slots) - x)
                    if n > held:
                        req.kv.append(self._alloc(req, n - held, out, may_preempt))
                    spans = ((0, x + n),)
                    after = x >= layout.question_start
                    turns = layout.turns if after else ()
                    damped = req.stale if after else ()
                else:
                    primer = ()
                    if chunk == 0 and layout.primer_len and self._primer_needed(req):
                        # P first, before any chunk of the request claims room in the
                        # chunk region (it could leave none for P).
                        primer, n = self._primer(req, out, budget - used, may_preempt)
                        used += n
                        if primer is None:  # P does not fit what is left of the budget
                            break
                    end = layout.chunk_bounds[chunk][1]
                    binding = req.bindings[chunk]
                    if binding is None:
                        binding = self._bind_chunk(req, chunk, out, may_preempt)
                    if not binding.computing:
                        x = end  # reused: its KV is ready (or completes earlier this step)
                        continue
                    if layout.primed(chunk):
                        primer, n = self._primer(req, out, budget - used, may_preempt)
                        used += n
                        if primer is None:
                            break
                    n = min(end - x, budget - used)
                    if n == 0:
                        break
                    spans = layout.chunk_kv_spans(chunk, x + n)
                    turns = damped = ()
                    computes_chunks = True
                    if x + n == end and binding.entry is not None:
                        out.completing.append(binding.entry)
                out.works.append(_work(req, x, x + n, spans, turns, damped))
                if chunk is not None and layout.primed(chunk):
                    out.works[-1].primer = primer
                x += n
                used += n
        except _Blocked as blocked:
            stop = blocked.reason
        if x > req.num_computed_tokens:
            out.progress[id(req)] = (req, x)
        return used, stop

    def _bind_chunk(self, req: Request, i: int, out: SchedulerOutput,
                    may_preempt: bool) -> ChunkBinding:
        """Decide where chunk i's KV comes from and append its slots to the request's list."""
        cache = self.chunk_cache
        if cache is not None:
            chunk = req.chunk_keys[i]
            if not req.looked_up[i]:
                entry = cache.lookup(chunk)
                if entry is LOADING:
                    cache.prefetch(req.chunk_keys[i + 1:])  # its other reads overlap
                    raise _Blocked(_Stop.LOADING)  # counted when it arrives
                req.looked_up[i] = True
                if req.layout.chunk_deltas[i]:
                    cache.count_repositioned(len(chunk))
                if entry is None:
                    req.metrics.num_chunk_misses += 1
                else:
                    req.metrics.num_chunk_hits += 1
                    req.metrics.num_chunk_cached_tokens += len(chunk)
            else:  # planned before (rolled back, or preempted): counted then
                entry = cache.find_or_load(chunk)
                if entry is LOADING:
                    raise _Blocked(_Stop.LOADING)
            if entry is not None:
                if not (entry.complete or entry in out.completing):
                    raise _Blocked(_Stop.CHUNK_WAIT)  # being computed: use it when done
                binding = ChunkBinding(entry, computing=False)
                cache.pin(entry)
            else:
                entry = cache.reserve(chunk)
                binding = ChunkBinding(entry, computing=True) if entry else None
            if binding is not None:
                req.kv.borrow(binding.entry.slots)
                req.bindings[i] = binding
                return binding
        # No chunk cache, or the chunk cannot fit its region: compute it in the general
        # region, uncached.
        start, end = req.layout.chunk_bounds[i]
        req.kv.append(self._alloc(req, end - start, out, may_preempt))
        req.bindings[i] = ChunkBinding(None, computing=True)
        return req.bindings[i]

    def _primer_needed(self, req: Request) -> bool:
        """Whether a chunk after the first is missing from the chunk cache (it will be
        computed, after P). A warm request never touches P."""
        if self.chunk_cache is None:
            return True
        find = self.chunk_cache.find
        return any(find(key) is None for key in req.chunk_keys[1:])

    def _primer(self, req: Request, out: SchedulerOutput, room: int, may_preempt: bool
                ) -> tuple[tuple[int, ...] | None, int]:
        """The slots of the primer P's KV, which `req`'s primed chunks read, and the budget
        used. P is bound once, like a chunk: its chunk-cache entry reused when complete (or
        completing this step), else computed at once, whole, by a work of its own, into a new
        entry, or into the request's own slots (`SeqKV.extra`) without a chunk cache or room
        in its region (None, and nothing planned, while P does not fit `room`). So a request
        never holds P unfinished across a step another one waits on."""
        at = len(req.layout.chunk_bounds)
        binding = req.bindings[at]
        if binding is not None:
            entry = binding.entry
            if entry is None:
                return tuple(req.kv.extra), 0
            if not (entry.complete or entry in out.completing):
                raise RuntimeError("the chunk primer's entry is neither computed nor computing")
            return tuple(entry.slots), 0
        cache = self.chunk_cache
        if cache is not None:
            entry = cache.find_or_load(req.primer_key)  # uncounted: P is no document
            if entry is LOADING:
                raise _Blocked(_Stop.LOADING)
            if entry is not None:
                if not (entry.complete or entry in out.completing):
                    raise _Blocked(_Stop.CHUNK_WAIT)
                cache.pin(entry)
                req.bindings[at] = ChunkBinding(entry, computing=False)
                return tuple(entry.slots), 0
        p = len(req.primer)
        if p > room:
            return None, 0
        entry = cache.reserve(req.primer_key) if cache is not None else None
        if entry is None:
            req.kv.extra = self._alloc(req, p, out, may_preempt)
        else:
            out.completing.append(entry)
        req.bindings[at] = ChunkBinding(entry, computing=True)
        slots = tuple(req.kv.extra if entry is None else entry.slots)
        s = req.layout.system_len
        out.works.append(SeqWork(
            request=req, start=s, end=s, kv_spans=((0, s),), token_ids=list(req.primer),
            positions=list(range(s, s + p)), sample=False, logits_from=s, primer=slots,
            computes_primer=True))
        return slots, p

    def _alloc(self, req: Request, n: int, out: SchedulerOutput, may_preempt: bool) -> list[int]:
        """`n` general-region slots, preempting newer unscheduled requests if allowed."""
        while True:
            slots = self.kv.allocate(n)
            if slots is not None:
                return slots
            victim = self._victim(req, out) if may_preempt else None
            if victim is None:
                raise _Blocked(_Stop.NO_SLOTS)
            self._preempt(victim, out)

    def _victim(self, req: Request, out: SchedulerOutput) -> Request | None:
        """The newest running request newer than `req` with nothing planned this step."""
        busy = {id(w.request) for w in out.works}
        for other in reversed(self.running):
            if other is req:
                return None
            if id(other) not in busy and id(other) not in out.progress:
                return other
        return None

    def update(self, out: SchedulerOutput, probe_scores: list = ()) -> None:
        """Commit the step after the model ran: advance computed counts, cache fresh KV,
        choose recomputed tokens from the probes' scores (one per `out.probes`). A request
        whose commit or choice fails is finished with FINISHED_ERROR and added to
        `out.failed`; the others are committed as usual."""
        if self._timed[1]:  # rows timed only where the speculator's cost gate is on
            self.speculator.cost.observe(*self._timed, time.perf_counter() - self._started)
            self._timed = (0, 0)
        completing = {id(e): e for e in out.completing}
        for req, x in out.progress.values():
            mine = [b.entry for b in req.bindings
                    if b is not None and b.computing and id(b.entry) in completing]
            try:
                for entry in mine:  # the chunk entries it finished computing
                    self.chunk_cache.complete(completing.pop(id(entry)))
                # A step with drafts is not a prefill: drafts not kept give their slots back.
                prefilled = not req.num_drafts and (x - req.num_computed_tokens > 1
                                                    or x <= req.layout.question_start)
                req.num_computed_tokens = x
                if self.enable_prefix_caching and prefilled:
                    self.kv.cache(req.kv, req.cacheable_tokens())
            except Exception as e:  # noqa: BLE001 (this request fails, not the step)
                logger.exception("updating request %s failed", req.request_id)
                for entry in mine:  # not completed: its owner abandons it below
                    completing.pop(id(entry), None)
                req.error = f"update failed: {type(e).__name__}: {e}"
                # Its commit stopped midway: none of its KV goes to the prefix cache.
                self.finish(req, RequestStatus.FINISHED_ERROR, keep_prefix=False)
                out.failed.append(req)
        for entry in completing.values():  # every one has an owner in `progress`
            self.chunk_cache.complete(entry)
        for req in self.recompute.update(out, list(probe_scores)):
            if not req.status.finished:
                self.finish(req, RequestStatus.FINISHED_ERROR)
            out.failed.append(req)

    def fail_step(self, out: SchedulerOutput, message: str) -> list[Request]:
        """The model could not run this step: finish every request with work in it, waiting
        for its recomputed tokens to be chosen after it, or bound to reuse a chunk the step
        was completing, with FINISHED_ERROR. Their slots come back; chunk entries they were
        computing are dropped; nothing else changes. Returns the failed requests."""
        failed = out.requests()
        for probe in out.probes:  # a request may have several probes (query+blend): once
            if probe.request not in failed and not probe.request.status.finished:
                failed.append(probe.request)
        # A request bound to reuse an entry this step was completing (its plan stopped
        # before any work of its own) would read KV that was never written.
        completing = {id(e) for e in out.completing}
        for req in self.running + list(self.waiting):
            if req not in failed and any(b is not None and b.entry is not None
                                         and not b.computing and id(b.entry) in completing
                                         for b in req.bindings):
                failed.append(req)
        for req in failed:
            req.error = message
            self.finish(req, RequestStatus.FINISHED_ERROR)
        return failed

    def accept_drafts(self, req: Request, sampled: list[int]) -> list[int]:
        """A drafting request's tokens to append, from the k + 1 samples of its step
        (Speculator.verify); the slots of the drafts not kept come back now."""
        tokens, valid = self.speculator.verify(req, sampled)
        self.kv.truncate(req.kv, valid)
        req.num_computed_tokens = valid
        return tokens

    def finish(self, req: Request, status: RequestStatus, keep_prefix: bool = True) -> None:
        """Take a request out of the queues and give back its slots (its computed prefix
        into the prefix cache unless `keep_prefix` is False: a request whose commit failed
        midway may hold KV nobody should reuse)."""
        Speculator.drop(req)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self._release(req, keep_prefix)
        req.status = status

    def live(self) -> list[Request]:
        return self.running + [r for r in self.waiting if r.kv.slots]

    def _release(self, req: Request, keep_prefix: bool = True) -> None:
        for i, binding in enumerate(req.bindings):
            if binding is not None and binding.entry is not None:
                if binding.computing and not binding.entry.complete:
                    self.chunk_cache.abandon(binding.entry)
                else:
                    self.chunk_cache.unpin(binding.entry)
            req.bindings[i] = None
        keep = self.enable_prefix_caching and keep_prefix
        self.kv.release(req.kv, req.cacheable_tokens() if keep else None)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        out.discard(req)
        Speculator.drop(req)
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.num_recomputed = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def check_invariants(self, out: SchedulerOutput) -> None:
        """What a step may rely on; raises AssertionError. Cost: linear in the step's works
        and the live requests' chunk bindings, not in the pool size."""
        running = {id(r) for r in self.running}
        written: set[int] = set()
        for w in out.works:
            req = w.request
            if id(req) not in running or req.status is not RequestStatus.RUNNING:
                raise AssertionError(f"scheduler: work for request {req.request_id}, which is "
                                     f"not running ({req.status.value})")
            if w.computes_primer:
                if (w.kv_spans != ((0, req.layout.system_len),) or not w.primer
                        or len(w.token_ids) != len(w.primer)):
                    raise AssertionError(f"scheduler: malformed primer work for request "
                                         f"{req.request_id}")
            else:
                _check_flat_work(w)
            for slot in w.write_slots():
                if slot == 0 or slot in written:
                    raise AssertionError(f"scheduler: slot {slot} written twice in one step "
                                         "(or the padding slot)")
                written.add(slot)
        self.recompute.check(out, running)
        for req, x in out.progress.values():
            if id(req) not in running or not req.num_computed_tokens < x <= req.num_tokens:
                raise AssertionError(f"scheduler: progress for request {req.request_id} that "
                                     "is not running or does not advance")
        if self.chunk_cache is None:
            return
        owners: dict[int, int] = {}
        for req in self.live():
            for b in req.bindings:
                if b is not None and b.entry is not None and b.computing:
                    owners[id(b.entry)] = owners.get(id(b.entry), 0) + 1
        for entry in self.chunk_cache.pending_entries():
            if owners.get(id(entry)) != 1:
                raise AssertionError("scheduler: a chunk entry being computed has "
                                     f"{owners.get(id(entry), 0)} live owners")
        for entry in out.completing:
            if entry.complete or not entry.alive or id(entry) not in owners:
                raise AssertionError("scheduler: a completing chunk entry has no live owner")


def _check_flat_work(w: SeqWork) -> None:
    """The invariants of a work over flat tokens of its request (every work but P's)."""
    req = w.request
    q = w.end - w.start
    if req.num_drafts and not (w.sample and w.end - w.logits_from == req.num_drafts + 1):
        raise AssertionError(f"scheduler: request {req.request_id}'s work does not "
                             "return a row for each of its drafts")
    if not (0 <= w.start < w.end <= req.num_tokens and w.kv_spans
            and w.kv_spans[-1][1] == w.end and w.num_kv >= q
            and all(0 <= a <= b <= len(req.kv.slots) for a, b in w.kv_spans)):
        raise AssertionError(f"scheduler: malformed work {w.start}..{w.end} "
                             f"{w.kv_spans} for request {req.request_id}")
    chunk = req.layout.chunk_at(w.start)
    if w.query_index is None and chunk is not None and not (
            req.bindings[chunk] and req.bindings[chunk].computing):
        raise AssertionError("scheduler: a work writes into a chunk it only reuses")


def _work(req: Request, start: int, end: int, spans: tuple[tuple[int, int], ...],
          turns: tuple[tuple[int, int, int], ...],
          damped: tuple[tuple[int, int], ...] = ()) -> SeqWork:
    sample = end == req.num_tokens
    logits_from = end - 1 if sample else end
    if sample and req.num_drafts:  # a row for the pending token and one for each draft
        logits_from = max(start, end - 1 - req.num_drafts)
    if req.num_logit_tokens:
        scored_from = max(start, req.num_prompt_tokens - req.num_logit_tokens)
        if scored_from < min(end, req.num_prompt_tokens):
            logits_from = scored_from
    return SeqWork(
        request=req, start=start, end=end, kv_spans=spans,
        token_ids=req.token_ids[start:end],
        positions=req.layout.positions(start, end),
        sample=sample, logits_from=logits_from, turns=turns, damped=damped,
        damping=req.recompute.damping if damped else 0.0,
    )

"""Continuous batching by token budget (vLLM v1 style), with chunk jobs for RAG requests.

Each step fills `max_num_batched_tokens` with work: running requests first, those decoding
before those still prefilling, then waiting requests in arrival order. A request advances
through its flat tokens (S, C_1..C_n, Q, generated) and a step may give it several works, one
per segment, each an extend in the attention contract's terms:
- system prompt: KV list = S so far (S is matched in the radix cache first);
- chunk C_i: KV list = [S, C_i so far]; skipped altogether when the chunk cache has it;
- question and decode: KV list = [S, C_1..C_n, Q so far].
A backend writes every new token's K/V of a step before it attends, so one step may hold a
whole cold RAG prompt, and a request may use a chunk that another request computes in the
same step. Long segments are split over steps (chunked prefill).

When the general KV region runs out, unlocked prefix-cache entries are evicted; if that is not
enough, the newest running request not yet scheduled this step is preempted: its slots go
back (its computed prefix into the radix cache, its unfinished chunk entries dropped) and it
is recomputed later. Everything here is plain integers and lists.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..cache.chunk_cache import ChunkCache, ChunkEntry
from ..cache.kv_manager import KVCacheManager
from .request import ChunkBinding, Request, RequestStatus


@dataclass(slots=True)
class SeqWork:
    """One sequence's share of a step, in the attention contract's terms."""

    request: Request
    token_ids: list[int]  # the new tokens to compute
    positions: list[int]
    kv_indices: list[int]  # whole KV list; its last len(token_ids) entries are written now
    sample: bool  # the step ends this request's pending tokens: sample the next one


@dataclass(slots=True)
class SchedulerOutput:
    works: list[SeqWork] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Chunk-cache entries whose last tokens are computed by this step.
    completing: list[ChunkEntry] = field(default_factory=list)
    # Flat token count each scheduled request will have computed after this step.
    progress: dict[int, tuple[Request, int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.works


class _Blocked(Exception):
    """Planning for a request stops here (no slots, or a chunk it waits for)."""


class Scheduler:
    def __init__(self, kv: KVCacheManager, chunk_cache: ChunkCache | None, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_prefix_caching: bool) -> None:
        self.kv = kv
        self.chunk_cache = chunk_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decoding + prefilling:
            if budget == 0:
                break
            if req.status is RequestStatus.RUNNING and id(req) not in out.progress:
                budget -= self._plan(req, budget, out, may_preempt=True)

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self.enable_prefix_caching and not req.kv.slots:
                # An ordinary prompt keeps one token to compute: its logits give the next
                # token. A RAG prompt always computes its question, so S may match whole.
                limit = req.layout.system_len if req.layout.is_rag else req.num_tokens - 1
                req.num_computed_tokens = self.kv.match_prefix(req.kv, req.token_ids[:limit])
            used = self._plan(req, budget, out, may_preempt=False)
            stuck = used == 0 and id(req) not in out.progress
            if stuck and not self._waits_for_chunk(req):
                self._release(req)  # no room: try again next step
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            metrics = req.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = time.monotonic()
                metrics.time_in_queue = metrics.first_scheduled_time - metrics.arrival_time
                metrics.num_prefix_cached_tokens = req.kv.num_tree
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= used
        return out

    def _plan(self, req: Request, budget: int, out: SchedulerOutput, may_preempt: bool) -> int:
        """Add `req`'s works for this step within `budget`; returns the tokens used."""
        x = req.num_computed_tokens
        layout = req.layout
        used = 0
        try:
            while x < req.num_tokens and used < budget:
                chunk = layout.chunk_at(x)
                if chunk is None:
                    # System prompt or question/generated: own slots, allocated as computed.
                    end = layout.system_len if x < layout.system_len else req.num_tokens
                    n = min(end - x, budget - used)
                    req.kv.slots.extend(self._alloc(req, n, out, may_preempt))
                    kv_indices = req.kv.slots[:x + n]
                else:
                    start, end = layout.chunk_bounds[chunk]
                    binding = req.bindings[chunk]
                    if binding is None:
                        binding = self._bind_chunk(req, chunk, out, may_preempt)
                    if not binding.computing:
                        x = end  # reused: its KV is ready (or completes earlier this step)
                        continue
                    n = min(end - x, budget - used)
                    kv_indices = req.kv.slots[:layout.system_len] + req.kv.slots[start:x + n]
                    if x + n == end and binding.entry is not None:
                        out.completing.append(binding.entry)
                out.works.append(_work(req, x, x + n, kv_indices))
                x += n
                used += n
        except _Blocked:
            if req in out.preempted:
                return 0
        if x > req.num_computed_tokens:
            out.progress[id(req)] = (req, x)
        return used

    def _bind_chunk(self, req: Request, i: int, out: SchedulerOutput,
                    may_preempt: bool) -> ChunkBinding:
        """Decide where chunk i's KV comes from and append its slots to the request's list."""
        cache = self.chunk_cache
        tokens = req.chunks[i]
        entry = None
        if cache is not None:
            if req.chunk_keys[i] is None:
                req.chunk_keys[i], entry = cache.lookup(req.namespace, req.system, tokens)
                if entry is None:
                    req.metrics.num_chunk_misses += 1
                else:
                    req.metrics.num_chunk_hits += 1
                    req.metrics.num_chunk_cached_tokens += len(tokens)
            else:
                entry = cache.find(req.chunk_keys[i], req.system, tokens)
            if entry is not None:
                if not (entry.complete or entry in out.completing):
                    raise _Blocked  # someone computes it right now: use theirs when done
                binding = ChunkBinding(entry, computing=False)
                cache.pin(entry)
            else:
                entry = cache.reserve(req.chunk_keys[i], req.system, tokens)
                binding = ChunkBinding(entry, computing=True) if entry else None
            if binding is not None:
                start = len(req.kv.slots)
                req.kv.slots.extend(binding.entry.slots)
                req.kv.borrowed.append((start, start + len(tokens)))
                req.bindings[i] = binding
                return binding
        # No chunk cache, or the chunk cannot fit its region: compute it in the general
        # region, uncached.
        req.kv.slots.extend(self._alloc(req, len(tokens), out, may_preempt))
        req.bindings[i] = ChunkBinding(None, computing=True)
        return req.bindings[i]

    def _waits_for_chunk(self, req: Request) -> bool:
        """Whether planning stopped at a chunk that another request is computing."""
        chunk = req.layout.chunk_at(req.num_computed_tokens)
        return (chunk is not None and req.bindings[chunk] is None
                and req.chunk_keys[chunk] is not None)

    def _alloc(self, req: Request, n: int, out: SchedulerOutput, may_preempt: bool) -> list[int]:
        """`n` general-region slots, preempting newer unscheduled requests if allowed."""
        while True:
            slots = self.kv.allocate(n)
            if slots is not None:
                return slots
            victim = self._newest_unscheduled(out, exclude=req) if may_preempt else None
            if victim is None:
                has_work = id(req) in out.progress or any(w.request is req for w in out.works)
                if may_preempt and not has_work:
                    self._preempt(req, out)
                raise _Blocked
            self._preempt(victim, out)

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the model ran; cache fresh KV."""
        for entry in out.completing:
            self.chunk_cache.complete(entry)
        for req, x in out.progress.values():
            prefilled = x - req.num_computed_tokens > 1 or x <= req.layout.question_start
            req.num_computed_tokens = x
            if self.enable_prefix_caching and prefilled:
                self.kv.cache(req.kv, req.cacheable_tokens())

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and give back its slots."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = status

    def live(self) -> list[Request]:
        return self.running + [r for r in self.waiting if r.kv.slots]

    def _release(self, req: Request) -> None:
        for i, binding in enumerate(req.bindings):
            if binding is not None and binding.entry is not None:
                if binding.computing and not binding.entry.complete:
                    self.chunk_cache.abandon(binding.entry)
                else:
                    self.chunk_cache.unpin(binding.entry)
            req.bindings[i] = None
        cacheable = req.cacheable_tokens() if self.enable_prefix_caching else None
        self.kv.release(req.kv, cacheable)

    def _newest_unscheduled(self, out: SchedulerOutput, exclude: Request) -> Request | None:
        busy = {id(w.request) for w in out.works}
        for req in reversed(self.running):
            if req is not exclude and id(req) not in busy and id(req) not in out.progress:
                return req
        return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)


def _work(req: Request, start: int, end: int, kv_indices: list[int]) -> SeqWork:
    return SeqWork(
        request=req,
        token_ids=req.token_ids[start:end],
        positions=req.layout.positions(start, end),
        kv_indices=kv_indices,
        sample=end == req.num_tokens,
    )

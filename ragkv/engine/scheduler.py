"""Continuous batching by token budget (vLLM v1 style).

Each step fills `max_num_batched_tokens` with work: running requests first, those decoding
before those still prefilling, then waiting requests in arrival order. A prompt longer than
what is left of the budget is prefilled in pieces over several steps (chunked prefill). When
the general KV region runs out, unlocked prefix-cache entries are evicted; if that is not
enough, the newest running request is preempted: its slots go back (its computed KV into the
prefix cache) and it is recomputed later. Everything here is plain integers and lists.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..cache.kv_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass(slots=True)
class SeqWork:
    """One sequence's share of a step, in the attention contract's terms."""

    request: Request
    token_ids: list[int]  # the new tokens to compute
    positions: list[int]
    kv_indices: list[int]  # whole KV list; its last len(token_ids) entries are written now
    sample: bool  # the step ends this sequence's pending tokens: sample the next one


@dataclass(slots=True)
class SchedulerOutput:
    works: list[SeqWork] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(w.token_ids) for w in self.works)

    @property
    def empty(self) -> bool:
        return not self.works


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool) -> None:
        self.kv = kv
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
        scheduled: set[int] = set()
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decoding + prefilling:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.extend(req.kv, n):
                victim = self._newest_unscheduled(scheduled, exclude=req)
                self._preempt(victim or req, out)
                if victim is None:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            scheduled.add(id(req))
            out.works.append(self._work(req, n))
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self.enable_prefix_caching and not req.kv.slots:
                # Keep at least one token to compute: its logits give the next token.
                req.num_computed_tokens = self.kv.match_prefix(req.kv, req.token_ids[:-1])
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.extend(req.kv, n):
                self.kv.release(req.kv)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            metrics = req.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = time.monotonic()
                metrics.time_in_queue = metrics.first_scheduled_time - metrics.arrival_time
                req.num_cached_tokens = req.num_computed_tokens
                metrics.num_prefix_cached_tokens = req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.add(id(req))
            out.works.append(self._work(req, n))
            budget -= n
        return out

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the model ran; cache fresh prefill KV in the tree."""
        for work in out.works:
            req = work.request
            req.num_computed_tokens += len(work.token_ids)
            if self.enable_prefix_caching and len(work.token_ids) > 1:
                self.kv.cache(req.kv, req.cacheable_tokens())

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and give back its slots."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        cacheable = req.cacheable_tokens() if self.enable_prefix_caching else None
        self.kv.release(req.kv, cacheable)
        req.status = status

    def live_kv(self) -> list:
        return [r.kv for r in self.running] + [r.kv for r in self.waiting if r.kv.slots]

    def _work(self, req: Request, n: int) -> SeqWork:
        start = req.num_computed_tokens
        end = start + n
        return SeqWork(
            request=req,
            token_ids=req.token_ids[start:end],
            positions=req.positions(start, end),
            kv_indices=req.kv.slots[:end],
            sample=end == req.num_tokens,
        )

    def _newest_unscheduled(self, scheduled: set[int], exclude: Request) -> Request | None:
        for req in reversed(self.running):
            if req is not exclude and id(req) not in scheduled:
                return req
        return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        cacheable = req.cacheable_tokens() if self.enable_prefix_caching else None
        self.kv.release(req.kv, cacheable)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

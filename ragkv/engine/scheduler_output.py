"""What a scheduling step hands the model runner and takes back: the plan of one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cache.chunk_cache import ChunkEntry
from ..cache.kv_manager import SeqKV
from ..recompute.probe import ProbeWork
from .request import Request


@dataclass(slots=True)
class SeqWork:
    """One sequence's share of a step, in the attention contract's terms: flat tokens
    [start, end) of `request` are computed now; the KV list is the concatenation of the
    `kv_spans` ranges of `request.kv.slots`, the last ending at `end` (and the chunk primer's
    slots after the first range, for a primed chunk: `primer`)."""

    request: Request
    start: int
    end: int
    kv_spans: tuple[tuple[int, int], ...]
    token_ids: list[int]
    positions: list[int]
    sample: bool  # the step ends this request's pending tokens: sample the next one
    # Flat index of the first token whose logits the step returns (`end` for none): the
    # sampled token's, preceded by any scored prompt tokens (`Request.num_scored_tokens`).
    logits_from: int = 0
    # (start, end, delta) ranges of the KV list whose keys attention sees turned forward by
    # `delta` positions (cached chunks re-positioned; model/reposition.py).
    turns: tuple[tuple[int, int, int], ...] = ()
    # Recomputed chunk tokens (recompute/): the KV-list entries the tokens are, which
    # are not the last ones, and their keys' RoPE positions (the chunk's base positions, where
    # the cached keys around them sit; `positions` are their places in the prompt).
    query_index: tuple[int, ...] | None = None
    key_positions: list[int] | None = None
    # (start, end) ranges of the KV list the new tokens read with their attention logits
    # lowered by `damping` (stale chunk tokens: Request.stale); () for none.
    damped: tuple[tuple[int, int], ...] = ()
    damping: float = 0.0
    # A primed chunk's (inputs/layout.py): the slots of the chunk primer P's KV, which the KV
    # list holds after its first range (S). A work that computes P itself
    # (`computes_primer`: its tokens are P's, in no flat range, start == end) has the one
    # range S and writes all of these slots (P is computed whole).
    primer: tuple[int, ...] = ()
    computes_primer: bool = False

    @property
    def kv(self) -> SeqKV:
        return self.request.kv

    @property
    def prompt_len(self) -> int:
        """The request's prompt tokens (packed weights route a short prompt's rows as
        generated ones: model/runner.py)."""
        return self.request.num_prompt_tokens

    @property
    def prompt_rows(self) -> int:
        """The prompt rows the request computes where this work's tokens are (packed weights
        run a few rows on the int4 kernel: model/runner.py). A RAG request's question, and
        once a recomputing request's probe chose its tokens those tokens too, is all it
        computes of its prompt after the chunks, cold or warm: its own rows. Anything before
        (S, the chunks: cache entries other requests read) counts the whole prompt, so it is
        computed as a cold prefill of the same prompt computes it."""
        req = self.request
        question = req.num_prompt_tokens - req.layout.question_start
        if req.selected is not None and (self.query_index is not None
                                         or self.start >= req.layout.question_start):
            return len(req.selected) + question
        if req.layout.is_rag and self.start >= req.layout.question_start:
            return question
        return req.num_prompt_tokens

    @property
    def num_kv(self) -> int:
        return sum(b - a for a, b in self.kv_spans) + len(self.primer)

    def write_slots(self) -> list[int]:
        """The slots the work's new K/V go to."""
        if self.computes_primer:
            return list(self.primer)
        slots = self.request.kv.slots
        if self.query_index is not None:
            return [slots[x] for x in self.query_index]
        return slots[self.end - len(self.token_ids):self.end]


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: the works the runner computes, and what the scheduler's `update`
    commits once they ran."""

    works: list[SeqWork] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Chunk-cache entries whose last tokens are computed by this step.
    completing: list[ChunkEntry] = field(default_factory=list)
    # Flat token count each scheduled request will have computed after this step.
    progress: dict[int, tuple[Request, int]] = field(default_factory=dict)
    # Requests that failed while being planned (already finished with FINISHED_ERROR).
    failed: list[Request] = field(default_factory=list)
    # Probes the runner executes after this step's forward (which completes their requests'
    # chunks): their scores choose the recomputed tokens (recompute/probe.py); and the count
    # of selected tokens each request will have computed after this step.
    probes: list[ProbeWork] = field(default_factory=list)
    recomputed: dict[int, tuple[Request, int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.works and not self.probes

    def requests(self) -> list[Request]:
        """The requests with work in this step, each once."""
        return list({id(w.request): w.request for w in self.works}.values())

    def discard(self, req: Request) -> None:
        """Forget everything `req` was given this step."""
        if any(w.request is req for w in self.works):
            self.works = [w for w in self.works if w.request is not req]
        owned = {id(b.entry) for b in req.bindings
                 if b is not None and b.entry is not None and b.computing}
        if owned:
            self.completing = [e for e in self.completing if id(e) not in owned]
        self.progress.pop(id(req), None)
        self.recomputed.pop(id(req), None)
        if any(p.request is req for p in self.probes):
            self.probes = [p for p in self.probes if p.request is not req]

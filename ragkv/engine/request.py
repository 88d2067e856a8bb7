"""Request state. No phases: a request has tokens, and `num_computed_tokens` of them have KV.
Each step computes some of the rest; when all are computed the next token is sampled.

A RAG request's tokens are laid out flat as S + C_1 + ... + C_n + Q + generated, and its
`PromptLayout` says where each segment lies, which RoPE positions its tokens take, and how
far each chunk's cached keys must be rotated to sit where the request places it (DESIGN §1).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..cache.chunk_cache import ChunkEntry
from ..cache.chunk_key import ChunkKey
from ..cache.kv_manager import SeqKV
from ..outputs import Logprob, RequestMetrics
from ..sampling.detokenizer import IncrementalDetokenizer
from ..sampling.params import SamplingParams

if TYPE_CHECKING:
    from ..structured.token_grammar import GrammarMatcher
    from .recompute import RecomputeSpec


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # serving this request failed; `Request.error` says why

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(frozen=True, slots=True)
class PromptLayout:
    """Flat token offsets of a prompt's segments and the positions of its tokens. An ordinary
    prompt has no chunks and its question segment is the whole prompt.

    A chunk's KV is always computed the same way, whatever the request does with it: at its
    *base* positions, after S (`isolated`: base s, its KV list S + itself) or alone
    (`standalone`: base 0, its KV list itself). That is what the chunk cache stores. The
    request places chunk i at its *target* positions: s for every chunk (`shared`) or where
    the chunk lies in the flat prompt (`sequential`); the question and generated tokens follow
    the longest chunk (`shared`) or the last one (`sequential`). Whoever attends to chunk i
    later sees its keys rotated by `chunk_deltas[i]` = target - base (`rotations`)."""

    system_len: int
    chunk_bounds: tuple[tuple[int, int], ...]  # [start, end) of each chunk
    question_start: int
    max_chunk_len: int
    sees_system: bool = True  # chunk_attention == "isolated"
    chunk_deltas: tuple[int, ...] = ()
    # (start, end, delta) of every chunk whose keys are rotated, in flat token indices (which
    # are also KV-list indices for the question and generated tokens).
    rotations: tuple[tuple[int, int, int], ...] = ()
    question_offset: int = 0  # RoPE position minus flat index, for Q and generated tokens

    @classmethod
    def build(cls, system_len: int, chunk_lens: list[int], position_strategy: str = "shared",
              chunk_attention: str = "isolated") -> PromptLayout:
        bounds, start = [], system_len
        for n in chunk_lens:
            bounds.append((start, start + n))
            start += n
        sees_system = chunk_attention == "isolated"
        base = system_len if sees_system else 0
        sequential = position_strategy == "sequential"
        deltas = tuple((a if sequential else system_len) - base for a, _ in bounds)
        longest = max(chunk_lens, default=0)
        return cls(
            system_len=system_len, chunk_bounds=tuple(bounds), question_start=start,
            max_chunk_len=longest, sees_system=sees_system, chunk_deltas=deltas,
            rotations=tuple((a, b, d) for (a, b), d in zip(bounds, deltas, strict=True) if d),
            question_offset=0 if sequential or not bounds else system_len + longest - start,
        )

    @property
    def is_rag(self) -> bool:
        return bool(self.chunk_bounds)

    def chunk_at(self, x: int) -> int | None:
        """Index of the chunk holding flat token x, if any."""
        if not self.system_len <= x < self.question_start:
            return None
        for i, (start, end) in enumerate(self.chunk_bounds):
            if start <= x < end:
                return i
        return None

    def chunk_kv_spans(self, chunk: int, end: int) -> tuple[tuple[int, int], ...]:
        """The KV list (ranges of flat tokens) of chunk tokens computed up to flat `end`."""
        start = self.chunk_bounds[chunk][0]
        if self.sees_system and self.system_len:
            return ((0, self.system_len), (start, end))
        return ((start, end),)

    def chunk_positions(self, xs: list[int]) -> tuple[list[int], list[int]]:
        """Base positions (where the cache computed their keys) and target positions (where
        the request places them) of the chunk tokens `xs`, ascending flat indices."""
        base_of = self.system_len if self.sees_system else 0
        base, target = [], []
        i = 0
        for x in xs:
            while self.chunk_bounds[i][1] <= x:
                i += 1
            b = base_of + x - self.chunk_bounds[i][0]
            base.append(b)
            target.append(b + self.chunk_deltas[i])
        return base, target

    def positions(self, start: int, end: int) -> list[int]:
        """RoPE positions of flat tokens [start, end), which lie in one segment; chunk tokens
        at their base positions (where their KV is computed)."""
        s = self.system_len
        if end <= s:
            return list(range(start, end))
        if start >= self.question_start:
            offset = self.question_offset
            return list(range(start + offset, end + offset))
        chunk_start = self.chunk_bounds[self.chunk_at(start)][0]
        base = s if self.sees_system else 0
        return list(range(base + start - chunk_start, base + end - chunk_start))


@dataclass(slots=True)
class ChunkBinding:
    """Where one chunk occurrence's KV comes from: a chunk-cache entry it reuses or computes
    (`entry`), or its own general-region slots (entry None, never cached)."""

    entry: ChunkEntry | None
    computing: bool  # this request computes the KV (otherwise it reuses a finished entry)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    parent_id: str
    index: int  # which of the parent's n samples this is
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # of the sampler's random stream (a 64-bit pattern as an int64)
    max_tokens: int  # effective limit on generated tokens (max_tokens and max_model_len)
    stop_ids: frozenset[int]  # token ids that end generation (EOS unless ignored, stop ids)
    metrics: RequestMetrics
    layout: PromptLayout
    # Each chunk's key in the chunk cache (none without one), made once per request.
    chunk_keys: tuple[ChunkKey, ...] = ()
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0
    kv: SeqKV = field(default_factory=SeqKV)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    bindings: list[ChunkBinding | None] = field(default_factory=list)
    # Whether chunk i was looked up (counted) already: later bindings (after a rollback or a
    # preemption) re-check the cache uncounted.
    looked_up: list[bool] = field(default_factory=list)
    detokenizer: IncrementalDetokenizer | None = None
    error: str | None = None  # why the request failed (status FINISHED_ERROR)
    # The last `num_scored_tokens` prompt tokens keep their next-token log-probabilities
    # (flat index -> [vocab] float32 on the CPU): teacher-forced scoring for `ragkv eval`.
    num_scored_tokens: int = 0
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    # Selective recompute (engine/recompute.py): the request's `RecomputeSpec` (None: off),
    # the chunk tokens it recomputes (flat indices, ascending; None until chosen, kept over
    # preemption: the choice depends only on the prompt) and how many of them have fresh KV.
    recompute: RecomputeSpec | None = None
    selected: tuple[int, ...] | None = None
    num_recomputed: int = 0
    # Penalties (sampling.py): how often each token has been generated, counted as tokens
    # are appended (None without penalties), and the prompt's distinct token ids on the
    # device for a repetition penalty, sent once.
    output_counts: Counter[int] | None = None
    prompt_ids_on_device: torch.Tensor | None = None
    # Structured outputs: where this sample is in its grammar (None without one).
    matcher: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
            self.cumulative_logprob = 0.0
        if self.params.counts_tokens:
            self.output_counts = Counter(self.output_token_ids)
        self.bindings = [None] * len(self.layout.chunk_bounds)
        self.looked_up = [False] * len(self.chunk_keys)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose KV was reused: prefix-cache hits plus chunk-cache hits."""
        return self.metrics.num_prefix_cached_tokens + self.metrics.num_chunk_cached_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def cacheable_tokens(self) -> list[int]:
        """The computed tokens whose KV may enter the prefix cache under their token ids:
        all of an ordinary request's, only the system prompt of a RAG request (what follows
        it has chunk-isolated semantics, which a token-keyed tree cannot express)."""
        limit = self.layout.system_len if self.layout.is_rag else self.num_computed_tokens
        return self.token_ids[:min(self.num_computed_tokens, limit)]

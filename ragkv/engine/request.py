"""Request state. No phases: a request has tokens, and `num_computed_tokens` of them have KV.
Each step computes some of the rest; when all are computed the next token is sampled.

A RAG request's tokens are laid out flat as S + C_1 + ... + C_n + Q + generated, and its
`PromptLayout` says where each segment lies and which RoPE positions its tokens take
(DESIGN §1: chunks share the range after S; Q starts after the longest chunk).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..cache.chunk_cache import ChunkEntry
from ..cache.kv_manager import SeqKV
from ..detokenizer import IncrementalDetokenizer
from ..outputs import Logprob, RequestMetrics
from ..sampling import SamplingParams


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
    """Flat token offsets of a prompt's segments. An ordinary prompt has no chunks and its
    question segment is the whole prompt."""

    system_len: int
    chunk_bounds: tuple[tuple[int, int], ...]  # [start, end) of each chunk
    question_start: int
    max_chunk_len: int

    @classmethod
    def build(cls, system_len: int, chunk_lens: list[int]) -> PromptLayout:
        bounds, start = [], system_len
        for n in chunk_lens:
            bounds.append((start, start + n))
            start += n
        return cls(system_len, tuple(bounds), start, max(chunk_lens, default=0))

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

    def positions(self, start: int, end: int) -> list[int]:
        """RoPE positions of flat tokens [start, end), which lie in one segment."""
        s = self.system_len
        if end <= s:
            return list(range(start, end))
        if start >= self.question_start:
            offset = s + self.max_chunk_len - self.question_start
            return list(range(start + offset, end + offset))
        chunk_start = self.chunk_bounds[self.chunk_at(start)][0]
        return list(range(s + start - chunk_start, s + end - chunk_start))


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
    generator: torch.Generator
    max_tokens: int  # effective limit on generated tokens (max_tokens and max_model_len)
    stop_ids: frozenset[int]  # token ids that end generation (EOS unless ignored, stop ids)
    metrics: RequestMetrics
    layout: PromptLayout
    system: tuple[int, ...] = ()  # S tokens and each chunk's tokens, as chunk-cache keys
    chunks: tuple[tuple[int, ...], ...] = ()
    namespace: str = ""  # chunk-cache namespace (model, dtype, strategy, cache salt)
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0
    kv: SeqKV = field(default_factory=SeqKV)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    bindings: list[ChunkBinding | None] = field(default_factory=list)
    chunk_keys: list[bytes | None] = field(default_factory=list)  # set on first lookup
    detokenizer: IncrementalDetokenizer | None = None
    error: str | None = None  # why the request failed (status FINISHED_ERROR)
    # The last `num_scored_tokens` prompt tokens keep their next-token log-probabilities
    # (flat index -> [vocab] float32 on the CPU): teacher-forced scoring for `ragkv eval`.
    num_scored_tokens: int = 0
    scores: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
            self.cumulative_logprob = 0.0
        self.bindings = [None] * len(self.chunks)
        self.chunk_keys = [None] * len(self.chunks)

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

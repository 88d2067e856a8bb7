"""Request state. No phases: a request has tokens, and `num_computed_tokens` of them have KV.
Each step computes some of the rest; when all are computed the next token is sampled.

A RAG request's tokens are laid out flat as S + C_1 + ... + C_n + Q + generated; its
`PromptLayout` (inputs/layout.py) says where each segment lies and which positions its tokens
take.
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
from ..inputs.layout import PromptLayout
from ..outputs import Logprob, RequestMetrics
from ..recompute.selection import RecomputeSpec
from ..sampling.detokenizer import IncrementalDetokenizer
from ..sampling.params import SamplingParams
from ..structured.token_grammar import GrammarMatcher

if TYPE_CHECKING:
    from .speculative import NgramIndex


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
    # A primed layout's primer P (inputs/primer.py): its tokens, and its key as a chunk after
    # S (None without a chunk cache). Its KV is read by the later chunks this request
    # computes; its binding follows the chunks' in `bindings`.
    primer: tuple[int, ...] = ()
    primer_key: ChunkKey | None = None
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
    bad_request: bool = False  # its own input made it fail (RequestOutput.bad_request)
    # The last `num_scored_tokens` prompt tokens keep their next-token log-probabilities
    # (flat index -> [vocab] float32 on the CPU): teacher-forced scoring for `ragkv eval`.
    num_scored_tokens: int = 0
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: the last `num_prompt_logprob_tokens` prompt tokens keep
    # the entry (the top-k and the actual token) of the prompt token after each, by that
    # token's flat index.
    num_prompt_logprob_tokens: int = 0
    prompt_logprobs: dict[int, dict[int, Logprob]] = field(default_factory=dict)
    # Selective recompute (recompute/): the request's `RecomputeSpec` (None: off),
    # the chunk tokens it recomputes (flat indices, ascending; None until chosen, kept over
    # preemption: the choice depends only on the prompt) and how many of them have fresh KV;
    # the stale chunk tokens the question and generated tokens read damped (ranges of flat
    # indices, RecomputeSpec.stale; set with `selected`).
    recompute: RecomputeSpec | None = None
    selected: tuple[int, ...] | None = None
    num_recomputed: int = 0
    stale: tuple[tuple[int, int], ...] = ()
    # Penalties (sampling/penalties.py): how often each token has been generated, counted as tokens
    # are appended (None without penalties), and the prompt's distinct token ids on the
    # device for a repetition penalty, sent once.
    output_counts: Counter[int] | None = None
    prompt_ids_on_device: torch.Tensor | None = None
    # Structured outputs: where this sample is in its grammar (None without one).
    matcher: GrammarMatcher | None = None
    # Speculative decoding (engine/speculative.py): drafts appended to `token_ids` for the
    # step being run (0 outside a step), the request's n-gram index, and its back-off.
    num_drafts: int = 0
    ngram: NgramIndex | None = None
    spec_misses: int = 0  # drafting steps in a row that kept no draft
    spec_backoff: int = 0  # decode steps left without drafts
    spec_length: int = 0  # the next draft's length (0: num_speculative_tokens)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
            self.cumulative_logprob = 0.0
        if self.params.counts_tokens:
            self.output_counts = Counter(self.output_token_ids)
        self.bindings = [None] * (len(self.layout.chunk_bounds) + bool(self.primer))
        self.looked_up = [False] * len(self.chunk_keys)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose KV was reused: prefix-cache hits plus chunk-cache hits."""
        return self.metrics.num_prefix_cached_tokens + self.metrics.num_chunk_cached_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_logit_tokens(self) -> int:
        """The last prompt tokens whose next-token logits are kept (scores, prompt logprobs):
        computed, never taken from the prefix cache."""
        return max(self.num_scored_tokens, self.num_prompt_logprob_tokens)

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

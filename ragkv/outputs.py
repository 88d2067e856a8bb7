"""Result objects returned to users, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """One entry of a per-token logprobs dict (token id -> Logprob)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps in seconds (time.monotonic) and cache accounting for one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    num_prefix_cached_tokens: int = 0
    num_chunk_hits: int = 0
    num_chunk_misses: int = 0
    num_chunk_cached_tokens: int = 0
    # Chunk tokens whose keys attention sees rotated to positions other than their cached
    # ones (sequential positions, standalone chunks).
    num_repositioned_tokens: int = 0
    # Chunk tokens recomputed with full attention (selective recompute) instead of reused.
    num_recomputed_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding (engine/speculative.py): steps that verified drafts, the drafts
    # they verified, and how many of those were kept.
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: one {token id: Logprob} per prompt token (the actual
    # token and the k most likely), None where there is none (the first token; in a RAG
    # prompt, up to the question's first).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Set when serving the request failed (its completions end with finish_reason "error");
    # the message says why. Other requests are not affected. `bad_request`: the request's own
    # input caused it (a structured-output schema over the grammar budget), a client error.
    error: str | None = None
    bad_request: bool = False
    # With `Engine.add_request(..., score_tokens=m)`: log-probabilities [m, vocab] (float32,
    # CPU) of the token after each of the last m prompt tokens; row m-1 is the distribution
    # the first generated token was drawn from.
    score_logprobs: object | None = None

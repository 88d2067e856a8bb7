"""Request state. No phases: a request has tokens, and `num_computed_tokens` of them have KV.
Each step computes some of the rest; when all are computed the next token is sampled."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..cache.kv_manager import SeqKV
from ..outputs import Logprob, RequestMetrics
from ..sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


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
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0
    kv: SeqKV = field(default_factory=SeqKV)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
            self.cumulative_logprob = 0.0

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

    def positions(self, start: int, end: int) -> list[int]:
        """RoPE positions of tokens [start, end): an ordinary prompt counts from 0."""
        return list(range(start, end))

    def cacheable_tokens(self) -> list[int]:
        """The computed tokens whose KV may enter the prefix cache under their token ids."""
        return self.token_ids[:self.num_computed_tokens]

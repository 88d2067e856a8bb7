"""A token-level RAG workload: a corpus of documents, requests drawing documents with Zipf
popularity in random order, one system prompt, fresh questions. Token ids, so it runs on any
model, including the built-in ones."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass


def add_bench_shape_args(parser, repeats: int = 5) -> None:
    """The flags of the benchmark scripts' one RAG prompt shape (64 + 4 x 512 + 32 by default
    on builtin:small) and how often each timing repeats."""
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--num-docs", type=int, default=4)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=repeats)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    num_docs: int = 16
    doc_tokens: int = 512
    docs_per_request: int = 4
    zipf: float = 1.1
    system_tokens: int = 64
    question_tokens: int = 32
    output_tokens: int = 8
    num_requests: int = 40
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_docs", "doc_tokens", "docs_per_request", "question_tokens",
                     "output_tokens", "num_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.system_tokens < 0:
            raise ValueError("system_tokens must be at least 0")
        if self.docs_per_request > self.num_docs:
            raise ValueError(f"docs_per_request={self.docs_per_request} exceeds "
                             f"num_docs={self.num_docs}")
        if self.zipf < 0:
            raise ValueError("zipf must be >= 0 (0 is uniform)")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    system: list[int]
    doc_ids: list[int]  # which corpus documents, in prompt order
    chunks: list[list[int]]
    question: list[int]

    @property
    def token_ids(self) -> list[int]:
        """The flat prompt: system + documents + question, as an ordinary prompt."""
        out = list(self.system)
        for chunk in self.chunks:
            out.extend(chunk)
        return out + self.question


def make_workload(config: WorkloadConfig, vocab_size: int,
                  low_token: int = 10) -> list[BenchRequest]:
    """Deterministic for a given config and vocabulary. Token ids below `low_token` (special
    tokens in most vocabularies) are never drawn."""
    rng = random.Random(config.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low_token, vocab_size) for _ in range(n)]

    system = tokens(config.system_tokens)
    corpus = [tokens(config.doc_tokens) for _ in range(config.num_docs)]
    weights = [1.0 / (rank + 1) ** config.zipf for rank in range(config.num_docs)]
    requests = []
    for _ in range(config.num_requests):
        picked: list[int] = []
        while len(picked) < config.docs_per_request:
            doc = rng.choices(range(config.num_docs), weights=weights)[0]
            if doc not in picked:
                picked.append(doc)
        rng.shuffle(picked)
        requests.append(BenchRequest(system, picked, [corpus[d] for d in picked],
                                     tokens(config.question_tokens)))
    return requests

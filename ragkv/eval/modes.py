"""How `ragkv eval` lays out one question's prompt in each mode: one registry, so a new
attention or position mode (sequential positions, selective recompute) is one entry.
Selective recompute is a family of modes named `METHOD@RATIO` (e.g. `blend@0.15`,
`sink+query@0.1`): the sequential layout with that method recomputing that fraction.

Every mode gets the same tokens: the chat prompt split into S, chunks and Q by
`Engine.process_chat` (documents after the system message). Modes differ only in what the
model computes over them, so any difference in the answers is the cost of that mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import check_recompute
from ..inputs.prompt import ChunkedPrompt, RAGPrompt


@dataclass(frozen=True, slots=True)
class EvalMode:
    """`build(prompt, tail)` is the engine prompt of `prompt` with `tail` tokens appended to
    the question (the gold answer, when scoring it teacher-forced)."""

    name: str
    description: str
    build: Callable[[ChunkedPrompt, list[int]], object]


def _full(p: ChunkedPrompt, tail: list[int]) -> object:
    flat = list(p.system) + [t for c in p.chunks for t in c] + list(p.question) + tail
    return {"prompt_token_ids": flat}


def _layout(position_strategy: str, chunk_attention: str, **recompute: object
            ) -> Callable[[ChunkedPrompt, list[int]], object]:
    def build(p: ChunkedPrompt, tail: list[int]) -> object:
        return RAGPrompt(system=list(p.system), chunks=[list(c) for c in p.chunks],
                         question=list(p.question) + tail, cache_salt=p.cache_salt,
                         position_strategy=position_strategy, chunk_attention=chunk_attention,
                         **recompute)

    return build


def recompute_mode(name: str) -> EvalMode:
    """The mode `METHOD@RATIO`: sequential-isolated chunk reuse recomputing RATIO of the chunk
    tokens chosen by METHOD (config.RECOMPUTE_METHODS). Scoring appends the gold answer to the
    question; the engine's query probe leaves scored tokens out, so the choice is the same as
    for the generation."""
    method, _, ratio_text = name.partition("@")
    try:
        ratio = float(ratio_text)
    except ValueError:
        raise ValueError(f"eval mode {name!r}: the ratio after '@' must be a number") from None
    check_recompute(method, ratio, None)
    return EvalMode(name, f"sequential-isolated reuse, recompute={method} of "
                          f"{ratio:g} of the chunk tokens",
                    _layout("sequential", "isolated", recompute=method, recompute_ratio=ratio))


MODES: dict[str, EvalMode] = {}


def register_mode(mode: EvalMode) -> None:
    MODES[mode.name] = mode


def get_mode(name: str) -> EvalMode:
    mode = MODES.get(name)
    if mode is None and "@" in name:
        return recompute_mode(name)
    if mode is None:
        raise ValueError(f"unknown eval mode {name!r}; known: {', '.join(MODES)}, or "
                         "METHOD@RATIO for selective recompute (e.g. blend@0.15)")
    return mode


# The reference every other mode is compared with.
REFERENCE = "full"

register_mode(EvalMode("full", "an ordinary prompt: documents concatenated, causal attention, "
                               "positions 0..N-1 (full prefill)", _full))
register_mode(EvalMode("chunk", "chunk-cache reuse: each document sees S and itself, shared "
                                "positions after S (positions=shared, attention=isolated)",
                       _layout("shared", "isolated")))
register_mode(EvalMode("sequential", "chunk-cache reuse with documents at their places in the "
                                     "prompt (keys rotated), each seeing S and itself "
                                     "(positions=sequential, attention=isolated)",
                       _layout("sequential", "isolated")))
register_mode(EvalMode("standalone", "chunk-cache reuse, documents at their places in the "
                                     "prompt, each seeing only itself, so one cached copy "
                                     "serves every system prompt (positions=sequential, "
                                     "attention=standalone)",
                       _layout("sequential", "standalone")))

"""A step's works as the sequences attention sees: plain-field works (`StepWork`), and a
recomputing request's last step joined into one sequence (`join_recomputed`), which the
runner's eager step and the extend graphs (`backends/cuda_graph.graph_step`) both take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cache.kv_manager import SeqKV
from .reposition import Turn

if TYPE_CHECKING:
    from .runner import Work


@dataclass(slots=True)
class StepWork:
    """A `Work` as plain fields: as a tensor-parallel worker receives it (the sequence
    reduced to its row), or a recomputing request's last step joined into one sequence
    (`join_recomputed`)."""

    kv: SeqKV
    token_ids: list[int]
    positions: list[int]
    kv_spans: tuple[tuple[int, int], ...]
    sample: bool
    end: int
    logits_from: int
    turns: tuple[Turn, ...]
    query_index: tuple[int, ...] | None
    key_positions: list[int] | None
    prompt_len: int
    prompt_rows: int
    damped: tuple[tuple[int, int], ...]
    damping: float
    primer: tuple[int, ...] = ()


def clip_turns(turns: tuple[Turn, ...], k: int) -> tuple[Turn, ...]:
    """`turns` as a list of the first k of the same entries has them."""
    return tuple((a, min(b, k), d) for a, b, d in turns if a < k)


def join_recomputed(works: Sequence[Work]) -> list[tuple[int, Work]]:
    """The step's sequences, each with the index of the work whose logits it returns. A
    recompute work (the chunk tokens a probe chose, scattered among cached entries; it
    samples nothing) followed by its request's question over a longer list of the same
    entries becomes one sequence: the question's queries are the last entries, the
    recomputed ones sit before them (cached entries may sit between), each seeing the
    entries up to its own, and the question's turns, cut at the recompute work's list,
    are the recompute work's. Attention then gathers and turns the list once and attends
    to both in one call: on the torch backend a separate question paid its own gather and
    turned its queries per range (docs/benchmarks.md, "One sequence for the recomputed
    tokens and the question"). Each query's arithmetic is unchanged up to float rounding."""
    units: list[tuple[int, Work]] = []
    # By slot-table row, not by object: a tensor-parallel worker gets each work with a
    # sequence of its own, and must join as rank 0 does.
    i = 0
    while i < len(works):
        r = works[i]
        w = works[i + 1] if i + 1 < len(works) else None
        n = 0 if w is None else len(w.token_ids)
        if (w is None or r.kv.row != w.kv.row or r.query_index is None or r.sample
                or r.logits_from != r.end or w.query_index is not None
                or w.key_positions is not None or r.primer or w.primer
                or r.kv_spans != ((0, r.end),) or w.kv_spans != ((0, w.end),)
                or r.end > w.end - n or r.turns != clip_turns(w.turns, r.end)
                or r.prompt_rows != w.prompt_rows or r.damped != w.damped
                or (r.damped and r.damping != w.damping)):
            units.append((i, r))
            i += 1
            continue
        units.append((i + 1, StepWork(
            kv=w.kv, token_ids=r.token_ids + w.token_ids, positions=r.positions + w.positions,
            kv_spans=w.kv_spans, sample=w.sample, end=w.end, logits_from=w.logits_from,
            turns=w.turns, query_index=r.query_index + tuple(range(w.end - n, w.end)),
            key_positions=(r.key_positions or r.positions) + w.positions,
            prompt_len=w.prompt_len, prompt_rows=w.prompt_rows, damped=w.damped,
            damping=w.damping)))
        i += 2
    return units

"""Where a cached key is turned to a new position: the one home of re-positioned keys.

A chunk's cached keys carry the RoPE rotation of the positions they were computed at (the
chunk's base positions). A request that places the chunk elsewhere (sequential positions, a
standalone chunk) sees those keys *turned forward* by `delta` = target - base positions: a key
rotated for position p is seen as the key rotated for p + delta (RoPE angles are linear in
the position, so R(p + delta) = R(delta) R(p)). One name for this everywhere: a **turn** is a
range of a sequence's KV list, (start, end, delta) where the request plans it and (start, end,
row) once the step's `TurnTable` has given each distinct delta a row. The pool is never
written, so a chunk's slots stay one copy shared by every request, whatever position each
gives it.

One sign convention: a `TurnTable`'s cos/sin turn a key *forward* by its row's delta. RoPE
makes a score depend only on the rotation of q against k, so a backend may turn the query
*back* instead, (R(-d) q) . k = q . (R(d) k): `for_queries()` gives those tables (the same
cosines, negated sines), which is cheaper when a sequence has a few queries over many keys.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# (start, end, delta) in planning, (start, end, row of the step's TurnTable) in a step.
Turn = tuple[int, int, int]


class TurnTable:
    """The turns of one step: each distinct delta a row, with the float32 cos/sin ([rows,
    head_dim]) that turn a key forward by it."""

    __slots__ = ("rows", "cos", "sin", "_back")

    def __init__(self, rows: dict[int, int], cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.rows = rows  # delta -> row
        self.cos = cos
        self.sin = sin
        self._back: torch.Tensor | None = None

    @classmethod
    def build(cls, rotary, deltas: Iterable[int]) -> TurnTable:
        """Rows for `deltas` in first-seen order (`rotary`: the model's RotaryEmbedding)."""
        rows: dict[int, int] = {}
        for delta in deltas:
            rows.setdefault(delta, len(rows))
        if not rows:  # no turn: nothing to compute (dynamic RoPE refuses any rotation)
            empty = torch.empty(0, rotary.head_dim, device=rotary.inv_freq.device)
            return cls(rows, empty, empty)
        cos, sin = rotary.rotation(list(rows))
        return cls(rows, cos, sin)

    def __len__(self) -> int:
        return len(self.rows)

    def by_row(self, turns: Iterable[Turn]) -> tuple[Turn, ...]:
        """(start, end, delta) turns as (start, end, row) of this table."""
        return tuple((a, b, self.rows[d]) for a, b, d in turns)

    def deltas(self, device: torch.device) -> torch.Tensor:
        """[rows + 1] int64: each row's delta, then 0 (index -1: no turn)."""
        return torch.tensor([*self.rows, 0], dtype=torch.int64, device=device)

    def for_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin turning a query back by each row's delta."""
        if self._back is None:
            self._back = -self.sin
        return self.cos, self._back

    def per_entry(self, turns: tuple[Turn, ...], num_entries: int
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin [num_entries, head_dim] turning each entry of a KV list forward by its
        turn's delta (`turns`: (start, end, row), within the list), no turn outside them;
        None without turns. Turning every key with these is one rotation for any number of
        turns, bit for bit what turning each range by its row does."""
        if not turns:
            return None
        rows = entry_turns(list(turns), num_entries, self.cos.device).long()
        rows = torch.where(rows < 0, len(self.rows), rows)
        head_dim = self.cos.shape[1]
        return (torch.cat([self.cos, self.cos.new_ones(1, head_dim)])[rows],
                torch.cat([self.sin, self.sin.new_zeros(1, head_dim)])[rows])

    def fill(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Copy the rows into persistent buffers (a CUDA graph's), rows 0 .. len - 1."""
        n = len(self.rows)
        cos[:n].copy_(self.cos)
        sin[:n].copy_(self.sin)


def turned_positions(positions: torch.Tensor, turns: tuple[Turn, ...],
                     table: TurnTable | None) -> torch.Tensor:
    """[k] int64: the positions a KV list's entries' keys are rotated for (`positions`, as
    stored), each turned forward by its range's delta (`turns`: (start, end, row) of
    `table`): where a sequence sees each entry."""
    positions = positions.long()
    if not turns:
        return positions
    rows = entry_turns(list(turns), positions.shape[0], positions.device).long()
    return positions + table.deltas(positions.device)[rows]  # row -1: the appended 0


def entry_turns(turns: list[Turn], num_entries: int, device: torch.device) -> torch.Tensor:
    """[num_entries] int32: each entry's row of the turn table, -1 outside every turn
    ((start, end, row), disjoint, over the concatenated KV lists). Three launches whatever
    the number of turns: a difference array, then its running sum."""
    bounds = torch.tensor([[a for a, _, _ in turns], [b for _, b, _ in turns],
                           [row + 1 for _, _, row in turns]], dtype=torch.int64).to(device)
    delta = torch.zeros(num_entries + 1, dtype=torch.int32, device=device)
    values = bounds[2].to(torch.int32)
    delta.index_add_(0, bounds[0], values)
    delta.index_add_(0, bounds[1], -values)
    return delta.cumsum(0, dtype=torch.int32)[:-1] - 1

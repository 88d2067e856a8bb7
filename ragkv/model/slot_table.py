"""Every running sequence's KV slot list, kept in one device tensor between steps.

Row r of `table` holds the slots of the sequence that owns row r (`SeqKV.row`), in the order of
`SeqKV.slots`; row 0 is never handed out and stays all zeros (slot 0 is the pool's padding
slot), so padded batch entries can point at it. A step copies only the entries appended or
rewritten since the last one (`SeqKV.num_mirrored`), in one transfer for the whole batch, so
the host work per decode step does not grow with the context. Kernels read a sequence's KV
list straight from its row, which is what a CUDA graph needs: the step's tensors stay where
they are and only their contents change.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..cache.kv_manager import SeqKV
from ..host_ints import int64_tensor

PAD_ROW = 0
# New entries of one sequence from which a step copies them as a slice of its row rather than
# scattering them one by one (a new request's list, not a decode step's one token), for at
# most MAX_ROW_COPIES sequences per step.
LONG_RUN = 32
MAX_ROW_COPIES = 4


class SlotTable:
    def __init__(self, num_rows: int, width: int, device: torch.device) -> None:
        # int32 halves the table's memory; slot numbers stay far below 2**31.
        self.table = torch.zeros(num_rows + 1, width, dtype=torch.int32, device=device)
        self.width = width
        self.device = device
        self._free = list(range(num_rows, PAD_ROW, -1))

    @property
    def num_rows(self) -> int:
        return self.table.shape[0] - 1

    def entries(self, row: int, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The KV list a step of the sequence in `row` reads: the spans [a, b) of its row,
        one after another (a view of the row when there is one span)."""
        if len(spans) == 1:
            return self.table[row, spans[0][0]:spans[0][1]]
        return torch.cat([self.table[row, a:b] for a, b in spans])

    def sync(self, seqs: Iterable[SeqKV], record: bool = False
             ) -> list[tuple[int, int, list[int]]] | None:
        """Give each sequence a row if it has none and copy its new entries to the device.
        `record`: return them as (row, first entry, slots), for `apply` on another rank's
        table (tensor parallelism)."""
        entries: list[tuple[int, int, list[int]]] = []  # (row, first new entry, new slots)
        for seq in seqs:
            n = len(seq.slots)
            if n > self.width:
                raise RuntimeError(f"slot table: a sequence holds {n} KV entries, more than "
                                   f"max_model_len={self.width}")
            if seq.row == PAD_ROW:
                if not self._free:
                    raise RuntimeError(f"slot table: all {self.num_rows} rows are in use")
                seq.row = self._free.pop()
                seq.num_mirrored = 0
            if seq.num_mirrored < n:
                entries.append((seq.row, seq.num_mirrored, seq.slots[seq.num_mirrored:n]))
                seq.num_mirrored = n
        self.apply(entries)
        return entries if record else None

    def apply(self, entries: list[tuple[int, int, list[int]]]) -> None:
        """Write `entries` (row, first entry, slots) into the table: this table's new
        entries (`sync`), or those another rank's table recorded, into the same rows."""
        if not entries:
            return
        # A few long runs (new requests' lists) are copied into their rows' slices: one copy
        # each. Everything else (a decode step's one entry per sequence, or many new requests
        # at once, where a copy per run would cost more launches than it saves) is scattered
        # through flat positions in the table. One transfer carries the runs' values, then the
        # scattered values, then their positions.
        runs = [e for e in entries if len(e[2]) >= LONG_RUN]
        scattered = [e for e in entries if len(e[2]) < LONG_RUN]
        if len(runs) > MAX_ROW_COPIES:
            runs, scattered = [], entries
        vals: list[int] = []
        for _, _, slots in runs:
            vals.extend(slots)
        count = len(vals)
        where: list[int] = []
        width = self.width
        for row, start, slots in scattered:
            # list.extend over a range or a slice runs in C; a nested list would not.
            base = row * width + start
            where.extend(range(base, base + len(slots)))
            vals.extend(slots)
        update = int64_tensor(vals + where).to(self.device)
        at = 0
        for row, start, slots in runs:
            self.table[row, start:start + len(slots)] = update[at:at + len(slots)]
            at += len(slots)
        if where:
            self.table.view(-1)[update[len(vals):]] = update[count:len(vals)].to(torch.int32)

    def release(self, seq: SeqKV) -> None:
        if seq.row != PAD_ROW:
            self._free.append(seq.row)
            seq.row = PAD_ROW
        seq.num_mirrored = 0

    def check_integrity(self, live: Iterable[SeqKV]) -> None:
        held = [seq.row for seq in live if seq.row != PAD_ROW]
        if len(set(held)) != len(held):
            raise AssertionError("slot table: a row is owned by two sequences")
        if set(held) & set(self._free) or len(held) + len(self._free) != self.num_rows:
            raise AssertionError(f"slot table: {len(self._free)} free rows + {len(held)} held "
                                 f"!= {self.num_rows}")

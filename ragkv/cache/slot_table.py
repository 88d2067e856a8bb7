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

from collections.abc import Iterable

import torch

from ..host_ints import int64_tensor
from .kv_manager import SeqKV

PAD_ROW = 0
# New entries of one sequence from which a step copies them as a slice of its row rather than
# scattering them one by one: a new request's list, not a decode step's one token.
LONG_RUN = 32


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

    def sync(self, seqs: Iterable[SeqKV]) -> None:
        """Give each sequence a row if it has none and copy its new entries to the device."""
        # A long run of new entries (a new request's whole list) is copied into its row's
        # slice; short ones (a decode step's one entry per sequence) are scattered through
        # flat positions in the table. One transfer carries both: the runs' values, then the
        # short entries' values, then their flat positions.
        runs: list[tuple[int, int, int]] = []  # (row, start, end)
        vals: list[int] = []
        short_vals: list[int] = []
        where: list[int] = []
        width = self.width
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
            start = seq.num_mirrored
            if start >= n:
                continue
            if n - start >= LONG_RUN:
                runs.append((seq.row, start, n))
                vals.extend(seq.slots[start:n])
            else:
                # list.extend over a range or a slice runs in C; a nested list would not.
                base = seq.row * width
                where.extend(range(base + start, base + n))
                short_vals.extend(seq.slots[start:n])
            seq.num_mirrored = n
        if not vals and not short_vals:
            return
        count, short = len(vals), len(short_vals)
        update = int64_tensor(vals + short_vals + where).to(self.device)
        at = 0
        for row, start, end in runs:
            self.table[row, start:end] = update[at:at + end - start]
            at += end - start
        if short:
            self.table.view(-1)[update[count + short:]] = update[count:count + short].to(
                torch.int32)

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

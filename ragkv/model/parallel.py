"""Tensor parallelism: how a model's heads and weights split across ranks, and the one
collective a forward needs.

Every rank holds a slice of each layer (Megatron's split, as vLLM and SGLang use it):
- attention: a share of the query heads with the KV heads they read (column-parallel
  q/k/v), its slice of o_proj's input columns (row-parallel), then an all-reduce of the
  partial outputs;
- MLP: a slice of the intermediate size (column-parallel gate/up, row-parallel down), then an
  all-reduce;
- the embedding, the norms and the LM head are replicated (a small model's vocabulary
  matmul is cheap beside the all-reduces a vocab-parallel head would add).

Heads go out by KV group, so each rank's heads read only its own KV heads: with at least as
many KV heads as ranks, whole groups per rank (as evenly as they split: SmolLM2's 3 groups
over 2 ranks are 2 + 1); with fewer, each KV head is replicated on `size / kv_heads` ranks,
which split its group's query heads between them (vLLM's rule). A rank's KV pool holds its
KV heads only, at the same slot indices as every other rank's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The query heads [q_start, q_start + q_count) and KV heads [kv_start, kv_start +
    kv_count) of the model that one rank holds (global head indices)."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


@dataclass(frozen=True, slots=True)
class Shard:
    """The part of a checkpoint tensor one rank holds: `count` entries from `start` along
    `dim`; `zero`: zeros in its place (a row-parallel layer's bias on ranks other than 0,
    added once before the sum over ranks)."""

    dim: int
    start: int
    count: int
    zero: bool = False

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.zero:
            return torch.zeros_like(tensor)
        return tensor.narrow(self.dim, self.start, self.count)


def group_columns(t: torch.Tensor, planes: int, k: int, start: int, count: int,
                  group: int) -> torch.Tensor:
    """Inputs start .. start + count - 1 of every plane of `t`: a quantized weight's values
    ([rows, planes * k]) or its per-group scales ([rows, planes * k / group]); a rank's part
    of a row-parallel layer must be whole groups."""
    if start % group or count % group:
        raise ValueError(f"inputs {start}..{start + count - 1} of a quantized weight: a rank's "
                         f"part must be whole groups of {group}")
    per = t.shape[1] // planes
    a, n = start * per // k, count * per // k
    return torch.cat([t[:, p * per + a:p * per + a + n] for p in range(planes)], dim=1)


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Rank `rank`'s heads out of `size` ranks (see the module docstring); ValueError where
    the heads cannot be split so."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        start, count = split(num_kv_heads, rank, size)
        return HeadShard(start * group, count * group, start, count)
    if size % num_kv_heads or group % (size // num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size={size} cannot split {num_heads} query heads over "
            f"{num_kv_heads} KV heads: with fewer KV heads than ranks, the ranks must divide "
            f"into one set per KV head, each splitting that head's {group} query heads evenly")
    per_kv = size // num_kv_heads  # ranks sharing one KV head
    kv, part = divmod(rank, per_kv)
    q_count = group // per_kv
    return HeadShard(kv * group + part * q_count, q_count, kv, 1)


def split(n: int, rank: int, size: int) -> tuple[int, int]:
    """(start, count) of rank `rank`'s share of n items over `size` ranks, the first n % size
    ranks taking one more."""
    base, extra = divmod(n, size)
    count = base + (rank < extra)
    return rank * base + min(rank, extra), count


class TPGroup:
    """This process's place among the ranks of one model, and the all-reduce of the row-
    parallel layers' partial outputs (torch.distributed: gloo on CPU, NCCL on CUDA)."""

    __slots__ = ("rank", "size", "group")

    def __init__(self, rank: int, size: int, group=None) -> None:
        self.rank = rank
        self.size = size
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        return head_shard(num_heads, num_kv_heads, self.rank, self.size)

    def share(self, n: int) -> tuple[int, int]:
        """(start, count) of this rank's slice of n (the MLP's intermediate size)."""
        return split(n, self.rank, self.size)


SINGLE = TPGroup(0, 1)

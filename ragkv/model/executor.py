"""Tensor parallelism's processes: one per rank, the engine's own being rank 0.

Rank 0 runs the whole engine: scheduler, caches, slot lists, sampling. Ranks 1 .. N-1 are
worker processes that ragkv spawns (vLLM's multiprocessing executor is the model); each holds
its shard of the model (model/parallel.py) and of the KV pool, at the same slot indices as
rank 0's, and does nothing but run steps. Every step, rank 0's `TPRunner` broadcasts what its
own `ModelRunner` is about to run: the slot-table entries the step added (rank 0 gives out the
rows), the works and the recompute probes. Then every rank runs the same forward, the row-
parallel layers' all-reduces keeping them in step, and rank 0 alone samples from the logits.
Collectives go through torch.distributed: gloo on CPU, NCCL on CUDA (one GPU per rank).

The chunk cache and its store see whole entries, every KV head, in the format a single
process stores (so replicas of any TP size share one store): rank 0's `ShardedPool` gathers
an entry's heads from the ranks to store it, and sends a loaded entry to every rank, each
writing its own heads. Both happen on the engine thread between steps, in the same order on
every rank as the steps themselves.

A worker that dies is found before the next step, or inside a step by the step's
collective failing on its closed connection: the engine raises `EngineDeadError`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing
import os
import socket
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache.kv_manager import SeqKV
from ..cache.kv_pool import KVPool
from ..config import EngineConfig
from . import quantized_linear
from .llama import CausalLM
from .loader import Checkpoint, load_weights
from .parallel import HeadShard, TPGroup, head_shard
from .runner import ModelOutput, ModelRunner
from .step_work import StepWork

logger = logging.getLogger("ragkv")

# How long a rank waits for the others in a collective (a dead rank fails it sooner: its
# connection closes).
_TIMEOUT = datetime.timedelta(minutes=10)
# The group of the control messages (steps' plans, chunk entries: host objects): gloo beside
# NCCL on GPUs, so they never pass through a device; the default group on CPU.
_control = None


class EngineDeadError(RuntimeError):
    """The engine cannot go on (vLLM's name): a rank died, or (its subclass
    `InvariantViolation`) its bookkeeping is inconsistent. A server stops on it."""


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank builds its shard from (rank 0 decides it, the workers receive it)."""

    config: EngineConfig
    checkpoint: Checkpoint
    dtype: torch.dtype
    max_len: int  # the model's RoPE tables
    max_model_len: int
    num_slots: int
    packed: bool
    # Packed weights: the prompt rows' matmul dtype, rank 0's choice (quantized_linear
    # .prompt_dtype), so that no rank's timing can choose differently.
    prompt_dtype: torch.dtype | None = None


def make_runner(model: CausalLM, pool: KVPool, spec: RankSpec) -> ModelRunner | TPRunner:
    """Rank 0's runner over its model and pool: itself without tensor parallelism, else a
    `TPRunner` over it, once the workers have started and joined the process group (a GPU
    runner's warm-up and graph capture already run collectives)."""
    size = spec.config.tensor_parallel_size
    if size == 1:
        return ModelRunner(model, pool, spec.config, spec.max_model_len)
    threads = torch.get_num_threads()
    if pool.kv.device.type == "cpu":
        # The ranks share the cores: each takes its part, as the workers do (on this 2-core
        # machine rank 0 at 2 threads made a decode step 1.3x slower). Back at close().
        torch.set_num_threads(_threads_per_rank(size))
    try:
        workers = start_workers(spec, pool.kv.device)
    except BaseException:
        torch.set_num_threads(threads)
        raise
    try:
        local = ModelRunner(model, pool, spec.config, spec.max_model_len)
    except BaseException:
        TPRunner.stop(workers)
        torch.set_num_threads(threads)
        raise
    return TPRunner(local, workers, threads)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: its own GPU on CUDA (rank 0 on the engine's), else the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _sent(work) -> StepWork:
    """A work as a worker receives it: the fields the runner reads, the sequence reduced to
    its row (`ModelRunner` reads `kv.row`; the row's entries come with the step)."""
    return StepWork(
        kv=SeqKV(row=work.kv.row), token_ids=work.token_ids, positions=work.positions,
        kv_spans=work.kv_spans, sample=work.sample, end=work.end, logits_from=work.logits_from,
        turns=work.turns, query_index=work.query_index, key_positions=work.key_positions,
        prompt_len=work.prompt_len, prompt_rows=work.prompt_rows, damped=work.damped,
        damping=work.damping, primer=work.primer)


class ShardedPool:
    """Rank 0's KV pool as the chunk cache sees it under tensor parallelism: entries of every
    KV head, gathered from the ranks that hold them (`read`) or spread to them (`write`)."""

    def __init__(self, local: KVPool, shards: list[HeadShard], num_kv_heads: int) -> None:
        self.local = local
        self.shards = shards
        self.num_kv_heads = num_kv_heads

    def entry_shape(self) -> tuple[int, int, int]:
        layers, _, dim = self.local.entry_shape()
        return layers, self.num_kv_heads, dim

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def read(self, slots: list[int]) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        _broadcast(("read", slots))
        parts = [None] * len(self.shards)
        dist.gather_object(_read_own(self.local, slots), parts, dst=0, group=_control)
        layers, heads, dim = self.entry_shape()
        kv = torch.empty(2, layers, len(slots), heads, dim, dtype=self.dtype)
        for shard, part in zip(self.shards, parts, strict=True):
            kv[:, :, :, shard.kv_start:shard.kv_start + shard.kv_count] = part
        return kv, None

    def write(self, slots: list[int], kv: torch.Tensor, first_position: int) -> None:
        kv = kv.cpu()
        _broadcast(("write", slots, kv, first_position))
        _write_own(self.local, self.shards[0], slots, kv, first_position)


def _read_own(pool: KVPool, slots: list[int]) -> torch.Tensor:
    """This rank's heads of `slots`, on the CPU."""
    kv, ready = pool.read(slots)
    if ready is not None:
        ready.synchronize()
    return kv


def _write_own(pool: KVPool, shard: HeadShard, slots: list[int], kv: torch.Tensor,
               first_position: int) -> None:
    """This rank's heads of a whole entry `kv` into `slots`."""
    pool.write(slots, kv[:, :, :, shard.kv_start:shard.kv_start + shard.kv_count],
               first_position)


class TPRunner:
    """Rank 0's runner under tensor parallelism: `ModelRunner`'s interface, each step sent
    to the workers first. `local` is rank 0's own runner (its slot table is the one whose
    rows the engine's sequences hold)."""

    def __init__(self, local: ModelRunner, workers: list, threads: int) -> None:
        self.local = local
        self.workers = workers
        # close(), or the runner's collection (an engine dropped unclosed): the workers stop,
        # the process group goes (another engine may form one), rank 0's torch threads are
        # what they were.
        self._finalizer = weakref.finalize(self, _shut_down, workers, threads)
        mc = local.model.config
        size = len(workers) + 1
        self.chunk_pool = ShardedPool(
            local.pool, [head_shard(mc.num_heads, mc.num_kv_heads, r, size) for r in range(size)],
            mc.num_kv_heads)

    @property
    def slot_table(self):
        return self.local.slot_table

    @property
    def backend(self):
        return self.local.backend

    @property
    def graphs(self):
        return self.local.graphs

    def release(self, seq: SeqKV) -> None:
        self.local.release(seq)

    def release_memory(self) -> None:
        _broadcast(("release",))
        self.local.release_memory()

    def restore_memory(self) -> None:
        _broadcast(("restore",))
        self.local.restore_memory()

    def execute(self, works: Sequence, probes: Sequence = ()) -> ModelOutput:
        self._check_workers()
        kvs = {id(w.kv): w.kv for w in works}
        entries = self.local.slot_table.sync(kvs.values(), record=True)
        # A probe's request stays here: the workers need its fields, not the engine's request.
        sent = [dataclasses.replace(p, request=None) for p in probes]
        try:
            _broadcast(("step", entries, [_sent(w) for w in works], sent))
            result = self.local.execute(works, probes)
        except Exception as e:
            # Whatever stopped rank 0's step (a worker gone mid-collective, an error here)
            # left the other ranks elsewhere in it: no later step can run in step with them.
            raise EngineDeadError(f"tensor parallelism: a step failed on the ranks "
                                  f"({type(e).__name__}: {e})") from e
        failed = [s for s in result.probe_scores if isinstance(s, Exception)]
        if failed:  # stopped midway on rank 0 alone, as above
            raise EngineDeadError(f"tensor parallelism: a recompute probe failed on rank 0 "
                                  f"({type(failed[0]).__name__}: {failed[0]})")
        return result

    def _check_workers(self) -> None:
        dead = [p for p in self.workers if not p.is_alive()]
        if dead:
            raise EngineDeadError(f"tensor parallelism: worker rank(s) "
                               f"{[self.workers.index(p) + 1 for p in dead]} exited "
                               f"(exit codes {[p.exitcode for p in dead]}); the engine stops")

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @staticmethod
    def stop(workers: list) -> None:
        """Tell live workers to stop, wait for them, leave the process group."""
        try:
            if all(p.is_alive() for p in workers):
                _broadcast(("stop",))
        finally:
            for p in workers:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            _destroy_group()


def _shut_down(workers: list, threads: int) -> None:
    try:
        TPRunner.stop(workers)
    finally:
        torch.set_num_threads(threads)


def start_workers(spec: RankSpec, device: torch.device) -> list:
    """Spawn ranks 1 .. N-1 and join the process group as rank 0; returns the worker
    processes."""
    import torch.distributed as dist

    size = spec.config.tensor_parallel_size
    if dist.is_initialized():
        raise RuntimeError("tensor parallelism: this process already belongs to a "
                           "torch.distributed group (one engine with tensor_parallel_size "
                           "> 1 per process: close the other one first)")
    if spec.packed and device.type == "cpu":
        spec = dataclasses.replace(spec, prompt_dtype=quantized_linear.prompt_dtype())
    address = f"tcp://127.0.0.1:{_free_port()}"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_worker_main, args=(rank, address, spec, device),
                               name=f"ragkv-tp{rank}", daemon=True)
               for rank in range(1, size)]
    for p in workers:
        p.start()
    try:
        _join(device, address, 0, size)
    except BaseException:
        for p in workers:
            p.kill()
        raise
    logger.info("tensor parallelism: %d ranks (%s)", size, _backend(device))
    return workers


def _worker_main(rank: int, address: str, spec: RankSpec, device: torch.device) -> None:
    """A worker rank: build its shard, then run every step rank 0 sends until told to stop."""
    import torch.distributed as dist

    size = spec.config.tensor_parallel_size
    torch.set_num_threads(_threads_per_rank(size))
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _join(device, address, rank, size)
    if spec.prompt_dtype is not None:
        quantized_linear.pin_prompt_dtype(spec.prompt_dtype)
    try:
        mc = spec.checkpoint.model_config
        model = CausalLM(mc, spec.max_len, spec.dtype, device, TPGroup(rank, size)).eval()
        load_weights(model, spec.checkpoint, spec.packed)
        pool = KVPool(mc.num_layers, spec.num_slots, model.num_kv_heads, mc.head_dim,
                      spec.dtype, device)
        runner = ModelRunner(model, pool, spec.config, spec.max_model_len)
        shard = head_shard(mc.num_heads, mc.num_kv_heads, rank, size)
        while True:
            message = _broadcast(None)
            kind = message[0]
            if kind == "stop":
                break
            if kind == "step":
                _, entries, works, probes = message
                runner.slot_table.apply(entries)
                runner.execute(works, probes)
            elif kind == "read":
                dist.gather_object(_read_own(pool, message[1]), None, dst=0, group=_control)
            elif kind == "write":
                _write_own(pool, shard, *message[1:])
            elif kind == "release":
                runner.release_memory()
            elif kind == "restore":
                runner.restore_memory()
    finally:
        _destroy_group()


def _broadcast(message):
    """Rank 0's `message` to every rank (the workers pass None and get it back)."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0, group=_control)
    return box[0]


def _join(device: torch.device, address: str, rank: int, size: int) -> None:
    """Join the process group (and, on GPUs, the control messages' gloo group) as `rank`."""
    import torch.distributed as dist

    global _control
    dist.init_process_group(_backend(device), init_method=address, rank=rank,
                            world_size=size, timeout=_TIMEOUT)
    _control = dist.new_group(backend="gloo", timeout=_TIMEOUT) if device.type == "cuda" else None


def _threads_per_rank(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _destroy_group() -> None:
    import torch.distributed as dist

    global _control
    _control = None
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

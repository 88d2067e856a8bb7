"""The model runner: everything that runs the model on its device. It builds the attention
backend, switches on the fused ops the backend offers, captures the CUDA graphs, warms the
kernels up and keeps the device mirror of the running sequences' slot lists; each step it turns
the scheduler's works into tensors, runs the model and returns the logits to sample. It never
imports the engine side: a work is anything with the fields of `Work`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..cache.kv_manager import SeqKV
from ..cache.kv_pool import KVPool
from ..config import EngineConfig
from ..host_ints import int64_tensor
from ..sampling.noise import uniform_noise
from .backends.base import AttentionBackend, AttentionBatch, AttentionMetadata, damping_offsets
from .backends.registry import get_attention_backend
from .backends.torch_sdpa import TorchAttentionBackend
from .llama import CausalLM
from .quantized_linear import takes_kernel
from .reposition import Turn, TurnTable
from .slot_table import PAD_ROW, SlotTable
from .step_work import join_recomputed

logger = logging.getLogger("ragkv")

# Largest decode batch captured in a CUDA graph (vLLM captures up to 512); larger ones run eagerly.
MAX_GRAPH_BATCH = 256


class Work(Protocol):
    """A sequence's share of a step (the scheduler's `SeqWork`): the KV list is the
    concatenation of the `kv_spans` ranges of `kv.slots` (with `primer` after the first);
    its last len(token_ids) entries are the slots the new tokens are written to."""

    kv: SeqKV
    token_ids: list[int]
    positions: list[int]
    kv_spans: tuple[tuple[int, int], ...]
    sample: bool
    end: int  # flat index after the work's last token
    logits_from: int  # flat index of the first token whose logits are returned (end: none)
    turns: tuple[Turn, ...]  # (start, end, delta) of the KV list (model/reposition.py)
    # Entries of the KV list the new tokens are (ascending; None: its last len(token_ids)),
    # and the RoPE positions of their keys where these differ from `positions` (recomputed
    # chunk tokens keep their keys at the chunk's base positions, like the cached ones).
    query_index: tuple[int, ...] | None
    key_positions: list[int] | None
    prompt_len: int  # the request's prompt tokens
    # The prompt rows the request computes where this work's tokens are: its prompt, or,
    # after a RAG request's chunks, its question (and the tokens its probe chose, if any)
    # (packed weights run a few rows on the int4 kernel: quantized_linear.takes_kernel).
    prompt_rows: int
    # (start, end) ranges of the KV list the new tokens read with their attention logits
    # lowered by `damping` (stale chunk tokens); () for none.
    damped: tuple[tuple[int, int], ...]
    damping: float
    # The chunk primer P's slots, which the KV list holds after its first range (S); ()
    # for none (scheduler_output.SeqWork).
    primer: tuple[int, ...]


class Probe(Protocol):
    """A pass of some layers of the model over the step's KV after its forward (the
    selective-recompute probe, recompute/probe.py), with the runner's attention backend; it
    writes only slots its request owns and has not computed yet."""

    def run(self, model: CausalLM, pool: KVPool, backend: AttentionBackend) -> torch.Tensor: ...


@dataclass(slots=True)
class ModelOutput:
    """What one step computed: float32 logits for the tokens [logits_from, end) of each work
    in order ([number of works with sample=True, vocab] when nothing is scored; None without
    works), and per probe its scores or the exception that stopped it (that probe's request
    fails, not the step)."""

    logits: torch.Tensor | None = None
    probe_scores: list[torch.Tensor | Exception] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, config: EngineConfig,
                 max_model_len: int) -> None:
        self.model = model
        self.pool = pool
        self.device = device = pool.kv.device
        self.num_heads = model.num_heads  # this rank's (tensor parallelism)
        self.num_kv_heads = pool.k.shape[2]
        # One row per running sequence (max_num_seqs) plus the padding row.
        self.slot_table = SlotTable(config.max_num_seqs, max_model_len, device)
        self.backend = get_attention_backend(config.attention_backend, device)
        model.use_fused_ops(self.backend.fused_ops)
        # Steps with damped logits (Work.damped) where the backend cannot apply them.
        self.torch_backend = self.backend if self.backend.damps else TorchAttentionBackend()
        self.graphs = None  # DecodeGraphs once captured
        self.extend_graphs = None  # ExtendGraphs once captured
        if device.type == "cuda" and self.backend.name == "triton" and not config.enforce_eager:
            from .backends.cuda_graph import DecodeGraphs, ExtendGraphs

            self.graphs = DecodeGraphs(model, pool, self.backend, self.slot_table,
                                       min(config.max_num_seqs, MAX_GRAPH_BATCH), max_model_len)
            self.extend_graphs = ExtendGraphs(model, pool, self.backend, self.slot_table,
                                              config.max_num_batched_tokens, max_model_len)
            self.capture_graphs()
        self.compiled = None  # CompiledDecode: the CPU's decode steps through torch.compile
        if config.enable_torch_compile:
            from .compiled_decode import CompiledDecode

            self.compiled = CompiledDecode(model, pool, self.slot_table,
                                            drafts=config.speculative_config is not None)
            logger.info("compiled the decode step in %.0f s", self.compiled.warmup())
        self.warmup(min(config.max_num_batched_tokens, max_model_len))

    def release(self, seq: SeqKV) -> None:
        """A sequence gave its slots back: its row of the slot table is free."""
        self.slot_table.release(seq)

    def close(self) -> None:
        """Nothing to stop (the tensor-parallel runner stops its workers)."""

    @property
    def chunk_pool(self) -> KVPool:
        """The pool as the chunk cache reads and writes whole entries (every KV head)."""
        return self.pool

    def release_memory(self) -> None:
        """Free the KV pool's memory (`Engine.sleep`)."""
        self.pool.release_memory()

    def restore_memory(self) -> None:
        """Allocate the pool again and re-capture the CUDA graphs, which addressed the freed
        memory (`Engine.wake_up`)."""
        self.pool.restore_memory()
        self.capture_graphs()

    def capture_graphs(self) -> None:
        """(Re-)capture the CUDA graphs: after the pool's memory came back (`wake_up`), the
        old ones address freed memory."""
        for graphs in (self.graphs, self.extend_graphs):
            if graphs is not None:
                graphs.capture()

    @torch.inference_mode()
    def execute(self, works: Sequence[Work], probes: Sequence[Probe] = ()) -> ModelOutput:
        """Run one step: the works' forward, then the probes, which read the KV it wrote."""
        out = ModelOutput(self._forward(works) if works else None)
        for probe in probes:
            try:
                out.probe_scores.append(probe.run(self.model, self.pool, self.backend))
            except Exception as e:  # noqa: BLE001 (its request fails, not the step)
                logger.exception("recompute probe failed")
                out.probe_scores.append(e)
        return out

    def _forward(self, works: Sequence[Work]) -> torch.Tensor:
        kvs = {id(w.kv): w.kv for w in works}
        self.slot_table.sync(kvs.values())
        damped = any(w.damped for w in works)
        # Damped logits run on a backend that applies them (`torch_backend`: the graphs' and
        # kernels' attention has no per-entry offset); the model's fused ops still write K/V.
        backend = self.torch_backend if damped else self.backend
        # The graphs read KV lists from the slot table's rows, which hold no primer slots.
        if not damped and not any(w.primer for w in works):
            if self.graphs is not None and self.graphs.can_run(works):
                return self.graphs.run(works)
            if self.extend_graphs is not None and self.extend_graphs.can_run(works):
                return self.extend_graphs.run(works)
            if self.compiled is not None and self.compiled.can_run(works):
                return self.compiled.run(works)
        table = self.slot_table.table
        prompt_rows = None
        # The torch backend attends sequence by sequence: a recomputing request's question
        # joins its recomputed tokens (as the extend graphs take them: graph_step).
        units = (join_recomputed(works) if backend.name == "torch"
                 else list(enumerate(works)))
        order = list(range(len(units)))
        if self.model.route is not None:
            # Packed weights route rows by kind (quantized_linear.RowRoute): the dense path's
            # rows first, then the kernel's: generated tokens (works after the prompt:
            # decode, drafts) and every row of a prompt short enough for the kernel to be
            # the faster (a chat turn: 3x on a 32-token prompt where bfloat16 is native), or
            # of the few rows a RAG request computes after its chunks (its question, and the
            # tokens a recomputing request's probe chose).
            # Either way a token's path depends on its request, never on the step. The
            # logits still come back in the works' order.
            kernel = [takes_kernel(w.end - len(w.token_ids), w.prompt_len, w.prompt_rows)
                      for _, w in units]
            order.sort(key=kernel.__getitem__)
            prompt_rows = sum(len(w.token_ids) for (_, w), k in zip(units, kernel, strict=True)
                              if not k)
        input_ids: list[int] = []
        positions: list[int] = []
        q_lens, kv_lens, q_starts, seq_lens = [], [], [], []
        rows, prefix = [], []
        kv_indices: list[torch.Tensor] = []
        logits_of: dict[int, range] = {}
        query_index: list[torch.Tensor | None] = []
        key_positions: list[int] | None = None
        write_parts: list[torch.Tensor] = []
        for u in order:
            i, w = units[u]
            row = w.kv.row
            spans = w.kv_spans
            index = self.slot_table.entries(row, spans)
            if w.primer:  # P's KV after S (a primed chunk's list, or P's own)
                system = spans[0][1] - spans[0][0]
                index = torch.cat([index[:system], self._primer_index(w), index[system:]])
            q, k = len(w.token_ids), index.numel()
            at = w.query_index
            if at is not None and at[0] == k - q and at[-1] == k - 1:
                at = None  # the last q entries: the ordinary bottom-right causal case
            if at is None:
                query_index.append(None)
                write_parts.append(index[k - q:])
            else:
                at_dev = torch.tensor(at, device=self.device)
                query_index.append(at_dev)
                write_parts.append(index[at_dev])
            if w.key_positions is not None and key_positions is None:
                key_positions = list(positions)
            if key_positions is not None:
                key_positions.extend(w.key_positions or w.positions)
            q_starts.append(len(input_ids))
            input_ids.extend(w.token_ids)
            positions.extend(w.positions)
            kv_indices.append(index)
            q_lens.append(q)
            kv_lens.append(k)
            seq_lens.append(max(w.positions) + 1)
            rows.append(row)
            prefix.append(len(spans) == 1 and spans[0][0] == 0 and not w.primer)
            logits_of[i] = range(len(input_ids) - (w.end - w.logits_from), len(input_ids))
        logits_rows = ([r for i in range(len(works)) for r in logits_of.get(i, ())]
                       if self.model.samples else [])  # a TP worker: no LM head
        batch = AttentionBatch(
            q_lens=q_lens, kv_lens=kv_lens, q_starts=q_starts, kv_indices=kv_indices,
            write_slots=torch.cat(write_parts).long(), num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, table=table, rows=rows, prefix=prefix)
        if any(x is not None for x in query_index):
            batch.query_index = query_index
        ordered = [units[u][1] for u in order]
        if damped:
            batch.damping = [damping_offsets(w.damped, w.damping, self.device) if w.damped
                             else None for w in ordered]
        # One transfer for ids, positions and logits rows.
        n = len(input_ids)
        extra = key_positions or []
        dev_ids = int64_tensor(input_ids + positions + extra + logits_rows).to(self.device)
        keys = dev_ids[2 * n:3 * n] if extra else None
        if self.model.has_windows:  # the keys' positions, for the windows of this and later steps
            self.pool.pos[batch.write_slots] = (dev_ids[n:2 * n] if keys is None
                                                else keys).to(torch.int32)
        shared: dict[tuple, AttentionMetadata] = {}
        metas = tuple(self._metadata(batch, ordered, k, dev_ids[n:2 * n], seq_lens, shared,
                                     backend) for k in range(self.model.num_kinds))
        return self.model(dev_ids[:n], dev_ids[n:2 * n], dev_ids[2 * n + len(extra):],
                          self.pool, metas, backend, key_positions=keys,
                          prompt_rows=prompt_rows)

    def _primer_index(self, w: Work) -> torch.Tensor:
        """The primer P's slots a work reads (and writes, when it computes P)."""
        return torch.tensor(w.primer, dtype=self.slot_table.table.dtype, device=self.device)

    def _metadata(self, batch: AttentionBatch, works: Sequence[Work], kind: int,
                  positions: torch.Tensor, seq_lens: list[int],
                  shared: dict[tuple, AttentionMetadata], backend: AttentionBackend
                  ) -> AttentionMetadata:
        """The step's metadata for the layers of attention kind `kind`: its turn table (its
        RoPE's rotations), its window where it hides something. Kinds that see the step alike
        share one (`shared`, by what differs)."""
        window = self.model.windows[kind]
        windowed = [window is not None and s > window for s in seq_lens]
        turns = any(w.turns for w in works)
        key = (kind if turns else None, window if any(windowed) else None)
        if key in shared:
            return shared[key]
        if key != (None, None):  # this kind's own copy (the step's batch stays as it is)
            batch = dataclasses.replace(batch)
        if turns:
            batch.turn_table = TurnTable.build(self.model.rotaries[kind],
                                               (d for w in works for _, _, d in w.turns))
            batch.turns = [batch.turn_table.by_row(w.turns) for w in works]
        if any(windowed):
            batch.window, batch.windowed = window, windowed
            batch.query_positions, batch.slot_positions = positions, self.pool.pos
        meta = AttentionMetadata(write_slots=batch.write_slots,
                                 state=backend.prepare(batch), seq_lens=seq_lens,
                                 q_lens=batch.q_lens)
        shared[key] = meta
        return meta

    @torch.inference_mode()
    def warmup(self, num_tokens: int) -> None:
        """On CUDA, run the kernels of an extend and a decode step once at start-up, so that
        compiling them (Triton) or choosing their algorithms (cuBLAS) never delays a request,
        then every other variant of the attention kernels (the backend's `warmup`) and the
        sampler's. The kernels take every length as data, so one shape stands for all. The
        dummy steps read and write only the padding slot 0, which is zeroed again after."""
        if self.device.type != "cuda":
            return
        for q_len, kv_len in ((num_tokens, num_tokens), (1, 2)):
            index = torch.zeros(kv_len, dtype=torch.int32, device=self.device)
            batch = AttentionBatch(
                q_lens=[q_len], kv_lens=[kv_len], q_starts=[0], kv_indices=[index],
                write_slots=index[kv_len - q_len:].long(), num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, table=self.slot_table.table, rows=[PAD_ROW],
                prefix=[q_len < kv_len])
            meta = AttentionMetadata(write_slots=batch.write_slots,
                                     state=self.backend.prepare(batch), seq_lens=[kv_len],
                                     q_lens=[q_len])
            ids = torch.zeros(q_len, dtype=torch.long, device=self.device)
            positions = torch.arange(kv_len - q_len, kv_len, device=self.device)
            last = torch.tensor([q_len - 1], device=self.device)
            self.model(ids, positions, last, self.pool, meta, self.backend)
        # Every kernel variant, not only the two steps' ones.
        self.backend.warmup(self.pool, self.num_heads, self.slot_table.table, PAD_ROW,
                            self.model.has_windows)
        # The sampler's noise kernel.
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        uniform_noise(zero, zero, self.model.config.vocab_size)
        self.pool.zero_padding_slot()
        torch.cuda.synchronize(self.device)

"""A compiled decode step for the CPU (`enable_torch_compile`): the model's own forward for a
batch of generated rows (each sequence's new token, or its last token and the drafts to
verify), traced once by `torch.compile` (inductor, which writes C++ and needs a C++ compiler
at run time), the CPU's counterpart of the CUDA graphs. A CPU decode step of a small model is
a few hundred tiny torch ops, each paying a few microseconds of dispatch: on SmolLM2 with
packed weights they cost as much as the matmuls. Inductor fuses them into a few loops per
layer, with the weights frozen into the compiled code (they never change after load; the pool
stays an input, which sleep and wake reallocate).

The step reads the KV pool and never writes it: each layer attends over the sequence's cached
keys (gathered through the slot table inside the fused loops) plus the step's new keys of its
sequence up to its own, and the graph returns the new keys and values, which one copy per
pool writes after it. Written inside the graph, the pool (an input of it) would be copied
whole at every layer.

Numerics: the same arithmetic as the eager step up to float summation order (the attention's
softmax over the old keys and the new ones, fused loops for the norms), so the logits agree
within float32 rounding (tests/test_compiled_decode.py), not bit for bit; with packed weights a
bfloat16 rounding of a layer's input can turn that into a whole bfloat16 step now and then,
as a batch of another size does.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..cache.kv_pool import KVPool
from ..host_ints import int64_tensor
from .backends.base import AttentionMetadata, causal_mask
from .layers import apply_rotary
from .llama import CausalLM
from .quantized_linear import KERNEL_MAX_ROWS, takes_kernel
from .reposition import TurnTable
from .slot_table import SlotTable

_META = AttentionMetadata(write_slots=None)  # no dynamic RoPE: nothing per sequence to carry


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                     bias: torch.Tensor, segment: torch.Tensor, turn_cos: torch.Tensor,
                     turn_sin: torch.Tensor, new_bias: torch.Tensor, scale: float
                     ) -> torch.Tensor:
    """T query rows, q [T, heads, d], each over its sequence's cached keys `k_cache[index]`
    (index [T, n], bias [T, n]: 0 for a key, -inf for padding) and the step's new keys k, v
    [T, kv_heads, d] that `new_bias` [T, T] lets it see (0: a key of its own sequence at or
    before it, -inf otherwise; a decode step's is its diagonal, a drafted sequence's rows see
    each other causally). A cached key in a turned range (model/reposition.py) is scored
    against the query turned back by the range's delta: `segment` [T, n] picks each key's turn
    among the row's m (`turn_cos`, `turn_sin` [T, m, d]; turn 0 is none: cos 1, sin 0).
    Written as products and sums, which inductor turns into loops that read the cache in place
    (a matmul would gather a copy first). Float32 inside."""
    t, heads, d = q.shape
    kv_heads, m = k.shape[1], turn_cos.shape[1]
    group = heads // kv_heads
    qf = q.float()
    turned = apply_rotary(qf[:, None].expand(t, m, heads, d).reshape(t * m, heads, d),
                          turn_cos.reshape(t * m, d), turn_sin.reshape(t * m, d))
    turned = turned.view(t, m, kv_heads, group, d)
    # Laid out [T, kv_heads, n, group, d]: each loop then runs along d, where the cache rows
    # are contiguous (along n, inductor would gather one float at a time).
    q_of = turned[torch.arange(t, device=q.device)[:, None], segment].permute(0, 2, 1, 3, 4)
    old_k = k_cache[index].float().permute(0, 2, 1, 3).unsqueeze(3)  # [T, kvh, n, 1, d]
    old_v = v_cache[index].float().permute(0, 2, 1, 3).unsqueeze(3)
    scores = (q_of * old_k).sum(-1) * scale + bias[:, None, :, None]  # [T, kvh, n, g]
    qg = qf.view(t, 1, kv_heads, group, d)
    new = ((qg * k.float()[None, :, :, None, :]).sum(-1) * scale
           + new_bias[:, :, None, None])  # [T, T, kvh, g]
    top = torch.maximum(scores.amax(2), new.amax(1))  # [T, kvh, g]
    p_old, p_new = (scores - top.unsqueeze(2)).exp(), (new - top.unsqueeze(1)).exp()
    total = p_old.sum(2) + p_new.sum(1)
    out = ((p_old.unsqueeze(-1) * old_v).sum(2)
           + (p_new.unsqueeze(-1) * v.float()[None, :, :, None, :]).sum(1))
    out = out / total.unsqueeze(-1)
    return out.reshape(t, heads, d).to(q.dtype)


def verify_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                     bias: torch.Tensor, segment: torch.Tensor, turn_cos: torch.Tensor,
                     turn_sin: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence verifying drafts: its L rows q [L, heads, d] (its last token and drafts)
    over its cached keys `k_cache[index]` (index, segment [1, n], as in `decode_attention`;
    bias [L, n] or [1, n]: each row's, or one for all) and its new keys k, v [L, kv_heads,
    d], causally. The cached keys are gathered and turned forward once for all the rows
    (`turn_cos`, `turn_sin` [1, m, d] turn keys forward), which attend in one SDPA call:
    `decode_attention`'s loops read the cache again for every row (3 rows cost 2.6x one
    there), while this copy of the keys costs the same for any number of rows (~110 us a
    layer at 900 keys on SmolLM2's shape), so it pays for one sequence and not for a batch.
    Float32 inside."""
    n, d = index.shape[1], q.shape[2]
    keys = apply_rotary(k_cache[index[0]].float(), turn_cos[0, segment[0]],
                        turn_sin[0, segment[0]])
    keys = torch.cat((keys, k.float())).transpose(0, 1)  # [kv_heads, n + L, d]
    values = torch.cat((v_cache[index[0]].float(), v.float())).transpose(0, 1)
    rows = q.shape[0]
    mask = torch.cat((bias.expand(rows, n), torch.zeros(rows, rows, device=q.device)
                      .masked_fill_(~causal_mask(rows, rows, q.device), float("-inf"))), dim=1)
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), keys, values,
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1).to(q.dtype).reshape(rows, -1, d)


class _ReadOnlyAttention:
    """The attention backend of a compiled step: reads the pool, collects the new K/V. The
    inputs' bias, cos and sin come per attention kind ([kinds, ...]: a window and a RoPE of
    its own, model/llama.py); each layer takes its kind's."""

    name = "compiled-decode"
    fused_ops: frozenset[str] = frozenset()
    damps = False

    def __init__(self, attend, inputs: tuple, layer_kind: tuple[int, ...]) -> None:
        self.attend, self.inputs = attend, inputs  # decode_attention or verify_attention
        self.layer_kind = layer_kind
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                pool: KVPool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        index, bias, segment, cos, sin, *rest = self.inputs
        kind = self.layer_kind[layer]
        return self.attend(q, k, v, pool.k[layer], pool.v[layer], index, bias[kind], segment,
                           cos[kind], sin[kind], *rest, scale)


def _run(model: CausalLM, pool: KVPool, ids: torch.Tensor, positions: torch.Tensor,
         attention: _ReadOnlyAttention) -> tuple[torch.Tensor, torch.Tensor]:
    # The decode graph's batch is unbacked (`warmup`): what `can_run` ensures is told here,
    # so the packed layers' route by size (kernel up to KERNEL_MAX_ROWS) traces one branch.
    torch._check(ids.shape[0] >= 1)
    if model.route is not None:
        torch._check(ids.shape[0] <= KERNEL_MAX_ROWS)
    rows = torch.arange(ids.shape[0], device=ids.device)
    logits = model.forward(ids, positions, rows, pool, _META, attention, prompt_rows=0)
    # As the pool holds them: [2, layers, T, kv_heads, d], one copy writes both.
    return logits, torch.stack((torch.stack(attention.keys), torch.stack(attention.values)))


def _step(model: CausalLM, pool: KVPool, ids: torch.Tensor, positions: torch.Tensor,
          *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, vocab] of the step's T rows (a sequence's new token, or its last token and
    drafts), and the new keys and values [2, layers, T, kv_heads, d] to write; `inputs`:
    decode_attention's."""
    return _run(model, pool, ids, positions,
                _ReadOnlyAttention(decode_attention, inputs, model.layer_kind))


def _verify_step(model: CausalLM, pool: KVPool, ids: torch.Tensor, positions: torch.Tensor,
                 *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same for one sequence's last token and drafts; `inputs`: verify_attention's."""
    return _run(model, pool, ids, positions,
                _ReadOnlyAttention(verify_attention, inputs, model.layer_kind))


class CompiledDecode:
    """Runs steps of generated tokens over a prefix (0, end) of each sequence's slot-table
    row through the compiled step: one sampled token per sequence, and with `drafts` (the
    engine's speculative decoding) also steps where sequences verify a token and its drafts
    (every row's logits wanted); `can_run` says which steps it takes, the runner runs the
    rest eagerly."""

    def __init__(self, model: CausalLM, pool: KVPool, slot_table: SlotTable,
                 drafts: bool = False) -> None:
        reason = self.unsupported(model, pool.kv.device)
        if reason is not None:
            raise ValueError(f"enable_torch_compile: {reason}")
        self.model, self.pool, self.slot_table = model, pool, slot_table
        self.head_dim = pool.k.shape[-1]
        # The smallest sliding window of the model's layers, None without one.
        self.window = min((w for w in model.windows if w is not None), default=None)
        self._turns: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # Inputs that depend only on the batch size, kept (the graph only reads them): the
        # no-turn cos/sin of an unturned batch, the new_bias of one row per sequence.
        self._unturned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._diagonals: dict[int, torch.Tensor] = {}
        # Only the batch, the cached length and the number of turns vary (marked in
        # `warmup`): the weights' and the pool's shapes stay constants of the generated code.
        # This engine's own graphs: by default every torch.compile of one function shares
        # one cache, whose entries other engines' models would count against its limit.
        self.step = torch.compile(_step, fullgraph=True, isolate_recompiles=True)
        self.verify = (torch.compile(_verify_step, fullgraph=True, isolate_recompiles=True)
                       if drafts else None)

    @staticmethod
    def unsupported(model: CausalLM, device: torch.device) -> str | None:
        """Why the decode steps of `model` on `device` cannot be compiled, or None."""
        if device.type != "cpu":
            return ("it compiles the CPU's decode step; on CUDA, decode runs in CUDA graphs "
                    "(the default)")
        if "isolate_recompiles" not in inspect.signature(torch.compile).parameters:
            return f"torch {torch.__version__} is too old (no isolate_recompiles)"
        if any(r.dynamic for r in model.rotaries):
            return "not built for dynamic-NTK RoPE"
        if model.tp.size > 1:
            return "not built for tensor parallelism"
        return None

    def can_run(self, works: Sequence) -> bool:
        packed = self.model.route is not None
        # Packed weights: the graph runs every row on the int4 kernel, and the LM head
        # (routed by size) on the kernel too up to KERNEL_MAX_ROWS rows: a prompt's last
        # token that eager steps send to the dense path, or a larger step, runs eagerly.
        if packed and sum(len(w.token_ids) for w in works) > KERNEL_MAX_ROWS:
            return False
        # A sliding window never cuts a row's view of its sequence's new keys: at most the
        # drafts' few before it (larger steps would need the window among them too).
        for w in works:
            spans, q = w.kv_spans, len(w.token_ids)
            if self.window is not None and q > self.window:
                return False
            # Generated tokens only: a decode row, or a last token and its drafts (every
            # row's logits wanted, for the verification), at the end of a prefix (0, end).
            if (len(spans) != 1 or spans[0][0] != 0 or not w.sample
                    or w.end - w.logits_from != q or q > 1 and w.end - q < w.prompt_len
                    or w.query_index is not None or w.key_positions is not None
                    or packed and not takes_kernel(w.end - q, w.prompt_len, w.prompt_rows)):
                return False
        return bool(works)

    def run(self, works: Sequence) -> torch.Tensor:
        """Logits [rows, vocab] of the works' rows in order; their K/V written to the pool."""
        lens = [w.kv_spans[0][1] for w in works]  # each sequence's KV list, new tokens too
        per = [len(w.token_ids) for w in works]
        cached = [n - q for n, q in zip(lens, per, strict=True)]
        ids = int64_tensor([t for w in works for t in w.token_ids])
        positions = int64_tensor([p for w in works for p in w.positions])
        # One sequence with drafts: the verifying graph (keys turned forward); else the
        # decode graph (queries turned back), for plain decode rows and batches with drafts.
        verify = self.verify is not None and len(works) == 1 and per[0] > 1
        # The cached keys before the new tokens, at least 2 columns, and at least one turn
        # besides "none" (as compiled: `warmup`).
        width = max(2, *cached)
        turns = max(2, 1 + max(len(w.turns) for w in works))
        rows = int64_tensor([w.kv.row for w in works])
        index = self.slot_table.table[rows, :width].long()
        bias = torch.zeros(len(works), width)
        if min(cached) < width:  # a shorter sequence's padding
            seen = torch.arange(width)[None, :] < torch.tensor(cached)[:, None]
            bias.masked_fill_(~seen, float("-inf"))
            index.masked_fill_(~seen, 0)  # slot 0: zeros (KVPool), never NaN
        segment = torch.zeros(len(works), width, dtype=torch.long)
        if not any(w.turns for w in works):  # then turns is 2
            cos, sin = self._no_turns(len(works))
        else:
            kinds = len(self.model.rotaries)
            cos = torch.ones(kinds, len(works), turns, self.head_dim)
            sin = torch.zeros(kinds, len(works), turns, self.head_dim)
            for i, w in enumerate(works):
                for j, (start, end, delta) in enumerate(w.turns, 1):
                    segment[i, start:end] = j
                    for kind in range(kinds):
                        # cos, then sin turning keys forward or back
                        turn = self._turn(kind, delta)
                        cos[kind, i, j], sin[kind, i, j] = turn[0], turn[1 if verify else 2]
        # Row r of the step is of sequence of[r]; each row has its own bias (windows cut by
        # row).
        one_each = len(ids) == len(works)
        of = None if one_each else torch.repeat_interleave(torch.arange(len(works)),
                                                           torch.tensor(per))
        bias = self._windowed(works, bias, of, index, segment, positions)
        if verify:
            step, inputs = self.verify, (index, bias, segment, cos, sin)
        elif one_each:  # one row per sequence: its own new key alone
            step, inputs = self.step, (index, bias, segment, cos, sin, self._diagonal(len(ids)))
        else:
            # Row i reads row j's new key where both are of one sequence and j <= i.
            order = torch.arange(len(of))
            new_bias = torch.zeros(len(of), len(of))
            new_bias.masked_fill_((of[:, None] != of[None, :])
                                  | (order[None, :] > order[:, None]), float("-inf"))
            step = self.step
            inputs = (index[of], bias, segment[of], cos[:, of], sin[:, of], new_bias)
        # Dynamo's guards over the model's few hundred tensors cost ~4% of a SmolLM2 step;
        # only those that tell the graphs apart run. The rest cannot fail between steps:
        # the same model, pool and (inference-mode) input kinds every time.
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            logits, kv = step(self.model, self.pool, ids, positions, *inputs)
        # The slots from the host's lists: a step's host work costs ~10 us a torch op here.
        slots = int64_tensor([s for w in works for s in w.kv.slots[w.end - len(w.token_ids):w.end]])
        self.pool.kv.index_copy_(2, slots, kv)
        if self.model.has_windows:  # the new keys' positions, for later steps' windows
            self.pool.pos[slots] = positions.to(torch.int32)
        return logits

    def _windowed(self, works: Sequence, bias: torch.Tensor, of: torch.Tensor | None,
                  index: torch.Tensor, segment: torch.Tensor, positions: torch.Tensor
                  ) -> torch.Tensor:
        """Each attention kind's bias [kinds, rows, width] of the step's rows over their
        cached keys (`of`: each row's sequence, None for one row each; `bias`, `index`,
        `segment`: the sequences'): the padding's, and in a sliding-window kind
        also -inf where a key sits `window` or more positions before the row's query (the
        key's position as the sequence sees it: its slot's, turned forward by its range's
        delta, as the eager attention's `window_mask`); every kind's the same where no window
        cuts."""
        windows = self.model.windows
        if of is not None:
            bias = bias[of]
        if self.window is None or int(positions.max()) < self.window:  # no key that far back
            # Contiguous either way: the graphs are compiled for contiguous inputs.
            return bias[None] if len(windows) == 1 else torch.stack([bias] * len(windows))
        # Each turn's delta by its column of `segment` (0: none), built only here: steps that
        # no window cuts never pay for it.
        deltas = torch.zeros(len(works), 1 + max(len(w.turns) for w in works), dtype=torch.long)
        for i, w in enumerate(works):
            for j, (_, _, delta) in enumerate(w.turns, 1):
                deltas[i, j] = delta
        if of is not None:
            index, segment, deltas = index[of], segment[of], deltas[of]
        keys = self.pool.pos[index].long() + deltas.gather(1, segment)
        distance = positions[:, None] - keys
        return torch.stack([bias if w is None else bias.masked_fill(distance >= w, float("-inf"))
                            for w in windows])

    def _no_turns(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos 1, sin 0 [kinds, batch, 2, d]: no row turned (the 2 turns `warmup` compiles
        for)."""
        if batch not in self._unturned:
            shape = (len(self.model.rotaries), batch, 2, self.head_dim)
            self._unturned[batch] = (torch.ones(shape), torch.zeros(shape))
        return self._unturned[batch]

    def _diagonal(self, rows: int) -> torch.Tensor:
        """new_bias of a step of one row per sequence: each row sees its own new key."""
        if rows not in self._diagonals:
            self._diagonals[rows] = torch.full((rows, rows), float("-inf")).fill_diagonal_(0.0)
        return self._diagonals[rows]

    def _turn(self, kind: int, delta: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin turning a key forward by `delta` in attention kind `kind`'s RoPE, and sin
        turning a query back, [d] each (a request's deltas stay the same through its decode
        steps: kept, a few thousand at most)."""
        if (kind, delta) not in self._turns:
            if len(self._turns) > 4096:
                self._turns.clear()
            table = TurnTable.build(self.model.rotaries[kind], [delta])
            cos, back = table.for_queries()
            self._turns[kind, delta] = cos[0], table.sin[0], back[0]
        return self._turns[kind, delta]

    @torch.inference_mode()  # as the engine's steps run: grad mode is part of the graph's key
    def warmup(self) -> float:
        """Compile the decode step for any number of rows and every cached length from 2,
        before a request waits for it, and with drafts the verifying step of one sequence;
        reads slot 0, writes nothing. Returns the seconds it took.
        torch.compile specializes sizes 0 and 1 of a dynamic size: the decode graph's batch
        sizes (rows and sequences) are unbacked instead, so one graph serves a batch of one
        as well as larger ones (a graph of its own for one row had doubled the start-up, for
        a step no faster); widths, turns and drafted rows are at least 2. No duck sizing,
        which would tie a batch or a width to an equal weight dimension and compile again
        when they part."""
        import torch._inductor.config as inductor_config

        start = time.perf_counter()
        graphs = [self.step] if self.verify is None else [self.step, self.verify]
        for step in graphs:
            sequences = 2 if step is self.step else 1
            ids = torch.zeros(2, dtype=torch.long)
            positions = torch.full((2,), 2, dtype=torch.long)
            # Sizes: index, segment [sequences, width]; bias [kinds, rows, width]; the turns'
            # cos, sin [kinds, sequences, turns, d]; the decode graph's new_bias [rows, rows].
            kinds, d = len(self.model.rotaries), self.head_dim
            index, segment = (torch.zeros(sequences, 2, dtype=torch.long) for _ in range(2))
            bias = torch.zeros(kinds, 2, 2)
            cos, sin = torch.ones(kinds, sequences, 2, d), torch.zeros(kinds, sequences, 2, d)
            inputs = (index, bias, segment, cos, sin)
            dynamic = [(index, 1), (segment, 1), (bias, 2), (cos, 2), (sin, 2)]
            unbacked = [(ids, 0), (positions, 0), (bias, 1)]
            if step is self.step:
                inputs += (torch.zeros(2, 2),)  # new_bias
                unbacked += [(index, 0), (segment, 0), (cos, 1), (sin, 1), (inputs[-1], 0),
                             (inputs[-1], 1)]
            else:  # the drafted rows: at least 2
                dynamic, unbacked = dynamic + unbacked, []
            for t, dim in dynamic:
                torch._dynamo.mark_dynamic(t, dim)
            for t, dim in unbacked:
                torch._dynamo.decorators.mark_unbacked(t, dim)
            try:
                # Freezing: the weights become constants of the compiled code, not inputs
                # handed through its wrapper every step (0.7 ms of a 7 ms SmolLM2 step).
                # No size, stride and alignment checks of each kernel's output at every
                # step (debugging aids of the generated wrapper): 3% of a SmolLM2 step.
                with (torch.fx.experimental._config.patch(use_duck_shape=False),
                      inductor_config.patch(freezing=True, size_asserts=False,
                                            scalar_asserts=False, alignment_asserts=False)):
                    step(self.model, self.pool, ids, positions, *inputs)
            except Exception as e:
                raise RuntimeError(f"enable_torch_compile: compiling the decode step failed: "
                                   f"{type(e).__name__}: {e} (inductor needs a working C++ "
                                   "compiler)") from e
        return time.perf_counter() - start

"""The Triton kernels (attention, fused ops) against the torch code on random data: mixed batches of
prefill, chunk-style (gapped and shared slot lists), question-over-cache and decode rows, GQA
ratios and head sizes, several KV splits. On a GPU they run compiled (float32 and bfloat16);
on CPU through Triton's interpreter (conftest sets TRITON_INTERPRET=1), at small shapes."""

from __future__ import annotations

import random

import pytest
import torch

triton_kernels = pytest.importorskip("ragkv.model.backends.triton_kernels")
if not triton_kernels.available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from ragkv.cache.kv_pool import KVPool  # noqa: E402
from ragkv.model.backends import triton_attention  # noqa: E402
from ragkv.model.backends.base import AttentionBatch, AttentionMetadata  # noqa: E402
from ragkv.model.backends.torch_sdpa import TorchAttentionBackend  # noqa: E402
from ragkv.model.backends.triton_attention import TritonAttentionBackend  # noqa: E402
from ragkv.model.reposition import TurnTable  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICES = ["cuda"] if CUDA else ["cpu"]


def _batch(rng: random.Random, pool_slots: int, table_width: int, kinds: list[str],
           device: str):
    """Random sequences over one slot table: each sequence owns a row; shared slots model
    cached chunks read by several sequences."""
    shared = rng.sample(range(1, pool_slots), 40)  # a "cached chunk" several sequences read
    free = [s for s in range(1, pool_slots) if s not in set(shared)]
    rng.shuffle(free)
    table = torch.zeros(len(kinds) + 1, table_width, dtype=torch.int32)
    q_lens, kv_lens, kv_lists, rows, prefix = [], [], [], [], []
    for i, kind in enumerate(kinds):
        row = i + 1
        if kind == "prefill":
            q = k = rng.randint(1, 70)
            slots = [free.pop() for _ in range(k)]
            spans_prefix = True
        elif kind == "decode":
            k, q = rng.randint(1, 200), 1
            slots = [free.pop() for _ in range(k)]
            spans_prefix = True
        elif kind == "question":  # S + shared chunk + own question tokens
            q = rng.randint(2, 20)
            slots = [free.pop() for _ in range(5)] + shared + [free.pop() for _ in range(q)]
            k = len(slots)
            spans_prefix = True
        else:  # "chunk": S + the chunk's own slots, a gapped list (not a row prefix)
            q = rng.randint(1, 40)
            system = [free.pop() for _ in range(6)]
            slots = system + [free.pop() for _ in range(q)]
            k = len(slots)
            spans_prefix = False
        table[row, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
        q_lens.append(q)
        kv_lens.append(k)
        kv_lists.append(torch.tensor(slots, dtype=torch.int32))
        rows.append(row)
        prefix.append(spans_prefix)
    q_starts, total = [], 0
    for q in q_lens:
        q_starts.append(total)
        total += q
    table = table.to(device)
    kv_indices = [t.to(device) for t in kv_lists]
    write = torch.cat([idx[k - q:] for idx, q, k in zip(kv_indices, q_lens, kv_lens,
                                                        strict=True)]).long()
    return dict(q_lens=q_lens, kv_lens=kv_lens, q_starts=q_starts, kv_indices=kv_indices,
                write_slots=write, table=table, rows=rows, prefix=prefix), total


CASES = [
    # heads, kv_heads, head_dim, kinds
    (4, 2, 32, ["prefill", "decode", "chunk", "question", "decode"]),
    (4, 4, 64, ["decode", "decode", "decode"]),
    (8, 2, 16, ["question", "chunk", "prefill"]),
    (6, 2, 48, ["decode", "prefill", "decode", "chunk"]),
]
if CUDA:
    CASES += [(32, 8, 128, ["prefill", "decode", "chunk", "question"] * 3),
              (16, 2, 64, ["decode"] * 17 + ["question"])]


@pytest.mark.parametrize("pack", [None, False, True])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_backend_equals_torch_backend(case: int, device: str, dtype: torch.dtype, pack,
                                             monkeypatch):
    """pack None: the kernel decides whether a tile packs a group's heads; False / True:
    every extend launch does or does not."""
    heads, kv_heads, head_dim, kinds = CASES[case]
    _force_packing(monkeypatch, pack)
    rng = random.Random(case)
    torch.manual_seed(case)
    pool_slots = 2048
    spec, total = _batch(rng, pool_slots, 512, kinds, device)
    _compare_backends(spec, total, (heads, kv_heads, head_dim), dtype, device, seed=1)


def _force_packing(monkeypatch, pack: bool | None) -> None:
    if pack is not None:
        monkeypatch.setattr(triton_kernels, "extend_packs", lambda *a: pack)


def _compare_backends(spec: dict, total: int, shape: tuple[int, int, int], dtype: torch.dtype,
                      device: str, seed: int, slot_positions: torch.Tensor | None = None,
                      **extra) -> AttentionMetadata:
    """The torch and the Triton backend on the same random pool and q/k/v (`total` tokens,
    `shape` = heads, kv heads, head dim): both write the step's K/V to the same slots, and
    their outputs agree (1e-5 relative in float32, 1e-2 in bfloat16). `slot_positions`:
    the pool's key positions (a sliding window's `extra` reads them). Returns the Triton
    run's metadata."""
    heads, kv_heads, head_dim = shape
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        pool = KVPool(1, 2048, kv_heads, head_dim, dtype, torch.device(device))
        gen = torch.Generator().manual_seed(seed)
        pool.kv[:, :, 1:] = torch.randn(pool.kv[:, :, 1:].shape, generator=gen).to(pool.kv)
        q, k, v = (torch.randn(total, h, head_dim, generator=gen).to(device, dtype)
                   for h in (heads, kv_heads, kv_heads))
        if slot_positions is not None:
            pool.pos.copy_(slot_positions)
            extra["slot_positions"] = pool.pos
        batch = AttentionBatch(**spec, num_heads=heads, num_kv_heads=kv_heads, **extra)
        meta = AttentionMetadata(batch.write_slots, backend.prepare(batch))
        outs.append(backend.forward(q, k, v, 0, pool, meta, head_dim ** -0.5).float())
        outs.append(pool.kv.float())
    ref, ref_pool, got, got_pool = outs
    assert torch.equal(ref_pool, got_pool)
    assert torch.isfinite(got).all()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err
    return meta


def _turn_table(deltas: list[int], head_dim: int, device: str) -> TurnTable:
    """A step's turn table: cos, sin turning a key forward by each delta (default RoPE)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.tensor(deltas, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return TurnTable({d: i for i, d in enumerate(deltas)}, emb.cos().float().to(device),
                     emb.sin().float().to(device))


def _repositioned(spec: dict, rng: random.Random) -> list[tuple[tuple[int, int, int], ...]]:
    """Random re-positioned ranges over each sequence's KV list: none for some sequences, one
    to three disjoint ascending ranges for the others (delta table rows 0..3, shared)."""
    out = []
    for k in spec["kv_lens"]:
        if k < 4 or rng.random() < 0.3:
            out.append(())
            continue
        cuts = sorted(rng.sample(range(1, k), min(k - 1, 2 * rng.randint(1, 3))))
        out.append(tuple((a, b, rng.randrange(4)) for a, b in zip(cuts[::2], cuts[1::2],
                                                                    strict=False) if a < b))
    return out


def _indexed(spec: dict, rng: random.Random, device: str) -> dict:
    """Turns the "chunk" and "question" sequences of a `_batch` spec into selectively
    recomputed ones: queries at random entries of the list (the last always among them),
    each attending up to its own entry, writing its K/V there."""
    spec = dict(spec)
    q_lens, q_starts, index, writes = [], [], [], []
    total = 0
    written: set[int] = set()  # a slot is written once per step (the engine's invariant)
    for i, slots in enumerate(spec["kv_indices"]):
        k, q = spec["kv_lens"][i], spec["q_lens"][i]
        at = None
        if q > 1 and k > q:
            free = [j for j in range(k - 1) if int(slots[j]) not in written]
            at = sorted(set(rng.sample(free, rng.randint(1, min(len(free), 24)))) | {k - 1})
            q = len(at)
        q_lens.append(q)
        q_starts.append(total)
        total += q
        index.append(None if at is None else torch.tensor(at, device=device))
        writes.append(slots[k - q:] if at is None else slots[index[-1]])
        written.update(int(x) for x in writes[-1])
    spec.update(q_lens=q_lens, q_starts=q_starts, query_index=index,
                write_slots=torch.cat(writes).long())
    return spec, total


def _recompute_step(case: int, device: str, splits, pack, seed: int, monkeypatch):
    """CASES[case] as a step with queries at given entries and re-positioned ranges, the
    extend launch's KV splits and head packing forced where given: (heads, kv heads, head
    dim), the rng, the batch spec, its token count, the turns and their table."""
    heads, kv_heads, head_dim, kinds = CASES[case]
    if splits is not None:
        monkeypatch.setattr(triton_attention, "extend_splits", lambda *a: splits)
    _force_packing(monkeypatch, pack)
    rng = random.Random(seed + case)
    spec, _ = _batch(rng, 2048, 512, kinds, device)
    spec, total = _indexed(spec, rng, device)
    turns = _repositioned(spec, rng)
    table = _turn_table([7, -3, 250, 1000], head_dim, device)
    return (heads, kv_heads, head_dim), rng, spec, total, turns, table


@pytest.mark.parametrize("splits,pack", [(None, None), (3, False), (3, True), (1, True)])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernels_turn_re_positioned_keys_and_take_query_entries(case: int, device: str,
                                                                dtype: torch.dtype, splits,
                                                                pack, monkeypatch):
    """Re-positioned key ranges (turned in the kernels' K loads) and queries at given entries
    of their list (selective recompute) against the torch backend, which turns the queries
    instead and masks explicitly: decode rows, extend rows, KV splits, packed heads, shared
    chunk slots."""
    shape, rng, spec, total, turns, table = _recompute_step(case, device, splits, pack, 100,
                                                           monkeypatch)
    meta = _compare_backends(spec, total, shape, dtype, device, seed=case, turns=turns,
                             turn_table=table)
    # The kernels took them (no torch fallback is left in the Triton backend).
    state = meta.state
    decode = [i for i, q in enumerate(spec["q_lens"]) if q == 1 and spec["prefix"][i]]
    extend = [i for i in range(len(spec["q_lens"])) if i not in decode]
    if any(turns[i] for i in decode):
        assert state.decode.turns is not None
    if any(turns[i] for i in extend):
        assert state.extend.entry_turns is not None
    if any(spec["query_index"][i] is not None for i in extend):
        assert state.extend.q_limit is not None


def _windowed(spec: dict, turns: list, table: TurnTable, rng: random.Random, window: int,
              ordered: bool, device: str) -> tuple[dict, torch.Tensor]:
    """A sliding window over a `_batch` spec: each slot's key position (its entry's place in
    the first list holding it when `ordered`, else random, so a window hides scattered
    entries and whole blocks) and each query's position (its own entry's, turned, plus less
    than `window`: it always sees itself)."""
    pos = torch.tensor([rng.randrange(400) for _ in range(2048)], dtype=torch.int32)
    if ordered:
        done: set[int] = set()
        for slots in spec["kv_indices"]:
            for j, s in enumerate(slots.tolist()):
                if s not in done:
                    pos[s] = j
                    done.add(s)
    deltas = {row: d for d, row in table.rows.items()}
    query = []
    for i, slots in enumerate(spec["kv_indices"]):
        k, q = spec["kv_lens"][i], spec["q_lens"][i]
        index = spec.get("query_index", [None] * len(spec["q_lens"]))[i]
        entries = list(range(k - q, k)) if index is None else index.tolist()
        for e in entries:
            turned = int(pos[slots[e]]) + sum(deltas[row] for a, b, row in turns[i]
                                             if a <= e < b)
            query.append(turned + (0 if ordered else rng.randrange(window)))
    return dict(window=window, windowed=[True] * len(spec["q_lens"]),
                query_positions=torch.tensor(query, device=device)), pos.to(device)


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("splits,pack", [(None, None), (3, False), (3, True)])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernels_apply_sliding_windows(case: int, device: str, splits, pack, ordered: bool,
                                       monkeypatch):
    """A sliding window (key position = slot position + turn delta) in both kernels against
    the torch backend: decode and extend rows, re-positioned keys, query entries, KV splits
    and packed heads; positions in list order (a window over a prompt) and scattered (blocks
    out of every row's window are skipped, rows that see nothing in a KV slice)."""
    shape, rng, spec, total, turns, table = _recompute_step(case, device, splits, pack, 200,
                                                           monkeypatch)
    window, positions = _windowed(spec, turns, table, rng, 24, ordered, device)
    meta = _compare_backends(spec, total, shape, torch.float32, device,
                             seed=case, slot_positions=positions, turns=turns,
                             turn_table=table, **window)
    state = meta.state
    for launch in (state.decode, state.extend):
        assert launch is None or launch.window is not None


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got - want).norm() / want.norm()).item()


# What merging KV slices may cost beyond the unsplit kernel: the merge rescales each slice's
# partial sums by exp(m_slice - m), a rounding or two per element in float32. A merge that
# dropped, double-counted or mis-weighted a slice is off by orders of magnitude more.
MERGE_TOL = 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits,pack", [(2, False), (5, False), (5, True)])
def test_extend_kv_splits_merge_to_the_unsplit_result(device: str, splits: int, pack: bool,
                                                      monkeypatch):
    """Query blocks over long lists cut into KV slices (rows that see nothing in a slice, a
    chunk job's gapped list, a fresh prefill) merge to the unsplit kernel's result within the
    merge's rounding (MERGE_TOL); the unsplit kernel matches the torch backend (1e-5)."""
    _force_packing(monkeypatch, pack)
    rng = random.Random(splits)
    heads, kv_heads, head_dim = 4, 2, 32
    spec, total = _batch(rng, 2048, 512, ["question", "chunk", "prefill", "decode"], device)
    outs = []
    for backend, n in ((TorchAttentionBackend(), None), (TritonAttentionBackend(), 1),
                       (TritonAttentionBackend(), splits)):
        monkeypatch.setattr(triton_attention, "extend_splits", lambda *a, n=n: n)
        pool = KVPool(1, 2048, kv_heads, head_dim, torch.float32, torch.device(device))
        gen = torch.Generator().manual_seed(3)
        pool.kv[:, :, 1:] = torch.randn(pool.kv[:, :, 1:].shape, generator=gen).to(pool.kv)
        q, k, v = (torch.randn(total, h, head_dim, generator=gen).to(device)
                   for h in (heads, kv_heads, kv_heads))
        batch = AttentionBatch(**spec, num_heads=heads, num_kv_heads=kv_heads)
        meta = AttentionMetadata(batch.write_slots, backend.prepare(batch))
        outs.append(backend.forward(q, k, v, 0, pool, meta, head_dim ** -0.5))
        if n is not None:
            assert meta.state.extend.splits == n
    ref, unsplit, split = outs
    assert _relative(unsplit, ref) < 1e-5
    assert _relative(split, unsplit) < MERGE_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [3, 8])
def test_decode_splits_merge_to_the_unsplit_result(device: str, splits: int):
    """A sequence's KV cut into slices (some empty for short sequences) merges to the unsplit
    kernel's attention within the merge's rounding (MERGE_TOL); the unsplit kernel matches
    the torch backend (1e-5). Lengths and rows are read on the device."""
    rng = random.Random(splits)
    spec, total = _batch(rng, 2048, 512, ["decode"] * 5, device)
    kv_heads, heads, head_dim = 2, 4, 32
    pool = KVPool(1, 2048, kv_heads, head_dim, torch.float32, torch.device(device))
    pool.kv[:, :, 1:] = torch.randn(pool.kv[:, :, 1:].shape).to(pool.kv)
    q = torch.randn(total, heads, head_dim, device=device)
    batch = AttentionBatch(**spec, num_heads=heads, num_kv_heads=kv_heads)
    ref_backend = TorchAttentionBackend()
    meta = AttentionMetadata(batch.write_slots, ref_backend.prepare(batch))
    ref = ref_backend.forward(q, pool.k[0][meta.write_slots], pool.v[0][meta.write_slots], 0,
                              pool, meta, head_dim ** -0.5)
    dev = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    outs = []
    for n in (1, splits):
        out = torch.full_like(q, float("nan"))
        triton_kernels.decode_attention(q, pool.k[0], pool.v[0], out, batch.table,
                                        dev(batch.rows), dev(batch.kv_lens),
                                        dev(batch.q_starts), n, head_dim ** -0.5)
        outs.append(out)
    unsplit, split = outs
    assert _relative(unsplit, ref) < 1e-5
    assert _relative(split, unsplit) < MERGE_TOL


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []))
@pytest.mark.parametrize("device", DEVICES)
def test_fused_ops_equal_the_torch_ops(device: str, dtype: torch.dtype):
    """RMSNorm (with the residual add), SiLU-mul and RoPE + KV store against the model's
    torch ops on random data (a yarn-style cos/sin scale included)."""
    from ragkv.model.backends import triton_ops
    from ragkv.model.layers import RMSNorm, apply_rotary

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    dev = torch.device(device)

    def close(got, want):
        got, want = got.float(), want.float()
        assert torch.isfinite(got).all()
        assert ((got - want).norm() / want.norm()).item() < tol

    tokens, hidden = 7, 96
    norm = RMSNorm(hidden, 1e-5, dtype, dev)
    norm.weight.copy_(torch.randn(hidden) * 0.5 + 1)
    x = torch.randn(tokens, hidden).to(dev, dtype)
    res = torch.randn(tokens, hidden).to(dev, dtype)
    want_out, want_total = norm.forward_add(x, res)
    got_out, got_total = triton_ops.rms_norm(x, norm.weight, norm.eps, res)
    close(got_total, want_total)
    close(got_out, want_out)
    close(triton_ops.rms_norm(x, norm.weight, norm.eps), norm.forward(x))

    gate_up = torch.randn(tokens, 2 * 80).to(dev, dtype)
    gate, up = gate_up.split(80, dim=-1)
    close(triton_ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)

    heads, kv_heads, head_dim, slots_n = 4, 2, 32, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dev, dtype)
    angles = torch.rand(tokens, head_dim // 2) * 6
    cos = (torch.cat([angles.cos()] * 2, -1) * 1.1).to(dev, dtype)
    sin = (torch.cat([angles.sin()] * 2, -1) * 1.1).to(dev, dtype)
    slots = torch.randperm(slots_n - 1)[:tokens].add(1).to(dev)
    k_cache = torch.zeros(slots_n, kv_heads, head_dim, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    q = triton_ops.rope_store(qkv, cos, sin, heads, kv_heads, head_dim, k_cache, v_cache, slots)
    view = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
    close(q, apply_rotary(view[:, :heads], cos, sin))
    close(k_cache[slots], apply_rotary(view[:, heads:heads + kv_heads], cos, sin))
    close(v_cache[slots], view[:, heads + kv_heads:])
    # Keys at their own positions (selectively recomputed tokens): q by cos/sin, k by others.
    key_cos, key_sin = cos.flip(0), sin.flip(0)
    q = triton_ops.rope_store(qkv, cos, sin, heads, kv_heads, head_dim, k_cache, v_cache,
                              slots, (key_cos, key_sin))
    close(q, apply_rotary(view[:, :heads], cos, sin))
    close(k_cache[slots], apply_rotary(view[:, heads:heads + kv_heads], key_cos, key_sin))
    untouched = torch.ones(slots_n, dtype=torch.bool, device=dev)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def _compiled_variants() -> int | None:
    """How many compiled variants the attention kernels hold on this GPU (None where
    Triton's cache cannot be read: the interpreter, another Triton version)."""
    total = 0
    for fn in (triton_kernels._extend_kernel, triton_kernels._decode_kernel,
               triton_kernels._merge_kernel):
        caches = getattr(fn, "device_caches", None)
        if not CUDA or caches is None:
            return None
        total += sum(len(entry[0]) for entry in caches.values())
    return total


@pytest.mark.parametrize("device", DEVICES)
def test_warmup_compiles_every_variant_and_touches_no_slot(device: str):
    """The start-up warm-up runs every kernel variant (splits, re-positioned keys, query
    entries, sliding windows, merge tiles) reading only the padding slot; on a GPU, a varied
    workload after it compiles nothing new."""
    heads, kv_heads, head_dim = 4, 2, 32
    pool = KVPool(2, 2048, kv_heads, head_dim, torch.float32, torch.device(device))
    pool.kv[:, :, 1:] = torch.randn(pool.kv[:, :, 1:].shape).to(pool.kv)
    before = pool.kv.clone()
    table = torch.zeros(3, 64, dtype=torch.int32, device=device)
    backend = TritonAttentionBackend()
    backend.warmup(pool, heads, table, 0, windows=True)
    assert torch.equal(pool.kv, before) and not pool.pos.any()
    compiled = _compiled_variants()
    # CASES[0] has the warm-up's head shape (another shape is another kernel).
    assert CASES[0][:3] == (heads, kv_heads, head_dim)
    for splits, pack in ((None, None), (2, False), (7, True)):
        with pytest.MonkeyPatch.context() as patch:
            test_kernels_turn_re_positioned_keys_and_take_query_entries(
                0, device, torch.float32, splits, pack, patch)
            test_kernels_apply_sliding_windows(0, device, splits, pack, False, patch)
    if compiled is not None:
        assert _compiled_variants() == compiled

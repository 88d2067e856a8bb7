"""RAG layouts beyond the default (docs/rag.md): `sequential` positions and
`standalone` chunks, whose cached keys are used at positions other than the ones they were
computed at, rotated at attention time.

Every output is checked against the one-pass reference of its layout (reference.py's
`layout_reference`): greedy tokens identical and first-token logprobs within 1e-4 in float32,
with the pool NaN-filled, cold, warm, reordered, in subsets, with the same chunk at several
positions in one batch, duplicates, eviction in between, chunked prefill, preemption, salts,
n > 1; `check_integrity()` after each (test_rag's `run`). Below them, the rotation itself:
rotating a key computed at p by d equals the key computed at p + d, and attention with turned
queries equals attention over rotated keys.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import MAIN_FAMILIES, random_prompt
from reference import layout_reference, rag_layout
from test_rag import GREEDY, TOL, check_outputs, make_llm, plain, rag, reference, run

from ragkv import LLM, SamplingParams
from ragkv.model.backends.base import AttentionBatch, causal_mask
from ragkv.model.backends.torch_sdpa import (
    build_decode_turns,
    turn_keys,
    turned_attention,
    turned_decode,
    turned_keys_attention,
)
from ragkv.model.layers import RotaryEmbedding, apply_rotary
from ragkv.model.reposition import TurnTable

SEQ_ISO = ("sequential", "isolated")
SHARED_ALONE = ("shared", "standalone")
SEQ_ALONE = ("sequential", "standalone")
LAYOUTS = [SEQ_ISO, SHARED_ALONE, SEQ_ALONE]
LAYOUT_IDS = ["sequential-isolated", "shared-standalone", "sequential-standalone"]


@pytest.fixture(scope="module")
def llama(checkpoint, hf_model):
    path = checkpoint("llama")
    return path, hf_model(path)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def triton_model(request, checkpoint, hf_model):
    """The models of the Triton tests: Llama, and Gemma 3 (two attention kinds, sliding
    windows shorter than the prompts)."""
    path = checkpoint(request.param)
    return path, hf_model(path)


# ------------------------------------------------------------------------- the reference


def test_reference_of_the_default_layout_is_the_shared_isolated_one():
    S, chunks, Q = [5] * 7, [[6] * 4, [7] * 9, [8] * 2], [9] * 3
    ids, positions, visible, hidden = layout_reference(S, chunks, Q)
    want_positions, want_visible = rag_layout(7, [4, 9, 2], 3)
    assert ids == S + [t for c in chunks for t in c] + Q
    assert positions == want_positions and torch.equal(visible, want_visible)
    assert not hidden.any()


def test_reference_places_a_copy_of_s_before_each_later_isolated_chunk():
    """Sequential + isolated: chunk 2 (flat start 7) sees S at positions 4..6, through a copy
    only it sees; the question sees S itself at 0..2 and both chunks."""
    S, A, B, Q = [1, 2, 3], [4] * 4, [5] * 2, [6, 7]
    ids, positions, visible, hidden = layout_reference(S, [A, B], Q, *SEQ_ISO)
    assert ids == S + A + S + B + Q
    assert positions == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8, 9, 10]
    assert hidden.tolist() == [False] * 7 + [True] * 3 + [False] * 4
    assert visible[10].nonzero().flatten().tolist() == [7, 8, 9, 10]  # B's first token
    assert visible[12].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 10, 11, 12]


# ---------------------------------------------------------------------- layouts end to end


def layout_scenarios(llm, hf, layout) -> None:
    S = random_prompt(9, seed=1)
    A, B, C, D = (random_prompt(n, seed=10 + n) for n in (14, 22, 6, 17))
    Q1, Q2 = random_prompt(5, seed=2), random_prompt(7, seed=3)

    def p(chunks, q, salt=None):
        return rag(S, chunks, q, salt, layout)

    out = run(llm, hf, [p([A, B, C], Q1)], ["MMM"])[0]
    assert out.num_cached_tokens == 0
    # Warm and reordered: every chunk now sits elsewhere than where it was computed.
    out = run(llm, hf, [p([C, A, B], Q1)], ["HHH"])[0]
    assert out.num_cached_tokens == len(S) + len(A) + len(B) + len(C)
    repositioned = out.metrics.num_repositioned_tokens
    if layout == SEQ_ISO:  # the first chunk stays where it was computed (right after S)
        assert repositioned == len(A) + len(B)
    else:
        assert repositioned == len(A) + len(B) + len(C)
    # A subset with a new chunk; the same cold chunk twice (computed once).
    run(llm, hf, [p([B, D], Q2)], ["HM"])
    run(llm, hf, [p([D, A, D], Q2)], ["HHH"])
    # The same chunks at several positions in one batch, beside plain prompts.
    run(llm, hf, [p([A, B], Q1), plain(random_prompt(20, seed=5)), p([B, A, C], Q2),
                  p([C, B], Q1), p([D], Q2)], ["HH", "", "HHH", "HH", "H"])
    stats = llm.get_chunk_cache_stats()
    assert stats.cached_chunks == 4
    assert stats.repositioned_tokens >= repositioned


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("family", MAIN_FAMILIES)
def test_layouts_match_reference(family, layout, checkpoint, hf_model):
    """Every family and static RoPE type (default, linear, llama3, yarn with its attention
    factor; Mistral, Qwen2 with tied embeddings, Qwen3 with q/k norms)."""
    path = checkpoint(family)
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512)
    layout_scenarios(llm, hf_model(path), layout)


def test_layout_as_engine_default(llama):
    """position_strategy / chunk_attention in the config are the default of every prompt, and
    a prompt's own choice overrides them."""
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024, position_strategy="sequential", recompute="none",
                   chunk_attention="standalone", chunk_separator="##")
    S = random_prompt(8, seed=30)
    A, B = random_prompt(12, seed=31), random_prompt(19, seed=32)
    q = random_prompt(4, seed=33)
    out = run(llm, hf, [rag(S, [A, B], q)], ["MM"])[0]
    assert out.metrics.num_repositioned_tokens == len(A) + len(B)
    # Shared + isolated for this prompt: other entries (a standalone key leaves S out).
    out = run(llm, hf, [rag(S, [B, A], q, layout=("shared", "isolated"))], ["MM"])[0]
    assert out.metrics.num_repositioned_tokens == 0
    # A string prompt takes the engine's layout too.
    tok = llm.get_tokenizer()
    text = llm.generate("sys ## doc a ## doc b ## question?", GREEDY, use_tqdm=False)[0]
    llm.check_integrity()
    by_ids = rag(tok.encode("sys", add_special_tokens=True),
                 [tok.encode("doc a", add_special_tokens=False),
                  tok.encode("doc b", add_special_tokens=False)],
                 tok.encode("question?", add_special_tokens=False))
    check_outputs(hf, [by_ids], [text], llm)


def test_standalone_chunk_hits_under_any_system_prompt(llama):
    """A standalone chunk's KV does not depend on S: one entry serves every system prompt.
    An isolated chunk's does, so another S misses."""
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512)
    S1, S2 = random_prompt(9, seed=40), random_prompt(14, seed=41)
    A, B = random_prompt(16, seed=42), random_prompt(11, seed=43)
    q = random_prompt(5, seed=44)
    for layout in (SHARED_ALONE, SEQ_ALONE):
        marks = "MM" if layout == SHARED_ALONE else "HH"
        run(llm, hf, [rag(S1, [A, B], q, layout=layout)], [marks])
        run(llm, hf, [rag(S2, [B, A], q, layout=layout)], ["HH"])
        run(llm, hf, [rag([], [A], q, layout=layout)], ["H"])  # no system prompt at all
    assert llm.get_chunk_cache_stats().cached_chunks == 2
    shared_iso = ("shared", "isolated")
    run(llm, hf, [rag(S1, [A, B], q, layout=shared_iso)], ["MM"])
    run(llm, hf, [rag(S2, [A, B], q, layout=shared_iso)], ["MM"])  # its KV depends on S
    # The position strategy is not part of the key: sequential reuses shared's entries.
    run(llm, hf, [rag(S1, [B, A], q, layout=SEQ_ISO)], ["HH"])
    run(llm, hf, [rag(S2, [A, B], q, layout=SEQ_ISO)], ["HH"])
    # Standalone (2), isolated under S1 (2) and under S2 (2).
    assert llm.get_chunk_cache_stats().cached_chunks == 6
    # Salts still separate tenants.
    run(llm, hf, [rag(S2, [A], q, salt="t", layout=SEQ_ALONE)], ["M"])


def test_eviction_chunked_prefill_and_preemption_under_sequential(llama):
    path, hf = llama
    # A chunk region for three 20-token chunks, 8 tokens a step, and a general region that
    # makes the running requests (three long plain prompts among them) preempt each other.
    llm = make_llm(path, kv_cache_tokens=150, chunk_cache_tokens=64, max_model_len=80,
                   max_num_batched_tokens=8)
    S = random_prompt(6, seed=50)
    A, B, C, D = (random_prompt(20, seed=51 + i) for i in range(4))
    prompts = [rag(S, chunks, random_prompt(5, seed=60 + i), layout=layout)
               for i, (chunks, layout) in enumerate([
                   ([A, B, C], SEQ_ISO), ([C, D], SEQ_ALONE), ([D, A], SEQ_ISO),
                   ([B, C, A], SHARED_ALONE), ([A, D, B], SEQ_ISO)])]
    prompts += [plain(random_prompt(40, seed=65 + i)) for i in range(3)]
    outs = run(llm, hf, prompts)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert llm.get_chunk_cache_stats().evictions > 0
    run(llm, hf, prompts[::-1])


def test_n_samples_and_logprobs_under_sequential(llama):
    """n > 1 shares the prompt's chunk entries; seeded sampling is reproducible and greedy
    sampling equals the reference for every sample."""
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024)
    S = random_prompt(7, seed=70)
    A, B = random_prompt(15, seed=71), random_prompt(9, seed=72)
    prompt = rag(S, [A, B], random_prompt(4, seed=73), layout=SEQ_ISO)
    greedy = SamplingParams(n=3, max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    out = llm.generate(prompt, greedy, use_tqdm=False)[0]
    llm.check_integrity()
    want, first = reference(hf, prompt, SEQ_ISO)
    for completion in out.outputs:
        assert completion.token_ids == want
        for tid, lp in completion.logprobs[0].items():
            assert abs(lp.logprob - first[tid].item()) < TOL
    sampled = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    again = [llm.generate(rag(S, [B, A], [3, 4], layout=SEQ_ISO), sampled, use_tqdm=False)[0]
             for _ in range(2)]
    llm.check_integrity()
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in again[1].outputs]


def test_uncached_chunks_are_re_positioned_too(llama):
    """With the chunk cache off (or too small), chunks are computed in the general region at
    their base positions and re-positioned like cached ones."""
    path, hf = llama
    S = random_prompt(8, seed=80)
    A, B = random_prompt(13, seed=81), random_prompt(10, seed=82)
    for kwargs in (dict(enable_chunk_cache=False), dict(chunk_cache_tokens=5)):
        llm = make_llm(path, kv_cache_tokens=1024, **kwargs)
        for layout in LAYOUTS:
            run(llm, hf, [rag(S, [A, B], random_prompt(4, seed=83), layout=layout),
                          rag(S, [B, A, B], random_prompt(3, seed=84), layout=layout)])
        assert llm.get_chunk_cache_stats().cached_chunks == 0


@pytest.mark.parametrize("layout", [SEQ_ISO, SEQ_ALONE], ids=LAYOUT_IDS[::2])
def test_layouts_on_the_triton_backend(layout, triton_model):
    """Re-positioned keys through the Triton kernels (interpreted without a GPU), sliding
    windows too; plain and RAG sequences in one batch."""
    pytest.importorskip("triton")
    path, hf = triton_model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512, device=device,
                   dtype="float32", attention_backend="triton")
    S = random_prompt(9, seed=90)
    A, B = random_prompt(14, seed=91), random_prompt(8, seed=92)
    run(llm, hf, [rag(S, [A, B], random_prompt(5, seed=93), layout=layout),
                  plain(random_prompt(12, seed=94))], ["MM", ""])
    run(llm, hf, [rag(S, [B, A], random_prompt(4, seed=95), layout=layout)], ["HH"])


def _triton_llm(triton_model, **kwargs):
    """The Triton engine (float32; CUDA graphs on a GPU, the interpreter without) and HF."""
    path, hf = triton_model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512, device=device,
                    dtype="float32", attention_backend="triton", max_num_seqs=4,
                    **kwargs), hf


class _EagerGraph:
    """Stands in for a captured CUDA graph where there is no GPU: a replay runs the step the
    graph would have captured (`forward`), on the same persistent input buffers, into the
    same logits."""

    def __init__(self, forward, rows: int, vocab: int) -> None:
        self.forward = forward
        self.logits = torch.empty(rows, vocab)
        self.replays = 0

    def replay(self) -> None:
        self.logits.copy_(self.forward())
        self.replays += 1


def _stand_in_graphs(graphs, rows) -> None:
    """Every (size, variant) graph of `graphs` (DecodeGraphs or ExtendGraphs) replaced by a
    stand-in replaying the step it would capture, into logits of `rows(size)` rows."""
    vocab = graphs.model.config.vocab_size
    for size in graphs.sizes:
        for variant in graphs.variants:
            stand_in = _EagerGraph(graphs.graph_forward(size, variant), rows(size), vocab)
            graphs.graphs[(size, variant)] = (stand_in, stand_in.logits)


@pytest.mark.parametrize("layout", [SEQ_ISO, SEQ_ALONE], ids=LAYOUT_IDS[::2])
def test_decode_graphs_take_re_positioned_ranges(layout, triton_model, monkeypatch):
    """Decode steps of re-positioned requests run through the CUDA-graph path: ranges and the
    cos/sin of their deltas go into the graph's persistent buffers, a batch padded to the
    next graph size, plain and re-positioned rows mixed, buffers left over from an earlier
    step with more ranges. On a GPU the engine's real graphs; without one, the graph
    replays are stand-ins that run the same forward on the same buffers (Triton
    interpreted)."""
    pytest.importorskip("triton")
    from ragkv.model.backends.cuda_graph import DecodeGraphs

    llm, hf = _triton_llm(triton_model)
    engine = llm.engine
    graphs = engine.runner.graphs
    if graphs is None:
        graphs = DecodeGraphs(engine.model, engine.pool, engine.runner.backend,
                              engine.runner.slot_table, 4, engine.max_model_len)
        _stand_in_graphs(graphs, rows=lambda size: size)
        engine.runner.graphs = graphs
    runs = []
    original = graphs.run
    monkeypatch.setattr(graphs, "run", lambda works: runs.append(
        sum(len(w.turns) for w in works)) or original(works))
    S = random_prompt(9, seed=90)
    A, B, C = random_prompt(14, seed=91), random_prompt(8, seed=92), random_prompt(11, seed=93)
    run(llm, hf, [rag(S, [A, B, C], random_prompt(5, seed=94), layout=layout),
                  plain(random_prompt(12, seed=95)),
                  rag(S, [C, A], random_prompt(4, seed=96), layout=layout)])
    run(llm, hf, [rag(S, [B], random_prompt(6, seed=97), layout=layout),
                  plain(random_prompt(7, seed=98))])
    run(llm, hf, [plain(random_prompt(10, seed=99))])
    assert runs and max(runs) > 0 and min(runs) == 0
    replays = {key: g.replays for key, (g, _) in graphs.graphs.items()
               if isinstance(g, _EagerGraph)}
    if replays:  # steps with re-positioned rows ran the turning graph, the others the plain
        assert sum(n for (_, variant), n in replays.items() if variant == "turning") > 0
        assert sum(n for (_, variant), n in replays.items() if variant == "plain") > 0


def _extend_graphed_llm(triton_model, max_tokens: int):
    """The Triton engine with its extend graphs up to `max_tokens` (stand-ins without a GPU),
    HF, and the graphs."""
    from ragkv.model.backends.cuda_graph import ExtendGraphs

    llm, hf = _triton_llm(triton_model, max_num_batched_tokens=max_tokens)
    engine = llm.engine
    graphs = engine.runner.extend_graphs
    if graphs is None:
        graphs = ExtendGraphs(engine.model, engine.pool, engine.runner.backend,
                              engine.runner.slot_table, max_tokens, engine.max_model_len)
        _stand_in_graphs(graphs, rows=lambda size: 1)
        engine.runner.extend_graphs = graphs
    return llm, hf, graphs


def test_extend_graphs_serve_short_single_sequence_steps(triton_model, monkeypatch):
    """Steps of one sequence with a few new tokens (a warm question over cached chunks, a short
    prompt, the last piece of a chunked prefill) run through the extend graphs: the list
    copied into the persistent index buffer, the tokens padded to the next graph size by a
    second sequence over the padding slot; re-positioned keys turned through the graphs' turn
    buffers. Batched and non-sampling steps stay eager. On a GPU the engine's real graphs;
    without one, stand-ins that run the same forward on the same buffers (Triton
    interpreted)."""
    pytest.importorskip("triton")
    llm, hf, graphs = _extend_graphed_llm(triton_model, 32)
    assert graphs.sizes == [8, 16, 32]
    runs = []
    original = graphs.run
    monkeypatch.setattr(graphs, "run", lambda works: runs.append(
        (len(works[0].token_ids), len(works[0].turns))) or original(works))
    S = random_prompt(9, seed=80)
    A, B = random_prompt(14, seed=81), random_prompt(8, seed=82)
    run(llm, hf, [rag(S, [A, B], random_prompt(5, seed=83))])  # cold: the question is graphed
    run(llm, hf, [rag(S, [B, A], random_prompt(8, seed=84))])  # warm, a full graph size
    run(llm, hf, [plain(random_prompt(3, seed=85))])  # a fresh prompt, padded to 8
    run(llm, hf, [plain(random_prompt(45, seed=86))])  # chunked: 32 eager, then 13 graphed
    assert len(runs) >= 4 and (13, 0) in runs and (8, 0) in runs
    # Re-positioned chunks, cold then warm in another order: the warm question and the
    # decode steps run the turning graphs (turn rows of an earlier, longer list left behind).
    run(llm, hf, [rag(S, [A, B], random_prompt(4, seed=87), layout=SEQ_ALONE)])
    run(llm, hf, [rag(S, [B, A], random_prompt(6, seed=90), layout=SEQ_ALONE)])
    run(llm, hf, [rag(S, [B], random_prompt(5, seed=91), layout=SEQ_ALONE)])
    assert (6, 2) in runs and (5, 1) in runs
    graphed = len(runs)
    # Batched steps stay eager (their decode steps go to the decode graphs).
    run(llm, hf, [plain(random_prompt(6, seed=88)), plain(random_prompt(7, seed=89))])
    assert len(runs) == graphed
    replays = [g.replays for g, _ in graphs.graphs.values() if isinstance(g, _EagerGraph)]
    if replays:
        assert sum(replays) == graphed


def test_extend_graphs_serve_recompute_steps(triton_model, monkeypatch):
    """A recomputed request's last step (its chosen chunk tokens at their entries of the list,
    then its question) runs as one sequence through the "indexed" extend graph: at r = 1 the
    full prefill of the flat prompt (HF), between the ends the same tokens and first-token
    logprobs as the eager torch engine, with and without re-positioned chunks. On a GPU the
    engine's real graphs; without one, stand-ins (Triton interpreted)."""
    pytest.importorskip("triton")
    from test_recompute import check, rc

    llm, hf, graphs = _extend_graphed_llm(triton_model, 64)
    engine = llm.engine
    runs = []
    original = graphs.run
    monkeypatch.setattr(graphs, "run", lambda works: runs.append(
        tuple(len(w.token_ids) for w in works)) or original(works))
    S, A, B, C = (random_prompt(n, seed=160 + n) for n in (7, 19, 11, 23))
    llm.generate([rag(S, [A, B, C], random_prompt(3, seed=169))], GREEDY, use_tqdm=False)
    # r = 1, warm: every chunk token after the (exact) first chunk recomputed with the
    # question, in one graph of 64.
    prompt = rc(S, [B, A], random_prompt(5, seed=170), "query", 1.0)
    check(hf, prompt, llm.generate([prompt], GREEDY, use_tqdm=False)[0], "full")
    llm.check_integrity()
    assert (19, 5) in runs
    # Between the ends: against the torch engine run eagerly.
    prompts = [rc(S, [C, A], random_prompt(6, seed=171), "query", 0.4),
               rc(S, [A, C], random_prompt(4, seed=172), "sink+blend", 0.3),
               rc(S, [B, A, C], random_prompt(5, seed=173), "query", 0.5)]
    got = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    llm.check_integrity()
    assert len([r for r in runs if len(r) == 2]) == 4
    ref = make_llm(triton_model[0], kv_cache_tokens=2048, chunk_cache_tokens=512,
                   dtype="float32",
                   attention_backend="torch", device=engine.pool.kv.device.type)
    for prompt, g in zip(prompts, got, strict=True):
        want = ref.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert g.metrics.num_recomputed_tokens == want.metrics.num_recomputed_tokens > 0
        assert g.outputs[0].token_ids == want.outputs[0].token_ids
        first_want, first_got = want.outputs[0].logprobs[0], g.outputs[0].logprobs[0]
        assert first_got.keys() == first_want.keys()
        for tid, lp in first_got.items():
            assert abs(lp.logprob - first_want[tid].logprob) < TOL, (tid, lp.logprob)
    replays = {key: g.replays for key, (g, _) in graphs.graphs.items()
               if isinstance(g, _EagerGraph)}
    if replays:
        assert sum(n for (_, variant), n in replays.items() if variant == "indexed") == 4


def test_dynamic_rope_refuses_re_positioning(checkpoint):
    """Dynamic-NTK frequencies depend on the sequence length, so a rotated key would not be
    the key at its new position: re-positioning layouts are refused, clearly."""
    path = checkpoint("dynamic")
    with pytest.raises(ValueError, match="dynamic-NTK"):
        LLM(path, kv_cache_tokens=512, position_strategy="sequential")
    with pytest.raises(ValueError, match="dynamic-NTK"):
        LLM(path, kv_cache_tokens=512, recompute="query")
    # Its default is the exact shared layout, not the quality mode it cannot serve.
    llm = LLM(path, kv_cache_tokens=512)
    assert (llm.engine.config.position_strategy, llm.engine.config.recompute) == ("shared",
                                                                                   "none")
    S, A, q = random_prompt(5, seed=1), random_prompt(6, seed=2), random_prompt(3, seed=3)
    for layout in LAYOUTS:
        with pytest.raises(ValueError, match="dynamic-NTK"):
            llm.generate(rag(S, [A], q, layout=layout), GREEDY, use_tqdm=False)
    llm.check_integrity()
    # The default layout and chunk-less prompts with any layout are fine.
    llm.generate([rag(S, [A], q), rag(S, [], q, layout=SEQ_ALONE)], GREEDY, use_tqdm=False)
    llm.check_integrity()


@pytest.mark.parametrize("bad", [
    dict(position_strategy="interleaved"), dict(chunk_attention="global"),
    dict(position_strategy=1),
])
def test_bad_layout_names_are_clear_errors(bad, llama):
    path, _ = llama
    with pytest.raises(ValueError, match=next(iter(bad))):
        LLM(path, kv_cache_tokens=256, **bad)
    llm = LLM(path, kv_cache_tokens=256)
    S, A, q = random_prompt(5, seed=1), random_prompt(6, seed=2), random_prompt(3, seed=3)
    with pytest.raises(ValueError, match=next(iter(bad))):
        llm.generate(rag(S, [A], q, layout=(bad.get("position_strategy"),
                                           bad.get("chunk_attention"))), GREEDY,
                     use_tqdm=False)
    with pytest.raises(ValueError, match=next(iter(bad))):
        llm.generate({"prompt": "s ## a ## q", **bad}, GREEDY, use_tqdm=False)
    llm.check_integrity()


# ------------------------------------------------------------------------------ the rotation

ROPES = {
    "default": {"rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
             "rope_theta": 10000.0},
}


def _rotated_keys(rope: dict, dtype: torch.dtype, max_pos: int, seed: int = 0):
    """(keys computed at p then rotated by d, keys computed at p + d, the same at p + d in
    float64: exact angles), for random keys, positions and deltas of either sign."""
    gen = torch.Generator().manual_seed(seed)
    rot = RotaryEmbedding(64, rope, 512, 2 * max_pos, dtype, torch.device("cpu"))
    k = torch.randn(256, 4, 64, generator=gen)
    p = torch.randint(0, max_pos, (256,), generator=gen)
    d = torch.randint(0, max_pos, (256,), generator=gen) - p // 2
    at_p = apply_rotary(k.to(dtype), rot.cos_table[p], rot.sin_table[p])
    cos, sin = rot.rotation(d.tolist())  # float32, applied in float32 (as attention does)
    moved = apply_rotary(at_p.float(), cos, sin).double()
    direct = apply_rotary(k.to(dtype), rot.cos_table[p + d], rot.sin_table[p + d]).double()
    angles = (p + d).double()[:, None] * rot.inv_freq.double()[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    factor = rot.cos_table[0, 0].double()  # yarn's attention factor (cos 0 = 1 otherwise)
    exact = apply_rotary(k.double(), angles.cos() * factor, angles.sin() * factor)
    return moved, direct, exact


@pytest.mark.parametrize("rope", list(ROPES))
def test_rotating_a_key_by_d_equals_the_key_at_p_plus_d(rope):
    moved, direct, _ = _rotated_keys(ROPES[rope], torch.float32, max_pos=128)
    assert (moved - direct).abs().max() <= 1e-5 * direct.abs().max()


@pytest.mark.parametrize("rope", list(ROPES))
def test_rotation_adds_no_error_beyond_float32_rope_tables(rope):
    """At large positions float32 RoPE tables themselves are off by the angle's rounding
    (~p * 6e-8 rad): a rotated key is no further from the exact rotation than the table's
    key at its new position (docs/rag.md lists the figures, and bf16's)."""
    moved, direct, exact = _rotated_keys(ROPES[rope], torch.float32, max_pos=32768)
    scale = exact.abs().max()
    assert (moved - exact).abs().max() <= 1.5 * (direct - exact).abs().max() + 1e-6 * scale


def test_bf16_rotation_error_is_bf16_rounding():
    """A bf16 key computed at p and rotated by d (in float32, as attention does) is within
    two bf16 ulps (2 * 2**-7, relative to the largest element) of the bf16 key computed at
    p + d: each went through bf16 RoPE tables and one bf16 rounding (measured: 0.71-0.95e-2
    for the four RoPE types)."""
    moved, direct, _ = _rotated_keys(ROPES["default"], torch.bfloat16, max_pos=4096)
    assert (moved - direct).abs().max() <= 2 * 2 ** -7 * direct.abs().max()


def test_rotation_refused_for_dynamic_rope():
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    rot = RotaryEmbedding(64, rope, 64, 256, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="dynamic"):
        rot.rotation([3])


@pytest.mark.parametrize("q_len", [1, 5])
def test_turning_queries_equals_rotating_keys(q_len):
    """`turned_attention` (queries turned back per turn) equals SDPA over keys rotated
    forward, with GQA, several turns (one at the list's end) and the causal tail."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d, k_len = 8, 2, 64, 60
    rot = RotaryEmbedding(d, ROPES["yarn"], 512, 512, torch.float32, torch.device("cpu"))
    q = torch.randn(q_len, heads, d, generator=gen)
    ks = torch.randn(k_len, kv_heads, d, generator=gen)
    vs = torch.randn(k_len, kv_heads, d, generator=gen)
    ranges = [(3, 20, 17), (20, 31, 40), (31, 52, 250)]
    if q_len == 1:
        ranges.append((52, 60, 7))
    deltas = [delta for _, _, delta in ranges]
    table = TurnTable.build(rot, deltas)
    turns = table.by_row(ranges)
    mask = causal_mask(q_len, k_len, q.device) if q_len > 1 else None
    got = turned_attention(q, ks, vs, turns, table, 0.125, mask)
    fwd_cos, fwd_sin = rot.rotation(deltas)
    moved = ks.clone()
    for i, (a, b, _) in enumerate(ranges):
        moved[a:b] = apply_rotary(ks[a:b], fwd_cos[i].expand(b - a, d),
                                  fwd_sin[i].expand(b - a, d))
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], moved.transpose(0, 1)[None], vs.transpose(0, 1)[None],
        attn_mask=mask, scale=0.125, enable_gqa=True)[0].transpose(0, 1)
    assert (got - want).abs().max() < 1e-5
    # The many-queries route turns the keys instead (a private copy): the same attention.
    tail = mask[:, k_len - q_len:] if mask is not None else None
    other = turned_keys_attention(q, ks.clone(), vs, turns, table, 0.125, tail)
    assert (other - want).abs().max() < 1e-5


def test_scattered_queries_see_the_entries_up_to_their_own():
    """Recomputed chunk tokens (query_index) are queries at scattered entries of their KV
    list: each sees entries up to its own, through both rotated routes and plain SDPA."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, d, k_len = 4, 2, 32, 40
    at = torch.tensor([3, 4, 11, 25, 39])
    batch = AttentionBatch(q_lens=[5], kv_lens=[k_len], q_starts=[0], kv_indices=[],
                           write_slots=torch.zeros(5), num_heads=heads, num_kv_heads=kv_heads,
                           query_index=[at])
    mask = batch.mask(0, torch.device("cpu"))
    assert mask.shape == (5, k_len - 3) and mask[0].sum() == 1 and mask[-1].all()
    q = torch.randn(5, heads, d, generator=gen)
    ks = torch.randn(k_len, kv_heads, d, generator=gen)
    vs = torch.randn(k_len, kv_heads, d, generator=gen)
    full = torch.arange(k_len)[None, :] <= at[:, None]
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
        attn_mask=full, scale=0.2, enable_gqa=True)[0].transpose(0, 1)
    for attend in (turned_attention, turned_keys_attention):
        got = attend(q, ks.clone(), vs, (), None, 0.2, mask)
        assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["scattered", "contiguous", "contiguous-long-prefix"])
def test_many_queries_skip_the_masked_part_and_attend_as_one_masked_call(kind):
    """Many queries at given entries (a selective recompute; r = 1 is the contiguous run after
    S): the keys-turning route runs scattered queries in row blocks over the entries up to
    each block's widest view, and a contiguous run as SDPA's causal case (queries padded in
    front); both equal one SDPA call with the whole explicit mask."""
    gen = torch.Generator().manual_seed(9)
    heads, kv_heads, d, k_len = 4, 2, 16, 300
    if kind == "scattered":
        at = torch.sort(torch.randperm(k_len - 20, generator=gen)[:170]).values + 20
    else:
        first = 40 if kind == "contiguous" else 200  # a prefix shorter / longer than the run
        at = torch.arange(first, k_len)
    n = len(at)
    batch = AttentionBatch(q_lens=[n], kv_lens=[k_len], q_starts=[0], kv_indices=[],
                           write_slots=torch.zeros(n), num_heads=heads, num_kv_heads=kv_heads,
                           query_index=[at])
    mask = batch.mask(0, torch.device("cpu"))
    q = torch.randn(n, heads, d, generator=gen)
    ks = torch.randn(k_len, kv_heads, d, generator=gen)
    vs = torch.randn(k_len, kv_heads, d, generator=gen)
    rot = RotaryEmbedding(d, ROPES["llama3"], 512, 512, torch.float32, torch.device("cpu"))
    table = TurnTable.build(rot, [7, 60])
    turns = ((20, 90, 0), (90, 250, 1))
    full = torch.arange(k_len)[None, :] <= at[:, None]
    turned = turn_keys(ks.clone(), turns, table)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], turned.transpose(0, 1)[None], vs.transpose(0, 1)[None],
        attn_mask=full, scale=0.2, enable_gqa=True)[0].transpose(0, 1)
    got = turned_keys_attention(q, ks.clone(), vs, turns, table, 0.2, mask)
    assert (got - want).abs().max() < 1e-5


def test_batched_turned_decode_equals_one_row_at_a_time():
    """Decode rows with different re-positioned ranges, one with none, padded to the longest
    list: the batched path gives each row what `turned_attention` gives it alone."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, d = 8, 4, 32
    rot = RotaryEmbedding(d, ROPES["llama3"], 512, 512, torch.float32, torch.device("cpu"))
    table = TurnTable.build(rot, [5, 90, 300])
    lens = [40, 25, 33]
    ranges = [((2, 10, 0), (10, 30, 2)), (), ((0, 33, 1),)]
    batch = AttentionBatch(q_lens=[1, 1, 1], kv_lens=lens, q_starts=[0, 1, 2], kv_indices=[],
                           write_slots=torch.zeros(3, dtype=torch.long), num_heads=heads,
                           num_kv_heads=kv_heads, turns=list(ranges), turn_table=table)
    q = torch.randn(3, heads, d, generator=gen)
    ks = torch.randn(3, kv_heads, 40, d, generator=gen)
    vs = torch.randn(3, kv_heads, 40, d, generator=gen)
    mask = (torch.arange(40)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    got = turned_decode(q, ks, vs, *build_decode_turns(batch, [0, 1, 2], 40, q.device), mask,
                        0.2)
    for b in range(3):
        n = lens[b]
        want = turned_attention(q[b:b + 1], ks[b, :, :n].transpose(0, 1),
                                vs[b, :, :n].transpose(0, 1), ranges[b], table, 0.2, None)
        assert (got[b] - want[0]).abs().max() < 1e-5

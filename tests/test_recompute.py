"""Selective recompute (ragkv/recompute/): reuse chunk KV in the sequential
layout and recompute a chosen set of chunk tokens with full attention.

The two ends of the curve are exact and checked against HF transformers in float32 (greedy
tokens identical, first-token logprobs within 1e-4), for every family and RoPE type, cold and
warm, with the pool NaN-filled: r = 1 equals the ordinary full prefill of the flat prompt,
r = 0 the sequential-isolated reference. In between, the chosen set is checked (its size, its
determinism, sinks where they belong), the cached entries' bytes are compared before and after
requests that recompute their tokens, and `check_integrity()` runs after every scenario.
"""

from __future__ import annotations

import pytest
import torch
from conftest import MAIN_FAMILIES, random_prompt
from test_rag import GREEDY, TOL, make_llm, plain, rag, reference, run

from ragkv import LLM
from ragkv.inputs.layout import PromptLayout
from ragkv.inputs.prompt import RAGPrompt
from ragkv.recompute.planner import RecomputePlanner
from ragkv.recompute.selection import RecomputeSpec

METHODS = ["blend", "sink", "query", "sink+blend", "sink+query", "query+blend"]
SEQ_ISO = ("sequential", "isolated")


def rc(system, chunks, question, method, ratio, sink=None, salt=None) -> RAGPrompt:
    return RAGPrompt(system, chunks, question, cache_salt=salt, position_strategy="sequential",
                     recompute=method, recompute_ratio=ratio, recompute_sink_tokens=sink)


def flat(prompt: RAGPrompt) -> list[int]:
    return list(prompt.system) + [t for c in prompt.chunks for t in c] + list(prompt.question)


def check(hf, prompt: RAGPrompt, out, exact: str) -> None:
    """`out` against the full prefill of the flat prompt ("full") or the sequential-isolated
    reference ("sequential")."""
    if exact == "full":
        want, first = reference(hf, plain(flat(prompt)))
    else:
        want, first = reference(hf, RAGPrompt(prompt.system, prompt.chunks, prompt.question),
                                SEQ_ISO)
    got = out.outputs[0]
    assert got.token_ids == want
    for tid, lp in got.logprobs[0].items():
        assert abs(lp.logprob - first[tid].item()) < TOL, (tid, lp.logprob)


def wrap_probes(monkeypatch, wrap) -> None:
    """Every probe the engine runs goes through `wrap(run, work, model, pool, backend)`,
    `run` being the real `ProbeWork.run`."""
    from ragkv.recompute import probe as probe_module

    run = probe_module.ProbeWork.run
    monkeypatch.setattr(probe_module.ProbeWork, "run",
                        lambda work, model, pool, backend=None: wrap(run, work, model, pool,
                                                                     backend))


def entry_bytes(llm) -> dict[bytes, torch.Tensor]:
    """Every cached chunk entry's K/V, all layers, copied."""
    cache = llm.engine.chunk_cache
    pool = llm.engine.pool.kv
    return {key: pool[:, :, torch.tensor(e.slots)].clone()
            for key, e in cache._entries.items() if e.complete}


@pytest.fixture(scope="module")
def llama(checkpoint, hf_model):
    path = checkpoint("llama")
    return path, hf_model(path)


def scenario(llm, hf, method: str) -> None:
    S = random_prompt(9, seed=1)
    A, B, C = (random_prompt(n, seed=30 + n) for n in (14, 21, 8))
    Q = random_prompt(6, seed=2)
    cold = rc(S, [A, B, C], Q, method, 1.0)
    # r = 1, cold then warm and reordered: the full prefill of each flat prompt.
    for prompt in (cold, rc(S, [C, A, B], Q, method, 1.0)):
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        llm.check_integrity()
        check(hf, prompt, out, "full")
        # Every chunk token but the first chunk's, whose cached KV is the full prefill's.
        assert out.metrics.num_recomputed_tokens == sum(map(len, prompt.chunks[1:]))
    # r = 0 (warm): nothing recomputed, the sequential layout exactly.
    prompt = rc(S, [B, C, A], Q, method, 0.0)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    llm.check_integrity()
    check(hf, prompt, out, "sequential")
    assert out.metrics.num_recomputed_tokens == 0


@pytest.mark.parametrize("family", MAIN_FAMILIES)
def test_ends_of_the_curve_match_reference(family, checkpoint, hf_model):
    """Every family and static RoPE type: r = 1 is the full prefill, r = 0 the sequential
    layout, cold and warm, for one method per family (all methods on llama below)."""
    path = checkpoint(family)
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512)
    scenario(llm, hf_model(path), METHODS[MAIN_FAMILIES.index(family) % len(METHODS)])


@pytest.mark.parametrize("method", METHODS)
def test_every_method_at_the_ends(method, llama):
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512)
    scenario(llm, hf, method)


def test_standalone_chunks_at_the_ends(llama):
    """Standalone chunks (cached without S) recompute too: r = 1 is still the full prefill,
    r = 0 the sequential-standalone layout."""
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512)
    S, A, B = random_prompt(7, seed=40), random_prompt(12, seed=41), random_prompt(9, seed=42)
    Q = random_prompt(5, seed=43)
    for ratio in (1.0, 1.0, 0.0):  # cold, warm, warm
        prompt = RAGPrompt(S, [A, B], Q, position_strategy="sequential",
                           chunk_attention="standalone", recompute="blend",
                           recompute_ratio=ratio)
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        llm.check_integrity()
        if ratio == 1.0:
            check(hf, prompt, out, "full")
        else:
            want, _ = reference(hf, rag(S, [A, B], Q), ("sequential", "standalone"))
            assert out.outputs[0].token_ids == want


def test_shared_chunk_recomputed_by_one_request_reused_plainly_by_another(llama):
    """In one step, one request recomputes every token of chunks that other requests reuse
    as they are (sequential and shared layouts, and a partial recompute): each gets its own
    correct result, and the cached entries' bytes do not change."""
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=4096, chunk_cache_tokens=1024)
    S = random_prompt(9, seed=50)
    A, B = random_prompt(16, seed=51), random_prompt(11, seed=52)
    Q1, Q2 = random_prompt(5, seed=53), random_prompt(4, seed=54)
    partial = rc(S, [A, B], Q2, "blend", 0.4)
    alone = llm.generate([partial], GREEDY, use_tqdm=False)[0]  # also warms A and B
    llm.check_integrity()
    before = entry_bytes(llm)
    full = rc(S, [B, A], Q1, "query", 1.0)
    seq = rag(S, [A, B], Q1, layout=SEQ_ISO)
    shared = rag(S, [B, A], Q2)
    outs = llm.generate([full, seq, partial, shared], GREEDY, use_tqdm=False)
    llm.check_integrity()
    check(hf, full, outs[0], "full")
    run(llm, hf, [seq, shared], ["HH", "HH"])
    assert outs[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[2].metrics.num_recomputed_tokens == alone.metrics.num_recomputed_tokens == 11
    after = entry_bytes(llm)
    assert before.keys() == after.keys() and len(before) == 2
    for key in before:
        assert torch.equal(before[key].nan_to_num(7.0), after[key].nan_to_num(7.0))


def test_selection_is_deterministic(llama, monkeypatch):
    """The same prompt chooses the same tokens cold, warm, alone and in a batch, and the
    chosen set has the budgeted size."""
    path, _ = llama
    llm = make_llm(path, kv_cache_tokens=4096, chunk_cache_tokens=1024)
    chosen: list[tuple[str, tuple[int, ...]]] = []
    planner = llm.engine.scheduler.recompute
    choose = planner.choose

    def record(req, selected):
        choose(req, selected)
        chosen.append((req.recompute.method, req.selected))

    monkeypatch.setattr(planner, "choose", record)
    S = random_prompt(8, seed=60)
    A, B = random_prompt(20, seed=61), random_prompt(13, seed=62)
    Q = random_prompt(6, seed=63)
    for method in ("blend", "query", "sink+query"):
        chosen.clear()
        prompt = rc(S, [A, B], Q, method, 0.3)
        llm.generate([prompt], GREEDY, use_tqdm=False)
        llm.generate([prompt, rc(S, [B, A], Q, method, 0.3), prompt], GREEDY, use_tqdm=False)
        llm.check_integrity()
        mine = [sel for m, sel in chosen if m == method]
        assert len(mine) == 4
        assert mine[0] == mine[1] == mine[3] and len(mine[0]) == 10  # ceil(0.3 * 33)
        # None of the first chunk's: its cached KV is the full prefill's already.
        assert all(len(S) + 20 <= x < len(S) + 33 for x in mine[0])
        if method == "sink+query":  # the first 4 tokens of each later chunk, then the scorer's
            assert set(range(28, 32)) <= set(mine[0])


@pytest.mark.parametrize("budget", [24, 64])
def test_recompute_over_several_steps_and_preemption(budget, llama):
    """Chunked prefill splits the recomputed tokens over steps (a budget below the 55 chunk
    tokens an r = 1 request recomputes); a small pool preempts requests mid-recompute.
    r = 1 stays the full prefill; a partial recompute gives what it gives in one step."""
    path, hf = llama
    S = random_prompt(6, seed=70)
    chunks = [random_prompt(n, seed=71 + n) for n in (18, 12, 25)]
    Qs = [random_prompt(4, seed=80 + i) for i in range(4)]
    big = make_llm(path, kv_cache_tokens=4096, chunk_cache_tokens=1024)
    partial = [rc(S, chunks[i:] + chunks[:i], Qs[i], "sink+blend", 0.25) for i in range(3)]
    want = big.generate(partial, GREEDY, use_tqdm=False)
    # The general region (100 slots) holds one r = 1 request's own slots (S, every chunk
    # token, Q, output: 71) but not two: requests are preempted mid-recompute.
    small = make_llm(path, kv_cache_tokens=180, chunk_cache_tokens=80, max_model_len=80,
                     max_num_batched_tokens=budget)
    exact = [rc(S, chunks[i:] + chunks[:i], Qs[3], "blend", 1.0) for i in range(3)]
    outs = small.generate(exact + partial, GREEDY, use_tqdm=False)
    small.check_integrity()
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for got, ref in zip(outs[3:], want, strict=True):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    for prompt, out in zip(exact, outs, strict=False):
        check(hf, prompt, out, "full")


def test_uncached_chunks_recompute_in_their_own_slots(llama):
    """Without a chunk cache (or a chunk too big for its region) a chunk's KV lives in the
    request's own slots; recomputed tokens overwrite it there."""
    path, hf = llama
    S, A, B = random_prompt(5, seed=90), random_prompt(30, seed=91), random_prompt(9, seed=92)
    Q = random_prompt(4, seed=93)
    for kwargs in ({"enable_chunk_cache": False}, {"chunk_cache_tokens": 16}):
        llm = make_llm(path, kv_cache_tokens=1024, **kwargs)
        prompt = rc(S, [A, B], Q, "query", 1.0)
        check(hf, prompt, llm.generate([prompt], GREEDY, use_tqdm=False)[0], "full")
        llm.check_integrity()


def test_many_query_route_at_the_ends(llama, monkeypatch):
    """Sequences with many queries attend through keys turned forward (a private copy):
    with every extend taking that route, r = 1 is still the full prefill."""
    from ragkv.model.backends import torch_sdpa

    monkeypatch.setattr(torch_sdpa, "_TURN_KEYS_FROM", 2)
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512)
    scenario(llm, hf, "sink+blend")


def test_recompute_without_a_system_prompt(llama):
    """With S empty, the recomputed tokens of a first chunk are a work whose KV list is only
    its own new tokens (regression: found by the property test)."""
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024, chunk_cache_tokens=256,
                   max_num_batched_tokens=8)
    A, B = random_prompt(6, seed=120), random_prompt(9, seed=121)
    for chunks in ([A, A], [B, A]):
        prompt = rc([], chunks, random_prompt(3, seed=122), "sink+blend", 1.0)
        check(hf, prompt, llm.generate([prompt], GREEDY, use_tqdm=False)[0], "full")
        llm.check_integrity()


def test_recompute_on_the_triton_backend(llama):
    pytest.importorskip("triton")
    path, hf = llama
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512, device=device,
                   dtype="float32", attention_backend="triton")
    S, A, B = random_prompt(9, seed=94), random_prompt(14, seed=95), random_prompt(8, seed=96)
    for chunks in ([A, B], [B, A]):
        prompt = rc(S, chunks, random_prompt(5, seed=97), "sink+query", 1.0)
        check(hf, prompt, llm.generate([prompt], GREEDY, use_tqdm=False)[0], "full")
        llm.check_integrity()


@pytest.mark.parametrize("method", ["sink+blend", "query"])
def test_partial_recompute_on_the_triton_backend_equals_the_torch_backend(llama, method):
    """Between the ends, recomputed tokens sit among cached ones (`query_index`) and the
    cached chunks are re-positioned: the extend kernel takes both in its loads. Same tokens
    and first-token logprobs as the torch backend, cold and warm, batched."""
    pytest.importorskip("triton")
    path, _ = llama
    device = "cuda" if torch.cuda.is_available() else "cpu"
    S, A, B, C = (random_prompt(n, seed=140 + n) for n in (7, 19, 11, 23))
    prompts = [[rc(S, [A, B], random_prompt(4, seed=150), method, 0.4),
                rc(S, [C, A], random_prompt(6, seed=151), method, 0.25)],
               [rc(S, [B, C, A], random_prompt(5, seed=152), method, 0.5)]]
    results = []
    for backend in ("torch", "triton"):
        llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512, device=device,
                       dtype="float32", attention_backend=backend)
        outs = [o for batch in prompts
                for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        llm.check_integrity()
        assert all(o.metrics.num_recomputed_tokens > 0 for o in outs)
        results.append(outs)
    for want, got in zip(*results, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        first_want, first_got = want.outputs[0].logprobs[0], got.outputs[0].logprobs[0]
        assert first_got.keys() == first_want.keys()
        for tid, lp in first_got.items():
            assert abs(lp.logprob - first_want[tid].logprob) < TOL, (tid, lp.logprob)


@pytest.mark.parametrize("method", ["sink+blend", "query"])
def test_question_joined_to_its_recomputed_tokens_equals_them_apart(llama, method,
                                                                    monkeypatch):
    """On the torch backend a recomputing request's question and its recomputed tokens are
    one sequence of the step (step_work.join_recomputed): the same tokens and first-token
    logprobs as the two apart, cold and warm, batched, and the pool whole after. A step of
    the pair alone is the one sequence the extend graphs would run (graph_step)."""
    from ragkv.model import runner
    from ragkv.model.backends.cuda_graph import graph_step

    path, _ = llama
    S, A, B, C = (random_prompt(n, seed=160 + n) for n in (7, 19, 11, 23))
    prompts = [[rc(S, [A, B], random_prompt(4, seed=170), method, 0.4),
                rc(S, [C, A], random_prompt(6, seed=171), method, 0.25)],
               [rc(S, [B, C, A], random_prompt(5, seed=172), method, 0.5)]]
    join = runner.join_recomputed
    joined: list[int] = []
    graph_steps = 0

    def counting(works):
        nonlocal graph_steps
        units = join(works)
        joined.append(len(works) - len(units))
        if len(works) == 2 and len(units) == 1:
            step, one = graph_step(works), units[0][1]
            assert step is not None and step.kv is one.kv
            assert ((step.token_ids, step.positions, step.turns, step.query_index,
                     step.key_positions)
                    == (one.token_ids, one.positions, one.turns, one.query_index,
                        one.key_positions))
            graph_steps += 1
        return units

    results = []
    for spy in (counting, lambda works: list(enumerate(works))):
        monkeypatch.setattr(runner, "join_recomputed", spy)
        llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512)
        outs = [o for batch in prompts for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        llm.check_integrity()
        assert all(o.metrics.num_recomputed_tokens > 0 for o in outs)
        results.append(outs)
    assert sum(joined) >= len(prompts[0]) + len(prompts[1])  # every request joined once
    assert graph_steps >= 1  # the last batch's request alone in its step
    for want, got in zip(*results, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        first_want, first_got = want.outputs[0].logprobs[0], got.outputs[0].logprobs[0]
        assert first_got.keys() == first_want.keys()
        for tid, lp in first_got.items():
            assert abs(lp.logprob - first_want[tid].logprob) < TOL, (tid, lp.logprob)


def test_recompute_as_engine_default_and_in_stats(llama):
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512,
                   position_strategy="sequential", recompute="blend", recompute_ratio=1.0)
    S, A, B = random_prompt(6, seed=100), random_prompt(15, seed=101), random_prompt(5, seed=104)
    prompt = RAGPrompt(S, [B, A], random_prompt(4, seed=102))
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    check(hf, prompt, out, "full")
    # A request may turn it off, or ask for another method.
    off = RAGPrompt(S, [B, A], random_prompt(4, seed=103), recompute="none")
    assert llm.generate([off], GREEDY, use_tqdm=False)[0].metrics.num_recomputed_tokens == 0
    stats = llm.get_chunk_cache_stats()
    assert stats.recomputed_tokens == 15 and stats.recomputed_requests == 1  # A; B is exact
    llm.check_integrity()


def test_quality_mode_is_the_default(llama):
    """An engine built with no layout or recompute settings serves RAG prompts in the quality
    mode: sequential positions, and (no calibrated profile here) the model-agnostic adaptive
    `query` recompute, 10% to 50% of the chunk tokens holding 0.9 of the scores, with later
    documents computed after the built-in chunk primer. Its warm
    answer equals its cold one token for token and the same mode named explicitly; a prompt may
    still ask for the exact shared layout, and a ratio of its own is a fixed budget whose ends
    are the references."""
    import math

    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512, position_strategy=None)
    c = llm.engine.config
    assert (c.position_strategy, c.recompute, c.recompute_ratio, c.recompute_min_ratio,
            c.recompute_score_mass) == ("sequential", "query", 0.5, 0.1, 0.9)
    settings = llm.engine.recompute_settings()
    assert settings["source"] == "model-agnostic" and settings["profile"] is None
    assert c.chunk_primer == "default" and llm.engine.inputs.primer
    assert settings["recompute_check_layers"] == [0, 1]  # 13/27/40% of 2 layers
    S, A, B = random_prompt(6, seed=140), random_prompt(15, seed=141), random_prompt(9, seed=142)
    Q = random_prompt(4, seed=143)
    prompt = RAGPrompt(S, [A, B], Q)
    cold = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    warm = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert warm.metrics.num_chunk_hits == 2 and cold.metrics.num_chunk_misses == 2
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    n = len(A) + len(B)  # the budget's share is of every chunk token; only B's can change
    assert (math.ceil(0.1 * n) <= cold.metrics.num_recomputed_tokens <= len(B)
            and warm.metrics.num_recomputed_tokens == cold.metrics.num_recomputed_tokens)
    # Shared unless named: recompute and the primer only when named.
    explicit = make_llm(path, kv_cache_tokens=2048, chunk_primer="default")
    named = RAGPrompt(S, [A, B], Q, position_strategy="sequential", recompute="query",
                      recompute_ratio=0.5, recompute_min_ratio=0.1, recompute_score_mass=0.9)
    out = explicit.generate([named], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    assert out.metrics.num_recomputed_tokens == cold.metrics.num_recomputed_tokens
    # The exact modes stay one setting away.
    shared = RAGPrompt(S, [A, B], random_prompt(3, seed=144), position_strategy="shared")
    out = llm.generate([shared], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_recomputed_tokens == 0
    want, _ = reference(hf, shared, ("shared", "isolated"))
    assert out.outputs[0].token_ids == want
    for ratio, exact in ((1.0, "full"), (0.0, "sequential")):
        # r = 0 without the primer is the plain sequential layout (with it: test_primer.py).
        own = RAGPrompt(S, [A, B], Q, recompute_ratio=ratio, chunk_primer=bool(ratio))
        out = llm.generate([own], GREEDY, use_tqdm=False)[0]
        assert out.metrics.num_recomputed_tokens == round(ratio * len(B))
        check(hf, own, out, exact)
    llm.check_integrity()
    explicit.check_integrity()


def test_default_recompute_settings_resolve(llama):
    """What an engine resolves: the user's ratio without a score mass is a fixed budget of the
    default method; shared positions recompute nothing; a recompute named with shared
    positions is an error."""
    path, _ = llama
    c = LLM(path, kv_cache_tokens=256, recompute_ratio=0.3).engine.config
    assert (c.position_strategy, c.recompute, c.recompute_ratio, c.recompute_score_mass,
            c.recompute_min_ratio) == ("sequential", "query", 0.3, None, 0.0)
    c = LLM(path, kv_cache_tokens=256, recompute_score_mass=0.5).engine.config
    assert (c.recompute, c.recompute_ratio, c.recompute_score_mass, c.recompute_min_ratio) == (
        "query", 0.5, 0.5, 0.1)
    engine = LLM(path, kv_cache_tokens=256, position_strategy="shared").engine
    assert (engine.config.recompute, engine.recompute_source) == ("none", "config")
    assert "no recompute (exact chunk reuse)" in engine.describe_rag_default()
    engine = LLM(path, kv_cache_tokens=256, recompute="blend").engine
    assert (engine.config.position_strategy, engine.config.recompute,
            engine.config.recompute_ratio, engine.config.recompute_score_mass,
            engine.recompute_source) == ("sequential", "blend", 0.15, None, "config")


@pytest.mark.parametrize("kwargs,fragment", [
    ({"recompute": "blend", "position_strategy": "shared"}, "position_strategy='sequential'"),
    ({"recompute": "magic", "position_strategy": "sequential"}, "recompute must be one of"),
    ({"recompute_ratio": 1.5}, "recompute_ratio"),
    ({"recompute_sink_tokens": -1}, "recompute_sink_tokens"),
    ({"recompute_check_layers": ()}, "recompute_check_layers"),
    ({"recompute_score_mass": 1.5}, "recompute_score_mass"),
    ({"recompute_min_ratio": -0.5}, "recompute_min_ratio"),
])
def test_bad_engine_settings_are_clear_errors(kwargs, fragment, llama):
    from ragkv.config import EngineConfig

    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        EngineConfig(model=llama[0], **kwargs)


def test_bad_request_settings_are_clear_errors_and_lose_nothing(llama):
    path, _ = llama
    llm = make_llm(path, kv_cache_tokens=1024, chunk_cache_tokens=256)
    S, A, Q = random_prompt(4, seed=110), random_prompt(6, seed=111), random_prompt(3, seed=112)
    for kwargs, fragment in (
            ({"recompute": "blend", "position_strategy": "shared"}, "sequential layout"),
            ({"recompute": "nope"}, "recompute must be one of"),
            ({"recompute": "sink", "recompute_ratio": -0.1}, "recompute_ratio"),
            ({"recompute": "sink", "recompute_sink_tokens": 2.5}, "recompute_sink_tokens")):
        with pytest.raises(ValueError, match=fragment):
            llm.generate([RAGPrompt(S, [A], Q, **kwargs)], GREEDY, use_tqdm=False)
        llm.check_integrity()
    with pytest.raises(ValueError, match="layer 9"):
        make_llm(path, kv_cache_tokens=512, position_strategy="sequential",
                 recompute="blend", recompute_check_layers=(0, 9))
    # Without position_strategy, a request asking for recompute gets the sequential layout.
    B = random_prompt(5, seed=113)
    out = llm.generate([RAGPrompt(S, [B, A], Q, recompute="sink", recompute_ratio=0.5)],
                       GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_recomputed_tokens == 3  # ceil(0.5 * 6) of A; B is exact
    llm.check_integrity()


# ------------------------------------------------------------------------ the selection


def test_sink_and_budget_rules():
    # Standalone chunks after S: none is exact already, so each may be chosen.
    layout = PromptLayout.build(3, [10, 4, 7], "sequential", "standalone")  # at 3, 13, 17
    spec = RecomputeSpec("sink", 0.2, None, (1,))
    assert spec.budget(21) == 5 and RecomputeSpec("sink", 0.15, None, (1,)).budget(100) == 15
    assert spec.sink(layout) == [3, 4, 13, 17, 18]  # ceil(0.2 * len) of each chunk
    assert RecomputeSpec("sink", 0.0, 3, (1,)).sink(layout) == [3, 4, 5, 13, 14, 15, 17, 18, 19]
    assert not spec.needs_probe(layout) and spec.select(layout, None) == (3, 4, 13, 17, 18)
    combo = RecomputeSpec("sink+query", 0.2, 2, (1,))  # budget 5: 3 first tokens, 2 seconds
    assert combo.sink(layout) == [3, 4, 13, 14, 17]
    assert not combo.needs_probe(layout)
    combo = RecomputeSpec("sink+query", 0.5, None, (1,))  # budget 11: 4 + 4 + 3 sinks
    assert len(combo.sink(layout)) == 11 and not combo.needs_probe(layout)
    assert RecomputeSpec("blend", 1.0, None, (1,)).select(
        layout, torch.zeros(21)) == tuple(range(3, 24))
    # Every chunk token at r = 1 (or an adaptive budget whose least is all): no probe to run.
    for everything in (RecomputeSpec("blend", 1.0, None, (1,)),
                       RecomputeSpec("query", 1.0, None, (1,), 0.5, 1.0)):
        assert not everything.needs_probe(layout)
        assert everything.select(layout, None) == tuple(range(3, 24))
    assert RecomputeSpec("query", 1.0, None, (1,), 0.5, 0.9).needs_probe(layout)


def test_the_exact_prefix_is_never_recomputed(llama):
    """A first chunk computed where it lies, after everything before it (sequential and
    isolated, or standalone with no S), has a full prefill's KV already: it is neither scored
    nor chosen, at any ratio, though the ratio stays a share of every chunk token. A request
    with one such chunk recomputes nothing and is the full prefill."""
    build = PromptLayout.build
    assert build(3, [4, 5], "sequential").exact_end == 7
    assert build(0, [4, 5], "sequential", "standalone").exact_end == 4
    assert build(3, [4, 5], "sequential", "standalone").exact_end == 3
    assert build(3, [4, 5], "shared", "standalone").exact_end == 3
    assert build(3, [], "sequential").exact_end == 3
    layout = build(2, [4, 4], "sequential")  # chunk tokens 2 .. 9, the first chunk exact
    scores = torch.tensor([9.0, 9.0, 9.0, 9.0, 0.5, 0.1, 0.3, 0.2])
    assert RecomputeSpec("query", 0.25, None, (1,)).select(layout, scores) == (6, 8)
    # Mass: 0.9 of the second chunk's 1.1 (the first chunk's 36 counts for nothing) takes
    # 0.5, 0.3 and 0.2.
    adaptive = RecomputeSpec("query", 1.0, None, (1,), 0.9, 0.0)
    assert adaptive.select(layout, scores) == (6, 8, 9)
    assert RecomputeSpec("query", 1.0, None, (1,)).select(layout, None) == (6, 7, 8, 9)
    assert RecomputeSpec("sink", 0.5, None, (1,)).select(layout, None) == (6, 7)
    assert RecomputeSpec("sink+query", 0.5, 1, (1,)).select(layout, scores) == (6, 7, 8, 9)
    one = build(2, [6], "sequential")
    for spec in (RecomputeSpec("query", 0.5, None, (1,), 0.9, 0.1),
                 RecomputeSpec("sink+blend", 1.0, None, (1,))):
        assert not spec.needs_probe(one) and spec.select(one, None) == ()

    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024, chunk_cache_tokens=256)
    S, A, Q = random_prompt(6, seed=170), random_prompt(14, seed=171), random_prompt(4, seed=172)
    for method in ("query", "blend", "sink+query"):  # cold, then warm
        prompt = rc(S, [A], Q, method, 0.5)
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.metrics.num_recomputed_tokens == 0
        check(hf, prompt, out, "full")
        llm.check_integrity()


def test_select_takes_the_best_scores_ties_to_the_earlier_token():
    layout = PromptLayout.build(2, [4, 4], "sequential", "standalone")
    scores = torch.tensor([0.1, 0.9, 0.5, 0.5, 0.5, 0.0, 0.9, 0.2])
    spec = RecomputeSpec("query", 0.5, None, (1,))
    assert spec.select(layout, scores) == (3, 4, 5, 8)  # 0.9, 0.9, then the first 0.5
    spec = RecomputeSpec("sink+blend", 0.5, 1, (1,))
    assert spec.select(layout, scores) == (2, 3, 6, 8)  # sinks 2 and 6, then 0.9 and 0.9
    with pytest.raises(ValueError, match="one score per chunk token"):
        spec.select(layout, torch.zeros(3))


def test_query_and_blend_combine_as_shares_of_their_totals(llama, monkeypatch):
    """`query+blend` runs both probes in one step (query at its check layers, blend at layer
    1) and ranks by the sum of each one's scores as a share of its total, so neither scorer's
    scale decides; one probe's scores are used as they are."""
    spec = RecomputeSpec("query+blend", 0.5, None, (0, 1))
    assert spec.scorers == ("query", "blend")
    assert spec.probes == (("query", (0, 1)), ("blend", (1,)))
    query = torch.tensor([1.0, 0.0, 3.0, 0.0])  # shares .25 0 .75 0
    blend = torch.tensor([0.0, 10.0, 0.0, 30.0])  # shares 0 .25 0 .75
    combined = spec.combine([query, blend])
    assert torch.allclose(combined, torch.tensor([0.25, 0.25, 0.75, 0.75], dtype=torch.float64))
    layout = PromptLayout.build(2, [2, 2], "sequential", "standalone")
    assert spec.select(layout, combined) == (4, 5)  # the two 0.75: one from each scorer
    assert RecomputeSpec("query", 0.5, None, (1,)).combine([query]) is query

    path, _ = llama
    llm = make_llm(path, kv_cache_tokens=1024)
    runs = []

    def record(run, work, model, pool, backend):
        scores = run(work, model, pool, backend)
        runs.append((work.kind, work.check_layers, scores))
        return scores

    wrap_probes(monkeypatch, record)
    chosen = []
    choose = RecomputePlanner.choose
    monkeypatch.setattr(RecomputePlanner, "choose",
                        lambda self, req, selected: chosen.append(selected)
                        or choose(self, req, selected))
    S, A, B = random_prompt(5, seed=150), random_prompt(13, seed=151), random_prompt(8, seed=152)
    prompt = RAGPrompt(S, [B, A], random_prompt(4, seed=153), position_strategy="sequential",
                       recompute="query+blend", recompute_ratio=0.25)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert [(kind, layers) for kind, layers, _ in runs] == [("query", (0, 1)), ("blend", (1,))]
    both = spec.combine([s for _, _, s in runs])
    want = RecomputeSpec("query", 0.25, None, (0, 1)).select(
        PromptLayout.build(5, [8, 13], "sequential"), both)
    assert chosen == [want] and out.metrics.num_recomputed_tokens == len(want) == 6
    # Neither scorer alone would have chosen it (else the combination would be untested).
    alone = [RecomputeSpec("query", 0.25, None, (0, 1)).select(
        PromptLayout.build(5, [8, 13], "sequential"), s) for _, _, s in runs]
    assert want not in alone
    llm.check_integrity()


def test_adaptive_budget_takes_the_fewest_tokens_holding_the_mass():
    layout = PromptLayout.build(2, [4, 4], "sequential", "standalone")  # chunk tokens 2 .. 9
    scores = torch.tensor([0.1, 0.9, 0.5, 0.5, 0.5, 0.0, 0.9, 0.2])  # mass 3.6

    def adaptive(mass, high=1.0, low=0.0, method="query", sink=None):
        return RecomputeSpec(method, high, sink, (1,), mass, low).select(layout, scores)

    assert adaptive(0.5) == (3, 8)  # 0.9 + 0.9 = 1.8 = half the mass
    assert adaptive(0.51) == (3, 4, 8)  # one more, the earlier of the 0.5s
    assert adaptive(1.0) == (2, 3, 4, 5, 6, 8, 9)  # every token with a score, not the 0.0
    assert adaptive(0.5, high=0.125) == (3,)  # at most ceil(0.125 * 8) = 1
    assert adaptive(0.1, low=0.5) == (3, 4, 5, 8)  # at least 4, best first
    # Sinks count towards the mass and the bounds: sink 2 (0.1) and 6 (0.5) hold 0.6, then
    # 0.9, 0.9 (2.4 of 3.6 = 2/3).
    assert adaptive(0.6, method="sink+blend", sink=1) == (2, 3, 6, 8)
    assert adaptive(0.1, method="sink+blend", sink=1) == (2, 6)
    zero = RecomputeSpec("blend", 1.0, None, (1,), 0.9, 0.25)
    assert zero.select(layout, torch.zeros(8)) == (2, 3)  # no mass: the least, ties earlier


def test_adaptive_budget_at_the_ends_and_within_bounds(llama):
    """Mass 1 with scores everywhere recomputes every chunk token up to the ratio: at
    ratio 1 the full prefill exactly; low = high = 0 is the sequential layout; in between each
    request recomputes within [low, high] of its chunk tokens (none of the first chunk's, which
    is exact already)."""
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512)
    S, Q = random_prompt(7, seed=120), random_prompt(5, seed=121)
    A, B = random_prompt(16, seed=122), random_prompt(11, seed=123)

    def adaptive(low, high, mass, chunks=(A, B)) -> RAGPrompt:
        return RAGPrompt(S, list(chunks), Q, position_strategy="sequential", recompute="blend",
                         recompute_ratio=high, recompute_min_ratio=low,
                         recompute_score_mass=mass)

    full = adaptive(1.0, 1.0, 0.5)
    out = llm.generate([full], GREEDY, use_tqdm=False)[0]
    check(hf, full, out, "full")
    assert out.metrics.num_recomputed_tokens == len(B)
    none = adaptive(0.0, 0.0, 0.9, (B, A))
    out = llm.generate([none], GREEDY, use_tqdm=False)[0]
    check(hf, none, out, "sequential")
    assert out.metrics.num_recomputed_tokens == 0
    counts = []
    for mass in (0.05, 0.5, 0.95):
        out = llm.generate([adaptive(0.1, 0.6, mass)], GREEDY, use_tqdm=False)[0]
        counts.append(out.metrics.num_recomputed_tokens)
    # ceil(.1 * 27) and ceil(.6 * 27) = 17, of which B holds 11
    assert 3 <= counts[0] <= counts[1] <= counts[2] <= 11, counts
    assert counts[0] < counts[2], counts  # the mass decides, not a fixed ratio
    for kwargs, fragment in (
            ({"recompute_score_mass": 0.0}, "recompute_score_mass"),
            ({"recompute_score_mass": 0.5, "recompute_min_ratio": 0.9}, "must not exceed"),
            ({"recompute_min_ratio": 1.5}, "recompute_min_ratio")):
        with pytest.raises(ValueError, match=fragment):
            llm.generate([RAGPrompt(S, [A], Q, recompute="blend", recompute_ratio=0.5,
                                    **kwargs)], GREEDY, use_tqdm=False)
        llm.check_integrity()
    llm.check_integrity()


# ------------------------------------------------------------------- scheduler regressions


def _scheduler_request(spec):
    from ragkv.cache.chunk_cache import ChunkCache
    from ragkv.cache.chunk_key import ChunkKeys
    from ragkv.cache.kv_manager import KVCacheManager, SeqKV
    from ragkv.cache.kv_pool import SlotAllocator
    from ragkv.engine.request import Request
    from ragkv.engine.scheduler import Scheduler
    from ragkv.outputs import RequestMetrics

    kv = KVCacheManager(SlotAllocator(1, 64), False)
    cache = ChunkCache(SlotAllocator(64, 100))
    sched = Scheduler(kv, cache, 4, 64, False, debug_checks=True, num_layers=4)
    S, C, Q = [1, 2], [(3, 4, 5, 6), (7, 8, 9, 10)], [11, 12]
    # Standalone chunks: with S before them, neither is exact already, so both recompute.
    layout = PromptLayout.build(2, [4, 4], "sequential", "standalone")
    tokens = S + [t for c in C for t in c] + Q
    req = Request(request_id="a", parent_id="a", index=0, prompt=None,
                  prompt_token_ids=tokens, params=GREEDY, seed=0,
                  max_tokens=2, stop_ids=frozenset(), metrics=None, layout=layout,
                  chunk_keys=ChunkKeys("m", torch.float32).of_prompt(S, C, "standalone", None),
                  kv=SeqKV(),
                  recompute=spec)
    req.metrics = RequestMetrics(arrival_time=0.0)
    return sched, cache, req


def test_chunks_computed_in_a_step_are_recomputed_the_step_after():
    """A request that computes its chunks in a step (cold, or readmitted after preemption
    with its entries evicted) recomputes its chosen tokens only from the next step: in the
    same step its chunk works would write through the slots the recomputed tokens take over
    (regression, found in review)."""
    from ragkv.engine.scheduler_output import SchedulerOutput

    sched, cache, req = _scheduler_request(RecomputeSpec("sink", 0.5, 2, (1,)))
    sched.add(req)
    out = sched.schedule()  # S and both chunks; sink needs no probe: chosen now
    assert req.selected == (2, 3, 6, 7) and not out.probes
    assert all(w.query_index is None for w in out.works)
    sched.update(out)
    sched._preempt(req, SchedulerOutput())
    assert cache.clear() == 2
    out = sched.schedule()  # readmitted: the chunks again, nothing recomputed yet
    entries = {s for b in req.bindings for s in b.entry.slots}
    assert all(w.query_index is None for w in out.works)
    assert {slot for w in out.works for slot in w.write_slots()} >= entries
    sched.update(out)
    out = sched.schedule()
    assert [w.query_index for w in out.works][0] == (2, 3, 6, 7)
    written = {slot for w in out.works for slot in w.write_slots()}
    assert not written & entries  # the entries are never written by the recompute


def test_a_failed_step_fails_the_requests_waiting_for_their_choice():
    """A request whose only part in a step is the choice after it (it may reuse a chunk that
    step was completing) fails with the step."""
    sched, cache, req = _scheduler_request(RecomputeSpec("blend", 0.5, None, (1,)))
    sched.add(req)
    out = sched.schedule()
    assert [p.request for p in out.probes] == [req]
    failed = sched.fail_step(out, "boom")
    assert req in failed and req.status.finished and not sched.has_unfinished()
    sched.kv.check_integrity([])
    cache.check_integrity({})


def test_a_failed_step_with_two_probes_fails_their_request_once(llama, monkeypatch):
    """A warm `query+blend` request (S from the prefix cache, its chunks from the chunk cache)
    has nothing in its first step but its two probes: when that step fails, the request fails
    once, the engine goes on, and every slot comes back."""
    path, _ = llama
    llm = make_llm(path, kv_cache_tokens=1024)
    S, A, B = random_prompt(6, seed=160), random_prompt(12, seed=161), random_prompt(9, seed=162)
    llm.generate([RAGPrompt(S, [A, B], random_prompt(3, seed=163))], GREEDY, use_tqdm=False)
    engine = llm.engine
    execute = engine.runner.execute

    def fail_probes(works, probes=()):
        if probes:
            assert len(probes) == 2 and not works
            raise RuntimeError("boom")
        return execute(works, probes)

    monkeypatch.setattr(engine.runner, "execute", fail_probes)
    prompt = RAGPrompt(S, [B, A], random_prompt(4, seed=164), position_strategy="sequential",
                       recompute="query+blend", recompute_ratio=0.3)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and "boom" in out.error
    monkeypatch.setattr(engine.runner, "execute", execute)
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].finish_reason == "length"
    llm.check_integrity()


def test_check_layers_default_per_scorer(llama):
    """Unset check layers are the scorer's: `query` probes at 13/27/40% of the depth (the
    layers measured on SmolLM2's 30), `blend` at layer 1; configured ones are kept."""
    from ragkv.recompute.policy import check_layers_for

    assert check_layers_for("query", None, 30) == (4, 8, 12)
    assert check_layers_for("sink+query", None, 32) == (4, 9, 13)
    assert check_layers_for("query", None, 2) == (0, 1)
    assert check_layers_for("query", None, 1) == (0,)
    assert check_layers_for("blend", None, 30) == check_layers_for("sink+blend", None, 8) == (1,)
    assert check_layers_for("query", (2, 5), 30) == (2, 5)
    path, _ = llama
    S, A, Q = random_prompt(5, seed=120), random_prompt(8, seed=121), random_prompt(3, seed=122)
    llm = make_llm(path, kv_cache_tokens=512)
    engine = llm.engine
    n = engine.model_config.num_layers
    for method in ("query", "sink+query", "blend"):
        spec = engine.inputs.process(RAGPrompt(S, [A], Q, recompute=method)).recompute
        assert spec.check_layers == check_layers_for(method, None, n)
    llm = make_llm(path, kv_cache_tokens=512, recompute_check_layers=(0,))
    engine = llm.engine
    spec = engine.inputs.process(RAGPrompt(S, [A], Q, recompute="query")).recompute
    assert spec.check_layers == (0,)


def test_one_layer_model_loads_with_recompute_off(tmp_path):
    """Check layers are checked only where recompute is used: blend's default (layer 1)
    fails on one layer, query's default fits any depth, and sink alone probes nothing."""
    import conftest

    from ragkv import LLM

    path = str(tmp_path / "one")
    # write_checkpoint reads the module's base config: one layer for this checkpoint only.
    base = dict(conftest._BASE)
    conftest._BASE["num_hidden_layers"] = 1
    try:
        conftest.write_checkpoint(path, "llama")
    finally:
        conftest._BASE.clear()
        conftest._BASE.update(base)
    llm = LLM(path, kv_cache_tokens=256)
    with pytest.raises(ValueError, match=r"layer 1; the model has layers 0 \.\. 0"):
        llm.generate([RAGPrompt([1, 2], [[3, 4]], [5], recompute="blend")], GREEDY,
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"its blend probe checks layer 1; the model has "
                                         r"layers 0 \.\. 0"):
        llm.generate([RAGPrompt([1, 2], [[3, 4]], [5], recompute="query+blend")], GREEDY,
                     use_tqdm=False)
    llm.check_integrity()
    # query: ceil(0.5 * 6) of the second chunk, by its probe; sink: ceil(0.5 * 4) of it.
    for method, count in (("query", 3), ("sink", 2)):
        out = llm.generate([RAGPrompt([1, 2], [[3, 4], [6, 7, 8, 9]], [5], recompute=method,
                                      recompute_ratio=0.5)], GREEDY, use_tqdm=False)[0]
        assert out.metrics.num_recomputed_tokens == count
    llm.check_integrity()


def test_a_probe_in_blocks_scores_as_one_pass(llama, monkeypatch):
    """The probe's memory stays within the step budget: a `blend` probe takes the chunk tokens
    through the layers a block at a time, and attention of any probe runs in row blocks
    (here blocks of 3 tokens and of one row): the scores equal the one-pass ones."""
    import dataclasses

    from ragkv.recompute import probe as probe_module

    path, _ = llama
    llm = make_llm(path, kv_cache_tokens=1024)
    runs = []

    def both_ways(run, work, model, pool, backend):
        whole = run(work, model, pool, backend)
        with monkeypatch.context() as m:
            m.setattr(probe_module, "_BLOCK_ELEMENTS", 1)
            blocked = run(dataclasses.replace(work, block_tokens=3), model, pool, backend)
        runs.append((work.kind, whole, blocked))
        return whole

    wrap_probes(monkeypatch, both_ways)
    S = random_prompt(7, seed=130)
    A, B = random_prompt(17, seed=131), random_prompt(11, seed=132)
    for method in ("blend", "query", "sink+blend"):
        llm.generate([rc(S, [A, B], random_prompt(5, seed=133), method, 0.3)], GREEDY,
                     use_tqdm=False)
    assert {kind for kind, _, _ in runs} == {"blend", "query"}
    for _, whole, blocked in runs:
        assert torch.allclose(whole, blocked, rtol=1e-5, atol=1e-7)
    llm.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_query_probe_runs_its_layers_as_a_step_in_the_questions_slots(backend, llama,
                                                                      monkeypatch):
    """A `query` probe writes its tokens' K/V into the question's own slots (taken by the
    planner, kept by the question) and runs its layers outside the check layers through the
    attention backend: its scores equal those of the probe that keeps its K/V to itself, and
    no cached chunk's KV changes."""
    import dataclasses

    if backend == "triton":
        pytest.importorskip("triton")
    path, _ = llama
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    llm = make_llm(path, kv_cache_tokens=1024, chunk_cache_tokens=512, device=device,
                   dtype="float32", attention_backend=backend)
    runs = []

    def both_ways(run, work, model, pool, engine_backend):
        stepped = run(work, model, pool, engine_backend)
        kept = run(dataclasses.replace(work, own_slots=[]), model, pool, None)
        qs = work.chunks[1]
        runs.append((work, list(work.request.kv.slots[qs:qs + len(work.token_ids)]),
                     stepped, kept))
        return stepped

    wrap_probes(monkeypatch, both_ways)
    written = []  # the slots each question work writes
    execute = llm.engine.runner.execute
    monkeypatch.setattr(llm.engine.runner, "execute", lambda works, probes=(): written.extend(
        w.kv.slots[w.start:w.end] for w in works
        if w.start == w.request.layout.question_start) or execute(works, probes))
    S, A, B = random_prompt(7, seed=180), random_prompt(17, seed=181), random_prompt(11, seed=182)
    llm.generate([rag(S, [A, B], random_prompt(3, seed=183))], GREEDY, use_tqdm=False)
    before = entry_bytes(llm)
    for chunks, q in (([B, A], 6), ([A, B], 1)):
        out = llm.generate([rc(S, chunks, random_prompt(q, seed=184 + q), "query", 0.3)],
                           GREEDY, use_tqdm=False)[0]
        assert out.metrics.num_recomputed_tokens > 0
    assert len(runs) == 2
    for work, question_slots, stepped, kept in runs:
        assert work.own_slots and work.own_slots == question_slots
        assert work.own_slots in written  # the question computes into them
        assert torch.allclose(stepped, kept, rtol=1e-4, atol=1e-6)
    after = entry_bytes(llm)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    llm.check_integrity()

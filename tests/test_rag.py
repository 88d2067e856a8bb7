"""RAG prompts against the one-pass reference (docs/rag.md): S, chunks C_1..C_n and Q, chunks at
shared positions after S and isolated from each other. Greedy tokens must equal HF's and the
first step's logprobs must be within 1e-4 (float32), with the chunk cache cold, warm, reordered,
evicting, deduplicating, salted, cleared or disabled; chunk hit/miss counts are exact."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import random_prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import layout_reference, reference_greedy

from ragkv import LLM, RAGPrompt, SamplingParams

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, ignore_eos=True)
TOL = 1e-4


# ---------------------------------------------------------------------------------- helpers


def parts(prompt) -> tuple[list[int], list[list[int]], list[int]]:
    """(S, chunks, Q) token lists of a token-id prompt; a plain prompt is all question."""
    if isinstance(prompt, RAGPrompt):
        return list(prompt.system), [list(c) for c in prompt.chunks if c], list(prompt.question)
    return [], [], list(prompt["prompt_token_ids"])


def layout_of(prompt, llm=None) -> tuple[str, str]:
    """(position_strategy, chunk_attention) a prompt runs with: its own, else the engine's."""
    config = llm.config if llm is not None else None
    strategy = (getattr(prompt, "position_strategy", None)
                or (config.position_strategy if config else "shared"))
    attention = (getattr(prompt, "chunk_attention", None)
                 or (config.chunk_attention if config else "isolated"))
    return strategy, attention


@functools.cache
def _reference(hf, system: tuple, chunks: tuple, question: tuple, layout: tuple[str, str],
               max_tokens: int):
    # No chunks: an ordinary causal prompt, whatever the layout.
    ids, positions, visible, hidden = layout_reference(
        list(system), [list(c) for c in chunks], list(question), *layout)
    return reference_greedy(hf, ids, positions, visible, max_tokens, hidden=hidden)


def reference(hf, prompt, layout: tuple[str, str] = ("shared", "isolated")):
    system, chunks, question = parts(prompt)
    # MAX_TOKENS is read now and keys the cache (test_speculative.py checks longer outputs).
    return _reference(hf, tuple(system), tuple(map(tuple, chunks)), tuple(question), layout,
                      MAX_TOKENS)


def check_outputs(hf, prompts, outs, llm=None) -> None:
    """Each output against the one-pass reference of its prompt's layout (the prompt's own,
    else `llm`'s default)."""
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        system, chunks, question = parts(prompt)
        assert out.prompt_token_ids == system + [t for c in chunks for t in c] + question
        want, first_logp = reference(hf, prompt, layout_of(prompt, llm))
        got = out.outputs[0]
        assert got.token_ids == want
        assert got.token_ids[0] in got.logprobs[0]
        for tid, lp in got.logprobs[0].items():
            assert abs(lp.logprob - first_logp[tid].item()) < TOL, (tid, lp.logprob)


def run(llm, hf, prompts, expect: list[str] | None = None):
    """Generate `prompts` in one call, check them against the reference and integrity.

    `expect` gives, per prompt, one letter per chunk occurrence: "H" (hit) or "M" (miss);
    the per-request metrics and the chunk-cache stats deltas must agree exactly.
    """
    before = llm.get_chunk_cache_stats()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.check_integrity()
    after = llm.get_chunk_cache_stats()
    check_outputs(hf, prompts, outs, llm)
    assert after.hits - before.hits == sum(o.metrics.num_chunk_hits for o in outs)
    assert after.misses - before.misses == sum(o.metrics.num_chunk_misses for o in outs)
    assert after.used_tokens <= after.capacity_tokens
    if expect is not None:
        assert len(expect) == len(prompts)
        for prompt, out, marks in zip(prompts, outs, expect, strict=True):
            _, chunks, _ = parts(prompt)
            assert len(marks) == len(chunks)
            hit_tokens = sum(len(c) for c, m in zip(chunks, marks, strict=True) if m == "H")
            m = out.metrics
            assert (m.num_chunk_hits, m.num_chunk_misses) == (marks.count("H"), marks.count("M"))
            assert m.num_chunk_cached_tokens == hit_tokens
            assert out.num_cached_tokens == m.num_prefix_cached_tokens + hit_tokens
        all_marks = "".join(expect)
        hit_tokens = sum(o.metrics.num_chunk_cached_tokens for o in outs)
        assert after.hits - before.hits == all_marks.count("H")
        assert after.misses - before.misses == all_marks.count("M")
        assert after.lookups - before.lookups == len(all_marks)
        assert after.hit_tokens - before.hit_tokens == hit_tokens
        assert after.lookups == after.hits + after.misses
        if after.lookups:
            assert after.hit_rate == pytest.approx(after.hits / after.lookups)
    return outs


def make_llm(model: str, **kwargs) -> LLM:
    """An LLM whose KV pool starts as NaN, so that attending to any slot that was never
    written (a chunk used before it is computed, a stale slot) poisons the output instead of
    passing silently. Slot 0, the padding target of batched decode, stays zero, as the pool
    makes it (test_decode_padding_slot_garbage_does_not_leak).

    Its default layout is the exact one these tests compare with their references: shared
    positions, no recompute (`position_strategy` given overrides it). The engine's own
    default, the quality mode, is tested in test_recompute.py."""
    llm = LLM(model, **{"position_strategy": "shared", **kwargs})
    kv = llm.engine.pool.kv
    kv.fill_(float("nan"))
    kv[:, :, 0] = 0.0
    return llm


def rag(system, chunks, question, salt=None, layout: tuple[str, str] | None = None
        ) -> RAGPrompt:
    """A token-id RAG prompt; `layout` = (position_strategy, chunk_attention), None: the
    engine's default."""
    strategy, attention = layout or (None, None)
    return RAGPrompt(system, chunks, question, cache_salt=salt, position_strategy=strategy,
                     chunk_attention=attention)


def plain(ids) -> dict:
    return {"prompt_token_ids": ids}


@pytest.fixture(scope="module")
def llama(checkpoint, hf_model):
    path = checkpoint("llama")
    return path, hf_model(path)


# -------------------------------------------------------------------------------- scenarios


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_rag_scenarios_match_reference(family, checkpoint, hf_model):
    path = checkpoint(family)
    rag_scenarios(make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512), hf_model(path))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "mistral_window"])
def test_rag_scenarios_on_the_triton_backend(family, checkpoint, hf_model):
    """The Triton kernels end to end: on a GPU compiled, in float32 against the float32 CPU
    reference, with decode through CUDA graphs; without one, through Triton's interpreter."""
    pytest.importorskip("triton")
    path = checkpoint(family)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512, device=device,
                   dtype="float32", attention_backend="triton")
    assert llm.engine.runner.backend.name == "triton"
    assert (llm.engine.runner.graphs is not None) == (device == "cuda")
    rag_scenarios(llm, hf_model(path))


def rag_scenarios(llm, hf) -> None:
    S = random_prompt(9, seed=1)
    A, B, C, D, E = (random_prompt(n, seed=10 + n) for n in (14, 22, 6, 17, 11))
    Q1, Q2 = random_prompt(5, seed=2), random_prompt(7, seed=3)

    # Cold: every chunk misses, nothing reused.
    out = run(llm, hf, [rag(S, [A, B, C], Q1)], ["MMM"])[0]
    assert out.num_cached_tokens == 0
    stats = llm.get_chunk_cache_stats()
    assert stats.cached_chunks == 3 and stats.used_tokens == len(A) + len(B) + len(C)
    assert stats.evictions == 0 and stats.capacity_tokens == 512

    # Warm, reordered: every chunk hits; S comes from the prefix cache.
    out = run(llm, hf, [rag(S, [C, A, B], Q1)], ["HHH"])[0]
    assert out.metrics.num_prefix_cached_tokens == len(S)
    assert out.num_cached_tokens == len(S) + len(A) + len(B) + len(C)

    # A subset plus a new chunk, another question.
    out = run(llm, hf, [rag(S, [B, D], Q2)], ["HM"])[0]
    assert out.num_cached_tokens == len(S) + len(B)
    assert llm.get_chunk_cache_stats().cached_chunks == 4

    # The same cold chunk twice in one prompt: computed once (1 miss, then 1 hit).
    out = run(llm, hf, [rag(S, [E, A, E], Q1)], ["MHH"])[0]
    assert out.num_cached_tokens == len(S) + len(A) + len(E)
    stats = llm.get_chunk_cache_stats()
    assert stats.cached_chunks == 5
    assert stats.used_tokens == sum(map(len, (A, B, C, D, E)))

    # Another system prompt: a chunk's KV depends on S, so every chunk misses.
    S2 = random_prompt(12, seed=4)
    out = run(llm, hf, [rag(S2, [A, B], Q1)], ["MM"])[0]
    assert out.num_cached_tokens == 0
    assert llm.get_chunk_cache_stats().cached_chunks == 7

    # No chunks: an ordinary causal prompt (S + Q); no chunk lookups.
    out = run(llm, hf, [rag(S, [], Q2)], [""])[0]
    assert out.num_cached_tokens == len(S)  # S is in the prefix cache
    assert llm.get_chunk_cache_stats().cached_chunks == 7


def test_batch_mixes_rag_and_plain_prompts(llama):
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=2048)
    S = random_prompt(8, seed=20)
    A, B, C = (random_prompt(n, seed=20 + n) for n in (13, 21, 9))
    prompts = [
        rag(S, [A, B], random_prompt(4, seed=30)),
        plain(random_prompt(33, seed=31)),
        rag(S, [B, C], random_prompt(6, seed=32)),  # B is being computed by the first
        plain(S + random_prompt(5, seed=33)),
        rag(S, [C, A, B], random_prompt(3, seed=34)),
    ]
    run(llm, hf, prompts, ["MM", "", "HM", "", "HHH"])
    assert llm.get_chunk_cache_stats().cached_chunks == 3
    # All again in one batch, shuffled: every chunk hits.
    prompts = prompts[::-1]
    run(llm, hf, prompts, ["HHH", "", "HH", "", "HH"])


def test_eviction_between_requests(llama):
    path, hf = llama
    # Room for one request's three chunks (60 tokens) and a little more.
    llm = make_llm(path, kv_cache_tokens=1024, chunk_cache_tokens=70)
    S = random_prompt(6, seed=40)
    A, B, C, D, E = (random_prompt(20, seed=41 + i) for i in range(5))
    q = random_prompt(5, seed=47)
    run(llm, hf, [rag(S, [A, B, C], q)], ["MMM"])
    assert llm.get_chunk_cache_stats().evictions == 0
    # D evicts A (least recently used), E evicts B.
    run(llm, hf, [rag(S, [D, E], q)], ["MM"])
    stats = llm.get_chunk_cache_stats()
    assert stats.evictions == 2 and stats.evicted_tokens == 40
    assert stats.cached_chunks == 3 and stats.used_tokens == 60 <= stats.capacity_tokens
    # E is still cached; A was evicted and misses again (evicting C, now the oldest).
    run(llm, hf, [rag(S, [E, A], q)], ["HM"])
    assert llm.get_chunk_cache_stats().evictions == 3
    # C went, D stayed.
    run(llm, hf, [rag(S, [D, C], q)], ["HM"])
    assert llm.get_chunk_cache_stats().evictions == 4


@pytest.mark.parametrize("budget", [2048, 16])
def test_concurrent_requests_compute_a_new_chunk_once(budget, llama):
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=2048, max_num_batched_tokens=budget)
    S = random_prompt(10, seed=50)
    N = random_prompt(37, seed=51)
    prompts = [rag(S, [N], random_prompt(5, seed=52)), rag(S, [N], random_prompt(8, seed=53))]
    run(llm, hf, prompts, ["M", "H"])
    stats = llm.get_chunk_cache_stats()
    assert stats.cached_chunks == 1 and stats.used_tokens == len(N)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_prefill_with_long_chunks(prefix_caching, llama):
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=2048, max_num_batched_tokens=16,
                   enable_prefix_caching=prefix_caching)
    S = random_prompt(20, seed=60)
    A, B, C, E = (random_prompt(n, seed=60 + n) for n in (40, 25, 33, 37))
    q = random_prompt(18, seed=61)
    out = run(llm, hf, [rag(S, [A, B, C], q)], ["MMM"])[0]
    assert out.num_cached_tokens == 0
    out = run(llm, hf, [rag(S, [C, A], q)], ["HH"])[0]
    assert out.num_cached_tokens == len(S) * prefix_caching + len(A) + len(C)
    # A long cold chunk twice in one prompt, and a second request waiting for it.
    run(llm, hf, [rag(S, [E, B, E], q), rag(S, [A, E, C], random_prompt(3, seed=62))],
        ["MHH", "HHH"])
    assert llm.get_chunk_cache_stats().cached_chunks == 4


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_with_rag_requests(prefix_caching, llama):
    """Running requests outgrow a small general region while decoding: the newest are
    preempted and recomputed, and every output still equals the reference."""
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=145, chunk_cache_tokens=60, max_model_len=80,
                   enable_prefix_caching=prefix_caching)
    S = random_prompt(10, seed=70)
    chunks = [random_prompt(n, seed=500 + n) for n in (25, 28, 22, 30, 26, 24, 27, 23)]
    prompts = [rag(S, [chunks[2 * i], chunks[2 * i + 1]], random_prompt(8, seed=900 + i))
               for i in range(4)]
    prompts += [plain(random_prompt(40, seed=5 + i)) for i in range(3)]
    before = llm.get_chunk_cache_stats()
    outs = run(llm, hf, prompts)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    # A preempted request recomputes, but each chunk occurrence is still counted once.
    for o in outs[:4]:
        assert o.metrics.num_chunk_hits + o.metrics.num_chunk_misses == 2
    after = llm.get_chunk_cache_stats()
    assert after.lookups - before.lookups == 8
    assert after.used_tokens <= after.capacity_tokens == 60
    # Everything released: the next request runs exactly too.
    run(llm, hf, prompts[:1])


def test_request_short_of_slots_waits_instead_of_preempting_itself(llama):
    """Regression (issue 8, defect 4): a request whose chunk cannot fit the (pinned-full) chunk
    region and whose fallback finds no free general slots was taken for one waiting on another
    request's chunk, admitted with no work, preempted itself, and looped (4 preemptions each
    for the last two requests here). Now its plan is rolled back and it waits in the queue
    until the running requests finish."""
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=200, chunk_cache_tokens=60, max_model_len=120)
    S = random_prompt(10, seed=70)
    chunks = [random_prompt(n, seed=500 + n) for n in (25, 28, 22, 30, 26, 24, 27, 23)]
    prompts = [rag(S, [chunks[2 * i], chunks[2 * i + 1], chunks[(2 * i + 2) % 8]],
                   random_prompt(8, seed=900 + i)) for i in range(4)]
    outs = run(llm, hf, prompts)
    assert [o.metrics.num_preemptions for o in outs] == [0, 0, 0, 0]
    for o in outs:
        assert o.metrics.num_chunk_hits + o.metrics.num_chunk_misses == 3


def test_chunk_region_smaller_than_a_chunk(llama):
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024, chunk_cache_tokens=10)
    S = random_prompt(7, seed=80)
    A, B = random_prompt(20, seed=81), random_prompt(15, seed=82)
    # No entry is ever made, so even a repeated chunk misses every time.
    prompt = rag(S, [A, B, A], random_prompt(6, seed=83))
    for _ in range(2):
        out = run(llm, hf, [prompt], ["MMM"])[0]
        stats = llm.get_chunk_cache_stats()
        assert stats.cached_chunks == 0 and stats.used_tokens == 0
        assert stats.capacity_tokens == 10 and stats.evictions == 0
    assert out.num_cached_tokens == len(S)


def test_chunk_cache_disabled(llama):
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024, enable_chunk_cache=False)
    S = random_prompt(9, seed=90)
    A, B = random_prompt(16, seed=91), random_prompt(12, seed=92)
    q = random_prompt(4, seed=93)
    outs = [run(llm, hf, [rag(S, chunks, q)])[0] for chunks in ([A, B], [B, A], [A, B])]
    assert [o.num_cached_tokens for o in outs] == [0, len(S), len(S)]
    for o in outs:
        m = o.metrics
        assert (m.num_chunk_hits, m.num_chunk_misses, m.num_chunk_cached_tokens) == (0, 0, 0)
    stats = llm.get_chunk_cache_stats()
    assert (stats.lookups, stats.hits, stats.misses, stats.hit_tokens, stats.cached_chunks,
            stats.used_tokens, stats.capacity_tokens, stats.evictions) == (0,) * 8
    assert stats.hit_rate == 0.0 and stats.avg_lookup_ms == 0.0
    assert llm.clear_chunk_cache() == 0


def test_cache_salt_separates_entries(llama):
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024, chunk_cache_fraction=0.25)
    assert llm.get_chunk_cache_stats().capacity_tokens == 256
    S = random_prompt(8, seed=100)
    A, B = random_prompt(18, seed=101), random_prompt(11, seed=102)
    q = random_prompt(5, seed=103)
    run(llm, hf, [rag(S, [A, B], q, salt="a")], ["MM"])
    run(llm, hf, [rag(S, [B, A], q, salt="b")], ["MM"])
    run(llm, hf, [rag(S, [A, B], q)], ["MM"])  # no salt is a namespace of its own
    run(llm, hf, [rag(S, [B, A], q, salt="a")], ["HH"])
    run(llm, hf, [rag(S, [A], q, salt="b")], ["H"])
    assert llm.get_chunk_cache_stats().cached_chunks == 6


def test_cache_salt_separates_prefix_cache(llama):
    """Tenants share no KV at all: the prefix cache is namespaced by the salt too."""
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024)
    prompt = random_prompt(30, seed=120)

    def cached(salt):
        request = {"prompt_token_ids": prompt}
        if salt is not None:
            request["cache_salt"] = salt
        out = llm.generate(request, GREEDY, use_tqdm=False)[0]
        llm.check_integrity()
        return out.num_cached_tokens

    assert cached("a") == 0
    assert cached("b") == 0
    assert cached(None) == 0
    assert cached("a") == len(prompt) - 1
    assert cached(None) == len(prompt) - 1


def test_clear_chunk_cache(llama):
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024)
    S = random_prompt(8, seed=110)
    A, B = random_prompt(18, seed=111), random_prompt(11, seed=112)
    q = random_prompt(5, seed=113)
    run(llm, hf, [rag(S, [A, B], q)], ["MM"])
    run(llm, hf, [rag(S, [B, A], q)], ["HH"])
    assert llm.clear_chunk_cache() == 2
    llm.check_integrity()
    stats = llm.get_chunk_cache_stats()
    assert stats.cached_chunks == 0 and stats.used_tokens == 0
    assert stats.evictions == 2 and stats.lookups == 4  # counters survive a clear
    run(llm, hf, [rag(S, [A, B], q)], ["MM"])
    assert llm.clear_chunk_cache() == 2
    assert llm.clear_chunk_cache() == 0


class _GarbageTorch:
    """`torch` as ragkv.cache.kv_pool sees it, except that `torch.empty` hands back memory
    full of NaN: legitimately what uninitialised memory may hold."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


def test_decode_padding_slot_garbage_does_not_leak(llama, monkeypatch):
    """Slot 0 is the padding target of batched decode, attended under a mask. If it held
    NaN (as memory from torch.empty may), masking would not help: NaN + -inf and 0 * NaN are
    NaN. The pool must keep it finite, whatever torch.empty returns."""
    import ragkv.cache.kv_pool as kv_pool

    path, hf = llama
    with monkeypatch.context() as m:
        m.setattr(kv_pool, "torch", _GarbageTorch())
        llm = LLM(path, kv_cache_tokens=512)
    # Two sequences of different lengths decode in one batch: the shorter one is padded.
    run(llm, hf, [plain(random_prompt(5, seed=140)), plain(random_prompt(30, seed=141))])


def test_oversize_chunks_error_or_split(llama):
    path, hf = llama
    S = random_prompt(6, seed=150)
    long, short = random_prompt(40, seed=151), random_prompt(9, seed=152)
    q = random_prompt(4, seed=153)
    llm = make_llm(path, kv_cache_tokens=1024, max_chunk_tokens=16)
    with pytest.raises(ValueError, match="max_chunk_tokens"):
        llm.generate([rag(S, [short], q), rag(S, [long], q)], GREEDY, use_tqdm=False)
    llm.check_integrity()
    assert llm.get_chunk_cache_stats().lookups == 0  # nothing was queued
    run(llm, hf, [rag(S, [short], q)], ["M"])

    # "split": the pieces are chunks of their own (each at positions s.., isolated).
    llm = make_llm(path, kv_cache_tokens=1024, max_chunk_tokens=16, oversize_chunk="split")
    pieces = [long[:16], long[16:32], long[32:]]
    out = llm.generate(rag(S, [short, long], q), GREEDY, use_tqdm=False)[0]
    llm.check_integrity()
    check_outputs(hf, [rag(S, [short, *pieces], q)], [out])
    assert (out.metrics.num_chunk_hits, out.metrics.num_chunk_misses) == (0, 4)
    assert llm.get_chunk_cache_stats().cached_chunks == 4
    run(llm, hf, [rag(S, [pieces[1], short], q)], ["HH"])


# ------------------------------------------------------------------------- property test

_SYSTEM = random_prompt(12, seed=120)
_POOL = [random_prompt(n, seed=121 + i) for i, n in enumerate((1, 30, 7, 18, 3, 25))]


@pytest.fixture(scope="module")
def shared_llama(llama):
    path, hf = llama
    # Big enough that nothing is ever evicted, so hits and misses are predictable.
    llm = make_llm(path, kv_cache_tokens=8192, chunk_cache_tokens=4096)
    return llm, hf, set()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=st.sampled_from([0, 5, 12]) | st.integers(0, 12),  # repeated S lengths give hits
       picks=st.integers(0, 4).flatmap(
           lambda n: st.lists(st.integers(0, len(_POOL) - 1), min_size=n, max_size=n)),
       q=st.integers(1, 8), q_seed=st.integers(0, 3))
def test_random_rag_prompts_match_reference(shared_llama, s, picks, q, q_seed):
    llm, hf, seen = shared_llama
    system = _SYSTEM[:s]
    chunks = [_POOL[i] for i in picks]
    question = random_prompt(q, seed=130 + q_seed)
    marks = ""
    for c in chunks:  # a hit iff the chunk was computed before under this S
        key = (tuple(system), tuple(c))
        marks += "H" if key in seen else "M"
        seen.add(key)
    run(llm, hf, [rag(system, chunks, question)], [marks])


# ---------------------------------------------------------------------------- string prompts


@pytest.fixture(scope="module")
def tiny():
    from ragkv.model.builtin import builtin_model_path

    return builtin_model_path("builtin:tiny")


@pytest.mark.parametrize("separator", ["##", " # # "])
def test_string_prompt_equals_tokenized_rag_prompt(separator, tiny, hf_model):
    llm = make_llm("builtin:tiny", kv_cache_tokens=1024, chunk_separator=separator)
    tok = llm.get_tokenizer()
    spaced = ["sys ", " doc a ", " doc b ", " question?"]
    # The whitespace next to each separator is trimmed with it: one canonical form.
    texts = [t.strip() for t in spaced]
    system = tok.encode(texts[0], add_special_tokens=True)
    chunks = [tok.encode(t, add_special_tokens=False) for t in texts[1:3]]
    question = tok.encode(texts[3], add_special_tokens=False)
    structured = RAGPrompt(system, chunks, question)
    hf = hf_model(tiny)

    with pytest.raises(ValueError, match="question"):
        llm.generate(separator.join([*texts[:3], "  "]), GREEDY, use_tqdm=False)
    by_text = llm.generate(separator.join(spaced), GREEDY, use_tqdm=False)[0]
    llm.check_integrity()
    assert by_text.prompt_token_ids == system + chunks[0] + chunks[1] + question
    assert (by_text.metrics.num_chunk_hits, by_text.metrics.num_chunk_misses) == (0, 2)
    by_ids = run(llm, hf, [structured], ["HH"])[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    check_outputs(hf, [structured], [by_text])
    # A RAGPrompt of the strings is tokenized the same way.
    by_strings = llm.generate(RAGPrompt(texts[0], texts[1:3], texts[3]), GREEDY,
                              use_tqdm=False)[0]
    llm.check_integrity()
    assert by_strings.prompt_token_ids == by_text.prompt_token_ids
    assert (by_strings.metrics.num_chunk_hits, by_strings.metrics.num_chunk_misses) == (2, 0)
    assert by_strings.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_xxh3_chunk_hash_gives_the_same_reuse(llama):
    """chunk_hash_algo='xxh3_128' keys entries differently but reuses them the same way."""
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=1024, chunk_hash_algo="xxh3_128")
    S = random_prompt(8, seed=130)
    A, B = random_prompt(18, seed=131), random_prompt(11, seed=132)
    q = random_prompt(5, seed=133)
    run(llm, hf, [rag(S, [A, B], q)], ["MM"])
    run(llm, hf, [rag(S, [B, A], q)], ["HH"])
    assert len(llm.engine.inputs.chunk_keys.hash("ns", (1,), (2,))) == 16

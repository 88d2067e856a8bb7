"""Speculative decoding from the request's own tokens (prompt lookup): outputs are the tokens
decoding without drafts gives (greedy, and sampled with a seed), against the one-pass
reference in every layout, through chunked prefill, preemption, n > 1, stop strings,
max_tokens inside a draft, logprobs; the pool stays whole after every step."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import test_rag
from conftest import random_prompt
from test_rag import make_llm, plain, rag, rag_scenarios
from test_rag import run as run_against_reference

from ragkv import LLM, SamplingParams
from ragkv.config import EngineConfig, SpeculativeConfig
from ragkv.engine import speculative
from ragkv.engine.speculative import NgramIndex, SpecDecodeStats, Speculator, StepCost
from ragkv.structured.params import StructuredOutputsParams

# Every draft found is verified: these tests check what drafted rows compute, and the cost
# gate (adaptive, the default) decides from measured step times which drafts a step takes.
# The gate has tests of its own (GATED), outputs compared too.
SPEC = {"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "adaptive": False}
GATED = {**SPEC, "adaptive": True}


@pytest.fixture(scope="module")
def llama(checkpoint, hf_model):
    path = checkpoint("llama")
    return path, hf_model(path)


@pytest.fixture
def longer_reference(monkeypatch):
    """test_rag's reference checks over 20 generated tokens instead of 6, so that drafts
    are proposed, kept and rejected within them."""
    monkeypatch.setattr(test_rag, "MAX_TOKENS", 20)
    monkeypatch.setattr(test_rag, "GREEDY", SamplingParams(
        max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True))


def _prompts() -> list:
    # Random tokens with repeats: greedy output on the test checkpoint falls into loops and
    # copies, so drafts are kept, cut short and rejected.
    loop = random_prompt(6, seed=41)
    return [plain(random_prompt(12, seed=40) + loop * 3), plain(random_prompt(30, seed=42)),
            plain(loop * 2 + random_prompt(5, seed=43))]


def _drafts(outs) -> tuple[int, int]:
    return (sum(o.metrics.num_draft_tokens for o in outs),
            sum(o.metrics.num_accepted_tokens for o in outs))


def _same(a, b, logprobs: bool = False) -> None:
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cx.token_ids == cy.token_ids
            assert (cx.text, cx.finish_reason, cx.stop_reason) == (
                cy.text, cy.finish_reason, cy.stop_reason)
            if logprobs:
                for ex, ey in zip(cx.logprobs, cy.logprobs, strict=True):
                    assert ex.keys() == ey.keys()
                    for t in ex:
                        assert math.isclose(ex[t].logprob, ey[t].logprob, abs_tol=1e-4)
                        assert ex[t].rank == ey[t].rank


def _pair(path: str, **kwargs) -> tuple[LLM, LLM]:
    return (LLM(path, debug_checks=True, **kwargs),
            LLM(path, debug_checks=True, speculative_config=SPEC, **kwargs))


def test_ngram_index_finds_the_latest_longest_match():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert index.propose(tokens, 2) == [7, 5]  # the latest "1 2 3", not the first
    assert index.propose([*tokens, 4], 3) == []  # "3 4", "4": never seen before
    index = NgramIndex(1, 3)
    assert index.propose([5, 6, 5], 4) == [6, 5]  # a 1-gram; the match may run into the end
    assert index.propose([5, 6, 5, 8, 6], 2) == [5, 8]  # indexed incrementally
    index = NgramIndex(2, 2)
    assert index.propose([1, 2, 9, 1], 3) == []  # below prompt_lookup_min


def test_config_is_checked():
    assert EngineConfig(model="m", speculative_config=SPEC).speculative_config == \
        SpeculativeConfig(**SPEC)
    for bad, fragment in [({"method": "eagle"}, "ngram"), ({"num_speculative_tokens": 0},
                                                           "positive"),
                          ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "at most"),
                          ({"typo": 1}, "unknown setting"), ("ngram", "dict"),
                          ({"adaptive": "yes"}, "true or false")]:
        with pytest.raises(ValueError, match=fragment):
            EngineConfig(model="m", speculative_config=bad)


def test_the_cost_gate_verifies_the_drafts_that_pay():
    """Speculator.paying: the step's drafts, best kept share first, while the tokens expected
    per second (by the measured StepCost of as many sequences) rise; a step of unknown cost is
    measured first, and the best draft's again after a run of steps without drafts."""
    spec = Speculator(SpeculativeConfig(**GATED), 1024)

    def proposals(*rates):  # requests that kept these shares of 80 drafted tokens so far
        return [(SimpleNamespace(metrics=SimpleNamespace(
            num_draft_tokens=80, num_accepted_tokens=round(80 * r))), [0, 0]) for r in rates]

    assert spec.paying(4, proposals(0.9, 0.9)) == 0  # the plain step is timed first
    spec.cost.observe(4, 4, 1.0)
    assert spec.paying(4, proposals(0.9, 0.9)) == 2  # then the step with every draft
    assert spec.cost.at(4, 6) is None and spec.cost.at(3, 4) is None
    spec.cost.observe(4, 8, 1.0)  # rows that cost nothing: every draft pays
    assert spec.cost.at(4, 6) == 1.0 and spec.cost.at(5, 6) is None
    assert spec.paying(4, proposals(0.9, 0.1)) == 2
    spec.cost.observe(4, 8, 3.0)  # then 1.5 (a measurement moves the estimate a quarter)
    # 4 rows 1 s, 6 rows 1.25 s, 8 rows 1.5 s: 4 tokens/s without drafts. Kept shares
    # (with the prior's 8 tokens at 0.5): 0.9 -> 0.864, 0.3 -> 0.318, 0.4 -> 0.409. One
    # request's 2 drafts at 0.864 give 5.73 tokens in 1.25 s (4.58/s), both 7.45 in 1.5 s
    # (4.97/s); with 0.318 for the second, 6.36 in 1.5 s (4.24/s); at 0.409 each, 3.85/s and
    # 3.76/s, below the plain step's 4/s
    assert spec.cost.at(4, 8) == 1.5 and spec.cost.at(4, 6) == 1.25
    assert spec.paying(4, proposals(0.9, 0.9)) == 2
    assert spec.paying(4, proposals(0.9, 0.3)) == 1
    # After 64 steps in a row without drafts, the best draft is taken once to time it again.
    assert [spec.paying(4, proposals(0.4, 0.4)) for _ in range(66)] == [0] * 64 + [1, 0]
    # Beyond the largest row count measured: the line through the two largest, never falling.
    assert spec.cost.at(4, 12) == 2.0 and spec.cost.at(4, 3) is None
    spec.cost.observe(3, 3, 2.0)
    spec.cost.observe(3, 6, 1.0)
    assert spec.cost.at(3, 9) == 1.0 and math.isclose(spec.cost.at(3, 4), 5 / 3)
    assert spec.paying(4, []) == 0
    # A request's kept share counts 8 more drafted tokens at the engine's share, which counts
    # 8 more at 0.5: a first miss, the engine's or a request's, rules nothing out.
    first = SimpleNamespace(metrics=SimpleNamespace(num_draft_tokens=0, num_accepted_tokens=0))
    missed = SimpleNamespace(metrics=SimpleNamespace(num_draft_tokens=2, num_accepted_tokens=0))
    assert spec.rate(first) == 0.5 and spec.rate(missed) == 0.4
    spec.stats = SpecDecodeStats(num_drafts=1, num_draft_tokens=2, num_accepted_tokens=0)
    assert spec.rate(first) == 0.4 and math.isclose(spec.rate(missed), 0.32)


def test_the_cost_gate_on_a_batch_and_its_measurements(llama, monkeypatch):
    """A batch of decoding requests drafts where the measured cost of rows says it pays, and
    not where it does not; the outputs are the same either way, and the engine times its
    steps of generated tokens by their sequences and rows."""
    path, _ = llama
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=2)
    want = LLM(path).generate(_prompts(), params, use_tqdm=False)
    llm = LLM(path, debug_checks=True, speculative_config=GATED)
    llm.generate(_prompts(), params, use_tqdm=False)
    measured = llm.engine.scheduler.speculator.cost.seconds
    assert (3, 3) in measured and all(1 <= b <= n and t > 0 for (b, n), t in measured.items())
    monkeypatch.setattr(StepCost, "observe", lambda *args: None)
    monkeypatch.setattr(speculative, "_REMEASURE", 10**9)
    drafted = {}
    for name, per_row in (("rows cost nothing", 0.0), ("rows cost all", 1.0)):
        llm = LLM(path, debug_checks=True, speculative_config=GATED)
        llm.engine.scheduler.speculator.cost.seconds = {
            (b, n): 1.0 + per_row * (n - b) for b in (1, 2, 3) for n in (b, 64)}
        got = llm.generate(_prompts(), params, use_tqdm=False)
        _same(want, got, logprobs=True)
        drafted[name] = _drafts(got)[0]
        llm.check_integrity()
    assert drafted["rows cost nothing"] > 0 and drafted["rows cost all"] == 0, drafted


def test_greedy_output_and_logprobs_are_unchanged(llama):
    path, _ = llama
    plain_llm, spec_llm = _pair(path)
    params = SamplingParams(max_tokens=48, temperature=0, logprobs=3)
    want = plain_llm.generate(_prompts(), params, use_tqdm=False)
    got = spec_llm.generate(_prompts(), params, use_tqdm=False)
    _same(want, got, logprobs=True)
    drafted, kept = _drafts(got)
    assert 0 < kept < drafted  # drafts were kept and rejected
    assert _drafts(want) == (0, 0)
    spec_llm.check_integrity()


def test_every_layout_cold_and_warm_against_the_reference(llama, longer_reference):
    """The RAG scenarios of test_rag.py (cold, warm, reordered, subsets, duplicates, eviction,
    every layout) with drafts on, each output against the one-pass reference."""
    path, hf = llama
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512, speculative_config=SPEC)
    seen = []
    generate = llm.generate
    llm.generate = lambda *a, **k: seen.extend(generate(*a, **k)) or seen[-len(a[0]) if
                                                                           isinstance(a[0], list)
                                                                           else -1:]
    rag_scenarios(llm, hf)
    drafted, kept = _drafts(seen)
    assert 0 < kept < drafted


@pytest.mark.parametrize("recompute", ["query", "sink+blend"])
def test_recompute_modes_are_unchanged(llama, recompute):
    path, _ = llama
    S = random_prompt(9, seed=1)
    docs = [random_prompt(n, seed=10 + n) for n in (14, 22, 17)]
    prompts = [rag(S, docs, random_prompt(5, seed=2), layout=("sequential", "isolated")),
               rag(S, docs[::-1], random_prompt(6, seed=4), layout=("sequential", "isolated"))]
    plain_llm, spec_llm = _pair(path, recompute=recompute, recompute_ratio=0.4,
                                position_strategy="sequential")
    params = SamplingParams(max_tokens=32, temperature=0)
    for _ in range(2):  # cold, then warm
        _same(plain_llm.generate(prompts, params, use_tqdm=False),
              spec_llm.generate(prompts, params, use_tqdm=False))
    spec_llm.check_integrity()


def test_chunked_prefill_and_preemption_against_the_reference(llama, longer_reference):
    path, hf = llama
    # A budget of 6 tokens a step: drafts share it with prefill chunks.
    llm = make_llm(path, kv_cache_tokens=2048, max_num_batched_tokens=6,
                   speculative_config=SPEC)
    outs = run_against_reference(llm, hf, _prompts())
    assert _drafts(outs)[1] > 0
    # A general region too small for every request: the newest are preempted, drafts and
    # all, and recomputed.
    llm = make_llm(path, kv_cache_tokens=160, chunk_cache_tokens=60, max_model_len=100,
                   speculative_config=SPEC)
    S = random_prompt(10, seed=70)
    chunks = [random_prompt(n, seed=500 + n) for n in (25, 28, 22, 30, 26, 24, 27, 23)]
    prompts = [rag(S, [chunks[2 * i], chunks[2 * i + 1]], random_prompt(8, seed=900 + i))
               for i in range(4)] + [plain(random_prompt(40, seed=5 + i)) for i in range(3)]
    outs = run_against_reference(llm, hf, prompts)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert _drafts(outs)[0] > 0


def test_sampled_output_is_the_seeded_output_without_drafts(llama):
    """Each row is sampled from the stream the same output index uses without drafts, so a
    seeded sample is the same tokens, for every seed (the strongest form of "keeps the
    target distribution"): n > 1, top-p and top-k included."""
    path, _ = llama
    plain_llm, spec_llm = _pair(path)
    drafted = 0
    for seed in range(12):
        params = SamplingParams(n=3, max_tokens=24, temperature=0.7, top_p=0.95, top_k=50,
                                seed=seed, logprobs=1)
        want = plain_llm.generate(_prompts()[:2], params, use_tqdm=False)
        got = spec_llm.generate(_prompts()[:2], params, use_tqdm=False)
        _same(want, got, logprobs=True)
        drafted += _drafts(got)[1]
    assert drafted > 0
    spec_llm.check_integrity()


def test_stops_and_max_tokens_inside_a_draft(llama):
    path, _ = llama
    plain_llm, spec_llm = _pair(path)
    base = plain_llm.generate(_prompts(), SamplingParams(max_tokens=48, temperature=0),
                              use_tqdm=False)
    # A stop string and a stop token that end the output where drafts were being kept.
    text = base[0].outputs[0].text
    stop_string = text[len(text) // 2:len(text) // 2 + 3]
    stop_token = base[2].outputs[0].token_ids[20]
    for params in (SamplingParams(max_tokens=48, temperature=0, stop=[stop_string]),
                   SamplingParams(max_tokens=48, temperature=0, stop_token_ids=[stop_token]),
                   SamplingParams(max_tokens=48, temperature=0, stop=["\x00", stop_string]),
                   *(SamplingParams(max_tokens=m, temperature=0) for m in (1, 2, 7, 13))):
        got = spec_llm.generate(_prompts(), params, use_tqdm=False)
        _same(plain_llm.generate(_prompts(), params, use_tqdm=False), got)
        if params.stop or params.stop_token_ids:
            assert "stop" in [o.outputs[0].finish_reason for o in got]
    spec_llm.check_integrity()


def test_penalties_and_min_tokens_see_drafts_as_generated(llama):
    """A row after drafts reads a history that counts them: penalties and min_tokens give the
    tokens decoding without drafts gives."""
    path, _ = llama
    plain_llm, spec_llm = _pair(path)
    for params in (SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.2),
                   SamplingParams(max_tokens=40, temperature=0, frequency_penalty=0.3,
                                  presence_penalty=0.2),
                   SamplingParams(max_tokens=40, temperature=0.8, seed=5,
                                  repetition_penalty=1.1, logit_bias={7: 2.0}),
                   SamplingParams(max_tokens=40, temperature=0, min_tokens=30,
                                  stop_token_ids=[0, 1, 2])):
        got = spec_llm.generate(_prompts(), params, use_tqdm=False)
        _same(plain_llm.generate(_prompts(), params, use_tqdm=False), got)
        assert _drafts(got)[0] > 0, params
    spec_llm.check_integrity()


def test_structured_outputs_mask_each_drafted_row(llama):
    """A drafted row is masked at the grammar state the drafts before it lead to; drafts are
    cut where the grammar refuses a token. A JSON output that copies a string from the prompt
    keeps drafts and is the output decoding without drafts gives."""
    path, _ = llama
    plain_llm, spec_llm = _pair(path)
    tok = plain_llm.engine.tokenizer
    copied = '{"name": "alpha beta gamma delta", "tag": "alpha beta gamma delta"}'
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "tag": {"type": "string", "maxLength": 40}},
              "required": ["name", "tag"]}
    prompts = [plain(tok.encode(copied * 3)), *_prompts()]
    drafted = 0
    for so in (StructuredOutputsParams(json=schema), StructuredOutputsParams(json_object=True),
               StructuredOutputsParams(choice=["alpha beta gamma", "alpha beta delta"])):
        for params in (SamplingParams(max_tokens=48, temperature=0, structured_outputs=so),
                       SamplingParams(max_tokens=48, temperature=0.9, seed=3,
                                      structured_outputs=so)):
            got = spec_llm.generate(prompts, params, use_tqdm=False)
            _same(plain_llm.generate(prompts, params, use_tqdm=False), got)
            drafted += _drafts(got)[1]
    assert drafted > 0
    spec_llm.check_integrity()


def test_each_row_after_drafts_reads_them_as_generated(llama):
    """The history of row j of a drafting request: the output counts plus the first j drafts,
    min_tokens counted from its own output index (so a stop token is banned exactly where
    decoding without drafts bans it)."""
    from ragkv.engine.speculative import Speculator

    path, _ = llama
    llm = LLM(path, speculative_config=SPEC)
    engine = llm.engine
    engine.add_request(_prompts()[1], SamplingParams(max_tokens=40, temperature=0,
                                                     frequency_penalty=0.1, min_tokens=12,
                                                     stop_token_ids=[9]), "r")
    req = engine.scheduler.waiting[0]
    while req.num_output_tokens < 10:
        engine.step()
    Speculator.drop(req)  # whatever the step left (nothing: drafts live within a step)
    done = req.num_output_tokens
    req.params = req.params.clone(min_tokens=done + 2)  # rows 0 and 1 early, 2 and 3 not
    counts = dict(req.output_counts)
    req.token_ids.extend([5, 6, 5])
    req.num_drafts = 3
    rows = [engine.outputs._history(req, done + j) for j in range(4)]
    for j, extra in enumerate(({}, {5: 1}, {5: 1, 6: 1}, {5: 2, 6: 1})):
        want = {t: counts.get(t, 0) + extra.get(t, 0) for t in {*counts, *extra}}
        assert {t: c for t, c in rows[j].counts.items() if c} == {
            t: c for t, c in want.items() if c}
    assert [9 in r.banned for r in rows] == [True, True, False, False]
    Speculator.drop(req)
    engine.abort_request("r")
    engine.check_integrity()


def test_pool_is_whole_after_every_step(llama):
    path, _ = llama
    llm = LLM(path, debug_checks=True, speculative_config=SPEC, kv_cache_tokens=512)
    engine = llm.engine
    for i, prompt in enumerate(_prompts()):
        engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, n=2,
                                                  seed=i), f"r{i}")
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(engine.step())
        engine.check_integrity()
        assert all(r.num_drafts == 0 for r in engine.scheduler.running)
    assert len(finished) == 3 and _drafts(finished)[1] > 0
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_available_tokens == stats.kv_capacity_tokens


def test_server_streams_drafted_tokens_and_counts_them(checkpoint):
    """`ragkv serve --speculative-config`: streamed and whole replies are the same tokens as
    without drafts, and /metrics counts the drafts (ragkv: and vLLM's names)."""
    import httpx
    from conftest import running_server
    from openai import OpenAI

    path = checkpoint("llama")
    prompt = "the cat sat on the mat and the cat sat on the mat and the cat"
    want = LLM(path).generate(prompt, SamplingParams(max_tokens=40, temperature=0),
                              use_tqdm=False)[0].outputs[0].text
    with running_server(path, "--speculative-config", '{"num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 1}', "--vllm-metric-names") as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=40,
                                          temperature=0)
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=40,
                                           temperature=0, stream=True)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert whole.choices[0].text == streamed == want
        text = httpx.get(f"{base}/metrics", timeout=10).text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                  for line in text.splitlines() if line.startswith(("ragkv:spec", "vllm:spec"))}
        drafted = values["ragkv:spec_decode_num_draft_tokens_total"]
        assert drafted >= values["ragkv:spec_decode_num_accepted_tokens_total"] > 0
        assert values["vllm:spec_decode_num_draft_tokens_total"] == drafted
        assert values["ragkv:spec_decode_num_drafts_total"] > 0

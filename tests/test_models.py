"""ragkv vs HF transformers on tiny checkpoints of every family: greedy tokens identical and
first-token logprobs within 1e-4 (float32), alone, batched, with prefix-cache hits, with
chunked prefill and with preemption."""

from __future__ import annotations

import pytest
from conftest import MAIN_FAMILIES, random_prompt
from reference import causal_layout, reference_greedy, reference_logprobs

from ragkv import LLM, SamplingParams

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, ignore_eos=True)


def check_against_hf(hf, prompts, outs):
    for prompt, out in zip(prompts, outs, strict=True):
        positions, visible = causal_layout(len(prompt))
        want, first_logp = reference_greedy(hf, prompt, positions, visible, MAX_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == want
        tok = got.token_ids[0]
        assert abs(got.logprobs[0][tok].logprob - first_logp[tok].item()) < 1e-4
        for tid, lp in got.logprobs[0].items():
            assert abs(lp.logprob - first_logp[tid].item()) < 1e-4


@pytest.mark.parametrize("family", MAIN_FAMILIES)
def test_family_matches_hf_alone_and_batched(family, checkpoint, hf_model):
    path = checkpoint(family)
    hf = hf_model(path)
    llm = LLM(path, max_num_batched_tokens=512)
    prompts = [random_prompt(n, seed=n) for n in (3, 17, 150, 300)]
    for p in prompts[:2]:
        check_against_hf(hf, [p], llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False))
        llm.check_integrity()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    check_against_hf(hf, prompts, outs)
    llm.check_integrity()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefix_cache_hits_give_identical_outputs(family, checkpoint, hf_model):
    path = checkpoint(family)
    hf = hf_model(path)
    llm = LLM(path)
    shared = random_prompt(120, seed=1)
    prompts = [shared + random_prompt(n, seed=10 + n) for n in (5, 40)]
    first = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    # The repeated prompt hits all but its last token; the other hits the shared part.
    assert outs[0].num_cached_tokens == len(prompts[0]) - 1
    assert outs[1].num_cached_tokens >= len(shared)
    check_against_hf(hf, prompts, outs)
    # The generated tokens were cached too: a prompt continuing the first output hits them.
    cont = prompts[0] + outs[0].outputs[0].token_ids[:-1] + [11, 12]
    again = llm.generate({"prompt_token_ids": cont}, GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens == len(prompts[0]) + MAX_TOKENS - 1
    check_against_hf(hf, [cont], again)
    llm.check_integrity()
    stats = llm.engine.stats()
    assert stats.prefix_hit_tokens > 0 and stats.prefix_queried_tokens >= stats.prefix_hit_tokens


@pytest.mark.parametrize("family", ["llama", "qwen2", "yarn"])
def test_chunked_prefill_matches_hf(family, checkpoint, hf_model):
    path = checkpoint(family)
    hf = hf_model(path)
    llm = LLM(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    prompts = [random_prompt(n, seed=n) for n in (40, 97, 9)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    check_against_hf(hf, prompts, outs)
    llm.check_integrity()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_by_recompute_matches_hf(prefix_caching, checkpoint, hf_model):
    path = checkpoint("llama")
    hf = hf_model(path)
    # 6 requests of ~60 tokens each cannot all hold their KV in 160 slots.
    llm = LLM(path, kv_cache_tokens=160, max_model_len=100, max_num_batched_tokens=64,
              enable_prefix_caching=prefix_caching)
    prompts = [random_prompt(n, seed=100 + n) for n in (50, 45, 52, 48, 30, 55)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    check_against_hf(hf, prompts, outs)
    llm.check_integrity()


def test_dynamic_rope_matches_hf_one_pass(checkpoint, hf_model):
    """Dynamic NTK rescales frequencies by sequence length. Within max_position_embeddings
    (64) it is plain RoPE; past it, a prompt prefilled in one pass gives HF's one-pass
    first-token distribution. The usable length is max_position_embeddings * factor."""
    path = checkpoint("dynamic")
    hf = hf_model(path)
    llm = LLM(path, enable_prefix_caching=False)
    assert llm.engine.max_model_len == 128
    short = random_prompt(30, seed=3)
    check_against_hf(hf, [short], llm.generate({"prompt_token_ids": short}, GREEDY,
                                                use_tqdm=False))
    long = random_prompt(100, seed=4)
    out = llm.generate({"prompt_token_ids": long},
                       SamplingParams(max_tokens=1, temperature=0, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    positions, visible = causal_layout(len(long))
    want = reference_logprobs(hf, long, positions, visible)
    assert out.token_ids == [int(want.argmax())]
    for tid, lp in out.logprobs[0].items():
        assert abs(lp.logprob - want[tid].item()) < 1e-4
    llm.check_integrity()


def test_eos_and_stop_token_ids_end_generation(checkpoint, hf_model):
    path = checkpoint("llama")
    hf = hf_model(path)
    llm = LLM(path)
    prompt = random_prompt(20, seed=5)
    positions, visible = causal_layout(len(prompt))
    want, _ = reference_greedy(hf, prompt, positions, visible, MAX_TOKENS)
    stop_at = want[3]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                      stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want[:want.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    llm.check_integrity()


def test_a_hub_id_loads_from_the_local_hf_cache(checkpoint, tmp_path, monkeypatch):
    """`LLM("Org/Name")` finds the model in the local Hugging Face cache, as transformers does
    offline: the snapshot `refs/main` names, else the newest; an id the cache lacks is a clear
    error saying where it looked, and nothing is downloaded."""
    import os
    import shutil

    path = checkpoint("llama")
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(path, repo / "snapshots" / "abc123")
    os.makedirs(repo / "snapshots" / "old")  # not the revision refs/main names
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": random_prompt(9, seed=3)}
    want = LLM(path, kv_cache_tokens=256).generate(prompt, params, use_tqdm=False)[0]
    got = LLM("acme/tiny-llama", kv_cache_tokens=256).generate(prompt, params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"models--acme--other.*never downloads"):
        LLM("acme/other", kv_cache_tokens=256)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    from ragkv.model.loader import hf_cache_snapshot

    assert hf_cache_snapshot("acme/tiny-llama") == str(repo / "snapshots" / "abc123")

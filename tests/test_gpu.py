"""GPU-only end-to-end checks (skipped without CUDA): the CUDA engine in bfloat16, with the
Triton kernels, fused ops and CUDA graphs, against the same engine in float32 with the torch
backend run eagerly. (The float32 Triton path is checked against the HF reference itself in
test_rag.py::test_rag_scenarios_on_the_triton_backend.)"""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt

from ragkv import LLM, RAGPrompt, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _prompts() -> list:
    system = random_prompt(20, seed=1)
    docs = [random_prompt(n, seed=10 + n) for n in (40, 75, 33, 130)]
    return [
        RAGPrompt(system, [docs[0], docs[1], docs[2]], random_prompt(9, seed=2)),
        RAGPrompt(system, [docs[2], docs[3]], random_prompt(5, seed=3)),
        {"prompt_token_ids": random_prompt(300, seed=4)},
        RAGPrompt(system, [docs[1], docs[0], docs[3]], random_prompt(12, seed=5)),
    ]


BF16_LOGPROB_TOL = 0.05


def _assert_first_token_close(want, got) -> None:
    """The first token's distribution the same to bf16 accuracy: every token of the float32
    top 5 that is clearly in it (more than twice the tolerance above its 5th logprob) is in
    the bf16 top 5 too, at least 3 of the 5 are shared, every shared token's logprob is
    within BF16_LOGPROB_TOL; and six tokens generated each."""
    for w, g in zip(want, got, strict=True):
        w_lp, g_lp = w.outputs[0].logprobs[0], g.outputs[0].logprobs[0]
        cut = sorted(lp.logprob for lp in w_lp.values())[-5]  # the 5th best
        for tid, lp in w_lp.items():
            if lp.logprob > cut + 2 * BF16_LOGPROB_TOL:
                assert tid in g_lp, (tid, lp, g_lp)
        shared = set(w_lp) & set(g_lp)
        assert len(shared) >= 3, (w_lp, g_lp)
        for tid in shared:
            assert abs(g_lp[tid].logprob - w_lp[tid].logprob) < BF16_LOGPROB_TOL, (
                tid, w_lp[tid], g_lp[tid])
        assert len(g.outputs[0].token_ids) == 6


def test_bf16_graphs_and_fused_kernels_agree_with_float32(checkpoint):
    path = checkpoint("llama")
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)
    ref = LLM(path, device="cuda", dtype="float32", attention_backend="torch",
              enforce_eager=True, kv_cache_tokens=4096)
    fast = LLM(path, device="cuda", dtype="bfloat16", kv_cache_tokens=4096)
    assert fast.engine.runner.graphs is not None
    prompts = _prompts()
    want = ref.generate(prompts, params, use_tqdm=False)
    for _ in range(2):  # cold, then every chunk and prefix warm
        got = fast.generate(prompts, params, use_tqdm=False)
        fast.check_integrity()
        _assert_first_token_close(want, got)


def test_graph_replay_equals_eager_decode(checkpoint):
    """The same engine with and without CUDA graphs: identical greedy tokens. float32, since
    the graph splits a sequence's KV for its padded batch size, eager decode for the batch it
    has: the same attention, summed in another order."""
    path = checkpoint("qwen2")
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    _assert_graphs_equal_eager(path, _prompts() * 3, params)  # 12: a padded batch size (16)


def _assert_graphs_equal_eager(path: str, prompts: list, params: SamplingParams) -> None:
    """The same float32 engine with and without CUDA graphs: identical greedy tokens."""
    outs = []
    for eager in (True, False):
        llm = LLM(path, device="cuda", dtype="float32", enforce_eager=eager,
                  kv_cache_tokens=8192)
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        llm.check_integrity()
    for a, b in zip(*outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def _layout_prompts(recompute_ratio: float) -> list:
    """Re-positioned chunks (sequential, standalone) and selective recompute, with a plain
    prompt in the same batch."""
    system = random_prompt(20, seed=1)
    docs = [random_prompt(n, seed=10 + n) for n in (40, 75, 33, 130)]
    return [
        RAGPrompt(system, [docs[0], docs[1], docs[2]], random_prompt(9, seed=2),
                  position_strategy="sequential"),
        RAGPrompt(system, [docs[2], docs[3]], random_prompt(5, seed=3),
                  position_strategy="sequential", chunk_attention="standalone"),
        RAGPrompt(system, [docs[1], docs[0], docs[3]], random_prompt(12, seed=5),
                  position_strategy="sequential", recompute="blend",
                  recompute_ratio=recompute_ratio),
        {"prompt_token_ids": random_prompt(300, seed=4)},
    ]


def test_re_positioned_and_recomputed_requests_in_bf16_graphs(checkpoint):
    """Keys turned in the kernels' loads, queries at given entries, the turning decode
    graphs, bf16: the first token's distribution as the float32 torch engine run eagerly
    (recompute at r = 1, whose choice does not depend on the probe's precision)."""
    path = checkpoint("llama")
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)
    ref = LLM(path, device="cuda", dtype="float32", attention_backend="torch",
              enforce_eager=True, kv_cache_tokens=4096)
    fast = LLM(path, device="cuda", dtype="bfloat16", kv_cache_tokens=4096)
    prompts = _layout_prompts(1.0)
    want = ref.generate(prompts, params, use_tqdm=False)
    for _ in range(2):  # cold, then warm
        got = fast.generate(prompts, params, use_tqdm=False)
        fast.check_integrity()
        _assert_first_token_close(want, got)


def test_turning_graphs_equal_eager_decode(checkpoint):
    """Decode steps with re-positioned rows through the turning CUDA graphs, and partial
    recompute, against the same engine without graphs: identical greedy tokens (float32)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    _assert_graphs_equal_eager(checkpoint("qwen2"), _layout_prompts(0.3) * 3, params)


def test_chunk_store_on_cuda(checkpoint, tmp_path):
    """The chunk store on CUDA: device-to-host copies are asynchronous (pinned memory, an event
    per record), chunks demoted to the host tier and read back from disk by a second engine,
    and sleep/wake, all give the tokens of the same engine without a store."""
    path = checkpoint("llama")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kwargs = dict(device="cuda", dtype="float32", kv_cache_tokens=4096)
    prompts = _prompts()
    want = [o.outputs[0].token_ids
            for o in LLM(path, **kwargs).generate(prompts, params, use_tqdm=False)]
    disk = f"disk:{tmp_path}:1GiB"
    # A chunk region smaller than the documents, requests one at a time (a running request
    # pins its chunks): evictions demote chunks to the host tier, read back as hits.
    first = LLM(path, **kwargs, chunk_cache_tokens=200, chunk_store=f"host:256MiB,{disk}")
    for _ in range(2):
        got = [first.generate(p, params, use_tqdm=False)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in got] == want
        first.check_integrity()
    stats = first.get_chunk_cache_stats()
    assert stats.evictions > 0 and stats.store_hits > 0
    first.engine.flush_chunk_store()
    first.sleep()
    first.wake_up()
    got = first.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    first.check_integrity()
    first.engine.close()

    second = LLM(path, **kwargs, chunk_store=disk)
    got = second.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert second.get_chunk_cache_stats().store_hits == 4  # every distinct document, from disk
    second.check_integrity()
    second.engine.close()


def test_graphs_write_only_memory_they_own(checkpoint):
    """A captured graph keeps no reference to what it writes: every buffer it writes must stay
    owned by the engine, or the caching allocator hands it to a later tensor that each replay
    then overwrites. Tensors of many sizes allocated after start-up keep their values through
    decode graphs (batch 1 and several) and extend graphs."""
    path = checkpoint("llama")
    llm = LLM(path, device="cuda", dtype="float32", kv_cache_tokens=4096)
    sentinels = [torch.full((n,), 7.0, device="cuda") for n in (16, 128, 512, 2048, 16384, 131072)
                 for _ in range(50)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate(_prompts(), params, use_tqdm=False)
    llm.generate(_prompts()[0], params, use_tqdm=False)
    torch.cuda.synchronize()
    assert all(bool((t == 7.0).all()) for t in sentinels)
    llm.check_integrity()


def test_penalties_on_cuda_equal_cpu_and_never_sync():
    """apply_penalties on the GPU: the CPU's result, with no host sync (sync debug mode
    raises on one)."""
    from collections import Counter

    from ragkv.sampling.penalties import TokenHistory, apply_penalties

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen) * 4
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5,
                             presence_penalty=-0.2, logit_bias={3: 2.0}), SamplingParams(),
              SamplingParams(presence_penalty=1.0)] * 2
    outputs = [torch.randint(1000, (n,), generator=gen).tolist() for n in (50, 0, 9) * 2]
    prompts = [torch.randint(1000, (n,), generator=gen) for n in (300, 1, 40) * 2]
    counts = [Counter(o) for o in outputs]
    want = apply_penalties(logits, params, [TokenHistory(c, p) for c, p in
                                            zip(counts, prompts, strict=True)])
    history = [TokenHistory(c, p.cuda()) for c, p in zip(counts, prompts, strict=True)]
    cuda_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = apply_penalties(cuda_logits, params, history)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-5)


def test_sampler_waits_for_the_device_once():
    """A step's sampling (greedy, sampled with truncations, penalties, logprobs) on CUDA:
    the tokens of the CPU's run, and one wait for the device that torch reports, the final
    transfer (a driver stall on a pageable copy would not be reported: the copies go through
    pinned memory, host_ints.to_device)."""
    import warnings
    from collections import Counter

    from ragkv.sampling.penalties import TokenHistory
    from ragkv.sampling.sampler import sample

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3000, generator=gen) * 3
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.01, seed=5),
              SamplingParams(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.5,
                             logit_bias={7: 1.0}, min_tokens=2),
              SamplingParams(temperature=0.7, frequency_penalty=0.3, seed=9, logprobs=1)]
    prompt = torch.randint(3000, (200,), generator=gen)
    counts = [Counter(torch.randint(3000, (n,), generator=gen).tolist()) for n in (0, 3, 1, 40)]
    history = [TokenHistory(c, prompt, (0,)) for c in counts]
    want = sample(logits, params, [1, 2, 3, 4], [0, 3, 1, 40], history)
    cuda_history = [TokenHistory(c, prompt.cuda(), (0,)) for c in counts]
    cuda_logits = logits.cuda()
    sample(cuda_logits, params, [1, 2, 3, 4], [0, 3, 1, 40], cuda_history)  # pinned blocks
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            got = sample(cuda_logits, params, [1, 2, 3, 4], [0, 3, 1, 40], cuda_history)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert got.token_ids == want.token_ids

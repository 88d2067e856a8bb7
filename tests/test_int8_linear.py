"""GGUF integer weights held as int8 groups (`quantization="gguf"` on CUDA,
model/int8_linear.py and model/backends/triton_quant.py).

Per type: the int8 rows hold exactly the file's values. Per layer: the fused kernel (small
steps, GEMV and tl.dot launches) and the dequantized path (large steps) multiply by the very
weights the dense layer holds (each value rounded once from float32 to the activations'
dtype), so they match the float32 product of those weights up to float32 accumulation order
and the output's rounding. The loader builds these layers from a GGUF file with the values of
the dense load. On CPU the kernels run through Triton's interpreter (float32, float16); on a
GPU in bfloat16 too, and end to end against the dequantized engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gguf import random_raw

from ragkv.model.backends import triton_quant
from ragkv.model.gguf.quants import SUPPORTED_TENSOR_TYPES, dequantize, int8_rows, packed_planes

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")

from ragkv.model.int8_linear import KERNEL_MAX_ROWS, Int8Linear, Int8Rows  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# The interpreter has no bfloat16 arithmetic; a GPU has.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
PACKABLE = [t.name for i, t in SUPPORTED_TENSOR_TYPES.items() if packed_planes(i)]


@pytest.mark.parametrize("name", PACKABLE)
def test_int8_rows_hold_the_files_values(name):
    type_id = next(i for i, t in SUPPORTED_TENSOR_TYPES.items() if t.name == name)
    raw = torch.from_numpy(random_raw(name, 64, 512, np.random.default_rng(5)).reshape(-1))
    rows = int8_rows(raw, type_id, (64, 512))
    assert rows.q.dtype == torch.int8 and rows.scale.shape == (64, 16)
    torch.testing.assert_close(rows.dequantize(), dequantize(raw, type_id, (64, 512)),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="needs"):
        int8_rows(raw[:-1], type_id, (64, 512))


def random_rows(n: int, k: int, offset: bool, seed: int) -> Int8Rows:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).half().float()
    zero = ((torch.randn(n, k // 32, generator=gen) * 0.02).half().float() if offset
            else torch.zeros(n, k // 32))
    return Int8Rows.of_ints(q, scale, zero)


def build(rows: Int8Rows, bias: torch.Tensor | None = None, split: int = 1) -> Int8Linear:
    n, k = rows.q.shape
    layer = Int8Linear(k, n, bias, DEVICE)
    step = n // split
    for start in range(0, n, step):  # loaded in row ranges, as fused destinations are
        part = slice(start, start + step)
        layer.load(start, Int8Rows(rows.q[part], rows.scale[part], rows.offset[part]))
    layer.pack()
    return layer


def check_product(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                  bias: torch.Tensor | None = None) -> None:
    """out = x @ w.T (+ bias) up to float32 accumulation order and the output's rounding."""
    want = x.float() @ w.float().t() + (0 if bias is None else bias.float())
    eps = torch.finfo(out.dtype).eps
    bound = eps * want.abs() + 1e-5 * (x.float().abs() @ w.float().abs().t()) + 1e-6
    assert out.shape == want.shape and out.dtype == x.dtype
    err = (out.float() - want).abs()
    assert bool((err <= bound).all()), float(err.max())


CONFIGS = [None, triton_quant.MatmulConfig(1, 8, 64),
           triton_quant.MatmulConfig(4, 4, 32, fast_cvt=False),
           triton_quant.MatmulConfig(16, 32, 64, dot=True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("config", CONFIGS)
def test_kernel_multiplies_by_the_dense_weights(dtype, offset, m, config):
    rows = random_rows(72, 192, offset, seed=m)
    q = rows.q.to(DEVICE)
    scale = rows.scale.half().to(DEVICE)
    off = rows.offset.half().to(DEVICE) if offset else None
    w = rows.dequantize().to(DEVICE, dtype)  # the dense layer's weights
    x = torch.randn(m, 192, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    check_product(triton_quant.int8_matmul(x, q, scale, off, config), x, w)
    assert torch.equal(triton_quant.int8_dequantize(q, scale, off, dtype), w)


def test_kernel_refuses_a_block_that_does_not_divide_k():
    rows = random_rows(16, 96, False, seed=1)
    with pytest.raises(ValueError, match="must divide K=96"):
        triton_quant.int8_matmul(torch.randn(1, 96, device=DEVICE), rows.q.to(DEVICE),
                                 rows.scale.to(DEVICE), None, triton_quant.MatmulConfig(1, 4, 64))


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("m", [1, 5, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 3])
def test_layer_matches_the_dense_layer(offset, m):
    rows = random_rows(96, 128, offset, seed=11)
    bias = torch.randn(96, device=DEVICE)
    layer = build(rows, bias, split=3)
    # Float16 scales where every one is exactly a float16 (these are), else float32; no
    # offset where the file has none (Q8_0).
    assert layer.scale.dtype == torch.float16
    assert (layer.offset is None) == (not offset)
    w = rows.dequantize().to(DEVICE)
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    out = layer.forward(x)
    check_product(out, x, w, bias)
    ids = torch.tensor([0, 7, 95], device=DEVICE)
    assert torch.equal(layer.rows(ids, torch.float32), w[ids])
    assert layer.weight_bytes() == 96 * 128 + 96 * 4 * 2 * (2 if offset else 1)


@pytest.mark.parametrize("m", [2, KERNEL_MAX_ROWS + 1])
def test_bias_is_added_before_the_one_rounding(m):
    """In half precision the bias joins the float32 sum before the output is rounded, on the
    kernel and the dense path alike (as the dense layer's GEMM adds it)."""
    rows = random_rows(64, 96, True, seed=5)
    bias = torch.randn(64, device=DEVICE).half()
    layer = build(rows, bias)
    w = rows.dequantize().to(DEVICE, torch.float16)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.float16)
    check_product(layer.forward(x), x, w, bias)


def test_a_step_without_rows():
    """A step whose logits rows are elsewhere hands the head no rows."""
    layer = build(random_rows(32, 64, False, seed=8))
    out = layer.forward(torch.empty(0, 64, device=DEVICE))
    assert out.shape == (0, 32)


def test_scales_that_are_not_float16_stay_float32():
    rows = random_rows(32, 64, True, seed=2)
    rows = Int8Rows(rows.q, rows.scale * (1 + 2 ** -14), rows.offset)  # off the float16 grid
    layer = build(rows)
    assert layer.scale.dtype == torch.float32 and layer.offset.dtype == torch.float32
    x = torch.randn(2, 64, device=DEVICE)
    check_product(layer.forward(x), x, rows.dequantize().to(DEVICE))


def test_layer_refuses_misuse():
    with pytest.raises(ValueError, match="whole groups of 32"):
        Int8Linear(48, 32, None, DEVICE)
    layer = Int8Linear(64, 32, None, DEVICE)
    with pytest.raises(RuntimeError, match="before pack"):
        layer.forward(torch.randn(1, 64, device=DEVICE))
    rows = random_rows(32, 64, False, seed=3)
    with pytest.raises(ValueError, match="do not fit"):
        layer.load(16, rows)
    layer.load(0, Int8Rows(rows.q[:16], rows.scale[:16], rows.offset[:16]))
    with pytest.raises(ValueError, match="before all of its rows"):
        layer.pack()
    layer.load(16, Int8Rows(rows.q[16:], rows.scale[16:], rows.offset[16:]))
    layer.pack()
    with pytest.raises(RuntimeError, match="already packed"):
        layer.load(0, rows)


def test_q8_0_quantization_rounds_each_value_to_its_group():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    w[3, :32] = 0  # an all-zero group: scale 0, values 0
    w[5, :32] = 0
    w[5, :5] = torch.tensor([127.0, 0.5, -0.5, 2.5, -1.5])  # d = 1: ties
    layer = Int8Linear.quantize_q8_0(w)
    # GGML's roundf: halves away from zero.
    assert layer.q[5, :5].tolist() == [127, 1, -1, 3, -2]
    assert layer.q.dtype == torch.int8 and layer.scale.dtype == torch.float16
    assert layer.offset is None
    back = layer.dequantize(torch.float32)
    d = layer.scale.float().repeat_interleave(32, dim=1)
    # Half a step, plus q (at most 127) times the float16 rounding of d (GGML rounds against
    # the float32 d and stores d as float16).
    assert bool(((back - w).abs() <= d * (0.5 + 127 * 2.0 ** -11) + 1e-6).all())
    assert bool((back[3, :32] == 0).all())


@pytest.mark.parametrize("family", ["llama", "mistral"])  # Q8_0, Q5_1 weights
def test_loader_holds_the_files_values(family, ckpt_root, checkpoint):
    """The loader's int8 layers (forced on CPU: the interpreter) hold what the dense load
    holds, fused q/k/v and gate/up ranges and llama.cpp's q/k row order included."""
    from test_gguf import _gguf_case

    from ragkv.model.layers import Linear
    from ragkv.model.llama import CausalLM
    from ragkv.model.loader import inspect_checkpoint, load_weights

    path, _ = _gguf_case(ckpt_root, checkpoint(family), family)
    ckpt = inspect_checkpoint(path)
    mc = ckpt.model_config

    def model() -> CausalLM:
        return CausalLM(mc, 64, torch.float32, DEVICE).eval()

    dense, packed = model(), model()
    load_weights(dense, ckpt)
    result = load_weights(packed, ckpt, packed=True, int8=True)
    assert result.int8_layers > 0 and result.int4_layers == 0
    assert result.id_suffix == "+int8"
    assert "held as int8 groups" in result.describe()
    pairs = [(p, m) for p, m in packed.named_modules()
             if isinstance(m, Int8Linear) and p.startswith("layers.")]
    assert len(pairs) == 4 * mc.num_layers  # qkv, o, gate_up, down
    for path_, layer in pairs:
        want = dense.get_submodule(path_)
        assert isinstance(want, Linear)
        assert torch.equal(layer.dequantize(torch.float32), want.weight)
    ids = torch.tensor([0, 5, mc.vocab_size - 1], device=DEVICE)
    assert torch.equal(packed.embed(ids), dense.embed(ids))
    head = dense.embed_tokens if mc.tie_word_embeddings else dense.lm_head
    assert torch.equal(packed.packed_head.dequantize(torch.float32), head)
    assert packed.route is None  # int8 layers route by size alone


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gguf_weights_held_int8_on_the_gpu(ckpt_root, checkpoint):
    from test_gguf import _gguf_case

    from ragkv import LLM, SamplingParams

    path, _ = _gguf_case(ckpt_root, checkpoint("llama"), "llama")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 300 + 7 * i, 41, 99]} for i in range(6)]
    packed = LLM(path, quantization="gguf", dtype="bfloat16", device="cuda",
                 position_strategy="shared")
    assert packed.engine.weights.int8_layers > 0
    out_packed = packed.generate(prompts, params, use_tqdm=False)
    packed.check_integrity()
    del packed
    dense = LLM(path, quantization="none", dtype="bfloat16", device="cuda",
                position_strategy="shared")
    out_dense = dense.generate(prompts, params, use_tqdm=False)
    # The same bf16 weights, other kernels: greedy tokens agree but where two logits tie
    # within bf16 rounding; most continuations are identical.
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(out_packed, out_dense, strict=True))
    assert same >= 4, same

"""Q8_0 weights on the GPU: ragkv's int8 layers (model/int8_linear.py) against bf16 and the
int8 weight floor, measured in one run.

Two parts:
- `kernels`: every linear layer shape of the 8B model (qkv 6144 x 4096, o 4096 x 4096,
  gate_up 28672 x 4096, down 4096 x 14336, LM head 128256 x 4096) at M rows: the fused Triton
  kernel, dequantize + dense GEMM and the bf16 GEMM, each against the layer's int8 floor (its
  bytes at the measured copy bandwidth); a sweep of launch shapes for 1..64 rows; the
  numerics (largest error against the float32 product of the same bf16 weights);
- `engine`: the 8B shape (random weights, HF checkpoint through ragkv's loader, as
  bench_gpu.py) decoding at batch 1, 8 and 32 and prefilling 4,288 tokens in bf16, then the same
  engine with every linear layer, the embedding and the LM head quantized to Q8_0 in place
  (`Int8Linear.quantize_q8_0`, GGML's Q8_0 rule: what a Q8_0 GGUF of these weights holds) and
  its CUDA graphs captured again.

    python benchmarks/bench_gpu_quant.py --json q8.json            # both parts, on CUDA
    python benchmarks/bench_gpu_quant.py --parts kernels --quick   # the layer rows only
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import add_model_args, build_checkpoint, ids, measure_floors, timed  # noqa: E402

SHAPES = {  # name: (N, K) of the 8B model's layers
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
    "down": (4096, 14336), "head": (128256, 4096),
}
PER_MODEL = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "head": 1}
DTYPE = torch.bfloat16  # --dtype
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 4096)


def q8_weights(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    scale = (torch.rand(n, k // 32, device=device) * 1e-3 + 1e-4).half()
    return q, scale


def dequant_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from ragkv.model.backends import triton_quant as tq

    return torch.nn.functional.linear(x, tq.int8_dequantize(q, scale, None, x.dtype))


def bench(fn) -> float:
    """Seconds per call: triton's do_bench (L2 flushed between calls, median); on CPU (a smoke
    test through Triton's interpreter) one timed call."""
    if not torch.cuda.is_available():
        fn()
        return timed(fn, "cpu")
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=25, return_mode="median") / 1e3


def kernels(args, floors: dict, fig: dict, say) -> None:
    from ragkv.model.backends import triton_quant as tq

    device = args.device
    bandwidth = floors["bandwidth"]
    fig["kernels"] = rows_fig = {}
    totals = {m: {"kernel": 0.0, "dequant": 0.0, "bf16": 0.0, "floor": 0.0} for m in ROWS}
    for name, (n, k) in SHAPES.items():
        q, scale = q8_weights(n, k, device)
        w = tq.int8_dequantize(q, scale, None, DTYPE)
        floor_bytes = q.numel() + scale.numel() * 2
        # Numerics: the kernel's product against the float32 product of the same bf16 W.
        for m in (1, 8, 64):
            x = torch.randn(m, k, device=device, dtype=DTYPE)
            ref = x.float() @ w.float().t()
            err = (tq.int8_matmul(x, q, scale, None).float() - ref).abs().max().item()
            say(f"{name} M={m}: max |kernel - float32| {err:.3g} (|ref| max "
                f"{ref.abs().max().item():.3g})")
        for m in ROWS:
            if m > 512 and name == "head":
                continue
            x = torch.randn(m, k, device=device, dtype=DTYPE)
            row = {"floor_int8_s": (floor_bytes + 2 * m * (k + n)) / bandwidth}
            if m <= 512:
                row["kernel_s"] = bench(functools.partial(tq.int8_matmul, x, q, scale, None))
            row["dequant_s"] = bench(functools.partial(dequant_linear, x, q, scale))
            row["bf16_s"] = bench(functools.partial(torch.nn.functional.linear, x, w))
            rows_fig[f"{name}/{m}"] = row
            say(f"{name:8s} M={m:5d}: kernel {row.get('kernel_s', float('nan')) * 1e6:8.1f} us"
                f"  dequant+gemm {row['dequant_s'] * 1e6:8.1f} us  bf16 "
                f"{row['bf16_s'] * 1e6:8.1f} us  int8 floor {row['floor_int8_s'] * 1e6:7.1f} us"
                f"  kernel/floor {row.get('kernel_s', float('nan')) / row['floor_int8_s']:.2f}")
            if name != "head" or m <= 512:
                t = totals[m]
                t["kernel"] += PER_MODEL[name] * row.get("kernel_s", float("nan"))
                t["dequant"] += PER_MODEL[name] * row["dequant_s"]
                t["bf16"] += PER_MODEL[name] * row["bf16_s"]
                t["floor"] += PER_MODEL[name] * row["floor_int8_s"]
        del w
        if args.sweep and name in ("o", "gate_up", "down"):
            sweep(name, q, scale, k, device, floor_bytes / bandwidth, fig, say)
        del q, scale
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    fig["model_matmuls"] = totals
    for m, t in totals.items():
        if m <= 512:
            say(f"8B model's matmuls, M={m}: kernel {t['kernel'] * 1e3:.2f} ms, dequant+gemm "
                f"{t['dequant'] * 1e3:.2f} ms, bf16 {t['bf16'] * 1e3:.2f} ms, int8 floor "
                f"{t['floor'] * 1e3:.2f} ms (kernel/floor {t['kernel'] / t['floor']:.2f})")
    if 4096 not in ROWS:
        return
    # Prefill-sized steps: the dot kernel with large tiles against dequantize + GEMM.
    n, k = SHAPES["gate_up"]
    q, scale = q8_weights(n, k, device)
    x = torch.randn(4096, k, device=device, dtype=DTYPE)
    for cfg in (tq.MatmulConfig(128, 128, 64, 8, 3, True),
                tq.MatmulConfig(128, 256, 64, 8, 3, True),
                tq.MatmulConfig(64, 128, 64, 4, 4, True)):
        try:
            t = bench(functools.partial(tq.int8_matmul, x, q, scale, None, cfg))
            say(f"gate_up M=4096 dot kernel {cfg}: {t * 1e6:.1f} us")
        except Exception as e:  # noqa: BLE001 - a tile that does not fit is a data point
            say(f"gate_up M=4096 dot kernel {cfg}: failed ({type(e).__name__}: {e})")


def sweep(name: str, q, scale, k: int, device: str, floor_s: float, fig: dict, say) -> None:
    """Launch shapes for 1, 8 and 32 rows: the four fastest and the default's time."""
    from ragkv.model.backends import triton_quant as tq

    for m in (1, 8, 32):
        x = torch.randn(m, k, device=device, dtype=DTYPE)
        if m == 1:
            configs = [tq.MatmulConfig(1, bn, bk, w, 3, False, fast, rnd) for bn in (4, 8)
                       for bk in (512, 1024) for w in (4, 8) for fast in (True, False)
                       for rnd in (True, False) if k % bk == 0]
        else:
            configs = [tq.MatmulConfig(bm, bn, 512, 4, 3) for bm in (2, 4, 8, 16)
                       for bn in (2, 4, 8) if bm <= m]
        results = []
        for cfg in configs:
            try:
                t = bench(functools.partial(tq.int8_matmul, x, q, scale, None, cfg))
                results.append((t, cfg))
            except Exception:  # noqa: BLE001 - out of shared memory and the like
                continue
        results.sort(key=lambda r: r[0])
        default = bench(functools.partial(tq.int8_matmul, x, q, scale, None))
        best = ", ".join(f"{t * 1e6:.1f} us {c.block_m}/{c.block_n}/{c.block_k}/w{c.num_warps}"
                         f"{'/fast' if c.fast_cvt else ''}{'/round' if c.round_w else ''}"
                         for t, c in results[:4])
        fig.setdefault("sweep", {})[f"{name}/{m}"] = {
            "default_s": default, "all": [(t, repr(c)) for t, c in results]}
        say(f"sweep {name} M={m}: default {default * 1e6:.1f} us ({default / floor_s:.2f}x "
            f"floor); best {best}")


def dot(args, floors: dict, fig: dict, say) -> None:
    """The tl.dot kernel's tiles for 8 to 64 rows, against the GEMV default and bf16."""
    from ragkv.model.backends import triton_quant as tq

    for name in ("o", "gate_up", "down"):
        n, k = SHAPES[name]
        q, scale = q8_weights(n, k, args.device)
        w = tq.int8_dequantize(q, scale, None, DTYPE)
        for m in (8, 16, 32, 64):
            x = torch.randn(m, k, device=args.device, dtype=DTYPE)
            bm = max(16, m)
            results = []
            for bn in (16, 32, 64):
                for bk in (128, 256):
                    cfg = tq.MatmulConfig(bm, bn, bk, 4, 3, True)
                    try:
                        t = bench(functools.partial(tq.int8_matmul, x, q, scale, None, cfg))
                        results.append((t, cfg))
                    except Exception as e:  # noqa: BLE001 - a tile that does not fit
                        say(f"dot {name} M={m} {cfg}: failed ({type(e).__name__}: {e})")
            results.sort(key=lambda r: r[0])
            if not results:
                continue
            ref = x.float() @ w.float().t()
            err = (tq.int8_matmul(x, q, scale, None, results[0][1]).float() - ref).abs().max()
            bf16 = bench(functools.partial(torch.nn.functional.linear, x, w))
            fig.setdefault("dot", {})[f"{name}/{m}"] = [(t, repr(c)) for t, c in results]
            say(f"dot {name} M={m}: best " + ", ".join(
                f"{t * 1e6:.1f} us {c.block_m}/{c.block_n}/{c.block_k}" for t, c in results[:3])
                + f"; bf16 {bf16 * 1e6:.1f} us; max err {err.item():.3g}")
        del q, scale, w


def to_q8_0(llm) -> int:
    """Every linear layer, the embedding and the LM head of the engine's model held as Q8_0
    int8 groups; the CUDA graphs captured again. Returns the weights' bytes as held."""
    from ragkv.model.int8_linear import Int8Linear
    from ragkv.model.layers import Linear

    model = llm.engine.model
    for path, m in list(model.named_modules()):
        if isinstance(m, Linear):
            parent, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent), attr, Int8Linear.quantize_q8_0(m.weight, m.bias))
    head = model.lm_head
    embedding = Int8Linear.quantize_q8_0(model.embed_tokens)
    model.pack_embedding(embedding)
    if head is not None:
        model.pack_head(Int8Linear.quantize_q8_0(head))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        llm.engine.runner.capture_graphs()
    held = {id(m): m for m in model.modules() if isinstance(m, Int8Linear)}
    held[id(embedding)] = embedding
    return (sum(m.weight_bytes() for m in held.values())
            + sum(p.numel() * p.element_size() for p in model.parameters()))


def engine(args, floors: dict, fig: dict, say) -> None:
    from ragkv import LLM, SamplingParams

    device = args.device
    rng = random.Random(0)
    tmp = tempfile.mkdtemp(prefix="ragkv-bench-q8-")
    start = time.perf_counter()
    hf = build_checkpoint(args, tmp)
    params = sum(p.numel() for p in hf.parameters())
    embed = hf.model.embed_tokens.weight.numel()
    del hf
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    say(f"checkpoint in {time.perf_counter() - start:.1f} s; {params / 1e9:.2f} B params")
    start = time.perf_counter()
    llm = LLM(tmp, dtype=args.dtype, device=device, max_model_len=8192,
              kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30), max_num_seqs=32,
              max_num_batched_tokens=8192, position_strategy="shared")
    say(f"loaded in {time.perf_counter() - start:.1f} s")
    reps, new = (2, 16) if args.quick else (3, 64)
    prompt = ids(4288 if not args.quick else 1024, rng)
    short = [{"prompt_token_ids": ids(256, rng)} for _ in range(32)]

    def generate(prompts, max_tokens: int) -> float:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        return timed(lambda: llm.generate(prompts, sp, use_tqdm=False), device)

    def measure(label: str, streamed: float) -> dict:
        row = {}
        for batch in (1, 8, 32):
            prompts = short[:batch]
            generate(prompts, 2)
            t1 = statistics.median(generate(prompts, 1) for _ in range(reps))
            tn = statistics.median(generate(prompts, new) for _ in range(reps))
            row[f"decode_b{batch}_s"] = step = (tn - t1) / (new - 1)
            floor = streamed / floors["bandwidth"]
            say(f"{label}: decode batch {batch} {step * 1e3:.2f} ms/step (weights floor "
                f"{floor * 1e3:.2f} ms, {step / floor:.2f}x)")
        times = []
        for _ in range(reps + 1):
            llm.reset_prefix_cache()
            times.append(generate([{"prompt_token_ids": prompt}], 1))
        row["prefill_s"] = statistics.median(times[1:])
        say(f"{label}: prefill {len(prompt)} tokens {row['prefill_s'] * 1e3:.1f} ms")
        outs = llm.generate(short[:4], SamplingParams(max_tokens=24, temperature=0.0),
                            use_tqdm=False)
        row["tokens"] = [o.outputs[0].token_ids for o in outs]
        return row

    bf16 = measure("bf16", (params - embed) * 2)
    held = to_q8_0(llm)
    say(f"Q8_0: weights held {held / 1e9:.2f} GB")
    # The int8 floor: every weight's int8 value and float16 scale (1.0625 bytes), bar the
    # embedding table (one row read per token).
    q8 = measure("Q8_0", (params - embed) * 1.0625)
    same = sum(a == b for a, b in zip(bf16["tokens"], q8["tokens"], strict=True))
    say(f"Q8_0 against bf16: {same}/4 greedy continuations identical (24 tokens; random "
        "weights, other weights: a measure of drift, not of quality)")
    say(f"Q8_0 / bf16: decode batch 1 {q8['decode_b1_s'] / bf16['decode_b1_s']:.2f}x, batch 8 "
        f"{q8['decode_b8_s'] / bf16['decode_b8_s']:.2f}x, batch 32 "
        f"{q8['decode_b32_s'] / bf16['decode_b32_s']:.2f}x, prefill "
        f"{q8['prefill_s'] / bf16['prefill_s']:.2f}x")
    llm.check_integrity()
    fig["engine"] = {"bf16": bf16, "q8_0": q8, "held_bytes": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, kv_cache_gb=8.0)
    parser.add_argument("--parts", default="kernels,engine")
    parser.add_argument("--sweep", action="store_true", help="sweep launch shapes too")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--rows", default=None, help="M values of the layer rows (1,2,...)")
    parser.add_argument("--shapes", default=None, help="N:K,... instead of the 8B layers")
    args = parser.parse_args()
    global DTYPE, ROWS
    DTYPE = getattr(torch, args.dtype)
    if args.shapes:  # a smoke test's small layers
        SHAPES.clear()
        for i, nk in enumerate(args.shapes.split(",")):
            n, k = map(int, nk.split(":"))
            SHAPES[list(PER_MODEL)[i]] = (n, k)
        ROWS = (1, 8, 128)
    if args.rows:
        ROWS = tuple(int(m) for m in args.rows.split(","))
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    floors = measure_floors(args.device, DTYPE, args.quick)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    say(f"floors: copy {floors['bandwidth'] / 1e9:.0f} GB/s, matmul "
        f"{floors['flops'] / 1e12:.0f} TFLOP/s; {name}")
    fig: dict = {"floors": floors}
    for part in args.parts.split(","):
        try:
            {"kernels": kernels, "dot": dot, "engine": engine}[part](args, floors, fig, say)
        except Exception:  # noqa: BLE001 - report and go on to the next part
            traceback.print_exc()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(fig, f, indent=1, default=str)


if __name__ == "__main__":
    main()

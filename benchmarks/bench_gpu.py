"""ragkv on a GPU against HF transformers and the hardware floors, measured in one run.

Builds an 8B-shaped Llama with random weights on the GPU (hidden 4096, 32 layers, 32/8 heads,
intermediate 14336, vocab 128,256, llama3 RoPE; no download), writes it as an HF checkpoint and
loads it through ragkv's loader. Floors are measured on the same GPU in the same run: copy
bandwidth (a large device-to-device copy, bytes read + written) and bf16 matmul rate
(8192^3). RAG prompts take shared positions and no recompute (exact chunk reuse) unless a row
names another layout; the engine's own default, the quality mode, is not what is timed. Rows:
- prefill of a 4,288-token prompt (ragkv TTFT vs one HF forward; MFU against the measured peak);
- warm RAG TTFT: 128 + 8 x 512 + 64 tokens, every chunk cached (floor: one pass over the
  weights), and its cold TTFT; where its wall time goes (host before the step, the CUDA
  graph on the device, the wait for the token, the outputs); the question's attention kernel
  alone, with the GQA group's heads packed into its tiles and without (floor: one read of
  the K/V), then packed at other KV split counts and other tiles (data for tuning);
- decode ms/step at batch 1 and 32 after warm-up, T(128) - T(1) over 127 steps, and the first
  pass over lengths never seen before against a repeat;
- a mixed workload, 16 prompts of 300-2,000 tokens x 32 tokens, twice with fresh lengths
  (floor: the prefills' FLOPs at peak + 32 decode steps at the batch-16 floor);
- warm RAG TTFT with the chunks re-positioned (sequential layout, no recompute: keys turned in
  the kernels' loads) and with selective recompute (blend, 15%), against the shared layout;
- `recompute`: the same warm request in the quality modes against the full prefill of its flat
  prompt, each with its recomputed share and its probe's time: sequential alone, `query` at a
  fixed 10% and 15%, the engine's model-agnostic default (`query`, 0.1-0.5 holding 0.9 of the
  scores; random weights spread their attention, so it takes the cap) and `blend` 15%; a
  recompute step of at most 512 tokens runs the indexed extend graph, measured against the
  same engine with its extend graphs set aside (eager, as every recompute step ran before);
- decode at batch 32 over re-positioned chunks (sequential layout, no recompute, through CUDA
  graphs) against the same requests in the shared layout, and sampled decode (seeded,
  temperature, top-k, top-p) against greedy;
- how many attention kernel variants were compiled after start-up (0: the warm-up covered
  every shape and layout the run met);
- `ragkv bench`'s RAG workload (none / prefix / chunk) on this model, the chunk mode in the
  shared layout.

    python benchmarks/bench_gpu.py                      # the 8B shape, on CUDA
    python benchmarks/bench_gpu.py --layers 2 --hidden 256 --heads 4 --kv-heads 2 \\
        --intermediate 512 --vocab 4096 --device cpu --dtype float32 --quick   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def measure_floors(device: str, dtype: torch.dtype, quick: bool) -> dict:
    """Copy bandwidth (GB/s, read + write) and matmul rate (TFLOP/s) on this device."""
    if not device.startswith("cuda"):
        return {"bandwidth": 20e9, "flops": 1e12, "note": "CPU: nominal figures"}
    n = 1 << (28 if quick else 30)  # elements: 0.5 / 2 GB in bf16
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        times.append(timed(lambda: dst.copy_(src), device))
    bandwidth = 2 * src.numel() * src.element_size() / statistics.median(times[2:])
    src = dst = None  # free before the matmul
    size = 8192
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    times = [timed(lambda: a @ b, device) for _ in range(12)]
    flops = 2 * size ** 3 / statistics.median(times[2:])
    return {"bandwidth": bandwidth, "flops": flops}


def build_checkpoint(args, path: str):
    """A random-weight HF Llama of the requested shape on the device, saved to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ragkv.model.builtin import save_builtin_tokenizer

    config = LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=1, eos_token_id=2)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(path)
    save_builtin_tokenizer(path)
    return model


def compiled_variants() -> int | None:
    """Compiled variants of the Triton kernels so far (None: not readable here)."""
    try:
        from ragkv.model.backends import triton_kernels, triton_ops
    except ImportError:
        return None
    total = 0
    for module in (triton_kernels, triton_ops):
        for value in vars(module).values():
            caches = getattr(value, "device_caches", None)
            if isinstance(caches, dict):
                total += sum(len(entry[0]) for entry in caches.values())
    return total if torch.cuda.is_available() else None


ROWS = ("prefill", "rag", "recompute", "decode", "sampled", "mixed", "ragbench")


def profile_request(run, out_dir: str, label: str, calls: int = 50) -> None:
    """Host time per Python function (cProfile over `calls` calls of `run`, sorted by
    cumulative time: one warm request is ~3 ms, which pstats' millisecond columns would
    round away) and device time per kernel (torch.profiler) of one call of `run`, written
    to `out_dir`."""
    import cProfile
    import os
    import pstats
    from io import StringIO

    os.makedirs(out_dir, exist_ok=True)
    prof = cProfile.Profile()
    cuda = torch.cuda.is_available()
    prof.enable()
    for _ in range(calls):
        run()
        torch.cuda.synchronize() if cuda else None
    prof.disable()
    text = StringIO()
    text.write(f"cProfile: {calls} calls (divide the times by {calls} for one)\n")
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]
                 + ([ProfilerActivity.CUDA] if cuda else [])) as tp:
        run()
        torch.cuda.synchronize() if cuda else None
    events = tp.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    table = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                         row_limit=25)
    with open(os.path.join(out_dir, f"{label}.txt"), "w") as f:
        f.write(f"device time {device_us / 1e3:.2f} ms over {launches} kernels\n\n{table}\n")
        f.write(text.getvalue())
    print(f"[profile {label}] device time {device_us / 1e3:.2f} ms over {launches} kernels",
          flush=True)


def ttft_breakdown(llm, run, reps: int) -> dict:
    """Where the wall time of one request's first token goes, medians over `reps` calls of
    `run` (seconds): host work before the model's step (adding the request, scheduling),
    host work of the step up to the graph's launch (slot table, graph inputs), the graph's
    launch call, the graph on the device (CUDA events around it), the wait for the sampled
    token, and what follows (outputs). Without a graph (eager steps, or a CPU) the step is
    one figure, `execute`."""
    from ragkv.engine import output_processor

    engine, runner = llm.engine, llm.engine.runner
    cuda = torch.cuda.is_available() and runner.device.type == "cuda"
    marks: dict[str, float] = {}
    events: dict[str, torch.cuda.Event] = {}

    def mark(name: str) -> None:
        marks.setdefault(name, time.perf_counter())
        if cuda and name not in events:
            events[name] = torch.cuda.Event(enable_timing=True)
            events[name].record()

    def wrap(fn, before: str, after: str):
        def wrapped(*a, **k):
            mark(before)
            out = fn(*a, **k)
            mark(after)
            return out
        return wrapped

    # (owner, attribute, marks): sample returns after its device-to-host sync.
    hooks = ((engine.scheduler, "schedule", ("schedule", "scheduled")),
             (runner, "execute", ("execute", "executed")),
             (output_processor, "sample", ("sample", "sampled")),
             (torch.cuda.CUDAGraph, "replay", ("replay", "replayed")))
    # What each owner held itself (an instance usually holds none: its class's method).
    own = [(owner, name, vars(owner).get(name)) for owner, name, _ in hooks]
    parts: dict[str, list[float]] = {}
    try:
        for owner, name, (before, after) in hooks:
            setattr(owner, name, wrap(getattr(owner, name), before, after))
        for _ in range(reps):
            marks.clear()
            events.clear()
            start = time.perf_counter()
            run()
            end = time.perf_counter()
            m = marks
            got = {"wall": end - start, "before_step": m["execute"] - start,
                   "schedule": m["scheduled"] - m["schedule"], "after_token": end - m["sampled"]}
            if "replay" in m:
                got.update(execute_host=m["replay"] - m["execute"],
                           replay_call=m["replayed"] - m["replay"],
                           wait_for_token=m["sampled"] - m["replayed"])
                if cuda:
                    torch.cuda.synchronize()
                    got["graph_device"] = events["replay"].elapsed_time(events["replayed"]) / 1e3
                    # From the step's start to the graph: its host work and small copies.
                    got["device_before_graph"] = (events["execute"].elapsed_time(
                        events["replay"]) / 1e3)
            else:
                got.update(execute=m["executed"] - m["execute"],
                           wait_for_token=m["sampled"] - m["executed"])
            for name, value in got.items():
                parts.setdefault(name, []).append(value)
    finally:
        for owner, name, held in own:
            if held is not None:
                setattr(owner, name, held)
            elif name in vars(owner):  # ours: the inherited one shows again
                delattr(owner, name)
    return {name: statistics.median(values) for name, values in parts.items()}


def format_breakdown(parts: dict) -> str:
    order = ("wall", "before_step", "schedule", "execute_host", "replay_call", "execute",
             "graph_device", "device_before_graph", "wait_for_token", "after_token")
    return ", ".join(f"{name} {parts[name] * 1e3:.2f}" for name in order if name in parts) + " ms"


def question_attention(args, dtype: torch.dtype, floors: dict, n_q: int, n_kv: int,
                       reps: int, plan_len: int) -> dict:
    """The extend kernel alone at the warm question's shape (n_q queries over n_kv cached
    entries at scattered slots), one launch per layer captured in a CUDA graph (device time,
    no launch overhead), with the group's heads packed into the tiles and without; against
    one read of the K/V it attends to. Each layer's launch reads its own K/V, as a step does:
    one shared copy (17.6 MB at the 8B shape) would be served from the L2 cache after the
    first layer. Splits are the ones the engine's step plans, for KV lists up to `plan_len`
    (the extend graphs plan for max_model_len), then a sweep of other counts."""
    from ragkv.model.backends import triton_kernels as ta

    device = torch.device(args.device)
    head_dim = args.hidden // args.heads
    slots = 2 * n_kv + 1
    gen = torch.Generator(device=device).manual_seed(0)
    caches = [tuple(torch.randn(slots, args.kv_heads, head_dim, generator=gen, device=device,
                                dtype=dtype) for _ in range(2)) for _ in range(args.layers)]
    q = torch.randn(n_q, args.heads, head_dim, generator=gen, device=device, dtype=dtype)
    out = torch.empty_like(q)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    kv_index = torch.randperm(slots - 1, generator=gen, device=device)[:n_kv].int() + 1
    # Made before any capture: a copy from the host cannot be captured.
    kv_indptr, zero, q_lens, rows = i32([0, n_kv]), i32([0]), i32([n_q]), i32(list(range(n_q)))

    def graphed(pack: bool, splits: int) -> float:
        def step(k_cache, v_cache):
            ta.extend_attention(q, k_cache, v_cache, out, kv_index, kv_indptr, zero, q_lens,
                                n_q, head_dim ** -0.5, splits, zero, rows, pack=pack)

        step(*caches[0])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for k_cache, v_cache in caches:
                step(k_cache, v_cache)
        graph.replay()
        return statistics.median(timed(graph.replay, args.device) for _ in range(reps * 4))

    figures = {}
    for pack in (False, True):
        name = "packed" if pack else "unpacked"
        splits = ta.extend_splits([n_q], [plan_len], args.heads, args.kv_heads, device, pack)
        figures[name] = graphed(pack, splits)
        figures[f"splits_{name}"] = splits
    # The packed launch at other split counts: whether the planned count (about two waves
    # of programs) is the fastest, the merge included.
    figures["packed_by_splits"] = {
        s: graphed(True, s) for s in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
        if s <= ta.MAX_SPLITS and s * 128 <= n_kv}
    figures["floor"] = (args.layers * n_kv * 2 * args.kv_heads * head_dim * dtype.itemsize
                        / floors["bandwidth"])
    figures["packed_by_tiles"] = tile_sweep(graphed, args, device, dtype, n_q, n_kv)
    return figures


def tile_sweep(graphed, args, device: torch.device, dtype: torch.dtype, n_q: int,
               n_kv: int) -> dict:
    """The packed launch with other tiles (BLOCK_M, BLOCK_N, warps, pipeline stages), each
    at one wave of programs as the engine plans it: data for tuning the kernel, not a choice
    the engine makes. A tile that does not compile (shared memory) is reported, not fatal."""
    from ragkv.model.backends import triton_kernels as ta

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    group = args.heads // args.kv_heads
    block_d = max(16, 1 << (args.hidden // args.heads - 1).bit_length())
    engine_tiles = ta._extend_tiles(device, dtype, block_d)
    candidates = [engine_tiles, (128, 128, 8, 2), (128, 32, 8, 3), (128, 64, 4, 3),
                  (128, 64, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3), (64, 128, 4, 2)]
    results, own = {}, ta._extend_tiles
    for tiles in dict.fromkeys(candidates):
        name = "BLOCK_M {} BLOCK_N {} warps {} stages {}".format(*tiles)
        programs = -(-n_q * group // tiles[0]) * args.kv_heads
        splits = max(1, min(ta.MAX_SPLITS, sms // programs, n_kv // 512))
        ta._extend_tiles = lambda *a, tiles=tiles: tiles
        try:
            results[name] = {"ms": graphed(True, splits) * 1e3, "splits": splits,
                             "engine": tiles == engine_tiles}
        except Exception as e:  # noqa: BLE001 - a tile the GPU cannot run is a result
            results[name] = {"error": repr(e)[:300], "splits": splits}
        finally:
            ta._extend_tiles = own
    return results


def ids(n: int, rng: random.Random) -> list[int]:
    # The built-in tokenizer's vocabulary is 4,096: ids stay below it.
    return [rng.randrange(10, 4000) for _ in range(n)]


def text_of(tok, n: int, special: bool, rng: random.Random) -> str:
    """A text the tokenizer encodes to exactly `n` tokens (with its special tokens if
    `special`). Random ids decoded do not encode back to as many (64 come back as 65-81 with
    the built-in tokenizer), which would make the text rows' requests, and the graphs they
    run, other than the id rows'."""
    extra = len(tok.encode("", add_special_tokens=special))  # BOS, if the tokenizer adds it
    want = n - extra
    for _ in range(20):  # fresh ids when trimming and topping up does not settle
        pick = ids(want, rng)
        for _ in range(5):
            text = tok.decode(pick)
            got = tok.encode(text, add_special_tokens=False)
            if len(got) == want:
                return text
            pick = got[:want] if len(got) > want else got + ids(want - len(got), rng)
    raise RuntimeError(f"no text of {n} tokens found")


def add_model_args(parser: argparse.ArgumentParser, kv_cache_gb: float) -> None:
    """The device, dtype and model shape flags (the 8B shape by default), for the GPU
    benchmarks that build a random-weight checkpoint (`build_checkpoint`)."""
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--kv-cache-gb", type=float, default=kv_cache_gb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, kv_cache_gb=12.0)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-rag-bench", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller sizes")
    parser.add_argument("--mixed-passes", type=int, default=2,
                        help="passes of the mixed workload, each with fresh lengths (>= 2)")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="profile one warm RAG request (cProfile: host time per function; "
                             "torch.profiler: device time per kernel) into DIR")
    args = parser.parse_args()

    from ragkv import LLM, RAGPrompt, SamplingParams

    device, dtype = args.device, getattr(torch, args.dtype)
    rng = random.Random(0)
    reps = 2 if args.quick else 5
    prefill_len = 1024 if args.quick else 4288
    decode_new = 16 if args.quick else 128
    doc_len = 128 if args.quick else 512
    fig: dict = {"shape": vars(args)}
    say = lambda *a: print(*a, flush=True)  # noqa: E731

    floors = measure_floors(device, dtype, args.quick)
    fig["floors"] = floors
    say(f"floors: copy {floors['bandwidth'] / 1e9:.0f} GB/s, matmul "
        f"{floors['flops'] / 1e12:.0f} TFLOP/s")

    tmp = tempfile.mkdtemp(prefix="ragkv-bench-gpu-")
    start = time.perf_counter()
    hf = build_checkpoint(args, tmp)
    fig["checkpoint_s"] = time.perf_counter() - start
    params_total = sum(p.numel() for p in hf.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    embed = hf.model.embed_tokens.weight
    streamed = weight_bytes - embed.numel() * embed.element_size()  # one embedding row read
    flop_params = params_total - embed.numel()
    head_dim = args.hidden // args.heads
    kv_bytes_per_token = 2 * args.layers * args.kv_heads * head_dim * dtype.itemsize
    say(f"checkpoint written in {fig['checkpoint_s']:.1f} s; {params_total / 1e9:.2f} B params, "
        f"{weight_bytes / 1e9:.2f} GB")
    if args.skip_hf:
        hf = None
        gc.collect()
        torch.cuda.empty_cache() if device.startswith("cuda") else None

    start = time.perf_counter()
    # Shared positions, no recompute: the RAG rows' default layout (exact chunk reuse), as
    # docs/benchmarks.md measured them; the engine's own default is the quality mode.
    llm = LLM(tmp, dtype=args.dtype, device=device, max_model_len=8192,
              kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30), max_num_seqs=64,
              max_num_batched_tokens=8192, attention_backend=args.attention_backend,
              enforce_eager=args.enforce_eager, position_strategy="shared")
    graphs = llm.engine.runner.graphs
    fig["load_s"] = time.perf_counter() - start
    variants_at_start = compiled_variants()
    swept_variants = 0  # compiled by the tile sweep for itself, not by the engine's steps
    extend_graphs = llm.engine.runner.extend_graphs
    fig["graph_capture_s"] = graphs.capture_seconds if graphs is not None else None
    fig["extend_graph_capture_s"] = (extend_graphs.capture_seconds
                                     if extend_graphs is not None else None)
    say(f"ragkv loaded in {fig['load_s']:.1f} s (CUDA graph capture: decode "
        f"{fig['graph_capture_s']} s, extend {fig['extend_graph_capture_s']} s; backend "
        f"{llm.engine.runner.backend.name})")

    def decode_floor(batch: int, context: int) -> float:
        return (streamed + batch * context * kv_bytes_per_token) / floors["bandwidth"]

    def prefill_flops(n: int) -> float:
        attn = 2 * 2 * args.layers * args.hidden * n * n / 2
        return 2 * (flop_params - args.vocab * args.hidden) * n + attn

    def generate(prompts, max_tokens: int, params=None) -> float:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        if params is not None:
            sp = [p.clone(max_tokens=max_tokens, ignore_eos=True) for p in params]
        return timed(lambda: llm.generate(prompts, sp, use_tqdm=False), device)

    def decode_step(prompts, params=None) -> float:
        """Seconds per decode step: (T(n) - T(1)) / (n - 1), medians."""
        generate(prompts, 2, params)
        t1 = statistics.median(generate(prompts, 1, params) for _ in range(reps))
        tn = statistics.median(generate(prompts, decode_new, params)
                               for _ in range(max(2, reps // 2)))
        return (tn - t1) / (decode_new - 1)

    rows = []
    want = set(args.rows.split(","))
    if want - set(ROWS):
        parser.error(f"--rows: unknown {sorted(want - set(ROWS))}")
    if args.mixed_passes < 2:
        parser.error("--mixed-passes: at least 2 (the row compares the first two)")

    if "prefill" in want:
        # Prefill.
        prompt = ids(prefill_len, rng)
        ragkv_t = []
        for _ in range(reps + 1):
            llm.reset_prefix_cache()
            ragkv_t.append(generate([{"prompt_token_ids": prompt}], 1))
        ragkv_prefill = statistics.median(ragkv_t[1:])
        hf_prefill = None
        if hf is not None:
            x = torch.tensor([prompt], device=device)
            with torch.inference_mode():
                hf_t = [timed(lambda: hf(x, logits_to_keep=1), device) for _ in range(reps + 1)]
            hf_prefill = statistics.median(hf_t[1:])
        floor = prefill_flops(prefill_len) / floors["flops"]
        fig["prefill"] = {"ragkv": ragkv_prefill, "hf": hf_prefill, "floor": floor,
                          "mfu": floor / ragkv_prefill}
        rows.append((f"prefill, {prefill_len}-token prompt", ragkv_prefill, hf_prefill, floor,
                     f"MFU {100 * floor / ragkv_prefill:.0f}%"))
        say(f"prefill: ragkv {ragkv_prefill * 1e3:.1f} ms, HF "
            f"{hf_prefill * 1e3 if hf_prefill else float('nan'):.1f} ms, "
            f"floor {floor * 1e3:.1f} ms")

    if "rag" in want:
        # Warm RAG TTFT.
        system = ids(128, rng)
        docs = [ids(doc_len, rng) for _ in range(8)]
        cold = generate([RAGPrompt(system, docs, ids(64, rng))], 1)

        def warm_ttft(system, docs, question, **layout) -> float:
            """Median TTFT of `reps` requests (after one more, not counted), each with the
            documents in a new order and a new question (`question()`)."""
            times = []
            for _ in range(reps + 1):
                order = docs[:]
                rng.shuffle(order)
                times.append(generate([RAGPrompt(system, order, question(), **layout)], 1))
            return statistics.median(times[1:])

        def new_question() -> list[int]:
            return ids(64, rng)

        warm = warm_ttft(system, docs, new_question)
        floor = decode_floor(1, 0)
        fig["rag_ttft"] = {"warm": warm, "cold": cold, "floor": floor}
        rows.append((f"warm RAG TTFT, 128 + 8x{doc_len} + 64, all cached (cold "
                     f"{cold * 1e3:.1f} ms)", warm, None, floor, ""))
        say(f"RAG TTFT: warm {warm * 1e3:.1f} ms, cold {cold * 1e3:.1f} ms")

        if llm.engine.runner.backend.name == "triton" and device.startswith("cuda"):
            n_kv = 128 + 8 * doc_len + 64
            # The splits the engine's question step runs with: its graphs plan for
            # max_model_len, an eager step for the list it has.
            graphs = llm.engine.runner.extend_graphs
            plan_len = graphs.max_model_len if graphs is not None else n_kv
            before = compiled_variants()
            kernel = question_attention(args, dtype, floors, 64, n_kv, reps, plan_len)
            swept_variants = compiled_variants() - before
            fig["question_attention"] = kernel
            rows.append((f"question's attention alone, {args.layers} layers x 64 over {n_kv}, "
                         "heads packed", kernel["packed"], None, kernel["floor"],
                         f"unpacked {kernel['unpacked'] * 1e3:.2f} ms (splits "
                         f"{kernel['splits_packed']} / {kernel['splits_unpacked']})"))
            say(f"question attention: packed {kernel['packed'] * 1e3:.2f} ms, unpacked "
                f"{kernel['unpacked'] * 1e3:.2f} ms, K/V read floor "
                f"{kernel['floor'] * 1e3:.2f} ms")
            by_splits = kernel["packed_by_splits"]
            best = min(by_splits, key=by_splits.get)
            say("question attention, packed, by KV splits: "
                + ", ".join(f"{s}: {t * 1e3:.2f}" for s, t in by_splits.items())
                + f" ms (fastest {best}; the engine's step uses {kernel['splits_packed']})")
            say("question attention, packed, by tiles: " + "; ".join(
                f"{name}: " + (f"{r['ms']:.2f} ms at {r['splits']} splits"
                               + (" (engine's)" if r["engine"] else "")
                               if "ms" in r else r["error"])
                for name, r in kernel["packed_by_tiles"].items()))

        def one_rag(**layout) -> None:
            order = docs[:]
            rng.shuffle(order)
            generate([RAGPrompt(system, order, ids(64, rng), **layout)], 1)

        # Where the warm request's wall time goes (host before the step, the graph on the
        # device, the wait for the token, the outputs).
        breakdown = ttft_breakdown(llm, one_rag, reps * 2)
        fig["rag_ttft_breakdown"] = breakdown
        say(f"RAG TTFT breakdown (warm, median of {reps * 2}): {format_breakdown(breakdown)}")
        if args.profile:
            profile_request(one_rag, args.profile, "rag_warm")
            profile_request(lambda: one_rag(position_strategy="sequential", recompute="blend",
                                            recompute_ratio=0.15), args.profile, "rag_blend")

        # The same warm request with the chunks re-positioned (exact: no recompute), and with
        # selective recompute.
        for name, layout in (("sequential", dict(position_strategy="sequential",
                                                 recompute="none")),
                             ("sequential + blend 15%", dict(position_strategy="sequential",
                                                             recompute="blend",
                                                             recompute_ratio=0.15))):
            t = warm_ttft(system, docs, new_question, **layout)
            fig[f"rag_ttft_{name}"] = t
            rows.append((f"warm RAG TTFT, {name}", t, None, floor,
                         f"{t / warm:.2f}x the shared layout"))
            say(f"RAG TTFT {name}: {t * 1e3:.1f} ms ({t / warm:.2f}x shared)")

        # The same request sent as text, as a server's clients send it: the system part and
        # the documents are tokenized on every request unless the tokenizer cache (on by
        # default) holds them. Off is measured on the same engine with its cache set aside.
        # Texts of the id rows' token counts (128 with BOS + 8 x 512 + 64), so the question
        # runs the same graph.
        tok = llm.get_tokenizer()
        system_text = text_of(tok, 128, True, rng)
        doc_texts = [text_of(tok, doc_len, False, rng) for _ in docs]

        def text_ttft() -> float:
            return warm_ttft(system_text, doc_texts, lambda: text_of(tok, 64, False, rng))

        text_cached = text_ttft()
        held, llm.engine.token_cache = llm.engine.token_cache, None
        try:
            text_uncached = text_ttft()
        finally:
            llm.engine.token_cache = held
        fig["rag_ttft_text"] = {"tokenizer_cache": text_cached, "no_cache": text_uncached}
        rows.append(("warm RAG TTFT, sent as text (tokenizer cache on)", text_cached, None,
                     floor, f"cache off {text_uncached * 1e3:.1f} ms"))
        say(f"RAG TTFT as text: tokenizer cache on {text_cached * 1e3:.1f} ms, off "
            f"{text_uncached * 1e3:.1f} ms")

    if "recompute" in want:
        # The quality modes on one warm request (128 + 8 x doc_len + 64, every chunk cached):
        # TTFT, recomputed share and probe time, against the full prefill of the flat prompt.
        from ragkv.recompute.probe import ProbeWork

        r_system = ids(128, rng)
        r_docs = [ids(doc_len, rng) for _ in range(8)]
        generate([RAGPrompt(r_system, r_docs, ids(64, rng))], 1)  # caches the chunks
        probe_times: list[float] = []
        probe_run = ProbeWork.run

        def timed_probe(self, model, pool, *backend):
            sync(device)
            start = time.perf_counter()
            scores = probe_run(self, model, pool, *backend)  # ends on the host (.cpu())
            probe_times.append(time.perf_counter() - start)
            return scores

        def quality_ttft(**layout) -> dict:
            """Median TTFT, recomputed share and probe time of `reps` warm requests (after one
            more), each with the documents in a new order and a new question."""
            times, shares = [], []
            probe_times.clear()
            for _ in range(reps + 1):
                order = r_docs[:]
                rng.shuffle(order)
                prompt = RAGPrompt(r_system, order, ids(64, rng), **layout)
                outs = []
                times.append(timed(lambda p=prompt, outs=outs: outs.extend(llm.generate(
                    [p], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)),
                    device))
                shares.append(outs[0].metrics.num_recomputed_tokens / (8 * doc_len))
            return {"ttft": statistics.median(times[1:]), "share": statistics.median(shares),
                    "probe": statistics.median(probe_times[1:]) if probe_times else 0.0}

        flat = r_system + [t for d in r_docs for t in d] + ids(64, rng)
        full_t = []
        for _ in range(reps + 1):
            llm.reset_prefix_cache()
            full_t.append(generate([{"prompt_token_ids": flat}], 1))
        full = statistics.median(full_t[1:])
        floor = decode_floor(1, 0)
        fig["recompute"] = {"full_prefill": full}
        rows.append((f"full prefill, {len(flat)}-token flat RAG prompt", full, None,
                     prefill_flops(len(flat)) / floors["flops"], ""))
        say(f"quality modes: full prefill of the flat prompt {full * 1e3:.1f} ms")
        ProbeWork.run = timed_probe
        try:
            modes = [
                ("shared (exact reuse)", dict(position_strategy="shared"), True),
                ("sequential", dict(position_strategy="sequential", recompute="none"), True),
                ("sequential + query 10%", dict(position_strategy="sequential",
                                                recompute="query", recompute_ratio=0.1), True),
                ("sequential + query 10%, eager", dict(position_strategy="sequential",
                                                       recompute="query",
                                                       recompute_ratio=0.1), False),
                ("sequential + query 15%", dict(position_strategy="sequential",
                                                recompute="query", recompute_ratio=0.15), True),
                ("default (query 0.1-0.5, mass 0.9)", dict(
                    position_strategy="sequential", recompute="query", recompute_ratio=0.5,
                    recompute_min_ratio=0.1, recompute_score_mass=0.9), True),
                ("sequential + blend 15%", dict(position_strategy="sequential",
                                                recompute="blend", recompute_ratio=0.15), True),
            ]
            for name, layout, graphed in modes:
                runner = llm.engine.runner
                saved = runner.extend_graphs
                if not graphed:
                    runner.extend_graphs = None
                try:
                    got = quality_ttft(**layout)
                finally:
                    runner.extend_graphs = saved
                fig["recompute"][name] = got
                rows.append((f"warm RAG TTFT, {name}", got["ttft"], None, floor,
                             f"{full / got['ttft']:.2f}x faster than full prefill; "
                             f"recomputed {100 * got['share']:.0f}%, probe "
                             f"{got['probe'] * 1e3:.2f} ms"))
                say(f"RAG TTFT {name}: {got['ttft'] * 1e3:.1f} ms ({full / got['ttft']:.2f}x "
                    f"below full prefill), recomputed {100 * got['share']:.1f}%, probe "
                    f"{got['probe'] * 1e3:.2f} ms")
        finally:
            ProbeWork.run = probe_run

    if "decode" in want:
        # Decode.
        def hf_decode(batch: int, context: int) -> float:
            x = torch.tensor([ids(context, rng) for _ in range(batch)], device=device)
            with torch.inference_mode():
                def run(n):
                    return timed(lambda: hf.generate(x, max_new_tokens=n, min_new_tokens=n,
                                                     do_sample=False), device)
                run(2)
                t1 = statistics.median(run(1) for _ in range(reps))
                tn = statistics.median(run(decode_new) for _ in range(max(2, reps // 2)))
            return (tn - t1) / (decode_new - 1)

        for batch in (1, 32):
            context = 512
            prompts = [{"prompt_token_ids": ids(context, rng)} for _ in range(batch)]
            generate(prompts, 2)
            t1 = statistics.median(generate(prompts, 1) for _ in range(reps))
            tn = statistics.median(generate(prompts, decode_new) for _ in range(max(2, reps // 2)))
            step = (tn - t1) / (decode_new - 1)
            # Decode steps at a context length never seen before, then at the same length again:
            # T(33) - T(1), each call from an empty prefix cache (the same prefill in both).
            fresh = 900 + rng.randrange(1000)
            new_prompts = [{"prompt_token_ids": ids(fresh, rng)} for _ in range(batch)]

            def cold(n: int, new_prompts=new_prompts) -> float:
                llm.reset_prefix_cache()
                return generate(new_prompts, n)

            first = cold(33) - cold(1)
            again = cold(33) - cold(1)
            hf_step = hf_decode(batch, context) if hf is not None else None
            floor = decode_floor(batch, context + decode_new // 2)
            fig[f"decode_b{batch}"] = {"ragkv": step, "hf": hf_step, "floor": floor,
                                       "first_pass_step": first / 32, "repeat_step": again / 32}
            rows.append((f"decode batch {batch}, ms/step", step, hf_step, floor,
                         f"new lengths: {first / 32 * 1e3:.2f} first, "
                         f"{again / 32 * 1e3:.2f} again"))
            say(f"decode b{batch}: {step * 1e3:.2f} ms/step, HF "
                f"{hf_step * 1e3 if hf_step else float('nan'):.2f}, floor {floor * 1e3:.2f}")

    if "sampled" in want:
        # Sampled decode (seeded, temperature, top-k, top-p) against greedy, batch 32.
        prompts = [{"prompt_token_ids": ids(512, rng)} for _ in range(32)]
        greedy_step = decode_step(prompts)
        sampled = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(32)]
        sampled_step = decode_step(prompts, sampled)
        if args.profile:
            profile_request(lambda: generate(prompts, 16), args.profile, "decode_b32")
            profile_request(lambda: generate(prompts, 16, sampled), args.profile,
                            "sampled_b32")
        fig["decode_b32_sampled"] = {"greedy": greedy_step, "sampled": sampled_step}
        rows.append(("decode batch 32 sampled (seeded, T 0.8, top-k 50, top-p 0.9), ms/step",
                     sampled_step, None, decode_floor(32, 512 + decode_new // 2),
                     f"greedy {greedy_step * 1e3:.2f} ms"))
        say(f"decode b32 sampled {sampled_step * 1e3:.2f} ms/step, greedy "
            f"{greedy_step * 1e3:.2f}")

    if "mixed" in want:
        # Mixed workload, two passes with fresh ids (no cache hits) and fresh lengths: the
        # second pass moves each length of the first by a different amount, in +d/-d pairs,
        # so both passes have the same number of tokens (and about the same floor).
        passes = []
        floor_sum = []
        lengths_1 = [rng.randrange(300, 2001) for _ in range(16)]

        def moved() -> list[int]:
            moves = [rng.randrange(1, 150) for _ in range(8)]
            return [n + (d if i % 2 else -d) for i, (n, d) in enumerate(
                zip(lengths_1, [m for m in moves for _ in (0, 1)], strict=True))]

        # More passes (--mixed-passes) tell a trend (the engine slowing as it runs) from noise.
        for lengths in [lengths_1] + [moved() for _ in range(args.mixed_passes - 1)]:
            llm.reset_prefix_cache()
            prompts = [{"prompt_token_ids": ids(n, rng)} for n in lengths]
            passes.append(generate(prompts, 32))
            floor_sum.append(sum(prefill_flops(n) for n in lengths) / floors["flops"]
                             + 32 * decode_floor(16, 1150))
        fig["mixed"] = {"first": passes[0], "second": passes[1], "floors": floor_sum,
                        "passes": passes}
        rows.append(("mixed: 16 x (300-2000 tokens) x 32 out, 1st / 2nd pass", passes[0], None,
                     floor_sum[0], f"2nd pass {passes[1]:.3f} s (floor {floor_sum[1]:.3f} s)"))
        say(f"mixed: {passes[0]:.3f} s then {passes[1]:.3f} s; floors {floor_sum}")
        if len(passes) > 2:
            say("mixed, every pass: " + ", ".join(f"{t:.3f}" for t in passes) + " s")

    if "rag" in want:
        # Decode over re-positioned chunks (sequential layout) against the shared layout, batch 32.
        def rag_batch(**layout):
            local = random.Random(5)
            return [RAGPrompt(system, local.sample(docs, 4), ids(32, local), **layout)
                    for _ in range(32)]

        shared_step = decode_step(rag_batch())
        moved_step = decode_step(rag_batch(position_strategy="sequential", recompute="none"))
        floor = decode_floor(32, 128 + 4 * doc_len + 32 + decode_new // 2)
        fig["decode_b32_repositioned"] = {"shared": shared_step, "sequential": moved_step,
                                          "floor": floor}
        rows.append(("decode batch 32 over 4 re-positioned chunks, ms/step", moved_step, None,
                     floor, f"shared layout {shared_step * 1e3:.2f} ms"))
        say(f"decode b32 RAG: sequential {moved_step * 1e3:.2f} ms/step, shared "
            f"{shared_step * 1e3:.2f}")

    variants_at_end = compiled_variants()
    if variants_at_start is not None:
        after_start = variants_at_end - variants_at_start - swept_variants
        fig["kernels_compiled_after_start"] = after_start
        say(f"Triton kernel variants compiled after start-up: {after_start} (of "
            f"{variants_at_end}; not counting the tile sweep's own {swept_variants})")

    # Free the GPU for the RAG benchmark's engines: the graphs hold the model and the pool,
    # `embed` HF's embedding.
    llm = hf = graphs = extend_graphs = embed = None
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    print("\n| what | ragkv | HF (sdpa) | floor | ragkv/floor | ragkv/HF | notes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, ours, theirs, floor, note in rows:
        hf_col = f"{theirs * 1e3:.1f} ms" if theirs else "—"
        ratio_hf = f"{ours / theirs:.2f}" if theirs else "—"
        print(f"| {name} | {ours * 1e3:.1f} ms | {hf_col} | {floor * 1e3:.1f} ms | "
              f"{ours / floor:.2f} | {ratio_hf} | {note} |", flush=True)

    if not args.skip_rag_bench and "ragbench" in want:
        from ragkv.bench.offline import format_table, run_offline
        from ragkv.bench.workload import WorkloadConfig

        config = WorkloadConfig(num_docs=16, doc_tokens=doc_len, docs_per_request=4,
                                system_tokens=64, question_tokens=32, output_tokens=8,
                                num_requests=16 if args.quick else 40)
        # The chunk mode in the shared layout (exact reuse), as docs/benchmarks.md measured
        # it; `ragkv bench`'s own default is the quality mode.
        kwargs = dict(dtype=args.dtype, device=device, max_model_len=8192,
                      kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
                      attention_backend=args.attention_backend,
                      enforce_eager=args.enforce_eager, position_strategy="shared")
        results = run_offline(tmp, ["none", "prefix", "chunk"], config, kwargs, progress=False)
        fig["rag_bench"] = results
        print("\n`ragkv bench` RAG workload on this model:")
        print(format_table(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""ragkv against llama.cpp on the CPU, on the same GGUF file (SmolLM2-135M-Instruct Q4_1, or
--model), side by side in one run: batch-1 greedy decode tokens/s (ragkv with packed 4-bit
weights, ragkv with dequantized float32 weights, llama.cpp through llama-cpp-python; --threads
CPU threads each); time to first token of a RAG prompt (system + 6 eval-suite documents +
question, chat-rendered, or plain text for a base model such as gemma3-270m)
whose documents come in a new order on every request: ragkv cold, ragkv warm (chunk KV reused,
in the engine's default RAG mode and with exact chunk reuse), ragkv with its caches off (full
prefill) and llama.cpp (reset before every request: a new order leaves it nothing past the
system prompt to reuse anyway);
and the weight bytes each ragkv engine holds against the GGUF file's size, with the process
RSS growth of loading each engine (and its first decode). llama.cpp gets the very token ids
ragkv's chat rendering gives, and is driven through `Llama.generate` (the token loop under
`create_completion`) so that it, like ragkv with ignore_eos, decodes exactly --max-tokens
tokens and every token is timed as it comes. llama-cpp-python is optional. Run it on an idle
machine: torch's OpenMP threads slow down sharply when another process takes one of the cores.

    python benchmarks/bench_cpu_peer.py                                # 128 tokens, 3 repeats
    python benchmarks/bench_cpu_peer.py --max-tokens 32 --repeats 1    # quicker
    python benchmarks/bench_cpu_peer.py --skip-llama-cpp --skip-dense  # ragkv packed only
    python benchmarks/bench_cpu_peer.py --compile --skip-dense  # + decode via torch.compile
    python benchmarks/bench_cpu_peer.py --crossover    # prefill: kernel vs dequantized path
    python benchmarks/bench_cpu_peer.py --prompt-dtypes  # prompt rows' matmul: f32 vs bf16

--crossover times plain prompts of 32-580 tokens (caches off) on dense float32 weights and on
packed weights with every prompt row on the kernel, on the dequantized path, and as served:
where the kernel and dequantized columns cross is where a prompt's rows should switch
(KERNEL_MAX_ROWS: prompts up to that length run the kernel).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

MODEL = "smollm2-135m-instruct"
COMPILED = "ragkv packed 4-bit, compiled decode"
EXACT = "ragkv packed 4-bit, exact chunk reuse"
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def rss_mib() -> float:
    """This process's resident set size (VmRSS), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_ticks() -> tuple[int, int]:
    """All CPUs' ticks from /proc/stat: total, and idle (idle + iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks), ticks[3] + ticks[4]


def busy_cpus(seconds: float = 0.5) -> float:
    """How many CPUs other processes keep busy over the next `seconds`."""
    total, idle = cpu_ticks()
    time.sleep(seconds)
    total2, idle2 = cpu_ticks()
    return (1 - (idle2 - idle) / max(total2 - total, 1)) * os.cpu_count()


def ragkv_decode(llm, prompt, n: int) -> tuple[float, list[int]]:
    """Decode tokens/s of one greedy request of exactly n tokens, and its tokens."""
    from ragkv import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    m, tokens = out.metrics, out.outputs[0].token_ids
    return (len(tokens) - 1) / max(m.finished_time - m.first_token_time, 1e-9), tokens


def llama_decode(llm, ids: list[int], n: int) -> tuple[float, list[int]]:
    """The same for llama.cpp: n greedy tokens (EOS not special), timed first to last."""
    llm.reset()
    gen = llm.generate(ids, temp=0.0, reset=True)
    tokens, stamps = [], []
    for _ in range(n):
        tokens.append(next(gen))
        stamps.append(time.perf_counter())
    gen.close()
    return (n - 1) / max(stamps[-1] - stamps[0], 1e-9), tokens


def pick_documents(tokenizer) -> tuple[object, list[str], list[str]]:
    """An eval-suite item with 6 documents totalling nearest 560 tokens, its documents, and 6
    other documents of the suite (none of the item's) for warming up the code paths."""
    from ragkv.eval.suite import build_suite

    suite = build_suite(16)
    sizes = {d: len(tokenizer.encode(d)) for item in suite for d in item.documents}
    items = [it for it in suite if len(it.documents) == 6]
    item = min(items, key=lambda it: abs(sum(sizes[d] for d in it.documents) - 560))
    others = [d for d in sizes if d not in item.documents and 60 <= sizes[d] <= 110][:6]
    return item, list(item.documents), others


def story_prompt(engine):
    """The decode prompt: STORY in the model's chat template, or as plain text for a base
    model (no template)."""
    from ragkv.inputs.prompt import parse_prompt

    if getattr(engine.tokenizer, "chat_template", None):
        return engine.process_chat(STORY)
    return parse_prompt(STORY[0]["content"] + "\n\n", engine.tokenizer, engine.inputs.rules)


def rag_ttft(llm, item, documents: list[str]) -> tuple[float, object, object]:
    """Wall time of generate(max_tokens=1) on eval-suite `item`'s question over `documents`
    (as `ragkv eval` renders it: the chat template, or plain text for a base model), the
    prompt and the output."""
    from ragkv import SamplingParams
    from ragkv.eval.evaluate import question_prompt

    prompt = question_prompt(llm.engine, item.system, documents, item.question)
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0),
                       use_tqdm=False)[0]
    return time.perf_counter() - start, prompt, out


def prompt_dtypes(common: dict, repeats: int) -> None:
    """Packed weights with the prompt rows' dense matmul in float32 and in bfloat16, in one
    process, interleaved: warm TTFT of the reordered RAG prompt and its full prefill."""
    import torch

    from ragkv import LLM
    from ragkv.model import quantized_linear

    engines = {dtype: (LLM(**common, quantization="gguf"),
                       LLM(**common, quantization="gguf", enable_chunk_cache=False,
                           enable_prefix_caching=False))
               for dtype in (torch.float32, torch.bfloat16)}
    first = next(iter(engines.values()))[0]
    item, docs, others = pick_documents(first.get_tokenizer())

    def ttft(llm, documents: list[str]) -> float:
        return rag_ttft(llm, item, documents)[0]

    saved = quantized_linear.prompt_dtype()
    times = {dtype: ([], []) for dtype in engines}
    try:
        for dtype, (llm, full) in engines.items():  # warm-up; the documents cached
            quantized_linear.pin_prompt_dtype(dtype)
            ttft(llm, others), ttft(llm, docs), ttft(full, docs)
        rng = random.Random(0)
        for _ in range(repeats):
            order = rng.sample(docs, len(docs))
            for dtype, (llm, full) in engines.items():
                quantized_linear.pin_prompt_dtype(dtype)
                times[dtype][0].append(ttft(llm, order))
                times[dtype][1].append(ttft(full, order))
    finally:
        quantized_linear.pin_prompt_dtype(saved)
    print(f"packed weights, prompt rows' matmul (this machine would choose {saved}); medians of "
          f"{repeats} reordered requests, interleaved:")
    for dtype, (warm, full) in times.items():
        print(f"  {str(dtype):<15} warm TTFT {statistics.median(warm) * 1e3:7.1f} ms   full "
              f"prefill {statistics.median(full) * 1e3:7.1f} ms")
    (w32, f32), (w16, f16) = ((statistics.median(a), statistics.median(b))
                              for a, b in times.values())
    print(f"  float32 / bfloat16: warm {w32 / w16:.2f} x, full prefill {f32 / f16:.2f} x")


def crossover(common: dict, threads: int) -> None:
    from ragkv import LLM, SamplingParams
    from ragkv.model import quantized_linear, runner

    dense = LLM(**common, quantization="none", dtype="float32", enable_chunk_cache=False,
                enable_prefix_caching=False)
    packed = LLM(**common, quantization="gguf", enable_chunk_cache=False,
                 enable_prefix_caching=False)
    words = dense.get_tokenizer()("The history of the city is long and full of turns. " * 80)
    one = SamplingParams(max_tokens=1)

    def best(llm, n: int) -> float:
        prompt = [{"prompt_token_ids": words["input_ids"][:n]}]
        llm.generate(prompt, one, use_tqdm=False)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            llm.generate(prompt, one, use_tqdm=False)
            times.append(time.perf_counter() - start)
        return min(times) * 1000

    route, saved = packed.engine.model.route, quantized_linear.KERNEL_MAX_ROWS
    takes_kernel = runner.takes_kernel
    print(f"prefill of a plain prompt, best of 3, ms ({threads} threads); packed: every prompt "
          "row on the kernel / on the dequantized path / as served (a prompt of at most "
          f"{saved} tokens on the kernel, a longer one's rows dequantized; the head and probes "
          f"take the kernel up to {saved} rows)")
    print(f"{'tokens':>6} {'dense f32':>10} {'kernel':>8} {'dequant':>8} {'served':>8}")
    try:
        for n in (32, 64, 80, 96, 112, 128, 192, 256, 580):
            dense_t = best(dense, n)
            served_t = best(packed, n)
            # Every prompt row on the dequantized path (the runner's routing; the head's
            # last-token row stays on the kernel, as served).
            runner.takes_kernel = lambda start, prompt_len, rows: start >= prompt_len
            dequant_t = best(packed, n)
            runner.takes_kernel = takes_kernel
            packed.engine.model.route = None  # by size, every row on the kernel
            quantized_linear.KERNEL_MAX_ROWS = 10**6
            kernel_t = best(packed, n)
            packed.engine.model.route, quantized_linear.KERNEL_MAX_ROWS = route, saved
            print(f"{n:>6} {dense_t:>10.1f} {kernel_t:>8.1f} {dequant_t:>8.1f} "
                  f"{served_t:>8.1f}", flush=True)
    finally:
        quantized_linear.KERNEL_MAX_ROWS = saved
        runner.takes_kernel = takes_kernel
        packed.engine.model.route = route


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL,
                        help="a GGUF model name or file (gemma3-270m: sliding windows)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2,
                        help="CPU threads for both: torch's intra-op threads and llama.cpp's")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--crossover", action="store_true",
                        help="only the prefill table: kernel against dequantized path")
    parser.add_argument("--prompt-dtypes", action="store_true",
                        help="only packed TTFT with the prompt rows' matmul in float32 and "
                             "in bfloat16, side by side")
    parser.add_argument("--skip-dense", action="store_true",
                        help="skip the dequantized float32 ragkv engine")
    parser.add_argument("--compile", action="store_true",
                        help="also a packed engine with its decode steps compiled "
                             "(enable_torch_compile; a minute or two to compile)")
    args = parser.parse_args()

    llama_cpp = None
    if not args.skip_llama_cpp:
        try:
            import llama_cpp
        except ImportError:
            print("llama_cpp not importable: skipping the llama.cpp columns. Install with\n"
                  "  pip install llama-cpp-python   (CPU build; see its README for options)")
    import torch

    from ragkv import LLM, SamplingParams
    from ragkv.model import quantized_linear
    from ragkv.model.loader import resolve_model_path

    torch.set_num_threads(args.threads)
    busy = busy_cpus()
    if busy > 0.3:
        print(f"note: other processes keep {busy:.1f} CPUs busy: torch's OpenMP threads slow "
              "down sharply when one of theirs is taken (idle machine, or --threads 1)")
    path = resolve_model_path(args.model)
    file_bytes = os.path.getsize(path)
    print(f"model {args.model}: {path} ({file_bytes / 2**20:.1f} MiB)")
    print(f"threads {args.threads}: ragkv torch.get_num_threads() {torch.get_num_threads()}"
          + ("" if llama_cpp is None else f", llama.cpp n_threads (llama-cpp-python "
             f"{llama_cpp.__version__}, n_batch 512)"))
    common = dict(model=args.model, device="cpu", max_model_len=4096)
    if args.crossover:
        crossover(common, args.threads)
        return
    if args.prompt_dtypes:
        prompt_dtypes(common, max(args.repeats, 5))
        return
    # Loaded first and not measured: it also takes the one-time imports out of the RSS figures.
    first = LLM(**common, quantization="gguf", enable_chunk_cache=False,
                enable_prefix_caching=False)
    story = story_prompt(first.engine)
    del first
    ids = story.token_ids
    n, reps = args.max_tokens, args.repeats

    engines, rss, rates, outs = {}, {}, {}, {}
    specs = [("ragkv packed 4-bit (gguf)", dict(quantization="gguf"))]
    if args.compile:
        specs.append((COMPILED, dict(quantization="gguf", enable_torch_compile=True)))
    if not args.skip_dense:
        specs.append(("ragkv dequantized float32", dict(quantization="none", dtype="float32")))
    if llama_cpp is not None:
        specs.append(("llama.cpp", None))
    print(f"\ndecode, batch 1, greedy, {n} new tokens, prompt {len(ids)} tokens "
          f"(median of {reps} after a warm-up):")
    runs = {}
    for name, kwargs in specs:  # load, and warm up, one at a time: the RSS growth of each
        before = rss_mib()
        if kwargs is None:
            llm = llama_cpp.Llama(path, n_ctx=4096, n_threads=args.threads, n_batch=512,
                                  verbose=False)
            runs[name] = lambda llm=llm: llama_decode(llm, ids, n)
        else:
            llm = LLM(**common, **kwargs)
            runs[name] = lambda llm=llm: ragkv_decode(llm, story, n)
        runs[name]()
        rss[name] = rss_mib() - before
        engines[name] = llm
    results = {name: [] for name in runs}
    for _ in range(reps):  # interleaved, so that a busy moment of the machine hits all alike
        for name, run in runs.items():
            results[name].append(run())
    for name in runs:
        outs[name] = results[name][-1][1]
        agree = ""
        if name != specs[0][0]:
            pairs = enumerate(zip(outs[specs[0][0]], outs[name], strict=True))
            same = next((i for i, (a, b) in pairs if a != b), n)
            agree = f"; first {same} tokens as ragkv packed"
        rates[name] = statistics.median(r[0] for r in results[name])
        print(f"  {name:<34} {rates[name]:8.1f} tok/s  ({len(outs[name])} tokens per run)"
              f"{agree}", flush=True)
    packed_name = specs[0][0]
    packed = engines[packed_name]
    for name in rates:
        if name != packed_name:
            print(f"  ragkv packed / {name}: {rates[packed_name] / rates[name]:.2f} x")

    tokenizer = packed.get_tokenizer()
    item, docs, others = pick_documents(tokenizer)
    print(f"\nRAG default: {packed.engine.describe_rag_default()}")
    print(f"packed weights: prompt rows multiply in {quantized_linear.prompt_dtype()} "
          "(RAGKV_PACKED_PROMPT_DTYPE pins it)")
    rng, seen = random.Random(0), set()

    def new_order() -> list[str]:
        while True:
            order = list(range(len(docs)))
            rng.shuffle(order)
            if tuple(order) not in seen:
                seen.add(tuple(order))
                return [docs[i] for i in order]

    one = SamplingParams(max_tokens=1, temperature=0.0)

    def ttft(llm, documents: list[str]) -> tuple[float, object, object]:
        return rag_ttft(llm, item, documents)

    def plain_ttft(llm, prompt) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": list(prompt.token_ids)}], one, use_tqdm=False)
        return time.perf_counter() - start

    def llama_ttft(llm, prompt) -> float:
        llm.reset()
        start = time.perf_counter()
        gen = llm.generate(prompt.token_ids, temp=0.0, reset=True)
        next(gen)
        elapsed = time.perf_counter() - start
        gen.close()
        return elapsed

    orders = [new_order() for _ in range(reps + 1)]
    kinds = [(name, kwargs) for name, kwargs in specs if kwargs is not None]
    # Exact chunk reuse (no recompute, no primer): TTFT only, beside the default mode.
    exact_kwargs = dict(quantization="gguf", recompute="none", chunk_primer="none")
    kinds.insert(1, (EXACT, exact_kwargs))
    print(f"TTFT, RAG prompt (system + {len(docs)} documents + question, documents in a new "
          "order each time), wall time of generate(max_tokens=1); full prefill: the same "
          "tokens as one plain prompt, caches off:")
    warm_of, prompts = {}, []
    for name, kwargs in kinds:
        llm = engines[name] = engines.get(name) or LLM(**common, **kwargs)
        eager = {k: v for k, v in kwargs.items() if k != "enable_torch_compile"}  # a prefill
        full = LLM(**common, **eager, enable_chunk_cache=False, enable_prefix_caching=False)
        ttft(llm, others)  # warm-up, other documents: the target documents stay uncached
        cold, first, cold_out = ttft(llm, orders[0])
        # With a chunk primer the first document's KV (after S alone) is another cache
        # entry than a later one's (after S and the primer): each document leads once,
        # untimed, so that the timed orders find every document cached in either role.
        for k in range(1, len(docs)):
            ttft(llm, orders[0][k:] + orders[0][:k])
        runs_ = [ttft(llm, order) for order in orders[1:]]
        warm = warm_of[name] = statistics.median(t for t, _, _ in runs_)
        prompts = [first] + [p for _, p, _ in runs_]
        full_t = statistics.median(plain_ttft(full, p) for p in [prompts[-1], *prompts])
        m = runs_[-1][2].metrics
        print(f"  {name}: {len(first.token_ids)} tokens (system {len(first.system)} + "
              f"documents {[len(c) for c in first.chunks]} + question {len(first.question)})")
        print(f"    cold (documents not cached)      {cold * 1000:8.1f} ms  "
              f"(chunk misses {cold_out.metrics.num_chunk_misses})")
        print(f"    warm (new order, median)         {warm * 1000:8.1f} ms  (chunk hits "
              f"{m.num_chunk_hits}, misses {m.num_chunk_misses}, recomputed "
              f"{m.num_recomputed_tokens} tokens)")
        print(f"    full prefill                     {full_t * 1000:8.1f} ms  "
              f"full / warm = {full_t / warm:.2f} x, cold / warm = {cold / warm:.2f} x")
        full.check_integrity()
        del full
    llama_t = None
    if llama_cpp is not None:
        lc = engines["llama.cpp"]
        llama_ttft(lc, prompts[-1])  # warm-up
        llama_t = statistics.median(llama_ttft(lc, p) for p in prompts)
        print(f"  llama.cpp (reset, same token ids)  {llama_t * 1000:8.1f} ms  " + ", ".join(
            f"/ {name} warm = {llama_t / w:.2f} x" for name, w in warm_of.items()))

    print(f"\nweights held vs the GGUF file ({file_bytes / 2**20:.1f} MiB); RSS growth of "
          "load + first decode (llama.cpp maps the file: its pages count once touched):")
    for name in engines:
        if name == EXACT:  # the packed engine's weights again
            continue
        if name == "llama.cpp":
            print(f"  {name:<26} {'':>38} RSS +{rss[name]:6.0f} MiB")
            continue
        w = engines[name].engine.weights
        print(f"  {name:<26} {w.weight_bytes / 2**20:7.1f} MiB "
              f"({w.weight_bytes / file_bytes:4.2f} x file), {w.int4_layers:3d} int4 layers  "
              f"RSS +{rss[name]:6.0f} MiB")

    skipped = "  (llama.cpp skipped)"
    lc_decode = skipped if llama_t is None else f"{rates[packed_name] / rates['llama.cpp']:6.2f} x"
    print(f"\nsummary:\n  decode packed / llama.cpp                    {lc_decode}")
    lc_ttft = skipped if llama_t is None else f"{llama_t / warm_of[packed_name]:6.2f} x"
    if COMPILED in rates and llama_t is not None:
        print(f"  decode packed, compiled / llama.cpp          "
              f"{rates[COMPILED] / rates['llama.cpp']:6.2f} x")
    print(f"  TTFT llama.cpp / ragkv warm (reordered)      {lc_ttft}")
    if llama_t is not None:
        print(f"  TTFT llama.cpp / ragkv warm, exact reuse     {llama_t / warm_of[EXACT]:6.2f} x")
    print(f"  weights held / GGUF file                     "
          f"{packed.engine.weights.weight_bytes / file_bytes:6.2f} x")
    for llm in engines.values():
        if hasattr(llm, "check_integrity"):
            llm.check_integrity()


if __name__ == "__main__":
    main()

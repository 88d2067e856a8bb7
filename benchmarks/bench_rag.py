"""Warm RAG time to first token against a full prefill of the same prompt, next to the FLOP
bound, per RAG layout, and the cost of re-positioning a long cached chunk, measured side by
side in one run.

The prompt: a system prompt, several documents and a question (default 64 + 4 x 512 + 32
tokens). "Full prefill" computes all of it (caches cleared before each run); "warm" runs with
every document already in the chunk cache, in a new order, with a new question, so only the
question is computed. The bound is the FLOP ratio of the two (full prefill FLOPs / question-
only FLOPs over the same context, ragkv/bench/flops.py). HF transformers computing the same
prompt with the reference mask is timed alongside. Warm TTFT, and the decode step of a batch
of 8 warm requests, are then measured for each layout (shared or sequential positions, isolated or
standalone chunks), interleaved. Every request here reuses its chunks exactly, with no
selective recompute: the engine runs with shared positions as its default layout (its own
default, the quality mode, recomputes chunk tokens), and the layouts are asked with
`recompute="none"`.

Re-positioning: S + a 16-token document + a long document (default 4,096 tokens) + the
question. Under `shared` positions the long document's cached keys are used where they were
computed; under `sequential` it sits after the short one, so attention sees its keys rotated
by 16 positions. The difference of the two warm TTFTs (and decode steps) is what
re-positioning costs; it is set against computing the document (cold TTFT minus warm TTFT)
and against rotating the document's keys into a copy, layer by layer, which is what a
request-owned rotated copy would cost (the route not taken).

    python benchmarks/bench_rag.py --model builtin:small
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch


def main() -> None:
    from ragkv.bench.workload import add_bench_shape_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_shape_args(parser)
    parser.add_argument("--decode-batch", type=int, default=8,
                        help="requests decoding together in the per-layout decode timing")
    parser.add_argument("--long-doc-tokens", type=int, default=4096,
                        help="the re-positioned document (0: skip that part)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers run")
    parser.add_argument("--quantization", default=None, choices=["gguf", "none"],
                        help="a GGUF file's weights packed or dequantized (default: the "
                        "engine's)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()

    from ragkv import LLM, RAGPrompt, SamplingParams
    from ragkv.bench.flops import rag_flop_bound
    from ragkv.bench.offline import reference_inputs
    from ragkv.bench.workload import BenchRequest

    # Shared positions, no recompute: "warm" computes the question only (exact chunk reuse).
    llm = LLM(args.model, max_num_batched_tokens=max(4096, args.long_doc_tokens + 64),
              max_chunk_tokens=max(4096, args.long_doc_tokens), position_strategy="shared",
              quantization=args.quantization)
    mc = llm.engine.model_config
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, mc.vocab_size) for _ in range(n)]

    system = tokens(args.system_tokens)
    docs = [tokens(args.doc_tokens) for _ in range(args.num_docs)]
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def ttft(prompt) -> float:
        out = llm.generate(prompt, one, use_tqdm=False)[0]
        return out.metrics.ttft

    def full() -> float:
        llm.clear_chunk_cache()
        llm.reset_prefix_cache()
        return ttft(RAGPrompt(system, docs, tokens(args.question_tokens)))

    def warm() -> float:
        order = docs[:]
        rng.shuffle(order)
        return ttft(RAGPrompt(system, order, tokens(args.question_tokens)))

    full(), warm()  # warm-up: also leaves every document cached
    full_times, warm_times = [], []
    for _ in range(args.repeats):
        full_times.append(full())
        warm()  # re-populate after the clear
        warm_times.append(warm())
    t_full, t_warm = statistics.median(full_times), statistics.median(warm_times)
    stats = llm.get_chunk_cache_stats()

    s, q, n, length = args.system_tokens, args.question_tokens, args.num_docs, args.doc_tokens
    context = s + n * length
    bound = rag_flop_bound(mc, s, [length] * n, q)
    speedup = t_full / t_warm
    results = {
        "prompt_tokens": context + q, "full_prefill_ttft_s": t_full, "warm_ttft_s": t_warm,
        "speedup": speedup, "flop_bound": bound, "fraction_of_bound": speedup / bound,
        "chunk_hit_rate": stats.hit_rate, "threads": torch.get_num_threads(),
    }
    print(f"prompt: system {s} + {n} x {length} documents + question {q} = "
          f"{context + q} tokens")
    print(f"full prefill TTFT  {t_full * 1000:8.1f} ms")
    print(f"warm TTFT          {t_warm * 1000:8.1f} ms   (all chunks cached, new order, "
          "new question)")
    print(f"speedup            {speedup:8.1f} x   (target >= 15)")
    print(f"FLOP bound         {bound:8.1f} x   reached {speedup / bound:.0%} (target >= 50%)")

    if not args.no_hf:
        from ragkv.model.loader import load_hf_model

        hf = load_hf_model(args.model)
        ids, positions, mask = reference_inputs(BenchRequest(system, [], docs, tokens(q)))

        def hf_run() -> float:
            start = time.perf_counter()
            with torch.inference_mode():
                hf(input_ids=ids, position_ids=positions, attention_mask=mask, logits_to_keep=1)
            return time.perf_counter() - start

        hf_run()
        t_hf = statistics.median(hf_run() for _ in range(args.repeats))
        results["hf_full_prefill_s"] = t_hf
        print(f"HF full prefill    {t_hf * 1000:8.1f} ms   (same prompt, reference mask); "
              f"ragkv full / HF = {t_full / t_hf:.2f}, HF / ragkv warm = {t_hf / t_warm:.1f} x")
    results["by_layout"] = layout_ttfts(llm, system, docs, tokens, args)
    if args.long_doc_tokens:
        results["reposition"] = reposition_cost(llm, tokens, args)
    llm.check_integrity()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


LAYOUTS = (("shared", "isolated"), ("sequential", "isolated"), ("shared", "standalone"),
           ("sequential", "standalone"))


def layout_ttfts(llm, system, docs, tokens, args) -> dict:
    """Warm TTFT of the same prompt shape in each layout, runs interleaved across layouts."""
    from ragkv import RAGPrompt, SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(1)
    times: dict[tuple[str, str], list[float]] = {layout: [] for layout in LAYOUTS}

    def warm(layout) -> float:
        order = docs[:]
        rng.shuffle(order)
        prompt = RAGPrompt(system, order, tokens(args.question_tokens),
                           position_strategy=layout[0], chunk_attention=layout[1],
                           recompute="none")
        out = llm.generate(prompt, one, use_tqdm=False)[0]
        assert out.metrics.num_chunk_misses == 0 or not times[layout], "not warm"
        return out.metrics.ttft

    decode = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    steps: dict[tuple[str, str], list[float]] = {layout: [] for layout in LAYOUTS}

    def decode_step(layout) -> float:
        """Mean decode step of a batch of `args.decode_batch` warm requests."""
        prompts = []
        for _ in range(args.decode_batch):
            order = docs[:]
            rng.shuffle(order)
            prompts.append(RAGPrompt(system, order, tokens(args.question_tokens),
                                     position_strategy=layout[0], chunk_attention=layout[1],
                                     recompute="none"))
        outs = llm.generate(prompts, decode, use_tqdm=False)
        first = max(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.last_token_time for o in outs)
        return (last - first) / (decode.max_tokens - 1)

    for layout in LAYOUTS:
        warm(layout)  # computes the standalone entries; warms up the code paths
        decode_step(layout)
    for _ in range(args.repeats):
        for layout in LAYOUTS:
            times[layout].append(warm(layout))
            steps[layout].append(decode_step(layout))
    base = statistics.median(times[LAYOUTS[0]])
    base_step = statistics.median(steps[LAYOUTS[0]])
    print(f"warm TTFT and decode step (batch {args.decode_batch}) by layout (positions, chunk "
          "attention), same prompt shape:")
    out = {}
    for layout in LAYOUTS:
        t, step = statistics.median(times[layout]), statistics.median(steps[layout])
        out["/".join(layout)] = {"warm_ttft_s": t, "decode_step_s": step}
        print(f"  {layout[0]:<10} {layout[1]:<10} TTFT {t * 1000:7.1f} ms ({t / base:4.2f} x)   "
              f"decode step {step * 1000:6.1f} ms ({step / base_step:4.2f} x)")
    return out


def reposition_cost(llm, tokens, args) -> dict:
    """What re-positioning a long cached document costs, against computing it."""
    from ragkv import RAGPrompt, SamplingParams
    from ragkv.model.layers import apply_rotary

    system, short, long = tokens(args.system_tokens), tokens(16), tokens(args.long_doc_tokens)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    decode = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)

    def prompt(strategy: str) -> RAGPrompt:
        return RAGPrompt(system, [short, long], tokens(args.question_tokens),
                         position_strategy=strategy, recompute="none")

    def cold() -> float:
        llm.clear_chunk_cache()
        return llm.generate(prompt("shared"), one, use_tqdm=False)[0].metrics.ttft

    def warm(strategy: str, params) -> tuple[float, float]:
        out = llm.generate(prompt(strategy), params, use_tqdm=False)[0]
        m = out.metrics
        assert m.num_chunk_misses == 0
        steps = len(out.outputs[0].token_ids) - 1
        return m.ttft, (m.last_token_time - m.first_token_time) / max(steps, 1)

    cold()
    warm("sequential", one)
    cold_times, ttft = [], {"shared": [], "sequential": []}
    step = {"shared": [], "sequential": []}
    for _ in range(args.repeats):
        cold_times.append(cold())
        for strategy in ("shared", "sequential"):
            warm(strategy, one)
        for strategy in ("shared", "sequential"):
            ttft[strategy].append(warm(strategy, one)[0])
            step[strategy].append(warm(strategy, decode)[1])
    t_cold = statistics.median(cold_times)
    t_shared, t_seq = (statistics.median(ttft[k]) for k in ("shared", "sequential"))
    s_shared, s_seq = (statistics.median(step[k]) for k in ("shared", "sequential"))
    compute = t_cold - t_shared  # computing the two documents (16 + L tokens)

    # The route not taken: rotate the document's keys into request-owned slots, every layer.
    # (What the slots hold does not matter to the time: any two sets of free slots will do.)
    engine = llm.engine
    slots = engine.kv.allocator.alloc(2 * len(long))
    src, dst = torch.tensor(slots[:len(long)]), torch.tensor(slots[len(long):])
    cos, sin = engine.model.rotary.rotation([16])
    d = cos.shape[-1]

    def copy_rotated(with_v: bool) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for layer in range(engine.pool.num_layers):
                k = engine.pool.k[layer].index_select(0, src)
                engine.pool.k[layer].index_copy_(
                    0, dst, apply_rotary(k, cos.expand(len(k), d), sin.expand(len(k), d)))
                if with_v:
                    engine.pool.v[layer].index_copy_(
                        0, dst, engine.pool.v[layer].index_select(0, src))
        return time.perf_counter() - start

    copy_rotated(True)
    t_copy_k = statistics.median(copy_rotated(False) for _ in range(args.repeats))
    t_copy_kv = statistics.median(copy_rotated(True) for _ in range(args.repeats))
    engine.kv.allocator.free(slots)

    overhead, step_overhead = t_seq - t_shared, s_seq - s_shared
    length = args.long_doc_tokens
    print(f"re-positioning a {length}-token cached document by 16 positions "
          f"(S {args.system_tokens} + 16 + {length} + Q {args.question_tokens}):")
    print(f"  warm TTFT, keys where computed (shared)   {t_shared * 1000:8.2f} ms")
    print(f"  warm TTFT, keys rotated (sequential)      {t_seq * 1000:8.2f} ms   "
          f"re-positioning {overhead * 1000:+.2f} ms (target < 10 ms)")
    print(f"  decode step, shared / sequential          {s_shared * 1000:8.2f} / "
          f"{s_seq * 1000:.2f} ms   ({step_overhead * 1000:+.2f} ms per step)")
    print(f"  computing the documents (cold - warm)     {compute * 1000:8.1f} ms   "
          f"re-positioning / computing = {overhead / compute:.4f}")
    print(f"  rotated copy instead, K / K+V             {t_copy_k * 1000:8.1f} / "
          f"{t_copy_kv * 1000:.1f} ms per use (not used: ragkv rotates queries)")
    return {"long_doc_tokens": length, "warm_ttft_shared_s": t_shared,
            "warm_ttft_sequential_s": t_seq, "reposition_overhead_s": overhead,
            "decode_step_shared_s": s_shared, "decode_step_sequential_s": s_seq,
            "compute_documents_s": compute, "overhead_over_compute": overhead / compute,
            "rotated_copy_k_s": t_copy_k, "rotated_copy_kv_s": t_copy_kv}


if __name__ == "__main__":
    main()

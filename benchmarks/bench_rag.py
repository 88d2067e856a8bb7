"""Warm RAG time to first token against a full prefill of the same prompt, next to the FLOP
bound, measured side by side in one run.

The prompt: a system prompt, several documents and a question (default 64 + 4 x 512 + 32
tokens). "Full prefill" computes all of it (caches cleared before each run); "warm" runs with
every document already in the chunk cache, in a new order, with a new question, so only the
question is computed. The bound is the FLOP ratio of the two (full prefill FLOPs / question-
only FLOPs over the same context, DESIGN §5). HF transformers computing the same prompt with
the reference mask is timed alongside.

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--num-docs", type=int, default=4)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers run")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()

    from ragkv import LLM, RAGPrompt, SamplingParams
    from ragkv.bench.flops import rag_flop_bound
    from ragkv.bench.offline import reference_inputs
    from ragkv.bench.workload import BenchRequest

    llm = LLM(args.model, max_num_batched_tokens=4096)
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
    llm.check_integrity()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

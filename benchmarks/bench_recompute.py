"""Selective recompute: warm time to first token against the recompute ratio r, per method,
next to a full prefill of the same prompt and the FLOP bound of each point, measured side by
side in one run.

The prompt: a system prompt, several documents and a question (default 64 + 4 x 512 + 32
tokens, the shape of bench_rag.py). "Full prefill" is the ordinary prompt (the documents
concatenated, caches cleared before each run). Every recompute point runs warm in the
sequential layout: all documents in the chunk cache, in a new order, with a new question, so the
request computes its probe (blend, query), its recomputed chunk tokens and the question. The
bound of a point is full prefill FLOPs over that work's FLOPs (`bench/flops.py`:
`recompute_flops`, recomputed tokens spread evenly over the documents). Runs are interleaved
over the points, and the medians are reported. The engine's own recompute is off
(`recompute="none"`: its default, the quality mode, would recompute an adaptive budget), so
each point recomputes only what it names (a fixed budget of r), at the method's default
check layers, and the request that puts the documents in the cache recomputes nothing.

    python benchmarks/bench_recompute.py --model builtin:small
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch

RATIOS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
METHODS = ("blend", "sink", "query")


def main() -> None:
    from ragkv.bench.workload import add_bench_shape_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_shape_args(parser)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--ratios", default=",".join(str(r) for r in RATIOS))
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()

    from ragkv import LLM, RAGPrompt, SamplingParams
    from ragkv.bench.flops import full_prefill_flops, recompute_flops
    from ragkv.recompute.policy import check_layers_for

    # Sequential positions without a recompute of the engine's own: each point names its own.
    llm = LLM(args.model, max_num_batched_tokens=4096, position_strategy="sequential",
              recompute="none")
    mc = llm.engine.model_config
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, mc.vocab_size) for _ in range(n)]

    s, n, length, q = args.system_tokens, args.num_docs, args.doc_tokens, args.question_tokens
    system = tokens(s)
    docs = [tokens(length) for _ in range(n)]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    methods = [m for m in args.methods.split(",") if m]
    ratios = [float(r) for r in args.ratios.split(",") if r]
    points = [(m, r) for m in methods for r in ratios]

    def full() -> float:
        llm.clear_chunk_cache()
        llm.reset_prefix_cache()
        flat = system + [t for d in docs for t in d] + tokens(q)
        return llm.generate({"prompt_token_ids": flat}, one, use_tqdm=False)[0].metrics.ttft

    def warm(method: str, ratio: float) -> tuple[float, int]:
        order = docs[:]
        rng.shuffle(order)
        prompt = RAGPrompt(system, order, tokens(q), recompute=method, recompute_ratio=ratio)
        out = llm.generate(prompt, one, use_tqdm=False)[0]
        assert out.metrics.num_chunk_hits == n, "a document was not cached"
        return out.metrics.ttft, out.metrics.num_recomputed_tokens

    def populate() -> None:
        """Put every document in the chunk cache (after a full prefill cleared it)."""
        llm.generate(RAGPrompt(system, docs, tokens(q)), one, use_tqdm=False)

    full()
    populate()
    for point in points:  # warm-up: runs every code path once
        warm(*point)
    times: dict = {"full": []} | {p: [] for p in points}
    recomputed: dict = {}
    for _ in range(args.repeats):
        times["full"].append(full())
        populate()
        for point in points:
            t, count = warm(*point)
            times[point].append(t)
            recomputed[point] = count
    t_full = statistics.median(times["full"])
    f_full = full_prefill_flops(mc, s + n * length + q)
    check_layers = {m: check_layers_for(m, llm.engine.config.recompute_check_layers,
                                        mc.num_layers) for m in methods}
    rows = []
    print(f"prompt: system {s} + {n} x {length} documents + question {q}; model {args.model} "
          f"({mc.num_layers} layers), check layers "
          + ", ".join(f"{m} {check_layers[m]}" for m in methods if m != "sink")
          + f", {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"full prefill TTFT {t_full * 1e3:.1f} ms")
    print(f"{'method':<7} {'r':>5} {'tokens':>6} {'warm ms':>8} {'speedup':>8} {'bound':>7} "
          f"{'of bound':>8}")
    for method, ratio in points:
        t = statistics.median(times[(method, ratio)])
        probe = method if method in ("blend", "query") and 0 < ratio < 1 else None
        # The tokens it did recompute (sink alone takes ceil(r * len) of each chunk after the
        # first, fewer than r of them all).
        share = recomputed[(method, ratio)] / (n * length)
        bound = f_full / recompute_flops(mc, s, [length] * n, q, share, probe,
                                         max(check_layers[method]) + 1)
        row = {"method": method, "ratio": ratio,
               "check_layers": check_layers[method] if method != "sink" else None,
               "recomputed_tokens": recomputed[(method, ratio)],
               "warm_ttft_s": t, "speedup": t_full / t, "flop_bound": bound,
               "fraction_of_bound": (t_full / t) / bound}
        rows.append(row)
        print(f"{method:<7} {ratio:>5.2f} {row['recomputed_tokens']:>6} {t * 1e3:>8.1f} "
              f"{row['speedup']:>7.1f}x {bound:>6.1f}x {row['fraction_of_bound']:>8.0%}")
    llm.check_integrity()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"full_prefill_ttft_s": t_full, "points": rows,
                       "threads": torch.get_num_threads()}, f, indent=2)


if __name__ == "__main__":
    main()

"""Decode on the CPU, eager against compiled (`enable_torch_compile`), side by side in one
process on SmolLM2 with packed weights: tokens/s of plain prompts at batch 1, 4 and 8, and of
RAG answers (eval-suite items whose documents are cached and come back reordered, so decode
reads turned ranges) at batch 1 and 8; T(n + 1) - T(1) of `LLM.generate`, medians of
--repeats interleaved runs; and how many outputs are the same as the eager engine's. The
compiled engine compiles its two graphs at load (minutes on 2 cores the first time, seconds
from inductor's disk cache). With --speculative-config, two more engines draft from the
prompt (eager and compiled; a token and its drafts are verified in the compiled step too).

    python benchmarks/bench_compiled_decode.py
    python benchmarks/bench_compiled_decode.py --model builtin:small --quantization none
    python benchmarks/bench_compiled_decode.py --speculative-config \
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="gguf", choices=["gguf", "none"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help="also eager and compiled engines drafting with this config")
    args = parser.parse_args()

    import torch

    from ragkv import LLM, RAGPrompt, SamplingParams
    from ragkv.eval.suite import build_suite

    torch.set_num_threads(args.threads)
    common = dict(model=args.model, device="cpu", max_model_len=4096,
                  quantization=args.quantization)
    eager = LLM(**common)
    start = time.perf_counter()
    compiled = LLM(**common, enable_torch_compile=True)
    print(f"{args.model} ({args.quantization}): compiled engine loaded in "
          f"{time.perf_counter() - start:.0f} s")
    engines = {"eager": eager, "compiled": compiled}
    if args.speculative_config:
        spec = {"speculative_config": args.speculative_config}
        engines["eager+drafts"] = LLM(**common, **spec)
        engines["compiled+drafts"] = LLM(**common, enable_torch_compile=True, **spec)
    n = args.max_tokens

    def rate(llm, prompts) -> tuple[float, list[list[int]]]:
        def run(tokens: int):
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]

        first, _ = run(1)
        total, outs = run(n + 1)
        return len(prompts) * n / (total - first), outs

    def compare(name: str, make_prompts) -> None:
        rates: dict[str, list[float]] = {k: [] for k in engines}
        outs: dict[str, list[list[int]]] = {}
        for rep in range(args.repeats):
            for key, llm in engines.items():
                r, outs[key] = rate(llm, make_prompts(rep))
                rates[key].append(r)
        e = statistics.median(rates["eager"])
        cells = [f"{e:8.1f}"]
        for key in list(engines)[1:]:
            r = statistics.median(rates[key])
            same = sum(a == b for a, b in zip(outs["eager"], outs[key], strict=True))
            cells.append(f"{r:8.1f} {r / e:5.2f}x {same}/{len(outs['eager'])}")
        print(f"  {name:<34} " + "  ".join(cells), flush=True)

    print(f"\ndecode tok/s, {n} greedy tokens, medians of {args.repeats}; each engine's "
          "tok/s, its ratio to eager, its outputs the same as eager's:")
    print(f"  {'workload':<34} " + "  ".join(f"{k:>8}" if k == "eager" else f"{k:>20}"
                                              for k in engines))
    topics = ["cat", "dog", "ship", "tree", "robot", "king", "bird", "river"]
    for batch in (1, 4, 8):
        prompts = [f"Write a story about a {t}." for t in topics[:batch]]
        compare(f"plain, batch {batch}", lambda rep, prompts=prompts: prompts)
    items = [it for it in build_suite(16) if len(it.documents) >= 4][:8]

    def rag(batch: int, rep: int) -> list:
        return [RAGPrompt(system=f"{it.system}\n\n", question=it.question,
                          chunks=[f"{d}\n\n" for d in
                                  (it.documents[::-1] if rep % 2 else it.documents)])
                for it in items[:batch]]

    for llm in engines.values():  # the documents cached: later requests reorder them
        llm.generate(rag(8, 0), SamplingParams(max_tokens=1), use_tqdm=False)
    for batch in (1, 8):
        compare(f"RAG answers (turned), batch {batch}", lambda rep, b=batch: rag(b, rep))
    for llm in engines.values():
        llm.check_integrity()


if __name__ == "__main__":
    main()

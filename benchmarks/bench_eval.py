"""`ragkv eval` wall time: questions in flight together against one request at a time.

The same questions and modes run twice on one engine, first with `batch_size=1` (the eval as
it ran before batching: one request at a time), then batched; each run starts with the caches
cleared, so both compute the same chunks. Prints both times, their ratio, and whether the two
runs gave the same answers (batching changes only the order of float sums):

    python benchmarks/bench_eval.py --model smollm2-135m-instruct --questions 20 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--modes", default="full,chunk,sequential,standalone")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from ragkv import LLM
    from ragkv.eval.evaluate import evaluate, pick_items
    from ragkv.eval.suite import TASKS, build_suite

    llm = LLM(args.model)
    items = pick_items(build_suite(-(-args.questions // len(TASKS))), args.questions)
    modes = [m for m in args.modes.split(",") if m]
    runs = {}
    for batch in (1, args.batch_size):
        llm.reset_prefix_cache()
        llm.clear_chunk_cache()
        start = time.perf_counter()
        results = evaluate(llm, items, modes, max_tokens=args.max_tokens, progress=False,
                           batch_size=batch)
        runs[batch] = (time.perf_counter() - start, results)
    (alone, first), (batched, second) = runs[1], runs[args.batch_size]
    same = sum(a.prediction == b.prediction for a, b in zip(first, second, strict=True))
    report = {"model": args.model, "questions": len(items), "modes": modes,
              "requests": 2 * len(first), "one_at_a_time_s": round(alone, 3),
              f"batch_{args.batch_size}_s": round(batched, 3),
              "speedup": round(alone / batched, 2), "same_answers": same,
              "answers": len(first)}
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

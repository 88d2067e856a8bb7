"""The CPU linears of a forward pass with a few rows: BLAS's `x @ W.T` (F.linear) against
`W @ x.T`, each weight read once per pass (streamed from memory, as in a decode or a
speculative verification step), over a model's real weights. Decides
`model/layers.py: _SMALL_BATCH_ROWS`.

    python benchmarks/bench_small_matmul.py --model smollm2-135m-instruct
    python benchmarks/bench_small_matmul.py --model builtin:small
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ragkv import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--rows", default="1,2,4,6,8,12,16,32")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    model = LLM(args.model, max_model_len=2048).engine.runner.model
    weights = [m.weight for m in model.modules() if type(m).__name__ == "Linear"]
    weights.append(model.lm_head_weight() if hasattr(model, "lm_head_weight")
                   else next(p for n, p in model.named_parameters() if "lm_head" in n
                             or "embed" in n))
    rows = [int(r) for r in args.rows.split(",")]

    def one_pass(n: int, form: str) -> float:
        xs = [torch.randn(n, w.shape[1]) for w in weights]
        start = time.perf_counter()
        for w, x in zip(weights, xs, strict=True):
            if form == "x @ W.T":
                F.linear(x, w)
            else:
                torch.mm(w, x.t()).t().contiguous()
        return (time.perf_counter() - start) * 1000

    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.repeats):  # interleaved, so drift hits both forms alike
        for n in rows:
            for form in ("x @ W.T", "W @ x.T"):
                times.setdefault((n, form), []).append(one_pass(n, form))
    print(f"{args.model}: every linear once per pass, median of {args.repeats} passes (ms)\n")
    print("| rows | x @ W.T | W @ x.T |")
    print("| --- | --- | --- |")
    for n in rows:
        a, b = (statistics.median(times[(n, f)]) for f in ("x @ W.T", "W @ x.T"))
        print(f"| {n} | {a:.1f} | {b:.1f} |")


if __name__ == "__main__":
    main()

"""The sampler's cost per step on this machine, per batch size, vocabulary and settings.

Prints milliseconds per `sample()` call (median of repeats) for greedy, plain sampling,
top-k + top-p, and greedy with the three penalties (each row having generated 256 tokens after
a 4,288-token prompt, the warm RAG shape), on random logits. With `--compare FILE`, also times
the `sample()` of another version of ragkv/sampling.py side by side (the one before
counter-based noise took a `torch.Generator` per row), e.g.

    git show d089013:ragkv/sampling.py > /tmp/old_sampling.py
    python benchmarks/bench_sampler.py --compare /tmp/old_sampling.py
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
import time
from collections import Counter
from functools import partial

import torch

from ragkv.sampling.params import SamplingParams
from ragkv.sampling.penalties import TokenHistory
from ragkv.sampling.sampler import sample


def load(path: str):
    spec = importlib.util.spec_from_file_location("other_sampling", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["other_sampling"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def timed(fn, device: str, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()  # returns host lists: the transfer is inside
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 49152, 128256])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--compare", default=None, help="another sampling.py to time too")
    args = parser.parse_args()
    other = load(args.compare) if args.compare else None
    # The older sampler took one torch.Generator per row instead of seeds and steps.
    other_takes_generators = other is not None and "generators" in inspect.signature(
        other.sample).parameters
    settings = {"greedy": dict(temperature=0.0), "plain": dict(temperature=0.8),
                "top-k 50 + top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
                "greedy + penalties": dict(temperature=0.0, presence_penalty=0.5,
                                           frequency_penalty=0.5, repetition_penalty=1.1)}
    header = "| vocab | batch | settings | ms per call |" + (
        " other version | other / this |" if other else "")
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for vocab in args.vocab:
        for batch in args.batch:
            logits = torch.randn(batch, vocab, device=args.device)
            for name, kw in settings.items():
                params = [SamplingParams(seed=i, **kw) for i in range(batch)]
                keys = list(range(batch)), [7] * batch
                history = None
                if params[0].has_penalties:
                    gen = torch.Generator().manual_seed(0)
                    history = [TokenHistory(
                        Counter(torch.randint(vocab, (256,), generator=gen).tolist()),
                        torch.randint(vocab, (4288,), generator=gen).to(args.device))
                        for _ in range(batch)]
                ours = timed(partial(sample, logits, params, *keys, history), args.device,
                             args.repeats)
                line = f"| {vocab} | {batch} | {name} | {ours * 1e3:.2f} |"
                if other is not None and history is not None:
                    line += " – | – |"  # older versions had no penalties
                elif other is not None:
                    theirs_params = [other.SamplingParams(seed=i, **kw) for i in range(batch)]
                    if other_takes_generators:
                        gens = [torch.Generator(device=args.device).manual_seed(i)
                                for i in range(batch)]
                        call = partial(other.sample, logits, theirs_params, gens)
                    else:
                        call = partial(other.sample, logits, theirs_params, *keys)
                    theirs = timed(call, args.device, args.repeats)
                    line += f" {theirs * 1e3:.2f} | {theirs / ours:.2f} |"
                print(line, flush=True)


if __name__ == "__main__":
    main()

"""Tensor parallelism against one process, in one run: decode tokens/s and prefill time at
TP=1 and TP=2 on the same model, and what a decode step sends between the ranks.

    python benchmarks/bench_tp.py                                  # builtin:small, CPU
    python benchmarks/bench_tp.py --model smollm2-135m-instruct    # float32 dequantized

Communication per decode step (batch B, hidden size H, L layers, activations of E bytes):
two all-reduces per layer (after o_proj and after down) of B x H values, so 2L calls and
2L·B·H·E bytes reduced, plus one broadcast of the step's plan from rank 0 (its pickled size
is measured here). The all-reduce's time at that size is measured on its own too.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _allreduce_worker(rank: int, size: int, address: str, numel: int, reps: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=size)
    x = torch.ones(numel)
    for _ in range(10):
        dist.all_reduce(x)
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x)
    if rank == 0:
        out.put((time.perf_counter() - start) / reps)
    dist.destroy_process_group()


def allreduce_seconds(numel: int, size: int = 2, reps: int = 500) -> float:
    """Mean time of one gloo all-reduce of `numel` float32 values between `size` processes."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, size, address, numel, reps, out))
             for r in range(size)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join()
    return result


def measure(model: str, size: int, prompt_len: int, tokens: int, repeats: int) -> dict:
    from ragkv import LLM, SamplingParams

    llm = LLM(model, dtype="float32", quantization="none", tensor_parallel_size=size,
              kv_cache_tokens=8192, enable_prefix_caching=False, enable_chunk_cache=False)
    try:
        prompt = {"prompt_token_ids": list(range(100, 100 + prompt_len))}
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        many = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        llm.generate([prompt], many, use_tqdm=False)  # warm-up
        prefill, decode = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            t1 = time.perf_counter()
            out = llm.generate([prompt], many, use_tqdm=False)
            t2 = time.perf_counter()
            prefill.append(t1 - t0)
            decode.append((t2 - t1 - (t1 - t0)) / (tokens - 1))
        mc = llm.engine.model_config
        return {"size": size, "prefill_ms": 1e3 * statistics.median(prefill),
                "decode_ms": 1e3 * statistics.median(decode),
                "tokens": out[0].outputs[0].token_ids, "layers": mc.num_layers,
                "hidden": mc.hidden_size}
    finally:
        llm.engine.close()


def plan_bytes(model: str) -> int:
    """Pickled size of one batch-1 decode step's plan, as rank 0 broadcasts it."""
    from ragkv.cache.kv_manager import SeqKV
    from ragkv.model.executor import _SentWork

    work = _SentWork(SeqKV(row=1), [1234], [300], ((0, 301),), True, 1, 0, (), None, None)
    return len(pickle.dumps(("step", [(1, 300, [4567])], [work], [])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:small")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = [measure(args.model, size, args.prompt_len, args.tokens, args.repeats)
            for size in (1, 2)]
    one, two = rows
    layers, hidden = one["layers"], one["hidden"]
    reduce_s = allreduce_seconds(hidden)
    print(f"{args.model}: {layers} layers, hidden {hidden}; prompt {args.prompt_len} tokens, "
          f"{args.tokens} decoded, {os.cpu_count()} CPU cores, gloo")
    for r in rows:
        print(f"  TP={r['size']}: prefill {r['prefill_ms']:.1f} ms, decode "
              f"{r['decode_ms']:.2f} ms/token ({1e3 / r['decode_ms']:.1f} tok/s)")
    print(f"  TP=2 / TP=1: prefill {two['prefill_ms'] / one['prefill_ms']:.2f}x the time, "
          f"decode {two['decode_ms'] / one['decode_ms']:.2f}x; same tokens: "
          f"{one['tokens'] == two['tokens']}")
    print(f"  per decode step (batch 1): {2 * layers} all-reduces of {hidden} float32 values "
          f"({2 * layers * hidden * 4 / 1024:.1f} KiB), one gloo all-reduce "
          f"{reduce_s * 1e6:.0f} us here -> {2 * layers * reduce_s * 1e3:.2f} ms a step; the "
          f"step's plan {plan_bytes(args.model)} bytes pickled, broadcast once")


if __name__ == "__main__":
    main()

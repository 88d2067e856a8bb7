"""Sliding windows in the Triton attention kernels: a windowed layer against the same layer
without a window, measured side by side in one run.

A sliding layer's query sees only the keys less than `window` positions behind it; the
kernels skip a block of keys out of every query's window after reading only its positions.
So a long prefill's windowed layer should cost about (window + tile) / (prompt / 2) of a
full layer, and a decode step over a long list about window / list of the attention's K/V
reads. This prints both ratios and the bound they are held against:

    python benchmarks/bench_window.py                    # CUDA, Gemma-3-1B-like heads
    python benchmarks/bench_window.py --smoke            # CPU, Triton interpreter, tiny

Rows: `prefill` (one sequence of --tokens new tokens over its own list) and `decode` (a
batch of --batch sequences of --tokens entries, one query each), each with the window and
without; the outputs of both are checked against the torch backend first (on tiny shapes
with --smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

if "--smoke" in sys.argv:  # before Triton is imported: its interpreter runs CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ragkv.cache.kv_pool import KVPool  # noqa: E402
from ragkv.model.backends.base import AttentionBatch, AttentionMetadata  # noqa: E402
from ragkv.model.backends.torch_sdpa import TorchAttentionBackend  # noqa: E402
from ragkv.model.backends.triton_attention import TritonAttentionBackend  # noqa: E402


def batch_of(kind: str, tokens: int, batch: int, heads: int, kv_heads: int,
             window: int | None, pool: KVPool, device: torch.device) -> AttentionBatch:
    """`prefill`: one sequence, `tokens` new tokens at positions 0..; `decode`: `batch`
    sequences of `tokens` entries each (slots in order, positions 0..), one new token."""
    if kind == "prefill":
        lists = [torch.arange(1, tokens + 1, dtype=torch.int32, device=device)]
        q_lens = [tokens]
    else:
        lists = [torch.arange(1 + b * tokens, 1 + (b + 1) * tokens, dtype=torch.int32,
                              device=device) for b in range(batch)]
        q_lens = [1] * batch
    table = torch.zeros(len(lists) + 1, tokens, dtype=torch.int32, device=device)
    for i, slots in enumerate(lists):
        table[i + 1] = slots
        pool.pos[slots.long()] = torch.arange(tokens, dtype=torch.int32, device=device)
    q_starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    write = torch.cat([s[tokens - q:] for s, q in zip(lists, q_lens, strict=True)]).long()
    qpos = torch.cat([torch.arange(tokens - q, tokens, device=device) for q in q_lens])
    out = AttentionBatch(q_lens=q_lens, kv_lens=[tokens] * len(lists), q_starts=q_starts,
                         kv_indices=lists, write_slots=write, num_heads=heads,
                         num_kv_heads=kv_heads, table=table,
                         rows=list(range(1, len(lists) + 1)), prefix=[True] * len(lists))
    if window is not None:
        out.window, out.windowed = window, [tokens > window] * len(lists)
        out.query_positions, out.slot_positions = qpos, pool.pos
    return out


def time_ms(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of `fn` (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16, help="decode rows")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.window, args.batch, args.reps = 96, 24, 2, 1
        args.heads, args.kv_heads, args.head_dim = 4, 2, 32
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    slots = args.tokens * max(args.batch, 1) + 1
    pool = KVPool(1, slots, args.kv_heads, args.head_dim, dtype, device)
    pool.kv[:, :, 1:].normal_()
    scale = args.head_dim ** -0.5
    rows = []
    for kind in ("prefill", "decode"):
        n = args.tokens if kind == "prefill" else args.batch
        q = torch.randn(n, args.heads, args.head_dim, device=device, dtype=dtype)
        timings = {}
        for window in (args.window, None):
            batch = batch_of(kind, args.tokens, args.batch, args.heads, args.kv_heads, window,
                             pool, device)
            outs = []
            for backend in (TritonAttentionBackend(device), TorchAttentionBackend()):
                meta = AttentionMetadata(batch.write_slots, backend.prepare(batch))
                outs.append(backend.attend(q, 0, pool, meta, scale).float())
            err = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
            assert err < (1e-5 if dtype == torch.float32 else 2e-2), (kind, window, err)
            backend = TritonAttentionBackend(device)
            meta = AttentionMetadata(batch.write_slots, backend.prepare(batch))
            timings[window] = time_ms(lambda b=backend, m=meta, x=q: b.attend(x, 0, pool, m, scale),
                                      device, args.reps)
        if kind == "prefill":  # keys each query reads: window + a tile, or half the prompt
            bound = args.tokens / 2 / min(args.tokens / 2, args.window + 64)
        else:
            bound = args.tokens / min(args.tokens, args.window + 64)
        speedup = timings[None] / timings[args.window]
        rows.append(dict(kind=kind, tokens=args.tokens, window=args.window,
                         windowed_ms=timings[args.window], full_ms=timings[None],
                         speedup=speedup, read_bound=bound))
        print(f"{kind:8s} {args.tokens} tokens, window {args.window}: windowed "
              f"{timings[args.window]:.3f} ms, full {timings[None]:.3f} ms -> "
              f"{speedup:.2f}x faster (keys read: {bound:.1f}x fewer)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(torch.cuda.get_device_name() if device.type == "cuda"
                                      else "cpu"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

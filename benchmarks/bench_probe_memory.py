"""Peak memory of the selective-recompute probe against the chunk tokens it scores.

A `blend` probe runs every chunk token of a request through the first layers over the cached
KV. In one pass its attention materializes a [tokens, keys] mask and scores, which grows with
the square of the chunk tokens; the engine's probe takes the tokens through the layers a step
budget at a time and attends in row blocks, so its peak stays bounded whatever the length.
Each case runs in a fresh process (peak RSS, minus the process's RSS before the probe) on a
model of SmolLM2-135M's shape (hidden 576, 9 heads, 3 KV heads, head dim 64; the two layers a
`blend` probe at check layer 1 runs) with random weights and a KV pool of random values:

    python benchmarks/bench_probe_memory.py --tokens 2048 8192 32768
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch


def measure(tokens: int, one_pass: bool, budget: int) -> dict:
    """In this process: one blend probe over `tokens` chunk tokens; its peak RSS growth."""
    from ragkv.cache.kv_pool import KVPool
    from ragkv.model.llama import CausalLM
    from ragkv.model.model_config import ModelConfig
    from ragkv.recompute import probe as probe_module

    torch.manual_seed(0)
    torch.set_num_threads(2)
    system = 64
    mc = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=576,
                     intermediate_size=1536, num_layers=2, num_heads=9, num_kv_heads=3,
                     head_dim=64, rms_norm_eps=1e-5, rope={"rope_type": "default",
                                                           "rope_theta": 100000.0},
                     max_position_embeddings=tokens + system + 1, tie_word_embeddings=True)
    device = torch.device("cpu")
    model = CausalLM(mc, tokens + system + 1, torch.float32, device)
    for p in model.parameters():
        p.normal_(0, 0.02)
    pool = KVPool(2, tokens + system + 1, 3, 64, torch.float32, device)
    pool.kv.normal_()
    pool.zero_padding_slot()
    span = range(system, system + tokens)
    work = probe_module.ProbeWork(
        request=None, kind="blend", token_ids=torch.randint(0, 1024, (tokens,)).tolist(),
        positions=list(span), key_positions=list(span),
        kv_slots=list(range(1, system + tokens + 1)), turns=(), chunks=(system, system + tokens),
        check_layers=(1,), block_tokens=(1 << 30) if one_pass else budget)
    if one_pass:  # no row blocks either: the attention of all tokens in one call
        probe_module._BLOCK_ELEMENTS = 1 << 62
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scores = work.run(model, pool)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"tokens": tokens, "one_pass": one_pass, "peak_mb": (after - before) / 1024,
            "finite": bool(torch.isfinite(scores).all())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--skip-one-pass-above", type=int, default=16384,
                        help="the one-pass probe's mask alone is tokens^2 bytes: skip it above")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        tokens, one_pass = json.loads(args.child)
        print(json.dumps(measure(tokens, one_pass, args.budget)))
        return
    print(f"blend probe, check layer 1, step budget {args.budget} tokens; peak RSS growth")
    for tokens in args.tokens:
        for one_pass in (True, False):
            if one_pass and tokens > args.skip_one_pass_above:
                print(f"  {tokens:>6} chunk tokens, one pass:  skipped (over "
                      f"--skip-one-pass-above)")
                continue
            out = subprocess.run(
                [sys.executable, __file__, "--budget", str(args.budget), "--child",
                 json.dumps([tokens, one_pass])], capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            kind = "one pass" if one_pass else "blocked "
            print(f"  {tokens:>6} chunk tokens, {kind}: {got['peak_mb']:8.0f} MB"
                  f"{'' if got['finite'] else '  (non-finite scores!)'}")


if __name__ == "__main__":
    main()

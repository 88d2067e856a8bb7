"""Engine speed against HF transformers on the same weights, measured side by side in one run.

- prefill: time to first token of a long prompt (default 2,000 tokens), ragkv's whole
  `generate` call against one HF forward (sdpa attention) over the same tokens;
- decode: tokens/s at batch 1 and 8, from T(N) - T(1) (the time of N generated tokens minus
  the time of one), for ragkv's `generate` and HF `generate` with its KV cache alike.

Runs alternate between ragkv and HF; the ratio reported is the median of the per-pair
ratios, so slow drifts of the machine's speed (large on a shared VM) hit both sides alike.

    python benchmarks/bench_engine.py --model builtin:small
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _summary(ragkv: list[float], hf: list[float]) -> tuple[float, float, float]:
    """Medians of both sides and the median of the per-pair ratios ragkv / HF."""
    ratio = statistics.median(a / b for a, b in zip(ragkv, hf, strict=True))
    return statistics.median(ragkv), statistics.median(hf), ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--decode-prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()

    from ragkv import LLM, SamplingParams
    from ragkv.model.loader import load_hf_model

    llm = LLM(args.model, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, args.prompt_tokens))
    hf = load_hf_model(args.model)
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    results: dict[str, float] = {"threads": torch.get_num_threads()}

    long_prompt = prompt(args.prompt_tokens)
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def ragkv_prefill():
        llm.generate({"prompt_token_ids": long_prompt}, one, use_tqdm=False)

    def hf_prefill():
        with torch.inference_mode():
            hf(torch.tensor([long_prompt]), logits_to_keep=1)

    ragkv_prefill(), hf_prefill()  # warm-up
    r_times, h_times = [], []
    for _ in range(args.repeats):
        r_times.append(_timed(ragkv_prefill))
        h_times.append(_timed(hf_prefill))
    r, h, ratio = _summary(r_times, h_times)
    results.update(prefill_ragkv_s=r, prefill_hf_s=h, prefill_ratio=ratio)
    print(f"prefill {args.prompt_tokens} tokens: ragkv {r * 1000:.0f} ms, HF sdpa "
          f"{h * 1000:.0f} ms, ratio ragkv/HF = {ratio:.3f} (target <= 1.1)")

    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [prompt(args.decode_prompt_tokens) for _ in range(batch)]
        ids = torch.tensor(prompts)

        def ragkv_run(n: int, prompts=prompts):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

        def hf_run(n: int, ids=ids):
            with torch.inference_mode():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                            min_new_tokens=n, do_sample=False, pad_token_id=0)

        n = args.decode_tokens
        ragkv_run(4), hf_run(4)  # warm-up
        def rate(run, n=n, batch=batch) -> float:
            return batch * (n - 1) / (_timed(lambda: run(n)) - _timed(lambda: run(1)))

        r_rates, h_rates = [], []
        for _ in range(args.repeats):
            r_rates.append(rate(ragkv_run))
            h_rates.append(rate(hf_run))
        r, h, ratio = _summary(r_rates, h_rates)
        results.update({f"decode_bs{batch}_ragkv_tok_s": r, f"decode_bs{batch}_hf_tok_s": h,
                        f"decode_bs{batch}_ratio": ratio})
        print(f"decode batch {batch}: ragkv {r:.1f} tok/s, HF generate {h:.1f} tok/s, "
              f"ratio ragkv/HF = {ratio:.2f} (target >= 1.0)")
    llm.check_integrity()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

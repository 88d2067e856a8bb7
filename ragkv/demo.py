"""`ragkv demo`: a short RAG workload in which documents recur in different orders.

Prints cold vs warm time to first token and the chunk-cache hit rate, then recomputes every
answer with the chunk cache (and prefix cache) off and checks the tokens are identical: reuse
is exact, not an approximation.
"""

from __future__ import annotations

import random
import statistics
from importlib import resources

from .llm import LLM
from .prompt import RAGPrompt
from .sampling import SamplingParams

SYSTEM = "You are a careful assistant. Answer the question using only the documents given."
QUESTIONS = [
    "What do these documents have in common?",
    "Which document mentions a number, and what is it?",
    "Summarise the second document in one sentence.",
    "What would a beginner find hardest here?",
    "Which claim in these documents is the most surprising?",
    "List three facts stated in the documents.",
    "How would you explain this to a child?",
    "What question do the documents leave open?",
]


def demo_documents(num_docs: int = 6) -> list[str]:
    """Paragraphs of the text shipped with the built-in tokenizer, used as documents."""
    text = resources.files("ragkv.model").joinpath("data/builtin_corpus.txt").read_text("utf-8")
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 700]
    step = max(1, len(paragraphs) // num_docs)
    return [p[:1500] for p in paragraphs[::step][:num_docs]]


def run_demo(model: str = "builtin:small", num_requests: int = 8, max_tokens: int = 12) -> int:
    docs = demo_documents()
    rng = random.Random(0)
    requests = []
    for i in range(num_requests):
        picked = [docs[(i + k * 2) % len(docs)] for k in range(3)]
        rng.shuffle(picked)
        requests.append(RAGPrompt(SYSTEM, picked, " " + QUESTIONS[i % len(QUESTIONS)]))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    if model.startswith("builtin:"):
        print(f"Model {model}: a built-in model with RANDOM weights (its answers are "
              "gibberish); every cache and code path is real.\n")
    llm = LLM(model)
    tokenizer = llm.get_tokenizer()
    print(f"{len(docs)} documents of {min(len(tokenizer.encode(d)) for d in docs)}-"
          f"{max(len(tokenizer.encode(d)) for d in docs)} tokens; {num_requests} requests of "
          "3 documents each, in varying orders, one at a time.\n")
    print(f"{'req':>3}  {'docs (order)':<14} {'chunk hits':>10} {'cached tok':>10} "
          f"{'prompt tok':>10} {'TTFT ms':>9}")
    rows = []
    for i, prompt in enumerate(requests):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        m = out.metrics
        order = ",".join(str(docs.index(c)) for c in prompt.chunks)
        hits = f"{m.num_chunk_hits}/{m.num_chunk_hits + m.num_chunk_misses}"
        print(f"{i:>3}  {order:<14} {hits:>10} {out.num_cached_tokens:>10} "
              f"{len(out.prompt_token_ids):>10} {m.ttft * 1000:>9.1f}")
        rows.append((m.num_chunk_misses == 0, m.ttft, out.outputs[0].token_ids))
    stats = llm.get_chunk_cache_stats()
    llm.check_integrity()

    cold = [ttft for warm, ttft, _ in rows if not warm]
    warm = [ttft for is_warm, ttft, _ in rows if is_warm]
    print()
    print(f"chunk cache: {stats.hits} hits / {stats.lookups} lookups "
          f"(hit rate {stats.hit_rate:.0%}), {stats.cached_chunks} chunks cached, "
          f"{stats.used_tokens} tokens")
    if cold and warm:
        c, w = statistics.mean(cold), statistics.mean(warm)
        print(f"TTFT: cold {c * 1000:.1f} ms (mean of {len(cold)}), warm {w * 1000:.1f} ms "
              f"(mean of {len(warm)}), speedup {c / w:.1f}x")

    print("\nChecking exactness: the same prompts with the chunk cache and prefix cache off...")
    reference = LLM(model, enable_chunk_cache=False, enable_prefix_caching=False)
    ref_outs = reference.generate(requests, params, use_tqdm=False)
    same = sum(r.outputs[0].token_ids == tokens for r, (_, _, tokens) in zip(ref_outs, rows,
                                                                              strict=True))
    print(f"{same}/{len(rows)} answers identical token for token.")
    return 0 if same == len(rows) else 1

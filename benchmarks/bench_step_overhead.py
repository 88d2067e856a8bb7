"""Host-side cost of an engine step, without the model: scheduling, slot tables, attention
metadata, sampling, detokenization and outputs.

The model is replaced by a stub that returns zero logits, so what is timed is everything the
engine does around it, which must not grow with a request's context or output length:
- context: B requests decoding at context C (C = 1k ... 32k), per-step ms;
- output: B streaming requests (include_unfinished=True, as the server runs), per-step ms over
  their first and last steps as their outputs grow to N tokens;
- warm RAG: one request of a 128-token system prompt, 8 cached 512-token chunks in a new
  order and a new 64-token question (shared positions, no recompute: exact chunk reuse), one
  output token, through `LLM.generate` (ms per request: everything the host does before and
  after the model's one step, which on a GPU the device waits for; the backend's metadata is
  left out too, since a CUDA graph replaces it there).
- warm RAG as text: the same request shape sent as text (`system ## doc ## ... ## question`,
  the built-in tokenizer, or --text-model's), side by side with the tokenizer cache on (the
  default) and off: the documents' tokenization is host work of every request unless cached.
The first two print the ratio largest/smallest: ~1 means the per-step cost is flat.

    python benchmarks/bench_step_overhead.py
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch

from ragkv import LLM, SamplingParams


def tiny_checkpoint(path: str, max_positions: int) -> str:
    """The built-in tiny model's shape with a long position range (random weights)."""
    import transformers

    from ragkv.model.builtin import save_builtin_tokenizer

    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=4096, max_position_embeddings=max_positions,
        bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    save_builtin_tokenizer(path)
    return path


def stub_model(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size

    def forward(input_ids, positions, logits_rows, *args, **kwargs):
        return torch.zeros(len(logits_rows), vocab)

    llm.engine.runner.model = forward


def warm_rag_engine(path: str, **kwargs) -> LLM:
    """An engine for the warm RAG scenarios: the model and the backend's attention metadata
    stubbed out (a CUDA graph replaces the metadata on a GPU). Shared positions, no recompute:
    a warm request computes its question only (the quality mode's probe and recomputed chunk
    tokens are model work, not the host work timed here)."""
    llm = LLM(path, max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=8192,
              position_strategy="shared", chunk_separator="##", **kwargs)
    stub_model(llm)
    llm.engine.runner.backend.prepare = lambda meta: None
    return llm


def context_scenario(path: str, batch: int, contexts: list[int], steps: int) -> list[float]:
    per_step = []
    for ctx in contexts:
        llm = LLM(path, kv_cache_tokens=batch * (ctx + steps + 8), max_model_len=ctx + steps + 8,
                  max_num_seqs=batch, max_num_batched_tokens=65536, enable_chunk_cache=False,
                  enable_prefix_caching=False)
        stub_model(llm)
        engine = llm.engine
        params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
        gen = torch.Generator().manual_seed(ctx)
        for i in range(batch):
            ids = torch.randint(10, 4096, (ctx,), generator=gen).tolist()
            engine.add_request({"prompt_token_ids": ids}, params, request_id=str(i))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in
                  list(engine.scheduler.running) + list(engine.scheduler.waiting)):
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step(include_unfinished=True)
            times.append(time.perf_counter() - start)
        per_step.append(1000 * statistics.median(times))
        print(f"  batch {batch}, context {ctx:>6}: {per_step[-1]:8.2f} ms per decode step")
        del llm, engine
    return per_step


def output_scenario(path: str, batch: int, tokens: int, window: int) -> tuple[float, float]:
    llm = LLM(path, kv_cache_tokens=batch * (tokens + 64), max_model_len=tokens + 64,
              max_num_seqs=batch, enable_chunk_cache=False)
    stub_model(llm)
    engine = llm.engine
    # Random tokens: stub logits are all zero, so sampled tokens follow the seeded generator.
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True,
                            stop=["this stop string never appears"])
    for i in range(batch):
        engine.add_request(f"Story number {i}:", params, request_id=str(i))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step(include_unfinished=True)
        times.append(time.perf_counter() - start)
    first = 1000 * statistics.median(times[5:5 + window])
    last = 1000 * statistics.median(times[-window - 1:-1])
    print(f"  batch {batch}, output tokens {5:>4}-{5 + window:<4}: {first:8.2f} ms per step")
    print(f"  batch {batch}, output tokens {tokens - window}-{tokens}: {last:8.2f} ms per step")
    return first, last


def rag_scenario(path: str, requests: int) -> float:
    from ragkv import RAGPrompt

    llm = warm_rag_engine(path)
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 4096, (n,), generator=gen).tolist()

    system, docs = ids(128), [ids(512) for _ in range(8)]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for _ in range(requests + 20):  # the first 20 compute and cache the chunks, then warm up
        order = [docs[j] for j in torch.randperm(8, generator=gen).tolist()]
        prompt = RAGPrompt(system, order, ids(64))
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    per_request = 1000 * statistics.median(times[20:])
    print(f"  warm RAG request, 128 + 8 x 512 + 64 tokens: {per_request:8.3f} ms per request")
    return per_request


def rag_text_scenario(path: str, requests: int) -> tuple[float, float]:
    """ms per warm text request with the tokenizer cache on and off, alternating requests
    between the two engines so that both see the same machine."""
    from ragkv.entrypoints.demo_corpus import DOCUMENTS

    engines = {mb: warm_rag_engine(path, tokenizer_cache_mb=mb) for mb in (64, 0)}
    tok = engines[64].get_tokenizer()
    words = " ".join(DOCUMENTS).split()
    rng = random.Random(0)

    def text(tokens: int) -> str:
        """Corpus words from a random place, cut to `tokens` tokens."""
        start = rng.randrange(len(words))
        piece = " ".join((words * (2 + tokens // len(words)))[start:start + tokens])
        return " " + tok.decode(tok.encode(piece, add_special_tokens=False)[:tokens]).strip()

    system, docs = text(128), [text(512) for _ in range(8)]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times: dict[int, list[float]] = {64: [], 0: []}
    for i in range(requests + 20):  # the first 20 cache the chunks, then warm up
        order = docs[:]
        rng.shuffle(order)
        prompt = "##".join([system, *order, text(64)])
        for mb, llm in engines.items():
            start = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            if i >= 20:
                times[mb].append(time.perf_counter() - start)
    on, off = (1000 * statistics.median(times[mb]) for mb in (64, 0))
    print(f"  warm RAG request as text, tokenizer cache off: {off:8.3f} ms per request")
    print(f"  warm RAG request as text, tokenizer cache on:  {on:8.3f} ms per request "
          f"({off / on:.1f}x less host work)")
    return on, off


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stream-batch", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=4096)
    parser.add_argument("--rag-requests", type=int, default=200)
    parser.add_argument("--text-model", default=None,
                        help="the model whose tokenizer the text scenario uses (e.g. "
                             "smollm2-135m-instruct; default: the tiny model's built-in one)")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_checkpoint(os.path.join(tmp, "tiny"), max(contexts) + args.output_tokens
                               + 256)
        print("decode step against context length (model stubbed out):")
        ctx = context_scenario(path, args.batch, contexts, args.steps)
        print("streaming step against output length (model stubbed out):")
        first, last = output_scenario(path, args.stream_batch, args.output_tokens, 50)
        print("warm RAG request, host work only (model and attention metadata stubbed out):")
        rag_scenario(path, args.rag_requests)
        print("warm RAG request sent as text (model and attention metadata stubbed out):")
        rag_text_scenario(args.text_model or path, args.rag_requests // 2)
    print(f"ratio context {contexts[-1]} / {contexts[0]}: {ctx[-1] / ctx[0]:.2f}")
    print(f"ratio output at {args.output_tokens} / at start: {last / first:.2f}")


if __name__ == "__main__":
    main()

"""Offline benchmark: the same request stream through each cache strategy in one process.

- `none`: prefix cache and chunk cache off; each prompt is the flat S + documents + Q, an
  ordinary prompt: a full prefill every time;
- `prefix`: the same ordinary prompts with the prefix cache on: what vLLM and SGLang reuse
  (an identical prefix);
- `chunk`: ragkv: RAG prompts with the chunk cache and the prefix cache on.

Requests run one at a time, so time to first token measures computation, not queueing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from ..inputs.prompt import RAGPrompt
from ..llm import LLM
from ..model.loader import inspect_checkpoint
from ..recompute.selection import probe_plan
from ..sampling.params import SamplingParams
from .flops import full_prefill_flops, probe_flops, rag_flop_bound, recompute_flops
from .workload import BenchRequest, WorkloadConfig, make_workload

MODES = {
    "none": {"enable_chunk_cache": False, "enable_prefix_caching": False},
    "prefix": {"enable_chunk_cache": False, "enable_prefix_caching": True},
    "chunk": {"enable_chunk_cache": True, "enable_prefix_caching": True},
}


@dataclass(frozen=True, slots=True)
class RequestRecord:
    ttft: float
    e2e: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    chunk_hits: int
    chunk_misses: int
    recomputed_tokens: int
    chunk_tokens: int


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"),
                "mean": float("nan")}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99),
            "mean": statistics.fmean(ordered)}


def _prompt(req: BenchRequest, mode: str):
    if mode == "chunk":
        return RAGPrompt(req.system, req.chunks, req.question)
    return {"prompt_token_ids": req.token_ids}


def run_mode(model: str, mode: str, requests: list[BenchRequest], config: WorkloadConfig,
             engine_kwargs: dict, progress: bool = True) -> dict:
    llm = LLM(model, **{**engine_kwargs, **MODES[mode]})
    params = SamplingParams(max_tokens=config.output_tokens, temperature=0.0, ignore_eos=True)
    # Warm up kernels on a same-shaped request of other tokens, then start from empty caches.
    vocab = llm.engine.model_config.vocab_size
    warmup = make_workload(WorkloadConfig(**{**config.to_dict(), "num_requests": 2,
                                             "seed": config.seed + 1}), vocab)
    llm.generate([_prompt(r, mode) for r in warmup], params, use_tqdm=False)
    llm.clear_chunk_cache()
    llm.reset_prefix_cache()
    stats0, chunks0 = llm.engine.stats(), llm.get_chunk_cache_stats()
    records: list[RequestRecord] = []
    start = time.perf_counter()
    for req in tqdm(requests, desc=f"mode {mode}", disable=not progress, leave=False):
        out = llm.generate(_prompt(req, mode), params, use_tqdm=False)[0]
        m = out.metrics
        records.append(RequestRecord(
            ttft=m.ttft, e2e=m.e2e_latency, prompt_tokens=len(out.prompt_token_ids),
            output_tokens=len(out.outputs[0].token_ids), cached_tokens=out.num_cached_tokens,
            chunk_hits=m.num_chunk_hits, chunk_misses=m.num_chunk_misses,
            recomputed_tokens=m.num_recomputed_tokens,
            chunk_tokens=sum(map(len, req.chunks)) if mode == "chunk" else 0))
    duration = time.perf_counter() - start
    llm.check_integrity()
    stats1, chunks1 = llm.engine.stats(), llm.get_chunk_cache_stats()
    prefix_queried = stats1.prefix_queried_tokens - stats0.prefix_queried_tokens
    prefix_hits = stats1.prefix_hit_tokens - stats0.prefix_hit_tokens
    lookups = chunks1.lookups - chunks0.lookups
    chunk_hits = chunks1.hits - chunks0.hits
    warm = [r.ttft for r in records if r.chunk_misses == 0 and r.chunk_hits > 0]
    output_tokens = sum(r.output_tokens for r in records)
    chunk_tokens = sum(r.chunk_tokens for r in records)
    return {
        "mode": mode,
        # The engine's default RAG layout and recompute, which the chunk mode's prompts get.
        "rag_default": llm.engine.describe_rag_default(),
        "recomputed_fraction": (sum(r.recomputed_tokens for r in records) / chunk_tokens
                                if chunk_tokens else 0.0),
        # (scorer, check layers) of the probes of the default recompute; None: none.
        "probes": _default_probes(llm),
        "requests": len(records),
        "duration_s": duration,
        "ttft_s": percentiles([r.ttft for r in records]),
        "e2e_s": percentiles([r.e2e for r in records]),
        "warm_ttft_s": percentiles(warm),
        "num_warm_requests": len(warm),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration,
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "cached_tokens": sum(r.cached_tokens for r in records),
        "prefix_cache": {
            "queried_tokens": prefix_queried,
            "hit_tokens": prefix_hits,
            "hit_rate": prefix_hits / prefix_queried if prefix_queried else 0.0,
        },
        "chunk_cache": {
            "lookups": lookups, "hits": chunk_hits, "misses": chunks1.misses - chunks0.misses,
            "hit_rate": chunk_hits / lookups if lookups else 0.0,
            "hit_tokens": chunks1.hit_tokens - chunks0.hit_tokens,
            "evictions": chunks1.evictions - chunks0.evictions,
            "request_hits": sum(r.chunk_hits for r in records),
            "request_misses": sum(r.chunk_misses for r in records),
        },
    }


def _default_probes(llm: LLM) -> list[tuple[str, list[int]]] | None:
    settings = llm.engine.recompute_settings()
    if settings["position_strategy"] != "sequential" or settings["recompute"] == "none":
        return None
    return [(kind, list(layers)) for kind, layers in
            probe_plan(settings["recompute"], settings["recompute_check_layers"])]


def run_hf(model: str, requests: list[BenchRequest], progress: bool = True) -> dict:
    """HF transformers computing the same prompts with ragkv's semantics (the reference's
    4-D mask and position ids): a full prefill per request, time to first token only."""
    import torch

    from ..model.loader import load_hf_model

    hf = load_hf_model(model)
    times = []
    for req in tqdm(requests, desc="HF transformers", disable=not progress, leave=False):
        ids, positions, mask = reference_inputs(req)
        start = time.perf_counter()
        with torch.inference_mode():
            logits = hf(input_ids=ids, position_ids=positions, attention_mask=mask,
                        logits_to_keep=1).logits
            int(logits[0, -1].argmax())
        times.append(time.perf_counter() - start)
    return {"mode": "hf", "requests": len(times), "ttft_s": percentiles(times)}


def reference_inputs(req: BenchRequest):
    """Input ids, position ids and the 4-D additive mask of a RAG prompt (chunks share the
    positions after S and see only S and themselves; the question sees everything)."""
    import torch

    s = len(req.system)
    lens = [len(c) for c in req.chunks]
    total = s + sum(lens) + len(req.question)
    visible = torch.zeros(total, total, dtype=torch.bool)
    visible[:s, :s] = torch.ones(s, s, dtype=torch.bool).tril()
    positions = list(range(s))
    start = s
    for n in lens:
        visible[start:start + n, :s] = True
        visible[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        positions += range(s, s + n)
        start += n
    q = len(req.question)
    visible[start:, :start] = True
    visible[start:, start:] = torch.ones(q, q, dtype=torch.bool).tril()
    positions += range(s + max(lens), s + max(lens) + q)
    mask = torch.zeros(total, total).masked_fill(~visible, float("-inf"))
    return (torch.tensor([req.token_ids]), torch.tensor([positions]), mask[None, None])


def run_offline(model: str, modes: list[str], config: WorkloadConfig, engine_kwargs: dict,
                compare_hf: bool = False, progress: bool = True) -> dict:
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    results: dict = {"model": model, "workload": config.to_dict(), "modes": {}}
    mc = inspect_checkpoint(model).model_config
    requests = make_workload(config, mc.vocab_size)
    for mode in modes:
        results["modes"][mode] = run_mode(model, mode, requests, config, engine_kwargs, progress)
    if "chunk" in results["modes"]:
        # The chunk mode's prompts take the engine's default layout (--position-strategy,
        # --chunk-attention, --recompute...): the quality mode unless told otherwise.
        chunk = results["modes"]["chunk"]
        results["layout"] = chunk["rag_default"]
        results["recomputed_fraction"] = chunk["recomputed_fraction"]
    chunk_lens = [config.doc_tokens] * config.docs_per_request
    bound = rag_flop_bound(mc, config.system_tokens, chunk_lens, config.question_tokens)
    if "chunk" in results["modes"] and results["modes"]["chunk"]["probes"] is not None:
        # The chunk mode recomputes: its bound counts the recomputed tokens (their measured
        # share, spread over the documents) and its probes.
        chunk = results["modes"]["chunk"]
        s, q, total = config.system_tokens, config.question_tokens, sum(chunk_lens)
        work = recompute_flops(mc, s, chunk_lens, q, chunk["recomputed_fraction"], None)
        work += sum(probe_flops(mc, s, total, q, kind, max(layers) + 1, chunk_lens[0])
                    for kind, layers in chunk["probes"])
        bound = full_prefill_flops(mc, s + total + q) / work
    results["flop_bound"] = bound
    chunk, none = results["modes"].get("chunk"), results["modes"].get("none")
    if chunk and none and chunk["num_warm_requests"]:
        speedup = none["ttft_s"]["p50"] / chunk["warm_ttft_s"]["p50"]
        results["warm_speedup_vs_none"] = speedup
        results["fraction_of_bound"] = speedup / bound
    for other in ("none", "prefix"):
        if chunk and other in results["modes"]:
            results[f"p50_ttft_ratio_{other}_over_chunk"] = (
                results["modes"][other]["ttft_s"]["p50"] / chunk["ttft_s"]["p50"])
    if compare_hf:
        results["modes"]["hf"] = run_hf(model, requests, progress)
    return results


def format_table(results: dict) -> str:
    ms = 1000.0
    lines = [
        f"model {results['model']}; workload {results['workload']}",
        *([f"chunk mode layout: {results['layout']}; recomputed "
           f"{results['recomputed_fraction']:.1%} of the chunk tokens"]
          if "layout" in results else []),
        f"{'mode':<7} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'E2E p50':>9} {'out tok/s':>10} "
        f"{'prefix hit':>10} {'chunk hit':>9} {'warm TTFT p50':>14}",
    ]
    for mode, f in results["modes"].items():
        t = f["ttft_s"]
        if mode == "hf":
            lines.append(f"{'hf':<7} {t['p50'] * ms:>7.1f}ms {t['p90'] * ms:>6.1f}ms "
                         f"{t['p99'] * ms:>6.1f}ms {'(prefill only, shared layout)':>30}")
            continue
        warm = f["warm_ttft_s"]["p50"]
        warm_text = f"{warm * ms:.1f}ms ({f['num_warm_requests']})" if f["num_warm_requests"] \
            else "-"
        lines.append(
            f"{mode:<7} {t['p50'] * ms:>7.1f}ms {t['p90'] * ms:>6.1f}ms {t['p99'] * ms:>6.1f}ms "
            f"{f['e2e_s']['p50'] * ms:>7.1f}ms {f['output_tokens_per_s']:>10.1f} "
            f"{f['prefix_cache']['hit_rate']:>10.1%} {f['chunk_cache']['hit_rate']:>9.1%} "
            f"{warm_text:>14}")
    lines.append(f"FLOP bound for a warm request: {results['flop_bound']:.1f}x")
    if "warm_speedup_vs_none" in results:
        lines.append(f"warm chunk TTFT vs none p50: {results['warm_speedup_vs_none']:.1f}x "
                     f"({results['fraction_of_bound']:.0%} of the bound)")
    for other in ("none", "prefix"):
        key = f"p50_ttft_ratio_{other}_over_chunk"
        if key in results:
            lines.append(f"p50 TTFT {other} / chunk: {results[key]:.1f}x")
    return "\n".join(lines)


def plot_ttft(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib (pip install 'ragkv[plot]')") from e
    modes = [m for m in results["modes"] if m != "hf"]
    fig, ax = plt.subplots(figsize=(6, 4))
    p50 = [results["modes"][m]["ttft_s"]["p50"] * 1000 for m in modes]
    p90 = [results["modes"][m]["ttft_s"]["p90"] * 1000 for m in modes]
    x = range(len(modes))
    ax.bar([i - 0.2 for i in x], p50, width=0.4, label="p50")
    ax.bar([i + 0.2 for i in x], p90, width=0.4, label="p90")
    ax.set_xticks(list(x), modes)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"TTFT per mode, {results['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

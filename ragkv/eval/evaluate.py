"""`ragkv eval`: RAG answer quality of each mode against full prefill, on a trained model.

For every question of the suite (`suite.py`) and every mode (`modes.py`), two requests run on
one engine, several questions (every mode of each) in flight at once (`batch_size`):
- a greedy generation: the answer (accuracy by normalized match) and its time to first token;
- a teacher-forced scoring of the gold answer appended to the question
  (`Engine.add_request(score_tokens=...)`): the gold answer's log-likelihood, and the
  next-token distributions at every gold position, compared with the `full` mode's at the same
  positions (mean KL(full || mode), top-1 agreement of the answer's first token).
Accuracy is noisy on a small model; the log-likelihood and KL move smoothly with quality.
Batching changes only the order of floating-point sums (a request's outputs depend on its own
prompt, not on its neighbours) and the TTFTs, which are then queueing times: timings come from
the benchmarks, or from `batch_size=1`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from ..inputs.prompt import ChunkedPrompt, RAGPrompt, parse_prompt
from ..llm import LLM
from ..sampling.params import SamplingParams
from .modes import REFERENCE, get_mode
from .suite import TASKS, EvalItem, is_correct


def question_prompt(engine, system: str, documents: Sequence[str], question: str,
                    cache_salt: str | None = None) -> ChunkedPrompt:
    """A RAG question as a prompt: a chat model's own template (`process_chat`, the documents
    after the system message); a base model (its tokenizer has no chat template) gets plain
    text whose answer lead-in a completion model continues: the system line, each document
    after a blank line, then "Question: ...\nAnswer:"."""
    if getattr(engine.tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": question}]
        return engine.process_chat(messages, documents=list(documents), cache_salt=cache_salt)
    prompt = RAGPrompt(system=f"{system}\n\n", chunks=[f"{d}\n\n" for d in documents],
                       question=f"Question: {question}\nAnswer:", cache_salt=cache_salt)
    return parse_prompt(prompt, engine.tokenizer, engine.inputs.rules, engine.token_cache)


@dataclass(frozen=True, slots=True)
class EvalResult:
    """One question in one mode. `kl` and `top1_agree` compare with the reference mode
    (None for the reference itself); `warm` means every document's KV came from the cache."""

    item_id: str
    task: str
    mode: str
    prediction: str
    correct: bool
    gold_logprob: float  # sum over the gold answer's tokens, natural log
    gold_tokens: int
    kl: float | None  # mean over the gold positions of KL(reference || mode), nats
    top1_agree: bool | None  # same most likely first answer token as the reference
    ttft: float  # seconds
    warm: bool
    # Chunk tokens the generation recomputed, over all its chunk tokens (None: no chunks,
    # as in `full`).
    recomputed_fraction: float | None = None


def pick_items(items: Sequence[EvalItem], limit: int | None) -> list[EvalItem]:
    """At most `limit` items, taken round-robin over the tasks so each stays represented."""
    if limit is None or limit >= len(items):
        return list(items)
    by_task = {t: [i for i in items if i.task == t] for t in TASKS}
    picked: list[EvalItem] = []
    depth = 0
    while len(picked) < limit:
        for task in TASKS:
            if depth < len(by_task[task]) and len(picked) < limit:
                picked.append(by_task[task][depth])
        depth += 1
    return picked


def _run(llm: LLM, prompt: object, params: SamplingParams, score_tokens: int = 0):
    """One request alone on the engine, to its end."""
    return _run_all(llm, [(prompt, params, score_tokens)], 1)[0]


def _run_all(llm: LLM, jobs: Sequence[tuple[object, SamplingParams, int]],
             in_flight: int) -> list:
    """Each job (prompt, params, score_tokens) as a request, at most `in_flight` at once, in
    order; the finished outputs in the jobs' order. A failed request is a RuntimeError (after
    the others are aborted, so the engine is left idle)."""
    engine = llm.engine
    results: list = [None] * len(jobs)
    index: dict[str, int] = {}
    following = 0
    try:
        while following < len(jobs) or index:
            while following < len(jobs) and len(index) < in_flight:
                prompt, params, score_tokens = jobs[following]
                index[engine.add_request(prompt, params, score_tokens=score_tokens)] = following
                following += 1
            for out in engine.step():
                if out.finished and out.request_id in index:
                    if out.error is not None:
                        raise RuntimeError(f"eval request failed: {out.error}")
                    results[index.pop(out.request_id)] = out
    finally:
        for rid in index:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return results


def evaluate(llm: LLM, items: Sequence[EvalItem], mode_names: Sequence[str],
             max_tokens: int = 32, progress: bool = True,
             batch_size: int = 8) -> list[EvalResult]:
    """Every item in the reference mode and each other mode, `batch_size` items at a time
    (each with its generation and scoring requests in every mode in flight together)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    names = [REFERENCE] + [m for m in mode_names if m != REFERENCE]
    modes = [get_mode(m, llm.engine) for m in names]
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    generate = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    score = SamplingParams(max_tokens=1, temperature=0.0)
    results: list[EvalResult] = []
    bar = tqdm(total=len(items) * len(modes), desc="ragkv eval", disable=not progress,
               dynamic_ncols=True)
    try:
        for first in range(0, len(items), batch_size):
            batch = items[first:first + batch_size]
            golds, jobs = [], []
            for item in batch:
                prompt = question_prompt(engine, item.system, item.documents, item.question)
                gold = tokenizer.encode(item.answer, add_special_tokens=False)
                golds.append((gold, sum(map(len, prompt.chunks))))
                for mode in modes:
                    # Rows 0..k-1 of the scoring predict the k gold tokens (row 0: after the
                    # question).
                    jobs.append((mode.build(prompt, []), generate, 0))
                    jobs.append((mode.build(prompt, gold), score, len(gold) + 1))
            # One question at a time runs one request at a time: TTFTs without queueing.
            outs = iter(_run_all(llm, jobs, len(jobs) if batch_size > 1 else 1))
            for item, (gold, chunk_tokens) in zip(batch, golds, strict=True):
                reference_rows = None
                for mode in modes:
                    answer, scored = next(outs), next(outs)
                    rows = scored.score_logprobs[:len(gold)]
                    gold_logprob = float(rows[torch.arange(len(gold)), torch.tensor(gold)].sum())
                    kl = agree = None
                    if mode.name == REFERENCE:
                        reference_rows = rows
                    else:
                        kl = float((reference_rows.exp() * (reference_rows - rows)).sum(-1)
                                   .mean())
                        agree = bool(rows[0].argmax() == reference_rows[0].argmax())
                    metrics = answer.metrics
                    text = answer.outputs[0].text
                    recomputed = None
                    if mode.name != REFERENCE and chunk_tokens:
                        recomputed = metrics.num_recomputed_tokens / chunk_tokens
                    results.append(EvalResult(
                        item_id=item.id, task=item.task, mode=mode.name, prediction=text,
                        correct=is_correct(text, item), gold_logprob=gold_logprob,
                        gold_tokens=len(gold), kl=kl, top1_agree=agree, ttft=metrics.ttft,
                        warm=metrics.num_chunk_hits > 0 and metrics.num_chunk_misses == 0,
                        recomputed_fraction=recomputed,
                    ))
                    bar.update(1)
    finally:
        bar.close()
    return results


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of an accuracy of `correct` out of `n` (sound at 0 and n,
    unlike the normal approximation)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, center - half), min(1.0, center + half)


def _group(results: list[EvalResult]) -> dict:
    n = len(results)
    compared = [r for r in results if r.kl is not None]
    warm = [r.ttft for r in results if r.warm]
    tokens = sum(r.gold_tokens for r in results)
    return {
        "n": n,
        "correct": sum(r.correct for r in results),
        "accuracy": sum(r.correct for r in results) / n,
        "accuracy_ci95": wilson_interval(sum(r.correct for r in results), n),
        "gold_logprob": sum(r.gold_logprob for r in results) / n,
        "gold_logprob_per_token": sum(r.gold_logprob for r in results) / tokens,
        "kl": sum(r.kl for r in compared) / len(compared) if compared else None,
        "top1_agreement": (sum(r.top1_agree for r in compared) / len(compared)
                           if compared else None),
        "ttft_ms_p50": statistics.median(r.ttft for r in results) * 1e3,
        "warm_requests": len(warm),
        "warm_ttft_ms_p50": statistics.median(warm) * 1e3 if warm else None,
        **_recomputed(results),
    }


def _recomputed(results: list[EvalResult]) -> dict:
    """The mean and the 10th, 50th and 90th percentiles of the recomputed fraction."""
    fractions = sorted(r.recomputed_fraction for r in results
                       if r.recomputed_fraction is not None)
    if not fractions:
        return {"recomputed_mean": None, "recomputed_p10_p50_p90": None}

    def at(q: float) -> float:
        return fractions[min(len(fractions) - 1, int(q * len(fractions)))]

    return {"recomputed_mean": sum(fractions) / len(fractions),
            "recomputed_p10_p50_p90": (at(0.1), at(0.5), at(0.9))}


def agreement(results: list[EvalResult], mode: str) -> dict | None:
    """Per question, whether the reference and `mode` answered correctly: the paired counts
    behind a difference in accuracy (None for the reference itself)."""
    if mode == REFERENCE:
        return None
    ref = {r.item_id: r.correct for r in results if r.mode == REFERENCE}
    pairs = [(ref[r.item_id], r.correct) for r in results
             if r.mode == mode and r.item_id in ref]
    return {"both": sum(a and b for a, b in pairs),
            "reference_only": sum(a and not b for a, b in pairs),
            "mode_only": sum(b and not a for a, b in pairs),
            "neither": sum(not a and not b for a, b in pairs)}


def summarize(results: list[EvalResult]) -> dict:
    """Per mode: overall and per task figures (see `_group`), and the paired agreement counts
    with the reference, in the modes' run order."""
    summary: dict[str, dict] = {}
    for mode in dict.fromkeys(r.mode for r in results):
        rows = [r for r in results if r.mode == mode]
        tasks = [t for t in TASKS if any(r.task == t for r in rows)]
        summary[mode] = {
            "overall": _group(rows),
            "by_task": {t: _group([r for r in rows if r.task == t]) for t in tasks},
            "agreement": agreement(results, mode),
        }
    return summary


def report_json(results: list[EvalResult], summary: dict, meta: dict) -> dict:
    return {**meta, "summary": summary, "items": [asdict(r) for r in results]}


def format_summary(summary: dict) -> str:
    """One table: a row per mode and task (overall last)."""
    width = max(8, *map(len, summary))
    head = (f"{'mode':<{width}} {'task':<14} {'n':>4} {'acc':>6} {'95% CI':>13} {'gold LL':>8} "
            f"{'LL/tok':>7} {'KL':>7} {'top1':>6} {'recomp':>6} {'TTFT ms':>8}")
    lines = [head, "-" * len(head)]

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for mode, data in summary.items():
        groups = list(data["by_task"].items()) + [("overall", data["overall"])]
        for task, g in groups:
            ttft = g["warm_ttft_ms_p50"] if g["warm_ttft_ms_p50"] is not None else g["ttft_ms_p50"]
            lo, hi = g["accuracy_ci95"]
            lines.append(
                f"{mode:<{width}} {task:<14} {g['n']:>4} {g['accuracy']:>6.1%} "
                f"{f'{lo:.0%}-{hi:.0%}':>13} "
                f"{g['gold_logprob']:>8.3f} {g['gold_logprob_per_token']:>7.3f} "
                f"{fmt(g['kl'], '7.4f'):>7} {fmt(g['top1_agreement'], '6.1%'):>6} "
                f"{fmt(g['recomputed_mean'], '6.1%'):>6} "
                f"{ttft:>8.1f}")
    for mode, data in summary.items():
        if data.get("agreement"):
            a = data["agreement"]
            lines.append(f"{mode}: per question vs {REFERENCE}: both correct {a['both']}, "
                         f"{REFERENCE} only {a['reference_only']}, {mode} only "
                         f"{a['mode_only']}, neither {a['neither']}")
    lines.append("TTFT: median over requests whose documents were all cached (warm) where "
                 "there are any, else over all")
    return "\n".join(lines)


def plot_summary(summary: dict, path: str) -> None:
    """Accuracy and gold log-likelihood per task, one bar per mode (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from e
    modes = list(summary)
    tasks = list(next(iter(summary.values()))["by_task"]) + ["overall"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        groups = {**summary[mode]["by_task"], "overall": summary[mode]["overall"]}
        xs = [i + j * width for i in range(len(tasks))]
        axes[0].bar(xs, [groups[t]["accuracy"] for t in tasks], width, label=mode)
        axes[1].bar(xs, [groups[t]["gold_logprob_per_token"] for t in tasks], width, label=mode)
    for ax, title in zip(axes, ("answer accuracy", "gold answer log-likelihood per token"),
                         strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], tasks, rotation=20)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)

"""`ragkv eval`: RAG answer quality of each mode against full prefill, on a trained model.

For every question of the suite (`suite.py`) and every mode (`modes.py`), two requests run
one at a time on one engine:
- a greedy generation: the answer (accuracy by normalized match) and its time to first token;
- a teacher-forced scoring of the gold answer appended to the question
  (`Engine.add_request(score_tokens=...)`): the gold answer's log-likelihood, and the
  next-token distributions at every gold position, compared with the `full` mode's at the same
  positions (mean KL(full || mode), top-1 agreement of the answer's first token).
Accuracy is noisy on a small model; the log-likelihood and KL move smoothly with quality.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from ..llm import LLM
from ..sampling.params import SamplingParams
from .modes import REFERENCE, get_mode
from .suite import TASKS, EvalItem, is_correct


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
    engine = llm.engine
    rid = engine.add_request(prompt, params, score_tokens=score_tokens)
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                result = out
    if result is None or result.error is not None:
        raise RuntimeError(f"eval request failed: {result.error if result else 'no output'}")
    return result


def evaluate(llm: LLM, items: Sequence[EvalItem], mode_names: Sequence[str],
             max_tokens: int = 32, progress: bool = True) -> list[EvalResult]:
    """Run every item in the reference mode first, then in each other mode."""
    names = [REFERENCE] + [m for m in mode_names if m != REFERENCE]
    modes = [get_mode(m) for m in names]
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    generate = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    score = SamplingParams(max_tokens=1, temperature=0.0)
    results: list[EvalResult] = []
    bar = tqdm(total=len(items) * len(modes), desc="ragkv eval", disable=not progress,
               dynamic_ncols=True)
    try:
        for item in items:
            messages = [{"role": "system", "content": item.system},
                        {"role": "user", "content": item.question}]
            prompt = engine.process_chat(messages, documents=list(item.documents))
            gold = tokenizer.encode(item.answer, add_special_tokens=False)
            reference_rows = None
            for mode in modes:
                answer = _run(llm, mode.build(prompt, []), generate)
                # Rows 0..k-1 predict the k gold tokens (row 0: after the question).
                scored = _run(llm, mode.build(prompt, gold), score, score_tokens=len(gold) + 1)
                rows = scored.score_logprobs[:len(gold)]
                gold_logprob = float(rows[torch.arange(len(gold)), torch.tensor(gold)].sum())
                kl = agree = None
                if mode.name == REFERENCE:
                    reference_rows = rows
                else:
                    kl = float((reference_rows.exp() * (reference_rows - rows)).sum(-1).mean())
                    agree = bool(rows[0].argmax() == reference_rows[0].argmax())
                metrics = answer.metrics
                text = answer.outputs[0].text
                results.append(EvalResult(
                    item_id=item.id, task=item.task, mode=mode.name, prediction=text,
                    correct=is_correct(text, item), gold_logprob=gold_logprob,
                    gold_tokens=len(gold), kl=kl, top1_agree=agree, ttft=metrics.ttft,
                    warm=metrics.num_chunk_hits > 0 and metrics.num_chunk_misses == 0,
                ))
                bar.update(1)
    finally:
        bar.close()
    return results


def _group(results: list[EvalResult]) -> dict:
    n = len(results)
    compared = [r for r in results if r.kl is not None]
    warm = [r.ttft for r in results if r.warm]
    tokens = sum(r.gold_tokens for r in results)
    return {
        "n": n,
        "correct": sum(r.correct for r in results),
        "accuracy": sum(r.correct for r in results) / n,
        "gold_logprob": sum(r.gold_logprob for r in results) / n,
        "gold_logprob_per_token": sum(r.gold_logprob for r in results) / tokens,
        "kl": sum(r.kl for r in compared) / len(compared) if compared else None,
        "top1_agreement": (sum(r.top1_agree for r in compared) / len(compared)
                           if compared else None),
        "ttft_ms_p50": statistics.median(r.ttft for r in results) * 1e3,
        "warm_requests": len(warm),
        "warm_ttft_ms_p50": statistics.median(warm) * 1e3 if warm else None,
    }


def summarize(results: list[EvalResult]) -> dict:
    """Per mode: overall and per task figures (see `_group`), in the modes' run order."""
    summary: dict[str, dict] = {}
    for mode in dict.fromkeys(r.mode for r in results):
        rows = [r for r in results if r.mode == mode]
        tasks = [t for t in TASKS if any(r.task == t for r in rows)]
        summary[mode] = {
            "overall": _group(rows),
            "by_task": {t: _group([r for r in rows if r.task == t]) for t in tasks},
        }
    return summary


def report_json(results: list[EvalResult], summary: dict, meta: dict) -> dict:
    return {**meta, "summary": summary, "items": [asdict(r) for r in results]}


def format_summary(summary: dict) -> str:
    """One table: a row per mode and task (overall last)."""
    width = max(8, *map(len, summary))
    head = (f"{'mode':<{width}} {'task':<14} {'n':>4} {'acc':>6} {'gold LL':>8} {'LL/tok':>7} "
            f"{'KL':>7} {'top1':>6} {'TTFT ms':>8}")
    lines = [head, "-" * len(head)]

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for mode, data in summary.items():
        groups = list(data["by_task"].items()) + [("overall", data["overall"])]
        for task, g in groups:
            ttft = g["warm_ttft_ms_p50"] if g["warm_ttft_ms_p50"] is not None else g["ttft_ms_p50"]
            lines.append(
                f"{mode:<{width}} {task:<14} {g['n']:>4} {g['accuracy']:>6.1%} "
                f"{g['gold_logprob']:>8.3f} {g['gold_logprob_per_token']:>7.3f} "
                f"{fmt(g['kl'], '7.4f'):>7} {fmt(g['top1_agreement'], '6.1%'):>6} "
                f"{ttft:>8.1f}")
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

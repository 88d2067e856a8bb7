"""`ragkv calibrate`: the cheapest selective-recompute setting that keeps a model's answers.

Runs a calibration split of the eval suite (its own suite seed, so its documents and questions
are not those `ragkv eval` reports) in `full`, `sequential` and each candidate recompute mode
(`METHOD@RATIO` or `METHOD@LOW:HIGH:MASS`, modes.py), and measures for each:
- **gap closed**: the share of the gold-answer log-likelihood gap between `sequential` and
  `full` that it closes;
- **accuracy within noise** of `full`: per question, the questions only `full` answers exceed
  those only the candidate answers by no more than 1.96 x sqrt(their sum) (McNemar's test at
  5%, the noise of a paired comparison);
- **cost**: the mean fraction of chunk tokens recomputed, plus what the probe costs in the same
  unit (`blend` takes every chunk token through its probe layers: probe layers / depth;
  `query` probes only the question's tokens: counted as 0).
A candidate meets the target when it closes at least `target` of the gap and its accuracy is
within noise; the cheapest such one is chosen (ties: the larger gap closed). When none meets
it, answers come first (`choose`) and the profile says the target was not met. The profile
(recompute/profile.py) keeps the chosen settings and the whole measured curve.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .. import __version__
from ..llm import LLM
from ..recompute.policy import check_layers_for, configured_layers
from ..recompute.profile import FORMAT, VERSION
from ..recompute.selection import probe_plan
from .evaluate import EvalResult, evaluate, pick_items, summarize
from .modes import PRIMED, REFERENCE, get_mode, recompute_mode_settings
from .suite import TASKS, build_suite

# The calibration split: a suite seed `ragkv eval` does not use by default (eval's is 0).
CALIBRATION_SEED = 1009
DEFAULT_TARGET = 0.9
# Candidates: fixed ratios of each scorer, and adaptive budgets (LOW:HIGH:MASS).
# The query probe's attention is concentrated: on SmolLM2-135M a mass of 0.6-0.75 is held by
# 5-10% of the chunk tokens, so its adaptive candidates ask for 0.9 and more.
QUICK_CANDIDATES = (
    "blend@0.15", "blend@0.3", "blend@0.5", "query@0.15", "query@0.3", "query@0.5",
    "sink+query@0.3", "query@0.1:0.5:0.9", "query@0.15:0.6:0.95", "blend@0.1:0.6:0.8",
)
CANDIDATES = QUICK_CANDIDATES + (
    "blend@0.1", "blend@0.2", "query@0.1", "query@0.2", "query@0.7", "sink+query@0.15",
    "sink+query@0.5", "sink+blend@0.3", "query@0.1:0.7:0.95", "query@0.2:0.7:0.97",
    "blend@0.1:0.7:0.9",
)
QUICK_QUESTIONS = 60
QUESTIONS = 250


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One candidate's measured figures (accuracy as a fraction; gold LL in nats)."""

    mode: str
    settings: dict
    accuracy: float
    accuracy_ci95: tuple[float, float]
    gold_logprob: float
    gap_closed: float
    kl: float
    top1_agreement: float
    recomputed_mean: float
    probe_cost: float
    cost: float
    reference_only: int
    mode_only: int
    within_noise: bool
    meets_target: bool


def within_noise(reference_only: int, mode_only: int) -> bool:
    """Whether the candidate is not significantly less accurate than the reference (McNemar's
    test at 5% on the discordant questions)."""
    return reference_only - mode_only <= 1.96 * math.sqrt(reference_only + mode_only)


def mode_settings(name: str, num_layers: int, layers: tuple[int, ...] | None,
                  primer: str | None = None) -> dict:
    """The engine settings (EngineConfig fields) of the recompute mode `name`, with the check
    layers its scorer probes on this model, and `primer` (the engine's chunk primer) for a
    `+primer` mode."""
    primed = name.endswith(PRIMED)
    settings = recompute_mode_settings(name.removesuffix(PRIMED))
    if primed:
        settings["chunk_primer"] = primer
    method = settings["recompute"]
    if method != "sink":
        settings["recompute_check_layers"] = list(check_layers_for(method, layers,
                                                                   num_layers))
    return settings


def curve(results: list[EvalResult], candidates: Sequence[str], num_layers: int,
          candidate_layers: dict[str, tuple[int, ...] | None], target: float,
          primer: str | None = None) -> list[CurvePoint]:
    """Each candidate's point from the eval results (which hold `full` and `sequential`);
    `candidate_layers`: each candidate's configured check layers (None: its scorer's
    default); `primer`: the engine's chunk primer, which `+primer` candidates ran with."""
    summary = summarize(results)
    full = summary[REFERENCE]["overall"]["gold_logprob"]
    sequential = summary["sequential"]["overall"]["gold_logprob"]
    gap = full - sequential
    points = []
    for name in candidates:
        data = summary[name]
        g, agree = data["overall"], data["agreement"]
        settings = mode_settings(name, num_layers, candidate_layers[name], primer)
        closed = (g["gold_logprob"] - sequential) / gap if gap > 0 else 1.0
        probe = 0.0
        for kind, layers in probe_plan(settings["recompute"],
                                       settings.get("recompute_check_layers")):
            if kind == "blend":  # every chunk token through its layers
                probe += (max(layers) + 1) / num_layers
        quiet = within_noise(agree["reference_only"], agree["mode_only"])
        points.append(CurvePoint(
            mode=name, settings=settings, accuracy=g["accuracy"],
            accuracy_ci95=tuple(g["accuracy_ci95"]), gold_logprob=g["gold_logprob"],
            gap_closed=closed, kl=g["kl"], top1_agreement=g["top1_agreement"],
            recomputed_mean=g["recomputed_mean"], probe_cost=probe,
            cost=g["recomputed_mean"] + probe, reference_only=agree["reference_only"],
            mode_only=agree["mode_only"], within_noise=quiet,
            meets_target=quiet and closed >= target))
    return points


def choose(points: Sequence[CurvePoint]) -> CurvePoint:
    """The cheapest point meeting the target (ties: more of the gap closed). When none does,
    answers come first: among the points whose accuracy is within noise of full, the one
    closing the most of the gap; when there is none, the most accurate (ties: cheaper). (The
    gold likelihood alone can mislead: a point may close all of the gap and still answer
    worse.)"""
    meeting = [p for p in points if p.meets_target]
    if meeting:
        return min(meeting, key=lambda p: (p.cost, -p.gap_closed))
    quiet = [p for p in points if p.within_noise]
    if quiet:
        return max(quiet, key=lambda p: (p.gap_closed, -p.cost))
    return max(points, key=lambda p: (p.accuracy, -p.cost))


def calibrate(llm: LLM, model_name: str, target: float = DEFAULT_TARGET, quick: bool = False,
              candidates: Sequence[str] | None = None, num_questions: int | None = None,
              suite_seed: int = CALIBRATION_SEED, max_tokens: int = 32, batch_size: int = 8,
              progress: bool = True) -> dict:
    """Measure the candidates on the calibration split and return the profile (a dict for
    recompute/profile.py's `write_profile`)."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    candidates = list(candidates or (QUICK_CANDIDATES if quick else CANDIDATES))
    for name in candidates:
        if "@" not in name:
            raise ValueError(f"calibration candidate {name!r} is not a recompute mode "
                             "(METHOD@RATIO or METHOD@LOW:HIGH:MASS, +primer after either)")
        get_mode(name)  # a clear error before anything runs
    primer = llm.engine.config.chunk_primer
    if primer in (None, "none") and any(n.endswith(PRIMED) for n in candidates):
        raise ValueError("+primer candidates need an engine with a chunk primer "
                         "(--chunk-primer)")
    n = num_questions or (QUICK_QUESTIONS if quick else QUESTIONS)
    per_task = math.ceil(n / len(TASKS))
    items = pick_items(build_suite(per_task, seed=suite_seed), n)
    engine = llm.engine
    num_layers = engine.model_config.num_layers
    # The check layers each candidate probes, as the engine applies them.
    configured = {name: configured_layers(
        engine.config, recompute_mode_settings(name.removesuffix(PRIMED))["recompute"],
        engine.inputs.layers_for_all) for name in candidates}
    start = time.monotonic()
    results = evaluate(llm, items, ["sequential", *candidates], max_tokens=max_tokens,
                       progress=progress, batch_size=batch_size)
    points = curve(results, candidates, num_layers, configured, target, primer)
    chosen = choose(points)
    summary = summarize(results)
    return {
        "format": FORMAT, "version": VERSION,
        "model": model_name, "model_fingerprint": engine.checkpoint.fingerprint,
        "num_layers": num_layers,
        "settings": chosen.settings,
        "chosen": chosen.mode,
        "meets_target": chosen.meets_target,
        "target": {"gap_closed": target, "accuracy": "within noise of full (McNemar, 5%)"},
        "reference": {name: {k: summary[name]["overall"][k]
                             for k in ("accuracy", "accuracy_ci95", "gold_logprob")}
                      for name in (REFERENCE, "sequential")},
        "curve": [asdict(p) for p in points],
        "calibration": {"suite_seed": suite_seed, "questions": len(items), "quick": quick,
                        "max_tokens": max_tokens, "dtype": str(engine.dtype),
                        "seconds": round(time.monotonic() - start, 1),
                        "ragkv_version": __version__},
    }


def format_curve(profile: dict) -> str:
    """The measured curve as a table, the chosen point marked."""
    ref = profile["reference"]
    lines = [f"full: accuracy {ref['full']['accuracy']:.1%}, gold LL "
             f"{ref['full']['gold_logprob']:.3f}; sequential: accuracy "
             f"{ref['sequential']['accuracy']:.1%}, gold LL "
             f"{ref['sequential']['gold_logprob']:.3f} "
             f"({profile['calibration']['questions']} questions, suite seed "
             f"{profile['calibration']['suite_seed']})",
             f"{'mode':<22} {'acc':>6} {'gap':>6} {'KL':>7} {'recomp':>7} {'cost':>6} "
             f"{'full/mode only':>15} meets"]
    for p in profile["curve"]:
        mark = " <- chosen" if p["mode"] == profile["chosen"] else ""
        lines.append(f"{p['mode']:<22} {p['accuracy']:>6.1%} {p['gap_closed']:>6.0%} "
                     f"{p['kl']:>7.4f} {p['recomputed_mean']:>7.1%} {p['cost']:>6.1%} "
                     f"{p['reference_only']:>7}/{p['mode_only']:<7} "
                     f"{'yes' if p['meets_target'] else 'no'}{mark}")
    verdict = ("meets" if profile["meets_target"] else "no candidate meets")
    lines.append(f"target: {profile['target']['gap_closed']:.0%} of the gold-LL gap closed, "
                 f"accuracy within noise of full; {verdict} it")
    return "\n".join(lines)

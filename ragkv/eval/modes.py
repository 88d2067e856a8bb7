"""How `ragkv eval` lays out one question's prompt in each mode: one registry, so a new
attention or position mode (sequential positions, selective recompute) is one entry.
Selective recompute is a family of modes named `METHOD@RATIO` (e.g. `blend@0.15`,
`sink+query@0.1`): the sequential layout with that method recomputing that fraction, or
`METHOD@LOW:HIGH:MASS` with an adaptive budget; `/DAMPING` after either damps the stale
chunk tokens (`query@0.2/1`). `+primer` after a sequential-isolated mode (`sequential+primer`,
`query@0.2+primer`, `calibrated+primer`) computes every document after the first after S
and the engine's chunk primer (inputs/primer.py).

Every mode gets the same tokens: the chat prompt split into S, chunks and Q by
`Engine.process_chat` (documents after the system message). Modes differ only in what the
model computes over them, so any difference in the answers is the cost of that mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..config import check_adaptive, check_damping, check_recompute
from ..inputs.prompt import ChunkedPrompt, RAGPrompt


@dataclass(frozen=True, slots=True)
class EvalMode:
    """`build(prompt, tail)` is the engine prompt of `prompt` with `tail` tokens appended to
    the question (the gold answer, when scoring it teacher-forced)."""

    name: str
    description: str
    build: Callable[[ChunkedPrompt, list[int]], object]
    primable: bool = False  # sequential-isolated: `+primer` applies


# The suffix of a mode whose later documents are computed after the chunk primer.
PRIMED = "+primer"


def primed_mode(base: EvalMode) -> EvalMode:
    """`base` (sequential-isolated) with every document after the first computed after S and
    the engine's chunk primer."""
    if not base.primable:
        raise ValueError(f"eval mode {base.name + PRIMED!r}: the chunk primer applies to "
                         "sequential-isolated modes (sequential, METHOD@..., calibrated)")
    return EvalMode(base.name + PRIMED,
                    f"{base.description}; later documents computed after the chunk primer",
                    lambda p, tail: replace(base.build(p, tail), chunk_primer=True))


def engine_primer(names: Sequence[str], given: str | None) -> str | None:
    """The engine's chunk primer for these modes: `given`, else the built-in one when a mode
    asks for it (else None: the profile's, if any)."""
    if given is None and any(n.endswith(PRIMED) for n in names):
        return "default"
    return given


def _full(p: ChunkedPrompt, tail: list[int]) -> object:
    flat = list(p.system) + [t for c in p.chunks for t in c] + list(p.question) + tail
    return {"prompt_token_ids": flat}


def _layout(position_strategy: str, chunk_attention: str, **recompute: object
            ) -> Callable[[ChunkedPrompt, list[int]], object]:
    # A layout mode names its recompute: none unless given, never the engine's default.
    # Nor the engine's chunk primer: `+primer` modes ask for it.
    recompute.setdefault("recompute", "none")

    recompute.setdefault("chunk_primer", False)

    def build(p: ChunkedPrompt, tail: list[int]) -> object:
        return RAGPrompt(system=list(p.system), chunks=[list(c) for c in p.chunks],
                         question=list(p.question) + tail, cache_salt=p.cache_salt,
                         position_strategy=position_strategy, chunk_attention=chunk_attention,
                         **recompute)

    return build


def recompute_mode(name: str) -> EvalMode:
    """The mode `METHOD@RATIO`: sequential-isolated chunk reuse recomputing RATIO of the chunk
    tokens chosen by METHOD (config.RECOMPUTE_METHODS); `METHOD@LOW:HIGH:MASS` gives it an
    adaptive budget: the fewest top-scored tokens holding MASS of the probe's scores, between
    LOW and HIGH of the chunk tokens. Scoring appends the gold answer to the question; the
    engine's query probe leaves scored tokens out, so the choice is the same as for the
    generation. `/DAMPING` after the budget lowers the question's and the answer's attention
    logits of the stale chunk tokens by DAMPING (config.py: recompute_damping)."""
    settings = recompute_mode_settings(name)
    method, high = settings["recompute"], settings["recompute_ratio"]
    if "recompute_score_mass" not in settings:
        description = f"recompute={method} of {high:g} of the chunk tokens"
    else:
        description = (f"recompute={method} of the fewest chunk tokens holding "
                       f"{settings['recompute_score_mass']:g} of the scores, "
                       f"{settings['recompute_min_ratio']:g} to {high:g} of them")
    if settings.get("recompute_damping"):
        description += f", stale tokens damped by {settings['recompute_damping']:g}"
    return EvalMode(name, f"sequential-isolated reuse, {description}",
                    _layout("sequential", "isolated", **settings), primable=True)


def recompute_mode_settings(name: str) -> dict:
    """The request settings (RAGPrompt fields) of the recompute mode `name`, checked:
    `recompute` and `recompute_ratio`, and for an adaptive budget `recompute_min_ratio` and
    `recompute_score_mass`; with `/DAMPING`, `recompute_damping`."""
    method, _, budget = name.partition("@")
    budget, slash, damping = budget.partition("/")
    extra = {}
    if slash:
        try:
            extra["recompute_damping"] = float(damping)
        except ValueError:
            raise ValueError(f"eval mode {name!r}: after '/' comes a damping "
                             "(query@0.2/1)") from None
        check_damping(extra["recompute_damping"])
    try:
        numbers = [float(x) for x in budget.split(":")]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 3):
        raise ValueError(f"eval mode {name!r}: after '@' comes a ratio (blend@0.15) or "
                         "LOW:HIGH:MASS for an adaptive budget (query@0.05:0.3:0.8)")
    if len(numbers) == 1:
        check_recompute(method, numbers[0], None)
        return {"recompute": method, "recompute_ratio": numbers[0], **extra}
    low, high, mass = numbers
    check_recompute(method, high, None)
    check_adaptive(mass, low)
    if low > high:
        raise ValueError(f"eval mode {name!r}: LOW must not exceed HIGH")
    return {"recompute": method, "recompute_ratio": high, "recompute_min_ratio": low,
            "recompute_score_mass": mass, **extra}


# The mode of the model's calibrated recompute profile (recompute/profile.py).
CALIBRATED = "calibrated"


def calibrated_mode(engine) -> EvalMode:
    """The sequential-isolated layout with the settings of the engine's model's recompute
    profile (found as an engine finds it); a clear error when there is none, or when its
    check layers are not the engine's (they are an engine setting, not a request's)."""
    from ..recompute.policy import check_layers_for
    from ..recompute.profile import find_profile

    profile = find_profile("auto", engine.checkpoint.fingerprint)
    if profile is None:
        raise ValueError(f"eval mode {CALIBRATED!r}: no recompute profile for this model "
                         "(ragkv calibrate writes one)")
    s = profile.settings
    method = s.get("recompute", "none")
    own = s.get("recompute_check_layers")
    layers = check_layers_for(method, engine.config.recompute_check_layers,
                              engine.model_config.num_layers)
    if own is not None and method != "sink" and tuple(own) != layers:
        raise ValueError(f"eval mode {CALIBRATED!r}: the profile checks layers "
                         f"{','.join(map(str, own))}; run with --recompute-check-layers "
                         f"{','.join(map(str, own))}")
    options = {k: v for k, v in s.items() if k not in ("recompute_check_layers",
                                                         "chunk_primer")}
    # The engine runs the profile's primer (it found the same profile); requests turn it on.
    options["chunk_primer"] = s.get("chunk_primer") not in (None, "none")
    return EvalMode(CALIBRATED, f"sequential-isolated reuse with the calibrated profile: "
                                f"{profile.describe()}",
                    _layout("sequential", "isolated", **options), primable=True)


MODES: dict[str, EvalMode] = {}


def register_mode(mode: EvalMode) -> None:
    MODES[mode.name] = mode


def get_mode(name: str, engine=None) -> EvalMode:
    """The mode `name`; `calibrated` (given the `engine`, whose model's profile it reads)
    too."""
    if name.endswith(PRIMED):
        return primed_mode(get_mode(name.removesuffix(PRIMED), engine))
    if name == CALIBRATED and engine is not None:
        return calibrated_mode(engine)
    mode = MODES.get(name)
    if mode is None and "@" in name:
        return recompute_mode(name)
    if mode is None:
        raise ValueError(f"unknown eval mode {name!r}; known: {', '.join(MODES)}, or "
                         "METHOD@RATIO for selective recompute (e.g. blend@0.15)")
    return mode


# The reference every other mode is compared with.
REFERENCE = "full"

register_mode(EvalMode("full", "an ordinary prompt: documents concatenated, causal attention, "
                               "positions 0..N-1 (full prefill)", _full))
register_mode(EvalMode("chunk", "chunk-cache reuse: each document sees S and itself, shared "
                                "positions after S (positions=shared, attention=isolated)",
                       _layout("shared", "isolated")))
register_mode(EvalMode("sequential", "chunk-cache reuse with documents at their places in the "
                                     "prompt (keys rotated), each seeing S and itself "
                                     "(positions=sequential, attention=isolated)",
                       _layout("sequential", "isolated"), primable=True))
register_mode(EvalMode("standalone", "chunk-cache reuse, documents at their places in the "
                                     "prompt, each seeing only itself, so one cached copy "
                                     "serves every system prompt (positions=sequential, "
                                     "attention=standalone)",
                       _layout("sequential", "standalone")))

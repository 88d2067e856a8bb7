"""Which selective recompute a request gets: its own settings, else the engine's, checked
against its layout and the model, and each scorer's check layers."""

from __future__ import annotations

from ..config import EngineConfig, check_adaptive, check_damping, check_recompute
from .selection import BLEND_CHECK_LAYER, RecomputeSpec, method_scorers, probe_plan

# Check layers of `query` when none are configured, as fractions of the model's depth. Its
# probe runs only the question's tokens, so deeper layers cost almost nothing, and there the
# question's attention points at the evidence rather than at positions: on SmolLM2-135M
# (docs/fidelity.md) layers 4, 8 and 12 of 30 close 90% of the gold-likelihood gap at
# r = 0.15, layer 1 41%. `blend` keeps CacheBlend's layer 1: its probe runs every chunk token
# through the layers up to the last check layer, so each deeper layer costs a prefill's share.
QUERY_CHECK_DEPTHS = (0.13, 0.27, 0.4)


def check_layers_for(method: str, configured: tuple[int, ...] | None,
                     num_layers: int) -> tuple[int, ...]:
    """The check layers a recompute method probes: the configured ones, else its scorer's
    default on a model of `num_layers` layers."""
    if configured is not None:
        return configured
    if "query" in method_scorers(method):  # with query+blend, blend keeps BLEND_CHECK_LAYER
        return tuple(sorted({min(num_layers - 1, round(f * num_layers))
                             for f in QUERY_CHECK_DEPTHS}))
    return (BLEND_CHECK_LAYER,)  # a one-layer model has no deviation to score


def recompute_spec(config: EngineConfig, method: str | None, ratio: float | None,
                   sink_tokens: int | None, position_strategy: str, num_layers: int,
                   score_mass: float | None = None, min_ratio: float | None = None,
                   layers_for_all: bool = True, damping: float | None = None
                   ) -> RecomputeSpec | None:
    """A prompt's selective recompute (its own `method`, `ratio`, `sink_tokens`, adaptive
    budget and `damping`, else the engine's), or None; raises ValueError for one its layout
    or the model cannot do. The engine's recompute is for sequential layouts: a prompt that
    asks for shared positions without naming a method gets none. Without `layers_for_all`
    (the engine's check layers came from a calibrated profile), they serve only methods with
    the engine's scorers; another method probes at its own default layers."""
    if method is None and position_strategy != "sequential":
        method = "none"
    method = config.recompute if method is None else method
    sink = config.recompute_sink_tokens if sink_tokens is None else sink_tokens
    if ratio is not None and score_mass is None:
        # A ratio of the prompt's own without a score mass is a fixed budget of that ratio.
        mass, low = None, 0.0 if min_ratio is None else min_ratio
    else:
        mass = config.recompute_score_mass if score_mass is None else score_mass
        low = config.recompute_min_ratio if min_ratio is None else min_ratio
    ratio = config.recompute_ratio if ratio is None else ratio
    check_recompute(method, ratio, sink)
    check_adaptive(mass, low)
    damping = (config.recompute_damping or 0.0) if damping is None else damping
    check_damping(damping)
    if mass is not None and low > ratio:
        raise ValueError(f"recompute_min_ratio ({low:g}) must not exceed recompute_ratio "
                         f"({ratio:g}), the most an adaptive budget recomputes")
    if method == "none":
        return None
    if position_strategy != "sequential":
        raise ValueError(f"recompute={method!r} recomputes chunk tokens in the sequential "
                         f"layout, not with position_strategy={position_strategy!r}")
    layers = configured_layers(config, method, layers_for_all)
    return RecomputeSpec(method, float(ratio), sink, check_layers(method, layers, num_layers),
                         None if mass is None else float(mass), float(low), float(damping))


def configured_layers(config: EngineConfig, method: str, layers_for_all: bool
                      ) -> tuple[int, ...] | None:
    """The engine's check layers as they apply to `method`: to every method when the user
    gave them (`layers_for_all`), else (a profile's) only to methods with the engine's own
    scorers; None: the method's default."""
    if layers_for_all or method_scorers(method) == method_scorers(config.recompute):
        return config.recompute_check_layers
    return None


def check_layers(method: str, configured: tuple[int, ...] | None,
                 num_layers: int) -> tuple[int, ...]:
    """The check layers `method` probes on a model of `num_layers` layers; a configured layer
    the model does not have is a ValueError."""
    layers = check_layers_for(method, configured, num_layers)
    bad = [x for x in layers if x >= num_layers]
    if bad and (configured is not None or method != "sink"):  # sink alone probes nothing
        which = "" if configured is not None else f" ({method}'s default)"
        raise ValueError(f"recompute_check_layers={layers}{which} names layer {bad[0]}; "
                         f"the model has layers 0 .. {num_layers - 1}")
    for scorer, probed in probe_plan(method, layers):
        if max(probed) >= num_layers:
            raise ValueError(f"recompute={method!r}: its {scorer} probe checks layer "
                             f"{max(probed)}; the model has layers 0 .. {num_layers - 1}")
    return layers

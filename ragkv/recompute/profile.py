"""A model's calibrated selective-recompute settings: the profile `ragkv calibrate` writes.

A profile is a small JSON file keyed by the fingerprint of the model's weights (the same one
that names its chunk-cache entries), so it is never applied to another model. It holds the
chosen settings (method, ratio or adaptive budget, check layers), the target they were chosen
for, and the measured curve they were chosen from.

An engine's default RAG mode is the quality mode: sequential positions with selective
recompute. When it is built with `recompute` left unset (None) and sequential positions (the
default), `resolve_recompute` looks for a profile of its model (`recompute_profile="auto"`:
the ragkv cache directory, then the profiles shipped in the package; or a path) and takes
from it every recompute setting the user did not give; a model without a profile gets
MODEL_AGNOSTIC. A profile that cannot be read, has another format, or belongs to another
model is refused: an error when named by path, a warning and no profile under "auto".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..config import (
    EngineConfig,
    check_adaptive,
    check_chunk_primer,
    check_damping,
    check_recompute,
)
from ..model.file_digest import cache_root

logger = logging.getLogger("ragkv")

FORMAT = "ragkv-recompute-profile"
VERSION = 1
# The profiles of the models ragkv names, shipped in the package.
SHIPPED = Path(__file__).parent / "profiles"
# Built-in defaults of the settings a profile supplies, when neither it nor the user gives one.
DEFAULTS = {"recompute": "none", "recompute_ratio": 0.15, "recompute_min_ratio": 0.0,
            "recompute_damping": 0.0}
# The quality mode of a model without a profile: `query` with an adaptive budget, 10% to 50%
# of the chunk tokens holding 90% of the question's attention, at the query scorer's check
# layers as fractions of depth (policy.QUERY_CHECK_DEPTHS), every document after the first
# computed after the built-in chunk primer. Measured on both models ragkv names
# (docs/fidelity.md, 400 questions each): Gemma 3 270M keeps 94% of full prefill's accuracy at
# 31% recomputed (88% at 41% without the primer); SmolLM2-135M 89% at 31% with the first
# primer, and 96% of full on its calibration split with today's.
MODEL_AGNOSTIC = {"recompute": "query", "recompute_ratio": 0.5, "recompute_min_ratio": 0.1,
                  "recompute_score_mass": 0.9, "chunk_primer": "default"}
SETTINGS = ("recompute", "recompute_ratio", "recompute_min_ratio", "recompute_score_mass",
            "recompute_sink_tokens", "recompute_check_layers", "recompute_damping",
            "chunk_primer")


@dataclass(frozen=True, slots=True)
class RecomputeProfile:
    """A loaded profile: `settings` are EngineConfig fields (SETTINGS); `data` the whole file."""

    path: str
    model_fingerprint: str
    settings: dict
    meets_target: bool
    data: dict

    def describe(self) -> str:
        return describe_settings(self.settings) + (
            "" if self.meets_target else " (best measured; below its target)")


def describe_settings(s: dict) -> str:
    """Recompute settings (SETTINGS keys) in words: method, budget, check layers."""
    ratio = s.get("recompute_ratio", DEFAULTS["recompute_ratio"])
    budget = (f"ratio {ratio:g}" if s.get("recompute_score_mass") is None
              else f"the fewest tokens holding {s['recompute_score_mass']:g} of the scores, "
                   f"{s.get('recompute_min_ratio') or 0:g} to {ratio:g}")
    layers = s.get("recompute_check_layers")
    return (f"{s['recompute']}, {budget}"
            + (f", check layers {','.join(map(str, layers))}" if layers else "")
            + (f", damping {s['recompute_damping']:g}" if s.get("recompute_damping") else "")
            + (", later documents after the chunk primer"
               if s.get("chunk_primer") not in (None, "none") else ""))


def describe_default(s: dict) -> str:
    """One line: the default layout of a RAG prompt, its recompute and where that came from
    (`Engine.recompute_settings()`)."""
    text = f"positions {s['position_strategy']}, chunk attention {s['chunk_attention']}"
    if s["recompute"] == "none":
        if s.get("chunk_primer") not in (None, "none") and s["position_strategy"] == "sequential":
            text += ", later documents after the chunk primer"
        return text + ", no recompute (exact chunk reuse)"
    where = {"profile": f"calibrated profile {s['profile'] or ''}",
             "model-agnostic": "no calibrated profile for this model: the model-agnostic "
                               "default",
             "config": "as configured"}[s["source"]]
    return text + f", recompute {describe_settings(s)} ({where})"


def profile_dir() -> Path:
    """Where `ragkv calibrate` writes profiles and engines look first: $RAGKV_PROFILE_DIR,
    else $RAGKV_CACHE_DIR/profiles."""
    own = os.environ.get("RAGKV_PROFILE_DIR")
    return Path(own).expanduser() if own else cache_root() / "profiles"


def profile_name(fingerprint: str) -> str:
    return f"{fingerprint}.json"


def parse_profile(data: object, path: str, fingerprint: str | None) -> RecomputeProfile:
    """A profile from its JSON `data`; ValueError when it is not one, or (with `fingerprint`)
    belongs to another model."""
    def bad(why: str) -> ValueError:
        return ValueError(f"recompute profile {path}: {why}")

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise bad(f"not a {FORMAT} file")
    if data.get("version") != VERSION:
        raise bad(f"version {data.get('version')!r}, this ragkv reads version {VERSION}")
    owner = data.get("model_fingerprint")
    if not isinstance(owner, str) or not owner:
        raise bad("no model_fingerprint")
    if fingerprint is not None and owner != fingerprint:
        raise bad(f"made for the model with fingerprint {owner}, not this one ({fingerprint})")
    settings = data.get("settings")
    if not isinstance(settings, dict) or set(settings) - set(SETTINGS):
        raise bad(f"settings must be an object with keys among {', '.join(SETTINGS)}")
    settings = dict(settings)
    if settings.get("recompute_check_layers") is not None:
        layers = settings["recompute_check_layers"]
        if not isinstance(layers, list) or not layers or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers):
            raise bad("recompute_check_layers must be a list of layer indices")
        settings["recompute_check_layers"] = tuple(layers)
    try:
        check_recompute(settings.get("recompute", "none"),
                        settings.get("recompute_ratio", DEFAULTS["recompute_ratio"]),
                        settings.get("recompute_sink_tokens"))
        check_adaptive(settings.get("recompute_score_mass"),
                       settings.get("recompute_min_ratio", 0.0))
        check_damping(settings.get("recompute_damping", 0.0))
        check_chunk_primer(settings.get("chunk_primer"))
    except ValueError as e:
        raise bad(str(e)) from None
    return RecomputeProfile(path, owner, settings, bool(data.get("meets_target")), data)


def read_profile(path: str | os.PathLike, fingerprint: str | None) -> RecomputeProfile:
    """The profile at `path` (ValueError if it is unreadable, corrupt or another model's)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"recompute profile {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"recompute profile {path}: not valid JSON ({e})") from None
    return parse_profile(data, str(path), fingerprint)


def write_profile(data: dict, path: str | os.PathLike) -> Path:
    """Write `data` (checked with parse_profile) atomically to `path`."""
    parse_profile(data, str(path), None)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def find_profile(source: str | None, fingerprint: str) -> RecomputeProfile | None:
    """The profile an engine uses: none for None/"none"; for "auto" the model's in the cache
    directory, else the package's (a damaged one is skipped with a warning); else the file at
    `source`, which must be this model's."""
    if source is None or source == "none":
        return None
    if source != "auto":
        return read_profile(source, fingerprint)
    for folder in (profile_dir(), SHIPPED):
        path = folder / profile_name(fingerprint)
        if path.is_file():
            try:
                return read_profile(path, fingerprint)
            except ValueError as e:
                logger.warning("%s; not used", e)
    return None


def resolve_recompute(config: EngineConfig, fingerprint: str, dynamic_rope: bool = False
                      ) -> tuple[EngineConfig, RecomputeProfile | None, str]:
    """`config` with its default layout and every recompute setting concrete, the profile
    they came from, and where the recompute came from: "profile", "model-agnostic" (the
    quality mode without a profile), or "config" (the user's, or none with shared positions).

    Positions left unset are sequential, or shared on a model with dynamic-NTK RoPE (its
    cached keys cannot be turned; a recompute the user asked for is then an error). With
    `recompute` unset and sequential positions, the model's profile supplies the settings the
    user did not give, else MODEL_AGNOSTIC does (a ratio the user gives without a score mass
    is a fixed budget: it takes no adaptive settings); everything still unset takes DEFAULTS."""
    position = config.position_strategy
    if position is None:
        position = "shared" if dynamic_rope else "sequential"
        if dynamic_rope and config.recompute not in (None, "none"):
            raise ValueError(f"recompute={config.recompute!r} recomputes chunk tokens in the "
                             "sequential layout, which this model's dynamic-NTK RoPE cannot "
                             "serve (cached keys cannot be turned to new positions)")
    profile, source = None, "config"
    values = {name: getattr(config, name) for name in SETTINGS}
    if config.recompute is None and position == "sequential":
        profile = find_profile(config.recompute_profile, fingerprint)
        given = dict(profile.settings if profile is not None else MODEL_AGNOSTIC)
        source = "profile" if profile is not None else "model-agnostic"
        if config.recompute_ratio is not None and config.recompute_score_mass is None:
            # A ratio of the user's own without a score mass is a fixed budget of that ratio.
            given.pop("recompute_score_mass", None)
            given.pop("recompute_min_ratio", None)
        for name, value in given.items():
            if values[name] is None:
                values[name] = value
    for name, value in DEFAULTS.items():
        if values[name] is None:
            values[name] = value
    return dataclasses.replace(config, position_strategy=position, **values), profile, source

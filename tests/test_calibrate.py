"""`ragkv calibrate` and recompute profiles: a profile is written keyed to the model, found and
applied by an engine of that model with sequential positions, the default (the user's own
settings winning), never applied to another model, and refused when corrupt; the choice of the
cheapest setting meeting the target."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import httpx
import pytest

from ragkv import LLM, RAGPrompt, SamplingParams
from ragkv.eval.calibrate import CurvePoint, choose, mode_settings, within_noise
from ragkv.recompute.profile import FORMAT, VERSION, profile_name, read_profile, write_profile

MODEL = "builtin:tiny"


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A cache directory holding builtin:tiny's profile, written by `ragkv calibrate`."""
    root = tmp_path_factory.mktemp("ragkv-cache")
    env = {**os.environ, "RAGKV_PROFILE_DIR": str(root / "profiles")}
    r = subprocess.run(
        [sys.executable, "-m", "ragkv", "calibrate", "--model", MODEL, "--device", "cpu",
         "--questions", "5", "--candidates", "blend@0.3,query@0.05:0.5:0.7",
         "--max-tokens", "3", "--no-progress"], capture_output=True, text=True, timeout=300,
        env=env)
    assert r.returncode == 0, r.stderr
    assert "<- chosen" in r.stdout and "profile written to" in r.stdout
    files = list((root / "profiles").iterdir())
    assert len(files) == 1
    return root, files[0]


@pytest.fixture
def cache_dir(calibrated, monkeypatch):
    root, path = calibrated
    monkeypatch.setenv("RAGKV_PROFILE_DIR", str(root / "profiles"))
    return path


def test_profile_is_written_keyed_to_the_model(cache_dir):
    data = json.loads(cache_dir.read_text())
    llm = LLM(MODEL, device="cpu", position_strategy="sequential")
    fingerprint = llm.engine.checkpoint.fingerprint
    assert cache_dir.name == profile_name(fingerprint)
    assert data["format"] == FORMAT and data["version"] == VERSION
    assert data["model_fingerprint"] == fingerprint
    assert data["chosen"] in ("blend@0.3", "query@0.05:0.5:0.7")
    assert [p["mode"] for p in data["curve"]] == ["blend@0.3", "query@0.05:0.5:0.7"]
    assert data["calibration"]["questions"] == 5 and data["calibration"]["suite_seed"] == 1009
    for point in data["curve"]:
        assert point["recomputed_mean"] <= float(point["mode"].split(":")[1]
                                                 if ":" in point["mode"] else 0.3) + 0.05
    # The engine found it and uses its settings.
    profile = llm.engine.recompute_profile
    assert profile is not None and profile.path == str(cache_dir)
    config = llm.engine.config
    for name, value in data["settings"].items():
        got = getattr(config, name)
        assert (list(got) if isinstance(got, tuple) else got) == value, name
    prompt = RAGPrompt("system here", ["a first document of some length", "a second one"],
                       "and a question?")
    out = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.metrics.num_recomputed_tokens > 0
    llm.check_integrity()


def test_users_settings_win_and_shared_positions_use_no_profile(cache_dir):
    data = json.loads(cache_dir.read_text())
    own = LLM(MODEL, device="cpu", position_strategy="sequential", recompute_ratio=0.9)
    assert own.engine.recompute_profile is not None
    assert own.engine.config.recompute_ratio == 0.9
    assert own.engine.config.recompute == data["settings"]["recompute"]
    default = LLM(MODEL, device="cpu")  # the quality mode: sequential with the profile
    assert default.engine.recompute_profile is not None
    assert default.engine.config.position_strategy == "sequential"
    assert default.engine.config.recompute == data["settings"]["recompute"]
    assert default.engine.recompute_settings()["source"] == "profile"
    for kwargs, method, ratio, source in (
            ({"position_strategy": "sequential", "recompute": "sink"}, "sink", 0.15, "config"),
            ({"position_strategy": "shared"}, "none", 0.15, "config"),
            ({"recompute_profile": None}, "query", 0.5, "model-agnostic")):
        llm = LLM(MODEL, device="cpu", **kwargs)
        assert llm.engine.recompute_profile is None, kwargs
        assert (llm.engine.config.recompute, llm.engine.config.recompute_ratio,
                llm.engine.recompute_source) == (method, ratio, source), kwargs


def test_a_profiles_check_layers_serve_only_its_own_scorers(cache_dir, tmp_path, monkeypatch):
    """A profile's check layers were calibrated for its method's scorers: a request naming
    another scorer probes at that scorer's default layers, while layers the user gives apply
    to every method. `sink` alone reports no check layers."""
    data = json.loads(cache_dir.read_text())
    data["settings"] = {"recompute": "query", "recompute_ratio": 0.5,
                        "recompute_check_layers": [0]}
    monkeypatch.setenv("RAGKV_PROFILE_DIR", str(tmp_path))
    write_profile(data, tmp_path / cache_dir.name)
    llm = LLM(MODEL, device="cpu")
    assert llm.engine.config.recompute_check_layers == (0,)
    prompt = RAGPrompt([1, 2], [[3, 4, 5], [6, 7]], [8, 9])

    def layers(engine, method):
        return engine.inputs.process(dataclasses.replace(prompt, recompute=method)
                                     ).recompute.check_layers

    assert layers(llm.engine, None) == layers(llm.engine, "sink+query") == (0,)
    # Other scorers (a combination too) probe at their defaults: blend layer 1, query 0 and 1.
    assert layers(llm.engine, "blend") == (1,) and layers(llm.engine, "query+blend") == (0, 1)
    own = LLM(MODEL, device="cpu", recompute_check_layers=(0,)).engine
    assert layers(own, "blend") == (0,)
    sink = LLM(MODEL, device="cpu", recompute="sink").engine
    assert sink.recompute_settings()["recompute_check_layers"] is None
    assert "check layers" not in sink.describe_rag_default()


def test_another_models_profile_is_never_used(cache_dir, tmp_path):
    other = LLM("builtin:small", device="cpu", position_strategy="sequential")
    assert other.engine.recompute_profile is None  # its fingerprint names no file
    # Named by path, another model's profile is an error.
    with pytest.raises(ValueError, match="made for the model with fingerprint"):
        LLM("builtin:small", device="cpu", position_strategy="sequential",
            recompute_profile=str(cache_dir))
    # Copied under the other model's name, it is still refused (the file names its model).
    fingerprint = other.engine.checkpoint.fingerprint
    impostor = cache_dir.parent / profile_name(fingerprint)
    impostor.write_text(cache_dir.read_text())
    try:
        assert LLM("builtin:small", device="cpu",
                   position_strategy="sequential").engine.recompute_profile is None
    finally:
        impostor.unlink()


@pytest.mark.parametrize("damage, fragment", [
    (lambda d: "{not json", "not valid JSON"),
    (lambda d: json.dumps({**d, "format": "something-else"}), "not a ragkv-recompute-profile"),
    (lambda d: json.dumps({**d, "version": 99}), "version 99"),
    (lambda d: json.dumps({**d, "settings": {"recompute": "magic"}}), "recompute must be one"),
    (lambda d: json.dumps({**d, "settings": {"max_num_seqs": 4}}), "settings must be"),
    (lambda d: json.dumps({**d, "settings": {"recompute": "query",
                                             "recompute_score_mass": 3}}),
     "recompute_score_mass"),
])
def test_a_corrupt_profile_is_refused(cache_dir, tmp_path, caplog, damage, fragment):
    good = cache_dir.read_text()
    bad = tmp_path / "bad.json"
    bad.write_text(damage(json.loads(good)))
    with pytest.raises(ValueError, match=fragment):
        LLM(MODEL, device="cpu", position_strategy="sequential", recompute_profile=str(bad))
    cache_dir.write_text(bad.read_text())  # found by "auto": a warning, and no profile
    try:
        with caplog.at_level(logging.WARNING, logger="ragkv"):
            llm = LLM(MODEL, device="cpu", position_strategy="sequential")
        assert llm.engine.recompute_profile is None
        assert (llm.engine.config.recompute, llm.engine.recompute_source) == (
            "query", "model-agnostic")
        assert any(fragment in r.getMessage() and "not used" in r.getMessage()
                   for r in caplog.records)
    finally:
        cache_dir.write_text(good)
    with pytest.raises(ValueError, match="No such file"):
        read_profile(tmp_path / "missing.json", None)


def test_models_endpoint_says_which_settings_apply(cache_dir):
    import asyncio

    from ragkv.server.app import ServerConfig, build_app
    from ragkv.server.async_engine import AsyncEngine
    from ragkv.server.metrics import Metrics

    llm = LLM(MODEL, device="cpu", position_strategy="sequential")
    engine = AsyncEngine(llm.engine)
    app = build_app(engine, Metrics(MODEL, llm.engine.chunk_store),
                    ServerConfig(model_name=MODEL))

    async def get() -> dict:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ragkv") as http:
            return (await http.get("/v1/models")).json()

    engine.start()
    try:
        body = asyncio.run(get())
    finally:
        engine.stop()
    settings = body["data"][0]["recompute"]
    assert settings["profile"] == str(cache_dir)
    assert settings["recompute"] == json.loads(cache_dir.read_text())["settings"]["recompute"]
    assert settings["position_strategy"] == "sequential"


def point(mode: str, gap: float, cost: float, ref_only: int = 0, mode_only: int = 0,
          target: float = 0.9) -> CurvePoint:
    quiet = within_noise(ref_only, mode_only)
    return CurvePoint(mode, {}, 0.5, (0.4, 0.6), -1.0, gap, 0.1, 0.8, cost, 0.0, cost,
                      ref_only, mode_only, quiet, quiet and gap >= target)


def test_choice_is_the_cheapest_point_meeting_the_target():
    assert within_noise(5, 5) and within_noise(6, 1) and not within_noise(10, 1)
    points = [point("a", 0.95, 0.30), point("b", 0.91, 0.20), point("c", 0.99, 0.10, 12, 1),
              point("d", 0.85, 0.05), point("e", 0.93, 0.20)]
    assert choose(points).mode == "e"  # b and e cost alike: the larger gap; c is not quiet
    # None meets: the point within noise closing most of the gap, not the one closing most.
    assert choose([point("x", 0.5, 0.1), point("y", 0.7, 0.4), point("z", 1.1, 0.2, 20, 2)
                   ]).mode == "y"
    loud = [point("u", 1.1, 0.2, 20, 2), point("v", 0.8, 0.3, 15, 2)]
    loud[1] = dataclasses.replace(loud[1], accuracy=0.6)
    assert choose(loud).mode == "v"  # none within noise: the most accurate
    settings = mode_settings("query@0.05:0.3:0.6", 30, None)
    assert settings == {"recompute": "query", "recompute_ratio": 0.3,
                        "recompute_min_ratio": 0.05, "recompute_score_mass": 0.6,
                        "recompute_check_layers": [4, 8, 12]}
    assert mode_settings("sink@0.2", 30, None) == {"recompute": "sink", "recompute_ratio": 0.2}


def test_written_profiles_are_checked(tmp_path):
    with pytest.raises(ValueError, match="not a ragkv-recompute-profile"):
        write_profile({"format": "x"}, tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


def test_eval_runs_the_calibrated_mode(cache_dir, monkeypatch, tmp_path):
    from ragkv.eval.evaluate import evaluate, pick_items, summarize
    from ragkv.eval.suite import build_suite

    data = json.loads(cache_dir.read_text())
    llm = LLM(MODEL, device="cpu")
    items = pick_items(build_suite(2, seed=4), 3)
    results = evaluate(llm, items, ["calibrated"], max_tokens=2, progress=False)
    summary = summarize(results)
    assert list(summary) == ["full", "calibrated"]
    recomputed = summary["calibrated"]["overall"]["recomputed_mean"]
    assert 0 < recomputed <= data["settings"]["recompute_ratio"] + 0.05
    llm.check_integrity()
    monkeypatch.setenv("RAGKV_PROFILE_DIR", str(tmp_path))  # no profile there
    with pytest.raises(ValueError, match="no recompute profile for this model"):
        evaluate(llm, items, ["calibrated"], max_tokens=2, progress=False)


def test_demo_runs_the_quality_mode_with_the_profile(calibrated, tmp_path):
    """`ragkv demo` answers in the default mode: with a profile, its settings (and the demo
    says so); without one, the model-agnostic default. Either way its answers equal, token
    for token, the same prompts with the caches off."""
    root, path = calibrated
    for cache, expect in ((root / "profiles", f"(calibrated profile {path})"),
                          (tmp_path, "(no calibrated profile for this model: the "
                                     "model-agnostic default)")):
        r = subprocess.run([sys.executable, "-m", "ragkv", "demo", "--model", MODEL,
                            "--num-requests", "4", "--max-tokens", "4"], capture_output=True,
                           text=True, timeout=300, env={**os.environ,
                                                        "RAGKV_PROFILE_DIR": str(cache)})
        assert r.returncode == 0, r.stdout + r.stderr
        assert "Default RAG mode: positions sequential" in r.stdout
        assert expect in r.stdout
        assert "default mode: 4/4 answers identical token for token" in r.stdout
        assert "exact chunk reuse: 4/4 answers identical token for token" in r.stdout


def test_a_profile_with_a_chunk_primer(calibrated, monkeypatch, tmp_path):
    """`ragkv calibrate` with `+primer` candidates: a chosen primed point writes the engine's
    primer into the profile; an engine of the model then primes its later documents (with or
    without a chunk cache) unless the user says `chunk_primer="none"`; `calibrated` in
    `ragkv eval` runs the profile's primer."""
    from ragkv.eval.evaluate import evaluate, pick_items, summarize
    from ragkv.eval.suite import build_suite

    profiles = tmp_path / "profiles"
    r = subprocess.run(
        [sys.executable, "-m", "ragkv", "calibrate", "--model", MODEL, "--device", "cpu",
         "--questions", "5", "--candidates", "query@0.3+primer", "--max-tokens", "3",
         "--no-progress"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "RAGKV_PROFILE_DIR": str(profiles)})
    assert r.returncode == 0, r.stderr
    data = json.loads(next(profiles.iterdir()).read_text())
    assert data["chosen"] == "query@0.3+primer"
    assert data["settings"]["chunk_primer"] == "default"
    assert mode_settings("query@0.2+primer", 2, None, "text")["chunk_primer"] == "text"
    monkeypatch.setenv("RAGKV_PROFILE_DIR", str(profiles))
    llm = LLM(MODEL, device="cpu")
    assert llm.engine.config.chunk_primer == "default"
    assert "after the chunk primer" in llm.engine.describe_rag_default()
    prompt = RAGPrompt("system here", ["a first document", "a second one"], "a question?")
    assert llm.engine.inputs.process(prompt).layout.primer_len > 0
    off = LLM(MODEL, device="cpu", chunk_primer="none").engine
    assert off.inputs.process(prompt).layout.primer_len == 0
    uncached = LLM(MODEL, device="cpu", enable_chunk_cache=False).engine
    assert uncached.inputs.process(prompt).layout.primer_len > 0
    items = pick_items(build_suite(2, seed=4), 3)
    summary = summarize(evaluate(llm, items, ["calibrated", "sequential"], max_tokens=2,
                                 progress=False))
    assert summary["calibrated"]["overall"]["recomputed_mean"] > 0
    llm.check_integrity()

"""`ragkv bench`: the workload generator, the offline modes and the serving mode, checked for
consistency (hit rates agree with the cache statistics, counts add up)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest
from conftest import running_server

from ragkv.bench.workload import WorkloadConfig, make_workload

SHAPE = ["--num-docs", "5", "--doc-tokens", "24", "--docs-per-request", "2",
         "--system-tokens", "8", "--question-tokens", "4", "--output-tokens", "3",
         "--num-requests", "6"]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ragkv", "bench", "--no-progress", *args],
                          capture_output=True, text=True, timeout=600)


def test_workload_is_deterministic_zipf_and_distinct():
    config = WorkloadConfig(num_docs=8, doc_tokens=5, docs_per_request=3, num_requests=400,
                            zipf=1.1, seed=3)
    a, b = make_workload(config, 100), make_workload(config, 100)
    assert a == b
    assert make_workload(WorkloadConfig(**{**config.to_dict(), "seed": 4}), 100) != a
    counts = collections.Counter(d for r in a for d in r.doc_ids)
    assert counts[0] > counts[3] > counts[7]  # popularity falls with rank
    for r in a:
        assert len(set(r.doc_ids)) == 3 and len(r.chunks) == 3
        assert all(len(c) == 5 for c in r.chunks) and len(r.question) == 32
        assert r.system is a[0].system and all(10 <= t < 100 for t in r.token_ids)
    with pytest.raises(ValueError, match="docs_per_request"):
        WorkloadConfig(num_docs=2, docs_per_request=3)


def test_offline_modes_are_consistent(tmp_path):
    out = tmp_path / "bench.json"
    r = bench("--model", "builtin:tiny", *SHAPE, "--json", str(out), "--compare-hf")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FLOP bound" in r.stdout and "p50 TTFT none / chunk" in r.stdout
    res = json.loads(out.read_text())
    assert set(res["modes"]) == {"none", "prefix", "chunk", "hf"}
    for mode in ("none", "prefix", "chunk"):
        f = res["modes"][mode]
        assert f["requests"] == 6 and f["output_tokens"] == 6 * 3
        assert f["prompt_tokens"] == 6 * (8 + 2 * 24 + 4)  # token-level: no BOS added
        pc, cc = f["prefix_cache"], f["chunk_cache"]
        assert pc["hit_tokens"] <= pc["queried_tokens"]
        assert pc["hit_rate"] == pytest.approx(pc["hit_tokens"] / pc["queried_tokens"]
                                               if pc["queried_tokens"] else 0.0)
        assert cc["lookups"] == cc["hits"] + cc["misses"]
        assert cc["hits"] == cc["request_hits"] and cc["misses"] == cc["request_misses"]
        assert f["ttft_s"]["p50"] <= f["ttft_s"]["p90"] <= f["ttft_s"]["p99"]
    none, prefix, chunk = (res["modes"][m] for m in ("none", "prefix", "chunk"))
    assert none["prefix_cache"]["queried_tokens"] == 0 and none["chunk_cache"]["lookups"] == 0
    assert none["cached_tokens"] == 0
    assert prefix["chunk_cache"]["lookups"] == 0
    assert prefix["cached_tokens"] == prefix["prefix_cache"]["hit_tokens"]
    assert chunk["chunk_cache"]["lookups"] == 6 * 2
    assert chunk["chunk_cache"]["misses"] <= 5  # each of the 5 documents is computed once
    assert chunk["cached_tokens"] == (chunk["prefix_cache"]["hit_tokens"]
                                      + chunk["chunk_cache"]["hit_tokens"])
    assert chunk["chunk_cache"]["hit_rate"] == pytest.approx(
        chunk["chunk_cache"]["hits"] / chunk["chunk_cache"]["lookups"])
    assert res["flop_bound"] > 1 and res["modes"]["hf"]["requests"] == 6


def test_serving_mode_against_a_running_server(tmp_path):
    out = tmp_path / "serving.json"
    with running_server("builtin:tiny", "--api-key", "k1") as url:
        r = bench("--url", url, "--api-key", "k1", "--model", "builtin:tiny", *SHAPE,
                  "--concurrency", "3", "--request-rate", "50", "--json", str(out))
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(out.read_text())
        assert res["completed"] == 6 and res["failed"] == 0, res["errors"]
        assert res["output_tokens"] == 6 * 3
        assert 0 < res["ttft_s"]["p50"] <= res["e2e_s"]["p50"]
        assert res["itl_s"]["mean"] > 0 and res["request_throughput"] > 0
        assert res["cached_tokens"] > 0  # documents recur, so the server reuses them
        wrong = bench("--url", url, "--api-key", "wrong", "--model", "builtin:tiny", *SHAPE)
        assert wrong.returncode != 0 or "failed 6" in wrong.stdout


def test_recompute_bench_and_curve_scripts(tmp_path):
    """benchmarks/bench_recompute.py times every point it is asked for, with a FLOP bound that
    is about 1 at r = 1; plot_recompute_curve.py turns an eval report and those timings into a
    table."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ttft = tmp_path / "ttft.json"
    r = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "bench_recompute.py"), "--model",
         "builtin:tiny", "--doc-tokens", "24", "--num-docs", "2", "--system-tokens", "8",
         "--question-tokens", "4", "--repeats", "1", "--methods", "blend,sink",
         "--ratios", "0,0.5,1", "--json", str(ttft)], capture_output=True, text=True,
        timeout=300)
    assert r.returncode == 0, r.stderr
    points = json.loads(ttft.read_text())["points"]
    assert [(p["method"], p["ratio"]) for p in points] == [
        (m, x) for m in ("blend", "sink") for x in (0.0, 0.5, 1.0)]
    # The first document's KV is exact already: at most the second's 24 tokens recompute
    # (blend: ceil(r * 48) of them; sink: ceil(r * 24) of its own).
    assert [p["recomputed_tokens"] for p in points] == [0, 24, 24, 0, 12, 24]
    # r = 1 recomputes the second document and the question; S and the first document (32 of
    # 60 tokens) are saved.
    assert all(60 / 28 - 0.5 < p["flop_bound"] < 60 / 28 + 0.01
               for p in points if p["ratio"] == 1.0), points
    assert all(p["flop_bound"] > 4 for p in points if p["ratio"] == 0.0)
    report = tmp_path / "eval.json"
    r = subprocess.run(
        [sys.executable, "-m", "ragkv", "eval", "--model", "builtin:tiny", "--device", "cpu",
         "--limit", "3", "--num-per-task", "2", "--max-tokens", "2", "--modes",
         "sequential,blend@0.5,sink@0.5,blend@1", "--json", str(report), "--no-progress"],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "plot_recompute_curve.py"),
         str(report), "--ttft", str(ttft)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| blend")]
    assert [row.split("|")[2].strip() for row in rows] == ["0", "0.5", "1"]
    assert "| 100% |" in rows[-1]  # r = 1 closes the whole gap


def test_store_bench_script(tmp_path):
    """benchmarks/bench_store.py times a chunk served from each tier against computing it, and
    a second replica (a fresh process) serves every chunk of a corpus the first precomputed
    from the shared store, while a cold replica computes them all."""
    import os
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with_redis = shutil.which("redis-server") is not None
    if not with_redis and os.environ.get("RAGKV_REQUIRE_REDIS") == "1":
        pytest.fail("redis-server is not installed and RAGKV_REQUIRE_REDIS=1")
    out = tmp_path / "store.json"
    r = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "bench_store.py"), "--model",
         "builtin:tiny", "--chunk-tokens", "32", "--doc-tokens", "24", "--num-docs", "2",
         "--docs-per-request", "1", "--num-requests", "2", "--system-tokens", "8",
         "--question-tokens", "4", "--repeats", "1", "--json", str(out),
         *([] if with_redis else ["--no-redis"])], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["redis"] is with_redis
    lvr = res["load_vs_recompute"]
    tiers = ["host", "disk", "redis"] if with_redis else ["host", "disk"]
    assert list(lvr["tiers"]) == tiers
    assert lvr["bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # tiny: 2 layers, 2 KV heads x 16, fp32
    assert lvr["payload_bytes"] == 32 * lvr["bytes_per_token"]
    assert lvr["recompute_ttft_s"] > 0 and lvr["pool_ttft_s"] > 0
    for tier in tiers:
        f = lvr["tiers"][tier]
        assert f["ttft_s"] > 0 and f["get_s"] > 0 and len(f["ttfts_s"]) == 1
        assert f["speedup_over_recompute"] == pytest.approx(lvr["recompute_ttft_s"] / f["ttft_s"])
        # The host tier keeps the tensor; disk and Redis add the header and checksum.
        assert f["header_bytes"] == 0 if tier == "host" else 0 < f["header_bytes"] < 4096
    rep = res["replicas"]
    assert rep["store"] == ("redis" if with_redis else "disk")
    assert rep["chunk_occurrences"] == rep["distinct_docs"] == 2
    assert rep["precompute_entries_written"] == 2
    warm, cold = rep["warm"], rep["cold"]
    # Replica 2 computes no chunk: each was precomputed by replica 1 and read from the store.
    assert warm["chunk_lookups"] == warm["chunk_hits"] == warm["store_hits"] == 2
    assert warm["chunk_misses"] == 0 and warm["store_hit_tokens"] == 2 * 24
    assert warm["store_loads"] == 2 and warm["store_load_s"] > 0
    assert warm["store_errors"] == warm["store_corrupt"] == 0
    assert cold["chunk_misses"] == 2 and cold["chunk_hits"] == cold["store_hits"] == 0
    for run in (warm, cold):
        assert len(run["ttfts_s"]) == 2 and all(t > 0 for t in run["ttfts_s"])
    assert rep["cold_over_warm_mean"] == pytest.approx(cold["ttft_mean_s"] / warm["ttft_mean_s"])


def test_eval_bench_script(tmp_path):
    """benchmarks/bench_eval.py times the same eval one request at a time and batched, and the
    two runs give the same answers."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "eval.json"
    r = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "bench_eval.py"), "--model",
         "builtin:tiny", "--questions", "3", "--modes", "chunk,sequential", "--batch-size", "3",
         "--max-tokens", "3", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["questions"] == 3 and res["answers"] == 9 and res["requests"] == 18
    assert res["same_answers"] == 9
    assert res["one_at_a_time_s"] > 0 and res["batch_3_s"] > 0 and res["speedup"] > 0


def test_vllm_surface_script_passes():
    """benchmarks/vllm_surface.py (a live server from a --config file, the openai client, one
    check per row of the vLLM surface) passes on builtin:tiny."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "vllm_surface.py")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("PASS") == 14 and "every check passed" in r.stdout
    assert "INFO  6 auto without forcing" in r.stdout

"""The Grafana dashboard (docs/grafana/ragkv-dashboard.json) matches the server's metrics.

- it is a dashboard with panels, a `DS_PROMETHEUS` datasource variable that every query uses
  and a `model_name` variable read from `ragkv:num_requests_running`;
- every metric its PromQL names (panels nested in rows included) is one the real registry
  exports: `Metrics(...).render()` with a chunk store of one host tier, parsed by
  prometheus_client, family names and their `_total`/`_bucket`/`_sum`/`_count` samples; no
  query uses vLLM's `vllm:` names, and every selector is filtered by `model_name`;
- every panel has a unique id and a title, and no two panels of one row section overlap.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ragkv.cache.store.host_tier import HostChunkStore
from ragkv.cache.store.tiered import TieredChunkStore, build_chunk_store
from ragkv.server.metrics import Metrics

DASHBOARD = pathlib.Path(__file__).resolve().parents[1] / "docs/grafana/ragkv-dashboard.json"
DATASOURCE = "${DS_PROMETHEUS}"
MODEL_QUERY = "label_values(ragkv:num_requests_running, model_name)"
MODEL_FILTER = 'model_name="$model_name"'
# A metric and its label selector, if any (PromQL metric names may hold digits: e2e).
SELECTOR = re.compile(r"\b((?:ragkv|vllm):[a-zA-Z0-9_:]*)(\{[^}]*\})?")
SAMPLE_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every metric name a scrape of the real registry can show: family names and the sample
    names that go with them."""
    store = build_chunk_store("host:64MiB")  # as the engine builds it from --chunk-store
    assert isinstance(store, TieredChunkStore)
    assert [type(t) for t in store.tiers] == [HostChunkStore]
    try:
        text = Metrics("m", store).render().decode()
    finally:
        store.close()
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SAMPLE_SUFFIXES)
        names.update(sample.name for sample in family.samples)
    assert "ragkv:chunk_store_hits_total" in names  # the store's families are there
    return names


def all_panels(dashboard: dict) -> list[dict]:
    """Top-level panels and the panels inside (collapsed) rows."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries(dashboard: dict) -> list[str]:
    return [t["expr"] for p in all_panels(dashboard) for t in p.get("targets", [])]


def variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def test_dashboard_shape_and_variables(dashboard):
    assert isinstance(dashboard, dict)
    assert isinstance(dashboard.get("panels"), list) and dashboard["panels"]
    assert dashboard.get("title") and dashboard.get("schemaVersion", 0) >= 36
    found = variables(dashboard)
    ds = found["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    model = found["model_name"]
    assert model["type"] == "query"
    query = model["query"]
    assert (query["query"] if isinstance(query, dict) else query) == MODEL_QUERY
    assert model["datasource"]["uid"] == DATASOURCE


def test_every_query_uses_the_datasource_variable(dashboard):
    with_targets = [p for p in all_panels(dashboard) if p.get("targets")]
    assert len(with_targets) >= 20
    for panel in with_targets:
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE}, panel["title"]
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == DATASOURCE, panel["title"]
            assert t["expr"].strip(), panel["title"]


def test_every_metric_is_exported_and_filtered_by_model(dashboard, exported):
    used = set()
    for expr in queries(dashboard):
        selectors = SELECTOR.findall(expr)
        assert selectors, expr
        for name, labels in selectors:
            assert not name.startswith("vllm:"), expr
            assert MODEL_FILTER in labels, f"{name} is not filtered by model_name in {expr}"
            used.add(name)
    missing = sorted(used - exported)
    assert not missing, f"the dashboard uses metrics the server does not export: {missing}"
    # The families the dashboard is for, each shown somewhere.
    for family in ("chunk_cache_hits", "chunk_cache_queries", "chunk_recomputed_tokens",
                   "chunk_repositioned_tokens", "prefix_cache_hits", "tokenizer_cache_hits",
                   "kv_cache_usage_perc", "chunk_cache_usage_perc", "num_requests_waiting",
                   "time_to_first_token_seconds", "request_queue_time_seconds",
                   "request_success", "num_preemptions", "chunk_store_read_bytes",
                   "chunk_store_available", "chunk_store_used_bytes",
                   "chunk_store_load_seconds", "chunk_store_errors"):
        assert any(n.startswith(f"ragkv:{family}") for n in used), family


def test_the_check_catches_unknown_names(exported):
    """The name check is not vacuous: a misspelt or vLLM-only name is not exported."""
    assert "ragkv:chunk_cache_hit_total" not in exported
    assert "vllm:num_requests_running" not in exported
    assert "ragkv:e2e_request_latency_seconds_bucket" in exported


def test_panels_have_unique_ids_and_titles(dashboard):
    panels = all_panels(dashboard)
    ids = [p.get("id") for p in panels]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel in panels:
        assert panel.get("title", "").strip(), panel
        if panel["type"] != "row":
            assert panel.get("description", "").strip(), panel["title"]


def sections(dashboard: dict) -> list[list[dict]]:
    """The panels of each row section: top-level panels up to the next row (the row itself
    included), and each collapsed row's own panels (laid out below it) on their own."""
    out: list[list[dict]] = [[]]
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.append([panel])
            if panel.get("collapsed") and panel.get("panels"):
                out.append([panel, *panel["panels"]])
        else:
            out[-1].append(panel)
    return [s for s in out if s]


def overlap(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def test_grid_positions_do_not_overlap(dashboard):
    for section in sections(dashboard):
        for panel in section:
            pos = panel["gridPos"]
            assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] >= 0
            assert pos["x"] + pos["w"] <= 24, panel["title"]
        for i, a in enumerate(section):
            for b in section[i + 1:]:
                assert not overlap(a["gridPos"], b["gridPos"]), (a["title"], b["title"])
    # Top-level panels (rows included) do not overlap either, across sections.
    top = dashboard["panels"]
    for i, a in enumerate(top):
        for b in top[i + 1:]:
            assert not overlap(a["gridPos"], b["gridPos"]), (a["title"], b["title"])

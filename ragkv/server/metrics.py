"""Prometheus metrics, named in vLLM's style with the `ragkv:` prefix.

Counters follow the engine's cumulative statistics (updated after every step from their
deltas); latency histograms are observed as tokens arrive. The chunk store's per-tier figures
(`ragkv:chunk_store_*`, label `tier`) are read from the tiers at scrape time: its writer thread
moves them between steps. Each server owns its registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..cache.store.tier import LOAD_BUCKETS
from ..cache.store.tiered import TieredChunkStore
from ..engine.engine import Engine
from ..outputs import RequestOutput

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
# Whole requests (vLLM's buckets for end-to-end latency and time in the queue).
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


# The series vLLM also publishes, by name after the prefix: with `vllm_names` each is
# published under `vllm:` as well, so dashboards built for vLLM show ragkv's figures.
VLLM_SERIES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
    "generation_tokens", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_success",
    "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"})
_SUFFIXES = ("_total", "_created", "_bucket", "_count", "_sum")


class Metrics:
    def __init__(self, model_name: str, chunk_store: TieredChunkStore | None = None,
                 vllm_names: bool = False) -> None:
        self.vllm_names = vllm_names
        self.registry = CollectorRegistry()
        if chunk_store is not None:
            self.registry.register(_ChunkStoreCollector(model_name, chunk_store))
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        self.chunk_cache_queries = counter("ragkv:chunk_cache_queries",
                                           "Chunk-cache lookups (one per chunk occurrence).")
        self.chunk_cache_hits = counter("ragkv:chunk_cache_hits",
                                        "Chunk-cache lookups that found the chunk's KV.")
        self.chunk_cache_evictions = counter("ragkv:chunk_cache_evictions",
                                             "Chunk-cache entries evicted.")
        self.chunk_repositioned_tokens = counter(
            "ragkv:chunk_repositioned_tokens",
            "Chunk tokens used at positions other than their cached ones, their keys rotated "
            "at attention time (sequential positions, standalone chunks).")
        self.chunk_recomputed_tokens = counter(
            "ragkv:chunk_recomputed_tokens",
            "Chunk tokens recomputed with full attention by selective recompute instead of "
            "reused from the chunk cache.")
        self.prefix_cache_queries = counter("ragkv:prefix_cache_queries",
                                            "Tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("ragkv:prefix_cache_hits",
                                         "Tokens found in the prefix cache.")
        self.tokenizer_cache_queries = counter(
            "ragkv:tokenizer_cache_queries",
            "System parts and documents sent as text looked up in the tokenizer cache.")
        self.tokenizer_cache_hits = counter(
            "ragkv:tokenizer_cache_hits",
            "Tokenizer-cache lookups answered without running the tokenizer.")
        self.prompt_tokens = counter("ragkv:prompt_tokens",
                                     "Prompt tokens processed (counted at a request's first "
                                     "token, or its end when it generates none).")
        self.generation_tokens = counter("ragkv:generation_tokens", "Generated tokens.")
        self.spec_drafts = counter("ragkv:spec_decode_num_drafts",
                                   "Speculative decoding: steps that verified drafts.")
        self.spec_draft_tokens = counter("ragkv:spec_decode_num_draft_tokens",
                                         "Speculative decoding: draft tokens verified.")
        self.spec_accepted_tokens = counter("ragkv:spec_decode_num_accepted_tokens",
                                            "Speculative decoding: draft tokens kept.")
        self.chunk_cache_usage = gauge("ragkv:chunk_cache_usage_perc",
                                       "Fraction of the chunk-cache region in use (0-1).")
        self.kv_cache_usage = gauge("ragkv:kv_cache_usage_perc",
                                    "Fraction of the general KV region held by requests (0-1).")
        self.num_running = gauge("ragkv:num_requests_running", "Requests running.")
        self.num_waiting = gauge("ragkv:num_requests_waiting", "Requests waiting.")
        self.ttft = Histogram("ragkv:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_TTFT_BUCKETS,
                              registry=self.registry).labels(model_name)
        self.itl = Histogram("ragkv:inter_token_latency_seconds", "Time between output tokens.",
                             labels, buckets=_ITL_BUCKETS,
                             registry=self.registry).labels(model_name)
        self.e2e = Histogram("ragkv:e2e_request_latency_seconds",
                             "Arrival to finish of finished requests.", labels,
                             buckets=_REQUEST_BUCKETS, registry=self.registry).labels(model_name)
        self.queue_time = Histogram("ragkv:request_queue_time_seconds",
                                    "Arrival to first scheduling of finished requests.", labels,
                                    buckets=_REQUEST_BUCKETS,
                                    registry=self.registry).labels(model_name)
        self.preemptions = counter("ragkv:num_preemptions",
                                   "Preemptions of finished requests (KV freed, recomputed "
                                   "later).")
        self._success = Counter("ragkv:request_success",
                                "Finished completions by finish reason (stop, length, error; "
                                "aborted ones are not counted).",
                                labels + ["finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "error"):  # every series exists from the start
            self._success.labels(model_name, reason)
        self._model_name = model_name
        self._totals: dict[str, float] = {}
        # (request id, completion index) -> (tokens seen, time of the last one)
        self._progress: dict[tuple[str, int], tuple[int, float]] = {}

    def on_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        """Called by the engine thread after every step."""
        stats = engine.stats()
        chunks = engine.chunk_cache_stats()
        self._advance(self.chunk_cache_queries, "chunk_queries", chunks.lookups)
        self._advance(self.chunk_cache_hits, "chunk_hits", chunks.hits)
        self._advance(self.chunk_cache_evictions, "chunk_evictions", chunks.evictions)
        self._advance(self.chunk_repositioned_tokens, "chunk_repositioned",
                      chunks.repositioned_tokens)
        self._advance(self.chunk_recomputed_tokens, "chunk_recomputed",
                      chunks.recomputed_tokens)
        self._advance(self.prefix_cache_queries, "prefix_queries", stats.prefix_queried_tokens)
        self._advance(self.prefix_cache_hits, "prefix_hits", stats.prefix_hit_tokens)
        tokens = engine.token_cache_stats()
        self._advance(self.tokenizer_cache_queries, "tokenizer_queries", tokens.queries)
        self._advance(self.tokenizer_cache_hits, "tokenizer_hits", tokens.hits)
        spec = engine.spec_decode_stats()
        self._advance(self.spec_drafts, "spec_drafts", spec.num_drafts)
        self._advance(self.spec_draft_tokens, "spec_draft_tokens", spec.num_draft_tokens)
        self._advance(self.spec_accepted_tokens, "spec_accepted", spec.num_accepted_tokens)
        self.chunk_cache_usage.set(chunks.usage)
        self.kv_cache_usage.set(stats.kv_usage)
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        if not outputs and self._progress:
            # Aborted requests never send a finished output: forget those the engine dropped.
            for key in [k for k in self._progress if not engine.has_request(k[0])]:
                del self._progress[key]
        for out in outputs:
            now = out.metrics.last_token_time or 0.0
            for completion in out.outputs:
                key = (out.request_id, completion.index)
                seen, last = self._progress.get(key, (0, 0.0))
                new = len(completion.token_ids) - seen
                if new > 0:
                    self.generation_tokens.inc(new)
                    if seen == 0:
                        if completion.index == 0:
                            self.prompt_tokens.inc(len(out.prompt_token_ids))
                        if out.metrics.ttft is not None:
                            self.ttft.observe(out.metrics.ttft)
                    else:
                        for _ in range(new):
                            self.itl.observe((now - last) / new)
                elif (seen == 0 and out.finished and completion.index == 0
                      and completion.finish_reason == "length"):
                    # max_tokens 0: the prompt was scored, nothing generated.
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                if out.finished:
                    self._progress.pop(key, None)
                    self._success.labels(self._model_name, completion.finish_reason).inc()
                else:
                    self._progress[key] = (len(completion.token_ids), now)
            if out.finished:
                m = out.metrics
                if m.e2e_latency is not None:
                    self.e2e.observe(m.e2e_latency)
                if m.time_in_queue is not None:
                    self.queue_time.observe(m.time_in_queue)
                if m.num_preemptions:
                    self.preemptions.inc(m.num_preemptions)

    def render(self) -> bytes:
        text = generate_latest(self.registry)
        if not self.vllm_names:
            return text
        # The same samples again under vLLM's names (HELP, TYPE and sample lines alike).
        extra = [b"vllm:" + line[len(b"ragkv:"):] if line.startswith(b"ragkv:")
                 else line.replace(b" ragkv:", b" vllm:", 1)
                 for line in text.splitlines() if _vllm_series(line)]
        return text + b"\n".join(extra) + (b"\n" if extra else b"")

    def _advance(self, counter, key: str, total: float) -> None:
        delta = total - self._totals.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._totals[key] = total


# (metric name without prefix, TierStats field, help) of the per-tier counters.
_STORE_COUNTERS = (
    ("hits", "hits", "Chunk-store lookups this tier answered with a usable entry."),
    ("misses", "misses", "Chunk-store lookups this tier did not hold (or could not reach)."),
    ("read_bytes", "bytes_read", "Bytes of chunk entries read from this tier."),
    ("written_bytes", "bytes_written", "Bytes of chunk entries written to this tier."),
    ("corrupt_entries", "corrupt",
     "Entries found damaged or foreign (checksum, shape, model, truncation): deleted and "
     "recomputed, never served."),
    ("errors", "errors", "Backend failures of this tier (timeouts, refused connections); the "
     "engine computed the chunks itself."),
)


class _ChunkStoreCollector:
    """The chunk store's tiers as Prometheus families, read at scrape time."""

    def __init__(self, model_name: str, store: TieredChunkStore) -> None:
        self.model_name = model_name
        self.store = store

    def describe(self):
        return []  # families are only known when collected; nothing to pre-register

    def collect(self):
        labels = ["model_name", "tier"]
        tiers = self.store.stats()
        for name, field, doc in _STORE_COUNTERS:
            family = CounterMetricFamily(f"ragkv:chunk_store_{name}", doc, labels=labels)
            for t in tiers:
                family.add_metric([self.model_name, t.name], getattr(t, field))
            yield family
        available = GaugeMetricFamily(
            "ragkv:chunk_store_available", "1 if the tier's backend is reachable, else 0.",
            labels=labels)
        used = GaugeMetricFamily("ragkv:chunk_store_used_bytes",
                                 "Bytes this tier holds (Redis: bytes this replica wrote).",
                                 labels=labels)
        for t in tiers:
            available.add_metric([self.model_name, t.name], 1.0 if t.available else 0.0)
            used.add_metric([self.model_name, t.name], t.used_bytes)
        yield available
        yield used
        loads = HistogramMetricFamily(
            "ragkv:chunk_store_load_seconds",
            "Time to read and verify one chunk entry from a tier (hits only).", labels=labels)
        for t in tiers:
            cumulative, buckets = 0, []
            for bound, count in zip(LOAD_BUCKETS, t.load_buckets, strict=True):
                cumulative += count
                buckets.append((str(bound), cumulative))
            buckets.append(("+Inf", t.loads))
            loads.add_metric([self.model_name, t.name], buckets, t.load_seconds)
        yield loads
        dropped = CounterMetricFamily(
            "ragkv:chunk_store_dropped_writes",
            "Chunk writes to the shared tiers dropped because the writer fell behind.",
            labels=["model_name"])
        dropped.add_metric([self.model_name], self.store.dropped_writes)
        yield dropped


def _vllm_series(line: bytes) -> bool:
    """Whether an exposition line belongs to a series in VLLM_SERIES."""
    if line.startswith((b"# HELP ragkv:", b"# TYPE ragkv:")):
        name = line.split(b" ")[2]
    elif line.startswith(b"ragkv:"):
        name = line.split(b"{")[0].split(b" ")[0]
    else:
        return False
    name = name[len(b"ragkv:"):].decode()
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[:-len(suffix)] in VLLM_SERIES:
            return True
    return name in VLLM_SERIES

"""Prometheus metrics, named in vLLM's style with the `ragkv:` prefix.

Counters follow the engine's cumulative statistics (updated after every step from their
deltas); latency histograms are observed as tokens arrive. Each server owns its registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.engine import Engine
from ..outputs import RequestOutput

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
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
        self.prompt_tokens = counter("ragkv:prompt_tokens",
                                     "Prompt tokens processed (counted at a request's first "
                                     "token).")
        self.generation_tokens = counter("ragkv:generation_tokens", "Generated tokens.")
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
                if out.finished:
                    self._progress.pop(key, None)
                else:
                    self._progress[key] = (len(completion.token_ids), now)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _advance(self, counter, key: str, total: float) -> None:
        delta = total - self._totals.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._totals[key] = total

"""Chunk store: loading a chunk's KV from each tier against computing it, and a second
replica's first sight of a corpus another replica precomputed, measured side by side in one
run.

Part 1, load vs recompute: one request, S (64 tokens) + one chunk (`--chunk-tokens`, 512) + a
tiny question (`--load-question-tokens`, 4), `max_tokens=1`, so its time to first token is the
chunk's cost plus a small fixed part. Each run of a tier first evicts the chunk from the pool
(as memory pressure would: an engine with a host tier demotes it there), so the chunk comes
from that tier (host memory, a disk directory, Redis) and is promoted into the pool;
"recompute" is the same request on an engine with no store, its pool emptied, so the chunk is
computed; "pool" is that request again with the chunk still in the pool (the floor: nothing to
fetch, nothing to compute). Runs are interleaved across rows; medians of
`--repeats`. The tiers' own counters give each load's time alone (read + verify, no request
around it), entry sizes and bytes per token. The system prompt stays in the prefix cache
throughout (the store keeps chunks, not prefixes).

Part 2, a second replica: replica 1 (this process, an engine with a shared store: the Redis
server if there is one, else a disk directory) computes `--num-docs` documents, one request
per document as `ragkv precompute` does, and waits for the writes. Replica 2 is a fresh process
with its own empty pool and the same store; it serves `--num-requests` RAG requests of
`--docs-per-request` documents each, one at a time, and reports their TTFTs. A cold replica
(fresh process, no store) serves the same requests. Both warm up first on an unrelated prompt
of the same shape (another system prompt and other documents), so neither pays one-time
start-up costs in the measured requests; the first measured request computes S on both.
Requests take the corpus in a shuffled order without repeating a document until every
document has been used, so by default every chunk a replica sees is a first sight.

Every engine (replicas included) runs with shared positions and no recompute, so a cached
chunk is used as it is and what is timed is fetching or computing chunks (the engine's own
default, the quality mode, would also recompute chunk tokens of every request).

A private `redis-server` (no persistence) is started on a free loopback port when one is on
PATH; `--redis-url` uses yours instead, `--no-redis` skips Redis. Every run uses a fresh
`cache_salt`, so entries left in a Redis by an earlier run are never hits.

    python benchmarks/bench_store.py --model builtin:small --json store.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

# The tiers' caps: generous, they only bound what the benchmark writes.
HOST_CAP = "4GiB"
DISK_CAP = "100GiB"
# A TTFT difference below this is within the run-to-run spread of a ~10 ms request here.
NOISE_S = 0.001


def main() -> None:
    from ragkv.bench.workload import add_bench_shape_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_shape_args(parser, repeats=10)  # part 1's runs are short: take more of them
    # Part 2's corpus: 32 documents, 4 per request, 8 requests (each document seen once).
    parser.set_defaults(num_docs=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--chunk-tokens", type=int, default=512,
                        help="the chunk of the load-vs-recompute timing")
    parser.add_argument("--load-question-tokens", type=int, default=4,
                        help="the question of the load-vs-recompute request (tiny, so the "
                             "chunk's cost dominates)")
    parser.add_argument("--docs-per-request", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--tiers", default="host,disk,redis",
                        help="tiers of the load-vs-recompute timing")
    parser.add_argument("--redis-url", default=None,
                        help="an existing Redis (default: start a private redis-server); what the "
                             "run writes there stays, under a fresh cache_salt")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis tier")
    parser.add_argument("--skip-replicas", action="store_true", help="part 1 only")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument("--replica-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica_worker:
        replica_worker(args.replica_worker)
        return
    if args.docs_per_request > args.num_docs:
        parser.error("--docs-per-request exceeds --num-docs")

    import torch

    tiers = [t for t in args.tiers.split(",") if t]
    unknown = set(tiers) - {"host", "disk", "redis"}
    if unknown:
        parser.error(f"unknown tiers {sorted(unknown)}: host, disk, redis")
    results: dict = {"model": args.model, "device": args.device, "dtype": args.dtype,
                     "threads": torch.get_num_threads()}
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="ragkv-bench-store-"))
        redis_url = None
        if not args.no_redis:
            redis_url = args.redis_url or stack.enter_context(private_redis())
            if redis_url is None:
                print("note: redis-server is not on PATH (or the redis package is missing) "
                      "and no --redis-url was given: the Redis tier is skipped")
        if redis_url is None:
            tiers = [t for t in tiers if t != "redis"]
        results["redis"] = redis_url is not None
        results["load_vs_recompute"] = load_vs_recompute(args, tiers, workdir, redis_url)
        if not args.skip_replicas:
            # The replicas' own database of the private server (db 1), so part 1's entries
            # (db 0) cannot be hits; with --redis-url the URL is used as given.
            shared = (redis_url if args.redis_url or redis_url is None
                      else redis_url.rsplit("/", 1)[0] + "/1")
            spec = shared or f"disk:{os.path.join(workdir, 'replicas')}:{DISK_CAP}"
            results["replicas"] = second_replica(args, spec, "redis" if shared else "disk",
                                                 workdir)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


@contextlib.contextmanager
def private_redis():
    """The URL of a redis-server of our own (the test suite's fixture, tests/redis_server.py);
    None when redis-server is not installed."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from redis_server import RedisServer

    binary = RedisServer.find()
    if binary is None:
        yield None
        return
    server = RedisServer(binary)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def load_vs_recompute(args, tiers: list[str], workdir: str, redis_url: str | None) -> dict:
    from ragkv import LLM, RAGPrompt, SamplingParams

    specs = {"host": f"host:{HOST_CAP}", "disk": f"disk:{os.path.join(workdir, 'disk')}:"
             f"{DISK_CAP}", "redis": redis_url}
    # Shared positions, no recompute: the chunk is fetched or computed, nothing more.
    common = {"device": args.device, "dtype": args.dtype, "position_strategy": "shared"}
    llms = {"recompute": LLM(args.model, **common)}
    for tier in tiers:
        llms[tier] = LLM(args.model, chunk_store=specs[tier], **common)
    engine = llms["recompute"].engine
    mc = engine.model_config
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, mc.vocab_size) for _ in range(n)]

    salt = f"bench-store-{uuid.uuid4().hex}"
    prompt = RAGPrompt(tokens(args.system_tokens), [tokens(args.chunk_tokens)],
                       tokens(args.load_question_tokens), cache_salt=salt)
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def request(llm) -> tuple[float, int, int]:
        m = llm.generate(prompt, one, use_tqdm=False)[0].metrics
        return m.ttft, m.num_chunk_hits, m.num_chunk_misses

    def tier_stats(llm):
        return llm.get_chunk_cache_stats().store[0]

    # Warm-up: every engine computes the chunk once (each run's code paths warm), and the
    # shared tiers receive it (written through by the store's writer thread).
    for llm in llms.values():
        request(llm)
        llm.engine.flush_chunk_store()
    rows = ["recompute", "pool", *tiers]
    ttft: dict[str, list[float]] = {row: [] for row in rows}
    get_s: dict[str, list[float]] = {tier: [] for tier in tiers}
    for _ in range(args.repeats + 1):  # the first round (discarded) warms the load paths
        llms["recompute"].clear_chunk_cache()
        t, hits, misses = request(llms["recompute"])
        assert misses == 1, "recompute: the chunk was cached"
        ttft["recompute"].append(t)
        t, hits, _ = request(llms["recompute"])
        assert hits == 1, "pool: the chunk was not in the pool"
        ttft["pool"].append(t)
        for tier in tiers:
            llm = llms[tier]
            # Evict (not clear_chunk_cache(), which also empties the host tier): the pool's
            # entries leave it as under memory pressure, demoted to the host tier if any.
            cache = llm.engine.chunk_cache
            cache.evict(cache.capacity)
            before, store_before = tier_stats(llm), llm.get_chunk_cache_stats().store_hits
            t, hits, _ = request(llm)
            after, store_after = tier_stats(llm), llm.get_chunk_cache_stats().store_hits
            assert hits == 1 and store_after == store_before + 1, (
                f"{tier}: not a store hit ({hits} hits, store hits {store_before} -> "
                f"{store_after}, {before} -> {after})")
            assert after.loads == before.loads + 1
            ttft[tier].append(t)
            get_s[tier].append(after.load_seconds - before.load_seconds)
    for values in (*ttft.values(), *get_s.values()):
        del values[0]

    bytes_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * engine.dtype.itemsize
    payload = bytes_per_token * args.chunk_tokens
    t_re, t_pool = statistics.median(ttft["recompute"]), statistics.median(ttft["pool"])
    out: dict = {"chunk_tokens": args.chunk_tokens, "system_tokens": args.system_tokens,
                 "question_tokens": args.load_question_tokens, "repeats": args.repeats,
                 "dtype": str(engine.dtype).removeprefix("torch."),
                 "device": str(engine.device), "bytes_per_token": bytes_per_token,
                 "payload_bytes": payload, "recompute_ttft_s": t_re, "pool_ttft_s": t_pool,
                 "recompute_ttfts_s": ttft["recompute"], "pool_ttfts_s": ttft["pool"],
                 "tiers": {}}
    print(f"load vs recompute: S {args.system_tokens} + one {args.chunk_tokens}-token chunk + "
          f"Q {args.load_question_tokens}, max_tokens=1; {args.model} "
          f"({mc.num_layers} layers, {mc.num_kv_heads} KV heads x {mc.head_dim}, "
          f"{out['dtype']}, {out['device']}); {bytes_per_token:,} bytes/token, chunk payload "
          f"{payload / 2**20:.2f} MiB; median of {args.repeats}")
    print(f"{'chunk from':<10} {'TTFT ms':>9} {'- pool ms':>10} {'get() ms':>9} "
          f"{'entry bytes':>12} {'recompute/TTFT':>15} {'compute/load':>13}")
    print(f"{'recompute':<10} {t_re * 1e3:>9.2f} {(t_re - t_pool) * 1e3:>10.2f} {'':>9} "
          f"{'':>12} {1.0:>14.2f}x {'':>13}")
    print(f"{'pool':<10} {t_pool * 1e3:>9.2f} {0.0:>10.2f} {'':>9} {'':>12} "
          f"{t_re / t_pool:>14.2f}x {'':>13}")
    for tier in tiers:
        stats = tier_stats(llms[tier])
        t, g = statistics.median(ttft[tier]), statistics.median(get_s[tier])
        entry = stats.bytes_read // stats.loads
        load = t - t_pool  # fetching and promoting the chunk, over a request with it pooled
        # Computing the chunk over loading it. Below NOISE_S the load is lost in the TTFT's
        # run-to-run spread, so only a lower bound is given.
        chunk_ratio = (t_re - t_pool) / load if load >= NOISE_S else None
        out["tiers"][tier] = {"ttft_s": t, "ttfts_s": ttft[tier], "get_s": g,
                              "gets_s": get_s[tier], "load_over_pool_s": load,
                              "entry_bytes": entry, "header_bytes": entry - payload,
                              "speedup_over_recompute": t_re / t,
                              "compute_over_load": chunk_ratio}
        if chunk_ratio is not None:
            ratio = f"{chunk_ratio:12.1f}x"
        elif t_re - t_pool >= NOISE_S:
            ratio = f"{'>' + format((t_re - t_pool) / NOISE_S, '.0f'):>12}x"
        else:
            ratio = f"{'n/a':>13}"
        print(f"{tier:<10} {t * 1e3:>9.2f} {load * 1e3:>10.2f} {g * 1e3:>9.3f} {entry:>12,} "
              f"{t_re / t:>14.2f}x {ratio}")
    print("(- pool: TTFT minus the pool row's; get(): the tier's read + verify alone; "
          "compute/load: (recompute - pool) / (tier - pool), a bound where tier - pool < "
          f"{NOISE_S * 1e3:.0f} ms)")
    for llm in llms.values():
        llm.engine.close()
    return out


def second_replica(args, spec: str, kind: str, workdir: str) -> dict:
    """Replica 1 (this process) precomputes the corpus into the shared store; replica 2 and a
    cold replica (fresh processes) serve the same requests."""
    from ragkv import LLM, RAGPrompt, SamplingParams

    llm = LLM(args.model, chunk_store=spec, device=args.device, dtype=args.dtype,
              max_num_batched_tokens=4096, position_strategy="shared")
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    salt = f"bench-store-{uuid.uuid4().hex}"
    system = tokens(args.system_tokens)
    docs = [tokens(args.doc_tokens) for _ in range(args.num_docs)]
    # Request i takes the next documents of one shuffled pass over the corpus (then another).
    order: list[int] = []
    need = args.num_requests * args.docs_per_request
    while len(order) < need:
        shuffled = list(range(args.num_docs))
        rng.shuffle(shuffled)
        order += shuffled
    requests = [{"chunks": [docs[d] for d in order[i * args.docs_per_request:
                                                     (i + 1) * args.docs_per_request]],
                 "question": tokens(args.question_tokens)} for i in range(args.num_requests)]
    occurrences = need
    distinct = len(set(order[:need]))
    # The warm-up prompt shares nothing with the corpus (its own S and documents).
    warmup = {"system": tokens(args.system_tokens),
              "chunks": [tokens(args.doc_tokens) for _ in range(args.docs_per_request)],
              "question": tokens(args.question_tokens)}

    # Replica 1: one request per document, as `ragkv precompute` does (a one-token question,
    # one output token), all queued at once; then wait for the writes to land.
    memory_before = redis_used_memory(spec) if kind == "redis" else None
    start = time.perf_counter()
    prompts = [RAGPrompt(system, [doc], tokens(1), cache_salt=salt) for doc in docs]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    llm.engine.flush_chunk_store()
    precompute_s = time.perf_counter() - start
    written = sum(t.writes for t in llm.get_chunk_cache_stats().store)
    entry_bytes = sum(t.bytes_written for t in llm.get_chunk_cache_stats().store) // written
    # What an entry costs the Redis server (its allocator rounds values up to size classes),
    # which is what maxmemory must be sized by.
    redis_per_entry = ((redis_used_memory(spec) - memory_before) // written
                       if memory_before is not None else None)
    llm.engine.close()
    del llm

    job = {"model": args.model, "device": args.device, "dtype": args.dtype, "salt": salt,
           "system": system, "requests": requests, "warmup": warmup}
    runs = {}
    for name, store in (("warm", spec), ("cold", None)):
        path = os.path.join(workdir, f"replica-{name}.json")
        with open(path, "w") as f:
            json.dump({**job, "store": store, "out": path + ".out"}, f)
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--replica-worker",
                            path], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{name} replica failed:\n{r.stdout}{r.stderr}")
        with open(path + ".out") as f:
            runs[name] = json.load(f)
    warm, cold = runs["warm"], runs["cold"]
    out = {"store": kind, "num_docs": args.num_docs, "doc_tokens": args.doc_tokens,
           "system_tokens": args.system_tokens, "question_tokens": args.question_tokens,
           "docs_per_request": args.docs_per_request, "num_requests": args.num_requests,
           "chunk_occurrences": occurrences, "distinct_docs": distinct,
           "precompute_s": precompute_s, "precompute_entries_written": written,
           "entry_bytes": entry_bytes, "redis_used_memory_per_entry": redis_per_entry,
           "warm": warm, "cold": cold,
           "cold_over_warm_mean": cold["ttft_mean_s"] / warm["ttft_mean_s"],
           "cold_over_warm_median": cold["ttft_median_s"] / warm["ttft_median_s"]}
    print(f"second replica, store {kind}: corpus {args.num_docs} x {args.doc_tokens} tokens "
          f"(S {args.system_tokens}) precomputed by replica 1 in {precompute_s:.2f} s "
          f"({written} entries of {entry_bytes:,} bytes written"
          + (f", {redis_per_entry:,} bytes of Redis memory each" if redis_per_entry else "")
          + f"); {args.num_requests} requests of "
          f"{args.docs_per_request} documents + Q {args.question_tokens}, one at a time, each "
          "replica a fresh process")
    print(f"{'replica':<26} {'TTFT mean ms':>13} {'median ms':>10} {'chunk hits':>11} "
          f"{'from store':>11} {'computed':>9} {'start s':>8}")
    for name, label in (("warm", f"2: shared store ({kind})"), ("cold", "cold: no store")):
        r = runs[name]
        print(f"{label:<26} {r['ttft_mean_s'] * 1e3:>13.1f} {r['ttft_median_s'] * 1e3:>10.1f} "
              f"{r['chunk_hits']:>11} {r['store_hits']:>11} {r['chunk_misses']:>9} "
              f"{r['start_s']:>8.1f}")
    print(f"cold / replica 2 TTFT: mean {out['cold_over_warm_mean']:.1f}x, median "
          f"{out['cold_over_warm_median']:.1f}x; replica 2 served {warm['store_hits']} of "
          f"{occurrences} chunk occurrences from the store ({distinct} distinct documents), "
          f"store load {warm['store_load_s'] / max(warm['store_loads'], 1) * 1e3:.2f} ms per "
          "chunk")
    return out


def redis_used_memory(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def replica_worker(path: str) -> None:
    """One replica in its own process: build the engine, warm up, serve the job's requests
    one at a time, write their TTFTs and the chunk cache's counters."""
    start = time.perf_counter()
    from ragkv import LLM, RAGPrompt, SamplingParams

    with open(path) as f:
        job = json.load(f)
    llm = LLM(job["model"], chunk_store=job["store"], device=job["device"], dtype=job["dtype"],
              max_num_batched_tokens=4096, position_strategy="shared")
    start_s = time.perf_counter() - start
    one = SamplingParams(max_tokens=1, temperature=0.0)
    w = job["warmup"]
    llm.generate(RAGPrompt(w["system"], w["chunks"], w["question"], cache_salt=job["salt"]),
                 one, use_tqdm=False)
    llm.engine.flush_chunk_store()  # the warm-up's write-through must not overlap the timing
    before = llm.get_chunk_cache_stats()
    ttfts = []
    for r in job["requests"]:
        prompt = RAGPrompt(job["system"], r["chunks"], r["question"], cache_salt=job["salt"])
        ttfts.append(llm.generate(prompt, one, use_tqdm=False)[0].metrics.ttft)
    after = llm.get_chunk_cache_stats()
    tiers = [(a, b) for a, b in zip(after.store, before.store, strict=True)]
    result = {"store": job["store"], "start_s": start_s, "ttfts_s": ttfts,
              "ttft_mean_s": statistics.fmean(ttfts), "ttft_median_s": statistics.median(ttfts),
              "chunk_lookups": after.lookups - before.lookups,
              "chunk_hits": after.hits - before.hits,
              "chunk_misses": after.misses - before.misses,
              "store_hits": after.store_hits - before.store_hits,
              "store_hit_tokens": after.store_hit_tokens - before.store_hit_tokens,
              "store_loads": sum(a.loads - b.loads for a, b in tiers),
              "store_load_s": sum(a.load_seconds - b.load_seconds for a, b in tiers),
              "store_bytes_read": sum(a.bytes_read - b.bytes_read for a, b in tiers),
              "store_errors": sum(a.errors - b.errors for a, b in tiers),
              "store_corrupt": sum(a.corrupt - b.corrupt for a, b in tiers)}
    llm.engine.close()
    with open(job["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

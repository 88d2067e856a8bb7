"""Soak test: a real server under many clients mixing everything, for minutes, hostile requests
included; no request may stall the others, none may be lost, and memory must not creep.

Starts `ragkv serve MODEL` on a free loopback port and runs `--clients` concurrent clients for
`--minutes`, each looping over a random mix of:
- plain completions (streamed; their TTFT is the latency figure);
- RAG chats with 2-4 documents of the demo corpus (`documents`), streamed or not, in the
  server's default RAG mode (the quality mode unless --serve-args says otherwise: sequential
  positions with the model's calibrated selective recompute, else the model-agnostic one);
- the same naming their own recompute (`recompute`: sink+query or blend, a fixed r = 0.15);
- structured outputs (a small JSON schema, `response_format`);
- penalties and logit_bias;
- streams the client cuts after two chunks;
- hostile structured outputs (unless --no-hostile): a $ref diamond of 22 levels, a chain of 280
  refs, an ambiguous recursive anyOf pushed by logit_bias: a 400 or a fast finish is right.
Reported: the server's default RAG mode (from /v1/models), requests by kind and status, lost
(no response within --timeout), 5xx, the server's RSS (sampled every 5 s: growth after the
first minute), the pool back at its baseline after the load (kv usage, running and waiting
requests, /debug/integrity), and the p50/p99 TTFT of plain requests against an unloaded run
measured first.

The KV pool is allocated untouched (torch.empty) and its pages enter the RSS as slots are
first used, so with the default 2 GiB pool the RSS climbs for many minutes without any leak;
a pool small enough for the load to touch in its first minute (the second command) makes the
growth after it mean what it should:

    python benchmarks/soak.py --model smollm2-135m-instruct --clients 64 --minutes 10
    python benchmarks/soak.py --clients 64 --minutes 10 \
        --serve-args "--kv-cache-tokens 12288 --chunk-cache-tokens 4096"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter

KEY = "soak-key"


def _diamond(levels: int) -> dict:
    defs = {f"n{i}": {"anyOf": [{"$ref": f"#/$defs/n{i + 1}"}] * 2} for i in range(levels)}
    defs[f"n{levels}"] = {"type": "string", "maxLength": 8}
    return {"$ref": "#/$defs/n0", "$defs": defs}


def _chain(links: int) -> dict:
    defs = {f"n{i}": {"$ref": f"#/$defs/n{i + 1}"} for i in range(links)}
    defs[f"n{links}"] = {"type": "string", "maxLength": 8}
    return {"$ref": "#/$defs/n0", "$defs": defs}


AMBIGUOUS = {"anyOf": [{"type": "array", "items": {"$ref": "#"}},
                       {"type": "array", "items": {"$ref": "#"}, "maxItems": 3}]}
SMALL_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                                 "sure": {"type": "boolean"}},
                "required": ["answer", "sure"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Soak:
    def __init__(self, args: argparse.Namespace, base: str, model: str) -> None:
        import httpx

        self.args = args
        self.base = base
        self.model = model
        self.client = httpx.AsyncClient(base_url=base, timeout=args.timeout,
                                        headers={"Authorization": f"Bearer {KEY}"},
                                        limits=httpx.Limits(max_connections=args.clients + 8))
        self.status: Counter = Counter()  # (kind, status)
        self.lost: Counter = Counter()
        self.plain_ttft: list[float] = []
        self.rng = random.Random(0)
        from ragkv.entrypoints.demo_corpus import DOCUMENTS, QUESTIONS

        self.documents = list(DOCUMENTS)
        self.questions = [q.question for q in QUESTIONS]

    async def stream_ttft(self, body: dict, path: str, cut_after: int | None = None
                          ) -> tuple[int, float | None]:
        """POST a streaming request; (status, seconds to the first content chunk)."""
        start = time.perf_counter()
        first = None
        async with self.client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, None
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    code = data["error"].get("code") or 500
                    return int(code) if str(code).isdigit() else 500, first
                if first is None and _has_content(data):
                    first = time.perf_counter() - start
                chunks += 1
                if cut_after is not None and chunks >= cut_after:
                    return 200, first  # leaving the block closes the connection mid-stream
        return 200, first

    def chat_body(self, stream: bool, **extra) -> dict:
        docs = self.rng.sample(self.documents, self.rng.randint(2, min(4, len(self.documents))))
        return {"model": self.model, "stream": stream, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "system", "content": "Answer from the documents."},
                             {"role": "user", "content": self.rng.choice(self.questions)}],
                "documents": docs, **extra}

    async def one(self) -> None:
        rng = self.rng
        kind = rng.choices(
            ["plain", "rag", "recompute", "structured", "penalties", "cut", "hostile"],
            weights=[25, 25, 10, 10, 10, 10, 0 if self.args.no_hostile else 10])[0]
        try:
            if kind == "plain":
                status, ttft = await self.stream_ttft(
                    {"model": self.model, "prompt": f"Story {rng.randrange(10**6)}:",
                     "max_tokens": 16, "stream": True}, "/v1/completions")
                if status == 200 and ttft is not None:
                    self.plain_ttft.append(ttft)
            elif kind == "rag":
                stream = rng.random() < 0.5
                if stream:
                    status, _ = await self.stream_ttft(self.chat_body(True),
                                                       "/v1/chat/completions")
                else:
                    r = await self.client.post("/v1/chat/completions",
                                               json=self.chat_body(False))
                    status = r.status_code
            elif kind == "recompute":
                method = rng.choice(["sink+query", "blend"])
                r = await self.client.post("/v1/chat/completions", json=self.chat_body(
                    False, recompute=method, recompute_ratio=0.15))
                status = r.status_code
            elif kind == "structured":
                r = await self.client.post("/v1/chat/completions", json=self.chat_body(
                    False, max_tokens=60, response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "a", "schema": SMALL_SCHEMA}}))
                status = r.status_code
            elif kind == "penalties":
                r = await self.client.post("/v1/completions", json={
                    "model": self.model, "prompt": "List some fruit:", "max_tokens": 20,
                    "presence_penalty": 0.5, "frequency_penalty": 0.5,
                    "repetition_penalty": 1.2, "logit_bias": {"28": 5.0}})
                status = r.status_code
            elif kind == "cut":
                status, _ = await self.stream_ttft(self.chat_body(True, max_tokens=64),
                                                   "/v1/chat/completions", cut_after=2)
            else:
                status = await self.hostile()
        except Exception as e:  # noqa: BLE001 (counted: a lost request)
            self.lost[f"{kind}: {type(e).__name__}"] += 1
            return
        self.status[(kind, status)] += 1

    async def hostile(self) -> int:
        which = self.rng.choice(["diamond", "chain", "ambiguous"])
        schema = {"diamond": _diamond(22), "chain": _chain(280), "ambiguous": AMBIGUOUS}[which]
        body = {"model": self.model, "prompt": "JSON:", "max_tokens": 40,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": which, "schema": schema}}}
        if which == "ambiguous":
            body["logit_bias"] = {str(self.args.bracket_token): 100}
        r = await self.client.post("/v1/completions", json=body)
        return r.status_code

    async def client_loop(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            await self.one()

    async def get_metrics(self) -> dict[str, float]:
        r = await self.client.get("/metrics")
        out = {}
        for line in r.text.splitlines():
            m = re.match(r'(ragkv:(?:kv_cache_usage_perc|num_requests_running|'
                         r'num_requests_waiting|chunk_cache_usage_perc))\{[^}]*\} (\S+)', line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out


def _has_content(chunk: dict) -> bool:
    for choice in chunk.get("choices", ()):
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def run(args: argparse.Namespace, base: str, pid: int, model: str) -> dict:
    soak = Soak(args, base, model)
    # Unloaded: plain streamed completions one at a time.
    unloaded = []
    for i in range(args.unloaded_requests):
        status, ttft = await soak.stream_ttft({"model": model, "prompt": f"Story {i}:",
                                               "max_tokens": 16, "stream": True},
                                              "/v1/completions")
        assert status == 200 and ttft is not None, status
        unloaded.append(ttft)
    baseline = await soak.get_metrics()
    rss = [(0.0, rss_mb(pid))]
    start = time.monotonic()
    deadline = start + 60 * args.minutes

    async def sample_rss() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(5)
            rss.append((time.monotonic() - start, rss_mb(pid)))

    sampler = asyncio.create_task(sample_rss())
    await asyncio.gather(*(soak.client_loop(deadline) for _ in range(args.clients)))
    await sampler
    # Idle again: every request done, the pool as before, the integrity walk clean.
    for _ in range(120):
        after = await soak.get_metrics()
        if not after.get("ragkv:num_requests_running") and not after.get(
                "ragkv:num_requests_waiting"):
            break
        await asyncio.sleep(0.5)
    integrity = (await soak.client.get("/debug/integrity")).json()
    await soak.client.aclose()
    after_minute = [mb for t, mb in rss if t >= 60] or [rss[-1][1]]
    statuses = Counter()
    for (_, status), n in soak.status.items():
        statuses[status] += n
    return {
        "clients": args.clients, "minutes": args.minutes, "hostile": not args.no_hostile,
        "requests": sum(soak.status.values()), "lost": sum(soak.lost.values()),
        "lost_by_kind": dict(soak.lost), "status": {str(k): v for k, v in statuses.items()},
        "by_kind": {f"{k} {s}": n for (k, s), n in sorted(soak.status.items())},
        "server_5xx": sum(n for s, n in statuses.items() if s >= 500),
        "rss_mb": {"start": rss[0][1], "at_1min": after_minute[0], "max_after_1min":
                   max(after_minute), "end": rss[-1][1]},
        "rss_growth_after_1min": max(after_minute) / after_minute[0] - 1,
        "rss_timeline": [(round(t), round(mb)) for t, mb in rss],
        "metrics_before": baseline, "metrics_after": after, "integrity": integrity,
        "plain_ttft_unloaded_s": {"p50": statistics.median(unloaded),
                                  "p99": percentile(unloaded, 0.99)},
        "plain_ttft_loaded_s": {"p50": statistics.median(soak.plain_ttft or [float("nan")]),
                                "p99": percentile(soak.plain_ttft, 0.99),
                                "count": len(soak.plain_ttft)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="a request without a response after this many seconds is lost")
    parser.add_argument("--unloaded-requests", type=int, default=20)
    parser.add_argument("--no-hostile", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--serve-args", default="", help="extra `ragkv serve` flags")
    args = parser.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "ragkv", "serve", args.model, "--port", str(port),
           "--api-key", KEY, *args.serve_args.split()]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        import httpx

        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"server exited: {server.stderr.read()[-2000:]}")
            time.sleep(0.5)
        models = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                           timeout=10).json()
        model = models["data"][0]["id"]
        from ragkv.model.loader import load_tokenizer, resolve_model_path

        tokenizer = load_tokenizer(resolve_model_path(args.model))
        args.bracket_token = tokenizer.encode("[", add_special_tokens=False)[0]
        result = asyncio.run(run(args, base, server.pid, model))
        # What the `rag` requests got: the server's default layout and recompute.
        result["rag_default"] = models["data"][0].get("recompute")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    print(json.dumps(result, indent=2))
    ratio = result["plain_ttft_loaded_s"]["p99"] / result["plain_ttft_unloaded_s"]["p99"]
    print(f"requests {result['requests']}, lost {result['lost']}, 5xx {result['server_5xx']}, "
          f"RSS growth after the first minute {100 * result['rss_growth_after_1min']:.1f}%, "
          f"plain p99 TTFT {result['plain_ttft_loaded_s']['p99'] * 1e3:.0f} ms loaded vs "
          f"{result['plain_ttft_unloaded_s']['p99'] * 1e3:.0f} ms unloaded ({ratio:.1f}x), "
          f"integrity {result['integrity']}")
    rag = result["rag_default"] or {}
    print(f"RAG chats in the server's default mode: positions {rag.get('position_strategy')}, "
          f"recompute {rag.get('recompute')} (ratio {rag.get('recompute_ratio')}, min ratio "
          f"{rag.get('recompute_min_ratio')}, score mass {rag.get('recompute_score_mass')}; "
          f"{rag.get('source')})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

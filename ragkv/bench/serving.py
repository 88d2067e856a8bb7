"""Serving benchmark: drive a running OpenAI-compatible server with streaming completions.

The token-level workload is turned into text with a tokenizer (the documents' text has the
separator's characters removed) and sent as `system ## doc ## ... ## question` prompts, each
request naming its `chunk_separator` (the server splits nothing unless told).
Requests start on a Poisson schedule at `request_rate` per second (all at once when infinite),
at most `concurrency` in flight. Uses only the standard library as the HTTP client.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from .offline import percentiles
from .workload import BenchRequest, WorkloadConfig, make_workload


@dataclass(slots=True)
class StreamResult:
    ok: bool
    error: str | None = None
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


def _headers(api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def served_model(url: str, api_key: str | None) -> str:
    req = urllib.request.Request(f"{url}/v1/models", headers=_headers(api_key))
    with urllib.request.urlopen(req, timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def stream_completion(url: str, body: dict, api_key: str | None,
                      timeout: float = 600) -> StreamResult:
    data = json.dumps(body).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=data, headers=_headers(api_key))
    start = time.perf_counter()
    result = StreamResult(ok=False)
    last = None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    result.ok = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = chunk["error"].get("message")
                    break
                now = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                if chunk.get("choices"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
    except (urllib.error.URLError, OSError, ValueError) as e:
        detail = e.read().decode(errors="replace")[:300] if hasattr(e, "read") else ""
        result.error = f"{e} {detail}".strip()
        result.ok = False
    result.e2e = time.perf_counter() - start
    return result


# The separator the prompts are written with, sent with each request.
SEPARATOR = "##"


def workload_prompts(requests: list[BenchRequest], tokenizer,
                     separator: str = SEPARATOR) -> list[str]:
    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True).replace(separator, " ")

    return [f"{text(r.system)} {separator} "
            + f" {separator} ".join(text(c) for c in r.chunks)
            + f" {separator} {text(r.question)}" for r in requests]


def run_serving(url: str, config: WorkloadConfig, tokenizer, concurrency: int = 8,
                request_rate: float = float("inf"), api_key: str | None = None,
                progress: bool = True) -> dict:
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if request_rate <= 0:
        raise ValueError("request_rate must be positive (inf: all at once)")
    url = url.rstrip("/")
    model = served_model(url, api_key)
    requests = make_workload(config, len(tokenizer))
    prompts = workload_prompts(requests, tokenizer)
    rng = random.Random(config.seed)
    starts, t = [], 0.0
    for _ in prompts:
        starts.append(t)
        if request_rate != float("inf"):
            t += rng.expovariate(request_rate)
    bar = tqdm(total=len(prompts), desc="requests", disable=not progress, leave=False)
    lock = threading.Lock()
    origin = time.perf_counter()

    def one(i: int) -> StreamResult:
        delay = starts[i] - (time.perf_counter() - origin)
        if delay > 0:
            time.sleep(delay)
        body = {"model": model, "prompt": prompts[i], "max_tokens": config.output_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "chunk_separator": SEPARATOR}
        result = stream_completion(url, body, api_key)
        with lock:
            bar.update(1)
        return result

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, range(len(prompts))))
    duration = time.perf_counter() - origin
    bar.close()
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    return {
        "url": url, "model": model, "workload": config.to_dict(),
        "concurrency": concurrency, "request_rate": request_rate,
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput_tok_s": output_tokens / duration,
        "output_tokens": output_tokens, "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r.cached_tokens for r in done),
        "ttft_s": percentiles([r.ttft for r in done]),
        "itl_s": percentiles([x for r in done for x in r.itls]),
        "e2e_s": percentiles([r.e2e for r in done]),
    }


def format_serving(results: dict) -> str:
    ms = 1000.0
    t, i, e = results["ttft_s"], results["itl_s"], results["e2e_s"]
    cached = results["cached_tokens"] / results["prompt_tokens"] if results["prompt_tokens"] \
        else 0.0
    return "\n".join([
        f"server {results['url']} model {results['model']}, concurrency "
        f"{results['concurrency']}, request rate {results['request_rate']}",
        f"completed {results['completed']}, failed {results['failed']} in "
        f"{results['duration_s']:.1f} s: {results['request_throughput']:.2f} req/s, "
        f"{results['output_throughput_tok_s']:.1f} output tok/s",
        f"TTFT  p50 {t['p50'] * ms:.1f} ms  p90 {t['p90'] * ms:.1f} ms  "
        f"p99 {t['p99'] * ms:.1f} ms",
        f"ITL   mean {i['mean'] * ms:.1f} ms  p50 {i['p50'] * ms:.1f} ms  "
        f"p99 {i['p99'] * ms:.1f} ms",
        f"E2E   p50 {e['p50'] * ms:.1f} ms  p90 {e['p90'] * ms:.1f} ms",
        f"prompt tokens served from cache: {cached:.1%}",
    ])

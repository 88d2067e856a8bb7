"""What a hostile structured-output request costs the request beside it, over HTTP.

Starts `ragkv serve MODEL` and times a 4-token completion: alone (the unloaded latency), then
sent together with each of: a small benign JSON schema (the control: two requests share the
steps), a $ref diamond of 22 levels, a chain of 280 $refs, and an ambiguous recursive anyOf
pushed to nest by logit_bias (its grammar outgrows its budget: a 400). Prints, per case, the
hostile request's status and time and the 4-token request's latency against the unloaded one
(medians over --repeats):

    python benchmarks/bench_hostile.py --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import statistics
import subprocess
import sys
import time

from soak import AMBIGUOUS, KEY, SMALL_SCHEMA, _chain, _diamond, free_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import httpx

    from ragkv.model.loader import load_tokenizer, resolve_model_path

    bracket = load_tokenizer(resolve_model_path(args.model)).encode(
        "[", add_special_tokens=False)[0]
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "ragkv", "serve", args.model, "--port",
                               str(port), "--api-key", KEY], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        http = httpx.Client(base_url=base, timeout=600,
                            headers={"Authorization": f"Bearer {KEY}"})
        model = http.get("/v1/models").json()["data"][0]["id"]
        small = {"model": model, "prompt": "Hello there, how are", "max_tokens": 4,
                 "temperature": 0, "ignore_eos": True}

        def timed(body: dict) -> tuple[int, float]:
            start = time.perf_counter()
            status = http.post("/v1/completions", json=body).status_code
            return status, time.perf_counter() - start

        def schema_body(schema: dict, bias: dict | None = None) -> dict:
            body = {"model": model, "prompt": "JSON:", "max_tokens": 40,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "x", "schema": schema}}}
            if bias:
                body["logit_bias"] = bias
            return body

        # Warm up: the first constrained request builds the vocabulary's trie (once).
        timed(schema_body(SMALL_SCHEMA))
        for _ in range(3):
            timed(small)
        unloaded = statistics.median(timed(small)[1] for _ in range(2 * args.repeats))
        print(f"4-token completion alone: {unloaded * 1e3:.0f} ms (median)")
        cases = [("benign schema (control)", schema_body(SMALL_SCHEMA)),
                 ("$ref diamond, 22 levels", schema_body(_diamond(22))),
                 ("$ref chain, 280 links", schema_body(_chain(280))),
                 ("ambiguous anyOf + logit_bias", schema_body(AMBIGUOUS, {str(bracket): 100}))]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for name, body in cases:
                beside, hostile = [], []
                for _ in range(args.repeats):
                    h = pool.submit(timed, body)
                    time.sleep(0.005)  # the hostile request first, as in the repro
                    s = pool.submit(timed, small)
                    hostile.append(h.result())
                    beside.append(s.result()[1])
                took = statistics.median(beside)
                statuses = sorted({status for status, _ in hostile})
                print(f"{name:30s} hostile {statuses} in "
                      f"{statistics.median(t for _, t in hostile) * 1e3:6.0f} ms; 4-token "
                      f"request beside it {took * 1e3:5.0f} ms ({took / unloaded:.2f}x alone)")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


if __name__ == "__main__":
    main()

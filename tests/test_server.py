"""A real `ragkv serve` process on loopback, driven with the official `openai` client."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
from conftest import running_server
from openai import OpenAI

from ragkv import LLM, RAGPrompt, SamplingParams

MODEL = "builtin:tiny"
KEY = "sk-test-key"
MAX_MODEL_LEN = 2048
DOCS_PROMPT = ("You answer from the documents. ## Bread needs flour, water and salt. "
               "## Rye bread is dense and dark. ## Which bread is denser?")


@pytest.fixture(scope="module")
def server():
    with running_server(MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes",
                        "200000", env={"RAGKV_API_KEY": KEY}) as base:
        yield base


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, max_model_len=MAX_MODEL_LEN)


def integrity(base: str) -> dict:
    report = httpx.get(f"{base}/debug/integrity", timeout=30,
                       headers={"Authorization": f"Bearer {KEY}"}).json()
    assert report["ok"], report
    return report


def wait_idle(base: str, timeout: float = 30) -> dict:
    """The integrity report once nothing runs or waits (or when the timeout is up)."""
    deadline = time.monotonic() + timeout
    while True:
        report = integrity(base)
        idle = report["num_running"] == 0 and report["num_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert match, f"{name} not exported"
    return float(match.group(1))


def test_models_and_health(server, client):
    assert httpx.get(f"{server}/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_equals_offline_engine(client, offline):
    for prompt in ("Once upon a time", DOCS_PROMPT):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        want = offline.generate(prompt, SamplingParams(max_tokens=8, temperature=0),
                                use_tqdm=False)[0]
        assert r.choices[0].text == want.outputs[0].text
        assert r.choices[0].finish_reason == want.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_streaming_equals_non_streaming(client):
    for kwargs in ({"prompt": DOCS_PROMPT}, {"prompt": "Plain text prompt"}):
        full = client.completions.create(model=MODEL, max_tokens=12, temperature=0, **kwargs)
        chunks = list(client.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                                stream=True, **kwargs))
        assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
        assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    messages = [{"role": "user", "content": "Tell me about rye."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                          temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_documents_and_separators_agree(client, offline):
    docs = ["Bread needs flour, water and salt.", " Rye bread is dense and dark."]
    system = {"role": "system", "content": "You answer from the documents."}
    by_field = client.chat.completions.create(
        model=MODEL, messages=[system, {"role": "user", "content": "Which is denser?"}],
        max_tokens=10, temperature=0, extra_body={"documents": docs})
    by_separator = client.chat.completions.create(
        model=MODEL, max_tokens=10, temperature=0,
        messages=[system, {"role": "user", "content": "##".join([*docs, "Which is denser?"])}])
    assert by_field.choices[0].message.content == by_separator.choices[0].message.content
    # The same split computed offline: system part, documents as chunks, question part.
    from ragkv.prompt import split_chat_prompt

    prompt, _ = split_chat_prompt(offline.get_tokenizer(), [
        {"role": "system", "content": "You answer from the documents."},
        {"role": "user", "content": "Which is denser?"}], docs)
    want = offline.generate(RAGPrompt(prompt.system, prompt.chunks, prompt.question),
                            SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0]
    assert by_field.choices[0].message.content == want.outputs[0].text
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2)
    assert plain.choices[0].message.role == "assistant"
    assert len(plain.choices[0].logprobs.content) == plain.usage.completion_tokens
    assert len(plain.choices[0].logprobs.content[0].top_logprobs) == 2


def test_cached_tokens_and_chunk_hit_metrics(server, client):
    docs = [" The first document talks about rivers and boats.",
            " The second document talks about mountains and snow.",
            " The third document talks about deserts and wind."]
    hits_before = metric(server, "ragkv:chunk_cache_hits_total")
    queries_before = metric(server, "ragkv:chunk_cache_queries_total")
    first = client.completions.create(
        model=MODEL, prompt="Sys##" + "##".join(docs) + "##Q1?", max_tokens=2, temperature=0)
    again = client.completions.create(
        model=MODEL, prompt="Sys##" + "##".join(reversed(docs)) + "##Another question?",
        max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens <= 1  # at most the shared BOS
    # Reordered documents: every chunk and the system prompt come from the caches.
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 6
    assert metric(server, "ragkv:chunk_cache_queries_total") == queries_before + 6
    assert metric(server, "ragkv:chunk_cache_hits_total") == hits_before + 3
    assert metric(server, "ragkv:prompt_tokens_total") > 0
    assert metric(server, "ragkv:generation_tokens_total") > 0
    text = httpx.get(f"{server}/metrics").text
    for name in ("ragkv:chunk_cache_evictions_total", "ragkv:prefix_cache_queries_total",
                 "ragkv:prefix_cache_hits_total", "ragkv:chunk_cache_usage_perc",
                 "ragkv:kv_cache_usage_perc", "ragkv:num_requests_running",
                 "ragkv:num_requests_waiting", "ragkv:time_to_first_token_seconds_bucket",
                 "ragkv:inter_token_latency_seconds_bucket"):
        assert name in text
    integrity(server)


def test_api_key_enforced(server):
    url = f"{server}/v1/completions"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(url, json=body).status_code == 401
    wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server}/v1/models").status_code == 401
    ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    assert httpx.get(f"{server}/health").status_code == 200  # outside /v1: open


@pytest.mark.parametrize("body,status,fragment", [
    (b"{not json", 400, "malformed JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"model": "nope", "prompt": "hi"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": {"prompt_token_ids": 1}}, 400, "prompt"),
    ({"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN + 1)}, 400, "max_model_len"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 2}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n must"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "system ## a document ##   "}, 400, "question"),
    ({"model": MODEL, "prompt": ""}, 400, "empty"),
    ({"model": MODEL, "prompt": "x" * 300_000}, 413, "body"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
])
def test_bad_requests_get_4xx_and_server_keeps_serving(server, client, body, status, fragment):
    chat = isinstance(body, dict) and "messages" in body
    endpoint = "chat/completions" if chat else "completions"
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server}/v1/{endpoint}", content=content, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"]
    assert httpx.get(f"{server}/health").status_code == 200
    good = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=2)
    assert good.choices[0].finish_reason in ("length", "stop")
    report = integrity(server)
    assert report["num_running"] == 0


def test_chat_empty_question_with_documents(client):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="question"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "  "}], max_tokens=2,
            extra_body={"documents": ["a document"]})


def test_64_concurrent_requests_from_16_clients(server):
    results: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        c = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            for i in range(4):
                prompt = f"Sys ## doc {w % 5} ## doc {(w + i) % 7} ## question {w}-{i}?"
                if i % 2:
                    chunks = list(c.completions.create(model=MODEL, prompt=prompt,
                                                       max_tokens=6, stream=True, seed=w))
                    reason = chunks[-1].choices[0].finish_reason
                else:
                    reason = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                                  seed=w).choices[0].finish_reason
                with lock:
                    results.append(reason)
        except BaseException as e:  # noqa: BLE001 (collected and asserted on)
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert len(results) == 64 and all(r in ("length", "stop") for r in results)
    assert integrity(server)["num_running"] == 0


def test_disconnect_mid_stream_aborts_and_frees_slots(server):
    before = integrity(server)
    generated_before = metric(server, "ragkv:generation_tokens_total")
    body = {"model": MODEL, "prompt": DOCS_PROMPT, "max_tokens": 1900, "ignore_eos": True,
            "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=30) as http, http.stream(
            "POST", f"{server}/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        lines = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines += 1
            if lines >= 3:
                break  # leave mid-stream: the connection closes here
    report = wait_idle(server)
    assert report["num_running"] == 0 and report["num_waiting"] == 0
    # Every general slot is free or only held by the reusable prefix cache, as before.
    assert report["kv_available_tokens"] == report["kv_capacity_tokens"]
    assert report["kv_capacity_tokens"] == before["kv_capacity_tokens"]
    assert metric(server, "ragkv:generation_tokens_total") - generated_before < 1900
    assert metric(server, "ragkv:num_requests_running") == 0


def test_disconnect_during_non_streaming_request_aborts_it(server):
    generated_before = metric(server, "ragkv:generation_tokens_total")
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 1900, "n": 4,
            "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", json=body, timeout=1.0,
                   headers={"Authorization": f"Bearer {KEY}"})
    report = wait_idle(server)
    assert report["num_running"] == 0
    assert report["kv_available_tokens"] == report["kv_capacity_tokens"]
    assert metric(server, "ragkv:generation_tokens_total") - generated_before < 4 * 1900


def test_debug_endpoint_and_unknown_routes_follow_the_api_key_and_error_format(server):
    assert httpx.get(f"{server}/debug/integrity").status_code == 401
    r = httpx.get(f"{server}/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "message" in r.json()["error"]

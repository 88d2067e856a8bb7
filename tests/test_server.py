"""A real `ragkv serve` process on loopback, driven with the official `openai` client."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time

import httpx
import pytest
from conftest import running_server, server_integrity, server_wait_idle
from openai import OpenAI

import ragkv
from ragkv import LLM, RAGPrompt, SamplingParams
from ragkv.structured.params import StructuredOutputsParams

MODEL = "builtin:tiny"
KEY = "sk-test-key"
MAX_MODEL_LEN = 2048
DOCS_PROMPT = ("You answer from the documents. ## Bread needs flour, water and salt. "
               "## Rye bread is dense and dark. ## Which bread is denser?")


@pytest.fixture(scope="module")
def server():
    # `##` prompts split into documents, as an operator asks with --chunk-separator; the
    # clients are trusted with their own chat templates; no chunk primer (a request asking
    # for one is an error here), so reordered documents are all hits.
    with running_server(MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes",
                        "200000", "--chunk-separator", "##", "--trust-request-chat-template",
                        "--chunk-primer", "none", env={"RAGKV_API_KEY": KEY}) as base:
        yield base


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, max_model_len=MAX_MODEL_LEN, chunk_separator="##", chunk_primer="none")


def integrity(base: str) -> dict:
    return server_integrity(base, KEY)


def wait_idle(base: str, timeout: float = 30) -> dict:
    return server_wait_idle(base, KEY, timeout)


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert match, f"{name} not exported"
    return float(match.group(1))


def test_models_and_health(server, client):
    assert httpx.get(f"{server}/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_served_model_names_and_vllm_metric_names():
    """--served-model-name with several names: /v1/models lists each, a request may give any,
    responses carry the first; --vllm-metric-names publishes vLLM's series under `vllm:` with
    the same values as ragkv's (a dashboard built for vLLM reads them)."""
    with running_server(MODEL, "--served-model-name", "tiny", "alias",
                        "--vllm-metric-names") as base:
        http = httpx.Client(base_url=base, timeout=30)
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "alias"]
        r = http.post("/v1/completions", json={"model": "alias", "prompt": "Hello",
                                               "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello"}
                         ).status_code == 404
        text = http.get("/metrics").text
        for name in ("prompt_tokens_total", "generation_tokens_total",
                     "time_to_first_token_seconds_count", "num_requests_running",
                     "kv_cache_usage_perc"):
            ours = re.search(rf"^ragkv:{name}{{[^}}]*}} (\S+)$", text, re.M)
            theirs = re.search(rf"^vllm:{name}{{[^}}]*}} (\S+)$", text, re.M)
            assert ours and theirs and ours.group(1) == theirs.group(1), name
        assert "vllm:chunk_cache_hits" not in text  # ragkv's own series stay ragkv's
        # Without --trust-request-chat-template a request's own template is refused.
        r = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
            "chat_template": "{{ messages[0].content }}"})
        _assert_openai_error(r, 400, "--trust-request-chat-template")
    with running_server(MODEL) as base:  # without the flag: ragkv's names only
        assert "vllm:" not in httpx.get(f"{base}/metrics", timeout=10).text


def test_completion_equals_offline_engine(client, offline):
    for prompt in ("Once upon a time", DOCS_PROMPT):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        want = offline.generate(prompt, SamplingParams(max_tokens=8, temperature=0),
                                use_tqdm=False)[0]
        assert r.choices[0].text == want.outputs[0].text
        assert r.choices[0].finish_reason == want.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_penalties_and_logit_bias_equal_offline_engine(client, offline):
    extra = dict(frequency_penalty=1.2, presence_penalty=0.3, logit_bias={"77": 4.0})
    offline_params = SamplingParams(max_tokens=10, temperature=0, frequency_penalty=1.2,
                                    presence_penalty=0.3, repetition_penalty=1.5,
                                    logit_bias={77: 4.0})
    r = client.completions.create(model=MODEL, prompt=DOCS_PROMPT, max_tokens=10, temperature=0,
                                  extra_body={"repetition_penalty": 1.5}, **extra)
    want = offline.generate(DOCS_PROMPT, offline_params, use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == want.text
    forced = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        logit_bias={"77": 100})
    assert forced.choices[0].message.content == offline.engine.tokenizer.decode([77] * 3)


BOUNDED_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                  "kind": {"enum": ["cat", "dog"]}},
                  "required": ["ok", "kind"]}


@pytest.mark.parametrize("extra,offline_so", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "pet", "schema": BOUNDED_SCHEMA}}},
     StructuredOutputsParams(json=BOUNDED_SCHEMA)),
    ({"guided_json": json.dumps(BOUNDED_SCHEMA)}, StructuredOutputsParams(json=BOUNDED_SCHEMA)),
    ({"structured_outputs": {"json": BOUNDED_SCHEMA}},
     StructuredOutputsParams(json=BOUNDED_SCHEMA)),
    ({"guided_choice": ["left", "right"]}, StructuredOutputsParams(choice=["left", "right"])),
    ({"structured_outputs": {"choice": ["up", "down"], "regex": None}},
     StructuredOutputsParams(choice=["up", "down"])),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
])
def test_structured_outputs_equal_offline_engine(client, offline, extra, offline_so):
    """OpenAI's response_format and vLLM's guided_json, guided_choice and structured_outputs
    give the offline engine's constrained output (a RAG prompt), and chat streams what it
    returns whole."""
    # Free JSON runs into free strings, where this random model has near-ties (1e-5 apart) that
    # another process's float sums may break the other way: 30 tokens stay before the first.
    max_tokens = 30 if offline_so.json_object else 150
    params = SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=offline_so)
    want = offline.generate(DOCS_PROMPT, params, use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=DOCS_PROMPT, max_tokens=max_tokens,
                                  temperature=0, extra_body=extra)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    if offline_so.choice:
        assert want.text in offline_so.choice and want.finish_reason == "stop"
    elif not offline_so.json_object:
        assert want.finish_reason == "stop" and set(json.loads(want.text)) == {"ok", "kind"}
    messages = [{"role": "user", "content": "Describe a pet as JSON."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages,
                                           max_tokens=max_tokens, temperature=0,
                                           extra_body=extra).choices[0]
    stream = client.chat.completions.create(model=MODEL, messages=messages,
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == whole.message.content
    if whole.finish_reason == "stop" and not offline_so.choice:
        json.loads(whole.message.content)


def test_unsupported_fields_in_their_harmless_forms_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        response_format={"type": "text"}, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert r.choices[0].finish_reason in ("length", "stop")
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2, best_of=2)
    assert len(r.choices) == 2


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
    from ragkv.inputs.chat import split_chat_prompt

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


def test_offline_chat_answers_as_the_server_does(client, offline):
    """`LLM.chat` renders and splits a conversation as /v1/chat/completions does: the same
    tokens, with documents, with separators, batched, and with vLLM's chat options."""
    docs = ["Bread needs flour, water and salt.", "Rye bread is dense and dark."]
    messages = [{"role": "system", "content": "You answer from the documents."},
                {"role": "user", "content": "Which is denser?"}]
    params = SamplingParams(max_tokens=10, temperature=0)
    served = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                            temperature=0, extra_body={"documents": docs})
    out = offline.chat(messages, params, use_tqdm=False, documents=docs)[0]
    assert out.outputs[0].text == served.choices[0].message.content
    assert out.metrics.num_chunk_hits + out.metrics.num_chunk_misses == 2
    # A list of conversations; text parts; the separator form of the same documents.
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Which is "},
                                                       {"type": "text", "text": "denser?"}]}]
    split = [messages[0], {"role": "user", "content": " ## ".join([*docs, "Which is denser?"])}]
    outs = offline.chat([split, parts], params, use_tqdm=False)
    assert outs[0].outputs[0].text == served.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                           temperature=0)
    assert outs[1].outputs[0].text == plain.choices[0].message.content
    # A template of the request's own, and no assistant header.
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    options = {"chat_template": template, "add_generation_prompt": False}
    served = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                            temperature=0, extra_body=options)
    out = offline.chat(messages, params, use_tqdm=False, **options)[0]
    assert out.outputs[0].text == served.choices[0].message.content
    assert offline.get_tokenizer().decode(out.prompt_token_ids).endswith(
        "[user] Which is denser?\n")
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        offline.chat(["not a message"], params, use_tqdm=False)


def test_separators_only_when_asked_and_documents_on_completions(server, client, offline):
    """A request's own `chunk_separator` splits its prompt (trimmed: the spacing around it
    does not matter); `documents` on /v1/completions are chunks before the prompt, the
    question; either with the other, or documents with token ids, is a 400."""
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    docs = ["Bread needs flour, water and salt.", "Rye bread is dense and dark."]
    glued = "You answer.<doc>" + "<doc>".join(docs) + "<doc>Which is denser?"
    spaced = "You answer. <doc> " + " <doc> ".join(docs) + " <doc>  Which is denser?"
    runs = [client.completions.create(prompt=p, extra_body={"chunk_separator": "<doc>"},
                                      **body) for p in (glued, spaced)]
    assert runs[0].choices[0].text == runs[1].choices[0].text
    assert runs[0].usage.prompt_tokens == runs[1].usage.prompt_tokens
    assert runs[1].usage.prompt_tokens_details.cached_tokens > 0  # the same chunk entries
    want = offline.generate(RAGPrompt("You answer.", docs, "Which is denser?"),
                            SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    assert runs[0].choices[0].text == want.outputs[0].text
    # Without its separator the same text is an ordinary prompt: more tokens.
    plain = client.completions.create(prompt=glued, **body)
    assert plain.usage.prompt_tokens > runs[0].usage.prompt_tokens
    by_docs = client.completions.create(prompt="Which is denser?",
                                        extra_body={"documents": docs}, **body)
    want = offline.generate(RAGPrompt("", docs, "Which is denser?"),
                            SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    assert by_docs.choices[0].text == want.outputs[0].text
    assert by_docs.usage.prompt_tokens == len(want.prompt_token_ids)
    headers = {"Authorization": f"Bearer {KEY}"}
    for extra, fragment in (({"documents": docs, "chunk_separator": "##"}, "not both"),
                            ({"chunk_separator": "   "}, "chunk_separator"),
                            ({"documents": docs, "prompt": [1, 2, 3]}, "token ids")):
        r = httpx.post(f"{server}/v1/completions", headers=headers, timeout=30,
                       json={**body, "prompt": "Q?", **extra})
        _assert_openai_error(r, 400, fragment)
    integrity(server)


def test_prompt_logprobs_and_echo_for_log_likelihood(server, client, offline):
    """`prompt_logprobs` (vLLM's field) returns the offline engine's prompt logprobs; the
    lm-evaluation-harness log-likelihood request (echo, logprobs, max_tokens 0) returns the
    prompt as text and the same numbers in OpenAI's logprobs object; echo or prompt_logprobs
    with stream, and suffix, are 400s naming the field."""
    prompt = "The capital of France is Paris"
    want = offline.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=2),
                            use_tqdm=False)[0]
    ids = want.prompt_token_ids
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        assert {int(t) for t in got[j]} == set(want.prompt_logprobs[j])
        entry = got[j][str(ids[j])]
        assert abs(entry["logprob"] - want.prompt_logprobs[j][ids[j]].logprob) < 1e-5
        assert entry["rank"] == want.prompt_logprobs[j][ids[j]].rank
    ll = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                   logprobs=1, temperature=0)
    choice = ll.choices[0]
    assert choice.text == prompt and ll.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - want.prompt_logprobs[j][ids[j]].logprob) < 1e-5
    # With a completion after the prompt: the prompt's tokens, then the completion's.
    both = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True,
                                     logprobs=1, temperature=0, extra_body={"ignore_eos": True})
    assert both.choices[0].text.startswith(prompt)
    assert len(both.choices[0].logprobs.tokens) == len(ids) + 3
    # Chat: vLLM puts them at the top of the response (one prompt).
    messages = [{"role": "user", "content": "Which is denser?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    want = offline.chat(messages, SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)[0]
    got = chat.model_extra["prompt_logprobs"]
    assert len(got) == len(want.prompt_token_ids) and got[0] is None
    assert [None if e is None else {int(t) for t in e} for e in got] == [
        None if e is None else set(e) for e in want.prompt_logprobs]
    headers = {"Authorization": f"Bearer {KEY}"}
    for endpoint, extra, fragment in (
            ("completions", {"echo": True, "stream": True}, "echo"),
            ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
            ("chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
            ("completions", {"suffix": "x"}, "suffix"),
            ("completions", {"prompt_logprobs": -1}, "prompt_logprobs")):
        body = ({"messages": messages} if endpoint.startswith("chat") else {"prompt": "Q?"})
        r = httpx.post(f"{server}/v1/{endpoint}", headers=headers, timeout=30,
                       json={"model": MODEL, **body, **extra})
        _assert_openai_error(r, 400, fragment)
    integrity(server)


def test_tokenize_detokenize_and_version(server, offline):
    """vLLM's /tokenize (a prompt or chat messages, tokenized as the engine runs them: the
    count is the request's prompt_tokens), /detokenize and /version."""
    headers = {"Authorization": f"Bearer {KEY}"}

    def post(path: str, **body) -> httpx.Response:
        return httpx.post(f"{server}{path}", json=body, headers=headers, timeout=30)

    tok = offline.get_tokenizer()
    r = post("/tokenize", model=MODEL, prompt="Hello there", return_token_strs=True).json()
    assert r["tokens"] == tok.encode("Hello there") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN and len(r["token_strs"]) == r["count"]
    bare = post("/tokenize", prompt="Hello there", add_special_tokens=False).json()
    assert bare["tokens"] == tok.encode("Hello there", add_special_tokens=False)
    assert bare["token_strs"] is None
    # A RAG prompt counts what the engine runs: separators are markup.
    r = post("/tokenize", prompt=DOCS_PROMPT).json()
    assert r["tokens"] == offline.engine.process_prompt(DOCS_PROMPT).token_ids
    docs = ["Bread needs flour.", "Rye bread is dense."]
    messages = [{"role": "user", "content": "Which is denser?"}]
    r = post("/tokenize", messages=messages, documents=docs).json()
    assert r["tokens"] == offline.engine.process_chat(messages, docs).token_ids
    r = post("/tokenize", messages=messages, add_generation_prompt=False).json()
    assert not tok.decode(r["tokens"]).endswith("assistant\n")
    text = post("/detokenize", model=MODEL, tokens=r["tokens"]).json()["prompt"]
    assert text == tok.decode(r["tokens"])
    for path, body, fragment in (
            ("/tokenize", {"prompt": "a", "messages": messages}, "exactly one"),
            ("/tokenize", {}, "exactly one"),
            ("/tokenize", {"messages": messages, "documents": docs, "chunk_separator": "##"},
             "not both"),
            ("/tokenize", {"prompt": "a", "model": "other"}, "does not exist"),
            ("/detokenize", {"tokens": [1, 10 ** 9]}, "outside the vocabulary"),
            ("/detokenize", {"tokens": "1 2"}, "tokens")):
        r = post(path, **body)
        assert r.status_code in (400, 404) and fragment in r.json()["error"]["message"], r.text
    assert httpx.post(f"{server}/tokenize", json={"prompt": "a"}).status_code == 401
    assert httpx.get(f"{server}/version").json()["version"] == ragkv.__version__


def test_cached_tokens_and_chunk_hit_metrics(server, client):
    docs = [" The first document talks about rivers and boats.",
            " The second document talks about mountains and snow.",
            " The third document talks about deserts and wind."]
    hits_before = metric(server, "ragkv:chunk_cache_hits_total")
    queries_before = metric(server, "ragkv:chunk_cache_queries_total")
    tok_hits_before = metric(server, "ragkv:tokenizer_cache_hits_total")
    tok_queries_before = metric(server, "ragkv:tokenizer_cache_queries_total")
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
    # Each request's system part and documents go through the tokenizer cache (its question
    # does not); the second finds its documents and the system part there.
    assert metric(server, "ragkv:tokenizer_cache_queries_total") == tok_queries_before + 8
    assert metric(server, "ragkv:tokenizer_cache_hits_total") >= tok_hits_before + 4
    assert metric(server, "ragkv:prompt_tokens_total") > 0
    assert metric(server, "ragkv:generation_tokens_total") > 0
    text = httpx.get(f"{server}/metrics").text
    for name in ("ragkv:chunk_cache_evictions_total", "ragkv:prefix_cache_queries_total",
                 "ragkv:prefix_cache_hits_total", "ragkv:chunk_cache_usage_perc",
                 "ragkv:kv_cache_usage_perc", "ragkv:num_requests_running",
                 "ragkv:num_requests_waiting", "ragkv:time_to_first_token_seconds_bucket",
                 "ragkv:inter_token_latency_seconds_bucket", "ragkv:num_preemptions_total"):
        assert name in text
    # Finished requests: by finish reason, end-to-end latency and time in the queue.
    def total(pattern: str) -> float:
        found = re.findall(rf"^{pattern} (\S+)$", httpx.get(f"{server}/metrics").text, re.M)
        assert found, pattern
        return float(found[0])

    length = r'ragkv:request_success_total\{[^}]*finished_reason="length"[^}]*\}'
    done, e2e = total(length), total(r"ragkv:e2e_request_latency_seconds_count\{[^}]*\}")
    client.completions.create(model=MODEL, prompt="count me", max_tokens=2, temperature=0,
                              extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10  # the engine thread updates metrics after delivering
    while total(length) < done + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert total(length) == done + 1
    assert total(r"ragkv:e2e_request_latency_seconds_count\{[^}]*\}") == e2e + 1
    assert total(r"ragkv:request_queue_time_seconds_count\{[^}]*\}") >= e2e + 1
    integrity(server)


def test_layout_per_request_in_extra_body(server, client, offline):
    """`position_strategy` / `chunk_attention` in the request body choose the prompt's layout,
    on completions and chat, and give what the offline engine gives for that layout."""
    params = SamplingParams(max_tokens=8, temperature=0)
    before = metric(server, "ragkv:chunk_repositioned_tokens_total")
    for layout in ({"position_strategy": "sequential"}, {"chunk_attention": "standalone"},
                   {"position_strategy": "sequential", "chunk_attention": "standalone"}):
        r = client.completions.create(model=MODEL, prompt=DOCS_PROMPT, max_tokens=8,
                                      temperature=0, extra_body=layout)
        want = offline.generate({"prompt": DOCS_PROMPT, **layout}, params, use_tqdm=False)[0]
        assert r.choices[0].text == want.outputs[0].text
        assert want.metrics.num_repositioned_tokens > 0
    docs = ["Bread needs flour, water and salt.", "Rye bread is dense and dark."]
    messages = [{"role": "system", "content": "You answer from the documents."},
                {"role": "user", "content": "Which is denser?"}]
    layout = {"position_strategy": "sequential", "chunk_attention": "standalone"}
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                          temperature=0, extra_body={"documents": docs, **layout})
    prompt = offline.engine.process_chat(messages, docs, **layout)
    want = offline.generate(prompt, params, use_tqdm=False)[0]
    assert chat.choices[0].message.content == want.outputs[0].text
    assert metric(server, "ragkv:chunk_repositioned_tokens_total") > before
    integrity(server)


def test_recompute_per_request_in_extra_body(server, client, offline):
    """`recompute` / `recompute_ratio` / `recompute_sink_tokens` in the body: the offline
    engine's output for the same options, `num_recomputed_tokens` in usage, and the counter."""
    params = SamplingParams(max_tokens=8, temperature=0)
    before = metric(server, "ragkv:chunk_recomputed_tokens_total")
    options = {"position_strategy": "sequential", "recompute": "sink+query",
               "recompute_ratio": 0.5, "recompute_sink_tokens": 2, "recompute_damping": 1.5}
    r = client.completions.create(model=MODEL, prompt=DOCS_PROMPT, max_tokens=8,
                                  temperature=0, extra_body=options)
    want = offline.generate({"prompt": DOCS_PROMPT, **options}, params, use_tqdm=False)[0]
    assert r.choices[0].text == want.outputs[0].text
    recomputed = want.metrics.num_recomputed_tokens
    assert recomputed > 0 and r.usage.model_extra["num_recomputed_tokens"] == recomputed
    docs = ["Bread needs flour, water and salt.", "Rye bread is dense and dark."]
    messages = [{"role": "user", "content": "Which is denser?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0,
        extra_body={"documents": docs, "recompute": "blend", "recompute_ratio": 1.0})
    prompt = offline.engine.process_chat(messages, docs, recompute="blend", recompute_ratio=1.0)
    want = offline.generate(prompt, params, use_tqdm=False)[0]
    assert chat.choices[0].message.content == want.outputs[0].text
    # r = 1: every chunk token but the first document's, whose cached KV is exact already.
    assert chat.usage.model_extra["num_recomputed_tokens"] == len(prompt.chunks[1])
    assert metric(server, "ragkv:chunk_recomputed_tokens_total") >= before + recomputed
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
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),  # 0 only scores
    ({"model": MODEL, "prompt": "system ## a document ##   "}, 400, "question"),
    ({"model": MODEL, "prompt": ""}, 400, "empty"),
    ({"model": MODEL, "prompt": "x" * 300_000}, 413, "body"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "prompt": DOCS_PROMPT, "position_strategy": "zigzag"}, 400,
     "position_strategy"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "q"}], "documents": ["d"],
      "chunk_attention": "global"}, 400, "chunk_attention"),
    ({"model": MODEL, "prompt": DOCS_PROMPT, "recompute": "most"}, 400, "recompute"),
    ({"model": MODEL, "prompt": DOCS_PROMPT, "recompute": "blend", "recompute_ratio": 2},
     400, "recompute_ratio"),
    ({"model": MODEL, "prompt": DOCS_PROMPT, "recompute": "blend", "recompute_damping": -1},
     400, "recompute_damping"),
    ({"model": MODEL, "prompt": DOCS_PROMPT, "recompute": "blend",
      "position_strategy": "shared"}, 400, "sequential layout"),
    ({"model": MODEL, "prompt": DOCS_PROMPT, "chunk_primer": True}, 400,
     "chunk_primer=true needs"),
    ({"model": MODEL, "prompt": DOCS_PROMPT, "chunk_primer": "yes please"}, 400, "chunk_primer"),
    ({"model": MODEL, "prompt": "hi", "frequency_penalty": 3}, 400, "frequency_penalty"),
    ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "q"}],
      "logit_bias": {"x": 1}}, 400, "logit_bias keys must be token ids"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 200}}, 400, "[-100, 100]"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "vocabulary"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"9" * 5000: 1}}, 400, "token ids"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"7": 1, "007": -1}}, 400, "twice"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "a+"}}}}, 400, "'pattern'"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "json_schema"}}, 400,
     "json_schema needs"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "grammar"}}, 400,
     "'grammar' is not supported"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "json_object"},
      "guided_choice": ["a"]}, 400, "both constrain"),
    ({"model": MODEL, "prompt": "hi", "guided_choice": []}, 400, "non-empty list"),
    ({"model": MODEL, "prompt": "hi", "guided_json": "{not json"}, 400, "not valid JSON"),
    ({"model": MODEL, "prompt": "hi", "guided_regex": "a+"}, 400, "guided_regex"),
    ({"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "a+"}}, 400, "'regex'"),
    ({"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"model": MODEL, "prompt": "hi", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "q"}],
      "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "not in tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "q"}],
      "tool_choice": "required"}, 400, "tool_choice 'required' needs tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "q"}],
      "functions": [{"name": "f"}]}, 400, "functions"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
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
    # Documents and a separator at once are ambiguous, in a chat as in a completion.
    with pytest.raises(BadRequestError, match="not both"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a ## q"}], max_tokens=2,
            extra_body={"documents": ["a document"], "chunk_separator": "##"})


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


# ------------------------------------------------------ issue 8: one request, one failure

def _post(base: str, body, endpoint: str = "completions", headers: dict | None = None,
          **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{base}/v1/{endpoint}", content=content, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}",
                               "Content-Type": "application/json", **(headers or {})},
                      **kwargs)


def _assert_openai_error(r: httpx.Response, status: int, fragment: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"], error
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status


def test_bad_cache_salt_fails_alone_while_a_stream_runs(server, client, offline):
    """Regression (defect 1): a cache_salt holding a lone surrogate raised inside the engine
    step and every in-flight request got a 500 with that request's error text."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = offline.generate(DOCS_PROMPT, params, use_tqdm=False)[0].outputs[0].text
    collected: list[str] = []

    def run_stream():
        for chunk in client.completions.create(model=MODEL, prompt=DOCS_PROMPT, max_tokens=40,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
            collected.append(chunk.choices[0].text)

    thread = threading.Thread(target=run_stream)
    thread.start()
    bad = (b'{"model": "%s", "prompt": "%s", "cache_salt": "\\ud800"}'
           % (MODEL.encode(), DOCS_PROMPT.encode()))
    for _ in range(5):
        _assert_openai_error(_post(server, bad), 400, "cache_salt is not valid Unicode")
    thread.join(60)
    assert "".join(collected) == want
    assert wait_idle(server)["num_running"] == 0


@pytest.mark.parametrize("body,fragment", [
    ({"n": 1099511627776}, "exceeds max_n=128"),
    ({"n": 10000}, "exceeds max_n=128"),
    ({"prompt": ["a prompt"] * 5000}, "5000 sequences"),
    ({"prompt": ["a", "b", "c"], "n": 100}, "300 sequences"),
    ({"n": 128, "max_tokens": 2000}, "KV cache holds"),
    ({"max_tokens": 2047}, "maximum context length is 2048 tokens"),
], ids=["n_2_40", "n_10000", "5000_prompts", "prompts_x_n", "n_x_max_tokens", "max_tokens"])
def test_request_fan_out_is_bounded(server, body, fragment):
    """Regression (defect 2): n had no upper bound (n=2**40 hung the engine thread while
    memory grew), nor did the number of prompts or n x max_tokens."""
    start = time.monotonic()
    r = _post(server, {"model": MODEL, "prompt": "hello", **body})
    _assert_openai_error(r, 400, fragment)
    assert time.monotonic() - start < 10  # refused up front, not after generating
    assert wait_idle(server)["num_running"] == 0


@pytest.mark.parametrize("raw,endpoint,fragment", [
    (b'{"model": "\\ud800", "prompt": "hi"}', "completions", "model is not valid Unicode"),
    (b'{"model": "%s", "prompt": "hi \\udfff"}' % MODEL.encode(), "completions",
     "prompt is not valid Unicode"),
    (b'{"model": "%s", "prompt": ["ok", "\\ud800"]}' % MODEL.encode(), "completions",
     "prompt[1] is not valid Unicode"),
    (b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}'
     % MODEL.encode(), "chat/completions", "messages[0].content is not valid Unicode"),
    (b'{"model": "%s", "messages": [{"role": "user", "content": "q"}], "documents": '
     b'["\\udc00"]}' % MODEL.encode(), "chat/completions", "documents[0] is not valid"),
    (b'{"model": "%s", "prompt": "hi", "\\ud800": 1}' % MODEL.encode(), "completions",
     "is not valid Unicode"),
    (b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * 1000 + b"]" * 1000 + b"}",
     "completions", "nested deeper than"),
    (b"[" * 100_000 + b"]" * 100_000, "completions", "nested deeper than"),
    (b'{"model": "%s", "prompt": "hi", "n": 1%s}' % (MODEL.encode(), b"0" * 5000),
     "completions", "malformed JSON"),
    (b'{"model": "%s", "prompt": [true, 5]}' % MODEL.encode(), "completions",
     "invalid field prompt"),
    (b'{"model": "%s", "prompt": "hi", "n": true}' % MODEL.encode(), "completions",
     "invalid field n"),
], ids=["model", "prompt", "prompt_list", "chat_message", "documents", "key", "deep_1000",
        "deep_100000", "huge_int", "bool_token_id", "bool_n"])
def test_malformed_unicode_and_json_get_400(server, client, raw, endpoint, fragment):
    """Regression (defects 3 and 11): lone surrogates (in the model name while writing the
    404, in a prompt, a chat message, documents), JSON nested 1,000 deep and huge integer
    literals were 500s; `[true]` was accepted as token ids."""
    _assert_openai_error(_post(server, raw, endpoint), 400, fragment)
    good = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=2)
    assert good.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", None])
def test_only_json_bodies_are_accepted(server, ctype):
    """Regression (defect 11): a text/plain body was accepted, so with no API key any web
    page could drive a local server (browsers send text/plain cross-origin without a
    preflight)."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    headers = {"Authorization": f"Bearer {KEY}"}
    if ctype:
        headers["Content-Type"] = ctype
    r = httpx.post(f"{server}/v1/completions", content=body, headers=headers, timeout=30)
    _assert_openai_error(r, 415, "application/json")


def test_streaming_n_sends_each_finish_reason_once(client):
    """Regression (defect 7): with n>1 a finished choice re-sent its finish_reason chunk in
    every later step."""
    stops = {"stop_token_ids": list(range(100, 4096, 3))}  # finish at different steps
    chunks = list(client.completions.create(model=MODEL, prompt="Count:", n=3, max_tokens=6,
                                            temperature=0.8, seed=1, stream=True,
                                            extra_body=stops))
    finishes = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
             for i in range(3)}
    full = client.completions.create(model=MODEL, prompt="Count:", n=3, max_tokens=6,
                                     temperature=0.8, seed=1, extra_body=stops)
    assert texts == {c.index: c.text for c in full.choices}


def test_concurrent_integrity_checks_share_walks(monkeypatch):
    """Regression (defect 11): every /debug/integrity call ran its own full walk on the
    engine thread; 40 concurrent calls stalled a stream 1.4 s. Here 40 calls go through the
    app (a real engine behind it) while the first walk is held on the engine thread until all
    of them have reached the endpoint's gate: each call joins the walk that is waiting or the
    one queued after it, so the engine walks at most twice (the gate runs one walk at a time
    and queues one more), and the 40 answers are ok and agree."""
    import asyncio

    from ragkv.config import EngineConfig
    from ragkv.engine.engine import Engine
    from ragkv.server import app as app_module
    from ragkv.server.async_engine import AsyncEngine
    from ragkv.server.metrics import Metrics

    calls = 40
    engine = Engine(EngineConfig(model=MODEL, max_model_len=MAX_MODEL_LEN))
    all_arrived = threading.Event()
    arrivals, walks, held = 0, 0, []
    walk = engine.check_integrity

    def counted_walk() -> None:  # on the engine thread
        nonlocal walks
        walks += 1
        if walks == 1:  # the first walk lasts until every call is in
            held.append(all_arrived.wait(timeout=60))
        walk()

    gate_check = app_module._IntegrityGate.check

    async def counted_check(gate) -> dict:
        nonlocal arrivals
        arrivals += 1
        if arrivals == calls:
            all_arrived.set()
        return await gate_check(gate)

    engine.check_integrity = counted_walk
    monkeypatch.setattr(app_module._IntegrityGate, "check", counted_check)
    async_engine = AsyncEngine(engine)
    app = app_module.build_app(async_engine, Metrics(MODEL, engine.chunk_store),
                               app_module.ServerConfig(model_name=MODEL, api_key=KEY))

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ragkv",
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            return await asyncio.gather(*(http.get("/debug/integrity") for _ in range(calls)))

    async_engine.start()
    try:
        answers = asyncio.run(main())
    finally:
        async_engine.stop()
        engine.close()
    assert [a.status_code for a in answers] == [200] * calls
    reports = [a.json() for a in answers]
    assert all(r["ok"] for r in reports)
    assert len({r["kv_capacity_tokens"] for r in reports}) == 1
    assert held == [True], "the calls did not all reach the gate during the first walk"
    assert arrivals == calls and 1 <= walks <= 2, f"{walks} walks for {calls} calls"


def test_chat_documents_are_reused_across_different_histories(server, client):
    """Regression (defect 12): the system part ran up to the last user message, so the same
    system message and documents missed the cache as soon as the history differed."""
    docs = ["The lighthouse keeper logs every ship at dawn.",
            "The harbour closes when the north wind blows."]
    system = {"role": "system", "content": "Answer from the documents."}
    first = client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0, extra_body={"documents": docs},
        messages=[system, {"role": "user", "content": "When does the harbour close?"}])
    hits_before = metric(server, "ragkv:chunk_cache_hits_total")
    again = client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0, extra_body={"documents": docs},
        messages=[system, {"role": "user", "content": "Hello"},
                  {"role": "assistant", "content": "Hi! Ask me about the harbour."},
                  {"role": "user", "content": "Who logs the ships?"}])
    # The documents are at least one token per word.
    doc_words = sum(len(d.split()) for d in docs)
    assert first.usage.prompt_tokens_details.cached_tokens < doc_words
    assert again.usage.prompt_tokens_details.cached_tokens >= doc_words
    # Both documents came from the chunk cache (prefix hits on the system header alone could
    # also reach doc_words cached tokens).
    assert metric(server, "ragkv:chunk_cache_hits_total") == hits_before + len(docs)



def test_integrity_gate_runs_few_walks_for_many_callers():
    """Regression (defect 11): each of 40 concurrent /debug/integrity calls ran a walk of its
    own on the engine thread. The gate lets concurrent callers share walks: at most two (the
    one running and the next one), however many callers."""
    import asyncio

    from ragkv.server.app import _IntegrityGate

    class CountingEngine:
        walks = 0

        async def call(self, fn):
            CountingEngine.walks += 1
            await asyncio.sleep(0.05)  # a walk takes a while on the engine thread
            return {"ok": True}

    async def main():
        gate = _IntegrityGate(CountingEngine(), interval=0.0)
        return await asyncio.gather(*(gate.check() for _ in range(40)))

    reports = asyncio.run(main())
    assert len(reports) == 40 and all(r["ok"] for r in reports)
    assert CountingEngine.walks <= 2


# anyOf of two array schemas of itself: each "[" doubles the alternatives of a state.
AMBIGUOUS_SCHEMA = {"anyOf": [{"type": "array", "items": {"$ref": "#"}},
                              {"type": "array", "items": {"$ref": "#"}, "maxItems": 3}]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_over_the_grammar_budget_is_a_400_and_stalls_nobody(server, offline, stream):
    """A schema whose automaton outgrows its budget once generation nests it (pushed there by
    logit_bias) fails its request alone, as a client error (400, streamed as an error
    event); a request sent beside it gets exactly the offline engine's tokens."""
    bracket = offline.get_tokenizer().encode("[", add_special_tokens=False)
    assert len(bracket) == 1
    body = {"model": MODEL, "prompt": "JSON:", "max_tokens": 40, "stream": stream,
            "logit_bias": {str(bracket[0]): 100},
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": AMBIGUOUS_SCHEMA}}}
    plain = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    want = offline.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0),
                            use_tqdm=False)[0].outputs[0].text
    headers = {"Authorization": f"Bearer {KEY}"}
    with (httpx.Client(base_url=server, headers=headers, timeout=120) as http,
          concurrent.futures.ThreadPoolExecutor(2) as pool):
        bad = pool.submit(http.post, "/v1/completions", json=body)
        good = pool.submit(http.post, "/v1/completions", json=plain)
        bad, good = bad.result(), good.result()
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == want
    if stream:
        events = [json.loads(line[6:]) for line in bad.text.splitlines()
                  if line.startswith("data: {")]
        errors = [e["error"] for e in events if "error" in e]
        assert bad.status_code == 200 and errors and errors[0]["code"] == 400
        assert "GrammarBudgetError" in errors[0]["message"]
    else:
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["type"] == "invalid_request_error" and "GrammarBudgetError" in error["message"]
    assert wait_idle(server)["ok"]


def test_every_recompute_method_is_a_valid_request_field():
    """The request schema takes every method the engine has (a `Literal` kept by hand)."""
    from ragkv.config import RECOMPUTE_METHODS
    from ragkv.server.protocol import ChatCompletionRequest, CompletionRequest

    for method in RECOMPUTE_METHODS:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "recompute": method})
        ChatCompletionRequest.model_validate({"model": "m", "recompute": method,
                                              "messages": [{"role": "user", "content": "x"}]})

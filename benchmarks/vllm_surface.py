"""The vLLM surface, row by row, against a live `ragkv serve` driven with the `openai` client.

Starts a server from a `--config` file (vLLM's format) and checks what a vLLM user meets when
switching: a markdown `##` prompt is not reinterpreted, a request's own separator is trimmed
to one canonical form, `LLM.chat` gives the server's tokens, several served model names,
`prompt_logprobs` and lm-evaluation-harness's log-likelihood request (echo, logprobs,
max_tokens 0) agreeing, `documents` on completions, /tokenize /detokenize /version, tool
calling on /v1/chat/completions, a Hub id from the local Hugging Face cache, and vLLM's metric
names. Tool calling (row 6) is checked on whatever model is served: `tool_choice` "required"
and a named function (the output held by the grammar, so the calls always parse), "auto" with
the model's output forced to a Hermes `<tool_call>` block by `guided_choice` (parsed whole and
from the streamed `tool_calls` deltas), and a call with its result in the history (the prompt
counted as /tokenize counts it with the tools). Whether the model calls a tool in plain "auto"
mode is a property of the model, not of the server: it is reported as an INFO line, not
checked. Prints one line per check; exits 1 if any fails.

    python benchmarks/vllm_surface.py                      # builtin:tiny
    python benchmarks/vllm_surface.py --model builtin:tiny-qwen2   # a template with tools
    python benchmarks/vllm_surface.py --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx
from openai import OpenAI

from ragkv import LLM, SamplingParams
from ragkv.model.loader import resolve_model_path

DOCS = ["Bread needs flour, water and salt.", "Rye bread is dense and dark."]
# Small argument spaces (a short string, an enum), so a random-weight model's constrained
# output ends well within max_tokens.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 12},
                                      "unit": {"enum": ["C", "F"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                       "required": ["zone"]}}},
]
TOOL_NAMES = {t["function"]["name"] for t in TOOLS}
FORCED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def start_server(model: str, workdir: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = os.path.join(workdir, "serve.yaml")
    with open(config, "w", encoding="utf-8") as f:
        f.write(f"model: {model}\nport: {port}\nmax-model-len: 1024\n"
                "served-model-name: [main, alias]\nvllm_metric_names: true\n"
                "log-level: warning\n")
    proc = subprocess.Popen([sys.executable, "-m", "ragkv", "serve", "--config", config],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not come up")


def checks(model: str, base: str, offline: LLM, workdir: str) -> list[tuple[str, Callable]]:
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    http = httpx.Client(base_url=base, timeout=120)
    tok = offline.get_tokenizer()
    greedy = {"temperature": 0, "max_tokens": 8}

    def markdown_is_text():
        text = "# Pets\n## Cats\nCats sleep a lot.\n## Dogs\nWhich sleeps more?"
        r = client.completions.create(model="main", prompt=text, **greedy)
        assert r.usage.prompt_tokens == len(tok.encode(text)), r.usage

    def separator_on_request_and_canonical():
        glued = "Answer briefly.##" + "##".join(DOCS) + "##Which is denser?"
        spaced = "Answer briefly. ## " + " ## ".join(DOCS) + " ##  Which is denser?"
        a, b = (client.completions.create(model="main", prompt=p, **greedy,
                                          extra_body={"chunk_separator": "##"})
                for p in (glued, spaced))
        assert a.choices[0].text == b.choices[0].text
        assert b.usage.prompt_tokens_details.cached_tokens > 0  # the same chunk entries

    def offline_chat_equals_server():
        messages = [{"role": "system", "content": "Answer from the documents."},
                    {"role": "user", "content": "Which is denser?"}]
        served = client.chat.completions.create(model="main", messages=messages, **greedy,
                                                extra_body={"documents": DOCS})
        out = offline.chat(messages, SamplingParams(**greedy), use_tqdm=False,
                           documents=DOCS)[0]
        assert out.outputs[0].text == served.choices[0].message.content

    def served_model_names():
        ids = [m.id for m in client.models.list().data]
        r = client.completions.create(model="alias", prompt="Hello", **greedy)
        assert ids == ["main", "alias"] and r.model == "main", (ids, r.model)

    def prompt_logprobs_and_echo():
        prompt = "The capital of France is Paris"
        r = client.completions.create(model="main", prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": 1})
        plp = r.choices[0].model_extra["prompt_logprobs"]
        ll = client.completions.create(model="main", prompt=prompt, max_tokens=0, echo=True,
                                       logprobs=1, temperature=0)
        ids = tok.encode(prompt)
        got = ll.choices[0].logprobs.token_logprobs
        assert ll.choices[0].text == prompt and got[0] is None and plp[0] is None
        for j in range(1, len(ids)):
            assert abs(got[j] - plp[j][str(ids[j])]["logprob"]) < 1e-5

    def documents_on_completions():
        r = client.completions.create(model="main", prompt="Which is denser?", **greedy,
                                      extra_body={"documents": DOCS})
        again = client.completions.create(model="main", prompt="Which is darker?", **greedy,
                                          extra_body={"documents": DOCS[::-1]})
        assert r.usage.prompt_tokens > len(tok.encode("Which is denser?"))
        assert again.usage.prompt_tokens_details.cached_tokens > 0

    def tokenize_detokenize_version():
        t = http.post("/tokenize", json={"model": "main", "prompt": "Hello there"}).json()
        d = http.post("/detokenize", json={"tokens": t["tokens"]}).json()
        v = http.get("/version").json()
        assert t["count"] == len(tok.encode("Hello there")) and "Hello there" in d["prompt"]
        assert v["version"]

    tool_request = {"model": "main", "tools": TOOLS, "temperature": 0, "max_tokens": 200,
                    "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}

    def required_tool_calls():
        # One call (maxItems 1): a random-weight model may otherwise keep adding calls to the
        # array until max_tokens cuts it.
        r = client.chat.completions.create(**tool_request, tool_choice="required",
                                           parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None, choice.message
        assert choice.message.tool_calls and len(choice.message.tool_calls) == 1, choice.message
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id, call
            assert call.function.name in TOOL_NAMES, call
            assert isinstance(json.loads(call.function.arguments), dict), call

    def named_tool_call():
        r = client.chat.completions.create(
            **tool_request, tool_choice={"type": "function", "function": {"name": "get_time"}})
        choice = r.choices[0]
        calls = choice.message.tool_calls
        assert choice.finish_reason == "stop" and calls and len(calls) == 1, choice
        assert calls[0].function.name == "get_time", calls
        assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET"), calls

    forced = {"guided_choice": [FORCED_CALL]}
    want_call = [("get_weather", {"city": "Paris"})]

    def auto_parses_a_call():
        r = client.chat.completions.create(**tool_request, extra_body=forced)
        choice = r.choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in choice.message.tool_calls or ()]
        assert calls == want_call and choice.message.content is None, choice.message
        assert choice.finish_reason == "tool_calls", choice.finish_reason

    def auto_parses_a_streamed_call():
        content, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(**tool_request, extra_body=forced,
                                                    stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for c in choice.delta.tool_calls or ():
                    if c.index not in calls:  # the first delta of a call names it
                        assert c.id and c.type == "function" and c.function.name, c
                        calls[c.index] = [c.function.name, ""]
                    calls[c.index][1] += c.function.arguments or ""
                finish = choice.finish_reason or finish
        got = [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))]
        assert got == want_call and content == "" and finish == "tool_calls", (
            content, calls, finish)

    def tool_result_in_history():
        messages = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
             "content": "21 C, sunny"}]
        r = client.chat.completions.create(**{**tool_request, "max_tokens": 8,
                                              "messages": messages})
        t = http.post("/tokenize", json={"model": "main", "messages": messages,
                                         "tools": TOOLS})
        assert t.status_code == 200, t.text
        assert r.usage.prompt_tokens == t.json()["count"], (r.usage, t.json()["count"])

    def auto_without_forcing():
        r = client.chat.completions.create(**tool_request)
        choice = r.choices[0]
        if choice.message.tool_calls:
            names = ", ".join(c.function.name for c in choice.message.tool_calls)
            return f"called {names} (finish_reason {choice.finish_reason})"
        return f"answered in text (finish_reason {choice.finish_reason})"

    def hub_id_from_local_cache():
        hub = os.path.join(workdir, "hub")
        snapshot = os.path.join(hub, "models--acme--surface", "snapshots", "rev1")
        source = resolve_model_path(model)
        if os.path.isfile(source):  # a GGUF file: a snapshot directory holding it
            os.makedirs(snapshot)
            shutil.copy(source, snapshot)
        else:
            shutil.copytree(source, snapshot)
        os.makedirs(os.path.join(hub, "models--acme--surface", "refs"))
        with open(os.path.join(hub, "models--acme--surface", "refs", "main"), "w") as f:
            f.write("rev1")
        os.environ["HF_HUB_CACHE"] = hub
        try:
            llm = LLM("acme/surface", kv_cache_tokens=512)
            params = SamplingParams(**greedy)
            want = offline.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids
            got = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids
            assert got == want
        finally:
            del os.environ["HF_HUB_CACHE"]

    def vllm_metric_names():
        text = http.get("/metrics").text
        for name in ("vllm:num_requests_running", "vllm:prompt_tokens_total",
                     "vllm:time_to_first_token_seconds_bucket"):
            assert name in text, name

    return [("1 a markdown '##' prompt stays text", markdown_is_text),
            ("1 a request's chunk_separator, spacing trimmed", separator_on_request_and_canonical),
            ("2 LLM.chat gives the server's answer", offline_chat_equals_server),
            ("3 --config file, several served model names", served_model_names),
            ("4 prompt_logprobs == echo + logprobs + max_tokens 0", prompt_logprobs_and_echo),
            ("4 documents on /v1/completions", documents_on_completions),
            ("5 /tokenize, /detokenize, /version", tokenize_detokenize_version),
            ("6 tool_choice required: tool_calls that parse", required_tool_calls),
            ("6 tool_choice a named function: its arguments", named_tool_call),
            ("6 tool_choice auto: a <tool_call> reply parsed", auto_parses_a_call),
            ("6 tool_choice auto, streamed: tool_calls deltas", auto_parses_a_streamed_call),
            ("6 a tool call and its result in the history", tool_result_in_history),
            ("6 auto without forcing", auto_without_forcing),
            ("7 a Hub id from the local HF cache", hub_id_from_local_cache),
            ("8 vLLM's metric names", vllm_metric_names)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny",
                        help="a model the server and the offline engine load")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="ragkv-surface-")
    proc, base = start_server(args.model, workdir)
    failed = 0
    try:
        offline = LLM(args.model, max_model_len=1024)
        for name, check in checks(args.model, base, offline, workdir):
            try:
                info = check()  # a check that returns text is reported (INFO), not judged
                print(f"INFO  {name}: {info}" if info else f"PASS  {name}")
            except Exception as e:  # noqa: BLE001 (every row is reported)
                failed += 1
                print(f"FAIL  {name}: {type(e).__name__}: {e}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{failed} of the checks failed" if failed else "every check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

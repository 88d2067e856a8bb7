"""Tool calling: the prompt (tools and call history through the template, or the Hermes
fallback), the parsing of replies whole and streamed, and a live server on the builtin
Qwen-family model for the none, auto, required and named tool choices."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import running_server, server_wait_idle
from openai import OpenAI

from ragkv import LLM, SamplingParams
from ragkv.inputs.tools import check_tools, hermes_messages, template_calls_tools, tool_fields
from ragkv.server.tool_calls import ToolCallStream, reply, tool_choice

QWEN = "builtin:tiny-qwen2"
# Small argument spaces, so a random-weight model's constrained output ends quickly.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 8},
                                      "unit": {"enum": ["C", "F"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"]}}},
]
FUNCTIONS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
HISTORY = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
]
# HISTORY as the chat template takes it (what LLM.chat and the server hand the engine).
TEMPLATE_HISTORY = [{"role": m["role"], "content": m["content"] or "",
                     **tool_fields(m, f"messages[{i}]")} for i, m in enumerate(HISTORY)]
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
        "</tool_call>")


# ---------------------------------------------------------------------------------------------
# Parsing, whole and streamed


def _streamed(choice, text: str, step: int, finish: str = "stop"):
    """`text` fed `step` characters at a time: the content, the calls (index, name,
    arguments, reassembled from the deltas) and the final finish_reason."""
    stream = ToolCallStream(choice)
    deltas = [stream.feed(text[i:i + step], False, None)[0] for i in range(0, len(text), step)]
    last, reason = stream.feed("", True, finish)
    deltas.append(last)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", ()):
            entry = calls.setdefault(c["index"], {"name": None, "arguments": ""})
            assert ("id" in c) == (entry["name"] is None)  # the id comes once, first
            if "name" in c.get("function", {}):
                entry["name"] = c["function"]["name"]
            entry["arguments"] += c["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)], reason


def _whole(choice, text: str, finish: str = "stop"):
    message, reason = reply(choice, text, finish)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls", ())]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in message.get("tool_calls", ()))
    return message["content"], calls, reason


@pytest.mark.parametrize("text, content, names", [
    ("Sure.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"), "Sure.\n",
     ["get_weather", "get_weather"]),
    ("\n" + CALL, None, ["get_weather"]),
    ('<tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}}]</tool_call>', None,
     ["get_time", "get_time"]),
    (CALL[:-len("</tool_call>")], None, ["get_weather"]),  # cut before the close: still one
    ("No call here, only <tool text.", "No call here, only <tool text.", []),
    ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    ("\n<tool_call>{not json</tool_call> tail", "\n<tool_call>{not json</tool_call> tail", []),
])
def test_auto_replies_parse_the_same_whole_and_streamed(text, content, names):
    choice = tool_choice(TOOLS, "auto", None)
    whole = _whole(choice, text)
    assert whole[0] == content and [c["name"] for c in whole[1]] == names
    assert whole[2] == ("tool_calls" if names else "stop")
    for c in whole[1]:
        assert isinstance(json.loads(c["arguments"]), dict)
    for step in (1, 2, 5, 11, len(text)):
        got = _streamed(choice, text, step)
        assert (got[0] or None, got[1], got[2]) == (content, whole[1], whole[2]), step


def test_auto_without_parallel_calls_keeps_the_first():
    choice = tool_choice(TOOLS, "auto", False)
    text = CALL + CALL.replace("Paris", "Rome")
    assert [json.loads(c["arguments"])["city"] for c in _whole(choice, text)[1]] == ["Paris"]
    assert len(_streamed(choice, text, 3)[1]) == 1


def test_required_and_named_replies():
    required = tool_choice(TOOLS, "required", None)
    text = '[{"name": "get_time", "arguments": {"zone": "UTC"}}]'
    assert _whole(required, text) == (None, [{"name": "get_time",
                                             "arguments": '{"zone": "UTC"}'}], "tool_calls")
    assert _streamed(required, text, 4) == ("", [{"name": "get_time",
                                                  "arguments": '{"zone": "UTC"}'}],
                                            "tool_calls")
    # Cut short by max_tokens: no call, the text is the content, finish_reason stays length.
    assert _whole(required, text[:20], "length") == (text[:20], [], "length")
    named = tool_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    whole = _whole(named, '{"zone": "CET"}')
    assert whole == (None, [{"name": "get_time", "arguments": '{"zone": "CET"}'}], "stop")
    assert _streamed(named, '{"zone": "CET"}', 3)[1:] == (whole[1], "stop")


def test_tool_choice_schemas_and_errors():
    schema = tool_choice(TOOLS, "required", False).schema()
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [b["properties"]["name"] for b in schema["items"]["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]
    assert tool_choice(TOOLS, None, None).mode == "auto"
    assert tool_choice(None, None, None).mode == "none"
    assert tool_choice(TOOLS, "auto", None).schema() is None
    for bad, fragment in [("required", "needs tools"), ("sometimes", "is not"),
                          ({"type": "function", "function": {"name": "nope"}}, "not in tools"),
                          ({"function": "x"}, "must be")]:
        with pytest.raises(ValueError, match=fragment):
            tool_choice(TOOLS if fragment != "needs tools" else None, bad, None)
    with pytest.raises(ValueError, match="second function"):
        check_tools(TOOLS + TOOLS[:1])
    with pytest.raises(ValueError, match="letters, digits"):
        check_tools([{"type": "function", "function": {"name": "has space"}}])


# ---------------------------------------------------------------------------------------------
# The prompt


def test_templates_with_and_without_tools_render_the_same_hermes_chat():
    """builtin:tiny-qwen2's template renders tools itself; builtin:tiny's has none, so ragkv
    writes the same Hermes chat (the templates differ only in the BOS)."""
    qwen, plain = LLM(QWEN), LLM("builtin:tiny")
    assert template_calls_tools(qwen.engine.tokenizer, None)
    assert not template_calls_tools(plain.engine.tokenizer, None)
    texts = [llm.engine.process_chat(TEMPLATE_HISTORY, ["Doc one.", "Doc two."],
                                     tools=TOOLS).text
             for llm in (qwen, plain)]
    assert texts[1] == "<s>" + texts[0]
    text = texts[0]
    # The documents stay chunks after the system message; tools, call and result follow.
    assert text.index("Doc two.") < text.index("<tools>") < text.index(CALL) \
        < text.index("<tool_response>\n21 C, sunny\n</tool_response>")
    assert '"name": "get_time"' in text
    prompt = qwen.engine.process_chat(TEMPLATE_HISTORY, ["Doc one.", "Doc two."], tools=TOOLS)
    assert len(prompt.chunks) == 2
    # Without tools the history still renders its calls.
    assert CALL in qwen.engine.process_chat(TEMPLATE_HISTORY).text


def test_hermes_messages_join_consecutive_results():
    msgs = hermes_messages([{"role": "user", "content": "q"},
                            {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}],
                           None)
    assert msgs == [{"role": "user", "content": "q"},
                    {"role": "user", "content": "<tool_response>\na\n</tool_response>\n"
                                                "<tool_response>\nb\n</tool_response>"}]


def test_offline_chat_takes_tools_and_history():
    llm = LLM(QWEN)
    out = llm.chat(HISTORY, SamplingParams(max_tokens=4, temperature=0), tools=TOOLS,
                   use_tqdm=False)[0]
    assert "<tools>" in out.prompt and len(out.outputs[0].token_ids) == 4
    bad = [*HISTORY[:2], {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"messages\[2\].tool_calls\[0\].function.arguments"):
        llm.chat(bad, use_tqdm=False)
    with pytest.raises(ValueError, match="non-empty list"):
        llm.chat(HISTORY, tools=[], use_tqdm=False)
    llm.check_integrity()


def test_the_builtin_qwen_model_is_the_hf_model(hf_model):
    """builtin:tiny-qwen2 loads as HF's Qwen2 (bias on q, k, v): greedy tokens of a chat with
    tools equal HF transformers' in float32."""
    from reference import causal_layout, reference_greedy

    from ragkv.model.builtin import builtin_model_path

    llm = LLM(QWEN, device="cpu", dtype="float32")
    out = llm.chat(HISTORY, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                   tools=TOOLS, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    expected, _ = reference_greedy(hf_model(builtin_model_path(QWEN)), ids,
                                   *causal_layout(len(ids)), max_tokens=6)
    assert out.outputs[0].token_ids == expected


# ---------------------------------------------------------------------------------------------
# A live server


@pytest.fixture(scope="module")
def server():
    with running_server(QWEN, "--max-model-len", "2048", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes") as base:
        yield base


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def _create(client, stream: bool = False, **kwargs):
    kwargs = {"messages": [{"role": "user", "content": "Weather in Paris?"}],
              "max_tokens": 300, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=QWEN, tools=TOOLS, stream=stream, **kwargs)


def _collect(chunks) -> tuple[str, list[dict], str]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for c in delta.tool_calls or ():
                entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
                entry["name"] += (c.function.name or "") if c.function else ""
                entry["arguments"] += (c.function.arguments or "") if c.function else ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _calls(message) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or ()]


@pytest.mark.parametrize("tool_choice_", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_calls_always_parse(server, client, tool_choice_):
    r = _create(client, tool_choice=tool_choice_)
    choice = r.choices[0]
    calls = _calls(choice.message)
    assert calls and choice.message.content is None
    for call in calls:
        args = json.loads(call["arguments"])
        assert call["name"] in FUNCTIONS and set(args) == set(FUNCTIONS[call["name"]]["required"])
    if tool_choice_ == "required":
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.finish_reason == "stop" and calls[0]["name"] == "get_weather"
        assert args["unit"] in ("C", "F") and len(args["city"]) <= 8
    streamed = _collect(_create(client, stream=True, tool_choice=tool_choice_))
    assert streamed == ("", calls, choice.finish_reason)
    server_wait_idle(server, None)


def test_auto_parses_the_models_calls_and_none_does_not(server, client):
    forced = {"guided_choice": ["Let me look.\n" + CALL]}
    r = _create(client, extra_body=forced)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content == "Let me look.\n"
    assert _calls(r.choices[0].message) == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}]
    assert _collect(_create(client, stream=True, extra_body=forced)) == (
        "Let me look.\n", _calls(r.choices[0].message), "tool_calls")
    # tool_choice none: the same output stays text.
    r = _create(client, tool_choice="none", extra_body=forced)
    assert r.choices[0].message.content == "Let me look.\n" + CALL
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    # Plain auto on random weights: text, with its usual finish.
    r = _create(client, max_tokens=8)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


def test_history_with_calls_and_results_and_n(server, client):
    r = _create(client, messages=HISTORY, max_tokens=4, n=2, temperature=1.0, seed=3)
    assert len(r.choices) == 2
    tokens = httpx.post(f"{server}/tokenize", json={"messages": HISTORY, "tools": TOOLS},
                        timeout=30).json()
    plain = httpx.post(f"{server}/tokenize", json={"messages": HISTORY}, timeout=30).json()
    assert r.usage.prompt_tokens == tokens["count"] > plain["count"]


@pytest.mark.parametrize("body, param, fragment", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "always"}, "tool_choice", "is not"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools",
     "letters, digits"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools", "invalid field"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "patternProperties": {}}}}],
      "tool_choice": "required"}, "tools", "patternProperties"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tools",
     "both constrain"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages", "not JSON"),
    ({"messages": [{"role": "user", "content": "q", "tool_calls": []}]}, "messages",
     "only an assistant"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
])
def test_bad_tool_requests_get_400_and_the_server_keeps_serving(server, client, body, param,
                                                                 fragment):
    request = {"model": QWEN, "messages": [{"role": "user", "content": "q"}], "tools": TOOLS,
               "max_tokens": 4, **body}
    request = {k: v for k, v in request.items() if v is not None}
    r = httpx.post(f"{server}/v1/chat/completions", json=request, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == param, error
    report = server_wait_idle(server, None)
    assert report["kv_available_tokens"] == report["kv_capacity_tokens"]
    assert _create(client, max_tokens=2).choices[0].finish_reason == "length"

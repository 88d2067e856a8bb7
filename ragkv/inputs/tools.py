"""Tools in a chat prompt: the functions a request offers, and the calls and results of earlier
turns, rendered by the model's chat template where it knows tools, else in the Hermes format
(the one Qwen2.5 and Qwen3 templates write) that ragkv adds to the system message itself, so a
tool call always has one format to be parsed from."""

from __future__ import annotations

import json
import re

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# OpenAI's rule for a function name.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PROBE_NAME = "ragkv_probe_function_7c1f"
_TEMPLATE_CALLS_TOOLS: dict[str, bool] = {}  # by template text
_MAX_TEMPLATES = 64


def check_tools(tools: object) -> None:
    """Check `tools` is OpenAI's list of {"type": "function", "function": {"name",
    "description", "parameters"}}: names as OpenAI allows them and unique, parameters a JSON
    schema object; raises ValueError naming the first that is not."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ValueError("tools must be a non-empty list of {'type': 'function', 'function': "
                         "{...}} objects")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn,
                                                                                         dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' "
                             f"or '-', got {name!r:.80}")
        if name in names:
            raise ValueError(f"tools[{i}]: a second function named {name!r}")
        names.add(name)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"tools[{i}].function.description must be a string")


def tool_fields(message: dict, where: str) -> dict:
    """The tool-calling fields of a chat message, as templates take them: an assistant's
    `tool_calls` (each {"id", "type": "function", "function": {"name", "arguments"}}, the
    arguments parsed from their JSON text into an object, as templates write them), a tool
    result's `tool_call_id` and `name`. Raises ValueError naming what is wrong."""
    out: dict = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant":
            raise ValueError(f"{where}: only an assistant message has tool_calls")
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list")
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise ValueError(f"{where}.{key} must be a string")
            out[key] = message[key]
    return out


def _call(call: object, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where} must be {{'id': ..., 'type': 'function', 'function': "
                         "{'name': ..., 'arguments': ...}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.function.arguments is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def render_inputs(tokenizer, chat_template: str | None, messages: list[dict],
                  tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools to hand the chat template: as they are where the template
    renders tools; else (or where there are none to render but the history holds calls) the
    messages rewritten in the Hermes format and no tools."""
    has_calls = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not tools and not has_calls:
        return messages, None
    if template_calls_tools(tokenizer, chat_template):
        return messages, tools or None
    return hermes_messages(messages, tools), None


def template_calls_tools(tokenizer, chat_template: str | None) -> bool:
    """Whether the template (the tokenizer's when None) writes the tools it is given into the
    prompt: found by rendering a probe function once per template."""
    text = chat_template if chat_template is not None else getattr(tokenizer, "chat_template",
                                                                   None)
    if not isinstance(text, str):
        return False
    known = _TEMPLATE_CALLS_TOOLS.get(text)
    if known is None:
        probe = {"type": "function", "function": {
            "name": _PROBE_NAME, "description": "probe",
            "parameters": {"type": "object", "properties": {}}}}
        try:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}], tools=[probe], tokenize=False,
                chat_template=text, add_generation_prompt=True)
            known = _PROBE_NAME in rendered
        except Exception:  # noqa: BLE001 (a template that fails on tools does not know them)
            known = False
        if len(_TEMPLATE_CALLS_TOOLS) >= _MAX_TEMPLATES:
            _TEMPLATE_CALLS_TOOLS.clear()
        _TEMPLATE_CALLS_TOOLS[text] = known
    return known


def hermes_preamble(tools: list[dict]) -> str:
    """ragkv's description of the tools and of the call format, for a template without one."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call functions to answer. Their signatures, one JSON object a "
            f"line:\n<tools>\n{lines}\n</tools>\n\nFor each call, reply with a JSON object "
            f"holding the function name and its arguments, inside {TOOL_CALL_OPEN}"
            f"{TOOL_CALL_CLOSE} tags:\n{TOOL_CALL_OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            f"{TOOL_CALL_CLOSE}")


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The chat in plain messages: the tools described at the end of the system message (a
    new one when there is none), an assistant's calls as <tool_call> JSON in its content, and
    tool results (consecutive ones together) as a user message of <tool_response> blocks."""
    out: list[dict] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        plain = {"role": role, "content": content}
        for call in m.get("tool_calls") or ():
            fn = call["function"]
            body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]},
                              ensure_ascii=False)
            plain["content"] += (("\n" if plain["content"] else "")
                                 + f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}")
        out.append(plain)
    for m in out:
        m.pop("tool_results", None)
    if tools:
        preamble = hermes_preamble(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0]["content"] + "\n\n" + preamble if out[0]["content"]
                                 else preamble)
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out

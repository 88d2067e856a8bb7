"""Tool calling on /v1/chat/completions: what `tool_choice` asks of the output, and the calls
parsed back out of it, whole or as OpenAI's streamed `tool_calls` deltas.

- `none`: the tools are shown to the model; the reply is text.
- `auto`: the model's own call format, the Hermes `<tool_call>{"name", "arguments"}</tool_call>`
  blocks (Qwen2.5/Qwen3 templates, and ragkv's preamble for templates without tools); text
  before the first block is the message content (see `ToolCallStream._auto`).
- `required`: the output is held to a JSON array of at least one {"name", "arguments"} object
  whose arguments follow that function's schema, by the structured-output grammar;
- a named function: the output is held to its parameters' schema and is the arguments.
Required and named calls therefore always parse.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from ..inputs.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

# A function without `parameters` takes any object.
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What a request's `tool_choice` asks: mode "none", "auto", "required" or "named" (then
    `name`), over the request's functions (name -> parameters schema)."""

    mode: str
    functions: dict[str, dict] = field(default_factory=dict)
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: more than one call in a reply

    @property
    def parses(self) -> bool:
        """Whether replies are parsed for calls (not for "none")."""
        return self.mode != "none"

    def schema(self) -> dict | None:
        """The JSON schema the output is held to (required, named), else None."""
        if self.mode == "named":
            return self.functions[self.name]
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "arguments": params},
                  "required": ["name", "arguments"]}
                 for name, params in self.functions.items()]
        array = {"type": "array", "minItems": 1,
                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return array


def tool_choice(tools: list[dict] | None, choice: object, parallel: bool | None) -> ToolChoice:
    """The ToolChoice of a request's `tools` (checked function definitions) and `tool_choice`
    (OpenAI's default: "auto" with tools, "none" without). Raises ValueError with the field."""
    functions = {t["function"]["name"]: t["function"].get("parameters") or _ANY_OBJECT
                 for t in tools or ()}
    parallel = parallel is not False
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': "
                             "'function', 'function': {'name': ...}}")
        if name not in functions:
            raise ValueError(f"tool_choice names function {name!r:.80}, which is not in tools")
        return ToolChoice("named", functions, name, parallel)
    if choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice {choice!r:.80} is not 'none', 'auto', 'required' or a "
                         "named function")
    if choice != "none" and not functions:
        raise ValueError(f"tool_choice {choice!r} needs tools")
    return ToolChoice(choice, functions, None, parallel)


def new_call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex


def _call(name: str, arguments: object) -> dict:
    """One call as OpenAI's message carries it (arguments: JSON text)."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _parse_call(body: str, functions: dict[str, dict]) -> list[dict] | None:
    """The calls in one <tool_call> block: a {"name", "arguments"} object, or a list of them
    (the form SmolLM2's tool-calling data uses); None unless every one names a known
    function with an object of arguments."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in functions:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        calls.append(_call(item["name"], args))
    return calls or None


def parse_required(text: str, functions: dict[str, dict]) -> list[dict] | None:
    """The calls of a `required` reply (a JSON array of {"name", "arguments"}), or None when
    it was cut short (max_tokens) and does not parse."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, list):
        return None
    calls = [_call(c["name"], c["arguments"]) for c in data
             if isinstance(c, dict) and c.get("name") in functions
             and isinstance(c.get("arguments"), dict)]
    return calls if len(calls) == len(data) and calls else None


def reply(choice: ToolChoice, text: str, finish_reason: str | None
          ) -> tuple[dict, str | None]:
    """The assistant message of a whole reply and its finish_reason ("tool_calls" when the
    model stopped after calling, as OpenAI's)."""
    calls: list[dict] = []
    content: str | None = text
    if choice.mode == "named":
        calls, content = [_call(choice.name, text)], None
    elif choice.mode == "required":
        calls = parse_required(text, choice.functions) or []
        content = None if calls else text
    elif choice.mode == "auto":
        delta, _ = ToolCallStream(choice).feed(text, True, None)
        calls = [{k: v for k, v in c.items() if k != "index"} for c in delta.get("tool_calls",
                                                                                  ())]
        content = (delta.get("content") or None) if calls else text
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
        if choice.mode != "named" and finish_reason == "stop":
            finish_reason = "tool_calls"
    return message, finish_reason


class ToolCallStream:
    """One choice's streamed reply turned into OpenAI deltas: `feed` takes the next text (the
    whole of it once `finished`) and returns the delta fields to send (content and/or
    tool_calls), and the finish_reason to report. A named call streams its arguments as they
    come; `required` is parsed at the end; `auto` streams content until a <tool_call> may
    begin, then sends each call once its block closes, and at the end what did not parse as
    content."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.text = ""  # everything fed
        self.sent = 0  # characters of it accounted for (sent as content or as calls)
        self.calls = 0  # calls sent
        self.failed = False  # auto: a block did not parse, so the rest is content
        self.content_sent = False

    def feed(self, new_text: str, finished: bool, finish_reason: str | None
             ) -> tuple[dict, str | None]:
        self.text += new_text
        mode = self.choice.mode
        if mode == "named":
            return self._named(new_text), finish_reason
        if mode == "required":
            if not finished:
                return {}, finish_reason
            calls = parse_required(self.text, self.choice.functions)
            if calls is None:
                return {"content": self.text}, finish_reason
            return self._calls(calls), "tool_calls" if finish_reason == "stop" else finish_reason
        delta = self._auto(finished)
        if finished and self.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return delta, finish_reason

    def _named(self, new_text: str) -> dict:
        if self.calls == 0:
            self.calls = 1
            return {"tool_calls": [{"index": 0, "id": new_call_id(), "type": "function",
                                    "function": {"name": self.choice.name,
                                                 "arguments": new_text}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]} \
            if new_text else {}

    def _calls(self, calls: list[dict]) -> dict:
        if not self.choice.parallel:
            calls = calls[:max(0, 1 - self.calls)]
        deltas = [{"index": self.calls + i, **c} for i, c in enumerate(calls)]
        self.calls += len(deltas)
        return {"tool_calls": deltas} if deltas else {}

    def _auto(self, finished: bool) -> dict:
        """The Hermes format: the text before the first <tool_call> is content (blank
        content is held until something else arrives), each closed block (or one left open
        at the end) a call, text between and after blocks is dropped; from a block that
        does not parse as a call of a known function on, everything is content."""
        delta: dict = {}
        content = ""
        while True:
            rest = self.text[self.sent:]
            if self.failed:
                content += rest
                self.sent = len(self.text)
                break
            start = rest.find(TOOL_CALL_OPEN)
            if start < 0:
                usable = len(rest) - (0 if finished else _partial_suffix(rest, TOOL_CALL_OPEN))
                if not self.calls:
                    if not finished and not (self.content_sent or rest[:usable].strip()):
                        break  # blank so far: maybe the spacing before a call
                    content += rest[:usable]
                self.sent += usable
                break
            if not self.calls and (self.content_sent or rest[:start].strip()):
                content += rest[:start]
            self.sent += start
            block = self.text[self.sent:]
            end = block.find(TOOL_CALL_CLOSE)
            if end < 0 and not finished:
                break
            call = _parse_call(block[len(TOOL_CALL_OPEN):end if end >= 0 else len(block)],
                               self.choice.functions)
            if call is None:
                self.failed = True
                if not self.calls and not self.content_sent:
                    self.sent, content = 0, ""  # no call at all: the whole reply is text
                continue
            sent = self._calls(call).get("tool_calls")
            if sent:
                delta.setdefault("tool_calls", []).extend(sent)
            self.sent += end + len(TOOL_CALL_CLOSE) if end >= 0 else len(block)
        if content:
            self.content_sent = True
            delta["content"] = content
        return delta


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

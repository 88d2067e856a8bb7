"""Server fuzz test: a few hundred generated malformed requests sent to a real `ragkv serve`
while long streaming completions run.

Checked:
- every malformed request gets a 4xx (the documented status where there is one: 401 for the API
  key, 404 for an unknown model or path, 405 for a wrong method, 413 for an oversize body, 415
  for a body that is not declared as JSON) whose body is an OpenAI error object
  `{"error": {"message", "type", "param", "code"}}` with `code` repeating the status; never a
  5xx, a hang or a dropped connection;
- streams run during all of the fuzzing (the first is mid-stream when it starts, their
  events arrive while the malformed requests are answered and after the last one), and each
  is unaffected: it ends normally (a last chunk with finish_reason "length", then
  `data: [DONE]`) and its text equals the same request made non-streaming afterwards
  (greedy, so deterministic);
- /health stays 200 and /debug/integrity ok between batches; once idle nothing runs or waits
  and every general KV slot is available again; a normal request still succeeds.

The malformed requests cover wrong JSON types for every request field, out-of-bounds values,
lone surrogates and invalid UTF-8, deep nesting, oversize bodies, wrong content types, bodies
that are not JSON objects, wrong paths, methods and API keys, chat-specific mistakes, and
random mutations of valid bodies. Each one is invalid per the OpenAI API as docs/server.md
describes it: unknown fields are ignored by design, so a case never relies on one being
rejected. The cases come from a seeded `random.Random`, so a failure reproduces exactly; the
failure message shows each offending request as sent and the answer.
"""

from __future__ import annotations

import base64
import copy
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import running_server, server_integrity, server_wait_idle

MODEL = "builtin:tiny"
KEY = "sk-fuzz-key"
VOCAB = 4096  # builtin:tiny's vocabulary
MAX_MODEL_LEN = 2048
MAX_BODY = 200_000
SEED = 20_240_611
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
AUTH = (("Authorization", f"Bearer {KEY}"),)
JSON_AUTH = (*AUTH, ("Content-Type", "application/json"))
BATCH = 60  # requests between two health and integrity checks
WORKERS = 4  # concurrent malformed requests: enough to overlap, few enough for 2 cores

DOCS_PROMPT = ("You answer from the documents. ## Bread needs flour, water and salt. "
               "## Rye bread is dense and dark. ## Which bread is denser?")
# The long stream that must not notice the fuzzing: greedy, so its text is reproducible.
STREAM_BODY = {"model": MODEL, "max_tokens": 300, "ignore_eos": True, "temperature": 0,
               "stream": True,
               "prompt": ("You tell long stories. ## Bread needs flour, water and salt. "
                          "## Rye bread is dense and dark. ## Tell a long story about bread.")}


@dataclass(frozen=True)
class Case:
    """One request. `expect` is the exact status where the API documents one, else None (any
    4xx). `chunked` sends the body without a Content-Length; `raw` is a whole HTTP/1.1
    request sent over a plain socket (for heads that httpx will not produce)."""

    category: str
    what: str
    body: bytes = b""
    path: str = COMPLETIONS
    method: str = "POST"
    headers: tuple[tuple[str, str | bytes], ...] = JSON_AUTH
    expect: int | None = None
    chunked: bool = False
    raw: bytes | None = None

    def describe(self) -> str:
        data = self.raw if self.raw is not None else self.body
        shown = repr(data[:300]) + (f"... ({len(data)} bytes)" if len(data) > 300 else "")
        if self.raw is not None:
            return f"[{self.category}] {self.what}: raw request {shown}"
        how = "chunked, no Content-Length" if self.chunked else "Content-Length"
        return (f"[{self.category}] {self.what}: {self.method} {self.path} "
                f"headers={dict(self.headers)!r} body ({how})={shown}")


# --- generation ------------------------------------------------------------------------------

_PROMPTS = ["Tell me about bread.", DOCS_PROMPT, [5, 17, 923, 44],
            ["First prompt", "System ## a document ## a question?"], [[5, 6, 7], [8, 9]]]
_MESSAGES = [
    [{"role": "user", "content": "Which bread is denser?"}],
    [{"role": "system", "content": "You answer from the documents."},
     {"role": "user", "content": "Which is denser?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                  {"type": "text", "text": "about rye."}]}],
]
_DOCUMENTS = ["Bread needs flour.", " Rye bread is dense."]
# Valid optional fields mixed into the bases; the last two are unknown, hence ignored.
_OPTIONAL = [("temperature", 0), ("seed", 7), ("stream", True), ("top_k", 5), ("top_p", 0.9),
             ("stop", ["\n\n"]), ("cache_salt", "tenant-a"), ("user", "fuzz"),
             ("logit_bias", {}), ("x_unknown", [1, {"a": None}])]

# Characters that tend to break text handling, all valid Unicode scalar values.
_ODD_CHARS = ["\x00", "\x01", "\x1f", "\x7f", "\x85", "\xa0", "\u0301", "\u200b", "\u200d",
              "\u202e", "\u2028", "\u2029", "\ufeff", "\ufffd", "\ufffe", "\uffff",
              "\U0001f600", "\U0010ffff", "\\", '"', "'", "{", "}", "é", "中", "\ufdfa"]
# Lone surrogates (json.dumps writes them as \uXXXX escapes); a reversed pair is two lone ones.
_SURROGATES = ["\ud800", "\udfff", "a\udbffb", "\ude00\ud83d", "x\ud83d"]
# Byte sequences that are not UTF-8: bad lead bytes, a stray continuation byte, an overlong
# "/", an encoded surrogate, a code point past U+10FFFF, a truncated sequence, a 5-byte form.
_NOT_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\x80", b"\xc0\xaf", b"\xed\xa0\x80",
             b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xf8\x88\x80\x80\x80"]

_COMMON_FIELDS = {
    "model": "str", "n": "int", "max_tokens": "int", "temperature": "float", "top_p": "float",
    "top_k": "int", "min_p": "float", "seed": "int", "stop": "stop", "stop_token_ids": "ids",
    "stream": "bool", "stream_options": "stream_options", "ignore_eos": "bool",
    "skip_special_tokens": "bool", "cache_salt": "str", "user": "str",
}
COMPLETION_FIELDS = {**_COMMON_FIELDS, "prompt": "prompt", "logprobs": "int", "echo": "bool",
                     "suffix": "str"}
CHAT_FIELDS = {**_COMMON_FIELDS, "messages": "messages", "max_completion_tokens": "int",
               "logprobs": "bool", "top_logprobs": "int", "documents": "documents"}


def _garbage(rng: random.Random, n: int) -> str:
    """n characters of valid but hostile Unicode (no surrogates)."""
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            out.append(rng.choice(_ODD_CHARS))
        else:
            cp = rng.randrange(0x20, 0x110000)
            while 0xD800 <= cp <= 0xDFFF:
                cp = rng.randrange(0x20, 0x110000)
            out.append(chr(cp))
    return "".join(out)


def _wrong(rng: random.Random, kind: str) -> object:
    """A JSON value of the wrong type for a field of this kind. null is never used for an
    optional field (null means "default" there); integral floats never for an integer (JSON
    Schema counts 2.0 as an integer); per the OpenAI API 0 and 1 are not booleans and "1" is
    not a number."""
    strings = ["", "1", "0.5", "true", "null", "[]", "ragkv", _garbage(rng, 6)]
    bool_wrong = [*strings, 0, 1, 2, -1, 0.5, [True], [], {"value": True}, {}]
    str_wrong = [0, 1, -7, 0.5, True, False, [MODEL], ["a", "b"], [], {"name": MODEL}, {}]
    pools: dict[str, list] = {
        "int": [*strings, 0.5, -2.5, 1e-3, True, False, [1], [], {"value": 1}, {}],
        "float": [*strings, True, False, [0.5], [], {"value": 0.5}, {}],
        "bool": bool_wrong,
        "str": str_wrong,
        "stop": [0, 1.5, True, {}, {"stop": "x"}, [1], [None], [True], [["a"]], [{}],
                 ["ok", 5]],
        "ids": ["1", 1, True, {}, {"0": 1}, ["1"], [1.5], [True], [None], [[1]], [1, "2"]],
        "stream_options": ["yes", 1, True, [], [{"include_usage": True}],
                           {"include_usage": rng.choice(bool_wrong)}],
        "prompt": [None, 5, 1.5, True, {}, {"prompt_token_ids": [1, 2]}, [True], [1.5],
                   [None], ["a", 1], [1, "a"], [[1], "a"], ["a", [1]], [[True]], [[1.5]],
                   [[None]], [[1, [2]]], [{"text": "a"}], [["a"]], [[[1]]]],
        "documents": ["doc", 5, True, {}, {"0": "doc"}, [5], [None], [True], [["doc"]], [{}],
                      ["ok", 1]],
    }
    if kind == "messages":
        return _wrong_messages(rng, str_wrong)
    return copy.deepcopy(rng.choice(pools[kind]))


def _wrong_messages(rng: random.Random, str_wrong: list) -> object:
    content_wrong = [5, 0.5, True, {"type": "text", "text": "hi"}, [5], ["hi"], [None],
                     [[{"type": "text", "text": "hi"}]], [True]]
    messages = copy.deepcopy(rng.choice(_MESSAGES))
    i = rng.randrange(len(messages))
    how = rng.randrange(5)
    if how == 0:  # the list itself has the wrong type
        return rng.choice([None, "hi", 5, {}, {"role": "user", "content": "hi"}])
    if how == 1:  # an entry is not a message object
        messages[i] = rng.choice([None, "hi", 5, [], [{"role": "user", "content": "hi"}]])
    elif how == 2:  # a message without a role, or with a null one
        messages[i] = rng.choice([{"content": "hi"}, {"role": None, "content": "hi"}])
    elif how == 3:
        messages[i]["role"] = copy.deepcopy(rng.choice(str_wrong))
    else:
        messages[i]["content"] = copy.deepcopy(rng.choice(content_wrong))
    return messages


def _base(rng: random.Random, chat: bool) -> dict:
    """A valid request (a cheap one: a few tokens)."""
    body: dict = {"model": MODEL, "max_tokens": rng.randint(1, 3)}
    if chat:
        body["messages"] = copy.deepcopy(rng.choice(_MESSAGES))
        if rng.random() < 0.4:
            body["documents"] = list(_DOCUMENTS)
    else:
        body["prompt"] = copy.deepcopy(rng.choice(_PROMPTS))
    body.update(rng.sample(_OPTIONAL, rng.randint(0, 3)))
    return body


def _dumps(rng: random.Random, body: dict) -> bytes:
    items = list(body.items())
    rng.shuffle(items)  # field order must not matter
    return json.dumps(dict(items)).encode()


def _endpoint(chat: bool) -> str:
    return CHAT if chat else COMPLETIONS


def _wrong_types(rng: random.Random, per_field: int = 6) -> list[Case]:
    cases = []
    for chat, fields in ((False, COMPLETION_FIELDS), (True, CHAT_FIELDS)):
        for name, kind in fields.items():
            for _ in range(per_field):
                body = _base(rng, chat)
                body[name] = _wrong(rng, kind)
                cases.append(Case("wrong-type", f"{name}={body[name]!r}"[:80],
                                  _dumps(rng, body), _endpoint(chat)))
        # null where a value is required
        for name in ("model", "messages" if chat else "prompt"):
            body = _base(rng, chat)
            body[name] = None
            cases.append(Case("wrong-type", f"{name}=null", _dumps(rng, body), _endpoint(chat)))
            del body[name]
            cases.append(Case("wrong-type", f"no {name}", _dumps(rng, body), _endpoint(chat)))
    body = _base(rng, True)
    body["messages"][-1]["role"] = None
    cases.append(Case("wrong-type", "role=null", _dumps(rng, body), CHAT))
    return cases


def _bounds(rng: random.Random) -> list[Case]:
    cases = []

    def add(chat: bool, what: str, changes: dict, literal: bytes | None = None) -> None:
        body = _base(rng, chat)
        body.pop("max_completion_tokens", None)
        body.update(changes)
        data = _dumps(rng, body)
        if literal is not None:  # a non-standard number literal json.dumps cannot write
            data = data.replace(b'"@LITERAL@"', literal)
        cases.append(Case("bounds", what, data, _endpoint(chat)))

    for chat in (False, True):
        for n in (0, -1, 10**12, 10**30):
            add(chat, f"n={n}", {"n": n})
        # (0 is valid: the prompt is only scored.) The last: prompt + max_tokens > limit.
        for m in (-1, -5, 10**9, 10**30, MAX_MODEL_LEN):
            add(chat, f"max_tokens={m}", {"max_tokens": m})
        for t in (-1, -1e-9, -10**30):
            add(chat, f"temperature={t}", {"temperature": t})
        for p in (0, 1.5, -0.1, 1.0000001):
            add(chat, f"top_p={p}", {"top_p": p})
        for k in (-2, -10**30):
            add(chat, f"top_k={k}", {"top_k": k})
        for p in (2, -0.1, 1.5):
            add(chat, f"min_p={p}", {"min_p": p})
        for s in (2**64, 10**30, -(2**63) - 1):  # outside the 64-bit seed range
            add(chat, f"seed={s}", {"seed": s})
        for stop in ("", [""], ["ok", ""]):
            add(chat, f"stop={stop!r}", {"stop": stop})
        for ids in ([-1], [5, -7]):
            add(chat, f"stop_token_ids={ids}", {"stop_token_ids": ids})
        for name, literal in (("temperature", b"NaN"), ("temperature", b"Infinity"),
                              ("temperature", b"-Infinity"), ("temperature", b"1e999"),
                              ("top_p", b"NaN"), ("min_p", b"Infinity")):
            add(chat, f"{name}={literal.decode()}", {name: "@LITERAL@"}, literal)
    # completions
    for lp in (-1, 21, 10**6):
        add(False, f"logprobs={lp}", {"logprobs": lp})
    long_text = "word " * 13_000  # past the character cap for max_model_len
    prompts = {
        "token id -1": [-1], "token id = vocab": [VOCAB], "token id 1e20": [10**20],
        "token id = vocab in a batch": [[5, VOCAB]], "negative id in a batch": [[7], [-3]],
        "empty list": [], "empty string": "", "empty token list": [[]],
        "empty prompt in a list": ["ok", ""], "5000 prompts": ["x"] * 5000,
        f"{MAX_MODEL_LEN + 1} token ids": list(range(10, 11 + MAX_MODEL_LEN)),
        f"{MAX_MODEL_LEN} token ids": list(range(10, 10 + MAX_MODEL_LEN)),
        "blank question": "system ## a document ##   ", "only separators": "## ##",
        "text over the character cap": long_text,
    }
    for what, prompt in prompts.items():
        add(False, f"prompt: {what}", {"prompt": prompt})
    add(False, "prompt + max_tokens over max_model_len",
        {"prompt": list(range(10, 10 + MAX_MODEL_LEN - 1)), "max_tokens": 2})
    add(False, "echo=true with stream", {"echo": True, "stream": True})
    add(False, "suffix", {"suffix": "the end"})
    # chat
    for m in (-2, -1, 10**9, MAX_MODEL_LEN):
        add(True, f"max_completion_tokens={m}", {"max_completion_tokens": m, "max_tokens": 2})
    for changes in ({"logprobs": True, "top_logprobs": 21},
                    {"logprobs": True, "top_logprobs": -1},
                    {"logprobs": True, "top_logprobs": 10**6},
                    {"top_logprobs": 2}, {"logprobs": False, "top_logprobs": 2}):
        add(True, f"{changes}", changes)
    add(True, "conversation over max_model_len",
        {"messages": [{"role": "user", "content": long_text}]})
    return cases


def _unicode(rng: random.Random) -> list[Case]:
    cases = []

    def setters(s: str) -> list[tuple[bool, str, object]]:
        """(chat, what, change): change is a dict merged into a base, or a function."""
        def content(body: dict) -> None:
            body["messages"][-1]["content"] = s

        def text_part(body: dict) -> None:
            body["messages"][-1]["content"] = [{"type": "text", "text": s}]

        def role(body: dict) -> None:
            body["messages"][-1]["role"] = s

        def message_key(body: dict) -> None:
            body["messages"][0][s] = "x"

        def part_key(body: dict) -> None:
            body["messages"][-1]["content"] = [{"type": "text", "text": "hi", s: 1}]

        def message_name(body: dict) -> None:
            body["messages"][0]["name"] = s

        return [
            (False, "model", {"model": s}), (False, "prompt", {"prompt": s}),
            (False, "prompt list entry", {"prompt": ["ok", s]}),
            (False, "cache_salt", {"cache_salt": s}), (False, "stop", {"stop": s}),
            (False, "stop list entry", {"stop": ["ok", s]}), (False, "user", {"user": s}),
            (False, "top-level key", {s: 1}), (False, "stream_options key", {
                "stream_options": {s: True}}),
            (False, "nested key of an unknown field", {"extra": {s: 1}}),
            (True, "model", {"model": s}), (True, "content", content),
            (True, "text part", text_part), (True, "role", role),
            (True, "message name", message_name), (True, "documents", {"documents": [s]}),
            (True, "documents entry", {"documents": ["ok", s]}),
            (True, "cache_salt", {"cache_salt": s}), (True, "stop", {"stop": [s]}),
            (True, "top-level key", {s: 1}), (True, "message key", message_key),
            (True, "content part key", part_key),
        ]

    # Lone surrogates, as JSON escapes, in every string field and in keys: each place twice.
    for _ in range(2):
        for place in range(len(setters(""))):
            s = rng.choice(_SURROGATES)
            chat, what, change = setters(s)[place]
            body = _base(rng, chat)
            if callable(change):
                change(body)
            else:
                body.update(change)
            cases.append(Case("unicode", f"lone surrogate {s!r} in {what}",
                              _dumps(rng, body), _endpoint(chat)))
    # Bytes that are not UTF-8, in a value, a key, or as the whole body.
    for bad in _NOT_UTF8:
        for where in ["key", *rng.sample(["prompt", "model", "content", "documents", "body"], 2)]:
            chat = where in ("content", "documents") or (where != "prompt" and rng.random() < .5)
            body = _base(rng, chat)
            if where == "key":
                body["@BAD@"] = 1
            elif where == "content":
                body["messages"][-1]["content"] = "hi @BAD@"
            elif where == "documents":
                body["documents"] = ["@BAD@"]
            elif where in ("prompt", "model"):
                body[where] = "@BAD@ x"
            data = _dumps(rng, body).replace(b"@BAD@", bad) if where != "body" else bad
            cases.append(Case("unicode", f"not UTF-8 {bad!r} in {where}", data, _endpoint(chat)))
    # Valid but hostile text where it cannot be right.
    for _ in range(4):
        body = _base(rng, rng.random() < 0.5)
        body["model"] = _garbage(rng, rng.randint(1, 40))
        cases.append(Case("unicode", "garbage model name", _dumps(rng, body),
                          _endpoint("messages" in body), expect=404))
        body = _base(rng, True)
        body["messages"][-1]["role"] = _garbage(rng, rng.randint(1, 12))
        cases.append(Case("unicode", "garbage role", _dumps(rng, body), CHAT))
        cases.append(Case("unicode", "body is a garbage string",
                          json.dumps(_garbage(rng, 50)).encode(), rng.choice([COMPLETIONS, CHAT])))
    # 20,000 random characters are far more than 2047 tokens.
    for chat in (False, True):
        text = _garbage(rng, 20_000)
        body = _base(rng, chat)
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        cases.append(Case("unicode", "20000 garbage characters",
                          json.dumps(body, ensure_ascii=False).encode(), _endpoint(chat)))
    return cases


def _deep_json(rng: random.Random) -> list[Case]:
    cases = []

    def fit(prefix: bytes, suffix: bytes, depth: int, pair: tuple[bytes, bytes]) -> int:
        """The depth, lowered to fit the body limit (so that the depth is what is tested)."""
        room = (MAX_BODY - len(prefix) - len(suffix)) // (len(pair[0]) + len(pair[1]))
        return min(depth, room)

    for depth in (100, 1000, 100_000):
        d = fit(b"", b"", depth, (b"[", b"]"))
        cases.append(Case("deep", f"body: array {d} deep", b"[" * d + b"]" * d,
                          rng.choice([COMPLETIONS, CHAT])))
        d = fit(b'{"a":', b"}", depth, (b'{"a":', b"}"))
        cases.append(Case("deep", f"body: object {d} deep", b'{"a":' * d + b"1" + b"}" * d,
                          rng.choice([COMPLETIONS, CHAT])))
        mixed = (b'{"a":[', b"]}")
        d = fit(b"", b"", depth, mixed)
        cases.append(Case("deep", f"body: objects and arrays {d} deep",
                          mixed[0] * d + mixed[1] * d, rng.choice([COMPLETIONS, CHAT])))
        fields = [
            (COMPLETIONS, b'{"model":"builtin:tiny","prompt":', b"}", (b"[", b"]")),
            (COMPLETIONS, b'{"model":"builtin:tiny","prompt":"hi","stop":', b"}", (b"[", b"]")),
            (COMPLETIONS, b'{"model":"builtin:tiny","prompt":"hi","stream_options":', b"}",
             (b'{"include_usage":', b"}")),
            (CHAT, b'{"model":"builtin:tiny","messages":[{"role":"user","content":', b"}]}",
             (b"[", b"]")),
            (CHAT, b'{"model":"builtin:tiny","messages":[{"role":"user","content":"q"}],'
                   b'"documents":', b"}", (b"[", b"]")),
            (CHAT, b'{"model":"builtin:tiny","messages":', b"}", (b'[{"role":"user","content":',
                                                                 b"}]")),
        ]
        for path, prefix, suffix, pair in fields:
            inner = b'"x"' if pair[0].endswith(b":") else b""
            d = fit(prefix, inner + suffix, depth, pair)
            body = prefix + pair[0] * d + inner + pair[1] * d + suffix
            name = prefix.rsplit(b'"', 2)[-2].decode()
            cases.append(Case("deep", f"{name}: {d} deep", body, path))
    cases.append(Case("deep", "100000 unclosed arrays", b"[" * 100_000, COMPLETIONS))
    cases.append(Case("deep", "1000 unclosed objects", b'{"a":' * 1000, CHAT))
    return cases


def _oversize(rng: random.Random) -> list[Case]:
    cases = []

    def padded(chat: bool, size: int) -> bytes:
        body = _base(rng, chat)
        key = "messages" if chat else "prompt"
        body[key] = "@PAD@"
        data = _dumps(rng, body)
        pad = b"x" * (size - len(data) + len(b"@PAD@"))
        if chat:
            return data.replace(b'"@PAD@"', b'[{"role":"user","content":"' + pad + b'"}]')
        return data.replace(b"@PAD@", pad)

    for chat in (False, True):
        for size in (MAX_BODY + 1, 300_000):
            data = padded(chat, size)
            for chunked in (False, True):
                how = "chunked" if chunked else "Content-Length"
                cases.append(Case("oversize", f"{len(data)}-byte JSON body, {how}", data,
                                  _endpoint(chat), expect=413, chunked=chunked))
    junk = b"x" * 250_000
    cases.append(Case("oversize", "250000 bytes of junk", junk, expect=413))
    cases.append(Case("oversize", "250000 bytes of junk, chunked", junk, CHAT, expect=413,
                      chunked=True))
    # The API key is checked first: an unauthenticated oversize request is a 401.
    cases.append(Case("oversize", "oversize without an API key", padded(False, 300_000),
                      headers=(("Content-Type", "application/json"),), expect=401))
    # Refused from the declared length alone, before any body arrives.
    for length in (b"200001", b"99999999999999999999"):
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: fuzz.test\r\n"
                b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                b"Content-Type: application/json\r\nContent-Length: " + length + b"\r\n\r\n")
        cases.append(Case("oversize", f"Content-Length {length.decode()}, no body sent",
                          expect=413, raw=head))
    return cases


def _content_types(rng: random.Random) -> list[Case]:
    cases = []
    types: list[str | bytes | None] = [
        None, "", "text/plain", "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=fuzz", "application/xml", "application/octet-stream",
        "*/*", b"application/json\xff", b"\xfe\xff"]
    for ctype in types:
        for chat in (False, True):
            headers = AUTH if ctype is None else (*AUTH, ("Content-Type", ctype))
            cases.append(Case("content-type", f"Content-Type {ctype!r} with a valid body",
                              _dumps(rng, _base(rng, chat)), _endpoint(chat), headers=headers,
                              expect=415))
    return cases


def _not_json(rng: random.Random) -> list[Case]:
    bodies = [
        b"", b" ", b"\n", b"{", b"}", b"[", b"[1,2]", b"[]", b"null", b"true", b"0", b'"str"',
        b"1e999", b"-1e999", b"9" * 5000, b"-" + b"9" * 5000, b"{}", b'{"model": "builtin:tiny"}',
        b"{'model': 'builtin:tiny', 'prompt': 'hi'}",
        b'{"model": "builtin:tiny", "prompt": "hi",}',
        b'{"model": "builtin:tiny" "prompt": "hi"}',
        b'{"model": "builtin:tiny", "prompt": "hi"} trailing',
        b'{"model": "builtin:tiny", "prompt": "hi"}{}',
        b'// comment\n{"model": "builtin:tiny", "prompt": "hi"}',
        b'{"model": "builtin:tiny", /* c */ "prompt": "hi"}',
        b'{"model": builtin:tiny, "prompt": "hi"}', b"\x00", b"NaN",
        b'{"model": "builtin:tiny", "prompt": "unterminated}',
        b'{"model": "builtin:tiny", "prompt": "bad \\x escape"}',
        b'{"model": "builtin:tiny", "prompt": "raw\ncontrol character"}',
        b'{"model": "builtin:tiny", "prompt": "hi", "n": ' + b"9" * 5000 + b"}",
        b'{"model": "builtin:tiny", "prompt": "hi", "max_tokens": 1' + b"0" * 4999 + b"}",
        b'{"model": "builtin:tiny", "prompt": [' + b"1" * 5000 + b"]}",
    ]
    return [Case("not-json", f"body {body[:40]!r}", body, path)
            for body in bodies for path in (COMPLETIONS, CHAT)]


def _routing_and_auth(rng: random.Random) -> list[Case]:
    cases = []
    valid = {COMPLETIONS: _dumps(rng, _base(rng, False)), CHAT: _dumps(rng, _base(rng, True))}
    for path in (COMPLETIONS, CHAT):
        for method in ("GET", "PUT", "PATCH", "DELETE", "OPTIONS"):
            body = valid[path] if method in ("PUT", "PATCH") else b""
            cases.append(Case("method", f"{method} {path}", body, path, method, expect=405))
    for method, path in (("POST", "/v1/models"), ("PUT", "/v1/models"), ("POST", "/health"),
                         ("POST", "/metrics"), ("POST", "/debug/integrity"),
                         ("DELETE", "/debug/integrity")):
        cases.append(Case("method", f"{method} {path}", b"", path, method, expect=405))
    for path in ("/v1/complete", "/v2/completions", "/V1/completions", "/v1/chat",
                 "/v1/chat/completion", "/v1/engines/builtin:tiny/completions",
                 "/v1/embeddings", "/v1/responses", "/completions",
                 "/", "/debug", "/v1/%00", "/v1/..%2f..%2fetc%2fpasswd", "/%ff",
                 "/v1/completions;x", "/v1//completions", "/" + "a" * 4000):
        cases.append(Case("path", f"POST {path[:60]}", valid[COMPLETIONS], path, expect=404))
    wrong_keys: list[str | bytes | None] = [
        None, "Bearer wrong", f"bearer {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}",
        f"Bearer  {KEY}", KEY, f"Token {KEY}", "Basic " + base64.b64encode(
            f"user:{KEY}".encode()).decode(), "Bearer", b"Bearer \xff\xfe" + KEY.encode(),
        f"Bearer {KEY},Bearer {KEY}"]
    targets = [("POST", COMPLETIONS, valid[COMPLETIONS]), ("POST", CHAT, valid[CHAT]),
               ("GET", "/v1/models", b""), ("GET", "/debug/integrity", b""),
               ("GET", "/v1/nothing-here", b""), ("GET", COMPLETIONS, b"")]
    for auth in wrong_keys:
        for method, path, body in rng.sample(targets, 3):
            headers = (("Content-Type", "application/json"),)
            if auth is not None:
                headers = (("Authorization", auth), *headers)
            cases.append(Case("auth", f"Authorization {auth!r} on {method} {path}", body, path,
                              method, headers, expect=401))
    return cases


def _chat_specific(rng: random.Random) -> list[Case]:
    cases = []

    def add(what: str, messages: list, documents: list | None = None, **extra) -> None:
        body = _base(rng, True)
        body.pop("documents", None)
        body["messages"] = messages
        if documents is not None:
            body["documents"] = documents
        body.update(extra)
        cases.append(Case("chat", what, _dumps(rng, body), CHAT))

    system = {"role": "system", "content": "You answer from the documents."}
    assistant = {"role": "assistant", "content": "Sure."}
    add("empty messages", [])
    add("only a system message", [system])
    add("only an assistant message", [assistant])
    add("system and assistant, no user", [system, assistant])
    add("only a tool message", [{"role": "tool", "content": "42", "tool_call_id": "x"}])
    add("documents without a user message", [system], _DOCUMENTS)
    for content in ("", "   ", None, [], [{"type": "text", "text": "  "}]):
        add(f"documents with an empty question {content!r}",
            [system, {"role": "user", "content": content}], _DOCUMENTS)
    add("empty question after separators",
        [{"role": "user", "content": "Doc one ## doc two ##  "}])
    add("documents=[] and an empty user message", [{"role": "user", "content": ""}], [])
    for role in ("alien", "", "USER", "Assistant", "system "):
        add(f"role {role!r}", [{"role": role, "content": "hi"}])
    parts = [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f"}}, {"type": 5, "text": "hi"},
        {"type": None, "text": "hi"}, {"text": "hi"}, {}, {"type": "TEXT", "text": "hi"},
        # a text part's text must be a string (OpenAI: required string)
        {"type": "text"}, {"type": "text", "text": None}, {"type": "text", "text": 5},
        {"type": "text", "text": ["hi"]}, {"type": "text", "text": {"value": "hi"}},
    ]
    for part in parts:
        add(f"content part {part!r}",
            [{"role": "user", "content": [{"type": "text", "text": "Look: "}, part]}])
    return cases


def _invalid_json(data: bytes) -> bool:
    """True when the server's parser (json.loads) cannot give a JSON object."""
    try:
        return not isinstance(json.loads(data), dict)
    except (ValueError, RecursionError):
        return True


def _mutations(rng: random.Random, count: int) -> list[Case]:
    """Valid bodies with a few bytes deleted, inserted, replaced or cut off; kept only when
    the result no longer parses as a JSON object (else it might still be valid)."""
    alphabet = [b"{", b"}", b"[", b"]", b'"', b":", b",", b"\\", b"\x00", b"\xff", b" ", b"1",
                b"-", b"e", b".", b"n", b"t", b"\xe2"]
    cases: list[Case] = []
    while len(cases) < count:
        chat = rng.random() < 0.5
        data = bytearray(_dumps(rng, _base(rng, chat)))
        ops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(data))
            op = rng.choice(["delete", "insert", "replace", "truncate", "swap"])
            if op == "delete":
                del data[i]
            elif op == "insert":
                data[i:i] = rng.choice(alphabet)
            elif op == "replace":
                data[i:i + 1] = rng.choice(alphabet)
            elif op == "truncate":
                del data[i:]
            else:
                j = rng.randrange(len(data))
                data[i], data[j] = data[j], data[i]
            ops.append(f"{op}@{i}")
            if not data:
                break
        if _invalid_json(bytes(data)):
            cases.append(Case("mutation", " ".join(ops), bytes(data), _endpoint(chat)))
    return cases


def _random_bytes(rng: random.Random, count: int) -> list[Case]:
    cases: list[Case] = []
    while len(cases) < count:
        size = rng.choice([1, 2, 7, 64, 1000, 20_000])
        if rng.random() < 0.5:
            data = rng.randbytes(size)
        else:  # printable: gets further into the JSON parser
            data = bytes(rng.randrange(0x20, 0x7f) for _ in range(size))
        if _invalid_json(data):
            cases.append(Case("random-bytes", f"{size} random bytes", data,
                              rng.choice([COMPLETIONS, CHAT])))
    return cases


def generate_cases(seed: int = SEED) -> list[Case]:
    rng = random.Random(seed)
    cases = [*_wrong_types(rng), *_bounds(rng), *_unicode(rng), *_deep_json(rng),
             *_oversize(rng), *_content_types(rng), *_not_json(rng), *_routing_and_auth(rng),
             *_chat_specific(rng), *_mutations(rng, 40), *_random_bytes(rng, 15)]
    unique = list({(c.method, c.path, c.headers, c.body, c.chunked, c.raw): c
                   for c in cases}.values())
    rng.shuffle(unique)  # interleave the categories: slow cases run beside fast ones
    return unique


# --- sending and checking --------------------------------------------------------------------

def _pieces(data: bytes):
    for i in range(0, len(data), 16_384):
        yield data[i:i + 16_384]


def _send_raw(base: str, request: bytes) -> tuple[int, str, bytes] | str:
    url = urlsplit(base)
    try:
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65_536)
                if not chunk:
                    return f"connection closed after {data[:200]!r}"
                data += chunk
            head, _, rest = data.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            headers = dict(line.split(b":", 1) for line in lines[1:])
            headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
            length = int(headers.get(b"content-length", b"0"))
            while len(rest) < length:
                chunk = sock.recv(65_536)
                if not chunk:
                    break
                rest += chunk
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return (int(lines[0].split()[1]), headers.get(b"content-type", b"").decode("latin-1"),
            rest[:length])


def send(http: httpx.Client, base: str, case: Case) -> tuple[int, str, bytes] | str:
    """(status, content type, body), or a description of a transport failure."""
    if case.raw is not None:
        return _send_raw(base, case.raw)
    content = _pieces(case.body) if case.chunked else case.body
    try:
        r = http.request(case.method, base + case.path, content=content,
                         headers=dict(case.headers))
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    return r.status_code, r.headers.get("content-type", ""), r.content


def error_problem(answer: tuple[int, str, bytes] | str, expect: int | None) -> str | None:
    """What is wrong with the answer to a malformed request (None: a proper OpenAI 4xx)."""
    if isinstance(answer, str):
        return f"no answer ({answer})"
    status, ctype, content = answer
    shown = f"{status} {ctype!r} {content[:300]!r}"
    if not 400 <= status < 500:
        return f"status {status}, not 4xx: {shown}"
    if expect is not None and status != expect:
        return f"status {status}, expected {expect}: {shown}"
    if not ctype.startswith("application/json"):
        return f"not a JSON answer: {shown}"
    try:
        error = json.loads(content)["error"]
        ok = (isinstance(error["message"], str) and error["message"]
              and isinstance(error["type"], str) and error["type"]
              and (error["param"] is None or isinstance(error["param"], str))
              and type(error["code"]) is int and error["code"] == status)
    except (ValueError, KeyError, TypeError):
        ok = False
    return None if ok else f"not an OpenAI error object: {shown}"


@dataclass
class Streamed:
    status: int
    events: list[str]  # the payloads of the `data:` lines, in order
    times: list[float]  # when each of them arrived (time.monotonic())
    start: float
    end: float


@dataclass
class StreamRunner:
    """Runs the long streaming request back to back until told to stop, so that one is in
    flight during all of the fuzzing however fast the machine is. Each stream is kept, with
    the arrival time of each of its events."""

    base: str
    streams: list[Streamed] = field(default_factory=list)
    error: BaseException | None = None
    first_chunk: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    last_arrival: float = 0.0  # when the latest event of any stream arrived
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def run(self) -> None:
        try:
            with httpx.Client(timeout=120, headers=dict(AUTH)) as http:
                while True:
                    start = time.monotonic()
                    events, times = [], []
                    with http.stream("POST", self.base + COMPLETIONS, json=STREAM_BODY) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                events.append(line[len("data: "):])
                                times.append(time.monotonic())
                                with self.arrived:
                                    self.last_arrival = times[-1]
                                    self.arrived.notify_all()
                                self.first_chunk.set()
                    self.streams.append(Streamed(r.status_code, events, times, start,
                                                 time.monotonic()))
                    if self.stop.is_set():
                        return
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            self.error = e
            self.first_chunk.set()
            with self.arrived:
                self.arrived.notify_all()

    def wait_for_event_after(self, moment: float, timeout: float) -> bool:
        """Whether a stream event arrives after `moment` (False if the runner failed first)."""
        with self.arrived:
            self.arrived.wait_for(lambda: self.last_arrival > moment or self.error is not None,
                                  timeout)
            return self.last_arrival > moment


def stream_problems(streamed: Streamed, want_text: str) -> list[str]:
    if streamed.status != 200:
        return [f"stream answered {streamed.status}: {streamed.events[:3]}"]
    events = streamed.events
    if not events or events[-1] != "[DONE]":
        return [f"stream did not end with [DONE]: {events[-3:]}"]
    chunks = [json.loads(e) for e in events[:-1]]
    problems = [f"error event in the stream: {c}" for c in chunks if "error" in c]
    chunks = [c for c in chunks if "error" not in c]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    if not chunks or reasons[-1] != "length" or any(r is not None for r in reasons[:-1]):
        problems.append(f"finish reasons {[r for r in reasons if r is not None]}, wanted one "
                        "'length' on the last chunk")
    if len({c["id"] for c in chunks}) != 1:
        problems.append("chunks of the stream carry different ids")
    text = "".join(c["choices"][0]["text"] for c in chunks)
    if text != want_text:
        problems.append(f"streamed text differs from the non-streaming text: {text[:80]!r} vs "
                        f"{want_text[:80]!r}")
    return problems


def integrity(base: str) -> dict:
    return server_integrity(base, KEY)


def wait_idle(base: str, timeout: float = 30) -> dict:
    return server_wait_idle(base, KEY, timeout)


def assert_normal_requests_work(base: str) -> None:
    with httpx.Client(timeout=60, headers=dict(JSON_AUTH)) as http:
        r = http.post(base + COMPLETIONS, json={"model": MODEL, "prompt": DOCS_PROMPT,
                                                "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        r = http.post(base + CHAT, json={"model": MODEL, "max_tokens": 4, "documents": _DOCUMENTS,
                                         "messages": [{"role": "user", "content": "Denser?"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"


# --- tests -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    # uvicorn's log level "critical" (the last --log-level wins): the server's output goes to
    # a pipe nobody reads while it runs, and a traceback per failing request could fill it
    # and stall the server; a failure shows up in the answers instead.
    with running_server(MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes",
                        str(MAX_BODY), "--log-level", "critical", "--chunk-separator", "##",
                        env={"RAGKV_API_KEY": KEY}) as base:
        yield base


def test_generated_cases_are_deterministic_and_cover_every_category():
    cases = generate_cases()
    assert cases == generate_cases()  # seeded: a failure reproduces
    assert len(cases) >= 300
    by_category: dict[str, list[Case]] = {}
    for case in cases:
        by_category.setdefault(case.category, []).append(case)
    assert set(by_category) == {"wrong-type", "bounds", "unicode", "deep", "oversize",
                                "content-type", "not-json", "method", "path", "auth", "chat",
                                "mutation", "random-bytes"}
    wrong = {c.what.split("=")[0] for c in by_category["wrong-type"]}
    assert set(COMPLETION_FIELDS) | set(CHAT_FIELDS) <= wrong  # every field, both endpoints
    assert {c.expect for c in cases} >= {None, 401, 404, 405, 413, 415}
    assert any(c.chunked for c in cases) and any(c.raw for c in cases)
    # Every body goes through with a Content-Length, except the deliberately oversize ones.
    assert all(len(c.body) <= MAX_BODY for c in cases if c.category != "oversize")


def test_malformed_requests_get_openai_4xx_while_a_stream_runs(server):
    cases = generate_cases()
    runner = StreamRunner(server)
    thread = threading.Thread(target=runner.run, name="fuzz-stream", daemon=True)
    thread.start()
    assert runner.first_chunk.wait(60), "the long stream never started"
    assert runner.error is None, runner.error
    fuzz_start = time.monotonic()

    failures: list[tuple[Case, str]] = []
    health: list[str] = []
    local = threading.local()
    clients: list[httpx.Client] = []

    def send_one(case: Case) -> tuple[int, str, bytes] | str:
        if not hasattr(local, "http"):  # one client per worker thread
            # A fresh connection per request, so that a failure is pinned on the request
            # that caused it, never on the next one sent over the same connection.
            local.http = httpx.Client(timeout=httpx.Timeout(30, connect=10),
                                      limits=httpx.Limits(max_keepalive_connections=0))
            clients.append(local.http)
        return send(local.http, server, case)

    with httpx.Client(timeout=30) as http, ThreadPoolExecutor(WORKERS) as pool:
        for start in range(0, len(cases), BATCH):
            batch = cases[start:start + BATCH]
            answers = list(pool.map(send_one, batch))
            for case, answer in zip(batch, answers, strict=True):
                problem = error_problem(answer, case.expect)
                if problem is not None:
                    failures.append((case, problem))
            # The server keeps serving, and its caches stay consistent, batch after batch.
            if (status := http.get(f"{server}/health").status_code) != 200:
                health.append(f"/health answered {status} after {start + len(batch)} cases")
            report = http.get(f"{server}/debug/integrity", headers=dict(AUTH))
            if report.status_code != 200 or not report.json().get("ok"):
                health.append(f"/debug/integrity after {start + len(batch)} cases: "
                              f"{report.status_code} {report.text[:300]}")
    for client in clients:
        client.close()
    fuzz_end = time.monotonic()
    # The runner stops only once a stream event has arrived after the fuzzing, so that the
    # streams are seen running on past it (not just a last one that ended afterwards).
    went_on = runner.wait_for_event_after(fuzz_end, 60)
    runner.stop.set()
    thread.join(timeout=120)

    problems = [f"{case.describe()}\n    -> {problem}"
                for case, problem in sorted(failures, key=lambda f: f[0].category)]
    problems += health
    assert not thread.is_alive(), "the stream did not finish"
    assert runner.error is None, f"the stream failed: {runner.error!r}"
    # Streams were in flight during all of the fuzzing: the first one was mid-stream when the
    # first malformed request went out (events before and after), events kept arriving while
    # the malformed requests were answered, and after the last one.
    first = runner.streams[0].times
    assert first[0] <= fuzz_start < first[-1], "the first stream was not mid-stream at the start"
    assert any(fuzz_start < t < fuzz_end for streamed in runner.streams
               for t in streamed.times), "no stream event arrived during the fuzzing"
    assert went_on, "no stream event arrived after the fuzzing"

    with httpx.Client(timeout=120, headers=dict(AUTH)) as http:
        r = http.post(server + COMPLETIONS, json={**STREAM_BODY, "stream": False})
    assert r.status_code == 200, r.text
    reference = r.json()
    assert reference["choices"][0]["finish_reason"] == "length"
    assert reference["usage"]["completion_tokens"] == STREAM_BODY["max_tokens"]
    for i, streamed in enumerate(runner.streams):
        problems += [f"stream {i}: {p}" for p in stream_problems(
            streamed, reference["choices"][0]["text"])]

    report = wait_idle(server)
    assert report["num_running"] == 0 and report["num_waiting"] == 0, report
    assert report["kv_available_tokens"] == report["kv_capacity_tokens"], report
    assert_normal_requests_work(server)
    assert not problems, (f"{len(failures)} of {len(cases)} malformed requests were not "
                          "answered with an OpenAI 4xx, or the server suffered:\n"
                          + "\n".join(problems))


def test_requests_that_may_be_valid_are_answered_200_or_4xx(server):
    """Inputs whose validity is debatable (a BOM, UTF-16, NUL characters, nulls the OpenAI API
    allows, duplicate keys, odd but in-range values): any proper answer is fine, a 5xx or a
    dropped connection is not."""
    rng = random.Random(SEED + 1)
    valid = {"model": MODEL, "prompt": "Tell me about bread.", "max_tokens": 2}
    chat = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": "Tell me about bread."}]}
    text = json.dumps(valid)
    cases = [
        Case("lenient", "UTF-8 BOM", b"\xef\xbb\xbf" + text.encode()),
        Case("lenient", "UTF-16-LE with BOM", b"\xff\xfe" + text.encode("utf-16-le")),
        Case("lenient", "UTF-16-BE with BOM", b"\xfe\xff" + text.encode("utf-16-be")),
        Case("lenient", "UTF-32-LE", text.encode("utf-32-le")),
        Case("lenient", "duplicate model key",
             b'{"model": "gpt-4", "model": "builtin:tiny", "prompt": "hi", "max_tokens": 1}'),
        Case("lenient", "query string", text.encode(), COMPLETIONS + "?x=1&y=%ff"),
        Case("lenient", "2000 unknown fields", json.dumps(
            {**valid, **{f"f{i}": i for i in range(2000)}}).encode()),
        Case("lenient", "256 prompts", json.dumps({**valid, "prompt": ["x"] * 256,
                                                   "max_tokens": 1}).encode()),
    ]
    for ctype in ("application/json; charset=utf-8", "Application/JSON",
                  "application/json ; q=1"):
        cases.append(Case("lenient", f"Content-Type {ctype!r}", text.encode(),
                          headers=(*AUTH, ("Content-Type", ctype))))
    for extra in ({"prompt": "a\x00b"}, {"stop": ["\x00"]}, {"cache_salt": "\x00"},
                  {"\x00": 1}, {"n": None}, {"stream": None}, {"echo": None},
                  {"stop_token_ids": [10**20]}, {"stop_token_ids": [VOCAB]}, {"top_k": 10**30},
                  {"seed": -1}, {"seed": 2**63}, {"temperature": 1e30}, {"top_p": 1e-300},
                  {"min_p": 1}, {"prompt": _garbage(rng, 200)}):
        cases.append(Case("lenient", f"{extra!r}"[:60], json.dumps({**valid, **extra}).encode()))
    for extra in ({"logprobs": None}, {"max_tokens": None, "max_completion_tokens": 2},
                  {"documents": ["\x00"]}, {"documents": []},
                  {"messages": [{"role": "user", "content": "a\x00b", "name": "\x00"}]},
                  {"messages": [{"role": "developer", "content": None},
                                {"role": "user", "content": _garbage(rng, 200)}]}):
        cases.append(Case("lenient", f"chat {extra!r}"[:60],
                          json.dumps({**chat, **extra}).encode(), CHAT))

    problems = []
    with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        for case in cases:
            answer = send(http, server, case)
            if not isinstance(answer, str) and answer[0] == 200:
                if "choices" not in json.loads(answer[2]):
                    problems.append(f"{case.describe()}\n    -> 200 without choices")
            elif (problem := error_problem(answer, None)) is not None:
                problems.append(f"{case.describe()}\n    -> {problem}")
    report = wait_idle(server)
    assert report["num_running"] == 0 and report["num_waiting"] == 0, report
    assert report["kv_available_tokens"] == report["kv_capacity_tokens"], report
    assert_normal_requests_work(server)
    assert not problems, "\n".join(problems)

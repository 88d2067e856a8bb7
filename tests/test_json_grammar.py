"""The byte automata of json_grammar.py on their own (CPU only, no model): JSON mode against
Python's json.loads as the independent reference (hand-written edge cases and a seeded fuzzer
of dumped documents and their byte mutations), the prefix property a token mask relies on,
schema mode on random valid instances and hand-made invalid ones, the errors for schemas it
cannot enforce, choices, and the whitespace bound. The token layer: test_structured_output.py.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import random
import re
import uuid

import pytest

from ragkv.structured.json_grammar import (
    MAX_WHITESPACE_RUN,
    ByteGrammar,
    choice_grammar,
    json_object_grammar,
)
from ragkv.structured.json_schema import json_schema_grammar

JSON_WS = " \t\n\r"  # JSON's whitespace (str.isspace knows more)


@pytest.fixture(scope="module")
def jm() -> ByteGrammar:
    return json_object_grammar()


# -- references ----------------------------------------------------------------------------

def whitespace_runs(text: str) -> list[tuple[int, str]]:
    """(start, run) of each run of JSON whitespace between the tokens of `text` (valid JSON):
    the grammar bounds those runs, never the bytes inside strings."""
    runs: list[tuple[int, str]] = []
    start = None
    in_string = escaped = False
    for i, ch in enumerate(text + "."):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch in JSON_WS:
            start = i if start is None else start
            continue
        if start is not None:
            runs.append((start, text[start:i]))
            start = None
        in_string = ch == '"'
    return runs


def whitespace_ok(text: str) -> bool:
    """The grammar's whitespace rules, on valid JSON `text`: each run between tokens at most
    MAX_WHITESPACE_RUN bytes with one newline at most and no carriage return; before the
    top-level value one space or tab at most; after it nothing."""
    for start, run in whitespace_runs(text):
        if start == 0 and run not in (" ", "\t"):
            return False
        if start + len(run) == len(text):
            return False
        if len(run) > MAX_WHITESPACE_RUN or run.count("\n") > 1 or "\r" in run:
            return False
    return True


def loose_utf8(data: bytes) -> bool:
    """UTF-8 by lead and continuation bytes only (what the automaton checks), without the
    overlong, surrogate and above-U+10FFFF rules of a strict decoder."""
    need = 0
    for b in data:
        if need:
            if not 0x80 <= b <= 0xBF:
                return False
            need -= 1
        elif b >= 0x80:
            if 0xC2 <= b <= 0xDF:
                need = 1
            elif 0xE0 <= b <= 0xEF:
                need = 2
            elif 0xF0 <= b <= 0xF4:
                need = 3
            else:
                return False
    return need == 0


def json_mode_reference(data: bytes) -> bool | None:
    """Whether JSON mode must accept `data`, by json.loads; None where the reference and the
    grammar mean different things (Python's NaN/Infinity, and invalid UTF-8 that only a strict
    decoder sees: test_invalid_utf8_strict_rules covers that separately)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None if loose_utf8(data) else False
    if "NaN" in text or "Infinity" in text:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return False
    if not isinstance(value, (dict, list)):
        return False  # no top-level scalars
    return whitespace_ok(text)


def walk(g: ByteGrammar, data: bytes) -> list:
    """The states after each byte of `data` (None from the first rejected byte on)."""
    states, state = [], g.initial
    for b in data:
        state = None if state is None else g.step(state, b)
        states.append(state)
    return states


def assert_prefixes_alive(g: ByteGrammar, data: bytes, terminal: bool) -> None:
    """Every proper prefix of an accepted output leaves the automaton alive; the output itself
    is accepting, and terminal where nothing may follow it."""
    states = walk(g, data)
    for i, state in enumerate(states):
        assert state is not None, (data, i, data[: i + 1])
    assert g.accepting(states[-1]), data
    assert g.terminal(states[-1]) == terminal, data


# -- JSON mode: hand-written edge cases ----------------------------------------------------

JSON_CASES = [
    # containers
    ("{}", True), ("[]", True), ("[[]]", True), ('{"a":{}}', True), ('[{},[],{"":[]}]', True),
    ('{"a":1,"a":2}', True),  # duplicate keys are JSON (the last one wins in Python)
    ("[1,2,3]", True), ("[1,]", False), ("[,1]", False), ("[1 2]", False), ("{,}", False),
    ('{"a":1,}', False), ('{"a"}', False), ('{"a":}', False), ('{"a" 1}', False),
    ('{1:2}', False), ("{'a':1}", False), ('{"a":1', False), ("[", False), ("]", False),
    ("[]]", False), ("{}}", False), ("[}", False), ("{]", False), ("", False),
    ("{}{}", False), ("{} []", False), ("[][]", False),
    # top-level scalars
    ("1", False), ('"a"', False), ("null", False), ("true", False), ("false", False),
    # literals
    ("[true,false,null]", True), ("[tru]", False), ("[True]", False), ("[nul]", False),
    ("[null1]", False), ("[nulll]", False), ("[falsey]", False),
    # numbers
    ("[0]", True), ("[-0]", True), ("[-0.0]", True), ("[1e5]", True), ("[1E5]", True),
    ("[1.5E-3]", True), ("[1e+5]", True), ("[-12.25e-07]", True), ("[10]", True),
    ("[123456789012345678901234567890]", True), ("[1e400]", True),
    ("[01]", False), ("[00]", False), ("[-01]", False), ("[1.]", False), ("[.5]", False),
    ("[-]", False), ("[- 1]", False), ("[+1]", False), ("[1e]", False), ("[1e+]", False),
    ("[1.e5]", False), ("[1.5.2]", False), ("[1e5e5]", False), ("[0x10]", False),
    ("[1-2]", False), ("[--1]", False), ("[1 ,2]", True), ("[1\n]", True),
    # strings and escapes
    ('[""]', True), ('["a b"]', True), ('["\\"\\\\\\/\\b\\f\\n\\r\\t"]', True),
    ('["\\u00e9\\uD83D\\ude00"]', True), ('["\\ud800"]', True),  # lone surrogates: JSON
    ('["\\u00g0"]', False), ('["\\u00e"]', False), ('["\\x41"]', False), ('["\\a"]', False),
    ('["\\"]', False), ('["\\\'"]', False), ('["a]', False), ('["a"', False),
    ("[\"a\tb\"]", False), ("[\"a\nb\"]", False), ("[\"\x00\"]", False), ("[\"\x1f\"]", False),
    ("[\"\x7f\"]", True),  # DEL needs no escape
    ('["é€😀\u2028"]', True), ('{"ключ":"значение"}', True), ('{"😀":["日本"]}', True),
    ('["' + " " * 40 + '"]', True),  # spaces inside a string are not whitespace runs
    # whitespace: one space or tab before the value, nothing after it, one newline and no
    # carriage return in a run (all JSON, but not what a well-behaved model writes)
    (' {"a" : [ 1 , 2 ] }', True), (' {"a" : [ 1 , 2 ] } ', False), ("\t[]", True),
    ("  []", False), ("\n[]", False), ("\r[]", False), ("[]\n", False), ("[] ", False),
    ("[\n]", True), ('{\n  "a": [\n    1,\n    2\n  ]\n}', True), ("[1,\n\t 2]", True),
    ("[1,\n\n2]", False), ("[1,\n \n2]", False), ("[1,\r\n2]", False), ("[\r]", False),
    ("[\u00a0]", False), ("[\x0b]", False), ("[\x0c]", False),
    ("\ufeff[]", False),  # a BOM is not whitespace
    # nesting
    ("[" * 30 + "]" * 30, True), ("[" * 30 + "]" * 29, False), ('{"a":[{"b":[{"c":{}}]}]}', True),
]


@pytest.mark.parametrize("text, expected", JSON_CASES)
def test_json_mode_edge_cases(jm, text, expected):
    """Each case by hand, and the fuzzer's reference agrees with the hand-written answer."""
    data = text.encode()
    assert jm.matches(data) == expected
    assert json_mode_reference(data) in (expected, None)
    if expected:
        assert_prefixes_alive(jm, data, terminal=True)


# -- JSON mode: a seeded fuzzer ------------------------------------------------------------

_CHARS = list("abcXYZ019 _-\"\\/'{}[],:") + ["\n", "\t", "\r", "\x00", "\x01", "\x1f", "\x7f",
                                            "é", "ß", "€", "中", "😀", "\u2028", "\ufeff"]
_FLOATS = [0.0, -0.0, 0.5, -1.5, 1e-05, 1.5e-300, 1e300, 2.5e+20, 123.456, -7e22]


def random_string(rng: random.Random) -> str:
    return "".join(rng.choice(_CHARS) for _ in range(rng.randint(0, 6)))


def random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth >= 4 or r < 0.4:
        kind = rng.randrange(6)
        if kind == 0:
            return rng.choice([None, True, False])
        if kind == 1:
            return rng.choice([0, 1, -1, 10, rng.randint(-10**20, 10**20)])
        if kind == 2:
            return rng.choice(_FLOATS + [rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30)])
        return random_string(rng)
    if r < 0.7:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {random_string(rng): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def random_document(rng: random.Random) -> str:
    """A random JSON text: usually an object or an array, dumped with random indentation and
    separators (deep indentation breaks the whitespace bound on purpose), sometimes with
    whitespace before or after it."""
    value = random_value(rng) if rng.random() < 0.1 else (
        [random_value(rng, 1) for _ in range(rng.randint(0, 4))] if rng.random() < 0.5 else
        {random_string(rng): random_value(rng, 1) for _ in range(rng.randint(0, 4))})
    indent = rng.choice([None, None, 0, 1, 2, 4, "\t", " " * 7])
    separators = rng.choice([(",", ":"), (", ", ": "), (",", ": "), (" ,\n", "\t:\r")])
    text = json.dumps(value, indent=indent, separators=separators,
                      ensure_ascii=rng.random() < 0.5)
    if rng.random() < 0.15:
        text = "".join(rng.choice(JSON_WS) for _ in range(rng.randint(1, 2))) + text
    if rng.random() < 0.05:
        text += rng.choice(JSON_WS)
    return text


_MUTATION_BYTES = (b'{}[],:"\\ \n\t\r-+.eE0123456789tfnulr/abx\x00\x01\x1f\x7f'
                   b"\x80\xbf\xc0\xc1\xc3\xa9\xe2\x82\xac\xf0\x9f\xf5\xff")
_ANCHORS = b'\\"0123456789.eE-+{[:,'


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One random edit: replace, insert or delete a byte, truncate, duplicate a slice, or
    insert a byte right after a digit, quote, backslash or bracket (where grammars differ)."""
    if not data:
        return bytes([rng.choice(_MUTATION_BYTES)])
    i = rng.randrange(len(data))
    new = rng.choice(_MUTATION_BYTES) if rng.random() < 0.85 else rng.randrange(256)
    kind = rng.randrange(7)
    if kind >= 5:
        spots = [k + 1 for k, b in enumerate(data) if b in _ANCHORS]
        if spots:
            i = rng.choice(spots)
            return data[:i] + bytes([new]) + data[i:]
    if kind == 0:
        return data[:i] + bytes([new]) + data[i + 1:]
    if kind == 1:
        return data[:i] + bytes([new]) + data[i:]
    if kind == 2:
        return data[:i] + data[i + 1:]
    if kind == 3:
        return data[:i]
    j = rng.randrange(i, len(data) + 1)
    return data[:j] + data[i:j] + data[j:]


def test_json_mode_fuzz_against_json_loads(jm):
    """matches() == "json.loads succeeds, gives a dict or list, whitespace within the bound,
    nothing after it" on random documents and on their random byte-level edits; every
    accepted document also passes the prefix property."""
    rng = random.Random(20240611)
    counts = {True: 0, False: 0, None: 0}
    mismatches = []
    for _ in range(500):
        data = random_document(rng).encode()
        variants = [data]
        for _ in range(5):
            variants.append(mutate(rng, variants[-1] if rng.random() < 0.3 else data))
        for v in variants:
            expected = json_mode_reference(v)
            counts[expected] += 1
            if expected is None:
                continue
            if jm.matches(v) != expected:
                mismatches.append((v, expected))
            elif expected:
                assert_prefixes_alive(jm, v, terminal=True)
    assert not mismatches, mismatches[:5]
    # The fuzzer must exercise both answers a fair number of times to mean anything.
    assert counts[True] > 300 and counts[False] > 800, counts


# -- invalid UTF-8 inside strings ----------------------------------------------------------

@pytest.mark.parametrize("raw", [
    b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xc3", b"\xc3\x41", b"\xe2\x82",
    b"\xe2\x82\x41", b"\xf0\x9f\x98", b"\xf5\x80\x80\x80", b"\xff", b"\xfe",
])
def test_invalid_utf8_in_strings(jm, raw):
    """Bad lead bytes, lone continuation bytes and cut-short sequences end the string."""
    assert not jm.matches(b'["' + raw + b'"]')
    assert not jm.matches(b'["' + raw + b'x"]')


@pytest.mark.parametrize("raw", [
    b"\xe0\x80\x80",      # overlong U+0000
    b"\xe0\x9f\xbf",      # overlong U+07FF
    b"\xed\xa0\x80",      # UTF-16 surrogate U+D800
    b"\xf0\x80\x80\x80",  # overlong U+0000
    b"\xf4\x90\x80\x80",  # U+110000
])
def test_invalid_utf8_strict_rules(jm, raw):
    """A strict decoder (Python's, any client's) rejects these: so should the automaton."""
    with pytest.raises(UnicodeDecodeError):
        raw.decode("utf-8")
    assert not jm.matches(b'["' + raw + b'"]')


@pytest.mark.parametrize("text", ["€", "😀", "\U0010ffff", "\u07ff", "\ud7ff", "\ue000"])
def test_valid_utf8_edges_in_strings(jm, text):
    """The edges of each UTF-8 length stay accepted."""
    assert jm.matches(json.dumps([text], ensure_ascii=False).encode())


def test_string_frame(jm):
    """string_frame (what the token layer keys its string-token cache on) inside a string."""
    expected = {b"[": None, b'["': 0, b'["a': 0, b'["\\': 1, b'["\\u': 14, b'["\\u0': 13,
                b'["\\u00e9': 0, b'["\xc3': 21, b'["\xe2': 22, b'["\xf1': 23, b'["\xf1\x9f': 22,
                b'["\xe0': 30, b'["\xed': 31, b'["\xf0': 32, b'["\xf4': 33, b'["\xf0\x9f': 22,
                b'["a"': None, b'{"': 0}
    for data, sub in expected.items():
        assert jm.string_frame(walk(jm, data)[-1]) == (None if sub is None else ("S", sub)), data


# -- whitespace bound ----------------------------------------------------------------------

WS_TEMPLATES = [
    "{W}", "[W[]]", "[W]", "[1,W2]", "[1W,2]", "[1W]", '{W"a":1}', '{"a"W:1}', '{"a":W1}',
    '{"a":1W}', '{"a":1,W"b":2}', "[trueW]", '["x"W]', "[[]W]", "[{}W,{}]", "[-1.5e3W]",
]


@pytest.mark.parametrize("template", WS_TEMPLATES)
@pytest.mark.parametrize("ws", [" ", "\t", " \t", "\n ", "\t\n"])
def test_whitespace_bound(jm, template, ws):
    """Up to MAX_WHITESPACE_RUN (16) whitespace bytes between tokens, not 17."""
    assert MAX_WHITESPACE_RUN == 16
    run = (ws + ws.replace("\n", "") * 16)[:MAX_WHITESPACE_RUN]
    assert jm.matches(template.replace("W", run).encode())
    assert not jm.matches(template.replace("W", run + " ").encode())
    assert jm.matches(template.replace("W", "").encode())


@pytest.mark.parametrize("template", WS_TEMPLATES)
def test_newlines_and_carriage_returns(jm, template):
    """One newline per run (pretty-printing needs no more), no carriage return."""
    for run, ok in (("\n", True), ("  \n  ", True), ("\n\n", False), ("\n  \n", False),
                    ("\r", False), ("\r\n", False), (" \r", False)):
        assert jm.matches(template.replace("W", run).encode()) == ok, (template, run)


def test_whitespace_runs_reset_at_each_token(jm):
    """The bound is per run: 16 + token + 16 is fine."""
    w = " " * 15 + "\n"
    assert jm.matches(f' {{{w}"a"{w}:{w}[{w}1{w},{w}2{w}]{w}}}'.encode())
    assert jm.matches(('["' + " " * 40 + "\\n" * 3 + '"]').encode())  # not runs: a string


def test_whitespace_bound_in_schema_mode():
    g = json_schema_grammar({"type": "object",
                             "properties": {"a": {"enum": ["x", 1]}, "b": {"type": "number"}},
                             "required": ["a"]})
    for template in ('{W"a":"x"}', '{"a"W:1}', '{"a":W1}', '{"a":1W}', '{"a":1,W"b":2}',
                     '{"a":1,"b":2W}', '{"a":"x"W,"b":0.5}'):
        assert g.matches(template.replace("W", " " * 16).encode()), template
        assert g.matches(template.replace("W", "\n" + " " * 15).encode()), template
        assert not g.matches(template.replace("W", " " * 17).encode()), template
        assert not g.matches(template.replace("W", "\n\n").encode()), template
    assert g.matches(b' {"a":1}') and g.matches(b'\t{"a":1}')
    assert not g.matches(b'  {"a":1}') and not g.matches(b'\n{"a":1}')
    assert not g.matches(b'{"a":1} ')  # nothing after the value
    n = json_schema_grammar({"type": "integer"})
    assert n.matches(b" 1") and not n.matches(b"1 ") and not n.matches(b"  1")


# -- schema mode ---------------------------------------------------------------------------

# As pydantic writes it for a model with a nested model, an enum, Optional fields (anyOf with
# null), lists with bounds and a dict[str, int].
PERSON = {
    "$defs": {
        "Address": {
            "title": "Address", "type": "object",
            "properties": {"street": {"title": "Street", "type": "string"},
                           "zip": {"anyOf": [{"type": "string"}, {"type": "null"}],
                                   "default": None, "title": "Zip"}},
            "required": ["street"],
        },
        "Role": {"enum": ["admin", "user", "guest"], "title": "Role", "type": "string"},
    },
    "title": "Person", "type": "object",
    "properties": {
        "name": {"title": "Name", "type": "string"},
        "age": {"title": "Age", "type": "integer"},
        "height": {"title": "Height", "type": "number"},
        "active": {"title": "Active", "type": "boolean"},
        "role": {"$ref": "#/$defs/Role"},
        "address": {"$ref": "#/$defs/Address", "description": "Where they live"},
        "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "scores": {"type": "object", "additionalProperties": {"type": "integer"}},
        "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "number"},
                                              "maxItems": 2}},
    },
    "required": ["name", "age", "height", "active", "role", "address", "tags", "scores"],
}

TREE = {
    "$defs": {"Node": {"type": "object",
                       "properties": {"value": {"type": "integer"},
                                      "children": {"type": "array",
                                                   "items": {"$ref": "#/$defs/Node"}}},
                       "required": ["value"]}},
    "$ref": "#/$defs/Node",
}

MIXED = {
    "type": "array", "minItems": 2, "maxItems": 4,
    "items": {"anyOf": [
        {"type": ["integer", "string", "null"]},
        {"const": {"k": [1, "é", None]}},
        {"type": "object", "properties": {"ab": {"type": "boolean"},
                                          "a": {"enum": [1, 12, 1.5, "a\"b", True]}},
         "required": ["a"]},
        {"allOf": [{"type": "array", "items": {"type": "integer"}, "maxItems": 0}]},
    ]},
}

# As pydantic writes Field(ge=0, le=1), Field(gt=0, le=100), constr lengths, date / datetime
# / time / UUID fields and tuple[int, str].
SCALARS = {
    "title": "Answer", "type": "object",
    "properties": {
        "confidence": {"maximum": 1, "minimum": 0, "title": "Confidence", "type": "number"},
        "page": {"exclusiveMinimum": 0, "maximum": 100, "type": "integer"},
        "delta": {"anyOf": [{"exclusiveMaximum": 0, "minimum": -2.5, "type": "number"},
                            {"type": "null"}], "default": None},
        "quote": {"maxLength": 12, "minLength": 1, "type": "string"},
        "code": {"minLength": 2, "type": "string"},
        "day": {"format": "date", "type": "string"},
        "at": {"format": "date-time", "type": "string"},
        "alarm": {"format": "time", "type": "string"},
        "id": {"format": "uuid", "type": "string"},
        "pair": {"maxItems": 2, "minItems": 2, "type": "array",
                 "prefixItems": [{"type": "integer"}, {"maxLength": 3, "type": "string"}]},
    },
    "required": ["confidence", "page", "quote", "day", "pair"],
}

SCHEMAS = {"person": PERSON, "tree": TREE, "mixed": MIXED, "scalars": SCALARS}


def resolve(root: dict, schema: dict) -> dict:
    while "$ref" in schema:
        node = root
        for part in schema["$ref"][2:].split("/"):
            node = node[part]
        schema = node
    return schema


def random_instance(rng: random.Random, root: dict, schema, depth: int = 0):
    """A random value valid under `schema` (the subset the tests use); object keys in random
    order."""
    schema = resolve(root, schema)
    if schema is True or schema == {}:
        return random_value(rng, 3)
    if "anyOf" in schema:
        return random_instance(rng, root, rng.choice(schema["anyOf"]), depth)
    if "allOf" in schema:
        return random_instance(rng, root, schema["allOf"][0], depth)
    if "const" in schema:
        return copy.deepcopy(schema["const"])
    if "enum" in schema:
        return copy.deepcopy(rng.choice(schema["enum"]))
    kind = schema["type"]
    if isinstance(kind, list):
        kind = rng.choice(kind)
    if kind == "string" and "format" in schema:
        return random_formatted(rng, schema["format"])
    if kind == "string" and ("minLength" in schema or "maxLength" in schema):
        low = schema.get("minLength", 0)
        return "".join(rng.choice(_CHARS) for _ in range(
            rng.randint(low, schema.get("maxLength", low + 4))))
    if kind == "string":
        return random_string(rng)
    if kind in ("integer", "number") and set(schema) & {"minimum", "exclusiveMinimum",
                                                         "maximum", "exclusiveMaximum"}:
        return random_bounded(rng, schema)
    if kind == "integer":
        return rng.choice([0, -1, 7, rng.randint(-10**12, 10**12)])
    if kind == "number":
        return rng.choice([0, 3, -2.5, 1e-07, rng.uniform(-1e6, 1e6)])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        high = (low + 3 if high is None else high) if depth < 3 else low
        prefix = schema.get("prefixItems", [])
        return [random_instance(rng, root, prefix[i] if i < len(prefix)
                                else schema.get("items", {}), depth + 1)
                for i in range(rng.randint(low, high))]
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", False)
    names = [n for n in props if n in schema.get("required", []) or rng.random() < 0.5]
    out = {n: random_instance(rng, root, props[n], depth + 1) for n in names}
    if extra is not False and depth < 3:
        for _ in range(rng.randint(0, 3)):
            out[random_string(rng)] = random_instance(rng, root, extra, depth + 1)
    items = list(out.items())
    rng.shuffle(items)
    return dict(items)


def random_formatted(rng: random.Random, fmt: str) -> str:
    day = datetime.date(1, 1, 1) + datetime.timedelta(days=rng.randrange(3_652_059))
    clock = (f"{rng.randrange(24):02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}"
             + rng.choice(["", f".{rng.randrange(10 ** 6):06d}"[:rng.randint(2, 7)]])
             + rng.choice(["Z", f"{rng.choice('+-')}{rng.randrange(24):02d}:"
                                f"{rng.randrange(60):02d}"]))
    return {"date": day.isoformat(), "time": clock, "date-time": f"{day.isoformat()}T{clock}",
            "uuid": str(uuid.UUID(int=rng.getrandbits(128)))}[fmt]


def random_bounded(rng: random.Random, schema: dict):
    """A number within the schema's bounds, written with at most 4 decimals."""
    low = schema.get("minimum", schema.get("exclusiveMinimum", -1000))
    high = schema.get("maximum", schema.get("exclusiveMaximum", 1000))
    while True:
        value = (rng.randint(math.ceil(low), math.floor(high)) if schema["type"] == "integer"
                 else rng.choice([low, high, round(rng.uniform(low, high), rng.randint(0, 4))]))
        if (value > schema.get("exclusiveMinimum", -math.inf)
                and value < schema.get("exclusiveMaximum", math.inf)):
            return value


@pytest.fixture(scope="module")
def grammars() -> dict[str, ByteGrammar]:
    return {name: json_schema_grammar(schema) for name, schema in SCHEMAS.items()}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_valid_instances_match(grammars, name):
    """Random valid instances, compact, with default separators and indented (accepted
    exactly when the indentation fits the whitespace bound); every prefix stays alive."""
    g, schema = grammars[name], SCHEMAS[name]
    rng = random.Random(name)
    indented_fit = indented_too_deep = 0
    for _ in range(60):
        value = random_instance(rng, schema, schema)
        compact = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        assert g.matches(compact.encode()), compact
        assert_prefixes_alive(g, compact.encode(), terminal=True)
        # const/enum values must be compact: only the "mixed" schema's const object
        canonical_only = '{"k":' in compact
        spaced = json.dumps(value, ensure_ascii=False)
        assert g.matches(spaced.encode()) == (not canonical_only or spaced == compact), spaced
        indented = json.dumps(value, ensure_ascii=False, indent=2)
        fits = whitespace_ok(indented) and not canonical_only
        assert g.matches(indented.encode()) == fits, indented
        indented_fit += fits
        indented_too_deep += not fits
    assert indented_fit > 10


def test_schema_given_as_json_text():
    g = json_schema_grammar(json.dumps(TREE))
    assert g.matches(b'{"value":1,"children":[{"value":2}]}')
    assert not g.matches(b'{"children":[]}')


PERSON_OK = {"name": "Ann", "age": 30, "height": 1.7, "active": True, "role": "admin",
             "address": {"street": "Main 1"}, "tags": ["a"], "scores": {}}


def person_text(patch: dict, drop: tuple = ()) -> bytes:
    value = {**PERSON_OK, **patch}
    for key in drop:
        del value[key]
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.mark.parametrize("patch", [
    {}, {"age": -0}, {"age": 10**30}, {"height": 2}, {"height": -1.5e-9}, {"role": "guest"},
    {"nickname": None}, {"nickname": "A"}, {"address": {"zip": None, "street": ""}},
    {"address": {"street": "x", "zip": "123"}}, {"tags": ["a", "b", "c"]},
    {"scores": {"math": 1, "art": -2, "": 0, "é": 3}}, {"matrix": []},
    {"matrix": [[], [1, 2.5]]}, {"name": "\"quoted\" \\ é 😀"},
])
def test_person_valid(grammars, patch):
    assert grammars["person"].matches(person_text(patch))


@pytest.mark.parametrize("patch, drop", [
    ({}, ("name",)), ({}, ("address",)), ({}, ("tags",)), ({}, ("scores",)),  # missing key
    ({"extra": 1}, ()), ({"Name": "x"}, ()),                 # keys not in properties
    ({"age": 1.5}, ()), ({"age": 1.0}, ()), ({"age": "1"}, ()), ({"age": True}, ()),
    ({"age": None}, ()), ({"height": "1.5"}, ()), ({"active": 1}, ()), ({"name": None}, ()),
    ({"name": 1}, ()), ({"role": "root"}, ()), ({"role": "Admin"}, ()), ({"role": None}, ()),
    ({"nickname": 1}, ()), ({"tags": []}, ()), ({"tags": ["a"] * 4}, ()), ({"tags": [1]}, ()),
    ({"tags": "a"}, ()), ({"scores": {"a": 1.5}}, ()), ({"scores": {"a": "1"}}, ()),
    ({"scores": []}, ()), ({"address": {}}, ()), ({"address": {"street": "x", "zip": 1}}, ()),
    ({"address": {"street": "x", "city": "y"}}, ()), ({"address": None}, ()),
    ({"matrix": [[1, 2, 3]]}, ()), ({"matrix": [1]}, ()), ({"matrix": [[True]]}, ()),
])
def test_person_invalid(grammars, patch, drop):
    """Missing required key, extra key, wrong type, enum value not in the list, too many or
    too few items, a float (even 1.0) where an integer is required."""
    assert not grammars["person"].matches(person_text(patch, drop))


@pytest.mark.parametrize("field, text, expected", [
    ("age", ":1e3", False), ("age", ":1E3", False), ("age", ":-0", True), ("age", ":01", False),
    ("age", ":1.", False), ("height", ":1e3", True), ("height", ":1.", False),
    ("height", ":-0.0E+1", True), ("role", ':"admin" ', True), ("role", ':"admi"', False),
    ("role", ':"adminx"', False), ("role", ' : "user"', True), ("role", ':"us\\u0065r"', False),
    ("nickname", ":nul", False), ("nickname", ":null", True), ("nickname", ':"\\u0041"', True),
])
def test_person_field_syntax(grammars, field, text, expected):
    """One field written by hand: numbers, enum strings (canonical only), whitespace."""
    rest = json.dumps({k: v for k, v in PERSON_OK.items() if k != field}, separators=(",", ":"))
    data = f'{rest[:-1]},"{field}"{text}}}'.encode()
    assert grammars["person"].matches(data) == expected, data


def test_duplicate_and_reordered_keys(grammars):
    """Properties in any order, each at most once."""
    g = grammars["person"]
    reordered = dict(reversed(list(PERSON_OK.items())))
    assert g.matches(json.dumps(reordered, separators=(",", ":")).encode())
    base = person_text({})
    assert not g.matches(b'{"name":"B",' + base[1:])
    assert not g.matches(base[:-1] + b',"age":3}')
    assert not g.matches(base[:-1] + b',"nickname":null,"nickname":null}')
    # dict[str, int] (additionalProperties): any keys, duplicates not tracked
    assert g.matches(person_text({"scores": {"a": 1}}).replace(b'"a":1', b'"a":1,"a":2'))
    assert not g.matches(base.replace(b'"tags":["a"]', b'"tags":["a"],'))  # dangling comma


@pytest.mark.parametrize("text, expected", [
    ('{"value":1}', True), ('{"value":1,"children":[]}', True),
    ('{"children":[],"value":-3}', True),
    ('{"value":1,"children":[{"value":2,"children":[{"value":3}]},{"value":4}]}', True),
    ('{"value":1,"children":[{"children":[]}]}', False),  # missing key deep down
    ('{"value":1,"children":[1]}', False), ('{"value":1.5}', False),
    ('{"value":1,"children":[{"value":2,"x":1}]}', False), ('{"value":1,"children":{}}', False),
    ('[]', False), ('null', False), ('{}', False),
])
def test_recursive_tree(grammars, text, expected):
    assert grammars["tree"].matches(text.encode()) == expected


def test_deep_recursion():
    """A tree 40 levels deep: the recursive $ref is expanded lazily, byte by byte."""
    g = json_schema_grammar(TREE)
    text = '{"value":0,"children":[' * 40 + '{"value":1}' + "]}" * 40
    assert g.matches(text.encode())
    assert not g.matches(text[:-1].encode())


@pytest.mark.parametrize("text, expected", [
    ("[1,2]", True), ('[null,"x",-5]', True), ('[{"k":[1,"é",null]},0]', True),
    ('[{"k":[1,"\\u00e9",null]},0]', False),  # const/enum: canonical form only
    ('[{"k": [1,"é",null]},0]', False),        # ... compact
    ('[{"a":1},{"a":12}]', True), ('[{"a":1.5},{"a":true}]', True), ('[{"a":"a\\"b"},0]', True),
    ('[{"a":1,"ab":false},{"ab":true,"a":12}]', True),  # a key that is a prefix of another
    ('[{"a":13},0]', False), ('[{"a":1.50},0]', False), ('[{"a":2},0]', False),
    ('[{"ab":true},0]', False), ('[{"a":1,"abc":true},0]', False), ('[{"a":1,"a":1},0]', False),
    ('[[],[]]', True), ('[[1],0]', False),  # allOf of an array with maxItems 0
    ("[1.5,2]", False), ("[1]", False), ("[1,2,3,4]", True), ("[1,2,3,4,5]", False),
    ("[true,1]", False), ("1", False),
])
def test_mixed_schema(grammars, text, expected):
    """Type lists, const, enums of mixed values, a key that is a prefix of another, allOf."""
    assert grammars["mixed"].matches(text.encode()) == expected


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer"}, ["0", "-7", "12345678901234567890"], ["1.0", "1e2", "-", "01", "1 "]),
    ({"type": "number"}, ["0", "-0.5", "1.5E-3", "2e+10"], [".5", "1.", "+1", "1e"]),
    ({"type": "boolean"}, ["true", "false"], ["True", "1", "null", "truee"]),
    ({"type": "null"}, ["null"], ["None", "nul", ""]),
    ({"type": "string"}, ['""', '"a\\n"', '"\\u0041"'], ['"a', "'a'", '"\n"']),
    ({"type": ["string", "null"]}, ['"x"', "null"], ["1", "[]"]),
    ({"type": ["integer", "number"]}, ["1", "1.5"], ['"1"']),
    ({"type": ["array", "null"], "items": {"type": "integer"}, "maxItems": 1},
     ["[]", "[1]", "null"], ["[1,2]", '["a"]']),
    ({"type": ["object", "null"], "properties": {"a": {"type": "integer"}}},
     ["{}", '{"a":1}', "null"], ['{"b":1}', "[]"]),
    ({"const": "x"}, ['"x"'], ['"y"', "x"]), ({"const": None}, ["null"], ['"null"']),
    ({"enum": [1, 12]}, ["1", "12"], ["123", "2", "1.0"]),
    ({"enum": ["é", 1.5, True, [1, {"a": None}]]}, ['"é"', "1.5", "true", '[1,{"a":null}]'],
     ['"\\u00e9"', "1.50", '[1, {"a":null}]']),
    # strict mode: no other keys than the properties; naming neither is any object
    ({"type": "object"}, ["{}", "{ }", '{"a":1,"b":[{}]}'], ["[]", "null"]),
    ({"type": "object", "properties": {}}, ["{}", "{ }"], ['{"a":1}']),
    ({"type": "object", "properties": {"a": {}}}, ["{}", '{"a":[1]}'], ['{"b":1}']),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False}, ['{"a":1}'],
     ['{"b":1}']),
    ({"type": "object", "additionalProperties": True}, ['{"a":[1,{"b":null}]}', "{}"], ["[]"]),
    ({"additionalProperties": {"type": "integer"}}, ['{"a":1,"b":2}'], ['{"a":"x"}']),
    ({"type": "array"}, ["[]", '[1,"a",{"b":[null]}]'], ["{}"]),
    ({"items": {"type": "boolean"}}, ["[true]"], ["[1]"]),
    ({}, ["1", '"s"', "null", "[]", '{"a":1}'], ["nul", "{"]),
    ({"title": "only annotations", "description": "d", "examples": [1]}, ["1", "[]"], ["x"]),
    ({"allOf": [{"type": "integer"}]}, ["1"], ["1.5"]),
    ({"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                 "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}},
                 "required": ["b"]}]},
     ['{"a":1}', '{"b":2}'], ['{"a":1,"b":2}', "{}"]),
    # left recursion through a $ref: no value from the loop, the other branch still works
    ({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}},
      "$ref": "#/$defs/A"}, ["null"], ["1"]),
    ({"definitions": {"a/b": {"type": "integer"}}, "$ref": "#/definitions/a~1b"}, ["3"],
     ['"3"']),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
     ["[1,2]"], ["[1]", "[1,2,3]", "[1,2,]"]),
    ({"type": "array", "minItems": 3}, ["[1,2,3]", "[1,2,3,4,5,6]"], ["[1,2]", "[]"]),
    ({"type": "array", "maxItems": 0}, ["[]", "[ ]"], ["[1]"]),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
      "minItems": 2, "maxItems": 2},  # pydantic's tuple[int, str]
     ['[1,"a"]', '[ -2 , "" ]'], ['[1]', '["a",1]', '[1,"a",2]', '[]', '[1,2]']),
    ({"type": "array", "prefixItems": [{"type": "boolean"}], "items": {"type": "null"}},
     ["[]", "[true]", "[false,null,null]"], ["[null]", "[true,true]", "[true,null,1]"]),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}],
      "items": False},
     ["[]", "[1]", "[1,2]"], ["[1,2,3]", '["a"]']),
    ({"type": "array", "prefixItems": [{"const": 1}], "minItems": 3},
     ["[1,2,3]", '[1,"x",null,4]'], ["[1,2]", "[2,2,3]"]),
])
def test_small_schemas(schema, good, bad):
    g = json_schema_grammar(schema)
    for text in good:
        assert g.matches(text.encode()), text
    for text in bad:
        assert not g.matches(text.encode()), text


def test_top_level_number_may_go_on():
    """A top-level number is accepting but not terminal (more digits could follow); nothing
    but number bytes may follow it."""
    g = json_schema_grammar({"type": "integer"})
    state = walk(g, b"12")[-1]
    assert g.accepting(state) and not g.terminal(state)
    assert g.step(state, ord(" ")) is None and g.step(state, ord("3")) is not None
    assert not g.accepting(walk(g, b"-")[-1])
    s = json_schema_grammar({"type": "number"})
    assert not s.accepting(walk(s, b"1.")[-1]) and not s.accepting(walk(s, b"1e+")[-1])
    assert s.accepting(walk(s, b"1e+5")[-1])


def test_initial_state_is_not_accepting():
    for g in (json_object_grammar(), json_schema_grammar({}), choice_grammar(["a"])):
        assert not g.matches(b"") and not g.accepting(g.initial) and not g.terminal(g.initial)


# -- no dead ends --------------------------------------------------------------------------

def can_finish(g: ByteGrammar, state, alphabet: bytes, limit: int = 5000) -> bool:
    """Depth-first, trying the bytes in `alphabet` order (closing ones first): some bytes lead
    from `state` to an accepting state."""
    seen, todo = set(), [state]
    while todo:
        s = todo.pop()
        if g.accepting(s):
            return True
        if s in seen:
            continue
        seen.add(s)
        assert len(seen) < limit, "search too large"
        todo.extend(reversed([t for t in (g.step(s, b) for b in alphabet) if t is not None]))
    return False


@pytest.mark.parametrize("name", sorted(SCHEMAS) + ["json"])
def test_no_dead_ends_on_random_walks(grammars, name):
    """Random byte walks through the automaton never reach a state from which the output
    cannot be completed: the token layer relies on that to always finish a value."""
    g = json_object_grammar() if name == "json" else grammars[name]
    text = json.dumps(SCHEMAS.get(name, {}), ensure_ascii=False)
    keys = bytes(sorted(set(text.encode()) - set(b" \t\n\r")))
    finish = b'}]"0:,' + bytes(sorted(set(b'{[123456789.eE-+truefalsnTZ\\') | set(keys)))
    step_bytes = finish + b" \n"
    rng = random.Random(name)
    for _ in range(12):
        state = g.initial
        for _ in range(60):
            assert can_finish(g, state, finish), state
            alive = [t for t in (g.step(state, b) for b in step_bytes) if t is not None]
            if not alive:
                assert g.terminal(state), state
                break
            state = rng.choice(alive)


# -- unsupported or inconsistent schemas -----------------------------------------------------

@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "pattern": "^a+$"}, "pattern"),
    ({"oneOf": [{"type": "integer"}, {"type": "null"}]}, "oneOf"),
    ({"type": "number", "multipleOf": 2}, "multipleOf"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "null"}}, "not"),
    # deep down: in a property, in items, behind a $ref, in an anyOf branch
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}}},
     "multipleOf"),
    ({"type": "array", "items": {"type": "string", "contentEncoding": "base64"}},
     "contentEncoding"),
    ({"$defs": {"X": {"type": "object", "propertyNames": {}}}, "$ref": "#/$defs/X"},
     "propertyNames"),
    ({"anyOf": [{"type": "null"}, {"if": {}}]}, "if"),
])
def test_unsupported_keywords_are_named(schema, keyword):
    with pytest.raises(ValueError, match=re.escape(repr(keyword))):
        json_schema_grammar(schema)


@pytest.mark.parametrize("schema, fragment", [
    ({"$ref": "#/$defs/Missing", "$defs": {}}, "points nowhere"),
    ({"$ref": "#/$defs/A/b", "$defs": {"A": {"type": "integer"}}}, "points nowhere"),
    ({"$ref": "https://example.com/s.json"}, "only local $ref"),
    ({"$ref": "other.json#/x"}, "only local $ref"),
    ({"$ref": 1}, "only local $ref"),
    ({"$ref": "#/$defs/A", "type": "object", "$defs": {"A": {}}}, "$ref beside"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},
     "required property 'b'"),
    ({"type": "object", "required": ["a"]}, "required property 'a'"),
    ({"type": "object", "required": "a"}, "required must be a list"),
    ({"type": "object", "properties": []}, "properties must be an object"),
    ({"type": []}, "type must not be an empty list"),
    ({"type": "float"}, "unknown type 'float'"),
    ({"type": ["string", "float"]}, "unknown type 'float'"),
    ({"enum": []}, "enum must be a non-empty list"),
    ({"enum": "a"}, "enum must be a non-empty list"),
    ({"anyOf": []}, "anyOf must be a non-empty list"),
    ({"anyOf": [{}], "type": "string"}, "anyOf beside"),
    ({"allOf": [{}, {}]}, "allOf is supported only with one"),
    ({"allOf": [{}], "type": "string"}, "allOf is supported only with one"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}},
     "additionalProperties beside properties"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True},
     "additionalProperties beside properties"),
    ({"type": "string", "items": {}}, "'items' does not apply to type 'string'"),
    ({"type": "array", "properties": {}}, "'properties' does not apply to type 'array'"),
    ({"type": "array", "minItems": -1}, "minItems must be an integer >= 0"),
    ({"type": "array", "minItems": 1.5}, "minItems must be an integer >= 0"),
    ({"type": "array", "maxItems": True}, "maxItems must be an integer >= 0"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems 2 < minItems 3"),
    ({"type": "array", "items": [{}]}, "items as a list (draft 4's tuples)"),
    ({"type": "array", "prefixItems": {}}, "prefixItems must be a list"),
    ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2},
     "minItems 2 with items false and 1 prefixItems"),
    ({"type": "string", "format": "email"}, "format 'email' is not supported"),
    ({"type": "string", "format": "date", "maxLength": 10}, "beside format"),
    ({"type": "string", "minLength": -1}, "minLength must be an integer >= 0"),
    ({"type": "string", "minLength": None}, "minLength must be an integer >= 0"),
    ({"type": "string", "maxLength": None}, "maxLength must be an integer >= 0"),
    ({"type": "array", "maxItems": None}, "maxItems must be an integer >= 0"),
    ({"minimum": 0, "maxLength": 3}, "'minimum' does not apply to type 'string' (implied"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "maxLength 2 < minLength 3"),
    ({"type": "integer", "minimum": "0"}, "minimum must be a finite number"),
    ({"type": "number", "exclusiveMinimum": True}, "exclusiveMinimum must be a finite number"),
    ({"type": "integer", "minimum": 0.2, "maximum": 0.8},
     "no integer with at most 400 digits lies within"),
    ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "no number without an exponent"),
    ({"minLength": 2, "enum": ["ab"]}, "'minLength' beside enum"),
    ({"type": "object", "properties": {"a": False}}, "is false"),
    (False, "is false"),
    ([], "must be an object"),
    (3, "must be an object"),
    ("{not json", "not valid JSON"),
])
def test_bad_schemas_raise(schema, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        json_schema_grammar(schema)


def test_anchor_refs_are_refused():
    """Only '#' and '#/...' pointers are supported: '#Item' (an anchor) must raise, not turn
    into a reference to the root (here: {"x": {"x": {}}} instead of {"x": 1})."""
    schema = {"type": "object", "properties": {"x": {"$ref": "#Item"}},
              "$defs": {"Item": {"type": "integer"}}}
    with pytest.raises(ValueError):
        json_schema_grammar(schema)


# -- choice --------------------------------------------------------------------------------

def test_choice_exact_strings():
    g = choice_grammar(["yes", "no", "maybe later", "é😀", '{"a": 1}'])
    for text in ("yes", "no", "maybe later", "é😀", '{"a": 1}'):
        data = text.encode()
        assert g.matches(data)
        states = walk(g, data)
        assert all(s is not None and not g.accepting(s) for s in states[:-1])
        assert g.terminal(states[-1])
    for text in ("", "y", "ye", "yes ", " yes", "Yes", "yess", "n o", "maybe", "é", "nope",
                 '{"a":1}', "noyes"):
        assert not g.matches(text.encode()), text


def test_choice_prefix_of_another():
    """After "yes" the output may end or go on to "yes sir"."""
    g = choice_grammar(["yes sir", "yes", "y"])
    s = walk(g, b"y")[-1]
    assert g.accepting(s) and not g.terminal(s)
    s = walk(g, b"yes")[-1]
    assert g.accepting(s) and not g.terminal(s)
    assert g.step(s, ord(" ")) is not None and g.step(s, ord("!")) is None
    s = walk(g, b"yes s")[-1]
    assert s is not None and not g.accepting(s)
    s = walk(g, b"yes sir")[-1]
    assert g.accepting(s) and g.terminal(s)
    assert g.step(s, ord("!")) is None
    assert not g.matches(b"yes si") and not g.matches(b"yes sir!")


def test_choice_duplicates_and_whitespace():
    g = choice_grammar(["a", "a", " b\n"])
    assert g.matches(b"a") and g.matches(b" b\n") and not g.matches(b"b")
    assert g.terminal(walk(g, b"a")[-1])


@pytest.mark.parametrize("bad", [[], [""], ["a", ""], "yes", ["a", 1], None, ("a",)])
def test_choice_bad_arguments(bad):
    with pytest.raises(ValueError, match="non-empty list of non-empty strings"):
        choice_grammar(bad)


def test_refs_into_lists_self_reference_and_non_finite_constants():
    """A JSON pointer may index a list; a schema that only refers to itself, and enum/const
    values that are not JSON (infinities, NaN), are errors."""
    g = json_schema_grammar({"anyOf": [{"type": "integer"}, {"$ref": "#/anyOf/0"}]})
    assert g.matches(b"12") and not g.matches(b"1.5")
    g = json_schema_grammar({"type": "array", "items": {"$ref": "#/%24defs/a~1b"},
                             "$defs": {"a/b": {"const": True}}})
    assert g.matches(b"[true,true]") and not g.matches(b"[false]")
    for schema in ({"$ref": "#"}, {"anyOf": [{"$ref": "#"}]}):
        with pytest.raises(ValueError, match="only refers to itself"):
            json_schema_grammar(schema)
    with pytest.raises(ValueError, match="not JSON data"):
        json_schema_grammar('{"const": 1e400}')
    with pytest.raises(ValueError, match="points nowhere"):
        json_schema_grammar({"type": "array", "items": {"$ref": "#/$defs/list/3"},
                             "$defs": {"list": [{"type": "null"}]}})


def test_nesting_is_capped():
    """JSON mode lets the model choose the depth; each level makes every later state a new
    one, so objects and arrays nest at most MAX_NESTING deep."""
    from ragkv.structured.json_grammar import MAX_NESTING

    g = json_object_grammar()
    assert g.matches(b"[" * MAX_NESTING + b"]" * MAX_NESTING)
    assert not g.matches(b"[" * (MAX_NESTING + 1) + b"]" * (MAX_NESTING + 1))

"""Byte-level automata for structured output: any JSON object or array (JSON mode), JSON
that follows a JSON schema, or one of a fixed list of strings (choice).

A state is a frozenset of alternatives, each a (stack, whitespace run) pair; a stack is a
tuple of frames, top last. Alternatives are how the automaton stays deterministic over an
ambiguous grammar (anyOf, a property name that is a prefix of another, choices that share a
prefix): a byte advances every alternative and keeps those that survive. States are plain
hashable tuples, so the token layer (structured_output.py) can intern them and cache one
vocabulary mask per state.

Frames:
  ("V", node)                         a value of `node` comes next (whitespace first is fine)
  ("S", sub)                          inside a string: sub 0 plain, 1 after a backslash,
                                      10 + k: k hex digits of a \\u escape left,
                                      20 + k: k UTF-8 continuation bytes left,
                                      30-33: a restricted second byte next
  ("C", sub, count, node)             inside a string of bounded length: `count`
                                      characters begun so far (counting stops at the
                                      minimum when there is no maximum); sub as above, and
                                      40: "\\uD" read (no escaped surrogates)
  ("F", text, node)                   inside a string of a format, `text` read so far
  ("L", rest)                         the bytes `rest` must follow exactly
  ("N", sub, integer)                 inside a number (sub: see _NUMBER)
  ("B", text, node)                   inside a number within bounds, `text` read so far
  ("O", node, seen, phase, key)       inside an object: phase 0 after "{", 1 after ",",
                                      2 after a key (`key`, None for a free one), 3 after a value
  ("A", node, count, phase)           inside an array: phase 0 after "[", 1 after a value,
                                      2 after ","; `count` values begun (counting stops
                                      where nothing depends on it any more)

Which texts a bounded number or a formatted string may be is decided in json_scalars.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import unquote

from .json_scalars import FORMATS, NumberBounds, format_scan, number_complete, number_prefix_ok

# Whitespace between JSON tokens: at most 16 bytes in a row, one newline among them, no
# carriage return, and one space or tab at most before the top-level value (SentencePiece
# vocabularies spell a word-initial "{" as " {"; the decoded text drops it). Unbounded
# whitespace lets a model that is unsure how to go on emit newlines until max_tokens (a known
# failure of JSON modes); this still covers compact JSON, spaces after separators and
# pretty-printing seven levels deep.
MAX_WHITESPACE_RUN = 16
_WHITESPACE = frozenset(b" \t\n")
# Deepest nesting of objects and arrays: in JSON mode the model chooses the depth, and every
# level makes each later state (and its mask) a new one.
MAX_NESTING = 128
_NEWLINE = 100  # added to an alternative's whitespace count once the run has a newline
_START_RUN = _NEWLINE + MAX_WHITESPACE_RUN - 1  # before the top-level value: one space
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')

# Number sub-states: what was read so far, and which of them may end the number.
_MINUS, _ZERO, _INT, _DOT, _FRAC, _E, _ESIGN, _EXP = range(8)
_NUMBER_ENDS = frozenset({_ZERO, _INT, _FRAC, _EXP})
_NUMBER_BYTES = frozenset(b"-.0123456789")  # what a bounded number is spelled with

# Schema keywords that only annotate: accepted and ignored.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                          "$comment", "readOnly", "writeOnly", "deprecated", "$defs",
                          "definitions"})
_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_LENGTHS = frozenset({"minLength", "maxLength"})
_SUPPORTED = frozenset({"type", "enum", "const", "properties", "required",
                        "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
                        "anyOf", "allOf", "$ref", "format"}) | _BOUNDS | _LENGTHS | _ANNOTATIONS
_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")

State = frozenset


@dataclass(frozen=True, slots=True)
class _Object:
    # property name -> (the name's bytes after the opening quote, the value's node)
    properties: dict[str, tuple[bytes, int]]
    required: frozenset[str]
    extra: int | None  # node of the values of other keys (None: no other keys)


@dataclass(frozen=True, slots=True)
class _Array:
    item: int | None  # node of the values after `prefix` (None: no more values)
    min_items: int
    max_items: int | None
    prefix: tuple[int, ...] = ()  # nodes of the first values, in order (prefixItems)


class ByteGrammar:
    """A compiled constraint over the bytes of the output. `step` is pure: the token layer
    memoizes it."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.nodes: list[tuple] = []
        self.initial: State = frozenset()

    def add(self, node: tuple) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    # -- queries --------------------------------------------------------------------------

    def accepting(self, state: State) -> bool:
        """Whether the output may end here (a complete value, or a top-level number that
        could also go on)."""
        for stack, _ in state:
            if not stack:
                return True
            if len(stack) == 1:
                top = stack[0]
                if top[0] == "N" and top[1] in _NUMBER_ENDS:
                    return True
                if top[0] == "B" and number_complete(top[1], self.nodes[top[2]][1]):
                    return True
        return False

    @staticmethod
    def string_frame(state: State) -> tuple | None:
        """The top frame when every alternative is inside a string ("S", or "C" of bounded
        length) at the same frame (what follows the string may differ), else None: which
        tokens stay inside such a string depends on that frame alone."""
        tops = {stack[-1] if stack and stack[-1][0] in "SC" else None for stack, _ in state}
        return next(iter(tops)) if len(tops) == 1 else None

    def length_bounds(self, node_id: int) -> tuple[int, int | None]:
        """minLength and maxLength of a "C" frame's node."""
        return self.nodes[node_id][1:]

    def terminal(self, state: State) -> bool:
        """Whether the output is complete and no byte may follow (a closed object, but also
        a top-level integer 0, which no digit may extend)."""
        return self.accepting(state) and not any(self.step(state, b) for b in range(256))

    def step(self, state: State, byte: int) -> State | None:
        """The state after `byte`, or None when no alternative accepts it."""
        out = set()
        for stack, run in state:
            self._advance(stack, run, byte, out)
        return frozenset(out) if out else None

    def matches(self, data: bytes) -> bool:
        """Whether `data` is a complete output (tests and error messages)."""
        state = self.initial
        for b in data:
            state = self.step(state, b)
            if state is None:
                return False
        return self.accepting(state)

    # -- the automaton ---------------------------------------------------------------------

    def _advance(self, stack: tuple, run: int, b: int, out: set) -> None:
        if not stack:
            return  # a complete value: nothing may follow
        top = stack[-1]
        kind = top[0]
        if kind == "S":
            sub = string_step(top[1], b)
            if sub == -1:
                return
            out.add((stack[:-1] if sub is None else stack[:-1] + (("S", sub),), 0))
        elif kind == "L":
            rest = top[1]
            if rest[0] == b:
                out.add((stack[:-1] + (("L", rest[1:]),) if len(rest) > 1 else stack[:-1], 0))
        elif kind == "N":
            sub = _number_step(top[1], b, top[2])
            if sub is not None:
                out.add((stack[:-1] + (("N", sub, top[2]),), 0))
            elif top[1] in _NUMBER_ENDS:
                self._advance(stack[:-1], 0, b, out)  # the byte after the number
        elif kind == "C":
            self._counted_step(stack, top, b, out)
        elif kind == "F":
            _, text, node_id = top
            fmt = self.nodes[node_id][1]
            if b == ord('"'):
                if format_scan(fmt, text) == 1:
                    out.add((stack[:-1], 0))
            elif 0x20 < b < 0x7F and b != ord("\\") and format_scan(fmt, text + chr(b)) >= 0:
                out.add((stack[:-1] + (("F", text + chr(b), node_id),), 0))
        elif kind == "B":
            _, text, node_id = top
            bounds = self.nodes[node_id][1]
            if b in _NUMBER_BYTES and number_prefix_ok(text + chr(b), bounds):
                out.add((stack[:-1] + (("B", text + chr(b), node_id),), 0))
            elif number_complete(text, bounds):
                self._advance(stack[:-1], 0, b, out)  # the byte after the number
        elif b in _WHITESPACE:
            newline = b == ord("\n")
            if run % _NEWLINE < MAX_WHITESPACE_RUN and not (newline and run >= _NEWLINE):
                out.add((stack, run + 1 + (_NEWLINE if newline else 0)))
        elif kind == "V":
            self._start_value(stack[:-1], top[1], b, out)
        elif kind == "O":
            self._object_step(stack, top, b, out)
        else:
            self._array_step(stack, top, b, out)

    def _start_value(self, below: tuple, node_id: int, b: int, out: set,
                     expanding: frozenset = frozenset()) -> None:
        """The first byte of a value of `node_id`, with `below` the rest of the stack."""
        node = self.nodes[node_id]
        kind = node[0]
        if len(below) >= MAX_NESTING and b in b"{[":
            return
        if kind == "anyof":
            if node_id in expanding:
                return  # a schema that refers to itself before any byte: no value here
            for child in node[1]:
                self._start_value(below, child, b, out, expanding | {node_id})
        elif kind == "any":
            if b == ord("{"):
                out.add((below + (("O", node[1], frozenset(), 0, None),), 0))
            elif b == ord("["):
                out.add((below + (("A", node[2], 0, 0),), 0))
            elif b == ord('"'):
                out.add((below + (("S", 0),), 0))
            elif b == ord("-") or b in _DIGITS:
                out.add((below + (("N", _number_start(b), False),), 0))
            else:
                for word in (b"true", b"false", b"null"):
                    if word[0] == b:
                        out.add((below + (("L", word[1:]),), 0))
        elif kind == "object":
            if b == ord("{"):
                out.add((below + (("O", node_id, frozenset(), 0, None),), 0))
        elif kind == "array":
            if b == ord("["):
                out.add((below + (("A", node_id, 0, 0),), 0))
        elif kind == "string":
            if b == ord('"'):
                out.add((below + (("S", 0),), 0))
        elif kind == "number":
            if b == ord("-") or b in _DIGITS:
                out.add((below + (("N", _number_start(b), node[1]),), 0))
        elif kind == "counted":
            if b == ord('"'):
                out.add((below + (("C", 0, 0, node_id),), 0))
        elif kind == "format":
            if b == ord('"'):
                out.add((below + (("F", "", node_id),), 0))
        elif kind == "bounded":
            if b in b"-0123456789" and number_prefix_ok(chr(b), node[1]):
                out.add((below + (("B", chr(b), node_id),), 0))
        else:  # literal alternatives
            for word in node[1]:
                if word[0] == b:
                    out.add((below + (("L", word[1:]),) if len(word) > 1 else below, 0))

    def _object_step(self, stack: tuple, top: tuple, b: int, out: set) -> None:
        _, node_id, seen, phase, key = top
        spec: _Object = self.nodes[node_id][1]
        below = stack[:-1]
        if phase in (0, 1) and b == ord('"'):
            for name, (rest, _) in spec.properties.items():
                if name not in seen:
                    out.add((below + (("O", node_id, seen | {name}, 2, name), ("L", rest)), 0))
            if spec.extra is not None:
                out.add((below + (("O", node_id, seen, 2, None), ("S", 0)), 0))
        elif phase == 2 and b == ord(":"):
            value = spec.extra if key is None else spec.properties[key][1]
            out.add((below + (("O", node_id, seen, 3, None), ("V", value)), 0))
        elif phase == 3 and b == ord(","):
            if spec.extra is not None or len(seen) < len(spec.properties):
                out.add((below + (("O", node_id, seen, 1, None),), 0))
        elif phase in (0, 3) and b == ord("}") and spec.required <= seen:
            out.add((below, 0))

    def _counted_step(self, stack: tuple, top: tuple, b: int, out: set) -> None:
        _, sub, count, node_id = top
        low, high = self.length_bounds(node_id)
        if sub == 0 and b == ord('"'):
            if count >= low:
                out.add((stack[:-1], 0))
            return
        nxt = counted_string_step(sub, b)
        if nxt is None or nxt < 0:
            return
        if sub == 0:  # a character begins (a plain byte, a UTF-8 lead or a backslash)
            count += 1
            if high is None:
                count = min(count, low)  # past the minimum nothing depends on the count
            elif count > high:
                return
        out.add((stack[:-1] + (("C", nxt, count, node_id),), 0))

    def _array_step(self, stack: tuple, top: tuple, b: int, out: set) -> None:
        _, node_id, count, phase = top
        spec: _Array = self.nodes[node_id][1]
        below = stack[:-1]
        more = (spec.max_items is None or count < spec.max_items) and (
            spec.item is not None or count < len(spec.prefix))
        if phase == 1 and b == ord(","):
            if more:
                out.add((below + (("A", node_id, count, 2),), 0))
        elif phase in (0, 1) and b == ord("]"):
            if count >= spec.min_items:
                out.add((below, 0))
        elif phase in (0, 2) and more:
            # A value starts: its node is the prefix's while there is one. Counting past
            # min_items and the prefix changes nothing without a maximum, so the count stops
            # there (fewer distinct states).
            item = spec.prefix[count] if count < len(spec.prefix) else spec.item
            if spec.max_items is not None or count < max(spec.min_items, len(spec.prefix)):
                count += 1
            self._start_value(below + (("A", node_id, count, 1),), item, b, out)


def string_step(sub: int, b: int) -> int | None:
    """The string sub-state after byte `b`: None when the string ends, -1 when invalid.
    Depends on nothing else, so the token layer precomputes which tokens stay inside."""
    if sub == 0:
        if b == ord('"'):
            return None
        if b == ord("\\"):
            return 1
        if b < 0x20:
            return -1  # control characters must be escaped
        if b < 0x80:
            return 0
        if 0xC2 <= b <= 0xDF:
            return 21
        # The second byte of these leads has a narrower range (no overlong forms, no
        # surrogates, nothing past U+10FFFF): sub-states 30-33.
        if b in _NARROW_LEADS:
            return _NARROW_LEADS[b][0]
        if 0xE1 <= b <= 0xEF:
            return 22
        if 0xF1 <= b <= 0xF3:
            return 23
        return -1
    if sub == 1:
        if b == ord("u"):
            return 14
        return 0 if b in _ESCAPES else -1
    if sub >= 30:
        low, high, then = _NARROW_SECOND[sub]
        return then if low <= b <= high else -1
    if sub > 20:
        return (sub - 1 if sub > 21 else 0) if 0x80 <= b <= 0xBF else -1
    return (sub - 1 if sub > 11 else 0) if b in _HEX else -1


# UTF-8 lead bytes whose second byte is restricted: lead -> (sub-state,); sub-state ->
# (lowest, highest second byte, sub-state after it: continuation bytes left).
_NARROW_LEADS = {0xE0: (30,), 0xED: (31,), 0xF0: (32,), 0xF4: (33,)}
_NARROW_SECOND = {30: (0xA0, 0xBF, 21), 31: (0x80, 0x9F, 21), 32: (0x90, 0xBF, 22),
                  33: (0x80, 0x8F, 22)}


def counted_string_step(sub: int, b: int) -> int | None:
    """string_step for strings of bounded length, which refuse a surrogate spelled as a
    \\u escape (\\uD800-\\uDFFF; JSON Schema counts an escaped pair as one character):
    sub-state 40 is "\\uD" read, and the next hex digit must be 0-7."""
    if sub == 14 and b in b"dD":
        return 40
    if sub == 40:
        return 12 if b in b"01234567" else -1
    return string_step(sub, b)


def _number_start(b: int) -> int:
    return _MINUS if b == ord("-") else _ZERO if b == ord("0") else _INT


def _number_step(sub: int, b: int, integer: bool) -> int | None:
    """The number sub-state after byte `b`, or None when `b` cannot continue the number."""
    digit = b in _DIGITS
    if sub == _MINUS:
        return (_ZERO if b == ord("0") else _INT) if digit else None
    if sub in (_ZERO, _INT):
        if digit:
            return _INT if sub == _INT else None
        if integer:
            return None
        return _DOT if b == ord(".") else _E if b in b"eE" else None
    if sub in (_DOT, _FRAC):
        if digit:
            return _FRAC
        return _E if sub == _FRAC and b in b"eE" else None
    if sub == _E:
        return _ESIGN if b in b"+-" else _EXP if digit else None
    return _EXP if digit else None  # _ESIGN, _EXP


# -- building grammars ---------------------------------------------------------------------

def _any_value(g: ByteGrammar) -> int:
    """The node of any JSON value (objects with any keys, arrays of anything)."""
    any_id = g.add(("any", None, None))
    obj = g.add(("object", _Object({}, frozenset(), any_id)))
    arr = g.add(("array", _Array(any_id, 0, None)))
    g.nodes[any_id] = ("any", obj, arr)
    return any_id


def json_object_grammar() -> ByteGrammar:
    """JSON mode: one JSON object or array (as vLLM's and xgrammar's json_object), any keys
    and values inside."""
    g = ByteGrammar("any JSON object or array")
    any_id = _any_value(g)
    _, obj, arr = g.nodes[any_id]
    g.initial = frozenset({((("V", g.add(("anyof", (obj, arr)))),), _START_RUN)})
    return g


def choice_grammar(choices: list[str]) -> ByteGrammar:
    """Exactly one of `choices`, as raw text (vLLM's guided_choice)."""
    if not isinstance(choices, list) or not choices or not all(
            isinstance(c, str) and c for c in choices):
        raise ValueError(f"choice must be a non-empty list of non-empty strings, got "
                         f"{choices!r:.200}")
    g = ByteGrammar(f"one of {len(choices)} choices")
    # Raw text, so no whitespace before it: the start is inside the literals, not a value.
    g.initial = frozenset(((("L", c.encode()),), 0) for c in choices)
    return g


def json_schema_grammar(schema: object) -> ByteGrammar:
    """JSON that follows `schema` (a dict, or its JSON text). Objects take their properties
    in any order, each at most once, the required ones before the closing brace, and no other
    keys unless additionalProperties allows them (then the object may have no `properties`):
    as the strict modes of OpenAI and xgrammar, where an absent additionalProperties means
    false (an object schema with neither is any object). Raises ValueError naming the first
    keyword it cannot enforce."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json schema is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError("json schema nests too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a json schema must be an object, got {type(schema).__name__}")
    g = ByteGrammar("JSON following the schema")
    try:
        root = _SchemaCompiler(g, schema).node(schema, "#")
    except RecursionError:
        raise ValueError("json schema nests too deeply") from None
    g.initial = frozenset({((("V", root),), _START_RUN)})
    # A $ref that only leads back to itself (or an anyOf of such) can never start a value: the
    # output would reach a state where nothing may follow. Found by a fixpoint over the nodes.
    startable = {i for i, node in enumerate(g.nodes) if node[0] != "anyof"}
    grew = True
    while grew:
        grew = False
        for i, node in enumerate(g.nodes):
            if i not in startable and any(c in startable for c in node[1]):
                startable.add(i)
                grew = True
    if len(startable) < len(g.nodes):
        raise ValueError("json schema: a $ref only refers to itself, so no value can follow "
                         "it")
    return g


class _SchemaCompiler:
    def __init__(self, g: ByteGrammar, root: object) -> None:
        self.g = g
        self.root = root
        self.refs: dict[str, int] = {}
        self.any: int | None = None

    def node(self, schema: object, where: str) -> int:
        g = self.g
        if schema is True or schema == {}:
            if self.any is None:
                self.any = _any_value(g)
            return self.any
        if schema is False:
            raise ValueError(f"json schema at {where} is false: no value can follow it")
        if not isinstance(schema, dict):
            raise ValueError(f"json schema at {where} must be an object or a boolean, got "
                             f"{schema!r:.80}")
        unknown = sorted(set(schema) - _SUPPORTED)
        if unknown:
            known = ", ".join(sorted(_SUPPORTED - _ANNOTATIONS))
            raise ValueError(f"json schema keyword {unknown[0]!r} (at {where}) is not "
                             f"supported; supported: {known}")
        if "$ref" in schema:
            if len(set(schema) - _ANNOTATIONS) > 1:
                raise ValueError(f"json schema at {where}: $ref beside other keywords is not "
                                 "supported")
            return self._ref(schema["$ref"], where)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1 or len(set(schema)
                                                                    - _ANNOTATIONS) > 1:
                raise ValueError(f"json schema at {where}: allOf is supported only with one "
                                 "schema and nothing beside it")
            return self.node(parts[0], f"{where}/allOf/0")
        if "anyOf" in schema:
            parts = schema["anyOf"]
            if not isinstance(parts, list) or not parts:
                raise ValueError(f"json schema at {where}: anyOf must be a non-empty list")
            rest = {k: v for k, v in schema.items() if k != "anyOf"}
            if set(rest) - _ANNOTATIONS:
                raise ValueError(f"json schema at {where}: anyOf beside other keywords is not "
                                 "supported")
            return g.add(("anyof", tuple(self.node(p, f"{where}/anyOf/{i}")
                                         for i, p in enumerate(parts))))
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError(f"json schema at {where}: enum must be a non-empty list")
            beside = sorted(set(schema) - _ANNOTATIONS - {"enum", "const", "type"})
            if beside or ("enum" in schema and "const" in schema):
                raise ValueError(f"json schema at {where}: "
                                 f"{beside[0] if beside else 'enum'!r} beside enum or const is "
                                 "not supported")
            kinds = schema.get("type")
            kinds = [kinds] if isinstance(kinds, str) else kinds
            wrong = [v for v in values if kinds is not None and not any(
                _is_type(v, k) for k in kinds)]
            if wrong:
                raise ValueError(f"json schema at {where}: enum or const value {wrong[0]!r:.40} "
                                 f"is not of type {schema['type']!r}")
            try:
                words = tuple(dict.fromkeys(json.dumps(v, ensure_ascii=False, allow_nan=False,
                                                       separators=(",", ":")).encode()
                                            for v in values))
            except (TypeError, ValueError) as e:  # NaN and infinities are not JSON
                raise ValueError(f"json schema at {where}: enum or const value is not JSON "
                                 f"data: {e}") from None
            return g.add(("literal", words))
        kind = schema.get("type")
        implied = kind is None
        if implied:
            # A type's keywords without a type: held to that type (as required and minItems
            # always were), not "any value, and this rule if it is of that type".
            kind = next((t for t in ("object", "array", "string", "number")
                         if set(schema) & _TYPE_KEYWORDS[t]), None)
            if kind is None:
                return self.node(True, where)
        if isinstance(kind, list):
            if not kind:
                raise ValueError(f"json schema at {where}: type must not be an empty list")
            # Each type keeps the keywords that apply to it.
            return g.add(("anyof", tuple(
                self.node({k: v for k, v in schema.items() if k in _ANNOTATIONS
                           or k in _TYPE_KEYWORDS.get(t, ())} | {"type": t}, where)
                for t in dict.fromkeys(kind))))
        if kind not in _TYPES:
            raise ValueError(f"json schema at {where}: unknown type {kind!r}")
        extra = sorted(set(schema) - _ANNOTATIONS - {"type"} - _TYPE_KEYWORDS[kind])
        if extra:
            raise ValueError(f"json schema at {where}: {extra[0]!r} does not apply to type "
                             f"{kind!r}" + (" (implied by its other keywords: no type is "
                                            "given)" if implied else ""))
        if kind == "string":
            return self._string(schema, where)
        if kind in ("integer", "number"):
            if set(schema) & _BOUNDS:
                return g.add(("bounded", NumberBounds.of(schema, kind == "integer", where)))
            return g.add(("number", kind == "integer"))
        if kind == "boolean":
            return g.add(("literal", (b"true", b"false")))
        if kind == "null":
            return g.add(("literal", (b"null",)))
        if kind == "array":
            return self._array(schema, where)
        return self._object(schema, where)

    def _string(self, schema: dict, where: str) -> int:
        low, high = _counts(schema, "minLength", "maxLength", where)
        if "format" in schema:
            fmt = schema["format"]
            if fmt not in FORMATS:
                raise ValueError(f"json schema at {where}: format {fmt!r:.40} is not "
                                 f"supported; supported: {', '.join(FORMATS)}")
            if set(schema) & _LENGTHS:
                raise ValueError(f"json schema at {where}: minLength or maxLength beside "
                                 "format is not supported")
            return self.g.add(("format", fmt))
        if (low, high) == (0, None):
            return self.g.add(("string",))
        return self.g.add(("counted", low, high))

    def _array(self, schema: dict, where: str) -> int:
        low, high = _counts(schema, "minItems", "maxItems", where)
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise ValueError(f"json schema at {where}: prefixItems must be a list of schemas")
        items = schema.get("items", True)
        if isinstance(items, list):
            raise ValueError(f"json schema at {where}: items as a list (draft 4's tuples) is "
                             "not supported; use prefixItems")
        if items is False:  # nothing after the prefix
            if low > len(prefix):
                raise ValueError(f"json schema at {where}: minItems {low} with items false "
                                 f"and {len(prefix)} prefixItems")
            high = len(prefix) if high is None else min(high, len(prefix))
        node_id = self.g.add(("array", None))
        nodes = tuple(self.node(p, f"{where}/prefixItems/{i}") for i, p in enumerate(prefix))
        item = None if items is False else self.node(items, f"{where}/items")
        self.g.nodes[node_id] = ("array", _Array(item, low, high, nodes))
        return node_id

    def _object(self, schema: dict, where: str) -> int:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError(f"json schema at {where}: properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"json schema at {where}: required must be a list of names")
        missing = [r for r in required if r not in props]
        # Strict mode: without additionalProperties no other keys, except in an object that
        # names no properties either ({"type": "object"}), which is any object.
        extra_schema = schema.get("additionalProperties", "properties" not in schema)
        if extra_schema is not False and props:
            raise ValueError(f"json schema at {where}: additionalProperties beside properties "
                             "is not supported (give one or the other)")
        if missing:
            raise ValueError(f"json schema at {where}: required property {missing[0]!r} is "
                             "not in properties")
        node_id = self.g.add(("object", None))
        extra = None if extra_schema is False else self.node(
            extra_schema, f"{where}/additionalProperties")
        compiled = {}
        for name, sub in props.items():
            key = json.dumps(name, ensure_ascii=False).encode()[1:]  # after the opening quote
            compiled[name] = (key, self.node(sub, f"{where}/properties/{name}"))
        self.g.nodes[node_id] = ("object", _Object(compiled, frozenset(required), extra))
        return node_id

    def _ref(self, ref: object, where: str) -> int:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ValueError(f"json schema at {where}: only local $ref ('#' or a JSON "
                             f"pointer '#/...') is supported, got {ref!r:.80}")
        if ref in self.refs:
            return self.refs[ref]
        target: object = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            elif isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise ValueError(f"json schema at {where}: $ref {ref!r} points nowhere")
        # A placeholder first, so a recursive schema refers to itself.
        placeholder = self.g.add(("anyof", ()))
        self.refs[ref] = placeholder
        self.g.nodes[placeholder] = ("anyof", (self.node(target, ref),))
        return placeholder


def _counts(schema: dict, low_key: str, high_key: str, where: str) -> tuple[int, int | None]:
    """A pair of count keywords (minItems / maxItems, minLength / maxLength), checked."""
    for name in (low_key, high_key):
        value = schema.get(name, 0)  # present: null is as wrong as -1
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"json schema at {where}: {name} must be an integer >= 0")
    low, high = schema.get(low_key, 0), schema.get(high_key)
    if high is not None and high < low:
        raise ValueError(f"json schema at {where}: {high_key} {high} < {low_key} {low}")
    return low, high


def _is_type(value: object, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python = {"string": str, "boolean": bool, "object": dict, "array": list}.get(kind)
    return value is None if kind == "null" else python is not None and isinstance(value, python)


# `format` on a number (OpenAPI's int64, double) is accepted and has no effect: JSON Schema
# applies formats to strings only.
_TYPE_KEYWORDS = {
    "string": _LENGTHS | {"format"}, "integer": _BOUNDS | {"format"},
    "number": _BOUNDS | {"format"}, "boolean": set(), "null": set(),
    "array": {"items", "prefixItems", "minItems", "maxItems"},
    "object": {"properties", "required", "additionalProperties"},
}

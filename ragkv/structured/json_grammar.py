"""Byte-level automata for structured output: any JSON object or array (JSON mode), JSON
that follows a JSON schema, or one of a fixed list of strings (choice).

A state is a frozenset of alternatives, each a (stack, whitespace run) pair; a stack is a
tuple of frames, top last. Alternatives are how the automaton stays deterministic over an
ambiguous grammar (anyOf, a property name that is a prefix of another, choices that share a
prefix): a byte advances every alternative and keeps those that survive. States are plain
hashable tuples, so the token layer (token_grammar.py) can intern them and cache one
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

import functools
from dataclasses import dataclass

from .json_scalars import format_scan, number_complete, number_prefix_ok

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
START_RUN = _NEWLINE + MAX_WHITESPACE_RUN - 1  # before the top-level value: one space
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')

# Number sub-states: what was read so far, and which of them may end the number.
_MINUS, _ZERO, _INT, _DOT, _FRAC, _E, _ESIGN, _EXP = range(8)
_NUMBER_ENDS = frozenset({_ZERO, _INT, _FRAC, _EXP})
_NUMBER_BYTES = frozenset(b"-.0123456789")  # what a bounded number is spelled with

# Alternatives one state may hold. An alternative per candidate is how the automaton stays
# deterministic: after `{"` an object has one per property it may name, a union of tool
# schemas one per property of every tool, an enum after `"` one per value. 4,096 keeps 128
# tools of 30 properties; an ambiguous recursive schema (anyOf of two array schemas of itself)
# doubles them at every nesting level and passes it at depth 12: its request fails
# (GrammarBudgetError) instead of slowing every other one.
MAX_ALTERNATIVES = 4096

State = frozenset


class GrammarBudgetError(ValueError):
    """A constraint needs more work than a request may take (too ambiguous a schema)."""


class WorkMeter:
    """Counts the elementary steps of one computation over a grammar (an alternative
    advanced, a node of an anyOf expanded, an enum word or a property name tried) against
    `limit`: a GrammarBudgetError past it, raised in the middle of the step that passes it."""

    __slots__ = ("used", "limit", "what")

    def __init__(self, limit: int, what: str) -> None:
        self.used = 0
        self.limit = limit
        self.what = what

    def charge(self, units: int = 1) -> None:
        self.used += units
        if self.used > self.limit:
            raise GrammarBudgetError(f"structured output: {self.what} needs more than "
                                     f"{self.limit} grammar steps (a too ambiguous schema)")


# What a step without a budget of its own counts against (tests and `matches`).
_UNMETERED = 1 << 62


@dataclass(frozen=True, slots=True)
class ObjectSpec:
    # property name -> (the name's bytes after the opening quote, the value's node)
    properties: dict[str, tuple[bytes, int]]
    required: frozenset[str]
    extra: int | None  # node of the values of other keys (None: no other keys)


@dataclass(frozen=True, slots=True)
class ArraySpec:
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
        # Each anyOf node's non-anyOf nodes, reached through anyOf alone: computed once, so
        # a $ref shared by many branches (a diamond of them) is expanded once, not per path.
        self._leaves: dict[int, tuple[int, ...]] = {}
        # Each literal node's words by their first byte: an enum of many values is looked up,
        # not scanned, for every byte.
        self._words: dict[int, dict[int, tuple[bytes, ...]]] = {}
        self._first: dict[int, frozenset[int]] = {}  # node -> bytes a value of it starts with

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

    def terminal(self, state: State, meter: WorkMeter | None = None) -> bool:
        """Whether the output is complete and no byte may follow (a closed object, but also
        a top-level integer 0, which no digit may extend)."""
        return self.accepting(state) and not any(self.step(state, b, meter)
                                                 for b in range(256))

    def step(self, state: State, byte: int, meter: WorkMeter | None = None) -> State | None:
        """The state after `byte`, or None when no alternative accepts it. Its work is charged
        to `meter`; past MAX_ALTERNATIVES alternatives, a GrammarBudgetError."""
        if meter is None:
            meter = WorkMeter(_UNMETERED, self.description)
        out = set()
        for stack, run in state:
            self._advance(stack, run, byte, out, meter)
            if len(out) > MAX_ALTERNATIVES:
                raise GrammarBudgetError(
                    f"structured output: {self.description} reaches a state with more than "
                    f"{MAX_ALTERNATIVES} alternatives (a schema whose anyOf branches recur "
                    "alike, or too many candidates at once)")
        return frozenset(out) if out else None

    def first_bytes(self, state: State) -> frozenset[int] | None:
        """A superset of the bytes some alternative of `state` accepts next (None: any may):
        the token layer steps only these, so a state of many alternatives (an enum's values,
        the properties of many tools) costs its candidates, not 256 tries of each. Computed
        from the top frames alone, so a frame whose next byte depends on the frames below it
        (a number that may end, a string of bounded length or a format) answers None."""
        out: set[int] = set()
        for stack, _ in state:
            if not stack:
                continue
            top = stack[-1]
            kind = top[0]
            if kind == "L":
                out.add(top[1][0])
            elif kind == "S":
                out |= _string_first(top[1])
            elif kind == "V":
                out |= self._value_first(top[1])
                out |= _WHITESPACE
            elif kind == "O":
                out |= _OBJECT_FIRST[top[3]]
            elif kind == "A":
                _, node_id, count, phase = top
                out |= _WHITESPACE
                out |= _ARRAY_FIRST[phase]
                if phase in (0, 2):
                    spec: ArraySpec = self.nodes[node_id][1]
                    item = spec.prefix[count] if count < len(spec.prefix) else spec.item
                    if item is not None:
                        out |= self._value_first(item)
            else:
                return None
        return frozenset(out)

    def _value_first(self, node_id: int) -> frozenset[int]:
        """The bytes a value of `node_id` may start with."""
        first = self._first.get(node_id)
        if first is None:
            node = self.nodes[node_id]
            kind = node[0]
            if kind == "anyof":
                first = frozenset().union(*(self._value_first(leaf)
                                            for leaf in self.anyof_leaves(node_id)))
            elif kind == "literal":
                first = frozenset(word[0] for word in node[1])
            else:
                first = _VALUE_FIRST[kind]
            self._first[node_id] = first
        return first

    def matches(self, data: bytes) -> bool:
        """Whether `data` is a complete output (tests and error messages)."""
        state = self.initial
        for b in data:
            state = self.step(state, b)
            if state is None:
                return False
        return self.accepting(state)

    # -- the automaton ---------------------------------------------------------------------

    def _advance(self, stack: tuple, run: int, b: int, out: set, meter: WorkMeter) -> None:
        meter.charge()
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
                self._advance(stack[:-1], 0, b, out, meter)  # the byte after the number
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
                self._advance(stack[:-1], 0, b, out, meter)  # the byte after the number
        elif b in _WHITESPACE:
            newline = b == ord("\n")
            if run % _NEWLINE < MAX_WHITESPACE_RUN and not (newline and run >= _NEWLINE):
                out.add((stack, run + 1 + (_NEWLINE if newline else 0)))
        elif kind == "V":
            self._start_value(stack[:-1], top[1], b, out, meter)
        elif kind == "O":
            self._object_step(stack, top, b, out, meter)
        else:
            self._array_step(stack, top, b, out, meter)

    def anyof_leaves(self, node_id: int) -> tuple[int, ...]:
        """The nodes other than anyOf that an anyOf node stands for, through any nesting of
        anyOf: a value of the node is a value of one of them. A branch that only leads back
        to an anyOf already on the way (a schema referring to itself before any byte) adds
        nothing."""
        leaves = self._leaves.get(node_id)
        if leaves is None:
            found: dict[int, None] = {}
            seen = {node_id}
            todo = list(reversed(self.nodes[node_id][1]))
            while todo:
                child = todo.pop()
                if self.nodes[child][0] != "anyof":
                    found[child] = None
                elif child not in seen:
                    seen.add(child)
                    todo.extend(reversed(self.nodes[child][1]))
            leaves = self._leaves[node_id] = tuple(found)
        return leaves

    def _start_value(self, below: tuple, node_id: int, b: int, out: set,
                     meter: WorkMeter) -> None:
        """The first byte of a value of `node_id`, with `below` the rest of the stack."""
        meter.charge()
        node = self.nodes[node_id]
        kind = node[0]
        if len(below) >= MAX_NESTING and b in b"{[":
            return
        if kind == "anyof":
            for leaf in self.anyof_leaves(node_id):
                self._start_value(below, leaf, b, out, meter)
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
            words = self._words.get(node_id)
            if words is None:
                words = {}
                for word in node[1]:
                    words.setdefault(word[0], []).append(word)
                words = self._words[node_id] = {k: tuple(v) for k, v in words.items()}
            starting = words.get(b, ())
            meter.charge(len(starting))
            for word in starting:
                out.add((below + (("L", word[1:]),) if len(word) > 1 else below, 0))

    def _object_step(self, stack: tuple, top: tuple, b: int, out: set,
                     meter: WorkMeter) -> None:
        _, node_id, seen, phase, key = top
        spec: ObjectSpec = self.nodes[node_id][1]
        below = stack[:-1]
        if phase in (0, 1) and b == ord('"'):
            meter.charge(len(spec.properties))
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

    def _array_step(self, stack: tuple, top: tuple, b: int, out: set,
                    meter: WorkMeter) -> None:
        _, node_id, count, phase = top
        spec: ArraySpec = self.nodes[node_id][1]
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
            self._start_value(below + (("A", node_id, count, 1),), item, b, out, meter)


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


_DIGIT_START = frozenset(b"-0123456789")
# The bytes a value of each node kind may start with (literals and anyOf: from their nodes).
_VALUE_FIRST = {"any": frozenset(b'{["tfn') | _DIGIT_START, "object": frozenset(b"{"),
                "array": frozenset(b"["), "string": frozenset(b'"'),
                "counted": frozenset(b'"'), "format": frozenset(b'"'),
                "number": _DIGIT_START, "bounded": _DIGIT_START}
# An array frame's own next bytes by phase (0 after "[", 1 after a value, 2 after ","),
# besides whitespace and its next value's.
_ARRAY_FIRST = {0: frozenset(b"]"), 1: frozenset(b",]"), 2: frozenset()}
# An object frame's next bytes by phase (0 after "{", 1 after ",", 2 after a key, 3 after a
# value), whitespace included.
_OBJECT_FIRST = {0: frozenset(b'"}') | _WHITESPACE, 1: frozenset(b'"') | _WHITESPACE,
                 2: frozenset(b":") | _WHITESPACE, 3: frozenset(b",}") | _WHITESPACE}


@functools.cache
def _string_first(sub: int) -> frozenset[int]:
    """The bytes string sub-state `sub` accepts (the closing quote included)."""
    return frozenset(b for b in range(256) if string_step(sub, b) != -1)


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

def any_value(g: ByteGrammar) -> int:
    """The node of any JSON value (objects with any keys, arrays of anything)."""
    any_id = g.add(("any", None, None))
    obj = g.add(("object", ObjectSpec({}, frozenset(), any_id)))
    arr = g.add(("array", ArraySpec(any_id, 0, None)))
    g.nodes[any_id] = ("any", obj, arr)
    return any_id


def json_object_grammar() -> ByteGrammar:
    """JSON mode: one JSON object or array (as vLLM's and xgrammar's json_object), any keys
    and values inside."""
    g = ByteGrammar("any JSON object or array")
    any_id = any_value(g)
    _, obj, arr = g.nodes[any_id]
    g.initial = frozenset({((("V", g.add(("anyof", (obj, arr)))),), START_RUN)})
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

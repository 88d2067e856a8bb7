"""Numbers within bounds, string formats and strings of bounded length (json_scalars.py and
their frames in json_grammar.py), each against a reference: Python's own comparisons,
json.loads and datetime / uuid parsers, by brute force over short texts. (prefixItems is in
test_json_grammar.py's small schemas.)"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import random
import re
import sys
import uuid

import pytest

from ragkv.structured.json_scalars import (
    MAX_DIGITS,
    NumberBounds,
    format_scan,
    number_complete,
    number_prefix_ok,
)
from ragkv.structured.json_schema import json_schema_grammar

# -- numbers within bounds -------------------------------------------------------------------

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")
_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
_ALPHABET = "-.0123456789"


def _texts(max_len: int) -> list[str]:
    return ["".join(p) for n in range(max_len + 1)
            for p in itertools.product(_ALPHABET, repeat=n)]


SHORT = _texts(3)
# Every number spelling of up to 5 characters, once for all the cases below.
SPELLINGS = [t for t in _texts(5) if _NUMBER.fullmatch(t)]


def reference(text: str, schema: dict) -> bool:
    """What a validator says of `text` as a whole number: JSON, of the type, within the
    bounds by Python's comparisons of what json.loads returns (an int, or a float)."""
    integer = schema["type"] == "integer"
    if not (_INTEGER if integer else _NUMBER).fullmatch(text):
        return False
    v = json.loads(text)
    return (("minimum" not in schema or v >= schema["minimum"])
            and ("maximum" not in schema or v <= schema["maximum"])
            and ("exclusiveMinimum" not in schema or v > schema["exclusiveMinimum"])
            and ("exclusiveMaximum" not in schema or v < schema["exclusiveMaximum"]))


BOUNDS = [
    {"type": "integer", "minimum": -5, "maximum": 20},
    {"type": "integer", "exclusiveMinimum": 0, "maximum": 100},
    {"type": "integer", "minimum": -50},
    {"type": "integer", "maximum": -3},
    {"type": "integer", "minimum": 1.5, "maximum": 7.9},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"type": "number", "minimum": 0.5, "maximum": 2.5},
    {"type": "number", "maximum": 0.3},
    {"type": "number", "exclusiveMinimum": -1.5, "maximum": -0.25},
    {"type": "number", "minimum": 10, "exclusiveMaximum": 10.5},
    {"type": "number", "minimum": 0, "exclusiveMinimum": 0, "maximum": 9},
    {"type": "number", "minimum": 100},
]


@pytest.mark.parametrize("schema", BOUNDS, ids=lambda s: json.dumps(s)[:60])
def test_bounded_numbers_against_python_comparisons(schema):
    """Every text of up to 4 characters is complete exactly when Python's comparisons admit
    it; every text of up to 3 may go on exactly when a valid spelling of up to 5 characters
    starts with it (in these cases each valid prefix has one that short)."""
    bounds = NumberBounds.of(schema, schema["type"] == "integer", "#")
    valid = [t for t in SPELLINGS if reference(t, schema)]
    prefixes = {t[:i] for t in valid for i in range(len(t) + 1)}
    for text in SHORT:
        assert number_prefix_ok(text, bounds) == (text in prefixes), text
    for text in _texts(4):
        assert number_complete(text, bounds) == reference(text, schema), text


def test_bounded_numbers_agree_with_float_comparisons_up_to_15_digits():
    """Decimal spellings of up to 15 digits (a 0 before the point not counted) compare with
    a float bound as the doubles do (the bound's shortest spelling is what they are compared
    with), also right next to the bound; longer ones are refused."""
    rng = random.Random(0)
    for _ in range(3000):
        bound = float(f"{rng.uniform(-1, 1):.{rng.randint(1, 17)}g}") * 10 ** rng.randint(-3, 5)
        key = rng.choice(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"])
        schema = {"type": "number", key: bound}
        bounds = NumberBounds.of(schema, False, "#")
        digits = rng.randint(1, MAX_DIGITS)
        near = bound * (1 + rng.choice([-1, 1]) * 10 ** -rng.randint(0, 16))
        text = f"{near:.{digits}g}" if rng.random() < 0.8 else f"{bound:.{digits}g}"
        if "e" in text:
            continue
        if "." not in text:
            text += ".0" if len(text.lstrip("-")) < MAX_DIGITS else ""
        if "." not in text:
            continue
        whole, _, frac = text.lstrip("-").partition(".")
        if len(frac) + (0 if whole == "0" else len(whole)) > MAX_DIGITS:
            assert not number_complete(text, bounds), text
            continue
        assert number_complete(text, bounds) == reference(text, schema), (text, schema)
    sixteen = "0." + "1" * 16
    loose = NumberBounds.of({"type": "number", "maximum": 1}, False, "#")
    assert number_prefix_ok(sixteen[:-1], loose) and not number_prefix_ok(sixteen, loose)
    assert not number_complete("12345678901.23456", loose)  # 16 digits


def test_integer_spellings_are_compared_exactly():
    """An integer against a float bound: as Python compares them (exactly), not through the
    bound's decimal spelling (2.0 ** 60 prints as 1.152921504606847e+18)."""
    bound = 2.0 ** 60
    for kind in ("integer", "number"):
        schema = {"type": kind, "maximum": bound}
        bounds = NumberBounds.of(schema, kind == "integer", "#")
        for n in (2 ** 60 - 1, 2 ** 60, 2 ** 60 + 1, 2 ** 60 + 24, 1152921504606847000):
            assert number_complete(str(n), bounds) == (n <= bound), n
        assert number_prefix_ok("1152921504606846976", bounds)
        # Past the bound, and too many digits for a fraction to bring it back.
        assert not number_prefix_ok("1152921504606846977", bounds)


def test_integer_spellings_also_compare_as_doubles():
    """Past 2**53 an integer's double may round onto an exclusive bound: pydantic's float
    fields and JavaScript compare the doubles, so such integers are refused too, and the
    automaton still never dead-ends next to the bound."""
    for schema in ({"type": "number", "exclusiveMaximum": 1e20},
                   {"type": "number", "exclusiveMinimum": -2 ** 63, "exclusiveMaximum": 2 ** 63},
                   {"type": "integer", "exclusiveMaximum": 2.0 ** 60 + 256}):
        bounds = NumberBounds.of(schema, schema["type"] == "integer", "#")
        top = schema["exclusiveMaximum"]
        for n in (int(top) - k for k in (0, 1, 2, 100, 1000, 5000, 10 ** 6)):
            both = reference(str(n), schema) and float(n) < top
            assert number_complete(str(n), bounds) == both, (n, schema)
        rng = random.Random(2)
        for _ in range(30):  # a walk of random allowed digits always finds an end
            text = ""
            while not number_complete(text, bounds) or rng.random() < 0.8:
                alive = [c for c in "-0123456789" if number_prefix_ok(text + c, bounds)]
                if not alive:
                    break
                text += rng.choice(alive)
            assert number_complete(text, bounds), (text, schema)
            assert reference(text, schema) and float(json.loads(text)) < top, text
    compare = {"minimum": float.__ge__, "maximum": float.__le__,
               "exclusiveMinimum": float.__gt__, "exclusiveMaximum": float.__lt__}
    rng = random.Random(3)
    for _ in range(1000):  # bounds of 2**50 to 2**90, integers within a few ulps of them
        bound = rng.getrandbits(rng.randint(50, 90)) * rng.choice([1, -1])
        bound = float(bound) if rng.random() < 0.5 else bound
        key = rng.choice(sorted(compare))
        kind = rng.choice(["integer", "number"])
        bounds = NumberBounds.of({"type": kind, key: bound}, kind == "integer", "#")
        for n in (int(bound) + rng.randint(-3000, 3000) for _ in range(4)):
            want = (reference(str(n), {"type": kind, key: bound})
                    and compare[key](float(n), float(bound)))
            assert number_complete(str(n), bounds) == want, (n, key, bound)


def test_long_and_extreme_bounded_numbers():
    """Integer spellings stop at 400 digits (Python converts at most 4,300, and a model
    that repeats digits must end); bounds near the doubles' limit stay satisfiable."""
    positive = NumberBounds.of({"type": "integer", "minimum": 1}, True, "#")
    assert number_prefix_ok("1" * 400, positive) and number_complete("1" * 400, positive)
    assert not number_prefix_ok("1" * 401, positive)
    g = json_schema_grammar({"type": "array", "items": {"type": "integer", "minimum": 1}})
    state = g.step(g.initial, ord("["))
    for _ in range(400):
        state = g.step(state, ord("7"))
    assert g.step(state, ord("7")) is None and g.step(state, ord("]")) is not None
    huge = NumberBounds.of({"type": "number", "minimum": 1e307, "maximum": 1.7e308}, False, "#")
    assert all(number_prefix_ok(t, huge) for t in ("1", "2", "17", "16999"))
    assert not number_prefix_ok("18" + "0" * 307, huge) and not number_prefix_ok("-", huge)
    assert number_complete(str(10 ** 307), huge) and not number_complete(str(10 ** 306), huge)
    with pytest.raises(ValueError, match="at most 15 digits beside a fraction"):
        NumberBounds.of({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-15},
                        False, "#")


def test_bounded_numbers_in_a_schema():
    g = json_schema_grammar({"type": "array", "items": {"type": "integer", "minimum": 1,
                                                          "maximum": 12}})
    assert g.matches(b"[1, 12,7]") and g.matches(b"[ ]")
    for bad in (b"[0]", b"[13]", b"[-1]", b"[1.0]", b"[01]", b"[1e1]", b"[1,,2]"):
        assert not g.matches(bad), bad
    top = json_schema_grammar({"type": "number", "exclusiveMinimum": 0, "maximum": 50})
    state = top.initial
    for b in b"5":
        state = top.step(state, b)
    assert top.accepting(state) and not top.terminal(state)  # 5, or 50, or 5.5
    assert top.matches(b"50") and not top.matches(b"51") and not top.matches(b"0")
    assert top.matches(b" 0.5") and not top.matches(b"-0.5") and not top.matches(b"0.")
    assert not top.terminal(top.step(top.step(top.initial, ord("5")), ord("0")))  # 50.0
    whole = json_schema_grammar({"type": "integer", "maximum": 50})
    assert whole.terminal(whole.step(whole.step(whole.initial, ord("5")), ord("0")))


# -- string formats --------------------------------------------------------------------------

_DATE = re.compile(r"\d{4}-\d\d-\d\d")
# Python's parser takes offset minutes past 59; RFC 3339's time-numoffset does not.
_TIME = re.compile(r"\d\d:\d\d:\d\d(\.\d{1,6})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)")


def format_reference(fmt: str, text: str) -> bool:
    """RFC 3339 / RFC 4122 in the spelling the grammar keeps (uppercase T and Z, at most 6
    digits of a second), checked by Python's parsers."""
    try:
        if fmt == "date":
            return bool(_DATE.fullmatch(text)) and datetime.date.fromisoformat(text) is not None
        if fmt == "time":
            return bool(_TIME.fullmatch(text)) and datetime.time.fromisoformat(
                text.replace("Z", "+00:00")) is not None
        if fmt == "date-time":
            date, sep, time = text.partition("T")
            return (sep == "T" and format_reference("date", date)
                    and format_reference("time", time))
        return (bool(re.fullmatch(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}", text))
                and uuid.UUID(text) is not None)
    except ValueError:
        return False


iso_parsers = pytest.mark.skipif(sys.version_info < (3, 11),
                                 reason="fromisoformat reads RFC 3339 from Python 3.11")


@iso_parsers
def test_dates_against_python():
    for year, month, day in itertools.product(
            (1, 4, 100, 400, 1900, 2000, 2023, 2024, 9999), range(14), range(33)):
        text = f"{year:04d}-{month:02d}-{day:02d}"
        assert (format_scan("date", text) == 1) == format_reference("date", text), text
    for bad in ("0000-01-01", "2024-1-01", "2024/01/01", "20240101", "2024-01-01 "):
        assert format_scan("date", bad) == -1 or format_scan("date", bad) == 0, bad
        assert format_scan("date", bad) != 1


@iso_parsers
def test_times_against_python():
    fractions = ("", ".", ".5", ".123456", ".1234567")
    offsets = ("Z", "z", "+05:30", "-23:59", "+24:00", "+05:60", "", "+05", "Z0")
    for hour, minute, second, frac, off in itertools.product(
            ("00", "09", "23", "24", "29"), ("00", "59", "60"), ("00", "59", "60"),
            fractions, offsets):
        text = f"{hour}:{minute}:{second}{frac}{off}"
        assert (format_scan("time", text) == 1) == format_reference("time", text), text
        stamp = "2024-02-29T" + text
        assert (format_scan("date-time", stamp) == 1) == format_reference("date-time",
                                                                           stamp), stamp
    for sep in ("t", " ", "_"):
        assert format_scan("date-time", f"2024-02-29{sep}12:00:00Z") == -1


@iso_parsers
def test_uuids_against_python():
    rng = random.Random(1)
    for _ in range(200):
        text = str(uuid.UUID(int=rng.getrandbits(128)))
        text = text.upper() if rng.random() < 0.3 else text
        assert format_scan("uuid", text) == 1
        broken = list(text)
        broken[rng.randrange(len(text))] = rng.choice("g-0x ")
        broken = "".join(broken)
        assert (format_scan("uuid", broken) == 1) == format_reference("uuid", broken), broken


@iso_parsers
@pytest.mark.parametrize("fmt", ["date", "time", "date-time", "uuid"])
def test_format_walks_never_dead_end(fmt):
    """From the empty text, random characters that keep the text alive: there is always
    one until the text is complete, and then it is valid by Python's parsers; every prefix of
    a valid text is alive."""
    rng = random.Random(fmt)
    alphabet = "0123456789-:T.Z+abcdefABCDEF "
    for _ in range(300):
        text = ""
        while format_scan(fmt, text) == 0:
            alive = [c for c in alphabet if format_scan(fmt, text + c) >= 0]
            assert alive, text
            text += rng.choice(alive)
        assert format_scan(fmt, text) == 1 and format_reference(fmt, text), text
        assert all(format_scan(fmt, text[:i]) == 0 for i in range(len(text))), text


def test_format_on_a_number_has_no_effect():
    """JSON Schema applies formats to strings only: OpenAPI's int64 or double on a number
    is accepted and changes nothing; on a string an unknown format is refused."""
    g = json_schema_grammar({"type": ["integer", "string"], "format": "date"})
    assert g.matches(b"12") and g.matches(b'"2024-01-31"') and not g.matches(b'"12"')
    assert json_schema_grammar({"type": "number", "format": "double"}).matches(b"1.5e3")


def test_formats_in_a_schema():
    g = json_schema_grammar({"type": "object", "properties": {
        "day": {"type": "string", "format": "date"},
        "at": {"type": ["string", "null"], "format": "date-time"}}, "required": ["day"]})
    assert g.matches(b'{"day": "2024-02-29", "at": "2024-02-29T23:59:59.5+05:30"}')
    assert g.matches(b'{"at": null, "day": "2000-02-29"}')
    for bad in (b'{"day": "2023-02-29"}', b'{"day": "2024-02-29 "}', b'{"day": "2024-2-9"}',
                b'{"day": "2024\\u002d02-29"}', b'{"day": 20240229}',
                b'{"day": "2024-01-01", "at": "2024-01-01"}'):
        assert not g.matches(bad), bad


# -- strings of bounded length ---------------------------------------------------------------

_PIECES = ["a", "é", "😀", "\\n", '\\"', "\\u00e9", "\\ud83d\\ude00", "\\uD800", "\\ue000"]


@pytest.mark.parametrize("low,high", [(0, 3), (2, 4), (3, None), (1, 1), (0, 0)])
def test_string_lengths_count_code_points(low, high):
    """Strings of 0-5 pieces (plain, multi-byte, escapes): accepted exactly when
    json.loads gives a string of low..high characters and no surrogate is spelled as an
    escape (an escaped pair would be one code point in two escapes)."""
    schema = {"type": "string", "minLength": low}
    if high is not None:
        schema["maxLength"] = high
    g = json_schema_grammar(schema)
    for n in range(6):
        for pieces in itertools.product(_PIECES, repeat=n) if n < 4 else (
                random.Random(n).choices(_PIECES, k=n) for _ in range(300)):
            body = "".join(pieces)
            text = f'"{body}"'
            value = json.loads(text)
            surrogate = re.search(r"\\u[dD][89a-fA-F]", body) is not None
            want = not surrogate and low <= len(value) <= (math.inf if high is None else high)
            assert g.matches(text.encode()) == want, text

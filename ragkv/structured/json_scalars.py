"""Constraints on single JSON values for the schema grammar (json_grammar.py): numbers within
bounds (minimum, maximum, exclusiveMinimum, exclusiveMaximum), strings of a format (date,
time, date-time, uuid) and strings of a bounded length (minLength, maxLength).

Each is a test over the text read so far: whether some continuation still ends in a valid
value (so the automaton never walks into a dead end) and whether the text is a complete one.
Where a keyword admits several spellings of a value, the output is held to one plain
spelling, a subset of the valid instances (as the grammar's whitespace is):
- bounded numbers have no exponent, and one with a fraction has at most 15 digits (not
  counting a 0 before the point; zeros after it count). Python, JavaScript and most
  validators parse such a number as a double; at most 15 significant digits make comparing
  the decimal text with the bound's shortest decimal spelling give the same answer as
  comparing the doubles. An integer spelling (at most 400 digits) must lie within the
  bounds both exactly, as Python compares an int with a bound, and as a double, as
  JavaScript and pydantic's float fields compare: below 2**53 the two agree; above it an
  exclusive bound also excludes the integers whose double rounds onto it;
- formats are RFC 3339 / RFC 4122 with uppercase "T" and "Z", fractions of a second of at
  most 6 digits (what Python's and pydantic's parsers keep), no leap second, no escapes;
- strings of bounded length spell no surrogate as a \\u escape: JSON Schema counts code
  points, and an escaped surrogate pair would be one code point in two escapes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from fractions import Fraction

# Digits of a bounded number written with a fraction, and of one without (see above; Python
# refuses to convert longer digit strings than 4,300, and a model that repeats digits stops).
MAX_DIGITS = 15
MAX_WHOLE_DIGITS = 400
# Digits of a fraction of a second in the time formats (microseconds).
MAX_SECOND_DIGITS = 6
FORMATS = ("date", "date-time", "time", "uuid")
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"


# -- numbers within bounds -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Interval:
    """Values from `low` to `high` (None: unbounded), each end open or closed."""

    low: Fraction | None = None
    low_open: bool = False
    high: Fraction | None = None
    high_open: bool = False

    def admits(self, v: Fraction) -> bool:
        return ((self.low is None or v > self.low or (v == self.low and not self.low_open))
                and (self.high is None or v < self.high
                     or (v == self.high and not self.high_open)))

    def magnitudes(self, negative: bool) -> Interval:
        """The magnitudes m >= 0 whose value (-m if `negative`, else m) lies in the interval."""
        if not negative:
            return self
        return Interval(None if self.high is None else -self.high, self.high_open,
                        None if self.low is None else -self.low, self.low_open)


_End = tuple[Fraction, bool]  # a bound's value and whether it is exclusive


@dataclass(frozen=True, slots=True)
class NumberBounds:
    """A number schema's bounds. `exact` holds what an integer spelling is compared with (the
    tighter of the bounds' exact values and their doubles' limits), `decimal` the bounds'
    shortest decimal spellings (what a spelling with a fraction is compared with); see the
    module's note."""

    integer: bool
    exact: Interval
    decimal: Interval

    @staticmethod
    def of(schema: dict, integer: bool, where: str) -> NumberBounds:
        whole: dict[str, _End | None] = {"low": None, "high": None}
        decimal: dict[str, _End | None] = {"low": None, "high": None}
        for side, keys in (("low", ("minimum", "exclusiveMinimum")),
                           ("high", ("maximum", "exclusiveMaximum"))):
            for key in keys:
                if key not in schema:
                    continue
                value = schema[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                        isinstance(value, float) and not math.isfinite(value)):
                    raise ValueError(f"json schema at {where}: {key} must be a finite number, "
                                     f"got {value!r:.40}")
                open_ = key.startswith("exclusive")
                exact = Fraction(value)
                shortest = Fraction(repr(value)) if isinstance(value, float) else exact
                # Both of a side given (minimum and exclusiveMinimum): the tighter holds.
                whole[side] = _tighter(side, whole[side], _tighter(
                    side, (exact, open_), _double_end(value, side, open_)))
                decimal[side] = _tighter(side, decimal[side], (shortest, open_))

        def interval(ends: dict[str, _End | None]) -> Interval:
            low, high = ends["low"], ends["high"]
            return Interval(low and low[0], bool(low and low[1]), high and high[0],
                            bool(high and high[1]))

        bounds = NumberBounds(integer, interval(whole), interval(decimal))
        if not number_prefix_ok("", bounds):
            spelled = ("with at most 400 digits" if integer else "without an exponent, with "
                       "at most 15 digits beside a fraction (400 without one)")
            raise ValueError(f"json schema at {where}: no {'integer' if integer else 'number'} "
                             f"{spelled} lies within its bounds")
        return bounds


def _tighter(side: str, a: _End | None, b: _End | None) -> _End | None:
    if a is None or b is None:
        return a or b
    if a[0] != b[0]:
        return a if (a[0] > b[0]) == (side == "low") else b
    return a if a[1] else b


def _double_end(value: int | float, side: str, open_: bool) -> _End | None:
    """Where the integers end whose doubles compare within the bound as doubles do. The last
    double admitted is the bound's (or, exclusive, its neighbour inside); an integer rounds
    to it up to the midpoint to the next double out, and at the midpoint to the one of even
    mantissa (round half to even, as float() and JavaScript parse). None: beyond every
    double."""
    try:
        d = float(value)
    except OverflowError:
        return None
    out = math.inf if side == "high" else -math.inf
    last = math.nextafter(d, -out) if open_ else d
    beyond = math.nextafter(last, out)
    far = Fraction(2 ** 1024) * (1 if side == "high" else -1)  # where doubles overflow
    mid = (Fraction(last) + (far if math.isinf(beyond) else Fraction(beyond))) / 2
    even = struct.unpack("<q", struct.pack("<d", last))[0] % 2 == 0
    return mid, not even


def _spelling_ok(text: str, integer: bool) -> bool:
    """Whether `text` starts a spelling -?(0|[1-9][0-9]*)(.[0-9]+)? (no fraction for
    integers) within the digit limit."""
    body = text[1:] if text.startswith("-") else text
    whole, dot, frac = body.partition(".")
    if "-" in body or (dot and (integer or not whole)) or "." in frac:
        return False
    if not all(c in _DIGITS for c in whole + frac):
        return False
    if (len(whole) > 1 and whole[0] == "0") or len(whole) > MAX_WHOLE_DIGITS:
        return False
    return not dot or len(frac) + (0 if whole == "0" else len(whole)) <= MAX_DIGITS


def number_complete(text: str, bounds: NumberBounds) -> bool:
    """Whether `text` is a whole number spelling whose value lies within the bounds."""
    body = text[1:] if text.startswith("-") else text
    if not body or body.endswith(".") or not _spelling_ok(text, bounds.integer):
        return False
    interval = bounds.decimal if "." in body else bounds.exact
    return interval.admits(Fraction(text))


def number_prefix_ok(text: str, bounds: NumberBounds) -> bool:
    """Whether some continuation of `text` is a whole spelling within the bounds."""
    if not _spelling_ok(text, bounds.integer):
        return False
    negative = text.startswith("-")
    body = text[1:] if negative else text
    if not body or body.endswith("."):  # the next character decides
        return any(number_prefix_ok(text + c, bounds) for c in ("-" if not text else "")
                   + _DIGITS)
    exact = bounds.exact.magnitudes(negative)
    decimal = bounds.decimal.magnitudes(negative)
    if "." in body:  # every continuation lies in [x, x + 10^-k), on a grid of the last digit
        whole, _, frac = body.partition(".")
        digits = MAX_DIGITS - (0 if whole == "0" else len(whole))
        x = Fraction(body)
        return _grid_hits(x, Fraction(1, 10 ** digits), x + Fraction(1, 10 ** len(frac)),
                          decimal)
    start = int(body)
    if start == 0:  # 0 itself, or 0.xxx
        return exact.admits(Fraction(0)) or (not bounds.integer and _grid_hits(
            Fraction(0), Fraction(1, 10 ** MAX_DIGITS), Fraction(1), decimal))
    highs = [v for v in (exact.high, decimal.high) if v is not None]
    top = max(highs) if highs else Fraction(10 ** MAX_WHOLE_DIGITS)
    # j more integer digits reach [start 10^j, (start + 1) 10^j): below a lower bound of D
    # digits while len(body) + j < D, so those are skipped (a bound of 1e300 is 300 steps).
    # D from the bit length, rounded down (str() refuses ints past 4,300 digits).
    lows = [int(v) for v in (exact.low, decimal.low) if v is not None and v >= 1]
    digits_low = int((min(lows).bit_length() - 1) * 0.30102999) + 1 if lows else 0
    j = max(0, digits_low - len(body) - 1)
    while start * 10 ** j <= top and len(body) + j <= MAX_WHOLE_DIGITS:
        low, end = Fraction(start * 10 ** j), Fraction((start + 1) * 10 ** j)
        if _grid_hits(low, Fraction(1), end, exact):
            return True
        digits = MAX_DIGITS - len(body) - j  # fraction digits left after them
        if not bounds.integer and digits > 0 and _grid_hits(
                low, Fraction(1, 10 ** digits), end, decimal):
            return True
        j += 1
    return False


def _grid_hits(first: Fraction, step: Fraction, end: Fraction, allowed: Interval) -> bool:
    """Whether some first + i * step (i >= 0) below `end` lies in `allowed` (magnitudes)."""
    point = first
    if allowed.low is not None and allowed.low >= first:
        point = first + math.ceil((allowed.low - first) / step) * step
        if allowed.low_open and point == allowed.low:
            point += step
    return point < end and allowed.admits(point)


# -- strings of a format -------------------------------------------------------------------

def format_scan(fmt: str, text: str) -> int:
    """-1 when no continuation of `text` is a valid string of format `fmt`, 1 when `text` is
    one (no format here lets a valid string go on), else 0."""
    if fmt == "date":
        return _date(text)
    if fmt == "time":
        return _time(text)
    if fmt == "date-time":
        if _date(text[:10]) < 0:
            return -1
        if len(text) <= 10:
            return 0
        if text[10] != "T":
            return -1
        return _time(text[11:])
    return _template(text, "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx")  # uuid


def _template(text: str, template: str) -> int:
    """Fixed-width text: "d" a digit, "x" a hex digit, anything else itself."""
    if len(text) > len(template):
        return -1
    for c, t in zip(text, template[:len(text)], strict=True):
        if not (c in _DIGITS if t == "d" else c in _HEX if t == "x" else c == t):
            return -1
    return 1 if len(text) == len(template) else 0


def _days_in_month(year: int, month: int) -> int:
    if month == 2:
        return 29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28
    return 30 if month in (4, 6, 9, 11) else 31


def _date(t: str) -> int:
    """RFC 3339 full-date, YYYY-MM-DD, year 0001 or later (Python's dates start there)."""
    shape = _template(t, "dddd-dd-dd")
    if shape < 0 or t[:4] == "0000" or (len(t) > 5 and t[5] not in "01"):
        return -1
    if len(t) >= 7:
        month = int(t[5:7])
        if not 1 <= month <= 12:
            return -1
        if len(t) >= 9:
            last = _days_in_month(int(t[:4]), month)
            if int(t[8]) > last // 10 or (len(t) == 10 and not 1 <= int(t[8:]) <= last):
                return -1
    return shape


def _clock(t: str, template: str) -> int:
    """HH:MM or HH:MM:SS: hours to 23, minutes and seconds to 59."""
    shape = _template(t, template)
    if shape < 0 or (t and t[0] not in "012") or (len(t) >= 2 and int(t[:2]) > 23):
        return -1
    if any(len(t) > i and t[i] not in "012345" for i in (3, 6)):
        return -1
    return shape


def _time(t: str) -> int:
    """RFC 3339 full-time: HH:MM:SS, a fraction of up to 6 digits, then Z or +HH:MM / -HH:MM."""
    if _clock(t[:8], "dd:dd:dd") < 0:
        return -1
    if len(t) <= 8:
        return 0
    rest = t[8:]
    if rest[0] == ".":
        digits = len(rest) - 1 - len(rest[1:].lstrip(_DIGITS))
        rest = rest[1 + digits:]
        if digits > MAX_SECOND_DIGITS or (rest and not digits):
            return -1
        if not rest:
            return 0
    if rest[0] == "Z":
        return 1 if len(rest) == 1 else -1
    if rest[0] not in "+-":
        return -1
    return _clock(rest[1:], "dd:dd")


"""Trace times: JSON numbers of microseconds -> exact int64 nanoseconds, the same on every decoder.

The rule: a `ts` or `dur` is the exact decimal value of its JSON text (any number of digits, any
exponent) times 1000, rounded to the nearest integer, ties to even. Three fractional digits (what
Kineto writes) are therefore always exact, at any magnitude up to the bound; more digits round to the
nearest nanosecond (`0.0005` -> 0, `0.0015` -> 2, `1.00049` -> 1000); ts and dur are rounded each on
its own, so where both have sub-ns digits an end (ts + dur) may be 1 ns from the rounded exact end.
|value| >= 2**53 us (`checks.MAX_ABS_US`, 285 years; int64 ns overflow at 9.2e15 us) is no time:
`UNREPRESENTABLE`, and `checks.check_events` drops the event.

No double is involved on any path: an epoch-scale timestamp (1732662400123456.789 us is 2**50.6 us)
has a double step of 0.25 us, and even Kineto's monotonic clock past 2**42 us (51 days of uptime) is
not exact in a double for a text with more than 3 decimals; a double cannot tell which text it came
from. The compiled scanner (`_kineto_fast.c`, `number_ns`) rounds from the digits it scans; the
msgspec path decodes `ts`/`dur` as raw JSON slices and converts them here (`from_texts`), vectorized.
`tests/tracelens/test_timestamps.py` checks both against a Decimal reference.
"""

from __future__ import annotations

import decimal
import re

import numpy as np

from .checks import MAX_ABS_US, UNREPRESENTABLE

_BOUND_US = int(MAX_ABS_US)  # 2**53: the integer part of |value| must be below it
# the digits `from_texts` gathers, by their offset from the decimal point, and their weights
_COLUMNS = np.array([*range(-16, 0), 1, 2, 3, 4])
_WHOLE_WEIGHTS = 10 ** np.arange(15, -1, -1, dtype=np.int64)  # us
_FRACTION_WEIGHTS = np.array([100, 10, 1], dtype=np.int64)  # ns
_NUMBER = re.compile(r"(-?)(\d+)(?:\.(\d+))?(?:[eE]([+-]?\d+))?")
_NS = decimal.Decimal("0.001")
_CONTEXT = decimal.Context(prec=40, rounding=decimal.ROUND_HALF_EVEN)  # 16 + 3 digits are the most a result has


def from_text(text: bytes | str) -> int:
    """One JSON number's text (microseconds) -> nanoseconds by the rule above (`UNREPRESENTABLE` past
    the bound). The scalar path, for exponent forms and long texts. ValueError if it is no JSON number."""
    if not isinstance(text, str):
        text = bytes(text).decode("ascii", "replace")
    m = _NUMBER.fullmatch(text)
    if m is None:
        raise ValueError(f"not a number: {text[:40]!r}")
    sign, whole, frac, exp = m.groups()
    digits = (whole + (frac or "")).lstrip("0")
    if not digits:
        return 0
    # an exponent of more than 7 digits puts any nonzero value past the bound or below 0.5 ns
    e = (int(exp) if len(exp.lstrip("+-")) <= 7 else (-1 if exp[0] == "-" else 1) * 10**7) if exp else 0
    d = decimal.Decimal((sign == "-", tuple(map(int, digits)), e - len(frac or "")))
    if d.adjusted() >= 16 or abs(d) >= _BOUND_US:  # (|d| >= 10**16: no digits expanded for a huge exponent)
        return UNREPRESENTABLE
    if d.adjusted() < -5:  # |d| < 10**-5 us = 0.01 ns
        return 0
    return int(d.quantize(_NS, context=_CONTEXT).scaleb(3, context=_CONTEXT))


def from_texts(texts: list, absent: int) -> np.ndarray:
    """Raw JSON values (bytes or buffers, e.g. `msgspec.Raw`) -> int64 ns by the rule above. An empty
    text (the key is not there) or `null` gives `absent`; another value that is no number (a string,
    `true`, an array) raises ValueError naming it.

    Vectorized for the plain forms (`-?digits(.digits)?`, as Kineto writes them), `from_text` for the
    others: the texts' bytes are joined once and each text's digits gathered into fixed columns by
    their place around the decimal point (16 integer digits, 3 fraction digits, the rounding digit), so
    the value is two small integer products; nothing is parsed per text in Python but ties past the
    4th decimal."""
    n = len(texts)
    lens = np.fromiter(map(len, texts), dtype=np.int64, count=n)
    if not lens.all():  # keys that are not there
        out = np.full(n, absent, dtype=np.int64)
        present = np.flatnonzero(lens)
        if len(present):
            out[present] = from_texts([texts[i] for i in present.tolist()], absent)
        return out
    if not n:
        return np.empty(0, dtype=np.int64)
    blob = b"".join(texts)
    a = np.frombuffer(blob, dtype=np.uint8)
    ends = np.cumsum(lens)
    starts = ends - lens
    point = ends.copy()  # where the '.' is, or the end
    dots = np.flatnonzero(a == ord("."))
    point[np.searchsorted(ends, dots, side="right")] = dots
    first = a[starts]
    neg = first == ord("-")
    first_digit = starts + neg
    # one at a time: an exponent (or a value that is no number), no integer digit, more than 16 of them
    other = np.flatnonzero(((a < ord("0")) | (a > ord("9"))) & (a != ord(".")) & (a != ord("-")))
    scalar = np.zeros(n, dtype=bool)
    scalar[np.searchsorted(ends, other, side="right")] = True
    scalar |= (point - first_digit < 1) | (point - first_digit > 16)
    idx = point[:, None] + _COLUMNS
    inside = (idx >= first_digit[:, None]) & (idx < ends[:, None])
    d = np.where(inside, a[np.clip(idx, 0, len(a) - 1)] - ord("0"), 0).astype(np.int64)
    whole = d[:, :16] @ _WHOLE_WEIGHTS
    over = whole >= _BOUND_US
    ns = np.where(over, 0, whole) * 1000 + d[:, 16:19] @ _FRACTION_WEIGHTS
    rounding = d[:, 19]
    up = rounding > 5
    for i in np.flatnonzero((rounding == 5) & ~scalar).tolist():  # a tie unless a later digit is nonzero
        up[i] = bool(ns[i] & 1) or bool(blob[point[i] + 5 : ends[i]].strip(b"0"))
    ns += up
    ns = np.where(neg, -ns, ns)
    ns[over] = UNREPRESENTABLE
    for i in np.flatnonzero(scalar).tolist():
        text = bytes(texts[i])
        if text == b"null":
            ns[i] = absent
        elif text[:1] in b"-0123456789":
            ns[i] = from_text(text)
        else:
            raise ValueError(f"{_cut(text)}, not a number")
    return ns


def _cut(text: bytes) -> str:
    return repr(text[:40].decode("utf-8", "replace") + ("..." if len(text) > 40 else ""))

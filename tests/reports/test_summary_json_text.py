"""summary.json's text (`reports.artifacts.summary_json`): what ``json.dumps(doc, indent=2)`` writes, except that a
list of more than LONG_LIST items is written a record a line (or on one line): the same values either way, checked by
parsing both; a short document byte for byte."""

from __future__ import annotations

import json
import math

import pytest

from reports.artifacts import LONG_LIST, summary_json


def _same(x, y) -> bool:
    if isinstance(x, float) and math.isnan(x):
        return isinstance(y, float) and math.isnan(y)
    if isinstance(x, dict):
        return list(x) == list(y) and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, list):
        return isinstance(y, list) and len(x) == len(y) and all(_same(p, q) for p, q in zip(x, y))
    return type(x) is type(y) and x == y


def test_a_document_without_long_lists_is_indent_2_byte_for_byte():
    doc = {"a": 1, "b": [1, 2, {"c": [3] * 5}], "d": "µs \\ \"q\"", "e": float("nan"), "f": None, "g": (1, 2),
           "h": [{"step": i, "us": i / 3} for i in range(LONG_LIST)], "i": {}, "j": [], "k": -0.0, "l": 1e-7}
    assert summary_json(doc) == json.dumps(doc, indent=2)


def test_long_lists_hold_the_same_values_a_record_a_line():
    steps = [{"step": i, "us": i / 7, "ok": i % 2 == 0, "ranks": [0, 1], "t": "xµ", "n": float("nan") if i == 3 else None}
             for i in range(LONG_LIST + 500)]
    doc = {"ranks": [{"rank": 0, "steps": steps, "ids": list(range(LONG_LIST + 1)), "names": ["a\"b"] * 2000}],
           "tail": {"k": [1, 2]}, "nested": [[1, 2]] * 1500, "tuple": tuple(range(LONG_LIST + 1)),
           # a string shaped like the writer's placeholder: never taken for one
           "trap": "\x00summary.json long list 0 0000000000000000\x00"}
    text = summary_json(doc)
    assert _same(json.loads(text), json.loads(json.dumps(doc)))
    lines = text.splitlines()
    first = next(k for k, ln in enumerate(lines) if ln.lstrip().startswith('{"step": 0,'))
    assert all(json.loads(lines[first + k].strip().rstrip(","))["step"] == k for k in range(len(steps)))
    assert sum(ln.lstrip().startswith('"ids": [0, 1, 2') for ln in lines) == 1  # numbers: one line


def test_what_json_cannot_encode_raises_what_json_raises():
    with pytest.raises(TypeError, match="not JSON serializable"):
        summary_json({"x": object()})
    with pytest.raises(TypeError, match="not JSON serializable"):
        summary_json({"x": [object()] * (LONG_LIST + 1)})

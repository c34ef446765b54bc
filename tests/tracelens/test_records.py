"""`tracelens.records.Records` (summary.json's per-step lists held as columns) against the plain data it stands for:
its dicts are what a dict per row built from the columns' Python values gives (NaN as None), its JSON text is the json
module's own encoding of each of those dicts, line for line, and summary.json's text with `Records` in it is the text
of the same document with plain lists. `round3_array` is `_num` per value. The analysis' summary holds plain lists
for the API and `Records` only when the writer asks (`columnar=True`), equal either way."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reports.artifacts import LONG_LIST, summary_json
from tracelens.analyzer import _num
from tracelens.numbers import round3_array
from tracelens.records import CHUNK, Records, plain

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _reference_dicts(cols: dict) -> list[dict]:
    """The records a row at a time from the columns, Python value by value (the truth `Records` must equal)."""
    n = len(next(iter(cols.values()))) if cols else 0
    out = []
    for i in range(n):
        d = {}
        for k, v in cols.items():
            x = v[i]
            if isinstance(x, np.generic):
                x = x.item()
            if isinstance(x, float) and math.isnan(x):
                x = None
            d[k] = x
        out.append(d)
    return out


def _same(a, b) -> bool:  # (equal, and -0.0 stays -0.0)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        if math.isnan(a):  # (a NaN inside a list value stays NaN)
            return type(b) is float and math.isnan(b)
        return type(b) is float and a == b and math.copysign(1, a) == math.copysign(1, b)
    return type(a) is type(b) and a == b


_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0.0, -0.0, 1.76, 1e-7, 1e16, 1e22, 5e-324, 2.675, 123456.789]))


@st.composite
def _columns(draw):
    n = draw(st.integers(0, 40))
    cols: dict = {}
    for j in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["f", "i", "u", "b", "lists", "objects"]))
        key = draw(st.sampled_from(["step", "span_us", "a{b}", 'q"x', "µs", f"k{j}"]))
        if key in cols:
            continue
        if kind == "f":
            cols[key] = np.array(draw(st.lists(_FLOATS, min_size=n, max_size=n)), dtype=np.float64)
        elif kind == "i":
            cols[key] = np.array(draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=n, max_size=n)), dtype=np.int64)
        elif kind == "u":
            cols[key] = np.array(draw(st.lists(st.integers(0, 255), min_size=n, max_size=n)), dtype=np.uint8)
        elif kind == "b":
            cols[key] = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
        elif kind == "lists":
            cols[key] = draw(st.lists(st.lists(st.integers(0, 7), max_size=3), min_size=n, max_size=n))
        else:
            cols[key] = draw(st.lists(st.one_of(st.none(), st.text(max_size=3), st.integers(), st.booleans(),
                                                st.lists(st.one_of(st.integers(), st.floats(), st.booleans()), max_size=2)),
                                      min_size=n, max_size=n))
    return cols


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(_columns(), st.sampled_from(["", "  ", "        "]))
def test_records_are_the_rows_and_their_json_is_the_json_modules(cols, pad):
    r = Records(cols)
    want = _reference_dicts(cols)
    assert len(r) == len(want)
    assert _same(r.to_list(), want)
    assert r == want and (not want or r != want[:-1])
    if want:
        assert _same(r[0], want[0]) and _same(r[-1], want[-1]) and _same(r[1:3], want[1:3])
    enc = json.JSONEncoder()
    assert ",\n".join(r.json_lines(pad)) == ",\n".join(pad + enc.encode(d) for d in want)


def test_json_lines_chunks_join_to_every_record():
    n = 2 * CHUNK + 17
    rng = np.random.default_rng(3)
    cols = {"step": np.arange(n), "span_us": np.round(rng.random(n) * 100, 3), "ok": rng.random(n) < 0.5,
            "ranks": [[0, 1] if i % 3 else [2] for i in range(n)]}
    r = Records(cols)
    chunks = list(r.json_lines("  "))
    assert len(chunks) == 3
    enc = json.JSONEncoder()
    assert ",\n".join(chunks) == ",\n".join("  " + enc.encode(d) for d in _reference_dicts(cols))


def test_records_reject_ragged_columns_and_non_string_keys():
    with pytest.raises(ValueError, match="column 'b' has 2 values"):
        Records({"a": np.zeros(3), "b": [1, 2]})
    with pytest.raises(TypeError, match="key must be a string"):
        Records({1: np.zeros(3)})


def test_summary_json_writes_records_as_their_lists():
    rng = np.random.default_rng(5)
    n = LONG_LIST + 300
    long = Records({"step": np.arange(n), "us": round3_array(rng.random(n) * 1e4),
                    "nan": np.where(np.arange(n) % 7 == 0, np.nan, 1.5), "steady": np.arange(n) % 2 == 0})
    short = Records({"step": np.arange(3), "us": np.array([0.5, -0.0, np.inf])})
    empty = Records({"step": np.zeros(0, dtype=np.int64)})
    doc = {"ranks": [{"rank": 0, "steps": long}, {"rank": 1, "steps": short}, {"rank": 2, "steps": empty}],
           "critical_path": {"steps": long, "span_us": 1.0}}
    assert summary_json(doc) == summary_json(plain(doc))
    assert summary_json({"s": short, "e": empty}) == json.dumps(plain({"s": short, "e": empty}), indent=2)


def test_round3_array_is_num_per_value():
    rng = np.random.default_rng(11)
    vals = np.concatenate([rng.integers(0, 10**12, 5_000) / 1e3, rng.random(5_000) * 1e6,
                           np.array([np.nan, np.inf, -np.inf, -0.0, 2.675, 0.0005, -1.0005, 2.0**43 + 0.5, 5e-324])])
    got = round3_array(vals).tolist()
    for v, g in zip(vals.tolist(), got):
        w = _num(v)
        assert (w is None and math.isnan(g)) or (g == w and math.copysign(1, g) == math.copysign(1, w)), v


def test_the_summary_is_plain_for_the_api_and_columnar_for_the_writer():
    import tracelens

    a = tracelens.analyze(tracelens.load(str(FIXTURES / "h200_nccl_2rank")))
    doc = a.summary()
    steps = doc["ranks"][0]["steps"]
    assert type(steps) is list and steps and all(type(s) is dict for s in steps)
    assert type(doc["critical_path"]["steps"]) is list
    json.dumps(doc)  # plain data throughout

    col, _, _ = a.summary_with(None, columnar=True)
    assert isinstance(col["ranks"][0]["steps"], Records) and isinstance(col["critical_path"]["steps"], Records)
    assert _same(plain(col), doc)
    assert summary_json(col) == summary_json(doc)


def test_list_values_are_given_out_as_copies_and_int_lists_written_as_json():
    ranks = [[0, 1], [2], []]
    r = Records({"step": np.arange(3), "ranks": ranks})
    first = r.to_list()
    first[0]["ranks"].append(9)
    assert ranks[0] == [0, 1] and r[0]["ranks"] == [0, 1]
    # a list holding a bool or a float is not a list of ints: the json module writes it (true, NaN)
    mixed = Records({"v": [[1, True], [float("nan")], [2**70]]})
    assert ",\n".join(mixed.json_lines()) == ",\n".join(json.JSONEncoder().encode(d) for d in mixed.to_list())


def test_columns_of_one_value_fold_into_the_literal_and_zeros_keep_their_sign():
    enc = json.JSONEncoder()
    for cols in ({"a": np.zeros(5), "b": np.arange(5), "c": np.full(5, -0.0), "d": np.ones(5, dtype=bool)},
                 {"z": np.array([0.0, -0.0, 0.0, -0.0]), "k": np.full(4, 7)},
                 {"only": np.full(3, np.nan)}, {"x": np.array([-0.0, -0.0]), "y": np.array([0.0, 0.0])}):
        r = Records(cols)
        assert ",\n".join(r.json_lines("  ")) == ",\n".join("  " + enc.encode(d) for d in _reference_dicts(cols))


def test_plain_copies_only_what_holds_records():
    inner = {"a": [1, 2], "b": {"c": 3}}
    doc = {"kept": inner, "steps": Records({"step": np.arange(2)}), "list": [inner, 4]}
    out = plain(doc)
    assert out["kept"] is inner and out["list"] is doc["list"]  # nothing inside to replace: the same objects
    assert out["steps"] == [{"step": 0}, {"step": 1}] and type(out["steps"]) is list and out is not doc
    assert plain(inner) is inner

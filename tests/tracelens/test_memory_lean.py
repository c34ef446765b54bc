"""The memory-lean loader and lookups (issue 20, bounded memory).

- `trace.narrow_args` stores the events table's numeric arg columns in the narrowest type that holds their
  values: the values equal the raw JSON's, the type is the narrowest one the raw values fit (computed here
  with the standard library and numpy's integer limits), and a column that needs int64 / float64 keeps it.
- Every analysis output on real fixtures is identical, table by table (values, dtypes, index) and in
  summary.json, to the analysis of the same trace with the events table widened back to int64 / float64
  (the loader's table before narrowing: the reference).
- `categories.positions` gives what `Index.get_indexer` gives, without building pandas' hash table.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import tracelens
from tracelens import categories as C
from tracelens.io.schema import ARG_FIELDS
from tracelens.trace import Trace, narrow_args

from ..conftest import FIXTURES, MI250, MOE_LOOP, raw_events

from ._narrow import narrowest

EP2_L0 = FIXTURES / "h200_ep2_run" / "L0_loop"
PP2_1F1B = FIXTURES / "h200_pp2_run" / "1f1b"
CPU_TINY = FIXTURES / "cpu_tiny" / "rank0.json.gz"

INT_ARGS = [c for c, (_, kind) in ARG_FIELDS.items() if kind == "int"]
FLOAT_ARGS = [c for c, (_, kind) in ARG_FIELDS.items() if kind == "float"]


def test_narrowed_columns_hold_the_raw_values_in_the_narrowest_type():
    path = EP2_L0 / "traces" / "rank0.json.gz"
    timed = [e for e in raw_events(path) if e.get("ph") in ("X", "i")]
    ev = tracelens.load(str(path), cache=False).events
    assert len(ev) == len(timed)
    narrowed = 0
    for col in INT_ARGS:
        key = ARG_FIELDS[col][0]
        raw = [v if type(v) is int else -1 for v in ((e.get("args") or {}).get(key) for e in timed)]
        assert ev[col].dtype == narrowest(raw), col
        assert sorted(ev[col].to_numpy().tolist()) == sorted(raw), col
        narrowed += ev[col].dtype != np.int64
    assert narrowed >= 10  # most arg columns are absent or small on a real trace
    assert ev["correlation"].dtype == np.int32 and ev["stream"].dtype == np.int8  # ids ~1e5, streams < 128
    for col in FLOAT_ARGS:
        key = ARG_FIELDS[col][0]
        raw = [(e.get("args") or {}).get(key) for e in timed]
        assert all(v is None for v in raw)  # no op of this trace carries flops: the column is all absent
        assert ev[col].dtype == np.float32 and ev[col].isna().all()
    for col in ("ts", "dur", "pid", "tid"):  # read everywhere: never narrowed
        assert ev[col].dtype == np.int64


def test_narrow_args_keeps_what_does_not_fit():
    t = pa.table({
        "bytes": pa.array([-1, 2**40], type=pa.int64()),  # needs int64
        "stream": pa.array([-1, 300], type=pa.int64()),  # int16
        "seq": pa.array([-1, -1], type=pa.int64()),  # int8
        "correlation": pa.array([-1, 2**31 - 1], type=pa.int64()),  # int32, at its limit
        "external_id": pa.array([-(2**31) - 1, 5], type=pa.int64()),  # below int32: int64
        "flops": pa.array([float("nan"), 1.5]),  # a value: float64 kept
        "ts": pa.array([1, 2**40], type=pa.int64()),  # not an arg column: untouched
    })
    out = narrow_args(t)
    assert [out.schema.field(c).type for c in out.column_names] == [
        pa.int64(), pa.int16(), pa.int8(), pa.int32(), pa.int64(), pa.float64(), pa.int64()]
    for c in t.column_names:
        a, b = t[c].to_numpy(), out[c].to_numpy()
        assert np.array_equal(a, b.astype(a.dtype), equal_nan=a.dtype.kind == "f"), c
    nan_only = narrow_args(pa.table({"flops": pa.array([float("nan")] * 3)}))
    assert nan_only.schema.field("flops").type == pa.float32()
    empty = pa.table({"bytes": pa.array([], type=pa.int64())})
    assert narrow_args(empty).schema.field("bytes").type == pa.int64()


def _widened(trace: Trace) -> Trace:
    """The trace with its events table as the loader gave it before narrowing (int64 / float64 args)."""
    ev = trace.events.copy()
    for c in INT_ARGS:
        ev[c] = ev[c].astype(np.int64)
    for c in FLOAT_ARGS:
        ev[c] = ev[c].astype(np.float64)
    return Trace(events=ev, flows=pd.DataFrame(), threads=trace.threads, ranks=trace.ranks,
                 warnings=list(trace.warnings), load_issues=trace.load_issues, run_status=trace.run_status)


def _same(x, y, where: str) -> None:
    if isinstance(x, pd.DataFrame):
        pd.testing.assert_frame_equal(x, y, check_exact=True, obj=where)
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            _same(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, list):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _same(u, v, f"{where}[{i}]")
    elif isinstance(x, float) and math.isnan(x):
        assert isinstance(y, float) and math.isnan(y), where
    else:
        assert x == y, where


@pytest.mark.parametrize("path", [EP2_L0, PP2_1F1B, MOE_LOOP, MI250, CPU_TINY], ids=lambda p: p.name)
def test_lean_analysis_equals_the_wide_reference(path):
    lean = tracelens.load(str(path), cache=False)
    assert any(lean.events[c].dtype != np.int64 for c in INT_ARGS)
    wide = _widened(lean)
    a, b = tracelens.analyze(lean), tracelens.analyze(wide)
    for name in ("gpu", "gpu_window", "steps", "timeline", "timeline_all", "step_timeline"):
        _same(getattr(a, name), getattr(b, name), name)
    ids = ("correlation", "external_id")  # the tree keeps the events table's types of these: values compared
    assert all(np.array_equal(a.tree[c].to_numpy(), b.tree[c].to_numpy()) for c in ids)
    _same(a.tree.drop(columns=list(ids)), b.tree.drop(columns=list(ids)), "tree")
    _same(a.tables(), b.tables(), "tables")
    _same(a.health(), b.health(), "health")
    _same(a.comm_instances(), b.comm_instances(), "comm_instances")
    sa, sb = json.loads(json.dumps(a.summary(), default=str)), json.loads(json.dumps(b.summary(), default=str))
    _same(sa, sb, "summary")
    assert a.gpu.empty or all(a.gpu[c].dtype == np.int64 for c in ("correlation", "stream", "bytes", "device"))
    # the tree keeps the events table's types (narrow ids) and int32 links (every label < 2**31)
    assert all(a.tree[c].dtype == lean.events[c].dtype for c in ("correlation", "external_id", "pid", "tid"))
    assert all(a.tree[c].dtype == np.int32 for c in ("parent", "inner_op", "outer_op", "step"))
    # the loader puts the tree's events first, so the tree's columns are views of the events' (no copy)
    assert isinstance(a.tree.index, pd.RangeIndex) and a.tree.index.start == 0
    for c in ("ts", "dur", "pid", "tid", "correlation", "external_id", "rank"):
        assert np.shares_memory(a.tree[c].to_numpy(), lean.events[c].to_numpy()), c
    assert np.shares_memory(a.tree["name"].array.codes, lean.events["name"].array.codes)


def test_positions_match_get_indexer():
    rng = np.random.default_rng(7)
    sorted_labels = np.unique(rng.integers(0, 10_000, 3_000))
    unsorted = rng.permutation(sorted_labels)
    queries = np.concatenate([rng.integers(-5, 10_010, 2_000), sorted_labels[:50], [-1, 10**12]])
    for index in (pd.RangeIndex(0, 5_000), pd.RangeIndex(100, 9_000, 3), pd.Index(sorted_labels),
                  pd.Index(unsorted), pd.Index(np.array([], dtype=np.int64)), pd.RangeIndex(0, 0)):
        got = C.positions(index, queries)
        want = index.get_indexer(queries)
        assert np.array_equal(got, want), repr(index)[:60]
        small = queries[np.abs(queries) < 2**31].astype(np.int32)  # the tree's int32 links
        assert np.array_equal(C.positions(index, small), index.get_indexer(small)), repr(index)[:60]


def test_idle_gaps_object_columns_hold_the_same_values():
    from tracelens.analysis import host as H

    a = tracelens.analyze(tracelens.load(str(EP2_L0), cache=False))
    text, lean = H.idle_gaps(a), H.idle_gaps(a, text_columns=False)
    assert len(text) == len(lean) > 100 and list(text.columns) == list(lean.columns)
    for c in text.columns:
        assert text[c].tolist() == lean[c].tolist(), c
    assert all(lean[c].dtype == object for c in ("cause", "next_op", "next_top_op"))
    # the gaps end where a GPU event of their rank starts, and each starts no earlier than it ends
    assert (lean["end_ns"] > lean["start_ns"]).all()


def test_roofline_owner_grouping_equals_one_groupby(monkeypatch):
    """roofline groups its owner rows on integer ids with numpy (bounded memory: no pandas grouping temporaries);
    the result equals pandas' one-pass groupby of the same rows, on every prefix of them."""
    from tracelens.analysis import roofline as R

    seen = []
    grouped = R._group_owners
    monkeypatch.setattr(R, "_group_owners", lambda cols, keys: seen.append((cols, keys)) or grouped(cols, keys))
    tracelens.analyze(tracelens.load(str(EP2_L0), cache=False)).roofline()
    (cols, keys), = seen
    n = len(cols["rank"])
    assert n > 200
    for rows in (1, 7, 160, 700, n):
        sub = {k: v[:rows] for k, v in cols.items()}
        one = pd.DataFrame(sub).groupby(keys, sort=False).agg(
            count=("dur_ns", "size"), kernels=("kernels", "sum"), dur_ns=("dur_ns", "sum")).reset_index()
        assert one["count"].sum() == rows and (rows < 160 or len(one) < rows)  # groups do merge rows
        pd.testing.assert_frame_equal(grouped(sub, keys), one, check_exact=True)

"""Profiler-step markers ("ProfilerStep#N") found over a names' dictionary at once (`categories.step_marker_numbers`)
and left out of `categories.map_strings`' per-name tests where the caller gives the test's value on them
(`on_markers`): checked against the per-name Python path (the reference: every name through fn), on names that look
like markers but are not."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tracelens import categories as C

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# names that look like step markers but are not exactly "ProfilerStep#<1-18 ASCII digits>" (some of them still
# STEP_RE matches: their number must then come from the per-name path)
LOOKALIKES = [
    "ProfilerStep#x", "ProfilerStep#12 ", " ProfilerStep#12", "ProfilerStep#", "profilerstep#12", "PROFILERSTEP#7",
    "ProfilerStep#12\n", "ProfilerStep#12a", "ProfilerStep#12.5", "ProfilerStep#12_3", "XProfilerStep#1",
    "ProfilerStep#\u0663\u0664", "ProfilerStep#1\u0663", "ProfilerStep#-3", "ProfilerStep#+3", "ProfilerStep# 3",
    "ProfilerStep#1234567890123456789", "ProfilerStep#99999999999999999999999", "## step 5", "##step#6",
    "ProfilerStep#3/inner", "Profiler\u017ftep#4", "ProfilerStep\uff03 5", "", "nccl:send 0->1", "nccl:recv 1<-0",
    "cudaLaunchKernel", "cuLaunchKernel", "pipeline/F/s0/mb1", "aten::mm", "aten::mm.out", "ProfilerStep",
]
MARKERS = ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#007", "ProfilerStep#123456789012345678",
           "ProfilerStep#999999999999999999"] + [f"ProfilerStep#{i}" for i in range(40, 140)]


def _reference_numbers(names):
    return [int(s[len("ProfilerStep#"):]) if re.fullmatch(r"ProfilerStep#[0-9]{1,18}", s, re.ASCII) else -1 for s in names]


def _column(names, rows, dtype="str"):
    cats = pd.Index(names, dtype=dtype)
    return pd.Series(pd.Categorical.from_codes(np.asarray(rows, dtype=np.int64), categories=cats))


def test_step_marker_numbers_against_the_names():
    names = LOOKALIKES[:-9] + MARKERS + LOOKALIKES[-9:]
    cats = pd.Index(names, dtype="str")
    got = C.step_marker_numbers(cats)
    assert got.dtype == np.int64
    assert got.tolist() == _reference_numbers(names)
    for s, n in zip(names, got.tolist()):
        if n >= 0:  # a marker's number is the one STEP_RE reads
            assert C.step_number(s) == n
    assert C.step_marker_numbers(cats) is got  # kept for the same categories
    assert C.step_marker_numbers(pd.Index([], dtype="str")).tolist() == []
    assert C.step_marker_numbers(pd.Index(["ProfilerStep#1", 3], dtype=object)).tolist() == [-1, -1]  # not strings


@pytest.mark.parametrize("dtype", ["str", object])
@pytest.mark.parametrize("fn, on_markers, out_dtype", [
    (C.step_number, C.STEP_NUMBER, np.int64),
    (lambda s: bool(C.STEP_RE.match(s)), True, bool),
    (lambda s: s.startswith(("nccl:send", "nccl:recv")), False, bool),
    (lambda s: len(s) % 3 == 0 and not s.startswith("ProfilerStep#"), False, bool),
])
def test_map_strings_on_markers_equals_every_name_through_fn(fn, on_markers, out_dtype, dtype):
    names = MARKERS[:50] + LOOKALIKES + MARKERS[50:]
    if on_markers is C.STEP_NUMBER:  # (a number past int64: both paths raise, below)
        names.remove("ProfilerStep#99999999999999999999999")
    rng = np.random.default_rng(0)
    rows = rng.integers(-1, len(names), 3000)
    rows[: len(names)] = np.arange(len(names))
    for sub in (rows, rows[rows != 3], rows[:0], np.full(5, -1)):
        col = _column(names, sub, dtype)
        got = C.map_strings(col, fn, dtype=out_dtype, on_markers=on_markers)
        expect = np.array([fn("" if pd.isna(v) else str(v)) for v in col], dtype=out_dtype)  # the per-row path
        assert got.dtype == expect.dtype
        assert got.tolist() == expect.tolist()


def test_map_strings_on_markers_does_not_call_fn_on_markers():
    names = MARKERS + ["aten::mm", "ProfilerStep#x"]
    col = _column(names, np.arange(len(names)))
    seen = []
    C.map_strings(col, lambda s: seen.append(s) or False, on_markers=False)
    assert sorted(seen) == ["", "ProfilerStep#x", "aten::mm"]


def test_map_strings_step_number_past_int64_raises_on_both_paths():
    names = MARKERS + ["ProfilerStep#99999999999999999999999"]
    col = _column(names, np.arange(len(names)))
    for kw in ({}, {"on_markers": C.STEP_NUMBER}):
        with pytest.raises(OverflowError):
            C.map_strings(col, C.step_number, dtype=np.int64, **kw)


def _production_tests():
    from tracelens import perfmodels
    from tracelens.analysis import health, pipeline
    return [(health._is_launch, False), (health._is_p2p_name, False), (pipeline._is_range_name, False),
            (pipeline._is_step_name, True), (perfmodels.has_model, perfmodels.has_model_on_markers()["on_markers"])]


@pytest.mark.parametrize("k", range(5))
def test_production_tests_on_markers(k):
    """The analyses' per-name tests given with on_markers: the same values as every name through the test."""
    fn, on_markers = _production_tests()[k]
    names = MARKERS + LOOKALIKES + ["aten::addmm.out", "aten::bmm_out", "ncclDevKernel_SendRecv",
                                    "cudaGraphLaunch", "hipExtLaunchKernel", "pipeline/B/s1/mb0"]
    for n in MARKERS:
        assert fn(n) == on_markers
    col = _column(names, np.r_[np.arange(len(names)), -1, 3])
    expect = [fn("" if pd.isna(v) else str(v)) for v in col]
    assert C.map_strings(col, fn, on_markers=on_markers).tolist() == expect
    assert any(expect)  # (the names hold some the test accepts)


@pytest.mark.parametrize("values", [C.SYNC_RUNTIME, frozenset({"ProfilerStep#5", "aten::mm"}), frozenset({"", "x"}),
                                    frozenset(), frozenset({"ProfilerStep#12 ", "ProfilerStep#x"})])
@pytest.mark.parametrize("dtype", ["str", object])
def test_isin_against_per_row(values, dtype):
    names = MARKERS + LOOKALIKES + sorted(C.SYNC_RUNTIME)
    rng = np.random.default_rng(1)
    for rows in (rng.integers(-1, len(names), 500), np.arange(len(names)), np.arange(0)):
        col = _column(names, rows, dtype)
        expect = [("" if pd.isna(v) else str(v)) in values for v in col]
        got = C.isin(col, values)
        assert got.dtype == bool and got.tolist() == expect
    small = pd.Series(pd.Categorical(["cudaMemcpy", None, "a"]))
    assert C.isin(small, values).tolist() == [("cudaMemcpy" in values), ("" in values), ("a" in values)]


@pytest.mark.parametrize("dtype", ["str", object])
def test_decode_codes_against_the_list(dtype):
    names = MARKERS + LOOKALIKES
    cats = pd.Index(names, dtype=dtype)
    ref = np.asarray([str(c) for c in cats] + [""], dtype=object)
    rng = np.random.default_rng(2)
    for codes in (rng.integers(-1, len(names), 300), np.array([-1, -1]), np.array([], dtype=np.int64),
                  np.array([len(names) - 1, 0], dtype=np.int32), np.array([-2, 3])):  # (-2: the last category)
        got = C.decode_codes(cats, codes)
        assert got.dtype == object and got.tolist() == ref[codes].tolist()
        assert all(type(v) is str for v in got.tolist())
    with pytest.raises(IndexError):
        C.decode_codes(cats, np.array([len(names) + 1]))


@pytest.mark.parametrize("dtype", ["str", object])
def test_categories_with_prefix(dtype):
    names = MARKERS + LOOKALIKES + ["pipeline/F/s0/mb0", "pipeline/", "pipelin", "Pipeline/B/s0/mb1", "\u00e9pipeline/x",
                                    "pipeline/\u00e9"]
    cats = pd.Index(names, dtype=dtype)
    for prefix in ("pipeline/", "ProfilerStep#", "", "\u00e9", "zzz"):
        assert C.categories_with_prefix(cats, prefix) == [s for s in names if s.startswith(prefix)]
    assert C.categories_with_prefix(pd.Index(["pipeline/a", "b"], dtype=dtype), "pipeline/") == ["pipeline/a"]


def test_has_pipeline_data_against_every_name():
    from types import SimpleNamespace
    from tracelens.analysis import pipeline
    for extra, expect in (([], False), (["pipeline/F/s0/mb1"], True), (["pipeline/F/s0/mbx", "xpipeline/F/s0/mb1"], False),
                          (["pipeline/W/s12/mb3"], True)):
        names = [n for n in MARKERS + LOOKALIKES if not n.startswith("pipeline/")] + extra
        ev = pd.DataFrame({"name": _column(names, np.arange(len(names)))})
        trace = SimpleNamespace(events=ev)
        assert any(pipeline.RANGE_RE.match(s) for s in names) == expect  # (the reference: every name)
        assert pipeline.has_pipeline_data(trace) == expect


def _take_strings_ref(col, rows, fill=""):  # (categories.take_strings before: a new Index, get_loc on it)
    cats = col.cat.categories
    if fill not in cats:
        cats = cats.append(pd.Index([fill]))
    fill_code = cats.get_loc(fill)
    code_t = np.int32 if len(cats) < 2**31 else np.int64
    codes = np.full(len(rows), fill_code, dtype=code_t)
    ok = rows >= 0
    got = col.cat.codes.to_numpy()[C.positions(col.index, rows[ok])].astype(code_t)
    got[got < 0] = fill_code
    codes[ok] = got
    return pd.Categorical.from_codes(codes, categories=cats)


@pytest.mark.parametrize("keep_max", [None, 4])  # 4: the path of a large dictionary (no lookup table kept)
@pytest.mark.parametrize("dtype", ["str", object])
@pytest.mark.parametrize("fill", ["", "(no op)", "ProfilerStep#3", "ProfilerStep#40", "aten::addmm"])
def test_take_strings_against_a_new_index_each_call(fill, dtype, keep_max, monkeypatch):
    if keep_max is not None:
        monkeypatch.setattr(C, "LOOKUP_KEEP_MAX", keep_max)
    names = MARKERS + LOOKALIKES[:-9] + ["aten::addmm"]
    col = _column(names, np.random.default_rng(6).integers(-1, len(names), 400), dtype)
    for rows in (np.array([3, -1, 0, 399, 12]), np.arange(-1, 400), np.array([], dtype=np.int64)):
        for _ in range(2):  # (the second call: the categories kept)
            got, ref = C.take_strings(col, rows, fill), _take_strings_ref(col, rows, fill)
            assert got.categories.equals(ref.categories) and got.categories.dtype == ref.categories.dtype
            assert got.ordered == ref.ordered and got.dtype == ref.dtype
            assert got.codes.tolist() == ref.codes.tolist() and got.codes.dtype == ref.codes.dtype
            assert np.asarray(got, dtype=object).tolist() == np.asarray(ref, dtype=object).tolist()
    a, b = C.take_strings(col, np.array([1]), fill), C.take_strings(col, np.array([2]), fill)
    assert a.categories is b.categories or fill in col.cat.categories
    if keep_max is not None and hasattr(a.categories, "_cache"):  # (pandas' lookup table: not kept when large)
        assert "_engine" not in a.categories._cache


@pytest.mark.parametrize("dtype", ["str", object])
def test_take_strings_of_an_ordered_column_is_unordered(dtype):
    names = ["b", "a", "", "c"]
    col = pd.Series(pd.Categorical(["a", "b", "c", "a"], categories=pd.Index(names, dtype=dtype), ordered=True))
    for fill in ("", "zz"):
        got, ref = C.take_strings(col, np.array([0, -1, 3]), fill), _take_strings_ref(col, np.array([0, -1, 3]), fill)
        assert not got.ordered and got.dtype == ref.dtype
        assert np.asarray(got, dtype=object).tolist() == np.asarray(ref, dtype=object).tolist()


@pytest.mark.parametrize("dtype", ["str", object])
def test_position_and_forget_lookup_on_a_large_index(dtype, monkeypatch):
    names = [f"ProfilerStep#{i}" for i in range(300)] + ["", "aten::mm"]
    for keep_max in (1000, 10):  # the Index's own lookup, then the comparison over its values
        monkeypatch.setattr(C, "LOOKUP_KEEP_MAX", keep_max)
        cats = pd.Index(names, dtype=dtype)
        for v in ["", "aten::mm", "ProfilerStep#7", "ProfilerStep#299", "absent", "ProfilerStep#300"]:
            assert C._position(cats, v) == (names.index(v) if v in names else -1)
        assert "aten::mm" in cats and cats.get_loc("ProfilerStep#5") == 5  # (builds pandas' table)
        assert C.forget_lookup(cats) is cats
        if hasattr(cats, "_cache"):
            assert ("_engine" in cats._cache) == (len(cats) <= keep_max)
        assert cats.get_loc("ProfilerStep#9") == 9 and "absent" not in cats  # (a later lookup: built again)


def test_loaded_categories_keep_no_lookup_table(monkeypatch):
    import tracelens

    monkeypatch.setattr(C, "LOOKUP_KEEP_MAX", 2)  # every dictionary of the fixture counts as large
    trace = tracelens.load(str(FIXTURES / "h200_ep2_run" / "L3_torch"), cache=False)
    cats = [d.categories for d in trace.events.dtypes.tolist() if isinstance(d, pd.CategoricalDtype)]
    assert any(len(c) > 2 for c in cats)
    for c in cats:
        if len(c) > 2 and hasattr(c, "_cache"):
            assert "_engine" not in c._cache, "the loader kept pandas' lookup table of a large dictionary"


@pytest.mark.parametrize("dtype", ["str", object])
def test_category_values_and_strings_against_the_whole_dictionary(dtype):
    names = [f"ProfilerStep#{i}" for i in range(6000)] + LOOKALIKES
    cats = pd.Index(names, dtype=dtype)
    full = np.array([str(c) for c in cats], dtype=object)
    rng = np.random.default_rng(7)
    for codes in (rng.integers(-1, 30, 500), rng.integers(-1, len(names), 50000), np.array([-1, -1]),
                  np.array([], dtype=np.int32), np.arange(len(names))):
        got = C.category_values(cats, codes)
        assert len(got) == len(cats) and got.dtype == object
        ok = codes[codes >= 0]
        assert got[ok].tolist() == full[ok].tolist()
        col = pd.Series(pd.Categorical.from_codes(codes, categories=cats))
        for missing in ("", "(none)", None):
            expect = [missing if c < 0 else full[c] for c in codes]
            assert C.strings(col, missing).tolist() == expect
    small = pd.Index(["a", "b"], dtype=dtype)
    assert C.category_values(small, np.array([1])).tolist() == ["a", "b"]

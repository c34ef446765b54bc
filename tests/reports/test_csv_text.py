"""reports.csv_text.csv_bytes writes exactly the bytes of ``df.to_csv(index=False)``: pandas itself is the truth
in every test here, on random frames of the dtypes it takes, on frames it leaves to pandas, and on the tables of
a real analysis; and the step tables take its own path (not pandas'), so the speed cannot go back unseen."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

import tracelens  # noqa: E402
from reports.artifacts import _plain, table_files  # noqa: E402
from reports.csv_text import csv_bytes, fast_path  # noqa: E402

from ..conftest import NCCL_2RANK  # noqa: E402

PROPS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])


def pandas_bytes(df: pd.DataFrame) -> bytes:
    return df.to_csv(index=False).encode("utf-8")


INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
FLOATS = [np.float16, np.float32, np.float64]
SPECIAL = [0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1e-7, 1e-5, 1e-4, 0.1, 1e15, 1e16, 1e22, 1e300,
           5e-324, 2.2250738585072014e-308, 1.5e-310, 123456789012345678.0, 0.30000000000000004, 65504.0, 6e-8,
           3.4028235e38, 1e-45]


@st.composite
def column(draw, n: int) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(INTS + FLOATS + [np.bool_])))
    if dtype.kind == "b":
        elements = st.booleans()
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        elements = st.integers(int(info.min), int(info.max))
    else:
        with np.errstate(over="ignore"):
            special = sorted({float(dtype.type(v)) for v in SPECIAL if not np.isnan(v)}) + [np.nan]
        elements = st.one_of(st.floats(width=8 * dtype.itemsize), st.sampled_from(special))
    if draw(st.booleans()):  # few distinct values, repeated (the step tables' kind: zeros, identical spans)
        pool = draw(st.lists(elements, min_size=1, max_size=4))
        elements = st.sampled_from(pool)
    return draw(hnp.arrays(dtype, n, elements=elements))


@st.composite
def frames(draw) -> pd.DataFrame:
    n = draw(st.integers(1, 40))
    k = draw(st.integers(1, 6))
    names = draw(st.lists(st.text(st.characters(codec="utf-8", exclude_characters=',"\r\n'), min_size=1,
                                  max_size=6), min_size=k, max_size=k))
    return pd.DataFrame({f"{i}{name}": draw(column(n)) for i, name in enumerate(names)})


@PROPS
@given(frames(), st.integers(1, 50))
def test_random_numeric_frames_are_what_pandas_writes(df, chunk):
    assert fast_path(df)
    assert csv_bytes(df, chunk=chunk) == pandas_bytes(df)


@PROPS
@given(st.data())
def test_one_column_with_nan_is_quoted_as_pandas_quotes_it(data):
    # the csv module writes a row of one empty field as "" (and pandas with it)
    df = pd.DataFrame({"x": data.draw(column(data.draw(st.integers(1, 20))))})
    assert csv_bytes(df, chunk=data.draw(st.integers(1, 8))) == pandas_bytes(df)


def test_the_rules_written_out():
    df = pd.DataFrame({"f": [-0.0, 0.0, np.nan, np.inf, -np.inf, 1e16, 1e-7, 5e-324],
                       "f32": np.array([0.1, 8.57, np.nan, 0.0, -0.0, 1e16, 1e-7, 1e-45], dtype=np.float32),
                       "i": np.array([-1, 0, 2**63 - 1, -2**63, 5, 6, 7, 8], dtype=np.int64),
                       "u": np.array([2**64 - 1, 0, 1, 2, 3, 4, 5, 6], dtype=np.uint64),
                       "b": [True, False] * 4})
    text = csv_bytes(df).decode()
    assert text == pandas_bytes(df).decode()
    assert text.splitlines()[:4] == ["f,f32,i,u,b", "-0.0,0.1,-1,18446744073709551615,True",
                                     "0.0,8.57,0,0,False", ",,9223372036854775807,1,True"]
    assert pd.DataFrame({"x": [np.nan, 1.0]}).pipe(csv_bytes) == b'x\n""\n1.0\n'
    odd_bools = pd.DataFrame({"b": np.array([0, 2, 1, 255], dtype=np.uint8).view(bool)})  # any byte but 0 is True
    assert csv_bytes(odd_bools) == pandas_bytes(odd_bools) == b"b\nFalse\nTrue\nTrue\nTrue\n"


def test_many_rows_over_several_chunks():
    rng = np.random.default_rng(0)
    n = 150_000  # > 2 chunks of the default CHUNK
    df = pd.DataFrame({"step": np.arange(n), "start_ns": rng.integers(0, 2**62, n),
                       "span_us": np.round(rng.random(n) * 1000, 3), "zero": np.zeros(n),
                       "few": rng.choice([0.5, -0.0, np.nan, 1e22], n), "f32": rng.random(n).astype(np.float32),
                       "steady": rng.random(n) < 0.5, "rank": np.zeros(n, dtype=np.int32)})
    assert fast_path(df)
    assert csv_bytes(df) == pandas_bytes(df)


FALLBACK = {
    "strings with commas and quotes": pd.DataFrame({"name": ['a,b', 'say "hi"', "x\ny", ""], "v": [1, 2, 3, 4]}),
    "str dtype": pd.DataFrame({"name": pd.array(["a", None, "c"], dtype="str"), "v": [1.0, 2.0, 3.0]}),
    "categorical": pd.DataFrame({"c": pd.Categorical(["x", "y", "x"]), "v": [1, 2, 3]}),
    "object": pd.DataFrame({"o": np.array([1, "a", None], dtype=object), "v": [0.5, 1.5, 2.5]}),
    "nullable Int64 with NA": pd.DataFrame({"n": pd.array([1, None, 3], dtype="Int64"), "v": [1, 2, 3]}),
    "nullable boolean": pd.DataFrame({"n": pd.array([True, None, False], dtype="boolean")}),
    "Float64": pd.DataFrame({"n": pd.array([0.1, None, 3.0], dtype="Float64")}),
    "datetime": pd.DataFrame({"t": pd.to_datetime(["2024-01-01", None, "2024-01-03"])}),
    "complex": pd.DataFrame({"z": np.array([1 + 2j, 0, -1j])}),
    "a column name with a comma": pd.DataFrame({"a,b": [1, 2], "c": [0.5, 0.25]}),
    "a column name with a quote": pd.DataFrame({'a"b': [1, 2]}),
    "an int column name": pd.DataFrame({0: [1, 2], "c": [0.5, 0.25]}),
    "a lone column named ''": pd.DataFrame({"": [1.0, np.nan]}),
    "MultiIndex columns": pd.DataFrame([[1, 2.0]], columns=pd.MultiIndex.from_tuples([("a", "x"), ("a", "y")])),
    "no rows": pd.DataFrame({"a": np.array([], dtype=np.int64), "b": np.array([], dtype=float)}),
    "no columns": pd.DataFrame(index=[1, 2]),
    "empty": pd.DataFrame(),
}


@pytest.mark.parametrize("name", list(FALLBACK))
def test_frames_it_leaves_to_pandas(name):
    df = FALLBACK[name]
    assert not fast_path(df)
    assert csv_bytes(df) == pandas_bytes(df)


def test_an_index_is_not_written():
    df = pd.DataFrame({"a": [1.5, 2.5], "b": [1, 2]}, index=pd.Index([10, 20], name="i"))
    assert csv_bytes(df) == pandas_bytes(df) == b"a,b\n1.5,1\n2.5,2\n"


@pytest.fixture(scope="module")
def analysis():
    return tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))


def test_every_table_of_a_real_analysis(analysis):
    tables = {name: _plain(df) for name, df in analysis.tables().items()}
    for name, df in tables.items():
        assert csv_bytes(df) == pandas_bytes(df), name
    files = table_files(analysis, formats=("csv",))
    assert files == {f"{name}.csv": pandas_bytes(df) for name, df in tables.items()}


def test_the_step_tables_take_the_fast_path(analysis):
    # the tables that are large on a trace of many short steps (800,000 rows at 2 GB): pandas would take ~5x longer
    tables = analysis.tables()
    for name in ("step_timeline", "steps", "timeline"):
        df = _plain(tables[name])
        assert len(df) > 0 and fast_path(df), (name, dict(df.dtypes))

"""The suite's exact table comparison (conftest.assert_frames_identical) fails on every kind of difference that
pd.testing.assert_frame_equal(check_exact=True) fails on, and passes on equal tables (NaN where NaN)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from .conftest import assert_frames_identical


def _frame() -> pd.DataFrame:
    return pd.DataFrame({
        "name": pd.Categorical(["a", "b", "a", None], categories=["a", "b"]),
        "ts": np.array([1, 2, 3, 4], dtype=np.int64),
        "flops": np.array([1.5, np.nan, 0.0, 2.0], dtype=np.float32),
        "s": pd.array(["x", None, "y", "z"], dtype="string[pyarrow]"),
    })


def test_equal_tables_pass():
    assert_frames_identical(_frame(), _frame())


@pytest.mark.parametrize("change", [
    lambda f: f.assign(ts=f["ts"] + np.array([0, 0, 0, 1])),
    lambda f: f.assign(flops=f["flops"].fillna(0.0)),
    lambda f: f.assign(flops=f["flops"] * np.float32(1.0000001) + np.float32(1e-7)),
    lambda f: f.assign(ts=f["ts"].astype(np.int32)),
    lambda f: f.assign(name=f["name"].cat.reorder_categories(["b", "a"])),
    lambda f: f.assign(name=f["name"].cat.add_categories(["c"])),
    lambda f: f.assign(s=f["s"].fillna("w")),
    lambda f: f[["ts", "name", "flops", "s"]],
    lambda f: f.set_axis([0, 1, 2, 5]),
    lambda f: f.iloc[:3],
], ids=["value", "nan", "float-ulp", "dtype", "category-order", "categories", "string", "column-order", "index",
        "rows"])
def test_every_difference_fails(change):
    with pytest.raises(AssertionError):
        assert_frames_identical(change(_frame()), _frame())

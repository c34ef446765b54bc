"""tracelens.analysis.grouped: the named aggregations without pandas' fixed cost give pandas' frame exactly."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tracelens.analysis.grouped import named_agg, named_agg_column


def _frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n) * 10.0 ** rng.integers(-3, 9, size=n)
    x[rng.random(n) < 0.1] = np.nan
    return pd.DataFrame({
        "rank": rng.integers(0, 4, size=n),
        "cause": pd.Series(rng.choice(["sync", "launch-bound", "other"], size=n), dtype=object),
        "name": rng.choice(["aten::mm", "aten::add", "a<b>", ""], size=n),
        "x": x, "k": rng.integers(0, 10**9, size=n),
        "text": pd.Series(rng.choice(["p", "q", None], size=n), dtype=object),
    })


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sort", [True, False])
def test_named_agg_is_pandas_named_aggregation(seed, sort):
    df = _frame(int(np.random.default_rng(seed).integers(0, 300)), seed)
    spec = dict(n=("x", "size"), s=("x", "sum"), k=("k", "sum"), first=("text", "first"), last=("name", "last"),
                lo=("x", "min"), hi=("k", "max"), mean=("x", "mean"), med=("x", "median"), uniq=("name", "nunique"),
                cnt=("x", "count"))
    for keys in (["rank", "cause"], ["name"], "rank", ["cause", "name", "rank"]):
        want = df.groupby(keys, sort=sort).agg(**spec)
        got = named_agg(df, keys, sort=sort, **spec)
        pd.testing.assert_frame_equal(got, want, check_exact=True)
        assert got.reset_index().to_json() == want.reset_index().to_json()
        want_c = df.groupby(keys, sort=sort)["x"].agg(n="size", hi="max", med="median")
        pd.testing.assert_frame_equal(named_agg_column(df, keys, "x", sort=sort, n="size", hi="max", med="median"),
                                      want_c, check_exact=True)


def test_an_empty_table_or_another_reduction_is_pandas_own():
    df = _frame(0, 1)
    pd.testing.assert_frame_equal(named_agg(df, ["rank"], s=("x", "sum"), f=("text", "first")),
                                  df.groupby(["rank"]).agg(s=("x", "sum"), f=("text", "first")))
    df = _frame(50, 2)
    pd.testing.assert_frame_equal(named_agg(df, "rank", s=("x", "std")), df.groupby("rank").agg(s=("x", "std")))

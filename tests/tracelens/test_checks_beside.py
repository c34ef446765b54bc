"""The loader's checks on a table large enough that its duplicates are found in a thread beside the other checks
(`tracelens.io.checks.check_events`, `_DUPLICATES_BESIDE_ROWS` rows and up): the rows dropped are exactly those the
table was built with (exact duplicates of earlier rows, negative durations, a far time outlier, including
duplicates of dropped rows), counted from the construction, not from the code under test."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from tracelens.io import checks


def _table(n: int, seed: int = 0) -> tuple[pa.Table, dict]:
    rng = np.random.default_rng(seed)
    ts = np.arange(n, dtype=np.int64) * 1000 + 10**12  # distinct rows: distinct ts
    dur = rng.integers(1, 900, n).astype(np.int64)
    name = rng.integers(0, 50, n).astype(np.int32)
    # 3,000 exact duplicates of earlier rows, appended; 40 negative durations, 7 of them duplicated; one row ~11
    # days later (an outlier: 1e15 ns past a 1.1 ms body... with its own duplicate)
    neg = rng.choice(n, 40, replace=False)
    dur[neg] = -5
    ts[n - 1] += 10**15
    src = np.r_[rng.choice(n - 1, 2993, replace=False), neg[:7], [n - 1]]
    src = src[~np.isin(src, neg[:7]) | (np.arange(len(src)) >= 2993)]
    idx = np.r_[np.arange(n), src]
    t = pa.table({"ts": ts[idx], "dur": dur[idx], "tid": np.zeros(len(idx), np.int64),
                  "name": pa.DictionaryArray.from_arrays(pa.array(name[idx]), pa.array([f"k{i}" for i in range(50)])),
                  "cat": pa.DictionaryArray.from_arrays(pa.array(np.zeros(len(idx), np.int32)), pa.array(["kernel"])),
                  "correlation": np.arange(n, dtype=np.int64)[idx]})
    n_dup_kept = int((~np.isin(src, neg) & (src != n - 1)).sum())
    return t, {"negative_dur": 40 + int(np.isin(src, neg).sum()), "time_outlier": 2, "duplicate": n_dup_kept}


def test_duplicates_beside_the_checks_drop_what_the_table_was_built_with():
    n = checks._DUPLICATES_BESIDE_ROWS + 5_000
    t, want = _table(n)
    out, issues = checks.check_events("big.json", t)
    got = {i["check"]: i["events"] for i in issues}
    assert got == want
    assert out.num_rows == t.num_rows - sum(want.values())
    ts = out["ts"].to_numpy()
    assert len(np.unique(ts)) == len(ts)  # every kept row distinct (the built table's rows differ by ts)


def test_the_same_drops_without_the_thread(monkeypatch):
    n = checks._DUPLICATES_BESIDE_ROWS + 5_000
    t, want = _table(n, seed=1)
    monkeypatch.setattr(checks, "_DUPLICATES_BESIDE_ROWS", 1 << 62)
    out, issues = checks.check_events("big.json", t)
    assert {i["check"]: i["events"] for i in issues} == want

"""critical_path's per-step bookkeeping over whole arrays (`_steps_by_rank`, `_first_missing_step`, the steps'
start/end by position): checked against the per-step code it replaces, kept here as the reference."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tracelens.analysis import critical_path as CP


def _steps_by_rank_ref(gpu):  # (the set-per-rank version before)
    rank = gpu["rank"].to_numpy().astype(np.int64)
    step = gpu["step"].to_numpy().astype(np.int64)
    if not len(rank):
        return {}
    lo, r0 = int(step.min()), int(rank.min())
    span = int(step.max()) - lo + 1
    out: dict[int, set[int]] = {}
    for key in np.unique((rank - r0) * span + (step - lo)).tolist():
        out.setdefault(key // span + r0, set()).add(key % span + lo)
    return out


def _first_missing_ref(steps, ranks, have):  # (the per-(step, rank) loop before)
    for n in steps:
        for r in ranks:
            if n not in have.get(r, set()):
                return n, r, sorted(x for x in have.get(r, set()) if x >= 0)
    return None


def _gpu(rng, n):
    return pd.DataFrame({"rank": rng.integers(2, 6, n).astype(np.int32), "step": rng.integers(-1, 9, n).astype(np.int32)})


def test_steps_by_rank_and_first_missing_against_the_loops():
    rng = np.random.default_rng(4)
    for i in range(300):
        gpu = _gpu(rng, int(rng.integers(0, 60)))
        have, ref = CP._steps_by_rank(gpu), _steps_by_rank_ref(gpu)
        assert {r: set(v.tolist()) for r, v in have.items()} == ref
        assert all((np.diff(v) > 0).all() and v.dtype == np.int64 for v in have.values())
        ranks = sorted(int(r) for r in gpu["rank"].unique())
        for steps in ([], [-1], rng.integers(-1, 10, int(rng.integers(1, 8))).tolist(), list(range(9))):
            got = CP._first_missing_step(steps, ranks + ([7] if i % 5 == 0 else []), have)
            exp = _first_missing_ref(steps, ranks + ([7] if i % 5 == 0 else []), ref)
            assert (got is None) == (exp is None)
            if got is not None:
                assert got == exp[:2]
                assert [x for x in have.get(got[1], np.empty(0, np.int64)).tolist() if x >= 0] == exp[2]


def test_critical_path_step_columns_and_missing_step_message():
    """Through critical_path on two ranks: a step one rank lacks raises the first (step, rank) message; the steps'
    start/end come from their GPU events."""
    from tracelens.errors import TraceError
    rows = []
    for r in (0, 1):
        for s in range(4):
            if r == 1 and s == 2:
                continue
            t = 1000 * s + 10 * r
            rows.append(dict(rank=r, ts=t, end=t + 100 + s, step=s))
    gpu = pd.DataFrame(rows)
    gpu = gpu.assign(dur=gpu["end"] - gpu["ts"], is_comm=False, category="GEMM", top_op="aten::mm", path="", launch_ts=-1,
                     name="k", kind="kernel")
    empty = pd.DataFrame(columns=["rank", "ts", "host_blocked_us"])
    with pytest.raises(TraceError, match=r"rank 1 has no GPU work in step 2 \(its steps: 0, 1, 3\)"):
        CP.critical_path(gpu, pd.DataFrame(), empty, [0, 2, 3])
    try:
        cp = CP.critical_path(gpu, pd.DataFrame(), empty, [3, 0, 1])
    except Exception as e:  # (a table this small may lack a column the walk reads: the check above is the point)
        pytest.skip(f"critical_path on a toy table: {e}")
    st = cp.steps
    by = gpu.groupby("step")
    assert st["step"].tolist() == [3, 0, 1]
    assert st["start_ns"].tolist() == [int(by["ts"].min()[s]) for s in (3, 0, 1)]
    assert st["end_ns"].tolist() == [int(by["end"].max()[s]) for s in (3, 0, 1)]


def test_steps_by_rank_sparse_keys():
    """Steps far apart (keys sorted by np.unique) and dense (by a count per key): the same sets."""
    for step in (np.array([0, 10**12, 5, 5, -3]), np.array([1, 2, 2, 0, 1])):
        gpu = pd.DataFrame({"rank": np.array([3, 1, 3, 1, 1]), "step": step})
        have = CP._steps_by_rank(gpu)
        assert {r: set(v.tolist()) for r, v in have.items()} == _steps_by_rank_ref(gpu)
        assert list(have) == sorted(have)


def test_rank_lists_are_each_steps_ranks_in_order_shared_between_equal_sets():
    from tracelens.analysis.critical_path import _rank_lists

    rng = np.random.default_rng(4)
    for n_ranks in (1, 3, 63, 64, 70):
        rank_ids = np.sort(rng.choice(1000, n_ranks, replace=False)).astype(np.int64)
        n_steps = 50
        pairs = sorted({(int(s), int(r)) for s, r in zip(rng.integers(0, n_steps, 300), rng.integers(0, n_ranks, 300))})
        on = np.array([s * n_ranks + r for s, r in pairs], dtype=np.int64)
        on_at = np.searchsorted(on // n_ranks, np.arange(n_steps + 1))
        want = [[int(rank_ids[r]) for s, r in pairs if s == k] for k in range(n_steps)]  # the old per-step slices
        got = _rank_lists(on, on_at, rank_ids)
        assert [list(x) for x in got] == want and all(type(x) is list for x in got)
        same = {}
        for x in got:  # equal sets are one list object
            assert same.setdefault(tuple(x), id(x)) == id(x)
    assert len(_rank_lists(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64))) == 0


def test_codes_of_a_large_dictionary_give_each_rows_string():
    from tracelens.analysis.critical_path import _codes

    names = [f"ProfilerStep#{i}" for i in range(10_000)] + ["aten::mm", ""]
    rows = [names[i] for i in (5, 10_000, 10_000, 7, 10_001)] + [None]
    col = pd.Series(pd.Categorical(rows, categories=names))
    codes, strings = _codes(col)
    assert [strings[c] for c in codes] == [r if r is not None else "" for r in rows]
    assert strings[-1] == "" and len(strings) < 10  # only the used categories made strings


def test_first_of_runs_is_np_unique_of_a_sorted_array():
    from tracelens.analysis.critical_path import _first_of_runs

    rng = np.random.default_rng(8)
    for n in (0, 1, 2, 50, 5000):
        v = np.sort(rng.integers(-5, 40, n))
        want = np.unique(v, return_index=True)
        got = _first_of_runs(v)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])

"""steps.py's per-step work over whole arrays (`_empty_steps`, `_ranges`, `_sorted_ints`, StepWindow.describe /
to_dict): checked against the per-step code they replace, kept here as the reference."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tracelens.analysis import steps as S


def _ranges_ref(xs) -> str:  # (the per-element code before)
    xs = sorted(int(x) for x in xs)
    if not xs:
        return "none"
    out, lo, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(lo) if lo == prev else f"{lo}-{prev}")
        if x is not None:
            lo = prev = x
    return ", ".join(out)


def _empty_ref(steps: pd.DataFrame, ops_per: pd.Series) -> list[tuple]:  # (the per-(rank, step) loop before)
    got = []
    n_ops = {(int(r), int(s)): int(n) for (r, s), n in ops_per.items()}
    for r, g in steps.groupby("rank"):
        counts = {s: n_ops.get((int(r), s), 0) for s in g["step"].astype(np.int64).tolist()}
        if any(counts.values()):
            for s, n in counts.items():
                if n == 0:
                    got.append((r, s))
    return got


@pytest.mark.parametrize("xs", [[], [5], [3, 1, 2], [1, 1, 2], [7, 5, 6, 10, 12, 11, 0], [-3, -2, 0, 1],
                                np.array([4, 2, 3], dtype=np.int32), np.array([9, 8], dtype=np.uint16),
                                np.array([1.0, 2.0, 4.0]), [np.int64(2), 3, np.int32(4)], list(range(100000)),
                                np.array([], dtype=np.int64), ["3", "4"], [2**40, 2**40 + 1, 5]])
def test_ranges_against_per_element(xs):
    assert S._ranges(xs) == _ranges_ref(xs)


def test_ranges_random():
    rng = np.random.default_rng(0)
    for _ in range(200):
        xs = rng.integers(-5, 40, rng.integers(0, 30))
        assert S._ranges(xs) == _ranges_ref(xs)
        assert S._ranges(xs.tolist()) == _ranges_ref(xs)
        assert S._sorted_ints(np.unique(xs)) == sorted(int(v) for v in np.unique(xs))


def _case(rng, n_ranks, n_steps, dup=False):
    rows = [(r, s) for r in rng.permutation(n_ranks) for s in rng.permutation(n_steps)[: rng.integers(0, n_steps + 1)]]
    if dup and rows:
        rows += [rows[i] for i in rng.integers(0, len(rows), 5)]
    steps = pd.DataFrame({"rank": np.array([r for r, _ in rows], dtype=np.int32),
                          "step": np.array([s for _, s in rows], dtype=np.int64)})
    ops = pd.DataFrame({"rank": rng.integers(0, n_ranks + 1, 60).astype(np.int32), "step": rng.integers(0, n_steps + 2, 60)})
    return steps, ops.groupby(["rank", "step"]).size()


def test_empty_steps_against_the_loop():
    rng = np.random.default_rng(1)
    for i in range(300):
        steps, ops_per = _case(rng, int(rng.integers(1, 5)), int(rng.integers(1, 12)), dup=i % 3 == 0)
        if i % 7 == 0:
            ops_per = ops_per[ops_per.index.get_level_values(0) != 0]
        if i % 11 == 0:  # a key twice (per-rank reductions concatenated): the last count, as a dict
            ops_per = pd.concat([ops_per, ops_per.iloc[:2] * 0])
        got = S._empty_steps(steps, ops_per)
        assert got == _empty_ref(steps, ops_per)
        assert all(type(r) is int and type(s) is int for r, s in got)
    empty = pd.DataFrame({"rank": np.array([], dtype=np.int32), "step": np.array([], dtype=np.int64)})
    assert S._empty_steps(empty, pd.Series(dtype=np.int64)) == []
    steps = pd.DataFrame({"rank": [0, 0], "step": [1, 2]})
    assert S._empty_steps(steps, pd.Series(dtype=np.int64)) == _empty_ref(steps, pd.Series(dtype=np.int64)) == []


def _window(excluded, used, steps):
    return S.StepWindow(mode=S.STEADY, steps=steps, used=used, excluded=excluded, outside_gpu_events=0,
                        outside_gpu_us=0.0)


@pytest.mark.parametrize("excluded", [[], [{"step": 3, "reason": "empty", "ranks": [0], "detail": "d"}],
                                      [{"step": 3, "reason": "startup_wait", "ranks": [1], "detail": "w"}]])
def test_describe_and_to_dict_without_the_used_set(excluded):
    steps = list(range(1, 2000))
    used = [s for s in steps if s != 3] if excluded and excluded[0]["reason"] == "empty" else steps
    sw = _window(excluded, used, steps)
    ref_used = {int(u) for u in used}
    left = [e for e in excluded if int(e["step"]) not in ref_used]
    text = sw.describe()
    assert text.startswith(f"steady-state steps {_ranges_ref(used)} of {_ranges_ref(steps)}")
    assert ("; excluded step 3" in text) == bool(left)
    d = sw.to_dict()
    assert [e["kept"] for e in d["steps_excluded"]] == [int(e["step"]) in ref_used for e in excluded]


def _steps_table_ref(tree):  # (calltree.steps_table's per-row dedup before)
    rows = np.flatnonzero(tree["is_step"].to_numpy())
    rank = tree["rank"].to_numpy()[rows]
    step = tree["step"].to_numpy()[rows].astype(np.int64)
    start = tree["ts"].to_numpy()[rows]
    end = start + tree["dur"].to_numpy()[rows]
    o = np.lexsort((start, rank))
    seen: set = set()
    keep = [i for i in o.tolist() if (k := (rank[i], step[i])) not in seen and not seen.add(k)]
    return pd.DataFrame({"rank": rank[keep], "step": step[keep], "start": start[keep], "end": end[keep]})


def test_steps_table_against_per_row_dedup():
    from tracelens.analysis.calltree import steps_table
    rng = np.random.default_rng(3)
    for n in (0, 1, 5, 40, 400):
        tree = pd.DataFrame({"is_step": rng.random(n) < 0.6, "rank": rng.integers(0, 3, n).astype(np.int32),
                             "step": rng.integers(-1, 6, n).astype(np.int32), "ts": rng.integers(0, 50, n),
                             "dur": rng.integers(0, 9, n)})
        got, ref = steps_table(tree), _steps_table_ref(tree)
        pd.testing.assert_frame_equal(got, ref)


@pytest.mark.parametrize("used", [[3, 1, 2], [np.int64(4), 5], [2.0, 7.0], [], list(range(5000)), ["3", "9"]])
def test_window_steps_and_steady_step_against_per_step(used):
    from types import SimpleNamespace
    from tracelens.analysis import moe_view
    from tracelens.projection import decomposition
    sw = SimpleNamespace(used=used, restricts=True)
    a = SimpleNamespace(window=sw)
    got = moe_view._window_steps(a)
    assert got == [int(s) for s in used] and all(type(s) is int for s in got)
    rng = np.random.default_rng(5)
    for dt in (np.int64, np.int32, np.float64):
        steps = pd.DataFrame({"rank": rng.integers(0, 2, 300), "step": rng.integers(0, 12, 300).astype(dt)})
        gpu = pd.DataFrame({"rank": rng.integers(0, 2, 200), "step": rng.integers(0, 12, 200)})
        a = SimpleNamespace(window=sw, steps=steps, gpu=gpu)
        for rank in (0, 1, 5):
            ref_used = {int(s) for s in used}
            st = steps[steps["rank"] == rank]
            have = [int(s) for s in st["step"] if int(s) in ref_used]
            if not used or not have:
                exp = None
            else:
                counts = gpu[(gpu["rank"] == rank) & gpu["step"].isin(have)].groupby("step").size()
                exp = int(counts.idxmax()) if len(counts) else have[len(have) // 2]
            assert decomposition._steady_step(a, rank) == exp


def test_empty_steps_wide_keys_and_negative_steps():
    """Steps far apart (the MultiIndex path) and below zero: the same as the loop."""
    steps = pd.DataFrame({"rank": np.array([0, 0, 1, 1, 0], dtype=np.int32),
                          "step": np.array([-2, 2**61, 5, 2**61, -2], dtype=np.int64)})
    ops = pd.Series([3, 0, 1], index=pd.MultiIndex.from_arrays([[0, 1, 1], [-2, 5, -7]]))
    assert S._empty_steps(steps, ops) == _empty_ref(steps, ops)
    steps2 = pd.DataFrame({"rank": [5, 5, 3, 3], "step": [-1, 0, 0, 1]})
    ops2 = pd.Series([2, 0], index=pd.MultiIndex.from_arrays([[5, 3], [-1, 1]]))
    assert S._empty_steps(steps2, ops2) == _empty_ref(steps2, ops2)


def test_window_events_is_the_table_itself_when_every_event_is_in_a_used_step():
    gpu = pd.DataFrame({"step": [1, 1, 2, 3, -1], "ts": [0, 1, 2, 3, 4]})
    sw = S.StepWindow(mode="steady", steps=[1, 2, 3], used=[1, 2, 3], excluded=[])
    assert S.window_events(gpu, sw).equals(gpu[gpu["step"].isin([1, 2, 3])])  # step -1: outside every step
    inside = gpu[gpu["step"] >= 1].reset_index(drop=True)
    assert S.window_events(inside, sw) is inside  # no copy of a table the window keeps whole
    some = S.StepWindow(mode="steady", steps=[1, 2, 3], used=[2, 3], excluded=[{"step": 1, "reason": "warmup"}])
    got = S.window_events(inside, some)
    assert got["step"].tolist() == [2, 3] and got is not inside


def test_the_reports_step_list_is_each_step_up_to_the_limit_then_runs():
    from reports.html import LIST_STEPS_UP_TO, _step_list

    assert _step_list(np.array([3, 1, 2, 7])) == "1, 2, 3, 7"
    assert _step_list(np.array([], dtype=np.int64)) == "not marked"
    many = np.r_[np.arange(1, LIST_STEPS_UP_TO + 5), [500, 502]]
    assert _step_list(many) == f"1-{LIST_STEPS_UP_TO + 4}, 500, 502"
    few = np.arange(LIST_STEPS_UP_TO)
    assert _step_list(few) == ", ".join(str(s) for s in range(LIST_STEPS_UP_TO))  # as before, one by one

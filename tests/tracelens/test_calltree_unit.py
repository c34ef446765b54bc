"""The vectorized range linker against the plain stack walk, on real traces and on hand-made cases."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import tracelens
from tracelens.analysis import calltree as CT

from ..conftest import DIFF_TEST, MI250, MOE_GROUPED, MOE_LOOP, NCCL_2RANK


def resolve(paths, pparent, pname):
    out = {}
    for pid in range(len(pparent)):
        chain, p = [], pid
        while p > 0:
            chain.append(int(pname[p]))
            p = int(pparent[p])
        out[pid] = tuple(reversed(chain))
    return [out[int(p)] for p in paths]


def sorted_ranges(events):
    host = CT.host_events(events)
    host = host[host["kind"] != CT.KIND_RUNTIME]
    ts = host["ts"].to_numpy()
    end = ts + host["dur"].to_numpy()
    kind = host["kind"].to_numpy()
    g = host[["rank", "pid", "tid"]].to_numpy()
    order = np.lexsort((kind, -(end - ts), ts, g[:, 2], g[:, 1], g[:, 0]))
    gs = g[order]
    new = np.r_[True, (gs[1:] != gs[:-1]).any(axis=1)]
    group = np.cumsum(new) - 1
    name = host["name"].cat.codes.to_numpy()[order].astype(np.int64)
    step = np.zeros(len(order), dtype=bool)
    return group, ts[order], end[order], kind[order], name, step


def check_same(args):
    a = CT.link_ranges(*args)
    b = CT.link_ranges_walk(*args)
    for x, y, what in zip(a[:4], b[:4], ("parent", "depth", "inner", "outer")):
        assert np.array_equal(x, y), what
    assert resolve(a[4], a[5], a[6]) == resolve(b[4], b[5], b[6])


@pytest.mark.parametrize("path", [MOE_LOOP, MOE_GROUPED, MI250, NCCL_2RANK, DIFF_TEST], ids=lambda p: p.name)
def test_vectorized_matches_walk_on_fixtures(path):
    check_same(sorted_ranges(tracelens.load(path, cache=False).events))


def test_hand_cases_zero_length_and_siblings():
    # thread 0: A[0,10) > B[0,4) > Z[4,4) zero-length at B's end; C[4,10) sibling of B; D[10,10) after A
    ts = np.array([0, 0, 4, 4, 10])
    end = np.array([10, 4, 10, 4, 10])
    dur = end - ts
    kind = np.array([CT.KIND_ANNOTATION, CT.KIND_OP, CT.KIND_OP, CT.KIND_OP, CT.KIND_OP])
    order = np.lexsort((kind, -dur, ts))
    args = (np.zeros(5, np.int64), ts[order], end[order], kind[order], np.arange(5)[order], np.zeros(5, bool))
    check_same(args)
    parent = CT.link_ranges(*args)[0]
    names = np.arange(5)[order]
    par = {int(names[i]): (int(names[p]) if p >= 0 else None) for i, p in enumerate(parent)}
    assert par == {0: None, 1: 0, 2: 0, 3: 2, 4: None}


@pytest.mark.parametrize("seed", range(20))
def test_random_properly_nested(seed):
    rng = np.random.default_rng(seed)
    # build random nested intervals per thread by recursive splitting
    rows = []

    def build(lo, hi, depth, g):
        t = lo
        while t < hi and depth < 6:
            a = int(rng.integers(t, hi + 1))
            b = int(rng.integers(a, hi + 1))
            rows.append((g, a, b, int(rng.integers(0, 3)), int(rng.integers(0, 4))))
            if b > a:
                build(a, b, depth + 1, g)
            t = b + int(rng.integers(0, 3))
            if rng.random() < 0.3:
                break

    for g in range(3):
        build(0, 200, 0, g)
    arr = np.array(rows, dtype=np.int64)
    g, ts, end, kind, name = arr.T
    order = np.lexsort((kind, -(end - ts), ts, g))
    step = rng.random(len(arr)) < 0.1
    check_same((g[order], ts[order], end[order], kind[order], name[order], step[order]))


# ------------------------------------------------------------------ degenerate traces (issue 17)


def _x(name, cat, ts, dur, pid=1, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def _write(tmp_path, events):
    import json

    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": events}))
    return p


def test_innermost_range_at_with_only_zero_length_ranges():
    # sorted positions on one thread: Z1[5,5) call@5 Z2[7,7) call@7 call@3 call@9. Every range is
    # zero-length (no range ever closes after opening), so nothing encloses any call.
    group = np.zeros(6, dtype=np.int64)
    ts = np.array([5, 5, 7, 7, 3, 9], dtype=np.int64)
    end = ts.copy()
    rng_pos, query_pos = np.array([0, 2]), np.array([1, 3, 4, 5])
    parent = np.full(6, -1, dtype=np.int64)
    depth = np.zeros(6, dtype=np.int64)
    got = CT._innermost_range_at(group, ts, end, rng_pos, parent, depth, query_pos)
    assert got.tolist() == [-1, -1, -1, -1]
    # with one non-empty range on another thread: still nothing on thread 0
    group2 = np.r_[group, 1, 1]
    ts2, end2 = np.r_[ts, 0, 4], np.r_[end, 10, 4]
    got = CT._innermost_range_at(group2, ts2, end2, np.array([0, 2, 6]), np.full(8, -1), np.zeros(8, np.int64),
                                 np.array([1, 3, 4, 5, 7]))
    assert got.tolist() == [-1, -1, -1, -1, 6]


def test_build_tree_when_every_duration_is_zero(tmp_path):
    # a zero-duration op encloses nothing: the calls have no parent and no launching op by time; the
    # External id still names the op (rule 1 of the module's docstring)
    p = _write(tmp_path, [
        _x("aten::a", "cpu_op", 100, 0, **{"External id": 5}),
        _x("aten::b", "cpu_op", 100, 0, **{"External id": 6}),
        _x("cudaLaunchKernel", "cuda_runtime", 100, 0, correlation=11),
        _x("cudaLaunchKernel", "cuda_runtime", 103, 0, correlation=12, **{"External id": 6}),
        _x("k1", "kernel", 110, 0, pid=0, tid=7, correlation=11, stream=7),
        _x("k2", "kernel", 111, 0, pid=0, tid=7, correlation=12, stream=7, **{"External id": 6}),
    ])
    events = tracelens.load(p, cache=False).events
    tree = CT.build_tree(events)
    rt = tree[tree["kind"] == CT.KIND_RUNTIME].sort_values("ts")
    assert rt["parent"].tolist() == [-1, -1] and rt["depth"].tolist() == [0, 0]
    names = dict(zip(tree.index, tree["name"].astype(str)))
    assert [names.get(i, None) for i in rt["inner_op"]] == [None, "aten::b"]
    ops = tree[tree["kind"] == CT.KIND_OP]
    assert (ops["parent"] == -1).all() and (ops["self_dur"] == 0).all()
    gpu = CT.attribute_gpu(CT.gpu_events(events), tree, CT.steps_table(tree)).sort_values("ts")
    assert gpu["op"].astype(str).tolist() == ["", "aten::b"]


def test_gpu_only_trace_empty_tree_and_attribution(tmp_path):
    p = _write(tmp_path, [
        _x("k1", "kernel", 100, 40, pid=0, tid=7, correlation=1, stream=7),
        _x("k2", "kernel", 120, 50, pid=0, tid=8, correlation=2, stream=8),
        _x("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 200, 10, pid=0, tid=7, correlation=3, stream=7),
    ])
    trace = tracelens.load(p, cache=False)
    tree = CT.build_tree(trace.events)
    assert tree.empty
    full = CT.build_tree(tracelens.load(MOE_GROUPED, cache=False).events)
    assert list(tree.columns) == list(full.columns)  # same schema as a real tree
    assert isinstance(tree["path"].dtype, pd.CategoricalDtype) and isinstance(tree["name"].dtype, pd.CategoricalDtype)
    gpu = CT.attribute_gpu(CT.gpu_events(trace.events), tree, CT.steps_table(tree))
    assert len(gpu) == 3 and (gpu["op_row"] == -1).all() and (gpu["launch"] == -1).all()
    assert set(gpu["op"].astype(str)) == {""} and set(gpu["path"].astype(str)) == {""}
    # the whole analysis: GPU figures from the raw intervals (2 kernels + 1 memcpy; union [100,170) +
    # [200,210) = 80 us busy, span 110 us), no ops, a warning naming the file
    a = tracelens.analyze(trace)
    s = a.summary()
    r = s["ranks"][0]
    assert r["kernel_count"] == 2 and r["gpu_busy_us"] == pytest.approx(80.0) and r["span_us"] == pytest.approx(110.0)
    assert r["memcpy_us"] == pytest.approx(10.0) and r["compute_us"] == pytest.approx(70.0)
    assert a.ops.empty and len(a.kernels) == 3
    assert f"{p}: GPU-only trace, no CPU events: GPU timeline and kernels only, no op or call-tree figures" in s["warnings"]
    assert not any("could be linked" in w for w in s["warnings"])


def _lexsort_order(rank, pid, tid, ts, dur, kind):
    return np.lexsort((kind, -dur, ts, tid, pid, rank))


@pytest.mark.parametrize("path", [MOE_LOOP, MI250, DIFF_TEST, NCCL_2RANK], ids=lambda p: p.name)
def test_thread_time_order_is_the_lexsort_on_fixtures(path):
    host = CT.host_events(tracelens.load(path, cache=False).events)
    cols = [host[c].to_numpy() for c in ("rank", "pid", "tid", "ts", "dur", "kind")]
    assert np.array_equal(CT.thread_time_order(*cols), _lexsort_order(*cols))


def test_thread_time_order_is_the_lexsort_on_any_input():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    small = st.integers(0, 3)
    row = st.tuples(small, st.sampled_from([1, 7, 2**40, -5]), st.sampled_from([3, 2**47 + 1, -2]),
                    st.integers(-20, 20), st.sampled_from([0, 1, 5, 2**30]), st.integers(0, 3))

    @settings(max_examples=300, deadline=None)
    @given(st.lists(row, min_size=0, max_size=60), st.sampled_from([0, 10**15, -(10**12)]))
    def check(rows, base):
        a = np.array(rows, dtype=np.int64).reshape(-1, 6)
        cols = [a[:, 0].astype(np.int32), a[:, 1], a[:, 2], a[:, 3] + base, a[:, 4], a[:, 5].astype(np.int8)]
        assert np.array_equal(CT.thread_time_order(*cols), _lexsort_order(*cols))

    check()


def test_thread_time_order_with_one_thread_and_an_overflowing_span():
    """Constant rank/pid/tid columns skip the factorization; a span past int64 still takes the lexsort."""
    n = 40
    rng = np.random.default_rng(5)
    for ts in (rng.integers(0, 30, n), rng.integers(-(2**62), 2**62, n)):
        cols = [np.zeros(n, np.int32), np.full(n, 7), np.full(n, 2**40), ts, rng.integers(0, 3, n),
                rng.integers(0, 4, n).astype(np.int8)]
        assert np.array_equal(CT.thread_time_order(*cols), _lexsort_order(*cols))


def test_first_match_is_the_index_lookup_of_first_occurrences():
    """`_first_match` against pd.Index with duplicates dropped + get_indexer, sorted, nearly sorted and random."""
    rng = np.random.default_rng(11)
    for keys in (np.arange(50), np.r_[np.arange(30), 5, 31, 2, 40], rng.integers(-5, 40, 200), np.array([], np.int64),
                 np.array([3, 3, 3]), np.array([2**62, -(2**62), 0])):
        keys = keys.astype(np.int64)
        queries = np.r_[rng.integers(-8, 45, 100), keys[:5]].astype(np.int64)
        idx = pd.Index(keys)
        first = ~idx.duplicated()
        hit = idx[first].get_indexer(queries)
        expect = np.full(len(queries), -1)
        expect[hit >= 0] = np.flatnonzero(first)[hit[hit >= 0]]
        assert np.array_equal(CT._first_match(keys, queries), expect), keys


def test_thread_time_order_falls_back_when_the_key_would_overflow():
    n = 50
    rng = np.random.default_rng(3)
    ts = rng.integers(-(2**62), 2**62, n)  # a span past int64 once threads multiply it
    cols = [np.zeros(n, np.int32), rng.integers(0, 9, n), rng.integers(0, 9, n), ts, rng.integers(0, 3, n),
            rng.integers(0, 4, n).astype(np.int8)]
    assert np.array_equal(CT.thread_time_order(*cols), _lexsort_order(*cols))


# ------------------------------------------------------------------ the compiled linking (_tree.c) = the vectorized


def _vectorized(monkeypatch):
    """Run the rest of the test on the vectorized linking (as without the compiled module)."""
    monkeypatch.setattr(CT, "_tree", None)


def _link_both(monkeypatch, group, ts, end, kind, name, step):
    pos_t = np.int32
    got = CT._link_sorted(group.astype(np.int32), ts, end, kind.astype(np.int8), name, step, pos_t)
    with monkeypatch.context() as m:
        _vectorized(m)
        ref = CT._link_sorted(group.astype(np.int32), ts, end, kind.astype(np.int8), name, step, pos_t)
    return got, ref


def _assert_links_equal(got, ref):
    for x, y, what in zip(got[:5], ref[:5], ("parent", "depth", "inner", "outer", "path")):
        if what == "path":  # path ids are numbered differently: the paths they stand for are the same
            x, y = resolve(x, got[5], got[6]), resolve(y, ref[5], ref[6])
            assert x == y, what
        else:
            assert np.array_equal(np.asarray(x), np.asarray(y)), what
    assert got[7] == ref[7]  # nested


def _random_events(rng, n_threads=3, n=120, span=60, nested=False):
    """Random sorted host events (ranges and runtime calls) on a few threads: zero lengths, equal starts and
    ends, ranges outlasting their parents unless `nested`."""
    rows = []
    for g in range(n_threads):
        if nested:
            def build(lo, hi, depth):
                t = lo
                while t < hi and depth < 5:
                    a = int(rng.integers(t, hi + 1))
                    b = int(rng.integers(a, hi + 1))
                    rows.append((g, a, b, int(rng.integers(0, 4)), int(rng.integers(-1, 4))))
                    if b > a:
                        build(a, b, depth + 1)
                    t = b + int(rng.integers(0, 3))
            build(0, span, 0)
        else:
            for _ in range(n // n_threads):
                a = int(rng.integers(0, span))
                b = a + int(rng.choice([0, 0, 1, 2, 5, 20, 40]))
                rows.append((g, a, b, int(rng.integers(0, 4)), int(rng.integers(-1, 4))))
    arr = np.array(rows, dtype=np.int64).reshape(-1, 5)
    g, ts, end, kind, name = arr.T
    order = np.lexsort((kind, -(end - ts), ts, g))
    step = (rng.random(len(arr)) < 0.15) & (kind == CT.KIND_ANNOTATION)
    return g[order], ts[order], end[order], kind[order], name[order], step[order]


@pytest.mark.skipif(CT._tree is None, reason="the compiled linking is not built")
@pytest.mark.parametrize("seed", range(40))
def test_compiled_linking_is_the_vectorized_on_random_events(monkeypatch, seed):
    rng = np.random.default_rng(seed)
    events = _random_events(rng, nested=seed % 2 == 0)
    got, ref = _link_both(monkeypatch, *events)
    _assert_links_equal(got, ref)


@pytest.mark.skipif(CT._tree is None, reason="the compiled linking is not built")
def test_compiled_linking_leaves_negative_durations_to_the_vectorized(monkeypatch):
    g, ts, end, kind, name, step = _random_events(np.random.default_rng(1))
    r = np.flatnonzero(kind != CT.KIND_RUNTIME)[3]
    end = end.copy()
    end[r] = ts[r] - 1
    out = [np.empty(len(ts), np.int32) for _ in range(5)]
    assert CT._tree.link(g.astype(np.int32), ts, end, kind.astype(np.int8), name.astype(np.int32),
                         step.view(np.uint8), *out) is None
    got, ref = _link_both(monkeypatch, g, ts, end, kind, name, step)
    _assert_links_equal(got, ref)


@pytest.mark.skipif(CT._tree is None, reason="the compiled linking is not built")
@pytest.mark.parametrize("path", [MOE_LOOP, MOE_GROUPED, MI250, NCCL_2RANK, DIFF_TEST], ids=lambda p: p.name)
def test_build_tree_compiled_is_the_vectorized_on_fixtures(monkeypatch, path):
    events = tracelens.load(path, cache=False).events
    got = CT.build_tree(events)
    _vectorized(monkeypatch)
    pd.testing.assert_frame_equal(got, CT.build_tree(events), check_exact=True)

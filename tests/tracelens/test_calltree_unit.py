"""The vectorized range linker against the plain stack walk, on real traces and on hand-made cases."""

from __future__ import annotations

import numpy as np
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

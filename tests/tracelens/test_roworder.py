"""Row order of the events table (tracelens/io/roworder.py): the call tree's events first, so the tree
shares their columns. Checked against the raw JSON and a plain predicate written here."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest

import tracelens
from tracelens import categories as C
from tracelens.io.roworder import tree_mask, tree_rows_first

from ..conftest import NCCL_2RANK, raw_events
from ..conftest import is_tree_event as is_tree


PHS = ["X", "i", "I", None]
CATS = ["cpu_op", "Operator", "user_annotation", "cuda_runtime", "cuda_driver", "Runtime", "python_function", "Python",
        "kernel", "gpu_memcpy", "Trace", "cuda_sync", "", None]
NAMES = ["nn.Module: Linear", "aten::mm", "nn.Module:", "f.py(3): g", "", None]


def test_call_tree_mask_is_the_predicate_on_every_combination():
    combos = list(itertools.product(PHS, CATS, NAMES))
    rng = np.random.default_rng(3)
    rows = [combos[i] for i in rng.integers(0, len(combos), 3000)] + combos

    def coded(col):  # codes in order of first appearance, None -> -1 (missing)
        uniq = [v for v in dict.fromkeys(col) if v is not None]
        return np.array([-1 if v is None else uniq.index(v) for v in col], dtype=np.int16), uniq

    ph, cat, name = (coded([r[k] for r in rows]) for k in range(3))
    got = C.call_tree_mask(ph, cat, name)
    want = np.array([is_tree(*(v or "" for v in r)) for r in rows])
    assert got.tolist() == want.tolist()
    assert [C.is_call_tree_event(*(v or "" for v in r)) for r in combos] == [is_tree(*(v or "" for v in r)) for r in combos]


def _table(rows):
    return pa.table({"ph": pa.array([r[0] for r in rows]).dictionary_encode(),
                     "cat": pa.array([r[1] for r in rows]).dictionary_encode(),
                     "name": pa.array([r[2] for r in rows]).dictionary_encode(),
                     "i": pa.array(np.arange(len(rows)))})


def test_tree_rows_first_is_a_stable_partition_and_leaves_ordered_tables_alone():
    rows = [("X", "kernel", "k"), ("X", "cpu_op", "a"), ("i", "cpu_op", "mark"), ("X", "cuda_runtime", "launch"),
            ("X", "python_function", "nn.Module: M"), ("X", "python_function", "g"), ("X", "user_annotation", "s"),
            ("X", "kernel", "k2")]
    t, k = tree_rows_first([_table(rows)])
    assert k == 4
    assert t["i"].to_pylist() == [1, 3, 4, 6, 0, 2, 5, 7]
    assert t["name"].to_pylist() == ["a", "launch", "nn.Module: M", "s", "k", "mark", "g", "k2"]
    assert tree_mask(t).tolist() == [True] * 4 + [False] * 4
    again, k2 = tree_rows_first([t])
    assert k2 == 4 and again is t  # in order already: the same table, nothing copied
    empty, k0 = tree_rows_first([_table([("X", "kernel", "k")])])
    assert k0 == 0 and empty["i"].to_pylist() == [0]


def test_two_ranks_stack_their_tree_parts_before_their_other_parts():
    t = tracelens.load(NCCL_2RANK, cache=False, progress=False)
    ev = t.events
    want_tree, want_rest = [], []
    for rank in (0, 1):
        for e in raw_events(NCCL_2RANK / f"rank{rank}.json.gz"):
            if e.get("ph") not in ("X", "i", "I"):
                continue
            (want_tree if is_tree(e.get("ph"), e.get("cat", ""), e.get("name", "")) else want_rest).append(
                (rank, e.get("name", "")))
    got = list(zip(ev["rank"].tolist(), ev["name"].astype(str).tolist()))
    assert got == want_tree + want_rest
    a = tracelens.analyze(t)
    assert len(a.tree) == len(want_tree) and a.tree.index.equals(ev.index[: len(want_tree)])
    assert np.shares_memory(a.tree["ts"].to_numpy(), ev["ts"].to_numpy())
    # row labels still link the tables: every GPU event's launch is a runtime row of the tree
    launched = a.gpu["launch"].to_numpy()
    launched = launched[launched >= 0]
    assert len(launched) and (a.tree.loc[launched, "kind"] == 3).all()


@pytest.mark.parametrize("cached", [False, True])
def test_a_frame_not_in_loader_order_gets_the_same_tree(cached, tmp_path):
    t = tracelens.load(NCCL_2RANK / "rank0.json.gz", cache=cached, cache_dir=str(tmp_path), progress=False)
    a = tracelens.analyze(t)
    # the same events in another row order (labels kept): the tree is copied, with the same rows and links
    shuffled = t.events.iloc[np.random.default_rng(0).permutation(len(t.events))]
    from tracelens.analysis import calltree

    b = calltree.build_tree(shuffled).sort_index()
    assert b.index.tolist() == a.tree.index.tolist()
    for c in ("parent", "inner_op", "outer_op", "depth", "self_dur", "kind", "step"):
        assert b[c].tolist() == a.tree[c].tolist(), c
    assert b["path"].astype(str).tolist() == a.tree["path"].astype(str).tolist()


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("which", ["two_ranks", "foreign"])
def test_the_trace_says_how_many_first_rows_are_the_tree_counted_from_the_raw_json(which, cached, tmp_path):
    # the load records how many leading rows are the call tree's (Trace.tree_rows, from the parse's meta, also
    # when the file comes from the cache), and the call tree takes them without looking for them again
    from ..conftest import DIFF_CONTROL

    files = [NCCL_2RANK / "rank0.json.gz", NCCL_2RANK / "rank1.json.gz"] if which == "two_ranks" else [DIFF_CONTROL]
    path = NCCL_2RANK if which == "two_ranks" else DIFF_CONTROL
    if cached:
        tracelens.load(path, cache=True, cache_dir=str(tmp_path), progress=False)  # fills the cache
    t = tracelens.load(path, cache=cached, cache_dir=str(tmp_path), progress=False)
    assert all(r.from_cache for r in t.ranks) == cached
    want = sum(is_tree(e.get("ph"), e.get("cat", ""), e.get("name", "")) for f in files for e in raw_events(f)
               if e.get("ph") in ("X", "i", "I"))
    assert t.tree_rows == want > 0
    ev = t.events
    mask = np.array([is_tree(p, c, n) for p, c, n in zip(ev["ph"].astype(str), ev["cat"].astype(str),
                                                          ev["name"].astype(str))])
    assert mask[:want].all() and not mask[want:].any()
    from tracelens.analysis import calltree

    a = tracelens.analyze(t)
    assert len(a.tree) == want and a.tree.index.equals(ev.index[:want])
    found = calltree.host_events(ev)  # looked for in the rows: the same table
    given = calltree.host_events(ev, leading=want)
    assert found.index.equals(given.index) and found.columns.equals(given.columns)
    assert all(found[c].equals(given[c]) for c in found.columns)
    with pytest.raises(ValueError, match="not a row count"):
        calltree.host_events(ev, leading=len(ev) + 1)


def test_a_table_without_its_count_is_ordered_and_counted_by_the_concat():
    # a cache entry written before the count was kept: _concat_ranks finds the tree rows itself and fills the count in
    from tracelens.trace import RankInfo, _concat_ranks

    rows = [("X", "kernel", "k"), ("X", "cpu_op", "a"), ("X", "python_function", "g"), ("X", "cuda_runtime", "l")]
    counts = [None]
    ev = _concat_ranks([_table(rows)], [RankInfo(rank=0, path="x")], events=True, tree_rows=counts)
    assert counts == [2] and ev["name"].astype(str).tolist() == ["a", "l", "k", "g"]

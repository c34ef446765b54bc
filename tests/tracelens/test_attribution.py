"""Kernel -> op attribution, exactly: every GPU event is credited to the op that launched it.

"The op that launched a GPU event" (the definition `tracelens.analysis.calltree` implements):

1. The launch is the runtime call (`cuda_runtime` / `cuda_driver`) on the same rank carrying the GPU
   event's `correlation` (the first one in the file when several share it).
2. Where the trace names the op: the runtime call's `External id` (or, when the call has none or there
   is no call, the GPU event's own) equals the `External id` of a CPU op on the same rank; that op
   launched it. Older Kineto writes the correlation id into the `External id` of runtime calls and GPU
   events; on a rank where every such id merely repeats the correlation, the ids name no op.
3. Otherwise: the innermost CPU op enclosing the runtime call on the same thread, by time, with
   half-open intervals [ts, ts + dur): an op ending at the instant the call starts does not enclose it
   (so a child ending in the same microsecond as its parent leaves neither open after that instant), a
   zero-duration op encloses nothing. Innermost = the latest start; at equal starts the one ending
   first; at equal start and end the one entered later (larger External id, else later in the file).
4. Neither: the GPU event has no launching op.

The reference below implements this from the raw JSON events with the standard library only (a sweep
over each thread's ops, dictionaries for the ids); nothing from tracelens is used to compute it. The
tests hold tracelens's per-event links, ops table and kernels table to it, to the nanosecond, on every
fixture we have and on synthetic traces full of microsecond ties and zero-duration ops.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
import os
import random
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest

import tracelens
from tracelens.analysis import calltree as CT, summaries

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
# Three more public traces (AMD TraceLens test data, MIT; ../shared/fixtures/README.md beside this project's
# workspace) not copied here (5.4 MB together): checked where that directory, or TRACELENS_CORPUS_EXTERNAL (a copy
# of it, as benchmarks/bench_load.py reads it), is present, skipped with its path otherwise.
EXTERNAL_ELSEWHERE = Path(os.environ.get("TRACELENS_CORPUS_EXTERNAL") or ROOT.parent / "shared" / "fixtures" / "external")
ELSEWHERE = ["tracelens/h100_owlv2_inference.json.gz", "tracelens/h100_timesformer.json.gz",
             "tracelens/mi300_sglang_qwen3_8b_prefilldecode.json.gz"]

OP_CATS = {"cpu_op", "Operator"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "Runtime"}
GPU_CATS = {"kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset"}


# ------------------------------------------------------------------------------ the reference


def ns(v) -> int:
    """Microseconds (a JSON number read as Decimal or int) -> integer nanoseconds."""
    return int((Decimal(v) * 1000).to_integral_value())


def int_arg(e: dict, key: str):
    v = (e.get("args") or {}).get(key)
    if isinstance(v, bool) or not isinstance(v, (int, Decimal)):
        return None
    return int(v)


def reference(events: list[dict]) -> dict:
    """Launching op of every GPU event of one rank's trace: {"gpu": [(key, op index or None, dur_ns)],
    "ops": {index: op event}}; key = (ts_ns, dur_ns, name, correlation) names the GPU event."""
    xs = [(i, e) for i, e in enumerate(events) if e.get("ph") == "X"]
    ops = [(i, e) for i, e in xs if e.get("cat") in OP_CATS]
    rts = [(i, e) for i, e in xs if e.get("cat") in RUNTIME_CATS]
    gpus = [(i, e) for i, e in xs if e.get("cat") in GPU_CATS]

    pairs = [(int_arg(e, "External id"), int_arg(e, "correlation")) for _, e in rts + gpus]
    ids_name_ops = any(x is not None and c is not None and x != c for x, c in pairs)
    op_by_ext: dict[int, int] = {}
    for i, e in ops:
        x = int_arg(e, "External id")
        if x is not None and x not in op_by_ext:
            op_by_ext[x] = i
    rt_by_corr: dict[int, tuple[int, dict]] = {}
    for i, e in rts:
        c = int_arg(e, "correlation")
        if c is not None and c not in rt_by_corr:
            rt_by_corr[c] = (i, e)

    # innermost enclosing op of each runtime call: sweep each thread's calls in time order, keeping the
    # ops started so far that are still open
    thread_ops = collections.defaultdict(list)
    for i, e in ops:
        s = ns(e["ts"])
        x = int_arg(e, "External id")
        thread_ops[(e.get("pid"), e.get("tid"))].append((s, s + ns(e.get("dur", 0)), -1 if x is None else x, i))
    thread_calls = collections.defaultdict(list)
    for i, e in rts:
        thread_calls[(e.get("pid"), e.get("tid"))].append((ns(e["ts"]), i))
    enclosing: dict[int, int] = {}
    for thr, calls in thread_calls.items():
        todo = sorted(thread_ops.get(thr, []))
        k, open_ops = 0, []
        for t, i in sorted(calls):
            while k < len(todo) and todo[k][0] <= t:
                open_ops.append(todo[k])
                k += 1
            open_ops = [o for o in open_ops if o[1] > t]
            if open_ops:  # latest start, then earliest end, then entered later, then later in the file
                enclosing[i] = max(open_ops, key=lambda o: (o[0], -o[1], o[2], o[3]))[3]

    out = []
    for _, e in gpus:
        c = int_arg(e, "correlation")
        rt = rt_by_corr.get(c) if c is not None else None
        op = None
        if ids_name_ops:
            x = int_arg(rt[1], "External id") if rt is not None else None
            if x is None:
                x = int_arg(e, "External id")
            op = op_by_ext.get(x) if x is not None else None
        if op is None and rt is not None:
            op = enclosing.get(rt[0])
        d = ns(e.get("dur", 0))
        out.append(((ns(e["ts"]), d, e.get("name"), c), op, d))
    return {"gpu": out, "ops": dict(ops)}


def dims_key(v) -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return v
    return json.dumps(v, separators=(",", ":"), default=str)


def read_events(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f, parse_float=Decimal)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


# ------------------------------------------------------------------------------ the comparison


def tables(path: Path, full: bool):
    """(tree, gpu, ops table, kernels table) of the whole trace: `tracelens.analyze(window="all")`, or,
    for the large fixtures, the same four calls analyze makes for them (no pipeline and comm sections)."""
    trace = tracelens.load(path, cache=False)
    if full:
        a = tracelens.analyze(trace, window="all")
        return a.tree, a.gpu, a.ops, a.kernels
    tree = CT.build_tree(trace.events)
    gpu = CT.attribute_gpu(CT.gpu_events(trace.events), tree, CT.steps_table(tree))
    return tree, gpu, summaries.ops_summary(tree, gpu, 1.0), summaries.kernel_summary(gpu, 1.0)


def check_against_reference(path: Path, full: bool = True) -> dict:
    """tracelens vs the reference on one single-rank trace file; returns {corr: op name} of tracelens."""
    ref = reference(read_events(path))
    tree, g, ops_table, kernels_table = tables(path, full)

    def op_id(e):
        return None if e is None else (ns(e["ts"]), ns(e.get("dur", 0)), e.get("name"), e.get("tid"))

    want = collections.Counter((k, op_id(ref["ops"].get(op))) for k, op, _ in ref["gpu"])
    t_ts, t_dur = dict(zip(tree.index, tree["ts"])), dict(zip(tree.index, tree["dur"]))
    t_name, t_tid = dict(zip(tree.index, tree["name"].astype(str))), dict(zip(tree.index, tree["tid"]))
    got = collections.Counter()
    for ts, dur, name, corr, row in zip(g["ts"].tolist(), g["dur"].tolist(), g["name"].astype(str).tolist(),
                                        g["correlation"].tolist(), g["op_row"].tolist()):
        op = None if row < 0 else (t_ts[row], t_dur[row], t_name[row], t_tid[row])
        got[((ts, dur, name, corr if corr >= 0 else None), op)] += 1
    assert got == want, (f"{path.name}: {sum((want - got).values())} GPU events credited to another op, e.g. "
                         f"{list((want - got).items())[:2]} vs {list((got - want).items())[:2]}")

    # ops table: GPU time per (op, input shapes), to the nanosecond
    per_op = collections.Counter()
    per_kernel = collections.Counter()
    for (_, _, kname, _), op, d in ref["gpu"]:
        oname = ref["ops"][op].get("name") if op is not None else ""
        per_kernel[(kname, oname)] += d
        if op is not None:
            per_op[(oname, dims_key((ref["ops"][op].get("args") or {}).get("Input Dims")))] += d
    table = collections.Counter()
    for op, dims, us in zip(ops_table["op"], ops_table["input_dims"], ops_table["gpu_total_us"]):
        table[(op, dims_key(dims))] += round(us * 1000)
    table = +table  # ops without GPU time are not in the reference
    assert table == per_op, f"{path.name}: ops table differs from the reference"

    # kernels table: GPU time per (kernel name, launching op)
    ktab = collections.Counter()
    for k, op, us in zip(kernels_table["kernel"], kernels_table["op"], kernels_table["total_us"]):
        ktab[(k, op)] += round(us * 1000)
    assert +ktab == +per_kernel, f"{path.name}: kernels table differs from the reference"
    return {c: (t_name[r] if r >= 0 else None) for c, r in zip(g["correlation"].tolist(), g["op_row"].tolist())}


NOT_TRACES = {"manifest.json", "routing.json", "measured.json"}  # run manifests, routing counts, measured grids


def all_fixture_files() -> list[Path]:
    """Every trace in tests/fixtures (run dirs' traces and the external copies), each content once."""
    seen, out = set(), []
    for p in sorted(FIXTURES.rglob("*.json*")):
        if not p.name.endswith((".json", ".json.gz")) or p.name in NOT_TRACES:
            continue
        digest = hashlib.blake2b(p.read_bytes(), digest_size=16).digest()
        if digest not in seen:
            seen.add(digest)
            out.append(p)
    return out


FIXTURE_FILES = all_fixture_files()


def test_fixture_list_covers_ours_and_external():
    names = {p.name for p in FIXTURE_FILES}
    assert {"moe1gpu_loop.json.gz", "control.json.gz", "test.json.gz", "rank0.json.gz", "b200_eager.json.gz",
            "mi300_resnet_act_checkpoint.json.gz"} <= names
    assert any("external" in str(p) for p in FIXTURE_FILES) and any("h200_pp2_run" in str(p) for p in FIXTURE_FILES)


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_every_fixture_matches_reference(path):
    check_against_reference(path, full=path.stat().st_size < 300_000)


@pytest.mark.parametrize("rel", ELSEWHERE)
def test_traces_outside_the_repository_match_reference(rel):
    path = EXTERNAL_ELSEWHERE / rel
    if not path.is_file():
        pytest.skip(f"{path} not present (public AMD TraceLens test data, not copied into tests/fixtures)")
    check_against_reference(path, full=False)


# ------------------------------------------------------------------------------ synthetic traces

BASE = 1_695_835_500_000_000  # µs, whole microseconds as older Kineto writes them


def _op(name, ts, dur, ext=None, tid=1, dims=None):
    args = {}
    if ext is not None:
        args["External id"] = ext
    if dims is not None:
        args["Input Dims"] = dims
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": BASE + ts, "dur": dur, "args": args}


def _call(ts, corr, ext=None, tid=1, dur=1):
    args = {"correlation": corr}
    if ext is not None:
        args["External id"] = ext
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid, "ts": BASE + ts,
            "dur": dur, "args": args}


def _kernel(corr, ext=None, dur=None):
    args = {"correlation": corr, "device": 0, "stream": 7}
    if ext is not None:
        args["External id"] = ext
    return {"ph": "X", "cat": "kernel", "name": f"kernel_{corr}", "pid": 0, "tid": 7,
            "ts": BASE + 5000 + 50 * corr, "dur": dur if dur is not None else 3 + corr % 17, "args": args}


def _write(tmp_path, events, name="t.json"):
    p = tmp_path / name
    p.write_text(json.dumps({"traceEvents": events}))
    return p


# One thread of ops with every tie we know of. (op name, ts, dur, External id) in the order written.
TIE_OPS = [
    ("outer", 0, 1000, 1),
    ("aten::parent", 100, 10, 2), ("aten::child", 105, 5, 3),          # child ends in the parent's µs
    ("aten::zeros", 120, 0, 4),                                          # zero-duration, alone
    ("aten::as_strided", 130, 0, 5), ("aten::launcher_a", 130, 10, 6),   # zero-duration op before the launcher
    ("aten::launcher_b", 150, 10, 7), ("aten::result_type", 150, 0, 8),  # zero-duration op after the launcher
    ("aten::launcher_c", 170, 5, 9), ("aten::zeros", 175, 0, 10),        # zero-duration op at the launcher's end
    ("aten::empty", 180, 0, 11), ("aten::as_strided", 180, 0, 12),       # nested zero-duration ops
    ("a1", 200, 30, 13), ("a2", 210, 20, 14), ("a3", 220, 10, 15),       # three ops ending in one µs
    ("aten::inner_same", 300, 10, 17), ("aten::outer_same", 300, 10, 16),  # identical intervals, child first
]
# (correlation, call ts, thread, the op that launched it)
TIE_CALLS = [
    (1, 107, 1, "aten::child"), (2, 109, 1, "aten::child"), (3, 110, 1, "outer"),
    (4, 120, 1, "outer"), (5, 130, 1, "aten::launcher_a"), (6, 150, 1, "aten::launcher_b"),
    (7, 175, 1, "outer"), (8, 180, 1, "outer"), (9, 229, 1, "a3"), (10, 230, 1, "outer"),
    (11, 305, 1, "aten::inner_same"), (12, 107, 2, "other_thread"), (13, 500, 3, None),
]


def tie_trace(style: str) -> tuple[list[dict], dict]:
    """The tie cases as a trace; style 'none' (no External ids on calls/kernels), 'old' (the correlation
    copied into them, numerically equal to unrelated ops' ids: a trap), 'named' (ids naming the ops)."""
    ev = [_op(n, ts, d, x) for n, ts, d, x in TIE_OPS] + [_op("other_thread", 0, 1000, 20, tid=2)]
    ext_of = {n: x for n, _, _, x in TIE_OPS} | {"other_thread": 20}
    want = {}
    for corr, ts, tid, op in TIE_CALLS:
        c = corr + (1000 if style == "named" else 0)
        x = {"none": None, "old": c, "named": ext_of.get(op)}[style]
        ev += [_call(ts, c, x, tid=tid), _kernel(c, x)]
        want[c] = op
    ev.append(_kernel(99 + (1000 if style == "named" else 0), 99 if style == "old" else None))  # no call
    want[99 + (1000 if style == "named" else 0)] = None
    if style == "named":
        # the trace's id decides against time: a call rounded past a1's end, a kernel without a call,
        # a call without an id whose kernel names the op
        ev += [_call(240, 1100, 13), _kernel(1100, 13)]
        want[1100] = "a1"
        ev.append(_kernel(1101, 6))
        want[1101] = "aten::launcher_a"
        ev += [_call(107, 1102, None), _kernel(1102, 2)]
        want[1102] = "aten::parent"
    return ev, want


@pytest.mark.parametrize("style", ["none", "old", "named"])
def test_tie_cases(tmp_path, style):
    ev, want = tie_trace(style)
    path = _write(tmp_path, ev)
    # the reference agrees with the hand-made answers ...
    ref = reference(json.loads(path.read_text(), parse_float=Decimal)["traceEvents"])
    ref_names = {k[3]: (ref["ops"][op]["name"] if op is not None else None) for k, op, _ in ref["gpu"]}
    assert ref_names == want
    # ... and tracelens agrees with both, per kernel and in the ops / kernels tables
    got = check_against_reference(path)
    assert got == want


def test_child_ending_with_parent_keeps_nothing_open(tmp_path):
    """The bug this fixes: with whole-µs timestamps, a child ending in its parent's µs stayed 'open', so
    the next launches of the enclosing op were credited to it (and to zero-duration ops)."""
    ev, want = tie_trace("none")
    a = tracelens.analyze(tracelens.load(_write(tmp_path, ev), cache=False), window="all")
    ops = a.ops.groupby("op")["gpu_total_us"].sum()
    k = {c: d for c, d in ((e["args"]["correlation"], e["dur"]) for e in ev if e["cat"] == "kernel")}
    assert ops["outer"] * 1000 == pytest.approx(sum(k[c] * 1000 for c, op in want.items() if op == "outer"))
    for zero in ("aten::zeros", "aten::as_strided", "aten::result_type", "aten::empty"):
        assert ops.get(zero, 0.0) == 0.0
    runtime = a.tree[a.tree["kind"] == CT.KIND_RUNTIME]
    names = a.tree["name"].astype(str)
    inner = {int(c): (names.loc[r] if r >= 0 else None) for c, r in zip(runtime["correlation"], runtime["inner_op"])}
    assert inner == {c: op for c, op in want.items() if c != 99}


# ------------------------------------------------------------------------------ random traces


def random_trace(seed: int) -> list[dict]:
    """Nested ops on three threads with integer-µs times and many ties (children starting or ending
    with their parent, zero-duration ops), sometimes a child outlasting its parent by 1 µs (rounding)
    or an nn.Module range partly overlapping ops; calls at op boundaries; ids of one of three styles;
    events written in random order."""
    rng = random.Random(seed)
    style = ["none", "old", "named"][seed % 3]
    ev, ops = [], []
    ext = [0]

    def build(lo, hi, tid, depth):
        t = lo
        while t <= hi and depth < 6 and rng.random() < 0.85:
            start = t if rng.random() < 0.4 else rng.randint(t, hi)
            r = rng.random()
            end = start if r < 0.2 else (hi if r < 0.45 else rng.randint(start, hi))
            if rng.random() < 0.05:
                end += 1  # outlasts its parent: a rounding artifact
            ext[0] += 1
            x = ext[0] if rng.random() < 0.9 else None
            e = _op(f"op{rng.randint(0, 9)}", start, end - start, x, tid=tid, dims=[[rng.randint(1, 3)]])
            ev.append(e)
            ops.append(e)
            if end > start:
                build(start, end, tid, depth + 1)
            t = end + rng.choice([0, 0, 1, 2])

    for tid in (1, 2, 3):
        build(0, 300, tid, 0)
        if rng.random() < 0.3:
            s = rng.randint(0, 250)
            ev.append({"ph": "X", "cat": "python_function", "name": "nn.Module: Block", "pid": 1, "tid": tid,
                       "ts": BASE + s, "dur": rng.randint(0, 60), "args": {}})
    times = [o["ts"] - BASE for o in ops] + [o["ts"] - BASE + o["dur"] for o in ops]
    for corr in range(1, 80):
        t = rng.choice(times) if times and rng.random() < 0.6 else rng.randint(0, 310)
        c = corr + (10_000 if style == "named" else 0)
        if style == "old":
            x = c
        elif style == "named":
            cands = [o for o in ops if o["args"].get("External id") is not None]
            x = rng.choice(cands)["args"]["External id"] if cands and rng.random() < 0.5 else None
        else:
            x = None
        kx = x if rng.random() < 0.8 else (c if style == "old" else None)
        if rng.random() < 0.93:
            ev.append(_call(t, c, x, tid=rng.choice([1, 2, 3]), dur=rng.choice([0, 1, 3])))
        ev.append(_kernel(c, kx))
        if rng.random() < 0.1:
            k2 = _kernel(c, kx, dur=7)
            k2["name"] += "_b"
            ev.append(k2)
    rng.shuffle(ev)
    return ev


@pytest.mark.parametrize("seed", range(30))
def test_random_traces_match_reference(tmp_path, seed):
    path = _write(tmp_path, random_trace(seed))
    check_against_reference(path)


# ------------------------------------------------------------------------------ the vectorized pieces


def test_previous_greater_matches_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 80))
        group = np.sort(rng.integers(0, 4, n))
        end = rng.integers(-5, 25, n)
        want = []
        for i in range(n):
            j = i - 1
            while j >= 0 and group[j] == group[i] and end[j] <= end[i]:
                j -= 1
            want.append(j if j >= 0 and group[j] == group[i] else -1)
        assert CT.previous_greater(group, end).tolist() == want


def test_innermost_op_at_matches_brute_force_without_nesting():
    rng = np.random.default_rng(2)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        group = rng.integers(0, 3, n)
        ts = rng.integers(0, 30, n)
        end = ts + rng.integers(-2, 15, n)  # overlapping freely, zero and negative lengths included
        order = np.lexsort((-end, ts, group))
        group, ts, end = group[order], ts[order], end[order]
        qg = rng.integers(0, 3, 50)
        qt = rng.integers(-2, 45, 50)
        got = CT.innermost_op_at(group, ts, end, qg, qt)
        for g_, t_, r in zip(qg, qt, got):
            open_ = [i for i in range(n) if group[i] == g_ and ts[i] <= t_ < end[i]]
            assert r == (max(open_, key=lambda i: (ts[i], -end[i], i)) if open_ else -1)


def test_innermost_range_at_long_trace_path_agrees():
    """The per-thread path taken when (thread, time) keys would overflow gives the same tops."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = 60
        group = np.sort(rng.integers(0, 3, n))
        ts = rng.integers(0, 50, n)
        dur = np.where(rng.random(n) < 0.3, 0, rng.integers(0, 20, n))
        order = np.lexsort((-dur, ts, group))
        group, ts, end = group[order], ts[order], (ts + dur)[order]
        kind = np.full(n, CT.KIND_OP)
        parent, depth = CT.link_ranges(group, ts, end, kind, np.zeros(n, np.int64), np.zeros(n, bool))[:2]
        # queries: runtime calls appended after the ranges in sorted order, at random times
        qn = 40
        qg, qt = rng.integers(0, 3, qn), rng.integers(0, 60, qn)
        all_g, all_ts = np.r_[group, qg], np.r_[ts, qt]
        all_end = np.r_[end, qt]
        par, dep = np.r_[parent, np.full(qn, -1)], np.r_[depth, np.zeros(qn, np.int64)]
        rng_pos, q_pos = np.arange(n), np.arange(n, n + qn)
        a = CT._innermost_range_at(all_g, all_ts, all_end, rng_pos, par, dep, q_pos)
        b = CT._innermost_range_at(all_g + (1 << 45), all_ts, all_end, rng_pos, par, dep, q_pos)
        assert a.tolist() == b.tolist()
        # and both are the walk's stack top: the innermost range open at t (nested input)
        for j, (g_, t_) in enumerate(zip(qg, qt)):
            open_ = [i for i in range(n) if group[i] == g_ and ts[i] <= t_ < end[i]]
            if open_ and all(end[i] <= end[parent[i]] for i in range(n) if parent[i] >= 0):
                assert a[j] == max(open_, key=lambda i: (ts[i], -end[i], i))


def test_multi_rank_load_keeps_ranks_apart():
    """External ids repeat across ranks: loaded together, each rank's GPU events still go to that rank's
    ops (checked against the reference run on each rank's file alone)."""
    run = ROOT / "tests" / "fixtures" / "h200_ep2_run" / "L3_torch"
    a = tracelens.analyze(tracelens.load(run, cache=False), window="all")
    g, tree = a.gpu, a.tree
    assert sorted(g["rank"].unique().tolist()) == [0, 1]
    t_key = dict(zip(tree.index, zip(tree["ts"], tree["dur"], tree["name"].astype(str), tree["tid"], tree["rank"])))
    got = collections.Counter(
        ((ts, dur, name, corr, rank), t_key[row][:4] if row >= 0 else None) for ts, dur, name, corr, rank, row in
        zip(g["ts"].tolist(), g["dur"].tolist(), g["name"].astype(str).tolist(), g["correlation"].tolist(),
            g["rank"].tolist(), g["op_row"].tolist()))
    assert all(row < 0 or t_key[row][4] == rank for rank, row in zip(g["rank"].tolist(), g["op_row"].tolist()))
    want = collections.Counter()
    for rank in (0, 1):
        ref = reference(read_events(run / "traces" / f"rank{rank}.json.gz"))
        for (ts, dur, name, corr), op, _ in ref["gpu"]:
            e = ref["ops"].get(op)
            want[((ts, dur, name, corr, rank),
                  None if e is None else (ns(e["ts"]), ns(e.get("dur", 0)), e.get("name"), e.get("tid")))] += 1
    assert got == want


@pytest.mark.parametrize("name", ["h200_moe_1gpu/moe1gpu_loop.json.gz", "external/hta/trace_diff/test.json.gz",
                                  "external/hta/benchmark_result_2869224_1695835535_trace.json.gz"])
def test_runtime_call_parents_match_a_stack_walk(name):
    """The parent range (op, annotation or nn.Module range) of every runtime call is the top of a plain
    stack walk over the thread's host events (parents before children: by start, longer first, ranges
    before calls), popping what has ended by the call's start: whole-µs ties and zero-duration ranges
    included."""
    tree = CT.build_tree(tracelens.load(ROOT / "tests" / "fixtures" / name, cache=False).events)
    cols = [tree[c].to_numpy() for c in ("rank", "pid", "tid", "ts", "dur", "kind", "external_id")]
    rows = sorted(range(len(tree)), key=lambda i: (cols[0][i], cols[1][i], cols[2][i], cols[3][i], -cols[4][i],
                                                   cols[5][i], cols[6][i], i))
    labels, parent = tree.index.to_numpy(), tree["parent"].to_numpy()
    want, got = {}, {}
    stack, thread = [], None
    for i in rows:
        thr = (cols[0][i], cols[1][i], cols[2][i])
        if thr != thread:
            stack, thread = [], thr
        while stack and cols[3][stack[-1]] + cols[4][stack[-1]] <= cols[3][i]:
            stack.pop()
        if cols[5][i] == CT.KIND_RUNTIME:
            want[labels[i]] = labels[stack[-1]] if stack else -1
            got[labels[i]] = parent[i]
        else:
            stack.append(i)
    assert want and got == want


# ------------------------------------------------------------------------------ bounded memory: chunked steps

@pytest.mark.parametrize("path", [ROOT / "tests" / "fixtures" / "h200_moe_1gpu" / "moe1gpu_loop.json.gz",
                                  ROOT / "tests" / "fixtures" / "external" / "hta" / "trace_diff" / "test.json.gz"],
                         ids=lambda p: p.name)
def test_chunked_steps_match_reference(monkeypatch, path):
    """build_tree places the runtime calls, and ops_summary sums its groups, a chunk of rows at a time
    (issue 20: temporaries bounded by the chunk, not the trace); with chunks of ~100 rows, so that every
    fixture spans many, the attribution and the ops / kernels tables still equal the reference."""
    monkeypatch.setattr(CT, "_QUERY_CHUNK", 97)
    monkeypatch.setattr(summaries, "_CHUNK", 101)
    check_against_reference(path, full=path.stat().st_size < 300_000)


@pytest.mark.parametrize("seed", range(5))
def test_chunked_steps_match_reference_random(monkeypatch, tmp_path, seed):
    monkeypatch.setattr(CT, "_QUERY_CHUNK", 3)
    monkeypatch.setattr(summaries, "_CHUNK", 5)
    check_against_reference(_write(tmp_path, random_trace(seed)))

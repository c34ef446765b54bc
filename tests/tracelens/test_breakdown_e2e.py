"""End-to-end numbers on real fixtures, checked against values computed here from the raw JSON.

The expected values use only the standard library on the raw events: exact Decimal timestamps, a
plain sort-and-merge union, and name matching for NCCL kernels. Nothing from tracelens is reused.
"""

from __future__ import annotations

import collections
from decimal import Decimal

import pytest

import tracelens
from tracelens.errors import TraceError

from ..conftest import (merged_length, ALEXNET, CPU_ONLY, DIFF_CONTROL, DIFF_TEST, GPU_TRACES, MI250, MOE_GROUPED, MOE_LOOP,
                        NCCL_2RANK, TRITON, raw_events)

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}




def expected_timeline(path):
    ev = [e for e in raw_events(path) if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    iv = lambda es: [(Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e.get("dur", 0))) for e in es]
    kern = [e for e in ev if e["cat"] == "kernel"]
    comm = [e for e in kern if "nccl" in e["name"].lower() or "rccl" in e["name"].lower()]
    comp = [e for e in kern if e not in comm]
    cpy = [e for e in ev if e["cat"] == "gpu_memcpy"]
    mst = [e for e in ev if e["cat"] == "gpu_memset"]
    start = min(s for s, _ in iv(ev))
    end = max(e for _, e in iv(ev))
    busy = merged_length(iv(ev))
    compute = merged_length(iv(comp))
    return {
        "span_us": end - start,
        "gpu_busy_us": busy,
        "gpu_idle_us": end - start - busy,
        "compute_us": compute,
        "comm_us": merged_length(iv(comm)),
        "memcpy_us": merged_length(iv(cpy)),
        "memset_us": merged_length(iv(mst)),
        "exposed_comm_us": merged_length(iv(comp + comm)) - compute,
        "kernel_count": len(kern),
    }


@pytest.mark.parametrize("path", GPU_TRACES, ids=lambda p: p.name)
def test_timeline_matches_raw(path):
    exp = expected_timeline(path)
    summary = tracelens.analyze(tracelens.load(path, cache=False)).summary()
    (rank,) = summary["ranks"]
    for key, want in exp.items():
        assert rank[key] == pytest.approx(float(want), abs=1e-3), key


def test_two_rank_nccl_timeline_and_steps():
    a = tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))
    s = a.summary()
    assert [r["rank"] for r in s["ranks"]] == [0, 1]
    for r, f in zip(s["ranks"], ["rank0.json.gz", "rank1.json.gz"]):
        exp = expected_timeline(NCCL_2RANK / f)  # the whole window; the default figures are steady-state
        assert r["all_steps"]["comm_us"] == pytest.approx(float(exp["comm_us"]), abs=1e-3)
        assert len(r["steps"]) == 3  # "## step N" annotations
    # per-step kernel counts: kernels whose launching runtime call lies inside the step annotation
    raw = raw_events(NCCL_2RANK / "rank0.json.gz")
    steps = [(Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"])) for e in raw
             if e.get("cat") == "user_annotation" and e["name"].startswith("## step")]
    launch_ts = {e["args"]["correlation"]: Decimal(e["ts"]) for e in raw
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    counts = collections.Counter()
    for e in raw:
        if e.get("cat") == "kernel":
            t = launch_ts[e["args"]["correlation"]]
            for i, (lo, hi) in enumerate(sorted(steps)):
                if lo <= t < hi:
                    counts[i] += 1
    got = {st["step"]: st["kernel_count"] for st in s["ranks"][0]["steps"]}
    assert got == dict(counts)


def innermost_op_of_kernels(path):
    """kernel (by correlation) -> name of the innermost cpu_op enclosing its launch, brute force."""
    raw = [e for e in raw_events(path) if e.get("ph") == "X"]
    ops = collections.defaultdict(list)
    for e in raw:
        if e.get("cat") == "cpu_op":
            ops[(e["pid"], e["tid"])].append((Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"]), e["name"]))
    out = {}
    for e in raw:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            t = Decimal(e["ts"])
            enclosing = [o for o in ops[(e["pid"], e["tid"])] if o[0] <= t < o[1]]
            if enclosing:  # innermost = latest start, then shortest
                out[e["args"]["correlation"]] = max(enclosing, key=lambda o: (o[0], -o[1]))[2]
    return {e["args"]["correlation"]: out.get(e["args"]["correlation"], "")
            for e in raw if e.get("cat") == "kernel"}


@pytest.mark.parametrize("path", [MOE_LOOP, MOE_GROUPED, MI250, NCCL_2RANK / "rank1.json.gz"], ids=lambda p: p.name)
def test_kernel_to_innermost_op(path):
    want = innermost_op_of_kernels(path)
    a = tracelens.analyze(tracelens.load(path, cache=False))
    k = a.gpu[a.gpu["kind"] == "kernel"]
    got = dict(zip(k["correlation"].tolist(), k["op"].astype(str).tolist()))
    assert got == want


def test_ops_summary_gpu_time_of_mm():
    path = MOE_LOOP
    want = innermost_op_of_kernels(path)
    raw = raw_events(path)
    total = sum(Decimal(e["dur"]) for e in raw if e.get("cat") == "kernel" and want[e["args"]["correlation"]] == "aten::mm")
    a = tracelens.analyze(tracelens.load(path, cache=False))
    got = a.ops[a.ops["op"] == "aten::mm"]["gpu_total_us"].sum()
    assert got == pytest.approx(float(total), abs=1e-3)
    assert got > 0


def test_grouped_vs_loop_categories():
    loop = tracelens.analyze(tracelens.load(MOE_LOOP, cache=False))
    grouped = tracelens.analyze(tracelens.load(MOE_GROUPED, cache=False))
    lc = loop.categories.set_index("category")["total_us"]
    gc = grouped.categories.set_index("category")["total_us"]
    assert "grouped GEMM" not in lc.index and gc["grouped GEMM"] > 0
    assert lc["GEMM"] > gc["GEMM"]  # per-expert GEMMs replaced by grouped GEMM
    # the grouped kernels are launched by aten::_grouped_mm
    gk = grouped.kernels[grouped.kernels["category"] == "grouped GEMM"]
    assert set(gk["op"]) <= {"aten::_grouped_mm"} | set(gk["op"])
    assert (gk["op"] == "aten::_grouped_mm").any()


def test_amd_and_other_devices():
    mi = tracelens.analyze(tracelens.load(MI250, cache=False))
    assert (mi.gpu["op_row"] >= 0).all()  # hip runtime calls link kernels to ops like CUDA's
    cats = set(mi.kernels["category"])
    assert "GEMM" in cats  # Cijk_* rocBLAS/hipBLASLt kernels
    tri = tracelens.analyze(tracelens.load(TRITON, cache=False))
    assert tri.kernels["kernel"].tolist() == ["triton_poi_fused_add_cos_sin_0"]
    assert tri.kernels["category"].tolist() == ["elementwise"]
    for p in (ALEXNET, DIFF_CONTROL, DIFF_TEST):
        a = tracelens.analyze(tracelens.load(p, cache=False))
        assert a.summary()["ranks"][0]["gpu_busy_us"] > 0
        assert a.ops["gpu_total_us"].sum() <= a.gpu["dur"].sum() / 1000 + 1e-6


def test_cpu_only_trace_has_no_gpu_sections():
    a = tracelens.analyze(tracelens.load(CPU_ONLY, cache=False))
    r = a.summary()["ranks"][0]
    assert r["gpu_available"] is False and r["gpu_busy_us"] is None
    assert any("CPU-only" in w for w in a.warnings)
    assert not a.breakdown.empty  # CPU self-time breakdown instead


def test_breakdown_tree_is_consistent():
    a = tracelens.analyze(tracelens.load(MOE_LOOP, cache=False))
    bd = a.breakdown.set_index("id")
    roots = bd[bd["parent"] == ""]
    assert roots["value"].sum() == pytest.approx(a.gpu["dur"].sum() / 1000, rel=1e-9)
    children = bd[bd["parent"] != ""].groupby("parent")["value"].sum()
    for pid, v in children.items():
        assert bd.loc[pid, "value"] >= v - 1e-6


def test_top_level_ops_cover_all_attributed_gpu_time():
    a = tracelens.analyze(tracelens.load(MOE_GROUPED, cache=False))
    attributed = a.gpu.loc[a.gpu["top_op_row"] >= 0, "dur"].sum() / 1000
    assert a.top_ops["gpu_total_us"].sum() == pytest.approx(attributed, rel=1e-9)


def test_load_error_types_are_trace_errors(tmp_path):
    with pytest.raises(TraceError):
        tracelens.load(tmp_path / "missing.json")

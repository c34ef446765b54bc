"""Steady-state windows, CPU-run findings and the diff's significance test, on real fixtures.

Expected numbers come from the raw JSON with the standard library (Decimal timestamps, a plain
sort-and-merge union, launches matched to kernels by correlation id); nothing from tracelens is reused
to compute them.
"""

from __future__ import annotations

import gzip
import json
import math
from decimal import Decimal
from pathlib import Path

import pytest

import tracelens
from tracelens.analysis import steps as S
from tracelens.analysis.diff import diff, student_t_two_sided, welch_test

from ..conftest import FIXTURES, MI250, MOE_LOOP, NCCL_2RANK, merged_length, raw_events, write_json_gz
from ._cli import run_cli

PP_1F1B = FIXTURES / "h200_pp2_run" / "1f1b"
GPU = {"kernel", "gpu_memcpy", "gpu_memset"}




def raw_steps(ev):
    return {int(e["name"].split()[-1]): (Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"]))
            for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("## step")}


def raw_gpu_by_step(path, keep_steps):
    """GPU events whose launching runtime call lies inside one of keep_steps' annotations."""
    ev = raw_events(path)
    steps = raw_steps(ev)
    launch = {e["args"]["correlation"]: Decimal(e["ts"]) for e in ev
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    out = []
    for e in ev:
        if e.get("cat") in GPU and e.get("ph") == "X":
            t = launch.get(e.get("args", {}).get("correlation"))
            if t is not None and any(steps[s][0] <= t < steps[s][1] for s in keep_steps):
                out.append(e)
    return out


def raw_figures(gpu_events):
    iv = lambda es: [(Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"])) for e in es]  # noqa: E731
    kern = [e for e in gpu_events if e["cat"] == "kernel"]
    comm = [e for e in kern if "nccl" in e["name"].lower()]
    comp = [e for e in kern if e not in comm]
    span = max(e for _, e in iv(gpu_events)) - min(s for s, _ in iv(gpu_events))
    compute = merged_length(iv(comp))
    return {"span_us": span, "gpu_busy_us": merged_length(iv(gpu_events)), "comm_us": merged_length(iv(comm)),
            "exposed_comm_us": merged_length(iv(comp + comm)) - compute, "kernel_count": len(kern)}


@pytest.fixture(scope="module")
def nccl():
    return tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))


def test_gpu_demo_reads_steady_state_steps(nccl):
    """`make demo-gpu-trace`: rank 1's 1.4 s profiler start-up wait (inside step 0) no longer makes it
    99.9 % busy; the window names step 0 and why; every figure matches the raw events of steps 1-2."""
    w = nccl.window
    assert w.used == [1, 2] and w.excluded_steps == [0]
    (ex,) = [e for e in w.excluded if e["step"] == 0]
    assert ex["reason"] == "startup_wait" and ex["ranks"] == [1] and "waited" in ex["detail"]
    s = nccl.summary()
    assert s["window"]["steps_used"] == [1, 2] and s["window"]["steps_excluded"][0]["step"] == 0
    for r, f in zip(s["ranks"], ("rank0.json.gz", "rank1.json.gz")):
        exp = raw_figures(raw_gpu_by_step(NCCL_2RANK / f, {1, 2}))
        for k, v in exp.items():
            # exposed communication counts each NCCL kernel's transfer only; with its waits beside it the parts
            # add up to the communication no compute hides, |comm u compute| - |compute| (tracelens.analysis.waits)
            got = r[k] + r["comm_wait_us"] + r["pipeline_wait_us"] if k == "exposed_comm_us" else r[k]
            assert got == pytest.approx(float(v), abs=1e-3), (f, k)
        assert r["gpu_busy_us"] / r["span_us"] < 0.95  # not the 99.9 % of the start-up wait
        whole = raw_figures([e for e in raw_events(NCCL_2RANK / f) if e.get("cat") in GPU and e.get("ph") == "X"])
        assert r["all_steps"]["span_us"] == pytest.approx(float(whole["span_us"]), abs=1e-3)
        assert [st["steady"] for st in r["steps"]] == [False, True, True]
    # the views read the same window: categories sum the durations of the steps-1-2 events
    cat = nccl.categories.groupby("rank")["total_us"].sum()
    for rank, f in enumerate(("rank0.json.gz", "rank1.json.gz")):
        want = sum(Decimal(e["dur"]) for e in raw_gpu_by_step(NCCL_2RANK / f, {1, 2}))
        assert cat[rank] == pytest.approx(float(want), abs=1e-3)
    assert nccl.kernels["count"].sum() == sum(len([e for e in raw_gpu_by_step(NCCL_2RANK / f, {1, 2})])
                                              for f in ("rank0.json.gz", "rank1.json.gz"))


def test_all_steps_window_keeps_whole_window_figures():
    a = tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False), window="all")
    assert a.window.mode == "all" and not a.window.restricts
    r1 = a.summary()["ranks"][1]
    whole = raw_figures([e for e in raw_events(NCCL_2RANK / "rank1.json.gz") if e.get("cat") in GPU and e.get("ph") == "X"])
    assert r1["span_us"] == pytest.approx(float(whole["span_us"]), abs=1e-3)
    assert r1["gpu_busy_us"] / r1["span_us"] > 0.99  # the start-up wait, kept on purpose
    with pytest.raises(ValueError):
        tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False), window="warm")


def test_cli_all_steps_flag(tmp_path):
    p = run_cli("analyze", NCCL_2RANK, "-o", tmp_path / "s")
    assert p.returncode == 0, p.stderr
    assert "window: steady-state steps 1-2 of 0-2; excluded step 0 (profiler start-up wait" in p.stdout
    assert " 99.9 " not in p.stdout
    p = run_cli("analyze", NCCL_2RANK, "-o", tmp_path / "a", "--all-steps")
    assert p.returncode == 0 and " 99.9 " in p.stdout
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["window"]["mode"] == "all"
    assert "steady-state steps 1-2" in (tmp_path / "s" / "report.html").read_text()


def _first_step_only(src: Path, dst: Path) -> Path:
    """A copy of a run's rank files cut to its first profiler step: every event that starts after that step's
    end dropped, the later step markers with them."""
    dst.mkdir()
    for f in sorted(src.glob("rank*.json.gz")):
        with gzip.open(f, "rt") as fh:
            doc = json.load(fh)
        ev = doc["traceEvents"]
        first = min((e for e in ev if str(e.get("name", "")).startswith(("ProfilerStep#", "## step "))),
                    key=lambda e: e["ts"])
        end = first["ts"] + first["dur"]
        doc["traceEvents"] = [e for e in ev if "ts" not in e or e["ts"] < end]
        write_json_gz(doc, dst / f.name)
    return dst


def test_single_step_with_startup_wait_is_cut_not_dropped(tmp_path):
    """The 2-rank NCCL run cut to its step 0: one profiled step, rank 1 waits 1.4 s in its first collective for
    rank 0 to start profiling. With no other step to use, the wait interval is cut out of rank 1's timeline."""
    run = _first_step_only(NCCL_2RANK, tmp_path / "step0")
    a = tracelens.analyze(tracelens.load(run, cache=False))
    w = a.window
    assert w.used == [0] and list(w.cuts) == [1] and len(w.cuts[1]) == 1
    (cs, ce), = w.cuts[1]
    assert 1_000_000_000 < ce - cs < 2_000_000_000  # ns
    raw = [e for e in raw_events(run / "rank1.json.gz") if e.get("cat") in GPU and e.get("ph") == "X"]
    iv = [(Decimal(e["ts"]) * 1000, (Decimal(e["ts"]) + Decimal(e["dur"])) * 1000) for e in raw]
    lo, hi = min(s for s, _ in iv), max(e for _, e in iv)
    # the same intervals with [cs, ce) removed, by hand
    left = []
    for s, e in iv:
        if e <= cs or s >= ce:
            left.append((s, e))
        else:
            if s < cs:
                left.append((s, Decimal(cs)))
            if e > ce:
                left.append((Decimal(ce), e))
    tl = a.timeline.set_index("rank").loc[1]
    assert tl["span_us"] == pytest.approx(float((hi - lo - (ce - cs)) / 1000), abs=1e-3)
    assert tl["gpu_busy_us"] == pytest.approx(float(merged_length(left) / 1000), abs=1e-3)
    assert tl["gpu_busy_us"] + tl["gpu_idle_us"] == pytest.approx(tl["span_us"], abs=1e-3)
    assert any("cut out of step 0" in x for x in a.warnings)


def test_pipeline_fill_is_not_a_startup_wait():
    """pp2 1F1B run, one profiled step: rank 1's first receive began before rank 0's trace did, and waits for
    stage 0's first forward (the schedule's fill), measured on both sides: not a profiler start-up wait, so
    nothing is cut and the wait is rank 1's pipeline wait (issue 34)."""
    raw = {r: raw_events(PP_1F1B / "traces" / f"rank{r}.json.gz") for r in (0, 1)}
    start0 = min(Decimal(e["ts"]) for e in raw[0] if "ts" in e and e.get("ph") == "X")
    recv = min((e for e in raw[1] if e.get("cat") == "kernel" and "nccl" in e["name"].lower()), key=lambda e: Decimal(e["ts"]))
    assert Decimal(recv["ts"]) < start0
    a = tracelens.analyze(tracelens.load(PP_1F1B, cache=False))
    assert a.window.used == [4] and not a.window.cuts
    assert not any("start-up wait" in x for x in a.warnings)
    assert a.timeline.set_index("rank").at[1, "pipeline_wait_us"] > 0


def test_empty_last_step_is_excluded():
    """MI250 trace: ProfilerStep#2 opens right before the profiler stops and holds no op."""
    raw = raw_events(MI250)
    st2 = next(e for e in raw if e.get("name") == "ProfilerStep#2")
    lo, hi = Decimal(st2["ts"]), Decimal(st2["ts"]) + Decimal(st2["dur"])
    assert not [e for e in raw if e.get("cat") == "cpu_op" and lo <= Decimal(e["ts"]) < hi]
    a = tracelens.analyze(tracelens.load(MI250, cache=False))
    assert a.window.used == [1] and a.window.excluded[0]["reason"] == "empty"


def _step_trace(ranks_steps: dict[int, list[int]], path):
    """Synthetic Kineto files, one per rank: ProfilerStep#N ranges with one op and one kernel each."""
    path.mkdir(parents=True, exist_ok=True)
    for rank, steps in ranks_steps.items():
        ev, ts, corr = [], 1000.0, 1
        for s in steps:
            ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1, "ts": ts, "dur": 100.0})
            ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": ts + 1, "dur": 20.0})
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts + 2,
                       "dur": 5.0, "args": {"correlation": corr}})
            ev.append({"ph": "X", "cat": "kernel", "name": "gemm_kernel", "pid": 0, "tid": 7, "ts": ts + 10, "dur": 30.0 + s,
                       "args": {"correlation": corr, "stream": 7, "device": 0}})
            ts += 200.0
            corr += 1
        doc = {"traceEvents": ev, "distributedInfo": {"rank": rank, "world_size": len(ranks_steps)},
               "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}]}
        (path / f"rank{rank}.json").write_text(json.dumps(doc))
    return path


def test_step_missing_on_a_rank_is_partial(tmp_path):
    d = _step_trace({0: [5, 6, 7], 1: [6, 7]}, tmp_path / "t")
    a = tracelens.analyze(tracelens.load(d, cache=False))
    assert a.window.used == [6, 7]
    (e,) = a.window.excluded
    assert e["step"] == 5 and e["reason"] == "missing_ranks" and e["ranks"] == [1]
    # kernel count per rank over steps 6-7: one kernel per step
    assert a.timeline.set_index("rank")["kernel_count"].to_dict() == {0: 2, 1: 2}


def test_manifest_warmup_and_export_steps(tmp_path):
    run = tmp_path / "run"
    _step_trace({0: [0, 1, 2, 3]}, run / "traces")
    (run / "manifest.json").write_text(json.dumps({"config": {"timing_warmup_steps": 1},
                                                   "profile": {"step_start": 0, "step_end": 3}}))
    a = tracelens.analyze(tracelens.load(run, cache=False))
    reasons = {e["step"]: e["reason"] for e in a.window.excluded}
    assert reasons == {0: "warmup", 3: "export"} and a.window.used == [1, 2]
    # kernels 31 + 32 us over the two steps
    assert a.categories["total_us"].sum() == pytest.approx(63.0)


def test_ppvis_lanes_default_to_a_steady_state_step():
    from tracelens.analysis.pipeline import load_pipeline

    m = json.loads((PP_1F1B / "manifest.json").read_text())
    warm, lo, hi = m["config"]["timing_warmup_steps"], m["profile"]["step_start"], m["profile"]["step_end"]
    res = load_pipeline(PP_1F1B)
    steady = [s for s in res.steps if s >= warm and not (lo <= s <= hi)]
    assert res.shown_step == steady[-1] and res.shown_step != res.steps[-1]
    assert S.steady_pipeline_step([1, 2], None) == 2  # no manifest: the last step


# ------------------------------------------------------------------------------------- CPU runs

def _cpu_run(run, step_times_s):
    """A CPU-only run dir: two profiled steps (3, 4) with moe/ stages and ops, and a manifest whose
    unprofiled steps are faster than the profiled ones."""
    (run / "traces").mkdir(parents=True)
    ev, ts = [], 1000.0
    for s in (3, 4):
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1, "ts": ts, "dur": 10000.0})
        ev.append({"ph": "X", "cat": "user_annotation", "name": "moe/router", "pid": 1, "tid": 1, "ts": ts + 100, "dur": 1000.0})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::topk", "pid": 1, "tid": 1, "ts": ts + 200, "dur": 500.0})
        ev.append({"ph": "X", "cat": "user_annotation", "name": "moe/experts", "pid": 1, "tid": 1, "ts": ts + 2000, "dur": 4000.0})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": ts + 2100, "dur": 3000.0})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": 1, "tid": 1, "ts": ts + 6500, "dur": 1000.0})
        ts += 10100.0
    (run / "traces" / "rank0.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": ev}).encode()))
    (run / "manifest.json").write_text(json.dumps({
        "config": {"timing_warmup_steps": 1}, "profile": {"step_start": 3, "step_end": 5},
        "metrics": {"step_times_s": step_times_s}}))
    return run


def test_cpu_run_gets_findings_and_host_tables(tmp_path):
    run = _cpu_run(tmp_path / "cpu", [0.5, 0.006, 0.006, 0.011, 0.012, 0.02, 0.0061, 0.0059, 0.006, 0.0062])
    a = tracelens.analyze(tracelens.load(run, cache=False))
    hs = S.host_step_table(a)
    assert hs["step_time_us"].tolist() == [10000.0, 10000.0] and hs["moe_us"].tolist() == [5000.0, 5000.0]
    assert hs["op_self_us"].tolist() == [4500.0, 4500.0]  # 500 + 3000 + 1000
    f = {x["type"]: x for x in a.findings()}
    assert f["moe_stages"]["evidence"]["stages_share_of_step"] == {"moe/experts": 0.4, "moe/router": 0.1}
    hot = f["host_hotspot"]
    assert hot["evidence"]["family"] == "GEMM" and hot["share_of_span"] == pytest.approx(0.4)  # mm + addmm
    ov = f["profiler_overhead"]["evidence"]
    # profiled steps 3-4 (11, 12 ms) vs unprofiled 2, 6-9 (step 0 warm-up, 5 the trace-export step)
    assert ov["profiled_steps"] == [3, 4] and ov["unprofiled_steps"] == [1, 2, 6, 7, 8, 9]
    assert ov["overhead"] == pytest.approx(11.5 / 6.0 - 1, abs=1e-3) and ov["beyond_noise"]
    assert all(x["severity"] == "info" and x["recoverable_us"] is None for x in f.values())
    html = __import__("reports.html", fromlist=["render"]).render(a)
    assert "No findings" not in html and "Host time per step and rank" in html and "% GPU busy" not in html


def test_profiler_overhead_needs_more_than_chance():
    m = {"config": {"timing_warmup_steps": 0}, "profile": {"step_start": 1, "step_end": 2},
         "metrics": {"step_times_s": [0.010, 0.012, 0.011]}}
    o = S.profiler_overhead(m)  # 1 profiled vs 1 unprofiled step: slower by chance half the time
    assert o["p_value"] == 0.5 and not o["beyond_noise"]


def test_roofline_on_cpu_run_explains_instead_of_crashing(tmp_path):
    run = _cpu_run(tmp_path / "cpu", [0.01] * 10)
    p = run_cli("roofline", run)
    assert p.returncode == 0, p.stderr
    assert "no GPU kernels" in p.stdout and "Traceback" not in p.stderr


# ------------------------------------------------------------------------------------------ diff

def test_student_t_against_closed_forms():
    for t in (0.3, 1.0, 2.5, 7.0):
        assert student_t_two_sided(t, 1.0) == pytest.approx(1 - 2 / math.pi * math.atan(t), abs=1e-12)  # Cauchy
        assert student_t_two_sided(t, 2.0) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-12)
    t, df, p = welch_test([1, 2, 3, 4], [3, 4, 5, 6])
    assert t == pytest.approx(2 / math.sqrt(2 * (5 / 3) / 4)) and df == pytest.approx(6.0)
    assert welch_test([1.0], [2.0, 3.0])[2] != welch_test([1.0], [2.0, 3.0])[2]  # NaN with one sample
    assert welch_test([2, 2], [2, 2])[2] == 1.0 and welch_test([2, 2], [3, 3])[2] == 0.0


def _stretched_copy(src, dst, factor):
    """A copy of a trace dir with every GPU kernel's duration multiplied by factor (raw JSON)."""
    dst.mkdir()
    for f in ("rank0.json.gz", "rank1.json.gz"):
        doc = json.loads(gzip.decompress((src / f).read_bytes()))
        for e in doc["traceEvents"]:
            if e.get("cat") == "kernel":
                e["dur"] = e["dur"] * factor
        (dst / f).write_bytes(gzip.compress(json.dumps(doc).encode()))
    return dst


def test_diff_gate_identical_one_sample_and_regression(tmp_path, nccl):
    # identical traces: exit 0, nothing significant
    p = run_cli("diff", NCCL_2RANK, NCCL_2RANK, "--fail-on", "step_time>+5%", "--fail-on", "category.gemm>+10%")
    assert p.returncode == 0, p.stderr
    # one sample per side: a warning line, noise unknown (not 0.000)
    p = run_cli("diff", MOE_LOOP, MOE_LOOP, "--fail-on", "step_time>+5%")
    assert p.returncode == 0
    assert any(x.startswith("warning: one sample") for x in p.stdout.splitlines())
    j = diff(tracelens.analyze(tracelens.load(MOE_LOOP, cache=False)), tracelens.analyze(tracelens.load(MOE_LOOP, cache=False)))
    st = j.metric("step_time")
    assert st["noise"] == "unknown" and st["spread"] != st["spread"] and not st["within_noise"]
    # a real regression: every kernel 20 % longer -> GEMM time per step +20 %, significant, exit 1
    new = _stretched_copy(NCCL_2RANK, tmp_path / "slow", 1.2)
    p = run_cli("diff", NCCL_2RANK, new, "--fail-on", "category.gemm>+10%", "-o", tmp_path / "d")
    assert p.returncode == 1, p.stdout + p.stderr
    d = json.loads((tmp_path / "d" / "diff.json").read_text())
    g = {m["metric"]: m for m in d["metrics"]}["category.gemm"]
    gemm = [e for f in ("rank0.json.gz", "rank1.json.gz") for e in raw_gpu_by_step(NCCL_2RANK / f, {1, 2})
            if e["cat"] == "kernel" and e["name"].startswith("nvjet")]
    base_ms = float(sum(Decimal(e["dur"]) for e in gemm)) / 2 / 2 / 1000  # 2 steps, 2 ranks
    # GEMM kernels of this fixture are nvjet_* kernels; the category sums their durations per step
    assert g["delta"] == pytest.approx(0.2 * base_ms, abs=2e-6)  # diff.json: 6 decimals
    # two steady steps a side: too few for a p-value (diff.MIN_SAMPLES), the rule decides on the change
    assert g["p_value"] is None and d["rules"][0]["tripped"] and d["rules"][0]["noise"] == "unknown"


def test_diff_lists_added_and_removed_host_ops(tmp_path, nccl):
    new = tmp_path / "new"
    new.mkdir()
    for f in ("rank0.json.gz", "rank1.json.gz"):
        doc = json.loads(gzip.decompress((NCCL_2RANK / f).read_bytes()))
        steps = raw_steps(doc["traceEvents"])
        for s, (lo, _) in steps.items():  # an op that launches nothing, once per step
            doc["traceEvents"].append({"ph": "X", "cat": "cpu_op", "name": "aten::_local_scalar_dense_new", "pid": 9,
                                       "tid": 9, "ts": float(lo) + 1.0, "dur": 3.0})
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("name") != "aten::zeros"]
        (new / f).write_bytes(gzip.compress(json.dumps(doc).encode()))
    r = diff(nccl, tracelens.analyze(tracelens.load(new, cache=False)))
    co = r.cpu_ops.set_index("op")
    assert co.loc["aten::_local_scalar_dense_new", "status"] == "added"
    assert co.loc["aten::_local_scalar_dense_new", "new_calls"] == 1.0  # per step, per rank
    raw_zeros = [e for e in raw_events(NCCL_2RANK / "rank0.json.gz") if e.get("name") == "aten::zeros"]
    if raw_zeros:
        assert co.loc["aten::zeros", "status"] == "removed"
    from reports.diff import to_text

    text = to_text(r)
    assert "host ops removed and added" in text and "aten::_local_scalar_dense_new" in text

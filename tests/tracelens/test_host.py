"""Host syncs, idle-gap causes, launch statistics and findings on the H200 MoE fixtures."""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal

import pytest

import tracelens
from tracelens.analysis import host as H
from tracelens.analysis.findings import findings

from ..conftest import CPU_ONLY, MOE_GROUPED, MOE_LOOP, NCCL_2RANK, raw_events


@pytest.fixture(scope="module")
def loop():
    return tracelens.analyze(tracelens.load(MOE_LOOP, cache=False))


@pytest.fixture(scope="module")
def grouped():
    return tracelens.analyze(tracelens.load(MOE_GROUPED, cache=False))


def test_tolist_syncs_per_layer_in_loop_only(loop, grouped):
    sl = H.sync_summary(H.host_syncs(loop)).set_index("op")
    sg = H.sync_summary(H.host_syncs(grouped)).set_index("op")
    # .tolist() of the per-expert counts: aten::to -> copy_ -> cudaStreamSynchronize, 2 layers x 2 steps
    assert sl.loc["aten::to", "count"] == 4 and sl.loc["aten::to", "via"] == "aten::copy_"
    assert "aten::to" not in sg.index
    assert sl.loc["aten::to", "gpu_idle_caused_us"] > 0


def test_sync_count_matches_raw(loop):
    raw = [e for e in raw_events(MOE_LOOP) if e.get("ph") == "X"]
    ops = [(Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"])) for e in raw if e.get("cat") == "cpu_op"]
    syncs = [e for e in raw if e.get("cat") == "cuda_runtime" and e["name"] == "cudaStreamSynchronize"
             and any(a <= Decimal(e["ts"]) < b for a, b in ops)]
    got = H.host_syncs(loop)
    assert len(got) == len(syncs)
    assert sorted(got["host_blocked_us"].round(3)) == sorted(round(float(e["dur"]), 3) for e in syncs)


def test_idle_gaps_partition_idle_time(loop):
    gaps = H.idle_gaps(loop)
    idle = loop.timeline.iloc[0]["gpu_idle_us"]
    assert gaps["dur_us"].sum() == pytest.approx(idle, rel=1e-9)  # every idle ns is in exactly one gap
    assert set(gaps["cause"]) <= {"sync", "launch-bound", "other"}
    assert (gaps["cause"] == "sync").sum() >= 4


def _rank_idle_from_raw(path, window):
    """A rank's GPU idle inside [lo, hi) straight from the raw JSON: the window minus the union of its GPU
    events (kernels, memcpy, memset) clipped to it, in µs."""
    lo, hi = window
    iv = sorted((max(float(e["ts"]), lo), min(float(e["ts"]) + float(e.get("dur", 0)), hi))
                for e in raw_events(path) if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            busy += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += (cur_e - cur_s) if cur_e is not None else 0.0
    return (hi - lo) - busy


def test_idle_by_cause_is_measured_on_the_timeline_window(tmp_path):
    """`host`'s idle per cause is the window's: the 10,000-case campaign made rank 0 of the two-rank trace have
    only zero-duration GPU events and got 'other' idle at 123.9 % of the span, because the gaps came from the
    whole trace and the span from the window less the start-up wait. Now each rank's causes add up to at most
    its idle over the window, checked against the raw JSON."""
    import gzip

    d = tmp_path / "traces"
    d.mkdir()
    for k in (0, 1):
        doc = json.loads(gzip.decompress((NCCL_2RANK / f"rank{k}.json.gz").read_bytes()))
        if k == 0:
            for e in doc["traceEvents"]:
                if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
                    e["dur"] = 0
        (d / f"rank{k}.json").write_text(json.dumps(doc))
    for target in (d, NCCL_2RANK, MOE_GROUPED, MOE_LOOP):
        a = tracelens.analyze(tracelens.load(target, cache=False))
        rep = H.host_report(a)
        for r in a.timeline.itertuples(index=False):
            mine = rep.idle[rep.idle["rank"] == r.rank]
            assert (mine["pct_of_span"] <= 100.0 + 1e-9).all(), mine
            assert mine["idle_us"].sum() <= r.gpu_idle_us + 1e-6, (target, r.rank)
    # rank 1 untouched, no cut on it: its causes add up to its idle over the window, from the raw JSON
    a = tracelens.analyze(tracelens.load(d, cache=False))
    cuts = a.window.cuts if a.window is not None else {}
    r1 = a.timeline[a.timeline["rank"] == 1].iloc[0]
    assert 1 not in cuts
    raw = _rank_idle_from_raw(d / "rank1.json", (r1.start_ns / 1e3, r1.end_ns / 1e3))
    got = H.host_report(a).idle.query("rank == 1")["idle_us"].sum()
    assert got == pytest.approx(raw, rel=1e-6, abs=0.01) and raw > 100


def test_small_kernel_share_larger_in_loop(loop, grouped):
    ll, lg = H.launch_stats(loop).iloc[0], H.launch_stats(grouped).iloc[0]
    raw = [e for e in raw_events(MOE_LOOP) if e.get("cat") == "kernel"]
    assert ll["small_kernels"] == sum(1 for e in raw if Decimal(e["dur"]) < 10)
    assert ll["small_share"] > lg["small_share"] and ll["small_kernels"] > 2 * lg["small_kernels"]
    assert 0 < ll["launch_p50_us"] < ll["launch_p90_us"]


def test_findings_structured_and_ranked(loop, grouped):
    fl = findings(loop)
    assert {f["type"] for f in fl} >= {"host_sync", "small_kernels", "launch_bound"}
    for f in fl:
        assert set(f) >= {"type", "severity", "title", "evidence", "recoverable_us", "ranks", "share_of_span"}
        assert f["severity"] in ("high", "medium", "low") and f["recoverable_us"] >= 0
    sev = ["high", "medium", "low"]
    keys = [(sev.index(f["severity"]), -f["recoverable_us"]) for f in fl]
    assert keys == sorted(keys)
    assert not [f for f in findings(grouped) if f["type"] == "host_sync" and f["evidence"]["op"] == "aten::to"]
    small = next(f for f in fl if f["type"] == "small_kernels")
    assert "aten::matmul" in small["evidence"]["ops"]


def test_findings_in_summary_and_multi_rank():
    a = tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))
    s = a.summary()
    types = {f["type"] for f in s["findings"]}
    assert {"sync_wait", "host_sync"} <= types
    json.dumps(s)  # serializable
    cpu = tracelens.analyze(tracelens.load(CPU_ONLY, cache=False))
    assert cpu.summary()["findings"] == []


def test_cli_host(tmp_path):
    out = tmp_path / "host.json"
    p = subprocess.run([sys.executable, "-m", "tracelens", "host", str(MOE_LOOP), "--json", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "aten::to" in p.stdout and "findings:" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["findings"] and doc["sync_summary"]


@pytest.mark.parametrize("kernels", [[(130, 40)], [(130, 40), (150, 40)]], ids=["one GPU event", "one busy stretch"])
def test_host_syncs_when_the_gpu_never_goes_idle(tmp_path, kernels):
    # aten::foo [100,200) launches the kernels and blocks in cudaStreamSynchronize [120,180); the GPU's
    # work is one busy stretch (no idle gap), so the sync is reported and caused no GPU idle time
    def x(name, cat, ts, dur, pid=1, tid=1, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}

    ev = [x("aten::foo", "cpu_op", 100, 100)]
    for k, (ts, dur) in enumerate(kernels):
        ev.append(x("cudaLaunchKernel", "cuda_runtime", 105 + k, 1, correlation=10 + k))
        ev.append(x(f"k{k}", "kernel", ts, dur, pid=0, tid=7, correlation=10 + k, stream=7))
    ev.append(x("cudaStreamSynchronize", "cuda_runtime", 120, 60, correlation=99))
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    a = tracelens.analyze(tracelens.load(p, cache=False))
    s = H.host_syncs(a)
    assert len(s) == 1 and s.iloc[0]["op"] == "aten::foo" and s.iloc[0]["call"] == "cudaStreamSynchronize"
    assert s.iloc[0]["host_blocked_us"] == 60.0 and s.iloc[0]["gpu_idle_caused_us"] == 0.0
    assert H.idle_gaps(a).empty
    f = {x["type"]: x for x in findings(a)}
    assert f["host_sync"]["evidence"]["count"] == 1 and f["host_sync"]["recoverable_us"] == 0.0
    assert "launch_bound" not in f
    assert a.summary()["ranks"][0]["kernel_count"] == len(kernels)

"""Wait vs transfer of communication kernels, one notion everywhere (issue 34, item 1), on real 4-GPU NCCL runs.

Every expected value is computed here from the raw trace JSON (gzip + json, no tracelens code): the NCCL
kernels of each rank, matched across ranks, the wait of each = min(last arrival - own start, duration).
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import tracelens
from tracelens.analysis import pipeline as P
from tracelens.analysis import waits as W

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "h100_4gpu"


@functools.cache  # each run's raw JSON parsed once per module (read only)
def _raw(run: Path) -> dict[int, list[dict]]:
    out = {}
    for r in range(4):
        with gzip.open(run / "traces" / f"rank{r}.json.gz", "rt") as f:
            out[r] = json.load(f)["traceEvents"]
    return out


def _nccl(events: list[dict]) -> np.ndarray:
    k = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower())
    return np.array(k, dtype=np.float64)


@functools.cache
def _analysis(run: Path):
    """The run's analysis, made once per module and shared by the tests that read it."""
    return tracelens.analyze(tracelens.load(run, progress=False))


@pytest.fixture(scope="module")
def ep4():
    run = FIX / "ep4_L0_loop"
    a = tracelens.analyze(tracelens.load(run, progress=False))
    return run, a, a.summary()


def test_ep4_collective_waits_are_not_communication(ep4):
    run, a, summ = ep4
    raw = {r: _nccl(ev) for r, ev in _raw(run).items()}
    n = {len(k) for k in raw.values()}
    assert len(n) == 1  # every rank runs the same collectives in the same order: the i-th kernels are one instance
    starts = np.stack([raw[r][:, 0] for r in range(4)])
    last = starts.max(axis=0)
    for r in range(4):
        dur = raw[r][:, 1] - raw[r][:, 0]
        wait_ms = float(np.minimum(last - raw[r][:, 0], dur).sum()) / 1e3
        transfer_ms = float(dur.sum()) / 1e3 - wait_ms
        rec = next(x for x in summ["ranks"] if x["rank"] == r)
        # summary.json: the communication kernels' wait and transfer (sums over kernels, as `comm`); the timeline
        # fields are the parts no compute hides: the wait its own category, exposed communication transfer only
        assert rec["comm_kernels"]["wait_us"] / 1e3 == pytest.approx(wait_ms, rel=0.01, abs=0.05), r
        assert rec["comm_kernels"]["transfer_us"] / 1e3 == pytest.approx(transfer_ms, rel=0.01, abs=0.05), r
        assert rec["comm_wait_us"] <= rec["comm_kernels"]["wait_us"] + 1.0
        assert rec["comm_wait_us"] > 0.8 * rec["comm_kernels"]["wait_us"], r
        assert rec["exposed_comm_us"] / 1e3 <= transfer_ms * 1.01 + 0.05, r
        assert rec["pipeline_wait_us"] == 0.0
        # `comm`: the same per-rank wait and transfer
        cs = a.comm_instances()
        mine = cs[(cs["rank"] == r) & ~cs["startup"]]
        assert float(mine["sync_us"].sum()) / 1e3 == pytest.approx(wait_ms, rel=0.01, abs=0.05)
        assert float(mine["comm_us"].sum()) / 1e3 == pytest.approx(transfer_ms, rel=0.01, abs=0.05)
    # the finding reads the same figure as summary.json
    ex = next(f for f in summ["findings"] if f["type"] == "exposed_comm")
    for r, us in ex["evidence"]["per_rank"].items():
        assert us == pytest.approx(next(x for x in summ["ranks"] if x["rank"] == int(r))["exposed_comm_us"], abs=0.01)


def _union(iv) -> float:
    total, end = 0.0, -np.inf
    for s, e in sorted(iv):
        if e <= s:
            continue
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def test_ep4_decomposition_collective_waits_are_the_exposed_waits(ep4):
    """The decomposition's `collective waits` (replayed step, not calibrated: it reproduces the traced step) is
    the step's collective waits no compute hides, computed here from the raw JSON as |W u T u C| - |T u C|
    (W waits, T transfers, C other kernels); what stays `exposed communication` is transfer only."""
    from tracelens.projection.decomposition import decomposition

    run, a, summ = ep4
    assert summ["window"]["gpu_events_outside_steps"] == 0  # every GPU event is in the analyzed step
    raw = _raw(run)
    k = {r: _nccl(ev) for r, ev in raw.items()}
    last = np.stack([k[r][:, 0] for r in range(4)]).max(axis=0)
    d = decomposition(a, calibrate=False)
    for info in d.attrs["ranks"]:
        r = info["rank"]
        comp = [(e["ts"], e["ts"] + e["dur"]) for e in raw[r] if e.get("cat") == "kernel" and "nccl" not in e["name"].lower()]
        w = [(s, min(max(lt, s), e)) for (s, e), lt in zip(k[r], last)]
        t = [(min(max(lt, s), e), e) for (s, e), lt in zip(k[r], last)]
        exposed_wait_ms = (_union(w + t + comp) - _union(t + comp)) / 1e3
        exposed_transfer_ms = (_union(t + comp) - _union(comp)) / 1e3
        scale = info["step_ms"] / info["traced_step_ms"]
        g = d[d["rank"] == r].set_index("component")["ms"]
        assert g["collective waits"] == pytest.approx(exposed_wait_ms * scale, rel=0.01), r
        assert g["exposed communication"] == pytest.approx(exposed_transfer_ms * scale, rel=0.05, abs=0.2), r
        rec = next(x for x in summ["ranks"] if x["rank"] == r)
        assert rec["comm_wait_us"] / 1e3 == pytest.approx(exposed_wait_ms, rel=0.01), r


def test_ep4_timeline_split_adds_up(ep4):
    _, a, _ = ep4
    tl = a.timeline
    parts = (tl["compute_us"] + tl["exposed_comm_us"] + tl["comm_wait_us"] + tl["pipeline_wait_us"]
             + tl["excl_memcpy_us"] + tl["excl_memset_us"] + tl["gpu_idle_us"])
    assert np.allclose(parts, tl["span_us"], atol=1e-3)
    # before the split, exposed communication was 70-96 % of each rank's NCCL time on this run
    assert (tl["exposed_comm_us"] < 0.35 * tl["comm_us"]).all()


def test_diff_has_the_wait_metric(ep4):
    from tracelens.analysis.diff import METRICS

    assert "gpu.comm_wait" in METRICS and "gpu.pipeline_wait" in METRICS
    _, a, _ = ep4
    from tracelens.analysis.steps import step_figures

    per = step_figures(a).per_step
    assert float(per["comm_wait_us"].iloc[0]) == pytest.approx(float(a.timeline["comm_wait_us"].mean()), rel=1e-6)


@functools.cache
def _pipeline_wait_parts(run: Path) -> dict[int, list[tuple[float, float]]]:
    """Per rank, µs: each SendRecv kernel's wait [start, start + wait) for its partner on the peer ranks its
    send/recv ops name (the kernel on that rank overlapping it whose end is nearest its own: the two end
    together; within 200 µs, else the nearest)."""
    raw = _raw(run)
    peers = {r: {e["args"]["Rank"] for e in ev if e.get("name") == "record_param_comms"
                 and e.get("args", {}).get("Collective name") in ("send", "recv")} for r, ev in raw.items()}
    k = {r: np.array(sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "kernel"
                            and "SendRecv" in e["name"])) for r, ev in raw.items()}
    out = {}
    for r in range(4):
        parts = []
        for t0, t1 in k[r]:
            cands = []
            for q in peers[r]:
                o = k[q][(k[q][:, 1] > t0) & (k[q][:, 0] < t1)]
                if len(o):
                    j = int(np.argmin(np.abs(o[:, 1] - t1)))
                    cands.append((abs(o[j, 1] - t1), o[j, 0]))
            if cands:
                near = [c for c in cands if c[0] <= 200.0] or [min(cands)]
                w = min(max(max(c[1] for c in near) - t0, 0.0), t1 - t0)
                parts.append((t0, t0 + w))
        out[r] = parts
    return out


def _pipeline_waits_raw(run: Path) -> dict[int, float]:
    """Per rank, ms: the SendRecv kernels' waits summed (`_pipeline_wait_parts`)."""
    return {r: sum(e - s for s, e in parts) / 1e3 for r, parts in _pipeline_wait_parts(run).items()}


def test_ppvis_account_tells_spin_from_transfer():
    """ppvis's bubble account sees the same waits: the part of a critical-path wait a point-to-point kernel spent
    spinning for its peer (`comm_wait_gpu`) is the union of the kernels' waits computed from the raw JSON; on the
    interleaved run it is most of the hand-off time, so the advice does not ask for smaller activations."""
    run = FIX / "pp4_vpp2"
    act = P.trace_activity(tracelens.load(run, progress=False), P.load_pipeline_actions(run))
    for r, parts in _pipeline_wait_parts(run).items():
        s, e = act.sets[r]["comm_wait_gpu"]
        assert float((e - s).sum()) / 1e6 == pytest.approx(_union(parts) / 1e3, rel=1e-3, abs=1e-3), r
    acc = P.load_pipeline(run).account
    w = acc.waits
    assert w["comm_wait_gpu_ns"].sum() > w["comm_gpu_ns"].sum()
    assert "not moving data" in acc.advice["comm"] and "smaller activations would not help" in acc.advice["comm"]


@pytest.mark.parametrize("name", ["pp4_1f1b", "pp4_vpp2"])
def test_pipeline_receive_waits_are_bubble_not_communication(name):
    run = FIX / name
    a = _analysis(run)
    want = _pipeline_waits_raw(run)
    tl = a.timeline.set_index("rank")
    per = W.rank_waits(a.comm_waits()).set_index("rank")
    for r, ms in want.items():
        assert per.at[r, "pipeline_wait_us"] / 1e3 == pytest.approx(ms, rel=0.02, abs=0.1), (name, r)
        # the timeline's pipeline wait is the part no compute on another stream hides
        assert tl.at[r, "pipeline_wait_us"] <= per.at[r, "pipeline_wait_us"] + 1.0
        # what is left as exposed communication is the hand-offs' transfer: a few ms, not the 24-339 ms of waiting
        assert tl.at[r, "exposed_comm_us"] < 0.05 * tl.at[r, "span_us"], (name, r)
    ex = next((f for f in a.findings() if f["type"] == "exposed_comm"), None)
    assert ex is None or ex["severity"] != "high"


def test_pipeline_fill_wait_is_not_a_startup_wait():
    """Issue 34: rank 0's first receive of the interleaved run (stage 3 -> 4 comes from rank 3) began before
    rank 3's trace did; it waits for the schedule's fill, measured on both sides, not for the profiler."""
    run = FIX / "pp4_vpp2"
    raw = _raw(run)
    first3 = min(e["ts"] for e in raw[3] if "ts" in e and e.get("ph") == "X")
    early = [e for e in raw[0] if e.get("cat") == "kernel" and "SendRecv" in e["name"] and e["ts"] < first3]
    assert early  # the situation the old start-up rule misread
    a = _analysis(run)
    assert not a.window.cuts and not a.window.notes
    assert not any(e["reason"] == "startup_wait" for e in a.window.excluded)
    assert (a.step_timeline["startup_wait_us"] == 0).all()
    assert not any("start-up wait" in w for w in a.warnings)


def test_ppvis_leaves_out_the_export_step():
    res = P.load_pipeline(FIX / "pp4_1f1b")
    man = json.loads((FIX / "pp4_1f1b" / "manifest.json").read_text())
    export = man["profile"]["step_end"]
    assert export not in res.steps and export in res.skipped_steps
    assert "trace export" in res.to_text().splitlines()[0]
    # the export step is the slowest of the run by far (manifest step times), so leaving it out lowers the mean
    times = man["metrics"]["step_times_s"]
    assert times[export] > 2 * float(np.median(times[2:]))


@pytest.mark.parametrize("name", ["pp4_1f1b", "pp4_vpp2"])
@pytest.mark.parametrize("step", [None, 4])
def test_ppvis_never_moves_a_stages_only_layer(name, step):
    res = P.load_pipeline(FIX / name, step=step)
    b = res.balance
    t = b.table.set_index("stage")
    if b.move and b.move.get("layers"):
        assert t.at[b.move["from"], "layers"] - b.move["layers"] >= 1
    slow = b.slowest_stage
    if int(t.at[slow, "layers"]) == 1:
        assert "move 1 layer" not in b.statement
        assert "single layer" in b.statement and "loss head" in b.statement

"""The critical path of a step across ranks (tracelens.analysis.critical_path; issue 34 item 2).

Independent truths: the raw JSON of the 4-GPU EP level-0 fixture (per all-to-all, the rank whose kernel starts last
and the GPU gaps on that rank before it, classified by when the host launched the next kernel), ppvis's
action-level critical path on the pipeline fixtures, and a single rank's own timeline.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tracelens
from tracelens.analysis.critical_path import (
    KINDS,
    _action_offsets,
    critical_path,
    critical_path_of,
)
from tracelens.analysis.pipeline import critical_path as ppvis_path
from tracelens.errors import TraceError

from ..conftest import MI250, MOE_LOOP, NCCL_2RANK, write_json_gz
from ._cli import run_cli

FIX = Path(__file__).resolve().parents[1] / "fixtures"
H100 = FIX / "h100_4gpu"
RUNS = [H100 / "ep4_L0_loop", H100 / "ep4_L3_torch", H100 / "pp4_1f1b", H100 / "pp4_vpp2", NCCL_2RANK,
        FIX / "h100_proxy_loop_mbs8", FIX / "h200_ep2_run" / "L0_loop", FIX / "h200_ep2_run" / "L3_torch",
        FIX / "h200_pp2_run" / "1f1b", FIX / "h200_pp2_run" / "vpp2", FIX / "h200_pp2_run" / "zb1p",
        NCCL_2RANK / "rank0.json.gz", MOE_LOOP, MI250]

_CACHE: dict[Path, object] = {}


def _analysis(path: Path):
    if path not in _CACHE:
        _CACHE[path] = tracelens.analyze(tracelens.load(path, progress=False))
    return _CACHE[path]


def _read(path: Path) -> dict:
    with gzip.open(path) as f:
        return json.load(f)


def _check_invariant(cp) -> None:
    seg, steps = cp.segments, cp.steps.set_index("step")
    assert set(seg["kind"]) <= set(KINDS)
    assert (seg["dur_ns"] == seg["end_ns"] - seg["start_ns"]).all() and (seg["dur_ns"] >= 0).all()
    for n, g in seg.groupby("step"):
        st = steps.loc[n]
        # the segments tile the step: contiguous, from its first GPU event to its last, durations adding up to the span
        assert int(g["dur_ns"].sum()) == int(st["span_ns"]) == int(st["end_ns"] - st["start_ns"])
        assert g["start_ns"].iloc[0] == st["start_ns"] and g["end_ns"].iloc[-1] == st["end_ns"]
        assert (g["start_ns"].to_numpy()[1:] == g["end_ns"].to_numpy()[:-1]).all()
        # zero-length segments are hops only, and every change of rank along the path is one: in time order, the
        # rank that waited takes over from the rank it waited for (its `wait` names that rank), then its transfer
        z = g[g["dur_ns"] == 0]
        assert (z["kind"] == "wait").all() and (z["to_rank"] >= 0).all()
        ranks, kinds, to = g["rank"].to_numpy(), g["kind"].to_numpy(), g["to_rank"].to_numpy()
        for i in range(1, len(g)):
            if ranks[i] != ranks[i - 1]:
                assert kinds[i] == "wait" and to[i] == ranks[i - 1], (n, i)
        assert int(st["hops"]) == len(z)


@pytest.mark.parametrize("path", RUNS, ids=lambda p: "/".join(p.parts[-2:]))
def test_segments_add_up_to_the_step_span(path):
    cp = critical_path_of(_analysis(path))
    assert cp.available, cp.problem
    _check_invariant(cp)
    assert cp.by_cause()["ns"].sum() == cp.span_ns
    assert cp.by_rank()["ns"].sum() == cp.span_ns


def _raw(run: Path) -> dict[int, tuple[list[dict], dict[int, float], list[dict]]]:
    """Per rank from the raw JSON: GPU events, runtime launch start by correlation, NCCL kernels in time order."""
    out = {}
    for f in sorted((run / "traces").iterdir()):
        ev = _read(f)["traceEvents"]
        gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        launch = {e["args"]["correlation"]: float(e["ts"]) for e in ev
                  if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {})}
        nccl = sorted((e for e in gpu if "nccl" in e["name"].lower()), key=lambda e: float(e["ts"]))
        out[int(f.name.split(".")[0].removeprefix("rank"))] = (gpu, launch, nccl)
    return out


def test_ep4_level0_path_runs_through_rank0_launch_bound():
    run = H100 / "ep4_L0_loop"
    raw = _raw(run)
    assert len({len(v[2]) for v in raw.values()}) == 1  # every rank runs the same collectives: the i-th is one instance
    a = _analysis(run)
    cp = critical_path_of(a)
    seg = cp.segments
    # the loader keeps the raw µs timestamps as ns on the same clock: find the offset once
    off = int(a.gpu.loc[a.gpu["rank"] == 0, "ts"].min()) - round(min(float(e["ts"]) for e in raw[0][0]) * 1000)
    a2a = [i for i, e in enumerate(raw[0][2]) if e["args"].get("Collective name") == "all_to_allv"]
    assert len(a2a) == 5
    raw_late = path_late = stretch_sum = 0.0
    lasts = []
    for i in a2a:
        last = max(raw, key=lambda r: float(raw[r][2][i]["ts"]))  # the rank whose all-to-all kernel starts last
        lasts.append(last)
        gpu, launch, nccl = raw[last]
        hi = float(nccl[i]["ts"])
        lo = float(nccl[i - 1]["ts"]) + float(nccl[i - 1]["dur"])  # its previous collective's end (i > 0 here)
        # GPU gaps on that rank in between, those whose next event the host launched after the gap began
        ivs = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), launch.get(e["args"].get("correlation"), -1.0))
                     for e in gpu if float(e["ts"]) + float(e["dur"]) > lo and float(e["ts"]) < hi)
        run_end, late = lo, 0.0
        for s, e, lt in ivs:
            if s > run_end and lt > run_end:
                late += s - run_end
            run_end = max(run_end, e)
        lo_ns, hi_ns = lo * 1000 + off, hi * 1000 + off
        on = seg[(seg["rank"] == last) & (seg["end_ns"] > lo_ns) & (seg["start_ns"] < hi_ns)]
        cov = (np.minimum(on["end_ns"], hi_ns) - np.maximum(on["start_ns"], lo_ns)).clip(lower=0)
        # the path runs on the last rank through the whole stretch before it arrived
        assert cov.sum() >= 0.99 * (hi_ns - lo_ns), (i, last)
        raw_late += late
        path_late += float(cov[on["kind"].isin(["launch-bound", "host sync"])].sum()) / 1e3
        stretch_sum += hi - lo
    assert lasts.count(0) == 2 and lasts.count(1) == 3  # forward all-to-alls wait for rank 1, backward for rank 0
    assert path_late == pytest.approx(raw_late, abs=0.03 * stretch_sum)
    assert raw_late > 0.8 * stretch_sum  # the host behind: most of the late ranks' time before arriving
    # over the step: the path runs through rank 0 most, and what dominates there is launch-bound idle
    br = cp.by_rank().set_index("rank")
    assert br["share"].idxmax() == 0 and br.at[0, "cause"] == "launch-bound" and br.at[0, "share"] > 0.5
    assert cp.by_cause()["cause"].iloc[0] == "launch-bound"
    # the late_rank finding cites it
    late = next(f for f in a.findings() if f["type"] == "late_rank")
    assert late["evidence"]["late_rank"] == 0
    ev = late["evidence"]["critical_path"]
    assert ev["on_path"] and ev["cause"] == "launch-bound" and ev["share"] == pytest.approx(br.at[0, "share"], abs=1e-4)
    assert ev["cause_share"] == pytest.approx(br.at[0, "cause_ns"] / br.at[0, "ns"], abs=1e-4)
    # before its late arrivals rank 0 itself waited for rank 1 (the forward's all-to-alls), and its compute there is
    # named by op and stage
    assert ev["waited_for"] == {1: 2} and len(ev["top_compute"]) == 3 and all(c["op"] for c in ev["top_compute"])
    assert "critical path is on rank 0" in late["title"] and "kernel launches" in late["title"]
    s = a.summary()["critical_path"]
    assert s["available"] and s["by_rank"][0]["rank"] == 0 and s["by_cause"][0]["cause"] == "launch-bound"
    assert s["span_us"] == pytest.approx(sum(x["us"] for x in s["by_cause"]), abs=0.01)


@pytest.mark.parametrize("name", ["pp4_1f1b", "pp4_vpp2"])
def test_pipeline_path_agrees_with_ppvis(name):
    a = _analysis(H100 / name)
    cp = critical_path_of(a)
    seg = cp.segments[cp.segments["dur_ns"] > 0]
    st = cp.steps.iloc[0]
    acts = a.pipeline.actions
    off = _action_offsets(acts, a.gpu, a.trace)
    acts = acts.assign(s=acts["start_ns"] - acts["rank"].map(off), e=acts["end_ns"] - acts["rank"].map(off))
    # the pipeline step recorded over the traced step
    overlap = acts.assign(o=(np.minimum(acts["e"], st["end_ns"]) - np.maximum(acts["s"], st["start_ns"])).clip(lower=0))
    step = overlap.groupby("step")["o"].sum().idxmax()
    pp = ppvis_path(acts[acts["step"] == step].drop(columns=["s", "e"]))
    assert pp["rank"].nunique() == 4
    # wherever ppvis's path runs an action, this path is on that action's rank (time-weighted)
    agree = total = 0
    for r in pp.itertuples(index=False):
        s, e = r.start_ns - off[r.rank], r.end_ns - off[r.rank]
        mine = seg[(seg["rank"] == r.rank) & (seg["end_ns"] > s) & (seg["start_ns"] < e)]
        agree += int((np.minimum(mine["end_ns"], e) - np.maximum(mine["start_ns"], s)).clip(lower=0).sum())
        total += e - s
    assert agree >= 0.95 * total
    # the stage with the most compute on the path is ppvis's critical stage
    comp = seg[(seg["kind"] == "compute") & seg["stage"].str.match(r"^[FBW] s\d+$")]
    by_stage = comp.groupby(comp["stage"].str.split(" s").str[1].astype(int))["dur_ns"].sum()
    assert by_stage.idxmax() == a.pipeline.balance.critical_stage
    # the hand-offs go through point-to-point kernels matched from the ranks' send/receive ops
    assert (cp.segments.loc[cp.segments["kind"] == "wait", "what"] == "p2p").sum() >= 3


def test_single_rank_is_its_own_timeline():
    a = _analysis(NCCL_2RANK / "rank0.json.gz")
    cp = critical_path_of(a)
    _check_invariant(cp)
    assert set(cp.segments["rank"]) == {0} and (cp.steps["hops"] == 0).all()
    # each step's span is the rank's own: first GPU event of the step to its last
    g = a.gpu.groupby("step").agg(lo=("ts", "min"), hi=("end", "max"))
    for s in cp.steps.itertuples(index=False):
        assert (s.start_ns, s.end_ns) == (g.at[s.step, "lo"], g.at[s.step, "hi"])
    # its all-reduce's peer is not loaded: communication without a wait/transfer split, no hop
    assert "comm" in set(cp.segments["kind"]) and "transfer" not in set(cp.segments["kind"])
    # no step marked: the whole window is one step (-1)
    one = critical_path_of(_analysis(MOE_LOOP))
    _check_invariant(one)
    assert one.steps["step"].tolist() == [-1] and "profiled window" in one.to_text()


def _copy_ranks(src: Path, dst: Path, mutate) -> Path:
    dst.mkdir(parents=True)
    for f in sorted(src.glob("rank*.json.gz")):
        r = int(f.name.split(".")[0].removeprefix("rank"))
        doc = _read(f)
        mutate(r, doc)
        write_json_gz(doc, dst / f.name)
    return dst


def _cli(*args, real: bool = False):
    """`tracelens critpath ARGS`: in this process, or as a real process (the entry point's exit status and stderr)."""
    if real:
        return subprocess.run([sys.executable, "-m", "tracelens", "critpath", *map(str, args)], check=False,
                              capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=300)
    return run_cli("critpath", *args)


def test_a_step_missing_on_one_rank_is_one_line(tmp_path):
    def drop_step2(r, doc):
        if r != 1:
            return
        st = next(e for e in doc["traceEvents"] if e.get("name") == "## step 2")
        lo, hi = float(st["ts"]), float(st["ts"]) + float(st["dur"])
        doc["traceEvents"] = [e for e in doc["traceEvents"] if "ts" not in e or not lo <= float(e["ts"]) <= hi]

    d = _copy_ranks(NCCL_2RANK, tmp_path / "run", drop_step2)
    p = _cli(d, "--step", 2, "--no-cache", real=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and "rank1.json.gz" in p.stderr and "rank 1 has no GPU work in step 2" in p.stderr
    # analyze keeps going: summary.json says whether there is a path, in one line when not
    a = tracelens.analyze(tracelens.load(d, cache=False, progress=False))
    s = a.summary()["critical_path"]
    assert s["available"] or "\n" not in s["reason"]


def test_ranks_with_no_matching_collective_is_one_line(tmp_path):
    def other_run(r, doc):  # rank 1's collectives become broadcasts and its sends/receives other ops
        if r != 1:
            return
        for e in doc["traceEvents"]:
            args = e.get("args") or {}
            if "Collective name" in args:
                args["Collective name"] = "broadcast"
            if e.get("name") in ("c10d::send", "c10d::recv_"):
                e["name"] = "c10d::barrier"

    d = _copy_ranks(NCCL_2RANK, tmp_path / "run", other_run)
    a = tracelens.analyze(tracelens.load(d, cache=False, progress=False))
    with pytest.raises(TraceError, match="no collective or send/receive is matched across them"):
        critical_path_of(a)
    assert not a.critical_path().available and "\n" not in a.critical_path().problem
    assert a.summary()["critical_path"]["available"] is False
    p = _cli(d, "--no-cache")
    assert p.returncode == 2 and p.stderr.startswith("tracelens: error: ") and p.stderr.count("\n") == 1


def test_unit_step_missing_and_unknown_step():
    a = _analysis(NCCL_2RANK)
    gpu = a.gpu.copy()
    gpu.loc[gpu["rank"] == 1, "step"] = gpu.loc[gpu["rank"] == 1, "step"].replace({1: 7})
    with pytest.raises(TraceError, match="rank 1 has no GPU work in step 1"):
        critical_path(gpu, a.comm_instances(), a.host_syncs(), [1], trace=a.trace)
    with pytest.raises(TraceError, match="step 9 is not in the traces"):
        critical_path_of(a, 9)


def test_cli_text_and_json(tmp_path):
    out = tmp_path / "cp.json"
    p = _cli(H100 / "ep4_L0_loop", "--json", out)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("step 4: critical path") and "launch-bound" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == 1 and doc["available"]
    assert sum(s["dur_us"] for s in doc["segments"]) == pytest.approx(doc["span_us"], abs=0.01)
    assert {s["kind"] for s in doc["segments"]} <= set(KINDS)


def test_cli_reads_a_single_trace_file(tmp_path):
    # the verb reads a single trace file as well as a run dir
    f = tmp_path / "one.json.gz"
    shutil.copy(MI250, f)
    p = _cli(f, "--no-cache")
    assert p.returncode == 0 and "critical path" in p.stdout


def test_segment_text_columns_are_the_strings_pandas_would_type():
    """The walk records codes and builds the text columns from them (no Python string per segment): each column
    holds the strings, typed as pandas types a column of Python strings, and the frame is the one pandas builds
    from those strings row by row."""
    import pandas as pd

    from tracelens.analysis import critical_path as CP

    a = _analysis(H100 / "pp4_1f1b")
    seg = critical_path_of(a).segments
    assert len(seg) > 1000 and set(seg["stage"]) - {""}  # pipeline actions and paths as stages
    rebuilt = pd.DataFrame({c: (np.array(seg[c].tolist(), dtype=object) if c in ("kind", "what", "op", "stage")
                                else seg[c].to_numpy()) for c in seg.columns})
    pd.testing.assert_frame_equal(seg, rebuilt)
    col = CP._text_column(np.array([2, 0, 1, 2]), ["x", "", "y z"])
    pd.testing.assert_series_equal(pd.Series(col), pd.Series(np.array(["y z", "x", "", "y z"], dtype=object)))
    codes, strings = CP._codes(pd.Series(["b", None, "a", "b"], dtype="category"))
    assert [strings[c] for c in codes] == ["b", "", "a", "b"]
    codes, strings = CP._codes(pd.Series(["b", None, "a", "b"], dtype=object))
    assert [strings[c] for c in codes] == ["b", "", "a", "b"]


@pytest.mark.parametrize("path", RUNS, ids=lambda p: "/".join(p.parts[-2:]))
def test_compiled_walk_is_the_python_walk(path, monkeypatch):
    """The compiled walk (tracelens/analysis/_walk.c) and `_walk_python`, its reference and fallback, give the same
    segments, steps and notes: hops, unfollowed waits, syncs and launch-bound stretches included."""
    import pandas as pd

    from tracelens.analysis import critical_path as CP

    if CP._walk is None:
        pytest.skip("the compiled walk is not built (setup.py build_ext --inplace)")
    a = _analysis(path)
    compiled = critical_path_of(a)
    monkeypatch.setattr(CP, "_walk", None)
    python = critical_path_of(a)
    pd.testing.assert_frame_equal(compiled.segments, python.segments)
    pd.testing.assert_frame_equal(compiled.steps, python.steps)
    assert compiled.notes == python.notes and compiled.problem == python.problem

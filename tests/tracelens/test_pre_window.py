"""GPU work queued before profiling began (the host ran ahead of the device) runs inside the first profiled
step without being its work: the analyzer finds it by correlation id and says so, with the count and time
computed here from the raw JSON."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import tracelens

FIX = Path(__file__).resolve().parents[1] / "fixtures"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _raw(path: Path):
    with gzip.open(path, "rt") as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    first = min(e["args"]["correlation"] for e in ev
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}))
    pre = [e for e in ev if e.get("cat") in GPU_CATS and e.get("args", {}).get("correlation", -1) >= 0
           and e["args"]["correlation"] < first]
    steps = [(int(re.sub(r"\D", "", e["name"])), e["ts"], e["ts"] + e["dur"]) for e in ev
             if e["name"].startswith("ProfilerStep#")]
    in_step = {}
    for e in pre:
        s = next((n for n, a, b in steps if a <= e["ts"] < b), None)
        if s is not None:
            in_step.setdefault(s, []).append(e["dur"])
    return in_step


def test_work_queued_before_the_window_is_named_with_its_step():
    path = FIX / "external" / "hta" / "trace_diff" / "test.json.gz"
    raw = _raw(path)
    assert raw, "the fixture has kernels launched before its first recorded launch"
    a = tracelens.analyze(tracelens.load(path, progress=False))
    got = [w for w in a.warnings if "launched before the trace's first recorded launch" in w]
    assert len(got) == len(raw)
    for step, durs in raw.items():
        w = next(w for w in got if f"run in step {step}:" in w)
        assert f": {len(durs)} GPU events ({sum(durs) / 1e3:.1f} ms)" in w


def test_a_trace_synced_before_its_window_has_none():
    a = tracelens.analyze(tracelens.load(FIX / "h100_proxy_loop_mbs8", progress=False))
    assert not any("launched before the trace's first recorded launch" in w for w in a.warnings)


def test_ranks_with_the_same_step_share_one_line():
    """4 ranks whose host ran ahead into the same step: one warning for them (the first screen of their report held
    four near-identical lines), with the per-rank range of events and ms, each rank's counted from its raw JSON."""
    run = FIX / "h100_4gpu" / "ep4_cap_ovl"
    per_rank = {r: _raw(run / "traces" / f"rank{r}.json.gz") for r in range(4)}
    assert all(len(v) == 1 for v in per_rank.values()) and len({s for v in per_rank.values() for s in v}) == 1
    step = next(iter(per_rank[0]))
    counts = [len(v[step]) for v in per_rank.values()]
    ms = [sum(v[step]) / 1e3 for v in per_rank.values()]
    a = tracelens.analyze(tracelens.load(run, progress=False))
    got = [w for w in a.warnings if "first recorded launch" in w]
    assert got == [f"ranks 0, 1, 2, 3: {min(counts)}-{max(counts)} GPU events ({min(ms):.1f}-{max(ms):.1f} ms) per "
                   f"rank were launched before their trace's first recorded launch (the host ran ahead when profiling "
                   f"began) and run in step {step}: their GPU figures include work of the step before"]


def test_the_unlinked_kernels_health_check_says_which_were_queued_before_profiling():
    """ep4_cap_ovl: every kernel without a launch in the trace was queued before profiling began (its correlation id
    below every runtime call's, counted per rank from the raw JSON): the health check says so and counts them."""
    run = FIX / "h100_4gpu" / "ep4_cap_ovl"
    raw = {r: sum(len(d) for d in _raw(run / "traces" / f"rank{r}.json.gz").values()) for r in range(4)}
    h = tracelens.analyze(tracelens.load(run, progress=False)).health()
    rows = h[h["check"] == "unlinked_kernels"]
    assert sorted(r[0] for r in rows["ranks"]) == [0, 1, 2, 3]
    for r in rows.itertuples(index=False):
        q = r.numbers["queued_before_profiling"]
        assert q == raw[r.ranks[0]] and q <= r.numbers["events"]
        assert ("all of them were queued before profiling began" in r.found) == (q == r.numbers["events"])

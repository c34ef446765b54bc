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

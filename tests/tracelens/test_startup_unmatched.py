"""A start-up wait whose peer kernel is missing stays out of the steady figures (found by the every-verb fuzz).

h200_nccl_2rank's first all-to-all on rank 1 waits ~0.76 s for rank 0 to start profiling (tests/fixtures/
README.md). With rank 0's first GPU event dropped, that kernel has no partner to split its wait from its
transfer; it used to stay in the window as 1.4 s of "exposed communication" in a ~15 ms trace (a finding
share of 45x the span). Counted as waiting for its whole duration, the window leaves its step out as it does
for the intact pair, and the figures match the intact pair's.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import tracelens

PAIR = Path(__file__).resolve().parents[1] / "fixtures" / "h200_nccl_2rank"


def _drop_first_gpu_event(src: Path, dst: Path) -> None:
    doc = json.load(gzip.open(src))
    gpu = [i for i, e in enumerate(doc["traceEvents"]) if e.get("ph") == "X" and e.get("cat") == "kernel"]
    first = min(gpu, key=lambda i: float(doc["traceEvents"][i]["ts"]))
    del doc["traceEvents"][first]
    dst.write_bytes(gzip.compress(json.dumps(doc).encode()))


def test_unmatched_startup_kernel_is_left_out(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    _drop_first_gpu_event(PAIR / "rank0.json.gz", d / "rank0.json.gz")
    (d / "rank1.json.gz").write_bytes((PAIR / "rank1.json.gz").read_bytes())
    a = tracelens.analyze(tracelens.load(d, cache=False, progress=False))
    intact = tracelens.analyze(tracelens.load(PAIR, cache=False, progress=False))
    assert 0 not in a.window.used and a.window.used == intact.window.used
    span = a.timeline.set_index("rank")["span_us"]
    assert span.max() < 2 * span.min()  # no rank's window stretched by the 0.76 s wait
    for f in a.findings():
        assert f["share_of_span"] is None or 0.0 <= f["share_of_span"] <= 1.0, f
    ex = next(f for f in a.findings() if f["type"] == "exposed_comm")
    ref = next(f for f in intact.findings() if f["type"] == "exposed_comm")
    assert ex["recoverable_us"] == pytest.approx(ref["recoverable_us"], rel=0.05)

"""Why the late rank was late (issue 34 item 2): the rank last into collectives and what it did before arriving.

Independent truth: tests/fixtures/README.md says rank 1 of h200_nccl_2rank spins its GPU (`torch.cuda._sleep`,
a kernel of category "other") before each all-reduce, so rank 0 waits ~2.0 ms inside it; on the 4-GPU EP
level-0 fixture the raw JSON shows which rank's reduce-scatter kernels start last.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import tracelens
from tracelens.analysis.straggler import late_rank_causes

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def _kernels(run: Path, needle: str) -> dict[int, list[dict]]:
    out = {}
    for f in sorted((run / "traces").iterdir()) if (run / "traces").is_dir() else sorted(run.glob("rank*.json.gz")):
        r = int(f.name.split(".")[0].removeprefix("rank"))
        ev = json.load(gzip.open(f))["traceEvents"]
        out[r] = sorted((e for e in ev if e.get("cat") == "kernel" and needle in e.get("name", "")),
                        key=lambda e: float(e["ts"]))
    return out


def test_injected_skew_is_named_with_its_cause():
    run = FIX / "h200_nccl_2rank"
    a = tracelens.analyze(tracelens.load(run, progress=False))
    t = late_rank_causes(a)
    row = t[(t["family"] == "all_reduce")].iloc[0]
    assert int(row["late_rank"]) == 1 and row["cause"] == "compute: other"
    # the wait it cost: rank 0's all-reduce kernels minus rank 1's, from the raw JSON (README: ~2.0 ms each)
    k = _kernels(run, "AllReduce")
    waits = [float(k0["dur"]) - float(k1["dur"]) for k0, k1 in zip(k[0], k[1])]
    steady = [w for w in waits if w > 0][-int(row["instances"]):]
    assert float(row["wait_caused_us"]) == pytest.approx(sum(steady), rel=0.05)
    top = next(f for f in a.findings() if f["type"] == "late_rank")
    assert top["title"].startswith("rank 1 is last into all_reduce") and "computed more other" in top["title"]


def test_ep4_level0_top_finding_names_the_late_rank_and_its_cause():
    run = FIX / "h100_4gpu" / "ep4_L0_loop"
    a = tracelens.analyze(tracelens.load(run, progress=False))
    k = _kernels(run, "ReduceScatter")
    steps = a.window.used
    # the profiled step's reduce-scatters: the rank whose kernel starts last, per instance, from the raw JSON
    n = min(len(v) for v in k.values())
    last = [max(k, key=lambda r: float(k[r][i]["ts"])) for i in range(n)]
    late = next(f for f in a.findings() if f["type"] == "late_rank")
    assert late["evidence"]["late_rank"] == 0 and last.count(0) >= n - 1, (last, steps)
    assert late["evidence"]["cause"] == "idle: launch-bound"
    top = a.findings()[0]
    assert "rank 0" in top["title"] and ("launch" in top["title"])
    # waits are not communication: the exposed-communication finding leaves them out
    ex = next((f for f in a.findings() if f["type"] == "exposed_comm"), None)
    waits = a.comm_instances()
    waits = waits[~waits["startup"] & waits["cross_rank"] & waits["step"].isin(steps)]
    per_rank_wait = waits.groupby("rank")["sync_us"].sum()
    if ex is not None:
        for r, us in ex["evidence"]["per_rank"].items():
            # the timeline's exposed communication is the transfer part only (tracelens.analysis.waits): at most
            # the rank's communication kernel time less its waits
            row = a.timeline.set_index("rank").loc[int(r)]
            assert us == pytest.approx(row["exposed_comm_us"], abs=1e-3)
            assert us <= row["comm_us"] - per_rank_wait.get(int(r), 0.0) + 1.0

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


def _raw_waits(run: Path) -> dict[tuple[str, int], float]:
    """µs per rank that the ranks waited inside NCCL collectives, by (family, rank last to arrive), from the raw
    JSON: the i-th NCCL kernel of each rank is the same collective (2 ranks, one group); a rank waits from its
    kernel's start until the last rank's starts, at most its kernel's duration (NCCL spins in the kernel)."""
    fam = {"AllGather": "all_gather", "ReduceScatter": "reduce_scatter", "AllReduce": "all_reduce",
           "SendRecv": "all_to_all"}  # SendRecv: the EP dispatch/combine all-to-all of this run
    k = _kernels(run, "ncclDevKernel_")
    assert sorted(k) == [0, 1] and len(k[0]) == len(k[1]) > 0
    out: dict[tuple[str, int], float] = {}
    for a, b in zip(k[0], k[1]):
        name = a["name"].removeprefix("ncclDevKernel_").split("_")[0].split("(")[0]
        assert b["name"].removeprefix("ncclDevKernel_").split("_")[0].split("(")[0] == name
        last_ts = max(float(a["ts"]), float(b["ts"]))
        last = 0 if float(a["ts"]) >= float(b["ts"]) else 1
        wait = sum(min(max(last_ts - float(e["ts"]), 0.0), float(e["dur"])) for e in (a, b))
        out[(fam[name], last)] = out.get((fam[name], last), 0.0) + wait / 2
    return out


def test_late_rank_and_sync_wait_count_each_wait_once():
    """issue 36: on the EP 2 level-0 run both findings counted the same collective waits (~14.5 ms each, and
    docs/host.md said "do not add them"). The late_rank finding claims the waits its rank caused (with their
    cause); each sync_wait keeps its family's other waits: together, every wait of the run once."""
    run = FIX / "h200_ep2_run" / "L0_loop"
    raw = _raw_waits(run)
    fs = tracelens.analyze(tracelens.load(run, progress=False)).findings()
    late = next(f for f in fs if f["type"] == "late_rank")
    assert late["evidence"]["late_rank"] == 0
    caused = {fam: w for (fam, last), w in raw.items() if last == 0}
    assert late["recoverable_us"] == pytest.approx(sum(caused.values()), abs=0.01)  # 14.54 ms
    syncs = {f["evidence"]["family"]: f for f in fs if f["type"] == "sync_wait"}
    rest = {fam: w for (fam, last), w in raw.items() if last != 0}  # rank 1 last: all-to-all, all-gather
    assert set(syncs) == set(rest) == {"all_to_all", "all_gather"}  # reduce-scatter, all-reduce: all rank 0's
    for fam, f in syncs.items():
        assert f["recoverable_us"] == pytest.approx(rest[fam], abs=0.01), fam
        assert f["evidence"]["straggler_rank"] == 1  # of the waits it keeps
        # the family's whole wait and the late rank's share of it, said in the evidence
        assert f["evidence"]["sync_us_per_rank"] == pytest.approx(rest[fam] + caused.get(fam, 0.0), abs=0.01)
        assert f["evidence"]["late_rank_us_per_rank"] == pytest.approx(caused.get(fam, 0.0), abs=0.01)
    total = late["recoverable_us"] + sum(f["recoverable_us"] for f in syncs.values())
    assert total == pytest.approx(sum(raw.values()), abs=0.02)  # 14.68 ms: each wait once

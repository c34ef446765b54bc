"""Communication vs synchronization on the 2-rank H200 fixture with injected skew (see fixtures README)."""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal

import pytest

import tracelens
from tracelens.analysis.comm import bus_factor, collective_instances, comm_summary, dtype_bytes, exposed_comm, stragglers

from ..conftest import MOE_LOOP, NCCL_2RANK, raw_events


@pytest.fixture(scope="module")
def inst():
    return collective_instances(tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False)))


def raw_allreduce(rank):
    ev = raw_events(NCCL_2RANK / f"rank{rank}.json.gz")
    return [(Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"])) for e in ev
            if e.get("cat") == "kernel" and "AllReduce" in e["name"]]


def test_allreduce_comm_and_sync_match_raw_and_readme(inst):
    ar = inst[inst["collective"] == "allreduce"].sort_values(["instance", "rank"])
    r0, r1 = raw_allreduce(0), raw_allreduce(1)
    assert len(r0) == len(r1) == 3
    for i, ((s0, e0), (s1, e1)) in enumerate(zip(r0, r1)):
        last = max(s0, s1)
        got0 = ar[(ar["instance"] == i) & (ar["rank"] == 0)].iloc[0]
        got1 = ar[(ar["instance"] == i) & (ar["rank"] == 1)].iloc[0]
        assert got0["sync_us"] == pytest.approx(float(last - s0), abs=1e-3)
        assert got0["comm_us"] == pytest.approx(float(e0 - last), abs=1e-3)
        assert got1["comm_us"] == pytest.approx(float(e1 - last), abs=1e-3)
        # the README's figures: ~0.46 ms of communication on both ranks, ~2.0 ms of waiting on rank 0
        assert got0["comm_us"] == pytest.approx(460, abs=20) and got1["comm_us"] == pytest.approx(460, abs=20)
        assert got0["sync_us"] == pytest.approx(2040, abs=60) and got1["sync_us"] < 1.0
        assert got0["last_rank"] == 1 and not got0["startup"]


def test_startup_wait_flagged_and_excluded(inst):
    first = inst[(inst["family"] == "all_to_all") & (inst["instance"] == 0)]
    assert first["startup"].all() and first["sync_us"].max() > 700_000  # rank 1 waited for rank 0 to start
    assert not inst[inst["instance"] > 0]["startup"].any()
    summ = comm_summary(inst).set_index(["rank", "collective"])
    assert summ.loc[(1, "all_to_allv"), "startup_excluded"] == 1
    assert summ.loc[(1, "all_to_allv"), "sync_us"] < 1_000  # the 0.76+ s wait is not in the totals
    assert summ.loc[(0, "allreduce"), "sync_us"] == pytest.approx(3 * 2040, abs=150)


def test_bandwidth_and_stragglers(inst):
    ar = inst[inst["collective"] == "allreduce"].iloc[0]
    assert ar["bytes"] == 67108864 * 2  # bf16 elements from the kernel args
    assert ar["busbw_gbps"] == pytest.approx(ar["bytes"] / (ar["comm_us"] * 1e3) * bus_factor("all_reduce", 2))
    s = stragglers(inst).set_index("family")
    assert s.loc["all_reduce", "straggler_rank"] == 1 and s.loc["all_reduce", "straggler_share"] == 1.0
    assert dtype_bytes("BFloat16") == 2 and dtype_bytes("c10::Half") == 2 and dtype_bytes("weird") is None


def test_exposed_comm_excludes_startup():
    a = tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))
    ex = exposed_comm(a, collective_instances(a)).set_index("rank")
    whole = a.timeline_all if getattr(a, "timeline_all", None) is not None else a.timeline  # every event
    assert ex.loc[1, "comm_us"] < 10_000 < whole.set_index("rank").loc[1, "comm_us"]
    assert 0 <= ex.loc[0, "exposed_comm_us"] <= ex.loc[0, "comm_us"]


def test_no_comm_single_gpu():
    a = tracelens.analyze(tracelens.load(MOE_LOOP, cache=False))
    assert collective_instances(a).empty and comm_summary(collective_instances(a)).empty


def test_cli_json(tmp_path):
    out = tmp_path / "comm.json"
    p = subprocess.run([sys.executable, "-m", "tracelens", "comm", str(NCCL_2RANK), "--json", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "start-up wait" in p.stdout
    doc = json.loads(out.read_text())
    rec = doc["records"][0]
    assert {"rank", "collective", "instance", "bytes", "start_us", "comm_us", "sync_us"} <= set(rec)
    assert {s["collective"] for s in doc["summary"]} >= {"allreduce", "all_to_allv"}


def test_startup_wait_does_not_poison_per_step_figures():
    from tracelens.analysis.steps import step_figures

    a = tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))
    st = a.step_timeline.set_index(["rank", "step"])
    assert st.loc[(1, 0), "startup_wait_us"] > 700_000 and st.loc[(0, 0), "startup_wait_us"] == 0
    assert any("start-up wait" in w for w in a.warnings)
    per = step_figures(a).per_step.set_index("step")
    assert per["step_time_us"].max() < 10_000  # ~5 ms steps, not 1.4 s


def test_window_starts_is_each_ranks_first_event_time():
    """One rank (the fast path) and two ranks: each rank's smallest ts, as pandas' groupby of every event gives it."""
    import pandas as pd

    import tracelens
    from tracelens.analysis.comm import window_starts

    from pathlib import Path

    fx = Path(__file__).resolve().parents[1] / "fixtures"
    for path in (fx / "h200_nccl_2rank", fx / "h200_ep2_run" / "L0_loop" / "traces" / "rank0.json.gz"):
        ev = tracelens.load(path, progress=False).events
        pd.testing.assert_series_equal(window_starts(ev), ev.groupby("rank")["ts"].min())

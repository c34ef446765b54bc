"""Communication vs synchronization on the 2-rank H200 fixture with injected skew (see fixtures README)."""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal

import pytest

import tracelens
from tracelens.analysis.comm import bus_factor, collective_instances, comm_summary, dtype_bytes, exposed_comm, stragglers

from ..conftest import FIXTURES, MOE_LOOP, NCCL_2RANK, raw_events


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


PP4_1F1B = FIXTURES / "h100_4gpu" / "pp4_1f1b" / "traces"


def _raw_pipeline_p2p(traces):
    """Per rank, each batched SendRecv kernel (no args: launched under `nccl:coalesced`) with the peers its own
    send/recv ops name (the `record_param_comms` ops since the previous `nccl:coalesced` on that thread), from
    the raw JSON."""
    out = {}
    for f in sorted(traces.glob("rank*.json.gz")):
        ev = raw_events(f)
        rank = int(f.name[4:].split(".")[0])
        launch = {e["args"]["correlation"]: e for e in ev
                  if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        host = sorted((e for e in ev if e.get("ph") == "X" and e.get("name") in ("record_param_comms", "nccl:coalesced")),
                      key=lambda e: Decimal(str(e["ts"])))
        windows, cur = [], set()
        for e in host:
            if e["name"] == "record_param_comms":
                if e["args"].get("Collective name") in ("send", "recv"):
                    cur.add(e["args"].get("Dst Rank", e["args"].get("Src Rank")))
            else:
                windows.append((Decimal(str(e["ts"])), Decimal(str(e["ts"])) + Decimal(str(e["dur"])), cur))
                cur = set()
        ks = []
        for k in ev:
            if k.get("cat") == "kernel" and "SendRecv" in k["name"] and "Collective name" not in k["args"]:
                t = Decimal(str(launch[k["args"]["correlation"]]["ts"]))
                peers = set().union(*(p for s, e, p in windows if s <= t <= e))
                ks.append((Decimal(str(k["ts"])), Decimal(str(k["ts"])) + Decimal(str(k["dur"])), peers))
        out[rank] = ks
    return out


def test_pipeline_p2p_partners_only_among_the_kernels_own_peers():
    """A batched pipeline SendRecv kernel is paired only with kernels of the ranks its own ops exchange with
    (docs/comm.md): on the 4-stage 1F1B fixture, rank 1's kernel that only sends to rank 0 and overlaps no
    rank-0 kernel was paired with rank 2's (its other neighbour) and counted as a cross-rank transfer."""
    raw = _raw_pipeline_p2p(PP4_1F1B)
    a = tracelens.analyze(tracelens.load(sorted(PP4_1F1B.glob("rank*.json.gz")), cache=False))
    inst = collective_instances(a)
    p2p = inst[inst["family"] == "p2p"]
    t0 = min(Decimal(str(e["ts"])) for f in sorted(PP4_1F1B.glob("rank*.json.gz")) for e in raw_events(f)
             if e.get("ph") == "X")
    no_partner = 0
    for rank, ks in raw.items():
        for s, e, peers in ks:
            starts = []
            for q in peers:
                over = [(abs(qe - e), qs) for qs, qe, _ in raw[q] if qs < e and qe > s]
                if not over:
                    starts = None
                    break
                starts.append(min(over)[1])
            got = p2p[(p2p["rank"] == rank) & ((p2p["start_us"] - float(s - t0)).abs() < 1e-3)]
            assert len(got) == 1
            row = got.iloc[0]
            if starts is None:
                no_partner += 1
                assert not row["cross_rank"] and row["sync_us"] != row["sync_us"]  # NaN: no partner
            else:
                last = max(starts + [s])
                assert row["cross_rank"]
                assert row["sync_us"] == pytest.approx(float(min(last - s, e - s)), abs=1e-3)
    assert no_partner == 4

"""The layout mechanism (tracelens/projection/mechanisms/layout.py): ep / dp / EP dispatch path on the same GPUs.

Its tables against values computed here from the raw fixture files (routing.json read as JSON, the dispatch
rule of trainer/model/dispatch.py written out), a prediction on the committed 4 x H100 EP run against the
documented measurement of the same config (docs/performance.md), and the CLI's one-line refusals."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest

from moespec.config import load_config
from tracelens.projection import whatif as W
from tracelens.projection.mechanisms import layout as L

from ._cli import run_cli

FIX = Path(__file__).resolve().parents[1] / "fixtures"
CAP_OVL = FIX / "h100_4gpu" / "ep4_cap_ovl"
ROUTED = FIX / "h100_4gpu_routing" / "ep4_L3_torch"
ROOT = Path(__file__).resolve().parents[2]


def _cfg(**kw) -> dict:
    return load_config(None, {**load_config("gpu_proxy_train"), **kw})


def test_buffer_rows_follow_the_dispatch_rule():
    # trainer/model/dispatch.py: capacity = ceil(f * T_c * k / P) per peer and chunk; nccl L2-3 = P*T*min(k, El)
    T = 16 * 2048
    cap = _cfg(ep=4, ep_dispatch="capacity", ep_capacity_factor=1.25, ep_overlap=True)
    assert L.capacity_rows(cap, T) == math.ceil(1.25 * (T / 2) * 6 / 4) == 30_720
    # the fixture README: the grouped GEMMs' input buffers are 4 * 30,720 = 122,880 rows per chunk
    assert L.recv_buffer_rows(cap, T) == 122_880
    assert L.send_rows(cap, T) == 2 * 122_880
    nccl = _cfg(ep=4)
    assert L.send_rows(nccl, T) == 4 * T * 6  # level 3: the worst case, min(6, 16) slots per token and peer
    assert L.send_rows(_cfg(ep=4, sync_free_level=1), T) == T * 6  # exact rows
    assert L.send_rows(_cfg(ep=1), T) == 0 and L.recv_buffer_rows(_cfg(ep=1), T) == 0


def test_the_fixture_all_to_all_has_the_capacity_buffer_size():
    # the committed run's token all-to-alls, read from the raw trace JSON: 122,880 rows x 2048 x bf16 each
    import gzip

    with gzip.open(CAP_OVL / "traces" / "rank0.json.gz") as fh:
        doc = json.loads(fh.read())
    sizes = {int(e["args"]["In msg nelems"]) for e in doc["traceEvents"]
             if e.get("name") == "record_param_comms" and e.get("args", {}).get("Collective name") == "all_to_allv"
             and int(e["args"].get("In msg nelems", 0)) > 1 << 16}
    cap = _cfg(ep=4, ep_dispatch="capacity", ep_overlap=True)
    assert sizes == {L.recv_buffer_rows(cap, 16 * 2048) * 2048}


def test_fsdp_expert_traffic_per_layout():
    n = 64 * 3 * 2048 * 1408  # the experts' w13 [E, 2F, d] and w2 [E, d, F] of one MoE layer
    assert L.fsdp_expert_bytes(_cfg(ep=1), 4) == (2 * n, 4 * n, 4)  # bf16 gathered, fp32 reduced, over dp 4
    assert L.fsdp_expert_bytes(_cfg(ep=2), 4) == (n, 2 * n, 2)  # half the experts per rank, over dp 2
    assert L.fsdp_expert_bytes(_cfg(ep=4), 4) == (0, 0, 1)  # dp 1: no expert gather


def test_expert_rows_from_the_routing_file():
    doc = json.loads((ROUTED / "routing.json").read_text())
    counts = {}
    for r in doc["ranks"]:
        for ly in r["layers"]:
            st = ly["steps"]
            counts[(r["rank"], ly["layer"])] = [sum(s["counts"][e] for s in st) / sum(s["forwards"] for s in st)
                                                for e in range(64)]
    from tracelens.io.run import Run

    routing, why = L.read_routing(Run.open(ROUTED), None)
    assert routing is not None and not why
    cfg = json.loads((ROUTED / "manifest.json").read_text())["config"]
    cfg = load_config(None, {k: v for k, v in cfg.items() if k in load_config(None, {})})
    T = 1024
    # ep 2 on 4 GPUs: groups {0, 1}, {2, 3}; rank 1 holds experts 32..63 of its group's tokens
    rows = L.expert_rows({**cfg, "ep": 2, "dp": None}, 4, T, routing)
    want = sum(sum(counts[(s, 1)][32:64]) for s in (0, 1))
    assert rows[1][1] == pytest.approx(want)
    # ep 1: every rank computes its own T*k rows
    rows1 = L.expert_rows({**cfg, "ep": 1, "dp": None}, 4, T, routing)
    assert all(rows1[r][1] == pytest.approx(T * 6) for r in range(4))
    # capacity: at most ceil(f * T * k / ep) rows from each peer
    capc = {**cfg, "ep": 4, "dp": None, "ep_dispatch": "capacity", "ep_capacity_factor": 1.0}
    cap = math.ceil(1.0 * T * 6 / 4)
    rc = L.expert_rows(capc, 4, T, routing)
    for r in range(4):
        want = sum(min(sum(counts[(s, 1)][16 * r:16 * r + 16]), cap) for s in range(4))
        assert rc[r][1] == pytest.approx(want)
    # no routing file: uniform, said so by the caller
    assert L.expert_rows({**cfg, "ep": 4, "dp": None}, 4, T, None)[2][1] == pytest.approx(T * 6)


def test_bandwidth_lookup_takes_the_nearest_size_of_the_same_collective_and_group():
    bw = L.Bandwidth(pd.DataFrame({"family": ["all_to_all", "all_to_all", "all_gather"], "group_size": [4, 4, 2],
                                   "bytes": [1 << 20, 1 << 30, 1 << 30], "busbw_gbps": [50.0, 200.0, 300.0],
                                   "n": [4, 4, 2]}))
    ns, src = bw.seconds("all_to_all", 4, 1 << 29)
    assert ns == pytest.approx((1 << 29) * 3 / 4 / 200e9 * 1e9)
    assert "all_to_all over 4" in src
    ns2, src2 = bw.seconds("all_to_all", 2, 1 << 29)  # no all-to-all over 2: the link over 2 (its fastest collective)
    assert ns2 == pytest.approx((1 << 29) / 2 / 300e9 * 1e9) and "all_gather of 1,024 MiB over 2: the link" in src2
    assert bw.seconds("all_to_all", 1, 1 << 29)[0] == 0.0
    # other families keep the nearest size of the same collective and group
    assert "all_gather over 2" in bw.seconds("all_gather", 2, 1 << 29)[1]


def test_an_all_to_all_without_one_measured_takes_the_fastest_large_collective_of_the_group():
    """A DP run has no all-to-all: the link's rate over the group is its fastest collective of >= 64 MiB over it (the
    4 x H100 dp 4 run: a 1,600 MiB reduce-scatter at 324 GB/s, not the nearest size's 2,112 MiB one at 251), else over
    any group size; a smaller collective does not count (latency-bound)."""
    t = pd.DataFrame({"family": ["all_gather", "reduce_scatter", "reduce_scatter", "all_gather"],
                      "group_size": [4, 4, 4, 2], "bytes": [1 << 20, 1600 << 20, 2112 << 20, 1 << 30],
                      "busbw_gbps": [400.0, 324.0, 251.0, 287.0], "n": [4, 4, 4, 2]})
    bw = L.Bandwidth(t)
    assert bw.lookup("all_to_all", 4, 3 << 30)[0] == 324.0
    assert bw.lookup("all_to_all", 2, 1 << 30)[0] == 287.0
    assert bw.lookup("all_to_all", 8, 1 << 30)[0] == 324.0  # no collective over 8: the fastest of any group
    assert bw.lookup("reduce_scatter", 4, 3 << 30)[0] == 251.0  # the nearest size for the others


@pytest.fixture(scope="module")
def cap_model():
    return W.Model.from_run(CAP_OVL)


def test_ep4_capacity_to_dp4_against_the_measured_row(cap_model):
    # docs/performance.md, 'Expert parallelism at the speed of data parallelism': dp4 118,384 tokens/s/GPU, 29.9 GiB
    p = cap_model.predict({"ep": 1})
    assert p.tokens_per_s_per_gpu == pytest.approx(118_384, rel=0.08)
    assert p.fits and p.peak_gib == pytest.approx(29.9, rel=0.10)
    text = "\n".join(p.modeled)
    assert "dispatch / combine stages" in text and "FSDP of the experts" in text
    # the experts' FSDP: 3 MoE layers x (2 all-gathers + 1 reduce-scatter) added to the replay
    assert "the run has none (dp 1)" in text


def test_ep4_worst_case_buffer_memory_against_the_measured_row(cap_model):
    # the nccl level-3 worst-case buffers: 60.8 GiB measured (same table); capacity 34.2 / 33.4 GiB
    p = cap_model.predict({"ep_dispatch": "nccl"})
    assert p.peak_gib == pytest.approx(60.8, rel=0.10)
    assert p.tokens_per_s_per_gpu < cap_model.base_tokens_per_s_per_gpu
    assert any("786,432 rows" in m for m in p.modeled)


def test_refusals_are_one_line(cap_model):
    for ch, needle in (({"ep": 3}, "not divisible by ep=3"), ({"pp": 3, "microbatches": 8}, "world size 4"),
                       ({"ep": 2, "dp": 4}, "world size 4")):
        with pytest.raises(W.WhatIfError, match=needle) as e:
            cap_model.predict(ch)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("sets,needle", [(["ep=3"], "ep=3"), (["ep=2", "dp=4"], "world size 4"),
                                         (["pp=3", "microbatches=8"], "world size 4")])
def test_cli_refuses_a_layout_in_one_line(sets, needle):
    args = ["whatif", CAP_OVL]
    for s in sets:
        args += ["--set", s]
    r = run_cli(*args)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_the_accuracy_harness_reads_the_measured_format(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_whatif_layouts as B
    finally:
        sys.path.pop(0)
    doc = {"config": "gpu_proxy_train",
           "baselines": {"ep4": {"run": str(CAP_OVL), "set": {"ep": 4, "ep_dispatch": "capacity", "ep_overlap": True}}},
           "points": [{"name": "dp4", "set": {"ep": 1}, "tokens_per_s_per_gpu": 118384, "peak_mem_gib": [29.9, 29.1],
                       "status": "ok"},
                      {"name": "ep4_nccl", "set": {"ep": 4, "ep_dispatch": "nccl", "ep_overlap": True,
                                                   "micro_batch_size": 48}, "status": "oom"},
                      {"name": "ep4_cap", "set": {"ep": 4, "ep_dispatch": "capacity"}, "tokens_per_s_per_gpu": 101386,
                       "status": "ok"}]}
    f = tmp_path / "measured.json"
    f.write_text(json.dumps(doc))
    res = B.evaluate(f)
    rows = {r["point"]: r for r in res["rows"]}
    assert rows["dp4"]["changes"] == {"ep": 1, "ep_dispatch": "nccl", "ep_overlap": False}
    assert abs(rows["dp4"]["error"]) < 0.08 and rows["dp4"]["verdict_right"]
    assert rows["ep4_nccl"]["predicted_fits"] is False and rows["ep4_nccl"]["verdict_right"]  # an OOM, predicted
    assert abs(rows["ep4_cap"]["error"]) < 0.08  # overlap off: the overlap mechanism (test_whatif_overlap.py)
    s = res["summary"]["ep4"]
    assert s["n"] == 2 and s["verdicts"] == 3 and s["verdicts_right"] == 3 and not s["meets"]
    assert "dp4" in B.to_text(res)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"baselines": [], "points": []}))
    with pytest.raises(B.MeasuredError, match="baselines"):
        B.load_measured(bad)

"""The expert placement mechanism (tracelens/projection/mechanisms/ep_placement.py): the rows each EP rank computes
under another placement, from the run's routing counts.

The rows against sums written here from the raw routing.json and the trainer's own plan (moespec.placement), the
pace (each rank's layer moves by the busiest rank's change) on a synthetic step, and the prediction on the committed
4 x H100 run against the measured pair of docs/performance.md stop 24 (another run of the same config)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moespec.placement import contiguous_placement, placement_plan
from tracelens.projection import replay as R
from tracelens.projection import whatif as W
from tracelens.projection.mechanisms import ep_placement as EPP
from tracelens.projection.mechanisms import layout as L
from tracelens.projection.profile import StepProfile

from ._cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
CAP = ROOT / "tests" / "fixtures" / "h100_4gpu_layouts" / "ep4_cap_mbs16"  # EP 4, capacity 1.25, routing.json
CAP_OVL = ROOT / "tests" / "fixtures" / "h100_4gpu" / "ep4_cap_ovl"  # EP 4, no routing.json
LOADS = str(CAP / "routing.json")
BAL = {"ep_placement": "balanced", "ep_placement_loads": LOADS}


@pytest.fixture(scope="module")
def model():
    return W.Model.from_run(CAP)


def _profiled_counts() -> dict:
    """(source rank, layer) -> tokens per logical expert per forward of the profiled steps, from the raw file."""
    doc = json.loads((CAP / "routing.json").read_text())
    out = {}
    for r in doc["ranks"]:
        for ly in r["layers"]:
            st = [s for s in ly["steps"] if s["forwards"] > 0]
            out[(r["rank"], ly["layer"])] = np.sum([s["counts"] for s in st], axis=0) / sum(s["forwards"] for s in st)
    return out


def test_rows_under_a_placement_are_the_held_experts_counts(model):
    cfg = model.config
    T, k, ep = 32_768, int(cfg["top_k"]), 4
    counts = _profiled_counts()
    routing = model.measured["layout"].routing
    plan = placement_plan({**cfg, **BAL})  # the trainer's own plan on these loads
    held = L.experts_by_rank({**cfg, **BAL}, ep, routing, cfg)
    assert held == {ly: [list(r) for r in lp.ranks] for ly, lp in plan.layers.items()}
    assert L.experts_by_rank(cfg, ep, routing, cfg) is None  # contiguous
    cap = L.capacity_rows(cfg, T)
    assert cap == 61_440  # ceil(1.25 * 32,768 * 6 / 4)
    for placement in (None, held):
        rows = L.expert_rows(cfg, 4, T, routing, False, placement)
        for r in range(4):
            for ly in (1, 2, 3):
                mine = placement[ly][r] if placement else contiguous_placement(64, ep)[r]
                # from each peer the rows routed to the experts rank r holds, at most its capacity
                want = sum(min(float(counts[(s, ly)][mine].sum()) * T / (counts[(s, ly)].sum() / k), cap)
                           for s in range(4))
                assert rows[r][ly] == pytest.approx(want, rel=1e-9)


def test_the_busiest_rank_sets_the_pace():
    # one rank, one MoE layer: a 4 ms expert stage (forward) on 100 rows; the busiest rank had 150, now 120, and this
    # rank goes from 100 to 120 rows: its stage x1.2 (4.8 ms), its wait for the busiest 2 ms -> 0: the stage and the
    # wait together move by the busiest rank's change, -30 rows x 40 us = -1.2 ms
    work = pd.DataFrame({"launch": [0], "start": [1_000], "dur": [4_000_000], "stream": [7], "name": ["gemm"],
                         "op": ["aten::_grouped_mm"], "path": [""], "dims": [""], "component": ["expert GEMMs"],
                         "scale": ["tokens"], "expert": [True], "moe_stage": ["moe/experts"], "layer": [1],
                         "backward": [False], "recompute": [False], "is_comm": [False], "linked": [True]})
    syncs = pd.DataFrame({"ts": pd.Series([], dtype="int64"), "end": pd.Series([], dtype="int64"),
                          "moe": pd.Series([], dtype=bool), "path": pd.Series([], dtype=object)})
    p = StepProfile(0, 1, "gpu", 0, 4_100_000, work, syncs, 1)
    plan = R.Plan.of(R.prepare(p), profiler_lead=False)
    rows0 = {0: {1: 100.0}, 1: {1: 150.0}}
    rows1 = {0: {1: 120.0}, 1: {1: 120.0}}
    moved, waits = L.scale_expert_stages(plan, work, 0, rows0, rows1, 1, 1, 2, 2, set(), [1])
    assert plan.dur[0] == pytest.approx(4_800_000)
    assert moved == pytest.approx(800_000)
    assert waits[(1, False)] == pytest.approx(0.0 - 2_000_000)
    add = EPP.pace(plan, work, waits)
    assert add == pytest.approx(-2_000_000)
    assert plan.dur[0] == pytest.approx(4_000_000 - 1_200_000)


def test_contiguous_to_balanced_against_the_measured_pair(model):
    """Measured (docs/performance.md stop 24, 4 x H100, the same config in another call): contiguous 101,919 ->
    balanced 101,796 tokens/s/GPU (-0.12 %): with capacity buffers the busiest rank stays at the capacity (every
    rank's received rows are capped at ep x capacity), so the pace barely moves."""
    p = model.predict(BAL)
    ratio = p.tokens_per_s_per_gpu / model.base_tokens_per_s_per_gpu
    measured = 101_796 / 101_919
    assert abs(ratio - measured) <= 0.01, ratio
    line = next(x for x in p.modeled if x.startswith("ep_placement contiguous -> balanced"))
    assert "rows max / mean over the EP group" in line and "memory unchanged" in line
    assert p.peak_gib == pytest.approx(model.predict({}).peak_gib)
    # the imbalance the line reports is the trainer's plan on the profiled step's counts
    assert "L2 1.76 -> 1.29" in line


def test_refusals_are_one_line(model, tmp_path):
    with pytest.raises(W.WhatIfError, match=r"ep_placement_loads: .*nope\.json: no such file") as e:
        model.predict({"ep_placement": "balanced", "ep_placement_loads": str(tmp_path / "nope.json")})
    assert "\n" not in str(e.value)
    # a run without routing.json: nothing says how many rows each expert received
    with pytest.raises(W.WhatIfError, match="ep_placement needs the run's routing counts per expert") as e:
        W.Model.from_run(CAP_OVL).predict(BAL)
    assert "\n" not in str(e.value)


def test_cli_without_routing_is_one_line_exit_2():
    r = run_cli("whatif", CAP_OVL, "--set", "ep_placement=balanced", "--set", f"ep_placement_loads={LOADS}")
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "routing.json" in lines[0] and "Traceback" not in r.stderr

"""The pipeline-layout mechanism (tracelens/projection/mechanisms/pp_layout.py): another pp on the run's GPUs.

The pp 4 -> 1 window against the stage means computed here from the raw pipeline action files, the tokens per GPU
against the trainer's rule, and the one-line refusals. No run of another pp than the recorded ones exists for these
configs: the predictions are unvalidated (docs/whatif.md says so)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from tracelens.projection import whatif as W

from ._cli import run_cli

FIX = Path(__file__).resolve().parents[1] / "fixtures"
PP4 = FIX / "h100_4gpu" / "pp4_1f1b"
CAP_OVL = FIX / "h100_4gpu" / "ep4_cap_ovl"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pp4():
    return W.Model.from_run(PP4)


def _stage_means(steps: set[int]) -> dict[tuple[int, str], float]:
    acts = []
    for f in sorted((PP4 / "pipeline").glob("rank*.jsonl.gz")):
        with gzip.open(f, "rt") as fh:
            acts += [json.loads(x) for x in fh if x.strip()]
    out: dict[tuple[int, str], list[float]] = {}
    for a in acts:
        if a["step"] in steps:
            out.setdefault((a["stage"], a["kind"]), []).append(a["end_ns"] - a["start_ns"])
    return {k: float(np.mean(v)) for k, v in out.items()}


def test_pp1_window_is_the_stages_work_back_to_back(pp4):
    # steady steps of the fixture (7 steps; 0 warm-up, 4 profiled, 5 the trace export): 1-3 and 6
    means = _stage_means({1, 2, 3, 6})
    per_mb = sum(means[(s, k)] for s in range(4) for k in ("F", "B"))
    p = pp4.predict({"pp": 1})
    line = next(m for m in p.modeled if m.startswith("pp 4 -> 1"))
    assert f"8 micro-batch(es) x {per_mb / 1e6:.1f} ms" in line  # nothing else changed: no scale
    assert f"{8 * per_mb / 1e6:.1f} ms" in line


def test_tokens_follow_the_replicas(pp4):
    # pp 4 x dp 1: one replica's 8 x 1,024 tokens over 4 GPUs; pp 1 x dp 4: four replicas'
    p = pp4.predict({"pp": 1})
    assert p.tokens_per_s_per_gpu * p.step_s == pytest.approx(4 * 8 * 1024 / 4, rel=1e-6)
    p2 = pp4.predict({"pp": 2})
    assert p2.tokens_per_s_per_gpu * p2.step_s == pytest.approx(2 * 8 * 1024 / 4, rel=1e-6)
    assert any("dp 1 -> 2" in m for m in p2.modeled) and any("2 stages" in m for m in p2.modeled)
    assert p2.fits


def test_pp_from_a_run_without_a_pipeline():
    m = W.Model.from_run(CAP_OVL)
    p = m.predict({"pp": 4, "ep": 1, "microbatches": 8})
    assert any(x.startswith("pp 1 -> 4: 4 stages") for x in p.modeled)
    assert any("no p2p" in x for x in p.modeled)  # the hand-off's bandwidth: the run's collective, said so
    assert p.fits and p.step_s > 0


def test_simulate_step_with_host_launches():
    """The host-aware schedule replay (`simulate_step(..., host=...)`), against hand-computed windows: 1f1b, pp 2,
    2 micro-batches. Device-bound (host 0) it is the plain replay; host-bound, each rank's host launches its actions
    back to back without waiting for their data, an action starts no earlier than its launch and ends no earlier
    than its last launch."""
    from tracelens.analysis.pipeline import simulate_step
    from tracelens.projection import pipeline_whatif as PW

    order = PW.schedule_actions("1f1b", 2, 1, 2)
    dev = PW._costs_for(order, [10, 10], [20, 20], [0, 0]).astype(np.int64)
    s0, e0, _ = simulate_step(order, dev, 0)
    s1, e1, _ = simulate_step(order, dev, 0, host=np.zeros(len(order), np.int64))
    assert (s0 == s1).all() and (e0 == e1).all() and e0.max() == 90  # F0 F1 | (F0 B0 F1 B1) | B0 B1
    # host 30 per action. Rank 1 (F0 B0 F1 B1): F0 after rank 0's F0 (30) ends at 40, B0 at max(40 + 20, its launch
    # 60) = 60, F1 after rank 0's F1 (60) ends at its launch 90, B1 at its launch 120. Rank 0 (F0 F1 B0 B1): F0 and
    # F1 end at their launches 30 and 60, B0 after rank 1's B0 (60) at max(80, 90) = 90, B1 after rank 1's B1 (120)
    # at 120 + 20 = 140
    host = np.full(len(order), 30, np.int64)
    _, e2, _ = simulate_step(order, dev, 0, host=host)
    assert sorted(e2.tolist()) == [30, 40, 60, 60, 90, 90, 120, 140]
    # the host never makes a step shorter, and a host-bound rank ends no earlier than its last launch
    assert (e2 >= e0).all() and e2.max() >= 4 * 30


def test_pp_pieces_from_the_changed_config_replay():
    """From a run without a pipeline, the pieces are the changed config's (the layout's unit edits reach them): pp 2 x
    ep 2 and pp 2 x ep 1 from the EP 4 baseline differ, and the modeled line gives their host launches and device
    work."""
    m = W.Model.from_run(FIX / "h100_4gpu_layouts" / "ep4_cap_mbs16")
    a = m.predict({"pp": 2, "ep": 2, "microbatches": 4, "micro_batch_size": 4})
    b = m.predict({"pp": 2, "ep": 1, "ep_dispatch": "nccl", "microbatches": 4, "micro_batch_size": 4})
    assert a.step_s != b.step_s
    line = next(x for x in a.modeled if x.startswith("pp 1 -> 2"))
    assert "ms of launches and" in line and "ms of device work" in line


@pytest.mark.parametrize("sets,needle", [({"pp": 3}, "world size 4"), ({"pp": 2, "ep": 4, "microbatches": 8}, "world size 4")])
def test_layouts_the_world_cannot_hold_are_one_line(sets, needle):
    m = W.Model.from_run(CAP_OVL) if "ep" in sets else W.Model.from_run(PP4)
    with pytest.raises(W.WhatIfError, match=needle) as e:
        m.predict(sets)
    assert "\n" not in str(e.value)


def test_cli_refuses_pp3_in_one_line():
    r = run_cli("whatif", PP4, "--set", "pp=3")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "world size 4" in lines[0]

"""benchmarks/bench_trainer_knobs.py: its loss comparison and table (the GPU runs themselves are the lead's;
``--cpu`` runs it end to end on the tiny config in about a minute, too slow for CI)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_trainer_knobs", REPO / "benchmarks" / "bench_trainer_knobs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_loss_diff_is_the_largest_relative_step_difference():
    b = _bench()
    assert b.loss_diff([10.0, 8.0, 4.0], [10.0, 8.4, 4.1]) == pytest.approx(0.05)  # 0.4 / 8 > 0.1 / 4
    assert b.loss_diff([10.0, 8.0], [10.0, 8.0, 7.0]) == 0.0  # the common steps
    assert b.loss_diff([10.0], [math.nan]) == math.inf
    assert b.loss_diff([], [1.0]) is None


def test_knob_rows_are_cumulative_and_trainer_keys():
    from moespec.config import load_config

    b = _bench()
    assert [n for n, _ in b.KNOBS] == ["baseline", "+ optimizer", "+ step_timing", "+ compile", "+ triton_kernels",
                                       "+ expert_swiglu", "+ micro_batch_24", "+ cuda_graphs"]
    acc = {}
    for _, knob in b.KNOBS:
        acc.update(knob)
    # the last row is a valid trainer config on a GPU machine (device checked at run time)
    cfg = load_config(b.GPU_BASE["config"], {**b.GPU_BASE["set"], **acc, "device": "auto"})
    assert (cfg["optimizer"], cfg["step_timing"], cfg["compile"], cfg["cuda_graphs"], cfg["micro_batch_size"],
            cfg["sync_free_level"], cfg["grouped_gemm_backend"], cfg["expert_swiglu"], cfg["use_triton_kernels"]) == \
        ("adamw_fused", "events", "dense", "on", 24, 3, "torch", "triton", True)


def test_table_shows_gain_loss_check_and_refusals():
    b = _bench()
    rows = [
        {"name": "baseline", "adds": {}, "tokens_per_s_per_gpu": 100.0, "mfu": 0.10, "step_ms": 10.0, "peak_gib": 1.0,
         "loss": [5.0], "run_dir": "r0", "rc": 0},
        {"name": "+ compile", "adds": {"compile": "dense"}, "tokens_per_s_per_gpu": 125.0, "mfu": 0.125,
         "step_ms": 8.0, "peak_gib": 1.1, "loss": [5.0], "run_dir": "r1", "rc": 0, "loss_rel_diff": 0.002,
         "loss_ok": True, "loss_check": {"ok": True, "agreed_steps": 12, "early_rel_diff": 0.002, "early_ok": True,
                                         "late_steps": 10, "late_mean": 4.9, "eager_late_mean": 5.0,
                                         "late_bound": 0.05, "late_ok": False, "finite": True}},
        {"name": "+ cuda_graphs", "adds": {"cuda_graphs": "on"}, "rc": 2, "run_dir": "r2",
         "error": "config error: cuda_graphs: on needs CUDA (device=cpu): CUDA graphs do not exist on a CPU"},
    ]
    md = b.table(rows, 0.01, "## t")
    assert ("| + compile | `compile=dense` | 125 | 12.5 % | 8.0 | +25.0 % | 1.10 | first 12 steps 2.00e-03 (ok); "
            "last 10 mean 4.900 vs 5.000 +/- 0.050 (OUT) | `r1` |") in md
    assert "| + cuda_graphs | `cuda_graphs=on` | refused (exit 2): config error: cuda_graphs: on needs CUDA" in md


def test_without_cuda_it_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = subprocess.run([sys.executable, "benchmarks/bench_trainer_knobs.py"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "no CUDA device visible" in r.stderr and "--cpu" in r.stderr


def _curve(n, drift_from, amp, seed):
    """A loss curve 11 - 0.01 step whose steps from ``drift_from`` on carry a deterministic wobble of size
    ``amp`` that differs by ``seed`` (the runs agree exactly before it)."""
    return [11.0 - 0.01 * i + (amp * math.sin(1.7 * i + seed) if i >= drift_from else 0.0) for i in range(n)]


def test_agreed_steps_stop_where_the_eager_runs_drift_apart():
    b = _bench()
    eager = [_curve(50, 13, 0.2, s) for s in (0, 1, 2)]
    assert b.agreed_steps(eager, 1e-2) == 13           # identical before step 13, 0.2 / 10.9 > 1e-3 at it
    assert b.agreed_steps(eager[:1], 1e-2) == 50       # one run: every step
    assert b.agreed_steps([[1.0, math.nan], [1.0, 1.0]], 1e-2) == 1


def test_judge_loss_numerics_on_agreed_steps_and_training_by_prediction_interval():
    b = _bench()
    eager = [_curve(50, 13, 0.2, s) for s in (0, 1, 2)]
    # a run that drifts like eager does after step 13: ok, though per step it is far from each eager run
    same = _curve(50, 13, 0.2, 3)
    j = b.judge_loss(eager, same, 1e-2)
    assert j["ok"] and j["agreed_steps"] == 13 and j["early_rel_diff"] < 1e-12
    assert b.loss_diff(eager[0], same) > 1e-2
    # the last-10 means of the eager runs and the interval, computed here from the curves
    means = [sum(e[-10:]) / 10 for e in eager]
    m = sum(means) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in means) / 2)
    assert j["eager_late_mean"] == pytest.approx(m)
    assert j["late_bound"] == pytest.approx(max(9.925 * sd * math.sqrt(1 + 1 / 3), 1e-2 * m))
    # 2 % off from step 1 on: the numerics part catches it
    off = [v * (1.02 if i else 1.0) for i, v in enumerate(same)]
    j = b.judge_loss(eager, off, 1e-2)
    assert not j["ok"] and not j["early_ok"] and j["early_rel_diff"] == pytest.approx(0.02, rel=1e-6)
    # right for the agreed steps, then trains away by 3 (a divergence): the training part catches it
    away = [v - (3.0 if i >= 30 else 0.0) for i, v in enumerate(same)]
    j = b.judge_loss(eager, away, 1e-2)
    assert j["early_ok"] and not j["late_ok"] and not j["ok"]
    # a non-finite loss fails
    assert not b.judge_loss(eager, same[:40] + [math.nan] * 10, 1e-2)["ok"]
    assert not b.judge_loss([], same, 1e-2)["ok"] and not b.judge_loss(eager, [], 1e-2)["ok"]


KNOB_ROWS = ("+ optimizer", "+ step_timing", "+ compile", "+ triton_kernels", "+ expert_swiglu", "+ cuda_graphs")


@pytest.mark.parametrize("which", ["first", "second"])
def test_judge_rows_on_the_h100_runs_passes_every_knob_and_eager_run_and_fails_the_control(which):
    """The stop-18 H100 loss checks (benchmarks/results/knobs_s18): three eager runs, every knob row and the
    control (learning rate x1.25), twice. The first ran before the control and the third eager run were rows
    of the script (they are separate manifests there); the second is the script's own output."""
    b = _bench()
    res = REPO / "benchmarks" / "results" / "knobs_s18"
    if which == "first":
        rows = json.loads((res / "check_loss.json").read_text())["rows"]
        rows.insert(2, {"name": "baseline (run 3)", "loss": json.loads((res / "eager3.json").read_text())["metrics"]["loss"]})
        rows.append({"name": "control: lr x1.25", "loss": json.loads((res / "lr125.json").read_text())["metrics"]["loss"]})
    else:
        rows = json.loads((res / "check_loss_v2" / "check_loss.json").read_text())["rows"]
    by = {r["name"]: r for r in rows}
    eager = [r["loss"] for r in rows if r["name"].startswith("baseline")]
    assert len(eager) == 3 and b.loss_diff(eager[0], eager[1]) > 1.5e-2  # per step, eager fails against itself
    b.judge_rows(rows, 1e-2)
    window = by["+ optimizer"]["loss_check"]["agreed_steps"]
    assert 10 <= window <= 20
    # the window, recomputed here: the leading steps on which all three eager runs lie within 1e-3 of their mean
    k = 0
    while k < 50 and (max(e[k] for e in eager) - min(e[k] for e in eager)) / (sum(e[k] for e in eager) / 3) <= 1e-3:
        k += 1
    assert window == k
    for r in rows:
        if r["name"].startswith("baseline") or r["name"] in KNOB_ROWS:
            assert r["loss_ok"] and r["loss_check"]["agreed_steps"] == window, r["name"]
            assert r["loss_rel_diff"] < 3e-3, r["name"]
    control = by["control: lr x1.25"]
    assert not control["loss_ok"] and not control["loss_check"]["early_ok"] and control["loss_rel_diff"] > 2e-2


def test_check_loss_needs_two_eager_runs():
    r = subprocess.run([sys.executable, "benchmarks/bench_trainer_knobs.py", "--check-loss", "--eager-runs", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "at least 2 with --check-loss" in r.stderr and "Traceback" not in r.stderr

"""benchmarks/bench_trainer_knobs.py: its loss comparison and table (the GPU runs themselves are the lead's;
``--cpu`` runs it end to end on the tiny config in about a minute, too slow for CI)."""

from __future__ import annotations

import importlib.util
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
    from trainer.config import load_config

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
         "loss_ok": True},
        {"name": "+ cuda_graphs", "adds": {"cuda_graphs": "on"}, "rc": 2, "run_dir": "r2",
         "error": "config error: cuda_graphs: on needs CUDA (device=cpu): CUDA graphs do not exist on a CPU"},
    ]
    md = b.table(rows, 0.01, "## t")
    assert "| + compile | `compile=dense` | 125 | 12.5 % | 8.0 | +25.0 % | 1.10 | 2.00e-03 (ok) | `r1` |" in md
    assert "| + cuda_graphs | `cuda_graphs=on` | refused (exit 2): config error: cuda_graphs: on needs CUDA" in md


def test_without_cuda_it_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = subprocess.run([sys.executable, "benchmarks/bench_trainer_knobs.py"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "no CUDA device visible" in r.stderr and "--cpu" in r.stderr

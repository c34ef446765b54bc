"""benchmarks/bench_swiglu.py on the CPU (Triton's interpreter, tiny shapes): the kernel part end to end, and
the trainer summary and table from given rows (the GPU runs themselves are the lead's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._benchmarks import load_benchmark

REPO = Path(__file__).resolve().parents[2]


def _bench():
    return load_benchmark("bench_swiglu")


def test_kernel_part_on_the_interpreter(needs_triton, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main sets it for --cpu; restored after the test
    b = _bench()
    assert b.main(["--cpu", "--no-trainer", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_swiglu.json").read_text())
    k = doc["kernel"]
    # tiny.yaml: micro_batch_size 4 x seq_len 64 x top_k 2 rows, moe_d_ff 32, fp32 on the CPU
    R, F = 4 * 64 * 2, 32
    assert (k["rows"], k["F"], k["dtype"]) == (R, F, "float32")
    assert max(k["err"].values()) < 1e-6
    # eager keeps h (the chunk views' storage) and silu(g); the fused path keeps h alone
    assert k["saved_bytes_eager"] == R * 2 * F * 4 + R * F * 4
    assert k["saved_bytes_fused"] == R * 2 * F * 4
    for key in ("eager_fwd_ms", "fused_fwd_ms", "eager_bwd_ms", "fused_bwd_ms"):
        assert k[key] > 0
    md = (tmp_path / "bench_swiglu.md").read_text()
    assert f"h = [{R:,}, 2 x {F}] float32" in md and "| fwd |" in md and "| bwd |" in md


def test_summary_gain_and_loss_check():
    b = _bench()
    rows = [
        {"name": "swiglu_torch_1", "expert_swiglu": "torch", "tokens_per_s_per_gpu": 100.0, "mfu": 0.20,
         "step_ms": 10.0, "peak_gib": 50.0, "loss": [10.0, 9.0], "run_dir": "a", "rc": 0},
        {"name": "swiglu_triton_1", "expert_swiglu": "triton", "tokens_per_s_per_gpu": 102.0, "mfu": 0.204,
         "step_ms": 9.8, "peak_gib": 48.5, "loss": [10.0, 9.09], "run_dir": "b", "rc": 0},
        {"name": "swiglu_torch_2", "expert_swiglu": "torch", "tokens_per_s_per_gpu": 98.0, "mfu": 0.196,
         "step_ms": 10.2, "peak_gib": 50.0, "loss": [10.0, 9.0], "run_dir": "c", "rc": 0},
        {"name": "swiglu_triton_2", "expert_swiglu": "triton", "rc": 1, "run_dir": "d", "error": "boom"},
        {"name": "swiglu_triton_kernels_1", "expert_swiglu": "triton+kernels", "tokens_per_s_per_gpu": 110.0,
         "mfu": 0.22, "step_ms": 9.0, "peak_gib": 47.0, "loss": [10.0, 8.82], "run_dir": "e", "rc": 0},
    ]
    s = b.summarize(rows)
    assert s["torch"]["runs"] == 2 and s["triton"]["runs"] == 1
    assert s["torch"]["tokens_per_s_per_gpu"] == pytest.approx(99.0)
    assert s["gain"] == pytest.approx(102.0 / 99.0 - 1)
    assert s["loss_rel_diff"] == pytest.approx(0.01)  # 0.09 / 9.0
    assert s["triton"]["peak_gib"] == 48.5
    md = b.report({"device": "H100", "kernel": {}, "trainer_rows": rows, "summary": s})
    assert "| swiglu_triton_1 | 102 | 20.4 % | 9.8 | 48.50 | `b` |" in md
    assert "| swiglu_triton_2 | failed: boom |" in md
    assert "+3.03 % tokens/s/GPU (99 -> 102)" in md
    assert s["gain_kernels"] == pytest.approx(110.0 / 99.0 - 1)
    assert s["loss_rel_diff_kernels"] == pytest.approx(0.02)  # 0.18 / 9.0, against the first torch run
    assert "use_triton_kernels=true vs torch: +11.11 % tokens/s/GPU (99 -> 110)" in md

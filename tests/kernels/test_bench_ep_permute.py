"""benchmarks/bench_ep_permute.py on the CPU (Triton's interpreter, small shapes): both capacity paths run, agree
bit for bit and drop the same rows; the timings themselves are the lead's (GPU)."""

from __future__ import annotations

import json
from pathlib import Path

from tests._benchmarks import load_benchmark

REPO = Path(__file__).resolve().parents[2]


def _bench():
    return load_benchmark("bench_ep_permute")


def test_both_paths_agree_on_the_interpreter(needs_triton, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what --cpu sets for its own process, taken back after the test
    out = tmp_path / "r.json"
    # 32 tokens x top-3 over 4 peers at capacity 0.8 still drop rows (asserted below); d_model 16 is one column
    # block: the interpreter runs each Triton program in Python (a fifth of the time of 96 tokens at d_model 32)
    assert _bench().main(["--cpu", "--tokens", "32", "--top-k", "3", "--experts", "8", "--ep", "4", "--d-model", "16",
                          "--factor", "0.8", "--iters", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    c = r["check"]
    assert c["y_equal"] and c["x_grad_equal"] and c["w_grad_max_diff"] < 1e-6
    assert c["dropped"] == c["dropped_fused"] > 0  # capacity 0.8 drops
    for name in ("forward", "forward+backward"):
        assert r[name]["unfused_ms"] > 0 and r[name]["fused_ms"] > 0
    assert "forward+backward" in capsys.readouterr().out


def test_without_a_gpu_one_line_exit_2(capsys):
    import torch

    if torch.cuda.is_available():
        return
    assert _bench().main(["--iters", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a CUDA GPU" in err

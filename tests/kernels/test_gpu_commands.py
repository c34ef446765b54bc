"""`tracelens kernels tune`, `tracelens calibrate` and benchmarks/bench_kernels.py, on the CPU.

No GPU here: `kernels tune` runs on tiny shapes under Triton's interpreter (this package's conftest
turns it on), `calibrate` must refuse without `--cpu` and measure the CPU with it, and the
benchmark runs its `--smoke` mode.  Expected numbers come from the rows and files the commands
write, recomputed here, and from the trainer config's values typed in by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kernels import backends as B
from tracelens import devices
from tracelens.cli import main

from tests.conftest import MOE_GROUPED

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh(needs_triton):
    B.clear_cache()
    yield
    B.clear_cache()


def _run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _one_line_error(res, needle: str) -> None:
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tracelens: error: ") and needle in lines[0], res.output


def test_tune_times_every_backend_per_pass_and_caches_the_fastest(tmp_path):
    out = tmp_path / "tune.json"
    res = _run("kernels", "tune", "--shapes", "40,16,24,4", "--dtype", "fp32", "--json", str(out))
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["rows"]
    assert {(r["pass"], r["backend"]) for r in rows} == {(p, b) for p in ("fwd", "dx", "dw") for b in ("triton", "loop")}
    cache = json.loads(B.cache_path().read_text())["entries"]
    for p in ("fwd", "dx", "dw"):
        prow = [r for r in rows if r["pass"] == p]
        assert all(r["error"] is None and r["ms"] > 0 for r in prow)
        assert all((r["T"], r["K"], r["N"], r["E"], r["dtype"], r["device"]) == (40, 16, 24, 4, "float32", "cpu")
                   for r in prow)
        fastest = min(prow, key=lambda r: r["ms"])["backend"]
        assert [r["backend"] for r in prow if r["winner"]] == [fastest]
        for r in prow:  # 2 T K N FLOPs per product
            assert r["tflops"] == pytest.approx(2 * 40 * 16 * 24 / (r["ms"] * 1e-3) / 1e12, rel=1e-9)
        # rows bucket to the next power of two: 40 -> 64
        assert cache[f"cpu|float32|T64|K16|N24|E4|{p}"]["backend"] == fastest
        assert f"{p:<4} {40:>7} {16:>6} {24:>6} {4:>4}  {fastest:<12}" in res.output
    assert f"cached in {B.cache_path()}" in res.output


def test_tune_takes_the_expert_gemms_of_a_trainer_config():
    res = _run("kernels", "tune", "--config", "tiny", "--set", "micro_batch_size=1", "--set", "seq_len=8",
               "--passes", "fwd", "--no-save", "--backends", "loop")
    assert res.exit_code == 0, res.output
    # tiny.yaml: d_model 64, moe_d_ff 32, 8 experts, top-2; 1 x 8 tokens -> 16 (token, slot) rows, fp32
    assert "dtype float32" in res.output
    assert f"fwd  {16:>7} {64:>6} {64:>6} {8:>4}  loop" in res.output  # up-projection: 64 -> 2 x 32
    assert f"fwd  {16:>7} {32:>6} {64:>6} {8:>4}  loop" in res.output  # down-projection: 32 -> 64
    assert not B.cache_path().exists()


@pytest.mark.parametrize("args, needle", [
    (["--shapes", "1,2,3"], "expected T,K,N,E"),
    (["--shapes", "8,8,8,0"], "expected T,K,N,E"),
    (["--shapes", "8,8,8,2", "--config", "tiny"], "not both"),
    (["--set", "ep=2"], "--set needs --config"),
    (["--config", "no_such_config.yaml"], "file not found"),
    (["--config", "tiny", "--set", "top_k=99"], "top_k"),
    (["--shapes", "8,8,8,2", "--backends", "cublas9"], "unknown backend"),
])
def test_tune_bad_input_is_one_line_exit_2(args, needle):
    _one_line_error(_run("kernels", "tune", *args), needle)


def test_calibrate_without_a_gpu_says_so_in_one_line():
    _one_line_error(_run("calibrate"), "no GPU present")


def test_calibrate_cpu_writes_ceilings_that_roofline_and_analyze_accept(tmp_path):
    ceil = tmp_path / "cpu.json"
    res = _run("calibrate", "--cpu", "--size", "128", "--mem-mib", "8", "--reps", "2", "-o", str(ceil))
    assert res.exit_code == 0, res.output
    doc = json.loads(ceil.read_text())
    assert set(doc) == {"device", "bf16_tflops", "fp32_tflops", "hbm_tbps", "source"}
    assert doc["device"].startswith("CPU: ") and "on the CPU" in doc["source"] and "not a GPU" in doc["source"]
    assert all(doc[k] > 0 for k in ("bf16_tflops", "fp32_tflops", "hbm_tbps"))
    assert "CPU figures" in res.output
    devices.load_measured(ceil)
    # the roofline of an H200 trace with these ceilings: the measured fields replace the datasheet's
    out = tmp_path / "roof.json"
    r = _run("roofline", str(MOE_GROUPED), "--ceilings", str(ceil), "--json", str(out), "--no-cache")
    assert r.exit_code == 0, r.output
    dev = json.loads(out.read_text())["summary"]["devices"]["NVIDIA H200"]
    assert dev["bf16_tflops"] == doc["bf16_tflops"] and dev["hbm_tbps"] == doc["hbm_tbps"]
    assert sorted(dev["measured"]) == ["bf16_tflops", "fp32_tflops", "hbm_tbps"]


def test_gpu_ceilings_document_is_accepted_by_roofline_and_analyze(tmp_path):
    """The document a GPU run writes (built from a measurement record, as on an H200)."""
    from kernels.calibrate import ceilings_json

    m = {"device": "NVIDIA H200", "kind": "gpu", "sm_count": 132, "torch": "2.11", "when": "2026-11-23T00:00:00Z",
         "tflops": {"bf16": 761.04, "fp16": 770.2, "tf32": 402.0, "fp32": 51.3},
         "memory": {"copy_tbps": 4.31, "read_tbps": 4.02},
         "settings": {"n": 8192, "mem_bytes": 2 << 30, "warmup": 3, "reps": 10}}
    doc = ceilings_json(m)
    assert doc == {"device": "NVIDIA H200", "bf16_tflops": 761.04, "fp16_tflops": 770.2, "tf32_tflops": 402.0,
                   "fp32_tflops": 51.3, "hbm_tbps": 4.31, "sm_count": 132, "source": doc["source"]}
    assert doc["source"].startswith("measured on the GPU by tracelens calibrate")
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(doc))
    run = tmp_path / "report"
    r = _run("analyze", str(MOE_GROUPED), "-o", str(run), "--ceilings", str(path), "--no-cache", "--no-tables", "-q")
    assert r.exit_code == 0, r.output
    summary = json.loads((run / "summary.json").read_text())
    dev = summary["roofline"]["devices"]["NVIDIA H200"]
    assert (dev["bf16_tflops"], dev["tf32_tflops"], dev["hbm_tbps"], dev["sm_count"]) == (761.04, 402.0, 4.31, 132)
    assert dev["fp8_tflops"] == devices.DEVICES["H200 SXM"].fp8_tflops  # not measured: datasheet stays
    assert (run / "report.html").stat().st_size > 0
    # a bad file is one line, exit 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device": "NVIDIA H200", "bf16_tflopz": 1.0}))
    _one_line_error(_run("analyze", str(MOE_GROUPED), "-o", str(run), "--ceilings", str(bad), "--no-cache"),
                    "unknown measured-ceiling keys")


_NO_TORCH = ("import sys\n"
             "class Block:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('torch', 'triton'):\n"
             "            raise ImportError(f'No module named {name!r} (blocked)')\n"
             "sys.meta_path.insert(0, Block())\n"
             "sys.argv = ['tracelens'] + sys.argv[1:]\n"
             "from tracelens.cli import main\n"
             "main()\n")


@pytest.mark.parametrize("cmd, env, needle", [
    (["calibrate", "--cpu"], {}, "calibrate needs torch"),
    (["kernels", "tune"], {}, "kernels tune needs torch"),
    (["kernels", "tune", "--shapes", "16,8,8,2"], {"TRITON_INTERPRET": "0"}, "no GPU present"),
])
def test_commands_without_torch_or_interpreter_fail_in_one_line(cmd, env, needle):
    import os

    code = _NO_TORCH if "torch" in needle else "import sys\nsys.argv = ['tracelens'] + sys.argv[1:]\n" \
                                              "from tracelens.cli import main\nmain()\n"
    r = subprocess.run([sys.executable, "-c", code, *cmd], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
    assert len(lines) == 1 and lines[0].startswith("tracelens: error: ") and needle in lines[0], r.stderr


def test_bench_smoke_writes_json_and_markdown(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/bench_kernels.py", "--smoke", "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads((tmp_path / "bench_kernels.json").read_text())
    md = (tmp_path / "bench_kernels.md").read_text()
    assert doc["smoke"] is True and doc["env"]["device"] == "cpu" and doc["ceiling_tflops"] > 0
    rows = doc["grouped_mm"]
    # smoke shape: hidden 32, ffn 16, 4 experts, top-2, 16 tokens -> 32 rows; up 32 -> 32, down 16 -> 32
    got = {(r["gemm"], r["K"], r["N"], r["backend"], r["pass"]) for r in rows}
    want = {(g, K, N, b, p) for g, K, N in (("up", 32, 32), ("down", 16, 32)) for b in ("triton", "loop")
            for p in ("fwd", "dx", "dw", "bwd")}
    assert got == want
    by = {(r["gemm"], r["backend"], r["pass"]): r for r in rows}
    for (gemm, backend, p), r in by.items():
        assert r["rows"] == 32 and r["E"] == 4 and r["tokens"] == 16 and r["vs_torch"] is None  # no torch backend on CPU
        if p == "bwd":  # bwd = dx + dw, with twice the FLOPs
            assert r["ms"] == pytest.approx(by[(gemm, backend, "dx")]["ms"] + by[(gemm, backend, "dw")]["ms"], abs=2e-4)
        flops = 2 * r["rows"] * r["K"] * r["N"] * (2 if p == "bwd" else 1)
        # ms is rounded to 4 decimals (relative error up to 5e-5 / ms) and the percentage to 1 decimal
        # (0.05): the two errors add up
        want = 100 * flops / (r["ms"] * 1e-3) / 1e12 / doc["ceiling_tflops"]
        assert abs(r["pct_ceiling"] - want) <= 0.051 + want * 6e-5 / r["ms"], (r, want)
    ce = {r["impl"]: r for r in doc["cross_entropy"]}
    assert set(ce) == {"fused", "unfused"} and all(r["vocab"] == 100 and r["ms_fwd_bwd"] > 0 for r in ce.values())
    assert "## Grouped GEMM" in md and "## Linear + cross-entropy" in md
    assert md.count("| smoke | up | 16 | 32 | 32 | 32 | 4 |") == 8  # 2 backends x 4 passes

"""Op replay: scripts generated from the real fixtures run on the CPU (torch in the venv) and rebuild exactly
the shapes, dtypes and strides the raw trace JSON records; ops that cannot be replayed say why."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import tracelens
from tracelens import replay as R
from tracelens.cli import main

FIX = Path(__file__).resolve().parents[1] / "fixtures"
MOE = FIX / "h200_moe_1gpu" / "moe1gpu_grouped.json.gz"
NCCL = FIX / "h200_nccl_2rank"
MI250 = FIX / "external" / "hta" / "mi250_minitoy_train_ROCm6_2_kineto.json.gz"
# Kineto type strings -> the torch dtype names the script prints (written out here, not taken from replay.py)
KINETO = {"c10::BFloat16": "bfloat16", "float": "float32", "c10::Half": "float16", "long int": "int64",
          "int": "int32", "bool": "bool"}


def _raw_calls(path: Path, name: str) -> list[dict]:
    """The op's cpu_op events in the raw JSON, in time order."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    ev = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op" and e.get("name") == name]
    return sorted(ev, key=lambda e: float(e["ts"]))


_RUNNER = """
import runpy, sys
for path in sys.argv[1:]:
    sys.argv = [path, "--iters", "1", "--warmup", "0", "--cpu"]
    print("@@", path, flush=True)
    print("@@", path, file=sys.stderr, flush=True)
    runpy.run_path(path, run_name="__main__")
"""


def _run_many(scripts: list[Path]) -> list[dict]:
    """Run generated scripts as __main__ in one interpreter (torch is imported once): one JSON line each."""
    p = subprocess.run([sys.executable, "-c", _RUNNER, *map(str, scripts)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    outs = [blk.strip().splitlines() for blk in p.stdout.split("@@ ")[1:]]
    errs = [blk for blk in p.stderr.split("@@ ")[1:]]
    assert len(outs) == len(scripts)
    res = []
    for out, err in zip(outs, errs):
        assert "on cpu" in err  # says which device it fell back to
        lines = out[1:]
        assert len(lines) == 1, out
        res.append(json.loads(lines[0]))
    return res


def eval_prod(dims) -> int:
    n = 1
    for d in dims:
        n *= d if isinstance(d, int) else 1
    return n


def _check_against_raw(out: dict, raw: dict) -> None:
    args = raw["args"]
    dims, types, strides = args["Input Dims"], args["Input type"], args["Input Strides"]
    assert len(out["shapes"]) == len(dims)
    n_tensors = 0
    for i, t in enumerate(types):
        if t in KINETO:
            n_tensors += 1
            assert out["shapes"][i] == dims[i], (i, out["shapes"][i], dims[i])
            assert out["dtypes"][i] == KINETO[t]
            assert out["strides"][i] == strides[i]
        else:
            assert out["shapes"][i] is None
    assert n_tensors >= 1 and out["device"] == "cpu" and out["measured_us"] > 0


@pytest.fixture(scope="module")
def moe_trace():
    return tracelens.load(str(MOE), cache=False)


def test_moe_scripts_rebuild_trace_shapes(moe_trace, tmp_path):
    pytest.importorskip("torch", reason="the generated scripts need torch")
    cands = R.candidates(moe_trace)
    # one op of each family: GEMM, grouped GEMM, SDPA, elementwise, norm
    ops = ("aten::mm", "aten::_grouped_mm", "aten::scaled_dot_product_attention", "aten::mul", "aten::layer_norm")
    calls, scripts = [], []
    for op in ops:
        rows = cands[(cands["op"] == op) & cands["replayable"]]
        size = [sum(abs(eval_prod(d)) for d in json.loads(x) if isinstance(d, list)) for x in rows["input_dims"]]
        row = rows.iloc[size.index(min(size))]  # the smallest signature: CPU time stays short
        call = R.find_call(moe_trace, op, int(row["index"]))
        assert call.replayable and call.clock == "gpu" and call.trace_us > 0
        calls.append(call)
        scripts.append(R.write_script(call, tmp_path / R.script_name(call)))
    for op, call, out in zip(ops, calls, _run_many(scripts)):
        raw = _raw_calls(MOE, op)[call.index]
        _check_against_raw(out, raw)
        assert out["op"] == op and out["trace_us"] == pytest.approx(call.trace_us, abs=1e-3)
        # the overload whose schema matches the recorded arguments, also where a None stands for an optional
        # tensor (grouped mm's bias, SDPA's attn_mask, layer_norm's weight/bias when absent), not the bare packet
        assert out["overload"], (op, out)
        if op == "aten::_grouped_mm":
            assert any("offsets" in n for n in out["notes"])


def test_moe_unsupported_have_reasons(moe_trace):
    cands = R.candidates(moe_trace)
    why = {r.op: r.reason for r in cands.itertuples(index=False) if not r.replayable}
    assert "attention backward" in why["aten::_cudnn_attention_backward"]
    assert "data-dependent" in why["aten::_index_put_impl_"]
    assert "not in the replayable families" in why["aten::sort"]
    assert all(isinstance(v, str) and v for v in why.values())
    # every op that owns GPU time appears once per signature, biggest first
    assert list(cands["trace_us"]) == sorted(cands["trace_us"], reverse=True)


def test_trace_time_is_inclusive_gpu_time(moe_trace):
    # aten::linear's GPU time = the kernels launched inside it (its addmm): check against the raw JSON by
    # linking kernels to runtime calls inside the op's time range on the same thread
    with gzip.open(MOE, "rt") as f:
        events = json.load(f)["traceEvents"]
    op = _raw_calls(MOE, "aten::linear")[0]
    t0, t1 = float(op["ts"]), float(op["ts"]) + float(op["dur"])
    corr = {e["args"]["correlation"] for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("tid") == op["tid"] and t0 <= float(e["ts"]) <= t1
            and "correlation" in e.get("args", {})}
    gpu_us = sum(float(e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                 and e.get("args", {}).get("correlation") in corr)
    call = R.find_call(moe_trace, "aten::linear", 0)
    assert gpu_us > 0 and call.trace_us == pytest.approx(gpu_us, rel=1e-6, abs=1e-3)


def test_nccl_and_external(tmp_path):
    pytest.importorskip("torch", reason="the generated scripts need torch")
    tr = tracelens.load(str(NCCL), cache=False)
    cands = R.candidates(tr)
    comm = cands[cands["op"] == "record_param_comms"]
    assert len(comm) and all("collective" in r for r in comm["reason"])
    scripts = [R.write_script(R.find_call(tr, "aten::relu_", 0), tmp_path / "relu.py")]
    raws = [_raw_calls(NCCL / "rank0.json.gz", "aten::relu_")[0]]
    # an external trace (AMD MI250, ROCm): a GEMM-family op and a loss
    ext = tracelens.load(str(MI250), cache=False)
    for op in ("aten::linear", "aten::mse_loss"):
        call = R.find_call(ext, op, 0)
        scripts.append(R.write_script(call, tmp_path / R.script_name(call)))
        raws.append(_raw_calls(MI250, op)[0])
    for out, raw in zip(_run_many(scripts), raws):
        _check_against_raw(out, raw)


def test_cli(tmp_path):
    r = CliRunner()
    res = r.invoke(main, ["replay", str(MOE), "--top", "12", "-o", str(tmp_path / "rp"), "--no-cache"])
    assert res.exit_code == 0, res.output
    assert "cannot replay: attention backward" in res.output
    written = sorted(p.name for p in (tmp_path / "rp").glob("*.py"))
    assert any(n.startswith("replay_grouped_mm_") for n in written)
    for args, msg in (([str(NCCL), "--op", "record_param_comms"], "collective"),
                      ([str(MOE), "--op", "aten::nonexistent"], "no op named"),
                      ([str(MOE), "--op", "aten::mm", "--index", "999"], "out of range"),
                      ([str(MOE)], "exactly one of")):
        res = r.invoke(main, ["replay", *args, "-o", str(tmp_path / "x"), "--no-cache"])
        assert res.exit_code == 2, (args, res.output)
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and msg in lines[0], res.output


def test_replay_module_does_not_import_torch():
    code = "import sys, tracelens.replay, tracelens.analysis.memory; print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "False"

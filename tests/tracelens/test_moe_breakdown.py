"""benchmarks/moe_breakdown.py on the real H100 proxy trace (tests/fixtures/h100_proxy_loop_mbs8): the forward
MoE stage totals and the forward SwiGLU subtotal against the raw Kineto JSON, read here without tracelens."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

import pytest

from tests._benchmarks import load_benchmark

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "tests" / "fixtures" / "h100_proxy_loop_mbs8"


def _script():
    return load_benchmark("moe_breakdown")


def _raw_forward(step: int) -> tuple[dict, float]:
    """(ms per moe/<stage> of the GPU work launched inside that stage's CPU range, ms of those in moe/experts
    whose innermost enclosing CPU op is aten::silu or aten::mul), over ProfilerStep#<step>."""
    with gzip.open(RUN / "traces" / "rank0.json.gz", "rt") as f:
        ev = json.load(f)["traceEvents"]
    (ps,) = [e for e in ev if e.get("cat") == "user_annotation" and e["name"] == f"ProfilerStep#{step}"]
    lo, hi = ps["ts"], ps["ts"] + ps["dur"]
    calls = {e["args"]["correlation"]: e for e in ev
             if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ranges = defaultdict(list)  # tid -> [(ts, end, name)] of moe/ annotations
    ops = defaultdict(list)  # tid -> [(ts, end, name)] of CPU ops
    for e in ev:
        if e.get("cat") == "user_annotation" and e["name"].startswith("moe/"):
            ranges[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif e.get("cat") == "cpu_op":
            ops[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    stage_ms: dict = defaultdict(float)
    swiglu = 0.0
    for e in ev:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        call = calls.get(e.get("args", {}).get("correlation"))
        if call is None or not lo <= call["ts"] < hi:
            continue
        t, tid = call["ts"], call["tid"]
        inside = [r for r in ranges[tid] if r[0] <= t < r[1]]
        if not inside:
            continue
        stage = min(inside, key=lambda r: r[0])[2]  # the outermost moe/ range (no nesting at ep=1)
        stage_ms[stage] += e["dur"] / 1e3
        enclosing = [o for o in ops[tid] if o[0] <= t < o[1]]
        if stage == "moe/experts" and enclosing:
            innermost = max(enclosing, key=lambda o: (o[0], -o[1]))
            if innermost[2] in ("aten::silu", "aten::mul"):
                swiglu += e["dur"] / 1e3
    return dict(stage_ms), swiglu


def test_forward_stages_and_swiglu_match_the_raw_trace():
    b = _script().breakdown(RUN)
    want, want_swiglu = _raw_forward(b["step"])
    assert set(want) == {"moe/router", "moe/permute", "moe/experts", "moe/unpermute"}
    for stage, ms in want.items():
        assert b["stages"][f"{stage} fwd"] == pytest.approx(ms, abs=2e-3), stage
    assert want_swiglu > 0
    assert b["swiglu"]["fwd"] == pytest.approx(want_swiglu, abs=2e-3)


def test_cli_prints_the_subtotals_and_refuses_a_non_run(tmp_path, capsys):
    mod = _script()
    out_json = tmp_path / "b.json"
    assert mod.main([str(RUN), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "expert SwiGLU: fwd" in text and "permute + unpermute:" in text and "LM head + loss" in text
    doc = json.loads(out_json.read_text())
    assert doc["swiglu"]["bwd"] > 0 and doc["permutation"]["bwd"] > 0 and doc["loss"]["ms"] > 0
    assert mod.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe_breakdown: ") and "manifest.json" in err[0]

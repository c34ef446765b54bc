"""The loss_fusion what-if mechanism (tracelens/projection/mechanisms/loss_fusion.py).

Truth from the raw trace JSON of the H100 proxy run (micro-batch 8 x 2048 tokens, vocabulary 102400, the
chunked loss with 8 chunks), from the measured fused/unfused loss memory of benchmarks/results, and from
synthetic steps whose answer is known by hand."""

from __future__ import annotations

import bisect
import functools
import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tracelens.projection import profile as P
from tracelens.projection import replay as R
from tracelens.projection import whatif as W
from tracelens.projection.mechanisms import BY_NAME, base

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "tests" / "fixtures" / "h100_proxy_loop_mbs8"
LF = BY_NAME["loss_fusion"]


@pytest.fixture(scope="module")
def model():
    return W.Model.from_run(RUN)


@functools.lru_cache(maxsize=None)
def _raw_kernels(step: int) -> list[dict]:
    """Rank 0's kernels launched inside ProfilerStep#<step>, in launch order, each with the CPU op that
    launched it (name and Input Dims): from the raw JSON by correlation id and time containment."""
    with gzip.open(RUN / "traces" / "rank0.json.gz", "rt") as f:
        ev = json.load(f)["traceEvents"]
    (ps,) = [e for e in ev if e.get("cat") == "user_annotation" and e["name"] == f"ProfilerStep#{step}"]
    lo, hi = ps["ts"], ps["ts"] + ps["dur"]
    kern = {e["args"]["correlation"]: e for e in ev if e.get("cat") == "kernel" and "correlation" in e.get("args", {})}
    calls = sorted((e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and lo <= e["ts"] < hi
                    and e.get("args", {}).get("correlation") in kern), key=lambda e: e["ts"])
    by_tid: dict = {}
    for e in sorted((e for e in ev if e.get("cat") == "cpu_op" and lo <= e["ts"] < hi), key=lambda e: e["ts"]):
        by_tid.setdefault(e["tid"], []).append(e)
    starts = {t: [o["ts"] for o in v] for t, v in by_tid.items()}
    out = []
    for c in calls:
        ops = by_tid.get(c["tid"], [])
        # an op enclosing the call started at or before it: only those, scanned back from the call's time
        inner = [o for o in ops[:bisect.bisect_right(starts.get(c["tid"], []), c["ts"])] if c["ts"] < o["ts"] + o["dur"]]
        op = min(inner, key=lambda o: o["dur"]) if inner else {"name": "", "args": {}}
        k = kern[c["args"]["correlation"]]
        out.append({"kernel": k["name"], "ns": k["dur"] * 1000, "op": op["name"],
                    "dims": json.dumps(op["args"].get("Input Dims"))})
    return out


def _device_ns(plan) -> float:
    return float(sum(plan.dur[j] for kd, j in zip(plan.kind, plan.ref) if kd == 0))


def test_unfusing_the_chunked_loss_against_the_raw_trace(model):
    """fused -> unfused: the 8 recomputed log-softmax forwards (in launch order the last 8 of the 16
    SoftMaxForward kernels: the forward's 8 run before the backward starts) and the 7 weight-gradient adds
    ([V, D] bf16 adds) leave; the 8 forward ones become one unit of their summed time."""
    p = model.profiles[0]
    raw = _raw_kernels(p.step)
    sm = [k["ns"] for k in raw if "cunn_SoftMaxForward" in k["kernel"]]
    assert len(sm) == 16
    fwd_sm, rec_sm = sm[:8], sm[8:]
    adds = [k["ns"] for k in raw if k["op"] in ("aten::add", "aten::add_")
            and k["dims"] == json.dumps([[102400, 2048], [102400, 2048], []])]
    assert len(fwd_sm) == len(rec_sm) == 8 and len(adds) == 7  # the raw facts: 8 chunks, checkpointed

    cfg = model.config
    plan = R.Plan.of(R.prepare(p), profiler_lead=False)
    d0 = _device_ns(plan)
    ch = base.Change(model, cfg, {**cfg, "loss_fusion": False}, {**cfg, "loss_fusion": False}, {"loss_fusion": False})
    assert LF.applies(ch)
    var = LF.edit(plan, p, ch)
    w = p.work
    live = [j for kd, j in zip(plan.kind, plan.ref) if kd == 0 and j < len(w)]
    sm = [j for j in live if w["op"].iat[j] == "aten::_log_softmax"]
    assert len(sm) == 1 and plan.dur[sm[0]] == pytest.approx(sum(fwd_sm), abs=8 * 1_000)  # µs-rounded raw JSON
    assert not any(w["op"].iat[j] in ("aten::add", "aten::add_") and "102400" in str(w["dims"].iat[j]) for j in live)
    removed = d0 - _device_ns(plan)
    assert removed >= sum(rec_sm) + sum(adds)  # and the recomputed logits GEMMs and casts with them
    assert removed < 0.35 * sum(k["ns"] for k in raw if "102400" in k["dims"])  # never more than the recomputation
    assert var > 0 and "loss_fusion true -> false" in ch.modeled[0]


def test_unfused_prediction_is_faster_and_holds_the_fp32_logits(model):
    p0 = model.predict({})
    p = model.predict({"loss_fusion": False})
    assert p.step_s < p0.step_s and p.tokens_per_s_per_gpu > p0.tokens_per_s_per_gpu
    assert sum(p.components.values()) == pytest.approx(p.step_s, rel=1e-9)
    assert p.uncertainty > p0.uncertainty
    # memory: at least the fp32 log-probabilities of 16384 x 102400 (6.25 GiB) more, and no more than the
    # unfused loss's whole extra peak measured at 16384 tokens (benchmarks/results/bench_kernels_h100.json)
    rows = json.loads((REPO / "benchmarks" / "results" / "bench_kernels_h100.json").read_text())["cross_entropy"]
    (meas,) = [r["peak_extra_gib"] for r in rows if r["tokens"] == 16384 and r["impl"] == "unfused"]
    grew = p.peak_gib - p0.peak_gib
    assert 4 * 16384 * 102400 / 2**30 <= grew <= 1.05 * meas
    assert p.changes == {"loss_fusion": False}


def test_modeled_accumulation_adds_match_the_measured_ones(model):
    """A smaller chunk on the fused run: more chunks, more weight-gradient adds; the add modeled by bytes at
    the measured cast's bandwidth lasts what the run's measured adds last (within 5 %)."""
    raw = _raw_kernels(model.profiles[0].step)
    adds = [k["ns"] for k in raw if k["op"] in ("aten::add", "aten::add_")
            and k["dims"] == json.dumps([[102400, 2048], [102400, 2048], []])]
    p = model.predict({"loss_chunk_size": 1024})
    (line,) = [x for x in p.modeled if x.startswith("loss_chunk_size 2048 -> 1024")]
    each_ms = float(line.split("weight-gradient adds of ")[1].split(" ms")[0])
    assert each_ms * 1e6 == pytest.approx(float(np.mean(adds)), rel=0.05)
    assert "16 chunk(s) of 1024 tokens" in line and p.step_s > model.base_step_s


def _profile(rows: list[tuple], device: str = "gpu") -> P.StepProfile:
    """A step from (op, name, dims, ns, backward, layer) units, launched 20 µs apart on one stream."""
    n = len(rows)
    t = [20_000 * (i + 1) for i in range(n)]
    start, s = [], 0
    for ti, r in zip(t, rows):
        s = max(s, ti + 5_000)
        start.append(s)
        s += r[3]
    work = pd.DataFrame({
        "launch": t, "start": start, "dur": [r[3] for r in rows], "stream": [7] * n, "name": [r[1] for r in rows],
        "op": [r[0] for r in rows], "path": [""] * n, "dims": [r[2] for r in rows], "component": ["other"] * n,
        "scale": ["tokens"] * n, "expert": [False] * n, "moe_stage": [""] * n, "layer": [r[5] for r in rows],
        "backward": [r[4] for r in rows], "recompute": [False] * n, "is_comm": [False] * n, "linked": [True] * n})
    syncs = pd.DataFrame({"ts": pd.Series([], dtype="int64"), "end": pd.Series([], dtype="int64"),
                          "moe": pd.Series([], dtype=bool), "path": pd.Series([], dtype=object)})
    return P.StepProfile(0, 1, device, 0, start[-1] + rows[-1][3] + 10_000, work, syncs, 4096)


T, V, D = 4096, 1000, 64
UNFUSED = [  # (op, kernel, dims, ns, backward, layer)
    ("aten::mm", "layer_gemm", "[[4096, 64], [64, 64]]", 100_000, False, 0),
    ("aten::mm", "head_gemm", f"[[{T}, {D}], [{D}, {V}]]", 400_000, False, -1),
    ("aten::copy_", "cast_f32", f"[[{T}, {V}], [{T}, {V}], []]", 120_000, False, -1),
    ("aten::_log_softmax", "softmax_fwd", f"[[{T}, {V}], [], []]", 200_000, False, -1),
    ("aten::nll_loss_forward", "nll_fwd", f"[[{T}, {V}], [{T}], [], [], []]", 10_000, False, -1),
    ("aten::fill_", "fill", f"[[{T}, {V}], []]", 50_000, True, -1),
    ("aten::nll_loss_backward", "nll_bwd", f"[[], [{T}, {V}], [{T}], [], [], [], []]", 10_000, True, -1),
    ("aten::_log_softmax_backward_data", "softmax_bwd", f"[[{T}, {V}], [{T}, {V}], [], []]", 200_000, True, -1),
    ("aten::copy_", "cast_bf16", f"[[{T}, {V}], [{T}, {V}], []]", 80_000, True, -1),
    ("aten::mm", "head_dw", f"[[{V}, {T}], [{T}, {D}]]", 300_000, True, -1),
    ("aten::mm", "head_dx", f"[[{T}, {V}], [{V}, {D}]]", 300_000, True, -1),
    ("aten::mm", "layer_gemm_bwd", "[[4096, 64], [64, 64]]", 200_000, True, 0),
]
CFG = {"vocab_size": V, "d_model": D, "micro_batch_size": 1, "seq_len": T, "loss_fusion": False, "loss_chunk_size": 1024,
       "use_triton_kernels": False}


def _change(old: dict, new: dict) -> base.Change:
    return base.Change(None, old, new, new, {k: v for k, v in new.items() if old.get(k) != v})


def test_unfused_to_fused_by_hand():
    """T = 4096 tokens in chunks of 1024: every loss op runs 4 times at 1/4 of its work, the forward loss
    (730 µs) runs again where the loss backward starts, and 3 weight-gradient adds of the bf16 cast's time
    x D / T (80 µs x 64 / 4096 = 1.25 µs) follow the loss backward; the layers are untouched."""
    p = _profile(UNFUSED)
    plan = R.Plan.of(R.prepare(p), profiler_lead=False)
    d0, n0 = _device_ns(plan), len(plan.kind)
    ch = _change(CFG, {**CFG, "loss_fusion": True})
    LF.edit(plan, p, ch)
    fwd_loss = 400_000 + 120_000 + 200_000 + 10_000
    assert _device_ns(plan) - d0 == pytest.approx(fwd_loss + 3 * 80_000 * D / T)
    assert len(plan.kind) - n0 == 10 * 3 + 4 * 4 + 3  # chunk launches, recomputation, adds
    durs = [plan.dur[j] for j in plan.ref]
    assert durs[0] == 100_000 and durs[-1] == 200_000  # the layers' units, first and last, unchanged
    first_bwd = next(i for i, j in enumerate(plan.ref) if j < len(p.work) and p.work["backward"].iat[j]
                     and p.work["layer"].iat[j] < 0)
    assert durs[first_bwd - 16:first_bwd] == [x / 4 for x in (400_000, 120_000, 200_000, 10_000)] * 4
    assert durs[first_bwd - 19:first_bwd - 16] == [10_000 / 4] * 3  # the last forward op's chunk launches
    assert "4 chunk(s) of 1024 tokens" in ch.modeled[0] and "3 weight-gradient adds" in ch.modeled[0]
    assert LF.applies(_change({**CFG, "loss_fusion": True}, {**CFG, "loss_fusion": True, "loss_chunk_size": 512}))
    assert not LF.applies(_change(CFG, {**CFG, "loss_chunk_size": 512}))  # a chunk size while unfused: nothing


def test_what_it_does_not_model_is_said():
    p = _profile(UNFUSED)
    plan = R.Plan.of(R.prepare(p), profiler_lead=False)
    triton = {**CFG, "loss_fusion": True, "use_triton_kernels": True}
    with pytest.raises(W.WhatIfError, match="Triton fused loss"):
        LF.edit(plan, p, _change(CFG, triton))
    cpu = _profile(UNFUSED, device="cpu")
    plan = R.Plan.of(R.prepare(cpu))
    ch = _change(CFG, {**CFG, "loss_fusion": True})
    assert LF.edit(plan, cpu, ch) == 0.0 and "no model on a CPU trace" in ch.modeled[0]
    no_loss = _profile([UNFUSED[0], UNFUSED[-1]])
    plan = R.Plan.of(R.prepare(no_loss), profiler_lead=False)
    ch = _change(CFG, {**CFG, "loss_fusion": True})
    assert LF.edit(plan, no_loss, ch) == 0.0 and "no loss units" in ch.notes[0]

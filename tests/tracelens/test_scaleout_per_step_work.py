"""Stop 32's scale-out mechanisms, each against values read from the raw trace JSON (never the code's own reading):

* the gradient clipping (`layout.grad_clip_units`) runs over the rank's gradient shard: its kernels between the last
  micro-batch's ``FSDP::root_post_backward_callback`` and ``Optimizer.step``, 17.1 ms over 2,255 M elements on
  1 GPU, half the elements on 2, a quarter on 4 (`ScaleOut.project` scales it by the parameters per GPU);
* a run at dp 1 casts its experts' parameters and copies their gradients in under FSDP2's hooks inside the layer's
  ``moe/`` ranges: parameter work (``params``), not the tokens' (`profile._scale`);
* a chunked loss's units are the ones that repeat once per chunk, not every kernel whose shapes hold the chunk and
  the vocabulary (`tokens.chunk_units`: with ``d_model == loss_chunk_size`` the clipping of the head's gradient
  matched too);
* an FSDP unit's reduce-scatter starts after its post-backward copy-in (`fsdp_overlap._reduce_keys`): in the dp 4
  run's trace each experts' reduce-scatter starts after that unit's ``_chunk_cat``.

The raw JSON is read here with nothing of tracelens: each kernel linked to its runtime launch by ``correlation``, the
launching op the innermost ``cpu_op`` around the launch on its thread, the FSDP ranges the ``user_annotation`` events
around it.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from tests._benchmarks import load_benchmark

FX = Path(__file__).resolve().parents[1] / "fixtures"
GPU1 = FX / "h100_scaling" / "gpu1_prof"
DP4_16 = FX / "h100_4gpu_layouts" / "dp4_mbs16"


# the element count of recorded input dims (nested lists), as benchmarks/grad_clip_raw.py counts them from the raw JSON
_numel = load_benchmark("grad_clip_raw")._numel


def _kernels(trace: Path, step: int) -> list[dict]:
    """Every kernel (and memcpy / memset) launched inside the host range ``ProfilerStep#<step>``: its name, stream,
    start, µs, launch time, the innermost op around the launch (name, input dims) and the annotations around it."""
    with gzip.open(trace, "rt") as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    st = next(e for e in ev if e.get("name") == f"ProfilerStep#{step}")
    lo, hi = st["ts"], st["ts"] + st["dur"]
    launches = {e["args"]["correlation"]: e for e in ev
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
                and lo <= e["ts"] <= hi}
    ops: dict = collections.defaultdict(list)
    ann: dict = collections.defaultdict(list)
    for e in ev:
        if e.get("cat") == "cpu_op" and e["ts"] + e["dur"] >= lo and e["ts"] <= hi:
            ops[e["tid"]].append(e)
        elif e.get("cat") == "user_annotation" and e["ts"] + e["dur"] >= lo and e["ts"] <= hi:
            ann[e["tid"]].append(e)
    for d in (ops, ann):
        for v in d.values():
            v.sort(key=lambda e: e["ts"])
    starts = {t: [e["ts"] for e in v] for t, v in ops.items()}
    out = []
    for k in ev:
        if k.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        la = launches.get(k.get("args", {}).get("correlation"))
        if la is None:
            continue
        t, ts = la["tid"], la["ts"]
        cand = ops[t][: bisect.bisect_right(starts.get(t, []), ts)]
        around = [o for o in cand if ts <= o["ts"] + o["dur"]]
        op = min(around, key=lambda o: o["dur"]) if around else None
        names = [a["name"] for a in ann[t] if a["ts"] <= ts <= a["ts"] + a["dur"]]
        out.append({"name": k["name"], "stream": k["args"].get("stream"), "start": k["ts"], "dur": k["dur"],
                    "launch": ts, "op": op["name"] if op else "", "dims": (op or {}).get("args", {}).get("Input Dims"),
                    "ann": names})
    return out


@pytest.fixture(scope="module")
def gpu1():
    from tracelens.projection.scaleout import ScaleOut

    so = ScaleOut.from_run(GPU1)
    p = so.model.profiles[0]
    return so, p, _kernels(GPU1 / "traces" / f"rank{p.rank}.json.gz", p.step)


def _clip_window(ks: list[dict], trace: Path, step: int) -> list[dict]:
    """The kernels launched after the step's last ``FSDP::root_post_backward_callback`` ended and before its
    ``Optimizer.step`` began (trainer/train.py's clip_grad_norm)."""
    with gzip.open(trace, "rt") as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    st = next(e for e in ev if e.get("name") == f"ProfilerStep#{step}")
    lo, hi = st["ts"], st["ts"] + st["dur"]
    cb = [e for e in ev if str(e.get("name", "")).startswith("FSDP::root_post_backward_callback")
          and lo <= e["ts"] <= hi]
    opt = min((e for e in ev if str(e.get("name", "")).startswith("Optimizer.step") and lo <= e["ts"] <= hi),
              key=lambda e: e["ts"])
    t0 = max(e["ts"] + e["dur"] for e in cb)
    return [k for k in ks if t0 <= k["launch"] < opt["ts"]]


@pytest.mark.parametrize("run, elems", [("h100_scaling/gpu1_prof", 2255), ("h100_scaling/dp2_prof", 1127),
                                        ("h100_4gpu_accum/dp4_mbs8_prof", 564)])
def test_the_gradient_clipping_is_the_raw_window_and_is_sharded_by_dp(run, elems):
    """`layout.grad_clip_units` on the slowest rank's profile holds the raw window's kernels (their count and µs);
    the window's ops' first inputs, the local gradients, hold 2,255 / 1,127 / 564 M elements at dp 1 / 2 / 4."""
    from tracelens.projection.mechanisms import layout as L
    from tracelens.projection.scaleout import ScaleOut

    so = ScaleOut.from_run(FX / run)
    p = so.model.profiles[0]
    trace = FX / run / "traces" / f"rank{p.rank}.json.gz"
    win = [k for k in _clip_window(_kernels(trace, p.step), trace, p.step) if not k["name"].startswith("nccl")]
    per_op: dict = {}
    for k in win:  # one first input per op: its kernels share it
        per_op.setdefault((k["launch"], k["op"]), _numel((k["dims"] or [[]])[0]) if k["op"] != "aten::mul_" else 0)
    grads = sum(v for (_, op), v in per_op.items() if op == "aten::pow")
    assert grads / 1e6 == pytest.approx(elems, rel=0.01)
    w = p.work
    clip = L.grad_clip_units(w)
    assert int(clip.sum()) == len(win)
    assert float(w["dur"].to_numpy(float)[clip].sum()) / 1e3 == pytest.approx(sum(k["dur"] for k in win), rel=1e-3)


def test_the_projection_scales_the_clipping_by_the_parameters_per_gpu(gpu1):
    """From 1 GPU to dp 4 the clipping runs over a quarter of the gradients: the note names the run's calibrated
    clipping and the factor 0.25 (the optimizer's parameters per GPU, 2,255 -> 564 M)."""
    so, p, ks = gpu1
    pr = so.project(4, {"ep": 1})
    note = next(n for n in pr.notes if n.startswith("gradient clipping"))
    assert "x 0.25 " in note
    raw_ms = sum(k["dur"] for k in _clip_window(ks, GPU1 / "traces" / f"rank{p.rank}.json.gz", p.step)) / 1e3
    ms = float(note.split(", ")[1].split(" ms")[0])
    assert ms == pytest.approx(raw_ms * so.model.device_scale[0], rel=0.01)


def test_fsdp_casts_of_a_dp1_runs_experts_are_parameter_work(gpu1):
    """gpu1_prof (dp 1): the copies FSDP2's hooks launch for the experts (the parameters' cast under ``FSDP::
    pre_forward (layers.<l>.ffn.experts)``, the gradients' copy-in under ``FSDP::post_backward_reduce (...)``) sit in
    the layer's ``moe/`` ranges; the profile marks every one ``params`` (not ``tokens``): the same count and µs as the
    raw JSON's."""
    _, p, ks = gpu1
    raw = [k for k in ks if any(a.startswith(("FSDP::pre_forward (layers.", "FSDP::post_backward_reduce (layers."))
                                and a.endswith(".ffn.experts)") for a in k["ann"])
           and k["op"] in ("aten::copy_", "aten::_chunk_cat") and not k["name"].startswith("nccl")]
    assert len(raw) >= 9  # per MoE layer: the cast's 2-4 copies, the copy-in
    w = p.work
    paths = w["path"].astype(str).to_numpy()
    ops = w["op"].astype(str).to_numpy()
    mine = np.array([("moe/" in q) and ("FSDP::" in q) and ("ffn.experts)" in q) for q in paths]) & np.isin(
        ops, ["aten::copy_", "aten::_chunk_cat"]) & ~w["is_comm"].to_numpy().astype(bool)
    assert int(mine.sum()) == len(raw)
    assert float(w["dur"].to_numpy(float)[mine].sum()) / 1e3 == pytest.approx(sum(k["dur"] for k in raw), rel=1e-3)
    assert set(w["scale"].to_numpy()[mine]) == {"params"}
    assert sum(k["dur"] for k in raw) / 1e3 > 15.0  # 15.8 ms a step the token mechanism used to scale


def test_the_chunked_loss_is_the_units_that_repeat_per_chunk(gpu1):
    """gpu1_prof, micro-batch 16 x 2,048 tokens, loss chunks of 2,048 (16 a micro-batch), d_model 2,048: of the
    kernels whose op's input shapes hold 2,048 and 102,400, the loss loop's are the (op, shapes) that occur 16 times
    or more; the others (the clipping's pow / sum / mul_ on the head's and embedding's gradients, FSDP2's copy-in,
    the loss's buffer fill / scale / copy) fewer times (their kernels, 1-4). `chunk_units` is exactly the first
    set."""
    from tracelens.projection.mechanisms.tokens import chunk_units

    so, p, ks = gpu1
    cfg = so.model.config
    chunks = int(cfg["micro_batch_size"]) * int(cfg["seq_len"]) // int(cfg["loss_chunk_size"])
    assert chunks == 16

    def shaped(k):
        nums = {int(x) for x in json.dumps(k["dims"]).replace("[", " ").replace("]", " ").replace(",", " ").split()
                if x.strip().lstrip("-").isdigit()}
        return 2048 in nums and 102400 in nums

    cand = [k for k in ks if shaped(k) and not k["name"].startswith("nccl")]
    count = collections.Counter((k["op"], json.dumps(k["dims"])) for k in cand)
    loop = [k for k in cand if count[(k["op"], json.dumps(k["dims"]))] >= chunks]
    other = [k for k in cand if count[(k["op"], json.dumps(k["dims"]))] < chunks]
    assert {k["op"] for k in other} >= {"aten::pow", "aten::sum", "aten::mul_"}
    assert max(count[(k["op"], json.dumps(k["dims"]))] for k in other) < chunks
    got = chunk_units(p.work, cfg)
    assert int(got.sum()) == len(loop)
    assert float(p.work["dur"].to_numpy(float)[got].sum()) / 1e3 == pytest.approx(sum(k["dur"] for k in loop),
                                                                                 rel=1e-3)


def test_an_experts_reduce_scatter_starts_after_its_copy_in():
    """dp4_mbs16 (rank 0): each experts' reduce-scatter kernel starts after the ``_chunk_cat`` of the same unit's
    post-backward ends (the raw JSON); the replay's rule keys that copy-in to the experts' unit, so the inserted
    reduce-scatter waits for it (`fsdp_overlap._reduce_keys`: the last unit of the experts' key in the backward is
    that copy-in, not the last grouped GEMM)."""
    from tracelens.projection import fsdp_overlap as FO
    from tracelens.projection.scaleout import ScaleOut

    so = ScaleOut.from_run(DP4_16)
    p = so.model.profiles[0]
    ks = _kernels(DP4_16 / "traces" / f"rank{p.rank}.json.gz", p.step)
    seen = 0
    for layer in (1, 2, 3):
        unit = f"FSDP::post_backward_reduce (layers.{layer}.ffn.experts)"
        cat = [k for k in ks if k["op"] == "aten::_chunk_cat" and unit in k["ann"]]
        rs = [k for k in ks if "ReduceScatter" in k["name"] and unit in k["ann"]]
        assert len(cat) == 1 and len(rs) == 1, (layer, len(cat), len(rs))
        assert rs[0]["start"] >= cat[0]["start"] + cat[0]["dur"] - 1  # µs-rounded clocks
        seen += 1
    assert seen == 3
    w = p.work
    keys = FO._unit_keys(w)
    rk = FO._reduce_keys(w, keys)
    ops = w["op"].astype(str).to_numpy()
    paths = w["path"].astype(str).to_numpy()
    bwd = w["backward"].to_numpy().astype(bool)
    for layer in (1, 2, 3):
        mine = [j for j in range(len(w)) if rk[j] == ("experts", layer) and bwd[j]]
        last = max(mine, key=lambda j: w["launch"].iat[j])
        assert f"post_backward_reduce (layers.{layer}.ffn.experts)" in paths[last], paths[last]
        assert ops[last] in ("aten::_chunk_cat", "aten::copy_") or "Memcpy" in w["name"].iat[last]

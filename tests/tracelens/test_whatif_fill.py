"""The pieces of the what-if's token scaling and host model that the 4 x H100 grid needed (docs/whatif.md,
"Calibration" and the micro_batch_size row): a kernel's fill from its shapes, the launch calls blocked on a full
queue, and the work queued before the trace began as the first profiled step's backlog (checked against the raw
trace JSON of the committed dp 4 baseline)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from tracelens.projection import profile as P
from tracelens.projection import replay as R
from tracelens.projection.mechanisms.tokens import launch_floor

DP4 = Path(__file__).resolve().parents[1] / "fixtures" / "h100_4gpu_layouts" / "dp4_mbs16"


def test_gemm_tiles_from_the_ops_shapes_and_the_kernels_tile():
    # forward: tokens x d_model @ d_model x F, nvjet tile 192 x 192
    assert P._gemm_tiles("aten::mm", "[[32768, 2048], [2048, 10944]]", "nvjet_sm90_tst_192x192_64x4_1x1_h_bz_coopB_TNN") \
        == math.ceil(32768 / 192) * math.ceil(10944 / 192)
    # addmm: the bias comes first; the operand pair is the one whose inner dimensions agree; no tile in the name: 128
    assert P._gemm_tiles("aten::addmm", "[[32768, 2048], [32768, 2816], [2816, 2048], [], [], [32768, 2048]]", "gemm") \
        == (32768 // 128) * (2048 // 128)
    # a weight gradient: the tokens are the reduction, the tiles do not change with them
    assert P._gemm_tiles("aten::mm", "[[2048, 32768], [32768, 2048], [2048, 2048]]", "nvjet_sm90_tst_256x128_64x4") == math.inf
    # bmm multiplies by the batch; shapes that do not multiply give None
    assert P._gemm_tiles("aten::bmm", "[[4, 256, 64], [4, 64, 256]]", "x") == 4 * 2 * 2
    assert P._gemm_tiles("aten::mm", "[[3, 5], [7, 9]]", "x") is None
    assert P._attention_tiles("[[16, 16, 2048, 128], [16, 16, 2048, 192]]") == 16 * 16 * math.ceil(2048 / P._ATTN_TILE)


def _raw(rank: int = 0) -> dict:
    return json.loads(gzip.decompress((DP4 / "traces" / f"rank{rank}.json.gz").read_bytes()))


def test_work_queued_before_the_trace_is_the_steps_backlog():
    import tracelens
    from tracelens.projection.whatif import Model

    raw = _raw()["traceEvents"]
    first = min(e["args"]["correlation"] for e in raw if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}))
    gpu = [e for e in raw if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    pre = [e for e in gpu if e["args"].get("correlation", -1) < first]
    assert len(pre) > 700  # the previous step's tail: its launches were before the profiler started
    a = tracelens.analyze(tracelens.load(DP4, progress=False))
    cfg = Model._run_config(json.loads((DP4 / "manifest.json").read_text())["config"], DP4 / "manifest.json")
    p = P.step_profile(a, cfg, 0)
    w = p.work
    assert w["linked"].all()  # every unit of the step was launched in the trace
    corr = a.gpu.loc[w["gpu_row"], "correlation"].to_numpy()
    assert (corr >= first).all()
    # the compute stream is busy with that work until the last of it ends (trace µs -> ns, the step's frame)
    compute = max(pre, key=lambda e: e["ts"])
    stream = compute["args"]["stream"]
    end_ns = max(e["ts"] + e["dur"] for e in pre if e["args"]["stream"] == stream) * 1000
    assert abs(p.backlog[stream] - (end_ns - p.start)) <= 2_000
    # fills: every kernel of the step got one or NaN; the persistent GEMMs of the step have many waves
    assert "fill" in w and "launch_dur" in w
    gemm = w["component"].isin(["dense GEMMs", "expert GEMMs"]) & (w["scale"] == "tokens")
    assert gemm.any() and (w.loc[gemm, "fill"].dropna() >= 1).mean() > 0.9


def test_queue_waits_are_the_blocked_calls_above_the_median_call():
    # six normal launch calls (10 µs), one that blocked 2 ms while its kernel still had 5 ms of queue ahead (a wait),
    # one as long whose kernel started right after it returned (host work: the device was not behind)
    w = pd.DataFrame({"launch_dur": [10e3] * 6 + [2e6, 2e6], "linked": [True] * 8})
    launch = np.array([0, 20e3, 40e3, 60e3, 80e3, 100e3, 120e3, 3e6])
    start = np.array([1e6, 1.1e6, 1.2e6, 1.3e6, 1.4e6, 1.5e6, 7e6, 5.01e6])
    kinds, idx = np.zeros(8, np.int8), np.arange(8)
    q = R._queue_waits(kinds, idx, launch, start, w)
    assert q.tolist() == [0.0] * 6 + [2e6 - 10e3, 0.0]
    assert R._queue_waits(kinds, idx, launch, start, w.drop(columns="launch_dur")).sum() == 0  # older profiles


def test_launch_floor_is_the_shortest_unit():
    assert launch_floor(np.array([0.0, 900.0, 1_440.0, 2e6])) == 900.0
    assert launch_floor(np.array([])) == 0.0

"""Roofline: perf-model formulas against hand-computed cases, device ceilings, and the real traces."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import tracelens
from tracelens import devices, perfmodels
from tracelens.analysis import roofline as R
from tracelens.perfmodels import model_args

from ..conftest import DIFF_CONTROL, DIFF_TEST, MI250, MOE_GROUPED, MOE_LOOP, NCCL_2RANK

BF, F32 = "c10::BFloat16", "float"


def perf(*args, **kw):
    r = model_args(*args, **kw)
    assert r.perf is not None, r.reason
    return r.perf


# ------------------------------------------------------------------------------------ formulas


def test_mm():
    p = perf("aten::mm", [[64, 32], [32, 16]], [BF, BF])
    assert p.flops == 2 * 64 * 16 * 32
    assert p.bytes == (64 * 32 + 32 * 16 + 64 * 16) * 2
    assert p.matrix and p.dtype == "bf16" and p.mnk == (64, 16, 32)


def test_addmm_reads_bias():
    p = perf("aten::addmm", [[16], [64, 32], [32, 16], [], []], [BF, BF, BF, "Scalar", "Scalar"], ["", "", "", "1", "1"])
    assert p.flops == 2 * 64 * 16 * 32
    assert p.bytes == (64 * 32 + 32 * 16 + 64 * 16 + 16) * 2


def test_bmm_and_baddbmm():
    p = perf("aten::bmm", [[4, 64, 32], [4, 32, 16]], [BF, BF])
    assert p.flops == 4 * 2 * 64 * 16 * 32
    assert p.bytes == 4 * (64 * 32 + 32 * 16 + 64 * 16) * 2
    q = perf("aten::baddbmm", [[4, 64, 16], [4, 64, 32], [4, 32, 16], [], []], [F32, F32, F32, "Scalar", "Scalar"])
    assert q.flops == p.flops and q.bytes == 2 * p.bytes + 4 * 64 * 16 * 4


def test_linear_3d_input():
    p = perf("aten::linear", [[2, 8, 32], [16, 32], [16]], [F32, F32, F32])
    assert p.flops == 2 * (2 * 8) * 16 * 32
    assert p.bytes == (2 * 8 * 32 + 16 * 32 + 2 * 8 * 16 + 16) * 4
    assert p.dtype == "fp32"


def test_matmul_broadcast_batch():
    p = perf("aten::matmul", [[3, 1, 64, 32], [5, 32, 16]], [BF, BF])
    assert p.flops == 15 * 2 * 64 * 16 * 32


def test_sdpa_causal_vs_noncausal():
    dims = [[2, 4, 128, 64]] * 3 + [[], [], [], [], []]
    types = [BF] * 3 + ["", "Scalar", "Scalar", "", "Scalar"]
    full = perf("aten::scaled_dot_product_attention", dims, types, ["", "", "", "", "0.", "False", "", "False"])
    causal = perf("aten::scaled_dot_product_attention", dims, types, ["", "", "", "", "0.", "True", "", "False"])
    assert full.flops == 2 * (2 * 4 * 128 * 128) * (64 + 64)
    assert causal.flops == 2 * (2 * 4 * (128 * 129 // 2)) * (64 + 64)
    assert full.bytes == causal.bytes == 4 * 2 * 4 * 128 * 64 * 2 + 2 * 4 * 128 * 4  # q k v o + fp32 lse
    assert causal.note == "causal" and full.kind == "attention"


def test_causal_pairs_top_left():
    assert R.perfmodels.causal_pairs(4, 4) == 10
    assert R.perfmodels.causal_pairs(4, 6) == 10  # row i keeps keys 0..i
    assert R.perfmodels.causal_pairs(6, 4) == 10 + 2 * 4


def test_cudnn_attention_backward_is_2_5x_forward():
    fdims = [[2, 6, 2048, 128]] * 3 + [[]] * 10
    ftypes = [BF] * 3 + ["", "", "", "Scalar", "Scalar", "Scalar", "Scalar", "Scalar", "Scalar", ""]
    fwd = perf("aten::_cudnn_attention_forward", fdims, ftypes,
               ["", "", "", "", "", "", "2048", "2048", "True", "0.", "True", "False", ""])
    bdims = [[2, 6, 2048, 128]] * 5 + [[2, 6, 2048, 1]] + [[]] * 10
    btypes = [BF] * 5 + [F32, "long int", "long int", "", "", "", "Scalar", "Scalar", "Scalar", "Scalar", ""]
    bwd = perf("aten::_cudnn_attention_backward", bdims, btypes,
               ["", "", "", "", "", "", "", "", "", "", "", "2048", "2048", "0.", "True", ""])
    assert fwd.flops == 2 * 2 * 6 * (2048 * 2049 // 2) * 256
    assert bwd.flops == pytest.approx(2.5 * fwd.flops)


def test_attention_without_is_causal_is_unmodeled():
    r = model_args("aten::scaled_dot_product_attention", [[2, 4, 128, 64]] * 3, [BF] * 3, [])
    assert r.perf is None and "is_causal" in r.reason


def test_grouped_mm_variants():
    p = perf("aten::_grouped_mm", [[8192, 768], [8, 768, 1536], [8], [], []], [BF, BF, "int", "", ""])
    assert p.flops == 2 * 8192 * 1536 * 768
    assert p.bytes == (8192 * 768 + 8 * 768 * 1536 + 8192 * 1536) * 2 + 8 * 4
    assert p.kind == "grouped_gemm"
    w = perf("aten::_grouped_mm", [[768, 8192], [8192, 1536], [8], [], []], [BF, BF, "int", "", ""])  # weight grad
    assert w.flops == 2 * 768 * 1536 * 8192
    assert w.bytes == (768 * 8192 + 8192 * 1536 + 8 * 768 * 1536) * 2 + 8 * 4
    b = perf("aten::_grouped_mm", [[8, 64, 32], [8, 32, 16], [], [], []], [BF, BF, "", "", ""])
    assert b.flops == 8 * 2 * 64 * 16 * 32


def test_layer_norm_and_backward():
    p = perf("aten::native_layer_norm", [[4, 8, 16], [], [16], [16], []], [BF, "ScalarList", BF, BF, "Scalar"],
             ["", "[16]", "", "", "1e-05"])
    assert p.flops == 5 * 512
    assert p.bytes == 2 * 512 * 2 + 2 * 16 * 2 + 2 * 32 * 4  # in+out, weight+bias, fp32 mean+rstd per row
    b = perf("aten::native_layer_norm_backward",
             [[4, 8, 16], [4, 8, 16], [], [4, 8, 1], [4, 8, 1], [16], [16], []],
             [BF, BF, "ScalarList", F32, F32, BF, BF, "ScalarList"], ["", "", "[16]", "", "", "", "", "[True, False, False]"])
    assert b.bytes == (512 + 512) * 2 + 2 * 32 * 4 + 16 * 2 + 512 * 2  # reads + grad_input only


def test_elementwise_broadcast():
    p = perf("aten::add", [[8, 1, 16], [4, 16], []], [F32, F32, "Scalar"])
    assert p.flops == 8 * 4 * 16
    assert p.bytes == (8 * 16 + 4 * 16) * 4 + 8 * 4 * 16 * 4
    q = perf("aten::add_", [[8, 4, 16], [8, 4, 16], []], [BF, BF, "Scalar"])
    assert q.bytes == 3 * 512 * 2  # read self, read other, write self


def test_expanded_operand_counts_once():
    dims = [[4096, 768], [], [8192, 768], [], [8192, 768]]
    types = [BF, "Scalar", "long int", "Scalar", BF]
    dense = perf("aten::gather", dims, types, ["", "0", "", "False", ""])
    expanded = perf("aten::gather", dims, types, ["", "0", "", "False", ""],
                    strides=[[768, 1], [], [1, 0], [], [768, 1]])
    assert dense.bytes - expanded.bytes == 8192 * 767 * 8


def test_softmax_reduction_loss_embedding():
    assert perf("aten::_softmax", [[4096, 8], [], []], [BF, "Scalar", "Scalar"]).bytes == 2 * 4096 * 8 * 2
    s = perf("aten::sum", [[4096, 768], [], [], []], [BF, "ScalarList", "Scalar", ""], ["", "[0]", "True", ""])
    assert s.bytes == (4096 * 768 + 768) * 2 and s.flops == 4096 * 768
    e = perf("aten::embedding", [[1000, 64], [2, 16]], [F32, "long int"])
    assert e.bytes == 32 * 8 + 2 * 32 * 64 * 4
    n = perf("aten::nll_loss_forward", [[32, 1000], [32], [], [], []], [F32, "long int", "", "Scalar", "Scalar"])
    assert n.bytes == 32 * 4 + 32 * 8 + 32 * 4


@pytest.mark.parametrize("args", [
    ("aten::mm", "not json", '["float"]', ""),
    ("aten::mm", "[[2, 3]]", '["float", "float"]', ""),  # missing operand
    ("aten::mm", "[[2, 3], [4, 5]]", '["float", "float"]', ""),  # inner dims differ
    ("aten::mm", "[[2, -1], [-1, 5]]", '["float", "float"]', ""),
    ("aten::mm", "", "", ""),
    ("aten::bmm", "[[2, 3], [3, 4]]", '["float", "float"]', ""),
    ("aten::_grouped_mm", "[[8, 3], [3, 4], [], [], []]", '["float", "float", "", "", ""]', ""),
    ("aten::add", "[[2, 3], [4, 5]]", '["float", "float"]', ""),  # no broadcast
    ("aten::linear", "{}", "[]", ""),
])
def test_malformed_shapes_are_unmodeled_not_errors(args):
    r = perfmodels.model(*args)
    assert r.perf is None and r.reason


def test_unknown_op_not_guessed():
    r = model_args("aten::sort", [[8192], [], [], []], ["long int", "Scalar", "Scalar", "Scalar"])
    assert r.perf is None and r.reason == "no model for this op"


# ------------------------------------------------------------------------------------ devices


@pytest.mark.parametrize("name,props,key", [
    ("NVIDIA H200", {}, "H200 SXM"), ("NVIDIA H100 80GB HBM3", {}, "H100 SXM"), ("NVIDIA H100 PCIe", {}, "H100 PCIe"),
    ("NVIDIA A100-SXM4-80GB", {}, "A100 SXM 80GB"), ("NVIDIA A100-PG509-200", {"totalGlobalMem": 42505273344},
                                                     "A100 SXM 40GB"),
    ("Tesla V100-SXM2-16GB", {}, "V100 SXM2"), ("AMD Instinct MI250X / MI250", {"numSms": 110}, "MI250X (per GCD)"),
    ("AMD Instinct MI250X / MI250", {"numSms": 104}, "MI250 (per GCD)"),
    ("AMD Radeon Graphics", {"numSms": 104, "computeMajor": 9}, "MI250 (per GCD)"),
    ("AMD Instinct MI300X", {}, "MI300X"), ("AMD Instinct MI325X", {}, "MI325X"), ("AMD Instinct MI355X", {}, "MI355X"),
])
def test_device_lookup(name, props, key):
    c = devices.lookup(name, props)
    assert c is not None and c.device == key
    assert c.hbm_tbps > 0 and c.source


def test_device_table_sane():
    for c in devices.DEVICES.values():
        assert c.hbm_tbps and c.fp32_tflops and c.sm_count and c.source.startswith("http")
        assert (c.bf16_tflops or c.fp16_tflops) > c.fp32_tflops
    assert devices.lookup("Mystery GPU 9000") is None
    assert "no ceilings for device Mystery GPU 9000" in devices.no_ceilings_message("Mystery GPU 9000")


def test_measured_ceilings_override(tmp_path):
    f = tmp_path / "ceil.json"
    f.write_text(json.dumps({"device": "NVIDIA H200", "bf16_tflops": 700.0, "hbm_tbps": 4.0}))
    c = devices.resolve("NVIDIA H200", None, f)
    assert c.peak_tflops("bf16") == 700.0 and c.hbm_tbps == 4.0 and c.fp8_tflops == 1978.9
    assert set(c.measured) == {"bf16_tflops", "hbm_tbps"}
    u = devices.resolve("Mystery GPU", None, {"bf16_tflops": 100.0, "hbm_tbps": 1.0})
    assert u.peak_tflops("bf16") == 100.0
    with pytest.raises(ValueError):
        devices.load_measured({"bf16_tflop": 1.0})
    with pytest.raises(ValueError):
        devices.load_measured({"bf16_tflops": -1})


@pytest.mark.parametrize("text, shown", [("1e999", "inf"), ("true", "True")])
@pytest.mark.parametrize("verb", ["roofline", "analyze"])
def test_a_non_finite_or_boolean_measured_ceiling_is_one_line_exit_2(tmp_path, verb, text, shown):
    """JSON reads 1e999 as inf: an infinite HBM bandwidth was taken (every op then 0 % of a memory roof), and true as
    1 TB/s, both with exit 0."""
    from ._cli import run_cli

    f = tmp_path / "ceil.json"
    f.write_text(f'{{"device": "NVIDIA H200", "hbm_tbps": {text}}}')
    out = ["-o", tmp_path / "out"] if verb == "analyze" else []
    r = run_cli(verb, MOE_GROUPED, "--ceilings", f, *out)
    assert r.returncode == 2, r.stdout
    assert r.stderr == f"tracelens: error: {f}: measured ceiling hbm_tbps must be a positive number, got {shown}\n"


# ------------------------------------------------------------------------------------ real traces


@pytest.fixture(scope="module")
def grouped():
    return tracelens.analyze(tracelens.load(MOE_GROUPED, cache=False))


@pytest.fixture(scope="module")
def loop():
    return tracelens.analyze(tracelens.load(MOE_LOOP, cache=False))


def _gemm_rows(t):
    return t[t["kind"].isin(["gemm", "grouped_gemm"])]


def test_h200_gemms_plausible(grouped):
    r = R.roofline_result(grouped)
    t = r.table
    assert r.ceilings["NVIDIA H200"].device == "H200 SXM"
    g = _gemm_rows(t)
    assert len(g) >= 8 and set(g.loc[g["kind"] == "grouped_gemm", "input_dims"]) == {
        "[[8192, 768], [8, 768, 1536], [8], [], []]", "[[8192, 1536], [8, 1536, 768], [8], [], []]",
        "[[768, 8192], [8192, 1536], [8], [], []]", "[[1536, 8192], [8192, 768], [8], [], []]"}
    assert (g["tflops"] > 0).all() and (g["tflops"] <= g["peak_tflops"]).all()
    big = g[g["flops"] > 1e10]  # the large GEMMs of this model reach a healthy fraction of 989 TFLOP/s
    assert len(big) >= 6 and big["pct_peak_compute"].between(20, 100).all()
    assert (big["bound"] == "compute").all()
    attn = t[t["kind"] == "attention"]
    assert set(attn["op"]) == {"aten::_cudnn_attention_forward", "aten::_cudnn_attention_backward"}
    assert (attn["note"] == "causal").all() and (attn["pct_peak_compute"] < 100).all()
    assert (t["pct_peak_compute"].dropna() <= 100).all()
    assert not any("compute ceiling" in w for w in r.warnings)
    # elementwise ops are memory-bound
    assert (t.loc[t["kind"] == "elementwise", "bound"] == "memory").all()


def test_unmodeled_listed_and_time_accounted(grouped):
    r = R.roofline_result(grouped)
    um = r.unmodeled
    assert {"aten::sort", "aten::topk"} <= set(um["op"])
    assert (um["reason"] != "").all()
    g = grouped.gpu[~grouped.gpu["is_comm"]]
    total_us = g["dur"].sum() / 1e3
    assert r.modeled_gpu_us + r.unmodeled_gpu_us + r.unattributed_gpu_us == pytest.approx(total_us, rel=1e-9)
    assert r.summary()["modeled_share"] > 0.5
    # no row counted twice: groups are unique
    keys = ["device", "op", "input_dims", "input_types", "concrete_inputs", "input_strides"]
    assert not r.table.duplicated(keys).any()


def test_expert_loop_is_a_shape_family(loop):
    r = R.roofline_result(loop)
    fam = r.families
    loops = fam[fam["family"].str.contains(r"\*")]
    assert len(loops) >= 4 and (loops["shapes"] >= 8).all()
    assert (loops["tflops"] <= loops["peak_tflops"] if "peak_tflops" in loops else loops["pct_peak_compute"] <= 100).all()
    assert (_gemm_rows(r.table)["pct_peak_compute"] <= 100).all()


def test_nccl_trace_gemms_and_comm_excluded():
    a = tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))
    t = R.roofline(a)
    g = _gemm_rows(t)
    assert len(g) and g["pct_peak_compute"].between(30, 100).all()
    assert not t["op"].str.contains("nccl|c10d|record_param_comms", case=False).any()


def test_mi250_trace():
    a = tracelens.analyze(tracelens.load(MI250, cache=False))
    r = R.roofline_result(a)
    c = next(iter(r.ceilings.values()))
    assert c is not None and c.device == "MI250 (per GCD)"
    assert {"aten::addmm", "aten::mm"} <= set(r.table["op"])
    assert (r.table["tflops"] >= 0).all() and (r.table["pct_peak_compute"].dropna() <= 100).all()


@pytest.mark.parametrize("path", [DIFF_CONTROL, DIFF_TEST])
def test_a100_v100_traces(path):
    a = tracelens.analyze(tracelens.load(path, cache=False))
    r = R.roofline_result(a)
    assert all(v is not None for v in r.ceilings.values())
    g = _gemm_rows(r.table)
    assert len(g) and (g["pct_peak_compute"] <= 100).all() and (g["tflops"] > 0).all()


def test_device_without_ceilings(grouped):
    import copy

    a = copy.copy(grouped)
    a.trace = copy.copy(grouped.trace)
    a.trace.ranks = [copy.copy(i) for i in grouped.trace.ranks]
    for i in a.trace.ranks:
        i.device_properties = [{"name": "Mystery GPU"}]
    r = R.roofline_result(a)
    assert r.ceilings == {"Mystery GPU": None}
    assert any("no ceilings for device Mystery GPU" in w for w in r.warnings)
    t = r.table
    assert len(t) and (t["tflops"].dropna() >= 0).all() and t["pct_peak_compute"].isna().all()
    assert (t["bound"] == "unknown").all()
    # measured ceilings make it work
    t2 = R.roofline(a, ceilings={"bf16_tflops": 900.0, "hbm_tbps": 4.5, "fp32_tflops": 60.0})
    assert _gemm_rows(t2)["pct_peak_compute"].between(0, 100).all()


def test_measured_ceilings_change_percentages(grouped):
    base = R.roofline(grouped)
    lower = R.roofline(grouped, ceilings={"device": "NVIDIA H200", "bf16_tflops": 494.7, "hbm_tbps": 4.8})
    m = base.merge(lower, on=["op", "input_dims", "input_types", "concrete_inputs", "input_strides"], suffixes=("", "_m"))
    assert len(m) == len(base)
    g = m[(m["dtype"] == "bf16") & m["kind"].isin(["gemm", "grouped_gemm"])]
    assert np.allclose(g["pct_peak_compute_m"], 2 * g["pct_peak_compute"])


def test_report_figure_is_plain_json(grouped):
    from reports import roofline as RR
    from reports.common import html_table, safe_json

    r = R.roofline_result(grouped)
    fig = RR.roofline_figure(r.table, r.ceilings)
    text = safe_json(fig)  # no NaN, plain types
    assert json.loads(text)["layout"]["xaxis"]["type"] == "log"
    names = [d["name"] for d in fig["data"]]
    assert any("roof" in n for n in names) and "gemm" in names
    pts = [d for d in fig["data"] if d["mode"] == "markers"]
    assert sum(len(d["x"]) for d in pts) == int(((r.table["tflops"] > 0) & (r.table["intensity"] > 0)).sum())
    assert all(x > 0 for d in pts for x in d["x"])
    assert html_table(r.table, RR.roofline_table_columns()).startswith("<table")
    # hover text is escaped
    t = r.table.copy()
    t.loc[t.index[0], "op"] = "<script>x</script>"
    fig2 = RR.roofline_figure(t, None)
    assert "<script>" not in json.dumps(fig2) and "&lt;script&gt;" in json.dumps(fig2)
    assert math.isfinite(fig2["layout"]["yaxis"]["range"][0])


# ------------------------------------------------------------------------------------ attribution (synthetic trace)


def _synthetic_trace(path):
    """One thread: sdpa (math fallback) -> bmm + _safe_softmax + its own kernel; linear -> t (a kernel)."""
    ev = []
    corr = [0]

    def op(name, ts, dur, dims, types, concrete=None):
        ev.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                   "args": {"Input Dims": dims, "Input type": types, "Concrete Inputs": concrete or [""] * len(dims)}})

    def launch(ts, kdur, kts):
        corr[0] += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts,
                   "dur": 1, "args": {"correlation": corr[0]}})
        ev.append({"ph": "X", "cat": "kernel", "name": f"kernel_{corr[0]}", "pid": 0, "tid": 7, "ts": kts, "dur": kdur,
                   "args": {"correlation": corr[0], "device": 0, "stream": 7}})

    q = [2, 4, 128, 64]
    op("aten::scaled_dot_product_attention", 100, 50, [q, q, q, [], [], [], [], []],
       [BF, BF, BF, "", "Scalar", "Scalar", "", "Scalar"], ["", "", "", "", "0.", "False", "", "False"])
    op("aten::bmm", 105, 10, [[8, 128, 64], [8, 64, 128]], [BF, BF])
    launch(106, 10, 1000)
    op("aten::_safe_softmax", 120, 10, [[2, 4, 128, 128], [], []], [BF, "Scalar", ""])
    launch(121, 5, 1020)
    launch(140, 2, 1030)  # launched by sdpa itself
    op("aten::linear", 200, 20, [[64, 32], [16, 32], []], [BF, BF, ""])
    op("aten::t", 202, 5, [[16, 32]], [BF])
    launch(203, 3, 1040)
    doc = {"traceEvents": ev, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132}]}
    path.write_text(json.dumps(doc))
    return path


def test_attribution_innermost_modeled_and_nested(tmp_path):
    a = tracelens.analyze(tracelens.load(_synthetic_trace(tmp_path / "syn.json"), cache=False))
    r = R.roofline_result(a)
    t = r.table.set_index("op")
    assert set(t.index) == {"aten::bmm", "aten::linear"}
    assert t.loc["aten::bmm", "gpu_us"] == pytest.approx(10.0)
    assert t.loc["aten::bmm", "flops"] == 8 * 2 * 128 * 128 * 64
    assert t.loc["aten::linear", "gpu_us"] == pytest.approx(3.0)  # the unmodeled child's kernel climbs to linear
    um = r.unmodeled.set_index("op")
    assert um.loc["aten::_safe_softmax", "gpu_us"] == pytest.approx(5.0)
    assert um.loc["aten::scaled_dot_product_attention", "gpu_us"] == pytest.approx(2.0)
    assert um.loc["aten::scaled_dot_product_attention", "reason"] == R.NESTED_REASON
    assert r.ceilings["NVIDIA H100 80GB HBM3"].device == "H100 SXM"
    assert r.modeled_gpu_us + r.unmodeled_gpu_us == pytest.approx(20.0)

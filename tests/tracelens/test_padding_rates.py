"""Rates on padded MoE work (issue 34, the level-3 defects): the roofline, `comm` and the what-if of the sync-free
level count the worst-case buffer's padding as padding.

On the 4-GPU EP-4 level-3 fixture (a real NCCL run) every `aten::_grouped_mm` computes 24,576 rows for the 6,144
routed (tokens x top_k) and every token all-to-all sends 24,576 rows of d_model: 75 % padding. The reference
values are computed here from the raw trace JSON (each grouped GEMM's input dims and the kernels its launches
ran, matched by correlation id; each all-to-all's `record_param_comms` element count) and the manifest's config,
not by the modules under test.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import tracelens
from tracelens.analysis import comm as CM
from tracelens.analysis.roofline import roofline_result

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "h100_4gpu"
L3 = FIX / "ep4_L3_torch"
L0 = FIX / "ep4_L0_loop"


def _cfg(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["config"]


def _routed(cfg: dict) -> int:
    return int(cfg["micro_batch_size"]) * int(cfg["seq_len"]) * int(cfg["top_k"])


def _events(path: Path) -> list[dict]:
    with gzip.open(path) as f:
        return json.load(f)["traceEvents"]


def _raw_grouped_gemms(run: Path) -> list[dict]:
    """Every `aten::_grouped_mm` call of every rank's raw JSON: its rank, input dims (as the trace writes them),
    grouped rows M, the other two GEMM dims (K, N) and the summed duration (us) of the kernels its launches ran."""
    out = []
    for f in sorted((run / "traces").iterdir()):
        rank = int(f.name.split(".")[0].removeprefix("rank"))
        ev = _events(f)
        kern = {e["args"]["correlation"]: e["dur"] for e in ev if e.get("cat") == "kernel"}
        launches = defaultdict(list)
        for e in ev:
            if e.get("cat") == "cuda_runtime" and "Launch" in e.get("name", ""):
                launches[e["tid"]].append((e["ts"], e["args"]["correlation"]))
        for e in ev:
            if e.get("cat") != "cpu_op" or e.get("name") != "aten::_grouped_mm":
                continue
            a, b = e["args"]["Input Dims"][:2]
            if len(b) == 3:  # [M, K] x [E, K, N]
                m, k, n = a[0], a[1], b[2]
            else:  # [K, M] x [M, N]: the weight gradient, M contracted
                m, k, n = a[1], a[0], b[1]
            us = sum(kern.get(c, 0.0) for ts, c in launches[e["tid"]] if e["ts"] <= ts <= e["ts"] + e["dur"])
            out.append({"rank": rank, "dims": e["args"]["Input Dims"], "m": m, "k": k, "n": n, "us": us})
    return out


@pytest.fixture(scope="module")
def l3():
    return tracelens.analyze(tracelens.load(L3, progress=False))


def test_roofline_rates_the_routed_rows_beside_the_computed_ones(l3):
    calls, cfg = _raw_grouped_gemms(L3), _cfg(L3)
    routed = _routed(cfg)
    assert {c["m"] for c in calls} == {4 * routed}  # the worst-case buffer: 75 % padding
    r = roofline_result(l3)
    t = r.table[r.table["op"] == "aten::_grouped_mm"]
    by_dims = defaultdict(list)
    for c in calls:
        by_dims[json.dumps(c["dims"]).replace(" ", "")].append(c)
    assert len(t) == len(by_dims)
    for row in t.itertuples(index=False):
        cs = by_dims[row.input_dims.replace(" ", "")]
        sec = sum(c["us"] for c in cs) / 1e6
        computed = sum(2.0 * c["m"] * c["k"] * c["n"] for c in cs) / sec / 1e12
        useful = sum(2.0 * routed * c["k"] * c["n"] for c in cs) / sec / 1e12
        assert row.gpu_us == pytest.approx(sum(c["us"] for c in cs), rel=1e-6)
        assert row.tflops == pytest.approx(computed, rel=1e-6)
        assert row.useful_tflops == pytest.approx(useful, rel=1e-6)
        assert row.useful_pct_roof == pytest.approx(100.0 * useful / row.roof_tflops, rel=1e-6)
        assert row.useful_pct_roof == pytest.approx(row.pct_roof / 4, rel=1e-6)
    others = r.table[r.table["op"] != "aten::_grouped_mm"]
    assert others["useful_tflops"].isna().all() and others["useful_pct_roof"].isna().all()
    # the same padding as the moe_padding finding, said in the text and the summary
    f = next(f for f in l3.findings() if f["type"] == "moe_padding")
    s = r.summary()
    assert s["padding"]["routed_rows_per_call"] == f["evidence"]["routed_rows_per_call"] == routed
    assert s["padding"]["padding_share_rows"] == f["evidence"]["padding_share_rows"] == 0.75
    text = r.to_text()
    assert "GPU time summed over 4 ranks" in text
    assert "useful" in text.lower() and "75% of expert-GEMM rows are padding" in text
    assert f"{routed:,} routed of {4 * routed:,} computed rows per call" in text


def test_roofline_without_padding_reports_no_useful_rate():
    a = tracelens.analyze(tracelens.load(L0, progress=False))
    r = roofline_result(a)
    assert r.table["useful_tflops"].isna().all() and r.summary()["padding"] is None
    text = r.to_text()
    assert "useful" not in text.lower() and "GPU time summed over 4 ranks" in text
    assert r.summary()["ranks"] == 4


def _raw_a2a_bytes(run: Path) -> list[int]:
    """Bytes of every token all-to-all (bf16 elements, larger than the counts exchange) of every rank."""
    cfg = _cfg(run)
    out = []
    for f in sorted((run / "traces").iterdir()):
        for e in _events(f):
            if e.get("name") == "record_param_comms" and e["args"].get("Collective name") == "all_to_allv":
                n = int(e["args"].get("In msg nelems") or 0)
                if n > cfg["d_model"]:
                    out.append(2 * n)
    return out


def test_comm_rates_the_routed_bytes_beside_the_padded_ones(l3):
    cfg = _cfg(L3)
    sent = _raw_a2a_bytes(L3)
    routed_b = _routed(cfg) * cfg["d_model"] * 2
    assert set(sent) == {4 * routed_b}
    rep = CM.comm_report(l3)
    s = rep.summary.set_index(["rank", "collective"])
    inst = rep.instances[~rep.instances["startup"] & rep.instances["cross_rank"]]
    for (rank, coll), g in inst.groupby(["rank", "collective"]):
        row = s.loc[(rank, coll)]
        frac = np.where(g["bytes"].isin(sent), routed_b / g["bytes"], 1.0)
        if coll == "all_to_allv":
            assert row["useful_bytes"] == int(np.where(g["bytes"].isin(sent), routed_b, g["bytes"]).sum())
            assert row["useful_busbw_gbps"] == pytest.approx(float((g["busbw_gbps"] * frac).mean()), rel=1e-9)
            assert row["useful_busbw_gbps"] < 0.3 * row["mean_busbw_gbps"]
        else:  # no padding in the other collectives: no useful figure claimed
            assert np.isnan(row["useful_busbw_gbps"])
    tokens = inst[inst["bytes"].isin(sent)]
    assert len(tokens) == len(sent)
    f = next(f for f in l3.findings() if f["type"] == "moe_padding")
    assert rep.padding["a2a_padding_share_bytes"] == f["evidence"]["a2a_padding_share_bytes"] == 0.75
    text = rep.to_text()
    assert "useful GB/s" in text
    assert "75% of the token all-to-all bytes are padding" in text
    assert rep.to_dict()["padding"]["a2a_routed_bytes_per_call"] == routed_b


def test_comm_without_padding_claims_no_useful_bandwidth():
    a = tracelens.analyze(tracelens.load(L0, progress=False))
    rep = CM.comm_report(a)
    assert rep.padding is None and rep.summary["useful_busbw_gbps"].isna().all()
    assert "useful" not in rep.to_text()


def test_report_shows_the_useful_rates_beside_the_computed_ones(l3):
    from reports.html import render

    page = render(l3)
    assert "useful TFLOP/s" in page and "useful GB/s" in page
    assert "75% of expert-GEMM rows are padding" in page and "75% of the token all-to-all bytes are padding" in page
    assert "GPU time summed over 4 ranks" in page

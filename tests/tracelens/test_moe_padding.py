"""Padded MoE work (issue 34 item 3, the padding part): a sync-free EP run's worst-case buffers are counted.

The reference count is made here from the raw trace JSON (each `aten::_grouped_mm` call's input dims, each
token all-to-all's `record_param_comms` element count) and the routed rows (tokens per micro-batch x top_k from
the manifest), not by the module under test. On the 4-GPU level-3 fixture 3 of every 4 rows are padding.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import tracelens
from tracelens.analysis.moe import expert_padding

FIX = Path(__file__).resolve().parents[1] / "fixtures"
L3 = FIX / "h100_4gpu" / "ep4_L3_torch"


def _raw_counts(run: Path) -> tuple[list[int], list[int], dict]:
    """(rows of every grouped GEMM call, elements of every all_to_allv larger than the counts exchange) over the
    profiled steps of every rank's raw JSON, and the manifest config."""
    cfg = json.loads((run / "manifest.json").read_text())["config"]
    rows, elems = [], []
    for f in sorted((run / "traces").iterdir()):
        for e in json.load(gzip.open(f))["traceEvents"]:
            if e.get("cat") == "cpu_op" and e.get("name") == "aten::_grouped_mm":
                a, b = e["args"]["Input Dims"][:2]
                rows.append(a[0] if len(b) == 3 else a[1])  # [M,K]x[E,K,N] or [K,M]x[M,N]
            if e.get("name") == "record_param_comms" and e["args"].get("Collective name") == "all_to_allv":
                n = int(e["args"].get("In msg nelems") or 0)
                if n > cfg["d_model"]:  # the token buffers, not the per-expert counts
                    elems.append(n)
    return rows, elems, cfg


def test_level3_ep4_padding_is_three_quarters():
    rows, elems, cfg = _raw_counts(L3)
    routed = cfg["micro_batch_size"] * cfg["seq_len"] * cfg["top_k"]
    want_rows = 1 - routed * len(rows) / sum(rows)
    want_bytes = 1 - routed * cfg["d_model"] * len(elems) / sum(elems)
    assert want_rows == pytest.approx(0.75, abs=0.02) and want_bytes == pytest.approx(0.75, abs=0.02)
    a = tracelens.analyze(tracelens.load(L3, progress=False))
    p = expert_padding(a)
    assert p["padding_share_rows"] == pytest.approx(want_rows, abs=1e-4)
    assert p["a2a_padding_share_bytes"] == pytest.approx(want_bytes, abs=1e-4)
    assert p["routed_rows_per_call"] == routed and p["rows_per_call"] == round(sum(rows) / len(rows))
    f = next(f for f in a.findings() if f["type"] == "moe_padding")
    assert f["title"].startswith("75% of expert-GEMM rows and all-to-all bytes are padding")
    assert p["buffers"] == "worst-case"  # the nccl path at level 3
    assert 0 < f["recoverable_us"] <= p["grouped_gemm_us_per_rank"] + 1e6


def test_no_padding_without_worst_case_buffers():
    for run in (FIX / "h100_4gpu" / "ep4_L0_loop", FIX / "h100_4gpu" / "pp4_1f1b"):
        a = tracelens.analyze(tracelens.load(run, progress=False))
        assert expert_padding(a) is None and not any(f["type"] == "moe_padding" for f in a.findings())


def test_a_trace_without_a_manifest_claims_nothing(tmp_path):
    import shutil

    shutil.copytree(L3 / "traces", tmp_path / "traces")
    a = tracelens.analyze(tracelens.load(tmp_path / "traces", progress=False))
    assert expert_padding(a) is None


CAP = FIX / "h100_4gpu" / "ep4_cap_ovl"


def test_capacity_overlap_run_buffers_padded_gemms_not():
    """The trainer of issue 33 (its manifest has `ep_dispatch`): capacity 1.25, 2 overlap chunks. Every grouped
    GEMM's buffer is ep * ceil(1.25 * chunk tokens * top_k / ep) rows (from the raw JSON, and from the formula);
    the routed rows per call are a chunk's tokens x top_k less the manifest's dropped share; the GEMMs stop at the
    routed rows, so the padding is in the buffers and on the wire, and no GEMM time is claimed for it."""
    rows, elems, cfg = _raw_counts(CAP)
    man = json.loads((CAP / "manifest.json").read_text())
    disp = man["ep_dispatch"]
    assert disp["path"] == "capacity" and disp["overlap_chunks"] == 2 and 0 < disp["dropped_share"] < 0.1
    chunk = cfg["micro_batch_size"] * cfg["seq_len"] // 2
    ep, k = cfg["ep"], cfg["top_k"]
    buf = ep * -(-int(1.25 * chunk * k) // ep)
    assert set(rows) == {buf} == {122_880}
    assert {n // cfg["d_model"] for n in elems} == {buf}  # the token all-to-alls carry the same buffers
    routed = chunk * k * (1 - disp["dropped_share"])
    a = tracelens.analyze(tracelens.load(CAP, progress=False))
    p = expert_padding(a)
    assert p["gemm_computes_padding"] is False and p["padded_gemm_us_per_rank"] == 0.0
    assert p["chunks_per_microbatch"] == 2 and p["rows_per_call"] == buf
    assert p["routed_rows_per_call"] == round(routed)
    assert p["padding_share_rows"] == pytest.approx(1 - routed / buf, abs=1e-4)
    assert p["a2a_padding_share_bytes"] == pytest.approx(1 - routed / buf, abs=1e-4)
    f = next(f for f in a.findings() if f["type"] == "moe_padding")
    assert "the GEMMs stop at the routed rows" in f["title"] and "buffer rows" in f["title"]
    assert "per chunk of 2" in f["title"] and "dropped" in f["title"]
    # the comm table's note names the buffers for what they are: the capacity path's, not worst-case ones
    assert p["buffers"] == "capacity"
    from tracelens.analysis.comm import comm_report

    note = comm_report(a).padding_note()
    assert "(capacity buffers, finding moe_padding)" in note and "worst-case" not in note

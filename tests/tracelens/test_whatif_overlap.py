"""The EP overlap mechanism (tracelens/projection/mechanisms/overlap.py): the token all-to-alls in another number of chunks.

The chunked blocks it finds against the raw trace JSON of the committed 4 x H100 run, the kernel-table lookup against
a table written here, the rebuilt replay's order (each chunk's experts after its rows, its return trip after its
experts), and predictions against the measured rows of docs/performance.md ('Expert parallelism at the speed of data
parallelism' and stop 24: rows of other calls, not fitted)."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest

from tracelens.projection import mechanisms as MECH
from tracelens.projection import replay as R
from tracelens.projection import whatif as W
from tracelens.projection.kerneltable import KernelTable
from tracelens.projection.mechanisms import layout as L
from tracelens.projection.mechanisms import overlap as O
from tracelens.projection.mechanisms.base import Change

CAP_OVL = Path(__file__).resolve().parents[1] / "fixtures" / "h100_4gpu" / "ep4_cap_ovl"


@pytest.fixture(scope="module")
def model():
    return W.Model.from_run(CAP_OVL)


def test_blocks_are_the_raw_traces_token_all_to_alls(model):
    # the raw JSON: token all-to-alls (record_param_comms all_to_allv of more than 64 Ki elements) of rank 0 in the
    # profiled steps 7-8: 3 MoE layers x 2 passes x 2 legs x 2 chunks = 24 a step
    with gzip.open(CAP_OVL / "traces" / "rank0.json.gz") as fh:
        doc = json.loads(fh.read())
    n = sum(1 for e in doc["traceEvents"] if e.get("name") == "record_param_comms"
            and e.get("args", {}).get("Collective name") == "all_to_allv" and int(e["args"].get("In msg nelems", 0)) > 1 << 16)
    assert n == 2 * 24
    p = model.profiles[0]
    comm = model.measured["layout"].comm[0]
    blocks = O._blocks(p.work, L._a2a_units(p.work, comm))
    assert len(blocks) == 6 and all(len(v) == 4 for v in blocks.values())
    assert {ly for ly, _ in blocks} == {1, 2, 3}  # layer 0 is dense (first_k_dense)
    # each chunk has its own expert work between its all-to-alls: the same grouped GEMMs in both chunks
    for (ly, bwd), us in blocks.items():
        mids = O._middles(p.work, ly, bwd, us[:2], us[2:])
        gemms = [int((p.work["component"].to_numpy()[m] == "expert GEMMs").sum()) for m in mids]
        assert gemms[0] == gemms[1] >= 2


def test_gemm_time_per_row_from_the_kernel_table():
    # a table of the E=64 grouped GEMM: 2.0 ms at 16,384 tokens (98,304 rows), 3.6 ms at 32,768
    rows = [{"pass": "fwd", "T": t, "K": 2048, "N": 2816, "E": 64, "backend": "torch", "ms": ms}
            for t, ms in ((16384, 2.0), (32768, 3.6))]
    cfg = {"ep": 4, "n_routed_experts": 64, "top_k": 6, "d_model": 2048, "moe_d_ff": 1408, "grouped_gemm_backend": "torch"}
    # 24,576 rows over 16 local experts = 1,536 per expert = the table's 16,384 tokens (98,304 rows over 64)
    assert O.gemm_time_per_row(KernelTable(rows, "t"), cfg, 24_576, "fwd") == pytest.approx(2.0e6 / 98_304)
    # 49,152 rows: the table's 32,768 tokens
    assert O.gemm_time_per_row(KernelTable(rows, "t"), cfg, 49_152, "fwd") == pytest.approx(3.6e6 / 196_608)
    assert O.gemm_time_per_row(None, cfg, 49_152, "fwd") is None
    # the bench_kernels.py rows name T "tokens"
    assert KernelTable([{**r, "tokens": r.pop("T")} for r in rows], "b").ms("fwd", 16384, 2048, 2816, 64, "torch") == 2.0


def test_rebuilt_chunks_wait_for_their_rows_and_experts(model):
    new = model._validate({"ep_overlap_chunks": 4})
    ch = Change(model, model.config, new, new, {"ep_overlap_chunks": 4})
    prog = model.programs[0]
    plan = R.Plan.of(prog, profiler_lead=False)
    n0 = len(plan.dur)
    MECH.BY_NAME["overlap"].edit(plan, prog.profile, replace(ch, modeled=[], notes=[]))
    res = plan.replay(model.host_scale[0])
    added = range(n0, len(plan.dur))
    assert len(added) == 6 * 4 * 4  # per block and chunk: first-leg all-to-all, regroup/combine work, GEMMs, return trip
    for j in added:
        d = plan.dep[j]
        if d >= n0:  # an added unit that waits for another added unit starts after it ends
            assert res.start[j] >= res.end[d] - 1e-6
    # every run unit of the re-cut blocks is at zero length: the step's token all-to-alls are the added ones
    a2a = L._a2a_units(prog.profile.work, model.measured["layout"].comm[0])
    assert all(plan.dur[int(j)] == 0.0 for j in a2a)


def test_overlap_off_against_the_measured_rows(model):
    # docs/performance.md: ep4_cap (overlap off) 101,386 (the call whose ep4_cap_ovl measured 102,013) and
    # ep4_cap_b30 101,849 (stop 24); the fixture's own row 102,247
    p = model.predict({"ep_overlap": False})
    for measured in (101_386, 101_849):
        assert p.tokens_per_s_per_gpu == pytest.approx(measured, rel=0.03)
    assert any("chunks 2 -> 1" in m for m in p.modeled)
    assert p.fits and p.peak_gib == pytest.approx(34.2, rel=0.05)


def test_four_chunks_against_the_measured_row(model):
    # ep4_cap_ovl4 (1.25, 4 chunks): 100,130 in the call where the fixture's row measured 102,247
    p = model.predict({"ep_overlap_chunks": 4})
    assert p.tokens_per_s_per_gpu == pytest.approx(100_130, rel=0.03)
    # not faster: no transfer left to hide. The added launches no longer slow it: with the launch calls that blocked
    # on a full queue out of its host gaps (replay._queue_waits) the fixture's replay is device-bound, and the re-cut
    # device work adds up to the same (the measured 1.8 % is a per-chunk device cost the mechanism does not model)
    assert p.tokens_per_s_per_gpu <= model.base_tokens_per_s_per_gpu * (1 + 1e-4)


def test_chunking_is_owned_by_one_mechanism():
    assert MECH.BY_NAME["overlap"].keys == ("ep_overlap", "ep_overlap_chunks")
    assert "ep_overlap" not in MECH.BY_NAME["layout"].keys


def test_the_pipelined_schedule_is_refused_in_one_line(tmp_path):
    """ep_overlap_schedule is refused with its reason (mechanisms/overlap_schedule.py: measured +0.6 %, below the
    model's uncertainty), and so is re-chunking a run of the pipelined schedule by this mechanism (which rebuilds
    the chunked schedule only)."""
    with pytest.raises(W.WhatIfError, match=r"^ep_overlap_schedule: the shared expert split around the chunk chain "
                                            r"is not replayed .*\+0\.6 %") as err:
        W.Model.from_run(CAP_OVL).predict({"ep_overlap_schedule": "pipelined"})
    assert "\n" not in str(err.value)
    run = tmp_path / "pipelined"
    run.mkdir()
    man = json.loads((CAP_OVL / "manifest.json").read_text())
    man["config"]["ep_overlap_schedule"] = "pipelined"
    (run / "manifest.json").write_text(json.dumps(man))
    (run / "traces").symlink_to(CAP_OVL / "traces")
    pipelined = W.Model.from_run(run)
    for change in ({"ep_overlap_chunks": 4}, {"ep_overlap": False}):  # overlap off: the mechanism's line, not the
        with pytest.raises(W.WhatIfError) as err:                    # trainer's "pipelined needs ep_overlap"
            pipelined.predict(change)
        assert str(err.value).startswith("ep_overlap / ep_overlap_chunks with ep_overlap_schedule=pipelined: the "
                                          "overlap mechanism rebuilds the chunked schedule only"), change
        assert "\n" not in str(err.value)
    # ep 1 has no chunks to schedule: the schedule goes back to its default with the other EP-only keys (it was a
    # config error, "'pipelined' schedules the chunks of ep_overlap, which is off"), and the layout is predicted
    p = pipelined.predict({"ep": 1})
    assert p.config["ep_overlap_schedule"] == "chunked" and p.config["ep"] == 1
    assert p.tokens_per_s_per_gpu > 0

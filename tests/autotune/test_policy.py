"""The guided policy (pure): which knob changes a trial's findings and signals lead to, in which order;
and the guided sweep's keep / revert / stop decisions, with a stand-in runner (no trainer)."""

from __future__ import annotations

import pytest

from autotune.policy import explore_moves, propose
from autotune.space import key_of, parse_space
from autotune.sweep import run_sweep

from ..conftest import MOE_LOOP
from ._fake import FakeRunner

KNOBS = {"sync_free_level": [0, 1, 2, 3], "grouped_gemm_backend": ["loop", "torch", "triton"], "manual_gc": [0, 5],
         "micro_batch_size": [1, 2, 4], "recompute_layer_ids": [[], [1], [0, 1]],
         "pipeline_schedule": ["1f1b", "zb1p"], "vpp": [1, 2], "microbatches": [4, 8], "pipeline_layout": ["a", "b"]}
CUR = {"sync_free_level": 1, "grouped_gemm_backend": "loop", "manual_gc": 0, "micro_batch_size": 2,
       "recompute_layer_ids": [], "pipeline_schedule": "1f1b", "vpp": 1, "microbatches": 4, "pipeline_layout": "a"}


def moves(findings=None, signals=None, metrics=None, knobs=KNOBS, cur=CUR):
    return [(m.knob, m.value, m.source) for m in propose(knobs, cur, findings, signals, metrics)]


def finding(kind, path="", severity="high"):
    return {"type": kind, "severity": severity, "title": f"{kind} title", "evidence": {"path": path, "count": 3}}


def test_host_sync_in_moe_raises_sync_free_level_nearest_first():
    assert moves([finding("host_sync", "layers.2/moe/permute")]) == [
        ("sync_free_level", 2, "host_sync"), ("sync_free_level", 3, "host_sync")]
    assert moves([finding("host_sync", "optimizer/clip_grad")]) == []  # not in the MoE path: no knob for it
    m = propose(KNOBS, CUR, [finding("host_sync", "layers.2/moe/permute")])[0]
    assert m.point == {**CUR, "sync_free_level": 2}
    assert m.motivation == "finding host_sync (high): host_sync title -> sync_free_level=2"


def test_findings_order_is_kept_and_moves_are_not_repeated():
    f = [finding("small_kernels"), finding("launch_bound"), finding("host_sync", "moe/experts")]
    assert moves(f) == [("grouped_gemm_backend", "torch", "small_kernels"), ("grouped_gemm_backend", "triton", "small_kernels"),
                        ("sync_free_level", 2, "launch_bound"), ("sync_free_level", 3, "launch_bound")]


def test_launch_bound_prefers_grouped_backends_and_never_proposes_a_per_expert_one():
    knobs = {"sync_free_level": [0, 1, 2], "grouped_gemm_backend": ["loop", "multistream", "torch", "triton"]}
    lb = [finding("launch_bound")]
    assert moves(lb, knobs=knobs, cur={"sync_free_level": 0, "grouped_gemm_backend": "loop"}) == [
        ("grouped_gemm_backend", "torch", "launch_bound"), ("grouped_gemm_backend", "triton", "launch_bound"),
        ("sync_free_level", 1, "launch_bound"), ("sync_free_level", 2, "launch_bound")]
    # already grouped: the sync-free levels first, then the other grouped backend; multistream/loop never
    assert moves(lb, knobs=knobs, cur={"sync_free_level": 0, "grouped_gemm_backend": "torch"}) == [
        ("sync_free_level", 1, "launch_bound"), ("sync_free_level", 2, "launch_bound"),
        ("grouped_gemm_backend", "triton", "launch_bound")]
    # many small kernels / many expert GEMMs per call: grouped first, the per-expert ones after
    assert moves([finding("small_kernels")], knobs=knobs, cur={"sync_free_level": 0, "grouped_gemm_backend": "multistream"}) == [
        ("grouped_gemm_backend", "torch", "small_kernels"), ("grouped_gemm_backend", "triton", "small_kernels"),
        ("grouped_gemm_backend", "loop", "small_kernels")]


def test_signals():
    assert moves(signals={"moe_sync_ops": 64}) == [("sync_free_level", 2, "moe_sync_ops"), ("sync_free_level", 3, "moe_sync_ops")]
    assert moves(signals={"moe_sync_ops": 0, "moe_host_syncs": 0}) == []
    assert moves(signals={"expert_gemms_per_call": 16}) == [
        ("grouped_gemm_backend", "torch", "expert_gemms_per_call"), ("grouped_gemm_backend", "triton", "expert_gemms_per_call")]
    assert moves(signals={"expert_gemms_per_call": 2}) == []  # a grouped GEMM: w13 + w2
    assert [m[1] for m in moves(signals={"expert_gemm_pct_roof": 33.0})] == ["torch", "triton"]
    assert moves(signals={"expert_gemm_pct_roof": 60.0}) == []
    # memory: near OOM -> recompute more layers and a smaller micro-batch; headroom -> a larger one
    assert moves(signals={"memory_used_share": 0.95}) == [
        ("recompute_layer_ids", [1], "memory_used_share"), ("recompute_layer_ids", [0, 1], "memory_used_share"),
        ("micro_batch_size", 1, "memory_used_share")]
    assert moves(signals={"memory_used_share": 0.30}) == [("micro_batch_size", 4, "memory_used_share")]
    assert moves(signals={"memory_used_share": 0.70}) == []
    # pipeline: measured bubble above theory * 1.1 + 0.02 (0.2 -> 0.24), stage imbalance above 1.10
    assert moves(signals={"bubble_ratio": 0.30, "bubble_theory": 0.20}) == [
        ("pipeline_schedule", "zb1p", "bubble_ratio"), ("vpp", 2, "bubble_ratio"), ("microbatches", 8, "bubble_ratio")]
    assert moves(signals={"bubble_ratio": 0.23, "bubble_theory": 0.20}) == []
    assert moves(signals={"stage_imbalance": 1.3}) == [("pipeline_layout", "b", "stage_imbalance")]
    assert moves(signals={"stage_imbalance": 1.05}) == []
    assert moves(metrics={"spread": 0.15}) == [("manual_gc", 5, "spread")]
    assert moves(metrics={"spread": 0.05, "noise": 0.3}) == []  # the standard error is not the spread
    # signals may come inside the metrics, as the store keeps them
    assert moves(metrics={"signals": {"stage_imbalance": 1.3}, "spread": 0}) == [("pipeline_layout", "b", "stage_imbalance")]


def test_knobs_outside_the_space_are_skipped():
    knobs = {"manual_gc": [0, 5]}
    cur = {"manual_gc": 0}
    assert moves([finding("host_sync", "moe/x"), finding("small_kernels")], {"memory_used_share": 0.99}, knobs=knobs, cur=cur) == []
    assert [(m.knob, m.value) for m in explore_moves({"a": [1, 2, 3], "b": ["x", "y"]}, {"a": 2, "b": "x"})] == [
        ("a", 1), ("a", 3), ("b", "y")]


def test_findings_table_and_real_analyzer_findings():
    """The H200 MoE trace with a per-expert loop: launch-bound (high) and small kernels (high) findings."""
    import tracelens
    from tracelens.analysis.findings import findings_table

    a = tracelens.analyze(tracelens.load(MOE_LOOP, cache=False, progress=False))
    f = a.findings()
    # (small_kernels claims the launch-bound idle before its ops, launch_bound the rest: disjoint amounts)
    assert [x["type"] for x in f[:2]] == ["small_kernels", "launch_bound"]
    knobs = {"sync_free_level": [0, 1, 2], "grouped_gemm_backend": ["loop", "torch"]}
    cur = {"sync_free_level": 0, "grouped_gemm_backend": "loop"}
    # small kernels of the per-expert loop: the grouped backend first; launch-bound: the sync-free levels
    expect = [("grouped_gemm_backend", "torch", "small_kernels"), ("sync_free_level", 1, "launch_bound"),
              ("sync_free_level", 2, "launch_bound")]
    assert moves(f, knobs=knobs, cur=cur) == expect
    assert moves(findings_table(f), knobs=knobs, cur=cur) == expect  # the table form (evidence as text)


def _k(lvl, backend, gc=0):
    return key_of({"sync_free_level": lvl, "grouped_gemm_backend": backend, "manual_gc": gc})


SYNC = {"type": "host_sync", "severity": "high", "title": "aten::to forces 8 syncs", "evidence": {"path": "moe/permute", "count": 8}}
LOOP = {"expert_gemms_per_call": 16}


def test_guided_keeps_reverts_and_stops():
    space = parse_space({"config": "tiny", "knobs": {"sync_free_level": [0, 1, 2], "grouped_gemm_backend": ["loop", "torch"],
                                                     "manual_gc": [0, 2]},
                         "guided": {"explore": 1}, "budget": {"trials": 10}}, check_trainer=False)
    table = {
        _k(0, "loop"): (100.0, [SYNC], LOOP, 0.0),
        _k(1, "loop"): (101.0, [SYNC], LOOP, 0.0),     # +1 %: inside the 2 % noise floor -> reverted
        _k(2, "loop"): (130.0, [], LOOP, 0.0),         # +30 % -> kept; no sync left
        _k(2, "torch"): (125.0, [], {}, 0.0),          # worse -> reverted
        _k(2, "loop", 2): (None, [], {}, 0.0),         # crash -> failed
    }
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        runner = FakeRunner(table)
        res = run_sweep(space, d, log=lambda m: None, runner=runner)
        got = [(key_of(p["knobs"]), p["decision"]) for p in res.path]
        assert got == [(_k(0, "loop"), "start"), (_k(1, "loop"), "reverted"), (_k(2, "loop"), "kept"),
                       (_k(2, "torch"), "reverted"), (_k(2, "loop", 2), "failed")]
        # after the findings, one neighbour check (explore: 1): sfl 0/1 and torch were tried, so manual_gc=2
        assert res.path[4]["motivation"] == "no finding left: check manual_gc -> manual_gc=2"
        assert res.path[1]["motivation"].startswith("finding host_sync (high): aten::to forces 8 syncs")
        assert res.path[3]["motivation"].startswith("signal: 16 GEMMs per moe/experts call")
        assert res.path[3]["parent"] == res.path[2]["trial"]
        assert res.stopped == "no finding or neighbour left"
        assert res.best["knobs"] == {"sync_free_level": 2, "grouped_gemm_backend": "loop", "manual_gc": 0}
        assert res.best["objective"] == 130.0 and res.baseline["objective"] == 100.0


@pytest.mark.parametrize("se_base, se_new, z, decision", [
    (0.0, 0.0, 2, "kept"),        # +5 % over the 2 % floor
    (0.0, 0.02, 2, "kept"),       # 2 standard errors = 4 % < 5 %
    (0.0, 0.03, 2, "reverted"),   # 6 % > 5 %
    (0.01, 0.02, 2, "kept"),      # 2 * sqrt(0.01^2 + 0.02^2) = 4.5 %
    (0.02, 0.02, 2, "reverted"),  # 2 * sqrt(2) * 2 % = 5.7 %
    (0.02, 0.02, 1, "kept"),      # z = 1: 2.8 %
])
def test_a_gain_must_beat_the_noise(tmp_path, se_base, se_new, z, decision):
    """+5 %: kept when it beats both the 2 % floor and z standard errors of the difference."""
    space = parse_space({"config": "tiny", "knobs": {"sync_free_level": [0, 1]}, "guided": {"noise_z": z}},
                        check_trainer=False)
    table = {key_of({"sync_free_level": 0}): (100.0, [SYNC], {}, se_base),
             key_of({"sync_free_level": 1}): (105.0, [], {}, se_new)}
    res = run_sweep(space, tmp_path, log=lambda m: None, runner=FakeRunner(table))
    assert [p["decision"] for p in res.path] == ["start", decision]
    # the search's answer is its incumbent; a reverted trial that measured higher is only the "top"
    assert res.top["objective"] == 105.0
    assert res.best["objective"] == (105.0 if decision == "kept" else 100.0)


def test_minimized_objective_and_budget(tmp_path):
    space = parse_space({"config": "tiny", "knobs": {"sync_free_level": [0, 1, 2, 3]}, "objective": "step_time",
                         "budget": {"trials": 2}}, check_trainer=False)
    table = {key_of({"sync_free_level": i}): (1.0 - 0.2 * i, [SYNC], {}, 0.0) for i in range(4)}
    res = run_sweep(space, tmp_path, log=lambda m: None, runner=FakeRunner(table))
    assert [p["decision"] for p in res.path] == ["start", "kept"] and res.stopped == "budget spent"
    assert res.best["objective"] == pytest.approx(0.8)


def test_failed_baseline_stops(tmp_path):
    space = parse_space({"config": "tiny", "knobs": {"sync_free_level": [0, 1]}}, check_trainer=False)
    res = run_sweep(space, tmp_path, log=lambda m: None, runner=FakeRunner({}, default=(None, [], {}, 0.0)))
    assert res.stopped.startswith("baseline failed (crash: exit 1: boom)") and len(res.trials) == 1 and res.best is None


def test_sweep_report_names_the_incumbent_and_the_higher_reverted_trial(tmp_path):
    """A reverted trial that measured higher (within noise) is shown as "highest measured", while the
    report's best (and best.yaml) is the search's incumbent."""
    from reports import sweep as sweep_report

    space = parse_space({"config": "tiny", "knobs": {"sync_free_level": [0, 1]}}, check_trainer=False)
    table = {key_of({"sync_free_level": 0}): (100.0, [SYNC], {}, 0.02),
             key_of({"sync_free_level": 1}): (105.0, [], {}, 0.02)}  # +5 % < 2 * sqrt(2) * 2 %: reverted
    res = run_sweep(space, tmp_path, log=lambda m: None, runner=FakeRunner(table))
    html = sweep_report.render(res, space, diff_error="no traces")
    assert res.best["id"] == 1 and res.top["id"] == 2
    assert "trial 1: tokens_per_s_per_gpu = 100" in html
    assert 'id="top-note">trial 2: 105, reverted' in html
    assert "sync_free_level: 0" in sweep_report.best_yaml(space, res.best)


EP_KNOBS = {"ep": [1, 4], "ep_dispatch": ["nccl", "capacity"], "ep_overlap": [False, True], "ep_overlap_chunks": [2, 4]}
EP_CUR = {"ep": 4, "ep_dispatch": "nccl", "ep_overlap": False, "ep_overlap_chunks": 2}


def test_exposed_comm_under_ep_asks_for_the_capacity_path_and_the_overlap():
    ex = [finding("exposed_comm")]
    assert moves(ex, knobs=EP_KNOBS, cur=EP_CUR) == [("ep_dispatch", "capacity", "exposed_comm"),
                                                    ("ep_overlap", True, "exposed_comm")]
    # the overlap already on: more chunks; at ep=1 no token travels, so no EP move at all
    assert moves(ex, knobs=EP_KNOBS, cur={**EP_CUR, "ep_dispatch": "capacity", "ep_overlap": True}) == [
        ("ep_overlap_chunks", 4, "exposed_comm")]
    # with the schedule in the space: the pipelined schedule after the chunks
    sched = {**EP_KNOBS, "ep_overlap_schedule": ["chunked", "pipelined"]}
    assert moves(ex, knobs=sched, cur={**EP_CUR, "ep_dispatch": "capacity", "ep_overlap": True,
                                       "ep_overlap_schedule": "chunked"}) == [
        ("ep_overlap_chunks", 4, "exposed_comm"), ("ep_overlap_schedule", "pipelined", "exposed_comm")]
    assert moves(ex, knobs=EP_KNOBS, cur={**EP_CUR, "ep": 1}) == []
    # a space without the EP knobs: nothing to move for it
    assert moves(ex) == []


def test_the_ep_space_is_steered_by_the_rules_when_the_model_cannot_build(tmp_path):
    """autotune/spaces/gpu_ep4.yaml where the what-if model cannot be built (the fake trials leave no run dir):
    the guided search says why it falls back, follows the exposed_comm rule from EP 4 on the all-to-all, then
    explores the neighbours it may (ep=1 only with the dispatch defaults; symm never with the overlap, the
    constraints say)."""
    from pathlib import Path

    from autotune.space import load_space

    space = load_space(Path(__file__).resolve().parents[2] / "autotune" / "spaces" / "gpu_ep4.yaml")
    base = dict(space.baseline)
    assert base == {"ep": 4, "ep_dispatch": "nccl", "ep_capacity_factor": 1.25, "ep_overlap": False,
                    "ep_overlap_chunks": 2, "ep_overlap_schedule": "chunked"}
    comm = {"type": "exposed_comm", "severity": "high", "title": "40 ms per rank of communication not hidden",
            "evidence": {"per_rank": {0: 40000.0}}}
    cap = {**base, "ep_dispatch": "capacity"}
    ovl = {**cap, "ep_overlap": True}
    table = {key_of(base): (100.0, [comm], {}, 0.0), key_of(cap): (150.0, [comm], {}, 0.0),
             key_of(ovl): (170.0, [comm], {}, 0.0), key_of({**ovl, "ep_overlap_chunks": 4}): (168.0, [], {}, 0.0)}
    logs: list[str] = []
    res = run_sweep(space, tmp_path, log=logs.append, runner=FakeRunner(table, default=(90.0, [], {}, 0.0)))
    assert any(line.startswith("[autotune] what-if model unavailable (WhatIfError: ") and "not a run dir with a "
               "manifest.json" in line and line.endswith("steering by the rules") for line in logs), logs
    got = [(p["knobs"], p["decision"], p["motivation"].split(" -> ")[-1]) for p in res.path]
    symm = {**base, "ep_dispatch": "symm"}  # the rule raises the path along the space's list: capacity, then symm
    assert got[:5] == [(base, "start", "baseline"), (cap, "kept", "ep_dispatch=capacity"),
                       (symm, "reverted", "ep_dispatch=symm"), (ovl, "kept", "ep_overlap=True"),
                       ({**ovl, "ep_overlap_chunks": 4}, "reverted", "ep_overlap_chunks=4")]
    assert res.path[1]["motivation"].startswith("finding exposed_comm (high): 40 ms per rank")
    # the rule's last move with the overlap on (the pipelined schedule; the fake trial is slower: reverted), then
    # the neighbours of the incumbent the constraints allow (ep=1 needs the defaults: not one knob away)
    assert (res.path[5]["knobs"], res.path[5]["decision"]) == ({**ovl, "ep_overlap_schedule": "pipelined"}, "reverted")
    assert [p["motivation"].split(" -> ")[-1] for p in res.path[5:]] == [
        "ep_overlap_schedule=pipelined", "ep_dispatch=nccl", "ep_capacity_factor=1.1"]
    assert all(space.allowed(p["knobs"]) for p in res.path)
    assert res.best["knobs"] == ovl and res.stopped == "no finding or neighbour left"

"""The verdict (tracelens.analysis.verdict) on small tables: the step bar, the bottleneck, the candidate
changes, the ranking of actions and the commands. Expected values are computed here from the inputs."""

from __future__ import annotations

import re
import shlex

import pandas as pd
import pytest

from tracelens.analysis import verdict as V


def _decomp(rows: dict[int, dict[str, float]], basis: str = "calibrated", labels: dict[str, str] | None = None):
    recs = []
    for rank, comps in rows.items():
        total = sum(comps.values())
        for c, ms in comps.items():
            recs.append({"rank": rank, "component": c, "ms": ms, "share": ms / total,
                         "scales_with": (labels or {}).get(c, "tokens"), "scale_share": 1.0, "scale_basis": "units",
                         "step": 5, "basis": basis})
    df = pd.DataFrame(recs)
    df.attrs["basis"] = basis
    return df


def _finding(type_, title, recoverable_us=None, share=0.0, severity="high", **evidence):
    return {"type": type_, "title": title, "severity": severity, "recoverable_us": recoverable_us,
            "share_of_span": share, "ranks": [0, 1], "evidence": evidence}


def test_the_decomposition_names_every_component_the_verdict_classifies():
    from tracelens.projection.profile import COMPONENTS

    assert set(V.KIND) == set(COMPONENTS)
    assert {c for comps, _, _ in V.LOSSES.values() for c in comps} <= set(COMPONENTS)


def test_step_is_the_mean_over_ranks_of_each_component():
    rows = {0: {"dense GEMMs": 30.0, "pipeline bubble": 60.0, "other": 10.0},
            1: {"dense GEMMs": 50.0, "pipeline bubble": 20.0, "other": 30.0}}
    step = V.step_of(_decomp(rows))
    mean = {c: (rows[0][c] + rows[1][c]) / 2 for c in rows[0]}
    total = sum(mean.values())
    assert step.ranks == 2 and step.basis == "calibrated"
    assert step.step_us == pytest.approx(1e3 * total)
    for c, v in mean.items():
        assert step.part(c).us == pytest.approx(1e3 * v)
        assert step.part(c).share == pytest.approx(v / total)
    assert step.part("pipeline bubble").kind == "bubble" and step.part("dense GEMMs").kind == "compute"


def test_step_falls_back_to_the_gpu_timeline():
    tl = pd.DataFrame({"rank": [0, 1], "span_us": [100.0, 100.0], "compute_us": [60.0, 40.0],
                       "exposed_comm_us": [10.0, 30.0], "comm_wait_us": [0.0, 10.0], "pipeline_wait_us": [0.0, 0.0],
                       "excl_memcpy_us": [0.0, 0.0], "excl_memset_us": [0.0, 0.0], "gpu_idle_us": [30.0, 20.0]})
    step = V.step_of(None, tl)
    assert step.basis == "timeline"
    total = 50.0 + 20.0 + 5.0 + 25.0
    assert step.step_us == pytest.approx(total)
    assert step.part("compute").share == pytest.approx(50.0 / total)
    assert step.part("pipeline bubble") is None  # no part of zero time
    assert V.step_of(None, None) is None


def test_bottleneck_is_the_largest_loss_with_the_finding_that_explains_it():
    rows = {0: {"dense GEMMs": 30.0, "pipeline bubble": 45.0, "attention": 25.0}}
    step = V.step_of(_decomp(rows, basis="replay"))
    bub = _finding("pipeline_bubble", "pipeline bubble 45.000 ms per rank per step: schedule 20.000 ms; stage 3 slow")
    text, part = V.bottleneck(step, [_finding("launch_bound", "GPU idle"), bub])
    assert part == "pipeline bubble"
    assert f"{100 * 45 / 100:.0f}% of the 100.0 ms step" in text
    # the finding's first clause, as measured (a replayed step: no "profiled step" qualifier)
    assert text.endswith("; pipeline bubble 45.000 ms per rank per step: schedule 20.000 ms.")


def test_host_losses_add_up_and_compute_bound_names_the_component():
    host = V.step_of(_decomp({0: {"dense GEMMs": 30.0, "launch-bound idle": 20.0, "sync waits": 15.0, "other": 35.0}}))
    text, part = V.bottleneck(host, [])
    assert part == "host" and "35% of the 100.0 ms step" in text  # 20 + 15 > 30
    comp = V.step_of(_decomp({0: {"attention": 40.0, "dense GEMMs": 35.0, "launch-bound idle": 25.0}}))
    text, part = V.bottleneck(comp, [])
    assert part == "attention"
    assert text.startswith("Compute-bound: the attention takes 40% of the 100.0 ms step (all computation 75%)")


def test_without_a_decomposition_idle_is_a_loss_not_compute_bound():
    # the GPU timeline's bar (no profiled step): 74 of 100 us idle, 25 compute, 1 memcpy
    tl = pd.DataFrame({"rank": [0], "span_us": [100.0], "compute_us": [25.0], "exposed_comm_us": [0.0],
                       "comm_wait_us": [0.0], "pipeline_wait_us": [0.0], "excl_memcpy_us": [1.0],
                       "excl_memset_us": [0.0], "gpu_idle_us": [74.0]})
    step = V.step_of(None, tl)
    launch = _finding("launch_bound", "GPU idle 60.000 ms per rank waiting for kernel launches; most before aten::mm")
    text, part = V.bottleneck(step, [_finding("exposed_comm", "comm not hidden"), launch])
    assert part == "idle"
    assert text.startswith("The step loses the most to the GPU sitting idle")
    assert "74% of the 0.100 ms step" in text
    assert text.endswith("; GPU idle 60.000 ms per rank waiting for kernel launches.")
    # compute larger than idle stays compute-bound; a decomposition has no "idle" part to name
    busy = V.step_of(None, tl.assign(compute_us=[80.0], gpu_idle_us=[19.0]))
    assert V.bottleneck(busy, [])[0].startswith("Compute-bound: the compute takes 80% of the 0.100 ms step")
    dec = V.step_of(_decomp({0: {"dense GEMMs": 40.0, "other": 60.0}}))
    assert V.bottleneck(dec, [])[1] == "dense GEMMs"


def test_candidates_follow_the_findings_and_the_config():
    cfg = {"micro_batch_size": 4, "grouped_gemm_backend": "loop", "sync_free_level": 1, "ep": 4, "pp": 1,
           "ep_overlap": False, "ep_dispatch": "nccl", "step_timing": "sync", "expert_swiglu": "triton",
           "optimizer": "adamw", "recompute_layer_ids": [1], "device": "cuda"}
    dec = _decomp({0: {"optimizer step": 10.0, "expert GEMMs": 30.0, "other": 60.0}},
                  labels={"optimizer step": "params", "other": "fixed"})
    step = V.step_of(dec)
    findings = [_finding("host_sync", "x forces 3 syncs", 10.0, call="cudaStreamSynchronize"),
                _finding("exposed_comm", "comm not hidden", 5.0)]
    ctx = V.Context(cfg, world=4, run="runs/r")
    got = [(c.changes, c.motive) for c in V.candidates(findings, step, ctx)]
    assert got == [({"sync_free_level": 2}, "host_sync"), ({"sync_free_level": 3}, "host_sync"),
                   ({"ep_overlap": True}, "exposed_comm"), ({"ep_dispatch": "capacity"}, "exposed_comm"),
                   ({"optimizer": "adamw_fused"}, "optimizer step"),  # 10% of the step
                   ({"grouped_gemm_backend": "torch"}, "expert GEMMs"),
                   ({"micro_batch_size": 8}, "micro-batch"), ({"micro_batch_size": 16}, "micro-batch"),
                   ({"recompute_layer_ids": []}, "recompute")]
    mb = next(c for c in V.candidates(findings, step, ctx, decomposition=dec) if c.motive == "micro-batch")
    assert mb.evidence.startswith("70% of the step does not grow with the tokens")  # optimizer 10 + other 60
    assert mb.current == {"micro_batch_size": 4} and mb.label() == "micro_batch_size 4 -> 8"
    # a trace without a trainer config: nothing to predict
    assert V.candidates(findings, step, V.Context(None)) == []


def test_a_knob_the_runs_config_lacks_reads_as_the_trainers_default_not_null():
    """A run from before a knob existed (h200_ep2_run's manifests have no ep_overlap or ep_dispatch): the change
    starts from the trainer's default, as the what-if reads it, never from "null" (the report once said
    "ep_overlap null -> true")."""
    from moespec.config import DEFAULTS

    cfg = {"micro_batch_size": 1, "sync_free_level": 3, "ep": 2, "pp": 1, "device": "cuda"}
    got = V.candidates([_finding("exposed_comm", "comm not hidden", 5.0)], None, V.Context(cfg, world=2, run="runs/r"))
    labels = [c.label() for c in got if c.motive == "exposed_comm"]
    assert labels == [f"ep_overlap {V._yaml(DEFAULTS['ep_overlap'])} -> true",
                      f"ep_dispatch {DEFAULTS['ep_dispatch']} -> capacity"]
    assert not [c for c in got if "null" in c.label()]

def _outcome(gain, fits=True, unc=0.1, peak=20.0, cap=80.0):
    return {"gain": gain, "uncertainty": unc, "fits": fits, "peak_gib": peak, "capacity_gib": cap}


def test_actions_rank_predicted_gains_then_fill_with_findings():
    cfg = {"micro_batch_size": 4, "sync_free_level": 0, "optimizer": "adamw"}
    mk = lambda ch, motive: V.Candidate(ch, motive, f"{motive} evidence", {k: cfg.get(k) for k in ch})
    cands = [mk({"sync_free_level": 1}, "host_sync"), mk({"sync_free_level": 3}, "host_sync"),
             mk({"optimizer": "adamw_fused"}, "optimizer step"), mk({"micro_batch_size": 8}, "micro-batch"),
             mk({"micro_batch_size": 16}, "micro-batch")]
    outcomes = {cands[0].key: _outcome(0.05), cands[1].key: _outcome(0.20),
                cands[2].key: _outcome(0.004),  # under 1%: no action
                cands[3].key: _outcome(0.30), cands[4].key: _outcome(0.70, fits=False, peak=120.0)}
    findings = [_finding("host_sync", "aten::item forces 2 syncs", 300.0, 0.03, op="aten::item",
                         call="cudaStreamSynchronize"),
                _finding("late_rank", "rank 1 is last into all_reduce (3)", 2000.0, 0.2, late_rank=1,
                         families=["all_reduce"], cause="compute: GEMM"),
                _finding("sync_wait", "ranks wait in all_reduce", 2000.0, 0.2, family="all_reduce", straggler_rank=1)]
    ctx = V.Context(cfg, world=2, run="runs/r", argv=("trainer/launch.py", "--config", "tiny", "-o", "runs/r"))
    v = V.verdict(findings, None, None, cands, outcomes, ctx)
    assert [a.changes for a in v.actions[:2]] == [{"micro_batch_size": 8}, {"sync_free_level": 3}]  # by gain; OOM out
    assert v.actions[0].gain == "+30% ± 10%" and v.actions[0].memory == "fits in 20.0 GiB of 80.0 GiB"
    assert v.actions[0].commands == [
        "tracelens whatif runs/r --set micro_batch_size=8",
        "python -m trainer.launch --config tiny --nproc 2 --set micro_batch_size=8 -o runs/r-micro_batch_size8"]
    # the third: the first finding without a predicted action (sync_wait is the late rank's waiting: left out)
    third = v.actions[2]
    assert third.changes is None and third.source == "late_rank" and third.title.startswith("Even out the work before rank 1")
    assert third.estimate == "up to 2.000 ms per rank (20% of the step)"
    assert third.no_prediction == "the what-if has no mechanism for this fix"
    assert len(v.actions) == V.N_ACTIONS
    joined = " | ".join(v.considered)
    assert "sync_free_level 0 -> 1: +5.0% ± 10%" in joined and "OUT OF MEMORY: 120.0 GiB of 80.0 GiB" in joined
    assert "optimizer adamw -> adamw_fused: +0.4%" in joined
    text = v.to_text()
    assert "  1. micro_batch_size 4 -> 8: +30% ± 10% tokens/s/GPU, fits in 20.0 GiB of 80.0 GiB" in text
    assert "     gain: up to 2.000 ms per rank (20% of the step) by the finding's estimate" in text


def test_without_a_model_every_action_is_a_finding_with_its_estimate_and_one_reason():
    findings = [_finding("exposed_comm", "1.466 ms per rank of communication not hidden", 1466.0, 0.145,
                         per_rank={0: 1437.0, 1: 1495.0}),
                _finding("host_sync", "aten::to forces 8 syncs", 790.0, 0.078, op="aten::to", call="cudaStreamSynchronize",
                         via="aten::copy_", count=8, host_blocked_us=13959.0, gpu_idle_caused_us=1580.0, path="ep_dispatch")]
    ctx = V.context_of(None, None)
    v = V.verdict(findings, None, None, [], {}, ctx)
    assert [a.source for a in v.actions] == ["exposed_comm", "host_sync"]
    assert v.actions[1].estimate == f"up to {790.0 / 1e3:.3f} ms per rank ({100 * 0.078:.1f}% of the step)"
    assert all(a.no_prediction == "" for a in v.actions)  # the run's reason is said once
    assert v.model.startswith("no predictions: these traces have no run manifest")
    assert v.actions[1].evidence == ("aten::to forces 8 syncs. In ep_dispatch, over the analysed steps the host waited "
                                     "13.96 ms in these syncs and the GPU then sat idle 1.580 ms (all ranks): 0.790 ms per rank.")


def test_trainer_command_replaces_the_changed_keys_and_the_run_dir():
    argv = ["/x/trainer/__main__.py", "--config", "gpu_proxy", "--set", "ep=4", "--set", "micro_batch_size=1",
            "--sync-free-level", "0", "--grouped-gemm-backend=loop", "-o", "/tmp/runs/a"]
    cmd = V.trainer_command(argv, 4, "runs/a", {"sync_free_level": 3, "grouped_gemm_backend": "torch"})
    assert shlex.split(cmd) == ["python", "-m", "trainer.launch", "--config", "gpu_proxy", "--nproc", "4",
                                "--set", "ep=4", "--set", "micro_batch_size=1", "--set", "sync_free_level=3",
                                "--set", "grouped_gemm_backend=torch", "-o",
                                "runs/a-sync_free_level3-grouped_gemm_backendtorch"]
    lst = V.trainer_command(["t.py", "--config", "tiny"], 1, "r", {"recompute_layer_ids": [1, 2]})
    assert shlex.split(lst)[-4:] == ["--set", "recompute_layer_ids=[1, 2]", "-o", "r-recompute_layer_ids12"]
    assert V.trainer_command(None, 1, "r", {"x": 1}) is None
    assert V.trainer_command(["t.py", "--set", "a=1"], 1, "r", {"x": 1}) is None  # no --config: not known


def test_health_lines_merge_ranks_and_keep_only_errors_and_warnings():
    h = pd.DataFrame([
        {"check": "unlinked_kernels", "severity": "warning", "ranks": [0], "found": "rank 0: 839 events", "invalidates": "ops"},
        {"check": "unlinked_kernels", "severity": "warning", "ranks": [2], "found": "rank 2: 840 events", "invalidates": "ops"},
        {"check": "with_stack", "severity": "info", "ranks": [0], "found": "no stacks", "invalidates": "sources"},
        {"check": "missing_ranks", "severity": "error", "ranks": [1], "found": "1 of 2 loaded", "invalidates": "comm"}])
    assert V.health_lines(h) == [
        {"severity": "error", "check": "missing_ranks", "ranks": [1], "text": "1 of 2 loaded", "invalidates": "comm"},
        {"severity": "warning", "check": "unlinked_kernels", "ranks": [0, 2], "text": "rank 0: 839 events (and 1 more like it)",
         "invalidates": "ops"}]


def test_numbers_in_words():
    assert [V.ms(x) for x in (2045.31, 148396.1, 1417215.3, 320478.0)] == ["2.045 ms", "148.4 ms", "1,417 ms", "320.5 ms"]
    assert [V.pct(x) for x in (0.1878, 0.0755, 0.003)] == ["19%", "7.5%", "0.3%"]
    assert V.pct(0.58, signed=True) == "+58%" and V.pct(-0.018, signed=True) == "-1.8%"
    assert V.gib(53.04) == "53.0 GiB" and V.gib(0.02) == "20 MiB"


@pytest.mark.parametrize("fixture", ["h200_nccl_2rank", "h200_pp2_run/1f1b", "cpu_tiny/rank0.json.gz"])
def test_real_findings_read_as_sentences_not_dumps(fixture):
    import tracelens

    from ..conftest import FIXTURES

    a = tracelens.analyze(tracelens.load(FIXTURES / fixture, cache=False))
    fs = a.findings()
    assert fs
    for f in fs:
        s = V.finding_sentence(f)
        assert not re.search(r"\b\w+=\S", s), s  # no key=value
        assert "{" not in s and "[" not in s, s  # no dict or list dumped


def test_a_change_that_rounds_to_zero_reads_plus_zero_not_minus_zero():
    from tracelens.projection.decomposition import _pct

    assert [V.pct(x, signed=True) for x in (-1e-5, -0.0004, 0.0, 0.071, -0.071, 0.58)] == \
        ["+0.0%", "+0.0%", "+0.0%", "+7.1%", "-7.1%", "+58%"]
    assert V.pct(-1e-5) == "0.0%" and V.pct(0.19) == "19%"
    assert _pct(13336.315, 13336.316) == "+0.0 %" and _pct(110.0, 100.0) == "+10.0 %"

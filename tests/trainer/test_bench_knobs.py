"""benchmarks/bench_trainer_knobs.py: its loss comparison and table (the GPU runs themselves are the lead's;
``--cpu`` runs it end to end on the tiny config in about a minute, too slow for CI), and its expert-parallel rows:
judged per section, the dropped-row share, one-line refusals, and (slow: 2 gloo processes, 1.5-2 minutes) the EP
rows end to end on a CPU with the loss check and, from the same runs, their trace diffs."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests._benchmarks import load_benchmark

REPO = Path(__file__).resolve().parents[2]


def _bench():
    return load_benchmark("bench_trainer_knobs")


def test_loss_diff_is_the_largest_relative_step_difference():
    b = _bench()
    assert b.loss_diff([10.0, 8.0, 4.0], [10.0, 8.4, 4.1]) == pytest.approx(0.05)  # 0.4 / 8 > 0.1 / 4
    assert b.loss_diff([10.0, 8.0], [10.0, 8.0, 7.0]) == 0.0  # the common steps
    assert b.loss_diff([10.0], [math.nan]) == math.inf
    assert b.loss_diff([], [1.0]) is None


def test_knob_rows_are_cumulative_and_trainer_keys():
    from moespec.config import load_config

    b = _bench()
    assert [n for n, _ in b.KNOBS] == ["baseline", "+ optimizer", "+ step_timing", "+ compile", "+ triton_kernels",
                                       "+ expert_swiglu", "+ micro_batch_24", "+ cuda_graphs"]
    acc = {}
    for _, knob in b.KNOBS:
        acc.update(knob)
    # the last row is a valid trainer config on a GPU machine (device checked at run time)
    cfg = load_config(b.GPU_BASE["config"], {**b.GPU_BASE["set"], **acc, "device": "auto"})
    assert (cfg["optimizer"], cfg["step_timing"], cfg["compile"], cfg["cuda_graphs"], cfg["micro_batch_size"],
            cfg["sync_free_level"], cfg["grouped_gemm_backend"], cfg["expert_swiglu"], cfg["use_triton_kernels"]) == \
        ("adamw_fused", "events", "dense", "on", 24, 3, "torch", "triton", True)


def test_table_shows_gain_loss_check_and_refusals():
    b = _bench()
    rows = [
        {"name": "baseline", "adds": {}, "tokens_per_s_per_gpu": 100.0, "mfu": 0.10, "step_ms": 10.0, "peak_gib": 1.0,
         "loss": [5.0], "run_dir": "r0", "rc": 0},
        {"name": "+ compile", "adds": {"compile": "dense"}, "tokens_per_s_per_gpu": 125.0, "mfu": 0.125,
         "step_ms": 8.0, "peak_gib": 1.1, "loss": [5.0], "run_dir": "r1", "rc": 0, "loss_rel_diff": 0.002,
         "loss_ok": True, "loss_check": {"ok": True, "agreed_steps": 12, "early_rel_diff": 0.002, "early_ok": True,
                                         "late_steps": 10, "late_mean": 4.9, "eager_late_mean": 5.0,
                                         "late_bound": 0.05, "late_ok": False, "finite": True}},
        {"name": "+ cuda_graphs", "adds": {"cuda_graphs": "on"}, "rc": 2, "run_dir": "r2",
         "error": "config error: cuda_graphs: on needs CUDA (device=cpu): CUDA graphs do not exist on a CPU"},
    ]
    md = b.table(rows, 0.01, "## t")
    assert ("| + compile | `compile=dense` | 125 | 12.5 % | 8.0 | +25.0 % | 1.10 | first 12 steps 2.00e-03 (ok); "
            "last 10 mean 4.900 vs 5.000 +/- 0.050 (OUT) | `r1` |") in md
    assert "| + cuda_graphs | `cuda_graphs=on` | refused (exit 2): config error: cuda_graphs: on needs CUDA" in md


def test_without_cuda_it_says_so(capsys):
    """In this process (the script's main(); its command line's exit statuses are run by the tests below)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert _bench().main([]) == 1
    err = capsys.readouterr().err
    assert "no CUDA device visible" in err and "--cpu" in err


def _curve(n, drift_from, amp, seed):
    """A loss curve 11 - 0.01 step whose steps from ``drift_from`` on carry a deterministic wobble of size
    ``amp`` that differs by ``seed`` (the runs agree exactly before it)."""
    return [11.0 - 0.01 * i + (amp * math.sin(1.7 * i + seed) if i >= drift_from else 0.0) for i in range(n)]


def test_agreed_steps_stop_where_the_eager_runs_drift_apart():
    b = _bench()
    eager = [_curve(50, 13, 0.2, s) for s in (0, 1, 2)]
    assert b.agreed_steps(eager, 1e-2) == 13           # identical before step 13, 0.2 / 10.9 > 1e-3 at it
    assert b.agreed_steps(eager[:1], 1e-2) == 50       # one run: every step
    assert b.agreed_steps([[1.0, math.nan], [1.0, 1.0]], 1e-2) == 1


def test_judge_loss_numerics_on_agreed_steps_and_training_by_prediction_interval():
    b = _bench()
    eager = [_curve(50, 13, 0.2, s) for s in (0, 1, 2)]
    # a run that drifts like eager does after step 13: ok, though per step it is far from each eager run
    same = _curve(50, 13, 0.2, 3)
    j = b.judge_loss(eager, same, 1e-2)
    assert j["ok"] and j["agreed_steps"] == 13 and j["early_rel_diff"] < 1e-12
    assert b.loss_diff(eager[0], same) > 1e-2
    # the last-10 means of the eager runs and the interval, computed here from the curves
    means = [sum(e[-10:]) / 10 for e in eager]
    m = sum(means) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in means) / 2)
    assert j["eager_late_mean"] == pytest.approx(m)
    assert j["late_bound"] == pytest.approx(max(9.925 * sd * math.sqrt(1 + 1 / 3), 1e-2 * m))
    # 2 % off from step 1 on: the numerics part catches it
    off = [v * (1.02 if i else 1.0) for i, v in enumerate(same)]
    j = b.judge_loss(eager, off, 1e-2)
    assert not j["ok"] and not j["early_ok"] and j["early_rel_diff"] == pytest.approx(0.02, rel=1e-6)
    # right for the agreed steps, then trains away by 3 (a divergence): the training part catches it
    away = [v - (3.0 if i >= 30 else 0.0) for i, v in enumerate(same)]
    j = b.judge_loss(eager, away, 1e-2)
    assert j["early_ok"] and not j["late_ok"] and not j["ok"]
    # a non-finite loss fails
    assert not b.judge_loss(eager, same[:40] + [math.nan] * 10, 1e-2)["ok"]
    assert not b.judge_loss([], same, 1e-2)["ok"] and not b.judge_loss(eager, [], 1e-2)["ok"]


KNOB_ROWS = ("+ optimizer", "+ step_timing", "+ compile", "+ triton_kernels", "+ expert_swiglu", "+ cuda_graphs")


@pytest.mark.parametrize("which", ["first", "second"])
def test_judge_rows_on_the_h100_runs_passes_every_knob_and_eager_run_and_fails_the_control(which):
    """The stop-18 H100 loss checks (benchmarks/results/knobs_s18): three eager runs, every knob row and the
    control (learning rate x1.25), twice. The first ran before the control and the third eager run were rows
    of the script (they are separate manifests there); the second is the script's own output."""
    b = _bench()
    res = REPO / "benchmarks" / "results" / "knobs_s18"
    if which == "first":
        rows = json.loads((res / "check_loss.json").read_text())["rows"]
        rows.insert(2, {"name": "baseline (run 3)", "loss": json.loads((res / "eager3.json").read_text())["metrics"]["loss"]})
        rows.append({"name": "control: lr x1.25", "loss": json.loads((res / "lr125.json").read_text())["metrics"]["loss"]})
    else:
        rows = json.loads((res / "check_loss_v2" / "check_loss.json").read_text())["rows"]
    by = {r["name"]: r for r in rows}
    eager = [r["loss"] for r in rows if r["name"].startswith("baseline")]
    assert len(eager) == 3 and b.loss_diff(eager[0], eager[1]) > 1.5e-2  # per step, eager fails against itself
    b.judge_rows(rows, 1e-2)
    window = by["+ optimizer"]["loss_check"]["agreed_steps"]
    assert 10 <= window <= 20
    # the window, recomputed here: the leading steps on which all three eager runs lie within 1e-3 of their mean
    k = 0
    while k < 50 and (max(e[k] for e in eager) - min(e[k] for e in eager)) / (sum(e[k] for e in eager) / 3) <= 1e-3:
        k += 1
    assert window == k
    for r in rows:
        if r["name"].startswith("baseline") or r["name"] in KNOB_ROWS:
            assert r["loss_ok"] and r["loss_check"]["agreed_steps"] == window, r["name"]
            assert r["loss_rel_diff"] < 3e-3, r["name"]
    control = by["control: lr x1.25"]
    assert not control["loss_ok"] and not control["loss_check"]["early_ok"] and control["loss_rel_diff"] > 2e-2


def test_check_loss_needs_two_eager_runs():
    r = subprocess.run([sys.executable, "benchmarks/bench_trainer_knobs.py", "--check-loss", "--eager-runs", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "at least 2 with --check-loss" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------------- expert-parallel rows
def test_ep_rows_are_cumulative_from_data_parallelism_and_valid_on_the_world():
    from moespec.config import load_config, resolve_world

    b = _bench()
    rows = b.section_rows("ep", 4, False, 3, b.EP_GPU_BASE)
    assert rows == [("baseline ep=1", {"ep": 1}), ("+ ep", {"ep": 4}), ("+ ep_dispatch", {"ep_dispatch": "capacity"}),
                    ("+ ep_overlap", {"ep_overlap": True}), ("+ ep_overlap_chunks", {"ep_overlap_chunks": 4}),
                    ("+ ep_overlap_schedule", {"ep_overlap_schedule": "pipelined"})]
    acc = {}
    for _, knob in rows:
        acc.update(knob)
        cfg = load_config(b.EP_GPU_BASE["config"], {**b.EP_GPU_BASE["set"], **acc, "device": "auto"})
        assert resolve_world(cfg, 4) == (4 // cfg["ep"], cfg["ep"])
    assert (cfg["ep"], cfg["ep_dispatch"], cfg["ep_capacity_factor"], cfg["ep_overlap"], cfg["ep_overlap_chunks"],
            cfg["ep_overlap_schedule"], cfg["micro_batch_size"], cfg["sync_free_level"]) == (
        4, "capacity", 1.25, True, 4, "pipelined", 16, 3)
    # the loss check: the DP baseline as the eager ensemble, no micro-batch row to drop, its own control
    rows = b.section_rows("ep", 2, True, 3, b.EP_CPU_BASE)
    assert [n for n, _ in rows] == ["baseline ep=1", "baseline ep=1 (run 2)", "baseline ep=1 (run 3)", "+ ep",
                                    "+ ep_dispatch", "+ ep_overlap", "+ ep_overlap_chunks", "+ ep_overlap_schedule",
                                    "control: lr x1.25"]
    assert rows[-1][1] == {"ep": 1, "lr": pytest.approx(1.25e-2)}  # tiny's lr 1e-2, from the DP baseline
    # the single-process rows are what they were
    assert [n for n, _ in b.section_rows("knobs", 4, True, 2, b.GPU_BASE)] == [
        "baseline", "baseline (run 2)", "+ optimizer", "+ step_timing", "+ compile", "+ triton_kernels",
        "+ expert_swiglu", "+ cuda_graphs", "control: lr x1.25"]
    assert b.run_dir_name(9, "baseline ep=1 (run 2)") == "9_baseline_ep-1_run_2"
    assert b.run_dir_name(3, "+ ep_overlap_chunks") == "3_ep_overlap_chunks"


def _row(name, loss, section="ep", **kw):
    return {"name": name, "section": section, "adds": {}, "tokens_per_s_per_gpu": 100.0, "mfu": None, "step_ms": 10.0,
            "peak_gib": 1.0, "loss": loss, "run_dir": name, "rc": 0, **kw}


def test_ep_rows_are_judged_against_their_own_baseline_and_a_capacity_row_out_of_the_window_fails():
    b = _bench()
    eager = [_curve(30, 13, 0.2, s) for s in (0, 1, 2)]
    knob_eager = [[v + 1.0 for v in eager[0]] for _ in range(2)]  # another batch size: another curve, no drift
    cap = {"path": "capacity", "capacity_factor": 1.0, "overlap": False, "overlap_chunks": 1, "routed_rows": 12288,
           "dropped_rows": 3072, "dropped_share": 0.25}
    rows = [_row("baseline", knob_eager[0], "knobs"), _row("baseline (run 2)", knob_eager[1], "knobs"),
            _row("baseline ep=1", eager[0]), _row("baseline ep=1 (run 2)", eager[1]),
            _row("baseline ep=1 (run 3)", eager[2]),
            _row("+ ep", _curve(30, 13, 0.2, 3), ep_dispatch={**cap, "path": "nccl", "capacity_factor": None,
                                                               "dropped_rows": 0, "dropped_share": 0.0}),
            # drops a quarter of the routed rows: 3 % off from step 1 on, out of the eager window
            _row("+ ep_dispatch", [v * (1.03 if i else 1.0) for i, v in enumerate(eager[0])], ep_dispatch=cap)]
    b.judge_rows(rows, 1e-2)
    by = {r["name"]: r for r in rows}
    assert by["+ ep"]["loss_ok"] and by["baseline ep=1 (run 3)"]["loss_ok"]
    # judged against the EP section's baseline, not the single-process one (which is 1.0 higher)
    assert by["+ ep"]["loss_check"]["eager_late_mean"] == pytest.approx(
        sum(sum(e[-10:]) / 10 for e in eager) / 3)
    assert by["baseline (run 2)"]["loss_ok"] and by["baseline (run 2)"]["loss_check"]["agreed_steps"] == 30
    capr = by["+ ep_dispatch"]
    assert not capr["loss_ok"] and not capr["loss_check"]["early_ok"]
    md = b.table([r for r in rows if r["section"] == "ep"], 1e-2, "## ep", ep=True)
    assert "| EP dispatch: dropped rows | loss vs eager" in md
    assert "| + ep | — | 100 | n/a | 10.0 | +0.0 % | 1.00 | nccl: none dropped | first 13 steps" in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| + ep_dispatch |"))
    assert "| capacity 1.0: 25.00 % dropped (3,072 of 12,288 rows) | first 13 steps 3.00e-02 (OUT);" in line
    assert "| baseline ep=1 | — | 100 | n/a | 10.0 |  | 1.00 | — |" in md
    assert not b.verdict(rows, cpu=True)  # the capacity row fails the run (exit 1), as any knob row would
    assert b.verdict([r for r in rows if r["name"] != "+ ep_dispatch"], cpu=True)
    # a control that passes fails the run, per section; a refused EP row is never excused on a CPU
    ok_control = _row("control: lr x1.25", eager[1], loss_ok=True)
    assert not b.verdict([ok_control], cpu=True)
    assert not b.verdict([_row("+ expert_swiglu", [], rc=2)], cpu=True)
    assert b.verdict([_row("+ expert_swiglu", [], "knobs", rc=2)], cpu=True)
    assert b.dropped_text(None) == "—"


@pytest.mark.parametrize("argv, msg", [
    (["--cpu", "--only", "ep"], "--only ep needs --nproc N > 1"),
    (["--cpu", "--nproc", "3", "--only", "ep"], "--nproc 3: the EP rows (ep=3 on tiny) cannot run: config error: ep: "),
    (["--cpu", "--nproc", "0"], "--nproc must be at least 1, got 0"),
    (["--cpu", "--nproc", "2", "--only", "ep", "--rows", "ep,ep_overlapp"],
     "--rows: no row named ep_overlapp in the rows of ep (ep, ep_dispatch, ep_overlap, ep_overlap_chunks, "
     "ep_overlap_schedule)"),
])
def test_ep_rows_bad_world_is_one_line_exit_2(argv, msg):
    r = subprocess.run([sys.executable, "benchmarks/bench_trainer_knobs.py", *argv], cwd=REPO, capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_cpu_ep_rows_on_two_gloo_processes(tmp_path):
    """``--cpu --nproc 2 --only ep --check-loss --diff --rows ...``: EP rows through trainer.launch on 2 gloo ranks, a
    few steps each, with the loss check and its control and, from the same runs (one step of each profiled), the
    trace diff of every knob row that ran against the one before. Three of the five knob rows (each row is a
    torchrun job of ~12 s of CPU here): the nccl path, the capacity path and the last row, which must still carry
    the knobs of the two rows ``--rows`` left out (overlap on, 4 chunks)."""
    # 6 steps: by step 5 the control (lr x1.25, after tiny's 2 warm-up steps) is 2e-2 off the DP runs, twice the
    # tolerance; at 4 steps it is still inside it
    r = subprocess.run([sys.executable, "benchmarks/bench_trainer_knobs.py", "--cpu", "--nproc", "2", "--only", "ep",
                        "--out", str(tmp_path), "--check-loss", "--diff", "--eager-runs", "2", "--steps", "6",
                        "--rows", "ep,+ ep_dispatch,ep_overlap_schedule"],
                       cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    out = tmp_path / "check_loss"
    doc = json.loads((out / "check_loss.json").read_text())
    rows = {row["name"]: row for row in doc["rows"]}
    assert doc["nproc"] == 2 and doc["sections"] == ["ep"], r.stderr[-3000:]
    assert list(rows) == ["baseline ep=1", "baseline ep=1 (run 2)", "+ ep", "+ ep_dispatch", "+ ep_overlap_schedule",
                          "control: lr x1.25"], r.stderr[-3000:]
    assert all(row["rc"] == 0 and row["nproc"] == 2 for row in rows.values()), r.stderr[-3000:]
    assert [row["ep_dispatch"] for row in rows.values() if row["name"].startswith(("baseline", "control"))] == \
        [None] * 3  # the DP runs (2 with --eager-runs 2) and the control
    assert rows["+ ep"]["ep_dispatch"]["path"] == "nccl" and rows["+ ep"]["ep_dispatch"]["dropped_rows"] == 0
    cap = rows["+ ep_dispatch"]["ep_dispatch"]
    assert (cap["path"], cap["capacity_factor"], cap["overlap"]) == ("capacity", 1.25, False)
    last = rows["+ ep_overlap_schedule"]["ep_dispatch"]  # the left-out rows' knobs carried (cumulative rows)
    assert (last["path"], last["overlap"], last["overlap_chunks"], last["overlap_schedule"]) == (
        "capacity", True, 4, "pipelined")
    assert 0 < cap["routed_rows"] and cap["dropped_share"] == cap["dropped_rows"] / cap["routed_rows"]
    md = (out / "check_loss.md").read_text()
    assert f"capacity 1.25: {100 * cap['dropped_share']:.2f} % dropped" in md
    # the loss of every EP row against the DP baseline's, rc 0 only when every row passes and the control fails
    ok = all(row.get("loss_ok", True) for n, row in rows.items() if not n.startswith("control"))
    assert not rows["control: lr x1.25"]["loss_ok"]
    assert r.returncode == (0 if ok else 1), r.stderr[-3000:]
    assert rows["+ ep"]["loss_ok"] and rows["+ ep"]["loss_rel_diff"] < 1e-5  # EP = the DP layer (fp32)
    # --diff: every row profiled one step on both ranks; the knob rows diffed in turn, the repeated eager run and
    # the control left out of the chain
    for row in rows.values():
        assert len(list((Path(row["run_dir"]) / "traces").glob("rank*.json.gz"))) == 2, row["name"]
    chain = ["0_baseline_ep-1", "2_ep", "3_ep_dispatch", "6_ep_overlap_schedule"]  # run dirs keep their plan index
    want = {f"diff_{a}__{b}" for a, b in itertools.pairwise(chain)}
    assert {d.name for d in out.glob("diff_*")} == want, md
    for d in want:
        assert (out / d / "diff.md").is_file(), md

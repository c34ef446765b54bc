"""CI for pipeline parallelism: 4 gloo ranks under torchrun (two launches of _pp_worker.py).

* Numerics: pipelined runs (1F1B PP=4 x 8 micro-batches; interleaved PP=2 x VPP=2 x DP=2 x 8; GPipe,
  PP+EP with DDP, the zero-bubble schedules) reproduce the losses, aux losses and global grad norms of
  non-pipelined runs over the same global batches (same seed), to fp32 round-off.
* Records: every rank's ``pipeline/rank<N>.jsonl`` holds exactly 8 F + 8 B (+ 8 W for zero-bubble) per
  stage per step, on the ranks the manifest says; the profiled step has the ``pipeline/...`` ranges.
* Bubble: measured from the jsonl (per step, per rank: idle / window, averaged) against the theory
  computed here by hand: (p-1)/(m+p-1) = 3/11 for 1F1B p=4 m=8, (p-1)/(v*m+p-1) = 1/17 interleaved.
* An unbalanced layout (5 of 8 layers on stage 2) shows the heavy stage in the jsonl.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _launch(out: Path, mode: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        str(REPO / "tests" / "trainer" / "_pp_worker.py"), str(out), mode],
                       cwd=REPO, capture_output=True, text=True, timeout=400,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((out / f"{mode}.json").read_text())


@pytest.fixture(scope="module")
def numerics(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_numerics")
    return out, _launch(out, "numerics")


@pytest.fixture(scope="module")
def timing(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_timing")
    return out, _launch(out, "timing")


def _actions(run: Path) -> list[dict]:
    rows = []
    for f in sorted((run / "pipeline").glob("rank*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def _bubble(rows: list[dict], skip_steps: int = 1) -> float:
    """Mean over steps (after warm-up) and ranks of idle / window, window = first start to last end of
    the step over all ranks, busy = the rank's summed action time (its actions never overlap)."""
    ratios = []
    for step in sorted({r["step"] for r in rows})[skip_steps:]:
        rs = [r for r in rows if r["step"] == step]
        lo, hi = min(r["start_ns"] for r in rs), max(r["end_ns"] for r in rs)
        busy = defaultdict(int)
        for r in rs:
            busy[r["rank"]] += r["end_ns"] - r["start_ns"]
        ratios += [1 - b / (hi - lo) for b in busy.values()]
    return sum(ratios) / len(ratios)


REFERENCE = {"pp4_1f1b": "ref_8", "pp4_gpipe": "ref_8", "pp2_ep2_1f1b_ddp": "ref_8",
             "pp2_vpp2_dp2": "ref_16", "pp2_vpp2_dp2_zb1p": "ref_16", "pp2_vpp2_dp2_zbv": "ref_16"}


def test_pipelined_runs_match_non_pipelined_losses(numerics):
    _, res = numerics
    runs = res["runs"]
    assert set(runs) | set(res["skipped"]) == set(REFERENCE) | {"ref_8", "ref_16"}
    assert set(res["skipped"]) <= {"pp2_vpp2_dp2_zbv"}
    for name, ref in REFERENCE.items():
        if name in res["skipped"]:
            continue
        got, want = runs[name]["metrics"], runs[ref]["metrics"]
        assert len(got["loss"]) == 3
        for key in ("loss", "aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=2e-5, abs=1e-6), (name, key, got[key], want[key])
    # the comparison is not vacuous: the model trains, the aux loss is live, clipping (0.05) acts
    ref = runs["ref_8"]["metrics"]
    assert ref["loss"][2] < ref["loss"][0] and all(a > 0.5 for a in ref["aux_loss"])
    assert all(g > 0.05 for g in ref["grad_norm"])


def test_manifest_pipeline_object_and_mesh(numerics):
    _, res = numerics
    p = res["runs"]["pp4_1f1b"]["pipeline"]
    assert p == {"pp": 4, "vpp": 1, "schedule": "1f1b", "torch_schedule": "Schedule1F1B", "microbatches": 8,
                 "layout": "Et|t|t|tL", "layout_source": "auto (FLOP model)",
                 "stage_layers": [[0], [1], [2], [3]],
                 "stage_modules": [["embedding", "layer0"], ["layer1"], ["layer2"], ["layer3", "loss"]],
                 "stage_to_rank": [0, 1, 2, 3]}
    v = res["runs"]["pp2_vpp2_dp2"]["pipeline"]
    assert (v["torch_schedule"], v["stage_to_rank"], v["layout"]) == ("ScheduleInterleaved1F1B", [0, 1, 0, 1],
                                                                     "Et|t|t|tL")
    assert res["runs"]["pp2_vpp2_dp2"]["mesh"]["dims"] == ["pp", "dp", "ep"]
    assert res["runs"]["pp2_vpp2_dp2"]["mesh"]["ranks"] == [[[0], [1]], [[2], [3]]]
    assert res["runs"]["pp2_ep2_1f1b_ddp"]["mesh"]["shape"] == [2, 1, 2]
    if "pp2_vpp2_dp2_zbv" in res["runs"]:
        assert res["runs"]["pp2_vpp2_dp2_zbv"]["pipeline"]["stage_to_rank"] == [0, 1, 1, 0]  # V shape
    assert res["runs"]["ref_8"]["pipeline"] is None


@pytest.mark.parametrize("name, kinds", [("pp4_1f1b", "FB"), ("pp2_vpp2_dp2", "FB"), ("pp2_vpp2_dp2_zb1p", "FBW"),
                                         ("pp2_ep2_1f1b_ddp", "FB")])
def test_jsonl_has_every_action_once(numerics, name, kinds):
    out, res = numerics
    rows = _actions(out / name)
    files = sorted(p.name for p in (out / name / "pipeline").glob("*.jsonl"))
    assert files == [f"rank{r}.jsonl" for r in range(4)]
    stage_to_rank = res["runs"][name]["pipeline"]["stage_to_rank"]
    keys = {"step", "rank", "pp_rank", "stage", "microbatch", "kind", "start_ns", "end_ns"}
    per_rank_pp = res["runs"][name]["mesh"]["shape"][1] * res["runs"][name]["mesh"]["shape"][2]  # dp * ep
    for r in rows:
        assert set(r) == keys and 0 <= r["start_ns"] <= r["end_ns"]
        assert r["pp_rank"] == r["rank"] // per_rank_pp  # mesh order (pp, dp, ep)
        assert stage_to_rank[r["stage"]] == r["pp_rank"]
    m = res["runs"][name]["pipeline"]["microbatches"]
    assert m == (4 if name == "pp2_ep2_1f1b_ddp" else 8)
    count = Counter((r["rank"], r["step"], r["stage"], r["kind"]) for r in rows)
    for rank in range(4):
        pp_rank = rank // per_rank_pp
        for stage in [s for s, pr in enumerate(stage_to_rank) if pr == pp_rank]:
            for step in range(3):
                for kind in kinds:
                    assert count[(rank, step, stage, kind)] == m, (rank, step, stage, kind)
                    mbs = sorted(r["microbatch"] for r in rows if (r["rank"], r["step"], r["stage"], r["kind"])
                                 == (rank, step, stage, kind))
                    assert mbs == list(range(m))
    stages_per_rank = len(stage_to_rank) // (4 // per_rank_pp)
    assert len(rows) == 4 * stages_per_rank * 3 * len(kinds) * m  # ranks x stages x steps x kinds x microbatches


def test_profiled_step_has_pipeline_ranges(numerics):
    out, res = numerics
    assert res["runs"]["pp4_1f1b"]["profile"]["traces"] == [f"traces/rank{r}.json.gz" for r in range(4)]
    for rank in range(4):
        with gzip.open(out / "pp4_1f1b" / "traces" / f"rank{rank}.json.gz", "rt") as f:
            events = json.load(f)["traceEvents"]
        names = Counter(e["name"] for e in events if e.get("cat") == "user_annotation"
                        and e.get("name", "").startswith("pipeline/"))
        assert names == {f"pipeline/{k}/s{rank}/mb{i}": 1 for k in "FB" for i in range(8)}, rank


def test_bubble_against_theory(timing):
    """Measured bubble vs theory (1F1B p=4 m=8: 3/11 = 27.3 %; interleaved p=2 v=2 m=8: 1/17 = 5.9 %).

    Always: the schedules really overlap (a serialised step would idle 75 % with PP=4, 50 % with PP=2)
    and interleaving lowers the bubble. With a CPU per rank (ranks pinned, like a device per rank; 4 dedicated cores of
    the H100 host) the measured ratios were 1F1B 27.6-30.7 % and interleaved 11-12 %: 1F1B is held to
    5 points of theory, interleaved to 7 (each of its 32 hand-offs per rank and step exposes gloo's
    point-to-point latency; its theoretical bubble is only one stage-time). With fewer CPUs than
    ranks the OS time-shares them and the figures move with the machine's load (2 CPUs for 4 ranks:
    1F1B 29-38 %, interleaved 9-22 % with other jobs running), so only the structural bounds are
    checked there.
    """
    out, res = timing
    measured = {name: _bubble(_actions(out / name)) for name in ("bubble_1f1b", "bubble_vpp")}
    theory = {"bubble_1f1b": 3 / 11, "bubble_vpp": 1 / 17}
    print("measured bubble", measured, "theory", theory, "cpus", res["cpus"])
    assert 0.5 * theory["bubble_1f1b"] <= measured["bubble_1f1b"] <= 0.5, measured
    assert 0 < measured["bubble_vpp"] <= 0.35, measured
    assert measured["bubble_vpp"] < measured["bubble_1f1b"], measured
    if res["cpus"] >= 4:
        assert abs(measured["bubble_1f1b"] - theory["bubble_1f1b"]) <= 0.05, measured
        assert abs(measured["bubble_vpp"] - theory["bubble_vpp"]) <= 0.07, measured


def test_unbalanced_layout_shows_the_heavy_stage(timing):
    out, res = timing
    assert res["runs"]["unbalanced"]["pipeline"]["stage_layers"] == [[0], [1], [2, 3, 4, 5, 6], [7]]
    rows = [r for r in _actions(out / "unbalanced") if r["step"] >= 1]
    per_stage = defaultdict(int)
    for r in rows:
        per_stage[r["stage"]] += r["end_ns"] - r["start_ns"]
    heavy = max(per_stage, key=per_stage.get)
    others = [v for s, v in per_stage.items() if s != 2]
    assert heavy == 2 and per_stage[2] > 2.5 * (sum(others) / len(others)), per_stage
    # and it is the least idle rank: everyone else waits for it
    idle = {}
    for step in sorted({r["step"] for r in rows}):
        rs = [r for r in rows if r["step"] == step]
        lo, hi = min(r["start_ns"] for r in rs), max(r["end_ns"] for r in rs)
        for rank in range(4):
            busy = sum(r["end_ns"] - r["start_ns"] for r in rs if r["rank"] == rank)
            idle[rank] = idle.get(rank, 0) + (hi - lo) - busy
    assert min(idle, key=idle.get) == 2

"""CI for pipeline parallelism: two torchrun launches of _pp_worker.py (4 gloo ranks for the numerics,
2 for the bubble).

* Numerics: pipelined runs (1F1B PP=4 x 8 micro-batches; interleaved PP=2 x VPP=2 x DP=2 x 8; GPipe,
  PP+EP with DDP, the zero-bubble schedules) reproduce the losses, aux losses and global grad norms of
  non-pipelined runs over the same global batches (same seed), to fp32 round-off.
* Records: every rank's ``pipeline/rank<N>.jsonl`` holds exactly 8 F + 8 B (+ 8 W for zero-bubble) per
  stage per step, on the ranks the manifest says; the profiled step has the ``pipeline/...`` ranges.
* Bubble (2 processes, each pinned to its own CPU core with one torch thread, like a device per rank):
  measured from the jsonl, by tracelens (``tracelens.analysis.pipeline.load_pipeline``) and again here
  from the raw lines (per step after the first, per rank: idle / window, averaged), within 5
  percentage points of the theory computed here by hand: (p-1)/(m+p-1) = 1/9 for 1F1B p=2 m=8,
  (p-1)/(v*m+p-1) = 1/17 for interleaved p=2 v=2 m=8.
* An unbalanced layout (10 of 16 layers on stage 2 of 4) is flagged by tracelens with stage 2, which
  also has the most time in the jsonl, and its rank is the least idle.
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

from tracelens.analysis.pipeline import load_pipeline

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _launch(out: Path, mode: str, nproc: int) -> dict:
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        str(REPO / "tests" / "trainer" / "_pp_worker.py"), str(out), mode],
                       cwd=REPO, capture_output=True, text=True, timeout=400,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((out / f"{mode}.json").read_text())


@pytest.fixture(scope="module")
def numerics(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_numerics")
    return out, _launch(out, "numerics", 4)


@pytest.fixture(scope="module")
def bubble(tmp_path_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the bubble measurement needs a CPU core per rank (2)")
    out = tmp_path_factory.mktemp("pp_bubble")
    return out, _launch(out, "bubble", 2)


def _actions(run: Path) -> list[dict]:
    rows = []
    for f in sorted((run / "pipeline").glob("rank*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def _bubble(rows: list[dict], skip_steps: int = 1) -> float:
    """Idle / window summed over the steps after warm-up and over the ranks (docs/pipeline.md): window =
    first start to last end of the step over all ranks, busy = the rank's summed action time (its
    actions never overlap), idle = window - busy."""
    idle = window = 0
    for step in sorted({r["step"] for r in rows})[skip_steps:]:
        rs = [r for r in rows if r["step"] == step]
        lo, hi = min(r["start_ns"] for r in rs), max(r["end_ns"] for r in rs)
        busy = defaultdict(int)
        for r in rs:
            busy[r["rank"]] += r["end_ns"] - r["start_ns"]
        idle += sum(hi - lo - b for b in busy.values())
        window += (hi - lo) * len(busy)
    return idle / window


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


# theory by hand: p = 2 pipeline ranks, m = 8 micro-batches, v = 2 virtual stages per rank
THEORY = {"bubble_1f1b": (2 - 1) / (8 + 2 - 1), "bubble_vpp": (2 - 1) / (2 * 8 + 2 - 1)}  # 1/9, 1/17


@pytest.mark.alone  # wall-clock time against theory, a CPU core per rank: nothing else may run beside it
def test_bubble_against_theory(bubble):
    """Measured bubble within 5 points of theory for 1F1B (11.1 %) and interleaved (5.9 %).

    On the 2-core development machine (shared, other jobs running or not): 1F1B 11.6-14.5 %,
    interleaved 6.0-7.7 % (9.8 % once at load 6). What is left above theory is the host cost of each
    hand-off (gloo send/recv and torch's runtime, 0.5-0.8 ms; interleaved has 32 per rank and step) and
    the cores' speed drifting by a few percent within a step (docs/pipeline.md, "Measured").
    """
    out, res = bubble
    got = {}
    for name, theory in THEORY.items():
        run = out / name
        ana = load_pipeline(run)  # tracelens' own analysis of the run dir (jsonl + manifest)
        mine = _bubble(_actions(run))  # independently from the raw lines
        got[name] = (ana.overall_ratio, mine)
        assert ana.theory_ratio == pytest.approx(theory), (name, ana.theory_ratio, ana.theory_note)
        assert ana.skipped_steps == [0] and ana.steps == [1, 2, 3, 4], (ana.skipped_steps, ana.steps)
        assert ana.overall_ratio == pytest.approx(mine, rel=1e-9), (name, ana.overall_ratio, mine)
    # each rank's CPU time / wall time per run: near 1 - bubble with a core to itself, lower when other
    # processes share the cores (the figures then widen: docs/pipeline.md)
    context = {"cpu_share": {n: res["cpu_share"][n] for n in THEORY}, "loadavg": res["loadavg"]}
    print("bubble (tracelens, raw jsonl) vs theory:",
          {n: (round(100 * a, 2), round(100 * b, 2), round(100 * THEORY[n], 2)) for n, (a, b) in got.items()}, context)
    for name, (tl, mine) in got.items():
        assert abs(tl - THEORY[name]) <= 0.05, (name, got, THEORY, context)
    assert got["bubble_vpp"][0] < got["bubble_1f1b"][0], (got, context)


@pytest.mark.alone  # the same launch as test_bubble_against_theory (whichever runs first makes it)
def test_unbalanced_layout_flags_the_heavy_stage(bubble):
    out, res = bubble
    assert res["runs"]["unbalanced"]["pipeline"]["stage_layers"] == [[0, 1], [2, 3], list(range(4, 14)), [14, 15]]
    bal = load_pipeline(out / "unbalanced").balance
    assert bal.flagged and bal.slowest_stage == 2, bal.statement
    assert bal.slowest_ratio > 1.8, bal.statement  # 10 layers against a mean of 4 per stage: 2.5x
    # from the raw lines: stage 2 has the most time (about 5x the others' mean: 10 layers vs 2 each)
    rows = [r for r in _actions(out / "unbalanced") if r["step"] >= 1]
    per_stage = defaultdict(int)
    for r in rows:
        per_stage[r["stage"]] += r["end_ns"] - r["start_ns"]
    heavy = max(per_stage, key=per_stage.get)
    others = [v for s, v in per_stage.items() if s != 2]
    assert heavy == 2 and per_stage[2] > 3 * (sum(others) / len(others)), per_stage
    # and its rank (0: stages 0 and 2, 12 layers) is the least idle: the other waits for it
    idle = defaultdict(int)
    for step in sorted({r["step"] for r in rows}):
        rs = [r for r in rows if r["step"] == step]
        lo, hi = min(r["start_ns"] for r in rs), max(r["end_ns"] for r in rs)
        for rank in (0, 1):
            idle[rank] += (hi - lo) - sum(r["end_ns"] - r["start_ns"] for r in rs if r["rank"] == rank)
    assert min(idle, key=idle.get) == 0, idle

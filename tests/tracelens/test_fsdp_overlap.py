"""FSDP2's collectives placed in a replayed step (`tracelens.projection.fsdp_overlap`): a hand-timed step, where every
start and end follows from FSDP2's rules by arithmetic, and the real multi-micro-batch fixture's segmentation."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from tracelens.projection import fsdp_overlap as FO
from tracelens.projection.replay import Plan

FIX = Path(__file__).resolve().parent.parent / "fixtures"
MS = 1_000_000.0

# one layer (dense unit 0 with its experts), the root around it, the optimizer last: (layer, moe_stage, backward,
# component, ms). The backward runs the layer's shared expert (its "tail", before the experts) and its attention after.
_KERNELS = [
    (-1, "", False, "other", 1.0),                 # 0 embedding (root)
    (0, "", False, "attention", 4.0),              # 1 layer 0 forward
    (0, "moe/experts", False, "expert GEMMs", 4.0),  # 2 experts 0 forward
    (-1, "", False, "dense GEMMs", 2.0),           # 3 head and loss (root)
    (-1, "", True, "dense GEMMs", 2.0),            # 4 loss backward (root)
    (0, "", True, "dense GEMMs", 1.0),             # 5 layer 0 backward: the shared expert
    (0, "moe/experts", True, "expert GEMMs", 8.0),  # 6 experts 0 backward
    (0, "", True, "attention", 6.0),               # 7 layer 0 backward: attention
    (-1, "", True, "other", 1.0),                  # 8 embedding backward (root)
    (-1, "", False, "optimizer step", 3.0),        # 9 the optimizer
]
GATHER = {("root", -1): 2 * MS, ("dense", 0): 1 * MS, ("experts", 0): 5 * MS}
REDUCE = {("root", -1): 1 * MS, ("dense", 0): 1 * MS, ("experts", 0): 3 * MS}


def _step(kernels=_KERNELS, gap_ms: float = 0.0):
    n = len(kernels)
    w = pd.DataFrame({"layer": [k[0] for k in kernels], "moe_stage": [k[1] for k in kernels],
                      "backward": [k[2] for k in kernels], "component": [k[3] for k in kernels],
                      "is_comm": [False] * n, "name": ["k"] * n})
    plan = Plan(kind=[0] * n, ref=list(range(n)), gap=[gap_ms * MS] * n, dur=[k[4] * MS for k in kernels],
                stream=[7] * n, dep=[-1] * n, wait=[0.0] * n, comp=[k[3] for k in kernels], sync_min=[], sync_ret=[],
                tail=0.0, latency=0.0, cpu=False, gap_x=[0.0] * n, sync_streams=[], backlog={})
    return SimpleNamespace(plan=plan, profile=SimpleNamespace(work=w), host_scale=1.0, device_scale=1.0), w


def test_a_device_bound_step_by_hand():
    """The host launches everything at once; by FSDP2's rules (module docstring), in ms: forward, the root's gather
    0-2, layer 0's 2-3 (after the root's copy-out at 2), the experts' 3-8 (after layer 0's copy-out at 3): the
    experts' forward waits until 8 (layer 0 ran 3-7), the head ends at 14. Backward: the loss 14-16; layer 0's
    gather, prefetched by the root, ran 8-9; the experts' gather, prefetched at layer 0's pre-backward, waits for
    layer 0's copy-out (16) and runs 16-21 while only the shared expert (16-17) runs beside it: the experts' backward
    21-29, attention 29-35, the embedding 35-36, the optimizer 36-39 (39 against 32 without FSDP: 7 exposed by the
    gathers). With the reduce-scatters: the experts' 29-32 hides under attention, layer 0's 35-36 under the embedding,
    the root's 36-37 holds the optimizer to 37-40: 8 in all. That is the placement alone (the contention rule off);
    with it (`contended_step`), the one compute unit a gather covers that has a rate and lies on the step's path is the
    experts' forward (expert GEMMs, 8-12), which layer 0's backward gather (8-9) covers for a quarter: 4 x (1 + 0.34 x
    1/4) = 4.34 ms at ``DEFAULT_RATE``'s 1.34 for expert GEMMs beside an all-gather, so 7.34 and 8.34 (the shared
    expert's 1 ms, also covered, lies beside the experts' 5 ms gather and moves nothing; attention, the embedding and
    the optimizer have no rate)."""
    rep, w = _step()
    off = FO.CONTENTION
    try:
        FO.CONTENTION = False
        e = FO.exposure(rep, w, GATHER, REDUCE, microbatches=1)
    finally:
        FO.CONTENTION = off
    assert e.gathers_ns == pytest.approx(7 * MS)
    assert e.total_ns == pytest.approx(8 * MS)
    assert e.reduces_ns == pytest.approx(1 * MS)
    assert e.units == 8  # 3 gathers forward, 2 backward (the root stays gathered), 3 reduce-scatters
    e = FO.exposure(rep, w, GATHER, REDUCE, microbatches=1)
    r = FO.CT.DEFAULT_RATE[("expert GEMMs", "AllGather")]
    assert r == 1.34
    assert e.gathers_ns == pytest.approx(7 * MS + 4 * MS * (r - 1) / 4)
    assert e.total_ns == pytest.approx(8 * MS + 4 * MS * (r - 1) / 4)


def test_the_replay_it_was_given_is_left_as_it_was():
    rep, w = _step()
    before = (list(rep.plan.kind), list(rep.plan.dur), list(rep.plan.dep))
    FO.exposure(rep, w, GATHER, REDUCE, microbatches=1)
    assert (rep.plan.kind, rep.plan.dur, rep.plan.dep) == before


def test_nothing_to_gather_exposes_nothing_and_exposure_never_goes_negative():
    rep, w = _step()
    e = FO.exposure(rep, w, {}, {}, microbatches=1)
    assert e.gathers_ns == 0 and e.total_ns == 0 and e.units == 0
    tiny = {k: 1.0 for k in GATHER}
    e = FO.exposure(rep, w, tiny, tiny, microbatches=1)
    assert 0 <= e.gathers_ns <= e.total_ns <= 10.0


def test_a_host_bound_step_hides_what_the_host_gaps_cover():
    """20 ms of host time before every launch: the device always waits for the host. A gather is launched by the
    hook just before its unit's first kernel (after that kernel's host gap), so it delays its unit by its whole
    length: the experts' forward, launched at 60 ms, starts at 65 after its 5 ms gather; the root's embedding at 22
    after its 2 ms one. But the next launch comes 20 ms later anyway, so the step does not grow by the gathers (0
    exposed). The step's end does: the root's reduce-scatter, launched with the optimizer at 200 ms after the
    embedding's backward (180-181), holds the optimizer to 201-204 instead of 200-203: 1 ms."""
    rep, w = _step(gap_ms=20.0)
    e = FO.exposure(rep, w, GATHER, REDUCE, microbatches=1)
    assert e.gathers_ns == pytest.approx(0.0, abs=1.0)
    assert e.total_ns == pytest.approx(1 * MS)
    plan = FO._clone(rep.plan)
    FO.insert(plan, w, GATHER, {}, with_reduces=False)
    r = plan.replay(1.0)
    assert r.start[2] == pytest.approx(65 * MS)
    assert r.start[0] == pytest.approx(22 * MS)
    assert sum(plan.gap) == pytest.approx(sum(rep.plan.gap))  # the hooks take no host time the run did not have


def test_per_step_repeats_the_gathers_with_the_micro_batches_and_the_reduce_scatters_once():
    e = FO.Exposure(gathers_ns=4.0, total_ns=6.0, microbatches=2, units=10)
    assert e.per_step(2) == pytest.approx(6.0)
    assert e.per_step(6) == pytest.approx(2.0 * 6 + 2.0)
    assert e.per_step(1) == pytest.approx(4.0)


def test_a_real_step_splits_into_its_micro_batches():
    """The profiled dp 4 run with 3 micro-batches (tests/fixtures/h100_4gpu_accum/dp4_mbs8_m3_prof): three forward /
    backward pairs, each holding every layer's forward kernels and every MoE layer's backward ones; its own FSDP
    collectives are found by name (the kernels named AllGather / ReduceScatter, counted here on the raw names)."""
    from tracelens.projection.whatif import Model

    m = Model.from_run(FIX / "h100_4gpu_accum" / "dp4_mbs8_m3_prof")
    prog, p = m.programs[0], m.profiles[0]
    plan = Plan.of(prog, profiler_lead=False)
    keys = FO._unit_keys(p.work)
    bwd = p.work["backward"].to_numpy().astype(bool)
    mbs = FO._microbatches(plan, keys, bwd)
    assert len(mbs) == 3
    layers = {k[1] for k in keys if k is not None and k[1] >= 0}
    # the dense first layer's backward kernels carry no layer range in this trace (they count as the root's)
    lay = p.work["layer"].to_numpy()
    with_bwd = {int(x) for x in set(lay[bwd]) if x >= 0}
    assert with_bwd == layers - {0}
    for fw, bw in mbs:
        assert {keys[j][1] for j in fw if keys[j][0] != "root"} == layers
        assert {keys[j][1] for j in bw if keys[j][0] != "root"} == with_bwd
        assert {keys[j] for j in bw if keys[j][0] == "experts"} == {("experts", x) for x in with_bwd}
    names = p.work["name"].astype(str)
    fs = FO.fsdp_collective_units(p.work)
    assert len(fs) == int(names.str.contains("AllGather|ReduceScatter").sum()) > 0


def test_the_hooks_host_time_is_the_median_of_the_committed_runs():
    """`HOOK_HOST_NS`, the host time FSDP2's hooks add per all-gather at dp > 1 (assumed for a run at dp 1, which
    records none), recomputed from the raw JSON of the runs it names: per rank, the ``FSDP::all_gather`` and
    ``FSDP::all_gather_copy_out`` ranges' time over the number of all-gathers; the median over every rank."""
    import gzip
    import json
    import statistics

    per_rank = []
    for run in FO.HOOK_HOST_SOURCES:
        traces = sorted((FIX / run / "traces").glob("rank*.json.gz"))
        assert traces, run
        for f in traces:
            with gzip.open(f, "rt") as fh:
                ev = json.load(fh)["traceEvents"]
            host = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op")]
            ag = [e for e in host if e["name"] == "FSDP::all_gather" or e["name"].startswith("FSDP::all_gather (")]
            out = [e for e in host if e["name"].startswith("FSDP::all_gather_copy_out")]
            assert ag, f
            per_rank.append((sum(e["dur"] for e in ag) + sum(e["dur"] for e in out)) / len(ag) * 1e3)  # us -> ns
    assert len(per_rank) == 20
    assert FO.HOOK_HOST_NS == pytest.approx(statistics.median(per_rank), rel=0.01)


def test_a_cpu_profile_keeps_the_window_rule():
    """A CPU-only profile's replay runs its ops one after another (no streams): FSDP's gathers placed in it would
    all count as exposed, and the hooks' host time is a GPU host's. The scale-out keeps the window rule there:
    its dp 4 projection exposes none of the traffic, which the ~40 ms window hides (as before `fsdp_overlap`)."""
    from tracelens.projection.scaleout import ScaleOut

    so = ScaleOut.from_run(FIX / "cpu_whatif_grid" / "rep0" / "base")
    p = so.project(4)
    assert p.components["dp traffic (exposed)"] == 0.0
    assert not any(n.startswith("FSDP: the all-gathers") for n in p.notes)


def test_experts_called_once_per_chunk_are_gathered_once_per_call():
    """The trainer calls a layer's experts once per EP dispatch chunk and FSDP2 gathers a unit at every call: with the
    experts' kernels of each pass in two calls, one more gather in the forward (the second call's, after the first's
    copy-out) and one more in the backward (each call prefetches the next), and the step exposes more."""
    split = list(_KERNELS)
    split[2:3] = [(0, "moe/experts", False, "expert GEMMs", 2.0)] * 2
    i = next(k for k, x in enumerate(split) if x[1] == "moe/experts" and x[2])
    split[i:i + 1] = [(0, "moe/experts", True, "expert GEMMs", 4.0)] * 2
    rep, w = _step(split)
    one = FO.exposure(rep, w, GATHER, REDUCE, microbatches=1, calls=1)
    two = FO.exposure(rep, w, GATHER, REDUCE, microbatches=1, calls=2)
    assert one.units == 8 and two.units == 10
    assert two.gathers_ns > one.gathers_ns

"""What EP overlap's chunks cost beyond the re-cut all-to-alls (docs/whatif.md, `ep_overlap`):

* FSDP2 gathers a MoE layer's experts once per call, and the trainer calls them once per chunk: at dp > 1 the
  experts' all-gathers per pass grow with the chunks. Checked on the raw JSON of two recorded 4 x H100 runs (ep 2 x
  dp 2, micro-batch 8, without and with 2 chunks; tests/fixtures/h100_4gpu_overlap_fsdp), by counting the NCCL
  all-gather kernels launched inside the first profiler step; at ep 4 (experts over a dp group of one) the count
  does not move (h100_4gpu_layouts/ep4_cap_mbs16 against h100_4gpu/ep4_cap_ovl).
* The chunk loop's host time: the forward's gaps repeat per chunk, the backward adds its median gap per launch
  (`overlap._rescale_loop_host`), checked by arithmetic on a hand-made plan.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

FX = Path(__file__).resolve().parents[1] / "fixtures"
PAIR = FX / "h100_4gpu_overlap_fsdp"


def _all_gathers_in_first_step(trace: Path) -> int:
    """NCCL all-gather kernels whose host launch lies inside the trace's first ProfilerStep range (raw JSON)."""
    with gzip.open(trace, "rt") as f:
        ev = json.load(f)["traceEvents"]
    step = min((e for e in ev if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")),
               key=lambda e: e["ts"])
    lo, hi = step["ts"], step["ts"] + step["dur"]
    corr = {e["args"]["correlation"] for e in ev
            if e.get("ph") == "X" and e.get("cat") == "kernel" and "AllGather" in str(e.get("name", ""))}
    return sum(1 for e in ev if e.get("ph") == "X" and e.get("cat") != "kernel"
               and e.get("args", {}).get("correlation") in corr and lo <= e["ts"] <= hi)


def _config(run: Path) -> dict:
    m = json.loads((run / "manifest.json").read_text())
    return m.get("config", m)


def test_fsdp_gathers_the_experts_once_per_chunk_at_dp_above_one():
    one, two = PAIR / "ep2_cap_mbs8", PAIR / "ep2_cap_eo_mbs8"
    c1, c2 = _config(one), _config(two)
    assert (c1["ep"], c2["ep"], bool(c1.get("ep_overlap")), bool(c2.get("ep_overlap"))) == (2, 2, False, True)
    chunks = int(c2.get("ep_overlap_chunks") or 2)
    moe_layers = int(c1["n_layers"]) - int(c1.get("first_k_dense") or 0)
    n1 = _all_gathers_in_first_step(one / "traces" / "rank0.json.gz")
    n2 = _all_gathers_in_first_step(two / "traces" / "rank0.json.gz")
    # each MoE layer's experts gathered once more per added chunk, in the forward and again in the backward
    assert n2 - n1 == (chunks - 1) * moe_layers * 2, (n1, n2)


def test_at_dp_one_the_experts_are_not_gathered_so_chunks_add_none():
    one = FX / "h100_4gpu_layouts" / "ep4_cap_mbs16" / "traces" / "rank0.json.gz"
    two = FX / "h100_4gpu" / "ep4_cap_ovl" / "traces" / "rank0.json.gz"
    assert _all_gathers_in_first_step(one) == _all_gathers_in_first_step(two)


def test_the_scaleout_counts_the_experts_copies_and_gathers_per_chunk():
    from tracelens.projection.scaleout import ScaleOut

    so = ScaleOut.from_run(FX / "h100_scaling" / "dp2_prof")
    base = {"ep": 2, "ep_dispatch": "capacity", "micro_batch_size": 8}
    cfg0, _, _ = so.target(4, {**base, "ep_overlap": False})
    cfg2, _, _ = so.target(4, {**base, "ep_overlap": True, "ep_overlap_chunks": 2})
    g0, r0 = so.fsdp_copies_ns(cfg0, 4)
    g2, r2 = so.fsdp_copies_ns(cfg2, 4)
    assert g0 > 0 and g2 == pytest.approx(2 * g0) and r2 == pytest.approx(r0)
    p0 = so.project(4, {**base, "ep_overlap": False})
    p2 = so.project(4, {**base, "ep_overlap": True, "ep_overlap_chunks": 2})
    # measured on the grid (tests/fixtures/h100_scaling/measured.json): 88,555 without, 81,454 with 2 chunks
    assert p2.tokens_per_s_per_gpu < p0.tokens_per_s_per_gpu


class _Plan:
    def __init__(self, gaps):
        self.gap = list(gaps)
        self.gap_x = [g / 2 for g in gaps]


def test_loop_host_time_forward_scales_with_the_chunks():
    from tracelens.projection.mechanisms.overlap import _rescale_loop_host

    plan = _Plan([40e3, 80e3, 120e3, 7e3])
    added = _rescale_loop_host(plan, [0, 1, 2], backward=False, c0=1, c1=2)
    assert added == pytest.approx(240e3)
    assert plan.gap == pytest.approx([80e3, 160e3, 240e3, 7e3])  # the item outside the loop keeps its gap
    assert plan.gap_x == pytest.approx([40e3, 80e3, 120e3, 3.5e3])
    back = _rescale_loop_host(plan, [0, 1, 2], backward=False, c0=2, c1=1)
    assert back == pytest.approx(-240e3) and plan.gap[:3] == pytest.approx([40e3, 80e3, 120e3])


def test_loop_host_time_backward_adds_its_median_gap_per_launch():
    from tracelens.projection.mechanisms.overlap import _rescale_loop_host

    gaps = [50e3, 100e3, 900e3]  # one long wait (the autograd engine's), which does not repeat per chunk
    plan = _Plan(gaps)
    added = _rescale_loop_host(plan, [0, 1, 2], backward=True, c0=1, c1=2)
    assert added == pytest.approx(3 * 100e3)  # (2/1 - 1) x 3 launches x the median gap
    assert sum(plan.gap) == pytest.approx(sum(gaps) + 300e3)
    assert _rescale_loop_host(_Plan([]), [], backward=True, c0=1, c1=2) == 0.0


def test_the_whatif_regathers_the_experts_per_chunk_on_a_recorded_run():
    """From the ep 2 x dp 2 run without overlap (ranks 0 and 1 committed) to 2 chunks: the experts' gathers of the
    chunk loops go from the run's 3 (one per forward) to 9 (two per forward, and the backward's second: its first is
    prefetched before the loop), and the prediction lands near the measured run with 2 chunks (t005: 81,454
    tokens/s/GPU; the grid's run without, 88,555)."""
    from tracelens.projection.mechanisms import overlap as O
    from tracelens.projection.whatif import Model

    m = Model.from_run(PAIR / "ep2_cap_mbs8")
    p = m.predict({"ep_overlap": True, "ep_overlap_chunks": 2})
    line = next(x for x in p.modeled if x.startswith("EP dispatch chunks 1 -> 2"))
    assert "FSDP2's gathers of the experts once per chunk: 9 in place of the run's 3" in line
    assert abs(p.tokens_per_s_per_gpu / 81_454 - 1) < 0.05
    of = O._Regather.of
    try:
        O._Regather.of = classmethod(lambda cls, *a, **k: None)
        q = Model.from_run(PAIR / "ep2_cap_mbs8").predict({"ep_overlap": True, "ep_overlap_chunks": 2})
    finally:
        O._Regather.of = of
    assert q.tokens_per_s_per_gpu > p.tokens_per_s_per_gpu * 1.02  # the gathers cost the step


def test_regather_block_replaces_the_run_s_gathers_inside_a_chunk_loop():
    from tracelens.projection.mechanisms.overlap import _Regather

    P = _Plan([])
    P.dur = [2.0e6, 1.0e6, 3.0e6, 5.0e6]
    rg = _Regather(units=[(10, 0), (25, 1), (40, 2)], mean=2.0e6, copy_in=0.0, copy_out=0.0, stream=9, hook=1.36e6)
    n, ns = rg.block(P, 20, 30, 1, 2)  # one gather inside (unit 1), one chunk more: two
    assert (n, ns, P.dur[1], rg.replaced) == (2, 1.0e6, 0.0, 1)
    n, ns = rg.block(P, 50, 60, 1, 2)  # none inside (prefetched before the loop): the added chunk's one
    assert (n, ns) == (1, 2.0e6)
    n, _ = rg.block(P, 35, 45, 2, 1)  # fewer chunks: one fewer, never below none
    assert n == 0 and P.dur[2] == 0.0

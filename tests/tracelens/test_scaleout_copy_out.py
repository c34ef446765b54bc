"""The experts' FSDP all-gather copy-outs that a run at dp 1 does not have (`ScaleOut.expert_copy_out_ns`).

FSDP2 copies each gathered buffer out into the parameters (``split_with_sizes_copy`` under an ``FSDP::`` range, on the
compute stream). A run at dp 1 gathers no experts, so a projection from it to dp > 1 must add their copy-outs: one per
call of a MoE layer's experts, in the forward and again in the backward, once per EP dispatch chunk, each moving the
gathered experts at the run's own copy-out rate (its other units' copy-outs).

Checked against the raw trace JSON (the kernels linked to their op by ``External id``, the op's place by the FSDP
ranges enclosing it on its thread, the elements from its ``Input Dims``), never against the code's own reading of the
traces: the rate on `ep2_cap_prof` (ep 2, dp 1, 2 x H100), and the count and time of the copy-outs the 4 x H100 grid's
ep 2 x dp 2 runs at micro-batch 8 recorded with one and with two chunks (tests/fixtures/h100_4gpu_overlap_fsdp).
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest

FX = Path(__file__).resolve().parents[1] / "fixtures"
EP2CAP = FX / "h100_scaling" / "ep2_cap_prof"
PAIR = FX / "h100_4gpu_overlap_fsdp"


def _manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def _copy_outs(trace: Path, step: int) -> list[tuple[int, float, bool]]:
    """(elements of the gathered buffer, kernel µs, of the experts?) of every FSDP copy-out whose op ran inside the
    host range ``ProfilerStep#<step>``, from the raw JSON."""
    with gzip.open(trace, "rt") as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    st = next(e for e in ev if e.get("name") == f"ProfilerStep#{step}")
    lo, hi = st["ts"], st["ts"] + st["dur"]
    fsdp = [e for e in ev if str(e.get("name", "")).startswith("FSDP::") and e.get("cat") != "kernel"]
    kern = {}
    for e in ev:
        if e.get("cat") == "kernel" and "split_with_sizes_copy" in e.get("name", ""):
            kern.setdefault(e["args"].get("External id"), []).append(e["dur"])
    out = []
    for e in ev:
        if e.get("name") != "aten::split_with_sizes_copy" or e.get("cat") != "cpu_op" or not lo <= e["ts"] <= hi:
            continue
        outer = [r for r in fsdp if r["tid"] == e["tid"] and r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"]]
        if not outer:
            continue
        ks = kern.get(e["args"]["External id"], [])
        assert len(ks) == 1, (e["args"]["External id"], ks)
        out.append((math.prod(e["args"]["Input Dims"][0]), ks[0], any("experts" in r["name"] for r in outer)))
    return out


def test_copy_out_rate_is_the_runs_own_other_units_copy_outs():
    from tracelens.projection.scaleout import ScaleOut

    so = ScaleOut.from_run(EP2CAP)
    m = so.model
    slow = int(np.argmax([sum(c.values()) for c in m.base_by_rank]))  # the rank the projection's pieces come from
    step = int(_manifest(EP2CAP)["profile"]["step_start"])
    got = _copy_outs(EP2CAP / "traces" / f"rank{m.profiles[slow].rank}.json.gz", step)
    other = [(n, us) for n, us, ex in got if not ex]
    assert len(other) == 9 and not any(ex for *_, ex in got)  # a run at dp 1 gathers no experts
    # bf16 elements x 2 bytes over the kernels' time, in the calibrated time of the replay (its device factor)
    want = sum(n for n, _ in other) * 2 / (sum(us for _, us in other) * 1e3 * m.device_scale[slow])
    assert so.copy_out_rate()[0] == pytest.approx(want, rel=1e-6)
    assert 1.1e3 < want < 1.3e3  # bytes per ns: 1.21 TB/s


@pytest.mark.parametrize("run,overlap", [("ep2_cap_mbs8", False), ("ep2_cap_eo_mbs8", True)])
def test_the_projection_adds_the_copy_outs_the_grid_recorded(run, overlap):
    from tracelens.projection.scaleout import ScaleOut

    so = ScaleOut.from_run(EP2CAP)
    cfg, dp, ep = so.target(4, {"ep": 2, "ep_dispatch": "capacity", "micro_batch_size": 8, "ep_overlap": overlap})
    assert (dp, ep) == (2, 2)
    ns, n = so.expert_copy_out_ns(cfg, 4)
    man = _manifest(PAIR / run)
    assert bool(man["config"]["ep_overlap"]) is overlap and man["world_size"] == 4
    got = [(k, us) for k, us, ex in _copy_outs(PAIR / run / "traces" / "rank0.json.gz",
                                               int(man["profile"]["step_start"])) if ex]
    assert n == len(got) == (12 if overlap else 6)
    # each copies the rank's gathered experts: E/ep x 3 x d x F elements
    c = man["config"]
    assert {k for k, _ in got} == {c["n_routed_experts"] // 2 * 3 * c["d_model"] * c["moe_d_ff"]}
    measured = sum(us for _, us in got) * 1e3
    # the other units' rate is about 20 % slower than the experts' own copy-out (2.75 vs 2.33 ms at one chunk; the
    # two chunks' copy-outs ran beside twice the all-gathers: 5.49 vs 5.63)
    assert 0.9 * measured < ns < 1.25 * measured, (ns, measured)


def test_no_copy_outs_added_from_a_run_at_dp_above_one_or_to_dp_one():
    from tracelens.projection.scaleout import ScaleOut

    so = ScaleOut.from_run(EP2CAP)
    cfg, dp, _ = so.target(4, {"ep": 4, "ep_dispatch": "capacity", "micro_batch_size": 8})
    assert dp == 1 and so.expert_copy_out_ns(cfg, 4) == (0.0, 0)
    dp2 = ScaleOut.from_run(FX / "h100_scaling" / "dp2_prof")  # its own expert copies are scaled instead
    cfg, dp, _ = dp2.target(4, {"ep": 2, "ep_dispatch": "capacity", "micro_batch_size": 8})
    assert dp == 2 and dp2.expert_copy_out_ns(cfg, 4) == (0.0, 0)

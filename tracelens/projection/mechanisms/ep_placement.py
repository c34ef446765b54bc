"""``ep_placement``, ``ep_placement_loads``: which EP rank holds which routed expert, at the run's EP size.

Under expert parallelism each MoE layer's expert stage on a rank computes the rows its peers route to the experts
it holds; the rank with the most rows sets the pace, and the others wait for it inside the next all-to-all (a
collective ends when its last rank arrives). ``contiguous`` puts experts ``[p*E/ep, (p+1)*E/ep)`` on EP rank ``p``;
``balanced`` (trainer: moespec/placement.py) chooses, per layer, ``E/ep`` experts per rank so that the expected
loads, the per-expert totals of an earlier run's ``routing.json`` (``ep_placement_loads``), are as even as its
LPT-and-swap plan finds.

The edit, per rank and MoE layer, on the run's replay program (the same arithmetic as the layout mechanism's for
another EP size, layout.py: `experts_by_rank`, `expert_rows`, `scale_expert_stages`):

* the rows each rank's experts compute under the run's placement and under the new one: the run's routing counts
  per forward of the profiled steps (``RUN/routing.json``, per source rank, layer and logical expert) summed over
  the experts the rank holds, from every rank of its EP group; capacity dispatch keeps at most its per-peer
  capacity of them (so a placement also changes the rows dropped);
* the new placement is the trainer's: `moespec.placement.placement_plan` on the target's ``ep_placement_loads``
  (the file must be readable here), or the run's own as its ``routing.json`` recorded it;
* each layer's expert stage (GEMMs, SwiGLU, their copies) x the rank's new rows over its old, at the run's own time
  per row; the busiest rank of the group sets the pace: the change of this rank's wait for it (the busiest rank's
  extra rows at this rank's time per row, new minus the run's) goes on the same stage, so each rank's layer moves
  by the busiest rank's change. (The layout mechanism puts it into the next all-to-all; but the model replays each
  collective's transfer only, the run's waits are not in it, and a shorter wait cannot come off a transfer: on the
  ``ep4_cap_mbs16`` fixture that rule predicted -1.1 % for contiguous -> balanced, the stage's +0.0 %.)

Kept from the run: the all-to-alls' sizes (each rank sends its own routed rows, or a buffer of fixed size: a
placement moves where rows go, not how many a rank sends; at nccl levels 0-1 the receive side's bytes move with the
rows and are not re-timed), the memory (the same buffers and the same experts per rank). Refused in one line: a
run without ``routing.json`` (nothing says how many rows each expert received), a run without EP, a loads file that
cannot be read here.

Measured (docs/performance.md stop 24, 4 x H100, ``gpu_proxy_train`` EP 4 capacity 1.25): contiguous -> balanced
101,919 -> 101,796 tokens/s/GPU (-0.1 %), the dropped rows 4.78 % -> 2.71 %.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from . import layout as L
from .base import Change, Mechanism, WhatIfError, register

PLACEMENT_KEYS = ("ep_placement", "ep_placement_loads")


def imbalance(rows: dict, ep: int, layer: int) -> float:
    """Max / mean of the rows the ranks of each EP group compute in ``layer``, the worst group."""
    ranks = sorted(rows)
    worst = 1.0
    for g in range(0, len(ranks), ep):
        v = [rows[r][layer] for r in ranks[g:g + ep] if layer in rows[r]]
        if v and np.mean(v) > 0:
            worst = max(worst, max(v) / float(np.mean(v)))
    return worst


def pace(plan, w, waits: dict) -> float:
    """The change of each (layer, pass)'s wait for the busiest rank (`layout.scale_expert_stages`) on the rank's own
    expert stage, so that its stage and wait together move by exactly the busiest rank's change. The model replays
    each collective's transfer only (a peer's lateness is not this rank's work), so the run's waits are not in its
    all-to-alls and a shorter wait cannot come off them: it comes off the rows the rank ran inside its old wait.
    Returns the time added (ns)."""
    add = 0.0
    for (ly, bwd), dw in waits.items():
        js = L._stage_units(w, ly, bwd)
        tot = float(sum(plan.dur[j] for j in js))
        if tot <= 0 or abs(dw) < 1.0:
            continue
        f = max(tot + dw, 0.0) / tot
        for j in js:
            plan.dur[j] *= f
        add += tot * (f - 1.0)
    return add


def changes_placement(change: Change) -> bool:
    return any(change.old.get(k) != change.target.get(k) for k in PLACEMENT_KEYS)


@register
class EPPlacement(Mechanism):
    name = "ep_placement"
    keys = PLACEMENT_KEYS
    sigma: ClassVar[dict[str, float]] = {"placement_rows": 0.10}
    order = 56.0  # after the layout (55), which applies a placement itself when the EP size changes too
    summary = ("the rows each rank's experts compute under the new placement from the run's routing counts; the "
               "expert stage x its rows, the busiest rank of the group setting the pace")

    def applies(self, change: Change) -> bool:
        return changes_placement(change) and not L.changes_layout(change)

    def edit(self, plan, p, change: Change) -> float:
        model, old, new = change.model, change.old, change.new
        b = model.measured.get("layout")
        if b is None:
            raise WhatIfError(f"{model.run}: ep_placement needs a multi-GPU run with expert parallelism")
        world = b.world
        _, ep = L.dims(new, world)
        if ep < 2:
            raise WhatIfError(f"{model.run}: ep_placement places experts over EP ranks; the run has ep 1")
        if b.routing is None:
            raise WhatIfError(f"{model.run}: ep_placement needs the run's routing counts per expert "
                              f"(RUN/routing.json: {b.routing_note}); without them no rank's rows under another "
                              "placement are known")
        t0, t1 = change.t0, change.t1
        old_trainer = not L.gemms_stop_at_routed_rows(model.manifest)
        x0 = L.experts_by_rank(old, ep, b.routing, old)
        x1 = L.experts_by_rank(new, ep, b.routing, old)
        rows0 = L.expert_rows(old, world, t0, b.routing, old_trainer, x0)
        rows1 = L.expert_rows(new, world, t1, b.routing, old_trainer, x1)
        layers = L.moe_layers(old)
        w = p.work
        r = p.rank
        moved, waits = L.scale_expert_stages(plan, w, r, rows0, rows1, t0, t1, ep, ep, set(), layers)
        add = pace(plan, w, waits)
        ds = change.device_scale
        mean0 = float(np.mean([rows0[r][ly] * t1 / t0 for ly in layers]))
        mean1 = float(np.mean([rows1[r][ly] for ly in layers]))
        imb = ", ".join(f"L{ly} {imbalance(rows0, ep, ly):.2f} -> {imbalance(rows1, ep, ly):.2f}" for ly in layers)
        what = (f"balanced by {new.get('ep_placement_loads')}" if new.get("ep_placement") == "balanced"
                else "contiguous")
        change.modeled.append(
            f"ep_placement {old.get('ep_placement', 'contiguous')} -> {what} at ep {ep}: rank {r}'s experts compute "
            f"{mean1:,.0f} rows per MoE layer and micro-batch instead of {mean0:,.0f} ({b.routing.basis}); rows max / "
            f"mean over the EP group {imb}; the expert stage x its rows at the run's time per row "
            f"({ds * moved / 1e6:.2f} ms moved) and the change of its wait for the busiest rank ({ds * add / 1e6:+.2f} "
            "ms per step); all-to-all sizes and memory unchanged (the same buffers and experts per rank)")
        return (self.sigma["placement_rows"] * (moved + abs(add)) / max(float(p.step_ns), 1.0)) ** 2

"""``microbatches`` (gradient accumulation) of a run without pipeline parallelism.

Per-micro-batch units and launches repeat, per-step units (optimizer, gradient reduction: scale
``params``) do not. On a pipelined run the pipeline mechanism replays the schedule with the new count
instead (it holds this key for the per-rank replay).
"""

from __future__ import annotations

import numpy as np

from .base import Change, Mechanism, register


def _m(cfg: dict) -> int:
    return int(cfg.get("microbatches") or 1)


@register
class Microbatches(Mechanism):
    name = "microbatches"
    keys = ("microbatches",)
    sigma = {"microbatches": 0.05}
    order = 70.0
    summary = "per-micro-batch work and launches x the count, per-step work once"

    def applies(self, change: Change) -> bool:
        return _m(change.old) != _m(change.new)

    def edit(self, plan, p, change: Change) -> float:
        m0, m1 = _m(change.old), _m(change.new)
        w = p.work
        scale = w["scale"].to_numpy()
        f = m1 / m0
        per_step = set(np.flatnonzero(scale == "params").tolist())
        for i, (k, j) in enumerate(zip(plan.kind, plan.ref)):
            if k == 0 and j < len(w) and j in per_step:
                continue
            plan.gap[i] *= f
        for j in range(len(plan.dur)):
            if not (j < len(w) and j in per_step):
                plan.dur[j] *= f
        change.modeled.append(f"microbatches {m0} -> {m1}: per-micro-batch work and launches x{f:g}, per-step "
                              "work (optimizer, gradient reduction) once")
        if int(change.new.get("pp") or 1) > 1:
            change.notes.append("pipeline: the bubble's change with the number of micro-batches is not modeled")
        return self.sigma["microbatches"] ** 2

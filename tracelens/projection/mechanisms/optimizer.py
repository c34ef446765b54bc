"""``optimizer``: foreach AdamW (``adamw``) or the fused one (``adamw_fused``).

Foreach AdamW makes several passes over the optimizer state (one kernel family per foreach op); fused
makes one. One pass reads param, grad, exp_avg and exp_avg_sq and writes three of them: ~7 state-sized
transfers against ~2 per foreach op (read + write), at the measured kernels' achieved bandwidth. On a
CPU no change (fused AdamW is CUDA-only).
"""

from __future__ import annotations

import numpy as np

from .base import Change, Mechanism, register, unit_positions


def _opt(cfg: dict) -> str:
    return cfg.get("optimizer", "adamw")


@register
class Optimizer(Mechanism):
    name = "optimizer"
    keys = ("optimizer",)
    sigma = {"optimizer": 0.30}
    order = 80.0
    summary = "the optimizer's foreach passes over the state become one fused pass (or back), at the measured bandwidth"

    def applies(self, change: Change) -> bool:
        return _opt(change.old) != _opt(change.new)

    def edit(self, plan, p, change: Change) -> float:
        o0, o1 = _opt(change.old), change.new["optimizer"]
        modeled, notes = change.modeled, change.notes
        if p.device != "gpu":
            modeled.append(f"optimizer {o0} -> {o1}: no change on a CPU (fused AdamW is CUDA-only)")
            return 0.0
        w = p.work
        opt = np.flatnonzero((w["component"] == "optimizer step").to_numpy())
        if not len(opt):
            notes.append("no optimizer kernels in the profiled step: optimizer change not modeled")
            return 0.0
        meas = float(w["dur"].to_numpy()[opt].sum())
        # the passes are the distinct foreach kernel launches per parameter chunk: estimate them from the
        # kernel names (multi_tensor_apply families)
        fam = w["op"].to_numpy()[opt]
        n_pass = max(len({f for f in fam if "_foreach_" in str(f)}), 1)
        pos = unit_positions(plan)
        if o1 == "adamw_fused":
            new = meas * 7.0 / (2.0 * n_pass + 1e-9) if n_pass > 1 else meas
            new = min(new, meas)
            drop = {pos[int(j)] for j in opt[1:] if int(j) in pos}
            plan.dur[int(opt[0])] = new
            plan.drop_items(drop)
        else:
            new = meas * (2.0 * 6) / 7.0
            plan.dur[int(opt[0])] += new - meas
        ds = change.device_scale  # the calibrated time the prediction's table shows
        modeled.append(f"optimizer {o0} -> {o1}: optimizer step {ds * meas / 1e6:.2f} -> {ds * new / 1e6:.2f} ms "
                       f"({n_pass} foreach op families measured)")
        return (self.sigma["optimizer"] * abs(new - meas) / max(float(p.step_ns), 1.0)) ** 2

"""New GEMM shapes of a per-expert backend (loop, multistream): the BLAS library's host-side cost.

A per-expert backend runs one GEMM per expert on that expert's token count, a new shape nearly every
step; the BLAS library's host-side choice of kernel for a shape it has not seen costs a few hundred µs
(on the H100 proxy a GEMM whose shape already ran in the step took a median 33-41 µs of host time; of
the first ones 34 % were slow at micro-batch 2, 73 % at 12). The profiled step shows the share p0 that
paid a miss and its cost (:func:`shape_stats`); the run's timed steps, and a changed token count, meet
new shapes at the rate :func:`miss_rate` gives: each first GEMM's host gap moves by (rate - p0) x cost.
The calibration (``whatif._calibrate``) applies the unchanged run's own rate, so the host factor does
not absorb the run's trend.
"""

from __future__ import annotations

import numpy as np

from .base import Change, Mechanism, register
from .gemm_backend import PER_EXPERT

SIGMA_SHAPES = 0.30


def shape_stats(plan, p) -> tuple[list, float, float] | None:
    """From the profiled step's expert-stage GEMMs of a per-expert backend: the host items of the GEMMs whose
    shape is the first of its kind in the step, the share of them that paid a miss (host gap above the
    repeated shapes' median + 3 MADs) and the cost of a miss (median slow - median repeated). None when
    the step has too few of either kind to tell."""
    w = p.work
    stage = w["moe_stage"].to_numpy()
    op = w["op"].to_numpy()
    dims = w["dims"].to_numpy()
    items = [(i, int(j)) for i, (kd, j) in enumerate(zip(plan.kind, plan.ref))
             if kd == 0 and j < len(w) and stage[j] == "moe/experts" and op[j] in ("aten::mm", "aten::addmm")]
    seen: set = set()
    first, rep = [], []
    for i, j in items:
        (rep if dims[j] in seen else first).append(i)
        seen.add(dims[j])
    if len(first) < 20 or len(rep) < 20:
        return None
    g_rep = np.array([plan.gap[i] for i in rep])
    g_first = np.array([plan.gap[i] for i in first])
    med = float(np.median(g_rep))
    thr = med + 3 * 1.4826 * float(np.median(np.abs(g_rep - med)))
    slow = g_first > thr
    p0 = float(slow.mean())
    if not 0.0 < p0 < 1.0:
        return None
    return first, p0, float(np.median(g_first[slow])) - med


def miss_rate(p0: float, step: int, timed, t0: int, t1: int) -> float:
    """The mean share of new shapes over the run's timed steps at ``t1`` tokens, from ``p0`` measured at
    the profiled step ``step`` with ``t0``. A GEMM's row count is an expert's token count, drawn each step
    from a range that grows with the tokens; the library remembers every shape it has met, so after k
    steps of D draws from R values a draw is new with probability exp(-k D / R): p(k) = p0 ** (k / step)
    in the run (the steps of a per-expert run get faster as it goes: 421 -> 277 ms over the timed steps of
    the H100 proxy's loop micro-batch 2, where grouped runs are flat), and ** (t0 / t1) with the tokens."""
    ks = [k for k in timed if isinstance(k, int) and not isinstance(k, bool) and k >= 0] \
        if isinstance(timed, list) else []
    if step < 1 or not ks:
        return p0 ** (t0 / t1)
    return float(np.mean([p0 ** ((k / step) * (t0 / t1)) for k in ks]))


def shape_misses(plan, p, t0: int, t1: int, modeled: list | None, notes: list, timed=None) -> float:
    """Move each first GEMM's host gap by (rate - p0) x cost (module docstring); returns the variance.
    ``modeled`` None: say nothing (the calibration, an unchanged token count)."""
    st = shape_stats(plan, p)
    if st is None:
        if modeled is not None and t0 != t1:
            notes.append("per-expert GEMM shapes: too few in the profiled step to measure how often a new "
                         "shape costs host time: its change with the tokens is not modeled")
        return 0.0
    first, p0, cost = st
    rate = miss_rate(p0, int(p.step), timed, t0, t1)
    moved = 0.0
    for i in first:
        new_gap = max(plan.gap[i] + (rate - p0) * cost, 0.0)
        moved += new_gap - plan.gap[i]
        plan.gap_x[i] = min(max(plan.gap_x[i] + new_gap - plan.gap[i], 0.0), new_gap)  # the stage's own time
        plan.gap[i] = new_gap
    if modeled is not None:
        modeled.append(f"per-expert GEMMs: a new shape costs {cost / 1e3:.0f} µs of host time; {100 * p0:.0f} % of "
                       f"the step's {len(first)} first shapes were new at {t0} tokens in step {p.step}, "
                       f"{100 * rate:.0f} % predicted over the timed steps at {t1} "
                       f"({moved / 1e6:+.1f} ms of host time, profiled)")
    return (SIGMA_SHAPES * moved / max(float(p.step_ns), 1.0)) ** 2 if t0 != t1 else 0.0


@register
class Shapes(Mechanism):
    name = "gemm_shapes"
    keys = ()  # follows the tokens of a per-expert backend
    sigma = {"shapes": SIGMA_SHAPES}
    order = 30.0
    summary = ("per-expert backends: the share of new GEMM shapes (host-side kernel choice) over the run's timed "
               "steps at the new tokens, from the profiled step's first shapes")

    def applies(self, change: Change) -> bool:
        return change.old["grouped_gemm_backend"] in PER_EXPERT and change.new["grouped_gemm_backend"] in PER_EXPERT

    def edit(self, plan, p, change: Change) -> float:
        return shape_misses(plan, p, change.t0, change.t1, change.modeled if change.s_tok != 1.0 else None,
                            change.notes, (change.model.manifest.get("metrics") or {}).get("timed_steps"))

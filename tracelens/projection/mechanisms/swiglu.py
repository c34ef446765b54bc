"""``expert_swiglu``: the routed experts' SwiGLU, eager (``torch``) or the fused Triton pair (``triton``).

Per MoE layer the eager kernels become the fused pair (or back), by the bytes each moves at the
measured kernels' bandwidth (:func:`swiglu`). Peak memory is not modeled (the fused pair keeps R x F
fewer elements per layer). On a CPU trace: no model (the fused kernel runs under Triton's interpreter).
"""

from __future__ import annotations

import numpy as np

from .base import Change, Mechanism, register, unit_positions

SIGMA_SWIGLU = 0.30


def swiglu(plan, p, e0: str, e1: str, modeled: list, notes: list) -> float:
    """``expert_swiglu``: per MoE layer, the eager activation (forward ``silu`` + ``mul``; backward two
    ``mul``, ``silu_backward`` and the ``cat`` of ``h.chunk(2)``'s backward, the first ``cat`` after the
    ``silu_backward`` before any GEMM) against the fused pair (``_swiglu_fwd_kernel`` /
    ``_swiglu_bwd_kernel``), by the bytes each moves at the measured kernels' bandwidth: the forward mul
    and the fused forward both move 3 R F elements (read gate and up, write the product), so the fused
    forward lasts as long as that layer's eager mul and the fused backward (5 R F: read gate, up and the
    output gradient, write both input gradients) 5/3 of it; eager is 5 R F forward (silu 2, mul 3) and 13
    R F backward (mul 3, mul 3, silu_backward 3, cat 4). Launches removed with the eager kernels; the
    other way the fused kernels are scaled up, without the eager kernels' extra launches."""
    if p.device != "gpu":
        modeled.append(f"expert_swiglu {e0} -> {e1}: no model on a CPU trace (the fused kernel runs under "
                       "Triton's interpreter there)")
        return 0.0
    w = p.work
    op = w["op"].to_numpy()
    name = w["name"].astype(str).to_numpy()
    exp = (w["moe_stage"] == "moe/experts").to_numpy()
    back = w["backward"].to_numpy()
    layer = w["layer"].to_numpy()
    pos = unit_positions(plan)
    before = after = 0.0
    done: list[int] = []
    if e1 == "triton":
        gemm = np.isin(op, ("aten::mm", "aten::addmm", "aten::_grouped_mm", "aten::bmm")) | np.char.find(
            name.astype(str), "gmm") >= 0
        drop: set[int] = set()
        for ly in sorted({int(v) for v in layer[exp]}):
            at = exp & (layer == ly)
            f_silu = np.flatnonzero(at & ~back & (op == "aten::silu"))
            f_mul = np.flatnonzero(at & ~back & (op == "aten::mul"))
            b_silu = np.flatnonzero(at & back & (op == "aten::silu_backward"))
            b_mul = np.flatnonzero(at & back & (op == "aten::mul"))
            if not (len(f_silu) == len(f_mul) == len(b_silu) == 1 and len(b_mul) == 2):
                notes.append(f"expert_swiglu: layer {ly}: the eager SwiGLU kernels (1 silu + 1 mul forward, "
                             "2 mul + 1 silu_backward backward) were not found as expected; layer not modeled")
                continue
            cat = []
            for j in range(int(b_silu[0]) + 1, len(w)):  # launch order: the chunk's cat follows silu_backward
                if at[j] and back[j] and gemm[j]:
                    break
                if at[j] and back[j] and op[j] == "aten::cat":
                    cat = [j]
                    break
            old_units = [int(f_silu[0]), int(f_mul[0]), int(b_silu[0]), *map(int, b_mul), *cat]
            d_mul = float(plan.dur[int(f_mul[0])])
            before += sum(float(plan.dur[j]) for j in old_units)
            plan.dur[int(f_mul[0])] = d_mul  # the fused forward: the mul's bytes at the mul's bandwidth
            plan.dur[int(b_silu[0])] = d_mul * 5.0 / 3.0
            after += d_mul * (1.0 + 5.0 / 3.0)
            drop |= {pos[j] for j in (int(f_silu[0]), *map(int, b_mul), *cat) if j in pos}
            done.append(ly)
        plan.drop_items(drop)
    else:
        for j in np.flatnonzero(exp):
            f = 5.0 / 3.0 if "_swiglu_fwd_kernel" in name[j] else 13.0 / 5.0 if "_swiglu_bwd_kernel" in name[j] else 0.0
            if f:
                before += float(plan.dur[j])
                plan.dur[j] = float(plan.dur[j]) * f
                after += float(plan.dur[j])
                done.append(int(layer[j]))
        done = sorted(set(done))
        if done:
            notes.append("expert_swiglu triton -> torch: the eager kernels' extra launches (4 per layer) are not "
                         "added")
    if not done:
        notes.append(f"expert_swiglu {e0} -> {e1}: no SwiGLU kernels of the routed experts in the profiled step; "
                     "not modeled")
        return 0.0
    modeled.append(f"expert_swiglu {e0} -> {e1}: SwiGLU of {len(done)} MoE layer(s) {before / 1e6:.2f} -> "
                   f"{after / 1e6:.2f} ms (bytes moved at the measured kernels' bandwidth); peak memory not "
                   "modeled (the fused pair keeps R x F fewer elements per layer)")
    return (SIGMA_SWIGLU * abs(after - before) / max(float(p.step_ns), 1.0)) ** 2


def _sw(cfg: dict) -> str:
    return cfg.get("expert_swiglu", "torch")


@register
class ExpertSwiGLU(Mechanism):
    name = "expert_swiglu"
    keys = ("expert_swiglu",)
    sigma = {"swiglu": SIGMA_SWIGLU}
    order = 90.0
    summary = "the eager SwiGLU kernels of each MoE layer become the fused pair (or back), by bytes moved"

    def applies(self, change: Change) -> bool:
        return _sw(change.old) != _sw(change.new)

    def edit(self, plan, p, change: Change) -> float:
        return swiglu(plan, p, _sw(change.old), _sw(change.new), change.modeled, change.notes)

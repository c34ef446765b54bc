"""``micro_batch_size``: the tokens of a micro-batch.

Token-proportional units keep their fixed part (the fastest instance of the same kernel in the step)
and scale their variable part with the tokens; units of a chunked loss (``loss_fusion``) repeat with
the number of chunks, launches included; per-step units (optimizer, gradient reduction) stay; host
launch costs stay. Expert GEMMs are left to the backend mechanism when a kernel table gives their
timings at the new rows.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from .base import Change, Mechanism, register, unit_positions


def chunk_units(w: pd.DataFrame, cfg: dict) -> np.ndarray:
    """Units of a chunked (fused) loss: their number follows the tokens, not their size. A unit of the
    loss loop works on a chunk of ``loss_chunk_size`` tokens against the ``vocab_size`` output rows:
    its op's input shapes hold both numbers."""
    chunk, vocab = int(cfg.get("loss_chunk_size") or 0), int(cfg.get("vocab_size") or 0)
    if not cfg.get("loss_fusion") or chunk <= 0 or vocab <= 0 or "dims" not in w:
        return np.zeros(len(w), bool)
    out = np.zeros(len(w), bool)
    for i, d in enumerate(w["dims"].to_numpy()):
        nums = {int(x) for x in re.findall(r"\d+", str(d))} if d else set()
        out[i] = chunk in nums and vocab in nums
    return out


@register
class Tokens(Mechanism):
    name = "tokens"
    keys = ("micro_batch_size",)
    sigma = {"tokens": 0.10}
    order = 20.0
    summary = ("token-proportional work x tokens above each kernel's fixed part (the fastest instance of its name "
               "in the step); a chunked loss repeats its chunks; per-step work and launch costs kept")

    def applies(self, change: Change) -> bool:
        return change.s_tok != 1.0

    def edit(self, plan, p, change: Change) -> float:
        w = p.work
        old, new = change.old, change.new
        t0, t1, s_tok = change.t0, change.t1, change.s_tok
        dur0 = np.asarray(plan.dur, dtype=float)
        names = w["name"].to_numpy()
        scale = w["scale"].to_numpy()
        expert = w["expert"].to_numpy()
        floors = pd.Series(dur0[: len(w)]).groupby(names).transform("min").to_numpy()
        chunked = chunk_units(w, old)
        tok = (scale == "tokens") & ~chunked & ~(expert & (change.model.table is not None))
        for j in np.flatnonzero(tok):
            f = min(floors[j], dur0[j])
            plan.dur[j] = f + s_tok * (dur0[j] - f)
        if chunked.any():
            reps = math.ceil(t1 / int(old["loss_chunk_size"])) / math.ceil(t0 / int(old["loss_chunk_size"]))
            pos = unit_positions(plan)
            for j in np.flatnonzero(chunked):
                plan.dur[j] = dur0[j] * reps
                i = pos.get(int(j))
                if i is not None:
                    plan.gap[i] *= reps
        d = float(np.abs(np.asarray(plan.dur[: len(w)]) - dur0[: len(w)]).sum())
        change.modeled.append(f"micro_batch_size {old['micro_batch_size']} -> {new['micro_batch_size']}: token-"
                              f"proportional work x{s_tok:g} above each kernel's fixed part"
                              + (f"; chunked loss x{reps:g} launches" if chunked.any() else "")
                              + "; per-step work and host launch costs unchanged")
        return (self.sigma["tokens"] * d / float(p.step_ns)) ** 2

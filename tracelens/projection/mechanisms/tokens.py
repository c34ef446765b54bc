"""``micro_batch_size``: the tokens of a micro-batch.

Token-proportional units scale their variable part with the tokens above a fixed part that depends on how
full the kernel kept the GPU (``fill``, its waves of work: `profile._attach_fill`): a kernel with a wave or
more scales above the launch floor (the step's shortest unit), never below one wave; an under-filled one
(or one whose fill is unknown) keeps the fastest instance of the same kernel in the step as its fixed part; units of a chunked loss (``loss_fusion``) repeat with
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
    its op's input shapes hold both numbers, and it runs once per chunk: its op and input shapes occur at
    least once per full chunk of each micro-batch (``m * (tokens // loss_chunk_size)`` times in the step).
    The shapes alone also match the work on the ``[vocab, d_model]`` head and embedding where ``d_model`` equals
    the chunk (2,048 in ``gpu_proxy_train``): the gradient clipping's ``pow`` / ``sum`` / ``mul_`` on those
    gradients, FSDP2's copy-in of the root's gradient, the loss's zeroing and scaling of its weight-gradient
    buffer, once a step or a micro-batch; the count tells them apart (gpu1_prof at micro-batch 16: 16 chunks,
    the loop's ``mm`` / ``add_`` / ``_LinearCEFn`` 16 times or more, those 1-2 times)."""
    chunk, vocab = int(cfg.get("loss_chunk_size") or 0), int(cfg.get("vocab_size") or 0)
    if not cfg.get("loss_fusion") or chunk <= 0 or vocab <= 0 or "dims" not in w:
        return np.zeros(len(w), bool)
    dims = w["dims"].to_numpy()
    out = np.zeros(len(w), bool)
    for i, d in enumerate(dims):
        nums = {int(x) for x in re.findall(r"\d+", str(d))} if d else set()
        out[i] = chunk in nums and vocab in nums
    tokens = int(cfg.get("micro_batch_size") or 0) * int(cfg.get("seq_len") or 0)
    per_chunk = int(cfg.get("microbatches") or 1) * max(tokens // chunk, 1)
    if out.any() and per_chunk > 1 and "op" in w:
        key = pd.Series(w["op"].astype(str).to_numpy()[out] + "|" + pd.Series(dims[out]).astype(str).to_numpy())
        count = key.map(key.value_counts()).to_numpy()
        out[np.flatnonzero(out)[count < per_chunk]] = False
    return out


def launch_floor(dur: np.ndarray) -> float:
    """The cost of a kernel that does (almost) nothing: the step's shortest unit of device work (ns)."""
    d = np.asarray(dur, dtype=float)
    d = d[d > 0]
    return float(d.min()) if len(d) else 0.0


@register
class Tokens(Mechanism):
    name = "tokens"
    keys = ("micro_batch_size",)
    sigma = {"tokens": 0.10}
    order = 20.0
    summary = ("token-proportional work x tokens above each kernel's fixed part (a kernel that fills the GPU: the "
               "launch floor, not below one wave; an under-filled one: the fastest instance of its name in the step); "
               "a chunked loss repeats its chunks; per-step work and launch costs kept")

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
        fill = w["fill"].to_numpy(float) if "fill" in w else np.full(len(w), np.nan)
        floor = launch_floor(dur0[: len(w)])
        chunked = chunk_units(w, old)
        tok = (scale == "tokens") & ~chunked & ~(expert & (change.model.table is not None))
        full = 0
        for j in np.flatnonzero(tok):
            if fill[j] >= 1.0:  # a full GPU: its waves follow the tokens, above the cost of any kernel
                f = min(floor, dur0[j])
                plan.dur[j] = f + (dur0[j] - f) * max(s_tok, 1.0 / fill[j])
                full += 1
            else:  # under-filled (or fill unknown): the part the fastest instance of its kernel also takes stays
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
                              f"proportional work x{s_tok:g} above each kernel's fixed part ({full} of "
                              f"{int(tok.sum())} kernels fill the GPU: above the launch floor "
                              f"{floor / 1e3:.1f} µs, not below one wave)"
                              + (f"; chunked loss x{reps:g} launches" if chunked.any() else "")
                              + "; per-step work and host launch costs unchanged")
        return (self.sigma["tokens"] * d / float(p.step_ns)) ** 2

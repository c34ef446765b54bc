"""The sharding planner: the layouts of a model that fit N GPUs at a global batch, ranked by projected tokens/s/GPU.

    >>> from tracelens.analysis import memory as M
    >>> from tracelens.projection import planner, scaleout
    >>> mc = M.load_model_config("gpu_proxy_train")
    >>> so = scaleout.ScaleOut.from_run("runs/ep4")                  # the profile the speeds are projected from
    >>> p = planner.plan(mc, gpus=64, global_batch=512, device_bytes=M.device_memory("H100"), scaleout=so)
    >>> p.rows[0]                   # the best layout: tokens/s/GPU, step, bubble, all-to-all share, peak, profile
    >>> print(p.to_text())

The layouts are `tracelens memory --sweep`'s (`analysis.memory.sweep`: pp, vpp, ep, micro-batch, recompute; the
gradient accumulation from the global batch; the projected peak within the device memory less the headroom), with
tensor and context parallelism left out (the trainer has neither). Each is projected from the profile
(`scaleout.ScaleOut.project`: its bubble, exposed all-to-all share and peak memory scaled by the run's measured /
projected peak) and ranked by tokens/s/GPU; a layout the projection cannot make (a pipeline layout the trainer
rejects, a knob without a mechanism) is listed with its one-line reason. Without a profile the layouts keep the
sweep's order (theoretical bubble, then communication bytes), and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis import memory as M
from .mechanisms.base import WhatIfError
from .scaleout import Projection, ScaleOut

GIB = float(1 << 30)
DEFAULT_MBS = (1, 2, 4, 8, 16)


@dataclass
class Plan:
    """The ranked layouts (what `tracelens plan` prints and writes with --json)."""

    source: str  # the model config
    gpus: int
    global_batch: int
    device_bytes: int
    headroom: float
    run: str | None  # the profile the speeds were projected from
    rows: list = field(default_factory=list)  # per layout, best first (dicts)
    refused: list = field(default_factory=list)  # (layout label, reason)
    candidates: int = 0  # layouts that fit (before projection)
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"config": self.source, "gpus": self.gpus, "global_batch": self.global_batch,
                "device_gib": self.device_bytes / GIB, "headroom": self.headroom, "projected_from": self.run,
                "candidates": self.candidates, "layouts": self.rows,
                "not_projected": [{"layout": a, "reason": b} for a, b in self.refused], "notes": self.notes}

    def to_text(self, top: int = 15) -> str:
        head = (f"{self.candidates} layout(s) of {self.gpus} GPUs fit {self.device_bytes / GIB:.1f} GiB (headroom "
                f"{100 * self.headroom:.0f}%) at a global batch of {self.global_batch} sequences; ")
        head += (f"ranked by tokens/s/GPU projected from {self.run}" if self.run else
                 "no profile given (--from RUN): in memory --sweep's order (theoretical bubble, then communication)")
        out = [head]
        if self.run:
            out.append(f"{'#':>3}  {'layout':<38} {'tokens/s/GPU':>12} {'step ms':>8} {'bubble':>7} {'a2a %':>6} "
                       f"{'peak GiB':>9}  status")
            for i, r in enumerate(self.rows[:top], 1):
                pk = f"{r['peak_gib']:.1f}{'' if r['fits'] else ' OOM'}" if r["peak_gib"] is not None else "-"
                out.append(f"{i:>3}  {r['label']:<38} {r['tokens_per_s_per_gpu']:>12,.0f} {1e3 * r['step_s']:>8.1f} "
                           f"{100 * r['bubble']:>6.1f}% {100 * r['a2a_share']:>5.1f}% {pk:>9}  {r['status']}")
        else:
            out.append(f"{'#':>3}  {'layout':<38} {'bubble':>7} {'comm GiB':>9} {'peak GiB':>9}")
            for i, r in enumerate(self.rows[:top], 1):
                out.append(f"{i:>3}  {r['label']:<38} {100 * r['bubble']:>6.1f}% {r['comm_gib']:>9.2f} "
                           f"{r['peak_gib']:>9.2f}")
        for label, why in self.refused[:top]:
            out.append(f"  not projected: {label}: {why}")
        if len(self.refused) > top:
            out.append(f"  ... and {len(self.refused) - top} more not projected (--json lists them)")
        out.extend(f"note: {n}" for n in self.notes)
        if self.run:
            out.append("layout: dp data parallel (trainer dp), ep expert parallel, pp pipeline stages (vpp virtual, then "
                       "the schedule), mbs micro-batch size, m micro-batches per step, rc recompute; bubble: pipeline "
                       "bubble / step; a2a %: exposed all-to-all / step; peak: the memory projection x the profile's "
                       "measured / projected peak. Every row is a projection from the profile named above")
        return "\n".join(out)


def _changes(cfg: dict, r) -> dict:
    """The trainer keys of one sweep row."""
    rc = r.recompute
    ids = [] if rc == "none" else list(range(int(cfg["n_layers"]))) if rc == "full" else list(rc)
    return {"ep": int(r.ep), "pp": int(r.pp), "vpp": int(r.vpp), "pipeline_schedule": str(r.schedule),
            "microbatches": int(r.microbatches), "micro_batch_size": int(r.mbs), "recompute_layer_ids": ids}


def plan(mc: M.ModelConfig, gpus: int, global_batch: int, device_bytes: int, scaleout: ScaleOut | None = None,
         mbs: tuple[int, ...] = DEFAULT_MBS, headroom: float = 0.05, source: str | None = None) -> Plan:
    """The layouts of ``mc``'s model on ``gpus`` GPUs at ``global_batch`` sequences that fit ``device_bytes``, ranked
    by tokens/s/GPU projected from ``scaleout``'s profile (module docstring). The config's own keys (sequence length,
    sync-free level, dispatch path, backend, ...) go with every layout; bad input raises a one-line `TraceError`."""
    cfg = mc.config
    base = M.resolve_layout(cfg, world=gpus, pp=1, ep=1, source=source or mc.source)
    space = M.SweepSpace(tp=(1,), cp=(1,), mbs=tuple(mbs))
    df = M.sweep(cfg, gpus, device_bytes, global_batch, base=base, space=space, headroom=headroom)
    p = Plan(source or mc.source, gpus, global_batch, device_bytes, headroom, scaleout.run if scaleout else None,
             candidates=len(df))
    if df.empty:
        p.notes.append(M.why_none_fit(df, gpus, global_batch, device_bytes * (1 - headroom) / GIB))
    p.notes.append("tensor and context parallelism are not enumerated: the trainer implements DP (FSDP2 / DDP), EP "
                   "and PP only")
    if scaleout is None:
        p.rows = [{"label": _label(r), **_sweep_fields(r)} for r in df.itertuples(index=False)]
        return p
    from .whatif import NEUTRAL

    own = {k: v for k, v in cfg.items() if k in scaleout.config and scaleout.config.get(k) != v
           and k not in NEUTRAL and k not in ("ep", "dp", "pp", "vpp", "pipeline_schedule", "microbatches",
                                              "micro_batch_size", "recompute_layer_ids")}
    if own:
        p.notes.append("the profile's config differs from the plan's in " + ", ".join(f"{k}={v!r}" for k, v in own.items())
                       + ": predicted by the what-if's mechanisms at the profile's GPUs")
    rows = []
    for r in df.itertuples(index=False):
        ch = {**own, **_changes(cfg, r)}
        try:
            pr: Projection = scaleout.project(gpus, ch)
        except WhatIfError as e:
            p.refused.append((_label(r), " ".join(str(e).split())))
            continue
        rows.append({"label": pr.label() + (f" rc={r.recompute}" if r.recompute != "none" else ""), **_sweep_fields(r),
                     "tokens_per_s_per_gpu": pr.tokens_per_s_per_gpu, "step_s": pr.step_s, "bubble": pr.bubble,
                     "a2a_share": pr.a2a_share, "peak_gib": pr.peak_gib, "fits": pr.fits, "status": pr.status,
                     "projected_from": pr.run, "components_ms": {k: 1e3 * v for k, v in pr.components.items()},
                     "notes": pr.notes})
    rows.sort(key=lambda x: (not x["fits"], -x["tokens_per_s_per_gpu"]))
    p.rows = rows
    if rows and not rows[0]["fits"]:
        p.notes.append("no layout fits once the profile's measured / projected peak is applied")
    return p


def _label(r) -> str:
    v = f" vpp{r.vpp}" if r.vpp > 1 else ""
    pp = f" pp{r.pp}{v} {r.schedule}" if r.pp > 1 else ""
    rc = f" rc={r.recompute}" if r.recompute != "none" else ""
    return f"dp{r.dp // r.ep} ep{r.ep}{pp} mbs{r.mbs} m{r.microbatches}{rc}"


def _sweep_fields(r) -> dict:
    return {"pp": int(r.pp), "vpp": int(r.vpp), "ep": int(r.ep), "dp": int(r.dp) // int(r.ep), "mbs": int(r.mbs),
            "microbatches": int(r.microbatches), "recompute": r.recompute, "schedule": r.schedule,
            "comm_gib": float(r.comm_gib), "peak_gib": float(r.peak_gib), "bubble": float(r.bubble)}


__all__ = ["DEFAULT_MBS", "Plan", "plan"]

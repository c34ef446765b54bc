"""Pipeline knobs of a pipelined run: ``pipeline_schedule``, ``vpp``, ``pipeline_layout``,
``pipeline_layer_costs`` (and ``microbatches`` when pp > 1); a change of ``pp`` itself is pp_layout.py's.

``pipeline_whatif.py`` replays the new schedule's action order over the run's measured stage costs,
re-split by piece into the new layout, with the run's per-hand-off overhead, plus the run's rest of the
step. The per-rank replay runs the other knobs of the what-if on the run's own pipeline (this mechanism
holds its keys there); their ratio to the base step scales the stage costs and the rest.
"""

from __future__ import annotations

from .. import pipeline_whatif as PW
from .base import Change, Mechanism, WhatIfError, register


@register
class Pipeline(Mechanism):
    name = "pipeline"
    keys = PW.PIPELINE_KEYS
    sigma = {"pipeline": 0.12}
    phase = "step"
    order = 100.0
    summary = ("the new schedule's action order replayed over the run's measured stage costs, re-split by piece into "
               "the new layout, with the run's per-hand-off overhead; the rest of the step kept")

    def applies(self, change: Change) -> bool:  # a change of pp itself: pp_layout.py
        same_pp = int(change.old.get("pp") or 1) == int(change.target.get("pp") or 1)
        return same_pp and PW.changes_pipeline(change.old, change.target)

    def hold(self, change: Change) -> tuple[str, ...]:
        return PW.PIPELINE_KEYS + ("microbatches",) if self.applies(change) else ()

    def finish(self, change: Change, step_s: float, components: dict, rank: int) -> tuple[float, dict, float]:
        """The new schedule replayed over the run's measured stage costs (`pipeline_whatif`), scaled by what
        the other knobs did to the step; the reported rank's components: its pipeline work changes with its
        actions, the rest of the change is idle (the bubble), no part below zero."""
        model = change.model
        modeled, notes = change.modeled, change.notes
        try:
            if model.pipe_base is None:
                model.pipe_base = PW.pipeline_base(model.run, manifest=model.manifest)
            scale = step_s / model.base_step_s if model.base_step_s > 0 else 1.0
            pr = PW.predict_pipeline(model.pipe_base, change.target, scale)
        except PW.PipelineWhatIfError as e:
            raise WhatIfError(str(e)) from None
        base = model.pipe_base
        modeled.extend(pr.modeled)
        notes.extend(pr.notes + base.notes)
        if abs(base.step_ns / 1e9 / model.base_step_s - 1.0) > 0.05:
            notes.append(f"pipeline: the step is predicted from the steady steps ({base.step_basis}; median "
                         f"{base.step_ns / 1e6:.1f} ms), not the manifest's mean step {1e3 * model.base_step_s:.1f} ms "
                         "(a warm-up or trace-export step in that mean?)")
        step = pr.step_ns / 1e9
        pp_rank = base.rank_to_pp.get(rank)
        d_busy = (pr.busy_ns[pp_rank] - pr.base_busy_ns[pp_rank]) / 1e9 if pp_rank is not None else 0.0
        out = dict(components)
        work = [c for c in out if c not in ("collective waits", "sync waits", "launch-bound idle", "pipeline bubble",
                                            "other")]
        tot_work = sum(out[c] for c in work)
        if tot_work > 0 and d_busy:
            f = max(tot_work + d_busy, 0.0) / tot_work
            for c in work:
                out[c] *= f
        rest = step - sum(out.values())
        for c in ("pipeline bubble", "other", "launch-bound idle", "sync waits", "collective waits"):
            if rest >= 0:
                break
            take = min(out.get(c, 0.0), -rest)
            out[c] = out.get(c, 0.0) - take
            rest += take
        if rest >= 0:
            out["pipeline bubble"] = out.get("pipeline bubble", 0.0) + rest
        else:  # still too much: everything shrinks in proportion
            tot = sum(out.values())
            out = {c: v * step / tot for c, v in out.items()} if tot > 0 else out
        var = (self.sigma["pipeline"] * pr.window_ns / max(pr.step_ns, 1.0)) ** 2
        return step, {c: float(v) for c, v in out.items()}, var

"""The guided search driven by the what-if model (``tracelens.projection.whatif``).

After the baseline trial, every allowed point of the space that has not run is predicted from the
nearest measured trial (fewest knobs changed; ties go to the incumbent): the model replays that
trial's profiled step with the point's knobs, calibrated to the trial's measured step time, and
projects its peak memory. Points predicted not to fit in memory are never run. The point with the
best predicted objective runs next; it is kept when it beats the incumbent by more than the noise
(:meth:`autotune.sweep.Sweep.better`), and its own trace becomes the anchor of the points nearest to
it: the model is refit on every measurement. The search stops when no candidate's predicted gain over
the incumbent beats the measured noise (``guided.noise_z`` standard errors of the incumbent's
objective, at least ``guided.min_gain``), or the budget is spent.

A knob the model has no mechanism for (``compile``, ``cuda_graphs``: what they buy depends on code
generation no trace of the unchanged run shows) does not stop the model: a point is predicted only from
a measured trial with the same values of every such knob (its context). When no prediction beats the
noise and some context has never run, the search measures it once, at the allowed point nearest the
incumbent, and goes on from there (kept or not, that trial anchors its context's predictions).

The policy's rules (``autotune/policy.py``) are no longer what orders the moves; the findings that
motivate them are still shown in each trial's report. Without a usable model (no profiled step in the
baseline's traces, a trainer that is not ours, a space of unmodeled knobs only) the sweep falls back to
the rules.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .space import key_of
from .runner import timed_steps_of


class ModelSearch:
    def __init__(self, sweep):
        self.sw = sweep
        self.space = sweep.space
        self.models: dict[int, Any] = {}
        self.failed: dict[int, str] = {}
        self.why = ""
        self.refused: set[str] = set()  # points the model gave no prediction for (said once each)
        self.predictions: list[dict] = list(sweep.store.get_meta("predictions", []) or [])

    # ------------------------------------------------------------------ models per trial
    def model_of(self, trial: dict):
        tid = trial["id"]
        if tid in self.models:
            return self.models[tid]
        if tid in self.failed:
            return None
        try:
            from tracelens.projection.whatif import Model

            m = Model.from_run(Path(trial["run_dir"]), kernel_table=self.space.kernel_table,
                               capacity_gib=self.space.memory_gib)
        except Exception as e:  # noqa: BLE001 - a trial the model cannot read is measured, not predicted from
            self.failed[tid] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            return None
        self.models[tid] = m
        return m

    def ready(self, base: dict) -> bool:
        """Whether the model can steer this space: some knob has a mechanism (asked first: then the
        baseline's traces are not even read) and the baseline's run gives a model."""
        if len(self.unmodeled) == len(self.space.knobs):
            self.why = f"the model has no mechanism for any knob of the space ({', '.join(self.unmodeled)})"
            return False
        if self.model_of(base) is None:
            self.why = self.failed.get(base["id"], "no model")
            return False
        return True

    @property
    def unmodeled(self) -> list[str]:
        """The space's knobs the model has no mechanism for (e.g. ``compile``): it predicts a point only from a
        measured trial with the same values of all of them (its *context*); each context is measured once,
        from the point nearest the incumbent, before the search may stop."""
        from tracelens.projection.whatif import MODELED, NEUTRAL

        return [k for k in self.space.knobs if k not in MODELED and k not in NEUTRAL]

    def _context(self, knobs: dict) -> tuple:
        return tuple(repr(knobs.get(k)) for k in self.unmodeled)

    # ------------------------------------------------------------------ predictions
    def _anchor(self, point: dict, anchors: list[dict], best: dict) -> dict:
        def dist(t):
            return sum(1 for k in self.space.knobs if t["knobs"].get(k) != point.get(k))

        return min(anchors, key=lambda t: (dist(t), t["id"] != best["id"], -t["id"]))

    def predict(self, point: dict, anchor: dict) -> dict | None:
        m = self.model_of(anchor)
        if m is None:
            return None
        try:
            p = m.predict({**self.space.fixed, **point})
        except Exception as e:  # noqa: BLE001 - a point the model refuses is left for the rules/grid
            return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"}
        base_obj = anchor["objective"]
        if self.space.maximize:
            obj = base_obj * p.tokens_per_s_per_gpu / p.base_tokens_per_s_per_gpu
        else:
            obj = base_obj * p.step_s / p.base_step_s
        top = sorted(((p.components.get(c, 0.0) - p.base_components.get(c, 0.0), c) for c in p.components),
                     key=lambda x: x[0])
        change = ", ".join(f"{c} {1e3 * d:+.1f} ms" for d, c in top[:2] if d < 0)
        return {"objective": obj, "uncertainty": p.uncertainty, "fits": p.fits, "peak_gib": p.peak_gib,
                "anchor": anchor["id"], "modeled": p.modeled, "change": change,
                "components_ms": {k: 1e3 * v for k, v in p.components.items()},
                "base_components_ms": {k: 1e3 * v for k, v in p.base_components.items()}}

    # ------------------------------------------------------------------ the search
    def run(self, best: dict) -> str:
        sw, space = self.sw, self.space
        skipped_oom: set[str] = set()
        explored = 0  # neighbour checks run (guided.explore)
        while sw.budget_left():
            sw.stop = None
            # anchors: the trials this search has visited (so a resumed sweep replays the same decisions)
            seen = set(sw.visited)
            measured = [t for t in sw.store.trials(finished_only=True)
                        if t["status"] == "ok" and t["run_dir"] and key_of(t["knobs"]) in seen]
            anchors = [t for t in measured if self.model_of(t) is not None] or [best]
            by_ctx: dict[tuple, list[dict]] = {}
            for t in anchors:
                by_ctx.setdefault(self._context(t["knobs"]), []).append(t)
            cands, unexplored = [], []
            for p in space.grid():
                k = key_of(p)
                if k in seen or k in skipped_oom:
                    continue
                same = by_ctx.get(self._context(p))
                if not same:  # a value of a knob the model cannot predict, never measured with these
                    unexplored.append(p)
                    continue
                pr = self.predict(p, self._anchor(p, same, best))
                if pr is None or "error" in pr:  # the model refuses it: left for the rules / exploration
                    if pr is not None and k not in self.refused:
                        self.refused.add(k)
                        sw.log(f"[autotune] no prediction for {_fmt(p)}: {pr['error']}")
                    unexplored.append(p)
                    continue
                if not pr["fits"]:
                    skipped_oom.add(k)
                    sw.log(f"[autotune] not run: {_fmt(p)} predicted out of memory "
                           f"({pr['peak_gib']:.1f} GiB projected)")
                    self._record(None, p, pr, "predicted OOM: not run")
                    continue
                cands.append((pr["objective"], p, pr))
            stop = None
            if not cands:
                stop = "every allowed point measured or predicted not to fit"
            else:
                cands.sort(key=lambda c: c[0], reverse=space.maximize)
                obj, point, pr = cands[0]
                gain = self._gain(obj, best)
                noise, source = sw.noise(best)
                if gain <= noise:
                    stop = (f"no candidate's predicted gain beats the noise (best: {_fmt(point)} predicted "
                            f"{gain:+.1%} vs noise {noise:.1%}: {source})")
                    se = float((best["metrics"] or {}).get("noise") or 0.0)
                    sw.stop = {"gain": gain, "noise": noise, "point": point, "trial": best["id"],
                               "se": se if se > 0 else None, "timed_steps": timed_steps_of(best),
                               "noise_source": source, "explored": explored}
            if stop is not None:
                if unexplored:
                    best = self._explore(unexplored, best)
                    continue
                near = [c for c in cands if _distance(c[1], best["knobs"]) == 1]
                if explored >= space.explore or not near:
                    return stop + (f"; {explored} neighbour check(s) measured" if explored else "")
                # guided.explore: no prediction beats the noise, but the space asks for neighbour checks:
                # measure the best-predicted one-knob neighbour of the incumbent, a test of the model
                explored += 1
                obj, point, pr = near[0]
                why = (f"neighbour check {explored}/{space.explore}: what-if from trial {pr['anchor']} predicted "
                       f"{obj:.4g} ({self._gain(obj, best):+.1%} +/- {100 * pr['uncertainty']:.0f}%), below the "
                       f"noise {noise:.1%}: measured to test the prediction")
                source = "explore"
            else:
                why = (f"what-if from trial {pr['anchor']}: predicted {obj:.4g} ({gain:+.1%} +/- "
                       f"{100 * pr['uncertainty']:.0f}%)" + (f"; {pr['change']}" if pr["change"] else ""))
                source = "whatif"
            cur = best
            t = sw.evaluate(point, why, parent=cur, source=source,
                            decide=lambda t, cur=cur: "kept" if sw.better(t, cur) else
                            ("failed" if t["status"] != "ok" else "reverted"))
            self._record(t, point, pr, t["decision"])
            if t["decision"] == "kept":
                best = t
        sw.stop = None
        return "budget spent"

    def _gain(self, objective: float, best: dict) -> float:
        """The relative gain of a predicted ``objective`` over the incumbent's measured one."""
        inc = best["objective"]
        return (objective - inc) / abs(inc) if self.space.maximize else (inc - objective) / abs(inc)

    def _explore(self, unexplored: list[dict], best: dict) -> dict:
        """Measure one point of a context no trial has: the one nearest the incumbent (fewest knobs changed;
        ties: fewest unmodeled knobs changed, then grid order). Returns the incumbent after it."""
        sw = self.sw
        inc = best["knobs"]

        def dist(p):
            return (sum(1 for k in self.space.knobs if p.get(k) != inc.get(k)),
                    sum(1 for k in self.unmodeled if p.get(k) != inc.get(k)))

        point = min(unexplored, key=dist)
        what = ", ".join(f"{k}={point[k]}" for k in self.unmodeled if point.get(k) != inc.get(k))
        if what:
            why = f"what-if: no mechanism for {what}: measured once, nearest the incumbent"
        else:  # every knob is modeled, but the model gave no prediction for this point (said in the log)
            what = "this point"
            why = "what-if: no prediction for this point: measured once, nearest the incumbent"
        cur = best
        t = sw.evaluate(point, why, parent=cur, source="whatif",
                        decide=lambda t, cur=cur: "kept" if sw.better(t, cur) else
                        ("failed" if t["status"] != "ok" else "reverted"))
        row = {"objective": float("nan"), "uncertainty": float("nan"), "anchor": None, "peak_gib": None,
               "modeled": [f"not predicted: {what} has no mechanism in the model" if what != "this point" else
                           "not predicted: the model refused this point (the sweep log says why)"], "components_ms": {},
               "base_components_ms": {}}
        self._record(t, point, row, t["decision"])
        return t if t["decision"] == "kept" else best

    def _record(self, t: dict | None, point: dict, pr: dict, decision: str | None) -> None:
        row = {"trial": t["id"] if t else None, "knobs": point, "predicted": pr["objective"],
               "uncertainty": pr["uncertainty"], "anchor": pr["anchor"], "peak_gib": pr["peak_gib"],
               "measured": t["objective"] if t and t["status"] == "ok" else None,
               "status": t["status"] if t else "not run", "decision": decision, "modeled": pr["modeled"],
               "components_ms": pr["components_ms"], "base_components_ms": pr["base_components_ms"]}
        self.predictions = [r for r in self.predictions if r["knobs"] != point] + [row]
        self.sw.store.set_meta("predictions", _finite(self.predictions))


def _distance(a: dict, b: dict) -> int:
    return sum(1 for k in a if a.get(k) != b.get(k))


def _fmt(point: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items())


def _finite(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


__all__ = ["ModelSearch"]

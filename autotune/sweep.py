"""Sweeps: grid, random, and trace-guided search over trainer knobs, resumable.

Guided search (what a performance engineer does by hand): run the baseline, read the analyzer's
findings and signals of the best trial so far, try the change they point to, keep it when the
objective improves by more than the noise (the larger of 2 % and the trials' step-to-step spread),
otherwise revert; stop when nothing is left to try or the budget is spent.

    finding / signal                                   move
    host syncs (GPU findings) or sync ops in moe/*      raise sync_free_level
    per-expert GEMM loop in moe/experts, small kernels  try the next grouped_gemm_backend
    GPU idle waiting for launches                       raise sync_free_level, then other backends
    step-time spread high (GC pauses, jitter)           try manual_gc values
    nothing left                                        one-knob changes of the best config, in order
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .runner import run_trial
from .space import Space, key_of
from .store import Store

MIN_GAIN = 0.02


@dataclass
class SweepResult:
    out: Path
    trials: list[dict]
    best: dict | None
    baseline: dict | None
    stopped: str
    path: list[dict] = field(default_factory=list)  # guided: the steps taken


class Sweep:
    def __init__(self, space: Space, out: str | Path, resume: bool = False, log: Callable[[str], None] = print):
        self.space = space
        self.out = Path(out)
        self.log = log
        self.store = Store(self.out / "sweep.sqlite")
        existing = [t for t in self.store.trials() if t["status"] != "running"]
        if existing and not resume:
            raise SystemExit(f"{self.out}: holds {len(existing)} finished trial(s) of an earlier sweep; "
                             "pass --resume to continue it, or choose another output directory")
        self.store.set_meta("space", space.__dict__)
        self.t0 = time.time()
        self.evaluated = 0

    # ------------------------------------------------------------------ budget and evaluation
    def budget_left(self) -> bool:
        done = len([t for t in self.store.trials() if t["status"] != "running"])
        return done < self.space.max_trials and (time.time() - self.t0) < self.space.wall_s

    def evaluate(self, point: dict, motivation: str, parent: int | None) -> dict:
        key = key_of(point)
        prev = self.store.done(key)
        if prev is not None:  # resumed: never run the same knobs twice
            return prev
        n = len(self.store.trials())
        run_dir = self.out / "trials" / f"t{n:03d}"
        tid = self.store.start(key, point, motivation, parent, str(run_dir))
        self.log(f"[autotune] trial {tid}: {point}  ({motivation})")
        res = run_trial(self.space, point, run_dir)
        self.store.finish(tid, res.status, res.objective, res.metrics, res.findings, res.reason)
        self.evaluated += 1
        msg = f"{self.space.objective} = {res.objective:.4g}" if res.objective is not None else f"{res.status}: {res.reason}"
        self.log(f"[autotune] trial {tid} -> {msg}")
        return self.store.done(key)

    def better(self, new: dict, best: dict) -> bool:
        if new is None or new["status"] != "ok" or best is None or best["status"] != "ok":
            return new is not None and new["status"] == "ok" and (best is None or best["status"] != "ok")
        noise = max(MIN_GAIN, new["metrics"].get("noise", 0.0), best["metrics"].get("noise", 0.0))
        a, b = new["objective"], best["objective"]
        gain = (a - b) / abs(b) if self.space.maximize else (b - a) / abs(b)
        return gain > noise

    # ------------------------------------------------------------------ strategies
    def run(self, strategy: str = "guided", seed: int = 0) -> SweepResult:
        if strategy == "grid":
            stopped = self._run_list(self.space.grid())
            path = []
        elif strategy == "random":
            pts = self.space.grid()
            random.Random(seed).shuffle(pts)
            stopped = self._run_list(pts)
            path = []
        elif strategy == "guided":
            stopped, path = self._guided()
        else:
            raise SystemExit(f"unknown strategy {strategy!r} (grid, random, guided)")
        trials = self.store.trials()
        ok = [t for t in trials if t["status"] == "ok"]
        best = (max if self.space.maximize else min)(ok, key=lambda t: t["objective"]) if ok else None
        base = self.store.done(key_of(self.space.baseline))
        self.store.set_meta("stopped", stopped)
        self.store.set_meta("path", path)
        return SweepResult(self.out, trials, best, base, stopped, path)

    def _run_list(self, points: list[dict]) -> str:
        for p in points:
            if not self.budget_left():
                return "budget spent"
            self.evaluate(p, "grid/random point", None)
        return "all points run"

    def _guided(self) -> tuple[str, list[dict]]:
        path = list(self.store.get_meta("path", []) or [])
        best = self.evaluate(dict(self.space.baseline), "baseline", None)
        if not path:
            path.append({"trial": best["id"], "knobs": best["knobs"], "motivation": "baseline", "decision": "start",
                         "objective": best["objective"]})
        # on resume, continue from the best kept point of the recorded path
        for step in path:
            if step["decision"] in ("start", "kept"):
                t = self.store.done(key_of(step["knobs"]))
                if t is not None and (best is None or self.better(t, best)):
                    best = t
        tried = {key_of(t["knobs"]) for t in self.store.trials() if t["status"] != "running"}
        while self.budget_left():
            cands = [(p, m) for p, m in self.propose(best) if key_of(p) not in tried and self.space.allowed(p)]
            if not cands:
                return "no finding or move left", path
            point, why = cands[0]
            tried.add(key_of(point))
            t = self.evaluate(point, why, best["id"] if best else None)
            kept = self.better(t, best)
            path.append({"trial": t["id"], "knobs": t["knobs"], "motivation": why,
                         "decision": "kept" if kept else ("failed" if t["status"] != "ok" else "reverted"),
                         "objective": t["objective"], "status": t["status"]})
            self.store.set_meta("path", path)
            if kept:
                best = t
        return "budget spent", path

    def propose(self, best: dict) -> list[tuple[dict, str]]:
        """Candidate moves from the best trial's findings and signals, most promising first."""
        k = self.space.knobs
        cur = dict(best["knobs"])
        sig = (best.get("metrics") or {}).get("signals", {}) or {}
        findings = best.get("findings") or []
        types = {f["type"]: f for f in findings}
        out: list[tuple[dict, str]] = []

        def step(knob: str, why: str, values: list | None = None) -> None:
            if knob not in k:
                return
            vals = k[knob]
            seq = values if values is not None else [v for v in vals if vals.index(v) > vals.index(cur[knob])]
            for v in seq:
                if v != cur[knob]:
                    out.append(({**cur, knob: v}, why))

        if "host_sync" in types or sig.get("moe_sync_ops", 0) > 0 or sig.get("host_syncs", 0) > 0:
            f = types.get("host_sync")
            step("sync_free_level", f"finding: {f['title']}" if f else
                 f"signal: {sig.get('moe_sync_ops', 0)} sync ops in the MoE path", values=_next(k, cur, "sync_free_level"))
        stages = sig.get("moe_stage_us") or {}
        experts_hot = stages and max(stages, key=stages.get) == "moe/experts"
        if sig.get("expert_gemms_per_call", 0) > 1.5 or "small_kernels" in types or experts_hot:
            why = (f"finding: {types['small_kernels']['title']}" if "small_kernels" in types else
                   f"signal: {sig.get('expert_gemms_per_call', 0):.0f} GEMMs per moe/experts call (per-expert loop)"
                   if sig.get("expert_gemms_per_call", 0) > 1.5 else "signal: moe/experts is the slowest MoE stage")
            if "grouped_gemm_backend" in k:
                step("grouped_gemm_backend", why, values=[v for v in k["grouped_gemm_backend"] if v != cur["grouped_gemm_backend"]])
        if "launch_bound" in types:
            step("sync_free_level", f"finding: {types['launch_bound']['title']}", values=_next(k, cur, "sync_free_level"))
        if (best.get("metrics") or {}).get("noise", 0) > 0.10 and "manual_gc" in k:
            step("manual_gc", f"signal: step time spread {100 * best['metrics']['noise']:.0f}% (GC pauses?)",
                 values=[v for v in k["manual_gc"] if v != cur["manual_gc"]])
        for knob in k:  # fallback: every single-knob change, in the order the space lists them
            step(knob, f"no finding left: try {knob}", values=[v for v in k[knob] if v != cur[knob]])
        return out


def _next(knobs: dict, cur: dict, name: str) -> list:
    if name not in knobs:
        return []
    vals = knobs[name]
    i = vals.index(cur[name]) if cur[name] in vals else -1
    return vals[i + 1:i + 2]


def run_sweep(space: Space, out: str | Path, strategy: str = "guided", resume: bool = False, seed: int = 0,
              log: Callable[[str], Any] = print) -> SweepResult:
    sw = Sweep(space, out, resume=resume, log=log)
    try:
        return sw.run(strategy, seed)
    finally:
        sw.store.close()

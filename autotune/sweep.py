"""Sweeps over trainer knobs: exhaustive grid, random, TPE (Optuna, optional) and trace-guided; resumable.

Guided search (what a performance engineer does by hand): run the baseline, read the analyzer's
findings and the runner's signals of the best trial so far, try the change the policy ranks first
(:mod:`autotune.policy`), keep it when the objective improves by more than the noise (the larger of
``guided.min_gain``, default 2 %, and ``guided.noise_z`` (default 2) standard errors of the difference,
from each trial's timed step times), otherwise revert; stop when
no finding points anywhere new (after ``guided.explore`` one-knob neighbour checks) or the budget
is spent.

Resume. Every finished trial is in the store with its decision, and every strategy is a
deterministic function of the trials' stored results, so ``--resume`` simply runs the strategy again
from the start: a point whose trial is finished is answered from the store (not run), and the first
point that is not is where the killed sweep stopped. The budget counts the points the strategy has
visited, stored or new, so a resumed sweep ends where the uninterrupted one would have.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .policy import Move, explore_moves, propose
from .runner import TrialResult, reap_orphans, run_trial, timed_steps_of
from .space import Space, key_of
from .store import StoreError, open_sweep_store
from .tpe import missing as tpe_missing, run_tpe

STRATEGIES = ("guided", "grid", "random", "tpe")


class SweepError(ValueError):
    """A sweep that cannot start or continue: one line."""


@dataclass
class SweepResult:
    out: Path
    strategy: str
    trials: list[dict]  # every row of the store, in id order
    best: dict | None
    baseline: dict | None
    stopped: str
    path: list[dict] = field(default_factory=list)  # the points visited, in order, with their decisions
    ran: int = 0  # trials actually run by this invocation (the rest came from the store)
    top: dict | None = None  # the highest-measured ok trial (= best, except for guided: see Sweep.result)
    # why the model-driven search stopped, in numbers: the best remaining prediction's gain vs the noise
    # threshold and where that threshold comes from (autotune.model_search); None for the other strategies
    stop: dict | None = None


Runner = Callable[[Space, dict, Path, Callable[[int], None]], TrialResult]


def _default_runner(space: Space, point: dict, run_dir: Path, on_start: Callable[[int], None]) -> TrialResult:
    return run_trial(space, point, run_dir, on_start=on_start)


class Sweep:
    def __init__(self, space: Space, out: str | Path, strategy: str = "guided", resume: bool = False, seed: int = 0,
                 log: Callable[[str], None] = print, runner: Runner | None = None):
        if strategy not in STRATEGIES:
            raise SweepError(f"unknown strategy {strategy!r} (one of {', '.join(STRATEGIES)})")
        if strategy == "tpe" and (why := tpe_missing()):
            raise SweepError(why)
        self.space, self.strategy, self.seed = space, strategy, seed
        self.out = Path(out).resolve()  # trials run in the repository root: their -o must be absolute
        self.log = log
        self.runner = runner or _default_runner
        try:  # locked: a second sweep on OUT stops here; a store that cannot account for OUT/trials is refused
            self.store = open_sweep_store(self.out)
        except StoreError as e:
            raise SweepError(str(e)) from None
        try:
            self._check_resume(space, strategy, resume, seed)
            self.elapsed0 = float(self.store.get_meta("elapsed_s", 0.0, kind=(int, float)))
            if not 0.0 <= self.elapsed0 < float("inf"):  # NaN would pass every budget check, inf none
                raise StoreError(f"{self.store.path}: meta 'elapsed_s' holds {self.elapsed0!r}, not a sweep's elapsed "
                                 "seconds (damaged store?)")
        except BaseException as e:
            self.store.close()  # releases the lock
            if isinstance(e, StoreError):
                raise SweepError(str(e)) from None
            raise
        self.t0 = time.time()
        self.visited: list[str] = []  # keys this invocation's strategy went through (stored or run)
        self.path: list[dict] = []
        self.ran = 0
        self.stop: dict | None = None  # set by the model-driven search when it stops on the noise

    def _check_resume(self, space: Space, strategy: str, resume: bool, seed: int) -> None:
        stored = self.store.get_meta("identity", kind=dict)
        if stored is not None:
            if not resume:
                n = len(self.store.trials(finished_only=True))
                raise SweepError(f"{self.out}: holds a sweep ({n} finished trial(s)); pass --resume to continue it, "
                                 "or choose another output directory")
            if stored != _jsonable(space.identity()):
                diff = sorted(k for k in stored if stored.get(k) != _jsonable(space.identity()).get(k))
                raise SweepError(f"{self.out}: the stored sweep has a different search space ({', '.join(diff)} differ); "
                                 "resume it with the same space file")
            prev = self.store.get_meta("strategy", kind=dict)
            if prev != {"name": strategy, "seed": seed}:
                raise SweepError(f"{self.out}: the stored sweep used --strategy {(prev or {}).get('name')} "
                                 f"--seed {(prev or {}).get('seed')}")
            for t in self.store.running():  # trials the killed sweep left behind
                if t["pgid"]:
                    gone = reap_orphans(t["pgid"], t["run_dir"])
                    if gone:
                        self.log(f"[autotune] killed {len(gone)} leftover process(es) of trial {t['id']}")
            for t in self.store.trials(finished_only=True):
                if not Path(t["run_dir"]).is_dir():
                    self.log(f"[autotune] trial {t['id']}: its dir {t['run_dir']} is missing; its stored result is "
                             "used, but its traces cannot be read again (what-if model, report links)")
        elif resume and not self.store.trials():
            self.log(f"[autotune] nothing to resume in {self.out}: starting a new sweep")
        self.store.set_meta("identity", _jsonable(space.identity()))
        self.store.set_meta("space", _jsonable(space.to_dict()))
        self.store.set_meta("strategy", {"name": strategy, "seed": seed})

    # ------------------------------------------------------------------ budget and evaluation
    def elapsed(self) -> float:
        return self.elapsed0 + (time.time() - self.t0)

    def budget_left(self) -> bool:
        return len(self.visited) < self.space.max_trials and self.elapsed() < self.space.wall_s

    def evaluate(self, point: dict, motivation: str, parent: dict | None = None,
                 decide: Callable[[dict], str] | None = None, source: str = "") -> dict:
        """The finished trial for ``point``: from the store if it ever finished, else run now."""
        key = key_of(point)
        self.visited.append(key)
        t = self.store.done(key)
        if t is None:
            prev = self.store.lookup(key)
            name = Path(prev["run_dir"]).name if prev else f"t{self.store.next_run_dir_index() + 1:03d}"
            row = self.store.start(key, point, name, motivation, parent["id"] if parent else None)
            run_dir = Path(row["run_dir"])  # always inside this sweep's own trials/ (the store resolves it)
            if prev is not None:
                moved = set_aside(run_dir, self.out / "interrupted", f"{name}-attempt{prev['attempts']}")
                if moved is not None:
                    self.log(f"[autotune] trial {row['id']}: what its killed attempt left is kept in {moved}")
            self.log(f"[autotune] trial {row['id']}: {_fmt(point)}  ({motivation})")
            res = self.runner(self.space, point, run_dir, lambda pgid: self.store.set_pgid(row["id"], pgid))
            provisional = {**row, "status": res.status, "objective": res.objective, "metrics": res.metrics}
            decision = decide(provisional) if decide else None
            t = self.store.finish(row["id"], res.status, res.objective, res.metrics, res.findings,
                                  res.failure, res.reason, decision)
            self.ran += 1
            self.store.set_meta("elapsed_s", self.elapsed())
            msg = f"{self.space.objective} = {res.objective:.4g}" if res.status == "ok" else res.reason
            self.log(f"[autotune] trial {row['id']} -> {res.status}: {msg}" + (f" [{decision}]" if decision else ""))
        elif decide and t["decision"] is None:
            t["decision"] = decide(t)
        self.path.append({"trial": t["id"], "knobs": t["knobs"], "motivation": motivation, "source": source,
                          "parent": parent["id"] if parent else None, "decision": t["decision"],
                          "status": t["status"], "objective": t["objective"], "reason": t["reason"]})
        self.store.set_meta("path", self.path)
        return t

    def noise(self, *trials: dict) -> tuple[float, str]:
        """The smallest relative gain over ``trials[0]`` that is not noise, and where the figure comes from
        (one phrase, for the stop line and the report): the larger of ``guided.min_gain`` and ``noise_z``
        standard errors of the difference of the trials' objectives, sqrt(sum se^2) (each trial's
        ``noise``: autotune.runner.step_noise, 0 when it has fewer than 3 timed steps, i.e. unknown)."""
        ses = [float((t.get("metrics") or {}).get("noise") or 0.0) for t in trials]
        z = self.space.noise_z
        se = sum(x * x for x in ses) ** 0.5
        threshold = max(self.space.min_gain, z * se)
        unknown = [t["id"] for t, x in zip(trials, ses) if x <= 0]
        if threshold > self.space.min_gain:
            if len(trials) == 1:
                n = timed_steps_of(trials[0])
                src = (f"{z:g} x the standard error {se:.1%} of trial {trials[0]['id']}'s objective"
                       + (f", from its {n} timed steps" if n else ""))
            else:
                src = f"{z:g} x the standard error {se:.1%} of the difference of trials " + \
                      " and ".join(str(t["id"]) for t in trials)
        elif unknown:
            who = (f"trial {unknown[0]}'s standard error is" if len(unknown) == 1 else
                   f"the standard errors of trials {' and '.join(map(str, unknown))} are")
            src = f"guided.min_gain; {who} unknown, fewer than 3 timed steps"
        else:
            src = f"guided.min_gain, above {z:g} x the standard error {se:.1%}"
        return threshold, src

    def better(self, new: dict, best: dict | None) -> bool:
        """``new`` beats ``best`` by more than the noise (any ok trial beats a failed or missing best): its
        relative gain must exceed both ``guided.min_gain`` and ``noise_z`` standard errors of the
        difference of the two objectives, sqrt(se_new^2 + se_best^2) (each trial's ``noise``)."""
        if new is None or new["status"] != "ok":
            return False
        if best is None or best["status"] != "ok":
            return True
        noise, _ = self.noise(new, best)
        a, b = new["objective"], best["objective"]
        gain = (a - b) / abs(b) if self.space.maximize else (b - a) / abs(b)
        return gain > noise

    # ------------------------------------------------------------------ strategies
    def run(self) -> SweepResult:
        if self.strategy == "grid":
            stopped = self._run_list(self.space.grid(), "grid point")
        elif self.strategy == "random":
            pts = self.space.grid()
            random.Random(self.seed).shuffle(pts)
            stopped = self._run_list(pts, f"random point (seed {self.seed})")
        elif self.strategy == "tpe":
            stopped = run_tpe(self)
        else:
            stopped = self._guided()
        self.store.set_meta("stopped", stopped)
        return self.result(stopped)

    def result(self, stopped: str) -> SweepResult:
        trials = self.store.trials()
        ok = [t for t in trials if t["status"] == "ok"]
        top = (max if self.space.maximize else min)(ok, key=lambda t: t["objective"]) if ok else None
        best = top
        if self.strategy == "guided":
            # the search's answer is its incumbent (the baseline or the last kept move): a reverted trial
            # may have measured higher, but not by more than the noise, and the search did not take it
            held = [p["trial"] for p in self.path if p["decision"] in ("start", "kept") and p["status"] == "ok"]
            best = next((t for t in trials if held and t["id"] == held[-1]), top)
        return SweepResult(self.out, self.strategy, trials, best, self.store.done(key_of(self.space.baseline)),
                           stopped, self.path, self.ran, top, self.stop)

    def _run_list(self, points: list[dict], why: str) -> str:
        for p in points:
            if not self.budget_left():
                return "budget spent"
            self.evaluate(p, why)
        return "every allowed point run"

    def _guided(self) -> str:
        best = self.evaluate(dict(self.space.baseline), "baseline", decide=lambda t: "start")
        if best["status"] != "ok":
            return f"baseline failed ({best['reason']}): nothing to steer from"
        if self.space.use_model:
            from .model_search import ModelSearch

            ms = ModelSearch(self)
            if ms.ready(best):
                return ms.run(best)
            self.log(f"[autotune] what-if model unavailable ({ms.why}): steering by the rules")
        return self._guided_rules(best)

    def _guided_rules(self, best: dict) -> str:
        explored = 0
        while self.budget_left():
            moves = [m for m in propose(self.space.knobs, best["knobs"], best["findings"], best["metrics"].get("signals"),
                                        best["metrics"], self.space.gemm_roof_pct) if self._new(m)]
            if not moves and explored < self.space.explore:
                moves = [m for m in explore_moves(self.space.knobs, best["knobs"]) if self._new(m)]
                explored += bool(moves)
            if not moves:
                return "no finding left" if not self.space.explore else "no finding or neighbour left"
            m: Move = moves[0]
            cur = best
            t = self.evaluate(m.point, m.motivation, parent=cur, source=m.source,
                              decide=lambda t, cur=cur: "kept" if self.better(t, cur) else
                              ("failed" if t["status"] != "ok" else "reverted"))
            if t["decision"] == "kept":
                best = t
        return "budget spent"

    def _new(self, m: Move) -> bool:
        k = key_of(m.point)
        return k not in self.visited and self.space.allowed(m.point)


def set_aside(run_dir: Path, into: Path, name: str) -> Path | None:
    """Move what a killed attempt left in ``run_dir`` (its log, partial traces) to ``into/name`` so the trial can
    run again in an empty dir; nothing is deleted. None when there was nothing to keep. A name already taken
    gets a numbered suffix."""
    if not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir())):
        return None
    into.mkdir(parents=True, exist_ok=True)
    dest, n = into / name, 1
    while dest.exists():
        n += 1
        dest = into / f"{name}.{n}"
    run_dir.rename(dest)  # same file system: the sweep's own directory
    return dest


def _fmt(point: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items())


def _jsonable(x):
    import json

    return json.loads(json.dumps(x, default=str))


def run_sweep(space: Space, out: str | Path, strategy: str = "guided", resume: bool = False, seed: int = 0,
              log: Callable[[str], None] = print, runner: Runner | None = None) -> SweepResult:
    """Run (or resume) a sweep into ``out``. SIGTERM is turned into KeyboardInterrupt while it runs, so the
    running trial's process group is killed on the way out and the store stays consistent."""
    sw = Sweep(space, out, strategy=strategy, resume=resume, seed=seed, log=log, runner=runner)
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        return sw.run()
    finally:
        if main:
            signal.signal(signal.SIGTERM, old)
        sw.store.close()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


__all__ = ["STRATEGIES", "Sweep", "SweepError", "SweepResult", "run_sweep"]

"""Guided search vs the exhaustive grid, in one command.

    python benchmarks/bench_autotune.py --config gpu_proxy [--out runs/bench_autotune] [--live] [--resume]

``--config`` names a space under autotune/spaces/ (``gpu_proxy``, ``tiny_cpu``) or is a space YAML path.
It runs every allowed point of the space (strategy grid) into OUT/grid, then the guided search from the
space's baseline into OUT/guided, and prints the two bests, their ratio and the trial counts, with the
acceptance verdict: the configuration the guided search ends on is within 3 % of the grid's best while
it ran at most 30 % of the grid's trials (``--tolerance``, ``--max-share``). ``--check`` exits 1 when
the verdict is a miss.

By default the guided search does not rerun the trainer: its trials are answered from the grid's
results store (the same measurement for the same knobs), so both strategies judge the same numbers
and the comparison costs one grid. ``--live`` runs the guided trials for real instead (its own
measurements, noise included), before the grid, so that both run on the same machine lease as far as
possible. A configuration is judged by the grid's measurement of it (``config_ratio``: the grid
measured every configuration once, under the same conditions); the guided search's own measurement of
its best is reported next to it (``ratio``), and in live mode the two differ by run-to-run noise.
Both sweeps are resumable (``--resume``) and each writes its sweep.html; a summary goes to
OUT/bench_autotune.json.

``--stop-after SECONDS`` starts no new trial past that many seconds of this invocation and exits with
status 3 (nothing lost: the stores keep every finished trial), so a grid longer than one machine lease
runs as a few ``--resume`` calls.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autotune.runner import TrialResult, run_trial, step_noise, step_spread  # noqa: E402
from autotune.space import SpaceError, key_of, load_space  # noqa: E402
from autotune.store import Store  # noqa: E402
from autotune.sweep import SweepError, run_sweep  # noqa: E402


def space_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return REPO / "autotune" / "spaces" / f"{name}.yaml"


class GridReplay:
    """A trial runner answering from the grid's store: the grid's measurement of the same knobs."""

    def __init__(self, grid_db: Path):
        self.store = Store(grid_db)

    def __call__(self, space, point, run_dir, on_start) -> TrialResult:
        t = self.store.done(key_of(point))
        if t is None:
            return TrialResult("failed", "crash", "crash: not measured by the grid", None, {})
        src = Path(t["run_dir"] or "")
        run_dir = Path(run_dir)
        if src.is_dir() and not run_dir.exists():  # the grid trial's run dir (traces, manifest) for the model
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            run_dir.symlink_to(src.resolve(), target_is_directory=True)
        metrics = dict(t["metrics"] or {})
        if metrics.get("step_times_s"):  # stores of older versions kept the spread under "noise"
            metrics["spread"], metrics["noise"] = step_spread(metrics), step_noise(metrics)
        return TrialResult(t["status"], t["failure"], t["reason"], t["objective"], metrics, t["findings"])


class DeadlineReached(Exception):
    """--stop-after: the invocation's time is up; resume to continue."""


class Deadline:
    """Wraps a trial runner: refuses to start a trial once ``stop_at`` (time.monotonic) is past."""

    def __init__(self, runner, stop_at: float | None):
        self.runner, self.stop_at = runner or run_trial, stop_at

    def __call__(self, space, point, run_dir, on_start) -> TrialResult:
        if self.stop_at is not None and time.monotonic() > self.stop_at:
            raise DeadlineReached()
        return self.runner(space, point, run_dir, on_start=on_start)


def compare(space, grid, guided, tolerance: float, max_share: float) -> dict:
    """The acceptance figures from two SweepResults."""
    n_grid, n_guided = len(grid.trials), len(guided.trials)
    out = {"objective": space.objective, "maximize": space.maximize, "grid_trials": n_grid, "guided_trials": n_guided,
           "trial_share": n_guided / n_grid if n_grid else None,
           "grid_best": grid.best and {"knobs": grid.best["knobs"], "objective": grid.best["objective"]},
           "guided_best": guided.best and {"knobs": guided.best["knobs"], "objective": guided.best["objective"]},
           # the guided search's answer is its incumbent; a reverted trial may have measured higher
           "guided_top": guided.top and {"knobs": guided.top["knobs"], "objective": guided.top["objective"]},
           "guided_path": [{"knobs": p["knobs"], "decision": p["decision"], "motivation": p["motivation"]} for p in guided.path]}
    rel = lambda b, g: b / g if space.maximize else g / b  # noqa: E731  1.0 = as good as the grid's best
    out["ratio"] = out["config_ratio"] = None
    if grid.best and guided.best:
        g = grid.best["objective"]
        out["ratio"] = rel(guided.best["objective"], g)  # the guided search's own measurement of its best
        same = next((t for t in grid.trials if t["key"] == guided.best["key"] and t["status"] == "ok"), None)
        if same is not None:  # the grid's measurement of the configuration the guided search reached
            out["guided_best_in_grid"] = same["objective"]
            out["config_ratio"] = rel(same["objective"], g)
    judged = out["config_ratio"] if out["config_ratio"] is not None else out["ratio"]
    out["within_tolerance"] = judged is not None and judged >= 1.0 - tolerance
    out["within_trial_share"] = out["trial_share"] is not None and out["trial_share"] <= max_share
    out["pass"] = bool(out["within_tolerance"] and out["within_trial_share"])
    return out


def accuracy(space, grid) -> dict:
    """The what-if model's predictions of every grid point from the grid's baseline trial alone, against
    the grid's measurements: absolute relative error of the objective per point, median and maximum; and
    whether each point's memory verdict (fits / over the limit) was right."""
    from tracelens.projection.whatif import Model

    base = next((t for t in grid.trials if t["key"] == key_of(space.baseline) and t["status"] == "ok"), None)
    if base is None:
        return {"error": "the baseline trial did not finish"}
    try:
        m = Model.from_run(Path(base["run_dir"]), kernel_table=space.kernel_table, capacity_gib=space.memory_gib)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    rows = []
    for t in grid.trials:
        try:
            p = m.predict({**space.fixed, **t["knobs"]})
        except Exception as e:  # noqa: BLE001
            rows.append({"knobs": t["knobs"], "error": f"{type(e).__name__}: {e}"})
            continue
        pred = base["objective"] * p.tokens_per_s_per_gpu / p.base_tokens_per_s_per_gpu if space.maximize \
            else base["objective"] * p.step_s / p.base_step_s
        row = {"knobs": t["knobs"], "predicted": pred, "uncertainty": p.uncertainty, "fits": p.fits,
               "peak_gib": p.peak_gib, "status": t["status"], "failure": t["failure"], "measured": t["objective"],
               "measured_peak_gib": (t["metrics"] or {}).get("signals", {}).get("peak_memory_gib")}
        if t["status"] == "ok" and t["objective"]:
            row["error"] = abs(pred - t["objective"]) / t["objective"]
        rows.append(row)
    errs = [r["error"] for r in rows if isinstance(r.get("error"), float) and r["knobs"] != space.baseline]
    import statistics

    mem_right = [r["fits"] == (r["failure"] not in ("oom", "memory")) for r in rows if "fits" in r]
    return {"points": rows, "n": len(errs), "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None,
            "memory_verdicts_right": f"{sum(mem_right)}/{len(mem_right)}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="gpu_proxy", help="space name under autotune/spaces/, or a space YAML path")
    p.add_argument("--out", default="runs/bench_autotune")
    p.add_argument("--live", action="store_true", help="run the guided trials for real instead of replaying the grid's")
    p.add_argument("--resume", action="store_true", help="continue the sweeps already in OUT")
    p.add_argument("--tolerance", type=float, default=0.03)
    p.add_argument("--max-share", type=float, default=0.30)
    p.add_argument("--check", action="store_true", help="exit 1 when the guided search misses the targets")
    p.add_argument("--accuracy", action="store_true",
                   help="also predict every grid point from the baseline trial alone and report the errors")
    p.add_argument("--stop-after", type=float, metavar="SECONDS",
                   help="start no trial past this many seconds; exit 3 (continue with --resume)")
    args = p.parse_args(argv)
    stop_at = time.monotonic() + args.stop_after if args.stop_after is not None else None
    from reports import sweep as sweep_report

    try:
        space = load_space(space_path(args.config))
        out = Path(args.out)
        log = lambda m: print(m, flush=True)  # noqa: E731
        n_points = len(space.grid())
        grid_space = space
        if space.max_trials < n_points:  # the grid is exhaustive whatever the space's trial budget
            import dataclasses

            grid_space = dataclasses.replace(space, max_trials=n_points)
        def run_grid():
            g = run_sweep(grid_space, out / "grid", strategy="grid", resume=args.resume, log=log,
                          runner=Deadline(None, stop_at))
            sweep_report.write(g, grid_space)
            return g

        def run_guided():
            runner = None if args.live else GridReplay(out / "grid" / "sweep.sqlite")
            g = run_sweep(space, out / "guided", strategy="guided", resume=args.resume, log=log,
                          runner=Deadline(runner, stop_at))
            sweep_report.write(g, space)
            return g

        if args.live:  # independent of the grid: run it first, on the same lease as the grid's start
            guided = run_guided()
            grid = run_grid()
        else:
            grid = run_grid()
            guided = run_guided()
    except (SpaceError, SweepError) as e:
        print(f"bench_autotune: error: {e}", file=sys.stderr)
        return 2
    except DeadlineReached:
        print(f"bench_autotune: --stop-after {args.stop_after:g} s reached; continue with --resume", file=sys.stderr)
        return 3
    r = compare(space, grid, guided, args.tolerance, args.max_share)
    r["mode"] = "live" if args.live else "replay of the grid's measurements"
    if args.accuracy:
        r["prediction"] = accuracy(space, grid)
    (out / "bench_autotune.json").write_text(json.dumps(r, indent=1, default=str))
    fmt = lambda b: f"{b['objective']:.6g} at {b['knobs']}" if b else "none (every trial failed)"  # noqa: E731
    print(f"grid:   {r['grid_trials']} trials, best {space.objective} {fmt(r['grid_best'])}")
    print(f"guided: {r['guided_trials']} trials ({r['mode']}), best {fmt(r['guided_best'])}")
    share = f"{100 * r['trial_share']:.0f}%" if r["trial_share"] is not None else "n/a"
    f4 = lambda x: f"{x:.4f}" if x is not None else "n/a"  # noqa: E731
    print(f"guided's configuration, as the grid measured it, vs the grid best: {f4(r['config_ratio'])} "
          f"(target >= {1 - args.tolerance:.2f}); guided's own measurement of it: {f4(r['ratio'])}")
    print(f"guided ran {share} of the grid's trials (target <= {100 * args.max_share:.0f}%): "
          f"{'PASS' if r['pass'] else 'MISS'}")
    acc = r.get("prediction")
    if acc:
        if acc.get("error"):
            print(f"prediction accuracy: n/a ({acc['error']})")
        else:
            for row in acc["points"]:
                if "predicted" in row:
                    meas = f"{row['measured']:.6g}" if row["measured"] else row["failure"]
                    err = f"{100 * row['error']:5.1f}%" if "error" in row else "  -  "
                    print(f"  predicted {row['predicted']:10.6g} +/- {100 * row['uncertainty']:3.0f}%  measured {meas:>10}"
                          f"  error {err}  fits {row['fits']}  {row['knobs']}")
            pct = lambda x: f"{100 * x:.1f}%" if x is not None else "n/a"  # noqa: E731
            print(f"prediction from the baseline alone over {acc['n']} grid points: median abs error "
                  f"{pct(acc['median_abs_error'])}, max {pct(acc['max_abs_error'])}; memory verdicts right "
                  f"{acc['memory_verdicts_right']}")
    print(f"wrote {out / 'bench_autotune.json'}, {out / 'grid' / 'sweep.html'}, {out / 'guided' / 'sweep.html'}")
    return 1 if args.check and not r["pass"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""What-if model accuracy, in one command: predictions from one run against other real runs, and the
replay's fidelity to the traced step.

    python benchmarks/bench_whatif.py accuracy --base RUNS/base RUNS/other1 RUNS/other2 ... [--kernel-table T.json]
    python benchmarks/bench_whatif.py fidelity TRACE_OR_RUN ... [--steps 3]

``accuracy``: builds the model from ``--base`` (a profiled run dir) and predicts every other run dir's
tokens/s/GPU from the knobs its manifest records (sync-free level, backend, micro-batch, recompute,
manual GC, optimizer, microbatches), then prints predicted vs measured per run and the median and maximum
absolute errors (the base itself excluded). Every run's measurement is its manifest's
``metrics.tokens_per_s_per_gpu``: independent of the model.

``fidelity``: replays every profiled step (up to ``--steps`` per rank) of each trace with nothing
changed and compares it with the step's span in the trace (the ``ProfilerStep#N`` range), printing the
relative error per step and the median, 90th percentile and the share within 2 %.

``--json FILE`` writes the rows. Used for docs/performance.md ("What-if model").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def accuracy(base: Path, runs: list[Path], kernel_table: str | None) -> dict:
    from tracelens.projection.whatif import MODELED, Model

    m = Model.from_run(base, kernel_table=kernel_table)
    rows = []
    for r in runs:
        man = json.loads((r / "manifest.json").read_text())
        cfg = man["config"]
        ch = {k: cfg[k] for k in MODELED if k in cfg}  # every key the model has a mechanism for
        p = m.predict(ch)
        meas = man["metrics"]["tokens_per_s_per_gpu"]
        pred = m.base_tokens_per_s_per_gpu * p.tokens_per_s_per_gpu / p.base_tokens_per_s_per_gpu
        rows.append({"run": str(r), "changes": p.changes, "predicted": pred, "measured": meas,
                     "error": (pred - meas) / meas, "uncertainty": p.uncertainty, "fits": p.fits,
                     "peak_gib": p.peak_gib,
                     "measured_peak_gib": max(man["metrics"].get("peak_memory_bytes") or [0]) / 2**30})
    errs = [abs(x["error"]) for x in rows if Path(x["run"]).resolve() != base.resolve()]
    return {"base": str(base), "rows": rows, "n": len(errs),
            "median_abs_error": statistics.median(errs) if errs else None, "max_abs_error": max(errs) if errs else None}


def fidelity(paths: list[str], steps: int) -> dict:
    import tracelens
    from tracelens.projection import profile as P
    from tracelens.projection import replay as R

    rows = []
    for path in paths:
        a = tracelens.analyze(tracelens.load(path, progress=False))
        for info in a.trace.ranks:
            st = a.steps[a.steps["rank"] == info.rank]
            for s in st["step"].tolist()[:steps]:
                p = P.step_profile(a, {}, info.rank, int(s))
                if p is None or not len(p.work):
                    continue
                res = R.run(R.prepare(p))
                rows.append({"trace": path, "rank": info.rank, "step": int(s), "traced_ms": p.step_ns / 1e6,
                             "replay_ms": res.step_ns / 1e6, "error": res.step_ns / p.step_ns - 1,
                             "units": len(p.work), "syncs": len(p.syncs)})
    errs = sorted(abs(r["error"]) for r in rows)
    q = lambda f: errs[min(int(f * len(errs)), len(errs) - 1)] if errs else None  # noqa: E731
    return {"rows": rows, "n": len(errs), "median_abs_error": statistics.median(errs) if errs else None,
            "p90_abs_error": q(0.9), "within_2pct": sum(e < 0.02 for e in errs) / len(errs) if errs else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--base", required=True, type=Path)
    a.add_argument("runs", nargs="+", type=Path)
    a.add_argument("--kernel-table")
    a.add_argument("--json")
    f = sub.add_parser("fidelity")
    f.add_argument("paths", nargs="+")
    f.add_argument("--steps", type=int, default=3)
    f.add_argument("--json")
    args = ap.parse_args(argv)
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    if args.cmd == "accuracy":
        out = accuracy(args.base, args.runs, args.kernel_table)
        for r in out["rows"]:
            print(f"{Path(r['run']).name:36s} predicted {r['predicted']:9.0f} +/- {100 * r['uncertainty']:3.0f}%  measured "
                  f"{r['measured']:9.0f}  error {100 * r['error']:+6.1f}%  peak {r['peak_gib'] or 0:5.1f} GiB "
                  f"(measured {r['measured_peak_gib']:5.1f})  {r['changes']}")
        print(f"from {out['base']}: {out['n']} runs, median abs error {pct(out['median_abs_error'])}, "
              f"max {pct(out['max_abs_error'])}")
    else:
        out = fidelity(args.paths, args.steps)
        for r in out["rows"]:
            print(f"{Path(r['trace']).name[:40]:40s} rank {r['rank']} step {r['step']:5d}  traced {r['traced_ms']:10.2f} ms  "
                  f"replay {r['replay_ms']:10.2f} ms  error {100 * r['error']:+7.1f}%  ({r['units']} units, {r['syncs']} syncs)")
        print(f"{out['n']} steps: median abs error {pct(out['median_abs_error'])}, 90th percentile "
              f"{pct(out['p90_abs_error'])}, within 2 %: {pct(out['within_2pct'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The what-if model's full cross-prediction matrix on a measured grid: every profiled point as the baseline,
predicting every other point.

    python benchmarks/bench_whatif_matrix.py RUNS/grid                 # a sweep dir (sweep.sqlite + run dirs)
    python benchmarks/bench_whatif_matrix.py MEASURED.json --json m.json
    python benchmarks/bench_whatif_matrix.py RUNS/grid --baseline t002 --baseline t014   # some baselines only

From a sweep dir (``tracelens autotune`` / benchmarks/bench_autotune.py output) every finished trial is a point
(benchmarks/layouts_from_sweep.py) and every one whose run dir holds a manifest and traces is a baseline. From a
measured.json (benchmarks/bench_whatif_layouts.py's format) the baselines are the file's ``baselines`` plus every
point with a ``run`` (a run dir relative to the file). Each baseline is built once (``Model.from_run``) and
predicts every other point, with the what-if changes that take its config to the point's
(`bench_whatif_layouts.changes_for`); the error is predicted / measured tokens/s/GPU - 1, and the memory verdict
(fits / out of memory) is checked against the point's status.

Summaries: over all predictions, and split into **layout-only** (the point has the baseline's micro-batch size:
ep, dispatch path, overlap change) and **micro-batch-changing** ones; per baseline the median and max |error| and
the issue-35 targets (>= 8 predictions, median <= 8 %, max <= 20 %, every memory verdict right). A point the
model refuses is listed with its one-line reason and not counted. No timing runs: the measurements are the
grid's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_whatif_layouts import (
    MAX_TARGET,
    MEDIAN_TARGET,
    MIN_POINTS,
    Baseline,
    MeasuredError,
    Point,
    changes_for,
    load_measured,
)

MBS = "micro_batch_size"


def _has_traces(run: Path) -> bool:
    return (run / "manifest.json").is_file() and any((run / "traces").glob("rank*.json*"))


def from_sweep(grid: Path) -> tuple[str, str, list[Baseline], list[Point]]:
    """(config, machine, baselines, points) of a sweep dir: every finished trial a point, every profiled one
    (its run dir has traces) a baseline named after its run dir (``t002``)."""
    from layouts_from_sweep import SweepError, measured_from_sweep

    try:
        doc, _ = measured_from_sweep(grid, grid / "measured.json", [])
    except SweepError as e:
        raise MeasuredError(str(e)) from None
    from autotune.store import Store

    store = Store(grid / "sweep.sqlite", lock=False)  # read only
    try:
        runs = {t["id"]: t["run_dir"] for t in store.trials()}
    finally:
        store.close()
    bases, points = [], []
    for p in doc["points"]:
        points.append(Point(p["name"], p["set"], p.get("tokens_per_s_per_gpu"),
                            max(p["peak_mem_gib"]) if p.get("peak_mem_gib") else None, p["status"]))
        if p["status"] != "ok":
            continue
        run = Path(runs.get(p["trial"]) or "")
        if not _has_traces(run):  # a sweep dir moved since it was written: its run dirs are trials/tNNN
            run = grid / "trials" / f"t{int(p['trial']):03d}"
        if _has_traces(run):
            bases.append(Baseline(run.name, run.resolve(), dict(p["set"])))
    return doc["config"], "", bases, points


def from_measured(path: Path) -> tuple[str, str, list[Baseline], list[Point]]:
    config, machine, bases, points = load_measured(path)
    doc = json.loads(path.read_text())
    have = {b.run for b in bases}
    for p in doc.get("points") or []:
        if isinstance(p, dict) and isinstance(p.get("run"), str):
            run = (path.parent / p["run"]).resolve()
            if run not in have and _has_traces(run):
                bases.append(Baseline(str(p.get("name", p["run"])), run, dict(p.get("set", p.get("overrides", {})))))
                have.add(run)
    return config, machine, bases, points


def load_source(source: Path) -> tuple[str, str, list[Baseline], list[Point]]:
    if source.is_dir():
        if not (source / "sweep.sqlite").is_file():
            raise MeasuredError(f"{source}: no sweep.sqlite (not a sweep directory)")
        return from_sweep(source)
    return from_measured(source)


def _stats(errs: list[float]) -> dict:
    return {"n": len(errs), "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None}


def summarize(rows: list[dict]) -> dict:
    """Overall, layout-only and micro-batch-changing summaries, and one per baseline."""
    counted = [r for r in rows if not r["own"] and "refused" not in r]
    err = [r for r in counted if "error" in r]
    out = {"all": _stats([abs(r["error"]) for r in err]),
           "layout_only": _stats([abs(r["error"]) for r in err if r["kind"] == "layout"]),
           "micro_batch": _stats([abs(r["error"]) for r in err if r["kind"] == "micro-batch"]),
           "verdicts_right": sum(r["verdict_right"] for r in counted), "verdicts": len(counted),
           "refused": sum("refused" in r for r in rows), "per_baseline": {}}
    for b in dict.fromkeys(r["baseline"] for r in rows):
        mine = [r for r in counted if r["baseline"] == b]
        e = [abs(r["error"]) for r in mine if "error" in r]
        s = _stats(e)
        s.update(verdicts_right=sum(r["verdict_right"] for r in mine), verdicts=len(mine),
                 meets=bool(e) and len(e) >= MIN_POINTS and s["median_abs_error"] <= MEDIAN_TARGET
                 and s["max_abs_error"] <= MAX_TARGET and all(r["verdict_right"] for r in mine))
        out["per_baseline"][b] = s
    return out


def evaluate(source: str | Path, kernel_table: str | None = None, only: list[str] | None = None,
             build=None) -> dict:
    """Every point predicted from every baseline (module docstring). ``build(run_dir)`` makes a baseline's model
    (default `Model.from_run` with ``kernel_table``)."""
    from moespec.config import load_config
    from tracelens.projection import whatif as W

    source = Path(source)
    config, machine, bases, points = load_source(source)
    if only:
        missing = [n for n in only if n not in {b.name for b in bases}]
        if missing:
            raise MeasuredError(f"{source}: no profiled baseline named {missing[0]!r} "
                                f"(have {', '.join(b.name for b in bases)})")
        bases = [b for b in bases if b.name in only]
    if not bases:
        raise MeasuredError(f"{source}: no profiled run dir to predict from")
    base_cfg = load_config(config)
    build = build or (lambda run: W.Model.from_run(run, kernel_table))
    rows, built_s = [], []
    for b in bases:
        t = time.perf_counter()
        try:
            model = build(b.run)
        except (W.WhatIfError, W.ProfileError) as e:
            raise MeasuredError(f"baseline {b.name}: {e}") from None
        built_s.append(time.perf_counter() - t)
        for pt in points:
            ch = changes_for(base_cfg, b, pt)
            mbs0 = b.sets.get(MBS, base_cfg.get(MBS))
            row = {"baseline": b.name, "point": pt.name, "changes": ch, "own": not ch,
                   "kind": "micro-batch" if pt.sets.get(MBS, base_cfg.get(MBS)) != mbs0 else "layout",
                   "measured_tps": pt.tps, "measured_status": pt.status}
            try:
                pr = model.predict(ch)
            except W.WhatIfError as e:
                rows.append({**row, "refused": str(e)})
                continue
            row.update(predicted_tps=pr.tokens_per_s_per_gpu, predicted_step_ms=1e3 * pr.step_s,
                       predicted_peak_gib=pr.peak_gib, predicted_fits=pr.fits,
                       verdict_right=pr.fits == (pt.status == "ok"))
            if pt.status == "ok" and pt.tps:
                row["error"] = pr.tokens_per_s_per_gpu / pt.tps - 1.0
            rows.append(row)
    return {"source": str(source), "config": config, "machine": machine, "baselines": [b.name for b in bases],
            "model_build_s": built_s, "rows": rows, "summary": summarize(rows)}


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def to_text(res: dict) -> str:
    out = [f"what-if matrix: {res['source']} ({res['config']}; {len(res['baselines'])} baselines)"]
    names = list(dict.fromkeys(r["point"] for r in res["rows"]))
    by = {(r["baseline"], r["point"]): r for r in res["rows"]}
    out.append("error of predicted tokens/s/GPU, baseline (rows) -> point (columns); '=' the baseline, "
               "'oom'/'OOM!' a right/wrong verdict on an OOM point, 'x' refused")
    out.append(f"{'':<16}" + "".join(f"{i:>7}" for i in range(len(names))))
    for b in res["baselines"]:
        cells = []
        for p in names:
            r = by.get((b, p))
            if r is None or "refused" in r:
                cells.append("x")
            elif r["own"]:
                cells.append("=")
            elif "error" not in r:
                cells.append("oom" if r["verdict_right"] else "OOM!")
            else:
                cells.append(f"{100 * r['error']:+.0f}" + ("" if r["verdict_right"] else "!"))
        out.append(f"{b:<16}" + "".join(f"{c:>7}" for c in cells))
    out.append("points: " + ", ".join(f"{i} {n}" for i, n in enumerate(names)))
    s = res["summary"]
    for key, label in (("all", "all"), ("layout_only", "layout-only (same micro-batch)"),
                       ("micro_batch", "micro-batch-changing")):
        t = s[key]
        out.append(f"{label}: {t['n']} predictions, median |error| {_pct(t['median_abs_error'])}, "
                   f"max {_pct(t['max_abs_error'])}")
    out.append(f"memory verdicts {s['verdicts_right']}/{s['verdicts']} right; {s['refused']} refused")
    for b, t in s["per_baseline"].items():
        out.append(f"  {b:<16} n {t['n']:>3}  median {_pct(t['median_abs_error']):>6}  max "
                   f"{_pct(t['max_abs_error']):>6}  verdicts {t['verdicts_right']}/{t['verdicts']}"
                   + ("  meets issue 35's targets" if t["meets"] else ""))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="a sweep dir (sweep.sqlite) or a measured.json")
    ap.add_argument("--baseline", action="append", default=None, metavar="NAME",
                    help="predict from this baseline only (repeatable; default every profiled point)")
    ap.add_argument("--kernel-table", default=None)
    ap.add_argument("--json", dest="json_out", default=None, help="write the rows and summaries here")
    a = ap.parse_args(argv)
    try:
        res = evaluate(a.source, a.kernel_table, a.baseline)
    except MeasuredError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(to_text(res))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

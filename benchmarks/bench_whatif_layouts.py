"""Cross-layout accuracy of the what-if model (issue 35): every measured layout predicted from each profiled baseline.

    python benchmarks/bench_whatif_layouts.py tests/fixtures/h100_4gpu_layouts/measured.json
    python benchmarks/bench_whatif_layouts.py MEASURED.json --json out.json --check   # exit 1 when a target fails

``measured.json`` (written with the recordings; paths relative to the file)::

    {"config": "gpu_proxy_train",                     # the trainer config every point and baseline extends
     "machine": "4 x H100 80GB HBM3",
     "baselines": [{"name": "dp4", "run": "dp4_base", "set": {"ep": 1}},
                   {"name": "ep4", "run": "ep4_base", "set": {"ep": 4, "ep_dispatch": "capacity"}}],
     "points": [{"name": "ep4_nccl", "set": {"ep": 4, "ep_dispatch": "nccl"},
                 "tokens_per_s_per_gpu": 80175.0, "peak_mem_gib": [60.8, 60.1, 60.5, 60.2], "status": "ok"},
                {"name": "ep4_mbs24", "set": {"ep": 4, "micro_batch_size": 24}, "status": "oom"}]}

(``baselines`` may also be a mapping name -> run dir or -> {"run", "set"}; a point's ``set`` may be called
``overrides``; ``peak_mem_gib`` is per rank or one number.) A point's config is the base config with its ``set``;
from a baseline the what-if changes every key where the two differ (the baseline's own keys go back to the base
config's values unless the point sets them). Each prediction is compared with the measurement: tokens/s/GPU error,
and the memory verdict (predicted fits / out of memory against the point's status: an OOM predicted to fit is
wrong, and so is a run that fit predicted as OOM). A point the model refuses (a knob without a mechanism) is listed
with its one-line reason and not counted. The baseline's own point (no key changed) is shown and not counted.

Targets (issue 35, "Done means"): per baseline, over >= 8 cross-layout predictions, median |error| <= 8 %, max
<= 20 %; every memory verdict right. No timing runs here: the measurements are the file's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

MEDIAN_TARGET, MAX_TARGET, MIN_POINTS = 0.08, 0.20, 8


class MeasuredError(ValueError):
    """measured.json is not usable: one line naming the file and the problem."""


@dataclass
class Point:
    name: str
    sets: dict
    tps: float | None
    peak_gib: float | None
    status: str  # ok | oom


@dataclass
class Baseline:
    name: str
    run: Path
    sets: dict


def _num(v, where: str, path: Path) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise MeasuredError(f"{path}: {where}: {str(v)[:40]!r} is not a number >= 0")
    return float(v)


def load_measured(path: str | Path) -> tuple[str, str, list[Baseline], list[Point]]:
    """(base config, machine, baselines, points) of a measured.json; `MeasuredError` naming the first problem."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise MeasuredError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise MeasuredError(f"{path}: not a JSON document ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(doc, dict):
        raise MeasuredError(f"{path}: not a JSON object")
    config = doc.get("config", "gpu_proxy_train")
    if not isinstance(config, str):
        raise MeasuredError(f"{path}: config: expected a trainer config name")
    raw_b = doc.get("baselines")
    if isinstance(raw_b, dict):
        raw_b = [{"name": k, **(v if isinstance(v, dict) else {"run": v})} for k, v in raw_b.items()]
    if not isinstance(raw_b, list) or not raw_b:
        raise MeasuredError(f"{path}: baselines: expected a non-empty list or mapping of run dirs")
    bases = []
    for i, b in enumerate(raw_b):
        if not isinstance(b, dict) or not isinstance(b.get("run"), str):
            raise MeasuredError(f"{path}: baselines[{i}]: expected {{'name', 'run', 'set'}} with a run dir")
        sets = b.get("set", b.get("overrides", {}))
        if not isinstance(sets, dict):
            raise MeasuredError(f"{path}: baselines[{i}].set: expected a mapping of trainer keys")
        bases.append(Baseline(str(b.get("name", b["run"])), (path.parent / b["run"]).resolve(), sets))
    raw_p = doc.get("points")
    if not isinstance(raw_p, list):
        raise MeasuredError(f"{path}: points: expected a list")
    points = []
    for i, p in enumerate(raw_p):
        w = f"points[{i}]"
        if not isinstance(p, dict):
            raise MeasuredError(f"{path}: {w}: not an object")
        sets = p.get("set", p.get("overrides", {}))
        if not isinstance(sets, dict):
            raise MeasuredError(f"{path}: {w}.set: expected a mapping of trainer keys")
        status = str(p.get("status", "ok")).lower()
        if status not in ("ok", "oom"):
            raise MeasuredError(f"{path}: {w}.status: {status[:20]!r} is not ok or oom")
        peak = p.get("peak_mem_gib")
        if isinstance(peak, list):
            vals = [_num(x, f"{w}.peak_mem_gib", path) for x in peak]
            vals = [x for x in vals if x is not None]
            peak = max(vals) if vals else None
        else:
            peak = _num(peak, f"{w}.peak_mem_gib", path)
        tps = _num(p.get("tokens_per_s_per_gpu"), f"{w}.tokens_per_s_per_gpu", path)
        if status == "ok" and tps is None:
            raise MeasuredError(f"{path}: {w}: status ok without tokens_per_s_per_gpu")
        points.append(Point(str(p.get("name", f"point{i}")), sets, tps, peak, status))
    return config, str(doc.get("machine", "")), bases, points


def changes_for(base_cfg: dict, baseline: Baseline, point: Point) -> dict:
    """The what-if changes that take the baseline's config to the point's: the point's keys, and the baseline's
    own keys back at the base config's values where the point does not set them."""
    out = {k: base_cfg.get(k) for k in baseline.sets if k not in point.sets}
    out.update(point.sets)
    return {k: v for k, v in out.items() if baseline.sets.get(k, base_cfg.get(k)) != v}


def evaluate(measured: str | Path, kernel_table: str | None = None) -> dict:
    """Every point predicted from every baseline: rows and per-baseline summaries (module docstring)."""
    from moespec.config import load_config
    from tracelens.projection import whatif as W

    config, machine, bases, points = load_measured(measured)
    base_cfg = load_config(config)
    rows, summary = [], {}
    for b in bases:
        try:
            model = W.Model.from_run(b.run, kernel_table)
        except (W.WhatIfError, W.ProfileError) as e:
            raise MeasuredError(f"baseline {b.name}: {e}") from None
        errs, verdicts = [], []
        for pt in points:
            ch = changes_for(base_cfg, b, pt)
            row = {"baseline": b.name, "point": pt.name, "changes": ch, "measured_tps": pt.tps,
                   "measured_status": pt.status, "measured_peak_gib": pt.peak_gib, "own": not ch}
            try:
                pr = model.predict(ch)
            except W.WhatIfError as e:
                row.update(refused=str(e))
                rows.append(row)
                continue
            row.update(predicted_tps=pr.tokens_per_s_per_gpu, predicted_peak_gib=pr.peak_gib, predicted_fits=pr.fits,
                       uncertainty=pr.uncertainty)
            row["verdict_right"] = pr.fits == (pt.status == "ok")
            if pt.status == "ok" and pt.tps:
                row["error"] = pr.tokens_per_s_per_gpu / pt.tps - 1.0
            if not row["own"]:
                verdicts.append(row["verdict_right"])
                if "error" in row:
                    errs.append(abs(row["error"]))
            rows.append(row)
        med = sorted(errs)[len(errs) // 2] if errs else None
        if errs and len(errs) % 2 == 0:
            s = sorted(errs)
            med = 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])
        summary[b.name] = {"n": len(errs), "median_abs_error": med, "max_abs_error": max(errs) if errs else None,
                           "verdicts_right": sum(verdicts), "verdicts": len(verdicts),
                           "meets": bool(errs) and len(errs) >= MIN_POINTS and med <= MEDIAN_TARGET
                           and max(errs) <= MAX_TARGET and all(verdicts)}
    return {"measured": str(measured), "config": config, "machine": machine, "rows": rows, "summary": summary}


def to_text(res: dict) -> str:
    out = [f"what-if across layouts: {res['measured']} ({res['config']}{', ' + res['machine'] if res['machine'] else ''})"]
    out.append(f"{'baseline':<10} {'point':<22} {'predicted':>10} {'measured':>10} {'error':>7}  {'peak GiB':>16}  "
               "verdict")
    for r in res["rows"]:
        if "refused" in r:
            out.append(f"{r['baseline']:<10} {r['point']:<22} refused: {r['refused']}")
            continue
        meas = f"{r['measured_tps']:,.0f}" if r["measured_tps"] else r["measured_status"].upper()
        err = f"{100 * r['error']:+.1f}%" if "error" in r else ""
        pk = f"{r['predicted_peak_gib']:.1f}" if r["predicted_peak_gib"] is not None else "-"
        mk = f"{r['measured_peak_gib']:.1f}" if r["measured_peak_gib"] is not None else "-"
        fit = "fits" if r["predicted_fits"] else "OOM"
        ok = "right" if r["verdict_right"] else "WRONG"
        own = " (the baseline itself)" if r["own"] else ""
        out.append(f"{r['baseline']:<10} {r['point']:<22} {r['predicted_tps']:>10,.0f} {meas:>10} {err:>7}  "
                   f"{pk:>7} vs {mk:>6}  {fit}: {ok}{own}")
    for name, s in res["summary"].items():
        if not s["n"]:
            out.append(f"{name}: no cross-layout prediction with a measured tokens/s")
            continue
        out.append(f"{name}: {s['n']} predictions, median |error| {100 * s['median_abs_error']:.1f}% "
                   f"(target <= {100 * MEDIAN_TARGET:.0f}%), max {100 * s['max_abs_error']:.1f}% "
                   f"(<= {100 * MAX_TARGET:.0f}%), memory verdicts {s['verdicts_right']}/{s['verdicts']} right"
                   + ("" if s["n"] >= MIN_POINTS else f" (fewer than the {MIN_POINTS} the target needs)")
                   + (": MEETS the targets" if s["meets"] else ": does not meet the targets"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", help="measured.json (module docstring)")
    ap.add_argument("--kernel-table", default=None)
    ap.add_argument("--json", dest="json_out", default=None, help="write the rows and summaries here")
    ap.add_argument("--check", action="store_true", help="exit 1 when a baseline misses a target")
    a = ap.parse_args(argv)
    try:
        res = evaluate(a.measured, a.kernel_table)
    except MeasuredError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(to_text(res))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(res, indent=1, default=str))
    return 1 if a.check and not all(s["meets"] for s in res["summary"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Cross-layout accuracy of the what-if model (issue 35): every measured layout predicted from each profiled baseline.

    python benchmarks/bench_whatif_layouts.py tests/fixtures/h100_4gpu_layouts/measured.json
    python benchmarks/bench_whatif_layouts.py MEASURED.json --json out.json --check   # exit 1 when a target fails

``measured.json``: the baselines (profiled run dirs) and the measured points, in the format
``tracelens.projection.measured`` reads (its docstring). A point's config is the base config with its ``set``; from a
baseline the what-if changes every key where the two differ (`changes_for`). Each prediction is compared with the
measurement: tokens/s/GPU error, and the memory verdict (predicted fits / out of memory against the point's status: an
OOM predicted to fit is wrong, and so is a run that fit predicted as OOM). A point the model refuses (a knob without a
mechanism) is listed with its one-line reason and not counted. The baseline's own point (no key changed) is shown and
not counted.

Targets (issue 35, "Done means"): per baseline, over >= 8 cross-layout predictions, median |error| <= 8 %, max
<= 20 %; every memory verdict right. No timing runs here: the measurements are the file's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MEDIAN_TARGET, MAX_TARGET, MIN_POINTS = 0.08, 0.20, 8


# the measured.json format has one reader, shared with `tracelens scaleout --validate`
from tracelens.projection.measured import (
    Baseline,
    MeasuredError,
    Point,
    changes_for,
    load_measured,
)

__all__ = ["Baseline", "MeasuredError", "Point", "changes_for", "evaluate", "load_measured", "main", "to_text"]


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

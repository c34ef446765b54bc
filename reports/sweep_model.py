"""The sweep report's what-if sections (sweep.html; issue 18):

* **Predicted vs measured**: every model-driven trial (``autotune/model_search.py`` stores each
  prediction in the sweep store's meta key ``predictions``): x the predicted objective with its
  uncertainty (1 sigma) as error bars, y the measured one, the y = x line, points labelled by trial id;
  the configs predicted not to fit in memory (never run) in a small table.
* **Where the step time went**: the step decomposition (``tracelens.projection``) of the baseline and of
  each kept trial of the search's path, ending with the best, side by side per component, so each kept
  move's shrinking component shows. From each trial's run dir (``Model.from_run(run).base_components``:
  the measured step, calibrated to its mean step time); where a run dir cannot be read, from the stored
  prediction (``components_ms`` of the trial, ``base_components_ms`` of its anchor) and labelled so.

Reads the store file read-only with sqlite3 (``reports`` does not import ``autotune``).
"""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path
from typing import Any

import pandas as pd

from .decomposition import compare_figure, components_order
from .common import html_table, plot_text

MAX_SIDES = 6  # baseline + up to 5 kept trials (the best always among them)


def load_predictions(result) -> tuple[list[dict], str]:
    """The stored predictions of the sweep in ``result.out`` (``result.predictions`` when the result
    carries them) and a one-line note when they could not be read ('' otherwise)."""
    preds = getattr(result, "predictions", None)
    if isinstance(preds, list):
        return [p for p in preds if isinstance(p, dict)], ""
    db = Path(result.out) / "sweep.sqlite"
    if not db.is_file():
        return [], ""
    try:
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
        try:
            row = con.execute("SELECT v FROM autotune_meta WHERE k = 'predictions'").fetchone()
        finally:
            con.close()
        preds = json.loads(row[0]) if row else []
    except (sqlite3.Error, ValueError, TypeError) as e:
        return [], f"the predictions in {db} could not be read ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
    if not isinstance(preds, list):
        return [], f"{db}: meta 'predictions' is not a list (damaged store?)"
    return [p for p in preds if isinstance(p, dict)], ""


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _knobs_text(knobs: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in knobs.items()) if isinstance(knobs, dict) else str(knobs or "")


def frames(preds: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the predictions of trials that ran, the predicted-OOM configs that did not)."""
    ran, oom = [], []
    for p in preds:
        pred, unc = _num(p.get("predicted")), _num(p.get("uncertainty"))
        row = {"trial": p.get("trial"), "knobs": _knobs_text(p.get("knobs")), "predicted": pred,
               "uncertainty_pct": None if unc is None else 100 * unc, "anchor": p.get("anchor"),
               "peak_gib": _num(p.get("peak_gib")), "measured": _num(p.get("measured")),
               "status": p.get("status") or "", "decision": p.get("decision") or "",
               "modeled": "; ".join(str(m) for m in p.get("modeled") or [])}
        if p.get("trial") is None:
            oom.append(row)
        else:
            m = row["measured"]
            row["error_pct"] = None if m is None or pred is None or m == 0 else 100 * (pred - m) / m
            ran.append(row)
    cols = ["trial", "knobs", "predicted", "uncertainty_pct", "measured", "error_pct", "anchor", "status", "decision",
            "peak_gib", "modeled"]
    ran_df = pd.DataFrame(ran, columns=cols).sort_values("trial", kind="stable") if ran else pd.DataFrame(columns=cols)
    oom_df = pd.DataFrame(oom, columns=cols[:4] + ["anchor", "peak_gib", "decision"]) if oom else pd.DataFrame(
        columns=cols[:4] + ["anchor", "peak_gib", "decision"])
    return ran_df.reset_index(drop=True), oom_df


def predicted_figure(ran: pd.DataFrame, objective: str) -> dict | None:
    """Scatter of measured vs predicted objective per model-driven trial that measured, with the 1-sigma
    uncertainty as horizontal error bars, labelled by trial id, and the y = x line."""
    ok = ran[ran["measured"].notna() & ran["predicted"].notna()]
    if ok.empty:
        return None
    xs, ys = [float(v) for v in ok["predicted"]], [float(v) for v in ok["measured"]]
    err = [float(p) * (u or 0.0) / 100 for p, u in zip(xs, ok["uncertainty_pct"].fillna(0.0))]
    lo = min(min(x - e for x, e in zip(xs, err)), min(ys))
    hi = max(max(x + e for x, e in zip(xs, err)), max(ys))
    pad = 0.08 * (hi - lo) if hi > lo else 0.1 * abs(hi) or 1.0
    lo, hi = lo - pad, hi + pad
    data = [{"type": "scatter", "mode": "lines", "name": "measured = predicted", "x": [lo, hi], "y": [lo, hi],
             "line": {"color": "#5b6475", "dash": "dash", "width": 1}, "hoverinfo": "skip"}]
    groups = (("kept", "kept", "#2e9d5b"), ("reverted", "reverted", "#9aa6b8"), (None, "other", "#3b7dd8"))
    for decision, name, color in groups:
        m = (ok["decision"] == decision) if decision else ~ok["decision"].isin(["kept", "reverted"])
        if not m.any():
            continue
        sub = ok[m]
        idx = [i for i, flag in enumerate(m) if flag]
        custom = [[plot_text(k), f"{u:.0f}" if u == u and u is not None else "–",
                   f"{e:+.1f} %" if e == e and e is not None else "–", plot_text(d or "–")]
                  for k, u, e, d in zip(sub["knobs"], sub["uncertainty_pct"], sub["error_pct"], sub["decision"])]
        data.append({
            "type": "scatter", "mode": "markers+text", "name": f"{name} trial", "x": [xs[i] for i in idx],
            "y": [ys[i] for i in idx], "text": [f"#{int(t)}" for t in sub["trial"]], "textposition": "top center",
            "error_x": {"type": "data", "array": [round(err[i], 6) for i in idx], "visible": True, "color": "#1d2430",
                        "thickness": 1.2, "width": 4},
            "marker": {"size": 11, "color": color}, "customdata": custom,
            "hovertemplate": "trial %{text} (%{customdata[3]}): %{customdata[0]}<br>predicted %{x:.4g} ± "
                             "%{customdata[1]} %<br>measured %{y:.4g} (error %{customdata[2]})<extra></extra>"})
    layout = {"height": 420, "margin": {"l": 80, "r": 20, "t": 10, "b": 50}, "showlegend": True,
              "xaxis": {"title": {"text": f"predicted {plot_text(objective)} (error bars: ±1σ)"}, "range": [lo, hi]},
              "yaxis": {"title": {"text": f"measured {plot_text(objective)}"}, "range": [lo, hi]},
              "legend": {"orientation": "h"}}
    return {"data": data, "layout": layout}


def ran_table(ran: pd.DataFrame, objective: str) -> str:
    return html_table(ran, [("trial", "trial", "num"), ("knobs", "knobs", "name"),
                            ("predicted", f"predicted {objective}", "num"), ("uncertainty_pct", "± % (1σ)", "num"),
                            ("measured", "measured", "num"), ("error_pct", "error %", "num"),
                            ("anchor", "from trial", "num"), ("decision", "decision", "text"),
                            ("modeled", "what was modeled", "text")], max_rows=10000)


def oom_table(oom: pd.DataFrame, objective: str) -> str:
    return html_table(oom, [("knobs", "knobs", "name"), ("peak_gib", "projected peak GiB", "num"),
                            ("predicted", f"predicted {objective}", "num"), ("anchor", "from trial", "num")],
                      max_rows=10000)


def summary_line(ran: pd.DataFrame) -> str:
    e = ran["error_pct"].dropna().abs() if len(ran) else pd.Series(dtype=float)
    if e.empty:
        return ""
    return (f"{len(e)} model-driven trial(s) measured: median absolute error {e.median():.1f} %, "
            f"largest {e.max():.1f} %.")


# ------------------------------------------------------------------------------ baseline vs best
def _kept_path(result) -> list[int]:
    """Trial ids of the baseline and every kept move, in the search's order (the last kept is the best
    of a guided search); for other strategies, baseline and best."""
    ids: list[int] = []
    base, best = result.baseline, result.best
    if base and base.get("status") == "ok":
        ids.append(int(base["id"]))
    if result.strategy == "guided":
        for p in result.path or []:
            if p.get("decision") == "kept" and p.get("status") == "ok" and int(p["trial"]) not in ids:
                ids.append(int(p["trial"]))
    if best and best.get("status") == "ok" and int(best["id"]) not in ids:
        ids.append(int(best["id"]))
    if len(ids) > MAX_SIDES:  # keep the baseline, the last kept moves and the best
        ids = ids[:1] + ids[-(MAX_SIDES - 1):]
    return ids


def decomposition_sides(result, preds: list[dict]) -> tuple[list[tuple[str, dict, str, float | None]], list[str]]:
    """[(label, {component: ms per step}, source, tokens per step per GPU)] for the baseline and each kept
    trial, and notes for the ones that could not be decomposed. ``source``: 'measured' (the trial's own
    run dir, calibrated to its mean step time) or 'predicted' (the stored prediction, when the run dir
    could not be read)."""
    from tracelens.projection.decomposition import reason
    from tracelens.projection.whatif import Model

    trials = {int(t["id"]): t for t in result.trials}
    by_trial = {int(p["trial"]): p for p in preds if p.get("trial") is not None}
    base_id = int(result.baseline["id"]) if result.baseline else None
    best_id = int(result.best["id"]) if result.best else None
    sides, notes = [], []
    prev_knobs: dict | None = None
    for tid in _kept_path(result):
        t = trials.get(tid)
        if t is None:
            continue
        role = "baseline" if tid == base_id else ("best" if tid == best_id else "kept")
        knobs = t.get("knobs") or {}
        moved = {k: v for k, v in knobs.items() if prev_knobs is not None and prev_knobs.get(k) != v}
        prev_knobs = knobs
        label = f"{role} #{tid}" + (f": {_knobs_text(moved)}" if moved else "")
        comps, source, why = None, "", ""
        if t.get("run_dir"):
            try:
                m = Model.from_run(Path(t["run_dir"]))
                comps, source = {c: 1e3 * float(v) for c, v in m.base_components.items()}, "measured"
            except Exception as e:  # noqa: BLE001 - a trial the model cannot read falls back to its prediction
                why = reason(e)
        if comps is None and tid in by_trial and isinstance(by_trial[tid].get("components_ms"), dict):
            comps, source = {c: float(v) for c, v in by_trial[tid]["components_ms"].items()
                             if _num(v) is not None}, "predicted"
        if comps is None and tid == base_id:  # the baseline is every first prediction's anchor
            anchored = [p for p in preds if p.get("anchor") == tid and isinstance(p.get("base_components_ms"), dict)]
            if anchored:
                comps = {c: float(v) for c, v in anchored[0]["base_components_ms"].items() if _num(v) is not None}
                source = "measured"  # the anchor's calibrated replay: its measured step
        if comps is None:
            notes.append(f"trial {tid}: no decomposition ({why or 'no run dir and no stored prediction'})")
            continue
        if why:
            notes.append(f"trial {tid}: run dir not decomposed ({why}); its stored prediction is shown")
        tokens = _num((t.get("metrics") or {}).get("tokens_per_step_per_gpu"))
        sides.append((label + (" (predicted)" if source == "predicted" else ""), comps, source, tokens))
    return sides, notes


def normalized(sides: list[tuple[str, dict, str, float | None]]) -> tuple[list[tuple[str, dict]], str]:
    """The sides in one unit: ms per step when every side runs the same tokens per step (per GPU), else
    µs per token (a move that changes the micro-batch changes the step's work: per token is what the
    objective, tokens/s/GPU, measures)."""
    toks = [tk for *_, tk in sides]
    if len({tk for tk in toks}) <= 1 or any(tk is None or tk <= 0 for tk in toks):
        return [(lbl, v) for lbl, v, _, _ in sides], "ms per step"
    return [(lbl, {c: 1e3 * x / tk for c, x in v.items()}) for lbl, v, _, tk in sides], "µs per token"


def decomposition_table(sides: list[tuple[str, dict]], unit: str, raw: list[tuple[str, dict, str, float | None]]) -> str:
    """Component x side (in ``unit``), with the change from the first side (the baseline) to the last;
    then the step time and tokens per step of each side."""
    comps = [c for c in components_order() if any(v.get(c, 0.0) > 0 for _, v in sides)]
    short = unit.split()[0]
    rows = []
    for c in comps + ["sum"]:
        row: dict[str, Any] = {"component": f"step ({unit})" if c == "sum" else c}
        for i, (_, v) in enumerate(sides):
            row[f"s{i}"] = sum(v.get(k, 0.0) for k in components_order()) if c == "sum" else v.get(c, 0.0)
        row["delta"] = row[f"s{len(sides) - 1}"] - row["s0"]
        rows.append(row)
    if unit != "ms per step":
        rows.append({"component": "step (ms)", **{f"s{i}": sum(v.values()) for i, (_, v, _, _) in enumerate(raw)}})
        rows.append({"component": "tokens per step per GPU", **{f"s{i}": tk for i, (*_, tk) in enumerate(raw)}})
    def head(lbl: str) -> str:  # "kept #3: micro_batch_size=8" -> "kept #3"; "(predicted)" kept
        return lbl.split(":")[0] + (" (predicted)" if lbl.endswith("(predicted)") else "")

    cols = [("component", "component", "text")] + [(f"s{i}", f"{head(lbl)} {short}", "num") for i, (lbl, _) in enumerate(sides)]
    if len(sides) > 1:
        cols.append(("delta", f"{head(sides[-1][0]).split(' (')[0]} − {head(sides[0][0]).split(' (')[0]} {short}", "num"))
    return html_table(pd.DataFrame(rows), cols)


def context(result, space) -> dict:
    """Everything sweep.html's two what-if sections need; never raises (a failure is a one-line note)."""
    out: dict[str, Any] = {"figures": {}, "pred_note": "", "pred_table": "", "oom_table": "", "pred_summary": "",
                           "pred_count": 0, "oom_count": 0, "decomp_table": "", "decomp_notes": [], "decomp_error": "",
                           "decomp_unit": "", "oom_limit": ""}
    try:
        preds, err = load_predictions(result)
        ran, oom = frames(preds)
        out["pred_count"], out["oom_count"] = int(len(ran)), int(len(oom))
        out["pred_note"] = err
        fig = predicted_figure(ran, space.objective)
        if fig is not None:
            out["figures"]["plot-predicted"] = fig
        if len(ran):
            out["pred_table"] = ran_table(ran, space.objective)
            out["pred_summary"] = summary_line(ran)
        if len(oom):
            out["oom_table"] = oom_table(oom, space.objective)
            lim = getattr(space, "memory_gib", None)
            out["oom_limit"] = (f"the space's limit of {lim:g} GiB (limits.memory_gib)" if lim
                                else "the device's memory")
    except Exception as e:  # noqa: BLE001 - the sweep's results stand even when this section cannot be drawn
        out["pred_note"] = f"predictions unavailable: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        preds = []
    try:
        sides, notes = decomposition_sides(result, preds)
        out["decomp_notes"] = notes
        if sides:
            norm, unit = normalized(sides)
            out["decomp_unit"] = unit
            out["figures"]["plot-decomp-compare"] = compare_figure(norm, unit)
            out["decomp_table"] = decomposition_table(norm, unit, sides)
        else:
            out["decomp_error"] = ("no trial of the search's path could be decomposed (below)" if notes
                                   else "no successful trial to decompose")
    except Exception as e:  # noqa: BLE001
        out["decomp_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return out


__all__ = ["load_predictions", "frames", "predicted_figure", "decomposition_sides", "context"]

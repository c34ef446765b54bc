"""Pipeline schedule figures and the standalone ``ppvis.html`` (and the pipeline section of report.html).

    >>> from tracelens.analysis.pipeline import load_pipeline
    >>> from reports.pipeline import write_ppvis
    >>> write_ppvis(load_pipeline("runs/pp4"), "runs/pp4/ppvis.html")

Figures are plain plotly dicts embedded as JSON by `reports.common.safe_json`; every label that comes from
the data is HTML-escaped for plotly. Three figures:
    lanes     one row per rank, one bar per action (colour = F/B/W, text = microbatch), idle gaps as
              hatched grey "bubble" bars, for one step (the last analyzed one, or --step)
    bubble    measured bubble ratio per rank and overall next to the theoretical ratio
    account   each rank's idle per step as a stacked bar: schedule theory, stage imbalance, p2p/comm wait,
              host/launch overhead, other (`tracelens.analysis.pipeline.bubble_account`)
    stages    mean F/B/W time per microbatch of each stage, with the mean of stages as a line
"""

from __future__ import annotations

import html
import math
import os
from pathlib import Path
from typing import Any

from tracelens.analysis.pipeline import ACCOUNT_LABELS, ACCOUNT_PARTS, PipelineAnalysis, _ranges, fmt_ns

from .common import html_table, plotly_js_packed, safe_json, template_env, version, write_text_atomic

KIND_COLORS = {"F": "#3b7dd8", "B": "#e4572e", "W": "#8e5ad6", "bubble": "#c9ced8"}
ACCOUNT_COLORS = {"theory": "#9aa6b8", "imbalance": "#e8a33d", "comm": "#3b7dd8", "host": "#c0392b", "other": "#4a5263"}
_SHORT = {"theory": "theory", "imbalance": "imbalance", "comm": "comm", "host": "host", "other": "other"}
KIND_NAMES = {"F": "forward (F)", "B": "backward (B)", "W": "weight grad (W)"}


def _esc(v: Any) -> str:
    return html.escape(str(v), quote=False)


def _ms(ns: Any) -> float:
    return round(float(ns) / 1e6, 6)


def _lane(rank: int, pp_rank: int) -> str:
    return f"rank {rank} · pp {pp_rank}"


def lanes_figure(res: PipelineAnalysis) -> dict:
    """Gantt of the shown step: one lane per rank, bars per action, bubbles between them."""
    acts = res.selected[res.selected["step"] == res.shown_step]
    t0 = int(acts["start_ns"].min())
    lanes = acts[["rank", "pp_rank"]].drop_duplicates().sort_values("rank", kind="stable")
    lane_of = {int(r): _lane(int(r), int(p)) for r, p in zip(lanes["rank"], lanes["pp_rank"])}
    data = []
    for kind in ("F", "B", "W"):
        k = acts[acts["kind"] == kind]
        if k.empty:
            continue
        dur = (k["end_ns"] - k["start_ns"]).to_numpy()
        data.append({
            "type": "bar", "orientation": "h", "name": KIND_NAMES[kind],
            "y": [lane_of[int(r)] for r in k["rank"]],
            "base": [_ms(s - t0) for s in k["start_ns"]], "x": [_ms(d) for d in dur],
            "text": [str(int(m)) for m in k["microbatch"]], "textposition": "inside", "insidetextanchor": "middle",
            "textfont": {"color": "#ffffff"},
            "customdata": [[int(s), int(m), _ms(d)] for s, m, d in zip(k["stage"], k["microbatch"], dur)],
            "hovertemplate": f"{kind} · stage %{{customdata[0]}} · microbatch %{{customdata[1]}}<br>"
                             "start %{base:.3f} ms · %{customdata[2]:.3f} ms<extra>%{y}</extra>",
            "marker": {"color": KIND_COLORS[kind], "line": {"color": "#ffffff", "width": 1}},
        })
    g = res.gaps
    if not g.empty:
        data.append({
            "type": "bar", "orientation": "h", "name": "bubble (idle)",
            "y": [lane_of.get(int(r), f"rank {int(r)}") for r in g["rank"]],
            "base": [_ms(s - t0) for s in g["start_ns"]], "x": [_ms(e - s) for s, e in zip(g["start_ns"], g["end_ns"])],
            "customdata": [[w] for w in g["where"]],
            "hovertemplate": "idle (%{customdata[0]}) · %{x:.3f} ms<extra>%{y}</extra>",
            "marker": {"color": KIND_COLORS["bubble"], "pattern": {"shape": "/", "fgcolor": "#9aa6b8"}},
        })
    n = len(lanes)
    layout = {
        "barmode": "overlay", "bargap": 0.25, "height": 140 + 46 * n,
        "margin": {"l": 110, "r": 20, "t": 10, "b": 40}, "uniformtext": {"mode": "hide", "minsize": 8},
        "xaxis": {"title": {"text": f"ms since the start of step {res.shown_step}"}, "zeroline": False},
        "yaxis": {"autorange": "reversed", "categoryorder": "array", "categoryarray": list(lane_of.values())},
        "legend": {"orientation": "h", "y": -0.25 if n < 4 else -0.12},
    }
    return {"data": data, "layout": layout}


def bubble_figure(res: PipelineAnalysis) -> dict:
    """Measured bubble ratio per rank (and overall) next to the schedule's theoretical ratio."""
    pr = res.per_rank.sort_values("rank", kind="stable")
    x = [_lane(int(r), int(p)) for r, p in zip(pr["rank"], pr["pp_rank"])] + ["overall"]
    measured = [round(100 * float(v), 3) for v in pr["bubble_ratio"]] + [round(100 * res.overall_ratio, 3)]
    data = [{"type": "bar", "name": "measured", "x": x, "y": measured, "marker": {"color": "#3b7dd8"},
             "text": [f"{v:.1f}%" for v in measured], "textposition": "outside",
             "hovertemplate": "%{x}: %{y:.2f}% idle<extra>measured</extra>"}]
    if not math.isnan(res.theory_ratio):
        th = round(100 * res.theory_ratio, 3)
        data.append({"type": "bar", "name": _esc(f"theory ({res.meta.schedule})"), "x": x, "y": [th] * len(x),
                     "marker": {"color": "#9aa6b8"}, "hovertemplate": "%{y:.2f}%<extra>theory</extra>"})
    top = max(measured + [100 * res.theory_ratio if not math.isnan(res.theory_ratio) else 0.0, 1.0])
    layout = {"barmode": "group", "height": 320, "margin": {"l": 60, "r": 20, "t": 20, "b": 60},
              "yaxis": {"title": {"text": "bubble (% of step window)"}, "range": [0, top * 1.2]},
              "legend": {"orientation": "h", "y": -0.25}}
    return {"data": data, "layout": layout}


def account_figure(res: PipelineAnalysis) -> dict:
    """Each rank's idle per step (over the account's steps) stacked by part; the measured idle on top."""
    acc = res.account
    pr = acc.per_rank.sort_values("rank", kind="stable")
    x = [_lane(int(r), int(p)) for r, p in zip(pr["rank"], pr["pp_rank"])]
    n = pr["steps"].clip(lower=1).to_numpy()
    idle = pr["idle_ns"].to_numpy()
    data = []
    for part in ACCOUNT_PARTS:
        v = pr[f"{part}_ns"].to_numpy()
        share = [round(100 * float(a) / float(b), 2) if b > 0 else 0.0 for a, b in zip(v, idle)]
        data.append({"type": "bar", "name": _esc(ACCOUNT_LABELS[part]), "x": x, "y": [_ms(a / k) for a, k in zip(v, n)],
                     "customdata": [[s] for s in share], "marker": {"color": ACCOUNT_COLORS[part]},
                     "hovertemplate": f"{_esc(ACCOUNT_LABELS[part])}: %{{y:.3f}} ms per step "
                                      "(%{customdata[0]:.1f}% of the idle)<extra>%{x}</extra>"})
    annotations = [{"x": xi, "y": _ms(i / k), "yanchor": "bottom", "showarrow": False,
                    "text": f"idle {fmt_ns(i / k)}"} for xi, i, k in zip(x, idle, n)]
    top = max([_ms(i / k) for i, k in zip(idle, n)] + [1e-3])
    layout = {"barmode": "stack", "height": 360, "margin": {"l": 60, "r": 20, "t": 24, "b": 60},
              "yaxis": {"title": {"text": f"idle ms per step (step {_ranges(acc.steps)})"}, "range": [0, top * 1.15]},
              "annotations": annotations, "legend": {"orientation": "h", "y": -0.2, "traceorder": "normal"}}
    return {"data": data, "layout": layout}


def account_context(res: PipelineAnalysis) -> dict[str, Any] | None:
    """Table, advice and note of the account section (None without an account)."""
    acc = res.account
    if acc is None:
        return None
    pr = acc.per_rank.sort_values("rank", kind="stable")
    n = pr["steps"].clip(lower=1)
    cols = {"idle_ms": pr["idle_ns"] / n / 1e6}
    table_cols = [("rank", "rank", "num"), ("pp_rank", "pp rank", "num"), ("steps", "steps", "num"),
                  ("idle_ms", "idle ms/step", "num")]
    for part in ACCOUNT_PARTS:
        cols[f"{part}_ms"] = pr[f"{part}_ns"] / n / 1e6
        cols[f"{part}_pct"] = 100 * pr[f"{part}_ns"] / pr["idle_ns"].where(pr["idle_ns"] > 0)
        table_cols += [(f"{part}_ms", f"{_SHORT[part]} ms/step", "num"), (f"{part}_pct", "% of idle", "pct")]
    table = html_table(pr.assign(**cols), table_cols)
    tot = acc.totals()
    parts = [{"part": p, "label": ACCOUNT_LABELS[p], "color": ACCOUNT_COLORS[p], "advice": acc.advice[p],
              "pct": 100 * tot[p] / tot["idle"] if tot["idle"] > 0 else 0.0} for p in ACCOUNT_PARTS]
    return {"table": table, "parts": parts, "note": acc.note, "steps": _ranges(acc.steps)}


def stage_figure(res: PipelineAnalysis) -> dict:
    """Stacked F/B/W time per microbatch per stage; the mean of stages as a dashed line."""
    t = res.balance.table
    x = [f"stage {int(s)}" for s in t["stage"]]
    data = []
    for kind, col in (("F", "f_ns"), ("B", "b_ns"), ("W", "w_ns")):
        if float(t[col].fillna(0).sum()) == 0:
            continue
        data.append({"type": "bar", "name": KIND_NAMES[kind], "x": x, "y": [_ms(v) if not math.isnan(v) else 0 for v in t[col]],
                     "marker": {"color": KIND_COLORS[kind]}, "hovertemplate": "%{x}: %{y:.3f} ms " + kind + "<extra></extra>"})
    mean = float(t["total_ns"].mean())
    shapes = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": _ms(mean), "y1": _ms(mean),
               "line": {"color": "#1d2430", "dash": "dash", "width": 1.5}}]
    slow = res.balance.slowest_stage
    annotations = [{"x": f"stage {slow}", "y": _ms(t.at[slow, "total_ns"]), "yanchor": "bottom", "showarrow": False,
                    "text": f"{res.balance.slowest_ratio:.2f}x mean", "font": {"color": "#c0392b" if _verdict(res.balance) == "flagged" else "#5b6475"}},
                   {"xref": "paper", "x": 1, "xanchor": "right", "y": _ms(mean), "yanchor": "bottom", "showarrow": False,
                    "text": "mean of stages", "font": {"size": 11}}]
    layout = {"barmode": "stack", "height": 340, "margin": {"l": 60, "r": 20, "t": 24, "b": 60},
              "yaxis": {"title": {"text": "ms per microbatch"}}, "shapes": shapes, "annotations": annotations,
              "legend": {"orientation": "h", "y": -0.25, "traceorder": "normal"}}
    return {"data": data, "layout": layout}


def _verdict(balance) -> str:
    """The statement's colour class: 'flagged' (red) only when it reports a fixable imbalance (a layer move
    that lowers the bottleneck, or an imbalance without a known layout); 'neutral' when the stages are
    uneven but moving whole layers would not help; 'ok' (green) when they are balanced."""
    if not balance.flagged:
        return "ok"
    move = balance.move
    layout_known = "layers" in balance.table and balance.table["layers"].notna().any()
    if layout_known and (move is None or not move.get("layers")):
        return "neutral"
    return "flagged"


def _pct(v: Any) -> float:
    return math.nan if v is None or (isinstance(v, float) and math.isnan(v)) else 100.0 * float(v)


def section_context(res: PipelineAnalysis, id_prefix: str = "plot-pp") -> dict[str, Any]:
    """Template variables of the pipeline section (`_pipeline.html`) and its figures by element id."""
    m = res.meta
    pr = res.per_rank.sort_values("rank", kind="stable")
    per_step_ms = {c: pr[f"{c}_ns"] / pr["steps"] / 1e6 for c in ("window", "busy", "idle", "lead", "inner", "tail")}
    pr = pr.assign(**{f"{c}_ms": v for c, v in per_step_ms.items()},
                   bubble_pct=pr["bubble_ratio"].map(_pct), theory_pct=pr["theory_ratio"].map(_pct))
    rank_table = html_table(pr, [
        ("rank", "rank", "num"), ("pp_rank", "pp rank", "num"), ("steps", "steps", "num"),
        ("window_ms", "window ms/step", "num"), ("busy_ms", "busy ms/step", "num"), ("idle_ms", "idle ms/step", "num"),
        ("lead_ms", "idle before first", "num"), ("inner_ms", "idle between", "num"), ("tail_ms", "idle after last", "num"),
        ("bubble_pct", "bubble %", "pct"), ("theory_pct", "theory %", "pct")])
    t = res.balance.table
    st = t.assign(**{c.replace("_ns", "_ms"): t[c] / 1e6 for c in ("f_ns", "b_ns", "w_ns", "total_ns", "layer_ns", "critical_ns")},
                  critical_pct=100 * t["critical_share"])
    cols = [("stage", "stage", "num"), ("pp_rank", "pp rank", "num"), ("modules", "modules", "name"),
            ("layers", "layers", "num"), ("f_ms", "F ms/mb", "num"), ("b_ms", "B ms/mb", "num"),
            ("w_ms", "W ms/mb", "num"), ("total_ms", "total ms/mb", "num"), ("ratio_to_mean", "x mean", "num"),
            ("layer_ms", "ms/layer/mb", "num"), ("critical_ms", "on critical path ms/step", "num"),
            ("critical_pct", "% of critical path", "pct")]
    if not st["modules"].astype(bool).any():
        cols = [c for c in cols if c[0] not in ("modules", "layers", "layer_ms")]
    if float(st["w_ns"].fillna(0).sum()) == 0:
        cols = [c for c in cols if c[0] != "w_ms"]
    stage_table = html_table(st, cols)
    theory = ("n/a" + (f" ({res.theory_note})" if res.theory_note else "") if math.isnan(res.theory_ratio)
              else f"{100 * res.theory_ratio:.1f}%")
    inferred = f" (inferred from the actions: {', '.join(m.inferred)})" if m.inferred else ""
    overview = [
        ("schedule", m.schedule + (f" ({m.torch_schedule})" if m.torch_schedule else "")),
        ("pp × vpp", f"{m.pp} × {m.vpp} = {m.n_stages} stages"),
        ("microbatches per step", str(m.microbatches)),
        ("layout", m.layout or "–"),
        ("steps analyzed", _ranges(res.steps) + (f" (step {_ranges(res.skipped_steps)} skipped as warm-up)"
                                                  if res.skipped_steps else "")),
        ("source", "pipeline/rank<N>.jsonl" if res.source == "jsonl" else "record_function ranges in the traces"),
        ("bubble overall", f"{100 * res.overall_ratio:.1f}% measured vs {theory} theoretical"),
        ("mean step window", fmt_ns(float(res.per_step.groupby("step")["window_ns"].first().mean()))),
    ]
    figures = {f"{id_prefix}-lanes": lanes_figure(res), f"{id_prefix}-bubble": bubble_figure(res),
               f"{id_prefix}-stages": stage_figure(res)}
    account = account_context(res)
    if account is not None:
        figures[f"{id_prefix}-account"] = account_figure(res)
    return {"statement": res.balance.statement, "flagged": res.balance.flagged, "verdict": _verdict(res.balance),
            "overview": overview,
            "inferred_note": inferred, "rank_table": rank_table, "stage_table": stage_table,
            "shown_step": res.shown_step, "id_prefix": id_prefix, "warnings": list(res.warnings), "figures": figures,
            "account": account}


def render_ppvis(res: PipelineAnalysis, title: str | None = None) -> str:
    """The standalone pipeline report (plotly.js inlined; works offline)."""
    ctx = section_context(res)
    figures = ctx.pop("figures")
    m = res.meta
    return template_env().get_template("ppvis.html").render(
        title=title or "tracelens ppvis", subtitle=f"pipeline {m.schedule}, pp {m.pp}, vpp {m.vpp}, "
                                                   f"{m.microbatches} microbatches · tracelens {version()}",
        plotly_packed=plotly_js_packed(), warnings=ctx["warnings"], pipeline=ctx, figures_json=safe_json(figures))


def write_ppvis(res: PipelineAnalysis, path: str | os.PathLike, title: str | None = None) -> Path:
    return write_text_atomic(path, render_ppvis(res, title))

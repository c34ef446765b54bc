"""The step decomposition in HTML (tracelens.projection.decomposition): a stacked horizontal bar per rank
and a small table, at the top of report.html; and the side-by-side decomposition of two configs (the
sweep report's baseline vs best). Same conventions as the other pages (reports/common.py): figure dicts for plotly whose
labels are HTML-escaped, tables through ``html_table``.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from .common import html_table, plot_text

# one colour per component: work in blues/greens/purples, communication red, idle in greys
COLORS = {
    "expert GEMMs": "#1b4f9c", "dense GEMMs": "#3b7dd8", "attention": "#8e5ad6", "norms/activations": "#29a37a",
    "optimizer step": "#17a2b8", "copies/casts": "#f3a712", "exposed communication": "#e4572e",
    "collective waits": "#8e44ad", "sync waits": "#c0392b", "launch-bound idle": "#b8c2d1", "pipeline bubble": "#6c7a91", "other": "#9aa6b8",
}
MECHANISM_TEXT = {"collective waits": "the late rank's lateness", "sync waits": "per blocking sync", "launch-bound idle": "per launch",
                  "pipeline bubble": "share of the stage time", "other": "idle of no known cause"}


def components_order() -> tuple[str, ...]:
    from tracelens.projection.profile import COMPONENTS

    return COMPONENTS


def scale_text(scales_with: Any, scale_share: Any, scale_basis: Any, component: str) -> str:
    """``tokens (84 %)`` from the units' labels; ``fixed (per launch)`` for an idle component."""
    if scales_with is None or scales_with != scales_with:
        return "–"
    if scale_basis == "mechanism":
        return f"{scales_with} ({MECHANISM_TEXT.get(component, 'idle')})"
    if scale_share is None or scale_share != scale_share:
        return str(scales_with)
    return f"{scales_with} ({100 * float(scale_share):.0f} %)"


def _by_component(df: pd.DataFrame) -> dict[str, list[dict[str, Any]]]:
    """The records of each component present, in COMPONENTS order (as `df[df["component"] == comp]` row by row):
    the table has a dozen rows, and a pandas filter, reindex or lookup of its string columns costs ~1 ms each,
    some 40 of them a report; records are read as plain values (the same values the filtered frames held)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for rec in df.to_dict("records"):
        out.setdefault(rec["component"], []).append(rec)
    return {c: out[c] for c in components_order() if c in out}


def figure(df: pd.DataFrame) -> dict:
    """Stacked horizontal bar per rank: the components of its step (ms), in COMPONENTS order."""
    ranks = sorted(int(r) for r in df["rank"].unique())
    totals = df.groupby("rank")["ms"].sum()
    ylab = [f"rank {r} ({totals.loc[r]:,.1f} ms)" for r in ranks]
    data = []
    nan = float("nan")
    missing = {"ms": nan, "share": nan, "scales_with": nan, "scale_share": nan, "scale_basis": nan}
    for comp, recs in _by_component(df).items():  # (a component without rows has no bar)
        at = {int(r["rank"]): r for r in recs}
        if len(at) < len(recs):  # two rows of one rank: what the frame's reindex says of it
            df[df["component"] == comp].set_index("rank").reindex(ranks)
        sub = [at.get(r, missing) for r in ranks]  # (each rank's row; a rank without one: all missing)
        if not any((0.0 if x["ms"] != x["ms"] else x["ms"]) > 0 for x in sub):
            continue
        custom = [[f"{100 * float(x['share']):.1f}" if x["share"] == x["share"] else "–",
                   plot_text(scale_text(x["scales_with"], x["scale_share"], x["scale_basis"], comp))] for x in sub]
        data.append({"type": "bar", "orientation": "h", "name": plot_text(comp), "y": ylab,
                     "x": [round(float(x["ms"]), 4) if x["ms"] == x["ms"] else 0.0 for x in sub],
                     "marker": {"color": COLORS.get(comp, "#888")}, "customdata": custom,
                     "hovertemplate": "%{y}: %{x:.3f} ms " + plot_text(comp)
                     + " (%{customdata[0]} % of the step)<br>scales with %{customdata[1]}<extra></extra>"})
    layout = {"barmode": "stack", "height": 150 + 34 * len(ranks), "margin": {"l": 120, "r": 20, "t": 10, "b": 40},
              "xaxis": {"title": {"text": "ms per step"}}, "yaxis": {"autorange": "reversed", "automargin": True},
              "legend": {"orientation": "h"}}
    return {"data": data, "layout": layout}


def table(df: pd.DataFrame) -> str:
    """One row per component (those with time on some rank): how it scales, then ms and % of the step
    per rank (up to 4 ranks), else the mean, min and max over the ranks."""
    ranks = sorted(int(r) for r in df["rank"].unique())
    rows = []
    for comp, recs in _by_component(df).items():
        ms = [r["ms"] for r in recs]
        if not any(v > 0 for v in ms):
            continue
        # the label of the rank where the component takes most time (ranks of one job agree in practice); the
        # first of the largest, NaN left out (Series.idxmax)
        top = recs[max((i for i, v in enumerate(ms) if v == v), key=lambda i: (ms[i], -i))]
        row: dict[str, Any] = {"component": comp,
                               "scales": scale_text(top["scales_with"], top["scale_share"], top["scale_basis"], comp)}
        if len(ranks) <= 4:
            for r in ranks:
                x = next((rec for rec in recs if rec["rank"] == r), None)
                row[f"ms{r}"] = float(x["ms"]) if x is not None else None
                row[f"pct{r}"] = 100 * float(x["share"]) if x is not None else None
        else:
            v = pd.Series(ms, dtype=float)
            row.update(mean=float(v.mean()), min=float(v.min()), max=float(v.max()),
                       pct=100 * float(pd.Series([r["share"] for r in recs], dtype=float).mean()))
        rows.append(row)
    total: dict[str, Any] = {"component": "step (sum)", "scales": ""}
    tot = df.groupby("rank")["ms"].sum()
    if len(ranks) <= 4:
        for r in ranks:
            total[f"ms{r}"], total[f"pct{r}"] = float(tot.loc[r]), 100.0
    else:
        total.update(mean=float(tot.mean()), min=float(tot.min()), max=float(tot.max()), pct=100.0)
    rows.append(total)
    cols = [("component", "component", "text"), ("scales", "scales with (share of its units' time)", "text")]
    if len(ranks) <= 4:
        for r in ranks:
            cols += [(f"ms{r}", f"rank {r} ms", "num"), (f"pct{r}", f"rank {r} % of step", "pct")]
    else:
        cols += [("mean", "mean ms", "num"), ("min", "min ms", "num"), ("max", "max ms", "num"),
                 ("pct", "mean % of step", "pct")]
    return html_table(pd.DataFrame(rows), cols)


def section_context(analysis) -> dict:
    """What report.html's "Step decomposition" section needs: ``decomp_note`` (which basis, how close),
    ``decomp_table``, ``decomp_figure`` (or None), or ``decomp_error``: one line saying why there is none.
    Never raises: a failure anywhere becomes that line."""
    from tracelens.projection.decomposition import reason

    try:
        df = analysis.decomposition()
        return {"decomp_note": df.attrs.get("note", ""), "decomp_basis": df.attrs.get("basis", ""),
                "decomp_table": table(df), "decomp_figure": figure(df), "decomp_error": ""}
    except Exception as e:  # noqa: BLE001 - the report is written whatever the decomposition meets
        return {"decomp_note": "", "decomp_basis": "", "decomp_table": "", "decomp_figure": None,
                "decomp_error": reason(e)}


def compare_figure(sides: list[tuple[str, dict[str, float]]], unit: str = "ms per step") -> dict:
    """Grouped horizontal bars per component, one colour per side (e.g. baseline vs best), in ``unit``.
    ``sides``: (label, {component: value})."""
    comps = [c for c in components_order() if any(v.get(c, 0.0) > 0 for _, v in sides)]
    # the baseline grey, the best green, the moves between in blues (in the search's order)
    blues = ["#9ec5f0", "#6fa3e0", "#3b7dd8", "#1b4f9c"]
    data = []
    for i, (label, comp_ms) in enumerate(sides):
        color = "#9aa6b8" if label.startswith("baseline") else "#2e9d5b" if label.startswith("best") \
            else blues[(i - 1) % len(blues)]
        tot = sum(comp_ms.get(c, 0.0) for c in components_order())
        data.append({"type": "bar", "orientation": "h", "name": plot_text(f"{label} ({tot:,.1f} {unit.split()[0]})"),
                     "legendgroup": str(i),
                     "y": [plot_text(c) for c in comps], "x": [round(float(comp_ms.get(c, 0.0)), 4) for c in comps],
                     "marker": {"color": color},
                     "hovertemplate": plot_text(label) + ": %{y} %{x:.3f} " + plot_text(unit) + "<extra></extra>"})
    layout = {"barmode": "group", "height": 160 + 22 * len(comps) * max(2, len(sides)),
              "margin": {"l": 150, "r": 20, "t": 10, "b": 40},
              "xaxis": {"title": {"text": plot_text(unit)}}, "yaxis": {"autorange": "reversed", "automargin": True},
              "legend": {"orientation": "h"}}
    return {"data": data, "layout": layout}


__all__ = ["figure", "table", "section_context", "compare_figure", "scale_text", "COLORS"]

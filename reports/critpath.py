"""The report's "Critical path across ranks" section (tracelens.analysis.critical_path): one step's path drawn as
it runs from rank to rank, coloured by what each stretch is, and the tables by cause and by rank."""

from __future__ import annotations

from typing import Any

import pandas as pd

from .common import COLORS, html_table, plot_text

# a colour per segment kind (compute in the kernel-category colours of the other figures)
KIND_COLORS = {"launch-bound": "#e377c2", "host sync": "#8b1a1a", "idle": "#dfe3ea", "transfer": COLORS["communication"],
               "comm": "#f08a72", "wait": "#6c3483"}
MAX_BARS = 3000  # merged stretches drawn per step (the tables hold every segment's time)


def _runs(seg: pd.DataFrame) -> pd.DataFrame:
    """Consecutive segments of one rank and one label merged into one stretch (start, end, label, rank)."""
    label = seg["kind"].where(seg["kind"] != "compute", seg["what"])
    new = (seg["rank"] != seg["rank"].shift()) | (label != label.shift())
    grp = new.cumsum()
    out = seg.assign(label=label).groupby(grp).agg(rank=("rank", "first"), label=("label", "first"),
                                                 start=("start_ns", "first"), end=("end_ns", "last"))
    return out[out["end"] > out["start"]]


def path_figure(cp, step: int) -> dict:
    """The step's path: one row per rank, a bar per stretch (ms from the step's start), coloured by label."""
    seg = cp.segments[cp.segments["step"] == step]
    t0 = int(cp.steps.set_index("step").at[step, "start_ns"])
    runs = _runs(seg)
    if len(runs) > MAX_BARS:  # keep the longest stretches; the rest are too short to see
        runs = runs.assign(d=runs["end"] - runs["start"]).nlargest(MAX_BARS, "d")
    ranks = sorted(int(r) for r in seg["rank"].unique())
    data = []
    for label, g in runs.groupby("label", sort=False):
        color = KIND_COLORS.get(label, COLORS.get(label, "#9aa6b8"))
        name = plot_text(label if label in KIND_COLORS else f"compute: {label}")
        data.append({"type": "bar", "orientation": "h", "name": name, "y": [f"rank {int(r)}" for r in g["rank"]],
                     "base": [round((s - t0) / 1e6, 4) for s in g["start"]],
                     "x": [round((e - s) / 1e6, 4) for s, e in zip(g["start"], g["end"])],
                     "marker": {"color": color}, "hovertemplate": "%{y}: %{x:.3f} ms " + name + " at %{base:.3f} ms<extra></extra>"})
    # the legend (up to a dozen causes) goes right of the plot, one cause per line: in a row above the plot it
    # runs into the mode bar
    layout = {"barmode": "overlay", "height": max(140 + 34 * len(ranks), 90 + 24 * len(data)),
              "margin": {"l": 70, "r": 20, "t": 40, "b": 40},
              "xaxis": {"title": {"text": f"ms from the start of step {step}"}},
              "yaxis": {"autorange": "reversed", "categoryorder": "array", "categoryarray": [f"rank {r}" for r in ranks]},
              "legend": {"orientation": "v", "x": 1.01, "xanchor": "left", "y": 1, "yanchor": "top",
                         "font": {"size": 11}}, "bargap": 0.3}
    return {"data": data, "layout": layout}


def section_context(a) -> dict[str, Any] | None:
    """The section's context: None without GPU activity; a one-line reason when there is no path (bad input);
    else the statement, the figure of the first analyzed step and the tables."""
    if not a.has_gpu:
        return None
    cp = a.critical_path()
    if not cp.available:
        return {"problem": cp.problem}
    step = int(cp.steps["step"].iloc[0])
    s = cp.steps.iloc[0]
    br, bc = cp.by_rank(), cp.by_cause()
    top = br.iloc[0]
    statement = (f"{'The profiled window' if step < 0 else f'Step {step}'}: the critical path runs {s.span_ns / 1e6:.3f} ms "
                 f"through rank(s) {', '.join(map(str, s.ranks))} with {int(s.hops)} hand-off(s); "
                 f"{100 * top['share']:.0f}% of it on rank {int(top['rank'])}, whose largest part is {top['cause']} "
                 f"({100 * top['cause_ns'] / top['ns']:.0f}% of its time there).")
    hops = cp.hops()
    return {
        "statement": statement,
        "figure": path_figure(cp, step),
        "cause_table": html_table(bc.assign(ms=bc["ns"] / 1e6, pct=100 * bc["share"]), [
            ("cause", "cause", "text"), ("ms", "ms on the path", "num"), ("pct", "% of the path", "pct"),
            ("segments", "segments", "num")]),
        "rank_table": html_table(br.assign(ms=br["ns"] / 1e6, pct=100 * br["share"],
                                           cause_pct=100 * br["cause_ns"] / br["ns"]), [
            ("rank", "rank", "num"), ("ms", "ms on the path", "num"), ("pct", "% of the path", "pct"),
            ("cause", "largest part", "text"), ("cause_pct", "% of its time", "pct")]),
        "hops": ", ".join(f"rank {int(h.from_rank)} waits for rank {int(h.to_rank)} ×{int(h['count'])}"
                          for _, h in hops.iterrows()),
        "notes": list(cp.notes) + ([f"{len(cp.steps)} steps analyzed; the figure shows step {step}, the tables all of them."]
                                   if len(cp.steps) > 1 else []),
    }

"""The report's "Critical path across ranks" section (tracelens.analysis.critical_path): one step's path drawn as
it runs from rank to rank, coloured by what each stretch is, and the tables by cause and by rank."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .common import COLORS, html_table, plot_text

# a colour per segment kind (compute in the kernel-category colours of the other figures)
KIND_COLORS = {"launch-bound": "#e377c2", "host sync": "#8b1a1a", "idle": "#dfe3ea", "transfer": COLORS["communication"],
               "comm": "#f08a72", "wait": "#6c3483"}
MAX_BARS = 3000  # merged stretches drawn per step (the tables hold every segment's time)


def _runs(cp, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str], list[int]]:
    """The step's consecutive segments of one rank and one label (the kind, or for compute the kernel category)
    merged into one stretch: (rank, label code, start, end) per stretch of positive length, the labels, and the
    ranks of the step's segments. On the
    segments' codes (`CriticalPath._coded`), without a string column per segment: a step of a long window has
    10^5 segments."""
    seg = cp.segments
    at = np.flatnonzero(seg["step"].to_numpy() == step)
    if not len(at):
        none = np.empty(0, dtype=np.int64)
        return none, none, none, none, [], []
    kind, kinds = cp._coded("kind")
    what, whats = cp._coded("what")
    # one code per distinct label string, whether it is a kind's or a category's
    uni, labels = pd.factorize(np.array(kinds + whats, dtype=object))
    kind, what = np.asarray(kind)[at].astype(np.int64), np.asarray(what)[at].astype(np.int64)
    compute = kinds.index("compute") if "compute" in kinds else -1
    label = uni[np.where(kind == compute, len(kinds) + what, kind)]
    rank = seg["rank"].to_numpy()[at]
    new = np.ones(len(at), dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (label[1:] != label[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(at)) - 1
    start, end = seg["start_ns"].to_numpy()[at][first], seg["end_ns"].to_numpy()[at][last]
    keep = end > start
    return (rank[first][keep], label[first][keep], start[keep], end[keep], [str(x) for x in labels],
            [int(r) for r in np.unique(rank)])


def path_figure(cp, step: int) -> dict:
    """The step's path: one row per rank, a bar per stretch (ms from the step's start), coloured by label."""
    t0 = int(cp.steps.set_index("step").at[step, "start_ns"])
    rank, label, start, end, labels, ranks = _runs(cp, step)
    if len(start) > MAX_BARS:  # keep the longest stretches; the rest are too short to see
        top = np.argsort(-(end - start), kind="stable")[:MAX_BARS]  # (the longest first, ties in order)
        rank, label, start, end = rank[top], label[top], start[top], end[top]
    data = []
    codes, first = np.unique(label, return_index=True)
    for code in codes[np.argsort(first)]:  # the labels in order of their first stretch
        mine = label == code
        name_ = labels[code]
        g_rank, g_start, g_end = rank[mine].tolist(), start[mine].tolist(), end[mine].tolist()
        color = KIND_COLORS.get(name_, COLORS.get(name_, "#9aa6b8"))
        name = plot_text(name_ if name_ in KIND_COLORS else f"compute: {name_}")
        data.append({"type": "bar", "orientation": "h", "name": name, "y": [f"rank {int(r)}" for r in g_rank],
                     "base": [round((s - t0) / 1e6, 4) for s in g_start],
                     "x": [round((e - s) / 1e6, 4) for s, e in zip(g_start, g_end)],
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

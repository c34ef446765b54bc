"""Memory projection report: a plotly stacked bar per configuration and a component table for each.

    >>> from tracelens.analysis import memory as M
    >>> from reports.memory import write_memory_report
    >>> p = M.project(cfg, M.resolve_layout(cfg, world=8))
    >>> write_memory_report([p], "out/memory.html", device_bytes=80 * 2**30)
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .common import html_table, plot_text, plotly_js_packed, safe_json, template_env, write_text_atomic

GIB = 1 << 30
# the parts of a configuration label such as "pp4 vpp2 tp1 cp1 ep8 dp2 mbs1 rc=none 1f1b L3" (Layout.label)
LAYOUT_LEGEND = [("pp", "pipeline stages"), ("vpp", "virtual stages per rank (interleaved schedule)"),
                 ("tp", "tensor parallel"), ("cp", "context parallel"), ("ep", "expert parallel"),
                 ("dp", "data parallel"), ("mbs", "micro-batch size (sequences)"),
                 ("rc=", "activation recompute: none, full, or the recomputed layer ids"),
                 ("1f1b / gpipe / vpp / zb1p / zbv", "pipeline schedule"),
                 ("L0…L3", "the trainer's sync-free level (0: token counts go to the host; 3: no host sync in the MoE path)")]
GROUP_COLORS = {"parameters": "#3b7dd8", "gradients": "#7fb800", "optimizer": "#1b4f9c", "activations": "#e4572e",
                "working": "#8e5ad6", "transient": "#f3a712"}


def memory_figure(projections: Sequence, device_bytes: float | None = None, measured_bytes: float | None = None) -> dict:
    """Stacked bars (GiB): x = configuration, one trace per component counted in the peak, coloured by group;
    a dashed line at the device memory and a marker at the measured peak when given."""
    labels = [plot_text(p.layout.label()) for p in projections]
    comps: dict[str, tuple[str, list[float]]] = {}
    for i, p in enumerate(projections):
        for r in p.table[p.table["in_peak"]].itertuples(index=False):
            group, vals = comps.setdefault(r.component, (r.group, [0.0] * len(projections)))
            vals[i] += r.bytes / GIB
    order = {g: k for k, g in enumerate(GROUP_COLORS)}
    data = [{"type": "bar", "name": plot_text(name), "x": labels, "y": [round(v, 4) for v in vals],
             "marker": {"color": GROUP_COLORS.get(group, "#9aa6b8"), "line": {"width": 0.5, "color": "#ffffff"}},
             "legendgroup": group, "hovertemplate": "%{x}<br>" + plot_text(name) + ": %{y:.3f} GiB<extra></extra>"}
            for name, (group, vals) in sorted(comps.items(), key=lambda kv: (order.get(kv[1][0], 99), kv[0]))]
    shapes = []
    if device_bytes:
        shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": device_bytes / GIB,
                       "y1": device_bytes / GIB, "line": {"dash": "dash", "color": "#c0392b"}})
    if measured_bytes:
        data.append({"type": "scatter", "mode": "markers", "name": "measured peak", "x": labels[:1],
                     "y": [measured_bytes / GIB], "marker": {"symbol": "diamond", "size": 12, "color": "#000"},
                     "hovertemplate": "measured: %{y:.3f} GiB<extra></extra>"})
    # legend at the right, starting below the toolbar (top margin); x labels (long layout names) automargined
    layout = {"barmode": "stack", "height": 520, "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
              "xaxis": {"automargin": True}, "yaxis": {"title": {"text": "GiB per GPU"}}, "shapes": shapes,
              "legend": {"font": {"size": 10}, "y": 1, "yanchor": "top"}}
    return {"data": data, "layout": layout}


def render(projections: Sequence, title: str = "tracelens memory", device_bytes: float | None = None,
           measured_bytes: float | None = None) -> str:
    configs = []
    cols = [("component", "component", "name"), ("group", "group", "text"), ("phase", "phase", "text"),
            ("gib", "GiB", "num"), ("in_peak", "in peak", "text"), ("note", "formula / note", "text")]
    for p in projections:
        t = p.table.assign(gib=p.table["bytes"] / GIB, in_peak=p.table["in_peak"].map({True: "yes", False: ""}))
        lay = p.layout
        configs.append({"label": lay.label(), "peak_gib": p.peak_bytes / GIB, "phase": p.phase, "stage": p.stage,
                        "world": lay.world, "dp": lay.dp, "edp": lay.edp, "dp_mode": lay.dp_mode,
                        "microbatches": lay.microbatches, "in_flight": f"{p.info.get('in_flight', 0):g}",
                        "fits": (p.peak_bytes <= device_bytes) if device_bytes else None,
                        "table": html_table(t, cols, max_rows=100)})
    figures = {"plot-memory": memory_figure(projections, device_bytes, measured_bytes)}
    from tracelens.analysis.memory import MOMENTS

    return template_env().get_template("memory.html").render(
        moments=[(k, v) for k, v in MOMENTS.items()], layout_legend=LAYOUT_LEGEND,
        title=title, warnings=[], plotly_packed=plotly_js_packed(), figures_json=safe_json(figures), configs=configs,
        n=len(configs), device_gib=device_bytes / GIB if device_bytes else None,
        measured_gib=measured_bytes / GIB if measured_bytes else None)


def write_memory_report(projections: Sequence, path: str | Path, title: str = "tracelens memory",
                        device_bytes: float | None = None, measured_bytes: float | None = None) -> Path:
    return write_text_atomic(path, render(projections, title, device_bytes, measured_bytes))

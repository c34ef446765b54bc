"""The MoE section of report.html: routing tied to expert-GEMM time and all-to-all traffic
(`tracelens.analysis.moe_view.MoEReport`, what `tracelens moe` prints).

Figures are plain plotly dicts embedded by `reports.common.safe_json` (labels from the data HTML-escaped):
    pairs     heatmap of token all-to-all bytes per step, sending rank x receiving rank (hover: routed bytes and
              padding share when the run's routing counts are known)
    experts   heatmap of routed tokens per step, MoE layer x expert (summed over ranks; routing counts only)
    gemm      expert-GEMM time per step per rank and layer, with the padded part when it is known
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tracelens.analysis.moe_view import NO_LAYER, MoEReport

from .common import html_table, plot_text


def _layer_name(v: int) -> str:
    return "–" if int(v) == NO_LAYER else f"layer {int(v)}"


def _shown_layers(t):
    """A table's rows as shown: padding as a percentage, and no layer number ("–", as the figures and the CLI say)
    for the kernels outside any layer/<i> range, not the NO_LAYER sentinel."""
    return t.assign(padding_pct=100 * t["padding_share"].astype(float), layer=t["layer"].where(t["layer"] != NO_LAYER))


def _pair_hover(sent, routed, i, j) -> str:
    s, d = int(sent.index[i]), int(sent.columns[j])
    out = plot_text(f"rank {s} → rank {d}")
    sv = sent.iat[i, j] if not sent.empty else float("nan")
    rv = routed.iat[i, j] if not routed.empty else float("nan")
    if not math.isnan(sv):
        out += f"<br>sent {sv / 1e6:,.3f} MB"
    if not math.isnan(rv):
        out += f"<br>routed {rv / 1e6:,.3f} MB"
        if not math.isnan(sv) and sv > 0:
            out += f" ({100 * (1 - rv / sv):.1f}% padding)"
    return out


def pairs_figure(rep: MoEReport) -> dict | None:
    """Bytes per step per (sending, receiving) rank: what the trace's all-to-alls sent and, with routing counts,
    what they had to carry (routed), side by side, each on its own colour scale (sent from 0: a worst-case
    buffer is uniform)."""
    sent, routed = rep.pair_matrix("sent_bytes"), rep.pair_matrix("routed_bytes")
    base = sent if not sent.empty else routed
    if base.empty:
        return None
    sent = sent.reindex(index=base.index, columns=base.columns) if not sent.empty else sent
    routed = routed.reindex(index=base.index, columns=base.columns) if not routed.empty else routed
    src = [str(int(i)) for i in base.index]
    dst = [str(int(c)) for c in base.columns]
    hover = [[_pair_hover(sent if not sent.empty else base * float("nan"), routed, i, j) for j in range(len(dst))]
             for i in range(len(src))]
    panels = [(m, name) for m, name in ((sent, "sent"), (routed, "routed")) if not m.empty]
    data, layout = [], {"margin": {"t": 40, "l": 70, "r": 20, "b": 50}, "annotations": []}
    width = 1.0 / len(panels)
    for k, (m, name) in enumerate(panels):
        ax = "" if k == 0 else str(k + 1)
        lo, hi = k * width + (0.0 if k == 0 else 0.06), (k + 1) * width - (0.06 if k + 1 < len(panels) else 0.0)
        data.append({"type": "heatmap", "z": (m.to_numpy() / 1e6).round(3).tolist(), "x": dst, "y": src, "name": name,
                     "text": hover, "hoverinfo": "text", "xaxis": f"x{ax}", "yaxis": f"y{ax}",
                     "coloraxis": f"coloraxis{ax}"})
        bar_x = hi + 0.005
        top = float(np.nanmax(m.to_numpy())) / 1e6 if np.isfinite(m.to_numpy()).any() else 1.0
        layout[f"coloraxis{ax}"] = {"colorscale": "Blues", "reversescale": True,  # plotly.js Blues: dark = low
                                    "colorbar": {"title": {"text": "MB"}, "x": bar_x, "len": 0.9, "thickness": 12},
                                    **({"cmin": 0.0, "cmax": top} if name == "sent" else {})}
        layout[f"xaxis{ax}"] = {"domain": [lo, hi - 0.04], "title": {"text": "to rank"}, "type": "category",
                                "anchor": f"y{ax}"}
        layout[f"yaxis{ax}"] = {"title": {"text": "from rank" if k == 0 else ""}, "type": "category",
                                "autorange": "reversed", "anchor": f"x{ax}"}
        layout["annotations"].append({"text": f"{name} (MB per step)", "showarrow": False, "xref": "paper",
                                      "yref": "paper", "x": (lo + hi - 0.04) / 2, "y": 1.06, "font": {"size": 13}})
    return {"data": data, "layout": layout}


def experts_figure(rep: MoEReport) -> dict | None:
    tpe = rep.tokens_per_expert()
    if tpe.empty:
        return None
    layers = [_layer_name(v) for v in tpe.index]
    return {"data": [{"type": "heatmap", "z": tpe.to_numpy().round(1).tolist(), "x": [str(int(c)) for c in tpe.columns],
                      "y": layers, "colorscale": "YlOrRd", "reversescale": True, "colorbar": {"title": {"text": "tokens / step"}},
                      "hovertemplate": "%{y}, expert %{x}: %{z:,.1f} tokens per step<extra></extra>"}],
            "layout": {"xaxis": {"title": {"text": "expert"}, "type": "category"},
                       "yaxis": {"title": {"text": "MoE layer"}, "type": "category"},
                       "margin": {"t": 30, "l": 80, "r": 20, "b": 50},
                       "title": {"text": "routed tokens per expert (all ranks)", "font": {"size": 13}}}}


def gemm_figure(rep: MoEReport) -> dict | None:
    t = rep.layers
    if t.empty or not (t["expert_gemm_us"] > 0).any():
        return None
    x = [f"rank {int(r)} · {_layer_name(ly)}" for r, ly in zip(t["rank"], t["layer"])]
    padded = t["padded_gemm_us"].fillna(0.0)
    useful = t["expert_gemm_us"] - padded
    data = [{"type": "bar", "name": "routed rows", "x": x, "y": (useful / 1e3).round(4).tolist(), "marker": {"color": "#3b7dd8"}}]
    if (padded > 0).any():
        data.append({"type": "bar", "name": "padding (upper bound)", "x": x, "y": (padded / 1e3).round(4).tolist(),
                     "marker": {"color": "#c9ced8"}})
    return {"data": data, "layout": {"barmode": "stack", "yaxis": {"title": {"text": "ms / step"}},
                                     "margin": {"t": 30, "l": 60, "r": 20, "b": 80},
                                     "title": {"text": "expert GEMM time per step", "font": {"size": 13}}}}


def moe_context(rep: MoEReport | None, error: str | None = None) -> dict[str, Any] | None:
    """The template context of the MoE section (None when the trace has no MoE work and nothing went wrong)."""
    if error:
        return {"error": error, "figures": {}}
    if rep is None or rep.empty:
        return None
    t = rep.totals

    def pct(v):
        return None if v is None else f"{100 * v:.1f}%"

    figures = {k: v for k, v in (("plot-moe-pairs", pairs_figure(rep)), ("plot-moe-experts", experts_figure(rep)),
                                  ("plot-moe-gemm", gemm_figure(rep))) if v is not None}
    # row and call counts are means over the profiled steps: whole numbers shown without decimals ("count")
    layer_cols = [("layer", "layer", "count"), ("rank", "rank", "num"), ("routed_rows", "rows routed (sent)", "count"),
                  ("received_rows", "rows received", "count"), ("local_expert_imbalance", "local expert imbalance", "num"),
                  ("gemm_calls", "grouped GEMM calls", "count"), ("rows_per_call", "rows / call", "count"),
                  ("routed_rows_per_call", "routed / call", "count"), ("padding_pct", "padding %", "pct"),
                  ("expert_gemm_us", "expert GEMM µs", "num"), ("padded_gemm_us", "on padding µs", "num")]
    summary_cols = [("layer", "layer", "count"), ("tokens", "tokens", "count"), ("expert_imbalance", "expert imbalance", "num"),
                    ("hottest_expert", "hottest expert", "num"), ("rank_imbalance", "rank imbalance", "num"),
                    ("expert_gemm_us", "expert GEMM µs", "num"), ("padding_pct", "padding %", "pct")]
    headline = []
    if t.get("padding_share_rows") is not None:
        headline.append(f"grouped-GEMM rows: {pct(t['padding_share_rows'])} padding "
                        f"({t['rows_computed']:,.0f} computed for {t['rows_routed']:,.0f} routed per step)")
    if t.get("a2a_padding_share_bytes") is not None:
        headline.append(f"token all-to-all bytes: {pct(t['a2a_padding_share_bytes'])} padding")
    if t.get("pair_skew_sent") is not None or t.get("pair_skew_routed") is not None:
        sk = [f"{k} {t[f'pair_skew_{k}']:.2f}" for k in ("sent", "routed") if t.get(f"pair_skew_{k}") is not None]
        headline.append("skew of bytes per rank pair (max / mean, off-diagonal): " + ", ".join(sk))
    return {
        "error": None, "source": rep.source, "missing": rep.missing, "steps": rep.steps, "basis": rep.routing_basis,
        "headline": headline, "straggler": rep.straggler["text"] if rep.straggler else None,
        "summary_table": html_table(_shown_layers(rep.layer_summary), summary_cols) if not rep.layer_summary.empty else "",
        "layers_table": html_table(_shown_layers(rep.layers), layer_cols) if not rep.layers.empty else "",
        "has_pairs": "plot-moe-pairs" in figures, "has_experts": "plot-moe-experts" in figures,
        "has_gemm": "plot-moe-gemm" in figures, "figures": figures,
    }


__all__ = ["experts_figure", "gemm_figure", "moe_context", "pairs_figure"]

"""Roofline figure and table columns for the HTML report (plain dicts, embedded as JSON).

    >>> from tracelens.analysis import roofline as R
    >>> from reports import roofline as RR
    >>> r = R.roofline_result(analysis)
    >>> fig = RR.roofline_figure(r.table, r.ceilings)          # {"data": [...], "layout": {...}}
    >>> html_table(r.table, RR.roofline_table_columns())       # reports.common.html_table
"""

from __future__ import annotations

import html
import math
from typing import Any, Mapping

import pandas as pd

# kind of op -> marker colour (one trace per kind so the legend filters them)
_KIND_COLORS = {
    "gemm": "#1f77b4", "grouped_gemm": "#9467bd", "attention": "#d62728", "elementwise": "#2ca02c",
    "norm": "#ff7f0e", "softmax": "#8c564b", "reduction": "#e377c2", "loss": "#7f7f7f", "embedding": "#bcbd22",
    "index": "#17becf", "copy": "#aec7e8",
}
_ROOF_COLORS = ("#444444", "#b22222", "#2f4f4f", "#8b008b")
# what a point's marker and hover text read of its row (records of these only: the table has 32 columns)
_POINT_COLUMNS = ("intensity", "tflops", "gpu_us", "pct_peak_compute", "pct_roof", "op", "dtype", "input_dims", "count",
                  "tbps", "bound", "note")


def roofline_table_columns(table: pd.DataFrame | None = None) -> list[tuple[str, str, str]]:
    """(column, header, kind) for `reports.common.html_table`; kinds 'num', 'pct', 'name', 'text'. Given the
    roofline table, the useful-work columns (padded expert GEMMs' routed rows) come too where it has any."""
    useful = table is not None and "useful_tflops" in table and bool(table["useful_tflops"].notna().any())
    return [
        ("op", "op", "name"), ("input_dims", "input dims", "name"), ("dtype", "dtype", "text"),
        ("kind", "kind", "text"), ("count", "count", "num"), ("gpu_us", "GPU µs", "num"),
        ("tflops", "TFLOP/s", "num"), ("tbps", "TB/s", "num"), ("intensity", "FLOP/byte", "num"),
        ("pct_peak_compute", "% peak compute", "pct"), ("pct_peak_memory", "% peak HBM", "pct"),
        ("pct_roof", "% of roof", "pct"),
        *([("useful_tflops", "useful TFLOP/s", "num"), ("useful_pct_roof", "useful % of roof", "pct")] if useful else []),
        ("bound", "bound", "text"), ("family", "shape family", "name"),
        ("note", "note", "text"), ("device", "device", "text"),
    ]


def unmodeled_table_columns() -> list[tuple[str, str, str]]:
    return [("op", "op", "name"), ("input_dims", "input dims", "name"), ("reason", "why not modeled", "text"),
            ("count", "count", "num"), ("kernels", "kernels", "num"), ("gpu_us", "GPU µs", "num"),
            ("device", "device", "text")]


def family_table_columns() -> list[tuple[str, str, str]]:
    return [("family", "GEMM shape family", "name"), ("shapes", "shapes", "num"), ("count", "count", "num"),
            ("gpu_us", "GPU µs", "num"), ("tflops", "TFLOP/s", "num"), ("pct_peak_compute", "% peak compute", "pct"),
            ("pct_roof", "% of roof", "pct"), ("bound", "bound", "text"), ("device", "device", "text")]


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _esc(v: Any) -> str:
    return html.escape(str(v), quote=False)


def _ceilings_map(ceilings: Any, df: pd.DataFrame) -> dict[str, Any]:
    """device name -> Ceilings, from a single Ceilings, a mapping, or None."""
    if ceilings is None:
        return {}
    if isinstance(ceilings, Mapping):
        return {k: v for k, v in ceilings.items() if v is not None}
    devs = sorted(set(df["device"].astype(str))) if "device" in df and len(df) else ["device"]
    return {d: ceilings for d in devs}


def roofline_figure(df: pd.DataFrame, ceilings: Any = None, max_points: int = 400) -> dict:
    """Log-log roofline: x = arithmetic intensity (FLOP/byte), y = achieved TFLOP/s, one marker per op
    group (size ~ sqrt of GPU time), one trace per op kind; the compute roofs and the HBM slope of each
    device drawn as lines. Groups with zero FLOPs (copies, gathers) have no place on a log axis and are
    left out (they are in the table). `ceilings`: a `tracelens.devices.Ceilings`, a mapping of device name
    -> Ceilings (as `RooflineResult.ceilings`), or None (points only)."""
    data: list[dict] = []
    pts = df
    if len(pts):
        pts = pts[(pd.to_numeric(pts["tflops"], errors="coerce") > 0)
                  & (pd.to_numeric(pts["intensity"], errors="coerce") > 0)]
        pts = pts.sort_values("gpu_us", ascending=False, kind="stable").head(max_points)
    xs_all: list[float] = []
    ys_all: list[float] = []
    gmax = max((_num(v) or 0.0 for v in pts["gpu_us"]), default=0.0) if len(pts) else 0.0
    for kind, sub in (pts.groupby("kind", sort=True) if len(pts) else []):
        x, y, size, text = [], [], [], []
        for r in sub[[c for c in _POINT_COLUMNS if c in sub]].to_dict("records"):  # (the columns read)
            xi, yi, g = _num(r.get("intensity")), _num(r.get("tflops")), _num(r.get("gpu_us")) or 0.0
            if xi is None or yi is None:
                continue
            x.append(xi)
            y.append(yi)
            size.append(6.0 + 34.0 * math.sqrt(g / gmax) if gmax > 0 else 8.0)
            pc = _num(r.get("pct_peak_compute"))
            pr = _num(r.get("pct_roof"))
            text.append("<br>".join([
                f"<b>{_esc(r.get('op'))}</b> ({_esc(r.get('dtype'))})",
                f"dims: {_esc(r.get('input_dims'))}",
                f"count {int(r.get('count') or 0)}, GPU {g:,.1f} µs",
                f"{yi:,.2f} TFLOP/s, {(_num(r.get('tbps')) or 0):,.3f} TB/s, {xi:,.2f} FLOP/B",
                f"% peak compute: {'–' if pc is None else f'{pc:.1f}'}, % of roof: {'–' if pr is None else f'{pr:.1f}'}",
                f"bound: {_esc(r.get('bound'))}" + (f" · {_esc(r.get('note'))}" if r.get("note") else ""),
            ]))
        xs_all += x
        ys_all += y
        data.append({
            "type": "scatter", "mode": "markers", "name": _esc(kind), "x": x, "y": y, "text": text,
            "hovertemplate": "%{text}<extra></extra>",
            "marker": {"size": size, "color": _KIND_COLORS.get(str(kind), "#333333"), "opacity": 0.75,
                       "line": {"width": 0.5, "color": "#222222"}},
        })
    cmap = _ceilings_map(ceilings, df)
    xmin = min(xs_all + [0.1]) / 4
    xmax = max(xs_all + [2000.0]) * 4
    ymin_pts = min(ys_all) if ys_all else 0.01
    dtypes_matrix = []
    if len(df) and "dtype" in df and "kind" in df:
        mat = df[df["kind"].isin(["gemm", "grouped_gemm", "attention"])]
        dtypes_matrix = list(mat.groupby("dtype")["gpu_us"].sum().sort_values(ascending=False, kind="stable").index[:2])
    if not dtypes_matrix:
        dtypes_matrix = ["bf16"]
    for i, (dev, c) in enumerate(sorted(cmap.items())):
        bw = _num(getattr(c, "hbm_tbps", None))
        roofs = [(f"{dt} matrix", _num(c.peak_tflops(dt, True))) for dt in dtypes_matrix]
        roofs.append(("fp32 vector", _num(c.peak_tflops("fp32", False))))
        color = _ROOF_COLORS[i % len(_ROOF_COLORS)]
        for j, (label, peak) in enumerate(roofs):
            if peak is None:
                continue
            if bw:
                ridge = peak / bw
                x = [xmin, ridge, xmax]
                y = [bw * xmin, peak, peak]
            else:
                x, y = [xmin, xmax], [peak, peak]
            data.append({
                "type": "scatter", "mode": "lines", "name": _esc(f"{dev}: {label} roof {peak:g} TFLOP/s"),
                "x": x, "y": y, "hoverinfo": "name",
                "line": {"color": color, "width": 2 if j == 0 else 1, "dash": "solid" if j == 0 else "dash"},
            })
        if bw:
            ymin_pts = min(ymin_pts, bw * xmin)
    layout = {
        "height": 560, "margin": {"l": 70, "r": 20, "t": 30, "b": 50},
        "xaxis": {"type": "log", "title": {"text": "arithmetic intensity (FLOP/byte, minimum bytes)"}},
        "yaxis": {"type": "log", "title": {"text": "achieved TFLOP/s"},
                  "range": [math.log10(max(ymin_pts, 1e-6)) - 0.3,
                            math.log10(max(ys_all + [1.0] + [(_num(c.peak_tflops(dt, True)) or 1.0)
                                                             for c in cmap.values() for dt in dtypes_matrix])) + 0.3]},
        "legend": {"orientation": "h", "y": -0.18},
        "hovermode": "closest",
    }
    if not cmap:
        layout["annotations"] = [{"text": "no device ceilings: achieved figures only", "showarrow": False,
                                  "xref": "paper", "yref": "paper", "x": 0.5, "y": 1.05}]
    return {"data": data, "layout": layout}

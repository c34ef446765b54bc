"""Render a `DiffResult`: diff.json (machines), diff.md (PR comments), diff.html (people), terminal text."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pandas as pd

from tracelens.analysis.diff import MIN_SAMPLES, DiffResult

from .common import html_table, plot_text, plotly_js_packed, safe_json, template_env, write_text_atomic

DIFF_SCHEMA = 1


def _num(v: Any) -> Any:
    if isinstance(v, float):
        return None if math.isnan(v) or math.isinf(v) else round(v, 6)
    if hasattr(v, "item"):
        return _num(v.item())
    return v


def _records(df: pd.DataFrame, limit: int | None = None) -> list[dict]:
    d = df if limit is None else df.head(limit)
    return [{k: _num(v) for k, v in r.items()} for r in d.to_dict("records")]


def to_json(r: DiffResult, rules: list[dict] | None = None) -> dict:
    return {
        "schema_version": DIFF_SCHEMA,
        "base": r.info["base"], "new": r.info["new"],
        "warnings": r.warnings,
        "metrics": _records(r.metrics),
        "categories": _records(r.categories),
        "host_syncs_by_op": _records(r.syncs),
        "cpu_ops": _records(r.cpu_ops, 500),
        "top_ops": _records(r.top_ops(), 500),
        "ops": _records(r.ops, 500),
        "kernels": _records(r.kernels, 500),
        "rules": rules or [],
        "failed": any(x["tripped"] for x in rules or []),
    }


def _fmt_change(row: pd.Series) -> str:
    d, rel = row["delta"], row["rel_pct"]
    if isinstance(d, float) and math.isnan(d):
        return "n/a"
    s = _num_text(d, row["unit"], sign=True)
    if not (isinstance(rel, float) and math.isnan(rel)):
        s += f" ({rel:+.1f}%)"
    p = row.get("p_value", math.nan)
    if isinstance(p, float) and math.isnan(p):
        s += "  noise unknown" if d != 0 else ""
    elif row["within_noise"] and d != 0:
        s += f" ~noise (p={p:.2f})"
    elif d != 0:
        s += f" (p{_p_text(p)})"
    return s


def fmt_p(p: float | None) -> str:
    """A p-value as shown: three decimals, '< 0.001' below that (never 0: a test never proves a change
    certain), '–' when there is none (too few samples)."""
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "–"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _p_text(p: float) -> str:
    """'=0.023' or ' < 0.001', to follow a 'p'."""
    t = fmt_p(p)
    return f" {t}" if t.startswith("<") else f"={t}"


def _fmt(v: Any, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return _num_text(v, unit)


def _num_text(v: float, unit: str, sign: bool = False) -> str:
    """A metric's number as the terminal, diff.md and the verdicts show it: ms with 3 decimals; other units with
    2, and 3 significant digits below 1, so a small value keeps its size (an MFU of 0.0312, a mean step of
    0.0526 s, a 0.00232 GiB change), not '0.03' or '+0.00'."""
    plus = "+" if sign else ""
    if unit == "ms":
        return f"{v:{plus}.3f}"
    return f"{v:{plus}#.3g}" if 0 < abs(v) < 1 else f"{v:{plus}.2f}"


def _metric_label(metric: str, unit: str) -> str:
    """'step_time (ms)'; a unitless metric (a loss) without empty parentheses."""
    return f"{metric} ({unit})" if unit else metric


def describe_rule(x: dict) -> str:
    """What a --fail-on verdict evaluated, in words with its numbers: the form (absolute: the new run's value;
    change: new - base), the values compared, the threshold and, for a change, its noise."""
    unit, metric = x.get("metric_unit", x["unit"]), x["metric"]
    per = (f" {unit}" if unit else "") + ("" if metric.startswith("run.") else " per step")
    thr = f"{x['threshold']:g}"
    if x.get("form") == "absolute":
        if x["new"] is None:
            return f"absolute, the new run: {metric} unavailable on the new run"
        verdict = f" {x['op']} {thr}" if x["tripped"] else f", not {x['op']} {thr}"
        return f"absolute, the new run: {metric} {_num_text(x['new'], unit)}{per}{verdict}"
    if x["base"] is None or x["new"] is None or x["compared"] is None:
        return f"change new - base: {metric} unavailable on a side"
    delta = x["new"] - x["base"]
    text = f"change new - base: {metric} {_num_text(x['base'], unit)} -> {_num_text(x['new'], unit)}{per} = "
    if x["unit"] == "%":
        text += f"{x['compared']:+.1f} %"
        thr = f"{x['threshold']:+g} %"
    else:
        text += _num_text(delta, unit, sign=True)
        text += f" {unit}" if unit else ""
    if delta == 0:
        return text + ", no change"
    crossed = _crosses(x["compared"], x["op"], x["threshold"])
    text += f" {x['op']} {thr}" if crossed else f", not {x['op']} {thr}"
    if x["within_noise"]:
        text += f", within noise (p={x['p_value']:.2f})" + (": not counted" if crossed else "")
    elif x.get("noise") == "unknown":
        nb, nn = x.get("samples", [1, 1])
        text += ("; noise unknown: one sample per side" if max(nb, nn) <= 1 else
                 f"; noise unknown: {nb} samples a side, a p-value needs {MIN_SAMPLES}" if nb == nn else
                 f"; noise unknown: {nb} and {nn} samples, a p-value needs {MIN_SAMPLES} a side")
    elif x.get("p_value") is not None:
        text += f", significant (p{_p_text(x['p_value'])})"
    return text


def _crosses(v: float, op: str, t: float) -> bool:
    return {">": v > t, ">=": v >= t, "<": v < t, "<=": v <= t}[op]


def rule_line(x: dict) -> str:
    """One verdict as the terminal prints it (also with -q)."""
    return f"rule {x['rule']!r}: {'FAIL' if x['tripped'] else 'ok'} ({describe_rule(x)})"


def to_text(r: DiffResult, rules: list[dict] | None = None, top: int = 10) -> str:
    lines = [f"tracelens diff: {r.base_label} -> {r.new_label} (per step; base {r.info['base']['steps']} "
             f"{r.info['base']['step_source']}, new {r.info['new']['steps']} {r.info['new']['step_source']})"]
    for w in r.warnings:
        lines.append(f"warning: {w}")
    lines.append(f"{'metric':<26} {'base':>12} {'new':>12}  change")
    for _, m in r.metrics.iterrows():
        unit = m["unit"]
        lines.append(f"{_metric_label(m['metric'], unit):<26} {_fmt(m['base'], unit):>12} "
                     f"{_fmt(m['new'], unit):>12}  {_fmt_change(m)}")
    moved = r.top_ops().head(top)
    if len(moved):
        lines.append("")
        lines.append("top-level ops that moved the step time most (ms per step of GPU time + idle before their kernels):")
        for _, o in moved.iterrows():
            lines.append(f"  {o['status']:<8} {o['delta_wall_ms']:+9.3f}  {o['top_op'][:100]}")
    if len(r.syncs):
        lines.append("")
        lines.append("host syncs per step by op: " + "; ".join(
            f"{s['op']} (via {s['via']}): {s['base_per_step']:g} -> {s['new_per_step']:g}" for _, s in r.syncs.iterrows()))
    ka = r.kernels[r.kernels["status"] == "added"].head(5)
    kr = r.kernels[r.kernels["status"] == "removed"].head(5)
    if len(ka) or len(kr):
        lines.append("")
        lines.append("kernels removed and added (ms per step):")
        for label, df in (("kernels removed", kr), ("kernels added", ka)):
            for _, k in df.iterrows():
                name = k.get("kernel_display") or k["kernel"]
                lines.append(f"  {label[8:]:<8} {k['delta_ms']:+9.3f} ms  [{k['category']}] {str(name)[:90]}")
    co = r.cpu_ops if r.cpu_ops is not None and len(r.cpu_ops) else None
    if co is not None:
        added, removed = co[co["status"] == "added"].head(top), co[co["status"] == "removed"].head(top)
        if len(added) or len(removed):
            lines.append("")
            lines.append("host ops removed and added (calls per step, self ms per step):")
            for label, df in (("removed", removed), ("added", added)):
                for _, o in df.iterrows():
                    calls = o["base_calls"] if label == "removed" else o["new_calls"]
                    ms = o["base_self_ms"] if label == "removed" else o["new_self_ms"]
                    lines.append(f"  {label:<8} {calls:9.2f} calls  {ms:8.3f} ms  {str(o['op'])[:90]}")
    if rules:
        lines.append("")
        lines += [rule_line(x) for x in rules]
    return "\n".join(lines)


# a '_' that can open or close an emphasis: at a word's edge (one inside a word, as in step_time, cannot)
_MD_EDGE_UNDERSCORE = re.compile(r"(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")


# Markdown's characters in a table cell, each as written: a backslash, '*' (emphasis), '|' (a cell's end), '<'
# and '>' (HTML), a backtick (a code span; shown as a quote)
_MD_TEXT = str.maketrans({"\\": "\\\\", "*": "\\*", "|": "\\|", "<": "&lt;", ">": "&gt;", "`": "'"})


def _md_escape(s: str) -> str:
    """Text for a table cell or a quote, shown as written: '|' would split the cell, '<' open HTML, and '*' or a
    '_' at a word's edge pair into emphasis (aten::_foreach_mul_ would show 'foreach_mul' in italics)."""
    return _MD_EDGE_UNDERSCORE.sub(lambda m: "\\_", str(s).translate(_MD_TEXT))


def _md_code(s: str) -> str:
    """A code span in a table cell: its text shown as is ('<' stays '<': GitHub does not decode entities in a code
    span, so '&lt;' would show), only the cell's '|' escaped and a backtick, which would end the span, replaced."""
    return "`" + str(s).replace("`", "'").replace("|", "\\|") + "`"


def to_markdown(r: DiffResult, rules: list[dict] | None = None, top: int = 10) -> str:
    out = []
    failed = [x for x in rules or [] if x["tripped"]]
    head = "❌ performance gate failed" if failed else ("✅ performance gate passed" if rules else "trace diff")
    step = r.metrics.set_index("metric").loc["step_time"]
    out.append(f"### tracelens: {head}")
    if not math.isnan(step["delta"]):
        out.append(f"Step time **{step['base']:.3f} → {step['new']:.3f} ms** ({_fmt_change(step)}), "
                   f"{_md_escape(r.base_label)} → {_md_escape(r.new_label)}.")
    for w in r.warnings:
        out.append(f"> ⚠️ {_md_escape(w)}")
    if rules:
        out.append("")
        out.append("| rule | result | evaluated |")
        out.append("|---|---|---|")
        for x in rules:
            out.append(f"| {_md_code(x['rule'])} | {'**FAIL**' if x['tripped'] else 'ok'} | "
                       f"{_md_escape(describe_rule(x))} |")
    out.append("")
    out.append("| metric (per step) | base | new | change |")
    out.append("|---|---:|---:|---|")
    for _, m in r.metrics.iterrows():
        out.append(f"| {_md_escape(_metric_label(m['metric'], m['unit']))} | {_fmt(m['base'], m['unit'])} | "
                   f"{_fmt(m['new'], m['unit'])} | "
                   f"{_fmt_change(m)} |")
    moved = r.top_ops().head(top)
    if len(moved):
        out.append("")
        out.append("<details><summary>Top-level ops that moved the step time most</summary>\n")
        out.append("| status | Δ ms/step | top-level op |")
        out.append("|---|---:|---|")
        for _, o in moved.iterrows():
            out.append(f"| {o['status']} | {o['delta_wall_ms']:+.3f} | {_md_escape(o['top_op'])} |")
        out.append("\n</details>")
    return "\n".join(out) + "\n"


def waterfall_figure(r: DiffResult) -> dict:
    """Step-time delta split into GPU time by category and idle time (and overlap correction)."""
    m = r.metrics.set_index("metric")
    base, new = m.loc["step_time", "base"], m.loc["step_time", "new"]
    if math.isnan(base) or math.isnan(new):  # no step time on one side: nothing to decompose
        return {"data": [], "layout": {"height": 120, "annotations": [{
            "text": "step time unavailable on one side: no waterfall", "showarrow": False,
            "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5}],
            "xaxis": {"visible": False}, "yaxis": {"visible": False}}}
    steps = [("base step", base, "absolute")]
    cat_total = 0.0
    for _, c in r.categories.iterrows():
        if abs(c["delta_ms"]) > 1e-9:
            steps.append((c["category"], c["delta_ms"], "relative"))
            cat_total += c["delta_ms"]
    idle = m.loc["gpu.idle", "delta"] if not math.isnan(m.loc["gpu.idle", "delta"]) else 0.0
    steps.append(("GPU idle", idle, "relative"))
    rest = (new - base) - cat_total - idle
    if abs(rest) > 1e-6:
        steps.append(("overlap / other", rest, "relative"))
    steps.append(("new step", new, "total"))
    data = [{
        "type": "waterfall", "orientation": "v", "x": [plot_text(s[0]) for s in steps],
        "y": [round(float(s[1]), 6) for s in steps], "measure": [s[2] for s in steps],
        "increasing": {"marker": {"color": "#e4572e"}}, "decreasing": {"marker": {"color": "#29a37a"}},
        "totals": {"marker": {"color": "#3b7dd8"}}, "hovertemplate": "%{x}: %{y:.3f} ms<extra></extra>",
    }]
    return {"data": data, "layout": {"height": 420, "margin": {"l": 60, "r": 20, "t": 10, "b": 80},
                                     "yaxis": {"title": {"text": "ms per step"}}}}


def bars_figure(r: DiffResult) -> dict:
    m = r.metrics[r.metrics["unit"] == "ms"]
    data = []
    for side, color in (("base", "#9aa6b8"), ("new", "#3b7dd8")):
        data.append({"type": "bar", "name": plot_text(getattr(r, f"{side}_label")), "x": [plot_text(x) for x in m["metric"]],
                     "y": [None if math.isnan(v) else round(float(v), 6) for v in m[side]], "marker": {"color": color},
                     "hovertemplate": "%{x}: %{y:.3f} ms<extra></extra>"})
    return {"data": data, "layout": {"barmode": "group", "height": 420, "margin": {"l": 60, "r": 20, "t": 10, "b": 120},
                                     "yaxis": {"title": {"text": "ms per step"}}}}


def _whole_counts(metrics: pd.DataFrame) -> pd.DataFrame:
    """The metrics table as shown: a count metric's whole values (host syncs, kernels per step) as integers,
    "3" and "1,177", not "3.000" and "1,177.0" (the number cells' float digits); a fractional median stays."""
    out = metrics.copy()
    counts = out["unit"] == "count"
    for col in ("base", "new", "delta", "spread"):
        out[col] = out[col].astype(object)
        out.loc[counts, col] = out.loc[counts, col].map(
            lambda v: int(v) if isinstance(v, float) and math.isfinite(v) and v == int(v) else v)
    return out


def render_html(r: DiffResult, rules: list[dict] | None = None) -> str:
    metrics = _whole_counts(r.metrics.assign(change=[_fmt_change(row) for _, row in r.metrics.iterrows()],
                                             p_shown=[fmt_p(v) for v in r.metrics["p_value"]]))
    figures = {"plot-bars": bars_figure(r), "plot-waterfall": waterfall_figure(r)}
    tables = {
        "metrics": html_table(metrics, [("metric", "metric", "text"), ("unit", "unit", "text"), ("base", "base", "num"),
                                        ("new", "new", "num"), ("delta", "Δ", "num"), ("rel_pct", "Δ %", "pct"),
                                        ("spread", "noise spread", "num"), ("p_shown", "p (Welch)", "text"),
                                        ("steps_base", "base steps", "num"), ("steps_new", "new steps", "num"),
                                        ("change", "verdict", "text")]),
        "top_ops": html_table(r.top_ops(), [("status", "status", "text"), ("delta_wall_ms", "Δ wall ms/step", "num"),
                                            ("top_op", "top-level op", "name"), ("base_wall_ms", "base wall ms", "num"),
                                            ("new_wall_ms", "new wall ms", "num")]),
        "ops": html_table(r.ops[r.ops["status"] != "same"], [
            ("status", "status", "text"), ("delta_wall_ms", "Δ wall ms/step", "num"), ("top_op", "top-level op", "name"),
            ("op", "op", "name"), ("input_dims", "input dims", "name"), ("base_wall_ms", "base wall ms", "num"),
            ("new_wall_ms", "new wall ms", "num"), ("base_gpu_ms", "base GPU ms", "num"), ("new_gpu_ms", "new GPU ms", "num"),
            ("path", "path", "name")]),
        "kernels": html_table(r.kernels, [("status", "status", "text"), ("delta_ms", "Δ ms/step", "num"),
                                          ("kernel_display", "kernel", "name"), ("category", "category", "text"),
                                          ("base_count", "base count", "num"), ("new_count", "new count", "num"),
                                          ("base_ms", "base ms", "num"), ("new_ms", "new ms", "num")]),
        "cpu_ops": html_table(r.cpu_ops[r.cpu_ops["status"] != "same"] if len(r.cpu_ops) else r.cpu_ops, [
            ("status", "status", "text"), ("op", "op", "name"), ("base_calls", "base calls/step", "num"),
            ("new_calls", "new calls/step", "num"), ("base_self_ms", "base self ms/step", "num"),
            ("new_self_ms", "new self ms/step", "num"), ("delta_self_ms", "Δ self ms/step", "num")]),
        "syncs": html_table(r.syncs, [("op", "op", "name"), ("via", "via", "name"), ("call", "sync call", "text"),
                                      ("base_per_step", "base / step", "num"), ("new_per_step", "new / step", "num"),
                                      ("delta", "Δ", "num")]),
    }
    return template_env().get_template("diff.html").render(
        title=f"tracelens diff: {r.base_label} → {r.new_label}", info=r.info, warnings=r.warnings,
        rules=[{**x, "evaluated": describe_rule(x)} for x in rules or []],
        plotly_packed=plotly_js_packed(), figures_json=safe_json(figures), tables=tables, min_samples=MIN_SAMPLES,
    )


def write_all(r: DiffResult, out: str | os.PathLike, rules: list[dict] | None = None) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in (("diff.json", json.dumps(to_json(r, rules), indent=2)), ("diff.md", to_markdown(r, rules)),
                       ("diff.html", render_html(r, rules))):
        paths[name] = write_text_atomic(out / name, text)
    return paths

"""Render an `Analysis` into one self-contained HTML file (plotly.js embedded; works offline).

Escaping: every string from a trace reaches the page either through Jinja2's autoescaping (tables,
text) or through the figures' JSON, which is written with <, > and & as \\u escapes inside a
`type="application/json"` script and whose labels are HTML-escaped for plotly (which interprets a
few tags in text). A kernel named `</script><script>...` shows as text.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tracelens.analysis.comm import ranks_text
from tracelens.analyzer import Analysis

from .common import (COLORS, html_table, packing_beside, plot_text, plotly_js_packed, safe_json, template_env, version,
                     write_text_atomic)
from .critpath import section_context as critpath_context
from .decomposition import section_context as decomposition_context
from .pipeline import section_context as pipeline_context
from .verdict import section_context as verdict_context

# ----------------------------------------------------------------------------------- figures


def timeline_figure(tl: pd.DataFrame) -> dict:
    ranks = [f"rank {r}" for r in tl["rank"]]
    parts = [
        ("compute", tl["compute_us"]),
        ("exposed comm", tl["exposed_comm_us"]),
        # a communication kernel's wait for another rank, and a pipeline stage's for its neighbour (the bubble), are
        # not communication (tracelens.analysis.waits)
        ("comm wait", tl.get("comm_wait_us")),
        ("pipeline wait", tl.get("pipeline_wait_us")),
        ("memcpy", tl["excl_memcpy_us"]),
        ("memset", tl["excl_memset_us"]),
        ("idle", tl["gpu_idle_us"]),
    ]
    # the wait parts only where some rank has them (one rank, or no communication: none)
    parts = [(n, v) for n, v in parts if v is not None and (n not in ("comm wait", "pipeline wait") or (v > 0).any())]
    data = [
        {"type": "bar", "orientation": "h", "name": name, "y": ranks, "x": [round(float(v) / 1000.0, 4) for v in vals],
         "marker": {"color": COLORS[name]}, "hovertemplate": "%{y}: %{x:.3f} ms " + name + "<extra></extra>"}
        for name, vals in parts
    ]
    layout = {"barmode": "stack", "height": 120 + 34 * len(ranks), "margin": {"l": 70, "r": 20, "t": 10, "b": 40},
              "xaxis": {"title": {"text": "ms"}}, "yaxis": {"autorange": "reversed"}, "legend": {"orientation": "h"}}
    return {"data": data, "layout": layout}


def category_figure(cats: pd.DataFrame) -> dict:
    data = []
    for cat in cats["category"].unique():
        sub = cats[cats["category"] == cat]
        data.append({"type": "bar", "orientation": "h", "name": plot_text(cat), "y": [f"rank {r}" for r in sub["rank"]],
                     "x": [round(float(v) / 1000.0, 4) for v in sub["total_us"]], "marker": {"color": COLORS.get(cat, "#888")},
                     "hovertemplate": "%{y}: %{x:.3f} ms " + plot_text(cat) + "<extra></extra>"})
    n = cats["rank"].nunique()
    layout = {"barmode": "stack", "height": 120 + 34 * n, "margin": {"l": 70, "r": 20, "t": 10, "b": 40},
              "xaxis": {"title": {"text": "ms (sum of durations)"}}, "yaxis": {"autorange": "reversed"},
              "legend": {"orientation": "h"}}
    return {"data": data, "layout": layout}


def breakdown_figure(bd: pd.DataFrame) -> dict:
    from tracelens.names import display_many

    names = display_many([str(lbl) for lbl in bd["label"]])  # kernel names demangled + shortened; hover: full
    data = [{
        "type": "sunburst", "ids": [plot_text(i) for i in bd["id"]], "parents": [plot_text(p) for p in bd["parent"]],
        "labels": [plot_text(short) for short, _ in names], "values": [round(float(v), 3) for v in bd["value"]],
        "customdata": [plot_text(full if len(full) <= 240 else full[:240] + "…") for _, full in names],
        "branchvalues": "total", "maxdepth": 4, "insidetextorientation": "radial",
        "hovertemplate": "%{customdata}<br>%{value:,.1f} us (%{percentRoot:.1%} of all)<extra></extra>",
    }]
    return {"data": data, "layout": {"margin": {"l": 0, "r": 0, "t": 0, "b": 0}, "height": 640}}


# ----------------------------------------------------------------------------------- page


def _run_name(trace) -> str:
    """The name a user knows the input by: the run dir for ``RUN/traces/rank<N>.json.gz``, else the
    common directory of the rank files, else the single file's name."""
    paths = [r.path for r in trace.ranks]
    if len(paths) == 1:
        p = os.path.dirname(paths[0])
        if os.path.basename(p) != "traces":
            return os.path.basename(paths[0])
    common = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
    run = getattr(trace, "run", None)
    if os.path.basename(common) == "traces" and run is not None and run.root is not None:
        common = os.path.dirname(common)
    return os.path.basename(common) or "trace"


_TL_COLS = [("rank", "rank", "num"), ("span_us", "span µs", "num"), ("gpu_busy_us", "busy µs", "num"),
            ("gpu_idle_us", "idle µs", "num"), ("compute_us", "compute µs", "num"), ("comm_us", "comm µs", "num"),
            ("exposed_comm_us", "exposed comm µs", "num"), ("comm_wait_us", "comm wait µs", "num"),
            ("pipeline_wait_us", "pipeline wait µs", "num"), ("memcpy_us", "memcpy µs", "num"),
            ("memset_us", "memset µs", "num"), ("kernel_count", "kernels", "num")]


def page_parts(analysis: Analysis, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """The parts of the page that read only the analysis' base tables and its entries declared `offload` (the
    roofline, the step decomposition): the timeline, category and breakdown figures, the tables of ops, kernels,
    top-level ops and annotations, the roofline, decomposition and pipeline sections, and plotly.js packed.
    `render` builds them when not given them; `reports.artifacts.write_all` has them built beside the summary's
    other entries (`Analysis.summary_with`, in a forked child on a second CPU). Plain data (strings, dicts,
    lists): the same wherever it is built. ``leave_out``: keys of `BASE_TABLE_HTML` built elsewhere
    (`base_table_html`)."""
    a = analysis
    has_gpu = a.has_gpu
    head: dict[str, Any] = {}  # the figures before the MoE view's, in page order
    out: dict[str, Any] = {"timeline_table": "", "step_table": ""}
    if has_gpu:
        head["plot-timeline"] = timeline_figure(a.timeline)
        head["plot-categories"] = category_figure(a.categories)
        out["timeline_table"] = html_table(a.timeline, _TL_COLS)
        if not a.step_timeline.empty:
            out["step_table"] = html_table(a.step_timeline, [_TL_COLS[0], ("step", "step", "num")] + _TL_COLS[1:]
                                           + [("startup_wait_us", "start-up wait µs", "num"),
                                              ("steady", "steady state", "text")])
    if not a.breakdown.empty:
        head["plot-breakdown"] = breakdown_figure(a.breakdown)
    out["roofline"] = _roofline_section(a) if has_gpu else {}
    decomp = decomposition_context(a)  # never raises: a failure is one line
    if decomp.get("decomp_figure"):
        head["plot-decomposition"] = decomp["decomp_figure"]
    out["decomposition"] = {k: v for k, v in decomp.items() if k != "decomp_figure"}
    if out["roofline"].get("roofline_figure"):
        head["plot-roofline"] = out["roofline"].pop("roofline_figure")
    out["figures"] = head
    out["pipeline"] = None
    if getattr(a, "pipeline", None) is not None:  # run dir with pipeline data: reports/pipeline.py
        out["pipeline"] = pipeline_context(a.pipeline)
    out["host_tables"] = {} if has_gpu else _host_sections(a)
    for key in BASE_TABLE_HTML:
        if key not in leave_out:
            out[key] = base_table_html(a, key)
    # plotly.js packed, unless a thread of the process rendering the page packs it (`tracelens analyze`)
    out["plotly_packed"] = None if packing_beside() else plotly_js_packed()
    return out


# the page's tables of the base tables only (no entry of the summary): `reports.artifacts.write_all` has each built
# by whichever process of `Analysis.summary_with` is free first
BASE_TABLE_HTML = ("ops_table", "kernels_table", "top_ops_table", "annotations_table")


def base_table_html(a: Analysis, key: str) -> str:
    """The part `key` of `BASE_TABLE_HTML`: the ops, kernels, top-level ops or annotations table."""
    has_gpu = a.has_gpu
    if key == "ops_table":
        ops_cols = [("op", "op", "name"), ("input_dims", "input dims", "name"), ("count", "count", "num"),
                    ("gpu_total_us", "GPU µs", "num"), ("gpu_mean_us", "GPU mean µs", "num"),
                    ("pct_gpu_busy", "% GPU busy", "pct"), ("kernels", "kernels", "num"),
                    ("cpu_total_us", "CPU µs", "num"), ("cpu_self_us", "CPU self µs", "num")]
        if not has_gpu:  # GPU columns are all zero on a CPU-only trace: leave them out
            ops_cols = [c for c in ops_cols if not c[0].startswith(("gpu_", "pct_gpu")) and c[0] != "kernels"]
        return html_table(a.ops if has_gpu else a.ops.sort_values("cpu_self_us", ascending=False, kind="stable"), ops_cols)
    if key == "kernels_table":
        kern_cols = [("kernel", "kernel", "kernel"), ("op", "launched by", "name"), ("category", "category", "text"),
                     ("count", "count", "num"), ("total_us", "total µs", "num"), ("mean_us", "mean µs", "num"),
                     ("min_us", "min µs", "num"), ("max_us", "max µs", "num"), ("pct_gpu_busy", "% GPU busy", "pct")]
        return html_table(a.kernels, kern_cols) if has_gpu else ""
    if key == "top_ops_table":
        top_cols = [("op", "op", "name"), ("count", "count", "num"), ("gpu_total_us", "GPU µs", "num"),
                    ("kernels", "kernels", "num"), ("cpu_total_us", "CPU µs", "num")]
        if not has_gpu:
            top_cols = [c for c in top_cols if c[0] not in ("gpu_total_us", "kernels")]
        return html_table(a.top_ops, top_cols)
    if key == "annotations_table":
        ann_cols = [("path", "path", "name"), ("count", "count", "num"), ("host_total_us", "host µs", "num"),
                    ("host_mean_us", "host mean µs", "num"), ("gpu_total_us", "GPU µs", "num"), ("kernels", "kernels", "num")]
        if not has_gpu:
            ann_cols = [c for c in ann_cols if c[0] not in ("gpu_total_us", "kernels")]
        return html_table(a.annotations, ann_cols) if not a.annotations.empty else ""
    raise KeyError(key)


def chain_parts(a: Analysis) -> dict[str, Any]:
    """The page's sections that read the summary's chain (findings, communication, host, MoE, critical path,
    health) and none of the offloaded entries (roofline, decomposition): `Analysis.summary_with` builds them in
    the parent before it waits for the child that builds `page_parts`."""
    return {"deep": _deep_sections(a), "moe": _moe_section(a), "critpath": critpath_context(a),
            "health": _health_context(a)}


LIST_STEPS_UP_TO = 100  # the overview lists this many profiler steps one by one; more as runs ("1-799041")


def _step_list(steps) -> str:
    """The overview's profiler steps: each one up to LIST_STEPS_UP_TO of them, else as runs of consecutive steps (a
    trace of 800,000 short steps listed them all: 5 MB of the page)."""
    from tracelens.analysis.steps import _ranges

    steps = np.sort(np.asarray(steps).astype(np.int64))
    if not len(steps):
        return "not marked"
    if len(steps) > LIST_STEPS_UP_TO:
        return _ranges(steps)
    return ", ".join(map(str, steps.tolist()))


def render(analysis: Analysis, title: str | None = None, parts: dict[str, Any] | None = None,
           chain: dict[str, Any] | None = None) -> str:
    """report.html's text. parts: `page_parts(analysis)` built elsewhere (built here when None); chain:
    `chain_parts(analysis)` built earlier (built here when None)."""
    a = analysis
    p = page_parts(a) if parts is None else parts
    c = chain_parts(a) if chain is None else chain
    trace = a.trace
    has_gpu = a.has_gpu
    devices = sorted({r.device_name for r in trace.ranks if r.device_name})
    title = title or f"tracelens report: {_run_name(trace)}"
    overview = [
        ("ranks", ", ".join(str(r) for r in trace.rank_ids)),
        ("devices", ", ".join(devices) or "–"),
        ("files", "; ".join(r.path for r in trace.ranks[:8]) + (" …" if len(trace.ranks) > 8 else "")),
        ("events", f"{len(trace.events):,} timed, {len(a.gpu):,} on GPU"),
        ("profiler steps", _step_list(a.steps["step"].unique())),
        ("figures over", a.window.describe() if getattr(a, "window", None) is not None else "whole profiled window"),
    ]
    figures: dict[str, Any] = dict(p["figures"])
    extra = {**c["deep"], **p["roofline"]}
    moe = c["moe"]
    if moe is not None:
        figures.update(moe.pop("figures"))
    pipeline = None
    if p["pipeline"] is not None:
        pipeline = dict(p["pipeline"])
        figures.update(pipeline.pop("figures"))
    critpath = c["critpath"]  # never raises: bad input is its one-line problem
    if critpath and critpath.get("figure"):
        figures["plot-critpath"] = critpath.pop("figure")
    return template_env().get_template("report.html").render(
        **extra,
        **p["decomposition"],
        title=title,
        subtitle=f"{len(trace.ranks)} rank(s) · {', '.join(devices) or 'no GPU'}",
        version=version(),
        plotly_packed=p["plotly_packed"] if p["plotly_packed"] is not None else plotly_js_packed(),
        warnings=a.warnings,
        verdict=verdict_context(a),  # never raises: no verdict is its one line
        health=c["health"],
        overview=overview,
        has_gpu=has_gpu,
        timeline_table=p["timeline_table"],
        step_table=p["step_table"],
        breakdown_note=("GPU time by record_function / module path, top-level op, op and kernel." if has_gpu
                        else "CPU self time of ops by record_function / module path and top-level op (no GPU events)."),
        ops_note="" if has_gpu else "No GPU events: sorted by CPU self time.",
        kernels_note="",
        ops_table=p["ops_table"],
        annotations_table=p["annotations_table"],
        **p["host_tables"],
        kernels_table=p["kernels_table"],
        top_ops_table=p["top_ops_table"],
        pipeline=pipeline,
        critpath=critpath,
        moe=moe,
        figures_json=safe_json(figures),
    )


def _deep_sections(a: Analysis) -> dict:
    """Findings, communication and host sections (empty when the trace has nothing for them)."""
    from tracelens.analysis import comm as CM, host as H
    from tracelens.analysis.verdict import finding_sentence

    out: dict = {"roofline_table": "", "roofline_unmodeled": "", "roofline_note": "", "findings": [], "comm_table": "", "straggler_table": "", "comm_note": "", "host_table": "",
                 "idle_table": "", "launch_table": ""}
    out["findings"] = [dict(f, sentence=finding_sentence(f)) for f in a.findings()]  # evidence in words
    if not a.has_gpu:
        return out
    comm = CM.comm_report(a, exposed=False)  # what `tracelens comm` shows (less its exposed figures: not on the page)
    if not comm.empty:
        out["comm_table"] = html_table(comm.summary, [("rank", "rank", "num"), ("collective", "collective", "text"),
                                              ("count", "count", "num"), ("kernel_us", "kernel µs", "num"),
                                              ("comm_us", "comm µs", "num"),
                                              ("sync_us", "sync wait µs", "num"), ("sync_pct", "sync %", "pct"),
                                              ("mean_busbw_gbps", "busbw GB/s", "num"),
                                              *([("useful_busbw_gbps", "useful GB/s", "num")] if comm.padding_note() else []),
                                              ("times_last", "times last", "num"),
                                              ("startup_excluded", "start-up excluded", "num")])
        strag = comm.stragglers
        out["straggler_table"] = html_table(strag, [
            ("family", "collective", "text"), ("instances", "instances", "num"), ("mean_skew_us", "mean skew µs", "num"),
            ("max_skew_us", "max skew µs", "num"), ("straggler_rank", "last rank", "num"), ("straggler_share", "share", "num")]) \
            if not strag.empty else ""
        n = comm.startup_instances  # and comm.partial: a group with ranks not loaded: per-rank figures only
        out["comm_note"] = " ".join(x for x in (
            comm.partial, f"{n} instance(s) began before every rank was profiling (start-up wait) and are left out." if n else "",
            comm.padding_note()) if x)
    host = H.host_report(a)  # what `tracelens host` shows
    if not host.syncs.empty:
        out["host_table"] = html_table(host.sync_summary, [
            ("op", "op", "name"), ("via", "via", "name"), ("call", "sync call", "text"), ("count", "count", "num"),
            ("host_blocked_us", "host blocked µs", "num"), ("gpu_idle_caused_us", "GPU idle caused µs", "num"),
            ("path", "path", "name")])
    if not host.idle.empty:
        out["idle_table"] = html_table(host.idle, [
            ("rank", "rank", "num"), ("cause", "idle cause", "text"), ("gaps", "gaps", "num"), ("idle_us", "idle µs", "num"),
            ("pct_of_span", "% of span", "pct")])
    out["launch_table"] = html_table(host.launch, [
        ("rank", "rank", "num"), ("kernels", "kernels", "num"), ("launch_p50_us", "launch latency p50 µs", "num"),
        ("launch_p90_us", "p90 µs", "num"), ("small_kernels", "small kernels", "num"), ("small_share", "small share", "num"),
        ("small_time_share", "small time share", "num")])
    return out


def _roofline_section(a: Analysis) -> dict:
    """The roofline section: its figure (when an op group is modeled), tables and note."""
    from . import roofline as RR

    out: dict = {}
    r = a.roofline()
    if not r.table.empty:
        out["roofline_figure"] = RR.roofline_figure(r.table, r.ceilings)
        out["roofline_table"] = html_table(r.table, RR.roofline_table_columns(r.table))
        s = r.summary()
        share = s.get("modeled_share")  # None when there is no non-communication GPU time (all durations 0)
        out["roofline_note"] = ((f"{100 * share:.0f}% of non-communication GPU time is in modeled ops. "
                                 if share is not None else "No non-communication GPU time to model. ")
                                + " ".join(r.notes() + r.warnings))
    if not r.unmodeled.empty:
        out["roofline_unmodeled"] = html_table(r.unmodeled, RR.unmodeled_table_columns())
    return out


def _moe_section(a: Analysis) -> dict | None:
    """The MoE section's context (reports/moe.py); a bad routing file is its one line, not a failed page."""
    from tracelens.errors import TraceError

    from .moe import moe_context

    try:
        return moe_context(a.moe())
    except TraceError as e:
        return moe_context(None, e.one_line())


def _health_context(a: Analysis) -> list[dict]:
    """Rows of the "Trace health" section (tracelens.analysis.health): errors, then warnings, then notes."""
    sev_class = {"error": "high", "warning": "medium", "info": "info"}
    return [{"severity": r["severity"], "cls": sev_class.get(r["severity"], "info"), "check": r["check"],
             "ranks": ranks_text(r["ranks"]), "found": r["found"], "invalidates": r["invalidates"]}
            for r in a.health().to_dict("records")]


def _host_sections(a: Analysis) -> dict:
    """CPU-only traces: host time per (rank, step), the MoE stages and the top ops by self time per step."""
    from tracelens.analysis import steps as S

    hs = S.host_step_table(a)
    ms = S.moe_stage_table(a)
    top = S.host_top_ops(a, top=15)
    return {
        "host_steps_table": html_table(hs, [("rank", "rank", "num"), ("step", "step", "num"),
                                            ("step_time_us", "step µs", "num"), ("op_self_us", "in ops (self) µs", "num"),
                                            ("moe_us", "MoE stages µs", "num"), ("steady", "steady state", "text")])
        if not hs.empty else "",
        "moe_stage_table": html_table(ms.assign(share_pct=100 * ms["share_of_step"]), [
            ("rank", "rank", "num"), ("stage", "stage", "name"), ("calls_per_step", "calls / step", "num"),
            ("host_us_per_step", "host µs / step", "num"), ("share_pct", "% of step", "pct")]) if not ms.empty else "",
        "host_top_table": html_table(top.assign(share_pct=100 * top["share_of_step"]), [
            ("rank", "rank", "num"), ("op", "op", "name"), ("calls_per_step", "calls / step", "num"),
            ("self_us_per_step", "self µs / step", "num"), ("share_pct", "% of step", "pct")]) if not top.empty else "",
    }


def write_report(analysis: Analysis, path: str | os.PathLike, title: str | None = None) -> Path:
    return write_text_atomic(path, render(analysis, title))

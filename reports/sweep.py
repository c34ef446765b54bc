"""Sweep report: objective per trial, the guided search's path with the finding behind each step,
per-knob effects, the best config as ready YAML, and a diff of best vs baseline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from .html import _env, _plot_text, html_table, plotly_js, safe_json


def trials_frame(trials: list[dict], objective: str) -> pd.DataFrame:
    rows = []
    for t in trials:
        rows.append({"trial": t["id"], "status": t["status"], objective: t["objective"],
                     "knobs": ", ".join(f"{k}={v}" for k, v in t["knobs"].items()), "motivation": t.get("motivation") or "",
                     "reason": t.get("reason") or "", "run_dir": t.get("run_dir") or "", **{f"knob.{k}": v for k, v in t["knobs"].items()}})
    return pd.DataFrame(rows)


def best_yaml(config: str, fixed: dict, best: dict | None) -> str:
    import yaml

    if best is None:
        return "# no successful trial\n"
    body = {"base_config": config, **fixed, **best["knobs"]}
    return (f"# best of the sweep (trial {best['id']}): {best['objective']:.6g}\n"
            f"# python -m trainer.launch --config {config} " + " ".join(f"--set {k}={v}" for k, v in {**fixed, **best['knobs']}.items())
            + "\n" + yaml.safe_dump(body, sort_keys=False))


def render(result, space) -> str:
    obj = space.objective
    df = trials_frame(result.trials, obj)
    figures = {}
    if len(df):
        ok = df[df["status"] == "ok"]
        colors = ["#3b7dd8" if s == "ok" else "#c0392b" for s in df["status"]]
        figures["plot-trials"] = {"data": [{
            "type": "bar", "x": [f"#{t}" for t in df["trial"]], "y": [v if v == v else 0 for v in df[obj].fillna(0)],
            "marker": {"color": colors}, "text": [_plot_text(k) for k in df["knobs"]],
            "hovertemplate": "%{x}: %{y:.4g}<br>%{text}<extra></extra>"}],
            "layout": {"height": 360, "margin": {"l": 60, "r": 20, "t": 10, "b": 40},
                       "yaxis": {"title": {"text": _plot_text(obj)}}}}
        effects = []
        for k in space.knobs:
            if len(ok) and f"knob.{k}" in ok:
                g = ok.groupby(ok[f"knob.{k}"].astype(str))[obj].mean()
                effects.append({"type": "bar", "name": _plot_text(k), "x": [_plot_text(f"{k}={v}") for v in g.index],
                                "y": [float(v) for v in g.values]})
        figures["plot-knobs"] = {"data": effects, "layout": {"height": 360, "margin": {"l": 60, "r": 20, "t": 10, "b": 80},
                                                             "yaxis": {"title": {"text": f"mean {_plot_text(obj)}"}}}}
    path = pd.DataFrame(result.path) if result.path else pd.DataFrame(columns=["trial", "decision", "motivation", "objective", "knobs"])
    if len(path):
        path = path.assign(knobs=[", ".join(f"{k}={v}" for k, v in kn.items()) for kn in path["knobs"]])
    tables = {
        "trials": html_table(df, [("trial", "trial", "num"), ("status", "status", "text"), (obj, obj, "num"),
                                  ("knobs", "knobs", "name"), ("motivation", "why", "text"), ("reason", "failure", "name"),
                                  ("run_dir", "run dir", "name")], max_rows=1000),
        "path": html_table(path, [("trial", "trial", "num"), ("decision", "decision", "text"), ("objective", obj, "num"),
                                  ("motivation", "finding that motivated it", "text"), ("knobs", "knobs", "name")], max_rows=1000),
    }
    best = result.best
    base = result.baseline
    speedup = (best["objective"] / base["objective"] if space.maximize else base["objective"] / best["objective"]) \
        if best and base and base.get("objective") else None
    return _env().get_template("sweep.html").render(
        title=f"tracelens autotune: {space.config}", warnings=[], plotly_js=plotly_js(), figures_json=safe_json(figures),
        tables=tables, best=best, baseline=base, speedup=speedup, objective=obj, stopped=result.stopped,
        best_yaml=best_yaml(space.config, space.fixed, best), n=len(df),
        failed=int((df["status"] != "ok").sum()) if len(df) else 0,
        diff_link="diff_best_vs_baseline/diff.html" if (result.out / "diff_best_vs_baseline" / "diff.html").exists() else None,
    )


def write(result, space) -> dict[str, Path]:
    out = Path(result.out)
    paths = {}
    (out / "best.yaml").write_text(best_yaml(space.config, space.fixed, result.best))
    paths["best.yaml"] = out / "best.yaml"
    if result.best and result.baseline and result.best["id"] != result.baseline["id"] and result.baseline["status"] == "ok":
        try:
            import tracelens
            from tracelens.analysis.diff import diff

            from . import diff as rdiff

            a = tracelens.analyze(tracelens.load(result.baseline["run_dir"], progress=False))
            b = tracelens.analyze(tracelens.load(result.best["run_dir"], progress=False))
            m = lambda d: json.loads((Path(d) / "manifest.json").read_text())  # noqa: E731
            r = diff(a, b, m(result.baseline["run_dir"]), m(result.best["run_dir"]), base_label="baseline", new_label="best")
            rdiff.write_all(r, out / "diff_best_vs_baseline")
            paths["diff"] = out / "diff_best_vs_baseline" / "diff.html"
        except Exception as e:  # the sweep's results stand even if the diff cannot be made
            (out / "diff_best_vs_baseline.error.txt").write_text(f"{type(e).__name__}: {e}\n")
    html = out / "sweep.html"
    tmp = html.with_suffix(".html.tmp")
    tmp.write_text(render(result, space), encoding="utf-8")
    os.replace(tmp, html)
    paths["sweep.html"] = html
    return paths

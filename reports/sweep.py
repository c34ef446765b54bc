"""Sweep report (OUT/sweep.html): the objective of every trial, the path the guided search took with
the finding that motivated each step, per-knob effects, the best config as a ready YAML file
(OUT/best.yaml, also shown) and a diff of the best trial against the baseline
(OUT/diff_best_vs_baseline/diff.html, made with tracelens.analysis.diff and reports/diff.py, linked);
the what-if model's predicted vs measured objective of every model-driven trial and the step
decomposition of the baseline and each kept move (reports/sweep_model.py).

Input: an ``autotune.sweep.SweepResult`` and its ``Space``; reads the trials' run dirs (manifests and
traces) for the YAML and the diff, nothing else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd

from .common import html_table, plot_text, plotly_js_packed, safe_json, template_env, write_text_atomic

OK, FAILED, KEPT = "#3b7dd8", "#c0392b", "#2e9d5b"


def _knobs_text(knobs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in knobs.items())


def _rel(path: str | None, root: Path) -> str:
    if not path:
        return ""
    try:
        return os.path.relpath(path, root)
    except ValueError:
        return str(path)


def trials_frame(trials: list[dict], objective: str, root: Path | None = None) -> pd.DataFrame:
    """One row per trial: id, status, objective, knobs (text and one ``knob.<name>`` column each)..."""
    rows = []
    for t in trials:
        rows.append({"trial": t["id"], "status": t["status"], objective: t["objective"],
                     "knobs": _knobs_text(t["knobs"]), "decision": t.get("decision") or "",
                     "motivation": t.get("motivation") or "", "failure": t.get("failure") or "",
                     "reason": t.get("reason") or "",
                     "run_dir": _rel(t.get("run_dir"), root) if root else (t.get("run_dir") or ""),
                     "wall_s": (t.get("metrics") or {}).get("wall_s"),
                     "se_pct": _se_pct(t), "timed_steps": _timed_steps(t),
                     **{f"knob.{k}": v for k, v in t["knobs"].items()}})
    cols = ["trial", "status", objective, "knobs", "decision", "motivation", "failure", "reason", "run_dir", "wall_s",
            "se_pct", "timed_steps"]
    return pd.DataFrame(rows, columns=cols + sorted({c for r in rows for c in r if c.startswith("knob.")}))


def _se_pct(t: dict) -> float | None:
    """The trial's repeat noise: the relative standard error of its objective (``metrics.noise``, std of
    the timed step times / sqrt(n) / their mean; autotune.runner.step_noise) in percent. None where it is
    unknown: a failed trial, or fewer than 3 timed steps (stored as 0)."""
    noise = (t.get("metrics") or {}).get("noise")
    if t.get("status") != "ok" or not isinstance(noise, (int, float)) or noise != noise or noise <= 0:
        return None
    return 100.0 * float(noise)


def _timed_steps(t: dict) -> int | None:
    """How many timed steps the trial's objective averages (the manifest's ``timed_steps``: not the warm-up,
    the profiled steps or the one after them); None where the trial does not say (a failed one)."""
    timed = (t.get("metrics") or {}).get("timed_steps")
    return len(timed) if isinstance(timed, list) else None


def stop_note(result, space) -> str | None:
    """Why the model-driven search stopped, in numbers (``result.stop``, autotune/model_search.py): the best
    remaining prediction's gain over the incumbent vs the noise threshold, and where that threshold comes
    from. None when the search did not stop on the noise (budget spent, another strategy)."""
    st = getattr(result, "stop", None)
    if not st:
        return None
    inc, n, se = st["trial"], st.get("timed_steps"), st.get("se")
    steps = f"{n} timed step{'s' if n != 1 else ''}" if n is not None else "timed steps"
    if se is None:
        few = f"{steps}, fewer than the 3 a standard error needs" if n is not None else "fewer than 3 timed steps"
        src = (f"guided.min_gain ({100 * space.min_gain:.1f} %), the smallest gain that counts, because trial {inc}'s "
               f"standard error is unknown: {few}")
    elif st["noise"] > space.min_gain:
        src = (f"{space.noise_z:g} × the standard error {100 * se:.2f} % of trial {inc}'s objective (the standard "
               f"deviation of its {f'{n} ' if n else ''}timed step times / √n / their mean)")
    else:
        src = (f"guided.min_gain ({100 * space.min_gain:.1f} %), the smallest gain that counts, above "
               f"{space.noise_z:g} × the standard error {100 * se:.2f} % of trial {inc}'s objective")
    k = st.get("explored") or 0
    checks = (f" after {k} neighbour check{'s' if k != 1 else ''} (guided.explore), each measured to test the model"
              if k else " (guided.explore is 0: no neighbour checks)")
    return (f"the best remaining prediction, {_knobs_text(st['point'])}, gains {100 * st['gain']:+.1f} % over trial "
            f"{inc} (the search's incumbent); the noise threshold is {100 * st['noise']:.1f} %: {src}. No predicted "
            f"gain could be told from noise, so the search stopped{checks}.")


def best_config(best: dict | None) -> dict | None:
    """The best trial's full resolved trainer config, from its manifest (what the trainer really ran)."""
    if best is None or not best.get("run_dir"):
        return None
    from tracelens.io.run import Run

    return Run.open(best["run_dir"]).config


def best_yaml(space, best: dict | None) -> str:
    """A trainer config file for the best trial: ``python -m trainer --config best.yaml`` runs it."""
    import yaml

    if best is None:
        return "# no successful trial: nothing to write\n"
    cfg = best_config(best)
    head = (f"# best of the sweep: trial {best['id']}, {space.objective} = {best['objective']:.6g}\n"
            f"# knobs: {_knobs_text(best['knobs'])}\n"
            f"# run it: python -m trainer.launch --config best.yaml --nproc {space.nproc} -o runs/best\n")
    if cfg is None:  # no manifest to copy: base config name + overrides (the launcher resolves it)
        head += f"# (the trial's manifest is missing: this is {space.config} with these overrides)\n"
        cfg = {**space.base_config, **space.fixed, **best["knobs"]} if space.base_config else None
        if cfg is None:
            return head + yaml.safe_dump({**space.fixed, **best["knobs"]}, sort_keys=False)
    return head + yaml.safe_dump(cfg, sort_keys=False)


def _figures(df: pd.DataFrame, path: list[dict], space) -> dict:
    obj = space.objective
    figs: dict[str, Any] = {}
    if not len(df):
        return figs
    y = [float(v) if v == v and v is not None else 0.0 for v in df[obj]]
    se = [v * se_pct / 100 if se_pct == se_pct and se_pct is not None else 0.0 for v, se_pct in zip(y, df["se_pct"])]
    figs["plot-trials"] = {
        "data": [{"type": "bar", "x": [f"#{t}" for t in df["trial"]], "y": y,
                  "marker": {"color": [OK if s == "ok" else FAILED for s in df["status"]]},
                  # repeat noise: ±2 standard errors of the objective (the guided search's default keep rule)
                  "error_y": {"type": "data", "array": [round(2 * e, 6) for e in se], "visible": any(se),
                              "color": "#1d2430", "thickness": 1.2, "width": 5},
                  "customdata": [f"±{p:.2f}%" if p == p and p is not None else "unknown" for p in df["se_pct"]],
                  "text": [plot_text(k if s == "ok" else f"{k}<br>{r}") for k, s, r in zip(df["knobs"], df["status"], df["reason"])],
                  "textposition": "none",
                  "hovertemplate": "trial %{x}: %{y:.4g} (standard error %{customdata})<br>%{text}<extra></extra>"}],
        "layout": {"height": 340, "margin": {"l": 70, "r": 20, "t": 10, "b": 40},
                   "xaxis": {"title": {"text": "trial"}, "type": "category"},
                   "yaxis": {"title": {"text": plot_text(obj)}}}}
    if path:
        xs = list(range(1, len(path) + 1))
        best_so_far, cur = [], None
        for p in path:
            if p["decision"] in ("start", "kept") and p["objective"] is not None:
                cur = p["objective"]
            best_so_far.append(cur)
        color = {"start": OK, "kept": KEPT, "reverted": "#9aa6b8", "failed": FAILED}
        figs["plot-path"] = {
            "data": [{"type": "scatter", "mode": "markers", "name": "trial", "x": xs,
                      "y": [p["objective"] if p["objective"] is not None else 0.0 for p in path],
                      "marker": {"size": 11, "color": [color.get(p["decision"] or "", OK) for p in path]},
                      "text": [plot_text(f"#{p['trial']} {p['decision'] or ''}: {p['motivation']}") for p in path],
                      "hovertemplate": "%{text}<br>%{y:.4g}<extra></extra>"},
                     {"type": "scatter", "mode": "lines", "name": "best so far", "x": xs, "y": best_so_far,
                      "line": {"shape": "hv", "color": KEPT}}],
            "layout": {"height": 320, "margin": {"l": 70, "r": 20, "t": 10, "b": 40},
                       "xaxis": {"title": {"text": "step of the search"}, "dtick": 1},
                       "yaxis": {"title": {"text": plot_text(obj)}}, "legend": {"orientation": "h"}}}
    ok = df[df["status"] == "ok"]
    effects = []
    knobs = [k for k in space.knobs if len(ok) and f"knob.{k}" in ok]
    gap = 0.06 if len(knobs) > 1 else 0.0
    width = (1.0 - gap * (len(knobs) - 1)) / max(1, len(knobs))
    axes: dict[str, Any] = {}
    for i, k in enumerate(knobs):
        col = f"knob.{k}"
        vals = ok[col].map(lambda v: json.dumps(v) if isinstance(v, (list, dict)) else str(v))
        g = ok.groupby(vals, sort=False)[obj].agg(["mean", "min", "max", "count"])
        order = [str(v) if not isinstance(v, (list, dict)) else json.dumps(v) for v in space.knobs[k]]
        g = g.reindex([o for o in order if o in g.index])
        ax = "" if i == 0 else str(i + 1)
        effects.append({"type": "bar", "name": plot_text(k), "x": [plot_text(v) for v in g.index],
                        "xaxis": f"x{ax}", "yaxis": "y",
                        "y": [float(v) for v in g["mean"]],
                        "error_y": {"type": "data", "symmetric": False,
                                    "array": [float(v) for v in g["max"] - g["mean"]],
                                    "arrayminus": [float(v) for v in g["mean"] - g["min"]]},
                        "customdata": [int(c) for c in g["count"]],
                        "hovertemplate": plot_text(k) + "=%{x}: mean %{y:.4g} over %{customdata} trial(s)<extra></extra>"})
        x0 = i * (width + gap)
        axes[f"xaxis{ax}"] = {"domain": [round(x0, 4), round(min(1.0, x0 + width), 4)], "type": "category",
                              "title": {"text": plot_text(k), "font": {"size": 12}}, "automargin": True,
                              "anchor": "y"}
    figs["plot-knobs"] = {"data": effects, "layout": {
        "height": 360, "margin": {"l": 70, "r": 20, "t": 10, "b": 60}, "showlegend": False, "bargap": 0.35,
        "yaxis": {"title": {"text": f"mean {plot_text(obj)} (whiskers: min-max)"}}, **axes}}
    return figs


def render(result, space, diff_link: str | None = None, diff_error: str | None = None) -> str:
    obj = space.objective
    df = trials_frame(result.trials, obj, Path(result.out))
    path = pd.DataFrame(result.path, columns=["trial", "decision", "objective", "motivation", "knobs", "status", "reason"]) \
        if result.path else pd.DataFrame(columns=["trial", "decision", "objective", "motivation", "knobs", "status", "reason"])
    if len(path):
        path = path.assign(step=range(1, len(path) + 1), knobs=[_knobs_text(k) for k in path["knobs"]],
                           reason=path["reason"].fillna(""))
    else:
        path = path.assign(step=[])
    tables = {
        "trials": html_table(df, [("trial", "trial", "num"), ("status", "status", "text"), (obj, obj, "num"),
                                  ("knobs", "knobs", "name"), ("decision", "decision", "text"),
                                  ("motivation", "why this point", "text"), ("reason", "failure", "text"),
                                  ("se_pct", "s.e. %", "num"), ("timed_steps", "timed steps", "count"),
                                  ("wall_s", "wall s", "num"),
                                  ("run_dir", "run dir", "name")], max_rows=10000),
        "path": html_table(path, [("step", "step", "num"), ("trial", "trial", "num"), ("decision", "decision", "text"),
                                  (obj if obj in path else "objective", obj, "num"),
                                  ("motivation", "finding that motivated it", "text"), ("knobs", "knobs", "name"),
                                  ("reason", "failure", "text")], max_rows=10000),
    }
    best, base = result.best, result.baseline
    speedup = None
    if best and base and base.get("status") == "ok" and base.get("objective"):
        speedup = best["objective"] / base["objective"] if space.maximize else base["objective"] / best["objective"]
    from .sweep_model import context as model_context  # predicted vs measured, decomposition per kept move

    model = model_context(result, space)
    figures = {**_figures(df, result.path, space), **model.pop("figures")}
    return template_env().get_template("sweep.html").render(
        title=f"tracelens autotune: {space.config} ({result.strategy})", warnings=[], plotly_packed=plotly_js_packed(),
        figures_json=safe_json(figures), tables=tables, model=model, best=best, top=getattr(result, "top", None), baseline=base,
        speedup=speedup, objective=obj, stopped=result.stopped, strategy=result.strategy,
        stop_note=stop_note(result, space), min_gain=space.min_gain,
        best_yaml=best_yaml(space, best), n=len(df), failed=int((df["status"] != "ok").sum()) if len(df) else 0,
        diff_link=diff_link, diff_error=diff_error, has_path=bool(result.path) and result.strategy == "guided",
    )


def write_diff(result, out: Path) -> tuple[str | None, str | None]:
    """Diff the best trial against the baseline (traces + manifests) into OUT/diff_best_vs_baseline/.
    Returns (relative link, None) or (None, why not)."""
    best, base = result.best, result.baseline
    if not best or not base or base.get("status") != "ok":
        return None, "no successful baseline to compare with"
    if best["id"] == base["id"]:
        return None, "the baseline is the best trial"
    import tracelens
    from tracelens.analysis.diff import diff
    from tracelens.errors import TraceError

    from . import diff as rdiff

    try:
        a = tracelens.analyze(tracelens.load(base["run_dir"], progress=False))
        b = tracelens.analyze(tracelens.load(best["run_dir"], progress=False))
        r = diff(a, b, a.trace.run.manifest, b.trace.run.manifest, base_label=f"baseline (trial {base['id']})",
                 new_label=f"best (trial {best['id']})")
        rdiff.write_all(r, out / "diff_best_vs_baseline")
    except TraceError as e:
        return None, f"diff unavailable: {e.one_line()[:300]}"
    except Exception as e:  # noqa: BLE001 - the sweep's results stand even when the diff cannot be made
        return None, f"diff unavailable: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return "diff_best_vs_baseline/diff.html", None


def write(result, space) -> dict[str, Path]:
    """Write OUT/best.yaml, OUT/diff_best_vs_baseline/ and OUT/sweep.html (each atomically)."""
    out = Path(result.out)
    paths: dict[str, Path] = {}
    write_text_atomic(out / "best.yaml", best_yaml(space, result.best))
    paths["best.yaml"] = out / "best.yaml"
    link, err = write_diff(result, out)
    if link:
        paths["diff.html"] = out / link
    write_text_atomic(out / "sweep.html", render(result, space, link, err))
    paths["sweep.html"] = out / "sweep.html"
    return paths


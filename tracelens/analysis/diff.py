"""Diff two analyses (base -> new): per-step metrics with noise, categories, ops, kernels; CI rules.

Everything is per step (see `steps.py`), so windows with different step counts compare fairly. When a
side has several steps, metrics are per-step medians and the spread (max - min, or p90 - p10 from 5
steps on) is reported; a change no larger than the larger of the two spreads is "within noise".

Rules (`--fail-on`), a small grammar:  METRIC OP VALUE
    METRIC  step_time | gpu.busy | gpu.idle | gpu.compute | gpu.comm | gpu.exposed_comm | gpu.span |
            host_syncs | kernels | category.<name> (gemm, grouped_gemm, attention, elementwise,
            reduction_norm, communication, memory, other) | run.<manifest metric> (run dirs)
    OP      >  >=  <  <=
    VALUE   a signed or unsigned number; with a trailing % it is the relative change in percent,
            otherwise the absolute change in the metric's unit (ms per step, counts per step).
A rule compares the *change* new - base, so a trace diffed against itself never trips one. A change
within noise never trips a rule either.
    step_time>+5%      the step got more than 5 % slower
    host_syncs>0       any host synchronization was added per step
    gpu.idle>+10%      GPU idle time per step grew by more than 10 %
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .. import categories as C
from ..errors import TraceError
from .steps import op_shares, step_figures, sync_ops

US = 1000.0
METRICS: dict[str, tuple[str, str, float]] = {  # name -> (per-step column, unit, scale from column)
    "step_time": ("step_time_us", "ms", 1e-3),
    "gpu.span": ("gpu_span_us", "ms", 1e-3),
    "gpu.busy": ("gpu_busy_us", "ms", 1e-3),
    "gpu.idle": ("gpu_idle_us", "ms", 1e-3),
    "gpu.compute": ("compute_us", "ms", 1e-3),
    "gpu.comm": ("comm_us", "ms", 1e-3),
    "gpu.exposed_comm": ("exposed_comm_us", "ms", 1e-3),
    "host_syncs": ("host_syncs", "count", 1.0),
    "kernels": ("kernels", "count", 1.0),
}


def category_metric(cat: str) -> str:
    return "category." + re.sub(r"[^a-z0-9]+", "_", cat.lower()).strip("_")


@dataclass
class DiffResult:
    base_label: str
    new_label: str
    metrics: pd.DataFrame  # metric, unit, base, new, delta, rel_pct, spread, within_noise
    categories: pd.DataFrame  # category, base_ms, new_ms, delta_ms (per step)
    ops: pd.DataFrame  # key columns, status, base/new GPU and wall ms per step, delta_wall_ms
    kernels: pd.DataFrame  # kernel (normalized), status, base/new count and ms per step
    syncs: pd.DataFrame  # op (top-level), via (innermost), call, base/new host syncs per step
    info: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def metric(self, name: str) -> pd.Series:
        return self.metrics.set_index("metric").loc[name]

    def top_ops(self) -> pd.DataFrame:
        """The op changes rolled up to top-level ops (as called from Python): where the step went."""
        o = self.ops
        if o.empty:
            return pd.DataFrame(columns=["top_op", "status", "base_wall_ms", "new_wall_ms", "delta_wall_ms"])
        g = o.groupby("top_op", sort=False).agg(base_wall_ms=("base_wall_ms", "sum"), new_wall_ms=("new_wall_ms", "sum"),
                                                delta_wall_ms=("delta_wall_ms", "sum")).reset_index()
        g["status"] = np.where(g["base_wall_ms"] == 0, "added", np.where(g["new_wall_ms"] == 0, "removed", "changed"))
        g = g[g["delta_wall_ms"].abs() > 1e-9]
        return g.reindex(g["delta_wall_ms"].abs().sort_values(ascending=False).index).reset_index(drop=True)[
            ["top_op", "status", "base_wall_ms", "new_wall_ms", "delta_wall_ms"]]


def _spread(values: np.ndarray) -> float:
    v = np.asarray(values, dtype=float)
    v = v[~np.isnan(v)]
    if len(v) < 2:
        return 0.0
    if len(v) >= 5:
        return float(np.percentile(v, 90) - np.percentile(v, 10))
    return float(v.max() - v.min())


def _per_step_categories(a, n_steps: int) -> pd.Series:
    if a.categories.empty:
        return pd.Series(dtype=float)
    per_rank = a.categories.groupby("category")["total_us"].sum() / max(1, a.trace_rank_count)
    return per_rank / n_steps / US  # ms per step


def diff(base, new, base_manifest: dict | None = None, new_manifest: dict | None = None,
         base_label: str = "base", new_label: str = "new") -> DiffResult:
    """Compare two `Analysis` objects (and optionally their run manifests)."""
    warnings: list[str] = []
    sb, sn = step_figures(base), step_figures(new)
    dev_b = sorted({r.device_name for r in base.trace.ranks if r.device_name})
    dev_n = sorted({r.device_name for r in new.trace.ranks if r.device_name})
    if dev_b != dev_n:
        warnings.append(f"different devices: {', '.join(dev_b) or 'none'} vs {', '.join(dev_n) or 'none'}; "
                        "kernel-level changes mix hardware and code effects")
    ws_b, ws_n = base.trace_rank_count, new.trace_rank_count
    wsi_b = next((r.world_size for r in base.trace.ranks if r.world_size), ws_b)
    wsi_n = next((r.world_size for r in new.trace.ranks if r.world_size), ws_n)
    if wsi_b != wsi_n:
        warnings.append(f"different world sizes: {wsi_b} vs {wsi_n}; per-rank figures are averaged over ranks")
    if sb.source != sn.source:
        warnings.append(f"steps are counted differently: {sb.source} ({sb.n_steps}) vs {sn.source} ({sn.n_steps})")
    elif sb.source != "profiler steps":
        warnings.append(f"no profiler steps marked: per-step figures divide the window by {sb.source} "
                        f"({sb.n_steps} vs {sn.n_steps})")
    if not base.has_gpu or not new.has_gpu:
        warnings.append("a side has no GPU activity: GPU metrics are unavailable for it")

    rows = []
    for name, (col, unit, scale) in METRICS.items():
        bvals = sb.per_step[col].to_numpy(dtype=float) * scale if col in sb.per_step else np.array([np.nan])
        nvals = sn.per_step[col].to_numpy(dtype=float) * scale if col in sn.per_step else np.array([np.nan])
        rows.append(_metric_row(name, unit, bvals, nvals))
    cb, cn = _per_step_categories(base, sb.n_steps), _per_step_categories(new, sn.n_steps)
    cats = sorted(set(cb.index) | set(cn.index), key=lambda c: C.CATEGORIES.index(c) if c in C.CATEGORIES else 99)
    for c in cats:
        rows.append(_metric_row(category_metric(c), "ms", np.array([cb.get(c, 0.0)]), np.array([cn.get(c, 0.0)])))
    for key, b, n, unit in _manifest_metrics(base_manifest, new_manifest):
        rows.append(_metric_row(f"run.{key}", unit, np.array([b]), np.array([n])))
    metrics = pd.DataFrame(rows)

    categories = pd.DataFrame({
        "category": cats,
        "base_ms": [float(cb.get(c, 0.0)) for c in cats],
        "new_ms": [float(cn.get(c, 0.0)) for c in cats],
    })
    categories["delta_ms"] = categories["new_ms"] - categories["base_ms"]

    ops = _diff_ops(base, new, sb.n_steps, sn.n_steps)
    kernels = _diff_kernels(base, new, sb.n_steps, sn.n_steps)
    info = {
        "base": {"label": base_label, "ranks": ws_b, "devices": dev_b, "steps": sb.n_steps, "step_source": sb.source},
        "new": {"label": new_label, "ranks": ws_n, "devices": dev_n, "steps": sn.n_steps, "step_source": sn.source},
    }
    syncs = _diff_syncs(base, new, sb.n_steps, sn.n_steps)
    return DiffResult(base_label, new_label, metrics, categories, ops, kernels, syncs, info, warnings)


def _diff_syncs(base, new, nb: int, nn: int) -> pd.DataFrame:
    b, n = sync_ops(base.tree), sync_ops(new.tree)
    m = b.merge(n, on=["op", "via", "call"], how="outer", suffixes=("_base", "_new")).fillna(
        {"count_base": 0, "count_new": 0})
    out = pd.DataFrame({"op": m["op"], "via": m["via"], "call": m["call"],
                        "base_per_step": m["count_base"] / nb / max(1, base.trace_rank_count),
                        "new_per_step": m["count_new"] / nn / max(1, new.trace_rank_count)})
    out["delta"] = out["new_per_step"] - out["base_per_step"]
    return out.sort_values("delta", key=lambda s: s.abs(), ascending=False, ignore_index=True)


def _metric_row(name: str, unit: str, bvals: np.ndarray, nvals: np.ndarray) -> dict:
    b = float(np.nanmedian(bvals)) if np.isfinite(bvals).any() else math.nan
    n = float(np.nanmedian(nvals)) if np.isfinite(nvals).any() else math.nan
    delta = n - b
    spread = max(_spread(bvals), _spread(nvals))
    rel = (100.0 * delta / abs(b)) if b not in (0.0,) and not math.isnan(b) and not math.isnan(delta) else (
        0.0 if delta == 0 else math.nan)
    within = (not math.isnan(delta)) and abs(delta) <= spread
    return {"metric": name, "unit": unit, "base": b, "new": n, "delta": delta, "rel_pct": rel,
            "spread": spread, "within_noise": bool(within), "steps_base": int(len(bvals)), "steps_new": int(len(nvals))}


def _manifest_metrics(bm: dict | None, nm: dict | None):
    """Run-level metrics of two run dirs: every scalar under `metrics`, plus the loss at the last step
    both runs reached, peak memory (max over ranks, GB) and the mean step time (ms)."""
    if not bm or not nm:
        return []
    mb, mn = bm.get("metrics", {}) or {}, nm.get("metrics", {}) or {}
    b, n = _flat_numbers(mb), _flat_numbers(mn)
    out = [(k, b[k], n[k], "") for k in sorted(set(b) & set(n))]
    lb, ln = mb.get("loss"), mn.get("loss")
    if isinstance(lb, list) and isinstance(ln, list) and lb and ln:
        k = min(len(lb), len(ln)) - 1
        if isinstance(lb[k], (int, float)) and isinstance(ln[k], (int, float)):
            out.append((f"loss_at_step_{k}", float(lb[k]), float(ln[k]), ""))
            out.append(("loss_final", float(lb[k]), float(ln[k]), ""))
    pb, pn = mb.get("peak_memory_bytes"), mn.get("peak_memory_bytes")
    if isinstance(pb, list) and isinstance(pn, list) and pb and pn:
        out.append(("peak_memory_gb", max(pb) / 2**30, max(pn) / 2**30, "GB"))
    return out


def _flat_numbers(d: Any, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flat_numbers(v, f"{prefix}{k}."))
    elif isinstance(d, (int, float)) and not isinstance(d, bool) and math.isfinite(d):
        out[prefix[:-1]] = float(d)
    return out


def _diff_ops(base, new, nb: int, nn: int) -> pd.DataFrame:
    keys = ["path", "top_op", "op", "input_dims"]
    ob, on = op_shares(base), op_shares(new)
    m = ob.merge(on, on=keys, how="outer", suffixes=("_base", "_new"))
    for c in ("gpu_us", "idle_us", "wall_us", "count"):
        for side in ("base", "new"):
            m[f"{c}_{side}"] = m[f"{c}_{side}"].fillna(0.0)
    out = m[keys].copy()
    out["status"] = np.where(m["count_base"] == 0, "added", np.where(m["count_new"] == 0, "removed", "changed"))
    out["base_gpu_ms"] = m["gpu_us_base"] / nb / US
    out["new_gpu_ms"] = m["gpu_us_new"] / nn / US
    out["base_wall_ms"] = m["wall_us_base"] / nb / US
    out["new_wall_ms"] = m["wall_us_new"] / nn / US
    out["delta_wall_ms"] = out["new_wall_ms"] - out["base_wall_ms"]
    out["base_kernels"] = m["count_base"] / nb
    out["new_kernels"] = m["count_new"] / nn
    out.loc[(out["status"] == "changed") & (out["delta_wall_ms"].abs() < 1e-9), "status"] = "same"
    return out.reindex(out["delta_wall_ms"].abs().sort_values(ascending=False).index).reset_index(drop=True)


def _diff_kernels(base, new, nb: int, nn: int) -> pd.DataFrame:
    def per(a, n):
        k = a.gpu
        if k.empty:
            return pd.DataFrame(columns=["kernel", "category", "count", "total_us"])
        names = k["name"].astype(str).map(_norm_cache)
        df = pd.DataFrame({"kernel": names.to_numpy(), "category": k["category"].astype(str).to_numpy(),
                           "dur": k["dur"].to_numpy()})
        g = df.groupby(["kernel", "category"], sort=False)["dur"].agg(["size", "sum"]).reset_index()
        g["count"] = g.pop("size") / n / max(1, a.trace_rank_count)
        g["total_us"] = g.pop("sum") / US / n / max(1, a.trace_rank_count)  # dur is ns
        return g

    kb, kn = per(base, nb), per(new, nn)
    m = kb.merge(kn, on=["kernel", "category"], how="outer", suffixes=("_base", "_new")).fillna(
        {"count_base": 0.0, "count_new": 0.0, "total_us_base": 0.0, "total_us_new": 0.0})
    out = pd.DataFrame({
        "kernel": m["kernel"], "category": m["category"],
        "status": np.where(m["count_base"] == 0, "added", np.where(m["count_new"] == 0, "removed", "changed")),
        "base_count": m["count_base"], "new_count": m["count_new"],
        "base_ms": m["total_us_base"] / US, "new_ms": m["total_us_new"] / US,
    })
    out["delta_ms"] = out["new_ms"] - out["base_ms"]
    return out.reindex(out["delta_ms"].abs().sort_values(ascending=False).index).reset_index(drop=True)


_NORM: dict[str, str] = {}


def _norm_cache(name: str) -> str:
    r = _NORM.get(name)
    if r is None:
        r = _NORM[name] = C.normalize_kernel_name(name)
    return r


# --------------------------------------------------------------------------------------- rules

_RULE = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=|>|<)\s*([+-]?\d+(?:\.\d+)?)\s*(%?)\s*$")


@dataclass
class Rule:
    text: str
    metric: str
    op: str
    value: float
    relative: bool

    def check(self, result: DiffResult) -> dict[str, Any]:
        rows = result.metrics[result.metrics["metric"] == self.metric]
        if rows.empty:
            known = ", ".join(result.metrics["metric"])
            raise TraceError(None, f"--fail-on {self.text!r}: unknown metric {self.metric!r} (known: {known})")
        r = rows.iloc[0]
        change = r["rel_pct"] if self.relative else r["delta"]
        cond = _compare(change, self.op, self.value)
        no_change = r["delta"] == 0 or (isinstance(change, float) and math.isnan(change))
        tripped = bool(cond and not no_change and not r["within_noise"])
        return {"rule": self.text, "metric": self.metric, "change": None if _nan(change) else float(change),
                "unit": "%" if self.relative else r["unit"], "within_noise": bool(r["within_noise"]),
                "tripped": tripped}


def _nan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _compare(x: float, op: str, v: float) -> bool:
    if _nan(x):
        return False
    return {">": x > v, ">=": x >= v, "<": x < v, "<=": x <= v}[op]


def parse_rule(text: str) -> Rule:
    m = _RULE.match(text)
    if not m:
        raise TraceError(None, f"bad --fail-on rule {text!r}: expected METRIC OP VALUE, e.g. 'step_time>+5%' or 'host_syncs>0'")
    metric, op, value, pct = m.groups()
    if metric not in METRICS and not metric.startswith(("category.", "run.")):
        raise TraceError(None, f"bad --fail-on rule {text!r}: unknown metric {metric!r} "
                               f"(one of {', '.join(METRICS)}, category.<name>, run.<manifest metric>)")
    return Rule(text=text.strip(), metric=metric, op=op, value=float(value), relative=pct == "%")


def check_rules(result: DiffResult, rules: list[Rule]) -> list[dict[str, Any]]:
    return [r.check(result) for r in rules]

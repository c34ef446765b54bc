"""Diff two analyses (base -> new): per-step metrics with noise, categories, ops, kernels; CI rules.

Everything is per step over each side's steady-state steps (see `steps.py`; `analyze(..., window="all")`
for every step), so windows with different step counts compare fairly. Each metric's per-step values are
its samples: the figure shown is their median, the spread (max - min, or p90 - p10 from 5 steps on) is
reported, and with at least MIN_SAMPLES (3) samples on each side Welch's t-test (scipy's when installed,
else the same test computed here) gives a two-sided p-value; a change is "within noise" when p >= 0.05.
With fewer on a side the noise is unknown (p-value null, never 0; the spread too with one sample): two
samples a side leave the test at most 2 degrees of freedom, and two near-equal steps make any change look
certain. The diff says so in a warning and a rule decides on the change alone.

Rules (`--fail-on`), a small grammar:  [new.|delta(]METRIC[)] OP VALUE
    METRIC  step_time | gpu.busy | gpu.idle | gpu.compute | gpu.comm | gpu.exposed_comm | gpu.comm_wait |
            gpu.pipeline_wait | gpu.span |
            host_syncs | kernels | category.<name> (gemm, grouped_gemm, attention, elementwise,
            reduction_norm, communication, memory, other) | run.<manifest metric> (run dirs)
    OP      >  >=  <  <=
    VALUE   a number, signed or not, with a trailing % for a relative change in percent
Two forms, and the verdict names the one it evaluated and the numbers it compared:
  absolute  new.METRIC OP NUMBER, or METRIC OP NUMBER with an unsigned number and no %: the new run's value
            per step (its median) against the number, whatever the base had. `host_syncs>0`: the new run
            syncs at all.
  change    delta(METRIC) OP VALUE, or METRIC OP VALUE with a signed number (+5, -3, +0) or a percentage:
            the change new - base (absolute in the metric's unit, or relative in %). A change rule never
            trips on no change (a trace diffed against itself passes it) or on a change within noise.
    step_time>+5%          the step got more than 5 % slower
    delta(host_syncs)>0    host synchronizations were added per step (also: host_syncs>+0)
    host_syncs>0           the new run has any host synchronization per step (also: new.host_syncs>0)
    gpu.idle>+10%          GPU idle time per step grew by more than 10 %
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
MIN_SAMPLES = 3  # per side, for a p-value (Welch's test on 2 + 2 samples has at most 2 degrees of freedom)
METRICS: dict[str, tuple[str, str, float]] = {  # name -> (per-step column, unit, scale from column)
    "step_time": ("step_time_us", "ms", 1e-3),
    "gpu.span": ("gpu_span_us", "ms", 1e-3),
    "gpu.busy": ("gpu_busy_us", "ms", 1e-3),
    "gpu.idle": ("gpu_idle_us", "ms", 1e-3),
    "gpu.compute": ("compute_us", "ms", 1e-3),
    "gpu.comm": ("comm_us", "ms", 1e-3),
    "gpu.exposed_comm": ("exposed_comm_us", "ms", 1e-3),
    "gpu.comm_wait": ("comm_wait_us", "ms", 1e-3),
    "gpu.pipeline_wait": ("pipeline_wait_us", "ms", 1e-3),
    "host_syncs": ("host_syncs", "count", 1.0),
    "kernels": ("kernels", "count", 1.0),
}


# the units of the trainer's run metrics (manifest.json `metrics`; trainer/train.py), by name; another scalar there
# takes its unit from its name's suffix (`_s`: seconds, `_bytes`), else none
RUN_UNITS = {"steps": "count", "timed_steps": "count", "tokens_per_step": "tokens", "tokens_per_step_per_gpu": "tokens",
             "tokens_per_s": "tokens/s", "tokens_per_s_per_gpu": "tokens/s/GPU", "model_flops_per_token": "FLOP",
             "mfu": "fraction"}


def run_unit(key: str) -> str:
    """The unit of a run metric (`run.<key>`), "" where the name does not say."""
    name = key.rsplit(".", 1)[-1]
    if name in RUN_UNITS:
        return RUN_UNITS[name]
    return "s" if name.endswith("_s") else "bytes" if name.endswith("_bytes") else ""


def category_metric(cat: str) -> str:
    return "category." + re.sub(r"[^a-z0-9]+", "_", cat.lower()).strip("_")


@dataclass
class DiffResult:
    base_label: str
    new_label: str
    metrics: pd.DataFrame  # metric, unit, base, new, delta, rel_pct, spread, p_value, within_noise, steps_base/new
    categories: pd.DataFrame  # category, base_ms, new_ms, delta_ms (per step)
    ops: pd.DataFrame  # key columns, status, base/new GPU and wall ms per step, delta_wall_ms
    kernels: pd.DataFrame  # kernel (normalized), kernel_display (demangled, short), status, base/new count and ms per step
    syncs: pd.DataFrame  # op (top-level), via (innermost), call, base/new host syncs per step
    info: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    cpu_ops: pd.DataFrame = field(default_factory=pd.DataFrame)  # op, status, calls and self ms per step (host)

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
        return g.reindex(g["delta_wall_ms"].abs().sort_values(ascending=False, kind="stable").index).reset_index(drop=True)[
            ["top_op", "status", "base_wall_ms", "new_wall_ms", "delta_wall_ms"]]


def _spread(values: np.ndarray) -> float:
    """max - min of the samples (p90 - p10 from 5 on); NaN (unknown) with fewer than two samples."""
    v = np.asarray(values, dtype=float)
    v = v[~np.isnan(v)]
    if len(v) < 2:
        return math.nan
    if len(v) >= 5:
        return float(np.percentile(v, 90) - np.percentile(v, 10))
    return float(v.max() - v.min())


def welch_test(a, b) -> tuple[float, float, float]:
    """Welch's unequal-variance t-test of two samples: (t, degrees of freedom, two-sided p-value).

    NaN everywhere with fewer than two values on a side. Both variances zero: p = 1 when the means are
    equal, 0 when they differ (a deterministic change, e.g. a kernel count). scipy.stats when installed,
    else the same statistic with the Student-t tail from the regularized incomplete beta function."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if len(a) < 2 or len(b) < 2:
        return math.nan, math.nan, math.nan
    va, vb = float(a.var(ddof=1)) / len(a), float(b.var(ddof=1)) / len(b)
    diff = float(b.mean() - a.mean())
    if va + vb <= 0:
        return (0.0 if diff == 0 else math.copysign(math.inf, diff)), math.nan, (1.0 if diff == 0 else 0.0)
    t = diff / math.sqrt(va + vb)
    df = (va + vb) ** 2 / ((va * va / (len(a) - 1) if va else 0.0) + (vb * vb / (len(b) - 1) if vb else 0.0))
    try:
        from scipy import stats  # optional: the reference implementation

        return t, df, float(stats.ttest_ind(b, a, equal_var=False).pvalue)
    except ImportError:
        return t, df, student_t_two_sided(t, df)


def student_t_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom: I_{df/(df+t^2)}(df/2, 1/2)."""
    if math.isnan(t) or math.isnan(df):
        return math.nan
    if math.isinf(t):
        return 0.0
    return min(1.0, max(0.0, _betainc(df / 2.0, 0.5, df / (df + t * t))))


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) (continued fraction, Numerical Recipes' betacf)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(lbeta)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _betacf(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _window_gpu(a) -> pd.DataFrame:
    g = getattr(a, "gpu_window", None)
    return a.gpu if g is None else g


def _per_step_categories(a, sf) -> dict[str, np.ndarray]:
    """category -> GPU time per step (ms, averaged over ranks), one sample per step of the window; one
    sample (the window / steps) when the trace marks no profiler steps."""
    g = _window_gpu(a)
    if g.empty:
        return {}
    nr = max(1, a.trace_rank_count)
    steps = sf.per_step["step"].to_numpy() if "step" in sf.per_step else np.array([0])
    if sf.source.startswith("profiler steps") and len(steps) and (g["step"] >= 0).any():
        t = g.groupby(["category", "step"], observed=True)["dur"].sum()
        out = {}
        for cat in t.index.get_level_values(0).unique():
            per = t.loc[cat].reindex(steps).fillna(0.0).to_numpy(dtype=float)
            out[str(cat)] = per / nr / US / US
        return out
    tot = g.groupby("category", observed=True)["dur"].sum()
    return {str(c): np.array([float(v) / nr / sf.n_steps / US / US]) for c, v in tot.items()}


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
    for side, a, sf in (("base", base, sb), ("new", new, sn)):
        w = getattr(a, "window", None)
        if w is not None and w.restricts and w.excluded_steps:
            warnings.append(f"{side}: {w.describe()}")
    kb, kn = len(sb.per_step), len(sn.per_step)
    if kb < 2 or kn < 2:
        warnings.append(f"one sample: base has {kb} per-step sample(s), new {kn} ({sb.source} / {sn.source}): the noise "
                        f"is unknown and rules decide on the change alone; profile {MIN_SAMPLES} or more steps for a "
                        "significance test")
    elif kb < MIN_SAMPLES or kn < MIN_SAMPLES:
        warnings.append(f"too few samples: base has {kb} per-step samples, new {kn} ({sb.source} / {sn.source}); "
                        f"a significance test needs {MIN_SAMPLES} a side: the noise is unknown and rules decide on the "
                        "change alone")

    rows = []
    for name, (col, unit, scale) in METRICS.items():
        bvals = sb.per_step[col].to_numpy(dtype=float) * scale if col in sb.per_step else np.array([np.nan])
        nvals = sn.per_step[col].to_numpy(dtype=float) * scale if col in sn.per_step else np.array([np.nan])
        rows.append(_metric_row(name, unit, bvals, nvals))
    cb, cn = _per_step_categories(base, sb), _per_step_categories(new, sn)
    cats = sorted(set(cb) | set(cn), key=lambda c: C.CATEGORIES.index(c) if c in C.CATEGORIES else 99)
    zb, zn = np.zeros(max(1, len(sb.per_step))), np.zeros(max(1, len(sn.per_step)))
    for c in cats:
        rows.append(_metric_row(category_metric(c), "ms", cb.get(c, zb), cn.get(c, zn)))
    for key, b, n, unit in _manifest_metrics(base_manifest, new_manifest):
        rows.append(_metric_row(f"run.{key}", unit, np.array([b]), np.array([n])))
    metrics = pd.DataFrame(rows)

    categories = pd.DataFrame({  # mean per step, so the categories add up to the GPU time per step
        "category": cats,
        "base_ms": [float(np.mean(cb.get(c, zb))) for c in cats],
        "new_ms": [float(np.mean(cn.get(c, zn))) for c in cats],
    })
    categories["delta_ms"] = categories["new_ms"] - categories["base_ms"]

    ops = _diff_ops(base, new, sb.n_steps, sn.n_steps)
    kernels = _diff_kernels(base, new, sb.n_steps, sn.n_steps)
    info = {
        "base": {"label": base_label, "ranks": ws_b, "devices": dev_b, "steps": sb.n_steps, "step_source": sb.source},
        "new": {"label": new_label, "ranks": ws_n, "devices": dev_n, "steps": sn.n_steps, "step_source": sn.source},
    }
    syncs = _diff_syncs(base, new, sb.n_steps, sn.n_steps)
    cpu_ops = _diff_cpu_ops(base, new, sb.n_steps, sn.n_steps)
    for side, a in (("base", base), ("new", new)):
        w = getattr(a, "window", None)
        if w is not None:
            info[side]["window"] = w.to_dict()
    return DiffResult(base_label, new_label, metrics, categories, ops, kernels, syncs, info, warnings, cpu_ops)


def _diff_cpu_ops(base, new, nb: int, nn: int) -> pd.DataFrame:
    """Host ops by name over each side's window: calls and self time per step (averaged over ranks);
    status added / removed / changed / same. Catches ops that launch nothing (aten::item, a .tolist())."""
    from .calltree import KIND_OP

    def per(a, n):
        t = a.tree
        m = t["kind"].to_numpy() == KIND_OP
        hw = getattr(a, "host_window", None)
        if hw is not None:
            m = m & np.asarray(hw, dtype=bool)
        if not m.any():
            return pd.DataFrame(columns=["op", "calls", "self_ms"])
        ops = t.loc[m, ["name", "self_dur"]]
        df = pd.DataFrame({"op": C.strings(ops["name"]), "self": ops["self_dur"].to_numpy()})
        g = df.groupby("op", sort=False)["self"].agg(["size", "sum"]).reset_index()
        k = n * max(1, a.trace_rank_count)
        return pd.DataFrame({"op": g["op"], "calls": g["size"] / k, "self_ms": g["sum"] / US / US / k})

    ob, on = per(base, nb), per(new, nn)
    m = ob.merge(on, on="op", how="outer", suffixes=("_base", "_new")).fillna(
        {"calls_base": 0.0, "calls_new": 0.0, "self_ms_base": 0.0, "self_ms_new": 0.0})
    out = pd.DataFrame({"op": m["op"], "base_calls": m["calls_base"], "new_calls": m["calls_new"],
                        "base_self_ms": m["self_ms_base"], "new_self_ms": m["self_ms_new"]})
    out["status"] = np.where(out["base_calls"] == 0, "added", np.where(out["new_calls"] == 0, "removed",
                             np.where(out["base_calls"] == out["new_calls"], "same", "changed")))
    out["delta_calls"] = out["new_calls"] - out["base_calls"]
    out["delta_self_ms"] = out["new_self_ms"] - out["base_self_ms"]
    order = {"added": 0, "removed": 1, "changed": 2, "same": 3}
    out = out.assign(_o=out["status"].map(order), _d=-out["delta_self_ms"].abs())
    return out.sort_values(["_o", "_d"], ignore_index=True, kind="stable")[
        ["op", "status", "base_calls", "new_calls", "delta_calls", "base_self_ms", "new_self_ms", "delta_self_ms"]]


def _diff_syncs(base, new, nb: int, nn: int) -> pd.DataFrame:
    b, n = sync_ops(base.tree), sync_ops(new.tree)
    m = b.merge(n, on=["op", "via", "call"], how="outer", suffixes=("_base", "_new")).fillna(
        {"count_base": 0, "count_new": 0})
    out = pd.DataFrame({"op": m["op"], "via": m["via"], "call": m["call"],
                        "base_per_step": m["count_base"] / nb / max(1, base.trace_rank_count),
                        "new_per_step": m["count_new"] / nn / max(1, new.trace_rank_count)})
    out["delta"] = out["new_per_step"] - out["base_per_step"]
    return out.sort_values("delta", key=lambda s: s.abs(), ascending=False, ignore_index=True, kind="stable")


def _metric_row(name: str, unit: str, bvals: np.ndarray, nvals: np.ndarray) -> dict:
    bvals, nvals = np.asarray(bvals, dtype=float), np.asarray(nvals, dtype=float)
    b = float(np.nanmedian(bvals)) if np.isfinite(bvals).any() else math.nan
    n = float(np.nanmedian(nvals)) if np.isfinite(nvals).any() else math.nan
    delta = n - b
    sb, sn = _spread(bvals), _spread(nvals)
    spread = math.nan if math.isnan(sb) or math.isnan(sn) else max(sb, sn)
    nb, nn = int(np.isfinite(bvals).sum()), int(np.isfinite(nvals).sum())
    p = welch_test(bvals, nvals)[2] if min(nb, nn) >= MIN_SAMPLES else math.nan
    rel = (100.0 * delta / abs(b)) if b not in (0.0,) and not math.isnan(b) and not math.isnan(delta) else (
        0.0 if delta == 0 else math.nan)
    # within noise: the test finds no difference (p >= 0.05); unknown noise (too few samples) never is
    within = (not math.isnan(delta)) and not math.isnan(p) and p >= 0.05
    return {"metric": name, "unit": unit, "base": b, "new": n, "delta": delta, "rel_pct": rel,
            "spread": spread, "p_value": p, "within_noise": bool(within),
            "noise": "unknown" if math.isnan(p) else ("within noise" if within else "significant"),
            "steps_base": int(len(bvals)), "steps_new": int(len(nvals)), "samples_base": nb, "samples_new": nn}


def _manifest_metrics(bm: dict | None, nm: dict | None):
    """Run-level metrics of two run dirs: every scalar under `metrics`, plus the loss at the last step
    both runs reached and peak memory (max over ranks, GiB: `peak_memory_gb`, the name rules already use)."""
    if not bm or not nm:
        return []
    mb, mn = bm.get("metrics", {}) or {}, nm.get("metrics", {}) or {}
    b, n = _flat_numbers(mb), _flat_numbers(mn)
    out = [(k, b[k], n[k], run_unit(k)) for k in sorted(set(b) & set(n))]
    lb, ln = mb.get("loss"), mn.get("loss")
    if isinstance(lb, list) and isinstance(ln, list) and lb and ln:
        k = min(len(lb), len(ln)) - 1
        if isinstance(lb[k], (int, float)) and isinstance(ln[k], (int, float)):
            out.append((f"loss_at_step_{k}", float(lb[k]), float(ln[k]), ""))
            out.append(("loss_final", float(lb[k]), float(ln[k]), ""))
    pb, pn = mb.get("peak_memory_bytes"), mn.get("peak_memory_bytes")
    if isinstance(pb, list) and isinstance(pn, list) and pb and pn:
        out.append(("peak_memory_gb", max(pb) / 2**30, max(pn) / 2**30, "GiB"))
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
    return out.reindex(out["delta_wall_ms"].abs().sort_values(ascending=False, kind="stable").index).reset_index(drop=True)


def _diff_kernels(base, new, nb: int, nn: int) -> pd.DataFrame:
    def per(a, n):
        k = _window_gpu(a)
        if k.empty:
            return pd.DataFrame(columns=["kernel", "category", "count", "total_us", "raw"])
        raw = k["name"].astype(str)
        names = raw.map(_norm_cache)
        df = pd.DataFrame({"kernel": names.to_numpy(), "category": k["category"].astype(str).to_numpy(),
                           "dur": k["dur"].to_numpy(), "raw": raw.to_numpy()})
        g = df.groupby(["kernel", "category"], sort=False).agg(size=("dur", "size"), sum=("dur", "sum"),
                                                               raw=("raw", "first")).reset_index()
        g["count"] = g.pop("size") / n / max(1, a.trace_rank_count)
        g["total_us"] = g.pop("sum") / US / n / max(1, a.trace_rank_count)  # dur is ns
        return g

    kb, kn = per(base, nb), per(new, nn)
    kb, kn = kb.rename(columns={"raw": "raw_base"}), kn.rename(columns={"raw": "raw_new"})
    m = kb.merge(kn, on=["kernel", "category"], how="outer", suffixes=("_base", "_new")).fillna(
        {"count_base": 0.0, "count_new": 0.0, "total_us_base": 0.0, "total_us_new": 0.0})
    out = pd.DataFrame({
        "kernel": m["kernel"], "kernel_display": _display(m["raw_base"].fillna(m["raw_new"]).fillna(m["kernel"])),
        "category": m["category"],
        "status": np.where(m["count_base"] == 0, "added", np.where(m["count_new"] == 0, "removed", "changed")),
        "base_count": m["count_base"], "new_count": m["count_new"],
        "base_ms": m["total_us_base"] / US, "new_ms": m["total_us_new"] / US,
    })
    out["delta_ms"] = out["new_ms"] - out["base_ms"]
    return out.reindex(out["delta_ms"].abs().sort_values(ascending=False, kind="stable").index).reset_index(drop=True)


_NORM: dict[str, str] = {}


def _display(names: pd.Series) -> list[str]:
    """Kernel names for people: demangled (C++ symbols such as _ZN7cutlass...) and shortened."""
    vals = [str(v) for v in names]
    try:
        from ..names import display_many
    except ImportError:  # pragma: no cover - names.py is part of the package
        return [C.short_kernel_name(v) for v in vals]
    return [shown for shown, _ in display_many(vals)]


def _norm_cache(name: str) -> str:
    r = _NORM.get(name)
    if r is None:
        r = _NORM[name] = C.normalize_kernel_name(name)
    return r


# --------------------------------------------------------------------------------------- rules

_RULE = re.compile(r"^\s*(?:new\.(?P<new>[A-Za-z_][\w.]*)|delta\(\s*(?P<delta>[A-Za-z_][\w.]*)\s*\)|(?P<bare>[A-Za-z_][\w.]*))"
                   r"\s*(?P<op>>=|<=|>|<)\s*(?P<value>[+-]?\d+(?:\.\d+)?)\s*(?P<pct>%?)\s*$")
ABSOLUTE, CHANGE = "absolute", "change"


@dataclass
class Rule:
    text: str
    metric: str
    op: str
    value: float
    relative: bool  # a change in percent of the base
    form: str = CHANGE  # ABSOLUTE: the new run's value; CHANGE: new - base

    def check(self, result: DiffResult) -> dict[str, Any]:
        """The verdict: the form evaluated, the base and new values, the number compared with the threshold
        (the new value, or the change) and whether the rule tripped, with the noise of the change."""
        rows = result.metrics[result.metrics["metric"] == self.metric]
        if rows.empty:
            known = ", ".join(result.metrics["metric"])
            raise TraceError(None, f"--fail-on {self.text!r}: unknown metric {self.metric!r} (known: {known})")
        r = rows.iloc[0]
        change = r["rel_pct"] if self.relative else r["delta"]
        if self.form == ABSOLUTE:  # a fact about the new run: the base and the noise of the change play no part
            compared = r["new"]
            tripped = _compare(compared, self.op, self.value)
        else:
            compared = change
            no_change = r["delta"] == 0 or _nan(change)
            tripped = bool(_compare(change, self.op, self.value) and not no_change and not r["within_noise"])
        return {"rule": self.text, "form": self.form, "metric": self.metric, "op": self.op, "threshold": self.value,
                "base": _num(r["base"]), "new": _num(r["new"]), "compared": _num(compared),
                "change": _num(change), "unit": "%" if self.relative else r["unit"],
                "metric_unit": r["unit"], "within_noise": bool(r["within_noise"]),
                "samples": [int(r.get("samples_base", 1)), int(r.get("samples_new", 1))],
                "noise": r.get("noise", "unknown"), "p_value": _num(r.get("p_value", math.nan)),
                "tripped": bool(tripped)}


def unevaluated(verdict: dict) -> str | None:
    """Why a rule's verdict could not be reached (a CI gate must not pass on a number it could not compute), None
    when it was: its metric missing on a side it reads, or a change in % from a base of 0."""
    m = verdict["metric"]
    if verdict["new"] is None:
        return f"{m} is unavailable on the new side"
    if verdict.get("form") == ABSOLUTE:
        return None
    if verdict["base"] is None:
        return f"{m} is unavailable on the base side"
    if verdict["compared"] is None:
        return f"{m} is 0 on the base side, so a change in % is undefined: write delta({m}) or new.{m} with a value"
    return None


def _num(v: Any) -> float | None:
    return None if v is None or _nan(float(v)) else float(v)


def _nan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _compare(x: float, op: str, v: float) -> bool:
    if _nan(x):
        return False
    return {">": x > v, ">=": x >= v, "<": x < v, "<=": x <= v}[op]


def parse_rule(text: str) -> Rule:
    """A --fail-on rule (the module docstring's grammar); a malformed one is a TraceError naming it."""
    m = _RULE.match(text)
    if not m:
        raise TraceError(None, f"bad --fail-on rule {text!r}: expected METRIC OP VALUE, e.g. 'step_time>+5%', "
                               "'host_syncs>0' (the new run) or 'delta(host_syncs)>0' (the change)")
    metric = m["new"] or m["delta"] or m["bare"]
    op, value, pct = m["op"], m["value"], m["pct"] == "%"
    if metric not in METRICS and not metric.startswith(("category.", "run.")):
        raise TraceError(None, f"bad --fail-on rule {text!r}: unknown metric {metric!r} "
                               f"(one of {', '.join(METRICS)}, category.<name>, run.<manifest metric>)")
    if m["new"] and pct:
        raise TraceError(None, f"bad --fail-on rule {text!r}: a percentage is a change relative to the base; "
                               f"write delta({metric}){op}{value}% or a value in the metric's unit")
    # a signed number or a percentage reads as a change; an unsigned number as a value ("host_syncs>0")
    form = ABSOLUTE if m["new"] or (m["bare"] and not pct and value[0] not in "+-") else CHANGE
    return Rule(text=text.strip(), metric=metric, op=op, value=float(value), relative=pct, form=form)


def check_rules(result: DiffResult, rules: list[Rule]) -> list[dict[str, Any]]:
    return [r.check(result) for r in rules]

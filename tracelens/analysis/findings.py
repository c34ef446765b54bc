"""Findings: what to fix first, as structured records a person reads and autotune consumes.

Each finding: type, severity (high/medium/low by recoverable share of the step), title (one line),
evidence (numbers and the ops responsible), recoverable_us (an estimate of the time a fix could win,
per rank on average), ranks. Types:
    host_sync           blocking device-to-host syncs issued by an op (e.g. .tolist(), .item(), bincount)
    launch_bound        GPU idle while waiting for the host to launch kernels
    small_kernels       many kernels under the small-kernel threshold (launch overhead dominates)
    sync_wait           ranks waiting inside collectives for the last rank (skew / straggler)
    exposed_comm        communication not overlapped by compute
Severity: recoverable >= 10 % of the span -> high, >= 3 % -> medium, else low.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from . import comm as CM
from . import host as H


def _severity(share: float) -> str:
    return "high" if share >= 0.10 else ("medium" if share >= 0.03 else "low")


def findings(analysis, small_us: float = H.SMALL_KERNEL_US) -> list[dict[str, Any]]:
    a = analysis
    if a.timeline.empty:
        return []
    n_ranks = max(1, a.timeline["rank"].nunique())
    span = float(a.timeline["span_us"].min())  # the shortest rank span: a start-up wait inflates the others
    out: list[dict[str, Any]] = []

    syncs = H.host_syncs(a)
    for _, s in H.sync_summary(syncs).iterrows():
        rec = (s["gpu_idle_caused_us"]) / n_ranks
        out.append({
            "type": "host_sync", "title": f"{s['op']} forces {s['count']} device-to-host sync(s) ({s['call']} via {s['via']})",
            "evidence": {"op": s["op"], "via": s["via"], "call": s["call"], "count": int(s["count"]),
                         "host_blocked_us": round(float(s["host_blocked_us"]), 3),
                         "gpu_idle_caused_us": round(float(s["gpu_idle_caused_us"]), 3), "path": s["path"],
                         "python_stack": s["stack"][:2000]},
            "recoverable_us": rec, "ranks": sorted(set(syncs.loc[syncs["op"] == s["op"], "rank"].astype(int))),
        })

    gaps = H.idle_gaps(a, syncs)
    lb = gaps[gaps["cause"] == "launch-bound"]
    if len(lb):
        by_op = lb.groupby("next_top_op")["dur_us"].sum().sort_values(ascending=False)
        total = float(lb["dur_us"].sum()) / n_ranks
        out.append({
            "type": "launch_bound", "title": f"GPU idle {total / 1e3:.3f} ms per rank waiting for kernel launches",
            "evidence": {"gaps": int(len(lb)), "idle_us_per_rank": round(total, 3),
                         "top_ops": {k: round(float(v), 3) for k, v in by_op.head(8).items()}},
            "recoverable_us": total, "ranks": sorted(lb["rank"].astype(int).unique().tolist()),
        })

    ls = H.launch_stats(a, small_us)
    kpo = H.kernels_per_op(a, small_us)
    if len(ls) and ls["small_share"].mean() >= 0.5 and ls["kernels"].sum() >= 50:
        small_ops = kpo.sort_values("small_kernels", ascending=False).head(8)
        # what fusing them could win: the launch-bound idle time in front of these ops' kernels
        rec = float(lb[lb["next_top_op"].isin(small_ops["top_op"])]["dur_us"].sum()) / n_ranks if len(lb) else 0.0
        out.append({
            "type": "small_kernels",
            "title": f"{100 * ls['small_share'].mean():.0f}% of kernels run under {small_us:g} us "
                     f"({int(ls['small_kernels'].sum())} of {int(ls['kernels'].sum())})",
            "evidence": {"small_share": round(float(ls["small_share"].mean()), 4),
                         "small_time_share": round(float(ls["small_time_share"].mean()), 4),
                         "ops": {r.top_op: int(r.small_kernels) for r in small_ops.itertuples()}},
            "recoverable_us": rec, "ranks": ls["rank"].astype(int).tolist(),
        })

    inst = CM.collective_instances(a)
    if not inst.empty:
        ok = inst[~inst["startup"]]
        for fam, g in ok.groupby("family"):
            wait = float(g["sync_us"].sum()) / n_ranks
            if wait <= 0:
                continue
            strag = g.drop_duplicates(["group", "instance"])["last_rank"].value_counts()
            out.append({
                "type": "sync_wait",
                "title": f"ranks wait {wait / 1e3:.3f} ms per rank in {fam} for the last rank (rank {int(strag.index[0])} "
                         f"last in {100 * strag.iloc[0] / strag.sum():.0f}%)",
                "evidence": {"family": fam, "sync_us_per_rank": round(wait, 3),
                             "comm_us_per_rank": round(float(g["comm_us"].sum()) / n_ranks, 3),
                             "straggler_rank": int(strag.index[0])},
                "recoverable_us": wait, "ranks": sorted(g["rank"].astype(int).unique().tolist()),
            })
        ex = CM.exposed_comm(a, inst)
        exposed = float(ex["exposed_comm_us"].mean()) if len(ex) else 0.0
        if exposed > 0:
            out.append({
                "type": "exposed_comm", "title": f"{exposed / 1e3:.3f} ms per rank of communication not hidden by compute",
                "evidence": {"per_rank": {int(r.rank): round(float(r.exposed_comm_us), 3) for r in ex.itertuples()}},
                "recoverable_us": exposed, "ranks": ex["rank"].astype(int).tolist(),
            })

    for f in out:
        share = f["recoverable_us"] / span if span > 0 else 0.0
        f["severity"] = _severity(share)
        f["recoverable_us"] = round(float(f["recoverable_us"]), 3)
        f["share_of_span"] = round(float(share), 4)
    order = {"high": 0, "medium": 1, "low": 2}
    return sorted(out, key=lambda f: (order[f["severity"]], -f["recoverable_us"]))


def findings_table(items: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame([{k: v for k, v in f.items() if k != "evidence"} | {"evidence": _short(f["evidence"])}
                         for f in items], columns=["severity", "type", "title", "recoverable_us", "share_of_span",
                                                   "ranks", "evidence"])


def _short(ev: dict) -> str:
    parts = []
    for k, v in ev.items():
        if k == "python_stack" or v in ("", None):
            continue
        if isinstance(v, float):
            v = round(v, 3)
        parts.append(f"{k}={v}")
    return "; ".join(parts)[:600]


__all__ = ["findings", "findings_table"]

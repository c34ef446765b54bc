"""Why the late rank was late: what the last rank into a collective did before it arrived, against the others.

A collective starts its transfer when its last rank arrives; the others spin in the kernel meanwhile (on NCCL)
and `tracelens.analysis.comm` counts that as their sync wait. The wait's cause is on the late rank, in the
stretch of its GPU timeline between its previous communication kernel (or the step's start) and this one:
it computed more (a heavier stage, more routed tokens), or its GPU idled waiting for the host (launches, a
blocking sync). For every collective instance with a wait, each rank's stretch is split into GPU work by
kernel category and idle time by cause (`tracelens.analysis.host` gaps: launch-bound, sync, other); the late
rank's excess over the median of the other ranks, part by part, says what made it late. Summed over the
instances a rank was last in, per collective family, the largest excess is the cause the finding names. The
finding also cites the step's critical path across ranks (`tracelens.analysis.critical_path`): how much of it
runs on the late rank and what dominates its segments there. Pure function of the analysis' tables.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .intervals import union

MIN_WAIT_US = 1.0  # an instance whose ranks waited less than this in all is not looked at


def _covered(starts: np.ndarray, ends: np.ndarray, lo: int, hi: int) -> float:
    """ns of [lo, hi) covered by the union of the intervals."""
    if hi <= lo or not len(starts):
        return 0.0
    s = np.clip(starts, lo, hi)
    e = np.clip(ends, lo, hi)
    keep = e > s
    if not keep.any():
        return 0.0
    us, ue = union(s[keep], e[keep])
    return float((ue - us).sum())


def late_rank_causes(analysis, inst: pd.DataFrame | None = None, gaps: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (family, late rank): instances it was last in, the wait it cost the others (µs, summed over
    them), and its excess over the other ranks before arriving, by part (µs, summed over the instances):
    ``parts`` (dict part -> µs), ``cause`` (the largest), ``cause_us``. Empty when no instance waited."""
    a = analysis
    cols = ["family", "late_rank", "instances", "wait_caused_us", "lateness_us", "cause", "cause_us", "parts"]
    if inst is None:
        inst = a.comm_instances()
    if inst is None or inst.empty:
        return pd.DataFrame(columns=cols)
    sw = getattr(a, "window", None)
    ok = inst[~inst["startup"] & inst["cross_rank"]]
    if sw is not None and getattr(sw, "restricts", False):
        ok = ok[ok["step"].isin(sw.used)]
    if ok.empty:
        return pd.DataFrame(columns=cols)
    gpu = a.gpu
    if gaps is None:
        gaps = a.idle_gaps() if hasattr(a, "idle_gaps") else pd.DataFrame(columns=["rank", "start_ns", "end_ns", "cause"])
    # absolute kernel start/end (ns) of every instance row, and each rank's communication kernels in time order
    rows = ok.assign(k_ts=gpu.loc[ok["gpu_row"], "ts"].to_numpy(np.int64),
                     k_end=gpu.loc[ok["gpu_row"], "end"].to_numpy(np.int64))
    comm = gpu[gpu["is_comm"]]
    work = gpu[~gpu["is_comm"]]
    steps = getattr(a, "steps", None)
    by_rank = {}
    for r in rows["rank"].unique():
        r = int(r)
        c = comm[comm["rank"] == r]
        w = work[work["rank"] == r]
        g = gaps[gaps["rank"] == r]
        st = steps[steps["rank"] == r] if steps is not None and len(steps) else None
        by_rank[r] = (np.sort(c["end"].to_numpy(np.int64)), w["ts"].to_numpy(np.int64), w["end"].to_numpy(np.int64),
                      w["category"].astype(str).to_numpy(), g["start_ns"].to_numpy(np.int64),
                      g["end_ns"].to_numpy(np.int64), g["cause"].astype(str).to_numpy(),
                      st["start"].to_numpy(np.int64) if st is not None and "start" in st else np.array([], np.int64))

    def stretch(r: int, k_ts: int) -> dict[str, float]:
        """The rank's GPU time before its kernel starting at k_ts, back to its previous comm kernel's end (or the
        step's start): µs of work per category and idle per cause."""
        ends, ws, we, wc, gs, ge, gc, sst = by_rank[r]
        i = np.searchsorted(ends, k_ts, side="right") - 1
        lo = int(ends[i]) if i >= 0 else 0
        j = np.searchsorted(sst, k_ts, side="right") - 1
        if j >= 0:
            lo = max(lo, int(sst[j]))
        if lo == 0:
            return {}
        out: dict[str, float] = {}
        for cat in np.unique(wc):
            m = wc == cat
            v = _covered(ws[m], we[m], lo, k_ts)
            if v > 0:
                out[f"compute: {cat}"] = v / 1e3
        for cause in np.unique(gc):
            m = gc == cause
            v = _covered(gs[m], ge[m], lo, k_ts)
            if v > 0:
                out[f"idle: {cause}"] = v / 1e3
        return out

    acc: dict[tuple[str, int], dict[str, Any]] = {}
    for key, g in rows.groupby(["group", "peers", "family", "seq", "instance"], sort=False):
        wait = float(g["sync_us"].sum())
        if wait < MIN_WAIT_US or len(g) < 2:
            continue
        late = int(g["last_rank"].iloc[0])
        if late not in set(g["rank"].astype(int)):
            continue
        parts = {int(r.rank): stretch(int(r.rank), int(r.k_ts)) for r in g.itertuples(index=False)}
        others = [p for r, p in parts.items() if r != late]
        keys = set(parts[late]).union(*others) if others else set(parts[late])
        excess = {k: parts[late].get(k, 0.0) - float(np.median([p.get(k, 0.0) for p in others])) for k in keys}
        e = acc.setdefault((str(key[2]), late), {"instances": 0, "wait": 0.0, "late": 0.0, "parts": {}})
        e["instances"] += 1
        e["wait"] += wait
        e["late"] += float(g["skew_us"].max())
        for k, v in excess.items():
            if v > 0:
                e["parts"][k] = e["parts"].get(k, 0.0) + v
    out = []
    for (fam, late), e in acc.items():
        parts = {k: round(v, 3) for k, v in sorted(e["parts"].items(), key=lambda kv: -kv[1])}
        cause = next(iter(parts), None)
        out.append({"family": fam, "late_rank": late, "instances": e["instances"], "wait_caused_us": round(e["wait"], 3),
                    "lateness_us": round(e["late"], 3), "cause": cause, "cause_us": parts.get(cause, 0.0) if cause else 0.0,
                    "parts": parts})
    df = pd.DataFrame(out, columns=cols)
    return df.sort_values("wait_caused_us", ascending=False, kind="stable").reset_index(drop=True)


def _cause_text(cause: str | None) -> str:
    if not cause:
        return "no part of its GPU timeline stands out"
    kind, _, what = cause.partition(": ")
    if kind == "idle":
        return {"launch-bound": "its GPU idled waiting for kernel launches (the host was behind)",
                "sync": "its host was blocked in a device sync, its GPU idle",
                }.get(what, "its GPU idled (no known cause)")
    return f"it computed more {what}"


def _path_text(cause: str) -> str:
    kind, _, what = cause.partition(": ")
    return {"launch-bound": "GPU idle waiting for kernel launches", "host sync": "GPU idle after host syncs",
            "idle": "GPU idle on stream or event dependencies", "wait": "waits it could not follow",
            }.get(kind, f"{what} {kind}" if what else kind)


def cite_path(finding: dict[str, Any], path) -> None:
    """Add to a ``late_rank`` finding what the step's critical path (tracelens.analysis.critical_path) says of its
    rank: the share of the path on it, the cause holding most of its segments there, its ops with the most compute
    on the path (with their stage) and the ranks it was itself waiting for (`evidence.critical_path`, and a clause
    of the title); that the path does not run through it when so."""
    if path is None or not getattr(path, "available", False):
        return
    late = finding["evidence"]["late_rank"]
    rc = path.rank_cause(late)
    if rc is None:
        finding["evidence"]["critical_path"] = {"on_path": False, "share": 0.0}
        finding["title"] += "; the step's critical path does not run through it"
        return
    finding["evidence"]["critical_path"] = {"on_path": True, **{k: rc[k] for k in ("share", "cause", "cause_share",
                                                                                  "top_compute", "waited_for")}}
    finding["title"] += (f"; {100 * rc['share']:.0f}% of the step's critical path is on rank {late}, "
                         f"{100 * rc['cause_share']:.0f}% of that {_path_text(rc['cause'])}")
    if rc["waited_for"]:  # its own earlier waits: the path goes on from the ranks it waited for
        finding["title"] += " (itself waiting for rank " + ", ".join(map(str, rc["waited_for"])) + " before)"


def straggler_finding(analysis, n_ranks: int, inst: pd.DataFrame | None = None,
                      gaps: pd.DataFrame | None = None, path=None) -> dict[str, Any] | None:
    """The rank whose late arrivals cost the others the most waiting, over every collective family, with what
    made it late (type ``late_rank``), or None. `path`: the step's critical path, cited when given (`cite_path`)."""
    t = late_rank_causes(analysis, inst, gaps)
    if t.empty:
        return None
    per = t.groupby("late_rank", sort=False).agg(wait=("wait_caused_us", "sum"), instances=("instances", "sum"))
    late = int(per["wait"].idxmax())
    mine = t[t["late_rank"] == late]
    wait = float(per.at[late, "wait"]) / max(n_ranks, 1)
    if wait <= 0:
        return None
    parts: dict[str, float] = {}
    for p in mine["parts"]:
        for k, v in p.items():
            parts[k] = parts.get(k, 0.0) + float(v)
    parts = {k: round(v, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}
    cause = next(iter(parts), None)
    n = int(per.at[late, "instances"])
    fams = ", ".join(f"{r.family} ({int(r.instances)})" for r in mine.itertuples(index=False))
    cause_us = parts.get(cause, 0.0) / max(n, 1) if cause else 0.0
    out = {
        "type": "late_rank",
        "title": f"rank {late} is last into {fams}, costing {wait / 1e3:.3f} ms per rank of waiting: before arriving "
                 f"{_cause_text(cause)} ({cause_us / 1e3:.3f} ms more than the other ranks per instance)",
        "evidence": {"late_rank": late, "instances": n, "families": mine["family"].tolist(), "cause": cause,
                     "excess_us_by_part": parts, "wait_caused_us_per_rank": round(wait, 3),
                     # the waits this finding claims, per family: the sync_wait findings keep the rest (findings.py)
                     "wait_caused_us_per_rank_by_family": {r.family: round(float(r.wait_caused_us) / max(n_ranks, 1), 3)
                                                           for r in mine.itertuples(index=False)},
                     # a late rank with no known cause (its parts undetermined: e.g. its CPU events were dropped)
                     # has cause None (JSON null), never a float NaN
                     "others": [{"family": r.family, "late_rank": int(r.late_rank), "wait_caused_us": r.wait_caused_us,
                                 "cause": r.cause if isinstance(r.cause, str) else None}
                                for r in t[t["late_rank"] != late].itertuples(index=False)][:4]},
        "recoverable_us": wait, "ranks": [late],
    }
    cite_path(out, path)
    return out


__all__ = ["cite_path", "late_rank_causes", "straggler_finding"]

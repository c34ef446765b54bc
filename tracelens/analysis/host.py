"""Host side: device-to-host syncs, launch latency, why the GPU sat idle, too many small kernels.

- Host syncs: every blocking runtime call (cudaStreamSynchronize, cudaDeviceSynchronize,
  cudaEventSynchronize, synchronous cudaMemcpy, hip*), with the op that issued it (top-level op as
  the program called it, e.g. `aten::to` for `.tolist()`, and the innermost, e.g. `aten::copy_`), its
  record_function / module path, the Python stack when recorded, how long the host was blocked, and
  the GPU idle time it caused: from the sync (or the moment the GPU drained, if later) until the GPU
  ran its next kernel; when several syncs return in one gap, each idle instant counts for the latest sync
  issued before it (the amounts are disjoint: they add up to the idle the syncs caused together).
- Idle gaps on each rank's GPU are classified by what the GPU waited for:
    sync          the gap follows a host sync (the host had to wait, then relaunch)
    launch-bound  the kernel ending the gap was launched by the host after the gap began
    other         it was launched before (stream dependencies, events, another rank)
- Launch latency: runtime launch start -> kernel start.
- Small kernels: share of kernels shorter than a threshold (default 10 us) and the ops launching most.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from .. import categories as C
from . import intervals as I
from .calltree import KIND_RUNTIME
from .grouped import named_agg

US = 1000.0
SMALL_KERNEL_US = 10.0
SYNC_TOLERANCE_NS = 20_000  # GPU draining and the sync returning are not simultaneous on the timeline


def _op_names(tree: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    return np.asarray(C.take_strings(tree["name"], rows, fill="(no op)"), dtype=object)


def host_syncs(analysis) -> pd.DataFrame:
    """One row per blocking sync call issued by the workload."""
    cols = ["rank", "call", "op", "via", "path", "stack", "ts", "host_blocked_us", "gpu_idle_caused_us", "step"]
    t = analysis.tree
    s = t[(t["kind"].to_numpy() == KIND_RUNTIME) & C.isin(t["name"], C.SYNC_RUNTIME) & (t["parent"].to_numpy() >= 0)]
    if s.empty:
        return pd.DataFrame(columns=cols)
    stack = np.full(len(s), "", dtype=object)
    if "call_stack" in analysis.trace.events:
        inner = s["inner_op"].to_numpy()
        ok = inner >= 0
        cs = analysis.trace.events["call_stack"]
        stack[ok] = np.asarray(C.take_strings(cs, inner[ok], fill=""), dtype=object)
    out = pd.DataFrame({
        "rank": s["rank"].to_numpy(), "call": s["name"].astype(str).to_numpy(),
        "op": _op_names(t, s["outer_op"].to_numpy()), "via": _op_names(t, s["inner_op"].to_numpy()),
        "path": s["path"].astype(str).to_numpy(), "stack": stack,
        "ts": s["ts"].to_numpy(), "host_blocked_us": s["dur"].to_numpy() / US,
    })
    end = s["ts"].to_numpy() + s["dur"].to_numpy()
    caused = np.zeros(len(s))
    g = analysis.gpu[["rank", "ts", "end"]]
    for r in np.unique(out["rank"]):
        m = out["rank"].to_numpy() == r
        gr = g[g["rank"] == r]
        if gr.empty:
            continue
        gs, ge = I.gaps(gr["ts"].to_numpy(), gr["end"].to_numpy())
        if not len(gs):  # the GPU's work is one busy stretch (e.g. a single event): no idle gap to cause
            continue
        # the gap during which the sync returned: it began before the sync ended, ended after
        idx = np.searchsorted(gs, end[m] + SYNC_TOLERANCE_NS, side="right") - 1
        ok = (idx >= 0) & (ge[np.maximum(idx, 0)] > end[m])
        i = np.maximum(idx, 0)
        lo = np.maximum(gs[i], s["ts"].to_numpy()[m])
        hi = ge[i].copy()
        # syncs returning in the same gap: each idle instant goes to the latest sync issued before it, so
        # the amounts are disjoint and add up to the union of the idle the syncs caused
        order = np.lexsort((lo, np.where(ok, idx, -1)))
        same = ok[order][1:] & ok[order][:-1] & (idx[order][1:] == idx[order][:-1])
        hi[order[:-1][same]] = np.minimum(hi[order[:-1][same]], lo[order[1:][same]])
        caused[m] = np.where(ok, np.maximum(hi - lo, 0), 0) / US
    out["gpu_idle_caused_us"] = caused
    from .calltree import assign_steps

    out["step"] = assign_steps(out["rank"].to_numpy(), out["ts"].to_numpy(), analysis.steps)
    return out[cols]


def sync_summary(syncs: pd.DataFrame) -> pd.DataFrame:
    cols = ["op", "via", "call", "count", "host_blocked_us", "gpu_idle_caused_us", "path", "stack"]
    if syncs.empty:
        return pd.DataFrame(columns=cols)
    out = named_agg(syncs, ["op", "via", "call"], sort=False, count=("ts", "size"), host_blocked_us=("host_blocked_us", "sum"),
                    gpu_idle_caused_us=("gpu_idle_caused_us", "sum"), path=("path", "first"), stack=("stack", "first"))
    return out.reset_index().sort_values("gpu_idle_caused_us", ascending=False, ignore_index=True, kind="stable")[cols]


_CAUSES = np.array(["sync", "launch-bound", "other"], dtype=object)


def idle_gaps(analysis, syncs: pd.DataFrame | None = None, text_columns: bool = True) -> pd.DataFrame:
    """Every GPU idle gap per rank with its cause and the op whose kernel ended it.

    text_columns=False: cause / next_op / next_top_op as object columns referring to the few distinct
    strings (the same values, not copied per gap into string columns: a 2 GB trace has ~860K gaps,
    -150 MB of peak), for callers that only filter and group them (`findings`)."""
    cols = ["rank", "start_ns", "end_ns", "dur_us", "cause", "next_op", "next_top_op"]
    g = analysis.gpu
    if g.empty:
        return pd.DataFrame(columns=cols)
    syncs = host_syncs(analysis) if syncs is None else syncs
    rows = []
    rank_all = g["rank"].to_numpy()
    ranks = np.unique(rank_all)
    for r in ranks:  # each rank's rows by position: no copy of the GPU table's columns per rank
        at = np.flatnonzero(rank_all == r) if len(ranks) > 1 else np.arange(len(g))
        at = at[np.argsort(g["ts"].to_numpy()[at], kind="stable")]
        ts, end = g["ts"].to_numpy()[at], g["end"].to_numpy()[at]
        run_end = np.maximum.accumulate(end)
        gap_after = np.flatnonzero(ts[1:] > run_end[:-1])  # gap between run_end[i] and ts[i+1]
        if not len(gap_after):
            continue
        gs, ge = run_end[gap_after], ts[gap_after + 1]
        nxt = at[gap_after + 1]  # rows of the GPU events that end the gaps
        del ts, end, run_end, gap_after, at
        sr = syncs[syncs["rank"] == r]
        s_end = np.sort((sr["ts"] + (sr["host_blocked_us"] * US).astype(np.int64)).to_numpy())
        # a sync that returned inside the gap (or just before it began)
        if len(s_end):
            k = np.searchsorted(s_end, ge, side="left") - 1
            after_sync = (k >= 0) & (s_end[np.maximum(k, 0)] >= gs - SYNC_TOLERANCE_NS)
        else:
            after_sync = np.zeros(len(gs), dtype=bool)
        launch = g["launch_ts"].to_numpy()[nxt]
        launched_late = (launch >= 0) & (launch > gs)
        cause = _CAUSES[np.where(after_sync, 0, np.where(launched_late, 1, 2))]
        ops = C.strings(g["op"].iloc[nxt])
        tops = C.strings(g["top_op"].iloc[nxt])
        text = (lambda v: v) if text_columns else (lambda v: pd.Series(v, dtype=object))
        rows.append(pd.DataFrame({"rank": np.full(len(gs), int(r)), "start_ns": gs, "end_ns": ge,
                                  "dur_us": (ge - gs) / US, "cause": text(cause), "next_op": text(ops),
                                  "next_top_op": text(tops)}))
    if not rows:
        return pd.DataFrame(columns=cols)
    # (one rank: its frame as it is, already in column order, rather than a concatenated copy of it)
    return rows[0] if len(rows) == 1 else pd.concat(rows, ignore_index=True)[cols]


def idle_summary(gaps: pd.DataFrame, timeline: pd.DataFrame, cuts: dict | None = None) -> pd.DataFrame:
    """GPU idle per rank and cause over the timeline's window: each gap clipped to its rank's window
    (``timeline.start_ns`` .. ``end_ns``) less the window's cuts (start-up waits, `steps.StepWindow.cuts`),
    so the idle is measured on the same time as ``span_us`` and never exceeds it (a gap of a warm-up step
    or inside a cut is not the window's idle)."""
    cols = ["rank", "cause", "gaps", "idle_us", "pct_of_span"]
    if gaps.empty or timeline.empty:
        return pd.DataFrame(columns=cols)
    tl = timeline.drop_duplicates("rank").set_index("rank")
    rank = gaps["rank"].to_numpy()
    known = pd.Series(rank).isin(tl.index).to_numpy()  # a rank with no timeline row has no window: no idle
    # integer ns throughout: epoch-ns times (~1.8e18) as floats would be rounded to 256 ns
    lo = pd.Series(rank).map(tl["start_ns"]).fillna(0).to_numpy(dtype=np.int64)
    hi = pd.Series(rank).map(tl["end_ns"]).fillna(0).to_numpy(dtype=np.int64)
    s = np.maximum(gaps["start_ns"].to_numpy(dtype=np.int64), lo)
    e = np.minimum(gaps["end_ns"].to_numpy(dtype=np.int64), hi)
    length = np.where(known, np.maximum(e - s, 0), 0)
    for r, ivs in (cuts or {}).items():
        on = rank == r
        for cs, ce in ivs:
            length[on] -= np.maximum(np.minimum(e[on], int(ce)) - np.maximum(s[on], int(cs)), 0)
    length = np.maximum(length, 0)
    kept = gaps.loc[length > 0, ["rank", "cause"]].assign(dur_us=length[length > 0] / US)
    if kept.empty:
        return pd.DataFrame(columns=cols)
    out = named_agg(kept, ["rank", "cause"], gaps=("dur_us", "size"), idle_us=("dur_us", "sum")).reset_index()
    span = out["rank"].map(tl["span_us"])
    out["pct_of_span"] = np.where(span > 0, 100.0 * out["idle_us"] / span, 0.0)
    return out[cols]


def _window_gpu(analysis) -> pd.DataFrame:
    """The GPU events the views read (`Analysis.gpu_window`: those launched in the window's steps, start-up waits
    cut from their durations); the whole GPU table for an analysis without one."""
    g = getattr(analysis, "gpu_window", None)
    return analysis.gpu if g is None else g


def launch_stats(analysis, small_us: float = SMALL_KERNEL_US) -> pd.DataFrame:
    """Per rank: kernels, launch latency percentiles, small-kernel count and shares, over the kernels of the
    analysis window (the steady-state steps by default), as the timeline's `kernel_count` counts them."""
    cols = ["rank", "kernels", "launch_p50_us", "launch_p90_us", "small_kernels", "small_share",
            "small_time_share"]
    g = _window_gpu(analysis)
    is_kernel = (g["kind"] == "kernel").to_numpy()
    rank_all = g["rank"].to_numpy()
    sw = getattr(analysis, "window", None)
    # each kernel's recorded start (a start-up wait cut from the window moves a kernel's start, not its launch)
    start = analysis.gpu["ts"].reindex(g.index).to_numpy() if sw is not None and sw.cuts else g["ts"].to_numpy()
    rows = []
    for r in np.unique(rank_all[is_kernel]).tolist():  # each rank's kernels by position: no copy of the table
        at = np.flatnonzero(is_kernel & (rank_all == r))
        launch = g["launch_ts"].to_numpy()[at]
        linked = launch >= 0
        lat = pd.Series((start[at][linked] - launch[linked]) / US)
        del launch, linked
        dur = g["dur"].to_numpy()[at]
        small = dur < small_us * US
        rows.append({"rank": int(r), "kernels": len(at),
                     "launch_p50_us": float(lat.median()) if len(lat) else np.nan,
                     "launch_p90_us": float(lat.quantile(0.9)) if len(lat) else np.nan,
                     "small_kernels": int(small.sum()), "small_share": float(small.mean()),
                     "small_time_share": float(dur[small].sum() / max(1, dur.sum()))})
    return pd.DataFrame(rows, columns=cols)


def kernels_per_op(analysis, small_us: float = SMALL_KERNEL_US) -> pd.DataFrame:
    """Ops (as called from Python) by how many kernels they launch, and how many are small, over the kernels of
    the analysis window."""
    cols = ["top_op", "kernels", "small_kernels", "gpu_us", "mean_kernel_us"]
    g = _window_gpu(analysis)
    k = g.loc[g["kind"] == "kernel", ["top_op", "dur"]]
    if k.empty:
        return pd.DataFrame(columns=cols)
    # sums per top-op code first (bincount), strings only for the few distinct ops
    code, top = pd.factorize(C.strings(k["top_op"]), sort=False)
    dur = k["dur"].to_numpy()
    n = len(top)
    df = pd.DataFrame({"top_op": np.where(np.asarray(top, dtype=object) == "", "(no op)", np.asarray(top, dtype=object)),
                       "kernels": np.bincount(code, minlength=n),
                       "small_kernels": np.bincount(code, weights=dur < small_us * US, minlength=n).astype(np.int64),
                       "gpu": np.bincount(code, weights=dur, minlength=n)})
    out = df.groupby("top_op").sum().reset_index()  # sorted by name, as before; merges "" into "(no op)"
    out["gpu_us"] = out.pop("gpu") / US
    out["mean_kernel_us"] = out["gpu_us"] / out["kernels"]
    return out.sort_values("kernels", ascending=False, ignore_index=True, kind="stable")[cols]


# ------------------------------------------------------------------------------ the `tracelens host` view


def _records(df: pd.DataFrame) -> list[dict]:
    return json.loads(df.to_json(orient="records"))


@dataclass
class HostReport:
    """The host side of a set of ranks: what `tracelens host` prints and writes with --json, and what the
    report's host sections show. Built by :func:`host_report`."""

    syncs: pd.DataFrame  # host_syncs: one row per blocking sync
    sync_summary: pd.DataFrame  # by the op that issued them
    idle: pd.DataFrame  # idle_summary: GPU idle per rank and cause
    launch: pd.DataFrame  # launch_stats: per rank
    kernels_per_op: pd.DataFrame  # ops by kernels launched
    findings: list[dict[str, Any]]  # ranked findings (tracelens.analysis.findings)
    small_us: float = SMALL_KERNEL_US  # kernels shorter than this count as small

    def to_dict(self) -> dict:
        """The `tracelens host --json` document (docs/host.md); the syncs without their Python stacks."""
        return {"schema_version": 1, "syncs": _records(self.syncs.drop(columns=["stack"])),
                "sync_summary": _records(self.sync_summary), "idle": _records(self.idle),
                "launch": _records(self.launch), "kernels_per_op": _records(self.kernels_per_op),
                "findings": self.findings}

    def to_text(self) -> str:
        """The `tracelens host` text: syncs by op, idle by cause, launch statistics, the ops launching the
        most kernels, then the findings."""
        lines = []
        # the host-sync findings are these syncs: their severity and recoverable time go on the syncs' lines,
        # not on a second list of the same syncs under the findings
        sync_f = {(f["evidence"]["op"], f["evidence"]["via"], f["evidence"]["call"]): f
                  for f in self.findings if f.get("type") == "host_sync"}
        if self.sync_summary.empty:
            lines.append("host syncs: none issued by the workload")
        else:
            lines.append("host syncs (blocking device-to-host), by the op that issued them:")
            for r in self.sync_summary.itertuples(index=False):
                f = sync_f.get((r.op, r.via, r.call))
                tail = "" if f is None else f" [{f['severity']}] recoverable ~{f['recoverable_us'] / 1e3:.3f} ms/rank"
                lines.append(f"  {r.count:>4} x {r.op} (via {r.via}, {r.call}): host blocked {r.host_blocked_us / 1e3:.3f} ms, "
                             f"GPU idle caused {r.gpu_idle_caused_us / 1e3:.3f} ms{tail}")
        for r in self.idle.itertuples(index=False):
            lines.append(f"rank {r.rank}: GPU idle {r.cause:<12} {r.gaps:>6} gaps {r.idle_us / 1e3:>9.3f} ms "
                         f"({r.pct_of_span:.1f}% of span)")
        for r in self.launch.itertuples(index=False):
            lines.append(f"rank {r.rank}: {r.kernels} kernels, launch latency p50 {r.launch_p50_us:.1f} us "
                         f"p90 {r.launch_p90_us:.1f} us, {100 * r.small_share:.0f}% under {self.small_us:g} us "
                         f"({100 * r.small_time_share:.0f}% of kernel time)")
        kpo = self.kernels_per_op.head(5)
        if len(kpo):
            lines.append("ops launching the most kernels: " + "; ".join(
                f"{r.top_op} {r.kernels} ({r.small_kernels} small)" for r in kpo.itertuples(index=False)))
        rest = [f for f in self.findings if f.get("type") != "host_sync"]
        if rest:
            lines.append("findings:")
            for f in rest:
                if f["recoverable_us"] is None:  # an "info" finding: where time goes, no estimate of a fix's gain
                    lines.append(f"  [{f['severity']}] {f['title']} ({100 * f['share_of_span']:.1f}% of the step; "
                                 "no recovery estimate)")
                else:
                    lines.append(f"  [{f['severity']}] {f['title']} (recoverable ~{f['recoverable_us'] / 1e3:.3f} ms/rank)")
        return "\n".join(lines)


def host_report(analysis, small_us: float = SMALL_KERNEL_US) -> HostReport:
    """The host view of an Analysis, from its entries (`host_syncs`, `idle_gaps`, `launch_stats`,
    `kernels_per_op`, `findings`: computed once there for the default threshold)."""
    syncs = analysis.host_syncs()
    return HostReport(syncs=syncs, sync_summary=sync_summary(syncs),
                      idle=idle_summary(analysis.idle_gaps(), analysis.timeline,
                                        analysis.window.cuts if analysis.window is not None else None),
                      launch=analysis.launch_stats(small_us), kernels_per_op=analysis.kernels_per_op(small_us),
                      findings=analysis.findings(small_us), small_us=small_us)

"""Findings: what to fix first, as structured records a person reads and autotune consumes.

Each finding: type, severity (high/medium/low by recoverable share of the step), title (one line),
evidence (numbers and the ops responsible), recoverable_us (an estimate of the time a fix could win,
per rank on average), ranks. Types:
    host_sync           blocking device-to-host syncs issued by an op (e.g. .tolist(), .item(), bincount)
    launch_bound        GPU idle while waiting for the host to launch kernels
    small_kernels       many kernels under the small-kernel threshold (launch overhead dominates)
    sync_wait           ranks waiting inside collectives for the last rank (skew / straggler)
    exposed_comm        communication (the transfer part of communication kernels: tracelens.analysis.waits)
                        not overlapped by compute
    profiler_overhead   (run dirs) the profiled steps ran slower than every unprofiled step: the trace's
                        absolute times are inflated by the profiler (from the manifest's step times)
  Host findings (traces without GPU activity, e.g. the trainer on a CPU; per rank, per step):
    host_hotspot        the op family (GEMM, attention, memory/layout, ... or one op) with the most host
                        self time per step, with its ops
    moe_stages          the MoE layer's stages (`moe/<stage>` record_function ranges) as shares of the step
Recoverable amounts of the host findings are disjoint: each host sync's is the GPU idle it caused (an idle
instant counted for one sync only, tracelens.analysis.host), and small_kernels claims the launch-bound idle
in front of its ops, which the launch_bound finding then leaves out (its title still gives all of it).
Severity: recoverable >= 10 % of the span -> high, >= 3 % -> medium, else low; "info" for findings that
describe where the time goes or how far to trust it without an estimate of what a fix recovers
(recoverable_us is null for them and share_of_span is the share of the step they describe).
All findings read the steady-state steps of the analysis window (tracelens.analysis.steps).
"""

from __future__ import annotations

import re
from typing import Any

import pandas as pd

from .. import categories as C
from . import comm as CM
from . import host as H
from . import steps as S
from . import waits as W
from .grouped import named_agg
from .moe import padding_finding
from .moe_view import routing_tie
from .straggler import MIN_WAIT_US, straggler_finding


def _severity(share: float) -> str:
    return "high" if share >= 0.10 else ("medium" if share >= 0.03 else "low")


def _sync_title(s) -> str:
    """A host-sync finding's title: the op the program called and the innermost op the sync ran in; a sync
    outside any op (in an annotation or module range only) is said so, not named "(no op)"."""
    if s["op"] == "(no op)":
        return f"A call outside any op forces {s['count']} device-to-host sync(s) ({s['call']})"
    return f"{s['op']} forces {s['count']} device-to-host sync(s) ({s['call']} via {s['via']})"


def findings(analysis, small_us: float = H.SMALL_KERNEL_US, *, host_syncs: pd.DataFrame | None = None,
             idle_gaps: pd.DataFrame | None = None, launch_stats: pd.DataFrame | None = None,
             kernels_per_op: pd.DataFrame | None = None, comm_instances: pd.DataFrame | None = None,
             critical_path=None) -> list[dict[str, Any]]:
    """The findings of an analysis (see the module docstring). The keyword arguments are its inputs when
    already computed (the analysis's entries: `idle_gaps` classified against every host sync, with object
    text columns; `launch_stats` / `kernels_per_op` at this `small_us`); each one not given is computed, but
    `critical_path` (tracelens.analysis.critical_path), which the `late_rank` finding cites when given."""
    a = analysis
    extra = _overhead_finding(getattr(a, "manifest", None))
    if a.timeline.empty:
        return _rank(host_findings(a) + extra)
    n_ranks = max(1, a.timeline["rank"].nunique())
    span = float(a.timeline["span_us"].min())  # the shortest rank span: a start-up wait inflates the others
    out: list[dict[str, Any]] = []

    sw = getattr(a, "window", None)
    restricts = sw is not None and sw.restricts
    all_syncs = H.host_syncs(a) if host_syncs is None else host_syncs
    syncs = all_syncs
    if restricts and not syncs.empty:
        syncs = syncs[syncs["step"].isin(sw.used)]
    for _, s in H.sync_summary(syncs).iterrows():
        rec = (s["gpu_idle_caused_us"]) / n_ranks
        out.append({
            "type": "host_sync", "title": _sync_title(s),
            "evidence": {"op": s["op"], "via": s["via"], "call": s["call"], "count": int(s["count"]),
                         "host_blocked_us": round(float(s["host_blocked_us"]), 3),
                         "gpu_idle_caused_us": round(float(s["gpu_idle_caused_us"]), 3), "path": s["path"],
                         "python_stack": s["stack"][:2000]},
            "recoverable_us": rec, "ranks": sorted(set(syncs.loc[syncs["op"] == s["op"], "rank"].astype(int))),
        })

    # gaps classified against the window's syncs: those against every sync when the window drops none
    if idle_gaps is not None and len(syncs) == len(all_syncs):
        gaps = idle_gaps
    else:
        gaps = H.idle_gaps(a, syncs, text_columns=False)  # filtered and grouped only: no per-gap string columns
    if restricts and not gaps.empty:  # idle inside the window's GPU extent of each rank
        ext = a.timeline.set_index("rank")
        lo, hi = gaps["rank"].map(ext["start_ns"]), gaps["rank"].map(ext["end_ns"])
        gaps = gaps[(gaps["start_ns"] >= lo) & (gaps["end_ns"] <= hi)]
    # (the three columns read, not a copy of every column of the launch-bound gaps: ~3M gaps at 8 GB)
    lb = gaps.loc[(gaps["cause"] == "launch-bound").to_numpy(), ["rank", "dur_us", "next_top_op"]]
    del gaps
    if len(lb):
        by_op = lb.groupby("next_top_op")["dur_us"].sum().sort_values(ascending=False, kind="stable")
        total = float(lb["dur_us"].sum()) / n_ranks
        out.append({
            "type": "launch_bound", "title": f"GPU idle {total / 1e3:.3f} ms per rank waiting for kernel launches",
            "evidence": {"gaps": int(len(lb)), "idle_us_per_rank": round(total, 3),
                         "top_ops": {k: round(float(v), 3) for k, v in by_op.head(8).items()}},
            "recoverable_us": total, "ranks": sorted(lb["rank"].astype(int).unique().tolist()),
        })

    ls = H.launch_stats(a, small_us) if launch_stats is None else launch_stats
    kpo = H.kernels_per_op(a, small_us) if kernels_per_op is None else kernels_per_op
    if len(ls) and ls["small_share"].mean() >= 0.5 and ls["kernels"].sum() >= 50:
        small_ops = kpo.sort_values("small_kernels", ascending=False, kind="stable").head(8)
        # what fusing them could win: the launch-bound idle time in front of these ops' kernels; that idle
        # is counted here and no longer in the launch-bound finding's recoverable time (disjoint amounts)
        rec = float(lb[lb["next_top_op"].isin(small_ops["top_op"])]["dur_us"].sum()) / n_ranks if len(lb) else 0.0
        lbf = next((f for f in out if f["type"] == "launch_bound"), None)
        if lbf is not None and rec > 0:
            lbf["recoverable_us"] = max(lbf["recoverable_us"] - rec, 0.0)
            lbf["evidence"]["small_kernel_ops_us_per_rank"] = round(rec, 3)
            lbf["title"] += f" ({rec / 1e3:.3f} ms of it before the small-kernel ops: counted under small kernels)"
        out.append({
            "type": "small_kernels",
            "title": f"{100 * ls['small_share'].mean():.0f}% of kernels run under {small_us:g} us "
                     f"({int(ls['small_kernels'].sum())} of {int(ls['kernels'].sum())})",
            "evidence": {"small_share": round(float(ls["small_share"].mean()), 4),
                         "small_time_share": round(float(ls["small_time_share"].mean()), 4),
                         "ops": {r.top_op: int(r.small_kernels) for r in small_ops.itertuples()}},
            "recoverable_us": rec, "ranks": ls["rank"].astype(int).tolist(),
        })

    inst_all = CM.collective_instances(a) if comm_instances is None else comm_instances
    inst = inst_all[inst_all["step"].isin(sw.used)] if restricts and not inst_all.empty else inst_all
    pad = padding_finding(a)
    if pad is not None:
        out.append(pad)
    bubble = _pipeline_bubble(a)
    p2p_wait: dict[int, float] = {}  # per rank, µs: waits in point-to-point kernels of a pipeline (its bubble)
    if bubble is not None:
        out.append(bubble)
    if not inst.empty:
        ok = inst[~inst["startup"] & inst["cross_rank"]]  # sync wait needs every rank of the group
        kw = a.comm_waits() if hasattr(a, "comm_waits") else None
        if bubble is not None and kw is not None and (kw["kind"] == "pipeline").any():
            # a pipeline stage waiting for its neighbour spins in its receive (NCCL): that wait is the bubble the
            # pipeline finding accounts for (schedule + imbalance), not communication (tracelens.analysis.waits)
            pw = W.rank_waits(kw, sw.used if restricts else None).set_index("rank")["pipeline_wait_us"]
            p2p_wait = {int(r): float(v) for r, v in pw.items() if v > 0}
            bubble["evidence"]["p2p_wait_us_per_rank"] = {r: round(v, 3) for r, v in p2p_wait.items()}
        late = straggler_finding(a, n_ranks, inst=inst_all[inst_all["family"] != "p2p"] if bubble is not None
                                 else inst_all, gaps=idle_gaps, path=critical_path)
        if late is not None:
            out.append(late)
            tie = routing_tie(a, late["evidence"]["late_rank"])  # the run's routing counts, when it has them
            if tie is not None:
                late["evidence"]["moe_routing"] = tie
                late["title"] += "; " + tie["text"].split(": ", 1)[1]
            lb = next((f for f in out if f["type"] == "launch_bound"), None)
            if lb is not None and late["evidence"]["cause"] == "idle: launch-bound":
                # the same mechanism seen from the other ranks: say it where the launch-bound idle is named
                lb["title"] += (f"; on rank {late['evidence']['late_rank']} it makes the other ranks wait "
                                f"{late['recoverable_us'] / 1e3:.3f} ms per rank in collectives")
                lb["evidence"]["late_rank"] = late["evidence"]["late_rank"]
        # each wait is counted once: the late_rank finding claims the waits its rank caused (with their cause), and
        # each family's sync_wait keeps the rest, the waits for the other ranks that arrived last
        late_rank = late["evidence"]["late_rank"] if late is not None else None
        claimed = late["evidence"]["wait_caused_us_per_rank_by_family"] if late is not None else {}
        for fam, g in ok.groupby("family"):
            wait = float(g["sync_us"].sum()) / n_ranks
            if wait <= 0 or (fam == "p2p" and bubble is not None):
                continue
            by_late = float(claimed.get(fam, 0.0))
            left = g[g["last_rank"] != late_rank] if by_late else g  # the instances another rank was last in
            rest = wait - by_late
            if by_late and (left.empty or rest < MIN_WAIT_US):
                continue  # every wait of the family is the late rank's (sub-µs instances aside)
            strag = left.drop_duplicates(["group", "peers", "seq"])["last_rank"].value_counts()
            out.append({
                "type": "sync_wait",
                "title": f"ranks wait {rest / 1e3:.3f} ms per rank in {fam} for the last rank (rank {int(strag.index[0])} "
                         f"last in {100 * strag.iloc[0] / strag.sum():.0f}%)"
                         + (f", besides the {by_late / 1e3:.3f} ms rank {late_rank} causes (its late_rank finding)"
                            if by_late else ""),
                "evidence": {"family": fam, "sync_us_per_rank": round(wait, 3),
                             "comm_us_per_rank": round(float(g["comm_us"].sum()) / n_ranks, 3),
                             "straggler_rank": int(strag.index[0]),
                             **({"late_rank": late_rank, "late_rank_us_per_rank": round(by_late, 3)} if by_late else {})},
                "recoverable_us": rest, "ranks": sorted(left["rank"].astype(int).unique().tolist()),
            })
        # exposed comm over the window: the steady timeline's (start-up steps are not in it), else the whole
        # window's; both count only the transfer part of each communication kernel: a rank spinning in a
        # collective until its last peer arrives is waiting, not communicating (tracelens.analysis.waits), and
        # those waits are the findings above (sync_wait, late_rank; on a pipeline its receives' waits are the bubble)
        tl = a.timeline if restricts or a.timeline_all is None else a.timeline_all
        cols = ["rank", "comm_us", "exposed_comm_us"] + [c for c in ("comm_wait_us", "pipeline_wait_us") if c in tl]
        ex = tl[cols]
        ex = ex[ex["comm_us"] > 0]
        exposed = float(ex["exposed_comm_us"].mean()) if len(ex) else 0.0
        waited = "comm_wait_us" in ex and bool(((ex["comm_wait_us"] > 0) | (ex["pipeline_wait_us"] > 0)).any())
        if exposed > 0:
            out.append({
                "type": "exposed_comm", "title": f"{exposed / 1e3:.3f} ms per rank of communication not hidden by compute"
                         + (" (waits for other ranks left out)" if waited else ""),
                "evidence": {"per_rank": {int(r.rank): round(float(r.exposed_comm_us), 3) for r in ex.itertuples()},
                             **({"wait_us_per_rank": {int(r.rank): round(float(r.comm_wait_us), 3) for r in ex.itertuples()},
                                 "pipeline_wait_us_per_rank": {int(r.rank): round(float(r.pipeline_wait_us), 3)
                                                               for r in ex.itertuples()}} if waited else {})},
                "recoverable_us": exposed, "ranks": ex["rank"].astype(int).tolist(),
            })

    for f in out:
        share = f["recoverable_us"] / span if span > 0 else 0.0
        f["severity"] = _severity(share)
        f["recoverable_us"] = round(float(f["recoverable_us"]), 3)
        f["share_of_span"] = round(float(share), 4)
    return _rank(out + extra)


def _pipeline_bubble(a) -> dict[str, Any] | None:
    """The pipeline's bubble as a finding (None without a pipeline account): per rank and step, the schedule's
    fill and drain (theory) plus the waits on slower stages (stage imbalance), from the bubble account of
    `tracelens.analysis.pipeline` (what ppvis shows), over the account's steps (the traced ones when any)."""
    acc = getattr(getattr(getattr(a, "pipeline", None), "account", None), "per_rank", None)
    account = getattr(getattr(a, "pipeline", None), "account", None)
    if acc is None or acc.empty or not {"rank", "theory_ns", "imbalance_ns"} <= set(acc.columns):
        return None
    n_steps = max(len(account.steps), 1)
    theory = acc.set_index("rank")["theory_ns"].astype(float) / 1e3 / n_steps
    imb = acc.set_index("rank")["imbalance_ns"].astype(float) / 1e3 / n_steps
    total = theory + imb
    if not (total > 0).any():
        return None
    bal = getattr(a.pipeline, "balance", None)
    slow = getattr(bal, "slowest_stage", None)
    ratio = getattr(bal, "slowest_ratio", None)
    imb_txt = f"stage imbalance {imb.mean() / 1e3:.3f} ms"
    if slow is not None and ratio is not None and ratio == ratio:
        imb_txt += f" (stage {int(slow)} is {float(ratio):.2f}x the mean)"
    return {
        "type": "pipeline_bubble",
        "title": f"pipeline bubble {total.mean() / 1e3:.3f} ms per rank per step: schedule {theory.mean() / 1e3:.3f} ms "
                 f"+ {imb_txt}",
        "evidence": {"theory_us_per_rank": {int(r): round(float(v), 3) for r, v in theory.items()},
                     "imbalance_us_per_rank": {int(r): round(float(v), 3) for r, v in imb.items()},
                     "steps": [int(x) for x in account.steps], "schedule": getattr(a.pipeline.meta, "schedule", None)},
        "recoverable_us": float(total.mean()), "ranks": [int(r) for r in total.index],
    }


_ORDER = {"high": 0, "medium": 1, "low": 2, "info": 3}


def _rank(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(items, key=lambda f: (_ORDER[f["severity"]], -(f["recoverable_us"] or 0.0), -f["share_of_span"]))


# op families for host self time: the launching-op rules of the kernel categories, else the op itself
_OP_FAMILIES = [(cat, op_re) for cat, _, op_re in C._RULES if op_re is not None] + [
    ("elementwise", re.compile(r"^aten::(add|sub|mul|div|neg|exp|log|pow|sqrt|rsqrt|sigmoid|tanh|silu|gelu|relu|"
                               r"where|clamp|lerp|addcmul|addcdiv|_foreach_\w+)_?$", re.IGNORECASE)),
    ("view/shape", re.compile(r"^aten::(view|reshape|_reshape_alias|permute|transpose|t|expand|squeeze|unsqueeze|"
                              r"as_strided|slice|select|narrow|split|chunk|unbind|flatten|_unsafe_view|detach|alias)$",
                              re.IGNORECASE)),
]


def op_family(name: str) -> str:
    """The family an op's host time is grouped under (see _OP_FAMILIES); the op's own name otherwise."""
    for fam, rx in _OP_FAMILIES:
        if rx.search(name):
            return fam
    return name


def host_findings(a) -> list[dict[str, Any]]:
    """Findings from host time alone (traces without GPU activity): per rank, per step of the window."""
    out: list[dict[str, Any]] = []
    top = S.host_top_ops(a, top=10_000)
    if top.empty:
        return out
    top = top.assign(family=[op_family(o) for o in top["op"]])
    fam = named_agg(top, ["rank", "family"], sort=False, us=("self_us_per_step", "sum"),
                    share=("share_of_step", "sum")).reset_index()
    mean = fam.groupby("family")[["us", "share"]].mean().sort_values("us", ascending=False, kind="stable")
    name = str(mean.index[0])
    ranks = sorted(fam.loc[fam["family"] == name, "rank"].astype(int).tolist())
    ops = (top[top["family"] == name].groupby("op")["self_us_per_step"].mean().sort_values(ascending=False, kind="stable").head(6))
    share = float(mean["share"].iloc[0])
    if share == share and share < 0.01:  # under 1 % of the step: not where the host time goes
        return out
    label = name if name in ops.index and len(ops) == 1 else f"{name} ops"
    share_txt = f"{100 * share:.0f}% of the host step time" if share == share else "the most host self time"
    per_rank = fam[fam["family"] == name].set_index("rank")
    out.append({
        "type": "host_hotspot", "severity": "info",
        "title": f"{label} take {share_txt} ({float(mean['us'].iloc[0]) / 1e3:.3f} ms per step per rank, "
                 f"self time): the largest op family on the host",
        "evidence": {"family": name, "ops_us_per_step": {k: round(float(v), 3) for k, v in ops.items()},
                     "per_rank_us_per_step": {int(r): round(float(v), 3) for r, v in per_rank["us"].items()},
                     "per_rank_share": {int(r): round(float(v), 4) for r, v in per_rank["share"].items()},
                     "next_families": {str(k): round(float(v), 3) for k, v in mean["us"].iloc[1:4].items()}},
        "recoverable_us": None, "share_of_span": round(share if share == share else 0.0, 4), "ranks": ranks,
    })
    st = S.moe_stage_table(a)
    if not st.empty:
        per = st.groupby("stage")[["host_us_per_step", "share_of_step", "calls_per_step"]].mean()
        per = per.sort_values("host_us_per_step", ascending=False, kind="stable")
        total = float(per["share_of_step"].sum())
        parts = ", ".join(f"{k} {100 * v:.0f}%" for k, v in per["share_of_step"].items())
        out.append({
            "type": "moe_stages", "severity": "info",
            "title": f"MoE layer stages take {100 * total:.0f}% of the host step ({parts}); "
                     f"{per.index[0]} is the largest",
            "evidence": {"stages_us_per_step": {k: round(float(v), 3) for k, v in per["host_us_per_step"].items()},
                         "stages_share_of_step": {k: round(float(v), 4) for k, v in per["share_of_step"].items()},
                         "calls_per_step": {k: round(float(v), 2) for k, v in per["calls_per_step"].items()},
                         "note": "record_function ranges cover what runs inside them on the host (the forward "
                                 "pass; backward work runs outside them)"},
            "recoverable_us": None, "share_of_span": round(total, 4), "ranks": sorted(st["rank"].astype(int).unique().tolist()),
        })
    return out


def _overhead_finding(manifest: dict | None) -> list[dict[str, Any]]:
    o = S.profiler_overhead(manifest)
    if not o or not o["beyond_noise"] or o["overhead"] is None:
        return []
    return [{
        "type": "profiler_overhead", "severity": "info",
        "title": f"the profiled steps ran {100 * o['overhead']:+.0f}% vs unprofiled ones (median "
                 f"{o['profiled_median_us'] / 1e3:.1f} ms vs {o['unprofiled_median_us'] / 1e3:.1f} ms, every profiled step "
                 f"slower than every unprofiled one): absolute times in this trace are inflated by the profiler",
        "evidence": o, "recoverable_us": None, "share_of_span": round(float(o["overhead"]), 4), "ranks": [],
    }]


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

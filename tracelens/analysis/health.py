"""Trace health: what in the input limits which figures a user can trust.

`health_checks(analysis, run)` is a pure function over the loaded trace's tables (and the run manifest
when there is one) returning one row per finding:

    check        what was checked (the ids in CHECKS)
    severity     "error"   a figure the report shows is wrong or unfounded (impossible clock order,
                           ranks that are not who the files say, a run that did not finish)
                 "warning" some figures are partial or polluted (missing ranks, unlinked kernels,
                           no shapes, start-up waits, partial steps, profiler overhead beyond the noise)
                 "info"    worth knowing; nothing shown is wrong (or: a check that could not run, and why)
    ranks        the ranks concerned ([] for the whole set)
    found        what was found, with the numbers
    invalidates  which figures not to trust because of it
    numbers      the figures behind `found` (a dict, for machines)

Every rule is a mechanism, not a threshold fitted to a trace: a collective that began before a peer
was profiling (start-up wait); a synchronizing collective that ended on one rank before it began on
another (clock skew; nothing can end before the data it needs was sent); a launch whose GPU activity is
absent; a profiled step slower than every unprofiled step of the run (profiler overhead beyond the
run's own spread). The only tolerance is the trace's timestamp resolution (1 µs).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .. import categories as C

SEVERITIES = ("error", "warning", "info")
COLUMNS = ["check", "severity", "ranks", "found", "invalidates", "numbers"]
TS_RESOLUTION_US = 1.0  # Chrome-trace timestamps are microseconds; some traces keep only whole ones

CHECKS: dict[str, str] = {
    "incomplete_run": "the run manifest says the run finished (and exists for a run dir)",
    "missing_ranks": "every rank of the world and of each process group was loaded",
    "rank_identity": "each file's rank agrees with its name and with the trace's own point-to-point records",
    "load_issues": "the loader kept every event as written (nothing dropped, clamped or replaced)",
    "unlinked_kernels": "every GPU event is linked to the runtime call / op that launched it",
    "dropped_gpu_events": "every kernel launch has its GPU activity in the trace",
    "record_shapes": "ops carry input shapes (record_shapes=True)",
    "with_stack": "ops carry Python stacks (with_stack=True)",
    "partial_steps": "every profiler step is whole on every rank",
    "startup_wait": "no collective waited for a rank that had not started profiling",
    "clock_skew": "the ranks' clocks agree (no collective ends on one rank before it began on another)",
    "profiler_overhead": "profiled steps are as fast as unprofiled ones (run manifest step times)",
}

# kernel launches only: a cudaMemsetAsync/cudaMemcpyAsync need not leave a GPU event (real traces have
# hundreds without one), so their absence proves nothing
_LAUNCH_RE = re.compile(r"LaunchKernel|LaunchCooperativeKernel|ModuleLaunchKernel|ExtLaunchKernel|cuLaunchKernel|"
                        r"GraphLaunch", re.IGNORECASE)


def _is_launch(name: str) -> bool:
    """A kernel-launch runtime call. False on every step marker "ProfilerStep#N" (`categories.map_strings`'
    on_markers): each alternative of _LAUNCH_RE holds an 'a', which no marker has in any case."""
    return bool(_LAUNCH_RE.search(name))


def _is_p2p_name(name: str) -> bool:
    """A point-to-point annotation ('nccl:send ...', 'nccl:recv ...'); False on every step marker."""
    return name.startswith(("nccl:send", "nccl:recv"))


_SEND_RE = re.compile(r"^nccl:send\s+(\d+)\s*->\s*(\d+)")
_RECV_RE = re.compile(r"^nccl:recv\s+(\d+)\s*<-\s*(\d+)")
_NOT_DONE = {"running", "incomplete", "failed", "killed", "crashed", "aborted", "interrupted", "started"}


# ------------------------------------------------------------------------------------ the run


def run_context(trace) -> dict[str, Any]:
    """Where the traces came from: {"run_dir", "manifest", "manifest_problem"}, from `Trace.run` (read when the
    trace was loaded; this module opens no file). A run dir is RUN when every rank file sits in RUN/traces/."""
    out: dict[str, Any] = {"run_dir": None, "manifest": None, "manifest_problem": None}
    run = getattr(trace, "run", None)
    if run is None or run.trace_dir is None or run.trace_dir.name != "traces":
        return out
    out["run_dir"] = str(run.root or run.trace_dir.parent)
    out["manifest"] = run.manifest
    out["manifest_problem"] = run.manifest_problem
    return out


# ------------------------------------------------------------------------------------ checks


def health_checks(analysis, run: dict | None = None, inst: pd.DataFrame | None = None,
                  kern: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every check over an `Analysis` (see the module docstring); `run` is `run_context(trace)` (None: no
    run dir); `inst` / `kern` the comm instances and comm-kernel rows when already computed (the analysis's
    entries). Rows sorted by severity."""
    from . import comm as CM

    run = run or {}
    rows: list[dict] = []

    def add(check, severity, ranks, found, invalidates, **numbers):
        rows.append({"check": check, "severity": severity, "ranks": sorted(int(r) for r in ranks), "found": found,
                     "invalidates": invalidates, "numbers": _plain(numbers)})

    trace = analysis.trace
    if kern is None:
        kern = CM.comm_kernels(analysis)
    if inst is None:
        inst = CM.collective_instances(analysis, kern)
    _incomplete_run(run, add)
    _missing_ranks(analysis, inst, kern, run, add)
    _rank_identity(trace, analysis, add)
    _load_issues(trace, add)
    _linking(analysis, add)
    _shapes_and_stacks(analysis, add)
    _partial_steps(analysis, add)
    _startup_waits(analysis, inst, add)
    _clock_skew(analysis, inst, add)
    _profiler_overhead(run.get("manifest"), add)
    df = pd.DataFrame(rows, columns=COLUMNS)
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return df.sort_values("severity", key=lambda s: s.map(order), kind="stable", ignore_index=True)


def health_summary(df: pd.DataFrame) -> dict[str, Any]:
    """summary.json's `health`: counts per severity, the worst severity, and every row."""
    counts = {s: int((df["severity"] == s).sum()) for s in SEVERITIES}
    worst = next((s for s in SEVERITIES if counts[s]), "clean")
    return {"worst": worst, "counts": counts, "checks": records(df)}


def records(df: pd.DataFrame) -> list[dict]:
    return [{c: r[c] for c in COLUMNS} for r in df.to_dict("records")]


def exit_status(df: pd.DataFrame, fail_on: str = "error") -> int:
    """CI exit status: 1 when a row is at least as severe as `fail_on` ("error", "warning"; "never": 0)."""
    if fail_on == "never":
        return 0
    levels = SEVERITIES[: SEVERITIES.index(fail_on) + 1]
    return 1 if df["severity"].isin(levels).any() else 0


def _plain(v):
    """numbers as JSON-ready Python values."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [_plain(x) for x in v]
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return None if f != f else round(f, 6)
    if isinstance(v, np.bool_):
        return bool(v)
    return v


def _ms(us: float) -> str:
    return f"{us / 1e3:.3f} ms"


def _list(xs, n=12) -> str:
    xs = list(xs)
    return ", ".join(str(x) for x in xs[:n]) + (f", … ({len(xs)} in all)" if len(xs) > n else "")


def _incomplete_run(run: dict, add) -> None:
    m = run.get("manifest")
    if run.get("run_dir") and run.get("manifest_problem"):
        add("incomplete_run", "warning", [], f"{run['manifest_problem']}: cannot tell whether the run finished or "
            "which ranks it profiled", "run-level figures (tokens/s, MFU, step times) and the completeness of the rank set",
            run_dir=run["run_dir"])
        return
    if not m:
        return
    status = m.get("status")
    flags = []
    if isinstance(status, str) and status.strip().lower() in _NOT_DONE:
        flags.append(f"status {status!r}")
    for key in ("complete", "completed", "finished"):
        if m.get(key) is False:
            flags.append(f"{key}: false")
    if m.get("incomplete") is True:
        flags.append("incomplete: true")
    if flags:
        add("incomplete_run", "error", [], f"the run manifest says the run did not finish ({', '.join(flags)})",
            "everything: the traces may stop mid-step, ranks may be missing, run metrics are partial",
            run_dir=run.get("run_dir"), status=status)


def _missing_ranks(analysis, inst, kern, run, add) -> None:
    from . import comm as CM

    trace = analysis.trace
    loaded = sorted(trace.rank_ids)
    world = CM._world_size(trace)
    m = run.get("manifest") or {}
    mw = m.get("world_size")
    if world is None and isinstance(mw, int) and not isinstance(mw, bool) and mw > 0:
        world = mw
    cross = ("cross-rank figures: sync wait, comm time, skew, last rank, stragglers, bus bandwidth; "
             "totals or means over 'all ranks'")
    if world and len(loaded) < world:
        missing = sorted(set(range(world)) - set(loaded))
        add("missing_ranks", "warning", missing,
            f"{len(loaded)} of {world} ranks loaded (ranks {_list(loaded)}); missing ranks {_list(missing)}",
            cross, world_size=world, loaded=loaded, missing=missing)
    elif world is None and len(loaded) == 1 and not inst.empty:
        add("missing_ranks", "info", loaded, "one rank loaded and the trace does not say its world size: whether other "
            "ranks exist cannot be checked", cross, loaded=loaded)
    prof = m.get("profile") if isinstance(m.get("profile"), dict) else {}
    listed = prof.get("traces") if isinstance(prof.get("traces"), list) else None
    if listed is not None and run.get("run_dir"):
        have = {Path(r.path).resolve() for r in trace.ranks}
        absent = [t for t in listed if isinstance(t, str) and (Path(run["run_dir"]) / t).resolve() not in have]
        if absent:
            add("missing_ranks", "warning", [], f"the run manifest lists {len(listed)} trace file(s); "
                f"{len(absent)} not loaded: {_list(absent, 6)}", cross, listed=listed, not_loaded=absent)
    if inst.empty:
        return
    cov = CM.group_coverage(analysis, inst, kern)
    world_missing = set(range(world)) - set(loaded) if world else set()
    for r in cov[~cov["complete"]].itertuples(index=False):
        miss = r.ranks_missing
        if world_missing and (r.group == "default" or (isinstance(miss, list) and set(miss) <= world_missing)):
            continue  # the world-level row says it
        name = f"process group {r.group}" + (f" (peers {r.peers})" if r.peers else "")
        what = (f"rank(s) {_list(miss)} of it not loaded" if isinstance(miss, list)
                else f"{miss} of its {r.group_size} ranks not loaded")
        add("missing_ranks", "warning", miss if isinstance(miss, list) else [],
            f"{name}: {what}; {r.instances} collective instance(s) have per-rank figures only", cross,
            group=r.group, group_size=r.group_size, ranks_loaded=r.ranks_loaded, instances=r.instances)


def _self_rank_evidence(analysis) -> dict[int, set[int]]:
    """loaded rank -> the global ranks its own point-to-point annotations name as the recording rank
    ('nccl:send A->B' is recorded by A, 'nccl:recv B<-A' by B)."""
    ev = analysis.trace.events
    if ev.empty:
        return {}
    is_p2p = C.map_strings(ev["name"], _is_p2p_name, on_markers=False)
    sub = ev.loc[is_p2p, ["rank", "name"]]
    out: dict[int, set[int]] = {}
    for (rank, name), _ in sub.groupby(["rank", "name"], observed=True):
        m = _SEND_RE.match(str(name)) or _RECV_RE.match(str(name))
        if m:
            out.setdefault(int(rank), set()).add(int(m.group(1)))
    return out


def _rank_identity(trace, analysis, add) -> None:
    from ..trace import _rank_from_name

    evidence = _self_rank_evidence(analysis)
    inv = "per-rank rows (which GPU is which), stragglers, last rank, pipeline stage assignment"
    for info in trace.ranks:
        dist = info.distributed_info.get("rank") if isinstance(info.distributed_info, dict) else None
        named = _rank_from_name(info.path) if len(trace.ranks) > 1 else None
        seen = evidence.get(info.rank, set())
        if seen and seen != {info.rank}:
            add("rank_identity", "error", [info.rank], f"{info.path} is analyzed as rank {info.rank}, but its own "
                f"point-to-point records were made by rank {_list(sorted(seen))}"
                + (f" (distributedInfo says {dist}, the file name {named})" if dist is not None or named is not None else ""),
                inv, file=info.path, assigned=info.rank, p2p_self=sorted(seen), distributed_info_rank=dist,
                name_rank=named)
        elif isinstance(dist, int) and named is not None and named != dist:
            agree = f"; its point-to-point records agree with rank {info.rank}" if seen == {info.rank} else ""
            add("rank_identity", "warning", [info.rank], f"{info.path}: the file name says rank {named}, distributedInfo "
                f"says rank {dist}; analyzed as rank {info.rank}{agree}", inv, file=info.path, assigned=info.rank,
                distributed_info_rank=dist, name_rank=named)


def _load_issues(trace, add) -> None:
    issues = getattr(trace, "load_issues", None)
    if issues is None or issues.empty:
        return
    for r in issues.itertuples(index=False):
        if r.check == "rank_name_mismatch":
            continue  # rank_identity says it, with the trace's own evidence
        if r.check in ("cache_entry", "cache_dir"):  # the cache, not the trace: the figures come from the file
            add("load_issues", "info", [r.rank], str(r.message), "nothing (the file itself was parsed)", file=r.file,
                kind=r.check, action=r.action, events=r.events)
            continue
        add("load_issues", "warning", [r.rank], str(r.message), "figures that include the affected events "
            "(see `found`)", file=r.file, kind=r.check, action=r.action, events=r.events)


def _linking(analysis, add) -> None:
    g = analysis.gpu
    if g.empty:
        return
    from .steps import pre_window_mask

    unlinked = (g["launch"].to_numpy() < 0) & (g["op_row"].to_numpy() < 0)
    queued = pre_window_mask(g, analysis.tree)  # launched before the trace's first recorded launch
    for rank, sub in g.groupby("rank"):
        on = g["rank"].to_numpy() == rank
        m = unlinked[on]
        if m.any():
            n, us = int(m.sum()), float(sub["dur"].to_numpy()[m].sum()) / 1e3
            tot = float(sub["dur"].sum()) / 1e3
            k = int((m & queued[on]).sum())
            why = ("" if not k else "; all of them were queued before profiling began (their launches precede the "
                   "trace)" if k == n else f"; {k} of them were queued before profiling began (their launches "
                   "precede the trace)")
            add("unlinked_kernels", "warning", [rank], f"rank {rank}: {n} of {len(sub)} GPU events ({_ms(us)}, "
                f"{100 * us / tot if tot else 0:.1f}% of GPU event time) have no launching runtime call or op "
                f"(no matching correlation / External id){why}", "ops table, roofline and per-op categories for "
                "that time (it is counted in the timeline but credited to no op)", events=n, us=us,
                of_events=len(sub), queued_before_profiling=k)
    # launches whose GPU activity is absent: dropped by the profiler, or cut by the window's end
    # (the four columns read at the launches' rows, not a copy of the runtime rows of the whole tree)
    tree = analysis.tree
    t_corr = tree["correlation"].to_numpy()
    sel = (tree["kind"].to_numpy() == 3) & (t_corr >= 0)
    if not sel.any():
        return
    sel &= C.map_strings(tree["name"], _is_launch, on_markers=False)
    rows = np.flatnonzero(sel)
    del sel
    rt_rank = tree["rank"].to_numpy()[rows]

    def key(rank, corr):
        return (rank.astype(np.int64) << 44) ^ corr.astype(np.int64)

    g_corr = g["correlation"].to_numpy()
    gkeys = np.sort(key(g["rank"].to_numpy()[g_corr >= 0], g_corr[g_corr >= 0]))
    lkeys = key(rt_rank, t_corr[rows])
    # ~np.isin(lkeys, gkeys), by binary search in the sorted keys (np.isin hashes both sides: ~30x slower here)
    at = np.minimum(np.searchsorted(gkeys, lkeys), max(len(gkeys) - 1, 0))
    absent = gkeys[at] != lkeys if len(gkeys) else np.ones(len(lkeys), dtype=bool)
    del gkeys, lkeys, at
    t_ts = tree["ts"].to_numpy()
    for rank in np.unique(rt_rank).tolist():
        gr = g[g["rank"].to_numpy() == rank]
        if gr.empty:
            continue
        of_rank = rt_rank == rank
        miss = absent[of_rank]
        if not miss.any():
            continue
        launches = int(of_rank.sum())
        last_launch = int(gr["launch_ts"].max()) if (gr["launch_ts"] >= 0).any() else int(gr["ts"].max())
        tail = t_ts[rows[of_rank]][miss] > last_launch  # after the last launch that did reach the GPU
        n_tail, n_mid = int(tail.sum()), int((~tail).sum())
        if n_mid:
            add("dropped_gpu_events", "warning", [rank], f"rank {rank}: {n_mid} of {launches} kernel launches "
                "have no GPU activity in the trace although later launches do (dropped by the profiler, e.g. a full "
                "CUPTI buffer)", "GPU busy time, per-op GPU time and category totals (undercounted)",
                launches=launches, missing=n_mid)
        if n_tail:
            add("dropped_gpu_events", "info", [rank], f"rank {rank}: the last {n_tail} launch(es) have no GPU activity: "
                "the profiler stopped before they ran", "the last step's GPU figures (partial)",
                launches=launches, missing_at_end=n_tail)


def _shapes_and_stacks(analysis, add) -> None:
    tree = analysis.tree
    is_op = tree["kind"].to_numpy() == 2  # the two columns read, not a copy of the ops' rows of the whole tree
    if not is_op.any():
        return
    has_dims = ~pd.isna(tree["input_dims"]).to_numpy()[is_op]
    by_rank = pd.Series(has_dims).groupby(tree["rank"].to_numpy()[is_op]).mean()
    none = [int(r) for r, v in by_rank.items() if v == 0]
    if none:
        add("record_shapes", "warning", none, f"rank(s) {_list(none)}: none of the ops carries input shapes (the trace "
            "was recorded without record_shapes=True)", "ops by input shape, roofline FLOPs/bytes and % of ceiling, "
            "replay scripts, shape-based findings", ops=int(is_op.sum()))
    ev = analysis.trace.events
    py = C.isin(ev["cat"], C.PYTHON_CATS)
    stacks = "call_stack" in ev.columns and bool(C.map_strings(ev["call_stack"], lambda s: s != "").any())
    no_stack = [int(r) for r in analysis.trace.rank_ids if not py[ev["rank"].to_numpy() == r].any()]
    if no_stack and not stacks:
        add("with_stack", "info", no_stack, f"rank(s) {_list(no_stack)}: no Python stacks (recorded without "
            "with_stack=True)", "source locations of ops and host syncs (names and shapes are still there)")


def _partial_steps(analysis, add) -> None:
    w = getattr(analysis, "window", None)
    if w is not None and getattr(w, "excluded", None):
        for e in w.excluded:
            if e["reason"] not in ("missing_ranks", "empty"):
                continue
            used = e["step"] in w.used
            add("partial_steps", "warning" if used else "info", e["ranks"],
                f"step {e['step']} is partial ({e['detail']})" + ("" if used else "; the steady-state views leave it out"),
                "per-step figures and step-to-step comparisons of that step" + ("" if not used else
                "; it is still read by the views"), step=e["step"], reason=e["reason"])
        return
    steps = analysis.steps
    if steps.empty:
        return
    ranks = sorted(int(r) for r in steps["rank"].unique())
    # only the steps some rank lacks (a trace of many short steps has tens of thousands, nearly all whole)
    seen = steps.groupby("step")["rank"].nunique()
    short = set(seen.index[seen.to_numpy() < len(ranks)].tolist())
    for step, g in (steps[steps["step"].isin(short)].groupby("step") if short else ()):
        missing = sorted(set(ranks) - set(int(r) for r in g["rank"]))
        if missing:
            add("partial_steps", "warning", missing, f"step {step} is not marked on rank(s) {_list(missing)}",
                "per-step cross-rank comparisons of that step", step=int(step))


def _startup_waits(analysis, inst, add) -> None:
    if inst.empty:
        return
    multi = inst.groupby(["group", "peers"])["rank"].nunique().max() > 1
    if not multi:
        add("startup_wait", "info", [], "not checked: no process group has two ranks loaded (a start-up wait is seen "
            "as a collective that began before a peer rank started profiling)", "")
        return
    su = inst[inst["startup"]]
    if su.empty:
        return
    steady = inst[~inst["startup"] & inst["cross_rank"]]
    w = getattr(analysis, "window", None)
    for r in su[su["sync_us"].fillna(0) > 0].itertuples(index=False):
        ref = steady[(steady["rank"] == r.rank) & (steady["family"] == r.family)]
        med = float(ref["sync_us"].median()) if len(ref) else float("nan")
        kmed = float(ref["kernel_us"].median()) if len(ref) else float("nan")
        excl = w is not None and getattr(w, "restricts", False) and r.step not in w.used
        found = (f"rank {r.rank}: {r.collective} #{r.instance} (step {r.step}) waited {_ms(r.sync_us)} for rank(s) that "
                 f"had not started profiling; its kernel ran {_ms(r.kernel_us)}"
                 + (f" vs a steady-state median of {_ms(kmed)} (sync {_ms(med)})" if len(ref) else ""))
        add("startup_wait", "warning", [r.rank], found,
            (f"step {r.step}'s figures on rank {r.rank}" + (" (left out of the steady-state views)" if excl else "")
             + "; whole-window busy %, comm and exposed comm of that rank; comm tables exclude it"),
            step=r.step, collective=r.collective, sync_us=r.sync_us, kernel_us=r.kernel_us,
            steady_median_sync_us=med, steady_median_kernel_us=kmed)


def _clock_skew(analysis, inst, add) -> None:
    from . import comm as CM

    trace = analysis.trace
    bases = {r.rank: r.base_time_ns for r in trace.ranks if r.base_time_ns is not None}
    if len(set(bases.values())) > 1:
        lo = min(bases.values())
        diffs = {r: (b - lo) / 1e9 for r, b in bases.items()}
        add("clock_skew", "info", [r for r, d in diffs.items() if d], "the ranks' baseTimeNanoseconds differ (by up to "
            f"{max(diffs.values()):.3f} s): their traces were not started on one epoch; timestamps are compared as "
            "written", "cross-rank timing if the hosts' clocks differ", base_time_offsets_s=diffs)
    if inst.empty or inst.groupby(["group", "peers"])["rank"].nunique().max() < 2:
        return
    v = CM.clock_violations(inst)
    v = v[v["max_gap_us"] > TS_RESOLUTION_US] if not v.empty else v
    for r in v.itertuples(index=False):
        add("clock_skew", "error", [r.early_rank, r.late_rank],
            f"in {r.instances} of {r.of_instances} synchronizing collective instances rank {r.early_rank}'s kernel "
            f"ended before rank {r.late_rank}'s began (by up to {_ms(r.max_gap_us)}, median {_ms(r.median_gap_us)}): "
            f"impossible on one clock; rank {r.late_rank}'s clock runs at least {_ms(r.max_gap_us)} ahead",
            "sync wait vs comm split, skew, last rank / stragglers, critical path and every cross-rank timeline "
            "comparison", instances=r.instances, of_instances=r.of_instances, max_gap_us=r.max_gap_us,
            median_gap_us=r.median_gap_us)


def _profiled_steps(manifest: dict) -> tuple[list[int], list[int]] | None:
    metrics = manifest.get("metrics") if isinstance(manifest.get("metrics"), dict) else {}
    times = metrics.get("step_times_s")
    prof = manifest.get("profile") if isinstance(manifest.get("profile"), dict) else {}
    lo, hi = prof.get("step_start"), prof.get("step_end")
    if not isinstance(times, list) or not all(isinstance(t, (int, float)) for t in times):
        return None
    if not (isinstance(lo, int) and isinstance(hi, int) and hi > lo):
        return None
    profiled = [s for s in range(lo, hi) if s < len(times)]
    timed = metrics.get("timed_steps")
    if isinstance(timed, list) and all(isinstance(s, int) for s in timed):
        unprof = [s for s in timed if 0 <= s < len(times) and not lo <= s <= hi]  # hi: the trace-export step
    else:
        cfg = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
        warm = cfg.get("timing_warmup_steps") if isinstance(cfg.get("timing_warmup_steps"), int) else 1
        unprof = [s for s in range(warm, len(times)) if not lo <= s <= hi]
    return profiled, unprof


def _profiler_overhead(manifest: dict | None, add) -> None:
    if not manifest:
        return
    got = _profiled_steps(manifest)
    if got is None:
        return
    profiled, unprof = got
    times = manifest["metrics"]["step_times_s"]
    if not profiled or not unprof:
        add("profiler_overhead", "info", [], "not checked: the run has no unprofiled steady step to compare with "
            f"(profiled steps {profiled}, unprofiled {unprof})", "")
        return
    p = [float(times[s]) for s in profiled]
    u = [float(times[s]) for s in unprof]
    mp, mu = statistics.median(p), statistics.median(u)
    over = mp / mu - 1 if mu > 0 else float("nan")
    beyond = min(p) > max(u) and len(u) >= 2
    found = (f"profiled step(s) {profiled}: median {mp * 1e3:.1f} ms; unprofiled steady step(s) {unprof}: median "
             f"{mu * 1e3:.1f} ms (range {min(u) * 1e3:.1f}-{max(u) * 1e3:.1f} ms): profiler overhead {100 * over:+.1f}%")
    if beyond:
        found += "; every profiled step is slower than every unprofiled one"
    elif len(u) < 2:
        found += "; one unprofiled step: its noise is unknown"
    add("profiler_overhead", "warning" if beyond else "info", [], found,
        "absolute step times and host/launch shares read from the trace (the profiler's own cost is in them)"
        if beyond else "", profiled_steps=profiled, unprofiled_steps=unprof, profiled_median_s=mp,
        unprofiled_median_s=mu, overhead_pct=100 * over)


# ------------------------------------------------------------------------------ the `tracelens check` view


@dataclass
class HealthReport:
    """The health checks of a set of ranks judged against a CI threshold: what `tracelens check` prints and
    writes with --json; summary.json's ``health`` is its :meth:`summary`. Built by :func:`health_report`."""

    checks: pd.DataFrame  # health_checks: one row per finding
    ranks: int  # ranks loaded
    fail_on: str = "error"  # the least severe level that fails the check ("never": none)

    @property
    def exit_status(self) -> int:
        return exit_status(self.checks, self.fail_on)

    def summary(self) -> dict[str, Any]:
        """summary.json's ``health``."""
        return health_summary(self.checks)

    def to_dict(self) -> dict[str, Any]:
        """The `tracelens check --json` document: the summary, the threshold and the exit status."""
        return {"schema_version": 1, **self.summary(), "fail_on": self.fail_on, "exit_status": self.exit_status}

    def to_text(self) -> str:
        """The `tracelens check` text: one line per check (and what not to trust), then the verdict."""
        lines = []
        for r in self.checks.itertuples(index=False):
            shown = ", ".join(map(str, r.ranks[:16])) + (f", … ({len(r.ranks)} in all)" if len(r.ranks) > 16 else "")
            who = f" (rank{'s' if len(r.ranks) > 1 else ''} {shown})" if r.ranks else ""
            lines.append(f"{r.severity:<7} {r.check}{who}: {r.found}")
            if r.invalidates:
                lines.append(f"        do not trust: {r.invalidates}")
        c = self.summary()["counts"]
        lines.append(f"{self.ranks} rank(s): {c['error']} error(s), {c['warning']} warning(s), {c['info']} note(s)"
                     + ("" if len(self.checks) else " - clean") + f"; exit {self.exit_status} (--fail-on {self.fail_on})")
        return "\n".join(lines)


def health_report(analysis, fail_on: str = "error") -> HealthReport:
    """The health view of an Analysis (its checks, computed once there)."""
    return HealthReport(analysis.health(), len(analysis.trace.ranks), fail_on)

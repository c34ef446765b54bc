"""Per-step figures: what one training step costs, with the step-to-step spread.

A step is a profiler-step annotation (`ProfilerStep#N`, `## step N`). When a trace marks none, the
window is split evenly over the optimizer steps it contains (`Optimizer.step#...` annotations), or
counted as one step; `StepFigures.source` says which, so a report can tell the reader.

Wall-time attribution: every GPU idle gap is charged to the op whose kernel ends the gap (the GPU was
waiting for the host to launch it), so each op's share = its GPU time + the idle time before its
kernels, and the shares add up to the GPU span. This is what lets a diff say *where* a step got
faster even when the saving is idle time (host syncs, launch overhead) rather than kernel time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd

from .. import categories as C
from .calltree import KIND_RUNTIME

US = 1000.0


@dataclass
class StepFigures:
    source: str  # "profiler steps", "optimizer steps", "whole window"
    n_steps: int
    per_step: pd.DataFrame  # one row per step: metric columns (step_time_us, gpu_busy_us, ...)


def host_sync_calls(tree: pd.DataFrame) -> pd.DataFrame:
    """Blocking device-to-host synchronizations issued by the workload: sync runtime calls inside an op
    or annotation (the profiler's own cudaDeviceSynchronize at window start/end is left out)."""
    rt = tree[tree["kind"] == KIND_RUNTIME]
    rt = rt[C.isin(rt["name"], C.SYNC_RUNTIME) & (rt["parent"].to_numpy() >= 0)]
    return rt


def sync_ops(tree: pd.DataFrame) -> pd.DataFrame:
    """Host syncs per issuing op: op (the top-level op the program called, e.g. aten::bincount or
    aten::to for a .tolist()), via (the innermost op, e.g. aten::_local_scalar_dense), call, count."""
    s = host_sync_calls(tree)
    if s.empty:
        return pd.DataFrame(columns=["op", "via", "call", "count"])
    top = C.take_strings(tree["name"], s["outer_op"].to_numpy(), fill="(no op)")
    via = C.take_strings(tree["name"], s["inner_op"].to_numpy(), fill="(no op)")
    df = pd.DataFrame({"op": np.asarray(top, dtype=object), "via": np.asarray(via, dtype=object),
                       "call": s["name"].astype(str).to_numpy()})
    return df.groupby(["op", "via", "call"]).size().rename("count").reset_index()


def optimizer_steps(events: pd.DataFrame) -> int:
    """How many optimizer steps the window holds (max over ranks), 0 when none are annotated."""
    is_ann = C.isin(events["cat"], C.ANNOTATION_CATS)
    is_opt = C.map_strings(events["name"], lambda s: s.startswith("Optimizer.step#"))
    sel = events[is_ann & is_opt]
    return int(sel.groupby("rank").size().max()) if len(sel) else 0


def idle_before(gpu: pd.DataFrame) -> np.ndarray:
    """Per GPU event (row order of `gpu`): the idle time on its rank right before it started, in ns."""
    out = np.zeros(len(gpu), dtype=np.int64)
    for _, g in gpu.groupby("rank", sort=False):
        pos = np.flatnonzero(gpu["rank"].to_numpy() == g["rank"].iloc[0])
        order = np.argsort(g["ts"].to_numpy(), kind="stable")
        s = g["ts"].to_numpy()[order]
        e = g["end"].to_numpy()[order]
        run_end = np.maximum.accumulate(e)
        gap = np.zeros(len(s), dtype=np.int64)
        gap[1:] = np.maximum(s[1:] - run_end[:-1], 0)
        res = np.zeros(len(s), dtype=np.int64)
        res[order] = gap
        out[pos] = res
    return out


def step_figures(analysis) -> StepFigures:
    """Per-step metrics of an `Analysis` over the steps its window uses (the steady-state steps unless it
    was analyzed with window="all"); median/spread are taken by the caller."""
    a = analysis
    syncs = host_sync_calls(a.tree)
    kernels = a.gpu[a.gpu["kind"] == "kernel"]
    sw = getattr(a, "window", None)
    used = sw.used if sw is not None and sw.restricts else None
    if not a.step_timeline.empty:
        st = a.step_timeline if used is None else a.step_timeline[a.step_timeline["step"].isin(used)]
        waits = st.set_index(["rank", "step"])["startup_wait_us"] if "startup_wait_us" in st else None
        if sw is not None and sw.cuts and used is not None:  # a kept start-up wait is cut out of the step
            from .timeline import gpu_timeline
            from .waits import wait_class

            kw = a.comm_waits() if hasattr(a, "comm_waits") and a.trace_rank_count >= 2 else None
            st = gpu_timeline(a.gpu[a.gpu["step"].isin(used).to_numpy()], by_step=True, cuts=sw.cuts,
                              waits=wait_class(kw))
            st = st.assign(startup_wait_us=0.0)
        host_steps = a.steps.assign(step_time_us=(a.steps["end"] - a.steps["start"]) / US)
        rows = []
        for step, g in st.groupby("step"):
            # a start-up wait (a collective waiting for ranks not yet profiling) is not the step's cost
            wait = g.set_index("rank")["startup_wait_us"] if "startup_wait_us" in g else pd.Series(dtype=float)
            hs = host_steps[host_steps["step"] == step].set_index("rank")["step_time_us"]
            host_wait = (waits.xs(step, level="step") if waits is not None and step in waits.index.get_level_values("step")
                         else pd.Series(dtype=float))
            hs = hs - host_wait.reindex(hs.index).fillna(0.0)
            span = g.set_index("rank")["span_us"] - wait.reindex(g["rank"]).fillna(0.0).to_numpy()
            sync_n = _count_in_steps(syncs, a.steps, step)
            rows.append({
                "step": int(step),
                "step_time_us": float(hs.max()) if len(hs) else float(span.max()),
                "gpu_span_us": float(span.max()),
                "gpu_busy_us": float(g["gpu_busy_us"].mean()),
                "gpu_idle_us": float(g["gpu_idle_us"].mean()),
                "compute_us": float(g["compute_us"].mean()),
                "comm_us": float(g["comm_us"].mean()),
                "exposed_comm_us": float(g["exposed_comm_us"].mean()),
                "comm_wait_us": float(g["comm_wait_us"].mean()) if "comm_wait_us" in g else 0.0,
                "pipeline_wait_us": float(g["pipeline_wait_us"].mean()) if "pipeline_wait_us" in g else 0.0,
                "kernels": float(g["kernel_count"].mean()),
                "host_syncs": float(sync_n) / max(1, a.trace_rank_count),
            })
        return StepFigures("profiler steps", len(rows), pd.DataFrame(rows))
    if a.timeline.empty and not a.steps.empty:
        # CPU-only trace with profiler steps: the step time is the host step range (slowest rank); GPU
        # figures are unknown (NaN), not zero, so a diff never reports a fake GPU change
        hs = a.steps if used is None else a.steps[a.steps["step"].isin(used)]
        hs = hs.assign(step_time_us=(hs["end"] - hs["start"]) / US)
        nan = float("nan")
        rows = [{"step": int(step), "step_time_us": float(g["step_time_us"].max()), "gpu_span_us": nan,
                 "gpu_busy_us": nan, "gpu_idle_us": nan, "compute_us": nan, "comm_us": nan,
                 "exposed_comm_us": nan, "comm_wait_us": nan, "pipeline_wait_us": nan, "kernels": 0.0,
                 "host_syncs": float(_count_in_steps(syncs, a.steps, step)) / max(1, a.trace_rank_count)}
                for step, g in hs.groupby("step")]
        return StepFigures("profiler steps (host)", len(rows), pd.DataFrame(rows))
    n = optimizer_steps(a.trace.events)
    source = "optimizer steps" if n else "whole window"
    n = max(n, 1)
    if a.timeline.empty:
        per = {"step": 0, "step_time_us": np.nan}
    else:
        tl = a.timeline
        per = {
            "step": 0,
            "step_time_us": float(tl["span_us"].max()) / n,
            "gpu_span_us": float(tl["span_us"].max()) / n,
            "gpu_busy_us": float(tl["gpu_busy_us"].mean()) / n,
            "gpu_idle_us": float(tl["gpu_idle_us"].mean()) / n,
            "compute_us": float(tl["compute_us"].mean()) / n,
            "comm_us": float(tl["comm_us"].mean()) / n,
            "exposed_comm_us": float(tl["exposed_comm_us"].mean()) / n,
            "comm_wait_us": float(tl["comm_wait_us"].mean()) / n if "comm_wait_us" in tl else 0.0,
            "pipeline_wait_us": float(tl["pipeline_wait_us"].mean()) / n if "pipeline_wait_us" in tl else 0.0,
            "kernels": len(kernels) / max(1, a.trace_rank_count) / n,
        }
    per["host_syncs"] = len(syncs) / max(1, a.trace_rank_count) / n
    return StepFigures(source, n, pd.DataFrame([per]))


def _count_in_steps(events: pd.DataFrame, steps: pd.DataFrame, step: int) -> int:
    s = steps[steps["step"] == step]
    total = 0
    for r in s.itertuples(index=False):
        ev = events[events["rank"] == r.rank]
        total += int(((ev["ts"] >= r.start) & (ev["ts"] < r.end)).sum())
    return total


def op_shares(analysis) -> pd.DataFrame:
    """Per op key (path / top-level op / op / input dims): GPU time and wall share (GPU + idle before),
    over the GPU events of the analysis window (the steady-state steps by default)."""
    g = analysis.gpu if getattr(analysis, "gpu_window", None) is None else analysis.gpu_window
    cols = ["path", "top_op", "op", "input_dims", "gpu_us", "idle_us", "wall_us", "count"]
    if g.empty:
        return pd.DataFrame(columns=cols)
    idle = idle_before(g)
    df = pd.DataFrame({
        "path": g["path"].astype(str).to_numpy(),
        "top_op": g["top_op"].astype(str).replace("", "(no op)").to_numpy(),
        "op": g["op"].astype(str).to_numpy(),
        "input_dims": g["op_input_dims"].astype(str).to_numpy(),
        "gpu": g["dur"].to_numpy(),
        "idle": idle,
    })
    agg = df.groupby(["path", "top_op", "op", "input_dims"], sort=False).agg(
        gpu=("gpu", "sum"), idle=("idle", "sum"), count=("gpu", "size")).reset_index()
    agg["gpu_us"] = agg.pop("gpu") / US
    agg["idle_us"] = agg.pop("idle") / US
    agg["wall_us"] = agg["gpu_us"] + agg["idle_us"]
    return agg[cols]


# --------------------------------------------------------------------------------- steady state
#
# Which profiler steps a view should read. A step is left out when the trace (or the run's manifest)
# shows a mechanism that makes it unlike the steps around it, never because its duration looks odd:
#   startup_wait   a collective on some rank began before a peer rank's profiled window started, so the
#                  rank waited inside it for a peer that was not being recorded (the profiler start-up
#                  wait: seconds on real multi-rank traces); found by matching collectives across ranks
#   missing_ranks  the step is marked on some ranks only: the profiler window cut it on the others
#   empty          the rank ran no op in the step while its other steps did: the profiler stopped (or
#                  started) right at the step's edge, so the step holds a fragment of a step
#   warmup         the run's manifest says the step is a warm-up step (config.timing_warmup_steps)
#   export         the run's manifest says the profiler stopped and exported its trace in this step
#                  (profile.step_end): the step pays for writing the trace
# When every step has such a reason the least-affected steps are kept (a start-up wait is then cut out
# of the step's timeline instead: see `StepWindow.cuts`) and the notes say so.

STEADY, ALL = "steady", "all"

REASON_TEXT = {
    "startup_wait": "profiler start-up wait",
    "missing_ranks": "partial: cut by the profiler window",
    "empty": "partial: holds no op",
    "warmup": "warm-up step",
    "export": "trace-export step",
}


@dataclass
class StepWindow:
    """The steps the views use, those left out and why."""

    mode: str  # "steady" (default) or "all" (every step and every event: the whole profiled window)
    steps: list[int]  # every step the trace marks, in order
    used: list[int]  # the steps whose events the views read
    excluded: list[dict]  # {"step", "reason", "ranks", "detail"}, one per (step, reason)
    cuts: dict = None  # rank -> [(start_ns, end_ns)] excised from kept steps (start-up waits kept as fallback)
    outside_gpu_events: int = 0  # GPU events launched outside every marked step (not read in steady mode)
    outside_gpu_us: float = 0.0
    notes: list = None

    def __post_init__(self) -> None:
        self.cuts = self.cuts or {}
        self.notes = self.notes or []

    @property
    def restricts(self) -> bool:
        """True when the views read a subset of the trace (steady mode on a trace with marked steps)."""
        return self.mode == STEADY and bool(self.steps)

    @property
    def excluded_steps(self) -> list[int]:
        used = {int(u) for u in self.used}  # (a set: thousands of steps)
        return sorted({int(e["step"]) for e in self.excluded if int(e["step"]) not in used})

    def describe(self) -> str:
        """One line for reports and the terminal."""
        if not self.steps:
            return "whole profiled window (the trace marks no profiler steps)"
        if self.mode == ALL:
            return f"whole profiled window: every step ({_ranges(self.steps)}) and the events between them"
        text = f"steady-state steps {_ranges(self.used)} of {_ranges(self.steps)}"
        used = {int(u) for u in self.used} if self.excluded else set()  # (a set: a list lookup per excluded step is quadratic)
        left = [e for e in self.excluded if int(e["step"]) not in used]
        if left:
            text += "; excluded " + "; ".join(f"step {e['step']} ({REASON_TEXT.get(e['reason'], e['reason'])}: "
                                               f"{e['detail']})" for e in left)
        if self.outside_gpu_events:
            text += (f"; {self.outside_gpu_events} GPU event(s) ({self.outside_gpu_us / 1e3:.3f} ms) launched "
                     f"outside every step left out")
        for n in self.notes:
            text += f"; {n}"
        return text

    def to_dict(self) -> dict:
        used = {int(u) for u in self.used} if self.excluded else set()  # (read per excluded step only)
        return {
            "mode": self.mode,
            "steps": [int(s) for s in self.steps],
            "steps_used": [int(s) for s in self.used],
            "steps_excluded": [{"step": int(e["step"]), "reason": e["reason"], "ranks": [int(r) for r in e["ranks"]],
                                "detail": e["detail"], "kept": int(e["step"]) in used} for e in self.excluded],
            "cuts": [{"rank": int(r), "start_ns": int(s), "end_ns": int(e), "us": round((e - s) / US, 3)}
                     for r, iv in sorted(self.cuts.items()) for s, e in iv],
            "gpu_events_outside_steps": int(self.outside_gpu_events),
            "gpu_us_outside_steps": round(float(self.outside_gpu_us), 3),
            "notes": list(self.notes),
            "description": self.describe(),
        }


def _sorted_ints(values) -> list[int]:
    """``sorted(int(v) for v in values)``, at once for an integer array."""
    a = np.asarray(values)
    if a.ndim == 1 and (a.dtype.kind == "i" or (a.dtype.kind == "u" and a.dtype.itemsize < 8)):
        return np.sort(a).tolist()
    return sorted(int(v) for v in values)


def _empty_steps(steps: pd.DataFrame, ops_per: pd.Series) -> list[tuple[int, int]]:
    """(rank, step) of the steps in which a rank ran no op (`ops_per`: ops per (rank, step), absent: none) while some
    other step of it did: ranks ascending, each rank's steps once, in the order of their first row. Whole columns at
    once (a trace of many short steps has tens of thousands of them), not a dict lookup per (rank, step)."""
    if steps.empty or len(ops_per) == 0:
        return []
    r = steps["rank"].to_numpy().astype(np.int64)
    s = steps["step"].to_numpy().astype(np.int64)
    o_r, o_s = (ops_per.index.get_level_values(i).to_numpy().astype(np.int64) for i in (0, 1))
    n = ops_per.to_numpy().astype(np.int64)
    r0, s0 = min(int(r.min()), int(o_r.min())), min(int(s.min()), int(o_s.min()))
    span = max(int(s.max()), int(o_s.max())) - s0 + 1
    if (max(int(r.max()), int(o_r.max())) - r0 + 1) * span < 2**62:  # (rank, step) as one int64 key
        key, o_key = (r - r0) * span + (s - s0), (o_r - r0) * span + (o_s - s0)
        u, at = np.unique(o_key[::-1], return_index=True)  # (a key given twice: the last count, as a dict of items)
        n_u = n[::-1][at]
        pos = np.minimum(np.searchsorted(u, key), max(len(u) - 1, 0))
        count = np.where(u[pos] == key, n_u[pos], 0)
        first = np.zeros(len(key), dtype=bool)
        first[np.unique(key, return_index=True)[1]] = True
    else:
        keys = pd.MultiIndex.from_arrays([o_r, o_s])
        last = ~keys.duplicated(keep="last")
        pos = keys[last].get_indexer(pd.MultiIndex.from_arrays([r, s]))
        count = np.where(pos >= 0, n[last][np.maximum(pos, 0)], 0)
        first = ~pd.MultiIndex.from_arrays([r, s]).duplicated(keep="first")
    busy_ranks = np.unique(r[count != 0])
    pick = (count == 0) & np.isin(r, busy_ranks)
    pick &= first
    rows = np.flatnonzero(pick)
    rows = rows[np.argsort(r[rows], kind="stable")]
    return list(zip(r[rows].tolist(), s[rows].tolist()))


def _ranges(xs) -> str:
    """Sorted integers as runs of consecutive ones: "1-3, 5, 7-8" (a number given twice ends a run). Whole arrays
    at once: a trace of many short steps has tens of thousands."""
    a = np.asarray(xs)
    if not (a.dtype.kind == "i" or (a.dtype.kind == "u" and a.dtype.itemsize < 8)) or a.ndim != 1:
        a = np.asarray([int(x) for x in xs], dtype=np.int64)  # (other values: as int() reads them)
    xs = np.sort(a.astype(np.int64))
    if not len(xs):
        return "none"
    brk = np.flatnonzero(np.diff(xs) != 1)  # a run ends at brk, the next starts at brk + 1
    lo = np.r_[xs[0], xs[brk + 1]].tolist()
    hi = np.r_[xs[brk], xs[-1]].tolist()
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in zip(lo, hi))


def run_manifest(trace) -> dict | None:
    """The run's manifest (`Trace.run`, read when the trace was loaded) when every rank file sits in
    RUN/traces/ (else None). An unreadable manifest is None too: the window then uses what the trace shows,
    and the health check names it."""
    run = getattr(trace, "run", None)
    return run.manifest if run is not None else None


def steady_pipeline_step(steps: list[int], manifest: dict | None) -> int:
    """The step a pipeline lanes view shows by default: the last step that is neither a warm-up step,
    a profiled step (the profiler's own overhead) nor the trace-export step of the run's manifest;
    the last step when every step is one of those or there is no manifest."""
    roles = manifest_step_roles(manifest, include_profiled=True)
    steady = [s for s in steps if s not in roles]
    return (steady or list(steps))[-1]


def manifest_step_roles(manifest: dict | None, include_profiled: bool = False) -> dict[int, tuple[str, str]]:
    """step -> (reason, detail) for the steps a run manifest marks as warm-up or trace-export steps (and,
    with include_profiled, the profiled steps: for data recorded outside the profiler, e.g. pipeline
    actions, those steps carry the profiler's overhead)."""
    out: dict[int, tuple[str, str]] = {}
    if not manifest:
        return out
    cfg = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    prof = manifest.get("profile") if isinstance(manifest.get("profile"), dict) else {}
    warm = cfg.get("timing_warmup_steps")
    if isinstance(warm, int) and not isinstance(warm, bool) and warm > 0:
        for s in range(warm):
            out[s] = ("warmup", f"the run's config sets timing_warmup_steps = {warm}")
    lo, hi = prof.get("step_start"), prof.get("step_end")
    if isinstance(lo, int) and isinstance(hi, int) and hi > lo:
        out[hi] = ("export", f"the profiler window is steps {lo}-{hi - 1}: it stops and writes the trace in step {hi}")
        if include_profiled:
            for s in range(lo, hi):
                out[s] = ("profiled", f"step {s} ran under the profiler (profiled steps {lo}-{hi - 1})")
    return out


def startup_waits(trace, gpu: pd.DataFrame, instances: Callable[[], pd.DataFrame]) -> pd.DataFrame:
    """Collective kernels that waited for a peer rank that had not started profiling yet: rank, step,
    collective, instance, sync_us and the waited interval [wait_start_ns, wait_end_ns) on that rank.
    instances: returns the collective instances (the analysis's `comm_instances` entry); called only
    when there can be a start-up wait (two ranks or more, communication kernels)."""
    cols = ["rank", "step", "collective", "instance", "sync_us", "wait_start_ns", "wait_end_ns"]
    if len(trace.ranks) < 2 or gpu.empty or not gpu["is_comm"].any():
        return pd.DataFrame(columns=cols)
    inst = instances()
    su = inst[inst["startup"]]
    # a start-up kernel whose peer's kernel is not in the traces (not matched: its wait cannot be told from
    # its transfer) counts as waiting for its whole duration, an upper bound: it must not stay in the steady
    # figures as 'communication' (a dropped event on the peer once left 1.4 s of it in a 15 ms window)
    sync = su["sync_us"].where(su["sync_us"].notna(), su["kernel_us"])
    su, sync = su[sync > 0], sync[sync > 0]
    if su.empty:
        return pd.DataFrame(columns=cols)
    ts = gpu["ts"].to_numpy()[C.positions(gpu.index, su["gpu_row"].to_numpy())].astype(np.int64)
    wait = np.round(sync.to_numpy() * US).astype(np.int64)
    return pd.DataFrame({"rank": su["rank"].to_numpy(), "step": su["step"].to_numpy(), "collective": su["collective"].to_numpy(),
                         "instance": su["instance"].to_numpy(), "sync_us": sync.to_numpy(),
                         "wait_start_ns": ts, "wait_end_ns": ts + wait})[cols].reset_index(drop=True)


def pre_window_mask(gpu: pd.DataFrame, tree: pd.DataFrame) -> np.ndarray:
    """Per GPU event (``gpu``'s row order): launched before the trace's first recorded launch call on its rank
    (no launch linked and a correlation id below every runtime call's: see `pre_window_launches`)."""
    if gpu.empty or tree.empty:
        return np.zeros(len(gpu), dtype=bool)
    rt = (tree["kind"].to_numpy() == KIND_RUNTIME) & (tree["correlation"].to_numpy() >= 0)
    if not rt.any():
        return np.zeros(len(gpu), dtype=bool)
    first = pd.Series(tree["correlation"].to_numpy()[rt]).groupby(tree["rank"].to_numpy()[rt]).min()
    fr = first.reindex(gpu["rank"].to_numpy()).to_numpy(dtype=float)
    corr = gpu["correlation"].to_numpy()
    return (gpu["launch_ts"].to_numpy() < 0) & (corr >= 0) & ~np.isnan(fr) & (corr < fr)


def pre_window_launches(gpu: pd.DataFrame, tree: pd.DataFrame) -> pd.DataFrame:
    """GPU events launched before the trace's first recorded launch call on their rank: CUDA/HIP correlation
    ids grow with every launch of a process, so an event whose id is below every runtime call's in the trace
    was queued before profiling began (the host ran ahead of the device) and runs inside the first profiled
    step's window without being that step's work. One row per (rank, step they fall in): count and busy ns."""
    cols = {"rank": pd.Series([], dtype="int64"), "step": pd.Series([], dtype="int64"),
            "events": pd.Series([], dtype="int64"), "busy_ns": pd.Series([], dtype="int64")}
    pre = pre_window_mask(gpu, tree)
    if not pre.any():
        return pd.DataFrame(cols)
    g = pd.DataFrame({"rank": gpu["rank"].to_numpy()[pre], "step": gpu["step"].to_numpy()[pre],
                      "dur": gpu["dur"].to_numpy()[pre]})
    out = g.groupby(["rank", "step"], sort=True).agg(events=("dur", "size"), busy_ns=("dur", "sum")).reset_index()
    return out.astype({"rank": "int64", "step": "int64", "events": "int64", "busy_ns": "int64"})


def host_steps(tree: pd.DataFrame, steps: pd.DataFrame) -> np.ndarray:
    """The profiler step of each host event (tree row order): the step whose range holds its start, else -1."""
    from .calltree import assign_steps

    return assign_steps(tree["rank"].to_numpy(), tree["ts"].to_numpy(), steps)


def step_window(trace, tree: pd.DataFrame, gpu: pd.DataFrame, steps: pd.DataFrame, *, mode: str = STEADY,
                waits: pd.DataFrame | None = None, manifest: dict | None = None,
                tree_step: np.ndarray | None = None) -> StepWindow:
    """Classify the marked profiler steps (see the comment above) and pick the ones the views use."""
    if mode not in (STEADY, ALL):
        raise ValueError(f"window must be {STEADY!r} or {ALL!r}, got {mode!r}")
    all_steps = _sorted_ints(steps["step"].unique()) if not steps.empty else []
    # (the GPU events launched outside every step, counted on two columns: not a copy of the GPU table's rows)
    outside = gpu["step"].to_numpy() < 0 if not gpu.empty and all_steps else np.zeros(0, dtype=bool)
    n_out = int(np.count_nonzero(outside))
    sw = StepWindow(mode=mode, steps=all_steps, used=list(all_steps), excluded=[], outside_gpu_events=n_out,
                    outside_gpu_us=float(gpu["dur"].to_numpy()[outside].sum()) / US if n_out else 0.0)
    if not all_steps:
        sw.outside_gpu_events, sw.outside_gpu_us = 0, 0.0
        return sw
    waits = startup_waits(trace, gpu) if waits is None else waits
    ts = host_steps(tree, steps) if tree_step is None else tree_step
    from .calltree import KIND_OP

    is_op = tree["kind"].to_numpy() == KIND_OP
    ops_per = pd.DataFrame({"rank": tree["rank"].to_numpy()[is_op], "step": ts[is_op]})
    ops_per = ops_per[ops_per["step"] >= 0].groupby(["rank", "step"]).size()
    return classify_steps(sw, steps, waits, ops_per, manifest)


def classify_steps(sw: StepWindow, steps: pd.DataFrame, waits: pd.DataFrame, ops_per: pd.Series,
                   manifest: dict | None) -> StepWindow:
    """The reasons and the chosen steps of `step_window`, from what it needs of the ranks: the steps table,
    the start-up waits, the op count per (rank, step) (steps >= 0) and the manifest; fills `sw`, whose
    mode, steps and outside-GPU counts are set. `tracelens.scale` calls it on per-rank reductions."""
    mode, all_steps = sw.mode, sw.steps
    reasons: dict[int, list[dict]] = {}

    def add(step, reason, ranks, detail):
        reasons.setdefault(int(step), []).append({"step": int(step), "reason": reason, "ranks": sorted(set(ranks)),
                                                  "detail": detail})

    for (step, rank), g in waits.groupby(["step", "rank"]):
        if step < 0:
            continue
        w = g.sort_values("sync_us", ascending=False, kind="stable").iloc[0]
        add(step, "startup_wait", [rank], f"rank {rank}'s {w['collective']} #{int(w['instance'])} waited "
                                          f"{g['sync_us'].sum() / 1e3:.3f} ms for ranks that had not started profiling")
    ranks_with_steps = sorted(int(r) for r in steps["rank"].unique())
    # per step, then per (rank, step): read as whole columns, not a pandas lookup per step (a trace of many short
    # steps has tens of thousands)
    seen = steps.groupby("step")["rank"].nunique()
    short = set(seen.index[seen.to_numpy() < len(ranks_with_steps)].tolist())
    for step, g in (steps[steps["step"].isin(short)].groupby("step") if short else ()):
        missing = sorted(set(ranks_with_steps) - set(int(r) for r in g["rank"]))
        if missing:
            add(step, "missing_ranks", missing, f"not marked on rank(s) {', '.join(map(str, missing))}")
    for r, s in _empty_steps(steps, ops_per):
        add(s, "empty", [r], f"rank {r} ran no op in it while its other steps did")
    for s, (reason, detail) in manifest_step_roles(manifest).items():
        if s in all_steps:
            add(s, reason, ranks_with_steps, detail)
    sw.excluded = [e for s in sorted(reasons) for e in reasons[s]]
    if mode == ALL:
        return sw
    used = [s for s in all_steps if s not in reasons]
    if not used:
        # every step has a reason: keep those whose only reason is a start-up wait, with the wait cut out
        used = [s for s in all_steps if all(e["reason"] == "startup_wait" for e in reasons[s])]
        if used:
            sw.notes.append(f"no step is free of start-up effects: step(s) {_ranges(used)} kept with the start-up "
                            f"wait cut out of the rank's timeline")
            for w in waits[waits["step"].isin(used)].itertuples(index=False):
                sw.cuts.setdefault(int(w.rank), []).append((int(w.wait_start_ns), int(w.wait_end_ns)))
        else:
            used = list(all_steps)
            sw.notes.append("every step has a reason to be left out: all steps used (read them as whole-window figures)")
    sw.used = used
    return sw


def window_events(gpu: pd.DataFrame, sw: StepWindow) -> pd.DataFrame:
    """GPU events the views read: those launched in the used steps (steady mode); the whole table in
    "all" mode or when the trace marks no steps. Times are the trace's (cuts are applied by the caller:
    `timeline.gpu_timeline(..., cuts=)` and `clip_durations`)."""
    if not sw.restricts or gpu.empty:
        return gpu
    keep = gpu["step"].isin(sw.used).to_numpy()
    # every event in the used steps (a trace whose steps are all steady): the table itself, not a copy of each column
    # (~260 MB for the 800,000 GPU events of a 2 GB trace of short steps)
    return gpu if keep.all() else gpu[keep]


def clip_durations(gpu: pd.DataFrame, cuts: dict) -> pd.DataFrame:
    """A copy with each event's part inside a cut interval of its rank removed: `dur` is the time left;
    an event whose start (end) falls in a cut starts (ends) at the cut's edge. Without cuts: `gpu` itself."""
    if not cuts or gpu.empty:
        return gpu
    g = gpu.copy()
    dur = g["dur"].to_numpy().astype(np.int64).copy()
    s = g["ts"].to_numpy().astype(np.int64).copy()
    e = g["end"].to_numpy().astype(np.int64).copy()
    rank = g["rank"].to_numpy()
    for r, ivs in cuts.items():
        m = rank == r
        for cs, ce in ivs:
            over = np.clip(np.minimum(e, ce) - np.maximum(s, cs), 0, None)
            dur[m] -= over[m]
            head = m & (s >= cs) & (s < ce)
            tail = m & (e > cs) & (e <= ce) & ~head
            s[head] = np.minimum(np.maximum(s[head], ce), e[head])
            e[tail] = np.maximum(cs, s[tail])
    g["dur"], g["ts"], g["end"] = dur, s, e
    return g


# ------------------------------------------------------------------------------- host per step

def _window_steps(analysis) -> pd.DataFrame:
    """The steps table restricted to the window's steps (every step in "all" mode)."""
    sw = getattr(analysis, "window", None)
    st = analysis.steps
    if sw is not None and sw.restricts:
        st = st[st["step"].isin(sw.used)]
    return st


def host_step_table(analysis) -> pd.DataFrame:
    """Per rank and profiler step of the window: the host step time (the step annotation), the host time
    in ops (self time summed: what the CPU spent inside ops, no double counting of nesting), and the host
    time of the MoE stages (`moe/<stage>` record_function ranges of the trainer, all stages together).
    Per rank, never summed over ranks; a steady flag says whether the window uses the step."""
    from .calltree import KIND_ANNOTATION, KIND_OP

    a = analysis
    cols = ["rank", "step", "step_time_us", "op_self_us", "moe_us", "steady"]
    if a.steps.empty:
        return pd.DataFrame(columns=cols)
    sw = getattr(a, "window", None)
    t = a.tree
    tstep = host_steps(t, a.steps)
    kind = t["kind"].to_numpy()
    is_moe = (kind == KIND_ANNOTATION) & C.map_strings(t["name"], lambda s: s.startswith("moe/"))
    # a moe/<stage> range inside another moe/ range is counted once, by its outermost moe/ ancestor
    is_moe &= ~C.map_strings(t["path"], lambda p: "moe/" in p.rsplit("/", 1)[0] if "/" in p else False)
    rank = t["rank"].to_numpy()
    key = pd.MultiIndex.from_arrays([rank, tstep])
    op_self = pd.Series(np.where(kind == KIND_OP, t["self_dur"].to_numpy(), 0), index=key).groupby(level=[0, 1]).sum()
    moe = pd.Series(np.where(is_moe, t["dur"].to_numpy(), 0), index=key).groupby(level=[0, 1]).sum()
    st = a.steps
    idx = pd.MultiIndex.from_arrays([st["rank"].to_numpy(), st["step"].to_numpy()])
    used = set(sw.used) if sw is not None and sw.restricts else None
    out = pd.DataFrame({
        "rank": st["rank"].astype(int).to_numpy(), "step": st["step"].astype(int).to_numpy(),
        "step_time_us": (st["end"] - st["start"]).to_numpy() / US,
        "op_self_us": op_self.reindex(idx).fillna(0).to_numpy() / US,
        "moe_us": moe.reindex(idx).fillna(0).to_numpy() / US,
        "steady": [used is None or int(s) in used for s in st["step"]],
    })
    return out.sort_values(["rank", "step"], ignore_index=True, kind="stable")[cols]


def moe_stage_table(analysis) -> pd.DataFrame:
    """Per rank and MoE stage (`moe/<stage>` ranges, e.g. moe/router, moe/permute, moe/experts,
    moe/unpermute): host time per step (mean over the window's steps), calls per step and the share of the
    rank's host step time; GPU time per step too when the trace has GPU activity."""
    from .calltree import KIND_ANNOTATION

    a = analysis
    cols = ["rank", "stage", "calls_per_step", "host_us_per_step", "share_of_step", "gpu_us_per_step"]
    st = _window_steps(a)
    t = a.tree
    if st.empty:
        return pd.DataFrame(columns=cols)
    tstep = host_steps(t, a.steps)
    kind = t["kind"].to_numpy()
    sel = (kind == KIND_ANNOTATION) & C.map_strings(t["name"], lambda s: s.startswith("moe/")) & np.isin(tstep, st["step"].unique())
    if not sel.any():
        return pd.DataFrame(columns=cols)
    rows = t.loc[sel, ["rank", "name", "dur"]]
    df = pd.DataFrame({"rank": rows["rank"].to_numpy(), "stage": C.strings(rows["name"]), "dur": rows["dur"].to_numpy()})
    n_steps = st.groupby("rank")["step"].nunique()
    step_us = st.assign(d=(st["end"] - st["start"]) / US).groupby("rank")["d"].sum()
    g = df.groupby(["rank", "stage"], sort=False)["dur"].agg(["size", "sum"]).reset_index()
    n = g["rank"].map(n_steps).astype(float)
    out = pd.DataFrame({"rank": g["rank"].astype(int), "stage": g["stage"], "calls_per_step": g["size"] / n,
                        "host_us_per_step": g["sum"] / US / n,
                        "share_of_step": g["sum"] / US / g["rank"].map(step_us).astype(float)})
    gpu = getattr(a, "gpu_window", None)
    if gpu is not None and not gpu.empty:
        # GPU time launched under each stage: per (rank, path) first (few distinct paths), then by name
        by_path = gpu.groupby(["rank", "path"], observed=True)["dur"].sum().reset_index()
        by_path["path"] = by_path["path"].astype(str)
        vals = []
        for r, s, k in zip(out["rank"], out["stage"], n):
            segs = by_path["path"].map(lambda p, s=s: s in p.split("/") if "/" not in s else
                                       (p == s or p.startswith(s + "/") or ("/" + s + "/") in (p + "/")))
            m = (by_path["rank"] == r).to_numpy() & segs.to_numpy(dtype=bool)
            vals.append(float(by_path.loc[m, "dur"].sum()) / US / k)
        out["gpu_us_per_step"] = vals
    else:
        out["gpu_us_per_step"] = np.nan
    return out.sort_values(["rank", "host_us_per_step"], ascending=[True, False], ignore_index=True, kind="stable")[cols]


def host_top_ops(analysis, top: int = 10) -> pd.DataFrame:
    """Per rank: the ops with the most host self time per step (mean over the window's steps), with their
    share of the rank's host step time. The whole window when the trace marks no steps (steps = 1). A
    wrapper range (`categories.WRAPPER_RANGES`: PythonSubclass) is no op: its self time counts in the op
    enclosing it."""
    from .calltree import KIND_OP

    a = analysis
    cols = ["rank", "op", "calls_per_step", "self_us_per_step", "share_of_step"]
    t = a.tree
    is_op = t["kind"].to_numpy() == KIND_OP
    mask = getattr(a, "host_window", None)
    if mask is not None:
        is_op = is_op & np.asarray(mask, dtype=bool)
    if not is_op.any():
        return pd.DataFrame(columns=cols)
    st = _window_steps(a)
    ops = t.loc[is_op, ["rank", "name", "self_dur", "parent"]]
    self_us = ops["self_dur"].to_numpy().astype(np.int64)
    wrap = C.isin(ops["name"], C.WRAPPER_RANGES)
    if wrap.any():  # a wrapper range's self time is the enclosing op's (categories.WRAPPER_RANGES)
        into = C.positions(ops.index, ops["parent"].to_numpy()[wrap])  # -1: its parent is no op of the window
        np.add.at(self_us, into[into >= 0], self_us[wrap][into >= 0])
        keep = ~wrap
        keep[np.flatnonzero(wrap)[into < 0]] = True
        ops, self_us = ops[keep], self_us[keep]
    df = pd.DataFrame({"rank": ops["rank"].to_numpy(), "op": C.strings(ops["name"]), "self": self_us})
    g = df.groupby(["rank", "op"], sort=False)["self"].agg(["size", "sum"]).reset_index()
    if st.empty:
        n = pd.Series(1.0, index=g.index)
        step_us = g["rank"].map(lambda r: float("nan"))
    else:
        n = g["rank"].map(st.groupby("rank")["step"].nunique()).astype(float)
        step_us = g["rank"].map(st.assign(d=(st["end"] - st["start"]) / US).groupby("rank")["d"].sum()).astype(float)
    out = pd.DataFrame({"rank": g["rank"].astype(int), "op": g["op"], "calls_per_step": g["size"] / n,
                        "self_us_per_step": g["sum"] / US / n, "share_of_step": g["sum"] / US / step_us})
    out = out.sort_values(["rank", "self_us_per_step"], ascending=[True, False], kind="stable")
    return out.groupby("rank", sort=True).head(top).reset_index(drop=True)[cols]


def profiler_overhead(manifest: dict | None) -> dict | None:
    """Profiled vs unprofiled step times from a run manifest (metrics.step_times_s, profile window):
    the profiled steps' median over the median of the steps timed without the profiler (warm-up steps,
    the profiled steps and the trace-export step left out). None without the data."""
    if not manifest:
        return None
    m = manifest.get("metrics") if isinstance(manifest.get("metrics"), dict) else {}
    p = manifest.get("profile") if isinstance(manifest.get("profile"), dict) else {}
    times, lo, hi = m.get("step_times_s"), p.get("step_start"), p.get("step_end")
    if not isinstance(times, list) or not isinstance(lo, int) or not isinstance(hi, int) or hi <= lo:
        return None
    ok = [isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in times]
    roles = manifest_step_roles(manifest)
    prof = [i for i in range(lo, min(hi, len(times))) if ok[i]]
    free = [i for i in range(len(times)) if ok[i] and not (lo <= i <= hi) and roles.get(i, ("",))[0] != "warmup"]
    if not prof or not free:
        return None
    pt = [float(times[i]) * 1e6 for i in prof]
    ft = [float(times[i]) * 1e6 for i in free]
    med_p, med_f = float(np.median(pt)), float(np.median(ft))
    # every profiled step slower than every unprofiled one: by chance (no profiler effect, exchangeable step
    # times) that happens with probability 1 / C(m + k, m) (the exact Mann-Whitney extreme)
    from math import comb

    p_chance = 1.0 / comb(len(pt) + len(ft), len(pt))
    return {"profiled_steps": prof, "unprofiled_steps": free, "profiled_median_us": round(med_p, 3),
            "unprofiled_median_us": round(med_f, 3), "unprofiled_max_us": round(max(ft), 3),
            "profiled_min_us": round(min(pt), 3), "overhead": round(med_p / med_f - 1.0, 4) if med_f > 0 else None,
            "p_value": round(p_chance, 4), "beyond_noise": bool(min(pt) > max(ft) and p_chance <= 0.05)}

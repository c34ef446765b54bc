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
    """Per-step metrics of an `Analysis` (median/spread are taken by the caller)."""
    a = analysis
    syncs = host_sync_calls(a.tree)
    kernels = a.gpu[a.gpu["kind"] == "kernel"]
    if not a.step_timeline.empty:
        st = a.step_timeline
        host_steps = a.steps.assign(step_time_us=(a.steps["end"] - a.steps["start"]) / US)
        rows = []
        for step, g in st.groupby("step"):
            # a start-up wait (a collective waiting for ranks not yet profiling) is not the step's cost
            wait = g.set_index("rank")["startup_wait_us"] if "startup_wait_us" in g else pd.Series(dtype=float)
            hs = host_steps[host_steps["step"] == step].set_index("rank")["step_time_us"]
            hs = hs - wait.reindex(hs.index).fillna(0.0)
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
                "kernels": float(g["kernel_count"].mean()),
                "host_syncs": float(sync_n) / max(1, a.trace_rank_count),
            })
        return StepFigures("profiler steps", len(rows), pd.DataFrame(rows))
    if a.timeline.empty and not a.steps.empty:
        # CPU-only trace with profiler steps: the step time is the host step range (slowest rank); GPU
        # figures are unknown (NaN), not zero, so a diff never reports a fake GPU change
        hs = a.steps.assign(step_time_us=(a.steps["end"] - a.steps["start"]) / US)
        nan = float("nan")
        rows = [{"step": int(step), "step_time_us": float(g["step_time_us"].max()), "gpu_span_us": nan,
                 "gpu_busy_us": nan, "gpu_idle_us": nan, "compute_us": nan, "comm_us": nan,
                 "exposed_comm_us": nan, "kernels": 0.0,
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
    """Per op key (path / top-level op / op / input dims): GPU time and wall share (GPU + idle before)."""
    g = analysis.gpu
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

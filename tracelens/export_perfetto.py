"""Export a loaded trace and its findings as one Perfetto trace (ui.perfetto.dev).

Layout: one process per rank ("rank N"); under it, a track per GPU stream and per CPU thread with the
raw events as slices (nested by the call tree on CPU threads), plus analysis tracks:
    analysis: collective sync wait   the part of each collective kernel spent waiting for the last rank
    analysis: exposed comm           communication intervals not overlapped by compute
    analysis: host syncs             blocking device-to-host sync calls, named by the op that issued them
    analysis: GPU idle               idle gaps labelled by cause (sync / launch-bound / other)
All ranks share one clock (ns since the earliest event of the run), so what happens at the same time on
two ranks lines up. Written with the `perfetto` package's protobuf builder, streamed to the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from . import categories as C
from .analysis import intervals as I
from .analysis.calltree import KIND_RUNTIME
from .errors import TraceError

_SEQ = 7  # one trusted packet sequence for the whole file


class _Writer:
    def __init__(self, f, t0: int):
        from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

        self.b = StreamingTraceProtoBuilder(f)
        self.t0 = t0
        self.next_uuid = 1000
        self.slices = 0

    def _uuid(self) -> int:
        self.next_uuid += 1
        return self.next_uuid

    def process(self, pid: int, name: str) -> int:
        p = self.b.create_packet()
        uuid = self._uuid()
        p.track_descriptor.uuid = uuid
        p.track_descriptor.process.pid = pid
        p.track_descriptor.process.process_name = name
        self.b.write_packet(p)
        return uuid

    def track(self, parent: int, name: str, order: int) -> int:
        p = self.b.create_packet()
        uuid = self._uuid()
        p.track_descriptor.uuid = uuid
        p.track_descriptor.parent_uuid = parent
        p.track_descriptor.name = name
        p.track_descriptor.sibling_order_rank = order
        self.b.write_packet(p)
        return uuid

    def slices_on(self, track: int, starts: np.ndarray, ends: np.ndarray, names: list[str],
                  depth: np.ndarray | None = None, args: list[dict] | None = None) -> None:
        """Slices as BEGIN/END pairs in an order Perfetto accepts: by time; at one instant the ends of
        slices with a duration first, deeper ones first, then the begins, shallower ones first (in the
        given order at equal depth), a zero-duration slice's end right after its own begin, so it
        nests where it is and never closes its parent or stays open."""
        n = len(starts)
        if n == 0:
            return
        depth = np.zeros(n, dtype=np.int64) if depth is None else np.asarray(depth, dtype=np.int64)
        starts = np.asarray(starts, dtype=np.int64)
        ends = np.maximum(np.asarray(ends, dtype=np.int64), starts)  # an end before its begin: zero duration
        zero = ends == starts
        ts = np.concatenate([starts, ends]) - self.t0
        kind = np.concatenate([np.ones(n, np.int64), np.zeros(n, np.int64)])  # 0 = end, 1 = begin
        # class 0: ends of slices with a duration; class 1: begins and zero-duration ends
        cls = np.concatenate([np.ones(n, np.int64), zero.astype(np.int64)])
        tie = np.concatenate([depth, np.where(zero, depth, -depth)])
        sub = np.concatenate([2 * np.arange(n), 2 * np.arange(n) + 1])
        idx = np.concatenate([np.arange(n), np.arange(n)])
        order = np.lexsort((sub, tie, cls, ts))
        for o in order:
            i = idx[o]
            p = self.b.create_packet()
            p.timestamp = int(max(ts[o], 0))
            p.trusted_packet_sequence_id = _SEQ
            te = p.track_event
            te.track_uuid = track
            if kind[o] == 1:
                te.type = te.TYPE_SLICE_BEGIN
                te.name = names[i]
                if args is not None and args[i]:
                    for k, v in args[i].items():
                        a = te.debug_annotations.add()
                        a.name = k
                        if isinstance(v, (int, np.integer)):
                            a.int_value = int(v)
                        elif isinstance(v, (float, np.floating)):
                            a.double_value = float(v)
                        else:
                            a.string_value = str(v)
                self.slices += 1
            else:
                te.type = te.TYPE_SLICE_END
            self.b.write_packet(p)


def _nested_ends(tree: pd.DataFrame) -> np.ndarray:
    """Slice ends clamped to their parent's end, so every thread's slices nest exactly."""
    ts = tree["ts"].to_numpy()
    end = ts + tree["dur"].to_numpy()
    par = tree["parent"].to_numpy()
    pos = np.searchsorted(tree.index.to_numpy(), np.maximum(par, 0))
    out = end.copy()
    for _ in range(int(tree["depth"].max()) + 1 if len(tree) else 0):
        has = par >= 0
        new = np.where(has, np.minimum(out, out[pos]), out)
        if np.array_equal(new, out):
            break
        out = new
    return np.maximum(out, ts)


def export_perfetto(analysis, out: str | os.PathLike) -> dict:
    """Write the Perfetto trace; returns counts of tracks and slices written."""
    a = analysis
    ev = a.trace.events
    if ev.empty:
        raise TraceError(None, "nothing to export: the trace has no events")
    t0 = int(ev["ts"].min())
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    inst = a.comm_instances() if a.has_gpu else pd.DataFrame()
    syncs = a.host_syncs() if a.has_gpu else pd.DataFrame()
    gaps = a.idle_gaps() if a.has_gpu else pd.DataFrame()
    threads = a.trace.threads
    tracks = 0
    tmp = out.with_suffix(out.suffix + ".tmp")
    with open(tmp, "wb") as f:
        w = _Writer(f, t0)
        for info in a.trace.ranks:
            r = info.rank
            proc = w.process(100_000 + r, f"rank {r}" + (f" ({info.device_name})" if info.device_name else ""))
            order = 0
            # GPU streams
            g = a.gpu[a.gpu["rank"] == r]
            for (dev, stream), gs in g.groupby(["pid", "stream"], sort=True):
                t = w.track(proc, f"GPU {dev} stream {stream}", order)
                order += 1
                tracks += 1
                names = [C.short_kernel_name(n, 120) for n in gs["name"].astype(str)]
                args = [{"op": o, "category": c} for o, c in zip(gs["op"].astype(str), gs["category"].astype(str))]
                w.slices_on(t, gs["ts"].to_numpy(), gs["end"].to_numpy(), names, args=args)
            # analysis tracks
            if not inst.empty:
                ir = inst[(inst["rank"] == r) & (inst["sync_us"] > 0)]
                if len(ir):
                    t = w.track(proc, "analysis: collective sync wait", order)
                    order += 1
                    tracks += 1
                    s = (ir["start_us"] * 1000).round().astype(np.int64).to_numpy() + t0
                    e = s + (ir["sync_us"] * 1000).round().astype(np.int64).to_numpy()
                    names = [f"wait {c}#{i}{' (start-up)' if su else ''}" for c, i, su in
                             zip(ir["collective"], ir["instance"], ir["startup"])]
                    w.slices_on(t, s, e, names, args=[{"last_rank": int(x)} for x in ir["last_rank"]])
                kr = g[g["is_comm"].to_numpy() & (g["kind"] == "kernel").to_numpy()]
                cp = g[(~g["is_comm"].to_numpy()) & (g["kind"] == "kernel").to_numpy()]
                if len(kr):
                    cs, ce = I.union(kr["ts"].to_numpy(), kr["end"].to_numpy())
                    exposed_s, exposed_e = _subtract(cs, ce, *I.union(cp["ts"].to_numpy(), cp["end"].to_numpy()))
                    if len(exposed_s):
                        t = w.track(proc, "analysis: exposed comm", order)
                        order += 1
                        tracks += 1
                        w.slices_on(t, exposed_s, exposed_e, ["exposed comm"] * len(exposed_s))
            if len(syncs):
                sr = syncs[syncs["rank"] == r]
                if len(sr):
                    t = w.track(proc, "analysis: host syncs", order)
                    order += 1
                    tracks += 1
                    s = sr["ts"].to_numpy()
                    e = s + (sr["host_blocked_us"] * 1000).round().astype(np.int64).to_numpy()
                    w.slices_on(t, s, e, [f"sync: {o}" for o in sr["op"]],
                                args=[{"via": v, "call": c, "gpu_idle_caused_us": float(x)}
                                      for v, c, x in zip(sr["via"], sr["call"], sr["gpu_idle_caused_us"])])
            if len(gaps):
                gr = gaps[gaps["rank"] == r]
                if len(gr):
                    t = w.track(proc, "analysis: GPU idle", order)
                    order += 1
                    tracks += 1
                    w.slices_on(t, gr["start_ns"].to_numpy(), gr["end_ns"].to_numpy(), [f"idle: {c}" for c in gr["cause"]],
                                args=[{"next_op": o} for o in gr["next_top_op"]])
            # CPU threads (host call tree)
            tr = a.tree[a.tree["rank"] == r]
            for (pid, tid), ts_ in tr.groupby(["pid", "tid"], sort=True):
                label = _thread_name(threads, r, pid, tid)
                t = w.track(proc, label, order)
                order += 1
                tracks += 1
                ends = _nested_ends(ts_)
                kinds = ts_["kind"].to_numpy()
                names = ts_["name"].astype(str).tolist()
                w.slices_on(t, ts_["ts"].to_numpy(), ends, names, depth=ts_["depth"].to_numpy(),
                            args=[{"correlation": int(c)} if k == KIND_RUNTIME else None
                                  for k, c in zip(kinds, ts_["correlation"].to_numpy())])
    os.replace(tmp, out)
    return {"tracks": tracks, "slices": w.slices, "path": str(out)}


def _subtract(as_, ae, bs, be):
    """Intervals of A (disjoint, sorted) not covered by B (disjoint, sorted)."""
    out_s, out_e = [], []
    j = 0
    for s, e in zip(as_.tolist(), ae.tolist()):
        cur = s
        while j < len(bs) and be[j] <= cur:
            j += 1
        k = j
        while k < len(bs) and bs[k] < e:
            if bs[k] > cur:
                out_s.append(cur)
                out_e.append(int(bs[k]))
            cur = max(cur, int(be[k]))
            k += 1
        if cur < e:
            out_s.append(cur)
            out_e.append(e)
    return np.asarray(out_s, dtype=np.int64), np.asarray(out_e, dtype=np.int64)


def _thread_name(threads: pd.DataFrame, rank: int, pid: int, tid: int) -> str:
    t = threads[(threads["rank"] == rank) & (threads["pid"] == pid) & (threads["tid"] == tid) &
                (threads["kind"] == "thread_name")]
    name = str(t["value"].iloc[0]) if len(t) else ""
    return f"CPU {name}" if name and name != "None" else f"CPU thread {tid}"


def export_pipeline_perfetto(result, out: str | os.PathLike) -> dict:
    """Write a pipeline schedule (`tracelens.analysis.pipeline.PipelineAnalysis`) as a Perfetto trace.

    One process per rank ("rank N (pp rank P)"); under it one track per pipeline stage the rank runs
    ("stage S"), with every action of the analyzed steps as a slice named "F mb3" (args: kind, stage,
    microbatch, step), and a "bubbles" track with the rank's idle intervals inside each step's window.
    Times are ns since the first action, on the run's shared clock. Returns counts of tracks and slices.
    """
    from .analysis.pipeline import bubble_gaps

    acts = result.selected
    if acts.empty:
        raise TraceError(None, "nothing to export: no pipeline actions in the analyzed steps")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = int(acts["start_ns"].min())
    gaps = bubble_gaps(acts)
    tracks = 0
    tmp = out.with_suffix(out.suffix + ".tmp")
    with open(tmp, "wb") as f:
        w = _Writer(f, t0)
        for (rank, pp_rank), ra in acts.groupby(["rank", "pp_rank"], sort=True):
            proc = w.process(200_000 + int(rank), f"rank {rank} (pp rank {pp_rank})")
            order = 0
            for stage, sa in ra.groupby("stage", sort=True):
                t = w.track(proc, f"stage {stage}", order)
                order += 1
                tracks += 1
                sa = sa.sort_values(["start_ns", "end_ns"], kind="stable")
                kinds = sa["kind"].astype(str).tolist()
                mbs = sa["microbatch"].tolist()
                starts = sa["start_ns"].to_numpy()
                # slices on one track must not partly overlap: cut an end at the next action's start
                ends = np.maximum(np.minimum(sa["end_ns"].to_numpy(), np.r_[starts[1:], np.iinfo(np.int64).max]), starts)
                w.slices_on(t, starts, ends,
                            [f"{k} mb{m}" for k, m in zip(kinds, mbs)],
                            args=[{"kind": k, "stage": int(stage), "microbatch": int(m), "step": int(s)}
                                  for k, m, s in zip(kinds, mbs, sa["step"].tolist())])
            g = gaps[gaps["rank"] == rank]
            if len(g):
                t = w.track(proc, "bubbles", order)
                tracks += 1
                w.slices_on(t, g["start_ns"].to_numpy(), g["end_ns"].to_numpy(), [f"bubble ({x})" for x in g["where"]],
                            args=[{"step": int(s)} for s in g["step"]])
    os.replace(tmp, out)
    return {"tracks": tracks, "slices": w.slices, "path": str(out)}

"""Replay a step: the host issues work, the device runs it, blocking syncs join the two.

The mechanism behind launch-bound idle, sync waits and GPU-bound steps, as a discrete-event
simulation over a :class:`~tracelens.projection.profile.StepProfile`:

* The host walks its items (launches and syncs) in the order it issued them. Between two items it
  spends the host time the trace shows (``gap``, times ``host_scale``: the profiler inflates host
  time, calibration finds how much).
* A launched unit starts on its stream when the host has launched it (plus the launch latency
  ``latency``), its stream is free, and the unit on another stream it waited for in the trace (an
  event dependency, found from the measured timeline) has ended; it runs for its (possibly changed)
  duration.
* A blocking sync returns when every unit launched before it has ended (plus the return latency
  measured at that sync), or after its own minimum cost when the device is already idle.

With nothing changed the replay reproduces the measured step (``fidelity`` says how closely). On a
CPU-only profile the host is the device: the step is the host time between ops plus the ops' own
time.

The replayed timeline is then cut into the step's components: each moment of device work goes to
the highest-priority component running (computation before copies before communication, so only
exposed communication counts), each idle moment to its cause (the host was blocked in a sync, the
host had not launched the next unit yet, or something else), so the parts add up to the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..analysis import intervals as I
from .profile import COMPONENTS, StepProfile

# order in which overlapping work is credited (earlier wins)
_PRIORITY = ("expert GEMMs", "dense GEMMs", "attention", "norms/activations", "optimizer step", "other",
             "copies/casts", "exposed communication")
_TOL_NS = 2_000  # two timestamps this close count as the same moment (trace clocks are µs-rounded)


@dataclass
class Program:
    """A step profile prepared for replay (host order, gaps, dependencies), in ns relative to the step start."""

    profile: StepProfile
    order_kind: np.ndarray  # 0 = unit, 1 = sync, per host item in host order
    order_idx: np.ndarray  # index into units or syncs
    gap: np.ndarray  # host time before each item (ns)
    tail: float  # host time after the last item until the step ends
    stream: np.ndarray  # per unit
    dep: np.ndarray  # per unit: the unit on another stream it waited for, or -1
    wait: np.ndarray  # per unit: unexplained extra wait before it started (kept constant)
    sync_min: np.ndarray  # per sync: cost when nothing is pending
    sync_ret: np.ndarray  # per sync: return latency after the device drained
    latency: float  # launch -> start when nothing else holds a unit back
    cpu: bool
    gap_expert: np.ndarray | None = None  # per item: the part of its host gap spent in the expert stage's ops


def prepare(p: StepProfile) -> Program:
    w = p.work
    n = len(w)
    if p.device == "cpu":
        busy = float(w["dur"].sum())
        tail = max(float(p.step_ns) - busy, 0.0)
        z = np.zeros(n)
        return Program(p, np.zeros(n, np.int8), np.arange(n), z, tail, np.zeros(n, np.int64), np.full(n, -1),
                       z, np.zeros(0), np.zeros(0), 0.0, True)
    launch = w["launch"].to_numpy(np.int64) - p.start
    start = w["start"].to_numpy(np.int64) - p.start
    dur = w["dur"].to_numpy(np.int64)
    end = start + dur
    stream = w["stream"].to_numpy(np.int64)
    lag = start - launch
    pos = lag[lag > 0]
    latency = float(np.percentile(pos, 5)) if len(pos) else 0.0
    # per unit: the previous unit on its stream, and what held it back
    dep = np.full(n, -1, dtype=np.int64)
    wait = np.zeros(n)
    order = np.argsort(start, kind="stable")
    last_end: dict[int, int] = {}
    ends_sorted_idx = np.argsort(end, kind="stable")
    ends_sorted = end[ends_sorted_idx]
    for k in order:
        s = int(stream[k])
        ready = max(launch[k] + latency, last_end.get(s, -1 << 62))
        if start[k] > ready + _TOL_NS:
            # waited for something: the unit on another stream that ended last before it started
            j = np.searchsorted(ends_sorted, start[k] + _TOL_NS, side="right") - 1
            while j >= 0 and stream[ends_sorted_idx[j]] == s:
                j -= 1
            if j >= 0 and ends_sorted[j] > ready:
                dep[k] = ends_sorted_idx[j]
                ready = max(ready, ends_sorted[j])
            wait[k] = max(start[k] - ready, 0)
        last_end[s] = max(last_end.get(s, 0), end[k])
    sy = p.syncs
    sts = sy["ts"].to_numpy(np.int64) - p.start
    sen = sy["end"].to_numpy(np.int64) - p.start
    # host order: launches by launch time, syncs by their start; a sync sorts after launches at the same time
    keys = np.concatenate([launch.astype(np.float64), sts.astype(np.float64) + 0.5])
    kinds = np.concatenate([np.zeros(n, np.int8), np.ones(len(sy), np.int8)])
    idx = np.concatenate([np.arange(n), np.arange(len(sy))])
    o = np.argsort(keys, kind="stable")
    kinds, idx = kinds[o], idx[o]
    gap = np.zeros(len(o))
    release = 0
    sync_min = np.zeros(len(sy))
    sync_ret = np.zeros(len(sy))
    for i, (kd, j) in enumerate(zip(kinds, idx)):
        t = launch[j] if kd == 0 else sts[j]
        gap[i] = max(t - release, 0)
        if kd == 0:
            release = max(release, t)
        else:
            # what the sync waited for: every unit launched before it
            before = launch <= sts[j]
            drain = int(end[before].max()) if before.any() else 0
            sync_ret[j] = max(sen[j] - max(drain, sts[j]), 0)
            sync_min[j] = sync_ret[j]
            release = max(release, sen[j])
    tail = max(float(p.step_ns) - release, 0.0)
    gx = _gap_overlap(kinds, idx, launch, sts, sen, gap, p)
    return Program(p, kinds, idx, gap, tail, stream, dep, wait, sync_min, sync_ret, latency, False, gx)


def _gap_overlap(kinds, idx, launch, sts, sen, gap, p: StepProfile) -> np.ndarray:
    """Per host item: how much of the host time before it was spent inside the expert stage's own CPU
    ops (``StepProfile.expert_host``)."""
    eh = p.expert_host
    out = np.zeros(len(gap))
    if eh is None or not len(eh):
        return out
    us, ue = I.union(eh["ts"].to_numpy(np.int64) - p.start, eh["end"].to_numpy(np.int64) - p.start)
    cum = np.concatenate([[0], np.cumsum(ue - us)])

    def covered(a: float, b: float) -> float:  # length of [a, b] inside the union
        if b <= a:
            return 0.0
        i = np.searchsorted(ue, a, side="right")
        j = np.searchsorted(us, b, side="left")
        if j <= i:
            return 0.0
        tot = cum[j] - cum[i]
        tot -= max(0, a - us[i])
        tot -= max(0, ue[j - 1] - b)
        return float(max(tot, 0))

    for n, (kd, j) in enumerate(zip(kinds, idx)):
        t = launch[j] if kd == 0 else sts[j]
        out[n] = min(covered(t - gap[n], t), gap[n])
    return out


@dataclass
class Result:
    step_ns: float
    components: dict  # component -> ns (adds up to step_ns)
    start: np.ndarray | None = None
    end: np.ndarray | None = None


def run(prog: Program, dur: np.ndarray | None = None, keep_unit: np.ndarray | None = None,
        keep_sync: np.ndarray | None = None, host_scale: float = 1.0, gap_scale: np.ndarray | None = None,
        component: np.ndarray | None = None) -> Result:
    """Replay ``prog`` with unit durations ``dur`` (default: measured), units/syncs dropped where
    ``keep_*`` is False (their host gap goes with them), host gaps times ``host_scale`` (and per item
    ``gap_scale``). Returns the step time and its components."""
    w = prog.profile.work
    n = len(w)
    d = w["dur"].to_numpy(np.float64) if dur is None else np.asarray(dur, dtype=np.float64)
    ku = np.ones(n, bool) if keep_unit is None else keep_unit
    comp = w["component"].to_numpy() if component is None else component
    if prog.cpu:
        busy_by = {}
        for c in set(comp[ku]):
            busy_by[c] = float(d[ku & (comp == c)].sum())
        other_host = prog.tail * host_scale
        total = sum(busy_by.values()) + other_host
        comps = {c: 0.0 for c in COMPONENTS}
        for c, v in busy_by.items():
            comps[c] = comps.get(c, 0.0) + v
        comps["other"] += other_host
        return Result(total, comps)
    ks = np.ones(len(prog.sync_min), bool) if keep_sync is None else keep_sync
    gs = np.ones(len(prog.gap)) if gap_scale is None else gap_scale
    start = np.full(n, np.nan)
    end = np.full(n, np.nan)
    cause = np.zeros(n, np.int8)  # idle before this unit: 0 none/other, 1 sync, 2 launch
    h = 0.0
    free: dict[int, float] = {}
    drain = 0.0
    last_sync_release = -1.0
    lat = prog.latency
    stream, dep, wait = prog.stream, prog.dep, prog.wait
    for i in range(len(prog.gap)):
        j = int(prog.order_idx[i])
        if prog.order_kind[i] == 0:
            if not ku[j]:
                continue
            h += prog.gap[i] * host_scale * gs[i]
            s_free = free.get(int(stream[j]), 0.0)
            t_launch = h + lat
            s = max(t_launch, s_free)
            dj = dep[j]
            if dj >= 0 and ku[dj] and not np.isnan(end[dj]):
                s = max(s, end[dj])
            s += wait[j]
            if s > drain + _TOL_NS:
                if last_sync_release >= drain and t_launch >= s - wait[j] - _TOL_NS:
                    cause[j] = 1
                elif t_launch >= s - wait[j] - _TOL_NS:
                    cause[j] = 2
            e = s + d[j]
            start[j], end[j] = s, e
            free[int(stream[j])] = e
            if e > drain:
                drain = e
        else:
            if not ks[j]:
                continue
            h += prog.gap[i] * host_scale * gs[i]
            h = max(h + prog.sync_min[j], drain + prog.sync_ret[j])
            last_sync_release = h
    h += prog.tail * host_scale
    step = max(h, drain)
    comps = decompose(start, end, comp, ku, cause, step)
    return Result(step, comps, start, end)


def decompose(start: np.ndarray, end: np.ndarray, comp: np.ndarray, keep: np.ndarray, cause: np.ndarray,
              step: float) -> dict:
    """Cut [0, step] into components: work by priority (exclusive), idle gaps by their cause."""
    out = {c: 0.0 for c in COMPONENTS}
    ok = keep & ~np.isnan(start)
    s_all, e_all = start[ok], end[ok]
    covered_s = np.zeros(0)
    covered_e = np.zeros(0)
    for c in _PRIORITY:
        m = ok & (comp == c)
        if not m.any():
            continue
        us, ue = I.union(start[m], end[m])
        both_s, both_e = I.union(np.concatenate([covered_s, us]), np.concatenate([covered_e, ue]))
        out[c] += float(I.length(both_s, both_e) - I.length(covered_s, covered_e))
        covered_s, covered_e = both_s, both_e
    # idle gaps: before each gap-ending unit, by its cause; the rest (head, tail) is host-bound
    if len(s_all):
        o = np.argsort(s_all, kind="stable")
        ss, ee = s_all[o], e_all[o]
        cz = cause[ok][o]
        run_end = np.maximum.accumulate(ee)
        prev = np.concatenate([[0.0], run_end[:-1]])
        idle = np.maximum(ss - prev, 0.0)
        out["sync waits"] += float(idle[cz == 1].sum())
        out["launch-bound idle"] += float(idle[cz == 2].sum())
        out["other"] += float(idle[cz == 0].sum())
        tail_idle = max(step - float(run_end[-1]), 0.0)
        out["launch-bound idle"] += tail_idle
    else:
        out["other"] += step
    # the parts add up to the step by construction; float rounding goes to "other"
    out["other"] += step - sum(out.values())
    return out


__all__ = ["Program", "Result", "prepare", "run", "decompose"]

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

from bisect import bisect_right

from dataclasses import dataclass, field

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
    sync_streams: list | None = None  # per sync: the streams it waited for
    lead: float = 0.0  # the step's lead-in with no recorded host event (StepProfile.lead), out of gap[0]


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
    linked = w["linked"].to_numpy(bool) if "linked" in w else np.ones(n, bool)
    backlog = {int(k): int(v) for k, v in (p.backlog or {}).items()}
    latency = _launch_latency(launch, start, end, stream, linked, backlog)
    # a unit with no launch event linked to it was launched, as far as anyone can tell, just in time
    launch = np.where(linked, launch, start - int(latency))
    # per unit: the previous unit on its stream, and what held it back
    dep = np.full(n, -1, dtype=np.int64)
    wait = np.zeros(n)
    order = np.argsort(start, kind="stable")
    last_end: dict[int, int] = dict(backlog)  # the previous step's work still running at the start
    ends_sorted_idx = np.argsort(end, kind="stable")
    ends_sorted = end[ends_sorted_idx]
    # in end order, the last position before each run of one stream's units: where a walk back from a
    # unit of that stream to the first unit of another stream lands (-1: none); one lookup instead of a
    # walk that is quadratic when one stream has most units (a pipeline step: 7,213 units, 0.27 -> 0.05 s)
    ends_stream = stream[ends_sorted_idx]
    new_run = np.ones(n, dtype=bool)
    new_run[1:] = ends_stream[1:] != ends_stream[:-1]
    before_run = (np.flatnonzero(new_run) - 1)[np.cumsum(new_run) - 1]
    # the walk below is sequential: on Python ints and lists (numpy scalars cost ~5x more per operation);
    # the same values, as every operation is exact on integers below 2**53 or done in float as before
    l_launch, l_start, l_end, l_stream = launch.tolist(), start.tolist(), end.tolist(), stream.tolist()
    l_ends, l_ends_stream, l_before, l_ends_idx = (ends_sorted.tolist(), ends_stream.tolist(), before_run.tolist(),
                                                   ends_sorted_idx.tolist())
    l_dep, l_wait = dep.tolist(), wait.tolist()
    for k in order.tolist():
        s = l_stream[k]
        ready = max(l_launch[k] + latency, last_end.get(s, -1 << 62))
        if l_start[k] > ready + _TOL_NS:
            # waited for something: the unit on another stream that ended last before it started
            j = bisect_right(l_ends, l_start[k] + _TOL_NS) - 1
            if j >= 0 and l_ends_stream[j] == s:
                j = l_before[j]
            if j >= 0 and l_ends[j] > ready:
                l_dep[k] = l_ends_idx[j]
                ready = max(ready, l_ends[j])
            l_wait[k] = max(l_start[k] - ready, 0)
        last_end[s] = max(last_end.get(s, 0), l_end[k])
    dep, wait = np.asarray(l_dep, dtype=np.int64), np.asarray(l_wait, dtype=np.float64)
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
    sync_streams: list[tuple] = [()] * len(sy)
    last_end = dict(backlog)  # per stream: measured end of the last unit launched so far
    l_launch, l_sts, l_stream, l_end = launch.tolist(), sts.tolist(), stream.tolist(), end.tolist()
    for i, (kd, j) in enumerate(zip(kinds.tolist(), idx.tolist())):
        t = l_launch[j] if kd == 0 else l_sts[j]
        gap[i] = max(t - release, 0)
        if kd == 0:
            release = max(release, t)
            last_end[l_stream[j]] = max(last_end.get(l_stream[j], 0), l_end[j])
        else:
            # what the sync waited for: the streams whose launched work had ended when it returned (a
            # stream sync waits for one stream; a kernel still running on another stream, e.g. a
            # collective, was not waited for)
            cov = tuple(s_ for s_, e_ in last_end.items() if e_ <= sen[j] + _TOL_NS)
            drain = max((last_end[s_] for s_ in cov), default=0)
            sync_streams[j] = cov
            sync_ret[j] = max(sen[j] - max(drain, sts[j]), 0)
            sync_min[j] = sync_ret[j]
            release = max(release, sen[j])
    tail = max(float(p.step_ns) - release, 0.0)
    kinds, idx, gap, sts, sen, sync_min, sync_ret, sync_streams = _hidden_syncs(
        kinds, idx, gap, launch, end, stream, sts, sen, sync_min, sync_ret, sync_streams, backlog)
    gx = _gap_overlap(kinds, idx, launch, sts, sen, gap, p)
    queue = _queue_waits(kinds, idx, launch, start, w)
    if queue.any():  # the host's time blocked in a launch call on a full queue is the device's, not host work
        nxt = np.zeros_like(queue)
        nxt[1:] = queue[:-1]
        cut = np.minimum(nxt, gap)
        gap = gap - cut
        gx = np.minimum(gx, gap)
    lead = 0.0
    if len(gap):
        lead = float(min(max(p.lead, 0), gap[0]))
        gap[0] -= lead
    return Program(p, kinds, idx, gap, tail, stream, dep, wait, sync_min, sync_ret, latency, False, gx, sync_streams,
                   lead)


# a launch call that lasted more than _QUEUE_CALL_NS and _QUEUE_CALL_X x the step's median launch call, and
# returned while its own unit still had _QUEUE_BEHIND_NS or more of queued work ahead of it on the device, blocked
# on a full launch queue (the CUDA driver holds ~1,000 pending launches; the call returns when the device frees a
# slot): its time above the median call is a wait for the device, not host work
_QUEUE_CALL_NS = 50_000
_QUEUE_CALL_X = 10.0
_QUEUE_BEHIND_NS = 1_000_000


def _queue_waits(kinds, idx, launch, start, w) -> np.ndarray:
    """Per host item (host order): the part of its launch call spent blocked on a full launch queue (ns, 0 for
    syncs and for calls that did not block). The host's next item comes after the call returns, so that time is
    in the next item's gap; a replay without a queue limit lets the host run ahead instead (the device is the
    bottleneck whenever the queue is full)."""
    out = np.zeros(len(kinds))
    if "launch_dur" not in w or not len(w):
        return out
    ld = w["launch_dur"].to_numpy(np.float64)
    linked = w["linked"].to_numpy(bool) if "linked" in w else np.ones(len(w), bool)
    calls = ld[linked & (ld > 0)]
    if not len(calls):
        return out
    med = float(np.median(calls))
    kinds, idx = np.asarray(kinds), np.asarray(idx)
    u = kinds == 0
    j = idx[u]
    ret = launch[j] + ld[j]
    blocked = linked[j] & (ld[j] > max(_QUEUE_CALL_NS, _QUEUE_CALL_X * med)) & (start[j] - ret >= _QUEUE_BEHIND_NS)
    out[np.flatnonzero(u)[blocked]] = ld[j][blocked] - med
    return out


# a host gap of _HIDDEN_MIN_WAIT_NS or more that ended within max(_HIDDEN_RET_NS, _HIDDEN_RET_SHARE x the
# gap) after the device drained waited for it: for host work independent of the device, ending inside that
# window is a coincidence of at most ~_HIDDEN_RET_SHARE (a recorded sync returns 5-30 µs after the drain;
# a call that waited inside a library may do some work after it: 158 µs after a 64 ms wait on the H100 proxy)
_HIDDEN_RET_NS = 50_000
_HIDDEN_RET_SHARE = 0.02
_HIDDEN_MIN_WAIT_NS = 1_000_000


def _hidden_syncs(kinds, idx, gap, launch, end, stream, sts, sen, sync_min, sync_ret, sync_streams, backlog):
    """Blocking waits no sync call recorded: a host gap during which the device ran work launched before it
    and which ended just after the device drained (an allocator that frees cached blocks, a library call
    that waits for the device inside an op: the call's time is the device's, not the host's). Each becomes
    a sync on every stream (the host's own work before it: the step's median gap), so a changed config's
    device time moves it, as it moves the recorded ones. Returns the host order and sync arrays with them."""
    n_items = len(kinds)
    if not n_items:
        return kinds, idx, gap, sts, sen, sync_min, sync_ret, sync_streams
    unit_gaps = gap[kinds == 0]
    typical = float(np.median(unit_gaps)) if len(unit_gaps) else 0.0
    drain = max(backlog.values(), default=0)
    release = 0
    found: list[tuple[int, float, float, float]] = []  # (item, host work before, wait start, return)
    l_launch, l_sts, l_sen, l_end, l_gap = launch.tolist(), sts.tolist(), sen.tolist(), end.tolist(), gap.tolist()
    for i, (kd, j) in enumerate(zip(kinds.tolist(), idx.tolist())):  # (Python scalars: see `prepare`)
        t = l_launch[j] if kd == 0 else l_sts[j]
        g = l_gap[i]
        r0 = t - g
        if kd == 0 and g >= _HIDDEN_MIN_WAIT_NS and drain - r0 >= _HIDDEN_MIN_WAIT_NS and 0 <= t - drain <= max(_HIDDEN_RET_NS, _HIDDEN_RET_SHARE * g):
            found.append((i, min(typical, float(g)), float(r0), float(t - drain)))
        if kd == 0:
            drain = max(drain, l_end[j])
            release = max(release, t)
        else:
            release = max(release, l_sen[j])
    if not found:
        return kinds, idx, gap, sts, sen, sync_min, sync_ret, sync_streams
    n_sy = len(sync_min)
    ins_at = {i: k for k, (i, _, _, _) in enumerate(found)}
    k_out, i_out, g_out = [], [], []
    add_ts, add_end, add_ret = [], [], []
    for i in range(n_items):
        if i in ins_at:
            _, pre, r0, ret = found[ins_at[i]]
            k_out.append(1)
            i_out.append(n_sy + len(add_ts))
            g_out.append(pre)
            add_ts.append(r0 + pre)
            add_end.append(launch[idx[i]])
            add_ret.append(ret)
            k_out.append(0)
            i_out.append(idx[i])
            g_out.append(0.0)
        else:
            k_out.append(kinds[i])
            i_out.append(idx[i])
            g_out.append(gap[i])
    sts = np.concatenate([sts, np.asarray(add_ts, dtype=np.int64)])
    sen = np.concatenate([sen, np.asarray(add_end, dtype=np.int64)])
    sync_min = np.concatenate([sync_min, np.asarray(add_ret)])
    sync_ret = np.concatenate([sync_ret, np.asarray(add_ret)])
    sync_streams = list(sync_streams) + [None] * len(add_ts)
    return (np.asarray(k_out, np.int8), np.asarray(i_out), np.asarray(g_out), sts, sen, sync_min, sync_ret,
            sync_streams)


def _launch_latency(launch, start, end, stream, linked, backlog) -> float:
    """Launch call -> kernel start when nothing held the kernel back. Every linked unit started at least
    that long after its launch, so the constant cannot exceed the smallest lags: the 1st percentile of
    the linked units' lags (robust to a stray unit whose clocks disagree; negative when the device clock
    runs behind the host's), and, when some units started on an idle stream, the smallest of their lags
    (a step whose every kernel queued behind earlier work, e.g. the first profiled step of a loop whose
    host runs far ahead, shows large lags everywhere else)."""
    if not linked.any():
        return 0.0
    lag = start - launch
    est = float(np.percentile(lag[linked], 1))
    n = len(start)
    prev_end = np.full(n, -(1 << 62), dtype=np.int64)
    last: dict[int, int] = dict(backlog)
    l_stream, l_end, l_prev = stream.tolist(), end.tolist(), prev_end.tolist()
    for k in np.argsort(start, kind="stable").tolist():
        l_prev[k] = last.get(l_stream[k], -(1 << 62))
        last[l_stream[k]] = max(last.get(l_stream[k], 0), l_end[k])
    prev_end = np.asarray(l_prev, dtype=np.int64)
    idle = linked & (start > prev_end + _TOL_NS) & (lag >= 0)
    if idle.any():
        est = min(est, float(lag[idle].min()))
    return est


def _gap_overlap(kinds, idx, launch, sts, sen, gap, p: StepProfile) -> np.ndarray:
    """Per host item: how much of the host time before it was spent inside the expert stage's own CPU
    ops (``StepProfile.expert_host``): the length of [t - gap, t] inside their union, at most the gap,
    for every item at once (t: the item's launch, or its sync's start)."""
    eh = p.expert_host
    gap = np.asarray(gap, dtype=np.float64)
    out = np.zeros(len(gap))
    if eh is None or not len(eh) or not len(gap):
        return out
    us, ue = I.union(eh["ts"].to_numpy(np.int64) - p.start, eh["end"].to_numpy(np.int64) - p.start)
    cum = np.concatenate([[0], np.cumsum(ue - us)])
    kinds, idx = np.asarray(kinds), np.asarray(idx)
    t = np.zeros(len(gap), dtype=np.int64)
    m = kinds == 0
    t[m] = np.asarray(launch, np.int64)[idx[m]]
    t[~m] = np.asarray(sts, np.int64)[idx[~m]]
    a = t - gap
    i = np.searchsorted(ue, a, side="right")  # the union's segments that end after a ...
    j = np.searchsorted(us, t, side="left")  # ... and start before t
    ok = (t > a) & (j > i)
    i, j = np.where(ok, i, 0), np.where(ok, j, 1)
    tot = (cum[j] - cum[i]).astype(np.float64)
    tot -= np.maximum(0, a - us[i])  # the first segment's part before a
    tot -= np.maximum(0, ue[j - 1] - t)  # the last segment's part after t
    return np.minimum(np.where(ok, np.maximum(tot, 0), 0.0), gap)


@dataclass
class Result:
    step_ns: float
    components: dict  # component -> ns (adds up to step_ns)
    start: np.ndarray | None = None
    end: np.ndarray | None = None
    host_ns: float = 0.0  # when the host was done with the step (after its tail), in the step's own frame
    free: dict | None = None  # per stream: when its last unit ends, in the same frame


@dataclass
class Plan:
    """An editable replay program: host items in order and the units they launch."""

    kind: list  # per item: 0 unit, 1 sync
    ref: list  # per item: unit index (kind 0) or sync index (kind 1)
    gap: list  # per item: host time before it
    dur: list  # per unit
    stream: list
    dep: list
    wait: list
    comp: list
    sync_min: list
    sync_ret: list
    tail: float
    latency: float
    cpu: bool
    gap_x: list  # per item: the part of its gap spent in the expert stage's own CPU ops
    sync_streams: list  # per sync: the streams it waits for (None: every stream)
    backlog: dict  # per stream: busy with the previous step's work until (ns after the step start)
    lead: float = 0.0  # host time before the step's first recorded event (the profiler's step transition)
    # per unit a mechanism inserted (index >= the profile's units): what it stands for, for the rules that run after
    # it (`fsdp_overlap`): ("fsdp",) an FSDP collective; ("call", key, call, backward) a unit of an FSDP unit's
    # call (the experts of a chunk: key ("experts", layer), the chunk's call index)
    unit_keys: dict = field(default_factory=dict)

    @classmethod
    def of(cls, prog: Program, profiler_lead: bool = True) -> "Plan":
        """``profiler_lead``: keep the step's lead-in with no recorded event (true to the trace); the
        what-if model drops it (the profiler's own step transition, absent from unprofiled steps)."""
        w = prog.profile.work
        gx = prog.gap_expert if prog.gap_expert is not None else np.zeros(len(prog.gap))
        return cls(list(prog.order_kind.tolist()), list(prog.order_idx.tolist()), list(prog.gap.tolist()),
                   list(w["dur"].to_numpy(float).tolist()), list(prog.stream.tolist()), list(prog.dep.tolist()),
                   list(prog.wait.tolist()), list(w["component"].tolist()), list(prog.sync_min.tolist()),
                   list(prog.sync_ret.tolist()), float(prog.tail), float(prog.latency), prog.cpu, list(gx.tolist()),
                   list(prog.sync_streams) if prog.sync_streams is not None else [None] * len(prog.sync_min),
                   dict(prog.profile.backlog or {}), float(prog.lead) if profiler_lead else 0.0)

    def replay(self, host_scale: float) -> "Result":
        """Replay the step. The device starts with the work the previous step left running
        (``backlog``, measured); the step is the host's time or, when the device is the bottleneck, the
        device's time from the end of that backlog to the end of this step's work (in a loop without a
        sync at the end of a step, one step's GPU work runs into the next one's host time). The
        components cut that window."""
        if self.cpu:
            comps = {c: 0.0 for c in COMPONENTS}
            live = [self.ref[i] for i in range(len(self.kind)) if self.kind[i] == 0]
            for j in live:
                comps[self.comp[j]] = comps.get(self.comp[j], 0.0) + self.dur[j]
            host = (sum(self.gap) + self.tail) * host_scale
            comps["other"] += host
            return Result(sum(comps.values()), comps)
        n = len(self.dur)
        start = np.full(n, np.nan)
        end = np.full(n, np.nan)
        cause = np.zeros(n, np.int8)
        keep = np.zeros(n, bool)
        free: dict[int, float] = {int(k): float(v) for k, v in self.backlog.items()}
        back = max(free.values(), default=0.0)
        h, drain, last_sync = float(self.lead), back, -1.0
        lat, tol = self.latency, _TOL_NS
        for kd, j, g in zip(self.kind, self.ref, self.gap):
            h += g * host_scale
            if kd == 0:
                t_launch = h + lat
                s = max(t_launch, free.get(self.stream[j], 0.0))
                d = self.dep[j]
                if d >= 0 and keep[d]:
                    s = max(s, end[d])
                ready = s
                s += self.wait[j]
                if s > drain + tol and t_launch >= ready - tol:
                    cause[j] = 1 if last_sync >= drain else 2
                e = s + self.dur[j]
                start[j], end[j], keep[j] = s, e, True
                free[self.stream[j]] = e
                if e > drain:
                    drain = e
            else:
                cov = self.sync_streams[j]
                waited = drain if cov is None else max((free.get(s_, 0.0) for s_ in cov), default=0.0)
                h = max(h + self.sync_min[j], waited + self.sync_ret[j])
                last_sync = h
        h += self.tail * host_scale
        gpu = drain - back  # the device's own time for this step's work (after the previous step's)
        # the window the components cut starts when the previous step's work has left the device: before that the
        # device runs work this step did not launch (in a steady state, its own work running into the next step
        # takes that place). Host-bound with a backlog (a loop whose host runs ahead and has no sync in its step),
        # a window from the step's host start counted the previous step's work as this step's idle ("other")
        # and cut off this step's own work past the host's end
        step, w0 = (gpu, back) if gpu > h else (max(h, 0.0), back)
        st, en = np.clip(start - w0, 0, step), np.clip(end - w0, 0, step)
        kp = keep & (en > st)
        return Result(step, decompose(st, en, np.asarray(self.comp, dtype=object), kp, cause, step), start - w0,
                      end - w0, h, free)

    def replay_chain(self, host_scale: float, n: int, end_cost: float) -> "Result":
        """Steps timed without a sync at their end (``step_timing: events``): ``n`` consecutive steps,
        each one's host starting when the previous one's host is done while the device still runs that
        step's work (it becomes the next step's ``backlog``), and a blocking read after the last (the
        trainer's log point: ``end_cost`` is that sync's return). The first step starts on an idle device
        (after the previous cycle's read). Returns the mean step over the cycle, its components scaled to
        it (they add up to it). On a CPU profile nothing is asynchronous: :meth:`replay`."""
        if self.cpu or n < 1:
            return self.replay(host_scale)
        saved = self.backlog
        total, steps = 0.0, 0.0
        comps: dict = {}
        backlog: dict = {}
        try:
            for k in range(n):
                self.backlog = backlog
                last = k == n - 1
                if last:
                    self.add_sync(len(self.kind), end_cost)
                try:
                    r = self.replay(host_scale)
                finally:
                    if last:
                        self._pop_last_sync()
                total += r.host_ns
                steps += r.step_ns
                for c, v in r.components.items():
                    comps[c] = comps.get(c, 0.0) + v
                backlog = {s: f - r.host_ns for s, f in r.free.items() if f - r.host_ns > 0}
        finally:
            self.backlog = saved
        mean = total / n
        f = mean / steps if steps > 0 else 0.0
        return Result(mean, {c: v * f for c, v in comps.items()})

    def _pop_last_sync(self) -> None:
        self.kind.pop()
        self.ref.pop()
        self.gap.pop()
        self.gap_x.pop()
        self.sync_min.pop()
        self.sync_ret.pop()
        self.sync_streams.pop()

    def add_unit(self, dur: float, stream: int, comp: str, gap: float, at: int) -> int:
        """Insert a new unit launched at item position ``at`` (before the item now there)."""
        j = len(self.dur)
        self.dur.append(dur)
        self.stream.append(stream)
        self.dep.append(-1)
        self.wait.append(0.0)
        self.comp.append(comp)
        self.kind.insert(at, 0)
        self.ref.insert(at, j)
        self.gap.insert(at, gap)
        self.gap_x.insert(at, 0.0)
        return j

    def add_sync(self, at: int, cost: float) -> None:
        j = len(self.sync_min)
        self.sync_min.append(cost)
        self.sync_ret.append(cost)
        self.sync_streams.append(None)  # an added sync (.tolist() of counts) waits for the device
        self.kind.insert(at, 1)
        self.ref.insert(at, j)
        self.gap.insert(at, 0.0)
        self.gap_x.insert(at, 0.0)

    def drop_items(self, positions: set[int]) -> None:
        keep = [i for i in range(len(self.kind)) if i not in positions]
        self.kind = [self.kind[i] for i in keep]
        self.ref = [self.ref[i] for i in keep]
        self.gap = [self.gap[i] for i in keep]
        self.gap_x = [self.gap_x[i] for i in keep]


def run(prog: Program, dur: np.ndarray | None = None, keep_unit: np.ndarray | None = None,
        keep_sync: np.ndarray | None = None, host_scale: float = 1.0, gap_scale: np.ndarray | None = None,
        component: np.ndarray | None = None) -> Result:
    """Replay ``prog`` with unit durations ``dur`` (default: measured), units/syncs dropped where
    ``keep_*`` is False (their host gap goes with them), host gaps times ``host_scale`` (and per item
    ``gap_scale``). Returns the steady-state step time and its components (:meth:`Plan.replay`)."""
    plan = Plan.of(prog)
    if dur is not None:
        plan.dur = [float(x) for x in np.asarray(dur, dtype=np.float64)]
    if component is not None:
        plan.comp = list(component)
    if gap_scale is not None:
        plan.gap = [g * float(f) for g, f in zip(plan.gap, gap_scale)]
    drop = set()
    for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)):
        if (kd == 0 and keep_unit is not None and not keep_unit[j]) or (kd == 1 and keep_sync is not None and not keep_sync[j]):
            drop.add(i)
    if drop:
        plan.drop_items(drop)
    return plan.replay(host_scale)


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


__all__ = ["Program", "Plan", "Result", "prepare", "run", "decompose"]

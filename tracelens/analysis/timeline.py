"""GPU timeline per rank and per profiler step: busy/idle and what the busy time was spent on.

All figures are lengths of unions of [start, end) intervals over every stream of the rank's GPU(s):
- busy     = |kernels u memcpy u memset|, idle = span - busy, span = first GPU start -> last GPU end
- compute  = |non-communication kernels|, comm = |communication kernels|, memcpy, memset likewise
- a communication kernel's duration is a wait and a transfer (`tracelens.analysis.waits`, when the
  cross-rank waits are given): the transfer part is communication, the wait part is not
- exposed_comm = |transfer u compute| - |compute| (data movement no compute hides)
- comm_wait = |transfer u compute u peer waits| - |transfer u compute|: waiting inside collectives for
  another rank (no compute, no transfer under it); pipeline_wait = |comm u compute| - |... u peer waits|:
  a pipeline stage's point-to-point kernels waiting for the neighbour stage (the pipeline bubble)
- the exclusive split used for stacked bars: compute, exposed comm, comm wait, pipeline wait, memcpy not
  under any of those, memset not under any of those, idle; these add up to the span exactly.
- cuts: intervals of a rank's time left out of its figures (a profiler start-up wait kept as a fallback,
  see `steps.StepWindow`): every union becomes |U - K| = |U u K| - |K| and the span loses |K|, so the
  identities above still hold on the time that is left.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from . import intervals as I

NS_PER_US = 1000.0

TIMELINE_COLUMNS = [
    "rank", "step", "span_us", "gpu_busy_us", "gpu_idle_us", "compute_us", "comm_us", "memcpy_us", "memset_us",
    "exposed_comm_us", "comm_wait_us", "pipeline_wait_us", "overlapped_comm_us", "excl_memcpy_us", "excl_memset_us", "kernel_count", "start_ns", "end_ns",
]


def _metrics(g: pd.DataFrame, cut: list | None = None) -> dict:
    s = g["ts"].to_numpy()
    e = g["end"].to_numpy()
    start, end = int(s.min()), int(e.max())
    K = None
    if cut:  # the rank's cut intervals inside [start, end)
        ks, ke = I.clip(np.array([c[0] for c in cut], dtype=np.int64), np.array([c[1] for c in cut], dtype=np.int64),
                        start, end)
        K = I.union(ks, ke) if ks.size else None
    cut_len = int((K[1] - K[0]).sum()) if K is not None else 0

    m = _masks(g)
    if K is None:
        # sorted by start once: every union below is of a masked (so still sorted) part of the same arrays
        o = np.argsort(s, kind="stable")
        s_o, e_o = s[o], e[o]

        def U(mask: np.ndarray) -> int:
            return _sorted_union_length(s_o[mask[o]], e_o[mask[o]])
    else:
        def U(mask: np.ndarray) -> int:
            return I.union_length((s[mask], e[mask]), K) - cut_len

    comp, comm, tx, peer, cpy, mst = m["comp"], m["comm"], m["tx"], m["peer"], m["cpy"], m["mst"]
    c_or_n = U(comp | comm)
    waited = m["waited"]
    return _figures(end - start - cut_len, U(comp | comm | cpy | mst), U(comp), U(comm), c_or_n,
                    U(comp | comm | cpy), U(cpy), U(mst), int(m["kernels"].sum()), start, end,
                    c_or_t=U(comp | tx) if waited else c_or_n, c_t_p=U(comp | tx | peer) if waited else c_or_n)


def _masks(g: pd.DataFrame) -> dict:
    """Row masks of a timeline's events (see `_with_waits` for the wait rows and `wclass`)."""
    kind = g["kind"]  # compared as a categorical: on its codes, no string per row
    is_k = (kind == "kernel").to_numpy()
    comm = g["is_comm"].to_numpy() & is_k
    wc = g["wclass"].to_numpy() if "wclass" in g.columns else np.zeros(len(g), dtype=np.int8)
    return {"comp": is_k & ~comm, "comm": comm, "tx": comm & (wc == 0), "peer": comm & (wc == 1),
            "cpy": (kind == "memcpy").to_numpy(), "mst": (kind == "memset").to_numpy(),
            "kernels": is_k & (wc == 0), "waited": bool((wc != 0).any())}


def _with_waits(data: pd.DataFrame, waits: pd.DataFrame | None) -> pd.DataFrame:
    """The events with each communication kernel that waited (`waits`: wait_ns and wclass by GPU row label,
    `waits.wait_class`) cut in two: its wait [ts, ts + wait) as an added row of class wclass (1 a peer wait,
    2 a pipeline wait) and its transfer [ts + wait, end) in its own row (class 0, like every other event)."""
    if waits is None or waits.empty or data.empty:
        return data
    hit = waits.index.intersection(data.index)
    if not len(hit):
        return data
    w = waits.loc[hit]
    dur = (data.loc[hit, "end"] - data.loc[hit, "ts"]).to_numpy(np.int64)
    wait = np.minimum(w["wait_ns"].to_numpy(np.int64), np.maximum(dur, 0))
    out = data.copy()
    out["wclass"] = np.int8(0)
    added = data.loc[hit].copy()
    added["end"] = added["ts"].to_numpy(np.int64) + wait
    added["wclass"] = w["wclass"].to_numpy(np.int8)
    out.loc[hit, "ts"] = out.loc[hit, "ts"].to_numpy(np.int64) + wait
    return pd.concat([out, added[wait > 0]])


def _sorted_union_length(s: np.ndarray, e: np.ndarray) -> int:
    """|union of [s, e)| for intervals already sorted by start (`intervals.length` without its sort)."""
    if not len(s):
        return 0
    run_end = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    first = np.flatnonzero(new)
    last = np.empty_like(first)
    last[:-1] = first[1:] - 1
    last[-1] = len(s) - 1
    return int((run_end[last] - s[first]).sum())


def _figures(span, busy, compute, comm_u, c_or_n, c_n_y, memcpy, memset, kernels, start, end, c_or_t=None,
             c_t_p=None) -> dict:
    """The timeline figures (µs) from the union lengths (ns): scalars for one group, arrays for many.
    c_or_t: |compute u transfer|, c_t_p: |compute u transfer u peer waits| (default: no waits known)."""
    c_or_t = c_or_n if c_or_t is None else c_or_t
    c_t_p = c_or_n if c_t_p is None else c_t_p
    exposed = c_or_t - compute
    comm_wait = c_t_p - c_or_t
    pipe_wait = c_or_n - c_t_p
    return {
        "span_us": span / NS_PER_US,
        "gpu_busy_us": busy / NS_PER_US,
        "gpu_idle_us": (span - busy) / NS_PER_US,
        "compute_us": compute / NS_PER_US,
        "comm_us": comm_u / NS_PER_US,
        "memcpy_us": memcpy / NS_PER_US,
        "memset_us": memset / NS_PER_US,
        "exposed_comm_us": exposed / NS_PER_US,
        "comm_wait_us": comm_wait / NS_PER_US,
        "pipeline_wait_us": pipe_wait / NS_PER_US,
        "overlapped_comm_us": (comm_u - (c_or_n - compute)) / NS_PER_US,
        "excl_memcpy_us": (c_n_y - c_or_n) / NS_PER_US,
        "excl_memset_us": (busy - c_n_y) / NS_PER_US,
        "kernel_count": kernels,
        "start_ns": start,
        "end_ns": end,
    }


def gpu_timeline(gpu: pd.DataFrame, by_step: bool = False, cuts: dict | None = None,
                 waits: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per rank (step = -1), or per (rank, step) for events inside marked steps.

    `gpu` is the output of `calltree.attribute_gpu` (needs rank, ts, end, kind, is_comm, step); `cuts`:
    rank -> [(start_ns, end_ns)] left out of that rank's figures (see the module docstring); `waits`: the
    communication kernels' waits by GPU row label (`waits.wait_class`; None: no wait known, every
    communication kernel is transfer).
    """
    rows = []
    if gpu.empty:
        return pd.DataFrame(columns=TIMELINE_COLUMNS)
    keys = ["rank", "step"] if by_step else ["rank"]
    data = gpu[["rank", "step", "ts", "end", "kind", "is_comm"]]
    data = data[data["step"] >= 0] if by_step else data
    data = _with_waits(data, waits)
    if by_step and not cuts:  # thousands of steps (a trace of short steps): every step at once
        fast = _step_metrics(data)
        if fast is not None:
            return fast
    for key, g in data.groupby(keys, sort=True, observed=True):
        key = key if isinstance(key, tuple) else (key,)
        row = {"rank": int(key[0]), "step": int(key[1]) if by_step else -1}
        row.update(_metrics(g, (cuts or {}).get(int(key[0]))))
        rows.append(row)
    return pd.DataFrame(rows, columns=TIMELINE_COLUMNS)


def _union_lengths(gid: np.ndarray, s: np.ndarray, e: np.ndarray, n_groups: int) -> np.ndarray:
    """|union of [s, e)| per group, for all groups at once (exact int64, as `intervals.union_length` per
    group). The intervals come sorted by start on a shifted axis that keeps groups apart (group * width +
    t - the group's start: see `_step_metrics`), so one running maximum merges within a group only."""
    out = np.zeros(n_groups, dtype=np.int64)
    if not len(s):
        return out
    run_end = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    first = np.flatnonzero(new)
    last = np.r_[first[1:] - 1, len(s) - 1]
    seg_len = run_end[last] - s[first]
    seg_g = gid[first]
    starts = np.flatnonzero(np.r_[True, seg_g[1:] != seg_g[:-1]])
    out[seg_g[starts]] = np.add.reduceat(seg_len, starts)
    return out


def _step_metrics(data: pd.DataFrame) -> pd.DataFrame | None:
    """`gpu_timeline(by_step=True)` without cuts, every (rank, step) at once: the same rows, values and
    dtypes as `_metrics` per group (tested against it). None when the shifted times would not fit int64."""
    if data.empty:
        return pd.DataFrame(columns=TIMELINE_COLUMNS)
    rank = data["rank"].to_numpy().astype(np.int64)
    step = data["step"].to_numpy().astype(np.int64)
    s = data["ts"].to_numpy().astype(np.int64)
    e = data["end"].to_numpy().astype(np.int64)
    if rank.min() >= 0 and step.min() >= 0 and int(rank.max()) * (int(step.max()) + 1) < (1 << 62):
        span = int(step.max()) + 1  # (rank, step) as one key: np.unique on rows (axis=0) is ~20x slower
        keys, gid = np.unique(rank * span + step, return_inverse=True)
        pairs = np.stack([keys // span, keys % span], axis=1)
    else:
        pairs, gid = np.unique(np.stack([rank, step], axis=1), axis=0, return_inverse=True)
    gid = gid.reshape(-1)
    n = len(pairs)
    start = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(start, gid, s)
    end = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(end, gid, e)
    if (e < s).any():  # (the loader drops negative durations; such rows take the per-step loop)
        return None
    width = int((end - start).max()) + 1  # each group's times, relative to its start, lie in [0, width)
    if n * width >= (1 << 62) or int(np.abs(s).max()) >= (1 << 61) or int(np.abs(e).max()) >= (1 << 61):
        return None
    m = _masks(data)
    comp, comm, tx, peer, cpy, mst = m["comp"], m["comm"], m["tx"], m["peer"], m["cpy"], m["mst"]

    # every group's times on one axis, groups apart (group * width + t - its start), sorted once: each
    # union below is of a masked, so still sorted, part
    off = gid * width - start[gid]
    order = np.argsort(s + off, kind="stable")
    s_o, e_o, g_o = (s + off)[order], (e + off)[order], gid[order]

    def U(mask: np.ndarray) -> np.ndarray:
        m = mask[order]
        return _union_lengths(g_o[m], s_o[m], e_o[m], n)

    compute = U(comp)
    comm_u = U(comm)
    c_or_n = U(comp | comm)
    c_n_y = U(comp | comm | cpy)
    busy = U(comp | comm | cpy | mst)
    waited = m["waited"]
    return pd.DataFrame({
        "rank": pairs[:, 0], "step": pairs[:, 1],
        **_figures(end - start, busy, compute, comm_u, c_or_n, c_n_y, U(cpy), U(mst),
                   np.bincount(gid, weights=m["kernels"], minlength=n).astype(np.int64), start, end,
                   c_or_t=U(comp | tx) if waited else c_or_n, c_t_p=U(comp | tx | peer) if waited else c_or_n),
    }, columns=TIMELINE_COLUMNS, copy=False)  # the columns are the frame's own (no consolidated second copy)


def idle_gaps(gpu: pd.DataFrame, rank: int) -> pd.DataFrame:
    """Idle periods of one rank's GPU (between busy segments), longest first."""
    g = gpu[gpu["rank"] == rank]
    s, e = I.gaps(g["ts"].to_numpy(), g["end"].to_numpy())
    return pd.DataFrame({"start_ns": s, "end_ns": e, "dur_us": (e - s) / NS_PER_US}).sort_values(
        "dur_us", ascending=False, ignore_index=True
    , kind="stable")

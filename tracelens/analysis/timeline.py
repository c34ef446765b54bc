"""GPU timeline per rank and per profiler step: busy/idle and what the busy time was spent on.

All figures are lengths of unions of [start, end) intervals over every stream of the rank's GPU(s):
- busy     = |kernels u memcpy u memset|, idle = span - busy, span = first GPU start -> last GPU end
- compute  = |non-communication kernels|, comm = |communication kernels|, memcpy, memset likewise
- exposed_comm = |comm - compute| = |comm u compute| - |compute| (communication no compute hides)
- the exclusive split used for stacked bars: compute, exposed comm, memcpy not under either, memset not
  under any of those, idle; these add up to the span exactly.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from . import intervals as I

NS_PER_US = 1000.0

TIMELINE_COLUMNS = [
    "rank", "step", "span_us", "gpu_busy_us", "gpu_idle_us", "compute_us", "comm_us", "memcpy_us", "memset_us",
    "exposed_comm_us", "overlapped_comm_us", "excl_memcpy_us", "excl_memset_us", "kernel_count", "start_ns", "end_ns",
]


def _metrics(g: pd.DataFrame) -> dict:
    s = g["ts"].to_numpy()
    e = g["end"].to_numpy()
    kind = g["kind"]  # compared as a categorical: on its codes, no string per row
    is_k = (kind == "kernel").to_numpy()
    comm = g["is_comm"].to_numpy() & is_k
    comp = is_k & ~comm
    cpy = (kind == "memcpy").to_numpy()
    mst = (kind == "memset").to_numpy()
    C = (s[comp], e[comp])
    N = (s[comm], e[comm])
    Y = (s[cpy], e[cpy])
    M = (s[mst], e[mst])
    compute = I.union_length(C)
    comm_u = I.union_length(N)
    c_or_n = I.union_length(C, N)
    c_n_y = I.union_length(C, N, Y)
    busy = I.union_length(C, N, Y, M)
    start, end = int(s.min()), int(e.max())
    span = end - start
    exposed = c_or_n - compute
    return {
        "span_us": span / NS_PER_US,
        "gpu_busy_us": busy / NS_PER_US,
        "gpu_idle_us": (span - busy) / NS_PER_US,
        "compute_us": compute / NS_PER_US,
        "comm_us": comm_u / NS_PER_US,
        "memcpy_us": I.union_length(Y) / NS_PER_US,
        "memset_us": I.union_length(M) / NS_PER_US,
        "exposed_comm_us": exposed / NS_PER_US,
        "overlapped_comm_us": (comm_u - exposed) / NS_PER_US,
        "excl_memcpy_us": (c_n_y - c_or_n) / NS_PER_US,
        "excl_memset_us": (busy - c_n_y) / NS_PER_US,
        "kernel_count": int(is_k.sum()),
        "start_ns": start,
        "end_ns": end,
    }


def gpu_timeline(gpu: pd.DataFrame, by_step: bool = False) -> pd.DataFrame:
    """One row per rank (step = -1), or per (rank, step) for events inside marked steps.

    `gpu` is the output of `calltree.attribute_gpu` (needs rank, ts, end, kind, is_comm, step).
    """
    rows = []
    if gpu.empty:
        return pd.DataFrame(columns=TIMELINE_COLUMNS)
    keys = ["rank", "step"] if by_step else ["rank"]
    data = gpu[["rank", "step", "ts", "end", "kind", "is_comm"]]
    data = data[data["step"] >= 0] if by_step else data
    for key, g in data.groupby(keys, sort=True, observed=True):
        key = key if isinstance(key, tuple) else (key,)
        row = {"rank": int(key[0]), "step": int(key[1]) if by_step else -1}
        row.update(_metrics(g))
        rows.append(row)
    return pd.DataFrame(rows, columns=TIMELINE_COLUMNS)


def idle_gaps(gpu: pd.DataFrame, rank: int) -> pd.DataFrame:
    """Idle periods of one rank's GPU (between busy segments), longest first."""
    g = gpu[gpu["rank"] == rank]
    s, e = I.gaps(g["ts"].to_numpy(), g["end"].to_numpy())
    return pd.DataFrame({"start_ns": s, "end_ns": e, "dur_us": (e - s) / NS_PER_US}).sort_values(
        "dur_us", ascending=False, ignore_index=True
    )

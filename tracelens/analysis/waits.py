"""Wait vs transfer of communication kernels: the one notion every view reads.

A communication kernel (NCCL/RCCL) starts when its rank launches it and cannot move data before every
rank it exchanges with has arrived: until then it spins. Its duration is a wait and a transfer:

    wait(k)     = min(last arrival - start(k), dur(k))    (last arrival: the latest start of the
                                                           instance's kernels over the ranks,
                                                           `comm.collective_instances`)
    transfer(k) = dur(k) - wait(k)

The wait is not communication, and no bandwidth shrinks it. What it is depends on what the rank waits
for (`kind`):

    peer      a collective (or a point-to-point exchange outside a pipeline) waiting for the last rank
              of its group to arrive: "waiting for rank N" (`waiting_for`); the late rank's cause is
              `tracelens.analysis.straggler`'s
    pipeline  a pipeline stage's point-to-point kernel (its receive, or a send whose peer has not posted
              its receive) waiting for its neighbour stage: the pipeline bubble (schedule + stage
              imbalance, as ppvis's bubble account splits it), not communication
    startup   waiting for a rank that had not started profiling (the wait is partly outside the trace:
              `steps.startup_waits`); unmatched such kernels wait for their whole duration

A kernel whose instance lacks a rank of its group in the loaded traces (a partial rank set) has no
known wait: it counts as transfer (`kind` ``unmatched``), as before this split existed.

Consumers: the GPU timeline (`timeline.gpu_timeline(..., waits=)`: exposed communication is the transfer
no compute hides; `comm_wait_us` and `pipeline_wait_us` are the waits, each its own category), and
through it summary.json, the report and `diff`; the findings; `comm`'s exposed communication; the
what-if's step profiles (`projection.profile`: a unit's ``wait``), so a predicted change never scales a
wait as if it were transfer; and the step decomposition (pipeline waits are its ``pipeline bubble``,
collective waits its ``collective waits``).
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

US = 1000.0
# point-to-point kernels by name (NCCL's SendRecv, RCCL's, send/recv kernels of other libraries)
P2P_KERNEL = re.compile(r"SendRecv|(?<![A-Za-z])(?:Send|Recv)(?![A-Za-z])|_send_|_recv_", re.IGNORECASE)
KINDS = ("peer", "pipeline", "startup", "unmatched")
# the GPU timeline's wait classes (`timeline.gpu_timeline`): 0 transfer (or any other event), 1 a wait for a
# peer rank (peer and startup), 2 a pipeline wait
WAIT_CLASS = {"peer": 1, "startup": 1, "pipeline": 2}
COLUMNS = ["rank", "step", "family", "kind", "wait_ns", "transfer_ns", "waiting_for"]


def is_pipeline(trace, has_pipeline_data=None) -> bool:
    """Whether the traces are of a pipeline-parallel run (its point-to-point kernels are stage hand-offs): a
    manifest with pp > 1, or (``has_pipeline_data``: `pipeline.has_pipeline_data`, passed in by the caller,
    so this module does not import the pipeline analysis) pipeline actions or ranges."""
    run = getattr(trace, "run", None)
    man = getattr(run, "manifest", None) if run is not None else None
    cfg = man.get("config") if isinstance(man, dict) and isinstance(man.get("config"), dict) else {}
    pp = cfg.get("pp")
    if isinstance(pp, int) and not isinstance(pp, bool) and pp > 1:
        return True
    if has_pipeline_data is None or getattr(trace, "events", None) is None:
        return False
    return bool(has_pipeline_data(trace))


# two point-to-point kernels that exchange data end together: the transfer completes on both sides (on the
# 4-GPU H100 fixtures within 12-14 µs, the clocks' offset); a peer kernel ending further from this one's end
# is doing another exchange
P2P_END_TOL_NS = 200_000


def p2p_partner_waits(ts: np.ndarray, end: np.ndarray, rank: np.ndarray,
                      peer_sets: dict | None = None, row_peers: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Waits of point-to-point kernels (ns, on one clock) whose peer pairs are not known: batched sends and
    receives of a pipeline, one kernel covering several ops. A point-to-point kernel moves data only while its
    peer's kernel runs, and the two end together when the transfer completes. So a kernel's partner on each
    rank it exchanges with (``peer_sets``: rank -> the ranks its send/recv ops name, `comm.p2p_peer_sets`,
    used both ways; a rank without an entry may exchange with any; ``row_peers``, per kernel, the ranks its own
    ops name, `comm.p2p_kernel_peers`, where known: a stage's receive from its predecessor is never paired with
    its successor's kernel) is that rank's kernel overlapping it whose
    end is nearest its own, taken when within `P2P_END_TOL_NS` (else, when no rank's is, the nearest of all).
    Its exchange begins when the last partner started: wait = min(that start - its start, its duration), 0
    when every partner was there first. Returns (wait: float ns, NaN where no peer kernel overlaps it; the
    rank waited for, or its own rank when it did not wait, -1 where unknown)."""
    ts, end, rank = (np.asarray(ts, np.int64), np.asarray(end, np.int64), np.asarray(rank, np.int64))
    sets = {int(r): set(v) for r, v in (peer_sets or {}).items()}
    ranks = sorted({int(r) for r in rank})
    by_rank = {}
    for r in ranks:
        i = np.flatnonzero(rank == r)
        i = i[np.argsort(ts[i], kind="stable")]
        by_rank[r] = (ts[i], end[i], np.maximum.accumulate(end[i]))
    wait = np.full(len(ts), np.nan)
    last = np.full(len(ts), -1, dtype=np.int64)
    for r in ranks:
        peers = [q for q in ranks if q != r and (r not in sets or q in sets[r]) and (q not in sets or r in sets[q])]
        for i in np.flatnonzero(rank == r):
            t0, t1 = int(ts[i]), int(end[i])
            cand = []  # (|end difference|, start, peer) of each peer's best partner
            own = row_peers[i] if row_peers is not None and isinstance(row_peers[i], tuple) else None
            for q in (peers if own is None else [q for q in own if q in by_rank and q != r]):
                qs, qe, q_run = by_rank[q]
                lo = int(np.searchsorted(q_run, t0, side="right"))  # kernels that may end after k starts ...
                hi = int(np.searchsorted(qs, t1, side="left"))  # ... and start before k ends
                if hi <= lo:
                    continue
                ok = np.flatnonzero(qe[lo:hi] > t0)
                if not len(ok):
                    continue
                d = np.abs(qe[lo:hi][ok] - t1)
                j = int(ok[int(np.argmin(d))])
                cand.append((int(abs(qe[lo + j] - t1)), int(qs[lo + j]), q))
            if not cand:
                continue
            near = [c for c in cand if c[0] <= P2P_END_TOL_NS] or [min(cand)]
            start, who = max((c[1], c[2]) for c in near)
            wait[i] = float(min(max(start - t0, 0), t1 - t0))
            last[i] = who if start > t0 else r
    return wait, last


def kernel_waits(inst: pd.DataFrame, pipeline: bool = False) -> pd.DataFrame:
    """One row per communication kernel of the collective instances `inst` (`comm.collective_instances`),
    indexed by its GPU row label (`gpu_row`): rank, step, family, kind (see the module docstring),
    wait_ns and transfer_ns (int64 ns, adding up to the kernel's duration) and waiting_for (the rank the
    wait is for: the instance's last arrival; -1 when it did not wait or the wait is not known).
    pipeline: the run is pipeline-parallel (`is_pipeline`): its point-to-point waits are pipeline waits."""
    if inst is None or inst.empty:
        return pd.DataFrame({c: pd.Series([], dtype="int64" if c not in ("family", "kind") else object)
                             for c in COLUMNS}, index=pd.Index([], dtype="int64", name="gpu_row"))
    dur = np.rint(inst["kernel_us"].to_numpy(np.float64) * US).astype(np.int64)
    sync = inst["sync_us"].to_numpy(np.float64)
    cross = inst["cross_rank"].to_numpy(bool)
    startup = inst["startup"].to_numpy(bool)
    known = cross & np.isfinite(sync)
    wait = np.zeros(len(inst), dtype=np.int64)
    wait[known] = np.rint(sync[known] * US).astype(np.int64)
    # a start-up kernel whose peer is not in the traces waits for its whole duration (an upper bound, as
    # `steps.startup_waits` counts it)
    wait[startup & ~known] = dur[startup & ~known]
    wait = np.clip(wait, 0, dur)
    fam = inst["family"].astype(str).to_numpy()
    kind = np.where(startup, "startup", np.where(~known, "unmatched",
                                                 np.where((fam == "p2p") & pipeline, "pipeline", "peer")))
    last = inst["last_rank"].to_numpy(np.int64)
    rank = inst["rank"].to_numpy(np.int64)
    waiting_for = np.where((wait > 0) & known & (last != rank), last, -1)
    out = pd.DataFrame({"rank": rank, "step": inst["step"].to_numpy(np.int64), "family": fam, "kind": kind.astype(object),
                        "wait_ns": wait, "transfer_ns": dur - wait, "waiting_for": waiting_for},
                       index=pd.Index(inst["gpu_row"].to_numpy(np.int64), name="gpu_row"))
    return out[~out.index.duplicated()]


def rank_waits(kw: pd.DataFrame, steps=None) -> pd.DataFrame:
    """Per rank (over `steps` when given, start-up waits left out): kernel time of its communication kernels
    split into peer wait, pipeline wait and transfer (µs, sums over kernels, as `tracelens comm` reports
    them), and the rank it waited for most (`waits_for`, -1: none)."""
    cols = ["rank", "peer_wait_us", "pipeline_wait_us", "transfer_us", "waits_for"]
    if kw is None or kw.empty:
        return pd.DataFrame(columns=cols)
    k = kw[kw["kind"] != "startup"]
    if steps is not None:
        k = k[k["step"].isin(list(steps))]
    rows = []
    for r, g in k.groupby("rank", sort=True):
        peer = g["kind"] == "peer"
        who = g[peer & (g["waiting_for"] >= 0)].groupby("waiting_for")["wait_ns"].sum()
        rows.append({"rank": int(r), "peer_wait_us": float(g.loc[peer, "wait_ns"].sum()) / US,
                     "pipeline_wait_us": float(g.loc[g["kind"] == "pipeline", "wait_ns"].sum()) / US,
                     "transfer_us": float(g["transfer_ns"].sum()) / US,
                     "waits_for": int(who.idxmax()) if len(who) and who.max() > 0 else -1})
    return pd.DataFrame(rows, columns=cols)


def wait_class(kw: pd.DataFrame | None) -> pd.DataFrame | None:
    """The GPU timeline's input: wait_ns and wclass (`WAIT_CLASS`) of the kernels that waited, indexed by
    GPU row label; None when none did."""
    if kw is None or kw.empty:
        return None
    k = kw[(kw["wait_ns"] > 0) & kw["kind"].isin(list(WAIT_CLASS))]
    if k.empty:
        return None
    return pd.DataFrame({"wait_ns": k["wait_ns"].to_numpy(np.int64),
                         "wclass": k["kind"].map(WAIT_CLASS).to_numpy(np.int8)}, index=k.index)


__all__ = ["COLUMNS", "KINDS", "P2P_END_TOL_NS", "P2P_KERNEL", "WAIT_CLASS", "is_pipeline", "kernel_waits", "p2p_partner_waits",
           "rank_waits", "wait_class"]

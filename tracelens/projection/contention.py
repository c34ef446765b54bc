"""Compute slowed by the communication that runs beside it: a kernel's replayed time by what overlaps it.

The replay gives every kernel its profiled duration whatever runs beside it. On the H100 runs a compute kernel
that an NCCL kernel on another stream covers runs slower than the same kernel (name, launching op, input dims)
alone in the same trace (`benchmarks/contention_ratios.py`, docs/whatif.md "Validation"): the time-weighted
ratio per kernel family and collective kind is steadier across runs than one factor per run (dense GEMMs beside a
reduce-scatter 1.57-1.80 on 10 of 12 runs, beside an all-gather 1.13-1.60; stop 30's one factor per run ranged
0.77-1.46 because each run mixes the kinds differently).

The rule: a compute unit's *alone* time is its profiled time less the slowdown of the share that communication
covered in the profile; its replayed time is that alone time slowed by the share communication covers in the
replay, at the rate of its component and the covering collective's kind:

    alone = dur / (1 + (r - 1) * f0),   dur' = alone * (1 + (r - 1) * f1)

``r`` is measured in the run's own profile where at least :data:`MIN_SAMPLES` of its units of that component ran
at least half covered by that kind (each against the median of its signature's uncovered units), else the default
(:data:`DEFAULT_RATE`, the medians over the committed multi-GPU runs). A unit nothing covers in either keeps its
time, so a replay of the run's own step is unchanged up to the replay's own placement. Not modeled: the FSDP
all-gathers' copy-in kernels (not units of the replay: `scaleout.fsdp_copies_ns` adds them as time of their own),
attention and other kernels (no rate measured), the grouped GEMMs' dependence on the routed rows.
"""

from __future__ import annotations

import numpy as np

#: a kernel counts as covered by a collective kind when that kind covers at least this share of it (rate fits)
BESIDE_MIN = 0.5
#: a kernel counts as alone when communication covers at most this share of it
ALONE_MAX = 0.02
#: units of a (component, kind) the run's own profile needs beside that kind to use its own rate
MIN_SAMPLES = 5
#: slowdown while covered, per (replay component, collective kind): medians over the committed 4 x H100 / 2 x H200
#: runs of the time-weighted ratio of `benchmarks/contention_ratios.py` (kernel families: dense GEMM, grouped GEMM,
#: elementwise, gather/index; the copies/casts component holds the dispatch path's gathers, the norms and activations
#: the elementwise kernels)
DEFAULT_RATE = {
    ("dense GEMMs", "AllGather"): 1.35, ("dense GEMMs", "ReduceScatter"): 1.75, ("dense GEMMs", "SendRecv"): 1.51,
    ("expert GEMMs", "AllGather"): 1.34, ("expert GEMMs", "ReduceScatter"): 1.34, ("expert GEMMs", "SendRecv"): 1.38,
    ("norms/activations", "AllGather"): 1.23, ("norms/activations", "ReduceScatter"): 1.15,
    ("norms/activations", "SendRecv"): 1.09,
    ("copies/casts", "AllGather"): 1.19, ("copies/casts", "ReduceScatter"): 1.09, ("copies/casts", "SendRecv"): 1.23,
}
KINDS = ("AllGather", "ReduceScatter", "SendRecv", "AllReduce")


def kind_of(name: str) -> str:
    """A collective kernel's kind by name (NCCL's kernel names); an all-to-all or p2p is ``SendRecv``."""
    for k in KINDS:
        if k.lower() in name.lower().replace("_", ""):
            return k
    return "SendRecv"


def _covered(s: np.ndarray, e: np.ndarray, cs: np.ndarray, ce: np.ndarray) -> np.ndarray:
    """Per interval [s, e): the length the union of [cs, ce) covers."""
    if not len(cs) or not len(s):
        return np.zeros(len(s))
    o = np.argsort(cs, kind="stable")
    cs, ce = cs[o], ce[o]
    # union
    us, ue = [cs[0]], [ce[0]]
    for a, b in zip(cs[1:], ce[1:]):
        if a <= ue[-1]:
            ue[-1] = max(ue[-1], b)
        else:
            us.append(a)
            ue.append(b)
    us, ue = np.asarray(us, float), np.asarray(ue, float)
    cum = np.concatenate([[0.0], np.cumsum(ue - us)])

    def upto(t):  # covered length of (-inf, t)
        i = np.searchsorted(us, t, side="right")
        last = np.clip(t - us[np.maximum(i - 1, 0)], 0, (ue - us)[np.maximum(i - 1, 0)])
        return cum[np.maximum(i - 1, 0)] + np.where(i > 0, last, 0.0)
    return upto(np.asarray(e, float)) - upto(np.asarray(s, float))


def cover(start, end, stream, comm, kind) -> dict:
    """Per unit, the share of it each collective kind covers on another stream: {kind: array}, plus ``"any"``.
    ``start`` / ``end`` / ``stream`` per unit; ``comm``: bool per unit; ``kind``: per unit (comm units' kinds)."""
    start, end = np.asarray(start, float), np.asarray(end, float)
    stream, comm = np.asarray(stream), np.asarray(comm, bool)
    kind = np.asarray(kind, dtype=object)
    dur = np.maximum(end - start, 1e-9)
    ok = ~np.isnan(start) & ~np.isnan(end)
    out = {k: np.zeros(len(start)) for k in KINDS + ("any",)}
    for s in np.unique(stream):
        mine = (stream == s) & ok
        if not mine.any():
            continue
        other = ok & comm & (stream != s) & (end > start)
        for k in KINDS:
            m = other & (kind == k)
            if m.any():
                out[k][mine] = _covered(start[mine], end[mine], start[m], end[m]) / dur[mine]
        if other.any():
            out["any"][mine] = _covered(start[mine], end[mine], start[other], end[other]) / dur[mine]
    return out


def profile_cover(w) -> tuple[dict, np.ndarray]:
    """A step profile's units (``w``: `profile.StepProfile.work`): the shares each kind covered, and the kinds."""
    comm = w["is_comm"].to_numpy().astype(bool)
    kinds = np.array([kind_of(n) if c else "" for n, c in zip(w["name"].astype(str), comm)], dtype=object)
    if "start" not in w:  # a profile with no measured timeline (a hand-built one): nothing covered anything
        return {k: np.zeros(len(w)) for k in KINDS + ("any",)}, kinds
    st = w["start"].to_numpy(float)
    return cover(st, st + w["dur"].to_numpy(float), w["stream"].to_numpy(), comm, kinds), kinds


def rates(w) -> dict:
    """Slowdown per (component, kind): the run's own where its profile has :data:`MIN_SAMPLES` covered units of the
    pair with uncovered units of the same signature (name, op, dims), else :data:`DEFAULT_RATE`."""
    cov, _ = profile_cover(w)
    if not all(c in w for c in ("name", "op", "dims", "component")):
        return dict(DEFAULT_RATE)
    comm = w["is_comm"].to_numpy().astype(bool)
    dur = w["dur"].to_numpy(float)
    comp = w["component"].astype(str).to_numpy()
    sig = list(zip(w["name"].astype(str), w["op"].astype(str), w["dims"].astype(str)))
    alone: dict = {}
    for i in np.flatnonzero(~comm & (cov["any"] <= ALONE_MAX)):
        alone.setdefault(sig[i], []).append(dur[i])
    med = {k: float(np.median(v)) for k, v in alone.items()}
    out = dict(DEFAULT_RATE)
    for (c, k) in DEFAULT_RATE:
        m = np.flatnonzero(~comm & (comp == c) & (cov[k] >= BESIDE_MIN))
        pairs = [(dur[i], med[sig[i]]) for i in m if sig[i] in med]
        if len(pairs) >= MIN_SAMPLES:
            out[(c, k)] = sum(d for d, _ in pairs) / sum(a for _, a in pairs)
    return out


def stretch(dur, comp, f0: dict, f1: dict, rate: dict) -> np.ndarray:
    """Each unit's duration with its profiled cover ``f0`` replaced by the replayed cover ``f1`` (per kind arrays of
    the same length as ``dur``; units past ``f0``'s length were not in the profile: nothing covered them)."""
    dur = np.asarray(dur, float).copy()
    comp = np.asarray(comp, dtype=object)
    n0 = len(f0["any"]) if f0 else 0
    for i in range(len(dur)):
        slow0 = slow1 = 0.0
        for k in KINDS:
            r = rate.get((comp[i], k))
            if r is None:
                continue
            if i < n0:
                slow0 += (r - 1.0) * f0[k][i]
            slow1 += (r - 1.0) * f1[k][i]
        if slow0 or slow1:
            dur[i] = dur[i] / (1.0 + slow0) * (1.0 + slow1)
    return dur


__all__ = ["ALONE_MAX", "BESIDE_MIN", "DEFAULT_RATE", "KINDS", "MIN_SAMPLES", "cover", "kind_of", "profile_cover",
           "rates", "stretch"]

"""Communication vs synchronization across ranks.

A collective kernel's duration on one rank is part waiting (for the last rank of its group to arrive)
and part communication (moving data once everyone is there). Matching each collective instance across
the ranks of its process group separates them:

    last arrival = max over ranks of the kernel start
    sync wait(r) = last arrival - start(r)          time rank r's kernel spent waiting for others
    comm(r)      = end(r) - last arrival             the communication proper

Matching is by what identifies an instance, not by global position: per process group (and, for
point-to-point, per peer pair) and per profiler step, each rank's collectives in launch order form a
sequence of (collective family, message size); the ranks' sequences are aligned (the most instances
matched; among equally good alignments, the one whose matched kernels end closest in time), so a rank
that lacks one instance (dropped, or outside its window) leaves a gap instead of shifting every later
pairing. `seq` is an instance's order within its process group, `instance` its order within
(group, family). The collective name, process group and message size come from the kernel's args, else
from the enclosing CPU `record_param_comms` op, else from the `nccl:*` annotation (its input dims and
type); a size that is not known is -1 and is never summed.

Cross-rank figures (sync wait, comm, skew, last rank, bandwidths) need every rank of the instance's group
in the loaded traces: for an instance whose group has ranks that were not loaded (a partial rank set) or
that some rank lacks, they are NaN (`cross_rank` False) and only per-rank figures (kernel time, bytes)
remain. An instance that one rank started before another rank's profiled window even began is a
start-up artifact (the wait is partly outside the trace): it is flagged `startup` and left out of
per-step and per-rank totals.

Bandwidths follow NCCL's definitions (nccl-tests PERFORMANCE.md): algbw = bytes / comm time, busbw =
algbw x factor: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; others 1.

Useful bandwidth: a sync-free MoE run (levels 2-3, EP > 1) sends worst-case token buffers of which only the
routed rows carry tokens (`tracelens.analysis.moe`, the `moe_padding` finding). Where that padding is known,
`comm_summary` also gives each rank's all-to-all bytes and bus bandwidth counting the routed bytes only
(`useful_bytes`, `useful_busbw_gbps`: the instance's busbw x routed / sent bytes); NaN elsewhere.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import pandas as pd

from .. import categories as C
from . import moe
from .grouped import named_agg_column

US = 1000.0

DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2, "long": 8,
    "int64": 8, "int": 4, "int32": 4, "short": 2, "int16": 2, "char": 1, "byte": 1, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "long int": 8, "unsigned char": 1, "signed char": 1, "c10::half": 2, "c10::bfloat16": 2,
}


def dtype_bytes(name: str | None) -> int | None:
    if not name or name != name:
        return None
    key = str(name).strip().lower().replace("c10::", "").replace("torch.", "")
    return DTYPE_BYTES.get(key)


def _norm_collective(name: str) -> str:
    n = re.sub(r"[^a-z0-9]", "", str(name).lower())
    if n in ("send", "recv", "sendrecv"):
        return "p2p"
    if n.startswith(("alltoall",)):
        return "all_to_all"
    if n.startswith("allreduce"):
        return "all_reduce"
    if n.startswith(("allgather", "allgatherbase", "allgatherintotensor")):
        return "all_gather"
    if n.startswith(("reducescatter",)):
        return "reduce_scatter"
    if n.startswith("broadcast"):
        return "broadcast"
    if n.startswith("reduce"):
        return "reduce"
    return n or "unknown"


def bus_factor(family: str, n: int) -> float:
    if n <= 1:
        return 1.0
    if family == "all_reduce":
        return 2.0 * (n - 1) / n
    if family in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _kernel_name_collective(name: str) -> str:
    """Collective from an NCCL/RCCL kernel name, for traces whose kernels lack collective args."""
    m = re.search(r"(AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|SendRecv|AllToAll|Send|Recv)", name)
    return m.group(1) if m else "unknown"


INSTANCE_COLUMNS = ["group", "peers", "family", "collective", "seq", "instance", "rank", "bytes", "size_source",
                    "start_us", "end_us", "kernel_us", "sync_us", "comm_us", "algbw_gbps", "busbw_gbps", "last_rank",
                    "skew_us", "startup", "step", "ranks_matched", "ranks_expected", "group_size", "cross_rank",
                    "gpu_row"]

# families whose every rank needs data from every other rank: no rank's kernel can end before the last
# rank's kernel began (on one clock); `clock_violations` relies on it
SYNCHRONIZING = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all"})
_PEERS = re.compile(r"(\d+)\s*(?:->|<-)\s*(\d+)")
# above this many cells one alignment falls back to matching by order within (group, family)
_MAX_DP_CELLS = 40_000_000


def _parse_ranks(text) -> tuple[int, ...] | None:
    """'[0, 1]' -> (0, 1); '[]', '' or anything else -> None (not known)."""
    if not isinstance(text, str) or not text.strip().startswith("["):
        return None
    try:
        v = json.loads(text)
    except ValueError:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return None
    return tuple(v)


def _annotation_bytes(dims_text, types_text) -> int:
    """Bytes of the first input of a `nccl:*` annotation from its Input Dims / Input type; -1 if unknown."""
    try:
        dims = json.loads(dims_text) if isinstance(dims_text, str) else None
        types = json.loads(types_text) if isinstance(types_text, str) else None
    except ValueError:
        return -1
    if not dims or not types or not isinstance(dims, list) or not isinstance(types, list):
        return -1
    size = dtype_bytes(types[0]) if isinstance(types[0], str) else None
    first = dims[0]
    if size is None or not isinstance(first, list):
        return -1
    shapes = first if first and all(isinstance(s, list) for s in first) else [first]  # a TensorList
    total = 0
    for s in shapes:
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s):
            return -1
        total += int(np.prod(s, dtype=np.int64)) if s else 1
    return total * size


# comm_kernels parses the same few texts for each of thousands of kernels (a collective's name, a process group's
# ranks, an annotation's input shapes): each distinct text once (the functions are pure; the results immutable)
_norm_collective_of = lru_cache(maxsize=4096)(_norm_collective)
_kernel_name_collective_of = lru_cache(maxsize=4096)(_kernel_name_collective)
_parse_ranks_text = lru_cache(maxsize=4096)(_parse_ranks)
_annotation_bytes_text = lru_cache(maxsize=4096)(_annotation_bytes)


def _ranks_of(text) -> tuple[int, ...] | None:
    """`_parse_ranks`, once per distinct string."""
    return _parse_ranks_text(text) if isinstance(text, str) else _parse_ranks(text)


def _enclosing(tree: pd.DataFrame | None, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each host row label in `start` (-1: none): the nearest enclosing `record_param_comms` op and
    `nccl:*` annotation (row labels, -1 when absent), walking the call tree's parent links."""
    n = len(start)
    rpc = np.full(n, -1, dtype=np.int64)
    ann = np.full(n, -1, dtype=np.int64)
    if tree is None or tree.empty or not n:
        return rpc, ann
    is_rpc = C.map_strings(tree["name"], lambda s: s == "record_param_comms")
    is_ann = C.map_strings(tree["name"], lambda s: s.startswith("nccl:"))
    parent = tree["parent"].to_numpy()
    index = tree.index
    cur = start.astype(np.int64).copy()
    for _ in range(256):  # deeper than any real call stack
        live = np.flatnonzero(cur >= 0)
        if not len(live):
            break
        pos = C.positions(index, cur[live])
        ok = pos >= 0
        live, pos = live[ok], pos[ok]
        hit = is_rpc[pos] & (rpc[live] < 0)
        rpc[live[hit]] = cur[live[hit]]
        hit = is_ann[pos] & (ann[live] < 0)
        ann[live[hit]] = cur[live[hit]]
        nxt = np.full(n, -1, dtype=np.int64)
        nxt[live] = parent[pos]
        nxt[(rpc >= 0) & (ann >= 0)] = -1
        cur = nxt
    return rpc, ann


def _values(frame: pd.DataFrame, col: str, labels: np.ndarray, missing):
    """frame[col] at row labels (object array; `missing` where the label is -1 or the value is NA)."""
    out = np.full(len(labels), missing, dtype=object)
    ok = labels >= 0
    if not ok.any() or col not in frame.columns:
        return out
    pos = C.positions(frame.index, labels[ok])
    good = pos >= 0
    vals = frame[col].iloc[pos[good]].to_numpy(dtype=object)
    isna = pd.isna(vals)
    vals[isna] = missing
    sel = np.flatnonzero(ok)[good]
    out[sel] = vals
    return out


def _int(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def comm_kernels(analysis) -> pd.DataFrame:
    """Every communication kernel with what identifies its collective, from the kernel's args or, when the
    kernel lacks them, from the CPU events that launched it. Columns: row, rank, ts, end, dur, step,
    collective, family, group, peers, pg_ranks, group_size, bytes, size_source, variable (per-rank sizes).
    Reads `analysis.gpu`, `.tree` and `.trace` (an Analysis keeps it as its `comm_kernels` entry)."""
    g = analysis.gpu
    k = g[g["is_comm"].to_numpy()] if not g.empty else g
    cols = ["row", "rank", "ts", "end", "dur", "step", "collective", "family", "group", "peers", "pg_ranks",
            "group_size", "bytes", "size_source", "variable"]
    if k.empty:
        return pd.DataFrame(columns=cols)
    tree = getattr(analysis, "tree", None)
    events = analysis.trace.events
    launch = k["launch"].to_numpy() if "launch" in k.columns else np.full(len(k), -1)
    op_row = k["op_row"].to_numpy() if "op_row" in k.columns else np.full(len(k), -1)
    rpc, ann = _enclosing(tree, np.where(launch >= 0, launch, op_row).astype(np.int64))
    names = C.strings(k["name"])

    def kcol(c, missing):
        v = k[c].to_numpy(dtype=object) if c in k.columns else np.full(len(k), missing, dtype=object)
        v = v.copy()
        v[pd.isna(v)] = missing
        return v

    k_coll, r_coll = kcol("collective", ""), _values(events, "collective", rpc, "")
    ann_name = _values(tree, "name", ann, "") if tree is not None else np.full(len(k), "", dtype=object)
    a_coll = np.array([re.sub(r"\s.*$", "", str(s)[5:]) if s else "" for s in ann_name], dtype=object)
    collective, family, peers = [], [], []
    for i in range(len(k)):
        c = k_coll[i] or r_coll[i] or (a_coll[i] if a_coll[i] not in ("", "coalesced") else "") \
            or _kernel_name_collective_of(names[i])
        collective.append(str(c))
        fam = _norm_collective_of(str(c))
        family.append(fam)
        m = _PEERS.search(str(ann_name[i])) if fam == "p2p" else None
        peers.append("-".join(str(x) for x in sorted((int(m.group(1)), int(m.group(2))))) if m else "")
    k_pg, r_pg = kcol("pg_name", ""), _values(events, "pg_name", rpc, "")
    k_ranks, r_ranks = kcol("pg_ranks", ""), _values(events, "pg_ranks", rpc, "")
    group, pg_ranks = [], []
    for i in range(len(k)):
        ranks = _ranks_of(k_ranks[i]) or _ranks_of(r_ranks[i])
        pg_ranks.append(ranks)
        group.append(str(k_pg[i] or r_pg[i] or (str(list(ranks)) if ranks else "default")))
    k_gs, r_gs = kcol("group_size", -1), _values(events, "group_size", rpc, -1)
    group_size = [max(_int(a), _int(b), len(r) if r else -1) if _int(a) <= 0 else _int(a)
                  for a, b, r in zip(k_gs, r_gs, pg_ranks)]
    # message size: kernel args, else the record_param_comms op, else the nccl:* annotation's input
    sizes, sources = [], []
    k_in, k_out, k_dt = kcol("in_nelems", -1), kcol("out_nelems", -1), kcol("dtype", "")
    r_in, r_out, r_dt = (_values(events, c, rpc, m) for c, m in (("in_nelems", -1), ("out_nelems", -1), ("dtype", "")))
    a_dims = _values(tree, "input_dims", ann, None) if tree is not None else np.full(len(k), None, dtype=object)
    a_types = _values(tree, "input_types", ann, None) if tree is not None else np.full(len(k), None, dtype=object)
    for i in range(len(k)):
        fam = family[i]
        b, src = -1, "unknown"
        for nin, nout, dt, where in ((k_in[i], k_out[i], k_dt[i], "kernel"), (r_in[i], r_out[i], r_dt[i], "cpu_op")):
            nel = _int(nout if fam == "all_gather" else nin)
            size = dtype_bytes(dt)
            if nel > 0 and size is not None:
                b, src = nel * size, where
                break
        if b < 0 and ann[i] >= 0:
            dims, types = a_dims[i], a_types[i]
            ab = (_annotation_bytes_text(dims, types) if isinstance(dims, (str, type(None))) and isinstance(types, (str, type(None)))
                  else _annotation_bytes(dims, types))
            if ab > 0 and fam == "all_gather":  # the annotation holds this rank's input shard
                ab = ab * group_size[i] if group_size[i] > 0 else -1
            if ab > 0:
                b, src = ab, "annotation"
        sizes.append(b)
        sources.append(src)
    variable = np.array([c.lower().endswith("v") for c in collective])
    peer_sets = p2p_peer_sets(events)
    return pd.DataFrame({
        "row": k.index.to_numpy(), "rank": k["rank"].to_numpy().astype(int), "ts": k["ts"].to_numpy(),
        "end": k["end"].to_numpy(), "dur": k["dur"].to_numpy(), "step": k["step"].to_numpy().astype(int),
        "collective": collective, "family": family, "group": group, "peers": peers, "pg_ranks": pg_ranks,
        "group_size": np.array(group_size, dtype=np.int64), "bytes": np.array(sizes, dtype=np.int64),
        "size_source": sources, "variable": variable,
        "p2p_peers": [peer_sets.get(int(r)) for r in k["rank"].to_numpy()],
        "p2p_kernel_peers": p2p_kernel_peers(
            events, k["rank"].to_numpy(), k["launch_ts"].to_numpy() if "launch_ts" in k.columns
            else np.full(len(k), -1), np.array([f == "p2p" for f in family])),
    }, columns=cols + ["p2p_peers", "p2p_kernel_peers"])


def _p2p_op_peers(events: pd.DataFrame) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per rank: its point-to-point ops (`record_param_comms` send / recv), as (start ts, peer global rank), in
    time order. The op's peer is its `rank` argument (the fourth of its Concrete Inputs: the destination of a
    send, the source of a receive, a rank of its process group), mapped to a global rank through the group's
    ranks."""
    need = {"name", "collective", "concrete_inputs", "rank"}
    if events is None or events.empty or not need <= set(events.columns):
        return {}
    coll = C.map_strings(events["collective"], lambda x: x in ("send", "recv"))
    is_rpc = C.map_strings(events["name"], lambda x: x == "record_param_comms")
    sel = events.loc[coll & is_rpc, [c for c in ("rank", "ts", "concrete_inputs", "pg_ranks") if c in events.columns]]
    if sel.empty:
        return {}
    out: dict[int, list] = {}
    pg = sel["pg_ranks"].to_numpy(dtype=object) if "pg_ranks" in sel.columns else np.full(len(sel), None, dtype=object)
    ts_col = sel["ts"].to_numpy() if "ts" in sel.columns else np.zeros(len(sel), dtype=np.int64)
    for r, t, ci, ranks in zip(sel["rank"].to_numpy(), ts_col, sel["concrete_inputs"].to_numpy(dtype=object), pg):
        try:
            vals = json.loads(ci) if isinstance(ci, str) else None
        except ValueError:
            continue
        if not isinstance(vals, list) or len(vals) < 4:
            continue
        try:
            peer = int(vals[3])
        except (TypeError, ValueError):
            continue
        members = _parse_ranks(ranks)
        if members is not None and 0 <= peer < len(members):
            peer = members[peer]
        if peer != int(r) and peer >= 0:
            out.setdefault(int(r), []).append((int(t), peer))
    res = {}
    for r, v in out.items():
        v.sort(key=lambda x: x[0])
        res[r] = (np.array([x[0] for x in v], dtype=np.int64), np.array([x[1] for x in v], dtype=np.int64))
    return res


def p2p_peer_sets(events: pd.DataFrame) -> dict[int, tuple[int, ...]]:
    """Per rank: the global ranks its point-to-point ops (`record_param_comms` send / recv) exchange with
    (`_p2p_op_peers`)."""
    return {r: tuple(sorted({int(p) for p in peers})) for r, (_, peers) in _p2p_op_peers(events).items()}


def p2p_kernel_peers(events: pd.DataFrame, rank: np.ndarray, launch_ts: np.ndarray,
                     is_p2p: np.ndarray) -> list[tuple[int, ...] | None]:
    """Per kernel (rows of `rank`, `launch_ts`, `is_p2p`): the global ranks the point-to-point ops it carries
    exchange with. A rank's send / recv ops belong to the first point-to-point kernel it launches at or after
    them (`batch_isend_irecv` coalesces several into one SendRecv kernel), as `critical_path.p2p_links` pairs
    them. None for other kernels and for a kernel no op maps to (its rank's peers then stand for it): a
    pipeline stage's kernel that only receives from the previous stage is not paired with the next one."""
    ops = _p2p_op_peers(events)
    rank, launch_ts = np.asarray(rank, np.int64), np.asarray(launch_ts, np.int64)
    out: list[tuple[int, ...] | None] = [None] * len(rank)
    for r, (o_ts, o_peer) in ops.items():
        idx = np.flatnonzero((rank == r) & np.asarray(is_p2p, bool) & (launch_ts >= 0))
        if not len(idx):
            continue
        idx = idx[np.argsort(launch_ts[idx], kind="stable")]
        at = np.searchsorted(launch_ts[idx], o_ts, side="left")
        got: dict[int, set] = {}
        for i, p in zip(at.tolist(), o_peer.tolist()):
            if i < len(idx):
                got.setdefault(int(idx[i]), set()).add(int(p))
        for i, ps in got.items():
            out[i] = tuple(sorted(ps))
    return out


def _p2p_by_overlap(df: pd.DataFrame) -> None:
    """Point-to-point kernels of no known peer pair (``peers`` empty: batched sends and receives, whose kernels
    cover several ops) cannot be matched as a sequence across ranks: a pipeline stage exchanges with two
    neighbours, in its own order. Each is paired instead with its partner kernels on the peer ranks it
    exchanges with (`waits.p2p_partner_waits`: the overlapping kernel that ends with it); its last arrival is
    the latest partner's start. Edits sync_ns, comm_ns, last_rank, skew and cross_rank in place for those rows
    (NaN, not cross-rank, where no peer kernel overlaps it)."""
    from .waits import p2p_partner_waits

    sel = np.flatnonzero(((df["family"] == "p2p") & (df["peers"] == "")).to_numpy())
    if not len(sel):
        return
    sub = df.iloc[sel]
    sets: dict[int, tuple] = {}
    if "p2p_peers" in sub.columns:
        for r, ps in zip(sub["rank"], sub["p2p_peers"]):
            if isinstance(ps, tuple) and int(r) not in sets:
                sets[int(r)] = ps
    row_peers = list(sub["p2p_kernel_peers"]) if "p2p_kernel_peers" in sub.columns else None
    ts, end = sub["ts"].to_numpy(np.int64), sub["end"].to_numpy(np.int64)
    sync, last = p2p_partner_waits(ts, end, sub["rank"].to_numpy(np.int64), sets, row_peers)
    idx = df.index[sel]
    df.loc[idx, "sync_ns"] = sync
    df.loc[idx, "comm_ns"] = (end - ts).astype(float) - sync
    df.loc[idx, "last_rank"] = last
    df.loc[idx, "skew"] = sync
    df.loc[idx, "cross_rank"] = ~np.isnan(sync)


# ------------------------------------------------------------------------------------ matching


def align(ref_fam, ref_size, ref_end, q_fam, q_size, q_end) -> list[tuple[int, int]]:
    """Align two ranks' collective sequences (family codes, sizes with -1 = unknown, end times) and
    return the matched (ref index, q index) pairs in order.

    A pair is allowed when the families are equal and the sizes are equal or one is unknown. The
    alignment maximizes the number of matched pairs (each unmatched instance costs 1); among alignments
    with as many pairs it takes the one whose matched kernels end closest in time (a cost below 1 in
    total, so time only breaks ties). Dynamic programming, vectorized per row."""
    n, m = len(ref_fam), len(q_fam)
    if n == 0 or m == 0:
        return []
    ref_end = np.asarray(ref_end, dtype=np.float64)
    q_end = np.asarray(q_end, dtype=np.float64)
    both = np.concatenate([ref_end, q_end])
    spacing = float(np.median(np.diff(np.sort(both)))) if len(both) > 1 else 0.0
    scale = max(spacing, 1.0)
    eps = 1.0 / (min(n, m) + 1)
    idx = np.arange(m + 1, dtype=np.float64)
    prev = idx.copy()
    choice = np.zeros((n + 1, m + 1), dtype=np.int8)  # 0 diagonal (pair), 1 skip ref i, 2 skip q j
    choice[0, 1:] = 2
    choice[1:, 0] = 1
    q_fam, q_size = np.asarray(q_fam), np.asarray(q_size)
    for i in range(1, n + 1):
        ok = (q_fam == ref_fam[i - 1]) & ((q_size < 0) | (ref_size[i - 1] < 0) | (q_size == ref_size[i - 1]))
        dt = np.abs(q_end - ref_end[i - 1])
        cost = np.where(ok, eps * dt / (dt + scale), np.inf)
        diag = prev[:-1] + cost
        up = prev[1:] + 1.0
        x = np.empty(m + 1)
        x[0] = prev[0] + 1.0
        x[1:] = np.minimum(diag, up)
        row = idx + np.minimum.accumulate(x - idx)
        ch = np.where(diag <= up, 0, 1).astype(np.int8)
        left = row[1:] < x[1:] - 1e-12
        ch[left] = 2
        choice[i, 1:] = ch
        prev = row
    pairs = []
    i, j = n, m
    while i > 0 or j > 0:
        c = choice[i, j]
        if c == 0:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif c == 1:
            i -= 1
        else:
            j -= 1
    return pairs[::-1]


class _Seq(NamedTuple):
    """One rank's comm kernels of a chunk, in (ts, row) order: row labels, family codes, size keys, ends."""

    labels: np.ndarray
    fam: np.ndarray
    key: np.ndarray
    end: np.ndarray


def _match_chunk(items: dict[int, _Seq]) -> list[dict[int, int]]:
    """Progressive alignment of several ranks' sequences (one process group, one step): the rank with
    the most instances first, every other rank aligned to the instances gathered so far. Returns the
    instances in order, each as {rank: row label in the comm-kernel table}."""
    order = sorted(items, key=lambda r: (-len(items[r].labels), r))
    first = items[order[0]]
    members = [{order[0]: lbl} for lbl in first.labels.tolist()]
    fam = first.fam.copy()
    size = first.key.copy()
    end = first.end.copy()
    for r in order[1:]:
        q = items[r]
        qf, qs, qe = q.fam, q.key, q.end
        if len(fam) == len(qf) and (fam == qf).all() and ((size < 0) | (qs < 0) | (size == qs)).all():
            pairs = [(i, i) for i in range(len(qf))]  # the common case: the same sequence on every rank
        elif len(fam) * len(qf) > _MAX_DP_CELLS:
            pairs = _order_pairs(fam, qf)
        else:
            pairs = align(fam, size, end, qf, qs, qe)
        # merge: consensus entries and q's unmatched ones, in sequence order
        new_members, nf, ns, ne = [], [], [], []
        ci = qj = 0
        labels = q.labels.tolist()
        for a, b in pairs + [(len(fam), len(qf))]:
            while ci < a:
                new_members.append(members[ci]); nf.append(fam[ci]); ns.append(size[ci]); ne.append(end[ci]); ci += 1
            while qj < b:
                new_members.append({r: labels[qj]}); nf.append(qf[qj]); ns.append(qs[qj]); ne.append(qe[qj]); qj += 1
            if a < len(fam) and b < len(qf):
                mem = dict(members[a]); mem[r] = labels[b]
                new_members.append(mem); nf.append(fam[a]); ns.append(size[a] if size[a] >= 0 else qs[b]); ne.append(end[a])
                ci, qj = a + 1, b + 1
        members, fam, size, end = new_members, np.array(nf), np.array(ns), np.array(ne)
    return members


def _order_pairs(fam_a, fam_b) -> list[tuple[int, int]]:
    """Fallback for very long sequences: the i-th instance of a family on one rank with the i-th on the other."""
    pairs = []
    for f in set(fam_a.tolist()) & set(fam_b.tolist()):
        ia, ib = np.flatnonzero(fam_a == f), np.flatnonzero(fam_b == f)
        pairs += list(zip(ia.tolist(), ib.tolist()))
    pairs.sort()
    out, last_b = [], -1
    for a, b in pairs:  # keep the pairs monotone in both sequences
        if b > last_b:
            out.append((a, b))
            last_b = b
    return out


def _world_size(trace) -> int | None:
    for r in trace.ranks:
        if r.world_size:
            return r.world_size
    return None


def _pg_config(trace) -> dict[str, tuple[int, ...]]:
    """Process group name -> global ranks, from the loaded ranks' distributedInfo.pg_config."""
    out: dict[str, tuple[int, ...]] = {}
    for r in trace.ranks:
        for pg in (r.distributed_info or {}).get("pg_config") or []:
            if isinstance(pg, dict) and isinstance(pg.get("ranks"), list) and pg.get("pg_name") is not None:
                ranks = tuple(x for x in pg["ranks"] if isinstance(x, int))
                if ranks:
                    out[str(pg["pg_name"])] = ranks
    return out


def expected_ranks(kern: pd.DataFrame, trace) -> dict[tuple[str, str], tuple[tuple[int, ...] | None, int]]:
    """(group, peers) -> (the group's global ranks when known, the group's size) of every group seen."""
    config = _pg_config(trace)
    world = _world_size(trace)
    loaded = sorted({int(r) for r in kern["rank"]})
    out = {}
    for (group, peers), g in kern.groupby(["group", "peers"], sort=False):
        if peers:
            ranks = tuple(int(x) for x in peers.split("-"))
            out[(group, peers)] = (ranks, len(ranks))
            continue
        known = [r for r in g["pg_ranks"] if r]
        ranks = known[0] if known else config.get(group)
        size = int(g["group_size"].max())
        if ranks:
            size = max(size, len(ranks))
        elif size <= 0:
            if (g["family"] == "p2p").all():
                size = 2
            elif group == "default" and world:
                size = world  # no group in the trace: the default group spans the world
            else:
                size = len(set(g["rank"]) | set(loaded if group == "default" else []))
        out[(group, peers)] = (ranks, size)
    return out


def collective_instances(analysis, kern: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (collective instance, rank) with its sync wait and pure communication time. kern: the
    `comm_kernels` rows when already computed (the analysis's entry)."""
    kern = comm_kernels(analysis) if kern is None else kern
    if kern.empty:
        return pd.DataFrame(columns=INSTANCE_COLUMNS)
    return match_instances(kern, window_starts(analysis.trace.events), analysis.trace)


def window_starts(events: pd.DataFrame) -> pd.Series:
    """Where each rank's profiled window begins: its first event's ts, a Series indexed by rank. One rank's
    events (a trace file's, the common case) without a groupby of every event (30 ms on 670,000)."""
    ranks = events["rank"].to_numpy()
    if len(ranks) and ranks[0] == ranks[-1] and (ranks == ranks[0]).all():
        s = pd.Series([events["ts"].to_numpy().min()], index=pd.Index([ranks[0]], name="rank"), name="ts")
        return s
    return events.groupby("rank")["ts"].min()


def match_instances(kern: pd.DataFrame, window_start: pd.Series, trace) -> pd.DataFrame:
    """`collective_instances` from what it needs of each rank: the comm-kernel rows (`comm_kernels`, every
    rank's in rank order; `row` = the GPU event's row label in the all-ranks tables), each rank's first
    event time (a Series indexed by rank) and the ranks' `RankInfo`s (`trace.ranks`). The cross-rank step
    `tracelens.scale` runs on per-rank reductions, so it never holds any rank's event tables."""
    if kern.empty:
        return pd.DataFrame(columns=INSTANCE_COLUMNS)
    kern = kern.copy()
    fam_codes = {f: i for i, f in enumerate(sorted(set(kern["family"])))}
    kern["fam"] = kern["family"].map(fam_codes).astype(np.int64)
    kern["key"] = np.where(kern["variable"].to_numpy() | (kern["bytes"].to_numpy() <= 0), -1, kern["bytes"].to_numpy())
    expected = expected_ranks(kern, trace)
    entries = []  # (group, peers, chunk start, position, members)
    # the chunks, each (group, peers, step) in order of appearance, and in each its ranks' kernels by (ts, row): one
    # sort of the table, then slices (a trace of many steps has thousands of chunks)
    chunk = kern.groupby(["group", "peers", "step"], sort=False).ngroup().to_numpy()
    keep = np.flatnonzero(chunk >= 0)  # (a missing key is in no chunk, as groupby leaves it out)
    rank_col = kern["rank"].to_numpy().astype(np.int64)
    ts_col = kern["ts"].to_numpy()
    order = keep[np.lexsort((kern["row"].to_numpy()[keep], ts_col[keep], rank_col[keep], chunk[keep]))]
    labels, fam, key, end = kern.index.to_numpy()[order], *(kern[c].to_numpy()[order] for c in ("fam", "key", "end"))
    c_sorted, r_sorted = chunk[order], rank_col[order]
    bounds = np.flatnonzero(np.diff(c_sorted) != 0) + 1
    c_start, c_end = np.append(0, bounds), np.append(bounds, len(order))
    names = kern[["group", "peers"]].to_numpy()[order]
    for a, b in zip(c_start.tolist(), c_end.tolist()):
        rb = (np.flatnonzero(np.diff(r_sorted[a:b]) != 0) + 1 + a).tolist()
        items = {int(r_sorted[i]): _Seq(labels[i:j], fam[i:j], key[i:j], end[i:j]) for i, j in zip([a, *rb], [*rb, b])}
        t0 = int(ts_col[order[a:b]].min())
        group, peers = names[a]
        for pos, mem in enumerate(_match_chunk(items)):
            entries.append((group, peers, t0, pos, mem))
    entries.sort(key=lambda e: (e[0], e[1], e[2], e[3]))
    rows, ent_id, seq, mem_of = [], [], [], []  # mem_of: each row's entry's ranks
    last_key, s = None, 0
    for e_i, (group, peers, _, _, mem) in enumerate(entries):
        s = s + 1 if (group, peers) == last_key else 0
        last_key = (group, peers)
        ranks_of = frozenset(mem)
        for lbl in mem.values():
            rows.append(lbl)
            ent_id.append(e_i)
            seq.append(s)
            mem_of.append(ranks_of)
    df = kern.loc[rows].reset_index(drop=True)
    df["entry"] = ent_id
    df["seq"] = seq
    # instance: order within (group, peers, family); every member of an entry shares it
    first = df.drop_duplicates("entry").sort_values("entry", kind="stable")
    first = first.assign(instance=first.groupby(["group", "peers", "family"]).cumcount())
    df["instance"] = df["entry"].map(first.set_index("entry")["instance"])
    grp = df.groupby("entry")
    df["ranks_matched"] = grp["rank"].transform("nunique")
    exp = [expected[(g, p)] for g, p in zip(df["group"], df["peers"])]
    df["ranks_expected"] = [n for _, n in exp]
    df["cross_rank"] = [len(m) >= n and (ranks is None or set(ranks) <= m) for m, (ranks, n) in zip(mem_of, exp)]
    df["group_size"] = np.where(df["group_size"] > 0, df["group_size"], df["ranks_expected"])
    last_arrival = grp["ts"].transform("max")
    first_arrival = grp["ts"].transform("min")
    cross = df["cross_rank"].to_numpy()
    ts, end, dur = df["ts"].to_numpy(), df["end"].to_numpy(), df["dur"].to_numpy()
    sync_ns = np.minimum(np.clip(last_arrival - ts, 0, None), dur).astype(float)
    comm_ns = np.clip(end - np.maximum(last_arrival, ts), 0, None).astype(float)
    df["sync_ns"] = np.where(cross, sync_ns, np.nan)
    df["comm_ns"] = np.where(cross, comm_ns, np.nan)
    df["skew"] = np.where(cross, (last_arrival - first_arrival).astype(float), np.nan)
    last_rank = df.loc[grp["ts"].idxmax(), ["entry", "rank"]].set_index("entry")["rank"]
    df["last_rank"] = np.where(cross, df["entry"].map(last_rank), -1)
    if (df["family"] == "p2p").any():
        _p2p_by_overlap(df)
        cross = df["cross_rank"].to_numpy()
    # start-up artifact: the instance began before a rank of its group that was loaded started profiling
    ws_by_rank = {int(r): int(v) for r, v in window_start.items()}
    group_ws = []
    for m, (ranks, _) in zip(mem_of, exp):
        pool = [r for r in (ranks or m) if r in ws_by_rank] or list(m)
        group_ws.append(max(ws_by_rank.get(r, -2**62) for r in pool))
    df["startup"] = first_arrival.to_numpy() < np.array(group_ws)
    # a point-to-point kernel whose peer's kernel is in the traces waited for that kernel, a wait measured on
    # both sides: a pipeline stage's first receive waits for the schedule's fill, not for the profiler
    p2p = ((df["family"] == "p2p") & (df["peers"] == "")).to_numpy()
    if p2p.any():
        st = df["startup"].to_numpy().copy()
        st[p2p] = np.isnan(df["sync_ns"].to_numpy(dtype=float)[p2p]) & (df["ts"].to_numpy()[p2p] < np.array(group_ws)[p2p])
        df["startup"] = st
    with np.errstate(divide="ignore", invalid="ignore"):
        alg = np.where((df["bytes"] > 0) & (df["comm_ns"] > 0), df["bytes"] / df["comm_ns"], np.nan)  # bytes/ns = GB/s
    df["algbw_gbps"] = alg
    df["busbw_gbps"] = alg * np.array([bus_factor(f, int(n)) for f, n in zip(df["family"], df["group_size"])])
    t0 = int(window_start.min())
    out = pd.DataFrame({
        "group": df["group"].astype(str), "peers": df["peers"].astype(str), "family": df["family"],
        "collective": df["collective"], "seq": df["seq"].astype(int), "instance": df["instance"].astype(int),
        "rank": df["rank"].astype(int), "bytes": df["bytes"].astype(np.int64), "size_source": df["size_source"],
        "start_us": (df["ts"] - t0) / US, "end_us": (df["end"] - t0) / US, "kernel_us": df["dur"] / US,
        "sync_us": df["sync_ns"] / US, "comm_us": df["comm_ns"] / US, "algbw_gbps": df["algbw_gbps"],
        "busbw_gbps": df["busbw_gbps"], "last_rank": df["last_rank"].astype(int), "skew_us": df["skew"] / US,
        "startup": df["startup"].astype(bool), "step": df["step"].astype(int),
        "ranks_matched": df["ranks_matched"].astype(int), "ranks_expected": df["ranks_expected"].astype(int),
        "group_size": df["group_size"].astype(int), "cross_rank": df["cross_rank"].astype(bool),
        "gpu_row": df["row"].astype(np.int64),
    })
    return out.sort_values(["start_us", "rank"], ignore_index=True, kind="stable")[INSTANCE_COLUMNS]


def group_coverage(analysis, inst: pd.DataFrame | None = None, kern: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per process group (and peer pair): the ranks it spans, those loaded, those missing, and how many of
    its instances have cross-rank figures. `complete` is False when a rank of the group was not loaded.
    inst / kern: the collective instances and comm-kernel rows when already computed."""
    kern = comm_kernels(analysis) if kern is None else kern
    inst = collective_instances(analysis, kern) if inst is None else inst
    return coverage(analysis.trace, kern, inst)


def coverage(trace, kern: pd.DataFrame, inst: pd.DataFrame) -> pd.DataFrame:
    """`group_coverage` from the comm-kernel rows, the instances and the ranks loaded (`trace.ranks`): the
    many-rank path (tracelens.scale) calls it on its reductions."""
    cols = ["group", "peers", "group_size", "ranks_expected", "ranks_loaded", "ranks_missing", "instances",
            "cross_rank_instances", "complete"]
    if kern.empty:
        return pd.DataFrame(columns=cols)
    loaded = {int(r.rank) for r in trace.ranks}
    rows = []
    for (group, peers), (ranks, size) in expected_ranks(kern, trace).items():
        have = sorted({int(r) for r in kern.loc[(kern["group"] == group) & (kern["peers"] == peers), "rank"]})
        if ranks:
            missing = sorted(set(ranks) - loaded)
            n_missing = len(missing)
        else:
            missing, n_missing = [], max(size - len(have), 0)
        sub = inst[(inst["group"] == group) & (inst["peers"] == peers)].drop_duplicates(["seq"])
        rows.append({"group": group, "peers": peers, "group_size": int(size),
                     "ranks_expected": list(ranks) if ranks else None, "ranks_loaded": have,
                     "ranks_missing": missing if ranks else n_missing, "instances": int(len(sub)),
                     "cross_rank_instances": int(sub["cross_rank"].sum()), "complete": n_missing == 0})
    return pd.DataFrame(rows, columns=cols)


def partial_note(analysis, inst: pd.DataFrame | None = None, kern: pd.DataFrame | None = None,
                 cov: pd.DataFrame | None = None) -> str:
    """One sentence naming the process groups with ranks that are not in the loaded traces, or ''.
    inst / kern: the collective instances and comm-kernel rows when already computed; cov: their
    `group_coverage`, when already computed."""
    cov = group_coverage(analysis, inst, kern) if cov is None else cov
    world = _world_size(analysis.trace)
    loaded = sorted(analysis.trace.rank_ids)
    parts = []
    if world and len(loaded) < world:
        parts.append(f"partial rank set: {len(loaded)} of {world} ranks loaded (ranks {ranks_text(loaded)})")
    bad = cov[~cov["complete"]] if not cov.empty else cov
    for r in bad.itertuples(index=False):
        miss = r.ranks_missing
        what = f"ranks {ranks_text(miss)} missing" if isinstance(miss, list) else f"{miss} of its {r.group_size} ranks missing"
        name = f"group {r.group}" + (f" ({r.peers})" if r.peers else "")
        parts.append(f"{name}: {what}")
    if not parts:
        return ""
    return ("; ".join(parts) + ". Sync wait, comm time, skew, last rank, stragglers and bus bandwidth need every "
            "rank of a group and are not computed where one is missing; per-rank kernel time, counts and bytes are.")


def ranks_text(ranks) -> str:
    """Ranks as a list for a sentence: the first 16, then how many in all."""
    ranks = list(ranks)
    return ", ".join(str(r) for r in ranks[:16]) + (f", … ({len(ranks)} in all)" if len(ranks) > 16 else "")


def clock_violations(inst: pd.DataFrame) -> pd.DataFrame:
    """Instances of synchronizing collectives (all-reduce, all-gather, reduce-scatter, all-to-all with equal
    sizes) where one rank's kernel ended before another rank's kernel of the same instance began: impossible
    on one clock, since neither can finish without the other's data. Per (rank that ended early, rank that
    started late): instances, the largest gap (a lower bound of the clocks' offset) and the median gap."""
    cols = ["early_rank", "late_rank", "instances", "max_gap_us", "median_gap_us", "of_instances"]
    if inst.empty:
        return pd.DataFrame(columns=cols)
    ok = inst[inst["family"].isin(SYNCHRONIZING) & ~inst["collective"].str.lower().str.endswith("v")
              & (inst["ranks_matched"] > 1)]
    recs = []
    n_inst = ok.drop_duplicates(["group", "peers", "seq"]).shape[0]
    for _, g in ok.groupby(["group", "peers", "seq"]):
        if len(g) < 2:
            continue
        late = g.loc[g["start_us"].idxmax()]
        for r in g.itertuples(index=False):
            gap = late["start_us"] - r.end_us
            if gap > 0 and r.rank != late["rank"]:
                recs.append((int(r.rank), int(late["rank"]), gap))
    if not recs:
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame(recs, columns=["early_rank", "late_rank", "gap"])
    out = named_agg_column(df, ["early_rank", "late_rank"], "gap", instances="size", max_gap_us="max",
                           median_gap_us="median").reset_index()
    out["of_instances"] = n_inst
    return out[cols]


def _sum_or_nan(s: pd.Series) -> float:
    return float(s.sum(min_count=1)) if len(s) else float("nan")


def _useful_fraction(inst: pd.DataFrame, padding: dict | None) -> pd.Series | None:
    """Per instance, routed / sent bytes: below 1 for the padded token all-to-alls `padding` (`moe.expert_padding`)
    names, 1 for every other instance; None when no instance is padded."""
    sizes = (padding or {}).get("a2a_buffer_bytes") or []
    routed = (padding or {}).get("a2a_routed_bytes_per_call")
    if not sizes or not routed or inst.empty:
        return None
    tok = (inst["family"] == "all_to_all") & inst["bytes"].isin(sizes)
    if not tok.any():
        return None
    frac = pd.Series(1.0, index=inst.index)
    frac[tok] = np.minimum(float(routed) / inst.loc[tok, "bytes"].astype(float), 1.0)
    return frac


def comm_summary(inst: pd.DataFrame, padding: dict | None = None) -> pd.DataFrame:
    """Per rank and collective (start-up instances excluded): counts, kernel time, bytes (known sizes only;
    `unknown_size` counts the rest), comm/sync totals and bandwidths over the instances with cross-rank
    figures (NaN when none has them: a rank of the group is missing). With the padding of a sync-free MoE
    run (`moe.expert_padding`), `useful_bytes` and `useful_busbw_gbps` count the token all-to-alls' routed
    bytes only, on the rows that hold such an all-to-all (NaN elsewhere; module docstring)."""
    cols = ["rank", "collective", "count", "bytes", "unknown_size", "kernel_us", "comm_us", "sync_us", "sync_pct",
            "mean_algbw_gbps", "mean_busbw_gbps", "times_last", "startup_excluded", "cross_rank", "useful_bytes",
            "useful_busbw_gbps"]
    if inst.empty:
        return pd.DataFrame(columns=cols)
    frac = _useful_fraction(inst, padding)
    if frac is None:
        frac = pd.Series(np.nan, index=inst.index)
    ok = inst[~inst["startup"]]
    ex = inst[inst["startup"]].groupby(["rank", "collective"]).size()
    rows = []
    for (r, c), g in ok.groupby(["rank", "collective"]):
        x = g[g["cross_rank"]]
        known = g["bytes"] > 0
        comm, sync = _sum_or_nan(x["comm_us"]), _sum_or_nan(x["sync_us"])
        tot = comm + sync
        padded = bool((frac[g.index] < 1.0).any())
        rows.append({"rank": int(r), "collective": c, "count": len(g), "bytes": int(g.loc[known, "bytes"].sum()),
                     "unknown_size": int((~known).sum()), "kernel_us": float(g["kernel_us"].sum()),
                     "comm_us": comm, "sync_us": sync,
                     "sync_pct": 100.0 * sync / tot if tot > 0 else (0.0 if tot == 0 else float("nan")),
                     "mean_algbw_gbps": x["algbw_gbps"].mean(), "mean_busbw_gbps": x["busbw_gbps"].mean(),
                     "times_last": int((x["last_rank"] == r).sum()) if len(x) else float("nan"),
                     "startup_excluded": int(ex.get((r, c), 0)), "cross_rank": int(len(x)),
                     "useful_bytes": float((g.loc[known, "bytes"] * frac[g.index][known]).sum()) if padded else np.nan,
                     "useful_busbw_gbps": float((x["busbw_gbps"] * frac[x.index]).mean())
                     if padded and len(x) else np.nan})
    for (r, c), n in ex.items():  # a collective seen only at start-up still gets its row
        if not any(d["rank"] == r and d["collective"] == c for d in rows):
            rows.append({"rank": int(r), "collective": c, "count": 0, "bytes": 0, "unknown_size": 0, "kernel_us": 0.0,
                         "comm_us": float("nan"), "sync_us": float("nan"), "sync_pct": float("nan"),
                         "mean_algbw_gbps": float("nan"), "mean_busbw_gbps": float("nan"), "times_last": float("nan"),
                         "startup_excluded": int(n), "cross_rank": 0, "useful_bytes": np.nan,
                         "useful_busbw_gbps": np.nan})
    return pd.DataFrame(rows, columns=cols).sort_values(["rank", "collective"], ignore_index=True, kind="stable")


def stragglers(inst: pd.DataFrame) -> pd.DataFrame:
    """Per collective: mean/max skew across ranks and the rank most often last to arrive, over the instances
    with cross-rank figures (every rank of the group loaded and matched) that are not start-up waits."""
    cols = ["family", "instances", "mean_skew_us", "max_skew_us", "straggler_rank", "straggler_share"]
    ok = inst[~inst["startup"] & inst["cross_rank"]] if not inst.empty else inst
    if ok.empty:
        return pd.DataFrame(columns=cols)
    per_inst = ok.drop_duplicates(["group", "peers", "seq"])
    rows = []
    for c, g in per_inst.groupby("family"):
        counts = g["last_rank"].value_counts()
        rows.append({"family": c, "instances": len(g), "mean_skew_us": g["skew_us"].mean(),
                     "max_skew_us": g["skew_us"].max(), "straggler_rank": int(counts.index[0]),
                     "straggler_share": float(counts.iloc[0] / len(g))})
    return pd.DataFrame(rows, columns=cols)


def exposed_comm(analysis, inst: pd.DataFrame) -> pd.DataFrame:
    """Per rank: communication kernel time (`comm_us`, their union), its transfer not overlapped by compute on
    any stream (`exposed_comm_us`) and its waits (`comm_wait_us` for another rank of a collective,
    `pipeline_wait_us` for the neighbour pipeline stage), each kernel split as `tracelens.analysis.waits` does
    (the GPU timeline's figures), with start-up instances left out (their wait happened partly before the other
    ranks were profiled). A per-rank figure: on a partial rank set the waits not known count as transfer."""
    from .timeline import gpu_timeline
    from .waits import is_pipeline, kernel_waits, wait_class

    cols = ["rank", "comm_us", "exposed_comm_us", "comm_wait_us", "pipeline_wait_us", "exposed_pct"]
    g = analysis.gpu
    if g.empty or inst.empty:
        return pd.DataFrame(columns=cols)
    startup_rows = inst.loc[inst["startup"], "gpu_row"].to_numpy()
    keep = ~np.isin(g.index.to_numpy(), startup_rows)
    kw = analysis.comm_waits() if hasattr(analysis, "comm_waits") else kernel_waits(inst, is_pipeline(analysis.trace))
    # (without the analysis's entry: a pipeline is known from the manifest only, and p2p waits count as peer waits)
    tl = gpu_timeline(g[keep], waits=wait_class(kw))
    tl = tl[tl["comm_us"] > 0] if len(tl) else tl
    out = tl[cols[:-1]].copy()
    c = out["comm_us"].to_numpy(np.float64)
    out["exposed_pct"] = np.where(c > 0, 100.0 * out["exposed_comm_us"].to_numpy(np.float64) / np.where(c > 0, c, 1.0), 0.0)
    out["rank"] = out["rank"].astype(int)
    return out[cols].reset_index(drop=True)


def exposed_a2a(analysis, inst: pd.DataFrame) -> pd.DataFrame:
    """Per rank: how much of its all-to-all kernel time no compute hides (issue 33's overlap measure: "exposed
    all-to-all <= 25 % of the all-to-all kernel time on every rank"). Over the rank's all-to-all kernels (family
    ``all_to_all``, start-up instances left out), each split as `tracelens.analysis.waits` does (wait first, then
    transfer), and its compute (non-communication kernels, any stream):

        a2a_us            |A|                 the all-to-all kernels' time (union)
        exposed_us        |T u C| - |C|       transfer no compute runs beside (the single number)
        exposed_wait_us   |W u T u C| - |T u C|  waiting for another rank with no compute beside it
        exposed_pct       100 * exposed_us / a2a_us; exposed_wait_pct likewise

    The wait is reported apart, as `tracelens comm` does everywhere: it is the slowest rank's lateness, which no
    overlap schedule removes. Empty frame without all-to-all kernels."""
    from . import intervals as I
    from .waits import is_pipeline, kernel_waits

    cols = ["rank", "a2a_count", "a2a_us", "exposed_us", "exposed_wait_us", "exposed_pct", "exposed_wait_pct"]
    g = analysis.gpu
    if g.empty or inst.empty:
        return pd.DataFrame(columns=cols)
    a2a = inst[(inst["family"] == "all_to_all") & ~inst["startup"]].drop_duplicates("gpu_row")
    if a2a.empty:
        return pd.DataFrame(columns=cols)
    kw = analysis.comm_waits() if hasattr(analysis, "comm_waits") else kernel_waits(inst, is_pipeline(analysis.trace))
    wait = kw["wait_ns"].reindex(a2a["gpu_row"].to_numpy()).fillna(0).to_numpy(np.int64)
    rows = g.loc[a2a["gpu_row"].to_numpy()]
    ts, end, rank = rows["ts"].to_numpy(np.int64), rows["end"].to_numpy(np.int64), rows["rank"].to_numpy(np.int64)
    mid = ts + np.clip(wait, 0, end - ts)
    is_k = (g["kind"] == "kernel").to_numpy() & ~g["is_comm"].to_numpy()
    out = []
    for r in np.unique(rank):
        m = rank == r
        cm = is_k & (g["rank"].to_numpy() == r)
        comp = I.union(g["ts"].to_numpy(np.int64)[cm], g["end"].to_numpy(np.int64)[cm])
        tx = I.union(mid[m], end[m])
        wt = I.union(ts[m], mid[m])
        c = I.length(*comp)
        c_t = I.union_length(comp, tx)
        total = I.length(ts[m], end[m])
        exp_t = (c_t - c) / US
        exp_w = (I.union_length(comp, tx, wt) - c_t) / US
        out.append({"rank": int(r), "a2a_count": int(m.sum()), "a2a_us": total / US, "exposed_us": exp_t,
                    "exposed_wait_us": exp_w, "exposed_pct": 100.0 * exp_t * US / total if total else 0.0,
                    "exposed_wait_pct": 100.0 * exp_w * US / total if total else 0.0})
    return pd.DataFrame(out, columns=cols)


# ------------------------------------------------------------------------------ the `tracelens comm` view


def _records(df: pd.DataFrame) -> list[dict]:
    return json.loads(df.to_json(orient="records"))


@dataclass
class CommReport:
    """Communication vs synchronization of a set of ranks: what `tracelens comm` prints and writes with
    --json, and what the report's communication section shows. Built by :func:`comm_report`."""

    instances: pd.DataFrame  # collective_instances: one row per (instance, rank)
    summary: pd.DataFrame  # comm_summary: per rank and collective
    stragglers: pd.DataFrame  # per collective family
    exposed: pd.DataFrame  # exposed_comm: per rank
    groups: pd.DataFrame  # group_coverage: per process group
    partial: str  # partial_note: '' when every group's ranks are loaded
    startup_instances: int  # instances that began before every rank was profiling (left out of the totals)
    padding: dict | None = None  # moe.expert_padding when the token all-to-alls carry padding (useful columns)
    exposed_a2a: pd.DataFrame | None = None  # exposed_a2a: per rank, the all-to-all time no compute hides

    @property
    def empty(self) -> bool:
        """No communication kernel in the traces."""
        return self.instances.empty

    def to_dict(self) -> dict:
        """The `tracelens comm --json` document (docs/comm.md)."""
        return {"schema_version": 2, "partial": self.partial or None, "records": _records(self.instances),
                "summary": _records(self.summary), "stragglers": _records(self.stragglers),
                "exposed_comm": _records(self.exposed), "groups": _records(self.groups),
                "padding": self.padding,
                "exposed_a2a": _records(self.exposed_a2a) if self.exposed_a2a is not None else []}

    def padding_note(self) -> str:
        """One line on the token all-to-alls' padding behind the useful columns; '' when there is none."""
        p = self.padding
        if not p or self.summary.empty or not self.summary["useful_busbw_gbps"].notna().any():
            return ""
        return (f"useful GB/s: bus bandwidth of the routed bytes only: {100 * p['a2a_padding_share_bytes']:.0f}% of the "
                f"token all-to-all bytes are padding ({p.get('buffers', 'worst-case')} buffers, finding moe_padding): "
                f"{p['a2a_routed_bytes_per_call']:,} routed of {p['a2a_bytes_per_call']:,} bytes sent per call")

    def to_text(self) -> str:
        """The `tracelens comm` table: per rank and collective, then stragglers and exposed communication.
        Cross-rank figures that a partial rank set leaves out are shown as '–'."""
        if self.empty:
            return "no communication kernels (NCCL/RCCL) in these traces"
        lines = []
        if self.partial:
            lines.append(f"note: {self.partial}")
        if self.startup_instances:
            lines.append(f"note: {self.startup_instances} collective instance(s) began before every rank was profiling "
                         "(start-up wait); excluded from the totals below")

        def f(v, fmt):
            return "–" if v != v else format(v, fmt)  # NaN: no cross-rank figure

        note = self.padding_note()
        useful = f" {'useful GB/s':>11}" if note else ""
        lines.append(f"{'rank':>4} {'collective':<16} {'count':>5} {'kernel ms':>9} {'comm ms':>9} {'sync ms':>9} "
                     f"{'sync %':>7} {'busbw GB/s':>10}{useful} {'last':>5}")
        for r in self.summary.itertuples(index=False):
            u = (f" {'':>11}" if r.useful_busbw_gbps != r.useful_busbw_gbps else f" {r.useful_busbw_gbps:>11.1f}") \
                if note else ""
            lines.append(f"{r.rank:>4} {r.collective[:16]:<16} {r.count:>5} {r.kernel_us / 1e3:>9.3f} "
                         f"{f(r.comm_us / 1e3, '.3f'):>9} {f(r.sync_us / 1e3, '.3f'):>9} {f(r.sync_pct, '.1f'):>7} "
                         f"{f(r.mean_busbw_gbps, '.1f'):>10}{u} {f(float(r.times_last), '.0f'):>5}")
        for r in self.stragglers.itertuples(index=False):
            lines.append(f"{r.family}: skew mean {r.mean_skew_us / 1e3:.3f} ms, max {r.max_skew_us / 1e3:.3f} ms; "
                         f"rank {r.straggler_rank} arrives last in {100 * r.straggler_share:.0f}% of {r.instances}")
        lines.append("exposed communication (transfer not overlapped by compute; waits apart; start-up excluded): "
                     + ", ".join(f"rank {int(x.rank)} {x.exposed_comm_us / 1e3:.3f} of {x.comm_us / 1e3:.3f} ms"
                                 + (f" (+ {x.comm_wait_us / 1e3:.3f} ms waiting for other ranks)" if x.comm_wait_us > 0 else "")
                                 + (f" (+ {x.pipeline_wait_us / 1e3:.3f} ms pipeline wait)" if x.pipeline_wait_us > 0 else "")
                                 for x in self.exposed.itertuples()))
        if self.exposed_a2a is not None and len(self.exposed_a2a):
            lines.append(self.exposed_a2a_line())
        if note:
            lines.append(note)
        return "\n".join(lines)

    def exposed_a2a_line(self) -> str:
        """One line, per rank: the share of its all-to-all kernel time no compute hides (transfer; the wait
        for other ranks apart), the figure issue 33's overlap target reads."""
        return ("exposed all-to-all (transfer no compute hides, % of all-to-all kernel time; + waiting for other "
                "ranks with no compute beside it): "
                + ", ".join(f"rank {int(x.rank)} {x.exposed_pct:.1f} % of {x.a2a_us / 1e3:.3f} ms"
                            f" (+ {x.exposed_wait_pct:.1f} % waiting)" for x in self.exposed_a2a.itertuples()))


def comm_report(analysis, exposed: bool = True) -> CommReport:
    """The communication view of an Analysis (its `comm_kernels` and `comm_instances` entries). exposed=False leaves
    the per-rank exposed communication out (`exposed` and `exposed_a2a` empty: each a GPU timeline of the ranks'
    kernels, ~30 ms apiece on a 200 MB trace), for a reader that shows neither (the report's communication
    section)."""
    inst = analysis.comm_instances()
    no_exposed = pd.DataFrame(columns=["rank", "comm_us", "exposed_comm_us", "comm_wait_us", "pipeline_wait_us", "exposed_pct"])
    if inst.empty:
        return CommReport(instances=inst, summary=comm_summary(inst), stragglers=stragglers(inst),
                          exposed=exposed_comm(analysis, inst) if exposed else no_exposed, groups=pd.DataFrame(),
                          partial="", startup_instances=0)
    kern = analysis.comm_kernels()
    padding = moe.expert_padding(analysis) if (inst["family"] == "all_to_all").any() else None
    if padding is not None and not padding.get("a2a_buffer_bytes"):
        padding = None  # padded GEMM rows, but no token all-to-all recognised: nothing for this view
    groups = group_coverage(analysis, inst, kern)
    return CommReport(instances=inst, summary=comm_summary(inst, padding), stragglers=stragglers(inst),
                      exposed=exposed_comm(analysis, inst) if exposed else no_exposed, groups=groups,
                      partial=partial_note(analysis, inst, kern, cov=groups),
                      startup_instances=int(inst.drop_duplicates(["group", "peers", "seq"])["startup"].sum()),
                      padding=padding, exposed_a2a=exposed_a2a(analysis, inst) if exposed else None)

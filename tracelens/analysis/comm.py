"""Communication vs synchronization across ranks.

A collective kernel's duration on one rank is part waiting (for the last rank of its group to arrive)
and part communication (moving data once everyone is there). Matching each collective instance across
the ranks of its process group separates them:

    last arrival = max over ranks of the kernel start
    sync wait(r) = last arrival - start(r)          time rank r's kernel spent waiting for others
    comm(r)      = end(r) - last arrival             the communication proper

Instances are matched per process group and collective family (point-to-point send/recv form one
family, every other collective its own) by their order on each rank. An instance that one rank started
before another rank's profiled window even began is a start-up artifact (the wait is partly outside
the trace): it is flagged `startup` and left out of per-step and per-rank totals.

Bandwidths follow NCCL's definitions (nccl-tests PERFORMANCE.md): algbw = bytes / comm time, busbw =
algbw x factor: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; others 1.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

US = 1000.0

DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2, "long": 8,
    "int64": 8, "int": 4, "int32": 4, "short": 2, "int16": 2, "char": 1, "byte": 1, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
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


INSTANCE_COLUMNS = ["group", "family", "collective", "instance", "rank", "bytes", "start_us", "end_us", "kernel_us",
                    "sync_us", "comm_us", "algbw_gbps", "busbw_gbps", "last_rank", "skew_us", "startup", "step",
                    "ranks_matched", "group_size", "gpu_row"]


def collective_instances(analysis) -> pd.DataFrame:
    """One row per (collective instance, rank) with its sync wait and pure communication time."""
    g = analysis.gpu
    k = g[g["is_comm"].to_numpy()] if not g.empty else g
    if k.empty:
        return pd.DataFrame(columns=INSTANCE_COLUMNS)
    events = analysis.trace.events
    window_start = events.groupby("rank")["ts"].min()  # where each rank's profiled window begins
    coll = k["collective"].astype(object).to_numpy()
    names = k["name"].astype(str).to_numpy()
    coll = np.where(pd.isna(coll), [_kernel_name_collective(n) for n in names], coll)
    group = k["pg_name"].astype(object).fillna(k["pg_ranks"].astype(object)).fillna("default").astype(str).to_numpy()
    df = pd.DataFrame({
        "row": k.index.to_numpy(), "rank": k["rank"].to_numpy(), "ts": k["ts"].to_numpy(), "end": k["end"].to_numpy(),
        "dur": k["dur"].to_numpy(), "collective": coll.astype(str), "group": group,
        "in_nelems": k["in_nelems"].to_numpy(), "out_nelems": k["out_nelems"].to_numpy(),
        "dtype": k["dtype"].astype(object).to_numpy(), "group_size": k["group_size"].to_numpy(), "step": k["step"].to_numpy(),
    })
    df["family"] = [_norm_collective(c) for c in df["collective"]]
    df = df.sort_values(["group", "family", "rank", "ts"], kind="stable")
    df["instance"] = df.groupby(["group", "family", "rank"]).cumcount()
    # matched instance: every rank's kernel with the same (group, family, index)
    key = ["group", "family", "instance"]
    df = df.reset_index(drop=True)
    last_rank = df.loc[df.groupby(key)["ts"].idxmax(), key + ["rank"]].rename(columns={"rank": "last_rank"})
    df = df.merge(last_rank, on=key, how="left")  # a left merge keeps df's row order
    grp = df.groupby(key)
    df["last_arrival"] = grp["ts"].transform("max")
    first_arrival = grp["ts"].transform("min")
    df["skew"] = df["last_arrival"] - first_arrival
    df["ranks_matched"] = grp["rank"].transform("nunique")
    df["sync_ns"] = np.minimum(np.clip(df["last_arrival"] - df["ts"], 0, None), df["dur"])
    df["comm_ns"] = np.clip(df["end"] - np.maximum(df["last_arrival"], df["ts"]), 0, None)
    # start-up artifact: some rank's kernel began before another rank of the group started profiling
    df["ws"] = df["rank"].map(window_start)
    df["startup"] = first_arrival < grp["ws"].transform("max")
    size = [dtype_bytes(d) for d in df["dtype"]]
    nel = np.where(df["family"].isin(["all_gather"]), df["out_nelems"], df["in_nelems"])
    df["bytes"] = [int(n) * s if (s is not None and n >= 0) else -1 for n, s in zip(nel, size)]
    gsz = np.where(df["group_size"] > 0, df["group_size"], df["ranks_matched"])
    df["group_size"] = gsz
    with np.errstate(divide="ignore", invalid="ignore"):
        alg = np.where((df["bytes"] > 0) & (df["comm_ns"] > 0), df["bytes"] / df["comm_ns"], np.nan)  # bytes/ns = GB/s
    df["algbw_gbps"] = alg
    df["busbw_gbps"] = alg * np.array([bus_factor(f, int(n)) for f, n in zip(df["family"], gsz)])
    t0 = int(events["ts"].min())
    out = pd.DataFrame({
        "group": df["group"], "family": df["family"], "collective": df["collective"], "instance": df["instance"],
        "rank": df["rank"].astype(int), "bytes": df["bytes"].astype(np.int64),
        "start_us": (df["ts"] - t0) / US, "end_us": (df["end"] - t0) / US, "kernel_us": df["dur"] / US,
        "sync_us": df["sync_ns"] / US, "comm_us": df["comm_ns"] / US, "algbw_gbps": df["algbw_gbps"],
        "busbw_gbps": df["busbw_gbps"], "last_rank": df["last_rank"].astype(int), "skew_us": df["skew"] / US,
        "startup": df["startup"].astype(bool), "step": df["step"].astype(int),
        "ranks_matched": df["ranks_matched"].astype(int), "group_size": df["group_size"].astype(int),
        "gpu_row": df["row"].astype(np.int64),
    })
    return out.sort_values(["start_us", "rank"], ignore_index=True)[INSTANCE_COLUMNS]


def comm_summary(inst: pd.DataFrame) -> pd.DataFrame:
    """Per rank and collective (start-up instances excluded): counts, comm/sync totals, bandwidths."""
    cols = ["rank", "collective", "count", "bytes", "comm_us", "sync_us", "sync_pct", "mean_algbw_gbps",
            "mean_busbw_gbps", "times_last", "startup_excluded"]
    if inst.empty:
        return pd.DataFrame(columns=cols)
    ok = inst[~inst["startup"]]
    g = ok.groupby(["rank", "collective"])
    out = g.agg(count=("instance", "size"), bytes=("bytes", "sum"), comm_us=("comm_us", "sum"),
                sync_us=("sync_us", "sum"), mean_algbw_gbps=("algbw_gbps", "mean"),
                mean_busbw_gbps=("busbw_gbps", "mean")).reset_index()
    out["times_last"] = [int(((ok["rank"] == r) & (ok["collective"] == c) & (ok["last_rank"] == r)).sum())
                         for r, c in zip(out["rank"], out["collective"])]
    ex = inst[inst["startup"]].groupby(["rank", "collective"]).size()
    out["startup_excluded"] = [int(ex.get((r, c), 0)) for r, c in zip(out["rank"], out["collective"])]
    tot = out["comm_us"] + out["sync_us"]
    out["sync_pct"] = np.where(tot > 0, 100.0 * out["sync_us"] / tot, 0.0)
    return out[cols]


def stragglers(inst: pd.DataFrame) -> pd.DataFrame:
    """Per collective: mean/max skew across ranks and the rank most often last to arrive."""
    cols = ["family", "instances", "mean_skew_us", "max_skew_us", "straggler_rank", "straggler_share"]
    ok = inst[~inst["startup"]] if not inst.empty else inst
    if ok.empty:
        return pd.DataFrame(columns=cols)
    per_inst = ok.drop_duplicates(["group", "family", "instance"])
    rows = []
    for c, g in per_inst.groupby("family"):
        counts = g["last_rank"].value_counts()
        rows.append({"family": c, "instances": len(g), "mean_skew_us": g["skew_us"].mean(),
                     "max_skew_us": g["skew_us"].max(), "straggler_rank": int(counts.index[0]),
                     "straggler_share": float(counts.iloc[0] / len(g))})
    return pd.DataFrame(rows, columns=cols)


def exposed_comm(analysis, inst: pd.DataFrame) -> pd.DataFrame:
    """Per rank: communication time not overlapped by compute on any stream, with start-up instances
    left out (their wait happened partly before the other ranks were profiled)."""
    from . import intervals as I

    cols = ["rank", "comm_us", "exposed_comm_us", "exposed_pct"]
    g = analysis.gpu
    if g.empty or inst.empty:
        return pd.DataFrame(columns=cols)
    startup_rows = set(inst.loc[inst["startup"], "gpu_row"].tolist())
    rows = []
    for r, gr in g.groupby("rank"):
        kern = (gr["kind"] == "kernel").to_numpy()
        comm = gr["is_comm"].to_numpy() & kern
        keep = ~np.isin(gr.index.to_numpy(), list(startup_rows))
        cs = (gr["ts"].to_numpy()[kern & ~comm], gr["end"].to_numpy()[kern & ~comm])
        ns = (gr["ts"].to_numpy()[comm & keep], gr["end"].to_numpy()[comm & keep])
        c = I.union_length(ns)
        exposed = I.union_length(cs, ns) - I.union_length(cs)
        rows.append({"rank": int(r), "comm_us": c / US, "exposed_comm_us": exposed / US,
                     "exposed_pct": 100.0 * exposed / c if c else 0.0})
    return pd.DataFrame(rows, columns=cols)

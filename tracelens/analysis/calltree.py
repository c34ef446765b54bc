"""Call tree: CPU op -> child ops -> runtime launch -> kernel(s).

Links, as Kineto writes them:
- nesting on a thread is time containment (an op encloses its children and its runtime calls);
- a runtime call (cudaLaunchKernel, hipLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...) and the
  GPU activity it started share `correlation`;
- GPU activity also carries the launching op's `External id` (the fallback when runtime events are
  missing from a trace).

`build_tree` returns one row per host event (ops, annotations, nn.Module ranges, runtime calls) with its
parent, innermost and outermost enclosing op and annotation/module path; `attribute_gpu` gives every
GPU event its launch, ops, path and profiler step.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .. import categories as C

KIND_ANNOTATION, KIND_MODULE, KIND_OP, KIND_RUNTIME = 0, 1, 2, 3
_MODULE_PREFIX = "nn.Module: "


def host_events(events: pd.DataFrame) -> pd.DataFrame:
    """The host-side events that form the call tree, with a `kind` column."""
    cat = events["cat"]
    x = C.map_strings(events["ph"], lambda s: s == "X")
    is_op = C.isin(cat, C.OP_CATS)
    is_ann = C.isin(cat, C.ANNOTATION_CATS)
    is_rt = C.isin(cat, C.RUNTIME_CATS)
    is_mod = C.isin(cat, C.PYTHON_CATS) & C.map_strings(events["name"], lambda s: s.startswith(_MODULE_PREFIX))
    sel = x & (is_op | is_ann | is_rt | is_mod)
    host = events.loc[sel, ["rank", "pid", "tid", "ts", "dur", "name", "cat", "correlation", "external_id",
                            "input_dims", "input_types", "module"]].copy()
    kind = np.full(len(host), KIND_OP, dtype=np.int8)
    kind[is_ann[sel]] = KIND_ANNOTATION
    kind[is_mod[sel]] = KIND_MODULE
    kind[is_rt[sel]] = KIND_RUNTIME
    host["kind"] = kind
    return host


def build_tree(events: pd.DataFrame) -> pd.DataFrame:
    """Parent/ancestor links of host events by time containment on each (rank, pid, tid).

    Columns added: parent (row label of the enclosing event or -1), depth, inner_op / outer_op (row
    labels of the innermost / outermost enclosing cpu op, the event itself when it is an op, -1 if
    none), path (record_function / nn.Module names from the root, joined by '/', profiler steps left
    out), self_dur (duration minus direct children's durations), is_step, step.
    """
    host = host_events(events)
    n = len(host)
    labels = host.index.to_numpy()
    if n == 0:
        for col, val in (("parent", -1), ("depth", 0), ("inner_op", -1), ("outer_op", -1), ("self_dur", 0)):
            host[col] = pd.Series(dtype=np.int64)
        host["path"] = pd.Series(dtype=str)
        host["is_step"] = pd.Series(dtype=bool)
        host["step"] = pd.Series(dtype=np.int64)
        return host
    ts = host["ts"].to_numpy()
    dur = host["dur"].to_numpy()
    end = ts + dur
    kind = host["kind"].to_numpy()
    names = host["name"]
    name_codes = names.cat.codes.to_numpy().astype(np.int64)
    name_uniques = list(names.cat.categories.astype(str)) + [""]  # code -1 -> ""
    step_num = C.map_strings(names, _step_number, dtype=np.int64)
    is_step = (step_num >= 0) & (kind == KIND_ANNOTATION)
    rank_a, pid_a, tid_a = (host[c].to_numpy() for c in ("rank", "pid", "tid"))
    # per thread; parents first: by start, then longer first, then annotation < module < op < runtime
    order = np.lexsort((kind, -dur, ts, tid_a, pid_a, rank_a))
    so = (rank_a[order], pid_a[order], tid_a[order])
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = (so[0][1:] != so[0][:-1]) | (so[1][1:] != so[1][:-1]) | (so[2][1:] != so[2][:-1])
    group = np.empty(n, dtype=np.int64)
    group[order] = np.cumsum(new_group)

    o_group = group[order].tolist()
    o_ts = ts[order].tolist()
    o_end = end[order].tolist()
    o_kind = kind[order].tolist()
    o_name = name_codes[order].tolist()
    o_step = is_step[order].tolist()
    parent = [-1] * n
    depth = [0] * n
    inner = [-1] * n
    outer = [-1] * n
    path = [0] * n
    path_ids: dict[tuple[int, int], int] = {}
    path_parent = [-1]
    path_name = [-1]
    stack: list[int] = []
    cur = -1
    for i in range(n):
        g = o_group[i]
        if g != cur:
            stack = []
            cur = g
        t = o_ts[i]
        while stack and o_end[stack[-1]] <= t:
            stack.pop()
        k = o_kind[i]
        if stack:
            p = stack[-1]
            parent[i] = p
            depth[i] = depth[p] + 1
            pin, pout, ppath = inner[p], outer[p], path[p]
        else:
            pin = pout = -1
            ppath = 0
        if k == KIND_OP:
            inner[i] = i
            outer[i] = pout if pout >= 0 else i
        else:
            inner[i] = pin
            outer[i] = pout
        if (k == KIND_ANNOTATION or k == KIND_MODULE) and not o_step[i]:
            key = (ppath, o_name[i])
            pid_ = path_ids.get(key)
            if pid_ is None:
                pid_ = path_ids[key] = len(path_parent)
                path_parent.append(ppath)
                path_name.append(o_name[i])
            path[i] = pid_
        else:
            path[i] = ppath
        if k != KIND_RUNTIME:
            stack.append(i)

    # sorted positions -> original row labels
    pos_to_label = labels[order]
    parent_a = np.asarray(parent, dtype=np.int64)
    inner_a = np.asarray(inner, dtype=np.int64)
    outer_a = np.asarray(outer, dtype=np.int64)

    def to_labels(a: np.ndarray) -> np.ndarray:
        out = np.full(a.size, -1, dtype=np.int64)
        ok = a >= 0
        out[ok] = pos_to_label[a[ok]]
        return out

    path_str = [""] * len(path_parent)
    for pid_ in range(1, len(path_parent)):
        nm = name_uniques[path_name[pid_]]
        if nm.startswith(_MODULE_PREFIX):
            nm = nm[len(_MODULE_PREFIX):]
        pp = path_parent[pid_]
        path_str[pid_] = f"{path_str[pp]}/{nm}" if pp > 0 else nm
    path_a = np.asarray(path, dtype=np.int64)

    inv = np.empty(n, dtype=np.int64)
    inv[order] = np.arange(n)
    out = host
    out["parent"] = to_labels(parent_a)[inv]
    out["depth"] = np.asarray(depth, dtype=np.int32)[inv]
    out["inner_op"] = to_labels(inner_a)[inv]
    out["outer_op"] = to_labels(outer_a)[inv]
    out["path"] = pd.Categorical(np.asarray(path_str, dtype=object)[path_a[inv]])
    # self time: own duration minus the durations of direct children
    self_dur = dur.astype(np.int64).copy()
    par_pos = parent_a[inv]
    has = par_pos >= 0
    np.subtract.at(self_dur, order[par_pos[has]], dur[has])  # order: sorted -> original position
    out["self_dur"] = np.maximum(self_dur, 0)
    out["is_step"] = is_step
    out["step"] = np.where(is_step, step_num, -1)
    return out


def _step_number(name: str) -> int:
    m = C.STEP_RE.match(name)
    return int(m.group(1)) if m else -1


def steps_table(tree: pd.DataFrame) -> pd.DataFrame:
    """Profiler steps per rank: rank, step, start, end (host time of the step annotation)."""
    s = tree.loc[tree["is_step"], ["rank", "step", "ts", "dur"]]
    s = s.assign(end=s["ts"] + s["dur"]).rename(columns={"ts": "start"}).drop(columns="dur")
    return s.sort_values(["rank", "start"]).drop_duplicates(["rank", "step"]).reset_index(drop=True)


def gpu_events(events: pd.DataFrame) -> pd.DataFrame:
    """GPU activity (kernels, memcpy, memset) with `kind` and `end` columns."""
    sel = C.map_strings(events["ph"], lambda s: s == "X") & C.isin(events["cat"], C.GPU_CATS)
    g = events.loc[sel, ["rank", "pid", "tid", "ts", "dur", "name", "cat", "correlation", "external_id", "device",
                         "stream", "bytes", "grid", "block", "collective", "in_nelems", "out_nelems", "dtype",
                         "group_size", "pg_name", "pg_ranks"]].copy()
    code = np.where(C.isin(g["cat"], C.KERNEL_CATS), 0, np.where(C.isin(g["cat"], C.MEMCPY_CATS), 1, 2))
    g["kind"] = pd.Categorical.from_codes(code, categories=["kernel", "memcpy", "memset"])
    g["end"] = g["ts"] + g["dur"]
    # stream: the arg when present, else Kineto's tid on the GPU "process" (which is the stream)
    g["stream"] = np.where(g["stream"].to_numpy() >= 0, g["stream"].to_numpy(), g["tid"].to_numpy())
    g["is_comm"] = (g["kind"] == "kernel").to_numpy() & C.is_comm_kernel(g["name"])
    return g


def _key(rank: np.ndarray, ident: np.ndarray) -> np.ndarray:
    return (rank.astype(np.int64) << 44) ^ ident.astype(np.int64)


def attribute_gpu(gpu: pd.DataFrame, tree: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Each GPU event's launch, innermost/outermost op, path, category and profiler step."""
    g = gpu
    n = len(g)
    launch = np.full(n, -1, dtype=np.int64)
    rt = tree[tree["kind"] == KIND_RUNTIME]
    rt = rt[rt["correlation"] >= 0]
    if len(rt) and n:
        idx = pd.Index(_key(rt["rank"].to_numpy(), rt["correlation"].to_numpy()))
        if not idx.is_unique:
            keep = ~idx.duplicated()
            idx, rt = idx[keep], rt[keep]
        pos = idx.get_indexer(_key(g["rank"].to_numpy(), g["correlation"].to_numpy()))
        ok = (pos >= 0) & (g["correlation"].to_numpy() >= 0)
        launch[ok] = rt.index.to_numpy()[pos[ok]]
    has_launch = launch >= 0
    inner = np.full(n, -1, dtype=np.int64)
    outer = np.full(n, -1, dtype=np.int64)
    launch_ts = np.full(n, -1, dtype=np.int64)
    if has_launch.any():
        lr = tree.loc[launch[has_launch]]
        inner[has_launch] = lr["inner_op"].to_numpy()
        outer[has_launch] = lr["outer_op"].to_numpy()
        launch_ts[has_launch] = lr["ts"].to_numpy()
    # fallback: the op with the kernel's External id
    need = (inner < 0) & (g["external_id"].to_numpy() >= 0)
    if need.any():
        ops = tree[tree["kind"] == KIND_OP]
        idx = pd.Index(_key(ops["rank"].to_numpy(), ops["external_id"].to_numpy()))
        keep = ~idx.duplicated() & (ops["external_id"].to_numpy() >= 0)
        idx, ops = idx[keep], ops[keep]
        pos = idx.get_indexer(_key(g["rank"].to_numpy()[need], g["external_id"].to_numpy()[need]))
        found = pos >= 0
        sel = np.flatnonzero(need)[found]
        op_rows = ops.index.to_numpy()[pos[found]]
        inner[sel] = op_rows
        outer[sel] = tree.loc[op_rows, "outer_op"].to_numpy()
    out = g.copy()
    out["launch"] = launch
    out["launch_ts"] = launch_ts
    out["op_row"] = inner
    out["top_op_row"] = outer
    # path of the launch (or of the op when only the External id links it)
    src = np.where(has_launch, launch, inner)
    out["op"] = C.take_strings(tree["name"], inner)
    out["top_op"] = C.take_strings(tree["name"], outer)
    out["op_input_dims"] = C.take_strings(tree["input_dims"], inner)
    out["path"] = C.take_strings(tree["path"], src)
    out["category"] = C.categorize_frame(out["name"], out["op"], out["cat"])
    out["step"] = assign_steps(out["rank"].to_numpy(), np.where(launch_ts >= 0, launch_ts, out["ts"].to_numpy()), steps)
    return out


def assign_steps(rank: np.ndarray, t: np.ndarray, steps: pd.DataFrame) -> np.ndarray:
    """Step number whose [start, end) holds time t on the same rank, else -1."""
    step = np.full(len(t), -1, dtype=np.int64)
    if steps.empty:
        return step
    for r, s in steps.groupby("rank"):
        m = rank == r
        if not m.any():
            continue
        starts = s["start"].to_numpy()
        ends = s["end"].to_numpy()
        nums = s["step"].to_numpy()
        pos = np.searchsorted(starts, t[m], side="right") - 1
        ok = pos >= 0
        ok[ok] = t[m][ok] < ends[pos[ok]]
        res = np.full(m.sum(), -1, dtype=np.int64)
        res[ok] = nums[pos[ok]]
        step[m] = res
    return step

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
                            "input_dims", "input_types", "module"]].copy(deep=False)
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

    # Ranges (ops, annotations, modules) get their parents from a stack walk in Python; runtime calls,
    # ~half of all host events and always leaves, are placed afterwards with a vectorized lookup of
    # "which range was innermost at this instant" (the stack top as a step function of time).
    o_kind_a = kind[order]
    rng_pos = np.flatnonzero(o_kind_a != KIND_RUNTIME)  # sorted positions of ranges
    r_parent, r_depth, r_inner, r_outer, r_path, path_parent, path_name = link_ranges(
        group[order][rng_pos], ts[order][rng_pos], end[order][rng_pos], o_kind_a[rng_pos],
        name_codes[order][rng_pos], is_step[order][rng_pos],
    )

    # back to all sorted positions: ranges' links are range indices -> sorted positions
    def spread(vals: np.ndarray, is_index: bool) -> np.ndarray:
        out = np.full(n, -1 if is_index else 0, dtype=np.int64)
        v = np.asarray(vals, dtype=np.int64)
        if is_index:
            ok = v >= 0
            v = np.where(ok, rng_pos[np.where(ok, v, 0)], -1)
        out[rng_pos] = v
        return out

    parent_s = spread(r_parent, True)
    depth_s = spread(r_depth, False)
    inner_s = spread(r_inner, True)
    outer_s = spread(r_outer, True)
    path_s = spread(r_path, False)
    rt_pos = np.flatnonzero(o_kind_a == KIND_RUNTIME)
    if len(rt_pos):
        top = _innermost_range_at(group[order], ts[order], end[order], rng_pos, parent_s, rt_pos)
        has = top >= 0
        parent_s[rt_pos] = top
        safe = np.where(has, top, 0)
        depth_s[rt_pos] = np.where(has, depth_s[safe] + 1, 0)
        inner_s[rt_pos] = np.where(has, inner_s[safe], -1)
        outer_s[rt_pos] = np.where(has, outer_s[safe], -1)
        path_s[rt_pos] = np.where(has, path_s[safe], 0)
    parent, depth, inner, outer, path = parent_s, depth_s, inner_s, outer_s, path_s

    # sorted positions -> original row labels
    pos_to_label = labels[order]
    parent_a, inner_a, outer_a = parent, inner, outer

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
    path_a = path

    inv = np.empty(n, dtype=np.int64)
    inv[order] = np.arange(n)
    out = host
    out["parent"] = to_labels(parent_a)[inv]
    out["depth"] = depth.astype(np.int32)[inv]
    out["inner_op"] = to_labels(inner_a)[inv]
    out["outer_op"] = to_labels(outer_a)[inv]
    out["path"] = _path_categorical(path_str, path_a[inv])
    # self time: own duration minus the durations of direct children
    self_dur = dur.astype(np.int64).copy()
    par_pos = parent_a[inv]
    has = par_pos >= 0
    np.subtract.at(self_dur, order[par_pos[has]], dur[has])  # order: sorted -> original position
    out["self_dur"] = np.maximum(self_dur, 0)
    out["is_step"] = is_step
    out["step"] = np.where(is_step, step_num, -1)
    return out


def _path_categorical(path_str: list[str], ids: np.ndarray) -> pd.Categorical:
    """pd.Categorical of path_str[ids] (categories: the distinct strings used, sorted), built from the
    few path ids instead of one string per row."""
    used = np.unique(ids)
    cats = sorted({path_str[i] for i in used.tolist()})
    pos = {c: k for k, c in enumerate(cats)}
    code_of = np.zeros(int(used.max(initial=0)) + 1, dtype=np.int32)
    code_of[used] = [pos[path_str[i]] for i in used.tolist()]
    return pd.Categorical.from_codes(code_of[ids], categories=pd.Index(cats))  # dtype inferred, as pd.Categorical(values) does


def link_ranges(group, ts, end, kind, name, is_step):
    """Parents of nested ranges on each thread, vectorized. Inputs sorted by (group, ts, -dur, kind).

    The depth of range i is the number of earlier ranges of its thread still open at its start
    (end > ts_i); its parent is the last earlier range one level up. Then inner/outer op and the
    annotation path flow down the tree one depth level at a time. Returns (parent, depth, inner,
    outer, path, path_parent, path_name) with indices into the inputs, -1 for none; path ids index
    path_parent / path_name (id 0 is the empty path). `link_ranges_walk` is the plain stack walk it
    is tested against.
    """
    m = len(ts)
    empty = np.empty(0, np.int64)
    if m == 0:
        return empty, empty, empty, empty, empty, np.array([-1]), np.array([-1])
    idx = np.arange(m, dtype=np.int64)
    gstart = np.searchsorted(group, group, side="left")  # first index of each range's thread
    # ranges of the same thread whose end <= ts_i (ended before i started), counted by searching
    # (group, end) pairs; keys are made from times relative to the trace start
    t0 = min(int(ts.min()), int(end.min()))
    span = int(max(end.max(), ts.max())) - t0 + 1
    e_order = np.lexsort((end, group))
    if int(group.max() + 1) * span < (1 << 62):
        ekey = group[e_order] * span + (end[e_order] - t0)
        ended = np.searchsorted(ekey, group * span + (ts - t0), side="right") - gstart
    else:  # astronomically long traces: per thread
        ended = np.empty(m, dtype=np.int64)
        for g in np.unique(group):
            lo, hi = np.searchsorted(group, [g, g + 1])
            ended[lo:hi] = np.searchsorted(np.sort(end[lo:hi]), ts[lo:hi], side="right")
    # zero-length ranges at exactly ts_i that sort after i were counted as ended but are not earlier
    zero = end == ts
    run_start = np.flatnonzero(np.r_[True, (group[1:] != group[:-1]) | (ts[1:] != ts[:-1])])
    run_id = np.cumsum(np.r_[True, (group[1:] != group[:-1]) | (ts[1:] != ts[:-1])]) - 1
    run_end = np.r_[run_start[1:], m] - 1
    zeros_per_run = np.bincount(run_id, weights=zero, minlength=len(run_start)).astype(np.int64)
    first_zero = run_end - zeros_per_run + 1  # zero-length ranges sort last in their run (-dur)
    fz = first_zero[run_id]
    later_zeros = np.where(zeros_per_run[run_id] > 0, run_end[run_id] - np.maximum(idx, fz) + 1, 0)
    depth = (idx - gstart) - (ended - later_zeros)
    depth = np.maximum(depth, 0)

    parent = np.full(m, -1, dtype=np.int64)
    inner = np.full(m, -1, dtype=np.int64)
    outer = np.full(m, -1, dtype=np.int64)
    path = np.zeros(m, dtype=np.int64)
    path_parent = [np.array([-1])]
    path_name = [np.array([-1])]
    n_paths = 1
    is_op = kind == KIND_OP
    extends = ~is_op & ~is_step  # annotations and modules extend the path; profiler steps do not
    by_depth = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[by_depth], np.arange(depth.max() + 2))
    prev_level = empty
    for d in range(depth.max() + 1):
        lvl = by_depth[bounds[d]:bounds[d + 1]]  # ascending indices at this depth
        if d == 0:
            par = np.full(len(lvl), -1, dtype=np.int64)
        else:
            k = np.searchsorted(prev_level, lvl) - 1
            par = np.where(k >= 0, prev_level[np.maximum(k, 0)], -1)
            par[(par >= 0) & (group[np.maximum(par, 0)] != group[lvl])] = -1
        parent[lvl] = par
        has = par >= 0
        pp = np.maximum(par, 0)
        p_inner = np.where(has, inner[pp], -1)
        p_outer = np.where(has, outer[pp], -1)
        p_path = np.where(has, path[pp], 0)
        op = is_op[lvl]
        inner[lvl] = np.where(op, lvl, p_inner)
        outer[lvl] = np.where(op & (p_outer < 0), lvl, p_outer)
        ext = extends[lvl]
        lv_path = p_path.copy()
        if ext.any():
            keys = np.stack([p_path[ext], name[lvl][ext]], axis=1)
            uniq, inv = np.unique(keys, axis=0, return_inverse=True)
            lv_path[ext] = n_paths + inv.reshape(-1)
            path_parent.append(uniq[:, 0])
            path_name.append(uniq[:, 1])
            n_paths += len(uniq)
        path[lvl] = lv_path
        prev_level = lvl
    return (parent, depth, inner, outer, path, np.concatenate(path_parent), np.concatenate(path_name))


def link_ranges_walk(group, ts, end, kind, name, is_step):
    """Reference implementation of `link_ranges`: the plain stack walk, one range at a time."""
    o_group, o_ts, o_end = group.tolist(), ts.tolist(), end.tolist()
    o_kind, o_name, o_step = kind.tolist(), name.tolist(), is_step.tolist()
    m = len(o_ts)
    parent, depth, inner, outer, path = [-1] * m, [0] * m, [-1] * m, [-1] * m, [0] * m
    path_ids: dict[tuple[int, int], int] = {}
    path_parent, path_name = [-1], [-1]
    stack: list[int] = []
    cur = None
    for i in range(m):
        if o_group[i] != cur:
            stack, cur = [], o_group[i]
        while stack and o_end[stack[-1]] <= o_ts[i]:
            stack.pop()
        pin = pout = -1
        ppath = 0
        if stack:
            p = stack[-1]
            parent[i], depth[i] = p, depth[p] + 1
            pin, pout, ppath = inner[p], outer[p], path[p]
        if o_kind[i] == KIND_OP:
            inner[i], outer[i] = i, (pout if pout >= 0 else i)
            path[i] = ppath
        else:
            inner[i], outer[i] = pin, pout
            if o_step[i]:
                path[i] = ppath
            else:
                key = (ppath, o_name[i])
                if key not in path_ids:
                    path_ids[key] = len(path_parent)
                    path_parent.append(ppath)
                    path_name.append(o_name[i])
                path[i] = path_ids[key]
        stack.append(i)
    a = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return a(parent), a(depth), a(inner), a(outer), a(path), a(path_parent), a(path_name)


def _innermost_range_at(group: np.ndarray, ts: np.ndarray, end: np.ndarray, rng_pos: np.ndarray,
                        parent: np.ndarray, query_pos: np.ndarray) -> np.ndarray:
    """For each query event (sorted position), the innermost range open at its start on its thread.

    The stack top is a step function of time: range r opens at ts[r] (top := r) and closes at end[r]
    (top := parent[r]). Closings sort before openings at the same instant, matching the walk, where a
    range ending exactly when another event starts does not enclose it. Arrays are in sorted order.
    """
    out = np.full(len(query_pos), -1, dtype=np.int64)
    if len(rng_pos) == 0 or len(query_pos) == 0:
        return out
    r_group = group[rng_pos]
    q_group = group[query_pos]
    # boundaries: (group, time, 0=close/1=open) -> new top
    b_group = np.concatenate([r_group, r_group])
    b_time = np.concatenate([ts[rng_pos], end[rng_pos]])
    b_kind = np.concatenate([np.ones(len(rng_pos), np.int8), np.zeros(len(rng_pos), np.int8)])
    b_top = np.concatenate([rng_pos, parent[rng_pos]])
    # a query at the same instant as an opening is inside it (ranges sort before runtime calls)
    border = np.lexsort((b_kind, b_time, b_group))
    b_group, b_time, b_top = b_group[border], b_time[border], b_top[border]
    q_time = ts[query_pos]
    t0 = min(int(b_time.min()), int(q_time.min()))
    span = max(int(b_time.max()), int(q_time.max())) - t0 + 1
    if int(max(b_group.max(), q_group.max()) + 1) * span < (1 << 62):
        # one search over (thread, time) keys: the last boundary at or before each query's start on the
        # query's own thread (a hit on an earlier thread means none)
        idx = np.searchsorted(b_group * span + (b_time - t0), q_group * span + (q_time - t0), side="right") - 1
        ok = idx >= 0
        ok[ok] = b_group[idx[ok]] == q_group[ok]
        out[ok] = b_top[idx[ok]]
        return out
    for g in np.unique(q_group):  # astronomically long traces: thread by thread
        lo, hi = np.searchsorted(b_group, [g, g + 1])
        if lo == hi:
            continue
        qm = np.flatnonzero(q_group == g)
        idx = np.searchsorted(b_time[lo:hi], ts[query_pos[qm]], side="right") - 1
        ok = idx >= 0
        out[qm[ok]] = b_top[lo:hi][idx[ok]]
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
                         "group_size", "pg_name", "pg_ranks"]].copy(deep=False)
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
    rt = tree.loc[(tree["kind"].to_numpy() == KIND_RUNTIME) & (tree["correlation"].to_numpy() >= 0), ["rank", "correlation"]]
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
        pos = _positions(tree, launch[has_launch])
        inner[has_launch] = tree["inner_op"].to_numpy()[pos]
        outer[has_launch] = tree["outer_op"].to_numpy()[pos]
        launch_ts[has_launch] = tree["ts"].to_numpy()[pos]
    # fallback: the op with the kernel's External id
    need = (inner < 0) & (g["external_id"].to_numpy() >= 0)
    if need.any():
        ops = tree.loc[tree["kind"].to_numpy() == KIND_OP, ["rank", "external_id"]]
        idx = pd.Index(_key(ops["rank"].to_numpy(), ops["external_id"].to_numpy()))
        keep = ~idx.duplicated() & (ops["external_id"].to_numpy() >= 0)
        idx, ops = idx[keep], ops[keep]
        pos = idx.get_indexer(_key(g["rank"].to_numpy()[need], g["external_id"].to_numpy()[need]))
        found = pos >= 0
        sel = np.flatnonzero(need)[found]
        op_rows = ops.index.to_numpy()[pos[found]]
        inner[sel] = op_rows
        outer[sel] = tree["outer_op"].to_numpy()[_positions(tree, op_rows)]
    out = g.copy(deep=False)  # new columns only: the caller's frame is left as it is
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


def _positions(frame: pd.DataFrame, labels: np.ndarray) -> np.ndarray:
    """Row positions of labels in a frame whose index is sorted (the tree keeps event order)."""
    index = frame.index.to_numpy()
    if frame.index.is_monotonic_increasing:
        return np.searchsorted(index, labels)
    return frame.index.get_indexer(labels)


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

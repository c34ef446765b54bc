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

The launching op of a GPU event (its `op_row`; the `inner_op` of a runtime call), exactly:
1. where the trace names it: the runtime call's `External id` (else the GPU event's own) equals the
   `External id` of a CPU op on the same rank. Older Kineto copies the correlation id into the
   `External id` of runtime calls and GPU events; on a rank where every such id repeats the
   correlation, the ids name no op and are ignored;
2. otherwise the innermost CPU op enclosing the runtime call on its thread, by half-open intervals
   [ts, ts + dur): an op that ends at the instant the call starts does not enclose it, one that ends
   in the same microsecond as its child still encloses the child's calls, a zero-duration op encloses
   nothing. Innermost = the latest start; at equal starts the one ending first; at equal start and end
   the one entered later (larger External id, else later in the file). Computed over the ops alone
   (`innermost_op_at`), so module/annotation ranges that partly overlap an op cannot shift it.
tests/tracelens/test_attribution.py checks this against a plain sweep over the raw JSON events.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .. import categories as C

try:  # the linking compiled (setup.py builds it where a C compiler exists); else the vectorized code, the same links
    from . import _tree
except ImportError:
    _tree = None

KIND_ANNOTATION, KIND_MODULE, KIND_OP, KIND_RUNTIME = 0, 1, 2, 3
_MODULE_PREFIX = C.MODULE_PREFIX
TREE_COLUMNS = ("rank", "pid", "tid", "ts", "dur", "name", "cat", "correlation", "external_id", "input_dims",
                "input_types", "module")  # the events' columns the tree keeps
_PANDAS3 = int(pd.__version__.split(".")[0]) >= 3  # copy-on-write: slices and column picks are views


def tree_rows(events: pd.DataFrame) -> np.ndarray:
    """Mask of the events that are call-tree nodes (`categories.is_call_tree_event`)."""
    cols = [events[c] for c in ("ph", "cat", "name")]
    if all(isinstance(c.dtype, pd.CategoricalDtype) for c in cols):
        return C.call_tree_mask(*((c.cat.codes.to_numpy(), c.cat.categories.tolist()) for c in cols))
    ph, cat, name = (C.strings(c) for c in cols)
    return np.fromiter(map(C.is_call_tree_event, ph, cat, name), dtype=bool, count=len(events))


def host_events(events: pd.DataFrame, leading: int | None = None) -> pd.DataFrame:
    """The host-side events that form the call tree, with a `kind` column.

    When they are the events table's first rows, as the loader orders them (tracelens/io/roworder.py),
    the result's columns are views of the events' (no copy: ~45 bytes per host event, ~0.8 GB at 8 GB of
    trace; its index a RangeIndex when the events' is one); otherwise the rows are copied. leading: how many
    first rows are all the tree's events when the caller knows it (`Trace.tree_rows`, as the load ordered them):
    they are not looked for again (4-7 ms per 700,000 events here, 20-30 on the device machine's CPU)."""
    if leading is not None:
        k = int(leading)
        if not 0 <= k <= len(events):
            raise ValueError(f"leading={leading}: not a row count of this {len(events)}-row table")
        sel = None
    else:
        sel = tree_rows(events)
        k = int(np.count_nonzero(sel))
    cols = list(TREE_COLUMNS)
    if sel is None or (k and sel[:k].all()):
        if _PANDAS3:  # (copy-on-write: the row slice of the columns is views)
            host = events.iloc[:k, [events.columns.get_loc(c) for c in cols]]
        else:
            host = pd.concat([events[c].iloc[:k] for c in cols], axis=1, copy=False)
    else:
        host = events.loc[sel, cols].copy(deep=False)
    # (every column as the events table has it: correlation / External id narrow (trace.narrow_args),
    # pid / tid int64, shared rather than narrowed into a copy)
    # (the tree's Python events are nn.Module ranges; anything else is an op); one lookup per category
    host["kind"] = C.map_strings(host["cat"], _kind_of_cat, dtype=np.int8)
    return host


def _kind_of_cat(cat: str) -> int:
    """The node kind of a call-tree event of category `cat` (`host_events`)."""
    if cat in C.RUNTIME_CATS:
        return KIND_RUNTIME
    if cat in C.PYTHON_CATS:
        return KIND_MODULE
    if cat in C.ANNOTATION_CATS:
        return KIND_ANNOTATION
    return KIND_OP


def _narrowest_id_type(a: np.ndarray) -> np.ndarray:
    """a as int32 when every value fits (labels, thread ids), else as it is."""
    if len(a) == 0 or (int(a.min()) >= -(2**31) and int(a.max()) < 2**31):
        return a.astype(np.int32, copy=False)
    return a


def build_tree(events: pd.DataFrame, leading: int | None = None) -> pd.DataFrame:
    """Parent/ancestor links of host events by time containment on each (rank, pid, tid).

    Columns added: parent (row label of the enclosing event or -1), depth, inner_op / outer_op (row
    labels of the innermost / outermost enclosing cpu op, the event itself when it is an op, -1 if
    none), path (record_function / nn.Module names from the root, joined by '/', profiler steps left
    out), self_dur (duration minus direct children's durations), is_step, step. Row labels (the index,
    parent, inner_op, outer_op) are event rows; the three link columns are int32 when every label fits,
    as is step; the events' columns keep the events table's types (views of them when the tree's events
    are the table's first rows, as the loader orders them: `host_events`, which `leading` is passed to).
    """
    host = host_events(events, leading)
    n = len(host)
    labels = host.index.to_numpy()
    if n == 0:
        # the same columns and dtypes as a non-empty tree (path and name categorical), so that
        # attribute_gpu and the summaries take a GPU-only trace like any other
        for col, dt in (("parent", np.int32), ("depth", np.int32), ("inner_op", np.int32), ("outer_op", np.int32)):
            host[col] = np.empty(0, dtype=dt)
        host["path"] = pd.Categorical([], categories=pd.Index([], dtype=object))
        host["self_dur"] = np.empty(0, dtype=np.int64)
        if not isinstance(host["name"].dtype, pd.CategoricalDtype):
            host["name"] = pd.Categorical(host["name"].astype(object))
        host["is_step"] = np.empty(0, dtype=bool)
        host["step"] = np.empty(0, dtype=np.int32)
        return host
    ts = host["ts"].to_numpy()
    dur = host["dur"].to_numpy()
    end = ts + dur
    kind = host["kind"].to_numpy()
    names = host["name"]
    name_codes = names.cat.codes.to_numpy()  # (int16 / int32, as the categorical keeps them)
    step_number = C.map_strings(names, _step_number, dtype=np.int64, on_markers=C.STEP_NUMBER)
    is_step = (step_number >= 0) & (kind == KIND_ANNOTATION)
    step_col = _narrowest_id_type(np.where(is_step, step_number, -1))  # (the `step` column, set at the end)
    del step_number
    rank_a, pid_a, tid_a = (host[c].to_numpy() for c in ("rank", "pid", "tid"))
    ext_a = host["external_id"].to_numpy()
    # per thread; parents first: by start, then longer first, then annotation < module < op < runtime,
    # then the one entered first (smaller External id: identical intervals of a parent and its child)
    # (memory: a 2 GB trace has millions of host rows, 8 bytes x rows per temporary array; the ones no
    # longer needed are dropped as the function goes, and sorted copies are made once and shared)
    # positions (sorted and original) in int32 below 2**31 host events: half the bytes of every position
    # array; the keys built from thread ids are made in int64 (`_wide`)
    pos_t = np.int32 if n < 2**31 else np.int64
    order = thread_time_order(rank_a, pid_a, tid_a, ts, dur, kind)
    if _tied_out_of_order(order, ts, dur, kind, ext_a):  # rare: sort again with the External id as the last key
        order = np.lexsort((ext_a, kind, -dur, ts, tid_a, pid_a, rank_a))
    order = order.astype(pos_t)
    new_group = np.zeros(n, dtype=bool)
    new_group[0] = True
    for a in (rank_a, pid_a, tid_a):
        so = a[order]
        new_group[1:] |= so[1:] != so[:-1]
    del so
    o_group = np.cumsum(new_group, dtype=pos_t)  # the thread of each sorted position (from 1)
    del new_group

    # Ranges (ops, annotations, modules) get their parents, depths, ops and paths by time containment; runtime
    # calls, ~half of all host events and always leaves, the innermost range open at their start (the stack top
    # as a step function of time): compiled (_tree.c) where built, else vectorized (`link_ranges`,
    # `_innermost_range_at`), the same arrays
    o_kind_a = kind[order]
    o_ts, o_end = ts[order], end[order]
    del end
    parent_s, depth_s, inner_s, outer_s, path_s, path_parent, path_name, nested = _link_sorted(
        o_group, o_ts, o_end, o_kind_a, name_codes[order], is_step[order], pos_t)
    del name_codes
    rt_pos = np.flatnonzero(o_kind_a == KIND_RUNTIME).astype(pos_t)
    launcher = None
    if len(rt_pos):
        top = parent_s[rt_pos]
        has = top >= 0
        # the launching op: named by the call's External id, else the innermost op enclosing it in time
        if nested:
            # properly nested ranges: the ranges open at t are the innermost one's ancestors, so its
            # innermost op is the innermost op open at t
            launcher = np.where(has, inner_s[np.where(has, top, 0)], -1)
        else:  # some range outlasts its parent: search the ops alone
            op_pos = np.flatnonzero(o_kind_a == KIND_OP)  # sorted by (thread, ts, -end, External id, row)
            k = innermost_op_at(_wide(o_group[op_pos]), o_ts[op_pos], o_end[op_pos], _wide(o_group[rt_pos]),
                                o_ts[rt_pos])
            launcher = np.where(k >= 0, op_pos[np.maximum(k, 0)], -1)
            del op_pos, k
        del top, has
    del o_group, o_ts, o_end, o_kind_a  # (before the External-id lookup below: the peak of build_tree)
    inv = np.empty(n, dtype=pos_t)  # original position -> sorted position
    inv[order] = np.arange(n, dtype=pos_t)
    if launcher is not None:
        # (in original order, so no sorted copy of rank / External id / labels is made; -> sorted positions)
        rt_orig = order[rt_pos]
        named = _op_by_external_id(rank_a, ext_a, labels, kind == KIND_OP, rank_a[rt_orig], ext_a[rt_orig],
                                   _ranks_with_op_ids(events))
        del rt_orig
        launcher = np.where(named >= 0, inv[np.maximum(named, 0)], launcher)
        has = launcher >= 0
        safe = np.where(has, launcher, 0)
        inner_s[rt_pos] = np.where(has, launcher, -1)
        outer_s[rt_pos] = np.where(has, outer_s[safe], -1)
        del has, safe, named
    del launcher, rt_pos
    parent, depth, inner, outer, path = parent_s, depth_s, inner_s, outer_s, path_s
    del parent_s, depth_s, inner_s, outer_s, path_s

    # sorted positions -> original row labels
    pos_to_label = labels[order]
    parent_a, inner_a, outer_a = parent, inner, outer

    lab_t = _narrowest_id_type(np.array([labels.min(), labels.max()])).dtype  # event rows: int32 below 2**31

    def to_labels(a: np.ndarray) -> np.ndarray:
        out = np.full(a.size, -1, dtype=lab_t)
        ok = a >= 0
        out[ok] = pos_to_label[a[ok]]
        return out

    path_str = [""] * len(path_parent)
    path_names = C.decode_codes(names.cat.categories, path_name).tolist()  # (code -1: ""; only the names used)
    for pid_ in range(1, len(path_parent)):
        nm = path_names[pid_]
        if nm.startswith(_MODULE_PREFIX):
            nm = nm[len(_MODULE_PREFIX):]
        pp = path_parent[pid_]
        path_str[pid_] = f"{path_str[pp]}/{nm}" if pp > 0 else nm
    path_a = path

    out = host
    # self time: own duration minus the durations of direct children
    self_dur = dur.astype(np.int64).copy()
    par_pos = parent_a[inv]
    has = par_pos >= 0
    np.subtract.at(self_dur, order[par_pos[has]], dur[has])  # order: sorted -> original position
    del par_pos, has
    out["parent"] = to_labels(parent_a[inv])  # (permuted first: one int64 array of the tree's length)
    del parent, parent_a
    out["depth"] = depth.astype(np.int32)[inv]
    del depth
    out["inner_op"] = to_labels(inner_a[inv])
    del inner, inner_a
    out["outer_op"] = to_labels(outer_a[inv])
    del outer, outer_a, pos_to_label
    out["path"] = _path_categorical(path_str, path_a[inv])
    del path, path_a, inv, order
    out["self_dur"] = np.maximum(self_dur, 0)
    out["is_step"] = is_step
    out["step"] = step_col
    return out


def _link_sorted(o_group: np.ndarray, o_ts: np.ndarray, o_end: np.ndarray, o_kind: np.ndarray, o_name: np.ndarray,
                 o_step: np.ndarray, pos_t) -> tuple:
    """The links of the host events in `build_tree`'s sorted order (thread, start, longer first, kind): parent,
    depth, inner, outer, path (path ids) per sorted position (runtime calls: their innermost enclosing range as
    parent, inner / outer -1), the path table (path_parent, path_name) and whether the ranges nest properly (each
    ends no later than its parent). `_tree.link` where it is built (a range ending before it starts leaves it to
    the vectorized code), else `link_ranges` over the ranges and `_innermost_range_at` for the runtime calls."""
    n = len(o_ts)
    if _tree is not None and pos_t is np.int32:
        out = [np.empty(n, dtype=np.int32) for _ in range(5)]
        got = _tree.link(o_group.astype(np.int32, copy=False), o_ts.astype(np.int64, copy=False),
                         o_end.astype(np.int64, copy=False), o_kind.astype(np.int8, copy=False),
                         o_name.astype(np.int32, copy=False), o_step.astype(bool, copy=False).view(np.uint8), *out)
        if got is not None:
            nested, path_parent, path_name = got
            return (*out, np.frombuffer(path_parent, dtype=np.int32), np.frombuffer(path_name, dtype=np.int32),
                    bool(nested))
        del out
    rng_pos = np.flatnonzero(o_kind != KIND_RUNTIME).astype(pos_t)  # sorted positions of ranges
    r_parent, r_depth, r_inner, r_outer, r_path, path_parent, path_name = link_ranges(
        o_group[rng_pos], o_ts[rng_pos], o_end[rng_pos], o_kind[rng_pos], o_name[rng_pos], o_step[rng_pos])

    # back to all sorted positions: ranges' links are range indices -> sorted positions
    def spread(vals: np.ndarray, is_index: bool, dtype=np.int64) -> np.ndarray:
        out = np.full(n, -1 if is_index else 0, dtype=dtype)
        v = vals
        if is_index:
            ok = v >= 0
            v = np.where(ok, rng_pos[np.where(ok, v, 0)], -1)
        out[rng_pos] = v
        return out

    parent_s = spread(r_parent, True, pos_t)
    depth_s = spread(r_depth, False, np.int32)  # depths and path ids are small: half the bytes
    inner_s = spread(r_inner, True, pos_t)
    outer_s = spread(r_outer, True, pos_t)
    path_s = spread(r_path, False, np.int32)
    del r_parent, r_depth, r_inner, r_outer, r_path
    rt_pos = np.flatnonzero(o_kind == KIND_RUNTIME).astype(pos_t)
    if len(rt_pos):
        top = _innermost_range_at(o_group, o_ts, o_end, rng_pos, parent_s, depth_s, rt_pos)
        has = top >= 0
        parent_s[rt_pos] = top
        safe = np.where(has, top, 0)
        depth_s[rt_pos] = np.where(has, depth_s[safe] + 1, 0)
        path_s[rt_pos] = np.where(has, path_s[safe], 0)
        del top, has, safe
    r_par = parent_s[rng_pos]
    nested = bool((o_end[rng_pos][r_par >= 0] <= o_end[r_par[r_par >= 0]]).all())
    return parent_s, depth_s, inner_s, outer_s, path_s, path_parent, path_name, nested


def _wide(a: np.ndarray) -> np.ndarray:
    """a as int64 (thread numbers enter keys like group * span + t, which overflow in int32)."""
    return a.astype(np.int64, copy=False)


def thread_time_order(rank: np.ndarray, pid: np.ndarray, tid: np.ndarray, ts: np.ndarray, dur: np.ndarray,
                      kind: np.ndarray) -> np.ndarray:
    """The permutation `np.lexsort((kind, -dur, ts, tid, pid, rank))` gives (by thread, then start, longer
    first, then kind; ties in file order), ~5x faster: the thread's rank in (rank, pid, tid) order and the
    start make one int64 key, sorted stably (a merge sort, quick on the runs of a thread's time-ordered
    events), and only the few entries whose key ties are sorted again by (-dur, kind). Falls back to the
    lexsort when the key would not fit int64. (Memory: the key, the order and the sorted key at most.)"""
    n = len(ts)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    t0, t1 = int(ts.min()), int(ts.max())
    kinds = int(kind.max()) + 1 if n else 1
    lo_dur, hi_dur = int(dur.min()), int(dur.max())
    g = None
    n_groups = 1
    overflow = False
    for a in (rank, pid, tid):  # thread index in (rank, pid, tid) order: mixed-radix over the sorted codes
        if a.min() == a.max():  # one value (the rank of a single file, its one pid): code 0 everywhere, no hashing
            continue
        codes, uniques = pd.factorize(a, sort=True)
        n_groups *= len(uniques)
        if n_groups * (t1 - t0 + 1) >= (1 << 62):
            overflow = True
            break
        g = codes.astype(np.int64, copy=False) if g is None else g * len(uniques) + codes
        del codes
    overflow = overflow or n_groups * (t1 - t0 + 1) >= (1 << 62)
    if g is None and not overflow:
        g = np.zeros(n, dtype=np.int64)
    if overflow or int(kind.min()) < 0 or (hi_dur - lo_dur + 1) * kinds >= (1 << 62):
        return np.lexsort((kind, -dur, ts, tid, pid, rank))
    g *= t1 - t0 + 1
    g += ts
    g -= t0  # g: the (thread, start) key
    order = np.argsort(g, kind="stable")
    s = g[order]
    del g
    tie = s[1:] == s[:-1]
    if tie.any():
        at = np.flatnonzero(tie)
        at = np.unique(np.concatenate([at, at + 1]))  # sorted positions inside runs of one key
        sub = order[at]
        second = (hi_dur - dur[sub]) * kinds + kind[sub]  # longer first, then kind
        order[at] = sub[np.lexsort((second, s[at]))]  # (stable: file order stays the last key)
    return order


def _tied_out_of_order(order: np.ndarray, ts: np.ndarray, dur: np.ndarray, kind: np.ndarray,
                       ext: np.ndarray) -> bool:
    """Whether two neighbours of the sort have the same start, duration and kind but External ids in
    descending order (then the sort is redone with the External id as its last key)."""
    o_ts = ts[order]
    same = o_ts[1:] == o_ts[:-1]
    del o_ts
    o_dur = dur[order]
    same &= o_dur[1:] == o_dur[:-1]
    del o_dur
    o_kind = kind[order]
    same &= o_kind[1:] == o_kind[:-1]
    del o_kind
    o_ext = ext[order]
    same &= o_ext[1:] < o_ext[:-1]
    return bool(same.any())


def _path_categorical(path_str: list[str], ids: np.ndarray) -> pd.Categorical:
    """pd.Categorical of path_str[ids] (categories: the distinct strings used, sorted), built from the
    few path ids instead of one string per row."""
    used = np.flatnonzero(np.bincount(ids, minlength=len(path_str)))  # (path ids are small: bins, no sort)
    cats = sorted({path_str[i] for i in used.tolist()})
    pos = {c: k for k, c in enumerate(cats)}
    code_of = np.zeros(int(used.max(initial=0)) + 1, dtype=np.int32)
    code_of[used] = [pos[path_str[i]] for i in used.tolist()]
    return pd.Categorical.from_codes(code_of[ids], categories=pd.Index(cats))  # dtype inferred, as pd.Categorical(values) does


def _range_depth(group: np.ndarray, ts: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Depth of each range of `link_ranges`: earlier ranges of its thread still open at its start.

    (Memory: one array of the ranges' size at a time beside the result where possible; a 2 GB trace has
    ~2.3M ranges, 18 MB per int64 array.)"""
    m = len(ts)
    group = _wide(group)  # (keys below are group * span + t)
    # ranges of the same thread whose end <= ts_i (ended before i started), counted by searching
    # (group, end) pairs; keys are made from times relative to the trace start. depth = (i - first index
    # of its thread) - (ranges of its thread ended by ts_i) = i - (ranges ended by ts_i, all threads before)
    t0 = min(int(ts.min()), int(end.min()))
    span = int(max(end.max(), ts.max())) - t0 + 1
    if int(group.max() + 1) * span < (1 << 62):
        ekey = group * span
        ekey += end
        ekey -= t0
        ekey.sort()  # the (group, end) keys in order
        depth = np.arange(m, dtype=np.int64)
        depth -= np.searchsorted(ekey, group * span + (ts - t0), side="right")
        del ekey
    else:  # astronomically long traces: per thread
        ended = np.empty(m, dtype=np.int64)
        for g in np.unique(group):
            lo, hi = np.searchsorted(group, [g, g + 1])
            ended[lo:hi] = np.searchsorted(np.sort(end[lo:hi]), ts[lo:hi], side="right")
        depth = np.arange(m, dtype=np.int64) - np.searchsorted(group, group, side="left")
        depth -= ended
        del ended
    # zero-length ranges at exactly ts_i that sort after i were counted as ended but are not earlier
    brk = np.empty(m, dtype=bool)
    brk[0] = True
    brk[1:] = (group[1:] != group[:-1]) | (ts[1:] != ts[:-1])
    run_start = np.flatnonzero(brk)  # runs of ranges of one thread starting at one instant
    run_id = np.cumsum(brk) - 1
    del brk
    run_end = np.r_[run_start[1:], m] - 1
    del run_start
    zeros_per_run = np.bincount(run_id, weights=end == ts, minlength=len(run_end)).astype(np.int64)
    rows = np.flatnonzero(zeros_per_run[run_id] > 0)  # ranges in a run holding a zero-length range (few)
    if len(rows):
        rid = run_id[rows]
        first_zero = run_end[rid] - zeros_per_run[rid] + 1  # zero-length ranges sort last in their run (-dur)
        depth[rows] += run_end[rid] - np.maximum(rows, first_zero) + 1
    del run_id, run_end, zeros_per_run, rows
    return np.maximum(depth, 0, out=depth)


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
    # (a function of its own: its temporaries go when it returns) links, depths and path ids in int32
    # below 2**31 ranges: half the bytes (an 8 GB trace has ~9M ranges)
    idx_t = np.int32 if m < 2**31 else np.int64
    depth = _range_depth(group, ts, end).astype(idx_t)

    parent = np.full(m, -1, dtype=idx_t)
    inner = np.full(m, -1, dtype=idx_t)
    outer = np.full(m, -1, dtype=idx_t)
    path = np.zeros(m, dtype=idx_t)
    path_parent = [np.array([-1])]
    path_name = [np.array([-1])]
    n_paths = 1
    is_op = kind == KIND_OP
    extends = ~is_op & ~is_step  # annotations and modules extend the path; profiler steps do not
    by_depth = np.argsort(depth, kind="stable").astype(idx_t)
    bounds = np.searchsorted(depth[by_depth], np.arange(depth.max() + 2))
    prev_level = empty
    for d in range(depth.max() + 1):
        lvl = by_depth[bounds[d]:bounds[d + 1]]  # ascending indices at this depth
        if d == 0:
            par = np.full(len(lvl), -1, dtype=idx_t)
        else:
            k = np.searchsorted(prev_level, lvl) - 1
            par = np.where(k >= 0, prev_level[np.maximum(k, 0)], -1).astype(idx_t, copy=False)
            del k
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
            pp_e, nm_e = p_path[ext].astype(np.int64), name[lvl][ext].astype(np.int64)
            lo, width = int(nm_e.min()), int(nm_e.max() - nm_e.min()) + 1
            # (parent path, name) as one key, in the same order as the rows: np.unique(axis=0) is ~20x slower
            uniq, inv = np.unique(pp_e * width + (nm_e - lo), return_inverse=True)
            lv_path[ext] = n_paths + inv.reshape(-1)
            path_parent.append(uniq // width)
            path_name.append(uniq % width + lo)
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


_QUERY_CHUNK = 1 << 20  # runtime calls placed at a time by `_innermost_range_at`


def _innermost_range_at(group: np.ndarray, ts: np.ndarray, end: np.ndarray, rng_pos: np.ndarray,
                        parent: np.ndarray, depth: np.ndarray, query_pos: np.ndarray) -> np.ndarray:
    """For each query event (sorted position), the innermost range open at its start on its thread.

    The stack top is a step function of time: range r opens at ts[r] (top := r) and closes at end[r]
    (top := parent[r]). At one instant: closings first, the deepest first (a child ending in the same
    microsecond as its parent is closed before it, so the parent's parent is the top after both), then
    openings in tree order, a zero-length range closing right after its own opening (it never stays
    open). So a range ending exactly when another event starts does not enclose it, as in the walk.
    Arrays are in sorted order.
    """
    if len(rng_pos) == 0 or len(query_pos) == 0:
        return np.full(len(query_pos), -1, dtype=np.int64)
    r_ts = ts[rng_pos]
    r_end = np.maximum(end[rng_pos], r_ts)  # a negative duration is a zero-length range
    zero = r_end == r_ts
    q_time = ts[query_pos]
    t0 = min(int(r_ts.min()), int(q_time.min()))
    span = max(int(r_end.max()), int(q_time.max())) - t0 + 1
    del q_time
    n_groups = int(max(group[rng_pos].max(), group[query_pos].max())) + 1
    dmax = int(depth[rng_pos].max(initial=0)) + 1
    if n_groups * span * dmax < (1 << 62):
        # The last boundary at or before each query decides: the last opening (ranges are in tree order,
        # so by (thread, start)) against the last closing of a non-empty range (sorted by (thread, end),
        # the shallowest last among equal ends). A closing wins only when strictly later; a zero-length
        # range that opened last has closed again, leaving its parent on top.
        # (memory: keys built in place in int64, the threads compared in the caller's narrow array, every
        # temporary dropped once used: at 8 GB each array of the ranges or the queries is ~70 MB)
        def key(pos: np.ndarray, t: np.ndarray) -> np.ndarray:  # (thread, t) as one int64
            k = _wide(group[pos])
            k *= span
            k += t
            k -= t0
            return k

        nz = np.flatnonzero(~zero)
        c_key = key(rng_pos[nz], r_end[nz])
        s_key = c_key * dmax
        s_key += dmax - 1
        s_key -= depth[rng_pos[nz]]
        c_ord = np.argsort(s_key, kind="stable")
        del s_key
        c_rng = nz[c_ord]
        del nz
        c_key = c_key[c_ord]
        del c_ord
        o_key = key(rng_pos, r_ts)
        # the queries a chunk at a time against the ranges' sorted openings and closings
        out = np.empty(len(query_pos), dtype=np.int64)
        for lo in range(0, len(query_pos), _QUERY_CHUNK):
            qp = query_pos[lo:lo + _QUERY_CHUNK]
            q_key = key(qp, ts[qp])
            o_idx = np.searchsorted(o_key, q_key, side="right") - 1
            c_idx = np.searchsorted(c_key, q_key, side="right") - 1  # all -1 when every range is zero-length
            del q_key
            q_group = group[qp]
            o_ok = o_idx >= 0
            o_ok[o_ok] = group[rng_pos[o_idx[o_ok]]] == q_group[o_ok]
            c_ok = c_idx >= 0
            c_ok[c_ok] = group[rng_pos[c_rng[c_idx[c_ok]]]] == q_group[c_ok]
            del q_group
            # c_i is read only where c_ok (a closing exists); with no closing at all it points at range 0
            o_i = np.maximum(o_idx, 0)
            c_i = c_rng[np.maximum(c_idx, 0)] if len(c_rng) else np.zeros_like(c_idx)
            del o_idx, c_idx
            close_wins = c_ok & (~o_ok | (r_end[c_i] > r_ts[o_i]))
            o_top = np.where(zero[o_i], parent[rng_pos[o_i]], rng_pos[o_i])
            out[lo:lo + len(qp)] = np.where(close_wins, parent[rng_pos[c_i]], np.where(o_ok, o_top, -1))
        return out
    # astronomically long traces: all boundaries sorted, thread by thread. Closings of non-empty ranges
    # first, the deepest first; then openings in tree order, a zero-length range closing right after
    # its opening
    r_group, q_group, d = _wide(group[rng_pos]), _wide(group[query_pos]), depth[rng_pos].astype(np.int64)
    out = np.full(len(query_pos), -1, dtype=np.int64)
    pos2 = 2 * np.arange(len(rng_pos), dtype=np.int64)
    base = dmax
    b_group = np.concatenate([r_group, r_group])
    b_time = np.concatenate([r_ts, r_end])
    b_tie = np.concatenate([base + pos2, np.where(zero, base + pos2 + 1, base - 1 - d)])
    b_top = np.concatenate([rng_pos, parent[rng_pos]])
    border = np.lexsort((b_tie, b_time, b_group))
    b_group, b_time, b_top = b_group[border], b_time[border], b_top[border]
    for g in np.unique(q_group):
        lo, hi = np.searchsorted(b_group, [g, g + 1])
        if lo == hi:
            continue
        qm = np.flatnonzero(q_group == g)
        idx = np.searchsorted(b_time[lo:hi], ts[query_pos[qm]], side="right") - 1
        ok = idx >= 0
        out[qm[ok]] = b_top[lo:hi][idx[ok]]
    return out


def _last_at_or_before(group: np.ndarray, ts: np.ndarray, q_group: np.ndarray, q_t: np.ndarray) -> np.ndarray:
    """Index of the last element with (group, ts) <= (q_group, q_t) in arrays sorted by (group, ts), -1 if
    that element is on another group or there is none."""
    t0 = min(int(ts.min()), int(q_t.min()))
    span = max(int(ts.max()), int(q_t.max())) - t0 + 1
    if int(max(group.max(), q_group.max()) + 1) * span < (1 << 62):
        idx = np.searchsorted(group * span + (ts - t0), q_group * span + (q_t - t0), side="right") - 1
    else:  # astronomically long traces: group by group
        idx = np.full(len(q_t), -1, dtype=np.int64)
        for g in np.unique(q_group):
            lo, hi = np.searchsorted(group, [g, g + 1])
            qm = np.flatnonzero(q_group == g)
            idx[qm] = np.where(hi > lo, lo + np.searchsorted(ts[lo:hi], q_t[qm], side="right") - 1, -1)
    ok = idx >= 0
    ok[ok] = group[idx[ok]] == q_group[ok]
    return np.where(ok, idx, -1)


def previous_greater(group: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For each i, the largest j < i of the same group with end[j] > end[i] (-1 if none), by pointer
    jumping: every element between j and i ends no later than i, which the jumps keep true."""
    m = len(end)
    prev = np.arange(m, dtype=np.int64) - 1
    if m == 0:
        return prev
    prev[np.r_[True, group[1:] != group[:-1]]] = -1
    act = np.flatnonzero(prev >= 0)
    act = act[end[prev[act]] <= end[act]]
    # none at all where i ends no earlier than everything before it in its group (e.g. the long runs of
    # top-level ops, which pointer jumping would otherwise walk in log2(run) rounds)
    t0 = int(end.min())
    span = int(end.max()) - t0 + 1
    if len(act) and int(group.max() + 1) * span < (1 << 62):
        key = group * span + (end - t0)
        run_max = np.maximum.accumulate(key)
        none = run_max[act - 1] <= key[act]  # an earlier group's keys are all smaller than this group's
        prev[act[none]] = -1
        act = act[~none]
    while len(act):
        nxt = prev[prev[act]]  # prev[act] >= 0 here
        prev[act] = nxt
        keep = nxt >= 0
        act, nxt = act[keep], nxt[keep]
        act = act[end[nxt] <= end[act]]
    return prev


def innermost_op_at(group: np.ndarray, ts: np.ndarray, end: np.ndarray, q_group: np.ndarray,
                    q_t: np.ndarray) -> np.ndarray:
    """Innermost op open at each query instant on the query's group (thread), by half-open intervals.

    Ops are sorted by (group, ts, -end, then inner after outer at identical intervals), so the op open
    at t with the latest start (the innermost) is the last op with ts <= t whose end > t. From the last
    op started by t, step back through `previous_greater` (the ops skipped end no later than the one
    left, so they are closed too) until an op still open at t; no nesting is assumed. Returns indices
    into the ops, -1 where none is open.
    """
    out = np.full(len(q_t), -1, dtype=np.int64)
    if len(ts) == 0 or len(q_t) == 0:
        return out
    cur = _last_at_or_before(group, ts, q_group, q_t)
    q = np.flatnonzero(cur >= 0)
    c = cur[q]
    prev = None
    while len(q):
        closed = end[c] <= q_t[q]
        out[q[~closed]] = c[~closed]
        if not closed.any():
            break
        if prev is None:
            prev = previous_greater(group, end)
        q, c = q[closed], prev[c[closed]]
        keep = c >= 0
        q, c = q[keep], c[keep]
    return out


def _ranks_with_op_ids(events: pd.DataFrame) -> np.ndarray:
    """Ranks whose runtime calls / GPU events carry External ids naming ops (see `_ranks_with_op_ids_of`)."""
    sel = C.isin(events["cat"], C.RUNTIME_CATS | C.GPU_CATS)
    return _ranks_with_op_ids_of(events["rank"].to_numpy()[sel], events["external_id"].to_numpy()[sel],
                                 events["correlation"].to_numpy()[sel])


def _ranks_with_op_ids_of(rank: np.ndarray, ext: np.ndarray, corr: np.ndarray) -> np.ndarray:
    """Ranks where some runtime call or GPU event has an External id different from its correlation:
    those ids name ops. Older Kineto writes the correlation id into both, which names nothing."""
    differs = (ext >= 0) & (corr >= 0) & (ext != corr)
    return np.unique(rank[differs])


def _op_by_external_id(rank: np.ndarray, ext: np.ndarray, row: np.ndarray, is_op: np.ndarray, q_rank: np.ndarray,
                       q_ext: np.ndarray, op_id_ranks: np.ndarray) -> np.ndarray:
    """For each query (rank, External id), the index of the op (among the candidates rank/ext/row/is_op)
    with that External id on that rank, the first in the file (smallest row label) where several have
    it; -1 where none, or where the rank's ids do not name ops."""
    out = np.full(len(q_ext), -1, dtype=np.int64)
    if len(op_id_ranks) == 0 or len(q_ext) == 0:
        return out
    use = (q_ext >= 0) & np.isin(q_rank, op_id_ranks)
    cand = np.flatnonzero(is_op & (ext >= 0))
    if not use.any() or len(cand) == 0:
        return out
    r = row[cand]
    if len(r) > 1 and not (r[1:] > r[:-1]).all():  # (the tree keeps event order: rows ascend already)
        cand = cand[np.argsort(r, kind="stable")]
    del r
    hit = _first_match(_key(rank[cand], ext[cand]), _key(q_rank[use], q_ext[use]))
    sel = np.flatnonzero(use)
    out[sel[hit >= 0]] = cand[hit[hit >= 0]]
    return out


def _first_match(keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """For each query, the index of the first element of `keys` equal to it, -1 where none: what
    `pd.Index(keys)` with duplicates dropped (`~duplicated()`) and `get_indexer` give, by a stable sort and a
    binary search instead of a hash table (~2x faster on the keys here, which come nearly sorted: ids grow
    through a trace; none at all to sort when they come sorted and unique)."""
    if len(keys) == 0:
        return np.full(len(queries), -1, dtype=np.int64)
    if (keys[1:] > keys[:-1]).all():  # sorted and unique
        order, ks = None, keys
    else:  # equal keys keep their order (a stable sort): the leftmost of a run, where the search lands, is the first
        order = np.argsort(keys, kind="stable")
        ks = keys[order]
    pos = np.searchsorted(ks, queries, side="left")
    np.minimum(pos, len(ks) - 1, out=pos)
    found = ks[pos] == queries
    if order is not None:
        pos = order[pos]
    return np.where(found, pos, -1)


_step_number = C.step_number


def steps_table(tree: pd.DataFrame) -> pd.DataFrame:
    """Profiler steps per rank: rank, step, start, end (host time of the step annotation)."""
    rows = np.flatnonzero(tree["is_step"].to_numpy())
    rank = tree["rank"].to_numpy()[rows]
    step = tree["step"].to_numpy()[rows].astype(np.int64)  # (int32 in the tree when the numbers fit)
    start = tree["ts"].to_numpy()[rows]
    end = start + tree["dur"].to_numpy()[rows]
    o = np.lexsort((start, rank))  # by rank, then start (stable, as sort_values on two columns)
    # the first (rank, step) of each pair kept, as drop_duplicates (hashed over whole columns: a trace of many short
    # steps has tens of thousands)
    keep = o[~pd.MultiIndex.from_arrays([rank[o], step[o]]).duplicated(keep="first")]
    return pd.DataFrame({"rank": rank[keep], "step": step[keep], "start": start[keep], "end": end[keep]})


def gpu_events(events: pd.DataFrame) -> pd.DataFrame:
    """GPU activity (kernels, memcpy, memset) with `kind` and `end` columns."""
    sel = C.map_strings(events["ph"], lambda s: s == "X") & C.isin(events["cat"], C.GPU_CATS)
    g = events.loc[sel, ["rank", "pid", "tid", "ts", "dur", "name", "cat", "correlation", "external_id", "device",
                         "stream", "bytes", "grid", "block", "collective", "in_nelems", "out_nelems", "dtype",
                         "group_size", "pg_name", "pg_ranks"]].copy(deep=False)
    for c in ("correlation", "external_id", "device", "stream", "bytes", "in_nelems", "out_nelems", "group_size"):
        g[c] = g[c].to_numpy().astype(np.int64, copy=False)  # narrowed in the events table (trace.narrow_args)
    code = np.where(C.isin(g["cat"], C.KERNEL_CATS), 0, np.where(C.isin(g["cat"], C.MEMCPY_CATS), 1, 2))
    g["kind"] = pd.Categorical.from_codes(code, categories=["kernel", "memcpy", "memset"])
    g["end"] = g["ts"] + g["dur"]
    # stream: the arg when present, else Kineto's tid on the GPU "process" (which is the stream)
    g["stream"] = np.where(g["stream"].to_numpy() >= 0, g["stream"].to_numpy(), g["tid"].to_numpy())
    g["is_comm"] = (code == 0) & C.is_comm_kernel(g["name"])  # (code 0: a kernel)
    return g


def _key(rank: np.ndarray, ident: np.ndarray) -> np.ndarray:
    return (rank.astype(np.int64) << 44) ^ ident.astype(np.int64)


def attribute_gpu(gpu: pd.DataFrame, tree: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Each GPU event's launch, innermost/outermost op, path, category and profiler step."""
    g = gpu
    n = len(g)
    launch = np.full(n, -1, dtype=np.int64)
    t_corr = tree["correlation"].to_numpy()
    rt = np.flatnonzero((tree["kind"].to_numpy() == KIND_RUNTIME) & (t_corr >= 0))  # runtime calls, tree order
    if len(rt) and n:
        # (the first runtime call in the tree's order with the GPU event's (rank, correlation))
        pos = _first_match(_key(tree["rank"].to_numpy()[rt], t_corr[rt]),
                           _key(g["rank"].to_numpy(), g["correlation"].to_numpy()))
        ok = (pos >= 0) & (g["correlation"].to_numpy() >= 0)
        launch[ok] = tree.index.to_numpy()[rt[pos[ok]]]
    del rt, t_corr
    has_launch = launch >= 0
    inner = np.full(n, -1, dtype=np.int64)
    outer = np.full(n, -1, dtype=np.int64)
    launch_ts = np.full(n, -1, dtype=np.int64)
    launch_ext = np.full(n, -1, dtype=np.int64)
    t_outer = tree["outer_op"].to_numpy()
    if has_launch.any():
        pos = _positions(tree, launch[has_launch])
        inner[has_launch] = tree["inner_op"].to_numpy()[pos]  # the runtime call's launching op (build_tree)
        outer[has_launch] = t_outer[pos]
        launch_ts[has_launch] = tree["ts"].to_numpy()[pos]
        launch_ext[has_launch] = tree["external_id"].to_numpy()[pos]
    # where the runtime call carries no External id (or there is no runtime call), the GPU event's own
    # External id names the op, on ranks whose ids name ops at all
    g_ext = g["external_id"].to_numpy()
    need = (launch_ext < 0) & (g_ext >= 0)
    if need.any():
        rt_rows = (tree["kind"].to_numpy() == KIND_RUNTIME)
        op_id_ranks = _ranks_with_op_ids_of(
            np.concatenate([tree["rank"].to_numpy()[rt_rows], g["rank"].to_numpy()]),
            np.concatenate([tree["external_id"].to_numpy()[rt_rows], g_ext]),
            np.concatenate([tree["correlation"].to_numpy()[rt_rows], g["correlation"].to_numpy()]))
        t_ext = tree["external_id"].to_numpy()
        hit = _op_by_external_id(tree["rank"].to_numpy(), t_ext, tree.index.to_numpy(),
                                 tree["kind"].to_numpy() == KIND_OP, g["rank"].to_numpy()[need], g_ext[need],
                                 op_id_ranks)
        found = hit >= 0
        sel = np.flatnonzero(need)[found]
        inner[sel] = tree.index.to_numpy()[hit[found]]
        outer[sel] = t_outer[hit[found]]
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
    """Row positions of labels of the frame (the tree keeps event order: binary search, no hash table)."""
    return C.positions(frame.index, labels)


def assign_steps(rank: np.ndarray, t: np.ndarray, steps: pd.DataFrame) -> np.ndarray:
    """Step number whose [start, end) holds time t on the same rank, else -1."""
    step = np.full(len(t), -1, dtype=np.int64)
    if steps.empty or not len(t):
        return step
    s_rank = steps["rank"].to_numpy()
    s_start, s_end, s_num = (steps[c].to_numpy() for c in ("start", "end", "step"))
    one_rank = rank.min() == rank.max()  # (one file: every row's rank is the one rank, no mask to apply)
    for r in np.unique(s_rank).tolist():  # (steps is sorted by rank, then start)
        if one_rank and r != rank[0]:
            continue
        rows = None if one_rank else np.flatnonzero(rank == r)
        if rows is not None and not len(rows):
            continue
        in_r = s_rank == r
        starts, ends, nums = s_start[in_r], s_end[in_r], s_num[in_r].astype(np.int64, copy=False)
        tr = t if rows is None else t[rows]
        pos = np.searchsorted(starts, tr, side="right") - 1
        ok = pos >= 0
        np.maximum(pos, 0, out=pos)
        ok &= tr < ends[pos]
        res = np.where(ok, nums[pos], -1)
        if rows is None:
            step = res
        else:
            step[rows] = res
    return step

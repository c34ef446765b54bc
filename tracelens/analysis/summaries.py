"""Op, kernel and category summaries, and the call-tree breakdown that the sunburst draws.

GPU time of an op = the summed durations of the GPU activity it launched (attributed through the
runtime call to the innermost enclosing op, as in `calltree`). Percentages are of the GPU busy time
(union over streams) of the ranks involved, so they answer "what share of the time the GPU was busy".

Window: the analyzer passes the GPU events of the steady-state steps and `host_mask`, a boolean mask
over the tree's rows (host events inside those steps); None means every row.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .. import categories as C
from .calltree import KIND_OP

US = 1000.0


def _in(tree: pd.DataFrame, host_mask) -> np.ndarray:
    return np.ones(len(tree), dtype=bool) if host_mask is None else np.asarray(host_mask, dtype=bool)


_CHUNK = 1 << 20  # tree rows per step of ops_summary (its temporaries scale with this, not with the trace)


def ops_summary(tree: pd.DataFrame, gpu: pd.DataFrame, busy_ns: float, host_mask=None) -> pd.DataFrame:
    """By (op name, input shapes): instances, CPU inclusive/self time, GPU time, kernels, % of busy."""
    sel = (tree["kind"].to_numpy() == KIND_OP) & _in(tree, host_mask)
    if not sel.any():
        return pd.DataFrame(columns=["op", "input_dims", "count", "cpu_total_us", "cpu_self_us", "gpu_total_us",
                                     "gpu_mean_us", "kernels", "pct_gpu_busy"])
    name_c = tree["name"].cat.codes.to_numpy()
    dims_c = tree["input_dims"].cat.codes.to_numpy()
    width = len(tree["input_dims"].cat.categories) + 1
    dur, self_dur = tree["dur"].to_numpy(), tree["self_dur"].to_numpy()

    def keys(rows) -> np.ndarray:  # (name code, dims code) as one int64: name * width + dims + 1 (codes from -1)
        k = name_c[rows].astype(np.int64)
        k *= width
        k += dims_c[rows]
        k += 1
        return k

    # groups in order of first appearance (as groupby(sort=False)), summed chunk by chunk of the tree so
    # that no temporary spans every op (a 8 GB trace has ~9M); durations are integers, so the float sums
    # are exact and do not depend on the order they are added in
    group_of: dict[int, int] = {}
    count = np.zeros(0, dtype=np.int64)
    cpu = np.zeros(0)
    cpu_self = np.zeros(0)
    for lo in range(0, len(sel), _CHUNK):
        m = np.flatnonzero(sel[lo:lo + _CHUNK])
        if len(m) == 0:
            continue
        m += lo
        inv, uniq = pd.factorize(keys(m))  # uniq in order of first appearance (a hash, no sort of the keys)
        uniq = uniq.tolist()
        for k in uniq:
            group_of.setdefault(k, len(group_of))
        g = np.fromiter((group_of[k] for k in uniq), dtype=np.int64, count=len(uniq))[inv]
        del inv
        n = len(group_of)
        count = np.pad(count, (0, n - len(count))) + np.bincount(g, minlength=n)
        cpu = np.pad(cpu, (0, n - len(cpu))) + np.bincount(g, weights=dur[m], minlength=n)
        cpu_self = np.pad(cpu_self, (0, n - len(cpu_self))) + np.bincount(g, weights=self_dur[m], minlength=n)
        del g, m
    n = len(group_of)
    group_keys = np.fromiter(group_of, dtype=np.int64, count=n)  # in group order (dict order)
    # GPU time and kernels per group: the GPU events whose op_row is a selected op
    lab = gpu["op_row"].to_numpy()
    ok = np.flatnonzero(lab >= 0)
    pos = C.positions(tree.index, lab[ok])
    hit = pos >= 0
    hit[hit] = sel[pos[hit]]
    ok, pos = ok[hit], pos[hit]
    by_key = np.argsort(group_keys)
    g = by_key[np.searchsorted(group_keys[by_key], keys(pos))]  # every selected op's key has a group
    gpu_sum = np.bincount(g, weights=gpu["dur"].to_numpy()[ok], minlength=n)
    nk = np.bincount(g, minlength=n)
    out = pd.DataFrame(
        {
            "op": _decode_codes(group_keys // width, tree["name"]),
            "input_dims": _decode_codes(group_keys % width - 1, tree["input_dims"]),
            "count": count.astype(np.int64),
            "cpu_total_us": cpu / US,
            "cpu_self_us": cpu_self / US,
            "gpu_total_us": gpu_sum / US,
            "gpu_mean_us": gpu_sum / US / count,
            "kernels": nk.astype(np.int64),
            "pct_gpu_busy": 100.0 * gpu_sum / busy_ns if busy_ns > 0 else np.nan,
        }
    )
    return out.sort_values(["gpu_total_us", "cpu_self_us"], ascending=False, ignore_index=True, kind="stable")


def _per_row(gpu: pd.DataFrame, col: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GPU time (ns, float) and event count of each row label in `rows`, from the GPU events whose
    `col` (op_row / top_op_row) is that label; bincount instead of groupby + reindex. rows are sorted
    tree labels, so the bins are their positions (found by binary search), not every event label."""
    lab = gpu[col].to_numpy()
    if len(rows) > 1 and not (rows[1:] > rows[:-1]).all():  # not sorted: bins over the labels themselves
        ok = lab >= 0
        lab, dur = lab[ok], gpu["dur"].to_numpy()[ok]
        size = int(max(lab.max(initial=-1), rows.max(initial=-1))) + 1
        return (np.bincount(lab, weights=dur, minlength=size)[rows].astype(float),
                np.bincount(lab, minlength=size)[rows].astype(float))
    pos = np.searchsorted(rows, lab)
    ok = (lab >= 0) & (pos < len(rows))
    ok[ok] = rows[pos[ok]] == lab[ok]
    pos, dur = pos[ok], gpu["dur"].to_numpy()[ok]
    return (np.bincount(pos, weights=dur, minlength=len(rows)).astype(float),
            np.bincount(pos, minlength=len(rows)).astype(float))


def _decode_codes(codes: np.ndarray, col: pd.Series) -> np.ndarray:
    return C.decode_codes(col.cat.categories, codes)


def kernel_summary(gpu: pd.DataFrame, busy_ns: float) -> pd.DataFrame:
    """By (kernel name, launching op): count, total/mean/min/max, category, % of GPU busy."""
    cols = ["kernel", "op", "category", "kind", "count", "total_us", "mean_us", "min_us", "max_us", "pct_gpu_busy"]
    if gpu.empty:
        return pd.DataFrame(columns=cols)
    keys = ["name", "op", "category", "kind"]
    got = _groups(gpu, keys)
    if got is not None:
        group, rows, cols_of = got
        dur = gpu["dur"].to_numpy()
        stats = pd.Series(dur if rows is None else dur[rows]).groupby(group, sort=False).agg(
            ["size", "sum", "mean", "min", "max"])
        agg = pd.DataFrame({**cols_of, **{c: stats[c].to_numpy() for c in stats.columns}})
    else:
        agg = gpu.groupby(keys, observed=True, sort=False)["dur"].agg(["size", "sum", "mean", "min", "max"]).reset_index()
    out = pd.DataFrame(
        {
            "kernel": agg["name"].astype(str),
            "op": agg["op"].astype(str),
            "category": agg["category"].astype(str),
            "kind": agg["kind"].astype(str),
            "count": agg["size"].astype(np.int64),
            "total_us": agg["sum"] / US,
            "mean_us": agg["mean"] / US,
            "min_us": agg["min"] / US,
            "max_us": agg["max"] / US,
            "pct_gpu_busy": 100.0 * agg["sum"] / busy_ns if busy_ns > 0 else np.nan,
        }
    )
    return out.sort_values("total_us", ascending=False, ignore_index=True, kind="stable")


def category_rollup(gpu: pd.DataFrame, busy_by_rank: dict[int, float]) -> pd.DataFrame:
    """Per rank and category: GPU event time (sum of durations), count, % of that rank's busy time."""
    cols = ["rank", "category", "count", "total_us", "pct_gpu_busy"]
    if gpu.empty:
        return pd.DataFrame(columns=cols)
    agg = _rank_category_sums(gpu)
    busy = agg["rank"].map(busy_by_rank).astype(float)
    out = pd.DataFrame(
        {
            "rank": agg["rank"].astype(int),
            "category": agg["category"].astype(str),
            "count": agg["size"].astype(np.int64),
            "total_us": agg["sum"] / US,
            "pct_gpu_busy": 100.0 * agg["sum"] / busy.where(busy > 0),
        }
    )
    order = {c: i for i, c in enumerate(C.CATEGORIES)}
    return out.sort_values(["rank", "category"], key=lambda s: s.map(order) if s.name == "category" else s,
                           ignore_index=True, kind="stable")


def _rank_category_sums(gpu: pd.DataFrame) -> pd.DataFrame:
    """`gpu.groupby(["rank", "category"], observed=True)["dur"].agg(["size", "sum"]).reset_index()` (the
    (rank, category) pairs in order; sums exact, int64) from bins of one int key, without pandas' grouping of
    two keys (~8 ms on 72K GPU events). Falls back to the groupby where the key or the sums would not fit."""
    rank = gpu["rank"].to_numpy()
    cat = gpu["category"]
    codes = cat.cat.codes.to_numpy()
    dur = gpu["dur"].to_numpy()
    n_cat = len(cat.cat.categories)
    ok = codes >= 0
    if (not len(rank) or rank.min() < 0 or (int(rank.max()) + 1) * n_cat > (1 << 24) or dur.dtype.kind != "i"
            or float(np.abs(dur).sum()) >= 2.0**53):
        return gpu.groupby(["rank", "category"], observed=True)["dur"].agg(["size", "sum"]).reset_index()
    key = rank.astype(np.int64) * n_cat + codes
    if not ok.all():
        key, dur = key[ok], dur[ok]
    size = np.bincount(key)
    u = np.flatnonzero(size)
    total = np.bincount(key, weights=dur)[u].astype(np.int64)  # (integer sums below 2**53: exact as floats)
    return pd.DataFrame({"rank": (u // n_cat).astype(rank.dtype),
                         "category": pd.Categorical.from_codes(u % n_cat, dtype=cat.dtype),
                         "size": size[u].astype(np.int64), "sum": total})


def top_level_ops(tree: pd.DataFrame, gpu: pd.DataFrame, host_mask=None) -> pd.DataFrame:
    """Outermost ops (e.g. aten::linear called from Python) with the GPU time of everything under them."""
    cols = ["op", "count", "cpu_total_us", "gpu_total_us", "kernels"]
    kind, outer = tree["kind"].to_numpy(), tree["outer_op"].to_numpy()
    labels = tree.index.to_numpy()
    rows = np.flatnonzero((kind == KIND_OP) & (outer == labels) & _in(tree, host_mask))
    if not len(rows):
        return pd.DataFrame(columns=cols)
    gpu_ns, nk = _per_row(gpu, "top_op_row", labels[rows])
    code = tree["name"].cat.codes.to_numpy()[rows]
    named = code >= 0  # an op without a name has no group (as groupby drops missing keys)
    code = code[named]
    # groups in category order, as groupby on the categorical: bins of the name codes (each bin adds its rows'
    # values in row order, as bincount over group numbers did; no sort of the codes)
    size = len(tree["name"].cat.categories)
    count = np.bincount(code, minlength=size)
    uniq = np.flatnonzero(count)
    out = pd.DataFrame(
        {"op": _decode_codes(uniq, tree["name"]), "count": count[uniq],
         "cpu_total_us": np.bincount(code, weights=tree["dur"].to_numpy()[rows][named], minlength=size)[uniq] / US,
         "gpu_total_us": np.bincount(code, weights=gpu_ns[named], minlength=size)[uniq] / US,
         "kernels": np.bincount(code, weights=nk[named], minlength=size)[uniq].astype(np.int64)}
    )
    return out.sort_values(["gpu_total_us", "cpu_total_us"], ascending=False, ignore_index=True, kind="stable")


def breakdown_tree(gpu: pd.DataFrame, tree: pd.DataFrame, max_leaves: int = 400, host_mask=None) -> pd.DataFrame:
    """Hierarchy for a sunburst: annotation/module path -> top-level op -> op -> kernel.

    Value is GPU time (us) when the trace has GPU activity, else CPU self time of ops. Returns
    columns id, parent, label, value, level; parents' values equal the sum of their children.
    """
    if not gpu.empty:
        leaves = pd.DataFrame(  # categoricals as they are (.array): grouping works on their codes
            {
                "path": gpu["path"].array,
                "top": gpu["top_op"].array,
                "op": gpu["op"].array,
                "leaf": gpu["name"].array,
                "value": gpu["dur"].to_numpy() / US,
            }
        )
    else:
        ops = tree[(tree["kind"] == KIND_OP).to_numpy() & _in(tree, host_mask)]
        if ops.empty:
            return pd.DataFrame(columns=["id", "parent", "label", "value", "level"])
        leaves = pd.DataFrame(
            {
                "path": ops["path"].array,
                "top": C.take_strings(tree["name"], ops["outer_op"].to_numpy()),
                "op": ops["name"].array,
                "leaf": "(self)",
                "value": ops["self_dur"].to_numpy() / US,
            }
        )
    # aggregate on categoricals first (cheap), then make labels for the few distinct rows
    keys = ["path", "top", "op", "leaf"]
    agg = _sum_by_codes(leaves, keys, "value")
    if agg is None:
        agg = leaves.groupby(keys, sort=False, observed=True)["value"].sum().reset_index()
        for c in keys:
            agg[c] = agg[c].astype(str)
    agg["top"] = agg["top"].replace({"": "(no op)", "nan": "(no op)"})
    if not gpu.empty:  # (each distinct kernel name shortened once)
        short = {k: C.short_kernel_name(k) for k in agg["leaf"].unique().tolist()}
        agg["leaf"] = agg["leaf"].map(short)
    agg.loc[agg["op"] == agg["top"], "op"] = ""
    again = _sum_by_codes(agg, keys, "value")  # (rows that now share their labels)
    agg = again if again is not None else agg.groupby(keys, sort=False)["value"].sum().reset_index()
    agg = agg.sort_values("value", ascending=False, ignore_index=True, kind="stable")
    if len(agg) > max_leaves:
        rest = agg.iloc[max_leaves:]["value"].sum()
        agg = agg.iloc[:max_leaves]
        agg = pd.concat([agg, pd.DataFrame([{"path": "", "top": "(other)", "op": "", "leaf": "", "value": rest}])],
                        ignore_index=True)
    nodes: dict[str, list] = {}  # id -> [parent, label, value, level]
    for path, top, op, leaf, value in zip(*(agg[c].tolist() for c in (*keys, "value"))):
        chain = [p for p in path.split("/") if p] + [top] + ([op] if op else []) + ([leaf] if leaf else [])
        parent = ""
        for level, label in enumerate(chain):
            node_id = f"{parent}\x1f{label}" if parent else label
            entry = nodes.get(node_id)
            if entry is None:
                nodes[node_id] = [parent, label, value, level]
            else:
                entry[2] += value
            parent = node_id
    return pd.DataFrame(
        [(i, p, lbl, v, lvl) for i, (p, lbl, v, lvl) in nodes.items()],
        columns=["id", "parent", "label", "value", "level"],
    )


def _groups(frame: pd.DataFrame, keys: list[str]) -> tuple[np.ndarray, np.ndarray | None, dict] | None:
    """The groups of `frame.groupby(keys, sort=False, observed=True)`, found by a hash of one int64 made of the
    keys' codes (a categorical's, else `pd.factorize`'s): (the group of each row kept, numbered in order of first
    appearance; the rows kept, None for all: rows with a missing key are left out, as the groupby drops them;
    each key's value per group, as strings for a categorical key (`astype(str)`), else as they are). Aggregating
    a column over that one int key with pandas gives what the groupby on the keys gives (the same cython
    reductions, over each group's rows in row order), at ~1/3 of the cost of grouping on several keys. None
    where the codes would not fit one int64 (the caller groups on the keys)."""
    codes, labels = [], []
    for k in keys:
        col = frame[k]
        if isinstance(col.dtype, pd.CategoricalDtype):
            codes.append(col.cat.codes.to_numpy())
            labels.append(C.category_values(col.cat.categories, codes[-1]))  # (the values the codes use)
        else:
            c, uniques = pd.factorize(col.to_numpy())
            codes.append(c)
            labels.append(np.asarray(uniques, dtype=object))
    if float(np.prod([float(len(x)) + 1.0 for x in labels])) >= 2.0**62:
        return None
    ok = np.ones(len(frame), dtype=bool)
    key = np.zeros(len(frame), dtype=np.int64)
    for c, lab in zip(codes, labels):
        ok &= c >= 0
        key *= len(lab)
        key += c
    rows = None if ok.all() else np.flatnonzero(ok)
    if rows is not None:
        key = key[rows]
    group, _ = pd.factorize(key)  # numbered in order of first appearance
    run = np.maximum.accumulate(group) if len(group) else group  # each group's first row: where a number
    first = np.flatnonzero(np.r_[True, run[1:] > run[:-1]]) if len(group) else group  # above all before it appears
    values = {k: pd.array(lab[(c if rows is None else c[rows])[first]], dtype=str) for k, c, lab in zip(keys, codes, labels)}
    return group, rows, values


def _sum_by_codes(frame: pd.DataFrame, keys: list[str], value: str) -> pd.DataFrame | None:
    """`frame.groupby(keys, sort=False, observed=True)[value].sum().reset_index()` by `_groups` (categorical keys
    as strings); None where `_groups` is."""
    got = _groups(frame, keys)
    if got is None:
        return None
    group, rows, out = got
    vals = frame[value].to_numpy()
    out[value] = pd.Series(vals if rows is None else vals[rows]).groupby(group, sort=False).sum().to_numpy()
    return pd.DataFrame(out)


def annotation_summary(tree: pd.DataFrame, gpu: pd.DataFrame, host_mask=None) -> pd.DataFrame:
    """record_function ranges and nn.Module scopes (e.g. moe/router, moe/dispatch): instances, host
    time (inclusive) and the GPU time of everything launched inside them, per annotation path."""
    from .calltree import KIND_ANNOTATION, KIND_MODULE

    cols = ["path", "name", "count", "host_total_us", "host_mean_us", "gpu_total_us", "kernels"]
    kind = tree["kind"].to_numpy()
    rows = np.flatnonzero(((kind == KIND_ANNOTATION) | (kind == KIND_MODULE)) & ~tree["is_step"].to_numpy()
                          & _in(tree, host_mask))
    if not len(rows):
        return pd.DataFrame(columns=cols)
    agg = _by_path_and_name(tree, rows)
    if gpu.empty:
        gp = pd.Series(dtype=float)
        gk = pd.Series(dtype=float)
    else:
        by_path = gpu.groupby("path", observed=True)["dur"].agg(["sum", "size"])
        by_path.index = by_path.index.astype(str)
        gp, gk = by_path["sum"], by_path["size"]
    # GPU time under each annotation path: its own and every path below it (q == p or q starts with p + "/"),
    # each GPU path's time added to every path it is below: the paths ending where q has a "/", and q itself
    # (integer sums, so the order they are added in changes nothing; a loop over every pair of paths took
    # 50 ms where a model's nn.Module paths are many)
    under: dict[str, list] = {}
    for q, v, k in zip(gp.index.tolist(), gp.tolist(), gk.tolist()):
        for i in [j for j, ch in enumerate(q) if ch == "/"] + [len(q)]:
            acc = under.setdefault(q[:i], [0, 0])
            acc[0] += v
            acc[1] += k
    gpu_us, kernels = [], []
    for p in agg["path"].tolist():
        acc = under.get(p)
        gpu_us.append(float(acc[0]) / US if acc else 0.0)
        kernels.append(int(acc[1]) if acc else 0)
    out = pd.DataFrame({"path": agg["path"], "name": agg["name"], "count": agg["size"].astype(np.int64),
                        "host_total_us": agg["sum"] / US, "host_mean_us": agg["sum"] / US / agg["size"],
                        "gpu_total_us": gpu_us, "kernels": kernels})
    key = "gpu_total_us" if out["gpu_total_us"].sum() > 0 else "host_total_us"
    return out.sort_values(key, ascending=False, ignore_index=True, kind="stable")[cols]


def _by_path_and_name(tree: pd.DataFrame, rows: np.ndarray) -> pd.DataFrame:
    """The tree's `rows` that have a path, by (path, name) in order of first appearance: columns path, name
    (strings), size, sum (of dur, int64), as `groupby(["path", "name"], sort=False)["dur"].agg(["size", "sum"])`
    on the rows' path and name strings gives them, grouped on the columns' codes instead (a string per row and a
    hash of each took ~30 ms on a model's 100K nn.Module ranges). Codes of equal strings (a missing value and an
    empty category are both "") are made one first."""
    def ids(col: pd.Series) -> tuple[np.ndarray, np.ndarray]:  # (string id of each row, the strings by id)
        lut = np.array(C.category_strings(col.cat.categories) + [""], dtype=object)  # code -1 -> ""
        same, uniques = pd.factorize(lut)
        return same[col.cat.codes.to_numpy()[rows]], np.asarray(uniques, dtype=object)

    p_id, p_str = ids(tree["path"])
    n_id, n_str = ids(tree["name"])
    keep = np.flatnonzero(p_str[p_id] != "")
    if not len(keep):  # (no group: the frame as groupby leaves it, empty, its dtypes included)
        ann = tree.iloc[rows]
        agg = pd.DataFrame({"path": C.strings(ann["path"]), "name": C.strings(ann["name"]), "dur": ann["dur"].to_numpy()})
        return agg[agg["path"] != ""].groupby(["path", "name"], sort=False)["dur"].agg(["size", "sum"]).reset_index()
    key = p_id[keep].astype(np.int64) * len(n_str) + n_id[keep]
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    appear = np.argsort(first, kind="stable")  # groups in order of first appearance
    group = np.empty(len(appear), dtype=np.int64)
    group[appear] = np.arange(len(appear))
    group = group[inv.reshape(-1)]
    size = np.bincount(group, minlength=len(appear))
    by_group = np.argsort(group, kind="stable")
    dur = tree["dur"].to_numpy()[rows[keep]].astype(np.int64, copy=False)
    total = np.add.reduceat(dur[by_group], np.r_[0, np.cumsum(size)[:-1]])  # int64: exact, as groupby's sum
    head = keep[first[appear]]  # each group's first row
    return pd.DataFrame({"path": p_str[p_id[head]], "name": n_str[n_id[head]], "size": size.astype(np.int64),
                         "sum": total})

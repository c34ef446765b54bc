"""The summaries' grouping against the plain pandas and Python they replaced (same frames, exactly), on every
fixture trace: `annotation_summary` (grouped on codes, the GPU time of the paths below each summed per prefix),
`ops_summary` (groups found by a hash of their keys), `kernel_summary` and `breakdown_tree` (grouped on one int key made
of the keys' codes)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import tracelens
from tracelens import categories as C
from tracelens.analysis import summaries as S
from tracelens.analysis.calltree import KIND_ANNOTATION, KIND_MODULE

from ..conftest import ALL_TRACES


def _annotation_summary_reference(tree: pd.DataFrame, gpu: pd.DataFrame, host_mask=None) -> pd.DataFrame:
    """annotation_summary as it was: a string per row grouped by pandas, every pair of paths compared."""
    cols = ["path", "name", "count", "host_total_us", "host_mean_us", "gpu_total_us", "kernels"]
    ann = tree.loc[(tree["kind"].isin([KIND_ANNOTATION, KIND_MODULE]) & ~tree["is_step"]).to_numpy() & S._in(tree, host_mask),
                   ["path", "name", "dur"]]
    if ann.empty:
        return pd.DataFrame(columns=cols)
    agg = pd.DataFrame({"path": C.strings(ann["path"]), "name": C.strings(ann["name"]), "dur": ann["dur"].to_numpy()})
    agg = agg[agg["path"] != ""].groupby(["path", "name"], sort=False)["dur"].agg(["size", "sum"]).reset_index()
    if gpu.empty:
        gp, gk = pd.Series(dtype=float), pd.Series(dtype=float)
    else:
        by_path = gpu.groupby("path", observed=True)["dur"].agg(["sum", "size"])
        by_path.index = by_path.index.astype(str)
        gp, gk = by_path["sum"], by_path["size"]
    below = list(zip(gp.index.tolist(), gp.tolist(), gk.tolist()))
    gpu_us, kernels = [], []
    for p in agg["path"].tolist():
        m = [(v, k) for q, v, k in below if q == p or q.startswith(p + "/")]
        gpu_us.append(float(sum(v for v, _ in m)) / S.US if m else 0.0)
        kernels.append(int(sum(k for _, k in m)) if m else 0)
    out = pd.DataFrame({"path": agg["path"], "name": agg["name"], "count": agg["size"].astype(np.int64),
                        "host_total_us": agg["sum"] / S.US, "host_mean_us": agg["sum"] / S.US / agg["size"],
                        "gpu_total_us": gpu_us, "kernels": kernels})
    key = "gpu_total_us" if out["gpu_total_us"].sum() > 0 else "host_total_us"
    return out.sort_values(key, ascending=False, ignore_index=True, kind="stable")[cols]


@pytest.mark.parametrize("path", ALL_TRACES, ids=lambda p: p.name)
def test_annotation_summary_is_the_pandas_reference(path):
    a = tracelens.analyze(tracelens.load(path, cache=False))
    for host_mask in (None, a.host_window):
        got = S.annotation_summary(a.tree, a.gpu_window, host_mask=host_mask)
        pd.testing.assert_frame_equal(got, _annotation_summary_reference(a.tree, a.gpu_window, host_mask=host_mask),
                                      check_exact=True)


def test_annotation_paths_sum_what_lies_below_them():
    """A path's GPU time is its own and its descendants' ("a/b" is below "a", "ab" is not; "a/" keeps its own)."""
    import tracelens.analysis.calltree as CT

    names = ["a", "b", "ab", "k"]
    tree = pd.DataFrame({"kind": np.array([KIND_ANNOTATION] * 3 + [CT.KIND_OP], dtype=np.int8),
                         "is_step": np.zeros(4, dtype=bool), "dur": np.array([10, 5, 7, 3]),
                         "path": pd.Categorical(["a", "a/b", "ab", "a/b"]), "name": pd.Categorical(names[:4])})
    gpu = pd.DataFrame({"path": pd.Categorical(["a/b", "a/b", "ab", "a", "a/b/c"]), "dur": np.array([100, 20, 4, 1, 1000])})
    got = S.annotation_summary(tree, gpu)
    pd.testing.assert_frame_equal(got, _annotation_summary_reference(tree, gpu), check_exact=True)
    assert dict(zip(got["path"], got["gpu_total_us"] * S.US)) == {"a": 1121, "a/b": 1120, "ab": 4}


def _ops_summary_reference(tree: pd.DataFrame, gpu: pd.DataFrame, busy_ns: float, host_mask=None) -> pd.DataFrame:
    """ops_summary by pandas: the ops grouped by (name, input shapes) in order of first appearance, the GPU events
    summed into their op's group (integer sums: exact whatever the order)."""
    from tracelens.analysis.calltree import KIND_OP

    sel = (tree["kind"].to_numpy() == KIND_OP) & S._in(tree, host_mask)
    ops = pd.DataFrame({"op": C.strings(tree["name"])[sel], "input_dims": C.strings(tree["input_dims"])[sel],
                        "dur": tree["dur"].to_numpy()[sel], "self_dur": tree["self_dur"].to_numpy()[sel],
                        "label": tree.index.to_numpy()[sel]})
    grp = ops.groupby(["op", "input_dims"], sort=False)
    ops["g"] = grp.ngroup()
    g = gpu[gpu["op_row"].isin(ops["label"])]
    g_of = ops.set_index("label")["g"].reindex(g["op_row"].to_numpy()).to_numpy()
    n = grp.ngroups
    gpu_sum = np.bincount(g_of, weights=g["dur"].to_numpy(), minlength=n)
    agg = grp.agg(count=("dur", "size"), cpu=("dur", "sum"), cpu_self=("self_dur", "sum")).reset_index()
    out = pd.DataFrame({"op": agg["op"].to_numpy(dtype=object), "input_dims": agg["input_dims"].to_numpy(dtype=object),
                        "count": agg["count"].astype(np.int64), "cpu_total_us": agg["cpu"] / S.US,
                        "cpu_self_us": agg["cpu_self"] / S.US, "gpu_total_us": gpu_sum / S.US,
                        "gpu_mean_us": gpu_sum / S.US / agg["count"], "kernels": np.bincount(g_of, minlength=n).astype(np.int64),
                        "pct_gpu_busy": 100.0 * gpu_sum / busy_ns if busy_ns > 0 else np.nan})
    return out.sort_values(["gpu_total_us", "cpu_self_us"], ascending=False, ignore_index=True, kind="stable")


@pytest.mark.parametrize("path", ALL_TRACES, ids=lambda p: p.name)
def test_ops_summary_is_the_pandas_reference(path):
    a = tracelens.analyze(tracelens.load(path, cache=False))
    if not (a.tree["kind"].to_numpy() == 2).any():
        return
    busy = float(a.timeline["gpu_busy_us"].sum() * 1000.0) if len(a.timeline) else 0.0
    for host_mask in (None, a.host_window):
        got = S.ops_summary(a.tree, a.gpu_window, busy, host_mask=host_mask)
        ref = _ops_summary_reference(a.tree, a.gpu_window, busy, host_mask=host_mask)
        pd.testing.assert_frame_equal(got, ref, check_exact=True, check_dtype=False)  # (op / input_dims: str or object)


def _kernel_summary_reference(gpu: pd.DataFrame, busy_ns: float) -> pd.DataFrame:
    """kernel_summary as it was: one groupby on the four categorical keys."""
    if gpu.empty:
        return pd.DataFrame(columns=["kernel", "op", "category", "kind", "count", "total_us", "mean_us", "min_us",
                                     "max_us", "pct_gpu_busy"])
    agg = gpu.groupby(["name", "op", "category", "kind"], observed=True, sort=False)["dur"].agg(
        ["size", "sum", "mean", "min", "max"]).reset_index()
    out = pd.DataFrame({"kernel": agg["name"].astype(str), "op": agg["op"].astype(str),
                        "category": agg["category"].astype(str), "kind": agg["kind"].astype(str),
                        "count": agg["size"].astype(np.int64), "total_us": agg["sum"] / S.US, "mean_us": agg["mean"] / S.US,
                        "min_us": agg["min"] / S.US, "max_us": agg["max"] / S.US,
                        "pct_gpu_busy": 100.0 * agg["sum"] / busy_ns if busy_ns > 0 else np.nan})
    return out.sort_values("total_us", ascending=False, ignore_index=True, kind="stable")


def _breakdown_labels_reference(gpu: pd.DataFrame) -> pd.DataFrame:
    """breakdown_tree's aggregation as it was: groupby on the four categoricals, labels, groupby on the strings."""
    leaves = pd.DataFrame({"path": gpu["path"].array, "top": gpu["top_op"].array, "op": gpu["op"].array,
                           "leaf": gpu["name"].array, "value": gpu["dur"].to_numpy() / S.US})
    agg = leaves.groupby(["path", "top", "op", "leaf"], sort=False, observed=True)["value"].sum().reset_index()
    for c in ("path", "top", "op", "leaf"):
        agg[c] = agg[c].astype(str)
    agg["top"] = agg["top"].replace({"": "(no op)", "nan": "(no op)"})
    agg["leaf"] = agg["leaf"].map(C.short_kernel_name)
    agg.loc[agg["op"] == agg["top"], "op"] = ""
    return agg.groupby(["path", "top", "op", "leaf"], sort=False)["value"].sum().reset_index()


@pytest.mark.parametrize("path", ALL_TRACES, ids=lambda p: p.name)
def test_kernel_summary_and_breakdown_groups_are_the_pandas_reference(path):
    a = tracelens.analyze(tracelens.load(path, cache=False))
    gw = a.gpu_window
    for busy in (0.0, 1e9):
        pd.testing.assert_frame_equal(S.kernel_summary(gw, busy), _kernel_summary_reference(gw, busy), check_exact=True)
    if gw.empty:
        return
    leaves = pd.DataFrame({"path": gw["path"].array, "top": gw["top_op"].array, "op": gw["op"].array,
                           "leaf": gw["name"].array, "value": gw["dur"].to_numpy() / S.US})
    agg = S._sum_by_codes(leaves, ["path", "top", "op", "leaf"], "value")
    agg["top"] = agg["top"].replace({"": "(no op)", "nan": "(no op)"})
    agg["leaf"] = agg["leaf"].map(C.short_kernel_name)
    agg.loc[agg["op"] == agg["top"], "op"] = ""
    agg = S._sum_by_codes(agg, ["path", "top", "op", "leaf"], "value")
    pd.testing.assert_frame_equal(agg, _breakdown_labels_reference(gw), check_exact=True, check_dtype=False)


def test_groups_leave_out_missing_keys_as_groupby_does():
    frame = pd.DataFrame({"a": pd.Categorical(["x", None, "y", "x", "y"]), "b": ["p", "q", None, "p", "q"],
                          "v": [0.1, 0.2, 0.3, 0.4, 0.5]})
    got = S._sum_by_codes(frame, ["a", "b"], "v")
    ref = frame.groupby(["a", "b"], sort=False, observed=True)["v"].sum().reset_index()
    ref["a"] = ref["a"].astype(str)
    pd.testing.assert_frame_equal(got, ref, check_exact=True, check_dtype=False)


def _top_level_ops_reference(tree: pd.DataFrame, gpu: pd.DataFrame, host_mask=None) -> pd.DataFrame:
    """top_level_ops as it was: the outermost ops' frame, groups by np.unique of the name codes."""
    from tracelens.analysis.calltree import KIND_OP

    kind, outer = tree["kind"].to_numpy(), tree["outer_op"].to_numpy()
    ops = tree.loc[(kind == KIND_OP) & (outer == tree.index.to_numpy()) & S._in(tree, host_mask), ["name", "dur"]]
    if ops.empty:
        return pd.DataFrame(columns=["op", "count", "cpu_total_us", "gpu_total_us", "kernels"])
    gpu_ns, nk = S._per_row(gpu, "top_op_row", ops.index.to_numpy())
    code = ops["name"].cat.codes.to_numpy()
    named = code >= 0
    uniq, grp = np.unique(code[named], return_inverse=True)
    n = len(uniq)
    out = pd.DataFrame({"op": S._decode_codes(uniq, ops["name"]), "count": np.bincount(grp, minlength=n),
                        "cpu_total_us": np.bincount(grp, weights=ops["dur"].to_numpy()[named], minlength=n) / S.US,
                        "gpu_total_us": np.bincount(grp, weights=gpu_ns[named], minlength=n) / S.US,
                        "kernels": np.bincount(grp, weights=nk[named], minlength=n).astype(np.int64)})
    return out.sort_values(["gpu_total_us", "cpu_total_us"], ascending=False, ignore_index=True, kind="stable")


@pytest.mark.parametrize("path", ALL_TRACES, ids=lambda p: p.name)
def test_top_level_ops_category_rollup_and_steps_are_the_pandas_reference(path):
    from tracelens.analysis import calltree as CT

    a = tracelens.analyze(tracelens.load(path, cache=False))
    for host_mask in (None, a.host_window):
        pd.testing.assert_frame_equal(S.top_level_ops(a.tree, a.gpu_window, host_mask=host_mask),
                                      _top_level_ops_reference(a.tree, a.gpu_window, host_mask=host_mask), check_exact=True)
    if not a.gpu.empty:
        pd.testing.assert_frame_equal(S._rank_category_sums(a.gpu),
                                      a.gpu.groupby(["rank", "category"], observed=True)["dur"].agg(["size", "sum"]).reset_index(),
                                      check_exact=True)
    s = a.tree.loc[a.tree["is_step"], ["rank", "step", "ts", "dur"]].astype({"step": np.int64})
    s = s.assign(end=s["ts"] + s["dur"]).rename(columns={"ts": "start"}).drop(columns="dur")
    ref = s.sort_values(["rank", "start"], kind="stable").drop_duplicates(["rank", "step"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(CT.steps_table(a.tree), ref, check_exact=True)

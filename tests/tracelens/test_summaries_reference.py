"""The summaries' grouping against the plain pandas and Python they replaced (same frames, exactly), on every
fixture trace: `annotation_summary` (grouped on codes, the GPU time of the paths below each summed per prefix)."""

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
    return out.sort_values(key, ascending=False, ignore_index=True)[cols]


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

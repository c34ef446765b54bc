"""`timeline.gpu_timeline(by_step=True)` computes every (rank, step) at once (a trace of thousands of
short steps): its figures equal plain per-step interval sweeps over random GPU events, and the rows,
values and dtypes equal the per-step loop (`_metrics`) it replaces."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tracelens.analysis import timeline as T

from ..conftest import merged_length


def _events(seed: int, n: int = 600) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rank = rng.integers(0, 3, n)
    step = rng.integers(-1, 6, n)  # -1: outside any step (left out)
    ts = rng.integers(0, 5_000, n) + step * 10_000 + rank * 7
    dur = rng.choice([0, 1, 5, 40, 300, 2_000], n)  # zero-length, touching and nested intervals
    kind = rng.choice(["kernel", "kernel", "memcpy", "memset"], n)
    return pd.DataFrame({"rank": rank.astype(np.int32), "step": step.astype(np.int64), "ts": ts.astype(np.int64),
                         "end": (ts + dur).astype(np.int64), "kind": pd.Categorical(kind),
                         "is_comm": rng.random(n) < 0.3})


def _loop(gpu: pd.DataFrame) -> pd.DataFrame:
    data = gpu[gpu["step"] >= 0][["rank", "step", "ts", "end", "kind", "is_comm"]]
    rows = []
    for key, g in data.groupby(["rank", "step"], sort=True, observed=True):
        rows.append({"rank": int(key[0]), "step": int(key[1]), **T._metrics(g)})
    return pd.DataFrame(rows, columns=T.TIMELINE_COLUMNS)


@pytest.mark.parametrize("seed", range(6))
def test_all_steps_at_once_equal_plain_sweeps_and_the_loop(seed):
    gpu = _events(seed)
    got = T.gpu_timeline(gpu, by_step=True)
    pd.testing.assert_frame_equal(got, _loop(gpu), check_exact=True)
    ns = lambda us: round(us * 1000)  # noqa: E731 - the table's µs back to the integer ns they came from
    for r in got.itertuples(index=False):
        g = gpu[(gpu["rank"] == r.rank) & (gpu["step"] == r.step)]
        iv = lambda m: list(zip(g["ts"][m], g["end"][m]))  # noqa: E731
        k = g["kind"] == "kernel"
        comm, comp = k & g["is_comm"], k & ~g["is_comm"]
        assert ns(r.gpu_busy_us) == merged_length(iv(g["ts"] == g["ts"]))
        assert ns(r.compute_us) == merged_length(iv(comp))
        assert ns(r.comm_us) == merged_length(iv(comm))
        assert ns(r.exposed_comm_us) == merged_length(iv(comp | comm)) - merged_length(iv(comp))
        assert ns(r.memcpy_us) == merged_length(iv(g["kind"] == "memcpy"))
        assert ns(r.span_us) == g["end"].max() - g["ts"].min() and r.kernel_count == int(k.sum())


def test_no_step_and_negative_durations_keep_the_loop_answer():
    gpu = _events(1)
    assert T.gpu_timeline(gpu.assign(step=-1), by_step=True).empty
    bad = gpu.copy()
    bad.loc[bad.index[:3], "end"] = bad["ts"].iloc[:3] - 5  # the loader drops these; the loop's answer stands
    pd.testing.assert_frame_equal(T.gpu_timeline(bad, by_step=True), _loop(bad), check_exact=True)

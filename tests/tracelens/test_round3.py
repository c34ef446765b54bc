"""`tracelens.numbers.round3`, summary.json's rounding over a column at once, gives exactly what `_num` (round(v, 3), None for
NaN) gives per value: the same floats, the same types, on values of every kind the step timeline holds and on the
edges of its shortcut (values already the nearest double to a number of thousandths)."""

from __future__ import annotations

import numpy as np

from tracelens.analyzer import _num
from tracelens.numbers import round3


def test_round3_is_num_per_value():
    rng = np.random.default_rng(7)
    vals = np.concatenate([
        rng.integers(0, 10**12, 20_000) / 1e3,  # ns / 1e3: the step timeline's times
        (rng.integers(0, 10**9, 20_000) * 7) / 3e3,  # sums and ratios that are not thousandths
        rng.random(20_000) * 1e6, rng.normal(0, 1e3, 10_000),
        rng.integers(-10**15, 10**15, 1_000) / 1e3,  # beyond 2**43 the shortcut is not taken
        np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 2.675, 0.0005, 1.0005, -1.0005, 2.0**43, 2.0**43 + 0.5, 2.0**60,
                  1e-320, 5e-324, 123456789.0125, 0.1 + 0.2, 1e15 / 1e3]),
    ])
    got = round3(vals)
    want = [_num(v) for v in vals.tolist()]
    assert len(got) == len(want)
    for v, g, w in zip(vals.tolist(), got, want):
        assert type(g) is type(w), v
        assert g == w or (g is None and w is None), (v, g, w)
        if w == 0.0:
            assert np.signbit(g) == np.signbit(w), v  # -0.0 stays -0.0
    assert round3(np.array([], dtype=float)) == []

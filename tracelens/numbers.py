"""Numbers as summary.json writes them: rounded to 3 decimals (µs to the ns), NaN as null.

`round3` does for a whole column what `round(v, 3)` with NaN as None does per value, with the same floats (the
analyzer's `_num` per value; a trace of 80,000 profiler steps has a million such values)."""

from __future__ import annotations

import numpy as np


def round3_array(a: np.ndarray) -> np.ndarray:
    """`round3` as a float array: round(v, 3) per value, NaN kept (summary.json's null). A value that is already the
    double nearest to a number of thousandths (v == rint(1000 v) / 1000: most of the step timeline's, times in ns /
    1e3) is its own round(v, 3), since the nearest 3-decimal number to it is that one; only the others go through
    `round`. (`tracelens.records.Records` holds such columns.)"""
    a = np.asarray(a, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        own = (np.rint(a * 1000.0) / 1000.0 == a) & (np.abs(a) < 2.0**43)
    others = np.flatnonzero(~own)
    if not len(others):
        return a
    out = a.copy()
    out[others] = [v if v != v else round(v, 3) for v in a[others].tolist()]
    return out


def round3(a: np.ndarray) -> list[float | None]:
    """`[_num(v) for v in a]` (tracelens.analyzer) for a float array: round(v, 3) per value, None for NaN
    (`round3_array`'s values as a list)."""
    r = round3_array(a)
    out = r.tolist()
    for i in np.flatnonzero(np.isnan(r)).tolist():
        out[i] = None
    return out

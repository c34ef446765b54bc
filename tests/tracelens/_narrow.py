"""The narrowest integer type the loader should pick for a column's raw values (its rule, restated)."""

from __future__ import annotations

import numpy as np


def narrowest(values: list[int]) -> np.dtype:
    lo, hi = min(values), max(values)
    for t in (np.int8, np.int16, np.int32):
        if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max:
            return np.dtype(t)
    return np.dtype(np.int64)

"""Interval arithmetic on [start, end) int64 nanosecond intervals, vectorized with numpy.

Overlap questions ("how much communication is not hidden under compute?") are answered with unions,
never with sums of durations: |A - B| = |A u B| - |B| and |A n B| = |A| + |B| - |A u B|.
"""

from __future__ import annotations

import numpy as np


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint, sorted intervals covering the same points as the input intervals."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if starts.size == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    run_end = np.maximum.accumulate(e)
    # a new segment begins where an interval starts after everything before it has ended
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    first = np.flatnonzero(new)
    last = np.empty_like(first)  # each segment's last interval: the one before the next segment's first
    last[:-1] = first[1:] - 1
    last[-1] = s.size - 1
    return s[first], run_end[last]


def length(starts: np.ndarray, ends: np.ndarray) -> int:
    """Total length of the union of the intervals."""
    s, e = union(starts, ends)
    return int((e - s).sum())


def union_length(*sets: tuple[np.ndarray, np.ndarray]) -> int:
    """Length of the union of several interval sets."""
    if not sets:
        return 0
    return length(np.concatenate([s for s, _ in sets]), np.concatenate([e for _, e in sets]))


def clip(starts: np.ndarray, ends: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Intervals cut to [lo, hi); empty ones dropped."""
    s = np.minimum(np.maximum(starts, lo), hi)  # (np.clip's semantics, without its per-call overhead)
    e = np.minimum(np.maximum(ends, lo), hi)
    keep = e > s
    return s[keep], e[keep]


def gaps(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The holes between the union's segments (idle periods), as intervals."""
    s, e = union(starts, ends)
    if s.size < 2:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return e[:-1], s[1:]

"""Theoretical pipeline bubble per schedule, as the analyzer reports it.

The theory (formulas, schedule names and aliases) is `moespec.schedules`, shared with the trainer; this
module gives it the analyzer's error type (`TraceError`, one line) and the table `tracelens bubble`
prints. GA = global batch tokens / (seq x micro-batch x DP), DP = world / (PP x TP x CP); expert
parallelism sits inside DP and does not change it.
"""

from __future__ import annotations

import math

import pandas as pd

from moespec import schedules as S

from ..errors import TraceError


def bubble_ratio(schedule: str, pp: int, m: int, vpp: int = 1) -> float:
    """`moespec.schedules.bubble_ratio`; a bad schedule or size is a `TraceError`."""
    try:
        return S.bubble_ratio(schedule, pp, m, vpp)
    except S.ScheduleError as e:
        raise TraceError(None, str(e)) from None


def gradient_accumulation(global_tokens: int, seq_len: int, mbs: int, world: int, pp: int = 1, tp: int = 1,
                          cp: int = 1) -> tuple[int, int]:
    """(GA, DP) from the global batch in tokens (`moespec.schedules.gradient_accumulation`); errors when the
    numbers do not divide."""
    try:
        return S.gradient_accumulation(global_tokens, seq_len, mbs, world, pp, tp, cp)
    except S.ScheduleError as e:
        raise TraceError(None, str(e)) from None


def bubble_table(pp: int, m: int, vpp: int = 1) -> pd.DataFrame:
    rows = []
    for s in S.MODELED:
        v = vpp if s == "vpp" else 1
        rows.append({"schedule": s, "pp": pp, "vpp": v, "microbatches": m, "bubble_ratio": bubble_ratio(s, pp, m, v)})
    return pd.DataFrame(rows)


def fmt_pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"

"""Theoretical pipeline bubble: the share of a step that pipeline stages sit idle, per schedule.

With p stages, m microbatches per step (gradient accumulation) and v virtual stages per rank, and the
usual unit costs forward = backward-for-inputs = backward-for-weights (F = B = W = 1, so a microbatch
costs 3 on each stage):
    gpipe, 1f1b          (p - 1) / (m + p - 1)
    interleaved (vpp)    (p - 1) / (v*m + p - 1)            (Narayanan et al., 2021)
    zb1p (ZB-H1)         (p - 1) / (3m + p - 1)             a third of 1F1B's idle time (Qi et al., 2024)
    zbv / zb2p           0 once m >= 2p (the schedules fill the bubble with W passes; memory permitting);
                         with fewer microbatches it is not modelled here (reported as n/a)
Ratios are of the step's wall time. GA = global batch tokens / (seq x micro-batch x DP), DP = world /
(PP x TP x CP); expert parallelism sits inside DP and does not change it.
"""

from __future__ import annotations

import math

import pandas as pd

from ..errors import TraceError

SCHEDULES = ("gpipe", "1f1b", "vpp", "zb1p", "zbv")


def bubble_ratio(schedule: str, pp: int, m: int, vpp: int = 1) -> float:
    if pp < 1 or m < 1 or vpp < 1:
        raise TraceError(None, f"bubble: pp, microbatches and vpp must be >= 1 (got pp={pp}, m={m}, vpp={vpp})")
    idle = pp - 1
    if schedule in ("gpipe", "1f1b"):
        return idle / (m + idle)
    if schedule in ("vpp", "interleaved", "interleaved1f1b"):
        return idle / (vpp * m + idle)
    if schedule in ("zb1p", "zbh1"):
        return idle / (3 * m + idle)
    if schedule in ("zbv", "zb2p", "zbh2"):
        return 0.0 if m >= 2 * pp else math.nan  # below 2p microbatches: not modelled (n/a)
    raise TraceError(None, f"bubble: unknown schedule {schedule!r} (one of {', '.join(SCHEDULES)})")


def gradient_accumulation(global_tokens: int, seq_len: int, mbs: int, world: int, pp: int = 1, tp: int = 1,
                          cp: int = 1) -> tuple[int, int]:
    """(GA, DP) from the global batch in tokens; errors when the numbers do not divide."""
    model_parallel = pp * tp * cp
    if world % model_parallel:
        raise TraceError(None, f"bubble: world size {world} is not divisible by pp*tp*cp = {model_parallel}")
    dp = world // model_parallel
    per_step = seq_len * mbs * dp
    if global_tokens % per_step:
        raise TraceError(None, f"bubble: global tokens {global_tokens} are not a multiple of seq*mbs*dp = {per_step}")
    return global_tokens // per_step, dp


def bubble_table(pp: int, m: int, vpp: int = 1) -> pd.DataFrame:
    rows = []
    for s in SCHEDULES:
        v = vpp if s == "vpp" else 1
        rows.append({"schedule": s, "pp": pp, "vpp": v, "microbatches": m, "bubble_ratio": bubble_ratio(s, pp, m, v)})
    return pd.DataFrame(rows)


def fmt_pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"

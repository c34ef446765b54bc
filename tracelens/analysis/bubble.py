"""Theoretical pipeline bubble per schedule, as the analyzer reports it.

The theory (formulas, schedule names and aliases) is `moespec.schedules`, shared with the trainer; this
module gives it the analyzer's error type (`TraceError`, one line) and the table `tracelens bubble`
prints. GA = global batch tokens / (seq x micro-batch x DP), DP = world / (PP x TP x CP); expert
parallelism sits inside DP and does not change it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass
class BubbleReport:
    """The theoretical bubble of every modeled schedule for one pipeline shape: what `tracelens bubble`
    prints. Built by :func:`bubble_report`."""

    pp: int
    microbatches: int  # per step (GA)
    vpp: int
    table: pd.DataFrame  # bubble_table
    derivation: str = ""  # how GA was derived from the global batch, when it was

    def to_dict(self) -> dict:
        """JSON-ready: the shape and each schedule's bubble ratio (null: not modelled for this shape)."""
        return {"schema_version": 1, "pp": self.pp, "vpp": self.vpp, "microbatches": self.microbatches,
                "derivation": self.derivation or None,
                "schedules": [{**r, "bubble_ratio": None if math.isnan(r["bubble_ratio"]) else r["bubble_ratio"]}
                              for r in self.table.to_dict("records")]}

    def to_text(self) -> str:
        lines = [self.derivation] if self.derivation else []
        na = []
        for r in self.table.itertuples(index=False):
            extra = f", vpp {r.vpp}" if r.vpp > 1 else ""
            lines.append(f"{r.schedule:<6} pp {r.pp}, {r.microbatches} microbatches{extra}: bubble {fmt_pct(r.bubble_ratio)}")
            if math.isnan(r.bubble_ratio):
                na.append(r.schedule)
        if "zbv" in na:
            lines.append(f"n/a: zbv (zero-bubble V schedule) reaches no bubble only with at least 2 x pp = {2 * self.pp} "
                         f"microbatches; with {self.microbatches} its bubble is not modelled here")
        return "\n".join(lines)


def bubble_report(pp: int, vpp: int = 1, ga: int | None = None, *, global_tokens: int | None = None,
                  seq: int | None = None, mbs: int = 1, world: int | None = None, tp: int = 1,
                  cp: int = 1) -> BubbleReport:
    """Bubbles for ``ga`` microbatches per step, or for the GA that a global batch of ``global_tokens``
    gives (with ``seq``, ``world``, ``mbs``, ``tp``, ``cp``; then the report says how)."""
    derivation = ""
    if ga is None:
        if not (global_tokens and seq and world):
            raise TraceError(None, "bubble: give the microbatches, or the global tokens with the sequence length "
                             "and the world size")
        ga, dp = gradient_accumulation(global_tokens, seq, mbs, world, pp, tp, cp)
        derivation = (f"DP = {world} / (pp {pp} x tp {tp} x cp {cp}) = {dp}; "
                      f"GA = {global_tokens} / ({seq} x {mbs} x {dp}) = {ga}")
    return BubbleReport(pp=pp, microbatches=ga, vpp=vpp, table=bubble_table(pp, ga, vpp), derivation=derivation)

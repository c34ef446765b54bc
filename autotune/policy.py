"""The guided search's policy: from one trial's findings and signals to the knob changes worth trying.

A pure function (no trainer, no files): :func:`propose` takes the knobs of the space, the current best
point, its tracelens findings (``tracelens.analysis.findings``: list of dicts, or the table of them)
and the signals the runner measured (:func:`autotune.runner.signals_of` + memory and pipeline
signals), and returns :class:`Move` s, most promising first: moves from findings in the findings' own
order (severity, then recoverable time), then moves from signals. Every move changes one knob and
says which finding or signal motivated it.

Knob value lists are ordered: "raise" a knob means the values after the current one in its list,
nearest first; "lower" the values before it, nearest first; "switch" every other value in list order.

    finding / signal                                          move
    host_sync in the MoE path (op path or stack has moe/expert)  raise sync_free_level
    launch_bound (GPU idle waiting for launches)              from a per-expert backend: grouped backends first;
                                                              then raise sync_free_level, then the other grouped
                                                              backends (never a per-expert one: more launches)
    small_kernels (most kernels under 10 us)                  switch grouped_gemm_backend, grouped ones first
    exposed_comm (communication not hidden), at ep > 1        raise ep_dispatch (nccl -> capacity -> symm), raise
                                                              ep_overlap; with the overlap on, raise
                                                              ep_overlap_chunks, then ep_overlap_schedule
    signal moe_sync_ops / moe_host_syncs > 0                  raise sync_free_level
    signal expert_gemms_per_call > 4 (per-expert loop)        switch grouped_gemm_backend, grouped ones first
    signal expert_gemm_pct_roof < gemm_roof_pct (default 50)  switch grouped_gemm_backend
    signal bubble_ratio above theory (+10 % and +0.02)        switch pipeline_schedule, raise vpp, raise microbatches
    signal stage_imbalance > 1.10                             switch pipeline_layout
    signal memory_used_share > 0.90 (near OOM)                raise recompute_layer_ids, lower micro_batch_size
    signal memory_used_share < 0.50 (headroom)                raise micro_batch_size
    step-time spread (p90-p10)/median > 10 %                  switch manual_gc

"Per-expert" backends (``loop``, ``multistream``: one GEMM launch per local expert, see kernels/backends.py)
are the cause of a launch-bound MoE layer, not its cure: the launch-side moves go to the grouped backends
(one launch for all experts) first. On the H100 single-GPU proxy this ordering takes the guided search
from the per-expert loop to the grid's best region in 6 trials instead of 11.

A knob the space does not list is skipped. :func:`explore_moves` gives the one-knob neighbours the
sweep may try when no finding is left (``guided.explore``, default 0: stop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moespec.backends import PER_EXPERT_BACKENDS  # one GEMM launch per local expert

SPREAD_LIMIT = 0.10
GEMMS_PER_CALL = 4.0  # a per-expert loop issues >= one GEMM per local expert; a grouped GEMM 2-3
NEAR_OOM = 0.90
HEADROOM = 0.50
BUBBLE_SLACK = (1.10, 0.02)  # measured > theory * 1.10 + 0.02
IMBALANCE = 1.10


@dataclass(frozen=True)
class Move:
    point: dict
    knob: str
    value: Any
    source: str  # the finding type or signal name, or "explore"
    motivation: str  # one line for the report

    def as_dict(self) -> dict:
        return {"knob": self.knob, "value": self.value, "source": self.source, "motivation": self.motivation}


def _records(findings: Any) -> list[dict]:
    if findings is None:
        return []
    if hasattr(findings, "to_dict"):  # a pandas table of findings
        findings = findings.to_dict("records")
    out = []
    for f in findings:
        ev = f.get("evidence")
        out.append({**f, "evidence": ev if isinstance(ev, dict) else {"text": str(ev or "")}})
    return out


def _in_moe(evidence: dict) -> bool:
    where = " ".join(str(evidence.get(k, "")) for k in ("path", "python_stack", "text")).lower()
    return "moe" in where or "expert" in where


class _Builder:
    def __init__(self, knobs: dict[str, list], current: dict):
        self.knobs, self.cur = knobs, dict(current)
        self.moves: list[Move] = []
        self.seen: set = set()

    def _add(self, knob: str, values: list, source: str, why: str) -> None:
        for v in values:
            point = {**self.cur, knob: v}
            key = (knob, repr(v))
            if v == self.cur.get(knob) or key in self.seen:
                continue
            self.seen.add(key)
            self.moves.append(Move(point, knob, v, source, f"{why} -> {knob}={v}"))

    def _index(self, knob: str) -> int | None:
        vals = self.knobs.get(knob)
        if vals is None or knob not in self.cur:
            return None
        try:
            return vals.index(self.cur[knob])
        except ValueError:
            return None

    def raise_(self, knob: str, source: str, why: str) -> None:
        i = self._index(knob)
        if i is not None:
            self._add(knob, self.knobs[knob][i + 1:], source, why)

    def lower(self, knob: str, source: str, why: str) -> None:
        i = self._index(knob)
        if i is not None:
            self._add(knob, self.knobs[knob][:i][::-1], source, why)

    def switch(self, knob: str, source: str, why: str) -> None:
        if self._index(knob) is not None:
            self._add(knob, self.knobs[knob], source, why)

    def switch_grouped(self, source: str, why: str, only: bool = False) -> None:
        """Switch grouped_gemm_backend, grouped backends first (``only``: no per-expert ones at all)."""
        knob = "grouped_gemm_backend"
        if self._index(knob) is not None:
            vals = self.knobs[knob]
            grouped = [v for v in vals if v not in PER_EXPERT_BACKENDS]
            self._add(knob, grouped if only else grouped + [v for v in vals if v in PER_EXPERT_BACKENDS], source, why)


def propose(knobs: dict[str, list], current: dict, findings: Any = None, signals: dict | None = None,
            metrics: dict | None = None, gemm_roof_pct: float = 50.0) -> list[Move]:
    """Moves from the current point, most promising first (see the module docstring for the rules)."""
    b = _Builder(knobs, current)
    sig = dict(signals or {})
    if metrics and not sig and isinstance(metrics.get("signals"), dict):
        sig = dict(metrics["signals"])
    gpc = float(sig.get("expert_gemms_per_call") or 0.0)
    per_expert = current.get("grouped_gemm_backend") in PER_EXPERT_BACKENDS or gpc > GEMMS_PER_CALL
    for f in _records(findings):
        kind, ev = f.get("type"), f["evidence"]
        label = f"finding {kind} ({f.get('severity', '?')}): {f.get('title', '')}"
        if kind == "host_sync":
            if _in_moe(ev):
                b.raise_("sync_free_level", kind, label)
        elif kind == "launch_bound":
            if per_expert:  # E launches per expert GEMM -> one
                b.switch_grouped(kind, label, only=True)
            b.raise_("sync_free_level", kind, label)  # fewer host syncs and host-side work between launches
            b.switch_grouped(kind, label, only=True)
        elif kind == "small_kernels":
            b.switch_grouped(kind, label)
        elif kind == "exposed_comm" and current.get("ep", 2) != 1:  # at ep=1 no token travels (ep not a knob: try)
            b.raise_("ep_dispatch", kind, label)  # capacity, symm: the bytes on the wire scale with the routed rows
            b.raise_("ep_overlap", kind, label)  # the all-to-alls behind the shared expert and the next chunk
            if current.get("ep_overlap") is True:
                b.raise_("ep_overlap_chunks", kind, label)
                b.raise_("ep_overlap_schedule", kind, label)  # chunked -> pipelined: the shared expert at both ends
    syncs = max(int(sig.get("moe_sync_ops") or 0), int(sig.get("moe_host_syncs") or 0))
    if syncs > 0:
        b.raise_("sync_free_level", "moe_sync_ops", f"signal: {syncs} host-sync op(s) in the MoE layer")
    if gpc > GEMMS_PER_CALL:
        b.switch_grouped("expert_gemms_per_call",
                 f"signal: {gpc:.0f} GEMMs per moe/experts call (one per expert: many small expert GEMMs)")
    roof = sig.get("expert_gemm_pct_roof")
    if isinstance(roof, (int, float)) and roof < gemm_roof_pct:
        b.switch("grouped_gemm_backend", "expert_gemm_pct_roof",
                 f"signal: expert GEMMs at {roof:.0f}% of roofline (< {gemm_roof_pct:g}%)")
    bub, theory = sig.get("bubble_ratio"), sig.get("bubble_theory")
    if isinstance(bub, (int, float)):
        limit = (theory * BUBBLE_SLACK[0] + BUBBLE_SLACK[1]) if isinstance(theory, (int, float)) else None
        if limit is not None and bub > limit:
            why = f"signal: pipeline bubble {100 * bub:.0f}% above theory {100 * theory:.0f}%"
            b.switch("pipeline_schedule", "bubble_ratio", why)
            b.raise_("vpp", "bubble_ratio", why)
            b.raise_("microbatches", "bubble_ratio", why)
    imb = sig.get("stage_imbalance")
    if isinstance(imb, (int, float)) and imb > IMBALANCE:
        b.switch("pipeline_layout", "stage_imbalance", f"signal: busiest pipeline stage {imb:.2f}x the mean")
    used = sig.get("memory_used_share")
    if isinstance(used, (int, float)):
        if used > NEAR_OOM:
            why = f"signal: peak memory {100 * used:.0f}% of capacity (near OOM)"
            b.raise_("recompute_layer_ids", "memory_used_share", why)
            b.lower("micro_batch_size", "memory_used_share", why)
        elif used < HEADROOM:
            b.raise_("micro_batch_size", "memory_used_share",
                     f"signal: peak memory {100 * used:.0f}% of capacity (headroom for a larger micro-batch)")
    spread = float((metrics or {}).get("spread") or 0.0)
    if spread > SPREAD_LIMIT:
        b.switch("manual_gc", "spread", f"signal: step-time spread {100 * spread:.0f}% (GC pauses?)")
    return b.moves


def explore_moves(knobs: dict[str, list], current: dict) -> list[Move]:
    """Every one-knob change of ``current``, knobs and values in the space's order."""
    b = _Builder(knobs, current)
    for k in knobs:
        b.switch(k, "explore", f"no finding left: check {k}")
    return b.moves

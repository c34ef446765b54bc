"""The verdict: what to change first and what it buys, from an analysis's results.

Every report opens with it and `tracelens analyze` prints it (issue 36):

* the step in one bar: where one step's time goes (the step decomposition's components, mean over ranks;
  without a decomposition the GPU timeline's parts);
* the bottleneck, named in one sentence: the largest part of the bar, compute components one by one and
  the losses grouped (pipeline bubble, waiting for the slowest rank, exposed communication, the host), with
  the finding that explains it;
* the top three actions, each with its evidence (the motivating finding or step part, in words and
  numbers), the what-if's predicted gain with its uncertainty and memory verdict ("micro_batch_size 4 -> 16:
  +58% ± 15%, fits in 53.0 GiB of 79.2 GiB") and the commands that check it (`tracelens whatif RUN --set
  k=v`, and the trainer's own command with the change, to measure it); where the what-if cannot predict
  (no run manifest, no mechanism for what the finding asks), one line says so and the finding's own
  estimate of the recoverable time stands in its place;
* the health warnings that invalidate a figure, and the findings as sentences with their numbers.

Pure functions of tables and records: `step_of(decomposition, timeline)`, `bottleneck(step, findings)`,
`candidates(findings, step, context)` (the knob changes worth predicting, each with its motive),
`verdict(findings, health, step, candidates, outcomes, context)`. The what-if itself (a projection) is
run by the caller, `tracelens.analyzer`'s `verdict` entry, which hands each candidate's outcome in:
``{"gain", "uncertainty", "fits", "peak_gib", "capacity_gib", "step_s", "base_step_s"}`` or ``{"error"}``.
This module imports no projection (the `analysis-is-tables` contract): the decomposition's component
names below are those of `tracelens.projection.profile.COMPONENTS` (a test checks they agree).
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd

from moespec.backends import PER_EXPERT_BACKENDS
from moespec.config import DEFAULTS

# the decomposition's components (tracelens.projection.profile.COMPONENTS) by what they are
COMPUTE = ("expert GEMMs", "dense GEMMs", "attention", "norms/activations", "optimizer step", "copies/casts")
KIND = {**{c: "compute" for c in COMPUTE}, "exposed communication": "communication", "collective waits": "wait",
        "sync waits": "host", "launch-bound idle": "host", "pipeline bubble": "bubble", "other": "other"}
# the losses the bottleneck names, each with the components it sums and the findings that explain it
LOSSES = {
    "pipeline bubble": (("pipeline bubble",), ("pipeline_bubble",),
                        "the pipeline bubble (stages idle while they wait for their neighbours)"),
    "waits": (("collective waits",), ("late_rank", "sync_wait"),
              "waiting for the slowest rank inside collectives"),
    "communication": (("exposed communication",), ("exposed_comm",), "communication not hidden by compute"),
    "host": (("launch-bound idle", "sync waits"), ("launch_bound", "host_sync", "small_kernels"),
             "the host: the GPU idles waiting for kernel launches and blocking syncs"),
}
# without a decomposition the GPU timeline's idle is one part of unknown cause: a loss all the same (a step 74 %
# idle is not "compute-bound"), with the host's findings as the likely explanation
TIMELINE_LOSSES = {
    "idle": (("idle",), ("launch_bound", "host_sync", "small_kernels"),
             "the GPU sitting idle (no step decomposition to split it by cause; the findings name the likely ones)"),
}
# the GPU timeline's parts (tracelens.analysis.timeline), the bar without a decomposition
TIMELINE_PARTS = (("compute", "compute_us", "compute"), ("exposed communication", "exposed_comm_us", "communication"),
                  ("collective waits", "comm_wait_us", "wait"), ("pipeline bubble", "pipeline_wait_us", "bubble"),
                  ("memcpy", "excl_memcpy_us", "compute"), ("memset", "excl_memset_us", "compute"),
                  ("idle", "gpu_idle_us", "other"))
MIN_GAIN = 0.01  # a predicted gain under 1% is no action
N_ACTIONS = 3
MICRO_BATCH_FACTORS = (2, 4)


# ------------------------------------------------------------------------------------------ numbers in words
def ms(us: float | None) -> str:
    """Microseconds as milliseconds with 3-4 significant digits ("2.045 ms", "148.4 ms", "1,417 ms")."""
    if us is None or not math.isfinite(us):
        return "–"
    v = us / 1e3
    a = abs(v)
    digits = 0 if a >= 1000 else 1 if a >= 100 else 2 if a >= 10 else 3
    return f"{v:,.{digits}f} ms"


def pct(share: float | None, signed: bool = False) -> str:
    """A share as a percentage ("19%", "7.5%", "0.3%"; ``signed``: "+58%")."""
    if share is None or not math.isfinite(share):
        return "–"
    v = 100.0 * share
    digits = 1 if abs(v) < 10 else 0
    v = round(v, digits) + 0.0  # a value that rounds to zero reads "+0.0%", not "-0.0%"
    return f"{v:{'+' if signed else ''}.{digits}f}%"


def gib(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "–"
    return f"{v * 1024:.0f} MiB" if v < 1 else f"{v:.1f} GiB"


def _op(name: Any) -> str:
    return str(name) if name not in (None, "") else "(no op)"


def _top(d: dict | None, n: int = 3, fmt=ms) -> str:
    items = sorted(((k, v) for k, v in (d or {}).items() if isinstance(v, (int, float))), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{_op(k)} ({fmt(v)})" for k, v in items)


def _per_rank_range(d: dict | None) -> str:
    vals = [float(v) for v in (d or {}).values() if isinstance(v, (int, float))]
    if not vals:
        return "–"
    lo, hi = min(vals), max(vals)
    return ms(lo) if math.isclose(lo, hi, rel_tol=0.005) else f"{ms(lo)[:-3]}–{ms(hi)}"


# ------------------------------------------------------------------------------------------ findings as sentences
def finding_sentence(f: dict) -> str:
    """A finding's evidence in words with its numbers (what the title does not already say). Never a
    key=value dump: a type without its own sentence gets its title's numbers only."""
    t, ev = f.get("type"), f.get("evidence") or {}
    try:
        if t == "host_sync":
            where = f"In {ev['path']}, over" if ev.get("path") else "Over"
            return (f"{where} the analysed steps the host waited {ms(ev.get('host_blocked_us'))} in these syncs and the "
                    f"GPU then sat idle {ms(ev.get('gpu_idle_caused_us'))} (all ranks): {ms(f.get('recoverable_us'))} "
                    "per rank.")
        if t == "launch_bound":
            return (f"{ev.get('gaps')} idle gaps of the GPU waiting for the next launch, {ms(ev.get('idle_us_per_rank'))} "
                    f"per rank; most before {_top(ev.get('top_ops'))} (summed over ranks).")
        if t == "small_kernels":
            ops = ", ".join(f"{_op(k)} ({v:,})" for k, v in list((ev.get("ops") or {}).items())[:3])
            return (f"{pct(ev.get('small_share'))} of the kernels but only {pct(ev.get('small_time_share'))} of kernel "
                    f"time: launch overhead, not work, sets their pace; most from {ops}.")
        if t == "sync_wait":
            # its amount is the family's waits the late_rank finding does not claim (each wait counted once)
            late = (f" (of the family's {ms(ev.get('sync_us_per_rank'))} of waiting, {ms(ev.get('late_rank_us_per_rank'))} "
                    f"is rank {ev.get('late_rank')}'s: its late_rank finding)") if ev.get("late_rank_us_per_rank") else ""
            return (f"In {ev.get('family')}, each rank waits {ms(f.get('recoverable_us'))} for the last rank to "
                    f"arrive and communicates {ms(ev.get('comm_us_per_rank'))}; rank {ev.get('straggler_rank')} "
                    f"arrives last most often{late}.")
        if t == "late_rank":
            # the title names the largest part of the late rank's extra work; the others, when they count
            n = max(int(ev.get("instances") or 1), 1)
            parts = {k: v / n for k, v in (ev.get("excess_us_by_part") or {}).items() if isinstance(v, (int, float))}
            total = sum(v for v in parts.values() if v > 0)
            rest = sorted(((k, v) for k, v in parts.items() if v > 0.05 * total), key=lambda kv: -kv[1])[1:3]
            if not rest:
                return ""
            return "Its extra work per late collective also: " + ", ".join(f"{_cause(k)} {ms(v)}" for k, v in rest) + "."
        if t == "exposed_comm":
            s = f"Transfer time not overlapped by compute: {_per_rank_range(ev.get('per_rank'))} per rank"
            if ev.get("wait_us_per_rank"):
                s += (f"; the ranks' waits for one another ({_per_rank_range(ev.get('wait_us_per_rank'))} per rank) "
                      "are not in it")
            return s + "."
        if t == "pipeline_bubble":
            th, im = ev.get("theory_us_per_rank") or {}, ev.get("imbalance_us_per_rank") or {}
            mean = lambda d: sum(d.values()) / len(d) if d else float("nan")
            sched = f" of {ev['schedule']}" if ev.get("schedule") else ""
            return (f"Per rank and step: the schedule's fill and drain{sched} {ms(mean(th))}, waiting on slower "
                    f"stages {ms(mean(im))} (mean of {len(th)} ranks; stage imbalance per rank "
                    f"{_per_rank_range(im)}).")
        if t == "moe_padding":
            return (f"{pct(ev.get('padding_share_rows'))} of the rows are padding: {ev.get('rows_per_call', 0):,} rows "
                    f"per grouped-GEMM call for {ev.get('routed_rows_per_call', 0):,} routed; the token all-to-alls "
                    f"carry {pct(ev.get('a2a_padding_share_bytes'))} padding bytes.")
        if t == "host_hotspot":
            nxt = _top(ev.get("next_families"), 3)
            return (f"Host self time per step: {_top(ev.get('ops_us_per_step'), 3)}"
                    + (f"; next: {nxt}" if nxt else "") + ".")
        if t == "moe_stages":
            return f"Host time per step: {_top(ev.get('stages_us_per_step'), 4)} (forward pass only)."
        if t == "profiler_overhead":
            return (f"Profiled median {ms(ev.get('profiled_median_us'))} vs unprofiled "
                    f"{ms(ev.get('unprofiled_median_us'))}.")
    except (TypeError, ValueError, KeyError, ZeroDivisionError):
        pass
    return ""


# ------------------------------------------------------------------------------------------ the step in one bar
@dataclass(frozen=True)
class Part:
    name: str
    us: float
    share: float
    kind: str  # compute / communication / wait / host / bubble / other


@dataclass(frozen=True)
class Step:
    parts: tuple[Part, ...]
    step_us: float
    ranks: int
    basis: str  # calibrated (measured step, modeled split) / replay (traced step) / timeline (GPU window)
    note: str

    def part(self, name: str) -> Part | None:
        return next((p for p in self.parts if p.name == name), None)

    def text(self, top: int = 6) -> str:
        shown = sorted((p for p in self.parts if p.share >= 0.005), key=lambda p: -p.us)[:top]
        over = {"calibrated": "measured mean step", "replay": "traced step, replayed",
                "timeline": "GPU time over the analysed window"}[self.basis]
        ranks = f", mean of {self.ranks} ranks" if self.ranks > 1 else ""
        return (f"{ms(self.step_us)} ({over}{ranks}): " + " | ".join(f"{p.name} {pct(p.share)}" for p in shown))


def step_of(decomposition: pd.DataFrame | None, timeline: pd.DataFrame | None = None) -> Step | None:
    """The step in one bar: the decomposition's components, mean over ranks (ms per step), else the GPU
    timeline's parts over the window (mean over ranks); None with neither."""
    d = decomposition
    if d is not None and len(d) and {"rank", "component", "ms"} <= set(d.columns):
        per = d.groupby("component", sort=False)["ms"].sum() / d["rank"].nunique()
        total = float(per.sum())
        if total > 0:
            parts = tuple(Part(str(c), 1e3 * float(v), float(v) / total, KIND.get(str(c), "other"))
                          for c, v in per.items() if v > 0)
            basis = str(d.attrs.get("basis") or (d["basis"].iloc[0] if "basis" in d else "replay"))
            return Step(parts, 1e3 * total, int(d["rank"].nunique()), basis if basis in ("calibrated", "replay") else "replay",
                        str(d.attrs.get("note", "")))
    tl = timeline
    if tl is not None and len(tl) and "span_us" in tl:
        vals = [(name, float(tl[col].mean()), kind) for name, col, kind in TIMELINE_PARTS if col in tl]
        total = sum(v for _, v, _ in vals)
        if total > 0:
            return Step(tuple(Part(n, v, v / total, k) for n, v, k in vals if v > 0), total, int(tl["rank"].nunique()),
                        "timeline", "the GPU timeline's parts over the analysed window (no step decomposition)")
    return None


def _loss_groups(step: Step) -> list[tuple[str, float, str, tuple[str, ...]]]:
    """(group, µs, phrase, finding types) of every loss and every compute component, largest first."""
    out = []
    losses = {**LOSSES, **TIMELINE_LOSSES} if step.basis == "timeline" else LOSSES
    for g, (comps, types, phrase) in losses.items():
        us = sum(p.us for p in step.parts if p.name in comps)
        if us > 0:
            out.append((g, us, phrase, types))
    for p in step.parts:
        if p.kind == "compute":
            out.append((p.name, p.us, p.name, ("moe_padding",) if p.name == "expert GEMMs" else ()))
    return sorted(out, key=lambda x: -x[1])


def bottleneck(step: Step | None, findings: list[dict]) -> tuple[str, str | None]:
    """The bottleneck in one sentence, and the name of the step part or loss it is (None without a step):
    the largest part of the step (compute components one by one, the losses grouped; "other" only when it
    is all there is), with the finding that explains it; without a step, the first finding's title."""
    if step is None or not step.parts:
        if findings:
            return f"Largest finding: {findings[0]['title']}.", None
        return "No bottleneck found: no step to decompose and no finding.", None
    groups = _loss_groups(step)
    if not groups:
        other = step.part("other")
        text = (f"No known kind of work or idle: {pct(other.share if other else 1.0)} of the step is other time "
                "(work of no known kind, idle of no known cause).")
        return text, "other"
    name, us, phrase, types = groups[0]
    share = us / step.step_us
    size = f"{pct(share)} of the {ms(step.step_us)} step"
    why = next((f for f in findings if f.get("type") in types), None)
    if name in LOSSES or name in TIMELINE_LOSSES:
        head = f"The step loses the most to {phrase}: {size}"
    else:
        busy = sum(p.us for p in step.parts if p.kind == "compute") / step.step_us
        verb = "take" if name.endswith("s") else "takes"
        head = f"Compute-bound: {'the ' if verb == 'takes' else ''}{name} {verb} {size} (all computation {pct(busy)})"
    tail = ""
    if why is not None:
        clause = why["title"].split("; ")[0]
        tail = f"; in the profiled step, {clause}" if step.basis == "calibrated" else f"; {clause}"
    return head + tail + ".", name


# ------------------------------------------------------------------------------------------ what to try
@dataclass(frozen=True)
class Context:
    """What the verdict knows of the run: its config and world (None: not a trainer run dir), where it is,
    the command that made it, and why the what-if cannot predict (None: it can)."""

    config: dict | None = None
    world: int = 1
    run: str | None = None  # the run dir as the commands should name it
    argv: tuple[str, ...] | None = None  # the trainer's command line (manifest versions.argv)
    device: str | None = None  # cpu / cuda (manifest device.type)
    peak_gib: float | None = None  # the run's measured peak memory (max over ranks; device memory only)
    capacity_gib: float | None = None  # the device memory the what-if fits against
    why_no_model: str | None = None


@dataclass(frozen=True)
class Candidate:
    changes: dict
    motive: str  # the finding type or step part that motivates it (one action per motive)
    evidence: str  # that motive in words with its numbers
    current: dict = field(default_factory=dict)  # the run's value of each changed key

    @property
    def key(self) -> str:
        return ", ".join(f"{k}={_yaml(v)}" for k, v in self.changes.items())

    def label(self, arrow: str = "->") -> str:
        return ", ".join(f"{k} {_yaml(self.current.get(k))} {arrow} {_yaml(v)}" for k, v in self.changes.items())


def _yaml(v: Any) -> str:
    """A value as the trainer's `--set` reads it (YAML flow)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_yaml(x) for x in v) + "]"
    return str(v)


def _moves(f: dict, cfg: dict) -> list[dict]:
    """The trainer knobs the what-if models that address one finding, from the run's config."""
    t, ev = f.get("type"), f.get("evidence") or {}
    ep, pp = int(cfg.get("ep") or 1), int(cfg.get("pp") or 1)
    level = int(cfg.get("sync_free_level") or 0)
    per_expert = cfg.get("grouped_gemm_backend") in PER_EXPERT_BACKENDS
    sync_timing = cfg.get("step_timing") == "sync"
    cuda = cfg.get("device", "cuda") != "cpu"
    out: list[dict] = []
    if t == "host_sync":
        if level < 3:
            out += [{"sync_free_level": v} for v in range(level + 1, 4)]
        if sync_timing and str(ev.get("call")) in ("cudaDeviceSynchronize", "cudaEventSynchronize"):
            out.append({"step_timing": "events"})
    elif t in ("launch_bound", "small_kernels"):
        if per_expert:
            out.append({"grouped_gemm_backend": "torch"})
        if t == "launch_bound" and level < 3:
            out.append({"sync_free_level": 3})
        if t == "launch_bound" and sync_timing:
            out.append({"step_timing": "events"})
        if cuda and cfg.get("expert_swiglu") == "torch":
            out.append({"expert_swiglu": "triton"})
    elif t == "exposed_comm" and ep > 1:
        if not cfg.get("ep_overlap"):
            out.append({"ep_overlap": True})
        else:
            out.append({"ep_overlap_chunks": 2 * int(cfg.get("ep_overlap_chunks") or 2)})
        if cfg.get("ep_dispatch", "nccl") == "nccl":
            out.append({"ep_dispatch": "capacity"})
    elif t in ("late_rank", "sync_wait") and ep > 1 and cfg.get("ep_dispatch", "nccl") == "nccl":
        out.append({"ep_dispatch": "capacity"})
    elif t == "pipeline_bubble" and pp > 1:
        out.append({"microbatches": 2 * int(cfg.get("microbatches") or 1)})
        if cfg.get("pipeline_schedule") in ("1f1b", "gpipe"):
            out.append({"pipeline_schedule": "zb1p"})
        if pp % 2 == 0:
            out.append({"pp": pp // 2})
    elif t == "moe_padding" and ep > 1:
        if level == 3:
            out.append({"sync_free_level": 2})
        if cfg.get("ep_dispatch", "nccl") == "nccl":
            out.append({"ep_dispatch": "capacity"})
    return out


def _not_per_token(step: Step | None, decomposition: pd.DataFrame | None) -> str:
    """Evidence for a larger micro-batch: the parts of the step that do not grow with its tokens (the
    decomposition's components labelled ``params`` or ``fixed``, ms per step, mean over ranks, as in the bar)."""
    d = decomposition
    if step is None or d is None or not len(d) or "scales_with" not in d or step.step_us <= 0:
        return ""
    per = d[d["scales_with"].isin(["params", "fixed"])].groupby("component", sort=False)["ms"].sum()
    per = (1e3 * per / d["rank"].nunique() / step.step_us).sort_values(ascending=False, kind="stable")
    per = per[per > 0.005]
    if per.empty:
        return ""
    parts = ", ".join(f"{c} {pct(v)}" for c, v in per.head(3).items())
    return (f"{pct(float(per.sum()))} of the step does not grow with the tokens of a micro-batch ({parts}): a larger "
            "micro-batch pays it once for more tokens (and makes the global batch larger)")


def candidates(findings: list[dict], step: Step | None, ctx: Context,
               decomposition: pd.DataFrame | None = None, limit: int = 12) -> list[Candidate]:
    """The changes worth predicting, each with its motive and evidence: the knobs each finding asks for (in
    the findings' order), then the step's own levers: the fused optimizer when the optimizer step is 5% or
    more of it, grouped expert GEMMs when a per-expert backend's expert GEMMs are, a 2x and 4x micro-batch
    (the parts that do not grow with the tokens), no recomputation. Only for a trainer run (a config); each
    change once, at most ``limit``."""
    cfg = ctx.config
    if not cfg:
        return []
    out: list[Candidate] = []
    seen: set[str] = set()

    def add(changes: dict, motive: str, evidence: str) -> None:
        # a key the run's config lacks (a run from before the knob) holds the trainer's default, as the what-if reads it
        changes = {k: v for k, v in changes.items() if cfg.get(k, DEFAULTS.get(k)) != v}
        if not changes:
            return
        c = Candidate(changes, motive, evidence, {k: cfg.get(k, DEFAULTS.get(k)) for k in changes})
        if c.key not in seen and len(out) < limit:
            seen.add(c.key)
            out.append(c)

    for f in findings:
        for ch in _moves(f, cfg):
            add(ch, f["type"], _evidence(f))
    if step is not None:
        opt = step.part("optimizer step")
        if opt is not None and opt.share >= 0.05 and cfg.get("optimizer") == "adamw":
            add({"optimizer": "adamw_fused"}, "optimizer step",
                f"the optimizer step takes {pct(opt.share)} of the step ({ms(opt.us)}), in one pass per parameter "
                "tensor (foreach AdamW)")
        eg = step.part("expert GEMMs")
        if eg is not None and cfg.get("grouped_gemm_backend") in PER_EXPERT_BACKENDS:
            add({"grouped_gemm_backend": "torch"}, "expert GEMMs",
                f"expert GEMMs take {pct(eg.share)} of the step ({ms(eg.us)}), one GEMM launch per local expert "
                f"(the {cfg.get('grouped_gemm_backend')} backend); torch._grouped_mm runs them in one")
    mbs = int(cfg.get("micro_batch_size") or 1)
    why = _not_per_token(step, decomposition) or "a larger micro-batch spreads per-step and per-launch costs over more tokens"
    if ctx.peak_gib is not None and ctx.capacity_gib:
        why += f"; measured peak memory {gib(ctx.peak_gib)} of {gib(ctx.capacity_gib)}"
    for k in MICRO_BATCH_FACTORS:
        add({"micro_batch_size": mbs * k}, "micro-batch", why)
    if cfg.get("recompute_layer_ids"):
        add({"recompute_layer_ids": []}, "recompute", f"layers {_yaml(cfg['recompute_layer_ids'])} run their forward "
            "twice (activation recomputation), which only memory pressure justifies")
    return out


def _evidence(f: dict) -> str:
    s = finding_sentence(f)
    return f"{f['title']}. {s}" if s else f"{f['title']}."


# ------------------------------------------------------------------------------------------ the verdict
@dataclass
class Action:
    title: str  # the change ("micro_batch_size 4 -> 8") or what to do when no knob is predicted
    evidence: str
    source: str  # the motive: a finding type or a step part
    changes: dict | None = None
    prediction: dict | None = None  # the what-if's outcome (gain, uncertainty, fits, peak_gib, capacity_gib, ...)
    predicted: str = ""  # "+58% ± 15% tokens/s/GPU, fits in 53.0 GiB of 79.2 GiB" (empty without a prediction)
    gain: str = ""  # its two parts: "+58% ± 15%"
    memory: str = ""  # "fits in 53.0 GiB of 79.2 GiB"
    estimate: str = ""  # without a prediction: the finding's own estimate of the time a fix recovers (an upper bound)
    no_prediction: str = ""  # why there is no predicted gain (one line)
    commands: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    bottleneck: str
    bottleneck_part: str | None
    step: Step | None
    step_note: str  # why there is no bar, else ""
    actions: list[Action]
    considered: list[str]  # changes predicted and not taken: why not, one line each
    health: list[dict]  # {severity, check, ranks, text, invalidates}
    findings: list[dict]  # {severity, type, title, sentence, recoverable_us, share_of_span}
    model: str  # what the predictions rest on, or why there are none

    def to_dict(self) -> dict:
        d = asdict(self)
        d["step"] = None if self.step is None else {
            "step_ms": self.step.step_us / 1e3, "ranks": self.step.ranks, "basis": self.step.basis,
            "parts": [{"name": p.name, "ms": p.us / 1e3, "share": p.share, "kind": p.kind} for p in self.step.parts]}
        return d

    def to_text(self, findings: int = 5) -> str:
        """What `tracelens analyze` prints: the bottleneck, the step, the actions with their predictions and
        commands, the health warnings, then the first findings as sentences."""
        lines = ["", f"verdict: {self.bottleneck}"]
        lines.append(f"  step: {self.step.text()}" if self.step is not None else f"  step: {self.step_note}")
        if self.actions:
            lines.append("  what to change first:")
        for i, a in enumerate(self.actions, 1):
            lines.append(f"  {i}. {a.title}" + (f": {a.predicted}" if a.predicted else ""))
            if not a.predicted:
                est = a.estimate + (" by the finding's estimate" if a.estimate.startswith("up to") else "")
                lines.append(f"     gain: {est}" + (f"; no prediction: {a.no_prediction}" if a.no_prediction else ""))
            lines.append(f"     why: {a.evidence}")
            for c in a.commands:
                lines.append(f"     check: {c}")
        if self.model:
            lines.append(f"  what-if: {self.model}")
        if self.considered:
            lines.append("  also predicted, not taken: " + "; ".join(self.considered[:4])
                         + (f"; {len(self.considered) - 4} more in summary.json" if len(self.considered) > 4 else ""))
        for h in self.health:
            lines.append(f"  health {h['severity']}: {h['check']}: {h['text']}"
                         + (f"; do not trust: {h['invalidates']}" if h.get("invalidates") else ""))
        if self.findings:
            lines.append("findings:")
        for f in self.findings[:findings]:
            lines.append(f"  {f['severity']:<6} {f['title']}")
            if f["sentence"]:
                lines.append(f"         {f['sentence']}")
        return "\n".join(lines)


def gain_text(o: dict) -> str:
    """"+58% ± 15%": the predicted change of tokens/s/GPU with its uncertainty (1 sigma)."""
    return f"{pct(o['gain'], signed=True)} ± {pct(o.get('uncertainty') or 0.0)}"


def memory_text(o: dict, device: str | None = None) -> str:
    """The memory verdict of one what-if outcome: "fits in 53.0 GiB of 79.2 GiB", "OUT OF MEMORY: ...", or the
    projected peak alone (a CPU run: the device's memory is not what limits it)."""
    peak, cap = o.get("peak_gib"), o.get("capacity_gib")
    if peak is None:
        return "memory not projected"
    if device == "cpu":
        return f"peak {gib(peak)} projected"
    if not o.get("fits", True):
        return f"OUT OF MEMORY: {gib(peak)} of {gib(cap)}"
    return f"fits in {gib(peak)} of {gib(cap)}" if cap else f"peak {gib(peak)} projected"


def predicted_text(o: dict, device: str | None = None) -> str:
    """"+58% ± 15% tokens/s/GPU, fits in 53.0 GiB of 79.2 GiB" for one what-if outcome."""
    return f"{gain_text(o)} tokens/s/GPU, {memory_text(o, device)}"


def whatif_command(run: str | None, changes: dict) -> str | None:
    if run is None:
        return None
    sets = " ".join(f"--set {shlex.quote(f'{k}={_yaml(v)}')}" for k, v in changes.items())
    return f"tracelens whatif {shlex.quote(run)} {sets}"


def trainer_command(argv: Iterable[str] | None, world: int, run: str | None, changes: dict) -> str | None:
    """The trainer's command that made the run (manifest versions.argv), with the changes as `--set` (an
    earlier `--set` or `--flag` of a changed key dropped) and a new run dir beside the run: what measures
    the prediction. None when the command is not known."""
    if not argv:
        return None
    args, config, keep, flags = list(argv)[1:], None, [], _flag_names(changes)
    i = 0
    while i < len(args):  # every option of the trainer and its launcher takes a value
        a = args[i]
        if a.startswith("--") and "=" in a:
            (opt, val), i = a.split("=", 1), i + 1
        elif a.startswith("-") and i + 1 < len(args):
            opt, val, i = a, args[i + 1], i + 2
        else:
            keep.append(a)
            i += 1
            continue
        if opt == "--config":
            config = val
        elif opt == "--set":
            if val.split("=", 1)[0].strip() not in changes:
                keep += ["--set", val]
        elif opt not in ("-o", "--out", "--nproc") and opt not in flags:
            keep += [opt, val]
    if config is None:
        return None
    slug = "-".join(re.sub(r"[^A-Za-z0-9_.]+", "", f"{k}{_yaml(v)}") for k, v in changes.items())
    out = f"{run.rstrip('/')}-{slug}" if run else f"runs/{slug}"
    cmd = ["python", "-m", "trainer.launch", "--config", config, "--nproc", str(world), *keep,
           *[x for k, v in changes.items() for x in ("--set", f"{k}={_yaml(v)}")], "-o", out]
    return " ".join(shlex.quote(x) for x in cmd)


def _cause(cause: Any) -> str:
    """The late rank's cause ("compute: grouped GEMM", "idle: launch-bound") in words: "grouped GEMM compute"."""
    kind, _, what = str(cause or "work").partition(": ")
    return f"{what} {kind}" if what else kind


def _flag_names(changes: dict) -> set[str]:
    return {"--" + k.replace("_", "-") for k in changes}


_ADVICE = {
    "late_rank": lambda ev: (f"Even out the work before rank {ev.get('late_rank')}'s collectives "
                             f"({', '.join((ev.get('families') or [])[:3])}): it is late by its extra "
                             f"{_cause(ev.get('cause'))}"),
    "sync_wait": lambda ev: f"Find why rank {ev.get('straggler_rank')} arrives last at {ev.get('family')} (comm section: stragglers)",
    "exposed_comm": lambda ev: "Hide communication under compute (overlap it with independent work, prefetch or bucket it)",
    "host_sync": lambda ev: (f"Remove the blocking {ev.get('call')} "
                             f"{'called outside any op' if _op(ev.get('op')) == '(no op)' else 'in ' + _op(ev.get('op'))}: "
                             "keep the value on the device, or read it once per step"),
    "launch_bound": lambda ev: "Launch fewer kernels per step: fuse elementwise ops, CUDA graphs or torch.compile, "
                               "grouped expert GEMMs",
    "small_kernels": lambda ev: "Fuse the small kernels (torch.compile, fused kernels) of " + ", ".join(
        _op(k) for k in list(ev.get("ops") or {})[:2]),
    "pipeline_bubble": lambda ev: "Shrink the pipeline bubble: more micro-batches, an interleaved or zero-bubble "
                                  "schedule, balanced stages",
    "moe_padding": lambda ev: "Send and compute the routed rows only (sync-free level 2, or capacity dispatch)",
    "host_hotspot": lambda ev: f"Cut the host time of {ev.get('family')} ops",
}


def health_lines(health: pd.DataFrame | None) -> list[dict]:
    """The errors and warnings of the health checks, one line per check (its ranks merged): what was found
    and what not to trust."""
    if health is None or not len(health):
        return []
    h = health[health["severity"].isin(["error", "warning"])]
    out = []
    for check, g in h.groupby("check", sort=False):
        ranks = sorted({int(r) for rs in g["ranks"] for r in (rs or [])})
        first = str(g["found"].iloc[0])
        more = f" (and {len(g) - 1} more like it)" if len(g) > 1 else ""
        out.append({"severity": str(g["severity"].iloc[0]), "check": str(check), "ranks": ranks,
                    "text": first + more, "invalidates": str(g["invalidates"].iloc[0] or "")})
    return sorted(out, key=lambda x: x["severity"] != "error")


def verdict(findings: list[dict], health: pd.DataFrame | None, step: Step | None, cands: list[Candidate],
            outcomes: dict[str, dict], ctx: Context, step_note: str = "") -> Verdict:
    """The verdict (module docstring). ``outcomes``: per candidate key, the what-if's outcome or
    ``{"error": line}``. Actions: the best predicted change of each motive that fits and gains at least
    1% (largest gain first, one action per knob), then, to make three, the findings whose fix no modeled
    knob predicts, each with the finding's own estimate and why there is no prediction."""
    head, part = bottleneck(step, findings)
    best: dict[str, tuple[Candidate, dict]] = {}
    considered: list[str] = []
    for c in cands:
        o = outcomes.get(c.key)
        if o is None:
            continue
        if "error" in o:
            considered.append(f"{c.label()}: no prediction ({o['error']})")
            continue
        txt = f"{c.label()}: {predicted_text(o, ctx.device)}"
        if not o.get("fits", True) or o["gain"] < MIN_GAIN:
            considered.append(txt)
            continue
        if c.motive not in best or o["gain"] > best[c.motive][1]["gain"]:
            if c.motive in best:
                considered.append(f"{best[c.motive][0].label()}: {predicted_text(best[c.motive][1], ctx.device)}")
            best[c.motive] = (c, o)
        else:
            considered.append(txt)
    actions: list[Action] = []
    knobs: set[str] = set()
    for c, o in sorted(best.values(), key=lambda co: -co[1]["gain"]):
        if knobs & set(c.changes) or len(actions) >= N_ACTIONS:
            considered.append(f"{c.label()}: {predicted_text(o, ctx.device)}")
            continue
        knobs |= set(c.changes)
        actions.append(Action(c.label(), c.evidence, c.motive, dict(c.changes),
                              dict(o), predicted_text(o, ctx.device), gain_text(o), memory_text(o, ctx.device),
                              commands=[x for x in (whatif_command(ctx.run, c.changes),
                                                    trainer_command(ctx.argv, ctx.world, ctx.run, c.changes)) if x]))
    tried: dict[str, list[str]] = {}
    for c in cands:
        o = outcomes.get(c.key)
        if o is not None and "error" not in o:
            tried.setdefault(c.motive, []).append(f"{c.label()} {pct(o['gain'], signed=True)}")
    done = {a.source for a in actions}
    late = next((f for f in findings if f.get("type") == "late_rank"), None)
    for f in findings:
        if len(actions) >= N_ACTIONS:
            break
        t, ev = f.get("type"), f.get("evidence") or {}
        if t in done or t not in _ADVICE:
            continue
        if t == "sync_wait" and late is not None and ev.get("straggler_rank") == late["evidence"].get("late_rank") \
                and ev.get("family") in (late["evidence"].get("families") or []):
            continue  # the same waiting as the late rank's
        rec, share = f.get("recoverable_us"), f.get("share_of_span")
        est = (f"up to {ms(rec)} per rank ({pct(share)} of the step)" if rec is not None
               else "no estimate (the finding says where time goes, not what a fix recovers)")
        if ctx.why_no_model:
            why = ""  # the run's own reason, said once (Verdict.model)
        elif t in tried:
            why = f"no knob the what-if models is predicted to help ({'; '.join(tried[t][:2])})"
        else:
            why = "the what-if has no mechanism for this fix"
        actions.append(Action(_ADVICE[t](ev), _evidence(f), t, estimate=est, no_prediction=why))
        done.add(t)
    if ctx.why_no_model:
        model = f"no predictions: {ctx.why_no_model}"
    elif not cands:
        model = "no predictions: no change to try for this run"
    else:
        model = (f"{len(cands)} change(s) predicted from this run's profiled step, calibrated to its measured step "
                 "time (tokens/s/GPU, 1 sigma)")
    rows = [{"severity": f["severity"], "type": f["type"], "title": f["title"], "sentence": finding_sentence(f),
             "recoverable_us": f.get("recoverable_us"), "share_of_span": f.get("share_of_span")} for f in findings]
    return Verdict(head, part, step, step_note if step is None else "", actions, considered, health_lines(health),
                   rows, model)


def context_of(manifest: dict | None, run_root: str | os.PathLike | None, cwd: str | None = None) -> Context:
    """The run's context from its manifest: config, world, the trainer's command, device, measured peak
    memory; ``run_root`` named relative to ``cwd`` when inside it. Without a config: why no what-if."""
    run = None
    if run_root is not None:
        root = os.path.abspath(run_root)
        here = os.path.abspath(cwd or os.getcwd())
        rel = os.path.relpath(root, here)
        run = rel if not rel.startswith("..") else root
    m = manifest if isinstance(manifest, dict) else None
    cfg = m.get("config") if m is not None and isinstance(m.get("config"), dict) else None
    if cfg is None:
        why = ("these traces have no run manifest (the what-if needs the trainer's config and measured step times: "
               "a run dir from `tracelens profile` or `python -m trainer.launch`)")
        return Context(None, 1, run, None, None, None, None, why)
    metrics = m.get("metrics") if isinstance(m.get("metrics"), dict) else {}
    peaks = [p for p in (metrics.get("peak_memory_bytes") or []) if isinstance(p, (int, float)) and p > 0]
    on_device = metrics.get("peak_memory_kind") == "cuda_max_memory_allocated"
    argv = (m.get("versions") or {}).get("argv") if isinstance(m.get("versions"), dict) else None
    dev = (m.get("device") or {}).get("type") if isinstance(m.get("device"), dict) else None
    mean = metrics.get("mean_step_time_s")
    why = None
    if not isinstance(mean, (int, float)) or isinstance(mean, bool) or not mean > 0:
        why = "the run manifest has no measured mean step time (metrics.mean_step_time_s) to calibrate on"
    world = m.get("world_size")
    return Context({**cfg, "device": cfg.get("device") or dev}, int(world) if isinstance(world, int) and world > 0 else 1,
                   run, tuple(str(a) for a in argv) if isinstance(argv, list) else None, dev,
                   max(peaks) / 2**30 if peaks and on_device else None, None, why)


__all__ = ["Action", "Candidate", "Context", "Part", "Step", "Verdict", "bottleneck", "candidates", "context_of",
           "finding_sentence", "gain_text", "health_lines", "memory_text", "predicted_text", "step_of", "trainer_command", "verdict",
           "whatif_command"]

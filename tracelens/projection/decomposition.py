"""The step decomposition: where one step's time goes, per rank, and how each part scales.

    >>> from tracelens.projection.decomposition import decomposition
    >>> df = decomposition(tracelens.analyze(tracelens.load("runs/demo")))
    >>> df.attrs["basis"], df.attrs["note"]
    >>> df[df["rank"] == 0]          # component, ms, share, scales_with, ...

Per rank, the step time is cut into the components of :data:`profile.COMPONENTS` (expert GEMMs,
dense GEMMs, attention, norms/activations, optimizer step, copies/casts, exposed communication, collective
waits (a collective kernel spinning until its last rank arrives: tracelens.analysis.waits), sync
waits, launch-bound idle, pipeline bubble, other) that add up to it. The cut is the what-if model's:
the rank's profiled step is replayed (``replay.py``: the host issues its launches and blocking syncs,
the device runs the units) and the replayed timeline is split by what the device did at each moment
and why it was idle. Two bases, named in ``attrs["basis"]``:

* ``"calibrated"``: the input is a run dir whose manifest has a measured mean step time
  (``metrics.mean_step_time_s``, the unprofiled timed steps): the components are
  ``Model.from_run(run).base_by_rank``, the replay calibrated to that time (one factor for the host,
  which the profiler slows, one for the rest), so per rank they add up to the measured mean step.
* ``"replay"``: no such manifest (trace files, a trace dir, a run without step times), or
  ``calibrate=False``: the replay of the traced step with the host at the speed the trace shows
  (``replay.run(replay.prepare(step_profile(...)))``, host_scale 1); the parts add up to the
  replayed step, which reproduces the traced ``ProfilerStep#N`` (``attrs["ranks"]`` gives both).

Each component is labelled by how its time scales when a knob changes (``scales_with``): the
``scale`` label (``tokens`` / ``params`` / ``fixed``, ``profile.py``) holding most of the measured
time of the component's units, with that label's share of it (``scale_share``). The idle components
have no units: their label comes from their mechanism (``scale_basis == "mechanism"``): a sync wait
and launch-bound idle are paid per blocking sync and per launch, not per token (``fixed``); a
pipeline bubble is a share of the stage time, which grows with the tokens (``tokens``). ``other``
holds both the work of units of no known kind and idle time of no known cause (on a CPU-only trace,
the host's time outside ops): the idle part counts as ``fixed`` in its label's share. A kind of work
the step does not have is labelled ``None`` (``scale_basis == "none"``).

A pure function of the analysis (and the manifest); it never reads raw events.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..analysis import waits as W
from ..io.run import Run
from . import replay as R
from .profile import COMPONENTS, IDLE_COMPONENTS, ProfileError, step_profile
from .whatif import Model, WhatIfError

COLUMNS = ["rank", "component", "ms", "share", "scales_with", "scale_share", "scale_basis", "step", "basis"]
# the label of a component that has no unit of work (time the device spent idle), by its mechanism
MECHANISM_SCALE = {"collective waits": "fixed", "sync waits": "fixed", "launch-bound idle": "fixed",
                   "pipeline bubble": "tokens", "other": "fixed"}
CALIBRATED, REPLAY = "calibrated", "replay"
# an uncalibrated replay further than this from the traced step is flagged in the note (the replay
# reproduces the trainer's traced steps within 0.3-0.6 %; other programs' traces can differ more)
FIDELITY_WARN = 0.05


class DecompositionError(ValueError):
    """A step that cannot be decomposed: one line saying why."""


def run_dir_of(analysis) -> Path | None:
    """The run dir whose ``traces/`` holds every rank file of the analysis (None for loose traces)."""
    run = getattr(getattr(analysis, "trace", None), "run", None)
    if run is None or run.trace_dir is None or run.trace_dir.name != "traces":
        return None
    return run.trace_dir.parent


def _mean_step_s(manifest: dict | None) -> float | None:
    m = (manifest or {}).get("metrics") if isinstance(manifest, dict) else None
    v = m.get("mean_step_time_s") if isinstance(m, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return None
    return float(v)


def decomposition(analysis, manifest: dict | None = None, calibrate: bool = True) -> pd.DataFrame:
    """Per rank and component of :data:`COMPONENTS`: ``ms`` (they add up to the rank's step), ``share``
    of the step, ``scales_with`` (tokens / params / fixed) with ``scale_share`` and ``scale_basis``
    (``units``: from the labels of the component's units; ``mechanism``: an idle component), the
    profiled ``step`` it comes from and the ``basis`` (``calibrated`` / ``replay``).

    ``manifest``: the run's manifest (default: the analysis's own, when its traces sit in a run dir).
    With a measured mean step time in it the decomposition is calibrated to it (unless ``calibrate``
    is False), else it is the replay of the traced step. ``attrs`` holds ``basis``, ``note`` (one
    line saying which and how close) and ``ranks`` (per rank: step, step_ms, traced_step_ms).

    Raises :class:`DecompositionError` (one line) when no rank has a profiled step to decompose.
    """
    if manifest is None:
        manifest = getattr(analysis, "manifest", None)
    config = dict(manifest.get("config") or {}) if isinstance(manifest, dict) and isinstance(
        manifest.get("config"), dict) else {}
    mean = _mean_step_s(manifest) if calibrate else None
    why_not = ""
    if calibrate and mean is None:
        why_not = ("no run manifest" if not isinstance(manifest, dict)
                   else "the manifest has no measured mean step time (metrics.mean_step_time_s)")
    if mean is not None:
        try:
            return _calibrated(analysis, manifest, mean)
        except DecompositionError:
            raise
        except Exception as e:  # noqa: BLE001 - the model cannot calibrate this run: say so, show the replay
            why_not = f"calibration failed ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    return _replayed(analysis, config, why_not)


# ------------------------------------------------------------------------------------------ the two bases
def _calibrated(analysis, manifest: dict, mean_s: float) -> pd.DataFrame:
    run = getattr(analysis.trace, "run", None) or Run()
    if run.manifest != manifest:  # a manifest given beside loose traces (or another one): the model takes it as given
        run = run.with_manifest(manifest)
    model = Model.from_run(run, analysis=analysis, transfer_only=False)
    rows, ranks, bubble_notes = [], [], []
    for p, comps in zip(model.profiles, model.base_by_rank):
        ms = {c: 1e3 * float(comps.get(c, 0.0)) for c in COMPONENTS}
        step_ms = float(sum(ms.values()))
        _move_waits(analysis, p, ms, step_ms, bubble_notes)
        idle = _other_idle_fraction(R.prepare(p))
        idle = _move_bubble(analysis, p, ms, step_ms, idle, bubble_notes)
        rows += _rows(p, ms, step_ms, CALIBRATED, idle)
        ranks.append({"rank": int(p.rank), "step": int(p.step), "step_ms": step_ms,
                      "traced_step_ms": p.step_ns / 1e6})
    timed = (manifest.get("metrics") or {}).get("timed_steps")
    timed_txt = f", timed steps {', '.join(str(s) for s in timed)}" if isinstance(timed, list) and timed else ""
    traced = ", ".join(f"rank {r['rank']} step {r['step']} {r['traced_step_ms']:.3f} ms" for r in ranks)
    note = (f"calibrated: each rank's profiled step replayed and scaled to the run's measured mean step time "
            f"{1e3 * mean_s:.3f} ms (manifest metrics.mean_step_time_s{timed_txt}); the total is measured, the "
            f"split is the replay's. Traced (profiled) step: {traced}")
    missing = _missing(analysis, {r["rank"] for r in ranks})
    if missing:
        note += f"; no profiled step with device work on rank(s) {missing}"
    return _frame(rows, CALIBRATED, note + "".join(bubble_notes[:2]), ranks)


def _replayed(analysis, config: dict, why_not: str) -> pd.DataFrame:
    rows, ranks, bubble_notes = [], [], []
    for info in analysis.trace.ranks:
        p = step_profile(analysis, config, info.rank, _steady_step(analysis, info.rank))
        if p is None or not len(p.work):
            continue
        prog = R.prepare(p)
        res = R.run(prog, host_scale=1.0)
        ms = {c: float(res.components.get(c, 0.0)) / 1e6 for c in COMPONENTS}
        step_ms = float(sum(ms.values()))
        _move_waits(analysis, p, ms, step_ms, bubble_notes)
        idle = _move_bubble(analysis, p, ms, step_ms, _other_idle_fraction(prog, res), bubble_notes)
        rows += _rows(p, ms, step_ms, REPLAY, idle)
        ranks.append({"rank": int(p.rank), "step": int(p.step), "step_ms": step_ms, "traced_step_ms": p.step_ns / 1e6})
    if not ranks:
        if analysis.steps.empty:
            raise DecompositionError("no profiler step marked in the trace (ProfilerStep#N): nothing to decompose")
        raise DecompositionError("no profiled step with device work (kernels, or CPU ops on a CPU-only trace) "
                                 "on any rank")
    fid = "; ".join(f"rank {r['rank']} step {r['step']}: traced {r['traced_step_ms']:.3f} ms, replayed "
                    f"{r['step_ms']:.3f} ms ({_pct(r['step_ms'], r['traced_step_ms'])})" for r in ranks)
    note = (f"replay of the traced step at the host speed the trace shows, not calibrated"
            f"{' (' + why_not + ')' if why_not else ''}: {fid}")
    off = [r for r in ranks if r["traced_step_ms"] > 0
           and abs(r["step_ms"] / r["traced_step_ms"] - 1.0) > FIDELITY_WARN]
    if off:
        worst = max(off, key=lambda r: abs(r["step_ms"] / r["traced_step_ms"] - 1.0))
        note += (f"; WARNING: the replay does not reproduce the traced step within {100 * FIDELITY_WARN:.0f} % on "
                 f"rank(s) {', '.join(str(r['rank']) for r in off)} (worst {_pct(worst['step_ms'], worst['traced_step_ms'])}"
                 "): read the split as approximate")
    missing = _missing(analysis, {r["rank"] for r in ranks})
    if missing:
        note += f"; no profiled step with device work on rank(s) {missing}"
    return _frame(rows, REPLAY, note + "".join(bubble_notes[:2]), ranks)


# ------------------------------------------------------------------------------------------ helpers
def _steady_step(analysis, rank: int) -> int | None:
    """The step to replay on ``rank``: of the steady-state window's steps (``analysis.window``: no
    profiler start-up wait, no step cut by the window, no warm-up or trace-export step), the one with
    the most device work (GPU events; on a CPU-only rank, ops); None: the profile's own default."""
    sw = getattr(analysis, "window", None)
    if sw is None or not sw.restricts or not sw.used:
        return None
    st = analysis.steps[analysis.steps["rank"] == rank]
    sv = st["step"].to_numpy()
    if sv.dtype.kind == "i":  # (whole columns: a trace of many short steps has tens of thousands)
        have = sv[np.isin(sv, np.asarray(sw.used, dtype=np.int64))].tolist()
    else:
        used = {int(s) for s in sw.used}
        have = [int(s) for s in st["step"] if int(s) in used]
    if not have:
        return None
    g = analysis.gpu
    if len(g):
        counts = g[(g["rank"] == rank) & g["step"].isin(have)].groupby("step").size()
        if len(counts):
            return int(counts.idxmax())
    return have[len(have) // 2]


P2P_KERNEL = W.P2P_KERNEL


def _move_bubble(analysis, p, ms: dict, step_ms: float, other_idle: float, notes: list) -> float:
    """A pipeline run: the pipeline analysis's bubble account (``analysis.pipeline.account``, docs/pipeline.md)
    says how much of a rank's waiting in the step is the schedule's bubble (``theory_ns + imbalance_ns``:
    waiting for other stages, not moving data). Where the replay put that time depends on the backend: on
    NCCL a rank waiting for its upstream stage spins in a point-to-point kernel (``SendRecv``), so the wait
    sits in ``exposed communication``; on gloo, and where the host launched the receive late, it is idle
    (``other``'s idle part, launch-bound idle, sync waits). That much (scaled like the rest of the step)
    moves to ``pipeline bubble``: first from the rank's point-to-point kernel time beyond what the account
    calls hand-off communication (``comm_ns``: the transfer and its waits on the critical path), then from
    ``other``'s idle part, launch-bound idle, sync waits. Edits ``ms`` in place; returns ``other``'s new
    idle fraction."""
    pa = getattr(analysis, "pipeline", None)
    acc = getattr(getattr(pa, "account", None), "per_step", None)
    if acc is None or not len(acc) or not {"step", "rank", "theory_ns", "imbalance_ns"} <= set(acc.columns):
        return other_idle
    row = acc[(acc["step"] == p.step) & (acc["rank"] == p.rank)]
    if row.empty:
        notes.append(f"; the pipeline bubble account has no row for rank {p.rank} step {p.step}: its bubble "
                     "stays in the idle parts")
        return other_idle
    bubble_ns = float(row["theory_ns"].iloc[0]) + float(row["imbalance_ns"].iloc[0])
    if not (bubble_ns > 0) or p.step_ns <= 0:
        return other_idle
    scale = step_ms / (p.step_ns / 1e6)  # the calibration: the traced step's ms -> the decomposed step's
    want = bubble_ns / 1e6 * scale
    w = p.work
    pipe_ms = _timeline_wait_ms(analysis, p, "pipeline_wait_us")
    if pipe_ms is not None:
        # the stage's point-to-point waits for its neighbour that no compute hides (tracelens.analysis.waits, the
        # GPU timeline's pipeline_wait_us of the step): the bubble's share of the communication kernels' time
        p2p_wait_ms = pipe_ms * scale
    else:  # no cross-rank waits known (one rank loaded): the point-to-point time beyond the hand-offs
        p2p = w["is_comm"].to_numpy(dtype=bool) & w["name"].astype(str).str.contains(P2P_KERNEL).to_numpy()
        handoff_ms = float(row["comm_ns"].iloc[0]) / 1e6 if "comm_ns" in row.columns else 0.0
        p2p_wait_ms = max(float(w["dur"].to_numpy(dtype=np.float64)[p2p].sum()) / 1e6 - handoff_ms, 0.0) * scale
    other_idle_ms = other_idle * ms["other"]
    moved = 0.0
    for comp, avail in (("exposed communication", min(p2p_wait_ms, ms["exposed communication"])),
                        ("other", other_idle_ms), ("launch-bound idle", ms["launch-bound idle"]),
                        ("sync waits", ms["sync waits"])):
        take = min(max(avail, 0.0), want - moved)
        if take <= 0:
            continue
        ms[comp] -= take
        moved += take
        if comp == "other":
            other_idle_ms -= take
    ms["pipeline bubble"] += moved
    if not any("pipeline bubble" in n for n in notes):
        notes.append("; pipeline bubble: the schedule's share of each rank's waiting (theory + stage imbalance, "
                     "from the pipeline bubble account) moved out of the point-to-point kernels it spins in "
                     "(NCCL) and the replay's idle parts")
    return other_idle_ms / ms["other"] if ms["other"] > 0 else 0.0


def _timeline_wait_ms(analysis, p, column: str) -> float | None:
    """ms of the rank's profiled step in the GPU timeline's wait column (``comm_wait_us`` / ``pipeline_wait_us``:
    communication kernels' waits no compute hides, tracelens.analysis.waits); None when the timeline has no
    such figure for it (no cross-rank waits known)."""
    st = getattr(analysis, "step_timeline", None)
    if st is None or not len(st) or column not in st.columns:
        return None
    row = st[(st["rank"] == p.rank) & (st["step"] == p.step)]
    if row.empty:
        return None
    return float(row[column].iloc[0]) / 1e3


def _move_waits(analysis, p, ms: dict, step_ms: float, notes: list) -> None:
    """A rank's communication kernels spin until the last rank of their collective arrives: that part of their
    time is waiting for another rank (its lateness), not communication (tracelens.analysis.waits). The step's
    such waits that no compute hides (the GPU timeline's ``comm_wait_us``), scaled like the rest of the step,
    move from ``exposed communication`` to ``collective waits``. Edits ``ms`` in place."""
    wait_ms = _timeline_wait_ms(analysis, p, "comm_wait_us")
    if not wait_ms or p.step_ns <= 0:
        return
    take = min(wait_ms * step_ms / (p.step_ns / 1e6), ms["exposed communication"])
    if take <= 0:
        return
    ms["exposed communication"] -= take
    ms["collective waits"] += take
    if not any("collective waits" in n for n in notes):
        notes.append("; collective waits: the time communication kernels spun waiting for the last rank of their "
                     "collective (GPU timeline comm_wait_us), moved out of exposed communication")


def _other_idle_fraction(prog: R.Program, res: R.Result | None = None) -> float:
    """The part of the replay's ``other`` that is idle time of no known cause (on a CPU-only trace: the
    host's time outside ops), not work of an ``other`` unit: that part scales as ``fixed``."""
    if res is None:
        res = R.run(prog, host_scale=1.0)
    total = float(res.components.get("other", 0.0))
    if total <= 0:
        return 0.0
    w = prog.profile.work
    if prog.cpu or res.start is None:
        work = float(w["dur"].to_numpy(dtype=np.float64)[(w["component"] == "other").to_numpy()].sum())
    else:  # the same timeline with every idle gap credited elsewhere: what is left in "other" is its work
        keep = ~np.isnan(res.start)
        alt = R.decompose(res.start, res.end, w["component"].to_numpy(), keep, np.full(len(w), 2, np.int8),
                          res.step_ns)
        work = float(alt.get("other", 0.0))
    return float(min(max(1.0 - work / total, 0.0), 1.0))


def _rows(p, ms: dict, step_ms: float, basis: str, other_idle: float = 0.0) -> list[dict]:
    labels = scale_labels(p.work, other_idle)
    out = []
    for c in COMPONENTS:
        lab = labels.get(c)
        if lab is None and c in MECHANISM_SCALE:
            scale, share, how = MECHANISM_SCALE[c], None, "mechanism"
        elif lab is None:  # a kind of work this step does not have
            scale, share, how = None, None, "none"
        else:
            scale, share, how = lab[0], lab[1], "units"
        out.append({"rank": int(p.rank), "component": c, "ms": ms[c], "share": ms[c] / step_ms if step_ms > 0 else 0.0,
                    "scales_with": scale, "scale_share": share, "scale_basis": how, "step": int(p.step),
                    "basis": basis})
    return out


def scale_labels(work: pd.DataFrame, other_idle: float = 0.0) -> dict[str, tuple[str, float]]:
    """component -> (the scale label holding most of its time, that label's share of it), from the
    ``scale`` labels of its units weighted by their time. ``other_idle``: the fraction of the ``other``
    component that is idle time (no unit), counted as ``fixed``."""
    if work is None or not len(work):
        return {"other": ("fixed", 1.0)} if other_idle > 0 else {}
    dur = work["dur"].to_numpy(dtype=np.float64)
    g = pd.DataFrame({"component": work["component"].astype(str).to_numpy(),
                      "scale": work["scale"].astype(str).to_numpy(), "dur": np.maximum(dur, 0.0)})
    out: dict[str, tuple[str, float]] = {}
    for comp, sub in g.groupby("component", sort=False):
        by = sub.groupby("scale", sort=True)["dur"].sum()
        total = float(by.sum())
        if total <= 0:
            continue
        if comp == "other" and other_idle > 0:
            by = by / total * (1.0 - other_idle)
            by["fixed"] = by.get("fixed", 0.0) + other_idle
            total = float(by.sum())
        # ties go to the first of tokens, params, fixed (the order profile.SCALES lists them)
        order = {"tokens": 0, "params": 1, "fixed": 2}
        best = sorted(by.items(), key=lambda kv: (-kv[1], order.get(kv[0], 9)))[0]
        out[str(comp)] = (str(best[0]), float(best[1]) / total)
    if "other" not in out and other_idle > 0:
        out["other"] = ("fixed", 1.0)
    return out


def _missing(analysis, have: set) -> str:
    miss = [str(r.rank) for r in analysis.trace.ranks if r.rank not in have]
    return ", ".join(miss)


def _pct(a: float, b: float) -> str:
    return f"{round(100 * (a - b) / b, 1) + 0.0:+.1f} %" if b > 0 else "n/a"  # (+ 0.0: never "-0.0 %")


def _frame(rows: list[dict], basis: str, note: str, ranks: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=COLUMNS)
    bad = df[(df["ms"] < -1e-9) | ~np.isfinite(df["ms"].to_numpy(dtype=np.float64))]
    if len(bad):
        r = bad.iloc[0]
        raise DecompositionError(f"rank {r['rank']}: component {r['component']} came out at {r['ms']} ms "
                                 "(negative or not finite): refusing a decomposition that does not add up")
    df.attrs = {"basis": basis, "note": note, "ranks": ranks}
    return df


def to_summary(df: pd.DataFrame) -> dict[str, Any]:
    """The ``decomposition`` record of summary.json (docs/summary-json.md): times in µs, like the rest of it."""
    ranks = []
    info = {r["rank"]: r for r in df.attrs.get("ranks", [])}
    for rank, sub in df.groupby("rank", sort=True):
        i = info.get(int(rank), {})
        step_ms = i.get("step_ms", float(sub["ms"].sum()))
        traced = i.get("traced_step_ms")
        ranks.append({
            "rank": int(rank), "step": int(sub["step"].iloc[0]),
            "step_us": _round(1e3 * step_ms, 3), "traced_step_us": None if traced is None else _round(1e3 * traced, 3),
            "components": [{"component": r.component, "us": _round(1e3 * r.ms, 3), "share": _round(r.share, 6),
                            "scales_with": r.scales_with if isinstance(r.scales_with, str) else None,
                            "scale_share": None if r.scale_share is None or r.scale_share != r.scale_share
                            else _round(r.scale_share, 4),
                            "scale_basis": r.scale_basis} for r in sub.itertuples(index=False)],
        })
    return {"available": True, "basis": df.attrs.get("basis"), "note": df.attrs.get("note", ""), "ranks": ranks}


def _round(v: Any, digits: int = 6) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if not math.isfinite(f) else round(f, digits)


def reason(e: BaseException) -> str:
    """One line saying why there is no decomposition: the message of our own one-line errors, else the
    exception's type and message (an unexpected failure is named, never hidden)."""
    from ..errors import TraceError

    if isinstance(e, TraceError):
        text = e.one_line()
    elif isinstance(e, (DecompositionError, ProfileError, WhatIfError)):
        text = str(e)
    else:
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return " ".join(text.split())[:400]


def unavailable(why: str) -> dict[str, Any]:
    """summary.json's record when there is no decomposition: why, in one line."""
    return {"available": False, "reason": " ".join(str(why).split())[:400]}


__all__ = ["decomposition", "scale_labels", "to_summary", "unavailable", "run_dir_of", "DecompositionError",
           "COLUMNS", "CALIBRATED", "REPLAY", "MECHANISM_SCALE", "IDLE_COMPONENTS"]

"""One trial = one real trainer run (a subprocess; torchrun when nproc > 1) plus its analysis.

The trainer runs in its own process group (session) with a timeout, and optionally a stall limit on
its output; past either, the whole group is killed, so a hung collective leaves no orphan ranks. On Linux the trial's first process also gets
``PR_SET_PDEATHSIG = SIGKILL``: if the sweep itself is killed (even with SIGKILL) its trial dies with
it; grandchildren (torchrun's ranks) are reaped on resume from the process group id the store keeps
(:func:`reap_orphans`). Output goes to RUN/trial.log.

A failed trial is classified from the exit status, the log and the manifest (``failure`` column):

    timeout       no exit within trial.timeout_s, or no new output for trial.stall_s (a hang): the
                  process group is killed
    oom           "out of memory" in the log (CUDA / torch / RuntimeError)
    killed        ended by a signal (e.g. SIGKILL from the kernel's OOM killer)
    config        exit status 2: the trainer rejected the combination of knobs
    crash         any other non-zero exit, or no readable manifest
    memory        finished, but its peak memory exceeds the space's limits.memory_gib
    no-objective  finished without the objective's metric (e.g. MFU on a CPU)

A finished run is analyzed with tracelens: manifest metrics, the step-time spread and the standard error
of the objective (``spread``, ``noise``: :func:`step_spread`, :func:`step_noise`), findings
and the signals the guided policy reads (:func:`signals_of`, :func:`memory_signals`,
:func:`pipeline_signals`).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .space import Space

GIB = float(2**30)
_OOM = re.compile(r"out of memory|outofmemoryerror|cuda_error_out_of_memory|hipErrorOutOfMemory", re.I)


@dataclass
class TrialResult:
    status: str  # ok | failed
    failure: str | None  # see the module docstring
    reason: str | None  # one line
    objective: float | None
    metrics: dict[str, Any] = field(default_factory=dict)
    findings: list[dict] = field(default_factory=list)


def trial_command(space: Space, knobs: dict, run_dir: Path) -> list[str]:
    """The trial's argv. Values are passed as JSON (a YAML subset the trainer's --set parses), so a
    string such as "1f1b" or "null" stays a string."""
    base = space.command or [sys.executable, "-m", "trainer.launch"]
    cmd = list(base) + ["--config", space.config, "--nproc", str(space.nproc), "-o", str(run_dir)]
    for k, v in {**space.fixed, **knobs}.items():
        cmd += ["--set", f"{k}={json.dumps(v, separators=(',', ':'))}"]
    return cmd


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(137)


def run_trial(space: Space, knobs: dict, run_dir: str | Path, on_start: Callable[[int], None] | None = None,
              timeout_s: float | None = None) -> TrialResult:
    """Run one trial into ``run_dir`` and return its result; never raises for a failed run. ``run_dir`` must
    not exist or be empty: a trial never deletes anything (a sweep moves what a killed attempt left there
    aside first, :func:`autotune.sweep.set_aside`). ``on_start(pgid)`` is called once the process is started
    (the store records it)."""
    run_dir = Path(run_dir)
    if run_dir.is_dir() and any(run_dir.iterdir()) or (run_dir.exists() and not run_dir.is_dir()):
        raise FileExistsError(f"{run_dir}: a trial runs in a new or empty directory, and this one is not")
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = trial_command(space, knobs, run_dir)
    timeout_s = timeout_s or space.timeout_s
    log = run_dir / "trial.log"
    t0 = time.time()
    with open(log, "wb") as out:
        out.write(("$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                                env={**os.environ, **space.trial_env, "PYTHONUNBUFFERED": "1"},
                                cwd=str(Path(__file__).resolve().parents[1]))
        try:
            if on_start is not None:
                on_start(proc.pid)
            rc, hang = _wait(proc, log, timeout_s, space.stall_s)
        except BaseException:  # the sweep is interrupted: take the trial down with it
            kill_group(proc)
            raise
        if hang is not None:
            kill_group(proc)
            return TrialResult("failed", "timeout", f"timeout: {hang} (hang?); process group killed",
                               None, {"wall_s": round(time.time() - t0, 3)})
    wall = round(time.time() - t0, 3)
    tail = log.read_text(errors="replace")[-8000:]
    if rc != 0:
        last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "(no output)")
        if _OOM.search(tail):
            kind = "oom"
        elif rc < 0:
            kind = "killed"
            last = f"killed by {signal.Signals(-rc).name}" + (" (out-of-memory killer?)" if -rc == signal.SIGKILL else "")
        else:
            kind = "config" if rc == 2 else "crash"
        return TrialResult("failed", kind, f"{kind}: exit {rc}: {last[:300]}", None, {"wall_s": wall})
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
        metrics = dict(manifest.get("metrics") or {})
    except (OSError, ValueError) as e:
        return TrialResult("failed", "crash", f"crash: exit 0 but no readable manifest.json ({type(e).__name__})",
                           None, {"wall_s": wall})
    metrics["wall_s"] = wall
    metrics["spread"] = step_spread(metrics)
    metrics["noise"] = step_noise(metrics)
    findings, signals = analyze_run(run_dir)
    signals.update(memory_signals(metrics, signals.pop("device_memory_bytes", None), space.memory_gib))
    metrics["signals"] = signals
    obj = metrics.get(space.metric)
    if isinstance(obj, bool) or not isinstance(obj, (int, float)) or not np.isfinite(obj):
        return TrialResult("failed", "no-objective", f"no-objective: manifest metric {space.metric!r} is {obj!r}",
                           None, metrics, findings)
    peak = signals.get("peak_memory_gib")
    if space.memory_gib is not None and peak is not None and peak > space.memory_gib:
        return TrialResult("failed", "memory", f"memory: peak {peak:.2f} GiB is over the limit {space.memory_gib:g} GiB",
                           float(obj), metrics, findings)
    return TrialResult("ok", None, None, float(obj), metrics, findings)


def _wait(proc: subprocess.Popen, log: Path, timeout_s: float, stall_s: float | None) -> tuple[int | None, str | None]:
    """Wait for the trial: (exit status, None), or (None, why it counts as hung): no exit within
    ``timeout_s``, or (with ``stall_s``) no new output in the log for ``stall_s`` seconds once the
    trial has printed something (start-up, imports and rendezvous are covered by ``timeout_s`` only)."""
    t0 = time.time()
    header = size = log.stat().st_size  # our own "$ command" line
    last = None
    while True:
        try:
            return proc.wait(timeout=1.0), None
        except subprocess.TimeoutExpired:
            pass
        now = time.time()
        if now - t0 >= timeout_s:
            return None, f"no exit within {timeout_s:g} s"
        if stall_s is not None:
            n = log.stat().st_size
            if n != size:
                size, last = n, now
            elif last is not None and size > header and now - last >= stall_s:
                return None, f"no output for {stall_s:g} s"


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the trial's process group, then SIGKILL what is left after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=5)
            if sig == signal.SIGKILL:
                return
        except subprocess.TimeoutExpired:
            continue
    try:  # members of the group may outlive its leader
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def reap_orphans(pgid: int, marker: str) -> list[int]:
    """Kill what is left of a killed sweep's trial: processes in group ``pgid`` whose command line
    has ``marker`` (the trial's run dir) as a whole argument, or a path under it, so a recycled group id or
    another sweep's trial (a copy of this sweep elsewhere) never gets hit. Linux only."""
    killed = []
    proc = Path("/proc")
    if not proc.is_dir() or not pgid:
        return killed
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) != pgid:  # state, ppid, pgrp
                continue
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if not any(a == marker or a.startswith(marker + os.sep) or a.endswith("=" + marker) for a in argv):
                continue
            os.kill(int(d.name), signal.SIGKILL)
            killed.append(int(d.name))
        except (OSError, ValueError, IndexError):
            continue
    return killed


def _timed_step_times(metrics: dict) -> np.ndarray:
    times = metrics.get("step_times_s") or []
    timed = metrics.get("timed_steps")
    if isinstance(timed, list) and timed:
        times = [times[i] for i in timed if isinstance(i, int) and 0 <= i < len(times)]
    return np.asarray([x for x in times if isinstance(x, (int, float)) and not isinstance(x, bool)], dtype=float)


def timed_steps_of(trial: dict) -> int | None:
    """How many timed steps a stored trial's objective averages (its manifest's ``timed_steps``: not the
    warm-up, the profiled steps or the one after them); None where the trial does not say."""
    timed = (trial.get("metrics") or {}).get("timed_steps")
    return len(timed) if isinstance(timed, list) else None


def step_spread(metrics: dict) -> float:
    """Relative step-to-step spread of the timed steps, (p90 - p10) / median; 0 with fewer than 3.
    A property of the configuration (GC pauses, routing imbalance), read by the policy."""
    t = _timed_step_times(metrics)
    if len(t) < 3 or np.median(t) <= 0:
        return 0.0
    return float((np.percentile(t, 90) - np.percentile(t, 10)) / np.median(t))


def step_noise(metrics: dict) -> float:
    """Relative standard error of the objective: std / sqrt(n) / mean of the timed step times (the
    objective is tokens over their mean). It shrinks with more timed steps, unlike the spread; the
    guided search keeps a change only when its gain beats it (:meth:`autotune.sweep.Sweep.better`).
    0 with fewer than 3 timed steps (unknown)."""
    t = _timed_step_times(metrics)
    if len(t) < 3 or t.mean() <= 0:
        return 0.0
    return float(t.std(ddof=1) / np.sqrt(len(t)) / t.mean())


def memory_signals(metrics: dict, device_bytes: float | None, limit_gib: float | None) -> dict:
    """Peak memory (largest rank) and its share of the capacity: the space's limit, else the device's."""
    peaks = [p for p in (metrics.get("peak_memory_bytes") or []) if isinstance(p, (int, float))]
    if not peaks:
        return {}
    peak = max(peaks) / GIB
    cap = limit_gib if limit_gib is not None else (device_bytes / GIB if device_bytes else None)
    out = {"peak_memory_gib": round(peak, 4)}
    if cap:
        out["memory_capacity_gib"] = round(cap, 4)
        out["memory_used_share"] = round(peak / cap, 4)
    return out


def pipeline_signals(trace) -> dict:
    """Measured pipeline bubble vs theory and stage imbalance, from tracelens' pipeline analysis
    (``tracelens.analysis.pipeline``: RUN/pipeline/rank<N>.jsonl, else ``pipeline/*`` trace ranges).
    Empty when the run has no pipeline data or that analysis is not available in this checkout."""
    try:
        from tracelens.analysis import pipeline as P
    except ImportError:
        return {}
    res = P.pipeline_for_trace(trace)
    if res is None:
        return {}
    out: dict[str, Any] = {"bubble_ratio": round(float(res.overall_ratio), 4)}
    if np.isfinite(res.theory_ratio):
        out["bubble_theory"] = round(float(res.theory_ratio), 4)
    if np.isfinite(res.balance.slowest_ratio):
        out["stage_imbalance"] = round(float(res.balance.slowest_ratio), 4)
        out["stage_statement"] = str(res.balance.statement)
    return out


def analyze_run(run_dir: Path) -> tuple[list[dict], dict]:
    """Findings and signals of a trial's traces. Never raises: the sweep goes on without them."""
    try:
        return _analyze(run_dir)
    except Exception as e:  # noqa: BLE001 - a trace the analyzer chokes on must not stop the sweep
        return [], {"analysis_error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}


def _analyze(run_dir: Path) -> tuple[list[dict], dict]:
    import tracelens
    from tracelens.errors import TraceError

    try:
        a = tracelens.analyze(tracelens.load(run_dir, progress=False))
    except TraceError as e:
        return [], {"analysis_error": e.one_line()}
    findings = a.findings()
    signals = signals_of(a, findings)
    try:
        signals.update(pipeline_signals(a.trace))
    except Exception as e:  # noqa: BLE001 - pipeline data the analyzer rejects: no pipeline signals
        signals["pipeline_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return findings, signals


def signals_of(a, findings: list[dict]) -> dict:
    """What the guided policy reads besides the findings, from an Analysis (works on CPU traces too):

    moe_stage_us           host (CPU traces) or GPU time per ``moe/*`` record_function stage
    expert_gemms_per_call  GEMM ops per ``moe/experts`` call (a per-expert loop makes this ~E)
    moe_sync_ops           ops that force a host sync on a GPU (item, nonzero...) under ``moe/*``
    moe_host_syncs         host-sync findings' counts whose op path is in the MoE layer
    expert_gemm_pct_roof   time-weighted % of roofline of the expert GEMMs (GEMM shape families with a
                           varying dimension, and grouped GEMMs); absent without a GPU roofline
    device_memory_bytes    the GPU's capacity from the trace (used for memory headroom)
    """
    from tracelens.analysis.calltree import KIND_OP

    ann, t = a.annotations, a.tree
    stages: dict[str, float] = {}
    if not ann.empty:
        for name, g in ann.groupby("name", observed=True):
            if str(name).startswith("moe/"):
                col = "gpu_total_us" if g["gpu_total_us"].sum() > 0 else "host_total_us"
                stages[str(name)] = round(float(g[col].sum()), 3)
    ops = t[t["kind"] == KIND_OP]
    path = ops["path"].astype(str)
    names = ops["name"].astype(str)
    in_experts = path.str.contains("moe/experts", regex=False)
    calls = int(ann.loc[ann["name"].astype(str) == "moe/experts", "count"].sum()) if not ann.empty else 0
    gemms = int(names[in_experts].isin(["aten::mm", "aten::addmm", "aten::bmm"]).sum())
    sync_ops = int(names[path.str.contains("moe/", regex=False)]
                   .isin(["aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::bincount"]).sum())
    moe_syncs = sum(int(f["evidence"].get("count", 0)) for f in findings
                    if f["type"] == "host_sync" and _in_moe(f["evidence"]))
    out: dict[str, Any] = {"moe_stage_us": stages, "expert_gemms_per_call": round(gemms / calls, 3) if calls else 0.0,
                           "moe_sync_ops": sync_ops, "moe_host_syncs": moe_syncs}
    if a.has_gpu:
        try:
            r = a.roofline()
            tab = r.table
            sel = tab[(tab["family"].astype(str).str.contains("=*", regex=False))
                      | tab["op"].astype(str).str.contains("grouped_mm", regex=False)]
            sel = sel[sel["gpu_us"] > 0]
            if len(sel):
                out["expert_gemm_pct_roof"] = round(float((sel["pct_roof"] * sel["gpu_us"]).sum() / sel["gpu_us"].sum()), 2)
        except Exception:  # noqa: BLE001 - a device without ceilings: no roofline signal
            pass
        mems = [d.get("totalGlobalMem") for ri in a.trace.ranks for d in ri.device_properties]
        mems = [m for m in mems if isinstance(m, (int, float)) and m > 0]
        if mems:
            out["device_memory_bytes"] = float(min(mems))
    return out


def _in_moe(evidence: dict) -> bool:
    where = f"{evidence.get('path', '')} {evidence.get('python_stack', '')}".lower()
    return "moe" in where or "expert" in where

"""One trial = one real trainer run (a subprocess; torchrun when nproc > 1) plus its analysis.

The trainer runs in its own process group with a timeout; on timeout the whole group is killed (a hung
collective leaves no orphan ranks). Its output goes to RUN/trial.log. Failures are classified from
the exit status and log: `timeout` (hang), `oom` (out of memory), `config` (exit status 2: the trainer
rejected the config) or `crash`. A finished run is analyzed with tracelens: manifest metrics, the
step-time spread (noise), findings, and MoE-stage signals the guided search reads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .space import Space


@dataclass
class TrialResult:
    status: str  # ok | failed | timeout
    reason: str | None
    objective: float | None
    metrics: dict[str, Any] = field(default_factory=dict)
    findings: list[dict] = field(default_factory=list)


def trial_command(space: Space, knobs: dict, run_dir: Path) -> list[str]:
    base = space.command or [sys.executable, "-m", "trainer.launch"]
    cmd = list(base) + ["--config", space.config, "--nproc", str(space.nproc), "-o", str(run_dir)]
    for k, v in {**space.fixed, **knobs}.items():
        cmd += ["--set", f"{k}={_fmt(v)}"]
    return cmd


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return json.dumps(list(v))
    return str(v)


def run_trial(space: Space, knobs: dict, run_dir: Path, timeout_s: float | None = None) -> TrialResult:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = trial_command(space, knobs, run_dir)
    timeout_s = timeout_s or space.timeout_s
    log = run_dir / "trial.log"
    t0 = time.time()
    with open(log, "wb") as out:
        out.write(("$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return TrialResult("timeout", f"hang: no exit within {timeout_s:.0f} s (process group killed)", None)
    tail = log.read_text(errors="replace")[-4000:]
    if rc != 0:
        low = tail.lower()
        kind = "oom" if ("out of memory" in low or "outofmemory" in low) else ("config" if rc == 2 else "crash")
        last = next((ln for ln in reversed(tail.strip().splitlines()) if ln.strip()), "")
        return TrialResult("failed", f"{kind}: exit {rc}: {last[:300]}", None)
    try:
        metrics = json.loads((run_dir / "manifest.json").read_text()).get("metrics", {})
    except (OSError, ValueError) as e:
        return TrialResult("failed", f"crash: no readable manifest ({e})", None)
    metrics = dict(metrics)
    metrics["wall_s"] = round(time.time() - t0, 3)
    obj = metrics.get(space.metric)
    if not isinstance(obj, (int, float)):
        return TrialResult("failed", f"no objective: manifest metric {space.metric!r} is missing", None, metrics)
    metrics["noise"] = step_noise(metrics)
    findings, signals = analyze_run(run_dir)
    metrics["signals"] = signals
    return TrialResult("ok", None, float(obj), metrics, findings)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def step_noise(metrics: dict) -> float:
    """Relative step-to-step spread of the timed steps ((p90 - p10) / median), 0 when unknown."""
    times = metrics.get("step_times_s") or []
    timed = metrics.get("timed_steps")
    if isinstance(timed, list) and timed:
        times = [times[i] for i in timed if i < len(times)]
    t = np.asarray([x for x in times if isinstance(x, (int, float))], dtype=float)
    if len(t) < 3:
        return 0.0
    return float((np.percentile(t, 90) - np.percentile(t, 10)) / np.median(t))


def analyze_run(run_dir: Path) -> tuple[list[dict], dict]:
    """Findings (GPU traces) and MoE-stage signals (any trace) from the trial's run dir."""
    import tracelens
    from tracelens.analysis.calltree import KIND_OP
    from tracelens.errors import TraceError

    try:
        a = tracelens.analyze(tracelens.load(run_dir, progress=False))
    except TraceError as e:
        return [], {"error": e.one_line()}
    findings = a.findings()
    ann = a.annotations
    stages = {}
    if not ann.empty:
        for name, g in ann.groupby("name"):
            if str(name).startswith("moe/"):
                key = "gpu_total_us" if g["gpu_total_us"].sum() > 0 else "host_total_us"
                stages[str(name)] = float(g[key].sum())
    t = a.tree
    ops = t[(t["kind"] == KIND_OP) & t["path"].astype(str).str.contains("moe/experts", regex=False)]
    names = ops["name"].astype(str)
    calls = int((ann["name"] == "moe/experts").sum()) if not ann.empty else 0
    gemms = int(names.isin(["aten::mm", "aten::addmm", "aten::bmm"]).sum())
    sync_ops = int(t[(t["kind"] == KIND_OP) & t["path"].astype(str).str.contains("moe/", regex=False)]["name"]
                   .astype(str).isin(["aten::item", "aten::_local_scalar_dense", "aten::nonzero"]).sum())
    signals = {"moe_stage_us": stages, "expert_gemms_per_call": (gemms / calls) if calls else 0.0,
               "moe_sync_ops": sync_ops, "host_syncs": sum(f["evidence"].get("count", 0) for f in findings
                                                             if f["type"] == "host_sync")}
    return findings, signals

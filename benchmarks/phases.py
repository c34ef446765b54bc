"""Where a cold `tracelens.load` + `analyze` + `summary` spends its time, phase by phase.

    python benchmarks/phases.py TRACE [TRACE ...] [--repeat 3] [--json out.json]

Each run is a fresh process (as bench_load.py's tracelens runs), with timers wrapped around the
loader's and the analyses' entry points (the code under test is not changed). Per phase it prints the
median over the runs of the time spent in it; phases that ran on the prefetch thread are marked, since
they overlap the main thread's imports. `import` is the time to import pandas and the analyses in the
main thread (it overlaps the scan), `start` the interpreter's own start-up before the script's first line.
Used to compare two machines (e.g. the device machine's CPU with the development machine) per phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import sys, time
T = time.perf_counter
t_start = T()
import functools, importlib, json, os, threading
times = {}
def add(name, dt, thread=None):
    key = name if (thread or threading.current_thread().name) == "MainThread" else name + " [thread]"
    times[key] = times.get(key, 0.0) + dt
def wrap(modname, attr):
    mod = importlib.import_module(modname)
    owner, name = (mod, attr) if "." not in attr else (getattr(mod, attr.split(".")[0]), attr.split(".")[1])
    f = getattr(owner, name)
    @functools.wraps(f)
    def g(*a, **k):
        s = T()
        try:
            return f(*a, **k)
        finally:
            add(attr.split(".")[-1], T() - s)
    setattr(owner, name, g)
# only modules light enough to import before the load starts (no pandas): the scan must start as it does
wrap("tracelens.io.scanner", "Scan.run")
import tracelens
t0 = T()
tr = tracelens.load(sys.argv[1], cache=False, progress=False)
t1 = T()
# parts offloaded to a forked child (tracelens.offload) are timed there and not seen here: `result` is the
# parent's wait for them (or their time, when computed in the parent)
# the load imported these; wrapping now times the analysis (and, below, the load's own parts via the
# record the prefetch thread and the main thread left)
for modname, attr in [("tracelens.analysis.calltree", "build_tree"), ("tracelens.analysis.calltree", "attribute_gpu"),
                      ("tracelens.analysis.calltree", "gpu_events"), ("tracelens.analysis.steps", "step_window"),
                      ("tracelens.analysis.timeline", "gpu_timeline"), ("tracelens.analysis.summaries", "ops_summary"),
                      ("tracelens.analysis.summaries", "kernel_summary"), ("tracelens.analysis.summaries", "category_rollup"),
                      ("tracelens.analysis.summaries", "top_level_ops"), ("tracelens.analysis.summaries", "breakdown_tree"),
                      ("tracelens.analysis.summaries", "annotation_summary"), ("tracelens.analyzer", "_pipeline"),
                      ("tracelens.analyzer", "summary_core"), ("tracelens.offload", "Task.result")]:
    wrap(modname, attr)
# each derived entry (tracelens.derived) under its name: its own time, its inputs being computed before it
import dataclasses
from tracelens.analyzer import DERIVED
for e in list(DERIVED):
    def timed(*a, _f=e.fn, _n=e.name, **k):
        s = T()
        try:
            return _f(*a, **k)
        finally:
            add(_n, T() - s)
    DERIVED.entries[e.name] = dataclasses.replace(e, fn=timed)
a = tracelens.analyze(tr)
t2 = T()
s = a.summary()
t3 = T()
mods = {m: sys.modules.get(m) is not None for m in ("pandas", "pyarrow", "numpy")}
print(json.dumps({"script_start": t_start, "load": t1 - t0, "analyze": t2 - t1, "summary": t3 - t2,
                  "total": t3 - t_start, "phases": times, "events": int(len(tr.events))}))
"""

IMPORT = r"""
import time
t = time.perf_counter()
import pandas
t1 = time.perf_counter()
import tracelens.trace, tracelens.analyzer
t2 = time.perf_counter()
import json; print(json.dumps({"import pandas": t1 - t, "import tracelens": t2 - t1}))
"""


def run(code: str, *args: str) -> dict:
    t = time.time()
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=str(ROOT))
    wall = time.time() - t
    if p.returncode:
        raise SystemExit(f"phases.py: run failed on {args}: {p.stderr.strip().splitlines()[-1:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["wall"] = wall
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    imports = [run(IMPORT) for _ in range(a.repeat)]
    print("imports in a fresh process, median of", a.repeat, ":",
          ", ".join(f"{k} {statistics.median(r[k] for r in imports):.3f} s" for k in imports[0]))
    out = {"imports": imports, "traces": {}}
    for trace in a.traces:
        runs = [run(CHILD, trace) for _ in range(a.repeat)]
        out["traces"][trace] = runs
        keys = ["wall", "total", "load", "analyze", "summary"]
        print(f"\n{trace}: {runs[0]['events']:,} events, median of {a.repeat} fresh processes")
        for k in keys:
            print(f"  {k:<28} {statistics.median(r[k] for r in runs):7.3f} s")
        names = sorted({n for r in runs for n in r["phases"]}, key=lambda n: -statistics.median(r["phases"].get(n, 0) for r in runs))
        for n in names:
            print(f"    {n:<26} {statistics.median(r['phases'].get(n, 0.0) for r in runs):7.3f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

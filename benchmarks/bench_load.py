#!/usr/bin/env python3
"""Load + full breakdown of a large trace: tracelens vs HolisticTraceAnalysis, side by side, one run.

Builds a ~200 MB trace by tiling a real fixture in time (benchmarks/scale_trace.py), then times, each in
a fresh subprocess so wall time and peak RSS are the process's own:
  - tracelens cold:  load (no cache) + analyze (timeline, call tree, ops/kernels/categories, breakdown)
  - tracelens warm:  the same with the Parquet cache already filled
  - HTA cold:        TraceAnalysis(trace_dir=...) + get_temporal_breakdown + get_gpu_kernel_breakdown
  - HTA warm:        HTA has no parsed-trace cache of its own; a second cold run is shown for the spread
and prints wall seconds, peak RSS (MB, the child's ru_maxrss) and the ratios HTA / tracelens.

    pip install --no-deps HolisticTraceAnalysis==0.5.0 && pip install psutil networkx pydot
    python benchmarks/bench_load.py                      # 200 MB from the A100 trace_diff fixture
    python benchmarks/bench_load.py --target-mb 1000 --src tests/fixtures/h200_moe_1gpu/moe1gpu_loop.json.gz
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from scale_trace import scale  # noqa: E402

DEFAULT_SRC = ROOT / "tests" / "fixtures" / "external" / "hta" / "trace_diff" / "control.json.gz"

TRACELENS = """
import sys, time, json
t0 = time.perf_counter()
import tracelens
tr = tracelens.load(sys.argv[1], cache=sys.argv[2] == "1", cache_dir=sys.argv[3], progress=False)
t1 = time.perf_counter()
a = tracelens.analyze(tr)
s = a.summary()
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "analyze_s": t2 - t1, "busy_us": s["ranks"][0]["gpu_busy_us"],
                  "kernels": int((a.gpu["kind"] == "kernel").sum())}))
"""

HTA = """
import sys, time, json, logging
logging.disable(logging.WARNING)
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
ta = TraceAnalysis(trace_dir=sys.argv[1])
t1 = time.perf_counter()
tb = ta.get_temporal_breakdown(visualize=False)
kb = ta.get_gpu_kernel_breakdown(visualize=False)
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "analyze_s": t2 - t1, "busy_us": None, "kernels": None}))
"""


def run_isolated(code: str, *args: str) -> dict:
    """Measure in a wrapper process so RUSAGE_CHILDREN holds exactly one child's peak."""
    wrapper = (
        "import json, resource, subprocess, sys, time\n"
        "t0 = time.perf_counter()\n"
        "p = subprocess.run([sys.executable, '-c', sys.argv[1], *sys.argv[2:]], capture_output=True)\n"
        "wall = time.perf_counter() - t0\n"
        "if p.returncode: sys.stderr.write(p.stderr.decode()); sys.exit(p.returncode)\n"
        "r = json.loads(p.stdout.decode().strip().splitlines()[-1])\n"
        "r.update(wall_s=wall, peak_mb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)\n"
        "print(json.dumps(r))\n"
    )
    p = subprocess.run([sys.executable, "-c", wrapper, code, *args], capture_output=True, cwd=str(ROOT))
    if p.returncode:
        raise SystemExit(f"benchmark child failed:\n{p.stderr.decode()[-3000:]}")
    return json.loads(p.stdout.decode().strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(DEFAULT_SRC), help="real trace to tile")
    ap.add_argument("--target-mb", type=float, default=200.0)
    ap.add_argument("--work", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--no-hta", action="store_true", help="skip HolisticTraceAnalysis")
    ap.add_argument("--repeat", type=int, default=1, help="repeat each measurement, report the median")
    a = ap.parse_args()

    work = Path(a.work or tempfile.mkdtemp(prefix="tracelens-bench-"))
    trace_dir = work / "trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    trace = trace_dir / "rank0.json"
    if not trace.exists():
        t = time.perf_counter()
        copies, n = scale(a.src, str(trace), target_mb=a.target_mb)
        print(f"built {trace} ({trace.stat().st_size / 1e6:.0f} MB, {n:,} events, {copies} copies) in "
              f"{time.perf_counter() - t:.1f}s", file=sys.stderr)
    size_mb = trace.stat().st_size / 1e6
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)

    def median(runs: list[dict]) -> dict:
        runs = sorted(runs, key=lambda r: r["wall_s"])
        return runs[len(runs) // 2]

    rows = []
    cold = median([run_isolated(TRACELENS, str(trace), "0", str(cache)) for _ in range(a.repeat)])
    rows.append(("tracelens", "cold", cold))
    run_isolated(TRACELENS, str(trace), "1", str(cache))  # fill the cache
    warm = median([run_isolated(TRACELENS, str(trace), "1", str(cache)) for _ in range(a.repeat)])
    rows.append(("tracelens", "warm cache", warm))
    hta = None
    if not a.no_hta:
        try:
            import hta  # noqa: F401
        except ImportError:
            print("HolisticTraceAnalysis not installed: pip install --no-deps HolisticTraceAnalysis==0.5.0 "
                  "psutil networkx pydot", file=sys.stderr)
        else:
            hta = median([run_isolated(HTA, str(trace_dir)) for _ in range(a.repeat)])
            rows.append(("HTA 0.5.0", "cold", hta))
            hta2 = run_isolated(HTA, str(trace_dir))
            rows.append(("HTA 0.5.0", "again (no cache)", hta2))

    print(f"\ntrace: {size_mb:.0f} MB uncompressed, tiled from {Path(a.src).name}; machine: {os.cpu_count()} CPUs")
    print(f"{'tool':<11} {'run':<17} {'wall s':>7} {'load s':>7} {'analyze s':>9} {'peak RSS MB':>11}")
    for tool, kind, r in rows:
        print(f"{tool:<11} {kind:<17} {r['wall_s']:>7.2f} {r['load_s']:>7.2f} {r['analyze_s']:>9.2f} {r['peak_mb']:>11.0f}")
    if hta:
        print(f"\nHTA / tracelens wall time: cold {hta['wall_s'] / cold['wall_s']:.1f}x, "
              f"vs warm cache {hta['wall_s'] / warm['wall_s']:.1f}x; "
              f"peak RSS ratio {hta['peak_mb'] / cold['peak_mb']:.1f}x")
    print(json.dumps({"size_mb": size_mb, "rows": [{"tool": t, "run": k, **r} for t, k, r in rows]}), file=sys.stderr)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Load + full breakdown of a large trace: tracelens vs HolisticTraceAnalysis, side by side, one run.

Builds a ~200 MB trace by tiling a real fixture in time (benchmarks/scale_trace.py), then times, each in
a fresh subprocess so wall time and peak RSS are the process's own:
  - tracelens cold:  load (no cache) + analyze (timeline, call tree, ops/kernels/categories, breakdown)
  - tracelens warm:  the same with the Parquet cache already filled
  - tracelens cold, msgspec path: TRACELENS_PURE_PYTHON=1, the decoder of an install without a C
    compiler (the compiled scanner's fallback), with its forked workers
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
sys.path.append(str(ROOT))  # tracelens from the checkout when it is not installed (the children run in ROOT)
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


_WRAPPER = """
import json, resource, subprocess, sys, threading, time
try:
    import psutil
except ImportError:
    psutil = None
t0 = time.perf_counter()
p = subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
tree_peak = [0]
def sample():  # summed PSS of the child and its descendants (forked parser workers included)
    if psutil is None or not int(__import__('os').environ.get('BENCH_SAMPLE_PSS', '0')):
        return
    try:
        root = psutil.Process(p.pid)
    except psutil.Error:
        return
    while p.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
            # PSS splits each shared page among the processes that map it, so pages shared
            # copy-on-write after fork are counted once, as physical memory is used
            tree_peak[0] = max(tree_peak[0], sum(q.memory_full_info().pss for q in procs))
        except psutil.Error:
            pass
        time.sleep(0.02)
th = threading.Thread(target=sample, daemon=True); th.start()
out, err = p.communicate()
wall = time.perf_counter() - t0
th.join(1)
if p.returncode:
    sys.stderr.write(err.decode()); sys.exit(p.returncode)
r = json.loads(out.decode().strip().splitlines()[-1])
r.update(wall_s=wall, peak_mb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
         tree_peak_mb=(tree_peak[0] / 2**20) or None)
print(json.dumps(r))
"""


def run_isolated(code: str, *args: str, env: dict | None = None) -> dict:
    """Run `code` in a fresh interpreter under a wrapper, so RUSAGE_CHILDREN holds exactly its peak
    (the largest single process). Wall time is measured without PSS sampling (which costs CPU); a
    second run with sampling gives the process tree's physical memory (summed PSS)."""
    e = {**os.environ, **(env or {})}
    p = subprocess.run([sys.executable, "-c", _WRAPPER, code, *args], capture_output=True, cwd=str(ROOT), env=e)
    if p.returncode:
        raise SystemExit(f"benchmark child failed:\n{p.stderr.decode()[-3000:]}")
    timed = json.loads(p.stdout.decode().strip().splitlines()[-1])
    p = subprocess.run([sys.executable, "-c", _WRAPPER, code, *args], capture_output=True, cwd=str(ROOT),
                       env={**e, "BENCH_SAMPLE_PSS": "1"})
    if p.returncode:
        raise SystemExit(f"benchmark child failed:\n{p.stderr.decode()[-3000:]}")
    timed["tree_peak_mb"] = json.loads(p.stdout.decode().strip().splitlines()[-1]).get("tree_peak_mb")
    return timed


DECODERS = """
import sys, json, time, gzip
data = open(sys.argv[1], 'rb').read()
res = {}
t = time.perf_counter(); json.loads(data); res['json'] = time.perf_counter() - t
try:
    import orjson
    t = time.perf_counter(); orjson.loads(data); res['orjson'] = time.perf_counter() - t
except ImportError:
    pass
import msgspec
t = time.perf_counter(); msgspec.json.decode(data); res['msgspec (untyped)'] = time.perf_counter() - t
from tracelens.io.kineto import BATCH, _DOC, _decode_batch, _json_array
t = time.perf_counter()
raws = _DOC.decode(data).traceEvents
for lo in range(0, len(raws), BATCH):
    _decode_batch('', _json_array(raws[lo:lo + BATCH]))
res['msgspec (typed, as tracelens)'] = time.perf_counter() - t
print(json.dumps(res))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(DEFAULT_SRC), help="real trace to tile")
    ap.add_argument("--target-mb", type=float, default=200.0)
    ap.add_argument("--work", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--no-hta", action="store_true", help="skip HolisticTraceAnalysis")
    ap.add_argument("--repeat", type=int, default=1, help="repeat each measurement, report the median")
    ap.add_argument("--decoders", action="store_true", help="also time JSON decoders on the trace")
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
    shutil.rmtree(cache, ignore_errors=True)
    # the decoder a machine without a C compiler gets (forked workers over the affinity mask's CPUs)
    pure = median([run_isolated(TRACELENS, str(trace), "0", str(cache), env={"TRACELENS_PURE_PYTHON": "1"})
                   for _ in range(a.repeat)])
    rows.append(("tracelens", "cold, msgspec path", pure))
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

    from tracelens.io.kineto import decoder

    print(f"\ntrace: {size_mb:.0f} MB uncompressed, tiled from {Path(a.src).name}; "
          f"CPUs usable: {len(os.sched_getaffinity(0))} of {os.cpu_count()}; decoder: {decoder()}")
    print(f"{'tool':<11} {'run':<17} {'wall s':>7} {'load s':>7} {'analyze s':>9} {'peak RSS MB':>11} {'tree PSS MB':>11}")
    for tool, kind, r in rows:
        tree = f"{r['tree_peak_mb']:>11.0f}" if r.get("tree_peak_mb") else f"{'n/a':>11}"
        print(f"{tool:<11} {kind:<17} {r['wall_s']:>7.2f} {r['load_s']:>7.2f} {r['analyze_s']:>9.2f} {r['peak_mb']:>11.0f} {tree}")
    print("peak RSS = the largest single process (ru_maxrss); tree PSS = physical memory of the process and"
          " its forked parser workers together (summed proportional set size, sampled every 20 ms)")
    if hta:
        print(f"\nHTA / tracelens wall time: cold {hta['wall_s'] / cold['wall_s']:.1f}x, "
              f"vs warm cache {hta['wall_s'] / warm['wall_s']:.1f}x; "
              f"peak RSS ratio {hta['peak_mb'] / cold['peak_mb']:.1f}x")
    if a.decoders:
        dec = run_isolated(DECODERS, str(trace))
        dec.pop("tree_peak_mb", None)
        print("\nJSON decode of the whole file (s): " + ", ".join(
            f"{k} {v:.2f}" for k, v in dec.items() if k not in ("wall_s", "peak_mb", "tree_peak_mb")))
    print(json.dumps({"size_mb": size_mb, "rows": [{"tool": t, "run": k, **r} for t, k, r in rows]}), file=sys.stderr)


if __name__ == "__main__":
    main()

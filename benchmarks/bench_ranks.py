#!/usr/bin/env python3
"""Many ranks on a local Dask cluster: N ranks x M MB tiled from a real multi-rank run, W workers.

Reports the wall time of `tracelens.scale.analyze_ranks` on a LocalCluster (W single-threaded worker
processes), every worker's peak RSS (the worker process's own ru_maxrss, read on the worker through
`client.run`), the driver's peak RSS, whether the summary equals the single-process path's, and the
per-rank costs that the extrapolation in docs/performance.md uses: one rank reduced alone in a fresh
process (seconds, peak RSS), the size of its light reduction (what the driver gathers) and of its
compact GPU table (what a worker keeps until the windowed step).

    python benchmarks/bench_ranks.py --ranks 64 --mb 200 --workers 2          # the issue's target (12.8 GB of traces)
    python benchmarks/bench_ranks.py --ranks 8 --mb 20 --workers 2 --compare full   # also vs analyze(load(all))

--compare inprocess (default): the same per-rank functions in this process, one rank at a time;
full: the all-in-memory `analyze(load(...))` (needs every rank in RAM: small runs only); none.
The traces are written under --dir (default: a temp dir) and deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
SHARED = ("schema_version", "tool", "world_size", "window", "ranks", "categories", "warnings")

_ONE_RANK = r"""
import json, pickle, sys, time
def hwm():  # this process's peak RSS (VmHWM: ru_maxrss would carry the parent's over fork + exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
from tracelens import scale
from tracelens.analysis import calltree, comm, pipeline, steps, summaries, timeline  # imports not timed
base = hwm()
t0 = time.perf_counter()
rt = scale.reduce_rank(sys.argv[1], 0, 1, cache=False)
t1 = time.perf_counter()
used = sorted(int(s) for s in rt.steps["step"].unique())  # every step: the timeline is recomputed as in steady mode
plan = scale.WindowPlan(restricts=bool(used), used=used, cuts={}, whole_gpu=False)
scale.window_rank(rt, plan)
t2 = time.perf_counter()
print(json.dumps({"reduce_s": t1 - t0, "window_s": t2 - t1,
                  "peak_rss_mb": hwm(), "imports_rss_mb": base,
                  "light_mb": len(pickle.dumps(rt.light())) / 1e6, "gpu_table_mb": len(pickle.dumps(rt.gpu)) / 1e6,
                  "events": rt.n_events, "gpu_events": rt.n_gpu, "comm_rows": len(rt.comm)}))
"""


def _peak_rss_mb() -> float:
    """This process's peak RSS in MB: VmHWM of /proc/self/status (Linux). Not ru_maxrss, which Linux
    carries over fork + exec, so a worker spawned by a large parent would report the parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker_peak() -> float:
    """Run on each Dask worker process (client.run): its peak RSS in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one_rank(path: Path) -> dict:
    """One rank reduced alone in a fresh process (no cache): seconds, peak RSS, reduction sizes."""
    p = subprocess.run([sys.executable, "-c", _ONE_RANK, str(path)], capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--mb", type=float, default=200.0, help="size of each rank file (uncompressed JSON, MB)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--memory-limit", default="auto", help="Dask memory limit per worker (e.g. 2GB)")
    ap.add_argument("--source", default=str(ROOT / "tests/fixtures/h200_ep2_run/L0_loop"),
                    help="the real multi-rank run to tile (default: the 2 x H200 EP run)")
    ap.add_argument("--dir", default=None, help="where to write the rank files (default: a temp dir)")
    ap.add_argument("--compare", choices=("inprocess", "full", "none"), default="inprocess")
    ap.add_argument("--keep", action="store_true", help="keep the generated traces")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)

    base = Path(a.dir) if a.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    need = a.ranks * a.mb * 1e6 * 1.1
    free = shutil.disk_usage(base).free
    if free < need + 5e9:
        sys.exit(f"{base}: {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed (+5 GB margin): try fewer ranks or MB")
    work = Path(tempfile.mkdtemp(prefix="tracelens-ranks-", dir=base))
    out: dict = {"ranks": a.ranks, "mb": a.mb, "workers": a.workers, "memory_limit": a.memory_limit,
                 "source": a.source, "cpus": os.cpu_count()}
    try:
        t = time.perf_counter()  # in a subprocess: this process's peak RSS is the analysis's alone
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tile_ranks.py"), a.source, str(work),
                        "--ranks", str(a.ranks), "--target-mb", str(a.mb)], check=True)
        files = sorted(work.glob("rank*.json"), key=lambda f: int(f.name[4:-5]))
        out["tile_s"] = round(time.perf_counter() - t, 1)
        out["total_gb"] = round(sum(f.stat().st_size for f in files) / 1e9, 2)
        print(f"tiled {len(files)} ranks, {out['total_gb']} GB in {out['tile_s']} s", file=sys.stderr)
        out["one_rank"] = one_rank(files[0])
        print(f"one rank alone: {out['one_rank']}", file=sys.stderr)

        import dask
        from distributed import Client, LocalCluster

        from tracelens import scale

        dask.config.set({"distributed.scheduler.allowed-failures": 0})
        t = time.perf_counter()
        with LocalCluster(n_workers=a.workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                          memory_limit=a.memory_limit, silence_logs=50) as cluster, Client(cluster) as client:
            t_up = time.perf_counter()
            res = scale.analyze_ranks(work, cache=False, client=client)
            t_done = time.perf_counter()
            peaks = client.run(_worker_peak)
        out["dask_phases_s"] = res.timings
        out["cluster_start_s"] = round(t_up - t, 2)
        out["dask_wall_s"] = round(t_done - t_up, 2)
        out["worker_peak_rss_mb"] = {k: round(v, 1) for k, v in peaks.items()}
        out["driver_peak_rss_mb"] = round(_peak_rss_mb(), 1)
        print(f"dask: {out['dask_wall_s']} s on {a.workers} workers (+{out['cluster_start_s']} s start-up); worker peak "
              f"RSS {sorted(out['worker_peak_rss_mb'].values())} MB; driver {out['driver_peak_rss_mb']} MB", file=sys.stderr)
        got = res.summary()
        if a.compare != "none":
            import tracelens

            t = time.perf_counter()
            if a.compare == "full":
                want = tracelens.analyze(tracelens.load(work, cache=False)).summary()
            else:
                ref = scale.analyze_ranks(work, cache=False)
                out["inprocess_phases_s"] = ref.timings
                want = ref.summary()
                want_comm = want["comm"]
                out["comm_equal"] = got["comm"] == want_comm and got["pipeline"] == want["pipeline"]
            out[f"{a.compare}_s"] = round(time.perf_counter() - t, 2)
            out["summary_equal"] = all(got[k] == want[k] for k in SHARED)
            out["driver_peak_rss_after_compare_mb"] = round(_peak_rss_mb(), 1)
            print(f"{a.compare}: {out[f'{a.compare}_s']} s; summary equal: {out['summary_equal']}", file=sys.stderr)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            out["dir"] = str(work)
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

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

Corpus mode (issues 20, 37): every trace of CORPUS below tiled to --target-mb; per trace, each in a fresh
subprocess, median of --repeat runs (default 3): `tracelens analyze TRACE -o OUT` as users run it (report,
tables and summary.json written, the cache on in an empty TRACELENS_CACHE_DIR: a first run), the API path
(load without cache + analyze + summary) and HTA cold (skipped, with one line, where it is not installed),
one trace after the other; prints a per-trace table (wall and CPU seconds, peak RSS, report size) and the
minimum HTA / CLI ratio over the corpus (the issue's measure) beside the minimum HTA / API ratio:
    python benchmarks/bench_load.py --corpus --work /tmp/corpus            # all, 200 MB, 3 repeats
    python benchmarks/bench_load.py --corpus --only moe_loop,cpu_tiny --repeat 1 --target-mb 50
    python benchmarks/bench_load.py --corpus --no-hta --json out.json      # tracelens only
    python benchmarks/bench_load.py --corpus --no-cli                      # the API path and HTA only
    git worktree add --detach /tmp/before main && (cd /tmp/before && python setup.py -q build_ext --inplace)
    python benchmarks/bench_load.py --corpus --compare-root /tmp/before    # + that checkout's CLI, alternating

Big mode (issue 20, bounded memory): one trace (default: the H200 MoE loop fixture) tiled to --target-mb
by every CPU this process may use, then cold load + analyze + summary in fresh processes pinned to --cpus,
up to --repeat runs while --budget seconds allow; prints wall time, load / analyze+summary time and peak
RSS (whole run, and peak so far after the load and after analyze), writes big-<MB>MB.json / .txt into --out
(default $OUT when set) and deletes the trace unless --keep (benchmarks/bench_big.sh runs it on the
device machine's CPU):
    python benchmarks/bench_load.py --big --target-mb 2000 --cpus 0,1 --repeat 3 --work /tmp/big
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
import sys, time, json, resource
maxrss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MB, peak so far
t0 = time.perf_counter()
import tracelens
tr = tracelens.load(sys.argv[1], cache=sys.argv[2] == "1", cache_dir=sys.argv[3], progress=False)
t1 = time.perf_counter()
m1 = maxrss()
a = tracelens.analyze(tr)
m2 = maxrss()
s = a.summary()
t2 = time.perf_counter()
r0 = s["ranks"][0]["all_steps"] if s.get("ranks") else {}  # the whole profiled window, as HTA reads it
print(json.dumps({"load_s": t1 - t0, "analyze_s": t2 - t1, "busy_us": r0.get("gpu_busy_us"),
                  "kernels": int((a.gpu["kind"] == "kernel").sum()), "events": int(len(tr.events)),
                  "steps": int(a.steps["step"].nunique()) if len(a.steps) else 0,
                  "peak_load_mb": m1, "peak_analyze_mb": m2}))
"""

# `tracelens analyze TRACE -o OUT` as users run it: the console script's entry point in a fresh interpreter (what the
# `tracelens` script does), report, tables and summary.json written, the cache at its default (on) in an empty
# TRACELENS_CACHE_DIR (a user's first run: the trace parsed and its cache entry written, plotly.js packed)
CLI = """
import atexit, json, os, sys, time
t0 = time.perf_counter()
out = sys.argv[2]

def timed():  # at exit, as the program leaves (its own exit skips the teardown: tracelens.cli.entry)
    print(json.dumps({"cli_s": time.perf_counter() - t0,
                      "report_mb": os.path.getsize(os.path.join(out, "report.html")) / 1e6,
                      "summary_mb": os.path.getsize(os.path.join(out, "summary.json")) / 1e6}), flush=True)

atexit.register(timed)
try:
    from tracelens.cli import entry
except ImportError:  # an older checkout (--compare-root): its click main, left through the interpreter's own exit
    from tracelens.cli import main as entry
entry(["analyze", sys.argv[1], "-o", out, "-q"])
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
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
r.update(wall_s=wall, peak_mb=ru.ru_maxrss / 1024, cpu_s=ru.ru_utime + ru.ru_stime,
         tree_peak_mb=(tree_peak[0] / 2**20) or None)
print(json.dumps(r))
"""


def run_isolated(code: str, *args: str, env: dict | None = None, pss: bool = True, cwd: Path = ROOT,
                 timeout: float | None = None, cpus: list[int] | None = None) -> dict:
    """Run `code` in a fresh interpreter under a wrapper, so RUSAGE_CHILDREN holds exactly its peak
    (the largest single process). Wall time is measured without PSS sampling (which costs CPU); a
    second run with sampling (unless `pss` is false) gives the process tree's physical memory (summed PSS).
    cpus: pin the run to these CPUs (as `taskset -c`), whatever this process may use."""
    e = {**os.environ, **(env or {})}
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    if timeout is not None or pin is not None:  # its own session, so the child it runs can be stopped with it
        proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, code, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=str(cwd), env=e, start_new_session=True,
                                preexec_fn=pin)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            return {"wall_s": float(timeout), "timed_out": True, "load_s": float("nan"), "analyze_s": float("nan"),
                    "peak_mb": float("nan")}
        p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    else:
        p = subprocess.run([sys.executable, "-c", _WRAPPER, code, *args], capture_output=True, cwd=str(cwd), env=e)
    if p.returncode:
        raise SystemExit(f"benchmark child failed:\n{p.stderr.decode()[-3000:]}")
    timed = json.loads(p.stdout.decode().strip().splitlines()[-1])
    if not pss:
        return timed
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


_FX = ROOT / "tests" / "fixtures"
# ../shared as the project finds it, or TRACELENS_CORPUS_EXTERNAL (a copy of it, e.g. carried to the device machine)
_EXT = Path(os.environ.get("TRACELENS_CORPUS_EXTERNAL") or ROOT.parent / "shared" / "fixtures" / "external").resolve()
# (name, trace file, what kind of trace it is); the external ones fall back to tests/fixtures/external
CORPUS = [
    ("moe_loop", _FX / "h200_moe_1gpu" / "moe1gpu_loop.json.gz", "H200 MoE 1 GPU, per-expert loop, syncs"),
    ("moe_grouped", _FX / "h200_moe_1gpu" / "moe1gpu_grouped.json.gz", "H200 MoE 1 GPU, grouped GEMM"),
    ("ep2_loop_r0", _FX / "h200_ep2_run" / "L0_loop" / "traces" / "rank0.json.gz", "H200 EP=2 run, rank 0, NCCL"),
    ("pp2_1f1b_r0", _FX / "h200_pp2_run" / "1f1b" / "traces" / "rank0.json.gz", "H200 PP=2 1F1B run, rank 0"),
    ("a100_control", _EXT / "hta" / "trace_diff" / "control.json.gz", "A100 training, world 8 (HTA data)"),
    ("v100_test", _EXT / "hta" / "trace_diff" / "test.json.gz", "V100 training, world 2 (HTA data)"),
    ("a100_alexnet", _EXT / "hta" / "benchmark_result_2869224_1695835535_trace.json.gz", "A100 AlexNet"),
    ("mi250", _EXT / "hta" / "mi250_minitoy_train_ROCm6_2_kineto.json.gz", "AMD MI250, ROCm 6.2"),
    ("mi300_resnet", _EXT / "tracelens" / "mi300_resnet_act_checkpoint.json.gz", "AMD MI300X ResNet, RCCL"),
    ("mi300_sglang", _EXT / "tracelens" / "mi300_sglang_qwen3_8b_prefilldecode.json.gz", "MI300X SGLang serving"),
    ("b200_eager", _EXT / "tracelens" / "b200_eager.json.gz", "B200 eager training, rank of 8"),
    ("h100_owlv2", _EXT / "tracelens" / "h100_owlv2_inference.json.gz", "H100 inference, Python stacks"),
    ("h100_timesformer", _EXT / "tracelens" / "h100_timesformer.json.gz", "H100 TimeSformer inference"),
    ("cpu_tiny", _FX / "cpu_tiny" / "rank0.json.gz", "CPU only, trainer tiny, record_shapes, deep op stacks"),
    # the kinds our trainer makes on GPUs (issue 37): one profiled step or two per source, so a 200 MB tile holds
    # 16-50 steps of a few thousand GPU events each
    ("h100_moe_mbs8", _FX / "h100_proxy_loop_mbs8" / "traces" / "rank0.json.gz",
     "H100 MoE 1 GPU, proxy model, per-expert loop, mbs 8 (12 MB a step)"),
    ("ep4_cap_ovl_r0", _FX / "h100_4gpu" / "ep4_cap_ovl" / "traces" / "rank0.json.gz",
     "4 x H100 EP=4 run, rank 0: capacity all-to-all overlapped, NCCL"),
    ("pp4_1f1b_r0", _FX / "h100_4gpu" / "pp4_1f1b" / "traces" / "rank0.json.gz",
     "4 x H100 PP=4 1F1B run, rank 0: send/recv, NCCL"),
    ("ep4_mbs16_r0", _FX / "h100_4gpu_layouts" / "ep4_cap_mbs16" / "traces" / "rank0.json.gz",
     "4 x H100 layout run EP=4, mbs 16, rank 0 (4.8 MB a step)"),
    ("dp4_mbs16_r0", _FX / "h100_4gpu_layouts" / "dp4_mbs16" / "traces" / "rank0.json.gz",
     "4 x H100 layout run DP=4, mbs 16, rank 0: all-reduce (4.0 MB a step)"),
    # a foreign kind not in the corpus before: one Triton kernel per profiled step (16 KB), so a 200 MB tile is
    # ~80,000 steps of a dozen events: per-step work that grows with the number of steps shows here first
    ("a100_triton", _EXT / "hta" / "triton_example.json.gz", "A100, one Triton kernel per step (HTA data)"),
]


def corpus_source(path: Path) -> Path:
    if path.exists():
        return path
    alt = _FX / "external" / path.relative_to(_EXT) if _EXT in path.parents else path
    if alt.exists():
        return alt
    raise SystemExit(f"{path}: corpus trace not found (not copied into tests/fixtures/external: set "
                     "TRACELENS_CORPUS_EXTERNAL to a directory holding it; tests/fixtures/README.md says where it is from)")


def _median(runs: list[dict]) -> dict:
    runs = sorted(runs, key=lambda r: r["wall_s"])
    return runs[len(runs) // 2]


def tile(src: Path, work: Path, name: str, target_mb: float) -> Path:
    """The tiled copy of `src` under work/<name>-<MB>/rank0.json, built once (its own directory: HTA
    reads every file of a directory)."""
    d = work / f"{name}-{target_mb:g}MB"
    trace = d / "rank0.json"
    if not trace.exists():
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "rank0.json.part"
        t = time.perf_counter()
        copies, n = scale(str(src), str(tmp), target_mb=target_mb)
        os.replace(tmp, trace)
        print(f"built {trace} ({trace.stat().st_size / 1e6:.0f} MB, {n:,} events, {copies} copies) in "
              f"{time.perf_counter() - t:.1f}s", file=sys.stderr)
    return trace


def run_cli(trace: Path, work: Path, cwd: Path = ROOT) -> dict:
    """One `tracelens analyze TRACE -o OUT` in a fresh process (the CLI child above) with an empty cache directory
    and output directory of its own under `work`, both removed after: wall and CPU seconds, peak RSS, report size."""
    d = Path(tempfile.mkdtemp(prefix="cli-", dir=work))
    try:
        return run_isolated(CLI, str(trace), str(d / "out"), env={"TRACELENS_CACHE_DIR": str(d / "cache")}, pss=False,
                            cwd=cwd)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def hta_available() -> bool:
    """Whether HolisticTraceAnalysis can be imported here (looked up without importing it: nothing is fetched)."""
    import importlib.util

    return importlib.util.find_spec("hta") is not None


def run_corpus(names: list[str] | None, target_mb: float, work: Path, repeat: int = 3, hta: bool = True,
               log=None, compare_root: Path | None = None, hta_timeout: float | None = None,
               cli: bool = True, api_repeat: int | None = None) -> list[dict]:
    """Each corpus trace (or those named) tiled to `target_mb`, then per trace, `repeat` fresh processes each and
    their medians: `tracelens analyze TRACE -o OUT` as users run it (`cli`: report, tables and summary.json
    written, cold cache), the API path (`tracelens`: load without cache + analyze + summary), and with `hta`
    HolisticTraceAnalysis cold (load + temporal and kernel breakdowns) in the same minutes. One dict per trace;
    `ratio` is HTA / the CLI (the issue's measure; HTA / the API path without the CLI: `ratio_api`).
    compare_root: another checkout of the project (e.g. `git worktree add --detach DIR main`, with the compiled
    scanner copied or built there) whose CLI runs the same way, alternating with this one's ("before").
    hta_timeout: an HTA run stopped after this many seconds counts as that long (the ratio is then a lower
    bound) and is not repeated. api_repeat: runs of the API path (default `repeat`; 1 where a device call's minutes
    go to the CLI and HTA: it still gives the trace's events, steps and GPU busy time)."""
    known = {n for n, _, _ in CORPUS}
    bad = [n for n in (names or []) if n not in known]
    if bad:
        raise SystemExit(f"unknown corpus trace(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
    rows = []
    for name, src, what in CORPUS:
        if names and name not in names:
            continue
        trace = tile(corpus_source(src), work, name, target_mb)
        cache = work / "cache-unused"
        clis, befores = [], []
        for _ in range(repeat if (cli or compare_root) else 0):  # alternating, so both see the same minutes
            if cli:
                clis.append(run_cli(trace, work))
            if compare_root:
                befores.append(run_cli(trace, work, cwd=compare_root))
        tl = _median([run_isolated(TRACELENS, str(trace), "0", str(cache), pss=False)
                      for _ in range(repeat if api_repeat is None else max(1, api_repeat))])
        row = {"name": name, "what": what, "size_mb": trace.stat().st_size / 1e6, "tracelens": tl,
               "cli": _median(clis) if clis else None, "hta": None}
        if befores:
            row["before"] = _median(befores)
        if hta:
            try:
                runs = []
                for _ in range(repeat):
                    runs.append(run_isolated(HTA, str(trace.parent), pss=False, timeout=hta_timeout))
                    if runs[-1].get("timed_out"):
                        break
                row["hta"] = runs[-1] if runs[-1].get("timed_out") else _median(runs)
            except SystemExit as err:  # HTA fails on some traces: say so, leave it out of the ratio
                row["hta_error"] = str(err).strip().splitlines()[-1][:200]
        if row["hta"]:
            h = row["hta"]["wall_s"]
            row["ratio_api"] = h / tl["wall_s"]
            if row["cli"]:
                row["ratio"] = h / row["cli"]["wall_s"]
            if row.get("before"):
                row["ratio_before"] = h / row["before"]["wall_s"]
        rows.append(row)
        if log:
            log(format_corpus([row], header=not rows[:-1], footer=False))
    return rows


def _ratio(row: dict, key: str) -> str:
    """A ratio cell: '12.3x', '>=12.3x' when HTA was stopped at the timeout, blank when there is none."""
    if not row.get(key):
        return f"{'':>7}"
    return f"{'>=' + format(row[key], '.1f') + 'x':>7}" if row["hta"].get("timed_out") else f"{row[key]:>6.1f}x"


def format_corpus(rows: list[dict], header: bool = True, footer: bool = True) -> str:
    out = []
    before = any(r.get("before") for r in rows)
    if header:
        out.append(f"{'trace':<17} {'MB':>5} {'events':>9} {'steps':>6} {'CLI s':>6} {'CLI cpu':>7} {'CLI MB':>6} "
                   f"{'page MB':>7} {'API s':>6} {'API MB':>6} {'HTA s':>7} {'HTA MB':>6} {'HTA/CLI':>7} {'HTA/API':>7} "
                   f"{'GPU busy ms':>11}" + (f" {'before s':>8} {'before cpu':>10} {'before MB':>9} {'HTA/before':>10}" if before else ""))
    for r in rows:
        t, h, c = r["tracelens"], r.get("hta"), r.get("cli")
        busy = f"{t['busy_us'] / 1e3:>11.1f}" if t.get("busy_us") is not None else f"{'(no GPU)':>11}"
        cs = (f"{c['wall_s']:>6.2f} {c['cpu_s']:>7.2f} {c['peak_mb']:>6.0f} {c['report_mb']:>7.2f}" if c else
              f"{'-':>6} {'-':>7} {'-':>6} {'-':>7}")

        hs = (f"{'>' + format(h['wall_s'], '.0f'):>7} {'':>6} {_ratio(r, 'ratio')} {_ratio(r, 'ratio_api')}"
              if h and h.get("timed_out") else
              f"{h['wall_s']:>7.2f} {h['peak_mb']:>6.0f} {_ratio(r, 'ratio')} {_ratio(r, 'ratio_api')}" if h else
              f"{'failed' if r.get('hta_error') else 'n/a':>7} {'':>6} {'':>7} {'':>7}")
        b = r.get("before")
        bs = ""
        if b:
            rb = f"{'':>10}"
            if r.get("ratio_before"):
                rb = (f"{'>=' + format(r['ratio_before'], '.1f') + 'x':>10}" if h and h.get("timed_out")
                      else f"{r['ratio_before']:>9.1f}x")
            bs = f" {b['wall_s']:>8.2f} {b['cpu_s']:>10.2f} {b['peak_mb']:>9.0f} {rb}"
        out.append(f"{r['name']:<17} {r['size_mb']:>5.0f} {t['events']:>9,} {t.get('steps', 0):>6,} {cs} "
                   f"{t['wall_s']:>6.2f} {t['peak_mb']:>6.0f} {hs} {busy}{bs}")
    if footer:
        out.append("CLI: `tracelens analyze TRACE -o OUT` (report, tables, summary.json; empty cache dir), fresh process; "
                   "API: load (no cache) + analyze + summary; HTA: TraceAnalysis + temporal + kernel breakdown; "
                   "wall s, medians; CLI cpu: user + sys s; MB: peak RSS")
        for key, what in (("ratio", "HTA / CLI"), ("ratio_api", "HTA / API")):
            rat = [r for r in rows if r.get(key)]
            if rat:
                lo = min(rat, key=lambda r: r[key])
                out.append(f"minimum {what} ratio: {lo[key]:.1f}x ({lo['name']}) over {len(rat)} traces"
                           + (" (HTA stopped at the timeout on " + ", ".join(r["name"] for r in rat if r["hta"].get("timed_out"))
                              + ": lower bounds)" if any(r["hta"].get("timed_out") for r in rat) else ""))
        rb = [r for r in rows if r.get("ratio_before")]
        if rb:
            lb = min(rb, key=lambda r: r["ratio_before"])
            out.append(f"minimum HTA / before (CLI) ratio: {lb['ratio_before']:.1f}x ({lb['name']})")
        worst = max(rows, key=lambda r: max(r["tracelens"]["peak_mb"], (r.get("cli") or {}).get("peak_mb", 0))) if rows else None
        if worst:
            out.append(f"maximum tracelens peak RSS: {max(worst['tracelens']['peak_mb'], (worst.get('cli') or {}).get('peak_mb', 0)):.0f} MB ({worst['name']})")
        for r in rows:
            if r.get("hta_error"):
                out.append(f"HTA failed on {r['name']}: {r['hta_error']}")
    return "\n".join(out)


def main_corpus(a) -> None:
    work = Path(a.work or tempfile.mkdtemp(prefix="tracelens-corpus-"))
    names = [n for n in (a.only or "").split(",") if n] or None
    hta = not a.no_hta
    if hta and not hta_available():
        print("HolisticTraceAnalysis not installed (pip install --no-deps HolisticTraceAnalysis==0.5.0 "
              "psutil networkx pydot): tracelens only", file=sys.stderr)
        hta = False
    from tracelens.io.kineto import decoder

    print(f"corpus at {a.target_mb:g} MB, median of {a.repeat}; CPUs usable: {len(os.sched_getaffinity(0))} of "
          f"{os.cpu_count()}; decoder: {decoder()}; work dir {work}", flush=True)
    rows = run_corpus(names, a.target_mb, work, repeat=a.repeat, hta=hta, log=lambda s: print(s, flush=True),
                      compare_root=Path(a.compare_root) if a.compare_root else None, hta_timeout=a.hta_timeout,
                      cli=not a.no_cli, api_repeat=a.api_repeat)
    print(format_corpus(rows, header=True, footer=True))
    if a.json:
        Path(a.json).write_text(json.dumps({"target_mb": a.target_mb, "repeat": a.repeat, "rows": rows}, indent=1))


BIG_SRC = _FX / "h200_moe_1gpu" / "moe1gpu_loop.json.gz"


def main_big(a) -> None:
    src = Path(a.src or BIG_SRC)
    out = Path(a.out or os.environ.get("OUT") or "") if (a.out or os.environ.get("OUT")) else None
    work = Path(a.work or tempfile.mkdtemp(prefix="tracelens-big-"))
    cpus = [int(c) for c in a.cpus.split(",")] if a.cpus else None
    d = work / f"big-{a.target_mb:g}MB"
    trace = d / "rank0.json"
    t_start = time.perf_counter()
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    from tracelens.io.kineto import decoder

    try:
        if not trace.exists():
            d.mkdir(parents=True, exist_ok=True)
            jobs = len(os.sched_getaffinity(0))
            t = time.perf_counter()
            copies, n = scale(str(src), str(d / "rank0.json.part"), target_mb=a.target_mb, jobs=jobs)
            os.replace(d / "rank0.json.part", trace)
            say(f"built {trace} from {src.name}: {trace.stat().st_size / 1e6:,.0f} MB, {n:,} events, {copies} copies, "
                f"{jobs} processes, {time.perf_counter() - t:.1f} s")
        size_mb = trace.stat().st_size / 1e6
        say(f"decoder: {decoder()}; analysis pinned to CPUs {cpus or sorted(os.sched_getaffinity(0))} "
            f"of {os.cpu_count()}; cold (no cache) load + analyze + summary, fresh process per run")
        say(f"{'run':>3} {'wall s':>7} {'load s':>7} {'anal s':>7} {'peak RSS MB':>11} {'after load':>10} "
            f"{'after analyze':>13} {'events':>11}")
        runs, before = [], []
        roots = [("", ROOT, runs)] + ([("before", Path(a.compare_root), before)] if a.compare_root else [])
        for i in range(a.repeat):
            for tag, root, acc in roots:  # alternating, so both see the same minutes of a shared machine
                r = run_isolated(TRACELENS, str(trace), "0", str(work / "cache-unused"), pss=False, cpus=cpus,
                                 cwd=root)
                acc.append(r)
                say(f"{i + 1:>3} {r['wall_s']:>7.2f} {r['load_s']:>7.2f} {r['analyze_s']:>7.2f} {r['peak_mb']:>11,.0f} "
                    f"{r.get('peak_load_mb', float('nan')):>10,.0f} {r.get('peak_analyze_mb', float('nan')):>13,.0f} "
                    f"{r['events']:>11,} {tag}")
            left = a.budget - (time.perf_counter() - t_start)
            if i + 1 < a.repeat and left < sum(acc[-1]["wall_s"] for _, _, acc in roots) * 1.2:
                say(f"(stopped after {i + 1} run(s): {left:.0f} s of the {a.budget:.0f} s budget left)")
                break
        for tag, root, acc in roots:
            med = _median(acc)
            say(f"{size_mb:,.0f} MB{' ' + tag + ' (' + str(root) + ')' if tag else ''}: median of {len(acc)}: wall "
                f"{med['wall_s']:.2f} s, peak RSS {med['peak_mb']:,.0f} MB (max over runs "
                f"{max(r['peak_mb'] for r in acc):,.0f} MB)")
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"big-{a.target_mb:g}MB.json").write_text(json.dumps({"size_mb": size_mb, "src": str(src), "cpus": cpus,
                                                      "decoder": decoder(), "runs": runs, "before": before or None},
                                                     indent=1))
            (out / f"big-{a.target_mb:g}MB.txt").write_text("\n".join(lines) + "\n")
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=None, help="real trace to tile (default: the A100 trace_diff control; "
                                                "with --big the H200 MoE loop trace)")
    ap.add_argument("--target-mb", type=float, default=200.0)
    ap.add_argument("--work", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--no-hta", action="store_true", help="skip HolisticTraceAnalysis")
    ap.add_argument("--api-repeat", type=int, default=None,
                    help="corpus: runs of the API path per trace (default --repeat)")
    ap.add_argument("--no-cli", action="store_true",
                    help="with --corpus: leave out the `tracelens analyze` runs (the API path and HTA only)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="repeat each measurement, report the median (default 1; 3 with --corpus)")
    ap.add_argument("--decoders", action="store_true", help="also time JSON decoders on the trace")
    ap.add_argument("--corpus", action="store_true", help="every trace of the corpus, a table and the minimum ratio")
    ap.add_argument("--only", default=None, help="with --corpus: comma-separated trace names (a subset)")
    ap.add_argument("--json", default=None, help="with --corpus: write the rows to this JSON file")
    ap.add_argument("--hta-timeout", type=float, default=300.0,
                    help="with --corpus: stop an HTA run after this many seconds (ratio a lower bound; default 300)")
    ap.add_argument("--compare-root", default=None,
                    help="with --corpus or --big: also run the tracelens of this other checkout (\"before\"), "
                         "same minutes")
    ap.add_argument("--big", action="store_true", help="one large tiled trace: wall time and peak RSS (see above)")
    ap.add_argument("--cpus", default=None, help="with --big: pin the analysis to these CPUs, e.g. 2,3")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="with --big: start no further run past this many seconds (default 420)")
    ap.add_argument("--out", default=None, help="with --big: write big-<MB>MB.json and .txt here (default $OUT)")
    ap.add_argument("--keep", action="store_true", help="with --big: keep the tiled trace")
    a = ap.parse_args()
    if a.big:
        a.repeat = a.repeat or 1
        return main_big(a)
    a.src = a.src or str(DEFAULT_SRC)
    if a.corpus:
        a.repeat = a.repeat or 3
        return main_corpus(a)
    a.repeat = a.repeat or 1

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

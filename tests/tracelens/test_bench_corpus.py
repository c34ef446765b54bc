"""benchmarks/bench_load.py --corpus on a tiny tiled size, tracelens only (HTA is not installed in CI):
every trace is tiled, loaded and analyzed in a fresh process, and the table's GPU busy time and kernel
count equal what the tiled file's raw JSON says (union of GPU event intervals, read with the standard
library)."""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from ..conftest import merged_length

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_load  # noqa: E402

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
NAMES = ["moe_grouped", "mi250", "cpu_tiny", "a100_triton"]


def _raw_truth(path: Path) -> tuple[float | None, int]:
    with open(path) as f:
        events = json.load(f, parse_float=Decimal)["traceEvents"]
    gpu = [(Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e.get("dur", 0))) for e in events
           if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    kernels = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") == "kernel")
    return (float(merged_length(gpu)) if gpu else None), kernels


def test_corpus_table_matches_the_raw_json(tmp_path):
    rows = bench_load.run_corpus(NAMES, target_mb=1.0, work=tmp_path, repeat=1, hta=False)
    assert [r["name"] for r in rows] == NAMES
    for r in rows:
        trace = tmp_path / f"{r['name']}-1MB" / "rank0.json"
        assert trace.exists() and r["size_mb"] == pytest.approx(trace.stat().st_size / 1e6)
        busy, kernels = _raw_truth(trace)
        t = r["tracelens"]
        assert t["kernels"] == kernels, r["name"]
        if busy is None:  # the CPU-only trace
            assert t["busy_us"] is None and kernels == 0
        else:
            assert t["busy_us"] == pytest.approx(busy, rel=1e-9, abs=1e-3), r["name"]
        assert t["wall_s"] > 0 and t["peak_mb"] > 0 and r["hta"] is None and "ratio" not in r
        raw_steps = len({e["name"] for e in json.loads(trace.read_text())["traceEvents"]
                         if str(e.get("name", "")).startswith("ProfilerStep#")})
        assert t["steps"] == raw_steps, r["name"]  # a100_triton: one profiler step per tiled copy
        c = r["cli"]  # `tracelens analyze` as users run it: a fresh process that wrote the report
        assert c["wall_s"] > 0 and c["cpu_s"] > 0 and c["peak_mb"] > 0 and c["report_mb"] > 1 and c["summary_mb"] > 0
    assert not list(tmp_path.glob("cli-*"))  # each CLI run's cache and output directories are removed
    table = bench_load.format_corpus(rows)
    for n in NAMES:
        assert n in table
    assert "(no GPU)" in table and "maximum tracelens peak RSS" in table and "minimum HTA" not in table
    assert "tracelens analyze TRACE -o OUT" in table  # the legend says what the CLI column times


def test_every_corpus_trace_is_there():
    """Each corpus entry's source resolves (the project's fixtures, or ../shared/fixtures' external traces with
    tests/fixtures/external as the fallback), so `--corpus` runs whole; names are unique."""
    names = [n for n, _, _ in bench_load.CORPUS]
    assert len(names) == len(set(names))
    for name, src, _ in bench_load.CORPUS:
        if not bench_load._EXT.is_dir() and bench_load._EXT in src.parents and not (
                bench_load._FX / "external" / src.relative_to(bench_load._EXT)).exists():
            continue  # only in ../shared/fixtures, which is not beside this checkout
        assert bench_load.corpus_source(src).is_file(), name
    for kind in ("h100_moe_mbs8", "ep4_cap_ovl_r0", "pp4_1f1b_r0", "ep4_mbs16_r0", "dp4_mbs16_r0", "a100_triton"):
        assert kind in names  # the trainer's GPU kinds and the foreign one issue 37 added


def test_corpus_cli_subset(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "benchmarks/bench_load.py", "--corpus", "--no-hta", "--only", "mi250",
                        "--repeat", "1", "--target-mb", "0.5", "--work", str(tmp_path), "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "median of 1" in r.stdout and r.stdout.count("\nmi250 ") >= 1
    rows = json.loads(out.read_text())["rows"]
    assert [x["name"] for x in rows] == ["mi250"]
    busy, kernels = _raw_truth(tmp_path / "mi250-0.5MB" / "rank0.json")
    assert rows[0]["tracelens"]["busy_us"] == pytest.approx(busy, rel=1e-9) and rows[0]["tracelens"]["kernels"] == kernels
    bad = subprocess.run([sys.executable, "benchmarks/bench_load.py", "--corpus", "--no-hta", "--only", "nope"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown corpus trace(s) nope" in bad.stderr


def test_parallel_tiling_writes_the_same_bytes(tmp_path):
    from scale_trace import scale

    src = REPO / "tests" / "fixtures" / "h200_moe_1gpu" / "moe1gpu_grouped.json.gz"
    one, par = tmp_path / "one.json", tmp_path / "par.json"
    assert scale(str(src), str(one), copies=5) == scale(str(src), str(par), copies=5, jobs=3)
    assert one.read_bytes() == par.read_bytes()
    assert not list(tmp_path.glob("*.part*"))  # the part files are gone
    timed = [e for e in json.loads(one.read_text())["traceEvents"] if e.get("ph") != "M" and "ts" in e]
    src_timed = [e for e in json.loads(__import__("gzip").open(src, "rt").read())["traceEvents"]
                 if e.get("ph") != "M" and "ts" in e]
    assert len(timed) == 5 * len(src_timed)


def test_big_mode_writes_wall_time_and_peak_rss(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run([sys.executable, "benchmarks/bench_load.py", "--big", "--target-mb", "1", "--cpus",
                        str(min(__import__("os").sched_getaffinity(0))), "--repeat", "2", "--work", str(work),
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((out / "big-1MB.json").read_text())
    assert len(doc["runs"]) == 2 and (out / "big-1MB.txt").read_text().count("median of 2") == 1
    for run in doc["runs"]:
        assert run["wall_s"] > 0 and run["peak_mb"] >= run["peak_analyze_mb"] >= run["peak_load_mb"] > 0
    # the events the analysis saw are the tiled file's ph X / i events: ~1 MB of the MoE loop trace
    src = REPO / "tests" / "fixtures" / "h200_moe_1gpu" / "moe1gpu_loop.json.gz"
    per_copy = sum(1 for e in json.loads(__import__("gzip").open(src, "rt").read())["traceEvents"]
                   if e.get("ph") in ("X", "i"))
    assert doc["runs"][0]["events"] % per_copy == 0 and doc["runs"][0]["events"] >= per_copy
    assert not list(work.glob("big-*/rank0.json"))  # the tiled trace is deleted (no --keep)

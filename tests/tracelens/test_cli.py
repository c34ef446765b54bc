"""The `tracelens analyze` command, run as a user would (subprocess), and its outputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from ..conftest import CPU_ONLY, FIXTURES, MOE_LOOP, NCCL_2RANK

SUMMARY_KEYS = {"rank", "span_us", "gpu_busy_us", "gpu_idle_us", "compute_us", "comm_us", "memcpy_us", "memset_us",
                "exposed_comm_us", "kernel_count", "steps"}


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "tracelens", *map(str, args)], capture_output=True, text=True, **kw)


def test_analyze_writes_report_summary_tables(tmp_path):
    out = tmp_path / "out"
    p = run("analyze", NCCL_2RANK, "-o", out)
    assert p.returncode == 0, p.stderr
    assert "rank" in p.stdout and "wrote" in p.stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["schema_version"] == 2 and s["world_size"] == 2
    assert [r["rank"] for r in s["ranks"]] == [0, 1]
    for r in s["ranks"]:
        assert SUMMARY_KEYS <= set(r)
        assert r["gpu_busy_us"] + r["gpu_idle_us"] == pytest.approx(r["span_us"], abs=2e-3)
        for st in r["steps"]:
            assert SUMMARY_KEYS - {"rank", "steps"} <= set(st)
    html = (out / "report.html").read_text()
    assert "<script src" not in html and "<link" not in html  # nothing fetched: works offline
    assert len(html) > 1_000_000  # plotly.js is embedded, not linked
    for name in ("timeline", "ops", "kernels", "categories", "breakdown"):
        df = pd.read_parquet(out / "tables" / f"{name}.parquet")
        csv = pd.read_csv(out / "tables" / f"{name}.csv")
        assert len(df) == len(csv)
    k = pd.read_parquet(out / "tables" / "kernels.parquet")
    assert k["kernel"].str.contains("ncclDevKernel_AllReduce").any()


def test_cpu_only_trace_gets_report_not_error(tmp_path):
    p = run("analyze", CPU_ONLY, "-o", tmp_path / "o")
    assert p.returncode == 0, p.stderr
    assert "CPU-only" in p.stderr
    html = (tmp_path / "o" / "report.html").read_text()
    assert "GPU sections unavailable" in html


@pytest.mark.parametrize(
    "content,needle",
    [(b'{"traceEvents": [{"ph": "X"', "truncated JSON"), (b"\x1f\x8b\x08\x00garbage", "corrupt or truncated gzip"),
     (b"<html></html>", "not a JSON trace"), (b'{"traceEvents": []}', "empty trace")],
)
def test_bad_input_exit_2_one_line(tmp_path, content, needle):
    f = tmp_path / ("bad.json.gz" if content.startswith(b"\x1f") else "bad.json")
    f.write_bytes(content)
    p = run("analyze", f, "-o", tmp_path / "o")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracelens: error: ") and str(f) in lines[0] and needle in lines[0]
    assert "Traceback" not in p.stderr


def test_missing_path(tmp_path):
    p = run("analyze", tmp_path / "nope")
    assert p.returncode == 2 and "no such file or directory" in p.stderr


def test_default_output_dir_next_to_file(tmp_path):
    f = tmp_path / "moe.json.gz"
    f.write_bytes(MOE_LOOP.read_bytes())
    p = run("analyze", f, "--no-tables", "-q")
    assert p.returncode == 0 and p.stdout == ""
    assert (tmp_path / "moe.tracelens" / "report.html").exists()
    assert not (tmp_path / "moe.tracelens" / "tables").exists()


def test_tracelens_imports_without_torch():
    code = ("import sys, builtins\nreal = builtins.__import__\n"
            "def guard(name, *a, **k):\n    assert not name.startswith(('torch', 'triton')), name\n    return real(name, *a, **k)\n"
            "builtins.__import__ = guard\nimport tracelens, tracelens.cli, reports.html, reports.artifacts\n"
            f"a = tracelens.analyze(tracelens.load({str(MOE_LOOP)!r}, cache=False))\n"
            "import reports.html as h; h.render(a)\nprint('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_cpu_only_summary_names_host_time_per_step_and_range(tmp_path):
    """A CPU run of the trainer: the terminal summary gives host time per profiler step and the
    top-level ranges (MoE stages) per step, not just 'GPU unavailable'."""
    ev, ts = [], 1000.0
    for i, (step_us, experts_us) in enumerate([(2000.0, 600.0), (3000.0, 1000.0)]):
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": 1, "tid": 1,
                   "ts": ts, "dur": step_us})
        ev.append({"ph": "X", "cat": "user_annotation", "name": "moe/experts", "pid": 1, "tid": 1,
                   "ts": ts + 10.0, "dur": experts_us})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": ts + 20.0,
                   "dur": experts_us / 2})
        ts += step_us + 50.0
    trace = tmp_path / "cpu.json"
    trace.write_text(json.dumps({"traceEvents": ev}))
    r = run("analyze", str(trace), "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "step 0 2.0 ms, step 1 3.0 ms" in r.stdout
    line = next(x for x in r.stdout.splitlines() if "MoE stages per step" in x)
    ms = float(line.split("moe/experts ")[1].split()[0])
    assert ms == pytest.approx((600 + 1000) / 2 / 1000)  # ms per step, per rank
    assert "(32%)" in line  # 1600 us of 5000 us of steps
    assert "top ops by self time per step: aten::mm 0.400 ms" in r.stdout  # (300 + 500) / 2 us
    # the verdict and the findings as sentences follow the tables (tracelens.analysis.verdict)
    assert any(x.startswith("verdict: ") for x in r.stdout.splitlines())
    assert any(x.startswith("  info   ") for x in r.stdout[r.stdout.index("findings:"):].splitlines())


def test_host_prints_info_findings_without_a_recovery_estimate(tmp_path):
    """A trace without GPU activity (the trainer on a CPU; HTA's MTIA test trace, whose device is not a
    GPU to the loader) has only "info" findings, whose recoverable_us is null: `host` prints their
    share of the step instead of dividing None (it exited 3)."""
    from ..conftest import FIXTURES

    out = tmp_path / "host.json"
    r = run("host", str(FIXTURES / "cpu_tiny" / "rank0.json.gz"), "--no-cache", "--json", str(out))
    assert r.returncode == 0 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    items = json.loads(out.read_text())["findings"]
    info = [f for f in items if f["recoverable_us"] is None]
    assert info and all(f["severity"] == "info" for f in info)
    lines = [x for x in r.stdout.splitlines() if x.startswith("  [info] ")]
    assert [x.rsplit(" (", 1)[0] for x in lines] == [f"  [info] {f['title']}" for f in info]
    for x, f in zip(lines, info):
        assert x.endswith(f"({100 * f['share_of_span']:.1f}% of the step; no recovery estimate)")


# (verb, manifest change, the problem named after "RUN/manifest.json: ")
_BAD_MANIFESTS = [
    ("whatif", "[]", "not a trainer manifest: a list, not a JSON object"),
    ("whatif", "{not json", "unreadable manifest (Expecting property name enclosed in double quotes"),
    ("whatif", {"config": None}, "not a trainer manifest: no 'config' (expected an object: the run's trainer config)"),
    ("whatif", {"metrics": "fast"}, "manifest field 'metrics' is a string ('fast') (expected an object)"),
    ("whatif", {"metrics.step_times_s": 7}, "manifest field 'metrics.step_times_s' is a number (7) (expected a list of numbers)"),
    ("whatif", {"config.micro_batch_size": "x"},
     "the run's config is not valid (config error: micro_batch_size: expected an integer, got 'x')"),
    ("memory", {"metrics": "fast"}, "manifest field 'metrics' is a string ('fast') (expected an object)"),
    ("memory", {"metrics.peak_memory_bytes": [1, "x"]}, "manifest field 'metrics.peak_memory_bytes[1]' is a string ('x') (expected a number)"),
    ("memory", {"world_size": 0}, "manifest field 'world_size' is a number (0) (expected an integer >= 1)"),
    ("diff", "[1, 2]", "not a trainer manifest: a list, not a JSON object"),
    ("diff", {"metrics": [1]}, "manifest field 'metrics' is a list (expected an object)"),
    ("diff", {"metrics.peak_memory_bytes": [1, "x"]}, "manifest field 'metrics.peak_memory_bytes[1]' is a string ('x') (expected a number)"),
]


@pytest.mark.parametrize("verb, change, problem", _BAD_MANIFESTS, ids=[f"{v}-{str(c)[:30]}" for v, c, _ in _BAD_MANIFESTS])
def test_malformed_manifests_are_one_line_naming_the_file(tmp_path, verb, change, problem):
    """whatif (a ProfileError escaped), memory ("metrics": "fast") and diff (a list manifest) exited 3;
    each now checks the manifest's fields (tracelens.io.manifest) before any work: one line, exit 2."""
    import shutil

    from ..conftest import FIXTURES

    src = FIXTURES / "h100_proxy_loop_mbs8"
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir)
    mf = run_dir / "manifest.json"
    if isinstance(change, str):
        mf.write_text(change)
    else:
        doc = json.loads(mf.read_text())
        for key, value in change.items():
            *parents, leaf = key.split(".")
            d = doc
            for k in parents:
                d = d[k]
            d[leaf] = value
        mf.write_text(json.dumps(doc))
    args = {"whatif": ["whatif", run_dir, "--set", "micro_batch_size=2"], "memory": ["memory", run_dir],
            "diff": ["diff", src, run_dir, "--no-cache"]}[verb]
    r = run(*args, timeout=300)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    assert r.stderr.startswith(f"tracelens: error: {mf}: {problem}") and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("args, message", [
    # float() reads 'nan' and 'inf' and nan passed every bound: host counted no (or every) kernel as small, whatif
    # said "10.18 GiB of nan GiB: OUT OF MEMORY", memory "does NOT fit 74.5 GiB (headroom nan%)", all with exit 0
    (["host", MOE_LOOP, "--small-us", "nan"], "Invalid value for '--small-us': 'nan' is not a finite number."),
    (["host", MOE_LOOP, "--small-us", "inf"], "Invalid value for '--small-us': 'inf' is not a finite number."),
    (["host", MOE_LOOP, "--small-us", "-5"], "Invalid value for '--small-us': -5.0 is not in the range x>0."),
    (["whatif", FIXTURES / "h200_ep2_run" / "L0_loop", "--memory-gib", "nan"],
     "Invalid value for '--memory-gib': 'nan' is not a finite number."),
    (["scaleout", FIXTURES / "h100_4gpu" / "ep4_cap_ovl", "--gpus", "8", "--memory-gib", "inf"],
     "Invalid value for '--memory-gib': 'inf' is not a finite number."),
    (["memory", "gpu_proxy", "--device", "H100", "--headroom", "nan"],
     "Invalid value for '--headroom': 'nan' is not a finite number."),
    (["plan", "gpu_proxy_train", "--gpus", "8", "--global-batch", "64", "--device", "H100", "--headroom", "nan"],
     "Invalid value for '--headroom': 'nan' is not a finite number."),
])
def test_non_finite_or_non_positive_float_options_are_usage_errors(args, message):
    from ._cli import run_cli

    r = run_cli(*args)
    assert r.returncode == 2, r.stdout
    assert r.stderr.splitlines()[-1] == f"Error: {message}" and "Traceback" not in r.stderr

"""Many ranks (tracelens.scale): per-rank reductions, in-process and as Dask tasks on a 2-worker
LocalCluster (worker processes, processes=True), against the all-in-memory `analyze(load(...))`.

The corpora are 8 ranks tiled from the real multi-rank fixtures by benchmarks/tile_ranks.py (replica j of
a 2-rank run = ranks 2j, 2j+1 with its own process groups): one from four different runs (EP, NCCL,
PP 1F1B with pipeline ranges, so ppvis runs), one from four copies of the 2-rank NCCL run (a start-up wait
leaves step 0 out of the steady-state window)."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tracelens
from tests._benchmarks import load_benchmark
from tracelens import scale
from tracelens.analysis import comm as C
from tracelens.errors import TraceError

from ..conftest import FIXTURES, NCCL_2RANK
from ._cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
SHARED_KEYS = ("schema_version", "tool", "world_size", "window", "ranks", "categories", "warnings")

distributed = pytest.importorskip("distributed")


def _tiler():
    return load_benchmark("tile_ranks").tile_ranks


@pytest.fixture(scope="module")
def mixed8(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed8")
    _tiler()([NCCL_2RANK, FIXTURES / "h200_ep2_run" / "L0_loop", FIXTURES / "h200_pp2_run" / "1f1b",
              FIXTURES / "h200_ep2_run" / "L3_torch"], 8, d, gz=True)
    return d


@pytest.fixture(scope="module")
def nccl8(tmp_path_factory):
    d = tmp_path_factory.mktemp("nccl8")
    _tiler()([NCCL_2RANK], 8, d, gz=True)
    return d


@pytest.fixture(scope="module")
def client():
    import dask
    from distributed import Client, LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):  # a dead worker fails its task at once
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                               silence_logs=50)
    with cluster, Client(cluster) as c:
        yield c


def _full(path, cache={}):  # noqa: B006 - each corpus's all-in-memory analysis, once for the module (read only)
    if path not in cache:
        cache[path] = tracelens.analyze(tracelens.load(path, cache=False))
    return cache[path]


def _check_equal(path, client):
    full = _full(path)
    want = full.summary()
    inst = C.collective_instances(full)
    local = scale.analyze_ranks(path, cache=False)
    dask_ = scale.analyze_ranks(path, cache=False, client=client)
    for res in (local, dask_):
        got = res.summary()
        for k in SHARED_KEYS:
            assert got[k] == want[k], k
        assert res.instances.equals(inst)
        assert res.comm_summary.equals(C.comm_summary(inst))
        assert res.stragglers.equals(C.stragglers(inst))
        assert res.coverage.equals(C.group_coverage(full, inst))
        assert res.trace.load_issues.equals(full.trace.load_issues)
        assert (res.pipeline is None) == (full.pipeline is None)
        if full.pipeline is not None:
            assert res.pipeline.to_dict() == full.pipeline.to_dict()
    assert local.summary()["comm"] == dask_.summary()["comm"]
    return full, local, dask_


def _raw_comm_kernels(path: Path) -> int:
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    return sum(1 for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"
               and re.search(r"nccl|rccl", str(e.get("name", "")), re.I))


def test_eight_mixed_ranks_equal_single_process(mixed8, client):
    full, local, dask_ = _check_equal(mixed8, client)
    s = dask_.summary()
    assert [r["rank"] for r in s["ranks"]] == list(range(8)) and s["world_size"] == 8
    assert s["distributed"]["engine"] == "dask client" and local.engine == "in-process"
    assert dask_.pipeline is not None  # ranks 4, 5: the PP run's pipeline ranges
    assert dask_.instances["cross_rank"].any()
    # independent truth: every communication kernel of the raw JSON is counted once per rank
    counts = dask_.comm_summary.groupby("rank")[["count", "startup_excluded"]].sum().sum(axis=1)
    for r in range(8):
        assert counts[r] == _raw_comm_kernels(mixed8 / f"rank{r}.json.gz"), r
    # each replica is its own process group: group "0.r1" holds ranks 2 and 3
    cov = dask_.coverage.set_index("group")
    assert cov.loc["0.r1", "ranks_loaded"] == [2, 3]


def test_eight_nccl_ranks_steady_window_equal(nccl8, client):
    full, local, dask_ = _check_equal(nccl8, client)
    w = dask_.summary()["window"]
    assert w["steps_used"] == [1, 2] and any(e["reason"] == "startup_wait" for e in w["steps_excluded"])
    # the start-up wait of every replica's rank 1 (rank 2j+1) leaves step 0 out
    waits = {e["ranks"][0] for e in w["steps_excluded"] if e["reason"] == "startup_wait"}
    assert waits == {1, 3, 5, 7}


def test_all_steps_window_and_scheduler_address(nccl8, client):
    """window="all" equals analyze(..., window="all"); a scheduler address (here the test cluster's) is
    the --scheduler path: a Client of its own on a running cluster."""
    want = tracelens.analyze(tracelens.load(nccl8, cache=False), window="all").summary()
    got = scale.analyze_ranks(nccl8, cache=False, window="all", scheduler=client.scheduler.address)
    s = got.summary()
    assert got.engine == f"dask scheduler {client.scheduler.address}"
    assert s["window"]["mode"] == "all" and s["window"]["steps_used"] == [0, 1, 2]
    for k in SHARED_KEYS:
        assert s[k] == want[k], k


def test_bad_rank_file_names_it(nccl8, tmp_path, client):
    d = tmp_path / "run"
    d.mkdir()
    for r in range(4):
        (d / f"rank{r}.json.gz").write_bytes((nccl8 / f"rank{r}.json.gz").read_bytes())
    bad = d / "rank2.json.gz"
    bad.write_bytes(bad.read_bytes()[:3000])  # truncated gzip
    with pytest.raises(TraceError) as e:
        scale.analyze_ranks(d, cache=False, client=client)
    assert e.value.path == str(bad) and "gzip" in e.value.problem
    p = subprocess.run([sys.executable, "-m", "tracelens", "analyze", str(d), "--workers", "2", "--no-cache",
                        "-o", str(tmp_path / "out")], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr
    assert p.stderr.startswith(f"tracelens: error: {bad}: corrupt or truncated gzip")


def test_worker_death_names_the_file(client):
    import os

    fut = client.submit(os._exit, 1, pure=False)
    with pytest.raises(TraceError) as e:
        scale._gather(client, [fut], ["/data/rank7.json.gz"])
    assert e.value.path == "/data/rank7.json.gz" and "worker" in e.value.problem and "died" in e.value.problem


def test_cli_workers_writes_summary(nccl8, tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "tracelens", "analyze", str(nccl8), "--workers", "2", "-o", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "LocalCluster (2 worker processes), 8 ranks" in p.stdout
    s = json.loads((out / "summary.json").read_text())
    want = _full(nccl8).summary()
    for k in SHARED_KEYS:
        assert s[k] == json.loads(json.dumps(want[k])), k
    assert (out / "tables" / "comm_summary.parquet").is_file() and not (out / "report.html").exists()


def test_without_dask_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # `import distributed` raises ImportError
    p = run_cli("analyze", NCCL_2RANK, "--workers", "2", "-o", tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip() == ("tracelens: error: the distributed path needs Dask distributed: "
                                "pip install 'tracelens[distributed]'")


def test_local_default_imports_no_dask():
    code = ("import sys, tracelens; r = tracelens.analyze_ranks(%r, cache=False); "
            "assert r.engine == 'in-process' and len(r.trace.ranks) == 2; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed')], 'dask imported'" % str(NCCL_2RANK))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("args, message", [
    # was "internal error: ValueError: missing port number in address 'notanaddr'", exit 3
    (["--scheduler", "notanaddr"],
     "notanaddr: not a Dask scheduler address (missing port number in address 'notanaddr'); e.g. tcp://host:8786"),
    # was "internal error: ValueError: Could not interpret 'abc' as a byte unit", exit 3
    (["--workers", "1", "--memory-limit", "abc"],
     "memory limit 'abc': not a size (Could not interpret 'abc' as a byte unit); e.g. 2GB"),
    # was each worker's traceback (OverflowError), then "internal error: RuntimeError: Nanny failed to start", exit 3
    (["--workers", "1", "--memory-limit", "-2GB"],
     "memory limit '-2GB': must be a size of 0 (no limit) or more; e.g. 2GB"),
    # without --workers the limit was silently not used (the analysis ran in this process, exit 0)
    (["--memory-limit", "2GB"], "--memory-limit sets the memory of --workers' local Dask workers: give --workers N with it"),
])
def test_a_bad_scheduler_address_or_memory_limit_is_one_line(tmp_path, args, message):
    r = run_cli("analyze", NCCL_2RANK, *args, "-o", tmp_path / "out")
    assert r.returncode == 2, r.stdout
    assert r.stderr == f"tracelens: error: {message}\n"
    assert not (tmp_path / "out").exists()

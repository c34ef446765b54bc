"""Shared test fixtures: paths to the real traces and an independent raw-JSON reader; the order and the
thread counts that let `make test` run the suite on two pytest-xdist workers."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from decimal import Decimal
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
NCCL_2RANK = FIXTURES / "h200_nccl_2rank"
MOE_LOOP = FIXTURES / "h200_moe_1gpu" / "moe1gpu_loop.json.gz"
MOE_GROUPED = FIXTURES / "h200_moe_1gpu" / "moe1gpu_grouped.json.gz"
HTA = FIXTURES / "external" / "hta"
MI250 = HTA / "mi250_minitoy_train_ROCm6_2_kineto.json.gz"
CPU_ONLY = HTA / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"
TRITON = HTA / "triton_example.json.gz"
ALEXNET = HTA / "benchmark_result_2869224_1695835535_trace.json.gz"
DIFF_CONTROL = HTA / "trace_diff" / "control.json.gz"
DIFF_TEST = HTA / "trace_diff" / "test.json.gz"

GPU_TRACES = [NCCL_2RANK / "rank0.json.gz", NCCL_2RANK / "rank1.json.gz", MOE_LOOP, MOE_GROUPED, MI250, TRITON,
              ALEXNET, DIFF_CONTROL, DIFF_TEST]
ALL_TRACES = GPU_TRACES + [CPU_ONLY]


def raw_events(path: Path) -> list[dict]:
    """The trace's events read with the standard library; floats kept exact as Decimal.

    Tests compute expected numbers from this, independently of the code under test.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f, parse_float=Decimal)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def to_ns(v) -> int:
    return int(Decimal(v) * 1000)


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """Module- and session-scoped fixtures (set up before the per-test cache below) use a cache of this
    session's own: never ~/.cache/tracelens, which a developer's kernel table or another run may fill."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRACELENS_CACHE_DIR", str(tmp_path_factory.mktemp("session-cache")))
        yield


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own parsed-trace cache, so tests never see each other's entries."""
    monkeypatch.setenv("TRACELENS_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


# ------------------------------------------------------------------ two workers (pytest-xdist)
# `make test` runs `pytest -n 2 --dist loadfile`: a test file runs on one worker, in order, so its module
# fixtures (a trainer run, a sweep) are built once. Two rules keep that as fast and as deterministic as
# one process:
# * files with a `slow` test start first (xdist would otherwise hand out the files with the most tests
#   first and leave the few long ones for the end, one worker busy and the other idle);
# * each worker runs torch (and OpenMP) on its share of the cores, never one thread per core each:
#   `pytest_configure`.
# No test times a real run and judges the time (the other worker, or any other process, may share the
# cores): figures that are wall-clock times are checked on recorded runs (tests/fixtures/cpu_whatif_grid,
# tests/fixtures/cpu_pp2_bubble), so no test needs the machine to itself.


def pytest_configure(config):
    """Under pytest-xdist, each worker (and every process it starts: trainer runs, sweeps) gets its share of
    the cores as its OpenMP thread count, as torchrun gives its ranks one thread each. Two workers with a
    thread per core each oversubscribe the machine: an OpenMP thread whose partner was descheduled waits a
    time slice at every parallel op, and the small ops of the tests' models became 10-50x slower beside the
    other worker (test_syncs' level-3 count: 0.2 s alone, 17 s in the suite). Set only where unset, before
    any test module imports torch (it reads the variable once, at import)."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))
    _session_bytecode()


# ------------------------------------------------------------------ bytecode where the environment writes none
# The suite starts a few hundred Python processes (CLI verbs, trainer ranks, sweeps, benchmarks). Where
# PYTHONDONTWRITEBYTECODE is set (this project's dev and device images set it), each of them compiled the
# project's packages from source again: ~0.3 s of CPU per process that imports tracelens and its reports. Then
# this process and every process it starts write and read bytecode under PYTHONPYCACHEPREFIX (never beside the
# sources, which the setting keeps clean): the directory benchmarks/bytecode.sh uses, /tmp/tracelens-pycache, kept
# between runs (a prefix holds the bytecode of everything imported, torch's too: filled once, ~15 s of CPU, then
# read). A PYTHONPYCACHEPREFIX already set is used as it is. Bytecode is checked against its source's mtime and
# size, as always: it changes no behaviour, only what is compiled again.
PYCACHE_PREFIX = Path(tempfile.gettempdir()) / "tracelens-pycache"


def _session_bytecode() -> None:
    import sys

    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    os.environ.pop("PYTHONDONTWRITEBYTECODE")
    os.environ["PYTHONPYCACHEPREFIX"] = str(PYCACHE_PREFIX)
    sys.pycache_prefix = str(PYCACHE_PREFIX)  # this process too, for what it imports from now on
    sys.dont_write_bytecode = False


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within each group stays


def merged_length(intervals):
    """Length of the union of (start, end) intervals: a plain sweep, independent of tracelens (ints,
    floats or Decimals; 0 for none)."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


_TREE_CATS = {"cpu_op", "Operator", "user_annotation", "cuda_runtime", "cuda_driver", "Runtime"}


def is_tree_event(ph, cat, name) -> bool:
    """A raw event that the call tree holds (complete ops, annotations, runtime calls, nn.Module ranges),
    written here from Kineto's categories, independently of tracelens.categories."""
    return ph == "X" and (cat in _TREE_CATS or (cat in ("python_function", "Python") and str(name).startswith("nn.Module: ")))


def assert_frames_identical(got, want) -> None:
    """``got`` and ``want`` are the same table: the same columns in the same order, the same index, the same dtype
    per column (a categorical's categories in the same order) and the same values, exactly (NaN where NaN).

    What ``pd.testing.assert_frame_equal(check_exact=True)`` checks, in a few vectorized calls: it boxes every
    element of a categorical with string categories (10 s for a 75,000-event table); ``DataFrame.equals`` compares
    the blocks. On a difference, ``assert_frame_equal`` runs to say where."""
    import pandas as pd

    same = (list(got.columns) == list(want.columns) and got.index.equals(want.index)
            and got.index.dtype == want.index.dtype and list(got.dtypes) == list(want.dtypes))
    if same:
        for c in got.columns:
            if isinstance(got[c].dtype, pd.CategoricalDtype):
                a, b = got[c].cat.categories, want[c].cat.categories
                same = same and a.dtype == b.dtype and a.equals(b)
        same = same and got.equals(want)
    if not same:
        pd.testing.assert_frame_equal(got, want, check_exact=True)
        raise AssertionError("the frames differ (a categorical's category order, or an index dtype)")


def write_json_gz(doc, path) -> Path:
    """Write ``doc`` as gzipped JSON (a trace a test made or changed): serialized in one call of the C encoder
    (``json.dump`` to a file encodes in Python, piece by piece: 4.4 s vs 1.1 s for a 1.5 MB trace) and compressed
    at level 1 (the tests read it once)."""
    path = Path(path)
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(json.dumps(doc).encode())
    return path

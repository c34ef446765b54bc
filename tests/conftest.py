"""Shared test fixtures: paths to the real traces and an independent raw-JSON reader."""

from __future__ import annotations

import gzip
import json
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


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own parsed-trace cache, so tests never see each other's entries."""
    monkeypatch.setenv("TRACELENS_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


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

"""The external traces' headline figures against truths computed here from the raw JSON.

Per trace recorded elsewhere (tests/fixtures/external/**): the profiler steps and their durations, each step's
GPU span, busy time, kernel count and communication time (a GPU event's step is the step range holding its
launch call), the kernel table's total and count, the communication category's total, and the host syncs.
The expected values use only the standard library (exact Decimal timestamps, a plain sort-and-merge union,
name matching): nothing from tracelens is reused.
"""

from __future__ import annotations

import re
from collections import defaultdict
from decimal import Decimal

import pytest

import tracelens

from ..conftest import FIXTURES, merged_length, raw_events

EXTERNAL = FIXTURES / "external"
TRACES = ["hta/mi250_minitoy_train_ROCm6_2_kineto.json.gz", "hta/triton_example.json.gz",
          "hta/benchmark_result_2869224_1695835535_trace.json.gz", "hta/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz",
          "hta/trace_diff/control.json.gz", "hta/trace_diff/test.json.gz", "tracelens/b200_eager.json.gz",
          "tracelens/mi300_resnet_act_checkpoint.json.gz"]

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
COMM = re.compile(r"nccl|rccl|allreduce|allgather|reducescatter|sendrecv|all_to_all", re.IGNORECASE)
STEP = re.compile(r"^(?:ProfilerStep#|##\s*step\s*)(\d+)$")
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "hipStreamSynchronize", "hipDeviceSynchronize", "hipEventSynchronize", "hipMemcpy"}


def raw_truth(path):
    ev = [e for e in raw_events(path) if e.get("ph") == "X"]
    t = lambda e: (Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e.get("dur", 0)))
    steps = {}
    for e in sorted((e for e in ev if e.get("cat") in ("cpu_op", "user_annotation") and STEP.match(e["name"])),
                    key=lambda e: Decimal(e["ts"])):
        steps.setdefault(int(STEP.match(e["name"]).group(1)), t(e))
    launch = {}
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch.setdefault(e["args"]["correlation"], Decimal(e["ts"]))
    gpu = defaultdict(list)  # step -> GPU events launched in it (-1: outside every step): (cat, name, start, end)
    for e in ev:
        if e.get("cat") in GPU_CATS:
            s, end = t(e)
            at = launch.get(e.get("args", {}).get("correlation"), s)
            gpu[next((n for n, (a, b) in steps.items() if a <= at < b), -1)].append((e["cat"], e["name"], s, end))
    # blocking syncs the workload issued: inside an op, an annotation or an nn.Module range of its thread
    ranges = defaultdict(list)
    for e in ev:
        if e.get("cat") in ("cpu_op", "user_annotation") or (
                e.get("cat") == "python_function" and e["name"].startswith("nn.Module: ")):
            ranges[(e.get("pid"), e.get("tid"))].append(t(e))
    calls = [(t(e), ranges[(e.get("pid"), e.get("tid"))]) for e in ev
             if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in SYNC_CALLS]
    syncs = sum(1 for (cs, ce), around in calls if any(s <= cs and ce <= end for s, end in around))
    return steps, gpu, syncs


def figures(events):
    kern = [(s, e) for cat, _, s, e in events if cat == "kernel"]
    comm = [(s, e) for cat, name, s, e in events if cat == "kernel" and COMM.search(name)]
    iv = [(s, e) for _, _, s, e in events]
    return {"span_us": max(e for _, e in iv) - min(s for s, _ in iv), "gpu_busy_us": merged_length(iv),
            "kernel_count": len(kern), "comm_us": merged_length(comm),
            "kernel_sum_us": sum(e - s for s, e in kern), "comm_sum_us": sum(e - s for s, e in comm)}


@pytest.mark.parametrize("name", TRACES, ids=lambda n: n.rsplit("/", 1)[-1].split(".")[0])
def test_external_trace_figures_match_raw_json(name):
    path = EXTERNAL / name
    if not path.is_file():
        pytest.skip(f"fixture {name} missing")
    steps, gpu, syncs = raw_truth(path)
    a = tracelens.analyze(tracelens.load(path, cache=False), window="all")

    st = a.steps
    assert sorted(st["step"].tolist()) == sorted(steps)
    for r in st.itertuples():
        s, e = steps[r.step]
        assert ((r.end - r.start) / 1000, r.start) == (float(e - s), int(s * 1000)), r.step
    stl = a.step_timeline.set_index("step")
    assert sorted(stl.index) == sorted(n for n in gpu if n >= 0)
    for n, events in gpu.items():
        if n < 0:
            continue
        want, got = figures(events), stl.loc[n]
        for k in ("span_us", "gpu_busy_us", "kernel_count", "comm_us"):
            assert got[k] == pytest.approx(float(want[k]), abs=1e-3), (n, k)
        parts = got[["compute_us", "exposed_comm_us", "comm_wait_us", "pipeline_wait_us", "excl_memcpy_us",
                     "excl_memset_us", "gpu_idle_us"]]
        assert (parts >= 0).all() and parts.sum() == pytest.approx(got["span_us"], abs=1e-3)

    every = [e for events in gpu.values() for e in events]
    ranks = a.summary()["ranks"]
    if not every:  # a CPU-only rank: no GPU figure at all
        assert ranks[0]["gpu_busy_us"] is None and a.kernels.empty
    else:
        want = figures(every)
        for k in ("span_us", "gpu_busy_us", "kernel_count", "comm_us"):
            assert ranks[0][k] == pytest.approx(float(want[k]), abs=1e-3), k
        k = a.kernels[a.kernels["kind"] == "kernel"]
        assert (k["count"].sum(), k["total_us"].sum()) == (want["kernel_count"], pytest.approx(float(want["kernel_sum_us"]), abs=1e-3))
        cat = a.categories
        assert cat.loc[cat["category"] == "communication", "total_us"].sum() == pytest.approx(float(want["comm_sum_us"]), abs=1e-3)
    assert len(a.host_syncs()) == syncs

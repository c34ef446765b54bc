"""Perfetto export: tracks per rank, stream and thread, analysis tracks, and well-formed slices."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict

import pytest

import tracelens
from tracelens.analysis.comm import collective_instances
from tracelens.export_perfetto import export_perfetto

from ..conftest import MI250, NCCL_2RANK

pytest.importorskip("perfetto")
from perfetto.trace_builder.proto_builder import Trace  # noqa: E402


def read(path):
    t = Trace.FromString(path.read_bytes())
    names = {p.track_descriptor.uuid: p.track_descriptor.name or p.track_descriptor.process.process_name
             for p in t.packet if p.HasField("track_descriptor")}
    parent = {p.track_descriptor.uuid: p.track_descriptor.parent_uuid for p in t.packet if p.HasField("track_descriptor")}
    slices = defaultdict(list)
    stacks = defaultdict(list)
    last_ts = defaultdict(int)
    for p in t.packet:
        if not p.HasField("track_event"):
            continue
        te = p.track_event
        assert p.timestamp >= last_ts[te.track_uuid]  # time never goes backwards on a track
        last_ts[te.track_uuid] = p.timestamp
        if te.type == te.TYPE_SLICE_BEGIN:
            stacks[te.track_uuid].append((te.name, p.timestamp))
        elif te.type == te.TYPE_SLICE_END:
            name, start = stacks[te.track_uuid].pop()  # every end closes an open slice
            slices[te.track_uuid].append((name, start, p.timestamp))
    assert all(not s for s in stacks.values())  # nothing left open
    return names, parent, slices


def test_two_rank_export(tmp_path):
    a = tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))
    res = export_perfetto(a, tmp_path / "t.pftrace")
    names, parent, slices = read(tmp_path / "t.pftrace")
    procs = [n for u, n in names.items() if n.startswith("rank ")]
    assert sorted(procs) == ["rank 0 (NVIDIA H200)", "rank 1 (NVIDIA H200)"]
    by_name = defaultdict(list)
    for u, n in names.items():
        by_name[n].append(u)
    assert len(by_name["analysis: collective sync wait"]) == 2
    assert len(by_name["GPU 0 stream 7"]) == 1 and len(by_name["GPU 1 stream 21"]) == 1
    # GPU slices = GPU events; sync-wait slices = instances with a wait
    gpu_slices = sum(len(slices[u]) for n, us in by_name.items() if n.startswith("GPU ") for u in us)
    assert gpu_slices == len(a.gpu)
    inst = collective_instances(a)
    waits = sum(len(slices[u]) for u in by_name["analysis: collective sync wait"])
    assert waits == int((inst["sync_us"] > 0).sum())
    startup = [s for u in by_name["analysis: collective sync wait"] for s in slices[u] if "start-up" in s[0]]
    assert len(startup) == 1
    # all-reduce waits on rank 0 last ~2 ms on the shared clock
    r0 = next(u for u in by_name["analysis: collective sync wait"] if names[parent[u]].startswith("rank 0"))
    ar = [e - s for n, s, e in slices[r0] if n.startswith("wait allreduce")]
    assert len(ar) == 3 and all(1.9e6 < d < 2.2e6 for d in ar)
    assert res["slices"] == sum(len(v) for v in slices.values())


def test_cli_and_amd(tmp_path):
    out = tmp_path / "amd.pftrace"
    p = subprocess.run([sys.executable, "-m", "tracelens", "export", str(MI250), "--perfetto", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    names, _, slices = read(out)
    assert any(n.startswith("CPU") for n in names.values()) and sum(map(len, slices.values())) > 100

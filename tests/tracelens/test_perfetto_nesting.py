"""Perfetto export keeps zero-duration slices where they belong: a zero-duration op nests in the op open
at its instant, encloses nothing, and never closes its parent or stays open; ops ending together close
innermost first. Checked by replaying the written BEGIN/END packets as Perfetto does (one stack per
track) against parents worked out by hand from the synthetic trace."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

import tracelens
from tracelens.export_perfetto import export_perfetto

pytest.importorskip("perfetto")
from perfetto.trace_builder.proto_builder import Trace  # noqa: E402

BASE = 1_700_000_000_000_000  # µs, whole microseconds

# (name, ts, dur, expected parent slice on the thread's track)
CPU = [
    ("outer", 0, 100, None),
    ("z_at_outer_start", 0, 0, "outer"),
    ("child", 10, 10, "outer"),
    ("z_in_child", 15, 0, "child"),
    ("z_at_child_end", 20, 0, "outer"),
    ("a", 30, 10, "outer"),
    ("b", 35, 5, "a"),  # ends in the same µs as its parent
    ("z_after_both", 40, 0, "outer"),
    ("z1", 50, 0, "outer"),
    ("z2", 50, 0, "outer"),  # two zero-duration ops at one instant: siblings, not nested
    ("c", 60, 10, "outer"),
    ("z_at_c_start", 60, 0, "c"),
    ("z_at_outer_end", 100, 0, None),
]
# kernels on one stream: a zero-duration one between two that touch it
GPU = [("k1", 0, 10), ("k_zero", 10, 0), ("k2", 10, 10)]


def replay(path):
    """(track name, slice name) -> list of (parent slice name, start, end), replaying packets in order."""
    t = Trace.FromString(path.read_bytes())
    names = {p.track_descriptor.uuid: p.track_descriptor.name for p in t.packet if p.HasField("track_descriptor")}
    stacks, out = defaultdict(list), defaultdict(list)
    for p in t.packet:
        if not p.HasField("track_event"):
            continue
        te = p.track_event
        st = stacks[te.track_uuid]
        if te.type == te.TYPE_SLICE_BEGIN:
            st.append((te.name, p.timestamp, st[-1][0] if st else None))
        elif te.type == te.TYPE_SLICE_END:
            assert st, "an END with no open slice"
            name, start, parent = st.pop()
            assert p.timestamp >= start
            out[(names[te.track_uuid], name)].append((parent, start, p.timestamp))
    assert all(not s for s in stacks.values()), "slices left open"
    return out


def test_zero_duration_slices_nest(tmp_path):
    ev = [{"ph": "X", "cat": "cpu_op", "name": n, "pid": 1, "tid": 1, "ts": BASE + ts, "dur": d,
           "args": {"External id": i + 1}} for i, (n, ts, d, _) in enumerate(CPU)]
    ev += [{"ph": "X", "cat": "kernel", "name": n, "pid": 0, "tid": 7, "ts": BASE + 1000 + ts, "dur": d,
            "args": {"device": 0, "stream": 7, "correlation": 50 + i}} for i, (n, ts, d) in enumerate(GPU)]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": ev}))
    a = tracelens.analyze(tracelens.load(trace, cache=False), window="all")
    out = tmp_path / "t.pftrace"
    res = export_perfetto(a, out)
    got = replay(out)
    cpu = {name: v for (track, name), v in got.items() if track.startswith("CPU")}
    assert set(cpu) == {n for n, *_ in CPU}
    for name, ts, dur, parent in CPU:
        (slice_,) = cpu[name]
        assert slice_ == (parent, ts * 1000, (ts + dur) * 1000), name  # ns since the first event
    gpu = {name: v for (track, name), v in got.items() if track.startswith("GPU")}
    for name, ts, dur in GPU:
        (slice_,) = gpu[name]
        assert slice_ == (None, (1000 + ts) * 1000, (1000 + ts + dur) * 1000), name
    assert res["slices"] == len(CPU) + len(GPU)

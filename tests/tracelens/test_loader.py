"""Loader: every real fixture round-trips into tables that match the raw JSON exactly."""

from __future__ import annotations

import collections
import gzip
import json
import os

import pytest

import tracelens
from tracelens.errors import TraceError
from tracelens.io.kineto import parse_file

from ..conftest import (
    ALL_TRACES,
    CPU_ONLY,
    DIFF_CONTROL,
    MOE_LOOP,
    NCCL_2RANK,
    assert_frames_identical,
    is_tree_event,
    raw_events,
    to_ns,
)


def tree_first(raw: list[dict]) -> list[dict]:
    """Raw timed events in the events table's order: the call tree's events first (complete ops,
    annotations, runtime calls and nn.Module ranges), then the others, each part in file order."""
    def is_tree(e):
        return is_tree_event(e.get("ph"), e.get("cat"), e.get("name", ""))
    return [e for e in raw if is_tree(e)] + [e for e in raw if not is_tree(e)]


@pytest.mark.parametrize("path", ALL_TRACES, ids=lambda p: p.name)
def test_events_match_raw_json(path):
    raw = tree_first([e for e in raw_events(path) if e.get("ph") in ("X", "i", "I")])
    ev = parse_file(path).events.to_pandas()
    assert len(ev) == len(raw)
    # exact integer ns timestamps and durations, in file order within the two parts
    assert ev["ts"].tolist() == [to_ns(e["ts"]) for e in raw]
    assert ev["dur"].tolist() == [to_ns(e.get("dur", 0)) for e in raw]
    assert ev["name"].astype(str).tolist() == [e.get("name", "") for e in raw]
    assert collections.Counter(ev["cat"].astype(str)) == collections.Counter(e.get("cat", "") for e in raw)
    corr = [int((e.get("args") or {}).get("correlation", -1)) for e in raw]
    assert ev["correlation"].tolist() == corr
    ext = [int((e.get("args") or {}).get("External id", -1)) for e in raw]
    assert ev["external_id"].tolist() == ext


def test_op_args_and_collectives():
    ev = parse_file(NCCL_2RANK / "rank0.json.gz").events.to_pandas()
    raw = tree_first([e for e in raw_events(NCCL_2RANK / "rank0.json.gz") if e.get("ph") in ("X", "i", "I")])
    i = next(i for i, e in enumerate(raw) if e.get("cat") == "kernel" and "AllReduce" in e["name"])
    row = ev.iloc[i]
    a = raw[i]["args"]
    assert row["collective"] == a["Collective name"] == "allreduce"
    assert row["in_nelems"] == a["In msg nelems"] and row["group_size"] == 2
    assert row["pg_ranks"] == "[0, 1]" and row["dtype"] == a["dtype"]
    assert row["stream"] == a["stream"] and row["device"] == a["device"]
    assert json.loads(row["grid"]) == a["grid"]
    j = next(i for i, e in enumerate(raw) if e.get("cat") == "cpu_op" and (e.get("args") or {}).get("Input Dims"))
    assert json.loads(ev.iloc[j]["input_dims"]) == raw[j]["args"]["Input Dims"]
    assert json.loads(ev.iloc[j]["input_types"]) == raw[j]["args"]["Input type"]


def test_metadata_and_ranks():
    t = tracelens.load(NCCL_2RANK, cache=False)
    assert t.rank_ids == [0, 1]
    assert t.ranks[0].device_name == "NVIDIA H200"
    assert t.ranks[1].world_size == 2
    assert set(t.events["rank"].unique()) == {0, 1}
    names = t.threads[t.threads["kind"] == "process_name"]
    assert (names["value"] == "python").any()


def test_rank_from_file_name_when_no_distributed_info():
    t = tracelens.load(CPU_ONLY, cache=False)
    assert t.rank_ids == [34]


def test_cache_hit_and_invalidation(tmp_path, monkeypatch):
    src = tmp_path / "t.json.gz"
    src.write_bytes(MOE_LOOP.read_bytes())
    cache = tmp_path / "cache"
    a = tracelens.load(src, cache_dir=cache)
    assert not a.ranks[0].from_cache
    with monkeypatch.context() as m:  # a hit is served from the cache entry: the trace is not parsed again
        m.setattr("tracelens.trace.parse_file", lambda *a, **k: pytest.fail("a cache hit parsed the trace"))
        b = tracelens.load(src, cache_dir=cache)
    assert b.ranks[0].from_cache
    assert_frames_identical(a.events, b.events)
    # change the content: the old entry must not be used
    doc = json.loads(gzip.decompress(src.read_bytes()))
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") != "kernel"]
    src.write_bytes(gzip.compress(json.dumps(doc).encode()))
    c = tracelens.load(src, cache_dir=cache)
    assert not c.ranks[0].from_cache
    assert (c.events["cat"] == "kernel").sum() == 0


def test_parallel_load_matches_serial(tmp_path, monkeypatch):
    import tracelens.trace as T

    monkeypatch.setattr(T, "PARALLEL_MIN_BYTES", 0)
    serial = tracelens.load(NCCL_2RANK, cache=False, jobs=1)
    par = tracelens.load(NCCL_2RANK, cache=False, jobs=2)
    assert_frames_identical(serial.events, par.events)
    par_cached = tracelens.load(NCCL_2RANK, cache=True, cache_dir=tmp_path / "c", jobs=2)
    assert_frames_identical(serial.events, par_cached.events)


def test_bare_array_and_string_pids_and_odd_arg_types(tmp_path):
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": "host", "tid": "main", "ts": 10.5, "dur": 5.25,
         "args": {"External id": 1, "Input Dims": [[2, 3], [3, 4]]}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": "host", "tid": "main", "ts": 11, "dur": 1,
         "args": {"correlation": 7, "stream": "stream 7"}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": "stream 7", "ts": 12, "dur": 3.001,
         "args": {"correlation": 7, "device": "0", "stream": 7}},
    ]
    p = tmp_path / "bare.json"
    p.write_text(json.dumps(events))
    ev = parse_file(p).events.to_pandas()
    assert ev["ts"].tolist() == [10500, 11000, 12000]
    assert ev["dur"].tolist() == [5250, 1000, 3001]
    assert ev.loc[2, "device"] == 0 and ev.loc[2, "stream"] == 7 and ev.loc[1, "stream"] == 7
    assert ev.loc[2, "tid"] == 7
    t = tracelens.load(p, cache=False)
    a = tracelens.analyze(t)
    assert a.gpu["op"].astype(str).tolist() == ["aten::mm"]


BAD = {
    "truncated.json": (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1', "truncated JSON"),
    "garbage.json": (b"hello world", "not a JSON trace"),
    "empty_events.json": (b'{"traceEvents": []}', "empty trace"),
    "no_events.json": (b'{"schemaVersion": 1}', "no 'traceEvents'"),
    "empty.json": (b"", "empty file"),
    "wrong_type.json": (b'{"traceEvents": 5}', "not a Chrome/Kineto trace"),
    "only_meta.json": (b'{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "x"}}]}',
                       "no timed events"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_one_line_error(tmp_path, name):
    data, expected = BAD[name]
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(TraceError) as ei:
        tracelens.load(p, cache=False)
    msg = str(ei.value)
    assert expected in msg and str(p) in msg and "\n" not in msg


def test_corrupt_gzip(tmp_path):
    p = tmp_path / "cut.json.gz"
    p.write_bytes(MOE_LOOP.read_bytes()[:2000])
    with pytest.raises(TraceError, match="corrupt or truncated gzip"):
        tracelens.load(p, cache=False)
    q = tmp_path / "flipped.json.gz"
    data = bytearray(DIFF_CONTROL.read_bytes())
    data[5000:5100] = bytes(100)
    q.write_bytes(bytes(data))
    with pytest.raises(TraceError, match=str(q.name)):
        tracelens.load(q, cache=False)


def test_mismatched_ranks(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    for i in range(2):  # both files claim rank 0
        (d / f"rank{i}.json.gz").write_bytes((NCCL_2RANK / "rank0.json.gz").read_bytes())
    with pytest.raises(TraceError, match="mismatched ranks"):
        tracelens.load(d, cache=False)


def test_empty_directory(tmp_path):
    with pytest.raises(TraceError, match="no trace files"):
        tracelens.load(tmp_path, cache=False)


def test_run_dir_layout(tmp_path):
    run = tmp_path / "runs" / "demo"
    (run / "traces").mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    for i in range(2):
        (run / "traces" / f"rank{i}.json.gz").write_bytes((NCCL_2RANK / f"rank{i}.json.gz").read_bytes())
    t = tracelens.load(run, cache=False)
    assert t.rank_ids == [0, 1]
    assert all(os.path.dirname(r.path).endswith("traces") for r in t.ranks)


@pytest.mark.parametrize("field, value, problem", [
    ("name", ["H100", "x"], "deviceProperties[1].name is a list (expected a string)"),
    ("name", {"a": 1}, "deviceProperties[1].name is an object (expected a string)"),
    ("name", 7, "deviceProperties[1].name is a number (expected a string)"),
    ("totalGlobalMem", "80GB", "deviceProperties[1].totalGlobalMem is a string (expected a number)"),
    ("numSms", [132], "deviceProperties[1].numSms is a list (expected a number)"),
    ("computeMajor", True, "deviceProperties[1].computeMajor is a boolean (expected an integer)"),
])
@pytest.mark.parametrize("cache", [False, True])
def test_device_properties_of_the_wrong_type_are_one_line_naming_the_file(tmp_path, monkeypatch, field, value,
                                                                          problem, cache):
    """A deviceProperties field the analyses read, of a type no profiler writes: one line naming the file
    and the field, exit 2 (a list as a name was "unhashable list", exit 3). Null is absent, as before."""
    import subprocess
    import sys

    from ..conftest import TRITON

    monkeypatch.setenv("TRACELENS_CACHE_DIR", str(tmp_path / "cache"))
    doc = json.loads(gzip.open(TRITON).read())
    doc["deviceProperties"][1][field] = None
    p = tmp_path / "trace.json"
    p.write_text(json.dumps(doc))
    assert tracelens.load(p, cache=cache).ranks[0].device_properties[1][field] is None  # null: absent
    doc["deviceProperties"][1][field] = value
    p.write_text(json.dumps(doc))
    with pytest.raises(TraceError) as e:
        tracelens.load(p, cache=cache)
    assert e.value.one_line() == f"{p}: {problem}"
    args = [sys.executable, "-m", "tracelens", "roofline", str(p)] + ([] if cache else ["--no-cache"])
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert r.returncode == 2 and r.stderr == f"tracelens: error: {p}: {problem}\n", r.stderr


def test_device_properties_not_a_list_of_objects(tmp_path):
    from ..conftest import TRITON

    doc = json.loads(gzip.open(TRITON).read())
    for props in ([1, 2], "H100", {"name": "H100"}):
        doc["deviceProperties"] = props
        p = tmp_path / "trace.json"
        p.write_text(json.dumps(doc))
        with pytest.raises(TraceError) as e:
            tracelens.load(p, cache=False)
        assert e.value.one_line().startswith(f"{p}: ") and "\n" not in e.value.one_line()

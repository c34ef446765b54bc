"""The fast loader's own promises: flow events read on demand, one file split across forked workers
gives the same tables, dictionaries in order of first appearance, remembered cache keys that never
outlive the bytes they were computed from, and worker counts from the CPU affinity mask."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest

import tracelens
from tracelens.errors import TraceError
from tracelens.io import cache as C
from tracelens.io import kineto as K

from ..conftest import DIFF_CONTROL, NCCL_2RANK, raw_events, to_ns


def _decoded(table: pa.Table) -> dict[str, list]:
    """Column values with dictionaries decoded, so tables built from different chunks compare."""
    out = {}
    for c in table.column_names:
        col = table[c]
        if pa.types.is_dictionary(col.type):
            col = col.cast(pa.string())
        vals = col.to_pylist()
        out[c] = ["nan" if isinstance(v, float) and v != v else v for v in vals]
    return out


def test_usable_cpus_follows_the_affinity_mask():
    assert K.usable_cpus() == len(os.sched_getaffinity(0))


def test_flows_are_read_on_first_access(tmp_path):
    t = tracelens.load(NCCL_2RANK, cache=True, cache_dir=tmp_path)
    assert "flows" not in t.__dict__  # not parsed by load
    for rank in (0, 1):
        raw = [e for e in raw_events(NCCL_2RANK / f"rank{rank}.json.gz") if e.get("ph") in ("s", "t", "f")]
        assert len(raw) > 100
        fl = t.flows[t.flows["rank"] == rank]
        assert fl["id"].tolist() == [int(e["id"]) for e in raw]
        assert fl["ts"].tolist() == [to_ns(e["ts"]) for e in raw]
        assert fl["ph"].astype(str).tolist() == [e["ph"] for e in raw]
        assert fl["cat"].astype(str).tolist() == [e["cat"] for e in raw]
    assert "flows" in t.__dict__  # read once, then kept
    # a warm load (cache entry without flows) reads them the same way
    warm = tracelens.load(NCCL_2RANK, cache=True, cache_dir=tmp_path)
    assert all(r.from_cache for r in warm.ranks)
    assert warm.flows["id"].tolist() == t.flows["id"].tolist()


def test_parse_file_with_flows_matches_raw_json():
    p = K.parse_file(NCCL_2RANK / "rank1.json.gz")
    raw = [e for e in raw_events(NCCL_2RANK / "rank1.json.gz") if e.get("ph") in ("s", "t", "f")]
    assert p.flows.column("bp").to_pylist() == [e.get("bp") for e in raw]
    assert K.parse_file(NCCL_2RANK / "rank1.json.gz", flows=False).flows is None


@pytest.mark.parametrize("workers", [2, 3])
def test_forked_workers_give_the_same_tables(workers, monkeypatch):
    # the msgspec path's forked workers (the compiled scanner needs none; test_loader_compiled.py);
    # 109,123 events: every worker gets one or more batches, and dictionaries differ per worker
    monkeypatch.setenv("TRACELENS_PURE_PYTHON", "1")
    serial = K.parse_file(DIFF_CONTROL, parallel=1)
    chunks = []  # the workers' tables, one chunk each, before the rows are ordered (roworder.py)
    real = K._parse_parallel

    def spy(*args, **kw):
        out = real(*args, **kw)
        chunks.append(out[0].column("name").num_chunks)
        return out

    monkeypatch.setattr(K, "_parse_parallel", spy)
    par = K.parse_file(DIFF_CONTROL, parallel=workers)
    assert chunks == [workers]
    assert _decoded(par.events) == _decoded(serial.events)
    assert _decoded(par.flows) == _decoded(serial.flows)
    assert par.threads.sort_by([("kind", "ascending"), ("pid", "ascending"), ("tid", "ascending")]).equals(
        serial.threads.sort_by([("kind", "ascending"), ("pid", "ascending"), ("tid", "ascending")]))


def test_dictionaries_list_values_in_order_of_first_appearance():
    # `collective` is carried by both kernels and cpu ops, which are decoded group by group
    path = NCCL_2RANK / "rank0.json.gz"
    raw = [e for e in raw_events(path) if e.get("ph") in ("X", "i", "I")]
    expected = []
    for e in raw:
        v = (e.get("args") or {}).get("Collective name")
        if v is not None and v not in expected:
            expected.append(v)
    assert len(expected) >= 2
    ev = K.parse_file(path).events
    assert ev.column("collective").combine_chunks().dictionary.to_pylist() == expected
    names = list(dict.fromkeys(e.get("name", "") for e in raw))
    assert ev.column("name").combine_chunks().dictionary.to_pylist() == names


def test_missing_timestamp_is_a_one_line_error(tmp_path):
    p = tmp_path / "nots.json"
    p.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "pid": 1, "tid": 1, "dur": 1},
                                             {"ph": "X", "cat": "cpu_op", "name": "b", "pid": 1, "tid": 1, "ts": 2}]}))
    with pytest.raises(TraceError) as ei:
        tracelens.load(p, cache=False)
    assert str(ei.value).count("\n") == 0
    assert "nots.json" in str(ei.value) and "1 complete events have no 'ts'" in str(ei.value)


def test_remembered_cache_key_is_only_reused_for_the_same_bytes(tmp_path):
    src = tmp_path / "t.json"
    src.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1, "dur": 1}]}))
    root = tmp_path / "cache"
    k1 = C.key_of(str(src), root)
    assert k1 == C.content_key(str(src))
    assert len(list((root / "keys").iterdir())) == 1  # remembered
    assert C.key_of(str(src), root) == k1
    # same size, same mtime, different bytes: the key must change
    st = os.stat(src)
    src.write_text(src.read_text().replace('"a"', '"b"'))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(src).st_size == st.st_size
    k2 = C.key_of(str(src), root)
    assert k2 != k1 and k2 == C.content_key(str(src))
    # and a warm load of the rewritten file sees the new name, not the cached old one
    tracelens.load(src, cache=True, cache_dir=root)
    src.write_text(src.read_text().replace('"b"', '"c"'))
    assert tracelens.load(src, cache=True, cache_dir=root).events["name"].astype(str).tolist() == ["c"]


@pytest.mark.parametrize("path", [NCCL_2RANK / "rank0.json.gz", DIFF_CONTROL], ids=lambda p: p.parent.name + "/" + p.name)
def test_runtime_call_parents_match_a_per_thread_step_function(path):
    """build_tree places runtime calls with one vectorized search over (thread, time) keys. Reference:
    per thread, the innermost open range as a step function of time (a range's start makes it the top,
    its end makes its parent the top), searched with bisect. At one instant, half-open intervals
    [ts, ts + dur): ends before starts, the deepest end first (a child ending in its parent's
    microsecond leaves the parent's parent on top, not the parent), starts parents first; a
    zero-duration range encloses nothing, so it never becomes the top."""
    import bisect
    from collections import defaultdict

    from tracelens.analysis import calltree as CT

    events = tracelens.load(path, cache=False).events
    tree = CT.build_tree(events)
    thread = list(zip(tree["rank"], tree["pid"], tree["tid"]))
    ts, end = tree["ts"].tolist(), (tree["ts"] + tree["dur"]).tolist()
    labels, kind, parent = tree.index.tolist(), tree["kind"].tolist(), tree["parent"].tolist()
    pos = {lab: i for i, lab in enumerate(labels)}
    depth = {}  # from the parent links: the number of enclosing ranges

    def depth_of(lab):
        if lab not in depth:
            p = parent[pos[lab]]
            depth[lab] = 0 if p < 0 else depth_of(p) + 1
        return depth[lab]

    steps = defaultdict(list)  # (time, 0 = end / 1 = start, order at the instant, top afterwards)
    for i, lab in enumerate(labels):
        if kind[i] != CT.KIND_RUNTIME and end[i] > ts[i]:
            d = depth_of(lab)
            steps[thread[i]].append((ts[i], 1, d, lab))
            steps[thread[i]].append((end[i], 0, -d, parent[i]))
    for v in steps.values():
        v.sort()
    expected = {}
    for i, lab in enumerate(labels):
        if kind[i] == CT.KIND_RUNTIME:
            v = steps.get(thread[i], [])
            k = bisect.bisect_right(v, (ts[i], 2)) - 1
            expected[lab] = v[k][3] if k >= 0 else -1
    got = {lab: p for lab, k, p in zip(labels, kind, parent) if k == CT.KIND_RUNTIME}
    assert len(got) > 100 and sum(p >= 0 for p in got.values()) > len(got) / 2
    assert got == expected


def test_vectorized_categories_match_the_rule_list_row_by_row():
    from tracelens import categories as CAT

    a = tracelens.analyze(tracelens.load(DIFF_CONTROL, cache=False))
    g = a.gpu
    expected = [CAT.categorize(str(n), str(o), str(c)) for n, o, c in zip(g["name"], g["op"], g["cat"])]
    assert g["category"].astype(str).tolist() == expected
    assert len(set(expected)) >= 4


def test_args_decode_falls_back_batch_by_batch(tmp_path):
    """Args are decoded inline with typed fields; a batch whose args are not all objects is decoded with
    raw args instead (only the groups that carry args decode them), and gives the same columns."""
    good = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1.5, "dur": 2,
             "args": {"External id": 5, "Input Dims": [[2, 3], [3, 4]], "Collective name": "none"}},
            {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 2, "dur": 1,
             "args": {"External id": 5, "correlation": 9, "grid": [1, 2, 1]}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main thread"}}]
    odd = good + [{"ph": "X", "cat": "my_marker", "name": "m", "pid": 1, "tid": 1, "ts": 5, "dur": 0, "args": [1, 2]}]
    tabs = []
    for name, evs in (("good.json", good), ("odd.json", odd)):
        p = tmp_path / name
        p.write_text(json.dumps({"traceEvents": evs}))
        tabs.append(K.parse_file(p))
    a, b = (_decoded(t.events) for t in tabs)
    assert {c: v[:2] for c, v in b.items()} == a
    assert a["external_id"] == [5, 5] and a["correlation"] == [-1, 9]
    assert a["input_dims"] == ["[[2, 3], [3, 4]]", None] and a["grid"] == [None, "[1, 2, 1]"]
    assert a["collective"] == ["none", None]
    for t in tabs:
        names = t.threads.to_pandas()
        assert names.loc[names["kind"] == "thread_name", "value"].tolist() == ["main thread"]


def test_the_cache_key_is_xxh3_128_of_the_bytes_as_stored_and_the_schema(tmp_path):
    """Computed here from the file's bytes with xxhash itself: the bytes as stored (a gzip file compressed), then the
    loader's schema version; hashed from bytes held, from a memory map and from the path alike."""
    import gzip
    import mmap

    import xxhash

    from tracelens.io import cache as C
    from tracelens.io.schema import SCHEMA_VERSION

    src = tmp_path / "t.json.gz"
    src.write_bytes(gzip.compress(b'{"traceEvents": []}' * 1000))
    want = xxhash.xxh3_128(src.read_bytes() + f"schema{SCHEMA_VERSION}".encode()).hexdigest()
    assert len(want) == 32
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert C.content_key(str(src)) == C.content_key(str(src), src.read_bytes()) == C.content_key(str(src), m) == want

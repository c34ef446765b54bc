"""The compiled scanner in parallel parts (scanner.Scan.run, threads > 1) gives exactly what one thread
gives: the same columns, dictionaries in the same order, the same integer widths, the same errors.

The reference here is the scanner on one thread, which test_loader_compiled.py checks against the
msgspec path; the last tests also go all the way to the tables with the parts forced on."""

from __future__ import annotations

import glob
import json
import mmap
import random

import pytest

from tracelens.io import kineto as K
from tracelens.io import scanner

from ..conftest import FIXTURES, NCCL_2RANK
from .test_loader_compiled import _assert_same, _mutations, _pure, cut_real_trace

pytestmark = pytest.mark.skipif(scanner._kineto_fast is None, reason="compiled scanner not built (no C compiler)")

FIXTURE_FILES = sorted(glob.glob(str(FIXTURES / "**" / "*.json.gz"), recursive=True))


def _plain(v):
    """A scan result as plain Python values (the Column buffers as bytes), for equality."""
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return bytes(memoryview(v))


def _scan(data, threads: int) -> scanner.Scan:
    s = scanner.Scan(data)
    s.run(threads=threads)
    return s


def _same_scan(data, threads: int) -> scanner.Scan:
    one, many = _scan(data, 1), _scan(data, threads)
    assert many.error == one.error
    assert _plain(many.result) == _plain(one.result)
    return many


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.split("fixtures/")[-1])
def test_every_fixture_scans_the_same_in_parts(path):
    data = scanner.read_bytes(path)
    for threads in (2, 3, 7):
        s = _same_scan(data, threads)
        assert s.error is None
        if data.count(b'{"ph"') > 4 * threads:  # enough events: every guessed start is a real one
            assert s.parts_used == threads, threads


def _ev(i: int, **args) -> dict:
    return {"ph": "X", "cat": "kernel", "name": f"k{i % 7}", "pid": 0, "tid": 7, "ts": 1000.0 + i, "dur": 0.5,
            "args": {"correlation": i, "stream": 7, **args}}


def _doc(events) -> bytes:
    return json.dumps({"traceEvents": events, "deviceProperties": [{"id": 0}]}, separators=(",", ":")).encode()


def test_a_guessed_start_inside_args_is_not_used():
    # args holding lists of objects that begin with an event's key: most guesses land inside them, and
    # the part before such a guess scans on through it (a part is used only where a parser lands exactly)
    frames = [{"name": f"f{j}", "ts": j} for j in range(40)]
    data = _doc([dict(_ev(i), args={"frames": frames, "correlation": i}) for i in range(300)])
    s = _same_scan(data, 6)
    assert s.error is None and 1 <= s.parts_used < 6
    one = _scan(data, 1)
    assert one.result["rows"] == 300


def test_widths_and_dictionaries_merge_as_one_parser_has_them():
    # part 1: small ints and few strings; part 2: ints past int32 and > 127 distinct string args, so the
    # merged columns must widen and the codes renumber in order of first appearance
    first = [_ev(i, device=i % 3, **{"External id": 5, "Collective name": "c"}) for i in range(200)]
    second = [_ev(i, device=2**40 + i, **{"External id": 70000 + i, "Collective name": f"c{i}"})
              for i in range(200, 600)]
    data = _doc(first + second)
    for threads in (2, 4, 5):
        s = _same_scan(data, threads)
        assert s.parts_used == threads
    widths = dict(zip(K.ARG_FIELDS, _scan(data, 3).result["arg_widths"]))
    assert widths["device"] == 8 and widths["external_id"] == 4  # values from a later part widened them
    assert widths["collective"] == 2  # 401 distinct names: codes past int8


def test_string_pids_flows_metadata_and_fixups_in_every_part():
    meta = {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}}
    flow = {"ph": "s", "id": 1, "pid": 0, "tid": 7, "ts": 1.0, "cat": "ac2g", "name": "ac2g"}
    events = []
    for i in range(400):
        e = _ev(i)
        if i % 50 == 0:
            e = dict(e, pid="Spans", tid=f"stream {i}")
        if i % 37 == 0:
            e["args"]["stream"] = "0x0"  # an int arg of another JSON type: a fix-up row
        events += [e, meta, flow] if i % 60 == 0 else [e]
    data = _doc(events)
    for threads in (2, 3, 8):
        s = _same_scan(data, threads)
        assert s.parts_used == threads
        assert len(memoryview(s.result["fixups"])) == 8 * 4 * 11  # 11 fix-ups of 4 int64s, rows counted across parts


@pytest.mark.parametrize("where", [0.1, 0.5, 0.97])
def test_an_error_in_any_part_is_the_one_a_single_thread_meets(where):
    events = [_ev(i) for i in range(600)]
    data = bytearray(_doc(events))
    k = int(len(data) * where)
    k = data.index(b'"name":"', k) + len(b'"name":"')
    data[k:k] = b"\\q"  # an invalid escape in this event's name
    data = bytes(data)
    one = _scan(data, 1)
    assert one.result is None and "invalid escape" in one.error
    for threads in (2, 3, 6):
        s = _same_scan(data, threads)
        assert s.error == one.error


def test_truncated_and_fuzzed_documents_give_the_same_outcome_in_parts():
    data = cut_real_trace(300)
    rng = random.Random(20261125)
    outcomes = set()
    for mutated in _mutations(data, rng, 150):
        s = _same_scan(mutated, 3)
        outcomes.add(s.error is None)
    assert outcomes == {True, False}  # both kinds were met


def test_a_memory_mapped_file_scans_the_same_in_parts(tmp_path, monkeypatch):
    data = _doc([_ev(i) for i in range(2000)])
    path = tmp_path / "t.json"
    path.write_bytes(data)
    monkeypatch.setattr(scanner, "MAP_MIN", 0)
    mm = scanner.map_file(str(path))
    assert isinstance(mm, mmap.mmap)
    s = _scan(mm, 4)
    assert s.parts_used == 4
    assert _plain(s.result) == _plain(_scan(data, 1).result)


@pytest.mark.parametrize("path", [NCCL_2RANK / "rank0.json.gz", FIXTURES / "h200_moe_1gpu" / "moe1gpu_loop.json.gz"],
                         ids=lambda p: p.name)
def test_tables_from_a_scan_in_parts_equal_the_msgspec_paths(path, monkeypatch):
    monkeypatch.setenv("TRACELENS_SCAN_THREADS", "3")
    fast = K.parse_file(path)
    assert fast.meta["decoder"] == "compiled"
    _assert_same(fast, _pure(monkeypatch, path))


def test_scan_threads_follow_the_size_the_cpus_and_the_override(monkeypatch):
    monkeypatch.delenv("TRACELENS_SCAN_THREADS", raising=False)
    monkeypatch.setattr(scanner, "usable_cpus", lambda: 4)
    assert scanner.scan_threads(scanner.PARALLEL_MIN - 1) == 1
    assert scanner.scan_threads(scanner.PARALLEL_MIN) == 2  # parts of at least PART_MIN bytes
    assert scanner.scan_threads(10 * scanner.PART_MIN) == 4  # one per usable CPU
    monkeypatch.setattr(scanner, "usable_cpus", lambda: 64)
    assert scanner.scan_threads(1 << 40) == scanner.MAX_PARTS
    monkeypatch.setenv("TRACELENS_SCAN_THREADS", "1")
    assert scanner.scan_threads(1 << 40) == 1
    monkeypatch.setenv("TRACELENS_SCAN_THREADS", "5")
    assert scanner.scan_threads(10) == 5


def test_the_parallel_api_refuses_misuse():
    data = _doc([_ev(i) for i in range(100)])
    p = scanner._kineto_fast.Parser(data, *scanner._FAST_SPEC)
    with pytest.raises(RuntimeError):
        p.fork(len(data) // 2)  # the events array is not located yet
    p.feed(0)
    with pytest.raises(ValueError):
        p.fork(len(data) + 5)
    s = scanner.Scan(data)
    s.parser.feed(0)
    a, b = s.part_starts(3)
    first, part1, part2 = s.parser, s.parser.fork(a), s.parser.fork(b)
    with pytest.raises(ValueError):
        first.set_limits([b, a])  # not ascending
    with pytest.raises(RuntimeError):
        part1.fork(b)  # only the first parser forks
    first.set_limits([a, b])
    part1.set_limits([b])
    while not first.feed(1000):
        pass
    assert first.stopped_at == a
    with pytest.raises(RuntimeError):
        first.absorb(part2)  # not the part it handed off to
    with pytest.raises(RuntimeError):
        first.absorb(part1)  # not scanned yet
    while not part1.feed(1000):
        pass
    while not part2.feed(1000):
        pass
    first.absorb(part1)
    assert first.stopped_at == b
    with pytest.raises(RuntimeError):
        first.result()  # a part is still to be absorbed
    first.absorb(part2)
    assert first.result()["rows"] == 100


@pytest.mark.parametrize("parts", [1, 2])
def test_dictionary_values_come_from_the_scanners_copy_not_the_document(parts):
    # the values of the string columns are read from the dictionaries' own copies at the end of the scan (and when
    # parts merge), never again from the document: a memory-mapped trace's pages are given back behind the scan, and
    # reading 800,000 distinct names from a 2 GB file faulted all of it back in (peak 2.8 GB for 753 MB of columns).
    # Overwriting the document after the events were fed must not change them.
    names = [f"op_{i}" for i in range(4000)]
    buf = bytearray(json.dumps({"traceEvents": [_ev(i) | {"name": n} for i, n in enumerate(names)]}).encode())
    first = scanner._kineto_fast.Parser(buf, *scanner._FAST_SPEC)
    forks = []
    if parts > 1:
        sc = scanner.Scan(buf)
        first = sc.parser
        first.feed(0)
        starts = sc.part_starts(parts)
        assert starts
        forks = [first.fork(s) for s in starts]
        first.set_limits(starts)
        for k, part in enumerate(forks):
            part.set_limits(starts[k + 1:])
    for p in [first, *forks]:
        while not p.feed(1000):
            pass
    buf[:] = buf.replace(b'"op_', b'"XX_')  # the same length: the parsers still see this buffer
    at = {p.start: p for p in forks}
    while first.stopped_at >= 0:
        first.absorb(at[first.stopped_at])
    codes, values, _ = first.result()["name"]
    assert sorted(v.decode() for v in values) == sorted(names)

"""The compiled scanner (`tracelens/io/_kineto_fast.c`) against the msgspec path, its reference.

Every real trace must give identical tables through both, the scanner must actually take them (a
silent fallback would hide a 3x regression), and any input -- odd but valid JSON, or mutated and
broken bytes -- must give the same outcome through both: the same tables or the same one-line error.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import random
from decimal import ROUND_HALF_EVEN, Decimal

import numpy as np
import pyarrow as pa
import pytest

from tracelens.errors import TraceError
from tracelens.io import kineto as K

from ..conftest import FIXTURES, NCCL_2RANK

pytestmark = pytest.mark.skipif(K._kineto_fast is None, reason="compiled scanner not built (no C compiler)")

FIXTURE_FILES = sorted(glob.glob(str(FIXTURES / "**" / "*.json.gz"), recursive=True))


def _sorted_threads(t: pa.Table) -> pa.Table:
    return t.sort_by([(c, "ascending") for c in t.column_names])


def _pure(monkeypatch, path, data=None, flows=True):
    monkeypatch.setenv("TRACELENS_PURE_PYTHON", "1")
    try:
        return K.parse_file(path, data=data, parallel=1, flows=flows)
    finally:
        monkeypatch.delenv("TRACELENS_PURE_PYTHON")


def _assert_same(fast: K.ParsedTrace, pure: K.ParsedTrace) -> None:
    assert fast.events.schema == pure.events.schema
    for c in fast.events.column_names:  # column by column, so a failure names the column
        a, b = fast.events[c], pure.events[c]
        if pa.types.is_floating(a.type):  # NaN (absent) equals NaN here
            assert np.array_equal(a.to_numpy(), b.to_numpy(), equal_nan=True), c
        else:
            assert a.equals(b), c
    if pure.flows is None:
        assert fast.flows is None
    else:
        assert fast.flows.equals(pure.flows)
    assert _sorted_threads(fast.threads).equals(_sorted_threads(pure.threads))
    assert {k: v for k, v in fast.meta.items() if k != "decoder"} == {
        k: v for k, v in pure.meta.items() if k != "decoder"}


def test_fixture_list_is_not_empty():
    assert len(FIXTURE_FILES) >= 20


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.split("fixtures/")[-1])
def test_every_fixture_gives_the_same_tables_through_the_scanner(path, monkeypatch):
    fast = K.parse_file(path)
    assert fast.meta["decoder"] == "compiled", "the scanner fell back on a real trace"
    pure = _pure(monkeypatch, path)
    assert pure.meta["decoder"] == "msgspec"
    _assert_same(fast, pure)


def test_flows_left_out_the_same_way(monkeypatch):
    path = NCCL_2RANK / "rank0.json.gz"
    fast = K.parse_file(path, flows=False)
    assert fast.flows is None and fast.meta["decoder"] == "compiled"
    _assert_same(fast, _pure(monkeypatch, path, flows=False))


def _doc(events, **top) -> bytes:
    return json.dumps({**top, "traceEvents": events}).encode()


def _kernel(name="k", **args):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": 10.5, "dur": 2.25,
            "args": {"correlation": 3, "External id": 4, "device": 0, "stream": 7, "grid": [1, 2, 3], **args}}


def _op(name="aten::mm", **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 100, "tid": 100, "ts": 9.0, "dur": 5.0,
            "args": {"External id": 4, "Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"], **args}}


META = {"ph": "M", "name": "thread_name", "pid": 100, "tid": 100, "args": {"name": "python"}}

# (id, document bytes, whether the scanner takes it)
CASES = [
    ("plain", _doc([META, _op(), _kernel()]), True),
    ("pretty-printed", json.dumps({"traceEvents": [META, _op(), _kernel()]}, indent=2).encode(), True),
    ("bare array", json.dumps([_op(), _kernel()]).encode(), True),
    ("keys after the events", _doc([_op(), _kernel()], deviceProperties=[{"id": 0, "name": "H100"}])
     + b"", True),
    ("escaped names merge with plain ones",
     b'{"traceEvents":[' + json.dumps(_kernel('a"b')).encode() + b","
     + json.dumps(_kernel("caf\u00e9"), ensure_ascii=False).encode() + b","
     + json.dumps(_kernel("caf\u00e9")).encode() + b"," + json.dumps(_kernel("tab\there")).encode() + b"]}", True),
    ("string pids and tids", _doc([dict(_op(), pid="Spans", tid="stream 7"), dict(_kernel(), tid="Traces"),
                                   dict(META, pid="Spans")]), True),
    ("no args, empty args, no dur, no cat", _doc([{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1},
                                                 {"ph": "i", "name": "b", "pid": 1, "tid": 1, "ts": 2, "args": {}},
                                                 {"ph": "X", "pid": 1, "tid": 1, "ts": 3, "dur": 1}]), True),
    ("timestamps: integers, negatives, 1-3 decimals, exponents, >3 decimals, epoch",
     _doc([dict(_kernel(), ts=t, dur=d) for t, d in [
         (0, 0), (-1.5, 0.001), (1.25, 1e3), (123456.789, 1.2345), (1661203462598509, 3),
         (1661203462598509.123, 0.5), (2.5e-3, 1e-4), (7e12, 10.999)]]), True),
    ("null args and unknown keys", _doc([dict(_kernel(), extra={"a": [1, {"b": None}]}),
                                         dict(_op(), args={"Input Dims": None, "Sequence number": None,
                                                           "Collective name": None, "flops": None})]), True),
    ("quoted JSON in split sizes", _doc([_op(**{"In split size": "[1, 2]", "Out split size": "null",
                                               "Process Group Ranks": [0, 1]})]), True),
    ("collective args on kernels and ops", _doc([
        _kernel("nccl", **{"Collective name": "allreduce", "In msg nelems": 10, "dtype": "Float"}),
        _op("c10d::allreduce_", **{"Collective name": "allreduce", "Group size": 2})]), True),
    ("flops as int and float", _doc([_op(flops=12), _op(flops=1.5e12)]), True),
    ("counter and async events are dropped", _doc([{"ph": "C", "name": "mem", "pid": 1, "ts": 1, "args": {"v": 1}},
                                                  {"ph": "b", "name": "x", "pid": 1, "ts": 2, "id": 5}, _kernel()]),
     True),
    ("flow events", _doc([_kernel(), {"ph": "s", "id": 1, "pid": 0, "tid": 7, "ts": 1, "cat": "ac2g", "name": "f"},
                          {"ph": "f", "id": "0x1", "pid": 0, "tid": 7, "ts": 2, "bp": "e", "cat": "ac2g"}]), True),
    # args of another JSON type than their column's, converted as the lenient decode does
    ("ROCm string streams", _doc([_kernel(stream="0x0"), _kernel(stream="7"), _kernel(stream="stream 3"),
                                  _kernel(stream=" 12 "), _kernel(stream="1e2")]), True),
    ("float and bool int args", _doc([_kernel(correlation=3.7, device=True), _kernel(correlation=-2.0)]), True),
    ("non-string str args", _doc([_kernel(**{"Collective name": c}) for c in
                                  [True, "true", "True", 5, "5", 1.5, [1, "a"], {"k": None}, None]]), True),
    ("non-number float args", _doc([_op(flops=f) for f in ["1.5", "x", True, [1], None, 2]]), True),
    # a string arg's codes widen as its dictionary grows (int8 -> int16 past 127 values, in the scanner)
    ("300 distinct shapes, absent between", _doc([_op(**{"Input Dims": [[i, 3]]}) if i % 3 else _op(**{"Input Dims": None})
                                                  for i in range(450)]), True),
    # rows reordered: the call tree's events first, each part in file order (roworder.py)
    ("kernels, ops, runtime calls, modules and instants interleaved", _doc([
        _kernel("k0"), _op("aten::a"), {"ph": "i", "name": "mark", "pid": 100, "tid": 100, "ts": 1, "s": "t"},
        dict(_kernel("rt"), cat="cuda_runtime"), {"ph": "X", "cat": "python_function", "name": "nn.Module: L",
                                                   "pid": 100, "tid": 100, "ts": 2, "dur": 9},
        {"ph": "X", "cat": "python_function", "name": "f.py(1): g", "pid": 100, "tid": 100, "ts": 3, "dur": 1},
        _kernel("k1", correlation=9), dict(_op("step"), cat="user_annotation")]), True),
    # the scanner hands these to the msgspec path: same outcome either way
    ("args not an object", _doc([dict(_op(), args=[1, 2])]), False),
    ("escaped key", b'{"traceEvents":[{"p\\u0068":"X","name":"a","pid":1,"tid":1,"ts":1}]}', False),
    ("timed event without ts", _doc([{"ph": "X", "name": "a", "pid": 1, "tid": 1, "dur": 1}]), False),
    ("null dur", _doc([dict(_kernel(), dur=None)]), False),
    ("float pid", _doc([dict(_kernel(), pid=1.5)]), False),
    ("huge int arg", _doc([_kernel(correlation=2**70)]), True),  # beyond int64: absent (-1) both ways
    ("empty events", _doc([]), False),
    ("only metadata", _doc([META]), False),
    ("no traceEvents", b'{"foo": 1}', False),
    ("traceEvents not a list", b'{"traceEvents": {"a": 1}}', False),
    ("trailing garbage", _doc([_kernel()]) + b" x", False),
    ("truncated", _doc([_op(), _kernel()])[:-20], False),
    ("not JSON", b"PK\x03\x04 zip file", False),
    ("event not an object", _doc([_kernel(), 5]), False),
    ("invalid escape", b'{"traceEvents":[{"ph":"X","name":"a\\q","pid":1,"tid":1,"ts":1}]}', False),
    ("duplicate args", b'{"traceEvents":[{"ph":"X","name":"a","pid":1,"tid":1,"ts":1,"args":{"stream":1},'
                       b'"args":{"device":2}}]}', False),
]


def _outcome(fn):
    try:
        p = fn()
    except TraceError as e:
        return ("error", str(e))
    except Exception as e:  # noqa: BLE001 - a reference-path bug must at least be the same bug
        return ("error", f"{type(e).__name__}: {e}")
    return ("ok", p)


def _same_outcome(a, b) -> None:
    assert a[0] == b[0], (a, b)
    if a[0] == "error":
        assert a[1] == b[1]
    else:
        _assert_same(a[1], b[1])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_odd_documents_give_the_same_outcome(case, monkeypatch, tmp_path):
    _, data, taken = case
    path = tmp_path / "t.json"
    path.write_bytes(data)
    fast = _outcome(lambda: K.parse_file(path))
    pure = _outcome(lambda: _pure(monkeypatch, path))
    _same_outcome(fast, pure)
    if fast[0] == "ok":
        assert (fast[1].meta["decoder"] == "compiled") == taken
    else:
        assert not taken


def test_escaped_spellings_of_one_name_are_one_dictionary_value():
    # distinct correlation ids: three events, not one recorded twice (exact duplicates are dropped)
    data = b'{"traceEvents":[' + b",".join(json.dumps(_kernel(n, correlation=i), ensure_ascii=a).encode() for i, (n, a) in
                                          enumerate([("caf\u00e9", False), ("caf\u00e9", True), ("x", True)])) + b"]}"
    ev = K.parse_file("mem.json", data=data).events
    assert ev.column("name").combine_chunks().dictionary.to_pylist() == ["caf\u00e9", "x"]
    assert ev.column("name").to_pylist() == ["caf\u00e9", "caf\u00e9", "x"]


def test_string_specials_at_every_offset_of_a_block(monkeypatch, tmp_path):
    """The scanner finds a string's end, escapes and control characters 16 (and 8) bytes at a time: each
    kind of special byte at every offset of a block, and strings of every length around a block, give what
    the msgspec path gives (the same tables, or the same error)."""
    names = []  # (JSON text of each name)
    for n in range(0, 40):
        names.append("k" * n)  # the closing quote at every offset
        names.append("k" * n + r"\"q\"" + "z" * (n % 7))  # an escape at every offset
        names.append("k" * n + r"\u00e9" + "y" * (n % 5))  # a \u escape
        names.append("k" * n + "\u00e9\u00ff" + "x" * (n % 3))  # bytes above 0x7f (never a stop byte)
    events = [f'{{"ph":"X","cat":"kernel","name":"{nm}","pid":1,"tid":1,"ts":{i},"dur":1}}' for i, nm in enumerate(names)]
    path = tmp_path / "t.json"
    path.write_bytes(("{\"traceEvents\":[" + ",".join(events) + "]}").encode())
    fast = _outcome(lambda: K.parse_file(path))
    assert fast[0] == "ok" and fast[1].meta["decoder"] == "compiled"
    _same_outcome(fast, _outcome(lambda: _pure(monkeypatch, path)))
    for n in range(0, 34):  # a raw control character (invalid JSON) at every offset: refused alike
        bad = tmp_path / f"bad{n}.json"
        bad.write_bytes(b'{"traceEvents":[{"ph":"X","cat":"kernel","name":"' + b"k" * n + b'\x01z","pid":1,"tid":1,"ts":1}]}')
        _same_outcome(_outcome(lambda: K.parse_file(bad)), _outcome(lambda: _pure(monkeypatch, bad)))


def test_numbers_of_every_length_give_the_same_tables(monkeypatch, tmp_path):
    """Integers read 8 digits at a time and timestamps of at most 3 decimals read in one pass: int args of
    1 to 24 digits, both signs, around the int64 bounds (past them: the lenient conversion), fractions with long
    digit runs, timestamps near the 2**53 us bound and with exponents, through both paths alike."""
    ints = []
    for d in range(1, 25):
        for lead in "19":
            ints.append(lead + "7" * (d - 1))
    ints += [str(2**63 - 1), str(2**63), str(2**64 - 1), str(2**64), "-" + str(2**63), "-" + str(2**63 + 1), "0", "-0",
             "12345678", "123456789", "9999999999999999", "1.5", "12345678901234567.25", "1e3", "-2.5E+2"]
    ts = ["4558382003891.471", "1695835542513910", "9007199254740991.999", "9007199254740992", "9007199254740992.0",
          "12e0", "1.5e-0", "1.25E+0", "0.001", "-0.5", "00.5", "123.4567", "1234567890123456.7", "12345678901234567",
          "4503599627370496.5e0", "7e2", "0"]
    events = []
    for i, v in enumerate(ints):
        events.append('{"ph":"X","cat":"cpu_op","name":"n%d","pid":1,"tid":1,"ts":%d,"dur":1,'
                      '"args":{"External id":%s,"Sequence number":%s,"Input Dims":[[%s,2],[]]}}' % (i, i, v, v, v))
    for i, v in enumerate(ts):
        events.append('{"ph":"X","cat":"kernel","name":"t%d","pid":1,"tid":2,"ts":%s,"dur":%s}' % (i, v, v.lstrip("-")))
    taken = 0
    for k, evs in enumerate([[e] for e in events] + [[e for e in events if '"name":"t12"' not in e]]):  # each alone,
        path = tmp_path / f"n{k}.json"  # then all but the invalid 00.5 together
        path.write_bytes(("{\"traceEvents\":[" + ",".join(evs) + "]}").encode())
        fast = _outcome(lambda: K.parse_file(path))
        _same_outcome(fast, _outcome(lambda: _pure(monkeypatch, path)))
        taken += fast[0] == "ok" and fast[1].meta["decoder"] == "compiled"
    assert taken > len(events) // 2


def _mutations(data: bytes, rng: random.Random, n: int):
    interesting = b'{}[]",:0123456789.-eEtfn\\ \n'
    for _ in range(n):
        b = bytearray(data)
        kind = rng.randrange(5)
        i = rng.randrange(len(b))
        if kind == 0:  # flip a byte to a JSON-significant one
            b[i] = rng.choice(interesting)
        elif kind == 1:  # delete a run
            del b[i : i + rng.randrange(1, 8)]
        elif kind == 2:  # duplicate a run
            j = rng.randrange(len(b))
            b[i:i] = b[j : j + rng.randrange(1, 40)]
        elif kind == 3:  # truncate
            del b[i:]
        else:  # an arbitrary byte (non-ASCII, control characters)
            b[i] = rng.randrange(256)
        yield bytes(b)


def cut_real_trace(n_timed: int) -> bytes:
    """A real trace (NCCL rank 1) cut to 40 untimed and `n_timed` timed events: small enough for fuzzing."""
    with gzip.open(NCCL_2RANK / "rank1.json.gz", "rb") as f:
        doc = json.loads(f.read())
    timed = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("ph") != "X"][:40] + timed[:n_timed]
    return json.dumps(doc).encode()


def test_fuzzed_traces_give_the_same_outcome_through_both_paths(monkeypatch, tmp_path):
    # a real trace, cut to a few hundred events so every mutation is parsed twice quickly
    data = cut_real_trace(120)
    rng = random.Random(20261123)
    taken = 0
    n = int(os.environ.get("TRACELENS_FUZZ_N", "400"))  # more for a sanitizer run (docs/performance.md)
    for k, mutated in enumerate(_mutations(data, rng, n)):
        fast = _outcome(lambda: K.parse_file(f"fuzz{k}.json", data=mutated))
        pure = _outcome(lambda: _pure(monkeypatch, f"fuzz{k}.json", data=mutated))
        _same_outcome(fast, pure)
        taken += fast[0] == "ok" and fast[1].meta["decoder"] == "compiled"
    assert taken > n // 4  # most single-byte changes inside strings leave a valid trace the scanner takes


def test_version_names_the_decoder_in_use():
    from click.testing import CliRunner

    from tracelens.cli import main

    out = CliRunner().invoke(main, ["--version"]).output
    assert "trace decoder: compiled scanner" in out


def test_timestamps_are_exact_nanoseconds_at_every_magnitude(monkeypatch):
    # both decoders against the exact decimal value, rounded half to even (timestamps.py's rule), from
    # Kineto's monotonic clock (2**30 us) to epoch clocks (2**50.6 us) and the bound, with 1-7 decimals
    # and the rounding edges: a fraction that rounds up to the next whole microsecond, exact halves
    rng = random.Random(20261125)
    vals = []
    for _ in range(20000):
        e = rng.choice([30, 39, 40, 41, 42, 45, 48, 51, 52])
        ip = rng.randrange(1 << e, min(1 << (e + 1), 9 * 10**15))
        fd = rng.choice([1, 2, 3, 3, 4, 6, 7])
        f = rng.choice([rng.randrange(10**fd), 10**fd - 1, 5 * 10 ** (fd - 1), 0])
        vals.append(f"{ip}.{f:0{fd}d}")
    vals += ["1099511627776.999", "4503599627370495.999999", "4503599627370496.5", "1099511627775.9995"]
    doc = ('{"traceEvents":[' + ",".join('{"ph":"X","name":"a%d","pid":1,"tid":1,"ts":%s,"dur":1}' % (i, v)
                                         for i, v in enumerate(vals)) + "]}").encode()
    want = [int((Decimal(v) * 1000).to_integral_value(rounding=ROUND_HALF_EVEN)) for v in vals]
    s = K.Scan(doc)
    s.run(threads=1)
    assert s.error is None
    assert np.frombuffer(s.result["ts"], dtype=np.int64).tolist() == want
    pure = _pure(monkeypatch, "times.json", data=doc).events  # rows reordered by thread and time: by name
    got = dict(zip(pure["name"].to_pylist(), pure["ts"].to_pylist()))
    assert [got[f"a{i}"] for i in range(len(vals))] == want

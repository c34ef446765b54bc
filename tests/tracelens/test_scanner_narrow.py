"""The compiled scanner writes int args in the narrowest width that holds them (issue 20, bounded memory).

A column starts at int8 and is widened in place when a value does not fit, so the scan never holds 8
bytes per absent arg. Checked here on synthetic traces whose values force every widening mid-file
(1 -> 2 -> 4 -> 8 bytes), a value of another JSON type converted after the scan ("bytes": "5000000000"),
and an event dropped at load that held a column's only wide value: the scanner's widths and values, the
per-file table against the msgspec decoder's, and the loaded events table against the raw JSON (the
narrowest type of the values kept, computed here from the JSON with numpy's integer limits). Also the
load's other large step, `check_events`' outlier bounds (now computed with less memory), against the
documented rule applied to the raw events.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

import tracelens
from tracelens.io import kineto
from tracelens.io.scanner import Scan, fast_enabled
from tracelens.io.schema import ARG_FIELDS

from ._narrow import narrowest

pytestmark = pytest.mark.skipif(not fast_enabled(), reason="compiled scanner not built")

INT_ARGS = [c for c, (_, kind) in ARG_FIELDS.items() if kind == "int"]
KEY = {c: key for c, (key, _) in ARG_FIELDS.items()}


def _kernel(i: int, args: dict, dur: int = 5) -> dict:
    return {"ph": "X", "cat": "kernel", "name": f"k{i % 3}", "pid": 0, "tid": 7, "ts": 1000 + 10 * i, "dur": dur,
            "args": {"device": 0, "stream": 7, **args}}


def _events() -> list[dict]:
    """300 kernels whose correlation grows past int8, int16 and int32 at rows 100, 150 and 200; bytes
    absent but for row 250, a numeric string; External id wide only on row 120, whose dur is negative."""
    evs = []
    for i in range(300):
        corr = i if i < 100 else 300 + i if i < 150 else 70_000 + i if i < 200 else 2**40 + i
        args = {"correlation": corr}
        if i == 250:
            args["bytes"] = "5000000000"  # another JSON type: converted by the caller after the scan
        if i == 120:
            args["External id"] = 2**35
        evs.append(_kernel(i, args, dur=-3 if i == 120 else 5))
    evs.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 0, "tid": 1, "ts": 990,
                "dur": 4, "args": {"correlation": 5, "External id": 9}})
    return evs


def _write(tmp_path, events: list[dict]) -> str:
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def _raw_int(e: dict, col: str) -> int:
    v = (e.get("args") or {}).get(KEY[col])
    return -1 if v is None else int(v)  # the numeric string converts exactly


def test_scanner_columns_are_narrow_and_hold_the_raw_values(tmp_path):
    events = _events()
    path = _write(tmp_path, events)
    scan = Scan(open(path, "rb").read())
    scan.run()
    r = scan.result
    assert r is not None, scan.error
    cols = list(ARG_FIELDS)
    for col in INT_ARGS:
        a = cols.index(col)
        width = r["arg_widths"][a]
        values = np.frombuffer(r["args"][a], dtype=np.dtype(f"int{8 * width}"))
        # the scanner leaves an arg of another JSON type at -1 (a fix-up); every other value as written
        raw = [-1 if isinstance((e["args"]).get(KEY[col]), str) else _raw_int(e, col) for e in events]
        assert values.tolist() == raw, col
        assert np.dtype(f"int{8 * width}") == narrowest(raw), col
    assert r["arg_widths"][cols.index("correlation")] == 8  # widened three times during the scan
    assert r["arg_widths"][cols.index("stream")] == 1 and r["arg_widths"][cols.index("seq")] == 1


def test_both_decoders_give_the_same_narrow_table(tmp_path, monkeypatch):
    path = _write(tmp_path, _events())
    fast = kineto.parse_file(path)
    assert fast.meta["decoder"] == "compiled"
    monkeypatch.setenv("TRACELENS_PURE_PYTHON", "1")
    slow = kineto.parse_file(path)
    assert slow.meta["decoder"] == "msgspec"
    assert fast.events.schema == slow.events.schema
    for c in fast.events.column_names:
        a, b = fast.events[c], slow.events[c]
        if pa.types.is_floating(a.type):  # NaN (absent) equals NaN here
            assert np.array_equal(a.to_numpy(), b.to_numpy(), equal_nan=True), c
        else:
            assert a.equals(b), c
    # per file, before the drop: bytes needs int64 for its converted string, External id for row 120
    assert fast.events.schema.field("bytes").type == pa.int64()
    assert fast.events.schema.field("correlation").type == pa.int64()


def test_loaded_events_are_the_narrowest_over_the_kept_events(tmp_path):
    events = _events()
    ev = tracelens.load(_write(tmp_path, events), cache=False).events
    kept = [e for e in events if e["dur"] >= 0]  # the negative-dur event is dropped at load
    assert len(ev) == len(kept) == len(events) - 1
    order = np.argsort(ev["ts"].to_numpy(), kind="stable")
    kept.sort(key=lambda e: e["ts"])
    for col in INT_ARGS:
        raw = [_raw_int(e, col) for e in kept]
        assert ev[col].dtype == narrowest(raw), col
        assert ev[col].to_numpy()[order].tolist() == raw, col
    # External id's only wide value left with the dropped event: narrowed again after the drop
    assert ev["external_id"].dtype == np.int8
    assert ev["bytes"].dtype == np.int64 and ev["correlation"].dtype == np.int64


def test_a_scanner_built_from_an_older_source_is_not_used(tmp_path):
    """An extension of another result layout (an older _kineto_fast.c, e.g. a checkout not rebuilt after a
    pull) would be misread: the loader takes the msgspec path instead and says why."""
    path = _write(tmp_path, _events())
    code = (
        "import sys, types\n"
        "old = types.ModuleType('tracelens.io._kineto_fast'); old.Parser = object\n"  # layout 1 had no LAYOUT
        "sys.modules['tracelens.io._kineto_fast'] = old\n"
        "from tracelens.io import kineto, scanner\n"
        "print(scanner.fast_enabled()); print(scanner.decoder())\n"
        f"print(kineto.parse_file({path!r}).meta['decoder'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "False"
    assert "out of date" in out[1] and "layout 1" in out[1]
    assert out[2] == "msgspec"


def test_time_outlier_bounds_with_an_event_already_dropped(tmp_path):
    """With a negative-dur event already dropped, the outlier rule judges the other events only: the body
    is the span of their work on the near side of the clock's jump (docs/robustness.md), computed here
    from the raw events."""
    events = _events()
    far = dict(_kernel(400, {"correlation": 1}), ts=4000 + 10**7)  # 10 s after the trace's body
    events.append(far)
    trace = tracelens.load(_write(tmp_path, events), cache=False)
    issues = trace.load_issues
    assert list(issues["check"]) == ["negative_dur", "time_outlier"]
    assert list(issues["events"]) == [1, 1]
    body = [e for e in events if e["dur"] >= 0 and e is not far]
    lo = min(e["ts"] for e in body) * 1000
    hi = max(e["ts"] + e["dur"] for e in body) * 1000
    away_ns = (far["ts"] + far["dur"]) * 1000 - hi
    msg = issues["message"].iloc[1]
    assert f"{away_ns / 1e9:,.1f} s after the body of the trace, which spans {(hi - lo) / 1e3:,.3f} us" in msg, msg
    assert len(trace.events) == len(events) - 2
    assert trace.events["ts"].max() == max(e["ts"] for e in body) * 1000

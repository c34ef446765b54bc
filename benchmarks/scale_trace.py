#!/usr/bin/env python3
"""Tile a real Kineto trace in time into a large, realistic one (for benchmarks).

Copy c of every timed event is shifted by c * period (the source's span plus 5 %), and its ids are
offset so every link stays one-to-one: `correlation` and `External id` (runtime <-> kernel, op <->
kernel), flow ids, and Python ids. Profiler-step annotations are renumbered so steps stay distinct.
Metadata events (process/thread names) are written once. Output is streamed, so a multi-GB trace
needs no more memory than the source.

    python benchmarks/scale_trace.py SRC.json.gz OUT.json --target-mb 200
    python benchmarks/scale_trace.py SRC.json.gz OUT.json.gz --copies 10
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import sys

import msgspec

_STEP = re.compile(r"^(ProfilerStep#|##\s*step\s*#?)(\d+)")
_ID_ARGS = ("correlation", "External id", "Python id", "Python parent id")


def _load(path: str) -> dict:
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return msgspec.json.decode(data)


def _max_id(events: list[dict]) -> int:
    best = 0
    for e in events:
        a = e.get("args")
        if isinstance(a, dict):
            for k in _ID_ARGS:
                v = a.get(k)
                if isinstance(v, int) and v > best:
                    best = v
        v = e.get("id")
        if isinstance(v, int) and v > best:
            best = v
    return best


def shifted_copy(e: dict, c: int, period: float, id_step: int, step_span: int) -> dict:
    """Copy number ``c`` of event ``e``: ``c`` periods later, its ids (correlation, External id, Python ids,
    flow id) moved past every id of the other copies, its step number ``c * step_span`` on."""
    e2 = dict(e)
    e2["ts"] = round(float(e["ts"]) + c * period, 3)
    if not c:
        return e2
    a = e.get("args")
    if isinstance(a, dict):
        a2 = dict(a)
        for k in _ID_ARGS:
            v = a2.get(k)
            if isinstance(v, int) and v >= 0:
                a2[k] = v + c * id_step
        e2["args"] = a2
    if isinstance(e.get("id"), int):
        e2["id"] = e["id"] + c * id_step
    if step_span and (m := _STEP.match(str(e.get("name", "")))):
        e2["name"] = f"{m.group(1)}{int(m.group(2)) + c * step_span}" + str(e["name"])[m.end():]
    return e2


def scale(src: str, out: str, copies: int | None = None, target_mb: float | None = None) -> tuple[int, int]:
    """Write the tiled trace; returns (copies, events written)."""
    doc = _load(src)
    events = doc.pop("traceEvents")
    timed = [e for e in events if e.get("ph") != "M" and "ts" in e]
    meta = [e for e in events if not (e.get("ph") != "M" and "ts" in e)]
    t0 = min(float(e["ts"]) for e in timed)
    t1 = max(float(e["ts"]) + float(e.get("dur", 0) or 0) for e in timed)
    period = round((t1 - t0) * 1.05 + 10.0, 3)
    id_step = _max_id(timed) + 1
    steps = {int(m.group(2)) for e in timed if (m := _STEP.match(str(e.get("name", ""))))}
    step_span = (max(steps) - min(steps) + 1) if steps else 0
    enc = msgspec.json.Encoder()
    if copies is None:
        one = sum(len(enc.encode(e)) + 1 for e in timed)
        copies = max(1, int((target_mb or 0) * 1e6 / one))
    opener = gzip.open if out.endswith(".gz") else open
    n = 0
    with opener(out, "wb") as f:
        head = enc.encode(doc)[:-1]  # the top-level object without its closing brace
        f.write(head + (b',"traceEvents":[' if len(head) > 1 else b'"traceEvents":['))
        first = True
        for e in meta:
            f.write((b"" if first else b",") + enc.encode(e))
            first = False
            n += 1
        for c in range(copies):
            buf = [enc.encode(shifted_copy(e, c, period, id_step, step_span)) for e in timed]
            f.write((b"" if first else b",") + b",".join(buf))
            first = False
            n += len(buf)
        f.write(b"]}")
    return copies, n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--copies", type=int)
    g.add_argument("--target-mb", type=float, help="approximate uncompressed size of OUT in MB")
    a = ap.parse_args(argv)
    copies, n = scale(a.src, a.out, a.copies, a.target_mb)
    print(f"{a.out}: {copies} copies, {n} events, {os.path.getsize(a.out) / 1e6:.1f} MB on disk", file=sys.stderr)


if __name__ == "__main__":
    main()

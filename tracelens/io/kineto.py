"""Parse one Kineto / Chrome-trace JSON file into columnar tables.

The hot path of the whole toolkit. Measured choices (see docs/performance.md):
- `msgspec` decodes the top level with `traceEvents` as a list of `Raw` slices (no objects built), then
  decodes events in batches into typed `Struct`s whose `args` stay `Raw`; only the few events whose
  category carries interesting args get those decoded, again in typed batches. Peak memory stays near
  the size of the file's bytes instead of several times it, and no per-event dict is ever built.
- Strings are dictionary-encoded by pyarrow (names repeat millions of times; a dictionary keeps one).
- Timestamps become exact integer nanoseconds: Kineto writes microseconds with three decimals; the
  integer and fractional parts are converted separately so no float rounding leaks into the ns value
  (exact while |ts| < 2**43 us, i.e. ~100 days of clock, which covers Kineto's monotonic clock and
  every epoch-based trace that writes whole microseconds).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import tempfile
import zlib
from operator import attrgetter
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import TraceError

BATCH = 65536

# ---------------------------------------------------------------------------------------------
# Typed schema. Unknown keys are skipped by msgspec without building objects.


_NORAW = msgspec.Raw(b"")  # "absent" for Raw fields (msgspec does not allow Raw in unions)


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: float | None = None
    dur: float = 0.0
    id: int | str | None = None
    bp: str | None = None
    args: msgspec.Raw = msgspec.Raw(b"{}")  # absent args decode to all defaults


def _f(name: str, default: Any = None) -> Any:
    return msgspec.field(default=default, name=name)


# Every arg the analyzer reads: column name -> (key in the trace, kind). Kinds: "int" (int64, -1 when
# absent), "str" (dictionary string), "raw" (compact JSON text of a list/object, dictionary string),
# "float" (float64, NaN when absent).
ARG_FIELDS: dict[str, tuple[str, str]] = {
    "correlation": ("correlation", "int"),
    "external_id": ("External id", "int"),
    "device": ("device", "int"),
    "stream": ("stream", "int"),
    "bytes": ("bytes", "int"),
    "grid": ("grid", "raw"),
    "block": ("block", "raw"),
    "collective": ("Collective name", "str"),
    "in_nelems": ("In msg nelems", "int"),
    "out_nelems": ("Out msg nelems", "int"),
    "group_size": ("Group size", "int"),
    "dtype": ("dtype", "str"),
    "pg_name": ("Process Group Name", "str"),
    "pg_desc": ("Process Group Description", "str"),
    "pg_ranks": ("Process Group Ranks", "raw"),
    "in_split": ("In split size", "raw"),
    "out_split": ("Out split size", "raw"),
    "seq": ("Sequence number", "int"),
    "fwd_tid": ("Fwd thread id", "int"),
    "rf_id": ("Record function id", "int"),
    "input_dims": ("Input Dims", "raw"),
    "input_types": ("Input type", "raw"),
    "input_strides": ("Input Strides", "raw"),
    "concrete_inputs": ("Concrete Inputs", "raw"),
    "flops": ("flops", "float"),
    "module": ("Module Hierarchy", "str"),
    "call_stack": ("Call stack", "str"),
    "python_id": ("Python id", "int"),
    "python_parent_id": ("Python parent id", "int"),
}
_COLLECTIVE = ("collective", "in_nelems", "out_nelems", "group_size", "dtype", "pg_name", "pg_desc",
               "pg_ranks", "in_split", "out_split")
# Which args each category carries; only those are decoded (a runtime call never has shapes).
_GROUPS: dict[str, tuple[str, ...]] = {
    "gpu": ("correlation", "external_id", "device", "stream", "bytes", "grid", "block") + _COLLECTIVE,
    "runtime": ("correlation", "external_id", "device", "stream"),
    "op": ("external_id", "seq", "fwd_tid", "rf_id", "input_dims", "input_types", "input_strides",
           "concrete_inputs", "flops", "module", "call_stack") + _COLLECTIVE,
    "python": ("python_id", "python_parent_id"),
}
CAT_GROUP: dict[str, str] = {
    "kernel": "gpu", "gpu_memcpy": "gpu", "gpu_memset": "gpu", "gpu_user_annotation": "gpu",
    "Kernel": "gpu", "Memcpy": "gpu", "Memset": "gpu",
    "cuda_runtime": "runtime", "cuda_driver": "runtime", "cuda_sync": "runtime", "Runtime": "runtime",
    "cpu_op": "op", "user_annotation": "op", "Operator": "op", "cuda_profiler_range": "op",
    "python_function": "python", "Python": "python",
}
_GROUP_CODE = {c: list(_GROUPS).index(g) for c, g in CAT_GROUP.items()}
_TIMED_PH = frozenset({"X", "i", "I"})
_FLOW_PH = frozenset({"s", "f", "t"})
_STRICT_TYPES = {"int": (int | str | None, -1), "str": (str | None, None), "raw": (msgspec.Raw, _NORAW),
                 "float": (float | None, None)}


def _group_struct(group: str, lenient: bool) -> type:
    fields = []
    for col in _GROUPS[group]:
        key, kind = ARG_FIELDS[col]
        typ, default = _STRICT_TYPES[kind]
        if lenient and kind != "raw":
            typ = Any
        fields.append((col, typ, msgspec.field(default=default, name=key)))
    return msgspec.defstruct(f"_{group}_args{'_lenient' if lenient else ''}", fields, gc=False)


_ARG_DECODERS = {
    g: (msgspec.json.Decoder(list[_group_struct(g, False)]), msgspec.json.Decoder(list[_group_struct(g, True)]))
    for g in _GROUPS
}


class _MetaArgs(msgspec.Struct):
    name: Any = None
    labels: Any = None
    sort_index: Any = None


class _Doc(msgspec.Struct):
    traceEvents: list[msgspec.Raw] | None = None
    deviceProperties: list[dict[str, Any]] | None = None
    distributedInfo: dict[str, Any] | None = None
    baseTimeNanoseconds: int | None = None
    schemaVersion: Any = None
    traceName: Any = None


_DOC = msgspec.json.Decoder(_Doc)
_LIST_RAW = msgspec.json.Decoder(list[msgspec.Raw])
_EVENTS = msgspec.json.Decoder(list[_Event])
_METAARGS = msgspec.json.Decoder(_MetaArgs)

# args some writers emit as a JSON string holding the value ("[0, 1]"): unwrap the string
UNQUOTE_COLS = frozenset({"pg_ranks", "in_split", "out_split"})
SCHEMA_VERSION = 1


@dataclass
class ParsedTrace:
    """Everything read from one file: columnar tables plus the file's metadata."""

    path: str
    events: pa.Table  # ph X/i events
    flows: pa.Table  # ph s/t/f events
    threads: pa.Table  # process/thread names from ph M events
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------


def read_bytes(path: str) -> bytes:
    """The file's JSON bytes, gunzipped when it is gzip (by magic, not by name)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TraceError(path, f"cannot read: {e.strerror or e}") from None
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(path, f"corrupt or truncated gzip ({e})") from None
    return data


def _json_problem(path: str, data: bytes, err: Exception) -> TraceError:
    msg = str(err)
    stripped = data.lstrip()
    if not stripped:
        return TraceError(path, "empty file, not a trace")
    if stripped[:1] not in (b"{", b"["):
        return TraceError(path, "not a JSON trace (does not start with '{' or '[')")
    if "truncated" in msg.lower() or "end of" in msg.lower():
        return TraceError(path, f"truncated JSON ({msg}); the trace was probably cut off while being written")
    return TraceError(path, f"invalid JSON ({msg})")


def _ns(values: list) -> np.ndarray:
    """Microsecond timestamps/durations (floats with <=3 decimals) -> exact int64 nanoseconds."""
    us = np.asarray(values, dtype=np.float64)
    whole = np.floor(us)
    frac_ns = np.rint((us - whole) * 1000.0)
    return whole.astype(np.int64) * 1000 + frac_ns.astype(np.int64)


def _int_or(v: Any, default: int = -1) -> int:
    if v is None:
        return default
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return int(v) if v == v else default
    try:
        s = str(v).strip()
        if s.lower().startswith("stream "):
            s = s[7:]
        return int(float(s))
    except (TypeError, ValueError):
        return default


def _raw_text(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, msgspec.Raw):
        b = bytes(v)
        if not b or b == b"null":
            return None
        # Collapse a JSON string to its text ("[0, 1]" -> [0, 1]); keep arrays as compact JSON.
        if b[:1] == b'"':
            return msgspec.json.decode(b)
        return b.decode("utf-8", "replace")
    return str(v)


def _dict_array(values: list) -> pa.Array:
    return pa.array(values, type=pa.string()).dictionary_encode()


def _int_array(values: list, default: int = -1) -> pa.Array:
    try:
        return pa.array(np.asarray(values, dtype=np.int64))
    except (TypeError, ValueError, OverflowError):
        return pa.array(np.asarray([_int_or(v, default) for v in values], dtype=np.int64))


def _pid_tid(values: list, names: dict[str, int]) -> np.ndarray:
    """pid/tid columns: ints stay; strings (e.g. "Spans", "stream 7") map to an int code."""
    try:
        return np.asarray(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        pass
    fixed = list(values)
    for i in [i for i, v in enumerate(values) if v.__class__ is not int]:
        s = str(values[i])
        m = re.fullmatch(r"(?:stream\s*)?(-?\d+)", s.strip())
        if m:
            fixed[i] = int(m.group(1))
        else:  # a negative code far from real ids, the same in every process (crc32 of the name);
            # names are kept in the threads table
            fixed[i] = names.setdefault(s, -(1 << 40) - zlib.crc32(s.encode()))
    return np.asarray(fixed, dtype=np.int64)


def _decode_args(path: str, group: str, raws: list) -> list:
    buf = b"[" + b",".join(raws) + b"]"
    strict, lenient = _ARG_DECODERS[group]
    try:
        return strict.decode(buf)
    except msgspec.ValidationError:
        return lenient.decode(buf)
    except msgspec.DecodeError as e:  # pragma: no cover - raw slices came from a valid document
        raise TraceError(path, f"invalid event args ({e})") from None


def _str_values(values: list) -> pa.Array:
    try:
        return pa.array(values, type=pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else str(v) for v in values], type=pa.string())


def _raw_values(values: list, unquote: bool) -> pa.Array:
    """Text of Raw JSON values; absent (empty) values become null."""
    arr = pa.array(list(map(bytes, values)), type=pa.binary())
    arr = pc.if_else(pc.equal(pc.binary_length(arr), 0), pa.scalar(None, pa.binary()), arr)
    if unquote and arr.null_count < len(arr):
        return pa.array([_raw_text(msgspec.Raw(v)) if v else None for v in arr.to_pylist()], type=pa.string())
    return arr.cast(pa.string())


def _int_values(values: list) -> np.ndarray:
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return np.asarray([_int_or(v, -1) for v in values], dtype=np.int64)


def _float_values(values: list) -> np.ndarray:
    try:
        return np.array(values, dtype=np.float64)  # None -> nan
    except (TypeError, ValueError):
        return np.asarray([_float_or_nan(v) for v in values], dtype=np.float64)


def _scatter(sub: pa.Array, idx: np.ndarray, n: int) -> pa.Array:
    """Full-length array with `sub` at positions `idx` and nulls elsewhere."""
    pos = np.full(n, -1, dtype=np.int64)
    pos[idx] = np.arange(len(idx), dtype=np.int64)
    return pc.take(sub, pa.array(pos, mask=pos < 0))


def _batch_events(path: str, timed: list, str_ids: dict[str, int]) -> pa.RecordBatch:
    """Columns for the timed events of one batch; args decoded per category group."""
    n = len(timed)
    ts = [e.ts for e in timed]
    try:
        ts_ns = _ns(ts)
    except TypeError:
        bad = sum(t is None for t in ts)
        raise TraceError(path, f"{bad} complete events have no 'ts' timestamp") from None
    cats = [e.cat for e in timed]
    cols: dict[str, pa.Array] = {
        "ph": _dict_array([e.ph for e in timed]),
        "cat": _dict_array(cats),
        "name": _dict_array([e.name for e in timed]),
        "pid": pa.array(_pid_tid([e.pid for e in timed], str_ids)),
        "tid": pa.array(_pid_tid([e.tid for e in timed], str_ids)),
        "ts": pa.array(ts_ns),
        "dur": pa.array(_ns([e.dur for e in timed])),
    }
    ints = {c: np.full(n, -1, dtype=np.int64) for c, (_, k) in ARG_FIELDS.items() if k == "int"}
    floats = {c: np.full(n, np.nan) for c, (_, k) in ARG_FIELDS.items() if k == "float"}
    texts: dict[str, list[tuple[np.ndarray, pa.Array]]] = {
        c: [] for c, (_, k) in ARG_FIELDS.items() if k in ("str", "raw")
    }
    cat_dict = cols["cat"]
    group_of_code = np.array([_GROUP_CODE.get(c, -1) for c in cat_dict.dictionary.to_pylist()] + [-1])
    codes = cat_dict.indices.to_numpy(zero_copy_only=False)
    event_group = group_of_code[codes]
    for gi, g in enumerate(_GROUPS):
        idx = np.flatnonzero(event_group == gi)
        if not len(idx):
            continue
        args = _decode_args(path, g, [timed[j].args for j in idx.tolist()])
        for c in _GROUPS[g]:
            kind = ARG_FIELDS[c][1]
            vals = list(map(attrgetter(c), args))
            if kind == "int":
                ints[c][idx] = _int_values(vals)
            elif kind == "float":
                floats[c][idx] = _float_values(vals)
            elif kind == "str":
                texts[c].append((idx, _str_values(vals)))
            else:
                texts[c].append((idx, _raw_values(vals, c in UNQUOTE_COLS)))
        del args
    for c, (_, kind) in ARG_FIELDS.items():
        if kind == "int":
            cols[c] = pa.array(ints[c])
        elif kind == "float":
            cols[c] = pa.array(floats[c])
        else:
            parts = texts[c]
            if not parts:
                cols[c] = pa.nulls(n, pa.string()).dictionary_encode()
            elif len(parts) == 1:
                cols[c] = _scatter(parts[0][1], parts[0][0], n).dictionary_encode()
            else:
                idx = np.concatenate([p[0] for p in parts])
                sub = pa.concat_arrays([p[1] for p in parts])
                cols[c] = _scatter(sub, idx, n).dictionary_encode()
    return pa.record_batch(cols)


def _batch_flows(flows: list, str_ids: dict[str, int]) -> pa.RecordBatch:
    return pa.record_batch(
        {
            "ph": _dict_array([e.ph for e in flows]),
            "cat": _dict_array([e.cat for e in flows]),
            "id": pa.array(_int_values([e.id for e in flows])),
            "pid": pa.array(_pid_tid([e.pid for e in flows], str_ids)),
            "tid": pa.array(_pid_tid([e.tid for e in flows], str_ids)),
            "ts": pa.array(_ns([0.0 if e.ts is None else e.ts for e in flows])),
            "bp": pa.array([e.bp for e in flows], type=pa.string()),
        }
    )


def _concat(batches: list[pa.RecordBatch], schema_from: pa.RecordBatch) -> pa.Table:
    if not batches:
        return schema_from.schema.empty_table()
    # chunks stay as they are (no copy); dictionaries are unified so every chunk shares one
    return pa.Table.from_batches(batches).unify_dictionaries()


def _parse_range(path: str, raws: list, lo: int, hi: int, progress=None, scale: float = 1.0
                 ) -> tuple[pa.Table | None, pa.Table, list[tuple]]:
    """Events raws[lo:hi] -> (timed events table or None, flows table, thread-metadata rows).

    progress(fraction) is called after each batch with the share of the whole file done (this range's
    share times `scale`, which parallel parsing uses to stand for all workers).
    """
    str_ids: dict[str, int] = {}
    ev_batches: list[pa.RecordBatch] = []
    flow_batches: list[pa.RecordBatch] = []
    meta_events: list = []
    for b_lo in range(lo, hi, BATCH):
        try:
            evs = _EVENTS.decode(b"[" + b",".join(raws[b_lo : min(b_lo + BATCH, hi)]) + b"]")
        except msgspec.ValidationError as e:
            raise TraceError(path, f"malformed event ({e})") from None
        timed = [e for e in evs if e.ph in _TIMED_PH]
        if len(timed) < len(evs):
            flows = [e for e in evs if e.ph in _FLOW_PH]
            meta_events.extend(e for e in evs if e.ph == "M")
        else:
            flows = []
        del evs
        if timed:
            ev_batches.append(_batch_events(path, timed, str_ids))
        if flows:
            flow_batches.append(_batch_flows(flows, str_ids))
        del timed, flows
        if progress is not None:
            progress(min(1.0, (min(b_lo + BATCH, hi) - lo) / max(1, len(raws)) * scale))
    events = _concat(ev_batches, ev_batches[0]) if ev_batches else None
    del ev_batches
    flows_t = _concat(flow_batches, _batch_flows([], {}))
    rows = []  # process/thread names, sort order, labels (ph M)
    for e in meta_events:
        try:
            ma = _METAARGS.decode(e.args)
        except (msgspec.DecodeError, msgspec.ValidationError):
            ma = _MetaArgs()
        pid_, tid_ = _pid_tid([e.pid, e.tid], str_ids)
        rows.append((e.name, int(pid_), int(tid_), ma.name, ma.labels, ma.sort_index))
    for sname, code in str_ids.items():  # string pids/tids ("Spans", "Traces") keep their names
        rows.append(("string_id", code, code, sname, None, 0))
    return events, flows_t, rows


# Parallel parsing of one large file: the parent forks workers that share the decoded buffer
# (copy-on-write), each parses a contiguous range of events and hands back Arrow IPC through a file
# in /dev/shm (memory-mapped by the parent, so nothing is copied twice).
PARALLEL_MIN_EVENTS = 300_000


def usable_cpus() -> int:
    """CPUs this process may run on: the affinity mask (taskset, cgroup cpusets), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _parallel_workers(n_events: int) -> int:
    if n_events < PARALLEL_MIN_EVENTS or not hasattr(os, "fork") or os.environ.get("TRACELENS_NO_FORK"):
        return 1
    return max(1, min(usable_cpus(), 8, n_events // (PARALLEL_MIN_EVENTS // 2)))


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _parse_parallel(path: str, raws: list, workers: int, progress=None) -> tuple[pa.Table | None, pa.Table, list[tuple]]:
    n = len(raws)
    per = -(-n // workers)
    per = -(-per // BATCH) * BATCH  # whole batches per worker
    ranges = [(lo, min(lo + per, n)) for lo in range(0, n, per)]
    tmpdir = tempfile.mkdtemp(prefix="tracelens-", dir=_shm_dir())
    children: list[tuple[int, str]] = []
    try:
        for k, (lo, hi) in enumerate(ranges[1:], start=1):
            out = os.path.join(tmpdir, f"part{k}")
            pid = os.fork()
            if pid == 0:  # child: parse, write, leave without running the parent's cleanup
                code = 0
                try:
                    _write_part(out, *_parse_range(path, raws, lo, hi))
                except TraceError as e:
                    with open(out + ".err", "w") as f:
                        f.write(e.problem)
                except BaseException as e:  # noqa: BLE001 - report anything to the parent
                    with open(out + ".err", "w") as f:
                        f.write(f"internal error in parser worker: {type(e).__name__}: {e}")
                finally:
                    os._exit(code)
            children.append((pid, out))
        first = _parse_range(path, raws, *ranges[0], progress=progress, scale=len(ranges))
        parts = [first]
        for pid, out in children:
            _, status = os.waitpid(pid, 0)
            if os.path.exists(out + ".err"):
                with open(out + ".err") as f:
                    raise TraceError(path, f.read())
            if status != 0 or not os.path.exists(out + ".events"):
                raise TraceError(path, f"parser worker died (status {status}); set TRACELENS_NO_FORK=1 to parse in one process")
            parts.append(_read_part(out))
        children = []
    finally:
        for pid, _ in children:  # only on error: do not leave workers behind
            try:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            except OSError:
                pass
        shutil.rmtree(tmpdir, ignore_errors=True)  # mapped files stay readable until unmapped
    evs = [p[0] for p in parts if p[0] is not None]
    events = pa.concat_tables(evs, promote_options="permissive").unify_dictionaries() if evs else None
    flows = pa.concat_tables([p[1] for p in parts], promote_options="permissive").unify_dictionaries()
    rows = [r for p in parts for r in p[2]]
    return events, flows, rows


def _write_part(out: str, events: pa.Table | None, flows: pa.Table, rows: list[tuple]) -> None:
    for name, table in (("events", events), ("flows", flows)):
        if table is None:
            continue
        with pa.OSFile(f"{out}.{name}.tmp", "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
        os.rename(f"{out}.{name}.tmp", f"{out}.{name}")
    with open(out + ".rows", "w") as f:
        json.dump(rows, f, default=str)


def _read_part(out: str) -> tuple[pa.Table | None, pa.Table, list[tuple]]:
    def read(name: str) -> pa.Table | None:
        p = f"{out}.{name}"
        if not os.path.exists(p):
            return None
        return pa.ipc.open_file(pa.memory_map(p)).read_all()

    with open(out + ".rows") as f:
        rows = [tuple(r) for r in json.load(f)]
    return read("events"), read("flows"), rows


def parse_file(path: str | os.PathLike, data: bytes | None = None, parallel: int | None = None,
               progress=None) -> ParsedTrace:
    """Parse one trace file. Raises TraceError naming the file for every kind of bad input.

    parallel: worker processes for one large file (default: automatic, one per CPU above
    PARALLEL_MIN_EVENTS events; 1 disables). progress: optional callback(fraction of the file done).
    """
    path = os.fspath(path)
    if data is None:
        data = read_bytes(path)
    try:
        if data.lstrip()[:1] == b"[":  # the Chrome format also allows a bare array of events
            doc = _Doc(traceEvents=_LIST_RAW.decode(data))
        else:
            doc = _DOC.decode(data)
    except msgspec.ValidationError as e:
        raise TraceError(path, f"not a Chrome/Kineto trace ({e})") from None
    except msgspec.DecodeError as e:
        raise _json_problem(path, data, e) from None
    if doc.traceEvents is None:
        raise TraceError(path, "not a Chrome/Kineto trace: no 'traceEvents' list")
    raws = doc.traceEvents
    doc.traceEvents = None
    del data  # the Raw slices keep the buffer alive until `raws` goes
    if not raws:
        raise TraceError(path, "empty trace: 'traceEvents' has no events")
    n_total = len(raws)

    workers = _parallel_workers(n_total) if parallel is None else max(1, int(parallel))
    if workers > 1:
        events, flows_t, rows = _parse_parallel(path, raws, workers, progress)
    else:
        events, flows_t, rows = _parse_range(path, raws, 0, n_total, progress)
    del raws
    if events is None:
        raise TraceError(path, "no timed events (ph 'X') in 'traceEvents'")
    threads = pa.table(
        {
            "kind": pa.array([r[0] for r in rows], type=pa.string()),
            "pid": pa.array([r[1] for r in rows], type=pa.int64()),
            "tid": pa.array([r[2] for r in rows], type=pa.int64()),
            "value": pa.array([None if r[3] is None else str(r[3]) for r in rows], type=pa.string()),
            "labels": pa.array([None if r[4] is None else str(r[4]) for r in rows], type=pa.string()),
            "sort_index": pa.array([_int_or(r[5], 0) for r in rows], type=pa.int64()),
        }
    ).group_by(["kind", "pid", "tid", "value", "labels", "sort_index"]).aggregate([])  # one row per fact

    meta = {
        "path": path,
        "device_properties": doc.deviceProperties or [],
        "distributed_info": doc.distributedInfo or {},
        "base_time_ns": doc.baseTimeNanoseconds,
        "schema_version": doc.schemaVersion if isinstance(doc.schemaVersion, (int, str)) else None,
        "trace_name": doc.traceName if isinstance(doc.traceName, str) else None,
        "n_raw_events": n_total,
    }
    return ParsedTrace(path=path, events=events, flows=flows_t, threads=threads, meta=meta)


def _float_or_nan(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def meta_to_json(meta: dict) -> str:
    return json.dumps(meta, default=str)

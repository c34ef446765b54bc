"""Parse one Kineto / Chrome-trace JSON file into columnar tables.

The hot path of the whole toolkit. Measured choices (see docs/performance.md):
- `msgspec` decodes the top level with `traceEvents` as a list of `Raw` slices (no objects built), then
  decodes events in batches of 32K into typed `Struct`s, args included (every arg the analyzer reads,
  typed; list/object args kept as their raw JSON text). A batch whose arg types surprise the strict
  decoder is decoded leniently, and one whose args are not objects keeps them `Raw` and decodes them
  per category group. No per-event dict is ever built, and batch objects die with their batch.
- Columns accumulate as numpy arrays per parsed range (`_RangeParser`); strings become int32 codes
  against one dictionary per column (`_Dict`: pyarrow hashes each batch, values keep the order of first
  appearance), so the final Arrow table has one chunk per column and nothing to unify. Arrow tables are
  built after the raw buffer is released, so the two never coexist.
- Flow events (ph s/t/f) are decoded but only turned into columns when asked for (`flows=True`,
  `parse_flows`): no analysis reads them.
- A large file is split over forked workers (`usable_cpus()` of them, from the affinity mask).
- A compiled scanner (`_kineto_fast.c`, built at install time where a C compiler exists) does all of
  the above for timed events in one pass without per-event Python objects, ~3x faster; a file it does
  not reproduce exactly (an arg of an unexpected JSON type, escaped keys, invalid JSON, ...) is parsed
  by the msgspec path, which is the reference and gives every error message. `DECODER` says which one
  is in use; TRACELENS_PURE_PYTHON=1 forces the msgspec path.
- Timestamps become exact integer nanoseconds (`timestamps.py`: the text's decimal value times 1000,
  rounded half to even, at any magnitude up to 2**53 us): `ts` and `dur` are decoded as raw JSON
  slices and converted from their digits, never through a double.
"""

from __future__ import annotations

import gzip
import json
import mmap
import os
import re
import shutil
import tempfile
import zlib
from itertools import compress
from operator import attrgetter
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from ..errors import TraceError

from .checks import check_events, cut_long_names, cut_name
from .narrow import narrow_args
from .roworder import tree_rows_first
from .scanner import FAST_FEED, Mapped, Scan, _kineto_fast, decoder, fast_enabled, map_file, read_bytes, usable_cpus  # noqa: F401 - re-exported
from .timestamps import from_texts

BATCH = 32768  # events per decode: smaller batches lower the peak memory, larger ones gain nothing measurable

# ---------------------------------------------------------------------------------------------
# Typed schema. Unknown keys are skipped by msgspec without building objects.


_NORAW = msgspec.Raw(b"")  # "absent" for Raw fields (msgspec does not allow Raw in unions)


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: msgspec.Raw = _NORAW  # JSON text, converted by timestamps.py (a double cannot hold epoch-scale ns)
    dur: msgspec.Raw = _NORAW
    id: int | str | None = None
    bp: str | None = None
    args: msgspec.Raw = msgspec.Raw(b"{}")  # absent args decode to all defaults


def _f(name: str, default: Any = None) -> Any:
    return msgspec.field(default=default, name=name)


from .schema import _COLLECTIVE, _GROUPS, ARG_FIELDS, CAT_GROUP, SCHEMA_VERSION, UNQUOTE_COLS  # noqa: E402,F401
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

# Events with every arg the analyzer reads decoded in the same pass (typed args), plus the three keys
# metadata events (ph M) carry. Decoding args once, inline, costs less than keeping them as Raw slices
# and decoding each category group's args again (measured ~20% of the decode). When a batch's args
# do not all have the expected JSON types, it is decoded again with lenient types, and when even that
# fails (args that are not objects), with `_Event` (Raw args, decoded per group as before).
_META_ARG_FIELDS = (("m_name", "name"), ("m_labels", "labels"), ("m_sort_index", "sort_index"))


def _inline_struct(lenient: bool) -> tuple[type, type]:
    fields = []
    for col, (key, kind) in ARG_FIELDS.items():
        typ, default = _STRICT_TYPES[kind]
        fields.append((col, Any if lenient and kind != "raw" else typ, msgspec.field(default=default, name=key)))
    fields += [(col, Any, msgspec.field(default=None, name=key)) for col, key in _META_ARG_FIELDS]
    args = msgspec.defstruct(f"_AllArgs{'Lenient' if lenient else ''}", fields, gc=False, frozen=True)
    event = msgspec.defstruct(
        f"_TypedEvent{'Lenient' if lenient else ''}",
        [(f, t, d) for f, t, d in (("ph", str, ""), ("cat", str, ""), ("name", str, ""), ("pid", int | str, 0),
                                   ("tid", int | str, 0), ("ts", msgspec.Raw, _NORAW), ("dur", msgspec.Raw, _NORAW),
                                   ("id", int | str | None, None), ("bp", str | None, None))]
        + [("args", args, msgspec.field(default_factory=args))],
        gc=False,
    )
    return args, event


_ALL_ARGS, _TYPED_EVENT = _inline_struct(False)
_ALL_ARGS_LENIENT, _TYPED_EVENT_LENIENT = _inline_struct(True)
_TYPED_EVENTS = msgspec.json.Decoder(list[_TYPED_EVENT])
_TYPED_EVENTS_LENIENT = msgspec.json.Decoder(list[_TYPED_EVENT_LENIENT])


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


@dataclass
class ParsedTrace:
    """Everything read from one file: columnar tables plus the file's metadata."""

    path: str
    events: pa.Table  # ph X/i events
    flows: pa.Table | None  # ph s/t/f events; None when the parse left them out (read later by parse_flows)
    threads: pa.Table  # process/thread names from ph M events
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------


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


_MISSING = np.iinfo(np.int64).min + 1  # a timed event's ts that is not there (or null): no time at all


def _ns(path: str, texts: list, key: str, absent: int) -> np.ndarray:
    """Raw `ts`/`dur` values -> exact int64 ns (`timestamps.py`; past 2**53 us UNREPRESENTABLE, dropped by
    checks.check_events); `absent` where the key is missing or null. A value that is no number is one
    line naming the file."""
    try:
        return from_texts(texts, absent)
    except ValueError as e:
        raise TraceError(path, f"malformed event: '{key}' is {e}") from None


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


def _pid_tid(values: list, names: dict[str, int]) -> np.ndarray:
    """pid/tid columns: ints stay; strings (e.g. "Spans", "stream 7") map to an int code."""
    try:
        return np.asarray(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        pass
    fixed = list(values)
    for i in [i for i, v in enumerate(values) if v.__class__ is not int or not _I64_MIN <= v <= _I64_MAX]:
        s = str(values[i])
        m = re.fullmatch(r"(?:stream\s*)?(-?\d+)", s.strip())
        if m and _I64_MIN <= int(m.group(1)) <= _I64_MAX:
            fixed[i] = int(m.group(1))
        else:  # a negative code far from real ids, the same in every process (crc32 of the name);
            # names (and ids beyond int64, e.g. 2**64-1) are kept in the threads table
            fixed[i] = names.setdefault(s, -(1 << 40) - zlib.crc32(s.encode()))
    return np.asarray(fixed, dtype=np.int64)


_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def _decode_args(path: str, group: str, raws: list) -> tuple[list, bool]:
    """Typed args of one category group; (structs, lenient) where lenient means the values were not
    all of the expected JSON types and were decoded as they are (converted per column afterwards)."""
    buf = _json_array(raws)
    strict, lenient = _ARG_DECODERS[group]
    try:
        return strict.decode(buf), False
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError as e:  # pragma: no cover - raw slices came from a valid document
        raise TraceError(path, f"invalid event args ({e})") from None
    try:
        return lenient.decode(buf), True
    except msgspec.ValidationError:
        pass
    # args that are not objects (a list, a string, a number): no args of ours, as if absent
    raws = [r if bytes(r).lstrip()[:1] == b"{" else b"{}" for r in raws]
    try:
        return lenient.decode(_json_array(raws)), True
    except msgspec.ValidationError as e:
        raise TraceError(path, f"malformed event args ({e})") from None


def _int_values(values: list) -> np.ndarray:
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return np.asarray([_int64_or(_int_or(v, -1)) for v in values], dtype=np.int64)


def _int64_or(v: int, default: int = -1) -> int:
    """An int arg beyond int64 (e.g. a correlation id of 2**64) is no id of ours: `default`, as absent."""
    return v if _I64_MIN <= v <= _I64_MAX else default


def _float_values(values: list) -> np.ndarray:
    try:
        return np.array(values, dtype=np.float64)  # None -> nan
    except (TypeError, ValueError):
        return np.asarray([_float_or_nan(v) for v in values], dtype=np.float64)


class _Dict:
    """Dictionary encoding of one string (or bytes) column across every batch of a parse.

    Values get int32 codes in order of first appearance (the order pyarrow's dictionary_encode and
    unify_dictionaries give); `absent` values get -1 (null). Each batch is dictionary-encoded by
    pyarrow (hashing in C), and only its few distinct values are looked up here, so the codes of all
    batches share one dictionary and nothing needs unifying afterwards.
    """

    __slots__ = ("codes", "values", "type")

    def __init__(self, absent: tuple = (None,), type: pa.DataType = pa.string()):
        self.codes: dict = dict.fromkeys(absent, -1)
        self.values: list = []  # code -> value
        self.type = type

    def encode(self, values: list) -> np.ndarray:
        arr = pa.array(values, type=self.type).dictionary_encode()
        codes = self.codes
        remap = np.empty(len(arr.dictionary) + 1, dtype=np.int32)
        for i, v in enumerate(arr.dictionary.to_pylist()):
            c = codes.get(v)
            if c is None:
                c = codes[v] = len(self.values)
                self.values.append(v)
            remap[i] = c
        remap[-1] = -1  # null
        local = arr.indices
        if local.null_count:
            local = local.fill_null(-1)
        return remap[local.to_numpy()]


def _dict_column(codes: np.ndarray, values: list) -> pa.DictionaryArray:
    """Dictionary<int, string> array from codes (-1 = null; int8/16/32, kept as they come: the compiled
    scanner gives an arg's codes in the narrowest width its dictionary allows) and the code -> string list."""
    mask = codes < 0
    codes = codes if codes.dtype in (np.int8, np.int16, np.int32) else codes.astype(np.int32)
    indices = pa.array(codes, mask=mask if mask.any() else None)
    return pa.DictionaryArray.from_arrays(indices, pa.array(values, type=pa.string()))


def _raw_dictionary(values: list, unquote: bool) -> tuple[list, np.ndarray | None]:
    """Text of the distinct Raw JSON values of a column (bytes) and, when some of them read as null
    (a quoted-JSON column holding `null`), the code remap that makes those codes -1."""
    if not unquote:
        return [b.decode("utf-8", "replace") for b in values], None
    texts = [_raw_text(msgspec.Raw(b)) for b in values]
    if all(t is not None for t in texts):
        return texts, None
    remap = np.full(len(texts) + 1, -1, dtype=np.int32)  # last entry: code -1 stays -1
    kept = []
    for i, t in enumerate(texts):
        if t is not None:
            remap[i] = len(kept)
            kept.append(t)
    return kept, remap


_STR_COLS = tuple(c for c, (_, k) in ARG_FIELDS.items() if k in ("str", "raw"))
# string columns that more than one category group carries (collective args on kernels and ops): their
# codes are given in row order, so dictionaries list values in order of first appearance in the file
_SHARED_STR_COLS = frozenset(c for c in _STR_COLS if sum(c in cols for cols in _GROUPS.values()) > 1)
_PH_TIMED, _PH_FLOW, _PH_META, _PH_OTHER = 0, 1, 2, 3


def _ph_kind(ph: Any) -> int:
    if ph in _TIMED_PH:
        return _PH_TIMED
    if ph in _FLOW_PH:
        return _PH_FLOW
    return _PH_META if ph == "M" else _PH_OTHER


class _RangeParser:
    """Columns of one contiguous range of events, accumulated batch by batch as numpy arrays (string
    columns as int32 dictionary codes against one dictionary per column), turned into Arrow tables
    once at the end: no per-event objects outlive their batch and no per-batch dictionaries need
    unifying."""

    def __init__(self, path: str, events: bool = True, flows: bool = True):
        self.path = path
        self.want_events, self.want_flows = events, flows
        self.str_ids: dict[str, int] = {}  # string pid/tid -> int code
        self.ph_all = _Dict()  # every ph of the range, to split timed / flow / metadata events
        self.ph_kind = np.empty(0, dtype=np.int8)
        self.ev_dicts = {c: _Dict() for c in ("ph", "cat", "name")}
        self.arg_dicts = {c: _Dict((None, b""), pa.binary()) if ARG_FIELDS[c][1] == "raw" else _Dict() for c in _STR_COLS}
        self.cat_group = np.empty(0, dtype=np.int8)  # cat code -> args group (-1: no args read)
        self.ev: dict[str, list[np.ndarray]] = {c: [] for c in ("ph", "cat", "name", "pid", "tid", "ts", "dur", *ARG_FIELDS)}
        self.flow_dicts = {c: _Dict() for c in ("ph", "cat")}
        self.fl: dict[str, list] = {c: [] for c in ("ph", "cat", "id", "pid", "tid", "ts", "bp")}
        self.meta_events: list = []
        self.n_other = 0  # events of a phase that is not read (Chrome B/E pairs, counters, async, ...)

    def add(self, evs: list, args_mode: str = "raw") -> None:
        """One decoded batch (`_decode_batch`): events and how their args were decoded."""
        ph_codes = self.ph_all.encode([e.ph for e in evs])
        if len(self.ph_kind) < len(self.ph_all.values):
            self.ph_kind = np.array([_ph_kind(p) for p in self.ph_all.values], dtype=np.int8)
        kind = self.ph_kind[ph_codes]
        self.n_other += int((kind == _PH_OTHER).sum())
        if self.want_events and (kind == _PH_TIMED).all():
            self._add_timed(evs, args_mode)
            return
        if self.want_events:
            timed = list(compress(evs, (kind == _PH_TIMED).tolist()))
            if timed:
                self._add_timed(timed, args_mode)
            self.meta_events.extend(compress(evs, (kind == _PH_META).tolist()))
        if self.want_flows:
            flows = list(compress(evs, (kind == _PH_FLOW).tolist()))
            if flows:
                self._add_flows(flows)

    def _add_timed(self, timed: list, args_mode: str) -> None:
        n = len(timed)
        ev = self.ev
        ev["ph"].append(self.ev_dicts["ph"].encode([e.ph for e in timed]))
        cat_codes = self.ev_dicts["cat"].encode([e.cat for e in timed])
        ev["cat"].append(cat_codes)
        ev["name"].append(self.ev_dicts["name"].encode([e.name for e in timed]))
        ev["pid"].append(_pid_tid([e.pid for e in timed], self.str_ids))
        ev["tid"].append(_pid_tid([e.tid for e in timed], self.str_ids))
        ts = _ns(self.path, [e.ts for e in timed], "ts", _MISSING)
        missing = int((ts == _MISSING).sum())
        if missing:
            raise TraceError(self.path, f"{missing} complete events have no 'ts' timestamp")
        ev["ts"].append(ts)
        ev["dur"].append(_ns(self.path, [e.dur for e in timed], "dur", 0))

        cats = self.ev_dicts["cat"].values
        if len(self.cat_group) < len(cats):
            self.cat_group = np.array([_GROUP_CODE.get(c, -1) for c in cats], dtype=np.int8)
        event_group = self.cat_group[cat_codes]
        cols: dict[str, np.ndarray] = {}
        for c, (_, k) in ARG_FIELDS.items():
            cols[c] = (np.full(n, np.nan) if k == "float" else
                       np.full(n, -1, dtype=np.int32 if k in ("str", "raw") else np.int64))
        shared: dict[str, list[tuple[np.ndarray, list]]] = {c: [] for c in _SHARED_STR_COLS}
        for gi, g in enumerate(_GROUPS):
            in_group = event_group == gi
            if not in_group.any():
                continue
            idx = np.flatnonzero(in_group)
            if args_mode == "raw":
                args, lenient = _decode_args(self.path, g, [e.args for e in compress(timed, in_group.tolist())])
            else:
                args, lenient = [e.args for e in compress(timed, in_group.tolist())], args_mode == "lenient"
            for c in _GROUPS[g]:
                kind = ARG_FIELDS[c][1]
                vals = list(map(attrgetter(c), args))
                if kind == "int":
                    cols[c][idx] = _int_values(vals)
                elif kind == "float":
                    cols[c][idx] = _float_values(vals)
                else:
                    if kind == "raw":  # JSON text kept as written; absent -> b"" -> null
                        vals = list(map(bytes, vals))
                    elif lenient:  # any JSON value: text of non-strings, as str() writes it
                        vals = [v if v is None or v.__class__ is str else str(v) for v in vals]
                    if c in shared:
                        shared[c].append((idx, vals))
                    else:
                        cols[c][idx] = self.arg_dicts[c].encode(vals)
            del args
        for c, parts in shared.items():  # columns of several groups: encode in row order
            if len(parts) == 1:
                cols[c][parts[0][0]] = self.arg_dicts[c].encode(parts[0][1])
            elif parts:
                idx = np.concatenate([p[0] for p in parts])
                order = np.argsort(idx, kind="stable")
                vals = np.array([v for p in parts for v in p[1]], dtype=object)[order].tolist()
                cols[c][idx[order]] = self.arg_dicts[c].encode(vals)
        for c, a in cols.items():
            ev[c].append(a)

    def _add_flows(self, flows: list) -> None:
        fl = self.fl
        fl["ph"].append(self.flow_dicts["ph"].encode([e.ph for e in flows]))
        fl["cat"].append(self.flow_dicts["cat"].encode([e.cat for e in flows]))
        fl["id"].append(_int_values([e.id for e in flows]))
        fl["pid"].append(_pid_tid([e.pid for e in flows], self.str_ids))
        fl["tid"].append(_pid_tid([e.tid for e in flows], self.str_ids))
        fl["ts"].append(_ns(self.path, [e.ts for e in flows], "ts", 0))  # a flow point without 'ts' sits at 0
        fl["bp"].extend([e.bp for e in flows])

    def events_table(self) -> pa.Table | None:
        if not self.ev["ts"]:
            return None
        cols: dict[str, pa.Array] = {}
        for c in list(self.ev):
            parts = self.ev.pop(c)  # each column's batches are let go as soon as it is built
            a = np.concatenate(parts)
            del parts
            if c in self.ev_dicts:
                cols[c] = _dict_column(a, self.ev_dicts[c].values)
            elif c in self.arg_dicts:
                values = self.arg_dicts[c].values
                if ARG_FIELDS[c][1] == "raw":
                    values, remap = _raw_dictionary(values, c in UNQUOTE_COLS)
                    if remap is not None:
                        a = remap[a]  # -1 indexes the last entry, which is -1
                cols[c] = _dict_column(a, values)
            else:
                cols[c] = pa.array(a)
        return pa.table(cols)

    def flows_table(self) -> pa.Table | None:
        if not self.want_flows:
            return None
        fl = self.fl

        def cat(c: str, dtype) -> np.ndarray:
            return np.concatenate(fl[c]) if fl[c] else np.empty(0, dtype=dtype)

        return pa.table(
            {
                "ph": _dict_column(cat("ph", np.int32), self.flow_dicts["ph"].values),
                "cat": _dict_column(cat("cat", np.int32), self.flow_dicts["cat"].values),
                "id": pa.array(cat("id", np.int64)),
                "pid": pa.array(cat("pid", np.int64)),
                "tid": pa.array(cat("tid", np.int64)),
                "ts": pa.array(cat("ts", np.int64)),
                "bp": pa.array(fl["bp"], type=pa.string()),
            }
        )

    def thread_rows(self) -> list[tuple]:
        rows = []  # process/thread names, sort order, labels (ph M)
        for e in self.meta_events:
            if isinstance(e.args, msgspec.Raw):
                try:
                    ma = _METAARGS.decode(e.args)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    ma = _MetaArgs()
            else:  # args decoded inline
                ma = _MetaArgs(e.args.m_name, e.args.m_labels, e.args.m_sort_index)
            pid_, tid_ = _pid_tid([e.pid, e.tid], self.str_ids)
            rows.append((e.name, int(pid_), int(tid_), ma.name, ma.labels, ma.sort_index))
        for sname, code in self.str_ids.items():  # string pids/tids ("Spans", "Traces") keep their names
            rows.append(("string_id", code, code, sname, None, 0))
        return rows


def _parse_range(path: str, raws: list, lo: int, hi: int, progress=None, scale: float = 1.0, flows: bool = True
                 ) -> _RangeParser:
    """Events raws[lo:hi] -> their columns (`_RangeParser`; the tables are built by its methods, which
    callers do after letting the raw buffer go, so the two are never held at once).

    progress(fraction) is called after each batch with the share of the whole file done (this range's
    share times `scale`, which parallel parsing uses to stand for all workers). flows=False leaves flow
    events out (they are decoded but never turned into columns).
    """
    rp = _RangeParser(path, flows=flows)
    for b_lo in range(lo, hi, BATCH):
        evs, args_mode = _decode_batch(path, _json_array(raws[b_lo : min(b_lo + BATCH, hi)]))
        rp.add(evs, args_mode)
        del evs
        if progress is not None:
            progress(min(1.0, (min(b_lo + BATCH, hi) - lo) / max(1, len(raws)) * scale))
    return rp


def _json_array(raws: list) -> bytes:
    """The JSON array of some raw events, with one copy of their bytes."""
    if len(raws) == 1:
        return b"[" + bytes(raws[0]) + b"]"
    return b",".join([b"[" + bytes(raws[0]), *raws[1:-1], bytes(raws[-1]) + b"]"])


def _decode_batch(path: str, buf: bytes) -> tuple[list, str]:
    """One batch of events -> (events, how their args were decoded: "strict", "lenient" or "raw")."""
    try:
        return _TYPED_EVENTS.decode(buf), "strict"
    except msgspec.ValidationError:
        pass
    except UnicodeDecodeError as e:
        raise TraceError(path, f"a string in an event is not valid UTF-8 ({e.reason}, byte {e.object[e.start:e.start + 1]!r})") from None
    except RecursionError:
        raise TraceError(path, "an event nests objects/arrays too deeply to be a trace (over ~1000 levels)") from None
    try:
        return _TYPED_EVENTS_LENIENT.decode(buf), "lenient"
    except msgspec.ValidationError:
        pass
    try:
        return _EVENTS.decode(buf), "raw"
    except msgspec.ValidationError as e:
        raise TraceError(path, f"malformed event ({e})") from None


def _tables(rp: _RangeParser) -> tuple[pa.Table | None, pa.Table | None, list[tuple], int]:
    return rp.events_table(), rp.flows_table(), rp.thread_rows(), rp.n_other


# Parallel parsing of one large file: the parent forks workers that share the decoded buffer
# (copy-on-write), each parses a contiguous range of events and hands back Arrow IPC through a file
# in /dev/shm (memory-mapped by the parent, so nothing is copied twice).
PARALLEL_MIN_EVENTS = 300_000


def _parallel_workers(n_events: int) -> int:
    if n_events < PARALLEL_MIN_EVENTS or not hasattr(os, "fork") or os.environ.get("TRACELENS_NO_FORK"):
        return 1
    return max(1, min(usable_cpus(), 8, n_events // (PARALLEL_MIN_EVENTS // 2)))


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _parse_parallel(path: str, holder: list, workers: int, progress=None, flows: bool = True
                    ) -> tuple[pa.Table | None, pa.Table | None, list[tuple]]:
    """holder: [raws], emptied once every worker has started and the parent's range is parsed, so the
    raw buffer is freed before the parent builds its tables."""
    raws = holder.pop()
    n = len(raws)
    # Equal shares: after its range the parent only maps the parts and concatenates (~0.05 s), while a
    # worker pays copy-on-write faults for the Raw objects it touches; measured, neither side needs more.
    per = -(-n // workers)
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
                    _write_part(out, *_tables(_parse_range(path, raws, lo, hi, flows=flows)))
                except TraceError as e:
                    with open(out + ".err", "w") as f:
                        f.write(e.problem)
                except BaseException as e:  # noqa: BLE001 - report anything to the parent
                    with open(out + ".err", "w") as f:
                        f.write(f"internal error in parser worker: {type(e).__name__}: {e}")
                finally:
                    os._exit(code)
            children.append((pid, out))
        first = _parse_range(path, raws, *ranges[0], progress=progress, scale=len(ranges), flows=flows)
        del raws
        parts = [_tables(first)]
        del first
        for pid, out in children:
            _, status = os.waitpid(pid, 0)
            if os.path.exists(out + ".err"):
                with open(out + ".err") as f:
                    raise TraceError(path, f.read())
            if status != 0 or not os.path.exists(out + ".rows"):  # .rows is written last
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
    fls = [p[1] for p in parts if p[1] is not None]
    flows_t = pa.concat_tables(fls, promote_options="permissive").unify_dictionaries() if fls else None
    rows = [r for p in parts for r in p[2]]
    return events, flows_t, rows, sum(p[3] for p in parts)


def _write_part(out: str, events: pa.Table | None, flows: pa.Table | None, rows: list[tuple], n_other: int) -> None:
    for name, table in (("events", events), ("flows", flows)):
        if table is None:
            continue
        with pa.OSFile(f"{out}.{name}.tmp", "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
        os.rename(f"{out}.{name}.tmp", f"{out}.{name}")
    with open(out + ".rows", "w") as f:
        json.dump({"rows": rows, "n_other": n_other}, f, default=str)


def _read_part(out: str) -> tuple[pa.Table | None, pa.Table | None, list[tuple], int]:
    def read(name: str) -> pa.Table | None:
        p = f"{out}.{name}"
        if not os.path.exists(p):
            return None
        return pa.ipc.open_file(pa.memory_map(p)).read_all()

    with open(out + ".rows") as f:
        part = json.load(f)
    return read("events"), read("flows"), [tuple(r) for r in part["rows"]], int(part["n_other"])


def _doc_and_raws(path: str, data: bytes | None) -> tuple[_Doc, list]:
    """The top level of the document and its events as raw JSON slices (nothing decoded yet)."""
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
    except UnicodeDecodeError as e:
        raise TraceError(path, f"not valid UTF-8 ({e.reason}, byte {e.object[e.start:e.start + 1]!r})") from None
    except RecursionError:
        raise TraceError(path, "nests objects/arrays too deeply to be a trace (over ~1000 levels)") from None
    if doc.traceEvents is None:
        raise TraceError(path, "not a Chrome/Kineto trace: no 'traceEvents' list")
    raws = doc.traceEvents
    doc.traceEvents = None  # the Raw slices keep the buffer alive until `raws` goes
    if not raws:
        raise TraceError(path, "empty trace: 'traceEvents' has no events")
    return doc, raws


def parse_flows(path: str | os.PathLike, data: bytes | None = None) -> pa.Table:
    """Only the flow events (ph s/t/f) of one file: what `parse_file(..., flows=False)` left out."""
    path = os.fspath(path)
    _, raws = _doc_and_raws(path, data)
    rp = _RangeParser(path, events=False, flows=True)
    for lo in range(0, len(raws), BATCH):
        rp.add(*_decode_batch(path, _json_array(raws[lo : lo + BATCH])))
    return rp.flows_table()


# ---------------------------------------------------------------------------------------------
# The compiled fast path: the same tables, from one pass of `_kineto_fast.Parser` over the bytes.

class _NotFast(Exception):
    """The compiled path does not take this file; the msgspec path parses it (and names any problem)."""


def _fast_string(v: bytes, flag: int) -> str:
    if flag == 0:  # a JSON string's content without escapes
        return v.decode("utf-8")
    if flag == 1:  # with escapes
        return msgspec.json.decode(b'"' + v + b'"')
    return str(msgspec.json.decode(v))  # a non-string value in a string column, as the lenient decode gives it


def _fast_strings(values: list, flags: bytes) -> tuple[list, np.ndarray | None]:
    """Decoded dictionary values of a string column, and a code remap when two spellings of one
    string (escaped and not, or 5 and "5") both occur: codes of the later spelling move to the first."""
    try:
        out = [_fast_string(v, f) for v, f in zip(values, flags)] if any(flags) else [v.decode("utf-8") for v in values]
    except (UnicodeDecodeError, msgspec.DecodeError) as e:
        raise _NotFast(f"string not valid UTF-8/JSON ({e})") from None
    if not any(flags) or len(set(out)) == len(out):
        return out, None
    first: dict = {}
    remap = np.empty(len(out) + 1, dtype=np.int32)
    kept: list = []
    for i, v in enumerate(out):
        if v not in first:
            first[v] = len(kept)
            kept.append(v)
        remap[i] = first[v]
    remap[-1] = -1
    return kept, remap


def _fast_dict_column(part: tuple, raw_unquote: bool | None = None, width: int = 4) -> pa.DictionaryArray:
    codes, values, escaped = part
    a = np.frombuffer(codes, dtype=_INT_OF_WIDTH[width])
    if raw_unquote is None:
        values, remap = _fast_strings(values, escaped)
    else:  # raw JSON text, as the msgspec path keeps it
        values, remap = _raw_dictionary(values, raw_unquote)
    if remap is not None:
        a = remap[a]  # -1 indexes the last entry, which is -1
    return _dict_column(a, values)


_INT_OF_WIDTH = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _parse_fast(path: str, scan: Scan, flows: bool = True) -> ParsedTrace:
    if scan.result is None:
        raise _NotFast(scan.error or "not scanned")
    data, r = scan.data, scan.result
    lo, hi = r["events_span"]
    if r["top_object"]:  # the document without its events: device properties, distributed info, ...
        view = memoryview(data)
        try:
            doc = _DOC.decode(b"".join((view[:lo], b"null", view[hi:])))
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise _NotFast(f"top level ({e})") from None
    else:
        doc = _Doc()
    if not r["n_events"]:
        raise TraceError(path, "empty trace: 'traceEvents' has no events")

    # metadata events (ph M), and flow events when asked for, through the msgspec path's own code
    rp = _RangeParser(path, events=True, flows=flows)
    n_spans = sum(memoryview(r[k]).nbytes // 16 for k in ("meta_spans", "flow_spans"))  # (start, end) int64 pairs
    for key in ("meta_spans", "flow_spans") if flows else ("meta_spans",):
        spans = np.frombuffer(r.pop(key), dtype=np.int64).reshape(-1, 2).tolist()
        view = memoryview(data)
        for b_lo in range(0, len(spans), BATCH):
            rp.add(*_decode_batch(path, _json_array([view[s:e] for s, e in spans[b_lo : b_lo + BATCH]])))
    if not r["rows"]:
        raise TraceError(path, "no timed events (ph 'X') in 'traceEvents'")
    n_other = r["n_events"] - r["rows"] - n_spans  # events of a phase that is not read

    cols: dict[str, pa.Array] = {c: _fast_dict_column(r.pop(c)) for c in ("ph", "cat", "name")}
    str_ids, _ = _fast_strings(*r["pid_tid_str"][1:])
    ids = _pid_tid(str_ids, rp.str_ids) if str_ids else np.empty(0, dtype=np.int64)
    for c in ("pid", "tid"):
        a = np.frombuffer(r.pop(c), dtype=np.int64)
        s = np.frombuffer(r.pop(c + "_s"), dtype=np.int32)
        if len(ids) and (s >= 0).any():
            a = np.where(s >= 0, ids[s], a)  # string ids ("Spans", "stream 7") as the msgspec path codes them
        cols[c] = pa.array(a)
    cols["ts"] = pa.array(np.frombuffer(r.pop("ts"), dtype=np.int64))
    cols["dur"] = pa.array(np.frombuffer(r.pop("dur"), dtype=np.int64))
    numeric = {}
    widths = r.pop("arg_widths")  # an int arg's column comes in the narrowest width that holds its values
    for (c, (_, kind)), part, w in zip(ARG_FIELDS.items(), r["args"], widths):
        if kind in ("int", "float"):
            numeric[c] = np.frombuffer(part, dtype=_INT_OF_WIDTH[w] if kind == "int" else np.float64)
    fix = np.frombuffer(r.pop("fixups"), dtype=np.int64).reshape(-1, 4)
    if len(fix):  # int/float args of another JSON type ("stream": "0x0"), converted as the lenient decode does
        names = list(ARG_FIELDS)
        for a in np.unique(fix[:, 1]).tolist():  # a converted value may not fit the column's width
            if ARG_FIELDS[names[a]][1] == "int":
                numeric[names[a]] = numeric[names[a]].astype(np.int64)  # narrowed again by `_parsed`
        for row, a, off, n in fix.tolist():
            c = names[a]
            v = msgspec.json.decode(data[off : off + n])
            numeric[c][row] = _lenient_int(v) if ARG_FIELDS[c][1] == "int" else _float_or_nan(v)
    for c, (_, kind), part, w in zip(ARG_FIELDS, ARG_FIELDS.values(), r.pop("args"), widths):
        if kind in ("int", "float"):
            cols[c] = pa.array(numeric[c])
        else:
            cols[c] = _fast_dict_column(part, (c in UNQUOTE_COLS) if kind == "raw" else None, w)
    n_events = r["n_events"]
    holder = [pa.table(cols)]
    del cols, numeric, r, a  # (the table holds the only references: `_parsed` can free the columns it replaces)
    return _parsed(path, doc, holder, rp.flows_table(), rp.thread_rows(), n_events, "compiled", n_other)


def parse_file(path: str | os.PathLike, data: bytes | list | None = None, parallel: int | None = None,
               progress=None, flows: bool = True, scan: Scan | None = None, threads: int | None = None) -> ParsedTrace:
    """Parse one trace file. Raises TraceError naming the file for every kind of bad input (see
    `_parse_file`). data: the file's JSON bytes, or a one-element list holding them, which the parse
    empties so that it holds the only reference and can free the buffer early."""
    try:
        return _parse_file(path, data, parallel, progress, flows, scan, threads)
    except RecursionError:
        raise TraceError(path, "nests objects/arrays too deeply to be a trace (over ~1000 levels)") from None
    except UnicodeDecodeError as e:
        raise TraceError(path, f"not valid UTF-8 ({e.reason}, byte {e.object[e.start:e.start + 1]!r})") from None


def _parse_file(path: str | os.PathLike, data: bytes | list | None = None, parallel: int | None = None,
                progress=None, flows: bool = True, scan: Scan | None = None, threads: int | None = None) -> ParsedTrace:
    """Parse one trace file. Raises TraceError naming the file for every kind of bad input.

    parallel: worker processes for one large file on the msgspec path (default: automatic, one per
    CPU above PARALLEL_MIN_EVENTS events; 1 disables; the compiled scanner needs none).
    progress: optional callback(fraction of the file done). flows=False skips the flow events (ph
    s/t/f: no analysis reads them; `parse_flows` reads them later); ParsedTrace.flows is then None.
    scan: the file's bytes already through the compiled scanner (`Scan`, run by a prefetch thread).
    threads: threads of the compiled scanner for one large file (default `scanner.scan_threads`: one per
    usable CPU; 1 where processes already run side by side, as the multi-file pool and Dask workers do).
    """
    path = os.fspath(path)
    if isinstance(data, list):
        data = data.pop()
    if scan is not None:
        data = scan.data
    elif data is None:
        data = (map_file(path) if fast_enabled() else None) or read_bytes(path)
    if scan is not None or fast_enabled():
        try:
            if scan is None:
                scan = Scan(data)
                scan.run(progress, threads)
            if isinstance(data, Mapped):  # truncated or rewritten during the scan: one line, before more reads
                data.check()
            return _parse_fast(path, scan, flows)
        except _NotFast:
            pass  # the msgspec path is the reference: it parses what the scanner does not take, or names the problem
        finally:
            scan = None
    if isinstance(data, Mapped):
        data.check()
    if isinstance(data, mmap.mmap):  # the msgspec path keeps slices of the bytes: read them into memory
        data = data[:]
    doc, raws = _doc_and_raws(path, data)
    del data
    n_total = len(raws)

    workers = _parallel_workers(n_total) if parallel is None else max(1, int(parallel))
    if workers > 1:
        holder = [raws]
        del raws
        events, flows_t, rows, n_other = _parse_parallel(path, holder, workers, progress, flows=flows)
    else:
        rp = _parse_range(path, raws, 0, n_total, progress, flows=flows)
        del raws  # the last reference to the file's bytes (and data, if the caller passed it, is theirs)
        events, flows_t, rows, n_other = _tables(rp)
        del rp
    if events is None:
        raise TraceError(path, "no timed events (ph 'X') in 'traceEvents'")
    holder = [events]
    del events
    return _parsed(path, doc, holder, flows_t, rows, n_total, "msgspec", n_other)


def _parsed(path: str, doc: _Doc, holder: list[pa.Table], flows_t: pa.Table | None, rows: list[tuple], n_total: int,
            decoder: str, n_other: int = 0) -> ParsedTrace:
    """The ParsedTrace of a decoded file; holder: a one-element list holding its events table (emptied
    here, so that the table's columns can be freed as they are replaced)."""
    events = narrow_args(holder.pop())  # both decoders' tables alike: the compiled one's int args come narrow already
    events, issues = check_events(path, events)  # impossible values dropped, each drop reported
    events, cut = cut_long_names(path, events)  # names past limits.MAX_NAME_BYTES cut, each cut reported
    holder.append(events)
    del events
    events, tree_rows = tree_rows_first(holder)  # the call tree's events first (roworder.py)
    dropped = "; ".join(i["message"][len(path) + 2:] for i in issues)
    issues += cut
    if n_other:
        issues.append({"check": "unread_phase", "action": "dropped", "events": n_other,
                       "message": f"{path}: dropped {n_other} event{'s' if n_other > 1 else ''} of a phase this loader does "
                                  f"not read (only complete 'X' events and 'i'/'I' instants are timed; Chrome 'B'/'E' "
                                  f"begin/end pairs, 'C' counters and async 'b'/'e' events are not)"})
    if not events.num_rows:
        raise TraceError(path, "no valid timed events: " + dropped)
    if not _has_activity(events):
        raise TraceError(path, "nothing to analyze: the only timed events are the profiler's own span and markers"
                         + (f" ({dropped})" if dropped else ""))
    # one row per fact, in the order of first appearance (a dict of the few metadata rows: Arrow's group_by here
    # imported pyarrow.acero and pyarrow.dataset, 15-38 ms on the load's path, for a few dozen rows)
    facts = list(dict.fromkeys((r[0], r[1], r[2], None if r[3] is None else cut_name(str(r[3])),
                                None if r[4] is None else cut_name(str(r[4])), _int_or(r[5], 0)) for r in rows))
    threads = pa.table(
        {
            "kind": pa.array([f[0] for f in facts], type=pa.string()),
            "pid": pa.array([f[1] for f in facts], type=pa.int64()),
            "tid": pa.array([f[2] for f in facts], type=pa.int64()),
            "value": pa.array([f[3] for f in facts], type=pa.string()),
            "labels": pa.array([f[4] for f in facts], type=pa.string()),
            "sort_index": pa.array([f[5] for f in facts], type=pa.int64()),
        }
    )

    meta = {
        "path": path,
        "device_properties": doc.deviceProperties or [],
        "distributed_info": doc.distributedInfo or {},
        "base_time_ns": doc.baseTimeNanoseconds,
        "schema_version": doc.schemaVersion if isinstance(doc.schemaVersion, (int, str)) else None,
        "trace_name": doc.traceName if isinstance(doc.traceName, str) else None,
        "n_raw_events": n_total,
        "decoder": decoder,  # "compiled" (the scanner) or "msgspec"
        "load_issues": issues,  # what checks.check_events dropped (kept in the cache entry's meta)
        "tree_rows": tree_rows,  # the events' leading rows that are the call tree's, all of them (roworder.py)
    }
    return ParsedTrace(path=path, events=events, flows=flows_t, threads=threads, meta=meta)


_PROFILER_CATS = frozenset({"Trace"})  # Kineto's "PyTorch Profiler (0)" span of the whole window


def _has_activity(events: pa.Table) -> bool:
    """Whether any timed event is more than the profiler's bookkeeping (its window span, instant marks)."""
    ph = events["ph"].combine_chunks()
    cat = events["cat"].combine_chunks()
    ph_ok = np.array([v == "X" for v in ph.dictionary.to_pylist()] + [False])
    cat_ok = np.array([v not in _PROFILER_CATS for v in cat.dictionary.to_pylist()] + [True])
    ph_codes = ph.indices.fill_null(-1).to_numpy()
    cat_codes = cat.indices.fill_null(-1).to_numpy()
    return bool((ph_ok[ph_codes] & cat_ok[cat_codes]).any())


def _lenient_int(v: Any) -> int:
    """An int arg's value of another JSON type, as `_int_values` converts it: numeric strings exactly,
    anything else through `_int_or` ("stream 7" -> 7, "0x0" -> -1, 3.0 -> 3, true -> 1)."""
    if isinstance(v, str):
        try:
            return _int64_or(int(v))
        except ValueError:
            pass
    return _int64_or(_int_or(v, -1))


def _float_or_nan(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def meta_to_json(meta: dict) -> str:
    return json.dumps(meta, default=str)

"""Impossible values in a parsed trace: dropped at the loader boundary, each drop reported.

Every analysis assumes what the hardware guarantees: an event does not end before it starts, a
timestamp is a point of one clock, one event is recorded once. A trace that breaks this (a writer's
bug, a hand-edited file, a merge gone wrong) would otherwise give silently wrong numbers downstream
(negative busy time, a 52-day span, communication at 129 % of GPU busy). `check_events` runs on the
events table of every parsed file, on both decoders (it is called from `kineto._parsed`), before the
table is cached; what it drops is described in `issues`, one record per kind of problem:

    {"check": "negative_dur" | "unrepresentable_time" | "duplicate" | "time_outlier",
     "action": "dropped", "events": N, "message": "<file>: dropped N ... (e.g. ...)"}

The records travel in the file's meta (`ParsedTrace.meta["load_issues"]`, so a cache hit reports
them again) and become `Trace.load_issues` (a table) and lines of `Trace.warnings`.

Rules (no threshold is fitted to one input; see docs/robustness.md):
- `dur` < 0: dropped (a duration cannot be negative).
- `ts` or `dur` of 2**53 us (285 years) or more, or not finite (int64 nanoseconds overflow at 9.2e15
  us): the decoders write `UNREPRESENTABLE` and the event is dropped.
- exact duplicates (every column equal, the same event recorded twice): later copies dropped.
- time outliers: an event with a start or end outside the body of the trace (`_body`): a clock's jump
  shows as a gap in time that nothing covers, more than `OUTLIER_FACTOR` times the span of the work on
  its other side and more than `OUTLIER_MIN_GAP_NS`; the side with less work (time covered, not event
  count: 10**6 zero-duration kernels in 20 us do not outweigh 50 ms of real work) is cut off. Real
  traces have no such gap (a prefill/decode trace's idle gaps are < 17x its work's span); a `ts` of 0
  among monotonic-clock timestamps is ~1e8x. Traces of fewer than `OUTLIER_MIN_EVENTS` events are not
  judged (with few events which side is the real work is a guess).
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .limits import MAX_NAME_BYTES

UNREPRESENTABLE = np.iinfo(np.int64).min  # ts/dur that no int64 ns can hold (written by the decoders)
MAX_ABS_US = float(2**53)  # |ts|, |dur| in us from here on are not exact int64 ns (the compiled scanner's limit too)
OUTLIER_FACTOR = 1000.0
OUTLIER_MIN_GAP_NS = 1e9  # and more than a second: a gap shorter than this is never a clock's jump
OUTLIER_MIN_EVENTS = 200


def _example(events: pa.Table, mask: np.ndarray, what: str) -> str:
    i = int(np.flatnonzero(mask)[0])
    cat = events["cat"][i].as_py()
    name = events["name"][i].as_py()
    label = repr(name if name is None or len(name) <= 60 else name[:57] + "...")  # repr: no raw control chars
    return f"e.g. {cat!r} {label} {what(i)}"


def _fmt_us(ns: int) -> str:
    if ns == UNREPRESENTABLE:
        return "beyond int64 ns"
    us = ns / 1e3
    return f"{us:,.3f} us" if abs(us) < 1e6 else f"{us / 1e6:,.1f} s" if abs(us) < 86400e6 else f"{us / 86400e6:,.1f} days"


def _fmt_ts(ns: int) -> str:
    return "beyond int64 ns" if ns == UNREPRESENTABLE else f"{ns / 1e3:.3f} us"


def _row_hash(events: pa.Table) -> np.ndarray:
    """A 64-bit hash of each row over the columns that tell events apart (candidates for duplicates;
    confirmed on every column)."""
    h = np.zeros(events.num_rows, dtype=np.uint64)
    scratch = np.empty_like(h)  # each column's values as int64, then the shifted hash: no other temporary
    as_int64 = scratch.view(np.int64)
    mult = np.uint64(0x9E3779B97F4A7C15)
    for c in ("ts", "dur", "tid", "name", "correlation"):
        if c not in events.column_names:
            continue
        col = events[c].combine_chunks() if events[c].num_chunks != 1 else events[c].chunk(0)
        if pa.types.is_dictionary(col.type):
            idx = col.indices
            a = (idx.fill_null(-1) if idx.null_count else idx).to_numpy()
        else:  # correlation comes narrow (narrow.narrow_args): its int64 value is what is hashed
            a = col.to_numpy(zero_copy_only=False)
        np.copyto(as_int64, a, casting="unsafe")  # integers sign-extended to int64, as astype(np.int64) does
        del a, col
        h ^= scratch
        h *= mult
        np.right_shift(h, np.uint64(29), out=scratch)
        h ^= scratch
    return h


def _exact_rows(events: pa.Table, idx: np.ndarray) -> np.ndarray:
    """Rows `idx` as an int64 matrix holding every column (dictionary codes, float bits), for equality."""
    sub = events.take(pa.array(idx))
    cols = []
    for c in sub.column_names:
        col = sub[c].combine_chunks()
        if pa.types.is_dictionary(col.type):
            # codes of one table share its dictionary; compare values, not codes, when chunks differ
            a = col.indices.fill_null(-1).to_numpy().astype(np.int64)
        elif pa.types.is_floating(col.type):
            a = np.nan_to_num(col.to_numpy(zero_copy_only=False).astype(np.float64), nan=np.inf).view(np.int64)
        else:
            a = col.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        cols.append(a)
    return np.stack(cols, axis=1)


def _duplicates(events: pa.Table) -> np.ndarray:
    """Mask of rows that repeat an earlier row exactly."""
    n = events.num_rows
    dup = np.zeros(n, dtype=bool)
    if n < 2:
        return dup
    h = _row_hash(events)
    # sorted: ~5 ms for 500K rows where numpy sorts with AVX-512 (the device hosts' numpy 2.5); pandas' hash table took
    # 17 ms for 790,000 (stop 31), faster only where numpy's sort is not vectorized (39-45 ms on numpy 2.4.6 here)
    s = np.sort(h)
    same = s[1:] == s[:-1]
    if not same.any():
        return dup  # every hash distinct: no duplicates (the common case)
    cand = np.flatnonzero(np.isin(h, np.unique(s[1:][same])))
    rows = _exact_rows(events, cand)
    _, first = np.unique(rows, axis=0, return_index=True)
    keep = np.zeros(len(cand), dtype=bool)
    keep[first] = True
    dup[cand[~keep]] = True
    return dup


def _covered(s: np.ndarray, e: np.ndarray, lo: float, hi: float) -> float:
    """Time the intervals [s, e] cover inside [lo, hi], summed (overlaps counted twice: a weight, not busy)."""
    return float(np.clip(np.minimum(e, hi) - np.maximum(s, lo), 0.0, None).sum())


_GAP_BINS_MAX = 1 << 24  # bins of the quick test below (2 MB of flags); a wider extent is sorted


def _may_have_gap(s: np.ndarray, e: np.ndarray, first: float, last: float) -> bool:
    """False when no two consecutive start/end points are more than OUTLIER_MIN_GAP_NS apart (then there is
    no outlier and no sort is needed): every bin of half that width holds a point. O(n), no sort."""
    if last - first <= OUTLIER_MIN_GAP_NS:
        return False
    width = OUTLIER_MIN_GAP_NS / 2
    n_bins = int((last - first) // width) + 1
    if n_bins > _GAP_BINS_MAX:
        return True
    seen = np.zeros(n_bins, dtype=bool)
    seen[_floor_bins(s - first, width)] = True
    seen[_floor_bins(e - first, width)] = True
    return not seen.all()


_TWO52 = 2.0**52  # floats from here up to 2**53 are the integers, one apart: x + 2**52 rounds x to one


def _floor_bins(d: np.ndarray, width: float) -> np.ndarray:
    """`(d // width).astype(np.int64)` for d >= 0 with d / width < 2**24 and width an integer below 2**29 (the
    bins of `_may_have_gap`), exactly, without numpy's float floor division and float-to-int cast (~12 ns a value
    each on the 2-core measuring host; this ~1): d / width rounded to the nearest integer k (adding 2**52) is the
    floor or one above it, and one above exactly when k * width > d (k * width < 2**53: an exact product); the
    integer is then read from the float's low bits (k + 2**52 holds k in its mantissa)."""
    k = d / width
    k += _TWO52  # rounds to the nearest integer (the sum's spacing is 1)
    k -= _TWO52  # k: that integer, as a float
    np.subtract(k, 1.0, out=k, where=k * width > d)  # rounded up past d / width: one down
    k += _TWO52
    bins = k.view(np.int64)
    bins -= np.float64(_TWO52).view(np.int64)
    return bins


def _body(s: np.ndarray, e: np.ndarray) -> tuple[float, float]:
    """The time window [lo, hi] that the events' work lies in (see the module docstring): their start and end
    points, split at the widest gap where that gap is more than OUTLIER_FACTOR times the span of the heavier
    side and more than OUTLIER_MIN_GAP_NS; the lighter side is cut off and the heavier one split again.
    Weight is the time the events cover inside a side's span, so a million zero-duration events cannot
    outweigh real work (a lone far point, such as the end of a memcpy with an absurd dur, weighs nothing);
    when both sides weigh nothing, the side with more points is the heavier."""
    first, last = float(min(s.min(), e.min())), float(max(s.max(), e.max()))
    if not _may_have_gap(s, e, first, last):
        return first, last
    pts = np.sort(np.concatenate([s, e]))
    a, b = 0, len(pts) - 1  # the body is pts[a..b]
    while b > a:
        gaps = np.diff(pts[a : b + 1])
        k = int(np.argmax(gaps))
        g = float(gaps[k])
        left, right = (float(pts[a]), float(pts[a + k])), (float(pts[a + k + 1]), float(pts[b]))
        w_l, w_r = _covered(s, e, *left), _covered(s, e, *right)
        n_l, n_r = k + 1, b - a - k
        heavy_right = (w_r, n_r) > (w_l, n_l)
        span = right[1] - right[0] if heavy_right else left[1] - left[0]
        if g <= OUTLIER_FACTOR * span or g <= OUTLIER_MIN_GAP_NS:
            break
        if heavy_right:
            a = a + k + 1
        else:
            b = a + k
    return float(pts[a]), float(pts[b])


# from here a thread's start (~0.1 ms) is nothing against the checks' sorts: the parse of a 200 MB trace of ~700,000
# events, five runs each on the dev machine against 1 << 20: b200_eager 0.113-0.154 -> 0.100-0.121 s, h100_owlv2
# 0.113-0.144 -> 0.108-0.134 s
_DUPLICATES_BESIDE_ROWS = 1 << 18


class _Beside:
    """``fn(*args)`` in a thread of its own; `result` waits for it and returns its value or raises its exception."""

    def __init__(self, fn, *args):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True, name="tracelens-checks")
        self._thread.start()

    def _run(self, fn, args) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised again by `result`, in the caller's thread
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def check_events(path: str, events: pa.Table) -> tuple[pa.Table, list[dict]]:
    """The events with impossible ones dropped, and one issue record per kind of drop."""
    issues: list[dict] = []
    ts = events["ts"].to_numpy()
    dur = events["dur"].to_numpy()
    drop = np.zeros(events.num_rows, dtype=bool)
    # the duplicates are found beside the checks below (mostly sorts, which release the GIL): rows dropped by them
    # are dropped with their duplicates, since each check reads only a row's own values, so the duplicates among
    # the rows kept are those of the whole table, less the dropped rows
    dups = _Beside(_duplicates, events) if events.num_rows >= _DUPLICATES_BESIDE_ROWS else None

    def report(check: str, mask: np.ndarray, what: str, detail) -> None:
        n = int(mask.sum())
        if n:
            issues.append({"check": check, "action": "dropped", "events": n,
                           "message": f"{path}: dropped {n} event{'s' if n > 1 else ''} {what} "
                                      f"({_example(events, mask, detail)})"})

    bad = (ts == UNREPRESENTABLE) | (dur == UNREPRESENTABLE)
    if bad.any():
        report("unrepresentable_time", bad, "whose ts or dur is beyond any clock (|value| >= 2**53 us, 285 years)",
               lambda i: f"ts {_fmt_ts(int(ts[i]))}, dur {_fmt_us(int(dur[i]))}")
        drop |= bad
    neg = (dur < 0) & ~bad
    if neg.any():
        report("negative_dur", neg, "with a negative dur", lambda i: f"dur {_fmt_us(int(dur[i]))}")
        drop |= neg

    ok = ~drop
    if int(ok.sum()) >= OUTLIER_MIN_EVENTS:
        kept = not drop.any()  # (the common case: every row judged, no gather)
        idx = None if kept else np.flatnonzero(ok)
        s_ = (ts if kept else ts[idx]).astype(np.float64)  # float: sums of durations may pass int64
        e_ = s_ + (dur if kept else dur[idx])
        lo, hi = _body(s_, e_)
        if kept:  # the same start and end values the rows are judged by
            out = s_ < lo
            out |= e_ > hi
            del s_, e_
        else:
            del s_, e_
            out = np.zeros(events.num_rows, dtype=bool)
            t_all = ts.astype(np.float64)
            out[idx] = t_all[idx] < lo
            t_all += dur
            out[idx] |= t_all[idx] > hi
            del t_all
        if out.any():
            width = hi - lo

            def where(i: int) -> str:
                t, e = float(ts[i]), float(ts[i]) + float(dur[i])
                away = lo - t if t < lo else e - hi
                side = "before" if t < lo else "after"
                return (f"ts {_fmt_ts(int(ts[i]))}, dur {_fmt_us(int(dur[i]))}: {_fmt_us(int(away))} {side} "
                        f"the body of the trace, which spans {_fmt_us(int(width))}")
            report("time_outlier", out, "far outside the time window of the trace", where)
            drop |= out

    dup = dups.result() if dups is not None else _duplicates(events)
    if drop.any():
        events = events.filter(pa.array(~drop))
        dup = dup[~drop]
    if dup.any():
        d_ts = events["ts"].to_numpy()
        report_events = events
        n = int(dup.sum())
        issues.append({"check": "duplicate", "action": "dropped", "events": n,
                       "message": f"{path}: dropped {n} exact duplicate event{'s' if n > 1 else ''} (the same event "
                                  f"recorded more than once; {_example(report_events, dup, lambda i: f'at ts {_fmt_ts(int(d_ts[i]))}')})"})
        events = events.filter(pa.array(~dup))
    return events, issues


def cut_name(s: str) -> str:
    """``s`` when it fits MAX_NAME_BYTES of UTF-8, else its first MAX_NAME_BYTES (whole characters) and a
    marker with the full length and a digest of the whole name (names that differ stay different)."""
    b = s.encode("utf-8", "surrogatepass")
    if len(b) <= MAX_NAME_BYTES:
        return s
    digest = hashlib.blake2b(b, digest_size=6).hexdigest()
    return b[:MAX_NAME_BYTES].decode("utf-8", "ignore") + f"...[cut: {len(b):,} bytes, blake2b {digest}]"


def cut_long_names(path: str, events: pa.Table, columns: tuple[str, ...] = ("name", "cat")
                   ) -> tuple[pa.Table, list[dict]]:
    """Event names (and categories) longer than MAX_NAME_BYTES cut to it (`cut_name`), one issue record
    per column with any cut: a 100 MB op name would otherwise be copied into every table and report."""
    issues: list[dict] = []
    for c in columns:
        if c not in events.column_names:
            continue
        col = events[c]
        if not pa.types.is_dictionary(col.type):
            continue
        chunks, n_cut, longest, example = [], 0, 0, None
        for ch in col.chunks:
            d = ch.dictionary
            lengths = pc.binary_length(d).to_numpy(zero_copy_only=False)
            long_ = np.flatnonzero(lengths > MAX_NAME_BYTES) if len(lengths) else np.empty(0, dtype=np.int64)
            if not len(long_):
                chunks.append(ch)
                continue
            values = d.to_pylist()
            for k in long_.tolist():
                if example is None:
                    example = values[k][:60]
                longest = max(longest, int(lengths[k]))
                values[k] = cut_name(values[k])
            n_cut += int(np.isin(ch.indices.fill_null(-1).to_numpy(), long_).sum())
            chunks.append(pa.DictionaryArray.from_arrays(ch.indices, pa.array(values, type=d.type)))
        if example is None:
            continue
        events = events.set_column(events.column_names.index(c), c, pa.chunked_array(chunks, type=col.type))
        issues.append({"check": "long_name", "action": "truncated", "events": n_cut,
                       "message": f"{path}: cut the {c} of {n_cut} event{'s' if n_cut > 1 else ''} to "
                                  f"{MAX_NAME_BYTES} bytes (the longest was {longest:,} bytes, e.g. {example!r}...)"})
    return events, issues

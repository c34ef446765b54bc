"""Load traces: a file, a directory of per-rank files, or a run directory -> one `Trace` of tables.

    >>> import tracelens
    >>> trace = tracelens.load("runs/demo")          # run dir, trace dir, or a .json/.json.gz file
    >>> trace.events.groupby("cat").dur.sum()

Per-rank files load in parallel processes and each parsed file is cached (Arrow IPC, keyed by content).
"""

from __future__ import annotations

import mmap
import os
import re
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from .categories import forget_lookups
from .errors import TraceError
from .io import cache as _cache
from .io.files import TRACE_SUFFIXES, _is_trace_file, discover  # noqa: F401 - re-exported
from .io.kineto import ParsedTrace, parse_file, parse_flows, usable_cpus
from .io.roworder import tree_rows_first
from .io.prefetch import from_scan
from .io.narrow import narrow_args  # noqa: F401 - re-exported (the loader applies it per file and after the concat)
from .io.run import Run
from .io.scanner import Mapped, fast_enabled, gunzip, map_file, read_raw
from .io.schema import ARG_FIELDS

MAX_RANK = 2**31  # ranks are int32 in the tables
_RANK_IN_NAME = re.compile(r"(?:^|[^a-z])rank[-_]?(\d+)", re.IGNORECASE)
# Below this total size a process pool costs more than it saves.
PARALLEL_MIN_BYTES = 16 << 20


@dataclass
class RankInfo:
    rank: int
    path: str
    device_properties: list[dict[str, Any]] = field(default_factory=list)
    distributed_info: dict[str, Any] = field(default_factory=dict)
    base_time_ns: int | None = None
    n_raw_events: int = 0
    from_cache: bool = False

    @property
    def device_name(self) -> str | None:
        names = {d.get("name") for d in self.device_properties if d.get("name")}
        return ", ".join(sorted(names)) if names else None

    @property
    def world_size(self) -> int | None:
        ws = self.distributed_info.get("world_size")
        return int(ws) if isinstance(ws, (int, float)) and not isinstance(ws, bool) and ws == ws and 1 <= ws <= MAX_RANK else None


@dataclass
class Trace:
    """All ranks' events as pandas tables (string columns are categoricals; times are int64 ns).

    `flows` may be given as None: no analysis reads flow events, so `load` leaves them out and they
    are read from the rank files on first access of `trace.flows`.
    """

    events: pd.DataFrame  # one row per ph X / i event; column `rank`. Rows: every rank's call-tree events
    # (ops, annotations, runtime calls, nn.Module ranges), rank by rank, then every rank's other events,
    # each in file order (io/roworder.py); the call tree is a view of the first rows
    flows: pd.DataFrame  # ph s/t/f flow events; column `rank` (read on first access when given as None)
    threads: pd.DataFrame  # process/thread names and sort order (ph M); column `rank`
    ranks: list[RankInfo]
    warnings: list[str] = field(default_factory=list)
    # What the loader dropped, clamped or replaced, one row per kind of problem and file (also lines of
    # `warnings`): rank, file, check (negative_dur, unrepresentable_time, duplicate, time_outlier,
    # cache_entry, rank_name_mismatch), action (dropped, replaced, kept), events (how many), message.
    load_issues: pd.DataFrame = field(default_factory=lambda: _issues_table([]))
    # The run dir's state when the traces are RUN/traces/* beside RUN/manifest.json, else None:
    # `Run.status()` (status complete | running | failed | ..., complete True/False/None, reason, warning).
    # An incomplete run also adds its warning to `warnings`.
    run_status: dict | None = None
    # The run the traces belong to (manifest, pipeline files), read once when the trace is made: analyses and
    # projections read it from here and never open a run dir's files (tracelens.io.run)
    run: Run | None = field(default=None, repr=False)
    # How many of `events`' first rows are the call tree's events (all of them: the rows above), as the load
    # ordered them; None when not known (then the call tree finds them from the rows: `calltree.host_events`)
    tree_rows: int | None = None

    def __post_init__(self) -> None:
        if self.run is None:
            self.run = Run.of_files([r.path for r in self.ranks])
        if self.flows is None:
            del self.flows  # the next read of .flows goes to __getattr__, which loads them

    def __getattr__(self, name: str) -> Any:
        if name != "flows":
            raise AttributeError(name)
        tables = [parse_flows(r.path) for r in self.ranks]
        self.flows = _concat_ranks(tables, self.ranks)
        return self.flows

    @property
    def rank_ids(self) -> list[int]:
        return [r.rank for r in self.ranks]

    def rank_info(self, rank: int) -> RankInfo:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(rank)


# ------------------------------------------------------------------------------------ discovery


def _rank_from_name(path: str) -> int | None:
    m = None
    for m in _RANK_IN_NAME.finditer(os.path.basename(path)):
        pass
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------------ loading


def _parse_one(path: str, use_cache: bool, cache_root: str | None, progress=None, prefetch=None,
               threads: int | None = None) -> tuple[ParsedTrace, bool]:
    """A parsed file, from the cache when it holds a valid entry; flow events are left for `Trace.flows`.

    The file is read once: its cache key is the hash of exactly the bytes that are parsed (a file
    replaced meanwhile cannot leave one version's tables under the other's key), and an entry is
    checked against its key and the file before it is served (`cache.fetch`); one that fails is
    re-parsed and replaced, and `meta["cache_warning"]` says so."""
    root = Path(cache_root) if cache_root else None
    unusable = _cache.unusable(root) if use_cache else None
    if not use_cache or unusable:
        scan = prefetch.take(path, progress) if prefetch is not None else None
        parsed = from_scan(path, scan, progress, threads)
        if unusable:  # parsed as with --no-cache, and said so (nothing is read from or written there)
            parsed.meta["cache_off"] = f"{unusable}: {path} was parsed without the cache"
        return parsed, False
    warning = ident = None
    _cache.wait_stores()  # an entry this process is still writing (`cache.store_later`) is served once written
    try:
        settled = prefetch.settled(path) if prefetch is not None else None
        later = prefetch.later(path) if prefetch is not None and settled is None else None
        if settled is not None:
            key, source = settled
        elif later is not None:  # a first load of a large uncompressed file: hashed after the scan
            key, source = None, later[2]
        else:
            key, ident = _cache.remembered(path, root)
            source = _cache.source_of_identity(ident)
    except OSError as e:
        raise TraceError(path, f"cannot read: {e.strerror or e}") from None
    if key is not None:
        hit, why = _cache.fetch(path, key, root, source)
        if hit is not None:
            return hit, True
        if why:
            warning = why
    scan = prefetch.take(path, progress) if prefetch is not None else None
    if scan is not None and later is not None:  # the thread scanned the map: hashed beside the analysis
        parsed = from_scan(path, scan, progress)
        _cache.store_later(parsed, partial(_key_of_map, path, root, later[0], later[1]), root, source)
        return parsed, False
    if scan is not None:  # the thread scanned the very bytes it hashed for `key`
        parsed = from_scan(path, scan, progress)
    else:
        try:
            ident = ident or _cache.identity(path)  # taken before the read: a write during it is seen
            # a large uncompressed file memory-mapped (hashed and scanned from the map, never held whole), else read
            raw = map_file(path) if fast_enabled() else None
            if raw is None:
                raw = read_raw(path)
            new_key = _cache.key_of(path, root, raw=raw, ident=ident)
        except OSError as e:
            raise TraceError(path, f"cannot read: {e.strerror or e}") from None
        source = _cache.source_of(raw)
        if new_key != key:  # the file changed since its identity was taken, or the same content is cached under another name
            key = new_key
            hit, why = _cache.fetch(path, key, root, source)
            if hit is not None:
                return hit, True
            warning = why or warning
        holder = [gunzip(path, raw)]
        del raw
        parsed = parse_file(path, data=holder, progress=progress, flows=False, threads=threads)  # it lets the bytes go
    _cache.store(parsed, key, root, source, replace=warning is not None)
    if warning:
        parsed.meta["cache_warning"] = (f"{path}: cache entry {key} rejected ({warning}); "
                                        f"the file was parsed again and the entry replaced")
    return parsed, False


def _key_of_map(path: str, root: Path | None, mapped: Mapped, ident: str) -> str | None:
    """The content key of a file scanned from its map (`cache.store_later`): the hash of the same map, None when
    the file is no longer what was mapped (its stamps moved: the bytes hashed may not be those parsed)."""
    mapped.madvise(mmap.MADV_DONTNEED)  # what the parse read of it since the scan (the hash drops its own pages)
    key = _cache.key_of(path, root, raw=mapped, ident=ident)
    try:
        mapped.check()
    except TraceError:
        return None
    return key


def _worker(args: tuple[str, bool, str | None]) -> tuple[str, Any]:
    path, use_cache, cache_root = args
    try:  # one scanner thread: the pool already runs a process per CPU
        parsed, hit = _parse_one(path, use_cache, cache_root, threads=1)
    except TraceError as e:
        return "error", (e.path, e.problem)
    if use_cache and _cache.unusable(Path(cache_root) if cache_root else None) is None:
        # the parent memory-maps the cache entry instead of receiving the tables by pipe
        return "cached", parsed.meta.get("cache_warning")
    return "parsed", parsed


def _progress(total_bytes: int, n_files: int, show: bool | None):
    """A byte-based bar (per file, and per batch inside one large file); None when not shown."""
    if show is False:
        return None
    from .progress import wanted

    if show is None and (total_bytes < (64 << 20) or not wanted()):  # a terminal, not CI: see progress.py
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency; degrade quietly if absent
        return None
    return tqdm(total=total_bytes, desc=f"loading {n_files} trace file{'s' if n_files > 1 else ''}", unit="B",
                unit_scale=True, file=sys.stderr, leave=False, mininterval=0.2)


def _ticking(results, files, sizes, bar):
    """Results of the worker pool in order, advancing the bar as each file is done (not all at the end)."""
    for f, r in zip(files, results):
        if bar is not None:
            bar.update(sizes[f])
        yield r


def load(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    cache: bool = True,
    cache_dir: str | os.PathLike | None = None,
    jobs: int | None = None,
    progress: bool | None = None,
    prefetch=None,
) -> Trace:
    """Load one or more traces into a `Trace`.

    paths: a trace file, a directory of per-rank trace files, a run directory, or a list of those.
    cache: read/write the cache of parsed files (Arrow IPC) keyed by file content. jobs: parallel processes for many
    files (default: the CPUs this process may use). progress: True/False forces the progress bar; None shows it on a TTY.
    prefetch: a `tracelens.io.prefetch.Prefetch` already reading the file (what `tracelens.load` passes).
    """
    global _largest_load
    files = discover(paths)
    cache_root = os.fspath(cache_dir) if cache_dir else None
    total_bytes = sum(os.path.getsize(f) for f in files)
    _largest_load = max(_largest_load, total_bytes)
    jobs = jobs or usable_cpus()
    parsed: list[ParsedTrace] = []
    sizes = {f: os.path.getsize(f) for f in files}
    bar = _progress(total_bytes, len(files), progress)
    try:
        if len(files) > 1 and jobs > 1 and total_bytes >= PARALLEL_MIN_BYTES:
            # imported here: multiprocessing and the process pool are 13-16 ms of imports a one-file load never uses
            from concurrent.futures import ProcessPoolExecutor
            from multiprocessing import get_context

            ctx = get_context("forkserver") if sys.platform.startswith("linux") else get_context("spawn")
            with ProcessPoolExecutor(max_workers=min(jobs, len(files)), mp_context=ctx) as ex:
                results = list(_ticking(ex.map(_worker, [(f, cache, cache_root) for f in files]), files, sizes, bar))
            for f, (kind, payload) in zip(files, results):
                if kind == "error":
                    raise TraceError(*payload)
                if kind == "cached":
                    p, _ = _parse_one(f, True, cache_root)
                    if payload:
                        p.meta["cache_warning"] = payload
                else:
                    p = payload
                parsed.append(p)
        else:
            for f in files:
                done = [0]

                def tick(fraction: float, f=f, done=done) -> None:
                    step = int(sizes[f] * fraction) - done[0]
                    if bar is not None and step > 0:
                        bar.update(step)
                        done[0] += step

                p, hit = _parse_one(f, cache, cache_root, tick if bar is not None else None, prefetch)
                p.meta["from_cache"] = hit
                parsed.append(p)
                tick(1.0)
    finally:
        if bar is not None:
            bar.close()
    trace = assemble(parsed)
    del parsed
    # Arrow's allocator keeps the buffers the conversion to pandas freed (~40% of the events table's size):
    # hand them back, no analysis uses Arrow memory afterwards (1 GB trace: 784 -> 610 MB after the load)
    give_back_memory()
    if total_bytes >= LEAN_MALLOC_BYTES:  # for the analysis (the load's own peak is the scanner's columns)
        fix_mmap_threshold()
    trace.run_status = trace.run.status()  # trace.run: read when the Trace was made (its ranks' files)
    if trace.run_status and trace.run_status["warning"]:
        trace.warnings.insert(0, trace.run_status["warning"])
    return trace


LEAN_MALLOC_BYTES = 1 << 30  # traces this large (in all) fix glibc's mmap threshold (`fix_mmap_threshold`)
OFFLOAD_MAX_BYTES = 4 << 30  # from traces this large (in all) on, no analysis part is forked (`tracelens.offload`)
_largest_load = 0  # the most bytes of trace one `load` of this process read (`largest_load`)


def largest_load() -> int:
    """The most bytes of trace files one `load` in this process has read (what `tracelens.offload` decides by)."""
    return _largest_load
_MMAP_THRESHOLD = 4 << 20  # arrays over 4 MiB: their own mappings (see fix_mmap_threshold)
_mmap_threshold_fixed = False


def lean_memory() -> bool:
    """Whether this process analyzes a large input (LEAN_MALLOC_BYTES or more: `fix_mmap_threshold` ran),
    where memory comes before speed (from OFFLOAD_MAX_BYTES on, tracelens.offload keeps every analysis in this
    process)."""
    return _mmap_threshold_fixed


def fix_mmap_threshold() -> None:
    """Fix glibc's mmap threshold at 4 MiB for the rest of the process (Linux / glibc only; elsewhere
    nothing happens). glibc raises the threshold to the size of each large block freed (up to 32 MiB),
    after which arrays of up to that size come from the heap, and the heap keeps the pages of freed arrays
    that lie below a live one: after `analyze` of an 8 GB trace 337 MB of RSS were such pages
    (`malloc_trim` handed them back), ~150 MB at 2 GB. With the threshold fixed every array over 4 MiB is
    its own mapping, returned when freed. Measured at 2 GB (analyze + summary, 2-core machine): glibc's
    default 5.4-5.8 s, 1,300 MB peak; 4 MiB 5.6-5.9 s, 1,248 MB; 128 KiB (every array mapped, each one's
    pages faulted in afresh) 6.9 s, 1,244 MB. `load` calls it at its end for inputs of LEAN_MALLOC_BYTES or
    more (the load's own peak is the scanner's columns), so smaller analyses keep glibc's default."""
    global _mmap_threshold_fixed
    if _mmap_threshold_fixed or not sys.platform.startswith("linux"):
        return
    _mmap_threshold_fixed = True
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(ctypes.c_int(-3), ctypes.c_int(_MMAP_THRESHOLD))  # M_MMAP_THRESHOLD (malloc.h)
    except (OSError, AttributeError):  # not glibc (e.g. musl): its allocator, as it is
        pass


def give_back_memory() -> None:
    """Hand the buffers Arrow's allocator keeps after they are freed back to the system (pandas 3 keeps
    string columns there). Called after the load and between the large steps of an analysis, so one
    step's freed string columns do not stay counted in the next one's peak (200 MB trace: 342 -> 304 MB
    peak). (glibc's `malloc_trim` as well was measured: 17 MB less peak at 2 GB for ~8 % more analysis
    time, the trimmed pages being faulted in again; not kept.)"""
    pa.default_memory_pool().release_unused()


def assemble(parsed: Iterable[ParsedTrace]) -> Trace:
    """Assign ranks, check they are consistent, and concatenate per-file tables."""
    parsed = list(parsed)
    warnings: list[str] = []
    issues: list[dict] = []
    infos: list[RankInfo] = []
    for i, p in enumerate(parsed):
        info, w, iss = rank_of(p, i, len(parsed))
        infos.append(info)
        warnings += w
        issues += iss
    warnings += check_ranks(infos)

    order = sorted(range(len(infos)), key=lambda i: infos[i].rank)
    parsed = [parsed[i] for i in order]
    infos = [infos[i] for i in order]
    tables = [p.events for p in parsed]
    for p in parsed:  # the list is the only holder, so to_pandas can free Arrow memory column by column
        p.events = None
    counts = [p.meta.get("tree_rows") for p in parsed]
    events = _concat_ranks(tables, infos, events=True, tree_rows=counts)
    flows = None if any(p.flows is None for p in parsed) else _concat_ranks([p.flows for p in parsed], infos)
    threads = _concat_ranks([p.threads for p in parsed], infos)
    return Trace(events=events, flows=flows, threads=threads, ranks=infos, warnings=warnings,
                 load_issues=_issues_table(issues), tree_rows=sum(counts))


def rank_of(p: ParsedTrace, i: int, n_files: int) -> tuple[RankInfo, list[str], list[dict]]:
    """The rank of the i-th of n_files parsed files (distributedInfo, else the file name, else its
    position), its `RankInfo`, and the warnings / load-issue rows its file adds. The per-file half of
    `assemble`; `tracelens.scale.reduce_rank` uses it on one file at a time."""
    warnings: list[str] = []
    issues: list[dict] = []
    dist = p.meta.get("distributed_info") or {}
    if not isinstance(dist, dict):
        dist = {}
    rank = dist.get("rank")
    named = _rank_from_name(p.path)
    if type(rank) is not int:  # absent or of another type: the file name decides, as before
        rank = None
    elif not 0 <= rank < MAX_RANK:
        raise TraceError(p.path, f"distributedInfo rank {rank} is not a rank (0 <= rank < 2**31)")
    ws = dist.get("world_size")
    if isinstance(ws, (int, float)) and not isinstance(ws, bool) and not (ws == ws and 1 <= ws <= MAX_RANK):
        raise TraceError(p.path, f"distributedInfo world_size {ws!r} is not a world size (1 <= size <= 2**31)")
    if rank is None:
        rank = named
    elif named is not None and named != rank and n_files > 1:
        warnings.append(f"{p.path}: the file name says rank {named} but its distributedInfo says rank {rank}; "
                        f"using rank {rank} (the profiler's own record)")
        issues.append({"rank": rank, "file": p.path, "check": "rank_name_mismatch", "action": "kept",
                       "events": 0, "message": warnings[-1]})
    if rank is None:
        rank = i if n_files > 1 else 0
    if rank >= MAX_RANK:
        raise TraceError(p.path, f"rank {rank} in the file name is not a rank (0 <= rank < 2**31)")
    for issue in p.meta.get("load_issues") or []:
        issues.append({"rank": int(rank), "file": p.path, **issue})
        warnings.append(issue["message"])
    if p.meta.get("cache_off"):
        warnings.append(p.meta["cache_off"])
        issues.append({"rank": int(rank), "file": p.path, "check": "cache_dir", "action": "not cached",
                       "events": 0, "message": p.meta["cache_off"]})
    if p.meta.get("cache_warning"):
        warnings.append(p.meta["cache_warning"])
        issues.append({"rank": int(rank), "file": p.path, "check": "cache_entry", "action": "replaced",
                       "events": 0, "message": p.meta["cache_warning"]})
    info = RankInfo(
        rank=int(rank), path=p.path, device_properties=_device_properties(p.path, p.meta.get("device_properties")),
        distributed_info=dist, base_time_ns=p.meta.get("base_time_ns"),
        n_raw_events=int(p.meta.get("n_raw_events") or 0), from_cache=bool(p.meta.get("from_cache")),
    )
    return info, warnings, issues


# deviceProperties fields the analyses read, and the JSON types the profiler writes them as
_DEVICE_FIELDS = {"name": (str,), "totalGlobalMem": (int, float), "numSms": (int, float), "computeMajor": (int,),
                  "computeMinor": (int,)}


def _device_properties(path: str, props: Any) -> list[dict[str, Any]]:
    """A file's ``deviceProperties``: a list of objects whose fields the analyses read (device name,
    memory, SM count, compute capability) have the profiler's types, null counting as absent. Anything
    else is a `TraceError` naming the file and the field (a list as a name was "unhashable", exit 3)."""
    if props is None:
        return []
    if not isinstance(props, list):
        raise TraceError(path, f"deviceProperties is {_json_type(props)} (expected a list of objects)")
    for i, d in enumerate(props):
        if not isinstance(d, dict):
            raise TraceError(path, f"deviceProperties[{i}] is {_json_type(d)} (expected an object)")
        for key, types in _DEVICE_FIELDS.items():
            v = d.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, types)):
                want = "a string" if types == (str,) else "an integer" if types == (int,) else "a number"
                raise TraceError(path, f"deviceProperties[{i}].{key} is {_json_type(v)} (expected {want})")
    return props


def _json_type(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def check_ranks(infos: list[RankInfo]) -> list[str]:
    """The cross-file half of `assemble`: no rank claimed twice, one world size, ranks below it. Raises
    TraceError naming the offending file; returns the warning for a partial rank set (or none)."""
    warnings: list[str] = []
    seen: dict[int, str] = {}
    for info in infos:
        if info.rank in seen:
            raise TraceError(info.path, f"mismatched ranks: rank {info.rank} is also claimed by {seen[info.rank]}")
        seen[info.rank] = info.path
    sizes = {info.world_size for info in infos if info.world_size is not None}
    if len(sizes) > 1:
        odd = next(i for i in infos if i.world_size is not None and i.world_size != infos[0].world_size)
        raise TraceError(odd.path, f"mismatched ranks: world_size {odd.world_size} here, {infos[0].world_size} in {infos[0].path}")
    if sizes and len(infos) > 1:
        ws = sizes.pop()
        if len(infos) != ws:
            warnings.append(f"{len(infos)} of {ws} ranks loaded; cross-rank analyses cover only these")
        bad = [i for i in infos if i.rank >= ws]
        if bad:
            raise TraceError(bad[0].path, f"mismatched ranks: rank {bad[0].rank} >= world_size {ws}")
    return warnings


LOAD_ISSUE_COLUMNS = ("rank", "file", "check", "action", "events", "message")


def _issues_table(issues: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame([{c: i.get(c) for c in LOAD_ISSUE_COLUMNS} for i in issues], columns=list(LOAD_ISSUE_COLUMNS))
    return df.astype({"rank": "int64", "events": "int64"})


def _concat_ranks(tables: list[pa.Table], infos: list[RankInfo], events: bool = False,
                  tree_rows: list[int | None] | None = None) -> pd.DataFrame:
    """Per-file tables (in the order of `infos`) -> one DataFrame with a `rank` column. Empties
    `tables`, so that its Arrow memory is released while pandas takes the data over. events: the tables
    are events tables: their arg columns come in the narrowest type that holds their values
    (`narrow_args`), and the ranks' call-tree events first (rank by rank, in file order), then their other
    events (io/roworder.py: the call tree shares the columns of these rows). tree_rows: per table, how many
    of its first rows are all its call-tree events, as its parse ordered them (`ParsedTrace.meta`); where
    missing (None), found from the rows and the rows ordered so. Filled in for each table."""
    tabs = [t.append_column("rank", pa.array(np.full(t.num_rows, info.rank, dtype=np.int32)))
            for t, info in zip(tables, infos)]
    tables.clear()
    if events:  # (a file parsed by this loader comes with its call-tree events first already)
        known = list(tree_rows) if tree_rows is not None else [None] * len(tabs)
        parts = []
        tabs.reverse()
        while tabs:
            k = known[len(parts)]
            parts.append((tabs.pop(), k) if k is not None else tree_rows_first([tabs.pop()]))
        if tree_rows is not None:
            tree_rows[:] = [k for _, k in parts]
        tabs = ([t for t, _ in parts] if len(parts) == 1 else
                [t.slice(0, k) for t, k in parts] + [t.slice(k) for t, k in parts])
        del parts
    table = tabs[0] if len(tabs) == 1 else pa.concat_tables(tabs, promote_options="permissive")
    del tabs
    multi = [i for i, f in enumerate(table.schema) if pa.types.is_dictionary(f.type) and table.column(i).num_chunks > 1]
    if multi:  # one dictionary for all chunks; codes in int32 first (a file's may be int8: too narrow for the union)
        for i in multi:
            f = table.schema.field(i)
            if f.type.index_type.bit_width < 32:
                table = table.set_column(i, f.name, table.column(i).cast(pa.dictionary(pa.int32(), f.type.value_type)))
        table = table.unify_dictionaries()
    if events:
        table = narrow_args(table)
    # (the categoricals' checks that their categories are unique built a lookup table of each: not kept)
    return forget_lookups(table.to_pandas(split_blocks=True, self_destruct=True))


"""The compiled scanner's Python side: read a trace's bytes and run `_kineto_fast.Parser` over them.

Kept to the standard library and the extension (no numpy, pyarrow or pandas), so `tracelens.load`
can start reading and scanning a large file in a thread within milliseconds of being called, while
the rest of the toolkit imports (`prefetch.py`). Turning a finished scan into tables is
`kineto._parse_fast`'s job.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
import zlib

from ..errors import TraceError
from .limits import gunzip_bounded, max_trace_bytes
from .schema import _GROUPS, ARG_FIELDS, CAT_GROUP

LAYOUT = 3  # the layout of `Parser.result()` this module reads (LAYOUT in _kineto_fast.c)

try:  # the compiled fast path; optional (see setup.py)
    from . import _kineto_fast
except ImportError as _e:  # pragma: no cover - depends on the install
    _kineto_fast = None
    _FAST_MISSING = f"compiled scanner not built ({_e})"
else:
    _FAST_MISSING = ""
    if getattr(_kineto_fast, "LAYOUT", 1) != LAYOUT:  # built from another version of _kineto_fast.c
        _FAST_MISSING = (f"compiled scanner out of date (layout {getattr(_kineto_fast, 'LAYOUT', 1)}, "
                         f"this tracelens reads {LAYOUT}; rebuild: make install, or python setup.py build_ext --inplace)")
        _kineto_fast = None


def read_bytes(path: str) -> bytes:
    """The file's JSON bytes, gunzipped when it is gzip (by magic, not by name)."""
    return gunzip(path, read_raw(path))


CHANGED_WHILE_READ = ("changed while it was read (another process is writing or truncating it); "
                      "load it again once it is complete")


def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def read_raw(path: str) -> bytes:
    """The file's bytes as stored; a `TraceError` naming it when it changed while it was read (its size,
    mtime or ctime moved: an in-place rewrite would otherwise give a mix of both versions)."""
    try:
        with open(path, "rb") as f:
            before = _stamp(os.fstat(f.fileno()))
            data = f.read()
            after = _stamp(os.fstat(f.fileno()))
    except OSError as e:
        raise TraceError(path, f"cannot read: {e.strerror or e}") from None
    if after != before or len(data) != before[1]:
        raise TraceError(path, CHANGED_WHILE_READ)
    return data


def gunzip(path: str, data: bytes) -> bytes | bytearray:
    """`data` decompressed when it is gzip (by magic, not by name), else `data` itself. The output is
    bounded (`limits.gunzip_bounded`: TRACELENS_MAX_TRACE_BYTES, and the memory available): a file that
    expands past it is refused naming the file, before it takes the machine."""
    if data[:2] == b"\x1f\x8b":
        try:
            data = gunzip_bounded(path, data, max_trace_bytes(), "not a trace this loader takes "
                                  "(TRACELENS_MAX_TRACE_BYTES=N raises the bound)", memory=True)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(path, f"corrupt or truncated gzip ({e})") from None
    return data


MAP_MIN = 64 << 20  # an uncompressed file this large is scanned from a memory map (see `map_file`)


class Mapped(mmap.mmap):
    """A memory-mapped trace file and what it was when mapped (`stamp`), to tell whether it changed since."""

    path: str = ""
    stamp: tuple = ()

    def check(self) -> None:
        """`TraceError` (changed while it was read) when the file is no longer what was mapped."""
        try:
            now = _stamp(os.stat(self.path))
        except OSError:
            now = ()
        if now != self.stamp or self.size() < len(self):
            raise TraceError(self.path, CHANGED_WHILE_READ)


def map_file(path: str) -> Mapped | None:
    """The file memory-mapped read-only when it is large (>= MAP_MIN) and not gzip, else None.

    `Scan.run` gives the pages it has scanned back behind itself (MADV_DONTNEED: a file-backed page
    that is read again is read from the page cache), so the file's bytes never sit in the process
    whole: a 2 GB trace costs the columns, not 2 GB + the columns. A file truncated by another process
    while it is mapped would kill the process (SIGBUS) when a page past its new end is touched: the
    compiled scanner's pass (nearly all the time the map is read) runs under a SIGBUS guard that turns
    that into an error, and the file is checked (`Mapped.check`: size, mtime, ctime) after the pass,
    before the few reads of it from Python, so the load ends in one line naming the file ("changed while
    it was read"). TRACELENS_NO_MMAP=1 reads the file into memory instead."""
    if os.environ.get("TRACELENS_NO_MMAP"):
        return None
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_size < MAP_MIN or f.read(2) == b"\x1f\x8b":
                return None
            mm = Mapped(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None  # the ordinary read names the problem
    mm.path, mm.stamp = path, _stamp(st)
    mm.madvise(mmap.MADV_SEQUENTIAL)
    return mm


def release_pages(mm: mmap.mmap, lo: int, hi: int) -> int:
    """Drop the process's pages of mm[lo:hi] (rounded inward to pages); returns the new low mark."""
    lo -= lo % mmap.PAGESIZE
    hi -= hi % mmap.PAGESIZE
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        return hi
    return lo


FAST_FEED = 65536  # events per call into the scanner: the progress callback's granularity


def decoder() -> str:
    """Which decoder `parse_file` uses, for `tracelens --version` and bug reports."""
    if _kineto_fast is None:
        return f"msgspec ({_FAST_MISSING})"
    if os.environ.get("TRACELENS_PURE_PYTHON"):
        return "msgspec (TRACELENS_PURE_PYTHON is set)"
    return "compiled scanner (tracelens.io._kineto_fast), msgspec for files it does not take"


def _fast_spec() -> tuple:
    cols = list(ARG_FIELDS)
    groups = list(_GROUPS)
    kind_code = {"int": "i", "str": "s", "raw": "r", "float": "f"}
    return (
        tuple(key.encode() for key, _ in ARG_FIELDS.values()),
        "".join(kind_code[k] for _, k in ARG_FIELDS.values()).encode(),
        tuple((cat.encode(), groups.index(g)) for cat, g in CAT_GROUP.items()),
        tuple(sum(1 << cols.index(c) for c in _GROUPS[g]) for g in groups),
    )


_FAST_SPEC = _fast_spec()


def fast_enabled() -> bool:
    return _kineto_fast is not None and not os.environ.get("TRACELENS_PURE_PYTHON")


# One file's scan in parallel parts (see the top of _kineto_fast.c): a part's guessed start is an object
# behind "}," that begins with an event's key (a nested object in args rarely does; a guess that is not
# an event start costs only its part's parallelism, never a wrong table).
PARALLEL_MIN = 32 << 20  # bytes: smaller documents are scanned by one thread
PART_MIN = 16 << 20  # bytes per part at least
MAX_PARTS = 8
_PART_START = re.compile(rb'\}[ \t\r\n]*,[ \t\r\n]*\{[ \t\r\n]*"(?:ph|cat|name|pid|tid|ts|dur|id|args|bp|s)"[ \t\r\n]*:')


def usable_cpus() -> int:
    """CPUs this process may run on: the affinity mask (taskset, cgroup cpusets), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def scan_threads(size: int) -> int:
    """Threads that scan a document of `size` bytes: one per usable CPU, at most MAX_PARTS, each part at
    least PART_MIN bytes; 1 below PARALLEL_MIN. TRACELENS_SCAN_THREADS=N forces N (1: one thread)."""
    forced = os.environ.get("TRACELENS_SCAN_THREADS")
    if forced:
        try:
            return max(1, min(int(forced), 64))
        except ValueError:
            pass
    if size < PARALLEL_MIN:
        return 1
    return max(1, min(usable_cpus(), MAX_PARTS, size // PART_MIN))


class Scan:
    """One document through the compiled scanner; `run` releases the GIL while it scans, so a thread
    can run it while the caller does other work (`tracelens/io/prefetch.py`), and a large document is
    scanned in parallel parts, one thread each (`scan_threads`)."""

    def __init__(self, data: bytes):
        self.data = data
        self.parser = _kineto_fast.Parser(data, *_FAST_SPEC)
        self.parts: list = []  # the forked parsers of a parallel scan, while it runs
        self.parts_used = 0  # parts the result was scanned in (a guessed start no parser landed on is not one)
        self.result: dict | None = None
        self.error: str | None = None  # why the scanner did not take the file
        self._stop = False  # set when the first part failed: the other parts stop early

    @property
    def fraction(self) -> float:
        parser, parts = self.parser, self.parts  # read once: the scanning threads let them go when done
        if parser is None:
            return 1.0
        done = parser.position + sum(max(0, p.position - p.start) for p in parts)
        return min(1.0, done / max(1, len(self.data)))

    def part_starts(self, n: int) -> list[int]:
        """Up to n - 1 guessed event starts that cut the events array into n parts of similar size."""
        lo, size = self.parser.events_start, len(self.data)
        starts: list[int] = []
        if lo < 0:
            return starts
        for k in range(1, n):
            m = _PART_START.search(self.data, lo + (size - lo) * k // n)
            if m is None:
                break
            s = m.start() + m.group().index(b"{")
            if not starts or s > starts[-1]:
                starts.append(s)
        return starts

    def run(self, progress=None, threads: int | None = None) -> None:
        """Scan the whole document (`result`, or `error` naming what the scanner does not take).
        threads: parts scanned in parallel (default `scan_threads`; 1 for one thread)."""
        mapped = self.data if isinstance(self.data, mmap.mmap) else None
        first = self.parser
        workers: list[threading.Thread] = []
        try:
            n = scan_threads(len(self.data)) if threads is None else max(1, int(threads))
            starts: list[int] = []
            if n > 1:
                first.feed(0)  # locate the events array
                starts = self.part_starts(n)
            if starts:
                self.parts = parts = [first.fork(s) for s in starts]
                first.set_limits(starts)
                for k, part in enumerate(parts):
                    part.set_limits(starts[k + 1:])
                    workers.append(threading.Thread(target=self._feed, args=(part, mapped), daemon=True,
                                                    name=f"tracelens-scan-{k + 1}"))
                for w in workers:
                    w.start()
            try:
                self._feed(first, mapped, progress)
            except _kineto_fast.Unsupported:
                self._stop = True
                raise
            for w in workers:
                w.join()
            at = {p.start: p for p in self.parts}
            used = 1
            while first.stopped_at >= 0:  # the confirmed parts, in order (the others are not used)
                first.absorb(at[first.stopped_at])
                used += 1
            self.result = first.result()
            self.parts_used = used
        except _kineto_fast.Unsupported as e:
            self.error = str(e)
        finally:
            self._stop = True
            for w in workers:
                w.join()
            self.parts = []
        if mapped is not None:
            release_pages(mapped, 0, len(mapped))
        self.parser = None

    def _feed(self, parser, mapped: mmap.mmap | None, progress=None) -> None:
        """Feed one part to its end (or hand-off). In a part's own thread an Unsupported stays in its
        parser, which `absorb` raises again if the part is used."""
        dropped = parser.start
        try:
            while not parser.feed(FAST_FEED) and not (self._stop and parser is not self.parser):
                if mapped is not None:  # pages behind the scan go back (re-read from the page cache if needed)
                    dropped = release_pages(mapped, dropped, parser.position)
                if progress is not None:
                    progress(self.fraction)
        except _kineto_fast.Unsupported:
            if parser is self.parser:
                raise

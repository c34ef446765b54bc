"""The compiled scanner's Python side: read a trace's bytes and run `_kineto_fast.Parser` over them.

Kept to the standard library and the extension (no numpy, pyarrow or pandas), so `tracelens.load`
can start reading and scanning a large file in a thread within milliseconds of being called, while
the rest of the toolkit imports (`prefetch.py`). Turning a finished scan into tables is
`kineto._parse_fast`'s job.
"""

from __future__ import annotations

import gzip
import mmap
import os
import zlib

from ..errors import TraceError
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


def read_raw(path: str) -> bytes:
    """The file's bytes as stored."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TraceError(path, f"cannot read: {e.strerror or e}") from None


def gunzip(path: str, data: bytes) -> bytes:
    """`data` decompressed when it is gzip (by magic, not by name), else `data` itself."""
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(path, f"corrupt or truncated gzip ({e})") from None
    return data


MAP_MIN = 64 << 20  # an uncompressed file this large is scanned from a memory map (see `map_file`)


def map_file(path: str) -> mmap.mmap | None:
    """The file memory-mapped read-only when it is large (>= MAP_MIN) and not gzip, else None.

    `Scan.run` gives the pages it has scanned back behind itself (MADV_DONTNEED: a file-backed page
    that is read again is read from the page cache), so the file's bytes never sit in the process
    whole: a 2 GB trace costs the columns, not 2 GB + the columns. The price of any memory map: a
    file truncated by another process during the scan kills the process (SIGBUS), as it would with
    numpy.memmap or pyarrow.memory_map. TRACELENS_NO_MMAP=1 reads the file into memory instead."""
    if os.environ.get("TRACELENS_NO_MMAP"):
        return None
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < MAP_MIN or f.read(2) == b"\x1f\x8b":
                return None
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None  # the ordinary read names the problem
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


class Scan:
    """One document through the compiled scanner; `run` releases the GIL while it scans, so a thread
    can run it while the caller does other work (`tracelens/io/prefetch.py`)."""

    def __init__(self, data: bytes):
        self.data = data
        self.parser = _kineto_fast.Parser(data, *_FAST_SPEC)
        self.result: dict | None = None
        self.error: str | None = None  # why the scanner did not take the file

    @property
    def fraction(self) -> float:
        parser = self.parser  # read once: the scanning thread lets it go when done
        return 1.0 if parser is None else min(1.0, parser.position / max(1, len(self.data)))

    def run(self, progress=None) -> None:
        mapped = self.data if isinstance(self.data, mmap.mmap) else None
        dropped = 0
        try:
            while not self.parser.feed(FAST_FEED):
                if mapped is not None:  # pages behind the scan go back (re-read from the page cache if needed)
                    dropped = release_pages(mapped, dropped, self.parser.position)
                if progress is not None:
                    progress(self.fraction)
            self.result = self.parser.result()
        except _kineto_fast.Unsupported as e:
            self.error = str(e)
        if mapped is not None:
            release_pages(mapped, 0, len(mapped))
        self.parser = None

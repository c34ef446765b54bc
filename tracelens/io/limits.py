"""Bounds on what one input file may cost, and the bounded gunzip both trace and pipeline files go through.

A small file must not be able to take the machine: a 21 MB `.json.gz` can expand to 20 GiB, and one
100 MB op name would be copied into every table and report. Each bound here is stated in
docs/robustness.md with what a user sees past it. Standard library only (`prefetch.py` and `run.py`
import it before numpy, pyarrow or pandas load).
"""

from __future__ import annotations

import os
import zlib

from ..errors import TraceError

# Decompressed bytes of one `.json.gz` trace. A Kineto trace of 8 GB is the largest seen; 32 GiB leaves
# room while still refusing a "zip bomb". TRACELENS_MAX_TRACE_BYTES=N (bytes) raises or lowers it.
MAX_TRACE_BYTES_DEFAULT = 32 << 30
# Bytes of one op/kernel name (or category) kept by the loader; a longer one is cut to this and the cut is
# recorded as a load issue. Real names reach ~5 KiB (C++ templated CUDA kernels: 5,123 bytes in an HTA
# fixture); 64 KiB is 12x that, while a 100 MB name no longer becomes a 1 GB report.
MAX_NAME_BYTES = 64 << 10

_CHUNK = 64 << 20  # bytes decompressed per step


def max_trace_bytes() -> int:
    """The decompressed-size bound of one trace file (TRACELENS_MAX_TRACE_BYTES, else 32 GiB). A value that is not
    a whole number of bytes above 0 is a `TraceError` naming the variable (it was ignored: the bound a user set to
    refuse large files silently did not hold)."""
    v = os.environ.get("TRACELENS_MAX_TRACE_BYTES", "").strip()
    if not v:
        return MAX_TRACE_BYTES_DEFAULT
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise TraceError(None, f"TRACELENS_MAX_TRACE_BYTES={v[:40]!r}: expected a whole number of bytes above 0 "
                               "(unset it for the default, 32 GiB)")
    return n


def available_memory() -> int | None:
    """Bytes this process can still take: MemAvailable, lowered by a cgroup (v2) limit when one is set;
    None where neither can be read."""
    avail = None
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", "rb") as f:
            cap = f.read().strip()
        if cap != b"max":
            with open("/sys/fs/cgroup/memory.current", "rb") as f:
                room = int(cap) - int(f.read().strip())
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return None if avail is None else max(0, avail)


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def gunzip_bounded(path, data: bytes, limit: int, what: str, memory: bool = False) -> bytearray:
    """gunzip ``data`` (every member), refusing with a `TraceError` naming ``path`` once the output passes
    ``limit`` bytes (``what``: the kind of file, for the message) or, with ``memory``, the memory
    available when it starts (`available_memory`): a file that cannot fit is refused before it takes the
    machine, not after. The output grows in place (a bytearray: no second copy at the end).
    Raises EOFError / zlib.error for a truncated or corrupt stream (the callers name the file)."""
    room = available_memory() if memory else None
    cap = limit if room is None else min(limit, room)
    out = bytearray()
    while data:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        while True:
            chunk = d.decompress(data, max(1, min(cap + 1 - len(out), _CHUNK)))
            out += chunk
            if len(out) > cap:
                del out, chunk
                if cap < limit:
                    raise TraceError(path, f"expands to more than the {_size(cap)} of memory available when "
                                           f"decompressing it; decompress it on a larger machine or free memory")
                raise TraceError(path, f"expands to more than {_size(limit)} when decompressed: {what}")
            data = d.unconsumed_tail
            if d.eof or (not data and not chunk):  # (input used up: flushed until nothing more comes)
                break
        if not d.eof:
            raise EOFError("compressed file ended before the end-of-stream marker was reached")
        data = d.unused_data
    return out

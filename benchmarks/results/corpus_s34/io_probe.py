"""Stop 34, issue 37: what a page costs on this host. The scan reads a 200 MB trace from a memory map, page by page,
and gives the pages back behind itself; on the device (gVisor) our command's load takes ~1.8x the dev machine's
time. This times, on FILE (in the page cache: read once first), medians of 3:
  map_touch     the scan's pattern: mmap, MADV_SEQUENTIAL, one byte a page, MADV_DONTNEED behind, 16 MB windows
  map_populate  the same with MADV_POPULATE_READ (22) on each window before it is touched (one call per window)
  read_reuse    readinto a reused 16 MB buffer (no new pages after the first window)
  read_whole    f.read() of the whole file (the TRACELENS_NO_MMAP path)
  anon_touch    a fresh anonymous array of the file's size, one write a page (what new columns cost)
Usage: python io_probe.py FILE"""

import mmap
import statistics
import sys
import time

import numpy as np

W = 16 << 20
PAGE = mmap.PAGESIZE
POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def touch(buf) -> int:
    return int(np.frombuffer(buf, np.uint8)[::PAGE].sum())


def map_touch(path: str, populate: bool = False) -> None:
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mm.madvise(mmap.MADV_SEQUENTIAL)
    n = len(mm)
    for lo in range(0, n, W):
        hi = min(n, lo + W)
        if populate:
            mm.madvise(POPULATE_READ, lo, hi - lo)
        touch(memoryview(mm)[lo:hi])
        end = hi - hi % PAGE
        if end > lo:
            mm.madvise(mmap.MADV_DONTNEED, lo, end - lo)
    mm.close()


def read_reuse(path: str) -> None:
    buf = bytearray(W)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            touch(buf)


def read_whole(path: str) -> None:
    with open(path, "rb") as f:
        touch(f.read())


def anon_touch(path: str) -> None:
    import os

    a = np.empty(os.path.getsize(path), np.uint8)
    a[::PAGE] = 1


def main() -> None:
    path = sys.argv[1]
    read_whole(path)  # into the page cache
    cases = {"map_touch": lambda: map_touch(path), "map_populate": lambda: map_touch(path, True),
             "read_reuse": lambda: read_reuse(path), "read_whole": lambda: read_whole(path),
             "anon_touch": lambda: anon_touch(path)}
    for name, fn in cases.items():
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            try:
                fn()
            except OSError as e:
                print(f"{name:13s} failed: {e}")
                break
            ts.append(time.perf_counter() - t)
        if ts:
            print(f"{name:13s} {statistics.median(ts) * 1e3:8.1f} ms  (runs {', '.join(f'{t * 1e3:.1f}' for t in ts)})")


if __name__ == "__main__":
    main()

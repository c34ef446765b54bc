"""The host's speed in three numbers, so that timings from different device hosts can be told apart (stop 34: the
same code took 14.8 s on one 1 x H200 host and 24.7 s on another for the 2 GB a100_triton tile; HTA's times move
with the host too). Run pinned like the benchmark it goes with (`taskset -c 2,3 python benchmarks/host_speed.py`);
prints one line:
  python_s  a pure-Python loop (10 M iterations of an add and a compare): the interpreter's speed
  sort_s    np.sort of 16 M float64: one core's memory and SIMD speed
  fault_s   touching 512 MiB of fresh anonymous pages, one write a page: what a page fault costs here
medians of 3."""

import statistics
import time

import numpy as np


def _python() -> None:
    t = 0
    for i in range(10_000_000):
        if i & 1:
            t += i


def _sort(a: np.ndarray) -> None:
    np.sort(a)


def _fault() -> None:
    b = np.empty(512 << 20, np.uint8)
    b[::4096] = 1


def main() -> None:
    a = np.random.default_rng(0).random(16 << 20)
    out = []
    for name, fn in (("python_s", _python), ("sort_s", lambda: _sort(a)), ("fault_s", _fault)):
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out.append(f"{name} {statistics.median(ts):.3f}")
    print("host speed: " + " ".join(out))


if __name__ == "__main__":
    main()

"""The C allocator's settings for the `tracelens` program's own process: glibc malloc's `mallopt`, set once by
`tracelens.cli.entry` before any thread starts. Never by the library: a program that imports tracelens keeps its
own allocator as it set it.

Why. An analysis of a large trace allocates and frees columns of tens of MB many times over, from several threads.
With glibc's defaults the free top of the heap goes back to the OS past 128 KB (M_TRIM_THRESHOLD) and the heap
grows again in small steps (M_TOP_PAD 128 KB), and each thread can take an arena of its own (up to 8 per CPU): the
next column's pages are new ones, each faulted in again, 4 KB at a time. A fault costs more on the device machine's
CPU (a gVisor sandbox) than on a plain kernel. Measured there (stop 34, `benchmarks/results/corpus_s34/
ab_malloc.sh`: `tracelens analyze` on two pinned CPUs, the settings below as MALLOC_* variables, two runs each):

| input | defaults | these settings |
|---|---|---|
| 2 GB `a100_triton` tile (800,000 steps) | 22.1, 18.4 s; 1.66 M faults; 1,744 MiB | 17.0, 16.9 s; 0.95-1.12 M faults; 1,786-1,801 MiB |
| 200 MB `mi300_sglang` tile | 1.79, 1.34 s; 284-288 MiB | 1.32, 1.46 s; 345-354 MiB |

The price is memory the process keeps for reuse instead of giving it back: up to TRIM_THRESHOLD of free heap
(RSS +40-70 MB on those inputs), never more than the process's own peak would have needed again.

TRACELENS_MALLOC=default keeps glibc's defaults; so does any MALLOC_* variable or GLIBC_TUNABLES in the environment
(the user's own settings win). Elsewhere than glibc (macOS, musl) nothing is set."""

from __future__ import annotations

import os

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_ARENA_MAX = -8

TOP_PAD = 256 << 20  # the heap grows by this much beyond a request (the pages are touched only when used)
TRIM_THRESHOLD = 512 << 20  # free heap at its top up to this much stays with the process


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _glibc() -> bool:
    """Whether this process's C library is glibc (its confstr answers; `platform.libc_ver` costs an import of
    `platform` at the program's start)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # (not POSIX, or a C library without the name)
        return False


def wanted(environ: dict[str, str] | None = None, cpus: int | None = None) -> dict[int, int]:
    """The mallopt settings this process should get ({parameter: value}; empty: keep the defaults)."""
    env = os.environ if environ is None else environ
    if env.get("TRACELENS_MALLOC", "").strip().lower() in ("default", "0", "off", "no"):
        return {}
    if "GLIBC_TUNABLES" in env or any(k.startswith("MALLOC_") for k in env):
        return {}
    n = _usable_cpus() if cpus is None else cpus
    # arenas: one per usable CPU (at least 2), not glibc's 8 per CPU: the threads that allocate (the scan's parts,
    # the prefetch, the writers) number about the CPUs they run on
    return {M_TOP_PAD: TOP_PAD, M_TRIM_THRESHOLD: TRIM_THRESHOLD, M_ARENA_MAX: max(2, n)}


def set_for_program(environ: dict[str, str] | None = None) -> dict[int, bool]:
    """Apply `wanted` through glibc's mallopt; {parameter: whether mallopt took it}. Nothing (empty) where the C
    library is not glibc, or mallopt cannot be found."""
    settings = wanted(environ)
    if not settings or not _glibc():
        return {}
    import ctypes  # (here: the program's start pays for it only where it is used)

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return {param: bool(mallopt(param, value)) for param, value in settings.items()}

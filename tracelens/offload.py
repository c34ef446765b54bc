"""Run an independent analysis in a forked child on a CPU the analysis would leave idle.

An analysis of one trace is single-threaded Python over pandas/numpy (the GIL serializes threads, which
was measured: no gain). Several of its parts are independent of each other once their inputs exist (the
pipeline account needs only the trace; the roofline and the step decomposition need only the core tables
that `summary`'s other sections also read). `submit(fn, *args)` forks: the child inherits the tables
copy-on-write (no copy, no pickling of the inputs), computes `fn(*args)` and sends back only the result
(pickled, kilobytes: a few summary tables); the parent goes on with the other parts meanwhile and collects
it with `Task.result()`.

The result is the one the parent would have computed: `fn` is a pure function of data the child sees as
it was at the fork. Whatever goes wrong in the child (an exception, a result that does not pickle, a
crash, a child that stops making progress) makes `result()` compute `fn(*args)` in the parent instead,
so errors surface as they would without the child, with their own traceback.

When it forks (`plan`): Linux (fork is not safe on macOS and absent on Windows), at least 2 usable CPUs
(affinity mask and cgroup quota), a trace large enough that the fork's ~6 ms pays off (MIN_EVENTS), not
an input of 4 GiB or more (`trace.OFFLOAD_MAX_BYTES`: the bounded-memory case of the 8 GB traces, where the
child's temporaries and copy-on-write copies would raise the peak), and memory to spare for the child
(MemAvailable at least the parent's resident size).
TRACELENS_OFFLOAD=0 never forks, =1 forks whenever fork is possible (tests), unset decides as above.
Nothing is forked from inside a child.
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import sys
import time
import warnings
import weakref
from typing import Any, Callable

MIN_EVENTS = 150_000  # below this, an analysis part takes less than the fork and the child's start cost
STALL_S = 10.0  # a child that used no CPU time for this long while not done is stuck: compute in the parent
_in_child = False


def _cpu_quota() -> float | None:
    """CPUs the cgroup (v2 cpu.max) grants this process, None when unlimited or unknown."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def plan(events: int) -> tuple[bool, str]:
    """(fork?, why): whether `submit` forks for an analysis of a trace of `events` rows."""
    mode = os.environ.get("TRACELENS_OFFLOAD", "").strip()
    if mode == "0":
        return False, "TRACELENS_OFFLOAD=0"
    if _in_child:
        return False, "already in an offloaded child"
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False, f"no safe fork on {sys.platform}"
    if mode == "1":
        return True, "TRACELENS_OFFLOAD=1"
    from .io.scanner import usable_cpus

    cpus = usable_cpus()
    quota = _cpu_quota()
    if cpus < 2 or (quota is not None and quota < 1.5):
        return False, f"one usable CPU (affinity {cpus}, cgroup quota {quota})"
    if events < MIN_EVENTS:
        return False, f"{events:,} events: below {MIN_EVENTS:,}, forking costs more than it saves"
    from .trace import OFFLOAD_MAX_BYTES, largest_load

    if largest_load() >= OFFLOAD_MAX_BYTES:
        # a child's temporaries and the copy-on-write copies of pages the parent rewrites meanwhile add to
        # the run's memory (measured on the process tree's PSS: +12 % at 2 GB, +10 % at 8 GB, over the
        # 4 GB bound there), and a very large input is the bounded-memory case. (At 2 GB the largest process
        # stays the parent: 1.61-1.64 GB peak RSS with or without the children, issue 37's third pass.)
        return False, "a large input (4 GiB or more): memory before speed"
    avail = _mem_available()
    if avail is not None and avail < _rss():
        return False, "not enough available memory for a second process"
    return True, "idle CPU"


class Task:
    """One part of an analysis, running in a forked child (or, when no child runs, computed on `result()`)."""

    def __init__(self, fn: Callable[..., Any], args: tuple, pid: int | None = None, fd: int | None = None):
        self.fn, self.args = fn, args
        self.pid, self.fd = pid, fd
        self.forked = pid is not None
        self.fallback: str | None = None  # why the parent computed it after all (None: the child's result)
        self._done = False
        self._value: Any = None
        # a Task dropped uncollected (the parent's part raised, ^C): its result is not wanted, the child goes
        self._finalizer = weakref.finalize(self, _reap, pid, fd, True) if pid is not None else None

    def result(self) -> Any:
        """The value of fn(*args): the child's, or computed here when there is none. Exceptions of fn raise."""
        if not self._done:
            ok, value = self._collect() if self.pid is not None else (False, None)
            if not ok:
                value = self.fn(*self.args)
            self._value, self._done = value, True
            self.fn = self.args = None  # type: ignore[assignment]  # the inputs may be large: drop them
        return self._value

    def _collect(self) -> tuple[bool, Any]:
        chunks: list[bytes] = []
        last_cpu, last_change = _cpu_ticks(self.pid), time.monotonic()
        stuck = False
        try:
            while True:
                ready, _, _ = select.select([self.fd], [], [], 1.0)
                if ready:
                    b = os.read(self.fd, 1 << 20)
                    if not b:
                        break
                    chunks.append(b)
                    last_change = time.monotonic()
                    continue
                cpu = _cpu_ticks(self.pid)
                if cpu != last_cpu:
                    last_cpu, last_change = cpu, time.monotonic()
                elif time.monotonic() - last_change > STALL_S:
                    stuck = True
                    break
        finally:
            self._finalizer.detach()
            _reap(self.pid, self.fd, kill=stuck)
            self.pid = self.fd = None
        if stuck:
            self.fallback = f"the child used no CPU for {STALL_S:g} s"
            return False, None
        try:
            ok, value = pickle.loads(b"".join(chunks))
        except Exception as e:  # noqa: BLE001 - a truncated result (the child died): compute here
            self.fallback = f"no result from the child ({type(e).__name__})"
            return False, None
        if not ok:
            self.fallback = f"in the child {value}"  # (an exception raises again here, with its traceback)
        return ok, value


def _cpu_ticks(pid: int | None) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def _reap(pid: int | None, fd: int | None, kill: bool = False) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    if pid is None:
        return
    try:
        if kill and os.waitpid(pid, os.WNOHANG) == (0, 0):  # still running, and still ours (no pid reuse)
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ChildProcessError, ProcessLookupError):  # reaped already (e.g. SIGCHLD ignored by the application)
        pass


class Shared:
    """Jobs that either side of a `submit` may run: whichever process is free first takes the next one (`take`).

    Made before the fork: a pipe holding one byte per job, its write end closed, its read end non-blocking and
    inherited by the child; a read of one byte is atomic, so each job goes to exactly one process, and an empty
    pipe (end of file) means none is left. Without a child the process that asks takes every job. A job the
    child took is only done if the child's result arrives: the caller does whatever is missing after the join."""

    def __init__(self, jobs: int):
        if not 0 <= jobs <= 255:
            raise ValueError(f"{jobs} jobs: one byte each, at most 255")
        self.jobs = jobs
        self._next = 0  # where no pipe could be made: handed out in order by this process
        self._fd: int | None = None
        if jobs and sys.platform.startswith("linux"):
            try:
                r, w = os.pipe()
            except OSError:
                return
            try:
                os.write(w, bytes(range(jobs)))
            finally:
                os.close(w)
            os.set_blocking(r, False)
            self._fd = r
            self._finalizer = weakref.finalize(self, os.close, r)

    def take(self) -> int | None:
        """The next job's index, or None when every job has been taken (here or in the other process)."""
        if self._fd is None:
            if self._next >= self.jobs:
                return None
            self._next += 1
            return self._next - 1
        try:
            b = os.read(self._fd, 1)
        except BlockingIOError:  # (cannot happen once the write end is closed; treated as none left)
            return None
        return b[0] if b else None


def submit(fn: Callable[..., Any], *args: Any, events: int, worth: bool = True) -> Task:
    """Start fn(*args) in a forked child when `plan(events)` says so; else (or when the caller knows it is
    not `worth` a process, e.g. a part with nothing to do on this trace) a Task computed on `result()`."""
    go = worth and plan(events)[0]
    if not go:
        return Task(fn, args)
    from .io.cache import wait_stores

    wait_stores(tables_only=True)  # a cache entry written beside the analysis: not forked mid-write (Arrow)
    r, w = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # buffered output must not be written twice
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    with warnings.catch_warnings():
        # Python >= 3.12 warns on fork() when native threads exist; here they are idle pools (Arrow's,
        # OpenBLAS', jemalloc's) that fork safely, and the child runs only `fn`, then _exit()s
        warnings.filterwarnings("ignore", message=r".*multi-threaded.*fork", category=DeprecationWarning)
        # every object the parent has goes into the collector's permanent generation for the fork, so that the
        # child's collections never visit (and so write the headers of, copying their pages) the parent's
        # objects: a child's gen-2 collection otherwise touches every page holding a container object (measured
        # on a 200 MB h100_moe_mbs8 tile: the summary's child 16.5k -> 12.7k minor page faults). The parent
        # gives them back to its oldest generation right after
        gc.freeze()
        try:
            pid = os.fork()
        except OSError:
            gc.unfreeze()
            os.close(r)
            os.close(w)
            return Task(fn, args)
    if pid != 0:
        gc.unfreeze()
    if pid == 0:  # the child: compute, send, leave without running the parent's exit handlers
        global _in_child
        _in_child = True
        code = 0
        try:
            os.close(r)
            try:
                value = fn(*args)
            except BaseException as e:  # noqa: BLE001 - the parent computes it again and raises it there
                payload = pickle.dumps((False, f"it raised {type(e).__name__}"))
            else:
                try:
                    payload = pickle.dumps((True, value), protocol=pickle.HIGHEST_PROTOCOL)
                except BaseException as e:  # noqa: BLE001
                    payload = pickle.dumps((False, f"its result does not pickle ({type(e).__name__})"))
            view = memoryview(payload)
            while view:
                view = view[os.write(w, view):]
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return Task(fn, args, pid=pid, fd=r)

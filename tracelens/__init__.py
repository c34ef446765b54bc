"""tracelens: read PyTorch (Kineto) traces into columnar tables and explain where the time went.

Scriptable API (the CLI and the reports are thin layers over it):

    import tracelens
    trace = tracelens.load("runs/demo")      # a trace file, a directory of rank files, or a run dir
    result = tracelens.analyze(trace)        # timeline, call tree, ops/kernels/category tables
    result.summary()                         # the summary.json machine interface
    many = tracelens.analyze_ranks("runs/big", workers=8)   # rank by rank on Dask (tracelens.scale)

torch is never imported here: analyzing traces needs only pandas, pyarrow and msgspec. Importing the
package is light: pandas and the analyses load on first use of `Trace`, `Analysis` or `analyze`, or
inside `load`, which first starts reading a large trace in a background thread so the two overlap.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Sequence

__version__ = "0.1.0"

from .errors import TraceError, TraceWarning  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from .analyzer import Analysis, analyze
    from .trace import Trace

__all__ = ["Analysis", "Trace", "TraceError", "TraceWarning", "analyze", "analyze_ranks", "load", "__version__"]

_LAZY = {"Trace": "trace", "Analysis": "analyzer", "analyze": "analyzer", "analyze_ranks": "scale"}


def load(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    cache: bool = True,
    cache_dir: str | os.PathLike | None = None,
    jobs: int | None = None,
    progress: bool | None = None,
) -> "Trace":
    """Load one or more traces into a `Trace` (see `tracelens.trace.load`).

    paths: a trace file, a directory of per-rank trace files, a run directory, or a list of those.
    cache: read/write the cache of parsed files (Arrow IPC) keyed by file content. jobs: parallel processes for many
    files (default: the CPUs this process may use). progress: True/False forces the progress bar;
    None shows it on a TTY.
    """
    from .io import prefetch

    pending = prefetch.start(paths, cache=cache, cache_dir=cache_dir)  # reads + scans while pandas imports
    with _no_gc():  # (the imports: once per process)
        from .trace import load as _load

        if pending is not None and pending.busy:
            # the load would only wait for the scan: import the analyses meanwhile (what nearly every load
            # is followed by), so `analyze` does not pay for them after the scan, and the ones `summary`
            # imports on first use for as long as the scan still runs
            from . import analyzer

            analyzer.preload(lambda: pending.busy)

    return _load(paths, cache=cache, cache_dir=cache_dir, jobs=jobs, progress=progress, prefetch=pending)


class _no_gc:
    """The cyclic garbage collector off for a block (as it was after it): the imports of pandas, pyarrow and the
    analyses create ~130,000 objects the collector tracks and under 1,000 unreachable ones, and the collections
    they triggered took ~13 % of their time on the device machine's CPU (median 0.50 -> 0.49-0.55 s of 0.43-0.65,
    paired runs: `benchmarks/results/corpus_s32/diag.sh`)."""

    def __enter__(self) -> None:
        import gc

        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        import gc

        if self.was:
            gc.enable()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tracelens' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

"""The one error type the analyzer raises for bad input.

Every problem with a user's file becomes a `TraceError` that names the file and says what is wrong in
one line; the CLI prints `tracelens: error: <file>: <problem>` and exits 2, never a traceback.
"""

from __future__ import annotations

import os


class TraceError(Exception):
    """A trace (or run directory) that cannot be analyzed, with the path and the reason."""

    def __init__(self, path: str | os.PathLike | None, problem: str):
        self.path = os.fspath(path) if path is not None else None
        self.problem = problem
        super().__init__(self.one_line())

    def __reduce__(self):  # pickled as (path, problem): it crosses process boundaries (loader pool, Dask workers)
        return (type(self), (self.path, self.problem))

    def one_line(self) -> str:
        problem = " ".join(str(self.problem).split())  # never more than one line
        return f"{self.path}: {problem}" if self.path else problem


class TraceWarning(UserWarning):
    """Something the user should know that does not stop the analysis (e.g. a CPU-only rank)."""

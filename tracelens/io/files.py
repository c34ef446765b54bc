"""Which files a load reads: a trace file, a directory of per-rank files, or a run directory.

Kept free of pandas so `tracelens.load` can find the files and start reading them before the
analysis modules are imported (`tracelens/io/prefetch.py`).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Sequence

from ..errors import TraceError
from .run import MANIFEST

TRACE_SUFFIXES = (".json", ".json.gz")


def _is_trace_file(p: Path) -> bool:
    return p.is_file() and p.name.endswith(TRACE_SUFFIXES) and p.name != MANIFEST


def _named_like_trace(p: Path) -> bool:
    return p.name.endswith(TRACE_SUFFIXES) and p.name != MANIFEST


def _not_a_file(p: Path) -> str | None:
    """Why `p` cannot be read as a trace file (None when it is a regular file, through symlinks)."""
    try:
        st = os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        if os.path.islink(p):
            return f"a dangling symlink (to {os.readlink(p)!r})"
        return e.strerror or str(e)
    if stat.S_ISREG(st.st_mode):
        return None
    kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode)
            else "a character device" if stat.S_ISCHR(st.st_mode) else "a block device" if stat.S_ISBLK(st.st_mode)
            else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
    return kind


def discover(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Expand run dirs / trace dirs / files into a sorted list of trace files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[str] = []
    for raw in paths:
        p = Path(raw)
        why = _not_a_file(p)
        if why is None:
            files.append(str(p))
            continue
        if why != "a directory":
            if why == "No such file or directory":
                raise TraceError(p, "no such file or directory")
            raise TraceError(p, f"not a trace file: {why}")
        # a run dir keeps its traces under traces/; a plain directory holds them directly
        d = p / "traces" if (p / "traces").is_dir() else p
        try:
            entries = sorted(d.iterdir())
        except OSError as e:
            raise TraceError(d, f"cannot list the directory: {e.strerror or e}") from None
        found = []
        for f in entries:
            if not _named_like_trace(f):
                continue
            why = _not_a_file(f)
            if why is not None:  # a rank file that cannot be read must not vanish from the rank set
                raise TraceError(f, f"named like a trace file but is {why}" if why.startswith("a ") else
                                 f"cannot read: {why}")
            found.append(str(f))
        if not found:
            raise TraceError(p, "no trace files (*.json or *.json.gz) in this directory")
        files.extend(found)
    return files

"""Which files a load reads: a trace file, a directory of per-rank files, or a run directory.

Kept free of pandas so `tracelens.load` can find the files and start reading them before the
analysis modules are imported (`tracelens/io/prefetch.py`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ..errors import TraceError

TRACE_SUFFIXES = (".json", ".json.gz")


def _is_trace_file(p: Path) -> bool:
    return p.is_file() and p.name.endswith(TRACE_SUFFIXES) and p.name != "manifest.json"


def discover(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Expand run dirs / trace dirs / files into a sorted list of trace files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[str] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise TraceError(p, "no such file or directory")
        if p.is_file():
            files.append(str(p))
            continue
        # a run dir keeps its traces under traces/; a plain directory holds them directly
        d = p / "traces" if (p / "traces").is_dir() else p
        found = sorted(str(f) for f in d.iterdir() if _is_trace_file(f))
        if not found:
            raise TraceError(p, "no trace files (*.json or *.json.gz) in this directory")
        files.extend(found)
    return files

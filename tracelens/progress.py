"""Progress bars for long work (trace loads, memory sweeps, autotune trials): tqdm on stderr when a
person is watching a terminal, nothing at all in CI or when output goes to a pipe or a file.

    >>> with bar(total=40, desc="memory sweep", unit="layout") as b:
    ...     for _ in range(40):
    ...         b.update(1)
"""

from __future__ import annotations

import os
import sys


def wanted(show: bool | None = None) -> bool:
    """Whether to draw a bar: ``show`` when given, else only on a terminal (stderr and stdout both TTYs:
    `tracelens ... > out.txt` stays clean too) and never when ``CI`` is set to a true value or
    ``TRACELENS_PROGRESS=0``."""
    if show is not None:
        return bool(show)
    if os.environ.get("TRACELENS_PROGRESS", "").strip() == "0":
        return False
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    try:
        return sys.stderr.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def bar(total: float | None = None, desc: str = "", unit: str = "it", show: bool | None = None, **kwargs):
    """A tqdm bar on stderr (disabled, so it prints nothing, when :func:`wanted` says no); use it as a
    context manager, ``.update(n)``, and ``.write(line)`` for log lines that must not break the bar."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not wanted(show), leave=False,
                mininterval=0.2, dynamic_ncols=True, **kwargs)


__all__ = ["bar", "wanted"]

"""The `tracelens` command line run in this process (click's CliRunner), for tests that check what a command
prints, writes and exits with: a `python -m tracelens` subprocess costs an interpreter start and the imports
of pandas, pyarrow and the analysis (1-2 s of CPU) before it does anything. What only a real process shows
(the exit status and one-line stderr of the installed entry point, no traceback from the interpreter, what is
imported) keeps a subprocess test per command: `subprocess_cli` here, and tests/test_readme.py runs every
README command as written.

Every verb that reads traces is safe to run here: only the GPU-side commands (calibrate, kernels) import torch,
and `profile` / `autotune` start the trainer; callers pass none of those.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Result:
    """What a test reads of a finished command (the fields of subprocess.CompletedProcess it uses)."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(*args, env: dict[str, str] | None = None) -> Result:
    """`tracelens ARGS` in this process. An exception the CLI lets escape (it turns every one into a one-line
    error and an exit status, so none should) is raised here, with its traceback."""
    from click.testing import CliRunner

    from tracelens.cli import main

    res = CliRunner().invoke(main, [str(a) for a in args], env=env, catch_exceptions=True)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return Result(res.exit_code, res.stdout, res.stderr)


def subprocess_cli(*args, **kw) -> subprocess.CompletedProcess:
    """`python -m tracelens ARGS` as a real process (the entry point's exit status and stderr)."""
    return subprocess.run([sys.executable, "-m", "tracelens", *map(str, args)], check=False, capture_output=True, text=True,
                          **kw)

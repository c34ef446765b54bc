"""Launching a test worker script on several gloo processes (torchrun) and reading the JSON it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_worker(script: str, out: Path, nproc: int = 4, timeout: int = 600) -> dict:
    """``torchrun --standalone --nproc-per-node nproc tests/trainer/<script> OUT`` with this checkout on the path;
    asserts a clean exit (stderr's tail on failure) and returns ``OUT/results.json``."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                        str(REPO / "tests" / "trainer" / script), str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((out / "results.json").read_text())

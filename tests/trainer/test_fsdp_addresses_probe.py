"""benchmarks/fsdp_param_addresses.py (the probe for the CUDA-graphs lead of issue 19) on the CPU: it runs,
prints one address per step for each wrapping, and a plain module's weight never moves."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    """A port nothing listens on now (the probe's one-rank store binds it): a fixed one would collide with
    another run of this test on the machine (a second pytest-xdist worker, another checkout's suite)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probe_prints_an_address_per_step(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fsdp_param_addresses.py"), "--steps", "3",
                        "--device", "cpu"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={"MASTER_PORT": str(_free_port()), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = {ln.split(" cpu:")[0].strip(): ln for ln in r.stdout.splitlines() if " cpu: weight address per step: " in ln}
    assert set(lines) == {"FSDP2 bf16", "plain module"}
    plain = re.findall(r"0x[0-9a-f]+", lines["plain module"])
    assert len(plain) == 3 and len(set(plain)) == 1
    assert len(re.findall(r"0x[0-9a-f]+", lines["FSDP2 bf16"])) == 3
    assert re.search(r"distinct addresses over 3 steps: FSDP2 bf16 [1-3], plain module 1$", r.stdout.strip())


def test_probe_refuses_one_step():
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fsdp_param_addresses.py"), "--steps", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--steps must be at least 2" in r.stderr

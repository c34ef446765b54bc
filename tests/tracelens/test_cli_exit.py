"""`tracelens.cli.entry`: after `analyze`, the program leaves without the interpreter's teardown (os._exit), having
done first what an exit must: the non-daemon threads joined (the cache entry's store), the atexit functions run, the
streams flushed, the exit status kept. Each case runs the program in its own interpreter, as users do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..conftest import MOE_LOOP

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRACELENS_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=str(REPO), env=env,
                          timeout=300, check=False)


def test_analyze_leaves_after_the_atexit_functions_with_its_outputs_and_cache_entry(tmp_path):
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('atexit ran', flush=True))\n"
            "from tracelens.cli import entry\n"
            "entry(['analyze', sys.argv[1], '-o', sys.argv[2]])\n")
    out = tmp_path / "out"
    r = _run(code, tmp_path, str(MOE_LOOP), str(out))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "atexit ran" and any(ln.startswith("wrote ") for ln in lines), r.stdout
    assert json.loads((out / "summary.json").read_text())["ranks"]  # complete JSON, not cut short
    assert (out / "report.html").read_text().rstrip().endswith("</html>")
    entries = [p for p in (tmp_path / "cache" / "traces").iterdir() if p.name != "st"]
    assert entries, "no cache entry committed"
    # the second run reads that entry (it was written whole before the first one left)
    again = _run(code, tmp_path, str(MOE_LOOP), str(tmp_path / "out2"))
    assert again.returncode == 0 and (tmp_path / "out2" / "summary.json").exists(), again.stderr


def test_a_failing_analyze_keeps_its_status_and_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    r = _run("import sys\nfrom tracelens.cli import entry\nentry(['analyze', sys.argv[1], '-o', sys.argv[2]])\n",
             tmp_path, str(bad), str(tmp_path / "out"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and str(bad) in r.stderr, r.stderr


def test_exit_now_waits_for_non_daemon_threads_and_keeps_the_status(tmp_path):
    mark = tmp_path / "written"
    code = ("import sys, threading, time\n"
            "from pathlib import Path\n"
            "from tracelens.cli import _exit_now\n"
            "def late():\n"
            "    time.sleep(0.3)\n"
            "    Path(sys.argv[1]).write_text('done')\n"
            "threading.Thread(target=late).start()\n"
            "print('buffered', end='')\n"
            "_exit_now(5)\n")
    r = _run(code, tmp_path, str(mark))
    assert r.returncode == 5 and r.stdout == "buffered" and mark.read_text() == "done"
    r = _run("from tracelens.cli import _exit_now\n_exit_now('stopped: a message')\n", tmp_path)
    assert r.returncode == 1 and r.stderr.strip() == "stopped: a message"


def test_the_collector_is_on_after_analyze_and_frozen_only_in_the_programs_own_process(tmp_path):
    # the load runs with the cyclic collector off (its imports make next to no garbage); the program's own process
    # then freezes what was imported (gc.freeze, for good), where `main` inside another program (a test's CliRunner)
    # must leave that program's collector as it found it, on a failed load too
    code = ("import gc, sys\n"
            "from click.testing import CliRunner\n"
            "from tracelens import cli\n"
            "frozen = gc.get_freeze_count()\n"
            "r = CliRunner().invoke(cli.main, ['analyze', sys.argv[1], '-o', sys.argv[2]])\n"
            "assert r.exit_code == 0, r.output\n"
            "assert gc.isenabled() and gc.get_freeze_count() == frozen, (gc.isenabled(), frozen)\n"
            "r = CliRunner().invoke(cli.main, ['analyze', sys.argv[3], '-o', sys.argv[2]])\n"
            "assert r.exit_code == 2 and gc.isenabled(), r.output\n"
            "import atexit\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 10000, gc.isenabled(), flush=True))\n"
            "cli.entry(['analyze', sys.argv[1], '-o', sys.argv[2]])\n")
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    r = _run(code, tmp_path, str(MOE_LOOP), str(tmp_path / "out"), str(bad))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "frozen True True", r.stdout

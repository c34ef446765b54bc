"""Sweep store integrity: one writer at a time (flock beside sweep.sqlite, released however the holder
ends), a store that cannot account for the trial dirs is refused without deleting anything, and every
store error is one line naming the file."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.space import key_of, parse_space
from autotune.store import Store, StoreError, StoreLocked
from autotune.sweep import Sweep, SweepError, run_sweep

from ._fake import FakeRunner

REPO = Path(__file__).resolve().parents[2]
SPACE = {"config": "tiny", "knobs": {"sync_free_level": [0, 1, 2]}, "budget": {"trials": 3}}
TABLE = {key_of({"sync_free_level": i}): (100.0 + i, [], {}, 0.0) for i in range(3)}
quiet = lambda m: None  # noqa: E731


def _space():
    return parse_space(SPACE, check_trainer=False)


def _one_line(msg: str, *names) -> None:
    assert "\n" not in msg and msg.strip() == msg
    for n in names:
        assert str(n) in msg, (n, msg)


def _finished_sweep(out: Path) -> dict[str, bytes]:
    """A finished 3-trial grid sweep in ``out`` whose trial dirs hold a result file each; returns the
    trial dirs' contents so that a test can check nothing was deleted or rewritten."""
    run_sweep(_space(), out, strategy="grid", log=quiet, runner=FakeRunner(TABLE))
    for i in (1, 2, 3):
        d = out / "trials" / f"t{i:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "manifest.json").write_text(f'{{"trial": {i}}}')
    return _snapshot(out / "trials")


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------- lock

def test_a_second_sweep_on_the_same_dir_is_refused_until_the_first_closes(tmp_path):
    first = Sweep(_space(), tmp_path, strategy="grid", log=quiet, runner=FakeRunner(TABLE))
    db = tmp_path / "sweep.sqlite"
    with pytest.raises(SweepError) as e:
        Sweep(_space(), tmp_path, strategy="grid", resume=True, log=quiet, runner=FakeRunner(TABLE))
    _one_line(str(e.value), db, f"pid {os.getpid()}")
    assert "in use by another sweep" in str(e.value)
    # the refused opener changed nothing: the first one runs its sweep to the end
    assert first.run().stopped == "every allowed point run"
    first.store.close()
    again = FakeRunner(TABLE)
    res = run_sweep(_space(), tmp_path, strategy="grid", resume=True, log=quiet, runner=again)
    assert again.calls == [] and len(res.trials) == 3
    # a refused Sweep (here: no --resume) releases the lock on its way out
    with pytest.raises(SweepError, match="pass --resume"):
        Sweep(_space(), tmp_path, strategy="grid", log=quiet, runner=FakeRunner(TABLE))
    Store(db).close()


_HOLDER = """
import sys, time
from autotune.store import Store
s = Store(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def test_a_killed_holder_releases_the_lock(tmp_path):
    db = tmp_path / "sweep.sqlite"
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(db)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLocked) as e:
            Store(db)
        _one_line(str(e.value), db, f"pid {p.pid}", db.with_name("sweep.sqlite.lock"))
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    Store(db).close()  # the kernel dropped the dead holder's lock


def test_child_processes_do_not_inherit_the_lock(tmp_path):
    """A trial (or a torchrun rank) that outlives its sweep must not keep the store locked."""
    db = tmp_path / "sweep.sqlite"
    s = Store(db)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        s.close()
        Store(db).close()
    finally:
        child.kill()
        child.wait()


def test_cli_resume_beside_a_live_sweep_exits_2_and_leaves_its_trial_alive(tmp_path):
    """The reported failure: a second --resume reaped the live sweep's running trial."""
    space = tmp_path / "space.yaml"
    space.write_text("config: tiny\nknobs: {sync_free_level: [0, 1]}\nbudget: {trials: 2}\n")
    out = tmp_path / "sweep"
    run_dir = out / "trials" / "t001"
    run_dir.mkdir(parents=True)
    live = Store(out / "sweep.sqlite")  # the live sweep: its trial 1 is running in run_dir
    row = live.start(key_of({"sync_free_level": 0}), {"sync_free_level": 0}, str(run_dir), "baseline")
    trial = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(60)", str(run_dir)],
                             start_new_session=True)
    live.set_pgid(row["id"], trial.pid)
    try:
        r = subprocess.run([sys.executable, "-m", "tracelens.cli", "autotune", str(space), "-o", str(out), "--resume"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and r.stdout == ""
        _one_line(lines[0], out / "sweep.sqlite", f"pid {os.getpid()}")
        time.sleep(0.2)
        assert trial.poll() is None, "the live sweep's trial was killed"
        assert live.get(row["id"])["status"] == "running"
    finally:
        trial.kill()
        trial.wait()
        live.close()


# ------------------------------------------------------------------ a store that cannot account for the trials

def _zero(db: Path):
    db.write_bytes(b"")
    for p in db.parent.glob("sweep.sqlite-*"):
        p.unlink()


def _deleted(db: Path):
    for p in [db, *db.parent.glob("sweep.sqlite-*")]:
        p.unlink()


def _garbage_header(db: Path):
    b = bytearray(db.read_bytes())
    b[:16] = b"not a database!!"
    db.write_bytes(bytes(b))


def _truncated(db: Path):
    db.write_bytes(db.read_bytes()[:1500])


def _torn_pages(db: Path):
    b = bytearray(db.read_bytes())
    for page in range(1, len(b) // 4096):  # page 1 (the header) intact, the b-tree pages scrambled
        b[page * 4096 + 8: page * 4096 + 200] = bytes(range(192))
    db.write_bytes(bytes(b))


@pytest.mark.parametrize("damage, says", [
    (_zero, "is empty (0 bytes)"), (_deleted, "is missing"), (_garbage_header, "not a readable sweep store"),
    (_truncated, "sweep store"), (_torn_pages, "sweep store"),
])
@pytest.mark.parametrize("resume", [True, False])
def test_a_store_that_cannot_account_for_the_trials_deletes_nothing(tmp_path, damage, says, resume):
    out = tmp_path / "sweep"
    before = _finished_sweep(out)
    damage(out / "sweep.sqlite")
    store_bytes = (out / "sweep.sqlite").read_bytes() if (out / "sweep.sqlite").exists() else None
    runner = FakeRunner(TABLE)
    with pytest.raises(SweepError) as e:
        run_sweep(_space(), out, strategy="grid", resume=resume, log=quiet, runner=runner)
    _one_line(str(e.value), out / "sweep.sqlite", "nothing was deleted")
    assert says in str(e.value)
    assert runner.calls == []
    assert _snapshot(out / "trials") == before  # every trial dir and file is still there, unchanged
    if store_bytes is not None:  # a damaged store is not rewritten either, nor a 0-byte one given a schema
        assert (out / "sweep.sqlite").read_bytes() == store_bytes
    else:  # nor a missing one created: a second try said 'holds no trials', the file the user should restore
        assert not [p.name for p in out.iterdir() if p.name.startswith("sweep.sqlite") and p.suffix != ".lock"]
    # the message's advice works: with the trial dirs moved away, a new sweep starts
    if damage in (_zero, _deleted):
        (out / "trials").rename(tmp_path / "old_trials")
        res = run_sweep(_space(), out, strategy="grid", resume=resume, log=quiet, runner=FakeRunner(TABLE))
        assert len(res.trials) == 3


def test_a_trial_dir_the_store_does_not_know_is_refused(tmp_path):
    out = tmp_path / "sweep"
    _finished_sweep(out)
    stray = out / "trials" / "t004"  # e.g. the store is an older copy: t004 would be cleared for the next trial
    stray.mkdir()
    (stray / "keep.txt").write_text("results")
    with pytest.raises(SweepError) as e:
        run_sweep(_space(), out, strategy="grid", resume=True, log=quiet, runner=FakeRunner(TABLE))
    _one_line(str(e.value), out / "trials", out / "sweep.sqlite", "t004", "nothing was deleted")
    assert (stray / "keep.txt").read_text() == "results"


def test_an_out_dir_under_a_file_is_one_line_without_restore_advice(tmp_path):
    """``-o FILE/sub`` (click's check for a file only sees ``-o FILE``): the store's directory cannot be made;
    the line used to end 'nothing was deleted: restore it to resume, or move it ... away', of a store that
    never existed."""
    (tmp_path / "f").write_text("mine")
    with pytest.raises(SweepError) as e:
        run_sweep(_space(), tmp_path / "f" / "sub", strategy="grid", log=quiet, runner=FakeRunner(TABLE))
    _one_line(str(e.value), tmp_path / "f" / "sub" / "sweep.sqlite", "cannot create its directory")
    assert "restore" not in str(e.value)
    assert (tmp_path / "f").read_text() == "mine"


def test_a_missing_store_without_trial_dirs_starts_a_new_sweep(tmp_path):
    logs = []
    res = run_sweep(_space(), tmp_path / "new", strategy="grid", resume=True, log=logs.append, runner=FakeRunner(TABLE))
    assert len(res.trials) == 3 and any("nothing to resume" in m for m in logs)


@pytest.mark.parametrize("sql", [
    "UPDATE autotune_trials SET knobs = 'not json' WHERE id = 2",
    "UPDATE autotune_trials SET metrics = '[1, 2]' WHERE id = 1",
    "UPDATE autotune_trials SET objective = NULL WHERE id = 3",
    "UPDATE autotune_trials SET objective = 9e999 WHERE id = 3",  # SQLite stores inf (a NaN becomes NULL)
    "UPDATE autotune_trials SET objective = -9e999 WHERE id = 1",
    "UPDATE autotune_meta SET v = '[]' WHERE k = 'identity'",
    "UPDATE autotune_meta SET v = '\"x\"' WHERE k = 'elapsed_s'",
    "UPDATE autotune_meta SET v = 'NaN' WHERE k = 'elapsed_s'",  # JSON's NaN: every budget check passed
    "UPDATE autotune_meta SET v = 'Infinity' WHERE k = 'elapsed_s'",
    "UPDATE autotune_meta SET v = '-1e9' WHERE k = 'elapsed_s'",
    "DROP TABLE autotune_trials",
    "ALTER TABLE autotune_trials DROP COLUMN run_dir",
])
def test_damaged_contents_are_one_line_naming_the_store(tmp_path, sql):
    out = tmp_path / "sweep"
    before = _finished_sweep(out)
    con = sqlite3.connect(out / "sweep.sqlite")
    con.execute(sql)
    con.commit()
    con.close()
    runner = FakeRunner(TABLE)
    with pytest.raises(SweepError) as e:
        run_sweep(_space(), out, strategy="grid", resume=True, log=quiet, runner=runner)
    _one_line(str(e.value), out)
    assert runner.calls == [] and _snapshot(out / "trials") == before


def test_store_errors_name_the_file(tmp_path):
    with pytest.raises(StoreError) as e:
        Store(tmp_path)  # a directory
    _one_line(str(e.value), tmp_path)
    s = Store(tmp_path / "s.sqlite")
    with pytest.raises(StoreError) as e:
        s.finish(99, "ok", 1.0, {}, [])
    _one_line(str(e.value), tmp_path / "s.sqlite", "trial 99 is not running")
    s.close()
    s.close()  # idempotent


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-1"])
def test_resume_with_an_elapsed_time_that_is_no_time_exits_2_naming_the_store(tmp_path, value):
    # a NaN elapsed_s passed every wall-time budget check on --resume (found by the every-verb fuzz)
    from click.testing import CliRunner

    from tracelens.cli import main

    out = tmp_path / "sweep"
    _finished_sweep(out)
    con = sqlite3.connect(out / "sweep.sqlite")
    con.execute("UPDATE autotune_meta SET v = ? WHERE k = 'elapsed_s'", (value,))
    con.commit()
    con.close()
    space = tmp_path / "space.yaml"
    space.write_text(json.dumps(SPACE))  # JSON is YAML
    res = CliRunner().invoke(main, ["autotune", str(space), "-o", str(out), "--strategy", "grid", "--resume"])
    assert res.exit_code == 2, res.output
    msg = res.output.strip()
    _one_line(msg, out / "sweep.sqlite", "elapsed_s")
    assert res.exception is None or isinstance(res.exception, SystemExit)

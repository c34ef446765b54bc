"""A sweep refers only to its own directory (issue 31, High 2).

The store keeps each trial's dir by name; a copied (`cp -r` backup) or moved sweep resumes in its own
`trials/`, and never touches, deletes or recreates the dirs of the place it was copied from. What a killed
attempt left in its trial dir is moved to `interrupted/`, never deleted. These checks read the file system
and the raw SQLite rows, not the store's own accessors, for what happened on disk.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.runner import reap_orphans, run_trial
from autotune.space import key_of, parse_space
from autotune.store import Store, StoreError
from autotune.sweep import run_sweep

from ._fake import FakeRunner
from .test_store import SPACE, _table


class WritingRunner(FakeRunner):
    """The fake runner, writing what a real trial writes (a log and a manifest) into its run dir first."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.dirs: list[Path] = []

    def __call__(self, space, point, run_dir, on_start):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)  # as run_trial does
        assert not any(run_dir.iterdir()), "a trial starts in an empty dir"
        self.dirs.append(run_dir)
        (run_dir / "trial.log").write_text(f"trial {key_of(point)} at {run_dir}\n")
        (run_dir / "manifest.json").write_text("{}")
        return super().__call__(space, point, run_dir, on_start)


def _tree(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``root``: (sha256 of its bytes, mtime in ns)."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _raw_run_dirs(db: Path) -> list[str]:
    con = sqlite3.connect(str(db))
    try:
        return [r[0] for r in con.execute("SELECT run_dir FROM autotune_trials ORDER BY id")]
    finally:
        con.close()


def _killed_sweep(out: Path):
    space = parse_space(SPACE, check_trainer=False)
    runner = WritingRunner(_table(), interrupt_at=3)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(space, out, strategy="grid", log=lambda m: None, runner=runner)
    return space, runner


def test_store_keeps_trial_dirs_relative(tmp_path):
    out = tmp_path / "sweep"
    _killed_sweep(out)
    assert _raw_run_dirs(out / "sweep.sqlite") == ["trials/t001", "trials/t002", "trials/t003"]


def test_resume_of_a_copy_never_touches_the_original(tmp_path):
    orig = tmp_path / "orig"
    space, killed = _killed_sweep(orig)
    assert (orig / "trials" / "t003" / "trial.log").exists()  # the killed attempt left its log
    backup = tmp_path / "backup"
    shutil.copytree(orig, backup, symlinks=True)
    before = _tree(orig)
    time.sleep(0.01)
    log: list[str] = []
    resumed = WritingRunner(_table())
    res = run_sweep(space, backup, strategy="grid", resume=True, log=log.append, runner=resumed)
    assert _tree(orig) == before  # not a byte or an mtime of the original changed
    assert all(d.is_relative_to(backup / "trials") for d in resumed.dirs)
    assert resumed.dirs[0] == backup / "trials" / "t003"  # the interrupted trial, rerun in the copy
    assert all(Path(t["run_dir"]).parent == backup / "trials" for t in res.trials)
    # the killed attempt's leftovers are kept, not deleted
    kept = backup / "interrupted" / "t003-attempt1" / "trial.log"
    assert kept.read_text() == f"trial {key_of(killed.calls[2])} at {orig / 'trials' / 't003'}\n"
    assert any("interrupted/t003-attempt1" in m for m in log)


def test_a_moved_sweep_resumes_where_it_is(tmp_path):
    old = tmp_path / "old"
    space, _ = _killed_sweep(old)
    new = tmp_path / "new"
    old.rename(new)
    resumed = WritingRunner(_table())
    res = run_sweep(space, new, strategy="grid", resume=True, log=lambda m: None, runner=resumed)
    assert not old.exists()  # nothing recreated at the old place
    assert {Path(t["run_dir"]).parent for t in res.trials} == {new / "trials"}
    assert sorted(p.name for p in (new / "trials").iterdir()) == [f"t{i:03d}" for i in range(1, len(res.trials) + 1)]


def test_older_stores_with_absolute_paths_are_read_by_name(tmp_path):
    out = tmp_path / "sweep"
    space, _ = _killed_sweep(out)
    con = sqlite3.connect(str(out / "sweep.sqlite"))
    elsewhere = tmp_path / "elsewhere"
    con.execute("UPDATE autotune_trials SET run_dir = ? || substr(run_dir, 8)", (f"{elsewhere}/sweep/trials/",))
    con.commit()
    con.close()
    resumed = WritingRunner(_table())
    run_sweep(space, out, strategy="grid", resume=True, log=lambda m: None, runner=resumed)
    assert not elsewhere.exists()
    assert resumed.dirs[0] == out / "trials" / "t003"


@pytest.mark.parametrize("bad", ["/", "trials/..", "..", "", "trials/a b"])
def test_a_run_dir_outside_trials_is_a_damaged_store(tmp_path, bad):
    s = Store(tmp_path / "sweep.sqlite")
    s.start("k1", {"a": 1}, "t001")
    s.close()
    con = sqlite3.connect(str(tmp_path / "sweep.sqlite"))
    con.execute("UPDATE autotune_trials SET run_dir = ?", (bad,))
    con.commit()
    con.close()
    s = Store(tmp_path / "sweep.sqlite")
    with pytest.raises(StoreError, match="impossible run_dir"):
        s.trials()
    s.close()
    with pytest.raises(StoreError, match="not a trial dir name"):
        Store(tmp_path / "other.sqlite").start("k", {}, "..")


def test_only_the_last_part_of_a_stored_run_dir_is_read(tmp_path):
    s = Store(tmp_path / "sweep.sqlite")
    s.start("k1", {"a": 1}, "t001")
    con = sqlite3.connect(str(tmp_path / "sweep.sqlite"))
    con.execute("UPDATE autotune_trials SET run_dir = '../../etc'")
    con.commit()
    con.close()
    assert s.trials()[0]["run_dir"] == str(tmp_path / "trials" / "etc")  # never a path outside trials/
    s.close()


def test_run_trial_never_clears_a_directory(tmp_path):
    d = tmp_path / "t001"
    d.mkdir()
    (d / "keep.txt").write_text("mine")
    space = parse_space(SPACE, check_trainer=False)
    with pytest.raises(FileExistsError, match="new or empty"):
        run_trial(space, {"sync_free_level": 0}, d)
    assert (d / "keep.txt").read_text() == "mine"


def test_reaping_matches_the_whole_run_dir(tmp_path):
    """A copy's resume reaps only its own trial's processes: one with the original's (or a longer) path lives."""
    here = str(tmp_path / "copy" / "trials" / "t002")
    others = [str(tmp_path / "orig" / "trials" / "t002"), here + "0"]
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-o", p],
                              start_new_session=True) for p in others + [here]]
    try:
        time.sleep(0.3)
        for p in procs[:2]:
            assert reap_orphans(os.getpgid(p.pid), here) == []
        assert reap_orphans(os.getpgid(procs[2].pid), here) == [procs[2].pid]
        assert procs[2].wait(timeout=10) == -9
        assert [p.poll() for p in procs[:2]] == [None, None]
    finally:
        for p in procs:
            p.kill()
            p.wait()

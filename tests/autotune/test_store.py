"""Results store: atomic rows under SIGKILL, running rows re-run in place, resume never repeats a trial."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.space import key_of, parse_space
from autotune.store import Store
from autotune.sweep import SweepError, run_sweep

from ._fake import FakeRunner

REPO = Path(__file__).resolve().parents[2]


def test_trial_lifecycle(tmp_path):
    s = Store(tmp_path / "s.sqlite")
    row = s.start("k1", {"a": 1}, str(tmp_path / "t001"), "baseline")
    assert (row["status"], row["attempts"], s.done("k1")) == ("running", 1, None)
    s.set_pgid(row["id"], 4242)
    assert s.running()[0]["pgid"] == 4242
    # a running row (the sweep was killed) is reused in place: same id and run dir, one more attempt
    again = s.start("k1", {"a": 1}, str(tmp_path / "other"), "baseline")
    assert (again["id"], again["run_dir"], again["attempts"], again["pgid"]) == (
        row["id"], str(tmp_path / "trials" / "t001"), 2, None)
    done = s.finish(row["id"], "ok", 12.5, {"noise": 0.01}, [{"type": "host_sync"}], decision="start")
    assert (done["status"], done["objective"], done["metrics"], done["findings"], done["decision"]) == (
        "ok", 12.5, {"noise": 0.01}, [{"type": "host_sync"}], "start")
    assert s.done("k1")["id"] == row["id"]
    with pytest.raises(ValueError, match="never run twice"):
        s.start("k1", {"a": 1}, "x")
    with pytest.raises(ValueError, match="not running"):
        s.finish(row["id"], "failed", None, {}, [])
    with pytest.raises(ValueError, match="status must be"):
        s.finish(row["id"], "timeout", None, {}, [])
    s.set_meta("path", [{"trial": 1}])
    assert s.get_meta("path") == [{"trial": 1}] and s.get_meta("nope", 3) == 3
    s.close()


_WRITER = """
import sys
from autotune.store import Store
s = Store(sys.argv[1])
i = 0
while True:
    i += 1
    r = s.start(f"k{i}", {"i": i}, f"t{i}")
    s.finish(r["id"], "ok", float(i), {"payload": [i] * 2000, "i": i}, [{"i": i}] * 50, decision="kept")
"""


def test_rows_are_atomic_when_the_writer_is_killed(tmp_path):
    db = tmp_path / "s.sqlite"
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(db)], cwd=REPO)
    deadline = time.time() + 60
    while time.time() < deadline:
        time.sleep(0.2)
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
            n = con.execute("SELECT COUNT(*) FROM autotune_trials WHERE status = 'ok'").fetchone()[0]
            con.close()
        except sqlite3.OperationalError:
            n = 0
        if n >= 20:
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    con = sqlite3.connect(str(db))
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = con.execute("SELECT key, status, objective, metrics, findings, decision, finished FROM autotune_trials").fetchall()
    assert sum(r[1] == "ok" for r in rows) >= 20
    assert sum(r[1] == "running" for r in rows) <= 1
    for key, status, obj, metrics, findings, decision, finished in rows:
        i = int(key[1:])
        if status == "running":  # started, never finished: nothing of the result half-written
            assert (obj, metrics, findings, decision, finished) == (None, None, None, None, None)
        else:
            assert obj == float(i) and decision == "kept" and finished is not None
            assert json.loads(metrics) == {"payload": [i] * 2000, "i": i}
            assert json.loads(findings) == [{"i": i}] * 50


SPACE = {"config": "tiny", "knobs": {"sync_free_level": [0, 1, 2], "grouped_gemm_backend": ["loop", "torch"]},
         "budget": {"trials": 5}}
MOE_SYNC = {"type": "host_sync", "severity": "high", "title": "aten::to forces 4 syncs",
            "evidence": {"path": "layers.1/moe/permute", "count": 4}}


def _table():
    t = {}
    for lvl in (0, 1, 2):
        for b in ("loop", "torch"):
            obj = 100 + 20 * lvl + (30 if b == "torch" else 0)
            t[key_of({"sync_free_level": lvl, "grouped_gemm_backend": b})] = (
                obj, [MOE_SYNC] if lvl < 2 else [], {"expert_gemms_per_call": 16 if b == "loop" else 2}, 0.0)
    return t


@pytest.mark.parametrize("strategy", ["guided", "grid", "random"])
def test_resume_after_a_kill_repeats_nothing(tmp_path, strategy):
    space = parse_space(SPACE, check_trainer=False)
    ref = run_sweep(space, tmp_path / "ref", strategy=strategy, seed=3, log=lambda m: None, runner=FakeRunner(_table()))
    killed = FakeRunner(_table(), interrupt_at=3)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(space, tmp_path / "s", strategy=strategy, seed=3, log=lambda m: None, runner=killed)
    with pytest.raises(SweepError, match="pass --resume"):
        run_sweep(space, tmp_path / "s", strategy=strategy, seed=3, log=lambda m: None, runner=FakeRunner(_table()))
    with pytest.raises(SweepError, match="different search space"):
        run_sweep(parse_space({**SPACE, "fixed": {"steps": 3}}, check_trainer=False), tmp_path / "s",
                  strategy=strategy, seed=3, resume=True, log=lambda m: None, runner=FakeRunner(_table()))
    resumed = FakeRunner(_table())
    res = run_sweep(space, tmp_path / "s", strategy=strategy, seed=3, resume=True, log=lambda m: None, runner=resumed)
    # the two finished trials are not run again; the interrupted third is, then the rest, as uninterrupted
    keys = lambda calls: [key_of(p) for p in calls]  # noqa: E731
    assert keys(resumed.calls)[0] == keys(killed.calls)[2]
    assert keys(killed.calls[:2] + resumed.calls) == [t["key"] for t in ref.trials]
    assert len(ref.trials) == (4 if strategy == "guided" else 5)  # guided: no finding left after 4
    # same trials, decisions and path as the uninterrupted sweep
    strip = lambda ts: [(t["knobs"], t["status"], t["objective"], t["decision"]) for t in ts]  # noqa: E731
    assert strip(res.trials) == strip(ref.trials)
    assert [(p["trial"], p["decision"]) for p in res.path] == [(p["trial"], p["decision"]) for p in ref.path]
    assert res.ran == len(resumed.calls) and res.trials[2]["attempts"] == 2
    # a second resume of a finished sweep runs nothing and reports the same
    again = FakeRunner(_table())
    res2 = run_sweep(space, tmp_path / "s", strategy=strategy, seed=3, resume=True, log=lambda m: None, runner=again)
    assert again.calls == [] and res2.stopped == res.stopped and res2.best["id"] == res.best["id"]

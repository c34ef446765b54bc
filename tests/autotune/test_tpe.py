"""The optional Optuna TPE strategy: its study lives in the sweep's SQLite file, it never repeats a
trial, resumes after a kill, and without Optuna the message says what to install."""

from __future__ import annotations

import sqlite3
import sys

import pytest

from autotune.space import key_of, parse_space
from autotune.sweep import SweepError, run_sweep

from ._fake import FakeRunner

SPACE = {"config": "tiny", "knobs": {"sync_free_level": [0, 1, 2, 3], "grouped_gemm_backend": ["loop", "torch"],
                                     "recompute_layer_ids": [[], [1]]},
         "constraints": ["not (grouped_gemm_backend == 'loop' and sync_free_level == 3)"], "budget": {"trials": 6}}


def _table():
    return {key_of(p): (100 + 10 * p["sync_free_level"] + (5 if p["grouped_gemm_backend"] == "torch" else 0), [], {}, 0.0)
            for p in parse_space(SPACE, check_trainer=False).grid()}


def test_tpe_study_in_the_same_file_resume_and_no_repeats(tmp_path):
    pytest.importorskip("optuna")
    space = parse_space(SPACE, check_trainer=False)
    killed = FakeRunner(_table(), interrupt_at=3)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(space, tmp_path, strategy="tpe", seed=1, log=lambda m: None, runner=killed)
    resumed = FakeRunner(_table())
    res = run_sweep(space, tmp_path, strategy="tpe", seed=1, resume=True, log=lambda m: None, runner=resumed)
    keys = [t["key"] for t in res.trials]
    assert len(res.trials) == 6 and len(set(keys)) == 6 and res.stopped == "budget spent"
    assert all(t["status"] == "ok" and space.allowed(t["knobs"]) for t in res.trials)
    assert key_of(resumed.calls[0]) == key_of(killed.calls[2])  # the interrupted trial first
    assert not {key_of(p) for p in resumed.calls} & {key_of(p) for p in killed.calls[:2]}
    assert res.best["objective"] == max(t["objective"] for t in res.trials)
    con = sqlite3.connect(tmp_path / "sweep.sqlite")
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"autotune_trials", "studies", "trials"} <= tables  # Optuna's RDB storage beside the store
    told = con.execute("SELECT COUNT(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]
    assert told >= 5  # every finished trial was told to the sampler (the killed one was marked failed)
    con.close()


def test_tpe_without_optuna_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna -> ImportError
    space = parse_space(SPACE, check_trainer=False)
    with pytest.raises(SweepError, match=r"strategy tpe needs Optuna, which is not installed: pip install 'tracelens\[tune\]'"):
        run_sweep(space, tmp_path, strategy="tpe", log=lambda m: None, runner=FakeRunner(_table()))

"""Results store: every trial of a sweep in one SQLite file, written atomically, so a killed sweep resumes.

One row per trial key (the knob values, canonical JSON). A trial is inserted as ``running`` in one
transaction before its process starts (with the run dir and, once started, the process group id) and
completed to ``ok`` / ``failed`` with its objective, metrics, findings, failure kind and reason, and
the guided search's decision in another. SQLite (WAL journal, synchronous=FULL) makes each of these
all-or-nothing on disk, so a sweep killed at any instant leaves finished trials complete and at most
the trials it was running as ``running`` rows. On resume such a row is run again in place (same id,
same run dir, cleared first): it never finished, so it is not a repeat. A finished key is never run
twice: :meth:`Store.done` answers for it.

Tables are prefixed ``autotune_`` so that other tools (e.g. Optuna's RDB storage, which has its own
``trials`` table) can share the file.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS autotune_trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT UNIQUE NOT NULL,
    knobs TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('running', 'ok', 'failed')),
    failure TEXT,            -- timeout | oom | crash | config | killed | memory | no-objective (failed only)
    reason TEXT,             -- one line: what happened
    objective REAL,
    metrics TEXT,            -- JSON: manifest metrics + noise + signals
    findings TEXT,           -- JSON: tracelens findings of the trial's traces
    motivation TEXT,         -- why the strategy chose this point (the finding, for guided)
    parent INTEGER,          -- the trial this one changed (guided)
    decision TEXT,           -- guided: start | kept | reverted | failed
    run_dir TEXT NOT NULL,
    pgid INTEGER,            -- process group of the running trial (to reap orphans after a kill)
    attempts INTEGER NOT NULL DEFAULT 1,
    started REAL,
    finished REAL
);
CREATE TABLE IF NOT EXISTS autotune_meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
"""
STATUSES = ("ok", "failed")


class Store:
    """The sweep's SQLite file. Every write is one transaction."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    # ---------------------------------------------------------------- meta (sweep-level facts)
    def set_meta(self, k: str, v: Any) -> None:
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO autotune_meta VALUES (?, ?)", (k, json.dumps(v, default=str)))

    def get_meta(self, k: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT v FROM autotune_meta WHERE k = ?", (k,)).fetchone()
        return json.loads(row[0]) if row else default

    # ---------------------------------------------------------------- trials
    def start(self, key: str, knobs: dict, run_dir: str, motivation: str = "", parent: int | None = None) -> dict:
        """Mark a trial running and return its row. A ``running`` row of the same key (a trial a killed
        sweep never finished) is reused: same id and run dir, one more attempt. A finished key is an error."""
        with self._tx():
            row = self.db.execute("SELECT * FROM autotune_trials WHERE key = ?", (key,)).fetchone()
            if row is not None and row["status"] != "running":
                raise ValueError(f"trial {key} already finished (id {row['id']}); it is never run twice")
            if row is not None:
                self.db.execute("UPDATE autotune_trials SET attempts = attempts + 1, started = ?, pgid = NULL, "
                                "motivation = ?, parent = ? WHERE id = ?", (time.time(), motivation, parent, row["id"]))
                tid = row["id"]
            else:
                cur = self.db.execute(
                    "INSERT INTO autotune_trials (key, knobs, status, motivation, parent, run_dir, started) "
                    "VALUES (?, ?, 'running', ?, ?, ?, ?)",
                    (key, json.dumps(knobs, sort_keys=True, default=str), motivation, parent, run_dir, time.time()))
                tid = int(cur.lastrowid)
        return self.get(tid)

    def set_pgid(self, trial_id: int, pgid: int | None) -> None:
        with self._tx():
            self.db.execute("UPDATE autotune_trials SET pgid = ? WHERE id = ?", (pgid, trial_id))

    def finish(self, trial_id: int, status: str, objective: float | None, metrics: dict, findings: list,
               failure: str | None = None, reason: str | None = None, decision: str | None = None) -> dict:
        """Complete a running trial in one transaction and return its row."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        with self._tx():
            n = self.db.execute(
                "UPDATE autotune_trials SET status = ?, objective = ?, metrics = ?, findings = ?, failure = ?, "
                "reason = ?, decision = ?, pgid = NULL, finished = ? WHERE id = ? AND status = 'running'",
                (status, objective, json.dumps(metrics, default=str), json.dumps(findings, default=str), failure,
                 reason, decision, time.time(), trial_id)).rowcount
            if n != 1:
                raise ValueError(f"trial {trial_id} is not running")
        return self.get(trial_id)

    def get(self, trial_id: int) -> dict:
        return self._row(self.db.execute("SELECT * FROM autotune_trials WHERE id = ?", (trial_id,)).fetchone())

    def lookup(self, key: str) -> dict | None:
        row = self.db.execute("SELECT * FROM autotune_trials WHERE key = ?", (key,)).fetchone()
        return self._row(row) if row else None

    def done(self, key: str) -> dict | None:
        """The finished trial with these knobs, or None (never run, or killed while running)."""
        t = self.lookup(key)
        return t if t is not None and t["status"] != "running" else None

    def trials(self, finished_only: bool = False) -> list[dict]:
        q = "SELECT * FROM autotune_trials" + (" WHERE status != 'running'" if finished_only else "") + " ORDER BY id"
        return [self._row(r) for r in self.db.execute(q).fetchall()]

    def running(self) -> list[dict]:
        return [self._row(r) for r in self.db.execute(
            "SELECT * FROM autotune_trials WHERE status = 'running' ORDER BY id").fetchall()]

    def next_run_dir_index(self) -> int:
        return int(self.db.execute("SELECT COALESCE(MAX(id), 0) FROM autotune_trials").fetchone()[0])

    @staticmethod
    def _row(r: sqlite3.Row) -> dict:
        d = dict(r)
        d["knobs"] = json.loads(d["knobs"])
        d["metrics"] = json.loads(d["metrics"]) if d.get("metrics") else {}
        d["findings"] = json.loads(d["findings"]) if d.get("findings") else []
        return d

    def _tx(self):
        return _Transaction(self.db)

    def close(self) -> None:
        self.db.close()


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (or ``ROLLBACK`` on error): one atomic write."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, exc, tb):
        self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")
        return False

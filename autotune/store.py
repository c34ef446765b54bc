"""Results store: every trial of a sweep in SQLite, written atomically, so a killed sweep resumes.

One row per trial key (the knobs). A trial is inserted as `running` before it starts and updated to
`ok` / `failed` / `timeout` in one transaction when it ends; a sweep that is killed leaves at most one
`running` row, which `--resume` runs again (it never finished). Nothing else is ever repeated.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT UNIQUE NOT NULL,
    knobs TEXT NOT NULL,
    status TEXT NOT NULL,
    objective REAL,
    metrics TEXT,
    findings TEXT,
    motivation TEXT,
    parent INTEGER,
    run_dir TEXT,
    reason TEXT,
    started REAL,
    finished REAL
);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT);
"""


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)

    def set_meta(self, k: str, v: Any) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, json.dumps(v)))

    def get_meta(self, k: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT v FROM meta WHERE k = ?", (k,)).fetchone()
        return json.loads(row[0]) if row else default

    def start(self, key: str, knobs: dict, motivation: str, parent: int | None, run_dir: str) -> int:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("DELETE FROM trials WHERE key = ? AND status = 'running'", (key,))
            cur = self.db.execute(
                "INSERT INTO trials (key, knobs, status, motivation, parent, run_dir, started) VALUES (?, ?, 'running', ?, ?, ?, ?)",
                (key, json.dumps(knobs, sort_keys=True), motivation, parent, run_dir, time.time()))
            return int(cur.lastrowid)

    def finish(self, trial_id: int, status: str, objective: float | None, metrics: dict, findings: list,
               reason: str | None) -> None:
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute(
                "UPDATE trials SET status = ?, objective = ?, metrics = ?, findings = ?, reason = ?, finished = ? WHERE id = ?",
                (status, objective, json.dumps(metrics, default=str), json.dumps(findings, default=str), reason,
                 time.time(), trial_id))

    def done(self, key: str) -> dict | None:
        row = self.db.execute("SELECT * FROM trials WHERE key = ? AND status != 'running'", (key,)).fetchone()
        return self._row(row) if row else None

    def trials(self) -> list[dict]:
        return [self._row(r) for r in self.db.execute("SELECT * FROM trials ORDER BY id").fetchall()]

    def _row(self, r: tuple) -> dict:
        cols = [d[0] for d in self.db.execute("SELECT * FROM trials LIMIT 0").description]
        d = dict(zip(cols, r))
        for k in ("knobs", "metrics", "findings"):
            d[k] = json.loads(d[k]) if d.get(k) else ({} if k != "findings" else [])
        return d

    def close(self) -> None:
        self.db.close()

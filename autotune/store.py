"""Results store: every trial of a sweep in one SQLite file, written atomically, so a killed sweep resumes.

One row per trial key (the knob values, canonical JSON). A trial is inserted as ``running`` in one
transaction before its process starts (with the run dir and, once started, the process group id) and
completed to ``ok`` / ``failed`` with its objective, metrics, findings, failure kind and reason, and
the guided search's decision in another. SQLite (WAL journal, synchronous=FULL) makes each of these
all-or-nothing on disk, so a sweep killed at any instant leaves finished trials complete and at most
the trials it was running as ``running`` rows. On resume such a row is run again (same id, same run dir;
what the killed attempt left there is moved to ``interrupted/`` first, never deleted): it never finished,
so it is not a repeat. A finished key is never run twice: :meth:`Store.done` answers for it.

Trial dirs are stored by name, relative to the store (``trials/t003``), and rows give ``run_dir`` as that
name under the store's own ``trials/``: a sweep directory that is copied or moved refers to its own trial
dirs, never to the place it was made (a store written by an older version kept absolute paths; only their
last part, the trial dir's name, is read).

Tables are prefixed ``autotune_`` so that other tools (e.g. Optuna's RDB storage, which has its own
``trials`` table) can share the file.

One writer at a time: opening the store takes an exclusive ``flock`` on ``<store>.lock`` beside it
(the holder's pid is written in it) and keeps it until :meth:`Store.close` or the process ends, however
it ends (the kernel drops the lock of a killed process; the descriptor is not inherited by trial
processes). A second opener gets :class:`StoreLocked` naming the store and the holder's pid instead of
reaping the live sweep's trial. Every error of the store (locked, not a database, damaged, unwritable)
is a :class:`StoreError` whose one-line message starts with the file.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: no lock (the trainer and the runner are Linux-only anyway)
    fcntl = None  # type: ignore[assignment]

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
    run_dir TEXT NOT NULL,   -- trials/<name>, relative to the store's directory (older stores: absolute)
    pgid INTEGER,            -- process group of the running trial (to reap orphans after a kill)
    attempts INTEGER NOT NULL DEFAULT 1,
    started REAL,
    finished REAL
);
CREATE TABLE IF NOT EXISTS autotune_meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
"""
STATUSES = ("ok", "failed")
TRIAL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a trial dir's name: no separator, never "." or ".."
COLUMNS = ("id", "key", "knobs", "status", "failure", "reason", "objective", "metrics", "findings", "motivation",
           "parent", "decision", "run_dir", "pgid", "attempts", "started", "finished")


class StoreError(ValueError):
    """The store cannot be opened, read or written: one line that starts with the file."""


class StoreLocked(StoreError):
    """Another process holds the store's lock (a sweep is running on it)."""


def _named(fn):
    """Turn SQLite errors (and undecodable stored JSON) of a store method into a StoreError naming the file."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except StoreError:
            raise
        except (sqlite3.Error, UnicodeDecodeError) as e:  # SQLite's message may quote damaged bytes
            raise StoreError(f"{self.path}: {_describe(e)}") from None

    return wrapper


def _describe(e: Exception) -> str:
    if isinstance(e, UnicodeDecodeError):
        return "not a readable sweep store (SQLite reported damaged, undecodable content)"
    msg = " ".join(str(e).split()) or type(e).__name__
    msg = "".join(c if c.isprintable() else "?" for c in msg)[:300]  # it may quote damaged bytes
    if isinstance(e, sqlite3.DatabaseError) and ("not a database" in msg or "malformed" in msg):
        return f"not a readable sweep store ({msg})"
    return msg


class Store:
    """The sweep's SQLite file. Every write is one transaction; one writer at a time (``lock``)."""

    def __init__(self, path: str | Path, lock: bool = True):
        self.path = Path(path).absolute()
        self.trials_dir = self.path.parent / "trials"  # every row's run dir is a child of this one
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._lock_fd: int | None = None
        self.db: sqlite3.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{self.path}: cannot create its directory ({e.strerror or e})") from None
        if lock:
            self._lock()
        try:
            self.db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            bad = [r[0] for r in self.db.execute("PRAGMA quick_check").fetchall() if r[0] != "ok"]
            if bad:
                raise StoreError(f"{self.path}: damaged sweep store (integrity check: {' '.join(bad[0].split())[:200]})")
            self.db.executescript(SCHEMA)
            cols = [r[1] for r in self.db.execute("PRAGMA table_info(autotune_trials)").fetchall()]
            missing = [c for c in COLUMNS if c not in cols]
            if missing:
                raise StoreError(f"{self.path}: its autotune_trials table is not a sweep store's "
                                 f"(no column {', '.join(missing)})")
        except (sqlite3.Error, StoreError, UnicodeDecodeError) as e:
            self.close()
            if isinstance(e, StoreError):
                raise
            raise StoreError(f"{self.path}: {_describe(e)}") from None

    def _lock(self) -> None:
        """Exclusive, non-blocking flock on ``<store>.lock``; the lock file keeps the holder's pid."""
        if fcntl is None:
            return
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreError(f"{self.path}: cannot open its lock file {self.lock_path} ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").split()
            except OSError:
                holder = []
            os.close(fd)
            pid = holder[0] if holder and holder[0].isdigit() else "unknown"
            raise StoreLocked(f"{self.path}: in use by another sweep (pid {pid} holds {self.lock_path}); "
                              "wait for it to end or stop it, then --resume") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    # ---------------------------------------------------------------- meta (sweep-level facts)
    @_named
    def set_meta(self, k: str, v: Any) -> None:
        with self._tx():
            self.db.execute("INSERT OR REPLACE INTO autotune_meta VALUES (?, ?)", (k, json.dumps(v, default=str)))

    @_named
    def get_meta(self, k: str, default: Any = None, kind: type | tuple[type, ...] | None = None) -> Any:
        """The stored value of ``k`` (``default`` if none); with ``kind``, a value of another type is a
        StoreError (a damaged or hand-edited store)."""
        row = self.db.execute("SELECT v FROM autotune_meta WHERE k = ?", (k,)).fetchone()
        if row is None:
            return default
        v = self._json(row[0], f"meta {k!r}")
        if kind is not None and (not isinstance(v, kind) or isinstance(v, bool)):
            raise StoreError(f"{self.path}: meta {k!r} holds a {type(v).__name__}, not a sweep's value (damaged store?)")
        return v

    # ---------------------------------------------------------------- trials
    @_named
    def start(self, key: str, knobs: dict, run_dir: str | Path, motivation: str = "", parent: int | None = None) -> dict:
        """Mark a trial running and return its row. ``run_dir`` names the trial's dir in the store's ``trials/``
        (its last part is taken: ``t003`` or ``.../trials/t003``). A ``running`` row of the same key (a trial a
        killed sweep never finished) is reused: same id and run dir, one more attempt. A finished key is an error."""
        name = Path(run_dir).name
        if not TRIAL_NAME.fullmatch(name):
            raise StoreError(f"{self.path}: {str(run_dir)[:80]!r} is not a trial dir name")
        with self._tx():
            row = self.db.execute("SELECT * FROM autotune_trials WHERE key = ?", (key,)).fetchone()
            if row is not None and row["status"] != "running":
                raise StoreError(f"{self.path}: trial {key} already finished (id {row['id']}); it is never run twice")
            if row is not None:
                self.db.execute("UPDATE autotune_trials SET attempts = attempts + 1, started = ?, pgid = NULL, "
                                "motivation = ?, parent = ? WHERE id = ?", (time.time(), motivation, parent, row["id"]))
                tid = row["id"]
            else:
                cur = self.db.execute(
                    "INSERT INTO autotune_trials (key, knobs, status, motivation, parent, run_dir, started) "
                    "VALUES (?, ?, 'running', ?, ?, ?, ?)",
                    (key, json.dumps(knobs, sort_keys=True, default=str), motivation, parent, f"trials/{name}",
                     time.time()))
                tid = int(cur.lastrowid)
        return self.get(tid)

    @_named
    def set_pgid(self, trial_id: int, pgid: int | None) -> None:
        with self._tx():
            self.db.execute("UPDATE autotune_trials SET pgid = ? WHERE id = ?", (pgid, trial_id))

    @_named
    def finish(self, trial_id: int, status: str, objective: float | None, metrics: dict, findings: list,
               failure: str | None = None, reason: str | None = None, decision: str | None = None) -> dict:
        """Complete a running trial in one transaction and return its row."""
        if status not in STATUSES:
            raise StoreError(f"{self.path}: status must be one of {STATUSES}, got {status!r}")
        with self._tx():
            n = self.db.execute(
                "UPDATE autotune_trials SET status = ?, objective = ?, metrics = ?, findings = ?, failure = ?, "
                "reason = ?, decision = ?, pgid = NULL, finished = ? WHERE id = ? AND status = 'running'",
                (status, objective, json.dumps(metrics, default=str), json.dumps(findings, default=str), failure,
                 reason, decision, time.time(), trial_id)).rowcount
            if n != 1:
                raise StoreError(f"{self.path}: trial {trial_id} is not running (another sweep on this store?)")
        return self.get(trial_id)

    @_named
    def get(self, trial_id: int) -> dict:
        return self._row(self.db.execute("SELECT * FROM autotune_trials WHERE id = ?", (trial_id,)).fetchone())

    @_named
    def lookup(self, key: str) -> dict | None:
        row = self.db.execute("SELECT * FROM autotune_trials WHERE key = ?", (key,)).fetchone()
        return self._row(row) if row else None

    def done(self, key: str) -> dict | None:
        """The finished trial with these knobs, or None (never run, or killed while running)."""
        t = self.lookup(key)
        return t if t is not None and t["status"] != "running" else None

    @_named
    def trials(self, finished_only: bool = False) -> list[dict]:
        q = "SELECT * FROM autotune_trials" + (" WHERE status != 'running'" if finished_only else "") + " ORDER BY id"
        return [self._row(r) for r in self.db.execute(q).fetchall()]

    @_named
    def running(self) -> list[dict]:
        return [self._row(r) for r in self.db.execute(
            "SELECT * FROM autotune_trials WHERE status = 'running' ORDER BY id").fetchall()]

    @_named
    def next_run_dir_index(self) -> int:
        return int(self.db.execute("SELECT COALESCE(MAX(id), 0) FROM autotune_trials").fetchone()[0])

    def _row(self, r: sqlite3.Row | None) -> dict:
        if r is None:
            raise StoreError(f"{self.path}: no such trial")
        d = dict(r)
        what = f"trial {d.get('id')}"
        d["knobs"] = self._json(d["knobs"], what)
        d["metrics"] = self._json(d["metrics"], what) if d.get("metrics") else {}
        d["findings"] = self._json(d["findings"], what) if d.get("findings") else []
        stored = d["run_dir"]
        name = stored.replace("\\", "/").rsplit("/", 1)[-1] if isinstance(stored, str) else None
        # the trial's dir under this store's trials/, wherever the store was made (copied or moved sweeps)
        d["run_dir"] = str(self.trials_dir / name) if name and TRIAL_NAME.fullmatch(name) else stored
        num = lambda x: x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))  # noqa: E731
        bad = next((c for c, ok in (
            ("key", isinstance(d["key"], str)), ("knobs", isinstance(d["knobs"], dict)),
            ("status", d["status"] in ("running",) + STATUSES), ("metrics", isinstance(d["metrics"], dict)),
            ("findings", isinstance(d["findings"], list) and all(isinstance(f, dict) for f in d["findings"])),
            ("objective", num(d["objective"]) and (d["status"] != "ok" or d["objective"] is not None)
             and (d["objective"] is None or abs(d["objective"]) < float("inf"))),  # inf and nan never measured
            ("run_dir", isinstance(stored, str) and d["run_dir"] != stored),
            ("pgid", d["pgid"] is None or isinstance(d["pgid"], int)),
        ) if not ok), None)
        if bad is not None:
            raise StoreError(f"{self.path}: {what} has an impossible {bad} ({str(d[bad])[:60]!r}; damaged store?)")
        return d

    def _json(self, text: Any, what: str) -> Any:
        try:
            return json.loads(text)
        except (TypeError, ValueError):
            raise StoreError(f"{self.path}: {what} holds a value that is not JSON (damaged store?)") from None

    def _tx(self):
        return _Transaction(self.db)

    def close(self) -> None:
        """Close the database and release the lock (idempotent)."""
        if self.db is not None:
            try:
                self.db.close()
            finally:
                self.db = None
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)  # drops the flock; the lock file stays (unlinking it would race a waiting opener)


def open_sweep_store(out: str | Path) -> Store:
    """``OUT/sweep.sqlite`` of a sweep, locked, after checking that it accounts for every trial dir in
    ``OUT/trials``. A zero-byte, deleted or older store does not know of some of them, and a trial runs
    in a cleared dir, so going on would delete results: that is refused (StoreError, one line naming
    the file and what to do), as is a damaged store. Nothing is deleted or changed either way (a missing or
zero-byte store is refused before it is opened, which would create it or write its schema)."""
    out = Path(out)
    db, tdir = out / "sweep.sqlite", out / "trials"
    what = "is missing" if not db.exists() else ("is empty (0 bytes)" if db.is_file() and db.stat().st_size == 0 else "")

    def unaccounted(unknown: list[str], rows: bool) -> StoreError:
        names = ", ".join(unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        if not rows:
            return StoreError(f"{db}: {what or 'holds no trials'}, but {tdir} holds {len(unknown)} trial dir(s) "
                              f"it cannot account for ({names}); nothing was deleted: restore the sweep's "
                              f"sweep.sqlite to resume it, or move {tdir} away (or choose another output "
                              "directory) to start a new sweep")
        return StoreError(f"{tdir}: {len(unknown)} dir(s) not in the store {db} ({names}); nothing was deleted: "
                          "move them away, or choose another output directory")

    def trial_dirs() -> list[str]:
        try:
            return sorted(p.name for p in tdir.iterdir()) if tdir.is_dir() else []
        except OSError as e:
            raise StoreError(f"{tdir}: cannot list the trial dirs ({e.strerror or e})") from None

    if what and (dirs := trial_dirs()):  # refused before opening: opening would create (or fill) the store
        raise unaccounted(dirs, rows=False)
    try:
        store = Store(db)
    except StoreLocked:
        raise
    except StoreError as e:
        if not db.exists():  # OUT cannot hold a store (a file on its path): there is nothing to restore or move
            raise
        raise StoreError(f"{e}; nothing was deleted: restore it to resume, or move it (and {tdir}) away to start "
                         "a new sweep") from None
    try:
        rows = store.trials()
        known = {Path(t["run_dir"]).name for t in rows}
        unknown = [d for d in trial_dirs() if d not in known]
        if unknown:
            raise unaccounted(unknown, rows=bool(rows))
    except BaseException:
        store.close()
        raise
    return store


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

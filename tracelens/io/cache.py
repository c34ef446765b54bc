"""Parquet cache of parsed traces, keyed by the content of the trace file.

Key = BLAKE2b of the file's bytes (as stored on disk, so a gzip file is hashed compressed) plus the
loader's schema version: editing or replacing the file changes the key, so a stale entry is never
read; a loader change that alters the tables bumps SCHEMA_VERSION. Entries are written to a temporary
name and renamed, so a killed process never leaves a half-written entry that later reads as valid.

Location: $TRACELENS_CACHE_DIR, else $XDG_CACHE_HOME/tracelens, else ~/.cache/tracelens.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .kineto import SCHEMA_VERSION, ParsedTrace


def cache_dir() -> Path:
    env = os.environ.get("TRACELENS_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tracelens"


def content_key(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    h.update(f"schema{SCHEMA_VERSION}".encode())
    return h.hexdigest()


def _entry(root: Path, key: str) -> Path:
    return root / "traces" / key[:2] / key


def load(path: str, key: str, root: Path | None = None) -> ParsedTrace | None:
    d = _entry(root or cache_dir(), key)
    try:
        meta = json.loads((d / "meta.json").read_text())
        tables = {name: pq.read_table(d / f"{name}.parquet", memory_map=True) for name in ("events", "threads")}
        flows = d / "flows.parquet"  # absent when the parse left flow events for later
        tables["flows"] = pq.read_table(flows, memory_map=True) if flows.exists() else None
    except (OSError, ValueError, pa.ArrowException):
        return None
    meta["path"] = path
    return ParsedTrace(path=path, events=tables["events"], flows=tables["flows"], threads=tables["threads"], meta=meta)


def store(parsed: ParsedTrace, key: str, root: Path | None = None) -> None:
    """Best effort: a read-only or full disk must not fail the analysis."""
    final = _entry(root or cache_dir(), key)
    if final.exists():
        return
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-"))
        for name in ("events", "flows", "threads"):
            if getattr(parsed, name) is not None:
                pq.write_table(getattr(parsed, name), tmp / f"{name}.parquet", compression="zstd")
        (tmp / "meta.json").write_text(json.dumps(parsed.meta, default=str))
        os.rename(tmp, final)
    except OSError:
        pass

"""Parquet cache of parsed traces, keyed by the content of the trace file.

Key = SHA-256 (first 128 bits) of the file's bytes (as stored on disk, so a gzip file is hashed
compressed) plus the loader's schema version: editing or replacing the file changes the key, so a stale entry is never
read; a loader change that alters the tables bumps SCHEMA_VERSION. Entries are written to a temporary
name and renamed, so a killed process never leaves a half-written entry that later reads as valid.

SHA-256 because CPUs have instructions for it (SHA-NI, x86 since ~2017): 0.11 s for 200 MB where
BLAKE2b takes 0.24 s. Hashing is still a third of a warm load, so the key of a file is remembered
under its identity (`key_of`: device, inode, size, mtime and ctime in ns, a digest of its first and
last 64 KiB, the schema version). Writing to the file or replacing it changes its ctime (and inode), so
a remembered key is reused only for the same bytes.

Location: $TRACELENS_CACHE_DIR, else $XDG_CACHE_HOME/tracelens, else ~/.cache/tracelens.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from typing import TYPE_CHECKING

from .schema import SCHEMA_VERSION

if TYPE_CHECKING:  # pragma: no cover
    from .kineto import ParsedTrace

# pyarrow is imported by `load` and `store` only: computing a key and asking whether an entry exists
# stay light, so `prefetch.py` can do both before pyarrow and pandas are imported.


def cache_dir() -> Path:
    env = os.environ.get("TRACELENS_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tracelens"


def content_key(path: str, raw: bytes | None = None) -> str:
    """The cache key of the file's content; `raw`: its bytes as stored, when already read."""
    h = hashlib.sha256()
    if raw is not None:
        h.update(raw)
    else:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    h.update(f"schema{SCHEMA_VERSION}".encode())
    return h.hexdigest()[:32]


def identity(path: str) -> str:
    """Who the file is and which version of it: stat fields plus a digest of its first and last 64 KiB
    (which catches a rewrite on a file system with coarse timestamps) and the loader schema."""
    st = os.stat(path)
    h = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        h.update(f.read(1 << 16))
        if st.st_size > 1 << 17:
            f.seek(-(1 << 16), os.SEEK_END)
            h.update(f.read())
    return (f"schema{SCHEMA_VERSION}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:"
            f"{h.hexdigest()}")


def _memo(path: str, root: Path | None) -> Path:
    return (root or cache_dir()) / "keys" / hashlib.blake2b(os.path.realpath(path).encode(), digest_size=16).hexdigest()


def known_key(path: str, root: Path | None = None) -> str | None:
    """The key remembered for this exact file version, without hashing; None when there is none."""
    try:
        known, key = _memo(path, root).read_text().split("\n")[:2]
        if known == identity(path) and len(key) == 32:
            return key
    except (OSError, ValueError):
        pass
    return None


def key_of(path: str, root: Path | None = None, raw: bytes | None = None, ident: str | None = None) -> str:
    """content_key(path), reusing the key remembered for this exact file version when there is one.
    raw: the file's bytes as stored, when the caller has read them (hashed instead of reading again);
    then ident must be `identity(path)` taken before they were read, so a write during the read is seen."""
    if raw is not None and ident is None:
        raise ValueError("key_of: raw bytes need the identity taken before they were read")
    ident = ident or identity(path)
    memo = _memo(path, root)
    try:
        known, key = memo.read_text().split("\n")[:2]
        if known == ident and len(key) == 32:
            return key
    except (OSError, ValueError):
        pass
    key = content_key(path, raw)
    if identity(path) == ident:  # unchanged while it was read: safe to remember
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
            tmp.write_text(f"{ident}\n{key}\n")
            os.replace(tmp, memo)
        except OSError:
            pass  # best effort, like the cache itself
    return key


def _entry(root: Path, key: str) -> Path:
    return root / "traces" / key[:2] / key


def exists(key: str, root: Path | None = None) -> bool:
    """Whether the cache holds an entry for this key (entries appear whole, by rename)."""
    return (_entry(root or cache_dir(), key) / "meta.json").exists()


def load(path: str, key: str, root: Path | None = None) -> ParsedTrace | None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .kineto import ParsedTrace

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
    import pyarrow.parquet as pq

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

"""Cache of parsed traces (Arrow IPC files, zstd), keyed by the content of the trace file.

Key = XXH3-128 (xxhash) of the file's bytes (as stored on disk, so a gzip file is hashed
compressed) plus the loader's schema version: editing or replacing the file changes the key, so a stale entry is never
read; a loader change that alters the tables bumps SCHEMA_VERSION. Entries are written to a temporary
name and renamed, so a killed process never leaves a half-written entry that later reads as valid.

XXH3-128 because it is the fastest well-kept 128-bit hash: 25 ms for 200 MB on the device machine's CPU where
SHA-256 (with the CPU's SHA instructions) took 147 and BLAKE2b 428 (stop 31). It is not a cryptographic hash: a
file crafted to collide with another's key would still have to match its size and its first and last 64 KiB to be
served that file's entry (`fetch`), and the cache is the user's own. The key of a file is remembered
under its identity (`key_of`: device, inode, size, mtime and ctime in ns, a digest of its first and
last 64 KiB, the schema version). Writing to the file or replacing it changes its ctime (and inode), so
a remembered key is reused only for the same bytes; where the time stamps cannot show a rewrite (a file
system with whole-second stamps) nothing is remembered and the bytes are hashed on every load (`_trusted`).

The key is always the hash of the very bytes that are parsed: a load reads the file once, hashes that
buffer and parses it (`key_of(..., raw=...)`), so a file replaced between hashing and parsing cannot
leave one version's tables under the other's key (a large uncompressed file is scanned from its memory map
first and the same map hashed after, in a thread beside the analysis: `store_later`, written only when the
file's stamps are still those it had when mapped). An entry records its key, the size and head/tail
digest of the file it was made from, and a seal (SHA-256 over the key, its meta and a fingerprint of
its tables: row counts, ts range, dur sum); `fetch` checks all three against the key and the file
being loaded before serving it, so an entry whose content disagrees with its key (meta of another
rank, tables of another trace, a hand-edited meta.json) is rejected, and the loader re-parses the
file and replaces the entry (with a one-line warning).

What a store killed half-way leaves (a staging directory, a remembered key's temporary file) is swept by
the next store (`sweep_stale`): at once when its owner on this host is dead, after an hour otherwise.

Location: $TRACELENS_CACHE_DIR, else $XDG_CACHE_HOME/tracelens, else ~/.cache/tracelens.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from .schema import SCHEMA_VERSION

if TYPE_CHECKING:  # pragma: no cover
    from .kineto import ParsedTrace

# An entry's tables: Arrow IPC files (Feather v2), zstd-compressed, one record batch each. Parquet (zstd) took
# ~0.5 s of CPU to write the events of a 200 MB trace and 0.15 s to read them; these take ~0.07 s and ~0.04 s, at
# ~2/3 of the size (docs/performance.md). The format is part of the key (SCHEMA_VERSION 7).
TABLE_SUFFIX = ".arrow"

# pyarrow is imported by `load` and `store` only: computing a key and asking whether an entry exists
# stay light, so `prefetch.py` can do both before pyarrow and pandas are imported.


def cache_dir() -> Path:
    env = os.environ.get("TRACELENS_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tracelens"


def unusable(root: Path | None = None) -> str | None:
    """Why the cache directory cannot hold entries (a path that exists and is not a directory: a mistyped
    TRACELENS_CACHE_DIR naming a file), None when it can or will be made; one stat."""
    root = root or cache_dir()
    if root.exists() and not root.is_dir():
        named = " (TRACELENS_CACHE_DIR)" if os.environ.get("TRACELENS_CACHE_DIR") and root == cache_dir() else ""
        return f"cache directory {root}{named} is not a directory"
    return None


_HASH_CHUNK = 16 << 20  # bytes of a memory-mapped file hashed at a time (then its pages are given back)


def _hash_mapped(h, mm: mmap.mmap) -> None:
    """Hash a memory-mapped file a chunk at a time, dropping each chunk's pages once hashed (MADV_DONTNEED: the
    scan that follows reads them again from the page cache), so the file never sits in the process whole."""
    with memoryview(mm) as view:
        for lo in range(0, len(mm), _HASH_CHUNK):
            hi = min(lo + _HASH_CHUNK, len(mm))
            h.update(view[lo:hi])
            end = hi - hi % mmap.PAGESIZE
            if end > lo:
                mm.madvise(mmap.MADV_DONTNEED, lo, end - lo)


def content_key(path: str, raw: bytes | mmap.mmap | None = None) -> str:
    """The cache key of the file's content; `raw`: its bytes as stored, when already read, or the file
    memory-mapped (`scanner.map_file`), which is hashed a chunk at a time. XXH3-128 (xxhash): a 128-bit hash
    for finding a file's own entry again, 6x faster than SHA-256 on the device machine's CPU (25 vs 147 ms
    for 200 MB; docs/performance.md); no entry is trusted on the key alone (`fetch` compares the entry's
    recorded size and head/tail digest with the file). Keys of SHA-256 (before) name no entry now."""
    h = xxhash.xxh3_128()
    if isinstance(raw, mmap.mmap):
        _hash_mapped(h, raw)
    elif raw is not None:
        h.update(raw)
    else:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    h.update(f"schema{SCHEMA_VERSION}".encode())
    return h.hexdigest()[:32]


_EDGE = 1 << 16  # bytes of the head and of the tail in a file's identity


def _edge_digest(head: bytes, tail: bytes) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(head)
    h.update(tail)
    return h.hexdigest()


# A remembered key stands for a file version only where a rewrite is bound to change the identity. Not on a file
# system with whole-second time stamps (FAT, some network and FUSE file systems, HFS+): a same-size rewrite of
# the middle within the same second keeps size, mtime, ctime and the head/tail digest, and would be served
# the old tables. There (mtime and ctime both whole seconds) the bytes are hashed on every load. (On ext4, xfs,
# btrfs, tmpfs the stamps have ns digits and move on every write by at least the kernel's clock tick, <= 10 ms:
# only a writer that rewrites the same bytes' size twice within one tick, around the load's read, goes unseen.)


def _stat(path: str) -> os.stat_result:
    return os.stat(path)


def _stamps(ident: str) -> tuple[int, int]:
    parts = ident.split(":")
    return int(parts[4]), int(parts[5])


def coarse_stamps(ident: str) -> bool:
    """Whether the identity's mtime and ctime are both whole seconds (a file system with 1-second stamps)."""
    return all(t % 1_000_000_000 == 0 for t in _stamps(ident))


def _trusted(ident: str) -> bool:
    """Whether a key may be remembered for (and reused under) this identity (see RACY_S)."""
    return not coarse_stamps(ident)


def identity(path: str) -> str:
    """Who the file is and which version of it: stat fields plus a digest of its first and last 64 KiB
    and the loader schema (a remembered key is reused under it only where that is safe: `_trusted`)."""
    st = _stat(path)
    with open(path, "rb") as f:
        head = f.read(_EDGE)
        tail = b""
        if st.st_size > 2 * _EDGE:
            f.seek(-_EDGE, os.SEEK_END)
            tail = f.read()
    return (f"schema{SCHEMA_VERSION}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:"
            f"{_edge_digest(head, tail)}")


def source_of(raw: bytes | mmap.mmap) -> dict:
    """Size and head/tail digest of a file's bytes as stored: what `identity` sees of the same file
    (recorded in a cache entry, compared with the file being loaded before the entry is served)."""
    tail = raw[-_EDGE:] if len(raw) > 2 * _EDGE else b""
    return {"size": len(raw), "digest": _edge_digest(raw[:_EDGE], tail)}


def source_of_identity(ident: str) -> dict:
    parts = ident.split(":")
    return {"size": int(parts[3]), "digest": parts[6]}


def _memo(path: str, root: Path | None) -> Path:
    return (root or cache_dir()) / "keys" / hashlib.blake2b(os.path.realpath(path).encode(), digest_size=16).hexdigest()


def known_key(path: str, root: Path | None = None) -> str | None:
    """The key remembered for this exact file version, without hashing; None when there is none."""
    return remembered(path, root)[0]


def remembered(path: str, root: Path | None = None) -> tuple[str | None, str]:
    """(the key remembered for the file's current identity or None, that identity); OSError when the
    file cannot be read."""
    ident = identity(path)
    if not _trusted(ident):
        return None, ident
    try:
        known, key = _memo(path, root).read_text().split("\n")[:2]
        if known == ident and len(key) == 32:
            return key, ident
    except (OSError, ValueError):
        pass
    return None, ident


def key_of(path: str, root: Path | None = None, raw: bytes | mmap.mmap | None = None, ident: str | None = None) -> str:
    """content_key(path), reusing the key remembered for this exact file version when there is one.
    raw: the file's bytes as stored, when the caller has read them (hashed instead of reading again), or
    the file memory-mapped (the scan that follows checks that it did not change since it was mapped:
    `scanner.Mapped.check`); then ident must be `identity(path)` taken before they were read (mapped), so a
    write during the read is seen."""
    if raw is not None and ident is None:
        raise ValueError("key_of: raw bytes need the identity taken before they were read")
    ident = ident or identity(path)
    memo = _memo(path, root)
    if not _trusted(ident):
        return content_key(path, raw)  # hashed on every load (coarse time stamps)
    try:
        known, key = memo.read_text().split("\n")[:2]
        # with raw bytes, the remembered key stands for them only if the file did not change while
        # they were read; otherwise the bytes themselves are hashed (the key of what is parsed)
        if known == ident and len(key) == 32 and (raw is None or identity(path) == ident):
            return key
    except (OSError, ValueError):
        pass
    key = content_key(path, raw)
    if identity(path) == ident:  # unchanged while it was read: safe to remember
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f".{memo.name}.{_owner()}")
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


def _fingerprint(events, flows, threads) -> dict:
    """What the tables of an entry are, cheaply and whatever their chunking (a file read gives one
    chunk per row group): row counts, the ts range and the dur sum of the events (tables of another
    trace differ in these). pyarrow.compute over the memory-mapped columns, no copies: ~2 ms for
    500K events."""
    import pyarrow.compute as pc

    ts = pc.min_max(events["ts"])
    return {
        "events": int(events.num_rows),
        "ts": [ts["min"].as_py(), ts["max"].as_py()],
        "dur_sum": pc.sum(events["dur"]).as_py(),
        "threads": int(threads.num_rows),
        "flows": None if flows is None else int(flows.num_rows),
    }


def _seal(key: str, meta: dict, fingerprint: dict) -> str:
    body = json.dumps({"key": key, "meta": meta, "tables": fingerprint}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()


def fetch(path: str, key: str, root: Path | None = None, source: dict | None = None
          ) -> tuple[ParsedTrace | None, str | None]:
    """The entry for `key`, checked before it is served: (parsed, None) when it holds; (None, None)
    when there is none; (None, why) when it cannot be read or disagrees with its key or with the file
    being loaded (source: `source_of` its bytes, or `source_of_identity` of its identity)."""
    import pyarrow as pa
    from pyarrow import feather

    from .kineto import ParsedTrace

    d = _entry(root or cache_dir(), key)
    try:
        meta = json.loads((d / "meta.json").read_text())
        tables = {name: feather.read_table(d / f"{name}{TABLE_SUFFIX}", memory_map=True) for name in ("events", "threads")}
        flows = d / f"flows{TABLE_SUFFIX}"  # absent when the parse left flow events for later
        tables["flows"] = feather.read_table(flows, memory_map=True) if flows.exists() else None
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, pa.ArrowException) as e:
        return None, f"unreadable ({type(e).__name__})"
    check = meta.pop("cache", None) if isinstance(meta, dict) else None
    if not isinstance(check, dict):
        return None, "no integrity record"
    if check.get("key") != key:
        return None, f"it records key {str(check.get('key'))[:12]}..., not {key[:12]}..."
    try:
        fp = _fingerprint(tables["events"], tables["flows"], tables["threads"])
    except (KeyError, ValueError, TypeError, pa.ArrowException):
        return None, "tables without the loader's columns"
    if check.get("seal") != _seal(key, meta, fp):
        return None, "its meta or tables were changed after it was written"
    if source is not None and check.get("source") != source:
        return None, "it was made from another file (size or head/tail digest differ)"
    meta["path"] = path
    return ParsedTrace(path=path, events=tables["events"], flows=tables["flows"], threads=tables["threads"], meta=meta), None


def load(path: str, key: str, root: Path | None = None, source: dict | None = None) -> ParsedTrace | None:
    """The entry for `key` if there is one that holds (see `fetch`), else None."""
    return fetch(path, key, root, source)[0]


def store(parsed: ParsedTrace, key: str, root: Path | None = None, source: dict | None = None,
          replace: bool = False) -> None:
    """Write the entry for `key` (source: `source_of(raw)` of the bytes parsed). replace: an entry
    that failed its check is swapped for this one. Best effort: a read-only or full disk must not fail
    the analysis."""
    root = root or cache_dir()
    if _entry(root, key).exists() and not replace:
        return
    staged = _stage(_tables_of(parsed), _meta_of(parsed), root, _entry(root, key).parent)
    if staged is not None:
        _commit(staged, key, root, source, replace)


def _tables_of(parsed: ParsedTrace) -> dict:
    return {name: getattr(parsed, name) for name in ("events", "flows", "threads")}


def _meta_of(parsed: ParsedTrace) -> dict:
    return json.loads(json.dumps({k: v for k, v in parsed.meta.items() if k not in _TRANSIENT}, default=str))


def _stage(tables: dict, meta: dict, root: Path, where: Path) -> tuple[Path, dict, dict] | None:
    """The entry's tables written into a new staging directory under `where` (a directory of `root/traces`):
    (that directory, meta, the tables' fingerprint); None when it could not be written (best effort). `tables`
    is emptied as they are written."""
    import shutil

    from pyarrow import feather

    sweep_stale(root)
    tmp = None
    try:
        where.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=where, prefix=f".tmp-{_owner()}-"))
        fp = _fingerprint(tables["events"], tables["flows"], tables["threads"])
        for name in ("events", "flows", "threads"):
            table = tables.pop(name)
            if table is not None:
                feather.write_feather(table, tmp / f"{name}{TABLE_SUFFIX}", compression="zstd",
                                      chunksize=max(table.num_rows, 1))
            del table
        staged, tmp = (tmp, meta, fp), None
        return staged
    except OSError:
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _commit(staged: tuple[Path, dict, dict], key: str, root: Path, source: dict | None, replace: bool) -> None:
    """Seal a staged entry (`_stage`) for `key` and rename it into place (or remove it, when an entry for `key`
    exists and is not to be replaced)."""
    import shutil

    tmp, meta, fp = staged
    final = _entry(root, key)
    try:
        if final.exists() and not replace:
            return
        meta["cache"] = {"key": key, "source": source, "seal": _seal(key, meta, fp)}
        (tmp / "meta.json").write_text(json.dumps(meta, default=str))
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():  # replacing a rejected entry: move it aside, then rename the new one in
            old = final.with_name(f".old-{_owner()}-{final.name}")
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)  # readers that mapped its files keep them until unmapped
        os.rename(tmp, final)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


_TRANSIENT = frozenset({"from_cache", "cache_warning", "cache_off"})  # per-load facts, never stored in an entry


# ------------------------------------------------------------------ stores beside the analysis
# A first load of a large uncompressed file (memory-mapped: `scanner.map_file`) scans it at once and leaves its
# key (the hash of the same map, `key_of(..., raw=mapped)`) and the entry's write to a thread that runs while
# the analysis does (one CPU of two is idle then: the analysis is one thread until `summary` forks). The entry is
# the same as a store in line would write; the key is still the hash of the very bytes parsed: the map is
# hashed, and the entry is written only when the file is what it was when mapped (`Mapped.check`, after the
# hash). A later load in this process and the interpreter's exit wait for it, a fork (`tracelens.offload`) for its
# tables to be written (the tables are written first, then the map is hashed).
STAGING = "st"  # the directory of root/traces where `store_later` stages entries before their key is known (not hex:
# never an entry's; `sweep_stale` looks into it as into the others)
_stores: list[tuple[threading.Thread, threading.Event]] = []  # (the thread, set once its tables are written)
_stores_lock = threading.Lock()


def store_later(parsed: ParsedTrace, key_of_bytes, root: Path | None = None, source: dict | None = None) -> None:
    """`store(parsed, key_of_bytes(), root, source)` in a thread (best effort, like `store`: nothing is written
    when key_of_bytes() returns None or raises). The thread takes the tables' references now (the caller may
    let `parsed` go: `trace.assemble` frees the Arrow columns as pandas takes them), writes them first, then
    lets them go and hashes (key_of_bytes), then seals the entry and renames it into place."""
    root = root or cache_dir()
    tables, meta = _tables_of(parsed), _meta_of(parsed)
    del parsed
    written = threading.Event()

    def run() -> None:
        staged = None
        try:
            with contextlib.suppress(Exception):  # best effort: the analysis never depends on the entry
                staged = _stage(tables, meta, root, root / "traces" / STAGING)
            tables.clear()
            with contextlib.suppress(Exception):
                import pyarrow as pa

                pa.default_memory_pool().release_unused()  # Arrow's buffers of the tables just written
        finally:
            written.set()  # what follows (the hash, the rename) uses no Arrow: a fork may happen meanwhile
        if staged is None:
            return
        key = None
        with contextlib.suppress(Exception):
            key = key_of_bytes()
        if key is None:
            import shutil

            shutil.rmtree(staged[0], ignore_errors=True)
            return
        _commit(staged, key, root, source, replace=False)

    t = threading.Thread(target=run, name="tracelens-cache-store")  # not a daemon: the exit waits for it
    with _stores_lock:
        _stores.append((t, written))
    t.start()


def wait_stores(tables_only: bool = False) -> None:
    """Wait for the stores `store_later` started (before a load reads the cache); tables_only: only until they
    have written their tables (before a fork: `tracelens.offload`; Arrow, whose writers and memory pool a fork
    must not catch mid-work, is done then, and the hash that follows may run on beside the child)."""
    if tables_only:
        with _stores_lock:
            pending = list(_stores)
        for _, written in pending:
            written.wait()
        return
    while True:
        with _stores_lock:
            if not _stores:
                return
            t, _ = _stores.pop()
        t.join()


# ------------------------------------------------------------------ leftovers of killed stores
# A store stages an entry in `traces/xx/.tmp-<owner>-<random>/` and renames it into place; a replaced entry is
# moved to `.old-<owner>-<key>` and removed; a remembered key is written to `keys/.<name>.<owner>` and renamed.
# A process killed (kill -9, OOM) between the two steps leaves these behind. <owner> is "<pid>@<host>".
STALE_AFTER_S = 3600.0  # a leftover whose owner cannot be checked (another host, an older name) is removed after this
_SWEPT: set[str] = set()  # roots swept by this process (once is enough: leftovers come from dead processes)
_OWNER_IN_NAME = re.compile(r"(?:^\.tmp-|^\.old-|^\.[0-9a-f]{32}\.)(\d+)@([A-Za-z0-9_]+)")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:64] or "host"


def _owner() -> str:
    return f"{os.getpid()}@{_host()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's), or cannot tell: keep
    return True


def _stale(entry: os.DirEntry, now: float) -> bool:
    """Whether a staging leftover is safe to remove: its owner on this host is dead, or it is older than
    STALE_AFTER_S (an owner on another host, a pid reused since, or a name of an older tracelens)."""
    m = _OWNER_IN_NAME.match(entry.name)
    if m and m.group(2) == _host() and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
        return True
    try:
        return now - entry.stat(follow_symlinks=False).st_mtime > STALE_AFTER_S
    except OSError:
        return False


def sweep_stale(root: Path) -> int:
    """Remove what killed stores left in the cache at ``root`` (see above); once per process and root,
    best effort. Returns how many leftovers were removed."""
    import shutil

    if str(root) in _SWEPT:
        return 0
    _SWEPT.add(str(root))
    now, removed = time.time(), 0
    dirs = []
    try:
        with os.scandir(root / "traces") as it:
            dirs = [e.path for e in it if e.is_dir(follow_symlinks=False) and len(e.name) == 2]
    except OSError:
        pass
    for d in dirs:
        try:
            with os.scandir(d) as it:
                for e in it:
                    if e.name.startswith((".tmp-", ".old-")) and e.is_dir(follow_symlinks=False) and _stale(e, now):
                        shutil.rmtree(e.path, ignore_errors=True)
                        removed += 1
        except OSError:
            continue
    try:
        with os.scandir(root / "keys") as it:
            for e in it:
                if e.name.startswith(".") and e.is_file(follow_symlinks=False) and _stale(e, now):
                    try:
                        os.unlink(e.path)
                        removed += 1
                    except OSError:
                        pass
    except OSError:
        pass
    return removed

"""Start reading and scanning a large trace before the analysis modules are imported.

`tracelens.load` is called in a fresh process more often than not (the CLI, CI jobs, notebooks'
first cell), and importing pandas and the analyses costs ~0.3-0.6 s. The compiled scanner releases
the GIL, so a thread can read and scan the file meanwhile: `start` does the cheap checks (one file,
large enough, not already in the cache) and hands the file to a thread; `trace.load` picks the
scan up with `take`. Anything unexpected in the thread (an unreadable file, a file the scanner does
not take) is left for the ordinary path, which reads the file again and names the problem: a
prefetch can only make a load faster, never change what it returns or raises.

Once the scan is done, the thread also turns it into the file's tables (`_parse_beside`: numpy and Arrow work,
imported then), while the main thread may still be importing; the load takes them (`from_scan`).

TRACELENS_NO_PREFETCH=1 turns it off (to measure what it saves), TRACELENS_NO_PREFETCH_PARSE=1 the parse in the
thread only. Only the standard library and the compiled extension are imported at the module's import (`scanner`, `cache`'s key functions, `files`): the thread starts
within milliseconds, before numpy, pyarrow or pandas load.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Sequence

from . import cache as _cache
from . import scanner
from .files import discover

MIN_BYTES = 16 << 20  # below this the scan takes less than the thread is worth


class Prefetch:
    """A background read + scan of one trace file (`scanner.Scan`).

    With the cache on, the thread also settles the file's cache key from the bytes it read (one read,
    no second hash in the main thread: `key`), and scans nothing when the cache holds the file."""

    def __init__(self, path: str, cache_root: Path | None, use_cache: bool):
        self.path = path
        self.scan: scanner.Scan | None = None  # set once the scan is done
        self._active: scanner.Scan | None = None  # the scan under way, for progress
        self._key: str | None = None
        self._source: dict | None = None
        self._later: tuple | None = None  # (the map, its identity): the key is hashed after the scan
        self._key_ready = threading.Event()  # set when the key is known, or will not be (no cache, failure)
        self._thread = threading.Thread(target=self._run, args=(cache_root, use_cache), daemon=True,
                                        name="tracelens-prefetch")
        self._thread.start()

    def _run(self, cache_root: Path | None, use_cache: bool) -> None:
        key = None
        try:
            if use_cache:
                key, ident = _cache.remembered(self.path, cache_root)
                if key is not None and _cache.exists(key, cache_root):
                    # a cached file needs no scan (the load checks the entry against this identity)
                    self._key, self._source = key, _cache.source_of_identity(ident)
                    return
            # a large uncompressed file is scanned from a memory map (its bytes never sit in the process whole);
            # a cached load hashes the map a chunk at a time (the key of exactly the bytes scanned: the load
            # checks that the file did not change since it was mapped): first when its key is remembered, after
            # the scan and beside the analysis when it is not (a first load: `later`)
            raw = scanner.map_file(self.path)
            if raw is not None and not use_cache:
                scan = self._active = scanner.Scan(raw)
                del raw
                scan.run()
                self.scan = scan
                _parse_beside(self.path, scan)
                return
            raw = raw if raw is not None else scanner.read_raw(self.path)
            if use_cache and key is None and isinstance(raw, scanner.Mapped):
                # a first load of a large uncompressed file: scanned at once, its map hashed after the scan, in
                # a thread beside the analysis (`cache.store_later`; `later`)
                self._source = _cache.source_of(raw)
                self._later = (raw, ident)
            elif use_cache:  # the key of exactly these bytes (no second read, no second hash)
                self._key = _cache.key_of(self.path, cache_root, raw=raw, ident=ident)
                self._source = _cache.source_of(raw)
            self._key_ready.set()
            if self._key is not None and _cache.exists(self._key, cache_root):
                return  # the same content is cached under another name
            scan = self._active = scanner.Scan(scanner.gunzip(self.path, raw))
            del raw
            scan.run()
            self.scan = scan
            _parse_beside(self.path, scan)
        except Exception:  # noqa: BLE001 - the ordinary path reads the file again and names the problem
            self.scan = None
        finally:
            self._key_ready.set()

    def key(self, path: str) -> str | None:
        """The cache key of `path` as the thread settled it (waiting for it), None if it did not."""
        settled = self.settled(path)
        return settled[0] if settled else None

    def settled(self, path: str) -> tuple[str, dict] | None:
        """(cache key, source: size and head/tail digest of the bytes the key stands for) as the
        thread settled them (waiting for it); None if it did not. A scan handed over by `take` is
        always of the bytes this key was hashed from."""
        if path != self.path:
            return None
        self._key_ready.wait()
        return (self._key, self._source) if self._key is not None and self._source is not None else None

    def later(self, path: str) -> tuple[scanner.Mapped, str, dict] | None:
        """(the map, the identity taken before it was mapped, source) when the thread scanned a large
        uncompressed file without hashing it first (a first load: its key is hashed from the same map after
        the scan, `cache.store_later`); None otherwise (waiting for the thread to settle that)."""
        if path != self.path:
            return None
        self._key_ready.wait()
        if self._later is None or self._source is None:
            return None
        return (*self._later, self._source)

    @property
    def busy(self) -> bool:
        """Whether the thread is still reading or scanning."""
        return self._thread.is_alive()

    def take(self, path: str, progress=None) -> scanner.Scan | None:
        """The finished scan of `path` (None when there is none); progress(fraction) while waiting."""
        if path != self.path:
            return None
        while self._thread.is_alive():
            active = self._active
            if progress is not None and active is not None:
                progress(active.fraction)
            self._thread.join(0.1)
        scan, self.scan, self._active = self.scan, None, None
        if progress is not None and scan is not None:
            progress(1.0)
        return scan


def _parse_beside(path: str, scan: scanner.Scan) -> None:
    """Turn a finished scan into the file's tables in this thread too (`kineto.parse_file`), while the main thread
    may still be importing pandas and the analyses: the checks, the row order and the tables' columns are numpy and
    Arrow work that releases the GIL for its large parts (0.16-0.37 s of one CPU on a 200 MB tile). The result, or
    the exception the parse raised, is left on the scan (`parsed`) for the load to take (`from_scan`), so a bad file
    raises exactly what it raises without the thread. Nothing when the scanner did not take the file (the load's own
    path reads it again) or with TRACELENS_NO_PREFETCH_PARSE=1 (to measure what it saves)."""
    if scan.result is None or os.environ.get("TRACELENS_NO_PREFETCH_PARSE"):
        return
    from .kineto import parse_file  # numpy and pyarrow: imported beside the main thread's imports, after the scan

    try:
        scan.parsed = parse_file(path, flows=False, scan=scan)
    except Exception as e:  # noqa: BLE001 - raised again by the load, in its own thread (`from_scan`)
        scan.parsed = e


def from_scan(path: str, scan: scanner.Scan | None, progress=None, threads: int | None = None):
    """The ParsedTrace of `path` from a prefetch's scan: the one its thread made (`_parse_beside`; the exception it
    raised is raised here), else parsed now (`kineto.parse_file`, which reads the file itself when `scan` is None)."""
    from .kineto import parse_file

    done = getattr(scan, "parsed", None)
    if isinstance(done, BaseException):
        raise done
    if done is not None:
        return done
    return parse_file(path, progress=progress, flows=False, scan=scan, threads=threads)


def start(paths: str | os.PathLike | Sequence[str | os.PathLike], cache: bool = True,
          cache_dir: str | os.PathLike | None = None) -> Prefetch | None:
    """A prefetch of the load's file when it is one large file the compiled scanner would read; None
    otherwise (many files load in a process pool; small ones are not worth a thread)."""
    if not scanner.fast_enabled() or os.environ.get("TRACELENS_NO_PREFETCH"):
        return None
    try:
        files = discover(paths)
        if len(files) != 1 or os.path.getsize(files[0]) < MIN_BYTES:
            return None
    except Exception:  # noqa: BLE001 - bad paths are reported by the load itself
        return None
    return Prefetch(files[0], Path(cache_dir) if cache_dir else None, cache)

"""`tracelens.load` reads and scans a large file in a thread while pandas and the analyses import:
the package imports without pandas, a prefetched load returns exactly what a plain one does, a
cached file is not scanned again, and a broken file still gets the plain path's one-line error."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

import tracelens
from tracelens.errors import TraceError
from tracelens.io import kineto as K
from tracelens.io import prefetch as P

from ..conftest import DIFF_CONTROL, assert_frames_identical

needs_scanner = pytest.mark.skipif(K._kineto_fast is None, reason="compiled scanner not built")


def test_import_is_light_and_names_stay_functions():
    code = ("import sys, tracelens; assert 'pandas' not in sys.modules, 'pandas imported'; "
            "import tracelens.analyzer, tracelens.trace; "
            "assert callable(tracelens.analyze) and tracelens.analyze.__module__ == 'tracelens.analyzer'; "
            "assert tracelens.Trace.__name__ == 'Trace'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_thread_starts_before_numpy_pyarrow_or_pandas_import():
    # prefetch, the scanner's Python side and the cache key need only the standard library
    code = ("import sys, tracelens.io.prefetch, tracelens.io.scanner, tracelens.io.cache; "
            "heavy = [m for m in ('numpy', 'pyarrow', 'pandas', 'msgspec') if m in sys.modules]; "
            "assert not heavy, heavy")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.fixture
def spy(monkeypatch):
    """The prefetches started (any file size), each with what its take() handed over."""
    monkeypatch.setattr(P, "MIN_BYTES", 0)
    started = []
    real_init, real_take = P.Prefetch.__init__, P.Prefetch.take

    def init(self, *a, **k):
        self.handed = []
        started.append(self)
        real_init(self, *a, **k)

    def take(self, path, progress=None):
        scan = real_take(self, path, progress)
        self.handed.append(scan)
        return scan

    monkeypatch.setattr(P.Prefetch, "__init__", init)
    monkeypatch.setattr(P.Prefetch, "take", take)
    return started


@needs_scanner
def test_prefetched_load_equals_a_plain_one(spy, monkeypatch, tmp_path):
    got = tracelens.load(DIFF_CONTROL, cache=False)
    assert len(spy) == 1 and spy[0].handed[0].result is not None  # the load used the thread's scan
    assert type(spy[0].handed[0].parsed).__name__ == "ParsedTrace"  # and the tables the thread made of it
    monkeypatch.setenv("TRACELENS_NO_PREFETCH", "1")
    plain = tracelens.load(DIFF_CONTROL, cache=False)
    assert len(spy) == 1  # no prefetch the second time
    assert_frames_identical(got.events, plain.events)
    assert_frames_identical(got.threads, plain.threads)


@needs_scanner
def test_cached_file_is_not_scanned_again(spy, tmp_path):
    cold = tracelens.load(DIFF_CONTROL, cache=True, cache_dir=tmp_path)
    assert spy[0].handed[0].result is not None and not cold.ranks[0].from_cache
    warm = tracelens.load(DIFF_CONTROL, cache=True, cache_dir=tmp_path)
    spy[1]._thread.join()
    assert warm.ranks[0].from_cache
    assert spy[1].handed == [] and spy[1]._active is None  # the thread saw the entry and scanned nothing
    assert_frames_identical(cold.events, warm.events)


@needs_scanner
def test_first_cached_load_hashes_the_file_once(spy, monkeypatch, tmp_path):
    from tracelens.io import cache as C

    calls = []
    real = C.content_key
    monkeypatch.setattr(C, "content_key", lambda path, raw=None: calls.append(raw is not None) or real(path, raw))
    tracelens.load(DIFF_CONTROL, cache=True, cache_dir=tmp_path)
    assert calls == [True]  # the thread hashed the bytes it read; the main thread took its key
    assert spy[0].key(str(DIFF_CONTROL)) == real(str(DIFF_CONTROL))  # the same key as hashing the file
    assert C.exists(spy[0].key(str(DIFF_CONTROL)), tmp_path)  # and the entry was stored under it
    with pytest.raises(ValueError):
        C.key_of(str(DIFF_CONTROL), tmp_path, raw=b"x")  # raw bytes without the identity before the read


@needs_scanner
def test_broken_file_gets_the_plain_error(spy, tmp_path):
    p = tmp_path / "cut.json"
    with gzip.open(DIFF_CONTROL, "rb") as f:
        p.write_bytes(f.read()[:200_000])
    with pytest.raises(TraceError) as ei:
        tracelens.load(p, cache=False)
    scan = spy[0].handed[0]
    # the scanner gave up (its note stays internal); the user sees the msgspec path's plain error
    assert scan.result is None and scan.error
    msg = str(ei.value)
    assert "\n" not in msg and "cut.json" in msg and "truncated" in msg


@needs_scanner
@pytest.mark.parametrize("cache", [False, True])
def test_a_file_the_thread_cannot_parse_raises_what_a_plain_load_raises(spy, monkeypatch, tmp_path, cache):
    """The scanner takes it, the tables refuse it (every event has a negative duration): the thread keeps the
    exception and the load raises it, the same one line as without the thread."""
    p = tmp_path / "neg.json"
    ev = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": 1, "ts": 10 * i, "dur": -5} for i in range(50)]
    p.write_text(json.dumps({"traceEvents": ev}))
    with pytest.raises(TraceError) as threaded:
        tracelens.load(p, cache=cache, cache_dir=tmp_path / "c")
    assert isinstance(spy[0].handed[0].parsed, TraceError)  # raised in the thread, kept, raised again by the load
    monkeypatch.setenv("TRACELENS_NO_PREFETCH", "1")
    with pytest.raises(TraceError) as plain:
        tracelens.load(p, cache=cache, cache_dir=tmp_path / "c")
    assert str(threaded.value) == str(plain.value) and "\n" not in str(plain.value) and "neg.json" in str(plain.value)


"""A large uncompressed trace is scanned from a memory map whose pages are given back behind the scan
(`scanner.map_file`, `Scan.run`): the tables are exactly those of a load from bytes, the process does
not keep the file's pages, and a file the scanner does not take still gets the msgspec path."""

from __future__ import annotations

import gzip
import mmap

import numpy as np
import pytest

import tracelens
from tracelens.errors import TraceError
from tracelens.io import kineto as K
from tracelens.io import prefetch as P
from tracelens.io import scanner as S

from ..conftest import DIFF_CONTROL, MI250, MOE_LOOP, assert_frames_identical

needs_scanner = pytest.mark.skipif(K._kineto_fast is None, reason="compiled scanner not built")


def _plain(tmp_path, src, name="t.json"):
    p = tmp_path / name
    with gzip.open(src, "rb") as f:
        p.write_bytes(f.read())
    return p


def _mapped_rss_kb(mm: mmap.mmap) -> int:
    """Resident kB of the mapping holding `mm`, from /proc/self/smaps (the kernel's own count)."""
    a = np.frombuffer(mm, dtype=np.uint8)
    addr = a.ctypes.data
    del a
    rss, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's header: start-end perms ...
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                rss = int(line.split()[1])
                break
    assert rss is not None
    return rss


@pytest.fixture
def small_map(monkeypatch):
    monkeypatch.setattr(S, "MAP_MIN", 1 << 16)


def test_only_large_uncompressed_files_are_mapped(tmp_path, small_map, monkeypatch):
    assert S.map_file(str(DIFF_CONTROL)) is None  # gzip: read and gunzipped as before
    p = _plain(tmp_path, DIFF_CONTROL)
    mm = S.map_file(str(p))
    assert isinstance(mm, mmap.mmap) and mm[:] == p.read_bytes()
    monkeypatch.setattr(S, "MAP_MIN", p.stat().st_size + 1)
    assert S.map_file(str(p)) is None  # small: read into memory
    monkeypatch.setattr(S, "MAP_MIN", 1 << 16)
    monkeypatch.setenv("TRACELENS_NO_MMAP", "1")
    assert S.map_file(str(p)) is None
    assert S.map_file(str(tmp_path / "missing.json")) is None  # the ordinary read names the problem


@needs_scanner
def test_scan_gives_the_pages_back(tmp_path, small_map):
    p = _plain(tmp_path, DIFF_CONTROL)  # 28 MB of JSON
    mm = S.map_file(str(p))
    assert _mapped_rss_kb(mm) == 0
    mm[:]  # touching every page makes it resident (the control: the count sees the mapping)
    assert _mapped_rss_kb(mm) * 1024 > 0.5 * len(mm)
    S.release_pages(mm, 0, len(mm))
    assert _mapped_rss_kb(mm) <= mmap.PAGESIZE // 1024  # (the file's last, partial page may stay)
    scan = S.Scan(mm)
    scan.run()
    assert scan.result is not None and scan.result["n_events"] > 0
    assert _mapped_rss_kb(mm) * 1024 < 0.02 * len(mm)


@needs_scanner
@pytest.mark.parametrize("src", [DIFF_CONTROL, MOE_LOOP, MI250], ids=lambda p: p.name)
def test_mapped_load_equals_a_load_from_bytes(tmp_path, small_map, monkeypatch, src):
    p = _plain(tmp_path, src)
    mapped = K.parse_file(p, flows=False)
    monkeypatch.setenv("TRACELENS_NO_MMAP", "1")
    plain = K.parse_file(p, flows=False)
    assert mapped.meta["decoder"] == plain.meta["decoder"] == "compiled"
    # (compared as pandas frames: Arrow's Table.equals holds NaN != NaN in the flops column)
    assert_frames_identical(mapped.events.to_pandas(), plain.events.to_pandas())
    assert_frames_identical(mapped.threads.to_pandas(), plain.threads.to_pandas())
    assert mapped.meta == plain.meta


@needs_scanner
def test_prefetched_mapped_load_equals_a_plain_one(tmp_path, small_map, monkeypatch):
    monkeypatch.setattr(P, "MIN_BYTES", 0)
    p = _plain(tmp_path, DIFF_CONTROL)
    took = []
    real_take = P.Prefetch.take
    monkeypatch.setattr(P.Prefetch, "take", lambda self, path, progress=None: took.append(
        real_take(self, path, progress)) or took[-1])
    got = tracelens.load(p, cache=False)
    assert took and isinstance(took[0].data, mmap.mmap)  # the thread scanned the map
    monkeypatch.setenv("TRACELENS_NO_PREFETCH", "1")
    monkeypatch.setenv("TRACELENS_NO_MMAP", "1")
    plain = tracelens.load(p, cache=False)
    assert_frames_identical(got.events, plain.events)
    assert_frames_identical(got.threads, plain.threads)


@needs_scanner
def test_a_file_the_scanner_does_not_take_goes_the_msgspec_way(tmp_path, small_map):
    p = _plain(tmp_path, DIFF_CONTROL)
    data = p.read_bytes()
    # an escaped key: valid JSON the scanner leaves to the msgspec path
    odd = data.replace(b'"traceEvents"', b'"trace\\u0045vents"', 1)
    q = tmp_path / "odd.json"
    q.write_bytes(odd)
    got = K.parse_file(q, flows=False)
    assert got.meta["decoder"] == "msgspec"
    ref = K.parse_file(p, flows=False, parallel=1)
    assert got.events.num_rows == ref.events.num_rows
    # and a broken one still gets the one-line error naming it
    cut = tmp_path / "cut.json"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError) as ei:
        K.parse_file(cut, flows=False)
    assert "cut.json" in str(ei.value) and "\n" not in str(ei.value)


@needs_scanner
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
def test_cached_load_hashes_and_scans_the_map(tmp_path, small_map, monkeypatch, prefetch):
    """With the cache on (the CLI's default) a large uncompressed file is hashed and scanned from its map, never
    read into memory whole: the key is the file's content key, the pages are given back behind the hash, and the
    first (stored) and second (served from the entry) loads equal a plain load from bytes. (With the prefetch
    thread, a first load scans first and hashes the map after, in a thread beside the analysis:
    `cache.store_later`.)"""
    from tracelens.io import cache as CA

    if prefetch:
        monkeypatch.setattr(P, "MIN_BYTES", 0)
    else:
        monkeypatch.setenv("TRACELENS_NO_PREFETCH", "1")
    p = _plain(tmp_path, DIFF_CONTROL)
    hashed = []
    real_key = CA.content_key
    monkeypatch.setattr(CA, "content_key", lambda path, raw=None: hashed.append(
        (type(raw), _mapped_rss_kb(raw) if isinstance(raw, mmap.mmap) else None, real_key(path, raw))) or hashed[-1][2])
    import tracelens.trace as T

    for mod in (S, T):
        monkeypatch.setattr(mod, "read_raw", lambda path: pytest.fail("a mapped file must not be read whole"))
    first = tracelens.load(p, cache=True, cache_dir=tmp_path / "cache")
    CA.wait_stores()  # a first prefetched load hashes the map after the scan, beside the analysis
    assert len(hashed) == 1 and issubclass(hashed[0][0], mmap.mmap) and hashed[0][1] == 0  # (nothing touched before)
    assert hashed[0][2] == real_key(str(p))  # the key of the file's bytes, as a plain read hashes them
    assert not first.ranks[0].from_cache
    again = tracelens.load(p, cache=True, cache_dir=tmp_path / "cache")
    assert again.ranks[0].from_cache
    monkeypatch.undo()  # read_raw, content_key and MAP_MIN back: the 28 MB file is read into memory, not mapped
    plain = tracelens.load(p, cache=False)
    for got in (first, again):
        assert_frames_identical(got.events, plain.events)
        assert_frames_identical(got.threads, plain.threads)

"""The Parquet cache serves only what belongs to the file being loaded.

- The key is the hash of exactly the bytes that are parsed: a file replaced while it is being loaded
  cannot leave one version's tables under the other version's key (issue 17: the loop trace was read
  as 452 kernels / 22.2 ms instead of 824 / 50.3 ms after such a race).
- An entry is checked against its key and the file before it is served: an entry of another trace
  under this key, an edited meta (another rank), or a remembered key that points at another file's
  entry is rejected with one warning line, the file is parsed again and the entry replaced.

Expected kernel counts come from the raw JSON (`raw_events`), never from the loader.
"""

from __future__ import annotations

import json
import shutil

import pytest

import tracelens
import tracelens.trace as T
from tracelens.io import cache as C
from tracelens.io import prefetch as P
from tracelens.io import scanner

from ..conftest import MOE_GROUPED, MOE_LOOP, raw_events


def _kernels(path) -> int:
    return sum(1 for e in raw_events(path) if e.get("ph") == "X" and e.get("cat") == "kernel")


N_LOOP, N_GROUPED = _kernels(MOE_LOOP), _kernels(MOE_GROUPED)


def _loaded_kernels(trace) -> int:
    return int((trace.events["cat"] == "kernel").sum())


def _replace_after_first_read(monkeypatch, module, target, other: bytes):
    """module.read_raw reads the file, then the file is replaced by `other` (a writer racing the load)."""
    real = module.read_raw
    done = []

    def racing(path):
        raw = real(path)
        if not done and str(path) == str(target):
            done.append(True)
            target.write_bytes(other)
        return raw

    monkeypatch.setattr(module, "read_raw", racing)
    return done


@pytest.mark.parametrize("use_prefetch", [False, True], ids=["plain", "prefetch"])
def test_file_replaced_during_the_load_never_poisons_the_cache(tmp_path, monkeypatch, use_prefetch):
    assert N_LOOP != N_GROUPED
    src = tmp_path / "trace.json.gz"
    src.write_bytes(MOE_LOOP.read_bytes())
    cache = tmp_path / "cache"
    if use_prefetch:
        if not scanner.fast_enabled():
            pytest.skip("the prefetch thread needs the compiled scanner")
        monkeypatch.setattr(P, "MIN_BYTES", 0)
        done = _replace_after_first_read(monkeypatch, scanner, src, MOE_GROUPED.read_bytes())
    else:
        monkeypatch.setenv("TRACELENS_NO_PREFETCH", "1")
        done = _replace_after_first_read(monkeypatch, T, src, MOE_GROUPED.read_bytes())
    first = tracelens.load(src, cache_dir=cache)
    assert done, "the race was not exercised"
    assert _loaded_kernels(first) == N_LOOP  # the tables of the bytes that were read
    monkeypatch.undo()
    monkeypatch.setenv("TRACELENS_NO_PREFETCH", "1")
    # the file now holds the grouped trace: its load must give the grouped tables, cached or not
    for _ in range(2):
        t = tracelens.load(src, cache_dir=cache)
        assert _loaded_kernels(t) == N_GROUPED and not t.warnings
    src.write_bytes(MOE_LOOP.read_bytes())  # and the loop trace again: its own entry
    for _ in range(2):
        t = tracelens.load(src, cache_dir=cache)
        assert _loaded_kernels(t) == N_LOOP and not t.warnings
    assert t.ranks[0].from_cache


def _entry_dir(cache, path) -> "object":
    key = C.known_key(str(path), cache)
    assert key is not None
    return cache / "traces" / key[:2] / key


def _assert_rejected_then_replaced(src, cache, expected_kernels: int):
    t = tracelens.load(src, cache_dir=cache)
    assert _loaded_kernels(t) == expected_kernels
    assert not t.ranks[0].from_cache
    lines = [w for w in t.warnings if "cache entry" in w]
    assert len(lines) == 1 and "\n" not in lines[0] and str(src) in lines[0] and "replaced" in lines[0]
    row = t.load_issues[t.load_issues["check"] == "cache_entry"]
    assert len(row) == 1 and row["action"].iloc[0] == "replaced"
    again = tracelens.load(src, cache_dir=cache)  # the replacement holds: served, no warning
    assert again.ranks[0].from_cache and not again.warnings
    assert _loaded_kernels(again) == expected_kernels


@pytest.fixture
def two_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACELENS_NO_PREFETCH", "1")
    a, b = tmp_path / "a.json.gz", tmp_path / "b.json.gz"
    a.write_bytes(MOE_LOOP.read_bytes())
    b.write_bytes(MOE_GROUPED.read_bytes())
    cache = tmp_path / "cache"
    for p in (a, b):
        tracelens.load(p, cache_dir=cache)
    return a, b, cache


def test_entry_holding_another_traces_tables_is_rejected(two_cached):
    a, b, cache = two_cached
    ea, eb = _entry_dir(cache, a), _entry_dir(cache, b)
    shutil.rmtree(ea)
    shutil.copytree(eb, ea)  # b's entry (meta and tables) under a's key
    _assert_rejected_then_replaced(a, cache, N_LOOP)


def test_entry_with_swapped_tables_but_its_own_meta_is_rejected(two_cached):
    a, b, cache = two_cached
    ea, eb = _entry_dir(cache, a), _entry_dir(cache, b)
    shutil.copy(eb / "events.arrow", ea / "events.arrow")
    _assert_rejected_then_replaced(a, cache, N_LOOP)


def test_entry_whose_meta_names_another_rank_is_rejected(two_cached):
    a, _, cache = two_cached
    meta_path = _entry_dir(cache, a) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["distributed_info"] = {"rank": 7, "world_size": 8}
    meta_path.write_text(json.dumps(meta))
    _assert_rejected_then_replaced(a, cache, N_LOOP)
    assert tracelens.load(a, cache_dir=cache).rank_ids == [0]


def test_remembered_key_pointing_at_another_files_entry_is_rejected(two_cached):
    a, b, cache = two_cached
    memo = C._memo(str(a), cache)
    ident, _ = memo.read_text().split("\n")[:2]
    memo.write_text(f"{ident}\n{C.known_key(str(b), cache)}\n")  # a's identity -> b's (valid) entry
    t = tracelens.load(a, cache_dir=cache)
    assert _loaded_kernels(t) == N_LOOP
    assert any("made from another file" in w for w in t.warnings)
    assert _loaded_kernels(tracelens.load(b, cache_dir=cache)) == N_GROUPED  # b's entry is untouched


def test_unreadable_entry_is_rejected_and_replaced(two_cached):
    a, _, cache = two_cached
    (_entry_dir(cache, a) / "events.arrow").write_bytes(b"not an Arrow file")
    _assert_rejected_then_replaced(a, cache, N_LOOP)


def test_load_issues_survive_the_cache(tmp_path, monkeypatch):
    """What the loader dropped is reported on a cache hit too (the entry keeps it)."""
    import gzip

    doc = json.loads(gzip.decompress(MOE_LOOP.read_bytes()))
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    kernels[3]["dur"] = -5000
    src = tmp_path / "neg.json"
    src.write_text(json.dumps(doc))
    cold = tracelens.load(src, cache_dir=tmp_path / "c")
    warm = tracelens.load(src, cache_dir=tmp_path / "c")
    assert warm.ranks[0].from_cache
    for t in (cold, warm):
        assert list(t.load_issues["check"]) == ["negative_dur"] and list(t.load_issues["events"]) == [1]
        assert _loaded_kernels(t) == N_LOOP - 1
        assert any("negative dur" in w and str(src) in w for w in t.warnings)


# ------------------------------------------------------------------ leftovers of killed stores (issue 31 #12)

_KILLED_STORE = r"""
import os, signal, sys
import tracelens
from tracelens.io import cache as C
real = os.rename
def rename(a, b):  # killed between staging the entry and renaming it into place
    os.kill(os.getpid(), signal.SIGKILL)
os.rename = rename
real_replace = os.replace
def replace(a, b):  # killed between writing a remembered key and renaming it into place
    os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace if sys.argv[2] == "key" else real_replace
tracelens.load(sys.argv[1], cache=True, cache_dir=sys.argv[3])
"""


def _leftovers(root):
    return sorted(p.name for p in root.rglob(".*"))


def test_kill_9_during_a_store_leaves_nothing_a_rerun_keeps(tmp_path):
    import subprocess
    import sys

    root = tmp_path / "cache"
    trace = tmp_path / "t.json.gz"
    shutil.copy(MOE_LOOP, trace)
    seen = []
    for where in ("key", "entry"):
        r = subprocess.run([sys.executable, "-c", _KILLED_STORE, str(trace), where, str(root)],
                           env={**__import__("os").environ, "TRACELENS_NO_PREFETCH": "1"}, capture_output=True)
        assert r.returncode == -9, r.stderr.decode()[-2000:]
        seen.append(_leftovers(root))
    # the first left a remembered key's temporary file; the second's store swept it and left its staging dir
    assert len(seen[0]) == 1 and not seen[0][0].startswith(".tmp-") and seen[0][0].endswith(f"@{C._host()}")
    assert len(seen[1]) == 1 and seen[1][0].startswith(f".tmp-") and "@" in seen[1][0], seen
    C._SWEPT.discard(str(root))
    t = tracelens.load(trace, cache=True, cache_dir=root)  # the rerun's store sweeps the dead processes' leftovers
    assert _loaded_kernels(t) == N_LOOP
    assert _leftovers(root) == []


def test_sweep_keeps_what_a_live_store_may_still_use(tmp_path):
    import os
    import time

    root = tmp_path / "cache"
    d = root / "traces" / "ab"
    keys = root / "keys"
    d.mkdir(parents=True)
    keys.mkdir()
    mine = d / f".tmp-{C._owner()}-x1"  # this (live) process's staging dir
    foreign_new = d / ".tmp-4242@otherhost-x2"  # another host's: its owner cannot be checked, it is recent
    legacy_old = d / ".tmp-abcd1234"  # an older tracelens's name, two hours old
    for p in (mine, foreign_new, legacy_old):
        p.mkdir()
    (keys / f".{'0' * 32}.{os.getpid()}").write_text("x")  # recent, older name: kept
    old_key = keys / f".{'1' * 32}.123"
    old_key.write_text("x")
    past = time.time() - 2 * C.STALE_AFTER_S
    os.utime(legacy_old, (past, past))
    os.utime(old_key, (past, past))
    assert C.sweep_stale(root) == 2
    assert _leftovers(root) == sorted([mine.name, foreign_new.name, f".{'0' * 32}.{os.getpid()}"])
    assert C.sweep_stale(root) == 0  # once per process and root


# ------------------------------------------------------------------ coarse time stamps (issue 31 #5)

def _whole_seconds(real):
    """os.stat as a file system with 1-second time stamps reports it."""
    import types

    def stat(path):
        st = real(path)
        return types.SimpleNamespace(st_dev=st.st_dev, st_ino=st.st_ino, st_size=st.st_size,
                                     st_mtime_ns=st.st_mtime_ns // 10**9 * 10**9,
                                     st_ctime_ns=st.st_ctime_ns // 10**9 * 10**9)
    return stat


def _rewrite_middle_same_size(path, when: int) -> None:
    """Double every kernel's dur in place (same size: the digits are swapped, not added), head and tail
    untouched, and the stamps put back to the same whole second."""
    import gzip as _gz
    import os

    raw = _gz.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    assert len(raw) > 4 * C._EDGE
    lo, hi = C._EDGE, len(raw) - C._EDGE
    mid = raw[lo:hi].replace(b'"dur": 1,', b'"dur": 9,')
    assert mid != raw[lo:hi] and len(mid) == hi - lo
    with open(path, "r+b") as f:
        f.seek(lo)
        f.write(mid)
    os.utime(path, ns=(when, when))


def test_same_size_rewrite_within_one_second_on_coarse_stamps_is_not_served_stale(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("TRACELENS_NO_PREFETCH", "1")
    monkeypatch.setattr(C, "_stat", _whole_seconds(os.stat))
    events = [{"ph": "X", "cat": "kernel", "name": f"k{i}", "pid": 0, "tid": 7, "ts": 10 * i, "dur": 1,
               "args": {"stream": 7, "correlation": i}} for i in range(6000)]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": events}))
    when = (os.stat(p).st_mtime_ns // 10**9 - 5) * 10**9
    os.utime(p, ns=(when, when))
    root = tmp_path / "cache"
    first = tracelens.load(p, cache=True, cache_dir=root)
    assert int(first.events["dur"].sum()) == 6000 * 1000
    assert C.coarse_stamps(C.identity(str(p)))
    _rewrite_middle_same_size(p, when)
    assert C.identity(str(p)) == C.identity(str(p))  # the identity cannot tell the versions apart
    again = tracelens.load(p, cache=True, cache_dir=root)
    n_changed = json.loads(p.read_text())["traceEvents"]
    expected = sum(e["dur"] for e in n_changed) * 1000
    assert int(again.events["dur"].sum()) == expected != 6000 * 1000



@pytest.mark.parametrize("use_prefetch", [False, True], ids=["plain", "prefetch"])
def test_a_cache_dir_that_is_a_file_is_said_so_and_left_alone(tmp_path, monkeypatch, use_prefetch):
    """TRACELENS_CACHE_DIR naming a file: the trace is parsed as with --no-cache, one warning names the variable
    and the path, nothing claims an entry was replaced, and the file is untouched."""
    if not use_prefetch:
        monkeypatch.setenv("TRACELENS_NO_PREFETCH", "1")
    notes = tmp_path / "notes.txt"
    notes.write_text("a user's file\n")
    monkeypatch.setenv("TRACELENS_CACHE_DIR", str(notes))
    src = tmp_path / "trace.json.gz"
    src.write_bytes(MOE_LOOP.read_bytes())
    t = tracelens.load(src)
    assert _loaded_kernels(t) == N_LOOP and not t.ranks[0].from_cache
    assert t.warnings == [f"cache directory {notes} (TRACELENS_CACHE_DIR) is not a directory: {src} was parsed "
                          "without the cache"]
    assert t.load_issues[["check", "action"]].values.tolist() == [["cache_dir", "not cached"]]
    assert notes.read_text() == "a user's file\n"
    h = tracelens.analyze(t).health()  # the cache, not the trace: no figure is in doubt
    assert h.loc[h["check"] == "load_issues", ["severity", "invalidates"]].values.tolist() == \
        [["info", "nothing (the file itself was parsed)"]]

"""Property-based fuzzing of the loader and the analysis on mutated REAL traces (Hypothesis).

Each case takes a real fixture, applies a few mutations drawn by Hypothesis (impossible or odd `dur`,
`ts`, `args`, `pid`/`tid`, names, ranks; duplicated or dropped events; invalid UTF-8; a truncated
file; gzip or not), loads and analyzes it, and requires one of two outcomes:

- a `TraceError`: one line that names the file (the CLI prints it and exits 2), or
- a summary that satisfies the invariants, checked against the raw events of the mutated file
  (computed here with the standard library, never by the code under test):
  no negative time; busy <= span; compute, comm, memcpy, memset, exposed comm <= busy; busy <= the
  union of the raw GPU intervals; span <= the extent of the raw GPU events (and, where an event was
  moved far away, <= the extent before the mutation); each category's total <= busy + the overlap
  of the raw GPU intervals; kernel count <= the distinct raw GPU events; duplicated events reported;
  a drop of an impossible value reported in a one-line warning naming the file; a cached load gives
  the same summary as the first one.

Any other exception (an internal error, exit 3 in the CLI) fails the test.

CI runs TRACELENS_FUZZ_EXAMPLES single-file cases (default 30, derandomized: the same cases every run)
and half as many two-rank cases (as many mutated files; a case of two ranks costs three single ones). A
longer, random run (docs/robustness.md):

    TRACELENS_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -q tests/tracelens/test_fuzz.py
"""

from __future__ import annotations

import copy
import gzip
import json
from decimal import ROUND_HALF_EVEN, Decimal
import os
import subprocess
import sys
import tempfile
from functools import cache, lru_cache
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import tracelens  # noqa: E402
from tracelens.errors import TraceError  # noqa: E402

from ..conftest import ALEXNET, FIXTURES, MOE_GROUPED, NCCL_2RANK, merged_length  # noqa: E402
from ._cli import run_cli

EXAMPLES = int(os.environ.get("TRACELENS_FUZZ_EXAMPLES", "30"))
LONG_RUN = "TRACELENS_FUZZ_EXAMPLES" in os.environ
# Shrinking a failure can take minutes on these inputs: on request only (TRACELENS_FUZZ_SHRINK=1).
_PHASES = [p for p in Phase if p != Phase.shrink or os.environ.get("TRACELENS_FUZZ_SHRINK")]
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not LONG_RUN, phases=_PHASES,
                report_multiple_bugs=False, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# A two-rank case mutates two files and its analysis (collectives matched across the ranks) costs ~3x a
# single file's: half the cases fuzz as many mutated files as the single-file property does.
FUZZ_PAIRS = settings(FUZZ, max_examples=max(1, EXAMPLES // 2))

# Real traces with enough events for every rule to apply (>= 400 timed events each); the NCCL pair is
# also fuzzed as a two-rank directory.
SINGLE = [NCCL_2RANK / "rank0.json.gz", NCCL_2RANK / "rank1.json.gz", ALEXNET,
          FIXTURES / "h200_ep2_run" / "L3_torch" / "traces" / "rank0.json.gz", MOE_GROUPED]
GPU_CATS = {"kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset"}
EPS_US = 0.01  # rounding of summary.json (3 decimals) and float sums


@lru_cache(maxsize=None)
def _doc(path: Path) -> str:
    with gzip.open(path, "rt") as f:
        return f.read()


def _load_doc(path: Path) -> dict:
    return json.loads(_doc(path))


# ---------------------------------------------------------------------------------------- mutations

BAD_DURS = [-5000.0, -0.001, 0.0, 1e12, 1e20, 1e300, 2.5e15, 0.0005]
BAD_TS = [0, -1.0, 1e12, 1e17, 1e20]
BAD_ARGS = [[1, 2], "x", 3, None, True, {"correlation": "abc"}, {"correlation": 2**70}, {"stream": -1},
            {"External id": [1]}, {"Input Dims": "not a list"}, {"a": {"b": {"c": [1, [2, [3]]]}}}]
BAD_IDS = [2**63, 2**64 - 1, -(2**63) - 1, -1, "stream 7", "Spans", 1.5, None, True, "", "stream 99999999999999999999"]
NAMES = ["", "\x1b[31mRED\x1b[0m", "\x1b]0;title\x07", "na\u0000me", "\u202eevil", "\U0001F600 emoji",
         "x" * 5000, "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
         "void at::native::vectorized_elementwise_kernel<4>(int)", "Memcpy HtoD (Pageable -> Device)"]
RANKS = [-1, 2**40, 2**31, "0", 1.5, True, None, 7, 1]

mutation = st.one_of(
    st.tuples(st.just("dur"), st.sampled_from(["gpu", "cpu", "any"]), st.integers(0, 10**6), st.sampled_from(BAD_DURS)),
    st.tuples(st.just("dur_all"), st.sampled_from(["gpu", "any"]), st.sampled_from([-1.0, 0.0])),
    st.tuples(st.just("ts"), st.sampled_from(["gpu", "cpu", "any"]), st.integers(0, 10**6), st.sampled_from(BAD_TS)),
    st.tuples(st.just("ts_shift"), st.sampled_from(["gpu", "any"]), st.integers(0, 10**6), st.floats(-50.0, 50.0)),
    st.tuples(st.just("args"), st.sampled_from(["gpu", "cpu", "any"]), st.integers(0, 10**6), st.sampled_from(BAD_ARGS)),
    st.tuples(st.just("pid"), st.sampled_from(["gpu", "cpu", "any"]), st.integers(0, 10**6), st.sampled_from(BAD_IDS)),
    st.tuples(st.just("tid"), st.sampled_from(["gpu", "cpu", "any"]), st.integers(0, 10**6), st.sampled_from(BAD_IDS)),
    st.tuples(st.just("name"), st.sampled_from(["gpu", "cpu", "any"]), st.integers(0, 10**6),
              st.one_of(st.sampled_from(NAMES), st.text(max_size=40))),
    st.tuples(st.just("rank"), st.sampled_from(RANKS)),
    st.tuples(st.just("world_size"), st.sampled_from([0, -2, 2**40, 1, 3, "2", 2.0])),
    st.tuples(st.just("duplicate"), st.sampled_from(["gpu", "cpu", "any"]), st.integers(0, 10**6), st.integers(1, 50)),
    st.tuples(st.just("drop"), st.sampled_from(["gpu", "cpu", "any"]), st.integers(0, 10**6), st.integers(1, 200)),
    st.tuples(st.just("drop_all"), st.sampled_from(["gpu", "cpu", "X", "M"])),
    st.tuples(st.just("no_ts"), st.sampled_from(["gpu", "cpu", "any"]), st.integers(0, 10**6)),
)


def _pick(events: list, kind: str) -> list[int]:
    if kind == "gpu":
        return [i for i, e in enumerate(events) if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if kind == "cpu":
        return [i for i, e in enumerate(events) if e.get("ph") == "X" and e.get("cat") not in GPU_CATS]
    return [i for i, e in enumerate(events) if e.get("ph") == "X"]


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Applied:
    """What the mutations did, for the checks that need to know (duplicates, far moves)."""

    def __init__(self) -> None:
        self.duplicated = False
        self.moved_far = False


def _apply(doc: dict, muts: list, applied: Applied) -> None:
    ev = doc["traceEvents"]
    for m in muts:
        kind = m[0]
        if kind in ("rank", "world_size"):
            info = doc.setdefault("distributedInfo", {}) if isinstance(doc.get("distributedInfo"), dict) else {}
            doc["distributedInfo"] = info
            info[kind] = m[1]
            continue
        if kind == "drop_all":
            sel = m[1]
            doc["traceEvents"] = ev = [e for e in ev if not (
                (sel == "gpu" and e.get("cat") in GPU_CATS) or (sel == "cpu" and e.get("ph") == "X" and e.get("cat") not in GPU_CATS)
                or (sel == "X" and e.get("ph") == "X") or (sel == "M" and e.get("ph") == "M"))]
            continue
        if kind == "dur_all":
            for i in _pick(ev, m[1]):
                ev[i]["dur"] = m[2] if m[2] == 0.0 else -abs(ev[i].get("dur", 1)) - 1
            continue
        idx = _pick(ev, m[1])
        if not idx:
            continue
        i = idx[m[2] % len(idx)]
        if kind == "dur":
            ev[i]["dur"] = m[3]
            if abs(m[3]) >= 1e9:
                applied.moved_far = True
        elif kind == "ts":
            ev[i]["ts"] = m[3]
            applied.moved_far = True
        elif kind == "ts_shift":
            if _is_number(ev[i].get("ts")):
                ev[i]["ts"] = ev[i]["ts"] + m[3]
        elif kind == "args":
            ev[i]["args"] = copy.deepcopy(m[3])
        elif kind in ("pid", "tid"):
            ev[i][kind] = m[3]
        elif kind == "name":
            ev[i]["name"] = m[3]
        elif kind == "duplicate":
            n = min(m[3], len(idx))
            ev.extend(copy.deepcopy(ev[j]) for j in idx[m[2] % len(idx):][:n])
            applied.duplicated = True
        elif kind == "drop":
            gone = set(idx[m[2] % len(idx):][: m[3]])
            doc["traceEvents"] = ev = [e for j, e in enumerate(ev) if j not in gone]
        elif kind == "no_ts":
            ev[i].pop("ts", None)


# ------------------------------------------------------------------------------ independent truth


def _ns(v) -> int | None:
    """Exact integer nanoseconds of a raw JSON number (parsed as Decimal); None if not a possible time."""
    if isinstance(v, bool) or not isinstance(v, (int, Decimal)):
        return None
    if not Decimal(v).is_finite() or abs(v) >= 2**53:
        return None
    return int((Decimal(v) * 1000).to_integral_value(rounding=ROUND_HALF_EVEN))


def _gpu_intervals(events: list) -> list[tuple[int, int]]:
    """[start, end) in ns of the raw GPU events whose ts and dur are possible numbers."""
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("cat") not in GPU_CATS:
            continue
        ts, dur = _ns(e.get("ts")), _ns(e.get("dur", 0))
        if ts is None or dur is None or dur < 0:
            continue
        out.append((ts, ts + dur))
    return out




def _truth(events: list) -> dict:
    iv = _gpu_intervals(events)
    distinct = {json.dumps(e, sort_keys=True, default=str) for e in events
                if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in GPU_CATS}
    return {  # in us
        "union": merged_length(iv) / 1e3,
        "overlap": (sum(e - s for s, e in iv) - merged_length(iv)) / 1e3,
        "extent": ((max(e for _, e in iv) - min(s for s, _ in iv)) if iv else 0) / 1e3,
        "distinct_gpu": len(distinct),
        "distinct_kernels": len({d for d in distinct if '"cat": "kernel"' in d or '"cat": "Kernel"' in d}),
    }


def _exact(text: bytes | str) -> list:
    """The events of a written document with every number exact (floats as Decimal)."""
    return json.loads(text, parse_float=Decimal)["traceEvents"]


@cache
def _source_truth(path: Path) -> dict:
    """The truth of an unmutated fixture (read-only: a case compares against it, never changes it)."""
    return _truth(_exact(_doc(path)))


# ----------------------------------------------------------------------------------------- checks


def _check_error(e: TraceError, paths: list[Path], root: Path) -> None:
    msg = str(e)
    assert "\n" not in msg and "\r" not in msg, msg
    assert any(str(p) in msg for p in paths) or str(root) in msg, f"error does not name the file: {msg}"


def _check_summary(summary: dict, trace, truths: dict[int, dict], before: dict[int, dict], applied: Applied) -> None:
    for w in summary["warnings"]:
        assert "\n" not in w and "\x1b" not in w, w  # one line, no raw terminal escapes
    by_rank = {}
    for r in summary["ranks"]:
        if not r["gpu_available"]:
            continue
        truth = truths[r["rank"]]
        assert truth is not None, "loaded a document that the standard library's json rejects"
        if r["gpu_busy_us"] is not None:
            by_rank[r["rank"]] = r
        for row in [r, *r["steps"]]:
            if row["span_us"] is None:
                # no figures (summary.json: null, "not available"; e.g. a rank whose only step is its
                # start-up wait, left out of the steady-state view) is not a wrong number
                assert all(row[k] is None for k in ("gpu_busy_us", "compute_us", "comm_us")), row
                continue
            for k in ("span_us", "gpu_busy_us", "gpu_idle_us", "compute_us", "comm_us", "memcpy_us", "memset_us",
                      "exposed_comm_us"):
                assert row[k] is not None and row[k] >= -EPS_US, (k, row[k])  # no negative time
            busy = row["gpu_busy_us"]
            assert busy <= row["span_us"] + EPS_US, row
            for k in ("compute_us", "comm_us", "memcpy_us", "memset_us", "exposed_comm_us"):
                assert row[k] <= busy + EPS_US, (k, row)
            assert busy <= truth["union"] + EPS_US, (busy, truth)
            assert row["span_us"] <= truth["extent"] + EPS_US, (row["span_us"], truth)
        if r["span_us"] is None:
            continue
        assert r["kernel_count"] <= truth["distinct_gpu"]
        if applied.moved_far and r["rank"] in before:  # span plausible for the events
            assert r["span_us"] <= before[r["rank"]]["extent"] * 1.001 + EPS_US, (r["span_us"], before[r["rank"]])
    for c in summary["categories"]:
        if c["rank"] in by_rank:
            assert c["total_us"] >= -EPS_US
            assert c["total_us"] <= by_rank[c["rank"]]["gpu_busy_us"] + truths[c["rank"]]["overlap"] + EPS_US, c
    if applied.duplicated:
        assert (trace.load_issues["check"] == "duplicate").any(), "duplicated events were not reported"
        assert any("duplicate" in w for w in summary["warnings"])
    for issue in trace.load_issues.itertuples():
        assert (issue.events > 0 if issue.action == "dropped" else issue.events >= 0)
        assert issue.file in issue.message and "\n" not in issue.message
        assert issue.message in summary["warnings"]


def _run_case(sources: list[Path], muts_per_file: list[list], gz: bool, cut: float | None, bad_utf8: bool,
              use_cache: bool) -> str:
    with tempfile.TemporaryDirectory(prefix="tracelens-fuzz-") as tmp:
        root = Path(tmp) / "traces"
        root.mkdir()
        paths, truths, before, applied = [], {}, {}, Applied()
        for k, (src, muts) in enumerate(zip(sources, muts_per_file)):
            doc = _load_doc(src)
            p = root / f"rank{k}.json{'.gz' if gz else ''}"
            before[str(p)] = _source_truth(src)
            _apply(doc, muts, applied)
            data = json.dumps(doc).encode()
            if bad_utf8 and k == 0:
                data = data.replace(b'"name": "', b'"name": "\xff\xfe', 1)
            if cut is not None and k == 0:
                data = data[: int(len(data) * cut)]
            p.write_bytes(gzip.compress(data, compresslevel=1) if gz else data)
            paths.append(p)
            try:  # of the mutated events, as written
                truths[str(p)] = _truth(_exact(data))
            except ValueError:  # cut or invalid bytes: only an error is acceptable
                truths[str(p)] = None
        target = root if len(paths) > 1 else paths[0]
        cache_dir = Path(tmp) / "cache"
        try:
            trace = tracelens.load(target, cache=use_cache, cache_dir=cache_dir, jobs=1)
            summary = tracelens.analyze(trace).summary()
        except TraceError as e:
            _check_error(e, paths, root)
            return "error"
        _check_summary(summary, trace, {i.rank: truths[i.path] for i in trace.ranks},
                       {i.rank: before[i.path] for i in trace.ranks}, applied)
        if use_cache:  # a cache hit gives the same answer, load issues included
            again = tracelens.load(target, cache=True, cache_dir=cache_dir, jobs=1)
            assert all(r.from_cache for r in again.ranks)
            assert tracelens.analyze(again).summary() == summary
        return "ok"


@FUZZ
@given(
    src=st.sampled_from(SINGLE),
    muts=st.lists(mutation, min_size=1, max_size=3),
    gz=st.booleans(),
    cut=st.one_of(st.none(), st.none(), st.none(), st.floats(0.0, 1.0)),
    bad_utf8=st.integers(0, 9).map(lambda k: k == 0),
    use_cache=st.booleans(),
)
def test_mutated_single_traces_error_in_one_line_or_satisfy_the_invariants(src, muts, gz, cut, bad_utf8, use_cache):
    _run_case([src], [muts], gz, cut, bad_utf8, use_cache)


@FUZZ_PAIRS
@given(
    muts0=st.lists(mutation, min_size=0, max_size=2),
    muts1=st.lists(mutation, min_size=0, max_size=2),
    swap=st.booleans(),
    use_cache=st.booleans(),
)
def test_mutated_rank_pairs_error_in_one_line_or_satisfy_the_invariants(muts0, muts1, swap, use_cache):
    srcs = [NCCL_2RANK / "rank0.json.gz", NCCL_2RANK / "rank1.json.gz"]
    if swap:  # rank1's content in rank0.json and vice versa: distributedInfo and the names disagree
        srcs = srcs[::-1]
    _run_case(srcs, [muts0, muts1], False, None, False, use_cache)


# ------------------------------------------------------------- the issue's reproductions, each pinned


def _mutated(tmp_path: Path, muts: list, src: Path = MOE_GROUPED) -> Path:
    doc = _load_doc(src)
    _apply(doc, muts, Applied())
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    return p


@pytest.mark.parametrize("muts,check", [
    ([("dur", "gpu", 5, -5000.0)], "negative_dur"),
    ([("dur", "gpu", 5, 1e20)], "unrepresentable_time"),
    ([("ts", "gpu", 0, 0), ("ts", "gpu", 1, 0), ("ts", "gpu", 2, 0)], "time_outlier"),
    ([("dur", "gpu", 0, 1e12)], "time_outlier"),
    ([("duplicate", "any", 0, 10**6)], "duplicate"),
], ids=["negative dur", "dur 1e20", "ts 0", "dur 1e12", "every event twice"])
def test_impossible_values_are_dropped_and_reported(tmp_path, muts, check):
    p = _mutated(tmp_path, muts)
    trace = tracelens.load(p, cache=False)
    assert list(trace.load_issues["check"]) == [check]
    n_dropped = int(trace.load_issues["events"].iloc[0])
    before = _source_truth(MOE_GROUPED)
    summary = tracelens.analyze(trace).summary()
    _check_summary(summary, trace, {0: _truth(_exact(p.read_text()))}, {0: before}, Applied())
    r = summary["ranks"][0]
    assert r["span_us"] <= before["extent"] + EPS_US
    if check == "duplicate":
        raw_x = [e for e in _load_doc(MOE_GROUPED)["traceEvents"] if e.get("ph") == "X"]
        assert n_dropped == len(raw_x)  # every timed event was written twice
        assert r["kernel_count"] == before["distinct_kernels"]


def test_all_durations_negative_is_one_line_error(tmp_path):
    p = _mutated(tmp_path, [("dur_all", "any", -1.0)])
    with pytest.raises(TraceError) as ei:
        tracelens.load(p, cache=False)
    assert str(p) in str(ei.value) and "negative dur" in str(ei.value)


@pytest.mark.parametrize("muts", [
    [("args", "any", i, v) for i, v in enumerate([[1, 2], "x", 3])],
    [("pid", "gpu", 0, 2**63), ("tid", "cpu", 0, 2**64 - 1)],
    [("rank", 2**40)],
    [("dur_all", "any", 0.0)],
    [("drop_all", "gpu")],
    [("drop_all", "cpu")],
], ids=["args list/str/number", "ids beyond int64", "rank 2**40", "all durations 0", "no GPU events", "no CPU events"])
def test_former_internal_errors_end_cleanly(tmp_path, muts):
    p = _mutated(tmp_path, muts)
    try:
        trace = tracelens.load(p, cache=False)
        summary = tracelens.analyze(trace).summary()
    except TraceError as e:
        _check_error(e, [p], tmp_path)
        return
    _check_summary(summary, trace, {trace.ranks[0].rank: _truth(_exact(p.read_text()))}, {}, Applied())


def test_all_zero_durations_write_the_report(tmp_path):
    """The whole output (summary, tables, HTML report) of a trace whose durations are all 0: no GPU time,
    so the roofline has no share of modeled time to state (it says so instead of failing)."""
    from reports.artifacts import write_all

    a = tracelens.analyze(tracelens.load(_mutated(tmp_path, [("dur_all", "any", 0.0)]), cache=False))
    write_all(a, tmp_path / "out", report=True)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["ranks"][0]["gpu_busy_us"] == 0.0 and summary["ranks"][0]["kernel_count"] > 0
    assert "No non-communication GPU time to model." in (tmp_path / "out" / "report.html").read_text()


def test_a_single_gpu_event_is_analyzed(tmp_path):
    doc = _load_doc(NCCL_2RANK / "rank0.json.gz")
    gpu = [i for i, e in enumerate(doc["traceEvents"]) if e.get("cat") in GPU_CATS]
    doc["traceEvents"] = [e for i, e in enumerate(doc["traceEvents"]) if i not in set(gpu[1:])]
    p = tmp_path / "one.json"
    p.write_text(json.dumps(doc))
    trace = tracelens.load(p, cache=False)
    _check_summary(tracelens.analyze(trace).summary(), trace, {0: _truth(_exact(p.read_text()))}, {}, Applied())


def test_only_the_profiler_span_is_one_line_error(tmp_path):
    doc = _load_doc(MOE_GROUPED)
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") == "Trace" or e.get("ph") in ("M", "i")]
    p = tmp_path / "span.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match="profiler's own span"):
        tracelens.load(p, cache=False)


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracelens", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRACELENS_CACHE_DIR": str(cwd or tempfile.gettempdir())})


def _one_line_exit_2(r, name: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracelens: error: ") and name in lines[0], r.stderr


def test_cli_names_fifo_device_and_unreadable_rank_files(tmp_path):
    # a real process for a FIFO and a device (a regression that blocks on them then hits the timeout), the
    # CLI in this process for the rank files that cannot be read (each an ordinary open that fails)
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    _one_line_exit_2(_cli("analyze", str(fifo), "--no-cache", "-o", str(tmp_path / "o")), str(fifo))
    _one_line_exit_2(_cli("analyze", "/dev/zero", "--no-cache", "-o", str(tmp_path / "o")), "/dev/zero")
    for kind in ("dangling", "loop", "fifo", "dir"):
        d = tmp_path / kind
        d.mkdir()
        (d / "rank0.json.gz").write_bytes((NCCL_2RANK / "rank0.json.gz").read_bytes())
        bad = d / "rank1.json.gz"
        if kind == "dangling":
            bad.symlink_to(d / "missing.json.gz")
        elif kind == "loop":
            bad.symlink_to(bad)
        elif kind == "fifo":
            os.mkfifo(bad)
        else:
            bad.mkdir()
        _one_line_exit_2(run_cli("analyze", d, "--no-cache", "--no-report", "-o", tmp_path / "o"), str(bad))


def test_swapped_distributed_info_ranks_are_named(tmp_path):
    for k in (0, 1):  # rank0.json holds rank 1's trace and the other way round
        (tmp_path / f"rank{k}.json.gz").write_bytes((NCCL_2RANK / f"rank{1 - k}.json.gz").read_bytes())
    trace = tracelens.load(tmp_path, cache=False)
    rows = trace.load_issues[trace.load_issues["check"] == "rank_name_mismatch"]
    assert len(rows) == 2 and set(rows["rank"]) == {0, 1}
    assert trace.rank_info(0).path.endswith("rank1.json.gz")  # the profiler's own record decides


def test_outputs_are_all_or_nothing_when_the_disk_fills(tmp_path, monkeypatch):
    from reports.artifacts import write_all

    a = tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))
    out = tmp_path / "out"
    write_all(a, out, report=False)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    calls = []
    real = Path.write_bytes

    def full(self, *args, **kw):  # the third table file written into the staging directory finds the disk full (the
        calls.append(1)           # tables' bytes are built before any write, beside the summary: reports.artifacts)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, *args, **kw)

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(TraceError) as ei:
        write_all(a, out, report=False)
    msg = str(ei.value)
    assert "\n" not in msg and str(out) in msg and "No space left" in msg
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before  # the previous outputs untouched, no staged leftovers


def test_read_only_output_dir_is_one_line_error(tmp_path, monkeypatch):
    from reports import artifacts

    a = tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))

    def denied(*args, **kw):
        raise PermissionError(13, "Permission denied", str(tmp_path / "ro"))

    monkeypatch.setattr(artifacts.tempfile, "mkdtemp", denied)
    with pytest.raises(TraceError) as ei:
        artifacts.write_all(a, tmp_path / "ro", report=False)
    assert "Permission denied" in str(ei.value) and str(tmp_path / "ro") in str(ei.value)
    assert not any((tmp_path / "ro").iterdir())


def test_a_failed_analysis_leaves_no_output_directory_behind(tmp_path, monkeypatch):
    from reports.artifacts import write_all
    from tracelens.analyzer import Analysis

    a = tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))

    def broken(self, *args, **kw):
        raise RuntimeError("the summary fails")

    monkeypatch.setattr(Analysis, "summary_with", broken)
    with pytest.raises(RuntimeError, match="the summary fails"):
        write_all(a, tmp_path / "fresh" / "out")
    assert not (tmp_path / "fresh" / "out").exists()  # made for the outputs, removed with them
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "summary.json").write_text("{}")
    with pytest.raises(RuntimeError):
        write_all(a, tmp_path / "kept")
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["summary.json"]  # a user's directory as it was

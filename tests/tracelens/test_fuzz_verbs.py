"""Property-based fuzzing of every verb of the CLI on mutated inputs (Hypothesis; issue 31).

`test_fuzz.py` fuzzes the trace loader and `analyze`. This module runs the other verbs, in-process
through click's CliRunner, on mutated copies of real run dirs, traces, pipeline files, trainer configs,
search spaces and sweep stores:

- run-dir manifests: a value replaced (wrong type, huge, deeply nested, NaN/Infinity, out of range), a
  key removed, the whole document replaced (not an object, empty, invalid JSON or UTF-8, truncated,
  nested beyond the parser), or manifest.json that is a FIFO, a directory or a dangling symlink;
  verbs: check, whatif, memory, diff, ppvis (plus host, comm, roofline, replay, critpath on the same dirs);
- pipeline `rank<N>.jsonl[.gz]`: a field replaced (out-of-range or swapped times, wrong types), a
  field removed, lines dropped, duplicated, replaced by non-objects, deep nesting or a huge line; an
  empty file, a missing rank, invalid UTF-8, a truncated gzip, a FIFO; verb: ppvis (and whatif);
- traces (the mutations of `test_fuzz.py`): host, comm, check, roofline, replay, diff;
- trainer config YAML and `--set` values: wrong types, unknown keys, YAML tags, alias expansion
  ("billion laughs"), deep nesting, `extends` loops; verbs: memory, whatif;
- search-space YAML and the sweep store: the same YAML mutations on a space file, then a sweep (its
  trials run by an in-process stand-in, not the trainer) and a `--resume` on a damaged store; verb:
  autotune.

Each invocation must end in one of two ways (docs/robustness.md):

- exit 2 with exactly one `tracelens: error:` line (the last line of stderr; other lines are
  `tracelens: warning:` lines) that names the file (or the option) at fault; or
- exit 0 (1 for `check` when a check trips) and output that satisfies the verb's invariants: every
  number in its JSON finite (no NaN/Infinity written), fractions in [0, 1], percentages in [0, 100],
  the sums the docs state adding up (what-if components = step time, ppvis busy + idle = window and the
  bubble account's parts = its idle, comm kernel = comm + sync, memory components in the peak = the
  peak), `check`'s exit status = the one in its JSON; and replay's scripts compile.

Never: an internal error (exit 3 or an exception out of click), a hang (each invocation runs under a
SIGALRM deadline, TRACELENS_FUZZ_TIMEOUT_S, default 120 s), or unbounded memory (inputs are bounded:
strings <= 200 KB, nesting <= 100,000 levels, alias expansion <= 10**7 nodes; the process's peak RSS
must stay under TRACELENS_FUZZ_MAX_RSS_GIB, default 6).

CI runs TRACELENS_FUZZ_EXAMPLES cases per property (default 3, derandomized: the same cases every
run). The long run (docs/robustness.md) keeps going past a failure and counts outcomes into a log:

    TRACELENS_FUZZ_EXAMPLES=2000 TRACELENS_FUZZ_LOG=fuzz.jsonl \
        .venv/bin/python -m pytest -q tests/tracelens/test_fuzz_verbs.py
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import resource
import shutil
import signal
import sqlite3
import tempfile
import time
import traceback
from functools import lru_cache
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from click.testing import CliRunner  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tracelens.cli import main  # noqa: E402

from ..conftest import FIXTURES, MOE_GROUPED, NCCL_2RANK  # noqa: E402
from .test_fuzz import Applied, _apply, _load_doc, mutation as trace_mutation  # noqa: E402

EXAMPLES = int(os.environ.get("TRACELENS_FUZZ_EXAMPLES", "3"))
LONG_RUN = "TRACELENS_FUZZ_EXAMPLES" in os.environ
TIMEOUT_S = float(os.environ.get("TRACELENS_FUZZ_TIMEOUT_S", "120"))
MAX_RSS_GIB = float(os.environ.get("TRACELENS_FUZZ_MAX_RSS_GIB", "6"))
# The long run: one JSON line per case (property, outcome, arguments, message) here, and a property keeps
# going past a failure (each failure is logged; the property fails at its end if there was one).
LOG = os.environ.get("TRACELENS_FUZZ_LOG")
# Wall-clock budget per property in the long run: cases past it are drawn but not run (logged "skipped").
BUDGET_S = float(os.environ.get("TRACELENS_FUZZ_BUDGET_S", "inf"))
_PHASES = [p for p in Phase if p != Phase.shrink or os.environ.get("TRACELENS_FUZZ_SHRINK")]
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not LONG_RUN, phases=_PHASES,
                report_multiple_bugs=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture, HealthCheck.large_base_example])

EP2_RUN = FIXTURES / "h200_ep2_run" / "L3_torch"
EP2_OTHER = FIXTURES / "h200_ep2_run" / "L0_loop"
PP2_RUN = FIXTURES / "h200_pp2_run" / "1f1b"
EPS = 1e-6


# ------------------------------------------------------------------------------------ the harness


class Hang(BaseException):
    """An invocation ran past its deadline (a BaseException: no `except Exception` in the CLI takes it)."""


@contextlib.contextmanager
def _deadline(seconds: float):
    def on_alarm(signum, frame):
        raise Hang(f"no answer within {seconds:g} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Failure(AssertionError):
    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class Case:
    """One fuzz case: a scratch directory (removed afterwards, FIFOs included) and the record of what ran."""

    def __init__(self, prop: str):
        self.prop = prop
        self.dir = Path(tempfile.mkdtemp(prefix="fz-", dir=_scratch()))
        self.calls: list[list[str]] = []

    def invoke(self, args: list[str], debug: bool = False):
        args = [str(a) for a in args]
        self.calls.append(args)
        env = {"TRACELENS_CACHE_DIR": str(_scratch() / "cache"), "TRACELENS_DEBUG": "1" if debug else None,
               "TRACELENS_PROGRESS": "0"}
        with _deadline(TIMEOUT_S):
            return CliRunner().invoke(main, args, env=env, catch_exceptions=True)

    def expect(self, res, names: list[str], ok_codes: tuple[int, ...] = (0,)) -> str:
        """'ok' (exit in ok_codes) or 'error' (exit 2 in one line naming one of ``names``); else a Failure."""
        exc = res.exception
        if exc is not None and not isinstance(exc, SystemExit):
            tb = "".join(traceback.format_exception(*res.exc_info))[-3000:]
            raise Failure("internal", f"{self.calls[-1]}: exception out of the CLI\n{tb}")
        code = res.exit_code
        lines = [ln for ln in (res.stderr or "").splitlines() if ln.strip()]
        if code == 2:
            errors = [ln for ln in lines if ln.startswith("tracelens: error: ")]
            if len(errors) != 1 or lines[-1] != errors[0]:
                raise Failure("invariant", f"{self.calls[-1]}: exit 2 without exactly one error line last: {lines[-5:]}")
            others = [ln for ln in lines if not ln.startswith(("tracelens: error: ", "tracelens: warning: "))]
            if others:
                raise Failure("invariant", f"{self.calls[-1]}: exit 2 with other output on stderr: {others[:3]}")
            if not any(n in errors[0] for n in names):
                raise Failure("invariant", f"{self.calls[-1]}: error line names none of {names[:4]}: {errors[0]!r}")
            return "error"
        if code in ok_codes:
            return "ok"
        if code == 3:  # the traceback, for the report
            dbg = self.invoke(self.calls[-1], debug=True)
            tb = "".join(traceback.format_exception(*dbg.exc_info))[-3000:] if dbg.exc_info else ""
            raise Failure("internal", f"{self.calls[-1]}: exit 3: {lines[-1:]} {tb}")
        raise Failure("internal", f"{self.calls[-1]}: exit {code}: {lines[-3:]}")

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


_STARTED: dict[str, float] = {}
_FAILURES: dict[str, list[str]] = {}


def _log(record: dict) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")


def _run(prop: str, body, inputs: dict) -> None:
    """Run one case of property ``prop`` drawn from ``inputs``: ``body(case)`` returns the outcome ('ok' /
    'error')."""
    t0 = _STARTED.setdefault(prop, time.monotonic())
    if time.monotonic() - t0 > BUDGET_S:
        _log({"prop": prop, "outcome": "skipped"})
        return
    case = Case(prop)
    start = time.monotonic()
    try:
        outcome, message = body(case), ""
        rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        if rss_gib > MAX_RSS_GIB:
            raise Failure("memory", f"{case.calls[-1:]}: peak RSS {rss_gib:.1f} GiB > {MAX_RSS_GIB:g}")
    except Hang as e:
        outcome, message = "hang", f"{case.calls[-1:]}: {e}"
    except Failure as e:
        outcome, message = e.kind, str(e)
    except AssertionError as e:
        outcome, message = "invariant", f"{case.calls[-1:]}: {e}"
    finally:
        case.close()
    _log({"prop": prop, "outcome": outcome, "s": round(time.monotonic() - start, 2), "calls": case.calls,
          "message": message[:4000], **({} if outcome in ("ok", "error") else {"inputs": repr(inputs)[:20_000]})})
    if outcome in ("ok", "error"):
        return
    if LOG:  # the long run counts every failure; the property fails at its end (_finish)
        _FAILURES.setdefault(prop, []).append(message)
        return
    pytest.fail(f"{outcome}: {message}", pytrace=False)


def _finish(prop: str) -> None:
    fails = _FAILURES.pop(prop, [])
    _STARTED.pop(prop, None)
    if fails:
        pytest.fail(f"{len(fails)} failing case(s); the first: {fails[0]}", pytrace=False)


@lru_cache(maxsize=None)
def _scratch() -> Path:
    """One scratch directory per session: the trace cache and every case's files (hard links need one file system)."""
    d = Path(tempfile.mkdtemp(prefix="tracelens-fuzz-verbs-"))
    import atexit

    atexit.register(shutil.rmtree, d, True)
    return d


@lru_cache(maxsize=None)
def _pristine(src: Path) -> Path:
    """A copy of the run dir ``src`` in the scratch directory, whose traces every case hard-links."""
    dst = _scratch() / "pristine" / src.parent.name / src.name
    shutil.copytree(src, dst)
    return dst


def _run_dir(case: Case, src: Path, name: str = "run") -> Path:
    """A fresh run dir in the case's directory: the traces hard-linked (the cache serves them), the manifest
    and pipeline files copied (for mutation)."""
    base, run = _pristine(src), case.dir / name
    (run / "traces").mkdir(parents=True)
    for f in sorted((base / "traces").iterdir()):
        os.link(f, run / "traces" / f.name)
    shutil.copy(base / "manifest.json", run / "manifest.json")
    if (base / "pipeline").is_dir():
        shutil.copytree(base / "pipeline", run / "pipeline")
    return run


# ------------------------------------------------------------------------------------ invariants


def _strict_json(path: Path):
    """The JSON a verb wrote; NaN or Infinity (which Python's json writes, and strict readers reject) fail."""
    def bad(token):
        raise AssertionError(f"{path}: {token} written into JSON (numbers must be finite)")

    return json.loads(path.read_text(), parse_constant=bad)


def _numbers(v, where=""):
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _numbers(x, f"{where}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _numbers(x, f"{where}[{i}]")
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
        yield where, v


def _frac(v, what, hi=1.0) -> None:
    if v is None:
        return
    assert -EPS <= v <= hi * (1 + EPS) + EPS, f"{what} = {v} outside [0, {hi:g}]"


def _close(a, b, what, rel=1e-6, abs_=1e-6) -> None:
    assert math.isclose(a, b, rel_tol=rel, abs_tol=abs_), f"{what}: {a} != {b}"


def _check_host(doc) -> None:
    for r in doc["launch"]:
        _frac(r["small_share"], "launch.small_share")
        _frac(r["small_time_share"], "launch.small_time_share")
        assert r["kernels"] >= r["small_kernels"] >= 0, r
        if r["launch_p50_us"] is not None and r["launch_p90_us"] is not None:
            assert r["launch_p50_us"] <= r["launch_p90_us"] + EPS, r
    for r in doc["idle"]:
        _frac(r["pct_of_span"], "idle.pct_of_span", 100)
        assert r["idle_us"] >= 0 and r["gaps"] >= 0, r
    for f in doc["findings"]:
        _frac(f.get("share_of_span"), "findings.share_of_span")
        assert f.get("recoverable_us") is None or f["recoverable_us"] >= 0, f


def _check_comm(doc) -> None:
    for r in doc["records"]:  # per instance and rank: the kernel is the wait for the last rank + the transfer
        if r.get("comm_us") is not None and r.get("sync_us") is not None:
            assert r["comm_us"] >= -EPS and r["sync_us"] >= -EPS, r
            _close(r["comm_us"] + r["sync_us"], r["kernel_us"], "comm + sync = kernel time", rel=1e-4, abs_=0.01)
    for r in doc["summary"]:
        _frac(r["sync_pct"], "summary.sync_pct", 100)
        assert r["count"] >= 0 and r["kernel_us"] >= 0 and 0 <= r["cross_rank"] <= r["count"], r
        if r["comm_us"] is not None and r["sync_us"] is not None:  # over the cross-rank instances only
            assert r["comm_us"] + r["sync_us"] <= r["kernel_us"] * (1 + 1e-4) + 0.01, r
            if r["cross_rank"] == r["count"]:
                _close(r["comm_us"] + r["sync_us"], r["kernel_us"], "comm + sync = kernel time", rel=1e-4, abs_=0.01)
    for r in doc["exposed_comm"]:
        assert 0 <= r["exposed_comm_us"] <= r["comm_us"] + 0.01, r
        _frac(r.get("exposed_pct"), "exposed_pct", 100)


def _check_check(doc, code) -> None:
    assert doc["exit_status"] == code, (doc["exit_status"], code)
    assert sum(doc["counts"].values()) == len(doc["checks"]), doc["counts"]


def _check_roofline(doc) -> None:
    _frac(doc["summary"].get("modeled_share"), "summary.modeled_share")
    for r in doc["roofline"]:
        for k in ("gpu_us", "tflops", "tbps", "pct_roof"):
            assert r.get(k) is None or r[k] >= 0, (k, r)


def _check_whatif(doc) -> None:
    for k in ("step_s", "base_step_s", "tokens_per_s_per_gpu", "base_tokens_per_s_per_gpu"):
        assert doc[k] > 0, (k, doc[k])
    assert doc["uncertainty"] >= 0 and (doc["peak_gib"] is None or doc["peak_gib"] >= 0), doc
    for comps, step in ((doc["components_ms"], doc["step_s"]), (doc["base_components_ms"], doc["base_step_s"])):
        assert all(v >= -EPS for v in comps.values()), comps
        _close(sum(comps.values()), 1e3 * step, "what-if components add up to the step time", rel=1e-4)


def _check_memory(doc) -> None:
    if "fits" in doc and "components" not in doc:  # --sweep
        return
    comps = doc["components"]
    assert all(c["bytes"] >= 0 for c in comps), comps
    assert doc["peak_bytes"] >= 0


def _check_ppvis(doc) -> None:
    b = doc["bubble"]
    _frac(b.get("overall_ratio"), "bubble.overall_ratio")
    _frac(b.get("theory_ratio"), "bubble.theory_ratio")
    for r in b["per_rank"] + b.get("per_step", []):
        _frac(r["bubble_ratio"], "per_rank.bubble_ratio")
        assert min(r["window_ns"], r["busy_ns"], r["idle_ns"]) >= 0, r
        assert r["busy_ns"] + r["idle_ns"] == r["window_ns"], ("busy + idle = window", r)
        assert r["lead_ns"] + r["inner_ns"] + r["tail_ns"] == r["idle_ns"], ("lead + inner + tail = idle", r)
    acc = doc.get("account") or {}
    if acc.get("totals_ns"):
        t = acc["totals_ns"]
        assert sum(t[p] for p in acc["parts"]) == t["idle"], ("the bubble account's parts = its idle", t)


def _check_critpath(doc) -> None:
    # the path's segments tile the analyzed steps: their durations add up to the summed spans, and so do the causes
    assert doc["schema_version"] == 1
    if not doc["available"]:
        assert "\n" not in doc["reason"]
        return
    _close(sum(s["dur_us"] for s in doc["segments"]), doc["span_us"], "segments = span", rel=1e-6, abs_=0.01)
    _close(sum(c["us"] for c in doc["by_cause"]), doc["span_us"], "causes = span", rel=1e-6, abs_=0.01)
    assert all(s["dur_us"] >= 0 for s in doc["segments"])


def _check_json(path: Path, check=None, *extra) -> None:
    doc = _strict_json(path)
    for where, v in _numbers(doc):
        assert math.isfinite(v), f"{path}: {where} = {v}"
    if check is not None:
        check(doc, *extra)


def _check_replay(out: Path) -> None:
    for script in sorted(out.glob("*.py")) if out.is_dir() else []:
        compile(script.read_text(), str(script), "exec")  # a SyntaxError here is a defect


# ------------------------------------------------------------------------------------ input mutations

# Values that replace one in a manifest, a pipeline record or a config: wrong types, out of range, huge,
# non-finite (Python's json writes NaN and Infinity, and reads them back), nested.
DEEP = ("deep", 5000)  # expanded at write time: [[[...]]] this deep (beyond the parser's recursion limit)
BAD_VALUES = [None, True, False, 0, -1, 1, 2, 2**31, 2**63 - 1, 2**63, 2**70, -(2**63) - 1, 1.5, -0.0, 1e-300,
              1e308, -1e308, float("nan"), float("inf"), float("-inf"), "", "x", "0", "1f1b", "\x1b[31m\u202e",
              "x" * 200_000, [], {}, [1, "a", None], {"a": {"b": [1, [2, [3]]]}}, list(range(50_000)),
              ("deep", 60), DEEP]
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=4),
                                                         st.dictionaries(st.text(max_size=8), c, max_size=4)),
                          max_leaves=12)
bad_value = st.one_of(st.sampled_from(BAD_VALUES), json_value)


def _expand(v):
    """A value of BAD_VALUES as written: ("deep", n) is n nested lists, kept as a placeholder until _dumps
    (json.dumps itself recurses, and cannot write what the parser is meant to choke on)."""
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "deep":
        return f"\x00deep{v[1]}\x00"
    return v


def _dumps(doc) -> str:
    """JSON text of ``doc``, each deep-nesting placeholder written out as its nested lists."""
    text = json.dumps(doc)
    while "\\u0000deep" in text:
        i = text.index('"\\u0000deep')
        j = text.index('\\u0000"', i + 2)
        n = int(text[i + 11: j])
        text = text[:i] + "[" * n + "1" + "]" * n + text[j + 7:]
    return text


def _paths(doc, prefix=(), depth=0):
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        if isinstance(doc, list) and k > 3:
            break
        out.append(prefix + (k,))
        if depth < 3:
            out.extend(_paths(v, prefix + (k,), depth + 1))
    return out


HOT = ("config", "metrics", "profile", "pipeline", "world_size", "status", "reason", "parallel", "device", "mesh")


@lru_cache(maxsize=None)
def _manifest_paths(src: Path) -> tuple[tuple, ...]:
    doc = json.loads((src / "manifest.json").read_text())
    paths = _paths(doc)
    hot = [p for p in paths if p[0] in HOT]
    return tuple(hot * 3 + paths)  # the keys the analyzer reads, drawn three times as often


def _set_path(doc, path, value, delete=False):
    cur = doc
    for k in path[:-1]:
        try:
            cur = cur[k]
        except (KeyError, IndexError, TypeError):
            return
    try:
        if delete:
            del cur[path[-1]]
        else:
            cur[path[-1]] = value
    except (KeyError, IndexError, TypeError):
        pass


WHOLE_DOCS = [b"", b" \n", b"[]", b"1", b'"manifest"', b"null", b"{", b'{"config": ', b"\xff\xfe{}",
              b"[" * 100_000, b'{"a": ' * 100_000, b"{}", b'{"config": null, "metrics": null}',
              b'{"config": [], "metrics": [], "pipeline": [], "world_size": []}', b"{} {}", b"NaN"]
SPECIAL = ["fifo", "dir", "dangling", "missing", "devnull"]

manifest_edit = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 10**6), bad_value),
    st.tuples(st.just("del"), st.integers(0, 10**6)),
    st.tuples(st.just("whole"), st.sampled_from(WHOLE_DOCS)),
    st.tuples(st.just("truncate"), st.floats(0.0, 1.0)),
    st.tuples(st.just("special"), st.sampled_from(SPECIAL)),
)


def _special(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "dangling":
        path.symlink_to(path.parent / "gone")
    elif kind == "devnull":
        path.symlink_to("/dev/zero")


def _mutate_manifest(run: Path, src: Path, edits: list) -> None:
    mf = run / "manifest.json"
    doc = json.loads(mf.read_text())
    paths = _manifest_paths(src)
    raw = None
    for e in edits:
        if e[0] == "set":
            _set_path(doc, paths[e[1] % len(paths)], _expand(e[2]))
        elif e[0] == "del":
            _set_path(doc, paths[e[1] % len(paths)], None, delete=True)
        elif e[0] == "whole":
            raw = e[1]
        elif e[0] == "truncate":
            text = _dumps(doc).encode()
            raw = text[: int(len(text) * e[1])]
        else:
            _special(mf, e[1])
            return
    mf.write_bytes(raw if raw is not None else _dumps(doc).encode())


PIPE_FIELDS = ["step", "rank", "pp_rank", "stage", "microbatch", "kind", "start_ns", "end_ns"]
TIMES = [0, -1, 1, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, 1.5e18, float("nan"), float("inf")]
pipe_edit = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 10**6), st.sampled_from(PIPE_FIELDS), bad_value),
    st.tuples(st.just("time"), st.integers(0, 10**6), st.sampled_from(["start_ns", "end_ns"]), st.sampled_from(TIMES)),
    st.tuples(st.just("shift"), st.integers(0, 10**6), st.sampled_from(["start_ns", "end_ns"]),
              st.sampled_from([-(10**12), -(10**9), -1, 1, 10**9, 10**12, 10**15])),
    st.tuples(st.just("swap"), st.integers(0, 10**6)),
    st.tuples(st.just("del"), st.integers(0, 10**6), st.sampled_from(PIPE_FIELDS)),
    st.tuples(st.just("drop"), st.integers(0, 10**6), st.integers(1, 100)),
    st.tuples(st.just("dup"), st.integers(0, 10**6), st.integers(1, 20)),
    st.tuples(st.just("line"), st.integers(0, 10**6), st.sampled_from(
        [b"", b"[]", b"1", b'"x"', b"null", b"{", b"\xff\xfe", b"[" * 100_000, b'{"a":' * 100_000,
         b'{"kind": "' + b"F" * 200_000 + b'"}', b"{} {}", b"NaN"])),
    st.tuples(st.just("file"), st.sampled_from(["empty", "missing", "blank", "bad_gzip", "cut_gzip", "plain",
                                                "fifo", "dir", "other_rank", "dangling"])),
)


def _mutate_pipeline(run: Path, per_rank: list[list]) -> list[Path]:
    files = sorted((run / "pipeline").iterdir())
    for f, edits in zip(files, per_rank):
        records = [json.loads(ln) for ln in gzip.decompress(f.read_bytes()).splitlines() if ln.strip()]
        lines: list[bytes] | None = None
        how = "gz"
        for e in edits:
            kind = e[0]
            if kind == "file":
                how = e[1]
                continue
            if not records:
                continue
            i = e[1] % len(records)
            r = records[i]
            if kind == "set" and isinstance(r, dict):
                r[e[2]] = _expand(e[3])
            elif kind == "time" and isinstance(r, dict):
                r[e[2]] = e[3]
            elif kind == "shift" and isinstance(r, dict) and isinstance(r.get(e[2]), int):
                r[e[2]] += e[3]
            elif kind == "swap" and isinstance(r, dict):
                r["start_ns"], r["end_ns"] = r.get("end_ns"), r.get("start_ns")
            elif kind == "del" and isinstance(r, dict):
                r.pop(e[2], None)
            elif kind == "drop":
                del records[i: i + e[2]]
            elif kind == "dup":
                records[i:i] = [dict(x) if isinstance(x, dict) else x for x in records[i: i + e[2]]]
            elif kind == "line":
                records[i] = ("raw", e[2])
        lines = [x[1] if isinstance(x, tuple) else _dumps(x).encode() for x in records]
        data = b"\n".join(lines) + b"\n"
        if how in ("plain", "other_rank"):
            f.unlink()
            target = f.with_suffix("") if how == "plain" else f.with_name(f"rank{7 + len(files)}.jsonl")
            target.write_bytes(data)
        elif how == "empty":
            f.write_bytes(gzip.compress(b""))
        elif how == "blank":
            f.write_bytes(gzip.compress(b"\n \n\n"))
        elif how == "missing":
            f.unlink()
        elif how == "bad_gzip":
            f.write_bytes(b"\x1f\x8b not gzip")
        elif how == "cut_gzip":
            z = gzip.compress(data)
            f.write_bytes(z[: len(z) // 2])
        elif how in ("fifo", "dir", "dangling"):
            _special(f, how)
        else:
            f.write_bytes(gzip.compress(data, compresslevel=1))
    return sorted((run / "pipeline").iterdir())


# YAML: values written as YAML text, and whole documents that attack the parser.
def _laughs(depth: int, width: int) -> str:
    """A 'billion laughs' document: `width ** depth` nodes once its aliases are expanded."""
    lines = ['a0: &a0 ["lol"]']
    for i in range(1, depth + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


YAML_DOCS = [
    "", "---\n", "[]\n", "1\n", "null\n", "'just a string'\n", "{\n", "key: [unclosed\n", "\tkey: tab\n",
    "a: 1\na: 2\n", "!!python/object/apply:os.system ['true']\n", "x: !!python/name:os.system\n",
    "x: !!binary aGVsbG8=\n", "x: !!set {a, b}\n", "x: 2001-12-14t21:59:43.10-05:00\n", "x: &a [*a]\n",
    "[" * 20_000 + "]" * 20_000 + "\n", "a: " + "[" * 2000 + "]" * 2000 + "\n", "x: " + "y" * 200_000 + "\n",
    _laughs(3, 10), _laughs(6, 9), _laughs(7, 10), "x: .nan\ny: .inf\n", "x: 1e400\n",
]
YAML_VALUES = ["null", "~", "true", "-1", "0", "1e400", ".nan", "-.inf", "99999999999999999999999", "1.5", "'8'",
               "[]", "{}", "[1, [2, [3]]]", "{a: 1}", "!!python/object/apply:os.system ['true']", "&a [*a]",
               "'" + "x" * 50_000 + "'", "[" * 5000 + "]" * 5000, "*undefined", "{", "2001-12-14",
               "!!binary aGVsbG8=", "!!set {a}", "zbv", "interleaved", "loop", "triton", "fsdp"]
yaml_value = st.one_of(st.sampled_from(YAML_VALUES), st.integers(-(2**70), 2**70).map(str),
                       st.text(max_size=12).map(json.dumps))


def _yaml_text(base: dict, edits: list) -> str:
    import yaml

    doc = dict(base)
    extra, whole = [], None
    for e in edits:
        if e[0] == "set":
            extra.append(f"{e[1]}: {e[2]}")
            doc.pop(e[1], None)
        elif e[0] == "del":
            doc.pop(sorted(doc)[e[1] % len(doc)], None) if doc else None
        elif e[0] == "whole":
            whole = e[1]
    if whole is not None:
        return whole
    return yaml.safe_dump(doc, sort_keys=False) + "".join(x + "\n" for x in extra)


# ------------------------------------------------------------------------------------ properties


VERBS_ON_RUN = ["check", "whatif", "memory", "ppvis", "diff", "host", "comm", "roofline", "replay", "critpath"]


def _verb(case: Case, verb: str, run: Path, other: Path | None = None, extra: tuple = (), keys: tuple = ()) -> str:
    """Run ``verb`` on ``run`` and check its answer; returns 'ok' or 'error'. An error must name a file of
    the case, or (for ``--set`` values) one of ``keys``."""
    out = case.dir / "out"
    names = [str(case.dir), *(f"{k}:" for k in keys), *(f"{k}=" for k in keys), *(f"'{k}'" for k in keys)]
    j = out.with_suffix(".json")
    if verb in ("host", "comm", "check", "roofline", "critpath"):
        res = case.invoke([verb, run, "--json", j, *extra])
        ok = case.expect(res, names, (0, 1) if verb == "check" else (0,))
        if ok == "ok":
            check = {"host": _check_host, "comm": _check_comm, "check": _check_check, "roofline": _check_roofline,
                     "critpath": _check_critpath}[verb]
            if j.exists() or verb != "roofline":  # roofline of a CPU-only trace writes nothing
                _check_json(j, check, *((res.exit_code,) if verb == "check" else ()))
        return ok
    if verb == "whatif":
        res = case.invoke(["whatif", run, "--json", j, *extra])
        ok = case.expect(res, names + ["--set"])
        if ok == "ok":
            _check_json(j, _check_whatif)
        return ok
    if verb == "memory":
        res = case.invoke(["memory", run, "--json", j, *extra])
        ok = case.expect(res, names + ["--set", "memory: "])
        if ok == "ok":
            _check_json(j, _check_memory)
        return ok
    if verb == "ppvis":
        res = case.invoke(["ppvis", run, "-o", out.with_suffix(".html"), "--json", j, *extra])
        ok = case.expect(res, names)
        if ok == "ok":
            _check_json(j, _check_ppvis)
        return ok
    if verb == "diff":
        res = case.invoke(["diff", run, other or run, "-o", out])
        ok = case.expect(res, names)
        if ok == "ok":
            _check_json(out / "diff.json")
        return ok
    if verb == "replay":
        res = case.invoke(["replay", run, "--top", "3", "-o", out, *extra])
        ok = case.expect(res, names + ["replay: "])
        if ok == "ok":
            _check_replay(out)
        return ok
    raise ValueError(verb)


@FUZZ
@given(verb=st.sampled_from(VERBS_ON_RUN), pp=st.booleans(), edits=st.lists(manifest_edit, min_size=1, max_size=3))
def _prop_manifest(verb, pp, edits):
    def body(case: Case) -> str:
        src = PP2_RUN if pp or verb == "ppvis" else EP2_RUN
        run = _run_dir(case, src)
        _mutate_manifest(run, src, edits)
        other = _run_dir(case, EP2_OTHER, "other") if verb == "diff" else None
        return _verb(case, verb, run, other, ("--no-traces",) if verb == "ppvis" and not pp else ())

    _run("manifest", body, dict(verb=verb, pp=pp, edits=edits))


def test_mutated_manifests_error_in_one_line_or_satisfy_the_invariants():
    _prop_manifest()
    _finish("manifest")


@FUZZ
@given(verb=st.sampled_from(["ppvis", "ppvis", "ppvis", "whatif", "check"]), traces=st.booleans(),
       rank0=st.lists(pipe_edit, min_size=1, max_size=3), rank1=st.lists(pipe_edit, max_size=2))
def _prop_pipeline(verb, traces, rank0, rank1):
    def body(case: Case) -> str:
        run = _run_dir(case, PP2_RUN)
        _mutate_pipeline(run, [rank0, rank1])
        return _verb(case, verb, run, extra=("--no-traces",) if verb == "ppvis" and not traces else ())

    _run("pipeline", body, dict(verb=verb, traces=traces, rank0=rank0, rank1=rank1))


def test_mutated_pipeline_files_error_in_one_line_or_satisfy_the_invariants():
    _prop_pipeline()
    _finish("pipeline")


TRACE_VERBS = ["host", "comm", "check", "roofline", "replay", "diff", "critpath"]


@FUZZ
@given(verb=st.sampled_from(TRACE_VERBS), pair=st.booleans(), muts=st.lists(trace_mutation, min_size=1, max_size=3),
       gz=st.booleans())
def _prop_traces(verb, pair, muts, gz):
    def body(case: Case) -> str:
        srcs = [NCCL_2RANK / "rank0.json.gz", NCCL_2RANK / "rank1.json.gz"] if pair else [MOE_GROUPED]
        paths = []
        for k, src in enumerate(srcs):
            doc = _load_doc(src)
            if k == 0:
                _apply(doc, muts, Applied())
            p = case.dir / "traces" / f"rank{k}.json{'.gz' if gz else ''}"
            p.parent.mkdir(exist_ok=True)
            data = json.dumps(doc).encode()
            p.write_bytes(gzip.compress(data, compresslevel=1) if gz else data)
            paths.append(p)
        target = paths[0].parent if pair else paths[0]
        if verb == "diff":
            return _verb(case, "diff", target, MOE_GROUPED if not pair else NCCL_2RANK)
        return _verb(case, verb, target)

    _run("traces", body, dict(verb=verb, pair=pair, muts=muts, gz=gz))


def test_mutated_traces_through_every_trace_verb():
    _prop_traces()
    _finish("traces")


@lru_cache(maxsize=None)
def _tiny_config() -> dict:
    import yaml

    return yaml.safe_load((Path(__file__).resolve().parents[2] / "trainer" / "configs" / "tiny.yaml").read_text())


CONFIG_KEYS = ["n_layers", "d_model", "n_heads", "n_kv_heads", "n_routed_experts", "top_k", "seq_len",
               "micro_batch_size", "ep", "dp", "pp", "vpp", "microbatches", "pipeline_schedule", "pipeline_layout",
               "recompute_layer_ids", "dtype", "dp_mode", "extends", "grouped_gemm_backend", "sync_free_level",
               "moe_d_ff", "vocab_size", "attn_type", "kv_lora_rank", "not_a_key"]
yaml_edit = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(CONFIG_KEYS), yaml_value),
    st.tuples(st.just("del"), st.integers(0, 100)),
    st.tuples(st.just("whole"), st.sampled_from(YAML_DOCS)),
)


@FUZZ
@given(verb=st.sampled_from(["memory", "memory", "whatif"]), edits=st.lists(yaml_edit, min_size=1, max_size=3),
       sets=st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), yaml_value), max_size=2),
       extends=st.sampled_from([None, "self", "tiny", "missing", "loop"]))
def _prop_config(verb, edits, sets, extends):
    def body(case: Case) -> str:
        text = _yaml_text(_tiny_config(), edits)
        cfg = case.dir / "config.yaml"
        if extends == "self":
            text = "extends: config.yaml\n" + text
        elif extends == "loop":
            (case.dir / "b.yaml").write_text("extends: config.yaml\n")
            text = "extends: b.yaml\n" + text
        elif extends is not None:
            text = f"extends: {extends}\n" + text
        cfg.write_text(text)
        set_args = [a for k, v in sets for a in ("--set", f"{k}={v}")]
        keys = tuple(k for k, _ in sets)
        if verb == "memory":
            return _verb(case, "memory", cfg, extra=tuple(set_args), keys=keys)
        run = _run_dir(case, EP2_RUN)  # what-if reads the run's manifest; the changes are --set values
        return _verb(case, "whatif", run, extra=tuple(set_args), keys=keys)

    _run("config", body, dict(verb=verb, edits=edits, sets=sets, extends=extends))


def test_mutated_trainer_configs_and_set_values_error_in_one_line_or_satisfy_the_invariants():
    _prop_config()
    _finish("config")


# autotune: the sweep's trials are run by this stand-in (the trainer is not what is fuzzed here)
def _fake_runner(space, point, run_dir, on_start):
    from autotune.runner import TrialResult
    from autotune.space import key_of

    on_start(None)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    h = sum(key_of(point).encode()) % 97
    if h % 7 == 0:
        return TrialResult("failed", "crash", "crash: exit 1: boom", None, {"wall_s": 0.1})
    obj = 1000.0 + h
    return TrialResult("ok", None, None, obj, {"tokens_per_s_per_gpu": obj, "noise": 0.01, "signals": {}, "wall_s": 0.1})


SPACE_BASE = {"config": "tiny", "knobs": {"sync_free_level": [0, 1, 2], "grouped_gemm_backend": ["loop", "torch"],
                                          "manual_gc": [0, 2]},
              "fixed": {"steps": 4, "profile_step_start": 2, "profile_step_end": 3},
              "constraints": ["not (grouped_gemm_backend == 'loop' and sync_free_level >= 2)"],
              "objective": "tokens_per_s_per_gpu", "budget": {"trials": 3}, "guided": {"model": False}}
SPACE_KEYS = ["config", "nproc", "knobs", "baseline", "fixed", "constraints", "objective", "budget", "trial",
              "limits", "guided", "command", "knobs.sync_free_level", "budget.trials", "budget.wall_s",
              "trial.timeout_s", "trial.env", "limits.memory_gib", "guided.explore", "guided.kernel_table",
              "fixed.steps", "unknown"]
CONSTRAINTS = ["'", "sync_free_level >", "1/0", "undefined_name > 0", "len(5)", "sync_free_level == 'x' or 1",
               "max(range(10**6)) > 0", "[x for x in range(10)]", "(lambda: 1)()", "().__class__",
               "not_a_knob", "n_layers > 100"]
space_edit = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(SPACE_KEYS), yaml_value),
    st.tuples(st.just("constraint"), st.sampled_from(CONSTRAINTS)),
    st.tuples(st.just("del"), st.sampled_from(["config", "knobs", "fixed", "constraints", "objective", "budget"])),
    st.tuples(st.just("whole"), st.sampled_from(YAML_DOCS)),
)
STORE_EDITS = [
    ("trial", "status", "'running'"), ("trial", "status", "'bogus'"), ("trial", "objective", "'inf'"),
    ("trial", "objective", "1e999"), ("trial", "objective", "'x'"), ("trial", "knobs", "'{'"),
    ("trial", "knobs", "'[]'"), ("trial", "metrics", "'nope'"), ("trial", "findings", "'{}'"),
    ("trial", "run_dir", "'/'"), ("trial", "run_dir", "'../../outside'"), ("trial", "run_dir", "'trials/../../x'"),
    ("trial", "run_dir", "''"), ("trial", "key", "'other'"), ("trial", "pgid", "1"), ("trial", "pgid", "-1"),
    ("trial", "attempts", "-5"), ("trial", "parent", "999"), ("trial", "started", "'x'"),
    ("meta", "identity", "'{'"), ("meta", "identity", "'[]'"), ("meta", "strategy", "'null'"),
    ("meta", "elapsed_s", "'NaN'"), ("meta", "elapsed_s", "'\"x\"'"), ("meta", "space", "'1'"),
    ("bytes", "truncate", None), ("bytes", "garbage", None), ("bytes", "empty", None), ("bytes", "dir", None),
    ("bytes", "fifo", None), ("sql", "DROP TABLE autotune_meta", None), ("sql", "DROP TABLE autotune_trials", None),
    ("sql", "DELETE FROM autotune_trials", None), ("trialdir", "rm", None), ("trialdir", "file", None),
]


def _space_text(edits: list) -> str:
    import copy

    import yaml

    doc = copy.deepcopy(SPACE_BASE)
    extra = []
    for e in edits:
        if e[0] == "whole":
            return e[1]
        if e[0] == "set":
            if "." in e[1]:
                top, sub = e[1].split(".", 1)
                if not isinstance(doc.get(top), dict):
                    doc[top] = {}
                doc[top][sub] = yaml.safe_load("0")  # placeholder replaced below by the raw YAML text
                extra.append((top, sub, e[2]))
            else:
                doc.pop(e[1], None)
                extra.append((e[1], None, e[2]))
        elif e[0] == "constraint":
            doc["constraints"] = [*doc.get("constraints", []), e[1]]
        elif e[0] == "del":
            doc.pop(e[1], None)
    text = yaml.safe_dump({k: v for k, v in doc.items() if not any(k == t and s is None for t, s, _ in extra)},
                          sort_keys=False, width=10**9)
    for top, sub, raw in extra:
        if sub is None:
            text += f"{top}: {raw}\n"
        else:  # a nested key: a block of its own that replaces the mapping
            text = "\n".join(ln for ln in text.splitlines() if not ln.startswith(f"{top}:")) + "\n"
            others = {k: v for k, v in (doc.get(top) or {}).items() if k != sub}
            text += f"{top}:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in others.items()) + f"  {sub}: {raw}\n"
    return text


def _damage_store(out: Path, edit: tuple, row: int) -> None:
    db = out / "sweep.sqlite"
    kind, what, value = edit
    if kind in ("trial", "meta", "sql"):
        con = sqlite3.connect(db)
        try:
            if kind == "trial":
                ids = [r[0] for r in con.execute("SELECT id FROM autotune_trials ORDER BY id")]
                if ids:
                    con.execute(f"UPDATE OR IGNORE autotune_trials SET {what} = {value} WHERE id = ?",
                                (ids[row % len(ids)],))
            elif kind == "meta":
                con.execute(f"UPDATE autotune_meta SET v = {value} WHERE k = ?", (what,))
            else:
                con.execute(what)
            con.commit()
        except sqlite3.DatabaseError:
            pass  # a CHECK constraint refused the damage: the store keeps its own rules
        finally:
            con.close()
    elif kind == "bytes":
        data = db.read_bytes()
        if what == "truncate":
            db.write_bytes(data[: len(data) // 3])
        elif what == "garbage":
            db.write_bytes(data[:100] + os.urandom(64) + data[164:])
        elif what == "empty":
            db.write_bytes(b"")
        else:
            _special(db, what)
    elif kind == "trialdir":
        trials = sorted((out / "trials").iterdir()) if (out / "trials").is_dir() else []
        if trials:
            t = trials[row % len(trials)]
            shutil.rmtree(t)
            if what == "file":
                t.write_text("not a dir")


@FUZZ
@given(edits=st.one_of(st.just([]), st.lists(space_edit, max_size=3)), damage=st.sampled_from(STORE_EDITS), row=st.integers(0, 10),
       strategy=st.sampled_from(["guided", "grid", "random"]))
def _prop_autotune(edits, damage, row, strategy):
    def body(case: Case) -> str:
        import autotune.sweep

        space = case.dir / "space.yaml"
        space.write_text(_space_text(edits))
        out = case.dir / "sweep"
        sentinel = case.dir / "outside" / "keep.txt"  # nothing outside OUT may be touched
        sentinel.parent.mkdir()
        sentinel.write_text("keep")
        real = autotune.sweep._default_runner
        autotune.sweep._default_runner = _fake_runner
        try:
            res = case.invoke(["autotune", space, "-o", out, "--strategy", strategy])
            first = case.expect(res, [str(case.dir)])
            if first == "ok":
                assert (out / "sweep.sqlite").is_file() and (out / "best.yaml").is_file()
                _damage_store(out, damage, row)
                res = case.invoke(["autotune", space, "-o", out, "--strategy", strategy, "--resume"])
                first = case.expect(res, [str(case.dir)])
        finally:
            autotune.sweep._default_runner = real
        assert sentinel.read_text() == "keep", "a resumed sweep touched a file outside its directory"
        return first

    _run("autotune", body, dict(edits=edits, damage=damage, row=row, strategy=strategy))


def test_mutated_spaces_and_stores_error_in_one_line_or_resume():
    _prop_autotune()
    _finish("autotune")


# ------------------------------------------------------------------ defects the suite found, each pinned


def _one_line_exit_2(res, name: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tracelens: error: ") and name in lines[0], res.stderr


@pytest.mark.parametrize("manifest", [b"[" * 100_000, b"[]", b"{"], ids=["nested too deeply", "a list", "cut"])
def test_whatif_on_an_unreadable_manifest_is_one_line_error(tmp_path, manifest):
    """`whatif` let the profile's ProfileError through (exit 3, 'internal error') for a manifest the
    reader rejects."""
    run = tmp_path / "run"
    shutil.copytree(EP2_RUN, run)
    (run / "manifest.json").write_bytes(manifest)
    res = CliRunner().invoke(main, ["whatif", str(run)], env={"TRACELENS_CACHE_DIR": str(tmp_path / "cache")})
    _one_line_exit_2(res, str(run / "manifest.json"))


def test_a_manifest_value_nested_thousands_deep_is_rejected_when_read(tmp_path):
    """A 5,000-deep list inside manifest.json decoded (the decoder's limit is higher), reached a verb's output
    and broke its JSON writer: `ppvis --json` exit 3, RecursionError (the 2,000-example campaign, worker 31).
    Now the reader rejects any run-dir JSON nested deeper than MAX_JSON_DEPTH, counted without recursion."""
    from tracelens.io.run import MAX_JSON_DEPTH, json_depth, read_json_value

    assert json_depth({"a": [1, {"b": []}]}, 10) == 4 and json_depth(7, 10) == 0
    assert json_depth([[[[[]]]]], 2) == 3  # stops counting past the bound
    run = tmp_path / "run"
    shutil.copytree(EP2_RUN, run)
    doc = json.loads((run / "manifest.json").read_text())
    doc["notes"] = "@@DEEP@@"
    text = json.dumps(doc)
    for depth, ok in ((MAX_JSON_DEPTH - 1, True), (MAX_JSON_DEPTH, False), (5000, False)):  # one level down
        (run / "manifest.json").write_text(text.replace('"@@DEEP@@"', "[" * depth + "]" * depth))
        got, err = read_json_value(run / "manifest.json")
        assert (err is None) == ok, err
        if depth == MAX_JSON_DEPTH:  # decoded, then refused by the depth bound
            assert err == ("RecursionError", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        elif not ok:  # the decoder's own limit, where the recursion limit is below 5,000 (it varies by host)
            assert err[0] == "RecursionError"
    res = CliRunner().invoke(main, ["whatif", str(run)], env={"TRACELENS_CACHE_DIR": str(tmp_path / "cache")})
    _one_line_exit_2(res, str(run / "manifest.json"))
    res = CliRunner().invoke(main, ["ppvis", str(run), "--no-traces", "-o", str(tmp_path / "p.html"), "--json",
                                    str(tmp_path / "p.json")], env={"TRACELENS_CACHE_DIR": str(tmp_path / "cache")})
    assert res.exit_code in (0, 2) and "internal error" not in res.stderr, res.stderr


def test_host_json_of_a_late_rank_with_no_known_cause_has_no_nan(tmp_path):
    """The 10,000-case campaign (worker 49): 142 CPU events dropped from rank 0 of the two-rank trace left a
    late rank whose cause could not be told; `host --json` wrote it as NaN (not JSON). Now null."""
    d = tmp_path / "traces"
    d.mkdir()
    for k in (0, 1):
        doc = _load_doc(NCCL_2RANK / f"rank{k}.json.gz")
        if k == 0:
            _apply(doc, [("drop", "cpu", 734, 142)], Applied())
        (d / f"rank{k}.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    out = tmp_path / "host.json"
    res = CliRunner().invoke(main, ["host", str(d), "--json", str(out)],
                             env={"TRACELENS_CACHE_DIR": str(tmp_path / "cache")})
    assert res.exit_code == 0, res.stderr
    doc = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in host --json"))
    late = [f for f in doc["findings"] if f["type"] == "late_rank"]
    assert late and all(o["cause"] is None or isinstance(o["cause"], str) for o in late[0]["evidence"]["others"])
    assert any(o["cause"] is None for o in late[0]["evidence"]["others"])  # the case that was NaN


def test_a_pipeline_stage_of_2_63_is_refused_not_iterated(tmp_path):
    """The 10,000-case campaign (worker 10): rank 0's first pipeline action with `stage` 2**63-1 made `check`
    run past 120 s (a stage table sized by the largest stage). Now a stage or pp_rank past MAX_STAGES is a
    one-line error at the action's line (ppvis), and `check` answers at once (the pipeline section is skipped,
    said in the analysis' warnings)."""
    import time

    from tracelens.analysis.pipeline import MAX_STAGES

    run = tmp_path / "run"
    shutil.copytree(PP2_RUN, run)
    f = sorted((run / "pipeline").iterdir())[0]
    recs = [json.loads(ln) for ln in gzip.decompress(f.read_bytes()).splitlines() if ln.strip()]
    recs[0]["stage"] = 2**63 - 1
    f.write_bytes(gzip.compress(b"\n".join(json.dumps(r).encode() for r in recs) + b"\n"))
    env = {"TRACELENS_CACHE_DIR": str(tmp_path / "cache")}
    res = CliRunner().invoke(main, ["ppvis", str(run), "--no-traces", "-o", str(tmp_path / "p.html")], env=env)
    _one_line_exit_2(res, f"{f}:1")
    assert f"at most {MAX_STAGES - 1}" in res.stderr
    t0 = time.process_time()  # CPU time: bounded work whatever else runs on the machine
    res = CliRunner().invoke(main, ["check", str(run), "--json", str(tmp_path / "c.json")], env=env)
    assert res.exit_code in (0, 1) and time.process_time() - t0 < 60, res.stderr


@pytest.mark.parametrize("line", [b"[" * 100_000, b'{"step":' * 100_000], ids=["list", "object"])
def test_ppvis_on_a_deeply_nested_pipeline_line_is_one_line_error(tmp_path, line):
    """A pipeline jsonl line nested beyond the decoder's recursion limit was a RecursionError (exit 3)."""
    run = tmp_path / "run"
    shutil.copytree(PP2_RUN, run)
    f = run / "pipeline" / "rank1.jsonl.gz"
    lines = gzip.decompress(f.read_bytes()).splitlines()
    f.write_bytes(gzip.compress(b"\n".join(lines[:3] + [line] + lines[3:]) + b"\n"))
    res = CliRunner().invoke(main, ["ppvis", str(run), "--no-traces", "-o", str(tmp_path / "p.html")],
                             env={"TRACELENS_CACHE_DIR": str(tmp_path / "cache")})
    _one_line_exit_2(res, f"{f}:4")
    assert "nested too deeply" in res.stderr


@pytest.mark.parametrize("key,value", [("vpp", -3), ("microbatches", 1)])
def test_whatif_on_a_manifest_whose_config_does_not_validate_names_the_manifest(tmp_path, key, value):
    """A manifest whose own config the trainer's rules reject was reported as 'config error: vpp: ...',
    naming no file (the user changed nothing)."""
    run = tmp_path / "run"
    shutil.copytree(PP2_RUN, run)
    doc = json.loads((run / "manifest.json").read_text())
    doc["config"][key] = value
    (run / "manifest.json").write_text(json.dumps(doc))
    res = CliRunner().invoke(main, ["whatif", str(run)], env={"TRACELENS_CACHE_DIR": str(tmp_path / "cache")})
    _one_line_exit_2(res, str(run / "manifest.json"))
    assert key in res.stderr

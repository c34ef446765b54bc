"""tracelens.offload: analysis parts in a forked child give the values the parent would compute, and every
way the child can fail (raises, dies, hangs, returns what does not pickle) falls back to the parent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

import tracelens
from tracelens import offload

FX = Path(__file__).resolve().parent.parent / "fixtures"
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="offload forks on Linux only")


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv("TRACELENS_OFFLOAD", "1")


def _square(x):
    return x * x


def _pid_and(x):
    return os.getpid(), x


def _boom(x):
    raise ValueError(f"bad input {x}")


def _dies_in_child():
    if offload._in_child:
        os._exit(3)  # as a crash would: no result written
    return "parent"


def _hangs_in_child():
    if offload._in_child:
        threading.Event().wait()  # blocked, using no CPU (as on a lock held at the fork)
    return "parent"


def _unpicklable():
    return lambda: 7


def _nested():
    t = offload.submit(_pid_and, 1, events=10**9)
    return t.forked, t.result()


def _big(n):
    return bytes(range(256)) * (n // 256)


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


# -- when it forks ---------------------------------------------------------------------------------------

def test_plan_env_switches(monkeypatch):
    monkeypatch.setenv("TRACELENS_OFFLOAD", "0")
    assert offload.plan(10**9) == (False, "TRACELENS_OFFLOAD=0")
    monkeypatch.setenv("TRACELENS_OFFLOAD", "1")
    assert offload.plan(1)[0] is sys.platform.startswith("linux")


@linux
def test_plan_auto_needs_cpus_size_and_memory(monkeypatch):
    monkeypatch.delenv("TRACELENS_OFFLOAD", raising=False)
    import tracelens.io.scanner as sc

    monkeypatch.setattr(sc, "usable_cpus", lambda: 2)
    monkeypatch.setattr(offload, "_cpu_quota", lambda: None)
    monkeypatch.setattr(offload, "_mem_available", lambda: 1 << 40)
    assert offload.plan(offload.MIN_EVENTS) == (True, "idle CPU")
    go, why = offload.plan(offload.MIN_EVENTS - 1)
    assert not go and "below" in why
    import tracelens.trace as T

    monkeypatch.setattr(T, "_largest_load", T.OFFLOAD_MAX_BYTES)  # a 4 GiB+ input was loaded: bounded memory first
    go, why = offload.plan(10**9)
    assert not go and "large input" in why
    monkeypatch.setattr(T, "_largest_load", T.OFFLOAD_MAX_BYTES - 1)  # 2 GB: still forks
    assert offload.plan(10**9) == (True, "idle CPU")
    monkeypatch.setattr(T, "_largest_load", 0)
    monkeypatch.setattr(sc, "usable_cpus", lambda: 1)
    assert not offload.plan(10**9)[0]
    monkeypatch.setattr(sc, "usable_cpus", lambda: 8)
    monkeypatch.setattr(offload, "_cpu_quota", lambda: 1.0)  # a container granted one CPU of eight
    assert not offload.plan(10**9)[0]
    monkeypatch.setattr(offload, "_cpu_quota", lambda: 2.0)
    monkeypatch.setattr(offload, "_mem_available", lambda: 1)
    go, why = offload.plan(10**9)
    assert not go and "memory" in why


def test_no_fork_below_the_plan(monkeypatch):
    monkeypatch.setenv("TRACELENS_OFFLOAD", "0")
    t = offload.submit(_pid_and, 5, events=10**9)
    assert not t.forked and t.result() == (os.getpid(), 5) and t.fallback is None


# -- the child's result, and its failures ---------------------------------------------------------------

@linux
def test_child_computes_and_is_reaped(forced):
    t = offload.submit(_pid_and, 5, events=1)
    assert t.forked
    child = t.pid
    pid, x = t.result()
    assert x == 5 and pid == child != os.getpid() and t.fallback is None
    assert _gone(child)  # waited for: no zombie left behind
    assert t.result() == (pid, 5)  # kept


@linux
def test_child_exception_raises_in_parent(forced):
    t = offload.submit(_boom, 3, events=1)
    with pytest.raises(ValueError, match="bad input 3"):
        t.result()
    assert t.fallback == "in the child it raised ValueError"


@linux
def test_child_that_dies_falls_back(forced):
    t = offload.submit(_dies_in_child, events=1)
    assert t.result() == "parent" and "no result" in t.fallback


@linux
def test_stuck_child_is_killed_and_parent_computes(forced, monkeypatch):
    monkeypatch.setattr(offload, "STALL_S", 0.5)
    t = offload.submit(_hangs_in_child, events=1)
    child = t.pid
    s = time.monotonic()
    assert t.result() == "parent"
    assert time.monotonic() - s < 10
    assert "no CPU" in t.fallback and _gone(child)


@linux
def test_unpicklable_result_computed_in_parent(forced):
    t = offload.submit(_unpicklable, events=1)
    assert t.result()() == 7 and "does not pickle" in t.fallback


@linux
def test_result_larger_than_a_pipe_buffer(forced):
    t = offload.submit(_big, 5 << 20, events=1)
    assert t.result() == _big(5 << 20) and t.fallback is None


@linux
def test_no_fork_inside_a_child(forced):
    t = offload.submit(_nested, events=1)
    child = t.pid
    forked_inside, (pid, x) = t.result()
    assert t.fallback is None and forked_inside is False and x == 1
    assert pid == child  # the nested part ran in the child itself, not in a grandchild


@linux
def test_dropped_task_reaps_its_child(forced):
    t = offload.submit(_square, 4, events=1)
    child = t.pid
    del t
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child)


def _sleeps_in_child():
    if offload._in_child:
        time.sleep(120)
    return "parent"


@linux
def test_dropped_task_kills_a_running_child(forced):
    """A Task dropped before its result is collected (the parent's own part raised, ^C): the child's work
    is not wanted and the child goes at once, not when it would have finished."""
    t = offload.submit(_sleeps_in_child, events=1)
    child = t.pid
    s = time.monotonic()
    del t
    while not _gone(child) and time.monotonic() - s < 10:
        time.sleep(0.05)
    assert _gone(child) and time.monotonic() - s < 10


@linux
def test_fork_with_threads_alive_warns_nothing(forced):
    stop = threading.Event()
    th = threading.Thread(target=stop.wait, daemon=True)
    th.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert offload.submit(_square, 9, events=1).result() == 81
    finally:
        stop.set()
        th.join()


@linux
def test_buffered_output_is_written_once(tmp_path):
    script = ("import sys; from tracelens import offload\n"
              "sys.stdout.write('before-fork ')\n"  # buffered (stdout is a pipe), not flushed
              "print(offload.submit(abs, -2, events=1).result())\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "TRACELENS_OFFLOAD": "1"}, cwd=str(Path(__file__).resolve().parents[2]))
    assert p.returncode == 0, p.stderr
    assert p.stdout == "before-fork 2\n"


# -- the analyses: the same summary and tables with and without the child ---------------------------------

def _files(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def parent_alone(tmp_path_factory):
    """What the parent alone computes for an input (``TRACELENS_OFFLOAD=0``), once per input for the module (the
    tests below compare runs with the child against it), from one fresh analysis of the input: ``parent_alone(path)``
    its summary (dict, and its JSON text), warnings, tables and whether there is a pipeline account;
    ``parent_alone(path, files=True)`` the files `tracelens analyze` writes (`write_all`)."""
    from reports.artifacts import write_all

    refs = {}

    def get(path: Path, files: bool = False) -> dict:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRACELENS_OFFLOAD", "0")
            ref = refs.setdefault(path, {"a": None})
            if ref["a"] is None:
                ref["a"] = tracelens.analyze(tracelens.load(path, cache=False, progress=False))
            a = ref["a"]
            if files and "files" not in ref:
                out = tmp_path_factory.mktemp("parent_alone")
                written = write_all(a, out)
                assert "report" in written and "tables" in written
                ref["files"] = _files(out)
            if not files and "summary" not in ref:
                s = a.summary()
                ref.update(summary=s, summary_json=json.dumps(s, sort_keys=True, default=str),
                           warnings=list(a.warnings), tables=dict(a.tables()), pipeline_none=a.pipeline is None)
        return ref

    return get


def _everything(path, monkeypatch, mode):
    monkeypatch.setenv("TRACELENS_OFFLOAD", mode)
    a = tracelens.analyze(tracelens.load(path, cache=False, progress=False))
    s = a.summary()
    tables = {k: v for k, v in a.tables().items()}
    return a, json.dumps(s, sort_keys=True, default=str), tables


@linux
@pytest.mark.parametrize("path", [
    FX / "h200_pp2_run" / "1f1b",  # a run dir with a pipeline account
    FX / "h200_ep2_run" / "L0_loop",  # two ranks, NCCL
    FX / "h200_moe_1gpu" / "moe1gpu_loop.json.gz",
    FX / "cpu_tiny",  # no GPU: no roofline
])
def test_summary_and_tables_equal_with_the_child(path, monkeypatch, parent_alone):
    if not path.exists():
        pytest.skip(f"{path} missing")
    ref = parent_alone(path)
    a1, s1, t1 = _everything(path, monkeypatch, "1")
    assert s1 == ref["summary_json"]
    assert a1.warnings == ref["warnings"]
    t0 = ref["tables"]
    assert t1.keys() == t0.keys()
    for k in t0:
        assert t1[k].equals(t0[k]), k
    assert (a1.pipeline is None) == ref["pipeline_none"]


@linux
@pytest.mark.parametrize("path", [
    FX / "h200_pp2_run" / "1f1b",  # the pipeline section among the parts built in the child
    FX / "h200_ep2_run" / "L0_loop",  # two ranks: communication sections in the parent
    FX / "cpu_tiny",  # no GPU: the host tables among the parts
])
def test_outputs_byte_identical_with_the_child(path, monkeypatch, tmp_path, parent_alone):
    """`tracelens analyze`'s outputs: the tables' files and the page parts built in the summary's child
    (`Analysis.summary_with`) give the very bytes the parent alone writes."""
    from reports.artifacts import write_all

    if not path.exists():
        pytest.skip(f"{path} missing")
    want = parent_alone(path, files=True)["files"]
    monkeypatch.setenv("TRACELENS_OFFLOAD", "1")
    a = tracelens.analyze(tracelens.load(path, cache=False, progress=False))
    written = write_all(a, tmp_path / "1")
    assert "report" in written and "tables" in written
    got = _files(tmp_path / "1")
    assert got.keys() == want.keys() and len(want) > 3
    for name, data in want.items():
        assert got[name] == data, name


@linux
def test_summary_with_runs_here_in_the_parent_before_the_join(monkeypatch, parent_alone):
    """`Analysis.summary_with(beside, here)`: `here` runs in this process (the page's sections of the chain's
    results, `reports.html.chain_parts`) while `beside` runs in the child; the summary is `summary()`'s (the
    parent's alone, which `summary()` with the child equals: above)."""
    path = FX / "h200_ep2_run" / "L0_loop"
    if not path.exists():
        pytest.skip(f"{path} missing")
    monkeypatch.setenv("TRACELENS_OFFLOAD", "1")
    a = tracelens.analyze(tracelens.load(path, cache=False, progress=False))
    summary, beside, here = a.summary_with(lambda _: os.getpid(), lambda _: os.getpid())
    assert here == os.getpid() and beside != os.getpid()
    assert summary == parent_alone(path)["summary"]


def test_has_pipeline_data_decides_like_the_analysis(tmp_path):
    """The cheap test `analyze` uses to decide whether the pipeline account is worth a child agrees with
    the account itself: data found exactly when `pipeline_for_trace` returns one."""
    from tracelens.analysis.pipeline import has_pipeline_data, pipeline_for_trace

    import shutil

    alone = tmp_path / "rank0.json.gz"  # outside its run dir: the ranges in the trace decide
    shutil.copy(FX / "h200_pp2_run" / "1f1b" / "traces" / "rank0.json.gz", alone)
    for path in [FX / "h200_pp2_run" / "1f1b", alone, FX / "h200_ep2_run" / "L0_loop", FX / "cpu_tiny",
                 FX / "h200_moe_1gpu" / "moe1gpu_loop.json.gz"]:
        if not path.exists():
            continue
        tr = tracelens.load(path, cache=False, progress=False)
        assert has_pipeline_data(tr) == (pipeline_for_trace(tr) is not None), path


@linux
def test_shared_jobs_go_to_one_process_each():
    """`offload.Shared`: a job taken in a forked child is not taken here, and every job is taken once."""
    from tracelens.offload import Shared

    shared = Shared(200)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: take jobs until none is left, send their indices
        os.close(r)
        mine = []
        while (j := shared.take()) is not None:
            mine.append(j)
        os.write(w, bytes(mine))
        os._exit(0)
    os.close(w)
    here = []
    while (j := shared.take()) is not None:
        here.append(j)
    os.waitpid(pid, 0)
    there = list(os.read(r, 1024))
    os.close(r)
    assert sorted(here + there) == list(range(200))
    assert Shared(0).take() is None


def test_shared_jobs_without_a_pipe_are_all_taken_here(monkeypatch):
    from tracelens import offload

    monkeypatch.setattr(offload.sys, "platform", "darwin")
    shared = offload.Shared(3)
    assert [shared.take() for _ in range(4)] == [0, 1, 2, None]


@linux
def test_outputs_when_the_child_took_shared_jobs_and_failed(monkeypatch, tmp_path, parent_alone):
    """A child that took shared jobs (`reports.artifacts._shared_jobs`) and then failed: the parent computes its part
    again and builds the jobs it took; the outputs are those of one process."""
    import reports.artifacts as A
    from tracelens import offload

    path = FX / "h200_ep2_run" / "L0_loop"
    if not path.exists():
        pytest.skip(f"{path} missing")
    real = A._outputs

    def failing(analysis, report, tables, jobs, shared, tables_dir):
        if offload._in_child:  # takes every shared job, writes part of each table's CSV it took, then fails
            while (j := shared.take()) is not None:
                if jobs[j][0] == "table":
                    (tables_dir / f"{jobs[j][1]}.csv").write_bytes(b"part of a table the child never finished")
            raise RuntimeError("the child fails")
        return real(analysis, report, tables, jobs, shared, tables_dir)

    want = parent_alone(path, files=True)["files"]
    monkeypatch.setenv("TRACELENS_OFFLOAD", "1")
    monkeypatch.setattr(A, "_outputs", failing)
    a = tracelens.analyze(tracelens.load(path, cache=False, progress=False))
    A.write_all(a, tmp_path / "1")
    got = _files(tmp_path / "1")
    assert got.keys() == want.keys() and len(want) > 3
    for name, data in want.items():
        assert got[name] == data, name

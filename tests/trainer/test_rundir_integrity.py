"""Run-dir integrity: the manifest says "running" until the run ends ("complete", or "failed" with the
reason), it is written atomically, a killed rank ends the job with ONE line naming the rank and the
signal, `tracelens analyze` warns about an incomplete run, a re-run replaces the previous run, and a
non-finite loss stops the run (exit != 0, one line naming the step and the rank). Tiny gloo runs."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer import runtime
from trainer.launch import failure_line

REPO = Path(__file__).resolve().parents[2]
FIXTURE_RUN = REPO / "tests" / "fixtures" / "h200_ep2_run" / "L0_loop"


def _launch(run: Path, nproc: int, *sets: str) -> list[str]:
    cmd = [sys.executable, "-m", "trainer.launch", "--config", "tiny", "--nproc", str(nproc), "-o", str(run)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def _manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def _descendants(pid: int) -> list[int]:
    kids = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                kids.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _rank_pid(launcher: int, rank: int) -> int | None:
    for p in _descendants(launcher):
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"torch.distributed.run" not in cmd:
            return p
    return None


def _agent_pid(launcher: int) -> int | None:
    for p in _descendants(launcher):
        try:
            if b"torch.distributed.run" in Path(f"/proc/{p}/cmdline").read_bytes():
                return p
        except OSError:
            continue
    return None


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the rank's pid through /proc")
@pytest.mark.parametrize("peer_fails_first", [False, True], ids=["agent-stops-peers", "peer-fails-first"])
def test_a_killed_rank_ends_the_job_in_one_line_and_analyze_warns(tmp_path, peer_fails_first):
    """peer-fails-first: the elastic agent is paused until rank 0 has failed on the lost connection
    (gloo "Connection reset by peer"), so torchrun's own root cause is rank 0 -- the issue's ~200 lines
    with 3 tracebacks. The one line must still name rank 1 and SIGKILL."""
    run = tmp_path / "run"
    proc = subprocess.Popen(_launch(run, 2, "steps=5000", "profile_step_start=1", "profile_step_end=3"),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not all((run / "traces" / f"rank{r}.json.gz").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "the traces were not written in time"
            time.sleep(0.2)
        # mid-run the manifest marks the run incomplete
        assert _manifest(run)["status"] == "running"
        pid = _rank_pid(proc.pid, 1)
        assert pid is not None
        if peer_fails_first:
            agent, rank0 = _agent_pid(proc.pid), _rank_pid(proc.pid, 0)
            os.kill(agent, signal.SIGSTOP)
            try:
                os.kill(pid, signal.SIGKILL)
                deadline = time.time() + 60
                while not _gone(rank0) and time.time() < deadline:
                    time.sleep(0.1)
                assert _gone(rank0), "rank 0 did not fail on the lost peer"
            finally:
                os.kill(agent, signal.SIGCONT)
        else:
            os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # today: ~200 lines with 3 tracebacks
    assert "rank 1 was killed by SIGKILL" in lines[0] and f"pid {pid}" in lines[0] and str(run) in lines[0]
    assert "Traceback" not in err + out
    m = _manifest(run)
    assert m["status"] == "failed" and "rank 1 was killed by SIGKILL" in m["reason"]
    # everything torchrun said is kept
    log = (run / "logs" / "torchrun.log").read_text()
    assert "Root Cause" in log and "SIGKILL" in log
    if peer_fails_first:  # rank 0's own failure line and traceback are kept, not shown
        assert "[trainer] error: rank 0: " in log and (run / "logs" / "rank0.traceback.txt").is_file()
    # every trace in traces/ is whole (a rank killed while exporting leaves its part in .partial/)
    for t in (run / "traces").iterdir():
        with gzip.open(t, "rt") as f:
            json.load(f)
    r = subprocess.run([sys.executable, "-m", "tracelens.cli", "analyze", str(run), "-o", str(tmp_path / "an"),
                        "--no-report", "--no-tables"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    warn = [ln for ln in r.stderr.splitlines() if "incomplete run" in ln]
    assert len(warn) == 1 and warn[0].startswith("tracelens: warning: ") and "rank 1 was killed by SIGKILL" in warn[0]
    summary = json.loads((tmp_path / "an" / "summary.json").read_text())
    assert any("incomplete run" in w for w in summary["warnings"])


def _launch_here(run: Path, nproc: int, capsys, *sets: str) -> tuple[int, str, str]:
    """``python -m trainer.launch`` with ``nproc`` 1 in this process (``trainer.launch.main``: world size 1 trains
    in the launcher's own process, so only a process start and a torch import are left out) -> (status, stdout,
    stderr)."""
    from trainer.launch import main

    rc = main(_launch(run, nproc, *sets)[3:])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_non_finite_loss_stops_the_run(tmp_path, capsys, nproc):
    """2 ranks: the launcher's command (torchrun, the failed rank's one line); 1: the launcher in this process."""
    run = tmp_path / "run"
    sets = ("steps=8", "lr=1e30", "profile_step_end=0")
    if nproc == 1:
        rc, stdout, stderr = _launch_here(run, nproc, capsys, *sets)
    else:
        r = subprocess.run(_launch(run, nproc, *sets), cwd=REPO, capture_output=True, text=True, timeout=180,
                           check=False)
        rc, stdout, stderr = r.returncode, r.stdout, r.stderr
    assert rc not in (0, 2), stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("[trainer] error: rank ") and "step " in lines[0] and "non-finite" in lines[0]
    assert "Traceback" not in stderr
    step = int(lines[0].split("step ")[1].split(":")[0])
    assert 1 <= step < 8  # the loss is finite at step 0 (the update with lr 1e30 comes after it)
    assert f"[trainer] step {step} " not in stdout  # stopped before logging it
    m = _manifest(run)
    assert m["status"] == "failed" and f"step {step}" in m["reason"]


@pytest.mark.slow
def test_a_complete_run_says_so_and_a_rerun_replaces_the_previous_run(tmp_path, capsys):
    run = tmp_path / "run"
    # the previous run: 4 ranks, pipeline files, an analysis; plus a file of the user's
    (run / "traces").mkdir(parents=True)
    for r in range(4):
        shutil.copy(FIXTURE_RUN / "traces" / "rank0.json.gz", run / "traces" / f"rank{r}.json.gz")
    (run / "pipeline").mkdir()
    (run / "pipeline" / "rank3.jsonl").write_text("{}\n")
    (run / "manifest.json").write_text(json.dumps({"schema_version": 1, "status": "complete", "world_size": 4}))
    for name in ("report.html", "summary.json", "routing.json"):
        (run / name).write_text("old")
    (run / "tables").mkdir()
    (run / "tables" / "ops.csv").write_text("old")
    (run / "notes.txt").write_text("mine")
    rc, stdout, stderr = _launch_here(run, 1, capsys, "steps=4", "profile_step_start=1", "profile_step_end=2")
    assert rc == 0, stderr
    assert f"[trainer] {run}: replaced the previous run (manifest.json, traces, pipeline, routing.json, report.html, " \
           "summary.json, tables)" in stdout
    assert sorted(p.name for p in (run / "traces").iterdir()) == ["rank0.json.gz"]
    assert sorted(p.name for p in run.iterdir()) == ["manifest.json", "notes.txt", "routing.json", "traces"]
    assert json.loads((run / "routing.json").read_text())["run"]["run_id"] == _manifest(run)["run_id"]  # the new one
    assert (run / "notes.txt").read_text() == "mine"
    m = _manifest(run)
    assert m["status"] == "complete" and m["world_size"] == 1 and "reason" not in m
    assert m["created_utc"] <= m["finished_utc"]
    assert m["profile"]["traces"] == ["traces/rank0.json.gz"]
    import tracelens

    t = tracelens.load(run, cache=False, progress=False)
    assert t.run_status["status"] == "complete" and t.run_status["complete"] is True
    assert not any("incomplete" in w for w in t.warnings)


def test_manifest_writes_are_atomic(tmp_path):
    p = tmp_path / "manifest.json"
    runtime.write_json_atomic(p, {"status": "running"})
    with pytest.raises(TypeError):
        runtime.write_json_atomic(p, {("not", "a", "str key"): 1})  # fails while serializing
    assert json.loads(p.read_text()) == {"status": "running"}  # the old file, whole
    assert sorted(x.name for x in tmp_path.iterdir()) == ["manifest.json"]  # no temporary left
    assert runtime.mark_failed(tmp_path, "rank 1 was killed by SIGKILL")
    assert json.loads(p.read_text()) == {"status": "failed", "reason": "rank 1 was killed by SIGKILL"}
    runtime.write_json_atomic(p, {"status": "complete"})
    assert not runtime.mark_failed(tmp_path, "late")  # a complete run stays complete
    assert not runtime.mark_failed(tmp_path / "nowhere", "x")


def test_clearing_touches_only_a_previous_run_and_only_its_files(tmp_path):
    home = tmp_path / "home"  # `-o ~`: not a run dir, so its logs/ and tables/ are not ours
    for f in ("logs/torchrun.log", "tables/a.csv", "report.html", "traces/notes.txt"):
        (home / f).parent.mkdir(parents=True, exist_ok=True)
        (home / f).write_text("keep")
    assert runtime.clear_previous_run(home) == []
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file()) == [
        "logs/torchrun.log", "report.html", "tables/a.csv", "traces/notes.txt"]
    run = tmp_path / "run"  # a run dir (its traces, no manifest: killed before manifests came first)
    for f in ("traces/rank0.json.gz", "traces/rank1.json.gz", "traces/README.txt", "logs/torchrun.log",
              "logs/rank1.traceback.txt", "logs/mine.txt", ".partial/rank0.json.gz", "pipeline/rank0.jsonl"):
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        (run / f).write_text("x")
    assert runtime.clear_previous_run(run) == ["traces", "pipeline", "logs", ".partial"]
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == [
        "logs", "logs/mine.txt", "traces", "traces/README.txt"]


def _run_dir_with(tmp_path: Path, manifest) -> Path:
    run = tmp_path / "r"
    (run / "traces").mkdir(parents=True)
    shutil.copy(FIXTURE_RUN / "traces" / "rank0.json.gz", run / "traces" / "rank0.json.gz")
    if manifest is not None:
        (run / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    return run


@pytest.mark.parametrize("manifest, status, complete, warns", [
    ({"status": "running"}, "running", False, "incomplete run: manifest.json says status 'running'"),
    ({"status": "failed", "reason": "rank 1 was killed by SIGKILL"}, "failed", False,
     "incomplete run: the trainer failed (rank 1 was killed by SIGKILL)"),
    ({"status": "complete"}, "complete", True, None),
    ({"schema_version": 1, "metrics": {}}, "complete", True, None),  # written before the status field
    ("{not json", "unreadable", None, "unreadable manifest"),
    ([1, 2], "unreadable", None, "unreadable manifest"),
    ({"status": "paused"}, "unknown", None, "unknown run status 'paused'"),
])
def test_trace_run_status(tmp_path, manifest, status, complete, warns):
    import tracelens

    run = _run_dir_with(tmp_path, manifest)
    t = tracelens.load(run, cache=False, progress=False)
    rs = t.run_status
    assert (rs["status"], rs["complete"], rs["run_dir"]) == (status, complete, str(run.resolve()))
    if warns is None:
        assert rs["warning"] is None and not any("incomplete" in w for w in t.warnings)
    else:
        assert warns in rs["warning"] and t.warnings[0] == rs["warning"] and "\n" not in rs["warning"]


def test_no_run_status_outside_a_run_dir(tmp_path):
    import tracelens

    run = _run_dir_with(tmp_path, None)  # traces/ without a manifest: a directory of traces, not known as a run
    assert tracelens.load(run, cache=False, progress=False).run_status is None
    assert tracelens.load(run / "traces" / "rank0.json.gz", cache=False, progress=False).run_status is None


REPORT = """\
E1124 12:55:54.673000 1240 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: {root_code}) local_rank: {root} (pid: 1291) of binary: /usr/bin/python
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
trainer FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-24_12:55:54
  host      : localhost
  rank      : {other} (local_rank: {other})
  exitcode  : {other_code} (pid: 1290)
  error_file: <N/A>
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_12:55:54
  host      : localhost
  rank      : {root} (local_rank: {root})
  exitcode  : {root_code} (pid: 1291)
  error_file: <N/A>
======================================================"""


@pytest.mark.parametrize("root, root_code, other, other_code, errors, want, code", [
    (1, -9, 0, -15, {}, "rank 1 was killed by SIGKILL (pid 1291)", 137),
    (0, -11, 1, -15, {}, "rank 0 was killed by SIGSEGV (pid 1291)", 139),
    # the survivor's error came first (gloo noticed the lost peer before torchrun did): the kill is the cause
    (0, 1, 1, -9, {0: "RuntimeError: Connection closed by peer"}, "rank 1 was killed by SIGKILL (pid 1290)", 137),
    (1, 1, 0, -15, {1: "step 3: the loss is nan (non-finite): training stopped"},
     "rank 1: step 3: the loss is nan (non-finite): training stopped", 1),
    (0, 3, 1, -15, {}, "rank 0 exited with status 3", 3),
])
def test_failure_line_names_the_root_cause(root, root_code, other, other_code, errors, want, code):
    agent = REPORT.format(root=root, root_code=root_code, other=other, other_code=other_code).splitlines()
    line, status = failure_line(1, agent, errors)
    assert line.startswith(want) and status == code and "\n" not in line
    assert failure_line(1, [], {})[0] == "torchrun exited with status 1"
    assert failure_line(-9, [], {})[0] == "torchrun was killed by SIGKILL"


def test_two_ranks_error_lines_run_together_are_both_read(tmp_path):
    """Seen in the suite under load: with stderr unbuffered, ``print`` wrote rank 1's line and its newline
    in two writes and rank 0's line fell between them; the launcher then knew no cause for rank 0."""
    import io

    from trainer.cli import ERROR_PREFIX
    from trainer.launch import _Output

    out = _Output(tmp_path / "torchrun.log")
    console = io.StringIO()
    one = f"{ERROR_PREFIX}rank 1: step 1: the loss is nan (non-finite): training stopped"
    zero = f"{ERROR_PREFIX}rank 0: step 1: the loss is nan (non-finite): training stopped"
    out._route("[trainer] step 0 loss 4.8560" + one + zero, console)
    out.log.close()
    assert out.rank_errors == {1: one.split("rank 1: ")[1], 0: zero.split("rank 0: ")[1]}
    assert console.getvalue().startswith("[trainer] step 0 loss 4.8560")
    assert failure_line(1, [], out.rank_errors)[0].startswith("rank 0: step 1: the loss is nan")


def test_a_rank_error_line_is_one_write(monkeypatch):
    """The rank's line and its newline leave in one write (atomic on a pipe), never as print's two."""
    from trainer import cli

    r, w = os.pipe()
    fake = open(w, "w", encoding="utf-8", closefd=False)  # unbuffered-like: its own descriptor
    monkeypatch.setattr(sys, "stderr", fake)
    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(data) or real_write(fd, data))
    cli.say_error("rank 3: step 2: boom\nsecond line")
    fake.close()
    os.close(w)
    got = os.read(r, 4096)
    os.close(r)
    assert writes == [got] and got == f"{cli.ERROR_PREFIX}rank 3: step 2: boom second line\n".encode()


def _previous_run(run: Path) -> dict[str, str]:
    """A previous run in ``run``: its manifest, a trace and its torchrun log; returns path -> text."""
    files = {"manifest.json": json.dumps({"schema_version": 1, "status": "complete", "run_id": "old"}),
             "traces/rank0.json.gz": "old trace", "logs/torchrun.log": "old log"}
    for name, text in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    return files


def _tree(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): p.read_text() for p in run.rglob("*") if p.is_file()}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_config_refused_for_the_device_leaves_the_previous_run(tmp_path, capsys):
    """``device=cuda`` on a CPU machine passes the config's own checks and is refused by the rank (one line,
    exit 2): the launcher had already removed the previous run in RUN by then."""
    run = tmp_path / "run"
    before = _previous_run(run)
    rc, stdout, stderr = _launch_here(run, 1, capsys, "device=cuda")
    assert rc == 2 and stderr == "config error: device: device=cuda but CUDA is not available\n"
    assert "replaced the previous run" not in stdout
    assert _tree(run) == before


def _fake_torchrun(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_torchrun_refusing_the_config_leaves_the_previous_run(tmp_path, capsys):
    """Under torchrun the ranks refuse the config (one line, exit 2) before rank 0 replaces the previous run:
    its manifest, traces and log stay as they were and the launcher's log of the refused job goes."""
    from trainer.launch import run_torchrun

    run = tmp_path / "run"
    before = _previous_run(run)
    rc = run_torchrun(_fake_torchrun("import sys; print('config error: device: device=cuda but CUDA is not available',"
                                     " file=sys.stderr); sys.exit(2)"), run, "old")
    assert rc == 2
    assert capsys.readouterr().err == "config error: device: device=cuda but CUDA is not available\n"
    assert _tree(run) == before
    fresh = tmp_path / "fresh"  # a new run dir: no logs/ is left behind either
    fresh.mkdir()
    assert run_torchrun(_fake_torchrun("import sys; print('config error: x: bad', file=sys.stderr); sys.exit(2)"),
                        fresh, None) == 2
    assert list(fresh.iterdir()) == []


def test_a_fifo_manifest_does_not_hang_the_launcher(tmp_path, capsys):
    """The launcher reads RUN's previous manifest (its run_id) before the job: a FIFO there is no manifest."""
    from trainer.launch import run_torchrun

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "manifest.json")
    assert runtime.read_manifest(run) is None and not runtime.mark_failed(run, "x")
    assert run_torchrun(_fake_torchrun("import sys; print('config error: x: bad', file=sys.stderr); sys.exit(2)"),
                        run, None) == 2
    assert capsys.readouterr().err == "config error: x: bad\n"


def test_torchrun_log_of_a_started_run_is_its_torchrun_log(tmp_path, capsys):
    """A job whose rank 0 wrote its manifest (a new run_id): the launcher's log becomes RUN/logs/torchrun.log,
    and a failure marks that manifest; a job that ended before it started marks nothing of the previous run."""
    from trainer.launch import run_torchrun

    run = tmp_path / "run"
    _previous_run(run)
    start = ("import json, os, sys; os.remove('{r}/logs/torchrun.log'); open('{r}/manifest.json', 'w').write("
             "json.dumps({{'status': 'running', 'run_id': 'new'}})); print('[trainer] step 0'); sys.exit({rc})")
    assert run_torchrun(_fake_torchrun(start.format(r=run, rc=0)), run, "old") == 0
    assert (run / "logs" / "torchrun.log").read_text() == "[trainer] step 0\n"
    assert [p.name for p in (run / "logs").iterdir()] == ["torchrun.log"]
    _previous_run(run)
    assert run_torchrun(_fake_torchrun(start.format(r=run, rc=1)), run, "old") == 1
    assert _manifest(run)["status"] == "failed"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{run} is incomplete (manifest: failed); full output: {run}/logs/torchrun.log" in err[0]
    before = _previous_run(run)  # the job fails before rank 0 replaces the previous run
    assert run_torchrun(_fake_torchrun("import sys; print('[trainer] error: rank 0: boom', file=sys.stderr); sys.exit(1)"), run, "old") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[trainer] error: rank 0: boom; the run did not start"), err
    staged = err[0].rsplit("full output: ", 1)[1]
    assert Path(staged).read_text() == "[trainer] error: rank 0: boom\n"
    assert {k: v for k, v in _tree(run).items() if k != str(Path(staged).relative_to(run))} == before


@pytest.mark.slow
def test_sigterm_stops_a_one_process_run_and_its_manifest_says_failed(tmp_path):
    """``--nproc 1`` trains in the launcher's process: SIGTERM (kill, a scheduler) ended it where it stood, with
    no line and the manifest saying "running" for good."""
    run = tmp_path / "run"
    proc = subprocess.Popen(_launch(run, 1, "steps=100000", "profile_step_end=0"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while runtime.read_manifest(run) is None or runtime.read_manifest(run).get("status") != "running":
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "the run did not start in time"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err == f"[trainer] error: interrupted (SIGTERM); {run} is incomplete (manifest: failed)\n"
    m = _manifest(run)
    assert m["status"] == "failed" and m["reason"] == "rank 0: interrupted"


@pytest.mark.slow
def test_sigterm_to_tracelens_profile_stops_its_trainer(tmp_path):
    """``tracelens profile`` ran the trainer with ``subprocess.call``: SIGTERM ended tracelens alone and the
    trainer trained on into RUN (its manifest "running", then "complete"); a Ctrl-C killed it 0.25 s later."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "tracelens", "profile", "--config", "tiny", "-o", str(run),
           "--set", "steps=100000", "--set", "profile_step_end=0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while (runtime.read_manifest(run) or {}).get("status") != "running":
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "the run did not start in time"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)  # returns once the trainer, which holds the pipes too, has ended
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.splitlines()[1:] == [f"[trainer] error: interrupted (SIGTERM); {run} is incomplete (manifest: failed)",
                                    "tracelens: error: interrupted"]
    assert _manifest(run)["status"] == "failed"


def test_a_second_run_into_a_run_dir_in_use_is_refused(tmp_path, capsys):
    """Two runs into one RUN at once each wrote its manifest and traces: a long run profiled early and a short
    one started meanwhile left the long run's "complete" manifest over the short run's trace. Rank 0 now holds
    the run dir's lock (a flock on the directory) for the run; a second run is one line, exit 2, nothing written."""
    run = tmp_path / "run"
    before = _previous_run(run)
    held = runtime.lock_run_dir(run)  # the first run (a flock conflicts across descriptors, in one process too)
    assert held is not None and held >= 0
    try:
        rc, stdout, stderr = _launch_here(run, 1, capsys, "steps=1")
    finally:
        os.close(held)
    assert rc == 2 and stderr.splitlines() == [
        f"config error: out: {run}: another run is writing into this run dir (it holds the dir's lock); wait for it "
        "to end, or choose another -o"]
    assert _tree(run) == before
    fd = runtime.lock_run_dir(run)  # released with its holder
    assert fd is not None and fd >= 0
    os.close(fd)

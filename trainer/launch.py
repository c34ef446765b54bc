"""``python -m trainer.launch --config CFG --nproc N [--set ...] -o RUN``: world size 1 runs in this
process; N > 1 spawns ``python -m torch.distributed.run --standalone --nproc-per-node N -m trainer ...``
and returns its exit code. Importable without torch (the tracelens CLI runs it as a subprocess); the
config, including dp*ep == N, is validated here first so a bad config fails in one line, exit 2.

A previous run's outputs in RUN are removed by rank 0 once the config has passed the checks that need the
ranks' device (docs/trainer.md, "Re-running"), not here: a config refused there (``device=cuda`` without
CUDA, ``compile=dense`` without a compiler) leaves the previous run as it was. Under torchrun the ranks' output is passed through as it comes, but what the elastic agent says
(its log lines, its banner, its traceback and failure report when a rank dies) and the ranks' own
failure lines go to ``RUN/logs/torchrun.log`` only (written as ``RUN/logs/.torchrun.<pid>.log`` until the
new run has started, then renamed; kept under that name when the job ended before it started): a failed job ends with ONE line naming the root-cause
rank and why it ended (the signal that killed it, or its own one-line error), and its manifest is marked
``failed`` with that reason.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from moespec.config import ConfigError

ERROR_PREFIX = "[trainer] error: "  # same as trainer.cli.ERROR_PREFIX (not imported: keep this module light)
# torch.distributed.elastic's log lines: "W1124 12:46:24.860000 15655 .../torch/distributed/.../api.py:1028] ..."
_AGENT_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch[/\\]distributed[/\\]")
_NOISE = re.compile(r"^(\*{10,}|Setting OMP_NUM_THREADS environment variable for each process|USDT:)")
_RANK_ERROR = re.compile(r"^" + re.escape(ERROR_PREFIX) + r"rank (\d+): (.*)$")
_FAILED_CHILD = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def build_command(nproc: int, trainer_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "trainer", *trainer_args]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m trainer.launch", add_help=True,
                                description="Launch the trainer on N local processes (torchrun for N > 1).")
    p.add_argument("--nproc", type=int, default=1)
    args, rest = p.parse_known_args(argv)
    if args.nproc < 1:
        print("config error: nproc: must be >= 1", file=sys.stderr)
        return 2
    from trainer.cli import build_parser, config_from_args, run_dir_of  # no torch import in trainer.cli at module level

    targs = build_parser("python -m trainer.launch").parse_args(rest)
    try:
        from moespec.config import resolve_world

        resolve_world(config_from_args(targs), args.nproc)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    out = Path(run_dir_of(targs))
    from trainer import runtime

    previous = runtime.read_manifest(out)  # the run dir's run before this one (rank 0 replaces it)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"{ERROR_PREFIX}{out}: cannot prepare the run dir ({err.strerror or err})", file=sys.stderr)
        return 2
    if args.nproc == 1:
        from trainer.cli import main as run_main

        return run_main(rest)
    return run_torchrun(build_command(args.nproc, rest), out, (previous or {}).get("run_id"))


class _Output:
    """Reads torchrun's stdout and stderr line by line: everything into the log, the ranks' ordinary
    output through to ours, the agent's noise and the ranks' failure lines held back."""

    def __init__(self, log_path: Path):
        self.log = open(log_path, "w", encoding="utf-8", errors="replace")
        self.lock = threading.Lock()
        self.agent: list[str] = []  # what the elastic agent said (log lines, failure report)
        self.rank_errors: dict[int, str] = {}  # rank -> its one-line error (first one)
        self.failing = False  # once a failure shows, nothing more goes to the console but rank stdout
        self.config_error: str | None = None

    def pump(self, stream, console) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            with self.lock:
                self.log.write(line + "\n")
                self.log.flush()
                self._route(line, console)

    def _route(self, line: str, console) -> None:
        at = line.find(ERROR_PREFIX, 1)
        if at > 0:  # another process's output ran into this line without its newline: route each part
            self._route(line[:at], console)
            self._route(line[at:], console)
            return
        m = _RANK_ERROR.match(line)
        if m:
            self.rank_errors.setdefault(int(m.group(1)), m.group(2))
            self.failing = True
            return
        if _AGENT_LOG.match(line):
            self.agent.append(line)
            if " failed (exitcode" in line or "closing signal" in line:
                self.failing = True
            return
        if line.startswith("config error: "):  # a rank rejected the config (exit 2)
            self.config_error = self.config_error or line
            self.failing = True
            return
        if "Traceback (most recent call last)" in line or "ChildFailedError" in line:
            self.failing = True
        if self.failing and console is not sys.stdout:
            self.agent.append(line)  # the agent's traceback and failure report, or a rank's traceback
            return
        if _NOISE.match(line) or (not line.strip() and console is not sys.stdout):
            return
        console.write(line + "\n")
        console.flush()

    def close(self) -> None:
        self.log.close()


def run_torchrun(cmd: list[str], out: Path, previous_run_id: str | None = None) -> int:
    """Run torchrun, pass the ranks' output through, and condense a failure into one line (stderr).
    ``previous_run_id``: the ``run_id`` of the manifest in ``out`` before the job (a manifest with another one
    is this job's: its run has started)."""
    log_path = out / "logs" / "torchrun.log"
    logs_made = not log_path.parent.exists()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    staged = log_path.with_name(f".torchrun.{os.getpid()}.log")  # rank 0 leaves it be when it clears logs/
    output = _Output(staged)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    readers = [threading.Thread(target=output.pump, args=(proc.stdout, sys.stdout), daemon=True),
               threading.Thread(target=output.pump, args=(proc.stderr, sys.stderr), daemon=True)]
    for t in readers:
        t.start()
    interrupted = None
    old = signal.signal(signal.SIGTERM, _raise_interrupt) if threading.current_thread() is threading.main_thread() else None
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt as err:  # Ctrl-C reaches torchrun too; SIGTERM is passed on
                interrupted = interrupted or (str(err) or "SIGINT")
                if proc.poll() is None:
                    try:
                        proc.send_signal(signal.SIGTERM)
                    except OSError:
                        pass
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    for t in readers:
        t.join(timeout=10)
    output.close()
    from trainer import runtime

    doc = runtime.read_manifest(out)
    started = doc is not None and doc.get("run_id") is not None and doc.get("run_id") != previous_run_id
    if started:
        os.replace(staged, log_path)
    if rc == 0 and interrupted is None:
        return 0
    line, code = failure_line(rc, output.agent, output.rank_errors, interrupted)
    if code == 2 and output.config_error:
        if not started:  # refused before rank 0 replaced the previous run: nothing of this job is left
            staged.unlink(missing_ok=True)
            if logs_made:
                try:
                    log_path.parent.rmdir()
                except OSError:
                    pass
        print(output.config_error, file=sys.stderr, flush=True)
        return 2
    if not started:  # the previous run (if any) is untouched: its manifest is not this job's to mark
        print(f"{ERROR_PREFIX}{line}; the run did not start (nothing in {out} was replaced); full output: {staged}",
              file=sys.stderr, flush=True)
        return code
    marked = runtime.mark_failed(out, line)
    tail = f"; {out} is incomplete (manifest: failed)" if marked else f"; {out} is incomplete"
    print(f"{ERROR_PREFIX}{line}{tail}; full output: {log_path}", file=sys.stderr, flush=True)
    return code


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def failures(agent: list[str]) -> list[dict]:
    """The failures in torchrun's failure report (``rank``, ``exitcode``, ``pid``, ``root``: whether it is
    the report's "Root Cause (first observed failure)"), else from the agent's "failed (exitcode ...)" line."""
    out: list[dict] = []
    root = False
    rank = None
    for ln in agent:
        if ln.startswith("Root Cause"):
            root = True
        m = re.match(r"^\s*rank\s*:\s*(\d+)", ln)
        if m:
            rank = int(m.group(1))
            continue
        m = re.match(r"^\s*exitcode\s*:\s*(-?\d+)(?:\s*\(pid:\s*(\d+)\))?", ln)
        if m and rank is not None:
            out.append({"rank": rank, "exitcode": int(m.group(1)), "pid": m.group(2), "root": root})
            rank = None
    if not out:
        for ln in agent:
            m = _FAILED_CHILD.search(ln)
            if m:
                out.append({"rank": int(m.group(2)), "exitcode": int(m.group(1)), "pid": m.group(3), "root": True})
                break
    return out


def failure_line(rc: int, agent: list[str], rank_errors: dict[int, str], interrupted: str | None = None) -> tuple[str, int]:
    """(one line saying why the job ended, exit status). The cause is torchrun's root cause (the first
    observed failure), except that a rank killed by a signal torchrun does not send (anything but SIGTERM)
    outranks ranks that exited with an error: those are its peers failing on the lost connection."""
    if interrupted is not None:
        return f"interrupted ({interrupted}): the ranks were stopped", 130
    fs = failures(agent)
    killed = [f for f in fs if f["exitcode"] < 0 and f["exitcode"] != -signal.SIGTERM]
    cause = next((f for f in fs if f["root"]), fs[0] if fs else None)
    if cause is not None and cause["exitcode"] >= 0 and killed:
        cause = killed[0]
    if cause is None:
        if rank_errors:
            r = min(rank_errors)
            return f"rank {r}: {rank_errors[r]}", rc if rc > 0 else 1
        if rc < 0:
            return f"torchrun was killed by {_signame(-rc)}", 128 - rc
        return f"torchrun exited with status {rc}", rc
    rank, code, pid = cause["rank"], cause["exitcode"], cause["pid"]
    if code < 0:
        return (f"rank {rank} was killed by {_signame(-code)}" + (f" (pid {pid})" if pid else "")
                + "; torchrun stopped the other ranks"), 128 - code
    status = code if code > 0 else (rc or 1)
    if rank in rank_errors:
        return f"rank {rank}: {rank_errors[rank]}", status
    return f"rank {rank} exited with status {code}", status


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def exit_with(rc: int) -> None:
    """End the process with ``rc``. An interrupted run (130) ends with os._exit after flushing: under ``python -m``
    CPython turns the exit of a program into death by SIGINT when a KeyboardInterrupt was ever raised inside code it
    ran through PyRun_String (torch runs some), so the status was 130 or -SIGINT by where the signal landed."""
    if rc == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(rc)


if __name__ == "__main__":
    exit_with(main())

"""Launching a test worker script on several gloo processes and reading the JSON it writes.

``run_worker`` starts ``python tests/trainer/_workers.py NPROC SCRIPT ARGS...`` (``launch_module``: ``... NPROC -m
MODULE ARGS...``): a launcher that imports torch once, then forks one process per rank, each running SCRIPT (or
MODULE, as ``python -m`` does) as ``__main__`` with the environment torchrun gives
its ranks (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a TCPStore the launcher
hosts, as torchrun's agent does). The workers' claims are about what the ranks compute, not about torchrun: a
torchrun launch of 4 ranks is 5 Python processes that each import torch (~3 s of CPU apiece), this is one. The
real torchrun path (``trainer.launch``'s elastic agent, its log handling and failure line) is run end to end by
tests/test_readme.py, tests/trainer/test_bench_knobs.py and the ``trainer.launch --nproc 2`` tests.

The launcher imports torch (and the parts of it every trainer rank imports: FSDP2, DTensor, torch._dynamo) and
nothing else before forking (no torch op has run, so no OpenMP or intra-op thread pool exists to be inherited
half-alive; no thread has started); everything else the script imports it imports in each rank, after the fork,
so environment a worker sets before its imports acts as under torchrun, except ``TRITON_INTERPRET``: triton is
imported in the launcher (by torch._dynamo), so a worker that runs Triton interpreted gets it from ``run_worker(...,
env=)`` (the two that do check it and stop, saying so). A rank that fails
stops the others (as torchrun's agent does: a peer blocked in a collective would wait for its timeout); the launcher exits with the first failing rank's status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_worker(script: str, out: Path, nproc: int = 4, timeout: int = 600, args: tuple[str, ...] = (),
               result: str = "results.json", env: dict[str, str] | None = None) -> dict:
    """Run ``tests/trainer/<script> OUT *args`` on ``nproc`` gloo ranks (the forking launcher below) with this
    checkout on the path; asserts a clean exit (stderr's tail on failure) and returns ``OUT/<result>``. ``env``: set
    in the launcher before it imports torch (``TRITON_INTERPRET``: torch._dynamo, imported there, imports triton,
    which reads it at import)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), str(nproc), str(REPO / "tests" / "trainer" / script),
           str(out), *args]
    p = _run_launcher(cmd, timeout, f"{script} on {nproc} ranks: no result", env)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((out / result).read_text())


def _run_launcher(cmd: list[str], timeout: int, what: str,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the launcher ``cmd`` in a session of its own (a timeout stops the ranks with it: AssertionError naming
    ``what`` and stderr's tail); the completed process, whatever its status."""
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, stderr = p.communicate()
        raise AssertionError(f"{what} after {timeout} s\n{stderr[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)


def launch_module(module: str, args: list[str], nproc: int, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m MODULE *args`` on ``nproc`` gloo ranks (the forking launcher below, from the checkout's root), e.g.
    the trainer's ranks without ``trainer.launch``'s torchrun; the completed process, whatever its status."""
    cmd = [sys.executable, str(Path(__file__).resolve()), str(nproc), "-m", module, *args]
    return _run_launcher(cmd, timeout, f"python -m {module} on {nproc} ranks: no exit")


def interpreter_or_stop() -> None:
    """For a worker that runs Triton interpreted on a CPU (the EP dispatch and placement workers), before it sets
    TRITON_INTERPRET: triton reads it when it is imported, and a launcher that imported triton first (this one imports
    torch._dynamo, which imports it) must have set it (``run_worker(..., env={"TRITON_INTERPRET": "1"})``); else the
    worker stops, saying so (its Triton cases would fail far from the cause)."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get(
            "EP_WORKER_DEVICE") != "cuda":
        raise SystemExit("triton was imported before this worker set TRITON_INTERPRET=1: launch it with "
                         "run_worker(..., env={'TRITON_INTERPRET': '1'})")


def _launch(nproc: int, script: str, argv: list[str]) -> int:
    """Fork ``nproc`` ranks of ``script`` (see the module's docstring); the first failing rank's exit status."""
    import ctypes

    # one OpenMP thread per rank unless the caller chose (what torchrun sets for its ranks); set before torch loads
    # its OpenMP runtime, which reads it once
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch  # noqa: F401 - imported once here, inherited by every rank
    # and what every trainer rank imports after it (FSDP2's DTensor ops, and torch._dynamo, which FSDP's
    # `_disable_dynamo`-wrapped functions import on their first call): ~3 s of CPU per rank otherwise. Importing
    # them registers ops and classes; it starts no thread (checked below) and runs no op
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    from torch.distributed import TCPStore

    assert threading.active_count() == 1, "a thread started before the ranks fork"

    sys.stdout.flush()
    sys.stderr.flush()
    pids, pipes = {}, []
    for rank in range(nproc):  # forked before the store below starts its thread: no thread is ever forked
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            for fd in pipes:  # the earlier ranks' pipes
                os.close(fd)
            prctl = getattr(ctypes.CDLL(None), "prctl", None)  # Linux: the rank ends with its launcher
            if prctl is not None:
                prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            with os.fdopen(r) as f:
                port = f.readline().strip()
            if not port:  # the launcher failed before it had a store
                os._exit(1)
            os._exit(_rank_main(script, argv, {
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": "0", "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        os.close(r)
        pipes.append(w)
        pids[pid] = rank
    # the rendezvous store, hosted here as torchrun's agent hosts it: every rank connects as a client
    # (TORCHELASTIC_USE_AGENT_STORE), and port 0 lets the kernel pick a free port with no race for it
    store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    for w in pipes:
        os.write(w, f"{store.port}\n".encode())
        os.close(w)
    status = 0
    while pids:
        pid, wait = os.wait()
        pids.pop(pid)
        code = os.waitstatus_to_exitcode(wait)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code  # killed by a signal: 128 + its number, as a shell says
            for other in pids:  # a peer blocked in a collective would otherwise wait for its timeout
                os.kill(other, signal.SIGTERM)
    return status


def _rank_main(script: str, argv: list[str], env: dict[str, str]) -> int:
    """One rank: the script (``-m MODULE``: the module) as ``__main__``; its exit status (a traceback on stderr if it
    raised)."""
    import runpy
    import traceback

    os.environ.update(env)
    module = argv[0] if script == "-m" else None
    if module:
        argv = argv[1:]
    code = 0
    try:
        if module:  # as `python -m MODULE` runs it: the working directory first on the path
            sys.argv = [module, *argv]
            sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:  # as `python SCRIPT` runs it: the script's directory first on the path
            sys.argv = [script, *argv]
            sys.path[0] = str(Path(script).parent)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported, and the rank's exit status says it failed
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(_launch(int(sys.argv[1]), sys.argv[2], sys.argv[3:]))

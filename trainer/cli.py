"""``python -m trainer --config CFG [--set key=value ...] [--sync-free-level N ...] -o runs/NAME``.

Runs in this process (world size 1) or as one rank under torchrun. A bad config prints one line
(``config error: <key>: ...``) and exits 2, without a traceback. A run that fails (a non-finite loss,
out of memory, a lost peer, a bug) prints one line ``[trainer] error: rank R: ...`` and exits 1; the
traceback, if any, goes to ``RUN/logs/rank<R>.traceback.txt`` (``TRAINER_DEBUG=1`` raises it instead).
Under torchrun the launcher (:mod:`trainer.launch`) collects these lines and prints the root cause.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from moespec.config import CLI_FLAG_KEYS, ConfigError, load_config, parse_override
from moespec.placement import placement_plan


def build_parser(prog: str = "python -m trainer") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="DeepSeek-style MoE trainer (writes a tracelens run dir)")
    p.add_argument("--config", required=True, help="YAML file or a name under trainer/configs (e.g. tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key (YAML value syntax); repeatable")
    p.add_argument("-o", "--out", default=None, help="run directory (default runs/<config name>)")
    for key in CLI_FLAG_KEYS:
        p.add_argument("--" + key.replace("_", "-"), dest=f"flag_{key}", default=None, metavar="V",
                       help=f"same as --set {key}=V")
    return p


def config_from_args(args) -> dict:
    overrides: dict = {}
    for item in args.overrides:
        k, v = parse_override(item)
        overrides[k] = v
    for key in CLI_FLAG_KEYS:
        v = getattr(args, f"flag_{key}")
        if v is not None:
            overrides[key] = parse_override(f"{key}={v}")[1]
    cfg = load_config(args.config, overrides)
    # ep_placement=balanced: read ep_placement_loads now, so a file that does not fit this model is one line
    # (exit 2) before any rank starts; the trainer builds its model from the same plan
    placement_plan(cfg)
    return cfg


ERROR_PREFIX = "[trainer] error: "  # a failed rank's one line (trainer.launch recognises it)


def run_dir_of(args) -> str:
    return args.out or str(Path("runs") / Path(args.config).stem)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    out = run_dir_of(args)
    rank = os.environ.get("RANK", "0")
    # not under torchrun: SIGTERM (kill, a job scheduler, a sweep's timeout) stops the run like Ctrl-C, so its
    # manifest says failed; it used to end the process where it stood, the manifest saying "running"
    # The first SIGINT or SIGTERM stops the run, later ones are ignored until it has stopped (a Ctrl-C reaches
    # `tracelens profile`, which passes it on, and this process both: a second interrupt would cut short the
    # manifest's "failed")
    alone = not ("WORLD_SIZE" in os.environ and "RANK" in os.environ)
    old = ({sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)
            if signal.getsignal(sig) is not signal.SIG_IGN}  # an ignored signal (nohup, a background job) stays so
           if alone and threading.current_thread() is threading.main_thread() else {})
    try:
        from trainer.train import shutdown, train

        try:
            train(cfg, out)
        finally:
            shutdown()
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C (or torchrun stopping the job): under torchrun the launcher says so
        if alone:
            from trainer import runtime

            m = runtime.read_manifest(out) or {}
            marked = m.get("status") == "failed" and m.get("reason") == "rank 0: interrupted"
            say_error(f"interrupted ({str(err) or 'SIGINT'}); {out} is incomplete" + (" (manifest: failed)" if marked else ""))
        return 130
    except Exception as err:  # noqa: BLE001 - every failure of a rank is one line
        if os.environ.get("TRAINER_DEBUG"):
            raise
        say_error(f"rank {rank}: " + describe_failure(err, out, rank))
        return 1
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 0


def _interrupt(signum, frame):
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def say_error(text: str) -> None:
    """Print a rank's one error line with a single write. The ranks share torchrun's stderr pipe, and
    ``print`` writes the text and its newline separately where stderr is unbuffered (PYTHONUNBUFFERED):
    two ranks failing at once then ran together on one line, and the launcher lost the first one's cause.
    One write of at most PIPE_BUF bytes to a pipe is atomic."""
    data = (ERROR_PREFIX + " ".join(text.splitlines()) + "\n").encode("utf-8", "replace")
    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), data)
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. a captured stream)
        sys.stderr.write(data.decode("utf-8"))
        sys.stderr.flush()


def describe_failure(err: BaseException, out: str, rank: str) -> str:
    """One line for a rank's failure; the traceback is saved beside the run (not for a TrainingError)."""
    from trainer.train import TrainingError, one_line

    msg = one_line(err)
    if isinstance(err, MemoryError) or "out of memory" in msg.lower() or "can't allocate memory" in msg.lower():
        msg = "out of memory: " + msg
    if isinstance(err, TrainingError):
        return msg
    path = Path(out) / "logs" / f"rank{rank}.traceback.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(err)))
        return f"{msg} (traceback: {path})"
    except OSError:
        return msg

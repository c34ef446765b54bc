"""``python -m trainer.launch --config CFG --nproc N [--set ...] -o RUN``: world size 1 runs in this
process; N > 1 spawns ``python -m torch.distributed.run --standalone --nproc-per-node N -m trainer ...``
and returns its exit code. Importable without torch (the tracelens CLI runs it as a subprocess); the
config, including dp*ep == N, is validated here first so a bad config fails in one line, exit 2.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from trainer.config import ConfigError


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
    from trainer.cli import build_parser, config_from_args  # no torch import in trainer.cli at module level

    targs = build_parser("python -m trainer.launch").parse_args(rest)
    try:
        from trainer.config import resolve_world

        resolve_world(config_from_args(targs), args.nproc)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    if args.nproc == 1:
        from trainer.cli import main as run_main

        return run_main(rest)
    return subprocess.call(build_command(args.nproc, rest))


if __name__ == "__main__":
    sys.exit(main())

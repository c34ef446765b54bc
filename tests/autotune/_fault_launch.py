"""Test-only fault injection for autotune trials: a launcher wrapper used as the space's ``command``.

    command: [python, tests/autotune/_fault_launch.py, --crash-if, "sync_free_level=1",
              --hang-if, "sync_free_level=2", "--"]

The runner appends the usual launcher arguments (``--config ... --set key=<json> ...``). When every
``key=value`` of a ``--crash-if`` spec matches the trial's ``--set`` values, the wrapper fails the way
a crashing trainer does (a traceback, exit 1); ``--hang-if`` makes it sleep until it is killed (a hung
collective); otherwise it becomes ``python -m trainer.launch`` with the same arguments (exec, same pid).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _spec(text: str) -> dict:
    out = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        out[k.strip()] = json.loads(v)
    return out


def main(argv: list[str]) -> int:
    crash, hang = [], []
    while argv and argv[0] != "--":
        opt, val, argv = argv[0], argv[1], argv[2:]
        (crash if opt == "--crash-if" else hang).append(_spec(val))
    rest = argv[1:]
    sets = {}
    for i, a in enumerate(rest):
        if a == "--set":
            k, _, v = rest[i + 1].partition("=")
            sets[k] = json.loads(v)
    match = lambda spec: all(sets.get(k) == v for k, v in spec.items())  # noqa: E731
    if any(match(s) for s in crash):
        print("[fault] injected crash", flush=True)
        raise RuntimeError("injected fault: trainer crashed")
    if any(match(s) for s in hang):
        print("[fault] injected hang", flush=True)
        while True:
            time.sleep(60)
    os.execv(sys.executable, [sys.executable, "-m", "trainer.launch", *rest])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

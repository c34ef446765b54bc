"""Regenerate the golden outputs in tests/golden/data/ (the expected files of tests/golden/test_golden.py).

    .venv/bin/python tests/golden/regen.py                    # every case (about 2 minutes on 2 cores)
    .venv/bin/python tests/golden/regen.py pp2_1f1b ep2_L0    # the cases whose id starts with one of these
    .venv/bin/python tests/golden/regen.py --check            # compare only, as the test does; writes nothing

When: only when an output of tracelens is meant to change -- a fixed bug, a new column or summary key, a
changed report. A refactoring that is meant to leave the outputs alone must pass the golden test
without regenerating; that is what the test is for. When it fails, read its message (case, file and the
first differing keys, cells or lines) and fix the code, not the golden.

How: the cases run in two fresh processes, one with TRACELENS_OFFLOAD=0 and one with =1, each with its
own PYTHONHASHSEED, and their files must be the same byte for byte (else it prints the differences and
writes nothing: an output that depends on the run is a bug to fix first, not to mask). Then the chosen
cases' directories under data/ are replaced and the script lists which golden files changed. Add or
change cases in tests/golden/cases.py.

A commit that regenerates goldens must say in its message which outputs changed and why (the list
this script prints is the start of that message), so a reviewer can tell an intended change from a
regression. Keep the committed data small (under 3 MB in all): prefer a few diverse cases.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.golden import harness
from tests.golden.cases import CASES


def select(prefixes: list[str]) -> list:
    if not prefixes:
        return list(CASES)
    chosen = [c for c in CASES if any(c.id.startswith(p) for p in prefixes)]
    if not chosen:
        sys.exit(f"regen: no case id starts with {' or '.join(prefixes)} (ids: {', '.join(c.id for c in CASES)})")
    return chosen


def produce(cases: list, root: Path) -> None:
    """Run the cases in this process, writing their golden files under root (not under data/)."""
    work = Path(tempfile.mkdtemp(prefix="tracelens-golden-"))
    os.environ["TRACELENS_CACHE_DIR"] = str(work / "cache")
    os.chdir(REPO)
    try:
        for i, case in enumerate(cases):
            files = harness.run_case(case, work / "out" / str(i))
            status = files[harness.CLI_FILE].split(b"\n", 1)[0]
            if status not in (b"exit 0", b"exit 1"):
                sys.exit(f"regen: {case.id}: {status.decode()} (bad input or an internal error), not a golden:\n"
                         + files[harness.CLI_FILE].decode())
            harness.write_golden(case.id, files, root)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _child(ids: list[str], root: Path, offload: str, seed: str) -> subprocess.Popen:
    env = {**os.environ, "TRACELENS_OFFLOAD": offload, "PYTHONHASHSEED": seed}
    return subprocess.Popen([sys.executable, __file__, "--produce", str(root), "--exact", *ids], env=env)


def _report(title: str, problems: dict[str, list[str]]) -> None:
    print(title)
    for case_id, probs in problems.items():
        for p in probs:
            print(f"  {case_id}/{p}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", help="case id prefixes (default: all)")
    ap.add_argument("--check", action="store_true", help="compare with the stored goldens; write nothing")
    ap.add_argument("--produce", metavar="DIR", help=argparse.SUPPRESS)  # the child processes
    ap.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cases = [c for c in CASES if c.id in set(args.cases)] if args.exact else select(args.cases)
    if args.produce:
        produce(cases, Path(args.produce))
        return 0

    with tempfile.TemporaryDirectory(prefix="tracelens-regen-") as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        ids = [c.id for c in cases]
        runs = [_child(ids, a, "0", "1")] + ([] if args.check else [_child(ids, b, "1", "2")])
        if any(p.wait() != 0 for p in runs):
            print("regen: a generating process failed (see above); nothing written", file=sys.stderr)
            return 1
        if not args.check:
            unstable = {c.id: harness.compare(harness.read_golden(c.id, a), harness.read_golden(c.id, b))
                        for c in cases}
            unstable = {k: v for k, v in unstable.items() if v}
            if unstable:
                _report("regen: the outputs differ between two runs (TRACELENS_OFFLOAD 0 vs 1, other hash seed); "
                        "nothing written:", unstable)
                return 1
        changed = {c.id: harness.compare(old, harness.read_golden(c.id, a)) if (old := harness.read_golden(c.id))
                   else ["(new case)"] for c in cases}
        changed = {k: v for k, v in changed.items() if v}
        if args.check:
            _report(f"{len(changed)} of {len(cases)} case(s) differ from the golden:" if changed
                    else f"all {len(cases)} case(s) match the golden", changed)
            return 1 if changed else 0
        for c in cases:
            shutil.rmtree(harness.case_dir(c.id), ignore_errors=True)
            shutil.copytree(harness.case_dir(c.id, a), harness.case_dir(c.id))
    if not args.cases:  # a full regeneration also drops the data of cases that no longer exist
        dirs = [harness.case_dir(c.id) for c in CASES]
        for p in sorted(harness.DATA.rglob("*"), reverse=True):
            if p.is_file() and not any(d in p.parents for d in dirs):
                p.unlink()
            elif p.is_dir() and not any(p.iterdir()):
                p.rmdir()
    size = sum(p.stat().st_size for p in harness.DATA.rglob("*") if p.is_file())
    _report(f"wrote {len(cases)} case(s) ({size / 2**20:.2f} MiB under {harness.DATA.relative_to(REPO)}); "
            f"{len(changed)} changed -- say which and why in the commit message:", changed)
    return 0


if __name__ == "__main__":
    sys.exit(main())

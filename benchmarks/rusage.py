"""Run a command; print its wall time, user and system CPU, peak RSS and page faults (getrusage of the child,
its own children included), one line: `rusage.py LABEL -- CMD ...`. For machines without /usr/bin/time."""

import argparse
import resource
import subprocess
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("label")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    t = time.perf_counter()
    rc = subprocess.call(cmd, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"{a.label} rc {rc} wall {wall:.3f} user {r.ru_utime:.3f} sys {r.ru_stime:.3f} rss_mb {r.ru_maxrss / 1024:.0f} "
          f"minflt {r.ru_minflt} majflt {r.ru_majflt} nvcsw {r.ru_nvcsw} nivcsw {r.ru_nivcsw}")
    return rc


if __name__ == "__main__":
    sys.exit(main())

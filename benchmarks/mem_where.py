"""Where a load + analyze + summary reaches each new RSS high: a thread reads /proc/self/statm every
millisecond and, whenever RSS has grown by 20 MB over the last high, records the main thread's innermost
four frames (file:line). Linux only; the sampling costs a few percent of wall time.

    python benchmarks/mem_where.py /tmp/big/big-2000MB/rank0.json          # the last 40 highs
    python benchmarks/mem_where.py TRACE --all                              # every one
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20
STEP_MB = 20


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_MB


def main() -> None:
    if len(sys.argv) < 2 or not os.path.isfile(sys.argv[1]):
        print(f"usage: {sys.argv[0]} TRACE [--all]  (TRACE: one trace file)", file=sys.stderr)
        sys.exit(2)
    main_id = threading.main_thread().ident
    highs: list[tuple[float, str]] = []
    done = threading.Event()

    def sample() -> None:
        high = 0.0
        while not done.is_set():
            r = _rss_mb()
            if r > high + STEP_MB:
                high = r
                frame = sys._current_frames().get(main_id)
                stack = traceback.extract_stack(frame)[-4:] if frame is not None else []
                del frame  # a held frame would keep its locals (large arrays) alive
                highs.append((r, " < ".join(f"{os.path.basename(s.filename)}:{s.lineno}" for s in reversed(stack))))
            time.sleep(0.001)

    threading.Thread(target=sample, daemon=True).start()
    import tracelens

    tr = tracelens.load(sys.argv[1], cache=False, progress=False)
    highs.append((_rss_mb(), "---- loaded (RSS now)"))
    a = tracelens.analyze(tr)
    highs.append((_rss_mb(), "---- analyzed (RSS now)"))
    a.summary()
    highs.append((_rss_mb(), "---- summary (RSS now)"))
    done.set()
    for r, where in highs if "--all" in sys.argv else highs[-40:]:
        print(f"{r:8.0f} MB  {where}")


if __name__ == "__main__":
    main()

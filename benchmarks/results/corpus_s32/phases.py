"""`tracelens analyze` as the console script runs it (tracelens.cli.entry), with a line on stderr when each phase
ends, in seconds since this process started its Python: the scan and the parse in the prefetch thread, the imports,
the load, the analysis, the summary and the written outputs (stop 32, issue 37: which chain is the critical path).
Nothing is imported ahead of the command's own order. Usage: python phases.py analyze TRACE -o OUT"""

import resource
import sys
import threading
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # this checkout's packages (run as a script, not installed)


def mark(what: str) -> None:
    r = resource.getrusage(resource.RUSAGE_SELF)
    sys.stderr.write(f"PHASE {time.perf_counter() - T0:.3f} {what} [{threading.current_thread().name}] "
                     f"cpu {r.ru_utime + r.ru_stime:.2f} minflt {r.ru_minflt} maxrss_mb {r.ru_maxrss // 1024}\n")


def wrap(obj, name: str, label: str, before: bool = False) -> None:
    orig = getattr(obj, name)

    def f(*a, **k):
        if before:
            mark(label + " start")
        r = orig(*a, **k)
        mark(label)
        return r

    setattr(obj, name, f)


import tracelens  # noqa: E402
from tracelens.io import prefetch, scanner  # noqa: E402

wrap(scanner.Scan, "run", "scan", before=True)
wrap(prefetch, "_parse_beside", "parse")
wrap(tracelens._no_gc, "__exit__", "imports and preload")
orig_load = tracelens.load


def load(*a, **k):
    r = orig_load(*a, **k)
    mark("load")
    import reports.artifacts as RA
    import tracelens.analyzer as A

    wrap(A.Analysis, "summary_with", "summary_with", before=True)
    wrap(RA, "write_all", "write_all", before=True)
    orig_an = A.analyze

    def an(*a, **k):
        mark("analyze start")
        res = orig_an(*a, **k)
        mark("analyze")
        return res

    tracelens.analyze = an
    return r


tracelens.load = load
import tracelens.cli as cli  # noqa: E402

sys.argv = ["tracelens"] + sys.argv[1:]
cli.entry()

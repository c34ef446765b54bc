"""tracelens: read PyTorch (Kineto) traces into columnar tables and explain where the time went.

Scriptable API (the CLI and the reports are thin layers over it):

    import tracelens
    trace = tracelens.load("runs/demo")      # a trace file, a directory of rank files, or a run dir
    result = tracelens.analyze(trace)        # timeline, call tree, ops/kernels/category tables
    result.summary()                         # the summary.json machine interface

torch is never imported here: analyzing traces needs only pandas, pyarrow and msgspec.
"""

__version__ = "0.1.0"

from .errors import TraceError, TraceWarning  # noqa: E402
from .trace import Trace, load  # noqa: E402
from .analyze import Analysis, analyze  # noqa: E402

__all__ = ["Analysis", "Trace", "TraceError", "TraceWarning", "analyze", "load", "__version__"]

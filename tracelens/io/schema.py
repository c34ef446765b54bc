"""What the loader keeps of a Kineto trace: the arg columns, which categories carry which args, and the
version of the table layout (part of every cache key).

Plain data with no imports, shared by the msgspec path (`kineto.py`), the compiled scanner's spec
(`scanner.py`) and the cache (`cache.py`), so a light module can name them without importing numpy.
"""

from __future__ import annotations

# Every arg the analyzer reads: column name -> (key in the trace, kind). Kinds: "int" (int64, -1 when
# absent), "str" (dictionary string), "raw" (compact JSON text of a list/object, dictionary string),
# "float" (float64, NaN when absent).
ARG_FIELDS: dict[str, tuple[str, str]] = {
    "correlation": ("correlation", "int"),
    "external_id": ("External id", "int"),
    "device": ("device", "int"),
    "stream": ("stream", "int"),
    "bytes": ("bytes", "int"),
    "grid": ("grid", "raw"),
    "block": ("block", "raw"),
    "collective": ("Collective name", "str"),
    "in_nelems": ("In msg nelems", "int"),
    "out_nelems": ("Out msg nelems", "int"),
    "group_size": ("Group size", "int"),
    "dtype": ("dtype", "str"),
    "pg_name": ("Process Group Name", "str"),
    "pg_desc": ("Process Group Description", "str"),
    "pg_ranks": ("Process Group Ranks", "raw"),
    "in_split": ("In split size", "raw"),
    "out_split": ("Out split size", "raw"),
    "seq": ("Sequence number", "int"),
    "fwd_tid": ("Fwd thread id", "int"),
    "rf_id": ("Record function id", "int"),
    "input_dims": ("Input Dims", "raw"),
    "input_types": ("Input type", "raw"),
    "input_strides": ("Input Strides", "raw"),
    "concrete_inputs": ("Concrete Inputs", "raw"),
    "flops": ("flops", "float"),
    "module": ("Module Hierarchy", "str"),
    "call_stack": ("Call stack", "str"),
    "python_id": ("Python id", "int"),
    "python_parent_id": ("Python parent id", "int"),
}
_COLLECTIVE = ("collective", "in_nelems", "out_nelems", "group_size", "dtype", "pg_name", "pg_desc",
               "pg_ranks", "in_split", "out_split")
# Which args each category carries; only those are decoded (a runtime call never has shapes).
_GROUPS: dict[str, tuple[str, ...]] = {
    "gpu": ("correlation", "external_id", "device", "stream", "bytes", "grid", "block") + _COLLECTIVE,
    "runtime": ("correlation", "external_id", "device", "stream"),
    "op": ("external_id", "seq", "fwd_tid", "rf_id", "input_dims", "input_types", "input_strides",
           "concrete_inputs", "flops", "module", "call_stack") + _COLLECTIVE,
    "python": ("python_id", "python_parent_id"),
}
CAT_GROUP: dict[str, str] = {
    "kernel": "gpu", "gpu_memcpy": "gpu", "gpu_memset": "gpu", "gpu_user_annotation": "gpu",
    "Kernel": "gpu", "Memcpy": "gpu", "Memset": "gpu",
    "cuda_runtime": "runtime", "cuda_driver": "runtime", "cuda_sync": "runtime", "Runtime": "runtime",
    "cpu_op": "op", "user_annotation": "op", "Operator": "op", "cuda_profiler_range": "op",
    "python_function": "python", "Python": "python",
}

# raw list args kept unquoted as written (rank lists and split sizes), not as JSON strings
UNQUOTE_COLS = frozenset({"pg_ranks", "in_split", "out_split"})
SCHEMA_VERSION = 7  # 2-3: impossible events dropped at load (checks.py), entries sealed (cache.py); 4: call-tree
# events first (roworder.py); 5: names cut at limits.MAX_NAME_BYTES; 6: ts/dur exact from their text (timestamps.py);
# 7: cache entries as Arrow IPC files instead of Parquet (cache.py)

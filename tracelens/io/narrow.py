"""Numeric arg columns of an events table in the narrowest type that holds their values, and string
columns' dictionary codes in the narrowest type their dictionary's size allows (`narrow_args`).

Applied twice by the loader: to each file's table as it is parsed (`kineto._parsed`: the compiled
scanner already writes its int args narrow, the msgspec path's come as int64, and both decoders must
give the same table), and to the events of all ranks after their concatenation (`trace._concat_ranks`),
where it narrows again what the dropped events (`checks.check_events`) or the union of ranks allow.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .schema import ARG_FIELDS

_NARROW_INTS = ((pa.int8(), np.iinfo(np.int8)), (pa.int16(), np.iinfo(np.int16)), (pa.int32(), np.iinfo(np.int32)))


def narrow_args(table: pa.Table) -> pa.Table:
    """The events table with its numeric arg columns (`ARG_FIELDS`: correlation, External id, device,
    stream, bytes, sizes, ids, sequence numbers, flops) stored in the narrowest type that holds every value
    exactly: an int column in int8/int16/int32 when all its values (-1 = absent) fit (int64 otherwise; a
    column already narrower than int64 is narrowed further when its values allow), a float column with no
    value (all NaN) in float32. Most of these args are absent from most events (a 2 GB trace: 13 int64
    columns of mostly -1, 104 of its ~170 bytes per row), so this halves the table; the values are
    unchanged, and the analyses widen what they copy into their own tables (`calltree.gpu_events`).
    ts, dur, pid and tid, read everywhere, are not arg columns and stay int64. String columns (dictionary
    encoded) get codes of the narrowest signed type that indexes their dictionary (int8 below 128 values),
    whatever width the decoder gave them."""
    import pyarrow.compute as pc

    for name, (_, kind) in ARG_FIELDS.items():
        i = table.schema.get_field_index(name)
        if i < 0 or table.num_rows == 0:
            continue
        col = table.column(i)
        if col.null_count:
            continue
        to = None
        if kind == "int" and pa.types.is_signed_integer(col.type) and col.type.bit_width > 8:
            mm = pc.min_max(col)
            lo, hi = mm["min"].as_py(), mm["max"].as_py()
            to = next((t for t, info in _NARROW_INTS if info.min <= lo and hi <= info.max), None)
            if to is not None and to.bit_width >= col.type.bit_width:
                to = None
        elif kind == "float" and pa.types.is_float64(col.type):
            to = pa.float32() if pc.all(pc.is_nan(col)).as_py() else None
        if to is not None:
            table = table.set_column(i, name, col.cast(to, safe=False))  # the range is checked above
        del col
    for i, f in enumerate(table.schema):  # string columns: codes in int8 below 128 distinct values, ...
        if not pa.types.is_dictionary(f.type) or not table.num_rows:
            continue
        col = table.column(i)
        size = max((len(c.dictionary) for c in col.chunks), default=0)
        to = next((t for t, info in _NARROW_INTS if size - 1 <= info.max), pa.int32())
        if to != f.type.index_type and to.bit_width <= 32:
            table = table.set_column(i, f.name, col.cast(pa.dictionary(to, f.type.value_type)))
        del col
    return table

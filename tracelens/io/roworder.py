"""Row order of the events table: the call tree's events first.

The call tree (tracelens.analysis.calltree) has a row per host event: CPU ops, user annotations,
runtime/driver calls and nn.Module ranges (`categories.is_call_tree_event`), ~85 % of a training
trace's events. When those rows are one block at the top of the events table, the tree's copies of
their columns (start, duration, ids, names, shapes: ~45 bytes per event, ~0.8 GB at 8 GB of trace) are
views instead. So each parsed file's table is ordered here, tree events first, the rest after, each
part in file order (a stable partition: ties the analyses break by file order break the same way);
`trace._concat_ranks` then stacks the ranks' tree parts before their other parts.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from ..categories import call_tree_mask
from .scanner import usable_cpus


def _codes_and_values(col: pa.ChunkedArray) -> tuple[np.ndarray, list]:
    """(codes, distinct values) of a string column, dictionary-encoded or not."""
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if not pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_encode()
    idx = arr.indices
    codes = (idx.fill_null(-1) if idx.null_count else idx).to_numpy(zero_copy_only=False)
    return codes, arr.dictionary.to_pylist()


def tree_mask(table: pa.Table) -> np.ndarray:
    """Mask of the table's rows that are call-tree events."""
    if table.num_rows == 0 or any(c not in table.column_names for c in ("ph", "cat", "name")):
        return np.zeros(table.num_rows, dtype=bool)
    return call_tree_mask(*(_codes_and_values(table[c]) for c in ("ph", "cat", "name")))


def tree_rows_first(holder: list[pa.Table]) -> tuple[pa.Table, int]:
    """(the table with its call-tree events first, how many there are). holder: a one-element list
    holding the table, which this empties: holding the only reference, it moves the rows a column at a
    time with one column's copy beside the table (not at all when they are in order already)."""
    table = holder.pop()
    mask = tree_mask(table)
    k = int(np.count_nonzero(mask))
    if mask[:k].all():
        return table, k
    order = pa.array(np.concatenate([np.flatnonzero(mask), np.flatnonzero(~mask)]))
    del mask
    names = table.column_names
    cols = [table.column(i) for i in range(len(names))]
    # Arrow's take releases the GIL: a few columns at a time on the usable CPUs (a worker's result is set
    # as soon as it comes, so a few columns' copies sit beside the table, not the table's)
    with ThreadPoolExecutor(max_workers=max(1, min(usable_cpus(), 4)), thread_name_prefix="tracelens-take") as ex:
        for i, col in enumerate(ex.map(lambda c: c.take(order), cols)):
            cols[i] = None
            table = table.set_column(i, names[i], col)
    return table, k

"""`named_agg`: pandas' named aggregation (``df.groupby(keys).agg(out=(column, "sum"), ...)``) without its fixed cost.

pandas turns named aggregations into its older dict-of-lists form and back (a MultiIndex of the output columns, built,
reordered and renamed), ~5-10 ms a call however small the table; an analysis makes a dozen such calls (the host
syncs by op, the idle gaps by rank and cause, the roofline's groups and families, ...). Here one groupby is made and
each output column is its own reduction of it (`SeriesGroupBy.sum`, `.first`, ...: the functions the named form calls
for these names, on the same groups in the same order), put side by side on the groups' index: the same frame, the
same values (the same summation, pandas' compensated one), 2-3x faster.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pandas as pd

_REDUCTIONS = frozenset({"sum", "first", "last", "min", "max", "mean", "median", "nunique", "count", "size"})


def named_agg(df: pd.DataFrame, keys: Hashable | Sequence[Hashable], *, sort: bool = True,
              **spec: tuple[Hashable, str]) -> pd.DataFrame:
    """``df.groupby(keys, sort=sort).agg(**spec)`` for a spec of (column, reduction name) pairs, the reductions those
    of `_REDUCTIONS`. An empty table (whose dtypes pandas infers its own way) is aggregated by pandas itself."""
    if df.empty or any(fn not in _REDUCTIONS for _, fn in spec.values()):
        return df.groupby(keys, sort=sort).agg(**spec)
    gb = df.groupby(keys, sort=sort)
    return pd.DataFrame({name: gb.size() if fn == "size" else getattr(gb[col], fn)() for name, (col, fn) in spec.items()})


def named_agg_column(df: pd.DataFrame, keys: Hashable | Sequence[Hashable], column: Hashable, *, sort: bool = True,
                     **spec: str) -> pd.DataFrame:
    """``df.groupby(keys, sort=sort)[column].agg(**spec)``: named reductions of one column (output name -> reduction
    name), as `named_agg` does them."""
    if df.empty or any(fn not in _REDUCTIONS for fn in spec.values()):
        return df.groupby(keys, sort=sort)[column].agg(**spec)
    gb = df.groupby(keys, sort=sort)[column]
    return pd.DataFrame({name: getattr(gb, fn)() for name, fn in spec.items()})

"""A table's CSV text, byte for byte what ``df.to_csv(index=False).encode("utf-8")`` writes, faster.

Why: pandas writes a CSV a row at a time through the standard library's csv writer, formatting every value
again; for the step tables of a trace of many short steps that is most of the writing. On the 2 GB tile of
800,000 steps (a100_triton-2000MB) `step_timeline` (800k rows x 20 columns, 88 MB of CSV) and `steps` (35 MB)
took ~6.3 s of the 40 s `tracelens analyze`. Here each column's values become text once per DISTINCT value in
a chunk of rows (step tables repeat values: zeros, identical spans), the texts are taken by the codes, and the
rows are joined with ``",".join`` a chunk (CHUNK rows) at a time, so the memory stays bounded. All the CSVs
of that tile's analysis: 5.27 s with pandas -> 1.35 s (medians of 3, alternated, one process; the same bytes);
the 200 MB tile of the same kind (80k steps): 0.64 -> 0.14 s; the whole `tracelens analyze` of the 2 GB tile
~29 -> ~23 s of user CPU, peak RSS unchanged (3.6 GB). tests/reports/test_csv_text.py checks the bytes against
pandas.

What it takes (`fast_path`): a frame of at least one row and one column, columns a flat Index of `str` names
none of which needs quoting (no ``,``, ``"``, ``\\n``, ``\\r``; a lone column not named ""), every column of a
NumPy dtype: signed or unsigned ints of any width, float16/32/64, bool (duplicate names are fine). Anything
else -- strings (pandas' "str" dtype), object, categorical, nullable (Int64, boolean, Float64), datetimes,
complex, an empty frame, other column names -- is written by pandas itself (`csv_bytes` falls back for the
whole frame).

The rules it reproduces (pandas 3.1's `get_values_for_csv` with na_rep="", float_format=None, QUOTE_MINIMAL,
then `csv.writer`):
  - ints: `str(int)` (pandas hands the csv writer Python ints; NumPy's ``astype(str)`` writes the same digits);
  - floats: NumPy's ``astype(str)`` of the column's own dtype (shortest round-trip text: "0.1", "1e+16",
    "1e-07", "5e-324", "-0.0", "inf", "-inf"; a float32 0.1 is "0.1", not the float64 repr), NaN the empty
    field. -0.0 and 0.0 are distinct texts, so floats are grouped by their bits, not their values;
  - bool: "True" / "False";
  - fields separated by ","; each row, the header included, ends with os.linesep (pandas' default
    lineterminator); a row that is one empty field (one column, NaN) is written ``""`` as the csv module does.
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd

CHUNK = 65_536  # rows a chunk: the texts of one chunk's columns are held at once
_SAMPLE = 1024  # a chunk's first values: mostly distinct -> format them all, else once per distinct value
_NEEDS_QUOTES = (",", '"', "\n", "\r")
_BITS = {2: np.int16, 4: np.int32, 8: np.int64}  # a float's bits, to group values without merging -0.0 and 0.0


def fast_path(df: pd.DataFrame) -> bool:
    """Whether `csv_bytes` writes `df` itself (else pandas does): the frames the module docstring lists."""
    cols = df.columns
    if len(df) == 0 or len(cols) == 0 or isinstance(cols, pd.MultiIndex):
        return False
    if not all(type(c) is str and not any(q in c for q in _NEEDS_QUOTES) for c in cols):
        return False
    if len(cols) == 1 and cols[0] == "":
        return False  # (the header would be the one empty field: "")
    for t in df.dtypes:
        if not isinstance(t, np.dtype) or t.kind not in "iub" and not (t.kind == "f" and t.itemsize in _BITS):
            return False
    return True


def csv_bytes(df: pd.DataFrame, chunk: int = CHUNK) -> bytes:
    """``df.to_csv(index=False).encode("utf-8")``, written here where `fast_path` takes the frame, `chunk` rows at
    a time."""
    if not fast_path(df):
        return df.to_csv(index=False).encode("utf-8")
    eol = os.linesep
    arrays = [df.iloc[:, i].to_numpy() for i in range(df.shape[1])]
    lone = len(arrays) == 1
    parts = [(",".join(df.columns) + eol).encode("utf-8")]
    for start in range(0, len(df), chunk):
        cols = [_texts(a[start:start + chunk], lone) for a in arrays]
        rows = cols[0] if lone else map(",".join, zip(*cols))
        parts.append((eol.join(rows) + eol).encode("utf-8"))
    return b"".join(parts)


def _texts(a: np.ndarray, lone: bool) -> list[str]:
    """The CSV fields of one chunk of one column (see the module docstring's rules)."""
    kind = a.dtype.kind
    if kind == "b":
        return np.array(["False", "True"], dtype=object).take((a.view(np.uint8) != 0).view(np.uint8)).tolist()
    if kind in "iu":
        if _mostly_distinct(a):
            return list(map(str, a.tolist()))
        codes, uniques = pd.factorize(a)
        return np.asarray(uniques.astype(a.dtype).astype(str), dtype=object).take(codes).tolist()
    # floats
    na = '""' if lone else ""
    if _mostly_distinct(a):
        texts = a.astype(str).astype(object)
        texts[np.isnan(a)] = na
        return texts.tolist()
    bits = _BITS[a.dtype.itemsize]
    codes, uniques = pd.factorize(a.view(bits))
    values = uniques.astype(bits).view(a.dtype)
    texts = values.astype(str).astype(object)
    texts[np.isnan(values)] = na
    return texts.take(codes).tolist()


def _mostly_distinct(a: np.ndarray) -> bool:
    head = a[:_SAMPLE]
    return len(pd.unique(head)) > len(head) // 2

"""Lists of records held as columns: summary.json's per-step lists without a Python dict per step.

summary.json lists one record per profiler step and rank (`ranks[].steps`) and per step of the critical path
(`critical_path.steps`). A trace of very many short steps (a Triton benchmark loop: 800,000 steps in a 2 GB trace)
made those lists 1.6 million dicts of ~14 values: ~1.5 GB of Python objects and ~2.4 s to build, then ~6.8 s to
encode record by record. `Records` keeps the columns (numpy arrays, or a list for values such as the critical
path's rank lists) and gives out dicts only when asked (`to_list`, iteration); `json_lines` writes each record's
JSON text as ``json.JSONEncoder().encode(record)`` would, from the columns: the text of each distinct value once,
the columns of one value folded into the literal text between the others, a chunk of records at a time (bounded
memory). The 2 GB trace's two lists: ~0.9 s on the dev machine, no dict made.

The documented interface stays plain data: `Analysis.summary()` and the other summaries return lists of dicts
(`plain`); only the program's own writer (`reports.artifacts.write_all`) asks for the columnar form.

A column's kind follows its dtype:
- float: values as summary.json holds them (already rounded, `tracelens.numbers.round3_array`); NaN is null
  (None in a dict), as `round3` gives it; infinities as the json module writes them (Infinity, -Infinity);
- integer: Python ints; bool: true/false;
- a list (object values): each value as the json module encodes it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

CHUNK = 65536  # records per chunk of text (json_lines) or of dicts (iteration)

_ENCODER = json.JSONEncoder()  # the json module's defaults: what json.dumps writes for a record


class Records(Sequence):
    """A list of records with the same keys in the same order, held as columns (key -> numpy array or list, all
    of one length). Equal to a list of dicts with the same items (`to_list`)."""

    __slots__ = ("_n", "columns")

    def __init__(self, columns: dict[str, Any]):
        cols: dict[str, Any] = {}
        n = None
        for k, v in columns.items():
            if not isinstance(k, str):
                raise TypeError(f"Records: a key must be a string, not {type(k).__name__}")
            v = v if isinstance(v, list) else np.asarray(v)
            if isinstance(v, np.ndarray) and (v.ndim != 1 or v.dtype.kind not in "fiub"):
                v = v.tolist()  # anything else is given out as the Python values it holds
            if n is not None and len(v) != n:
                raise ValueError(f"Records: column {k!r} has {len(v)} values, the others {n}")
            n = len(v)
            cols[k] = v
        self.columns = cols
        self._n = n or 0

    def __len__(self) -> int:
        return self._n

    def _chunk(self, lo: int, hi: int) -> list[list[Any]]:
        """The columns' Python values of records lo..hi-1 (as a dict gives them)."""
        out = []
        for v in self.columns.values():
            if isinstance(v, list):  # (a list value given out as a copy: the records' dicts share nothing)
                out.append([x.copy() if type(x) is list else x for x in v[lo:hi]])
                continue
            part = v[lo:hi]
            vals = part.tolist()
            if part.dtype.kind == "f":
                for i in np.flatnonzero(np.isnan(part)).tolist():
                    vals[i] = None
            out.append(vals)
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        keys = tuple(self.columns)
        for lo in range(0, self._n, CHUNK):
            for row in zip(*self._chunk(lo, min(self._n, lo + CHUNK))):
                yield dict(zip(keys, row))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("Records index out of range")
        return dict(zip(self.columns, (c[0] for c in self._chunk(i, i + 1))))

    def to_list(self) -> list[dict[str, Any]]:
        return list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Records):
            other = other.to_list()
        if isinstance(other, (list, tuple)):
            return len(other) == self._n and self.to_list() == list(other)
        return NotImplemented

    __hash__ = None  # (a mutable container's, as list's)

    def __repr__(self) -> str:
        return f"Records({self._n} records: {', '.join(self.columns)})"

    def json_lines(self, indent: str = "") -> Iterator[str]:
        """The records' JSON text as a JSON array's items a line each: ``indent + json.JSONEncoder().encode(record)``
        per record, the lines joined by ",\\n", in chunks (join the chunks with ",\\n" too).

        Per chunk, each column's text is made once per distinct value (`_distinct_texts`). A column that holds one
        value in the chunk (most of a step table's: zeros, a constant span) is folded, key and value, into the
        literal text between the columns that vary; each varying column's distinct texts carry the literal before
        them (and the last one the closing brace), so a record is the "".join of its varying columns' texts: for
        800,000 steps with only the step number varying, one string per record and no join."""
        keys = [_ENCODER.encode(k) + ": " for k in self.columns]
        for lo in range(0, self._n, CHUNK):
            hi = min(self._n, lo + CHUNK)
            lit = indent + "{"
            varying: list[list] = []  # [the literal before, distinct texts, codes (None: a text per row), after]
            for c, (key, v) in enumerate(zip(keys, self.columns.values())):
                head = lit + (", " if c else "") + key
                texts, codes = _distinct_texts(v[lo:hi])
                if len(texts) == 1 and codes is not None:  # one value in this chunk: part of the literal
                    lit = head + texts[0]
                    continue
                varying.append([head, texts, codes, ""])
                lit = ""
            if not varying:
                yield ",\n".join([lit + "}"] * (hi - lo))
                continue
            varying[-1][3] = lit + "}"
            cols = []
            for head, texts, codes, tail in varying:
                texts = [f"{head}{t}{tail}" for t in texts]  # (each distinct text once; every row's where all differ)
                cols.append(np.asarray(texts, dtype=object)[codes].tolist() if codes is not None else texts)
            yield ",\n".join(cols[0] if len(cols) == 1 else map("".join, zip(*cols)))


def _distinct_texts(v: Any) -> tuple[list[str], np.ndarray | None]:
    """A column's (part's) values as the json module writes them: (the distinct values' texts, each row's index
    into them), or (every row's text, None) where (nearly) every value is distinct."""
    if isinstance(v, list):
        return _object_text(v)
    kind = v.dtype.kind
    if kind == "b":
        codes = v.astype(np.intp)
        return ["false", "true"], codes
    import pandas as pd  # (imported by every caller already: summary.json is written after the analysis)

    codes, uniques = pd.factorize(v, use_na_sentinel=False)
    if kind != "f":
        if len(uniques) == len(v):  # (every value distinct, e.g. the step numbers: no take)
            return list(map(int.__repr__, v.tolist())), None
        return [int.__repr__(x) for x in uniques.tolist()], codes
    texts = [_float_text(x) for x in uniques.tolist()]
    zero = v == 0
    if zero.any():  # the hash takes -0.0 and 0.0 for one value: zeros get codes of their own sign's text
        neg = np.signbit(v)
        texts += ["0.0", "-0.0"]
        codes = codes.copy()
        codes[zero & ~neg] = len(texts) - 2
        codes[zero & neg] = len(texts) - 1
        used = np.unique(codes)
        if len(used) < len(texts):  # (the hash's own zero entry, now unused: not counted as a distinct value)
            remap = np.full(len(texts), -1, dtype=np.intp)
            remap[used] = np.arange(len(used))
            texts = [texts[k] for k in used.tolist()]
            codes = remap[codes]
    return texts, codes


def _float_text(x: float) -> str:
    if math.isnan(x):
        return "null"  # NaN is a missing value (round3's None)
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return float.__repr__(x)


def _object_text(values: list) -> tuple[list[str], np.ndarray | None]:
    """Each value's JSON text, as (distinct texts, codes): values that are one object (the critical path's steps
    with the same ranks share one list) are encoded once. A list of ints is written by `repr`, which gives it
    exactly as the json module does ("[0, 1]"); anything else by the module."""
    import pandas as pd

    n = len(values)
    codes, _ = pd.factorize(np.fromiter(map(id, values), dtype=np.int64, count=n))  # (the objects are alive: ids
    first = np.empty(int(codes.max()) + 1 if n else 0, dtype=np.int64)            # name one object each)
    first[codes[::-1]] = np.arange(n - 1, -1, -1)  # each object's first row
    texts = [list.__repr__(x) if type(x) is list and all(type(e) is int for e in x) else _ENCODER.encode(x)
             for x in (values[k] for k in first.tolist())]
    return texts, codes


def plain(obj: Any) -> Any:
    """`obj` with every `Records` in it (in dicts and lists, at any depth) replaced by its list of dicts; a dict or
    list with none inside is `obj`'s own object, not a copy (a summary's entries stay the analysis' own values)."""
    if isinstance(obj, Records):
        return obj.to_list()
    if isinstance(obj, dict):
        out = {k: plain(v) for k, v in obj.items()}
        return obj if all(out[k] is v for k, v in obj.items()) else out
    if isinstance(obj, list):
        out_l = [plain(v) for v in obj]
        return obj if all(x is y for x, y in zip(out_l, obj)) else out_l
    return obj

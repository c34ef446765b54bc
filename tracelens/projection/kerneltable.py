"""Per-shape grouped-GEMM timings the what-if model uses for the ``grouped_gemm_backend`` knob.

Sources, best first:

1. rows written by ``tracelens kernels tune --json FILE`` (or ``benchmarks/bench_kernels.py``):
   ``{"op": "grouped_mm", "pass", "T", "K", "N", "E", "backend", "ms", "device"}``, a JSON list or an
   object with a ``grouped_mm`` / ``rows`` list;
2. the kernel tuner's cache (``$TRACELENS_CACHE_DIR/kernels/grouped_mm.json``, what
   ``grouped_gemm_backend=auto`` reads): every backend's time per (device, dtype, T bucket, K, N, E, pass);
3. none: the model falls back to merging the measured per-expert kernels (their work adds, one
   launch floor is paid) and says so.

A timing for a T that was not measured is interpolated linearly in T between the two nearest measured
T of the same (K, N, E, pass, backend) (extrapolated from the nearest two, never below the smallest
measured time's per-row cost floor).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np


class KernelTable:
    def __init__(self, rows: list[dict], source: str):
        self.source = source
        self.rows = rows
        self._pts: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
        for r in rows:
            try:
                if r.get("ms") is None:
                    continue
                key = (str(r["pass"]), int(r["K"]), int(r["N"]), int(r["E"]), str(r["backend"]))
                # T: tokens (the tuner's rows); benchmarks/bench_kernels.py writes them as "tokens"
                self._pts[key].append((int(r["T"] if "T" in r else r["tokens"]), float(r["ms"])))
            except (KeyError, TypeError, ValueError):
                continue
        for k in self._pts:
            self._pts[k] = sorted(set(self._pts[k]))

    def __len__(self) -> int:
        return sum(len(v) for v in self._pts.values())

    def for_device(self, device: str | None, dtype: str | None) -> tuple[KernelTable | None, int]:
        """The rows timed on ``device`` (a run's device name, e.g. ``NVIDIA H100 80GB HBM3``, or ``cpu``) in
        ``dtype`` (``bfloat16``; ``bf16``/``fp32`` accepted), and how many rows of other devices or dtypes were
        left out. A row that does not say its device or dtype is kept (a file the user named for this run). None
        when no row is left: another machine's timings never stand in for this run's kernels."""
        dt = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(str(dtype), dtype)
        keep = [r for r in self.rows
                if (device is None or r.get("device") in (None, device))
                and (dt is None or r.get("dtype") in (None, dt))]
        table = KernelTable(keep, self.source) if keep else None
        return (table if table is not None and len(table) else None), len(self.rows) - len(keep)

    def backends(self) -> set[str]:
        return {k[4] for k in self._pts}

    def ms(self, pass_: str, T: int, K: int, N: int, E: int, backend: str) -> float | None:
        pts = self._pts.get((pass_, K, N, E, backend))
        if not pts:
            return None
        ts = np.array([p[0] for p in pts], dtype=float)
        ms = np.array([p[1] for p in pts], dtype=float)
        if len(ts) == 1:
            return float(ms[0] * max(T / ts[0], 1.0)) if T > ts[0] else float(ms[0])
        if T <= ts[0]:
            # below the smallest measured size: the time does not fall under the per-row cost of the
            # two smallest points' line (a GEMM never gets cheaper than its fixed part)
            slope = (ms[1] - ms[0]) / (ts[1] - ts[0])
            return float(max(ms[0] - slope * (ts[0] - T), ms[0] * 0.5))
        if T >= ts[-1]:
            slope = (ms[-1] - ms[-2]) / (ts[-1] - ts[-2])
            return float(ms[-1] + max(slope, 0.0) * (T - ts[-1]))
        return float(np.interp(T, ts, ms))


def _rows_from_doc(doc) -> list[dict]:
    if isinstance(doc, list):
        return [r for r in doc if isinstance(r, dict)]
    if isinstance(doc, dict):
        for key in ("grouped_mm", "rows"):
            if isinstance(doc.get(key), list):
                return [r for r in doc[key] if isinstance(r, dict)]
        entries = doc.get("entries")
        if isinstance(entries, dict):  # the tuner's cache
            rows = []
            for key, e in entries.items():
                # "<device>|<dtype>|T<bucket>|K<k>|N<n>|E<e>|<pass>" (kernels/backends.py cache_key)
                parts = str(key).split("|")
                try:
                    T, K, N, E = (int(parts[i][1:]) for i in (2, 3, 4, 5))
                    pass_ = parts[6]
                except (IndexError, ValueError):
                    continue
                for b, ms in (e.get("times_ms") or {}).items():
                    rows.append({"pass": pass_, "T": T, "K": K, "N": N, "E": E, "backend": b, "ms": ms,
                                 "device": parts[0], "dtype": parts[1]})
            return rows
    return []


def load(path: str | os.PathLike | None = None) -> KernelTable | None:
    """The kernel table from ``path`` (tuner --json rows, bench_kernels JSON or a tuner cache), else the
    tuner's cache on this machine; None when there is none. Raises ValueError naming an unreadable file."""
    paths = []
    if path is not None:
        paths.append(Path(path))
    else:
        root = os.environ.get("TRACELENS_CACHE_DIR")
        base = Path(root) if root else Path.home() / ".cache" / "tracelens"
        paths.append(base / "kernels" / "grouped_mm.json")
    rows, used = [], []
    for p in paths:
        if not p.is_file():
            if path is not None:
                raise ValueError(f"{p}: kernel table not found")
            continue
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{p}: unreadable kernel table ({type(e).__name__})") from None
        got = _rows_from_doc(doc)
        if path is not None and not got:
            raise ValueError(f"{p}: no grouped_mm timings in it (expected `tracelens kernels tune --json` rows "
                             "or the tuner cache)")
        rows += got
        used.append(str(p))
    if not rows:
        return None
    return KernelTable(rows, ", ".join(used))


def load_many(paths: list[str | os.PathLike]) -> KernelTable | None:
    rows, used = [], []
    for p in paths:
        t = load(p)
        if t is not None:
            for (pass_, K, N, E, b), pts in t._pts.items():
                rows += [{"pass": pass_, "T": T, "K": K, "N": N, "E": E, "backend": b, "ms": ms} for T, ms in pts]
            used.append(t.source)
    return KernelTable(rows, ", ".join(used)) if rows else None


__all__ = ["KernelTable", "load", "load_many"]

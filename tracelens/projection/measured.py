"""The measured points the what-if and the scale-out projection are checked against: the ``measured.json`` format.

``measured.json`` (written with the recordings; paths relative to the file)::

    {"config": "gpu_proxy_train",                     # the trainer config every point and baseline extends
     "machine": "4 x H100 80GB HBM3",
     "baselines": [{"name": "dp4", "run": "dp4_base", "set": {"ep": 1}},
                   {"name": "ep4", "run": "ep4_base", "set": {"ep": 4, "ep_dispatch": "capacity"}}],
     "points": [{"name": "ep4_nccl", "set": {"ep": 4, "ep_dispatch": "nccl"},
                 "tokens_per_s_per_gpu": 80175.0, "peak_mem_gib": [60.8, 60.1, 60.5, 60.2], "status": "ok"},
                {"name": "ep4_mbs24", "set": {"ep": 4, "micro_batch_size": 24}, "status": "oom"}]}

(``baselines`` may also be a mapping name -> run dir or -> {"run", "set"}; a point's ``set`` may be called
``overrides``; ``peak_mem_gib`` is per rank or one number.) A point may name its GPU count, ``"gpus": 4`` (the
scale-out projection's validation, `tracelens scaleout --validate`; the top-level ``"gpus"`` is the default for every
point, and without either a point ran on its baseline's GPUs). A point's config is the base config with its ``set``;
from a baseline the what-if changes every key where the two differ (the baseline's own keys go back to the base
config's values unless the point sets them): :func:`changes_for`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


class MeasuredError(ValueError):
    """measured.json is not usable: one line naming the file and the problem."""


@dataclass
class Point:
    name: str
    sets: dict
    tps: float | None
    peak_gib: float | None
    status: str  # ok | oom
    gpus: int | None = None  # the GPU count it ran on (None: its baseline's)


@dataclass
class Baseline:
    name: str
    run: Path
    sets: dict


def _num(v, where: str, path: Path) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise MeasuredError(f"{path}: {where}: {str(v)[:40]!r} is not a number >= 0")
    return float(v)


def _gpus(v, where: str, path: Path) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise MeasuredError(f"{path}: {where}: {str(v)[:40]!r} is not a GPU count (a whole number >= 1)")
    return v


def load_measured(path: str | Path) -> tuple[str, str, list[Baseline], list[Point]]:
    """(base config, machine, baselines, points) of a measured.json; `MeasuredError` naming the first problem."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise MeasuredError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise MeasuredError(f"{path}: not a JSON document ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(doc, dict):
        raise MeasuredError(f"{path}: not a JSON object")
    config = doc.get("config", "gpu_proxy_train")
    if not isinstance(config, str):
        raise MeasuredError(f"{path}: config: expected a trainer config name")
    raw_b = doc.get("baselines")
    if isinstance(raw_b, dict):
        raw_b = [{"name": k, **(v if isinstance(v, dict) else {"run": v})} for k, v in raw_b.items()]
    if not isinstance(raw_b, list) or not raw_b:
        raise MeasuredError(f"{path}: baselines: expected a non-empty list or mapping of run dirs")
    bases = []
    for i, b in enumerate(raw_b):
        if not isinstance(b, dict) or not isinstance(b.get("run"), str):
            raise MeasuredError(f"{path}: baselines[{i}]: expected {{'name', 'run', 'set'}} with a run dir")
        sets = b.get("set", b.get("overrides", {}))
        if not isinstance(sets, dict):
            raise MeasuredError(f"{path}: baselines[{i}].set: expected a mapping of trainer keys")
        bases.append(Baseline(str(b.get("name", b["run"])), (path.parent / b["run"]).resolve(), sets))
    raw_p = doc.get("points")
    if not isinstance(raw_p, list):
        raise MeasuredError(f"{path}: points: expected a list")
    gpus_all = _gpus(doc.get("gpus"), "gpus", path)
    points = []
    for i, p in enumerate(raw_p):
        w = f"points[{i}]"
        if not isinstance(p, dict):
            raise MeasuredError(f"{path}: {w}: not an object")
        sets = p.get("set", p.get("overrides", {}))
        if not isinstance(sets, dict):
            raise MeasuredError(f"{path}: {w}.set: expected a mapping of trainer keys")
        status = str(p.get("status", "ok")).lower()
        if status not in ("ok", "oom"):
            raise MeasuredError(f"{path}: {w}.status: {status[:20]!r} is not ok or oom")
        peak = p.get("peak_mem_gib")
        if isinstance(peak, list):
            vals = [_num(x, f"{w}.peak_mem_gib", path) for x in peak]
            vals = [x for x in vals if x is not None]
            peak = max(vals) if vals else None
        else:
            peak = _num(peak, f"{w}.peak_mem_gib", path)
        tps = _num(p.get("tokens_per_s_per_gpu"), f"{w}.tokens_per_s_per_gpu", path)
        if status == "ok" and tps is None:
            raise MeasuredError(f"{path}: {w}: status ok without tokens_per_s_per_gpu")
        gpus = _gpus(p.get("gpus"), f"{w}.gpus", path) or gpus_all
        points.append(Point(str(p.get("name", f"point{i}")), sets, tps, peak, status, gpus))
    return config, str(doc.get("machine", "")), bases, points


def changes_for(base_cfg: dict, baseline: Baseline, point: Point) -> dict:
    """The what-if changes that take the baseline's config to the point's: the point's keys, and the baseline's
    own keys back at the base config's values where the point does not set them."""
    out = {k: base_cfg.get(k) for k in baseline.sets if k not in point.sets}
    out.update(point.sets)
    return {k: v for k, v in out.items() if baseline.sets.get(k, base_cfg.get(k)) != v}

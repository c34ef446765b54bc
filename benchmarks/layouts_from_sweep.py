"""A sweep's grid as the measured.json of benchmarks/bench_whatif_layouts.py (issue 35's cross-layout accuracy).

    python benchmarks/layouts_from_sweep.py RUNS/grid -o measured.json \\
        --baseline dp4=ep=1,micro_batch_size=16 --baseline ep4=ep=4,ep_dispatch=capacity,ep_overlap=false,micro_batch_size=16

Every finished trial of the sweep (``RUNS/grid/sweep.sqlite``, written by ``tracelens autotune`` or
benchmarks/bench_autotune.py) becomes a point: its knobs as the ``set``, its measured tokens/s/GPU and peak memory
per rank, ``ok``; a trial that failed out of memory becomes an ``oom`` point; other failures are left out and listed.
Each ``--baseline NAME=k=v,...`` names the trial whose knobs are exactly those (every knob of the space given) and
whose run dir the predictions start from; ``--copy-baselines DIR`` copies those run dirs (manifest, routing, traces)
next to measured.json, so that the file and its baselines can be committed together. Paths in measured.json are
relative to it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autotune.store import Store


class SweepError(ValueError):
    """The sweep cannot give a measured.json: one line naming the file and the problem."""


def _value(s: str):
    low = s.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(s)
        except ValueError:
            pass
    return s.strip()


def point_name(knobs: dict) -> str:
    """A short name of a point: ``ep4_capacity_eo_mbs16`` for {ep: 4, ep_dispatch: capacity, ep_overlap: true,
    micro_batch_size: 16} (numbers after the key's initials, words as they are, a true flag as its initials)."""
    parts = []
    for k, v in knobs.items():
        ini = k if len(k.split("_")) == 1 else "".join(w[0] for w in k.split("_") if w)
        if isinstance(v, bool):
            if v:
                parts.append(ini)
        elif isinstance(v, (int, float)):
            parts.append(f"{ini}{v:g}")
        else:
            parts.append(str(v))
    return "_".join(parts) or "defaults"


def parse_baseline(spec: str) -> tuple[str, dict]:
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise SweepError(f"--baseline {spec!r}: expected NAME=key=value,key=value")
    knobs = {}
    for part in rest.split(","):
        k, sep, v = part.partition("=")
        if not sep or not k.strip():
            raise SweepError(f"--baseline {spec!r}: {part!r} is not key=value")
        knobs[k.strip()] = _value(v)
    return name, knobs


def measured_from_sweep(grid: Path, out: Path, baselines: list[tuple[str, dict]], copy_to: Path | None = None,
                        machine: str = "") -> tuple[dict, list[str]]:
    db = grid / "sweep.sqlite"
    if not db.is_file():
        raise SweepError(f"{grid}: no sweep.sqlite (not a sweep directory)")
    store = Store(db, lock=False)  # read only: the writer's lock (and its pid file) stays the sweep's
    try:
        trials = [t for t in store.trials() if t["status"] in ("ok", "failed")]
        space = store.get_meta("space") or {}
    finally:
        store.close()
    config = space.get("config") if isinstance(space, dict) else None
    points, skipped = [], []
    for t in trials:
        name = point_name(t["knobs"])
        m = t["metrics"] or {}
        if t["status"] == "ok" and t["objective"]:
            peaks = [b / 2**30 for b in m.get("peak_memory_bytes") or []]
            points.append({"name": name, "set": t["knobs"], "tokens_per_s_per_gpu": m.get("tokens_per_s_per_gpu"),
                           "peak_mem_gib": [round(p, 3) for p in peaks] or None, "status": "ok", "trial": t["id"]})
        elif t["failure"] in ("oom", "memory"):
            points.append({"name": name, "set": t["knobs"], "status": "oom", "trial": t["id"]})
        else:
            skipped.append(f"trial {t['id']} {t['knobs']}: {t['status']} ({t['failure']})")
    out.parent.mkdir(parents=True, exist_ok=True)
    bases = []
    for name, knobs in baselines:
        match = [t for t in trials if t["status"] == "ok" and t["knobs"] == knobs]
        if not match:
            raise SweepError(f"{grid}: --baseline {name}: no finished trial has exactly the knobs {knobs}")
        src = Path(match[0]["run_dir"])
        if not (src / "manifest.json").is_file():
            raise SweepError(f"{src}: baseline {name}'s run dir has no manifest.json")
        run = src
        if copy_to is not None:
            run = copy_to / name
            if run.exists():
                shutil.rmtree(run)
            shutil.copytree(src, run, ignore=shutil.ignore_patterns("logs", "*.log"))
        bases.append({"name": name, "run": str(Path(_rel(run, out.parent))), "set": knobs})
    doc = {"config": config or "gpu_proxy_train", "machine": machine,
           "source": f"the grid of {space.get('name', grid.parent.name) if isinstance(space, dict) else grid}",
           "baselines": bases, "points": points}
    return doc, skipped


def _rel(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path.resolve(), start.resolve())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("grid", type=Path, help="the sweep's grid directory (holds sweep.sqlite)")
    p.add_argument("-o", "--out", type=Path, required=True)
    p.add_argument("--baseline", action="append", default=[], metavar="NAME=k=v,...")
    p.add_argument("--copy-baselines", type=Path, metavar="DIR")
    p.add_argument("--machine", default="")
    a = p.parse_args(argv)
    try:
        doc, skipped = measured_from_sweep(a.grid, a.out, [parse_baseline(s) for s in a.baseline], a.copy_baselines,
                                           a.machine)
    except SweepError as e:
        print(f"layouts_from_sweep: error: {e}", file=sys.stderr)
        return 2
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    for s in skipped:
        print(f"left out: {s}")
    print(f"wrote {a.out}: {len(doc['points'])} points, baselines {[b['name'] for b in doc['baselines']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

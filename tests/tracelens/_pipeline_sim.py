"""Synthetic pipeline schedules for the ppvis tests, simulated from their definitions.

Each rank runs its schedule's action order; an action starts when the rank is free and its data
dependency has finished (F(s, mb) after F(s-1, mb); B(s, mb) after B(s+1, mb), or after the last
stage's own F(mb)). No communication time. The tests compare the analyzer's numbers with values worked
out by hand for these schedules, not with this simulator's output.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..conftest import write_json_gz


def one_f_one_b_order(p: int, m: int, r: int) -> list[tuple[str, int]]:
    """1F1B on pp rank r: p - r - 1 warm-up forwards, then F/B pairs, then the remaining backwards."""
    w = min(p - r - 1, m)
    order = [("F", i) for i in range(w)]
    for i in range(m - w):
        order += [("F", w + i), ("B", i)]
    return order + [("B", i) for i in range(m - w, m)]


def gpipe_order(p: int, m: int, r: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def simulate(p: int, m: int, f_cost, b_cost, order=one_f_one_b_order, step: int = 0, t0: int = 0,
             rank_offset: int = 0) -> list[dict]:
    """Records in the contract's jsonl format for one step; f_cost/b_cost: ns per stage."""
    orders = [order(p, m, r) for r in range(p)]
    done: dict[tuple, int] = {}
    free = [t0] * p
    pos = [0] * p
    recs = []
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] >= len(orders[r]):
                continue
            kind, mb = orders[r][pos[r]]
            if kind == "F":
                dep = ("F", r - 1, mb) if r > 0 else None
            else:
                dep = ("B", r + 1, mb) if r < p - 1 else ("F", r, mb)
            if dep is not None and dep not in done:
                continue
            start = max(free[r], done[dep] if dep else t0)
            end = start + (f_cost[r] if kind == "F" else b_cost[r])
            done[(kind, r, mb)] = free[r] = end
            pos[r] += 1
            progressed = True
            recs.append({"step": step, "rank": r + rank_offset, "pp_rank": r, "stage": r, "microbatch": mb,
                         "kind": kind, "start_ns": start, "end_ns": end})
        assert progressed, "schedule deadlocked"
    return recs


def write_jsonl(run: Path, recs: list[dict]) -> None:
    d = run / "pipeline"
    d.mkdir(parents=True, exist_ok=True)
    for r in sorted({x["rank"] for x in recs}):
        with open(d / f"rank{r}.jsonl", "w") as f:
            for x in recs:
                if x["rank"] == r:
                    f.write(json.dumps(x) + "\n")


def write_manifest(run: Path, **pipeline) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "manifest.json").write_text(json.dumps({"schema_version": 1, "pipeline": pipeline}))


def write_kineto(path: Path, rank: int, world: int, recs: list[dict], step_markers: list[tuple[int, int, int]] = (),
                 gpu_copies: list[tuple[int, int, int]] | None = None) -> None:
    """A small Kineto trace: the actions as user_annotation ranges (ts/dur in µs), optional
    ProfilerStep#N markers (step, start_ns, end_ns) and gpu_user_annotation copies (stream, shift_ns, extra_ns)."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1,
           "ts": a / 1000, "dur": (b - a) / 1000} for s, a, b in step_markers]
    for x in recs:
        name = f"pipeline/{x['kind']}/s{x['stage']}/mb{x['microbatch']}"
        ev.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1,
                   "ts": x["start_ns"] / 1000, "dur": (x["end_ns"] - x["start_ns"]) / 1000})
        for stream, shift, extra in gpu_copies or []:
            ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": name, "pid": 0, "tid": stream,
                       "ts": (x["start_ns"] + shift) / 1000, "dur": (x["end_ns"] - x["start_ns"] + extra) / 1000})
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0.5, "dur": 0.1})
    doc = {"traceEvents": ev, "distributedInfo": {"rank": rank, "world_size": world}}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_gz(doc, path)

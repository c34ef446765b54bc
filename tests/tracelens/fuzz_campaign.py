"""The long every-verb fuzz run (`test_fuzz_verbs.py`, issue 31), split over worker processes.

    .venv/bin/python -m tests.tracelens.fuzz_campaign --workers 16 --examples 2000 --out fuzz-campaign

`--examples` is per property, as TRACELENS_FUZZ_EXAMPLES is (2000 -> 10,000 cases over the five
properties: manifests, pipeline files, traces, trainer configs, spaces and stores). Each worker is one
pytest process running every property with its share of the examples (examples / workers, the rest to
the first workers), its own Hypothesis seed (`--seed` + worker index, so a campaign is reproducible and
no two workers draw the same stream) and its own log (`TRACELENS_FUZZ_LOG`: one JSON line per case).
Hypothesis splits no property across processes itself, and pytest-xdist distributes tests, not
examples: hence one process per share.

When all workers are done (progress every 30 s), the logs are counted into OUT/summary.json and
OUT/summary.txt: per property and verb the cases and their outcomes (ok, error = a one-line error,
and the failures: internal, invariant, hang, memory; skipped past TRACELENS_FUZZ_BUDGET_S), the wall
time, and each failure with its worker, seed, invocation, message and drawn inputs. Exit status 0 when
every case ended ok or in a one-line error and every worker exited cleanly, else 1. (Hypothesis may
draw a few cases fewer than asked where a property's inputs run out; the summary says how many ran.)

Each worker holds up to TRACELENS_FUZZ_MAX_RSS_GIB (default 6) of memory and one CPU; give it a core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUITE = "tests/tracelens/test_fuzz_verbs.py"
# property (the `prop` of each log record) -> the test that runs it
PROPERTIES = {
    "manifest": "test_mutated_manifests_error_in_one_line_or_satisfy_the_invariants",
    "pipeline": "test_mutated_pipeline_files_error_in_one_line_or_satisfy_the_invariants",
    "traces": "test_mutated_traces_through_every_trace_verb",
    "config": "test_mutated_trainer_configs_and_set_values_error_in_one_line_or_satisfy_the_invariants",
    "autotune": "test_mutated_spaces_and_stores_error_in_one_line_or_resume",
}
PASSED = ("ok", "error")  # a verb's answer, or a one-line error naming the file: what the suite requires
FAILED = ("internal", "invariant", "hang", "memory")


def shares(examples: int, workers: int) -> list[int]:
    """Examples per worker: `examples` split as evenly as whole numbers allow (none empty)."""
    workers = max(1, min(workers, examples))
    return [examples // workers + (k < examples % workers) for k in range(workers)]


def _worker_cmd(props: list[str], seed: int) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--hypothesis-seed={seed}",
            *(f"{SUITE}::{PROPERTIES[p]}" for p in props)]


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def run(workers: int, examples: int, props: list[str], seed: int, out: Path, progress_s: float = 30.0) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("worker*.jsonl"), *out.glob("worker*.log")]:
        old.unlink()  # a log is appended to: start each campaign from empty ones
    per = shares(examples, workers)
    total = examples * len(props)
    procs = []
    t0 = time.monotonic()
    for k, n in enumerate(per):
        env = {**os.environ, "TRACELENS_FUZZ_EXAMPLES": str(n), "TRACELENS_FUZZ_LOG": str(out / f"worker{k}.jsonl")}
        log = open(out / f"worker{k}.log", "w")  # noqa: SIM115 - closed when the worker ends
        procs.append((k, seed + k, n, subprocess.Popen(_worker_cmd(props, seed + k), cwd=REPO, env=env,
                                                       stdout=log, stderr=subprocess.STDOUT), log))
    print(f"fuzz campaign: {len(per)} workers x {len(props)} properties, {total} cases "
          f"({examples} per property; seeds {seed}..{seed + len(per) - 1}); logs in {out}", flush=True)
    try:
        report = t0 + progress_s
        while any(p.poll() is None for *_, p, _ in procs):
            time.sleep(0.5)
            if time.monotonic() >= report:
                report += progress_s
                done = sum(_count_lines(out / f"worker{k}.jsonl") for k, *_ in procs)
                running = sum(p.poll() is None for *_, p, _ in procs)
                print(f"  {time.monotonic() - t0:7.0f} s: {done}/{total} cases, {running} workers running", flush=True)
    except KeyboardInterrupt:
        for *_, p, _ in procs:
            p.terminate()
        raise
    finally:
        for *_, log in procs:
            log.close()
    wall = time.monotonic() - t0
    exits = {k: p.returncode for k, _, _, p, _ in procs}
    summary = summarize(out, {k: s for k, s, *_ in procs}, wall, total, exits)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = summary_text(summary)
    (out / "summary.txt").write_text(text)
    print(text, end="")
    return summary


def summarize(out: Path, seeds: dict[int, int], wall_s: float, planned: int, exits: dict[int, int]) -> dict:
    """Counts per property and verb from the workers' logs, and every failure with what reproduces it."""
    rows: dict[tuple[str, str], Counter] = defaultdict(Counter)
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    failures = []
    for k, seed in sorted(seeds.items()):
        path = out / f"worker{k}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            calls = rec.get("calls") or []
            verb = calls[0][0] if calls and calls[0] else "-"
            key = (rec["prop"], verb)
            rows[key][rec["outcome"]] += 1
            seconds[key] += rec.get("s", 0.0)
            if rec["outcome"] not in PASSED and rec["outcome"] != "skipped":
                failures.append({"worker": k, "seed": seed, "prop": rec["prop"], "verb": verb, "outcome": rec["outcome"],
                                 "calls": calls, "message": rec.get("message", ""), "inputs": rec.get("inputs")})
    table = [{"prop": p, "verb": v, "cases": sum(c.values()), **{o: c.get(o, 0) for o in (*PASSED, *FAILED, "skipped")},
              "case_s": round(seconds[(p, v)], 1)} for (p, v), c in sorted(rows.items())]
    cases = sum(r["cases"] for r in table)
    bad_exits = {k: c for k, c in exits.items() if c != 0}
    return {"wall_s": round(wall_s, 1), "planned_cases": planned, "cases": cases,
            "skipped": sum(r["skipped"] for r in table), "failures": len(failures),
            "passed": not failures and not bad_exits,
            "worker_exits": exits, "seeds": seeds, "table": table, "failure_cases": failures}


def summary_text(s: dict) -> str:
    cols = ("cases", *PASSED, *FAILED, "skipped")
    lines = [f"{'property':<10} {'verb':<9} " + " ".join(f"{c:>9}" for c in cols) + f" {'case s':>9}"]
    for r in s["table"]:
        lines.append(f"{r['prop']:<10} {r['verb']:<9} " + " ".join(f"{r[c]:>9}" for c in cols) + f" {r['case_s']:>9.1f}")
    tot = {c: sum(r[c] for r in s["table"]) for c in cols}
    lines.append(f"{'all':<20} " + " ".join(f"{tot[c]:>9}" for c in cols)
                 + f" {sum(r['case_s'] for r in s['table']):>9.1f}")
    lines.append(f"wall {s['wall_s']:.0f} s; {s['cases']} of {s['planned_cases']} planned cases logged; "
                 f"{s['failures']} failing; worker exits {s['worker_exits']}")
    for f in s["failure_cases"][:20]:
        lines.append(f"FAIL [{f['outcome']}] {f['prop']}/{f['verb']} (worker {f['worker']}, --hypothesis-seed={f['seed']}): "
                     f"{f['message'][:300]}")
    bad = {k: c for k, c in s["worker_exits"].items() if c != 0}
    if bad and not s["failure_cases"]:
        lines.append(f"workers exited {bad} with no failing case logged: see worker<k>.log")
    lines.append("PASSED" if s["passed"] else "FAILED")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.tracelens.fuzz_campaign", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: the CPUs)")
    ap.add_argument("--examples", type=int, default=2000, help="cases per property, over all workers (default 2000)")
    ap.add_argument("--props", default=",".join(PROPERTIES), help=f"properties to run (default all: {','.join(PROPERTIES)})")
    ap.add_argument("--seed", type=int, default=0, help="Hypothesis seed of worker 0 (worker k: seed + k)")
    ap.add_argument("--out", type=Path, default=Path("fuzz-campaign"), help="directory for the logs and the summary")
    args = ap.parse_args(argv)
    props = [p.strip() for p in args.props.split(",") if p.strip()]
    unknown = [p for p in props if p not in PROPERTIES]
    if unknown or not props or args.workers < 1 or args.examples < 1:
        ap.error(f"unknown properties {unknown}" if unknown else "need a property, a worker and an example at least")
    suite = (REPO / SUITE).read_text()
    missing = [t for t in PROPERTIES.values() if f"def {t}(" not in suite]
    if missing:
        ap.error(f"{SUITE} has no {missing}: update PROPERTIES here")
    summary = run(args.workers, args.examples, props, args.seed, args.out.resolve())
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

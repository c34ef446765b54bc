"""Record the CPU what-if accuracy grid: one profiled baseline run of the tiny config and five runs with other
knobs, each measured (tests/fixtures/cpu_whatif_grid/, read by tests/tracelens/test_whatif.py).

The what-if model's accuracy is tested on these recorded runs, never by timing runs inside the test suite (a
busy CI machine would make the test measure the machine). Record on quiet cores, e.g. on the device machine's
CPU:

    taskset -c 2,3 python benchmarks/record_cpu_whatif_grid.py -o tests/fixtures/cpu_whatif_grid

Writes OUT/base/ (a complete run dir: manifest and traces, what the model is built from), OUT/p<i>/manifest.json
for each grid point (the measured metrics the predictions are checked against; their traces are not kept) and
OUT/grid.yaml (JSON, which is YAML too; the corpus-wide trace tests take every *.json: the changes of each point, the fixed keys and the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRID = [
    {"micro_batch_size": 2},
    {"micro_batch_size": 8},
    {"grouped_gemm_backend": "torch"},
    {"grouped_gemm_backend": "torch", "micro_batch_size": 8, "sync_free_level": 3},
    {"recompute_layer_ids": [1, 2]},
]
FIXED = {"steps": 10, "profile_step_start": 5, "profile_step_end": 6, "timing_warmup_steps": 2, "log_every": 100}


def train(out: Path, changes: dict) -> dict:
    cmd = [sys.executable, "-m", "trainer.launch", "--config", "tiny", "--nproc", "1", "-o", str(out)]
    for k, v in {**FIXED, **changes}.items():
        cmd += ["--set", f"{k}={json.dumps(v)}"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        raise SystemExit(f"{out}: trainer failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return json.loads((out / "manifest.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True)
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    base = train(out / "base", {})
    shutil.rmtree(out / "base" / "logs", ignore_errors=True)
    print(f"base: {base['metrics']['tokens_per_s_per_gpu']:.0f} tokens/s/GPU", flush=True)
    for i, ch in enumerate(GRID):
        d = out / f"p{i}"
        man = train(d, ch)
        for sub in ("traces", "logs", "pipeline"):
            shutil.rmtree(d / sub, ignore_errors=True)
        print(f"p{i} {ch}: {man['metrics']['tokens_per_s_per_gpu']:.0f} tokens/s/GPU", flush=True)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    (out / "grid.yaml").write_text(json.dumps({"grid": GRID, "fixed": FIXED, "machine": platform.processor()
                                               or platform.machine(), "cpus": cpus}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Test stand-in for the trainer launcher: writes a run dir from recorded H200 traces (no torch, no GPU).

Used as a space's ``command`` by the sweep-report browser test: the trial's ``--set`` knobs pick the
trace (grouped_gemm_backend=loop -> the per-expert-loop MoE trace, otherwise the grouped-GEMM one),
the objective comes from the OBJECTIVE table below, and manifest.json holds the config and metrics
the way the trainer writes them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "h200_moe_1gpu"
OBJECTIVE = {(0, "loop"): 1000.0, (1, "loop"): 1010.0, (0, "torch"): 1500.0, (1, "torch"): 1650.0}


def main(argv: list[str]) -> int:
    out = Path(argv[argv.index("-o") + 1])
    sets = dict(a.split("=", 1) for a in (argv[i + 1] for i, x in enumerate(argv) if x == "--set"))
    knobs = {k: json.loads(v) for k, v in sets.items()}
    level, backend = knobs["sync_free_level"], knobs["grouped_gemm_backend"]
    (out / "traces").mkdir(parents=True, exist_ok=True)
    src = FIXTURES / ("moe1gpu_loop.json.gz" if backend == "loop" else "moe1gpu_grouped.json.gz")
    shutil.copy(src, out / "traces" / "rank0.json.gz")
    tps = OBJECTIVE[(level, backend)]
    print(f"[replay] {src.name}: tokens/s/GPU {tps}", flush=True)
    manifest = {"schema_version": 1, "name": out.name, "config": {"base": "replay", **knobs},
                "metrics": {"tokens_per_s_per_gpu": tps, "tokens_per_step_per_gpu": 4096,
                            "mean_step_time_s": 4096 / tps, "step_times_s": [4096 / tps] * 3, "timed_steps": [0, 1, 2],
                            "peak_memory_bytes": [20 * 2**30]}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

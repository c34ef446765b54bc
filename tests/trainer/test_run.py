"""A one-process run (no torchrun) through the launcher writes a valid run directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.trainer._rundir import check_run_dir

REPO = Path(__file__).resolve().parents[2]


def test_single_process_run_writes_run_dir(tmp_path):
    run = tmp_path / "single"
    r = subprocess.run(
        [sys.executable, "-m", "trainer.launch", "--config", "tiny", "--nproc", "1", "-o", str(run),
         "--set", "steps=6", "--set", "profile_step_start=2", "--set", "profile_step_end=4",
         "--loss-fusion", "true", "--set", "loss_chunk_size=100", "--recompute-layer-ids", "[1]",
         "--manual-gc", "2", "--numa-bind", "true", "--set", "env={TRACELENS_TEST_KNOB: 7}",
         "--sync-free-level", "2", "--grouped-gemm-backend", "torch", "--dp-mode", "ddp"],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "numa_bind: no-op" in r.stdout  # CPU: clear no-op message
    m = check_run_dir(run, world=1, steps=6, profiled=range(2, 4))
    assert m["toggles"] == {"sync_free_level": 2, "grouped_gemm_backend": "torch", "recompute_layer_ids": [1],
                            "optimizer": "adamw", "loss_fusion": True, "manual_gc": 2, "numa_bind": True,
                            "dtype": "fp32", "step_timing": "sync", "compile": "none", "cuda_graphs": "off",
                            "ep_dispatch": "nccl", "ep_capacity_factor": 1.25, "ep_overlap": False,
                            "ep_overlap_chunks": 2, "ep_overlap_schedule": "chunked", "ep_placement": "contiguous",
                            "router_bias_update_rate": 0.0}
    assert m["ep_placement"] is None  # ep=1: no placement to record
    assert m["env"]["knobs"] == {"TRACELENS_TEST_KNOB": "7"}
    assert m["env"]["recorded"] is not None
    assert m["numa"]["bound"] is False and "no-op" in m["numa"]["reason"]
    assert m["parallel"] == {"dp": 1, "ep": 1, "dp_mode": "ddp", "launched_by_torchrun": False}
    # warm-up step 0, profiled steps 2-3 and step 4 (the profiler stops and exports there) excluded
    assert m["metrics"]["timed_steps"] == [1, 5]
    assert m["metrics"]["peak_memory_kind"] == "process_max_rss"
    # the manifest's resolved config round-trips through the strict loader
    from moespec.config import load_config

    assert load_config(None, m["config"]) == m["config"]
    json.dumps(m)

"""Checks shared by the run-directory tests: the DESIGN.md contract, read with the standard library."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

MOE_RANGES = {"moe/router", "moe/permute", "moe/dispatch", "moe/experts", "moe/combine", "moe/unpermute"}


def check_run_dir(run: Path, world: int, steps: int, profiled: range) -> dict:
    m = json.loads((run / "manifest.json").read_text())
    assert m["schema_version"] == 1
    assert m["world_size"] == world
    assert m["mesh"]["dims"] == ["dp", "ep"] and m["mesh"]["shape"][0] * m["mesh"]["shape"][1] == world
    assert m["versions"]["torch"] and m["versions"]["python"]
    assert m["device"]["name"]
    cfg = m["config"]
    for key in ("sync_free_level", "grouped_gemm_backend", "recompute_layer_ids", "loss_fusion", "manual_gc",
                "numa_bind", "env"):
        assert key in cfg
    mt = m["metrics"]
    assert mt["steps"] == steps
    assert len(mt["loss"]) == len(mt["step_times_s"]) == len(mt["aux_loss"]) == len(mt["grad_norm"]) == steps
    assert all(g > 0 for g in mt["grad_norm"])
    assert all(t > 0 for t in mt["step_times_s"])
    # step times (what tracelens and autotune read): the mean over the timed steps; disjoint intervals within the
    # wall time of the step loop. Over ranks both are maxima (per step, and of the walls): a little slack there
    timed = mt["timed_steps"]
    assert abs(mt["mean_step_time_s"] - sum(mt["step_times_s"][i] for i in timed) / len(timed)) <= 1e-12 * mt["mean_step_time_s"]
    assert mt["step_timing"] in ("host_sync", "cuda_events", "wall_clock")
    assert sum(mt["step_times_s"]) <= mt["steps_wall_s"] * (1 if world == 1 else 1.1)
    assert mt["tokens_per_step"] == world * cfg["micro_batch_size"] * cfg["seq_len"]
    assert abs(mt["tokens_per_s"] - mt["tokens_per_s_per_gpu"] * world) < 1e-6 * mt["tokens_per_s"]
    assert abs(mt["tokens_per_s_per_gpu"] * mt["mean_step_time_s"] - cfg["micro_batch_size"] * cfg["seq_len"]) < 1e-6
    assert mt["model_flops_per_token"] > 0
    assert mt["mfu"] is None  # CPU: no bf16 peak
    assert len(mt["peak_memory_bytes"]) == world and all(b > 10 * 2**20 for b in mt["peak_memory_bytes"])
    assert m["profile"]["traces"] == [f"traces/rank{r}.json.gz" for r in range(world)]
    for r in range(world):
        with gzip.open(run / "traces" / f"rank{r}.json.gz", "rt") as f:
            doc = json.load(f)
        names = Counter(e.get("name") for e in doc["traceEvents"])
        steps_seen = sorted(int(n.split("#")[1]) for n in names if n and n.startswith("ProfilerStep#"))
        assert steps_seen == list(profiled), steps_seen
        n_moe = cfg["n_layers"] - cfg["first_k_dense"]
        for rng in ("moe/router", "moe/permute", "moe/experts", "moe/unpermute"):
            assert names[rng] >= n_moe * len(profiled), (rng, names[rng])
        if cfg["ep"] > 1:
            assert names["moe/dispatch"] >= n_moe * len(profiled) and names["moe/combine"] >= n_moe * len(profiled)
            # per MoE layer and step: counts exchange + dispatch + combine forward, dispatch + combine backward
            assert names["c10d::alltoall_base_"] == 5 * n_moe * len(profiled), names["c10d::alltoall_base_"]
        assert names["aten::mm"] > 0
        if world > 1:
            assert doc["distributedInfo"]["world_size"] == world and doc["distributedInfo"]["rank"] == r
    return m

"""Run under torchrun (4 gloo ranks) by test_pipeline.py: pipelined and reference runs, one world.

``python -m torch.distributed.run --nproc-per-node 4 _pp_worker.py OUT numerics|timing``

* ``numerics``: a small MoE config trained 3 steps by non-pipelined references (pp=1, dp=4 with 2 or 4
  micro-batches) and by pipelined runs over the same global batches (1F1B PP=4 x 8 micro-batches,
  interleaved PP=2 x VPP=2 x DP=2 x 8, and more schedules / DP / EP combinations); writes
  ``OUT/numerics.json`` ({run: manifest metrics + pipeline object}).
* ``timing``: a config sized so compute dominates gloo's point-to-point latency, 4 steps each of
  1F1B PP=4, interleaved PP=2 x VPP=2 (balanced automatic layouts) and 1F1B PP=4 with a deliberately
  unbalanced layout; the test reads the run dirs' ``pipeline/rank<N>.jsonl``. With at least one CPU
  per rank each rank is pinned to its own CPU (dedicated "devices"); otherwise the OS shares the CPUs.

ZBV on torch < 2.13 with gloo is left out (recorded in ``skipped``): torch 2.11's own point-to-point
warm-up sends a stage's message to its own rank at the V's turn, which gloo rejects.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import load_config
from trainer.train import train

SMALL = {"n_layers": 4, "first_k_dense": 1, "steps": 3, "log_every": 0, "profile_step_end": 0,
         "micro_batch_size": 2, "seq_len": 32, "grad_clip": 0.05}  # clipping active: global norm must be exact

# name -> overrides on top of SMALL; "ref_*" are the non-pipelined references
NUMERICS = {
    "ref_8": {"microbatches": 2},                      # 4 replicas x 2 = the global batch of 8 micro-batches
    "pp4_1f1b": {"pp": 4, "microbatches": 8, "pipeline_schedule": "1f1b",
                 "profile_step_start": 1, "profile_step_end": 2},
    "pp4_gpipe": {"pp": 4, "microbatches": 8, "pipeline_schedule": "gpipe", "dp_mode": "ddp"},
    "pp2_ep2_1f1b_ddp": {"pp": 2, "ep": 2, "microbatches": 4, "pipeline_schedule": "1f1b", "dp_mode": "ddp"},
    "ref_16": {"microbatches": 4},                     # 4 replicas x 4 = 16 micro-batches
    "pp2_vpp2_dp2": {"pp": 2, "vpp": 2, "microbatches": 8, "pipeline_schedule": "vpp"},
    "pp2_vpp2_dp2_zb1p": {"pp": 2, "vpp": 2, "microbatches": 8, "pipeline_schedule": "zb1p",
                          "dp_mode": "ddp"},
    "pp2_vpp2_dp2_zbv": {"pp": 2, "vpp": 2, "microbatches": 8, "pipeline_schedule": "zbv",
                         "dp_mode": "ddp"},
}

# all-MoE layers of equal cost; ~40 ms forward per stage per micro-batch on one CPU core
TIMING = {"n_layers": 8, "first_k_dense": 0, "d_model": 256, "n_heads": 4, "n_kv_heads": 4, "moe_d_ff": 256,
          "n_routed_experts": 8, "n_group": 1, "topk_group": 1, "seq_len": 128, "micro_batch_size": 2,
          "steps": 4, "log_every": 0, "profile_step_end": 0, "microbatches": 8}
TIMED_RUNS = {
    "bubble_1f1b": {"pp": 4, "pipeline_schedule": "1f1b"},
    "bubble_vpp": {"pp": 2, "vpp": 2, "pipeline_schedule": "vpp"},
    "unbalanced": {"pp": 4, "pipeline_schedule": "1f1b", "pipeline_layout": "Et|t|ttttt|tL", "steps": 3},
}


def main(out_dir: str, mode: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    results, skipped = {}, {}
    runs = NUMERICS if mode == "numerics" else TIMED_RUNS
    base = SMALL if mode == "numerics" else TIMING
    cpus = sorted(os.sched_getaffinity(0))
    world = int(os.environ["WORLD_SIZE"])
    if mode == "timing" and len(cpus) >= world:
        os.sched_setaffinity(0, {cpus[int(os.environ["RANK"])]})
    old_torch = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
    for name, overrides in runs.items():
        if overrides.get("pipeline_schedule") == "zbv" and old_torch:
            skipped[name] = f"torch {torch.__version__} with gloo: self-send in torch's p2p warm-up"
            continue
        cfg = load_config("tiny", {**base, **overrides})
        m = train(cfg, out / name)
        if m is not None:
            results[name] = {"metrics": m["metrics"], "pipeline": m["pipeline"], "mesh": m["mesh"],
                             "profile": m["profile"]}
    if dist.get_rank() == 0:
        (out / f"{mode}.json").write_text(json.dumps({"runs": results, "skipped": skipped, "cpus": len(cpus)},
                                                     indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

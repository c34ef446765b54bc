"""Pipelined and reference runs, one world per launch: ``numerics`` by test_pipeline.py (4 ranks forked by
tests/trainer/_workers.py, with the environment torchrun gives its ranks), or by hand under torchrun:

``python -m torch.distributed.run --nproc-per-node 4 _pp_worker.py OUT numerics``
``python -m torch.distributed.run --nproc-per-node 2 _pp_worker.py OUT bubble`` (records tests/fixtures/cpu_pp2_bubble)

* ``numerics`` (4 gloo ranks): a small MoE config trained 3 steps by non-pipelined references (pp=1,
  dp=4 with 2 or 4 micro-batches) and by pipelined runs over the same global batches (1F1B PP=4 x 8
  micro-batches, interleaved PP=2 x VPP=2 x DP=2 x 8, and more schedules / DP / EP combinations);
  writes ``OUT/numerics.json`` ({run: manifest metrics + pipeline object}).
* ``bubble`` (2 gloo ranks, one CPU core and one thread each, like a device per rank): 1F1B PP=2 and
  interleaved PP=2 x VPP=2 on the automatic (balanced) layout, 8 micro-batches, and an interleaved run
  with a deliberately unbalanced layout (smaller layers: only its stages' time ratios are checked); the
  run dirs' ``manifest.json`` and ``pipeline/rank<N>.jsonl`` (gzipped) are tests/fixtures/cpu_pp2_bubble, which
  test_pipeline.py reads: the suite does not run this mode (its figures are wall-clock times).
  The model (:data:`BUBBLE`) is sized so that an action's compute dwarfs the schedule's fixed host
  cost per action (gloo send/recv and torch's runtime, ~0.5-0.8 ms per hand-off on CPU), and its layers
  are dense, so every micro-batch costs the same on every stage (MoE routing would make a stage's cost
  depend on the tokens it gets): the conditions the theoretical bubble assumes.

ZBV on torch < 2.13 with gloo is left out (recorded in ``skipped``): torch 2.11's own point-to-point
warm-up sends a stage's message to its own rank at the V's turn, which gloo rejects.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moespec.config import load_config
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

# 16 equal dense layers (4 per stage with pp x vpp = 2 x 2): ~75 ms forward and ~135 ms backward per
# stage and micro-batch on one CPU core; the embedding and the loss head (vocab 128) add < 1 % to their
# stages. Activations per hand-off: 2 x 128 x 256 fp32 = 256 KiB.
BUBBLE = {"n_layers": 16, "first_k_dense": 16, "d_model": 256, "n_heads": 4, "n_kv_heads": 4, "d_ff": 2048,
          "seq_len": 128, "micro_batch_size": 2, "steps": 5, "log_every": 0, "profile_step_end": 0,
          "microbatches": 8}
BUBBLE_RUNS = {
    "bubble_1f1b": {"pp": 2, "pipeline_schedule": "1f1b"},
    "bubble_vpp": {"pp": 2, "vpp": 2, "pipeline_schedule": "vpp"},
    # stage 2 holds 10 of the 16 layers, the others 2 each (rank 0: 12 layers, rank 1: 4). The test reads
    # ratios of stage times (~5x), not a bubble against theory: layers ~1/5 the compute (d_ff 512, seq 64),
    # still ~10 ms per layer and micro-batch against < 1 ms of host cost per hand-off
    "unbalanced": {"pp": 2, "vpp": 2, "pipeline_schedule": "vpp", "pipeline_layout": "Ett|tt|t*10|ttL",
                   "steps": 3, "d_ff": 512, "seq_len": 64},
}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(out_dir: str, mode: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    results, skipped = {}, {}
    runs = NUMERICS if mode == "numerics" else BUBBLE_RUNS
    base = SMALL if mode == "numerics" else BUBBLE
    cpus = sorted(os.sched_getaffinity(0))
    world = int(os.environ["WORLD_SIZE"])
    if mode == "bubble" and len(cpus) >= world:  # a core of its own per rank (what the recording assumes)
        os.sched_setaffinity(0, {cpus[int(os.environ["RANK"])]})
    old_torch = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
    share = {}  # run -> this rank's CPU time / wall time
    for name, overrides in runs.items():
        if overrides.get("pipeline_schedule") == "zbv" and old_torch:
            skipped[name] = f"torch {torch.__version__} with gloo: self-send in torch's p2p warm-up"
            continue
        cfg = load_config("tiny", {**base, **overrides})
        cpu0, wall0 = _cpu_s(), time.perf_counter()
        m = train(cfg, out / name)
        share[name] = round((_cpu_s() - cpu0) / (time.perf_counter() - wall0), 3)
        if m is not None:
            results[name] = {"metrics": m["metrics"], "pipeline": m["pipeline"], "mesh": m["mesh"],
                             "profile": m["profile"]}
    # per run and rank, CPU time / wall time: near 1 - bubble with a core to itself, lower when other
    # processes share its core
    shares = [None] * world
    dist.all_gather_object(shares, share)
    if dist.get_rank() == 0:
        (out / f"{mode}.json").write_text(json.dumps({"runs": results, "skipped": skipped, "cpus": len(cpus),
                                                      "cpu_share": {n: [x[n] for x in shares] for n in share},
                                                      "loadavg": os.getloadavg()}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

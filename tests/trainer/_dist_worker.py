"""Run on 4 gloo ranks (dp 2 x ep 2) by test_distributed.py (forked by tests/trainer/_workers.py, with the environment
torchrun gives its ranks); writes rank-0 results as JSON.

1. EP numerics: for every sync-free level and backend, an EP MoE layer's output and gradients equal an
   EP=1 reference computed on all ranks' tokens with the full expert set.
2. Host syncs in the MoE path per level under EP (forward + backward of the layer).
3. Every level x backend trains 2 steps through train() (alternating FSDP2 / DDP).
4. The 10-step run of ``trainer.launch --config tiny --nproc 4 --set ep=2 --sync-free-level 1
   --grouped-gemm-backend torch -o OUT/dp2ep2``: its arguments parsed as each rank's ``python -m trainer`` parses
   them (trainer/cli.py), then train(): in this launch, not a second torchrun of 4 processes (the launcher's own
   part, starting torchrun and its ranks, is run by the README's commands: tests/test_readme.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moespec.backends import GROUPED_GEMM_BACKENDS
from moespec.config import load_config
from trainer.cli import build_parser, config_from_args
from trainer.model.moe import MoE
from trainer.parallel import init_distributed
from trainer.syncs import HostSyncCounter
from trainer.train import train

LAUNCHER_RUN = ["--config", "tiny", "--set", "ep=2", "--sync-free-level", "1", "--grouped-gemm-backend", "torch"]


def moe_check(cfg, d, level, backend):
    cfg = dict(cfg, sync_free_level=level, grouped_gemm_backend=backend)
    ep = MoE(cfg, d.ep_group, d.ep, d.ep_rank)
    ref = MoE(cfg, None, 1, 0)
    for m in (ep, ref):
        torch.manual_seed(7)
        m.gate.weight.data.normal_(0, 0.5)
        m.shared.w1.weight.data.normal_(0, 0.1)
        m.shared.w2.weight.data.normal_(0, 0.1)
        m.shared.w3.weight.data.normal_(0, 0.1)
        m.init_weights(0.1, torch.Generator().manual_seed(11))
    B, S, D = 2, 16, cfg["d_model"]
    # tokens of every rank of my EP group (ranks in the same dp row)
    ep_ranks = dist.get_process_group_ranks(d.ep_group)
    xs = [torch.randn(B, S, D, generator=torch.Generator().manual_seed(100 + r)) for r in ep_ranks]
    gs = [torch.randn(B, S, D, generator=torch.Generator().manual_seed(200 + r)) for r in ep_ranks]
    me = ep_ranks.index(d.rank)
    x = xs[me].clone().requires_grad_(True)
    with HostSyncCounter() as counter:
        y, _ = ep(x)
        (y * gs[me]).sum().backward()
    xr = torch.cat(xs).requires_grad_(True)
    yr, _ = ref(xr)
    (yr * torch.cat(gs)).sum().backward()
    lo, hi = d.ep_rank * ep.E_local, (d.ep_rank + 1) * ep.E_local
    gate_grad = ep.gate.weight.grad.clone()
    dist.all_reduce(gate_grad, group=d.ep_group)
    err = {
        "y": (y - yr[me * B:(me + 1) * B]).abs().max().item(),
        "x_grad": (x.grad - xr.grad[me * B:(me + 1) * B]).abs().max().item(),
        # expert grads are pre-scaled by 1/ep for the DP reduction (see trainer.parallel.dist)
        "w13_grad": (ep.experts.w13.grad * d.ep - ref.experts.w13.grad[lo:hi]).abs().max().item(),
        "w2_grad": (ep.experts.w2.grad * d.ep - ref.experts.w2.grad[lo:hi]).abs().max().item(),
        "gate_grad": (gate_grad - ref.gate.weight.grad).abs().max().item(),
    }
    return err, counter.moe_total, dict(counter.by_stage), counter.total


def main(out_dir: str) -> None:
    out = Path(out_dir)
    cfg = load_config("tiny", {"ep": 2, "steps": 2, "log_every": 0, "profile_step_end": 0,
                               "grad_clip": 0.05})  # clipping active: the global norm must be layout-exact
    d = init_distributed(cfg)
    results = {"numerics": {}, "syncs": {}, "train": {}}
    for level in range(4):
        for backend in GROUPED_GEMM_BACKENDS:
            err, moe_syncs, stages, total = moe_check(cfg, d, level, backend)
            results["numerics"][f"{level}/{backend}"] = err
            results["syncs"][f"{level}/{backend}"] = {"moe": moe_syncs, "stages": stages, "total": total}
    for i, level in enumerate(range(4)):
        for j, backend in enumerate(GROUPED_GEMM_BACKENDS):
            mode = "fsdp" if (i + j) % 2 == 0 else "ddp"
            run_cfg = dict(cfg, sync_free_level=level, grouped_gemm_backend=backend, dp_mode=mode,
                           recompute_layer_ids=[2] if j == 1 else [], loss_fusion=j == 2,
                           loss_chunk_size=100)
            m = train(run_cfg, out / f"l{level}_{backend}")
            if m is not None:
                results["train"][f"{level}/{backend}"] = {"loss": m["metrics"]["loss"], "dp_mode": mode,
                                                          "grad_norm": m["metrics"]["grad_norm"],
                                                          "mesh": m["mesh"]["shape"]}
    args = build_parser().parse_args([*LAUNCHER_RUN, "-o", str(out / "dp2ep2")])
    train(config_from_args(args), args.out)
    if d.rank == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

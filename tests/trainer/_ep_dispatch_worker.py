"""Run under torchrun (4 gloo ranks) by test_ep_dispatch.py; rank 0 writes the results as JSON.

For EP 4 (one group of 4) and EP 2 (two groups of 2), every dispatch path (``ep_dispatch`` nccl at
every sync-free level; capacity with a factor that drops nothing and with one that drops), overlap
off and on: one MoE layer's output and gradients against a reference computed on every rank of the
group's tokens with the full expert set:

* without drops, the reference is the EP=1 layer (trainer.model.moe.MoE, ep_size 1);
* with drops, it is written out here from the weights: for each (token, slot) in token order, the
  row is kept while fewer than ``ceil(f * n * k / P)`` earlier rows of the same chunk of the same
  rank went to the same peer; a token's output is its shared expert plus its kept experts' weighted
  SwiGLU outputs. The dropped-row count is checked against the same rule.

Host syncs in the MoE path are counted per path and level (forward + backward).

``EP_WORKER_DEVICE=cuda`` (benchmarks/bench_ep.sh, on GPUs): NCCL instead of gloo, the same cases on the
GPU, plus bf16 cases through ``torch._grouped_mm`` (whose rows past the last offset are left unwritten:
the outputs and gradients must still match and be finite).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moespec.config import load_config
from trainer.model.moe import MoE, route
from trainer.syncs import HostSyncCounter


def _init(m: MoE) -> None:
    torch.manual_seed(7)
    m.gate.weight.data.normal_(0, 0.5)
    for lin in (m.shared.w1, m.shared.w2, m.shared.w3):
        lin.weight.data.normal_(0, 0.1)
    m.init_weights(0.1, torch.Generator().manual_seed(11))


DEV = torch.device("cpu")


def _inputs(ranks, B, S, D, dtype):
    xs = [torch.randn(B, S, D, generator=torch.Generator().manual_seed(100 + r)).to(DEV, dtype) for r in ranks]
    gs = [torch.randn(B, S, D, generator=torch.Generator().manual_seed(200 + r)).to(DEV, dtype) for r in ranks]
    return xs, gs


def _dropping_reference(ref: MoE, cfg, xs, P, chunks, factor):
    """Output of every rank's tokens under the capacity rule, from ``ref``'s weights (EP=1 layer)."""
    k, E = cfg["top_k"], cfg["n_routed_experts"]
    El = E // P
    ys, dropped = [], 0
    w13, w2 = ref.experts.w13, ref.experts.w2
    for x in xs:
        xf = x.reshape(-1, x.shape[-1])
        T = xf.shape[0]
        logits = F.linear(xf.float(), ref.gate.weight.float())
        idx, w, _ = route(logits, top_k=k, score_func=cfg["score_func"], n_group=cfg["n_group"],
                          topk_group=cfg["topk_group"], norm_topk_prob=cfg["norm_topk_prob"],
                          routed_scaling_factor=cfg["routed_scaling_factor"])
        keep = torch.zeros(T, k, dtype=torch.bool)
        for c in range(chunks):
            lo, hi = T * c // chunks, T * (c + 1) // chunks
            cap = max(1, math.ceil(factor * (hi - lo) * k / P - 1e-9))
            used = [0] * P
            for t in range(lo, hi):
                for s in range(k):
                    p = int(idx[t, s]) // El
                    if used[p] < cap:
                        keep[t, s] = True
                        used[p] += 1
        dropped += int((~keep).sum())
        y = ref.shared(xf)
        for t in range(T):
            for s in range(k):
                if keep[t, s]:
                    e = int(idx[t, s])
                    h = xf[t] @ w13[e].t()
                    g, u = h.chunk(2)
                    y = y.index_add(0, torch.tensor([t], device=y.device),
                                    (w[t, s].to(y.dtype) * ((F.silu(g) * u) @ w2[e].t())).unsqueeze(0))
        ys.append(y.view_as(x))
    return ys, dropped


def check(cfg, group, P, me, ranks, *, path, level, overlap, factor, backend="torch", dtype=torch.float32):
    cfg = dict(cfg, sync_free_level=level, grouped_gemm_backend=backend, ep=P, ep_dispatch=path,
               ep_capacity_factor=factor, ep_overlap=overlap, ep_overlap_chunks=2)
    ep = MoE(cfg, group, P, me)
    ref = MoE(dict(cfg, ep=1, ep_dispatch="nccl", ep_overlap=False), None, 1, 0)
    _init(ep)
    _init(ref)
    ep.to(DEV, dtype)
    ref.to(DEV, dtype)
    B, S, D = 2, 16, cfg["d_model"]
    xs, gs = _inputs(ranks, B, S, D, dtype)
    x = xs[me].clone().requires_grad_(True)
    with HostSyncCounter() as counter:
        y, _ = ep(x)
        (y * gs[me]).sum().backward()
    chunks = 2 if overlap else 1
    if path == "capacity":
        xr = [t.clone().requires_grad_(True) for t in xs]
        yr, want_dropped = _dropping_reference(ref, cfg, xr, P, chunks, factor)
        sum((a * b).sum() for a, b in zip(yr, gs, strict=True)).backward()
        y_ref, xg_ref = yr[me], xr[me].grad
        got_dropped = int(ep.dispatcher.dropped)
        total = torch.tensor([got_dropped], device=DEV)
        dist.all_reduce(total, group=group)
        got_dropped = int(total)
    else:
        xr = torch.cat(xs).requires_grad_(True)
        yr, _ = ref(xr)
        (yr * torch.cat(gs)).sum().backward()
        y_ref, xg_ref = yr[me * B:(me + 1) * B], xr.grad[me * B:(me + 1) * B]
        want_dropped = got_dropped = 0
    lo, hi = me * ep.E_local, (me + 1) * ep.E_local
    ref_scale = {"y": y_ref.abs().max(), "x_grad": xg_ref.abs().max(), "w13_grad": ref.experts.w13.grad.abs().max(),
                 "w2_grad": ref.experts.w2.grad.abs().max(), "gate_grad": ref.gate.weight.grad.abs().max(),
                 "shared_grad": ref.shared.w1.weight.grad.abs().max()}
    # the gate's gradient of the EP layer covers my tokens only: sum over the group
    gate_grad = ep.gate.weight.grad.clone()
    dist.all_reduce(gate_grad, group=group)
    shared_grad = ep.shared.w1.weight.grad.clone()
    dist.all_reduce(shared_grad, group=group)
    finite = all(bool(t.isfinite().all()) for t in (y, x.grad, ep.experts.w13.grad, ep.experts.w2.grad))
    err = {
        "y": (y - y_ref).abs().max().item(),
        "x_grad": (x.grad - xg_ref).abs().max().item(),
        # expert grads are pre-scaled by 1/ep for the DP reduction (see trainer.parallel.dist)
        "w13_grad": (ep.experts.w13.grad * P - ref.experts.w13.grad[lo:hi]).abs().max().item(),
        "w2_grad": (ep.experts.w2.grad * P - ref.experts.w2.grad[lo:hi]).abs().max().item(),
        "gate_grad": (gate_grad - ref.gate.weight.grad).abs().max().item(),
        "shared_grad": (shared_grad - ref.shared.w1.weight.grad).abs().max().item(),
    }
    if dtype != torch.float32:  # relative to the reference's scale: bf16 rounds every product
        err = {k: v / max(1e-6, float(ref_scale[k])) for k, v in err.items()}
    return {"err": err, "finite": finite, "syncs": dict(counter.by_stage), "moe_syncs": counter.moe_total,
            "dropped": got_dropped, "want_dropped": want_dropped, "routed_rows": ep.dispatcher.routed_rows}


def main(out_dir: str) -> None:
    global DEV
    cuda = os.environ.get("EP_WORKER_DEVICE") == "cuda"
    if cuda:
        DEV = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(DEV)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4
    cfg = load_config("tiny", {"ep": 1})
    ep2_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    layouts = {4: (dist.group.WORLD, rank, [0, 1, 2, 3]),
               2: (ep2_groups[rank // 2], rank % 2, [2 * (rank // 2), 2 * (rank // 2) + 1])}
    cases = []
    for level in range(4):
        for overlap in (False, True):
            cases.append(dict(path="nccl", level=level, overlap=overlap, factor=1.25))
    for overlap in (False, True):
        cases.append(dict(path="capacity", level=3, overlap=overlap, factor=8.0))   # >= the worst case: no drop
        cases.append(dict(path="capacity", level=3, overlap=overlap, factor=0.6))   # drops
    cases.append(dict(path="capacity", level=3, overlap=True, factor=0.6, backend="loop"))
    if cuda:
        for path, factor in (("nccl", 1.25), ("capacity", 8.0), ("capacity", 0.6)):
            for backend in ("torch", "triton"):
                cases.append(dict(path=path, level=3, overlap=True, factor=factor, backend=backend,
                                  dtype=torch.bfloat16))
    results = {}
    for P, (group, me, ranks) in layouts.items():
        for c in cases:
            key = f"ep{P}/{c['path']}/L{c['level']}/{'overlap' if c['overlap'] else 'serial'}/f{c['factor']}" \
                  f"/{c.get('backend', 'torch')}" + ("/bf16" if c.get("dtype") == torch.bfloat16 else "")
            results[key] = check(cfg, group, P, me, ranks, **c)
    if rank == 0:
        (Path(out_dir) / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

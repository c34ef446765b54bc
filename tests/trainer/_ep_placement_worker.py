"""Run on 4 gloo ranks by test_ep_placement.py (forked by tests/trainer/_workers.py, with the environment torchrun
gives its ranks); rank 0 writes the results as JSON.

``ep_placement: balanced`` against the contiguous placement, at EP 4 (one group of 4) and EP 2 (two groups
of 2), through the dispatch paths (nccl at levels 0 and 3, capacity without drops, symm on the emulated
NVSHMEM ops of _ep_dispatch_worker.py), serial and overlapped: the same MoE layer (same global weights,
same inputs) built twice, once with the contiguous placement and once with a balanced placement computed by
`moespec.placement.balanced_placement` from the group's own routing counts (so hot experts really move
rank). Compared:

* the outputs, the input gradients, the gate's and the shared expert's gradients (summed over the group);
* the routed experts' weight gradients, gathered over the group into the global ``[E, ...]`` order (a
  balanced rank's local expert ``i`` is logical expert ``local_experts[i]``);
* the routing log's counts (trainer/routing_log.py): per LOGICAL expert under both placements.

With drops (capacity 0.6) the two placements drop different rows (the peer of a row is its slot's rank): the
balanced layer is checked against the capacity rule written out with the slots' peers
(``_dropping_reference(..., slot=...)``), and drops fewer rows when its placement evens the peers' loads.

Then the trainer end to end on the same 4 ranks (tiny, ep 4, 6 steps), each run's arguments parsed as each rank's
``python -m trainer`` parses them (trainer/cli.py: the loads file read before training) and trained by train():
``OUT/contiguous`` writes its routing.json, ``OUT/balanced`` (``ep_placement=balanced``) reads it.
"""

from __future__ import annotations

import json
import os
import sys

from tests.trainer._workers import interpreter_or_stop

interpreter_or_stop()
if os.environ.get("EP_WORKER_DEVICE") != "cuda":  # the fused capacity path runs its Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")  # interpreted on a CPU (set before triton is imported)
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moespec.config import load_config
from moespec.placement import (
    balanced_placement,
    contiguous_placement,
    imbalance,
    slot_map,
)
from tests.trainer._ep_dispatch_worker import (
    EmulatedSymmOps,
    _dropping_reference,
    _init,
    _inputs,
)
from trainer.cli import build_parser, config_from_args
from trainer.model import dispatch
from trainer.model.moe import MoE, route
from trainer.routing_log import RoutingLog
from trainer.train import train


def _loads(cfg, ref: MoE, xs) -> list[int]:
    """Tokens per expert that the group's inputs route to (the placement's expected loads)."""
    E = cfg["n_routed_experts"]
    out = torch.zeros(E, dtype=torch.int64)
    for x in xs:
        logits = F.linear(x.reshape(-1, x.shape[-1]).float(), ref.gate.weight.float())
        idx, _, _ = route(logits, top_k=cfg["top_k"], score_func=cfg["score_func"], n_group=cfg["n_group"],
                          topk_group=cfg["topk_group"], norm_topk_prob=cfg["norm_topk_prob"],
                          routed_scaling_factor=cfg["routed_scaling_factor"])
        out += torch.bincount(idx.reshape(-1), minlength=E)
    return out.tolist()


def _run(m: MoE, x, g, group, P):
    """Forward + backward of one layer under a routing log -> (y, x.grad, global expert grads, gate and
    shared grads summed over the group, logged counts, dropped rows over the group)."""
    log = RoutingLog(SimpleNamespace(layers=[SimpleNamespace(is_moe=True, layer_id=1, ffn=m)]), range(0))
    x = x.clone().requires_grad_(True)
    with log.active():
        y, _ = m(x)
    (y * g).sum().backward()
    experts = []
    for w in (m.experts.w13.grad, m.experts.w2.grad):
        parts = [torch.empty_like(w) for _ in range(P)]
        dist.all_gather(parts, w.contiguous(), group=group)
        slots = torch.cat(parts) * P  # slot order; grads are pre-scaled by 1/ep for the DP reduction
        if m.local_experts is not None:  # slot -> logical: logical e sits in slot expert_slot[e]
            slots = slots.index_select(0, m.expert_slot)
        experts.append(slots)
    sums = []
    for t in (m.gate.weight.grad, m.shared.w1.weight.grad):
        t = t.clone()
        dist.all_reduce(t, group=group)
        sums.append(t)
    dropped = torch.tensor([int(m.dispatcher.dropped) if m.dispatcher.dropped is not None else 0])
    dist.all_reduce(dropped, group=group)
    return {"y": y.detach(), "x_grad": x.grad, "w13_grad": experts[0], "w2_grad": experts[1], "gate_grad": sums[0],
            "shared_grad": sums[1], "counts": log.acc[0].clone(), "dropped": int(dropped)}


def check(cfg, group, P, me, ranks, *, path, level, overlap, factor):
    cfg = dict(cfg, sync_free_level=level, grouped_gemm_backend="torch", ep=P, ep_dispatch=path,
               ep_capacity_factor=factor, ep_overlap=overlap, ep_overlap_chunks=2)
    E = cfg["n_routed_experts"]
    ref = MoE(dict(cfg, ep=1, ep_dispatch="nccl", ep_overlap=False), None, 1, 0)
    _init(ref)
    B, S, D = 2, 16, cfg["d_model"]
    xs, gs = _inputs(ranks, B, S, D, torch.float32)
    loads = _loads(cfg, ref, xs)
    placed = balanced_placement(loads, P)
    slots = slot_map(placed.ranks)
    runs = {}
    for name, placement in (("contiguous", None), ("balanced", slots)):
        m = MoE(cfg, group, P, me, placement)
        _init(m)
        runs[name] = _run(m, xs[me], gs[me], group, P)
    a, b = runs["contiguous"], runs["balanced"]
    keys = ("y", "x_grad", "w13_grad", "w2_grad", "gate_grad", "shared_grad")
    res = {"loads": loads, "ranks": [list(r) for r in placed.ranks],
           "moved": sum(s // (E // P) != e // (E // P) for e, s in enumerate(slots)),
           "imbalance": [imbalance(loads, contiguous_placement(E, P)), imbalance(loads, placed.ranks)],
           "counts_equal": bool(torch.equal(a["counts"], b["counts"])), "dropped": [a["dropped"], b["dropped"]]}
    if factor >= 8:  # no drop: the same function, whatever the placement
        res["err"] = {k: float((a[k] - b[k]).abs().max()) for k in keys}
        res["bitwise"] = {k: bool(torch.equal(a[k], b[k])) for k in keys}
    else:  # drops follow the slots' peers: the capacity rule written out with them
        xr = [t.clone().requires_grad_(True) for t in xs]
        yr, want = _dropping_reference(ref, cfg, xr, P, 2 if overlap else 1, factor, slot=slots)
        sum((u * v).sum() for u, v in zip(yr, gs, strict=True)).backward()
        res["err"] = {"y": float((b["y"] - yr[me].detach()).abs().max()), "x_grad": float((b["x_grad"] - xr[me].grad).abs().max()),
                      "w13_grad": float((b["w13_grad"] - ref.experts.w13.grad).abs().max()),
                      "w2_grad": float((b["w2_grad"] - ref.experts.w2.grad).abs().max())}
        res["want_dropped"] = want
    return res


# the trainer end to end: name -> --set overrides ({out}: this launch's output directory)
E2E = ["ep=4", "steps=6", "profile_step_end=0", "log_every=0"]
E2E_RUNS = {"contiguous": E2E,
            "balanced": [*E2E, "ep_placement=balanced", "ep_placement_loads={out}/contiguous/routing.json"]}


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 4
    dispatch.set_symm_ops(EmulatedSymmOps())
    # 16 experts: at EP 4 four per rank, enough for the balanced placement to differ from the contiguous one
    cfg = load_config("tiny", {"ep": 1, "n_routed_experts": 16})
    ep2_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    layouts = {4: (dist.group.WORLD, rank, [0, 1, 2, 3]),
               2: (ep2_groups[rank // 2], rank % 2, [2 * (rank // 2), 2 * (rank // 2) + 1])}
    cases = [{"path": "nccl", "level": lv, "overlap": ov, "factor": 8.0} for lv in (0, 3) for ov in (False, True)]
    cases += [{"path": "capacity", "level": 3, "overlap": ov, "factor": f} for ov in (False, True) for f in (8.0, 0.6)]
    cases += [{"path": "symm", "level": 3, "overlap": False, "factor": f} for f in (8.0, 0.6)]
    results = {}
    for P, (group, me, ranks) in layouts.items():
        for c in cases:
            key = f"ep{P}/{c['path']}/L{c['level']}/{'overlap' if c['overlap'] else 'serial'}/f{c['factor']}"
            try:
                results[key] = check(cfg, group, P, me, ranks, **c)
            except Exception as err:  # noqa: BLE001 - the test names the case and its error
                results[key] = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"}
    out = Path(out_dir)
    for name, sets in E2E_RUNS.items():
        sets = [x.format(out=out) for x in sets]
        args = build_parser().parse_args(["--config", "tiny", *[a for x in sets for a in ("--set", x)],
                                          "-o", str(out / name)])
        train(config_from_args(args), args.out)
        dist.barrier()  # the balanced run reads the contiguous run's routing.json
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

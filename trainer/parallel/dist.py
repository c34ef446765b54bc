"""Process groups and data parallelism.

One code path for every world size: without torchrun (no ``WORLD_SIZE`` in the environment) the
process forms a world of one through an in-memory store, so the mesh, FSDP2/DDP wrapping and the
MoE collectives' code all run as they do under torchrun. Backend: NCCL on CUDA, gloo on CPU.

Mesh ``(dp, ep)`` (``init_device_mesh``): EP groups are the rows of consecutive ranks (all-to-all
stays inside a node when ep <= GPUs per node), DP groups the columns. With pipeline parallelism the
mesh is ``(pp, dp, ep)``: pipeline rank outermost, so the ``dp * ep`` ranks of one stage are
consecutive and a pipeline group is every ``dp * ep``-th rank. The ``dp * ep`` ranks that hold the
same stage form the *replica* group (the whole world when pp = 1). Gradient reduction:

* dense parameters see a different micro-batch on every replica rank, so they are averaged over the
  replica group (FSDP2 on a 1-D replica mesh, or DDP on the replica group);
* expert parameters are averaged over the DP group only (FSDP2 on the ``dp`` sub-mesh, or an
  all-reduce after backward under DDP); their gradients are pre-scaled by 1/ep in the model
  (``scale_grad``) because an expert already sums the contributions of all ep ranks through the
  all-to-all backward; together this is exactly the world-mean gradient.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    dp: int
    ep: int
    dp_rank: int
    ep_rank: int
    mesh: object = None          # DeviceMesh (dp, ep), or (pp, dp, ep) when pp > 1
    world_mesh: object = None    # 1-D DeviceMesh over all ranks
    ep_group: object = None
    dp_group: object = None
    launched: bool = False       # under torchrun
    notes: list = field(default_factory=list)
    pp: int = 1
    pp_rank: int = 0
    pp_group: object = None      # the ranks of my pipeline (one per stage position)
    replica_mesh: object = None  # 1-D DeviceMesh over the dp*ep ranks holding my stage (== world_mesh if pp=1)

    @property
    def data_rank(self) -> int:
        """Index of my data-parallel replica (what the data loader shards by; shared by a pipeline)."""
        return self.dp_rank * self.ep + self.ep_rank

    @property
    def mesh_info(self) -> dict:
        ranks = self.mesh.mesh.tolist() if self.mesh is not None else [[0]]
        if self.pp > 1:
            return {"dims": ["pp", "dp", "ep"], "shape": [self.pp, self.dp, self.ep], "ranks": ranks,
                    "backend": self.backend}
        return {"dims": ["dp", "ep"], "shape": [self.dp, self.ep], "ranks": ranks, "backend": self.backend}


def pick_device(cfg: dict, local_rank: int) -> torch.device:
    want = cfg["device"]
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from moespec.config import ConfigError

            raise ConfigError("device", "device=cuda but CUDA is not available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(cfg: dict) -> Dist:
    from torch.distributed.device_mesh import init_device_mesh

    from moespec.config import resolve_world

    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dp, ep = resolve_world(cfg, world)  # fails fast before any collective
    device = pick_device(cfg, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=10)
        if launched:
            kw = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend, timeout=timeout, **kw)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    pp = cfg.get("pp", 1)
    world_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("world",))
    if pp == 1:
        mesh = init_device_mesh(device.type, (dp, ep), mesh_dim_names=("dp", "ep"))
        pp_kw = {"replica_mesh": world_mesh}
    else:
        mesh = init_device_mesh(device.type, (pp, dp, ep), mesh_dim_names=("pp", "dp", "ep"))
        replica = init_device_mesh(device.type, (pp, dp * ep), mesh_dim_names=("pp", "replica"))
        pp_kw = {"pp": pp, "pp_rank": mesh.get_local_rank("pp"), "pp_group": mesh.get_group("pp"),
                 "replica_mesh": replica["replica"]}
    return Dist(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend, dp=dp, ep=ep,
                dp_rank=mesh.get_local_rank("dp"), ep_rank=mesh.get_local_rank("ep"), mesh=mesh,
                world_mesh=world_mesh, ep_group=mesh.get_group("ep"), dp_group=mesh.get_group("dp"),
                launched=launched, **pp_kw)


def expert_param_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if ".experts." in n]


def wrap_data_parallel(model: nn.Module, cfg: dict, d: Dist) -> nn.Module:
    """FSDP2 (``fully_shard`` per block, experts on the dp sub-mesh) or DDP (experts excluded), over the
    ranks that hold the same parameters (the replica group: the world, or one pipeline stage's ranks).
    ``model`` is the whole Transformer or one pipeline stage's module (anything with ``.layers``)."""
    bf16 = cfg["dtype"] == "bf16"
    if cfg["dp_mode"] == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        dp_mesh = d.mesh["dp"]
        for layer in model.layers:
            if layer.is_moe:
                fully_shard(layer.ffn.experts, mesh=dp_mesh, mp_policy=mp)
            fully_shard(layer, mesh=d.replica_mesh, mp_policy=mp)
        fully_shard(model, mesh=d.replica_mesh, mp_policy=mp)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    # expert weights are split over ep (their gradients are reduced by sync_expert_grads); the routers'
    # balancing biases are updated identically on every rank (trainer/model/balance.py): no broadcast
    bias = [n for n, _ in model.named_buffers() if n.endswith("expert_bias")]
    DDP._set_params_and_buffers_to_ignore_for_model(model, expert_param_names(model) + bias)
    kw = {"device_ids": [d.device.index]} if d.device.type == "cuda" else {}
    return DDP(model, process_group=d.replica_mesh.get_group(), **kw)


def sync_expert_grads(model: nn.Module, cfg: dict, d: Dist) -> None:
    """DDP mode: average expert gradients over the DP group (FSDP2 does this itself)."""
    if cfg["dp_mode"] != "ddp" or d.dp == 1:
        return
    grads = [p.grad for n, p in model.named_parameters() if ".experts." in n and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=d.dp_group)
    flat /= d.dp
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()

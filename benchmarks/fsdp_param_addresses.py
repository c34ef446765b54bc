"""Do FSDP2's unsharded parameters keep their addresses from step to step? (issue 19, the CUDA-graphs lead)

CUDA-graph trees (torch.compile mode="reduce-overhead", the trainer's ``cuda_graphs: on``) treat a compiled
region's parameters as static inputs: a parameter found at a new address makes them record the graph again.
Under FSDP2 with a bf16 ``MixedPrecisionPolicy`` (the trainer's ``dp_mode: fsdp``, also at world size 1) the
parameters a block's forward sees are the all-gathered bf16 copies FSDP2 allocates each step. This script
wraps two Linear layers as the trainer wraps its blocks, runs a few optimizer steps and prints the address of
the first layer's weight as its forward sees it, per step, for FSDP2 (bf16) and for plain modules:

    python benchmarks/fsdp_param_addresses.py            # CPU (gloo) or, when there is one, the GPU (nccl)
    python benchmarks/fsdp_param_addresses.py --steps 8 --device cpu

Exit 0; the last line says how many distinct addresses each wrapping gave over the steps.
"""

from __future__ import annotations

import argparse
import os
import sys


def addresses(fsdp: bool, steps: int, device: str) -> list[int]:
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)).to(device)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.split(":")[0], (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in m:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(m, mesh=mesh, mp_policy=mp)
    seen: list[int] = []
    m[0].register_forward_pre_hook(lambda mod, args: seen.append(int(mod.weight.data_ptr())))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(32, 256, device=device)
    for _ in range(steps):
        m(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
    return seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be at least 2")
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        print("fsdp_param_addresses: torch is not installed", file=sys.stderr)
        return 2
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("fsdp_param_addresses: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=0, world_size=1)
    try:
        counts = {}
        for name, fsdp in (("FSDP2 bf16", True), ("plain module", False)):
            seen = addresses(fsdp, a.steps, device)
            counts[name] = len(set(seen))
            print(f"{name:13s} {device}: weight address per step: {', '.join(hex(v) for v in seen)}")
    finally:
        dist.destroy_process_group()
    print("distinct addresses over", a.steps, "steps:", ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Process-level toggles: environment knobs, NUMA binding, manual GC, version/environment capture."""

from __future__ import annotations

import gc
import os
import platform
import sys
from importlib import metadata

# Environment variables worth recording whatever the config says.
RECORDED_ENV_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_", "CUDA_", "OMP_", "GLOO_", "TRITON_", "NVTE_", "MKL_")


def apply_env(knobs: dict) -> dict:
    """Set the config's ``env`` knobs (before process-group init) and return them as strings."""
    applied = {str(k): str(v) for k, v in knobs.items()}
    os.environ.update(applied)
    return applied


def recorded_env() -> dict:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_ENV_PREFIXES)}


def _parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return cpus


def numa_bind(device) -> dict:
    """Pin this process to the NUMA node of its GPU. Returns what happened (for the manifest)."""
    if device.type != "cuda":
        return {"bound": False, "reason": "no-op: not on a GPU, GPU NUMA topology unknown"}
    import torch

    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    dom = getattr(props, "pci_domain_id", 0)
    dev = getattr(props, "pci_device_id", None)
    if bus is None or dev is None:
        return {"bound": False, "reason": "no-op: this torch does not expose the GPU's PCI address"}
    pci = f"{dom:04x}:{bus:02x}:{dev:02x}.0"
    try:
        node = int(open(f"/sys/bus/pci/devices/{pci}/numa_node").read().strip())
    except (OSError, ValueError):
        return {"bound": False, "reason": f"no-op: NUMA node of GPU {pci} unknown (no sysfs entry)"}
    if node < 0:
        return {"bound": False, "reason": f"no-op: sysfs reports no NUMA node for GPU {pci}"}
    try:
        cpus = _parse_cpulist(open(f"/sys/devices/system/node/node{node}/cpulist").read())
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as err:
        return {"bound": False, "reason": f"no-op: cannot bind to node {node}: {err}"}
    return {"bound": True, "numa_node": node, "pci": pci, "n_cpus": len(cpus)}


class ManualGC:
    """``every`` > 0: automatic GC off, ``gc.collect()`` every ``every`` steps (same step on every rank,
    so no rank stalls a collective while the others wait)."""

    def __init__(self, every: int):
        self.every = every
        self.was_enabled = gc.isenabled()
        if every > 0:
            gc.disable()

    def step(self, step: int) -> None:
        if self.every > 0 and step > 0 and step % self.every == 0:
            gc.collect()

    def close(self) -> None:
        if self.every > 0 and self.was_enabled:
            gc.enable()


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    for pkg in ("triton", "numpy", "pyyaml"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    out["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            out["nccl"] = None
    out["argv"] = list(sys.argv)
    return out


def peak_memory_bytes(device) -> tuple[int, str]:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(rss if sys.platform == "darwin" else rss * 1024), "process_max_rss"

"""Process-level toggles: environment knobs, NUMA binding, manual GC, version/environment capture; the run
dir's bookkeeping (atomic manifest writes, clearing a previous run). Importable without torch."""

from __future__ import annotations

import gc
import json
import os
import platform
import shutil
import stat
import sys
from importlib import metadata
from pathlib import Path

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


# ------------------------------------------------------------------------------------------ run dir
# What a run writes into its directory, and what `tracelens analyze RUN` derives from it: name -> the
# files of ours in it (None: a file). A new run into a used run dir removes these first (docs/trainer.md,
# "Re-running"); a directory keeps anything else it holds, and is removed only when that leaves it empty.
PARTIAL_DIR = ".partial"  # files being written (traces), renamed into place when whole
RUN_OUTPUTS: dict[str, tuple[str, ...] | None] = {
    "manifest.json": None, "traces": ("*.json", "*.json.gz"), "pipeline": ("*.jsonl", "*.jsonl.gz"),
    "logs": ("torchrun.log", "rank*.traceback.txt"), PARTIAL_DIR: ("*",),
    "routing.json": None, "report.html": None, "summary.json": None, "ppvis.html": None, "tables": ("*.parquet", "*.csv"),
}


def write_json_atomic(path: str | Path, doc, indent: int | None = 2) -> None:
    """Write JSON so that a reader sees the old file or the new one, never a part: a temporary file in
    the same directory, fsync'd, then ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(doc, indent=indent, default=str))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    try:  # the rename itself survives a crash once the directory is synced
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def looks_like_run_dir(out: str | Path) -> bool:
    """A trainer run dir: a manifest.json, or rank traces under traces/ (a run killed before manifests
    were written first)."""
    out = Path(out)
    return (out / "manifest.json").is_file() or any((out / "traces").glob("rank*.json*"))


def clear_previous_run(out: str | Path, keep: tuple[str, ...] = ()) -> list[str]:
    """Remove a previous run's outputs from ``out`` (RUN_OUTPUTS, except ``keep``) so that new traces
    never sit beside an old manifest or an old rank's trace. Only in a directory that holds a run
    (:func:`looks_like_run_dir`: ``-o ~`` never loses ``~/logs``); only our files. Returns the names
    of what was removed."""
    out = Path(out)
    if not looks_like_run_dir(out):
        return []
    removed = []
    for name, patterns in RUN_OUTPUTS.items():
        p = out / name
        if name in keep or not (p.exists() or p.is_symlink()):
            continue
        if patterns is None or p.is_symlink() or not p.is_dir():
            if patterns is None and (p.is_file() or p.is_symlink()):
                p.unlink()
                removed.append(name)
            continue
        hit = False
        for pat in patterns:
            for f in p.glob(pat):
                if f.is_dir() and not f.is_symlink():
                    shutil.rmtree(f)
                else:
                    f.unlink()
                hit = True
        try:
            p.rmdir()  # only when nothing else is left in it
        except OSError:
            pass
        if hit:
            removed.append(name)
    return removed


MAX_MANIFEST_BYTES = 64 << 20  # as tracelens/io/manifest.py reads one


def lock_run_dir(out: str | Path) -> int | None:
    """Take the run dir's exclusive lock (a non-blocking ``flock`` on the directory itself: no file is made,
    and the kernel drops it when the holder ends, however it ends). Returns the descriptor to close to release
    it (-1: this filesystem has no flock, so no lock), or None when another run holds it."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return -1
    fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:  # e.g. ENOLCK on a network filesystem
        os.close(fd)
        return -1
    return fd


def read_manifest(out: str | Path) -> dict | None:
    """RUN/manifest.json as a dict, or None: missing, unreadable, not JSON, or not a regular file of at most
    64 MiB (the launcher reads a previous run's manifest before starting: a FIFO there must not hang it)."""
    path = Path(out) / "manifest.json"
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            return None
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def mark_failed(out: str | Path, reason: str) -> bool:
    """Record a failed run in its manifest (``status: failed`` + ``reason``) unless it says ``complete``.
    Returns whether the manifest was updated."""
    doc = read_manifest(out)
    if doc is None or doc.get("status") == "complete":
        return False
    doc["status"] = "failed"
    doc["reason"] = reason
    try:
        write_json_atomic(Path(out) / "manifest.json", doc)
    except OSError:
        return False
    return True

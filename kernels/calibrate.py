"""Measure the roofline ceilings of the device the kernels run on: dense matmul TFLOP/s per dtype and
memory bandwidth.  ``tracelens calibrate`` runs :func:`measure` and writes :func:`ceilings_json`, a
file that ``tracelens roofline --ceilings FILE`` and ``tracelens analyze --ceilings FILE`` accept
(the measured-ceilings format of ``tracelens/devices.py``).

What is measured (random normal data; CUDA events on a GPU, ``perf_counter`` on a CPU; warm-up,
then the median of repeats):

========== ================================================ =========================================
key        GPU (CUDA)                                        CPU (``cpu=True``)
========== ================================================ =========================================
bf16       ``torch.mm`` n x n x n in bf16 -> ``bf16_tflops``  same, on the CPU
fp16       same in fp16 -> ``fp16_tflops``                   (not measured)
tf32       fp32 with TF32 allowed -> ``tf32_tflops``         (not measured: CPUs have no TF32)
fp32       fp32, TF32 off (CUDA cores) -> ``fp32_tflops``    fp32 -> ``fp32_tflops``
hbm        max of a device copy (bytes read + written) and  the same on host memory (DRAM, not HBM)
           a sum reduction (bytes read) -> ``hbm_tbps``
========== ================================================ =========================================

plus ``sm_count`` (multiprocessors) on a GPU.  An fp32 matmul with TF32 off runs on the CUDA
cores, which is the roof ``tracelens`` applies to non-matrix (vector) fp32 work, hence
``fp32_tflops``.

May import: torch, stdlib.
"""

from __future__ import annotations

import datetime
import platform

import torch

from ._runtime import median_ms

MATMUL_DTYPES = ("bf16", "fp16", "tf32", "fp32")
CPU_DTYPES = ("bf16", "fp32")
_TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}


def matmul_tflops(dtype: str, n: int, device: torch.device, warmup: int = 3, reps: int = 10) -> float:
    """Dense ``n x n x n`` matmul throughput in TFLOP/s (2 n^3 FLOPs per product)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=_TORCH_DTYPE[dtype])
    b = torch.randn(n, n, generator=g).to(device=device, dtype=_TORCH_DTYPE[dtype])
    out = torch.empty(n, n, device=device, dtype=a.dtype)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        sec = median_ms(lambda: torch.mm(a, b, out=out), warmup, reps, device) * 1e-3
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return 2.0 * n ** 3 / sec / 1e12


def memory_tbps(nbytes: int, device: torch.device, warmup: int = 3, reps: int = 10) -> dict[str, float]:
    """Bandwidth of a copy (``dst.copy_(src)``: ``2 * nbytes`` moved) and of a read (``src.sum()``:
    ``nbytes`` read), TB/s, over a buffer of ``nbytes`` (far larger than the caches)."""
    n = max(1, nbytes // 4)
    src = torch.ones(n, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    acc = torch.empty((), device=device, dtype=torch.float32)
    copy_s = median_ms(lambda: dst.copy_(src), warmup, reps, device) * 1e-3
    read_s = median_ms(lambda: torch.sum(src, dim=0, out=acc), warmup, reps, device) * 1e-3
    return {"copy_tbps": 2 * 4 * n / copy_s / 1e12, "read_tbps": 4 * n / read_s / 1e12}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def measure(cpu: bool = False, n: int | None = None, mem_bytes: int | None = None, dtypes=None,
            warmup: int = 3, reps: int = 10, log=None) -> dict:
    """Measure this machine's ceilings.  ``cpu=False`` needs a CUDA device (``RuntimeError`` without).

    Defaults: ``n`` 8192 on a GPU (1024 on a CPU), ``mem_bytes`` 2 GiB on a GPU (256 MiB on a CPU),
    ``dtypes`` :data:`MATMUL_DTYPES` on a GPU (:data:`CPU_DTYPES` on a CPU).  Returns a dict with
    ``device``, ``kind`` ("gpu"/"cpu"), ``tflops`` {dtype: TFLOP/s}, ``memory`` {copy_tbps,
    read_tbps}, ``sm_count``, ``settings`` and ``torch``.
    """
    if not cpu and not torch.cuda.is_available():
        raise RuntimeError("no GPU present (torch sees no CUDA device)")
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    n = n or (1024 if cpu else 8192)
    mem_bytes = mem_bytes or ((256 if cpu else 2048) << 20)
    dtypes = tuple(dtypes or (CPU_DTYPES if cpu else MATMUL_DTYPES))
    bad = [d for d in dtypes if d not in _TORCH_DTYPE or (cpu and d not in CPU_DTYPES)]
    if bad:
        raise ValueError(f"cannot measure dtype(s) {bad} on {'a CPU' if cpu else 'a GPU'}; "
                         f"choose from {CPU_DTYPES if cpu else MATMUL_DTYPES}")
    say = log or (lambda msg: None)
    tflops = {}
    for dt in dtypes:
        tflops[dt] = matmul_tflops(dt, n, device, warmup, reps)
        say(f"{dt} matmul {n}x{n}x{n}: {tflops[dt]:.1f} TFLOP/s")
    mem = memory_tbps(mem_bytes, device, warmup, reps)
    say(f"memory {mem_bytes / 2**20:.0f} MiB: copy {mem['copy_tbps']:.3f} TB/s, read {mem['read_tbps']:.3f} TB/s")
    if cpu:
        name, sms = f"CPU: {cpu_name()}", None
    else:
        props = torch.cuda.get_device_properties(device)
        name, sms = torch.cuda.get_device_name(device), props.multi_processor_count
    return {"device": name, "kind": "cpu" if cpu else "gpu", "tflops": tflops, "memory": mem, "sm_count": sms,
            "settings": {"n": n, "mem_bytes": mem_bytes, "warmup": warmup, "reps": reps},
            "torch": torch.__version__,
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _sig(v: float) -> float:
    """Five significant digits (a slow CPU's TFLOP/s must not round to 0)."""
    return float(f"{v:.5g}")


_KEY = {"bf16": "bf16_tflops", "fp16": "fp16_tflops", "tf32": "tf32_tflops", "fp32": "fp32_tflops"}


def ceilings_json(m: dict) -> dict:
    """The measured-ceilings document for ``tracelens roofline --ceilings``: only the keys that
    ``tracelens.devices.load_measured`` knows, the settings and the machine kind in ``source``."""
    s = m["settings"]
    where = "on the CPU (host memory bandwidth as hbm_tbps; not a GPU)" if m["kind"] == "cpu" else "on the GPU"
    doc: dict = {"device": m["device"]}
    for dt, v in m["tflops"].items():
        doc[_KEY[dt]] = _sig(v)
    doc["hbm_tbps"] = _sig(max(m["memory"]["copy_tbps"], m["memory"]["read_tbps"]))
    if m.get("sm_count"):
        doc["sm_count"] = int(m["sm_count"])
    doc["source"] = (f"measured {where} by tracelens calibrate at {m['when']} (torch {m['torch']}; "
                     f"{s['n']}^3 torch.mm per dtype, copy/read of {s['mem_bytes'] / 2**20:.0f} MiB, "
                     f"median of {s['reps']} after {s['warmup']} warm-up)")
    return doc

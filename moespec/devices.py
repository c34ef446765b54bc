"""Devices: datasheet ceilings and memory capacity per GPU, looked up by the name torch or a trace gives.

One table, `DEVICES` (with `HBM_BYTES`, the memory capacity of the same rows). Every number is the
vendor datasheet's *dense* peak (no 2:4 sparsity) at boost clock, per device as torch sees it (an
MI250/MI250X is two GCDs and torch shows each GCD as a device, so those rows hold half the package's
figures). Units: TFLOP/s and TB/s (1e12); memory in bytes.

    >>> from moespec import devices
    >>> c = devices.lookup("NVIDIA H200")          # Ceilings or None
    >>> c.peak_tflops("bf16"), c.hbm_tbps
    (989.4, 4.8)
    >>> devices.peak_bf16_flops("NVIDIA H100 80GB HBM3")    # the trainer's MFU denominator, FLOP/s
    989400000000000.0
    >>> devices.device_memory("H200")              # bytes, by a short name (memory projection)
    141000000000

The trainer divides by `peak_bf16_flops` for MFU; the analyzer's roofline reads `lookup` (with measured
ceilings on top: ``tracelens.devices``) and the memory projection `device_memory`. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

# dtype class of an op -> which ceiling bounds it
DTYPE_CLASSES = ("fp8", "bf16", "fp16", "tf32", "fp32", "fp64")


@dataclass(frozen=True)
class Ceilings:
    device: str
    hbm_tbps: float | None = None  # HBM bandwidth, TB/s
    bf16_tflops: float | None = None  # dense matrix (tensor core / MFMA) peaks, TFLOP/s
    fp16_tflops: float | None = None
    fp8_tflops: float | None = None
    tf32_tflops: float | None = None
    fp32_matrix_tflops: float | None = None  # AMD MFMA fp32 (NVIDIA has no fp32 tensor-core path)
    fp32_tflops: float | None = None  # vector (CUDA core / SIMD) fp32: the roof of non-matrix ops
    fp64_tflops: float | None = None
    sm_count: int | None = None  # SMs (NVIDIA) or CUs (AMD) per device
    source: str = ""  # where the numbers come from (datasheet URL, or "measured: <file>")
    measured: tuple[str, ...] = field(default_factory=tuple)  # fields that came from measurements

    def peak_tflops(self, dtype_class: str, matrix: bool = True) -> float | None:
        """Compute roof for an op of this dtype class. matrix=False: vector roof (elementwise, norms...).

        fp32 matrix ops (GEMM/attention in float) are bounded by TF32 tensor cores where the device has
        them (an upper bound: what the op can reach with TF32 allowed), else by the fp32 matrix/vector peak.
        """
        if not matrix:
            if dtype_class == "fp64":
                return self.fp64_tflops
            return self.fp32_tflops
        if dtype_class == "fp8":
            return self.fp8_tflops
        if dtype_class == "bf16":
            return self.bf16_tflops or self.fp16_tflops
        if dtype_class == "fp16":
            return self.fp16_tflops or self.bf16_tflops
        if dtype_class in ("fp32", "tf32"):
            return self.tf32_tflops or self.fp32_matrix_tflops or self.fp32_tflops
        if dtype_class == "fp64":
            return self.fp64_tflops
        return None

    def ridge(self, dtype_class: str, matrix: bool = True) -> float | None:
        """Arithmetic intensity (FLOP/byte) where the compute roof meets the memory slope."""
        p = self.peak_tflops(dtype_class, matrix)
        return p / self.hbm_tbps if p and self.hbm_tbps else None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["measured"] = list(self.measured)
        return d


_NV_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 datasheet)"
_NV_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (H200 datasheet)"
_NV_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_NV_V100 = "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"
_NV_L40S = "https://www.nvidia.com/en-us/data-center/l40s/ (L40S datasheet)"
_NV_B200 = "https://www.nvidia.com/en-us/data-center/dgx-b200/ (DGX B200: 72 PF fp8 training / 8 GPUs, dense = half)"
_AMD_MI250 = "https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html and .../mi250.html (package peak / 2 GCDs)"
_AMD_MI300X = "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"
_AMD_MI325X = "https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html"
_AMD_MI355X = "https://www.amd.com/en/products/accelerators/instinct/mi350/mi355x.html"

# key -> Ceilings. Datasheet figures with sparsity are halved to dense. NVIDIA tensor-core peaks;
# NVIDIA fp32 = CUDA-core fp32; AMD fp32_tflops = vector fp32, fp32_matrix_tflops = MFMA fp32.
DEVICES: dict[str, Ceilings] = {c.device: c for c in (
    Ceilings("H100 SXM", hbm_tbps=3.35, bf16_tflops=989.4, fp16_tflops=989.4, fp8_tflops=1978.9,
             tf32_tflops=494.7, fp32_tflops=66.9, fp64_tflops=33.5, sm_count=132, source=_NV_H100),
    Ceilings("H100 PCIe", hbm_tbps=2.0, bf16_tflops=756.5, fp16_tflops=756.5, fp8_tflops=1513.0,
             tf32_tflops=378.0, fp32_tflops=51.2, fp64_tflops=25.6, sm_count=114, source=_NV_H100),
    Ceilings("H100 NVL", hbm_tbps=3.9, bf16_tflops=835.5, fp16_tflops=835.5, fp8_tflops=1670.5,
             tf32_tflops=417.5, fp32_tflops=60.0, fp64_tflops=30.0, sm_count=132, source=_NV_H100),
    Ceilings("H200 SXM", hbm_tbps=4.8, bf16_tflops=989.4, fp16_tflops=989.4, fp8_tflops=1978.9,
             tf32_tflops=494.7, fp32_tflops=66.9, fp64_tflops=33.5, sm_count=132, source=_NV_H200),
    Ceilings("H200 NVL", hbm_tbps=4.8, bf16_tflops=835.5, fp16_tflops=835.5, fp8_tflops=1670.5,
             tf32_tflops=417.5, fp32_tflops=60.0, fp64_tflops=30.0, sm_count=132, source=_NV_H200),
    Ceilings("B200", hbm_tbps=8.0, bf16_tflops=2250.0, fp16_tflops=2250.0, fp8_tflops=4500.0,
             tf32_tflops=1100.0, fp32_tflops=75.0, fp64_tflops=37.0, sm_count=148, source=_NV_B200),
    Ceilings("A100 SXM 40GB", hbm_tbps=1.555, bf16_tflops=312.0, fp16_tflops=312.0, tf32_tflops=156.0,
             fp32_tflops=19.5, fp64_tflops=19.5, sm_count=108, source=_NV_A100),
    Ceilings("A100 SXM 80GB", hbm_tbps=2.039, bf16_tflops=312.0, fp16_tflops=312.0, tf32_tflops=156.0,
             fp32_tflops=19.5, fp64_tflops=19.5, sm_count=108, source=_NV_A100),
    Ceilings("A100 PCIe 40GB", hbm_tbps=1.555, bf16_tflops=312.0, fp16_tflops=312.0, tf32_tflops=156.0,
             fp32_tflops=19.5, fp64_tflops=19.5, sm_count=108, source=_NV_A100),
    Ceilings("A100 PCIe 80GB", hbm_tbps=1.935, bf16_tflops=312.0, fp16_tflops=312.0, tf32_tflops=156.0,
             fp32_tflops=19.5, fp64_tflops=19.5, sm_count=108, source=_NV_A100),
    Ceilings("L40S", hbm_tbps=0.864, bf16_tflops=362.05, fp16_tflops=362.05, fp8_tflops=733.0, tf32_tflops=183.0,
             fp32_tflops=91.6, sm_count=142, source=_NV_L40S),
    # V100: no bf16 / tf32 tensor cores; fp16 tensor-core peak
    Ceilings("V100 SXM2", hbm_tbps=0.9, fp16_tflops=125.0, fp32_tflops=15.7, fp64_tflops=7.8, sm_count=80,
             source=_NV_V100),
    Ceilings("V100 PCIe", hbm_tbps=0.9, fp16_tflops=112.0, fp32_tflops=14.0, fp64_tflops=7.0, sm_count=80,
             source=_NV_V100),
    # MI250X package: 383 TF bf16/fp16, 95.7 fp32 matrix, 47.9 fp32 vector, 3.2768 TB/s, 220 CUs
    Ceilings("MI250X (per GCD)", hbm_tbps=1.6384, bf16_tflops=191.5, fp16_tflops=191.5, fp32_matrix_tflops=47.85,
             fp32_tflops=23.95, fp64_tflops=23.95, sm_count=110, source=_AMD_MI250),
    # MI250 package: 362.1 TF bf16/fp16, 90.5 fp32 matrix, 45.3 fp32 vector, 3.2768 TB/s, 208 CUs
    Ceilings("MI250 (per GCD)", hbm_tbps=1.6384, bf16_tflops=181.05, fp16_tflops=181.05, fp32_matrix_tflops=45.25,
             fp32_tflops=22.65, fp64_tflops=22.65, sm_count=104, source=_AMD_MI250),
    Ceilings("MI300X", hbm_tbps=5.3, bf16_tflops=1307.4, fp16_tflops=1307.4, fp8_tflops=2614.9, tf32_tflops=653.7,
             fp32_matrix_tflops=163.4, fp32_tflops=163.4, fp64_tflops=81.7, sm_count=304, source=_AMD_MI300X),
    Ceilings("MI325X", hbm_tbps=6.0, bf16_tflops=1307.4, fp16_tflops=1307.4, fp8_tflops=2614.9, tf32_tflops=653.7,
             fp32_matrix_tflops=163.4, fp32_tflops=163.4, fp64_tflops=81.7, sm_count=304, source=_AMD_MI325X),
    # MI355X: 2.5 PF fp16/bf16 dense, 5.0 PF fp8 dense, 157.3 TF fp32, 8 TB/s, 256 CUs (no TF32 on CDNA4)
    Ceilings("MI355X", hbm_tbps=8.0, bf16_tflops=2516.6, fp16_tflops=2516.6, fp8_tflops=5033.2,
             fp32_matrix_tflops=157.3, fp32_tflops=157.3, fp64_tflops=78.6, sm_count=256, source=_AMD_MI355X),
)}

_GIB = 1 << 30


def device_key(name: str, props: Mapping[str, Any] | None = None) -> str | None:
    """`DEVICES` key for a device name (torch.cuda.get_device_name, a trace's deviceProperties "name"),
    using SM/CU count and memory size from deviceProperties to tell variants apart when the name does
    not; None when unknown."""
    s = name.lower()
    props = props or {}
    mem = props.get("totalGlobalMem") or 0
    sms = props.get("numSms") or 0
    if "h200" in s:
        return "H200 NVL" if "nvl" in s else "H200 SXM"
    if "h100" in s or "h800" in s:  # H800: an H100 with its NVLink capped (and FP64 cut); the same bf16/HBM roofs
        if "nvl" in s:
            return "H100 NVL"
        if "pcie" in s or sms == 114:
            return "H100 PCIe"
        return "H100 SXM"
    if "b200" in s:
        return "B200"
    if "l40s" in s:
        return "L40S"
    if "a100" in s or "a800" in s:  # A800: an A100 with its NVLink capped; the same roofs
        big = "80gb" in s or mem > 60 * _GIB
        pcie = "pcie" in s
        return f"A100 {'PCIe' if pcie else 'SXM'} {'80GB' if big else '40GB'}"
    if "v100" in s:
        return "V100 PCIe" if "pcie" in s else "V100 SXM2"
    if "mi355" in s:
        return "MI355X"
    if "mi325" in s:
        return "MI325X"
    if "mi300x" in s or re.search(r"mi300(?!a)", s):
        return "MI300X"
    if "mi250x" in s or "mi250" in s:  # "AMD Instinct MI250X / MI250": tell them apart by CU count
        return "MI250 (per GCD)" if sms == 104 else "MI250X (per GCD)"
    if s.startswith("amd") and props:  # ROCm often reports a generic "AMD Radeon Graphics"
        major = props.get("computeMajor")
        if major == 9 and sms == 104:
            return "MI250 (per GCD)"
        if major == 9 and sms == 110:
            return "MI250X (per GCD)"
        if sms == 304:
            return "MI325X" if mem > 200 * _GIB else "MI300X"
        if sms == 256 and mem > 200 * _GIB:
            return "MI355X"
    return None


def lookup(name: str | None, props: Mapping[str, Any] | None = None) -> Ceilings | None:
    """Datasheet ceilings for a device name (as in the trace's deviceProperties), None if unknown."""
    if not name:
        return None
    if name in DEVICES:
        return DEVICES[name]
    key = device_key(name, props)
    return replace(DEVICES[key]) if key else None


# Memory capacity per device (bytes): the datasheet's memory size, per device as torch sees it. torch
# reports a little less (ECC, the CUDA context); the memory projection's `headroom` covers that and the
# allocator's fragmentation. V100 rows are left out (16 and 32 GB boards share a name).
HBM_BYTES: dict[str, int] = {
    "H100 SXM": 80 * 10**9, "H100 PCIe": 80 * 10**9, "H100 NVL": 94 * 10**9, "H200 SXM": 141 * 10**9,
    "H200 NVL": 141 * 10**9, "B200": 180 * 10**9, "A100 SXM 40GB": 40 * 10**9,
    "A100 SXM 80GB": 80 * 10**9, "A100 PCIe 40GB": 40 * 10**9, "A100 PCIe 80GB": 80 * 10**9, "L40S": 48 * 10**9,
    "MI250X (per GCD)": 64 * 10**9, "MI250 (per GCD)": 64 * 10**9, "MI300X": 192 * 10**9, "MI325X": 256 * 10**9,
    "MI355X": 288 * 10**9,
}
# Short names a user types for a device's memory (``tracelens memory --device H100``) -> `DEVICES` key.
MEMORY_ALIASES: dict[str, str] = {
    "H100": "H100 SXM", "H200": "H200 SXM", "A100": "A100 SXM 80GB", "A100 80GB": "A100 SXM 80GB",
    "A100 40GB": "A100 SXM 40GB", "MI250X": "MI250X (per GCD)",
}


def memory_names() -> list[str]:
    """Every name `device_memory` knows, sorted."""
    return sorted({*HBM_BYTES, *MEMORY_ALIASES})


def device_memory(name: str) -> int | None:
    """Memory bytes of a device by name (H100, H200, B200, A100, MI300X...): a table key or short name
    equal to ``name`` or contained in it, the longest first, ignoring case; None when none is."""
    key = name.strip().lower()
    for k in sorted(memory_names(), key=len, reverse=True):
        if k.lower() == key or k.lower() in key:
            return HBM_BYTES[MEMORY_ALIASES.get(k, k)]
    return None


def peak_bf16_flops(device_name: str | None, props: Mapping[str, Any] | None = None) -> float | None:
    """Dense bf16 matrix peak in FLOP/s of a device by name (the denominator of the trainer's MFU), None
    when the device is unknown or has no bf16 tensor cores."""
    c = lookup(device_name, props)
    return c.bf16_tflops * 1e12 if c is not None and c.bf16_tflops else None

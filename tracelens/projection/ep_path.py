"""The EP dispatch path's own kernels: what an expert-parallel step runs beside its all-to-alls and its experts.

A run at ep 1 has none of them; the layout mechanism (`mechanisms.layout`) adds them to a what-if from such a run to
ep > 1, and the scale-out projection (`scaleout`) to a projection from a 1-GPU run. Per MoE layer, micro-batch and
chunk of ``T`` tokens (``R = T * top_k`` routed rows, a buffer of ``B`` rows per chunk, ``D = d_model`` elements of
``e`` activation bytes), the trainer's code (trainer/model/dispatch.py, ``_MoveRows``: ``index_select`` forward, a
gather or a ``new_zeros(...).index_copy_`` backward) runs, by path:

=================  ======================================================  =============================================
where              capacity (unfused; ``B = ep * capacity``)               nccl level 3 (``B = ep * T * min(k, E/ep)``)
=================  ======================================================  =============================================
fwd, send          fill ``B+1`` rows, clone ``B+1`` (copy), index_copy R   fill ``B``, clone ``B``, index_copy R
fwd, receive       regroup gather ``B`` rows                               the same
fwd, return        regroup-back gather ``B``                               the same
fwd, combine       gather ``R`` rows from the buffer, ``where`` on R        gather ``R`` rows
bwd, send          ``where`` R, fill ``B+1``, index_copy_ R                 fill ``B``, index_copy_ R
bwd, receive       the return regroup's backward: gather ``B``             the same
bwd, return        the receive regroup's backward: gather ``B``            the same
bwd, combine       fill ``B+1``, copy ``B`` (the slice), gather ``R``       gather ``R``
=================  ======================================================  =============================================

nccl level 2 trims the received rows (the receive regroup gathers ``R``, the return one scatters them into a zeroed
``B``-row buffer: fill, clone, index_copy; the backward mirrors it); nccl levels 0-1 regroup the routed rows only (a
gather of ``R`` rows each way, and their backward); the fused capacity path builds its send buffer in the permute's
gather (``B`` rows written instead of ``R``) and reads the returned buffer in the unpermute (its backward writes
``B`` rows instead of ``R``), with the four regroup gathers of ``B`` rows; the symm path has none of these kernels
(not added, said so). The small index kernels (slot arithmetic, scans: about 1 ms a step on the 4-GPU capacity runs)
are not added.

**Time.** Two kernel classes, each at a rate the run itself measures:

* vectorized row moves (fill, copy, gather): bytes (writes, plus reads of the rows moved) at the bandwidth of the
  run's own permute gather (``_PermuteFn``, else the ``index_select`` of the token rows: ``[T, D]`` -> ``R`` rows,
  ``2 R D e`` bytes), the one row move every MoE run has;
* PyTorch's generic elementwise kernels (``where`` with a broadcast mask, ``index_copy``: one element per thread, no
  vector loads; ``at::native::elementwise_kernel`` / ``index_elementwise_kernel``): elements (``R x D``) at the
  elements per second of the run's own generic elementwise kernels (``at::native::elementwise_kernel<...>`` of at
  least 2^20 elements: on the 4 x H100 grid's runs the broadcast ``mul`` of the norms' backward, 282 G elements/s on
  the dp 4 run, against 291 and 300 G elements/s of the EP runs' ``index_copy`` and ``where``). Without such a kernel
  the bytes at the row-move bandwidth, stated.

Checked kernel family by kernel family against the 4 x H100 grid's EP runs (docs/whatif.md, "Validation").
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import numpy as np

_GENERIC = re.compile(r"at::native::(?:index_)?elementwise_kernel<")
PASSES = ("send", "recv", "ret", "comb")  # the places in each pass (module docstring's rows)


@dataclass(frozen=True)
class Rates:
    """The run's own measured rates: bytes per ns of its vectorized row move, elements per ns of its generic
    elementwise kernels (None: none in the run), and where each came from."""

    bytes_per_ns: float
    bytes_src: str
    elems_per_ns: float | None
    elems_src: str


@dataclass(frozen=True)
class Kernel:
    name: str  # fill, copy, gather, index_copy, where
    backward: bool
    where: str  # send / recv / ret / comb
    amount: float  # bytes (vectorized) or elements (generic)
    generic: bool  # PyTorch's generic elementwise kernel (elements), else a vectorized row move (bytes)
    elem: int = 2  # bytes per element


def _dims(s) -> list:
    if isinstance(s, list):
        return s
    try:
        d = ast.literal_eval(str(s)) if s else []
    except (ValueError, SyntaxError):
        return []
    return d if isinstance(d, list) else []


def _numel(shape) -> int:
    return int(np.prod(shape)) if isinstance(shape, list) and shape and all(isinstance(x, int) for x in shape) else 0


def measure_rates(profiles: list, elem: int) -> Rates | None:
    """The run's rates (module docstring) over every profiled rank's step, from the units' profiled durations (the
    replay's own time base); None when the run has no permute gather of token rows."""
    nb = nt = 0.0
    ne = ntg = 0.0
    n_perm = n_gen = 0
    for p in profiles:
        w = p.work
        if not len(w):
            continue
        ops = w["op"].astype(str).to_numpy()
        names = w["name"].astype(str).to_numpy()
        dims = w["dims"].to_numpy()
        dur = w["dur"].to_numpy(float)
        stage = w["moe_stage"].astype(str).to_numpy()
        bwd = w["backward"].to_numpy()
        comm = w["is_comm"].to_numpy()
        for j in range(len(w)):
            if comm[j] or dur[j] <= 0:
                continue
            if ops[j] in ("_PermuteFn", "aten::index_select") and not bwd[j] and stage[j] == "moe/permute":
                d = _dims(dims[j])
                if len(d) >= 2 and isinstance(d[0], list) and len(d[0]) == 2 and isinstance(d[1], list) and d[1]:
                    rows, width = int(d[1][0]), int(d[0][1])
                    nb += 2.0 * rows * width * elem
                    nt += dur[j]
                    n_perm += 1
            elif _GENERIC.search(names[j]) and "index_elementwise" not in names[j]:
                n = max((_numel(s) for s in _dims(dims[j]) if isinstance(s, list)), default=0)
                if n >= 1 << 20:
                    ne += n
                    ntg += dur[j]
                    n_gen += 1
    if nt <= 0:
        return None
    bsrc = f"the run's permute gather of token rows ({n_perm} kernels, {nb / nt:,.0f} GB/s profiled)"
    if ntg > 0:
        return Rates(nb / nt, bsrc, ne / ntg, f"the run's generic elementwise kernels ({n_gen} of >= 2^20 elements, "
                                               f"{ne / ntg:,.1f} G elements/s profiled)")
    return Rates(nb / nt, bsrc, None, "no generic elementwise kernel in the run: their bytes at the row-move rate")


def path_name(cfg: dict) -> str:
    """The dispatch path a config runs at ep > 1: capacity, capacity_fused, symm, nccl_l3, nccl_l2, nccl_exact."""
    p = cfg.get("ep_dispatch", "nccl")
    if p == "capacity":
        return "capacity_fused" if cfg.get("ep_capacity_fused") else "capacity"
    if p == "symm":
        return "symm"
    lvl = int(cfg.get("sync_free_level") or 0)
    return "nccl_l3" if lvl >= 3 else "nccl_l2" if lvl == 2 else "nccl_exact"


def kernels(path: str, T: int, R: int, B: int, D: int, e: int) -> list[Kernel]:
    """One chunk's EP path kernels (module docstring's table): ``T`` tokens, ``R`` routed rows, ``B`` buffer rows."""
    row = D * e
    V = lambda name, bwd, where, rows: Kernel(name, bwd, where, float(rows * row), False)
    G = lambda name, bwd, where, rows: Kernel(name, bwd, where, float(rows * D), True, e)
    if path == "capacity":
        return [V("fill", False, "send", B + 1), V("copy", False, "send", 2 * (B + 1)), G("index_copy", False, "send", R),
                V("gather", False, "recv", 2 * B), V("gather", False, "ret", 2 * B),
                V("gather", False, "comb", 2 * R), G("where", False, "comb", R),
                G("where", True, "send", R), V("fill", True, "send", B + 1), G("index_copy", True, "send", R),
                V("gather", True, "recv", 2 * B), V("gather", True, "ret", 2 * B),
                V("fill", True, "comb", B + 1), V("copy", True, "comb", 2 * B), V("gather", True, "comb", 2 * R)]
    if path == "nccl_l3":
        return [V("fill", False, "send", B), V("copy", False, "send", 2 * B), G("index_copy", False, "send", R),
                V("gather", False, "recv", 2 * B), V("gather", False, "ret", 2 * B), V("gather", False, "comb", 2 * R),
                V("fill", True, "send", B), G("index_copy", True, "send", R),
                V("gather", True, "recv", 2 * B), V("gather", True, "ret", 2 * B), V("gather", True, "comb", 2 * R)]
    if path == "nccl_l2":
        return [V("fill", False, "send", B), V("copy", False, "send", 2 * B), G("index_copy", False, "send", R),
                V("gather", False, "recv", 2 * R),
                V("fill", False, "ret", B), V("copy", False, "ret", 2 * B), G("index_copy", False, "ret", R),
                V("gather", False, "comb", 2 * R),
                V("fill", True, "send", B), G("index_copy", True, "send", R), V("gather", True, "recv", 2 * R),
                V("fill", True, "ret", B), G("index_copy", True, "ret", R), V("gather", True, "comb", 2 * R)]
    if path == "nccl_exact":
        return [V("gather", False, "recv", 2 * R), V("gather", False, "ret", 2 * R),
                V("gather", True, "recv", 2 * R), V("gather", True, "ret", 2 * R)]
    if path == "capacity_fused":
        return [V("gather", False, "send", max(B - R, 0)), V("gather", False, "recv", 2 * B),
                V("gather", False, "ret", 2 * B), V("gather", True, "recv", 2 * B), V("gather", True, "ret", 2 * B),
                V("gather", True, "comb", 2 * max(B - R, 0))]
    return []


def seconds(k: Kernel, rates: Rates) -> float:
    """ns of one kernel at the run's rates (module docstring)."""
    if k.generic:
        if rates.elems_per_ns:
            return k.amount / rates.elems_per_ns
        return 2.0 * k.amount * k.elem / rates.bytes_per_ns  # a read and a write of each element
    return k.amount / rates.bytes_per_ns


def layer_ns(path: str, T: int, R: int, B: int, D: int, e: int, chunks: int, rates: Rates) -> tuple[float, float, int]:
    """(forward ns, backward ns, kernels) of one MoE layer's EP path kernels per micro-batch (``chunks`` chunks of
    ``T, R, B`` each)."""
    ks = kernels(path, T, R, B, D, e)
    f = sum(seconds(k, rates) for k in ks if not k.backward) * chunks
    b = sum(seconds(k, rates) for k in ks if k.backward) * chunks
    return f, b, len(ks) * chunks

"""``ep_capacity_fused``: the capacity path's row moves, unfused <-> fused (trainer/model/dispatch.py, "The fused
capacity path"; docs/performance.md, "Where EP 4 loses to DP: the capacity path, kernel by kernel").

Per MoE layer and chunk of ``T`` tokens (``R = T * top_k`` routed rows, a send buffer of ``B = ep * capacity`` rows
of ``D = d_model`` elements), the unfused path moves the rows as follows, each kernel found in the trace by its op
and its shapes (the stage it is attributed to varies between chunks, the shapes do not):

==========  ===========================================================  ======================  ====================
pass        kernel (op, shapes)                                          what it does            fused
==========  ===========================================================  ======================  ====================
forward     ``_PermuteFn`` gather ``[T, D]`` -> ``R`` rows                the rows in expert      one gather ``[T, D]``
                                                                          order (``x_perm``)      -> ``B`` rows (the
                                                                                                  send buffer, padding
                                                                                                  zero): x (R+B)/(2R)
forward     ``fill_ [B+1, D]``, ``copy_ [B+1, D]``, ``index_copy             zero, clone, scatter    gone
            [B+1, D]``                                                    into the send buffer
forward     ``gather [B, D] -> [R, D]``, ``where [R, 1], [R, D]``           returned rows into      gone (the unpermute
                                                                          sorted order, dropped   reads the buffer)
                                                                          rows zeroed
backward    ``where``, ``fill_ [B+1, D]``, ``index_copy_ [B+1, D]``         the same, transposed    gone
backward    ``fill_ [B+1, D]``, ``copy_ [B, D]``; ``gather [B+1, D] ->      the buffer slice's and  gone
            [R, D]``                                                      ``index_copy``'s        
                                                                          gradients               
backward    ``_UnpermuteFnBackward`` ``[T, D]`` -> ``R`` rows (and the      the unpermute's         over the buffer:
            weights' gradient, a dot with the ``R`` expert outputs)       gradient                x (T+2B)/(T+2R)
==========  ===========================================================  ======================  ====================

The sender permute's backward (``_PermuteFnBackward``: ``R`` rows gathered and reduced into ``T``) is the fused
gather's backward too (the same bytes) and stays; so do the receive-side regroups (``[B, D]`` both ways) and the
small index kernels (scans, the capacity rule: microseconds each; the fused path's two maps replace the unfused
slot math).

* **unfused -> fused**: the kernels of the "gone" rows leave, with the host time before their launches; the two
  that change size are scaled by their bytes (bf16 rows: the send gather reads ``R`` and writes ``B`` rows instead
  of ``R`` and ``R``; the unpermute's backward reads ``T`` gradient rows and the ``B``-row buffer and writes ``B``
  instead of ``R`` and ``R``), at their own measured bandwidth.
* **fused -> unfused**: the reverse scalings, and the unfused kernels added per chunk beside the fused gather (the
  forward's), the unpermute (the combine's) and the sender permute's backward (the backward's): each one's bytes at
  the bandwidth of the run's own receive-side regroup gather (``[B, D]`` both ways, on both paths) x that kernel's
  efficiency relative to it, measured kernel by kernel on the unfused ``tests/fixtures/h100_4gpu_layouts/
  ep4_cap_mbs16`` (4 x H100, 12 instances each: :data:`UNFUSED_EFFICIENCY`); one launch each at the host's cost per
  launch when it does not wait (the step's 10th-percentile host gap before a launch).

Memory: the memory projection reads the key (`tracelens.analysis.memory.index_copy_send`, `combine_saved`: the
unfused send buffer's ``index_copy`` keeps the expert-ordered rows, the fused combine the returned buffer; checked on
the trainer's model by benchmarks/activation_census.py). From ``ep4_cap_mbs16`` (unfused, 34.15 GiB measured) the
fused path is predicted at 32.5 GiB against 31.71 measured in another call. A run whose manifest has no
``ep_capacity_fused`` ran the unfused path (the key came with the fused one): ``legacy``.

Measured (docs/performance.md, "The fused capacity path", 4 x H100, one call): unfused 98,117 -> fused 107,029
tokens/s/GPU (+9.1 %); predicted from ``ep4_cap_mbs16`` (unfused, another call): see docs/whatif.md.
"""

from __future__ import annotations

import ast
import math
from typing import ClassVar

import numpy as np

from . import layout as L
from .base import Change, Mechanism, WhatIfError, register

# (kernel, backward) -> its bandwidth (bytes moved / time) over the receive-side regroup gather's in the same trace:
# the medians over the 12 instances (3 layers x 4 ranks) of tests/fixtures/h100_4gpu_layouts/ep4_cap_mbs16 (4 x H100,
# bf16, B = 245,760, R = 196,608, D = 2,048; the regroup gather moved 2 B D x 2 bytes at 2.88 TB/s)
UNFUSED_EFFICIENCY: dict[tuple[str, bool], float] = {
    ("fill", False): 1.11, ("fill", True): 1.11,
    ("copy", False): 1.04, ("copy", True): 1.05,
    ("index_copy", False): 0.40, ("index_copy", True): 0.39,
    ("gather_rows", False): 0.95, ("gather_rows", True): 1.06,
    ("where", False): 0.52, ("where", True): 0.47,
}
_STAGES = ("moe/dispatch", "moe/permute", "moe/combine", "moe/unpermute")


def _dims(s) -> list:
    if isinstance(s, list):
        return s
    try:
        d = ast.literal_eval(s) if s else []
    except (ValueError, SyntaxError):
        return []
    return d if isinstance(d, list) else []


def shapes(cfg: dict, tokens: int) -> tuple[int, int, int, int]:
    """(T, R, B, D) per chunk of a micro-batch of ``tokens``: tokens, routed rows, send-buffer rows, d_model."""
    c = L.chunks(cfg)
    t = tokens // c
    return t, t * int(cfg["top_k"]), int(cfg.get("ep") or 1) * L.capacity_rows(cfg, tokens), int(cfg["d_model"])


def classify(w, T: int, R: int, B: int, D: int, fused: bool) -> dict[str, np.ndarray]:
    """The capacity path's row-move units of a step profile by role (module docstring): ``gone`` (the unfused-only
    kernels, as ``(kind, unit)`` pairs in ``kinds``), ``send`` (the send gather), ``unperm_bwd`` (the unpermute's
    backward), ``ref`` (the receive-side regroup gathers, forward), ``perm_bwd`` (the sender permute's backward),
    ``unperm`` (the unpermute forward). ``fused``: the trace's path (its send gather writes B rows, not R)."""
    stage = w["moe_stage"].to_numpy()
    ok = np.isin(stage, _STAGES) & ~w["is_comm"].to_numpy() & (w["layer"].to_numpy() >= 0)
    ops = w["op"].astype(str).to_numpy()
    bwd = w["backward"].to_numpy()
    out: dict[str, list] = {k: [] for k in ("send", "unperm_bwd", "ref", "perm_bwd", "unperm")}
    kinds: list[tuple[str, int]] = []
    for j in np.flatnonzero(ok):
        d = _dims(w["dims"].iloc[j])
        if not d or not isinstance(d[0], list) or len(d[0]) < 1:
            continue
        d0, op, b = d[0], ops[j], bool(bwd[j])
        d1, d2 = (d[1] if len(d) > 1 else None), (d[2] if len(d) > 2 else None)
        if op == "_PermuteFn" and d0 == [T, D] and d1 == [B if fused else R]:
            out["send"].append(j)
        elif op == "_UnpermuteFnBackward" and d0 == [T, D]:
            out["unperm_bwd"].append(j)
        elif op == "_UnpermuteFn" and not b:
            out["unperm"].append(j)
        elif op == "_PermuteFnBackward":
            out["perm_bwd"].append(j)
        elif op == "aten::gather" and d0 == [B, D] and d2 == [B, D] and not b and stage[j] == "moe/permute":
            out["ref"].append(j)
        elif fused:
            continue
        elif op == "aten::fill_" and d0 == [B + 1, D]:
            kinds.append(("fill", j))
        elif op == "aten::copy_" and d0 in ([B + 1, D], [B, D]) and d1 == d0:
            kinds.append(("copy", j))
        elif op in ("aten::index_copy", "aten::index_copy_") and d0 == [B + 1, D]:
            kinds.append(("index_copy", j))
        elif op == "aten::gather" and d0 in ([B, D], [B + 1, D]) and d2 == [R, D]:
            kinds.append(("gather_rows", j))
        elif op == "aten::where" and d0 == [R, 1] and d1 == [R, D]:
            kinds.append(("where", j))
    res = {k: np.asarray(v, dtype=np.int64) for k, v in out.items()}
    res["gone"] = np.asarray([j for _, j in kinds], dtype=np.int64)
    res["kinds"] = kinds  # type: ignore[assignment]
    return res


def unfused_kernels(T: int, R: int, B: int, D: int, elem: int) -> list[tuple[str, bool, float, str]]:
    """The unfused path's extra kernels per chunk: (kind, backward, bytes moved, where: ``send`` / ``combine`` /
    ``bwd_combine`` / ``bwd_dispatch``) (module docstring's table)."""
    buf, rows = (B + 1) * D * elem, R * D * elem
    return [("fill", False, buf, "send"), ("copy", False, 2 * buf, "send"), ("index_copy", False, 2 * rows, "send"),
            ("gather_rows", False, 2 * rows, "combine"), ("where", False, 2 * rows, "combine"),
            ("where", True, 2 * rows, "bwd_combine"), ("fill", True, buf, "bwd_combine"),
            ("index_copy", True, 2 * rows, "bwd_combine"),
            ("fill", True, buf, "bwd_dispatch"), ("copy", True, 2 * B * D * elem, "bwd_dispatch"),
            ("gather_rows", True, 2 * rows, "bwd_dispatch")]


def send_factor(T: int, R: int, B: int) -> float:
    """Unfused -> fused send gather, by bytes: reads R rows and writes B (fused) over reads R and writes R."""
    return (R + B) / (2 * R)


def unpermute_bwd_factor(T: int, R: int, B: int) -> float:
    """Unfused -> fused unpermute backward, by bytes: reads T gradient rows and the expert outputs (B rows, for the
    weights' gradient), writes B rows, over T, R and R."""
    return (T + 2 * B) / (T + 2 * R)


def is_capacity_ep(cfg: dict, world: int) -> bool:
    try:
        _, ep = L.dims(cfg, world)
    except WhatIfError:
        return False
    return ep > 1 and cfg.get("ep_dispatch", "nccl") == "capacity"


@register
class CapacityFused(Mechanism):
    name = "capacity_fused"
    keys = ("ep_capacity_fused",)
    sigma: ClassVar[dict[str, float]] = {"capacity_fused": 0.20}
    order = 56.5  # after the layout (55: it sizes the receive buffer) and before the overlap (57: it re-cuts the
    # chunks' work, these kernels among it)
    legacy: ClassVar[dict] = {"ep_capacity_fused": False}
    summary = ("the capacity path's row moves found by op and shape: the unfused path's fill, clone, scatter, where "
               "and sorted-order gathers removed or added at their bytes and measured bandwidth, the send gather and "
               "the unpermute's backward scaled by bytes")

    def applies(self, change: Change) -> bool:
        if change.old.get("ep_capacity_fused") == change.target.get("ep_capacity_fused"):
            return False
        world = L.world_of(change.model.manifest)
        return is_capacity_ep(change.old, world) and is_capacity_ep(change.target, world)

    def edit(self, plan, p, change: Change) -> float:
        model, old, new = change.model, change.old, change.new
        to_fused = bool(new.get("ep_capacity_fused"))
        T, R, B, D = shapes(old, change.t0)
        w = p.work
        got = classify(w, T, R, B, D, fused=not to_fused)
        if not len(got["send"]) or not len(got["unperm_bwd"]):
            raise WhatIfError(f"{model.run}: rank {p.rank}'s profiled step does not show the "
                              f"{'unfused' if to_fused else 'fused'} capacity path's row moves (the send gather "
                              f"[{T}, {D}] -> {R if to_fused else B} rows and the unpermute's backward, Triton "
                              "kernels: use_triton_kernels); ep_capacity_fused is predicted from such a trace only")
        pos = L._positions(plan)
        ds = change.device_scale
        lines = []
        fs, fu = send_factor(T, R, B), unpermute_bwd_factor(T, R, B)
        if not to_fused:
            fs, fu = 1.0 / fs, 1.0 / fu
        before = float(sum(plan.dur[j] for j in got["send"]) + sum(plan.dur[j] for j in got["unperm_bwd"]))
        for j in got["send"]:
            plan.dur[j] *= fs
        for j in got["unperm_bwd"]:
            plan.dur[j] *= fu
        after = float(sum(plan.dur[j] for j in got["send"]) + sum(plan.dur[j] for j in got["unperm_bwd"]))
        moved = abs(after - before)
        if to_fused:
            gone = got["gone"]
            dev = float(sum(plan.dur[j] for j in gone))
            host = 0.0
            gone_set = {int(j) for j in gone}
            for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)):
                if kd == 0 and j in gone_set:
                    host += plan.gap[i]
                    plan.gap[i] = 0.0
                    plan.gap_x[i] = 0.0
            for j in gone:
                plan.dur[j] = 0.0
            moved += dev
            by_kind: dict[str, int] = {}
            for k, _ in got["kinds"]:
                by_kind[k] = by_kind.get(k, 0) + 1
            lines.append(f"ep_capacity_fused false -> true: the unfused row moves leave ({', '.join(f'{n} {k}' for k, n in sorted(by_kind.items()))}: "
                         f"{ds * dev / 1e6:.2f} ms of device and {host / 1e6:.2f} ms of the profiled host time); the "
                         f"send gather x{send_factor(T, R, B):.3f} and the unpermute's backward x"
                         f"{unpermute_bwd_factor(T, R, B):.3f} by bytes ({T:,} tokens, {R:,} routed rows, a {B:,}-row "
                         f"buffer per chunk): {ds * before / 1e6:.2f} -> {ds * after / 1e6:.2f} ms")
        else:
            ref = got["ref"]
            if not len(ref):
                raise WhatIfError(f"{model.run}: rank {p.rank}'s profiled step has no receive-side regroup gather "
                                  f"[{B}, {D}] to take the row moves' bandwidth from")
            elem = L.act_bytes(old)
            bw = float(np.median([2 * B * D * elem / max(plan.dur[j], 1.0) for j in ref]))  # bytes per ns
            launch_gaps = [g for kd, g in zip(plan.kind, plan.gap) if kd == 0]
            per_launch = float(np.percentile(launch_gaps, 10)) if launch_gaps else 0.0
            anchors = {"send": sorted(got["send"].tolist(), key=lambda j: pos.get(j, 0)),
                       "combine": sorted(got["unperm"].tolist(), key=lambda j: pos.get(j, 0)),
                       "bwd_combine": sorted(got["unperm_bwd"].tolist(), key=lambda j: pos.get(j, 0)),
                       "bwd_dispatch": sorted(got["perm_bwd"].tolist(), key=lambda j: pos.get(j, 0))}
            ins = []
            added = 0.0
            n_add = 0
            for kind, b, nbytes, where in unfused_kernels(T, R, B, D, elem):
                ns = nbytes / (bw * UNFUSED_EFFICIENCY[(kind, b)])
                for a in anchors[where]:
                    at = pos[a] + (1 if where == "bwd_combine" else 0)
                    ins.append((at, ns, int(plan.stream[a])))
                    added += ns
                    n_add += 1
            comp = "copies/casts" if "copies/casts" in set(plan.comp) else plan.comp[int(got["send"][0])]
            # from the last position back (earlier positions stay valid); at one position, in the path's order
            for _, (at, ns, stream) in sorted(enumerate(ins), key=lambda x: (-x[1][0], -x[0])):
                plan.add_unit(ns, stream, comp, per_launch, at)
            moved += added
            lines.append(f"ep_capacity_fused true -> false: {n_add} unfused row-move kernels added ({ds * added / 1e6:.2f} "
                         f"ms: zero fill, clone and scatter of the send buffer, the sorted-order gathers and where, "
                         f"both passes), each at its bytes over the run's regroup-gather bandwidth "
                         f"({bw:,.0f} GB/s profiled) x its efficiency measured on the unfused ep4_cap_mbs16 fixture, "
                         f"{per_launch / 1e3:.1f} us of host time per launch; the send gather x{fs:.3f} and the "
                         f"unpermute's backward x{fu:.3f} by bytes: {ds * before / 1e6:.2f} -> {ds * after / 1e6:.2f} ms")
        change.modeled.extend(lines)
        if not math.isclose(change.t0, change.t1):
            change.notes.append("ep_capacity_fused: the row moves were found at the run's shapes and scaled with the "
                                "tokens by the token mechanism before this edit")
        return (self.sigma["capacity_fused"] * moved / max(float(p.step_ns), 1.0)) ** 2

"""``loss_fusion`` and ``loss_chunk_size``: the LM head and cross-entropy over the whole micro-batch, or
chunk by chunk under activation checkpointing (``trainer/model/transformer.py``, ``cross_entropy``).

What the trainer runs, per micro-batch of T tokens, vocabulary V, hidden D:

* **unfused**: the logits GEMM ``[T, D] x [D, V]``, their fp32 cast, ``_log_softmax`` and
  ``nll_loss_forward``; backward ``fill_`` / ``nll_loss_backward`` / ``_log_softmax_backward_data``, the
  bf16 cast of the logits' gradient, the dW and dX GEMMs. The fp32 log-probabilities of T x V stay alive
  for the backward.
* **fused** (chunked, ``use_triton_kernels`` off): the same ops on C = ceil(T / chunk) chunks, each under
  ``checkpoint``: the backward first recomputes the chunk's forward (logits GEMM, cast, ``_log_softmax``,
  ``nll_loss_forward``), and the head's weight gradient is accumulated over the chunks (C - 1 bf16 adds of
  V x D). Only one chunk's logits are alive.

The step profile's loss units are the units outside every ``layer/<i>`` range and outside the
optimizer and gradient reduction whose op is a loss op (``_log_softmax``, ``nll_loss_*``, their
backward) or holds a logits-shaped tensor (``[n, V]``, n a token count of the micro-batch or a chunk),
or a GEMM against the vocabulary (the head's forward, dW, dX); the weight-gradient accumulation is a
backward ``add`` / ``add_`` of two ``[V, D]`` tensors. (On the H100 proxy's profiled step at micro-batch
8, C = 8: 143 units, 79.4 ms of the 487 ms step, 25.8 ms of it the recomputation and the adds;
docs/performance.md, "Loss and LM head", breaks down the same kernels at micro-batch 16.) The change, from the units themselves:

* fused -> unfused: the recomputation (backward units identical in op, kernel and shapes to a forward
  loss unit) and the accumulation adds leave; the C chunks of every other loss op merge into one unit
  whose time is their sum (the same FLOPs and bytes over T rows; these kernels last 0.3-1 ms, their fixed
  part is µs), the other C - 1 launches and their host time leave.
* unfused -> fused: each loss op splits into C launches (each with the op's host time); the forward
  loss units run again in the backward (the checkpoint's recomputation), split the same way; C - 1
  accumulation adds of V x D bf16 elements (6 bytes each: read two, write one) at the bandwidth of the
  measured logits cast (6 bytes per T x V element: bf16 <-> fp32; the faster, vectorized fp32 -> bf16 one,
  the kernel family of a bf16 add), i.e. the cast's time x D / T each. On the H100 proxy that gives
  0.409 ms per add against 0.403-0.407 ms measured.
* a new ``loss_chunk_size`` of a fused run: unfused, then fused at the new size.

Peak memory is the memory projection of the new config (``analysis/memory.py`` keeps the unfused
loss's fp32 T x V log-probabilities). Not modeled: the Triton fused loss (``use_triton_kernels`` with
``loss_fusion``: ``kernels.linear_cross_entropy``; refused in one line), the chunk loop's slice-gradient
bookkeeping (a ``[T, D]`` fill and add per chunk, ~0.1 ms each on the H100 proxy: kept as measured), and
CPU traces (their ops nest and their backward is not marked: no change, said so).
"""

from __future__ import annotations

import math
import re

import numpy as np

from .base import Change, Mechanism, WhatIfError, register, unit_positions

LOSS_OPS = ("aten::_log_softmax", "aten::log_softmax", "aten::nll_loss_forward", "aten::nll_loss_backward",
            "aten::_log_softmax_backward_data", "aten::cross_entropy_loss", "aten::nll_loss", "aten::nll_loss_nd")
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm")
_SHAPE_RE = re.compile(r"\[(\d+(?:,\s*\d+)*)\]")


def _fused(cfg: dict) -> bool:
    return bool(cfg.get("loss_fusion"))


def _chunk(cfg: dict) -> int:
    return int(cfg.get("loss_chunk_size") or 1024)


def _shapes(dims) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in m.split(",")) for m in _SHAPE_RE.findall(str(dims or ""))]


def loss_units(w, cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """(loss units, weight-gradient accumulation adds) of a step profile's work table, as boolean masks
    (module docstring)."""
    V, D = int(cfg["vocab_size"]), int(cfg["d_model"])
    t = int(cfg["micro_batch_size"]) * int(cfg["seq_len"])
    ns = {t}
    if _fused(cfg):
        c = min(_chunk(cfg), t)
        ns |= {c, t % c} - {0}
    op = w["op"].to_numpy()
    out = np.zeros(len(w), bool)
    acc = np.zeros(len(w), bool)
    cand = (w["layer"].to_numpy() < 0) & (w["scale"].to_numpy() != "params") & ~w["is_comm"].to_numpy().astype(bool)
    back = w["backward"].to_numpy()
    dims = w["dims"].to_numpy()
    for j in np.flatnonzero(cand):
        sh = _shapes(dims[j])
        if op[j] in LOSS_OPS or any(len(s) == 2 and s[1] == V and s[0] in ns for s in sh):
            out[j] = True
        elif op[j] in GEMM_OPS and any(V in s for s in sh):
            out[j] = True
        elif back[j] and op[j] in ("aten::add", "aten::add_") and sum(s == (V, D) for s in sh) >= 2:
            out[j] = acc[j] = True
    return out, acc


def _signature(w, j: int) -> tuple:
    return str(w["op"].iat[j]), str(w["name"].iat[j]), str(w["dims"].iat[j])


def _calls(plan, w, mask: np.ndarray) -> list[tuple[bool, list[int]]]:
    """The loss calls of the step: ``mask``'s units in host order, cut where a unit of a layer runs between
    two of them or the direction (forward, backward) changes: (backward, units) per call. A pipeline stage
    runs one call per micro-batch and direction."""
    layer = w["layer"].to_numpy()
    back = w["backward"].to_numpy()
    out: list[tuple[bool, list[int]]] = []
    cut = True
    for kd, j in zip(plan.kind, plan.ref):
        if kd != 0:
            continue
        if j < len(w) and mask[j]:
            if cut or out[-1][0] != bool(back[j]):
                out.append((bool(back[j]), []))
            out[-1][1].append(int(j))
            cut = False
        elif j < len(w) and layer[j] >= 0:
            cut = True
    return out


def _unfuse(plan, w, loss: np.ndarray, acc: np.ndarray) -> tuple[float, int]:
    """Fused -> unfused on ``plan`` (module docstring). Returns (device ns removed, launches removed)."""
    pos = unit_positions(plan)
    back = w["backward"].to_numpy()
    fwd_sig = {_signature(w, int(j)) for j in np.flatnonzero(loss & ~back)}
    recompute = [int(j) for j in np.flatnonzero(loss & back & ~acc) if _signature(w, int(j)) in fwd_sig]
    gone = set(recompute) | {int(j) for j in np.flatnonzero(acc)}
    removed = sum(plan.dur[j] for j in gone if j in pos)
    drop = {pos[j] for j in gone if j in pos}
    for _bw, units in _calls(plan, w, loss):
        groups: dict[tuple, list[int]] = {}
        for j in units:
            if j not in gone:
                groups.setdefault((str(w["op"].iat[j]), str(w["name"].iat[j])), []).append(j)
        for js in groups.values():
            plan.dur[js[0]] = float(sum(plan.dur[j] for j in js))
            drop |= {pos[j] for j in js[1:]}
    plan.drop_items(drop)
    return float(removed), len(drop)


def _fuse(plan, w, loss: np.ndarray, n_chunks: int, per_add: float | None) -> tuple[float, int]:
    """Unfused -> fused with ``n_chunks`` chunks on ``plan`` (module docstring; ``per_add``: ns of one
    weight-gradient accumulation add, None: not added). Returns (device ns added, launches added)."""
    pos = unit_positions(plan)
    calls = _calls(plan, w, loss)
    n0 = len(plan.kind)
    added = 0.0
    # (position, rank, ns, stream, component, host gap): at one position, the chunk launches of the op before
    # it (rank 0), then the recomputation (1), then the accumulation adds (2)
    inserts: list[tuple[int, int, float, int, str, float]] = []
    # every loss op runs once per chunk: C launches of 1/C of its work, each with the op's host time
    for _bw, units in calls:
        for j in units:
            plan.dur[j] = float(plan.dur[j]) / n_chunks
            inserts += [(pos[j] + 1, 0, plan.dur[j], int(plan.stream[j]), str(plan.comp[j]),
                         float(plan.gap[pos[j]]))] * (n_chunks - 1)
    for k, (bw, fwd) in enumerate(calls):
        if bw:
            continue
        bwd = next((units for b2, units in calls[k + 1:] if b2), None)
        if bwd is None:
            continue
        # the checkpoint's recomputation: this call's forward loss units again where its backward starts
        at = pos[bwd[0]]
        for _ in range(n_chunks):
            for j in fwd:
                inserts.append((at, 1, plan.dur[j], int(plan.stream[j]), str(plan.comp[j]), float(plan.gap[pos[j]])))
                added += plan.dur[j]
        if per_add is not None and n_chunks > 1:
            # the head's weight gradient accumulated over the chunks, after the call's backward
            inserts += [(pos[bwd[-1]] + 1, 2, per_add, int(plan.stream[bwd[-1]]), "norms/activations", 0.0)] * (
                n_chunks - 1)
            added += per_add * (n_chunks - 1)
    # from the back, so positions hold; at one position the last to go in ends up first
    order = sorted(range(len(inserts)), key=lambda i: (-inserts[i][0], -inserts[i][1], -i))
    for i in order:
        at, _r, ns, stream, comp, gap = inserts[i]
        plan.add_unit(ns, stream, comp, gap, at)
    return added, len(plan.kind) - n0


@register
class LossFusion(Mechanism):
    name = "loss_fusion"
    keys = ("loss_fusion", "loss_chunk_size")
    sigma = {"loss": 0.15, "loss_bytes": 0.30}
    order = 25.0  # after the token scaling (it merges and splits token-scaled chunks)
    summary = ("the chunked loss's checkpoint recomputation and weight-gradient accumulation removed (or added, the "
               "adds by bytes at the measured cast's bandwidth) and its chunks merged (or split); memory from the "
               "projection")

    def applies(self, change: Change) -> bool:
        old, new = change.old, change.new
        return _fused(old) != _fused(new) or (_fused(new) and _chunk(old) != _chunk(new))

    def edit(self, plan, p, change: Change) -> float:
        old, new = change.old, change.new
        for cfg in (old, new):
            if _fused(cfg) and cfg.get("use_triton_kernels") and p.device == "gpu":
                raise WhatIfError("loss_fusion with use_triton_kernels: the Triton fused loss "
                                  "(kernels.linear_cross_entropy) has no what-if mechanism yet")
        f0, f1 = _fused(old), _fused(new)
        what = (f"loss_fusion {str(f0).lower()} -> {str(f1).lower()}" if f0 != f1
                else f"loss_chunk_size {_chunk(old)} -> {_chunk(new)}")
        if p.device != "gpu":
            change.modeled.append(f"{what}: no model on a CPU trace (its ops nest and their backward is not marked)")
            return 0.0
        w = p.work
        loss, acc = loss_units(w, old)
        if not loss.any():
            change.notes.append(f"{what}: rank {p.rank}: no loss units (cross-entropy ops or logits-shaped units outside "
                                "the layers) in its profiled step (the loss runs on another pipeline stage, or the "
                                "trace misses it): that rank's step kept")
            return 0.0
        t1 = change.t1
        V, D = int(old["vocab_size"]), int(old["d_model"])
        # the measured logits casts (bf16 <-> fp32, 6 bytes per element of their [n, V]): an accumulation add
        # moves 6 bytes per element of [V, D], so it lasts a cast's time x D / n; at the fastest cast's rate
        # (the vectorized fp32 -> bf16 one, the kernel family of a bf16 add; bf16 -> fp32 runs unrolled, slower)
        rates = [float(w["dur"].iat[int(j)]) * D / s[0] for j in np.flatnonzero(loss & ~acc)
                 if w["op"].iat[int(j)] == "aten::copy_" for s in _shapes(w["dims"].iat[int(j)])[:1]
                 if len(s) == 2 and s[1] == V]
        per_add = float(min(rates)) if rates else None
        dev0 = float(sum(plan.dur[j] for kd, j in zip(plan.kind, plan.ref) if kd == 0))
        host0 = float(sum(plan.gap))
        parts = []
        byte_ns = moved = 0.0  # device ns modeled by bytes, and taken from measured units
        if f0:
            removed, gone = _unfuse(plan, w, loss, acc)
            moved += removed
            parts.append(f"the chunked loss's recomputation and weight-gradient adds removed ({removed / 1e6:.2f} ms), "
                         f"its chunks merged ({gone} launches less)")
            loss = loss & ~acc & np.isin(np.arange(len(w)), list(unit_positions(plan)))  # one unit per loss op left
        if f1:
            n_chunks = math.ceil(t1 / _chunk(new))
            added, more = _fuse(plan, w, loss, n_chunks, per_add)
            adds = per_add is not None and n_chunks > 1
            byte_ns = per_add * (n_chunks - 1) if adds else 0.0
            moved += added - byte_ns
            parts.append(f"{n_chunks} chunk(s) of {min(_chunk(new), t1)} tokens ({more} launches more), the forward loss "
                         f"units recomputed in the backward ({(added - byte_ns) / 1e6:.2f} ms)"
                         + (f", {n_chunks - 1} weight-gradient adds of {per_add / 1e6:.3f} ms (bytes at the measured "
                            "logits cast's bandwidth)" if adds else "")
                         + ("" if adds or n_chunks == 1 else
                            ", the weight-gradient adds not modeled (no logits cast measured)"))
        dev1 = float(sum(plan.dur[j] for kd, j in zip(plan.kind, plan.ref) if kd == 0))
        host1 = float(sum(plan.gap))
        gib = 4.0 * t1 * int(new["vocab_size"]) / float(1 << 30)
        change.modeled.append(f"{what}: " + "; ".join(parts)
                              + f": loss device time {(dev1 - dev0) / 1e6:+.2f} ms, host {(host1 - host0) / 1e6:+.2f} ms "
                              f"(profiled); peak memory from the projection (the unfused loss keeps the fp32 "
                              f"log-probabilities: {gib:.2f} GiB per micro-batch)")
        step = max(float(p.step_ns), 1.0)
        moved += abs(host1 - host0)
        return (self.sigma["loss"] * moved / step) ** 2 + (self.sigma["loss_bytes"] * byte_ns / step) ** 2

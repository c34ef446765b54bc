"""``ep_overlap``, ``ep_overlap_chunks`` at ep > 1: the token all-to-alls in another number of chunks.

What the trainer does (trainer/model/moe.py ``_ep_forward``, trainer/model/dispatch.py): the tokens of a MoE
layer are cut into ``C`` chunks (``C = ep_overlap_chunks`` with ``ep_overlap``, else 1). Every chunk's rows are
sent (all-to-all on NCCL's stream) before any expert runs, and the shared expert computes while they travel;
then, chunk by chunk, the compute stream waits for the chunk's rows, regroups them, runs the experts on them and
sends the outputs back (all-to-all), so chunk ``c``'s return trip runs while chunk ``c+1``'s experts compute.
The backward mirrors it (the outputs' gradients travel first, the rows' gradients second). With ``C = 1`` only
the dispatch hides (under the shared expert); the return trip is exposed.

The edit, per MoE layer, pass and rank, on the run's own replay program (the chunked structure is rebuilt, so
what hides under what is decided by the replay: never more than the compute that runs beside it):

* the run's ``2 C`` token all-to-alls of the pass are found in launch order (first leg: the dispatch forward, the
  combine's gradient backward; second leg: the other), and each chunk's **expert work** (the compute-stream units of
  the regroup, expert and combine stages launched between them);
* they are replaced by ``C'`` chunks: each leg's all-to-alls at ``1/C'`` of the bytes, each at the run's own
  transfer time per all-to-all x the ratio of the run's measured bus time at the new and the old message size
  (`layout.Bandwidth`: the run's all-to-alls at the nearest size); each chunk's expert work at ``1/C'`` of the
  total, its grouped GEMMs x the **per-chunk efficiency**: the time per row of the grouped GEMM at the new chunk's
  rows over the one at the run's, from the kernel table (``--kernel-table``: the tuner's measured grouped-GEMM
  times, at the same rows per expert) or, without one, linear in rows (no loss; said so);
* each new chunk's expert work waits for its first-leg all-to-all, its second-leg all-to-all waits for its expert
  work; the run's own units stay in place at zero length, so what waited on them (the shared expert, the
  unpermute) still waits for the last chunk;
* **the chunk loop's host time**: the trainer runs the dispatch, permute, expert, combine and unpermute code once per
  chunk, so their launches repeat per chunk and so does the host's work between them. Forward: the host gaps
  before those launches x ``C'/C`` (measured on the 4 x H100 grid's five pairs without / with 2 chunks, ep 2 and 4,
  micro-batch 8, 16, 24: launches x2.04, forward gap sums x1.81-2.5, the mean gap per launch 70-100 us either
  way). Backward: each added (or removed) launch at the backward loop's median gap: its sums grew only x1.36-1.95
  for x2.1 the launches, its mean gap per launch fell (242 -> 179 us at ep 2 micro-batch 8), its median stayed
  (78-134 us): the larger backward gaps are the autograd engine's waits, once per layer, not per chunk.
* **FSDP2's gathers of the experts, once per chunk** (at dp > 1 on both sides): the trainer wraps each layer's
  experts in their own ``fully_shard`` unit (trainer/parallel/dist.py) and calls them once per chunk; FSDP2 gathers
  a unit at every call and reshards after it. So each chunk loop holds one all-gather per chunk's call (a
  backward's first may be prefetched before the loop): the run's gathers inside the loop leave, and as many as the
  new chunks call for are inserted on the run's all-gather stream before their chunks' expert work, each at the
  loop's own gather time plus the run's copy-in per gather, with its copy-out on the compute stream before the
  chunk's GEMMs and FSDP2's hook host time (`fsdp_overlap.HOOK_HOST_NS`). Counted on the 4 x H100 grid's raw
  traces: 15 -> 21 all-gathers in a step at ep 2 x dp 2 with 2 chunks, none added at ep 4
  (tests/tracelens/test_overlap_chunk_costs.py).

``ep_overlap_schedule`` (the shared expert split over both ends of the chunk chain) is not modeled: a change of it
is refused by the what-if's rule for keys without a mechanism, and a change of the chunks where the run or the
target is ``pipelined`` is refused here, in one line.

Not modeled (said in the prediction): the slower half-size kernels and the SM contention of an all-to-all with the compute it overlaps (a grouped
GEMM running beside NCCL was 1.9x slower on the ep4_cap_ovl fixture), the per-call weight copies of the grouped
GEMMs (split with the rows), overlap changes from or to a run without EP (the layout mechanism inserts or drops
the all-to-alls there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import layout as L
from .base import Change, Mechanism, WhatIfError, register

OVERLAP_KEYS = ("ep_overlap", "ep_overlap_chunks")
_MIDDLE = ("moe/permute", "moe/experts", "moe/combine")
# the stages whose code the trainer runs once per chunk (trainer/model/moe.py _ep_forward)
_LOOP = ("moe/dispatch", "moe/permute", "moe/experts", "moe/combine", "moe/unpermute")


def chunks_of(cfg: dict) -> int:
    """Dispatch chunks of a config (trainer/model/moe.py): ``ep_overlap_chunks`` with ``ep_overlap``, else 1."""
    return L.chunks(cfg)


def changes_chunks(change: Change) -> bool:
    """Whether a what-if changes the number of dispatch chunks with EP on both sides."""
    old, new = change.old, change.target
    world = int((getattr(change.model, "manifest", None) or {}).get("world_size") or 1)
    if world < 2:
        return False
    try:
        _, ep0 = L.dims(old, world)
        _, ep1 = L.dims(new, world)
    except WhatIfError:
        return False
    return ep0 > 1 and ep1 > 1 and chunks_of(old) != chunks_of(new)


def gemm_time_per_row(table, cfg: dict, rows: float, pass_: str) -> float | None:
    """ns per row of the run's grouped GEMM (gate/up, ``d_model -> 2 moe_d_ff``) over the rank's local experts at
    ``rows`` rows, from the kernel table at the same rows per expert; None without a matching entry."""
    if table is None or rows <= 0:
        return None
    ep = int(cfg.get("ep") or 1)
    el = int(cfg["n_routed_experts"]) // ep
    k = int(cfg["top_k"])
    K, N = int(cfg["d_model"]), 2 * int(cfg["moe_d_ff"])
    backend = str(cfg.get("grouped_gemm_backend") or "torch")
    per_expert = rows / el
    for (p, kk, nn, e_tab, b) in sorted(table._pts):
        if (p, kk, nn, b) != (pass_, K, N, backend):
            continue
        t_eq = per_expert * e_tab / k  # tokens of the table's run with as many rows per expert
        ms = table.ms(pass_, max(round(t_eq), 1), K, N, e_tab, backend)
        if ms:
            return ms * 1e6 / (t_eq * k)
    return None


def chunk_efficiency(model, cfg: dict, rows: float, c0: int, c1: int) -> tuple[float, str]:
    """(grouped-GEMM time factor going from ``c0`` to ``c1`` chunks of ``rows`` rows, its source)."""
    tpr0 = gemm_time_per_row(getattr(model, "table", None), cfg, rows / c0, "fwd")
    tpr1 = gemm_time_per_row(getattr(model, "table", None), cfg, rows / c1, "fwd")
    if tpr0 and tpr1:
        return tpr1 / tpr0, (f"kernel table ({model.table.source}): {tpr0:.1f} -> {tpr1:.1f} ns per row at "
                             f"{rows / c0:,.0f} -> {rows / c1:,.0f} rows per chunk")
    return 1.0, "linear in rows (no kernel table with the run's grouped GEMM: no per-chunk efficiency loss modeled)"


def _blocks(w, a2a: np.ndarray):
    """Per (layer, backward): the token all-to-all units in launch order (the work is in launch order)."""
    out: dict[tuple[int, bool], list[int]] = {}
    lay = w["layer"].to_numpy()
    bwd = w["backward"].to_numpy()
    rec = w["recompute"].to_numpy() if "recompute" in w else np.zeros(len(w), bool)
    for j in sorted(int(x) for x in a2a):
        if rec[j]:
            continue
        out.setdefault((int(lay[j]), bool(bwd[j])), []).append(j)
    return out


def _middles(w, layer: int, backward: bool, leg1: list[int], leg2: list[int]) -> list[np.ndarray]:
    """Per chunk of the run: its expert work (regroup, experts, combine; compute stream, not FSDP), launched
    after the first leg's last all-to-all (chunk 0) or the previous chunk's second-leg all-to-all, and before
    its own second-leg all-to-all."""
    n = len(w)
    idx = np.arange(n)
    m = ((w["layer"].to_numpy() == layer) & (w["backward"].to_numpy() == backward)
         & np.isin(w["moe_stage"].to_numpy(), _MIDDLE) & ~w["is_comm"].to_numpy())
    if "recompute" in w:
        m &= ~w["recompute"].to_numpy()
    m &= np.array(["FSDP" not in s for s in w["path"].astype(str).to_numpy()], dtype=bool)
    out, lo = [], leg1[-1]
    for hi in leg2:
        out.append(idx[m & (idx > lo) & (idx < hi)])
        lo = hi
    return out


@dataclass
class _Regather:
    """The experts' FSDP all-gathers of a run at dp > 1 (module docstring: FSDP2 gathers the experts once per call,
    the trainer calls them once per chunk): the run's gather units, their mean time, the copy-in / copy-out kernels
    per gather (the run's `layout.fsdp_expert_copies` over its gathers) and the hooks' host time per gather."""

    units: list  # (plan position, unit index) of the run's experts' all-gathers, in host order
    mean: float
    copy_in: float
    copy_out: float
    stream: int
    hook: float
    replaced: int = 0

    @classmethod
    def of(cls, plan, w, comm, old: dict, target: dict, world: int, pos: dict) -> _Regather | None:
        from ..fsdp_overlap import HOOK_HOST_NS

        ag0, rs0, n0 = L.fsdp_expert_bytes(old, world)
        if n0 <= 1 or L.fsdp_expert_bytes(target, world)[2] <= 1:
            return None
        u_ag = [int(j) for j in L._fsdp_expert_units(comm, ag0, rs0)[0] if int(j) in pos]
        if not u_ag:
            return None
        copies = L.fsdp_expert_copies(w)
        per = 1.0 / len(u_ag)
        return cls(sorted((pos[j], j) for j in u_ag), float(np.mean([plan.dur[j] for j in u_ag])),
                   per * float(sum(plan.dur[int(j)] for j in copies["aten::_foreach_copy_"])),
                   per * float(sum(plan.dur[int(j)] for j in copies["aten::split_with_sizes_copy"])),
                   int(plan.stream[u_ag[0]]), HOOK_HOST_NS)

    def block(self, plan, lo: int, hi: int, c0: int, c1: int) -> tuple[int, float]:
        """One chunk loop (plan positions ``lo``..``hi``): the run's gathers inside it (one per chunk's call; a
        backward's first may have been prefetched before it) leave, and as many as the new chunks call for are
        returned to be inserted: (how many, ns each)."""
        inside = [j for p, j in self.units if lo <= p <= hi]
        n_new = min(max(len(inside) + c1 - c0, 0), c1)
        ns = float(np.mean([plan.dur[j] for j in inside])) if inside else self.mean
        for j in inside:
            plan.dur[j] = 0.0
        self.replaced += len(inside)
        return n_new, ns


def _loop_items(w, plan, pos: dict) -> dict[tuple[int, bool], list[int]]:
    """Per (layer, backward): the plan positions of the chunk loop's launches (`_LOOP` stages; not recomputation,
    not FSDP's), whose host gaps the loop repeats per chunk."""
    m = np.isin(w["moe_stage"].to_numpy(), _LOOP)
    if "recompute" in w:
        m &= ~w["recompute"].to_numpy().astype(bool)
    m &= np.array(["FSDP" not in s for s in w["path"].astype(str).to_numpy()], dtype=bool)
    lay, bwd = w["layer"].to_numpy(), w["backward"].to_numpy()
    out: dict[tuple[int, bool], list[int]] = {}
    for j in np.flatnonzero(m).tolist():
        if j in pos:
            out.setdefault((int(lay[j]), bool(bwd[j])), []).append(pos[j])
    return out


def _rescale_loop_host(plan, its: list[int], backward: bool, c0: int, c1: int) -> float:
    """The host time of one layer's chunk loop (plan positions ``its``) going from ``c0`` to ``c1`` chunks (module
    docstring): forward gaps x c1/c0; backward ``(c1/c0 - 1) x launches x median gap``, spread over its gaps in
    proportion. Returns the host time added (ns, negative when removed)."""
    gaps = np.array([plan.gap[i] for i in its], dtype=np.float64)
    g_sum = float(gaps.sum())
    if not len(its) or g_sum <= 0:
        return 0.0
    added = (c1 / c0 - 1.0) * (g_sum if not backward else len(its) * float(np.median(gaps)))
    f = max(g_sum + added, 0.0) / g_sum
    for i in its:
        plan.gap[i] *= f
        plan.gap_x[i] *= f
    return g_sum * f - g_sum


@register
class Overlap(Mechanism):
    name = "overlap"
    keys = OVERLAP_KEYS
    sigma: ClassVar[dict[str, float]] = {"overlap": 0.25}
    order = 57.0  # after the layout (55): on its all-to-all sizes and expert rows
    summary = ("the run's chunked token all-to-alls and expert work rebuilt in the new number of chunks (each chunk's "
               "experts wait for its rows, its return trip for its experts), at the run's measured bus time per size and "
               "the grouped GEMM's time per row at the new chunk rows")

    def applies(self, change: Change) -> bool:
        return changes_chunks(change)

    def edit(self, plan, p, change: Change) -> float:
        model, old, target = change.model, change.old, change.target
        if "pipelined" in (old.get("ep_overlap_schedule"), target.get("ep_overlap_schedule")):
            raise WhatIfError("ep_overlap / ep_overlap_chunks with ep_overlap_schedule=pipelined: the overlap mechanism "
                              "rebuilds the chunked schedule only (the shared expert before the chunks); measure it instead "
                              "(benchmarks/bench_ep.sh, ep4_cap_pipe* rows)")
        b = model.measured.get("layout")
        if b is None:
            raise WhatIfError(f"{model.run}: ep_overlap needs a multi-GPU run with its collectives")
        c0, c1 = chunks_of(old), chunks_of(target)
        world = b.world
        _, ep1 = L.dims(target, world)
        pi = next(i for i, q in enumerate(model.profiles) if q is p)
        comm = b.comm[pi]
        w = p.work
        blocks = _blocks(w, L._a2a_units(w, comm))
        if not blocks:
            raise WhatIfError(f"{model.run}: rank {p.rank}'s profiled step has no token all-to-all to re-chunk")
        pos = L._positions(plan)
        rows = float(change.t1 * int(target["top_k"]))  # rows a rank's experts compute per layer and micro-batch
        eff, eff_src = chunk_efficiency(model, target, rows, c0, c1)
        inserts = []  # (position, dur, stream, comp, dep unit or None, tag)
        loop_items = _loop_items(w, plan, pos)
        rg = _Regather.of(plan, w, comm, old, target, world, pos)
        host_moved = 0.0
        moved = 0.0
        exposed_note = 0
        regathers = 0
        for (ly, bwd), units in sorted(blocks.items()):
            if len(units) % (2 * c0):
                raise WhatIfError(f"{model.run}: rank {p.rank}'s layer {ly} {'backward' if bwd else 'forward'} has "
                                  f"{len(units)} token all-to-alls, not a multiple of 2 x {c0} chunks: the run's "
                                  "chunking is not what its config says")
            for m in range(len(units) // (2 * c0)):  # one block per micro-batch
                us = units[m * 2 * c0:(m + 1) * 2 * c0]
                leg1, leg2 = us[:c0], us[c0:]
                mids = _middles(w, ly, bwd, leg1, leg2)
                if any(not len(x) for x in mids):
                    raise WhatIfError(f"{model.run}: rank {p.rank}'s layer {ly}: a chunk without expert work between "
                                      "its all-to-alls (the trace does not show the chunked dispatch)")
                allm = np.concatenate(mids)
                comps_of = dict(zip(allm.tolist(), w["component"].to_numpy()[allm].tolist()))
                gemm = allm[w["component"].to_numpy()[allm] == "expert GEMMs"]
                rest = allm[w["component"].to_numpy()[allm] != "expert GEMMs"]
                g_tot = float(sum(plan.dur[j] for j in gemm))
                r_tot = float(sum(plan.dur[j] for j in rest))
                g_new, r_new = g_tot * eff / c1, r_tot / c1
                comps = w["component"].to_numpy()[rest]
                r_comp = max(set(comps), key=lambda c: float(sum(plan.dur[j] for j in rest if comps_of[j] == c))) \
                    if len(rest) else "norms/activations"
                streams = [plan.stream[j] for j in allm]
                cstream = max(set(streams), key=streams.count)
                # the legs: per all-to-all, the run's transfer x (bus time at the new size / at the old size)
                leg_new = []
                for leg in (leg1, leg2):
                    by = float(sum(float(comm.at[j, "bytes"]) for j in leg))
                    t_old = sum(b.bw.seconds("all_to_all", ep1, float(comm.at[j, "bytes"]))[0] for j in leg)
                    t_new = c1 * b.bw.seconds("all_to_all", ep1, by / c1)[0]
                    run = float(sum(plan.dur[j] for j in leg))
                    leg_new.append((run * t_new / t_old if t_old > 0 else run) / c1)
                a_stream = plan.stream[leg1[0]]
                old_total = g_tot + r_tot + sum(plan.dur[j] for j in leg1 + leg2)
                # the run's units stay as ordering points, at zero length
                for j in list(leg1) + list(leg2) + allm.tolist():
                    plan.dur[j] = 0.0
                for jn in range(c1):
                    src = leg1[min(c0 - 1, math.ceil((jn + 1) * c0 / c1) - 1)]
                    inserts.append((pos[src], leg_new[0], a_stream, "exposed communication", ("dep_of", src),
                                    ("l1", ly, bwd, m, jn)))
                first_mid = min(pos[int(j)] for j in allm)
                # FSDP2 gathers the experts once per call, the trainer calls them once per chunk (module docstring)
                gathered = rg.block(plan, pos[leg1[0]], pos[leg2[-1]], c0, c1) if rg is not None else (0, 0.0)
                for jn in range(c1):  # per chunk: its regroup / combine work, its GEMMs, its return trip
                    if jn >= c1 - gathered[0]:
                        ag = ("ag", ly, bwd, m, jn)
                        inserts.append((first_mid, gathered[1] + rg.copy_in, rg.stream, "exposed communication",
                                        None, ag, rg.hook))
                        inserts.append((first_mid, rg.copy_out, cstream, "copies/casts", ("tag", ag),
                                        ("co", ly, bwd, m, jn)))
                        regathers += 1
                    inserts.append((first_mid, r_new, cstream, r_comp, ("tag", ("l1", ly, bwd, m, jn)),
                                    ("rest", ly, bwd, m, jn)))
                    inserts.append((first_mid, g_new, cstream, "expert GEMMs", None, ("mid", ly, bwd, m, jn)))
                    inserts.append((first_mid, leg_new[1], a_stream, "exposed communication",
                                    ("tag", ("mid", ly, bwd, m, jn)), ("l2", ly, bwd, m, jn)))
                moved += abs(c1 * (g_new + r_new + leg_new[0] + leg_new[1]) - old_total)
                exposed_note += 1
        for (ly, bwd), its in loop_items.items():  # the chunk loop's host time (module docstring)
            if (ly, bwd) in blocks:
                host_moved += _rescale_loop_host(plan, its, bwd, c0, c1)
        # insert: at one position the new units keep their order (l1s before their run's unit; mids and l2s
        # interleaved); from the last position back so that earlier positions stay valid
        by_pos: dict[int, list] = {}
        for it in inserts:
            by_pos.setdefault(it[0], []).append(it)
        tags: dict[tuple, int] = {}
        deps: list[tuple[int, tuple]] = []
        for at in sorted(by_pos, reverse=True):
            for _, ns, stream, comp, dep, tag, *gap in reversed(by_pos[at]):
                j = plan.add_unit(ns, stream, comp, gap[0] if gap else 0.0, at)
                tags[tag] = j
                deps.append((j, dep))
        for j, dep in deps:
            if dep is not None:
                how, what = dep
                plan.dep[j] = plan.dep[what] if how == "dep_of" else tags[what]
        # what the inserted units stand for, for FSDP2's placement after this edit (`fsdp_overlap`, the scale-out):
        # each chunk's expert GEMMs are a call of the layer's experts unit, the re-gathers FSDP collectives
        for tag, j in tags.items():
            if tag[0] == "mid":
                plan.unit_keys[j] = ("call", ("experts", tag[1]), tag[4], tag[2])
            elif tag[0] == "ag":
                plan.unit_keys[j] = ("fsdp",)
        ds = change.device_scale
        change.modeled.append(
            f"EP dispatch chunks {c0} -> {c1} at ep {ep1}: {exposed_note} MoE blocks (layer x pass x micro-batch) "
            f"rebuilt with {c1} chunk(s) of all-to-alls and expert work (each chunk's experts wait for its rows, its "
            f"return trip for its experts; what hides is what the replay overlaps); all-to-alls at the run's transfer "
            f"time x the bus time at the new size; grouped GEMMs x{eff:.3f} per row: {eff_src}; {ds * moved / 1e6:.2f} "
            f"ms of device work re-cut; host {host_moved / 1e6:+.2f} ms (profiled) for the chunk loop's launches "
            f"(dispatch to unpermute, once per chunk: the forward's gaps x{c1 / c0:.2f}, the backward's added launches "
            f"at its median gap)"
            + (f"; FSDP2's gathers of the experts once per chunk: {regathers} in place of the run's {rg.replaced} in "
               f"the chunk loops, {rg.mean / 1e6:.2f} ms each (+ copy-in {rg.copy_in / 1e6:.2f}, copy-out "
               f"{rg.copy_out / 1e6:.2f} ms) and {rg.hook / 1e6:.2f} ms of the hooks' host time" if rg is not None else ""))
        change.notes.append("ep_overlap: the slowdown of compute overlapped by an all-to-all (SM contention with NCCL) "
                            "is not modeled: the run's measured times are kept as they were, overlapped or not")
        return (self.sigma["overlap"] * moved / max(float(p.step_ns), 1.0)) ** 2

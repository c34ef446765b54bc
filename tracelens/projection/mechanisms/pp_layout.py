"""``pp``: another number of pipeline ranks on the run's GPUs (the data parallelism follows: ``dp = W / (pp ep)``).

Built on the pipeline what-if (``pipeline_whatif.py``: its schedule replay, layout rules and piece costs); the other
knobs of the same what-if are replayed on the run's own layout first (this mechanism holds ``pp``, the micro-batch
count and the pipeline knobs there) and their ratio to the base step scales what follows. From one profiled run:

* **Piece costs** (ns per micro-batch, forward and full backward, per piece ``embedding``, ``layer<i>``, ``loss``):
  from a pipelined run, the pipeline what-if's (each stage's measured mean action time over the steady steps,
  split over its pieces by the FLOP model); from a run without a pipeline, the slowest rank's replay of the changed
  config at the run's pp (`piece_costs_from_replay`: every unit edit applied): each layer's device work and the
  host's launch time before its units (forward and backward; recomputation goes with the backward), the
  token-shaped work outside the layers and the chunked loss as the ``loss`` piece, divided by the run's
  micro-batches (the embedding lookup is in that piece: the FLOP model gives it no cost). Before, these were the
  run's per-layer device work x (the changed config's step / the run's step): a host-bound step's whole host time
  became device time of the pieces, and the layout's edits reached them only through that ratio.
* **Stages and schedule**: the new layout by the trainer's rules (``moespec.layout.resolve_layout`` with the new
  pp x vpp); the schedule's action order replayed by the pipeline what-if's simulator (`simulate_step`), one
  overhead per hand-off between ranks: a pipelined run's calibrated one (it carries the p2p of the same
  activations), else the activations' transfer, ``micro_batch_size x seq_len x d_model`` x the activation bytes, at
  the run's measured bus bandwidth at the nearest message size (`layout.Bandwidth`: a run without a pipeline has no
  p2p; its collectives on the same links, stated). From a run without a pipeline each rank's host is replayed beside
  its device (``simulate_step(..., host=...)``: it launches its actions back to back without waiting for their
  data; an action starts no earlier than its launch and ends no earlier than its last launch), and the rest of the
  step is the replayed step less the same replay of its own micro-batches. At pp 1 the window is the micro-batches'
  work back to back.
* **The rest of the step** (optimizer, gradient reduction, what the window does not hold): the run's, with its
  data-parallel traffic changed: the bytes one GPU sends per step for the old and the new layout
  (`tracelens.analysis.memory.comm_volume`, ``dp``: FSDP gathers / reduce-scatters or DDP's all-reduce of the
  busiest stage's parameters over the new dp group) at the run's measured bus bandwidth, exposed beyond the last
  micro-batch's backward of the busiest stage (DDP and ZeRO-1/2 reduce during it) or beyond the window (ZeRO-3,
  whose gathers are prefetched); the optimizer's time x the busiest stage's parameters per GPU, new / old.
* **Tokens** per GPU follow the replicas (``dp x ep``) and the micro-batches (whatif.Model); memory is the memory
  projection of the new layout (every stage; the busiest decides).

Not modeled (said in the prediction): the pipeline schedule's own host time per action beyond the layers' launches
(from a run without a pipeline), the p2p's SM contention, a changed layout of experts (``ep`` with ``pp``: the layout mechanism replays
the new ep at pp 1 first, then this one splits the step).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from .. import pipeline_whatif as PW
from . import layout as L
from .base import Change, Mechanism, WhatIfError, register

_HELD = ("pp", "microbatches") + PW.PIPELINE_KEYS


def _pp(cfg: dict) -> int:
    return int(cfg.get("pp") or 1)


def _lay(cfg: dict, world: int):
    from ...analysis import memory as M

    return M.resolve_layout(cfg, world=world)


def fsdp_per_microbatch_ns(p, cfg: dict, device_scale: float) -> float:
    """ns per micro-batch of a run's FSDP work outside the pieces that repeats with the micro-batches
    (`layout.fsdp_gather_units`: the all-gathers' copies and casts), out of ``piece_costs_from_profile``'s per-step
    work."""
    from .tokens import chunk_units

    w = p.work
    m = int(cfg.get("microbatches") or 1)
    tok = (w["scale"].to_numpy() == "tokens") | chunk_units(w, cfg)
    sel = L.fsdp_gather_units(w) & (w["component"].to_numpy() != "optimizer step") & (w["layer"].to_numpy() < 0) & ~tok
    return float(w["dur"].to_numpy(float)[sel].sum()) * device_scale / m


def piece_costs_from_profile(p, cfg: dict, device_scale: float) -> tuple[dict, dict, float]:
    """(forward ns, full backward ns) per piece per micro-batch from one rank's profiled step of a run without a
    pipeline, and the per-step work left out of them (ns): each layer's non-communication device work, the
    token-shaped work outside the layers and the chunked loss's units (`tokens.chunk_units`: their number follows the
    tokens, not their shapes) as ``loss``, ``embedding`` 0."""
    from .tokens import chunk_units

    w = p.work
    m = int(cfg.get("microbatches") or 1)
    comm = w["is_comm"].to_numpy()
    comp = w["component"].to_numpy()
    lay = w["layer"].to_numpy()
    bwd = w["backward"].to_numpy() | (w["recompute"].to_numpy() if "recompute" in w else False)
    dur = w["dur"].to_numpy(float) * device_scale
    tok = (w["scale"].to_numpy() == "tokens") | chunk_units(w, cfg)
    work = ~comm & (comp != "optimizer step")
    f, bw = {"embedding": 0.0}, {"embedding": 0.0}
    for i in range(int(cfg["n_layers"])):
        sel = work & (lay == i)
        f[f"layer{i}"] = float(dur[sel & ~bwd].sum()) / m
        bw[f"layer{i}"] = float(dur[sel & bwd].sum()) / m
    out = work & (lay < 0) & tok
    f["loss"] = float(dur[out & ~bwd].sum()) / m
    bw["loss"] = float(dur[out & bwd].sum()) / m
    return f, bw, float(dur[work & (lay < 0) & ~tok].sum())


def piece_costs_from_replay(rep, cfg: dict) -> tuple[dict, dict, dict, dict]:
    """Per piece and micro-batch (``embedding``, ``layer<i>``, ``loss``), forward and full backward: the device work
    and the host's launch time of one rank's replayed step of the changed config at the run's pp (``rep``:
    `base.Replayed`, every unit edit applied), in calibrated ns: (device F, device B, host F, host B).

    Device: the piece's units' durations as edited (each layer's ``layer/<i>`` units, the token-shaped work outside
    the layers and the chunked loss's units as ``loss``; not communication, not the optimizer). Host: the host time
    before each of the piece's launches (communication included: the host launches it in the piece), a sync's
    going with the launch after it, x the rank's host factor. Everything else (the optimizer, parameter gathers and
    reductions, per-step work) is the rest of the step."""
    from .tokens import chunk_units

    p, plan, ds, hs = rep.profile, rep.plan, rep.device_scale, rep.host_scale
    w = p.work
    n = len(w)
    m = int(cfg.get("microbatches") or 1)
    comm = w["is_comm"].to_numpy().astype(bool)
    lay = w["layer"].to_numpy()
    bwd = w["backward"].to_numpy() | (w["recompute"].to_numpy() if "recompute" in w else False)
    opt = w["component"].to_numpy() == "optimizer step"
    loss = (lay < 0) & ((w["scale"].to_numpy() == "tokens") | chunk_units(w, cfg)) & ~comm & ~opt
    piece = np.full(n, "", dtype=object)
    for i in range(int(cfg["n_layers"])):
        piece[lay == i] = f"layer{i}"
    piece[loss] = "loss"
    dur = np.asarray(plan.dur[:n], float) * ds
    names = ["embedding"] + [f"layer{i}" for i in range(int(cfg["n_layers"]))] + ["loss"]
    df = {k: 0.0 for k in names}
    db = dict(df)
    hf, hb = dict(df), dict(df)
    for j in np.flatnonzero((piece != "") & ~comm & ~opt):
        (db if bwd[j] else df)[piece[j]] += dur[j] / m
    pend = 0.0
    for kd, j, g in zip(plan.kind, plan.ref, plan.gap):
        g = g * hs * ds
        if kd != 0:
            pend += g
            continue
        if j < n and piece[j] != "":
            (hb if bwd[j] else hf)[piece[j]] += (g + pend) / m
        pend = 0.0
    return df, db, hf, hb


def _serial_window(m: int, f: float, b: float, hf: float, hb: float) -> float:
    """The micro-batches' forward and backward back to back on one rank (pp 1), the host launching each action after
    the previous one and the device running it once launched (`analysis.pipeline.simulate_step`'s rule with ``host``):
    ns."""
    hc = dc = 0.0
    for _ in range(m):
        for d, h in ((f, hf), (b, hb)):
            dc = max(max(dc, hc) + d, hc + h)
            hc += h
    return dc


def p2p_bandwidth(analysis, cfg: dict) -> tuple[float, str] | None:
    """(GB/s, source) of a pipelined run's p2p hand-offs: one micro-batch's activations (``micro_batch_size x
    seq_len x d_model`` x the activation bytes: the trace records no p2p size) over the 5th percentile of the p2p
    kernels' durations (the fastest ones: no wait for the neighbour stage in them). None without p2p kernels."""
    from ...analysis import comm as CM

    k = CM.comm_kernels(analysis)
    d = k.loc[k["family"] == "p2p", "dur"].to_numpy(float) if len(k) else np.zeros(0)
    d = d[d > 0]
    if not len(d) or int(cfg.get("pp") or 1) < 2:
        return None
    nbytes = L.act_bytes(cfg) * int(cfg["micro_batch_size"]) * int(cfg["seq_len"]) * int(cfg["d_model"])
    t = float(np.percentile(d, 5))
    return nbytes / t, (f"the run's p2p hand-offs: {nbytes / 2**20:.1f} MiB of activations in {t / 1e3:.1f} us (5th "
                        f"percentile of {len(d)} p2p kernels)")


def link_bandwidth(model, family: str, n: int, nbytes: float) -> tuple[float, str]:
    """(GB/s, source): the run's collectives at the nearest size (`layout.Bandwidth`), else its p2p hand-offs."""
    b = model.measured.get("layout")
    if b is not None and len(b.bw.table):
        return b.bw.lookup(family, n, nbytes)
    p2p = model.measured.get("pp_layout")
    if p2p is not None:
        return p2p[0], p2p[1] + " (no collective of that size measured: the p2p link's bandwidth, stated)"
    raise WhatIfError(f"{model.run}: pp needs a multi-GPU run with collectives or p2p hand-offs to take a bandwidth from")


def dp_seconds(model, cfg: dict, world: int, mean_bwd_ns: float, window_ns: float) -> tuple[float, float, str]:
    """(exposed ns, total ns, the bandwidth's source) of one GPU's data-parallel traffic per step for ``cfg``:
    `memory.comm_volume`'s ``dp`` bytes at the run's bus bandwidth, less what hides under the last micro-batch's
    backward (DDP, ZeRO-1/2) or the window (ZeRO-3)."""
    from ...analysis import memory as M

    lay = _lay(cfg, world)
    nbytes = M.comm_volume(cfg, lay)["dp"]
    if nbytes <= 0:
        return 0.0, 0.0, ""
    n = max(lay.dp * lay.cp, lay.edp, 2)
    gbps, src = link_bandwidth(model, "all_gather" if lay.zero == 3 else "reduce_scatter", n, nbytes)
    total = nbytes / (gbps * 1e9) * 1e9
    hide = window_ns if lay.zero == 3 else mean_bwd_ns
    return max(total - hide, 0.0), total, src


def optimizer_params(cfg: dict, world: int) -> float:
    """Parameters the busiest stage's optimizer steps on one GPU (sharded over dp under ZeRO >= 1)."""
    from ...analysis import memory as M

    lay = _lay(cfg, world)
    best = 0.0
    for s in range(lay.pp):
        dense, experts, _ = M._per_gpu_params(cfg, lay, s)
        if lay.zero >= 1:
            dense, experts = dense / max(lay.dp * lay.cp, 1), experts / max(lay.edp, 1)
        best = max(best, dense + experts)
    return best


def stage_costs(cfg: dict, piece_f: dict, piece_bw: dict, beta: float | None) -> tuple[list, list, list, list]:
    """(modules per stage, F, B, W per stage) of ``cfg``'s pipeline layout from the piece costs."""
    pp = _pp(cfg)
    if pp == 1:
        mods = [list(piece_f)]
    else:
        mods = PW.new_layout(cfg)
    missing = [n for st in mods for n in st if n not in piece_f]
    if missing:
        raise WhatIfError(f"pp: module {missing[0]!r} of the new layout is not in the run ({', '.join(piece_f)})")
    f = [sum(piece_f[n] for n in st) for st in mods]
    full = [sum(piece_bw[n] for n in st) for st in mods]
    sched = str(cfg.get("pipeline_schedule") or "1f1b")
    if pp > 1 and PW.S.SCHEDULES[sched].split_backward:
        be = beta if beta is not None else PW._input_grad_share(cfg)
        b = [0.0 if s == 0 else be * full[s] for s in range(len(mods))]
        return mods, f, b, [full[s] - b[s] for s in range(len(mods))]
    return mods, f, full, [0.0] * len(mods)


@register
class PipelineLayout(Mechanism):
    name = "pp_layout"
    keys = ("pp",)
    sigma: ClassVar[dict[str, float]] = {"pp_window": 0.12, "pp_rest": 0.30}
    phase = "step"
    order = 101.0  # after the pipeline knobs' (100), which stand aside when pp changes
    summary = ("the run's per-piece compute (measured per stage or per layer) regrouped into the new pipeline's stages, "
               "its schedule replayed with the run's hand-off cost (or the activations at the measured bandwidth); "
               "the data-parallel traffic of the new layout at the measured bandwidth")

    def applies(self, change: Change) -> bool:
        return _pp(change.old) != _pp(change.target)

    def hold(self, change: Change) -> tuple[str, ...]:
        return _HELD if self.applies(change) else ()

    def measure(self, model, analysis) -> None:
        model.measured["pp_layout"] = p2p_bandwidth(analysis, model.config)

    def finish(self, change: Change, step_s: float, components: dict, rank: int) -> tuple[float, dict, float]:
        model, old, new = change.model, change.old, change.target
        world = L.world_of(model.manifest)
        pp0, pp1 = _pp(old), _pp(new)
        scale = step_s / model.base_step_s if model.base_step_s > 0 else 1.0
        m0, m1 = int(old.get("microbatches") or 1), int(new.get("microbatches") or 1)
        if world < 2:
            raise WhatIfError(f"{model.run}: pp needs a multi-GPU run")
        lines = []
        host_f = host_bw = None
        if pp0 > 1:
            try:
                base = PW.base_of(model)
            except PW.PipelineWhatIfError as e:
                raise WhatIfError(str(e)) from None
            piece_f = {k: v * scale for k, v in base.piece_f.items()}
            piece_bw = {k: v * scale for k, v in base.piece_bw.items()}
            rest0 = base.rest_ns * scale
            window0 = base.window_ns * scale
            handoff, beta = base.handoff_ns, base.beta
            src = (f"the run's stages' measured mean actions over {base.step_basis}, split by piece by the FLOP model")
            ho_src = f"the run's calibrated {handoff / 1e6:.3f} ms per hand-off (its p2p of the same activations)"
            step0 = base.step_ns * scale
        else:
            slow = int(np.argmax([sum(c.values()) for c in model.base_by_rank])) if model.base_by_rank else 0
            p = model.profiles[slow]
            step0 = step_s * 1e9
            # the changed config's own pieces: each one's device work and host launch time in the replayed step
            piece_f, piece_bw, host_f, host_bw = piece_costs_from_replay(change.replayed, old)
            p = change.replayed.profile
            window0 = _serial_window(m0, sum(piece_f.values()), sum(piece_bw.values()), sum(host_f.values()),
                                     sum(host_bw.values()))
            busy0 = m0 * sum(piece_f[k] + piece_bw[k] for k in piece_f)
            rest0 = max(step0 - window0, 0.0)
            beta = None
            ab = L.act_bytes(new) * int(new["micro_batch_size"]) * int(new["seq_len"]) * int(new["d_model"])
            gbps, bsrc = link_bandwidth(model, "all_to_all", world, ab)
            handoff = ab / (gbps * 1e9) * 1e9
            src = (f"rank {p.rank}'s replayed step of the changed config at pp {pp0}: each layer's device work and host "
                   f"launch time by pass, the token-shaped work outside the layers and the chunked loss as the loss "
                   f"piece, / {m0} micro-batch(es); {m0 * sum(host_f.values()) / 1e6:.1f} ms of launches and "
                   f"{busy0 / 1e6:.1f} ms of device work in a {window0 / 1e6:.1f} ms window")
            ho_src = (f"the activations ({ab / 2**20:.1f} MiB per micro-batch) at {gbps:.0f} GB/s ({bsrc}; the run has "
                      f"no p2p: its collective at the nearest size): {handoff / 1e6:.3f} ms per hand-off")
        mods, f, bb, ww = stage_costs(new, piece_f, piece_bw, beta)
        if pp1 > 1:
            sched, vpp = str(new.get("pipeline_schedule") or "1f1b"), int(new.get("vpp") or 1)
            order = PW.schedule_actions(sched, pp1, vpp, m1)
            costs = PW._costs_for(order, f, bb, ww)
            hcost = None
            if host_f is not None:
                _, hf_, hb_, hw_ = stage_costs(new, host_f, host_bw, beta)
                hcost = PW._costs_for(order, hf_, hb_, hw_)
            try:
                window, _, _ = PW._replay(order, costs, handoff, hcost)
            except PW.PipelineWhatIfError as e:
                raise WhatIfError(str(e)) from None
            busy = np.bincount(order["rank"].to_numpy(), weights=costs, minlength=pp1)
            shape = "|".join("".join("E" if n == "embedding" else "L" if n == "loss" else "t" for n in st) for st in mods)
            lines.append(f"pp {pp0} -> {pp1}: {len(mods)} stages ({shape}), {sched} x {m1} micro-batches replayed with "
                         f"the pieces' costs ({src}) and {ho_src}: window {window / 1e6:.1f} ms, busiest rank "
                         f"{busy.max() / 1e6:.1f} ms of work")
            last_bwd = max(bb[s] + ww[s] for s in range(len(mods)))
        else:
            window = m1 * (f[0] + bb[0])
            busy = np.asarray([window])
            lines.append(f"pp {pp0} -> 1: the {len(piece_f)} pieces' work back to back, {m1} micro-batch(es) x "
                         f"{(f[0] + bb[0]) / 1e6:.1f} ms ({src}): {window / 1e6:.1f} ms")
            last_bwd = bb[0]
        # the rest of the step: the data-parallel traffic's exposed part and the optimizer change
        old_busy_bwd = (max(base.stage_b[s] + base.stage_w[s] for s in range(len(base.stage_b))) * scale
                        if pp0 > 1 else sum(piece_bw.values()))
        e0, t0, _ = dp_seconds(model, old, world, old_busy_bwd, window0)
        e1, t1, dsrc = dp_seconds(model, new, world, last_bwd, window)
        opt0 = components.get("optimizer step", 0.0) * 1e9
        p_old, p_new = optimizer_params(old, world), optimizer_params(new, world)
        opt1 = opt0 * (p_new / p_old if p_old > 0 else 1.0)
        rest1 = max(rest0 - e0 + e1 - opt0 + opt1, 0.0)
        lay0, lay1 = _lay(old, world), _lay(new, world)
        lines.append(f"data parallelism dp {lay0.dp} -> {lay1.dp}: per GPU and step {t0 / 1e6:.1f} -> {t1 / 1e6:.1f} ms "
                     f"of gradient / parameter traffic (memory.comm_volume at {dsrc or 'no traffic'}), exposed "
                     f"{e0 / 1e6:.1f} -> {e1 / 1e6:.1f} ms past the compute it overlaps; optimizer x{opt1 / max(opt0, 1):.2f} "
                     f"(the busiest stage's parameters per GPU); rest of the step {rest0 / 1e6:.1f} -> {rest1 / 1e6:.1f} ms")
        step_ns = window + rest1
        step = step_ns / 1e9
        # components: the work scales with the busiest rank's work, the optimizer as above, the rest is the bubble
        out = dict(components)
        work_c = [c for c in out if c not in ("collective waits", "sync waits", "launch-bound idle", "pipeline bubble",
                                              "other", "optimizer step", "exposed communication")]
        tot = sum(out[c] for c in work_c)
        if pp0 > 1:
            place = PW.placement(base.meta.schedule, base.meta.pp, base.meta.vpp)
            per = np.bincount(place, weights=[base.stage_f[s] + base.stage_b[s] + base.stage_w[s]
                                              for s in range(len(place))], minlength=base.meta.pp)
            busy0 = float(per.max()) * base.meta.microbatches * scale
        fw = (float(busy.max()) / busy0) if busy0 > 0 else 1.0
        if tot > 0:
            for c in work_c:
                out[c] *= fw
        out["optimizer step"] = opt1 / 1e9
        out["exposed communication"] = max(out.get("exposed communication", 0.0) + (e1 - e0) / 1e9, 0.0)
        for c in ("pipeline bubble", "collective waits", "sync waits", "launch-bound idle", "other"):
            out[c] = 0.0 if c != "other" else out.get(c, 0.0)
        gap = step - sum(out.values())
        if gap >= 0:
            out["pipeline bubble" if pp1 > 1 else "other"] += gap
        else:
            t = sum(out.values())
            out = {c: v * step / t for c, v in out.items()} if t > 0 else out
        change.modeled.extend(lines)
        change.notes.append("pp from a run without a pipeline: measured on two points of the 4 x H100 grid only (docs/whatif.md)"
                            if pp0 == 1 else "pp: the run's per-hand-off overhead is kept for the new stages' hand-offs")
        var = (self.sigma["pp_window"] * window / max(step_ns, 1.0)) ** 2 + (
            self.sigma["pp_rest"] * abs(rest1 - rest0) / max(step_ns, 1.0)) ** 2
        return step, {c: float(v) for c, v in out.items()}, var

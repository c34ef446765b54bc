"""FSDP2's parameter all-gathers and gradient reduce-scatters placed in a replayed step: how much of them it exposes.

The scale-out projection (`scaleout`) used to hide a ZeRO-3 run's data-parallel traffic under the whole step's
window. FSDP2 does not: measured on 4 x H100 at micro-batch 8 (tests/fixtures/h100_4gpu_accum/dp4_mbs8_prof,
rank 0), 17 of the experts' 21 ms of all-gathers ran with no computation beside them, while at micro-batch 16
(h100_4gpu_layouts/dp4_mbs16) 6 of 32 ms did. What hides a gather is the work queued in front of it, and FSDP2 lets
little queue there:

* **Forward: no prefetch.** A unit's all-gather is issued by its pre-forward hook, just before the host launches
  the unit's first kernel (the trainer sets no explicit forward prefetch). It overlaps only the device's backlog at
  that moment: the step's earlier work that the host launched ahead of the device. A host-bound forward (micro-batch
  8 on an H100: the host launches the layers about as fast as the device runs them) exposes it whole.
* **Backward: one unit ahead.** A unit's pre-backward hook prefetches the next unit in backward order; the root's
  prefetches the first. The root (embedding, final norm, head) stays gathered from its forward to its
  post-backward.
* **One gather ahead of its use.** A unit's all-gather copy-in waits until the previous all-gather's output was
  copied out, which the compute stream does when the previous unit starts. So in backward a layer's experts are
  gathered only while the rest of their layer's backward that precedes them runs (the shared expert's), not while
  the layer before.
* **Reduce-scatters** follow each unit's last backward kernel, one at a time on their own stream, once per step
  (gradient sync is off for the earlier micro-batches); the step's end (the optimizer) waits for the last.

:func:`exposure` inserts these collectives, with the times of the projected layout, into a replayed step of the
changed config (`whatif`'s replay: host launches, streams, dependencies) and replays it; what the step grows by is
what they expose. The run's own FSDP collectives (a run at dp > 1) are taken out first, so the same rules price the
run's layout and the target's; the projection keeps the run's measured exposure and adds the difference.

Units are found in the step's kernels: layer ``l``'s experts are its expert-stage kernels (``moe/experts``), layer
``l`` its other kernels (attention, router, dispatch, shared expert), the root the kernels outside the layers.
**One gather per call.** FSDP2 gathers a unit at every call and reshards after it, and the trainer calls a layer's
experts once per EP dispatch chunk (``ep_overlap_chunks``): each call is gathered at its own first launch (`_calls`:
the units a mechanism inserted say their call, `replay.Plan.unit_keys`; a profile's own are cut into the chunks' runs).
Counted on the 4 x H100 grid: 15 -> 21 all-gathers a step at ep 2 x dp 2 with 2 chunks
(tests/tracelens/test_overlap_chunk_costs.py).
**The hooks' host time.** At dp > 1 each all-gather costs the host the time of FSDP2's ``FSDP::all_gather`` and
``FSDP::all_gather_copy_out`` ranges (the copy-in's setup, the NCCL call, the copy-out), which a run's own host gaps
hold already. A run at dp 1 records none: FSDP2 skips the collective there. Projected from such a run, each gather
adds :data:`HOOK_HOST_NS` of host time before its launch (per unit kind: a run at ep 2 and dp 1 gathers its dense
units, whose hooks it recorded, but not its experts): the median, over the ranks of the six committed FSDP runs
at dp > 1 (tests/fixtures: h100_scaling dp2_prof and ep2_cap_prof, h100_4gpu_accum dp4_mbs8_prof and
dp4_mbs8_m3_prof, h100_4gpu_layouts dp4_mbs16, h100_4gpu ep4_cap_ovl; 20 ranks, 1.09-1.92 ms), of those ranges'
host time per all-gather. Where the host leads the device it costs nothing; at micro-batch 4-8 on an H100 the
forward is host-bound and it does (test_fsdp_overlap recomputes the median from the raw traces).

Not modeled: the copy-in / copy-out kernels' own time (`scaleout.fsdp_copies_ns` counts it apart); a pipelined
stage's gathers (pp > 1 keeps the window rule).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import contention as CT

#: host ns per all-gather of FSDP2's hooks at dp > 1 (module docstring), for a run at dp 1 that records none
HOOK_HOST_NS = 1.36e6
#: the committed runs it is the median of (tests/fixtures/...), each rank's ranges per all-gather
HOOK_HOST_SOURCES = ("h100_scaling/dp2_prof", "h100_scaling/ep2_cap_prof", "h100_4gpu_accum/dp4_mbs8_prof",
                     "h100_4gpu_accum/dp4_mbs8_m3_prof", "h100_4gpu_layouts/dp4_mbs16", "h100_4gpu/ep4_cap_ovl")

_FSDP_FAMILIES = ("allgather", "all_gather", "reducescatter", "reduce_scatter", "_reduce_scatter_base",
                  "_allgather_base")


@dataclass(frozen=True)
class Exposure:
    """What FSDP's collectives add to one replayed step (calibrated ns): ``gathers`` with the all-gathers alone
    (they repeat with each micro-batch), ``total`` with the reduce-scatters too (once a step)."""

    gathers_ns: float
    total_ns: float
    microbatches: int
    units: int

    @property
    def reduces_ns(self) -> float:
        return max(self.total_ns - self.gathers_ns, 0.0)

    def per_step(self, microbatches: int) -> float:
        """The step's exposure at ``microbatches`` micro-batches of the same size: the gathers' per micro-batch x
        them, the reduce-scatters' once."""
        m0 = max(self.microbatches, 1)
        return max(self.gathers_ns / m0 * microbatches + self.reduces_ns, 0.0)


def _clone(plan):
    """A copy of a replay plan whose lists can be edited without touching ``plan``."""
    return replace(plan, **{k: list(getattr(plan, k)) for k in ("kind", "ref", "gap", "dur", "stream", "dep", "wait",
                                                               "comp", "sync_min", "sync_ret", "gap_x",
                                                               "sync_streams")},
                   backlog=dict(plan.backlog), unit_keys=dict(getattr(plan, "unit_keys", {}) or {}))


def fsdp_collective_units(w) -> np.ndarray:
    """Indices of a step profile's FSDP collectives (all-gathers and reduce-scatters, by kernel name)."""
    names = w["name"].astype(str).str.lower().to_numpy()
    comm = w["is_comm"].to_numpy().astype(bool)
    hit = np.array([any(f in s for f in _FSDP_FAMILIES) for s in names], dtype=bool)
    return np.flatnonzero(comm & hit)


def _unit_keys(w) -> list:
    """Per unit of the profile: the FSDP unit its kernel belongs to, ``("experts", l)``, ``("dense", l)``,
    ``("root", -1)``, or None (communication, the optimizer)."""
    layer = w["layer"].to_numpy()
    stage = w["moe_stage"].astype(str).to_numpy()
    comm = w["is_comm"].to_numpy().astype(bool)
    comp = w["component"].astype(str).to_numpy()
    out: list = []
    for j in range(len(w)):
        if comm[j] or comp[j] == "optimizer step":
            out.append(None)
        elif layer[j] >= 0:
            out.append(("experts" if stage[j] == "moe/experts" else "dense", int(layer[j])))
        else:
            out.append(("root", -1))
    return out


def _reduce_keys(w, keys: list) -> list:
    """Per unit: the FSDP unit whose reduce-scatter waits for it. A unit's reduce-scatter takes the gradients its
    post-backward hook copied in (``FSDP::post_backward_reduce``: ``_chunk_cat`` into the reduce-scatter's input), so
    it starts after that copy, not after the unit's last backward kernel. The experts' hook runs while the layer's
    backward is in the dispatch's gradient (its kernels sit under ``moe/permute/FSDP::post_backward_reduce
    (layers.<l>.ffn.experts)``), so by the stage alone they are the layer's other units: here they are the
    experts'. On ``h100_4gpu_layouts/dp4_mbs16`` (rank 0) each experts' reduce-scatter starts 1.9 ms after the
    experts' last grouped GEMM of the backward, after the copy-in's 1.84 ms ``_chunk_cat``, beside the router's,
    the attention's and the norms' backward."""
    out = list(keys)
    if "path" not in w or "layer" not in w:  # a hand-built profile with no ranges: the stages' keys
        return out
    paths = w["path"].astype(str).to_numpy()
    layer = w["layer"].to_numpy()
    for j in range(min(len(paths), len(out))):
        p = paths[j]
        if out[j] is not None and layer[j] >= 0 and "post_backward_reduce" in p and ".experts)" in p:
            out[j] = ("experts", int(layer[j]))
    return out


def _microbatches(plan, keys, bwd) -> list[tuple[list[int], list[int]]]:
    """The step's micro-batches in host order: per micro-batch (forward unit indices, backward unit indices). A new
    micro-batch starts where the first layer's forward starts again after some backward work (forward-flagged
    kernels inside a backward, and the step's work after the last backward, stay with their micro-batch)."""
    n = len(keys)
    layers = [k[1] for k in keys if k is not None and k[1] >= 0]
    first = ("dense", min(layers)) if layers else None
    out: list[tuple[list[int], list[int]]] = []
    cur_f: list[int] = []
    cur_b: list[int] = []
    for kd, j in zip(plan.kind, plan.ref):
        if kd != 0 or j >= n or keys[j] is None:
            continue
        if bwd[j]:
            cur_b.append(j)
            continue
        if cur_b and keys[j] == first:
            out.append((cur_f, cur_b))
            cur_f, cur_b = [], []
        cur_f.append(j)
    if cur_f or cur_b:
        out.append((cur_f, cur_b))
    return out


def _calls(plan, keys: list, bwd: np.ndarray, calls: int) -> dict[int, int]:
    """Per unit of an experts key: which call of the unit it belongs to. FSDP2 gathers a unit at every call, and the
    trainer calls a layer's experts once per EP dispatch chunk. Units a mechanism inserted say their call
    (`replay.Plan.unit_keys`); the profile's own experts units of one pass of a layer, between two launches of the
    layer's other units, are cut in host order into ``calls`` runs of equal length (the chunks launch the same
    kernels)."""
    out: dict[int, int] = {}
    for j, v in (getattr(plan, "unit_keys", {}) or {}).items():
        if v and v[0] == "call":
            out[j] = int(v[2])
    if calls <= 1:
        return out
    n = len(bwd)
    runs: dict[tuple, list[int]] = {}
    seen_other: dict[tuple, int] = {}
    block = 0
    for kd, j in zip(plan.kind, plan.ref):
        if kd != 0 or j >= n or keys[j] is None:
            continue
        k = keys[j]
        if k[0] == "experts":
            runs.setdefault((k, bool(bwd[j]), seen_other.get((k[1], bool(bwd[j])), 0)), []).append(j)
        else:
            if k[1] >= 0:
                seen_other[(k[1], bool(bwd[j]))] = block
            block += 1
    for js in runs.values():
        for i, j in enumerate(js):
            out.setdefault(j, min(i * calls // len(js), calls - 1))
    return out


def insert(plan, w, gather: dict, reduce: dict, with_reduces: bool = True, hook: dict | None = None,
           calls: int = 1) -> int:
    """Insert FSDP2's collectives into ``plan`` (the module's rules), ``gather`` / ``reduce``: ns per unit key
    (units missing from them send nothing: a group of one); ``hook``: per unit key, the host time its all-gather's
    hook adds before the launch (profiled ns; none where the run's own hooks' time is in its host gaps already);
    ``calls``: how many times a pass calls each layer's experts (the EP dispatch chunks: one gather per call, `_calls`).
    Returns how many collectives were inserted."""
    hook = hook or {}
    keys = _unit_keys(w)
    bwd = (w["backward"].to_numpy() | (w["recompute"].to_numpy() if "recompute" in w else False)).astype(bool)
    n0 = len(keys)
    # units a mechanism inserted that stand for a call of an FSDP unit (the chunks' expert work)
    extra = {j: v for j, v in (getattr(plan, "unit_keys", {}) or {}).items() if v and v[0] == "call"}
    if extra:
        top = max(extra) + 1
        keys = keys + [None] * max(top - n0, 0)
        bwd = np.concatenate([bwd, np.zeros(max(top - n0, 0), bool)])
        for j, v in extra.items():
            keys[j], bwd[j] = v[1], bool(v[3])
    call = _calls(plan, keys, bwd, calls)
    mbs = _microbatches(plan, keys, bwd)
    if not mbs:
        return 0
    pos = {j: i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)) if kd == 0}
    s_ag = max(plan.stream) + 1 if plan.stream else 1
    s_rs = s_ag + 1
    # (host position, order at that position, spec); a spec: (name, dur, stream, dep-name or kernel index)
    specs: list[tuple[int, int, tuple]] = []
    chain = None  # the last copy-out marker: the next gather's copy-in waits for it

    def first_of(js):
        got: dict = {}
        for j in js:
            got.setdefault((keys[j], call.get(j, 0)), j)  # one gather per call of a unit
        return got

    for mi, (fw, bw) in enumerate(mbs):
        # forward: each unit gathered at its own first launch, gated on the previous unit's copy-out
        for (key, c), j in sorted(first_of(fw).items(), key=lambda kv: pos[kv[1]]):
            if key not in gather:
                continue
            ag, mk = ("ag", mi, "f", key, c), ("mk", mi, "f", key, c)  # name[3]: the unit key
            specs.append((pos[j], 0, (ag, gather[key], s_ag, chain)))
            specs.append((pos[j], 1, (mk, 0.0, plan.stream[j], ag)))
            chain = mk
        # backward: units in backward order; each one's pre-backward prefetches the next (the root stays gathered)
        firsts = sorted(first_of(bw).items(), key=lambda kv: pos[kv[1]])
        for k, ((key, c), j) in enumerate(firsts):
            if key != ("root", -1) and key in gather and not any(
                    s[2][0] == ("ag", mi, "b", key, c) for s in specs):  # not prefetched: gathered at its own launch
                ag = ("ag", mi, "b", key, c)
                specs.append((pos[j], 0, (ag, gather[key], s_ag, chain)))
            if key != ("root", -1) and key in gather:
                mk = ("mk", mi, "b", key, c)
                specs.append((pos[j], 1, (mk, 0.0, plan.stream[j], ("ag", mi, "b", key, c))))
                chain = mk
            if k + 1 < len(firsts):
                nxt, nc = firsts[k + 1][0]
                if nxt != ("root", -1) and nxt in gather:
                    specs.append((pos[j], 2, (("ag", mi, "b", nxt, nc), gather[nxt], s_ag, chain)))
        if with_reduces and mi == len(mbs) - 1 and bw:
            lasts: dict = {}
            rs_keys = _reduce_keys(w, keys)
            for j in bw:
                if j < len(rs_keys) and rs_keys[j] is not None:
                    lasts[rs_keys[j]] = j
            last_rs = None
            for key, j in sorted(lasts.items(), key=lambda kv: pos[kv[1]]):
                if key in reduce:
                    rs = ("rs", key)
                    specs.append((pos[j] + 1, 0, (rs, reduce[key], s_rs, int(j))))
                    last_rs = (rs, pos[j] + 1)
            if last_rs is not None:
                # the step's end waits for the last reduce-scatter: the first launch after the backward's last
                after = [i for i in range(max(pos[j] for j in bw) + 1, len(plan.kind)) if plan.kind[i] == 0]
                if after:
                    i = after[0]
                    specs.append((i, 9, (("end",), 0.0, plan.stream[plan.ref[i]], last_rs[0])))
    made: dict = {}
    deps: list = []
    for at, _, (name, dur, stream, dep) in sorted(specs, key=lambda s: (s[0], s[1]), reverse=True):
        # launched by the hook that runs just before the item at ``at``: that item's host time comes before it
        gap = plan.gap[at] if at < len(plan.gap) else 0.0
        gx = plan.gap_x[at] if at < len(plan.gap_x) else 0.0
        j = plan.add_unit(float(dur), int(stream), "exposed communication",
                          gap + (hook.get(name[3], 0.0) if name[0] == "ag" else 0.0), at)
        plan.gap_x[at] = gx
        if at + 1 < len(plan.gap):
            plan.gap[at + 1] = 0.0
            plan.gap_x[at + 1] = 0.0
        made[name] = j
        deps.append((j, dep))
    for j, dep in deps:
        if dep is None:
            continue
        plan.dep[j] = int(dep) if isinstance(dep, (int, np.integer)) else made.get(dep, -1)
    return sum(1 for n in made if n[0] in ("ag", "rs"))


def exposure(rep, w, gather: dict, reduce: dict, microbatches: int, hook: dict | None = None,
             calls: int = 1) -> Exposure:
    """What FSDP2's collectives (``gather`` / ``reduce``: ns per unit key, in profiled time) add to the replayed step
    ``rep`` (`mechanisms.base.Replayed`; its ``plan`` is left as it is), with the run's own FSDP collectives taken
    out, in calibrated ns."""
    hs, ds = rep.host_scale, rep.device_scale
    base = _clone(rep.plan)
    for j in fsdp_collective_units(w):
        base.dur[int(j)] = 0.0
    for j, v in base.unit_keys.items():  # FSDP collectives a mechanism inserted (the overlap's re-gathers)
        if v and v[0] == "fsdp":
            base.dur[int(j)] = 0.0
    s_ag = max(base.stream) + 1 if base.stream else 1  # `insert`'s streams: the gathers', then the reduce-scatters'
    f0, _ = CT.profile_cover(w)
    rate = CT.rates(w)

    def step(plan) -> float:
        return contended_step(plan, hs, w, f0, rate, s_ag)

    t0 = step(base)
    ag = _clone(base)
    insert(ag, w, gather, {}, with_reduces=False, hook=hook, calls=calls)
    t_ag = step(ag)
    both = _clone(base)
    n = insert(both, w, gather, reduce, with_reduces=True, hook=hook, calls=calls)
    t_all = step(both)
    return Exposure(max(t_ag - t0, 0.0) * ds, max(t_all - t0, 0.0) * ds, microbatches, n)


def contended_step(plan, hs: float, w, f0: dict, rate: dict, s_ag: int) -> float:
    """The step of ``plan`` replayed with its compute slowed by the communication the replay places beside it
    (`contention`): replay, each compute unit's cover by each collective kind against its profiled cover ``f0``,
    replay again with the stretched durations. Units on ``s_ag`` / ``s_ag + 1`` are `insert`'s all-gathers /
    reduce-scatters; another inserted communication unit is an all-to-all (the EP mechanisms'), one a mechanism
    marks ``("fsdp",)`` an all-gather."""
    r = plan.replay(hs)
    if r.start is None or not CONTENTION:
        return r.step_ns
    n, n0 = len(plan.dur), len(w)
    comp = np.asarray(plan.comp, dtype=object)
    is_comm = np.zeros(n, bool)
    is_comm[:n0] = w["is_comm"].to_numpy().astype(bool)
    is_comm[n0:] = comp[n0:] == "exposed communication"
    names = w["name"].astype(str).to_numpy()
    stream = np.asarray(plan.stream)
    keys = getattr(plan, "unit_keys", {}) or {}
    kinds = np.full(n, "", dtype=object)
    for j in np.flatnonzero(is_comm):
        if j < n0:
            kinds[j] = CT.kind_of(names[j])
        elif stream[j] == s_ag or (keys.get(int(j)) or ("",))[0] == "fsdp":
            kinds[j] = "AllGather"
        elif stream[j] == s_ag + 1:
            kinds[j] = "ReduceScatter"
        else:
            kinds[j] = "SendRecv"
    f1 = CT.cover(r.start, r.end, stream, is_comm, kinds)
    dur = CT.stretch(plan.dur, np.where(is_comm, "", comp), f0, f1, rate)
    again = _clone(plan)
    again.dur = [float(x) for x in dur]
    return again.replay(hs).step_ns


#: the contention rule on (`contended_step`); off, the replay gives each kernel its profiled time
CONTENTION = True


__all__ = ["HOOK_HOST_NS", "HOOK_HOST_SOURCES", "Exposure", "exposure", "fsdp_collective_units", "insert"]

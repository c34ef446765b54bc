"""``ep``, ``dp``, ``ep_dispatch``, ``ep_capacity_factor``: another expert / data parallel layout on the same GPUs.

A run of ``W`` GPUs (pp = 1) is ``dp x ep`` (trainer/parallel/dist.py): EP groups are consecutive ranks, rank ``r``
holds experts ``[(r % ep) * E/ep, ...)``; dense parameters are FSDP-sharded over the world, expert parameters over
the ``dp = W / ep`` ranks that hold the same experts (no expert all-gather at ``dp = 1``). A new layout changes four
things in each rank's replayed step, each from the run's own tables:

* **Expert rows.** The rows each rank's experts compute per MoE layer and micro-batch: the rows routed to its local
  experts from every rank of its new EP group, from the run's routing counts (``RUN/routing.json``: per rank, layer
  and global expert; the profiled steps' counts per forward), ``T * k`` per rank when the run has none (said so).
  ``ep_dispatch: capacity`` keeps at most ``ceil(f * T_c * k / ep)`` rows per peer and chunk (the rest is dropped);
  the trainer before issue 33 (a manifest without ``ep_dispatch``) computed the whole worst-case buffer at level 3.
  Each layer's expert-stage work (GEMMs, SwiGLU, their copies) scales with the rank's rows: the baseline's measured
  time per row of each kernel. The rank with the most rows in a layer sets the pace: the others wait for it in the
  next all-to-all (the difference between the new and the run's wait is added to that all-to-all).
* **Token all-to-alls.** Per MoE layer, micro-batch and chunk four of them (dispatch and combine, forward and
  backward), each sending the rank's buffer: the routed rows (nccl, levels 0-1), the worst-case buffer
  ``ep * T * min(k, E/ep)`` (nccl, levels 2-3) or ``ep * ceil(f * T * k / ep)`` (capacity), x ``d_model`` x the
  activation bytes. Time = bus bytes / the run's measured bus bandwidth at the nearest message size of the same
  collective and group size (`bandwidth_table`): the run's own all-to-alls when it has them, else (a DP run) its
  FSDP all-gathers / reduce-scatters on the same links, said so. From a DP run they are inserted on the experts'
  stream around each layer's expert stage (with the counts exchange, at the run's smallest collective's time).
* **FSDP of the experts.** Each MoE layer's experts are all-gathered (forward and backward, working dtype) and
  their gradients reduce-scattered (fp32) over the ``dp`` group: ``E/ep * 3 * d * F`` parameters. The run's expert
  all-gathers and reduce-scatters (found by their size) take the new size and group's time, or go at ``dp = 1``;
  from a run without them they are inserted on the run's all-gather / reduce-scatter streams, the expert stage
  waiting for its gather and the reduce-scatter for the expert stage's last backward kernel.
* Memory is the memory projection's (``tracelens.analysis.memory``: experts sharded by ep, FSDP over dp, the
  dispatch buffers by path); the model scales it by the run's measured / projected peak.

Not modeled (said in the prediction): the receive-side regroup kernels an EP run adds (from a DP run) or drops,
the host time of the added collectives' launches, a pipelined run's layout (pp > 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .. import ep_path as EP
from .base import Change, Mechanism, WhatIfError, register
from .gemm_backend import _row_shaped, gemms_stop_at_routed_rows

LAYOUT_KEYS = ("ep", "dp", "ep_dispatch", "ep_capacity_factor")  # ep_overlap / ep_overlap_chunks: overlap.py
_FAMILIES = ("all_to_all", "all_gather", "reduce_scatter")


# ------------------------------------------------------------------------------------------ the layout's numbers
def world_of(manifest: dict) -> int:
    return int((manifest or {}).get("world_size") or 1)


def dims(cfg: dict, world: int) -> tuple[int, int]:
    """(dp, ep) of ``cfg`` on ``world`` GPUs (pp = 1): the trainer's rule (``moespec.config.resolve_world``)."""
    from moespec.config import ConfigError, resolve_world

    try:
        return resolve_world(cfg, world)
    except ConfigError as e:
        raise WhatIfError(f"layout: {e}") from None


def act_bytes(cfg: dict) -> int:
    """Bytes per element of the activations the token all-to-alls move."""
    return 2 if cfg.get("dtype") == "bf16" else 4


def chunks(cfg: dict) -> int:
    return int(cfg.get("ep_overlap_chunks") or 2) if cfg.get("ep_overlap") else 1


def capacity_rows(cfg: dict, tokens: int) -> int:
    """Per-peer capacity of the capacity path per chunk: ``ceil(f * T_c * k / ep)`` (trainer/model/dispatch.py)."""
    ep = int(cfg.get("ep") or 1)
    tc = tokens / chunks(cfg)
    return math.ceil(float(cfg["ep_capacity_factor"]) * tc * int(cfg["top_k"]) / ep)


def send_rows(cfg: dict, tokens: int) -> int:
    """Rows one rank's token all-to-all sends per micro-batch (all chunks together; docs/trainer.md): the routed
    rows (nccl, levels 0-1), the worst-case buffer (nccl, levels 2-3), the capacity buffer (capacity); 0 at ep 1."""
    ep, k = int(cfg.get("ep") or 1), int(cfg["top_k"])
    if ep == 1:
        return 0
    if cfg.get("ep_dispatch", "nccl") == "capacity":
        return ep * capacity_rows(cfg, tokens) * chunks(cfg)
    if int(cfg["sync_free_level"]) >= 2:
        return ep * tokens * min(k, int(cfg["n_routed_experts"]) // ep)
    return tokens * k


def recv_buffer_rows(cfg: dict, tokens: int) -> int:
    """Rows of one chunk's EP receive buffer (what the regroup gathers and the combine scatters): the send buffer
    per chunk at levels 2-3 or under capacity; 0 where the buffer is the routed rows (nccl levels 0-1) or at ep 1."""
    ep = int(cfg.get("ep") or 1)
    if ep == 1 or (cfg.get("ep_dispatch", "nccl") != "capacity" and int(cfg["sync_free_level"]) < 2):
        return 0
    return send_rows(cfg, tokens) // chunks(cfg)


def expert_params(cfg: dict) -> int:
    """Routed-expert parameters of one MoE layer on one rank before FSDP sharding: ``E/ep * 3 * d * F``."""
    ep = int(cfg.get("ep") or 1)
    return int(cfg["n_routed_experts"]) // ep * 3 * int(cfg["d_model"]) * int(cfg["moe_d_ff"])


def fsdp_expert_bytes(cfg: dict, world: int) -> tuple[int, int, int]:
    """(all-gather output bytes, reduce-scatter input bytes, group size) of one MoE layer's experts under FSDP
    (trainer/parallel/dist.py: experts on the dp sub-mesh; bf16 params gathered, fp32 gradients reduced);
    (0, 0, 1) at dp = 1 or under DDP."""
    dp, _ = dims(cfg, world)
    if cfg.get("dp_mode", "fsdp") != "fsdp" or dp == 1:
        return 0, 0, 1
    n = expert_params(cfg)
    return n * act_bytes(cfg), n * 4, dp


# ------------------------------------------------------------------------------------------ routing: rows per rank
@dataclass
class Routing:
    """Per source rank and MoE layer: its tokens per global expert per forward (micro-batch), at the run's tokens."""

    counts: dict  # rank -> layer -> np.ndarray [E]
    basis: str
    # ``ep_placement: balanced`` runs: per MoE layer, the EP rank (index into a group) holding each expert
    placement: dict = field(default_factory=dict)
    ep: int = 1  # the run's EP group size


def read_routing(run, manifest: dict | None) -> tuple[Routing | None, str]:
    """The run's routing counts per forward, or None and why."""
    from ...errors import TraceError

    if run is None:
        return None, "no run dir"
    try:
        rc = run.routing()
    except TraceError as e:
        return None, e.one_line()
    if rc is None:
        return None, "the run has no routing.json"
    out: dict = {}
    used: set = set()
    for rank, r in rc.ranks.items():
        out[rank] = {}
        for lid, lc in r.layers.items():
            got = [(f, np.asarray(c, float)) for s, (f, c) in sorted(lc.steps.items()) if f > 0]
            if got:
                used |= set(lc.steps)
                out[rank][lid] = sum(c for _, c in got) / sum(f for f, _ in got)
            elif lc.total_forwards > 0:
                out[rank][lid] = np.asarray(lc.total, float) / lc.total_forwards
    basis = (f"routing.json, profiled step(s) {', '.join(map(str, sorted(used)))}" if used
             else f"routing.json, all {rc.steps} steps")
    ep = max((len(r.ep_group) for r in rc.ranks.values()), default=1)
    return Routing(out, basis, {int(k): tuple(v) for k, v in (rc.placement or {}).items()}, ep), ""


def experts_by_rank(cfg: dict, ep: int, routing: Routing | None, run_cfg: dict) -> dict | None:
    """Per MoE layer, the experts each EP rank holds under ``cfg``'s placement at ``ep`` ranks: {layer: [[expert,
    ...] per EP rank]}; None for the contiguous placement (or ep < 2). The run's own balanced placement comes from
    its ``routing.json`` (``routing.placement``, at the run's EP size, when ``cfg`` asks for the run's loads file);
    any other from the trainer's plan on ``cfg``'s ``ep_placement_loads``. A loads file that cannot be read here:
    `WhatIfError`, one line."""
    if ep < 2 or cfg.get("ep_placement", "contiguous") != "balanced":
        return None
    E = int(cfg["n_routed_experts"])
    if (routing is not None and routing.placement and routing.ep == ep
            and run_cfg.get("ep_placement") == "balanced"
            and run_cfg.get("ep_placement_loads") == cfg.get("ep_placement_loads")):
        return {ly: [[e for e in range(E) if where[e] == p] for p in range(ep)]
                for ly, where in routing.placement.items()}
    from moespec.config import ConfigError
    from moespec.placement import placement_plan

    try:
        plan = placement_plan({**cfg, "ep": ep})
    except ConfigError as e:
        raise WhatIfError(f"ep_placement: {e}") from None
    return {ly: [list(r) for r in lp.ranks] for ly, lp in plan.layers.items()}


def moe_layers(cfg: dict) -> list[int]:
    return list(range(int(cfg.get("first_k_dense") or 0), int(cfg["n_layers"])))


def expert_rows(cfg: dict, world: int, tokens: int, routing: Routing | None, padded_l3: bool = False,
                experts: dict | None = None) -> dict:
    """Rows each rank's experts compute per micro-batch of ``tokens``: {rank: {layer: rows}} (module docstring).
    ``padded_l3``: the trainer before issue 33 computed the whole worst-case buffer at nccl level 3. ``experts``:
    per MoE layer the experts of each EP rank (``ep_placement``: `experts_by_rank`); None or a layer
    missing from it: contiguous (EP rank ``p`` holds ``[p*E/ep, (p+1)*E/ep)``)."""
    _, ep = dims(cfg, world)
    E, k = int(cfg["n_routed_experts"]), int(cfg["top_k"])
    el = E // ep
    cap = capacity_rows(cfg, tokens) if ep > 1 and cfg.get("ep_dispatch", "nccl") == "capacity" else None
    c = chunks(cfg) if ep > 1 else 1
    out: dict = {}
    for r in range(world):
        g0 = (r // ep) * ep
        lo = (r % ep) * el
        out[r] = {}
        for ly in moe_layers(cfg):
            if ep > 1 and padded_l3 and cap is None and int(cfg["sync_free_level"]) >= 3:
                out[r][ly] = float(ep * tokens * min(k, el))
                continue
            tot = 0.0
            for s in range(g0, g0 + ep):
                if routing is not None and s in routing.counts and ly in routing.counts[s]:
                    cnt = routing.counts[s][ly]
                    scale = tokens / max(float(cnt.sum()) / k, 1.0)  # the run's counts at these tokens
                    held = (experts or {}).get(ly)
                    sent = float((cnt[list(held[r % ep])] if held is not None else cnt[lo:lo + el]).sum()) * scale
                else:
                    sent = tokens * k / ep
                tot += c * min(sent / c, cap) if cap is not None else sent
            out[r][ly] = tot
    return out


# ------------------------------------------------------------------------------------------ measured bandwidth
@dataclass
class Bandwidth:
    """The run's measured bus bandwidth per collective family, group size and message size (transfer time only:
    `tracelens.analysis.comm`, end - last arrival)."""

    table: pd.DataFrame  # family, group_size, bytes, busbw_gbps, n
    _memo: dict = field(default_factory=dict, repr=False, compare=False)  # (family, n, bytes) -> lookup's answer

    def lookup(self, family: str, n: int, nbytes: float) -> tuple[float, str]:
        """(bus GB/s, where it came from) at the nearest measured message size: the same family and group size,
        else the same group size (another collective on the same links), else the family at another size."""
        key = (family, n, nbytes)
        if key not in self._memo:
            self._memo[key] = self._lookup(family, n, nbytes)
        return self._memo[key]

    def _lookup(self, family: str, n: int, nbytes: float) -> tuple[float, str]:
        t = self.table
        if family == "all_to_all" and not ((t.family == "all_to_all") & (t.group_size == n)).any():
            return self.link(n)
        for sel, how in ((t[(t.family == family) & (t.group_size == n)], f"{family} over {n}"),
                         (t[(t.group_size == n) & t.family.isin(_FAMILIES)], f"the run's collectives over {n}"),
                         (t[t.family == family], f"{family} over another group size"),
                         (t[t.family.isin(_FAMILIES)], "the run's collectives")):
            if len(sel):
                d = np.abs(np.log(sel["bytes"].to_numpy(float) / max(nbytes, 1.0)))
                row = sel.iloc[int(np.argmin(d))]
                src = f"{row.family} over {int(row.group_size)} at {row.bytes / 2**20:,.0f} MiB"
                return float(row.busbw_gbps), src + ("" if how.startswith(family) else f" ({how})")
        raise WhatIfError("layout: the run has no measured collective to take a bandwidth from")

    def link(self, n: int) -> tuple[float, str]:
        """(bus GB/s, source) of the intra-node link for an all-to-all over ``n`` ranks in a run without one over
        ``n`` (a DP run, or an EP run of another group size): the fastest of its collectives
        of at least 64 MiB over ``n`` ranks (else over any group size). An FSDP collective runs beside compute and
        below the link's rate, the fastest one the least disturbed; an EP step's all-to-alls run half alone, half
        beside the shared expert's GEMMs (4 x H100: the dp 4 run's fastest, a 1,600 MiB reduce-scatter, 324 GB/s;
        the ep 4 nccl run's all-to-alls 360 alone, 290 beside the GEMMs). The nearest size (the other families'
        rule) took the experts' 2,112 MiB reduce-scatter there, 251 GB/s, the slowest: 9.64 ms per all-to-all
        against 7.56 measured."""
        t = self.table
        big = t[t.family.isin(_FAMILIES) & (t["bytes"] >= 64 * 2**20)]
        for sel, how in ((big[big.group_size == n], f"over {n}"), (big, "over another group size")):
            if len(sel):
                row = sel.iloc[int(np.argmax(sel["busbw_gbps"].to_numpy(float)))]
                return float(row.busbw_gbps), (f"the fastest of the run's collectives {how}, {row.family} of "
                                               f"{row.bytes / 2**20:,.0f} MiB over {int(row.group_size)}: the link")
        sel = t[t.family.isin(_FAMILIES)]
        if len(sel):
            row = sel.iloc[int(np.argmax(sel["busbw_gbps"].to_numpy(float)))]
            return float(row.busbw_gbps), f"the fastest of the run's collectives, {row.family} over {int(row.group_size)}"
        raise WhatIfError("layout: the run has no measured collective to take a bandwidth from")

    def seconds(self, family: str, n: int, nbytes: float) -> tuple[float, str]:
        """Transfer time (ns) of one collective of ``nbytes`` over ``n`` ranks, and the bandwidth's source."""
        if n <= 1 or nbytes <= 0:
            return 0.0, ""
        bw, src = self.lookup(family, n, nbytes)
        return nbytes * (n - 1) / n / (bw * 1e9) * 1e9, src


def bandwidth_table(inst: pd.DataFrame) -> Bandwidth:
    ok = inst[~inst["startup"] & inst["cross_rank"] & (inst["bytes"] > 0) & (inst["comm_us"] > 0)]
    ok = ok[ok["family"].isin(_FAMILIES)]
    if ok.empty:
        return Bandwidth(pd.DataFrame(columns=["family", "group_size", "bytes", "busbw_gbps", "n"]))
    t = ok.groupby(["family", "group_size", "bytes"]).agg(busbw_gbps=("busbw_gbps", "median"),
                                                          n=("rank", "size")).reset_index()
    return Bandwidth(t[t["busbw_gbps"] > 0].reset_index(drop=True))


# ------------------------------------------------------------------------------------------ what the run shows
@dataclass
class LayoutBase:
    """What the mechanism reads from the run once (`Layout.measure`)."""

    world: int
    bw: Bandwidth
    comm: list  # per profile: DataFrame indexed by unit (family, bytes, group_size) of its communication units
    routing: Routing | None
    routing_note: str
    latency_ns: float  # the run's smallest collective transfer (a counts exchange costs about that)
    notes: list = field(default_factory=list)
    ep_rates: EP.Rates | None = None  # the run's row-move and elementwise rates (the EP path's kernels from ep 1)


def measure(model, analysis) -> LayoutBase | None:
    from ...analysis import comm as CM

    world = world_of(model.manifest)
    if world < 2:
        return None
    kern = CM.comm_kernels(analysis)
    inst = CM.collective_instances(analysis, kern)
    bw = bandwidth_table(inst)
    k = kern.set_index("row")
    per = []
    for p in model.profiles:
        w = p.work
        c = w.index[w["is_comm"].to_numpy()] if "gpu_row" in w else w.index[:0]
        rows = w.loc[c, "gpu_row"].to_numpy() if len(c) else np.zeros(0, np.int64)
        hit = np.isin(rows, k.index.to_numpy())
        df = pd.DataFrame({"family": "", "bytes": -1, "group_size": -1}, index=c)
        if hit.any():
            kk = k.loc[rows[hit]]
            df.loc[c[hit], "family"] = kk["family"].to_numpy()
            df.loc[c[hit], "bytes"] = kk["bytes"].to_numpy()
            df.loc[c[hit], "group_size"] = kk["group_size"].to_numpy()
        per.append(df)
    run = getattr(analysis.trace, "run", None)
    routing, why = read_routing(run, model.manifest)
    lat = [float(p.work["dur"].to_numpy()[df.index.to_numpy()].min()) for p, df in zip(model.profiles, per) if len(df)]
    rates = EP.measure_rates(model.profiles, act_bytes(model.config))
    return LayoutBase(world, bw, per, routing, why, min(lat) if lat else 10_000.0, ep_rates=rates)


# ------------------------------------------------------------------------------------------ editing a rank's step
def _positions(plan) -> dict[int, int]:
    return {j: i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)) if kd == 0}


def _stage_units(w: pd.DataFrame, layer: int, backward: bool) -> np.ndarray:
    """The layer's expert-stage units of one pass (GEMMs, SwiGLU, their copies), not communication."""
    m = ((w["layer"].to_numpy() == layer) & (w["moe_stage"].to_numpy() == "moe/experts")
         & (w["backward"].to_numpy() == backward) & ~w["is_comm"].to_numpy())
    paths = w["path"].astype(str).to_numpy()
    m &= np.array(["FSDP" not in s for s in paths], dtype=bool)
    return np.flatnonzero(m)


def _a2a_units(w: pd.DataFrame, comm: pd.DataFrame) -> np.ndarray:
    """The token all-to-alls (not the counts exchange: a message of a few KiB)."""
    if comm is None or comm.empty:
        return np.zeros(0, np.int64)
    sel = comm[(comm["family"] == "all_to_all") & (comm["bytes"] > 1 << 16)]
    return sel.index.to_numpy(np.int64)


def _all_a2a(comm: pd.DataFrame) -> np.ndarray:
    if comm is None or comm.empty:
        return np.zeros(0, np.int64)
    return comm.index[comm["family"] == "all_to_all"].to_numpy(np.int64)


def _fsdp_expert_units(comm: pd.DataFrame, ag: int, rs: int) -> tuple[np.ndarray, np.ndarray]:
    if comm is None or comm.empty or (ag <= 0 and rs <= 0):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    b = comm["bytes"].to_numpy(float)
    fam = comm["family"].to_numpy()
    is_ag = (fam == "all_gather") & (np.abs(b - ag) <= 0.01 * max(ag, 1))
    is_rs = (fam == "reduce_scatter") & (np.abs(b - rs) <= 0.01 * max(rs, 1))
    return comm.index[is_ag].to_numpy(np.int64), comm.index[is_rs].to_numpy(np.int64)


def _stream_of(w: pd.DataFrame, comm: pd.DataFrame, family: str) -> int | None:
    if comm is None or comm.empty:
        return None
    idx = comm.index[comm["family"] == family]
    return int(w["stream"].iloc[idx[0]]) if len(idx) else None


def scale_expert_stages(plan, w: pd.DataFrame, r: int, rows0: dict, rows1: dict, t0: int, t1: int, ep0: int, ep1: int,
                        skip: set, layers: list[int]) -> tuple[float, dict]:
    """Each MoE layer's expert stage of rank ``r`` x its rows per token ``rows1 / t1`` over ``rows0 / t0`` (the
    tokens mechanism scaled the tokens; units in ``skip`` are left alone). Returns the device time moved (ns) and,
    per (layer, backward), the change in the rank's wait for the busiest rank of its EP group: that rank's extra
    rows at this rank's time per row, new minus the run's (``ep0`` / ``ep1``: the groups' sizes)."""
    moved = 0.0
    waits: dict[tuple[int, bool], float] = {}
    for ly in layers:
        if r not in rows0 or ly not in rows0[r]:
            continue
        f = (rows1[r][ly] / t1) / max(rows0[r][ly] / t0, 1e-9)
        g0 = range((r // ep0) * ep0, (r // ep0) * ep0 + ep0)
        g1 = range((r // ep1) * ep1, (r // ep1) * ep1 + ep1)
        for bwd in (False, True):
            js = np.asarray([j for j in _stage_units(w, ly, bwd) if int(j) not in skip], dtype=np.int64)
            if not len(js):
                continue
            before = float(sum(plan.dur[j] for j in js))
            for j in js:
                plan.dur[j] *= f
            moved += abs(before * (f - 1.0))
            # the busiest rank of the group sets the pace: its extra rows, at this rank's time per row
            per_row = before / max(rows0[r][ly] * t1 / t0, 1e-9)
            w1 = per_row * (max(rows1[s][ly] for s in g1) - rows1[r][ly]) if ep1 > 1 else 0.0
            w0 = per_row * (max(rows0[s][ly] * t1 / t0 for s in g0) - rows0[r][ly] * t1 / t0) if ep0 > 1 else 0.0
            waits[(ly, bwd)] = w1 - w0
    return moved, waits


def wait_for_busiest(plan, w: pd.DataFrame, waits: dict, a2a: np.ndarray, pos: dict, inserted: list) -> float:
    """Each (layer, pass)'s change in the wait for the busiest rank (`scale_expert_stages`) goes into the first
    token all-to-all after the stage's last unit (the collective the rank waits in), or, in a run without one, into
    ``inserted`` as a unit after the stage (where the inserted all-to-alls go). Returns the time added (ns)."""
    add = 0.0
    for (ly, bwd), dw in waits.items():
        if abs(dw) < 1.0:
            continue
        js = _stage_units(w, ly, bwd)
        last = max((pos[int(j)] for j in js if int(j) in pos), default=None)
        tgt = next((int(j) for j in a2a if pos.get(int(j), -1) > (last or -1)), None) if last is not None else None
        if tgt is not None and int(w["layer"].iloc[tgt]) == ly:
            plan.dur[tgt] = max(plan.dur[tgt] + dw, 0.0)
            add += dw
        elif last is not None and len(inserted) and dw > 0:
            inserted.append((last + 1, dw, int(plan.stream[int(js[-1])]), "exposed communication"))
            add += dw
    return add


_EP_COMP = {"fill": "copies/casts", "copy": "copies/casts", "index_copy": "copies/casts", "gather": "norms/activations",
            "where": "norms/activations"}  # the component each family's kernels fall in (profile._component)


def ep_chunk_shape(cfg: dict, tokens: int) -> tuple[int, int, int]:
    """(T, R, B) of one chunk of a micro-batch of ``tokens`` at ``cfg``'s ep > 1: tokens, routed rows, buffer rows
    (the send / receive buffer of the capacity and padded nccl paths, else the routed rows)."""
    c = chunks(cfg)
    t = tokens // c
    r = t * int(cfg["top_k"])
    return t, r, recv_buffer_rows(cfg, tokens) or r


_MOE_STAGES = ("moe/router", "moe/permute", "moe/dispatch", "moe/experts", "moe/combine", "moe/unpermute")


def shared_expert_units(plan, w: pd.DataFrame, pos: dict, layer: int, backward: bool) -> list[int]:
    """The layer's shared-expert units of one pass in a run at ep 1, in launch order: the block of units of one
    program range (``path``: the shared expert's compiled graph or module) launched right after the layer's last
    unpermute unit (forward), or right before its first unpermute-backward unit (backward), outside the MoE stages
    (trainer/model/moe.py: at ep 1 the shared expert runs after the unpermute; under EP it runs while the rows
    travel, ``_ep_forward``). Empty when there is no such block."""
    lay, stg, bk = w["layer"].to_numpy(), w["moe_stage"].astype(str).to_numpy(), w["backward"].to_numpy()
    paths = w["path"].astype(str).to_numpy()
    comm = w["is_comm"].to_numpy()
    order = [j for kd, j in zip(plan.kind, plan.ref) if kd == 0 and j < len(w)]
    at = {j: k for k, j in enumerate(order)}
    unp = [at[int(j)] for j in np.flatnonzero((lay == layer) & (stg == "moe/unpermute") & (bk == backward))
           if int(j) in at]
    if not unp:
        return []
    step = -1 if backward else 1
    k = min(unp) - 1 if backward else max(unp) + 1
    out: list[int] = []
    want = None
    while 0 <= k < len(order):
        j = order[k]
        if comm[j] or lay[j] != layer or bool(bk[j]) != backward or stg[j] in _MOE_STAGES:
            break
        if want is None:
            want = paths[j]
            if want in ("", "nan", f"layer/{layer}"):
                return []
        elif paths[j] != want:
            break
        out.append(j)
        k += step
    return out[::step] if len(out) <= 64 else []


def insert_ep_path(plan, w: pd.DataFrame, new: dict, b: LayoutBase, pos: dict, t1: int, ep1: int, waits: dict,
                   layers: list[int], inserted: list) -> tuple[float, list[str]]:
    """A run at ep 1 -> ep > 1: each MoE layer's EP path as the trainer runs it (trainer/model/moe.py ``_ep_forward``,
    trainer/model/dispatch.py). Per pass and chunk, around the layer's expert stage on its stream: before it the
    send-side kernels, the token all-to-all on a communication stream of its own (waiting for them), the receive-side
    kernels (waiting for it); after it the return regroup, the second all-to-all and the combine's kernels
    (`ep_path`: each kernel at the run's measured rates). The shared expert's units move to where the EP step runs
    them, beside an all-to-all: forward after the dispatch is sent, backward after the dispatch's gradient is sent
    (on the 4-GPU ep 4 nccl run t013 17.6 of the busiest rank's 83.5 ms of all-to-all ran under compute; those
    all-to-alls run slower beside the GEMMs, 8.3 against 6.7 ms alone, which the link's rate, `Bandwidth.link`,
    averages over). The change in this rank's wait for the busiest rank of its group (``waits``) goes on the all-to-all after the
    expert stage. The entries go into ``inserted`` as blocks (`_insert_block`). Returns the all-to-all time added
    (ns) and the lines to say."""
    n_c = chunks(new)
    ab = act_bytes(new) * int(new["d_model"])
    rows_s1 = send_rows(new, t1)
    b_new = rows_s1 / n_c * ab
    t_a2a, srcs = b.bw.seconds("all_to_all", ep1, b_new)
    T, R, B = ep_chunk_shape(new, t1)
    path = EP.path_name(new)
    rates = b.ep_rates
    ks = EP.kernels(path, T, R, B, int(new["d_model"]), act_bytes(new)) if rates is not None else []
    sc = max(plan.stream) + 1 if plan.stream else 1  # the all-to-alls' stream
    shared = int(new.get("n_shared_experts") or 0) > 0
    moved = 0
    lines: list[str] = []
    a2a_added = 0.0
    ep_dev = 0.0
    wait_added = 0.0
    for ly in layers:
        for bwd in (False, True):
            js = _stage_units(w, ly, bwd)
            ps = [pos[int(j)] for j in js if int(j) in pos]
            if not ps:
                continue
            s0 = int(plan.stream[int(js[0])])
            first, last = min(ps), max(ps)
            sh = shared_expert_units(plan, w, pos, ly, bwd) if shared else []
            sh_units = [("unit", plan.dur[j], s0, plan.comp[j], None) for j in sh]
            for j in sh:
                plan.dur[j] = 0.0
            moved += len(sh)

            dw = float(waits.get((ly, bwd), 0.0))
            before: list = []
            if not bwd:
                before.append(("unit", b.latency_ns, s0, "exposed communication", None))  # the counts exchange
            for c in range(n_c):
                before += _chunk_units(ks, rates, bwd, "send", s0)
                before.append(("unit", 0.0, s0, "other", None))  # the rows are ready
                before.append(("unit", t_a2a, sc, "exposed communication", "prev"))
            if not bwd:
                before += sh_units
            for c in range(n_c):
                before.append(("unit", 0.0, s0, "other", ("a2a", c)))  # the rows have arrived
                before += _chunk_units(ks, rates, bwd, "recv", s0)
            after: list = []
            for c in range(n_c):
                after += _chunk_units(ks, rates, bwd, "ret", s0)
                after.append(("unit", 0.0, s0, "other", None))
                after.append(("unit", t_a2a + (max(dw, 0.0) if c == 0 else 0.0), sc, "exposed communication", "prev"))
            wait_added += max(dw, 0.0)
            if bwd:
                after += sh_units
            for c in range(n_c):
                after.append(("unit", 0.0, s0, "other", ("a2a", c)))
                after += _chunk_units(ks, rates, bwd, "comb", s0)
            inserted.append((first, 0.0, s0, ("block", before)))
            inserted.append((last + 1, 0.0, s0, ("block", after)))
            a2a_added += 2 * n_c * t_a2a + max(dw, 0.0) + (0.0 if bwd else b.latency_ns)
            ep_dev += sum(u[1] for u in before + after if u[3] != "exposed communication") - sum(
                u[1] for u in sh_units)
    lines.append(f"token all-to-alls: the run has none; {4 * n_c} per MoE layer and micro-batch added on a stream of "
                 f"their own, {rows_s1 // n_c:,} rows ({b_new / 2**20:,.1f} MiB) each over {ep1} ranks at "
                 f"{t_a2a / 1e6:.2f} ms (the bus bandwidth of {srcs}: no all-to-all measured, stated as such), and one "
                 f"counts exchange per layer forward at the run's smallest collective ({b.latency_ns / 1e3:.0f} us)")
    if rates is None:
        lines.append("EP dispatch path: the run has no permute gather of token rows to take a row-move bandwidth "
                     "from: its kernels are not added")
    elif ks:
        lines.append(f"EP dispatch path ({path}, {T:,} tokens, {R:,} routed rows, a {B:,}-row buffer per chunk): "
                     f"{len(ks) * n_c} kernels per MoE layer and micro-batch, {ep_dev / 1e6:.2f} ms per step as "
                     f"profiled (row moves by bytes at {rates.bytes_src}; where / index_copy by elements at "
                     f"{rates.elems_src}); the small index kernels not added")
    else:
        lines.append(f"EP dispatch path ({path}): none of its kernels modeled (the symm path's copies), not added")
    if moved:
        lines.append(f"the shared expert's {moved} units moved beside the all-to-alls (forward: while the rows travel; "
                     "backward: while the dispatch's gradient does), as the EP step runs them")
    if wait_added:
        lines.append(f"load imbalance: {wait_added / 1e6:.2f} ms per step of waiting for the busiest rank of the EP "
                     "group (its rows at this rank's time per row) on the all-to-all after each expert stage")
    return a2a_added, lines


def _chunk_units(ks: list, rates, bwd: bool, where: str, stream: int) -> list:
    """One chunk's EP path kernels of one pass at one place, as block units (`_insert_block`)."""
    return [("unit", EP.seconds(k, rates), stream, _EP_COMP.get(k.name, "other"), None)
            for k in ks if k.backward == bwd and k.where == where]


def _insert_block(plan, at: int, units: list) -> None:
    """Insert a block of new units launched at item position ``at``, in order. Each unit: ``("unit", ns, stream,
    comp, dep)``; ``dep``: None, ``"prev"`` (the unit before it in the block) or ``("a2a", c)`` (the block's c-th
    unit on another stream than its first unit's: its c-th all-to-all)."""
    made: list[int] = []
    s0 = units[0][2] if units else 0
    a2a_new: list[int] = []
    for k, (_, ns, stream, comp, dep) in enumerate(units):
        j = plan.add_unit(float(ns), int(stream), comp, 0.0, at + k)
        if dep == "prev" and made:
            plan.dep[j] = made[-1]
        elif isinstance(dep, tuple) and dep[1] < len(a2a_new):
            plan.dep[j] = a2a_new[dep[1]]
        if stream != s0:
            a2a_new.append(j)
        made.append(j)


def fsdp_copy_factors(dp0: int, ep0: int, dp1: int, ep1: int) -> dict[str, float]:
    """Each FSDP copy kernel of the experts (by op) x its new / old size under (ep0, dp0) -> (ep1, dp1)
    (`scale_fsdp_expert_copies`). From a run at dp 1 (no copy-in, no copy-out; a parameter copy of its own) all
    stay: its gradients' copy-in alone x ep0/ep1 without the copies dp > 1 adds moved the grid's ep 4 baselines
    further from their ep 1 / ep 2 points (up to 1 point)."""
    if dp0 == 1:
        return {"aten::_chunk_cat": 1.0, "aten::split_with_sizes_copy": 1.0, "aten::_foreach_copy_": 1.0}
    return {"aten::_chunk_cat": ep0 / ep1,
            "aten::split_with_sizes_copy": (ep0 / ep1) if dp1 > 1 else 0.0,
            "aten::_foreach_copy_": (ep0 * dp0) / (ep1 * dp1) if dp1 > 1 else 0.0}


def fsdp_expert_copies(w: pd.DataFrame) -> dict[str, np.ndarray]:
    """The experts' FSDP copy units of a step profile by op (`fsdp_copy_factors`' ops)."""
    paths = w["path"].astype(str).to_numpy()
    ops = w["op"].astype(str).to_numpy()
    comm = w["is_comm"].to_numpy()
    ok = ~comm & np.array(["FSDP::" in p and "experts" in p for p in paths], dtype=bool)
    return {op: np.flatnonzero(ok & (ops == op)) for op in fsdp_copy_factors(1, 1, 1, 1)}


#: the experts' FSDP copy ops that go with an all-gather (its copy-in and copy-out): FSDP2 gathers the parameters in
#: every micro-batch's forward and backward (reshard after forward), also under ``set_requires_gradient_sync(False)``;
#: the reduce-scatter's copy-in (``_chunk_cat``) runs once per step, with the one reduction
FSDP_GATHER_COPY_OPS = ("aten::split_with_sizes_copy", "aten::_foreach_copy_")


def fsdp_gather_units(w: pd.DataFrame) -> np.ndarray:
    """Mask of a step profile's FSDP work that repeats per micro-batch under gradient accumulation: the device work
    (not communication) under an ``FSDP::`` range other than the post-backward's (``FSDP::pre_forward``,
    ``pre_backward``, ``all_gather``, ``all_gather_copy_out``, ``backward_prefetch``, ``cast_forward_inputs``: the
    parameters' all-gather copy-in / copy-out and casts, run by FSDP2 in every micro-batch's forward and backward);
    the post-backward's (``post_backward_reduce`` / ``_reshard`` / ``_accumulate``, the root's callback) run with the
    step's one reduction. On the 4 x H100 dp 4 runs at micro-batch 8 (tests/fixtures/h100_4gpu_accum): 7.9 ms a step
    with one micro-batch, 27.5 ms with three."""
    paths = w["path"].astype(str).to_numpy()
    comm = w["is_comm"].to_numpy().astype(bool)
    return ~comm & np.array(["FSDP::" in p and "post_backward" not in p for p in paths], dtype=bool)


def grad_clip_units(w: pd.DataFrame) -> np.ndarray:
    """Mask of a step profile's gradient clipping (trainer/train.py's ``clip_grad_norm``): the device work, not
    communication nor under an ``FSDP::`` range, launched after the step's last backward unit (FSDP2's post-backward
    included) and before its first optimizer unit: each gradient's ``pow`` / ``sum`` and ``mul_``, the norm's small
    kernels. It runs over the rank's local gradients, the parameters' shard under FSDP2 (like the optimizer), once a
    step. On the committed 4 x H100 runs (raw traces, rank 0): 17.1 ms on 1 GPU (2,255 M gradient elements), 8.7-8.8 on
    the two 2-GPU runs (1,127 M), 4.5-4.8 at dp 4 (564 M); an empty mask without an optimizer unit."""
    n = len(w)
    if n == 0 or "launch" not in w:
        return np.zeros(n, dtype=bool)
    comp = w["component"].astype(str).to_numpy()
    paths = w["path"].astype(str).to_numpy()
    launch = w["launch"].to_numpy(float)
    comm = w["is_comm"].to_numpy().astype(bool)
    opt = comp == "optimizer step"
    bwd = w["backward"].to_numpy().astype(bool) | np.array(["post_backward" in p for p in paths], dtype=bool)
    if not opt.any() or not bwd.any():
        return np.zeros(n, dtype=bool)
    lo, hi = launch[bwd].max(), launch[opt].min()
    fsdp = np.array(["FSDP::" in p for p in paths], dtype=bool)
    return (launch > lo) & (launch < hi) & ~comm & ~opt & ~fsdp


def scale_fsdp_expert_copies(plan, w: pd.DataFrame, old: dict, new: dict, world: int, ds: float) -> str:
    """The experts' FSDP copy kernels (FSDP2's, trainer/parallel/dist.py: the units under an ``FSDP::`` range of an
    ``experts`` module) under another (ep, dp): the reduce-scatter's copy-in of the gradients (``_chunk_cat``) covers
    the rank's ``E/ep`` experts at any dp; the all-gather's copy-out (``split_with_sizes_copy``) the same, at dp > 1
    only; its copy-in (``_foreach_copy_``) the rank's shard ``E/(ep dp)``, at dp > 1 only. Each x its new / old
    size (0 at dp 1). On the 4 x H100 grid's runs, per step: 5.58 / 2.74 / 1.34 ms of ``_chunk_cat`` at ep 1 / 2 /
    4, 4.69 / 2.33 / 0 of copy-out at dp 4 / 2 / 1, 7.51 / 7.94 / 0.32 of copy-in at a shard of 16 / 16 experts / dp
    1. The parameter copy FSDP makes at dp 1 (4.0 ms a step at ep 4) is not added from a run at dp > 1; a run at dp 1
    keeps its copies as they are (`fsdp_copy_factors`). Returns the line to say, or ""."""
    dp0, ep0 = dims(old, world)
    dp1, ep1 = dims(new, world)
    f = fsdp_copy_factors(dp0, ep0, dp1, ep1)
    if dp0 == 1:
        return ""
    before = after = 0.0
    n = 0
    for op, js in fsdp_expert_copies(w).items():
        for j in js:
            before += plan.dur[j]
            plan.dur[j] *= f[op]
            after += plan.dur[j]
            n += 1
    if not n:
        return ""
    what = ", ".join(f"{k.split('::')[-1]} x{v:.2f}" for k, v in f.items())
    return (f"FSDP of the experts, copies: {n} copy-in / copy-out kernels ({what}"
            f" by the experts' size per rank and shard): {ds * before / 1e6:.2f} -> {ds * after / 1e6:.2f} ms; FSDP's "
            "parameter copy at dp 1 not added")


def changes_layout(change: Change) -> bool:
    """Whether a what-if changes the expert / data parallel layout (then this mechanism owns the token all-to-alls)."""
    return any(change.old.get(k) != change.target.get(k) for k in LAYOUT_KEYS)


@register
class Layout(Mechanism):
    name = "layout"
    keys = LAYOUT_KEYS
    sigma = {"layout_rows": 0.10, "layout_a2a": 0.20, "layout_fsdp": 0.15}
    order = 55.0  # after tokens (20), the backend (40) and the sync-free level (50): on their durations
    summary = ("expert rows per rank from the routing counts (the busiest rank sets the pace), token all-to-alls and "
               "the experts' FSDP traffic at the run's measured bus bandwidth per size and group")

    def applies(self, change: Change) -> bool:
        return changes_layout(change)

    @staticmethod
    def base(change: Change) -> LayoutBase:
        b = getattr(change.model, "measured", {}).get("layout")
        if b is None:
            raise WhatIfError(f"{change.model.run}: a layout change needs a multi-GPU run with its collectives "
                              "(world size 1, or no communication kernels in the profiled step)")
        return b

    def measure(self, model, analysis) -> None:
        model.measured["layout"] = measure(model, analysis)

    def edit(self, plan, p, change: Change) -> float:
        model, old, new = change.model, change.old, change.new
        b = self.base(change)
        if int(old.get("pp") or 1) > 1 or int(new.get("pp") or 1) > 1:
            raise WhatIfError("layout: ep / dp of a pipelined run (pp > 1) is not modeled")
        world = b.world
        dp0, ep0 = dims(old, world)
        dp1, ep1 = dims(new, world)
        if ep0 > 1 and ep1 > 1 and chunks(old) != chunks(new):
            # the overlap mechanism (overlap.py) re-cuts the chunks after this edit: sized here in the run's chunks
            new = {**new, "ep_overlap": old.get("ep_overlap"), "ep_overlap_chunks": old.get("ep_overlap_chunks")}
        if ep0 > 1 and ep1 == 1 and chunks(old) > 1:
            change.notes.append(f"layout: the run's {chunks(old)} dispatch chunks ran the expert stage in {chunks(old)} "
                                "pieces; at ep 1 they merge (their launches are kept)")
        pi = next(i for i, q in enumerate(model.profiles) if q is p)
        comm = b.comm[pi]
        w = p.work
        ds = change.device_scale
        t0, t1 = change.t0, change.t1
        old_trainer = not gemms_stop_at_routed_rows(model.manifest)
        rows0 = expert_rows(old, world, t0, b.routing, old_trainer, experts_by_rank(old, ep0, b.routing, old))
        rows1 = expert_rows(new, world, t1, b.routing, old_trainer, experts_by_rank(new, ep1, b.routing, old))
        r = p.rank
        var = 0.0
        lines = []
        pos = _positions(plan)
        # ---- the receive buffer's row-shaped kernels (regroup gathers, their backward scatters, activations on the
        # whole buffer): x the buffer's rows per token (the tokens mechanism scaled the tokens)
        buf0, buf1 = recv_buffer_rows(old, t0), recv_buffer_rows(new, t1)
        shaped = np.flatnonzero(_row_shaped(w, {buf0})) if buf0 else np.zeros(0, np.int64)
        shaped = shaped[~w["expert"].to_numpy()[shaped]] if len(shaped) else shaped
        if len(shaped):
            fb = (buf1 / t1) / (buf0 / t0)
            sb = float(sum(plan.dur[j] for j in shaped))
            for j in shaped:
                plan.dur[j] *= fb
            lines.append(f"the EP receive buffer: {buf1:,} rows per chunk instead of {buf0:,}: its {len(shaped)} "
                         f"row-shaped kernels (regroup, scatter, activations on the buffer) {ds * sb / 1e6:.2f} -> "
                         f"{ds * sb * fb / 1e6:.2f} ms, linear in rows")
        skip = set(shaped.tolist())
        # ---- expert rows: each layer's expert stage x rows per token (the tokens mechanism scaled the tokens)
        moved, waits = scale_expert_stages(plan, w, r, rows0, rows1, t0, t1, ep0, ep1, skip, moe_layers(old))
        mean0 = np.mean([rows0[r][ly] for ly in rows0.get(r, {})]) if rows0.get(r) else 0.0
        mean1 = np.mean([rows1[r][ly] for ly in rows1.get(r, {})]) if rows1.get(r) else 0.0
        src = b.routing.basis if b.routing is not None else f"uniform T*k/ep per peer ({b.routing_note})"
        lines.append(f"layout ep {ep0} -> {ep1} (dp {dp0} -> {dp1}): rank {r}'s experts compute {mean1:,.0f} rows per "
                     f"MoE layer and micro-batch instead of {mean0 * t1 / t0:,.0f} ({src}); the expert stage x its rows "
                     f"at the run's time per row")
        var += (self.sigma["layout_rows"] * moved / max(float(p.step_ns), 1.0)) ** 2
        # ---- token all-to-alls
        a2a = _a2a_units(w, comm)
        rows_s0, rows_s1 = send_rows(old, t1), send_rows(new, t1)
        ab = act_bytes(new) * int(new["d_model"])
        a2a_before = float(sum(plan.dur[j] for j in _all_a2a(comm)))
        inserted: list[tuple[int, float, int, str]] = []  # (position, ns, stream, comp)
        dp_to_ep, a2a_added = False, 0.0
        if ep1 == 1:
            # the dispatch and combine stages (and the receive-side regroup) run only under EP: their kernels and
            # the host time before each of their launches go
            stage = w["moe_stage"].to_numpy()
            gone = set(_all_a2a(comm).tolist()) | skip | set(np.flatnonzero(np.isin(stage, ("moe/dispatch",
                                                                                              "moe/combine"))).tolist())
            host = 0.0
            for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)):
                if kd == 0 and j in gone:
                    host += plan.gap[i]
                    plan.gap[i] = 0.0
                    plan.gap_x[i] = 0.0
            dev = float(sum(plan.dur[j] for j in gone))
            for j in gone:
                plan.dur[j] = 0.0
            lines.append(f"EP dispatch at ep 1: the dispatch / combine stages and the receive-side regroup go: "
                         f"{len(gone)} kernels ({len(_all_a2a(comm))} all-to-alls), {ds * dev / 1e6:.2f} ms of device "
                         f"and {host / 1e6:.2f} ms of the profiled host time")
        elif len(a2a):
            # the run's all-to-alls, from their measured durations (the tokens' change is in the new bytes)
            dur0 = w["dur"].to_numpy(float)
            n_per = max(round(len(a2a) / (4 * len(moe_layers(old)) * int(old.get("microbatches") or 1))), 1)
            b_new = rows_s1 / n_per * ab
            t_new, srcs = b.bw.seconds("all_to_all", ep1, b_new)
            for j in a2a:
                b_old = float(comm.at[j, "bytes"])
                t_old, _ = b.bw.seconds("all_to_all", ep0, b_old)
                plan.dur[j] = dur0[j] * (t_new / t_old) if t_old > 0 else t_new
            lines.append(f"token all-to-alls: {rows_s1:,} rows per micro-batch instead of {rows_s0:,} "
                         f"({'capacity' if new.get('ep_dispatch') == 'capacity' else 'nccl'}), "
                         f"{b_new / 2**20:,.1f} MiB each over {ep1} ranks at the bus bandwidth of {srcs}")
        else:
            # a run without token all-to-alls (ep 1): the EP path as the trainer runs it (`insert_ep_path`)
            a2a_added, ep_lines = insert_ep_path(plan, w, new, b, pos, t1, ep1, waits, moe_layers(old), inserted)
            lines.extend(ep_lines)
            dp_to_ep = True
        # ---- load imbalance: the wait for the busiest rank goes into the all-to-all after the expert stage
        if ep1 > 1 and not dp_to_ep:
            add = wait_for_busiest(plan, w, waits, a2a, pos, inserted)
            if abs(add) > 0:
                lines.append(f"load imbalance: rank {r} waits {ds * add / 1e6:+.2f} ms per step for the busiest rank "
                             "of its EP group (its rows at this rank's time per row), against the run's")
        # ---- FSDP of the experts
        ag0, rs0, n0 = fsdp_expert_bytes(old, world)
        ag1, rs1, n1 = fsdp_expert_bytes(new, world)
        if (ep0, dp0) != (ep1, dp1):
            line = scale_fsdp_expert_copies(plan, w, old, new, world, ds)
            if line:
                lines.append(line)
        if (ag0, rs0, n0) != (ag1, rs1, n1):
            u_ag, u_rs = _fsdp_expert_units(comm, ag0, rs0)
            f_before = float(sum(plan.dur[j] for j in np.concatenate([u_ag, u_rs])))
            t_ag, s_ag = b.bw.seconds("all_gather", n1, ag1)
            t_rs, s_rs = b.bw.seconds("reduce_scatter", n1, rs1)
            if len(u_ag) or len(u_rs):
                for j in u_ag:
                    plan.dur[j] = t_ag
                for j in u_rs:
                    plan.dur[j] = t_rs
                lines.append(f"FSDP of the experts: {len(u_ag)} all-gathers of {ag0 / 2**20:,.0f} -> {ag1 / 2**20:,.0f} "
                             f"MiB and {len(u_rs)} reduce-scatters of {rs0 / 2**20:,.0f} -> {rs1 / 2**20:,.0f} MiB per "
                             f"step over {n1} ranks" + (f" ({s_ag}; {s_rs})" if n1 > 1 else " (none at dp 1)")
                             + f": {ds * f_before / 1e6:.2f} -> {ds * (len(u_ag) * t_ag + len(u_rs) * t_rs) / 1e6:.2f} ms")
            elif n1 > 1:
                s_ag_stream, s_rs_stream = _stream_of(w, comm, "all_gather"), _stream_of(w, comm, "reduce_scatter")
                if s_ag_stream is None or s_rs_stream is None:
                    raise WhatIfError("layout: the run has no FSDP all-gather / reduce-scatter to place the experts' on")
                fsdp_ins = []
                for ly in moe_layers(old):
                    for bwd in (False, True):
                        js = _stage_units(w, ly, bwd)
                        ps = sorted(pos[int(j)] for j in js if int(j) in pos)
                        if not ps:
                            continue
                        first_j = min((int(j) for j in js if int(j) in pos), key=lambda j: pos[j])
                        last_j = max((int(j) for j in js if int(j) in pos), key=lambda j: pos[j])
                        fsdp_ins.append((ps[0], t_ag, s_ag_stream, first_j, "wait"))
                        if bwd:
                            fsdp_ins.append((ps[-1] + 1, t_rs, s_rs_stream, last_j, "after"))
                for at, ns, stream, anchor, how in fsdp_ins:
                    inserted.append((at, ns, stream, ("fsdp", anchor, how)))
                lines.append(f"FSDP of the experts: the run has none (dp 1); per MoE layer 2 all-gathers of "
                             f"{ag1 / 2**20:,.0f} MiB ({t_ag / 1e6:.2f} ms, {s_ag}) and a reduce-scatter of "
                             f"{rs1 / 2**20:,.0f} MiB ({t_rs / 1e6:.2f} ms, {s_rs}) over {n1} ranks added")
            var += (self.sigma["layout_fsdp"] * abs(f_before - (len(u_ag) * t_ag + len(u_rs) * t_rs))
                    / max(float(p.step_ns), 1.0)) ** 2
        # ---- insert the new units, from the last position back (earlier positions stay valid)
        for at, ns, stream, comp in sorted(inserted, key=lambda x: -x[0]):
            if isinstance(comp, tuple) and comp[0] == "block":
                _insert_block(plan, at, comp[1])
            elif isinstance(comp, tuple):
                _, anchor, how = comp
                j = plan.add_unit(ns, stream, "exposed communication", 0.0, at)
                if how == "wait":
                    plan.dep[anchor] = j
                else:
                    plan.dep[j] = anchor
            else:
                plan.add_unit(ns, stream, comp, 0.0, at)
        a2a_after = float(sum(plan.dur[j] for j in _all_a2a(comm))) + a2a_added + sum(
            x[1] for x in inserted if not isinstance(x[3], tuple))
        var += (self.sigma["layout_a2a"] * abs(a2a_after - a2a_before) / max(float(p.step_ns), 1.0)) ** 2
        change.modeled.extend(lines)
        return var

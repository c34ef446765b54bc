"""Scale-out projection: a 1-4 GPU profile projected to 8, 16, 64 ... 1,024 GPUs over several nodes.

    >>> from tracelens.projection.scaleout import ScaleOut
    >>> so = ScaleOut.from_run("runs/ep4", network_path="net.yaml")      # or gpus_per_node=8, inter_node_gbps=400
    >>> p = so.project(64, {"ep": 8})                                      # trainer keys; dp follows: 64 / (pp ep)
    >>> p.tokens_per_s_per_gpu, p.step_s, p.components, p.a2a_share, p.bubble, p.peak_gib, p.fits
    >>> so.scaling([8, 16, 64, 1024])                                       # the run's layout at every count
    >>> so.ep_scaling([8, 64], eps=[1, 2, 4, 8, 16]); so.bubbles(64, pps=[2, 4])

How (docs/whatif.md, "Scale-out projection and the planner"). The per-GPU work of a target layout is built from the
run's own pieces, each by an existing mechanism:

1. **Anchor**: the what-if model (`whatif.Model`) predicts the target's non-layout keys (micro-batch, backend,
   sync-free level, dispatch path, ...) on the run's own GPUs, at the expert parallelism nearest the target's that the
   run's GPUs hold (``ep`` dividing the world size and the experts); a pipelined run keeps its own layout there. That
   prediction is calibrated to the run's measured step time: projected to the run's own layout, the projection is the
   what-if's (and so the measurement).
2. **Per micro-batch work** per piece (``embedding``, ``layer<i>``, ``loss``; forward and full backward): the
   pipeline-layout mechanism's piece costs (`mechanisms.pp_layout.piece_costs_from_profile`, or a pipelined run's
   measured stage actions, `pipeline_whatif.pipeline_base`), normalised so that the anchor's step is reproduced.
   Each MoE layer's expert stage (`mechanisms.layout._stage_units`) scales with the rows the busiest rank of the new
   EP group computes (`mechanisms.layout.expert_rows`, the run's routing counts averaged over its ranks; capacity and
   padded buffers by the dispatch path); each MoE layer's token all-to-alls (`layout.send_rows`, 4 per micro-batch and
   chunk) cost the network model's all-to-all over the new EP group; what the anchor hid of its own all-to-alls stays
   hidden, the rest of the change is exposed.
3. **Pipeline**: the new stages by the trainer's layout rules and the schedule replayed by the pipeline what-if's
   simulator (`pipeline_whatif.schedule_actions` / `_replay`), one hand-off per stage boundary: the activations over
   the network (across nodes when the world spans nodes), plus a pipelined run's calibrated per-hand-off overhead.
4. **Rest of the step**: the data-parallel collectives of the new layout (`analysis.memory.dp_collectives`: FSDP
   gathers / reduce-scatters or DDP's all-reduce, dense over the stage's replicas, experts over the ranks holding the
   same experts) at the network model's hierarchical cost, exposed beyond the compute they overlap, on top of what
   the anchor's trace exposed: under FSDP (pp 1) placed per unit in the anchor's replayed step by FSDP2's rules
   (`fsdp_overlap`: no forward prefetch, one unit ahead in backward, one gather ahead of its use), under DDP beyond
   the last micro-batch's backward, under a pipelined FSDP beyond the window; the optimizer x the busiest stage's
   parameters per GPU (`pp_layout.optimizer_params`); the run's per-step work.
5. **Memory** per GPU: the memory projection of the target (`analysis.memory.project`), x the run's measured /
   projected peak.

Every projection names its run and the anchor it was predicted from; projections at more GPUs than the run had are
unvalidated (nothing measured them), and those over several nodes rest on the network file's (or the assumed)
inter-node figures.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moespec.config import DEFAULTS, ConfigError, load_config, resolve_world
from moespec.schedules import MODELED, V_SHAPED

from ..errors import TraceError
from . import ep_path as EP
from . import fsdp_overlap as FO
from . import network as N
from . import pipeline_whatif as PW
from .mechanisms import layout as L
from .mechanisms import pp_layout as PPL
from .mechanisms.base import WhatIfError

#: the bubble table's schedules (every modeled one but GPipe, which holds every micro-batch's activations) and the
#: vpp each runs at: 2 for the interleaved and the V-shaped ones, 1 for the others
_BUBBLE_SCHEDULES = tuple((s, 2 if s == "vpp" or s in V_SHAPED else 1) for s in MODELED if s != "gpipe")

# trainer keys the scale-out projection sets itself (the rest go to the what-if anchor)
LAYOUT_KEYS = ("ep", "dp", "pp", "vpp", "pipeline_schedule", "pipeline_layout", "pipeline_layer_costs", "microbatches",
               "dp_mode")
_EP_ONLY = ("ep_dispatch", "ep_capacity_factor", "ep_overlap", "ep_overlap_chunks")
# FSDP2's gradient accumulation (`ScaleOut.grad_accum_ns`): bytes a parameter of the first micro-batch's cast of the
# unsharded bf16 gradient to fp32 (read 2, write 4), and of each later micro-batch's add (read 2 + 4, write 4)
_ACC_CAST_BYTES = 6
_ACC_ADD_BYTES = 10
COMPONENTS = ("compute", "expert stage", "all-to-all (exposed)", "pipeline bubble", "dp traffic (exposed)",
              "optimizer step", "other per-step work")
GIB = float(1 << 30)


class ScaleOutError(WhatIfError):
    """A projection that cannot be made: one line naming the run, key or flag and why."""


@dataclass
class Projection:
    """One projected layout on ``gpus`` GPUs (times in seconds)."""

    run: str
    gpus: int
    nodes: int
    layout: dict  # dp, ep, pp, vpp, schedule, microbatches, micro_batch_size
    changes: dict  # the trainer keys asked for (beyond the run's config)
    step_s: float
    tokens_per_s_per_gpu: float
    components: dict  # COMPONENTS -> s, adding up to step_s
    a2a_s: float  # modeled all-to-all time per step of the busiest rank (all of it, hidden or not)
    dp_comm_s: float  # modeled data-parallel collective time per step (all of it)
    bubble: float  # pipeline bubble / step
    peak_bytes: float | None
    capacity_bytes: float | None
    anchor: dict  # the what-if changes predicted on the run's GPUs
    anchor_gpus: int
    validated: bool  # the run's own GPU count or fewer: the what-if's measured accuracy applies
    notes: list = field(default_factory=list)

    @property
    def a2a_share(self) -> float:
        """Exposed all-to-all time / step."""
        return self.components.get("all-to-all (exposed)", 0.0) / self.step_s if self.step_s > 0 else 0.0

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_bytes is None else self.peak_bytes / GIB

    @property
    def fits(self) -> bool:
        return self.peak_bytes is None or self.capacity_bytes is None or self.peak_bytes <= self.capacity_bytes

    @property
    def status(self) -> str:
        return "projection" if self.validated else "projection, unvalidated"

    def label(self) -> str:
        lay = self.layout
        pp = f" pp{lay['pp']}" + (f" vpp{lay['vpp']}" if lay["vpp"] > 1 else "") + f" {lay['schedule']}" \
            if lay["pp"] > 1 else ""
        return f"dp{lay['dp']} ep{lay['ep']}{pp} mbs{lay['micro_batch_size']} m{lay['microbatches']}"

    def as_dict(self) -> dict:
        return {"run": self.run, "gpus": self.gpus, "nodes": self.nodes, "layout": self.layout, "label": self.label(),
                "changes": self.changes, "step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "components_ms": {k: 1e3 * v for k, v in self.components.items()}, "a2a_s": self.a2a_s,
                "a2a_share": self.a2a_share, "dp_comm_s": self.dp_comm_s, "bubble": self.bubble,
                "peak_gib": self.peak_gib, "capacity_gib": None if self.capacity_bytes is None
                else self.capacity_bytes / GIB, "fits": self.fits, "anchor": self.anchor,
                "anchor_gpus": self.anchor_gpus, "status": self.status, "notes": self.notes}


@dataclass
class _Anchor:
    """The what-if prediction on the run's GPUs a projection starts from, cut into per-micro-batch pieces."""

    changes: dict
    config: dict
    step_ns: float
    pieces: dict  # kind -> (forward {piece: ns}, backward {piece: ns}); kinds compute, expert, a2a
    microbatches: int
    opt_ns: float
    fixed_ns: float  # per-step work outside the pieces (not optimizer, not communication), at the anchor's micro-batches
    dp_exposed_ns: float  # the exposed data-parallel traffic the anchor's step holds
    dp_model_ns: float  # what the network model exposes of the anchor's own data-parallel traffic
    a2a_hidden: float  # share of the anchor's modeled all-to-all time its step hid
    handoff_ns: float  # a pipelined run's calibrated overhead per hand-off (0 otherwise)
    beta: float | None
    notes: list
    fsdp_mb_ns: float = 0.0  # of fixed_ns: FSDP's all-gather copies and casts per micro-batch (they repeat with them)
    fsdp_rep: object = None  # the slowest rank's replay of the anchor (`fsdp_overlap`), None for a pipelined run
    fsdp_model_ns: float | None = None  # what `fsdp_overlap` exposes of the anchor's own FSDP traffic
    clip_ns: float = 0.0  # of fixed_ns: the gradient clipping (`layout.grad_clip_units`), over the rank's gradient shard


def _first_numel(dims: str) -> int:
    """Elements of the first input of a recorded op's ``Input Dims`` text (``[[2, 209716224], [], ...]`` -> 419432448);
    0 when it has none."""
    m = re.match(r"\s*\[\s*\[([0-9,\s]+)\]", dims)
    if not m:
        return 0
    return int(np.prod([int(x) for x in m.group(1).split(",") if x.strip()]))


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def _mem_cfg(cfg: dict) -> dict:
    """``cfg`` as the memory projection takes it: a V-shaped schedule (zbv: two stages per rank, vpp 2 in the trainer)
    at vpp 1 with its V placement (the same layers per rank; the projection's layout check takes vpp > 1 for the
    interleaved schedule only)."""
    if int(cfg.get("pp") or 1) > 1 and cfg.get("pipeline_schedule") == "zbv" and int(cfg.get("vpp") or 1) == 2:
        return {**cfg, "vpp": 1}
    return cfg


class ScaleOut:
    """Projections of one profiled run to other GPU counts and layouts (:meth:`project`)."""

    def __init__(self, model, net: N.Network, routing: L.Routing | None, routing_note: str):
        self.model = model
        self.net = net
        self.run = model.run
        self.world = L.world_of(model.manifest)
        self.config = model.config
        self.routing = routing
        self.routing_note = routing_note
        self.padded_l3 = not L.gemms_stop_at_routed_rows(model.manifest)
        self._anchors: dict = {}
        self._fsdp: dict = {}
        self._acc: tuple[float, str] | None = None  # `_acc_rate`, once
        self._co_rate: tuple[float, str] | None = None  # `copy_out_rate`, once
        self._mean = self._mean_routing()
        b = model.measured.get("layout")
        self.ep_rates = b.ep_rates if b is not None else EP.measure_rates(model.profiles, L.act_bytes(model.config))

    # ------------------------------------------------------------------ building
    @classmethod
    def from_run(cls, run, network_path: str | Path | None = None, kernel_table: str | Path | None = None,
                 capacity_gib: float | None = None, **net_flags) -> ScaleOut:
        """The projection of one profiled run dir (manifest + traces; routing.json when it has one). ``net_flags``:
        the network fields (`network.FIELDS`) given on the command line, over ``network_path``'s."""
        import tracelens

        from .whatif import Model

        net = N.network(path=network_path, **net_flags)  # bad network input fails before the trace is read
        p = Path(run)
        if not p.is_dir():
            raise ScaleOutError(f"{p}: not a run dir (expected a directory with manifest.json and traces/)")
        try:
            analysis = tracelens.analyze(tracelens.load(p, progress=False))
        except FileNotFoundError:
            raise ScaleOutError(f"{p}: no trace files (the projection replays a profiled step)") from None
        except TraceError as e:
            raise ScaleOutError(e.one_line()) from None
        model = Model.from_run(p, kernel_table=kernel_table, capacity_gib=capacity_gib, analysis=analysis)
        b = model.measured.get("layout")
        if b is not None:
            routing, why = b.routing, b.routing_note
        else:
            routing, why = L.read_routing(getattr(analysis.trace, "run", None), model.manifest)
        intra, what = N.measured_intra(model)
        net = N.Network(**{**{f: getattr(net, f) for f in N.FIELDS}, "intra": intra, "intra_source": what,
                           "sources": net.sources})
        return cls(model, net, routing, why)

    def _mean_routing(self) -> dict | None:
        """Per MoE layer: the run's tokens per global expert per forward, averaged over its ranks."""
        if self.routing is None:
            return None
        out: dict = {}
        for ly in L.moe_layers(self.config):
            got = [c[ly] for c in self.routing.counts.values() if ly in c]
            if got:
                out[ly] = np.mean(np.stack(got), axis=0)
        return out or None

    # ------------------------------------------------------------------ the pieces of a layout
    def busiest_rows(self, cfg: dict, tokens: int) -> float:
        """Rows the busiest rank of an EP group of ``cfg`` computes per MoE layer and micro-batch of ``tokens``
        (mean over the MoE layers): `layout.expert_rows` over one EP group, every source rank routing as the run's
        ranks did on average."""
        ep = int(cfg["ep"])
        one = {**cfg, "dp": 1, "pp": 1}
        routing = None
        if self._mean is not None:
            routing = L.Routing({s: self._mean for s in range(ep)}, self.routing.basis if self.routing else "")
        rows = L.expert_rows(one, ep, tokens, routing, self.padded_l3)
        per = [max(rows[r][ly] for r in rows) for ly in L.moe_layers(cfg) if ly in rows[0]]
        return float(np.mean(per)) if per else 0.0

    def a2a_layer_ns(self, cfg: dict, tokens: int) -> tuple[float, float]:
        """(forward, backward) ns of one MoE layer's token all-to-alls per micro-batch: 2 per pass and chunk of the
        path's send buffer (`layout.send_rows`) x d_model x the activation bytes, over the EP group (consecutive
        ranks) on the network model."""
        ep = int(cfg["ep"])
        if ep <= 1:
            return 0.0, 0.0
        c = L.chunks(cfg)
        nbytes = L.send_rows(cfg, tokens) / c * int(cfg["d_model"]) * L.act_bytes(cfg)
        t = 2 * c * self.net.all_to_all(nbytes, ep)
        return t, t

    def ep_path_ns(self, cfg: dict, tokens: int) -> tuple[float, float, int]:
        """(forward, backward) ns per MoE layer and micro-batch of the EP dispatch path's own kernels of ``cfg``
        (`ep_path`: each path's row moves at this run's measured rates, calibrated like the run's step), and how many
        kernels; zeros at ep 1 or without the run's rates."""
        ep = int(cfg.get("ep") or 1)
        if ep <= 1 or self.ep_rates is None:
            return 0.0, 0.0, 0
        T, R, B = L.ep_chunk_shape(cfg, tokens)
        f, b, n = EP.layer_ns(EP.path_name(cfg), T, R, B, int(cfg["d_model"]), L.act_bytes(cfg), L.chunks(cfg),
                              self.ep_rates)
        ds = float(np.median(self.model.device_scale)) if len(self.model.device_scale) else 1.0
        return f * ds, b * ds, n

    def fsdp_copies_ns(self, cfg: dict, gpus: int) -> tuple[float, float]:
        """ns per step, at the run's micro-batches, of the experts' FSDP copy kernels under ``cfg`` on ``gpus`` GPUs:
        (the all-gathers' copy-in / copy-out, `layout.FSDP_GATHER_COPY_OPS`, which repeat per micro-batch; the
        reduce-scatter's copy-in, once per step): the run's own (its slowest rank's, calibrated) x their size under
        the new (ep, dp) (`layout.fsdp_copy_factors`); 0 for a pipelined run. A run at dp 1 has no copies of the
        experts' gathers to scale: `expert_copy_out_ns` gives their copy-outs at dp > 1."""
        model = self.model
        if int(self.config.get("pp") or 1) > 1 or int(cfg.get("pp") or 1) > 1 or not model.profiles:
            return 0.0, 0.0
        slow = int(np.argmax([sum(c.values()) for c in model.base_by_rank])) if model.base_by_rank else 0
        p = model.profiles[slow]
        dur = p.work["dur"].to_numpy(float) * model.device_scale[slow]
        dp0, ep0 = L.dims(self.config, self.world)
        try:
            dp1, ep1 = resolve_world(cfg, gpus)
        except ConfigError:
            return 0.0, 0.0
        f = L.fsdp_copy_factors(dp0, ep0, dp1, ep1)
        # the all-gathers' copies repeat per chunk of the EP dispatch (FSDP2 gathers the experts once per call)
        c = L.chunks(cfg) / L.chunks(self.config)
        f = {op: v * (c if op in L.FSDP_GATHER_COPY_OPS else 1.0) for op, v in f.items()}
        ns = {op: float(dur[js].sum() * f[op]) for op, js in L.fsdp_expert_copies(p.work).items()}
        gather = sum(v for op, v in ns.items() if op in L.FSDP_GATHER_COPY_OPS)
        return gather, sum(ns.values()) - gather

    def copy_out_rate(self) -> tuple[float, str]:
        """(bytes per calibrated ns, its source) of FSDP2's all-gather copy-out (``split_with_sizes_copy`` under an
        ``FSDP::`` range, on the compute stream) on the run's GPU: the run's own copy-outs of its other units (the
        root, the layers' dense parts), the gathered buffer's bf16 elements (the kernel's first input, world x
        shard) over their time on the slowest rank; (0, why) without one. On the committed 4 x H100 runs these units
        copy out at 1.17-1.20 TB/s and the experts' own at 1.42 (t004, dp4_mbs16, dp2_prof): the experts' copy-out
        from this rate is about 20 % long (tests/tracelens/test_scaleout_copy_out.py)."""
        if self._co_rate is None:
            model = self.model
            self._co_rate = (0.0, "no FSDP all-gather copy-out in the run to take a rate from")
            if model.profiles and int(self.config.get("pp") or 1) == 1:
                slow = int(np.argmax([sum(c.values()) for c in model.base_by_rank])) if model.base_by_rank else 0
                w = model.profiles[slow].work
                ops = w["op"].astype(str).to_numpy()
                paths = w["path"].astype(str).to_numpy()
                comm = w["is_comm"].to_numpy().astype(bool)
                js = [j for j in np.flatnonzero((ops == "aten::split_with_sizes_copy") & ~comm)
                      if "FSDP::" in paths[j] and "experts" not in paths[j]]
                elems = [_first_numel(str(w["dims"].iat[j])) for j in js]
                ns = float(w["dur"].to_numpy(float)[js].sum()) * model.device_scale[slow] if js else 0.0
                if js and all(e > 0 for e in elems) and ns > 0:
                    r = sum(elems) * L.act_bytes(self.config) / ns
                    self._co_rate = (r, f"{r / 1e3:.2f} TB/s, the run's own {len(js)} copy-out(s) of its other FSDP units")
        return self._co_rate

    def expert_copy_out_ns(self, cfg: dict, gpus: int) -> tuple[float, int]:
        """(ns per step at the run's micro-batches, how many) of the experts' FSDP all-gather copy-outs under ``cfg``
        on ``gpus`` GPUs that a run at dp 1 does not have: at dp > 1 FSDP2 gathers each MoE layer's experts at every
        call, in the forward and again in the backward (reshard after forward), once per EP dispatch chunk
        (`layout.chunks`), and copies the gathered buffer (`layout.fsdp_expert_bytes`) out into the parameters on the
        compute stream: counted on the 4 x H100 grid, 6 copy-outs a step at ep 2 x dp 2 with one chunk, 12 with two
        (tests/fixtures/h100_4gpu_overlap_fsdp), each at the run's copy-out rate (`copy_out_rate`). 0 where the run
        is at dp > 1 (its own copies are scaled, `fsdp_copy_factors`), at dp 1 in ``cfg``, or without a rate."""
        try:
            dp0, _ = L.dims(self.config, self.world)
            dp1, _ = resolve_world(cfg, gpus)
        except (ConfigError, WhatIfError):
            return 0.0, 0
        if dp0 != 1 or dp1 <= 1 or cfg.get("dp_mode", "fsdp") != "fsdp" or int(cfg.get("pp") or 1) > 1:
            return 0.0, 0
        rate = self.copy_out_rate()[0]
        ag = L.fsdp_expert_bytes({**cfg, "dp": dp1}, gpus)[0]
        if rate <= 0 or ag <= 0:
            return 0.0, 0
        n = 2 * len(L.moe_layers(cfg)) * L.chunks(cfg) * int(self.config.get("microbatches") or 1)
        return n * ag / rate, n

    def _acc_rate(self) -> tuple[float, str]:
        """(bytes per ns, its source) of a bf16 -> fp32 cast of gradients on the run's GPU: the experts' FSDP
        reduce-scatter copy-in (`_chunk_cat`, 6 bytes a parameter: 1.79-1.86 TB/s on the committed H100 runs),
        calibrated; (0, why) without one."""
        if self._acc is None:
            from ..analysis import memory as M

            model = self.model
            self._acc = (0.0, "no FSDP gradient copy-in in the run to take a rate from")
            if model.profiles and int(self.config.get("pp") or 1) == 1:
                slow = int(np.argmax([sum(c.values()) for c in model.base_by_rank])) if model.base_by_rank else 0
                p = model.profiles[slow]
                js = L.fsdp_expert_copies(p.work)["aten::_chunk_cat"]
                try:
                    ex = [u for u in M.fsdp_units(self.config, self.mem_layout(self.config, self.world))
                          if u[0] == "experts"]
                except TraceError:
                    ex = []
                ns = float(p.work["dur"].to_numpy(float)[js].sum()) * model.device_scale[slow]
                if len(js) and ex and ns > 0:
                    r = len(js) * float(ex[0][2]) * _ACC_CAST_BYTES / ns
                    self._acc = (r, f"{r:.2f} TB/s, the run's experts' gradient copy-in (_chunk_cat)")
        return self._acc

    def grad_accum_ns(self, cfg: dict, gpus: int) -> float:
        """ns per step of FSDP2's gradient accumulation under ``cfg`` on ``gpus`` GPUs (pp 1: trainer/train.py turns
        the gradient sync off for all micro-batches but the last): each unit's unsharded gradients are cast to fp32
        in the first micro-batch (6 bytes a parameter) and added to in each later one (10 bytes), at the run's cast
        rate (`_acc_rate`). Measured on tests/fixtures/h100_4gpu_accum/dp4_mbs8_m3_prof (rank 0, 3 micro-batches):
        the experts' casts 5.38 ms, their adds 14.10, the layers' 2.52, the root's ~4.9: about 27 ms a step, where
        this gives 31.5 (the adds ran at 2.36 TB/s against the cast's 1.86). 0 at one micro-batch, under DDP or a
        pipeline (not measured there)."""
        from ..analysis import memory as M

        m = int(cfg.get("microbatches") or 1)
        if m <= 1 or cfg.get("dp_mode", "fsdp") != "fsdp" or int(cfg.get("pp") or 1) > 1:
            return 0.0
        rate = self._acc_rate()[0]
        if rate <= 0:
            return 0.0
        try:
            params = sum(float(u[2]) for u in M.fsdp_units(cfg, self.mem_layout(cfg, gpus)))
        except TraceError:
            return 0.0
        return params * (_ACC_CAST_BYTES + _ACC_ADD_BYTES * (m - 1)) / rate

    @staticmethod
    def mem_layout(cfg: dict, gpus: int):
        """The memory projection's layout of ``cfg`` on ``gpus`` GPUs (`analysis.memory.resolve_layout`). A V-shaped
        schedule (zbv: two stages per rank, vpp 2 in the trainer) is one the projection takes at vpp 1 with its V
        placement: the same layers per rank."""
        from ..analysis import memory as M

        return M.resolve_layout(_mem_cfg(cfg), world=gpus)

    def dp_ns(self, cfg: dict, gpus: int) -> float:
        """ns per step of the data-parallel collectives of ``cfg`` on ``gpus`` GPUs (`memory.dp_collectives`, each
        issued per unit at the network model's hierarchical cost)."""
        from ..analysis import memory as M

        lay = self.mem_layout(cfg, gpus)
        tot = 0.0
        for x in M.dp_collectives(cfg, lay):
            units = int(x["units"])
            tot += x["count"] * units * self.net.collective(x["family"], x["buffer_bytes"] / units, int(x["group"]),
                                                             int(x["stride"]))
        return tot

    def _anchor_changes(self, target: dict) -> dict:
        cfg = self.config
        ch = {k: v for k, v in target.items() if k in DEFAULTS and k not in LAYOUT_KEYS
              and cfg.get(k, DEFAULTS[k]) != v}
        if int(cfg.get("pp") or 1) == 1:
            E = int(cfg["n_routed_experts"])
            cands = [e for e in _divisors(self.world) if E % e == 0]
            ep_t = int(target["ep"])
            ep_a = ep_t if ep_t in cands else max(e for e in cands if e <= ep_t)
            if ep_a != int(cfg.get("ep") or 1):
                ch["ep"] = ep_a
                if cfg.get("dp") is not None:
                    ch["dp"] = self.world // ep_a
            if ep_a == 1:
                ch = {k: v for k, v in ch.items() if k not in _EP_ONLY}
        else:
            ch = {k: v for k, v in ch.items() if k not in _EP_ONLY or int(cfg.get("ep") or 1) > 1}
        return ch

    def anchor(self, changes: dict) -> _Anchor:
        key = tuple(sorted((k, repr(v)) for k, v in changes.items()))
        if key not in self._anchors:
            self._anchors[key] = self._build_anchor(changes)
        return self._anchors[key]

    def _build_anchor(self, changes: dict) -> _Anchor:
        model = self.model
        pred = model.predict(changes)
        cfg_a = pred.config
        scale = pred.step_s / model.base_step_s if model.base_step_s > 0 else 1.0
        step_a = pred.step_s * 1e9
        comps = pred.components
        opt = comps.get("optimizer step", 0.0) * 1e9
        tokens = int(cfg_a["micro_batch_size"]) * int(cfg_a["seq_len"])
        notes: list = []
        slow = int(np.argmax([sum(c.values()) for c in model.base_by_rank])) if model.base_by_rank else 0
        m = int(cfg_a.get("microbatches") or 1)
        a2a_f, a2a_b = self.a2a_layer_ns(cfg_a, tokens)
        moe = L.moe_layers(cfg_a)
        a2a_tot = m * len(moe) * (a2a_f + a2a_b)
        # each MoE layer's expert stage per micro-batch: the slowest rank's (the pieces' rank); in a pipeline, each
        # layer's from the rank that holds it
        pipelined = int(model.config.get("pp") or 1) > 1
        ex_f, ex_b = {}, {}
        for i, (p, ds) in enumerate(zip(model.profiles, model.device_scale)):
            if not pipelined and i != slow:
                continue
            dur = p.work["dur"].to_numpy(float) * ds * scale / m
            for ly in moe:
                ex_f[f"layer{ly}"] = max(ex_f.get(f"layer{ly}", 0.0), float(dur[L._stage_units(p.work, ly, False)].sum()))
                ex_b[f"layer{ly}"] = max(ex_b.get(f"layer{ly}", 0.0), float(dur[L._stage_units(p.work, ly, True)].sum()))
        if pipelined:
            try:
                base = PW.base_of(model)
            except PW.PipelineWhatIfError as e:
                raise ScaleOutError(str(e)) from None
            # the steady steps' median window and rest of the step, scaled to the anchor's step (the run's measured
            # mean x the what-if's change)
            scale = step_a / (base.window_ns + base.rest_ns) if base.window_ns + base.rest_ns > 0 else scale
            pf = {k: v * scale for k, v in base.piece_f.items()}
            pb = {k: v * scale for k, v in base.piece_bw.items()}
            hidden, handoff, beta = 0.0, base.handoff_ns, base.beta
            dp_exp, fixed = None, 0.0  # below: the rest of the step past the replayed window
            notes.append(f"pieces: the run's stages' measured mean actions over {base.step_basis}, split by piece by "
                         f"the FLOP model; its calibrated {handoff / 1e6:.3f} ms per hand-off kept")
            pf = {k: max(v - a2a_f, 0.0) if k in {f"layer{ly}" for ly in moe} else v for k, v in pf.items()}
            pb = {k: max(v - a2a_b, 0.0) if k in {f"layer{ly}" for ly in moe} else v for k, v in pb.items()}
            a2a_exposed_f, a2a_exposed_b = a2a_f, a2a_b
        else:
            p = model.profiles[slow]
            # the run's profile, in the run's micro-batches (m: the anchor keeps them)
            pf, pb, fixed = PPL.piece_costs_from_profile(p, model.config, model.device_scale[slow] * scale)
            fsdp_mb = PPL.fsdp_per_microbatch_ns(p, model.config, model.device_scale[slow] * scale)
            pf, pb, fixed, clip_ns = self._clip_out(p, model.device_scale[slow], scale, pf, pb, fixed)
            e_comm = comps.get("exposed communication", 0.0) * 1e9
            e_a2a = min(e_comm, a2a_tot)
            e_dp = e_comm - e_a2a
            hidden = 1.0 - e_a2a / a2a_tot if a2a_tot > 0 else 0.0
            a2a_exposed_f, a2a_exposed_b = (1.0 - hidden) * a2a_f, (1.0 - hidden) * a2a_b
            # the EP dispatch path's kernels the what-if added to a run at ep 1 (not in its profile's pieces): out of
            # the work the pieces share, back on the MoE layers
            epf, epb = 0.0, 0.0
            if int(model.config.get("ep") or 1) == 1 and int(cfg_a.get("ep") or 1) > 1:
                epf, epb, _ = self.ep_path_ns(cfg_a, tokens)
            # the pieces take what the step holds beyond the optimizer, the per-step work and the exposed traffic
            work = (step_a - opt - fixed - e_comm) / m - len(moe) * (epf + epb)
            tot = sum(pf.values()) + sum(pb.values())
            f = work / tot if tot > 0 else 0.0
            pf = {k: v * f + (epf if k in {f"layer{ly}" for ly in moe} else 0.0) for k, v in pf.items()}
            pb = {k: v * f + (epb if k in {f"layer{ly}" for ly in moe} else 0.0) for k, v in pb.items()}
            ex_f = {k: v * f for k, v in ex_f.items()}
            ex_b = {k: v * f for k, v in ex_b.items()}
            dp_exp, handoff, beta = e_dp, 0.0, None
            notes.append(f"pieces: rank {p.rank}'s replayed step, each layer's device work by pass (pp_layout), "
                         f"normalised to the anchor's {step_a / 1e6:.1f} ms step")
        if moe and not any(ex_f.values()) and not any(ex_b.values()):
            notes.append("expert stage: no expert-stage kernels per MoE layer in the trace (no layer/<i> ranges): the "
                         "expert compute is not rescaled with the rows of another EP layout")
        # split each piece into its expert stage and the rest
        cf = {k: max(v - ex_f.get(k, 0.0), 0.0) for k, v in pf.items()}
        cb = {k: max(v - ex_b.get(k, 0.0), 0.0) for k, v in pb.items()}
        ef = {k: min(ex_f.get(k, 0.0), v) for k, v in pf.items()}
        eb = {k: min(ex_b.get(k, 0.0), v) for k, v in pb.items()}
        af = {k: (a2a_exposed_f if k in {f"layer{ly}" for ly in moe} else 0.0) for k in pf}
        ab = {k: (a2a_exposed_b if k in {f"layer{ly}" for ly in moe} else 0.0) for k in pb}
        a = _Anchor(changes, cfg_a, step_a, {"compute": (cf, cb), "expert": (ef, eb), "a2a": (af, ab)}, m, opt,
                    fixed, dp_exp or 0.0, 0.0, hidden, handoff, beta, notes, 0.0 if pipelined else fsdp_mb)
        a.clip_ns = 0.0 if pipelined else clip_ns
        if not pipelined and len(pred.replayed_all) > slow:
            a.fsdp_rep = pred.replayed_all[slow]
            a.fsdp_model_ns = self._fsdp_exposed(cfg_a, self.world, a)
        # the network model's exposure of the anchor's own data-parallel traffic, as a projection computes it
        w = self._window(cfg_a, self.world, {"compute": (cf, cb), "expert stage": (ef, eb),
                                             "all-to-all (exposed)": (af, ab)}, a)
        a.dp_model_ns = self._dp_exposed(cfg_a, self.world, w["last_bwd_ns"], w["window_ns"])
        if dp_exp is None:  # a pipelined run: the rest of its step holds the exposed traffic the model gives it
            rest = step_a - w["window_ns"]
            a.dp_exposed_ns = min(a.dp_model_ns, max(rest - opt, 0.0))
            a.fixed_ns = max(rest - opt - a.dp_exposed_ns, 0.0)
        return a

    def _clip_out(self, p, ds: float, scale: float, pf: dict, pb: dict, fixed: float):
        """(pieces F, B, per-step work, the clipping's ns) with the run's gradient clipping (`layout.grad_clip_units`)
        taken out of the pieces it was counted in (a unit whose gradient is token-shaped lands in ``loss``) and into
        the per-step work, at the run's calibrated time: once a step, whatever the micro-batch (the what-if's change
        of the step, ``scale``, is not applied to it)."""
        from .mechanisms.tokens import chunk_units

        w = p.work
        clip = L.grad_clip_units(w)
        if not clip.any():
            return pf, pb, fixed, 0.0
        cfg = self.model.config
        m = int(cfg.get("microbatches") or 1)
        dur = w["dur"].to_numpy(float) * ds
        lay = w["layer"].to_numpy()
        bwd = w["backward"].to_numpy() | (w["recompute"].to_numpy() if "recompute" in w else False)
        tok = (w["scale"].to_numpy() == "tokens") | chunk_units(w, cfg)
        pf, pb = dict(pf), dict(pb)
        for j in np.flatnonzero(clip):
            key = f"layer{int(lay[j])}" if lay[j] >= 0 else ("loss" if tok[j] else None)
            if key is None:
                fixed -= dur[j] * scale
            else:
                d = pb if bwd[j] else pf
                d[key] = max(d.get(key, 0.0) - dur[j] * scale / m, 0.0)
        ns = float(dur[clip].sum())
        return pf, pb, max(fixed, 0.0) + ns, ns

    def _fsdp_exposed(self, cfg: dict, gpus: int, a: _Anchor) -> float | None:
        """ns per step that FSDP2's all-gathers and reduce-scatters of ``cfg`` on ``gpus`` GPUs expose, placed by its
        rules (`fsdp_overlap`) in the anchor's replayed step at the network model's time per unit; None where that
        does not apply (no ZeRO-3, a pipeline, no replay, a CPU-only profile: its replay has no streams for a
        collective to overlap on, and the hooks' host time is a GPU host's)."""
        if a.fsdp_rep is None or int(cfg.get("pp") or 1) > 1 or getattr(a.fsdp_rep.plan, "cpu", False):
            return None
        lay = self.mem_layout(cfg, gpus)
        if lay.zero != 3:
            return None
        pb = 2 if lay.dtype == "bf16" else 4
        ds = a.fsdp_rep.device_scale or 1.0
        gather, reduce = {}, {}
        # the experts' gathers: FSDP2 gathers a unit at every call, the trainer calls the experts once per EP chunk
        calls = L.chunks(cfg)
        for kind, li, params, group in self._units(cfg, gpus):
            if group <= 1 or params <= 0:
                continue
            stride = lay.ep if kind == "experts" else 1
            gather[(kind, li)] = self.net.collective("all_gather", pb * params, int(group), stride) / ds
            reduce[(kind, li)] = self.net.collective("reduce_scatter", 4 * params, int(group), stride) / ds
        key = (id(a), tuple(sorted(gather.items())), tuple(sorted(reduce.items())), calls)
        if key not in self._fsdp:
            w = a.fsdp_rep.profile.work
            # the run's host gaps hold the hooks of the units it gathered; a unit kind it did not gather (dp 1 over
            # that kind's group) gets FSDP2's hook time per gather
            hook = {k: FO.HOOK_HOST_NS / (a.fsdp_rep.host_scale or 1.0) for k in gather
                    if k[0] not in self._gathered_kinds()}
            self._fsdp[key] = FO.exposure(a.fsdp_rep, w, gather, reduce, a.microbatches, hook, calls)
        return self._fsdp[key].per_step(int(cfg.get("microbatches") or 1))

    def _units(self, cfg: dict, gpus: int) -> list:
        from ..analysis import memory as M

        return M.fsdp_units(cfg, self.mem_layout(cfg, gpus))

    def _gathered_kinds(self) -> set[str]:
        """The FSDP unit kinds the run all-gathered (`memory.fsdp_units` over its own layout: a group over one rank
        gathers nothing)."""
        from ..analysis import memory as M

        try:
            lay = self.mem_layout(self.config, self.world)
        except TraceError:
            return set()
        return {kind for kind, _, params, group in M.fsdp_units(self.config, lay) if group > 1 and params > 0}

    def _dp_exposed(self, cfg: dict, gpus: int, last_bwd_ns: float, window_ns: float,
                    total: float | None = None) -> float:
        """Exposed ns of the data-parallel traffic where `_fsdp_exposed` does not apply: beyond the window under FSDP
        (a pipeline's stages), beyond the last micro-batch's backward of the busiest stage under DDP / ZeRO-1/2
        (pp_layout.dp_seconds's rule)."""
        tot = self.dp_ns(cfg, gpus) if total is None else total
        lay = self.mem_layout(cfg, gpus)
        hide = window_ns if lay.zero == 3 else last_bwd_ns
        return max(tot - hide, 0.0)

    # ------------------------------------------------------------------ projecting
    def target(self, gpus: int, changes: dict | None = None) -> tuple[dict, int, int]:
        """(the full trainer config, dp, ep) of ``changes`` on ``gpus`` GPUs, checked by the trainer's own rules."""
        changes = dict(changes or {})
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ScaleOutError(f"--gpus: {gpus!r} is not a GPU count")
        bad = [k for k in changes if k not in DEFAULTS]
        if bad:
            raise ScaleOutError(f"unknown trainer key {bad[0]!r} (see docs/trainer.md for the keys)")
        raw = {**{k: v for k, v in self.config.items() if k in DEFAULTS}, **changes}
        if "dp" not in changes:
            raw["dp"] = None
        if int(raw.get("ep") or 1) == 1:
            raw.update({k: DEFAULTS[k] for k in _EP_ONLY if k not in changes})
        try:
            cfg = load_config(None, raw)
        except ConfigError as e:
            raise ScaleOutError(str(e)) from None
        try:
            dp, ep = resolve_world(cfg, gpus)
        except ConfigError as e:
            raise ScaleOutError(f"--gpus {gpus}: {e}") from None
        if int(cfg["pp"]) > 1:
            try:
                PW.new_layout(cfg)
            except PW.PipelineWhatIfError as e:
                raise ScaleOutError(str(e)) from None
        try:
            self.mem_layout(cfg, gpus)
        except TraceError as e:
            raise ScaleOutError(f"--gpus {gpus}: {e.one_line()}") from None
        return cfg, dp, ep

    def project(self, gpus: int, changes: dict | None = None) -> Projection:
        """The projection of the run's config with ``changes`` (trainer keys) on ``gpus`` GPUs."""
        cfg, dp, ep = self.target(gpus, changes)
        a = self.anchor(self._anchor_changes(cfg))
        net = self.net
        tokens = int(cfg["micro_batch_size"]) * int(cfg["seq_len"])
        moe = {f"layer{ly}" for ly in L.moe_layers(cfg)}
        # per micro-batch pieces of the target
        r_a = self.busiest_rows(a.config, tokens)
        r_t = self.busiest_rows(cfg, tokens)
        fx = r_t / r_a if r_a > 0 else 1.0
        a2a_f_a, a2a_b_a = self.a2a_layer_ns(a.config, tokens)
        a2a_f_t, a2a_b_t = self.a2a_layer_ns(cfg, tokens)
        cf, cb = a.pieces["compute"]
        # the EP dispatch path's own kernels: the target's less the anchor's (the anchor's replay holds its own)
        pf_t, pb_t, n_ep = self.ep_path_ns(cfg, tokens)
        pf_a, pb_a, _ = self.ep_path_ns(a.config, tokens)
        if (pf_t, pb_t) != (pf_a, pb_a) and int(cfg["pp"]) == 1:
            cf = {k: (v + pf_t - pf_a if k in moe else v) for k, v in cf.items()}
            cb = {k: (v + pb_t - pb_a if k in moe else v) for k, v in cb.items()}
        ef, eb = ({k: v * fx for k, v in d.items()} for d in a.pieces["expert"])
        af = {k: (max(v + a2a_f_t - a2a_f_a, 0.0) if k in moe else 0.0) for k, v in a.pieces["a2a"][0].items()}
        ab = {k: (max(v + a2a_b_t - a2a_b_a, 0.0) if k in moe else 0.0) for k, v in a.pieces["a2a"][1].items()}
        kinds = {"compute": (cf, cb), "expert stage": (ef, eb), "all-to-all (exposed)": (af, ab)}
        pp, m = int(cfg["pp"]), int(cfg["microbatches"])
        nodes = math.ceil(gpus / net.gpus_per_node)
        notes = list(a.notes)
        w = self._window(cfg, gpus, kinds, a)
        parts, bubble_ns = w["parts"], w["bubble_ns"]
        if pp > 1:
            vpp_text = f" x vpp {cfg['vpp']}" if int(cfg["vpp"]) > 1 else ""
            notes.append(f"pipeline: {cfg['pipeline_schedule']} pp {pp}{vpp_text}, {m} "
                         f"micro-batches replayed with {w['handoff_ns'] / 1e6:.3f} ms per hand-off "
                         f"({w['act_bytes'] / 2**20:.1f} MiB of activations "
                         f"{'across nodes' if w['cross'] else 'inside a node'})")
        # the rest of the step: the data-parallel traffic's change on top of what the anchor's step exposed
        dp_total = self.dp_ns(cfg, gpus)
        fsdp_t = self._fsdp_exposed(cfg, gpus, a) if a.fsdp_model_ns is not None else None
        if fsdp_t is not None:
            # FSDP2's gathers placed in the anchor's replayed step: the run's own exposure + the change in the model's
            dp_exp = max(a.dp_exposed_ns + fsdp_t - a.fsdp_model_ns, 0.0)
            if fsdp_t != a.fsdp_model_ns:
                new_kinds = sorted({k for k, _, _, g in self._units(cfg, gpus) if g > 1} - self._gathered_kinds())
                notes.append(f"FSDP: the all-gathers and reduce-scatters placed per unit in the run's replayed step "
                             f"by FSDP2's rules (fsdp_overlap): {fsdp_t / 1e6:.2f} ms exposed against the run's "
                             f"layout's {a.fsdp_model_ns / 1e6:.2f}" + ("" if not new_kinds else (
                                 f"; each gather of the {' / '.join(new_kinds)} units, which the run did not gather, "
                                 f"{FO.HOOK_HOST_NS / 1e6:.2f} ms of its hooks' host time, assumed")))
        else:
            dp_t = self._dp_exposed(cfg, gpus, w["last_bwd_ns"], w["window_ns"], total=dp_total)
            dp_exp = max(a.dp_exposed_ns + dp_t - a.dp_model_ns, 0.0)
        p_a, p_t = PPL.optimizer_params(_mem_cfg(a.config), self.world), PPL.optimizer_params(_mem_cfg(cfg), gpus)
        opt = a.opt_ns * (p_t / p_a if p_a > 0 else 1.0)
        # the gradient clipping runs over the rank's gradient shard, as the optimizer over its parameters
        clip = a.clip_ns * ((p_t / p_a if p_a > 0 else 1.0) - 1.0)
        if clip:
            notes.append(f"gradient clipping: over the rank's gradient shard, {a.clip_ns / 1e6:.2f} ms in the run x "
                         f"{p_t / p_a:.3g} (its parameters per GPU, as the optimizer's)")
        # the experts' FSDP copies under the new (ep, dp) (the all-gathers' per micro-batch, the reduce-scatter's once)
        # and the run's other FSDP all-gather copies, both x the new micro-batches
        # from a run at dp 1, the experts' gather copy-outs (`expert_copy_out_ns`) of a target at pp 1 less its
        # anchor's, counted alike: the what-if's replay holds none, so a layout on the run's own GPUs stays the
        # what-if's, and a target at ep 1 (its anchor at dp > 1 on the run's GPUs already) gets none either
        (g_t, r_t), (g_a, r_a) = self.fsdp_copies_ns(cfg, gpus), self.fsdp_copies_ns(a.config, self.world)
        (co_t, n_t), (co_a, n_a) = self.expert_copy_out_ns(cfg, gpus), self.expert_copy_out_ns(a.config, self.world)
        if n_t != n_a and int(cfg["pp"]) == 1:
            g_t += co_t - co_a
            notes.append(f"FSDP: the experts' all-gather copy-outs a run at dp 1 does not have, {n_t} a step at the "
                         f"run's micro-batches (forward and backward, per EP chunk) against the anchor's {n_a}: "
                         f"{(co_t - co_a) / 1e6:+.2f} ms at {self.copy_out_rate()[1]}")
        f_m = m / a.microbatches if int(cfg["pp"]) == 1 else 1.0
        copies = (g_t - g_a) * f_m + (r_t - r_a) + a.fsdp_mb_ns * a.microbatches * (f_m - 1.0)
        if f_m != 1.0 and a.fsdp_mb_ns > 0:
            notes.append(f"FSDP: the all-gathers' copies and casts outside the layers ({a.fsdp_mb_ns / 1e6:.2f} ms per "
                         f"micro-batch in the run) repeat with the {m} micro-batches; the reduce-scatter's once")
        # FSDP2's gradient accumulation: the unsharded gradients kept in fp32 through the micro-batches without sync
        acc_t, acc_a = self.grad_accum_ns(cfg, gpus), self.grad_accum_ns(a.config, self.world)
        if acc_t != acc_a:
            notes.append(f"FSDP: gradient accumulation over {m} micro-batches keeps each unit's unsharded gradients in "
                         f"fp32 (a cast, then an add per later micro-batch): {acc_t / 1e6:.2f} ms per step against the "
                         f"anchor's {acc_a / 1e6:.2f}, at {self._acc_rate()[1]}")
        comps = {"compute": parts["compute"], "expert stage": parts["expert stage"],
                 "all-to-all (exposed)": parts["all-to-all (exposed)"], "pipeline bubble": bubble_ns,
                 "dp traffic (exposed)": dp_exp, "optimizer step": opt,
                 "other per-step work": max(a.fixed_ns + copies + acc_t - acc_a + clip, 0.0)}
        step_ns = sum(comps.values())
        tps = m * tokens / pp / (step_ns / 1e9)
        a2a_busy = m * len(moe) / pp * (a2a_f_t + a2a_b_t)  # the busiest rank's share of the layers, all of it
        peak, note = self._peak(cfg, gpus)
        if note:
            notes.append(note)
        if self.routing is None and ep > 1:
            notes.append(f"expert rows: uniform T*k/ep per peer ({self.routing_note})")
        elif ep > 1 and gpus != self.world:
            notes.append(f"expert rows: the busiest rank's from this run's {self.routing.basis}; a run on {gpus} GPUs "
                         "routes otherwise (its data per rank differs), so its imbalance between EP ranks is not "
                         "known here")
        if ep > 1 and (pf_t, pb_t) != (pf_a, pb_a) and int(cfg["pp"]) == 1:
            notes.append(f"EP dispatch path ({EP.path_name(cfg)}): its own kernels, {n_ep} per MoE layer and "
                         f"micro-batch, {(pf_t + pb_t) / 1e6:.2f} ms per layer and micro-batch against the anchor's "
                         f"{(pf_a + pb_a) / 1e6:.2f} (row moves at {self.ep_rates.bytes_src}; where / index_copy at "
                         f"{self.ep_rates.elems_src})")
        elif ep > 1 and self.ep_rates is None and int(self.config.get("ep") or 1) == 1:
            notes.append("EP dispatch path: the run has no permute gather to take a row-move rate from: its own "
                         "kernels are not added (docs/whatif.md, \"Validation\")")
        if gpus > self.world:
            notes.append(f"unvalidated: {gpus} GPUs, the run had {self.world}")
        if cfg.get("dp_mode") != a.config.get("dp_mode"):
            notes.append(f"dp_mode {cfg.get('dp_mode')}: its data-parallel traffic, optimizer sharding and memory "
                         f"modeled; the compute is the run's under {a.config.get('dp_mode')}")
        lay = {"dp": dp, "ep": ep, "pp": pp, "vpp": int(cfg["vpp"]), "schedule": str(cfg["pipeline_schedule"]),
               "microbatches": m, "micro_batch_size": int(cfg["micro_batch_size"])}
        return Projection(self.run, gpus, nodes, lay, dict(changes or {}), step_ns / 1e9, tps,
                          {k: float(v) / 1e9 for k, v in comps.items()}, a2a_busy / 1e9, dp_total / 1e9,
                          bubble_ns / step_ns if step_ns > 0 else 0.0, peak, self.model.capacity_bytes,
                          a.changes, self.world, gpus <= self.world, notes)

    def _window(self, cfg: dict, gpus: int, kinds: dict, a: _Anchor) -> dict:
        """The per-step window of ``cfg``'s pieces (``kinds``: component -> (forward, backward) ns per piece and
        micro-batch): the micro-batches back to back at pp 1, else the schedule replayed with one hand-off per stage
        boundary (the activations over the network, plus a pipelined run's calibrated overhead less its own p2p);
        the busiest rank's parts, the bubble, the busiest stage's last backward."""
        net = self.net
        pp, m = int(cfg["pp"]), int(cfg["microbatches"])
        stage = {k: tuple(PPL.stage_costs(cfg, f, b, a.beta)[1:]) for k, (f, b) in kinds.items()}
        n = len(stage["compute"][0])
        tot = [[sum(stage[k][i][s] for k in kinds) for s in range(n)] for i in range(3)]
        act = L.act_bytes(cfg) * int(cfg["micro_batch_size"]) * int(cfg["seq_len"]) * int(cfg["d_model"])
        cross = gpus > net.gpus_per_node
        out = {"act_bytes": act, "cross": cross, "handoff_ns": 0.0,
               "last_bwd_ns": max(tot[1][s] + tot[2][s] for s in range(n))}
        if pp == 1:
            out["parts"] = {k: m * (stage[k][0][0] + stage[k][1][0] + stage[k][2][0]) for k in kinds}
            out.update(window_ns=sum(out["parts"].values()), bubble_ns=0.0)
            return out
        handoff = a.handoff_ns + net.p2p(act, cross)
        if a.handoff_ns > 0:  # the run's calibrated overhead carries its own p2p of its activations
            own = L.act_bytes(a.config) * int(a.config["micro_batch_size"]) * int(a.config["seq_len"]) * \
                int(a.config["d_model"])
            handoff = max(handoff - net.p2p(own, False), a.handoff_ns)
        order = PW.schedule_actions(str(cfg["pipeline_schedule"]), pp, int(cfg["vpp"]), m)
        try:
            window, _, _ = PW._replay(order, PW._costs_for(order, *tot), handoff)
        except PW.PipelineWhatIfError as e:
            raise ScaleOutError(str(e)) from None
        ranks = order["rank"].to_numpy()
        busy = {k: np.bincount(ranks, weights=PW._costs_for(order, *stage[k]), minlength=pp) for k in kinds}
        total = sum(busy.values())
        r = int(np.argmax(total))
        out.update(parts={k: float(busy[k][r]) for k in kinds}, window_ns=window, handoff_ns=handoff,
                   bubble_ns=max(window - float(total[r]), 0.0))
        return out

    def _peak(self, cfg: dict, gpus: int) -> tuple[float | None, str]:
        from ..analysis import memory as M

        try:
            lay = self.mem_layout(cfg, gpus)
            proj = max(M.project(cfg, lay, stage=s).peak_bytes for s in range(lay.pp))
        except TraceError as e:
            return None, f"memory projection unavailable: {e.one_line()}"
        return float(proj) * (self.model.mem_ratio or 1.0), ""

    # ------------------------------------------------------------------ the guides' tables
    def scaling(self, gpus: list[int], changes: dict | None = None) -> list[Projection | str]:
        """The run's layout (with ``changes``) at every GPU count: dp grows, per-GPU work stays (weak scaling).
        A count the layout cannot fill is its one-line reason instead."""
        out: list = []
        for n in gpus:
            try:
                out.append(self.project(n, changes))
            except WhatIfError as e:
                out.append(f"{n} GPUs: {e}")
        return out

    def ep_scaling(self, gpus: list[int], eps: list[int] | None = None, changes: dict | None = None) -> list:
        """EP 1..N at each GPU count (ep dividing the experts and the GPUs of a stage)."""
        out: list = []
        E = int(self.config["n_routed_experts"])
        pp = int({**self.config, **(changes or {})}.get("pp") or 1)
        for n in gpus:
            cands = eps or [e for e in _divisors(E) if (n // pp) % e == 0 and n % pp == 0]
            for e in cands:
                try:
                    out.append(self.project(n, {**(changes or {}), "ep": e}))
                except WhatIfError as err:
                    out.append(f"{n} GPUs, ep {e}: {err}")
        return out

    def bubbles(self, gpus: int, pps: list[int] | None = None, microbatches: int | None = None,
                changes: dict | None = None) -> list:
        """The pipeline bubble per schedule (1f1b, interleaved vpp 2, zero-bubble zb1p, zbv) at each pp."""
        out: list = []
        L_ = int(self.config["n_layers"])
        pps = pps or [p for p in (2, 4, 8, 16) if p <= L_ and gpus % p == 0]
        for p in pps:
            m = microbatches or max(2 * p, int(self.config.get("microbatches") or 1))
            for sched, vpp in _BUBBLE_SCHEDULES:
                ch = {**(changes or {}), "pp": p, "pipeline_schedule": sched, "vpp": vpp, "microbatches": m}
                if sched.startswith("zb"):  # the trainer runs the split-backward schedules under DDP only
                    ch["dp_mode"] = "ddp"
                try:
                    out.append(self.project(gpus, ch))
                except WhatIfError as err:
                    out.append(f"pp {p} {sched}{f' vpp {vpp}' if vpp > 1 else ''}: {err}")
        return out


# ------------------------------------------------------------------------------------------ the tables, in text
def _rows(items: list) -> tuple[list, list]:
    ps = [x for x in items if isinstance(x, Projection)]
    return ps, [x for x in items if isinstance(x, str)]


def table_text(title: str, items: list, efficiency: bool = False) -> str:
    """One of the guides' tables: a row per projection (tokens/s/GPU, step time and its parts, all-to-all share, bubble,
    peak memory, status), then the rows that could not be projected with their reason."""
    ps, bad = _rows(items)
    out = [title, f"{'GPUs':>5} {'nodes':>5}  {'layout':<34} {'tokens/s/GPU':>12} {'step ms':>8} {'compute':>8} "
                  f"{'experts':>8} {'a2a exp':>8} {'bubble':>8} {'dp exp':>7} {'optim':>6} {'a2a %':>6} "
                  f"{'bubble %':>8} {'peak GiB':>9}" + (f" {'DP eff':>7}" if efficiency else "") + "  status"]
    ref = ps[0] if ps else None
    for p in ps:
        c = {k: 1e3 * v for k, v in p.components.items()}
        pk = f"{p.peak_gib:.1f}{'' if p.fits else ' OOM'}" if p.peak_gib is not None else "-"
        eff = f" {100 * p.tokens_per_s_per_gpu / ref.tokens_per_s_per_gpu:>6.1f}%" if efficiency and ref else ""
        out.append(f"{p.gpus:>5} {p.nodes:>5}  {p.label():<34} {p.tokens_per_s_per_gpu:>12,.0f} {1e3 * p.step_s:>8.1f} "
                   f"{c['compute']:>8.1f} {c['expert stage']:>8.1f} {c['all-to-all (exposed)']:>8.1f} "
                   f"{c['pipeline bubble']:>8.1f} {c['dp traffic (exposed)']:>7.1f} {c['optimizer step']:>6.1f} "
                   f"{100 * p.a2a_share:>5.1f}% {100 * p.bubble:>7.1f}% {pk:>9}{eff}  {p.status}")
    out.extend(f"  not projected: {b}" for b in bad)
    if efficiency and ref:
        out.append(f"  DP eff: tokens/s/GPU against the first row ({ref.gpus} GPUs), the same per-GPU layout")
    return "\n".join(out)


LEGEND = ("ms per step of the busiest rank: compute (outside the expert stage, host idle included), experts (the expert "
          "stage, x the busiest rank's rows), a2a exp (token all-to-alls not hidden), bubble (pipeline), dp exp "
          "(data-parallel collectives not hidden), optim (optimizer step); the other per-step work completes the step. "
          "a2a %: exposed all-to-all / step. Every row is a projection from the run named above; 'unvalidated': more "
          "GPUs than the run had, nothing measured it")


@dataclass
class Report:
    """What `tracelens scaleout` prints and writes with --json."""

    scaleout: ScaleOut
    scaling: list
    ep: list
    bubbles: list
    bubble_gpus: int | None

    def to_text(self) -> str:
        so = self.scaleout
        m = so.model
        head = [(f"scale-out projection from {so.run} ({so.world} GPU(s), measured {m.base_tokens_per_s_per_gpu:,.0f} "
                f"tokens/s/GPU, step {1e3 * m.base_step_s:.1f} ms)"),
                "network model:"] + [f"  {x}" for x in so.net.describe()]
        routing = so.routing.basis if so.routing is not None else f"uniform T*k/ep ({so.routing_note})"
        head.append(f"expert rows: the busiest rank of each EP group, from {routing}")
        parts = ["\n".join(head),
                 table_text("DP scaling (the run's layout, per-GPU work fixed: dp grows):", self.scaling, True)]
        if self.ep:
            parts.append(table_text("EP scaling (ep 1..N at each GPU count):", self.ep))
        if self.bubbles:
            parts.append(table_text(f"Pipeline bubble per schedule at {self.bubble_gpus} GPUs:", self.bubbles))
        parts.append(LEGEND)
        return "\n\n".join(parts)

    def to_dict(self) -> dict:
        def rows(items):
            return [x.as_dict() if isinstance(x, Projection) else {"not_projected": x} for x in items]

        so = self.scaleout
        return {"run": so.run, "run_gpus": so.world, "measured_tokens_per_s_per_gpu": so.model.base_tokens_per_s_per_gpu,
                "network": {**so.net.as_dict(), "description": so.net.describe()},
                "routing": so.routing.basis if so.routing is not None else None,
                "scaling": rows(self.scaling), "ep_scaling": rows(self.ep), "bubbles": rows(self.bubbles),
                "bubble_gpus": self.bubble_gpus}


def report(so: ScaleOut, gpus: list[int], changes: dict | None = None, eps: list[int] | None = None,
           ep_gpus: list[int] | None = None, pps: list[int] | None = None, bubble_gpus: int | None = None) -> Report:
    """The guides' tables for one run: DP scaling over ``gpus``, EP scaling at ``ep_gpus`` (default: every count),
    the bubble per schedule at ``bubble_gpus`` (default: the largest count)."""
    big = bubble_gpus or max(gpus)
    return Report(so, so.scaling(gpus, changes), so.ep_scaling(ep_gpus or gpus, eps, changes),
                  so.bubbles(big, pps, changes=changes), big)


# ------------------------------------------------------------------------------------------ validation
VALIDATION_TARGET = 0.10  # issue 35: the projection from 1 and 2 GPUs to 4 within 10 % of measured


def validate(measured: str | Path, kernel_table: str | Path | None = None, network_path: str | Path | None = None,
             **net_flags) -> dict:
    """Every measured point projected from every baseline of a ``measured.json`` (`projection.measured`: a point's
    ``gpus`` is the count it ran on): per point the projected and measured tokens/s/GPU, the error and the memory
    verdict; per baseline the median and largest |error| over the points at more GPUs than the baseline had
    (the scale-out ones) and whether every one is within :data:`VALIDATION_TARGET`."""
    from . import measured as MS

    config, machine, bases, points = MS.load_measured(measured)
    try:
        base_cfg = load_config(config)
    except ConfigError as e:
        raise ScaleOutError(f"{measured}: config {config!r}: {e}") from None
    rows, summary = [], {}
    for b in bases:
        try:
            so = ScaleOut.from_run(b.run, network_path, kernel_table, **net_flags)
        except (WhatIfError, TraceError) as e:
            raise ScaleOutError(f"{measured}: baseline {b.name}: {e}") from None
        errs = []
        for pt in points:
            gpus = pt.gpus or so.world
            ch = MS.changes_for(base_cfg, b, pt)
            row = {"baseline": b.name, "baseline_gpus": so.world, "point": pt.name, "gpus": gpus, "changes": ch,
                   "measured_tps": pt.tps, "measured_status": pt.status, "measured_peak_gib": pt.peak_gib,
                   "own": not ch and gpus == so.world, "scale_out": gpus > so.world}
            try:
                p = so.project(gpus, ch)
            except WhatIfError as e:
                rows.append({**row, "refused": " ".join(str(e).split())})
                continue
            row.update(predicted_tps=p.tokens_per_s_per_gpu, predicted_peak_gib=p.peak_gib, predicted_fits=p.fits,
                       verdict_right=p.fits == (pt.status == "ok"), layout=p.label())
            row["layout_only"] = all(k in LAYOUT_KEYS or k in _EP_ONLY for k in ch)
            if pt.status == "ok" and pt.tps:
                row["error"] = p.tokens_per_s_per_gpu / pt.tps - 1.0
                if row["scale_out"]:
                    errs.append((abs(row["error"]), row["layout_only"]))
            rows.append(row)
        summary[b.name] = {"gpus": so.world, **_error_summary([e for e, _ in errs]),
                           "layout_only": _error_summary([e for e, lo in errs if lo])}
    return {"measured": str(measured), "config": config, "machine": machine, "rows": rows, "summary": summary,
            "target": VALIDATION_TARGET}


def _error_summary(errs: list[float]) -> dict:
    return {"n": len(errs), "median_abs_error": float(np.median(errs)) if errs else None,
            "max_abs_error": float(max(errs)) if errs else None,
            "meets": bool(errs) and float(max(errs)) <= VALIDATION_TARGET}


def validation_text(res: dict) -> str:
    out = [(f"scale-out projection against {res['measured']} ({res['config']}"
           f"{', ' + res['machine'] if res['machine'] else ''})"),
           (f"{'baseline':<12} {'GPUs':>4} {'point':<22} {'GPUs':>4} {'projected':>10} {'measured':>10} {'error':>7}  "
           "verdict")]
    for r in res["rows"]:
        head = f"{r['baseline']:<12} {r['baseline_gpus']:>4} {r['point']:<22} {r['gpus']:>4}"
        if "refused" in r:
            out.append(f"{head} not projected: {r['refused']}")
            continue
        meas = f"{r['measured_tps']:,.0f}" if r["measured_tps"] else r["measured_status"].upper()
        err = f"{100 * r['error']:+.1f}%" if "error" in r else ""
        fit = ("fits" if r["predicted_fits"] else "OOM") + (": right" if r["verdict_right"] else ": WRONG")
        out.append(f"{head} {r['predicted_tps']:>10,.0f} {meas:>10} {err:>7}  {fit}"
                   + (" (the baseline itself)" if r["own"] else ""))
    for name, s in res["summary"].items():
        if not s["n"]:
            out.append(f"{name}: no point at more GPUs than its {s['gpus']} with a measured tokens/s")
            continue
        lo = s["layout_only"]
        out.append(f"{name} ({s['gpus']} GPU(s)): {s['n']} scale-out point(s), median |error| "
                   f"{100 * s['median_abs_error']:.1f}%, max {100 * s['max_abs_error']:.1f}% (target: every one within "
                   f"{100 * res['target']:.0f}%): {'MEETS' if s['meets'] else 'does not meet'} the target"
                   + (f"; the {lo['n']} that change only the parallel layout (ep, dp, pp, dispatch path): median "
                      f"{100 * lo['median_abs_error']:.1f}%, max {100 * lo['max_abs_error']:.1f}%"
                      f"{', within' if lo['meets'] else ', not all within'} {100 * res['target']:.0f}%"
                      if lo["n"] and lo["n"] < s["n"] else ""))
    return "\n".join(out)

"""What-if: predict step time, tokens/s/GPU and peak memory of a changed trainer config from one run.

    >>> from tracelens.projection import whatif as W
    >>> m = W.Model.from_run("runs/base")                 # a profiled run dir (manifest + traces)
    >>> p = m.predict({"micro_batch_size": 8, "grouped_gemm_backend": "torch"})
    >>> p.tokens_per_s_per_gpu, p.step_s, p.peak_gib, p.fits, p.uncertainty
    >>> p.table()                                          # component by component, base vs predicted

How (docs/whatif.md has the details). The run's profiled step is replayed (``replay.py``: the host
issues its launches and blocking syncs, the device runs the units) and the replay is calibrated to the
run's unprofiled mean step time with one factor for host speed (the profiler slows the host) and one
for the rest. A changed config edits the replayed program by the mechanism of each knob:

* ``micro_batch_size``: token-proportional units keep their fixed part (the fastest instance of the
  same kernel in the step) and scale their variable part with the tokens; units of a chunked loss
  (``loss_fusion``) repeat with the number of chunks, launches included; per-step units (optimizer,
  gradient reduction) stay; host launch costs stay.
* ``grouped_gemm_backend``: expert GEMM time per MoE layer and pass is the measured time times the
  ratio of the kernel table's timings (``kerneltable.py``: tuner rows or cache) of the new backend at
  the new rows to the old backend at the old rows; a per-expert backend (loop, multistream) launches
  one GEMM per local expert, a grouped one (torch, triton) one per pass: launches and their host time
  are removed or added. Without a table the per-expert kernels are merged (their work adds, one fixed
  part is paid) and the prediction says so.
* ``sync_free_level``: removes (or adds) the MoE layer's blocking syncs (docs/trainer.md table); the
  per-expert backends at levels 2-3 run the masked reference (every expert over all rows).
* ``recompute_layer_ids``: a newly recomputed layer's forward units run again before its backward; an
  un-recomputed layer's recomputation is removed. Memory from the projection.
* ``microbatches`` (gradient accumulation): per-micro-batch units repeat, per-step units do not.
* ``pipeline_schedule``, ``vpp``, ``pipeline_layout`` (and ``microbatches`` when pp > 1):
  ``pipeline_whatif.py`` replays the new schedule's action order over the run's measured stage costs,
  re-split by piece into the new layout, plus the run's rest of the step.
* ``manual_gc``: the step is kept: the collector's pauses are not in a trace, and the tail of the timed
  steps above their median (which may be them, or not) is the uncertainty.
* ``optimizer`` (``adamw`` -> ``adamw_fused``): the optimizer's foreach kernels become one pass over
  the optimizer state at the measured kernels' achieved bandwidth.
* ``expert_swiglu`` (``torch`` <-> ``triton``): the routed experts' eager SwiGLU kernels become the fused
  pair (or back), by the bytes each moves at the measured kernels' bandwidth.

Peak memory: the memory projection (``tracelens.analysis.memory``) of the new config, scaled by the
run's measured / projected peak; over the capacity (the space's limit, else the device's) it is
predicted as OOM. Keys that do not change performance (steps, profiling window, logging, seed) are
accepted; keys the model has no mechanism for are refused in one line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..errors import TraceError
from . import kerneltable as KT
from . import pipeline_whatif as PW
from . import replay as R
from .profile import COMPONENTS, ProfileError, StepProfile, read_manifest, step_profile

GIB = float(1 << 30)
PER_EXPERT = ("loop", "multistream")
GROUPED = ("torch", "triton", "auto")
# keys the model predicts, and keys that do not change a step's time
MODELED = ("micro_batch_size", "grouped_gemm_backend", "sync_free_level", "recompute_layer_ids", "microbatches",
           "manual_gc", "optimizer", "step_timing", "expert_swiglu", "pipeline_schedule", "vpp", "pipeline_layout",
           "pipeline_layer_costs")
NEUTRAL = ("steps", "profile_step_start", "profile_step_end", "log_every", "timing_warmup_steps", "seed", "lr",
           "min_lr_ratio", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "grad_clip", "numa_bind",
           "env", "multistream_num_streams", "init_std")
# relative uncertainty (1 sigma) of each kind of modeled change, on the time it changes
# the host's return after a device drain inside a per-expert expert stage (124-256 µs on the H100 proxy)
DRAIN_RETURN_NS = 150_000.0
SIGMA = {"tokens": 0.10, "table": 0.10, "merge": 0.30, "syncs": 0.30, "recompute": 0.15, "microbatches": 0.05,
         "gc": 1.0, "optimizer": 0.30, "timing": 0.30, "swiglu": 0.30, "shapes": 0.30, "masked": 0.30,
         "pipeline": 0.12}


class WhatIfError(ValueError):
    """A what-if that cannot be answered: one line naming the run or key and why."""


@dataclass
class Prediction:
    config: dict  # the full changed config
    changes: dict  # the keys that changed
    step_s: float
    tokens_per_s_per_gpu: float
    peak_bytes: float | None
    capacity_bytes: float | None
    base_step_s: float
    base_tokens_per_s_per_gpu: float
    components: dict  # component -> seconds (adds up to step_s)
    base_components: dict
    uncertainty: float  # relative, 1 sigma
    measured: list = field(default_factory=list)  # what came from the measurement unchanged
    modeled: list = field(default_factory=list)  # one line per modeled change
    notes: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.peak_bytes is None or self.capacity_bytes is None or self.peak_bytes <= self.capacity_bytes

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_bytes is None else self.peak_bytes / GIB

    @property
    def gain(self) -> float:
        return self.tokens_per_s_per_gpu / self.base_tokens_per_s_per_gpu - 1.0

    def objective(self, metric: str) -> float | None:
        if metric == "tokens_per_s_per_gpu":
            return self.tokens_per_s_per_gpu
        if metric == "step_time":
            return self.step_s
        return None

    def table(self) -> pd.DataFrame:
        rows = []
        for c in COMPONENTS:
            b, p = self.base_components.get(c, 0.0), self.components.get(c, 0.0)
            if b or p:
                rows.append({"component": c, "base_ms": 1e3 * b, "predicted_ms": 1e3 * p, "delta_ms": 1e3 * (p - b)})
        return pd.DataFrame(rows)

    def as_dict(self) -> dict:
        return {
            "changes": self.changes, "step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "gain": self.gain, "uncertainty": self.uncertainty, "peak_gib": self.peak_gib,
            "capacity_gib": None if self.capacity_bytes is None else self.capacity_bytes / GIB, "fits": self.fits,
            "base_step_s": self.base_step_s, "base_tokens_per_s_per_gpu": self.base_tokens_per_s_per_gpu,
            "components_ms": {k: 1e3 * v for k, v in self.components.items()},
            "base_components_ms": {k: 1e3 * v for k, v in self.base_components.items()},
            "measured": self.measured, "modeled": self.modeled, "notes": self.notes,
        }


# the editable replay program lives in replay.py
_Plan = R.Plan


# ------------------------------------------------------------------------------------------ the model
@dataclass
class Model:
    """A what-if model calibrated on one run: :meth:`predict` answers for a changed config."""

    run: str
    config: dict
    manifest: dict
    profiles: list  # StepProfile per rank (the slowest rank decides a synchronous step)
    programs: list  # replay.Program per profile
    host_scale: list  # per profile
    device_scale: list  # per profile: what is left after the host factor (measured / replayed)
    base_step_s: float
    base_tokens_per_s_per_gpu: float
    base_components: dict
    noise: float  # relative standard error of the run's measured objective
    jitter: float  # (mean - median) / mean of the timed steps
    table: Any = None  # KernelTable or None
    capacity_bytes: float | None = None
    mem_ratio: float | None = None  # measured / projected peak of the run
    notes: list = field(default_factory=list)
    base_by_rank: list = field(default_factory=list)  # calibrated base components per profile
    pipe_base: Any = None  # pipeline_whatif.PipelineBase of a pipelined run, measured on first use
    expert_host: list = field(default_factory=list)  # per profile: the expert stage's host factor (_calibrate)

    # -------------------------------------------------------------- building
    @classmethod
    def from_run(cls, run: str | Path, kernel_table: str | Path | None = None, capacity_gib: float | None = None,
                 analysis=None) -> "Model":
        run = Path(run)
        man = read_manifest(run)
        if man is None:
            raise WhatIfError(f"{run}: not a run dir with a manifest.json (the what-if model needs the run's config "
                              "and measured step times)")
        cfg = cls._run_config(man["config"], run / "manifest.json")
        metrics = man.get("metrics") or {}
        mean = metrics.get("mean_step_time_s")
        if not isinstance(mean, (int, float)) or not math.isfinite(mean) or mean <= 0:
            raise WhatIfError(f"{run / 'manifest.json'}: no measured mean_step_time_s to calibrate on")
        if analysis is None:
            import tracelens

            try:
                trace = tracelens.load(run, progress=False)
            except TraceError:
                raise
            except FileNotFoundError:
                raise WhatIfError(f"{run}: no trace files (the what-if model replays a profiled step)") from None
            analysis = tracelens.analyze(trace)
        profs = []
        for info in analysis.trace.ranks:
            p = step_profile(analysis, cfg, info.rank)
            if p is not None and len(p.work):
                profs.append(p)
        if not profs:
            raise WhatIfError(f"{run}: no profiled step with device work in its traces (profile_step_start/"
                              "profile_step_end must cover a whole step)")
        _transfer_only(profs)
        progs = [R.prepare(p) for p in profs]
        hs, ds, comps_all = [], [], []
        per_expert = cfg.get("grouped_gemm_backend") in PER_EXPERT
        tok = int(cfg.get("micro_batch_size") or 1) * int(cfg.get("seq_len") or 1)

        def own_rate(plan: _Plan, p: StepProfile) -> None:  # the run's own trend of new GEMM shapes
            if per_expert:
                cls._shape_misses(plan, p, tok, tok, None, [], metrics.get("timed_steps"))

        xs = []
        for prog in progs:
            h, d, x, res = _calibrate(prog, float(mean) * 1e9, own_rate, per_expert)
            xs.append(x)
            hs.append(h)
            ds.append(d)
            comps_all.append({k: v * d / 1e9 for k, v in res.components.items()})
        slow = int(np.argmax([sum(c.values()) for c in comps_all]))
        tps = metrics.get("tokens_per_s_per_gpu")
        tokens_rank = metrics.get("tokens_per_step_per_gpu")
        if not isinstance(tps, (int, float)) or not tps:
            tps = (tokens_rank or 0) / mean
        noise, jitter = _noise(metrics)
        try:
            table = KT.load(kernel_table)
        except ValueError as e:
            raise WhatIfError(str(e)) from None
        m = cls(str(run), cfg, man, profs, progs, hs, ds, float(mean), float(tps), comps_all[slow], noise, jitter,
                table)
        m.base_by_rank = comps_all
        m.expert_host = xs
        if any(x > 1.0 for x in xs):
            m.notes.append(f"the run's timed steps were slower than its profiled step replays at any profiler factor: "
                           f"the rest is put on the per-expert stage's host time (x{max(xs):.2f})")
        m._memory_setup(capacity_gib, analysis)
        return m

    def _memory_setup(self, capacity_gib: float | None, analysis) -> None:
        if capacity_gib is not None:
            self.capacity_bytes = capacity_gib * GIB
        else:
            mems = [d.get("totalGlobalMem") for ri in analysis.trace.ranks for d in ri.device_properties]
            mems = [m for m in mems if isinstance(m, (int, float)) and m > 0]
            self.capacity_bytes = float(min(mems)) if mems else None
        peaks = (self.manifest.get("metrics") or {}).get("peak_memory_bytes") or []
        kind = (self.manifest.get("metrics") or {}).get("peak_memory_kind")
        peaks = [p for p in peaks if isinstance(p, (int, float)) and p > 0]
        try:
            proj = self._project(self.config)
        except Exception as e:  # noqa: BLE001 - a layout the projection does not take: no memory figure
            self.notes.append(f"memory projection unavailable: {' '.join(str(e).split())[:160]}")
            return
        if peaks and proj and kind == "cuda_max_memory_allocated":
            self.mem_ratio = max(peaks) / proj

    def _project(self, cfg: dict) -> float | None:
        from ..analysis import memory as M

        world = int(self.manifest.get("world_size") or 1)
        lay = M.resolve_layout(cfg, world=world)
        return float(max(M.project(cfg, lay, stage=s).peak_bytes for s in range(lay.pp)))

    # -------------------------------------------------------------- predicting
    def predict(self, changes: dict) -> Prediction:
        new = self._validate(changes)
        from trainer.config import DEFAULTS  # noqa: PLC0415

        diff = {k: v for k, v in new.items() if k in changes and self.config.get(k, DEFAULTS.get(k)) != v}
        # ---- pipeline knobs (pipeline_whatif.py): the replay below runs the other knobs on the old pipeline
        pipe = PW.changes_pipeline(self.config, new)
        new_all = new
        if pipe:
            keep = PW.PIPELINE_KEYS + ("microbatches",)
            new = {**new, **{k: self.config.get(k, DEFAULTS.get(k)) for k in keep}}
            diff_other = {k: v for k, v in diff.items() if k not in keep}
        # ---- end pipeline knobs
        notes: list[str] = []
        modeled: list[str] = []
        sig2 = 0.0
        steps, comps_list = [], []
        chain = (self.config.get("step_timing", "sync") != new.get("step_timing", "sync")
                 and new.get("step_timing") == "events")
        xs = self.expert_host or [1.0] * len(self.programs)
        for prog, hs, ds, x in zip(self.programs, self.host_scale, self.device_scale, xs):
            plan = _Plan.of(prog, profiler_lead=False)
            _scale_expert_host(plan, x)
            var = self._apply(plan, prog.profile, new, diff_other if pipe else diff,
                              modeled if not comps_list else [], notes)
            if chain:  # the steady state of steps the host queues ahead; its change from one step is uncertain
                one = plan.replay(hs).step_ns
                res = plan.replay_chain(hs, _log_cycle(new), _median_sync_return(plan))
                var += (SIGMA["timing"] * abs(res.step_ns - one) / max(one, 1.0)) ** 2
            else:
                res = plan.replay(hs)
            steps.append(res.step_ns * ds / 1e9)
            comps_list.append({k: v * ds / 1e9 for k, v in res.components.items()})
            sig2 = max(sig2, var)
        slow = int(np.argmax(steps))
        step = steps[slow]
        if "manual_gc" in diff:
            # Python's collector leaves no trace in a profile: a run's step-time tail above its median may
            # be its pauses, or anything else (allocator, host jitter). Measured on the H100 proxy (dev runs
            # and the gc grid, 7 pairs), manual GC moved tokens/s by -3.5 % to +0.0 %, and the largest tail
            # (11 % of the mean, multistream) was still 6 % with it on: the step is kept, the tail is the uncertainty.
            modeled.append(f"manual_gc={new['manual_gc']}: step kept (the collector's pauses are not in the trace); "
                           f"the run's step-time tail above the median, {100 * self.jitter:.1f}% of the mean, is the "
                           "uncertainty")
            sig2 += (SIGMA["gc"] * max(self.jitter, 0.01)) ** 2
        comps = comps_list[slow]
        if pipe:  # ---- pipeline knobs: the new schedule's window replaces the old one
            new = new_all
            step, comps, var = self._pipeline(new, step, comps, self.profiles[slow].rank, modeled, notes)
            sig2 += var
        base_comps = self.base_by_rank[slow] if self.base_by_rank else self.base_components
        tokens = self._tokens_per_gpu(new)
        tps = tokens / step
        peak = None
        try:
            proj = self._project(new)
            if proj is not None:
                peak = proj * (self.mem_ratio or 1.0)
        except Exception as e:  # noqa: BLE001
            notes.append(f"memory projection unavailable: {' '.join(str(e).split())[:160]}")
        unc = math.sqrt(sig2 + self.noise ** 2)
        measured = [f"replayed profiled step of rank {p.rank} (step {p.step}), calibrated to the measured mean "
                    f"step {1e3 * self.base_step_s:.1f} ms" for p in self.profiles[:1]]
        if not diff:
            modeled = ["no change: the calibrated replay of the measured run"]
        return Prediction(new, diff, step, tps, peak, self.capacity_bytes, self.base_step_s,
                          self.base_tokens_per_s_per_gpu, comps, base_comps, unc, measured, modeled,
                          list(dict.fromkeys(notes + list(self.notes))))

    def _tokens_per_gpu(self, cfg: dict) -> float:
        m = self.manifest.get("metrics") or {}
        base = m.get("tokens_per_step_per_gpu")
        if not isinstance(base, (int, float)) or base <= 0:
            # the trainer's definition: dp * ep replicas each take microbatches x micro-batch x seq tokens a
            # step, spread over the world (pipeline ranks share their replica's tokens)
            world = int(self.manifest.get("world_size") or 1)
            par = self.manifest.get("parallel") or {}
            replicas = int(par.get("dp") or 1) * int(par.get("ep") or 1)
            base = (replicas * int(self.config.get("micro_batch_size", 1)) * int(self.config.get("seq_len", 1))
                    * int(self.config.get("microbatches") or 1)) / world
        scale = (int(cfg["micro_batch_size"]) * int(cfg.get("microbatches") or 1) * int(cfg["seq_len"])) / (
            int(self.config["micro_batch_size"]) * int(self.config.get("microbatches") or 1) * int(self.config["seq_len"]))
        return float(base) * scale

    @staticmethod
    def _run_config(raw: dict, manifest: Path) -> dict:
        """The run's config, checked by the trainer's own loader (the model computes with its values):
        a manifest whose config the trainer would refuse is one line naming the manifest."""
        from trainer.config import ConfigError, load_config  # noqa: PLC0415 (standard library + PyYAML)

        try:
            return load_config(None, dict(raw))
        except ConfigError as e:
            raise WhatIfError(f"{manifest}: the run's config is not valid ({e})") from None

    def _validate(self, changes: dict) -> dict:
        from trainer.config import ConfigError, load_config  # noqa: PLC0415 (standard library + PyYAML)

        from trainer.config import DEFAULTS  # noqa: PLC0415

        bad = [k for k in changes if k not in DEFAULTS]
        if bad:
            raise WhatIfError(f"unknown trainer key {bad[0]!r} (see docs/trainer.md for the keys)")
        unmodeled = [k for k, v in changes.items()
                     if k not in MODELED and k not in NEUTRAL and self.config.get(k, DEFAULTS[k]) != v]
        if unmodeled:
            raise WhatIfError(f"{unmodeled[0]}: the what-if model has no mechanism for this key yet (it models "
                              f"{', '.join(MODELED)})")
        try:
            new = load_config(None, {**self.config, **changes})
        except ConfigError as e:
            raise WhatIfError(str(e)) from None
        return new

    # -------------------------------------------------------------- knob mechanisms
    def _apply(self, plan: _Plan, p: StepProfile, new: dict, diff: dict, modeled: list, notes: list) -> float:
        """Edit ``plan`` for the changed keys; returns the variance (relative^2) the edits add."""
        var = 0.0
        w = p.work
        old = self.config
        t0 = int(old["micro_batch_size"]) * int(old["seq_len"])
        t1 = int(new["micro_batch_size"]) * int(new["seq_len"])
        s_tok = t1 / t0
        dur0 = np.asarray(plan.dur, dtype=float)
        changed_ns = 0.0
        base_total = float(p.step_ns)
        names = w["name"].to_numpy()
        scale = w["scale"].to_numpy()
        expert = w["expert"].to_numpy()
        # ---- device drains inside the per-expert expert stage (before anything moves positions)
        var += self._drains(plan, p, new, modeled)
        # ---- tokens per micro-batch
        if s_tok != 1.0:
            floors = pd.Series(dur0[: len(w)]).groupby(names).transform("min").to_numpy()
            chunked = self._chunk_units(w, old)
            tok = (scale == "tokens") & ~chunked & ~(expert & (self.table is not None))
            for j in np.flatnonzero(tok):
                f = min(floors[j], dur0[j])
                plan.dur[j] = f + s_tok * (dur0[j] - f)
            if chunked.any():
                reps = math.ceil(t1 / int(old["loss_chunk_size"])) / math.ceil(t0 / int(old["loss_chunk_size"]))
                pos = {j: i for i, (k, j) in enumerate(zip(plan.kind, plan.ref)) if k == 0}
                for j in np.flatnonzero(chunked):
                    plan.dur[j] = dur0[j] * reps
                    i = pos.get(int(j))
                    if i is not None:
                        plan.gap[i] *= reps
            d = float(np.abs(np.asarray(plan.dur[: len(w)]) - dur0[: len(w)]).sum())
            changed_ns += d
            var += (SIGMA["tokens"] * d / base_total) ** 2
            modeled.append(f"micro_batch_size {old['micro_batch_size']} -> {new['micro_batch_size']}: token-"
                           f"proportional work x{s_tok:g} above each kernel's fixed part"
                           + (f"; chunked loss x{reps:g} launches" if chunked.any() else "")
                           + "; per-step work and host launch costs unchanged")
        # ---- a per-expert backend's GEMMs meet new shapes more often with more tokens
        if old["grouped_gemm_backend"] in PER_EXPERT and new["grouped_gemm_backend"] in PER_EXPERT:
            var += self._shape_misses(plan, p, t0, t1, modeled if s_tok != 1.0 else None, notes,
                                      (self.manifest.get("metrics") or {}).get("timed_steps"))
        # ---- expert GEMM backend (and the rows it sees)
        b0, b1 = old["grouped_gemm_backend"], new["grouped_gemm_backend"]
        lvl0, lvl1 = int(old["sync_free_level"]), int(new["sync_free_level"])
        masked0 = b0 in PER_EXPERT and lvl0 >= 2
        masked1 = b1 in PER_EXPERT and lvl1 >= 2
        pad0 = int(old.get("ep") or 1) > 1 and lvl0 >= 3
        pad1 = int(new.get("ep") or 1) > 1 and lvl1 >= 3
        if b0 != b1 or (self.table is not None and s_tok != 1.0) or masked0 != masked1 or pad0 != pad1:
            v = self._experts(plan, p, new, b0, b1, t0, t1, masked0, masked1, modeled, notes)
            var += v
        # ---- sync-free level: the MoE layer's blocking syncs
        n0, n1 = _moe_syncs(old, lvl0, b0), _moe_syncs(new, lvl1, b1)
        if n1 != n0:
            var += self._syncs(plan, p, n0, n1, modeled)
        # ---- recomputation
        r0, r1 = set(old.get("recompute_layer_ids") or []), set(new.get("recompute_layer_ids") or [])
        if r0 != r1:
            var += self._recompute(plan, p, r0, r1, modeled, notes)
        # ---- gradient accumulation
        m0, m1 = int(old.get("microbatches") or 1), int(new.get("microbatches") or 1)
        if m0 != m1:
            f = m1 / m0
            per_step = set(np.flatnonzero(scale == "params").tolist())
            for i, (k, j) in enumerate(zip(plan.kind, plan.ref)):
                if k == 0 and j < len(w) and j in per_step:
                    continue
                plan.gap[i] *= f
            for j in range(len(plan.dur)):
                if not (j < len(w) and j in per_step):
                    plan.dur[j] *= f
            var += SIGMA["microbatches"] ** 2
            modeled.append(f"microbatches {m0} -> {m1}: per-micro-batch work and launches x{f:g}, per-step "
                           "work (optimizer, gradient reduction) once")
            if int(new.get("pp") or 1) > 1:
                notes.append("pipeline: the bubble's change with the number of micro-batches is not modeled")
        # ---- optimizer implementation
        if old.get("optimizer", "adamw") != new.get("optimizer", "adamw"):
            var += self._optimizer(plan, p, old.get("optimizer", "adamw"), new["optimizer"], modeled, notes)
        # ---- the routed experts' SwiGLU: eager kernels or the fused pair
        e0, e1 = old.get("expert_swiglu", "torch"), new.get("expert_swiglu", "torch")
        if e0 != e1:
            var += self._swiglu(plan, p, e0, e1, modeled, notes)
        # ---- step timing: the sync at the end of every step, or none (the last edit: it acts on the step's end)
        if old.get("step_timing", "sync") != new.get("step_timing", "sync"):
            self._step_timing(plan, p, old.get("step_timing", "sync"), new["step_timing"], modeled, notes)
        return var

    @staticmethod
    def _step_timing(plan: _Plan, p: StepProfile, s0: str, s1: str, modeled: list, notes: list) -> None:
        """``sync``: ``torch.cuda.synchronize`` after every step (the trace's blocking syncs after the
        step's last launch); ``events``: none, the host queues the next steps while the GPU works, and only a
        log point blocks (:meth:`replay.Plan.replay_chain`, run by :meth:`predict`). Dropping the end syncs
        here, adding one (and no backlog: the device is drained at every step start) for events -> sync."""
        if p.device != "gpu":
            modeled.append(f"step_timing {s0} -> {s1}: no change on a CPU (nothing asynchronous to wait for)")
            return
        units = [i for i, kd in enumerate(plan.kind) if kd == 0]
        last_launch = units[-1] if units else -1
        trailing = {i for i, kd in enumerate(plan.kind) if kd == 1 and i > last_launch}
        if s1 == "events":
            if not trailing:
                notes.append("step_timing sync -> events: no blocking sync after the step's last launch in the "
                             "profiled step; only the run-ahead across steps is modeled")
            plan.drop_items(trailing)
            modeled.append(f"step_timing sync -> events: the sync after the step dropped ({len(trailing)} blocking "
                           "call(s)); the host queues the next steps while the device works, a blocking read at "
                           "each log point (a chain of log_every steps replayed)")
        else:
            if not trailing:
                plan.add_sync(len(plan.kind), _median_sync_return(plan))
            plan.backlog = {}
            modeled.append("step_timing events -> sync: a blocking sync after each step; every step starts on a "
                           "drained device")

    @staticmethod
    def _shape_stats(plan: _Plan, p: StepProfile) -> tuple[list, float, float] | None:
        """From the profiled step's expert-stage GEMMs of a per-expert backend: the host items of the GEMMs whose
        shape is the first of its kind in the step, the share of them that paid a miss (host gap above the
        repeated shapes' median + 3 MADs) and the cost of a miss (median slow - median repeated). None when
        the step has too few of either kind to tell."""
        w = p.work
        stage = w["moe_stage"].to_numpy()
        op = w["op"].to_numpy()
        dims = w["dims"].to_numpy()
        items = [(i, int(j)) for i, (kd, j) in enumerate(zip(plan.kind, plan.ref))
                 if kd == 0 and j < len(w) and stage[j] == "moe/experts" and op[j] in ("aten::mm", "aten::addmm")]
        seen: set = set()
        first, rep = [], []
        for i, j in items:
            (rep if dims[j] in seen else first).append(i)
            seen.add(dims[j])
        if len(first) < 20 or len(rep) < 20:
            return None
        g_rep = np.array([plan.gap[i] for i in rep])
        g_first = np.array([plan.gap[i] for i in first])
        med = float(np.median(g_rep))
        thr = med + 3 * 1.4826 * float(np.median(np.abs(g_rep - med)))
        slow = g_first > thr
        p0 = float(slow.mean())
        if not 0.0 < p0 < 1.0:
            return None
        return first, p0, float(np.median(g_first[slow])) - med

    @staticmethod
    def _miss_rate(p0: float, step: int, timed, t0: int, t1: int) -> float:
        """The mean share of new shapes over the run's timed steps at ``t1`` tokens, from ``p0`` measured at
        the profiled step ``step`` with ``t0``. A GEMM's row count is an expert's token count, drawn each step
        from a range that grows with the tokens; the library remembers every shape it has met, so after k
        steps of D draws from R values a draw is new with probability exp(-k D / R): p(k) = p0 ** (k / step)
        in the run (the steps of a per-expert run get faster as it goes: 421 -> 277 ms over the timed steps of
        the H100 proxy's loop micro-batch 2, where grouped runs are flat), and ** (t0 / t1) with the tokens."""
        ks = [k for k in timed if isinstance(k, int) and not isinstance(k, bool) and k >= 0] \
            if isinstance(timed, list) else []
        if step < 1 or not ks:
            return p0 ** (t0 / t1)
        return float(np.mean([p0 ** ((k / step) * (t0 / t1)) for k in ks]))

    @staticmethod
    def _shape_misses(plan: _Plan, p: StepProfile, t0: int, t1: int, modeled: list | None, notes: list,
                      timed=None) -> float:
        """A per-expert backend runs one GEMM per expert on that expert's token count, a new shape nearly every
        step; the BLAS library's host-side choice of kernel for a shape it has not seen costs a few hundred µs
        (on the H100 proxy a GEMM whose shape already ran in the step took a median 33-41 µs of host time; of
        the first ones 34 % were slow at micro-batch 2, 73 % at 12). The profiled step shows p0 and the cost
        (:meth:`_shape_stats`); the run's timed steps, and a changed token count, meet new shapes at the rate
        :meth:`_miss_rate` gives: each first GEMM's host gap moves by (rate - p0) x cost. The calibration
        applies the unchanged run's own rate, so the host factor does not absorb the run's trend."""
        st = Model._shape_stats(plan, p)
        if st is None:
            if modeled is not None and t0 != t1:
                notes.append("per-expert GEMM shapes: too few in the profiled step to measure how often a new "
                             "shape costs host time: its change with the tokens is not modeled")
            return 0.0
        first, p0, cost = st
        rate = Model._miss_rate(p0, int(p.step), timed, t0, t1)
        moved = 0.0
        for i in first:
            new_gap = max(plan.gap[i] + (rate - p0) * cost, 0.0)
            moved += new_gap - plan.gap[i]
            plan.gap_x[i] = min(max(plan.gap_x[i] + new_gap - plan.gap[i], 0.0), new_gap)  # the stage's own time
            plan.gap[i] = new_gap
        if modeled is not None:
            modeled.append(f"per-expert GEMMs: a new shape costs {cost / 1e3:.0f} µs of host time; {100 * p0:.0f} % of "
                           f"the step's {len(first)} first shapes were new at {t0} tokens in step {p.step}, "
                           f"{100 * rate:.0f} % predicted over the timed steps at {t1} "
                           f"({moved / 1e6:+.1f} ms of host time, profiled)")
        return (SIGMA["shapes"] * moved / max(float(p.step_ns), 1.0)) ** 2 if t0 != t1 else 0.0

    def _drains(self, plan: _Plan, p: StepProfile, new: dict, modeled: list) -> float:
        """Per-expert backends (loop, multistream) allocate per-expert buffers of a different size for every
        expert: inside their expert stage's backward the host sometimes waits until the device has drained
        (the caching allocator reorganising its pool; no sync call is recorded: the replay finds these waits,
        ``replay._hidden_syncs``). On the H100 proxy (3 grids, 52 runs) such a drain appeared in 7 of 7
        per-expert runs whose peak memory grew past the level of micro-batch 2 (without recompute), in 1 of 9
        at that level, and in none of 34 grouped-backend runs inside the expert stage. So: a grouped backend
        has none (the baseline's are dropped: the host work before them stays, the wait goes); a per-expert
        backend whose projected peak grows past the baseline's gets one at the first expert backward, where
        the measured ones are, unless the baseline already shows it (it then moves with the device time)."""
        w = p.work
        b0, b1 = self.config["grouped_gemm_backend"], new["grouped_gemm_backend"]
        if b0 not in PER_EXPERT and b1 not in PER_EXPERT:
            return 0.0
        n_rec = len(p.syncs)
        stage = w["moe_stage"].to_numpy()
        back = w["backward"].to_numpy()
        hidden = [i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref))
                  if kd == 1 and j >= n_rec and i + 1 < len(plan.kind) and plan.kind[i + 1] == 0
                  and plan.ref[i + 1] < len(w) and stage[plan.ref[i + 1]] == "moe/experts"]
        if b0 in PER_EXPERT and b1 not in PER_EXPERT:
            if not hidden:
                return 0.0
            waited = sum(plan.sync_ret[plan.ref[i]] for i in hidden)
            for i in hidden:
                plan.gap[i + 1] += plan.gap[i]
            plan.drop_items(set(hidden))
            modeled.append(f"{b1}: the {len(hidden)} device drain(s) inside the per-expert expert stage removed "
                           "(a grouped backend's expert stage has none)")
            return (SIGMA["syncs"] * 0.1 * waited / max(float(p.step_ns), 1.0)) ** 2
        if b1 not in PER_EXPERT or hidden:
            return 0.0
        try:
            grows = (self._project(new) or 0.0) > (self._project(self.config) or 0.0) * 1.001
        except Exception:  # noqa: BLE001 - no projection: no basis to add one
            return 0.0
        if not grows:
            return 0.0
        first = next((i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref))
                      if kd == 0 and j < len(w) and back[j] and stage[j] == "moe/experts"), None)
        if first is None:
            return 0.0
        plan.add_sync(first, DRAIN_RETURN_NS)
        modeled.append(f"{b1}: a device drain at the first expert backward (per-expert buffers with more memory "
                       "in use: measured in every such run on the H100 proxy)")
        return SIGMA["syncs"] ** 2 * 0.01

    def _pipeline(self, new: dict, step_other: float, comps: dict, rank: int, modeled: list,
                  notes: list) -> tuple[float, dict, float]:
        """Pipeline knobs (schedule, vpp, layout, micro-batches of a pipelined run): the new schedule replayed
        over the run's measured stage costs (`pipeline_whatif`), scaled by what the other knobs did to the
        step. Returns (step s, components adding up to it, variance)."""
        try:
            if self.pipe_base is None:
                self.pipe_base = PW.pipeline_base(self.run, manifest=self.manifest)
            scale = step_other / self.base_step_s if self.base_step_s > 0 else 1.0
            pr = PW.predict_pipeline(self.pipe_base, new, scale)
        except PW.PipelineWhatIfError as e:
            raise WhatIfError(str(e)) from None
        base = self.pipe_base
        modeled.extend(pr.modeled)
        notes.extend(pr.notes + base.notes)
        if abs(base.step_ns / 1e9 / self.base_step_s - 1.0) > 0.05:
            notes.append(f"pipeline: the step is predicted from the steady steps ({base.step_basis}; median "
                         f"{base.step_ns / 1e6:.1f} ms), not the manifest's mean step {1e3 * self.base_step_s:.1f} ms "
                         "(a warm-up or trace-export step in that mean?)")
        step = pr.step_ns / 1e9
        # the components of the reported rank: its pipeline work changes with its actions, the rest of the
        # change is idle (the bubble); no part goes below zero
        pp_rank = base.rank_to_pp.get(rank)
        d_busy = (pr.busy_ns[pp_rank] - pr.base_busy_ns[pp_rank]) / 1e9 if pp_rank is not None else 0.0
        out = dict(comps)
        work = [c for c in out if c not in ("sync waits", "launch-bound idle", "pipeline bubble", "other")]
        tot_work = sum(out[c] for c in work)
        if tot_work > 0 and d_busy:
            f = max(tot_work + d_busy, 0.0) / tot_work
            for c in work:
                out[c] *= f
        rest = step - sum(out.values())
        for c in ("pipeline bubble", "other", "launch-bound idle", "sync waits"):
            if rest >= 0:
                break
            take = min(out.get(c, 0.0), -rest)
            out[c] = out.get(c, 0.0) - take
            rest += take
        if rest >= 0:
            out["pipeline bubble"] = out.get("pipeline bubble", 0.0) + rest
        else:  # still too much: everything shrinks in proportion
            tot = sum(out.values())
            out = {c: v * step / tot for c, v in out.items()} if tot > 0 else out
        var = (SIGMA["pipeline"] * pr.window_ns / max(pr.step_ns, 1.0)) ** 2
        return step, {c: float(v) for c, v in out.items()}, var

    @staticmethod
    def _chunk_units(w: pd.DataFrame, cfg: dict) -> np.ndarray:
        """Units of a chunked (fused) loss: their number follows the tokens, not their size. A unit of the
        loss loop works on a chunk of ``loss_chunk_size`` tokens against the ``vocab_size`` output rows:
        its op's input shapes hold both numbers."""
        chunk, vocab = int(cfg.get("loss_chunk_size") or 0), int(cfg.get("vocab_size") or 0)
        if not cfg.get("loss_fusion") or chunk <= 0 or vocab <= 0 or "dims" not in w:
            return np.zeros(len(w), bool)
        out = np.zeros(len(w), bool)
        for i, d in enumerate(w["dims"].to_numpy()):
            nums = {int(x) for x in re.findall(r"\d+", str(d))} if d else set()
            out[i] = chunk in nums and vocab in nums
        return out

    def _experts(self, plan: _Plan, p: StepProfile, new: dict, b0: str, b1: str, t0: int, t1: int, masked0: bool,
                 masked1: bool, modeled: list, notes: list) -> float:
        w = p.work
        ex = np.flatnonzero(w["expert"].to_numpy())
        if not len(ex):
            notes.append("no expert GEMM kernels in the profiled step: the backend change is not modeled")
            return 0.0
        old = self.config
        k = int(old["top_k"])
        ep = int(old.get("ep") or 1)
        e_local = int(old["n_routed_experts"]) // ep
        # rows the expert GEMMs see (trainer/gemm_shapes.py): at EP > 1 and level 3 the whole worst-case
        # buffer, ep * tokens * min(top_k, local experts)
        rows0 = t0 * (ep * min(k, e_local) if ep > 1 and int(old["sync_free_level"]) >= 3 else k)
        rows1 = t1 * (ep * min(k, e_local) if ep > 1 and int(new["sync_free_level"]) >= 3 else k)
        d, ff = int(old["d_model"]), int(old["moe_d_ff"])
        layer = w["layer"].to_numpy()
        back = w["backward"].to_numpy()
        base_ns = float(w["dur"].to_numpy()[ex].sum())
        passes = {False: (("fwd", rows0, d, 2 * ff), ("fwd", rows0, ff, d)),
                  True: (("dx", rows0, d, 2 * ff), ("dw", rows0, d, 2 * ff), ("dx", rows0, ff, d), ("dw", rows0, ff, d))}

        def table_ms(backend: str, rows: int, bw: bool) -> float | None:
            if self.table is None:
                return None
            tot = 0.0
            for pass_, _r, K, N in passes[bw]:
                ms = self.table.ms(pass_, rows, K, N, e_local, "loop" if backend == "multistream" else
                                   ("torch" if backend == "auto" else backend))
                if ms is None:
                    return None
                tot += ms
            return tot

        pos = {j: i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)) if kd == 0}
        source = "table" if self.table is not None else "merge"
        pending: list[tuple] = []  # (item position, units, ns each, stream, host gap each) to insert
        inserted: list[int] = []
        drop: set[int] = set()
        groups: dict[tuple, list[int]] = {}
        for j in ex:
            groups.setdefault((int(layer[j]), bool(back[j])), []).append(int(j))
        host_gap = float(np.median([plan.gap[pos[j]] for j in ex if j in pos])) if pos else 0.0
        used_table = False
        merged_ns = 0.0
        for (ly, bw), js in groups.items():
            meas = float(sum(w["dur"].iloc[j] for j in js))
            m_old = table_ms(b0, rows0, bw)
            m_new = table_ms(b1, rows1, bw)
            if m_old and m_new:
                used_table = True
                new_total = meas * m_new / m_old
            else:
                # no table: per-expert -> grouped merges the work and pays one fixed part per pass
                dj = np.array([plan.dur[j] for j in js])  # already token-scaled
                f = float(dj.min())
                n_pass = len(passes[bw])
                if (b0 in PER_EXPERT) and (b1 not in PER_EXPERT):
                    new_total = float((dj - f).sum()) + f * n_pass
                elif (b0 not in PER_EXPERT) and (b1 in PER_EXPERT):
                    new_total = float(dj.sum()) + f * n_pass * (e_local - 1)
                else:
                    new_total = float(dj.sum())
                if masked1 and not masked0:
                    new_total *= e_local
                elif masked0 and not masked1:
                    new_total /= e_local
            n_new = (e_local if b1 in PER_EXPERT else 1) * len(passes[bw])
            if (b0 in PER_EXPERT) == (b1 in PER_EXPERT) and len(js) >= 1 and not (masked0 or masked1):
                # same launch structure: rescale in place
                cur = sum(plan.dur[j] for j in js) or 1.0
                for j in js:
                    plan.dur[j] = plan.dur[j] * new_total / cur
                continue
            # different launch structure: the group's launches are replaced
            if b0 in PER_EXPERT and b1 not in PER_EXPERT:
                merged_ns += self._merge_per_expert(plan, w, pos, ly, bw, e_local, drop)
            first = min(pos[j] for j in js if j in pos)
            stream = plan.stream[js[0]]
            for j in js:
                if j in pos:
                    drop.add(pos[j])
            # new units go where the first of the group was launched
            pending.append((first, n_new, new_total / n_new, stream, host_gap))
        pool = 0.0
        n_old = n_kept = 0
        if pending:
            # the expert stage's host time (its own CPU ops: one set per expert for a per-expert backend, a
            # few per pass for a grouped one) scales with the number of units the stage launches
            pool = float(sum(plan.gap_x))
            for i in range(len(plan.gap)):
                plan.gap[i] -= plan.gap_x[i]
                plan.gap_x[i] = 0.0
            stg = w["moe_stage"].to_numpy()
            in_stage = {int(j) for j in np.flatnonzero(stg == "moe/experts")}
            n_old = sum(1 for kd, j in zip(plan.kind, plan.ref) if kd == 0 and j in in_stage)
            n_kept = sum(1 for i, (kd, j) in enumerate(zip(plan.kind, plan.ref))
                         if kd == 0 and j in in_stage and i not in drop)
        if drop or pending:
            pend = sorted(pending, reverse=True)
            keep_pos = [i for i in range(len(plan.kind)) if i not in drop]
            remap = {old_i: new_i for new_i, old_i in enumerate(keep_pos)}
            plan.drop_items(drop)
            for first, n_new, each, stream, gap in pend:
                at = remap.get(first)
                if at is None:
                    at = next((remap[i] for i in range(first, first + 10**6) if i in remap), len(plan.kind))
                for _ in range(n_new):
                    inserted.append(plan.add_unit(each, stream, "expert GEMMs", 0.0, at))
        if inserted and n_old:
            n_after = n_kept + len(inserted)
            share = pool * n_after / n_old / len(inserted)
            pos_new = {j: i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)) if kd == 0}
            for j in inserted:
                plan.gap[pos_new[j]] += share
                plan.gap_x[pos_new[j]] += share
            merged_host = pool - share * len(inserted)
        else:
            merged_host = 0.0
        new_ns = float(sum(plan.dur[j] for kd, j in zip(plan.kind, plan.ref) if kd == 0 and plan.comp[j] == "expert GEMMs"))
        what = "kernel-table ratio" if used_table else "merged per-expert work (no kernel table)"
        modeled.append(f"grouped_gemm_backend {b0} -> {b1}" + (" (masked reference)" if masked1 else "")
                       + f": expert GEMMs {base_ns / 1e6:.2f} -> {new_ns / 1e6:.2f} ms by {what}"
                       + ("; launches per pass 1 per expert" if b1 in PER_EXPERT else "; one launch per pass")
                       + (f"; the per-expert copies/elementwise kernels merged ({merged_ns / 1e6:.2f} ms less)"
                          if merged_ns else "")
                       + (f"; the expert stage's host time x{(n_kept + len(inserted)) / n_old:.2f} with its launches "
                          f"({merged_host / 1e6:+.2f} ms less, profiled)" if inserted and n_old and pool else ""))
        if b0 not in PER_EXPERT and b1 in PER_EXPERT:
            notes.append(f"{b1}: the per-expert backend's extra copies and elementwise kernels (besides its GEMMs) are "
                         "not in this grouped run's trace: predicted time is a lower bound")
        if not used_table and b0 != b1:
            notes.append("no kernel table for the backend change: run `tracelens kernels tune --config ... --json T.json` "
                         "on the GPU and pass --kernel-table T.json for a measured ratio")
            source = "merge"
        # the GEMM change, the merged kernels and the expert stage's host time moved: each modeled
        changed = abs(new_ns - base_ns) + merged_ns + abs(merged_host)
        return (SIGMA[source] * changed / max(float(p.step_ns), 1.0)) ** 2

    @staticmethod
    def _merge_per_expert(plan: _Plan, w: pd.DataFrame, pos: dict, ly: int, bw: bool, e_local: int,
                          drop: set) -> float:
        """A per-expert backend repeats some copies and elementwise kernels once per local expert (splits,
        concatenation, per-expert gradient buffers). A grouped backend runs each once over all rows: the
        kernels of one name repeated in this MoE layer's expert stage merge into one, whose time keeps the
        summed work above the fastest instance (work on rows adds up, the fixed part is paid once). Returns
        the ns removed."""
        stage = w["moe_stage"].to_numpy()
        sel = np.flatnonzero((stage == "moe/experts") & ~w["expert"].to_numpy() & (w["layer"].to_numpy() == ly)
                             & (w["backward"].to_numpy() == bw))
        if not len(sel):
            return 0.0
        names = w["name"].to_numpy()[sel]
        removed = 0.0
        need = max(2, e_local // 4)
        for nm in set(names):
            js = [int(j) for j in sel[names == nm] if int(j) in pos]
            if len(js) < need:
                continue
            d = np.array([plan.dur[j] for j in js])
            f = float(d.min())
            keep = js[0]
            new = f + float((d - f).sum())
            removed += float(d.sum()) - new
            plan.dur[keep] = new
            for j in js[1:]:
                drop.add(pos[j])
        return removed

    def _syncs(self, plan: _Plan, p: StepProfile, n0: int, n1: int, modeled: list) -> float:
        sy = p.syncs
        moe = sy["moe"].to_numpy() if len(sy) else np.zeros(0, bool)
        if n1 < n0:
            # drop MoE syncs: all of them when the new level has none, else the first (permute) ones
            moe_pos = [i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)) if kd == 1 and j < len(moe) and moe[j]]
            if n1 == 0:
                drop = set(moe_pos)
            else:
                paths = sy["path"].to_numpy()
                drop = {i for i in moe_pos if "moe/permute" in str(paths[plan.ref[i]])}
            for i in drop:  # the host work after a dropped sync stays; the wait goes
                if i + 1 < len(plan.gap):
                    plan.gap[i + 1] += plan.gap[i]
            plan.drop_items(drop)
            modeled.append(f"sync_free_level: {len(drop)} blocking MoE sync(s) per step removed")
        else:
            # add syncs: one per MoE layer forward (and per recomputed forward) at its permutation
            w = p.work
            stage = w["moe_stage"].to_numpy()
            back = w["backward"].to_numpy()
            layer = w["layer"].to_numpy()
            want = n1 - n0
            firsts: dict[int, int] = {}
            for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)):
                if kd == 0 and j < len(w) and not back[j] and stage[j] in ("moe/permute", "moe/router", "moe/experts"):
                    firsts.setdefault(int(layer[j]), i)
            cost = float(np.median(plan.sync_ret)) if plan.sync_ret else 20_000.0
            added = 0
            for at in sorted(firsts.values(), reverse=True):
                for _ in range(want):
                    plan.add_sync(at, cost)
                    added += 1
            modeled.append(f"sync_free_level: {added} blocking MoE sync(s) per step added (at each MoE layer's "
                           "permutation)")
        return SIGMA["syncs"] ** 2 * 0.01

    def _recompute(self, plan: _Plan, p: StepProfile, r0: set, r1: set, modeled: list, notes: list) -> float:
        w = p.work
        layer = w["layer"].to_numpy()
        back = w["backward"].to_numpy()
        rec = w["recompute"].to_numpy()
        pos = {j: i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)) if kd == 0}
        added_ns = 0.0
        removed = set()
        for ly in sorted(r0 - r1):
            for j in np.flatnonzero(rec & (layer == ly)):
                if int(j) in pos:
                    removed.add(pos[int(j)])
                    added_ns -= plan.dur[int(j)]
        inserts = []
        pending_share: list[tuple] = []
        for ly in sorted(r1 - r0):
            fwd = [int(j) for j in np.flatnonzero((layer == ly) & ~back & ~rec) if int(j) in pos]
            bwd = [pos[int(j)] for j in np.flatnonzero((layer == ly) & back) if int(j) in pos]
            if not fwd:
                # no "layer/<i>" ranges (a trace from before the trainer marked them): one layer's share of
                # the forward's device work, run once before the backward starts
                fw = np.flatnonzero(~back & ~rec & (w["scale"].to_numpy() == "tokens"))
                n_layers = int(self.config.get("n_layers") or 1)
                first_b = [pos[int(j)] for j in np.flatnonzero(back) if int(j) in pos]
                if not len(fw) or not first_b:
                    notes.append(f"recompute layer {ly}: no forward work found in the trace: not modeled")
                    continue
                share = float(sum(plan.dur[int(j)] for j in fw)) / n_layers
                pending_share.append((min(first_b), share, int(plan.stream[int(fw[0])])))
                notes.append(f"recompute layer {ly}: the trace has no 'layer/{ly}' range: modeled as 1/{n_layers} of "
                             "the forward's token work")
                continue
            at = min(bwd) if bwd else len(plan.kind)
            inserts.append((at, fwd))
        if removed:
            plan.drop_items(removed)
            # positions after drops: recompute them for the inserts
            pos = {j: i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)) if kd == 0}
            inserts = [(min((pos[j] for j in np.flatnonzero((layer == ly) & back) if int(j) in pos),
                            default=len(plan.kind)), fwd) for (_at, fwd), ly in zip(inserts, sorted(r1 - r0))]
        orig_pos = {j: i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)) if kd == 0}
        for at, fwd in sorted(inserts, key=lambda x: -x[0]):
            if plan.cpu:
                # on a CPU the host is the device: the layer's forward costs its whole span (its ops' own
                # time and the Python between them), run again
                st = w["start"].to_numpy()[fwd]
                en = st + w["dur"].to_numpy()[fwd]
                span = float(en.max() - st.min()) if len(fwd) else 0.0
                plan.add_unit(span, 0, "other", 0.0, at)
                added_ns += span
                continue
            for j in reversed(fwd):
                gap = plan.gap[orig_pos[j]] if j in orig_pos else 0.0
                plan.add_unit(plan.dur[j], plan.stream[j], plan.comp[j], gap, at)
                added_ns += plan.dur[j]
        for at, share, stream in sorted(pending_share, key=lambda x: -x[0]):
            at = min(at, len(plan.kind))
            plan.add_unit(share, stream, "other", 0.0, at)
            added_ns += share
        if r1 - r0 or r0 - r1:
            modeled.append(f"recompute_layer_ids {sorted(r0)} -> {sorted(r1)}: forward of the recomputed layers runs "
                           f"again in the backward ({added_ns / 1e6:+.2f} ms of device work)")
        return (SIGMA["recompute"] * abs(added_ns) / max(float(p.step_ns), 1.0)) ** 2

    @staticmethod
    def _swiglu(plan: _Plan, p: StepProfile, e0: str, e1: str, modeled: list, notes: list) -> float:
        """``expert_swiglu``: per MoE layer, the eager activation (forward ``silu`` + ``mul``; backward two
        ``mul``, ``silu_backward`` and the ``cat`` of ``h.chunk(2)``'s backward, the first ``cat`` after the
        ``silu_backward`` before any GEMM) against the fused pair (``_swiglu_fwd_kernel`` /
        ``_swiglu_bwd_kernel``), by the bytes each moves at the measured kernels' bandwidth: the forward mul
        and the fused forward both move 3 R F elements (read gate and up, write the product), so the fused
        forward lasts as long as that layer's eager mul and the fused backward (5 R F: read gate, up and the
        output gradient, write both input gradients) 5/3 of it; eager is 5 R F forward (silu 2, mul 3) and 13
        R F backward (mul 3, mul 3, silu_backward 3, cat 4). Launches removed with the eager kernels; the
        other way the fused kernels are scaled up, without the eager kernels' extra launches."""
        if p.device != "gpu":
            modeled.append(f"expert_swiglu {e0} -> {e1}: no model on a CPU trace (the fused kernel runs under "
                           "Triton's interpreter there)")
            return 0.0
        w = p.work
        op = w["op"].to_numpy()
        name = w["name"].astype(str).to_numpy()
        exp = (w["moe_stage"] == "moe/experts").to_numpy()
        back = w["backward"].to_numpy()
        layer = w["layer"].to_numpy()
        pos = {j: i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)) if kd == 0}
        before = after = 0.0
        done: list[int] = []
        if e1 == "triton":
            gemm = np.isin(op, ("aten::mm", "aten::addmm", "aten::_grouped_mm", "aten::bmm")) | np.char.find(
                name.astype(str), "gmm") >= 0
            drop: set[int] = set()
            for ly in sorted({int(v) for v in layer[exp]}):
                at = exp & (layer == ly)
                f_silu = np.flatnonzero(at & ~back & (op == "aten::silu"))
                f_mul = np.flatnonzero(at & ~back & (op == "aten::mul"))
                b_silu = np.flatnonzero(at & back & (op == "aten::silu_backward"))
                b_mul = np.flatnonzero(at & back & (op == "aten::mul"))
                if not (len(f_silu) == len(f_mul) == len(b_silu) == 1 and len(b_mul) == 2):
                    notes.append(f"expert_swiglu: layer {ly}: the eager SwiGLU kernels (1 silu + 1 mul forward, "
                                 "2 mul + 1 silu_backward backward) were not found as expected; layer not modeled")
                    continue
                cat = []
                for j in range(int(b_silu[0]) + 1, len(w)):  # launch order: the chunk's cat follows silu_backward
                    if at[j] and back[j] and gemm[j]:
                        break
                    if at[j] and back[j] and op[j] == "aten::cat":
                        cat = [j]
                        break
                old_units = [int(f_silu[0]), int(f_mul[0]), int(b_silu[0]), *map(int, b_mul), *cat]
                d_mul = float(plan.dur[int(f_mul[0])])
                before += sum(float(plan.dur[j]) for j in old_units)
                plan.dur[int(f_mul[0])] = d_mul  # the fused forward: the mul's bytes at the mul's bandwidth
                plan.dur[int(b_silu[0])] = d_mul * 5.0 / 3.0
                after += d_mul * (1.0 + 5.0 / 3.0)
                drop |= {pos[j] for j in (int(f_silu[0]), *map(int, b_mul), *cat) if j in pos}
                done.append(ly)
            plan.drop_items(drop)
        else:
            for j in np.flatnonzero(exp):
                f = 5.0 / 3.0 if "_swiglu_fwd_kernel" in name[j] else 13.0 / 5.0 if "_swiglu_bwd_kernel" in name[j] else 0.0
                if f:
                    before += float(plan.dur[j])
                    plan.dur[j] = float(plan.dur[j]) * f
                    after += float(plan.dur[j])
                    done.append(int(layer[j]))
            done = sorted(set(done))
            if done:
                notes.append("expert_swiglu triton -> torch: the eager kernels' extra launches (4 per layer) are not "
                             "added")
        if not done:
            notes.append(f"expert_swiglu {e0} -> {e1}: no SwiGLU kernels of the routed experts in the profiled step; "
                         "not modeled")
            return 0.0
        modeled.append(f"expert_swiglu {e0} -> {e1}: SwiGLU of {len(done)} MoE layer(s) {before / 1e6:.2f} -> "
                       f"{after / 1e6:.2f} ms (bytes moved at the measured kernels' bandwidth); peak memory not "
                       "modeled (the fused pair keeps R x F fewer elements per layer)")
        return (SIGMA["swiglu"] * abs(after - before) / max(float(p.step_ns), 1.0)) ** 2

    def _optimizer(self, plan: _Plan, p: StepProfile, o0: str, o1: str, modeled: list, notes: list) -> float:
        if p.device != "gpu":
            modeled.append(f"optimizer {o0} -> {o1}: no change on a CPU (fused AdamW is CUDA-only)")
            return 0.0
        w = p.work
        opt = np.flatnonzero((w["component"] == "optimizer step").to_numpy())
        if not len(opt):
            notes.append("no optimizer kernels in the profiled step: optimizer change not modeled")
            return 0.0
        meas = float(w["dur"].to_numpy()[opt].sum())
        # foreach AdamW makes several passes over the state (one kernel family per foreach op); fused makes
        # one. The passes are the distinct foreach kernel launches per parameter chunk: estimate them from
        # the kernel names (multi_tensor_apply families).
        fam = w["op"].to_numpy()[opt]
        n_pass = max(len({f for f in fam if "_foreach_" in str(f)}), 1)
        pos = {j: i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)) if kd == 0}
        if o1 == "adamw_fused":
            # one pass reads param, grad, exp_avg, exp_avg_sq and writes three of them: ~7 state-sized
            # transfers against ~2 per foreach op (read + write); at the same achieved bandwidth
            new = meas * 7.0 / (2.0 * n_pass + 1e-9) if n_pass > 1 else meas
            new = min(new, meas)
            drop = {pos[int(j)] for j in opt[1:] if int(j) in pos}
            plan.dur[int(opt[0])] = new
            plan.drop_items(drop)
        else:
            new = meas * (2.0 * 6) / 7.0
            plan.dur[int(opt[0])] += new - meas
        modeled.append(f"optimizer {o0} -> {o1}: optimizer step {meas / 1e6:.2f} -> {new / 1e6:.2f} ms "
                       f"({n_pass} foreach op families measured)")
        return (SIGMA["optimizer"] * abs(new - meas) / max(float(p.step_ns), 1.0)) ** 2


def _transfer_only(profs: list[StepProfile]) -> None:
    """Across ranks, a collective kernel lasts until the last rank arrives: the part of it spent waiting
    for another rank is that rank's lateness, not this one's work. Each collective kernel (matched across
    ranks by its order among the step's collective kernels on the same stream position) keeps only the
    shortest rank's duration, the transfer; the replay of each rank then runs without the others' waits
    and the slowest rank decides the step."""
    if len(profs) < 2:
        return
    seqs = []
    for p in profs:
        w = p.work
        seqs.append(np.flatnonzero(w["is_comm"].to_numpy()))
    n = min(len(s) for s in seqs)
    if n == 0 or any(len(s) != n for s in seqs):
        return  # collectives that do not pair up one to one: leave the measured durations
    durs = np.stack([p.work["dur"].to_numpy()[s[:n]] for p, s in zip(profs, seqs)])
    low = durs.min(axis=0)
    for p, s in zip(profs, seqs):
        d = p.work["dur"].to_numpy().copy()
        d[s[:n]] = low
        p.work["dur"] = d


def _moe_syncs(cfg: dict, level: int, backend: str) -> int:
    """Blocking syncs per MoE layer forward (docs/trainer.md, 'Sync-free levels')."""
    ep = int(cfg.get("ep") or 1)
    if level >= 2:
        return 0
    if level == 1:
        return 1
    return 2 if ep > 1 else 1


def _calibrate(prog: R.Program, target_ns: float, prep=None,
               per_expert: bool = False) -> tuple[float, float, float, R.Result]:
    """Host factor h (0.3..1.2: the profiler only slows the host) that makes the replay match the measured
    unprofiled step; for a per-expert run still slower at h = 1.2, the factor x >= 1 on its expert stage's
    host time that makes up the rest (that stage is where such a run's steps differ from one another: device
    drains inside it, new GEMM shapes, the allocator; the H100 proxy's multistream micro-batch 4 timed steps
    ran 415-749 ms around a 378 ms profiled step), so a grouped backend, which replaces the stage, does not
    inherit it; then the factor that removes what is left (device-side profiler cost, or a step that is
    faster than any host speed explains). ``prep(plan, profile)`` first applies what the unchanged config's
    prediction applies too (the run's trend of new GEMM shapes). Returns (h, d, x, result)."""

    def build(x: float) -> _Plan:
        plan = _Plan.of(prog, profiler_lead=False)
        _scale_expert_host(plan, x)
        if prep is not None:
            prep(plan, prog.profile)
        return plan

    plan = build(1.0)
    lo, hi = 0.3, 1.2
    f_lo, f_hi = plan.replay(lo).step_ns, plan.replay(hi).step_ns
    x = 1.0
    if f_lo >= target_ns:
        h = lo
    elif f_hi <= target_ns:
        h = hi
        if per_expert and f_hi < target_ns and sum(plan.gap_x) > 0:
            x_hi = 50.0
            x = x_hi if build(x_hi).replay(hi).step_ns <= target_ns else \
                _bisect(lambda v: build(v).replay(hi).step_ns, 1.0, x_hi, target_ns)
            plan = build(x)
    else:
        h = _bisect(lambda v: plan.replay(v).step_ns, lo, hi, target_ns)
    res = plan.replay(h)
    d = target_ns / res.step_ns if res.step_ns > 0 else 1.0
    return h, d, x, res


def _bisect(f, lo: float, hi: float, target: float, tol: float = 1e-3) -> float:
    """The point of [lo, hi] where the increasing ``f`` reaches ``target`` (to ``tol``)."""
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo < tol:
            break
    return 0.5 * (lo + hi)


def _scale_expert_host(plan: _Plan, x: float) -> None:
    """The expert stage's own host time (``gap_x`` of each item) times ``x``."""
    if x == 1.0:
        return
    for i, gx in enumerate(plan.gap_x):
        if gx:
            plan.gap[i] += (x - 1.0) * gx
            plan.gap_x[i] = x * gx


def _log_cycle(cfg: dict) -> int:
    """Steps between two blocking reads when steps are timed by events: the trainer reads the loss and the
    step time at each log point (``log_every``); without one, only at the run's end (a long chain: 8 steps
    stand for it, past which the mean changes little)."""
    every = int(cfg.get("log_every") or 0)
    return max(1, min(every if every > 0 else 8, int(cfg.get("steps") or 8), 64))


def _median_sync_return(plan: _Plan) -> float:
    """A blocking sync's return after the device drained: the step's recorded syncs' median (20 µs
    without one)."""
    ret = [r for r, st in zip(plan.sync_ret, plan.sync_streams) if r > 0]
    return float(np.median(ret)) if ret else 20_000.0


def _noise(metrics: dict) -> tuple[float, float]:
    times = metrics.get("step_times_s") or []
    timed = metrics.get("timed_steps")
    if isinstance(timed, list) and timed:
        times = [times[i] for i in timed if isinstance(i, int) and 0 <= i < len(times)]
    t = np.asarray([x for x in times if isinstance(x, (int, float)) and not isinstance(x, bool)], dtype=float)
    if len(t) < 3 or t.mean() <= 0:
        return 0.02, 0.0
    se = float(t.std(ddof=1) / np.sqrt(len(t)) / t.mean())
    jitter = max(float((t.mean() - np.median(t)) / t.mean()), 0.0)
    return se, jitter


def predict(run: str | Path, changes: dict, kernel_table: str | Path | None = None,
            capacity_gib: float | None = None) -> Prediction:
    """One what-if: :meth:`Model.from_run` then :meth:`Model.predict`."""
    return Model.from_run(run, kernel_table, capacity_gib).predict(changes)


def parse_sets(items: list[str]) -> dict:
    """``KEY=VALUE`` strings (values parsed as YAML, like the trainer's --set, by the same bounded
    loader: moespec.yaml_bounded) -> dict."""
    import yaml

    from moespec.yaml_bounded import safe_load

    out = {}
    for it in items:
        shown = it if len(it) <= 80 else it[:80] + "..."
        if "=" not in it:
            raise WhatIfError(f"--set {shown!r}: expected KEY=VALUE")
        k, v = it.split("=", 1)
        try:
            out[k.strip()] = safe_load(v)
        except yaml.YAMLError as e:
            why = " ".join(str(getattr(e, "problem", None) or e).split())[:200]
            raise WhatIfError(f"--set {shown!r}: value is not valid YAML ({why})") from None
        except RecursionError:
            raise WhatIfError(f"--set {shown!r}: value is not valid YAML (nested too deeply)") from None
    return out


__all__ = ["Model", "Prediction", "WhatIfError", "predict", "parse_sets", "MODELED", "NEUTRAL", "ProfileError"]

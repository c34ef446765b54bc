"""What-if: predict step time, tokens/s/GPU and peak memory of a changed trainer config from one run.

    >>> from tracelens.projection import whatif as W
    >>> m = W.Model.from_run("runs/base")                 # a profiled run dir (manifest + traces)
    >>> p = m.predict({"micro_batch_size": 8, "grouped_gemm_backend": "torch"})
    >>> p.tokens_per_s_per_gpu, p.step_s, p.peak_gib, p.fits, p.uncertainty
    >>> p.table()                                          # component by component, base vs predicted

How (docs/whatif.md has the details). The run's profiled step is replayed (``replay.py``: the host
issues its launches and blocking syncs, the device runs the units) and the replay is calibrated to the
run's unprofiled mean step time with one factor for host speed (the profiler slows the host) and one
for the rest. A changed config edits the replayed program by the mechanism of each knob family: one
module per family in ``mechanisms/`` (the tokens of a micro-batch, the expert GEMM backend with its GEMM
shapes and device drains, the sync-free level, recompute, gradient accumulation, GC, the optimizer, step
timing, the experts' SwiGLU, the pipeline knobs), each declaring the config keys it owns, its uncertainty
and its edit; the model applies them in their declared order (``mechanisms.REGISTRY``). What the model
can predict (:data:`MODELED`, :data:`NEUTRAL`) and the uncertainties (:data:`SIGMA`) are derived from
them. docs/whatif.md lists each mechanism and says how to add one.

Peak memory: the memory projection (``tracelens.analysis.memory``) of the new config, scaled by the
run's measured / projected peak; over the capacity (the space's limit, else the device's) it is
predicted as OOM. Keys that do not change performance (steps, profiling window, logging, seed) are
accepted; keys the model has no mechanism for are refused in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moespec.config import DEFAULTS, ConfigError, load_config, resolve_world

from ..errors import TraceError
from . import kerneltable as KT
from . import mechanisms as MECH
from . import replay as R
from ..io.run import MANIFEST, Run
from .mechanisms.base import Change, WhatIfError
from .mechanisms.gemm_backend import PER_EXPERT
from .mechanisms.shapes import shape_misses
from .profile import COMPONENTS, ProfileError, StepProfile, read_manifest, step_profile

GIB = float(1 << 30)
# keys the model predicts, keys that do not change a step's time, and the relative uncertainty (1 sigma) of
# each kind of modeled change (on the time it changes): declared by the mechanisms
MODELED, NEUTRAL, SIGMA = MECH.MODELED, MECH.NEUTRAL, MECH.SIGMA


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
    #: every rank's edited replay (`mechanisms.base.Replayed`), for the scale-out's FSDP overlap (not part of the result)
    replayed_all: list = field(default_factory=list, repr=False, compare=False)

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

    def to_dict(self) -> dict:
        """The `tracelens whatif --json` document (docs/whatif.md)."""
        return self.as_dict()

    def to_text(self, source: str) -> str:
        """The `tracelens whatif` text for a prediction on the run ``source``: step time, tokens/s/GPU and
        peak memory before and after, the components, and what was measured or modeled."""
        ch = ", ".join(f"{k}={v}" for k, v in self.changes.items()) or "(no change)"
        unc = f"+/- {100 * self.uncertainty:.0f}%"
        lines = [f"what-if {ch} on {source}",
                 f"  step time      {1e3 * self.base_step_s:9.1f} ms -> {1e3 * self.step_s:9.1f} ms",
                 f"  tokens/s/GPU   {self.base_tokens_per_s_per_gpu:9,.0f}    -> {self.tokens_per_s_per_gpu:9,.0f}    "
                 f"({100 * self.gain:+.1f}%, {unc}, 1 sigma)"]
        if self.peak_gib is not None:
            cap = f" of {self.capacity_bytes / 2**30:.1f} GiB" if self.capacity_bytes else ""
            verdict = "fits" if self.fits else "OUT OF MEMORY: would not run"
            lines.append(f"  peak memory    {self.peak_gib:9.2f} GiB{cap}: {verdict}")
        lines.append(f"  {'component':<22} {'base ms':>9} {'predicted':>10} {'change':>9}")
        for r in self.table().itertuples(index=False):
            lines.append(f"  {r.component:<22} {r.base_ms:>9.2f} {r.predicted_ms:>10.2f} {r.delta_ms:>+9.2f}")
        lines.append("  measured: " + "; ".join(self.measured))
        lines.extend(f"  modeled: {line}" for line in self.modeled)
        lines.extend(f"  note: {line}" for line in self.notes)
        return "\n".join(lines)

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
    measured: dict = field(default_factory=dict)  # per mechanism: what it read from the run (Mechanism.measure)

    # -------------------------------------------------------------- building
    @classmethod
    def from_run(cls, run, kernel_table: str | Path | None = None, capacity_gib: float | None = None,
                 analysis=None, transfer_only: bool = True) -> "Model":
        """The model of one profiled run. ``run``: a run dir's path, or a `tracelens.io.run.Run` (e.g. an
        analysis's ``trace.run``, or one given another manifest with `Run.with_manifest`). ``transfer_only``
        (the what-if's): each communication kernel replays its transfer only, its wait for another rank
        left out (`_transfer_only`); False (the step decomposition's): the kernels as measured, so each
        rank's waits stay in its step."""
        source = run if isinstance(run, Run) else None
        run = Path(run) if source is None else (source.root or source.trace_dir or Path("."))
        man = read_manifest(source if source is not None else run)
        if man is None:
            raise WhatIfError(f"{run}: not a run dir with a manifest.json (the what-if model needs the run's config "
                              "and measured step times)")
        cfg = cls._run_config(man["config"], run / MANIFEST)
        metrics = man.get("metrics") or {}
        mean = metrics.get("mean_step_time_s")
        if not isinstance(mean, (int, float)) or not math.isfinite(mean) or mean <= 0:
            raise WhatIfError(f"{run / MANIFEST}: no measured mean_step_time_s to calibrate on")
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
        if transfer_only:
            _transfer_only(profs)
        progs = [R.prepare(p) for p in profs]
        hs, ds, comps_all = [], [], []
        per_expert = cfg.get("grouped_gemm_backend") in PER_EXPERT
        tok = int(cfg.get("micro_batch_size") or 1) * int(cfg.get("seq_len") or 1)

        def own_rate(plan: _Plan, p: StepProfile) -> None:  # the run's own trend of new GEMM shapes
            if per_expert:
                shape_misses(plan, p, tok, tok, None, [], metrics.get("timed_steps"))

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
        pending_notes = []
        if table is not None:  # only this run's device and dtype: a CPU tuning run must not stand in for an H100's
            device = man.get("device") if isinstance(man.get("device"), dict) else {}
            dev = device.get("name") or device.get("type")
            source = table.source
            table, other = table.for_device(dev, cfg.get("dtype"))
            if other:
                pending_notes.append(f"kernel table ({source}): {other} timing(s) of other devices or dtypes left "
                                     f"out (this run: {dev or 'device unknown'}, {cfg.get('dtype')})")
        m = cls(str(run), cfg, man, profs, progs, hs, ds, float(mean), float(tps), comps_all[slow], noise, jitter,
                table)
        m.base_by_rank = comps_all
        m.notes.extend(pending_notes)
        m.expert_host = xs
        if any(x > 1.0 for x in xs):
            m.notes.append(f"the run's timed steps were slower than its profiled step replays at any profiler factor: "
                           f"the rest is put on the per-expert stage's host time (x{max(xs):.2f})")
        for mech in MECH.REGISTRY:
            mech.measure(m, analysis)
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
        diff = {k: v for k, v in new.items() if k in changes and self.config.get(k, DEFAULTS.get(k)) != v}
        ch = Change(self, self.config, new, new, diff)
        # keys a mechanism predicts after the replay (the pipeline's) stay at the run's values in the replay
        held = tuple(dict.fromkeys(k for m in MECH.REGISTRY if m.changes_step for k in m.hold(ch)))
        if held:
            ch.new = {**new, **{k: self.config.get(k, DEFAULTS.get(k)) for k in held}}
        notes: list[str] = []
        modeled: list[str] = []
        ch.modeled, ch.notes = modeled, notes
        edits = [m for m in MECH.EDITS if m.applies(ch)]
        sig2 = 0.0
        steps, comps_list, said, replayed = [], [], [], []
        xs = self.expert_host or [1.0] * len(self.programs)
        for prog, hs, ds, x in zip(self.programs, self.host_scale, self.device_scale, xs):
            plan = _Plan.of(prog, profiler_lead=False)
            _scale_expert_host(plan, x)
            # each rank says what it modeled, in its calibrated time; the rank whose step is shown is the one heard
            rank_ch = replace(ch, modeled=[], device_scale=ds)
            said.append(rank_ch.modeled)
            var = 0.0
            for m in edits:
                var += m.edit(plan, prog.profile, rank_ch)
            res = None
            for m in MECH.REGISTRY:
                got = m.replay(plan, hs, rank_ch) if m.changes_step else None
                if got is not None:
                    res, v = got
                    var += v
                    break
            if res is None:
                res = plan.replay(hs)
            steps.append(res.step_ns * ds / 1e9)
            replayed.append(MECH.base.Replayed(plan, prog.profile, res, ds, hs))
            comps_list.append({k: v * ds / 1e9 for k, v in res.components.items()})
            sig2 = max(sig2, var)
        slow = int(np.argmax(steps))
        step = steps[slow]
        comps = comps_list[slow]
        modeled.extend(said[slow])
        ch.replayed, ch.replayed_all = replayed[slow], replayed
        for m in MECH.STEPS:
            if m.applies(ch):
                step, comps, var = m.finish(ch, step, comps, self.profiles[slow].rank)
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
                    f"step {1e3 * self.base_step_s:.1f} ms" for p in self.profiles[slow:slow + 1]]
        if not diff:
            modeled = ["no change: the calibrated replay of the measured run"]
        return Prediction(new, diff, step, tps, peak, self.capacity_bytes, self.base_step_s,
                          self.base_tokens_per_s_per_gpu, comps, base_comps, unc, measured, modeled,
                          list(dict.fromkeys(notes + list(self.notes))), replayed)

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
        world = int(self.manifest.get("world_size") or 1)
        try:  # the replicas (dp x ep: a pipeline's ranks share their replica's tokens) follow pp
            (dp0, ep0), (dp1, ep1) = resolve_world(self.config, world), resolve_world(cfg, world)
            scale *= (dp1 * ep1) / (dp0 * ep0)
        except ConfigError:
            pass
        return float(base) * scale

    @staticmethod
    def _run_config(raw: dict, manifest: Path) -> dict:
        """The run's config with every key the trainer knows checked by the trainer's own loader (the
        model computes with these values) and the trainer's defaults for keys the manifest lacks; keys the
        trainer does not know (an older or newer trainer's) are kept as they are. A value the trainer
        would refuse is one line naming the manifest."""
        # a key the run's trainer did not have yet: the value that trainer ran with (the mechanisms' ``legacy``)
        raw = {**{k: v for k, v in MECH.LEGACY.items() if k not in raw}, **raw}
        try:
            known = load_config(None, {k: v for k, v in raw.items() if k in DEFAULTS})
        except ConfigError as e:
            raise WhatIfError(f"{manifest}: the run's config is not valid ({e})") from None
        return {**raw, **known}

    def _validate(self, changes: dict) -> dict:
        bad = [k for k in changes if k not in DEFAULTS]
        if bad:
            raise WhatIfError(f"unknown trainer key {bad[0]!r} (see docs/trainer.md for the keys)")
        refused = [k for k, v in changes.items() if k in MECH.REFUSED and self.config.get(k, DEFAULTS[k]) != v]
        if refused:  # a knob family declared without a prediction: its own one line (mechanisms' ``refuses``)
            raise WhatIfError(f"{refused[0]}: {MECH.REFUSED[refused[0]]}")
        unmodeled = [k for k, v in changes.items()
                     if k not in MODELED and k not in NEUTRAL and self.config.get(k, DEFAULTS[k]) != v]
        if unmodeled:
            raise WhatIfError(f"{unmodeled[0]}: the what-if model has no mechanism for this key yet (it models "
                              f"{', '.join(MODELED)})")
        if changes.get("ep") == 1:  # the EP-only keys have no meaning at ep 1: back at their defaults unless given
            changes = {**{k: DEFAULTS[k] for k in ("ep_dispatch", "ep_overlap", "ep_overlap_schedule")}, **changes}
        elif changes.get("ep_overlap") is False:  # the schedule orders the overlap's chunks: none left to order
            changes = {"ep_overlap_schedule": DEFAULTS["ep_overlap_schedule"], **changes}
        try:
            new = load_config(None, {**self.config, **changes})
        except ConfigError as e:
            try:
                load_config(None, self.config)
            except ConfigError as own:  # the run's own config is at fault, not the change: name its manifest
                raise WhatIfError(f"{Path(self.run) / MANIFEST}: the run's config does not validate ({own})") from None
            raise WhatIfError(str(e)) from None
        world = int(self.manifest.get("world_size") or 1)
        try:  # the layout must fill the run's GPUs: pp * dp * ep = world size (the trainer's own rule)
            resolve_world(new, world)
        except ConfigError as e:
            raise WhatIfError(f"{e} (the what-if predicts layouts of the run's {world} GPU(s))") from None
        return new


def _transfer_only(profs: list[StepProfile]) -> None:
    """Across ranks, a collective kernel lasts until the last rank arrives: the part of it spent waiting for
    another rank is that rank's lateness, not this one's work, and no bandwidth or size change shrinks it.
    Each communication kernel keeps only its transfer (its duration less its wait for a peer rank, the one
    notion of `tracelens.analysis.waits`: a unit's ``wait`` of kind ``peer`` or ``startup``); the replay of
    each rank then runs without the others' waits and the slowest rank decides the step. A pipeline stage's
    waits for its neighbour stay: they are the schedule's bubble, which the pipeline model accounts for."""
    for p in profs:
        w = p.work
        if "wait" not in w.columns or not len(w):
            continue
        peer = w["wait_kind"].isin(["peer", "startup"]).to_numpy()
        if peer.any():
            d = w["dur"].to_numpy().copy()
            d[peer] = np.maximum(d[peer] - w["wait"].to_numpy()[peer], 0)
            w["dur"] = d


def _calibrate(prog: R.Program, target_ns: float, prep=None,
               per_expert: bool = False) -> tuple[float, float, float, R.Result]:
    """Host factor h (0.3..1.2: the profiler only slows the host) that makes the replay match the measured
    unprofiled step. A replay that is device-bound at the traced host speed (h = 1 gives the step of the fastest
    host) does not identify h: it stays 1, the traced host (blocked launch calls already out of its gaps,
    `replay._queue_waits`), and the device factor takes the rest (not for a per-expert run: the rule below puts
    what its timed steps take beyond the replay on its expert stage's host time); for a per-expert run still slower at h = 1.2, the factor x >= 1 on its expert stage's
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
    if plan.replay(1.0).step_ns <= f_lo * (1 + _DEVICE_BOUND_TOL) and not per_expert:
        # device-bound at the traced host speed: the step does not identify the host's (any faster host gives
        # the same step); the traced speed, the profiler included, is the evidence (and an upper bound)
        h = 1.0
    elif f_lo >= target_ns:
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


_DEVICE_BOUND_TOL = 0.005  # a replay within this of the fastest host's is device-bound


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

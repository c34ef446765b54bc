"""What-if for pipeline knobs: schedule, virtual stages, layout and micro-batches of a pipelined run.

    >>> from tracelens.projection import pipeline_whatif as PW
    >>> base = PW.pipeline_base("runs/pp2_1f1b")                # measured stage costs, hand-off overhead
    >>> p = PW.predict_pipeline(base, {"pipeline_schedule": "vpp", "vpp": 2})
    >>> p.step_ns, p.window_ns, p.rest_ns, p.busy_ns, p.idle_ns    # step = rest + window (slowest rank)

The mechanism (docs/whatif.md, "Pipeline knobs"), over the run's pipeline actions
(``RUN/pipeline/rank<N>.jsonl``, `tracelens.analysis.pipeline`) and the old and new trainer config:

1. **Steady steps.** Every step but the first (the pipeline analysis' warm-up convention), the profiled
   steps (the profiler's overhead) and the trace-export step after the window (`manifest_step_roles`);
   the trainer's ``timing_warmup_steps`` are kept (their actions and step times are steady on the H200
   runs, and more steps average out the micro-batch spread).
2. **Piece costs.** Per stage and kind (F, B, W) the mean action time over those steps, split over the
   stage's pieces (``embedding``, ``layer<i>``, ``loss`` from the manifest's ``stage_modules``) in
   proportion to the FLOP model of each piece (`moespec.layout.layer_costs`: the embedding is
   free, the loss is the LM head). A split backward (B + W, zero-bubble schedules) is kept as the full
   backward B + W per piece.
3. **New stages.** The new config's layout (`moespec.layout.resolve_layout`: the same rules the
   trainer applies, ``auto``/``uniform``/a string, with the new pp x vpp) groups the pieces into stages;
   a stage's F and full backward are the sums of its pieces'. A schedule that splits the backward
   (``zb1p``, ``zbv``) gets B = beta x full and W = the rest, beta the measured B share of the run's
   non-first stages when the run split its backward, else the FLOP model's input-gradient share; the
   first stage has no input gradient (B = 0: torch computes that stage's whole backward in W, as the
   H200 zb1p run records).
4. **Schedule.** Each pipeline rank's action order is the torch schedule's (`moespec.schedules.action_order`:
   1f1b, gpipe, interleaved 1F1B, ZB-H1 and ZB-V as ``torch.distributed.pipelining`` builds them), replayed with
   `tracelens.analysis.pipeline.simulate_step` (data dependencies F(s) <- F(s-1), B(s) <- B(s+1),
   W(s) <- B(s)) and one overhead per hand-off between ranks, calibrated so that the run's own schedule
   replays to its measured median window: it carries the p2p transfer, the host's launch after a
   receive and the micro-batch-to-micro-batch spread the stage means leave out.
5. **Step.** The step is the replayed window plus the rest of the run's step (its measured step time
   minus the pipeline window: optimizer, gradient reduction, data; per step, median over the steady
   steps). ``scale`` multiplies the stage costs and the rest (the ratio by which the other knobs of the
   same what-if change the step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from moespec import schedules as S
from moespec.layout import LayoutError, layer_costs, resolve_layout
from moespec.params import attention_dims, attention_params, moe_active_params

from ..io.run import MANIFEST
from ..analysis import pipeline as P
from ..analysis.steps import manifest_step_roles
from ..errors import TraceError

PIPELINE_KEYS = ("pipeline_schedule", "vpp", "pipeline_layout", "pipeline_layer_costs")


class PipelineWhatIfError(ValueError):
    """A pipeline what-if that cannot be answered: one line naming the run or key and why."""


# ------------------------------------------------------------------------------------ action orders
def action_order(schedule: str, pp: int, vpp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The order in which pipeline rank ``rank`` runs its actions in one step, as ``(kind, stage,
    microbatch)`` with kind F, B (backward, or backward for inputs) or W (backward for weights):
    `moespec.schedules.action_order` (1f1b, gpipe, interleaved 1F1B, ZB-H1 and ZB-V as
    ``torch.distributed.pipelining`` builds them)."""
    try:
        return S.action_order(schedule, pp, vpp, m, rank)
    except S.ScheduleError:
        raise PipelineWhatIfError(f"pipeline_schedule {schedule!r}: no action order modeled (the what-if models "
                                  f"{', '.join(S.MODELED)})") from None


def placement(schedule: str, pp: int, vpp: int) -> list[int]:
    """Pipeline rank of every stage: V-shaped for zbv (stage s and 2pp-1-s on rank s), else s % pp."""
    return S.stage_to_rank(pp * vpp, pp, S.placement_of(schedule))


def schedule_actions(schedule: str, pp: int, vpp: int, m: int) -> pd.DataFrame:
    """One step's actions of every pipeline rank in schedule order, as an actions table whose start_ns is
    the action's position on its rank (what `simulate_step` reads the order from)."""
    rows = []
    for r in range(pp):
        for i, (k, s, mb) in enumerate(action_order(schedule, pp, vpp, m, r)):
            rows.append((0, r, r, s, mb, k, i, i))
    df = pd.DataFrame(rows, columns=list(P.ACTION_COLUMNS))
    return df


# ------------------------------------------------------------------------------------ the run's base
@dataclass
class PipelineBase:
    """What a pipelined run measured, in the form the pipeline what-if replays."""

    run: str
    meta: P.PipelineMeta
    config: dict
    steps: list[int]  # the steady steps used
    step_basis: str  # which steps, in words
    stage_f: list[float]  # ns per microbatch, per stage of the run
    stage_b: list[float]  # backward (B, or B for inputs when split)
    stage_w: list[float]  # W (0 when the run does not split the backward)
    piece_f: dict  # piece name -> ns per microbatch
    piece_bw: dict  # piece name -> full backward ns per microbatch
    beta: float | None  # measured B / (B + W) of the run's non-first stages (split runs), else None
    step_ns: float  # median measured step time over the steady steps
    window_ns: float  # median pipeline window (first action start to last action end)
    rest_ns: float  # median of step - window
    handoff_ns: float  # calibrated overhead per hand-off between ranks
    replay_ns: float  # the run's own schedule replayed with the stage means and the hand-off overhead
    account: dict = field(default_factory=dict)  # the bubble account's comm / host / other per step (ns)
    notes: list = field(default_factory=list)
    rank_to_pp: dict = field(default_factory=dict)  # global rank -> pipeline rank (from the actions)

    @property
    def split(self) -> bool:
        return any(w > 0 for w in self.stage_w)


def _steady_steps(actions: pd.DataFrame, manifest: dict | None) -> tuple[list[int], str]:
    steps = sorted(actions["step"].unique().tolist())
    roles = {s: r for s, (r, _d) in manifest_step_roles(manifest, include_profiled=True).items()
             if r in ("profiled", "export")}
    first = steps[:1] if len(steps) > 1 else []
    clean = [s for s in steps if s not in roles and s not in first]
    if clean:
        return clean, (f"step(s) {P._ranges(clean)}: every step but the first, the profiled and the trace-export "
                       "step")
    loose = [s for s in steps if s not in first and roles.get(s, ("",))[0] != "profiled"] or steps
    return loose, f"step(s) {P._ranges(loose)}: every step but the first and the profiled ones (no other left)"


def _step_times(manifest: dict | None) -> list[float]:
    m = (manifest or {}).get("metrics") or {}
    t = m.get("step_times_s")
    return t if isinstance(t, list) else []


def _piece_weights(cfg: dict) -> dict[str, float]:
    """FLOP model per piece name (embedding, layer<i>, loss)."""
    e, layers, loss = layer_costs(cfg)
    out = {"embedding": float(e), "loss": float(loss)}
    out.update({f"layer{i}": float(c) for i, c in enumerate(layers)})
    return out


def _input_grad_share(cfg: dict) -> float:
    """FLOP model's share of a layer's backward that is the input gradient: matmuls split evenly between
    dX and dW, the attention scores' backward is all dX."""
    params = attention_params(cfg) + moe_active_params(cfg)
    dqk, dv = attention_dims(cfg)
    scores = cfg["seq_len"] * cfg["n_heads"] * (dqk + dv)
    return (2.0 * params + 2.0 * scores) / (4.0 * params + 2.0 * scores)


def _stage_pieces(meta: P.PipelineMeta, cfg: dict, where: str) -> list[list[str]]:
    mods = meta.stage_modules
    if mods is None or len(mods) != meta.n_stages:
        try:
            mods = resolve_layout({**cfg, "pp": meta.pp, "vpp": meta.vpp}).stage_modules
        except Exception as e:  # noqa: BLE001 - one line below
            raise PipelineWhatIfError(f"{where}: the run's stage layout is unknown (no pipeline.stage_modules in the "
                                      f"manifest and the config's layout does not resolve: {e})") from None
    return [[str(x) for x in m] for m in mods]


def pipeline_base(run: str | Path, analysis: P.PipelineAnalysis | None = None, manifest: dict | None = None,
                  ) -> PipelineBase:
    """Measure what the pipeline what-if needs from a pipelined run dir (see the module docstring)."""
    run = Path(run)
    if manifest is None:
        from .profile import read_manifest

        manifest = read_manifest(run)
    if not manifest or not isinstance(manifest.get("config"), dict):
        raise PipelineWhatIfError(f"{run}: not a run dir with a manifest.json")
    cfg = dict(manifest["config"])
    try:
        if analysis is None:
            analysis = P.load_pipeline(run)
    except TraceError as e:
        raise PipelineWhatIfError(f"{run}: no pipeline data to model the pipeline knobs from ({e.one_line()})") from None
    meta = analysis.meta
    acts = analysis.actions
    steps, basis = _steady_steps(acts, manifest)
    sel = acts[acts["step"].isin(steps)]
    n_stages = meta.n_stages
    if int(sel["stage"].max()) + 1 != n_stages:
        raise PipelineWhatIfError(f"{run}: the pipeline actions have {int(sel['stage'].max()) + 1} stages, the manifest "
                                  f"says pp x vpp = {n_stages}")
    dur = (sel["end_ns"] - sel["start_ns"]).astype(float)
    mean = dur.groupby([sel["stage"], sel["kind"].astype(str)]).mean()

    def col(k: str) -> list[float]:
        return [float(mean.get((s, k), 0.0)) for s in range(n_stages)]

    f, b, w = col("F"), col("B"), col("W")
    if min(f) <= 0 or min(bi + wi for bi, wi in zip(b, w)) <= 0:
        raise PipelineWhatIfError(f"{run}: a stage has no forward or backward time in the steady steps {steps}")
    pieces = _stage_pieces(meta, cfg, str(run / MANIFEST))
    weights = _piece_weights(cfg)
    piece_f, piece_bw = {}, {}
    for s, names in enumerate(pieces):
        unknown = [n for n in names if n not in weights]
        if unknown:
            raise PipelineWhatIfError(f"{run / MANIFEST}: pipeline.stage_modules: unknown module {unknown[0]!r}")
        ws = [weights[n] for n in names]
        tot = sum(ws)
        share = [x / tot for x in ws] if tot > 0 else [1.0 / len(names)] * len(names)
        for n, sh in zip(names, share):
            piece_f[n] = f[s] * sh
            piece_bw[n] = (b[s] + w[s]) * sh
    beta = None
    if any(x > 0 for x in w) and n_stages > 1:
        beta = float(np.median([b[s] / (b[s] + w[s]) for s in range(1, n_stages)]))
    # step time and the rest of the step, over the steady steps that have a clean step time
    times = _step_times(manifest)
    win = sel.groupby("step").agg(lo=("start_ns", "min"), hi=("end_ns", "max"))
    windows = (win["hi"] - win["lo"]).astype(float)
    timed = [s for s in steps if s < len(times) and isinstance(times[s], (int, float)) and times[s] > 0]
    if not timed:
        raise PipelineWhatIfError(f"{run / MANIFEST}: no measured step time (metrics.step_times_s) for the "
                                  f"steady step(s) {steps}")
    step_ns = float(np.median([times[s] * 1e9 for s in timed]))
    rest = [times[s] * 1e9 - windows[s] for s in timed]
    rest_ns = max(float(np.median(rest)), 0.0)
    window_ns = float(np.median(windows.to_numpy()))
    notes = []
    if min(rest) < 0:
        notes.append("a step's pipeline window is longer than its measured step time: the rest of the step taken as "
                     f"{rest_ns / 1e6:.2f} ms (median, floored at 0)")
    # calibrate the hand-off overhead on the run's own schedule
    sched, pp, vpp, m = meta.schedule, meta.pp, meta.vpp, meta.microbatches
    try:
        order = schedule_actions(sched, pp, vpp, m)
    except PipelineWhatIfError as e:
        raise PipelineWhatIfError(f"{run}: the run's own schedule: {e}") from None
    costs = _costs_for(order, f, b, w)
    lam, replay = _calibrate_handoff(order, costs, window_ns)
    acc = {}
    if analysis.account is not None:
        ps = analysis.account.per_step
        ps = ps[ps["step"].isin(analysis.account.steps)]
        if len(ps):
            n = max(1, ps["step"].nunique())
            one = ps.groupby("step")[["comm_ns", "host_ns", "other_ns"]].first().sum() / n
            acc = {k: float(v) for k, v in one.items()}
    r2p = {int(r): int(p) for r, p in acts[["rank", "pp_rank"]].drop_duplicates("rank").itertuples(index=False)}
    return PipelineBase(str(run), meta, cfg, steps, basis, f, b, w, piece_f, piece_bw, beta, step_ns, window_ns,
                        rest_ns, lam, replay, acc, notes, r2p)


def base_of(model) -> PipelineBase:
    """A what-if model's pipelined run, measured once (`pipeline_base`, kept in ``model.pipe_base``)."""
    if model.pipe_base is None:
        model.pipe_base = pipeline_base(model.run, manifest=model.manifest)
    return model.pipe_base


def _costs_for(order: pd.DataFrame, f: list[float], b: list[float], w: list[float]) -> np.ndarray:
    st = order["stage"].to_numpy()
    kind = order["kind"].astype(str).to_numpy()
    fa, ba, wa = np.asarray(f), np.asarray(b), np.asarray(w)
    return np.where(kind == "F", fa[st], np.where(kind == "B", ba[st], wa[st]))


def _replay(order: pd.DataFrame, costs: np.ndarray, handoff: float,
            host: np.ndarray | None = None) -> tuple[float, np.ndarray, np.ndarray]:
    """(window, starts, ends) of the schedule ``order`` with each action's device time ``costs`` (ns) and, optionally,
    its host launch time ``host`` (`analysis.pipeline.simulate_step`)."""
    s, e, forced = P.simulate_step(order, np.round(costs).astype(np.int64), 0, int(round(handoff)),
                                   host=None if host is None else np.round(host).astype(np.int64))
    if forced:
        raise PipelineWhatIfError("the schedule's action order deadlocks under its data dependencies (a bug in the "
                                  "modeled order)")
    return float(e.max()), s, e


def _calibrate_handoff(order: pd.DataFrame, costs: np.ndarray, target: float) -> tuple[float, float]:
    """Hand-off overhead (ns) that makes the replay's window equal `target` (0 when even free hand-offs
    replay longer: then the stage means alone over-explain the window)."""
    w0 = _replay(order, costs, 0)[0]
    if w0 >= target:
        return 0.0, w0
    lo, hi = 0.0, max(target - w0, 1.0)
    while _replay(order, costs, hi)[0] < target:
        hi *= 2
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if _replay(order, costs, mid)[0] < target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 100:
            break
    lam = 0.5 * (lo + hi)
    return lam, _replay(order, costs, lam)[0]


# ------------------------------------------------------------------------------------ predicting
@dataclass
class PipelinePrediction:
    schedule: str
    pp: int
    vpp: int
    microbatches: int
    layout: str
    step_ns: float  # rest + window
    window_ns: float  # replayed pipeline window
    rest_ns: float  # the non-pipeline part of the step (scaled)
    busy_ns: list  # per pipeline rank: sum of its actions
    idle_ns: list  # per pipeline rank: window - busy
    base_window_ns: float  # the run's own schedule replayed with the same scale (for deltas)
    base_busy_ns: list
    stage_f: list
    stage_b: list
    stage_w: list
    modeled: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def slowest_rank(self) -> int:
        return int(np.argmax(self.busy_ns))


def new_layout(cfg: dict) -> list[list[str]]:
    """Module names per stage (``embedding``, ``layer<i>``, ``loss``) of a config, by the trainer's rules."""
    try:
        return resolve_layout(cfg).stage_modules
    except LayoutError as e:
        raise PipelineWhatIfError(f"pipeline_layout: {' '.join(str(e).split())}") from None


def predict_pipeline(base: PipelineBase, new_cfg: dict, scale: float = 1.0) -> PipelinePrediction:
    """The pipeline part of a what-if: the new config's stages, schedule and micro-batches replayed with the
    run's measured piece costs (x ``scale``) and hand-off overhead; the step is that window plus the run's
    rest of the step (x ``scale``). ``new_cfg`` is a full trainer config (validated by the trainer's rules)."""
    old = base.meta
    cfg = {**base.config, **new_cfg}
    pp = int(cfg.get("pp") or 1)
    vpp = int(cfg.get("vpp") or 1)
    m = int(cfg.get("microbatches") or 1)
    sched = str(cfg.get("pipeline_schedule") or old.schedule)
    if pp != old.pp:
        raise PipelineWhatIfError(f"pp {old.pp} -> {pp}: changing the number of pipeline ranks changes the world size "
                                  "and the data parallelism; not modeled")
    if sched not in S.MODELED:
        raise PipelineWhatIfError(f"pipeline_schedule {sched!r}: no action order modeled (the what-if models "
                                  f"{', '.join(S.MODELED)})")
    modeled, notes = [], []
    # stages of the new config from the run's pieces
    same_layout = vpp == old.vpp and cfg.get("pipeline_layout") == base.config.get("pipeline_layout") and (
        cfg.get("pipeline_layer_costs") == base.config.get("pipeline_layer_costs"))
    mods = new_layout(cfg) if not same_layout else _stage_pieces(old, base.config, base.run)
    n_stages = pp * vpp
    if len(mods) != n_stages:
        raise PipelineWhatIfError(f"pipeline_layout: {len(mods)} stages but pp*vpp = {pp}*{vpp} = {n_stages}")
    missing = [n for st in mods for n in st if n not in base.piece_f]
    if missing:
        raise PipelineWhatIfError(f"pipeline_layout: module {missing[0]!r} is not in the run's stages "
                                  f"({', '.join(base.piece_f)})")
    split_new = S.SCHEDULES[sched].split_backward
    if same_layout:
        f = list(base.stage_f)
        full = [bb + ww for bb, ww in zip(base.stage_b, base.stage_w)]
    else:
        f = [sum(base.piece_f[n] for n in st) for st in mods]
        full = [sum(base.piece_bw[n] for n in st) for st in mods]
    if split_new and base.split and same_layout and sched == old.schedule:
        b, w = list(base.stage_b), list(base.stage_w)
    elif split_new:
        beta = base.beta if base.beta is not None else _input_grad_share(cfg)
        b = [0.0 if s == 0 else beta * full[s] for s in range(n_stages)]
        w = [full[s] - b[s] for s in range(n_stages)]
        modeled.append(f"backward split into B (input gradient, {100 * beta:.0f}% of the backward"
                       + (", measured" if base.beta is not None else ", FLOP model") + "; none on stage 0) and W")
    else:
        b, w = full, [0.0] * n_stages
        if base.split:
            modeled.append("the split backward (B + W) runs as one backward per action")
    f = [x * scale for x in f]
    b = [x * scale for x in b]
    w = [x * scale for x in w]
    order = schedule_actions(sched, pp, vpp, m)
    place = placement(sched, pp, vpp)
    if any(place[s] != r for s, r in zip(order["stage"], order["rank"])):
        raise PipelineWhatIfError(f"pipeline_schedule {sched!r}: action order and placement disagree")
    costs = _costs_for(order, f, b, w)
    window, _s, _e = _replay(order, costs, base.handoff_ns)
    busy = pd.Series(costs).groupby(order["rank"].to_numpy()).sum().reindex(range(pp), fill_value=0.0)
    # the run's own schedule at the same scale: the reference the deltas are read against
    old_order = schedule_actions(old.schedule, old.pp, old.vpp, old.microbatches)
    old_costs = _costs_for(old_order, [x * scale for x in base.stage_f], [x * scale for x in base.stage_b],
                           [x * scale for x in base.stage_w])
    old_window = _replay(old_order, old_costs, base.handoff_ns)[0]
    old_busy = pd.Series(old_costs).groupby(old_order["rank"].to_numpy()).sum().reindex(range(old.pp), fill_value=0.0)
    rest = base.rest_ns * scale
    layout = "|".join("".join("E" if n == "embedding" else "L" if n == "loss" else "t" for n in st) for st in mods)
    modeled.append(f"pipeline {old.schedule} vpp {old.vpp} x {old.microbatches} microbatches (layout {old.layout or '?'})"
                   f" -> {sched} vpp {vpp} x {m} microbatches (layout {layout}): the schedule's action order replayed "
                   f"with the run's measured stage costs re-split by piece and {base.handoff_ns / 1e6:.3f} ms per "
                   f"hand-off between ranks: window {old_window / 1e6:.1f} -> {window / 1e6:.1f} ms; the rest of the "
                   f"step ({rest / 1e6:.1f} ms: optimizer, gradient reduction, data) kept")
    return PipelinePrediction(sched, pp, vpp, m, layout, rest + window, window, rest, busy.tolist(),
                              (window - busy).tolist(), old_window, old_busy.tolist(), f, b, w, modeled, notes)


def changes_pipeline(old_cfg: dict, new_cfg: dict) -> bool:
    """Whether a what-if touches the pipeline: a pipeline key or the micro-batch count of a pipelined run."""
    if int(old_cfg.get("pp") or 1) <= 1:
        return False
    keys = PIPELINE_KEYS + ("microbatches",)
    return any(old_cfg.get(k) != new_cfg.get(k) for k in keys)


__all__ = ["PipelineBase", "PipelinePrediction", "PipelineWhatIfError", "action_order", "changes_pipeline",
           "pipeline_base", "placement", "predict_pipeline", "schedule_actions", "PIPELINE_KEYS"]

"""`analyze(trace)`: run the hierarchical breakdown and return every table plus `summary.json`.

    >>> import tracelens
    >>> a = tracelens.analyze(tracelens.load("runs/demo"))
    >>> a.timeline          # per-rank GPU busy/idle/compute/comm/exposed comm
    >>> a.kernels.head()    # kernel summary
    >>> a.summary()         # the stable machine interface written as summary.json

Views (timeline, categories, kernels, ops, sunburst, annotations) read the steady-state steps by
default and `a.window` names the steps left out and why (tracelens.analysis.steps); `analyze(trace,
window="all")` gives the whole profiled window, and `a.timeline_all` always holds its per-rank figures.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pandas as pd

from . import __version__, offload
from .analysis import calltree, steps as steps_mod, summaries, timeline
from .analysis import waits as waits_mod
from .numbers import round3_array
from .records import Records, plain
from .derived import Derived, Registry
from .trace import Trace, give_back_memory

if TYPE_CHECKING:
    from .analysis.pipeline import PipelineAnalysis
    from .analysis.roofline import RooflineResult
    from .analysis.steps import StepWindow

SUMMARY_SCHEMA = 2
T = TypeVar("T")


_BASE = ("trace", "tree", "gpu", "steps", "timeline", "step_timeline", "ops", "kernels", "categories", "top_ops",
         "breakdown", "annotations", "warnings", "pipeline", "window", "timeline_all", "gpu_window", "host_window",
         "manifest")

# The derived entries of an analysis (tracelens.derived): each declared with the base tables and entries it
# reads, computed once on first read and shared by the summary, the report, the CLI and the export.
DERIVED = Registry(base=_BASE)


@DERIVED.entry("comm_kernels", inputs=("gpu", "tree", "trace"), module="tracelens.analysis.comm")
def _comm_kernels(a: Any) -> pd.DataFrame:
    """Every communication kernel with its collective, group and size (tracelens.analysis.comm.comm_kernels)."""
    from .analysis.comm import comm_kernels

    return comm_kernels(a)


@DERIVED.entry("comm_instances", inputs=("comm_kernels", "trace"), module="tracelens.analysis.comm")
def _comm_instances(a: Any, comm_kernels: pd.DataFrame) -> pd.DataFrame:
    """One row per (collective instance, rank) (tracelens.analysis.comm.collective_instances)."""
    from .analysis.comm import collective_instances

    return collective_instances(a, kern=comm_kernels)


@DERIVED.entry("comm_waits", inputs=("comm_instances", "trace"), module="tracelens.analysis.waits")
def _comm_waits(a: Any, comm_instances: pd.DataFrame) -> pd.DataFrame:
    """Each communication kernel's wait and transfer, by GPU row label (tracelens.analysis.waits.kernel_waits)."""
    from .analysis.pipeline import has_pipeline_data
    from .analysis.waits import is_pipeline, kernel_waits

    return kernel_waits(comm_instances, pipeline=is_pipeline(a.trace, has_pipeline_data))


@DERIVED.entry("host_syncs", inputs=("tree", "gpu", "steps", "trace"), module="tracelens.analysis.host")
def _host_syncs(a: Any) -> pd.DataFrame:
    """One row per blocking device-to-host sync (tracelens.analysis.host.host_syncs)."""
    from .analysis.host import host_syncs

    return host_syncs(a)


@DERIVED.entry("idle_gaps", inputs=("gpu", "host_syncs"), module="tracelens.analysis.host")
def _idle_gaps(a: Any, host_syncs: pd.DataFrame) -> pd.DataFrame:
    """Every GPU idle gap with its cause (tracelens.analysis.host.idle_gaps; text columns as object columns
    over the few distinct strings, which every reader filters, groups or writes)."""
    from .analysis.host import idle_gaps

    return idle_gaps(a, host_syncs, text_columns=False)


@DERIVED.entry("launch_stats", inputs=("gpu", "gpu_window"), module="tracelens.analysis.host")
def _launch_stats(a: Any) -> pd.DataFrame:
    """Per rank: launch latency and small kernels at the default threshold (tracelens.analysis.host)."""
    from .analysis.host import launch_stats

    return launch_stats(a)


@DERIVED.entry("kernels_per_op", inputs=("gpu", "gpu_window"), module="tracelens.analysis.host")
def _kernels_per_op(a: Any) -> pd.DataFrame:
    """Ops by the kernels they launch, at the default small-kernel threshold (tracelens.analysis.host)."""
    from .analysis.host import kernels_per_op

    return kernels_per_op(a)


@DERIVED.entry("critical_path", inputs=("gpu", "steps", "window", "pipeline", "trace", "comm_instances", "host_syncs"),
               module="tracelens.analysis.critical_path")
def _critical_path(a: Any, comm_instances: pd.DataFrame, host_syncs: pd.DataFrame) -> Any:
    """The critical path of the window's steps across ranks (tracelens.analysis.critical_path); bad input is its
    one-line `problem`, never an exception (findings and summary.json read it)."""
    from .analysis.critical_path import path_entry

    return path_entry(a, comm_instances, host_syncs)


@DERIVED.entry("findings", inputs=("timeline", "window", "manifest", "gpu", "tree", "steps", "trace", "host_syncs",
                                   "idle_gaps", "launch_stats", "kernels_per_op", "comm_instances", "critical_path"),
               module="tracelens.analysis.findings")
def _findings(a: Any, host_syncs: pd.DataFrame, idle_gaps: pd.DataFrame, launch_stats: pd.DataFrame,
              kernels_per_op: pd.DataFrame, comm_instances: pd.DataFrame, critical_path: Any) -> list[dict[str, Any]]:
    """Ranked, structured findings (tracelens.analysis.findings)."""
    from .analysis.findings import findings

    return findings(a, host_syncs=host_syncs, idle_gaps=idle_gaps, launch_stats=launch_stats,
                    kernels_per_op=kernels_per_op, comm_instances=comm_instances, critical_path=critical_path)


@DERIVED.entry("health", inputs=("trace", "tree", "gpu", "steps", "window", "comm_kernels", "comm_instances"), module="tracelens.analysis.health")
def _health(a: Any, comm_kernels: pd.DataFrame, comm_instances: pd.DataFrame) -> pd.DataFrame:
    """Trace health checks, one row per finding (tracelens.analysis.health)."""
    from .analysis.health import health_checks, run_context

    return health_checks(a, run_context(a.trace), inst=comm_instances, kern=comm_kernels)


@DERIVED.entry("roofline", inputs=("gpu", "tree", "trace"), offload=True, module="tracelens.analysis.roofline")
def _roofline(a: Any) -> RooflineResult:
    """Roofline of every modeled op group at the default ceilings (tracelens.analysis.roofline)."""
    from .analysis.roofline import roofline_result

    return roofline_result(a)


@DERIVED.entry("decomposition", inputs=("trace", "steps", "gpu", "window", "pipeline", "manifest"), offload=True,
               keep_errors=True, module="tracelens.projection.decomposition")
def _decomposition(a: Any) -> pd.DataFrame:
    """The step decomposition (tracelens.projection.decomposition), or the error that stopped it."""
    from .projection.decomposition import decomposition

    return decomposition(a)


@DERIVED.entry("moe", inputs=("trace", "gpu", "tree", "steps", "timeline", "window", "comm_kernels", "comm_instances",
                              "findings"), keep_errors=True, module="tracelens.analysis.moe_view")
def _moe(a: Any, comm_kernels: pd.DataFrame, comm_instances: pd.DataFrame, findings: list) -> Any:
    """The MoE view (tracelens.analysis.moe_view), or the error of a bad routing file (one line, kept)."""
    from .analysis.moe_view import moe_report

    return moe_report(a)


@DERIVED.entry("verdict", inputs=("trace", "timeline", "manifest", "findings", "health"), keep_errors=True,
               module="tracelens.analysis.verdict")
def _verdict(a: Any, findings: list[dict[str, Any]], health: pd.DataFrame) -> Any:
    """The verdict (tracelens.analysis.verdict): the step in one bar, the bottleneck and the top three actions
    with the what-if's predicted gains. It also reads the `decomposition` entry's outcome (not an input: a
    decomposition that failed is a verdict without its bar, not a failed verdict). The what-if (a projection,
    which the analysis module may not import) runs here: the model calibrated on this run once, each
    candidate change predicted, a change it refuses one line."""
    from dataclasses import replace

    from .analysis import verdict as V
    from .projection.decomposition import reason

    dec = a.derived.outcome("decomposition")
    dec_df = dec if isinstance(dec, pd.DataFrame) else None
    step = V.step_of(dec_df, a.timeline if a.has_gpu else None)
    note = "" if step is not None or dec_df is not None else f"no step decomposition: {reason(dec)}"
    run = a.trace.run
    ctx = V.context_of(a.manifest, run.root if run is not None else None)
    model = None
    if ctx.config is not None and ctx.why_no_model is None:
        from .io.run import Run
        from .projection.whatif import GIB, Model

        src = run if run is not None else Run()
        if src.manifest != a.manifest:  # a manifest given beside loose traces: the model takes it as given
            src = src.with_manifest(a.manifest)
        try:
            model = Model.from_run(src, analysis=a)
        except Exception as e:  # noqa: BLE001 - no model is a verdict without predictions, said in one line
            ctx = replace(ctx, why_no_model=f"the what-if model cannot calibrate on this run ({reason(e)})")
        else:
            ctx = replace(ctx, capacity_gib=model.capacity_bytes / GIB if model.capacity_bytes else None)
    cands = V.candidates(findings, step, ctx, decomposition=dec_df)
    outcomes: dict[str, dict[str, Any]] = {}
    for c in cands if model is not None else ():
        try:
            p = model.predict(c.changes)
        except Exception as e:  # noqa: BLE001 - a change the model refuses (invalid layout, no mechanism)
            outcomes[c.key] = {"error": " ".join(str(e).split())[:200]}
            continue
        outcomes[c.key] = {"gain": p.gain, "uncertainty": p.uncertainty, "fits": p.fits, "peak_gib": p.peak_gib,
                           "capacity_gib": p.capacity_bytes / GIB if p.capacity_bytes else None,
                           "step_s": p.step_s, "base_step_s": p.base_step_s}
    return V.verdict(findings, health, step, cands, outcomes, ctx, step_note=note)


@dataclass
class Analysis:
    """The base tables `analyze` builds, and the derived entries (`DERIVED`) computed from them on first
    read: `a.derived[name]`, or the typed accessors below."""

    trace: Trace
    tree: pd.DataFrame  # host events with parent/op/path links
    gpu: pd.DataFrame  # GPU events with launch, op, path, category, step
    steps: pd.DataFrame  # rank, step, start, end
    timeline: pd.DataFrame  # per rank, over the window's steps (steady state by default)
    step_timeline: pd.DataFrame  # per rank and step (every step; `steady` says which the window uses)
    ops: pd.DataFrame
    kernels: pd.DataFrame
    categories: pd.DataFrame
    top_ops: pd.DataFrame
    breakdown: pd.DataFrame
    annotations: pd.DataFrame  # record_function ranges / nn.Module scopes with host and GPU time
    warnings: list[str] = field(default_factory=list)
    pipeline: PipelineAnalysis | None = field(default=None, repr=False)  # when the run has pipeline data
    window: StepWindow | None = None  # the steps the views read and those left out, with reasons
    timeline_all: pd.DataFrame | None = None  # per rank over the whole profiled window (every event)
    gpu_window: pd.DataFrame | None = None  # the GPU events the views read (durations with cuts removed)
    host_window: np.ndarray | None = None  # boolean mask over `tree` rows: host events inside the window's steps (None: all)
    manifest: dict | None = field(default=None, repr=False)  # the run dir's manifest.json, when there is one
    computed: InitVar[dict[str, Any] | None] = None  # entries computed while the tables were built (analyze)
    derived: Derived = field(init=False, repr=False, compare=False)

    def __post_init__(self, computed: dict[str, Any] | None) -> None:
        self.derived = Derived(DERIVED, self, computed, after=give_back_memory)

    def roofline(self, ceilings: Any = None) -> RooflineResult:
        """Roofline of every modeled op group (tracelens.analysis.roofline): the `roofline` entry, or with
        `ceilings` (a dict or JSON path) a result for those, not kept."""
        if ceilings is not None:
            from .analysis.roofline import roofline_result

            r = roofline_result(self, ceilings=ceilings)
            give_back_memory()
            return r
        return self.derived["roofline"]

    def use_ceilings(self, ceilings: Any) -> None:
        """Make measured ceilings (a dict or JSON path, e.g. from `tracelens calibrate`; see
        tracelens.devices) the default of :meth:`roofline`, so summary.json and the report use them.
        Raises OSError/ValueError for an unreadable or invalid file."""
        from .analysis.roofline import roofline_result

        self.derived.put("roofline", roofline_result(self, ceilings=ceilings))

    def comm_kernels(self) -> pd.DataFrame:
        """The `comm_kernels` entry (read-only: callers filter it, never change it)."""
        return self.derived["comm_kernels"]

    def comm_instances(self) -> pd.DataFrame:
        """The `comm_instances` entry: one row per (collective instance, rank) (read-only)."""
        return self.derived["comm_instances"]

    def comm_waits(self) -> pd.DataFrame:
        """The `comm_waits` entry: each communication kernel's wait and transfer (tracelens.analysis.waits)."""
        return self.derived["comm_waits"]

    def host_syncs(self) -> pd.DataFrame:
        """The `host_syncs` entry: every blocking device-to-host sync (read-only)."""
        return self.derived["host_syncs"]

    def idle_gaps(self) -> pd.DataFrame:
        """The `idle_gaps` entry: every GPU idle gap with its cause (read-only)."""
        return self.derived["idle_gaps"]

    def launch_stats(self, small_us: float | None = None) -> pd.DataFrame:
        """Per rank launch latency and small kernels: the entry at the default threshold, else computed."""
        from .analysis.host import SMALL_KERNEL_US, launch_stats

        return self.derived["launch_stats"] if small_us in (None, SMALL_KERNEL_US) else launch_stats(self, small_us)

    def kernels_per_op(self, small_us: float | None = None) -> pd.DataFrame:
        """Ops by the kernels they launch: the entry at the default threshold, else computed."""
        from .analysis.host import SMALL_KERNEL_US, kernels_per_op

        return self.derived["kernels_per_op"] if small_us in (None, SMALL_KERNEL_US) else kernels_per_op(self, small_us)

    def critical_path(self, step: int | None = None) -> Any:
        """The critical path across ranks (tracelens.analysis.critical_path.CriticalPath): the entry (the window's
        steps; `problem` says why there is none), or of one `step`, computed (raises TraceError for bad input)."""
        if step is None:
            return self.derived["critical_path"]
        from .analysis.critical_path import critical_path_of

        return critical_path_of(self, step, instances=self.comm_instances(), syncs=self.host_syncs())

    def health(self) -> pd.DataFrame:
        """Trace health checks (tracelens.analysis.health): one row per finding with its severity, the ranks,
        what was found and which figures it invalidates."""
        return self.derived["health"]

    def findings(self, small_us: float | None = None) -> list[dict[str, Any]]:
        """Ranked, structured findings (tracelens.analysis.findings): the entry at the default small-kernel
        threshold; another threshold computes them again from the same syncs, gaps and instances."""
        from .analysis.host import SMALL_KERNEL_US

        if small_us in (None, SMALL_KERNEL_US):
            return self.derived["findings"]
        from .analysis.findings import findings

        return findings(self, small_us, host_syncs=self.host_syncs(), idle_gaps=self.idle_gaps(),
                        comm_instances=self.comm_instances(), critical_path=self.critical_path())

    def decomposition(self) -> pd.DataFrame:
        """The step decomposition (tracelens.projection.decomposition): per rank, the components that add
        up to the step time, how each scales, calibrated to the manifest's measured mean step time when
        the traces sit in a run dir (``attrs["basis"]``, ``attrs["note"]``). Raises DecompositionError
        (one line) when there is no profiled step to decompose, again on each call without recomputing."""
        return self.derived["decomposition"]

    def verdict(self) -> Any:
        """The verdict (tracelens.analysis.verdict.Verdict): the step in one bar, the bottleneck, the top three
        actions with the what-if's predicted gains, health warnings and findings as sentences. Raises what
        stopped it, again on each call without recomputing."""
        return self.derived["verdict"]

    def moe(self):
        """The MoE view (tracelens.analysis.moe_view.MoEReport): routing tied to expert-GEMM time and all-to-all
        bytes per rank pair. Raises TraceError (one line naming the file) for a truncated routing file or one
        from another run, again on each call without recomputing."""
        return self.derived["moe"]

    @property
    def trace_rank_count(self) -> int:
        return len(self.trace.ranks)

    @property
    def has_gpu(self) -> bool:
        return not self.gpu.empty

    def tables(self) -> dict[str, pd.DataFrame]:
        """The tables written next to the report (Parquet/CSV)."""
        return {
            **self.base_tables(),
            **(self.roofline().tables() if self.has_gpu else {}),
            **(self.pipeline.tables() if self.pipeline is not None else {}),
        }

    def base_tables(self) -> dict[str, pd.DataFrame]:
        """The tables of `tables` that `analyze` computed (no entry of the summary is computed for them): those
        either process of `summary_with` may write (`reports.artifacts.write_all`)."""
        return {
            "timeline": self.timeline, "timeline_all": self.timeline_all if self.timeline_all is not None else self.timeline,
            "step_timeline": self.step_timeline, "ops": self.ops,
            "kernels": self.kernels, "categories": self.categories, "top_ops": self.top_ops,
            "breakdown": self.breakdown, "steps": self.steps, "annotations": self.annotations,
        }

    def summary(self) -> dict[str, Any]:
        """The documented machine interface (docs/summary-json.md)."""
        return self.summary_with(None)[0]

    def summary_with(self, beside: Callable[[Analysis], T] | None,
                     here: Callable[[Analysis], Any] | None = None,
                     columnar: bool = False) -> tuple[dict[str, Any], T | None, Any]:
        """The summary, ``beside(self)`` and ``here(self)``. ``columnar``: the per-step lists as `Records` (columns;
        summary.json's writer, `reports.artifacts.summary_json`, encodes them without a dict per step), else
        plain lists of dicts, as `summary` gives them. ``beside``: work that reads only the base tables and the
        entries declared `offload` (the report's tables and figures, the tables' files: `reports.artifacts.write_all`).
        Both run in one forked child on a second CPU while this process computes the summary's other entries (the
        collective instances, the critical path, the findings, the MoE view: the longest chain), with the values
        they would have here (tracelens.offload); without a child, `beside` runs here after them. ``here``: work
        that reads those entries and none of the offloaded ones (the page's sections of the chain's results), run
        in this process after the chain and before it waits for the child (where the child is the longer side,
        instead of after it)."""
        # the entries declared `offload` (independent of findings and health, which share the collective
        # instances): on a second CPU they run beside them (tracelens.offload), with the values they
        # would have here
        wanted = ["roofline", "decomposition"] if self.has_gpu else ["decomposition"]
        away = [n for n in wanted if DERIVED[n].offload and n not in self.derived]
        # the offloaded entries' modules, imported before the fork rather than by each process on first use: this
        # one needs them too (their values come back pickled, as objects of those modules; the verdict and the
        # summary read the decomposition's), and the child importing them again took ~50 ms of CPU (the projection
        # package's ~40 modules, the roofline's). (`tracelens.load` may have imported them during the scan.)
        for name in dict.fromkeys(DERIVED[n].module for n in wanted if DERIVED[n].module):
            importlib.import_module(name)
        task = (offload.submit(_away, self, away, beside, events=len(self.trace.events))
                if away or beside is not None else None)
        core = summary_core(self.trace, self.window, self.timeline,
                            self.timeline_all if self.timeline_all is not None else self.timeline,
                            self.step_timeline, self.categories)
        cross = len(self.trace.ranks) >= 2 and self.has_gpu and bool(self.gpu["is_comm"].any())
        add_comm_kernel_waits(core["ranks"], self.comm_waits() if cross else None, self.window)
        findings = self.findings()
        health = _health_summary(self)
        critical_path = self.critical_path().summary(columnar=True)
        moe = self.moe().summary()
        mine = here(self) if here is not None else None
        extra = None
        if task is not None:  # the verdict reads the decomposition
            values, extra = task.result()
            for name, value in values.items():
                if name not in self.derived:
                    self.derived.put(name, value)
        doc = {
            **core,
            "findings": findings,
            "roofline": self.roofline().summary() if self.has_gpu else None,
            "warnings": list(self.warnings),
            "health": health,
            "decomposition": _decomposition_summary(self),
            "critical_path": critical_path,
            "moe": moe,
            "verdict": _verdict_summary(self),
        }
        return (doc if columnar else plain(doc)), extra, mine


def _away(a: Analysis, names: list[str], beside: Callable[[Analysis], Any] | None) -> tuple[dict[str, Any], Any]:
    """What `Analysis.summary_with` offloads: the outcomes of the entries `names`, then `beside(a)` (which may
    read them)."""
    values = a.derived.compute(names)
    return values, beside(a) if beside is not None else None


def summary_text(result: Any) -> str:
    """What `tracelens analyze` prints: the window, then per rank the GPU figures; for CPU-only traces
    (the trainer on a CPU) per rank the host time per profiler step, the MoE stages and the ops with the
    most self time per step (never summed over ranks), then the first findings. ``result``: an
    `Analysis`, or the many-rank path's result (`tracelens.scale`) when it has GPU activity."""
    lines = [f"window: {result.window.describe()}"] if result.window is not None else []
    tl = result.timeline
    if not tl.empty:
        waits = "comm_wait_us" in tl.columns and bool((tl["comm_wait_us"] > 0).any() or (tl["pipeline_wait_us"] > 0).any())
        lines.append(f"{'rank':>4} {'span ms':>10} {'busy %':>7} {'compute ms':>11} {'comm ms':>9} {'exposed ms':>11} "
                     + (f"{'wait ms':>9} {'pp wait ms':>10} " if waits else "") + f"{'kernels':>8}")
        for r in tl.itertuples(index=False):
            busy = 100.0 * r.gpu_busy_us / r.span_us if r.span_us else 0.0
            lines.append(f"{r.rank:>4} {r.span_us / 1e3:>10.3f} {busy:>7.1f} {r.compute_us / 1e3:>11.3f} "
                         f"{r.comm_us / 1e3:>9.3f} {r.exposed_comm_us / 1e3:>11.3f} "
                         + (f"{r.comm_wait_us / 1e3:>9.3f} {r.pipeline_wait_us / 1e3:>10.3f} " if waits else "")
                         + f"{r.kernel_count:>8}")
        if waits:
            lines.append("comm ms: communication kernel time; exposed ms: its transfer not hidden by compute; wait ms: "
                         "waiting in collectives for another rank; pp wait ms: pipeline receives waiting for the "
                         "neighbour stage (the bubble)")
        return "\n".join(lines + _verdict_lines(result))
    lines.append("no GPU activity in these traces (CPU-only): GPU timeline unavailable; host time per rank instead")
    hs = steps_mod.host_step_table(result)
    ms = steps_mod.moe_stage_table(result)
    top = steps_mod.host_top_ops(result, top=5)
    for rank, g in hs.groupby("rank"):
        per = ", ".join(f"step {int(r.step)} {r.step_time_us / 1e3:.1f} ms{'' if r.steady else ' (excluded)'}"
                        for r in g.itertuples(index=False))
        lines.append(f"rank {rank}: {per}")
        m = ms[ms["rank"] == rank]
        if len(m):
            lines.append("  MoE stages per step: " + ", ".join(
                f"{r.stage} {r.host_us_per_step / 1e3:.3f} ms ({100 * r.share_of_step:.0f}%)" for r in m.itertuples(index=False)))
        t = top[top["rank"] == rank]
        if len(t):
            lines.append("  top ops by self time per step: " + ", ".join(
                f"{r.op} {r.self_us_per_step / 1e3:.3f} ms" for r in t.itertuples(index=False)))
    return "\n".join(lines + _verdict_lines(result))


def _verdict_lines(result: Any) -> list[str]:
    """The verdict's text (an `Analysis`; the many-rank path's result has none), or the one line that says
    why there is none."""
    if not isinstance(result, Analysis):
        return []
    from .projection.decomposition import reason

    try:
        return result.verdict().to_text().split("\n")
    except Exception as e:  # noqa: BLE001 - the tables above still stand
        return ["", f"verdict: unavailable ({reason(e)})"]


@dataclass
class CoreTables:
    """The base tables the first entries read (`comm_kernels`, `comm_instances`): what `analyze` has built
    when the start-up waits need the collective instances, before the Analysis exists, and what the
    many-rank path (tracelens.scale) has of one rank."""

    trace: Trace
    tree: pd.DataFrame
    gpu: pd.DataFrame


def summary_core(trace: Any, window: Any, timeline: pd.DataFrame, timeline_all: pd.DataFrame,
                 step_timeline: pd.DataFrame, categories: pd.DataFrame) -> dict[str, Any]:
    """The per-rank part of summary.json (schema, tool, world size, window, ranks, categories) from the
    per-rank tables; `Analysis.summary` and the many-rank path (`tracelens.scale`) both build it here.
    `trace` needs only `.ranks`."""
    ranks = []
    tl = timeline.set_index("rank") if not timeline.empty else None
    tla = timeline_all.set_index("rank") if not timeline_all.empty else None
    used = set(window.used) if window is not None and window.restricts else None
    for info in trace.ranks:
        r: dict[str, Any] = {"rank": info.rank, "file": info.path, "device": info.device_name,
                             "gpu_available": tla is not None and info.rank in tla.index}
        if tl is not None and info.rank in tl.index:
            r.update(_metric_fields(tl.loc[info.rank]))
        else:
            r.update({k: None for k in _FIELDS})
        r["all_steps"] = (_metric_fields(tla.loc[info.rank]) if tla is not None and info.rank in tla.index
                          else {k: None for k in _FIELDS})
        r["steps"] = _step_records(step_timeline[step_timeline["rank"] == info.rank], used)
        ranks.append(r)
    return {
        "schema_version": SUMMARY_SCHEMA,
        "tool": {"name": "tracelens", "version": __version__},
        "world_size": _world_size(trace),
        "window": window.to_dict() if window is not None else None,
        "ranks": ranks,
        "categories": [
            {"rank": int(c.rank), "category": c.category, "count": int(c.count), "total_us": _num(c.total_us),
             "pct_gpu_busy": _num(c.pct_gpu_busy)}
            for c in categories.itertuples(index=False)
        ],
    }


_FIELDS = ("span_us", "gpu_busy_us", "gpu_idle_us", "compute_us", "comm_us", "memcpy_us", "memset_us",
           "exposed_comm_us", "comm_wait_us", "pipeline_wait_us", "kernel_count")


def add_comm_kernel_waits(ranks: list[dict[str, Any]], kw: pd.DataFrame | None, sw: Any) -> None:
    """Each rank's ``comm_kernels`` record: its communication kernels' time over the window split into waiting
    for another rank, waiting for the neighbour pipeline stage and transfer (sums over kernels, as `tracelens
    comm` reports them; the timeline fields are the parts no compute hides), and the rank it waited for most,
    from the kernels' waits ``kw`` (tracelens.analysis.waits); null without cross-rank waits (kw None: one
    rank, no communication). `Analysis.summary` and the many-rank path both call it."""
    per = waits_mod.rank_waits(kw, sw.used if sw is not None and sw.restricts else None) if kw is not None else None
    by = per.set_index("rank") if per is not None and len(per) else None
    for r in ranks:
        if by is None or r["rank"] not in by.index:
            r["comm_kernels"] = None
            continue
        x = by.loc[r["rank"]]
        r["comm_kernels"] = {"wait_us": _num(x["peer_wait_us"]), "pipeline_wait_us": _num(x["pipeline_wait_us"]),
                             "transfer_us": _num(x["transfer_us"]),
                             "waits_for": int(x["waits_for"]) if int(x["waits_for"]) >= 0 else None}


def _decomposition_summary(a: Analysis) -> dict[str, Any]:
    """summary.json's ``decomposition``: the records, or ``available: false`` with the reason in one line."""
    from .projection.decomposition import reason, to_summary, unavailable

    try:
        return to_summary(a.decomposition())
    except Exception as e:  # noqa: BLE001 - summary.json is written whatever the decomposition meets
        return unavailable(reason(e))


def _verdict_summary(a: Analysis) -> dict[str, Any]:
    """summary.json's ``verdict``: the record (docs/summary-json.md), or ``available: false`` with the reason."""
    from .projection.decomposition import reason

    try:
        return {"available": True, **a.verdict().to_dict()}
    except Exception as e:  # noqa: BLE001 - summary.json is written whatever the verdict meets
        return {"available": False, "reason": " ".join(reason(e).split())[:400]}


def _health_summary(a: Analysis) -> dict[str, Any]:
    """summary.json's ``health``: what `tracelens check` reports (tracelens.analysis.health.HealthReport)."""
    from .analysis.health import health_report

    return health_report(a).summary()


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else round(f, 3)


def _step_records(st: pd.DataFrame, used: set[int] | None) -> Records:
    """One rank's per-step records of summary.json: step, `_FIELDS` as `_metric_fields` gives them, startup_wait_us,
    steady. Held as columns (`tracelens.records`; `_num`'s rounding on each column's values at once): a trace of
    80,000 steps spent 0.7 s here as a record and a `_num` call per field and step, 800,000 steps ~1.3 s and
    ~0.7 GB as a dict per step."""
    n = len(st)

    def ints(k: str) -> np.ndarray | list:
        v = st[k].to_numpy()
        if v.dtype.kind in "iu":
            return v.astype(np.int64, copy=False)
        return [int(x) for x in v.tolist()]  # (as int() takes each value: 3.0 -> 3, and what it rejects)

    steps = ints("step") if n else np.empty(0, dtype=np.int64)
    cols: dict[str, Any] = {"step": steps}
    for k in _FIELDS:
        cols[k] = ints(k) if k == "kernel_count" else round3_array(st[k].to_numpy(dtype=float, na_value=np.nan))
    cols["startup_wait_us"] = (round3_array(st["startup_wait_us"].to_numpy(dtype=float, na_value=np.nan))
                               if "startup_wait_us" in st.columns else np.zeros(n))
    cols["steady"] = (np.ones(n, dtype=bool) if used is None
                      else np.isin(np.asarray(steps, dtype=np.int64), np.fromiter(used, dtype=np.int64, count=len(used))))
    return Records(cols)


def _metric_fields(row: Any) -> dict[str, Any]:
    out = {k: _num(row[k]) for k in _FIELDS}
    out["kernel_count"] = int(row["kernel_count"])
    return out


def _world_size(trace: Trace) -> int | None:
    for r in trace.ranks:
        if r.world_size:
            return r.world_size
    return len(trace.ranks) if len(trace.ranks) > 1 else None


def _mark_startup_waits(stl: pd.DataFrame, waits: pd.DataFrame, warnings: list[str], sw) -> pd.DataFrame:
    """Collectives one rank began before another rank's profiled window started wait partly outside the
    trace: say so (and what the views do with it), and give each step its start-up wait."""
    stl = stl.assign(startup_wait_us=0.0)
    for r in waits.itertuples(index=False):
        if sw.restricts and r.step not in sw.used:
            where = f"step {r.step} is left out of the steady-state views"
        elif sw.restricts and r.rank in sw.cuts:
            where = f"the wait is cut out of step {r.step}'s timeline on this rank (no other step to use)"
        else:
            where = f"step {r.step}'s figures on this rank include it (startup_wait_us)"
        warnings.append(f"rank {r.rank}: {r.collective} #{r.instance} waited {r.sync_us / 1e3:.3f} ms for ranks that had "
                        f"not started profiling yet (start-up wait); comm analyses leave it out, and {where}")
        m = (stl["rank"] == r.rank) & (stl["step"] == r.step)
        stl.loc[m, "startup_wait_us"] += r.sync_us
    return stl


# what `Analysis.summary` imports on first use: the pipeline account (`analyze`), then the modules the
# derived entries compute in
_SUMMARY_MODULES = ("tracelens.analysis.pipeline", *dict.fromkeys(e.module for e in DERIVED if e.module))


def preload(while_=lambda: True) -> None:
    """Import the modules `summary` uses on first use, one at a time while `while_()` holds (`tracelens.load`
    does this while the scan of a large file runs, so an analysis does not import them after it)."""
    import importlib

    for name in _SUMMARY_MODULES:
        if not while_():
            return
        importlib.import_module(name)


def _pipeline(trace: Trace) -> tuple[Any, list[str]]:
    """Pipeline schedule analysis when the run dir has pipeline/rank<N>.jsonl or the traces have pipeline
    ranges (tracelens.analysis.pipeline), and the warnings it adds; a problem with that data becomes a
    warning, not a failure. (Returns its warnings rather than appending them: it may run in an offloaded
    child, tracelens.offload.)"""
    from .analysis.pipeline import pipeline_for_trace
    from .errors import TraceError

    try:
        res = pipeline_for_trace(trace)
    except TraceError as e:
        return None, [f"pipeline section skipped: {e.one_line()}"]
    return res, ([f"pipeline: {w}" for w in res.warnings] if res is not None else [])


def analyze(trace: Trace, window: str = "steady") -> Analysis:
    """Hierarchical breakdown of a loaded trace: timeline -> ops -> kernels, per rank and step.

    window: "steady" (default) reads the steady-state profiler steps (`a.window` names the steps left
    out and why); "all" reads the whole profiled window, every event.
    """
    if window not in (steps_mod.STEADY, steps_mod.ALL):
        raise ValueError(f"window must be 'steady' or 'all', got {window!r}")
    warnings = list(trace.warnings)
    # the pipeline account needs only the trace: on a second CPU it runs beside the core tables below
    from .analysis.pipeline import has_pipeline_data

    pipeline_task = offload.submit(_pipeline, trace, events=len(trace.events), worth=has_pipeline_data(trace))
    tree = calltree.build_tree(trace.events, trace.tree_rows)
    give_back_memory()  # build_tree's temporaries (the largest of an analysis)
    steps = calltree.steps_table(tree)
    gpu = calltree.attribute_gpu(calltree.gpu_events(trace.events), tree, steps)
    give_back_memory()
    manifest = steps_mod.run_manifest(trace)
    # entries of the tables built so far (the collective instances the start-up waits read), kept for the
    # Analysis: findings, health and the report read the same ones
    early = DERIVED.bind(CoreTables(trace=trace, tree=tree, gpu=gpu))
    waits = steps_mod.startup_waits(trace, gpu, instances=lambda: early["comm_instances"])
    tree_step = steps_mod.host_steps(tree, steps)
    sw = steps_mod.step_window(trace, tree, gpu, steps, mode=window, waits=waits, manifest=manifest, tree_step=tree_step)
    # each communication kernel's wait (for a peer rank, for the pipeline) and transfer: the timelines count
    # only the transfer as communication (tracelens.analysis.waits)
    cross = len(trace.ranks) >= 2 and not gpu.empty and bool(gpu["is_comm"].any())
    kwaits = waits_mod.wait_class(early["comm_waits"]) if cross else None
    tl_all = timeline.gpu_timeline(gpu, waits=kwaits)
    stl = timeline.gpu_timeline(gpu, by_step=True, waits=kwaits)
    gpu_ranks = set(gpu["rank"].unique().tolist())
    for info in trace.ranks:
        if info.rank not in gpu_ranks:
            warnings.append(f"{info.path}: CPU-only trace (no GPU kernels, memcpy or memset): GPU sections unavailable")
    op_ranks = set(tree.loc[tree["kind"].to_numpy() == calltree.KIND_OP, "rank"].unique().tolist())
    host_ranks = set(tree["rank"].unique().tolist())
    for info in trace.ranks:
        if info.rank in gpu_ranks and info.rank not in op_ranks:
            what = "no CPU op" if info.rank in host_ranks else "GPU-only trace, no CPU events"
            warnings.append(f"{info.path}: {what}: GPU timeline and kernels only, no op or call-tree figures")
    stl = _mark_startup_waits(stl, waits, warnings, sw)
    if not stl.empty:
        stl["steady"] = stl["step"].isin(sw.used).to_numpy() if sw.restricts else True
    gw_raw = steps_mod.window_events(gpu, sw)
    if sw.restricts and not gpu.empty and gw_raw.empty:
        sw.notes.append("no GPU event was launched inside the steady-state steps: GPU views read the whole window")
        gw_raw = gpu
    tl = timeline.gpu_timeline(gw_raw, cuts=sw.cuts, waits=kwaits) if gw_raw is not gpu or sw.cuts else tl_all
    gw = steps_mod.clip_durations(gw_raw, sw.cuts)
    host_mask = np.isin(tree_step, sw.used) if sw.restricts else None
    if host_mask is not None and not (host_mask & (tree["kind"].to_numpy() == calltree.KIND_OP)).any():
        if (tree["kind"].to_numpy() == calltree.KIND_OP).any():
            sw.notes.append("no op ran inside the steady-state steps: host views read the whole window")
        host_mask = None
    busy_by_rank = {int(r.rank): r.gpu_busy_us * 1000.0 for r in tl.itertuples(index=False)}
    busy_total = float(sum(busy_by_rank.values()))
    if not gpu.empty and op_ranks and (gpu["op_row"] < 0).all():  # (no op at all: said per rank above)
        warnings.append("no GPU event could be linked to a CPU op (trace lacks runtime events/correlation ids)")
    pre = steps_mod.pre_window_launches(gpu, tree)
    for step, g in pre[pre["step"] >= 0].groupby("step", sort=True):  # one line per step, however many ranks
        if len(g) == 1:
            r = next(g.itertuples(index=False))
            warnings.append(f"rank {r.rank}: {r.events} GPU events ({r.busy_ns / 1e6:.1f} ms) were launched before "
                            f"the trace's first recorded launch (the host ran ahead when profiling began) and run in "
                            f"step {step}: its GPU figures include work of the step before")
            continue
        from .analysis.comm import ranks_text

        ev, ms = g["events"], g["busy_ns"] / 1e6
        warnings.append(f"ranks {ranks_text(sorted(int(x) for x in g['rank']))}: {ev.min()}-{ev.max()} GPU events "
                        f"({ms.min():.1f}-{ms.max():.1f} ms) per rank were launched before their trace's first recorded "
                        f"launch (the host ran ahead when profiling began) and run in step {step}: their GPU figures "
                        f"include work of the step before")
    if not steps.empty and not stl.empty and (gpu["step"] < 0).mean() > 0.5:
        warnings.append("most GPU activity was launched outside the marked profiler steps")
    tables = dict(
        ops=summaries.ops_summary(tree, gw, busy_total, host_mask=host_mask),
        kernels=summaries.kernel_summary(gw, busy_total),
        categories=summaries.category_rollup(gw, busy_by_rank),
        top_ops=summaries.top_level_ops(tree, gw, host_mask=host_mask),
        breakdown=summaries.breakdown_tree(gw, tree, host_mask=host_mask),
        annotations=summaries.annotation_summary(tree, gw, host_mask=host_mask),
    )
    pipeline, pipeline_warnings = pipeline_task.result()
    warnings.extend(pipeline_warnings)
    a = Analysis(
        trace=trace, tree=tree, gpu=gpu, steps=steps, timeline=tl, step_timeline=stl, **tables,
        warnings=warnings, pipeline=pipeline,
        window=sw, timeline_all=tl_all, gpu_window=gw, host_window=host_mask, manifest=manifest,
        computed=early.values,
    )
    give_back_memory()
    return a

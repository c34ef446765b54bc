"""Many ranks: per-rank work as independent tasks, the cross-rank step on per-rank reductions.

    >>> from tracelens import scale
    >>> r = scale.analyze_ranks("runs/big")                 # in this process, one rank at a time
    >>> r = scale.analyze_ranks("runs/big", workers=8)      # Dask LocalCluster, 8 worker processes
    >>> r = scale.analyze_ranks("runs/big", scheduler="tcp://head:8786")   # a running Dask cluster
    >>> r.summary()          # == analyze(load(...)).summary() on its keys (docs/summary-json.md)
    >>> r.comm_summary, r.stragglers, r.pipeline

Two per-rank steps, both pure functions of one rank file and small inputs:

1. `reduce_rank(path)` loads one rank (the loader, its cache), builds the call tree and the GPU table and
   returns `RankTables`: the rank's identity and load warnings, its steps, op counts per step, its
   whole-window and per-step timelines, its communication-kernel rows, its pipeline actions and activity
   intervals (when the run has pipeline data), and a compact GPU table (times, kind, category, step) for
   step 2. `RankTables.light()` is everything but that GPU table: what the driver gathers.
2. `window_rank(tables, plan)`: the rank's figures over the steady-state window the driver chose from
   every rank's reduction (timeline, categories).

The driver's cross-rank step (`combine`) sees only light reductions: it checks the rank set, matches
collectives across ranks (`comm.match_instances`), picks the steady-state window
(`steps.classify_steps`), and runs the pipeline analysis on the gathered actions. The same functions run
in-process (no Dask, the default) or as Dask tasks (`workers=` / `scheduler=`): the two paths give equal
results by construction, and tests/tracelens/test_scale.py checks both against the all-in-memory
`analyze(load(...))`. Dask is the optional extra `tracelens[distributed]`; nothing here imports it
unless a cluster is asked for.

Not in this summary (they need every rank's full tables on one machine): findings, roofline, health and
the step decomposition; `summary()` says so under `distributed`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import pandas as pd

from .errors import TraceError

INSTALL_HINT = "pip install 'tracelens[distributed]'"


class NeedsDask(RuntimeError):
    """The distributed path was asked for and Dask distributed is not installed."""


@dataclass
class RankTables:
    """One rank's reduction: what the cross-rank step needs, plus `gpu` for the windowed figures."""

    info: Any  # tracelens.trace.RankInfo
    index: int  # position of the file among those discovered
    warnings: list[str]
    issues: list[dict]
    n_events: int
    n_tree: int  # the call tree's events: the rank's first rows (io/roworder.py)
    window_start: int | None  # first event ts (ns); None when the rank has no event
    steps: pd.DataFrame  # calltree.steps_table
    ops_per: pd.Series  # ops per (rank, step >= 0)
    n_ops: int
    has_host: bool
    outside_n: int  # GPU events launched outside every marked step
    outside_ns: int
    gpu_steps: pd.Series  # GPU events per step (index step, incl. -1)
    n_gpu: int
    any_linked: bool  # some GPU event has a launching op
    timeline_all: pd.DataFrame
    step_timeline: pd.DataFrame  # by step, every step
    comm: pd.DataFrame  # comm.comm_kernels rows; `row` is the rank-local row label
    actions: pd.DataFrame | None  # pipeline actions from the rank's own ranges (None: none)
    activity: tuple | None  # pipeline.rank_activity of the rank (lo, hi, sets) when wanted
    gpu: pd.DataFrame | None = field(default=None, repr=False)  # compact GPU table for `window_rank`

    def light(self) -> "RankTables":
        """This reduction without the GPU table (what the driver gathers)."""
        return replace(self, gpu=None)


@dataclass
class WindowPlan:
    """What the driver decided for the windowed per-rank figures."""

    restricts: bool
    used: list[int]
    cuts: dict  # rank -> [(start_ns, end_ns)]
    whole_gpu: bool  # no GPU event inside the steady steps anywhere: read the whole window
    # rank -> its communication kernels' waits (`waits.wait_class`, on the rank's own row labels): the
    # timelines count only their transfer as communication
    waits: dict = field(default_factory=dict)


_GPU_COLS = ["rank", "step", "ts", "end", "dur", "kind", "is_comm", "category"]


def reduce_rank(path: str, index: int = 0, n_files: int = 1, *, cache: bool = True,
                cache_dir: str | None = None, want_activity: bool = False, threads: int | None = None) -> RankTables:
    """Load one rank file and reduce it to `RankTables` (see the module docstring). `index` / `n_files`:
    the file's place among the run's files (the rank of a file without distributedInfo or a rank in its
    name is its position, as `tracelens.load` assigns it). threads: the compiled scanner's threads (1 on a
    Dask worker, which shares the machine with the others). Raises TraceError naming the file."""
    from .analysis import calltree, timeline
    from .analysis.pipeline import actions_from_trace, rank_activity
    from .analyzer import DERIVED, CoreTables
    from .analysis.steps import host_steps
    from .trace import Trace, _concat_ranks, _parse_one, rank_of

    parsed, hit = _parse_one(os.fspath(path), cache, os.fspath(cache_dir) if cache_dir else None, threads=threads)
    parsed.meta["from_cache"] = hit
    info, warnings, issues = rank_of(parsed, index, n_files)
    tables = [parsed.events]
    parsed.events = None
    counts = [parsed.meta.get("tree_rows")]
    events = _concat_ranks(tables, [info], events=True, tree_rows=counts)
    trace = Trace(events=events, flows=pd.DataFrame(), threads=pd.DataFrame(), ranks=[info], tree_rows=counts[0])
    tree = calltree.build_tree(events, counts[0])
    steps = calltree.steps_table(tree)
    gpu = calltree.attribute_gpu(calltree.gpu_events(events), tree, steps)
    tree_step = host_steps(tree, steps)
    is_op = tree["kind"].to_numpy() == calltree.KIND_OP
    ops_per = pd.DataFrame({"rank": tree["rank"].to_numpy()[is_op], "step": tree_step[is_op]})
    ops_per = ops_per[ops_per["step"] >= 0].groupby(["rank", "step"]).size()
    step_col = gpu["step"].to_numpy()
    outside = step_col < 0
    comm = DERIVED.bind(CoreTables(trace=trace, tree=tree, gpu=gpu))["comm_kernels"]  # the rank's entry
    actions = actions_from_trace(trace)
    activity = None
    if want_activity or not actions.empty:
        activity = rank_activity(events).get(info.rank)
    out = RankTables(
        info=info, index=index, warnings=warnings, issues=issues, n_events=len(events), n_tree=len(tree),
        window_start=int(events["ts"].min()) if len(events) else None,
        steps=steps, ops_per=ops_per, n_ops=int(is_op.sum()), has_host=len(tree) > 0,
        outside_n=int(outside.sum()), outside_ns=int(gpu["dur"].to_numpy()[outside].sum()),
        gpu_steps=pd.Series(step_col).value_counts().sort_index(), n_gpu=len(gpu),
        any_linked=bool((gpu["op_row"].to_numpy() >= 0).any()) if len(gpu) else False,
        timeline_all=timeline.gpu_timeline(gpu), step_timeline=timeline.gpu_timeline(gpu, by_step=True),
        comm=comm, actions=None if actions.empty else actions, activity=activity,
        gpu=gpu[_GPU_COLS].copy(),
    )
    return out


def window_rank(rt: RankTables, plan: WindowPlan) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """One rank's figures over the chosen window: (timeline row, category rows, whole-window timeline,
    per-step timeline), as `analyze` computes them for that rank (the last two redone with the waits of the
    rank's communication kernels when the cross-rank step found any)."""
    from .analysis import summaries, timeline
    from .analysis.steps import clip_durations

    gpu = rt.gpu
    gw_raw = gpu
    if plan.restricts and not gpu.empty and not plan.whole_gpu:
        gw_raw = gpu[gpu["step"].isin(plan.used).to_numpy()]
    cuts = {rt.info.rank: plan.cuts[rt.info.rank]} if rt.info.rank in plan.cuts else {}
    w = (plan.waits or {}).get(rt.info.rank)
    tla = timeline.gpu_timeline(gpu, waits=w) if w is not None else rt.timeline_all
    stl = timeline.gpu_timeline(gpu, by_step=True, waits=w) if w is not None else rt.step_timeline
    tl = timeline.gpu_timeline(gw_raw, cuts=cuts, waits=w) if (gw_raw is not gpu or plan.cuts) else tla
    gw = clip_durations(gw_raw, cuts)
    busy = {int(r.rank): r.gpu_busy_us * 1000.0 for r in tl.itertuples(index=False)}
    return tl, summaries.category_rollup(gw, busy), tla, stl


@dataclass
class _RanksTrace:
    """What the cross-rank analyses read of a `Trace`, without event tables."""

    ranks: list
    warnings: list[str]
    run_status: dict | None = None
    run: Any = None  # tracelens.io.run.Run of the rank files
    rank_activity: dict | None = None
    pipeline_actions: pd.DataFrame | None = None
    events: pd.DataFrame = field(default_factory=pd.DataFrame)
    load_issues: pd.DataFrame | None = None  # as Trace.load_issues

    @property
    def rank_ids(self) -> list[int]:
        return [r.rank for r in self.ranks]


@dataclass
class RanksAnalysis:
    """The many-rank result: per-rank tables and the cross-rank analyses (see the module docstring)."""

    trace: _RanksTrace
    window: Any  # steps.StepWindow
    timeline: pd.DataFrame
    timeline_all: pd.DataFrame
    step_timeline: pd.DataFrame
    categories: pd.DataFrame
    instances: pd.DataFrame  # comm.collective_instances
    comm_waits: pd.DataFrame | None  # waits.kernel_waits of the instances (None: no cross-rank waits)
    comm_summary: pd.DataFrame
    stragglers: pd.DataFrame
    coverage: pd.DataFrame
    pipeline: Any
    warnings: list[str]
    engine: str  # "in-process", "dask LocalCluster (N workers)", "dask scheduler ADDR"
    timings: dict = field(default_factory=dict)  # wall seconds: reduce (per-rank tasks), combine (driver), window, finish

    def comm_instances(self) -> pd.DataFrame:
        """The `comm_instances` entry of the run (as `Analysis.comm_instances()`), matched across ranks
        from each rank's `comm_kernels` entry."""
        return self.instances

    def tables(self) -> dict[str, pd.DataFrame]:
        out = {"timeline": self.timeline, "timeline_all": self.timeline_all, "step_timeline": self.step_timeline,
               "categories": self.categories, "comm_instances": self.instances, "comm_summary": self.comm_summary,
               "comm_stragglers": self.stragglers}
        if self.pipeline is not None:
            out.update(self.pipeline.tables())
        return out

    def summary(self, columnar: bool = False) -> dict[str, Any]:
        """summary.json of the many-rank path: the keys it shares with `Analysis.summary()` hold equal
        values; `comm` and `pipeline` hold the cross-rank analyses; `distributed` says what is left out.
        ``columnar``: the per-step lists as `tracelens.records.Records` (summary.json's writer), else lists."""
        import json

        from .analyzer import add_comm_kernel_waits, summary_core
        from .records import plain

        def recs(df):
            return json.loads(df.to_json(orient="records"))

        core = summary_core(self.trace, self.window, self.timeline, self.timeline_all, self.step_timeline,
                            self.categories)
        add_comm_kernel_waits(core["ranks"], self.comm_waits, self.window)
        doc = {
            **core,
            "warnings": list(self.warnings),
            "comm": {"summary": recs(self.comm_summary), "stragglers": recs(self.stragglers),
                     "coverage": recs(self.coverage)},
            "pipeline": self.pipeline.to_dict() if self.pipeline is not None else None,
            "distributed": {"engine": self.engine,
                            "not_included": ["findings", "roofline", "health", "decomposition", "ops", "kernels"],
                            "note": "per-rank work ran as independent tasks; the sections left out need every "
                                    "rank's full tables in one process (tracelens analyze without --workers)"},
        }
        return doc if columnar else plain(doc)


def _wants_activity(files: list[str]) -> bool:
    """True when the files belong to a run with pipeline/rank<N>.jsonl files."""
    from .io.run import Run

    return bool(Run.of_files(files).pipeline_files())


def combine(light: list[RankTables], files: list[str], window: str = "steady"):
    """The cross-rank step on light reductions (any order): returns (trace-like, StepWindow, WindowPlan,
    comm pieces, the rest `finish` needs)."""
    from .analysis import steps as steps_mod
    from .analysis.comm import match_instances
    from .io.run import Run
    from .trace import _issues_table, check_ranks

    light = sorted(light, key=lambda r: r.index)
    warnings: list[str] = []
    issues: list[dict] = []
    for r in light:
        warnings += r.warnings
        issues += r.issues
    warnings += check_ranks([r.info for r in light])
    light = sorted(light, key=lambda r: r.info.rank)
    rt = _RanksTrace(ranks=[r.info for r in light], warnings=warnings, load_issues=_issues_table(issues))
    rt.run = Run.of_files(files)
    rt.run_status = rt.run.status()
    if rt.run_status and rt.run_status["warning"]:
        rt.warnings.insert(0, rt.run_status["warning"])
    # comm-kernel rows with the row labels of the all-ranks tables: the ranks' call-tree events in rank
    # order, then their other events in rank order (trace._concat_ranks)
    k = np.array([r.n_tree for r in light], dtype=np.int64)
    rest = np.array([r.n_events for r in light], dtype=np.int64) - k
    tree_off = np.concatenate([[0], np.cumsum(k)[:-1]])
    rest_off = k.sum() + np.concatenate([[0], np.cumsum(rest)[:-1]]) - k  # (minus k: local rows past the tree)

    def global_rows(i: int, row: np.ndarray) -> np.ndarray:
        return np.where(row < k[i], row + tree_off[i], row + rest_off[i])

    parts = [r.comm.assign(local_row=r.comm["row"].to_numpy(), row=global_rows(i, r.comm["row"].to_numpy()))
             for i, r in enumerate(light) if not r.comm.empty]
    kern = pd.concat(parts, ignore_index=True) if parts else light[0].comm.iloc[:0]
    window_start = pd.Series({r.info.rank: r.window_start for r in light if r.window_start is not None}, dtype=np.int64)
    inst = match_instances(kern, window_start, rt)
    n_gpu = sum(r.n_gpu for r in light)
    waits = _startup_waits(inst, kern, len(light), n_gpu)
    steps = pd.concat([r.steps for r in light], ignore_index=True)
    all_steps = sorted(int(s) for s in steps["step"].unique()) if not steps.empty else []
    manifest = steps_mod.run_manifest(rt)
    out_n = sum(r.outside_n for r in light) if n_gpu and all_steps else 0
    out_ns = sum(r.outside_ns for r in light) if n_gpu and all_steps else 0
    sw = steps_mod.StepWindow(mode=window, steps=all_steps, used=list(all_steps), excluded=[],
                              outside_gpu_events=int(out_n), outside_gpu_us=float(out_ns) / 1000.0 if out_n else 0.0)
    if all_steps:
        ops_per = pd.concat([r.ops_per for r in light]) if light else pd.Series(dtype=np.int64)
        sw = steps_mod.classify_steps(sw, steps, waits, ops_per, manifest)
    return rt, sw, kern, inst, waits, manifest


def _startup_waits(inst: pd.DataFrame, kern: pd.DataFrame, n_ranks: int, n_gpu: int) -> pd.DataFrame:
    """steps.startup_waits from the matched instances (the kernel's start comes from its comm row)."""
    cols = ["rank", "step", "collective", "instance", "sync_us", "wait_start_ns", "wait_end_ns"]
    if n_ranks < 2 or n_gpu == 0 or kern.empty:
        return pd.DataFrame(columns=cols)
    su = inst[inst["startup"] & (inst["sync_us"] > 0)]
    if su.empty:
        return pd.DataFrame(columns=cols)
    ts = kern.set_index("row").loc[su["gpu_row"].to_numpy(), "ts"].to_numpy().astype(np.int64)
    wait = np.round(su["sync_us"].to_numpy() * 1000.0).astype(np.int64)
    return pd.DataFrame({"rank": su["rank"].to_numpy(), "step": su["step"].to_numpy(), "collective": su["collective"].to_numpy(),
                         "instance": su["instance"].to_numpy(), "sync_us": su["sync_us"].to_numpy(),
                         "wait_start_ns": ts, "wait_end_ns": ts + wait})[cols].reset_index(drop=True)


def comm_waits(light: list[RankTables], rt, kern: pd.DataFrame, inst: pd.DataFrame) -> pd.DataFrame | None:
    """`waits.kernel_waits` of the matched instances (global row labels), as `analyze`'s `comm_waits` entry;
    None when there are no cross-rank waits to find (one rank, no GPU, no communication kernel)."""
    from .analysis.pipeline import has_pipeline_data
    from .analysis.waits import is_pipeline, kernel_waits

    if len(light) < 2 or not sum(r.n_gpu for r in light) or kern.empty:
        return None
    pipeline = is_pipeline(rt, has_pipeline_data) or any(r.actions is not None for r in light)
    return kernel_waits(inst, pipeline=pipeline)


def local_waits(kw: pd.DataFrame | None, kern: pd.DataFrame) -> dict:
    """rank -> `waits.wait_class` of its kernels on its own row labels (what `window_rank` reads)."""
    from .analysis.waits import wait_class

    wc = wait_class(kw)
    if wc is None or kern.empty or "local_row" not in kern.columns:
        return {}
    m = kern.drop_duplicates("row").set_index("row")[["rank", "local_row"]].reindex(wc.index)
    ok = m["rank"].notna().to_numpy()
    wc, m = wc[ok], m[ok]
    out = {}
    for r in sorted(set(m["rank"].astype(int))):
        sel = (m["rank"].astype(int) == r).to_numpy()
        part = wc[sel].copy()
        part.index = pd.Index(m.loc[sel, "local_row"].astype(np.int64).to_numpy())
        out[r] = part
    return out


def plan_window(light: list[RankTables], sw, waits: dict | None = None) -> WindowPlan:
    """The window decisions `analyze` takes on all ranks' GPU and host tables, from the reductions; adds
    its notes to `sw` in the same order. waits: `local_waits` (rank -> its kernels' waits)."""
    whole = False
    if sw.restricts and any(r.n_gpu for r in light):
        inside = sum(int(r.gpu_steps[r.gpu_steps.index.isin(sw.used)].sum()) for r in light)
        if inside == 0:
            sw.notes.append("no GPU event was launched inside the steady-state steps: GPU views read the whole window")
            whole = True
    if sw.restricts:
        in_used = sum(int(r.ops_per[r.ops_per.index.get_level_values("step").isin(sw.used)].sum()) for r in light)
        if in_used == 0 and any(r.n_ops for r in light):
            sw.notes.append("no op ran inside the steady-state steps: host views read the whole window")
    return WindowPlan(restricts=sw.restricts, used=list(sw.used), cuts=dict(sw.cuts), whole_gpu=whole,
                      waits=waits or {})


def finish(light: list[RankTables], windowed: dict[int, tuple], rt, sw, kern, inst, waits, engine: str,
           kw: pd.DataFrame | None = None) -> RanksAnalysis:
    """Assemble the result from the light reductions, the windowed figures (rank -> (timeline, categories))
    and the cross-rank pieces of `combine`; the warnings in `analyze`'s order."""
    from .analysis.comm import comm_summary, coverage, stragglers
    from .analysis.timeline import TIMELINE_COLUMNS
    from .analyzer import _mark_startup_waits, _pipeline

    light = sorted(light, key=lambda r: r.info.rank)
    warnings = list(rt.warnings)
    for r in light:
        if r.n_gpu == 0:
            warnings.append(f"{r.info.path}: CPU-only trace (no GPU kernels, memcpy or memset): GPU sections unavailable")
    for r in light:
        if r.n_gpu and not r.n_ops:
            what = "no CPU op" if r.has_host else "GPU-only trace, no CPU events"
            warnings.append(f"{r.info.path}: {what}: GPU timeline and kernels only, no op or call-tree figures")

    def cat(frames, cols=None):
        frames = [f for f in frames if f is not None and not f.empty]
        if not frames:
            return pd.DataFrame(columns=cols) if cols else pd.DataFrame()
        return pd.concat(frames, ignore_index=True)

    stl = cat([windowed[r.info.rank][3] for r in light], TIMELINE_COLUMNS)
    stl = _mark_startup_waits(stl, waits, warnings, sw)
    if not stl.empty:
        stl["steady"] = stl["step"].isin(sw.used).to_numpy() if sw.restricts else True
    n_gpu = sum(r.n_gpu for r in light)
    if n_gpu and any(r.n_ops for r in light) and not any(r.any_linked for r in light):
        warnings.append("no GPU event could be linked to a CPU op (trace lacks runtime events/correlation ids)")
    steps_any = any(not r.steps.empty for r in light)
    if steps_any and not stl.empty and sum(int(r.gpu_steps[r.gpu_steps.index < 0].sum()) for r in light) / n_gpu > 0.5:
        warnings.append("most GPU activity was launched outside the marked profiler steps")
    # pipeline: the run's jsonl, else every rank's own ranges; activity intervals per rank
    acts = [r.actions for r in light if r.actions is not None]
    if acts:
        from .analysis.pipeline import _finish

        rt.pipeline_actions = _finish(pd.concat(acts, ignore_index=True))
    else:
        from .analysis.pipeline import _empty_actions

        rt.pipeline_actions = _empty_actions()
    rt.rank_activity = {r.info.rank: r.activity for r in light if r.activity is not None}
    pipe, pipe_warnings = _pipeline(rt)
    warnings.extend(pipe_warnings)
    tl = cat([windowed[r.info.rank][0] for r in light], TIMELINE_COLUMNS)
    cats = cat([windowed[r.info.rank][1] for r in light], ["rank", "category", "count", "total_us", "pct_gpu_busy"])
    tla = cat([windowed[r.info.rank][2] for r in light], TIMELINE_COLUMNS)

    return RanksAnalysis(
        trace=rt, window=sw, timeline=tl, timeline_all=tla, step_timeline=stl, categories=cats, instances=inst,
        comm_waits=kw,
        comm_summary=comm_summary(inst), stragglers=stragglers(inst),
        coverage=coverage(rt, kern, inst), pipeline=pipe, warnings=warnings, engine=engine,
    )


# ------------------------------------------------------------------------------------ drivers


def _check_memory_limit(text: str | None) -> None:
    """A worker memory limit Dask takes ("auto", bytes or a size such as 2GB, a share of the machine's memory, 0 for
    none), checked before the cluster starts: Dask fails on a bad one in each worker process, with their tracebacks."""
    if text is None or text == "auto":
        return
    from dask.utils import parse_bytes

    try:
        n = float(text)
    except ValueError:
        try:
            n = parse_bytes(text)
        except ValueError as e:
            raise TraceError(None, f"memory limit {text!r}: not a size ({e}); e.g. 2GB") from None
    if not n >= 0 or n == float("inf"):
        raise TraceError(None, f"memory limit {text!r}: must be a size of 0 (no limit) or more; e.g. 2GB")


def _client(workers: int | None, scheduler: str | None, memory_limit: str | None):
    try:
        import dask
        from distributed import Client, LocalCluster
    except ImportError:
        raise NeedsDask(f"the distributed path needs Dask distributed: {INSTALL_HINT}") from None
    if scheduler:
        try:
            return Client(scheduler, timeout="20s"), None, f"dask scheduler {scheduler}"
        except (OSError, TimeoutError) as e:
            raise TraceError(scheduler, f"cannot reach the Dask scheduler: {e}") from None
        except ValueError as e:  # not an address (no port, unknown protocol)
            raise TraceError(scheduler, f"not a Dask scheduler address ({e}); e.g. tcp://host:8786") from None
    # a rank that kills its worker (out of memory, a crash in native code) fails at once, not after 3 retries
    _check_memory_limit(memory_limit)
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                               memory_limit=memory_limit or "auto", silence_logs=50)
    return Client(cluster), cluster, f"dask LocalCluster ({workers} worker process{'es' if workers != 1 else ''})"


def _raise_for(fut, path: str) -> None:
    """A failed task as one TraceError naming its rank file."""
    exc = fut.exception()
    if isinstance(exc, TraceError):
        raise TraceError(exc.path or path, exc.problem) from None
    name = type(exc).__name__
    if name == "KilledWorker":
        raise TraceError(path, "the Dask worker analyzing this rank died (out of memory or a crash); "
                               "see the worker's log") from None
    raise TraceError(path, f"failed on a Dask worker: {name}: {exc}") from None


def _gather(client, futs, files) -> list:
    from distributed import wait

    wait(futs)
    for f, path in zip(futs, files):
        if f.status != "finished":
            _raise_for(f, path)
    return client.gather(futs)


def analyze_ranks(paths: str | os.PathLike | Sequence[str | os.PathLike], *, workers: int | None = None,
                  scheduler: str | None = None, client: Any = None, cache: bool = True,
                  cache_dir: str | os.PathLike | None = None, window: str = "steady",
                  memory_limit: str | None = None) -> RanksAnalysis:
    """Analyze a many-rank run rank by rank (see the module docstring).

    Without workers / scheduler / client: in this process, one rank at a time (no Dask needed). workers=N:
    a Dask LocalCluster of N single-threaded worker processes (memory_limit per worker, Dask's "auto"
    by default). scheduler="tcp://host:8786": a running Dask cluster (its workers must see the same
    paths). client: a `distributed.Client` of yours. Raises TraceError (one line naming the rank file)
    for a bad file or a task that failed, NeedsDask when Dask distributed is not installed.
    """
    from .analysis.steps import ALL, STEADY
    from .io.files import discover

    if window not in (STEADY, ALL):
        raise ValueError(f"window must be 'steady' or 'all', got {window!r}")
    files = discover(paths)
    n = len(files)
    want = _wants_activity(files)
    cdir = os.fspath(cache_dir) if cache_dir else None
    clock = [time.perf_counter()]
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        now = time.perf_counter()
        timings[name] = round(now - clock[0], 3)
        clock[0] = now

    if workers is None and scheduler is None and client is None:
        full = [reduce_rank(f, i, n, cache=cache, cache_dir=cdir, want_activity=want) for i, f in enumerate(files)]
        light = [r.light() for r in full]
        lap("reduce")
        rt, sw, kern, inst, waits, _ = combine(light, files, window)
        kw = comm_waits(light, rt, kern, inst)
        plan = plan_window(light, sw, local_waits(kw, kern))
        lap("combine")
        windowed = {r.info.rank: window_rank(r, plan) for r in full}
        lap("window")
        res = finish(light, windowed, rt, sw, kern, inst, waits, "in-process", kw)
        lap("finish")
        res.timings = timings
        return res
    own = None
    if client is None:
        client, own, engine = _client(workers, scheduler, memory_limit)
    else:
        engine = "dask client"
    try:
        full = client.map(reduce_rank, files, range(n), [n] * n, cache=cache, cache_dir=cdir, want_activity=want,
                          threads=1, pure=False)  # (a worker process per CPU: one scanner thread each)
        light_f = client.map(RankTables.light, full, pure=False)
        light = _gather(client, light_f, files)
        del light_f
        lap("reduce")
        rt, sw, kern, inst, waits, _ = combine(light, files, window)
        kw = comm_waits(light, rt, kern, inst)
        plan = plan_window(light, sw, local_waits(kw, kern))
        lap("combine")
        win_f = client.map(window_rank, full, plan=plan, pure=False)
        win = _gather(client, win_f, files)
        del full, win_f
        lap("window")
        by_index = {r.index: r.info.rank for r in light}
        windowed = {by_index[i]: w for i, w in enumerate(win)}
        res = finish(light, windowed, rt, sw, kern, inst, waits, engine, kw)
        lap("finish")
        res.timings = timings
        return res
    finally:
        if own is not None or scheduler:
            client.close()
        if own is not None:
            own.close()

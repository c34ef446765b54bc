"""Pipeline-parallel schedules as measured: per-rank lanes, bubbles, stage balance, critical path.

Input is one table of pipeline *actions*, one row per forward/backward of one microbatch on one stage:

    step  rank  pp_rank  stage  microbatch  kind  start_ns  end_ns
    kind: F forward, B backward (for inputs, or the whole backward), W backward for weights (zero bubble)

It comes from the run directory's ``pipeline/rank<N>.jsonl`` files (`read_pipeline_jsonl`), or, when
those are absent, is rebuilt from ``record_function`` ranges named ``pipeline/{kind}/s{stage}/mb{mb}``
in the traces (`actions_from_trace`). Everything after loading is a pure function of that table:

    >>> from tracelens.analysis import pipeline as P
    >>> actions = P.load_pipeline_actions("runs/pp4")          # jsonl, else the trace ranges
    >>> meta = P.pipeline_meta("runs/pp4", actions)            # manifest["pipeline"], else inferred
    >>> per_step = P.bubbles(actions)                          # per (step, rank): window, busy, idle
    >>> bal = P.stage_balance(actions, meta)                   # per-stage time, slowest, critical path
    >>> print(bal.statement)       # "stage 3 is 1.40x slower than the mean: move 1 layer to stage 2"
    >>> res = P.analyze_pipeline(actions, meta)                # all of the above, warm-up step skipped

Definitions (docs/pipeline.md):
- window of a step: first action start to last action end over all ranks of that step;
- busy of a rank: the union of its action intervals in the window; idle = window - busy; bubble
  ratio = idle / window, per rank, and overall as the sum of idle over the sum of windows;
- theoretical bubble: `tracelens.analysis.bubble.bubble_ratio` for the schedule, pp, vpp and
  microbatches (from the manifest, or inferred from the actions);
- stage time: mean over microbatches of the F + B + W time of one microbatch on that stage;
- critical path: walking back from the action that ends the step, at each action the predecessor that
  finished last among its data dependency (F from the previous stage, B from the next stage, W from
  its B) and the previous action on the same rank (preferred on a tie); the stage with most compute
  on that path is the one that sets the step time.
- warm-up: when several steps exist and no step is chosen, the first step is left out (it pays for
  allocator growth, communicator set-up and kernel autotuning).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from moespec.layout import LayoutError, split_layout
from moespec.schedules import TORCH_CLASS_THEORY

from .. import categories as C
from ..errors import TraceError
from ..io.run import Run
from . import intervals as I
from . import waits as waits_mod
from .bubble import bubble_ratio
from .comm import p2p_peer_sets
from .steps import manifest_step_roles, run_manifest, steady_pipeline_step

KINDS = ("F", "B", "W")
MAX_TIME_NS = 1 << 62  # 2116 in epoch ns: a start or end at or past it is not a time (2**63-1 is a sentinel)
# stages (and pp ranks) at or past this are not a pipeline: tables sized by the stage count would not end
# (a stage of 2**63-1 made `check` spin over range(stages)); far above any real pipeline (thousands of stages)
MAX_STAGES = 1 << 16
ACTION_COLUMNS = ("step", "rank", "pp_rank", "stage", "microbatch", "kind", "start_ns", "end_ns")
RANGE_RE = re.compile(r"^pipeline/([FBW])/s(\d+)/mb(\d+)$")


def _is_range_name(name: str) -> bool:
    """A pipeline range name; False on every step marker "ProfilerStep#N" (RANGE_RE starts with 'pipeline/')."""
    return bool(RANGE_RE.match(name))


def _is_step_name(name: str) -> bool:
    """A profiler-step name (STEP_RE); True on every step marker "ProfilerStep#N" (`categories.step_marker_numbers`)."""
    return bool(C.STEP_RE.match(name))


# A stage is flagged when its time per microbatch is at least this many times the mean of all stages.
IMBALANCE_THRESHOLD = 1.10
# The module kind of each piece of the layout grammar (`moespec.layout.PIECES`, Megatron's "Et|tt|tt|tL"):
# E embedding, t transformer layer, m MTP layer, L loss/output head.
_LAYOUT_MODULES = {"E": "embedding", "t": "layer", "m": "mtp", "L": "loss"}


# ------------------------------------------------------------------------------------ loading


def _empty_actions() -> pd.DataFrame:
    df = pd.DataFrame({c: pd.Series(dtype=np.int64) for c in ACTION_COLUMNS})
    df["kind"] = pd.Categorical([], categories=list(KINDS))
    return df[list(ACTION_COLUMNS)]


def _finish(df: pd.DataFrame) -> pd.DataFrame:
    """Typed, sorted actions table with the standard columns."""
    for c in ACTION_COLUMNS:
        if c != "kind":
            df[c] = df[c].astype(np.int64)
    df["kind"] = pd.Categorical(df["kind"].astype(str), categories=list(KINDS))
    return df[list(ACTION_COLUMNS)].sort_values(["step", "rank", "start_ns", "end_ns"], kind="stable").reset_index(drop=True)


class _ActionLine(msgspec.Struct):
    """One jsonl line as msgspec decodes it in bulk (types checked in C; the rest in `_check_line`)."""

    step: int
    rank: int
    pp_rank: int
    stage: int
    microbatch: int
    kind: str
    start_ns: int
    end_ns: int


_LINES = msgspec.json.Decoder(list[_ActionLine])


def read_pipeline_jsonl(run_dir) -> pd.DataFrame | None:
    """Actions from ``RUN/pipeline/rank<N>.jsonl`` (or ``.jsonl.gz``); None when the run has no such files.

    ``run_dir``: a `tracelens.io.run.Run` (what a loaded trace carries), or a run dir's path. The files are
    read by the `Run`; this decodes them (`decode_pipeline_jsonl`).
    """
    run = run_dir if isinstance(run_dir, Run) else Run.open(run_dir)
    if not run.pipeline_files():
        return None
    return decode_pipeline_jsonl(run.pipeline_data())


def decode_pipeline_jsonl(files: list[tuple[int, Path, bytes]]) -> pd.DataFrame | None:
    """Actions from the bytes of pipeline jsonl files, (rank in the file name, file, bytes) each.

    Each line is one JSON object with the contract's keys (step, rank, pp_rank, stage, microbatch, kind,
    start_ns, end_ns). A line that is not such an object raises `TraceError` naming the file and the
    line number; blank lines are skipped. A file is decoded in one pass; only when that finds a
    problem is it read again line by line to name the first bad line. None when no file holds a line.
    """
    frames, empty = [], []
    for file_rank, path, text in files:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if not lines:
            empty.append(f"{path}: empty: rank {file_rank}'s pipeline actions are missing (its bubbles and the "
                         "stages it holds are not in the account)")
            continue
        try:
            recs = _LINES.decode(b"[" + b",".join(lines) + b"]")
        except (msgspec.DecodeError, RecursionError):  # the line-by-line pass below names the line
            recs = None
        cols = None
        if recs is not None:  # struct fields are in ACTION_COLUMNS order
            cols = {c: np.asarray(v, dtype=object if c == "kind" else None)
                    for c, v in zip(ACTION_COLUMNS, zip(*map(msgspec.structs.astuple, recs)))}
        if cols is None or not _columns_ok(cols, file_rank):
            for lineno, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    _check_line(line, f"{path}:{lineno}", file_rank)
            raise TraceError(path, "pipeline records out of range (an integer beyond 64 bits?)")
        df = pd.DataFrame(cols)
        keep, why = _one_at_a_time(df)
        if why:
            empty.append(f"{path}: {why}")
            df = df[keep]
        frames.append(df)
    if not frames:
        return None
    out = _finish(pd.concat(frames, ignore_index=True))
    out.attrs["warnings"] = empty
    return out


OVERLAP_TOLERANCE_NS = 1_000  # timestamps of consecutive actions may touch; 1 us more is an overlap
MAX_OVERLAP_DROPS = 100


def _overlaps(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """For each interval, how many others it overlaps by more than OVERLAP_TOLERANCE_NS (O(n log n))."""
    e_t = e - OVERLAP_TOLERANCE_NS
    ss, es = np.sort(s), np.sort(e)
    # j overlaps i when s_j < e_i - tol and e_j > s_i + tol
    n = np.searchsorted(ss, e_t, side="left") - np.searchsorted(es, s + OVERLAP_TOLERANCE_NS, side="right")
    self_ = (e_t > s) & (e > s + OVERLAP_TOLERANCE_NS)
    return np.maximum(n - self_.astype(np.int64), 0)


def _one_at_a_time(df: pd.DataFrame) -> tuple[np.ndarray, str | None]:
    """A rank runs one pipeline action at a time (every recorded run: no two of a rank's actions overlap), so an
    action overlapping others has a broken time (a start of 0: a 56-year action; an end 1,000 s late): the action
    overlapping the most others is left out, again until none overlap. (keep mask, the warning or None); more
    than MAX_OVERLAP_DROPS such actions is not one rank's record: `TraceError`."""
    s = df["start_ns"].to_numpy(np.int64)
    e = df["end_ns"].to_numpy(np.int64)
    keep = np.ones(len(df), dtype=bool)
    dropped = []
    while True:
        idx = np.flatnonzero(keep)
        ov = _overlaps(s[idx], e[idx])
        if not len(ov) or ov.max() == 0:
            break
        worst = idx[int(np.argmax(ov))]
        keep[worst] = False
        dropped.append(worst)
        if len(dropped) > MAX_OVERLAP_DROPS:
            raise TraceError(None, f"more than {MAX_OVERLAP_DROPS} pipeline actions of one rank overlap others: "
                                   "not the record of one rank running one action at a time")
    if not dropped:
        return keep, None
    r = df.iloc[dropped[0]]
    first = (f"step {int(r['step'])} stage {int(r['stage'])} microbatch {int(r['microbatch'])} {r['kind']}: "
             f"start_ns {int(r['start_ns'])}, end_ns {int(r['end_ns'])}")
    return keep, (f"{len(dropped)} pipeline action(s) left out: each overlaps other actions of rank "
                  f"{int(r['rank'])}, which runs one at a time (a broken time; first: {first})")


def _columns_ok(arr: dict[str, np.ndarray], file_rank: int) -> bool:
    ok = all(arr[c].dtype.kind == "i" and (arr[c] >= 0).all() for c in ACTION_COLUMNS if c != "kind")
    ok = ok and (arr["stage"] < MAX_STAGES).all() and (arr["pp_rank"] < MAX_STAGES).all()
    return bool(ok and np.isin(arr["kind"], KINDS).all() and (arr["end_ns"] >= arr["start_ns"]).all()
                and (arr["end_ns"] < MAX_TIME_NS).all() and (arr["rank"] == file_rank).all())


def _check_line(line: bytes, where: str, file_rank: int) -> None:
    """Raise `TraceError` at `where` (file:line) for the first problem of one jsonl line."""
    try:
        rec = msgspec.json.decode(line)
    except msgspec.DecodeError as e:
        raise TraceError(where, f"not valid JSON ({e})") from None
    except RecursionError:
        raise TraceError(where, "nested too deeply: not a pipeline action record") from None
    if not isinstance(rec, dict):
        raise TraceError(where, f"expected a JSON object, got {type(rec).__name__}")
    missing = [c for c in ACTION_COLUMNS if c not in rec]
    if missing:
        raise TraceError(where, f"missing key(s) {', '.join(repr(m) for m in missing)}")
    for c in ACTION_COLUMNS:
        v = rec[c]
        if c == "kind":
            if v not in KINDS:
                raise TraceError(where, f"'kind' must be one of F, B, W, got {v!r}")
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            raise TraceError(where, f"{c!r} must be an integer, got {v!r}")
        if v < 0:
            raise TraceError(where, f"{c!r} must be >= 0, got {v}")
        if c in ("start_ns", "end_ns") and v >= MAX_TIME_NS:
            raise TraceError(where, f"{c!r} {v} is not a time (at or past 2**62 ns, the year 2116)")
        if c in ("stage", "pp_rank") and v >= MAX_STAGES:
            raise TraceError(where, f"{c!r} {v} is not a pipeline stage (at most {MAX_STAGES - 1})")
    if rec["end_ns"] < rec["start_ns"]:
        raise TraceError(where, f"'end_ns' {rec['end_ns']} is before 'start_ns' {rec['start_ns']}")
    if rec["rank"] != file_rank:
        raise TraceError(where, f"'rank' is {rec['rank']} in the file of rank {file_rank}")


def actions_from_trace(trace) -> pd.DataFrame:
    """Actions rebuilt from ``pipeline/{kind}/s{stage}/mb{mb}`` ranges in a loaded `Trace`.

    On a rank whose trace has GPU copies of the ranges (``gpu_user_annotation``) those are used, as they
    time the device's work; otherwise the host ranges (``user_annotation``). Copies of one range on
    several GPU streams that overlap are merged. The k-th occurrence of a range on a rank belongs to the
    k-th step: numbered by the rank's ``ProfilerStep#N`` markers when there are enough of them, else from 0.
    pp_rank is the lowest stage a rank holds (true of GPipe, 1F1B, interleaved and V schedules).
    A trace-like object with `pipeline_actions` (every rank's, as `tracelens.scale` gathers them) gives those.
    """
    pre = getattr(trace, "pipeline_actions", None)
    if pre is not None:
        return pre
    ev = trace.events
    if ev.empty:
        return _empty_actions()
    is_ann = C.isin(ev["cat"], frozenset({"user_annotation", "gpu_user_annotation"}))
    is_pipe = C.map_strings(ev["name"], _is_range_name, on_markers=False)
    sel = ev.loc[is_ann & is_pipe, ["rank", "cat", "name", "ts", "dur"]]
    if sel.empty:
        return _empty_actions()
    sel = sel.assign(gpu=(sel["cat"].astype(str) == "gpu_user_annotation").to_numpy())
    # GPU copies on a rank only when every range of that rank has one (torch records some ranges, e.g. only
    # the backward's, on the GPU): mixing the two clocks would misplace the actions
    names_of = sel.assign(name=sel["name"].astype(str)).groupby(["rank", "gpu"])["name"].agg(frozenset)
    use_gpu = {r: bool(names_of.get((r, True)) and names_of.get((r, True)) >= names_of.get((r, False), frozenset()))
               for r in sel["rank"].unique().tolist()}
    has_gpu = sel["rank"].map(use_gpu).to_numpy(dtype=bool)
    sel = sel[sel["gpu"].to_numpy() == has_gpu]
    names = sel["name"].astype(str)
    parts = names.str.extract(RANGE_RE)
    df = pd.DataFrame({"rank": sel["rank"].to_numpy().astype(np.int64), "name": names.to_numpy(),
                       "kind": parts[0].to_numpy(), "stage": parts[1].astype(np.int64).to_numpy(),
                       "microbatch": parts[2].astype(np.int64).to_numpy(),
                       "start_ns": sel["ts"].to_numpy().astype(np.int64),
                       "end_ns": (sel["ts"] + sel["dur"].clip(lower=0)).to_numpy().astype(np.int64)})
    df = df.sort_values(["rank", "name", "start_ns"], kind="stable").reset_index(drop=True)
    # merge overlapping copies of the same range (one per GPU stream), then number the occurrences
    g = df.groupby(["rank", "name"], sort=False)
    prev_end = g["end_ns"].cummax().to_numpy()  # the latest end so far in the (rank, name) run; then shifted
    prev_end = np.r_[-1, prev_end[:-1]]
    r_, n_ = df["rank"].to_numpy(), df["name"].to_numpy()
    prev_end[np.r_[True, (r_[1:] != r_[:-1]) | (n_[1:] != n_[:-1])]] = -1  # a run's first copy
    new = df["start_ns"].to_numpy() >= prev_end
    df["occ"] = pd.Series(new.astype(np.int64)).groupby([df["rank"], df["name"]]).cumsum().to_numpy() - 1
    df = df.groupby(["rank", "name", "occ"], as_index=False, sort=False).agg(
        kind=("kind", "first"), stage=("stage", "first"), microbatch=("microbatch", "first"),
        start_ns=("start_ns", "min"), end_ns=("end_ns", "max"))
    step_names = C.map_strings(ev["name"], _is_step_name, on_markers=True) & C.isin(ev["cat"], C.ANNOTATION_CATS)
    markers = ev.loc[step_names, ["rank", "name", "ts"]]
    step_no: dict[int, list[int]] = {}
    for r, mk in markers.groupby("rank"):
        nums = mk.sort_values("ts", kind="stable")["name"].astype(str).map(lambda s: int(C.STEP_RE.match(s).group(1)))
        step_no[int(r)] = list(dict.fromkeys(nums.tolist()))  # in time order, each once
    steps = np.empty(len(df), dtype=np.int64)
    for r, idx in df.groupby("rank").indices.items():
        occ = df["occ"].to_numpy()[idx]
        nums = step_no.get(int(r), [])
        steps[idx] = np.asarray(nums, dtype=np.int64)[occ] if len(nums) > occ.max() else occ
    df["step"] = steps
    df["pp_rank"] = df.groupby("rank")["stage"].transform("min")
    return _finish(df)


def load_pipeline_actions(source, *, cache: bool = True) -> pd.DataFrame:
    """Actions from a run dir's jsonl files, else from the pipeline ranges of its traces.

    source: a run directory, a trace directory or file, or a loaded `tracelens.trace.Trace`. Raises
    `TraceError` when neither holds pipeline data.
    """
    return _actions_and_trace(source, cache=cache)[0]


def _actions_and_trace(source, *, cache: bool = True):
    """(actions, the Trace they were rebuilt from or None when they come from the jsonl)."""
    if not isinstance(source, (str, os.PathLike)):
        df = actions_from_trace(source)
        if df.empty:
            raise TraceError(None, "no pipeline data: the traces have no 'pipeline/{F|B|W}/s<stage>/mb<n>' ranges")
        return df, source
    p = Path(source)
    if not p.exists():
        raise TraceError(p, "no such file or directory")
    if p.is_dir():
        run = Run.open(p)
        # only p's own pipeline/ (a run dir's traces/ given alone: its actions are rebuilt from the ranges)
        if run.pipeline_dir is not None and run.pipeline_dir.parent == p:
            df = read_pipeline_jsonl(run)
            if df is not None:
                return df, None
    from ..trace import discover, load

    try:
        discover(p)
    except TraceError:
        raise TraceError(p, "no pipeline data: no pipeline/rank<N>.jsonl and no trace files to rebuild it from") from None
    trace = load(p, cache=cache, progress=False)
    df = actions_from_trace(trace)
    if df.empty:
        raise TraceError(p, "no pipeline data: no pipeline/rank<N>.jsonl, and the traces have no "
                            "'pipeline/{F|B|W}/s<stage>/mb<n>' ranges")
    return df, trace


# ------------------------------------------------------------------------------------ metadata


@dataclass
class PipelineMeta:
    """What the analysis knows about the pipeline set-up; `inferred` lists fields guessed from actions."""

    pp: int
    vpp: int
    microbatches: int
    schedule: str
    torch_schedule: str = ""
    layout: str = ""
    stage_layers: list[list[int]] | None = None
    stage_modules: list[list[str]] | None = None
    stage_to_rank: list[int] | None = None
    inferred: list[str] = field(default_factory=list)

    @property
    def n_stages(self) -> int:
        return self.pp * self.vpp

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("pp", "vpp", "microbatches", "schedule", "torch_schedule", "layout",
                                              "stage_layers", "stage_modules", "stage_to_rank", "inferred")}


def parse_layout(layout: str) -> list[list[str]]:
    """Modules per stage from a Megatron-style layout string, by the trainer's grammar
    (`moespec.layout.split_layout`; spaces ignored), checking only the grammar and that no stage is empty.

    ``"Et|tt|tt|tL"`` -> [["embedding", "layer"], ["layer", "layer"], ...]. Supports repetition of a
    letter (``t*3``) or a group (``(tt|)*2``); letters E embedding, t layer, m MTP layer, L loss.
    """
    try:
        stages = split_layout(layout.replace(" ", "") if isinstance(layout, str) else layout)
    except LayoutError as e:
        raise TraceError(None, f"layout {layout!r}: {e}") from None
    for i, s in enumerate(stages):
        if not s:
            raise TraceError(None, f"layout {layout!r}: stage {i} is empty")
    return [[_LAYOUT_MODULES[ch] for ch in s] for s in stages]


def _int_field(pipe: dict, key: str, where: Path) -> int:
    v = pipe.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise TraceError(where, f"pipeline.{key} must be an integer >= 1, got {v!r}")
    return v


def _schedule_name(schedule: str, torch_schedule: str) -> str:
    s = (schedule or "").strip().lower()
    if s:
        return s
    return TORCH_CLASS_THEORY.get((torch_schedule or "").strip().lower(), "")


def infer_meta(actions: pd.DataFrame) -> PipelineMeta:
    """pp, vpp, microbatches and schedule read off the actions (no manifest).

    pp = number of distinct pp_ranks; vpp = stages / pp; microbatches = most distinct microbatches any
    rank runs in a step; schedule: any W action -> "zbv" when rank 0 also holds the last stage (V shape)
    else "zb1p"; vpp > 1 -> "vpp"; all forwards before all backwards on every rank -> "gpipe"; else "1f1b".
    """
    if actions.empty:
        raise TraceError(None, "no pipeline actions to infer the pipeline set-up from")
    top = int(actions["stage"].max())
    if top >= MAX_STAGES:  # a pipeline range of a trace (pipeline/F/s<N>/...) read with an absurd stage number
        raise TraceError(None, f"a pipeline action of stage {top}: not a pipeline stage (at most {MAX_STAGES - 1})")
    pp = int(actions["pp_rank"].nunique())
    n_stages = int(actions["stage"].max()) + 1
    vpp = max(1, n_stages // pp)
    m = int(actions.groupby(["step", "rank"])["microbatch"].nunique().max())
    s2r = _stage_to_pp_rank(actions, n_stages)
    if (actions["kind"] == "W").any():
        schedule = "zbv" if vpp == 2 and s2r[-1] == s2r[0] else "zb1p"
    elif vpp > 1:
        schedule = "vpp"
    else:
        first_b = actions[actions["kind"] == "B"].groupby(["step", "rank"])["start_ns"].min()
        last_f = actions[actions["kind"] == "F"].groupby(["step", "rank"])["start_ns"].max()
        both = pd.concat([first_b.rename("b"), last_f.rename("f")], axis=1).dropna()
        schedule = "gpipe" if len(both) and (both["f"] < both["b"]).all() else "1f1b"
    return PipelineMeta(pp=pp, vpp=vpp, microbatches=m, schedule=schedule, stage_to_rank=s2r,
                        inferred=["pp", "vpp", "microbatches", "schedule", "stage_to_rank"])


def _stage_to_pp_rank(actions: pd.DataFrame, n_stages: int) -> list[int]:
    owner = actions.groupby("stage")["pp_rank"].agg(lambda x: int(x.mode().iloc[0]))
    return [int(owner.get(s, -1)) for s in range(n_stages)]


def pipeline_meta(run_dir, actions: pd.DataFrame) -> PipelineMeta:
    """The manifest's ``pipeline`` object (validated), else `infer_meta`; fields absent from the
    manifest are inferred. ``run_dir``: a `tracelens.io.run.Run`, a run dir's path, or None. Bad manifest
    values raise `TraceError` naming manifest.json and the key."""
    inferred = infer_meta(actions)
    if run_dir is None:
        return inferred
    run = run_dir if isinstance(run_dir, Run) else Run.open(run_dir)
    mf = run.manifest_path
    if mf is None:
        return inferred
    if run.manifest is None and run.manifest_error and run.manifest_error[0]:
        raise TraceError(mf, f"unreadable manifest ({run.manifest_error[1]})") from None
    doc = run.manifest
    pipe = doc.get("pipeline") if isinstance(doc, dict) else None
    if pipe is None:
        return inferred
    if not isinstance(pipe, dict):
        raise TraceError(mf, f"'pipeline' must be an object, got {type(pipe).__name__}")
    out = PipelineMeta(pp=inferred.pp, vpp=inferred.vpp, microbatches=inferred.microbatches,
                       schedule=inferred.schedule, stage_to_rank=inferred.stage_to_rank, inferred=[])
    for key in ("pp", "vpp", "microbatches"):
        if key in pipe:
            setattr(out, key, _int_field(pipe, key, mf))
        else:
            out.inferred.append(key)
    for key in ("schedule", "torch_schedule", "layout"):
        v = pipe.get(key, "")
        if not isinstance(v, str):
            raise TraceError(mf, f"pipeline.{key} must be a string, got {v!r}")
        setattr(out, key, v)
    name = _schedule_name(out.schedule, out.torch_schedule)
    if name:
        out.schedule = name
    else:
        out.schedule = inferred.schedule
        out.inferred.append("schedule")
    n_stages = out.pp * out.vpp
    for key in ("stage_layers", "stage_modules"):
        v = pipe.get(key)
        if v is None:
            continue
        if not (isinstance(v, list) and all(isinstance(x, list) for x in v)) or len(v) != n_stages:
            raise TraceError(mf, f"pipeline.{key} must be a list of {n_stages} lists (one per stage), got {str(v)[:80]}")
        setattr(out, key, v)
    s2r = pipe.get("stage_to_rank")
    if s2r is not None:
        if not (isinstance(s2r, list) and len(s2r) == n_stages and all(isinstance(x, int) for x in s2r)):
            raise TraceError(mf, f"pipeline.stage_to_rank must be a list of {n_stages} integers, got {str(s2r)[:80]}")
        out.stage_to_rank = s2r
    else:
        out.inferred.append("stage_to_rank")
    if out.stage_modules is None and out.layout:
        try:
            mods = parse_layout(out.layout)
        except TraceError as e:
            raise TraceError(mf, f"pipeline.layout: {e.problem}") from None
        if len(mods) == n_stages:
            out.stage_modules = mods
    return out


# ------------------------------------------------------------------------------------ steps


def select_steps(actions: pd.DataFrame, step: int | None = None,
                 manifest: dict | None = None) -> tuple[pd.DataFrame, list[int], list[int]]:
    """(actions of the analyzed steps, analyzed step numbers, steps skipped).

    step given: that step only (`TraceError` if absent). Otherwise every step but the first when there
    are two or more (the first is warm-up), and but the steps the run's manifest marks as warm-up or as
    the trace-export step (`steps.manifest_step_roles`: the step in which the profiler stops and writes
    its trace, 2x the others on the 4-GPU fixtures), as the rest of the analyzer leaves them out; when
    that would leave no step, those are kept.
    """
    all_steps = sorted(actions["step"].unique().tolist())
    if not all_steps:
        raise TraceError(None, "empty window: no pipeline actions")
    if step is not None:
        if step not in all_steps:
            raise TraceError(None, f"step {step} is not in the pipeline data (steps {_ranges(all_steps)})")
        return actions[actions["step"] == step], [step], []
    skipped = all_steps[:1] if len(all_steps) > 1 else []
    roles = manifest_step_roles(manifest)
    more = [s for s in all_steps if s in roles and s not in skipped]
    if [s for s in all_steps if s not in skipped and s not in more]:
        skipped = sorted(skipped + more)
    keep = [s for s in all_steps if s not in skipped]
    return actions[actions["step"].isin(keep)], keep, skipped


def skip_reasons(skipped: list[int], manifest: dict | None) -> str:
    """'step 0 (warm-up), 5 (trace export)': why the analyzed window leaves those steps out."""
    roles = manifest_step_roles(manifest)
    if not any(s in roles for s in skipped):
        return ""
    names = {"warmup": "warm-up", "export": "trace export"}
    return ", ".join(f"{s} ({names.get(roles[s][0], roles[s][0]) if s in roles else 'warm-up'})" for s in skipped)


def _ranges(nums: list[int]) -> str:
    """[0,1,2,5] -> '0-2, 5'."""
    out = []
    for n in nums:
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def check_actions(actions: pd.DataFrame, meta: PipelineMeta | None = None) -> list[str]:
    """Warnings about inconsistent data: ranks that disagree on the microbatches of a step, a step some
    rank has no actions in, duplicate actions, stage or microbatch counts that differ from the manifest."""
    warns: list[str] = []
    nmb = actions.groupby(["step", "rank"])["microbatch"].nunique().rename("mb").reset_index()
    for s, g in nmb.groupby("step"):
        if g["mb"].nunique() > 1:
            detail = ", ".join(f"rank {int(r)}: {int(m)}" for r, m in zip(g["rank"], g["mb"]))
            warns.append(f"step {s}: ranks disagree on the number of microbatches ({detail})")
            if len(warns) >= 5:
                warns.append("further microbatch disagreements not listed")
                break
    all_ranks = set(actions["rank"].unique().tolist())
    for s, ranks in actions.groupby("step")["rank"].unique().items():
        missing = sorted(all_ranks - set(ranks.tolist()))
        if missing:
            warns.append(f"step {s}: no actions from rank(s) {', '.join(map(str, missing))}")
            break  # once is enough: usually a run stopped mid-step
    dup = actions.duplicated(["step", "rank", "stage", "microbatch", "kind"])
    if dup.any():
        warns.append(f"{int(dup.sum())} action(s) appear more than once for the same step, rank, stage, microbatch and kind")
    if meta is not None and "pp" not in meta.inferred:
        n_stages = int(actions["stage"].max()) + 1
        if n_stages != meta.n_stages:
            warns.append(f"the manifest says pp={meta.pp} x vpp={meta.vpp} = {meta.n_stages} stages, the actions have {n_stages}")
        if "microbatches" not in meta.inferred:
            seen = int(nmb["mb"].max())
            if seen != meta.microbatches:
                warns.append(f"the manifest says {meta.microbatches} microbatches per step, the actions have {seen}")
    return warns


# ------------------------------------------------------------------------------------ bubbles


def step_windows(actions: pd.DataFrame) -> pd.DataFrame:
    """Per step: window_start_ns (first start over all ranks), window_end_ns (last end), window_ns."""
    steps, at = np.unique(actions["step"].to_numpy(), return_inverse=True)
    at = at.reshape(-1)
    lo = np.full(len(steps), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(lo, at, actions["start_ns"].to_numpy(np.int64))
    hi = np.full(len(steps), np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(hi, at, actions["end_ns"].to_numpy(np.int64))
    return pd.DataFrame({"step": steps, "window_start_ns": lo, "window_end_ns": hi, "window_ns": hi - lo})


@dataclass
class _Lanes:
    """Each (step, rank) lane's actions sorted by start, with the union's shape computed in bulk."""

    keys: pd.DataFrame  # one row per lane: step, rank, pp_rank, actions, first_start, last_end, window
    gap_lane: np.ndarray  # per idle gap between actions: its lane, start and end
    gap_start: np.ndarray
    gap_end: np.ndarray


def _lanes(actions: pd.DataFrame) -> _Lanes:
    a = actions.sort_values(["step", "rank", "start_ns", "end_ns"], kind="stable")
    step, rank = a["step"].to_numpy(), a["rank"].to_numpy()
    start, end = a["start_ns"].to_numpy(np.int64), a["end_ns"].to_numpy(np.int64)
    first = np.r_[True, (step[1:] != step[:-1]) | (rank[1:] != rank[:-1])]
    lane = np.cumsum(first) - 1
    run_end = pd.Series(end).groupby(lane).cummax().to_numpy()  # latest end so far in the lane
    gap = np.r_[False, ~first[1:] & (start[1:] > run_end[:-1])]
    last = np.r_[np.flatnonzero(first)[1:] - 1, len(a) - 1]
    keys = pd.DataFrame({"step": step[first], "rank": rank[first], "pp_rank": a["pp_rank"].to_numpy()[first],
                         "actions": np.diff(np.r_[np.flatnonzero(first), len(a)]),
                         "first_start": start[first], "last_end": run_end[last]})
    win = step_windows(actions).set_index("step")
    keys["window_start_ns"] = win["window_start_ns"].reindex(keys["step"]).to_numpy()
    keys["window_end_ns"] = win["window_end_ns"].reindex(keys["step"]).to_numpy()
    gi = np.flatnonzero(gap)
    return _Lanes(keys, lane[gi], run_end[gi - 1], start[gi])


def bubbles(actions: pd.DataFrame) -> pd.DataFrame:
    """Per (step, rank): window, busy (union of the rank's actions), idle and bubble ratio, with the idle
    split into lead (before the rank's first action), inner (between actions) and tail (after its last)."""
    cols = ["step", "rank", "pp_rank", "window_start_ns", "window_end_ns", "window_ns", "busy_ns", "idle_ns",
            "lead_ns", "inner_ns", "tail_ns", "bubble_ratio", "actions"]
    if actions.empty:
        return pd.DataFrame(columns=cols)
    ln = _lanes(actions)
    k = ln.keys
    inner = np.bincount(ln.gap_lane, weights=ln.gap_end - ln.gap_start, minlength=len(k)).astype(np.int64)
    out = k[["step", "rank", "pp_rank", "window_start_ns", "window_end_ns"]].copy()
    out["window_ns"] = out["window_end_ns"] - out["window_start_ns"]
    out["busy_ns"] = (k["last_end"] - k["first_start"]).to_numpy() - inner
    out["idle_ns"] = out["window_ns"] - out["busy_ns"]
    out["lead_ns"] = k["first_start"] - k["window_start_ns"]
    out["inner_ns"] = inner
    out["tail_ns"] = k["window_end_ns"] - k["last_end"]
    out["bubble_ratio"] = out["idle_ns"] / out["window_ns"].where(out["window_ns"] > 0)
    out["actions"] = k["actions"]
    return out[cols].reset_index(drop=True)


def bubble_gaps(actions: pd.DataFrame) -> pd.DataFrame:
    """Every idle interval of every rank inside its step's window (lead, inner and tail gaps):
    step, rank, start_ns, end_ns, where ('lead' | 'inner' | 'tail')."""
    cols = ["step", "rank", "start_ns", "end_ns", "where"]
    if actions.empty:
        return pd.DataFrame(columns=cols)
    ln = _lanes(actions)
    k = ln.keys
    lead = k[k["first_start"] > k["window_start_ns"]]
    tail = k[k["last_end"] < k["window_end_ns"]]
    parts = [
        pd.DataFrame({"step": lead["step"], "rank": lead["rank"], "start_ns": lead["window_start_ns"],
                      "end_ns": lead["first_start"], "where": "lead"}),
        pd.DataFrame({"step": k["step"].to_numpy()[ln.gap_lane], "rank": k["rank"].to_numpy()[ln.gap_lane],
                      "start_ns": ln.gap_start, "end_ns": ln.gap_end, "where": "inner"}),
        pd.DataFrame({"step": tail["step"], "rank": tail["rank"], "start_ns": tail["last_end"],
                      "end_ns": tail["window_end_ns"], "where": "tail"}),
    ]
    out = pd.concat([p for p in parts if len(p)], ignore_index=True) if any(len(p) for p in parts) else pd.DataFrame(columns=cols)
    return out[cols].sort_values(["step", "rank", "start_ns"], kind="stable").reset_index(drop=True)


def rank_bubbles(per_step: pd.DataFrame, theory: float = math.nan) -> pd.DataFrame:
    """Per rank over the given steps: window, busy, idle (sums) and bubble ratio = idle / window,
    next to the theoretical ratio."""
    g = per_step.groupby(["rank", "pp_rank"], as_index=False)[["window_ns", "busy_ns", "idle_ns", "lead_ns", "inner_ns",
                                                               "tail_ns"]].sum()
    g["steps"] = per_step.groupby(["rank", "pp_rank"]).size().to_numpy()
    g["bubble_ratio"] = g["idle_ns"] / g["window_ns"].where(g["window_ns"] > 0)
    g["theory_ratio"] = theory
    return g


def theoretical_bubble(meta: PipelineMeta) -> tuple[float, str]:
    """(ratio, note). NaN with a note when the schedule is unknown or not modelled."""
    try:
        r = bubble_ratio(meta.schedule, meta.pp, meta.microbatches, meta.vpp)
    except TraceError as e:
        return math.nan, e.problem
    if math.isnan(r):
        return r, f"{meta.schedule} with {meta.microbatches} microbatches < 2 x pp is not modelled"
    return r, ""


# ------------------------------------------------------------------------------------ stage balance


@dataclass
class StageBalance:
    """Per-stage compute and what to do about the slowest stage."""

    table: pd.DataFrame  # one row per stage
    slowest_stage: int
    slowest_ratio: float  # its time per microbatch / mean over stages
    critical_stage: int  # most compute on the critical path
    flagged: bool  # slowest_ratio >= IMBALANCE_THRESHOLD
    move: dict[str, Any] | None  # {"layers": k, "from": s, "to": n, "layer_ns": .., "bottleneck_before_ns", "after"}
    statement: str
    critical_path: pd.DataFrame = field(default_factory=pd.DataFrame)


def critical_path(actions: pd.DataFrame) -> pd.DataFrame:
    """The chain of actions that sets each step's time (see the module docstring), in time order per
    step, with `wait_ns`: the gap between the predecessor's end and the action's start (transfer or
    scheduling delay). Ranks running the same pp_rank are separate data-parallel pipelines, paired by
    rank order (the k-th rank of each pp_rank forms pipeline k)."""
    if actions.empty:
        return actions.assign(wait_ns=pd.Series(dtype=np.int64))
    a = actions.sort_values(["step", "rank", "start_ns", "end_ns"], kind="stable").reset_index(drop=True)
    ranks = a[["rank", "pp_rank"]].drop_duplicates("rank").sort_values("rank", kind="stable")
    replica_of = dict(zip(ranks["rank"].tolist(), ranks.groupby("pp_rank").cumcount().tolist()))
    # an action's identity (step, pipeline, stage, microbatch, kind) as one integer, for fast look-ups
    step_i = pd.factorize(a["step"])[0].astype(np.int64)
    replica_i = a["rank"].map(replica_of).to_numpy(np.int64)
    stage_i, mb_i = a["stage"].to_numpy(np.int64), a["microbatch"].to_numpy(np.int64)
    kind_i = pd.Categorical(a["kind"].astype(str), categories=list(KINDS)).codes.astype(np.int64)  # F 0, B 1, W 2
    n_rep, n_stage, n_mb = int(replica_i.max()) + 1, int(stage_i.max()) + 2, int(mb_i.max()) + 1

    def code(st, rp, s, m, k):
        return (((st * n_rep + rp) * n_stage + s) * n_mb + m) * 3 + k

    index = dict(zip(code(step_i, replica_i, stage_i, mb_i, kind_i).tolist(), range(len(a))))
    step, replica, stage, mb = step_i.tolist(), replica_i.tolist(), stage_i.tolist(), mb_i.tolist()
    kind = a["kind"].astype(str).tolist()
    start, end = a["start_ns"].tolist(), a["end_ns"].tolist()
    last_stage = int(stage_i.max())
    same_lane = np.r_[False, (a["step"].to_numpy()[1:] == a["step"].to_numpy()[:-1])
                      & (a["rank"].to_numpy()[1:] == a["rank"].to_numpy()[:-1])]
    prev_on_rank = np.where(same_lane, np.arange(len(a)) - 1, -1).tolist()

    def predecessors(i: int) -> list[int]:
        st, rp, s, m, k = step[i], replica[i], stage[i], mb[i], kind[i]
        if k == "F":
            keys = [code(st, rp, s - 1, m, 0)] if s > 0 else []
        elif k == "B":
            keys = [code(st, rp, s, m, 0)] + ([code(st, rp, s + 1, m, 1)] if s < last_stage else [])
        else:
            keys = [code(st, rp, s, m, 1)]
        out = [index[key] for key in keys if key in index]
        if prev_on_rank[i] >= 0:
            out.append(prev_on_rank[i])
        return out

    rows, waits = [], []
    last_of_step = a.groupby("step")["end_ns"].idxmax()
    for cur in last_of_step.tolist():
        path: list[tuple[int, int]] = []
        seen: set[int] = set()
        while True:
            seen.add(cur)
            prev = prev_on_rank[cur]
            cands = [j for j in predecessors(cur) if end[j] <= end[cur] and j not in seen]
            # the latest-finishing predecessor; on a tie the rank's own previous action (the rank was busy)
            nxt = max(cands, key=lambda j: (end[j], j == prev, start[j])) if cands else None
            path.append((cur, max(0, start[cur] - end[nxt]) if nxt is not None else 0))
            if nxt is None:
                break
            cur = nxt
        path.reverse()
        rows += [i for i, _ in path]
        waits += [w for _, w in path]
    out = a.iloc[rows].reset_index(drop=True)
    out["wait_ns"] = np.asarray(waits, dtype=np.int64)
    return out


def stage_layout(meta: PipelineMeta | str | None, n_stages: int) -> tuple[list[int] | None, list[list[str]] | None]:
    """(transformer layers per stage, modules per stage) from PipelineMeta or a layout string."""
    if meta is None:
        return None, None
    if isinstance(meta, str):
        mods = parse_layout(meta)
        if len(mods) != n_stages:
            raise TraceError(None, f"layout {meta!r} has {len(mods)} stages, the actions have {n_stages}")
        return [sum(1 for x in m if x in ("layer", "mtp")) for m in mods], mods
    mods = meta.stage_modules
    if meta.stage_layers is not None and len(meta.stage_layers) == n_stages:
        layers = [len(x) for x in meta.stage_layers]
    elif mods is not None and len(mods) == n_stages:
        layers = [sum(1 for x in m if _is_layer_module(x)) for m in mods]
    else:
        layers = None
    if mods is not None and len(mods) != n_stages:
        mods = None
    return layers, mods


def _is_layer_module(name: Any) -> bool:
    s = str(name).lower()
    return s.startswith(("layer", "mtp")) or s in ("t", "m")


def stage_balance(actions: pd.DataFrame, layout: PipelineMeta | str | None = None) -> StageBalance:
    """Per-stage mean compute per microbatch (F + B + W), ratio to the mean of stages, the slowest stage,
    the stage with most compute on the critical path, and a recommendation.

    layout: `PipelineMeta` (stage_layers / stage_modules), a Megatron layout string, or None. With layer
    counts, the number of layers k to move from the slowest stage to a neighbour is the one that most
    lowers the busiest pipeline rank's load (the sum of its stages' times; the slowest stage when each
    rank holds one), with a layer costing the per-layer time of the slowest stage (or of a neighbour
    holding only layers, when the slowest stage also holds the embedding or the loss head).
    Without them the statement gives only the ratio.
    """
    if actions.empty:
        raise TraceError(None, "empty window: no pipeline actions to balance")
    n_stages = int(actions["stage"].max()) + 1
    # one sample = one microbatch of one step on one rank; a kind it lacks counts as 0
    dur = (actions["end_ns"] - actions["start_ns"]).astype(np.float64)
    samples = actions.drop_duplicates(["step", "stage", "microbatch", "rank"]).groupby("stage").size()
    by_kind = dur.groupby([actions["stage"], actions["kind"]], observed=False).sum().unstack("kind").reindex(
        columns=list(KINDS), fill_value=0.0).fillna(0.0)
    stage_mean = by_kind.div(samples, axis=0)
    stage_mean["total"] = stage_mean[list(KINDS)].sum(axis=1)
    n_mb = actions.drop_duplicates(["stage", "microbatch"]).groupby("stage").size()
    owner = actions.groupby("stage")["pp_rank"].agg(lambda x: int(x.mode().iloc[0]))
    tab = pd.DataFrame({"stage": np.arange(n_stages)})
    tab["pp_rank"] = [int(owner.get(s, -1)) for s in range(n_stages)]
    for k, col in (("F", "f_ns"), ("B", "b_ns"), ("W", "w_ns"), ("total", "total_ns")):
        tab[col] = [float(stage_mean.at[s, k]) if s in stage_mean.index else math.nan for s in range(n_stages)]
    if not (actions["kind"] == "W").any():
        tab["w_ns"] = math.nan  # the schedule does not split the backward
    tab["microbatches"] = [int(n_mb.get(s, 0)) for s in range(n_stages)]
    mean = float(np.nanmean(tab["total_ns"]))
    tab["ratio_to_mean"] = tab["total_ns"] / mean if mean > 0 else math.nan
    layers, mods = stage_layout(layout, n_stages)
    tab["layers"] = layers if layers is not None else [None] * n_stages
    tab["modules"] = [" ".join(str(x) for x in m) for m in mods] if mods is not None else [""] * n_stages
    tab["layer_ns"] = [t / n if n else math.nan for t, n in zip(tab["total_ns"], layers)] if layers else math.nan

    cp = critical_path(actions)
    n_steps = max(1, actions["step"].nunique())
    cp_stage = cp.assign(dur=cp["end_ns"] - cp["start_ns"]).groupby("stage")["dur"].sum()
    tab["critical_ns"] = [float(cp_stage.get(s, 0)) / n_steps for s in range(n_stages)]
    cp_total = float(cp_stage.sum())
    tab["critical_share"] = tab["critical_ns"] * n_steps / cp_total if cp_total > 0 else 0.0

    slowest = int(tab["total_ns"].idxmax())
    ratio = float(tab.at[slowest, "ratio_to_mean"])
    critical = int(tab["critical_ns"].idxmax())
    flagged = ratio >= IMBALANCE_THRESHOLD
    move = _layer_move(tab, slowest, layers, mods) if flagged and layers is not None else None
    statement = _statement(tab, slowest, ratio, critical, flagged, move, layers is not None)
    return StageBalance(table=tab, slowest_stage=slowest, slowest_ratio=ratio, critical_stage=critical, flagged=flagged,
                        move=move, statement=statement, critical_path=cp)


def _layer_move(tab: pd.DataFrame, s: int, layers: list[int], mods: list[list[str]] | None) -> dict[str, Any] | None:
    """Best k layers to move from stage s to one neighbouring stage.

    A pipeline rank runs all its stages' work for every microbatch, so the figure to lower is the
    busiest rank's load: the sum of the times of the stages it holds (with one stage per rank, simply
    the slowest stage). Moving layers between two stages of the same rank changes nothing.
    """
    t = tab["total_ns"].to_numpy(dtype=np.float64)
    owner = tab["pp_rank"].to_numpy()
    n_s = layers[s]
    if n_s <= 0:
        return None

    def pure(i: int) -> bool:  # holds only transformer layers
        return mods is None or all(_is_layer_module(x) for x in mods[i])

    def busiest(times: np.ndarray) -> float:
        return float(pd.Series(times).groupby(owner).sum().max())

    neighbours = [n for n in (s - 1, s + 1) if 0 <= n < len(t)]
    if pure(s) or not mods:
        layer_ns = t[s] / n_s
    else:
        clean = [t[n] / layers[n] for n in neighbours if layers[n] > 0 and pure(n)]
        layer_ns = float(np.mean(clean)) if clean else t[s] / n_s
    before = busiest(t)
    best = None
    keep_min = 1  # a stage keeps at least one transformer layer (as the automatic layout gives every stage)
    for n in neighbours:
        for k in range(1, n_s - keep_min + 1):
            new = t.copy()
            new[s] -= k * layer_ns
            new[n] += k * layer_ns
            after = busiest(new)
            if best is None or after < best["bottleneck_after_ns"] - 1e-9 * before:
                best = {"layers": k, "from": s, "to": n, "layer_ns": layer_ns, "bottleneck_before_ns": before,
                        "bottleneck_after_ns": after, "from_after_ns": float(new[s]), "to_after_ns": float(new[n])}
    if best is None or best["bottleneck_after_ns"] >= before * 0.99:
        # the non-layer pieces the stage holds (embedding, loss head) and what they cost beyond its layers
        extra = [x for x in (mods[s] if mods else []) if not _is_layer_module(x)]
        return {"layers": 0, "from": s, "to": None, "layer_ns": layer_ns, "bottleneck_before_ns": before,
                "bottleneck_after_ns": before, "stage_layers": int(n_s), "extra_modules": extra,
                "extra_ns": max(float(t[s]) - n_s * layer_ns, 0.0) if extra else 0.0}
    return best


def _statement(tab, slowest, ratio, critical, flagged, move, has_layout) -> str:
    crit = (f"; stage {critical} has the most compute on the critical path"
            + (f" ({100 * tab.at[critical, 'critical_share']:.0f}%)" if tab.at[critical, "critical_share"] else ""))
    if not flagged:
        return f"stages are balanced: the slowest, stage {slowest}, is {ratio:.2f}x the mean{crit}"
    head = f"stage {slowest} is {ratio:.2f}x slower than the mean"
    if not has_layout:
        return f"{head} (no layer layout known, so no layer move is suggested){crit}"
    one_stage_per_rank = tab["pp_rank"].is_unique
    what = "slowest stage" if one_stage_per_rank else "busiest pipeline rank"
    if move is None or not move["layers"]:
        per = fmt_ns(move["layer_ns"]) if move else "?"
        n_l = (move or {}).get("stage_layers")
        if n_l == 1:  # no layer can leave it: say what would help instead
            extra = move.get("extra_modules") or []
            piece = " and ".join({"loss": "the loss head", "embedding": "the embedding"}.get(str(x), str(x)) for x in extra)
            cost = f" (≈ {fmt_ns(move['extra_ns'])} per microbatch beyond its layer)" if extra and move.get("extra_ns") else ""
            help_ = (f"; it holds a single layer{' and ' + piece + cost if piece else ''}, which no layer move can "
                     "lower: give every other stage more layers (fewer pipeline stages, pp or vpp, or more layers "
                     "per stage)" + (f", or make {piece} cheaper (fused or chunked loss)" if "loss" in extra else ""))
            return f"{head}{help_} (one layer ≈ {per}){crit}"
        return (f"{head}: moving whole layers to a neighbour would not lower the {what} "
                f"(one layer ≈ {per}){crit}")
    k = move["layers"]
    return (f"{head}: move {k} layer{'s' if k > 1 else ''} to stage {move['to']} "
            f"(≈ {fmt_ns(move['layer_ns'])} per layer per microbatch; {what} "
            f"{fmt_ns(move['bottleneck_before_ns'])} -> {fmt_ns(move['bottleneck_after_ns'])}){crit}")


def fmt_ns(ns: float) -> str:
    """A duration with a readable unit: '1.234 ms', '12.3 µs', '850 ns'."""
    if ns is None or (isinstance(ns, float) and math.isnan(ns)):
        return "–"
    if abs(ns) >= 1e6:
        return f"{ns / 1e6:.3f} ms"
    if abs(ns) >= 1e3:
        return f"{ns / 1e3:.1f} µs"
    return f"{ns:.0f} ns"


# ------------------------------------------------------------------------------------ bubble account

# The parts a rank's idle time is split into, in this order (they add up to the measured idle exactly).
ACCOUNT_PARTS = ("theory", "imbalance", "comm", "host", "other")
ACCOUNT_LABELS = {"theory": "schedule theory", "imbalance": "stage imbalance", "comm": "p2p / comm wait",
                  "host": "host / launch overhead", "other": "other"}
# Host-side events that are communication: c10d ops (send, recv_, wait, allreduce_, ...), the backends'
# ranges (nccl:*, gloo:*, ...) and the profiler's record of a collective.
_HOST_COMM_RE = re.compile(r"^(c10d::|c10d_|nccl:|rccl:|gloo:|mpi:|ucc:|record_param_comms)", re.IGNORECASE)
_HOST_BUSY_CATS = C.OP_CATS | C.RUNTIME_CATS | C.PYTHON_CATS
# What the trace shows during a critical-path wait, in order of precedence, and the part each goes to.
WAIT_CLASSES = {
    "comm_wait_gpu": "comm",  # a point-to-point kernel on the rank's GPU spinning until its peer posts its side
                              # (the sender or receiver was late: tracelens.analysis.waits), not moving data
    "comm_gpu": "comm",      # a communication kernel (NCCL/RCCL p2p or collective) running on the rank's GPU
    "gpu_other": "other",    # other GPU work outside the pipeline actions
    "comm_host": "comm",     # GPU idle, the host inside a send/recv/wait or collective call
    "host_ops": "host",      # GPU idle, the host inside other ops / runtime calls (launching)
    "host_python": "host",   # GPU idle, the host between recorded ops (Python, the schedule's own code)
    "before_trace": "host",  # before the rank's trace begins, ending inside it: the rank entered the profiled
                             # step late (its previous step's tail, the profiler starting); host on a CPU-only
                             # trace, other when the rank has GPU work (the GPU may have been the one behind)
    "no_trace": "other",     # no trace of that rank at that time: comm and host cannot be told apart
}


def _step_graph(a: pd.DataFrame) -> tuple[list[list[int]], list[list[int]]]:
    """For one step's actions (rows 0..n-1): each row's data predecessors, and each rank's rows in
    measured order. Data dependencies as in `critical_path`: F(s) after F(s-1); B(s) after B(s+1), or
    after its own F on the last stage; W(s) after B(s); ranks sharing a pp_rank are separate
    data-parallel pipelines, paired by rank order."""
    ranks, first = np.unique(a["rank"].to_numpy(), return_index=True)  # each rank's pp_rank: its first row's
    replica_of, seen = {}, {}
    for r, pp in zip(ranks.tolist(), a["pp_rank"].to_numpy()[first].tolist()):  # in rank order per pp_rank
        replica_of[r] = seen.get(pp, 0)
        seen[pp] = replica_of[r] + 1
    rank, stage = a["rank"].tolist(), a["stage"].tolist()
    mb, kind = a["microbatch"].tolist(), a["kind"].astype(str).tolist()
    rep = [replica_of[r] for r in rank]
    key = {(rep[i], stage[i], mb[i], kind[i]): i for i in range(len(a))}
    last = max(stage) if stage else 0
    preds: list[list[int]] = []
    for i in range(len(a)):
        s, k = stage[i], kind[i]
        if k == "F":
            dep = (rep[i], s - 1, mb[i], "F") if s > 0 else None
        elif k == "B":
            dep = (rep[i], s + 1, mb[i], "B") if s < last else (rep[i], s, mb[i], "F")
        else:
            dep = (rep[i], s, mb[i], "B")
        j = key.get(dep) if dep is not None else None
        preds.append([j] if j is not None and j != i else [])
    order_idx = np.lexsort((a["end_ns"].to_numpy(), a["start_ns"].to_numpy(), a["rank"].to_numpy()))
    r_sorted = a["rank"].to_numpy()[order_idx]
    cuts = np.flatnonzero(np.r_[True, r_sorted[1:] != r_sorted[:-1]])
    order = [seg.tolist() for seg in np.split(order_idx, cuts[1:])] if len(a) else []
    return preds, order


def simulate_step(a: pd.DataFrame, durations, t0: int | None = None, handoff_ns: int = 0,
                  graph: tuple[list[list[int]], list[list[int]]] | None = None,
                  host=None) -> tuple[np.ndarray, np.ndarray, int]:
    """Replay one step's schedule with the given action durations and no communication or host time
    (or, with ``handoff_ns``, that much more before an action whose data dependency ran on another rank:
    the what-if model's per-hand-off overhead).

    Each rank runs its actions in the measured order; an action starts as soon as its rank is free and
    its data dependency (see `_step_graph`) has ended; every rank is free from t0 (default: the step's
    first measured start). Returns (start_ns, end_ns, forced) aligned with `a`'s rows; `forced` counts
    actions started without an unmet dependency to break a deadlock, which only inconsistent records
    (a dependency that ends after its consumer starts, e.g. skewed clocks) can produce. ``graph``: `_step_graph(a)`
    when the caller replays the same step several times. ``host``: per action, the host time its launches take (the
    what-if's pipeline from a run without one): each rank's host launches its actions one after another without
    waiting for their data (a p2p receive makes the stream wait, not the host); an action starts no earlier than its
    host gets to it and ends no earlier than its last launch.
    """
    n = len(a)
    dur = np.asarray(durations, dtype=np.int64).tolist()
    hdur = np.asarray(host, dtype=np.int64).tolist() if host is not None else None
    if n == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64), 0
    preds, order = _step_graph(a) if graph is None else graph
    t0 = int(a["start_ns"].min()) if t0 is None else int(t0)
    meas_start = a["start_ns"].tolist()
    rank_of, handoff = a["rank"].tolist(), int(handoff_ns)
    start, end = [-1] * n, [-1] * n
    pos, free = [0] * len(order), [t0] * len(order)
    hfree = [t0] * len(order)  # each rank's host: when it has launched its actions so far
    left, forced = n, 0

    def run(k: int, i: int, ready: int) -> None:
        if hdur is not None:
            ready = max(ready, hfree[k])  # its first kernel is not launched before the host gets to it
            hfree[k] += hdur[i]
        start[i], end[i] = ready, ready + dur[i]
        if hdur is not None:
            end[i] = max(end[i], hfree[k])
        free[k] = end[i]
        pos[k] += 1

    while left:
        progressed = False
        for k, rows in enumerate(order):
            while pos[k] < len(rows):
                i = rows[pos[k]]
                ready = free[k]
                for j in preds[i]:
                    if end[j] < 0:
                        ready = -1
                        break
                    ready = max(ready, end[j] + (handoff if rank_of[j] != rank_of[i] else 0))
                if ready < 0:
                    break
                run(k, i, ready)
                left -= 1
                progressed = True
        if not progressed and left:
            k = min((k for k in range(len(order)) if pos[k] < len(order[k])), key=lambda k: meas_start[order[k][pos[k]]])
            i = order[k][pos[k]]
            run(k, i, max([free[k]] + [end[j] for j in preds[i] if end[j] >= 0]))
            left -= 1
            forced += 1
    return np.asarray(start, np.int64), np.asarray(end, np.int64), forced


@dataclass
class TraceActivity:
    """What a run's traces show, per rank, as disjoint interval sets on the actions' clock."""

    span: dict[int, tuple[int, int]]  # first event start, last event end
    sets: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]  # rank -> class -> (starts, ends)
    offset: dict[int, int]  # actions' clock - trace ts

    def classify(self, rank: int, lo: int, hi: int) -> dict[str, int]:
        """ns of [lo, hi) on `rank` per WAIT_CLASSES (first class that holds wins; they sum to hi - lo)."""
        out = dict.fromkeys(WAIT_CLASSES, 0)
        if hi <= lo:
            return out
        if rank not in self.sets:
            out["no_trace"] = hi - lo
            return out
        s0, s1 = self.span[rank]
        a, b = max(lo, s0), min(hi, s1)
        if b <= a:
            out["no_trace"] = hi - lo
            return out
        out["before_trace"] = a - lo
        out["no_trace"] = hi - b
        cov_s, cov_e = np.empty(0, np.int64), np.empty(0, np.int64)
        done = 0
        empty = (np.empty(0, np.int64), np.empty(0, np.int64))
        for cls in ("comm_wait_gpu", "comm_gpu", "gpu_other", "comm_host", "host_ops"):
            starts, ends = self.sets[rank].get(cls, empty)
            i, j = np.searchsorted(ends, a, side="right"), np.searchsorted(starts, b, side="left")
            if j > i:  # (a class with nothing in [a, b) adds nothing: no union to redo)
                cs, ce = I.clip(starts[i:j], ends[i:j], a, b)
                cov_s, cov_e = I.union(np.concatenate((cov_s, cs)), np.concatenate((cov_e, ce)))
            now = int((cov_e - cov_s).sum())
            out[cls], done = now - done, now
        out["host_python"] = (b - a) - done
        return out


def trace_activity(trace, actions: pd.DataFrame) -> TraceActivity | None:
    """Interval sets per rank from a loaded `Trace`: communication kernels, other GPU work, host
    communication calls, other host ops. The clock offset of a rank is the one (0, or the trace's
    baseTimeNanoseconds: jsonl times are epoch ns, Kineto ts are relative to that base) under which most
    of its actions fall inside its trace; a rank with no action inside its trace is left out.

    A trace-like object with `rank_activity` (rank -> `rank_activity` of its events, as
    `tracelens.scale` gathers them) instead of event tables gives the same result."""
    per_rank = getattr(trace, "rank_activity", None)
    if per_rank is None:
        ev = trace.events
        if ev.empty or actions.empty:
            return None
        per_rank = rank_activity(ev, set(actions["rank"].unique().tolist()))
    elif actions.empty:
        return None
    base = {ri.rank: int(ri.base_time_ns or 0) for ri in trace.ranks}
    span, sets, offset, peers = {}, {}, {}, {}
    for r in sorted(per_rank):
        lo, hi, rank_sets = per_rank[r]
        acts = actions[actions["rank"] == r]
        if acts.empty:
            continue
        s, e = acts["start_ns"].to_numpy(np.int64), acts["end_ns"].to_numpy(np.int64)
        best, best_n = None, 0
        for off in dict.fromkeys((0, base.get(r, 0))):
            n_in = int(((s >= lo + off) & (e <= hi + off)).sum())
            if n_in > best_n:
                best, best_n = off, n_in
        if best is None:
            continue
        offset[r], span[r] = best, (lo + best, hi + best)
        sets[r] = {cls: (a + best, b + best) for cls, (a, b) in rank_sets.items() if cls != "p2p_peers"}
        if "p2p_peers" in rank_sets:
            peers[r] = tuple(int(x) for x in rank_sets["p2p_peers"][0])
    if not sets:
        return None
    _p2p_wait_sets(sets, peers)
    return TraceActivity(span=span, sets=sets, offset=offset)


def _p2p_wait_sets(sets: dict, peers: dict) -> None:
    """Each rank's ``comm_wait_gpu`` intervals: the part of its point-to-point kernels (``p2p``: each kernel,
    not a union) spent waiting for the peer to post its side, paired across ranks on the actions' clock as
    everywhere else (`waits.p2p_partner_waits`); the ``p2p`` entries are dropped."""
    ranks = [r for r in sets if "p2p" in sets[r]]
    parts = [(r, *sets[r].pop("p2p")) for r in ranks]
    parts = [(r, s, e) for r, s, e in parts if len(s)]
    for rank_sets in sets.values():
        rank_sets.setdefault("comm_wait_gpu", (np.empty(0, np.int64), np.empty(0, np.int64)))
    if len(parts) < 2:
        return
    ts = np.concatenate([s for _, s, _ in parts])
    end = np.concatenate([e for _, _, e in parts])
    rank = np.concatenate([np.full(len(s), r, dtype=np.int64) for r, s, _ in parts])
    wait, _ = waits_mod.p2p_partner_waits(ts, end, rank, peers)
    ok = np.isfinite(wait) & (wait > 0)
    for r, _, _ in parts:
        m = ok & (rank == r)
        if m.any():
            sets[r]["comm_wait_gpu"] = I.union(ts[m], ts[m] + wait[m].astype(np.int64))


def rank_activity(ev: pd.DataFrame, ranks: set | None = None) -> dict[int, tuple[int, int, dict]]:
    """Per rank of `ev` (those in `ranks` when given): (first event start, last event end, class ->
    disjoint (starts, ends)) on the trace's own clock; `trace_activity` shifts them to the actions' clock
    (a union commutes with the shift)."""
    out: dict[int, tuple[int, int, dict]] = {}
    if ev.empty:
        return out
    cat, name = ev["cat"], ev["name"]
    gpu = C.isin(cat, C.GPU_CATS)
    comm_k = gpu & C.is_comm_kernel(name)
    host_comm = C.isin(cat, C.OP_CATS | C.ANNOTATION_CATS | C.RUNTIME_CATS) & C.map_strings(
        name, lambda s: bool(_HOST_COMM_RE.match(s)))
    host = C.isin(cat, _HOST_BUSY_CATS)
    masks = {"comm_gpu": comm_k, "gpu_other": gpu & ~comm_k, "comm_host": host_comm, "host_ops": host}
    p2p = comm_k & C.map_strings(name, lambda s: bool(waits_mod.P2P_KERNEL.search(s)))
    peer_sets = p2p_peer_sets(ev) if p2p.any() else {}
    ts = ev["ts"].to_numpy(np.int64)
    te = ts + np.maximum(ev["dur"].fillna(0).to_numpy(np.int64), 0)
    rank_col = ev["rank"].to_numpy()
    for r, idx in pd.Series(np.arange(len(ev))).groupby(rank_col).indices.items():
        r = int(r)
        if ranks is not None and r not in ranks:
            continue
        lo, hi = int(ts[idx].min()), int(te[idx].max())
        sets = {cls: I.union(ts[idx[m[idx]]], te[idx[m[idx]]]) for cls, m in masks.items()}
        k = idx[p2p[idx]]
        if len(k):  # each point-to-point kernel (not their union), and the ranks its ops name: for the waits
            k = k[np.argsort(ts[k], kind="stable")]
            sets["p2p"] = (ts[k], te[k])
            if r in peer_sets:
                pe = np.array(peer_sets[r], dtype=np.int64)
                sets["p2p_peers"] = (pe, pe)  # (ranks, not times: never shifted)
        out[r] = (lo, hi, sets)
    return out


@dataclass
class BubbleAccount:
    """Each rank's idle time (the bubble) split into parts that add up to it exactly (see
    `bubble_account`)."""

    per_step: pd.DataFrame  # one row per (step, rank)
    per_rank: pd.DataFrame  # summed over `steps`
    steps: list[int]  # the steps summed in per_rank: the traced ones when any
    traced_steps: list[int]  # steps every rank's trace covers
    waits: pd.DataFrame  # per step: critical-path waits by what the trace shows (WAIT_CLASSES, ns)
    advice: dict[str, str]  # part -> what it is and what to change
    note: str
    warnings: list[str] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        """ns per part (and measured idle) summed over ranks and `steps`."""
        pr = self.per_rank
        return {k: int(pr[f"{k}_ns"].sum()) for k in ("idle",) + ACCOUNT_PARTS}

    def to_dict(self) -> dict[str, Any]:
        def recs(df):
            return json.loads(df.to_json(orient="records"))

        return {"parts": list(ACCOUNT_PARTS), "labels": ACCOUNT_LABELS, "steps": self.steps,
                "traced_steps": self.traced_steps, "totals_ns": self.totals(), "per_rank": recs(self.per_rank),
                "per_step": recs(self.per_step), "waits": recs(self.waits), "advice": self.advice, "note": self.note,
                "warnings": list(self.warnings)}


def _group_mean(values: np.ndarray, *keys: np.ndarray) -> np.ndarray:
    """Each row's group mean of `values` (int64 ns) over the groups of `keys`, rounded half to even as
    `Series.round` does, as int64 (what `groupby(keys).transform("mean").round()` gives)."""
    codes = np.zeros(len(values), dtype=np.int64)
    for k in keys:
        _, inv = np.unique(k, return_inverse=True)
        codes = codes * (int(inv.max()) + 1 if len(inv) else 1) + inv.reshape(-1)
    _, g = np.unique(codes, return_inverse=True)
    g = g.reshape(-1)
    means = np.bincount(g, weights=values) / np.bincount(g)
    return np.round(means[g]).astype(np.int64)


def _split(total: int, weights: list[int]) -> list[int]:
    """`total` in integer parts proportional to `weights`; the last part takes the rounding."""
    w = sum(weights)
    if total <= 0 or w <= 0:
        return [0] * (len(weights) - 1) + [max(total, 0)]
    parts = [total * x // w for x in weights[:-1]]
    return parts + [total - sum(parts)]


def bubble_account(actions: pd.DataFrame, meta: PipelineMeta | None = None, balance: StageBalance | None = None,
                   trace=None, activity: TraceActivity | None = None, measured: pd.DataFrame | None = None) -> BubbleAccount:
    """Split every rank's idle time per step into schedule theory + stage imbalance + p2p/comm wait +
    host/launch overhead + other, adding up exactly to the measured idle (window - busy, as `bubbles`).

    Per step, the schedule is replayed (`simulate_step`: measured order, data dependencies, no
    communication or host time) three times: with every action at its kind's mean duration (equal
    stages: idle_equal), at its stage's mean per kind (idle_stage) and at its own measured duration
    (idle_sim). For a rank with measured idle I:
        theory    = min(idle_equal, idle_sim, I)      the idle the schedule has with equal stages
        imbalance = min(idle_sim, I) - theory         the idle the measured costs add (waiting on slower
                    stages); of it, `imbalance_layout` = what the stage means explain, the rest
                    `imbalance_variation` is microbatch-to-microbatch spread
        overhead  = I - theory - imbalance           what communication and the host added
    The overhead stretches the step beyond the zero-overhead replay; it is split by what the trace shows
    during the waits on the step's critical path (`critical_path`'s wait_ns, plus a late start of the
    path): see WAIT_CLASSES. comm and host take their share of the overhead; other takes GPU work outside
    the actions, waits no trace covers (every untraced step's whole overhead) and integer rounding.
    A slow stage's rank idles less than the equal-stage schedule would, so its theory part is smaller.
    measured: `bubbles(actions)` when the caller has it already.
    """
    if actions.empty:
        raise TraceError(None, "empty window: no pipeline actions to account for")
    had_trace = trace is not None or activity is not None
    if activity is None and trace is not None:
        activity = trace_activity(trace, actions)
    rows, wait_rows, warns = [], [], []
    traced: list[int] = []
    gpu = None if activity is None else any(len(s["comm_gpu"][0]) or len(s["gpu_other"][0]) for s in activity.sets.values())
    part_of = {**WAIT_CLASSES, "before_trace": "other" if gpu else "host"}
    # every (step, rank) lane at once: a lane's figures depend on its own step's actions alone
    measured = dict(iter((bubbles(actions) if measured is None else measured).groupby("step", sort=False)))
    paths = dict(iter(critical_path(actions).groupby("step", sort=False)))  # each step's path is its own
    for step, a in actions.groupby("step", sort=True):
        a = a.sort_values(["rank", "start_ns", "end_ns"], kind="stable").reset_index(drop=True)
        t0 = int(a["start_ns"].min())
        dur = (a["end_ns"] - a["start_ns"]).to_numpy(np.int64)
        kind = a["kind"].astype(str).to_numpy()
        equal = _group_mean(dur, kind)  # (integer ns: the sums are exact, as pandas' groupby mean has them)
        per_stage = _group_mean(dur, kind, a["stage"].to_numpy())
        ranks, rank_i = np.unique(a["rank"].to_numpy(), return_inverse=True)
        sims, forced = {}, 0
        graph = _step_graph(a)
        for name, d in (("equal", equal), ("stage", per_stage), ("sim", dur)):
            s, e, f = simulate_step(a, d, t0, graph=graph)
            forced = max(forced, f)
            window = int(e.max() - t0)
            busy = np.bincount(rank_i.reshape(-1), weights=d, minlength=len(ranks))
            sims[name] = (window, {int(r): window - int(b) for r, b in zip(ranks.tolist(), busy.tolist())})
        if forced:
            warns.append(f"step {step}: {forced} action(s) start before the action they depend on ends "
                         "(skewed clocks?); the replay ignored those dependencies")
        meas = measured[step].set_index("rank")
        # overhead classes: the critical path's waits and a late start of the path
        cp = paths[step]
        waits = [(int(r), int(s) - int(w), int(s)) for r, s, w in zip(cp["rank"], cp["start_ns"], cp["wait_ns"]) if w > 0]
        if len(cp) and int(cp["start_ns"].iloc[0]) > t0:
            waits.append((int(cp["rank"].iloc[0]), t0, int(cp["start_ns"].iloc[0])))
        by_class = dict.fromkeys(WAIT_CLASSES, 0)
        for r, lo, hi in waits:
            got = activity.classify(r, lo, hi) if activity is not None else {"no_trace": hi - lo}
            for k, v in got.items():
                by_class[k] += v
        wait_rows.append({"step": int(step), **{f"{k}_ns": v for k, v in by_class.items()},
                          "critical_wait_ns": sum(by_class.values()), "sim_window_ns": sims["sim"][0],
                          "window_ns": int(a["end_ns"].max()) - t0})
        fully = activity is not None and all(
            r in activity.span and activity.span[r][0] <= int(g["start_ns"].min()) and int(g["end_ns"].max()) <= activity.span[r][1]
            for r, g in a.groupby("rank"))
        if fully:
            traced.append(int(step))
        weights = [sum(v for k, v in by_class.items() if part_of[k] == part) for part in ("comm", "host", "other")]
        for r in meas.index:
            idle = int(meas.at[r, "idle_ns"])
            i_eq, i_st, i_sim = (int(sims[n][1].get(r, 0)) for n in ("equal", "stage", "sim"))
            explained = min(max(i_sim, 0), idle)
            theory = min(max(i_eq, 0), explained)
            imb = explained - theory
            imb_layout = min(max(i_st - theory, 0), imb)
            comm, host, other = _split(idle - explained, weights)
            rows.append({"step": int(step), "rank": int(r), "pp_rank": int(meas.at[r, "pp_rank"]), "traced": fully,
                         "window_ns": int(meas.at[r, "window_ns"]), "idle_ns": idle, "theory_ns": theory,
                         "imbalance_ns": imb, "comm_ns": comm, "host_ns": host, "other_ns": other,
                         "imbalance_layout_ns": imb_layout, "imbalance_variation_ns": imb - imb_layout,
                         "idle_equal_ns": i_eq, "idle_stage_ns": i_st, "idle_sim_ns": i_sim,
                         "sim_window_ns": sims["sim"][0]})
    per_step = pd.DataFrame(rows)
    steps = traced or sorted(per_step["step"].unique().tolist())
    sums = ["window_ns", "idle_ns"] + [f"{p}_ns" for p in ACCOUNT_PARTS] + [
        "imbalance_layout_ns", "imbalance_variation_ns", "idle_equal_ns", "idle_stage_ns", "idle_sim_ns"]
    chosen = per_step[per_step["step"].isin(steps)]
    per_rank = chosen.groupby(["rank", "pp_rank"], as_index=False)[sums].sum()
    per_rank.insert(2, "steps", chosen.groupby(["rank", "pp_rank"]).size().to_numpy())
    per_rank["other_share"] = per_rank["other_ns"] / per_rank["idle_ns"].where(per_rank["idle_ns"] > 0)
    waits_df = pd.DataFrame(wait_rows)
    if traced:
        note = (f"step {_ranges(traced)}, the analyzed step(s) the traces cover, where communication and host "
                "overhead are told apart by what the trace shows")
    elif had_trace:
        note = (f"step {_ranges(steps)}; no analyzed step lies inside the traces, so communication and host "
                "overhead are not told apart (they are in other)")
    else:
        note = (f"step {_ranges(steps)}; without traces communication and host overhead cannot be told apart "
                "(they are in other)")
    advice = _account_advice(per_rank, waits_df[waits_df["step"].isin(steps)], meta, balance, gpu)
    return BubbleAccount(per_step=per_step, per_rank=per_rank, steps=steps, traced_steps=traced, waits=waits_df,
                         advice=advice, note=note, warnings=warns)


def _pct_of(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "0%"


def _account_advice(per_rank: pd.DataFrame, waits: pd.DataFrame, meta: PipelineMeta | None,
                    balance: StageBalance | None, gpu: bool | None = None) -> dict[str, str]:
    """What each part is on this run and what to change to shrink it (numbers from the account).
    gpu: whether the traces have GPU activity (None: no traces)."""
    tot = {k: int(per_rank[f"{k}_ns"].sum()) for k in ("idle",) + ACCOUNT_PARTS}
    n = max(1, int(per_rank["steps"].max()) if len(per_rank) else 1)
    idle = tot["idle"]

    def share(k):
        return f"{fmt_ns(tot[k] / n / max(1, len(per_rank)))} per rank per step, {_pct_of(tot[k], idle)} of the idle"

    out = {}
    alt = ""
    if meta is not None:
        opts = []
        for label, args in ((f"{2 * meta.microbatches} microbatches", (meta.schedule, meta.pp, 2 * meta.microbatches, meta.vpp)),
                            (f"vpp {max(2, meta.vpp * 2)}", ("vpp", meta.pp, meta.microbatches, max(2, meta.vpp * 2))),
                            ("zb1p (ZB-H1)", ("zb1p", meta.pp, meta.microbatches, 1))):
            try:
                r = bubble_ratio(*args)
            except TraceError:
                continue
            if not math.isnan(r):
                opts.append(f"{label}: {100 * r:.1f}%")
        try:
            now = bubble_ratio(meta.schedule, meta.pp, meta.microbatches, meta.vpp)
        except TraceError:
            now = math.nan
        head = f"{meta.schedule} with pp {meta.pp}, vpp {meta.vpp}, {meta.microbatches} microbatches"
        alt = (f" ({head}: {100 * now:.1f}% of the step in theory" if not math.isnan(now) else f" ({head}") + (
            f"; {', '.join(opts)})" if opts else ")")
    out["theory"] = (f"{share('theory')}: the fill and drain the schedule has even with equal stages and free "
                     f"communication{alt}. Change the schedule: more microbatches per step, more virtual stages "
                     "per rank, or a zero-bubble schedule.")
    imb = int(per_rank["imbalance_ns"].sum())
    lay = int(per_rank["imbalance_layout_ns"].sum())
    stmt = f" {balance.statement[:1].upper()}{balance.statement[1:]}." if balance is not None else ""
    out["imbalance"] = (f"{share('imbalance')}: ranks waiting on slower stages; {_pct_of(lay, imb)} of it is explained "
                        f"by the stages' mean costs (the layout), the rest by microbatch-to-microbatch variation "
                        f"(routing, noise), which no layout removes.{stmt}")
    w = {k: int(waits[f"{k}_ns"].sum()) for k in WAIT_CLASSES} if len(waits) else dict.fromkeys(WAIT_CLASSES, 0)
    wall = max(1, sum(w.values()))
    on_gpu = w["comm_gpu"] + w.get("comm_wait_gpu", 0)
    spin = (f"; {_pct_of(w['comm_wait_gpu'], on_gpu)} of that a point-to-point kernel spinning until its peer posts "
            "its side (the peer was late, e.g. its host launching the send late), not moving data"
            if w.get("comm_wait_gpu") else "")
    seen = (f"on the critical path, a communication kernel on the GPU ({_pct_of(on_gpu, wall)} of its waits{spin}) "
            f"or the host in send/recv/collective calls with the GPU idle ({_pct_of(w['comm_host'], wall)})"
            if gpu is not False else
            f"on the critical path, the host in send/recv/collective calls ({_pct_of(w['comm_host'], wall)} of its waits)")
    if w.get("comm_wait_gpu", 0) * 2 > w["comm_gpu"] + w.get("comm_wait_gpu", 0) + w["comm_host"]:
        # mostly kernels waiting for their peer: moving less data would not shorten it
        fix = ("Most of it is waiting, not moving data: the peer stage posts its send or receive late. Post "
               "receives before the compute they feed and sends as soon as an output is ready (batch isend/irecv), "
               "and shrink the peer's host time per action (the host part); smaller activations would not help.")
    else:
        fix = ("Overlap the hand-offs with compute (post receives early, batch isend/irecv, a separate "
               "communication stream) and send fewer or smaller activations (each virtual stage adds a hand-off "
               "per microbatch).")
    out["comm"] = f"{share('comm')}: {seen}. {fix}"
    late = w.get("before_trace", 0)
    late_txt = (f"; before the rank's trace begins: {_pct_of(late, wall)}, the rank entering the profiled step late "
                "(its previous step's tail or the profiler starting: profile two steps to see which)") if late else ""
    if gpu is False:
        out["host"] = (f"{share('host')}: a rank not yet running an action it could run, in host ops "
                       f"({_pct_of(w['host_ops'], wall)} of the waits) or between recorded ops "
                       f"({_pct_of(w['host_python'], wall)}: Python, or the process waiting for a CPU core){late_txt}. "
                       "Give each rank its own cores and keep the schedule's own Python work small.")
    else:
        out["host"] = (f"{share('host')}: the GPU idle before an action because the host had not launched it (in ops "
                       f"or runtime calls: {_pct_of(w['host_ops'], wall)} of the waits; between recorded ops, Python: "
                       f"{_pct_of(w['host_python'], wall)}). Launch less per action: CUDA graphs for the stages' "
                       "forward/backward, no host syncs in the step (sync-free MoE), fewer small kernels.")
    unknown = w["no_trace"] + (late if gpu else 0)
    out["other"] = (f"{share('other')}: GPU work outside the pipeline actions ({_pct_of(w['gpu_other'], wall)} of the "
                    f"waits) and waits no trace covers ({_pct_of(unknown, wall)}), where communication and host "
                    "time cannot be told apart: profile the analyzed steps to split them.")
    return out


def account_lines(res: "PipelineAnalysis") -> list[str]:
    """The account as terminal lines (`tracelens ppvis`)."""
    acc = res.account
    if acc is None:
        return []
    out = [f"bubble account ({acc.note}), ms per step:"]
    out.append(f"{'rank':>4} {'pp':>3} {'idle':>9} " + " ".join(f"{p:>10}" for p in ACCOUNT_PARTS) + f" {'other %':>7}")
    for r in acc.per_rank.sort_values("rank", kind="stable").itertuples(index=False):
        n = max(1, r.steps)
        vals = " ".join(f"{getattr(r, p + '_ns') / n / 1e6:>10.3f}" for p in ACCOUNT_PARTS)
        out.append(f"{r.rank:>4} {r.pp_rank:>3} {r.idle_ns / n / 1e6:>9.3f} {vals} "
                   f"{100 * (r.other_share if r.other_share == r.other_share else 0.0):>6.1f}%")
    for p in ACCOUNT_PARTS:
        out.append(f"  {ACCOUNT_LABELS[p]}: {acc.advice[p]}")
    return out


# ------------------------------------------------------------------------------------ everything


@dataclass
class PipelineAnalysis:
    """Everything `tracelens ppvis` shows, for the analyzed steps."""

    actions: pd.DataFrame  # every action loaded
    selected: pd.DataFrame  # the analyzed steps' actions
    steps: list[int]
    skipped_steps: list[int]
    shown_step: int  # the step drawn in the lanes figure
    meta: PipelineMeta
    per_step: pd.DataFrame  # bubbles per (step, rank)
    per_rank: pd.DataFrame  # bubbles per rank over the analyzed steps
    overall_ratio: float
    theory_ratio: float
    theory_note: str
    gaps: pd.DataFrame  # idle intervals of the shown step
    balance: StageBalance
    source: str  # "jsonl" | "trace"
    warnings: list[str] = field(default_factory=list)
    account: BubbleAccount | None = None  # each rank's idle split into theory, imbalance, comm, host, other
    skipped_note: str = ""  # why the skipped steps are left out ('0 (warm-up), 5 (trace export)')

    def tables(self) -> dict[str, pd.DataFrame]:
        out = {"pipeline_actions": self.actions, "pipeline_bubbles": self.per_step,
               "pipeline_ranks": self.per_rank, "pipeline_stages": self.balance.table}
        if self.account is not None:
            out["pipeline_account"] = self.account.per_step
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (the `--json` file)."""
        def recs(df):
            return json.loads(df.to_json(orient="records"))

        b = self.balance
        return {
            "schema_version": 1, "source": self.source, "meta": self.meta.to_dict(), "steps": self.steps,
            "skipped_steps": self.skipped_steps, "shown_step": self.shown_step,
            "bubble": {"overall_ratio": _num(self.overall_ratio), "theory_ratio": _num(self.theory_ratio),
                       "theory_note": self.theory_note, "per_rank": recs(self.per_rank), "per_step": recs(self.per_step)},
            "stages": {"table": recs(b.table), "slowest_stage": b.slowest_stage, "slowest_ratio": _num(b.slowest_ratio),
                       "critical_stage": b.critical_stage, "flagged": b.flagged, "move": b.move, "statement": b.statement},
            "account": self.account.to_dict() if self.account is not None else None,
            "warnings": list(self.warnings),
        }


    def to_text(self) -> str:
        """The `tracelens ppvis` text: bubbles per rank against theory, the stage balance and the fix, and
        the bubble account; times per step."""
        m = self.meta
        skipped = ("" if not self.skipped_steps else f"; step {self.skipped_note} skipped" if self.skipped_note
                   else f"; step {', '.join(map(str, self.skipped_steps))} skipped as warm-up")
        pct = lambda v: "n/a" if v is None or math.isnan(v) else f"{100 * v:.1f}%"  # noqa: E731
        lines = [f"pipeline: {m.schedule}{f' ({m.torch_schedule})' if m.torch_schedule else ''}, pp {m.pp}, vpp {m.vpp}, "
                 f"{m.microbatches} microbatches; {len(self.steps)} step(s) analyzed{skipped}"
                 + (f" [inferred: {', '.join(m.inferred)}]" if m.inferred else ""),
                 f"{'rank':>4} {'pp':>3} {'window':>12} {'busy':>12} {'idle':>12} {'bubble':>7} {'theory':>7}"]
        for r in self.per_rank.sort_values("rank", kind="stable").itertuples(index=False):
            lines.append(f"{r.rank:>4} {r.pp_rank:>3} {fmt_ns(r.window_ns / r.steps):>12} {fmt_ns(r.busy_ns / r.steps):>12} "
                         f"{fmt_ns(r.idle_ns / r.steps):>12} {pct(r.bubble_ratio):>7} {pct(r.theory_ratio):>7}")
        lines.append(f"overall bubble {pct(self.overall_ratio)} (theory {pct(self.theory_ratio)}"
                     + (f": {self.theory_note}" if self.theory_note else "") + "); times are per step")
        lines.append(f"{'stage':>5} {'pp':>3} {'layers':>6} {'F/mb':>11} {'B/mb':>11} {'W/mb':>11} {'total/mb':>11} "
                     f"{'x mean':>6} {'crit %':>6}")
        for st in self.balance.table.itertuples(index=False):
            layers = "–" if st.layers is None or (isinstance(st.layers, float) and math.isnan(st.layers)) else str(int(st.layers))
            lines.append(f"{st.stage:>5} {st.pp_rank:>3} {layers:>6} {fmt_ns(st.f_ns):>11} {fmt_ns(st.b_ns):>11} "
                         f"{fmt_ns(st.w_ns):>11} {fmt_ns(st.total_ns):>11} {st.ratio_to_mean:>6.2f} "
                         f"{100 * st.critical_share:>6.1f}")
        lines.append(self.balance.statement)
        lines.extend(account_lines(self))
        return "\n".join(lines)


def _num(v: float) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def analyze_pipeline(actions: pd.DataFrame, meta: PipelineMeta | None = None, *, step: int | None = None,
                     source: str = "jsonl", trace=None, manifest: dict | None = None) -> PipelineAnalysis:
    """Bubbles, theory, stage balance and the bubble account over the analyzed steps (see `select_steps`);
    `trace` (the run's loaded traces) lets the account tell communication from host overhead."""
    if actions.empty:
        raise TraceError(None, "empty window: no pipeline actions")
    meta = meta or infer_meta(actions)
    warns = list(actions.attrs.get("warnings", [])) + check_actions(actions, meta)
    if manifest is None and trace is not None:
        manifest = run_manifest(trace)
    sel, steps, skipped = select_steps(actions, step, manifest)
    per_step = bubbles(sel)
    if per_step.empty or int(per_step["window_ns"].sum()) <= 0:
        raise TraceError(None, f"empty window: the actions of step(s) {_ranges(steps)} span no time")
    theory, note = theoretical_bubble(meta)
    per_rank = rank_bubbles(per_step, theory)
    overall = float(per_step["idle_ns"].sum() / per_step["window_ns"].sum())
    # lanes show a steady-state step: not a warm-up, profiled or trace-export step of the run's manifest
    shown = steps[-1] if step is not None else steady_pipeline_step(steps, manifest)
    gaps = bubble_gaps(sel[sel["step"] == shown])
    balance = stage_balance(sel, meta)
    account = bubble_account(sel, meta, balance, trace=trace, measured=per_step)
    return PipelineAnalysis(actions=actions, selected=sel, steps=steps, skipped_steps=skipped, shown_step=shown, meta=meta,
                            per_step=per_step, per_rank=per_rank, overall_ratio=overall, theory_ratio=theory,
                            theory_note=note, gaps=gaps, balance=balance, source=source,
                            warnings=warns + account.warnings, account=account,
                            skipped_note=skip_reasons(skipped, manifest))


def load_pipeline(source, *, step: int | None = None, cache: bool = True, traces: bool = True) -> PipelineAnalysis:
    """`analyze_pipeline` of a run dir (jsonl + manifest), trace dir/file, or loaded Trace.

    traces: also read the run's traces (RUN/traces, Parquet-cached) when the actions come from the jsonl, so
    that the bubble account can tell communication from host overhead. Traces that cannot be read cost only
    that split (a warning), never the analysis.
    """
    actions, trace = _actions_and_trace(source, cache=cache)
    is_path = isinstance(source, (str, os.PathLike))
    src = "jsonl" if trace is None else "trace"  # None: the actions came from the run's jsonl files
    run = Run.open(source) if is_path else getattr(source, "run", None)  # a run dir, also given as its traces/
    meta = pipeline_meta(run, actions)
    extra = []
    if trace is None and traces and is_path:
        from ..trace import discover, load

        try:
            discover(source)
        except TraceError:
            pass  # a run dir without traces: the account says so
        else:
            try:
                trace = load(source, cache=cache, progress=False)
            except TraceError as e:
                extra.append(f"bubble account without traces (comm and host not told apart): {e.one_line()}")
    try:
        res = analyze_pipeline(actions, meta, step=step, source=src, trace=trace,
                               manifest=getattr(run, "manifest", None) if run is not None else None)
    except TraceError as e:
        if e.path is None and is_path:  # name the run in the one-line error
            raise TraceError(source, e.problem) from None
        raise
    res.warnings.extend(extra)
    return res


def has_pipeline_data(trace) -> bool:
    """Whether `pipeline_for_trace` can find anything, decided cheaply: a run dir with pipeline jsonl,
    gathered actions (`tracelens.scale`), or an event name of the ``pipeline/...`` ranges in the names'
    dictionary (a non-categorical name column: True, undecided)."""
    if getattr(trace, "pipeline_actions", None) is not None:
        return True
    run = getattr(trace, "run", None)
    if run is not None and run.pipeline_files():
        return True
    ev = getattr(trace, "events", None)
    if ev is None or ev.empty:
        return False
    names = ev["name"]
    if not isinstance(names.dtype, pd.CategoricalDtype):
        return True
    return any(RANGE_RE.match(c) for c in C.categories_with_prefix(names.cat.categories, "pipeline/"))  # (RANGE_RE: ^pipeline/)


def pipeline_for_trace(trace) -> PipelineAnalysis | None:
    """Pipeline analysis for the main report: from the run dir's jsonl if the trace sits in a run dir,
    else from the trace's ranges; None when there is no pipeline data."""
    run = getattr(trace, "run", None)
    actions = read_pipeline_jsonl(run) if run is not None else None
    source = "jsonl"
    if actions is None:
        actions = actions_from_trace(trace)
        source = "trace"
    if actions.empty:
        return None
    return analyze_pipeline(actions, pipeline_meta(run, actions), source=source, trace=trace)

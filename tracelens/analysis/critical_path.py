"""The critical path of a step across ranks: the chain of GPU work, idle time and hand-offs that sets the step's time.

`tracelens.analysis.pipeline.critical_path` walks a pipeline's actions; this walks every rank's GPU timeline at
kernel granularity and crosses ranks where they wait for each other, so it covers expert / data parallelism
(all-to-all, all-gather, reduce-scatter, all-reduce) as well as a pipeline's sends and receives.

The walk starts at the GPU event that ends the step last (over all ranks) and goes back in time, one segment at a
time, until the step's first GPU event on any rank:

- a computation kernel, memcpy or memset: the segment is the event (``compute``: kernel category, the launching
  top-level op and the stage: the pipeline action ``F s2`` when the run has pipeline records, else the
  record_function path, ``backward`` or ``optimizer``);
- a communication kernel matched across the ranks of its group (`tracelens.analysis.comm`): its transfer, from the
  last rank's arrival to its end, is a ``transfer`` segment; the time it spent before that was waiting for the last
  rank, so the walk hops there (``wait``: a zero-length segment naming ``to_rank``) and goes on with what that rank
  did before its kernel began. A rank that arrived last itself has no wait: its whole kernel is transfer. A kernel
  that is not matched (a group with ranks not loaded, a start-up instance) is one ``comm`` segment;
- before an event, the event that ended last on the same rank at or before its start (the latest-finishing
  predecessor, as in ppvis's path; events still running when it started ran beside it and are not on the path), and
  between the two the GPU was idle for that event: ``host sync`` when a blocking device-to-host sync returned in
  that stretch, ``launch-bound`` when the host launched it after the stretch began, else ``idle`` (a stream
  dependency, an event wait), the same rules as `tracelens.analysis.host.idle_gaps`.

The segments of a step are contiguous and their durations add up to the step's span: first GPU event start to last
GPU event end over all ranks (the tests assert it on every fixture). A trace with no profiler step marked is one
step, numbered -1: the profiled window. A hop that would come back to a (rank, time)
already visited (clocks or an unusual overlap of streams) is not followed; the wait stays on the path as a
``wait`` segment with its duration. Pure function of the analysis' tables; `CriticalPath` carries the text, the
JSON (`tracelens critpath`), summary.json's ``critical_path`` and the report section.
"""

from __future__ import annotations

import json
import re
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .. import categories as C
from ..errors import TraceError
from ..numbers import round3_array
from ..records import Records
from .host import SYNC_TOLERANCE_NS

try:  # the walk compiled (setup.py builds it where a C compiler exists); else `_walk_python`, the same walk
    from . import _walk
except ImportError:
    _walk = None

KINDS = ("compute", "launch-bound", "host sync", "idle", "transfer", "comm", "wait")
SEGMENT_COLUMNS = ["step", "rank", "start_ns", "end_ns", "dur_ns", "kind", "what", "op", "stage", "to_rank", "gpu_row"]
def _int_column(s: pd.Series) -> np.ndarray | list:
    """A column's values as int() gives them: the integer array itself, else int() of each value."""
    v = s.to_numpy()
    return v.astype(np.int64, copy=False) if v.dtype.kind in "iu" else [int(x) for x in v.tolist()]


STEP_COLUMNS = ["step", "start_ns", "end_ns", "span_ns", "end_rank", "segments", "hops", "ranks"]
KIND_TEXT = {"compute": "compute", "launch-bound": "GPU idle waiting for kernel launches",
             "host sync": "GPU idle after a blocking host sync", "idle": "GPU idle (stream or event dependency)",
             "transfer": "communication transfer", "comm": "communication (not matched across ranks)",
             "wait": "waiting for another rank (not followed)"}


@dataclass
class CriticalPath:
    """The critical path of each analyzed step (see the module docstring). ``problem``: why there is none, in one
    line (then the tables are empty)."""

    segments: pd.DataFrame  # SEGMENT_COLUMNS, each step's segments in time order
    steps: pd.DataFrame  # STEP_COLUMNS, one row per step
    problem: str = ""
    notes: list[str] = field(default_factory=list)
    # the segments with a duration and their cause, and the per-rank table: what by_cause, by_rank, rank_cause and
    # summary read (summary.json, the findings and the report each ask), built once
    # the walk's integer codes of the text columns kind, what, op and stage (`_segment_frame`): column -> (codes, its
    # distinct strings), so that the summaries below group and compare small ints, not the strings of every segment
    # (2.17M segments at 2 GB); absent (a path built otherwise), they are factorized from the columns
    codes: dict[str, tuple[np.ndarray, list[str]]] | None = field(default=None, repr=False, compare=False)
    _timed: pd.DataFrame | None = field(default=None, init=False, repr=False, compare=False)
    _causes: list[str] = field(default_factory=list, init=False, repr=False, compare=False)
    _by_rank: pd.DataFrame | None = field(default=None, init=False, repr=False, compare=False)
    _by_cause: pd.DataFrame | None = field(default=None, init=False, repr=False, compare=False)

    def _coded(self, col: str) -> tuple[np.ndarray, list[str]]:
        """The text column `col` of the segments as (codes, strings): one code per distinct string."""
        if self.codes is not None and col in self.codes and len(self.codes[col][0]) == len(self.segments):
            return self.codes[col]
        codes, uniq = pd.factorize(self.segments[col].astype(str))
        return codes, [str(u) for u in uniq]

    def _is(self, col: str, value: str) -> np.ndarray:
        """Where the text column `col` is `value` (compared as codes)."""
        codes, strings = self._coded(col)
        return codes == strings.index(value) if value in strings else np.zeros(len(codes), dtype=bool)

    def _caused(self) -> pd.DataFrame:
        """The segments with a duration: their rank, duration and cause (the columns by_cause and by_rank read); the
        cause as its index in `_causes`, the causes' labels sorted (so that grouping by the index orders groups as
        grouping by the label would)."""
        if self._timed is None:
            dur = self.segments["dur_ns"].to_numpy()
            timed = dur > 0
            kind, kinds = self._coded("kind")
            what, whats = self._coded("what")
            cause, self._causes = _cause(kind[timed], kinds, what[timed], whats)
            self._timed = pd.DataFrame({"rank": self.segments["rank"].to_numpy()[timed], "dur_ns": dur[timed],
                                        "cause": cause})
        return self._timed

    @property
    def available(self) -> bool:
        return not self.problem and not self.steps.empty

    @property
    def span_ns(self) -> int:
        return int(self.steps["span_ns"].sum()) if len(self.steps) else 0

    def by_cause(self) -> pd.DataFrame:
        """Time on the path by cause over the steps: compute per kernel category, transfer per collective family,
        idle per cause; ``share`` of the summed spans."""
        cols = ["cause", "ns", "share", "segments"]
        if self._by_cause is not None:
            return self._by_cause.copy()
        seg = self._caused()
        if seg.empty:
            return pd.DataFrame(columns=cols)
        # groupby("cause", sort=False).agg(ns=sum, segments=size): the causes in order of first appearance
        code, ns, size = _sums_by_code(seg["cause"].to_numpy(), seg["dur_ns"].to_numpy())
        out = pd.DataFrame({"cause": code, "ns": ns, "segments": size})
        out["cause"] = _text_column(out["cause"].to_numpy(), self._causes)
        out = out.sort_values("ns", ascending=False, kind="stable", ignore_index=True)
        out["share"] = out["ns"] / max(self.span_ns, 1)
        self._by_cause = out[cols]
        return self._by_cause.copy()

    def by_rank(self) -> pd.DataFrame:
        """Per rank: time on the path, its share, and the cause holding most of that rank's segments."""
        cols = ["rank", "ns", "share", "cause", "cause_ns"]
        if self._by_rank is not None:
            return self._by_rank.copy()
        seg = self._caused()
        if seg.empty:
            return pd.DataFrame(columns=cols)
        rows = []
        # per rank (in order) the time of each cause: one table of rank x cause sums (the causes of a rank's
        # segments have positive sums, the others 0), its largest the first of the largest in cause order
        ranks, at = np.unique(seg["rank"].to_numpy(), return_inverse=True)
        per = np.zeros((len(ranks), max(len(self._causes), 1)), dtype=np.int64)
        np.add.at(per, (at.reshape(-1), seg["cause"].to_numpy()), seg["dur_ns"].to_numpy().astype(np.int64))
        for r, row in zip(ranks.tolist(), per):
            top = int(np.argmax(row))
            rows.append({"rank": int(r), "ns": int(row.sum()), "cause": self._causes[top], "cause_ns": int(row[top])})
        out = pd.DataFrame(rows, columns=cols)
        out["share"] = out["ns"] / max(self.span_ns, 1)
        self._by_rank = out.sort_values("ns", ascending=False, kind="stable", ignore_index=True)[cols]
        return self._by_rank.copy()

    def hops(self) -> pd.DataFrame:
        """The hand-offs the path follows: per (from_rank, to_rank), how many."""
        seg = self.segments
        w = seg.loc[self._is("kind", "wait") & (seg["dur_ns"].to_numpy() == 0), ["rank", "to_rank"]]
        if w.empty:
            return pd.DataFrame(columns=["from_rank", "to_rank", "count"])
        out = w.groupby(["rank", "to_rank"]).size().reset_index(name="count")
        return out.rename(columns={"rank": "from_rank"}).sort_values("count", ascending=False, kind="stable", ignore_index=True)

    def top_ops(self, n: int = 8) -> pd.DataFrame:
        """The launching ops with the most compute on the path (with their stage)."""
        return self._top_compute(self._is("kind", "compute") & (self.segments["dur_ns"].to_numpy() > 0), n)

    def _top_compute(self, rows: np.ndarray, n: int) -> pd.DataFrame:
        """top_ops of the segments where `rows`: compute time per (op, stage), the `n` largest (ties in order of
        first appearance), grouped by the columns' codes (one per distinct string: the groups and their order are
        those of the strings)."""
        dur = self.segments["dur_ns"].to_numpy()[rows]
        if not len(dur):
            return pd.DataFrame(columns=["op", "stage", "ns", "share"])
        (op, ops), (stage, stages) = self._coded("op"), self._coded("stage")
        # groupby(["op", "stage"], sort=False) sums, sorted by time (stable: ties in order of first appearance)
        key, ns, _ = _sums_by_code(np.asarray(op)[rows].astype(np.int64) * len(stages)
                                   + np.asarray(stage)[rows].astype(np.int64), dur)
        top = np.argsort(-ns, kind="stable")[:n]
        out = pd.DataFrame({"op": key[top] // len(stages), "stage": key[top] % len(stages), "ns": ns[top]})
        out["op"] = _text_column(out["op"].to_numpy(), ops)
        out["stage"] = _text_column(out["stage"].to_numpy(), stages)
        out["share"] = out["ns"] / max(self.span_ns, 1)
        return out

    def rank_cause(self, rank: int) -> dict[str, Any] | None:
        """What dominates `rank`'s segments on the path: {share (of the path on that rank), cause, cause_share (of
        that rank's time on the path), ns, top_compute (its three ops with the most compute on the path, with their
        stage), waited_for (rank -> hand-offs: the path left it for a rank it was itself waiting for)}, or None when
        the path does not run through it."""
        br = self.by_rank()
        row = br[br["rank"] == rank]
        if row.empty:
            return None
        r = row.iloc[0]
        seg = self.segments
        mine, dur = seg["rank"].to_numpy() == rank, seg["dur_ns"].to_numpy()
        top = self._top_compute(mine & self._is("kind", "compute") & (dur > 0), 3)
        waited = seg.loc[mine & self._is("kind", "wait") & (dur == 0), "to_rank"].value_counts()
        return {"share": round(float(r["share"]), 4), "cause": str(r["cause"]),
                "cause_share": round(float(r["cause_ns"]) / max(float(r["ns"]), 1.0), 4), "ns": int(r["ns"]),
                "top_compute": [{"op": op, "stage": st, "us": round(v / 1e3, 3)}
                                for op, st, v in zip(top["op"], top["stage"], top["ns"].tolist())],
                "waited_for": {int(k): int(v) for k, v in waited.items()}}

    def summary(self, columnar: bool = False) -> dict[str, Any]:
        """summary.json's ``critical_path`` (docs/summary-json.md); ``columnar``: its per-step list as
        `tracelens.records.Records` (what summary.json's writer takes), else a list of dicts."""
        if not self.available:
            return {"available": False, "reason": self.problem or "no GPU activity in the analyzed steps"}

        def recs(df: pd.DataFrame, ns_cols=("ns",)) -> list[dict[str, Any]]:
            df = df.copy()
            for c in ns_cols:
                df[c] = df[c] / 1e3
            df = df.rename(columns={c: c[:-2] + "us" for c in ns_cols})
            if "share" in df:
                df["share"] = df["share"].round(4)
            return json.loads(df.to_json(orient="records", double_precision=3))

        return {"available": True,
                "steps": self._step_records() if columnar else self._step_records().to_list(),
                "span_us": round(self.span_ns / 1e3, 3),
                "by_cause": recs(self.by_cause()),
                "by_rank": recs(self.by_rank(), ("ns", "cause_ns")),
                "hops": json.loads(self.hops().to_json(orient="records")),
                "top_ops": recs(self.top_ops()),
                "notes": list(self.notes)}

    def _step_records(self) -> Records:
        """The summary's per-step records (step, span_us as round(span_ns / 1e3, 3), end_rank, hops, ranks), held as
        columns (`tracelens.records`): a namedtuple and a `round` per step took ~0.4 s at 80,000 steps, a dict per
        step ~1.1 s and ~0.6 GB at 800,000."""
        st = self.steps
        return Records({"step": _int_column(st["step"]),
                        "span_us": round3_array(st["span_ns"].to_numpy(dtype=np.int64) / 1e3),
                        "end_rank": _int_column(st["end_rank"]), "hops": _int_column(st["hops"]),
                        # (lists, as they are; Records gives each record a copy)
                        "ranks": [rk if type(rk) is list else list(rk) for rk in st["ranks"].tolist()]})

    def to_dict(self) -> dict[str, Any]:
        """The `tracelens critpath --json` document: the summary plus every segment (times in µs from the step's
        start, and absolute trace ns)."""
        out = {"schema_version": 1, **self.summary()}
        if self.available:
            seg = self.segments.copy()
            t0 = seg["step"].map(self.steps.set_index("step")["start_ns"])
            seg["start_us"] = (seg["start_ns"] - t0) / 1e3
            seg["dur_us"] = seg["dur_ns"] / 1e3
            out["segments"] = json.loads(seg.to_json(orient="records", double_precision=3))
        return out

    def to_text(self, top: int = 10) -> str:
        """What `tracelens critpath` prints."""
        if not self.available:
            return f"no critical path: {self.problem or 'no GPU activity in the analyzed steps'}"
        lines = []
        for s in self.steps.itertuples(index=False):
            lines.append(f"{'the profiled window (no step marked)' if s.step < 0 else f'step {s.step}'}: critical path {s.span_ns / 1e6:.3f} ms, ends on rank {s.end_rank}, runs through "
                         f"rank(s) {', '.join(map(str, s.ranks))} with {s.hops} hand-off(s)")
        lines.append(f"{'cause':<40} {'ms':>10} {'% path':>7} {'segments':>8}")
        for c in self.by_cause().head(top).itertuples(index=False):
            lines.append(f"{c.cause[:40]:<40} {c.ns / 1e6:>10.3f} {100 * c.share:>7.1f} {c.segments:>8}")
        lines.append("per rank: " + "; ".join(
            f"rank {r.rank} {r.ns / 1e6:.3f} ms ({100 * r.share:.0f}%; {100 * r.cause_ns / max(r.ns, 1):.0f}% {r.cause})"
            for r in self.by_rank().itertuples(index=False)))
        h = self.hops()
        if len(h):
            lines.append("hand-offs: " + ", ".join(
                f"rank {int(x.from_rank)} waits for rank {int(x.to_rank)} x{int(x['count'])}" for _, x in h.iterrows()))
        c = self.segments[(self.segments["kind"] == "compute") & (self.segments["stage"] != "")]
        if len(c):
            st = c.groupby("stage")["dur_ns"].sum().sort_values(ascending=False, kind="stable").head(5)
            lines.append("compute on the path, by stage: " + ", ".join(f"{k} {v / 1e6:.3f} ms" for k, v in st.items()))
        t = self.top_ops(5)
        if len(t):
            lines.append("compute on the path, by op: " + ", ".join(
                f"{o.op} [{o.stage or '-'}] {o.ns / 1e6:.3f} ms" for o in t.itertuples(index=False)))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _cause(kind: np.ndarray, kinds: list[str], what: np.ndarray, whats: list[str]) -> tuple[np.ndarray, list[str]]:
    """Segments' cause labels ('compute: GEMM', 'transfer: all_to_all', 'launch-bound', ...) from the codes of their
    kind and what, as (codes, labels): the labels distinct and sorted, made once per distinct (kind, what) pair (a
    2 GB trace's path has millions of segments and a few dozen pairs)."""
    pair, inv = _unique_small(kind.astype(np.int64) * len(whats) + what)
    per_pair = [k if k not in ("compute", "transfer", "comm") else f"{k}: {whats[p % len(whats)]}"
                for k, p in ((kinds[p // len(whats)], p) for p in pair.tolist())]
    labels = sorted(set(per_pair))
    at = {x: i for i, x in enumerate(labels)}
    return np.array([at[x] for x in per_pair], dtype=np.int64)[inv.reshape(-1)], labels


def _first_of_runs(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(v, return_index=True)` of a sorted array: each distinct value and where its run begins, by one
    comparison of neighbours (np.unique sorts or hashes again: 0.1-0.2 s a call at 800,000 steps)."""
    first = np.flatnonzero(np.r_[True, v[1:] != v[:-1]]) if len(v) else np.empty(0, dtype=np.intp)
    return v[first], first


def _unique_small(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(v, return_inverse=True)` of small non-negative codes by a table instead of a sort (the path's
    segments: 10^5 to millions, a few dozen distinct codes)."""
    if not len(v) or v.min() < 0 or v.max() >= 1 << 22:
        return np.unique(v, return_inverse=True)
    seen = np.zeros(int(v.max()) + 1, dtype=bool)
    seen[v] = True
    uniq = np.flatnonzero(seen)
    lut = np.zeros(len(seen), dtype=np.intp)
    lut[uniq] = np.arange(len(uniq))
    return uniq.astype(v.dtype), lut[v]


def _sums_by_code(code: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct code in order of first appearance (groupby(code, sort=False)): the code, the sum of `dur` (int64,
    exact) and the count."""
    uniq, inv = _unique_small(np.asarray(code).astype(np.int64))
    sums = np.zeros(len(uniq), dtype=np.int64)
    np.add.at(sums, inv, np.asarray(dur).astype(np.int64))
    first = np.full(len(uniq), len(inv), dtype=np.intp)
    np.minimum.at(first, inv, np.arange(len(inv)))
    order = np.argsort(first, kind="stable")
    return uniq[order], sums[order], np.bincount(inv, minlength=len(uniq))[order].astype(np.int64)


def _distinct_codes(codes: np.ndarray, strings: list[str]) -> tuple[np.ndarray, list[str]]:
    """`codes` into `strings` re-coded so that each distinct string has one code (`CriticalPath.codes`), in the
    smallest unsigned dtype that holds them."""
    remap, uniq = pd.factorize(np.array(strings, dtype=object))
    return remap.astype(np.min_scalar_type(max(len(uniq) - 1, 0)))[codes], [str(u) for u in uniq]


def unavailable(problem: str) -> CriticalPath:
    return CriticalPath(pd.DataFrame(columns=SEGMENT_COLUMNS), pd.DataFrame(columns=STEP_COLUMNS), problem=problem)


# ------------------------------------------------------------------------------------------------- the walk


def _stage_label(path: str, top_op: str) -> str:
    """Where in the step a kernel ran, from its record_function path (first four levels), else its launching op."""
    if path:
        return "/".join(path.split("/")[:4])
    if top_op.startswith("autograd::engine"):
        return "backward"
    if top_op.startswith("Optimizer.") or "optimizer" in top_op.lower():
        return "optimizer"
    return ""


def _action_offsets(actions: pd.DataFrame, gpu: pd.DataFrame, trace) -> dict[int, int]:
    """Per rank, the clock offset (actions' clock - trace ts) under which most of its pipeline actions fall inside
    its GPU span: 0, or the trace's baseTimeNanoseconds (jsonl times are epoch ns; see pipeline.trace_activity)."""
    base = {ri.rank: int(ri.base_time_ns or 0) for ri in getattr(trace, "ranks", [])}
    out = {}
    for r, g in gpu.groupby("rank"):
        acts = actions[actions["rank"] == r]
        if acts.empty:
            continue
        lo, hi = int(g["ts"].min()), int(g["end"].max())
        s, e = acts["start_ns"].to_numpy(np.int64), acts["end_ns"].to_numpy(np.int64)
        best, best_n = None, 0
        for off in dict.fromkeys((0, base.get(int(r), 0))):
            n = int(((s >= lo + off) & (e <= hi + off)).sum())
            if n > best_n:
                best, best_n = off, n
        if best is not None:
            out[int(r)] = best
    return out


def _pipeline_stages(pipeline, gpu: pd.DataFrame, trace) -> dict[int, tuple[np.ndarray, np.ndarray, list[str]]]:
    """Per rank: its pipeline actions on the trace's clock (starts, ends, labels like 'B s2'), sorted by start."""
    actions = getattr(pipeline, "actions", None)
    if actions is None or actions.empty:
        return {}
    off = _action_offsets(actions, gpu, trace)
    out = {}
    for r, g in actions.groupby("rank"):
        if int(r) not in off:
            continue
        g = g.sort_values("start_ns", kind="stable")
        out[int(r)] = (g["start_ns"].to_numpy(np.int64) - off[int(r)], g["end_ns"].to_numpy(np.int64) - off[int(r)],
                       [f"{k} s{s}" for k, s in zip(g["kind"].astype(str), g["stage"].astype(int))])
    return out


def _rank_file(trace, rank: int) -> str | None:
    for ri in getattr(trace, "ranks", []):
        if ri.rank == rank:
            return ri.path
    return None


P2P_OPS = {"c10d::send": "send", "c10d::recv_": "recv"}
_P2P_KERNEL = re.compile(r"SendRecv|Send|Recv", re.IGNORECASE)


def _peer(concrete: Any) -> int | None:
    """The peer of a c10d::send / c10d::recv_ op: its third concrete input (dst / src, a group rank)."""
    try:
        v = json.loads(concrete) if isinstance(concrete, str) else None
        return int(v[2]) if isinstance(v, list) and len(v) > 2 and str(v[2]).lstrip("-").isdigit() else None
    except ValueError:
        return None


def p2p_links(events: pd.DataFrame, gpu: pd.DataFrame) -> dict[int, list[int]]:
    """Each point-to-point kernel (GPU-table row) -> the peer kernels carrying the other side of its sends and
    receives. A rank's `c10d::send` / `c10d::recv_` ops belong to the first p2p kernel it launches at or after
    them (`batch_isend_irecv` coalesces several into one SendRecv kernel); the peer is the op's dst / src (mapped
    to a global rank through the process group's ranks when its `record_param_comms` names them); rank A's k-th
    send to B in a step pairs with B's k-th receive from A in that step (NCCL keeps each pair's order). Empty when
    the trace has no such ops (then `comm`'s matching by peers from the `nccl:*` annotations is all there is)."""
    if events is None or events.empty or gpu.empty or "concrete_inputs" not in events:
        return {}
    ops = events[C.isin(events["name"], frozenset(P2P_OPS))]
    if ops.empty:
        return {}
    k = gpu[gpu["is_comm"].to_numpy() & C.map_strings(gpu["name"], lambda n: bool(_P2P_KERNEL.search(n)))]
    k = k[k["launch_ts"].to_numpy() >= 0]
    rpc = events[C.isin(events["name"], frozenset({"record_param_comms"}))]
    queues: dict[tuple[int, int, str, int], list[int]] = {}  # (from, to, send|recv, step) -> kernel rows in order
    for r, o in ops.groupby("rank"):
        kr = k[k["rank"] == r].sort_values("launch_ts", kind="stable")
        if kr.empty:
            continue
        o = o.sort_values("ts", kind="stable")
        at = np.searchsorted(kr["launch_ts"].to_numpy(np.int64), o["ts"].to_numpy(np.int64), side="left")
        rr = rpc[rpc["rank"] == r]
        r_ts, r_ranks = rr["ts"].to_numpy(np.int64), C.strings(rr["pg_ranks"]) if len(rr) else np.array([])
        k_rows, k_step = kr.index.to_numpy(), kr["step"].to_numpy()
        for name, ts, dur, conc, i in zip(C.strings(o["name"]), o["ts"].to_numpy(np.int64),
                                          o["dur"].fillna(0).to_numpy(np.int64), C.strings(o["concrete_inputs"]), at):
            peer = _peer(conc)
            if peer is None or i >= len(kr):
                continue
            j = int(np.searchsorted(r_ts, ts, side="left"))
            if j < len(r_ts) and r_ts[j] <= ts + dur:  # its record_param_comms: the group's global ranks
                try:
                    ranks = json.loads(r_ranks[j])
                    peer = int(ranks[peer]) if isinstance(ranks, list) and 0 <= peer < len(ranks) else peer
                except (ValueError, TypeError):
                    pass
            row, step = int(k_rows[i]), int(k_step[i])
            kind = P2P_OPS[name]
            key = (int(r), peer, kind, step) if kind == "send" else (peer, int(r), kind, step)
            queues.setdefault(key, []).append(row)
    links: dict[int, list[int]] = {}
    for (src, dst, kind, step), rows in queues.items():
        if kind != "send":
            continue
        for a, b in zip(rows, queues.get((src, dst, "recv", step), [])):
            links.setdefault(a, []).append(b)
            links.setdefault(b, []).append(a)
    return links


# what the walk records per segment: (rank, start, end, kind, what, row, to_rank), seven int64 in one flat array
# (~56 bytes a segment; a 2 GB trace's path has millions of segments, which as tuples of Python objects and then
# object columns took ~900 MB and a third of the analysis' CPU time); the text columns are built from the codes
_K = {k: i for i, k in enumerate(KINDS)}
_W_NONE, _W_BEFORE, _W_CATEGORY = 0, 1, -1  # `what`: "", the late-start text, the row's category; >= 2: a family
_BEFORE = "before its first traced GPU work (the rank began the step late)"
_WIDTH = 7


def _rank_lists(on: np.ndarray, on_at: np.ndarray, rank_ids: np.ndarray) -> np.ndarray:
    """Per step, the list of its ranks with time on the path (`on`: step * len(rank_ids) + the rank's index, sorted;
    step k's entries at on_at[k]:on_at[k + 1]), as an object column whose steps with the same ranks share one list:
    a list per step was 143 MB for the 800,000 steps of a 2 GB trace, for a handful of distinct sets."""
    n_steps, n_ranks = len(on_at) - 1, max(len(rank_ids), 1)
    out = np.empty(n_steps, dtype=object)
    if not n_steps:
        return out
    idx = on % n_ranks
    if n_ranks <= 63:  # each step's set as a bit mask, the distinct masks' lists made once
        bits = np.zeros(n_steps, dtype=np.int64)
        np.bitwise_or.at(bits, on // n_ranks, np.left_shift(np.int64(1), idx.astype(np.int64)))
        masks, inv = np.unique(bits, return_inverse=True)
        lists = np.empty(len(masks), dtype=object)
        for j, m in enumerate(masks.tolist()):
            lists[j] = [int(rank_ids[i]) for i in range(n_ranks) if m >> i & 1]
        out[:] = lists[inv.reshape(-1)]
        return out
    shared: dict[tuple, list] = {}
    ranks = rank_ids[idx].tolist()
    for k, (a, b) in enumerate(zip(on_at[:-1].tolist(), on_at[1:].tolist())):
        t = tuple(ranks[a:b])
        out[k] = shared.setdefault(t, list(t))
    return out


def _codes(col: pd.Series) -> tuple[np.ndarray, list[str]]:
    """A (categorical) string column as (int64 codes, their strings); a missing value is "" (the last string). Of a
    large dictionary (the GPU events' names: one per profiler step in a trace of short steps) only the categories
    used are made strings, the codes renumbered over them (65 MB of strings at 800,000 steps otherwise)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        codes = col.cat.codes.to_numpy().astype(np.int64)
        cats_index = col.cat.categories
        if len(cats_index) > 4096:
            used = np.flatnonzero(np.bincount(codes + 1, minlength=len(cats_index) + 1)[1:])
            if len(used) * 4 < len(cats_index):
                renum = np.full(len(cats_index), -1, dtype=np.int64)
                renum[used] = np.arange(len(used))
                codes = np.where(codes < 0, -1, renum[codes])
                cats_index = cats_index.take(used)
        cats = C.category_strings(cats_index)
    else:
        codes, uniq = pd.factorize(C.strings(col))
        codes, cats = codes.astype(np.int64), [str(c) for c in uniq]
    return np.where(codes < 0, len(cats), codes), cats + [""]


def _text_column(codes: np.ndarray, strings: list[str]) -> Any:
    """The column of `strings[codes]`, typed as pandas types a column of those Python strings (its default string
    dtype), built from the codes without a Python string per row."""
    dtype = pd.Series(np.array([""], dtype=object)).dtype
    if isinstance(dtype, pd.StringDtype) and dtype.storage == "pyarrow":
        import pyarrow as pa

        # a take of the strings by the codes (a third of the time of a dictionary array cast to strings)
        out = pd.array(pa.array(strings, pa.large_string()).take(pa.array(codes, pa.int32())), dtype=dtype)
        pa.default_memory_pool().release_unused()  # the codes' and the dictionary's buffers, kept by Arrow's pool
        return out
    return np.array(strings, dtype=object)[codes]


def _steps_by_rank(gpu: pd.DataFrame) -> dict[int, np.ndarray]:
    """Per rank, the distinct steps of its GPU events, sorted (int64): one np.unique of the (rank, step) pairs, split
    by rank, not a Python int per GPU event (a third of the path's time on a 200 MB trace) nor per step."""
    rank = gpu["rank"].to_numpy().astype(np.int64)
    step = gpu["step"].to_numpy().astype(np.int64)
    if not len(rank):
        return {}
    lo, r0 = int(step.min()), int(rank.min())
    span = int(step.max()) - lo + 1
    keys = (rank - r0) * span + (step - lo)  # (r0 once: not a pass over the rows per key)
    size = (int(rank.max()) - r0 + 1) * span
    if size <= 2 * len(keys) + (1 << 20):  # the keys present, sorted: by a count per key (O(n)), else by sorting
        keys = np.flatnonzero(np.bincount(keys, minlength=size))
    else:
        keys = np.unique(keys)
    k_rank, k_step = keys // span + r0, keys % span + lo
    cut = np.flatnonzero(k_rank[1:] != k_rank[:-1]) + 1
    return dict(zip(k_rank[np.r_[0, cut]].tolist(), np.split(k_step, cut)))


def _first_missing_step(steps: list[int], ranks: list[int], have: dict[int, np.ndarray]) -> tuple[int, int] | None:
    """The first (step, rank), steps outer and ranks inner, of a step in `steps` that rank lacks in `have`
    (`_steps_by_rank`); None when every rank has every step. One isin per rank, not a lookup per (step, rank)."""
    want = np.asarray(steps, dtype=np.int64)
    first = None
    for r in ranks:
        miss = ~np.isin(want, have.get(r, np.empty(0, np.int64)))
        if miss.any() and (first is None or int(np.argmax(miss)) < first[0]):
            first = (int(np.argmax(miss)), r)
    return None if first is None else (steps[first[0]], first[1])


def critical_path(gpu: pd.DataFrame, instances: pd.DataFrame, syncs: pd.DataFrame, steps: list[int], *,
                  trace=None, pipeline=None, events: pd.DataFrame | None = None) -> CriticalPath:
    """The critical path of each step in `steps` (see the module docstring).

    gpu: the analysis's GPU table (rank, ts, end, is_comm, category, top_op, path, launch_ts, step; row labels as
    `instances.gpu_row` names them); instances: `tracelens.analysis.comm.collective_instances`; syncs:
    `tracelens.analysis.host.host_syncs`; trace: for the rank files (messages) and the pipeline clock; pipeline: a
    `PipelineAnalysis` (stage labels); events: the host events, for the peers of point-to-point kernels
    (`p2p_links`; default: the trace's). Raises TraceError (one line) for a step that some rank lacks, or for ranks
    that communicate with no collective matched across them."""
    if gpu.empty or not steps:
        return unavailable("no GPU activity in the analyzed steps")
    ranks = sorted(int(r) for r in gpu["rank"].unique())
    have = _steps_by_rank(gpu)
    bad = _first_missing_step(steps, ranks, have)
    if bad is not None:
        n, r = bad
        where = [x for x in have.get(r, np.empty(0, np.int64)).tolist() if x >= 0]
        raise TraceError(_rank_file(trace, r), f"rank {r} has no GPU work in step {n} (its steps: "
                         f"{', '.join(map(str, where)) or 'none'}), so no critical path of step {n} across ranks")
    if events is None and trace is not None:
        events = getattr(trace, "events", None)
    links = p2p_links(events, gpu)
    comm_ranks = sorted(int(r) for r in gpu.loc[gpu["is_comm"].to_numpy(), "rank"].unique())
    matched = instances[instances["cross_rank"] & ~instances["startup"]] if len(instances) else instances
    # point-to-point kernels matched as one group-wide sequence (no peers known) are not pairs: their "last rank"
    # says nothing about whom a kernel waited for
    matched = matched[(matched["family"] != "p2p") | (matched["peers"] != "")] if len(matched) else matched
    if len(comm_ranks) > 1 and matched.empty and not links:
        raise TraceError(_rank_file(trace, comm_ranks[0]), f"ranks {', '.join(map(str, comm_ranks))} run communication "
                         "kernels but no collective or send/receive is matched across them (different runs, or a "
                         "group with ranks not loaded): no critical path across ranks")
    # each matched comm kernel (GPU row): the last arrival of its instance (ns), the last rank, the family, and
    # the last rank's kernel (where a hop lands)
    arrival: dict[int, tuple[int, int, str, int]] = {}
    if len(matched):
        m = matched.assign(k_ts=gpu.loc[matched["gpu_row"], "ts"].to_numpy(np.int64))
        for _, g in m.groupby(["group", "peers", "seq"], sort=False):
            i = g["k_ts"].idxmax()
            a, last, last_row = int(g.at[i, "k_ts"]), int(g.at[i, "rank"]), int(g.at[i, "gpu_row"])
            for row, fam in zip(g["gpu_row"].tolist(), g["family"].tolist()):
                arrival[int(row)] = (a, last, str(fam), last_row)
    if links:  # a p2p kernel ends after every peer kernel it pairs with has begun
        lab = np.fromiter({x for row, peers in links.items() for x in (row, *peers)}, dtype=np.int64)
        where = gpu.index.get_indexer(lab)
        k_ts = dict(zip(lab.tolist(), gpu["ts"].to_numpy(np.int64)[where].tolist()))
        k_rank = dict(zip(lab.tolist(), gpu["rank"].to_numpy()[where].tolist()))
        for row, peers in links.items():
            j = max((row, *peers), key=lambda x, row=row: (k_ts[x], x == row))
            arrival[row] = (k_ts[j], int(k_rank[j]), "p2p", j)
    # The walk visits about one GPU event per segment (hundreds of thousands on a trace of many steps); everything
    # it reads is built here for every row, rank and step at once: each event's latest-finishing predecessor on
    # its rank (the common step back) by one searchsorted per rank, bisect finds the others (after a hop). Rows
    # are positions in the GPU table, ranks indices into `ranks`, all int64 arrays (`_walk`).
    ts_arr, end_arr = gpu["ts"].to_numpy(np.int64), gpu["end"].to_numpy(np.int64)
    rank_arr = gpu["rank"].to_numpy()
    rank_idx = np.searchsorted(np.asarray(ranks, dtype=np.int64), rank_arr.astype(np.int64))
    s_rank = syncs["rank"].to_numpy() if len(syncs) else np.empty(0)
    s_end = ((syncs["ts"] + (syncs["host_blocked_us"] * 1e3).astype(np.int64)).to_numpy(np.int64)
             if len(syncs) else np.empty(0, np.int64))
    pred_k = np.full(len(gpu), -1, np.int64)  # per GPU row: position in its rank's sorted ends of the event ending
    rank_ends, rank_at, rank_sync = [], [], []  # last at or before the row's start; per rank: the ends, their rows
    for r in ranks:
        mine = np.flatnonzero(rank_arr == r)
        at = mine[end_arr[mine] > ts_arr[mine]]
        at = at[np.lexsort((ts_arr[at], end_arr[at]))]  # the rank's events with a positive duration, by (end, start)
        ends = end_arr[at]
        pred_k[mine] = ends.searchsorted(ts_arr[mine], "right") - 1
        rank_ends.append(ends)
        rank_at.append(at.astype(np.int64))
        rank_sync.append(np.sort(s_end[s_rank == r]))  # sorted ends of the rank's blocking host syncs
    mine = at = ends = None  # (a rank's arrays: on a trace of one rank, as long as the GPU table)
    # the matched comm kernels: per GPU row its index in the arrival tables (-1: none); per matched kernel its
    # instance's last arrival, the last rank, the family's `what` code (from 2) and the last rank's kernel (where a
    # hop lands). (Tables of the matched kernels only: per-row arrays of each would touch 3 x 8 bytes a GPU row.)
    families: dict[str, int] = {}
    hit = np.full(len(gpu), -1, np.int64)
    hit_a, hit_last, hit_fam, hit_pos = (np.empty(0, np.int64),) * 4
    if arrival:
        hit[gpu.index.get_indexer(np.fromiter(arrival, dtype=np.int64, count=len(arrival)))] = np.arange(len(arrival))
        a_, last_, fam_, last_row_ = zip(*arrival.values())
        hit_a = np.asarray(a_, dtype=np.int64)
        hit_last = np.searchsorted(np.asarray(ranks, dtype=np.int64), np.asarray(last_, dtype=np.int64))
        hit_fam = np.asarray([families.setdefault(f, 2 + len(families)) for f in fam_], dtype=np.int64)
        hit_pos = gpu.index.get_indexer(np.asarray(last_row_, dtype=np.int64))
    del arrival
    stages = _pipeline_stages(pipeline, gpu, trace) if pipeline is not None else {}
    offsets = lambda parts: np.cumsum([0, *map(len, parts)], dtype=np.int64)
    cat = lambda parts: np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)
    # each step's first start, last end and the row ending last, for every step at once (a trace of many short
    # steps has tens of thousands)
    step_arr = gpu["step"].to_numpy()
    order = np.argsort(step_arr, kind="stable")
    ids, first = _first_of_runs(step_arr[order])
    t0_of = np.minimum.reduceat(ts_arr[order], first)
    ends_in_order = end_arr[order]
    t1_of = np.maximum.reduceat(ends_in_order, first)
    # the row ending last: the first such row in table order, as np.argmax over the step's rows gives
    is_last = ends_in_order == np.repeat(t1_of, np.diff(np.append(first, len(order))))
    cand = np.flatnonzero(is_last)
    last_of = order[cand[_first_of_runs(np.searchsorted(first, cand, "right") - 1)[1]]]
    at_step = np.searchsorted(ids, np.asarray(steps, dtype=ids.dtype))  # each walked step's position in `ids`
    launch = gpu["launch_ts"].to_numpy(np.int64) if "launch_ts" in gpu else np.full(len(gpu), -1, np.int64)
    walk_args = (ts_arr, end_arr, pred_k, launch, rank_idx, gpu["is_comm"].to_numpy().astype(np.int64), hit,
                 hit_a, hit_last, hit_fam, hit_pos, np.asarray(ranks, dtype=np.int64),
                 cat(rank_ends), cat(rank_at), offsets(rank_ends), cat(rank_sync), offsets(rank_sync),
                 t0_of[at_step].astype(np.int64), last_of[at_step].astype(np.int64))
    del pred_k, rank_ends, rank_at, rank_sync, hit, hit_a, hit_last, hit_fam, hit_pos
    walk_args = tuple(np.ascontiguousarray(x, dtype=np.int64) for x in walk_args)
    # what the walk does not need after this point goes now (a GPU row's worth of bytes each; at 2 GB they were
    # ~100 MB of the process's peak, which is reached after the walk)
    del rank_idx, launch, order, ends_in_order, is_last, cand, step_arr, ts_arr, end_arr, s_rank, s_end
    consts = (_K["compute"], _K["launch-bound"], _K["host sync"], _K["idle"], _K["transfer"], _K["comm"], _K["wait"],
              _W_CATEGORY, _W_BEFORE, _W_NONE, int(SYNC_TOLERANCE_NS))
    walk = _walk.walk if _walk is not None else _walk_python
    buf, blocks_b, unfollowed_b = walk(*walk_args, consts)
    end_rank = rank_arr[walk_args[-1]].tolist()
    del walk_args
    notes = [f"step {n}: {u} wait(s) not followed (the rank waited for had already been passed at that time: clocks "
             "or overlapping streams); they stay on the path as waits"
             for n, u in zip(steps, np.frombuffer(unfollowed_b, dtype=np.int64).tolist()) if u]
    rec = np.frombuffer(buf, dtype=np.int64).reshape(-1, _WIDTH) if len(buf) else np.empty((0, _WIDTH), np.int64)
    start = np.frombuffer(blocks_b, dtype=np.int64)  # where each step's records begin
    size = np.diff(np.append(start, len(rec)))
    blk = np.repeat(np.arange(len(start)), size)
    order = start[blk]
    order += order + size[blk] - 1 - np.arange(len(rec))  # each step's segments in time order (the walk: latest first)
    cols = [rec[:, i][order] for i in range(_WIDTH)]
    del rec, buf, order
    seg, codes = _segment_frame(cols, blk, np.asarray(steps, dtype=np.int64), gpu, families, stages)
    # per step: the hand-offs followed (zero-length waits) and the ranks with time on the path
    r_col, kind, dur = cols[0], cols[3], seg["dur_ns"].to_numpy()
    del cols
    hops = np.bincount(blk[(kind == _K["wait"]) & (dur == 0)], minlength=len(start))
    rank_ids = _unique_small(r_col)[0]
    on = _unique_small(blk[dur > 0] * len(rank_ids) + np.searchsorted(rank_ids, r_col[dur > 0]))[0]
    on_at = np.searchsorted(on // max(len(rank_ids), 1), np.arange(len(start) + 1))
    del r_col, kind, dur, blk  # (a record's worth each: before the steps' frame is built)
    if steps:  # column by column (tens of thousands of steps on a trace of short ones), the values a row each gave
        # (every step walked is some rank's GPU step, checked above: in `ids`, at `at_step`)
        t0 = t0_of.astype(np.int64)[at_step]
        t1 = t1_of.astype(np.int64)[at_step]
        step_frame = pd.DataFrame({
            "step": np.asarray(steps, dtype=np.int64), "start_ns": t0, "end_ns": t1, "span_ns": t1 - t0,
            "end_rank": np.asarray(end_rank, dtype=np.int64), "segments": size.astype(np.int64),
            "hops": hops.astype(np.int64), "ranks": _rank_lists(on, on_at, rank_ids)},
            columns=STEP_COLUMNS, copy=False)  # the columns are the frame's own (no consolidated second copy)
    else:
        step_frame = pd.DataFrame([], columns=STEP_COLUMNS)
    return CriticalPath(seg, step_frame, notes=notes, codes=codes)


def _walk_python(ts: np.ndarray, end: np.ndarray, pred: np.ndarray, launch: np.ndarray, rank: np.ndarray,
                 is_comm: np.ndarray, hit: np.ndarray, hit_a: np.ndarray, hit_last: np.ndarray, hit_fam: np.ndarray, hit_pos: np.ndarray,
                 rank_val: np.ndarray, ends_all: np.ndarray, at_all: np.ndarray, rank_off: np.ndarray,
                 sync_end: np.ndarray, sync_off: np.ndarray, step_t0: np.ndarray, step_last: np.ndarray,
                 consts: tuple[int, ...]) -> tuple[array, bytes, bytes]:
    """The walk of every step (the module docstring), as `_walk.walk` (tracelens/analysis/_walk.c, whose comment
    says what each argument is) does it: the reference, and the walk where that module is not built. The loop
    reads array('q') and lists, never numpy scalars (8 bytes a row; lists of Python ints took 40, +670 MB at 2 GB).
    Returns the records (7 int64 a segment: rank, start, end, kind, what, row, to_rank; each step's latest first)
    and, per step, where its records begin and its waits not followed (int64 bytes)."""
    K_COMPUTE, K_LAUNCH, K_SYNC, K_IDLE, K_TRANSFER, K_COMM, K_WAIT, W_CATEGORY, W_BEFORE, W_NONE, tol = consts
    ts_all, end_all, pred_all, launch_all = _ints(ts), _ints(end), _ints(pred), _ints(launch)
    rank_all, comm_all, rank_of = _ints(rank), _ints(is_comm), rank_val.tolist()
    hit_all = _ints(hit)
    fam_of, a_of, last_of, pos_of = hit_fam.tolist(), hit_a.tolist(), hit_last.tolist(), hit_pos.tolist()
    off, soff = rank_off.tolist(), sync_off.tolist()
    rank_ends = [_ints(ends_all[off[i]:off[i + 1]]) for i in range(len(rank_of))]
    rank_at = [_ints(at_all[off[i]:off[i + 1]]) for i in range(len(rank_of))]
    rank_sync = [sync_end[soff[i]:soff[i + 1]].tolist() for i in range(len(rank_of))]

    def idle_kind(r: int, gs: int, ge: int, launch: int) -> int:
        se = rank_sync[r]
        if se:
            k = bisect_left(se, ge) - 1
            if k >= 0 and se[k] >= gs - tol:
                return K_SYNC
        return K_LAUNCH if launch >= 0 and launch > gs else K_IDLE

    buf = array("q")
    blocks, unfollowed = array("q"), array("q")
    for t0, cur in zip(step_t0.tolist(), step_last.tolist()):  # cur: the row of the event being put on the path
        blocks.append(len(buf) // _WIDTH)
        r = rank_all[cur]
        visited: set[tuple[int, int]] = set()
        n_unfollowed = 0
        while True:
            lo_e, hi_e = ts_all[cur], end_all[cur]
            t = lo_e  # where the walk goes on from, on rank r
            succ_launch = launch_all[cur]
            h = hit_all[cur]
            if h >= 0:
                fam, a, last = fam_of[h], a_of[h], last_of[h]
                if last != r and a > lo_e:  # r waited for `last` until a: the transfer, then the hop
                    a = min(a, hi_e)  # (a kernel ending before its last peer began: clocks apart; hop at its end)
                    if a < hi_e:
                        buf.extend((rank_of[r], max(a, t0), hi_e, K_TRANSFER, fam, cur, -1))
                    if a <= t0:
                        break
                    if (last, a) not in visited:
                        visited.update({(r, a), (last, a)})
                        buf.extend((rank_of[r], a, a, K_WAIT, fam, cur, rank_of[last]))
                        r, t = last, a
                        succ_launch = launch_all[pos_of[h]]
                    else:
                        n_unfollowed += 1
                        buf.extend((rank_of[r], max(lo_e, t0), a, K_WAIT, fam, cur, rank_of[last]))
                else:
                    buf.extend((rank_of[r], max(lo_e, t0), hi_e, K_TRANSFER, fam, cur, -1))
            else:
                buf.extend((rank_of[r], max(lo_e, t0), hi_e, K_COMM if comm_all[cur] else K_COMPUTE, W_CATEGORY, cur, -1))
            if t <= t0:
                break
            ends = rank_ends[r]
            # the event that ended last at or before t
            k = pred_all[cur] if t == lo_e and rank_all[cur] == r else bisect_right(ends, t) - 1
            if k < 0 or ends[k] <= t0:
                if k < 0:
                    buf.extend((rank_of[r], t0, t, K_IDLE, W_BEFORE, -1, -1))
                else:
                    buf.extend((rank_of[r], t0, t, idle_kind(r, ends[k], t, succ_launch), W_NONE, -1, -1))
                break
            if ends[k] < t:
                buf.extend((rank_of[r], ends[k], t, idle_kind(r, ends[k], t, succ_launch), W_NONE, -1, -1))
            cur = rank_at[r][k]
        unfollowed.append(n_unfollowed)
    return buf, blocks.tobytes(), unfollowed.tobytes()


def _ints(x: np.ndarray) -> array:
    """An integer array as array('q'): indexed from Python as fast as a list, 8 bytes an element."""
    out = array("q")
    out.frombytes(np.ascontiguousarray(x, dtype=np.int64).tobytes())
    return out


def _segment_frame(cols: list[np.ndarray], blk: np.ndarray, steps: np.ndarray, gpu: pd.DataFrame,
                   families: dict[str, int], stages: dict[int, tuple[np.ndarray, np.ndarray, list[str]]]) -> pd.DataFrame:
    """SEGMENT_COLUMNS from the walk's records (`cols`: rank, start, end, kind, what, row, to_rank; `blk`: each
    record's index in `steps`): the text columns from codes, each compute segment's stage (`_stage_label`, or the
    pipeline action running at its midpoint on its rank) computed once per distinct value."""
    r_col, lo, hi, kind, what, row, to_rank = cols
    has_row = row >= 0
    at = np.where(has_row, row, 0)
    cat_codes, cats = _codes(gpu["category"])
    top_codes, tops = (_codes(gpu["top_op"]) if "top_op" in gpu
                       else (np.full(len(gpu), 0, np.int64), [""]))
    path_codes, paths = _codes(gpu["path"]) if "path" in gpu else (np.full(len(gpu), 0, np.int64), [""])
    what_strings = ["", _BEFORE, *families, *cats]  # (families in their code order: 2, 3, ...)
    what_codes = np.where(what == _W_CATEGORY, 2 + len(families) + cat_codes[at], what)
    op_codes = np.where(has_row, top_codes[at], len(tops) - 1)  # (the last string is "")
    stage_strings: list[str] = [""]
    intern: dict[str, int] = {"": 0}
    stage_codes = np.zeros(len(kind), np.int64)
    comp = np.flatnonzero(kind == _K["compute"])
    if len(comp):
        pair = path_codes[at[comp]] * len(tops) + top_codes[at[comp]]
        uniq, inv = np.unique(pair, return_inverse=True)
        lut = np.array([intern.setdefault(_stage_label(paths[u // len(tops)], tops[u % len(tops)]), len(intern))
                        for u in uniq.tolist()], dtype=np.int64)
        stage_codes[comp] = lut[inv.reshape(-1)]
        mid = (lo[comp] + hi[comp]) // 2
        for r, (s, e, lab) in stages.items():
            mine = np.flatnonzero(r_col[comp] == r)
            if not len(mine):
                continue
            k = np.searchsorted(s, mid[mine], "right") - 1
            ok = k >= 0
            ok[ok] = e[k[ok]] > mid[mine][ok]
            lab_codes = np.array([intern.setdefault(x, len(intern)) for x in lab], dtype=np.int64)
            stage_codes[comp[mine[ok]]] = lab_codes[k[ok]]
        stage_strings = list(intern)
    lab_arr = gpu.index.to_numpy().astype(np.int64)
    gpu_row = np.where(has_row, lab_arr[at] if len(lab_arr) else -1, -1)
    del at, has_row
    text = {"kind": _text_column(kind, list(KINDS))}
    codes = {"kind": _distinct_codes(kind, list(KINDS))}
    text["what"] = _text_column(what_codes, what_strings)
    codes["what"] = _distinct_codes(what_codes, what_strings)
    del what_codes
    text["op"] = _text_column(op_codes, tops)
    codes["op"] = _distinct_codes(op_codes, tops)
    del op_codes
    text["stage"] = _text_column(stage_codes, stage_strings)
    codes["stage"] = _distinct_codes(stage_codes, stage_strings)
    del stage_codes
    # copy=False: the columns are this frame's own (no second, consolidated copy of the int columns)
    return pd.DataFrame({"step": steps[blk], "rank": r_col, "start_ns": lo, "end_ns": hi, "dur_ns": hi - lo,
                         **text, "to_rank": to_rank, "gpu_row": gpu_row}, columns=SEGMENT_COLUMNS, copy=False), codes


def critical_path_of(analysis, step: int | None = None, *, instances: pd.DataFrame | None = None,
                     syncs: pd.DataFrame | None = None) -> CriticalPath:
    """The critical path of an analysis: of `step`, else of every step its window reads (the steady state).
    Raises TraceError for a step not in the traces, a step some rank lacks, or ranks with no matched collective."""
    a = analysis
    gpu = a.gpu
    if gpu.empty:
        return unavailable("no GPU activity in these traces (CPU-only): no GPU critical path")
    u = np.asarray(gpu["step"].unique())
    # the steps with GPU work, sorted, as an array (800,000 steps as a list and a set of Python ints: ~60 MB)
    known = np.sort(u[u >= 0]).astype(np.int64) if u.dtype.kind in "iu" else \
        np.asarray(sorted(int(s) for s in u if s >= 0), dtype=np.int64)
    if not len(known):  # no profiler step marked: the whole profiled window is the one "step" (-1)
        if step is not None:
            raise TraceError(None, f"step {step} is not in the traces: they mark no profiler step (the whole window "
                             "is analyzed without --step)")
        return critical_path(gpu, a.comm_instances() if instances is None else instances,
                             a.host_syncs() if syncs is None else syncs, [-1], trace=a.trace,
                             pipeline=getattr(a, "pipeline", None), events=a.trace.events)
    if step is not None:
        if not np.isin(int(step), known):
            raise TraceError(None, f"step {step} is not in the traces' GPU work (steps: "
                             f"{', '.join(map(str, known.tolist())) or 'none'})")
        steps = [step]
    else:
        sw = getattr(a, "window", None)
        used = [int(s) for s in getattr(sw, "used", [])] if sw is not None else []
        has = np.isin(np.asarray(used, dtype=np.int64), known).tolist() if used else []
        steps = [s for s, h in zip(used, has) if h] or known.tolist()
    inst = a.comm_instances() if instances is None else instances
    syncs = a.host_syncs() if syncs is None else syncs
    return critical_path(gpu, inst, syncs, steps, trace=a.trace, pipeline=getattr(a, "pipeline", None),
                         events=a.trace.events)


def path_entry(analysis, instances: pd.DataFrame, syncs: pd.DataFrame) -> CriticalPath:
    """The analysis's `critical_path` entry: the window's steps; bad input kept as the one-line problem."""
    try:
        return critical_path_of(analysis, instances=instances, syncs=syncs)
    except TraceError as e:
        return unavailable(e.one_line())


__all__ = ["KINDS", "CriticalPath", "critical_path", "critical_path_of", "p2p_links", "path_entry", "unavailable"]

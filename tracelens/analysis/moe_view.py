"""The MoE view: routing tied to kernel time and all-to-all traffic, per MoE layer and rank.

From the run's routing counts (``RUN/routing.json``, `Run.routing`: each rank's tokens per global expert per
MoE layer, per profiled step) and the trace:

- routed tokens per expert (``experts``: per layer, rank and expert; a step's figure is its mean over the
  window's steps) and the expert load imbalance, max / mean over a layer's experts of the tokens they
  receive from their EP group (``layer_summary``); the rank imbalance, max / mean of the rows each rank's
  experts receive;
- grouped-GEMM rows computed vs routed (``layers``, per layer and rank): the rows of each
  ``aten::_grouped_mm`` call (`tracelens.analysis.moe`'s count from its input dims) against the rows routed
  to the rank's experts per forward (micro-batch); the difference is padding (a sync-free worst-case buffer);
- expert GEMM time per layer and rank: the GPU time of the GEMM kernels of the ``moe/experts`` stage, the
  backward's found through the autograd sequence number of the forward op that made its node;
- all-to-all bytes per rank pair (``pairs``): what each token all-to-all (the ``all_to_all`` collectives of
  floating-point rows) sends to each peer, from its split sizes (``In split size``; none: an even split), per
  step; with routing counts, the routed bytes of the same calls (each call carries on average half of the
  rows routed s -> d plus those routed d -> s: dispatch and combine, forward and backward), so the padded share
  and the skew of both;
- the expert placement by load (`placement_preview`): per layer the expected rank imbalance under the run's
  placement and under the balanced one the trainer's ``ep_placement: balanced`` computes from this routing
  file (`moespec.placement`), so the gain shows before a run;
- the tie to the straggler: whether the late rank (the ``late_rank`` finding) is the one receiving the most
  routed rows, or spending the most time in expert GEMMs.

Without a routing file (a run from before the trainer wrote it, a trace from another framework) the view keeps
what the trace has: grouped-GEMM rows and time per layer and rank, all-to-all bytes per pair from the split
sizes; with a run manifest, the mean routed rows per rank (tokens x top_k); and says in one line what is
missing. Pure function of the analysis' tables and `Trace.run` (which reads the file).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from moespec.placement import contiguous_placement, imbalance, plan_layer

from .. import categories as C
from ..io.run import ROUTING
from .calltree import KIND_OP
from .comm import _parse_ranks, dtype_bytes
from .moe import _ELEM_BYTES, _grouped_rows, dispatch_facts

_LAYER_RE = re.compile(r"(?:^|/)layer/(\d+)(?:/|$)")
# another framework's MoE layer: a module or range with "moe" in its name (vLLM's FusedMoE_3, an op moe_forward)
_FOREIGN_MOE_RE = re.compile(r"moe", re.IGNORECASE)
_FOREIGN_INDEX_RE = re.compile(r"(?:^|/)[^/]*moe[^/]*?_(\d+)(?:/|$)", re.IGNORECASE)
_GROUPED_OPS = ("aten::_grouped_mm", "aten::_scaled_grouped_mm")
_FLOAT_DTYPES = ("float", "half", "bfloat16", "bf16", "fp8", "float8")
NO_LAYER = -1  # kernels outside any layer/<i> range (a trace from another framework)


# ------------------------------------------------------------------------------------------- the trace side


def _known(v: Any) -> bool:
    """Not None and not NaN."""
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _window_steps(a) -> list[int] | None:
    sw = getattr(a, "window", None)
    if sw is not None and getattr(sw, "restricts", False):
        u = np.asarray(sw.used)
        if u.ndim == 1 and u.dtype.kind == "i":  # (at once: a trace of many short steps has tens of thousands)
            return u.tolist()
        return [int(s) for s in sw.used]
    return None


def _step_count(a, gpu: pd.DataFrame) -> int:
    used = _window_steps(a)
    if used:
        return len(used)
    steps = gpu["step"].dropna()
    steps = steps[steps >= 0] if len(steps) else steps
    return max(int(steps.nunique()), 1)


def _per_value(values: np.ndarray, fn, dtype=bool) -> np.ndarray:
    """``fn`` once per distinct string of an object array, broadcast to its rows (as `categories.map_strings`).
    The distinct values by hashing (`pd.factorize`), not by a sorted categorical of a string copy of every row
    (~10x the time on the 10^5 kernel paths of a 200 MB trace)."""
    if not len(values):
        return np.zeros(0, dtype=dtype)
    codes, uniques = pd.factorize(values, use_na_sentinel=False)
    return np.array([fn(str(u)) for u in uniques], dtype=dtype)[codes]


def _layer_of(path: str, foreign: bool) -> int:
    m = _LAYER_RE.findall(path)
    if m:
        return int(m[-1])
    f = _FOREIGN_INDEX_RE.findall(path) if foreign else None
    return int(f[-1]) if f else NO_LAYER


def _strings_at(col: pd.Series, pos: np.ndarray) -> np.ndarray:
    """A (categorical) string column's values at positions `pos` as str ("" where missing), with a string made only
    for those positions' distinct values."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        lut = np.array(C.category_strings(col.cat.categories) + [""], dtype=object)
        return lut[col.cat.codes.to_numpy()[pos]]
    return C.strings(col.iloc[pos])


def _backward_forward_paths(a, op_rows: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """For each (innermost) op row of a kernel: the record_function path of the forward op whose autograd node
    the op runs in (its nearest ancestor that is a backward node with a sequence number), '' when none."""
    out = np.full(len(op_rows), "", dtype=object)
    ev, tree = a.trace.events, a.tree
    if not len(op_rows) or "seq" not in ev or tree is None or tree.empty:
        return out
    seq_np = ev["seq"].to_numpy()
    is_bwd = C.map_strings(tree["name"], lambda n: n.startswith("autograd::engine::evaluate_function")
                           or n.endswith(("Backward0", "Backward1")))
    parent = tree["parent"].to_numpy()
    cur = op_rows.astype(np.int64).copy()
    found = np.full(len(cur), -1, dtype=np.int64)
    for _ in range(6):  # the op, its autograd function, evaluate_function, ... (a few levels)
        ok = (cur >= 0) & (found < 0)
        if not ok.any():
            break
        pos = C.positions(tree.index, cur[ok])
        s = seq_np[C.positions(ev.index, cur[ok])]
        hit = (s >= 0) & is_bwd[pos]
        idx = np.flatnonzero(ok)
        found[idx[hit]] = s[hit]
        cur[idx] = parent[pos].astype(np.int64)
    need = found >= 0
    if not need.any():
        return out
    # the forward op of each (rank, seq): an op with that number, not a backward node, on the forward thread (the
    # tree's columns read at the ops' positions: no copy of the op rows, strings only for the candidates)
    op_pos = np.flatnonzero(tree["kind"].to_numpy() == KIND_OP)
    op_lab = tree.index.to_numpy()[op_pos]
    oseq = seq_np[C.positions(ev.index, op_lab)]
    cand = np.isin(oseq, np.unique(found[need])) & ~C.map_strings(
        tree["name"], lambda n: n.startswith("autograd::") or n.endswith(("Backward0", "Backward1")))[op_pos]
    if "fwd_tid" in ev:
        cand &= ev["fwd_tid"].to_numpy()[C.positions(ev.index, op_lab)] <= 0
    at = op_pos[cand]
    path = _strings_at(tree["path"], at)
    keep = path != ""
    rank_c, seq_c, path = tree["rank"].to_numpy()[at][keep].astype(np.int64), oseq[cand][keep].astype(np.int64), path[keep]
    # the first op of each number with a path, in tree order (the op that made the node; its children carry the same
    # number), looked up for each (rank, number) wanted
    want_rank, want_seq = ranks[need].astype(np.int64), found[need]
    span = int(max(seq_c.max(initial=0), want_seq.max(initial=0))) + 1
    keys, first = np.unique(rank_c * span + seq_c, return_index=True)
    want = want_rank * span + want_seq
    i = np.minimum(np.searchsorted(keys, want), max(len(keys) - 1, 0))
    hit = (keys[i] == want) if len(keys) else np.zeros(len(want), dtype=bool)
    got = np.full(len(want), "", dtype=object)
    got[hit] = path[first[i[hit]]]
    out[np.flatnonzero(need)] = got
    return out


def expert_gemm_kernels(a) -> pd.DataFrame:
    """The window's expert-GEMM kernels: rank, step, layer (-1: none known), backward, op_row, grouped (a
    ``_grouped_mm`` call), rows (its grouped M; -1 for other GEMMs), dur_us. Expert GEMMs are the GEMM kernels
    of the ``moe/experts`` stage (in a backward, of the forward op that made the node). In a trace without
    ``moe/`` ranges (another framework): the kernels of ``_grouped_mm`` calls and every kernel of an op or
    module named for MoE (vLLM's ``vllm::moe_forward`` in ``FusedMoE_<i>``; layer = that index); see
    `expert_kernel_kind`."""
    cols = ["rank", "step", "layer", "backward", "op_row", "grouped", "rows", "dur_us"]
    gpu = a.gpu
    if gpu is None or gpu.empty:
        return pd.DataFrame(columns=cols)
    used = _window_steps(a)
    any_moe = bool(C.map_strings(a.tree["path"], lambda p: "moe/" in p).any()) if a.tree is not None else False
    keep = ~gpu["is_comm"].to_numpy()
    if any_moe:
        keep &= C.map_strings(gpu["category"], lambda c: c in ("GEMM", "grouped GEMM"))
    if used is not None:
        keep &= gpu["step"].isin(used).to_numpy()
    if not any_moe and (a.tree is None or not C.map_strings(a.tree["path"], lambda p: bool(_FOREIGN_MOE_RE.search(p))).any()):
        # no path of the call tree names MoE, so neither can the path of the forward op of a kernel's backward (a
        # path of the tree): the expert kernels are those of grouped GEMMs and of ops or own paths named for MoE.
        # Only these go on to the walk to the forward op (which gives their path and backward flag), not every
        # kernel of a dense model
        keep &= (C.map_strings(gpu["op"], lambda o: o in _GROUPED_OPS or bool(_FOREIGN_MOE_RE.search(o)))
                 | C.map_strings(gpu["path"], lambda p: bool(_FOREIGN_MOE_RE.search(p))))
    g = gpu.loc[keep, ["rank", "step", "path", "op", "op_row", "op_input_dims", "dur"]]  # (only the columns read)
    if g.empty:
        return pd.DataFrame(columns=cols)
    own = C.strings(g["path"]).astype(object)
    in_experts = C.map_strings(g["path"], lambda p: "moe/experts" in p)
    back = np.zeros(len(g), dtype=bool)
    path = own.copy()
    rest = np.flatnonzero(~in_experts)
    if len(rest):
        fp = _backward_forward_paths(a, g["op_row"].to_numpy()[rest], g["rank"].to_numpy()[rest])
        hit = fp != ""
        path[rest[hit]] = fp[hit]
        back[rest[hit]] = True
    grouped = C.map_strings(g["op"], lambda o: o in _GROUPED_OPS)
    if any_moe:
        expert = _per_value(path, lambda p: "moe/experts" in p)
    else:
        named = C.map_strings(g["op"], lambda o: bool(_FOREIGN_MOE_RE.search(o))) | _per_value(
            path, lambda p: bool(_FOREIGN_MOE_RE.search(p)))
        expert = grouped | named
    g = g[expert]
    if g.empty:
        return pd.DataFrame(columns=cols)
    path, back, grouped = path[expert], back[expert], grouped[expert]
    layer = _per_value(path, lambda p: _layer_of(p, not any_moe), dtype=np.int64)
    rows = np.where(grouped, C.map_strings(g["op_input_dims"], lambda d: _grouped_rows(d) or -1, dtype=np.int64), -1)
    return pd.DataFrame({"rank": g["rank"].to_numpy().astype(int), "step": g["step"].to_numpy(), "layer": layer,
                         "backward": back, "op_row": g["op_row"].to_numpy().astype(np.int64), "grouped": grouped,
                         "rows": rows, "dur_us": g["dur"].to_numpy() / 1e3})


def expert_kernel_kind(gemm: pd.DataFrame, a) -> str:
    """What the expert kernels are, in words (the trainer's moe/experts GEMMs, grouped GEMMs, or the kernels of
    another framework's MoE ops)."""
    if a.tree is not None and C.map_strings(a.tree["path"], lambda p: "moe/" in p).any():
        return "expert GEMM"
    return "grouped-GEMM" if gemm["grouped"].all() else "MoE-op kernel"


def _is_count(dtype: Any) -> bool:
    """An integer all-to-all (a count exchange, not tokens); an unrecorded dtype is not known to be one."""
    if not _known(dtype) or not str(dtype) or str(dtype) == "nan":
        return False
    d = str(dtype).lower()
    return not any(x in d for x in _FLOAT_DTYPES)


def a2a_calls(a) -> pd.DataFrame:
    """The window's token all-to-alls (floating-point rows, or of no recorded dtype), one row per (call, sending
    rank, peer): rank, peer (-1: the trace names no peers), step, bytes (sent to that peer), split_source
    ("split sizes" | "even split" | "no peer list"), elem_bytes (0: unknown), call."""
    cols = ["rank", "peer", "step", "bytes", "split_source", "elem_bytes", "call"]
    inst = a.comm_instances() if hasattr(a, "comm_instances") else None
    if inst is None or inst.empty:
        return pd.DataFrame(columns=cols)
    x = inst[(inst["family"] == "all_to_all") & ~inst["startup"] & (inst["bytes"] > 0)]
    used = _window_steps(a)
    if used is not None:
        x = x[x["step"].isin(used)]
    if x.empty:
        return pd.DataFrame(columns=cols)
    ev = a.trace.events
    rows = x["gpu_row"].to_numpy().astype(np.int64)
    dtype = ev["dtype"].reindex(rows).astype(object).to_numpy() if "dtype" in ev else np.full(len(rows), None)
    split = ev["in_split"].reindex(rows).astype(object).to_numpy() if "in_split" in ev else np.full(len(rows), None)
    kern = a.comm_kernels().set_index("row")
    peers_of = kern["pg_ranks"].reindex(rows).to_numpy()
    out = []
    for i, (r, st, b) in enumerate(zip(x["rank"].to_numpy(), x["step"].to_numpy(), x["bytes"].to_numpy())):
        if _is_count(dtype[i]):
            continue  # a count exchange (int64), not tokens
        peers = peers_of[i] if isinstance(peers_of[i], tuple) else _parse_ranks(peers_of[i])
        if not peers:
            out.append((int(r), -1, int(st), float(b), "no peer list", dtype_bytes(dtype[i]) or 0, int(rows[i])))
            continue
        sp = None
        if isinstance(split[i], str) and split[i].startswith("["):
            try:
                sp = [int(v) for v in json.loads(split[i])]
            except (ValueError, TypeError):
                sp = None
        if sp and len(sp) == len(peers) and sum(sp) > 0:
            share, src = [v / sum(sp) for v in sp], "split sizes"
        else:
            share, src = [1.0 / len(peers)] * len(peers), "even split"
        eb = dtype_bytes(dtype[i]) or 0
        for p, s in zip(peers, share):
            out.append((int(r), int(p), int(st), float(b) * s, src, eb, int(rows[i])))
    return pd.DataFrame(out, columns=cols)


# ----------------------------------------------------------------------------------------- the routing side


def routing_tables(counts, steps: list[int] | None) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """From `RoutingCounts`: (experts, forwards, basis). ``experts``: layer, rank, expert, owner (global rank
    holding it), tokens (per step: mean over the chosen steps). ``forwards``: layer, rank, forwards per step.
    The chosen steps are the window's steps the file kept one by one, else all of the run (``basis`` says
    which)."""
    kept = set()
    for rc in counts.ranks.values():
        for lc in rc.layers.values():
            kept |= set(lc.steps)
    use = sorted(set(steps) & kept) if steps else sorted(kept)
    basis = f"profiled step(s) {', '.join(map(str, use))}" if use else f"all {counts.steps} steps of the run (mean)"
    recs, fw = [], []
    E = counts.n_experts
    for rank, rc in sorted(counts.ranks.items()):
        for lid, lc in sorted(rc.layers.items()):
            # where the layer's experts lived: the run's placement (ep_placement), else contiguous
            owners = [rc.ep_group[counts.ep_rank_of(e, lid, len(rc.ep_group))] for e in range(E)]
            if use:
                got = [lc.steps[s] for s in use if s in lc.steps]
                n = max(len(got), 1)
                tok = np.sum([c for _, c in got], axis=0) / n if got else np.zeros(E)
                f = sum(fw_ for fw_, _ in got) / n
            else:
                n = max(counts.steps, 1)
                tok, f = np.asarray(lc.total, dtype=float) / n, lc.total_forwards / n
            recs.append(pd.DataFrame({"layer": lid, "rank": rank, "expert": np.arange(E), "owner": owners,
                                      "tokens": np.asarray(tok, dtype=float)}))
            fw.append((lid, rank, float(f)))
    experts = pd.concat(recs, ignore_index=True) if recs else pd.DataFrame(
        columns=["layer", "rank", "expert", "owner", "tokens"])
    return experts, pd.DataFrame(fw, columns=["layer", "rank", "forwards"]), basis


def placement_preview(counts, ep: int | None = None) -> pd.DataFrame:
    """Per MoE layer, what ``ep_placement: balanced`` would gain (the trainer's `moespec.placement`, on this
    run's routing counts as ``ep_placement_loads``): the expected rank imbalance (max / mean of the rows each
    EP rank's experts receive, from every step's counts summed over the ranks) under the placement the run
    used (``now``: its recorded placement at its own EP size, else contiguous) and under the balanced one,
    whose experts per rank are ``ranks``. ``ep``: the EP size to place for (default: the run's). Empty when
    there is nothing to place (``ep`` < 2, or experts that do not split evenly)."""
    cols = ["layer", "ep", "placement_now", "imbalance_now", "imbalance_balanced", "swap_optimal", "ranks"]
    run_ep = max((len(rc.ep_group) for rc in counts.ranks.values()), default=1)
    ep = run_ep if ep is None else int(ep)
    E = counts.n_experts
    if ep < 2 or E % ep:
        return pd.DataFrame(columns=cols)
    loads: dict[int, list[int]] = {}
    for rc in counts.ranks.values():
        for lid, lc in rc.layers.items():
            acc = loads.setdefault(lid, [0] * E)
            for e, v in enumerate(lc.total):
                acc[e] += v
    rows = []
    for lid, v in sorted(loads.items()):
        if not any(v):
            continue
        where = counts.placement.get(lid) if ep == run_ep else None
        now = [[e for e in range(E) if where[e] == p] for p in range(ep)] if where else contiguous_placement(E, ep)
        lp = plan_layer(lid, v, ep)
        rows.append({"layer": lid, "ep": ep, "placement_now": "balanced" if where else "contiguous",
                     "imbalance_now": round(imbalance(v, now), 4), "imbalance_balanced": round(lp.imbalance_balanced, 4),
                     "swap_optimal": lp.swap_optimal, "ranks": [list(r) for r in lp.ranks]})
    return pd.DataFrame(rows, columns=cols)


# ------------------------------------------------------------------------------------------------ the view


@dataclass
class MoEReport:
    """The MoE view of an analysis: what `tracelens moe` prints and writes with --json, the report's MoE
    section and summary.json's ``moe``. Built by :func:`moe_report`."""

    source: str  # "routing file + trace" | "trace + manifest" | "trace"
    missing: str | None  # one line: what the input lacks and so what is not shown; None when nothing is
    steps: int  # window steps the per-step figures are over
    layers: pd.DataFrame  # per (layer, rank)
    layer_summary: pd.DataFrame  # per layer
    pairs: pd.DataFrame  # per (src, dst)
    experts: pd.DataFrame  # per (layer, rank, expert): routed tokens per step (routing file only)
    totals: dict[str, Any] = field(default_factory=dict)
    straggler: dict[str, Any] | None = None
    routing_basis: str | None = None
    # per layer: the expected rank imbalance now and under ep_placement=balanced (`placement_preview`)
    placement: pd.DataFrame = field(default_factory=pd.DataFrame)
    routing_file: str | None = None

    @property
    def empty(self) -> bool:
        return self.layers.empty and self.pairs.empty

    def tokens_per_expert(self) -> pd.DataFrame:
        """Layer x expert: routed tokens per step summed over ranks (the heatmap's grid); empty without routing."""
        if self.experts.empty:
            return pd.DataFrame()
        return self.experts.pivot_table(index="layer", columns="expert", values="tokens", aggfunc="sum")

    def pair_matrix(self, col: str = "sent_bytes") -> pd.DataFrame:
        """src x dst of one `pairs` column (bytes per step)."""
        p = self.pairs[self.pairs["dst"] >= 0] if not self.pairs.empty else self.pairs
        if p.empty or col not in p or p[col].isna().all():
            return pd.DataFrame()
        return p.pivot_table(index="src", columns="dst", values=col, aggfunc="sum")

    def summary(self) -> dict[str, Any] | None:
        """summary.json's ``moe`` block (docs/summary-json.md); None when the trace has no MoE work."""
        if self.empty:
            return None
        tpe = self.tokens_per_expert()
        return {
            "source": self.source, "missing": self.missing, "steps": self.steps, "routing_basis": self.routing_basis,
            **self.totals,
            "layers": _records(self.layer_summary), "ranks": _records(self.layers), "pairs": _records(self.pairs),
            "tokens_per_expert": {str(int(k)): [round(float(v), 3) for v in row] for k, row in tpe.iterrows()}
            if not tpe.empty else None,
            "straggler": self.straggler,
        }

    def to_dict(self) -> dict[str, Any]:
        """The `tracelens moe --json` document: the summary plus every (layer, rank, expert) record."""
        d = self.summary() or {"source": self.source, "missing": self.missing, "steps": self.steps}
        return {"schema_version": 1, **d, "experts": _records(self.experts), "placement": _records(self.placement)}

    def to_text(self) -> str:
        if self.empty:
            return "no MoE work in these traces (no expert GEMMs, no token all-to-all)"
        out = [f"MoE view ({self.source}; per step, over {self.steps} step(s)"
               + (f"; routing: {self.routing_basis}" if self.routing_basis else "") + ")"]
        if self.missing:
            out.append(f"note: {self.missing}")
        t = self.totals

        def pct(v):
            return "–" if not _known(v) else f"{100 * v:.1f}%"

        def num(v, fmt=",.0f"):
            return "–" if not _known(v) else format(v, fmt)

        if t.get("padding_share_rows") is not None:
            if t.get("gemm_computes_padding") is False:  # issue 33's trainer: offsets end at the routed rows
                out.append(f"grouped-GEMM buffer rows: {num(t['rows_computed'])}, {num(t['rows_routed'])} routed: "
                           f"{pct(t['padding_share_rows'])} padding (moved and sent; the GEMMs stop at the routed rows)")
            else:
                out.append(f"grouped-GEMM rows: {num(t['rows_computed'])} computed, {num(t['rows_routed'])} routed: "
                           f"{pct(t['padding_share_rows'])} padding")
        if t.get("a2a_padding_share_bytes") is not None:
            out.append(f"token all-to-all bytes: {num(t['a2a_sent_bytes'])} sent, {num(t['a2a_routed_bytes'])} "
                       f"routed: {pct(t['a2a_padding_share_bytes'])} padding")
        if not self.layer_summary.empty:
            out.append("")
            out.append(f"{'layer':>5} {'expert imb':>10} {'hottest':>8} {'rank imb':>9} {'expert ms':>9} {'padding':>8}")
            for r in self.layer_summary.itertuples(index=False):
                lay = "–" if r.layer == NO_LAYER else str(r.layer)
                out.append(f"{lay:>5} {num(r.expert_imbalance, '.2f'):>10} {num(r.hottest_expert, '.0f'):>8} "
                           f"{num(r.rank_imbalance, '.2f'):>9} {r.expert_gemm_us / 1e3:>9.3f} {pct(r.padding_share):>8}")
        if not self.layers.empty:
            out.append("")
            out.append(f"{'layer':>5} {'rank':>4} {'routed':>9} {'received':>9} {'GEMM calls':>10} {'rows/call':>10} "
                       f"{'routed/call':>11} {'padding':>8} {'expert ms':>9}")
            for r in self.layers.itertuples(index=False):
                lay = "–" if r.layer == NO_LAYER else str(r.layer)
                out.append(f"{lay:>5} {r.rank:>4} {num(r.routed_rows):>9} {num(r.received_rows):>9} "
                           f"{num(r.gemm_calls, '.0f'):>10} {num(r.rows_per_call):>10} {num(r.routed_rows_per_call):>11} "
                           f"{pct(r.padding_share):>8} {r.expert_gemm_us / 1e3:>9.3f}")
        if not self.pairs.empty:
            out.append("")
            src = self.pairs["split_source"].iloc[0] if "split_source" in self.pairs else ""
            out.append(f"token all-to-all per rank pair (MB per step; {src}):")
            out.append(f"{'src':>4} {'dst':>4} {'sent MB':>10} {'routed MB':>10} {'padding':>8}")
            for r in self.pairs.itertuples(index=False):
                dst = "?" if r.dst < 0 else str(r.dst)
                out.append(f"{r.src:>4} {dst:>4} {num(r.sent_bytes / 1e6, '.3f'):>10} "
                           f"{num(r.routed_bytes / 1e6, '.3f'):>10} {pct(r.padding_share):>8}")
            if t.get("pair_skew_sent") is not None or t.get("pair_skew_routed") is not None:
                out.append(f"pair skew (max / mean, off-diagonal): sent {num(t.get('pair_skew_sent'), '.2f')}, "
                           f"routed {num(t.get('pair_skew_routed'), '.2f')}")
        if not self.placement.empty:
            out.append("")
            pl = self.placement
            out.append(f"expert placement at ep={int(pl['ep'].iloc[0])}: expected rank imbalance (max / mean rows per EP "
                       "rank, every step's routing) now and balanced by load")
            out.append(f"{'layer':>5} {'now':>6} {'balanced':>9}  experts of each rank (balanced)")
            for r in pl.itertuples(index=False):
                now = f"{r.imbalance_now:.2f}" + ("*" if r.placement_now == "balanced" else "")
                out.append(f"{r.layer:>5} {now:>6} {r.imbalance_balanced:>9.2f}  "
                           + " | ".join(",".join(map(str, x)) for x in r.ranks))
            if (pl["placement_now"] == "balanced").any():
                out.append("(* the run's own balanced placement)")
            src = self.routing_file or "RUN/routing.json"
            out.append(f"train with: --set ep_placement=balanced --set ep_placement_loads={src}")
        if self.straggler:
            out.append("")
            out.append(f"straggler: {self.straggler['text']}")
        return "\n".join(out)


def _records(df: pd.DataFrame) -> list[dict]:
    if df is None or df.empty:
        return []
    return json.loads(df.to_json(orient="records", double_precision=6))


def _sum_min1(v: np.ndarray, min_count: int = 1) -> float:
    """`pd.Series(v).sum(min_count=min_count)` of a float array without the Series: NaN left out (summed as 0,
    as pandas does, so the float is the same), NaN when fewer than `min_count` values are known."""
    ok = ~np.isnan(v)
    if int(ok.sum()) < min_count:
        return float("nan")
    return np.where(ok, v, 0.0).sum() if not ok.all() else v.sum()


def _mean_skew(v: pd.Series) -> float | None:
    v = v.dropna()
    if v.empty or float(v.mean()) <= 0:
        return None
    return round(float(v.max() / v.mean()), 4)


def _gemm_by_key(gemm: pd.DataFrame) -> dict[tuple[int, int], tuple[int, float, float]]:
    """Per (layer, rank) of the expert-GEMM kernels: (grouped-GEMM calls with rows, their mean rows per call, the
    kernels' dur_us sum). One stable sort and a slice per key instead of filtering the table once per key (a model
    of 36 MoE layers: 36 filters of every kernel); each figure is the one of the filtered table: the same values
    in the same order, so numpy's sum (what pandas' sum and mean call) gives the same float."""
    if gemm.empty:
        return {}
    layer = gemm["layer"].to_numpy().astype(np.int64)
    rank = gemm["rank"].to_numpy().astype(np.int64)
    key = (layer - layer.min()) * (int(rank.max() - rank.min()) + 1) + (rank - rank.min())
    order = np.argsort(key, kind="stable")  # table order within a key
    bounds = np.flatnonzero(np.diff(key[order])) + 1
    dur = gemm["dur_us"].to_numpy()
    with_rows = gemm["grouped"].to_numpy().astype(bool) & (gemm["rows"].to_numpy() > 0)
    op_row = gemm["op_row"].to_numpy()
    rows = gemm["rows"].to_numpy()
    out = {}
    for idx in np.split(order, bounds):
        g = idx[with_rows[idx]]
        calls_n, rows_call = 0, float("nan")
        if len(g):
            _, first = np.unique(op_row[g], return_index=True)  # drop_duplicates("op_row"): each call's first row
            calls_n = len(first)
            r = rows[g[np.sort(first)]]
            rows_call = float(r.sum(dtype=np.float64) / np.float64(len(r)))  # (pandas' mean of the column)
        out[(int(layer[idx[0]]), int(rank[idx[0]]))] = (calls_n, rows_call, float(dur[idx].sum()))
    return out


def moe_report(analysis, late_rank: int | None = None) -> MoEReport:
    """The MoE view of an analysis (module docstring). ``late_rank``: the straggler to tie to (default: the
    ``late_rank`` finding's rank, if any). Raises `TraceError` (one line naming the file) for a routing file
    that is truncated, malformed or from another run."""
    a = analysis
    run = getattr(a.trace, "run", None)
    counts = run.routing() if run is not None else None
    cfg = run.config if run is not None else None
    gemm = expert_gemm_kernels(a)
    calls = a2a_calls(a)
    n_steps = _step_count(a, a.gpu) if a.gpu is not None and not a.gpu.empty else 1
    used = _window_steps(a)
    if used is None and a.steps is not None and len(a.steps):
        used = sorted(int(s) for s in a.steps["step"].unique())

    # ---- routing (file) -> received rows per (layer, rank), routed rows per pair per forward
    experts = pd.DataFrame(columns=["layer", "rank", "expert", "owner", "tokens"])
    fwd = pd.DataFrame(columns=["layer", "rank", "forwards"])
    basis = None
    if counts is not None:
        experts, fwd, basis = routing_tables(counts, used)
    # received rows per (layer, rank) per step: every sender's tokens for the experts the rank holds
    recv = experts.groupby(["layer", "owner"])["tokens"].sum() if not experts.empty else pd.Series(dtype=float)
    sent = experts.groupby(["layer", "rank"])["tokens"].sum() if not experts.empty else pd.Series(dtype=float)
    fw_map = fwd.set_index(["layer", "rank"])["forwards"] if not fwd.empty else pd.Series(dtype=float)

    # ---- per (layer, rank)
    keys = set()
    if not gemm.empty:
        keys |= set(zip(gemm["layer"].astype(int), gemm["rank"].astype(int)))
    if not experts.empty:
        keys |= set(zip(experts["layer"].astype(int), experts["rank"].astype(int)))
    trace_ranks = {int(r) for r in a.timeline["rank"].unique()} if not a.timeline.empty else set()
    mean_routed = None  # without routing counts: tokens x top_k per forward from the manifest (every rank's mean)
    chunks, dropped, computes_padding = 1, 0.0, True
    if cfg:
        try:
            chunks, dropped, computes_padding = dispatch_facts(run, cfg, int(cfg.get("ep", 1) or 1))
        except (TypeError, ValueError):
            pass
    if counts is None and cfg:
        try:
            mean_routed = float(int(cfg["micro_batch_size"]) * int(cfg["seq_len"]) * int(cfg["top_k"]))
        except (KeyError, TypeError, ValueError):
            mean_routed = None
    gemm_of = _gemm_by_key(gemm)
    rows = []
    for layer, rank in sorted(keys):
        calls_n, rows_call, gemm_sum = gemm_of.get((layer, rank), (0, float("nan"), None))
        fwds = float(fw_map.get((layer, rank), float("nan")))
        received = float(recv.get((layer, rank), float("nan"))) if counts is not None else float("nan")
        routed_call = received / fwds if counts is not None and fwds and _known(fwds) else (
            mean_routed if mean_routed is not None else float("nan"))
        # a grouped GEMM carries one overlap chunk; the capacity's drops (a run average: routing counts are the
        # router's, before the drop) leave its buffer too
        routed_call = routed_call / chunks * (1.0 - dropped)
        pad = max(1.0 - routed_call / rows_call, 0.0) if calls_n and _known(routed_call) else float("nan")
        gemm_us = gemm_sum / n_steps if gemm_sum is not None else 0.0
        mine = experts[(experts["layer"] == layer) & (experts["owner"] == rank)] if not experts.empty else experts
        local = mine.groupby("expert")["tokens"].sum() if not mine.empty else pd.Series(dtype=float)
        rows.append({
            "layer": int(layer), "rank": int(rank),
            "routed_rows": float(sent.get((layer, rank), float("nan"))) if counts is not None else float("nan"),
            "received_rows": received, "forwards": fwds,
            "local_expert_imbalance": _mean_skew(local) if len(local) else None,
            "gemm_calls": calls_n / n_steps if calls_n else float("nan"), "rows_per_call": rows_call,
            "routed_rows_per_call": routed_call, "padding_share": pad, "expert_gemm_us": gemm_us,
            # since issue 33 the grouped GEMMs stop at the routed rows: the padding costs no GEMM time
            "padded_gemm_us": (gemm_us * pad if computes_padding else 0.0) if _known(pad) else float("nan"),
        })
    layers = pd.DataFrame(rows, columns=["layer", "rank", "routed_rows", "received_rows", "forwards",
                                         "local_expert_imbalance", "gemm_calls", "rows_per_call", "routed_rows_per_call",
                                         "padding_share", "expert_gemm_us", "padded_gemm_us"])

    # ---- per layer
    summ = []
    # the rows of each layer as numpy columns, one slice per layer (36 MoE layers: not 36 pandas filters)
    lay = layers["layer"].to_numpy()
    comp_v = layers["rows_per_call"].to_numpy(dtype=float) * layers["gemm_calls"].to_numpy(dtype=float)
    rout_v = layers["routed_rows_per_call"].to_numpy(dtype=float) * layers["gemm_calls"].to_numpy(dtype=float)
    recv_v = layers["received_rows"].to_numpy(dtype=float)
    gemm_v = layers["expert_gemm_us"].to_numpy(dtype=float)
    for layer in np.unique(lay):
        at = np.flatnonzero(lay == layer)  # table order, as groupby's group
        loads = experts[experts["layer"] == layer].groupby("expert")["tokens"].sum() if not experts.empty else pd.Series(dtype=float)
        comp, rout = _sum_min1(comp_v[at]), _sum_min1(rout_v[at])
        summ.append({"layer": int(layer), "tokens": float(loads.sum()) if len(loads) else float("nan"),
                     "expert_imbalance": _mean_skew(loads) if len(loads) else None,
                     "hottest_expert": int(loads.idxmax()) if len(loads) and loads.max() > 0 else None,
                     "rank_imbalance": _mean_skew(pd.Series(recv_v[at])) if (~np.isnan(recv_v[at])).any() else None,
                     "expert_gemm_us": float(_sum_min1(gemm_v[at], 0)),
                     "padding_share": max(1.0 - rout / comp, 0.0) if _known(comp) and comp > 0 and _known(rout) else None})
    layer_summary = pd.DataFrame(summ, columns=["layer", "tokens", "expert_imbalance", "hottest_expert",
                                                "rank_imbalance", "expert_gemm_us", "padding_share"])

    # ---- per rank pair
    pairs = pd.DataFrame(columns=["src", "dst", "sent_bytes", "calls", "routed_bytes", "padding_share", "split_source"])
    elem = None
    if not calls.empty:
        per = calls.groupby(["rank", "peer"]).agg(sent=("bytes", "sum"), calls=("call", "nunique"))
        elem = int(calls["elem_bytes"].mode().iloc[0]) or None
        src_kind = ", ".join(sorted(calls["split_source"].unique()))
        pairs = pd.DataFrame({"src": per.index.get_level_values(0).astype(int), "dst": per.index.get_level_values(1).astype(int),
                              "sent_bytes": per["sent"].to_numpy() / n_steps, "calls": per["calls"].to_numpy() / n_steps,
                              "routed_bytes": np.nan, "padding_share": np.nan, "split_source": src_kind})
    if counts is not None:
        eb = elem or _ELEM_BYTES.get(str(counts.dtype).lower(), 2)
        row_bytes = counts.d_model * eb
        # rows routed s -> d per step, over the layers and their forwards (micro-batches)
        r_sd = experts.groupby(["rank", "owner"])["tokens"].sum()
        f_rank = fwd.groupby("rank")["forwards"].sum()  # MoE forwards per step, over the rank's layers
        ep_groups = any(len(rc.ep_group) > 1 for rc in counts.ranks.values())
        if pairs.empty and ep_groups:  # no all-to-all in the trace: the pairs the routing implies (4 calls per forward)
            idx = sorted(set(r_sd.index) | {(d, s) for s, d in r_sd.index})
            pairs = pd.DataFrame({"src": [s for s, _ in idx], "dst": [d for _, d in idx], "sent_bytes": np.nan,
                                  "calls": [4.0 * float(f_rank.get(s, 0.0)) for s, _ in idx], "routed_bytes": np.nan,
                                  "padding_share": np.nan, "split_source": "routing counts (no all-to-all in the trace)"})
        routed = []
        for s, d, c in zip(pairs["src"], pairs["dst"], pairs["calls"]) if not pairs.empty else ():
            f = float(f_rank.get(s, 0.0))
            both = float(r_sd.get((s, d), 0.0)) + float(r_sd.get((d, s), 0.0))
            # per MoE forward four token all-to-alls (dispatch and combine, forward and backward) carry the rows
            # routed s -> d twice and d -> s twice: each call, on average, half of both (c calls per step)
            # (with overlap chunks a call carries one chunk's rows; the capacity's drops do not travel)
            routed.append(c / f * (both / 2.0) * row_bytes / chunks * (1.0 - dropped) if f > 0 else np.nan)
        pairs["routed_bytes"] = routed if routed else np.nan
        ok = pairs["sent_bytes"] > 0
        pairs.loc[ok, "padding_share"] = (1.0 - pairs.loc[ok, "routed_bytes"] / pairs.loc[ok, "sent_bytes"]).clip(lower=0.0)

    # ---- totals
    totals: dict[str, Any] = {"gemm_computes_padding": computes_padding, "chunks_per_microbatch": chunks,
                              "dropped_share": round(dropped, 6)}
    gsel = layers[layers["gemm_calls"].notna()] if not layers.empty else layers
    if not gsel.empty:
        comp = float((gsel["rows_per_call"] * gsel["gemm_calls"]).sum())
        rout = float((gsel["routed_rows_per_call"] * gsel["gemm_calls"]).sum(min_count=1))
        totals.update(rows_computed=round(comp, 3), rows_routed=round(rout, 3) if _known(rout) else None,
                      padding_share_rows=round(max(1 - rout / comp, 0.0), 4) if comp > 0 and _known(rout) else None)
    totals["expert_gemm_us_per_rank"] = round(float(layers["expert_gemm_us"].sum()) / max(len(trace_ranks), 1), 3) \
        if not layers.empty else 0.0
    if not pairs.empty:
        sent_tot = float(pairs["sent_bytes"].sum(min_count=1))
        routed_tot = float(pairs["routed_bytes"].sum(min_count=1))
        if counts is None and mean_routed is not None and elem and cfg and not calls.empty:
            # no routing counts: every call carries tokens x top_k rows on average over the ranks
            routed_tot = (float(calls["call"].nunique()) / n_steps * mean_routed / chunks * (1.0 - dropped)
                          * int(cfg["d_model"]) * elem)
        off = pairs[(pairs["src"] != pairs["dst"]) & (pairs["dst"] >= 0)]
        totals.update(
            a2a_sent_bytes=round(sent_tot, 1) if _known(sent_tot) else None,
            a2a_routed_bytes=round(routed_tot, 1) if _known(routed_tot) else None,
            a2a_padding_share_bytes=round(max(1 - routed_tot / sent_tot, 0.0), 4)
            if _known(sent_tot) and sent_tot > 0 and _known(routed_tot) else None,
            pair_skew_sent=_mean_skew(off["sent_bytes"]), pair_skew_routed=_mean_skew(off["routed_bytes"]))
    for c in ("routed_rows", "received_rows", "gemm_calls", "rows_per_call", "routed_rows_per_call"):
        if c in layers:
            layers[c] = layers[c].astype(float).round(3)
    # ---- what is missing, in one line
    missing = None
    if counts is None and not (gemm.empty and calls.empty):  # (no MoE work at all: nothing is missing)
        where = f" ({run.root / ROUTING})" if run is not None and run.root is not None else ""
        lacks = "tokens per expert, expert load imbalance and routed bytes per rank pair are unknown"
        have = []
        if not gemm.empty:
            have.append(("grouped-GEMM rows and " if (gemm["rows"] > 0).any() else "") + expert_kernel_kind(gemm, a)
                        + " time per layer and rank")
        if not calls.empty:
            kinds = set(calls["split_source"])
            have.append("all-to-all bytes per rank" + (" (no peer list)" if kinds == {"no peer list"} else
                        " pair from " + " and ".join(sorted(k + "s" if k == "even split" else k
                                                            for k in kinds - {"no peer list"}))))
        if mean_routed is not None:
            missing = f"no routing file{where}: {lacks}; routed rows per rank are the manifest's mean (tokens x top_k)"
        else:
            missing = f"no routing file and no run manifest: {lacks}, and so is any padding"
        if have:
            missing += "; shown from the trace: " + ", ".join(have)
        if calls.empty and not gemm.empty:
            missing += "; no token all-to-all in the trace"
    source = "routing file + trace" if counts is not None else ("trace + manifest" if mean_routed is not None else "trace")
    rep = MoEReport(source=source, missing=missing, steps=n_steps, layers=layers, layer_summary=layer_summary,
                    pairs=pairs.reset_index(drop=True), experts=experts, totals=totals, routing_basis=basis,
                    placement=placement_preview(counts) if counts is not None else pd.DataFrame(),
                    routing_file=str(run.routing_path) if counts is not None and run.routing_path else None)
    if late_rank is None:
        late = next((f for f in a.findings() if f.get("type") == "late_rank"), None) if hasattr(a, "findings") else None
        late_rank = late["evidence"]["late_rank"] if late else None
    if late_rank is not None and not rep.layers.empty:
        rep.straggler = straggler_tie(rep.layers, int(late_rank))
    return rep


def straggler_tie(layers: pd.DataFrame, late: int) -> dict[str, Any] | None:
    """How the late rank's MoE work compares with the other ranks': the rows routed to it (when known) and its
    expert-GEMM time, each against the mean and the rank with the most; ``text`` says it in one sentence."""
    per = layers.groupby("rank").agg(received=("received_rows", lambda s: s.sum(min_count=1)),
                                     gemm_us=("expert_gemm_us", "sum"))
    if late not in per.index or len(per) < 2:
        return None
    out: dict[str, Any] = {"late_rank": late}
    parts = []
    if per["received"].notna().all():
        r = per["received"]
        top = int(r.idxmax())
        out.update(received_rows=round(float(r[late]), 1), mean_received_rows=round(float(r.mean()), 1),
                   most_received_rank=top, received_excess=round(float(r[late] / r.mean() - 1), 4) if r.mean() > 0 else None)
        if top == late:
            parts.append(f"it receives the most routed rows ({r[late]:,.0f} per step, "
                         f"{100 * (r[late] / r.mean() - 1):+.1f}% vs the mean)")
        else:
            parts.append(f"it receives {r[late]:,.0f} routed rows per step ({100 * (r[late] / r.mean() - 1):+.1f}% vs "
                         f"the mean; rank {top} the most): routing does not explain it")
    g = per["gemm_us"]
    if g.sum() > 0:
        top = int(g.idxmax())
        out.update(expert_gemm_us=round(float(g[late]), 3), mean_expert_gemm_us=round(float(g.mean()), 3),
                   most_expert_gemm_rank=top)
        parts.append(f"its expert GEMMs take {g[late] / 1e3:.3f} ms per step ({100 * (g[late] / g.mean() - 1):+.1f}% vs the "
                     f"mean{'' if top == late else f'; rank {top} the longest'})")
    if not parts:
        return None
    out["tied"] = bool(out.get("most_received_rank", out.get("most_expert_gemm_rank")) == late)
    out["text"] = f"rank {late} is the late rank (late_rank finding): " + "; ".join(parts)
    return out


def routing_tie(analysis, late: int) -> dict[str, Any] | None:
    """For the ``late_rank`` finding: `straggler_tie` from the run's routing counts (None without a routing
    file, or when it cannot be read: the MoE view says why)."""
    from ..errors import TraceError

    run = getattr(analysis.trace, "run", None)
    if run is None or run.routing_path is None:
        return None
    try:
        rep = moe_report(analysis, late_rank=late)
    except TraceError:
        return None
    return rep.straggler if rep.straggler and "received_rows" in rep.straggler else None


__all__ = ["MoEReport", "a2a_calls", "expert_gemm_kernels", "moe_report", "placement_preview", "routing_tables",
           "routing_tie", "straggler_tie"]

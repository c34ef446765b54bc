"""Step profiles: the measured step, event by event, in the form the what-if model replays.

A :class:`StepProfile` holds, for one rank and one profiled step of a run:

* ``work``: every unit of device work of the step, in host launch order. On a GPU trace a unit is a
  GPU event (kernel, memcpy, memset) with its stream, the host time its launch call started, when it
  ran and for how long. On a CPU-only trace (the CPU *is* the device) a unit is the self time of one
  CPU op (its duration minus its children's), run on the host thread.
* ``syncs``: the host's blocking calls (``cudaStreamSynchronize``, ``.item()``, ...), when they
  started and returned.
* For every unit: its **component** (what it does: :data:`COMPONENTS`) and how it **scales**:
  ``tokens`` (its work grows with the tokens of a micro-batch), ``params`` (once per step, with the
  parameters: the optimizer, gradient reduction), ``fixed``. The label comes from where the work
  sits in the program (record_function paths, including the forward path of a backward op through
  the autograd sequence number) and from its input shapes (a tensor with a dimension of
  ``micro_batch_size * seq_len`` tokens), never from a threshold.

Built from analysis tables (``Analysis.gpu``, ``Analysis.tree``, ``Analysis.steps``), not raw events.
"""

from __future__ import annotations

import itertools
import math
import re
from functools import lru_cache
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .. import categories as C
from ..analysis.calltree import KIND_ANNOTATION, KIND_OP, KIND_RUNTIME
from ..analysis.steps import pre_window_mask
from ..errors import TraceError
from ..io.run import Run

# Components of a step, in the order a report lists them: they add up to the step time. Device work
# first (communication counts only where no computation overlaps it: exposed), then device idle time
# by cause; "other" is any other kernel and idle time with no known cause.
# "collective waits" (a communication kernel spinning until the last rank of its collective arrives:
# tracelens.analysis.waits) is the decomposition's, out of the replay's exposed communication: the what-if's
# replay runs each kernel's transfer only, so it has none.
COMPONENTS = ("expert GEMMs", "dense GEMMs", "attention", "norms/activations", "optimizer step", "copies/casts",
              "exposed communication", "collective waits", "sync waits", "launch-bound idle", "pipeline bubble",
              "other")
IDLE_COMPONENTS = ("collective waits", "sync waits", "launch-bound idle", "pipeline bubble")
WORK_COMPONENTS = tuple(c for c in COMPONENTS if c not in IDLE_COMPONENTS)
# how each component's time scales when a knob changes (reported beside the decomposition)
SCALES = ("tokens", "params", "fixed")

_LAYER_RE = re.compile(r"(?:^|/)layer/(\d+)(?:/|$)")
# the optimizer: its record_function range (torch.optim wraps step/zero_grad), or a fused optimizer op;
# not any foreach op (FSDP copies parameters in and out with _foreach_copy_)
_OPTIMIZER_PATH_RE = re.compile(r"Optimizer\.(?:step|zero_grad)|clip_grad", re.IGNORECASE)
_OPTIMIZER_OP_RE = re.compile(r"_fused_adamw?_?\b|_fused_sgd|fused_adam", re.IGNORECASE)
_FSDP_RE = re.compile(r"FSDP::|post_backward_reduce|all_gather|reduce_scatter", re.IGNORECASE)
_MOE_TOKENS_RE = re.compile(r"(?:^|/)moe/(?:experts|permute|unpermute|dispatch|combine|router|gate|shared)")
_DIMS_RE = re.compile(r"\d+")


class ProfileError(ValueError):
    """A run the what-if model cannot build a step profile from: one line naming the run and why."""


@dataclass
class StepProfile:
    rank: int
    step: int
    device: str  # "gpu" or "cpu"
    start: int  # ns, host start of the step
    end: int  # ns, host end of the step
    work: pd.DataFrame  # see module docstring; columns in WORK_COLUMNS
    syncs: pd.DataFrame  # ts, end (ns), moe (bool: issued inside the MoE layer), path
    tokens: int  # tokens per micro-batch on this rank (micro_batch_size * seq_len)
    config: dict = field(default_factory=dict)
    # host time spent in the MoE expert stage's own CPU ops (outermost ops whose place, or whose forward's
    # place for a backward op, is moe/experts): intervals (ts, end) in ns; a per-expert backend runs
    # several ops per expert there, a grouped one a few per pass
    expert_host: pd.DataFrame = field(default_factory=lambda: pd.DataFrame({"ts": [], "end": [], "backward": []}))
    # per stream: how long (ns after the step's start) work launched before the step kept the stream busy
    # (a loop without a sync at the end of its step lets one step's GPU work run into the next)
    backlog: dict = field(default_factory=dict)
    # ns from the step's start to its first recorded host event: the profiler's own step transition
    # (it grows with the events of the step before: 9.5 ms at 12K events, 37 ms at 26K on the H100 proxy)
    # and any Python that records nothing; absent from unprofiled steps
    lead: int = 0

    @property
    def step_ns(self) -> int:
        return int(self.end - self.start)


WORK_COLUMNS = ["launch", "start", "dur", "stream", "name", "op", "path", "dims", "component", "scale", "expert",
                "moe_stage", "layer", "backward", "recompute", "is_comm"]


def tokens_per_microbatch(config: dict) -> int:
    return int(config.get("micro_batch_size") or 1) * int(config.get("seq_len") or 1)


def _forward_paths(tree: pd.DataFrame, events: pd.DataFrame) -> dict[tuple[int, int], str]:
    """(rank, autograd sequence number) -> the record_function path of the forward op that made the
    node, so a backward op inherits the forward's place (``layer/3/moe/experts``): the first forward op
    of the number (in tree order) with a non-empty path, else the first one.

    Names are tested once per distinct name and the first op per number is found by a sort, not per row
    in Python (a 200 MB trace has ~10^5-10^6 ops)."""
    if "seq" not in events:
        return {}
    ops = tree[(tree["kind"].to_numpy() == KIND_OP)]
    seq = events["seq"].reindex(ops.index).to_numpy()
    fwd = (seq >= 0) & C.map_strings(
        ops["name"], lambda n: not (n.startswith("autograd::") or n.endswith(("Backward0", "Backward1"))))
    if "fwd_tid" in events:
        ftid = events["fwd_tid"].reindex(ops.index).to_numpy()
        fwd &= ftid <= 0
    idx = np.flatnonzero(fwd)
    if not len(idx):
        return {}
    ranks = ops["rank"].to_numpy()[idx].astype(np.int64)
    seqs = seq[idx].astype(np.int64)
    paths = C.strings(ops["path"])[idx]
    has_path = C.map_strings(ops["path"], bool)[idx]
    order = np.lexsort((np.arange(len(idx)), ~has_path, seqs, ranks))
    r_o, s_o = ranks[order], seqs[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (r_o[1:] != r_o[:-1]) | (s_o[1:] != s_o[:-1])
    pick = order[first]
    return dict(zip(zip(ranks[pick].tolist(), seqs[pick].tolist()), (str(p) for p in paths[pick])))


@lru_cache(maxsize=4096)  # (a step's kernels repeat a few hundred input shapes)
def _token_shaped(dims: str, tokens: int, mbs: int, seq_len: int) -> bool:
    """Does an op's ``Input Dims`` text hold a tensor with the micro-batch's tokens in it?"""
    if not dims or dims == "nan":
        return False
    for tensor in re.findall(r"\[([0-9, ]*)\]", dims):
        d = [int(x) for x in _DIMS_RE.findall(tensor)]
        if not d:
            continue
        if tokens in d:
            return True
        if len(d) >= 2 and d[0] == mbs and seq_len in d[1:3]:
            return True
    return False


def _component(category: str, is_comm: bool, fpath: str, op: str, expert_path: bool) -> str:
    if is_comm or category == "communication":
        return "exposed communication"
    if _OPTIMIZER_PATH_RE.search(fpath) or _OPTIMIZER_OP_RE.search(op):
        return "optimizer step"
    if category == "grouped GEMM" or (category == "GEMM" and expert_path):
        return "expert GEMMs"
    if category == "GEMM":
        return "dense GEMMs"
    if category == "attention":
        return "attention"
    if category in ("elementwise", "reduction/norm"):
        return "norms/activations"
    if category == "memory":
        return "copies/casts"
    return "other"


def _scale(component: str, fpath: str, op: str, dims: str, tokens: int, mbs: int, seq_len: int) -> str:
    if component == "optimizer step":
        return "params"
    if component == "expert GEMMs":  # the routed tokens' rows, whatever their shape says
        return "tokens"
    # FSDP2's hooks work on parameters and gradients (casts, copy-ins and copy-outs, whole or flat), whatever module
    # they hook: an expert unit's cast under ``moe/experts/FSDP::pre_forward`` does not follow the tokens (only a
    # hook's cast of the module's inputs does, and that one is token-shaped)
    if _FSDP_RE.search(fpath) and not _token_shaped(dims, tokens, mbs, seq_len):
        return "params"
    if _MOE_TOKENS_RE.search(fpath):
        return "tokens"
    if _token_shaped(dims, tokens, mbs, seq_len):
        return "tokens"
    if _FSDP_RE.search(fpath):
        return "params"
    return "fixed"


def _choose_step(analysis, rank: int) -> int:
    st = analysis.steps[analysis.steps["rank"] == rank]
    if st.empty:
        return -1
    g = analysis.gpu
    if len(g):
        counts = g[g["rank"] == rank].groupby("step").size()
        counts = counts[counts.index >= 0]
        if len(counts) > 1:
            # not the first profiled step: its device work may queue behind work launched before the trace
            # began, which the trace does not show
            counts = counts[counts.index > counts.index.min()]
        if len(counts):
            # the profiled step with the most device work (a step cut by the profiler window has less)
            return int(counts.idxmax())
    return int(st["step"].iloc[len(st) // 2])


def profiles(analysis, config: dict, ranks: list[int] | None = None, steps: list[int] | None = None) -> list[StepProfile]:
    """Step profiles of an analyzed run: one per (rank, profiled step) (``steps``: these only)."""
    out = []
    for info in analysis.trace.ranks:
        if ranks is not None and info.rank not in ranks:
            continue
        st = analysis.steps[analysis.steps["rank"] == info.rank]
        want = [int(s) for s in st["step"]] if steps is None else steps
        for s in want:
            p = step_profile(analysis, config, info.rank, s)
            if p is not None:
                out.append(p)
    return out


def step_profile(analysis, config: dict, rank: int, step: int | None = None) -> StepProfile | None:
    """The profile of one rank's step (default: its fullest profiled step); None if it has none."""
    if step is None:
        step = _choose_step(analysis, rank)
    st = analysis.steps[(analysis.steps["rank"] == rank) & (analysis.steps["step"] == step)]
    if st.empty:
        return None
    start, end = int(st["start"].iloc[0]), int(st["end"].iloc[0])
    tokens = tokens_per_microbatch(config)
    mbs, seq_len = int(config.get("micro_batch_size") or 1), int(config.get("seq_len") or 1)
    tree = analysis.tree
    mine = (tree["rank"].to_numpy() == rank) & (tree["kind"].to_numpy() == KIND_OP)  # (4 columns, not the tree)
    fwd_paths = _forward_paths(tree.loc[mine, ["kind", "name", "path", "rank"]], analysis.trace.events)
    g_all = analysis.gpu
    g_all = g_all[g_all["rank"] == rank] if len(g_all) else g_all
    g = g_all[g_all["step"] == step] if len(g_all) else g_all
    backlog: dict = {}
    if len(g):
        # work queued before the trace began (a host that runs ahead of its device: the previous step's kernels,
        # their launches not recorded) runs inside the first profiled step's window without being its work: it is
        # that step's backlog, like the work launched before the step's start
        pre = pd.Series(pre_window_mask(g_all, tree), index=g_all.index)
        before = g_all[((g_all["launch_ts"].where(g_all["launch_ts"] >= 0, g_all["ts"]) < start) | pre)
                       & (g_all["end"] > start)]
        for st_, e_ in before.groupby("stream")["end"].max().items():
            backlog[int(st_)] = int(e_) - start
        own = ~pre.reindex(g.index).to_numpy()
        if own.any():
            g = g[own]
    if len(g):
        work = _attach_waits(_gpu_work(g, tree, analysis.trace.events, fwd_paths, tokens, mbs, seq_len), analysis)
        _attach_fill(work, g, tree, _device_props(analysis, rank))
        device = "gpu"
    else:
        work = _cpu_work(tree, analysis.trace.events, rank, start, end, fwd_paths, tokens, mbs, seq_len)
        device = "cpu"
    syncs = _syncs(tree, rank, start, end)
    return StepProfile(rank, int(step), device, start, end, work, syncs, tokens, dict(config),
                       _expert_host(tree, analysis.trace.events, rank, start, end, fwd_paths), backlog,
                       _lead(tree, rank, start, end))


def _device_props(analysis, rank: int) -> dict:
    for info in analysis.trace.ranks:
        if info.rank == rank and info.device_properties:
            return dict(info.device_properties[0])
    return {}


_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
             "aten::_grouped_mm", "aten::_scaled_mm"}
_ATTN_RE = re.compile(r"attention|flash|sdpa|_efficient_att", re.IGNORECASE)
_TILE_RE = re.compile(r"_(\d+)x(\d+)_\d+x\d+")  # cuBLAS / nvjet / CUTLASS names: <tile M>x<tile N>_<K>x<stages>
_DEFAULT_TILE = (128, 128)
_ATTN_TILE = 128  # query rows per attention tile (flash attention on sm80/sm90: 64-128)


def _shapes(dims: str) -> list[list[int]]:
    out = []
    for part in re.findall(r"\[([\d,\s]*)\]", dims or ""):
        nums = [int(x) for x in re.findall(r"\d+", part)]
        out.append(nums)
    return out


def _gemm_tiles(op: str, dims: str, name: str) -> float | None:
    """Output tiles of a GEMM op from its input shapes and the kernel's tile (from its name; 128 x 128 if the
    name has none): A [.., M, K] x B [.., K, N] -> ceil(M/tm) ceil(N/tn), times the batch (bmm) or the groups of
    a grouped GEMM whose operands are both 2-D (the weight gradient: one output per group). A GEMM whose reduction
    K is its longest dimension (a weight gradient: the tokens are K) keeps its tiles whatever the tokens, each
    tile's work growing with K: infinite (it is as full as it was)."""
    sh = [d for d in _shapes(dims) if len(d) >= 2]
    pair = next(((x, y) for x, y in itertools.pairwise(sh) if x[-1] == y[-2]), None)  # addmm's bias comes first
    if pair is None:
        return None
    a, b = pair
    m_, k_, n_ = a[-2], a[-1], b[-1]
    if k_ > max(m_, n_):
        return math.inf
    mt = _TILE_RE.search(name or "")
    tm, tn = (int(mt.group(1)), int(mt.group(2))) if mt else _DEFAULT_TILE
    tiles = math.ceil(m_ / tm) * math.ceil(n_ / tn)
    if len(a) == 3 and len(b) == 3:
        tiles *= a[0]
    return float(tiles)


def _attention_tiles(dims: str) -> float | None:
    sh = [d for d in _shapes(dims) if len(d) == 4]
    if not sh:
        return None
    b, h, sq = sh[0][0], sh[0][1], sh[0][2]
    return float(b * h * math.ceil(sq / _ATTN_TILE))


def _attach_fill(work: pd.DataFrame, g: pd.DataFrame, tree: pd.DataFrame, props: dict) -> None:
    """Per unit: ``fill``, the waves of work it had on the GPU (NaN where unknown), and ``launch_dur``, the
    duration (ns) of the host call that launched it (0 where none is linked).

    A kernel's time follows its waves: its independent pieces of work over what the SMs hold at once. A GEMM
    (and attention) kernel on sm90 is persistent: it launches one block per SM whatever its size and loops over
    its output tiles, so its fill is its tiles (from the launching op's input shapes and the kernel's tile
    size) over the SMs; any other kernel's is its blocks (grid) over the SMs x the blocks an SM holds at that
    block size (an upper bound on residency: registers and shared memory may allow fewer)."""
    sms = props.get("numSms") or props.get("multiProcessorCount")
    per_sm_threads = props.get("maxThreadsPerMultiprocessor") or 2048
    n = len(work)
    fill = np.full(n, np.nan)
    launch_dur = np.zeros(n)
    rows = work["gpu_row"].to_numpy(np.int64)
    lrow = g["launch"].reindex(rows).to_numpy() if "launch" in g else np.full(n, -1)
    ok = lrow >= 0
    if ok.any():
        launch_dur[ok] = tree["dur"].reindex(lrow[ok]).fillna(0).to_numpy(float)
    work["launch_dur"] = launch_dur
    if not sms:
        work["fill"] = fill
        return
    grid = C.strings(g["grid"].reindex(rows)) if "grid" in g else np.full(n, "", dtype=object)
    block = C.strings(g["block"].reindex(rows)) if "block" in g else np.full(n, "", dtype=object)
    cat = C.strings(g["category"].reindex(rows)) if "category" in g else np.full(n, "", dtype=object)
    ops, dims, names = work["op"].to_numpy(), work["dims"].to_numpy(), work["name"].to_numpy()

    def fill_of(i: int) -> float:
        f = np.nan
        tiles = None
        if ops[i] in _GEMM_OPS or "GEMM" in str(cat[i]):
            tiles = _gemm_tiles(str(ops[i]), str(dims[i]), str(names[i])) if ops[i] in _GEMM_OPS else None
        elif _ATTN_RE.search(str(ops[i])) or str(cat[i]) == "attention":
            tiles = _attention_tiles(str(dims[i]))
        if tiles is not None:
            f = tiles / sms
        else:
            gd = [int(x) for x in re.findall(r"\d+", str(grid[i]))]
            bd = [int(x) for x in re.findall(r"\d+", str(block[i]))]
            if gd and bd and ops[i] not in _GEMM_OPS and not _ATTN_RE.search(str(ops[i])):
                threads = max(int(np.prod(bd)), 1)
                resident = max(1, min(32, per_sm_threads // threads))
                f = float(np.prod(gd)) / (sms * resident)
        return f

    # a step's kernels share few (op, shapes, name, grid, block, category) combinations: each computed once (the
    # combinations of the columns' codes: one per distinct string, so the same groups, at most split)
    at = g.index.get_indexer(rows) if len(rows) else rows
    gid, first = _key_ids([_codes(g[c])[at] if c in g else np.zeros(n, np.int64)
                           for c in ("op", "op_input_dims", "name", "grid", "block", "category")])
    fill = np.array([fill_of(i) for i in first.tolist()], dtype=float)[gid] if n else fill
    work["fill"] = fill


def _attach_waits(work: pd.DataFrame, analysis) -> pd.DataFrame:
    """Each unit's ``wait`` (ns) and ``wait_kind``: the part of a communication kernel spent waiting for another
    rank (``peer``, ``startup``) or for the neighbour pipeline stage (``pipeline``), from the analysis's
    `comm_waits` (tracelens.analysis.waits); 0 and '' for every other unit and where no wait is known."""
    work["wait"] = np.zeros(len(work), dtype=np.int64)
    work["wait_kind"] = np.full(len(work), "", dtype=object)
    get = getattr(analysis, "comm_waits", None)
    if get is None or not work["is_comm"].any() or len(getattr(analysis.trace, "ranks", ())) < 2:
        return work
    kw = get()
    if kw is None or kw.empty:
        return work
    rows = work["gpu_row"].to_numpy(np.int64)
    hit = np.isin(rows, kw.index.to_numpy())
    if hit.any():
        k = kw.loc[rows[hit]]
        work.loc[hit, "wait"] = np.minimum(k["wait_ns"].to_numpy(np.int64), work.loc[hit, "dur"].to_numpy(np.int64))
        work.loc[hit, "wait_kind"] = k["kind"].to_numpy(dtype=object)
    return work


def _paths_of(tree: pd.DataFrame, events: pd.DataFrame, rows: np.ndarray, fwd_paths: dict, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(path to classify by, is backward) per tree row: a backward op's own path if it has one, else the
    path of the forward op that created its autograd node."""
    n = len(rows)
    ok = rows >= 0
    path = np.full(n, "", dtype=object)
    back = np.zeros(n, dtype=bool)
    if not ok.any():
        return path, back
    at = C.positions(tree.index, rows[ok])  # rows are tree labels
    path[ok] = C.strings(tree["path"].iloc[at]) if n else path[ok]
    if "seq" in events:
        seq = np.full(n, -1, dtype=np.int64)
        seq[ok] = events["seq"].reindex(rows[ok]).fillna(-1).to_numpy(dtype=np.int64)
        is_bwd = np.zeros(n, dtype=bool)  # (tested once per distinct name)
        is_bwd[ok] = C.map_strings(tree["name"].iloc[at], lambda nm: nm.startswith("autograd::engine::evaluate_function")
                                   or nm.endswith(("Backward0", "Backward1")))
        bw = np.flatnonzero(ok & (seq >= 0) & is_bwd)
        back[bw] = True
        new = []
        for p, s in zip(path[bw].tolist(), seq[bw].tolist()):  # (plain lists: no numpy scalar per element)
            fp = fwd_paths.get((rank, s))
            new.append(p if fp is None else (f"{p}/{fp}" if p and fp else (fp or p)))
        path[bw] = new
    return path, back


def _classify_kernel(cat: str, is_comm: bool, p: str, op: str, dims: str, back: bool, own: str, tokens: int, mbs: int,
                     seq_len: int) -> tuple:
    """(component, scale, expert, moe stage, layer, recompute) of a kernel from what `_gpu_work` knows of it."""
    comp = _component(cat, is_comm, p, op, "moe/experts" in p)
    m = re.search(r"moe/(\w+)", p)
    lm = _LAYER_RE.findall(p)
    # a layer's forward range ("layer/<i>" in the kernel's own path) opened inside an autograd
    # backward function: activation checkpointing running that layer's forward again
    return (comp, _scale(comp, p, op, dims, tokens, mbs, seq_len), comp == "expert GEMMs",
            f"moe/{m.group(1)}" if m else "", int(lm[-1]) if lm else -1, back and _LAYER_RE.search(own) is not None)


def _codes(col: pd.Series) -> np.ndarray:
    """A (categorical) string column's codes: equal codes, equal strings (a column of strings: its values)."""
    return col.cat.codes.to_numpy() if isinstance(col.dtype, pd.CategoricalDtype) else C.strings(col)


def _key_ids(cols: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the id of its combination of the `cols` values (ids in order of first appearance), and each id's
    first row: the rows a loop keeping a dict of computed keys would compute, by one hash factorization per
    column instead of a tuple and a dict lookup per row (the results, a pure function of the key, are the same)."""
    n = len(cols[0])
    gid = np.zeros(n, dtype=np.int64)
    for c in cols:
        codes, uniq = pd.factorize(c, use_na_sentinel=False)
        gid = pd.factorize(gid * max(len(uniq), 1) + codes)[0].astype(np.int64)
    first = np.ones(n, dtype=bool)  # a row whose id is new (ids are given in order, each one more than the last)
    first[1:] = gid[1:] > np.maximum.accumulate(gid)[:-1]
    return gid, np.flatnonzero(first)


def _gpu_work(g: pd.DataFrame, tree: pd.DataFrame, events: pd.DataFrame, fwd_paths: dict, tokens: int, mbs: int,
              seq_len: int) -> pd.DataFrame:
    g = g.sort_values(["launch_ts", "ts"], kind="stable")
    rank = int(g["rank"].iloc[0])
    top = g["top_op_row"].to_numpy()
    fpath, back = _paths_of(tree, events, top, fwd_paths, rank)
    own = C.strings(g["path"])
    # the kernel's own record_function path when it has one (forward, optimizer), else its forward's
    path = np.where(own != "", own, fpath)
    path = np.where((own != "") & (fpath != "") & (fpath != own) & back, fpath + "/" + own, path).astype(object)
    cat = C.strings(g["category"])
    op = C.strings(g["op"])
    dims = C.strings(g["op_input_dims"])
    is_comm = g["is_comm"].to_numpy()
    n = len(g)
    comp = np.empty(n, dtype=object)
    scale = np.empty(n, dtype=object)
    expert = np.zeros(n, dtype=bool)
    stage = np.empty(n, dtype=object)
    layer = np.full(n, -1, dtype=np.int64)
    recompute = np.zeros(n, dtype=bool)
    # a step's kernels share few (category, path, op, shapes) combinations: each classified once (the string
    # columns by their codes: one per distinct string)
    gid, first = _key_ids([_codes(g["category"]), is_comm.astype(bool), path, _codes(g["op"]), _codes(g["op_input_dims"]),
                           back.astype(bool), _codes(g["path"])])
    got = [_classify_kernel(cat[i], bool(is_comm[i]), path[i], op[i], dims[i], bool(back[i]), own[i], tokens, mbs,
                            seq_len) for i in first.tolist()]
    if got:
        k_comp, k_scale, k_expert, k_stage, k_layer, k_recompute = zip(*got)
        comp, scale, stage = (np.array(v, dtype=object)[gid] for v in (k_comp, k_scale, k_stage))
        expert, recompute = np.array(k_expert, dtype=bool)[gid], np.array(k_recompute, dtype=bool)[gid]
        layer = np.array(k_layer, dtype=np.int64)[gid]
    work = pd.DataFrame({
        "launch": g["launch_ts"].to_numpy(np.int64), "start": g["ts"].to_numpy(np.int64),
        "dur": g["dur"].to_numpy(np.int64), "stream": g["stream"].to_numpy(np.int64),
        "name": C.strings(g["name"]), "op": op, "path": path, "dims": dims, "component": comp, "scale": scale,
        "expert": expert, "moe_stage": stage, "layer": layer, "backward": back, "recompute": recompute,
        "is_comm": is_comm.astype(bool), "gpu_row": g.index.to_numpy(np.int64),
    })
    bad = work["launch"].to_numpy() < 0  # no launch event linked: it ran when it ran
    work["linked"] = ~bad
    work.loc[bad, "launch"] = work.loc[bad, "start"]
    return work.reset_index(drop=True)


def _cpu_work(tree: pd.DataFrame, events: pd.DataFrame, rank: int, start: int, end: int, fwd_paths: dict,
              tokens: int, mbs: int, seq_len: int) -> pd.DataFrame:
    """CPU-only trace: the device is the host. One unit per CPU op's self time inside the step."""
    t = tree[(tree["rank"] == rank) & (tree["kind"].to_numpy() == KIND_OP)]
    ts = t["ts"].to_numpy()
    t = t[(ts >= start) & (ts < end)]
    if t.empty:
        return pd.DataFrame(columns=WORK_COLUMNS)
    rows = t.index.to_numpy()
    fpath, back = _paths_of(tree, events, t["outer_op"].to_numpy(), fwd_paths, rank)
    own = C.strings(t["path"])
    recompute = back & np.array([_LAYER_RE.search(o) is not None for o in own], dtype=bool)
    path = np.where(own != "", own, fpath).astype(object)
    op = C.strings(t["name"])
    dims = C.strings(t["input_dims"]) if "input_dims" in t else np.full(len(t), "", dtype=object)
    n = len(t)
    comp = np.empty(n, dtype=object)
    scale = np.empty(n, dtype=object)
    stage = np.empty(n, dtype=object)
    layer = np.full(n, -1, dtype=np.int64)
    names = pd.Series(op)
    cat = C.categorize_frame(names, names, pd.Series(["kernel"] * n)).astype(str).to_numpy() if n else np.array([])
    comm = np.array([bool(C.COMM_RE.search(o)) or o.startswith(("c10d::", "gloo:", "record_param_comms")) for o in op])
    for i in range(n):
        p = path[i]
        comp[i] = _component(cat[i], bool(comm[i]), p, op[i], "moe/experts" in p)
        scale[i] = _scale(comp[i], p, op[i], dims[i], tokens, mbs, seq_len)
        m = re.search(r"moe/(\w+)", p)
        stage[i] = f"moe/{m.group(1)}" if m else ""
        lm = _LAYER_RE.findall(p)
        if lm:
            layer[i] = int(lm[-1])
    work = pd.DataFrame({
        "launch": t["ts"].to_numpy(np.int64), "start": t["ts"].to_numpy(np.int64),
        "dur": t["self_dur"].to_numpy(np.int64), "stream": t["tid"].to_numpy(np.int64), "name": op, "op": op,
        "path": path, "dims": dims, "component": comp, "scale": scale, "expert": comp == "expert GEMMs", "moe_stage": stage,
        "layer": layer, "backward": back, "recompute": recompute, "is_comm": comm,
    })
    work = work[work["dur"] > 0].sort_values("start", kind="stable").reset_index(drop=True)
    return work


def _lead(tree: pd.DataFrame, rank: int, start: int, end: int) -> int:
    """ns from the step's start to the first host event inside it (the step's own range excluded)."""
    ts = tree["ts"].to_numpy()  # (masks over the tree's columns: no copy of the rank's rows)
    inside = (tree["rank"].to_numpy() == rank) & (ts > start) & (ts < end) & ~tree["is_step"].to_numpy(bool)
    return int(ts[inside].min() - start) if inside.any() else 0


def _expert_host(tree: pd.DataFrame, events: pd.DataFrame, rank: int, start: int, end: int,
                 fwd_paths: dict) -> pd.DataFrame:
    """Host intervals of the outermost CPU ops of the MoE expert stage within the step."""
    ts = tree["ts"].to_numpy()
    t = tree.loc[(tree["rank"].to_numpy() == rank) & (tree["kind"].to_numpy() == KIND_OP)
                 & (tree["depth"].to_numpy() == 0) & (ts >= start) & (ts < end), ["ts", "dur", "path"]]
    if t.empty:
        return pd.DataFrame({"ts": np.zeros(0, np.int64), "end": np.zeros(0, np.int64), "backward": np.zeros(0, bool)})
    path, back = _paths_of(tree, events, t.index.to_numpy(), fwd_paths, rank)
    own = C.strings(t["path"])
    where = np.array([f"{o}/{p}" for o, p in zip(own, path)], dtype=object)
    m = np.array(["moe/experts" in x for x in where], dtype=bool)
    return pd.DataFrame({"ts": t["ts"].to_numpy(np.int64)[m], "end": (t["ts"] + t["dur"]).to_numpy(np.int64)[m],
                         "backward": back[m]})


def _syncs(tree: pd.DataFrame, rank: int, start: int, end: int) -> pd.DataFrame:
    rt = (tree["rank"].to_numpy() == rank) & (tree["kind"].to_numpy() == KIND_RUNTIME)
    if not rt.any():
        return pd.DataFrame({"ts": np.zeros(0, np.int64), "end": np.zeros(0, np.int64), "moe": np.zeros(0, bool),
                             "path": np.zeros(0, object)})
    ts = tree["ts"].to_numpy()
    t = tree.loc[rt & C.isin(tree["name"], C.SYNC_RUNTIME) & (ts >= start) & (ts < end), ["ts", "dur", "path"]]
    path = C.strings(t["path"]).astype(object)
    return pd.DataFrame({"ts": t["ts"].to_numpy(np.int64), "end": (t["ts"] + t["dur"]).to_numpy(np.int64),
                         "moe": np.array(["moe/" in p for p in path], dtype=bool), "path": path}
                        ).sort_values("ts", kind="stable").reset_index(drop=True)


def read_manifest(run) -> dict | None:
    """The run's trainer manifest (None when ``run`` is not a run dir or has none), checked: its fields have the
    trainer's types and it has a config (`tracelens.io.manifest`); else a one-line `ProfileError` naming the file.
    ``run``: a `tracelens.io.run.Run` (its manifest as read, or as given with `Run.with_manifest`), or a run
    dir's path."""
    from ..io.manifest import check_manifest, read_manifest as read_checked, run_manifest_path

    if isinstance(run, Run):
        if run.manifest is not None:
            try:
                return check_manifest(run.manifest, run.manifest_path or "the given manifest", need_config=True)
            except TraceError as e:
                raise ProfileError(e.one_line()) from None
        m = run.manifest_path
    else:
        m = run_manifest_path(run)
    if m is None:
        return None
    try:
        return read_checked(m, need_config=True)
    except TraceError as e:
        raise ProfileError(e.one_line()) from None


__all__ = ["COMPONENTS", "WORK_COMPONENTS", "IDLE_COMPONENTS", "SCALES", "StepProfile", "ProfileError",
           "profiles", "step_profile", "read_manifest", "tokens_per_microbatch"]

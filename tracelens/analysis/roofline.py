"""Roofline: achieved TFLOP/s and TB/s of every modeled op group against the device's ceilings.

    >>> import tracelens
    >>> from tracelens.analysis import roofline
    >>> a = tracelens.analyze(tracelens.load("runs/demo"))
    >>> r = roofline.roofline_result(a)                  # or roofline.roofline(a) for the main table only
    >>> r.table        # one row per (device, op, input dims, input types, concrete inputs, input strides)
    >>> r.unmodeled    # ops whose kernels ran but that have no model (or unusable shapes), with the reason
    >>> r.families     # GEMM shape families: per-expert loops (one dim varying) rolled up
    >>> roofline.roofline(a, ceilings="measured.json")  # measured ceilings override the datasheet

Time attribution: each GPU event (kernel, memcpy, memset; communication kernels excluded) belongs to the
innermost op on its launch stack that has a perf model (`tracelens.perfmodels.MODELS`); kernels with no
modeled op above them belong to their innermost op, which is then listed as unmodeled. So
`scaled_dot_product_attention -> _scaled_dot_product_cudnn_attention -> _cudnn_attention_forward` counts
once, at the innermost (most specific) op, and backward kernels are counted at the aten ops the autograd
engine calls (e.g. `aten::mm` inside `MmBackward0`), with the shapes of that call.

Every rank's time adds up in a group's GPU time (`gpu_us`, "GPU time summed over N ranks" in the text); the
rates (TFLOP/s, TB/s, % of roof) are per GPU: the group's FLOPs or bytes over its GPU time.

Useful work: a sync-free MoE run's expert GEMMs compute a worst-case buffer of which only the routed rows carry
tokens (`tracelens.analysis.moe`, the `moe_padding` finding). Where that padding is known, each grouped-GEMM
row also gives the rate of its routed rows alone (`useful_tflops`, `useful_pct_roof`: the FLOPs of the routed
rows over the same GPU time; FLOPs are linear in the grouped dimension) beside the computed rate, which counts
the padding as work; elsewhere those columns are NaN.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import pandas as pd

from .. import categories as C
from .. import devices, perfmodels
from . import calltree, moe
from .grouped import named_agg

TABLE_COLUMNS = (
    "device", "op", "kind", "dtype", "input_dims", "input_types", "concrete_inputs", "input_strides", "note", "family", "count",
    "kernels", "gpu_us", "flops", "bytes", "total_flops", "total_bytes", "tflops", "tbps", "intensity",
    "peak_tflops", "peak_tbps", "ridge", "roof_tflops", "pct_peak_compute", "pct_peak_memory", "pct_roof", "bound",
    "share_gpu_time", "useful_total_flops", "useful_tflops", "useful_pct_roof",
)
UNMODELED_COLUMNS = ("device", "op", "input_dims", "input_types", "concrete_inputs", "reason", "count", "kernels", "gpu_us",
                     "share_gpu_time")
FAMILY_COLUMNS = ("device", "family", "op", "dtype", "shapes", "count", "gpu_us", "total_flops", "total_bytes",
                  "tflops", "tbps", "intensity", "pct_peak_compute", "pct_roof", "bound", "useful_tflops",
                  "useful_pct_roof")


NO_GPU_TEXT = ("no GPU kernels in these traces (CPU-only profile): a roofline needs GPU kernel times; nothing to plot "
               "(`tracelens analyze` shows host time per step and op)")

NESTED_REASON = ("encloses other modeled ops with their own GPU work: its FLOPs cannot be split between them "
                 "(the sub-ops are in the roofline table)")


@dataclass
class RooflineResult:
    table: pd.DataFrame
    unmodeled: pd.DataFrame
    families: pd.DataFrame
    ceilings: dict[str, devices.Ceilings | None]  # device name in the trace -> ceilings (None: unknown)
    warnings: list[str] = field(default_factory=list)
    modeled_gpu_us: float = 0.0
    unmodeled_gpu_us: float = 0.0
    unattributed_gpu_us: float = 0.0  # GPU time launched outside any op
    ranks: int = 1  # ranks whose GPU time the table sums
    padding: dict[str, Any] | None = None  # `moe.gemm_padding`: the expert GEMMs' computed vs routed rows, if padded

    def tables(self) -> dict[str, pd.DataFrame]:
        """The tables to write next to the report (Parquet/CSV), named like `Analysis.tables()`."""
        return {"roofline": self.table, "roofline_unmodeled": self.unmodeled, "roofline_families": self.families}

    def summary(self) -> dict[str, Any]:
        """Small JSON-able summary (coverage, devices, warnings) for summary.json / the CLI."""
        total = self.modeled_gpu_us + self.unmodeled_gpu_us + self.unattributed_gpu_us
        return {
            "modeled_gpu_us": round(self.modeled_gpu_us, 3),
            "unmodeled_gpu_us": round(self.unmodeled_gpu_us, 3),
            "unattributed_gpu_us": round(self.unattributed_gpu_us, 3),
            "modeled_share": round(self.modeled_gpu_us / total, 4) if total else None,
            "devices": {k: (v.to_dict() if v else None) for k, v in self.ceilings.items()},
            "warnings": list(self.warnings),
            "ranks": self.ranks,  # gpu_us sums these ranks' time; the rates are per GPU
            "padding": dict(self.padding) if self.padding else None,
        }

    def to_dict(self) -> dict[str, Any]:
        """What `tracelens roofline --json` writes: the summary and every table as records."""
        recs = lambda df: json.loads(df.to_json(orient="records"))  # noqa: E731
        return {"schema_version": 1, "summary": self.summary(), "roofline": recs(self.table),
                "unmodeled": recs(self.unmodeled), "families": recs(self.families)}

    def notes(self) -> list[str]:
        """What the figures mean beyond the table's headers: the ranks the GPU time sums, and the expert GEMMs'
        padding the useful columns take out (the text and the report show them)."""
        out = []
        if self.ranks > 1:
            out.append(f"GPU time summed over {self.ranks} ranks; TFLOP/s, TB/s and % roof per GPU.")
        u = self.table[self.table["useful_tflops"].notna()]
        if self.padding is not None and len(u):
            p = self.padding
            sec = float(u["gpu_us"].sum()) / 1e6
            roof = float((u["roof_tflops"] * u["gpu_us"]).sum() / u["gpu_us"].sum())
            comp, use = float(u["total_flops"].sum()) / sec / 1e12, float(u["useful_total_flops"].sum()) / sec / 1e12
            out.append(f"Useful: {100 * p['padding_share_rows']:.0f}% of expert-GEMM rows are padding "
                       f"({p.get('buffers', 'worst-case')} buffers, finding moe_padding): {p['routed_rows_per_call']:,} routed of {p['rows_per_call']:,} "
                       f"computed rows per call; the grouped GEMMs run {comp:.1f} TFLOP/s ({100 * comp / roof:.1f}% of "
                       f"roof) on computed rows, {use:.1f} ({100 * use / roof:.1f}%) on routed rows (the useful columns).")
        return out

    def to_text(self, top: int = 15) -> str:
        """What `tracelens roofline` prints: the `top` op groups by GPU time, the modeled share and the `notes`
        (the warnings are the caller's to show, on stderr). With padded expert GEMMs (`padding`), two columns
        give their routed rows' rate (module docstring)."""
        rows = self.table.sort_values("gpu_us", ascending=False, kind="stable").head(top)
        useful = self.padding is not None and bool(rows["useful_tflops"].notna().any())
        head = f"{'op':<36} {'GPU ms':>8} {'TFLOP/s':>8} {'TB/s':>6} {'AI':>7} {'% roof':>7}"
        lines = [head + (f" {'useful TFLOP/s':>14} {'useful % roof':>13}" if useful else "") + " bound"]
        for x in rows.itertuples(index=False):
            line = (f"{x.op[:36]:<36} {x.gpu_us / 1e3:>8.3f} {x.tflops:>8.1f} {x.tbps:>6.2f} {x.intensity:>7.1f} "
                    f"{x.pct_roof:>7.1f}")
            if useful:
                line += (f" {x.useful_tflops:>14.1f} {x.useful_pct_roof:>13.1f}" if x.useful_tflops == x.useful_tflops
                         else f" {'':>14} {'':>13}")
            lines.append(f"{line} {x.bound}")
        share = self.summary().get("modeled_share")
        share = "n/a" if share is None else f"{100 * share:.0f}%"
        lines.append(f"modeled: {share} of non-communication GPU time; {len(self.unmodeled)} op group(s) unmodeled")
        lines.extend(self.notes())
        return "\n".join(lines)


def _rank_ceilings(analysis, ceilings) -> tuple[dict[int, str], dict[str, devices.Ceilings | None], list[str]]:
    """Device name per rank and ceilings per device name. `ceilings`: None (datasheet), a `Ceilings`
    (used for every rank), or measured ceilings as a dict / JSON path (override the datasheet)."""
    rank_dev: dict[int, str] = {}
    props: dict[str, Mapping[str, Any]] = {}
    for info in analysis.trace.ranks:
        name = info.device_name or "unknown device"
        rank_dev[info.rank] = name
        if info.device_properties:
            props.setdefault(name, info.device_properties[0])
    ceil: dict[str, devices.Ceilings | None] = {}
    warnings: list[str] = []
    measured = None
    if isinstance(ceilings, (str, os.PathLike, Mapping)):
        measured = devices.load_measured(ceilings)
    for name in sorted(set(rank_dev.values())):
        if isinstance(ceilings, devices.Ceilings):
            ceil[name] = ceilings
        else:
            ceil[name] = devices.resolve(None if name == "unknown device" else name, props.get(name), measured)
        if ceil[name] is None:
            warnings.append(devices.no_ceilings_message(None if name == "unknown device" else name))
    return rank_dev, ceil, warnings


def _owner_rows(tree: pd.DataFrame, op_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each op row label, the innermost op on its ancestor chain (itself included) with a model;
    the op itself when none has one. Vectorized: one numpy step per nesting level.

    Returns (owner labels, nested): nested is True where the owner is a modeled op that also encloses
    other modeled ops owning GPU work (e.g. a math-fallback SDPA around bmm/softmax): its FLOP model
    covers the whole op while only part of the time is left to it, so it must not be reported as modeled.
    """
    labels = tree.index
    pos_of = lambda lab: C.positions(labels, lab)  # noqa: E731
    modeled = C.map_strings(tree["name"], perfmodels.has_model, **perfmodels.has_model_on_markers()) & (
        tree["kind"].to_numpy() == calltree.KIND_OP)
    parent = tree["parent"].to_numpy()
    inner = tree["inner_op"].to_numpy()
    # parent op of each row: the innermost op enclosing its parent
    ppos = pos_of(parent)
    parent_op = np.where((parent >= 0) & (ppos >= 0), inner[np.maximum(ppos, 0)], -1)
    start = pos_of(op_rows)
    cur = start.copy()
    for _ in range(256):
        p = parent_op[cur]
        need = ~modeled[cur] & (p >= 0)
        if not need.any():
            break
        nxt = pos_of(p[need])
        idx = np.flatnonzero(need)
        ok = nxt >= 0
        cur[idx[ok]] = nxt[ok]
        if not ok.all():  # a parent label outside the tree (cannot happen with build_tree): stop there
            stop = np.zeros(len(labels), dtype=bool)
            stop[cur[idx[~ok]]] = True
            parent_op = np.where(stop, -1, parent_op)
    cur = np.where(modeled[cur], cur, start)
    # modeled strict ancestors of modeled owners: those enclose other modeled work
    enclosing = np.zeros(len(labels), dtype=bool)
    walk = _distinct(cur[modeled[cur]], len(labels))
    for _ in range(256):
        p = parent_op[walk]
        walk = pos_of(p[p >= 0])
        walk = walk[walk >= 0]
        if not len(walk):
            break
        enclosing[walk[modeled[walk]]] = True
        walk = _distinct(walk, len(labels))
    nested = enclosing[cur]
    cur = np.where(nested & (cur != start), start, cur)  # unmodeled descendants' kernels stay with them
    return labels.to_numpy()[cur], enclosing[cur]


def _distinct(pos: np.ndarray, n: int) -> np.ndarray:
    """The distinct positions (0 <= pos < n), sorted: `np.unique` by a table of the n positions, not a sort (the
    owners of a 200 MB trace's GPU work: ~10^5)."""
    seen = np.zeros(n, dtype=bool)
    seen[pos] = True
    return np.flatnonzero(seen)


def _codes_at(col: pd.Series, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes of a (categorical) string column at positions `pos`, and the lookup table code -> str
    (code -1, a missing value, -> "", the last entry)."""
    if not isinstance(col.dtype, pd.CategoricalDtype):
        col = col.astype("category")
    lut = np.array(C.category_strings(col.cat.categories) + [""], dtype=object)
    return col.cat.codes.to_numpy()[pos].astype(np.int64), lut


def _empty(cols) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})


def _group_owners(cols: dict[str, np.ndarray], keys: list[str]) -> pd.DataFrame:
    """groupby(keys, sort=False) of the owner rows: count (rows), kernels and dur_ns (sums): the groups in order of
    first appearance, each with its first row's keys. On the integer columns with numpy: the keys folded into one
    group id by one hash factorization per key (each in order of first appearance, so the id is too), the sums of
    integers (exact, in any order): the table pandas' grouping gives, without its temporaries (~200 bytes a row
    for seven keys; an 8 GB trace has ~3.5M owner rows) and at a third of its time."""
    n = len(cols[keys[0]])
    if not n:
        return pd.DataFrame({k: v for k, v in cols.items()}).groupby(keys, sort=False).agg(
            count=("dur_ns", "size"), kernels=("kernels", "sum"), dur_ns=("dur_ns", "sum")).reset_index()
    gid = np.zeros(n, dtype=np.int64)
    for k in keys:
        codes, uniq = pd.factorize(cols[k])
        gid = pd.factorize(gid * len(uniq) + codes)[0].astype(np.int64)  # (< n * n: no overflow below 3e9 rows)
    first = np.ones(n, dtype=bool)  # a row whose id is new: ids are given in order, each one more than the last
    first[1:] = gid[1:] > np.maximum.accumulate(gid)[:-1]
    first = np.flatnonzero(first)
    kernels = np.zeros(len(first), dtype=np.int64)
    dur_ns = np.zeros(len(first), dtype=np.int64)
    np.add.at(kernels, gid, cols["kernels"].astype(np.int64))
    np.add.at(dur_ns, gid, cols["dur_ns"].astype(np.int64))
    return pd.DataFrame({**{k: cols[k][first] for k in keys}, "count": np.bincount(gid, minlength=len(first)).astype(np.int64),
                         "kernels": kernels, "dur_ns": dur_ns})


def roofline_result(analysis, ceilings: Any = None) -> RooflineResult:
    """Roofline of every op group in `analysis` (a `tracelens.Analysis`).

    ceilings: None (datasheet ceilings of each rank's device), a `devices.Ceilings` for all ranks, or
    measured ceilings (dict or JSON file path, see `tracelens.devices`) overriding the datasheet.
    """
    rank_dev, ceil, warnings = _rank_ceilings(analysis, ceilings)
    g = analysis.gpu
    tree = analysis.tree
    if g.empty:
        warnings.append("no GPU activity in the trace: roofline unavailable")
        return RooflineResult(_empty(TABLE_COLUMNS), _empty(UNMODELED_COLUMNS), _empty(FAMILY_COLUMNS), ceil, warnings)
    n_ranks = max(int(g["rank"].nunique()), 1) if "rank" in g else 1
    is_comm = g["is_comm"].to_numpy() if "is_comm" in g else np.zeros(len(g), bool)
    # the two columns read, not copies of the GPU table
    op_row, dur = g["op_row"].to_numpy()[~is_comm], g["dur"].to_numpy()[~is_comm]
    linked = op_row >= 0
    unattributed_us = float(dur[~linked].sum()) / 1e3
    if unattributed_us > 0:
        warnings.append(f"{unattributed_us:.1f} us of GPU time launched outside any op (not in the roofline)")
    op_row, dur = op_row[linked], dur[linked]
    if not len(op_row):
        warnings.append("no GPU event is linked to an op: roofline unavailable")
        return RooflineResult(_empty(TABLE_COLUMNS), _empty(UNMODELED_COLUMNS), _empty(FAMILY_COLUMNS), ceil,
                              warnings, unattributed_gpu_us=unattributed_us, ranks=n_ranks)
    uniq, inv = np.unique(op_row, return_inverse=True)
    owner_u, nested_u = _owner_rows(tree, uniq)
    owner = owner_u[inv.reshape(-1)]
    per = pd.DataFrame({"owner": owner, "dur": dur}).groupby("owner")["dur"].agg(["sum", "size"])
    rows = per.index.to_numpy()
    ev = analysis.trace.events
    at = C.positions(tree.index, rows)  # owners are tree rows: one lookup for every column
    keys = ["device", "op", "input_dims", "input_types", "concrete_inputs", "input_strides", "nested"]
    # grouped first on (rank, string codes), then the few groups' strings are looked up and grouped again
    # by device and text: no string per owner row (a 1 GB trace has ~10^5 owners)
    cols = {"rank": tree["rank"].to_numpy()[at]}
    texts = {}
    for key, col in (("op", tree["name"]), ("input_dims", tree["input_dims"]), ("input_types", tree["input_types"])):
        cols[key], texts[key] = _codes_at(col, at)
    ev_at = C.positions(ev.index, rows)
    for key in ("concrete_inputs", "input_strides"):
        cols[key], texts[key] = _codes_at(ev[key], ev_at) if key in ev else (np.full(len(rows), -1), None)
    cols.update(dur_ns=per["sum"].to_numpy(), kernels=per["size"].to_numpy(), nested=np.isin(rows, owner_u[nested_u]))
    first = ["rank", "op", "input_dims", "input_types", "concrete_inputs", "input_strides", "nested"]
    ops = _group_owners(cols, first)
    for key, lut in texts.items():  # codes -> strings ("" where an arg is absent: code -1)
        ops[key] = lut[ops[key].to_numpy()] if lut is not None else np.full(len(ops), "", dtype=object)
    ops["device"] = ops["rank"].map(rank_dev).fillna("unknown device")
    grp = named_agg(ops, keys, sort=False, count=("count", "sum"), kernels=("kernels", "sum"),
                    dur_ns=("dur_ns", "sum")).reset_index()
    total_us = float(grp["dur_ns"].sum()) / 1e3
    results = [perfmodels.Result(None, NESTED_REASON) if n else perfmodels.model(o, d, t, c, s) for o, d, t, c, s, n in
               zip(grp["op"], grp["input_dims"], grp["input_types"], grp["concrete_inputs"], grp["input_strides"],
                   grp["nested"])]
    ok = np.array([r.perf is not None for r in results], dtype=bool)
    grp["gpu_us"] = grp["dur_ns"] / 1e3
    grp["share_gpu_time"] = grp["gpu_us"] / total_us if total_us else np.nan

    um = grp.loc[~ok].copy()
    um["reason"] = [r.reason for r, k in zip(results, ok) if not k]
    um = um.sort_values("gpu_us", ascending=False, kind="stable")[list(UNMODELED_COLUMNS)].reset_index(drop=True)

    m = grp.loc[ok].copy()
    perfs = [r.perf for r, k in zip(results, ok) if k]
    m["kind"] = [p.kind for p in perfs]
    m["dtype"] = [p.dtype for p in perfs]
    m["note"] = [p.note for p in perfs]
    m["flops"] = np.array([p.flops for p in perfs], dtype=float)
    m["bytes"] = np.array([p.bytes for p in perfs], dtype=float)
    m["total_flops"] = m["flops"] * m["count"]
    m["total_bytes"] = m["bytes"] * m["count"]
    sec = m["dur_ns"].to_numpy() / 1e9
    with np.errstate(divide="ignore", invalid="ignore"):
        m["tflops"] = np.where(sec > 0, m["total_flops"] / sec / 1e12, np.nan)
        m["tbps"] = np.where(sec > 0, m["total_bytes"] / sec / 1e12, np.nan)
        m["intensity"] = np.where(m["total_bytes"] > 0, m["total_flops"] / m["total_bytes"], np.nan)
    peak = []
    bw = []
    for dev, p in zip(m["device"], perfs):
        c = ceil.get(dev)
        peak.append(c.peak_tflops(p.dtype, p.matrix) if c else None)
        bw.append(c.hbm_tbps if c else None)
    m["peak_tflops"] = pd.to_numeric(pd.Series(peak, index=m.index, dtype=object), errors="coerce").astype(float)
    m["peak_tbps"] = pd.to_numeric(pd.Series(bw, index=m.index, dtype=object), errors="coerce").astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        m["ridge"] = m["peak_tflops"] / m["peak_tbps"]
        m["roof_tflops"] = np.minimum(m["peak_tflops"], m["intensity"] * m["peak_tbps"])
        m["pct_peak_compute"] = 100.0 * m["tflops"] / m["peak_tflops"]
        m["pct_peak_memory"] = 100.0 * m["tbps"] / m["peak_tbps"]
        m["pct_roof"] = np.where(m["roof_tflops"] > 0, 100.0 * m["tflops"] / m["roof_tflops"], m["pct_peak_memory"])
    bound = np.where(m["intensity"].isna() | (m["flops"] <= 0), "memory",
                     np.where(m["intensity"] >= m["ridge"], "compute", "memory"))
    bound = np.where(m["ridge"].isna(), "unknown", bound)
    m["bound"] = bound
    m["family"] = _families(m, perfs)
    padding = _useful_work(analysis, m)
    m = m.sort_values("gpu_us", ascending=False, kind="stable")
    table = m[list(TABLE_COLUMNS)].reset_index(drop=True)

    over = table[table["pct_peak_compute"] > 100.0]
    for r in over.head(5).itertuples(index=False):
        warnings.append(f"{r.op} {r.input_dims}: achieved {r.tflops:.1f} TFLOP/s exceeds the device's compute "
                        f"ceiling ({r.peak_tflops} TFLOP/s): FLOP model or time attribution suspect")
    over_bw = table[(table["pct_peak_memory"] > 100.0) & ~(table["pct_peak_compute"] > 100.0)]
    if len(over_bw):
        warnings.append(f"{len(over_bw)} op group(s) moved more than HBM bandwidth allows for their minimum bytes "
                        f"(e.g. {over_bw.iloc[0]['op']} at {over_bw.iloc[0]['tbps']:.2f} TB/s): operands served "
                        f"from L2 cache")
    modeled_us = float(table["gpu_us"].sum())
    return RooflineResult(table=table, unmodeled=um, families=family_table(table), ceilings=ceil, warnings=warnings,
                          modeled_gpu_us=modeled_us, unmodeled_gpu_us=float(um["gpu_us"].sum()),
                          unattributed_gpu_us=unattributed_us, ranks=n_ranks, padding=padding)


def _useful_work(analysis, m: pd.DataFrame) -> dict[str, Any] | None:
    """The useful-work columns of the modeled groups `m` (module docstring), in place: NaN unless the run's
    expert GEMMs are padded (`moe.gemm_padding`, what the `moe_padding` finding reports). Returns that padding."""
    for c in ("useful_total_flops", "useful_tflops", "useful_pct_roof"):
        m[c] = np.nan
    grouped = m["op"].isin(moe.GROUPED_GEMM_OPS)
    padding = moe.gemm_padding(analysis) if grouped.any() else None
    if padding is None:
        return None
    share = pd.Series([moe.useful_share(padding, d) if k else None for d, k in zip(m["input_dims"], grouped)],
                      index=m.index, dtype=float)
    m["useful_total_flops"] = m["total_flops"] * share
    sec = m["dur_ns"].to_numpy() / 1e9
    with np.errstate(divide="ignore", invalid="ignore"):
        m["useful_tflops"] = np.where(sec > 0, m["useful_total_flops"] / sec / 1e12, np.nan)
        m["useful_pct_roof"] = np.where(m["roof_tflops"] > 0, 100.0 * m["useful_tflops"] / m["roof_tflops"], np.nan)
    return padding


def roofline(analysis, ceilings: Any = None) -> pd.DataFrame:
    """The roofline table (see `roofline_result` for the unmodeled ops, families and warnings)."""
    return roofline_result(analysis, ceilings).table


# ------------------------------------------------------------------------------------ GEMM shape families


FAMILY_MAX_RATIO = 8  # the varying dim of a family spans at most this ratio (expert loads, not unrelated layers)


def _families(m: pd.DataFrame, perfs: list[perfmodels.Perf]) -> list[str]:
    """Label GEMM groups that differ in one dimension only (per-expert loops: M varies in the forward
    and input-gradient GEMMs, K in the weight-gradient GEMM) as one family, e.g.
    'aten::mm bf16 [M=*, N=1536, K=768]'. A family needs >= 3 distinct shapes; otherwise the label is the
    group's own shape."""
    out = []
    for p, op in zip(perfs, m["op"]):
        out.append(f"{op} {p.dtype} [M={p.mnk[0]}, N={p.mnk[1]}, K={p.mnk[2]}]" if p.mnk else "")
    gem = [(i, p) for i, p in enumerate(perfs) if p.mnk is not None]
    if not gem:
        return out
    devs = m["device"].tolist()
    ops = m["op"].tolist()
    pattern_sets: dict[tuple, set] = defaultdict(set)
    names = ("M", "N", "K")
    for i, p in gem:
        for free in range(3):
            key = (devs[i], ops[i], p.dtype, p.batch, free) + tuple(v for j, v in enumerate(p.mnk) if j != free)
            pattern_sets[key].add(p.mnk)
    for i, p in gem:
        best = None
        for free in range(3):
            key = (devs[i], ops[i], p.dtype, p.batch, free) + tuple(v for j, v in enumerate(p.mnk) if j != free)
            vals = [s[free] for s in pattern_sets[key]]
            n = len(vals)
            if n >= 3 and max(vals) <= FAMILY_MAX_RATIO * max(min(vals), 1) and (best is None or n > best[0]):
                best = (n, free)
        if best is not None:
            free = best[1]
            dims = ", ".join(f"{names[j]}={'*' if j == free else p.mnk[j]}" for j in range(3))
            out[i] = f"{ops[i]} {p.dtype} [{dims}]"
    return out


def family_table(table: pd.DataFrame) -> pd.DataFrame:
    """Roll the roofline table up by GEMM shape family (rows without a family are left out)."""
    t = table[table["family"] != ""]
    if t.empty:
        return _empty(FAMILY_COLUMNS)
    f = named_agg(
        t, ["device", "family"], sort=False, op=("op", "first"), dtype=("dtype", "first"), shapes=("input_dims", "nunique"), count=("count", "sum"),
        gpu_us=("gpu_us", "sum"), total_flops=("total_flops", "sum"), total_bytes=("total_bytes", "sum"),
        peak_tflops=("peak_tflops", "first"), peak_tbps=("peak_tbps", "first")).reset_index()
    # useful FLOPs: where any group of the family has them, the others' FLOPs are all useful
    known = t["useful_total_flops"].notna().groupby([t["device"], t["family"]], sort=False).any()
    useful = t["useful_total_flops"].fillna(t["total_flops"]).groupby([t["device"], t["family"]], sort=False).sum()
    useful = useful.where(known).reindex(pd.MultiIndex.from_frame(f[["device", "family"]])).to_numpy()
    sec = f["gpu_us"] / 1e6
    with np.errstate(divide="ignore", invalid="ignore"):
        f["tflops"] = f["total_flops"] / sec / 1e12
        f["tbps"] = f["total_bytes"] / sec / 1e12
        f["intensity"] = f["total_flops"] / f["total_bytes"]
        f["pct_peak_compute"] = 100.0 * f["tflops"] / f["peak_tflops"]
        roof = np.minimum(f["peak_tflops"], f["intensity"] * f["peak_tbps"])
        f["pct_roof"] = 100.0 * f["tflops"] / roof
        ridge = f["peak_tflops"] / f["peak_tbps"]
        f["useful_tflops"] = useful / sec / 1e12
        f["useful_pct_roof"] = 100.0 * f["useful_tflops"] / roof
    f["bound"] = np.where(ridge.isna(), "unknown", np.where(f["intensity"] >= ridge, "compute", "memory"))
    return f.sort_values("gpu_us", ascending=False, kind="stable")[list(FAMILY_COLUMNS)].reset_index(drop=True)

"""Useful vs padded MoE work: rows of the expert GEMMs and bytes of the token all-to-alls that carry no token.

Sync-free MoE (the trainer's levels 2-3) trades host syncs for static buffers: with expert parallelism each
peer sends, and each rank's experts compute, a worst-case buffer of ``T * min(top_k, E_local)`` rows per peer,
while the rows actually routed are fixed by the router: every token goes to ``top_k`` experts, so over the EP
group a rank receives ``T * top_k`` rows per micro-batch on average (exactly, summed over the group: nothing
is dropped). The rest of each buffer is padding. This module counts it from what the trace records:

- each ``aten::_grouped_mm`` call's grouped (token) dimension: rows computed per call. Forward and data
  gradient ``[M, K] x [E, K, N]``: M is the first input's rows; weight gradient ``[K, M] x [M, N]``: M is the
  contracted dimension;
- each token all-to-all's bytes (`tracelens.analysis.comm` instances whose bytes are the grouped rows times
  ``d_model`` times the element size);

against the routed rows ``T * top_k`` (``T = micro_batch_size * seq_len``, from the run's manifest config;
with ``ep_overlap`` each grouped GEMM and all-to-all carries one of ``ep_overlap_chunks`` chunks of tokens, and
with ``ep_dispatch: capacity`` the rows the manifest's ``ep_dispatch.dropped_share`` counts as dropped are not
routed). Time on padding is estimated as the padded share of the GEMM and transfer time (an upper bound for
GEMMs, whose cost does not fall linearly with rows).

Which trainer wrote the run matters for the GEMMs: since the dispatch paths of issue 33 (a manifest with an
``ep_dispatch`` key), the grouped GEMMs' device offsets end at the routed rows, so a padded buffer's tail is
moved and sent but never multiplied: ``gemm_computes_padding`` is false, the padded share then describes the
buffers (memory, all-to-all bytes), and no GEMM time is counted as spent on padding. Older runs computed the
whole buffer. Without a manifest (a trace from another framework) the routed rows are not known and nothing is
claimed. Pure function of the analysis' tables and `Trace.run`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

MIN_SHARE = 0.05  # a padded share below this is routing variation between ranks, not a worst-case buffer
_ELEM_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}


def _grouped_rows(dims: Any) -> int | None:
    """Rows of the grouped (token) dimension of one ``_grouped_mm`` call, from its input dims."""
    if isinstance(dims, str):
        try:
            dims = json.loads(dims)
        except ValueError:
            return None
    if not isinstance(dims, list) or len(dims) < 2 or not all(isinstance(d, list) for d in dims[:2]):
        return None
    a, b = dims[0], dims[1]
    if len(a) == 2 and len(b) == 3 and isinstance(a[0], int):
        return a[0]  # [M, K] x [E, K, N]
    if len(a) == 2 and len(b) == 2 and isinstance(a[1], int) and a[1] == b[0]:
        return a[1]  # [K, M] x [M, N]: the weight gradient, M contracted
    return None


GROUPED_GEMM_OPS = ("aten::_grouped_mm", "aten::_scaled_grouped_mm")


def dispatch_facts(run, cfg: dict, ep: int) -> tuple[int, float, bool]:
    """What the run's EP dispatch does to the rows of one grouped-GEMM call (module docstring): (chunks per
    micro-batch: ``ep_overlap_chunks`` with ``ep_overlap``, else 1; the manifest's dropped share of the routed
    rows; whether the GEMMs computed the padded tail: true for a trainer before issue 33, whose manifest has no
    ``ep_dispatch``)."""
    manifest = getattr(run, "manifest", None) or {}
    dispatch = manifest.get("ep_dispatch") if isinstance(manifest, dict) else None
    chunks = 1
    if ep > 1 and cfg.get("ep_overlap") is True:
        try:
            chunks = max(1, int(cfg.get("ep_overlap_chunks", 2)))
        except (TypeError, ValueError):
            chunks = 1
    dropped = 0.0
    if isinstance(dispatch, dict):
        try:
            dropped = min(max(float(dispatch.get("dropped_share") or 0.0), 0.0), 1.0)
        except (TypeError, ValueError):
            dropped = 0.0
    return chunks, dropped, not (isinstance(manifest, dict) and "ep_dispatch" in manifest)
grouped_rows = _grouped_rows  # public: the grouped (token) rows of one call's input dims (the what-if reads them)


def _gemm_part(analysis) -> tuple[dict[str, Any], pd.DataFrame, dict] | None:
    """The expert-GEMM half of `expert_padding`: (its fields, the grouped-GEMM op groups with their rows, the
    run's config), or None."""
    run = getattr(analysis.trace, "run", None)
    cfg = run.config if run is not None else None
    if not cfg:
        return None
    try:
        tokens = int(cfg["micro_batch_size"]) * int(cfg["seq_len"])
        top_k = int(cfg["top_k"])
        ep = int(cfg.get("ep", 1) or 1)
    except (KeyError, TypeError, ValueError):
        return None
    chunks, dropped, computes_padding = dispatch_facts(run, cfg, ep)
    ops = analysis.ops
    if ops is None or ops.empty:
        return None
    g = ops[ops["op"].astype(str).isin(GROUPED_GEMM_OPS)]
    if g.empty:
        return None
    rows = g["input_dims"].map(_grouped_rows)
    g = g[rows.notna()].assign(rows=rows[rows.notna()].astype(np.int64))
    if g.empty:
        return None
    routed_exact = tokens * top_k / chunks * (1.0 - dropped)
    routed = int(round(routed_exact))
    calls = g["count"].astype(float)
    # per call the padded share; weighted by the calls' GPU time for the time estimate
    share_call = (1.0 - routed_exact / g["rows"].astype(float)).clip(lower=0.0)
    rows_mean = float((g["rows"] * calls).sum() / calls.sum())
    share = max(1.0 - routed_exact / rows_mean, 0.0)
    if share < MIN_SHARE:
        return None
    n_ranks = max(int(analysis.timeline["rank"].nunique()), 1) if not analysis.timeline.empty else 1
    gemm_us = float(g["gpu_total_us"].sum()) / n_ranks
    padded_gemm_us = float((g["gpu_total_us"] * share_call).sum()) / n_ranks if computes_padding else 0.0
    out: dict[str, Any] = {
        "rows_per_call": int(round(rows_mean)), "routed_rows_per_call": routed, "tokens_per_microbatch": tokens,
        "top_k": top_k, "padding_share_rows": round(share, 4), "grouped_gemm_us_per_rank": round(gemm_us, 3),
        "padded_gemm_us_per_rank": round(padded_gemm_us, 3), "grouped_gemm_calls": int(calls.sum()),
        "gemm_computes_padding": computes_padding, "chunks_per_microbatch": chunks,
        "dropped_share": round(dropped, 6),
        # what the padding is: the capacity path's static buffers (ep_capacity_factor x the balanced rows) or the
        # nccl path's worst-case buffers (every peer may send min(top_k, local experts) copies of each token)
        "buffers": "capacity" if cfg.get("ep_dispatch") == "capacity" else "worst-case",
    }
    return out, g, cfg


def gemm_padding(analysis) -> dict[str, Any] | None:
    """The expert-GEMM fields of `expert_padding` alone (rows computed and routed per call, padded share and
    time): what needs no communication table (the roofline reads it). None when `expert_padding` has none."""
    part = _gemm_part(analysis)
    return None if part is None else part[0]


def useful_share(padding: dict[str, Any], input_dims: Any) -> float | None:
    """Routed / computed rows of one grouped-GEMM call with these input dims, given `gemm_padding`'s or
    `expert_padding`'s result: the share of its FLOPs that is useful work (a GEMM's FLOPs are linear in its
    grouped dimension). None when the dims do not give the grouped dimension; 1 when the GEMMs stop at the
    routed rows (``gemm_computes_padding`` false: the buffer's tail is not computed)."""
    rows = _grouped_rows(input_dims)
    if not rows:
        return None
    if padding.get("gemm_computes_padding") is False:
        return 1.0
    return min(float(padding["routed_rows_per_call"]) / rows, 1.0)


def expert_padding(analysis) -> dict[str, Any] | None:
    """Padded rows and bytes of a run's expert GEMMs and token all-to-alls (module docstring); None when the run
    has no grouped GEMMs, no manifest config with the MoE shape, or no padding above `MIN_SHARE`.
    ``a2a_buffer_bytes``: the sizes of the all-to-all instances counted as token buffers (`tracelens
    .analysis.comm` rates their routed bytes with it)."""
    part = _gemm_part(analysis)
    if part is None:
        return None
    out, g, cfg = part
    out.update(a2a_padding_share_bytes=None, a2a_bytes_per_call=None, a2a_routed_bytes_per_call=None,
               padded_a2a_us_per_rank=0.0, a2a_buffer_bytes=[])
    try:
        d_model = int(cfg["d_model"])
    except (KeyError, TypeError, ValueError):
        return out
    n_ranks = max(int(analysis.timeline["rank"].nunique()), 1) if not analysis.timeline.empty else 1
    routed = out["routed_rows_per_call"]
    elem = _ELEM_BYTES.get(str(cfg.get("dtype", "bf16")).lower())
    inst = analysis.comm_instances() if hasattr(analysis, "comm_instances") else None
    if elem and inst is not None and not inst.empty:
        buf = {int(r) * d_model * elem for r in g["rows"].unique()}
        a2a = inst[(inst["family"] == "all_to_all") & inst["bytes"].isin(buf) & ~inst["startup"]]
        sw = getattr(analysis, "window", None)
        if sw is not None and getattr(sw, "restricts", False):
            a2a = a2a[a2a["step"].isin(sw.used)]
        if not a2a.empty:
            sent = float(a2a["bytes"].mean())
            routed_b = float(routed * d_model * elem)
            s_b = max(1.0 - routed_b / sent, 0.0)
            out.update(a2a_padding_share_bytes=round(s_b, 4), a2a_bytes_per_call=int(sent),
                       a2a_routed_bytes_per_call=int(routed_b),
                       padded_a2a_us_per_rank=round(float(a2a["comm_us"].sum()) * s_b / n_ranks, 3),
                       a2a_buffer_bytes=sorted(int(b) for b in a2a["bytes"].unique()))
    return out


def padding_finding(analysis) -> dict[str, Any] | None:
    """`expert_padding` as a finding (type ``moe_padding``), None when there is none."""
    p = expert_padding(analysis)
    if p is None:
        return None
    a2a = p["a2a_padding_share_bytes"]
    rec = p["padded_gemm_us_per_rank"] + p["padded_a2a_us_per_rank"]
    share_txt = f"{100 * p['padding_share_rows']:.0f}%"
    if a2a is not None and abs(a2a - p["padding_share_rows"]) >= 0.005:
        share_txt += f" / {100 * a2a:.0f}%"
    routed_txt = "tokens x top_k" + (f" per chunk of {p['chunks_per_microbatch']}" if p["chunks_per_microbatch"] > 1
                                     else "") + (f", less the {100 * p['dropped_share']:.1f}% dropped"
                                                 if p["dropped_share"] else "")
    if p["gemm_computes_padding"]:
        what = "expert-GEMM rows" + (" and all-to-all bytes" if a2a is not None else "")
        title = (f"{share_txt} of {what} are padding: grouped GEMMs compute {p['rows_per_call']:,} rows per call for "
                 f"{p['routed_rows_per_call']:,} routed ({routed_txt}); up to {rec / 1e3:.3f} ms per rank on padding")
    else:  # the GEMMs stop at the routed rows: the padding is in the buffers and on the wire
        what = "expert-GEMM buffer rows" + (" and all-to-all bytes" if a2a is not None else "")
        title = (f"{share_txt} of {what} are padding: buffers of {p['rows_per_call']:,} rows per call for "
                 f"{p['routed_rows_per_call']:,} routed ({routed_txt}); the GEMMs stop at the routed rows, "
                 f"up to {rec / 1e3:.3f} ms per rank sending padding")
    return {
        "type": "moe_padding",
        "title": title,
        "evidence": p, "recoverable_us": rec,
        "ranks": sorted(int(r) for r in analysis.timeline["rank"].unique()) if not analysis.timeline.empty else [],
    }


__all__ = ["GROUPED_GEMM_OPS", "MIN_SHARE", "dispatch_facts", "expert_padding", "gemm_padding", "grouped_rows", "padding_finding",
           "useful_share"]

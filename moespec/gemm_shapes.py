"""The routed-expert grouped-GEMM shapes a trainer config runs, per rank (standard library only).

The expert MLP of every MoE layer runs two grouped GEMMs over the rows a rank's experts receive:

* up-projection (gate and up fused): ``[R, d_model] x [E_local, d_model, 2*moe_d_ff]``
* down-projection: ``[R, moe_d_ff] x [E_local, moe_d_ff, d_model]``

``R``, the rows per step, depends on the sync-free level and EP (see docs/trainer.md):

* EP = 1: ``tokens * top_k`` (every (token, slot) assignment, exactly);
* EP > 1, levels 0-2: the received rows vary from step to step around ``tokens * top_k`` (the
  average over a balanced router);
* EP > 1, level 3: the experts run on the whole worst-case buffer, ``ep * tokens * min(top_k,
  E_local)``.

With ``grouped_gemm_align > 1`` (torch, triton, auto) every group is padded: ``+ E_local *
(align - 1)`` rows.  ``tokens = micro_batch_size * seq_len`` per rank.

These are the shapes ``tracelens kernels tune --config CFG`` tunes and the trainer's
``grouped_gemm_backend=auto`` tunes before its first step; the tuner's cache buckets the rows to
a power of two, so a varying ``R`` mostly stays in one bucket.
"""

from __future__ import annotations

from typing import NamedTuple

from .backends import GROUPED_BACKENDS


class ExpertGemm(NamedTuple):
    """One grouped GEMM ``[T, K] x [E, K, N]``; ``name`` is ``up`` or ``down``."""

    name: str
    T: int
    K: int
    N: int
    E: int


def expert_rows(cfg: dict) -> int:
    """Rows one rank's grouped expert GEMMs see per micro-batch (see the module docstring)."""
    tokens = cfg["micro_batch_size"] * cfg["seq_len"]
    k, ep = cfg["top_k"], cfg["ep"]
    e_local = cfg["n_routed_experts"] // ep
    if ep > 1 and cfg["sync_free_level"] >= 3:
        rows = ep * tokens * min(k, e_local)
    else:
        rows = tokens * k
    align = cfg.get("grouped_gemm_align", 0) or 0
    if align > 1 and cfg["grouped_gemm_backend"] in GROUPED_BACKENDS:
        rows += e_local * (align - 1)
    return rows


def expert_gemm_shapes(cfg: dict) -> list[ExpertGemm]:
    """The up- and down-projection grouped GEMMs of a config's MoE layers (empty without MoE layers)."""
    if cfg["first_k_dense"] >= cfg["n_layers"]:
        return []
    rows = expert_rows(cfg)
    d, ff, e_local = cfg["d_model"], cfg["moe_d_ff"], cfg["n_routed_experts"] // cfg["ep"]
    return [ExpertGemm("up", rows, d, 2 * ff, e_local), ExpertGemm("down", rows, ff, d, e_local)]


def expert_gemm_dtype(cfg: dict) -> str:
    """torch dtype name of the expert GEMMs: bf16 runs them in bfloat16 (FSDP2 mixed precision or
    autocast), fp32 in float32."""
    return "bfloat16" if cfg["dtype"] == "bf16" else "float32"

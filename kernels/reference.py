"""Plain-PyTorch references for every kernel in this package.

Each function here is the specification of the matching Triton kernel: the tests compare the
kernels against these, and ``kernels`` falls back to them where Triton cannot run.  They favour
clarity over speed and may synchronize with the host (``.tolist()``); the kernels never do.

May import: torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "grouped_mm_ref",
    "permute_ref",
    "unpermute_ref",
    "gather_rows_ref",
    "router_ref",
    "linear_cross_entropy_ref",
    "swiglu_ref",
]


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = [int(v) for v in offs.tolist()]
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def grouped_mm_ref(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[offs[i-1]:offs[i]] = x[offs[i-1]:offs[i]] @ w[i]``; ``offs`` are cumulative END offsets.

    x: [T, K], w: [E, K, N], offs: int [E], non-decreasing, ``offs[-1] <= T``.  Rows past
    ``offs[-1]`` belong to no expert and come out as zeros.  Products accumulate in fp32 and are
    rounded to ``x.dtype`` once, like the kernels.  Differentiable through ordinary autograd.
    """
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1 or w.shape[0] != offs.shape[0] or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm: bad shapes x{tuple(x.shape)} w{tuple(w.shape)} offs{tuple(offs.shape)}")
    pieces = []
    end = 0
    for i, (s, e) in enumerate(_bounds(offs)):
        if e > s:
            pieces.append((x[s:e].float() @ w[i].float()).to(x.dtype))
        end = max(end, e)
    T, N = x.shape[0], w.shape[2]
    if end < T:
        pieces.append(x.new_zeros(T - end, N) + 0 * x[end:, :1])  # keep the graph connected
    if not pieces:  # no rows at all: zeros, still connected to the graph (zero gradients)
        return x.new_zeros(T, N) + 0 * (x.sum() + w.sum())
    return torch.cat(pieces, 0)


def permute_ref(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int):
    """Sort the (token, slot) assignments of ``topk_ids`` [T, k] by expert, stably.

    Returns ``(x_perm [T*k, D], sorted_pos [T*k], row_map [T*k], counts [E] int32, offs [E] int32)``:
    ``sorted_pos[r]`` is the flat assignment index ``t*k + slot`` at permuted row ``r`` (so
    ``x_perm[r] = x[sorted_pos[r] // k]``), ``row_map`` is its inverse (the permuted row of each
    assignment), ``counts`` the rows per expert and ``offs`` their cumulative END offsets.
    Index tensors are int32.  Differentiable in ``x``.
    """
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    sorted_pos = torch.sort(flat, stable=True).indices
    row_map = torch.empty_like(sorted_pos)
    row_map[sorted_pos] = torch.arange(sorted_pos.numel(), device=sorted_pos.device)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount would sync on CUDA
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x_perm = x[sorted_pos // k]
    return x_perm, sorted_pos.to(torch.int32), row_map.to(torch.int32), counts, offs


def unpermute_ref(y_perm: torch.Tensor, row_map: torch.Tensor, topk_weights: torch.Tensor | None,
                  top_k: int | None = None) -> torch.Tensor:
    """Inverse of :func:`permute_ref` with routing weights: ``out[t] = sum_s w[t,s] * y_perm[row_map[t*k+s]]``.

    An assignment whose ``row_map`` entry is -1 (no row: dropped) contributes nothing.
    ``topk_weights`` [T, k] (``None``: all ones, then ``top_k`` is required).  Accumulates in fp32,
    returns ``y_perm.dtype``.  Differentiable in ``y_perm`` and ``topk_weights``.
    """
    k = topk_weights.shape[1] if topk_weights is not None else int(top_k)
    T = row_map.numel() // k
    rows = row_map.long()
    # an assignment without a row (row_map -1: an out-of-range id, a dropped row) reads an appended zero row
    y_ext = torch.cat([y_perm.float(), y_perm.new_zeros(1, y_perm.shape[1], dtype=torch.float32)])
    y = y_ext[torch.where(rows >= 0, rows, y_perm.shape[0])].view(T, k, y_perm.shape[1])
    if topk_weights is not None:
        y = y * topk_weights.float().unsqueeze(-1)
    return y.sum(1).to(y_perm.dtype)


def gather_rows_ref(x: torch.Tensor, src: torch.Tensor, top_k: int) -> torch.Tensor:
    """A buffer of token copies: ``out[b] = x[src[b] // top_k]``, zeros where ``src[b] < 0`` (padding rows).

    ``src`` [R] holds the flat assignment index ``t*k + slot`` each buffer row copies. Differentiable in ``x``
    (its gradient sums the rows that copied each token).
    """
    idx = src.long()
    x_ext = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return x_ext[torch.where(idx >= 0, idx // top_k, x.shape[0])]


def router_ref(logits: torch.Tensor, top_k: int, score_func: str = "softmax", n_groups: int = 1,
               topk_groups: int = 1, norm_topk: bool = True, scaling: float = 1.0,
               bias: torch.Tensor | None = None):
    """Router: scores -> (group-limited) top-k -> weights, plus aux-loss statistics.

    logits: [T, E].  ``score_func`` is ``"softmax"`` or ``"sigmoid"``.  With ``n_groups > 1`` the
    experts split into ``n_groups`` equal groups, each group is scored by its best expert, and only
    experts of the ``topk_groups`` best groups may be chosen (DeepSeek-V2 device-limited routing).
    Weights are the chosen scores, divided by their sum when ``norm_topk``, times ``scaling``. A ``bias``
    [E] (DeepSeek-V3's auxiliary-loss-free balancing) is added to the scores that choose the groups and
    the experts, not to the weights; the ids come in descending order of the biased score.

    Returns ``(topk_weights [T,k] fp32, topk_ids [T,k] int32, tokens_per_expert_frac [E] fp32,
    mean_prob [E] fp32)``: the fraction of the T*k assignments that went to each expert (f_i, not
    differentiable) and the mean score of each expert over tokens (P_i, differentiable), so the
    switch-style balance loss is ``E * sum(f * P)``.
    """
    T, E = logits.shape
    s = logits.float()
    scores = torch.softmax(s, -1) if score_func == "softmax" else torch.sigmoid(s)
    sel = scores.detach() if bias is None else scores.detach() + bias.detach().float()
    if n_groups > 1:
        g = sel.view(T, n_groups, E // n_groups).amax(-1)
        gidx = torch.topk(g, topk_groups, dim=-1).indices
        gmask = torch.zeros(T, n_groups, dtype=torch.bool, device=logits.device).scatter_(1, gidx, True)
        emask = gmask.unsqueeze(-1).expand(T, n_groups, E // n_groups).reshape(T, E)
        sel = sel.masked_fill(~emask, float("-inf"))
    ids = torch.topk(sel, top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if norm_topk:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * scaling
    frac = torch.bincount(ids.reshape(-1), minlength=E).float() / max(T * top_k, 1)
    mean_prob = scores.mean(0) if T > 0 else scores.new_zeros(E)
    return w, ids.to(torch.int32), frac, mean_prob


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                             ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, target)`` computed the obvious way (full fp32 logits).

    hidden [T, D], weight [V, D], target [T] int64.  ``reduction`` is ``"mean"`` (over targets that
    are not ``ignore_index``), ``"sum"`` or ``"none"``.
    """
    logits = (hidden.float() @ weight.float().t())
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


def swiglu_ref(h: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` for ``h = [g | u]`` [R, 2F] (gate columns first): computed in fp32 and rounded to
    ``h.dtype`` once, like the kernel. Differentiable through ordinary autograd."""
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"swiglu: expected h [R, 2F] (gate columns, then up columns); got {tuple(h.shape)}")
    g, u = h.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(h.dtype)

"""Fused MoE router: logits -> softmax/sigmoid -> (group-limited) top-k -> weights + aux statistics.

One Triton program handles ``BT`` tokens with the whole expert row in registers (``E <= 1024``):

1. scores ``p = softmax(logits)`` (or ``sigmoid``), fp32;
2. with ``n_groups > 1``: each group of ``E / n_groups`` experts is scored by its best expert, the
   ``topk_groups`` best groups are kept and every other expert is masked out (DeepSeek-V2
   device-limited routing); with a ``bias`` [E] (DeepSeek-V3's auxiliary-loss-free balancing) the
   groups and experts are chosen by ``p + bias`` while the weights stay ``p``;
3. top-k by ``k`` rounds of ``argmax`` + mask (ties go to the lower expert id);
4. weights: the chosen scores, divided by their sum when ``norm_topk``, times ``scaling``;
5. aux-loss statistics: per block of tokens, the number of assignments and the sum of scores of
   each expert, written as partials ``[n_blocks, E]`` and summed by PyTorch (deterministic, no
   atomics) into ``tokens_per_expert_frac`` (f_i) and ``mean_prob`` (P_i).

The backward is a second Triton kernel that recomputes ``p`` from the logits and the chosen ids
and applies the chain rule through the normalisation and softmax/sigmoid; gradients flow from the
weights and from ``mean_prob`` (the token fractions and ids are not differentiable).

May import: torch, triton, stdlib.
"""

from __future__ import annotations

import torch

from ._runtime import HAS_TRITON, INTERPRET, next_pow2, triton_ok
from .reference import router_ref

__all__ = ["fused_router"]

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _scores(logits_ptr, t, e, T, E, s_l, SOFTMAX: tl.constexpr):
        tmask = t < T
        emask = e < E
        m = tmask[:, None] & emask[None, :]
        x = tl.load(logits_ptr + t.to(tl.int64)[:, None] * s_l + e[None, :], mask=m, other=0.0).to(tl.float32)
        if SOFTMAX:
            x = tl.where(emask[None, :], x, float("-inf"))
            mx = tl.max(x, 1)
            p = tl.exp(x - mx[:, None])
            p = p / tl.sum(p, 1)[:, None]
        else:
            p = tl.sigmoid(x)
        return tl.where(m, p, 0.0), m

    @triton.jit
    def _candidates(p, m, e, E, N_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr):
        """Scores of the experts that may be chosen; -inf elsewhere."""
        sel = tl.where(m, p, float("-inf"))
        if N_GROUPS > 1:
            gsize = E // N_GROUPS
            gid = e // gsize
            gscore = tl.full(p.shape, float("-inf"), tl.float32)
            for g in tl.static_range(N_GROUPS):
                ing = (gid == g)[None, :] & m
                gm = tl.max(tl.where(ing, p, float("-inf")), 1)
                gscore = tl.where(ing, gm[:, None], gscore)
            keep = tl.zeros(p.shape, tl.int32)
            for _ in tl.static_range(TOPK_GROUPS):
                col = tl.argmax(gscore, 1)
                same = gid[None, :] == (col // gsize)[:, None]
                keep = tl.where(same, 1, keep)
                gscore = tl.where(same, float("-inf"), gscore)
            sel = tl.where(keep != 0, sel, float("-inf"))
        return sel

    @triton.jit
    def _router_fwd_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, cnt_ptr, psum_ptr, T, E, s_l, scaling,
                           TOPK: tl.constexpr, SOFTMAX: tl.constexpr, N_GROUPS: tl.constexpr,
                           TOPK_GROUPS: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BT: tl.constexpr, BLOCK_E: tl.constexpr):
        pid = tl.program_id(0)
        t = pid * BT + tl.arange(0, BT)
        e = tl.arange(0, BLOCK_E)
        tmask = t < T
        p, m = _scores(logits_ptr, t, e, T, E, s_l, SOFTMAX)
        if HAS_BIAS:  # selection scores: p + bias (the choice and its order); the weights stay p
            q = p + tl.load(bias_ptr + e, mask=e < E, other=0.0).to(tl.float32)[None, :]
        else:
            q = p
        sel = _candidates(q, m, e, E, N_GROUPS, TOPK_GROUPS)
        chosen = tl.zeros((BT, BLOCK_E), tl.int32)
        for _ in tl.static_range(TOPK):  # pass 1: chosen set and the normaliser
            idx = tl.argmax(sel, 1)
            hit = e[None, :] == idx[:, None]
            chosen = tl.where(hit, 1, chosen)
            sel = tl.where(hit, float("-inf"), sel)
        if NORM:
            inv = scaling / (tl.sum(tl.where(chosen != 0, p, 0.0), 1) + 1e-20)
        else:
            inv = tl.full((BT,), 1.0, tl.float32) * scaling
        # pass 2: emit (weight, id) in descending selection-score order
        sel = tl.where(chosen != 0, q, float("-inf"))
        t64 = t.to(tl.int64)
        for i in tl.static_range(TOPK):
            idx = tl.argmax(sel, 1)
            hit = e[None, :] == idx[:, None]
            v = tl.sum(tl.where(hit, p, 0.0), 1)
            tl.store(w_ptr + t64 * TOPK + i, v * inv, mask=tmask)
            tl.store(ids_ptr + t64 * TOPK + i, idx.to(tl.int32), mask=tmask)
            sel = tl.where(hit, float("-inf"), sel)
        chosen = tl.where(tmask[:, None], chosen, 0)
        emask = e < E
        tl.store(cnt_ptr + pid.to(tl.int64) * E + e, tl.sum(chosen, 0), mask=emask)
        tl.store(psum_ptr + pid.to(tl.int64) * E + e, tl.sum(p, 0), mask=emask)

    @triton.jit
    def _router_bwd_kernel(logits_ptr, ids_ptr, gw_ptr, gmp_ptr, dl_ptr, T, E, s_l, s_d, scaling, inv_T,
                           TOPK: tl.constexpr, SOFTMAX: tl.constexpr, NORM: tl.constexpr, HAS_GW: tl.constexpr,
                           HAS_GMP: tl.constexpr, BT: tl.constexpr, BLOCK_E: tl.constexpr):
        pid = tl.program_id(0)
        t = pid * BT + tl.arange(0, BT)
        e = tl.arange(0, BLOCK_E)
        tmask = t < T
        p, m = _scores(logits_ptr, t, e, T, E, s_l, SOFTMAX)
        t64 = t.to(tl.int64)
        dp = tl.zeros((BT, BLOCK_E), tl.float32)
        if HAS_GW:
            gsel = tl.zeros((BT, BLOCK_E), tl.float32)  # upstream grad of each chosen expert's weight
            chosen = tl.zeros((BT, BLOCK_E), tl.int32)
            for i in tl.static_range(TOPK):
                idx = tl.load(ids_ptr + t64 * TOPK + i, mask=tmask, other=-1)
                g = tl.load(gw_ptr + t64 * TOPK + i, mask=tmask, other=0.0).to(tl.float32)
                hit = e[None, :] == idx[:, None]
                gsel = tl.where(hit, g[:, None], gsel)
                chosen = tl.where(hit, 1, chosen)
            if NORM:
                s = tl.sum(tl.where(chosen != 0, p, 0.0), 1) + 1e-20
                gdotw = tl.sum(gsel * p, 1)  # sum_i g_i p_i
                dp = tl.where(chosen != 0, scaling * (gsel / s[:, None] - (gdotw / (s * s))[:, None]), 0.0)
            else:
                dp = gsel * scaling
        if HAS_GMP:
            gm = tl.load(gmp_ptr + e, mask=e < E, other=0.0).to(tl.float32)
            dp += gm[None, :] * inv_T
        if SOFTMAX:
            dx = p * (dp - tl.sum(p * dp, 1)[:, None])
        else:
            dx = dp * p * (1.0 - p)
        tl.store(dl_ptr + t64[:, None] * s_d + e[None, :], dx.to(dl_ptr.dtype.element_ty), mask=m)


def _bt(E: int) -> int:
    if INTERPRET:
        return 8
    return max(1, min(64, 4096 // max(16, next_pow2(E))))


class _RouterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, score_func, n_groups, topk_groups, norm_topk, scaling, bias):
        T, E = logits.shape
        logits = logits.contiguous()
        dev = logits.device
        BT = _bt(E)
        BLOCK_E = max(16, next_pow2(E))
        nb = max(1, triton.cdiv(T, BT))
        w = torch.empty(T, top_k, device=dev, dtype=torch.float32)
        ids = torch.empty(T, top_k, device=dev, dtype=torch.int32)
        cnt = torch.zeros(nb, E, device=dev, dtype=torch.int32)
        psum = torch.zeros(nb, E, device=dev, dtype=torch.float32)
        if T > 0:
            _router_fwd_kernel[(nb,)](
                logits, logits if bias is None else bias, w, ids, cnt, psum, T, E, logits.stride(0), float(scaling),
                TOPK=top_k, SOFTMAX=score_func == "softmax", N_GROUPS=n_groups, TOPK_GROUPS=topk_groups,
                NORM=norm_topk, HAS_BIAS=bias is not None, BT=BT, BLOCK_E=BLOCK_E, num_warps=4,
            )
        frac = cnt.sum(0).float() / max(T * top_k, 1)
        mean_prob = psum.sum(0) / max(T, 1)
        ctx.save_for_backward(logits, ids)
        ctx.cfg = (top_k, score_func == "softmax", norm_topk, float(scaling), BT, BLOCK_E)
        ctx.mark_non_differentiable(ids, frac)
        return w, ids, frac, mean_prob

    @staticmethod
    def backward(ctx, gw, _gids, _gfrac, gmp):
        logits, ids = ctx.saved_tensors
        top_k, softmax, norm, scaling, BT, BLOCK_E = ctx.cfg
        T, E = logits.shape
        dl = torch.empty_like(logits)
        if T > 0:
            gw_c = gw.contiguous() if gw is not None else dl
            gmp_c = gmp.contiguous() if gmp is not None else dl
            _router_bwd_kernel[(triton.cdiv(T, BT),)](
                logits, ids, gw_c, gmp_c, dl, T, E, logits.stride(0), dl.stride(0), scaling, 1.0 / T,
                TOPK=top_k, SOFTMAX=softmax, NORM=norm, HAS_GW=gw is not None, HAS_GMP=gmp is not None,
                BT=BT, BLOCK_E=BLOCK_E, num_warps=4,
            )
        return dl, None, None, None, None, None, None, None


def fused_router(logits: torch.Tensor, top_k: int, score_func: str = "softmax", n_groups: int = 1,
                 topk_groups: int = 1, norm_topk: bool = True, scaling: float = 1.0,
                 bias: torch.Tensor | None = None):
    """Route ``logits`` [T, E]; returns ``(topk_weights [T,k] fp32, topk_ids [T,k] int32,
    tokens_per_expert_frac [E] fp32, mean_prob [E] fp32)``.  Semantics: :func:`kernels.reference.router_ref`.

    The balance loss of Switch/DeepSeek is ``alpha * E * (frac * mean_prob).sum()``. ``bias`` [E] (fp32,
    not differentiable): DeepSeek-V3's auxiliary-loss-free balancing term, added to the scores that choose
    the experts (and their groups) but not to the weights.
    """
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    T, E = logits.shape
    if not (1 <= top_k <= E):
        raise ValueError(f"top_k={top_k} must be in [1, {E}]")
    if n_groups > 1:
        if E % n_groups:
            raise ValueError(f"E={E} is not divisible by n_groups={n_groups}")
        if not (1 <= topk_groups <= n_groups) or top_k > topk_groups * (E // n_groups):
            raise ValueError("need 1 <= topk_groups <= n_groups and top_k <= topk_groups * E / n_groups")
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"bias must have shape ({E},) (one per expert), got {tuple(bias.shape)}")
    if not triton_ok(logits) or E > 1024:
        return router_ref(logits, top_k, score_func, n_groups, topk_groups, norm_topk, scaling, bias=bias)
    return _RouterFn.apply(logits, int(top_k), score_func, int(n_groups), int(topk_groups), bool(norm_topk),
                           float(scaling), None if bias is None else bias.detach().float().contiguous())

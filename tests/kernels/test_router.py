import pytest
import torch

from kernels import fused_router
from kernels.reference import router_ref

from .conftest import assert_close

CONFIGS = [
    # score_func, n_groups, topk_groups, norm_topk, scaling, top_k, E
    ("softmax", 1, 1, True, 1.0, 2, 8),
    ("softmax", 1, 1, False, 1.0, 6, 64),
    ("softmax", 4, 2, False, 16.0, 3, 16),  # DeepSeek-V2 style: group-limited, scaled
    ("sigmoid", 1, 1, True, 1.0, 4, 12),  # E not a power of two
    ("sigmoid", 4, 2, True, 2.5, 3, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_router_matches_reference(needs_triton, cfg, dtype):
    score, ng, tg, norm, scaling, k, E = cfg
    T = 21
    logits = torch.randn(T, E).to(dtype)
    la, lb = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    w, ids, frac, mp = fused_router(la, k, score, ng, tg, norm, scaling)
    rw, rids, rfrac, rmp = router_ref(lb, k, score, ng, tg, norm, scaling)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, rids)
    assert_close(w, rw, torch.float32, "weights")
    assert torch.allclose(frac, rfrac) and abs(frac.sum().item() - 1) < 1e-6
    assert_close(mp, rmp, torch.float32, "mean_prob")
    if ng > 1:  # every chosen expert is in one of the topk_groups best groups
        assert (ids // (E // ng)).unique(dim=None).numel() <= ng
        assert all(len(set((row // (E // ng)).tolist())) <= tg for row in ids)
    gw, gm = torch.randn(T, k), torch.randn(E)
    loss_a = (w * gw).sum() + (mp * gm).sum()
    loss_b = (rw * gw).sum() + (rmp * gm).sum()
    assert_close(torch.autograd.grad(loss_a, la)[0], torch.autograd.grad(loss_b, lb)[0], dtype, "d logits")


def test_aux_loss_gradient_only_through_mean_prob(needs_triton):
    logits = torch.randn(9, 8, requires_grad=True)
    _, _, frac, mp = fused_router(logits, 2)
    aux = 8 * (frac * mp).sum()
    ref_logits = logits.detach().clone().requires_grad_()
    _, _, rfrac, rmp = router_ref(ref_logits, 2)
    raux = 8 * (rfrac * rmp).sum()
    assert_close(aux, raux, torch.float32, "aux")
    assert_close(torch.autograd.grad(aux, logits)[0], torch.autograd.grad(raux, ref_logits)[0], torch.float32, "grad")


def test_router_single_token_and_errors(needs_triton):
    w, ids, frac, mp = fused_router(torch.randn(1, 4), 4)
    assert sorted(ids[0].tolist()) == [0, 1, 2, 3] and abs(w.sum().item() - 1) < 1e-5
    with pytest.raises(ValueError):
        fused_router(torch.randn(3, 10), 2, n_groups=3)
    with pytest.raises(ValueError):
        fused_router(torch.randn(3, 8), 9)
    with pytest.raises(ValueError):
        fused_router(torch.randn(3, 8), 2, score_func="relu")


@pytest.mark.parametrize("cfg", [CONFIGS[1], CONFIGS[2], CONFIGS[4]], ids=lambda c: "-".join(map(str, c)))
def test_router_bias_chooses_but_does_not_weigh(needs_triton, cfg):
    """DeepSeek-V3's balancing bias: the ids are the top-k of scores + bias (groups too), the weights the
    unbiased scores of those ids; checked against a direct computation, not only against router_ref."""
    score, ng, tg, norm, scaling, k, E = cfg
    torch.manual_seed(3)
    T = 37
    logits = torch.randn(T, E)
    bias = torch.randn(E) * 0.3
    la, lb = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    w, ids, frac, mp = fused_router(la, k, score, ng, tg, norm, scaling, bias=bias)
    rw, rids, _, rmp = router_ref(lb, k, score, ng, tg, norm, scaling, bias=bias)
    assert torch.equal(ids, rids)
    assert_close(w, rw, torch.float32, "weights")
    # independent truth: per token, the experts of its best groups (by max of p + bias) ranked by p + bias
    p = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    q = p + bias
    for t in range(T):
        allowed = range(E)
        if ng > 1:
            g = E // ng
            best = sorted(range(ng), key=lambda j: -max(q[t, j * g:(j + 1) * g]).item())[:tg]
            allowed = [e for e in range(E) if e // g in best]
        want = sorted(allowed, key=lambda e: -q[t, e].item())[:k]
        assert ids[t].tolist() == want
        wt = p[t, want]
        if norm:
            wt = wt / wt.sum()
        assert torch.allclose(w[t], wt * scaling, rtol=1e-5, atol=1e-6)
    assert torch.allclose(frac * T * k, torch.bincount(ids.reshape(-1).long(), minlength=E).float())
    # a large bias on one expert makes every token pick it; without groups nothing stops it
    if ng == 1:
        big = torch.zeros(E)
        big[E - 1] = 10.0
        _, ids_big, _, _ = fused_router(logits, k, score, ng, tg, norm, scaling, bias=big)
        assert (ids_big[:, 0] == E - 1).all()
    # the bias takes no gradient: d logits as without it, given the same ids
    gw = torch.randn(T, k)
    assert_close(torch.autograd.grad((w * gw).sum(), la)[0], torch.autograd.grad((rw * gw).sum(), lb)[0],
                 torch.float32, "d logits")
    with pytest.raises(ValueError):
        fused_router(logits, k, score, ng, tg, norm, scaling, bias=torch.zeros(E + 1))

import pytest
import torch

from kernels import grouped_mm, permute, unpermute
from kernels.permutation import route_indices
from kernels.reference import permute_ref, unpermute_ref

from .conftest import assert_close


def _ids(T, k, E, skip=()):
    """Distinct experts per token, never an expert in ``skip`` (so those are empty)."""
    allowed = torch.tensor([e for e in range(E) if e not in skip])
    rows = [allowed[torch.randperm(len(allowed))[:k]] for _ in range(T)]
    return torch.stack(rows).to(torch.int32) if T else torch.empty(0, k, dtype=torch.int32)


CASES = {
    "uneven_with_empty": (37, 3, 8, (2, 5)),
    "single_token": (1, 2, 4, ()),
    "top1": (19, 1, 6, (0,)),
    "many_experts": (40, 4, 40, ()),  # more rows than one interpreter block
    "no_tokens": (0, 2, 4, ()),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_permute_unpermute_match_reference(needs_triton, name, dtype):
    T, k, E, skip = CASES[name]
    ids = _ids(T, k, E, skip)
    D = 20
    x = torch.randn(T, D).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    p = permute(xa, ids, E)
    r = permute_ref(xb, ids, E)
    for got, want, what in zip(p, r, ["x_perm", "sorted_pos", "row_map", "counts", "offs"]):
        assert got.dtype == want.dtype, what
        assert torch.equal(got, want), what
    for e in skip:
        assert p.counts[e] == 0
    w = torch.rand(T, k)
    y = torch.randn(T * k, D).to(dtype)
    ya, wa = y.clone().requires_grad_(), w.clone().requires_grad_()
    yb, wb = y.clone().requires_grad_(), w.clone().requires_grad_()
    out = unpermute(ya, p, wa)
    ref = unpermute_ref(yb, r[2], wb)
    assert_close(out, ref, dtype, "unpermute")
    g = torch.randn(T, D).to(dtype)
    if T:
        for got, want, what in zip(torch.autograd.grad(out, (ya, wa), g), torch.autograd.grad(ref, (yb, wb), g),
                                   ["d y_perm", "d weights"]):
            assert_close(got, want, dtype, what)
        gp = torch.randn(T * k, D).to(dtype)
        assert_close(torch.autograd.grad(p.x_perm, xa, gp)[0], torch.autograd.grad(r[0], xb, gp)[0], dtype, "dx")


def test_stable_order_and_offsets(needs_triton):
    ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]], dtype=torch.int32)
    sorted_pos, row_map, counts, offs = route_indices(ids, 4)
    assert sorted_pos.tolist() == [1, 2, 6, 3, 5, 0, 4, 7]
    assert counts.tolist() == [3, 2, 3, 0] and offs.tolist() == [3, 5, 8, 8]
    assert torch.equal(row_map[sorted_pos.long()], torch.arange(8, dtype=torch.int32))


def test_moe_layer_end_to_end(needs_triton):
    """permute -> grouped_mm -> unpermute equals the dense per-token computation, with grads."""
    T, k, E, D, H = 13, 2, 5, 16, 24
    ids = _ids(T, k, E, (3,))
    x = torch.randn(T, D, requires_grad=True)
    w = torch.randn(E, D, H, requires_grad=True)
    gate = torch.rand(T, k, requires_grad=True)
    p = permute(x, ids, E)
    out = unpermute(grouped_mm(p.x_perm, w, p.offs), p, gate)
    dense = sum(gate[:, s : s + 1] * torch.einsum("td,tdh->th", x, w[ids[:, s].long()]) for s in range(k))
    assert_close(out, dense, torch.float32, "moe out")
    g = torch.randn(T, H)
    for a, b in zip(torch.autograd.grad(out, (x, w, gate), g), torch.autograd.grad(dense, (x, w, gate), g)):
        assert_close(a, b, torch.float32, "moe grad")


def test_out_of_range_ids_are_dropped_safely(needs_triton):
    ids = torch.tensor([[0, -1], [3, 1], [7, 1]], dtype=torch.int32)  # -1 and 7 are not experts of E=4
    x = torch.randn(3, 16)
    p = permute(x, ids, 4)
    assert p.counts.tolist() == [1, 2, 0, 1] and p.offs.tolist() == [1, 3, 3, 4]
    assert p.row_map[1] == -1 and p.row_map[4] == -1
    assert torch.equal(p.x_perm[:4], x[[0, 1, 2, 1]])
    assert torch.all(p.x_perm[4:] == 0)  # rows past offs[-1] belong to no expert
    w = torch.ones(3, 2, requires_grad=True)
    y = p.x_perm.detach().clone().requires_grad_()
    out = unpermute(y, p, w)
    assert torch.allclose(out, torch.stack([x[0], 2 * x[1], x[2]]))
    gw, gy = torch.autograd.grad(out.sum(), (w, y))
    assert gw[0, 1] == 0 and gw[2, 0] == 0  # dropped slots get no weight gradient
    assert torch.allclose(gw[1, 0], x[1].sum()) and torch.all(gy[4:] == 0)

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


def _capacity_maps(T, k, R, drop_share, seed=0):
    """A capacity-style send buffer: ``row_map`` [T*k] (buffer row of each assignment, -1 dropped) and its
    inverse ``src`` [R] (assignment of each row, -1 padding), injective on the kept assignments."""
    g = torch.Generator().manual_seed(seed)
    row_map = torch.randperm(R, generator=g)[:T * k]
    row_map[torch.rand(T * k, generator=g) < drop_share] = -1
    src = torch.full((R,), -1, dtype=torch.int64)
    kept = row_map >= 0
    src[row_map[kept]] = torch.arange(T * k)[kept]
    return row_map.to(torch.int32), src.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T, k, R, drop", [(13, 3, 50, 0.3), (40, 2, 80, 0.0), (5, 4, 20, 1.0), (0, 2, 6, 0.0)])
def test_gather_rows_and_combine_of_a_padded_buffer(needs_triton, T, k, R, drop, dtype):
    """The fused capacity path's two ops against their references: the send buffer gathered from the tokens
    (padding rows zero) and its backward; the returned buffer combined into the tokens (dropped assignments add
    nothing) and its backward (padding rows get a zero gradient, dropped slots no weight gradient)."""
    from kernels import gather_rows
    from kernels.reference import gather_rows_ref

    D = 20
    row_map, src = _capacity_maps(T, k, R, drop)
    x = torch.randn(T, D).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    buf, ref = gather_rows(xa, src, row_map, k), gather_rows_ref(xb, src, k)
    assert torch.equal(buf, ref)
    assert torch.all(buf[src < 0] == 0)
    g = torch.randn(R, D).to(dtype)
    if T:
        assert_close(torch.autograd.grad(buf, xa, g)[0], torch.autograd.grad(ref, xb, g)[0], dtype, "dx")
    y, w = torch.randn(R, D).to(dtype), torch.rand(T, k)
    ya, wa = y.clone().requires_grad_(), w.clone().requires_grad_()
    yb, wb = y.clone().requires_grad_(), w.clone().requires_grad_()
    out = unpermute(ya, row_map, wa, sorted_pos=src)
    want = unpermute_ref(yb, row_map, wb)
    assert_close(out, want, dtype, "combine")
    if T:
        go = torch.randn(T, D).to(dtype)
        (gy, gw), (ry, rw) = torch.autograd.grad(out, (ya, wa), go), torch.autograd.grad(want, (yb, wb), go)
        assert_close(gy, ry, dtype, "d buffer")
        assert_close(gw, rw, dtype, "d weights")
        assert torch.all(gy[src < 0] == 0)
        assert torch.all(gw.reshape(-1)[row_map < 0] == 0)


def test_unpermute_reference_skips_rows_it_does_not_have():
    """row_map -1 (a dropped assignment) contributes nothing, also in the reference (it used to read the last row)."""
    y = torch.arange(12.0).view(3, 4)
    out = unpermute_ref(y, torch.tensor([2, -1, 0, 1], dtype=torch.int32), torch.ones(2, 2))
    assert torch.equal(out, torch.stack([y[2], y[0] + y[1]]))

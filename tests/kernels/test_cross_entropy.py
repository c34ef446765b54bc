import pytest
import torch

from kernels import linear_cross_entropy
from kernels.reference import linear_cross_entropy_ref

from .conftest import assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_ce_matches_reference(needs_triton, reduction, dtype):
    T, D, V = 37, 16, 100  # chunk 16 does not divide T; V not a multiple of the block
    h = torch.randn(T, D).to(dtype)
    W = (torch.randn(V, D) / D**0.5).to(dtype)
    t = torch.randint(0, V, (T,))
    t[[3, 20]] = -100
    ha, Wa = h.clone().requires_grad_(), W.clone().requires_grad_()
    hb, Wb = h.clone().requires_grad_(), W.clone().requires_grad_()
    loss = linear_cross_entropy(ha, Wa, t, reduction=reduction, chunk=16)
    ref = linear_cross_entropy_ref(hb, Wb, t, reduction=reduction)
    assert loss.dtype == torch.float32
    assert_close(loss, ref, dtype, "loss")
    if reduction == "none":
        assert loss[3] == 0 and loss[20] == 0
    g = torch.rand_like(ref)
    for got, want, what in zip(torch.autograd.grad(loss, (ha, Wa), g), torch.autograd.grad(ref, (hb, Wb), g),
                               ["d hidden", "d weight"]):
        assert got.dtype == dtype
        assert_close(got, want, dtype, what)


def test_linear_ce_no_grad_and_single_row(needs_triton):
    h, W = torch.randn(1, 8), torch.randn(50, 8)
    t = torch.tensor([7])
    with torch.no_grad():
        got = linear_cross_entropy(h, W, t)
    assert_close(got, linear_cross_entropy_ref(h, W, t), torch.float32, "loss")


def test_linear_ce_errors():
    with pytest.raises(ValueError):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), reduction="x")
    with pytest.raises(ValueError):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 7), torch.zeros(4, dtype=torch.long))

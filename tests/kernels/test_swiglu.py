"""kernels.swiglu (fused silu(gate) * up, forward and backward) under Triton's interpreter.

Expected values come from the raw input by formulas written out here in float64 (silu(g) = g / (1 +
exp(-g)); d/dg = s (1 + g (1 - s)); d/du = silu(g)), not from the code under test; the reference
(kernels.reference.swiglu_ref, autograd) is checked against the same formulas.
"""

from __future__ import annotations

import pytest
import torch

from kernels import swiglu
from kernels.reference import swiglu_ref
from kernels.activation import swiglu_backward, swiglu_blocks, swiglu_forward

from .conftest import assert_close

# (rows, F): several 16 x 16 interpreter tiles, ragged edges in both dimensions, one row, no rows
SHAPES = {"tiles": (40, 24), "ragged": (37, 19), "one_row": (1, 5), "no_rows": (0, 8)}


def _expected(h: torch.Tensor, da: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, dh) in float64 from the raw input."""
    F = h.shape[1] // 2
    g, u = h.double()[:, :F], h.double()[:, F:]
    s = 1.0 / (1.0 + torch.exp(-g))
    a = g * s * u
    dd = da.double()
    dh = torch.cat([dd * u * s * (1.0 + g * (1.0 - s)), dd * g * s], dim=1)
    return a, dh


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(SHAPES))
def test_forward_and_gradient_match_formulas(needs_triton, name, dtype):
    R, F = SHAPES[name]
    h = (torch.randn(R, 2 * F) * 3).to(dtype)  # |g| up to ~10: both tails of the sigmoid
    da = torch.randn(R, F).to(dtype)
    a_want, dh_want = _expected(h, da)
    hk = h.clone().requires_grad_()
    a = swiglu(hk)
    assert a.dtype == dtype and a.shape == (R, F)
    assert_close(a, a_want, dtype, "a")
    (dh,) = torch.autograd.grad(a, hk, da) if R else (torch.zeros_like(h),)
    assert dh.dtype == dtype and dh.shape == (R, 2 * F)
    assert_close(dh, dh_want, dtype, "dh")
    # the reference (the fallback and the specification) against the same formulas
    hr = h.clone().requires_grad_()
    ar = swiglu_ref(hr)
    assert_close(ar, a_want, dtype, "reference a")
    if R:
        assert_close(torch.autograd.grad(ar, hr, da)[0], dh_want, dtype, "reference dh")


def test_fp32_matches_reference_tightly(needs_triton):
    """fp32: the kernel and the reference differ only by fp32 rounding of the same formula."""
    h = torch.randn(33, 2 * 21, dtype=torch.float32) * 4
    da = torch.randn(33, 21)
    a_want, dh_want = _expected(h, da)
    assert (swiglu_forward(h).double() - a_want).abs().max().item() < 1e-5
    assert (swiglu_backward(h, da).double() - dh_want).abs().max().item() < 1e-5


def test_bf16_rounds_once_like_the_reference(needs_triton):
    """bf16: the output is the fp32 result rounded to nearest once, so it equals the reference (fp32 math,
    one rounding) to the bit wherever the two fp32 results round alike (all but a handful of elements
    next to a rounding boundary, which may differ by one ulp)."""
    h = torch.randn(64, 2 * 32).to(torch.bfloat16)
    got, want = swiglu_forward(h), swiglu_ref(h)
    exact = (got == want).float().mean().item()
    assert exact > 0.99, f"only {exact:.3f} of bf16 outputs equal the reference"
    ulp = (want.float().abs() * 2.0 ** -7).clamp_min(1e-30)
    assert ((got.float() - want.float()).abs() <= ulp).all()


def test_strided_input_and_gradient(needs_triton):
    """h as a column slice of a wider buffer (row stride != 2F) and a non-contiguous da."""
    R, F = 20, 12
    base = torch.randn(R, 2 * F + 6)
    h = base[:, 3:3 + 2 * F]
    assert not h.is_contiguous()
    da = torch.randn(F, R).t()
    a_want, dh_want = _expected(h, da)
    assert_close(swiglu_forward(h), a_want, torch.float32, "a (strided h)")
    assert_close(swiglu_backward(h, da), dh_want, torch.float32, "dh (strided h, da)")


def test_gradient_flows_through_a_graph(needs_triton):
    """swiglu inside a small expert MLP: the gradients of both weights and the input equal the eager
    silu(g) * u path's (fp32)."""
    R, D, F = 24, 16, 20
    x = torch.randn(R, D)
    w13, w2 = torch.randn(2 * F, D) * 0.3, torch.randn(D, F) * 0.3
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    out = swiglu(leaves[0] @ leaves[1].t()) @ leaves[2].t()
    got = torch.autograd.grad(out.square().sum(), leaves)
    eager = [t.clone().requires_grad_() for t in (x, w13, w2)]
    g, u = (eager[0] @ eager[1].t()).chunk(2, dim=-1)
    ref_out = (torch.nn.functional.silu(g) * u) @ eager[2].t()
    want = torch.autograd.grad(ref_out.square().sum(), eager)
    for a, b, what in zip(got, want, ["dx", "dw13", "dw2"]):
        assert_close(a, b, torch.float32, what)


def test_bad_shapes_are_one_line_errors():
    with pytest.raises(ValueError, match=r"expected h \[R, 2F\]"):
        swiglu(torch.randn(4, 7))
    with pytest.raises(ValueError, match=r"expected h \[R, 2F\]"):
        swiglu_ref(torch.randn(8))


def test_block_choice_pads_least():
    """Column blocks for compiled kernels: F = 1408 (DeepSeek-V2-Lite) takes 128 (11 tiles, no padding;
    64 ties and loses to the larger), 4096 takes 256, 1000 takes 256 (every choice pads 24), 192 takes 64
    (the only one without padding), 96 takes 128 (64 and 128 both pad 32); rows fill 4,096 elements."""
    for F, bf in ((1408, 128), (4096, 256), (1000, 256), (192, 64), (96, 128)):
        br, got = swiglu_blocks(F, interpret=False)
        assert (br, got) == (4096 // bf, bf), F
    assert swiglu_blocks(1408, interpret=True) == (16, 16)


@pytest.mark.parametrize("n", [0, 17, 40])
def test_device_row_bound_computes_only_the_rows_before_it(needs_triton, n):
    """A padded EP buffer: only rows [0, n) are routed, n known on the device. Rows before n equal the
    formulas both ways; rows from n on are never written (the sentinel they were allocated with stays)."""
    R, F = 40, 24
    h = torch.randn(R, 2 * F) * 3
    da = torch.randn(R, F)
    a_want, dh_want = _expected(h, da)
    bound = torch.tensor([n], dtype=torch.int32)
    a = swiglu_forward(h, bound)
    dh = swiglu_backward(h, da, bound)
    assert (a[:n].double() - a_want[:n]).abs().max().item() < 1e-5 if n else True
    assert (dh[:n].double() - dh_want[:n]).abs().max().item() < 1e-5 if n else True
    # unwritten tail: compare against a call whose output buffer is known (the kernel must not touch it)
    torch.manual_seed(0)
    sentinel = torch.full((R, F), 12345.0)
    orig_empty = torch.empty
    try:
        torch.empty = lambda *s, **k: sentinel.clone() if tuple(s[:2]) == (R, F) else orig_empty(*s, **k)
        tail = swiglu_forward(h, bound)[n:]
    finally:
        torch.empty = orig_empty
    assert bool((tail == 12345.0).all())
    # through autograd: gradient rows before n match, and the bound is validated in one line
    hg = h.clone().requires_grad_()
    (swiglu(hg, bound)[:n] * da[:n]).sum().backward()
    if n:
        assert (hg.grad[:n].double() - dh_want[:n]).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="n_rows must be one int32/int64 element"):
        swiglu(h, torch.tensor([1.0]))

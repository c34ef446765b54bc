import pytest
import torch

from kernels import backends, grouped_mm
from kernels.grouped_gemm import grouped_mm_dw_triton, grouped_mm_dx_triton, grouped_mm_triton
from kernels.reference import grouped_mm_ref

from .conftest import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (rows per expert, trailing rows that belong to no expert)
GROUPS = {
    "uneven_with_empty": ([5, 0, 1, 19, 0, 8], 0),
    "single_token": ([1, 1, 1], 0),
    "all_empty": ([0, 0, 0], 0),
    "one_expert": ([23], 0),
    "tail_rows": ([3, 0, 10], 6),
    "empty_last": ([7, 9, 0], 0),
}


def _case(counts, tail, K, N, dtype):
    T = sum(counts) + tail
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    x = torch.randn(T, K).to(dtype)
    w = (torch.randn(len(counts), K, N) / K**0.5).to(dtype)
    return x, w, offs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(GROUPS))
def test_forward_and_grads_match_reference(needs_triton, name, dtype):
    counts, tail = GROUPS[name]
    x, w, offs = _case(counts, tail, 24, 20, dtype)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = grouped_mm(xa, wa, offs)
    ref = grouped_mm_ref(xb, wb, offs)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, "fwd")
    if tail:
        assert torch.all(out[-tail:] == 0)
    dy = torch.randn_like(ref)
    gx, gw = torch.autograd.grad(out, (xa, wa), dy)
    rx, rw = torch.autograd.grad(ref, (xb, wb), dy)
    assert_close(gx, rx, dtype, "dx")
    assert_close(gw, rw, dtype, "dw")


def test_block_boundaries_and_odd_sizes(needs_triton):
    """Groups that straddle several 16-row tiles, K and N not multiples of the block."""
    x, w, offs = _case([17, 33, 0, 16, 2], 0, 37, 41, torch.float32)
    assert_close(grouped_mm_triton(x, w, offs), grouped_mm_ref(x, w, offs), torch.float32, "fwd")
    dy = torch.randn(x.shape[0], 41)
    assert_close(grouped_mm_dx_triton(dy, w, offs), backends._reference_pass("dx", dy, w, offs), torch.float32, "dx")
    assert_close(grouped_mm_dw_triton(x, dy, offs), backends._reference_pass("dw", x, dy, offs), torch.float32, "dw")


def test_strided_weights(needs_triton):
    """w given as a transposed view (e.g. stored [E, N, K]) is read through its strides."""
    x, w, offs = _case([4, 9, 3], 0, 16, 24, torch.float32)
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert not w_t.is_contiguous()
    assert_close(grouped_mm(x, w_t, offs), grouped_mm_ref(x, w, offs), torch.float32, "fwd")


def test_int64_offsets_accepted(needs_triton):
    x, w, offs = _case([4, 0, 5], 0, 16, 16, torch.float32)
    assert_close(grouped_mm(x, w, offs.long()), grouped_mm_ref(x, w, offs), torch.float32, "fwd")


@pytest.mark.parametrize("backend", ["loop", "reference", ("triton", "loop", "reference"), "auto"], ids=str)
def test_backends_agree(needs_triton, backend):
    x, w, offs = _case([6, 0, 11, 1], 2, 16, 16, torch.float32)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = grouped_mm(xa, wa, offs, backend=backend)
    ref = grouped_mm_ref(xb, wb, offs)
    assert_close(out, ref, torch.float32, "fwd")
    dy = torch.randn_like(ref)
    for g, r in zip(torch.autograd.grad(out, (xa, wa), dy), torch.autograd.grad(ref, (xb, wb), dy)):
        assert_close(g, r, torch.float32, "grad")


def test_shape_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError):
        grouped_mm(x, torch.randn(2, 7, 3), torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(ValueError):
        grouped_mm(x, torch.randn(3, 8, 3), torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(TypeError):
        grouped_mm(x, torch.randn(2, 8, 3, dtype=torch.float64), torch.tensor([2, 4], dtype=torch.int32))


def test_transposed_linear_weights_and_grad_layout(needs_triton):
    """The trainer's layout: w_nk [E, N, K] contiguous, passed as w_nk.transpose(1, 2); dW keeps that layout."""
    x, w, offs = _case([5, 0, 12, 3], 0, 24, 16, torch.bfloat16)
    w_nk = w.transpose(1, 2).contiguous().requires_grad_()
    xa = x.clone().requires_grad_()
    out = grouped_mm(xa, w_nk.transpose(1, 2), offs)
    w_ref = w_nk.detach().clone().requires_grad_()
    xb = x.clone().requires_grad_()
    ref = grouped_mm_ref(xb, w_ref.transpose(1, 2), offs)
    assert_close(out, ref, torch.bfloat16, "fwd")
    dy = torch.randn_like(ref)
    out.backward(dy)
    ref.backward(dy)
    assert_close(xa.grad, xb.grad, torch.bfloat16, "dx")
    assert_close(w_nk.grad, w_ref.grad, torch.bfloat16, "dw")
    assert w_nk.grad.is_contiguous()


@pytest.mark.parametrize("layout", ["kn", "linear"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tma_kernel_matches_reference(needs_triton, layout, dtype):
    """The TMA (tensor-descriptor) variant for fwd and dX, both weight layouts, through the registry."""
    from kernels.grouped_gemm import tma_ok

    counts = [5, 0, 1, 19, 0, 8]
    E, K, N = len(counts), 24, 40
    T = sum(counts) + 3
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    x = torch.randn(T, K).to(dtype)
    w = torch.randn(E, K, N).to(dtype) if layout == "kn" else torch.randn(E, N, K).to(dtype).transpose(1, 2)
    assert tma_ok(x, w)
    out = backends.run_pass("triton_tma", "fwd", x, w, offs)
    assert_close(out, grouped_mm_ref(x, w, offs), dtype, "fwd")
    assert torch.all(out[-3:] == 0)
    dy = torch.randn(T, N).to(dtype)
    assert_close(backends.run_pass("triton_tma", "dx", dy, w, offs), backends._reference_pass("dx", dy, w, offs),
                 dtype, "dx")
    assert_close(backends.run_pass("triton_tma", "dw", x, dy, offs), backends._reference_pass("dw", x, dy, offs),
                 dtype, "dw")


def test_offsets_past_the_rows_are_clamped(needs_triton):
    """Bad offsets (offs[-1] > T) must not address memory past x/out: groups are clipped at T."""
    x = torch.randn(10, 16)
    w = torch.randn(2, 16, 16)
    offs = torch.tensor([6, 25], dtype=torch.int32)
    out = grouped_mm_triton(x, w, offs)
    assert_close(out, grouped_mm_ref(x, w, torch.tensor([6, 10], dtype=torch.int32)), torch.float32, "fwd")
    dw = grouped_mm_dw_triton(x, torch.randn(10, 16), offs)
    assert torch.isfinite(dw).all()

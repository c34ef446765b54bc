"""Every grouped-GEMM backend agrees with the per-expert loop, forward and gradients."""

from __future__ import annotations

import pytest
import torch

from moespec.backends import GROUPED_GEMM_BACKENDS
from trainer.model.experts import counts_to_offs, expert_swiglu, gmm_masked_reference, grouped_gemm

COUNTS = [5, 0, 9, 1, 0, 13, 4, 0]  # includes empty experts


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    T, D, F = sum(COUNTS), 32, 24
    x = torch.randn(T, D, generator=g).to(dtype)
    w13 = (torch.randn(len(COUNTS), 2 * F, D, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(len(COUNTS), D, F, generator=g) * 0.2).to(dtype)
    gy = torch.randn(T, D, generator=g).to(dtype)
    return x, w13, w2, gy


def _run(backend, dtype, device_offs):
    x, w13, w2, gy = _inputs(dtype)
    for t in (x, w13, w2):
        t.requires_grad_(True)
    kw = {"offs": counts_to_offs(COUNTS, x.device)} if device_offs else {"counts": COUNTS}
    y = expert_swiglu(x, w13, w2, backend=backend, **kw)
    (y.float() * gy.float()).sum().backward()
    return y.detach().float(), x.grad.float(), w13.grad.float(), w2.grad.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device_offs", [False, True], ids=["host-counts", "device-offs"])
@pytest.mark.parametrize("backend", GROUPED_GEMM_BACKENDS)
def test_backend_matches_loop(backend, dtype, device_offs):
    ref = _run("loop", dtype, device_offs=False)
    got = _run(backend, dtype, device_offs)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, a, b in zip(("y", "dx", "dw13", "dw2"), got, ref):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{backend} {name}: {m}")
    # gradients of empty experts are exactly zero
    assert got[2][1].abs().max().item() == 0.0 and got[3][4].abs().max().item() == 0.0


def test_masked_reference_zeroes_rows_past_the_end():
    x = torch.randn(10, 4)
    w = torch.randn(2, 3, 4)
    offs = torch.tensor([3, 7], dtype=torch.int32)
    y = gmm_masked_reference(x, w, offs)
    torch.testing.assert_close(y[:3], x[:3] @ w[0].T)
    torch.testing.assert_close(y[3:7], x[3:7] @ w[1].T)
    assert y[7:].abs().max().item() == 0.0


def test_torch_grouped_mm_backend_really_uses_grouped_mm(monkeypatch):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing in this torch build")
    calls = []
    orig = torch._grouped_mm

    def spy(*a, **k):
        calls.append(a[0].shape)
        return orig(*a, **k)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    x, w13, _, _ = _inputs(torch.float32)
    grouped_gemm(x, w13, backend="torch", counts=COUNTS)
    assert calls == [x.shape]


def test_kernels_grouped_mm_contract_if_present():
    """The triton backend hands kernels.grouped_mm a [E,K,N] transposed view of w13."""
    try:
        from kernels import grouped_mm
    except ImportError:
        pytest.skip("kernels.grouped_mm not available yet")
    x, w13, _, _ = _inputs(torch.float32)
    offs = counts_to_offs(COUNTS, x.device)
    got = grouped_mm(x, w13.transpose(1, 2), offs)
    torch.testing.assert_close(got, grouped_gemm(x, w13, backend="loop", counts=COUNTS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("align", [8, 16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_aligned_groups_match_loop(backend, align):
    ref = _run("loop", torch.float32, device_offs=False)
    x, w13, w2, gy = _inputs(torch.float32)
    for t in (x, w13, w2):
        t.requires_grad_(True)
    y = expert_swiglu(x, w13, w2, backend=backend, offs=counts_to_offs(COUNTS, x.device), align=align)
    (y * gy).sum().backward()
    for a, b in zip((y.detach(), x.grad, w13.grad, w2.grad), ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_align_groups_layout():
    from trainer.model.experts import align_groups

    x = torch.arange(1, 11, dtype=torch.float32).unsqueeze(1)  # 10 rows, groups 3, 0, 7
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)
    xp, offs_p, dest = align_groups(x, offs, 4)
    assert offs_p.tolist() == [4, 4, 10 + 3 * 3]
    assert dest.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
    assert torch.equal(xp[dest], x)
    assert xp[3].item() == 0 and xp[11:].abs().sum().item() == 0

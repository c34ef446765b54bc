"""The Triton paths never read device values back to the host.

On a CPU we cannot observe a CUDA sync, so we make the host-reading tensor methods raise while the
ops run (the reference and the `loop` backends would trip this; the Triton paths must not).
"""

import pytest
import torch

from kernels import fused_router, grouped_mm, linear_cross_entropy, permute, unpermute


@pytest.fixture
def no_host_reads(monkeypatch):
    def boom(name):
        def f(*a, **k):
            raise AssertionError(f"host read: Tensor.{name}")

        return f

    for name in ("item", "tolist", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, boom(name))
    monkeypatch.setattr(torch, "nonzero", boom("nonzero"))
    monkeypatch.setattr(torch, "bincount", boom("bincount"))


def test_moe_step_has_no_host_reads(needs_triton, no_host_reads):
    T, k, E, D, H, V = 11, 2, 4, 16, 16, 40
    x = torch.randn(T, D, requires_grad=True)
    w = torch.randn(E, D, H, requires_grad=True)
    head = torch.randn(V, H, requires_grad=True)
    logits = torch.randn(T, E, requires_grad=True)
    weights, ids, frac, mean_prob = fused_router(logits, k)
    p = permute(x, ids, E)
    y = unpermute(grouped_mm(p.x_perm, w, p.offs), p, weights)
    loss = linear_cross_entropy(y, head, torch.randint(0, V, (T,))) + E * (frac * mean_prob).sum()
    loss.backward()
    assert x.grad is not None and w.grad is not None and head.grad is not None and logits.grad is not None


def test_loop_backend_does_read_the_host(needs_triton, no_host_reads):
    """Control: the fixture does catch a host read."""
    with pytest.raises(AssertionError, match="host read"):
        grouped_mm(torch.randn(4, 16), torch.randn(2, 16, 16), torch.tensor([1, 4], dtype=torch.int32), backend="loop")

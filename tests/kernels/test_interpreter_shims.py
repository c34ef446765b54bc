"""The interpreter shims of kernels/_runtime.py: fp32 -> bf16 rounds to nearest even (as on the GPU and
in PyTorch), and nested @triton.jit calls inside a launch still see the patched language."""

from __future__ import annotations

import struct

import pytest
import torch

from kernels._runtime import HAS_TRITON, INTERPRET

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _to_bf16_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src_ptr + i, mask=i < n)
        tl.store(dst_ptr + i, x.to(tl.bfloat16), mask=i < n)

    @triton.jit
    def _store_fp32_into_bf16_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n), mask=i < n)  # implicit cast on store

    @triton.jit
    def _nested_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=0.0)
        # tl.cdiv / tl.maximum / tl.sum are @triton.jit functions of triton.language: nested calls
        s = tl.sum(tl.maximum(x, 0.0), 0) + tl.cdiv(n, BLOCK)
        tl.store(out_ptr + tl.program_id(0), s)


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# fp32 bit patterns around bf16 rounding boundaries: the low 16 bits decide
CASES = [
    0x3F808000,  # 1.00390625: exactly half an ulp above 1.0, tie -> even (1.0)
    0x3F818000,  # half an ulp above 1.0078125 (odd mantissa): tie -> up
    0x3F808001,  # just above the tie: up
    0x3F807FFF,  # just below the tie: down
    0xBF80C000,  # negative, above the tie: away from zero
    0x7F7FFFFF,  # largest finite fp32: rounds up to +inf
    0x00000001,  # smallest subnormal: 0
    0x7F800000, 0xFF800000,  # +-inf
    0x40490FDB,  # pi
]


@pytest.mark.parametrize("kernel", ["cast", "store"])
def test_fp32_to_bf16_rounds_to_nearest_even(needs_triton, kernel):
    assert INTERPRET
    vals = [_f32(b) for b in CASES] + torch.randn(1000, generator=torch.Generator().manual_seed(0)).tolist()
    src = torch.tensor(vals, dtype=torch.float32)
    dst = torch.empty(src.shape, dtype=torch.bfloat16)
    fn = _to_bf16_kernel if kernel == "cast" else _store_fp32_into_bf16_kernel
    fn[(triton.cdiv(src.numel(), 64),)](src, dst, src.numel(), BLOCK=64)
    want = src.to(torch.bfloat16)  # PyTorch: round to nearest even
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16))
    # the hand-picked cases, by value
    assert dst[0].item() == 1.0 and dst[1].item() == 1.015625 and dst[2].item() == 1.0078125
    assert dst[3].item() == 1.0 and dst[4].item() == -1.0078125 and dst[5].item() == float("inf")


def test_fp32_nan_stays_nan_in_bf16(needs_triton):
    src = torch.tensor([float("nan"), _f32(0x7F800001), 1.0], dtype=torch.float32)  # quiet and signalling NaN
    dst = torch.empty(3, dtype=torch.bfloat16)
    _to_bf16_kernel[(1,)](src, dst, 3, BLOCK=4)
    assert torch.isnan(dst[:2]).all() and dst[2].item() == 1.0


def test_nested_jit_calls_inside_a_launch(needs_triton):
    x = torch.tensor([-1.0, 2.0, 3.5, -4.0, 0.5, 6.0, -7.0], dtype=torch.float32)
    out = torch.empty(2, dtype=torch.float32)
    for _ in range(2):  # a second launch starts from a fresh per-launch record
        _nested_kernel[(2,)](x, out, 7, BLOCK=4)
        # by hand: block 0 = [-1, 2, 3.5, -4] -> 5.5, block 1 = [0.5, 6, -7] -> 6.5; cdiv(7, 4) = 2
        assert out.tolist() == [7.5, 8.5]


def test_interpreter_env_is_not_handed_to_subprocesses(needs_triton):
    """conftest.py imports kernels under TRITON_INTERPRET=1 and then takes the variable out of the
    environment (unless the caller set it): this process keeps the interpreter, subprocesses that other
    test packages start (trainers under torchrun) do not inherit it."""
    import os
    import subprocess
    import sys

    from triton import knobs

    from . import conftest

    assert INTERPRET and knobs.runtime.interpret
    if conftest._env_given:
        pytest.skip("TRITON_INTERPRET was set by the caller: it is theirs to pass on")
    assert "TRITON_INTERPRET" not in os.environ
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('TRITON_INTERPRET'))"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "None"

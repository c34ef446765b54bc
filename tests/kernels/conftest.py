"""Kernel tests run Triton's CPU interpreter.

Triton picks compiled-vs-interpreted when a kernel is decorated, i.e. when ``kernels`` is first
imported, so ``TRITON_INTERPRET=1`` is set here, at conftest import, before any test module
imports ``kernels``.  If ``kernels`` was already imported without it (another test package ran
first in this process), the Triton tests skip with that reason rather than silently testing the
PyTorch fallback; the reference/registry tests still run.  Unless the caller set it, the variable
is taken out of the environment again after the import (Triton's runtime knob keeps the value for
this process), so subprocesses started by other test packages do not inherit the interpreter.
"""

from __future__ import annotations

import os
import sys

_already = "kernels" in sys.modules
_env_given = "TRITON_INTERPRET" in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import kernels  # noqa: E402
from kernels import _runtime  # noqa: E402

if not _env_given and _runtime.HAS_TRITON:
    # Keep the interpreter for this process -- Triton's knob holds the value once set -- but do not
    # hand TRITON_INTERPRET=1 to the subprocesses that later test packages start (trainers under
    # torchrun would run every Triton kernel interpreted, which takes minutes).
    from triton import knobs  # noqa: E402

    knobs.runtime.interpret = _runtime.INTERPRET
    os.environ.pop("TRITON_INTERPRET", None)

if not _runtime.HAS_TRITON:
    SKIP_REASON = f"triton is not importable: {_runtime._IMPORT_ERROR}"
elif not (_runtime.INTERPRET or torch.cuda.is_available()):
    SKIP_REASON = ("Triton kernels were built without TRITON_INTERPRET=1 "
                   + ("(the `kernels` package was imported before tests/kernels/conftest.py set it; "
                      "run `pytest tests/kernels` on its own or first)" if _already else
                      "(TRITON_INTERPRET was set to 0 in the environment)"))
else:
    SKIP_REASON = ""


@pytest.fixture
def needs_triton():
    """Skip unless this package's Triton kernels can run on CPU tensors here."""
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """Max abs error relative to the largest magnitude of ``want``, within the dtype's tolerance."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = got.detach().float(), want.detach().float()
    if w.numel() == 0:
        return
    scale = max(w.abs().max().item(), 1.0)
    err = (g - w).abs().max().item() / scale
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]} ({dtype})"

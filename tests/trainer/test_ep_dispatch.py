"""CI: the expert-parallel dispatch paths (``ep_dispatch``) and the chunked overlap (``ep_overlap``, both
``ep_overlap_schedule`` values) on 4 gloo ranks, EP 4 and EP 2: outputs and gradients equal the reference (the
EP=1 layer, or, where the capacity drops rows, the capacity rule written out from the weights in
_ep_dispatch_worker.py), the host syncs per path and level, the dropped-row count; the pipelined schedule also
equals the serial path and the chunked schedule directly, and runs its shared expert where it says; the fused
capacity path (``ep_capacity_fused``) is bit-equal to the unfused one; and the knobs' bad values are one line,
exit 2.

``symm`` runs here on an emulation of its two NVSHMEM ops (the worker's ``EmulatedSymmOps``), so everything
of the path but the ops themselves is checked on a CPU: the capacity rule, the packed send layout, the
receive layout's GEMM offsets and padding mask, the autograd in both directions, the buffer reuse across
layers and chunks. Its index math is also checked piece by piece against loops in test_symm_dispatch.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer._workers import run_worker

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5  # fp32, tiny.yaml: outputs and gradients differ only by summation order (measured <= 7e-6)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker("_ep_dispatch_worker.py", tmp_path_factory.mktemp("ep_dispatch"), env={"TRITON_INTERPRET": "1"})


@pytest.mark.slow
def test_every_path_and_overlap_equals_the_reference(results):
    kernel_cases = [k for k in results if k.endswith("/kernels")]
    assert len(kernel_cases) in (0, 2 * 4)  # 0: no triton here (the references' cases still run the fused path)
    assert len(results) == 2 * 27 + len(kernel_cases)
    for key, res in results.items():
        assert max(res["err"].values()) < TOL, (key, res["err"])


@pytest.mark.slow
def test_host_syncs_per_path_and_level(results):
    want = {"L0": {"permute": 1, "dispatch": 1}, "L1": {"dispatch": 1}, "L2": {"permute": 1}, "L3": {}}
    for key, res in results.items():
        ep, path, level, mode = key.split("/")[:4]
        # one read per level for all chunks: the overlap adds none; capacity and symm read nothing at any level
        assert res["syncs"] == (want[level] if path == "nccl" else {}), (key, res["syncs"])
        if path == "capacity":
            assert level == "L3"


@pytest.mark.slow
def test_capacity_drops_exactly_the_rows_the_rule_drops(results):
    for key, res in results.items():
        assert res["dropped"] == res["want_dropped"], key
        if ("/capacity/" in key or "/symm/" in key) and ("/f0.6/" in key or "/f1.0/" in key or "/f1.25/" in key):
            assert res["dropped"] > 0, key  # the factor really drops
        else:
            assert res["dropped"] == 0, key
        # every rank routes its 32 tokens x top-2 once per forward
        assert res["routed_rows"] == 2 * 16 * 2, key


@pytest.mark.slow
def test_fused_capacity_path_equals_the_unfused_one(results):
    """``ep_capacity_fused`` (the default) against ``false`` on the same inputs, every capacity case (EP 4 and 2,
    serial, overlapped and pipelined, with and without drops, on the kernels' PyTorch references and on their
    Triton kernels): outputs and every gradient bit-equal (the same products summed in the same order; top-2
    sums are order-free), and the same rows dropped."""
    cases = {k: r for k, r in results.items() if "/capacity/" in k}
    assert len(cases) == 2 * 8 + sum(k.endswith("/kernels") for k in results)
    for key, res in cases.items():
        vs = res["vs_unfused"]
        assert vs["dropped"] == vs["own_dropped"], key
        assert ("/f0.6/" in key) == (vs["dropped"] > 0), key
        for name, err in vs.items():
            if "dropped" not in name:
                assert err == 0.0, (key, name, err)
    assert any(k.endswith("/kernels") for k in cases) or not _triton_importable()


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
def test_pipelined_schedule_equals_serial_and_chunked(results):
    """``ep_overlap_schedule: pipelined`` only moves the shared expert: against the chunked schedule (same chunks,
    same drops) the routed path is bit-equal and the shared expert's weight gradients, summed over two halves of
    the tokens, equal within fp32 rounding; against the serial path (no overlap) everything is within the
    tolerance where nothing is dropped (a capacity counts per chunk, so with drops the serial path drops other
    rows: the chunked comparison and the rule above judge those cases)."""
    cases = {k: r for k, r in results.items() if "/pipelined/" in k}
    assert len(cases) == 2 * 5
    for key, res in cases.items():
        chunked = res["vs"]["chunked"]
        assert chunked["dropped"] == chunked["own_dropped"], key
        for name in ("y", "x_grad", "gate.weight", "experts.w13", "experts.w2"):
            assert chunked[name] == 0.0, (key, name, chunked[name])
        assert max(v for n, v in chunked.items() if n.startswith("shared.")) < TOL, (key, chunked)
        if "/f0.6/" not in key:
            serial = res["vs"]["serial"]
            assert serial["dropped"] == serial["own_dropped"] == 0, key
            assert max(v for n, v in serial.items() if "dropped" not in n) < TOL, (key, serial)


@pytest.mark.slow
def test_pipelined_schedule_puts_the_shared_expert_at_both_ends(results):
    """Forward: the two chunks' rows go out, half the shared expert (16 of 32 tokens) computes, the two return
    trips start, the other half computes. Backward (autograd's order, not a line of the trainer's): the two output
    gradients start back first, the second half's backward covers them, then the row gradients and the first
    half's backward."""
    want = ["a2a fwd", "a2a fwd", "shared fwd 16", "a2a fwd", "a2a fwd", "shared fwd 16",
            "a2a bwd", "a2a bwd", "shared bwd 16", "a2a bwd", "a2a bwd", "shared bwd 16"]
    for key, res in results.items():
        if "/pipelined/" in key:
            assert res["order"] == want, (key, res["order"])




@pytest.mark.slow
def test_symm_skewed_router_leaves_a_peer_without_rows(results):
    """The skew cases really exercise a peer that receives nothing and local experts with no rows (the
    ops' one-row minimum blocks), and still equal the reference (above)."""
    skewed = [k for k in results if k.endswith("/skew")]
    assert len(skewed) == 8
    for key in skewed:
        P = int(key.split("/")[0][2:])
        rows = results[key]["rows_per_expert"]
        El = len(rows) // P
        assert sum(rows[-El:]) == 0, (key, rows)           # the last peer receives nothing
        assert sum(r == 0 for r in rows[:El]) < El, key     # while the first one does


@pytest.mark.parametrize("args, needle", [
    (["--set", "ep_dispatch=capacity"], "ep_dispatch: 'capacity' needs expert parallelism (ep > 1)"),
    (["--set", "ep_overlap=true"], "ep_overlap: True needs expert parallelism (ep > 1)"),
    (["--set", "ep_dispatch=deepep"], "ep_dispatch: 'deepep' is not one of nccl, capacity"),
    (["--set", "ep=2", "--set", "ep_dispatch=capacity", "--set", "ep_capacity_factor=0"],
     "ep_capacity_factor: must be > 0"),
    (["--set", "ep=2", "--set", "ep_overlap_chunks=1"], "ep_overlap_chunks: must be >= 2"),
    (["--set", "ep=2", "--set", "ep_overlap_schedule=pipelined"],
     "ep_overlap_schedule: 'pipelined' schedules the chunks of ep_overlap, which is off: set ep_overlap=true"),
    (["--set", "ep=2", "--set", "ep_overlap=true", "--set", "ep_overlap_schedule=dualpipe"],
     "ep_overlap_schedule: 'dualpipe' is not one of chunked, pipelined"),
    (["--set", "ep=3"], "n_routed_experts=8 is not divisible by ep=3"),
    (["--set", "ep_dispatch=symm"], "ep_dispatch: 'symm' needs expert parallelism (ep > 1)"),
    (["--set", "ep=2", "--set", "ep_dispatch=symm"], "ep_dispatch: symm needs CUDA GPUs with NVSHMEM (device=cpu)"),
    (["--set", "ep=2", "--set", "ep_dispatch=symm", "--set", "device=cuda", "--set", "n_routed_experts=64"],
     "ep_dispatch: symm: the NVSHMEM dispatch op takes at most 16 experts per rank, got n_routed_experts/ep = 32"),
])
def test_bad_ep_knobs_are_one_line(tmp_path, capsys, args, needle):
    """The trainer's command line (``trainer.cli.main``, what ``python -m trainer`` runs) in this process: every
    refusal is decided from the config, before any training; the command itself is run once below."""
    from trainer.cli import main

    rc = main(["--config", "tiny", *args, "-o", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2, (rc, err[-2000:])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "run").exists()


def test_a_bad_ep_knob_is_one_line_exit_2_from_the_command(tmp_path):
    """``python -m trainer`` itself: exit status 2 and one line on stderr, no traceback."""
    r = subprocess.run([sys.executable, "-m", "trainer", "--config", "tiny", "--set", "ep=2", "--set",
                        "ep_overlap_chunks=1", "-o", str(tmp_path / "run")],
                       cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: ep_overlap_chunks: must be >= 2"), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()

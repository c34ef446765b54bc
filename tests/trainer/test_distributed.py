"""CI: 4 gloo ranks (dp 2 x ep 2), one launch of _dist_worker.py for the module (forked by tests/trainer/_workers.py
with the environment torchrun gives its ranks, which is what the manifest's ``launched_by_torchrun`` reads):

* 10 steps of tiny.yaml with the launcher's arguments (`--set ep=2 --sync-free-level 1 --grouped-gemm-backend
  torch`, parsed as each rank parses them): loss decreases, every rank's trace and the manifest exist;
* EP numerics and host syncs for every level x backend, and 2 trained steps of each combination (FSDP2 and DDP
  alternating).
"""

from __future__ import annotations

import pytest

from tests.trainer._rundir import check_run_dir
from tests.trainer._workers import run_worker

BACKENDS = ("loop", "multistream", "torch", "triton")


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    return out, run_worker("_dist_worker.py", out, timeout=400)


@pytest.mark.slow
def test_four_ranks_dp2_ep2_train_ten_steps(worker):
    out, _ = worker
    m = check_run_dir(out / "dp2ep2", world=4, steps=10, profiled=range(3, 5))
    assert m["mesh"]["shape"] == [2, 2] and m["mesh"]["ranks"] == [[0, 1], [2, 3]]
    assert m["parallel"]["launched_by_torchrun"] is True
    loss = m["metrics"]["loss"]
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.1, loss
    assert loss[0] > 4.5  # ~ln(128) at init


@pytest.mark.slow
def test_every_level_and_backend_under_ep(worker):
    _, res = worker
    n_layers = 1  # moe_check runs one MoE layer
    for level in range(4):
        for backend in BACKENDS:
            key = f"{level}/{backend}"
            err = res["numerics"][key]
            assert max(err.values()) < 1e-5, (key, err)
            s = res["syncs"][key]
            assert s["total"] == s["moe"], (key, s)  # all syncs are in the MoE path
            # EP > 1: level 0 = permute + dispatch, 1 = dispatch, 2 = receive-side trim, 3 = none
            expected = {0: {"permute": 1, "dispatch": 1}, 1: {"dispatch": 1}, 2: {"permute": 1}, 3: {}}[level]
            assert s["stages"] == {k: v * n_layers for k, v in expected.items()}, (key, s)
            t = res["train"][key]
            assert t["mesh"] == [2, 2] and len(t["loss"]) == 2
            assert all(x == x and 3.0 < x < 6.0 for x in t["loss"]), (key, t)
    # same data + same init: every level/backend and both FSDP2 and DDP give the same losses
    first = res["train"]["0/loop"]
    assert all(g > 0.05 for g in first["grad_norm"])  # so clipping really acted
    for key, t in res["train"].items():
        assert t["loss"] == pytest.approx(first["loss"], rel=1e-4, abs=1e-4), key
        assert t["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-4), key
    assert {t["dp_mode"] for t in res["train"].values()} == {"fsdp", "ddp"}

"""``ep_dispatch: symm`` on a CPU: the refusal where it cannot run, and its index math against loops.

The NVSHMEM ops need GPUs (``benchmarks/bench_ep.sh check`` runs the path for real); everything around
them is plain tensor math, checked here on CPU tensors against independent loop implementations: the
capacity rule that bounds what a rank receives, the packed send slots (whose order is the ops' rank-major
input order), the static buffer bounds, and the GEMM offsets and padding mask read from the expert-major
layout that ``all_to_all_vdev_2d`` writes (emulated in ``_ep_dispatch_worker.EmulatedSymmOps``).
"""

from __future__ import annotations

import math

import pytest
import torch

from moespec.config import ConfigError, load_config
from tests.trainer._ep_dispatch_worker import EmulatedSymmOps
from trainer.model.dispatch import (
    Dispatcher,
    Routed,
    capacity_keep,
    layout_gemm_offsets,
    layout_row_mask,
    packed_slots,
    symm_bounds,
    symm_problem,
)
from trainer.model.moe import permutation


def _routed(topk_idx: torch.Tensor, E: int) -> Routed:
    order, _, sorted_exp = permutation(topk_idx)
    counts = torch.bincount(topk_idx.reshape(-1), minlength=E)
    x = torch.zeros(topk_idx.numel(), 1)
    return Routed(x, counts, order, sorted_exp, topk_idx.reshape(-1), topk_idx.shape[0])


def _random_routing(n: int, k: int, E: int, seed: int, skew: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, E, generator=g)
    if skew:  # most rows to the first experts, none to the last two
        scores[:, :2] += 2.0
        scores[:, -2:] -= 5.0
    return scores.topk(k, dim=1).indices


@pytest.mark.parametrize("seed, P, El, cap, skew", [(0, 4, 2, 5, False), (1, 2, 4, 9, False), (2, 4, 4, 3, True),
                                                    (3, 2, 3, 100, True), (4, 8, 1, 2, False)])
def test_capacity_keep_is_the_token_order_rule(seed, P, El, cap, skew):
    E, k, n = P * El, 2, 37
    idx = _random_routing(n, k, E, seed, skew)
    r = _routed(idx, E)
    keep, kept_counts = capacity_keep(r, P, El, cap)
    # reference: walk the (token, slot) pairs in token order, a peer takes its first ``cap``
    used, keep_tok = [0] * P, []
    for t in range(n):
        for s in range(k):
            p = int(idx[t, s]) // El
            keep_tok.append(used[p] < cap)
            used[p] += 1
    want = torch.tensor(keep_tok)[r.order]  # sorted-row order
    assert torch.equal(keep, want)
    want_counts = torch.zeros(E, dtype=torch.int64)
    for row, e in enumerate(r.sorted_exp.tolist()):
        want_counts[e] += int(want[row])
    assert torch.equal(kept_counts, want_counts)
    assert int(kept_counts.view(P, El).sum(1).max()) <= cap


def test_packed_slots_follow_the_ops_rank_major_input_order():
    """The kept sorted rows, packed in order, are exactly the (peer, local expert) blocks the op reads with
    ``in_splits`` = kept rows per global expert; a dropped row goes to the dummy row."""
    P, El, k, n, cap = 4, 2, 2, 29, 4
    E = P * El
    idx = _random_routing(n, k, E, 5, skew=True)
    r = _routed(idx, E)
    keep, kept_counts = capacity_keep(r, P, El, cap)
    _, send_rows, _ = symm_bounds(n, k, P, El, cap * P / (n * k))
    slot = packed_slots(keep, send_rows)
    kept_rows = [i for i in range(keep.numel()) if keep[i]]
    assert slot[keep].tolist() == list(range(len(kept_rows)))
    assert set(slot[~keep].tolist()) <= {send_rows} and bool((~keep).any())
    # the block of (peer p, local expert e) in the packed buffer holds rows of global expert p*El + e only
    starts = (kept_counts.cumsum(0) - kept_counts).tolist()
    for g in range(E):
        rows = [i for i in kept_rows if int(r.sorted_exp[i]) == g]
        assert sorted(int(slot[i]) for i in rows) == list(range(starts[g], starts[g] + len(rows)))


@pytest.mark.parametrize("tokens, k, P, El, f", [(32, 2, 4, 2, 1.25), (32, 2, 4, 2, 8.0), (32, 6, 4, 16, 0.6),
                                                 (32768, 6, 4, 16, 1.25), (7, 8, 2, 2, 1.0)])
def test_symm_bounds(tokens, k, P, El, f):
    cap, send_rows, recv_rows = symm_bounds(tokens, k, P, El, f)
    assert cap == min(max(1, math.ceil(f * tokens * k / P - 1e-9)), tokens * min(k, El))
    assert send_rows == min(tokens * k, P * cap)          # a rank never sends more than it routes
    assert recv_rows == P * cap + El                      # P senders x cap, one padding row per empty expert


def _layout(recv: torch.Tensor) -> torch.Tensor:
    splits, offsets = EmulatedSymmOps.expert_major(recv)
    return torch.stack([splits, offsets])


@pytest.mark.parametrize("recv", [
    [[3, 0], [1, 2], [0, 0], [4, 1]],        # P=4, El=2: one source sends nothing
    [[0, 0, 5], [0, 0, 2]],                  # P=2, El=3: two empty experts (one padding row each)
    [[0, 0], [0, 0]],                        # nothing received at all
    [[7]],                                   # P=1, El=1
])
def test_gemm_offsets_and_padding_mask_from_the_layout(recv):
    recv = torch.tensor(recv, dtype=torch.int64)
    P, El = recv.shape
    layout = _layout(recv)
    rows = int(recv.sum()) + El
    # reference, by walking the op's layout rule: expert blocks back to back, each at least one row
    start, want_offs, want_mask = 0, [], [False] * rows
    for e in range(El):
        n_e = int(recv[:, e].sum())
        for i in range(n_e):
            want_mask[start + i] = True
        want_offs.append(start + n_e)
        start += max(n_e, 1)
    assert layout_gemm_offsets(layout, P, El).tolist() == want_offs
    assert layout_gemm_offsets(layout, P, El).dtype == torch.int32
    assert layout_row_mask(layout, P, El, rows).tolist() == want_mask
    # every group of the grouped GEMM [offs[e-1], offs[e]) holds expert e's rows and only padding before them
    offs = [0, *want_offs]
    for e in range(El):
        grp = list(range(offs[e], offs[e + 1]))
        assert sum(want_mask[i] for i in grp) == int(recv[:, e].sum())
        assert all(want_mask[i] for i in grp[len(grp) - int(recv[:, e].sum()):])


def test_symm_refused_where_it_cannot_run():
    assert symm_problem(torch.device("cpu")) == "needs CUDA GPUs with NVSHMEM, and this run is on cpu"
    from trainer.train import _check_device_knobs

    cfg = load_config("tiny", {"ep": 2, "ep_dispatch": "symm", "device": "auto"})
    with pytest.raises(ConfigError, match="^config error: ep_dispatch: symm needs CUDA GPUs with NVSHMEM, and this "
                                          "run is on cpu$"):
        _check_device_knobs(cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match="at most 16 ranks and 16 experts per rank, got ep=2 with 32"):
        Dispatcher(path="symm", level=3, k=2, P=2, El=32, group=None)


@pytest.mark.parametrize("over, needle", [
    ({"ep": 2, "ep_dispatch": "symm"}, "symm needs CUDA GPUs with NVSHMEM (device=cpu)"),
    ({"ep": 32, "n_routed_experts": 64, "ep_dispatch": "symm", "device": "cuda"}, "at most 16 ranks per EP group, got ep=32"),
    ({"ep": 2, "n_routed_experts": 64, "ep_dispatch": "symm", "device": "cuda"}, "at most 16 experts per rank"),
])
def test_symm_config_validation(over, needle):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", over)
    assert err.value.key == "ep_dispatch" and needle in str(err.value) and "\n" not in str(err.value)


def test_symm_config_accepted_on_gpus():
    cfg = load_config("tiny", {"ep": 4, "ep_dispatch": "symm", "device": "cuda"})
    assert cfg["ep_dispatch"] == "symm"


def test_symm_is_refused_where_it_ran_wrong_or_hung_on_the_gpus():
    """On 4 x H100 (stop 24): EP 4 over the world matched the reference (5 serial symm cases, fp32 and bf16), EP 2
    groups of a 4-rank world did not (rows reached the wrong peers), and the overlapped exchange hung after
    its first step: both are one-line config errors until fixed."""
    from moespec.config import ConfigError, load_config, resolve_world

    base = {"ep": 2, "ep_dispatch": "symm", "device": "auto"}
    cfg = load_config("tiny", base)
    assert resolve_world(cfg, 2) == (1, 2)
    with pytest.raises(ConfigError, match="one EP group over the whole world"):
        resolve_world(cfg, 4)
    with pytest.raises(ConfigError, match="ep_overlap"):
        load_config("tiny", {**base, "ep_overlap": True})

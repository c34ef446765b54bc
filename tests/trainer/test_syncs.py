"""Host syncs in one forward+backward of the whole model, per sync_free_level (EP = 1, in process).

The EP > 1 counts (dispatch/receive-side syncs) are asserted in test_distributed.py.
"""

from __future__ import annotations

import pytest
import torch

from moespec.backends import GROUPED_GEMM_BACKENDS
from moespec.config import load_config
from trainer.model import Transformer
from trainer.syncs import HostSyncCounter, moe_stage

# The counts are per MoE layer and stage, whatever the widths and the tokens: tiny's layers (1 dense + 2 MoE, 8
# experts, top-2) at a quarter of its width and 16 tokens (32 routed rows per MoE layer). Under Triton's
# interpreter (the triton and auto backends on a CPU) every grouped-GEMM tile runs in Python: this halves their time.
SMALL = {"d_model": 16, "d_ff": 32, "moe_d_ff": 16, "seq_len": 16}


def _fwd_bwd_syncs(level: int, backend: str, recompute=()):
    cfg = load_config("tiny", {"sync_free_level": level, "grouped_gemm_backend": backend,
                               "recompute_layer_ids": list(recompute), **SMALL})
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    tokens = torch.randint(0, cfg["vocab_size"], (1, cfg["seq_len"]))
    with HostSyncCounter() as counter:
        loss, aux = model(tokens, tokens)
        (loss + cfg["aux_loss_coef"] * aux).backward()
    n_moe = cfg["n_layers"] - cfg["first_k_dense"]
    return counter, n_moe


def test_counter_sees_item_tolist_nonzero_and_bool():
    x = torch.tensor([0, 3, 0, 5])
    with HostSyncCounter() as c:
        with moe_stage("router"):
            x.sum().item()
            x.tolist()
            torch.nonzero(x)
            x[x > 0]  # boolean mask indexing -> nonzero
            if x.any():
                pass
        x.max().item()
    assert c.moe_total == 5
    assert c.total == 6
    assert c.by_stage["router"] == 5 and c.by_stage[None] == 1
    # and nothing leaks after exit
    with HostSyncCounter() as c2:
        pass
    x.tolist()
    assert c2.total == 0


@pytest.mark.parametrize("backend", GROUPED_GEMM_BACKENDS)
def test_sync_counts_per_level(backend):
    counts = {}
    for level in range(4):
        counter, n_moe = _fwd_bwd_syncs(level, backend)
        counts[level] = counter
        # nothing outside the MoE path syncs either (attention, loss, backward)
        assert counter.total == counter.moe_total, counter.events
    # level 0: tokens-per-expert to the host in the permutation, once per MoE layer
    assert counts[0].moe_total == n_moe > 0
    assert dict(counts[0].by_stage) == {"permute": n_moe}
    # level 1: router + permutation on device; the grouped MLP still takes host counts
    assert dict(counts[1].by_stage) == {"experts": n_moe}
    # levels 2 and 3: nothing in the MoE path syncs (EP = 1)
    assert counts[2].moe_total == 0
    assert counts[3].total == 0


def test_recompute_repeats_forward_syncs_in_backward():
    base, n_moe = _fwd_bwd_syncs(0, "loop")
    rec, _ = _fwd_bwd_syncs(0, "loop", recompute=[1, 2])
    assert base.moe_total == n_moe
    assert rec.moe_total == 2 * n_moe  # both MoE layers re-run their forward in backward
    zero, _ = _fwd_bwd_syncs(3, "torch", recompute=[1, 2])
    assert zero.total == 0


def test_aligned_grouped_gemm_stays_sync_free():
    cfg = load_config("tiny", {"sync_free_level": 3, "grouped_gemm_backend": "torch", "grouped_gemm_align": 8})
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    tokens = torch.randint(0, cfg["vocab_size"], (2, cfg["seq_len"]))
    with HostSyncCounter() as counter:
        loss, aux = model(tokens, tokens)
        (loss + aux).backward()
    assert counter.total == 0
    assert torch.isfinite(loss)

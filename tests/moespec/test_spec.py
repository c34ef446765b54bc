"""The shared definitions behave as the trainer and the analyzer relied on before they moved here."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from moespec import devices, params, schedules as S
from moespec.config import load_config
from moespec.layout import layer_costs

# ------------------------------------------------------------------------------------ schedules


def test_schedule_table():
    assert S.PIPELINE_SCHEDULES == ("gpipe", "1f1b", "vpp", "looped_bfs", "zb1p", "zbv", "dualpipev")
    assert set(S.MODELED) <= set(S.PIPELINE_SCHEDULES)
    assert S.SINGLE_STAGE == ("gpipe", "1f1b") and S.V_SHAPED == ("zbv", "dualpipev")
    assert S.SPLIT_BACKWARD == ("zb1p", "zbv", "dualpipev")
    # a run known only by its torch class is read as the modeled schedule of the same family
    assert S.TORCH_CLASS_THEORY == {
        "schedulegpipe": "gpipe", "schedule1f1b": "1f1b", "scheduleinterleaved1f1b": "vpp",
        "scheduleloopedbfs": "vpp", "scheduleinterleavedzerobubble": "zb1p", "schedulezbvzerobubble": "zbv",
        "scheduledualpipev": "zbv"}
    assert all(S.canonical(a) in S.MODELED for a in S.ALIASES) and S.canonical("1f1b") == "1f1b"


def test_placement():
    assert S.stage_to_rank(8, 4, "loop") == [0, 1, 2, 3, 0, 1, 2, 3]
    assert S.stage_to_rank(8, 4, "v") == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [S.placement_of(s) for s in ("1f1b", "vpp", "zbv", "dualpipev", "unknown")] == [
        "loop", "loop", "v", "v", "loop"]


def test_bubble_theory():
    assert S.bubble_ratio("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert S.bubble_ratio("interleaved", 4, 8, 2) == S.bubble_ratio("vpp", 4, 8, 2) == pytest.approx(3 / 19)
    assert S.bubble_ratio("zbh1", 4, 8) == pytest.approx(3 / 27)
    assert S.bubble_ratio("zbv", 4, 8) == 0.0 and math.isnan(S.bubble_ratio("zb2p", 4, 7))
    for bad in (("looped_bfs", 4, 8), ("1f1b", 0, 8)):
        with pytest.raises(S.ScheduleError, match="^bubble: "):
            S.bubble_ratio(*bad)
    assert S.gradient_accumulation(4096 * 8 * 16, 4096, 2, 32, pp=4) == (8, 8)
    with pytest.raises(S.ScheduleError, match="not divisible by pp"):
        S.gradient_accumulation(4096, 4096, 1, 6, pp=4)


CASES = [(s, pp, vpp, m) for s, vpps in (("gpipe", (1,)), ("1f1b", (1,)), ("vpp", (2, 3)), ("zb1p", (1, 2)),
                                          ("zbv", (2,)))
         for pp in (1, 2, 4) for vpp in vpps for m in (pp, 2 * pp, 3 * pp + (pp > 1))
         if not (s in ("vpp", "zb1p") and m % max(1, m // pp))]  # the config's rounds rule


@pytest.mark.parametrize("schedule,pp,vpp,m", CASES)
def test_action_order_runs_every_action_once_on_its_rank(schedule, pp, vpp, m):
    """Each rank runs F (and B, and W for a split backward) of every micro-batch of exactly the stages the
    schedule places on it, each once, a stage's micro-batches in order, and a backward after its forward."""
    place = S.stage_to_rank(pp * vpp, pp, S.placement_of(schedule))
    kinds = ("F", "B", "W") if S.SCHEDULES[schedule].split_backward else ("F", "B")
    for rank in range(pp):
        order = S.action_order(schedule, pp, vpp, m, rank)
        mine = [s for s, r in enumerate(place) if r == rank]
        assert Counter(order) == Counter((k, s, mb) for k in kinds for s in mine for mb in range(m))
        at = {a: i for i, a in enumerate(order)}
        for s in mine:
            for k in kinds:
                assert [mb for kk, st, mb in order if (kk, st) == (k, s)] == list(range(m))
            for mb in range(m):
                assert at[("F", s, mb)] < at[("B", s, mb)]
                if "W" in kinds:
                    assert at[("B", s, mb)] < at[("W", s, mb)]


def test_action_order_of_an_unmodeled_schedule():
    with pytest.raises(S.ScheduleError, match="'dualpipev': no action order modeled"):
        S.action_order("dualpipev", 2, 2, 4, 0)


# ------------------------------------------------------------------------------------ parameters


@pytest.mark.parametrize("name,over", [("tiny", []), ("deepseek_v2_lite", []), ("tiny", ["attn_type=mla"]),
                                       ("tiny", ["attn_type=mla", "q_lora_rank=16", "tie_embeddings=true"]),
                                       ("tiny", ["n_kv_heads=2", "first_k_dense=0"])])
def test_counts_agree(name, over):
    cfg = load_config(name, over)
    assert params.total_params(cfg) == params.count_params(cfg)["total"]
    # the layout's per-piece costs add up to the model FLOPs per token (MFU's numerator)
    e, layers, loss = layer_costs(cfg)
    assert e + sum(layers) + loss == pytest.approx(params.model_flops_per_token(cfg), rel=1e-12)
    assert params.attention_score_flops(cfg) == 3 * cfg["seq_len"] * cfg["n_heads"] * sum(params.attention_dims(cfg))


# ------------------------------------------------------------------------------------ devices
# What the memory projection and the trainer's MFU read before the table was one: unchanged.
OLD_MEMORY = {"H100": 80, "H100 SXM": 80, "H100 PCIe": 80, "H100 NVL": 94, "H200": 141, "H200 SXM": 141,
              "H200 NVL": 141, "B200": 180, "A100": 80, "A100 80GB": 80, "A100 40GB": 40, "MI250X": 64,
              "MI300X": 192, "MI325X": 256, "MI355X": 288, "NVIDIA H100 80GB HBM3": 80, "nvidia h200": 141,
              "NVIDIA A100-SXM4-80GB": 80}


@pytest.mark.parametrize("name,gb", OLD_MEMORY.items())
def test_device_memory(name, gb):
    assert devices.device_memory(name) == gb * 10**9


def test_device_memory_unknown():
    assert devices.device_memory("Mystery GPU") is None
    assert "H100" in devices.memory_names() and "MI300X" in devices.memory_names()


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H200", 989.4e12), ("NVIDIA GH200 480GB", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A800-SXM4-80GB", 312e12), ("NVIDIA B200", 2250e12),
    ("NVIDIA L40S", 362.05e12), ("AMD Instinct MI300X", 1307.4e12), ("Tesla V100-SXM2-32GB", None), ("cpu", None),
    (None, None)])
def test_mfu_peak(name, peak):
    assert devices.peak_bf16_flops(name) == peak


def test_analyzer_names_every_piece_of_the_grammar():
    from moespec.layout import PIECES
    from tracelens.analysis import pipeline as P

    assert set(P._LAYOUT_MODULES) == set(PIECES)


def test_h800_reads_as_the_h100_of_its_form():
    """The H800 is an H100 with its NVLink capped: the same bf16 peak (the trainer's MFU denominator before
    the table moved here was 989.4 TFLOP/s for it) and HBM ceilings."""
    from moespec.devices import device_key, peak_bf16_flops

    assert device_key("NVIDIA H800") == "H100 SXM"
    assert device_key("NVIDIA H800 PCIe") == "H100 PCIe"
    assert peak_bf16_flops("NVIDIA H800") == 989.4e12

"""The what-if mechanisms' registry (tracelens/projection/mechanisms): every module of the package registers
its mechanism, the keys the model predicts and the uncertainties are derived from them, and the order the
model applies them in is the declared one (the constraints between the edits hold)."""

from __future__ import annotations

import pkgutil
from typing import ClassVar

import pytest

from moespec.config import DEFAULTS
from tracelens.projection import mechanisms as MECH
from tracelens.projection import whatif as W
from tracelens.projection.mechanisms import base


def test_every_module_registers_a_mechanism_and_the_lists_are_derived():
    modules = {m.name for m in pkgutil.iter_modules(MECH.__path__)} - {"base"}
    assert {type(m).__module__.rsplit(".", 1)[1] for m in MECH.REGISTRY} == modules
    assert [m.order for m in MECH.REGISTRY] == sorted(m.order for m in MECH.REGISTRY)
    # the model's lists are the registry's, nothing kept by hand beside them
    assert W.MODELED == tuple(k for m in MECH.REGISTRY if m.changes_step and not m.refuses for k in m.keys)
    assert W.NEUTRAL == tuple(k for m in MECH.REGISTRY if not m.changes_step and not m.refuses for k in m.keys)
    assert MECH.REFUSED == {k: m.refuses for m in MECH.REGISTRY if m.refuses for k in m.keys}
    assert W.SIGMA == {s: v for m in MECH.REGISTRY for s, v in m.sigma.items()}
    keys = [k for m in MECH.REGISTRY for k in m.keys]
    assert len(keys) == len(set(keys)), "a key owned by two mechanisms"
    assert set(keys) <= set(DEFAULTS), "a mechanism owns a key the trainer does not have"
    for m in MECH.REGISTRY:
        assert m.name and m.summary and m.phase in base.PHASES
        assert all(0.0 < v <= 1.0 for v in m.sigma.values()), m.name
        assert m.changes_step or not m.sigma, m.name


def test_the_application_order_keeps_the_dependencies_between_edits():
    edits = [m.name for m in MECH.EDITS]
    # the drains are found before anything moves item positions; the token scaling comes before the expert
    # GEMMs it feeds (already token-scaled per-expert kernels are merged); the step timing acts on the step's
    # end after every other edit; the EP overlap re-cuts the chunks the layout sized; GC and the pipeline act on the
    # replayed step, the pipeline's own knobs before a change of pp (which stands them aside)
    assert edits[0] == "drains" and edits[-1] == "step_timing"
    assert edits.index("tokens") < edits.index("gemm_shapes") < edits.index("gemm_backend") < edits.index("sync_free")
    assert edits.index("layout") < edits.index("overlap")
    assert [m.name for m in MECH.STEPS] == ["gc", "pipeline", "pp_layout"]
    assert set(edits) | {"gc", "pipeline", "pp_layout"} == {m.name for m in MECH.REGISTRY
                                                             if m.changes_step and not m.refuses}
    # the placement and the fused capacity path act on the layout's rows and buffers, before the chunks are re-cut
    assert edits.index("layout") < edits.index("ep_placement") < edits.index("capacity_fused") < edits.index("overlap")
    # a refused family is never applied
    assert not {m.name for m in MECH.REGISTRY if m.refuses} & set(edits)


def test_registration_refuses_a_bad_declaration():
    class NoPhase(base.Mechanism):
        name = "x_bad_phase"
        phase = "later"

    class Twice(base.Mechanism):
        name = "tokens"

    class Nameless(base.Mechanism):
        pass

    n = len(base._REGISTERED)
    for cls, needle in ((NoPhase, "phase 'later'"), (Twice, "registered twice"), (Nameless, "no name")):
        with pytest.raises(ValueError, match=needle):
            base.register(cls)
    assert len(base._REGISTERED) == n


def test_a_mechanism_applies_only_to_its_own_change():
    old = {**DEFAULTS, "micro_batch_size": 2, "grouped_gemm_backend": "torch"}

    class _Model:
        table = None

    def applying(**changes) -> list[str]:
        new = {**old, **changes}
        ch = base.Change(_Model(), old, new, new, changes)
        return [m.name for m in MECH.REGISTRY if m.changes_step and m.applies(ch)]

    assert applying() == []
    assert applying(micro_batch_size=4) == ["tokens"]
    assert applying(recompute_layer_ids=[1]) == ["recompute"]
    assert applying(step_timing="events") == ["step_timing"]
    assert applying(manual_gc=5) == ["gc"]
    # a per-expert backend: its drains and GEMM shapes come with it
    assert applying(grouped_gemm_backend="loop") == ["drains", "gemm_backend"]


# ---------------------------------------------------------------------------------------------- the audit of the keys
# Every trainer key (moespec.config.DEFAULTS), by what the what-if does with a change of it. A key added to the
# trainer's config fails test_every_trainer_key_is_classified until a mechanism owns it (modeled, neutral or refused
# with its one line) and it is listed here.
AUDIT = {
    "modeled": {"micro_batch_size", "loss_fusion", "loss_chunk_size", "grouped_gemm_backend", "sync_free_level", "ep",
                "dp", "ep_dispatch", "ep_capacity_factor", "ep_placement", "ep_placement_loads", "ep_capacity_fused",
                "ep_overlap", "ep_overlap_chunks", "recompute_layer_ids", "microbatches", "manual_gc", "optimizer",
                "step_timing", "expert_swiglu", "pipeline_schedule", "vpp", "pipeline_layout", "pipeline_layer_costs",
                "pp"},
    "neutral": {"steps", "profile_step_start", "profile_step_end", "log_every", "timing_warmup_steps", "seed", "lr",
                "min_lr_ratio", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "grad_clip", "numa_bind",
                "env", "multistream_num_streams", "init_std", "rms_eps", "rope_theta", "routed_scaling_factor",
                "norm_topk_prob"},
    "refused": {
        # another model (model_shape.py)
        "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "attn_type", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "d_ff", "moe_d_ff", "n_routed_experts",
        "n_shared_experts", "top_k", "score_func", "n_group", "topk_group", "first_k_dense", "tie_embeddings",
        "seq_len",
        "compile", "cuda_graphs", "use_triton_kernels",  # code generation (codegen.py)
        "dtype", "device",  # precision.py
        "data", "data_path", "data_dtype",  # the input pipeline (data.py)
        "dp_mode",  # dp_mode.py
        "grouped_gemm_align",  # gemm_align.py
        "router_bias_update_rate", "aux_loss_coef",  # routing that changes over the run (balance.py)
        "ep_overlap_schedule",  # overlap_schedule.py
    },
}


def test_every_trainer_key_is_classified():
    got = {"modeled": set(W.MODELED), "neutral": set(W.NEUTRAL), "refused": set(MECH.REFUSED)}
    assert got == AUDIT
    every = set().union(*AUDIT.values())
    missing = sorted(set(DEFAULTS) - every)
    assert not missing, f"trainer keys no mechanism owns (modeled, neutral or refused): {missing}"
    assert sum(len(v) for v in AUDIT.values()) == len(DEFAULTS)


def test_refusals_are_one_line_that_names_the_key():
    m = W.Model.__new__(W.Model)  # _validate reads the run's config only
    m.config, m.manifest, m.run = dict(DEFAULTS), {"world_size": 1}, "RUN"
    for key, why in MECH.REFUSED.items():
        assert why and "\n" not in why and len(why) < 400, key
        other = {"vocab_size": 1024, "compile": "dense", "cuda_graphs": "on", "use_triton_kernels": True,
                 "dtype": "bf16", "device": "cpu", "data": "memmap", "data_path": "x.bin", "data_dtype": "int32",
                 "dp_mode": "ddp", "grouped_gemm_align": 16, "router_bias_update_rate": 0.001, "aux_loss_coef": 0.0,
                 "ep_overlap_schedule": "pipelined", "score_func": "sigmoid", "attn_type": "mla",
                 "tie_embeddings": True}.get(key)
        if other is None:
            other = DEFAULTS[key] * 2 if isinstance(DEFAULTS[key], int) and DEFAULTS[key] else 2
        with pytest.raises(W.WhatIfError) as e:
            m._validate({key: other})
        assert str(e.value) == f"{key}: {why}"


def test_a_refused_family_is_declared_and_cannot_be_applied():
    class Bad(base.Mechanism):
        name = "x_two_lines"
        keys = ("seed",)
        refuses = "one\ntwo"

    class BadLegacy(base.Mechanism):
        name = "x_bad_legacy"
        keys = ("seed",)
        legacy: ClassVar[dict] = {"lr": 1.0}

    n = len(base._REGISTERED)
    for cls, needle in ((Bad, "one line"), (BadLegacy, "legacy value for a key it does not own")):
        with pytest.raises(ValueError, match=needle):
            base.register(cls)
    assert len(base._REGISTERED) == n
    # the run's trainer without the fused capacity path ran the unfused one
    assert MECH.LEGACY == {"ep_capacity_fused": False}

"""The what-if mechanisms' registry (tracelens/projection/mechanisms): every module of the package registers
its mechanism, the keys the model predicts and the uncertainties are derived from them, and the order the
model applies them in is the declared one (the constraints between the edits hold)."""

from __future__ import annotations

import pkgutil

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
    assert W.MODELED == tuple(k for m in MECH.REGISTRY if m.changes_step for k in m.keys)
    assert W.NEUTRAL == tuple(k for m in MECH.REGISTRY if not m.changes_step for k in m.keys)
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
    assert set(edits) | {"gc", "pipeline", "pp_layout"} == {m.name for m in MECH.REGISTRY if m.changes_step}


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

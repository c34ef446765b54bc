"""The registry of derived entries (tracelens.derived) and the analysis's use of it: each entry computed
once, its declared inputs resolved first, a bad declaration rejected at once with one line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

import tracelens
from tracelens.analyzer import DERIVED, Analysis
from tracelens.derived import DeclarationError, Registry

FIX = Path(__file__).resolve().parents[1] / "fixtures"
NCCL_2RANK = FIX / "h200_nccl_2rank"


@dataclass
class _Owner:
    x: int


def _registry(calls: list[str]) -> Registry:
    reg = Registry(base=("x",))

    @reg.entry("double", inputs=("x",))
    def _double(a):
        calls.append("double")
        return 2 * a.x

    @reg.entry("plus_one", inputs=("double",))
    def _plus_one(a, double):
        calls.append("plus_one")
        return double + 1

    @reg.entry("both", inputs=("x", "double", "plus_one"))
    def _both(a, double, plus_one):
        calls.append("both")
        return (a.x, double, plus_one)

    return reg


def test_each_entry_is_computed_once_after_its_inputs():
    calls: list[str] = []
    d = _registry(calls).bind(_Owner(5))
    assert d["both"] == (5, 10, 11)
    assert calls == ["double", "plus_one", "both"]  # inputs first, each once
    assert d["both"] == (5, 10, 11) and d["plus_one"] == 11 and d["double"] == 10
    assert calls == ["double", "plus_one", "both"]  # read again: nothing recomputed
    assert "double" in d and _registry([]).upstream("both") == ["double", "plus_one", "both"]


def test_a_missing_input_a_cycle_or_a_taken_name_is_rejected_when_declared():
    reg = Registry(base=("gpu",))
    with pytest.raises(DeclarationError, match=r"^entry 'a': input 'nope' is neither a base table nor an entry") as e:
        reg.entry("a", inputs=("gpu", "nope"))(lambda a, nope: None)
    assert "\n" not in str(e.value)
    with pytest.raises(DeclarationError, match=r"^entry 'a': lists itself as an input \(a cycle\)$"):
        reg.entry("a", inputs=("a",))(lambda a, a_: None)
    # a <- b <- a: whichever comes first names the other, not declared yet
    with pytest.raises(DeclarationError, match=r"^entry 'a': input 'b' is neither"):
        reg.entry("a", inputs=("b",))(lambda a, b: None)
    reg.entry("b", inputs=("gpu",))(lambda a: 1)
    with pytest.raises(DeclarationError, match=r"^entry 'b': the name is already a declared entry$"):
        reg.entry("b")(lambda a: 2)
    with pytest.raises(DeclarationError, match=r"^entry 'gpu': the name is already a base table$"):
        reg.entry("gpu")(lambda a: 2)
    assert list(reg.entries) == ["b"]  # nothing half-declared


def test_a_kept_error_is_raised_again_without_recomputing():
    reg = Registry(base=())
    calls = []

    @reg.entry("fails", keep_errors=True)
    def _fails(a):
        calls.append(1)
        raise ValueError("no profiled step")

    d = reg.bind(object())
    for _ in range(2):
        with pytest.raises(ValueError, match="no profiled step"):
            d["fails"]
    assert calls == [1] and isinstance(d.outcome("fails"), ValueError)


def test_put_refuses_to_replace_an_input_of_a_computed_entry():
    d = _registry([]).bind(_Owner(1))
    d.put("double", 7)  # not computed yet: a value from elsewhere (an offloaded child)
    assert d["plus_one"] == 8
    with pytest.raises(ValueError, match="plus_one was computed from it"):
        d.put("double", 9)
    d.put("both", (0, 0, 0))  # nothing reads it
    assert d["both"] == (0, 0, 0)


def test_the_analysis_entries_are_declared_over_its_base_tables():
    base = {f.name for f in Analysis.__dataclass_fields__.values()} - {"derived", "computed"}
    assert DERIVED.base == base
    for e in DERIVED:
        assert e.inputs and e.module and e.doc, e.name
    assert {e.name for e in DERIVED if e.offload} == {"roofline", "decomposition"}


def test_summary_report_and_verbs_share_one_computation(monkeypatch):
    """comm instances, host syncs and idle gaps: computed once, read by the start-up waits, findings,
    health, the report and the accessors the CLI verbs call."""
    from reports.html import render
    from tracelens.analysis import comm as CM, host as H

    monkeypatch.setenv("TRACELENS_OFFLOAD", "0")
    counts = {"collective_instances": 0, "comm_kernels": 0, "host_syncs": 0, "idle_gaps": 0, "launch_stats": 0}
    for mod, name in ((CM, "collective_instances"), (CM, "comm_kernels"), (H, "host_syncs"), (H, "idle_gaps"),
                      (H, "launch_stats")):
        def counted(*a, _f=getattr(mod, name), _n=name, **k):
            counts[_n] += 1
            return _f(*a, **k)
        monkeypatch.setattr(mod, name, counted)
    a = tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))
    assert "comm_instances" in a.derived  # the start-up waits read it while the tables were built
    s = a.summary()
    html = render(a)
    assert a.comm_instances() is a.derived["comm_instances"] and a.findings() is s["findings"] is a.findings()
    assert not a.comm_instances().empty and "sync wait" in html
    a.idle_gaps(), a.host_syncs(), a.launch_stats(), a.health()
    # findings classify the gaps against the window's syncs: again only when the window leaves some out
    syncs, w = a.host_syncs(), a.window
    again = int(w.restricts and not syncs["step"].isin(w.used).all())
    assert counts == {"collective_instances": 1, "comm_kernels": 1, "host_syncs": 1, "idle_gaps": 1 + again,
                      "launch_stats": 1}

"""Wrapper ranges are not ops (issue 36: the demo's top op was "PythonSubclass").

`PythonSubclass` is the range the dispatcher records when an op reaches a tensor subclass's
``__torch_dispatch__`` (DTensor under FSDP2): it sits between the op the program called and the same op on
the local tensors (``aten::sqrt > PythonSubclass > aten::sqrt``). Its self time is the subclass's Python
dispatch of that op, so the host view counts it in the enclosing op. Checked against the raw JSON of the
CPU fixture, whose optimizer step runs on FSDP2's DTensor parameters."""

from __future__ import annotations

import re
from collections import defaultdict
from decimal import Decimal

import pytest

import tracelens
from tracelens.analysis.steps import host_top_ops

from ..conftest import FIXTURES, raw_events

CPU_TINY = FIXTURES / "cpu_tiny" / "rank0.json.gz"


@pytest.fixture(scope="module")
def cpu_tiny():
    return tracelens.analyze(tracelens.load(CPU_TINY, cache=False))


def _raw_self_per_step(path, steps: set[int]) -> tuple[dict[str, Decimal], dict[str, Decimal]]:
    """Host self time per step by op name over the given profiler steps, from the raw events: each op's
    duration less its direct children's (every host range on its thread); once as recorded, once with each
    PythonSubclass range's self time given to the op enclosing it."""
    ev = [e for e in raw_events(path) if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    windows = [(Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"])) for e in ev
               if (m := re.fullmatch(r"ProfilerStep#(\d+)", e["name"])) and int(m.group(1)) in steps]
    by_thread = defaultdict(list)
    for e in ev:
        by_thread[(e["pid"], e["tid"])].append(e)
    as_recorded, folded = defaultdict(Decimal), defaultdict(Decimal)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (Decimal(e["ts"]), -Decimal(e["dur"])))
        stack, parent, self_t = [], {}, {}
        for i, e in enumerate(evs):
            ts = Decimal(e["ts"])
            while stack and Decimal(evs[stack[-1]]["ts"]) + Decimal(evs[stack[-1]]["dur"]) <= ts:
                stack.pop()
            parent[i] = stack[-1] if stack else None
            self_t[i] = Decimal(e["dur"])
            if stack:
                self_t[stack[-1]] -= Decimal(e["dur"])
            stack.append(i)
        for i, e in enumerate(evs):
            ts = Decimal(e["ts"])
            if e["cat"] != "cpu_op" or not any(lo <= ts < hi for lo, hi in windows):
                continue
            as_recorded[e["name"]] += self_t[i]
            p = parent[i]
            target = evs[p]["name"] if e["name"] == "PythonSubclass" and p is not None and evs[p]["cat"] == "cpu_op" \
                else e["name"]
            folded[target] += self_t[i]
    n = Decimal(len(windows))
    return {k: v / n for k, v in as_recorded.items()}, {k: v / n for k, v in folded.items()}


def test_wrapper_self_time_goes_to_the_enclosing_op(cpu_tiny):
    a = cpu_tiny
    top = host_top_ops(a, top=10_000)
    raw, folded = _raw_self_per_step(CPU_TINY, {int(s) for s in a.window.used})
    assert raw["PythonSubclass"] > max(v for k, v in raw.items() if k != "PythonSubclass")  # as recorded: the top op
    assert "PythonSubclass" not in set(top["op"])
    assert top["op"].iloc[0] == max(folded, key=folded.get) != "PythonSubclass"
    got = top.set_index("op")["self_us_per_step"]
    for op in ("aten::mul", "aten::mm", "aten::sqrt", "aten::add_", "aten::lerp_"):
        assert got[op] == pytest.approx(float(folded[op]), abs=1e-3), op
    assert got.sum() == pytest.approx(float(sum(raw.values())), rel=1e-9)  # moved, not lost


def test_analyze_terminal_and_host_finding_name_real_ops(cpu_tiny):
    from tracelens.analysis.findings import host_findings
    from tracelens.analyzer import summary_text

    text = summary_text(cpu_tiny)
    line = next(ln for ln in text.splitlines() if "top ops by self time per step:" in ln)
    assert "PythonSubclass" not in line
    f = host_findings(cpu_tiny)[0]
    assert "PythonSubclass" not in f["evidence"]["next_families"] and "PythonSubclass" not in f["evidence"]["ops_us_per_step"]

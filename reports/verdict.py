"""The verdict at the top of report.html (tracelens.analysis.verdict): the bottleneck in one red line, the
step in one bar, the top three actions with the what-if's predicted gain, memory verdict and the commands
that check it, and the health warnings that invalidate a figure. Plain HTML and CSS (no plotly), so the
first screen is there before any chart is drawn. Same conventions as the other page modules
(reports/common.py); trace-derived text reaches the page through Jinja2's autoescaping only.
"""

from __future__ import annotations

from typing import Any

from tracelens.analysis import verdict as V
from tracelens.analysis.comm import ranks_text

from .common import COLORS as CATEGORY_COLORS
from .decomposition import COLORS as COMPONENT_COLORS

BASIS = {"calibrated": "measured mean step, split by the what-if's replay",
         "replay": "the traced step, replayed (no measured step time to calibrate on)",
         "timeline": "GPU time over the analysed window (no step decomposition)"}
LABEL_MIN = 0.08  # a part narrower than this share of the bar carries no label inside it (its legend entry does)


def _color(name: str) -> str:
    return COMPONENT_COLORS.get(name) or CATEGORY_COLORS.get(name) or "#9aa6b8"


def _arrows(text: str) -> str:
    """The terminal's "a -> b" of a knob change as the page writes it."""
    return text.replace(" -> ", " → ")


def section_context(a: Any) -> dict[str, Any]:
    """The template context of the verdict section; ``{"error": line}`` when there is no verdict (never raises:
    the rest of the page still stands)."""
    from tracelens.projection.decomposition import reason

    try:
        v = a.verdict()
    except Exception as e:  # noqa: BLE001 - the page is written whatever the verdict meets
        return {"error": reason(e)}
    parts = []
    if v.step is not None:
        for p in sorted(v.step.parts, key=lambda p: -p.us):
            parts.append({"name": p.name, "share": p.share, "width": round(100.0 * p.share, 3), "color": _color(p.name),
                          "text": f"{p.name} {V.pct(p.share)}", "title": f"{p.name}: {V.ms(p.us)} ({V.pct(p.share)} of the step)",
                          "inside": p.share >= LABEL_MIN, "legend": p.share >= 0.005,
                          "main": p.name == v.bottleneck_part or (v.bottleneck_part == "host" and p.kind == "host")
                          or (v.bottleneck_part == "waits" and p.name == "collective waits")
                          or (v.bottleneck_part == "communication" and p.name == "exposed communication")})
    actions = []
    for a_ in v.actions:
        o = a_.prediction or {}
        cls = "none" if not a_.predicted else ("oom" if not o.get("fits", True) else "gain")
        actions.append({"title": _arrows(a_.title), "knob": a_.changes is not None, "gain": a_.gain, "memory": a_.memory,
                        "cls": cls, "estimate": a_.estimate, "no_prediction": _arrows(a_.no_prediction),
                        "evidence": a_.evidence, "commands": a_.commands, "source": a_.source})
    step = v.step
    return {
        "error": None, "bottleneck": v.bottleneck, "parts": parts,
        "step_ms": V.ms(step.step_us) if step is not None else None,
        "step_basis": BASIS.get(step.basis, step.basis) if step is not None else None,
        "step_ranks": step.ranks if step is not None else 0, "step_note": v.step_note,
        "actions": actions, "model": v.model, "considered": [_arrows(c) for c in v.considered],
        "health": [dict(h, ranks=ranks_text(h["ranks"])) for h in v.health],
    }


__all__ = ["section_context"]

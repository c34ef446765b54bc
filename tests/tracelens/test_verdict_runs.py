"""The verdict end to end (issue 36): `tracelens analyze` on a CPU run, the 2-GPU NCCL traces, a pipeline-parallel
and an expert-parallel 4-GPU run prints the bottleneck, three actions with their gains and the health warnings,
and report.html opens with the same verdict."""

from __future__ import annotations

import html
import json
import re

import pytest
from click.testing import CliRunner

from tracelens.cli import main

from ..conftest import FIXTURES

RUNS = {
    "cpu": FIXTURES / "cpu_whatif_grid" / "rep0" / "base",  # a CPU run dir (manifest + trace)
    "nccl": FIXTURES / "h200_nccl_2rank",  # two trace files, no manifest: no what-if
    "pp": FIXTURES / "h100_4gpu" / "pp4_1f1b",
    "ep": FIXTURES / "h100_4gpu" / "ep4_cap_ovl",
}
HOST = ("launch-bound idle", "sync waits")
LOSS = {"pipeline bubble": "pipeline bubble", "collective waits": "waiting for the slowest rank",
        "exposed communication": "communication not hidden by compute", "host": "the host"}


@pytest.fixture(scope="module", params=list(RUNS))
def analyzed(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    r = CliRunner().invoke(main, ["analyze", str(RUNS[request.param]), "-o", str(out), "--no-tables", "--no-cache"])
    assert r.exit_code == 0, r.output
    return request.param, r.stdout, json.loads((out / "summary.json").read_text()), (out / "report.html").read_text()


def _largest_part(summary: dict) -> str:
    """The bottleneck computed here from summary.json's decomposition: the largest mean part over ranks, the
    host's two idle parts together, "other" left out."""
    ranks = summary["decomposition"]["ranks"]
    mean: dict[str, float] = {}
    for r in ranks:
        for c in r["components"]:
            key = "host" if c["component"] in HOST else c["component"]
            mean[key] = mean.get(key, 0.0) + c["us"] / len(ranks)
    mean.pop("other", None)
    return max(mean, key=mean.get)


def test_the_terminal_names_the_bottleneck_and_three_actions_with_gains(analyzed):
    name, out, summary, _ = analyzed
    lines = out.splitlines()
    head = next(x for x in lines if x.startswith("verdict: "))
    part = _largest_part(summary)
    assert (LOSS[part] if part in LOSS else f"Compute-bound: {'the ' if not part.endswith('s') else ''}{part}") in head
    numbered = [x for x in lines if re.match(r"  \d\. ", x)]
    assert [x[:5] for x in numbered] == ["  1. ", "  2. ", "  3. "]
    for i, x in enumerate(numbered):  # each action with its gain: predicted, or the finding's estimate
        j = lines.index(x)
        assert "tokens/s/GPU" in x or lines[j + 1].startswith("     gain: "), x
    predicted = [x for x in numbered if "tokens/s/GPU" in x]
    if name == "nccl":
        assert not predicted and "what-if: no predictions: these traces have no run manifest" in out
    else:
        assert predicted, out  # a run dir: the what-if predicts
        assert all(re.search(r": [+-]\d+(\.\d)?% ± \d+(\.\d)?% tokens/s/GPU, (fits in|peak) ", x) for x in predicted)
        assert "check: tracelens whatif " in out and "check: python -m trainer.launch --config " in out
    for h in summary["health"]["checks"]:  # every health warning, in the terminal too
        if h["severity"] in ("error", "warning"):
            assert f"health {h['severity']}: {h['check']}: " in out
    assert "findings:" in out and "=" not in out[out.index("findings:"):]  # sentences, no key=value


def test_the_report_opens_with_the_same_verdict(analyzed):
    _, _, summary, page = analyzed
    main_ = page[page.index("<main>"):]
    first = re.search(r"<section id=\"([\w-]+)\"", main_)
    assert first.group(1) == "verdict"
    section = main_[first.start():main_.index("</section>", first.start())]
    text = html.unescape(section)
    v = summary["verdict"]
    assert v["available"] and len(v["actions"]) == 3
    assert v["bottleneck"] in text
    assert section.count('<li data-source="') == 3
    for a in v["actions"]:
        assert a["title"].replace(" -> ", " → ") in text
        assert (a["gain"] or a["estimate"]) in text
    # the load warnings (the CPU-only banner among them) come after the verdict
    whole = html.unescape(page)
    for w in summary["warnings"]:
        assert whole.index(w) > whole.index('id="verdict"')

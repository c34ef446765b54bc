"""The split long fuzz run (`tests/tracelens/fuzz_campaign.py`): shares, the per-verb counts, failures."""

from __future__ import annotations

import json

from .fuzz_campaign import PROPERTIES, shares, summarize, summary_text


def test_shares_split_every_example_over_the_workers():
    assert shares(2000, 16) == [125] * 16
    assert shares(10, 4) == [3, 3, 2, 2] and sum(shares(61, 7)) == 61
    assert shares(3, 16) == [1, 1, 1]  # no worker without an example


def test_the_properties_are_the_suites_tests():
    from . import test_fuzz_verbs

    for test in PROPERTIES.values():
        assert callable(getattr(test_fuzz_verbs, test))


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_summary_counts_per_property_and_verb_and_keeps_each_failure(tmp_path):
    _write(tmp_path / "worker0.jsonl", [
        {"prop": "manifest", "outcome": "ok", "s": 1.0, "calls": [["check", "run", "--json", "j"]]},
        {"prop": "manifest", "outcome": "error", "s": 0.5, "calls": [["check", "run"]]},
        {"prop": "manifest", "outcome": "internal", "s": 2.0, "calls": [["whatif", "run"]], "message": "exit 3: boom",
         "inputs": "{'verb': 'whatif'}"},
    ])
    _write(tmp_path / "worker1.jsonl", [
        {"prop": "autotune", "outcome": "ok", "s": 3.0, "calls": [["autotune", "s.yaml"], ["autotune", "--resume"]]},
        {"prop": "autotune", "outcome": "skipped"},
    ])
    s = summarize(tmp_path, {0: 10, 1: 11}, wall_s=12.0, planned=6, exits={0: 1, 1: 0})
    rows = {(r["prop"], r["verb"]): r for r in s["table"]}
    assert rows[("manifest", "check")]["cases"] == 2 and rows[("manifest", "check")]["ok"] == 1
    assert rows[("manifest", "check")]["error"] == 1 and rows[("manifest", "whatif")]["internal"] == 1
    assert rows[("autotune", "autotune")]["ok"] == 1 and rows[("autotune", "-")]["skipped"] == 1
    assert s["cases"] == 5 and s["skipped"] == 1 and s["failures"] == 1 and not s["passed"]
    (f,) = s["failure_cases"]
    assert (f["worker"], f["seed"], f["verb"], f["outcome"]) == (0, 10, "whatif", "internal")
    text = summary_text(s)
    assert "--hypothesis-seed=10" in text and "exit 3: boom" in text and text.rstrip().endswith("FAILED")


def test_a_clean_campaign_passes(tmp_path):
    _write(tmp_path / "worker0.jsonl", [{"prop": "traces", "outcome": "ok", "s": 1.0, "calls": [["host", "t"]]}])
    s = summarize(tmp_path, {0: 0}, wall_s=1.0, planned=1, exits={0: 0})
    assert s["passed"] and summary_text(s).rstrip().endswith("PASSED")

"""Generated replay scripts never run trace text as code (issue 31, High 1).

A trace is data from someone else: its op names and the path it sits at go into the reproducer only as
data. The attack cases are the ones the adversarial pass found: an op named so that it closes the old
docstring and opens a statement (still replayable: the overload suffix is dropped), and a trace directory
whose name closes a string and concatenates a call. The checks are independent of replay.py's own code:
the generated module's syntax tree must be the one a benign trace gives (only the data string differs),
and running the script must not perform the injected side effect.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import tracelens
from tracelens import replay as R
from tracelens.cli import main

from ..conftest import write_json_gz

FIX = Path(__file__).resolve().parents[1] / "fixtures"
MOE = FIX / "h200_moe_1gpu" / "moe1gpu_grouped.json.gz"

# each payload, if it ever ran, creates the file named by the marker in the current directory
OP_PAYLOAD = 'aten::mm.x"""\nopen("PWNED_OP", "w").close()\n"""'
DIR_PAYLOAD = '"""+open("PWNED_DIR","w").close().__str__()+"""' + "'''+open('PWNED_DIR2','w').close()+'''"


def _rename_first_mm(src: Path, dst: Path, new_name: str) -> None:
    """A copy of the real trace whose first `aten::mm` cpu_op is called ``new_name`` (everything else as recorded)."""
    with gzip.open(src, "rt") as f:
        doc = json.load(f)
    mm = sorted((e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"
                 and e.get("name") == "aten::mm"), key=lambda e: float(e["ts"]))
    assert mm, "the fixture has aten::mm calls"
    mm[0]["name"] = new_name
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_json_gz(doc, dst)


def _skeleton(path: Path) -> str:
    """The script's syntax tree with every string constant blanked: equal for two scripts iff they differ only in
    string data."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.dump(tree)


def _spec(path: Path) -> dict:
    """The SPEC data of a generated script, read from its syntax tree (never by running it)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "SPEC":
            return json.loads(node.value.args[0].value)
    raise AssertionError("no SPEC assignment")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("inj")
    benign = root / "benign" / "trace.json.gz"
    evil = root / DIR_PAYLOAD / "trace.json.gz"
    _rename_first_mm(MOE, benign, "aten::mm")
    _rename_first_mm(MOE, evil, OP_PAYLOAD)
    return benign, evil


def test_script_holds_trace_text_only_as_data(traces, tmp_path):
    benign, evil = traces
    good = R.write_script(R.find_call(tracelens.load(str(benign), cache=False), "aten::mm", 0), tmp_path / "good.py")
    call = R.find_call(tracelens.load(str(evil), cache=False), OP_PAYLOAD, 0)
    assert call.replayable, call.reason  # the attack needs a replayable op: it is one
    bad = R.write_script(call, tmp_path / "bad.py")
    # same code, only string data differs: no statement, call or name came from the trace
    assert _skeleton(bad) == _skeleton(good)
    spec = _spec(bad)
    assert spec["op"] == OP_PAYLOAD and DIR_PAYLOAD in spec["source"]  # the text is kept exactly, as data
    assert spec["args"] == _spec(good)["args"]
    # the docstring and comments carry no trace text at all
    doc = ast.get_docstring(ast.parse(bad.read_text()))
    assert "PWNED" not in doc and "PWNED" not in "".join(ln for ln in bad.read_text().splitlines()
                                                         if ln.lstrip().startswith("#"))


def test_cli_replay_of_hostile_trace_runs_nothing(traces, tmp_path):
    pytest.importorskip("torch", reason="running the generated script needs torch")
    _, evil = traces
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["replay", str(evil), "--op", OP_PAYLOAD, "-o", str(out)])
    assert r.exit_code == 0, r.output
    scripts = sorted(out.glob("*.py"))
    assert len(scripts) == 1 and scripts[0].name.isascii() and '"' not in scripts[0].name
    work = tmp_path / "cwd"
    work.mkdir()
    p = subprocess.run([sys.executable, str(scripts[0]), "--cpu", "--iters", "1", "--warmup", "0"], cwd=work,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(os.listdir(work)) == []  # no payload ran: it would have created PWNED_* here
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["op"] == OP_PAYLOAD and res["overload"] == "default" and res["measured_us"] > 0
    # the shapes it built are the raw trace's for that call
    with gzip.open(evil, "rt") as f:
        raw = next(e for e in json.load(f)["traceEvents"] if e.get("name") == OP_PAYLOAD)
    assert res["shapes"] == raw["args"]["Input Dims"]


def test_list_arguments_must_be_plain_data():
    with pytest.raises(tracelens.TraceError, match="not a list of numbers"):
        R.build_args("aten::view", [[2, 3], []], ["float", "IntList"], [[3, 1], []], ["", "[{1, 2}]"])
    with pytest.raises(tracelens.TraceError, match="is not a list"):
        R.build_args("aten::view", [[2, 3], []], ["float", "IntList"], [[3, 1], []], ["", "[" * 5000])

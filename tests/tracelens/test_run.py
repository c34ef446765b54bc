"""`tracelens.io.run.Run`: the run-dir contract read in one module (issue 32, item 1).

Checked against the files themselves (json.loads of the fixture's manifest, the jsonl lines counted by
hand), and the rule that no other module of the analyzer or the reports opens a run dir's files.
"""

from __future__ import annotations

import ast
import gzip
import json
import shutil
from pathlib import Path

import pytest

import tracelens
from tracelens.analysis import pipeline as P
from tracelens.errors import TraceError
from tracelens.io.run import Run

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures"
PP2 = FIX / "h200_pp2_run" / "vpp2"
EP2 = FIX / "h200_ep2_run" / "L0_loop"


def _pp2_run() -> Path:
    for d in sorted((FIX / "h200_pp2_run").iterdir()):
        if (d / "manifest.json").is_file() and (d / "pipeline").is_dir():
            return d
    pytest.skip("no pipeline run dir with a manifest in the fixtures")


def test_run_of_a_run_dir_holds_its_manifest_and_files():
    run = _pp2_run()
    r = Run.open(run)
    assert r.is_run_dir and r.root == run and r.name == run.name
    assert r.manifest == json.loads((run / "manifest.json").read_text())
    assert r.config == r.manifest["config"] and r.manifest_problem is None
    assert sorted(Path(f).name for f in r.trace_files) == sorted(p.name for p in (run / "traces").iterdir()
                                                                 if p.name.endswith((".json", ".json.gz")))
    names = sorted(p.name for p in (run / "pipeline").iterdir())
    assert [p.name for _, p in r.pipeline_files()] == names
    # the same run reached from its traces/ directory and from its trace files
    assert Run.open(run / "traces").root == run
    assert Run.of_files(r.trace_files).manifest == r.manifest
    # what the loaded trace carries is that run
    t = tracelens.load(run, cache=False, progress=False)
    assert t.run.root == run and t.run.manifest == r.manifest
    assert t.run_status == r.status() and r.status()["status"] in ("complete", "running", "failed", "unknown")


def test_pipeline_actions_decoded_from_the_runs_bytes():
    run = _pp2_run()
    n_lines = 0
    for f in (run / "pipeline").iterdir():
        data = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
        n_lines += sum(1 for ln in data.splitlines() if ln.strip())
    acts = P.read_pipeline_jsonl(Run.open(run))
    assert len(acts) == n_lines
    assert P.read_pipeline_jsonl(run).equals(acts)  # a path is opened as a Run


def test_loose_traces_have_no_run_dir(tmp_path):
    src = next((EP2 / "traces").iterdir())
    f = tmp_path / src.name
    shutil.copy(src, f)
    r = Run.of_files([f])
    assert (r.root, r.manifest, r.manifest_problem, r.pipeline_files()) == (None, None, None, [])
    assert r.status() is None and r.name == f.name
    with pytest.raises(TraceError, match="not a run dir with a manifest.json"):
        r.require_manifest("the what-if model")
    given = r.with_manifest({"config": {"a": 1}})
    assert given.config == {"a": 1} and given.trace_files == r.trace_files


@pytest.mark.parametrize("content,problem", [
    (b"{not json", "unreadable (JSONDecodeError"),
    (b"[1, 2]", "not a JSON object"),
    (b"[" * 100000 + b"]" * 100000, "unreadable ("),
])
def test_a_bad_manifest_is_one_line_naming_it(tmp_path, content, problem):
    run = tmp_path / "run"
    shutil.copytree(EP2, run)
    (run / "manifest.json").write_bytes(content)
    r = Run.open(run)
    assert r.manifest is None and r.manifest_problem.startswith(f"{run / 'manifest.json'}: ")
    assert problem in r.manifest_problem and "\n" not in r.manifest_problem
    st = r.status()
    assert st["status"] == "unreadable" and "whether the run finished is unknown" in st["warning"]
    with pytest.raises(TraceError, match="needs the run's manifest"):
        r.require_manifest("the what-if model")


def test_traces_without_a_manifest(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(EP2 / "traces", run / "traces")
    r = Run.of_files(sorted((run / "traces").iterdir()))
    assert r.root is None and r.manifest is None and r.status() is None
    assert r.manifest_problem == f"{run / 'manifest.json'}: no manifest.json beside traces/"
    t = tracelens.load(run / "traces", cache=False, progress=False)
    assert t.run.manifest_problem == r.manifest_problem and t.run_status is None


def _opens_run_files(path: Path) -> list[str]:
    """Code (not docstrings) of one module that names a run dir's files: the manifest's or the routing file's
    name, or a path joined with "pipeline" (the jsonl directory)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    hits = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            if n.value in ("manifest.json", "routing.json"):
                hits.append(f"{path.relative_to(REPO)}:{n.lineno}: {n.value!r}")
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) and isinstance(n.right, ast.Constant) \
                and n.right.value == "pipeline":
            hits.append(f"{path.relative_to(REPO)}:{n.lineno}: / 'pipeline'")
    return hits


def test_the_run_dir_is_opened_in_one_module():
    """Analyses, projections, the CLI and the reports receive a `Run`; only tracelens/io/run.py opens a run
    dir's manifest, pipeline and routing files."""
    owner = REPO / "tracelens" / "io" / "run.py"
    assert _opens_run_files(owner), "the check must see the owner's own reads"
    hits = [h for pkg in ("tracelens", "reports") for f in sorted((REPO / pkg).rglob("*.py")) if f != owner
            for h in _opens_run_files(f)]
    assert hits == []


def _copy_pp_run(tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(_pp2_run(), run)
    return run


def test_an_empty_pipeline_file_is_said_not_dropped(tmp_path):
    run = _copy_pp_run(tmp_path)
    files = sorted((run / "pipeline").iterdir())
    victim = files[-1]
    victim.write_bytes(b"" if victim.suffix != ".gz" else gzip.compress(b""))
    res = P.load_pipeline(run, cache=False, traces=False)
    assert any(w.startswith(f"{victim}: empty: rank ") for w in res.warnings), res.warnings


def test_a_sentinel_end_time_names_the_record(tmp_path):
    run = _copy_pp_run(tmp_path)
    f = sorted((run / "pipeline").iterdir())[0]
    data = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
    lines = data.splitlines()
    rec = json.loads(lines[1])
    rec["end_ns"] = 2**63 - 1
    lines[1] = json.dumps(rec).encode()
    new = b"\n".join(lines) + b"\n"
    f.write_bytes(gzip.compress(new) if f.suffix == ".gz" else new)
    with pytest.raises(TraceError, match=r":2: 'end_ns' 9223372036854775807 is not a time"):
        P.read_pipeline_jsonl(run)


@pytest.mark.parametrize("how", ["start_zero", "end_late"])
def test_an_action_with_a_broken_time_is_left_out_and_said(tmp_path, how):
    """Issue 31 #6: one action with start_ns 0 (a 56-year window, 75 % bubble) or ending 1,000 s late (74.8 %)
    changed the bubble with no warning. A rank runs one action at a time (no recorded run has two of a rank's
    actions overlapping), so the broken action is the one overlapping the others: left out, and said."""
    run = _copy_pp_run(tmp_path)
    ref = P.load_pipeline(_pp2_run(), cache=False, traces=False)
    f = sorted((run / "pipeline").iterdir())[0]
    data = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
    lines = data.splitlines()
    k = len(lines) // 2
    rec = json.loads(lines[k])
    if how == "start_zero":
        rec["start_ns"] = 0
    else:
        rec["end_ns"] = rec["end_ns"] + 1000 * 10**9
    lines[k] = json.dumps(rec).encode()
    new = b"\n".join(lines) + b"\n"
    f.write_bytes(gzip.compress(new) if f.suffix == ".gz" else new)
    res = P.load_pipeline(run, cache=False, traces=False)
    assert any(w.startswith(f"{f}: 1 pipeline action(s) left out") for w in res.warnings), res.warnings
    assert abs(res.overall_ratio - ref.overall_ratio) < 0.05, (res.overall_ratio, ref.overall_ratio)

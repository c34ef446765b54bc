"""Golden test: every output of tracelens on the committed fixture corpus is what it was.

Each case of tests/golden/cases.py (one `tracelens` invocation: analyze's summary.json, report.html and
every table in Parquet and CSV; comm / host / roofline / check / memory / whatif JSON; ppvis' page and
JSON; diff's JSON, Markdown and page; bubble; and the stdout, stderr and exit status of each) runs
in this process through click's CliRunner, from the checkout's root with fixture paths relative to it,
and what it writes must equal the stored golden in tests/golden/data/<case id>/ byte for byte after
this normalization (tests/golden/harness.py has the details):

* the checkout's absolute path -> <REPO>, the case's output directory -> <OUT>;
* tracelens' own version -> <VERSION> (summary.json tool.version, "tracelens X.Y.Z" in pages);
* in the CLI's text, the elapsed time `analyze` prints ("in 1.23s") -> "in <T>s";
* in HTML pages, the bundled plotly.js library -> <PLOTLY_JS>, and the figures' JSON payload -> its
  SHA-256, the payload itself compared as JSON data (NAME.html.figures.json);
* Parquet tables are compared through a description: row count, each column's Arrow type and pandas
  dtype, and hashes of the exact values by column and by 25-row block (the values are in the CSV twin).

No number is rounded: the outputs are deterministic (two generations with TRACELENS_OFFLOAD=0 and =1
and different hash seeds give the same bytes; regen.py checks it each time). A failure names the case,
the file and its first differing JSON keys, CSV cells (row, column), Parquet columns and row blocks,
or text lines. It assumes the environment the goldens came from: the pinned libraries of `make install`
(pandas' CSV float format, pyarrow's types) and a system `c++filt` (kernel names are demangled with it).

When the outputs are meant to change, regenerate (tests/golden/regen.py says how, and that the commit
message must say which outputs changed and why).
"""

from __future__ import annotations

import gzip
import json

import pytest

from ..conftest import write_json_gz
from . import harness
from .cases import BY_ID, CASES, Case


@pytest.fixture
def at_repo_root(monkeypatch, tmp_path):
    """The cases run from the checkout's root, with an empty cache directory of their own (so no kernel
    tuner cache of this machine enters a what-if) and internal errors as the one line users see."""
    monkeypatch.chdir(harness.REPO)
    monkeypatch.setenv("TRACELENS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TRACELENS_DEBUG", raising=False)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_outputs_unchanged(case: Case, tmp_path, at_repo_root):
    golden = harness.read_golden(case.id)
    assert golden, (f"{case.id}: no golden in {harness.case_dir(case.id).relative_to(harness.REPO)}; "
                    "run tests/golden/regen.py (see its docstring)")
    problems = harness.compare(golden, harness.run_case(case, tmp_path / "out"))
    assert not problems, f"golden case {case.id} differs:\n  " + "\n  ".join(problems)


def test_every_golden_directory_has_a_case():
    """A case removed from cases.py leaves no stale golden behind (regen.py deletes them)."""
    dirs = [harness.case_dir(c.id) for c in CASES]
    stale = sorted({p.parent.relative_to(harness.DATA).as_posix() for p in harness.DATA.rglob("*")
                    if p.is_file() and not any(d in p.parents for d in dirs)})
    assert not stale, f"golden data without a case in cases.py: {stale}"


def test_committed_goldens_are_small():
    size = sum(p.stat().st_size for p in harness.DATA.rglob("*") if p.is_file())
    assert size < 3 * 2**20, f"tests/golden/data holds {size / 2**20:.1f} MiB: keep it under 3 MiB (fewer, more diverse cases)"


# ----------------------------------------------------------------------- the comparator on perturbed outputs


@pytest.fixture(scope="module")
def nccl_golden():
    return harness.read_golden("nccl_2rank/analyze")


def test_a_changed_summary_value_is_named_by_its_json_path(nccl_golden):
    summary = json.loads(nccl_golden["summary.json"])
    assert json.dumps(summary, indent=2).encode() == nccl_golden["summary.json"]  # as `analyze` writes it
    busy = summary["ranks"][1]["gpu_busy_us"]
    summary["ranks"][1]["gpu_busy_us"] = busy + 0.001
    now = {**nccl_golden, "summary.json": json.dumps(summary, indent=2).encode()}
    assert harness.compare(nccl_golden, now) == [
        f"summary.json: 1 difference(s):\n    $.ranks[1].gpu_busy_us: golden {busy!r}, now {busy + 0.001!r}"]


def test_a_changed_csv_cell_is_named_by_row_and_column(nccl_golden):
    lines = nccl_golden["tables/kernels.csv"].decode().splitlines(keepends=True)
    header = lines[0].rstrip("\n").split(",")
    row = lines[3]
    cells = row.rstrip("\n").split(",")
    col = header.index("count")
    cells[col] = str(int(cells[col]) + 1)
    now = {**nccl_golden, "tables/kernels.csv": "".join(lines[:3] + [",".join(cells) + "\n"] + lines[4:]).encode()}
    (problem,) = harness.compare(nccl_golden, now)
    assert problem.startswith("tables/kernels.csv: 1 difference(s)")
    assert "row 2 (kernel=" in problem, problem
    assert f"column 'count': golden \"{int(cells[col]) - 1}\", now \"{cells[col]}\"" in problem, problem


def test_a_changed_parquet_column_is_named_with_its_rows(nccl_golden):
    desc = json.loads(nccl_golden["tables/kernels.parquet.json"])
    desc["columns"][2]["hash"] = "0" * 16
    desc["columns"][3]["arrow_type"] = "float"
    desc["row_blocks"][0] = "0" * 16
    now = {**nccl_golden, "tables/kernels.parquet.json": harness._dump(desc)}
    (problem,) = harness.compare(nccl_golden, now)
    name2, name3 = desc["columns"][2]["name"], desc["columns"][3]["name"]
    assert f"values differ in column(s) ['{name2}']" in problem
    assert f"column '{name3}': arrow_type" in problem and "-> float" in problem
    assert "in rows 0-24 (the golden values are in tables/kernels.csv)" in problem


def test_a_changed_figure_point_and_page_line_are_located(nccl_golden):
    figs = json.loads(nccl_golden["report.html.figures.json"])
    first = next(iter(figs))
    figs[first]["layout"]["title_changed_by_test"] = 1
    page = nccl_golden["report.html"].decode().replace("<h2>", "<h2>X", 1)
    now = {**nccl_golden, "report.html.figures.json": harness._dump(figs), "report.html": page.encode()}
    problems = harness.compare(nccl_golden, now)
    assert len(problems) == 2, problems
    assert problems[0].startswith("report.html: ") and "@@ -" in problems[0] and "\n    +  <h2>X" in problems[0], problems[0]
    assert f"$.{first}.layout.title_changed_by_test: added (1)" in problems[1]


def test_missing_and_extra_files_are_named(nccl_golden):
    now = dict(nccl_golden)
    del now["tables/ops.csv"]
    now["tables/new_table.csv"] = b"a\n1\n"
    assert harness.compare(nccl_golden, now) == ["tables/ops.csv: in the golden, not written now",
                                                 "tables/new_table.csv: written now, not in the golden"]


def test_a_perturbed_trace_fails_its_golden_case(monkeypatch, tmp_path, at_repo_root):
    """End to end: the same case on a copy of its trace whose one kernel runs 1 µs longer (at the same
    relative path, from another root) fails, naming summary.json's key and the timeline table's cells."""
    case = BY_ID["hta_triton/analyze"]
    rel = case.args[1]
    with gzip.open(harness.REPO / rel, "rt") as f:
        doc = json.load(f)
    kernel = next(e for e in doc["traceEvents"] if e.get("cat") == "kernel")
    kernel["dur"] += 1
    copy = tmp_path / "root" / rel
    copy.parent.mkdir(parents=True)
    write_json_gz(doc, copy)
    monkeypatch.chdir(tmp_path / "root")
    problems = harness.compare(harness.read_golden(case.id), harness.run_case(case, tmp_path / "out"))
    text = "\n".join(problems)
    assert any(p.startswith("summary.json: ") and ".gpu_busy_us: golden " in p for p in problems), text
    assert any(p.startswith("tables/timeline.csv: ") and "column 'gpu_busy_us'" in p for p in problems), text
    assert any(p.startswith("tables/timeline.parquet.json: ") and "'gpu_busy_us'" in p for p in problems), text


def test_stored_gzip_files_are_deterministic():
    """Gzipped goldens carry no name or time in their header, so regenerating unchanged data changes no byte."""
    for p in harness.DATA.rglob("*.gz"):
        head = p.read_bytes()[:10]
        assert head[4:8] == b"\0\0\0\0" and not head[3] & 0x08, f"{p}: gzip header has a time or a name"
        gzip.decompress(p.read_bytes())

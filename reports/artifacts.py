"""Write everything `tracelens analyze` produces into one output directory.

    OUT/report.html        self-contained HTML report
    OUT/summary.json       the stable machine interface (docs/summary-json.md)
    OUT/tables/NAME.parquet and NAME.csv for every analysis table

All or nothing: every file is first written under a temporary name in OUT (a hidden staging
directory), and only when all of them are complete are they renamed into place. A read-only or full
output directory (or any other write error) ends in one `TraceError` naming the directory and the
problem, with the staged files removed and the previous outputs, if any, untouched -- never a
traceback, never a half-written report beside a fresh summary.json.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd

from tracelens.analyzer import Analysis
from tracelens.errors import TraceError
from tracelens.offload import Shared
from tracelens.records import Records

from .csv_text import csv_bytes
from .html import BASE_TABLE_HTML, base_table_html, chain_parts, page_parts, render


LONG_LIST = 1000  # summary.json: a list of more items than this is written one record (or all its scalars) a line


def summary_json(doc: Any) -> str:
    """summary.json's text: ``json.dumps(doc, indent=2)``, except that a list of more than LONG_LIST items is written
    one dict a line (a list of records: per-step figures), or on one line (a list of numbers or strings). The same
    values (Python's own encoder for each item), in a file that still reads a record a line, written by the C
    encoder: with indent, Python's json encodes in Python, ~1.8 s for the 80,000 steps of a 200 MB trace of short
    steps (~18 s at 2 GB), against ~0.6 s this way. Shorter lists are as ``indent=2`` writes them. A
    `tracelens.records.Records` (the per-step lists as columns) is written as its list of dicts would be, from
    its columns (`Records.json_lines`: no dict per record)."""
    return "".join(summary_json_parts(doc))


def summary_json_parts(doc: Any) -> Iterator[str]:
    """`summary_json`'s text in parts, the records of a long `Records` list a chunk at a time as they are encoded: written
    one after the other, the file holds the text without the whole of it in memory (300 MB for the 800,000 steps of
    a 2 GB trace). Everything but those chunks is encoded here, before the first part is given out (what the json
    module cannot encode raises here)."""
    long: list[Any] = []
    nonce = os.urandom(8).hex()  # (in every placeholder: no string of the summary can be one)

    def mark(o: Any) -> Any:
        if isinstance(o, dict):
            return {k: mark(v) for k, v in o.items()}
        if isinstance(o, Records):
            if len(o) > LONG_LIST:
                long.append(o)
                return _Long(len(long) - 1, nonce)
            return mark(o.to_list())
        if isinstance(o, (list, tuple)):
            if len(o) > LONG_LIST:
                long.append(o)
                return _Long(len(long) - 1, nonce)
            return [mark(v) for v in o]
        return o

    text = json.dumps(mark(doc), indent=2, default=_Long.encode)
    enc = json.JSONEncoder()
    parts: list[Any] = []  # strings, and (Records, pad) to encode when the parts are written
    at = 0
    for k, items in enumerate(long):
        token = json.dumps(_Long(k, nonce).encode())
        i = text.index(token, at)
        line = text[text.rfind("\n", 0, i) + 1:i]
        pad = " " * (len(line) - len(line.lstrip(" ")))
        parts.append(text[at:i])
        if isinstance(items, Records):
            parts.append((items, pad))
        elif all(isinstance(x, dict) for x in items):
            parts.append("[\n" + ",\n".join(pad + "  " + enc.encode(x) for x in items) + "\n" + pad + "]")
        else:
            parts.append(enc.encode(list(items)))
        at = i + len(token)
    parts.append(text[at:])
    del long, text
    return _give_out(parts)


def _give_out(parts: list[Any]) -> Iterator[str]:
    """The parts of `summary_json_parts` in order, each `Records` encoded a chunk at a time (and let go after)."""
    parts.reverse()
    while parts:
        p = parts.pop()
        if isinstance(p, str):
            yield p
            continue
        items, pad = p
        yield "[\n"
        for j, chunk in enumerate(items.json_lines(pad + "  ")):
            yield ",\n" + chunk if j else chunk
        yield "\n" + pad + "]"
        del p, items


class _Long:
    """A long list's place in `summary_json`'s first pass: the JSON string of a key no summary holds."""

    def __init__(self, k: int, nonce: str):
        self.k, self.nonce = k, nonce

    def encode(self) -> str:
        if not isinstance(self, _Long):  # (json's `default` for anything else: what json.dumps raises)
            raise TypeError(f"Object of type {type(self).__name__} is not JSON serializable")
        return f"\x00summary.json long list {self.k} {self.nonce}\x00"


def write_tables(analysis: Analysis, out: Path, formats: tuple[str, ...] = ("parquet", "csv")) -> list[Path]:
    tables_dir = out / "tables"
    tables_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in table_files(analysis, formats).items():
        p = tables_dir / name
        p.write_bytes(data)
        written.append(p)
    return written


def table_files(analysis: Analysis, formats: tuple[str, ...] = ("parquet", "csv"),
                tables: dict[str, pd.DataFrame] | None = None) -> dict[str, bytes]:
    """Every analysis table (or those of `tables`) as the bytes of its files (NAME.parquet, NAME.csv), in the order
    they are written."""
    files: dict[str, bytes] = {}
    for name, df in (analysis.tables() if tables is None else tables).items():
        df = _plain(df)
        if "parquet" in formats:
            buf = io.BytesIO()
            df.to_parquet(buf, index=False)
            files[f"{name}.parquet"] = buf.getvalue()
        if "csv" in formats:
            files[f"{name}.csv"] = csv_bytes(df)  # df.to_csv(index=False)'s bytes, faster (csv_text.py)
    return files


def _plain(df: pd.DataFrame) -> pd.DataFrame:
    """Categoricals become plain strings so every reader (CSV, Parquet, spreadsheets) sees values. A table without
    one is written as it is (no copy)."""
    cats = [c for c, t in df.dtypes.items() if isinstance(t, pd.CategoricalDtype)]
    if not cats:
        return df
    out = df.copy()
    for c in cats:
        out[c] = out[c].astype(str)
    return out


Job = tuple[str, str]  # ("page", a key of BASE_TABLE_HTML) or ("table", a name of Analysis.base_tables)


def _shared_jobs(analysis: Analysis, report: bool, tables: bool) -> list[Job]:
    """The outputs that read only the base tables: either process of `Analysis.summary_with` may build them, so
    each goes to the one free first (`offload.Shared`): on a trace whose child has more to do than the parent's
    chain (a single-GPU trace) the parent takes them after its chain; where the chain is the longer side, the
    child does."""
    return ([("page", k) for k in BASE_TABLE_HTML] if report else []) + \
        ([("table", name) for name in analysis.base_tables()] if tables else [])


def _job(analysis: Analysis, job: Job, tables_dir: Path | None) -> Any:
    """A page's table (its HTML), or a table's files written into `tables_dir` (their names)."""
    kind, key = job
    if kind == "page":
        return base_table_html(analysis, key)
    return _write_files(table_files(analysis, tables={key: analysis.base_tables()[key]}), tables_dir)


def _write_files(files: dict[str, bytes], tables_dir: Path | None) -> list[str]:
    """`files` written into `tables_dir` (the staging directory's tables/, which either process of the summary's
    fork writes: a child's tables never travel back through the pipe: ~150 MB of bytes pickled, read and held by
    the parent at 2 GB of short steps); their names."""
    for name, data in files.items():
        (tables_dir / name).write_bytes(data)
    return list(files)


def _take_jobs(analysis: Analysis, jobs: list[Job], shared: Shared, tables_dir: Path | None) -> dict[Job, Any]:
    """The jobs this process takes until none is left, with their outputs."""
    done = {}
    while (j := shared.take()) is not None:
        done[jobs[j]] = _job(analysis, jobs[j], tables_dir)
    return done


def _outputs(analysis: Analysis, report: bool, tables: bool, jobs: list[Job], shared: Shared,
             tables_dir: Path | None) -> tuple[dict[str, Any] | None, list[str] | None, dict[Job, Any]]:
    """What `write_all` has built beside the summary (`Analysis.summary_with`): the page's parts that read only
    the base tables and the offloaded entries, and the files of the tables that are no base table (the roofline's,
    the pipeline's); then the shared jobs it takes."""
    base = analysis.base_tables()
    parts = page_parts(analysis, leave_out=BASE_TABLE_HTML) if report else None
    files = _write_files(table_files(analysis, tables={k: v for k, v in analysis.tables().items() if k not in base}),
                         tables_dir) if tables else None
    return parts, files, _take_jobs(analysis, jobs, shared, tables_dir)


def _here(analysis: Analysis, report: bool, jobs: list[Job], shared: Shared,
          tables_dir: Path | None) -> tuple[dict[str, Any] | None, dict[Job, Any]]:
    """What the parent builds after the summary's chain, before it waits for the child: the page's sections of the
    chain's results, then the shared jobs it takes."""
    return (chain_parts(analysis) if report else None), _take_jobs(analysis, jobs, shared, tables_dir)


def _import_for_both(report: bool, tables: bool) -> None:
    """Import what both processes of `Analysis.summary_with` use to build the outputs, before it forks: each side
    importing it on first use imported it twice (the tables' Parquet and CSV writers, the kernel names' demangler
    and the records the HTML tables are formatted from)."""
    if report:
        import pandas.core.methods.to_dict  # noqa: F401 - (DataFrame.to_dict, every HTML table)

        import tracelens.names  # noqa: F401 - (kernel names in the tables and the breakdown figure)
    if tables:
        import pandas.io.formats.csvs  # noqa: F401 - (DataFrame.to_csv)
        import pyarrow.parquet  # noqa: F401 - (DataFrame.to_parquet)

        try:  # (what pandas registers with Arrow on its first conversion of a table to Arrow)
            import pandas.core.arrays.arrow.extension_types  # noqa: F401
        except ImportError:
            pass


def _write_error(out: Path, e: OSError) -> TraceError:
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return TraceError(out, f"cannot write the output: {e.strerror or e}{where}; nothing was written")


def write_all(analysis: Analysis, out: str | os.PathLike, *, report: bool = True, tables: bool = True,
              title: str | None = None) -> dict[str, Path]:
    out = Path(out)
    # everything is written into a staging directory inside `out`, then moved into place (the tables first,
    # summary.json and report.html last): anything that fails (the analysis' own summary, the HTML, a write) leaves
    # `out` as it was. The tables' files and the parts of the page that do not wait for the summary's longest chain
    # (the critical path, the findings, the MoE view) are built beside it, on a second CPU where there is one
    # (tracelens.offload); either process writes the tables' files into the staging directory
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(dir=out, prefix=".tracelens-staging-"))
    except OSError as e:
        raise _write_error(out, e) from None
    tables_dir = stage / "tables" if tables else None
    try:
        if tables_dir is not None:
            tables_dir.mkdir()
        if isinstance(analysis, Analysis):
            # the page's sections of the chain's results are built after the chain, before waiting for the child;
            # the outputs of the base tables alone by whichever side is free first
            _import_for_both(report, tables)
            jobs = _shared_jobs(analysis, report, tables)
            shared = Shared(len(jobs))
            summary, (parts, _, done), (chain, done_here) = analysis.summary_with(
                partial(_outputs, report=report, tables=tables, jobs=jobs, shared=shared, tables_dir=tables_dir),
                partial(_here, report=report, jobs=jobs, shared=shared, tables_dir=tables_dir), columnar=True)
            done.update(done_here)
            for job in jobs:  # taken by a child whose result never came (the parent then built the rest itself)
                if job not in done:
                    done[job] = _job(analysis, job, tables_dir)
            if report:
                parts.update({key: done[("page", key)] for key in BASE_TABLE_HTML})
        else:  # the many-rank path's result (tracelens.scale): its own summary, no report
            summary, parts, chain = analysis.summary(columnar=True), None, None
            if tables_dir is not None:
                _write_files(table_files(analysis), tables_dir)
        summary_text = summary_json_parts(summary)
        del summary
        html = render(analysis, title, parts, chain) if report else None
        with open(stage / "summary.json", "w", encoding="utf-8") as f:
            f.writelines(summary_text)
        if html is not None:
            (stage / "report.html").write_text(html, encoding="utf-8")
        # commit: the tables first, summary.json and report.html last (a reader polling for
        # summary.json finds the tables beside it)
        paths: dict[str, Path] = {}
        if tables:
            (out / "tables").mkdir(exist_ok=True)
            for f in sorted((stage / "tables").iterdir()):
                os.replace(f, out / "tables" / f.name)
            paths["tables"] = out / "tables"
        os.replace(stage / "summary.json", out / "summary.json")
        paths["summary"] = out / "summary.json"
        if html is not None:
            os.replace(stage / "report.html", out / "report.html")
            paths["report"] = out / "report.html"
    except OSError as e:
        raise _write_error(out, e) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if made:  # (made here for outputs that never came: not left behind empty)
            try:
                if not any(out.iterdir()):
                    out.rmdir()
            except OSError:
                pass
    return {k: paths[k] for k in ("summary", "tables", "report") if k in paths}

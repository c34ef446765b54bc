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

import json
import os
import shutil
import tempfile
from pathlib import Path

import pandas as pd

from tracelens.analyzer import Analysis
from tracelens.errors import TraceError

from .html import render


def write_tables(analysis: Analysis, out: Path, formats: tuple[str, ...] = ("parquet", "csv")) -> list[Path]:
    tables_dir = out / "tables"
    tables_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, df in analysis.tables().items():
        df = _plain(df)
        if "parquet" in formats:
            p = tables_dir / f"{name}.parquet"
            df.to_parquet(p, index=False)
            written.append(p)
        if "csv" in formats:
            p = tables_dir / f"{name}.csv"
            df.to_csv(p, index=False)
            written.append(p)
    return written


def _plain(df: pd.DataFrame) -> pd.DataFrame:
    """Categoricals become plain strings so every reader (CSV, Parquet, spreadsheets) sees values."""
    out = df.copy()
    for c in out.columns:
        if isinstance(out[c].dtype, pd.CategoricalDtype):
            out[c] = out[c].astype(str)
    return out


def _write_error(out: Path, e: OSError) -> TraceError:
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return TraceError(out, f"cannot write the output: {e.strerror or e}{where}; nothing was written")


def write_all(analysis: Analysis, out: str | os.PathLike, *, report: bool = True, tables: bool = True,
              title: str | None = None) -> dict[str, Path]:
    out = Path(out)
    # everything that can fail (the analysis' own summary, the HTML, the tables) runs before any write
    summary_text = json.dumps(analysis.summary(), indent=2)
    html = render(analysis, title) if report else None
    try:
        out.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(dir=out, prefix=".tracelens-staging-"))
    except OSError as e:
        raise _write_error(out, e) from None
    try:
        (stage / "summary.json").write_text(summary_text, encoding="utf-8")
        if tables:
            write_tables(analysis, stage)
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
    return {k: paths[k] for k in ("summary", "tables", "report") if k in paths}

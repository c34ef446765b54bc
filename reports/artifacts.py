"""Write everything `tracelens analyze` produces into one output directory.

    OUT/report.html        self-contained HTML report
    OUT/summary.json       the stable machine interface (docs/summary-json.md)
    OUT/tables/NAME.parquet and NAME.csv for every analysis table
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from tracelens.analyzer import Analysis

from .html import write_report, write_text_atomic


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


def write_all(analysis: Analysis, out: str | os.PathLike, *, report: bool = True, tables: bool = True,
              title: str | None = None) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    summary = out / "summary.json"
    write_text_atomic(summary, json.dumps(analysis.summary(), indent=2))
    paths["summary"] = summary
    if tables:
        write_tables(analysis, out)
        paths["tables"] = out / "tables"
    if report:
        paths["report"] = write_report(analysis, out / "report.html", title=title)
    return paths

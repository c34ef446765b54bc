"""Run a golden case, turn what it wrote into golden files, and compare them with the stored ones.

What a case's golden holds (`tests/golden/data/<case id>/`):

* `_cli.txt`: the exit status, stdout and stderr of the invocation (the text users read);
* every file the invocation wrote, under its path relative to the output directory, normalized (below):
  JSON, CSV, Markdown and text as they are; an HTML page with its two large parts split off
  (`NAME.html` keeps the page, `NAME.html.figures.json` the plotly figures' data, pretty-printed);
  a Parquet file as `NAME.parquet.json`, its description: row count, each column's Arrow type and pandas
  dtype, one hash of each column's values and one of each block of rows (the values themselves are in
  the CSV twin that `analyze` writes beside every Parquet table);
* stored gzipped (`NAME.gz`, deterministic: no name or time in the header) when larger than 32 KiB.

Normalization (nothing else is changed; all comparisons are byte for byte after it):

* the checkout's absolute path -> `<REPO>`, the case's output directory -> `<OUT>` (fixture paths are
  given relative to the checkout, so outputs show them as users do);
* tracelens' version -> `<VERSION>` where it is printed as the tool's version (summary.json
  `tool.version`, "tracelens X.Y.Z" in pages);
* `_cli.txt`: the elapsed time `analyze` prints ("in 1.23s") -> "in <T>s";
* HTML: the embedded plotly.js library (plotly's own bytes, or the gzip + base64 text of them that the pages
  embed: its bytes depend on the zlib build) -> `<PLOTLY_JS>`; the figures' JSON payload
  -> its SHA-256 (so its exact bytes, escapes included, are still compared) with the data compared as
  JSON in `NAME.html.figures.json`. Figure div ids are fixed names in tracelens (`plot-timeline`, ...):
  nothing random to mask.

No float is rounded: generating twice (in two processes, with `TRACELENS_OFFLOAD` 0 and 1 and different
hash seeds) gave the same bytes, Parquet files included; `regen.py` checks that again before it writes.
"""

from __future__ import annotations

import csv
import difflib
import functools
import gzip
import hashlib
import io
import json
import math
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
CLI_FILE = "_cli.txt"
GZIP_OVER = 32 * 1024
BLOCK_ROWS = 25  # rows per hashed block of a Parquet column: a difference is located to 25 rows
MAX_SHOWN = 6  # differences listed per file

_PLOTLY_PACKED = re.compile(r'(<script id="plotly-js" [^>]*>)([A-Za-z0-9+/=]*)(</script>)')
_FIGURES = re.compile(r'(<script id="figures" type="application/json">)(.*?)(</script>)', re.DOTALL)
_ELAPSED = re.compile(r"\bin \d+(?:\.\d+)?s\b")


# ---------------------------------------------------------------------------------------------- running


def run_case(case, out: Path) -> dict[str, bytes]:
    """Run `case` (cases.Case) from the checkout's root, writing into the empty directory `out`; return its
    golden files {relative name: normalized bytes}. The caller sets the working directory to REPO."""
    out.mkdir(parents=True, exist_ok=True)
    if case.api is not None:
        case.api(out)
        cli_text = "exit 0\n"
    else:
        cli_text = _invoke([a.replace("{out}", str(out)) for a in case.args])
    files = {CLI_FILE: _norm_text(cli_text, out, cli=True).encode()}
    for p in sorted(out.rglob("*")):
        if p.is_file():
            files.update(golden_files(p.relative_to(out).as_posix(), p, out))
    return files


def _invoke(args: list[str]) -> str:
    """The CLI in this process (click's CliRunner): exit status, stdout, stderr as one text."""
    from click.testing import CliRunner

    from tracelens.cli import main

    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()  # click >= 8.2 keeps stdout and stderr apart
    with warnings.catch_warnings(record=True):  # library warnings are no tracelens output
        res = runner.invoke(main, args, catch_exceptions=True)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise RuntimeError(f"tracelens {' '.join(args)} raised {res.exception!r}") from res.exception
    return f"exit {res.exit_code}\n--- stdout\n{res.stdout}--- stderr\n{res.stderr}"


def golden_files(name: str, path: Path, out: Path) -> dict[str, bytes]:
    """The golden files of one output file."""
    if name.endswith(".parquet"):
        return {name + ".json": _dump(describe_parquet(path))}
    text = _norm_text(path.read_text(encoding="utf-8"), out)
    if name.endswith(".html"):
        page, figures = split_html(text)
        files = {name: page.encode()}
        if figures is not None:
            files[name + ".figures.json"] = _dump(figures)
        return files
    return {name: text.encode()}


def _norm_text(text: str, out: Path, cli: bool = False) -> str:
    from tracelens import __version__

    for p in _spellings(out):
        text = text.replace(p, "<OUT>")
    for p in _spellings(REPO):
        text = text.replace(p, "<REPO>")
    text = re.sub(r'("tool": \{\s*"name": "tracelens",\s*"version": )"' + re.escape(__version__) + '"',
                  r'\1"<VERSION>"', text)
    text = text.replace(f"tracelens {__version__}", "tracelens <VERSION>")
    if cli:
        text = _ELAPSED.sub("in <T>s", text)
    return text


def _spellings(p: Path) -> list[str]:
    return sorted({str(p), str(p.resolve())}, key=len, reverse=True)


@functools.lru_cache(maxsize=1)
def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def split_html(text: str) -> tuple[str, Any]:
    """(the page with plotly.js and the figures' payload replaced, the figures as parsed JSON or None)."""
    text = text.replace(_plotly_js(), "<PLOTLY_JS>")
    text = _PLOTLY_PACKED.sub(lambda m: m.group(1) + "<PLOTLY_JS>" + m.group(3), text)
    m = _FIGURES.search(text)
    if m is None:
        return text, None
    payload = m.group(2)
    digest = hashlib.sha256(payload.encode()).hexdigest()
    page = text[:m.start(2)] + f"<FIGURES sha256={digest}>" + text[m.end(2):]
    return page, json.loads(payload)


def describe_parquet(path: Path) -> dict:
    """A Parquet table's golden: row count, column types, and hashes of its values by column and by block
    of BLOCK_ROWS rows (each value written exactly: floats by repr, NaN and None apart)."""
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    meta = json.loads((t.schema.metadata or {}).get(b"pandas", b"{}"))
    numpy_types = {c.get("name"): c.get("numpy_type") for c in meta.get("columns", [])}
    cols = {name: t.column(name).to_pylist() for name in t.column_names}
    n = t.num_rows
    return {
        "rows": n,
        "block_rows": BLOCK_ROWS,
        "columns": [{"name": name, "arrow_type": str(t.schema.field(name).type), "pandas_dtype": numpy_types.get(name),
                     "hash": _hash(vals)} for name, vals in cols.items()],
        "row_blocks": [_hash([[v[i] for i in range(s, min(s + BLOCK_ROWS, n))] for v in cols.values()])
                       for s in range(0, n, BLOCK_ROWS)],
    }


def _hash(values: Any) -> str:
    text = json.dumps(values, default=lambda o: f"{type(o).__name__}:{o!r}", allow_nan=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _dump(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, ensure_ascii=False, allow_nan=True) + "\n").encode()


# ---------------------------------------------------------------------------------------------- storage


def case_dir(case_id: str, root: Path = DATA) -> Path:
    return root / case_id


def write_golden(case_id: str, files: dict[str, bytes], root: Path = DATA) -> None:
    d = case_dir(case_id, root)
    for name, data in files.items():
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if len(data) > GZIP_OVER:
            p = p.with_name(p.name + ".gz")
            data = gzip.compress(data, compresslevel=9, mtime=0)
        p.write_bytes(data)


def read_golden(case_id: str, root: Path = DATA) -> dict[str, bytes]:
    d = case_dir(case_id, root)
    files = {}
    for p in sorted(d.rglob("*")):
        if not p.is_file():
            continue
        name = p.relative_to(d).as_posix()
        if name.endswith(".gz"):
            files[name[:-3]] = gzip.decompress(p.read_bytes())
        else:
            files[name] = p.read_bytes()
    return files


# ------------------------------------------------------------------------------------------- comparison


def compare(golden: dict[str, bytes], now: dict[str, bytes]) -> list[str]:
    """Every difference between a case's stored golden files and the files it produces now, one message
    per file naming the file and its first differing keys / cells / lines; [] when identical."""
    problems = []
    for name in sorted(golden.keys() - now.keys()):
        problems.append(f"{name}: in the golden, not written now")
    for name in sorted(now.keys() - golden.keys()):
        problems.append(f"{name}: written now, not in the golden")
    for name in sorted(golden.keys() & now.keys()):
        if golden[name] != now[name]:
            problems.append(f"{name}: " + explain(name, golden[name], now[name]))
    return problems


def explain(name: str, old: bytes, new: bytes) -> str:
    """Where two versions of one golden file differ, for people."""
    a, b = old.decode("utf-8", "replace"), new.decode("utf-8", "replace")
    if name.endswith(".parquet.json"):
        return _explain_parquet(json.loads(a), json.loads(b), name)
    if name.endswith(".json"):
        try:
            ja, jb = json.loads(a), json.loads(b)
        except ValueError:
            return _explain_lines(a, b)
        diffs = list(_json_diffs(ja, jb, "$"))
        if not diffs:
            return "same JSON values, different bytes (formatting, key order or escapes): " + _explain_lines(a, b)
        return _listed(diffs)
    if name.endswith(".csv"):
        return _explain_csv(a, b)
    return _explain_lines(a, b)


def _listed(diffs: list[str]) -> str:
    more = f"\n    ... and {len(diffs) - MAX_SHOWN} more" if len(diffs) > MAX_SHOWN else ""
    return f"{len(diffs)} difference(s):\n    " + "\n    ".join(diffs[:MAX_SHOWN]) + more


def _short(v: Any, n: int = 100) -> str:
    s = json.dumps(v, ensure_ascii=False, allow_nan=True) if not isinstance(v, str) or len(v) < 2 * n else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def _json_diffs(a: Any, b: Any, path: str) -> Iterable[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a:
            if k not in b:
                yield f"{path}.{k}: removed (was {_short(a[k])})"
        for k in b:
            if k not in a:
                yield f"{path}.{k}: added ({_short(b[k])})"
        if [k for k in a if k in b] != [k for k in b if k in a]:
            yield f"{path}: key order changed"
        for k in a:
            if k in b:
                yield from _json_diffs(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{path}: length {len(a)} -> {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _json_diffs(x, y, f"{path}[{i}]")
    elif not _same(a, b):
        yield f"{path}: golden {_short(a)}, now {_short(b)}"


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _explain_csv(a: str, b: str) -> str:
    ra, rb = list(csv.reader(io.StringIO(a))), list(csv.reader(io.StringIO(b)))
    if not ra or not rb:
        return _explain_lines(a, b)
    ha, hb = ra[0], rb[0]
    out = []
    if ha != hb:
        gone, new = [c for c in ha if c not in hb], [c for c in hb if c not in ha]
        out.append(f"columns changed: removed {gone}, added {new}" if gone or new else f"column order {ha} -> {hb}")
    if len(ra) != len(rb):
        out.append(f"rows {len(ra) - 1} -> {len(rb) - 1}")
    common = [c for c in ha if c in hb]
    ia, ib = {c: i for i, c in enumerate(ha)}, {c: i for i, c in enumerate(hb)}
    for r, (x, y) in enumerate(zip(ra[1:], rb[1:])):
        for c in common:
            va = x[ia[c]] if ia[c] < len(x) else "<missing>"
            vb = y[ib[c]] if ib[c] < len(y) else "<missing>"
            if va != vb:
                key = ", ".join(f"{k}={_short(x[ia[k]], 40)}" for k in ha[:2] if k != c and ia[k] < len(x))
                out.append(f"row {r} ({key}), column {c!r}: golden {_short(va)}, now {_short(vb)}")
        if len(out) >= MAX_SHOWN + 2:
            break
    if not out:
        return "same cells, different bytes (quoting or line ends): " + _explain_lines(a, b)
    return _listed(out)


def _explain_parquet(a: dict, b: dict, name: str) -> str:
    out = []
    csv_twin = name[: -len(".parquet.json")] + ".csv"
    if a["rows"] != b["rows"]:
        out.append(f"rows {a['rows']} -> {b['rows']}")
    ca, cb = {c["name"]: c for c in a["columns"]}, {c["name"]: c for c in b["columns"]}
    if list(ca) != list(cb):
        out.append(f"columns {list(ca)} -> {list(cb)}")
    for k in ca.keys() & cb.keys():
        for field in ("arrow_type", "pandas_dtype"):
            if ca[k][field] != cb[k][field]:
                out.append(f"column {k!r}: {field} {ca[k][field]} -> {cb[k][field]}")
    changed = [k for k in ca if k in cb and ca[k]["hash"] != cb[k]["hash"]]
    if changed:
        out.append(f"values differ in column(s) {changed}")
    blocks = [i for i, (x, y) in enumerate(zip(a["row_blocks"], b["row_blocks"])) if x != y]
    if blocks:
        n = a["block_rows"]
        spans = ", ".join(f"{i * n}-{i * n + n - 1}" for i in blocks[:MAX_SHOWN])
        out.append(f"in rows {spans}" + (f" and {len(blocks) - MAX_SHOWN} more blocks" if len(blocks) > MAX_SHOWN else "")
                   + f" (the golden values are in {csv_twin})")
    return _listed(out or ["description differs"])


def _explain_lines(a: str, b: str) -> str:
    la, lb = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            col = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            if len(x) > 200 or len(y) > 200:  # a long line (an HTML table): show where it differs
                s = max(0, col - 80)
                return (f"line {i + 1}, column {col + 1}:\n    golden ...{x[s:col + 120]!r}...\n"
                        f"    now    ...{y[s:col + 120]!r}...")
            break
    diff = list(difflib.unified_diff(la, lb, "golden", "now", n=2, lineterm=""))
    if not diff:
        return "same lines, different bytes (line ends or the final newline)"
    shown = [d if len(d) <= 240 else d[:237] + "..." for d in diff[:40]]
    return "\n    " + "\n    ".join(shown) + (f"\n    ... ({len(diff) - 40} more diff lines)" if len(diff) > 40 else "")

"""What every report page shares: the Jinja2 environment of reports/templates, plotly.js to inline, the
escaping of trace-derived text for plotly labels and for JSON inside a <script>, sortable HTML tables,
number formatting, the atomic file write, and the version stamp.

The pages (`reports.html`, `reports.pipeline`, `reports.decomposition`, `reports.diff`, `reports.memory`,
`reports.sweep`, `reports.sweep_model`) import these from here and never from each other's page
modules, except to embed a section (report.html embeds the decomposition and pipeline sections; the
sweep report the sweep-model one). This module imports no other module of `reports`.
"""

from __future__ import annotations

import html
import json
import math
import os
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
from jinja2 import BytecodeCache, Environment, FileSystemLoader, select_autoescape
from jinja2.bccache import Bucket

TEMPLATES = Path(__file__).parent / "templates"
COLORS = {
    "compute": "#3b7dd8", "exposed comm": "#e4572e", "comm wait": "#8e44ad", "pipeline wait": "#6c7a91", "memcpy": "#f3a712", "memset": "#a0a0a0", "idle": "#dfe3ea",
    "GEMM": "#3b7dd8", "grouped GEMM": "#1b4f9c", "attention": "#8e5ad6", "elementwise": "#29a37a",
    "reduction/norm": "#7fb800", "communication": "#e4572e", "memory": "#f3a712", "other": "#9aa6b8",
}
MAX_TABLE_ROWS = 200


PLOTLY_GZIP_LEVEL = 6  # 4.8 MB of plotly.js (7.1) -> 1.47 MB gzip (level 9: 1.47, level 1: 1.71), 0.2 s once


@lru_cache(maxsize=1)
def plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


@lru_cache(maxsize=1)
def plotly_js_bytes() -> bytes:
    """plotly.js's bytes (what `plotly_js` decodes): read from plotly's package data where plotly is installed as
    files, without importing plotly (~30 ms of CPU in a process that draws nothing itself, `tracelens analyze`);
    else through plotly's own loader."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("plotly")  # (finds the package, imports nothing)
        for where in (spec.submodule_search_locations or ()) if spec is not None else ():
            path = Path(where) / "package_data" / "plotly.min.js"
            if path.is_file():
                return path.read_bytes()
    except (ImportError, ValueError, OSError):
        pass
    return plotly_js().encode()


def plotly_js_packed() -> str:
    """plotly.js gzip-compressed and base64-encoded, as every page embeds it (base.html unpacks it in the browser
    with DecompressionStream): ~1.96 MB of page instead of 4.8 MB. Compressing takes ~0.2 s of CPU, so the gzip
    bytes are kept (`_asset_dirs`: beside the install where Python keeps bytecode, else in tracelens's cache
    directory) under a digest of the very plotly.js they compress (another plotly version, or an edited bundle, is
    another file), and a kept file is used only when its gzip trailer's CRC-32 and length are those of that
    plotly.js (`_packs`). Best effort, like the trace cache: no writable place only means compressing every time.
    When `pack_plotly_beside` started packing it in a thread of this process, waits for that thread."""
    packer = _packer
    if packer is not None and packer[1] == os.getpid() and packer[0] is not threading.current_thread():
        packer[0].join()
    return _plotly_js_packed()


_packer: tuple[threading.Thread, int] | None = None  # (the thread packing plotly.js, the process that started it)


def pack_plotly_beside() -> None:
    """Pack plotly.js (`plotly_js_packed`) in a thread while this process analyzes a trace (`tracelens analyze`:
    the analysis runs on one CPU until its summary forks, and a first run compresses plotly.js). zlib releases
    the GIL. The page's parts built in a forked child then leave it out (`packing_beside`), and the page, rendered
    in this process, waits for the thread. Everything the thread runs is imported here first (a fork while a
    thread holds an import lock would leave the child waiting on it)."""
    global _packer
    if _packer is not None or _plotly_js_packed.cache_info().currsize:
        return
    import base64  # noqa: F401 - for the thread (above)
    import gzip  # noqa: F401
    import hashlib  # noqa: F401

    from tracelens.io.cache import cache_dir  # noqa: F401

    plotly_js_bytes()  # read here (it may import plotly's loader)
    thread = threading.Thread(target=_plotly_js_packed, name="tracelens-plotly-pack", daemon=True)
    _packer = (thread, os.getpid())
    thread.start()


def packing_beside() -> bool:
    """Whether `pack_plotly_beside` packs plotly.js in a thread of this process or of the one this process was
    forked from (whose page then embeds it)."""
    return _packer is not None


@lru_cache(maxsize=1)
def _plotly_js_packed() -> str:
    import base64
    import gzip
    import hashlib

    js = plotly_js_bytes()
    name = f"plotly-{hashlib.sha256(js).hexdigest()[:24]}.js.gz"
    places = _asset_dirs("assets")
    for i, (d, _) in enumerate(places):
        try:
            packed = (d / name).read_bytes()
        except OSError:
            continue
        if _packs(packed, js):
            break
    else:
        packed, i = gzip.compress(js, PLOTLY_GZIP_LEVEL, mtime=0), len(places)
    # kept in the first place that takes it (also when found only in a later one: the cache directory of another
    # run, while the install's place is the one every later process looks at first)
    for d, writable in places[:i]:
        if writable and _write_whole(d / name, packed):
            break
    return base64.b64encode(packed).decode("ascii")


def _packs(packed: bytes, js: bytes) -> bool:
    """Whether `packed` is a whole gzip member of `js`: its header, and its trailer's CRC-32 and length of the very
    bytes (a truncated or foreign file is not; checked without decompressing)."""
    import zlib

    return (len(packed) > 18 and packed[:2] == b"\x1f\x8b"
            and int.from_bytes(packed[-8:-4], "little") == zlib.crc32(js)
            and int.from_bytes(packed[-4:], "little") == len(js) & 0xFFFFFFFF)


def _write_whole(path: Path, data: bytes) -> bool:
    """Write `data` at `path` through a temporary name and a rename (never a partial file, also with another process
    writing it); False where the directory cannot be made or written (nothing left behind)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        return False


def _asset_dirs(sub: str) -> list[tuple[Path, bool]]:
    """Where the report's assets derived from installed files (plotly.js packed; the compiled templates,
    `TemplateBytecode`) are kept, as (directory, writable): first where Python keeps the bytecode of a module of
    `reports` (reports/__pycache__, or under sys.pycache_prefix when set), beside the install they derive from,
    written unless sys.dont_write_bytecode (PYTHONDONTWRITEBYTECODE: read only, as Python does with .pyc); then `sub`
    of tracelens's cache directory (`tracelens.io.cache.cache_dir`: $TRACELENS_CACHE_DIR, ...)."""
    import importlib.util
    import sys

    dirs = []
    try:
        dirs.append((Path(importlib.util.cache_from_source(str(Path(__file__).parent / "_.py"))).parent,
                     not sys.dont_write_bytecode))
    except (NotImplementedError, ValueError):  # no cache tag (an implementation without bytecode files)
        pass
    try:
        from tracelens.io.cache import cache_dir

        dirs.append((cache_dir() / sub, True))
    except Exception:  # noqa: BLE001 - no home directory: no second place
        pass
    return dirs


class TemplateBytecode(BytecodeCache):
    """Jinja2's compiled templates kept between processes, as Python keeps a module's .pyc: compiling report.html and
    the templates it includes from source takes ~0.06 s of CPU, in every `tracelens analyze` (a fresh process).

    `dirs`: (directory, writable) pairs, read in order until one holds the template's bytecode; it is written into
    the first writable one that takes it. An entry is used only when it was compiled from the very source read now
    (Jinja2 stores the source's SHA-1 in it and compiles again on a mismatch) by the same Jinja2 release, Python
    version and environment settings (in the file's key, `get_cache_key`), so an edited template or an upgrade is
    never served stale code. Every failure is soft: an unreadable, corrupt or truncated entry is compiled again, a
    directory that cannot be written to is passed over (none: compiled in every process, as without a cache)."""

    def __init__(self, dirs: list[tuple[Path, bool]], settings: str = ""):
        self.dirs = dirs
        self.settings = settings

    def get_cache_key(self, name: str, filename: str | None = None) -> str:
        import hashlib
        import jinja2

        key = f"{name}|{filename}|jinja2 {jinja2.__version__}|{self.settings}"
        return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:40]

    def load_bytecode(self, bucket: Bucket) -> None:
        for i, (d, _) in enumerate(self.dirs):
            try:
                with open(d / f"{bucket.key}.jinja2", "rb") as f:
                    bucket.load_bytecode(f)  # (resets the bucket itself on another magic, checksum or marshal error)
            except Exception:  # noqa: BLE001 - unreadable or corrupt (a pickle error): compiled again
                bucket.reset()
                continue
            if bucket.code is not None:
                self._dump(bucket, self.dirs[:i])  # found in a later place only: kept in the first that takes it
                return

    def dump_bytecode(self, bucket: Bucket) -> None:
        self._dump(bucket, self.dirs)

    def _dump(self, bucket: Bucket, dirs: list[tuple[Path, bool]]) -> None:
        if not any(w for _, w in dirs):
            return
        data = bucket.bytecode_to_string()
        for d, writable in dirs:
            if writable and _write_whole(d / f"{bucket.key}.jinja2", data):
                return


_ENV_SETTINGS = "autoescape=html"  # in TemplateBytecode's keys: another setting compiles another code


@lru_cache(maxsize=1)
def template_env() -> Environment:
    """Jinja2 over reports/templates with autoescaping for .html templates (one per process: its compiled
    templates are kept and shared by every page), their bytecode kept between processes (`TemplateBytecode`)."""
    return Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=select_autoescape(["html"]),
                       bytecode_cache=TemplateBytecode(_asset_dirs("templates"), _ENV_SETTINGS))


def plot_text(s: Any) -> str:
    """A label for plotly: HTML-escaped (plotly renders entities, and would parse tags)."""
    return html.escape(str(s), quote=False)


def safe_json(obj: Any) -> str:
    """JSON safe to embed in a <script> element: no '<', '>' or '&' appear literally."""
    text = json.dumps(obj, separators=(",", ":"), default=_json_default, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def html_table(df: pd.DataFrame, columns: Iterable[tuple[str, str, str]], max_rows: int = MAX_TABLE_ROWS) -> str:
    """A sortable table. columns: (dataframe column, header, kind) with kind 'num', 'pct', 'count' (a count,
    possibly a mean over steps: no decimals when it is whole, "24,576" not "24,576.0"), 'name', 'text',
    or 'kernel' (a kernel name: demangled and shortened for the cell, the full name in its title).
    'name' and 'kernel' cells stay on one line (cut with an ellipsis); hovering shows the whole name."""
    from tracelens.names import display_many

    columns = list(columns)
    head = df.head(max_rows)
    shown = {col: display_many(["" if v is None else str(v) for v in head[col]])
             for col, _, kind in columns if kind == "kernel" and col in head}
    # Python values, as every cell is formatted from: of the shown columns only (a table may have twice as many: the
    # roofline's 32), each column's values the same as in the whole table's records
    shown_cols = [c for c in dict.fromkeys(col for col, _, _ in columns) if c in head]
    recs = head[shown_cols].to_dict("records") if shown_cols else [{} for _ in range(len(head))]
    cells = [_column_cells([rec.get(col) for rec in recs], kind, shown.get(col) if kind == "kernel" else None)
             for col, _, kind in columns]
    out = ['<table class="data"><thead><tr>']
    for _, header, kind in columns:
        out.append(f'<th data-type="{"num" if kind in _NUM_KINDS else "text"}">{_esc(str(header))}</th>')
    out.append("</tr></thead><tbody>")
    rows = zip(*cells) if cells else ([] for _ in recs)  # (no column: an empty row per record)
    out.extend(f"<tr>{''.join(row)}</tr>" for row in rows)
    out.append("</tbody></table>")
    if len(df) > max_rows:
        out.append(f'<p class="note">Showing {min(len(df), max_rows)} of {len(df)} rows; all rows are in the '
                   "CSV/Parquet tables.</p>")
    return "".join(out)


_NUM_KINDS = ("num", "pct", "count")

try:  # markupsafe.escape's own replacement (C where built), without the Markup object per cell it returns
    from markupsafe import _escape_inner as _esc
except ImportError:  # (another markupsafe layout) the same five replacements
    def _esc(s: str) -> str:
        return s.replace("&", "&amp;").replace(">", "&gt;").replace("<", "&lt;").replace("'", "&#39;").replace('"', "&#34;")


def _column_cells(values: list, kind: str, shown: list[tuple[str, str]] | None) -> list[str]:
    """One column's <td> cells, written as Jinja2's autoescaping wrote them from the table's template (the
    template rendered every cell through a generator and a Markup per value, ~3x the time; tests/reports holds the
    template and checks the bytes are the same). A number kind: the value formatted (`_fmt`), the raw value in
    data-v for sorting; a kernel name: shortened, the full name in data-v (when shortened) and the title; else the
    text ('name': also in the title)."""
    out = []
    if kind in _NUM_KINDS:
        for v in values:
            if hasattr(v, "item"):
                v = v.item()
            if kind == "count":
                digits = 0 if not isinstance(v, float) or not math.isfinite(v) or v == int(v) else 1
            else:
                digits = 1 if kind == "pct" else (3 if isinstance(v, float) and abs(v) < 10 else 1)
            c = _clean(v)
            data = "" if v is None else str(c if c is not None else "")
            out.append(f'<td class="num" data-v="{_esc(data)}">{_esc(_fmt(v, digits))}</td>')
        return out
    cls = _esc(str(kind))
    for i, v in enumerate(values):
        if hasattr(v, "item"):
            v = v.item()
        if shown is not None and v is not None:  # a kernel name
            text, full = shown[i]
            out.append('<td class="name"' + (f' data-v="{_esc(full)}"' if text != full else "")
                       + (f' title="{_esc(full)}"' if full else "") + f">{_esc(text)}</td>")
            continue
        # a flag reads as a word ("yes"/"no"), not Python's True/False
        text = ("" if v is None or (isinstance(v, float) and math.isnan(v)) else ("yes" if v else "no")
                if isinstance(v, bool) else str(v))
        out.append(f'<td class="{cls}"' + (f' title="{_esc(text)}"' if kind == "name" and text else "")
                   + f">{_esc(text)}</td>")
    return out


def version() -> str:
    """tracelens's version, stamped on every page."""
    from tracelens import __version__

    return __version__


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` (parents created) through a temporary file and a rename, so a reader
    (a browser, CI picking up an artifact, a resumed sweep) never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path

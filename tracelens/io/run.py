"""`Run`: the run-directory contract, read in this one module.

The trainer writes (docs/architecture.md, "The run directory")::

    RUN/manifest.json             config, environment, metrics, status, pipeline layout
    RUN/traces/rank<N>.json.gz    one Kineto trace per rank
    RUN/pipeline/rank<N>.jsonl    one line per pipeline action (optional; .jsonl.gz for long runs)
    RUN/routing.json              MoE routing counts per layer, rank and expert (optional; `tracelens.io.routing`)

Everything the analyzer learns about a run beyond its traces comes from these files, and this module is
the only one that opens them (a test greps the package for it): analyses and projections receive a `Run`
(the loaded trace carries one, `Trace.run`) and never touch the file system. A `Run` is read once and then
immutable; what could not be read is kept as a one-line problem naming the file, so each consumer decides
whether it is fatal (the what-if model needs the manifest; the timeline does not).

Which files form a run:
- ``root``: RUN, when every trace file sits in ``RUN/traces/`` and ``RUN/manifest.json`` exists (the
  contract). A directory of traces with no manifest, or loose files, has no root: it is still analyzed,
  with whatever its events allow.
- ``pipeline_dir``: ``RUN/pipeline``, else ``pipeline/`` beside loose trace files of one directory.

Standard library only (the pipeline jsonl decoder lives with its reader in `tracelens.analysis.pipeline`
and is given the bytes read here).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..errors import TraceError
from .limits import gunzip_bounded

MANIFEST = "manifest.json"
ROUTING = "routing.json"
INCOMPLETE = ("running", "failed")
_JSONL_NAME = re.compile(r"^rank(\d+)\.jsonl(\.gz)?$")  # gzip for long runs
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is kilobytes; anything this large is not one
# A pipeline jsonl line is ~150 bytes: 2 GiB is ~14 M actions per rank. A .jsonl.gz that expands past it is
# refused (naming the file) before it takes the memory, not after (docs/robustness.md).
MAX_PIPELINE_BYTES = 2 << 30


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


MAX_JSON_DEPTH = 200  # levels of nesting in a run dir's JSON files (manifest.json: 5)


def read_json_value(path: Path) -> tuple[Any, tuple[str, str] | None]:
    """(the JSON document in ``path``, None) or (None, (exception type name or "", the problem)). Never raises.
    Only a regular file of at most MAX_MANIFEST_BYTES is read (a FIFO would block, a device never end), and
    only a document nested at most MAX_JSON_DEPTH levels is returned: the trainer writes 5, and a deeper one
    would reach the recursion limit later, in whatever writes a field of it back out (a verb's JSON)."""
    try:
        if not path.is_file():
            return None, ("", "not a regular file")
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            return None, ("", f"larger than {MAX_MANIFEST_BYTES >> 20} MiB: not a manifest")
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        return None, (type(e).__name__, str(e))
    if json_depth(doc, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        return None, ("RecursionError", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return doc, None


def json_depth(doc: Any, stop: int) -> int:
    """The nesting depth of a decoded JSON value (a scalar: 0), walked without recursion; stops counting once
    past ``stop``."""
    deepest, todo = 0, [(doc, 0)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            d += 1
            if d > deepest:
                deepest = d
                if deepest > stop:
                    return deepest
            todo.extend((x, d) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def read_json_object(path: Path) -> tuple[dict | None, tuple[str, str] | None]:
    """(the JSON object in ``path``, None) or (None, (exception type name or "", the problem)). Never raises."""
    doc, err = read_json_value(path)
    if err is None and not isinstance(doc, dict):
        return None, ("", "not a JSON object")
    return doc, err


def _problem(mf: Path, err: tuple[str, str] | None) -> str | None:
    if err is None:
        return None
    kind, msg = err
    return f"{mf}: {msg}" if not kind else f"{mf}: unreadable ({kind}: {msg})"


def pipeline_files(directory: Path | None) -> list[tuple[int, Path]]:
    """(rank, file) of ``directory/rank<N>.jsonl[.gz]``, sorted by rank; a rank with both keeps the plain
    (live) file. Empty when there is no such directory."""
    if directory is None or not directory.is_dir():
        return []
    out: dict[int, Path] = {}
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return []
    for f in entries:
        m = _JSONL_NAME.match(f.name)
        if m:
            r = int(m.group(1))
            if r not in out or out[r].suffix == ".gz":
                out[r] = f
    return sorted(out.items())


def read_pipeline_bytes(path: Path, limit: int = MAX_PIPELINE_BYTES) -> bytes:
    """The decompressed bytes of one pipeline jsonl file; `TraceError` naming it when they cannot be read,
    when it is not a regular file, or when it holds (or expands to) more than ``limit`` bytes."""
    try:
        if not path.is_file():
            raise TraceError(path, "named like a pipeline file but is not a regular file")
        if path.stat().st_size > limit:
            raise TraceError(path, f"larger than {limit >> 20} MiB: not a pipeline file this reader takes")
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = bytes(gunzip_bounded(path, data, limit, "not a pipeline file this reader takes"))
    except OSError as e:
        raise TraceError(path, f"cannot read: {e.strerror or e}") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise TraceError(path, f"corrupt gzip ({e})") from None
    return data


@dataclass(frozen=True)
class Run:
    """What one run is made of, read once (see the module docstring).

    ``manifest`` is the parsed manifest.json (None when there is none or it is unreadable: then
    ``manifest_problem`` says why in one line naming the file, if the files looked like a run dir).
    """

    trace_files: tuple[str, ...] = ()
    root: Path | None = None  # RUN (see the module docstring), None for traces outside a run dir
    trace_dir: Path | None = None  # the one directory all trace files sit in (None: several)
    manifest_path: Path | None = None
    manifest: dict | None = field(default=None, repr=False)
    manifest_problem: str | None = None
    manifest_error: tuple[str, str] | None = None  # (exception type or "", message) behind manifest_problem
    pipeline_dir: Path | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def of_files(cls, files: Iterable[str | os.PathLike]) -> "Run":
        """The run the given trace files belong to (what `tracelens.load` attaches to a Trace)."""
        files = tuple(str(f) for f in files)
        parents = {Path(f).resolve().parent for f in files}
        if len(parents) != 1:
            return cls(trace_files=files)
        d = parents.pop()
        if d.name != "traces":
            pipe = d / "pipeline"
            return cls(trace_files=files, trace_dir=d, pipeline_dir=pipe if pipeline_files(pipe) else None)
        mf = d.parent / MANIFEST
        if not mf.exists():
            return cls(trace_files=files, trace_dir=d, manifest_problem=f"{mf}: no manifest.json beside traces/")
        doc, err = read_json_object(mf)
        return cls(trace_files=files, root=d.parent, trace_dir=d, manifest_path=mf, manifest=doc,
                   manifest_problem=_problem(mf, err), manifest_error=err, pipeline_dir=d.parent / "pipeline")

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Run":
        """The run at ``path``: a run dir (its manifest, its traces if any, its pipeline files), or its
        ``traces/`` directory. Trace files need not exist (a run dir may hold only a manifest)."""
        p = Path(path)
        if p.name == "traces" and (p.parent / MANIFEST).exists():
            p = p.parent
        if not p.is_dir():
            return cls.of_files([p]) if p.exists() else cls()
        tdir = p / "traces"
        files: tuple[str, ...] = ()
        if tdir.is_dir():
            try:
                files = tuple(str(f) for f in sorted(tdir.iterdir())
                              if f.name.endswith((".json", ".json.gz")) and f.name != MANIFEST)
            except OSError:
                files = ()
        mf = p / MANIFEST
        if mf.exists():
            doc, err = read_json_object(mf)
            return cls(trace_files=files, root=p, trace_dir=tdir if tdir.is_dir() else None, manifest_path=mf,
                       manifest=doc, manifest_problem=_problem(mf, err), manifest_error=err, pipeline_dir=p / "pipeline")
        pipe = p / "pipeline"
        return cls(trace_files=files, trace_dir=tdir if tdir.is_dir() else p,
                   pipeline_dir=pipe if pipeline_files(pipe) else None)

    # ------------------------------------------------------------------ what it holds
    @property
    def is_run_dir(self) -> bool:
        """The files follow the run-dir contract (RUN/traces beside RUN/manifest.json)."""
        return self.root is not None

    @property
    def name(self) -> str:
        """What a user knows the input by: the run dir's name, else the traces' directory, else the file."""
        if self.root is not None:
            return self.root.name
        if self.trace_dir is not None and len(self.trace_files) > 1:
            return self.trace_dir.name
        return Path(self.trace_files[0]).name if self.trace_files else ""

    @property
    def config(self) -> dict | None:
        """The manifest's trainer config (None when there is no manifest or it has no config object)."""
        c = self.manifest.get("config") if self.manifest else None
        return c if isinstance(c, dict) else None

    @property
    def metrics(self) -> dict:
        m = self.manifest.get("metrics") if self.manifest else None
        return m if isinstance(m, dict) else {}

    def require_manifest(self, what: str) -> dict:
        """The manifest, or `TraceError` (one line naming the file) saying that ``what`` needs it."""
        if self.manifest is not None:
            return self.manifest
        if self.manifest_problem:
            raise TraceError(None, f"{self.manifest_problem}; {what} needs the run's manifest")
        where = self.root or self.trace_dir or (Path(self.trace_files[0]) if self.trace_files else Path("."))
        raise TraceError(where, f"not a run dir with a manifest.json ({what} needs the run's manifest)")

    def status(self) -> dict | None:
        """Whether the run finished, from the manifest's ``status``: ``{"run_dir", "manifest", "status",
        "complete", "reason", "warning"}``, None for traces outside a run dir. ``status``: complete | running |
        failed | unreadable | unknown; ``complete`` False for running and failed, None when it cannot be told;
        ``warning`` the line to show, or None. Manifests written before the field existed were written only
        at the end of a run, so no ``status`` means complete."""
        if self.root is None or self.manifest_path is None:
            return None
        run, mf = self.root, self.manifest_path
        out = {"run_dir": str(run), "manifest": str(mf), "status": None, "complete": None, "reason": None,
               "warning": None}
        if self.manifest is None:
            kind, msg = self.manifest_error or ("", "")
            err = " ".join(msg.split())[:200] if kind else msg
            out.update(status="unreadable",
                       warning=f"{mf}: unreadable manifest ({err}); whether the run finished is unknown")
            return out
        status = self.manifest.get("status", "complete")
        reason = self.manifest.get("reason")
        out["reason"] = " ".join(str(reason).split())[:300] if reason is not None else None
        if status == "complete":
            out.update(status="complete", complete=True)
        elif status == "running":
            out.update(status="running", complete=False,
                       warning=f"{run}: incomplete run: manifest.json says status 'running' (the trainer was killed, "
                               "or is still running): traces may end early and the run's metrics are missing")
        elif status == "failed":
            out.update(status="failed", complete=False,
                       warning=f"{run}: incomplete run: the trainer failed ({out['reason'] or 'no reason recorded'}): "
                               "traces may end early and the run's metrics are missing")
        else:
            out.update(status="unknown",
                       warning=f"{mf}: unknown run status {str(status)[:40]!r}; whether the run finished is unknown")
        return out

    def pipeline_files(self) -> list[tuple[int, Path]]:
        """(rank, file) of the run's pipeline jsonl files (empty when it has none)."""
        return pipeline_files(self.pipeline_dir)

    def pipeline_data(self) -> list[tuple[int, Path, bytes]]:
        """(rank, file, decompressed bytes) of each pipeline jsonl file; `TraceError` naming a file that cannot
        be read. Read on each call (the files can be large; callers keep what they decode)."""
        return [(r, p, read_pipeline_bytes(p)) for r, p in self.pipeline_files()]

    @property
    def routing_path(self) -> Path | None:
        """RUN/routing.json when the run dir holds one (None outside a run dir or without the file)."""
        if self.root is None:
            return None
        p = self.root / ROUTING
        return p if (p.exists() or p.is_symlink()) else None

    def routing(self):
        """The run's MoE routing counts (`tracelens.io.routing.RoutingCounts`), None when it has no routing file;
        `TraceError`, one line naming the file, when it cannot be read, is truncated or malformed, or was written
        by another run than the manifest's. Read on each call (the caller keeps what it decodes)."""
        from .routing import RoutingError, check_run, decode, problem_line

        path = self.routing_path
        if path is None:
            return None
        doc, err = read_json_value(path)
        if err is not None:
            raise TraceError(None, problem_line(path, err))
        try:
            counts = decode(doc)
            check_run(counts, self.manifest)
        except RoutingError as e:
            raise TraceError(path, str(e)) from None
        return counts

    def with_manifest(self, manifest: dict | None) -> "Run":
        """This run with another manifest (a user's manifest given beside loose traces)."""
        from dataclasses import replace

        return replace(self, manifest=manifest, manifest_problem=None, manifest_error=None)

    def to_dict(self) -> dict[str, Any]:
        return {"root": str(self.root) if self.root else None, "manifest": str(self.manifest_path)
                if self.manifest_path else None, "manifest_problem": self.manifest_problem,
                "pipeline_dir": str(self.pipeline_dir) if self.pipeline_dir else None,
                "trace_files": list(self.trace_files)}


__all__ = ["Run", "MANIFEST", "ROUTING", "INCOMPLETE", "pipeline_files", "read_json_object", "read_json_value", "read_pipeline_bytes"]

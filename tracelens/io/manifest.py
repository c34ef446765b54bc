"""A run dir's ``manifest.json`` for the verbs that compute with it (``whatif``, ``memory``, ``diff``).

A manifest comes with a run dir, possibly from someone else, so it is data to check, not to trust: the
fields these verbs read must have the JSON types the trainer writes (``null`` counts as absent), and
anything else is a :class:`~tracelens.errors.TraceError` naming the file and the field, shown as one line
with exit status 2. What is checked (``FIELDS``, ``METRICS``):

    the document        an object
    config              an object (required where the verb needs the run's config)
    metrics             an object; its scalar metrics numbers, its per-step / per-rank series lists of
                        numbers (or nulls), ``peak_memory_kind`` a string
    world_size          an integer >= 1
    pipeline, profile, parallel, mesh, device, toggles, kernels   objects

``analyze`` reads the manifest more leniently (`tracelens.io.run.Run`: a manifest it cannot use is named by
the health check and the analysis goes on from the trace alone). The file itself is read by
`tracelens.io.run` (the one module that opens a run dir's files); this module checks what it holds.
Standard library only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import TraceError
from .run import MANIFEST, MAX_MANIFEST_BYTES, read_json_value
_OBJECT_FIELDS = ("config", "metrics", "pipeline", "profile", "parallel", "mesh", "device", "toggles", "kernels")
_NUMBER_METRICS = ("mean_step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "tokens_per_step",
                   "tokens_per_step_per_gpu", "model_flops_per_token", "mfu", "steps")
_SERIES_METRICS = ("step_times_s", "timed_steps", "loss", "aux_loss", "grad_norm", "peak_memory_bytes")


def run_manifest_path(run: str | Path) -> Path | None:
    """``RUN/manifest.json`` when ``run`` is a directory holding one (a FIFO or a dangling link named so
    included: reading it names the problem), else None."""
    p = Path(run)
    m = p / MANIFEST
    return m if p.is_dir() and (m.exists() or m.is_symlink()) else None


def read_manifest(path: str | Path, need_config: bool = False) -> dict[str, Any]:
    """Read (through `tracelens.io.run`, the one reader of run-dir files) and check the manifest at ``path``
    (the file itself): a regular file of at most MAX_MANIFEST_BYTES holding a JSON object whose fields have
    the trainer's types."""
    p = Path(path)
    doc, err = read_json_value(p)
    if err is not None:
        kind, msg = err
        if msg == "not a regular file":  # a FIFO, a device (a link to /dev/zero), a directory, a dangling link
            raise TraceError(p, "manifest is not a regular file")
        if not kind:
            raise TraceError(p, f"manifest is too large (at most {MAX_MANIFEST_BYTES} bytes)")
        if kind == "RecursionError":
            raise TraceError(p, "unreadable manifest (JSON nested too deeply)")
        if kind in ("JSONDecodeError", "ValueError", "UnicodeDecodeError"):
            raise TraceError(p, f"unreadable manifest ({' '.join(msg.split())[:200]})")
        raise TraceError(p, f"cannot read manifest: {msg}")
    return check_manifest(doc, p, need_config)


def check_manifest(doc: Any, path: str | Path, need_config: bool = False) -> dict[str, Any]:
    """``doc`` when it is an object whose fields have the trainer's types, else a TraceError naming
    ``path`` and the first offending field."""
    if not isinstance(doc, dict):
        raise TraceError(path, f"not a trainer manifest: {_kind(doc)}, not a JSON object")
    if need_config and not isinstance(doc.get("config"), dict):
        got = "no 'config'" if doc.get("config") is None else f"'config' is {_kind(doc['config'])}"
        raise TraceError(path, f"not a trainer manifest: {got} (expected an object: the run's trainer config)")
    for key in _OBJECT_FIELDS:
        v = doc.get(key)
        if v is not None and not isinstance(v, dict):
            raise TraceError(path, f"manifest field '{key}' is {_kind(v)} (expected an object)")
    ws = doc.get("world_size")
    if ws is not None and (not _is_int(ws) or ws < 1):
        raise TraceError(path, f"manifest field 'world_size' is {_kind(ws)} (expected an integer >= 1)")
    metrics = doc.get("metrics") or {}
    for key in _NUMBER_METRICS:
        v = metrics.get(key)
        if v is not None and not _is_number(v):
            raise TraceError(path, f"manifest field 'metrics.{key}' is {_kind(v)} (expected a number)")
    for key in _SERIES_METRICS:
        v = metrics.get(key)
        if v is None:
            continue
        if not isinstance(v, list):
            raise TraceError(path, f"manifest field 'metrics.{key}' is {_kind(v)} (expected a list of numbers)")
        bad = next((i for i, x in enumerate(v) if x is not None and not _is_number(x)), None)
        if bad is not None:
            raise TraceError(path, f"manifest field 'metrics.{key}[{bad}]' is {_kind(v[bad])} (expected a number)")
    kind = metrics.get("peak_memory_kind")
    if kind is not None and not isinstance(kind, str):
        raise TraceError(path, f"manifest field 'metrics.peak_memory_kind' is {_kind(kind)} (expected a string)")
    return doc


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({'true' if v else 'false'})"
    if isinstance(v, (int, float)):
        return f"a number ({v!r})"
    if isinstance(v, str):
        return f"a string ({v[:40]!r}{'...' if len(v) > 40 else ''})"
    return {dict: "an object", list: "a list"}.get(type(v), type(v).__name__)

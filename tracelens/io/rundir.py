"""Whether the run dir a trace came from is complete: its ``manifest.json`` ``status``.

The trainer writes ``RUN/manifest.json`` with ``"status": "running"`` before any trace, and replaces it
(atomically) with ``"complete"`` at the end, or ``"failed"`` and a ``reason`` when it fails (a killed
rank, a non-finite loss...). A run dir whose manifest is not ``complete`` is an incomplete run: its traces
may stop mid-window, and its metrics are missing. Manifests written before the field existed were only
written at the end of a run, so no ``status`` means complete. Standard library only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

INCOMPLETE = ("running", "failed")


def run_status(files: Iterable[str]) -> dict | None:
    """For trace files that all sit in one ``RUN/traces/`` beside a ``RUN/manifest.json``: ``{"run_dir",
    "manifest", "status", "complete", "reason", "warning"}``; None for anything else (single files, trace
    directories that are not a run dir's). ``status``: complete | running | failed | unreadable (the
    manifest is not a JSON object) | unknown (a status this reader does not know); ``complete`` is False
    for running and failed, None when it cannot be told; ``warning`` is the line to show, or None."""
    parents = {Path(f).resolve().parent for f in files}
    if len(parents) != 1:
        return None
    d = parents.pop()
    run = d.parent
    mf = run / "manifest.json"
    if d.name != "traces" or not mf.is_file():
        return None
    out = {"run_dir": str(run), "manifest": str(mf), "status": None, "complete": None, "reason": None, "warning": None}
    try:
        doc = json.loads(mf.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        doc, err = None, " ".join(str(e).split())[:200]
    else:
        err = "not a JSON object"
    if not isinstance(doc, dict):
        out.update(status="unreadable", warning=f"{mf}: unreadable manifest ({err}); whether the run finished is unknown")
        return out
    status = doc.get("status", "complete")  # older trainers wrote the manifest only at the end
    reason = doc.get("reason")
    out["reason"] = " ".join(str(reason).split())[:300] if reason is not None else None
    if status == "complete":
        out.update(status="complete", complete=True)
    elif status == "running":
        out.update(status="running", complete=False,
                   warning=f"{run}: incomplete run: manifest.json says status 'running' (the trainer was killed, or "
                           "is still running): traces may end early and the run's metrics are missing")
    elif status == "failed":
        out.update(status="failed", complete=False,
                   warning=f"{run}: incomplete run: the trainer failed ({out['reason'] or 'no reason recorded'}): "
                           "traces may end early and the run's metrics are missing")
    else:
        out.update(status="unknown",
                   warning=f"{mf}: unknown run status {str(status)[:40]!r}; whether the run finished is unknown")
    return out

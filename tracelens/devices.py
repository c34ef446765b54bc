"""Device ceilings for the roofline: the datasheet table (`moespec.devices`) with measured ceilings on top.

The datasheet peaks per GPU live in one table, `moespec.devices.DEVICES` (shared with the trainer's MFU
and the memory projection), looked up by the trace's device name:

    >>> from tracelens import devices
    >>> c = devices.lookup("NVIDIA H200")          # Ceilings or None
    >>> c.peak_tflops("bf16"), c.hbm_tbps
    (989.4, 4.8)
    >>> devices.resolve("NVIDIA H200", measured={"device": "NVIDIA H200", "bf16_tflops": 720, "hbm_tbps": 4.1})

Measured ceilings (e.g. from a calibration run on the GPU) override the datasheet field by field:
`{"device": "NVIDIA H200", "bf16_tflops": 720.0, "hbm_tbps": 4.1}`. Keys are the `Ceilings` field
names; `device` is optional and only checked against the trace's device when given.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields, replace
from typing import Any, Mapping

from moespec.devices import DEVICES, DTYPE_CLASSES, Ceilings, lookup

__all__ = ["DEVICES", "DTYPE_CLASSES", "Ceilings", "load_measured", "lookup", "no_ceilings_message", "resolve"]

_FIELD_NAMES = {f.name for f in fields(Ceilings)} - {"device", "source", "measured"}


def load_measured(src: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """Read a measured-ceilings JSON file (or take a dict). Unknown keys are an error."""
    if isinstance(src, Mapping):
        data = dict(src)
    else:
        with open(src) as f:
            data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError("measured ceilings must be a JSON object")
    bad = set(data) - _FIELD_NAMES - {"device", "source"}
    if bad:
        raise ValueError(f"unknown measured-ceiling keys: {sorted(bad)} (known: {sorted(_FIELD_NAMES)})")
    for k in _FIELD_NAMES & set(data):
        v = data[k]  # (JSON reads 1e999 as inf and NaN as nan: not a ceiling any more than true is)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf):
            raise ValueError(f"measured ceiling {k} must be a positive number, got {data[k]!r}")
    if not isinstance(src, Mapping):
        data.setdefault("source", f"measured: {os.fspath(src)}")
    return data


def resolve(name: str | None, props: Mapping[str, Any] | None = None,
            measured: str | os.PathLike | Mapping[str, Any] | None = None) -> Ceilings | None:
    """Datasheet ceilings for `name`, with measured values (file or dict) taking precedence.

    A measured file for an unknown device still gives ceilings (only the measured fields). A measured
    file naming a different device than the trace's is not applied (returns the datasheet ceilings).
    """
    base = lookup(name, props)
    if measured is None:
        return base
    m = load_measured(measured)
    mdev = m.get("device")
    if mdev and name and mdev != name and lookup(mdev) is not None and base is not None \
            and lookup(mdev).device != base.device:
        return base
    vals = {k: m[k] for k in _FIELD_NAMES & set(m) if m[k] is not None}
    if "sm_count" in vals:
        vals["sm_count"] = int(vals["sm_count"])
    src = m.get("source", "measured")
    if base is None:
        return Ceilings(device=name or mdev or "unknown", source=src, measured=tuple(sorted(vals)), **vals)
    return replace(base, **vals, source=f"{src}; else {base.source}", measured=tuple(sorted(vals)))


def no_ceilings_message(name: str | None) -> str:
    return (f"no ceilings for device {name or '(unknown: trace has no deviceProperties)'}: roofline reports "
            f"achieved TFLOP/s and TB/s without % of peak (pass measured ceilings to get them)")

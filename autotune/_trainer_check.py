"""Ask the trainer's config loader (``moespec.config``, the one the trainer runs on) about a search space,
in a subprocess.

``python -m autotune._trainer_check`` reads one JSON object on stdin::

    {"config": "tiny", "fixed": {...}, "baseline": {...}, "knobs": {"name": [values...]}}

and writes one JSON object on stdout::

    {"base": {resolved trainer config with the fixed overrides}, "keys": [every trainer config key],
     "error": null | "one line", "error_key": the key it names, "bad": [["knob", index, "one line"], ...]}

``base`` is what constraints may refer to (e.g. ``n_layers``); ``bad`` lists each knob value that the
trainer rejects combined with the baseline of the other knobs and with every other combination of
their values too (so a value valid only next to another knob's value, e.g. pipeline_schedule=zbv with
vpp=2, is not bad; at most MAX_COMBOS combinations are tried per value). It needs no torch.
"""

from __future__ import annotations

import itertools
import json
import sys

MAX_COMBOS = 512


def check(req: dict) -> dict:
    from moespec.config import DEFAULTS, ConfigError, load_config

    out: dict = {"base": None, "keys": sorted(DEFAULTS), "error": None, "error_key": None, "bad": []}
    fixed, baseline = req.get("fixed") or {}, req.get("baseline") or {}
    try:
        out["base"] = load_config(req["config"], fixed)
    except ConfigError as e:
        out["error"], out["error_key"] = str(e), e.key
        return out
    knobs = {k: v for k, v in (req.get("knobs") or {}).items() if k in DEFAULTS}  # others: reported by the caller

    def ok(point: dict) -> str | None:
        try:
            load_config(req["config"], {**fixed, **baseline, **point})
        except ConfigError as e:
            return str(e)
        return None

    for name, values in knobs.items():
        others = [k for k in knobs if k != name]
        for i, v in enumerate(values):
            err = ok({name: v})
            if err is None:
                continue
            combos = itertools.islice(itertools.product(*(knobs[k] for k in others)), MAX_COMBOS)
            if not any(ok({**dict(zip(others, c)), name: v}) is None for c in combos):
                out["bad"].append([name, i, err])
    return out


def main() -> int:
    try:
        req = json.loads(sys.stdin.read())
    except ValueError as e:
        print(json.dumps({"error": f"bad request: {e}"}))
        return 1
    print(json.dumps(check(req), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

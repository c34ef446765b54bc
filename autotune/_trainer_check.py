"""Ask the trainer's own config loader about a search space (run as a subprocess).

``python -m autotune._trainer_check`` reads one JSON object on stdin::

    {"config": "tiny", "fixed": {...}, "baseline": {...}, "knobs": {"name": [values...]}}

and writes one JSON object on stdout::

    {"base": {resolved trainer config with the fixed overrides}, "keys": [every trainer config key],
     "error": null | "one line", "error_key": the key it names, "bad": [["knob", index, "one line"], ...]}

``base`` is what constraints may refer to (e.g. ``n_layers``); ``bad`` lists each knob value that the
trainer rejects when it is combined with the baseline of the other knobs. autotune may use the trainer
only as a subprocess (docs/architecture.md), so this runs in its own interpreter; it needs no torch.
"""

from __future__ import annotations

import json
import sys


def check(req: dict) -> dict:
    from trainer.config import DEFAULTS, ConfigError, load_config

    out: dict = {"base": None, "keys": sorted(DEFAULTS), "error": None, "error_key": None, "bad": []}
    fixed, baseline = req.get("fixed") or {}, req.get("baseline") or {}
    try:
        out["base"] = load_config(req["config"], fixed)
    except ConfigError as e:
        out["error"], out["error_key"] = str(e), e.key
        return out
    for name, values in (req.get("knobs") or {}).items():
        if name not in DEFAULTS:
            continue  # reported by the caller, which knows the keys
        for i, v in enumerate(values):
            try:
                load_config(req["config"], {**fixed, **baseline, name: v})
            except ConfigError as e:
                out["bad"].append([name, i, str(e)])
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

"""``python -m trainer --config CFG [--set key=value ...] [--sync-free-level N ...] -o runs/NAME``.

Runs in this process (world size 1) or as one rank under torchrun. A bad config prints one line
(``config error: <key>: ...``) and exits 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from trainer.config import CLI_FLAG_KEYS, ConfigError, load_config, parse_override


def build_parser(prog: str = "python -m trainer") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="DeepSeek-style MoE trainer (writes a tracelens run dir)")
    p.add_argument("--config", required=True, help="YAML file or a name under trainer/configs (e.g. tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key (YAML value syntax); repeatable")
    p.add_argument("-o", "--out", default=None, help="run directory (default runs/<config name>)")
    for key in CLI_FLAG_KEYS:
        p.add_argument("--" + key.replace("_", "-"), dest=f"flag_{key}", default=None, metavar="V",
                       help=f"same as --set {key}=V")
    return p


def config_from_args(args) -> dict:
    overrides: dict = {}
    for item in args.overrides:
        k, v = parse_override(item)
        overrides[k] = v
    for key in CLI_FLAG_KEYS:
        v = getattr(args, f"flag_{key}")
        if v is not None:
            overrides[key] = parse_override(f"{key}={v}")[1]
    return load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        from pathlib import Path

        out = args.out or str(Path("runs") / Path(args.config).stem)
        from trainer.train import shutdown, train

        try:
            train(cfg, out)
        finally:
            shutdown()
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return 2
    return 0

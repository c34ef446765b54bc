"""The gradient clipping's kernels per step (trainer/train.py's clip_grad_norm), from raw trace JSON only.

Kernels whose launch lies between the end of the last ``FSDP::root_post_backward_callback`` and the start of
``Optimizer.step`` on the CPU, by their launching op (the innermost CPU op around the launch on its thread): device
ms and the op's first input's elements (the local gradient); and the optimizer step's and zero_grad's kernels.
Stop 31 (helper/s31shard): 17.1 ms on gpu1_prof (2,255 M elements), 8.7-8.8 on dp2_prof / ep2_cap_prof (1,127 M),
4.5-4.8 on the dp 4 runs (564 M): sharded by dp, like the optimizer (docs/whatif.md).

    .venv/bin/python benchmarks/grad_clip_raw.py tests/fixtures/h100_scaling/gpu1_prof/traces/rank0.json.gz ...
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math


def _numel(dims) -> int:
    if not dims:
        return 0
    if isinstance(dims[0], list):
        return sum(_numel(d) for d in dims)
    return math.prod(dims)


def clip_window(path: str) -> tuple[dict[str, list], dict[str, float]]:
    """({launching op: [kernels, device us, first-input elements]} in the clipping's window,
    {"step": us, "zero_grad": us} of the optimizer's kernels)."""
    with gzip.open(path, "rt") as f:
        ev = json.load(f)["traceEvents"]
    ua = [e for e in ev if e.get("cat") == "user_annotation"]
    callbacks = [e for e in ua if e["name"].startswith("FSDP::root_post_backward_callback")]
    opt = next(e for e in ua if e["name"].startswith("Optimizer.step"))
    zero = next(e for e in ua if e["name"].startswith("Optimizer.zero_grad"))
    t0 = max(e["ts"] + e["dur"] for e in callbacks)  # the last micro-batch's
    t1 = opt["ts"]
    launches = {e["args"]["correlation"]: e for e in ev
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops_by_tid = collections.defaultdict(list)
    for o in ev:
        if o.get("cat") == "cpu_op":
            ops_by_tid[o["tid"]].append(o)

    def owner(launch: dict) -> dict | None:  # the innermost CPU op around the launch
        best = None
        for o in ops_by_tid[launch["tid"]]:
            if o["ts"] <= launch["ts"] <= o["ts"] + o["dur"] and (best is None or o["dur"] < best["dur"]):
                best = o
        return best

    window: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0])
    optimizer: dict[str, float] = collections.defaultdict(float)
    for k in ev:
        if k.get("cat") != "kernel":
            continue
        launch = launches.get(k["args"].get("correlation"))
        if launch is None:
            continue
        if t0 <= launch["ts"] < t1:
            o = owner(launch)
            dims = (o or {}).get("args", {}).get("Input Dims", [[]])
            row = window[o["name"] if o else "?"]
            row[0] += 1
            row[1] += k["dur"]
            row[2] += _numel(dims[0]) if dims else 0
        elif opt["ts"] <= launch["ts"] <= zero["ts"] + zero["dur"]:
            optimizer["step" if launch["ts"] < opt["ts"] + opt["dur"] else "zero_grad"] += k["dur"]
    return window, optimizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="rank trace files (.json.gz) of FSDP runs of the trainer")
    ap.add_argument("--top", type=int, default=8, help="launching ops listed per trace")
    args = ap.parse_args()
    for path in args.traces:
        window, optimizer = clip_window(path)
        total = sum(v[1] for v in window.values())
        print(f"{path}: clip window kernels {total / 1e3:.2f} ms; optimizer {optimizer['step'] / 1e3:.2f} ms, "
              f"zero_grad {optimizer['zero_grad'] / 1e3:.2f}")
        for name, (n, us, numel) in sorted(window.items(), key=lambda x: -x[1][1])[:args.top]:
            print(f"   {name:28s} n={n:4d} {us / 1e3:7.3f} ms  numel {numel / 1e6:8.2f} M")


if __name__ == "__main__":
    main()

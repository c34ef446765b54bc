"""Trainer benchmark: every sync_free_level x grouped_gemm_backend on the single-GPU proxy.

    python benchmarks/bench_trainer.py [--config gpu_proxy] [--steps 12] [--levels 0 1 2 3]
                                       [--backends loop multistream torch triton] [--nproc 1]
                                       [--out runs/bench_trainer] [--set key=value ...]

Each combination is a separate ``python -m trainer.launch`` run (fresh process: clean peak-memory
statistics, no allocator state carried over) writing its own run dir; the table reads their
manifests: tokens/s/GPU, MFU (against the device's bf16 peak, moespec/devices.py), mean step time
and peak memory (max over ranks). A failed combination (e.g. out of memory) shows its exit code.

Needs CUDA; on a machine without it the script says so and exits 1.
Note: ``loop``/``multistream`` at levels 2-3 have only device-side counts and run the masked
per-expert reference (E x the expert FLOPs) -- expect them to be slow; that is the point of the
comparison.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="gpu_proxy")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--backends", nargs="+", default=["loop", "multistream", "torch", "triton"])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--out", default="runs/bench_trainer")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--timeout", type=int, default=900, help="seconds per combination")
    args = p.parse_args()

    try:
        import torch
    except ImportError:
        print("bench_trainer: torch is not installed; this benchmark needs a CUDA GPU.", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("bench_trainer: no CUDA device visible; this benchmark runs the GPU proxy and needs a GPU "
              "(run the CPU tests with `python -m pytest tests/trainer` instead).", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name(0)
    out = Path(args.out)
    rows = []
    for level in args.levels:
        for backend in args.backends:
            run = out / f"L{level}_{backend}"
            cmd = [sys.executable, "-m", "trainer.launch", "--config", args.config, "--nproc", str(args.nproc),
                   "--sync-free-level", str(level), "--grouped-gemm-backend", backend,
                   "--set", f"steps={args.steps}", "-o", str(run)]
            for o in args.overrides:
                cmd += ["--set", o]
            t0 = time.time()
            try:
                r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
                rc, tail = r.returncode, (r.stderr or r.stdout).strip().splitlines()[-1:]
            except subprocess.TimeoutExpired:
                rc, tail = "timeout", []
            row = {"level": level, "backend": backend, "rc": rc, "wall_s": time.time() - t0}
            man = run / "manifest.json"
            if rc == 0 and man.exists():
                m = json.loads(man.read_text())["metrics"]
                row.update(tps=m["tokens_per_s_per_gpu"], mfu=m["mfu"], step_ms=m["mean_step_time_s"] * 1e3,
                           peak_gib=max(m["peak_memory_bytes"]) / 2**30, loss=m["loss"][-1])
            else:
                row["error"] = tail[0] if tail else str(rc)
            rows.append(row)
            print(f"  done L{level} {backend}: rc={rc} ({row['wall_s']:.0f}s)", file=sys.stderr, flush=True)

    print(f"\ntrainer benchmark: config={args.config} device={device} nproc={args.nproc} steps={args.steps}")
    hdr = f"{'level':>5} {'backend':<12} {'tokens/s/GPU':>13} {'MFU':>7} {'step ms':>9} {'peak GiB':>9} {'loss':>7}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "tps" in r:
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
            print(f"{r['level']:>5} {r['backend']:<12} {r['tps']:>13,.0f} {mfu:>7} {r['step_ms']:>9.1f} "
                  f"{r['peak_gib']:>9.2f} {r['loss']:>7.3f}")
        else:
            print(f"{r['level']:>5} {r['backend']:<12} failed (rc={r['rc']}): {r.get('error', '')[:80]}")
    (out / "bench_trainer.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "bench_trainer.json").write_text(json.dumps({"device": device, "config": args.config, "rows": rows},
                                                       indent=1))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

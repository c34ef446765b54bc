"""Fused expert SwiGLU (``expert_swiglu=triton``, kernels/activation.py) vs eager ``silu(g) * u``: kernels and trainer.

    python benchmarks/bench_swiglu.py [--out DIR] [--steps 14] [--mbs 16] [--repeats 1] [--no-trainer]
                                      [--kernels-row] [--set key=value ...] [--cpu]

1. Kernels (run after the trainer runs), at the proxy's expert shape (``h = [R, 2F]`` bf16 with R =
   micro_batch_size x seq_len x top_k rows, F = moe_d_ff: 196,608 x 2 x 1,408 at micro-batch 16): the
   eager activation as the trainer ran it before (``h.chunk(2)``, ``F.silu(g) * u``; backward = two
   ``mul``, ``silu_backward`` and the chunk's ``cat``) against ``kernels.swiglu`` (one kernel each way),
   forward and backward, CUDA-event medians; the bytes each path keeps for the backward (saved-tensor
   hooks); the largest error of each against the fp32 formula.
2. The trainer (``python -m trainer.launch``, one process each), gpu_proxy at sync-free level 3, torch
   grouped GEMM, micro-batch ``--mbs``, unprofiled: ``expert_swiglu=torch`` then ``triton`` (``--repeats``
   N alternates the pair N times): tokens/s/GPU, MFU, mean step time, peak memory, and the largest
   relative per-step loss difference (bf16 tolerance 1e-2). ``--kernels-row`` adds one run with
   ``use_triton_kernels=true`` as well (the Triton router, permutation and fused loss: the trace's largest
   estimated gain, an existing knob; ~45 s more).

About 2 minutes on one H100 (the kernel part ~10 s, each 14-step trainer run ~45 s). Prints a markdown
table; writes ``bench_swiglu.json`` and ``.md`` into ``--out``, else ``$OUT`` when set, else
runs/bench_swiglu. Exit 1 when a run fails, the fused outputs are off, or the losses differ beyond the
tolerance.

``--cpu``: small shapes under Triton's interpreter and the tiny config on the CPU (TRITON_INTERPRET=1 is
set for this process and the trainer runs): a test of this script, not a measurement.

Estimate before building (docs/performance.md, issue 19: from the H100 trace of this baseline at
micro-batch 16): the eager activation costs 4.75 ms forward + 9.04 ms backward per step (3 MoE layers);
at ~2.6 TB/s the fused kernels move the same bytes minus the intermediates in ~1.9 + ~3.2 ms, so about
8.7 ms of a 495 ms step (~1.8 % tokens/s), and 0.55 GB less activation memory per MoE layer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

GPU_BASE = {"config": "gpu_proxy", "set": {"sync_free_level": 3, "grouped_gemm_backend": "torch",
                                           "micro_batch_size": 16, "timing_warmup_steps": 3, "log_every": 7}}
CPU_BASE = {"config": "tiny", "set": {"sync_free_level": 3, "grouped_gemm_backend": "torch", "timing_warmup_steps": 1,
                                      "log_every": 2}}
LOSS_RTOL = 1e-2
KERNELS_VARIANT = "triton+kernels"  # --kernels-row: expert_swiglu=triton and use_triton_kernels=true


def _saved_bytes(fn, h):
    """Bytes of the distinct tensors autograd saves for the backward of ``fn(h)`` (views of one storage
    counted once, as the storage they keep alive)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(h)
    return out, sum(seen.values())


def kernel_bench(R: int, F: int, dtype, device, warmup: int, reps: int) -> dict:
    """Eager vs fused SwiGLU at [R, 2F]: forward / backward medians, saved bytes, errors vs fp32."""
    import torch
    import torch.nn.functional as Fn

    import kernels
    from kernels._runtime import median_ms
    from kernels.activation import swiglu_backward, swiglu_forward

    def eager(h):
        g, u = h.chunk(2, dim=-1)
        return Fn.silu(g) * u

    gen = torch.Generator(device=device).manual_seed(0)  # made on the device: 0.8 G values at mbs 16
    h = (torch.randn(R, 2 * F, generator=gen, device=device) * 2).to(dtype)
    da = torch.randn(R, F, generator=gen, device=device).to(dtype)
    rec: dict = {"rows": R, "F": F, "dtype": str(dtype).replace("torch.", ""), "device": str(device)}
    # correctness on this device: both against the fp32 formula, relative to its largest magnitude
    hf, daf = h.float(), da.float()
    g, u = hf[:, :F], hf[:, F:]
    s = torch.sigmoid(g)
    want_a = g * s * u
    want_dh = torch.cat([daf * u * s * (1 + g * (1 - s)), daf * g * s], dim=1)
    hr = h.clone().requires_grad_()
    a_eager = eager(hr)
    (dh_eager,) = torch.autograd.grad(a_eager, hr, da)
    a_fused, dh_fused = swiglu_forward(h), swiglu_backward(h, da)

    def rel(x, w):
        return float((x.detach().float() - w).abs().max() / w.abs().max().clamp_min(1e-30))

    rec["err"] = {"eager_a": rel(a_eager, want_a), "fused_a": rel(a_fused, want_a),
                  "eager_dh": rel(dh_eager, want_dh), "fused_dh": rel(dh_fused, want_dh)}
    del hf, daf, g, u, s, want_a, want_dh, a_eager, dh_eager, a_fused, dh_fused, hr
    # what each path keeps for its backward
    hs = h.clone().requires_grad_()
    _, rec["saved_bytes_eager"] = _saved_bytes(eager, hs)
    _, rec["saved_bytes_fused"] = _saved_bytes(kernels.swiglu, hs)
    # timings: forward alone (no graph), backward alone (the eager path's autograd nodes, retained)
    with torch.no_grad():
        rec["eager_fwd_ms"] = median_ms(lambda: eager(h), warmup, reps, device)
        rec["fused_fwd_ms"] = median_ms(lambda: swiglu_forward(h), warmup, reps, device)
    a_graph = eager(hs)
    rec["eager_bwd_ms"] = median_ms(lambda: torch.autograd.grad(a_graph, hs, da, retain_graph=True), warmup, reps,
                                    device)
    rec["fused_bwd_ms"] = median_ms(lambda: swiglu_backward(h, da), warmup, reps, device)
    # bytes the fused kernels must move, and the bandwidth they reached
    esz = h.element_size()
    fwd_bytes, bwd_bytes = 3 * R * F * esz, 5 * R * F * esz  # fwd: read g,u write a; bwd: read g,u,da write dg,du
    rec["fused_fwd_tbps"] = fwd_bytes / (rec["fused_fwd_ms"] * 1e-3) / 1e12 if rec["fused_fwd_ms"] > 0 else None
    rec["fused_bwd_tbps"] = bwd_bytes / (rec["fused_bwd_ms"] * 1e-3) / 1e12 if rec["fused_bwd_ms"] > 0 else None
    return rec


def trainer_runs(args, base: dict, out: Path) -> list[dict]:
    import bench_trainer_knobs as K  # the knob benchmark's runner: one trainer process per row

    run_args = argparse.Namespace(overrides=args.overrides, timeout=args.timeout)
    steps = args.steps
    rows = []
    pairs = [("torch", {"expert_swiglu": "torch"}), ("triton", {"expert_swiglu": "triton"})]
    runs = [(f"swiglu_{name}_{rep + 1}", name, over) for rep in range(args.repeats) for name, over in pairs]
    if args.kernels_row:  # plus the Triton router / permutation / loss (the trace's largest estimated item)
        runs.append(("swiglu_triton_kernels_1", KERNELS_VARIANT,
                     {"expert_swiglu": "triton", "use_triton_kernels": True}))
    b = base if args.cpu else {"config": base["config"], "set": {**base["set"], "micro_batch_size": args.mbs}}
    for i, (run_name, variant, over) in enumerate(runs):
        # plain run-dir names (letters, digits, _): what comes back from $OUT on the device machines
        row = K.run_row(i, len(runs), run_name, over, run_args, b, out, steps, profile=False)
        row["expert_swiglu"] = variant
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Per variant: mean tokens/s over its runs, step ms, peak GiB; the gains over ``torch``; the loss checks
    against the first ``torch`` run (``loss_rel_diff``: triton; ``loss_rel_diff_kernels``: the kernels row)."""
    out: dict = {}
    for impl in ("torch", "triton", KERNELS_VARIANT):
        done = [r for r in rows if r["expert_swiglu"] == impl and "loss" in r]
        if not done:
            continue
        tps = [r["tokens_per_s_per_gpu"] for r in done]
        out[impl] = {"runs": len(done), "tokens_per_s_per_gpu": statistics.fmean(tps),
                     "mfu": statistics.fmean(r["mfu"] for r in done if r["mfu"] is not None)
                     if any(r["mfu"] is not None for r in done) else None,
                     "step_ms": statistics.fmean(r["step_ms"] for r in done if r["step_ms"] is not None)
                     if any(r["step_ms"] is not None for r in done) else None,
                     "peak_gib": max(r["peak_gib"] for r in done)}
    if "torch" in out and "triton" in out:
        out["gain"] = out["triton"]["tokens_per_s_per_gpu"] / out["torch"]["tokens_per_s_per_gpu"] - 1
        base = next(r for r in rows if r["expert_swiglu"] == "torch" and "loss" in r)
        diffs = [_loss_diff(base["loss"], r["loss"]) for r in rows if r["expert_swiglu"] == "triton" and "loss" in r]
        out["loss_rel_diff"] = max((d for d in diffs if d is not None), default=None)
    if "torch" in out and KERNELS_VARIANT in out:
        out["gain_kernels"] = out[KERNELS_VARIANT]["tokens_per_s_per_gpu"] / out["torch"]["tokens_per_s_per_gpu"] - 1
        base = next(r for r in rows if r["expert_swiglu"] == "torch" and "loss" in r)
        kr = next(r for r in rows if r["expert_swiglu"] == KERNELS_VARIANT and "loss" in r)
        out["loss_rel_diff_kernels"] = _loss_diff(base["loss"], kr["loss"])
    return out


def _loss_diff(a: list[float], b: list[float]) -> float | None:
    import bench_trainer_knobs as K

    return K.loss_diff(a, b)


def _f(v, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def report(doc: dict) -> str:
    k = doc.get("kernel") or {}
    lines = [f"## Fused expert SwiGLU (expert_swiglu=triton) vs eager, device {doc['device']}", ""]
    if "error" in k:
        lines += [f"Kernel benchmark failed: {k['error']}", ""]
    elif k:
        lines += [f"Kernels at h = [{k['rows']:,}, 2 x {k['F']:,}] {k['dtype']} (one MoE layer):", "",
                  "| pass | eager ms | fused ms | saved | fused TB/s |", "|---|---:|---:|---:|---:|"]
        for p in ("fwd", "bwd"):
            e, f = k[f"eager_{p}_ms"], k[f"fused_{p}_ms"]
            lines.append(f"| {p} | {e:.3f} | {f:.3f} | {e - f:+.3f} ms | {_f(k.get(f'fused_{p}_tbps'), '.2f')} |")
        lines += ["", f"Kept for the backward: eager {k['saved_bytes_eager'] / 2**20:,.1f} MiB, fused "
                      f"{k['saved_bytes_fused'] / 2**20:,.1f} MiB per MoE layer. Largest error vs the fp32 formula "
                      f"(relative to its largest magnitude): forward eager {k['err']['eager_a']:.2e} / fused "
                      f"{k['err']['fused_a']:.2e}, backward eager {k['err']['eager_dh']:.2e} / fused "
                      f"{k['err']['fused_dh']:.2e}.", ""]
        if doc.get("n_moe_layers"):
            per = (k["eager_fwd_ms"] + k["eager_bwd_ms"]) - (k["fused_fwd_ms"] + k["fused_bwd_ms"])
            n = doc["n_moe_layers"]
            lines += [f"Kernel time saved per step ({n} MoE layers): {per * n:.2f} ms.", ""]
    rows = doc.get("trainer_rows") or []
    if rows:
        lines += ["| run | tokens/s/GPU | MFU | step ms | peak GiB | run dir |", "|---|---:|---:|---:|---:|---|"]
        for r in rows:
            if "loss" in r:
                lines.append(f"| {r['name']} | {r['tokens_per_s_per_gpu']:,.0f} | "
                             f"{'n/a' if r['mfu'] is None else format(100 * r['mfu'], '.1f') + ' %'} | "
                             f"{_f(r['step_ms'], '.1f')} | "
                             f"{r['peak_gib']:.2f} | `{r['run_dir']}` |")
            else:
                lines.append(f"| {r['name']} | {'refused' if r.get('rc') == 2 else 'failed'}: "
                             f"{str(r.get('error', '')).replace('|', '/')} | | | | `{r.get('run_dir', '')}` |")
        s = doc.get("summary") or {}
        if "gain" in s:
            lines += ["", f"expert_swiglu=triton vs torch: {100 * s['gain']:+.2f} % tokens/s/GPU "
                          f"({s['torch']['tokens_per_s_per_gpu']:,.0f} -> {s['triton']['tokens_per_s_per_gpu']:,.0f}), "
                          f"step {_f(s['torch']['step_ms'], '.1f')} -> {_f(s['triton']['step_ms'], '.1f')} ms, "
                          f"peak {s['torch']['peak_gib']:.2f} -> {s['triton']['peak_gib']:.2f} GiB; largest relative "
                          f"per-step loss difference {_f(s.get('loss_rel_diff'), '.2e')} (tolerance {LOSS_RTOL:g})."]
        if "gain_kernels" in s:
            k2 = s[KERNELS_VARIANT]
            lines += ["", f"expert_swiglu=triton + use_triton_kernels=true vs torch: {100 * s['gain_kernels']:+.2f} % "
                          f"tokens/s/GPU ({s['torch']['tokens_per_s_per_gpu']:,.0f} -> "
                          f"{k2['tokens_per_s_per_gpu']:,.0f}), step {_f(k2['step_ms'], '.1f')} ms, peak "
                          f"{k2['peak_gib']:.2f} GiB; largest relative per-step loss difference "
                          f"{_f(s.get('loss_rel_diff_kernels'), '.2e')}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output dir (default $OUT, else runs/bench_swiglu[_cpu])")
    p.add_argument("--steps", type=int, default=14, help="trainer steps per run (3 warm-up, untimed)")
    p.add_argument("--mbs", type=int, default=16, help="micro_batch_size of the trainer runs and the kernel shape")
    p.add_argument("--repeats", type=int, default=1, help="torch/triton trainer pairs, alternating")
    p.add_argument("--no-trainer", action="store_true", help="the kernel part only")
    p.add_argument("--kernels-row", action="store_true",
                   help="one more trainer run with use_triton_kernels=true too (Triton router, permutation, loss)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per trainer run")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra trainer overrides for every run")
    p.add_argument("--cpu", action="store_true",
                   help="small shapes, Triton's interpreter, tiny config (tests the script)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.mbs < 1 or args.repeats < 1:
        print("bench_swiglu: --steps, --mbs and --repeats must be >= 1", file=sys.stderr)
        return 2
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels is imported; inherited by the trainer runs
    try:
        import torch
    except ImportError:
        print("bench_swiglu: torch is not installed", file=sys.stderr)
        return 1
    if not args.cpu and not torch.cuda.is_available():
        print("bench_swiglu: no CUDA device visible; run with --cpu to test the script", file=sys.stderr)
        return 1
    from moespec.config import ConfigError, load_config

    base = CPU_BASE if args.cpu else GPU_BASE
    try:
        cfg = load_config(base["config"], {**base["set"], **({} if args.cpu else {"micro_batch_size": args.mbs})})
    except ConfigError as err:
        print(f"bench_swiglu: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or os.environ.get("OUT") or f"runs/bench_swiglu{'_cpu' if args.cpu else ''}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    R = cfg["micro_batch_size"] * cfg["seq_len"] * cfg["top_k"]
    n_moe = cfg["n_layers"] - cfg["first_k_dense"]
    doc: dict = {"config": base["config"], "overrides": {**base["set"], "micro_batch_size": cfg["micro_batch_size"]},
                 "n_moe_layers": n_moe, "steps": args.steps}
    # the trainer runs first, while this process holds no GPU memory (micro-batch 24 runs at the allocator's limit)
    if not args.no_trainer:
        doc["trainer_rows"] = trainer_runs(args, base, out)
        doc["summary"] = summarize(doc["trainer_rows"])
    device = "cpu" if args.cpu else torch.device("cuda", 0)
    doc["device"] = "cpu (Triton interpreter)" if args.cpu else torch.cuda.get_device_name(0)
    print(f"[bench] kernels at h = [{R}, 2 x {cfg['moe_d_ff']}] ...", file=sys.stderr, flush=True)
    try:
        dtype = torch.float32 if args.cpu else torch.bfloat16
        doc["kernel"] = kernel_bench(R, cfg["moe_d_ff"], dtype, device, warmup=1 if args.cpu else 5,
                                     reps=2 if args.cpu else 20)
    except Exception as err:  # reported in the table and the exit status
        doc["kernel"] = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}
    doc["wall_s"] = round(time.time() - t0, 1)
    md = report(doc)
    (out / "bench_swiglu.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "bench_swiglu.md").write_text(md)
    print(md)
    print(f"[bench] wrote {out / 'bench_swiglu.json'} and bench_swiglu.md ({doc['wall_s']:.0f} s)", file=sys.stderr)
    k = doc["kernel"]
    tol = 1e-5 if args.cpu else 2e-2
    ok = "error" not in k and k["err"]["fused_a"] <= tol and k["err"]["fused_dh"] <= tol
    if not args.no_trainer:
        ok = ok and all(r.get("rc") == 0 for r in doc["trainer_rows"])
        lrd = doc["summary"].get("loss_rel_diff")
        ok = ok and lrd is not None and lrd <= LOSS_RTOL
        if args.kernels_row:
            lrk = doc["summary"].get("loss_rel_diff_kernels")
            ok = ok and lrk is not None and lrk <= LOSS_RTOL
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

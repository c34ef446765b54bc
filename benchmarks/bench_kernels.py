#!/usr/bin/env python3
"""Grouped-GEMM backends and fused cross-entropy on a CUDA GPU, in one run.

For each MoE expert shape and tokens-per-step count, builds a realistic routing (random top-k
over E experts, so groups are uneven), then times — CUDA events, warm-up, median of repeats —
every grouped-GEMM backend (Triton with block pointers and with TMA, ``torch._grouped_mm``,
per-expert loop, multi-stream) on the expert up-projection (hidden -> 2*ffn, gate and up fused)
and down-projection (ffn -> hidden), for the forward and both backward products (dX, dW;
"bwd" = dX + dW).  Reports TFLOP/s, % of a
bf16 matmul ceiling measured here with a large ``torch.mm``, and throughput relative to
``torch._grouped_mm``.  Then compares peak memory and time of the fused chunked linear +
cross-entropy against the unfused ``F.cross_entropy(hidden @ W.T)`` at vocab 100K+.

    python benchmarks/bench_kernels.py --out results/           # DeepSeek-V2-Lite + Mixtral-8x7B experts, 4K..64K tokens
    python benchmarks/bench_kernels.py --tokens 4096 16384 --shapes dsv2-lite --json out.json
    python benchmarks/bench_kernels.py --quick                  # fewer tokens and repeats
    python benchmarks/bench_kernels.py --smoke --out /tmp/b     # CPU self-test: tiny shapes, Triton interpreter

``--out DIR`` writes ``bench_kernels.json`` (every row, the environment and the ceiling) and
``bench_kernels.md`` (the same as Markdown tables).  The full run is sized to finish in about 8
minutes on one H100, Triton autotuning included; ``--budget-s`` (default 420) stops starting new
grouped-GEMM cases past that point and lists the ones left out.  Without CUDA (and without
``--smoke``) it prints one line and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# name: (hidden, expert ffn, experts, top-k)
SHAPES = {
    "dsv2-lite": (2048, 1408, 64, 6),  # DeepSeek-V2-Lite routed experts
    "mixtral-8x7b": (4096, 14336, 8, 2),  # few, large experts
}
TOKENS = [4096, 8192, 16384, 32768, 65536]
GRADS = ("fwd", "dx", "dw")


def timer(fn, warmup: int, reps: int, cuda: bool) -> float:
    """Median milliseconds of ``fn()`` (kernels' own timer; imported late: --smoke sets the interpreter first)."""
    from kernels._runtime import median_ms

    return median_ms(fn, warmup, reps, "cuda" if cuda else "cpu")


def matmul_ceiling(dev, n: int, reps: int, dtype=torch.bfloat16) -> float:
    """Measured dense TFLOP/s of an n x n x n torch.mm (bf16 on the GPU)."""
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    ms = timer(lambda: torch.mm(a, b), 5, reps, dev.type == "cuda")
    return 2 * n**3 / (ms * 1e-3) / 1e12


def routed_offs(tokens: int, E: int, k: int, dev) -> torch.Tensor:
    logits = torch.randn(tokens, E, device=dev)
    ids = torch.topk(logits, k, dim=-1).indices
    counts = torch.zeros(E, dtype=torch.int32, device=dev).scatter_add_(
        0, ids.reshape(-1), torch.ones(tokens * k, dtype=torch.int32, device=dev))
    return torch.cumsum(counts, 0, dtype=torch.int32)


def bench_grouped(args, dev, ceiling, dtype, t_start: float, skipped: list[str]) -> list[dict]:
    from kernels import backends as B

    rows = []
    cuda = dev.type == "cuda"
    probe = torch.empty(0, device=dev, dtype=dtype)
    names = [n for n in args.backends if n in B.BACKENDS and B.BACKENDS[n].available(probe)]
    unavailable = [n for n in args.backends if n not in names]
    if unavailable:
        print(f"# not available here, skipped: {', '.join(unavailable)}")
        skipped += [f"backend {n} (not available here)" for n in unavailable]
    for shape in args.shapes:
        hidden, ffn, E, k = SHAPES[shape]
        for tokens in args.tokens:
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append(f"{shape} {tokens} tokens (time budget {args.budget_s:.0f} s)")
                continue
            T = tokens * k
            offs = routed_offs(tokens, E, k, dev)
            for gemm, K, N in (("up", hidden, 2 * ffn), ("down", ffn, hidden)):
                flops = 2.0 * T * K * N
                g = torch.Generator(device=dev).manual_seed(0)
                x = torch.randn(T, K, device=dev, dtype=dtype, generator=g) * 0.1
                if args.w_layout == "linear":  # the trainer's nn.Linear-style [E, N, K] storage, seen as [E, K, N]
                    w = (torch.randn(E, N, K, device=dev, dtype=dtype, generator=g) * 0.02).transpose(1, 2)
                else:
                    w = torch.randn(E, K, N, device=dev, dtype=dtype, generator=g) * 0.02
                dy = torch.randn(T, N, device=dev, dtype=dtype, generator=g) * 0.1
                inputs = {"fwd": (x, w), "dx": (dy, w), "dw": (x, dy)}
                res: dict[tuple[str, str], float | None] = {}
                for name in names:
                    for p in GRADS:
                        a, b = inputs[p]
                        try:
                            res[(name, p)] = timer(lambda: B.run_pass(name, p, a, b, offs), args.warmup, args.reps,
                                                   cuda)
                        except Exception as exc:  # e.g. an alignment a backend does not support
                            print(f"# {shape} {tokens} {gemm} {name} {p}: {type(exc).__name__}: {exc}"[:200])
                            res[(name, p)] = None
                    if res.get((name, "dx")) is not None and res.get((name, "dw")) is not None:
                        res[(name, "bwd")] = res[(name, "dx")] + res[(name, "dw")]
                for name in names:
                    for p in GRADS + ("bwd",):
                        ms = res.get((name, p))
                        if ms is None:
                            continue
                        f = flops * (2 if p == "bwd" else 1)
                        tf = f / (ms * 1e-3) / 1e12
                        ref = res.get(("torch", p))
                        rows.append({
                            "shape": shape, "gemm": gemm, "tokens": tokens, "rows": T, "K": K, "N": N, "E": E,
                            "backend": name, "pass": p, "ms": round(ms, 4), "tflops": round(tf, 1),
                            "pct_ceiling": round(100 * tf / ceiling, 1),
                            "vs_torch": round(ref / ms, 3) if ref else None,
                        })
                del x, w, dy
                if cuda:
                    torch.cuda.empty_cache()
    return rows


def bench_ce(args, dev, dtype) -> list[dict]:
    from kernels import linear_cross_entropy

    cuda = dev.type == "cuda"
    rows = []
    D, V = args.ce_hidden, args.ce_vocab
    for T in args.ce_tokens:
        h = (torch.randn(T, D, device=dev, dtype=dtype) * 0.1).requires_grad_()
        W = (torch.randn(V, D, device=dev, dtype=dtype) * 0.02).requires_grad_()
        t = torch.randint(0, V, (T,), device=dev)

        def unfused():
            loss = F.cross_entropy((h @ W.t()).float(), t)
            loss.backward()

        def fused():
            loss = linear_cross_entropy(h, W, t)
            loss.backward()

        for name, fn in (("unfused", unfused), ("fused", fused)):
            h.grad = W.grad = None
            try:
                fn()  # warm-up (autotune, allocator)
                h.grad = W.grad = None
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                fn()
                peak = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3) if cuda else None
                h.grad = W.grad = None
                ms = timer(lambda: (fn(), setattr(h, "grad", None), setattr(W, "grad", None)), 1, args.reps, cuda)
                rows.append({"tokens": T, "hidden": D, "vocab": V, "impl": name, "peak_extra_gib": peak,
                             "ms_fwd_bwd": round(ms, 3)})
            except torch.OutOfMemoryError:
                rows.append({"tokens": T, "hidden": D, "vocab": V, "impl": name, "peak_extra_gib": "OOM",
                             "ms_fwd_bwd": None})
                torch.cuda.empty_cache()
        del h, W, t
    return rows


def table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    return "\n".join(out)


G_COLS = ["shape", "gemm", "tokens", "rows", "K", "N", "E", "pass", "backend", "ms", "tflops", "pct_ceiling", "vs_torch"]
CE_COLS = ["tokens", "hidden", "vocab", "impl", "peak_extra_gib", "ms_fwd_bwd"]


def markdown(doc: dict) -> str:
    """The whole result as Markdown: environment, ceiling, grouped-GEMM and cross-entropy tables."""
    env = doc["env"]
    lines = [f"# bench_kernels: {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, {env['dtype']}, expert weights {env['w_layout']}; "
             f"{doc['elapsed_s']:.0f} s" + (" (smoke: tiny shapes on the CPU interpreter)" if doc["smoke"] else ""), "",
             f"Measured matmul ceiling ({doc['ceiling_shape']} torch.mm, {env['dtype']}): "
             f"**{doc['ceiling_tflops']:.1f} TFLOP/s**. `pct_ceiling` = TFLOP/s / ceiling; `vs_torch` = "
             "torch._grouped_mm time / this backend's time (> 1: faster); `bwd` = dx + dw.", ""]
    if doc["skipped"]:
        lines += ["Not run (time budget or availability): " + "; ".join(doc["skipped"]), ""]
    lines += ["## Grouped GEMM", "", table(doc["grouped_mm"], G_COLS), ""]
    if doc["cross_entropy"]:
        lines += ["## Linear + cross-entropy (fwd+bwd)", "", "`peak_extra_gib`: peak memory above the inputs.", "",
                  table(doc["cross_entropy"], CE_COLS), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS, help="tokens per step (before top-k)")
    ap.add_argument("--backends", nargs="+", default=["triton", "triton_tma", "torch", "loop", "multistream"])
    ap.add_argument("--w-layout", choices=["linear", "kn"], default="linear",
                    help="expert weights stored [E,N,K] like nn.Linear (the trainer's layout) or [E,K,N]")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ce-tokens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--ce-hidden", type=int, default=2048)
    ap.add_argument("--ce-vocab", type=int, default=102400, help="DeepSeek-V2 vocabulary")
    ap.add_argument("--skip-ce", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tokens 4K and 16K, 3 warm-up, 5 repeats")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="stop starting new grouped-GEMM cases after this many seconds (the rest is listed as not run)")
    ap.add_argument("--out", type=Path, help="write bench_kernels.json and bench_kernels.md into this directory")
    ap.add_argument("--json", type=Path, help="also write all rows here")
    ap.add_argument("--smoke", "--cpu-smoke", dest="smoke", action="store_true",
                    help="tiny shapes on the CPU under Triton's interpreter (a self-test of this script, for CI)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels is imported
        SHAPES["smoke"] = (32, 16, 4, 2)
        args.shapes, args.tokens, args.warmup, args.reps = ["smoke"], [16], 0, 1
        args.ce_tokens, args.ce_hidden, args.ce_vocab = [32], 16, 100
        dev, dtype = torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        print("bench_kernels: CUDA is not available on this machine; run it on an NVIDIA GPU (H100/H200), "
              "or pass --smoke for the CPU self-test.")
        return 1
    else:
        dev, dtype = torch.device("cuda"), torch.bfloat16
    if args.quick:
        args.tokens, args.warmup, args.reps = [t for t in args.tokens if t in (4096, 16384)] or args.tokens, 3, 5

    import kernels

    if args.smoke and not kernels.INTERPRET:
        print("bench_kernels: --smoke needs the Triton interpreter, but kernels was imported without it")
        return 1
    env = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "triton": getattr(sys.modules.get("triton"), "__version__", None), "dtype": str(dtype).replace("torch.", ""),
           "w_layout": args.w_layout}
    print(f"# {env}", flush=True)
    n = 8192 if dev.type == "cuda" else 64
    ceiling = matmul_ceiling(dev, n, args.reps, dtype)
    print(f"# measured matmul ceiling ({n}^3 torch.mm, {env['dtype']}): {ceiling:.1f} TFLOP/s", flush=True)
    skipped: list[str] = []
    g_rows = bench_grouped(args, dev, ceiling, dtype, t_start, skipped)
    print("\n## Grouped GEMM\n")
    print(table(g_rows, G_COLS), flush=True)
    ce_rows = [] if args.skip_ce else bench_ce(args, dev, dtype)
    if ce_rows:
        print("\n## Linear + cross-entropy (fwd+bwd)\n")
        print(table(ce_rows, CE_COLS))
    doc = {"env": env, "smoke": args.smoke, "ceiling_tflops": ceiling, "ceiling_shape": f"{n}^3",
           "grouped_mm": g_rows, "cross_entropy": ce_rows, "skipped": skipped,
           "elapsed_s": time.perf_counter() - t_start}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_kernels.json").write_text(json.dumps(doc, indent=1))
        (args.out / "bench_kernels.md").write_text(markdown(doc))
        print(f"# wrote {args.out}/bench_kernels.json and bench_kernels.md")
    print(f"# done in {doc['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a trainer step's GPU time goes, MoE stage by stage: the numbers behind docs/performance.md (issue 19).

    python benchmarks/moe_breakdown.py RUN [--json FILE]

RUN is a profiled trainer run dir (manifest.json + traces/rank0.json.gz). Prints, for rank 0's profiled
step (the analyzer's steady-state window): the kernel categories (``tracelens analyze``), then every GPU
kernel's MoE stage (``moe/router``, ``moe/permute``, ``moe/experts``, ``moe/unpermute``...) and direction,
from the what-if model's step profile (``tracelens.projection.profile.step_profile``: a backward kernel
takes the stage of the forward op that made its autograd node), summed per stage and direction and per
op, and three subtotals the fusion estimates start from:

- ``swiglu``: the routed experts' activation (``silu``, ``mul``, ``silu_backward``, ``fused swiglu``
  kernels, and the backward ``cat`` of ``h.chunk(2)``) in ``moe/experts``;
- ``permutation``: ``moe/permute`` + ``moe/unpermute``, both directions;
- ``loss``: kernels whose op has the vocabulary size among its input dimensions (LM head and loss).

``--json FILE`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SWIGLU_OPS = ("aten::silu", "aten::mul", "aten::silu_backward")
SWIGLU_KERNELS = ("_swiglu_fwd_kernel", "_swiglu_bwd_kernel")


def breakdown(run: str | Path) -> dict:
    """The figures above for ``run`` (rank 0, the analyzer's steady-state window): ms per step."""
    import tracelens
    from tracelens.analyzer import analyze
    from tracelens.projection.profile import read_manifest, step_profile

    run = Path(run)
    manifest = read_manifest(run)
    if manifest is None or not isinstance(manifest.get("config"), dict):
        raise ValueError(f"{run}: no manifest.json with a config (a trainer run dir is needed)")
    cfg = manifest["config"]
    a = analyze(tracelens.load(str(run)))
    steps = list(a.window.used) if a.window is not None and a.window.used else []
    p = step_profile(a, cfg, 0)
    if p is None:
        raise ValueError(f"{run}: no profiled step on rank 0")
    w = p.work.copy()
    w["ms"] = w["dur"] / 1e6
    w["dir"] = w["backward"].map({True: "bwd", False: "fwd"})
    n_steps = max(len(steps), 1)
    cats = a.categories[a.categories["rank"] == 0]
    out: dict = {
        "run": str(run), "step": p.step, "step_ms": p.step_ns / 1e6,
        "gpu_busy_ms": float(a.timeline.loc[a.timeline["rank"] == 0, "gpu_busy_us"].sum()) / 1e3 / n_steps,
        "kernels": int(len(w)),
        "categories": {str(r.category): round(float(r.total_us) / 1e3 / n_steps, 3) for r in cats.itertuples()},
    }
    moe = w[w["moe_stage"] != ""]
    per_stage = moe.groupby(["moe_stage", "dir"])["ms"].sum()
    out["stages"] = {f"{s} {d}": round(float(v), 3) for (s, d), v in per_stage.items()}
    by_op = moe.groupby(["moe_stage", "dir", "op"])["ms"].agg(["sum", "count"]).sort_values("sum", ascending=False)
    out["stage_ops"] = [{"stage": s, "dir": d, "op": o, "ms": round(float(r["sum"]), 3), "kernels": int(r["count"])}
                        for (s, d, o), r in by_op.iterrows()]
    exp = w[w["moe_stage"] == "moe/experts"]
    names = exp["name"].astype(str)
    is_sw = exp["op"].isin(SWIGLU_OPS) | names.str.contains("|".join(SWIGLU_KERNELS), regex=True)
    # h.chunk(2)'s backward: the cat launched by autograd's SplitBackward0 (the loop backend's per-expert
    # x.split(counts) has SplitWithSizesBackward0); the top op's name is in the analyzer's tables
    chunk_cat = (exp["op"] == "aten::cat") & exp["backward"] & exp["start"].isin(_split_backward_starts(a))
    sw = exp[is_sw | chunk_cat]
    out["swiglu"] = {"fwd": round(float(sw.loc[~sw["backward"], "ms"].sum()), 3),
                     "bwd": round(float(sw.loc[sw["backward"], "ms"].sum()), 3), "kernels": int(len(sw))}
    perm = w[w["moe_stage"].isin(["moe/permute", "moe/unpermute"])]
    out["permutation"] = {"fwd": round(float(perm.loc[~perm["backward"], "ms"].sum()), 3),
                          "bwd": round(float(perm.loc[perm["backward"], "ms"].sum()), 3), "kernels": int(len(perm))}
    vocab = str(cfg.get("vocab_size"))
    loss = w[w["dims"].astype(str).str.contains(rf"\b{vocab}\b", regex=True)] if vocab != "None" else w.iloc[:0]
    out["loss"] = {"ms": round(float(loss["ms"].sum()), 3), "kernels": int(len(loss))}
    return out


def _split_backward_starts(a) -> set:
    """GPU start times (ns) of rank 0's kernels launched under ``autograd::...: SplitBackward0``."""
    import numpy as np
    from tracelens import categories as C

    g = a.gpu[a.gpu["rank"] == 0]
    top = g["top_op_row"].to_numpy()
    ok = top >= 0
    names = np.full(len(g), "", dtype=object)
    names[ok] = C.strings(a.tree["name"].loc[top[ok]])
    hit = np.array([str(n).endswith(": SplitBackward0") for n in names], dtype=bool)
    return set(g["ts"].to_numpy()[hit].tolist())


def render(b: dict) -> str:
    lines = [f"{b['run']}: step {b['step']} {b['step_ms']:.1f} ms, GPU busy {b['gpu_busy_ms']:.1f} ms, "
             f"{b['kernels']} kernels", "", "category             ms"]
    lines += [f"  {k:<18} {v:9.2f}" for k, v in sorted(b["categories"].items(), key=lambda kv: -kv[1])]
    lines += ["", "MoE stage (all layers)   ms"]
    lines += [f"  {k:<22} {v:9.2f}" for k, v in b["stages"].items()]
    lines += ["", "top MoE ops              ms  kernels"]
    lines += [f"  {r['stage']:<14} {r['dir']} {r['op']:<28} {r['ms']:8.2f} {r['kernels']:5d}"
              for r in b["stage_ops"][:25]]
    s, pm, lo = b["swiglu"], b["permutation"], b["loss"]
    lines += ["", f"expert SwiGLU: fwd {s['fwd']:.2f} + bwd {s['bwd']:.2f} = {s['fwd'] + s['bwd']:.2f} ms "
                  f"({s['kernels']} kernels)",
              f"permute + unpermute: fwd {pm['fwd']:.2f} + bwd {pm['bwd']:.2f} = {pm['fwd'] + pm['bwd']:.2f} ms "
              f"({pm['kernels']} kernels)",
              f"LM head + loss (vocabulary-shaped ops): {lo['ms']:.2f} ms ({lo['kernels']} kernels)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="profiled trainer run dir")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    try:
        b = breakdown(args.run)
    except (ValueError, OSError) as err:
        print(f"moe_breakdown: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(render(b), end="")
    if args.json:
        Path(args.json).write_text(json.dumps(b, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``compile: dense`` and ``cuda_graphs: on``: torch.compile of each block's dense parts.

What is compiled, per block (:class:`trainer.model.transformer.Block`):

* a dense layer (``first_k_dense``): the whole block, ``x + attn(attn_norm(x))`` then
  ``x + SwiGLU(ffn_norm(x))`` (attention with its rotary embedding, both norms, the residual adds and
  the MLP in one region: the elementwise work between the GEMMs fuses);
* an MoE layer: the attention half (``x + attn(attn_norm(x))`` and ``ffn_norm(x)``) and the shared
  experts' SwiGLU. The router, permutation, EP dispatch/combine and the routed experts stay eager:
  their shapes depend on the routing below sync-free level 3, and their ``moe/<stage>`` profiler ranges
  (what tracelens reads) would vanish inside a compiled region.

The block's own ``layer/<i>`` range stays eager around all of it. ``cuda_graphs: on`` compiles the same
regions with ``mode="reduce-overhead"`` (inductor's CUDA-graph trees; the loop marks each step's
start with ``torch.compiler.cudagraph_mark_step_begin``). Shapes are static (``dynamic=False``): one
graph per region and shape.

Where compile cannot work (no C++ compiler for inductor's CPU code, no Triton for its GPU code) this
fails before step 0 with one line (a ConfigError on ``compile``).
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

from moespec.config import ConfigError

log = logging.getLogger("trainer")


def compile_problem(device: torch.device) -> str | None:
    """Why inductor cannot compile for ``device`` on this machine, or None."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton  # noqa: PLC0415

        if not has_triton():
            return "needs Triton for inductor's GPU kernels, and it is not importable here (pip install triton)"
        return None
    import torch._inductor.config as ic  # noqa: PLC0415

    cxx = ic.cpp.cxx[-1] if isinstance(ic.cpp.cxx, tuple) else ic.cpp.cxx
    cxx = os.environ.get("CXX") or cxx or "g++"
    if shutil.which(cxx) is None:
        return (f"needs a C++ compiler for inductor's CPU code ({cxx!r}, from $CXX or torch's default), and none "
                "is on PATH (install g++ or set CXX), or use compile=none")
    return None


def compile_dense(model: torch.nn.Module, cfg: dict, device: torch.device) -> list[str]:
    """Compile the dense regions of every Block under ``model`` in place (lazily: the first forward
    compiles). Returns the compiled regions' names. Raises ConfigError when compile cannot work here."""
    from trainer.model.transformer import Block  # noqa: PLC0415

    why = compile_problem(device)
    if why:
        raise ConfigError("compile", f"dense {why}")
    mode = "reduce-overhead" if cfg["cuda_graphs"] == "on" else None
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    # each block's regions are their own graphs (guards on the module): room for all of them, forward and
    # recompiles, beyond dynamo's default of 8 per code object
    limit = 4 * len(blocks) + 8
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name) and getattr(torch._dynamo.config, name) < limit:
            setattr(torch._dynamo.config, name, limit)
    names = []
    for b in blocks:
        i = b.layer_id
        if b.is_moe:
            b.compiled_attn = torch.compile(b.attn_half, mode=mode, dynamic=False)
            names.append(f"layer/{i}.attn_half")
            if b.ffn.shared is not None:
                b.ffn.shared.compile(mode=mode, dynamic=False)
                names.append(f"layer/{i}.ffn.shared")
        else:
            b.compiled_dense = torch.compile(b.dense_block, mode=mode, dynamic=False)
            names.append(f"layer/{i}.dense_block")
    log.warning("compile=dense%s: torch.compile of %d regions (%s); MoE routing/dispatch/experts eager",
             " (cuda_graphs=on: mode=reduce-overhead)" if mode else "", len(names),
             ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""))
    return names


def compile_stats(cfg: dict) -> dict | None:
    """What torch.compile did in this process (the manifest's ``compile``; None with compile=none): dynamo's
    unique graphs and graph breaks (with their most frequent reasons), and with cuda_graphs=on how many
    compiled graphs inductor ran without CUDA graphs (``cudagraph_skips``: TORCH_LOGS=cudagraphs says why;
    a note says so when it is not 0)."""
    if cfg["compile"] != "dense":
        return None
    from torch._dynamo.utils import counters  # noqa: PLC0415

    breaks = counters.get("graph_break", {})
    out = {"mode": "reduce-overhead" if cfg["cuda_graphs"] == "on" else "default",
           "unique_graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
           "graph_breaks": int(sum(breaks.values())),
           "graph_break_reasons": [f"{n}x {' '.join(str(r).split())[:200]}"
                                   for r, n in sorted(breaks.items(), key=lambda kv: -kv[1])[:5]],
           "cudagraph_skips": int(counters.get("inductor", {}).get("cudagraph_skips", 0))}
    if cfg["cuda_graphs"] == "on" and out["cudagraph_skips"]:
        log.warning("cuda_graphs=on: inductor ran %d compiled graph(s) without CUDA graphs (rerun with "
                    "TORCH_LOGS=cudagraphs to see why)", out["cudagraph_skips"])
    return out

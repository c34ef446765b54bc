"""Memory projection: bytes per GPU by component for a trainer config and a parallel layout.

    >>> from tracelens.analysis import memory as M
    >>> cfg = M.load_model_config("gpu_proxy")            # trainer YAML, config name, manifest.json or run dir
    >>> lay = M.resolve_layout(cfg.config, world=1)         # the trainer's own layout: dp*ep = world
    >>> p = M.project(cfg.config, lay)
    >>> p.table                                           # one row per component, bytes per GPU
    >>> p.peak_bytes, p.stage, p.phase                    # projected peak, on which stage, in which phase
    >>> M.sweep(cfg.config, world=768, device_bytes=80 * 2**30, global_batch=...)   # layouts that fit

Everything here is arithmetic on the trainer's flat config keys (``trainer/config.py``); nothing imports
torch. Every formula, with its assumptions, is in docs/memory.md; the short version:

* **Model state** follows what the trainer allocates. FSDP2 (``dp_mode=fsdp``, ZeRO-3): sharded fp32
  parameters (the fp32 master weights under bf16 mixed precision), fp32 gradients, AdamW ``exp_avg`` and
  ``exp_avg_sq`` (fp32), dense parameters sharded over their data-parallel group (the trainer's world mesh),
  routed experts over the expert-data-parallel group (the trainer's ``dp`` sub-mesh); plus the unsharded
  bf16 working copies that FSDP2 all-gathers (the root's embedding/head for the whole step, two layers at a
  time) and, in backward, one unit's unsharded bf16 gradient and its fp32 reduce-scatter input.
  DDP (ZeRO-0): everything replicated, plus DDP's gradient buckets and autocast's bf16 weight copies.
  ZeRO-1/2 (not in the trainer; Megatron's distributed optimizer): bf16 parameters, fp32 main parameters
  and Adam states sharded, gradients sharded from level 2.
* **Activations** are the tensors autograd saves in the trainer's modules (layers.py, moe.py), per layer
  and microbatch, times the microbatches in flight on the stage (1F1B: ``p - s`` on stage ``s``;
  interleaved: ``2(p-s-1) + (v-1)p + 1`` chunks; GPipe: all ``m``). Tensor/sequence parallelism (with
  sequence parallelism) and context parallelism divide every per-token activation by ``tp*cp``.
* **Transients** are short-lived: the loss (fp32 logits, their log-softmax and gradient), one layer's
  backward working set (plus its recomputation when checkpointed), the MoE dispatch/combine buffers, and
  the optimizer step's ``foreach`` temporary (``sqrt(exp_avg_sq)``, one fp32 copy of the shard).

The peak is the largest of four moments of a step (each component says at which it is alive):
**forward end** (state + activations + the loss transient), **backward** of the largest layer (state +
activations + two all-gathered layers + its gradient reduce buffers + its backward workspace),
**backward end** (state + all gradients + the root's reduce buffers) and **optimizer step** (state +
gradients + the foreach temporary). Gradients count everywhere when they persist across microbatches.
Measured on an H100 (gpu_proxy, FSDP2 bf16): projected peak / torch.cuda.max_memory_allocated = 0.998.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from ..errors import TraceError
from . import bubble as _bubble

GIB = 1 << 30
SCHEMA_VERSION = 1

# Memory capacity per device (bytes): the datasheet's HBM size. torch reports a little less (ECC, the CUDA
# context); `headroom` in `fits` covers that and the allocator's fragmentation.
DEVICE_MEMORY: dict[str, int] = {
    "H100": 80 * 10**9, "H100 SXM": 80 * 10**9, "H100 PCIe": 80 * 10**9, "H100 NVL": 94 * 10**9,
    "H200": 141 * 10**9, "H200 SXM": 141 * 10**9, "H200 NVL": 141 * 10**9,
    "B200": 180 * 10**9, "A100": 80 * 10**9, "A100 80GB": 80 * 10**9, "A100 40GB": 40 * 10**9,
    "MI250X": 64 * 10**9, "MI300X": 192 * 10**9, "MI325X": 256 * 10**9, "MI355X": 288 * 10**9,
}

SCHEDULES = ("1f1b", "gpipe", "vpp", "zb1p", "zbv")
COMPONENT_GROUPS = ("parameters", "gradients", "optimizer", "activations", "working", "transient")


# ------------------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class ModelConfig:
    """A trainer config (flat keys, validated by ``trainer.config``) and where it came from."""

    config: dict
    source: str
    world: int | None = None            # from a manifest: the run's world size
    measured_peak_bytes: int | None = None  # from a manifest: max over ranks of torch.cuda.max_memory_allocated
    measured_kind: str | None = None


def load_model_config(src: str | os.PathLike, overrides: Iterable[str] = ()) -> ModelConfig:
    """Read a trainer config: a YAML file, a config name under trainer/configs, a run's manifest.json or a
    run dir. ``overrides`` are ``key=value`` strings. Bad input raises a one-line `TraceError`."""
    from trainer.config import ConfigError, load_config, parse_override  # noqa: PLC0415 (PyYAML only)

    p = Path(src)
    if p.is_dir():
        if not (p / "manifest.json").exists():
            raise TraceError(p, "directory has no manifest.json (expected a run dir)")
        p = p / "manifest.json"
    try:
        if p.suffix == ".json":
            try:
                man = json.loads(p.read_text())
            except (OSError, ValueError) as e:
                raise TraceError(p, f"cannot read manifest: {e}") from None
            if not isinstance(man, dict) or not isinstance(man.get("config"), dict):
                raise TraceError(p, "not a trainer manifest (no 'config' mapping)")
            ovr = dict(man["config"])
            for o in overrides:
                k, v = parse_override(o)
                ovr[k] = v
            cfg = load_config(None, ovr)
            metrics = man.get("metrics") or {}
            peaks = [int(x) for x in metrics.get("peak_memory_bytes") or [] if isinstance(x, (int, float))]
            return ModelConfig(cfg, str(p), world=man.get("world_size"),
                               measured_peak_bytes=max(peaks) if peaks else None,
                               measured_kind=metrics.get("peak_memory_kind"))
        cfg = load_config(src, list(overrides))
    except ConfigError as e:
        raise TraceError(src, str(e)) from None
    except OSError as e:
        raise TraceError(src, f"cannot read: {e.strerror or e}") from None
    except Exception as e:  # YAML syntax errors and the like: one line
        if type(e).__module__.startswith("yaml"):
            raise TraceError(src, f"invalid YAML: {' '.join(str(e).split())}") from None
        raise
    return ModelConfig(cfg, str(src))


@dataclass(frozen=True)
class Layout:
    """A parallel layout and the training knobs that change memory.

    world = pp * tp * cp * dp; experts are split over ``ep`` ranks inside the ``world / pp`` ranks of a
    stage (expert-data-parallel size ``edp = world / (pp * ep)``). ``microbatches`` is the number of
    microbatches per optimizer step (gradient accumulation, the pipeline's m). ``recompute`` is "none",
    "full" or a tuple of layer indices (the trainer's ``recompute_layer_ids``). ``zero``: 3 = FSDP2
    (the trainer's ``dp_mode=fsdp``), 0 = DDP, 1/2 = distributed optimizer.
    """

    world: int
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    tp: int = 1
    cp: int = 1
    mbs: int = 1
    seq: int = 4096
    microbatches: int = 1
    schedule: str = "1f1b"
    recompute: Any = "none"
    sync_free_level: int = 0
    loss_fusion: bool = False
    loss_chunk: int = 1024
    dtype: str = "bf16"
    zero: int = 3
    moe_imbalance: float = 1.0   # received rows / balanced rows at levels 0-2 (1.0 = perfectly balanced)

    @property
    def dp(self) -> int:
        return self.world // (self.pp * self.tp * self.cp)

    @property
    def edp(self) -> int:
        return self.world // (self.pp * self.ep)

    @property
    def dp_mode(self) -> str:
        return {3: "fsdp", 0: "ddp"}.get(self.zero, f"zero{self.zero}")

    def label(self) -> str:
        rc = self.recompute if isinstance(self.recompute, str) else "ids" + ",".join(map(str, self.recompute))
        v = f" vpp{self.vpp}" if self.vpp > 1 else ""
        return (f"pp{self.pp}{v} tp{self.tp} cp{self.cp} ep{self.ep} dp{self.dp} mbs{self.mbs} "
                f"rc={rc} {self.schedule} L{self.sync_free_level}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["recompute"] = self.recompute if isinstance(self.recompute, str) else list(self.recompute)
        d.update(dp=self.dp, edp=self.edp, dp_mode=self.dp_mode)
        return d


def _bad(key: str, problem: str, source: str | None = None) -> TraceError:
    return TraceError(source, f"memory: {key}: {problem}")


def parse_recompute(value: Any, n_layers: int, source: str | None = None) -> Any:
    """"none" / "full" / "selective"-free; a list or comma string of layer indices -> tuple."""
    if value is None or value == [] or value == ():
        return "none"
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("none", "full"):
            return v
        try:
            value = [int(x) for x in v.split(",") if x.strip()]
        except ValueError:
            raise _bad("recompute", f"expected none, full or comma-separated layer ids, got {value!r}", source) from None
    ids = tuple(sorted(set(int(i) for i in value)))
    if any(not 0 <= i < n_layers for i in ids):
        raise _bad("recompute", f"layer ids must lie in [0, {n_layers}), got {list(ids)}", source)
    if len(ids) == n_layers:
        return "full"
    return ids or "none"


def resolve_layout(cfg: dict, world: int | None = None, source: str | None = None, **kw: Any) -> Layout:
    """A `Layout` from the config's own knobs overridden by ``kw`` (None values are ignored), checked.

    Defaults come from the config: ``ep``, ``micro_batch_size``, ``seq_len``, ``sync_free_level``,
    ``loss_fusion``, ``loss_chunk_size``, ``dtype``, ``dp_mode`` (fsdp -> zero 3, ddp -> zero 0) and
    ``recompute_layer_ids``. ``world`` defaults to ``pp*tp*cp*dp`` when ``dp`` is given, else the
    trainer's ``dp*ep`` (``dp`` unset: 1). A layout that does not divide raises a one-line `TraceError`.
    """
    kw = {k: v for k, v in kw.items() if v is not None}
    unknown = set(kw) - {f for f in Layout.__dataclass_fields__} - {"dp"}
    if unknown:
        raise _bad(sorted(unknown)[0], "unknown layout key", source)
    dp = kw.pop("dp", None)
    pp, tp, cp = kw.get("pp", 1), kw.get("tp", 1), kw.get("cp", 1)
    ep = kw.get("ep", cfg["ep"])
    for k, v in (("pp", pp), ("tp", tp), ("cp", cp), ("ep", ep), ("dp", dp), ("world", world)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise _bad(k, f"must be a positive integer, got {v!r}", source)
    if world is None:
        world = pp * tp * cp * (dp if dp is not None else (cfg["dp"] or 1) * ep)
    elif dp is not None and pp * tp * cp * dp != world:
        raise _bad("dp", f"world {world} != pp*tp*cp*dp = {pp}*{tp}*{cp}*{dp}", source)
    zero = kw.get("zero", 3 if cfg["dp_mode"] == "fsdp" else 0)
    lay = Layout(
        world=world, pp=pp, vpp=kw.get("vpp", 1), ep=ep, tp=tp, cp=cp,
        mbs=kw.get("mbs", cfg["micro_batch_size"]), seq=kw.get("seq", cfg["seq_len"]),
        microbatches=kw.get("microbatches", 1 if pp == 1 else 4 * pp),
        schedule=kw.get("schedule", "vpp" if kw.get("vpp", 1) > 1 else "1f1b"),
        recompute=parse_recompute(kw.get("recompute", cfg["recompute_layer_ids"]), cfg["n_layers"], source),
        sync_free_level=kw.get("sync_free_level", cfg["sync_free_level"]),
        loss_fusion=kw.get("loss_fusion", cfg["loss_fusion"]), loss_chunk=kw.get("loss_chunk", cfg["loss_chunk_size"]),
        dtype=kw.get("dtype", cfg["dtype"]), zero=zero, moe_imbalance=float(kw.get("moe_imbalance", 1.0)),
    )
    check_layout(cfg, lay, source)
    return lay


def check_layout(cfg: dict, lay: Layout, source: str | None = None) -> None:
    """Divisibility and range checks; the first problem raises a one-line `TraceError`."""
    for k in ("pp", "vpp", "ep", "tp", "cp", "mbs", "seq", "microbatches", "world", "loss_chunk"):
        v = getattr(lay, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _bad(k, f"must be a positive integer, got {v!r}", source)
    mp = lay.pp * lay.tp * lay.cp
    if lay.world % mp:
        raise _bad("world", f"world size {lay.world} is not divisible by pp*tp*cp = {mp}", source)
    if (lay.world // lay.pp) % lay.ep:
        raise _bad("ep", f"ep={lay.ep} does not divide the {lay.world // lay.pp} ranks of a pipeline stage", source)
    if cfg["n_routed_experts"] % lay.ep:
        raise _bad("ep", f"n_routed_experts={cfg['n_routed_experts']} is not divisible by ep={lay.ep}", source)
    if cfg["n_heads"] % lay.tp:
        raise _bad("tp", f"n_heads={cfg['n_heads']} is not divisible by tp={lay.tp}", source)
    if lay.tp > 1 and cfg["attn_type"] == "gqa" and (cfg["n_kv_heads"] or cfg["n_heads"]) % lay.tp:
        raise _bad("tp", f"n_kv_heads={cfg['n_kv_heads']} is not divisible by tp={lay.tp}", source)
    if (lay.seq * lay.mbs) % (lay.tp * lay.cp) or (lay.cp > 1 and lay.seq % (2 * lay.cp)):
        raise _bad("cp", f"seq {lay.seq} x mbs {lay.mbs} does not split over tp*cp = {lay.tp}*{lay.cp} "
                   "(context parallelism needs seq divisible by 2*cp)", source)
    if lay.pp * lay.vpp > cfg["n_layers"]:
        raise _bad("pp", f"pp*vpp = {lay.pp * lay.vpp} exceeds n_layers={cfg['n_layers']}", source)
    if lay.vpp > 1 and lay.schedule not in ("vpp",):
        raise _bad("vpp", f"vpp={lay.vpp} needs schedule vpp (interleaved 1F1B), got {lay.schedule}", source)
    if lay.schedule not in SCHEDULES:
        raise _bad("schedule", f"unknown schedule {lay.schedule!r} (one of {', '.join(SCHEDULES)})", source)
    if not 0 <= lay.sync_free_level <= 3:
        raise _bad("sync_free_level", f"must be 0..3, got {lay.sync_free_level}", source)
    if lay.zero not in (0, 1, 2, 3):
        raise _bad("zero", f"must be 0, 1, 2 or 3, got {lay.zero}", source)
    if lay.dtype not in ("bf16", "fp32"):
        raise _bad("dtype", f"must be bf16 or fp32, got {lay.dtype!r}", source)
    if lay.pp > 1 and lay.microbatches < 1:
        raise _bad("microbatches", "must be >= 1", source)
    if not lay.moe_imbalance >= 1.0:
        raise _bad("moe_imbalance", f"must be >= 1.0, got {lay.moe_imbalance}", source)


# ------------------------------------------------------------------------------ parameter counts


def attention_params(c: dict) -> int:
    """Matmul weights of one attention block (as trainer/model/layers.py builds it)."""
    d, H = c["d_model"], c["n_heads"]
    if c["attn_type"] == "mla":
        qd = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        qr = c["q_lora_rank"]
        q = d * qr + qr * H * qd if qr else d * H * qd
        kv_a = d * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
        kv_b = c["kv_lora_rank"] * H * (c["qk_nope_head_dim"] + c["v_head_dim"])
        return q + kv_a + kv_b + H * c["v_head_dim"] * d
    hd = c["head_dim"] or d // H
    kv = c["n_kv_heads"] or H
    return d * H * hd + 2 * d * kv * hd + H * hd * d  # wq, wk, wv, wo


def layer_params(c: dict, layer: int) -> dict[str, int]:
    """Parameters of one decoder layer by part: attention (+ its norms), dense FFN or MoE parts."""
    d = c["d_model"]
    norms = 2 * d + (c["kv_lora_rank"] + (c["q_lora_rank"] or 0) if c["attn_type"] == "mla" else 0)
    out = {"attention": attention_params(c), "norms": norms, "dense_ffn": 0, "router": 0, "shared": 0, "experts": 0}
    if layer < c["first_k_dense"]:
        out["dense_ffn"] = 3 * d * c["d_ff"]
    else:
        out["router"] = d * c["n_routed_experts"]
        out["shared"] = 3 * d * c["moe_d_ff"] * c["n_shared_experts"]
        out["experts"] = c["n_routed_experts"] * 3 * d * c["moe_d_ff"]
    return out


def stage_layers(n_layers: int, pp: int, vpp: int = 1) -> list[list[int]]:
    """Layer indices per pipeline stage: ``pp*vpp`` contiguous chunks, sizes differing by at most one
    (the first chunks take the remainder); stage ``s`` holds chunks ``s, s+pp, s+2pp, ...``."""
    n_chunks = pp * vpp
    base, extra = divmod(n_layers, n_chunks)
    chunks, start = [], 0
    for i in range(n_chunks):
        size = base + (1 if i < extra else 0)
        chunks.append(list(range(start, start + size)))
        start += size
    return [[li for v in range(vpp) for li in chunks[s + v * pp]] for s in range(pp)]


def stage_params(c: dict, lay: Layout, stage: int) -> dict[str, int]:
    """Unsharded parameter counts held by one stage (all its TP/EP ranks together): ``dense`` (everything
    but the routed experts; embedding on stage 0, final norm and head on the last stage) and ``experts``."""
    layers = stage_layers(c["n_layers"], lay.pp, lay.vpp)[stage]
    dense = experts = 0
    for li in layers:
        p = layer_params(c, li)
        experts += p["experts"]
        dense += sum(v for k, v in p.items() if k != "experts")
    V, d = c["vocab_size"], c["d_model"]
    if stage == 0:
        dense += V * d
    if stage == lay.pp - 1:
        dense += d + (0 if c["tie_embeddings"] else V * d)
        if c["tie_embeddings"] and lay.pp > 1:
            dense += V * d  # the last stage keeps its own copy of the tied embedding (Megatron does)
    return {"dense": dense, "experts": experts}


def total_params(c: dict) -> int:
    """All parameters of the model (each counted once), from `layer_params`; equals
    ``trainer.flops.count_params(c)["total"]`` (tested)."""
    V, d = c["vocab_size"], c["d_model"]
    body = sum(sum(layer_params(c, i).values()) for i in range(c["n_layers"]))
    return body + V * d * (1 if c["tie_embeddings"] else 2) + d


def _per_gpu_params(c: dict, lay: Layout, stage: int) -> tuple[float, float, int]:
    """(dense params on one GPU before data-parallel sharding, expert params on one GPU, norm+router
    params that tensor parallelism replicates) for ``stage``."""
    layers = stage_layers(c["n_layers"], lay.pp, lay.vpp)[stage]
    sp = stage_params(c, lay, stage)
    replicated = sum(layer_params(c, li)["norms"] + layer_params(c, li)["router"] for li in layers)
    if stage == lay.pp - 1:
        replicated += c["d_model"]
    dense_gpu = replicated + (sp["dense"] - replicated) / lay.tp
    return dense_gpu, sp["experts"] / lay.ep, replicated


# ----------------------------------------------------------------------------------- activations


def _norm_saved(tokens: float, width: int) -> float:
    """RMSNorm (layers.py) saves ``x.float()`` and the normalised fp32 ``y``: 8 bytes per element."""
    return 8.0 * tokens * width


def layer_activations(c: dict, lay: Layout, layer: int) -> dict[str, float]:
    """Bytes autograd saves for one layer and one microbatch on one GPU, by part (see docs/memory.md).

    Parts: ``norms`` (attn_norm, ffn_norm), ``attention`` (incl. MLA's q/kv norms and the SDPA inputs,
    output and log-sum-exp), ``dense_ffn``, ``moe`` (router, permutation indices, expert SwiGLU on the
    balanced rows, the top-k output copies, shared experts), ``moe_dispatch`` (level 3: the expert
    activations on the worst-case buffer beyond the balanced rows).
    """
    a = 2 if lay.dtype == "bf16" else 4
    t = lay.mbs * lay.seq / (lay.tp * lay.cp)   # tokens per GPU: sequence parallel (tp) and context parallel (cp)
    d, H = c["d_model"], c["n_heads"]
    out = {"norms": 2 * _norm_saved(t, d), "attention": 0.0, "dense_ffn": 0.0, "moe": 0.0, "moe_dispatch": 0.0}
    # ---- attention: tensors of shape [tokens/cp, heads/tp, dim] have t*H*dim elements
    if c["attn_type"] == "mla":
        qd = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        vd, kvr, qr = c["v_head_dim"], c["kv_lora_rank"], c["q_lora_rank"]
        att = a * t * d                                        # normed input, saved by wq/wq_a and wkv_a
        if qr:
            att += _norm_saved(t, qr) + a * t * qr             # q_norm + wq_b's input
        att += _norm_saved(t, kvr) + a * t * kvr               # kv_norm + wkv_b's input
        att += 2 * a * t * H * qd                              # q, k after cat (SDPA inputs)
        att += a * t * H * (c["qk_nope_head_dim"] + vd)        # kv: v is a view of it, keeps it alive
        att += 2 * a * t * H * vd                              # SDPA output + wo's input (reshape copy)
        att += 4.0 * t * H                                     # log-sum-exp, fp32
    else:
        hd = c["head_dim"] or d // H
        att = a * t * d + 5 * a * t * H * hd + 4.0 * t * H    # x; q, k, v (GQA: repeated), out, wo input; lse
    out["attention"] = att
    if layer < c["first_k_dense"]:
        out["dense_ffn"] = a * t * d + 4 * a * t * c["d_ff"]  # input; w1 out, silu out, w3 out, product
        return out
    E, k, ff, ns = c["n_routed_experts"], c["top_k"], c["moe_d_ff"], c["n_shared_experts"]
    tk = t * k
    moe = 0.0
    moe += (4.0 * t * d) if a == 2 else 0.0                    # router input x.float() (fp32 copy under bf16)
    moe += a * t * d if (ns or a == 4) else 0.0                # ffn_norm output, saved by the shared expert
    moe += 4.0 * t * E + (t * E if c["n_group"] > 1 else 0)    # scores (softmax/sigmoid output); group mask
    moe += 8.0 * tk + 4.0 * tk + 4.0 * t + a * tk              # gather index, top-k weights, their sum, bf16 copy
    moe += 8.0 * tk * 2                                        # permutation index (order // k) and inverse
    rows = tk * (lay.moe_imbalance if lay.ep > 1 else 1.0)
    expert = a * (d + 4 * ff)                                  # per row: input, w13 out [2F], silu out, product
    moe += rows * (expert + (8.0 if lay.ep > 1 else 0.0))      # + receive-side order index under EP
    if lay.ep > 1 and lay.sync_free_level >= 2:
        moe += 8.0 * tk                                        # slot index of the padded send buffer
    moe += a * tk * d                                          # top-k output copies kept by the weighted sum
    if ns:
        moe += 4 * a * t * ff * ns                             # shared expert SwiGLU
    out["moe"] = moe
    if lay.ep > 1 and lay.sync_free_level == 3:
        worst = moe_worst_rows(c, lay)
        out["moe_dispatch"] = max(0.0, worst - rows) * (expert + 8.0)
    return out


def moe_worst_rows(c: dict, lay: Layout) -> float:
    """Rows of the level-2/3 worst-case receive buffer: ``ep * T * min(k, E/ep)`` (moe.py: every local
    token may send min(k, E_local) copies to each peer)."""
    t = lay.mbs * lay.seq / (lay.tp * lay.cp)
    return lay.ep * t * min(c["top_k"], c["n_routed_experts"] // lay.ep)


def in_flight(lay: Layout, stage: int) -> float:
    """Microbatches whose activations stage ``stage`` holds at its peak, in units of the stage's layers.

    1F1B / ZB-H1: ``min(p - s, m)``; GPipe: ``m``; interleaved (v chunks): ``min(2(p-s-1) + (v-1)p + 1,
    m v) / v`` (Megatron's warm-up count + 1, each chunk a 1/v of the stage); ZB-V: ``min(p, m)`` on every
    stage (its schedule balances memory at 1F1B's stage-0 peak).
    """
    p, m, s, v = lay.pp, lay.microbatches, stage, lay.vpp
    if lay.schedule in ("1f1b", "zb1p"):
        return float(min(p - s, m))
    if lay.schedule == "gpipe":
        return float(m)
    if lay.schedule == "vpp":
        return min(2 * (p - s - 1) + (v - 1) * p + 1, m * v) / v
    return float(min(p, m))  # zbv


# ------------------------------------------------------------------------------------ projection


@dataclass
class MemoryProjection:
    """The projection of one layout. ``table``: one row per component with columns ``component``,
    ``group`` (parameters, gradients, optimizer, activations, working, transient), ``phase`` (the moments
    it is alive at: F forward end, B backward, E backward end, S optimizer step), ``bytes`` (per GPU),
    ``in_peak`` (alive at the peak moment), ``note``. ``phase`` (attribute) names the peak moment."""

    layout: Layout
    table: pd.DataFrame
    peak_bytes: float
    stage: int
    phase: str
    stages: pd.DataFrame          # per stage: train and step phase totals
    info: dict = field(default_factory=dict)

    def component_bytes(self, group: str | None = None, component: str | None = None) -> float:
        t = self.table
        if group is not None:
            t = t[t["group"] == group]
        if component is not None:
            t = t[t["component"] == component]
        return float(t["bytes"].sum())

    def summary(self) -> dict:
        """JSON-able: the peak, where it is, the layout and the breakdown."""
        return {
            "layout": self.layout.to_dict(), "label": self.layout.label(),
            "peak_bytes": int(round(self.peak_bytes)), "peak_gib": round(self.peak_bytes / GIB, 3),
            "stage": self.stage, "phase": self.phase, **self.info,
            "components": [{"component": r.component, "group": r.group, "phase": r.phase,
                            "bytes": int(round(r.bytes)), "gib": round(r.bytes / GIB, 4), "in_peak": bool(r.in_peak),
                            "note": r.note} for r in self.table.itertuples(index=False)],
            "stages": json.loads(self.stages.to_json(orient="records")),
        }


def _rows_for_stage(c: dict, lay: Layout, stage: int) -> list[dict]:
    """Components (bytes per GPU) of one pipeline stage, before choosing the peak phase."""
    rows: list[dict] = []

    def add(component, group, phase, nbytes, note=""):
        rows.append({"component": component, "group": group, "phase": phase, "bytes": float(nbytes), "note": note})

    bf16 = lay.dtype == "bf16"
    pb = 2 if bf16 else 4                     # bytes of the compute (working) copy of a parameter
    dense_gpu, expert_gpu, _ = _per_gpu_params(c, lay, stage)
    ddp_group = lay.dp * lay.cp               # dense parameters are data parallel over dp x cp
    edp = lay.edp
    if lay.zero == 3:   # FSDP2: sharded fp32 (master) params, fp32 grads, Adam m/v, all sharded
        sd, se = dense_gpu / ddp_group, expert_gpu / edp
        add("params: dense (sharded)", "parameters", "FBES", 4 * sd,
            f"fp32 shards, dense over dp*cp={ddp_group}" + (" (the fp32 master weights)" if bf16 else ""))
        add("params: experts (sharded)", "parameters", "FBES", 4 * se, f"fp32 shards, routed experts over edp={edp}")
        opt_params = sd + se
        grad_sd, grad_se = sd, se
    elif lay.zero == 0:  # DDP: everything replicated (the trainer's dp_mode=ddp: fp32 weights, autocast bf16)
        add("params: dense", "parameters", "FBES", 4 * dense_gpu, "fp32, replicated")
        add("params: experts", "parameters", "FBES", 4 * expert_gpu, "fp32, this rank's experts")
        add("DDP gradient buckets", "gradients", "FBES", 4 * dense_gpu,
            "DDP's flat bucket buffers (dense params; experts are excluded from DDP)")
        opt_params = dense_gpu + expert_gpu
        grad_sd, grad_se = dense_gpu, expert_gpu
    else:               # ZeRO-1/2 distributed optimizer (Megatron style)
        add("params: dense", "parameters", "FBES", pb * dense_gpu, f"{lay.dtype}, replicated over dp")
        add("params: experts", "parameters", "FBES", pb * expert_gpu, f"{lay.dtype}, this rank's experts")
        sd, se = dense_gpu / ddp_group, expert_gpu / edp
        if bf16:
            add("fp32 main params", "optimizer", "FBES", 4 * (sd + se), "fp32 master copy, sharded (distributed optimizer)")
        opt_params = sd + se
        grad_sd, grad_se = (sd, se) if lay.zero == 2 else (dense_gpu, expert_gpu)
    grads_persist = lay.microbatches > 1       # accumulated across microbatches: alive during the peak
    gphase = "FBES" if grads_persist else "ES"
    gnote = "fp32" + (", sharded" if lay.zero >= 2 else ", replicated") + (
        "; accumulated across microbatches" if grads_persist else "; freed by zero_grad(set_to_none) before forward")
    add("grads: dense", "gradients", gphase, 4 * grad_sd, gnote)
    add("grads: experts", "gradients", gphase, 4 * grad_se, gnote)
    add("optimizer: Adam exp_avg + exp_avg_sq", "optimizer", "FBES", 8 * opt_params, "fp32, sharded like the params"
        if lay.zero >= 1 else "fp32")
    add("optimizer step temporary", "transient", "S", 4 * opt_params,
        "foreach AdamW: sqrt(exp_avg_sq) of the whole shard")

    # ---- activations
    layers = stage_layers(c["n_layers"], lay.pp, lay.vpp)[stage]
    nfl = in_flight(lay, stage)
    a = 2 if bf16 else 4
    t = lay.mbs * lay.seq / (lay.tp * lay.cp)
    d, V = c["d_model"], c["vocab_size"]
    full_rc = lay.recompute == "full"
    rc_ids = set(range(c["n_layers"])) if full_rc else (set() if lay.recompute == "none" else set(lay.recompute))
    parts = {"attention": 0.0, "norms": 0.0, "dense_ffn": 0.0, "moe": 0.0, "moe_dispatch": 0.0}
    kept_rc = 0.0
    saved_by_rc = 0.0
    largest_layer = 0.0
    per_layer = {}
    for li in layers:
        la = layer_activations(c, lay, li)
        per_layer[li] = la
        tot = sum(la.values())
        if li in rc_ids:
            kept_rc += a * t * d                      # checkpoint keeps the layer input only
            saved_by_rc += tot - a * t * d
            largest_layer = max(largest_layer, tot)
        else:
            for k, v in la.items():
                parts[k] += v
    labels = {"attention": "activations: attention", "norms": "activations: layer norms",
              "dense_ffn": "activations: dense FFN", "moe": "activations: MoE (router, experts, top-k copies)",
              "moe_dispatch": "activations: MoE level-3 worst-case buffer"}
    infl = f"x {nfl:g} microbatch(es) in flight ({lay.schedule}, stage {stage})"
    for k, lab in labels.items():
        if parts[k] or k in ("attention", "moe"):
            extra = ""
            if k == "attention" and lay.cp > 1:
                extra = f"; cp={lay.cp} splits the sequence"
            if k == "moe_dispatch":
                extra = f"; rows ep*T*min(k, E/ep) = {moe_worst_rows(c, lay):,.0f} vs {t * c['top_k']:,.0f} balanced"
            add(lab, "activations", "FB", parts[k] * nfl, infl + extra)
    if rc_ids & set(layers):
        add("activations: recomputed layers' inputs", "activations", "FB", kept_rc * nfl,
            f"{len(rc_ids & set(layers))} checkpointed layer(s) keep their input only")
    if stage == 0:
        add("activations: embedding", "activations", "FB", 8.0 * lay.mbs * lay.seq / lay.cp * nfl, "token ids")
    loss_rows = []
    if stage == lay.pp - 1:
        head = _norm_saved(t, d) + a * t * d
        if lay.loss_fusion:
            chunk = min(lay.loss_chunk, t)
            loss_saved, loss_tr = head, 12.0 * chunk * V / lay.tp
            lnote = f"fused chunked CE: chunk {chunk:g} tokens x vocab/tp, fp32 logits + log-softmax + grad"
        else:
            loss_saved = head + 4.0 * t * V / lay.tp
            loss_tr = (8.0 + (a if a == 2 else 0)) * t * V / lay.tp
            lnote = "full fp32 logits: log-softmax output saved; backward adds its gradient and the NLL gradient"
        add("activations: final norm + loss", "activations", "FB", loss_saved * nfl,
            "final RMSNorm, head input" + ("" if lay.loss_fusion else ", fp32 log-softmax of the logits"))
        loss_rows.append(("transient: loss (logits and their gradient)", loss_tr, lnote))
    if saved_by_rc:
        add("recompute savings (not allocated)", "activations", "", saved_by_rc * nfl,
            "activations the checkpointed layers do not keep")

    # ---- working copies (FSDP2 all-gathered params, DDP autocast copies)
    layer_sizes = []
    for li in layers:
        p = layer_params(c, li)
        dense_l = p["norms"] + p["router"] + (p["attention"] + p["dense_ffn"] + p["shared"]) / lay.tp
        layer_sizes.append((dense_l, p["experts"] / lay.ep))
    root = 0.0
    if stage == 0:
        root += V * d / lay.tp
    if stage == lay.pp - 1:
        root += d + (0 if c["tie_embeddings"] and lay.pp == 1 else V * d / lay.tp)
    big_layer = max((x + y for x, y in layer_sizes), default=0.0)
    big_unit = max((max(x, y) for x, y in layer_sizes), default=0.0)
    if lay.zero == 3:
        add("FSDP unsharded params: root", "working", "FBE", pb * root,
            f"{'bf16' if bf16 else 'fp32'} all-gathered embedding/head/final norm, kept for the whole step")
        add("FSDP unsharded params: layers", "working", "B", pb * min(2, len(layers)) * big_layer,
            "two layers all-gathered at a time (current and prefetched)")
        add("FSDP root gradient reduce buffers", "working", "E", (pb + 4) * root,
            "backward end: the root's unsharded gradient + its fp32 reduce-scatter input")
        bwd_fsdp = (pb + 4) * big_unit + (pb * V * d / lay.tp if stage == lay.pp - 1 else 0.0)
        bnote = ("one unit's unsharded gradient + its fp32 reduce-scatter input; the head's gradient waits for "
                 "the root's reduce-scatter")
    elif lay.zero == 0 and bf16:
        add("autocast bf16 weight copies", "working", "FB", 2 * (dense_gpu + expert_gpu),
            "bf16 casts of the fp32 weights, kept for backward")
        bwd_fsdp, bnote = 0.0, ""
    else:
        bwd_fsdp, bnote = 0.0, ""
    if bwd_fsdp:
        add("FSDP layer gradient reduce buffers", "working", "B", bwd_fsdp, bnote)

    # ---- training transients, each at its moment
    for name, nbytes, note in loss_rows:
        add(name, "transient", "F", nbytes, note)
    ws = max((_layer_backward_workspace(c, lay, li) for li in layers), default=0.0)
    rc_note = " + the recomputed layer's activations" if largest_layer else ""
    add("transient: layer backward workspace", "transient", "B", ws + largest_layer,
        "gradients of the largest layer's biggest tensors" + rc_note)
    if lay.ep > 1 and any(li >= c["first_k_dense"] for li in layers):
        if lay.sync_free_level >= 2:
            add("transient: MoE dispatch/combine buffers", "transient", "FB", 2 * a * moe_worst_rows(c, lay) * d,
                "level >= 2: padded send + receive buffers of ep*T*min(k, E/ep) rows")
        else:
            add("transient: MoE dispatch/combine buffers", "transient", "FB", 2 * a * t * c["top_k"] * lay.moe_imbalance * d,
                "all-to-all send/receive buffers")
    return rows


def _layer_backward_workspace(c: dict, lay: Layout, layer: int) -> float:
    """Largest gradient temporaries while one layer runs backward (bytes)."""
    a = 2 if lay.dtype == "bf16" else 4
    t = lay.mbs * lay.seq / (lay.tp * lay.cp)
    d, H = c["d_model"], c["n_heads"]
    if c["attn_type"] == "mla":
        qd, vd = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    else:
        qd = vd = c["head_dim"] or d // H
    attn = a * t * H * (2 * qd + vd) + 4.0 * t * H    # dq, dk, dv + softmax row sums
    if layer < c["first_k_dense"]:
        return max(attn, a * t * (3 * c["d_ff"] + d))
    rows = t * c["top_k"] * (lay.moe_imbalance if lay.ep > 1 else 1.0)
    if lay.ep > 1 and lay.sync_free_level == 3:
        rows = moe_worst_rows(c, lay)
    return max(attn, a * rows * (d + 3 * c["moe_d_ff"]))  # d(w13 out) [2F] + d(product) [F] + d(input)


def project(c: dict, lay: Layout, stage: int | None = None) -> MemoryProjection:
    """Project per-GPU memory for ``lay``; the reported stage is the one with the highest peak (or
    ``stage``). Pure arithmetic over the config dict; see docs/memory.md for every formula."""
    check_layout(c, lay)
    best = None
    srows = []
    for s in (range(lay.pp) if stage is None else [stage]):
        rows = _rows_for_stage(c, lay, s)
        totals = _phase_totals(rows)
        moment = max(totals, key=totals.get)
        peak = totals[moment]
        srows.append({"stage": s, **{f"{MOMENTS[k].replace(' ', '_')}_bytes": v for k, v in totals.items()},
                      "peak_bytes": peak})
        if best is None or peak > best[0]:
            best = (peak, s, rows, moment)
    peak, s, rows, moment = best
    phase = MOMENTS[moment]
    for r in rows:
        r["in_peak"] = moment in r["phase"]
    df = pd.DataFrame(rows)[["component", "group", "phase", "bytes", "in_peak", "note"]]
    info = {"params_total": total_params(c), "microbatches": lay.microbatches,
            "in_flight": in_flight(lay, s)}
    return MemoryProjection(lay, df.reset_index(drop=True), float(peak), s, phase, pd.DataFrame(srows), info)


MOMENTS = {"F": "forward end", "B": "backward", "E": "backward end", "S": "optimizer step"}


def _phase_totals(rows: list[dict]) -> dict[str, float]:
    """Bytes alive at each moment of a step: a row counts where its ``phase`` string holds the moment's
    letter (F forward end, B backward of the largest layer, E backward end, S optimizer step)."""
    return {m: sum(r["bytes"] for r in rows if m in r["phase"]) for m in MOMENTS}


# --------------------------------------------------------------------------- communication volume


def comm_volume(c: dict, lay: Layout) -> dict[str, float]:
    """Bytes one GPU sends per optimizer step, by kind (ring algorithms; see docs/memory.md):

    * ``ep_all_to_all``: 4 all-to-alls per MoE layer and microbatch (dispatch, combine, and their
      backward), each sending ``(ep-1)/ep`` of the buffer: ``T*k*d`` rows balanced (levels 0-1), the
      padded ``ep*T*min(k, E/ep)`` rows at levels 2-3.
    * ``dp``: ZeRO-3: all-gather of the params in forward and in backward per microbatch (working
      dtype) + reduce-scatter of fp32 grads once per step; ZeRO-1/2: reduce-scatter fp32 grads + all-gather
      params; ZeRO-0: all-reduce fp32 grads (2x). Each moves ``(n-1)/n`` of the buffer; dense params over
      ``dp*cp``, experts over ``edp``.
    * ``pp``: activations forward and their gradients backward, ``[T/(tp*cp), d]`` per microbatch and
      chunk boundary (v per microbatch when interleaved).
    * ``tp``: sequence parallel: 4 all-gathers/reduce-scatters of ``[T, d]`` per layer forward, 4 backward.
    * ``cp``: ring attention passes the K and V chunks ``cp-1`` times per layer forward, K, V and their
      gradients twice that in backward.
    """
    a = 2 if lay.dtype == "bf16" else 4
    m = lay.microbatches
    t = lay.mbs * lay.seq / (lay.tp * lay.cp)
    d = c["d_model"]
    stage = max(range(lay.pp), key=lambda s: len(stage_layers(c["n_layers"], lay.pp, lay.vpp)[s]))
    layers = stage_layers(c["n_layers"], lay.pp, lay.vpp)[stage]
    n_moe = sum(1 for li in layers if li >= c["first_k_dense"])
    out = {}
    if lay.ep > 1:
        rows = moe_worst_rows(c, lay) if lay.sync_free_level >= 2 else t * c["top_k"] * lay.moe_imbalance
        out["ep_all_to_all"] = 4 * n_moe * m * rows * d * a * (lay.ep - 1) / lay.ep
    else:
        out["ep_all_to_all"] = 0.0
    dense_gpu, expert_gpu, _ = _per_gpu_params(c, lay, stage)
    pb = 2 if lay.dtype == "bf16" else 4

    def share(n):
        return (n - 1) / n if n > 1 else 0.0

    dp_bytes = 0.0
    for n_params, group in ((dense_gpu, lay.dp * lay.cp), (expert_gpu, lay.edp)):
        f = share(group)
        if lay.zero == 3:
            dp_bytes += f * n_params * (2 * m * pb + 4)
        elif lay.zero in (1, 2):
            dp_bytes += f * n_params * (4 + pb)
        else:
            dp_bytes += 2 * f * n_params * 4
    out["dp"] = dp_bytes
    out["pp"] = (2.0 * m * lay.vpp * a * t * d) if lay.pp > 1 else 0.0
    out["tp"] = 8.0 * len(layers) * m * a * t * d * lay.tp * share(lay.tp) if lay.tp > 1 else 0.0
    if lay.cp > 1:
        H = c["n_heads"] // lay.tp
        if c["attn_type"] == "mla":
            kv = (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * H
        else:
            kv = 2 * (c["n_kv_heads"] or c["n_heads"]) // lay.tp * (c["head_dim"] or d // c["n_heads"])
        chunk = a * lay.mbs * lay.seq / lay.cp * kv
        out["cp"] = 3.0 * (lay.cp - 1) * chunk * len(layers) * m
    else:
        out["cp"] = 0.0
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------------------------------ sweep


def parse_bytes(text: str | int | float) -> int:
    """'80GiB', '80 GB', '141e9', '85899345920' -> bytes (GiB/MiB binary, GB/MB decimal)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B?|B)?\s*", str(text))
    if not m:
        raise TraceError(None, f"memory: device memory {text!r} is not a size like 80GiB or 141GB")
    unit = (m.group(2) or "B").upper().rstrip("B")
    mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
            "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(float(m.group(1)) * mult)


def device_memory(name: str) -> int:
    """HBM bytes of a device by name (H100, H200, B200, A100, MI300X...)."""
    key = name.strip()
    for k in sorted(DEVICE_MEMORY, key=len, reverse=True):
        if k.lower() == key.lower() or k.lower() in key.lower():
            return DEVICE_MEMORY[k]
    raise TraceError(None, f"memory: unknown device {name!r} (known: {', '.join(sorted(DEVICE_MEMORY))}); "
                     "give --device-memory instead")


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


@dataclass(frozen=True)
class SweepSpace:
    """Choices the sweep enumerates; None = all valid divisors (pp, ep) up to the limits."""

    pp: tuple[int, ...] | None = None
    vpp: tuple[int, ...] = (1, 2)
    ep: tuple[int, ...] | None = None
    tp: tuple[int, ...] = (1, 2, 4, 8)
    cp: tuple[int, ...] = (1, 2)
    mbs: tuple[int, ...] = (1, 2)
    recompute: tuple[str, ...] = ("none", "full")
    max_pp: int = 64


def sweep(c: dict, world: int, device_bytes: float, global_batch: int, base: Layout | None = None,
          space: SweepSpace = SweepSpace(), headroom: float = 0.05, top: int | None = None) -> pd.DataFrame:
    """Enumerate layouts valid for ``world`` GPUs and the model, keep those whose projected peak fits
    ``device_bytes * (1 - headroom)``, rank them by the theoretical bubble (bubble.py) and then by the
    communication volume per step. ``global_batch`` is in sequences; GA = global_batch / (mbs * dp).

    Returns one row per fitting layout (best first) with its knobs, peak, bubble and communication.
    """
    if global_batch < 1:
        raise TraceError(None, f"memory: global batch must be >= 1, got {global_batch}")
    base = base or resolve_layout(c, world=world)
    limit = device_bytes * (1 - headroom)
    E, L = c["n_routed_experts"], c["n_layers"]
    pps = space.pp or tuple(p for p in _divisors(world) if p <= min(L, space.max_pp))
    rows = []
    for pp, tp, cp in itertools.product(pps, space.tp, space.cp):
        if world % (pp * tp * cp):
            continue
        stage_ranks = world // pp
        eps = space.ep or tuple(e for e in _divisors(E) if stage_ranks % e == 0)
        for vpp, ep, mbs, rc in itertools.product(space.vpp if pp > 1 else (1,), eps, space.mbs, space.recompute):
            dp = world // (pp * tp * cp)
            if global_batch % (mbs * dp):
                continue
            m = global_batch // (mbs * dp)
            if pp > 1 and m < pp:
                continue
            sched = "vpp" if vpp > 1 else ("1f1b" if base.schedule == "vpp" else base.schedule)
            lay = replace(base, pp=pp, vpp=vpp, tp=tp, cp=cp, ep=ep, mbs=mbs, microbatches=m, schedule=sched,
                          recompute=rc)
            try:
                check_layout(c, lay)
            except TraceError:
                continue
            proj = _peak_only(c, lay)
            if proj > limit:
                continue
            b = _bubble.bubble_ratio(sched, pp, m, vpp) if pp > 1 else 0.0
            comm = comm_volume(c, lay)
            rows.append({"label": lay.label(), "pp": pp, "vpp": vpp, "tp": tp, "cp": cp, "ep": ep, "dp": dp,
                         "mbs": mbs, "microbatches": m, "recompute": rc, "schedule": sched,
                         "peak_bytes": proj, "peak_gib": proj / GIB, "bubble": 0.0 if math.isnan(b) else b,
                         "comm_bytes": comm["total"], "comm_gib": comm["total"] / GIB,
                         **{f"comm_{k}_gib": v / GIB for k, v in comm.items() if k != "total"}})
    df = pd.DataFrame(rows, columns=SWEEP_COLUMNS if not rows else None)
    if df.empty:
        return df
    df = df.sort_values(["bubble", "comm_bytes", "peak_bytes"], kind="mergesort").reset_index(drop=True)
    return df.head(top) if top else df


SWEEP_COLUMNS = ("label", "pp", "vpp", "tp", "cp", "ep", "dp", "mbs", "microbatches", "recompute", "schedule",
                 "peak_bytes", "peak_gib", "bubble", "comm_bytes", "comm_gib")


def _peak_only(c: dict, lay: Layout) -> float:
    """The projected peak without building tables (the sweep evaluates thousands of layouts)."""
    return max(max(_phase_totals(_rows_for_stage(c, lay, s)).values()) for s in range(lay.pp))

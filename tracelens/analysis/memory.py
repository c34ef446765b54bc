"""Memory projection: bytes per GPU by component for a trainer config and a parallel layout.

    >>> from tracelens.analysis import memory as M
    >>> cfg = M.load_model_config("gpu_proxy")            # trainer YAML, config name, manifest.json or run dir
    >>> lay = M.resolve_layout(cfg.config, world=1)         # the trainer's own layout: dp*ep = world
    >>> p = M.project(cfg.config, lay)
    >>> p.table                                           # one row per component, bytes per GPU
    >>> p.peak_bytes, p.stage, p.phase                    # projected peak, on which stage, in which phase
    >>> M.sweep(cfg.config, world=768, device_bytes=80 * 2**30, global_batch=...)   # layouts that fit

Everything here is arithmetic on the trainer's flat config keys (``moespec/config.py``, with the parameter
counts of ``moespec/params.py`` and the schedules' action orders of ``moespec/schedules.py``); nothing
imports torch. Every formula, with its assumptions, is in docs/memory.md; the short version:

* **Model state** follows what the trainer allocates. FSDP2 (``dp_mode=fsdp``, ZeRO-3): sharded fp32
  parameters (the fp32 master weights under bf16 mixed precision), fp32 gradients, AdamW ``exp_avg`` and
  ``exp_avg_sq`` (fp32), dense parameters sharded over their data-parallel group (the trainer's world mesh),
  routed experts over the expert-data-parallel group (the trainer's ``dp`` sub-mesh); plus the unsharded
  bf16 working copies that FSDP2 all-gathers (the root's embedding/head until its post-backward, a unit
  and its prefetched neighbour) and each unit's reduce-scatter (fp32 input + bf16 gradient or fp32 output
  shard, after its parameters were resharded); unsharded fp32 accumulators under gradient accumulation and
  pipelines. DDP (ZeRO-0, the trainer's autocast): everything replicated, DDP's gradient buckets, autocast's
  cached bf16 matmul weights, and per-microbatch bf16 copies of the routed experts.
  ZeRO-1/2 (not in the trainer; Megatron's distributed optimizer): bf16 parameters, fp32 main parameters
  and Adam states sharded, gradients sharded from level 2.
* **Activations** are the tensors autograd saves in the trainer's modules (layers.py, moe.py), per layer
  and microbatch, times the microbatches each virtual stage of the pipeline rank holds: simulated from the
  torch schedule's action order (`moespec.schedules.action_order`, `backward_moments`) for 1f1b/gpipe/vpp, analytic
  (`in_flight`) otherwise. The stage layout is the run's own (a manifest's ``stage_layers`` and
  ``stage_to_rank``) or an even split. Tensor/sequence parallelism (with
  sequence parallelism) and context parallelism divide every per-token activation by ``tp*cp``.
* **Transients** are short-lived: the loss (fp32 logits, their log-softmax and gradient), one layer's
  backward working set (plus its recomputation when checkpointed), the MoE dispatch/combine buffers, and
  the optimizer step's ``foreach`` temporary (``sqrt(exp_avg_sq)``, one fp32 copy of the shard).

The peak is the largest of four moments of a step (each component says at which it is alive):
**forward end** (state + activations + the loss transient), **backward** of the largest layer (state +
activations + two all-gathered layers + its gradient reduce buffers + its backward workspace),
**backward end** (state + all gradients + the root's reduce buffers) and **optimizer step** (state +
gradients + the foreach temporary). Gradients count everywhere when they persist across microbatches.
Measured: H100 gpu_proxy (FSDP2 bf16) projected / torch.cuda.max_memory_allocated = 0.998; the 2 x H200
run dirs in tests/fixtures (EP2 FSDP2, PP2 1F1B and interleaved under DDP) 0.993-1.022 on every rank
(`compare_ranks`).
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

from moespec import devices as _devices
from moespec import schedules as _schedules
from moespec.params import attention_params, layer_params, total_params  # noqa: F401 (this module's API too)

from ..errors import TraceError
from . import bubble as _bubble

GIB = 1 << 30
SCHEMA_VERSION = 1
COMPONENT_GROUPS = ("parameters", "gradients", "optimizer", "activations", "working", "transient")


# ------------------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class ModelConfig:
    """A trainer config (flat keys, validated by ``moespec.config``) and where it came from."""

    config: dict
    source: str
    world: int | None = None            # from a manifest: the run's world size
    measured_peak_bytes: int | None = None  # from a manifest: max over ranks of torch.cuda.max_memory_allocated
    measured_kind: str | None = None
    measured_peaks: tuple[int, ...] | None = None  # from a manifest: per global rank
    pipeline: dict | None = None        # from a manifest: its "pipeline" record (stage_layers, stage_to_rank, ...)
    warnings: tuple[str, ...] = ()      # e.g. a bare name that is both a config and a local path

    @property
    def measured_on_gpu(self) -> bool:
        """The measured peak is a GPU's allocations (torch.cuda), not a host process's memory."""
        return str(self.measured_kind or "").startswith("cuda")

    def layout_kwargs(self) -> dict:
        """Layout keys that a pipelined run's manifest fixes: the trainer's own stage layout and placement
        (``stage_layers``, ``stage_to_rank``), schedule, vpp and microbatches. Empty without a pipeline."""
        pl = self.pipeline
        if not pl:
            return {}
        return {"pp": pl.get("pp"), "vpp": pl.get("vpp"), "schedule": pl.get("schedule"),
                "microbatches": pl.get("microbatches"),
                "stage_layers": tuple(tuple(x) for x in pl["stage_layers"]) if pl.get("stage_layers") else None,
                "stage_to_rank": tuple(pl["stage_to_rank"]) if pl.get("stage_to_rank") else None}


def load_model_config(src: str | os.PathLike, overrides: Iterable[str] = ()) -> ModelConfig:
    """Read a trainer config: a YAML file, a config name under trainer/configs, a run's manifest.json or a
    run dir. ``overrides`` are ``key=value`` strings. Bad input raises a one-line `TraceError`.
    Which one ``src`` means: see :func:`resolve_source`."""
    from moespec.config import CONFIG_DIR, ConfigError, load_config, parse_override  # noqa: PLC0415 (PyYAML on first use)

    from ..io.run import MANIFEST

    p, note = resolve_source(src, CONFIG_DIR)
    if note is not None:
        mc = load_model_config(p, overrides)
        return replace(mc, source=str(src), warnings=(note,) + mc.warnings)
    if p.is_dir():
        if not (p / MANIFEST).exists():
            raise TraceError(p, "directory has no manifest.json (expected a run dir)")
        p = p / MANIFEST
    try:
        if p.suffix == ".json":
            from ..io.manifest import read_manifest  # noqa: PLC0415

            man = read_manifest(p, need_config=True)  # fields of the trainer's types, else one line
            ovr = dict(man["config"])
            if "ep_capacity_fused" not in ovr:  # the key came with the fused path: a run without it ran unfused
                ovr["ep_capacity_fused"] = False
            for o in overrides:
                k, v = parse_override(o)
                ovr[k] = v
            cfg = load_config(None, ovr)
            metrics = man.get("metrics") or {}
            peaks = [int(x) for x in metrics.get("peak_memory_bytes") or [] if isinstance(x, (int, float))]
            pipe = man.get("pipeline")
            if pipe is not None and not (isinstance(pipe, dict) and isinstance(pipe.get("stage_layers"), list)
                                         and isinstance(pipe.get("stage_to_rank"), list)):
                raise TraceError(p, "manifest 'pipeline' needs lists 'stage_layers' and 'stage_to_rank'")
            return ModelConfig(cfg, str(p), world=man.get("world_size"),
                               measured_peak_bytes=max(peaks) if peaks else None,
                               measured_kind=metrics.get("peak_memory_kind"),
                               measured_peaks=tuple(peaks) or None, pipeline=pipe)
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


def resolve_source(src: str | os.PathLike, config_dir: Path) -> tuple[Path, str | None]:
    """What CONFIG names, and the line to warn with when that was a choice. A path is a path when it
    says so: it has a directory part (``./tiny``, ``runs/tiny``, an absolute path) or nothing else
    matches. A bare name (``tiny``, ``tiny.yaml``) is a config under ``config_dir`` when one has that name,
    even if a file or directory of that name exists here too; then the warning says which was taken and
    how to ask for the other (``./tiny``)."""
    text = os.fspath(src)
    p = Path(text)
    bare = text not in ("", ".", "..") and os.sep not in text and "/" not in text
    named = next((c for c in (config_dir / text, config_dir / f"{text}.yaml") if c.is_file()), None) if bare else None
    if named is None:
        return p, None
    if not (p.exists() or p.is_symlink()):
        return named, None
    kind = "directory" if p.is_dir() else "file"
    return named, (f"{text!r} is both a trainer config ({named.name} under trainer/configs) and a {kind} here; "
                   f"using the config (write ./{text} for the {kind})")


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
    # EP dispatch path (trainer/model/dispatch.py): "nccl" (exact rows at levels 0-1, the worst-case buffer at 2-3)
    # or "capacity" (static buffers of ep * ceil(f * T_c * k / ep) rows per chunk); chunks: ep_overlap's
    ep_dispatch: str = "nccl"
    ep_capacity: float = 1.25
    ep_chunks: int = 1
    # ep_capacity_fused (trainer/model/dispatch.py "The fused capacity path"): the capacity path's send buffer is one
    # gather from the tokens and the returned buffer is combined by one gather-reduce; a manifest without the key ran
    # the unfused path. triton_kernels: kernels' Triton permutation (use_triton_kernels), else their PyTorch references
    ep_capacity_fused: bool = True
    triton_kernels: bool = False
    # The trainer's pipeline layout (a manifest's "pipeline" record): layer ids per virtual stage (pp*vpp of
    # them, in model order) and the pipeline rank of each. None = even contiguous chunks, placed s % pp (V for zbv).
    stage_layers: tuple[tuple[int, ...], ...] | None = None
    stage_to_rank: tuple[int, ...] | None = None

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
        if self.stage_layers is not None:
            d["stage_layers"] = [list(x) for x in self.stage_layers]
        if self.stage_to_rank is not None:
            d["stage_to_rank"] = list(self.stage_to_rank)
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
    ``recompute_layer_ids``. ``pp``, ``vpp``, ``schedule`` (``pipeline_schedule``) and ``microbatches`` come
    from the config when ``pp`` is not given (a pipelined run's own settings); with ``pp`` given, the
    microbatches default to 1 (pp = 1) or 4*pp. ``world`` defaults to ``pp*tp*cp*dp`` when ``dp`` is given,
    else the trainer's ``pp*dp*ep`` (``dp`` unset: 1). A layout that does not divide raises a one-line
    `TraceError`.
    """
    kw = {k: v for k, v in kw.items() if v is not None}
    unknown = set(kw) - {f for f in Layout.__dataclass_fields__} - {"dp"}
    if unknown:
        raise _bad(sorted(unknown)[0], "unknown layout key", source)
    dp = kw.pop("dp", None)
    if "pp" not in kw and cfg.get("pp", 1) > 1:   # the config's own pipeline (trainer keys pp, vpp, ...)
        kw.setdefault("pp", cfg["pp"])
        kw.setdefault("vpp", cfg.get("vpp", 1))
        kw.setdefault("microbatches", cfg.get("microbatches", 4 * cfg["pp"]))
        kw.setdefault("schedule", cfg.get("pipeline_schedule", "1f1b"))
    elif "pp" not in kw and cfg.get("microbatches", 1) > 1:
        kw.setdefault("microbatches", cfg["microbatches"])  # gradient accumulation without a pipeline
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
        ep_dispatch=kw.get("ep_dispatch", cfg.get("ep_dispatch") or "nccl"),
        ep_capacity=float(kw.get("ep_capacity", cfg.get("ep_capacity_factor") or 1.25)),
        ep_chunks=int(kw.get("ep_chunks", (cfg.get("ep_overlap_chunks") or 2) if cfg.get("ep_overlap") else 1)),
        ep_capacity_fused=bool(kw.get("ep_capacity_fused", cfg.get("ep_capacity_fused", True))),
        triton_kernels=bool(kw.get("triton_kernels", cfg.get("use_triton_kernels", False))),
        stage_layers=kw.get("stage_layers"), stage_to_rank=kw.get("stage_to_rank"),
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
    if lay.vpp > 1 and lay.pp == 1:  # as the trainer's config check: virtual stages interleave pipeline ranks
        raise _bad("vpp", f"needs pipeline parallelism (pp > 1), got pp=1 and vpp={lay.vpp}", source)
    if lay.pp * lay.vpp > cfg["n_layers"]:
        raise _bad("pp", f"pp*vpp = {lay.pp * lay.vpp} exceeds n_layers={cfg['n_layers']}", source)
    if lay.vpp > 1 and lay.schedule not in ("vpp",):
        raise _bad("vpp", f"vpp={lay.vpp} needs schedule vpp (interleaved 1F1B), got {lay.schedule}", source)
    if lay.schedule not in _schedules.MODELED:
        raise _bad("schedule", f"unknown schedule {lay.schedule!r} (one of {', '.join(_schedules.MODELED)})", source)
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
    n_v = lay.pp * lay.vpp
    if lay.stage_layers is not None:
        flat = [li for st in lay.stage_layers for li in st]
        if len(lay.stage_layers) != n_v:
            raise _bad("stage_layers", f"{len(lay.stage_layers)} virtual stages, expected pp*vpp = {n_v}", source)
        if flat != list(range(cfg["n_layers"])):
            raise _bad("stage_layers", f"must list layers 0..{cfg['n_layers'] - 1} once each in order, got {flat}",
                       source)
    if lay.stage_to_rank is not None:
        if len(lay.stage_to_rank) != n_v or any(not 0 <= r < lay.pp for r in lay.stage_to_rank) \
                or sorted(set(lay.stage_to_rank)) != list(range(lay.pp)):
            raise _bad("stage_to_rank", f"needs {n_v} pipeline ranks covering 0..{lay.pp - 1}, "
                       f"got {list(lay.stage_to_rank)}", source)


# ------------------------------------------------------------------------------ parameter counts


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


def virtual_stages(c: dict, lay: Layout) -> list[list[int]]:
    """Layer ids of every virtual stage (``pp*vpp`` of them, model order): the layout's own
    ``stage_layers`` (a run's manifest) or even contiguous chunks (`stage_layers` of the chunks)."""
    if lay.stage_layers is not None:
        return [list(x) for x in lay.stage_layers]
    n_chunks = lay.pp * lay.vpp
    base, extra = divmod(c["n_layers"], n_chunks)
    out, start = [], 0
    for i in range(n_chunks):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def placement(lay: Layout) -> list[int]:
    """Pipeline rank of every virtual stage: the layout's ``stage_to_rank``, else the schedule's placement
    (`moespec.schedules`): ``s % pp`` (the trainer's loop placement), or V-shaped for zbv (stage s and
    2pp-1-s on rank s)."""
    if lay.stage_to_rank is not None:
        return list(lay.stage_to_rank)
    return _schedules.stage_to_rank(lay.pp * lay.vpp, lay.pp, _schedules.placement_of(lay.schedule))


def rank_stages(lay: Layout, rank: int) -> list[int]:
    """The virtual stages pipeline rank ``rank`` holds, in model order."""
    return [v for v, r in enumerate(placement(lay)) if r == rank]


def _rank_pieces(c: dict, lay: Layout, rank: int, memo: _Memo | None = None) -> tuple[list[int], bool, bool]:
    """(layer ids, holds the embedding, holds the final norm + head) of one pipeline rank."""
    memo = memo or _memo(c)
    vs = memo.rank_stages(lay, rank)
    chunks = memo.stages(lay)
    layers = [li for v in vs for li in chunks[v]]
    return layers, 0 in vs, lay.pp * lay.vpp - 1 in vs


def stage_params(c: dict, lay: Layout, stage: int, memo: _Memo | None = None) -> dict[str, int]:
    """Unsharded parameter counts held by one pipeline rank (all its TP/EP ranks together): ``dense``
    (everything but the routed experts; the embedding with virtual stage 0, final norm and head with the last)
    and ``experts``."""
    memo = memo or _memo(c)
    layers, has_embed, has_head = _rank_pieces(c, lay, stage, memo)
    dense = experts = 0
    for li in layers:
        p = memo.params(li)
        experts += p["experts"]
        dense += sum(v for k, v in p.items() if k != "experts")
    V, d = c["vocab_size"], c["d_model"]
    if has_embed:
        dense += V * d
    if has_head:
        dense += d + (0 if c["tie_embeddings"] else V * d)
        if c["tie_embeddings"] and lay.pp > 1:
            dense += V * d  # the last stage keeps its own copy of the tied embedding (Megatron does)
    return {"dense": dense, "experts": experts}


def _per_gpu_params(c: dict, lay: Layout, stage: int, memo: _Memo | None = None) -> tuple[float, float, int]:
    """(dense params on one GPU before data-parallel sharding, expert params on one GPU, norm+router
    params that tensor parallelism replicates) for ``stage``."""
    memo = memo or _memo(c)
    layers, _, has_head = _rank_pieces(c, lay, stage, memo)
    sp = stage_params(c, lay, stage, memo)
    replicated = sum(memo.params(li)["norms"] + memo.params(li)["router"] for li in layers)
    if has_head:
        replicated += c["d_model"]
    dense_gpu = replicated + (sp["dense"] - replicated) / lay.tp
    return dense_gpu, sp["experts"] / lay.ep, replicated


# ------------------------------------------------------------------------------ per-config caches

# the Layout fields `layer_activations` and `_layer_backward_workspace` read (with autocast, padded_buffer,
# moe_buffer_rows, moe_worst_rows): two layouts equal on these get the same bytes for a layer of each kind
_ACT_FIELDS = ("dtype", "zero", "mbs", "seq", "tp", "cp", "ep", "moe_imbalance", "sync_free_level", "ep_dispatch",
               "ep_capacity", "ep_chunks")


class _Memo:
    """Caches of one config's per-layer arithmetic, for `memory --sweep`'s thousands of layouts (issue 36).

    A model's layers are of two kinds, dense (id < ``first_k_dense``) and MoE, and `layer_params` depends on
    the kind alone; `layer_activations` and `_layer_backward_workspace` on the kind and the layout's
    `_ACT_FIELDS`; `virtual_stages` on the pipeline shape and `rank_stages` on it and the schedule's placement.
    A sweep asked for them hundreds of thousands of times (316K and 93K calls of the first two for
    proxy_1t on 768 GPUs). The cached values are shared: callers read them and never change them."""

    def __init__(self, c: dict):
        self.c = c
        self.snapshot = copy.deepcopy(c)  # `_memo` compares it with the config, to notice a change in place
        self._dense_below = c["first_k_dense"]
        self._params: dict[bool, dict[str, int]] = {}
        self._acts: dict[tuple, dict[str, float]] = {}
        self._ws: dict[tuple, float] = {}
        self._stages: dict[tuple, list[list[int]]] = {}
        self._ranks: dict[tuple, list[int]] = {}
        self._lay: Layout | None = None  # the last layout asked about and its `_ACT_FIELDS` (one layout at a time)
        self._lay_key: tuple = ()

    def _key(self, lay: Layout, layer: int) -> tuple:
        if lay is not self._lay:
            self._lay, self._lay_key = lay, tuple(getattr(lay, f) for f in _ACT_FIELDS)
        return (layer < self._dense_below, self._lay_key)

    def params(self, layer: int) -> dict[str, int]:
        """`layer_params` of ``layer``."""
        dense = layer < self._dense_below
        p = self._params.get(dense)
        if p is None:
            p = self._params[dense] = layer_params(self.c, layer)
        return p

    def activations(self, lay: Layout, layer: int) -> dict[str, float]:
        """`layer_activations` of ``layer`` under ``lay``."""
        k = self._key(lay, layer)
        a = self._acts.get(k)
        if a is None:
            a = self._acts[k] = layer_activations(self.c, lay, layer)
        return a

    def workspace(self, lay: Layout, layer: int) -> float:
        """`_layer_backward_workspace` of ``layer`` under ``lay``."""
        k = self._key(lay, layer)
        w = self._ws.get(k)
        if w is None:
            w = self._ws[k] = _layer_backward_workspace(self.c, lay, layer)
        return w

    def stages(self, lay: Layout) -> list[list[int]]:
        """`virtual_stages` of ``lay``."""
        k = (lay.pp, lay.vpp, lay.stage_layers)
        v = self._stages.get(k)
        if v is None:
            v = self._stages[k] = virtual_stages(self.c, lay)
        return v

    def rank_stages(self, lay: Layout, rank: int) -> list[int]:
        """`rank_stages` of pipeline rank ``rank`` under ``lay``."""
        k = (lay.pp, lay.vpp, lay.schedule, lay.stage_to_rank, rank)
        v = self._ranks.get(k)
        if v is None:
            v = self._ranks[k] = rank_stages(lay, rank)
        return v


_LAST_MEMO: _Memo | None = None


def _memo(c: dict) -> _Memo:
    """The caches of config ``c``: the last config's when ``c`` is that config (the same object, unchanged),
    else new ones. One config at a time: a sweep, or a report of several layouts of one model."""
    global _LAST_MEMO
    m = _LAST_MEMO
    if m is None or m.c is not c or m.snapshot != c:
        m = _LAST_MEMO = _Memo(c)
    return m


def _memo_clear() -> None:
    """Forget the cached config (tests)."""
    global _LAST_MEMO
    _LAST_MEMO = None


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
    ac = autocast(lay)
    cd = compiled_dense(c, lay)
    # compile=dense: the compiled region keeps its bf16 input and the residual after attention and recomputes each
    # norm in the backward from them and its fp32 rstd (Inductor's min-cut partitioner)
    norms = 2 * a * t * d + 2 * 4.0 * t if cd else 2 * _norm_saved(t, d)
    out = {"norms": norms, "attention": 0.0, "dense_ffn": 0.0, "moe": 0.0, "moe_dispatch": 0.0,
           "moe_weight_copies": 0.0}
    # ---- attention: tensors of shape [tokens/cp, heads/tp, dim] have t*H*dim elements
    if c["attn_type"] == "mla":
        qd = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        vd, kvr, qr = c["v_head_dim"], c["kv_lora_rank"], c["q_lora_rank"]
        att = a * t * d * (2 if ac else 1)                     # normed input, saved by wq/wq_a and wkv_a
        #                                                        (autocast: each linear keeps its own bf16 cast)
        if qr:                                                 # q_norm (compiled: wq_a's output and the rstd)
            att += (a * t * qr + 4.0 * t if cd else _norm_saved(t, qr)) + a * t * qr  # + wq_b's input
        #                                                        kv_norm (compiled: wkv_a's whole output, the
        #                                                        latent and the rope part, and the rstd)
        att += (a * t * (kvr + c["qk_rope_head_dim"]) + 4.0 * t if cd else _norm_saved(t, kvr))
        att += a * t * kvr                                     # wkv_b's input
        att += 2 * a * t * H * qd                              # q, k after cat (SDPA inputs)
        att += a * t * H * (c["qk_nope_head_dim"] + vd)        # kv: v is a view of it, keeps it alive
        att += 2 * a * t * H * vd                              # SDPA output + wo's input (reshape copy)
        att += 4.0 * t * H                                     # log-sum-exp, fp32
    else:
        hd = c["head_dim"] or d // H
        att = a * t * d * (3 if ac else 1) + 5 * a * t * H * hd + 4.0 * t * H  # x (autocast: wq/wk/wv casts);
        #                                                        q, k, v (GQA: repeated), out, wo input; lse
    out["attention"] = att
    if layer < c["first_k_dense"]:
        out["dense_ffn"] = a * t * d * (2 if ac else 1) + (3 if cd else 4) * a * t * c["d_ff"]  # input (autocast:
        #                                                        w1's and w3's casts); w1 out, silu out, w3 out,
        #                                                        product (compiled: one of the last two recomputed)
        return out
    E, k, ff, ns = c["n_routed_experts"], c["top_k"], c["moe_d_ff"], c["n_shared_experts"]
    tk = t * k
    moe = 0.0
    if ac:
        moe += a * t * d                                       # router input: autocast's bf16 cast for the gate
        moe += 2 * a * t * d if ns else 0.0                    # shared expert: w1's and w3's bf16 input casts
    else:
        moe += (4.0 * t * d) if a == 2 else 0.0                # router input x.float() (fp32 copy under bf16)
        moe += a * t * d if (ns or a == 4) else 0.0            # ffn_norm output, saved by the shared expert
    moe += 4.0 * t * E + (t * E if c["n_group"] > 1 else 0)    # scores (softmax/sigmoid output); group mask
    moe += 8.0 * tk + 4.0 * tk + 4.0 * t + a * tk              # gather index, top-k weights, their sum, bf16 copy
    moe += 8.0 * tk * 2                                        # permutation index (order // k) and inverse
    rows = tk * (lay.moe_imbalance if lay.ep > 1 else 1.0)
    # per row: input, w13 out [2F], silu out, product; expert_swiglu=triton (kernels.swiglu) keeps only its input
    # [2F] and recomputes the SiLU in its backward kernel
    expert = a * (d + (3 if c.get("expert_swiglu") == "triton" else 4) * ff)
    moe += rows * (expert + (8.0 if lay.ep > 1 else 0.0))      # + receive-side order index under EP
    if lay.ep > 1 and (lay.sync_free_level >= 2 or lay.ep_dispatch == "capacity"):
        moe += 8.0 * tk                                        # slot index of the padded send buffer
    if index_copy_send(lay):                                   # the expert-ordered rows: the send buffer's
        moe += a * tk * d                                      # out-of-place index_copy keeps its source
    moe += combine_saved(c, lay)                               # what the combine keeps (the top-k output rows)
    if ns:
        moe += (3 if cd else 4) * a * t * ff * ns              # shared expert SwiGLU (compiled: one recomputed)
    out["moe"] = moe
    if ac:  # GroupedExperts.forward: w13.to(bf16), w2.to(bf16) -- fresh copies per forward, saved by the GEMMs
        out["moe_weight_copies"] = 2.0 * E / lay.ep * 3 * d * ff
    if padded_buffer(lay):
        worst = moe_buffer_rows(c, lay)
        out["moe_dispatch"] = max(0.0, worst - rows) * (expert + 8.0)
    return out


def compiled_dense(c: dict, lay: Layout) -> bool:
    """``compile: dense`` (trainer/compiling.py): each block's attention half, the dense blocks and the shared
    experts run compiled, and keep what Inductor's min-cut partitioner saves (checked against the trainer's model by
    benchmarks/activation_census.py). Under autocast (DDP) the regions' casts are not modeled: the eager figures."""
    return c.get("compile") == "dense" and not autocast(lay)


def autocast(lay: Layout) -> bool:
    """The trainer runs bf16 DDP (``dp_mode=ddp``, zero 0) under ``torch.autocast`` with fp32 weights and
    an fp32 residual stream; FSDP2 (zero 3) casts the parameters instead (``MixedPrecisionPolicy``)."""
    return lay.zero == 0 and lay.dtype == "bf16"


def combine_saved(c: dict, lay: Layout) -> float:
    """Bytes the MoE combine (the routing-weighted sum of each token's expert outputs) keeps for its backward, per
    layer and micro-batch (checked against the trainer's model by benchmarks/activation_census.py): the top-k output
    rows ``a * T * k * D``; on the fused capacity path the returned buffer itself (``kernels.unpermute``, the
    Triton kernels) or, on the kernels' PyTorch reference, its fp32 ``[T, k, D]`` gather and fp32 weights. Freed
    first in the layer's backward, before its experts' (`_layer_backward_workspace`)."""
    a = 2 if lay.dtype == "bf16" else 4
    tk = lay.mbs * lay.seq / (lay.tp * lay.cp) * c["top_k"]
    if fused_capacity(lay):
        if lay.triton_kernels:
            return a * moe_buffer_rows(c, lay) * c["d_model"]
        return 4.0 * tk * c["d_model"] + (4.0 - a) * tk  # (the weights' fp32 instead of the bf16 copy counted apart)
    return a * tk * c["d_model"]


def index_copy_send(lay: Layout) -> bool:
    """Whether the EP send buffer is built by an out-of-place ``index_copy`` of the expert-ordered rows
    (trainer/model/dispatch.py ``send``): the worst-case buffer (nccl, levels 2-3) and the unfused capacity path.
    Autograd's ``index_copy`` keeps its source, ``a * T * k * D`` bytes per MoE layer (activation census)."""
    return lay.ep > 1 and ((lay.ep_dispatch == "capacity" and not lay.ep_capacity_fused)
                           or (lay.ep_dispatch == "nccl" and lay.sync_free_level >= 2))


def fused_capacity(lay: Layout) -> bool:
    """Whether the run takes the fused capacity path (``ep_capacity_fused`` on the capacity dispatch)."""
    return lay.ep > 1 and lay.ep_dispatch == "capacity" and lay.ep_capacity_fused


def padded_buffer(lay: Layout) -> bool:
    """Whether the experts' input is a padded EP buffer kept for the backward: the worst case (nccl, level 3) or
    the capacity buffer (capacity, any level)."""
    return lay.ep > 1 and (lay.ep_dispatch == "capacity" or lay.sync_free_level == 3)


def moe_buffer_rows(c: dict, lay: Layout) -> float:
    """Rows of a rank's EP receive buffers per micro-batch (every chunk's: all are sent before any expert runs):
    capacity ``chunks * ep * ceil(f * T/chunks * k / ep)``; nccl levels 2-3 the worst case (`moe_worst_rows`);
    nccl levels 0-1 the received rows ``T * k`` x the imbalance."""
    t = lay.mbs * lay.seq / (lay.tp * lay.cp)
    if lay.ep_dispatch == "capacity":
        tc = t / max(lay.ep_chunks, 1)
        return float(lay.ep_chunks * lay.ep * math.ceil(lay.ep_capacity * tc * c["top_k"] / lay.ep))
    if lay.sync_free_level >= 2:
        return moe_worst_rows(c, lay)
    return t * c["top_k"] * lay.moe_imbalance


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


# the schedules whose action order (no split backward: F and B only) the activations are simulated on
SIMULATED_SCHEDULES = tuple(n for n in _schedules.MODELED if not _schedules.SCHEDULES[n].split_backward)


def backward_moments(lay: Layout, rank: int) -> list[tuple[int, dict[int, float]]]:
    """Every backward action of pipeline rank ``rank`` in one step, as ``(virtual stage it runs, {virtual
    stage: microbatches whose activations are alive})`` (the one running its backward included).

    Without a pipeline: one moment, one microbatch (gradient accumulation runs microbatches one after
    another). Schedules simulated by `moespec.schedules.action_order` (1f1b, gpipe, vpp, with the trainer's
    loop placement)
    give the exact mix of stages; the others (zb1p, zbv) get `in_flight`'s count on each local stage.
    """
    vs = rank_stages(lay, rank)
    if lay.pp == 1:
        return [(vs[-1], {v: 1.0 for v in vs})]
    loop = placement(lay) == [s % lay.pp for s in range(lay.pp * lay.vpp)]
    if lay.schedule not in SIMULATED_SCHEDULES or not loop:
        n = in_flight(lay, rank)
        return [(v, {u: n for u in vs}) for v in vs]
    return [(st, dict(alive)) for st, alive in _simulated_moments(lay.schedule, lay.pp, lay.vpp, lay.microbatches,
                                                                   rank, tuple(vs))]


@functools.lru_cache(maxsize=1024)
def _simulated_moments(schedule: str, pp: int, vpp: int, m: int, rank: int,
                       vs: tuple[int, ...]) -> tuple[tuple[int, tuple[tuple[int, float], ...]], ...]:
    """`backward_moments` of a simulated schedule on the loop placement, as tuples. It depends on the
    schedule's shape alone, so a sweep's thousands of layouts (tp, ep, dp, mbs, recompute varying) share it."""
    alive: dict[int, set] = {v: set() for v in vs}
    out = []
    for kind, st, mb in _schedules.action_order(schedule, pp, vpp, m, rank):
        if kind == "F":
            alive[st].add(mb)
        else:
            out.append((st, tuple((v, float(len(x))) for v, x in alive.items())))
            alive[st].discard(mb)
    return tuple(out)


def _distinct_moments(lay: Layout, rank: int) -> list[tuple[int, dict[int, float]]]:
    """`backward_moments` with each (stage, alive mix) once, in order of first appearance: a steady state
    repeats the same mix for every microbatch, and the peak is a max over the mixes (`max` returns the
    first maximal element, which is the first appearance of its mix, so the choice is the same)."""
    if lay.pp > 1 and lay.schedule in SIMULATED_SCHEDULES and placement(lay) == [
            s % lay.pp for s in range(lay.pp * lay.vpp)]:  # backward_moments' simulated case, cached on its shape
        return [(st, dict(comp)) for st, comp in _distinct_simulated(
            lay.schedule, lay.pp, lay.vpp, lay.microbatches, rank, tuple(rank_stages(lay, rank)))]
    seen, out = set(), []
    for st, comp in backward_moments(lay, rank):
        key = (st, tuple(comp.items()))
        if key not in seen:
            seen.add(key)
            out.append((st, comp))
    return out


@functools.lru_cache(maxsize=1024)
def _distinct_simulated(schedule: str, pp: int, vpp: int, m: int, rank: int,
                        vs: tuple[int, ...]) -> tuple[tuple[int, tuple[tuple[int, float], ...]], ...]:
    """`_simulated_moments` with each (stage, alive mix) once, in order of first appearance: a sweep asks
    for the same schedule shape for thousands of layouts, and the dedup of its thousands of moments was
    most of `memory --sweep`'s time."""
    return tuple(dict.fromkeys(_simulated_moments(schedule, pp, vpp, m, rank, vs)))


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


ACT_PARTS = {
    "attention": "activations: attention",
    "norms": "activations: layer norms",
    "dense_ffn": "activations: dense FFN",
    "moe": "activations: MoE (router, experts, top-k copies)",
    "moe_dispatch": "activations: MoE level-3 worst-case buffer",
    "moe_weight_copies": "activations: expert weight bf16 copies (autocast)",
    "recompute_inputs": "activations: recomputed layers' inputs",
    "embedding": "activations: embedding",
    "final": "activations: final norm + loss",
    "stage_output": "activations: pipeline stage outputs",
}


def _residual_bytes(lay: Layout) -> int:
    """Bytes per element of the hidden states between layers and stages: bf16 under FSDP2's bf16 policy,
    fp32 under autocast (DDP) or fp32 training (the trainer's ``act_dtype``)."""
    return 4 if (autocast(lay) or lay.dtype != "bf16") else 2


def _vstage_activations(c: dict, lay: Layout, v: int, layers: list[int],
                        memo: _Memo | None = None) -> tuple[dict, float, float]:
    """Per microbatch on one GPU, for virtual stage ``v``: (bytes by part of `ACT_PARTS`, bytes recompute
    saves, bytes of its backward workspace: largest layer's gradient temporaries + a recomputed layer)."""
    memo = memo or _memo(c)
    a = 2 if lay.dtype == "bf16" else 4
    t = lay.mbs * lay.seq / (lay.tp * lay.cp)
    d, V = c["d_model"], c["vocab_size"]
    last_v = lay.pp * lay.vpp - 1
    rc_ids = set(range(c["n_layers"])) if lay.recompute == "full" else (
        set() if lay.recompute == "none" else set(lay.recompute))
    parts = dict.fromkeys(ACT_PARTS, 0.0)
    saved = largest_rc = 0.0
    for li in layers:
        la = memo.activations(lay, li)
        tot = sum(la.values())
        if li in rc_ids:
            parts["recompute_inputs"] += a * t * d        # the checkpoint keeps the layer input only
            saved += tot - a * t * d
            largest_rc = max(largest_rc, tot)
        else:
            for k, x in la.items():
                parts[k] += x
    if v == 0:
        parts["embedding"] = 8.0 * lay.mbs * lay.seq / lay.cp   # token ids
    if v == last_v:
        head_in = (4 if autocast(lay) and lay.loss_fusion else a) * t * d  # autocast: the fp32 h the checkpoint keeps
        parts["final"] = _norm_saved(t, d) + head_in + (0.0 if lay.loss_fusion else 4.0 * t * V / lay.tp)
    elif lay.pp > 1:
        parts["stage_output"] = _residual_bytes(lay) * t * d   # kept by the stage for its backward
    ws = max((memo.workspace(lay, li) for li in layers), default=0.0)
    return parts, saved, ws + largest_rc


def _fsdp_units(c: dict, lay: Layout, layers: list[int],
                memo: _Memo | None = None) -> list[tuple[str, int, float, int]]:
    """FSDP2 units of a rank's layers in forward order, as the trainer wraps them: (kind ``dense`` or
    ``experts``, layer id, params on this GPU before sharding, shard group size)."""
    memo = memo or _memo(c)
    out = []
    for li in layers:
        p = memo.params(li)
        out.append(("dense", li, p["norms"] + p["router"] + (p["attention"] + p["dense_ffn"] + p["shared"]) / lay.tp,
                    lay.dp * lay.cp))
        if p["experts"]:
            out.append(("experts", li, p["experts"] / lay.ep, lay.edp))
    return out


def fsdp_units(c: dict, lay: Layout, stage: int = 0) -> list[tuple[str, int, float, int]]:
    """FSDP2 units of one pipeline stage's rank in forward order, as the trainer wraps them (trainer/parallel/dist.py):
    the root first (``root``, layer -1: embedding / final norm / head, when the stage holds them), then per layer its
    ``dense`` unit and its ``experts``. Each: (kind, layer id, params on this GPU before sharding, shard group size)."""
    memo = _memo(c)
    layers, has_embed, has_head = _rank_pieces(c, lay, stage, memo)
    V, d = c["vocab_size"], c["d_model"]
    root = (V * d / lay.tp if has_embed else 0.0) + (
        d + (0 if c["tie_embeddings"] and lay.pp == 1 else V * d / lay.tp) if has_head else 0.0)
    out = [("root", -1, float(root), lay.dp * lay.cp)] if root else []
    return out + _fsdp_units(c, lay, layers, memo)


def _describe(comp: dict[int, float], lay: Layout) -> str:
    if lay.pp == 1:
        n = next(iter(comp.values()))
        return f"x {n:g} microbatch"
    return " + ".join(f"stage {v} x{n:g}" for v, n in comp.items() if n) or "nothing"


def _rows_for_stage(c: dict, lay: Layout, stage: int) -> list[dict]:
    """Components (bytes per GPU) of one pipeline rank ``stage`` (all its virtual stages), before choosing
    the peak moment. Each row's ``phase`` lists the moments it is alive at (see `MOMENTS`)."""
    rows: list[dict] = []

    def add(component, group, phase, nbytes, note=""):
        rows.append({"component": component, "group": group, "phase": phase, "bytes": float(nbytes), "note": note})

    bf16 = lay.dtype == "bf16"
    pb = 2 if bf16 else 4                     # bytes of the compute (working) copy of a parameter
    a = pb
    t = lay.mbs * lay.seq / (lay.tp * lay.cp)
    d, V = c["d_model"], c["vocab_size"]
    ac = autocast(lay)
    memo = _memo(c)
    layers, has_embed, has_head = _rank_pieces(c, lay, stage, memo)
    vs = memo.rank_stages(lay, stage)
    chunks = memo.stages(lay)
    last_v = lay.pp * lay.vpp - 1
    dense_gpu, expert_gpu, _ = _per_gpu_params(c, lay, stage, memo)
    ddp_group = lay.dp * lay.cp               # dense parameters are data parallel over dp x cp
    edp = lay.edp
    # FSDP2 without a reduce-scatter per backward: gradient accumulation (set_requires_gradient_sync(False))
    # and every pipeline (PipelineStage turns gradient sync and resharding off until the last microbatch)
    fsdp_acc = lay.zero == 3 and (lay.pp > 1 or lay.microbatches > 1)

    # ---- model state
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
    # accumulated across microbatches (alive during the peak) -- except FSDP2's shards, which the last
    # reduce-scatter creates (the accumulation happens in unsharded fp32 buffers, below)
    grads_persist = lay.microbatches > 1 and lay.zero != 3
    gphase = "FBES" if grads_persist else "ES"
    if lay.zero == 3:
        gnote = "fp32, sharded; created by the reduce-scatters of the (last) backward, freed by zero_grad(set_to_none)"
    else:
        gnote = "fp32" + (", sharded" if lay.zero >= 2 else ", replicated") + (
            "; accumulated across microbatches" if grads_persist else "; freed by zero_grad(set_to_none) before forward")
    add("grads: dense", "gradients", gphase, 4 * grad_sd, gnote)
    add("grads: experts", "gradients", gphase, 4 * grad_se, gnote)
    add("optimizer: Adam exp_avg + exp_avg_sq", "optimizer", "FBES", 8 * opt_params, "fp32, sharded like the params"
        if lay.zero >= 1 else "fp32")
    add("optimizer step temporary", "transient", "S", 4 * opt_params,
        "foreach AdamW: sqrt(exp_avg_sq) of the whole shard")

    # ---- activations: per virtual stage and microbatch, times the microbatches alive at each moment
    per_v = {v: _vstage_activations(c, lay, v, chunks[v], memo) for v in vs}
    size = {v: sum(per_v[v][0].values()) for v in vs}
    moments = _distinct_moments(lay, stage)
    alive = [sum(n * size[v] for v, n in comp.items()) for _, comp in moments]   # activations alive at each

    # largest layer backward; then the loss / forward end (`max` keeps the first of equal moments)
    b_stage, b_comp = moments[max(range(len(moments)), key=lambda i: alive[i] + per_v[moments[i][0]][2])]
    loss = [i for i, m in enumerate(moments) if m[0] == last_v] if has_head else range(len(moments))
    f_stage, f_comp = moments[max(loss, key=alive.__getitem__)]
    sched = f"{lay.schedule}, " if lay.pp > 1 else ""
    for k, label in ACT_PARTS.items():
        fb = {m: sum(n * per_v[v][0][k] for v, n in comp.items()) for m, comp in (("F", f_comp), ("B", b_comp))}
        if not (fb["F"] or fb["B"]) and k not in ("attention", "moe"):
            continue
        extra = ""
        if k == "attention" and lay.cp > 1:
            extra = f"; cp={lay.cp} splits the sequence"
        if k == "moe_dispatch":
            extra = (f"; rows {'ep*ceil(f*T*k/ep) (capacity)' if lay.ep_dispatch == 'capacity' else 'ep*T*min(k, E/ep)'}"
                     f" = {moe_buffer_rows(c, lay):,.0f} vs {t * c['top_k']:,.0f} balanced")
        if k == "moe_weight_copies":
            extra = "; GroupedExperts casts w13/w2 per forward and the grouped GEMMs save the casts"
        if k == "stage_output":
            extra = "; the stage output each in-flight microbatch keeps for its backward"
        if fb["F"] == fb["B"]:
            add(label, "activations", "FB", fb["F"], f"{_describe(b_comp, lay)} ({sched}rank {stage})" + extra)
        else:
            add(label, "activations", "F", fb["F"], f"{_describe(f_comp, lay)} at the forward end / loss" + extra)
            add(label, "activations", "B", fb["B"], f"{_describe(b_comp, lay)} at the backward of stage {b_stage}"
                + extra)
    saved = sum(n * per_v[v][1] for v, n in b_comp.items())
    if saved:
        add("recompute savings (not allocated)", "activations", "", saved, "activations the checkpointed layers do not keep")
    if lay.pp > 1:
        rb = _residual_bytes(lay)
        n_buf = sum((v != 0) + (v != last_v) for v in vs) * lay.microbatches
        add("pipeline receive buffers", "working", "FBES", n_buf * rb * t * d,
            f"PipelineStage: one activation (non-first stages) and one gradient (non-last stages) buffer per "
            f"microbatch, {n_buf} x [{lay.mbs}, {lay.seq // lay.cp}, {d}] {'fp32' if rb == 4 else 'bf16'}, kept across steps")

    # ---- working copies (FSDP2 all-gathered params, autocast's cached bf16 weights)
    root = 0.0
    if has_embed:
        root += V * d / lay.tp
    if has_head:
        root += d + (0 if c["tie_embeddings"] and lay.pp == 1 else V * d / lay.tp)
    head = V * d / lay.tp if has_head else 0.0
    if lay.zero == 3:
        freed = None
        if lay.pp == 1:  # per layer: what its backward frees (the whole layer; the expert rows at its experts)
            rc_ids = set(range(c["n_layers"])) if lay.recompute == "full" else (
                set() if lay.recompute == "none" else set(lay.recompute))
            freed = {}
            for li in layers:
                la = memo.activations(lay, li)
                whole = a * t * d if li in rc_ids else sum(la.values())
                freed[li] = (whole, 0.0 if li in rc_ids else la["moe"] + la["moe_dispatch"])
            if has_head:  # the loss's saved tensors go first (key -1: before every layer)
                freed[-1] = (per_v[last_v][0]["final"], 0.0)
        _fsdp_rows(add, lay, _fsdp_units(c, lay, layers, memo), root, head, pb, fsdp_acc, freed)
    elif ac:
        cached = head + sum((memo.params(li)["attention"] + memo.params(li)["dense_ffn"]
                             + memo.params(li)["shared"]) / lay.tp + memo.params(li)["router"] for li in layers)
        add("autocast bf16 weight cache", "working", "FB", 2 * cached,
            "bf16 casts of the fp32 matmul weights (attention, dense FFN, shared experts, router, head), cached "
            "by autocast for the whole forward+backward; the embedding and norms run in fp32")

    # ---- training transients, each at its moment
    if has_head:
        if lay.loss_fusion:
            chunk = min(lay.loss_chunk, t)
            loss_tr = 12.0 * chunk * V / lay.tp + (2.0 * V * d / lay.tp if ac else 0.0)
            lnote = (f"fused chunked CE: chunk {chunk:g} tokens x vocab/tp: saved fp32 log-softmax, its gradient "
                     "and the NLL gradient" + ("; + autocast's bf16 head cast in the recomputation" if ac else ""))
        else:
            loss_tr = (8.0 + (a if a == 2 else 0)) * t * V / lay.tp
            lnote = "full fp32 logits: log-softmax output saved; backward adds its gradient and the NLL gradient"
        add("transient: loss (logits and their gradient)", "transient", "F", loss_tr, lnote)
    ws = per_v[b_stage][2]
    add("transient: layer backward workspace", "transient", "B", ws,
        "gradients of the largest layer's biggest tensors" + (" + a recomputed layer's activations"
                                                             if lay.recompute != "none" else "")
        + ("; autocast: a weight gradient in bf16 and its fp32 cast" if ac else ""))
    if lay.ep > 1 and any(li >= c["first_k_dense"] for li in layers):
        # while the experts run backward: their outputs' gradient, received and regrouped into expert order (the
        # regroup frees the received copy); the experts' own gradients are the workspace
        if lay.ep_dispatch == "capacity":
            add("transient: MoE dispatch/combine buffers", "transient", "B", a * moe_buffer_rows(c, lay) * d,
                "capacity: the expert outputs' gradient in a static buffer of ep*ceil(f*T*k/ep) rows per chunk")
        elif lay.sync_free_level >= 2:
            add("transient: MoE dispatch/combine buffers", "transient", "B", a * moe_worst_rows(c, lay) * d,
                "level >= 2: the expert outputs' gradient in a padded buffer of ep*T*min(k, E/ep) rows")
        else:
            add("transient: MoE dispatch/combine buffers", "transient", "B", a * t * c["top_k"] * lay.moe_imbalance * d,
                "the expert outputs' gradient as received")
    return rows


def _fsdp_rows(add, lay: Layout, units: list, root: float, head: float, pb: int, acc: bool,
               freed: dict[int, tuple[float, float]] | None = None) -> None:
    """FSDP2's unsharded parameters and gradient buffers (what torch's ``fully_shard`` allocates):

    * The root (embedding / final norm / head of the model or stage module) stays all-gathered from forward
      until its post-backward; each other unit is all-gathered for its forward and again for its backward,
      where the next unit in backward order is prefetched; ``reshard()`` frees a unit's parameters *before*
      its gradients are reduce-scattered.
    * A unit's reduce-scatter (``foreach_reduce``) copies its unsharded ``pb``-byte gradients into an fp32
      input buffer (4 B/param; freed at the next unit's reduce), frees them, and allocates the fp32 output
      shard (4/n B/param) that becomes the sharded ``.grad``. Peak: ``4 + max(pb, 4/n)`` B/param.
    * ``B`` is the reduce-scatter of the unit that maximises it: its buffers, the shards reduced before it,
      the unsharded units still gathered (the rest of its layer when it is a layer's experts, and the
      prefetched previous layer) and the head's gradient waiting for the root, net of the activations the
      backward has freed by then (``freed``: per layer, (all its activations, its expert rows' part);
      later layers are freed whole, the unit's own layer by its experts' part). The activation rows count
      every layer, so the row is that net amount (never below zero).
    * Without a reduce-scatter per backward (gradient accumulation, pipelines) the unsharded gradients
      accumulate in fp32 (``unsharded_accumulated_grad``) across microbatches; under a pipeline the stage
      modules also stay unsharded until the last microbatch (``set_reshard_after_backward(False)``).
    """
    total = root + sum(u[2] for u in units)
    if acc and lay.pp > 1:
        add("FSDP unsharded params (pipeline: kept between microbatches)", "working", "FBE", pb * total,
            "PipelineStage turns resharding after backward off until the last microbatch")
    else:
        add("FSDP unsharded params: root", "working", "FB", pb * root,
            "all-gathered embedding/head/final norm, kept from forward until the root's post-backward")
    if acc:
        add("FSDP unsharded fp32 gradient accumulators", "gradients", "FBE" if lay.pp > 1 else "FB", 4 * total,
            "gradient sync off between microbatches: unsharded gradients accumulate in fp32 (reduce dtype)")
    best_total, which_best = 0.0, None
    for j, (kind, li, n_params, group) in enumerate(units):
        if acc:
            rs = 4 * n_params          # the accumulator (counted above) is freed after the copy into the input
        else:
            rs = 4 * n_params + max(pb * n_params, 4 * n_params / group)
        before = sum(4 * u[2] / u[3] for u in units[j + 1:]) if not acc else 0.0
        gone = 0.0
        if freed:
            gone = sum(freed[x][0] for x in freed if x > li or x == -1) + (
                freed[li][1] if kind == "experts" else freed[li][0])
        gathered = 0.0
        if not (acc and lay.pp > 1):
            if kind == "experts":
                gathered += pb * units[j - 1][2]            # the rest of its layer
            prev = [u for u in units[:j] if u[0] == "dense" and u[1] < li]
            if prev:
                gathered += pb * prev[-1][2]                # the previous layer, prefetched
        if which_best is None or rs + before + gathered - gone > best_total:
            best_total, which_best = rs + before + gathered - gone, (rs, before, gathered, gone, (kind, li))
    rs, before, gathered, gone, which = which_best if which_best else (0.0, 0.0, 0.0, 0.0, None)
    if which is not None and not (acc and lay.pp > 1):  # a pipeline reduces only after its last microbatch (E)
        add("FSDP unsharded params: layers", "working", "B", gathered,
            "during the largest unit's reduce-scatter: the rest of its layer and the prefetched previous layer")
        add("FSDP gradient reduce-scatter (largest unit)", "working", "B", max(0.0, rs + before - gone) + pb * head,
            f"layer {which[1]} {which[0]}: fp32 reduce-scatter input + the unsharded gradient / output shard"
            + ("; shards of the units reduced before it" if before else "")
            + (f"; net of {gone / GIB:.3f} GiB of activations already freed" if gone else "")
            + ("; the head's gradient waiting for the root" if head else ""))
    n_root = lay.dp * lay.cp
    if acc and lay.pp > 1:
        e_bytes = 4 * max([root] + [u[2] for u in units])
        enote = ("end of the pipeline's backward: fp32 reduce-scatter input of the largest unit while the other "
                 "accumulators and unsharded params are still alive (an upper bound)")
    elif acc:
        e_bytes = 4 * root + max(4 * root, 4 * root / n_root) - 4 * root / n_root
        enote = "backward end: the root's fp32 accumulator + its reduce-scatter input, net of its shard"
    else:
        e_bytes = 4 * root + max(pb * root, 4 * root / n_root) - 4 * root / n_root
        enote = ("backward end: the root's fp32 reduce-scatter input + its unsharded gradient, net of its shard "
                 "(counted under grads); the root's parameters are resharded first")
    add("FSDP root gradient reduce buffers", "working", "E", e_bytes, enote)


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
    # autocast: a weight's gradient arrives in bf16 and is cast to fp32 before it is accumulated into the
    # fp32 .grad: 2 + 4 bytes per element of the largest matmul weight of the layer
    wgrad = 6.0 * max(_attention_matrices(c) + ([d * c["d_ff"]] if layer < c["first_k_dense"] else
                                                [d * c["moe_d_ff"] * c["n_shared_experts"]])) / lay.tp \
        if autocast(lay) else 0.0
    if layer < c["first_k_dense"]:
        return max(attn, a * t * (3 * c["d_ff"] + d), wgrad)
    rows = t * c["top_k"] * (lay.moe_imbalance if lay.ep > 1 else 1.0)
    if padded_buffer(lay):
        rows = moe_buffer_rows(c, lay)
    if autocast(lay):
        # the w13 copy's bf16 gradient, its fp32 cast and w2's pending bf16 gradient, after both copies
        # (counted in the activations) were freed: net 4 bytes per element of this rank's w13
        wgrad = max(wgrad, 4.0 * c["n_routed_experts"] / lay.ep * 2 * c["moe_d_ff"] * d)
    # d(w13 out) [2F] + d(product) [F] + d(input), while the combine's saved rows (freed when the layer's backward
    # began, before its experts') are gone
    return max(attn, a * rows * (d + 3 * c["moe_d_ff"]) - combine_saved(c, lay), wgrad)


def _attention_matrices(c: dict) -> list[int]:
    """Element counts of the attention block's weight matrices (layers.py)."""
    d, H = c["d_model"], c["n_heads"]
    if c["attn_type"] == "mla":
        qd = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        qr, kvr = c["q_lora_rank"], c["kv_lora_rank"]
        q = [d * qr, qr * H * qd] if qr else [d * H * qd]
        return q + [d * (kvr + c["qk_rope_head_dim"]), kvr * H * (c["qk_nope_head_dim"] + c["v_head_dim"]),
                    H * c["v_head_dim"] * d]
    hd = c["head_dim"] or d // H
    kv = c["n_kv_heads"] or H
    return [d * H * hd, d * kv * hd, d * kv * hd, H * hd * d]



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
            "in_flight": max(sum(comp.values()) for _, comp in backward_moments(lay, s)) / len(rank_stages(lay, s))}
    return MemoryProjection(lay, df.reset_index(drop=True), float(peak), s, phase, pd.DataFrame(srows), info)


def compare_ranks(c: dict, lay: Layout, measured: Iterable[int | float]) -> pd.DataFrame:
    """Projected vs measured peak per global rank (a manifest's ``metrics.peak_memory_bytes``, one per rank).

    Global rank g holds pipeline rank ``g // (world / pp)`` (the trainer's mesh puts the pipeline dimension
    outermost). Columns: rank, pp_rank, projected_bytes, projected_gib, moment, measured_bytes,
    measured_gib, ratio (projected / measured).
    """
    per_pp: dict[int, MemoryProjection] = {}
    rows = []
    for g, meas in enumerate(measured):
        pr = g // (lay.world // lay.pp)
        if pr not in per_pp:
            per_pp[pr] = project(c, lay, stage=pr)
        p = per_pp[pr]
        rows.append({"rank": g, "pp_rank": pr, "projected_bytes": p.peak_bytes, "projected_gib": p.peak_bytes / GIB,
                     "moment": p.phase, "measured_bytes": float(meas), "measured_gib": float(meas) / GIB,
                     "ratio": p.peak_bytes / float(meas) if meas else float("nan")})
    return pd.DataFrame(rows, columns=["rank", "pp_rank", "projected_bytes", "projected_gib", "moment",
                                       "measured_bytes", "measured_gib", "ratio"])


MOMENTS = {"F": "forward end", "B": "backward", "E": "backward end", "S": "optimizer step"}


def _phase_totals(rows: list[dict]) -> dict[str, float]:
    """Bytes alive at each moment of a step: a row counts where its ``phase`` string holds the moment's
    letter (F forward end, B backward of the largest layer, E backward end, S optimizer step)."""
    return {m: sum(r["bytes"] for r in rows if m in r["phase"]) for m in MOMENTS}


# --------------------------------------------------------------------------- communication volume


def dp_collectives(c: dict, lay: Layout) -> list[dict]:
    """The data-parallel collectives of one GPU per optimizer step (the busiest pipeline stage's parameters), one
    entry per kind and group: ``part`` (dense / experts), ``family`` (all_gather, reduce_scatter, all_reduce),
    ``group`` (ranks), ``stride`` (rank distance between members: dense parameters over the ``dp*cp`` ranks of a
    stage, consecutive; experts over the ``edp`` ranks holding the same experts, ``ep`` apart), ``units`` (FSDP units
    or layers it is issued per), ``buffer_bytes`` (the whole unsharded buffer of all units: gathered parameters,
    reduced gradients) and ``count`` (times per step). ZeRO-3 all-gathers the parameters in forward and backward per
    microbatch (working dtype) and reduce-scatters fp32 gradients once; ZeRO-1/2 reduce-scatter fp32 gradients and
    all-gather the parameters; ZeRO-0 all-reduces fp32 gradients. Groups of one rank send nothing and are left out."""
    pb = 2 if lay.dtype == "bf16" else 4
    m = lay.microbatches
    stage = max(range(lay.pp), key=lambda s: len(_rank_pieces(c, lay, s)[0]))
    layers = _rank_pieces(c, lay, stage)[0]
    n_moe = sum(1 for li in layers if li >= c["first_k_dense"])
    dense_gpu, expert_gpu, _ = _per_gpu_params(c, lay, stage)
    out = []
    for part, n_params, group, stride, units in (("dense", dense_gpu, lay.dp * lay.cp, 1, max(len(layers), 1)),
                                                 ("experts", expert_gpu, lay.edp, lay.ep, max(n_moe, 1))):
        if group <= 1 or n_params <= 0:
            continue
        if lay.zero == 3:
            kinds = (("all_gather", n_params * pb, 2 * m), ("reduce_scatter", n_params * 4, 1))
        elif lay.zero in (1, 2):
            kinds = (("reduce_scatter", n_params * 4, 1), ("all_gather", n_params * pb, 1))
        else:
            kinds = (("all_reduce", n_params * 4, 1),)
        for family, nbytes, count in kinds:
            out.append({"part": part, "family": family, "group": group, "stride": stride, "units": units,
                        "buffer_bytes": float(nbytes), "count": count})
    return out


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
    stage = max(range(lay.pp), key=lambda s: len(_rank_pieces(c, lay, s)[0]))
    layers = _rank_pieces(c, lay, stage)[0]
    n_moe = sum(1 for li in layers if li >= c["first_k_dense"])
    out = {}
    if lay.ep > 1:
        rows = moe_buffer_rows(c, lay)
        out["ep_all_to_all"] = 4 * n_moe * m * rows * d * a * (lay.ep - 1) / lay.ep
    else:
        out["ep_all_to_all"] = 0.0

    def share(n):
        return (n - 1) / n if n > 1 else 0.0

    out["dp"] = sum(share(x["group"]) * x["buffer_bytes"] * x["count"] * (2 if x["family"] == "all_reduce" else 1)
                    for x in dp_collectives(c, lay))
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
    n = int(float(m.group(1)) * mult)
    if n < 1:  # "0": nothing fits a device of no memory, a verdict on a typo
        raise TraceError(None, f"memory: device memory {text!r} is not a size above 0 bytes")
    return n


def device_memory(name: str) -> int:
    """Memory bytes of a device by name (H100, H200, B200, A100, MI300X...; `moespec.devices.device_memory`)."""
    nbytes = _devices.device_memory(name)
    if nbytes is None:
        raise TraceError(None, f"memory: unknown device {name!r} (known: {', '.join(_devices.memory_names())}); "
                         "give --device-memory instead")
    return nbytes


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
          space: SweepSpace = SweepSpace(), headroom: float = 0.05, top: int | None = None,
          progress: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Enumerate layouts valid for ``world`` GPUs and the model, keep those whose projected peak fits
    ``device_bytes * (1 - headroom)``, rank them by the theoretical bubble (bubble.py) and then by the
    communication volume per step. ``global_batch`` is in sequences; GA = global_batch / (mbs * dp).

    Returns one row per fitting layout (best first) with its knobs, peak, bubble and communication.
    ``progress(done, total)`` is called as each (pp, tp, cp) combination starts and once at the end
    (the CLI's progress bar).
    """
    if global_batch < 1:
        raise TraceError(None, f"memory: global batch must be >= 1, got {global_batch}")
    base = base or resolve_layout(c, world=world)
    limit = device_bytes * (1 - headroom)
    E, L = c["n_routed_experts"], c["n_layers"]
    pps = space.pp or tuple(p for p in _divisors(world) if p <= min(L, space.max_pp))
    rows = []
    rejected = {"batch": 0, "rules": 0, "memory": 0}  # layouts enumerated and not kept, by why (`why_none_fit`)
    outer = list(itertools.product(pps, space.tp, space.cp))
    for done, (pp, tp, cp) in enumerate(outer):
        if progress is not None:
            progress(done, len(outer))
        if world % (pp * tp * cp):
            continue
        stage_ranks = world // pp
        eps = space.ep or tuple(e for e in _divisors(E) if stage_ranks % e == 0)
        for vpp, ep, mbs, rc in itertools.product(space.vpp if pp > 1 else (1,), eps, space.mbs, space.recompute):
            dp = world // (pp * tp * cp)
            if global_batch % (mbs * dp):
                rejected["batch"] += 1
                continue
            m = global_batch // (mbs * dp)
            if pp > 1 and m < pp:
                rejected["batch"] += 1
                continue
            sched = "vpp" if vpp > 1 else ("1f1b" if base.schedule == "vpp" else base.schedule)
            lay = replace(base, pp=pp, vpp=vpp, tp=tp, cp=cp, ep=ep, mbs=mbs, microbatches=m, schedule=sched,
                          recompute=rc)
            try:
                check_layout(c, lay)
            except TraceError:
                rejected["rules"] += 1
                continue
            proj = _peak_only(c, lay, limit)
            if proj > limit:
                rejected["memory"] += 1
                continue
            b = _bubble.bubble_ratio(sched, pp, m, vpp) if pp > 1 else 0.0
            comm = comm_volume(c, lay)
            rows.append({"label": lay.label(), "pp": pp, "vpp": vpp, "tp": tp, "cp": cp, "ep": ep, "dp": dp,
                         "mbs": mbs, "microbatches": m, "recompute": rc, "schedule": sched,
                         "peak_bytes": proj, "peak_gib": proj / GIB, "bubble": 0.0 if math.isnan(b) else b,
                         "comm_bytes": comm["total"], "comm_gib": comm["total"] / GIB,
                         **{f"comm_{k}_gib": v / GIB for k, v in comm.items() if k != "total"}})
    if progress is not None:
        progress(len(outer), len(outer))
    df = pd.DataFrame(rows, columns=SWEEP_COLUMNS if not rows else None)
    df.attrs["rejected"] = rejected
    if df.empty:
        return df
    df = df.sort_values(["bubble", "comm_bytes", "peak_bytes"], kind="mergesort").reset_index(drop=True)
    return df.head(top) if top else df


def why_none_fit(df: pd.DataFrame, world: int, global_batch: int, limit_gib: float) -> str:
    """Why a sweep kept no layout, from its counts of the layouts it enumerated and refused (`sweep`)."""
    r = df.attrs.get("rejected") or {}
    n = sum(r.values())
    if not n:
        return f"no layout of {world} GPUs was enumerated"
    parts = [f"{r['batch']} do not split the global batch of {global_batch} sequences (dp x mbs x micro-batches, "
             "and at least pp micro-batches)" if r.get("batch") else "",
             f"{r['rules']} break a layout rule of the trainer or the model"
             if r.get("rules") else "",
             f"{r['memory']} are over {limit_gib:.1f} GiB" if r.get("memory") else ""]
    return f"none of the {n} layouts of {world} GPUs fits: " + "; ".join(x for x in parts if x)


SWEEP_COLUMNS = ("label", "pp", "vpp", "tp", "cp", "ep", "dp", "mbs", "microbatches", "recompute", "schedule",
                 "peak_bytes", "peak_gib", "bubble", "comm_bytes", "comm_gib")


def _peak_only(c: dict, lay: Layout, limit: float | None = None) -> float:
    """The projected peak without building tables (the sweep evaluates thousands of layouts). With ``limit``,
    the first pipeline rank found over it ends the search: the layout does not fit, whatever the others hold
    (the value returned is then that rank's peak, above ``limit``). Rank 0 is tried first: it keeps the most
    microbatches in flight: 4665 of the 4810 layouts of `memory proxy_1t --world 768 --sweep` that do not fit
    are over on it alone."""
    peaks = []
    for s in range(lay.pp):
        peaks.append(max(_phase_totals(_rows_for_stage(c, lay, s)).values()))
        if limit is not None and peaks[-1] > limit:
            break
    return max(peaks)


# ------------------------------------------------------------------------------ the `tracelens memory` view


LAYOUT_LEGEND = ("layout: pp pipeline stages, vpp virtual stages per rank, tp tensor, cp context, ep expert, "
                 "dp data parallel; mbs micro-batch size; rc recompute; then the pipeline schedule; "
                 "L<n> the trainer's sync-free level")


def layout_for(mc: ModelConfig, *, dp_mode: str | None = None, world: int | None = None, pp: int | None = None,
               vpp: int | None = None, microbatches: int | None = None, schedule: str | None = None,
               global_batch: int | None = None, sweep: bool = False, source: str | None = None,
               **kw: Any) -> tuple[dict, Layout]:
    """The config (with ``dp_mode`` applied) and the layout that `tracelens memory`'s options name.

    A run's manifest fixes its world size (unless ``dp`` is given) and, unless ``pp`` is given, its own
    pipeline: stages, placement, schedule, vpp and microbatches (its stage layout only while vpp is the
    run's). ``global_batch`` (sequences) gives the microbatches as global / (mbs*dp) when they are not
    given (the sweep derives them per layout instead). ``kw``: the other `resolve_layout` keys (ep, tp,
    cp, dp, mbs, seq, recompute, sync_free_level, loss_fusion, dtype, zero). Bad values raise a one-line
    `TraceError` naming ``source`` (default: the config's)."""
    source = mc.source if source is None else source
    cfg = mc.config if dp_mode is None else {**mc.config, "dp_mode": dp_mode}
    if world is None:  # (not `world or`: --world 0 is a bad value, never "the default")
        world = mc.world if kw.get("dp") is None else None
    run_layout = mc.layout_kwargs() if pp is None else {}
    if run_layout:
        vpp = vpp if vpp is not None else run_layout["vpp"]
        schedule = schedule or run_layout["schedule"]
        microbatches = microbatches if microbatches is not None else run_layout["microbatches"]
        pp = run_layout["pp"]
        run_layout = {k: run_layout[k] for k in ("stage_layers", "stage_to_rank")} if vpp == run_layout["vpp"] else {}
    if global_batch is not None and global_batch < 1:
        raise TraceError(None, f"memory: global batch must be >= 1, got {global_batch}")
    if global_batch is not None and microbatches is None and not sweep:
        shape = {k: kw.get(k) for k in ("tp", "cp", "dp", "ep", "mbs")}
        lay0 = resolve_layout(cfg, world=world, source=source, pp=pp, vpp=vpp, **shape)
        if global_batch % (lay0.mbs * lay0.dp):
            raise TraceError(None, f"memory: global batch {global_batch} is not a multiple of mbs*dp = "
                             f"{lay0.mbs}*{lay0.dp}")
        microbatches = global_batch // (lay0.mbs * lay0.dp)
    lay = resolve_layout(cfg, world=world, source=source, pp=pp, vpp=vpp, microbatches=microbatches,
                         schedule=schedule, **kw, **run_layout)
    return cfg, lay


def capacity(device_memory_text: str | None = None, device: str | None = None) -> int | None:
    """Device memory in bytes from a size (``80GiB``) or else a device name; None when neither is given."""
    if device_memory_text:
        return parse_bytes(device_memory_text)
    return device_memory(device) if device else None


@dataclass
class MemoryReport:
    """The projection of one layout against the run's measured peak and the device: what `tracelens
    memory` prints and writes with --json. Built by :func:`memory_report`."""

    config: ModelConfig
    projection: MemoryProjection
    device_bytes: int | None = None
    headroom: float = 0.05  # share of device memory kept free when deciding what fits
    per_rank: pd.DataFrame | None = None  # compare_ranks: a pipelined run's measured peak per rank

    @property
    def fits(self) -> bool | None:
        """The projected peak fits the device with the headroom kept free (None: no device given)."""
        if self.device_bytes is None:
            return None
        return self.projection.peak_bytes <= self.device_bytes * (1 - self.headroom)

    @property
    def projections(self) -> list[MemoryProjection]:
        return [self.projection]

    def _ratio(self) -> float | None:
        mc = self.config
        return self.projection.peak_bytes / mc.measured_peak_bytes if mc.measured_peak_bytes and mc.measured_on_gpu else None

    def to_dict(self) -> dict:
        """The `tracelens memory --json` document (docs/memory.md)."""
        mc = self.config
        out = {"schema_version": SCHEMA_VERSION, "config": mc.source, **self.projection.summary()}
        if mc.measured_peak_bytes:
            out.update(measured_peak_bytes=mc.measured_peak_bytes, measured_kind=mc.measured_kind)
            if mc.measured_on_gpu:
                out["projected_over_measured"] = round(self._ratio(), 4)
                if self.per_rank is not None:
                    out["ranks"] = json.loads(self.per_rank.to_json(orient="records"))
        if self.device_bytes is not None:
            out.update(device_bytes=self.device_bytes, fits=self.fits)
        return out

    def to_text(self) -> str:
        """The `tracelens memory` text: the components, the peak, the measured peak and the fit verdict."""
        mc, p = self.config, self.projection
        lay = p.layout
        lines = [f"{mc.source}: {lay.label()}, world {lay.world}; stage {p.stage} of {lay.pp} "
                 f"({p.info['in_flight']:g} microbatch(es) in flight)",
                 f"{'component':<52} {'phase':<7} {'GiB':>9}  in peak"]
        for r in p.table.itertuples(index=False):
            lines.append(f"{r.component:<52} {r.phase:<7} {r.bytes / GIB:>9.3f}  {'*' if r.in_peak else ''}")
        lines.append("phase: the moments of a step a component is alive at ("
                     + ", ".join(f"{k} {v}" for k, v in MOMENTS.items())
                     + "; FBES = the whole step); * = alive at the projected peak")
        lines.append(LAYOUT_LEGEND)
        lines.append(f"projected peak: {p.peak_bytes / GIB:.2f} GiB ({p.phase} phase)")
        if mc.measured_peak_bytes and not mc.measured_on_gpu:  # e.g. a CPU run's process RSS: not comparable
            lines.append(f"measured peak ({mc.measured_kind}): {mc.measured_peak_bytes / GIB:.2f} GiB, a host "
                         "process's memory (interpreter and libraries included), not a GPU's allocations: "
                         "not compared with the projection")
        elif mc.measured_peak_bytes:
            lines.append(f"measured peak ({mc.measured_kind}): {mc.measured_peak_bytes / GIB:.2f} GiB; "
                         f"projected / measured = {self._ratio():.3f}")
            for r in (self.per_rank.itertuples(index=False) if self.per_rank is not None else ()):
                lines.append(f"  rank {r.rank} (pipeline rank {r.pp_rank}): projected {r.projected_gib:.2f} GiB "
                             f"({r.moment}), measured {r.measured_gib:.2f} GiB, ratio {r.ratio:.3f}")
        if self.device_bytes is not None:
            lines.append(f"{'fits' if self.fits else 'does NOT fit'} {self.device_bytes / GIB:.1f} GiB "
                         f"(headroom {100 * self.headroom:.0f}%)")
        return "\n".join(lines)


def memory_report(mc: ModelConfig, cfg: dict, lay: Layout, device_bytes: int | None = None,
                  headroom: float = 0.05) -> MemoryReport:
    """Project ``lay`` (from :func:`layout_for`); a pipelined run measured on GPUs is compared rank by rank
    (pipeline ranks hold different stages)."""
    per_rank = None
    if mc.measured_peak_bytes and mc.measured_on_gpu and lay.pp > 1 and mc.measured_peaks:
        per_rank = compare_ranks(cfg, lay, mc.measured_peaks)
    return MemoryReport(config=mc, projection=project(cfg, lay), device_bytes=device_bytes, headroom=headroom,
                        per_rank=per_rank)


@dataclass
class SweepReport:
    """The layouts of ``world`` GPUs that fit the device, best first, and the projections of the best few:
    what `tracelens memory --sweep` prints and writes with --json. Built by :func:`sweep_report`."""

    config: ModelConfig
    world: int
    device_bytes: int
    headroom: float
    global_batch: int
    fitting: pd.DataFrame  # sweep(): every fitting layout, best first
    top: int  # layouts shown and written
    projections: list[MemoryProjection]  # of the best min(top, 8)

    def to_dict(self) -> dict:
        """The `tracelens memory --sweep --json` document (docs/memory.md)."""
        return {"schema_version": SCHEMA_VERSION, "config": self.config.source, "world": self.world,
                "device_bytes": self.device_bytes, "headroom": self.headroom, "global_batch": self.global_batch,
                "fits": json.loads(self.fitting.head(self.top).to_json(orient="records")),
                "projections": [p.summary() for p in self.projections]}

    def to_text(self) -> str:
        lines = [f"{len(self.fitting)} layout(s) of {self.world} GPUs fit {self.device_bytes / GIB:.1f} GiB "
                 f"(headroom {100 * self.headroom:.0f}%), ranked by bubble then communication per step:",
                 f"{'layout':<58} {'peak GiB':>8} {'bubble':>7} {'comm GiB':>9}"]
        for r in self.fitting.head(self.top).itertuples(index=False):
            lines.append(f"{r.label:<58} {r.peak_gib:>8.2f} {100 * r.bubble:>6.1f}% {r.comm_gib:>9.2f}")
        if len(self.fitting):
            lines.append(LAYOUT_LEGEND + "; bubble: theoretical pipeline bubble of the schedule "
                         "(tracelens bubble); comm GiB: communication volume per GPU per step")
        else:
            lines.append(why_none_fit(self.fitting, self.world, self.global_batch,
                                      self.device_bytes * (1 - self.headroom) / GIB))
        return "\n".join(lines)


SWEEP_PROJECTED = 8  # the best layouts of a sweep whose full projection is kept (the report shows them)


def sweep_report(mc: ModelConfig, cfg: dict, lay: Layout, device_bytes: int, global_batch: int,
                 headroom: float = 0.05, top: int = 15,
                 progress: Callable[[int, int], None] | None = None) -> SweepReport:
    """Sweep the layouts of ``lay.world`` GPUs around ``lay`` (its sequence length, sync-free level, loss
    fusion, dtype and ZeRO level stay) and project the best min(top, 8)."""
    df = sweep(cfg, lay.world, device_bytes, global_batch, base=lay, headroom=headroom, progress=progress)
    best = [project(cfg, resolve_layout(cfg, world=lay.world, pp=r.pp, vpp=r.vpp, ep=r.ep, tp=r.tp, cp=r.cp,
                                        mbs=r.mbs, seq=lay.seq, microbatches=r.microbatches, schedule=r.schedule,
                                        recompute=r.recompute, sync_free_level=lay.sync_free_level,
                                        loss_fusion=lay.loss_fusion, dtype=lay.dtype, zero=lay.zero))
            for r in df.head(min(top, SWEEP_PROJECTED)).itertuples(index=False)]
    return SweepReport(config=mc, world=lay.world, device_bytes=device_bytes, headroom=headroom,
                       global_batch=global_batch, fitting=df, top=top, projections=best)

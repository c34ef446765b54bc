"""The trainer's configuration: defaults, YAML loading, ``key=value`` overrides and fail-fast validation.

Every knob is a flat key (so ``--set key=value`` can reach all of them). Unknown keys and inconsistent
values raise :class:`ConfigError`, whose message is one line naming the offending key. The trainer runs
on what :func:`load_config` returns, and the analyzer (memory projection, what-if, ``kernels tune
--config``) reads configs with the same function, so both agree on every default and rule. This module
imports only the standard library and PyYAML (on first use), so the launcher and the analyzer validate
without torch.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

from .backends import GROUPED_GEMM_BACKENDS
from .layout import LayoutError, resolve_layout
from .schedules import PIPELINE_SCHEDULES, SCHEDULES, SINGLE_STAGE

# The named configs (``tiny``, ``gpu_proxy``, ...) are the trainer's, shipped in its package data
# (trainer/configs/*.yaml, installed with this package by the same distribution); read as files here,
# never imported.
CONFIG_DIR = Path(__file__).parent.parent / "trainer" / "configs"


# ep_dispatch=symm: the PyTorch NVSHMEM ops' limits (torch/csrc/distributed/c10d/symm_mem/nvshmem_extension.cu:
# one 512-thread block holds the splits, in 16 tiles of a 32-lane warp scan): all_to_all_vdev_2d takes at most
# 16 experts per rank, all_to_all_vdev_2d_offset at most 16 ranks
SYMM_MAX_EP = 16
SYMM_MAX_LOCAL_EXPERTS = 16


class ConfigError(ValueError):
    """A bad configuration value. ``key`` names the offending key; ``str(err)`` is one line."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config error: {key}: {message}")


# key -> default. Grouped only by comment; the manifest records the full resolved dict.
DEFAULTS: dict[str, Any] = {
    # ---- model ----
    "vocab_size": 512,
    "d_model": 64,
    "n_layers": 3,
    "n_heads": 4,
    "n_kv_heads": None,          # None -> n_heads (MHA); fewer -> GQA
    "head_dim": None,            # None -> d_model // n_heads
    "attn_type": "gqa",          # gqa (MHA/GQA) | mla (DeepSeek multi-head latent attention)
    "q_lora_rank": None,         # MLA: None -> full-rank q projection
    "kv_lora_rank": 32,          # MLA
    "qk_nope_head_dim": 16,      # MLA
    "qk_rope_head_dim": 8,       # MLA
    "v_head_dim": 16,            # MLA
    "d_ff": 128,                 # dense FFN intermediate size (first_k_dense layers)
    "moe_d_ff": 32,              # per-expert intermediate size
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "top_k": 2,
    "score_func": "softmax",     # softmax | sigmoid
    "n_group": 1,                # group-limited routing: experts split in n_group groups
    "topk_group": 1,             # ... and tokens pick experts only from the best topk_group groups
    "norm_topk_prob": False,     # renormalise the top-k weights to sum to 1 (always done for sigmoid)
    "routed_scaling_factor": 1.0,
    "aux_loss_coef": 0.01,       # load-balancing loss weight (0 disables)
    "router_bias_update_rate": 0.0,  # DeepSeek-V3 auxiliary-loss-free balancing: bias step per update (0 = off)
    "first_k_dense": 1,          # the first k layers use a dense FFN instead of MoE
    "tie_embeddings": False,
    "rms_eps": 1e-6,
    "rope_theta": 10000.0,
    "init_std": 0.02,
    # ---- training ----
    "seq_len": 64,
    "micro_batch_size": 2,
    "steps": 10,
    "lr": 3e-3,
    "min_lr_ratio": 0.1,
    "warmup_steps": 2,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "optimizer": "adamw",        # adamw (torch's default: foreach kernels on CUDA) | adamw_fused (one fused kernel
                                 # per parameter group; CUDA only, falls back to foreach on CPU, logged)
    "grad_clip": 1.0,
    "seed": 1234,
    "dtype": "fp32",             # fp32 | bf16 (bf16: FSDP2 mixed precision or autocast under DDP)
    "device": "auto",            # auto | cpu | cuda
    "log_every": 1,
    "timing_warmup_steps": 1,    # steps excluded from tokens/s and MFU
    "step_timing": "sync",       # sync (torch.cuda.synchronize after every step) | events (CUDA events, read only
                                 # where a value is logged and at the end: the host runs ahead; CPU: wall clock)
    "compile": "none",           # none | dense (torch.compile of each block's attention, norms, rotary and dense /
                                 # shared-expert SwiGLU; MoE routing, permutation, dispatch and experts stay eager)
    "cuda_graphs": "off",        # off | on (the compiled dense regions as CUDA graphs, torch.compile
                                 # mode=reduce-overhead; needs CUDA, compile=dense, sync_free_level 3, pp 1)
    # ---- parallelism ----
    "dp": None,                  # None -> world_size // ep
    "ep": 1,
    "dp_mode": "fsdp",           # fsdp (FSDP2 fully_shard) | ddp
    # ---- expert parallelism (ep > 1; docs/trainer.md "Expert parallelism") ----
    "ep_dispatch": "nccl",       # nccl (exact splits at levels 0-1, the worst-case buffer at 2-3) | capacity
                                 # (a static per-peer capacity: rows beyond it are dropped and counted) | symm
                                 # (the capacity rule, only routed rows sent over NVSHMEM symmetric memory)
    "ep_capacity_factor": 1.25,  # capacity, symm: rows per peer = ceil(factor * tokens * top_k / ep), per chunk
    "ep_capacity_fused": True,   # capacity: the send buffer in one gather from the tokens, the return in one
                                 # gather-reduce into them (false: the unfused row moves, for comparison)
    "ep_overlap": False,         # chunked dispatch: a chunk's rows travel while another chunk's experts (or
                                 # the shared expert) compute
    "ep_overlap_chunks": 2,      # chunks of tokens per micro-batch when ep_overlap is on
    "ep_overlap_schedule": "chunked",  # with ep_overlap: chunked (the shared expert while the rows go out) |
                                 # pipelined (the shared expert split over both ends of the chunk chain)
    "ep_placement": "contiguous",  # contiguous (rank p holds experts [p*El, (p+1)*El)) | balanced (per MoE layer,
                                 # El experts per rank chosen so the expected rank loads are even; moespec/placement.py)
    "ep_placement_loads": None,  # balanced: the routing.json of an earlier run of this model (the expected loads)
    # ---- pipeline parallelism (docs/pipeline.md) ----
    "pp": 1,                     # pipeline ranks; world = pp * dp * ep
    "vpp": 1,                    # virtual stages per pipeline rank (interleaved / zero-bubble schedules)
    "pipeline_schedule": "1f1b",  # gpipe | 1f1b | vpp | looped_bfs | zb1p | zbv | dualpipev
    "pipeline_layout": None,     # Megatron layout string ("Et|tt|tt|tL"), "uniform", or null/"auto" (balanced)
    "pipeline_layer_costs": None,  # auto layout: per-layer costs (e.g. measured ms), null = FLOP model
    "microbatches": 1,           # micro-batches per optimizer step per data-parallel replica (grad accumulation)
    # ---- MoE toggles ----
    "sync_free_level": 0,        # 0..3, see docs/trainer.md
    "grouped_gemm_backend": "loop",  # loop | multistream | torch | triton | auto (tuned per pass, docs/kernels.md)
    "multistream_num_streams": 4,
    "grouped_gemm_align": 0,     # torch/triton: pad each expert's rows to a multiple of this (0/1 = off)
    "expert_swiglu": "torch",    # torch (silu(gate) * up: 2 kernels forward, 4 backward) | triton (kernels.swiglu:
                                 # one fused kernel each way, silu(gate) not kept; CUDA, or CPU under TRITON_INTERPRET=1)
    "recompute_layer_ids": [],   # activation checkpointing of these layer indices
    "loss_fusion": False,        # chunked cross-entropy, never materialises full fp32 logits
    "loss_chunk_size": 1024,     # tokens per chunk when loss_fusion is on
    "use_triton_kernels": False,  # fused router, sync-free permute/unpermute, fused CE from kernels/ where they apply
    "manual_gc": 0,              # 0: Python GC as usual; N>0: gc disabled, gc.collect() every N steps
    "numa_bind": False,          # pin each rank to its GPU's NUMA node when known
    "env": {},                   # extra environment knobs set before init, recorded in the manifest
    # ---- data ----
    "data": "synthetic",         # synthetic | memmap
    "data_path": None,           # memmap: flat token file
    "data_dtype": "uint16",      # memmap token dtype
    # ---- profiling ----
    "profile_step_start": 3,     # first profiled step (0-based, inclusive)
    "profile_step_end": 5,       # end of the profiled window (exclusive); <= start disables profiling
}

_LEVEL_KEYS = {"sync_free_level"}
_INT_KEYS = {"vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "moe_d_ff", "n_routed_experts",
             "n_shared_experts", "top_k", "n_group", "topk_group", "first_k_dense", "seq_len",
             "micro_batch_size", "steps", "warmup_steps", "seed", "log_every", "timing_warmup_steps",
             "ep", "sync_free_level", "multistream_num_streams", "grouped_gemm_align", "loss_chunk_size", "manual_gc",
             "profile_step_start", "profile_step_end", "kv_lora_rank", "qk_nope_head_dim",
             "qk_rope_head_dim", "v_head_dim", "pp", "vpp", "microbatches", "ep_overlap_chunks"}
_OPT_INT_KEYS = {"n_kv_heads", "head_dim", "dp", "q_lora_rank"}
_FLOAT_KEYS = {"routed_scaling_factor", "aux_loss_coef", "router_bias_update_rate", "rms_eps", "rope_theta",
               "init_std", "lr", "min_lr_ratio", "weight_decay", "adam_beta1", "adam_beta2", "grad_clip",
               "ep_capacity_factor"}
_BOOL_KEYS = {"norm_topk_prob", "tie_embeddings", "loss_fusion", "numa_bind", "use_triton_kernels", "ep_overlap",
              "ep_capacity_fused"}
_CHOICES = {
    "attn_type": ("gqa", "mla"),
    "score_func": ("softmax", "sigmoid"),
    "dtype": ("fp32", "bf16"),
    "device": ("auto", "cpu", "cuda"),
    "dp_mode": ("fsdp", "ddp"),
    "grouped_gemm_backend": GROUPED_GEMM_BACKENDS,
    "data": ("synthetic", "memmap"),
    "data_dtype": ("uint16", "uint32", "int32", "int64"),
    "pipeline_schedule": PIPELINE_SCHEDULES,
    "optimizer": ("adamw", "adamw_fused"),
    "step_timing": ("sync", "events"),
    "compile": ("none", "dense"),
    "cuda_graphs": ("off", "on"),
    "expert_swiglu": ("torch", "triton"),
    "ep_dispatch": ("nccl", "capacity", "symm"),
    "ep_overlap_schedule": ("chunked", "pipelined"),
    "ep_placement": ("contiguous", "balanced"),
}

# Bounds (docs/trainer.md "Bounds"): every integer key is in [0, MAX_INT] (seed: [0, MAX_SEED]); the ones below
# also have a floor of 1 or a tighter ceiling. Far above any real model, they turn an impossible value into one
# line instead of a multi-terabyte allocation or a hang.
MAX_INT = 2**31 - 1
MAX_SEED = 2**63 - 1
_INT_MAX = {"vocab_size": 2**24, "seq_len": 2**24, "n_layers": 100_000}
MAX_TOKENS_PER_STEP = 2**28  # microbatches * micro_batch_size * seq_len per replica (the step's token array)
# Float keys: (lowest, highest, lowest allowed?) beyond "finite".
_FLOAT_RANGES = {
    "lr": (0.0, None, True), "min_lr_ratio": (0.0, 1.0, True), "weight_decay": (0.0, None, True),
    "adam_beta1": (0.0, 1.0, True), "adam_beta2": (0.0, 1.0, True), "grad_clip": (0.0, None, True),
    "aux_loss_coef": (0.0, None, True), "routed_scaling_factor": (0.0, None, False), "rms_eps": (0.0, None, False),
    "rope_theta": (0.0, None, False), "init_std": (0.0, None, True),
    "ep_capacity_factor": (0.0, 1e6, False),
    "router_bias_update_rate": (0.0, 1.0, True),
}
MAX_CONFIG_BYTES = 1 << 20

# Keys that also get a dedicated CLI flag (``--sync-free-level 2`` == ``--set sync_free_level=2``).
CLI_FLAG_KEYS = ("sync_free_level", "grouped_gemm_backend", "recompute_layer_ids", "loss_fusion",
                 "manual_gc", "numa_bind", "steps", "ep", "dp", "dp_mode", "dtype", "device",
                 "profile_step_start", "profile_step_end", "pp", "vpp", "pipeline_schedule", "pipeline_layout",
                 "microbatches", "optimizer", "step_timing", "compile", "cuda_graphs", "expert_swiglu",
                 "ep_dispatch", "ep_capacity_factor", "ep_overlap")


def _parse_value(text: str, key: str = "config", where: str = "") -> Any:
    """Plain YAML (no ``!!python`` tags) with aliases' expansion bounded (moespec.yaml_bounded), every
    failure a one-line ConfigError."""
    import yaml

    from moespec.yaml_bounded import safe_load

    try:
        return safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(key, f"{where}{_yaml_problem(err)}") from None
    except RecursionError:
        raise ConfigError(key, f"{where}YAML nested too deeply") from None


def _yaml_problem(err) -> str:
    problem = " ".join(str(getattr(err, "problem", None) or err).split())
    if "constructor for the tag" in problem:
        tag = problem.split("tag", 1)[1].strip(" '").replace("tag:yaml.org,2002:", "!!")
        problem = f"YAML tag {tag} is not allowed (plain YAML values only)"
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"invalid YAML: {where}{problem}"[:300]


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(item, "override must look like key=value")
    key, _, value = item.partition("=")
    return key.strip(), _parse_value(value, key.strip() or "config")


def _read_yaml_file(p: Path) -> Any:
    """A config file's YAML, bounded: a regular file of at most MAX_CONFIG_BYTES of UTF-8 text."""
    try:
        if not p.is_file():
            raise ConfigError("config", f"{p}: not a regular file")
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError("config", f"{p}: {size} bytes is too large for a config (at most {MAX_CONFIG_BYTES})")
        raw = p.read_bytes()[:MAX_CONFIG_BYTES + 1]
    except OSError as err:
        raise ConfigError("config", f"{p}: cannot read ({err.strerror or err})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("config", f"{p}: not a UTF-8 text file (byte {err.start}): a YAML config was expected") from None
    return _parse_value(text, "config", f"{p}: ")


def resolve_config_path(name: str | Path) -> Path:
    p = Path(name)
    if p.exists():
        return p
    for cand in (CONFIG_DIR / p.name, CONFIG_DIR / f"{p.name}.yaml"):
        if cand.exists():
            return cand
    raise ConfigError("config", f"file not found: {name}")


MAX_EXTENDS = 8  # files in one ``extends`` chain


def _config_layers(p: Path) -> list[dict]:
    """The mappings to merge for config file ``p``, the base first: a file may start with ``extends: NAME``
    (another config: a path next to the file, or a name under trainer/configs/) and then sets only what
    differs from it. A cycle or a chain longer than MAX_EXTENDS is a one-line error."""
    layers: list[dict] = []
    chain: list[Path] = []
    while True:
        if p.resolve() in chain:
            raise ConfigError("extends", f"{p}: the extends chain returns to this file "
                                         f"({' -> '.join(c.name for c in chain + [p.resolve()])})")
        if len(chain) >= MAX_EXTENDS:
            raise ConfigError("extends", f"{p}: more than {MAX_EXTENDS} files in the extends chain")
        chain.append(p.resolve())
        data = _read_yaml_file(p)
        if data is None:  # an empty file (only comments): no keys; `[]`, `0` or `false` are not a config
            data = {}
        if not isinstance(data, dict):
            raise ConfigError("config", f"{p} must hold a mapping")
        data = dict(data)
        parent = data.pop("extends", None)
        layers.append(data)
        if parent is None:
            return layers[::-1]
        if not isinstance(parent, str) or not parent.strip():
            raise ConfigError("extends", f"{p}: expected the name or path of another config, got {_short(parent)}")
        near = [p.parent / parent, p.parent / f"{parent}.yaml"]
        p = next((c for c in near if c.is_file()), None) or resolve_config_path(parent)


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> dict:
    """Defaults <- YAML file (after the files it ``extends``) <- overrides, then type/consistency checks (not
    the world size)."""
    cfg = copy.deepcopy(DEFAULTS)
    if path is not None:
        for data in _config_layers(resolve_config_path(path)):
            _merge(cfg, data)
    if overrides:
        items = overrides.items() if isinstance(overrides, dict) else (parse_override(o) for o in overrides)
        _merge(cfg, dict(items))
    validate(cfg)
    return cfg


def _merge(cfg: dict, data: dict) -> None:
    for key, value in data.items():
        if not isinstance(key, str) or key not in DEFAULTS:
            raise ConfigError(str(key)[:80], "unknown config key")
        cfg[key] = value


# off|on keys: YAML 1.1 reads a bare on/off (``--set cuda_graphs=on``) as a boolean; taken as the word
_ON_OFF_KEYS = {"cuda_graphs"}


def _check_type(cfg: dict, key: str) -> None:
    v = cfg[key]
    if key in _ON_OFF_KEYS and isinstance(v, bool):
        v = cfg[key] = "on" if v else "off"
    if key in _INT_KEYS and (not isinstance(v, int) or isinstance(v, bool)):
        raise ConfigError(key, f"expected an integer, got {_short(v)}")
    if key in _OPT_INT_KEYS and v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise ConfigError(key, f"expected an integer or null, got {_short(v)}")
    if (key in _INT_KEYS or key in _OPT_INT_KEYS) and v is not None:
        lo = 1 if key in _OPT_INT_KEYS else 0
        hi = MAX_SEED if key == "seed" else _INT_MAX.get(key, MAX_INT)
        if not lo <= v <= hi:
            raise ConfigError(key, f"must be between {lo} and {hi}, got {_short(v)}")
    if key in _FLOAT_KEYS:
        if isinstance(v, str):  # YAML 1.1 reads "1e-2" as a string
            try:
                v = float(v)
            except ValueError:
                pass
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(key, f"expected a number, got {_short(v)}")
        try:
            v = float(v)
        except OverflowError:
            v = math.inf
        if not math.isfinite(v):
            raise ConfigError(key, f"must be a finite number, got {v!r}")
        lo, hi, lo_ok = _FLOAT_RANGES.get(key, (None, None, True))
        if lo is not None and (v < lo or (v == lo and not lo_ok)):
            raise ConfigError(key, f"must be {'>=' if lo_ok else '>'} {lo:g}, got {v!r}")
        if hi is not None and v > hi:
            raise ConfigError(key, f"must be <= {hi:g}, got {v!r}")
        cfg[key] = v
    if key in _BOOL_KEYS and not isinstance(v, bool):
        raise ConfigError(key, f"expected true/false, got {_short(v)}")
    if key in _CHOICES and (not isinstance(v, (str, int, float, type(None))) or v not in _CHOICES[key]):
        raise ConfigError(key, f"{_short(v)} is not one of {', '.join(map(str, _CHOICES[key]))}")


def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False


def _short(v: Any) -> str:
    from moespec.yaml_bounded import short_repr  # cut while built: never the repr of a whole huge value

    return short_repr(v, 80)


def validate(cfg: dict) -> None:
    for key in DEFAULTS:
        _check_type(cfg, key)
    E, k = cfg["n_routed_experts"], cfg["top_k"]
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len", "micro_batch_size", "ep",
                "n_routed_experts", "top_k", "n_group", "topk_group", "moe_d_ff", "d_ff"):
        if cfg[key] < 1:
            raise ConfigError(key, f"must be >= 1, got {cfg[key]}")
    if cfg["steps"] < 0:
        raise ConfigError("steps", "must be >= 0")
    if k > E:
        raise ConfigError("top_k", f"top_k={k} exceeds n_routed_experts={E}")
    if E % cfg["ep"]:
        raise ConfigError("ep", f"n_routed_experts={E} is not divisible by ep={cfg['ep']}")
    if not 0 <= cfg["sync_free_level"] <= 3:
        raise ConfigError("sync_free_level", f"must be 0, 1, 2 or 3, got {cfg['sync_free_level']}")
    nkv = cfg["n_kv_heads"] or cfg["n_heads"]
    if cfg["n_heads"] % nkv:
        raise ConfigError("n_kv_heads", f"n_heads={cfg['n_heads']} is not divisible by n_kv_heads={nkv}")
    if cfg["head_dim"] is None and cfg["attn_type"] == "gqa" and cfg["d_model"] % cfg["n_heads"]:
        raise ConfigError("n_heads", "d_model is not divisible by n_heads (set head_dim)")
    if cfg["attn_type"] == "gqa":
        hd = cfg["head_dim"] or cfg["d_model"] // cfg["n_heads"]
        if hd % 2:
            raise ConfigError("head_dim", f"RoPE needs an even head_dim, got {hd}")
    elif cfg["qk_rope_head_dim"] % 2:
        raise ConfigError("qk_rope_head_dim", "RoPE needs an even qk_rope_head_dim")
    if E % cfg["n_group"]:
        raise ConfigError("n_group", f"n_routed_experts={E} is not divisible by n_group={cfg['n_group']}")
    if cfg["topk_group"] > cfg["n_group"]:
        raise ConfigError("topk_group", f"topk_group={cfg['topk_group']} exceeds n_group={cfg['n_group']}")
    if k > cfg["topk_group"] * (E // cfg["n_group"]):
        raise ConfigError("topk_group", f"top_k={k} exceeds the experts in topk_group groups")
    if not 0 <= cfg["first_k_dense"] <= cfg["n_layers"]:
        raise ConfigError("first_k_dense", "must be between 0 and n_layers")
    if cfg["router_bias_update_rate"] > 0 and cfg["first_k_dense"] >= cfg["n_layers"]:
        raise ConfigError("router_bias_update_rate", f"{cfg['router_bias_update_rate']} balances MoE routers, but "
                                                     f"all {cfg['n_layers']} layers are dense (first_k_dense)")
    ids = cfg["recompute_layer_ids"]
    if not isinstance(ids, list) or any(type(i) is not int or not 0 <= i < cfg["n_layers"] for i in ids):
        raise ConfigError("recompute_layer_ids",
                          f"must be a list of layer indices in [0, {cfg['n_layers']}), got {_short(ids)}")
    if len(set(ids)) != len(ids):
        raise ConfigError("recompute_layer_ids", f"lists a layer twice: {_short(ids)}")
    tokens = cfg["microbatches"] * cfg["micro_batch_size"] * cfg["seq_len"]
    if tokens > MAX_TOKENS_PER_STEP:
        raise ConfigError("micro_batch_size", f"microbatches * micro_batch_size * seq_len = {tokens} tokens per step "
                                              f"and replica is more than {MAX_TOKENS_PER_STEP}")
    if cfg["manual_gc"] < 0:
        raise ConfigError("manual_gc", "must be >= 0")
    if cfg["loss_chunk_size"] < 1:
        raise ConfigError("loss_chunk_size", "must be >= 1")
    if cfg["grouped_gemm_align"] < 0:
        raise ConfigError("grouped_gemm_align", "must be >= 0")
    if cfg["multistream_num_streams"] < 1:
        raise ConfigError("multistream_num_streams", "must be >= 1")
    if not isinstance(cfg["env"], dict) or any(
            not isinstance(k, str) or not k or "=" in k or "\0" in k
            or not isinstance(v, (str, int, float, bool)) or "\0" in str(v) for k, v in cfg["env"].items()):
        raise ConfigError("env", f"must be a mapping of environment variable -> value (scalars), got {_short(cfg['env'])}")
    if cfg["data_path"] is not None and (not isinstance(cfg["data_path"], str) or "\0" in cfg["data_path"]):
        raise ConfigError("data_path", f"expected a path or null, got {_short(cfg['data_path'])}")
    if cfg["data"] == "memmap" and not cfg["data_path"]:
        raise ConfigError("data_path", "data=memmap needs data_path")
    if cfg["profile_step_start"] < 0:
        raise ConfigError("profile_step_start", "must be >= 0")
    if cfg["dp"] is not None and cfg["dp"] < 1:
        raise ConfigError("dp", "must be >= 1")
    _validate_pipeline(cfg)
    _validate_cuda_graphs(cfg)
    _validate_ep(cfg)


def _validate_ep(cfg: dict) -> None:
    """The expert-parallel knobs act on tokens that leave their rank: with ep=1 there are none, so a
    non-default value there is a mistake, said in one line rather than ignored."""
    if cfg["ep_overlap_chunks"] < 2:
        raise ConfigError("ep_overlap_chunks", f"must be >= 2 (1 chunk is ep_overlap=false), got {cfg['ep_overlap_chunks']}")
    tokens = cfg["micro_batch_size"] * cfg["seq_len"]
    if cfg["ep_overlap"] and cfg["ep_overlap_chunks"] > tokens:
        raise ConfigError("ep_overlap_chunks", f"{cfg['ep_overlap_chunks']} chunks of a micro-batch of {tokens} tokens "
                                               "leave some chunk empty")
    if cfg["ep_overlap_schedule"] != "chunked" and not cfg["ep_overlap"]:
        raise ConfigError("ep_overlap_schedule", f"{cfg['ep_overlap_schedule']!r} schedules the chunks of ep_overlap, "
                                                 "which is off: set ep_overlap=true")
    if cfg["ep"] == 1:
        for key, default in (("ep_dispatch", "nccl"), ("ep_overlap", False), ("ep_placement", "contiguous")):
            if cfg[key] != default:
                raise ConfigError(key, f"{cfg[key]!r} needs expert parallelism (ep > 1): with ep=1 no token leaves "
                                       "its rank")
    _validate_placement(cfg)
    if cfg["ep_dispatch"] == "symm":
        _validate_symm(cfg)


def _validate_placement(cfg: dict) -> None:
    """ep_placement=balanced reads its expected loads from ep_placement_loads (the file itself is read where the
    model is built: moespec.placement.placement_plan, called by the trainer's CLI before any rank starts)."""
    path = cfg["ep_placement_loads"]
    if path is not None and (not isinstance(path, str) or not path.strip() or "\0" in path):
        raise ConfigError("ep_placement_loads", f"expected the path of a routing.json or null, got {_short(path)}")
    if cfg["ep_placement"] == "balanced" and path is None:
        raise ConfigError("ep_placement_loads", "ep_placement=balanced needs the expected expert loads: the "
                                                "routing.json of an earlier run of this model")
    if cfg["ep_placement"] != "balanced" and path is not None:
        raise ConfigError("ep_placement_loads", f"is read only by ep_placement=balanced (got "
                                                f"ep_placement={cfg['ep_placement']})")


def _validate_symm(cfg: dict) -> None:
    """ep_dispatch=symm runs PyTorch's NVSHMEM all-to-all ops: GPUs only (checked again at run time, with
    NVSHMEM and the ops, for device=auto), within the ops' limits on ranks and experts per rank."""
    if cfg["device"] == "cpu":
        raise ConfigError("ep_dispatch", "symm needs CUDA GPUs with NVSHMEM (device=cpu): on a CPU use nccl or capacity")
    if cfg["ep_overlap"]:
        raise ConfigError("ep_overlap", "true with ep_dispatch=symm is refused: on 4 x H100 the chunked NVSHMEM "
                                        "exchange hung after its first step (docs/trainer.md); use symm serial, or "
                                        "capacity with ep_overlap")
    if cfg["ep"] > SYMM_MAX_EP:
        raise ConfigError("ep_dispatch", f"symm: the NVSHMEM ops take at most {SYMM_MAX_EP} ranks per EP group, "
                                         f"got ep={cfg['ep']}")
    El = cfg["n_routed_experts"] // cfg["ep"]
    if El > SYMM_MAX_LOCAL_EXPERTS:
        raise ConfigError("ep_dispatch", f"symm: the NVSHMEM dispatch op takes at most {SYMM_MAX_LOCAL_EXPERTS} "
                                         f"experts per rank, got n_routed_experts/ep = {El}")


def _validate_cuda_graphs(cfg: dict) -> None:
    """cuda_graphs=on: graphs need static shapes and no host sync inside the step (sync_free_level 3), run
    on the compiled dense regions (compile=dense) and a GPU; the device is checked again at run time
    (device=auto on a machine without CUDA)."""
    if cfg["cuda_graphs"] != "on":
        return
    if cfg["device"] == "cpu":
        raise ConfigError("cuda_graphs", "on needs CUDA (device=cpu): CUDA graphs do not exist on a CPU")
    if cfg["sync_free_level"] != 3:
        raise ConfigError("cuda_graphs", f"on needs sync_free_level 3 (static shapes, no host sync in the step), "
                                         f"got sync_free_level={cfg['sync_free_level']}")
    if cfg["compile"] != "dense":
        raise ConfigError("cuda_graphs", "on graphs the compiled dense regions (torch.compile "
                                         "mode=reduce-overhead): set compile=dense too")
    if cfg["pp"] > 1:
        raise ConfigError("cuda_graphs", f"on is not supported with pipeline parallelism (pp={cfg['pp']})")


def _validate_pipeline(cfg: dict) -> None:
    """pp / vpp / schedule / layout / microbatches (docs/pipeline.md)."""
    pp, vpp, m, sched = cfg["pp"], cfg["vpp"], cfg["microbatches"], cfg["pipeline_schedule"]
    for key in ("pp", "vpp", "microbatches"):
        if cfg[key] < 1:
            raise ConfigError(key, f"must be >= 1, got {cfg[key]}")
    costs = cfg["pipeline_layer_costs"]
    if costs is not None and (not isinstance(costs, list) or any(
            isinstance(c, bool) or not isinstance(c, (int, float)) or not _finite(c) for c in costs)):
        raise ConfigError("pipeline_layer_costs", f"must be null or a list of numbers (finite), got {_short(costs)}")
    if pp == 1:
        for key, default in (("vpp", 1), ("pipeline_layout", None), ("pipeline_layer_costs", None)):
            if cfg[key] != default:
                raise ConfigError(key, f"needs pipeline parallelism (pp > 1), got pp=1 and {key}={_short(cfg[key])}")
        return
    spec = SCHEDULES[sched]
    if spec.single_stage and vpp != 1:
        multi = [s for s in PIPELINE_SCHEDULES if s not in SINGLE_STAGE]
        raise ConfigError("pipeline_schedule", f"{sched!r} runs one stage per rank, so vpp must be 1 (got vpp={vpp}); "
                          f"use {', '.join(multi[:-1])} or {multi[-1]} for virtual stages")
    if spec.placement == "v" and vpp != 2:
        raise ConfigError("vpp", f"pipeline_schedule={sched!r} is V-shaped: exactly 2 stages per rank, so vpp must be 2 "
                                 f"(got {vpp})")
    if cfg["tie_embeddings"]:
        raise ConfigError("tie_embeddings", "not supported with pp > 1 (embedding and LM head live on different stages)")
    if spec.split_backward and cfg["dp_mode"] != "ddp":
        raise ConfigError("dp_mode", f"pipeline_schedule={sched!r} splits the backward (B/W), which FSDP2 does not "
                                     "support here: use dp_mode=ddp (gradients are then all-reduced after the step)")
    need = 2 * pp if sched == "dualpipev" else pp
    if m < need:
        raise ConfigError("microbatches", f"microbatches={m} is fewer than the {need} pipeline stages the "
                                          f"{sched!r} schedule fills (pp={pp}{', x2 for dualpipev' if need > pp else ''})")
    if spec.rounds:
        rounds = max(1, m // pp)
        if m % rounds:
            raise ConfigError("microbatches", f"{sched!r} needs microbatches to be a multiple of "
                                              f"max(1, microbatches // pp) = {rounds}, got {m}")
    try:
        resolve_layout(cfg)
    except LayoutError as err:
        key = "pipeline_layer_costs" if "costs" in str(err) else "pipeline_layout"
        raise ConfigError(key, str(err)) from None


def resolve_world(cfg: dict, world_size: int) -> tuple[int, int]:
    """(dp, ep) for this world size; fails when pp * dp * ep != world_size."""
    ep, pp = cfg["ep"], cfg.get("pp", 1)
    dp = cfg["dp"] if cfg["dp"] is not None else world_size // (ep * pp)
    if dp * ep * pp != world_size:
        key = "dp" if cfg["dp"] is not None else ("pp" if pp > 1 else "ep")
        if cfg["dp"] is None:  # dp follows from the world: there is no whole one
            what = f"pp*ep = {pp}*{ep}" if pp > 1 else f"ep = {ep}"
            raise ConfigError(key, f"world size {world_size} is not a multiple of {what}: no whole dp "
                                   f"({'pp*dp*ep' if pp > 1 else 'dp*ep'} must be the world size)")
        if pp > 1:
            raise ConfigError(key, f"world size {world_size} != pp*dp*ep = {pp}*{dp}*{ep}")
        raise ConfigError(key, f"world size {world_size} != dp*ep = {dp}*{ep}")
    if cfg.get("ep_dispatch") == "symm" and ep != world_size:
        raise ConfigError("ep_dispatch", f"symm needs one EP group over the whole world (ep = world size = "
                                         f"{world_size}, got ep={ep}): on 4 x H100 with torch 2.11 the NVSHMEM ops "
                                         "exchanged rows with the wrong peers inside smaller EP groups (docs/trainer.md)")
    return dp, ep

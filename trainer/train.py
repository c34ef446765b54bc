"""The training loop: build, wrap, train, profile a window of steps, write the run directory."""

from __future__ import annotations


import datetime
import logging
import math
import os
import sys
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from moespec.config import ConfigError
from moespec.devices import peak_bf16_flops
from moespec.params import count_params, model_flops_per_token
from moespec.placement import placement_plan
from trainer import runtime
from trainer.compiling import compile_dense, compile_stats
from trainer.data import make_data
from trainer.model import Transformer
from trainer.model import experts
from trainer.model.balance import RouterBias, moe_layers
from trainer.parallel import Dist, init_distributed, sync_expert_grads, wrap_data_parallel
from trainer.routing_log import RoutingLog, rank_record, write_routing
from trainer.timing import StepTimer

SCHEMA_VERSION = 1
log = logging.getLogger("trainer")


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); ``str(err)`` is one line naming the step (the rank
    is added by whoever reports it: ``trainer.cli``)."""


class _LossWatch:
    """Stops the run at the first non-finite loss, without a host sync of its own: on a GPU the step's loss
    is copied into pinned memory asynchronously before the step's ``synchronize`` (which the loop does anyway
    for its step time) and read after it; on a CPU the value is read directly. ``deferred``
    (``step_timing=events`` on a GPU, no sync per step): the losses are kept on the device and checked
    together by :meth:`flush`, where the loop logs a step and at the end (a non-finite loss then stops the
    run at the next log point, naming its step)."""

    def __init__(self, device: torch.device, deferred: bool = False):
        self.deferred = deferred
        self.buf = torch.zeros((), dtype=torch.float32, pin_memory=True) if device.type == "cuda" and not deferred else None
        self.cur: torch.Tensor | None = None
        self.pending: list[tuple[int, torch.Tensor]] = []

    def post(self, loss: torch.Tensor, step: int = -1) -> None:
        if self.deferred:
            self.pending.append((step, loss.detach()))
            return
        if self.buf is not None:
            self.buf.copy_(loss.detach(), non_blocking=True)
            self.cur = self.buf
        else:
            self.cur = loss.detach()

    def check(self, step: int) -> None:
        if self.cur is None:
            return
        v = float(self.cur.float().numpy()) if self.cur.dim() == 0 else float(self.cur.float().numpy().sum())
        self._raise_if_bad(step, v)

    def flush(self) -> None:
        """Deferred mode: check every loss posted since the last flush (one device-to-host copy)."""
        if not self.pending:
            return
        vals = torch.stack([v.float().reshape(-1).sum() for _, v in self.pending]).cpu().tolist()
        steps = [s for s, _ in self.pending]
        self.pending.clear()
        for step, v in zip(steps, vals):
            self._raise_if_bad(step, v)

    @staticmethod
    def _raise_if_bad(step: int, v: float) -> None:
        if not math.isfinite(v):
            raise TrainingError(f"step {step}: the loss is {v} (non-finite): training stopped "
                                "(learning rate too high, or a bad init_std?)")


class _Notes(logging.Handler):
    """Collects the trainer's one-time notes (backend fallbacks...) for the manifest and echoes them."""

    def __init__(self, echo: bool):
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.echo = echo

    def emit(self, record):
        msg = record.getMessage()
        if msg not in self.messages:
            self.messages.append(msg)
            if self.echo:
                print(f"[trainer] note: {msg}", file=sys.stderr, flush=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def clip_grad_norm(model, max_norm: float, cfg: dict, d: Dist) -> torch.Tensor:
    """Global grad-norm clip that knows the layout: FSDP2 shards (dense over the world, experts over
    dp) or DDP replicas (dense replicated, experts split over ep). No host sync."""
    dense, expert = [], []
    for n, p in model.named_parameters():
        if p.grad is not None:
            (expert if ".experts." in n else dense).append(_local(p.grad))
    dev = d.device
    sq_dense = sum((g.float().pow(2).sum() for g in dense), torch.zeros((), device=dev))
    sq_exp = sum((g.float().pow(2).sum() for g in expert), torch.zeros((), device=dev))
    if d.world_size > 1:
        if cfg["dp_mode"] == "fsdp":
            both = torch.stack([sq_dense, sq_exp])
            dist.all_reduce(both)
            sq_dense, sq_exp = both[0], both[1]
        elif d.ep > 1:
            dist.all_reduce(sq_exp, group=d.ep_group)
        if cfg["dp_mode"] != "fsdp" and d.pp > 1:  # DDP replicas hold one stage: add up the stages
            both = torch.stack([sq_dense, sq_exp])
            dist.all_reduce(both, group=d.pp_group)
            sq_dense, sq_exp = both[0], both[1]
    norm = (sq_dense + sq_exp).sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in dense + expert:
            g.mul_(coef.to(g.dtype))
    return norm


@contextmanager
def _grad_sync(model, enabled: bool):
    """Let DDP/FSDP2 reduce gradients in this backward only when ``enabled`` (the last micro-batch)."""
    if enabled:
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def forward_backward(model, tokens, targets, cfg: dict, autocast: bool):
    """Gradient accumulation without pipelining: ``cfg['microbatches']`` micro-batches (equal row chunks
    of ``tokens``), each backpropagating ``(loss + aux_loss_coef * aux) / microbatches``, with the DP
    gradient reduction only in the last backward. Returns the mean (loss, aux) over micro-batches."""
    m = cfg["microbatches"]
    loss_sum = aux_sum = 0.0
    for i, (tk, tg) in enumerate(zip(tokens.chunk(m), targets.chunk(m))):
        with _grad_sync(model, i == m - 1):
            with torch.autocast(tk.device.type, dtype=torch.bfloat16, enabled=autocast):
                loss, aux = model(tk, tg)
                total = loss + cfg["aux_loss_coef"] * aux
            (total / m if m > 1 else total).backward()
        loss_sum = loss_sum + loss.detach().float()
        aux_sum = aux_sum + aux.detach().float()
    return loss_sum / m, aux_sum / m


def lr_at(step: int, cfg: dict) -> float:
    base, warm, total = cfg["lr"], cfg["warmup_steps"], max(cfg["steps"], 1)
    if step < warm:
        return base * (step + 1) / warm
    frac = (step - warm) / max(total - warm, 1)
    return base * (cfg["min_lr_ratio"] + (1 - cfg["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


TRACE_GZIP_LEVEL = 6  # zlib's default (the gzip tool's): ~10x less CPU than 9, files ~12 % larger


def export_gzipped(prof, path: Path) -> None:
    """The profiler's Chrome trace as gzipped JSON at ``path``: Kineto writes the JSON beside it (``.raw``), compressed
    here at ``TRACE_GZIP_LEVEL`` in 1 MiB blocks, then removed. ``export_chrome_trace`` with a ``.gz`` path
    compresses at level 9, line by line: on the CPU tests' traces (5-27 MB of JSON a rank) 0.4-3.7 s of CPU a
    rank, 10x what level 6 takes; the same JSON either way."""
    import gzip
    import shutil

    raw = path.with_suffix(".raw")  # not .gz: the profiler writes it as it is
    prof.export_chrome_trace(str(raw))
    try:
        with open(raw, "rb") as fin, gzip.open(path, "wb", compresslevel=TRACE_GZIP_LEVEL) as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
    finally:
        raw.unlink(missing_ok=True)


def _profiler(cfg: dict, d: Dist, trace_path: Path):
    start, end = cfg["profile_step_start"], min(cfg["profile_step_end"], cfg["steps"])
    if end <= start:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.device.type == "cuda" else [])
    wait, warmup = (start - 1, 1) if start >= 1 else (0, 0)

    def ready(prof):
        # written under RUN/.partial/ and renamed into traces/ when whole: a rank killed while exporting
        # leaves no truncated trace where tracelens looks
        partial = trace_path.parent.parent / runtime.PARTIAL_DIR / trace_path.name
        partial.parent.mkdir(parents=True, exist_ok=True)
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        export_gzipped(prof, partial)
        os.replace(partial, trace_path)

    return profile(activities=acts, schedule=schedule(wait=wait, warmup=warmup, active=end - start, repeat=1),
                   on_trace_ready=ready, record_shapes=True, with_flops=True, with_modules=True,
                   profile_memory=False, with_stack=False)


def train(cfg: dict, out_dir: str | Path) -> dict | None:
    """Train ``cfg['steps']`` steps; rank 0 writes ``out_dir/manifest.json``, every rank its trace.
    Returns the manifest on rank 0 (None elsewhere)."""
    out = Path(out_dir)
    notes = _Notes(echo=int(os.environ.get("RANK", 0)) == 0)
    logging.getLogger("trainer").addHandler(notes)
    try:  # the handler goes with the run, a refusal before the first step included (in-process callers call again)
        return _start(cfg, out, notes)
    finally:
        logging.getLogger("trainer").removeHandler(notes)


def _start(cfg: dict, out: Path, notes: _Notes) -> dict | None:
    env_knobs = runtime.apply_env(cfg["env"])
    d = init_distributed(cfg)
    _check_device_knobs(cfg, d.device)  # before the run dir is touched, like the config's own checks
    lock = None
    if d.rank == 0:  # a new run replaces the previous one in ``out``; the manifest says "running" until the end
        out.mkdir(parents=True, exist_ok=True)
        # one run at a time in ``out``: two at once each wrote a manifest and traces, and the last manifest
        # could describe the other run's trace (both said "complete")
        lock = runtime.lock_run_dir(out)
    free = [lock is not None]
    if d.world_size > 1:  # every rank learns it, so that all stop with the same line (no peer fails on a lost rank 0)
        dist.broadcast_object_list(free, src=0)
    if not free[0]:
        raise ConfigError("out", f"{out}: another run is writing into this run dir (it holds the dir's lock); "
                                 "wait for it to end, or choose another -o")
    try:
        if d.rank == 0:
            removed = runtime.clear_previous_run(out)  # the launcher's log is staged apart (trainer.launch)
            if removed:
                print(f"[trainer] {out}: replaced the previous run ({', '.join(removed)})", flush=True)
            # run_id: what ties the run's other files (routing.json) to this manifest
            runtime.write_json_atomic(out / "manifest.json", {**_manifest_head(cfg, d, out), "run_id": uuid.uuid4().hex,
                                                              "status": "running"})
        if d.world_size > 1:
            dist.barrier()  # no rank writes into ``out`` before the previous run is gone
        try:
            return _train(cfg, out, d, notes, env_knobs)
        except BaseException as err:
            if d.rank == 0:
                why = "interrupted" if isinstance(err, KeyboardInterrupt) else one_line(err)
                runtime.mark_failed(out, f"rank 0: {why}")
            raise
    finally:
        if lock is not None and lock >= 0:
            os.close(lock)  # releases the flock


def _check_device_knobs(cfg: dict, device: torch.device) -> None:
    """The knobs whose validity depends on the resolved device (``device: auto``): one-line ConfigErrors."""
    from trainer.compiling import compile_problem  # noqa: PLC0415

    if cfg["cuda_graphs"] == "on" and device.type != "cuda":
        raise ConfigError("cuda_graphs", f"on needs CUDA, and this run is on {device.type} (CUDA graphs do not "
                                         "exist on a CPU)")
    if cfg["compile"] == "dense":
        why = compile_problem(device)
        if why:
            raise ConfigError("compile", f"dense {why}")
    if cfg["ep_dispatch"] == "symm" and cfg["ep"] > 1:
        from trainer.model.dispatch import symm_problem

        why = symm_problem(device)
        if why:
            raise ConfigError("ep_dispatch", f"symm {why}")
    if cfg["expert_swiglu"] == "triton":
        from trainer.model.experts import swiglu_problem  # noqa: PLC0415

        why = swiglu_problem(device)
        if why:
            raise ConfigError("expert_swiglu", f"triton {why}")


def one_line(err: BaseException) -> str:
    """``Type: message`` on one line (the message of a TrainingError alone)."""
    msg = " ".join(str(err).split())
    if isinstance(err, TrainingError):
        return msg
    return f"{type(err).__name__}: {msg}"[:500] if msg else type(err).__name__


def _manifest_head(cfg: dict, d: Dist, out: Path) -> dict:
    """What the manifest says from the start (also in the ``running`` manifest of an unfinished run)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "name": out.name,
        "status": "running",
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": cfg,
        "world_size": d.world_size,
        "mesh": d.mesh_info,
        "parallel": {"dp": d.dp, "ep": d.ep, "dp_mode": cfg["dp_mode"], "launched_by_torchrun": d.launched},
    }


def _train(cfg: dict, out: Path, d: Dist, notes: _Notes, env_knobs: dict) -> dict | None:
    numa = runtime.numa_bind(d.device) if cfg["numa_bind"] else {"bound": False, "reason": "numa_bind off"}
    if cfg["numa_bind"] and not numa["bound"] and d.rank == 0:
        print(f"[trainer] numa_bind: {numa['reason']}", flush=True)
    gcm = runtime.ManualGC(cfg["manual_gc"])

    torch.manual_seed(cfg["seed"])
    # one GPU stage per rank: build and initialise the model on its GPU (seconds where the CPU's default
    # init and the copy take ~40 s for the GPU proxy); a pipeline builds the whole model and keeps its
    # stages, so it stays on the CPU until then
    on_device = d.device.type == "cuda" and d.pp == 1
    # ep_placement=balanced: which EP rank holds which expert, per MoE layer (moespec/placement.py; the CLI
    # has read the loads file once already, so a bad one never gets here)
    placement = placement_plan(cfg) if d.ep > 1 else None
    with torch.device(d.device) if on_device else nullcontext():
        model = Transformer(cfg, d.ep_group, d.ep, d.ep_rank, placement)
    model.init_weights(cfg["seed"], device=d.device if on_device else None)
    # tokens per expert of every MoE layer, kept on the device until the end (trainer/routing_log.py)
    routing = RoutingLog(model, range(cfg["profile_step_start"], min(cfg["profile_step_end"], cfg["steps"])))
    # router_bias_update_rate: each step's loads (the routing log's counters) move the routers' biases
    # (trainer/model/balance.py), summed over the ranks that hold the same layers
    balancer = RouterBias(moe_layers(model), cfg["router_bias_update_rate"], d.replica_mesh.get_group()
                          if d.replica_mesh is not None and d.world_size > 1 else None)
    if cfg["compile"] == "dense":
        compile_dense(model, cfg, d.device)  # the same Block objects end up in the pipeline stages / DP wrappers
    pipe = None
    if d.pp > 1:  # keep this rank's stages of the full model (same init as without PP), DP-wrap each
        from trainer.parallel.pipeline import build_pipeline

        pipe = build_pipeline(cfg, d, model, out)
        model = pipe.core
    else:
        model.to(d.device)
        model = wrap_data_parallel(model, cfg, d)
    experts.reset_records()
    experts.pretune_config(cfg, d.device)  # grouped_gemm_backend=auto: tune before step 0, never inside it
    core = model.module if hasattr(model, "module") else model
    opt = make_optimizer(model, cfg, d.device)
    data = make_data(cfg, d.data_rank)
    autocast = cfg["dtype"] == "bf16" and cfg["dp_mode"] == "ddp"
    log_rank = pipe.log_rank if pipe is not None else 0  # the rank that holds a loss to print

    trace_path = out / "traces" / f"rank{d.rank}.json.gz"
    prof = _profiler(cfg, d, trace_path)
    if prof is not None:
        prof.start()
    losses, auxes, gnorms = [], [], []
    timer = StepTimer(cfg["step_timing"], d.device)
    if cfg["step_timing"] == "events" and not timer.events:
        log.warning("step_timing=events: no CUDA events on %s, steps are timed by the wall clock (no sync either)",
                    d.device.type)
    if timer.events and pipe is not None:
        log.warning("step_timing=events with pp > 1: the pipeline's action recorder still waits for each step's "
                    "last action (a host sync per step)")
    watch = _LossWatch(d.device, deferred=timer.deferred)
    graphs = cfg["cuda_graphs"] == "on"
    routing.start()
    try:
        for step in range(cfg["steps"]):
            gcm.step(step)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            tokens, targets = data.batch(step)
            tokens = tokens.to(d.device, non_blocking=True)
            targets = targets.to(d.device, non_blocking=True)
            if graphs:  # a new iteration for CUDA-graph trees: the previous step's graph outputs may be reused
                torch.compiler.cudagraph_mark_step_begin()
            timer.start()
            if pipe is not None:
                loss, aux = pipe.step(step, tokens, targets)
            else:
                loss, aux = forward_backward(model, tokens, targets, cfg, autocast)
            sync_expert_grads(core, cfg, d)
            gnorms.append(clip_grad_norm(core, cfg["grad_clip"], cfg, d).detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            watch.post(loss, step)
            timer.stop()  # step_timing=sync: torch.cuda.synchronize; events: an event, no sync
            balancer.step(routing.acc)  # before end_step clears the step's counts; device work only
            routing.end_step(step)  # device work only: the counts reach the host after the loop
            watch.check(step)  # deferred (events): checked at the log points below and at the end
            if pipe is not None:
                pipe.end_step()  # after the synchronisation above: resolves CUDA event times
            losses.append(loss.detach().float())
            auxes.append(aux.detach().float())
            if prof is not None:
                prof.step()
            if d.rank == log_rank and cfg["log_every"] > 0 and (step % cfg["log_every"] == 0 or step == cfg["steps"] - 1):
                watch.flush()
                aux_txt = f"aux {aux.item():.4f}" if pipe is None else f"aux(stages {pipe.my_stages}) {aux.item():.4f}"
                print(f"[trainer] step {step} loss {loss.item():.4f} {aux_txt} "
                      f"time {timer.last() * 1e3:.1f} ms", flush=True)
        step_times = timer.finish()
        watch.flush()
    finally:
        routing.stop()
        if prof is not None:
            prof.stop()
        gcm.close()
        if pipe is not None:
            pipe.close()
    return _finish(cfg, d, out, core, losses, auxes, gnorms, step_times, trace_path if prof else None,
                   env_knobs, numa, notes.messages, pipe, timer, rank_record(routing, d),
                   balancer.summary() if balancer.active else None, placement)


def make_optimizer(model, cfg: dict, device) -> torch.optim.Optimizer:
    """AdamW as ``cfg["optimizer"]`` says: ``adamw`` is torch's default implementation (foreach kernels on
    CUDA), ``adamw_fused`` the single fused kernel per parameter group (CUDA only: on a CPU it falls back
    to the default, with a log line)."""
    kw = dict(lr=cfg["lr"], betas=(cfg["adam_beta1"], cfg["adam_beta2"]), weight_decay=cfg["weight_decay"])
    if cfg.get("optimizer", "adamw") == "adamw_fused":
        if device.type == "cuda":
            kw["fused"] = True
        else:
            logging.getLogger("trainer").warning("optimizer=adamw_fused needs CUDA: using the default AdamW on %s",
                                                 device.type)
    return torch.optim.AdamW(model.parameters(), **kw)


def _finish(cfg, d: Dist, out: Path, model, losses, auxes, gnorms, step_times, trace_path, env_knobs, numa, notes,
            pipe=None, timer: StepTimer | None = None, routing: dict | None = None, balance: dict | None = None,
            placement=None):
    n = len(losses)
    dev = d.device
    stats = torch.stack([torch.stack(losses), torch.stack(auxes)]) if n else torch.zeros(2, 0, device=dev)
    wall = timer.wall_s if timer is not None and timer.wall_s is not None else sum(step_times)
    times = torch.tensor([*step_times, wall], dtype=torch.float64, device=dev)
    peak, peak_kind = runtime.peak_memory_bytes(dev)
    drops = ep_drop_totals(model, dev)  # [dropped, routed] rows of this rank's MoE layers (device, no sync yet)
    if d.world_size > 1:
        dist.all_reduce(drops)
        dist.all_reduce(stats)
        # per data-parallel replica: under PP only the last stage has the loss and each stage a part of aux
        stats /= d.world_size // d.pp
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
        peaks = [None] * d.world_size
        dist.all_gather_object(peaks, peak)
        traces = [None] * d.world_size
        dist.all_gather_object(traces, trace_path is not None and trace_path.exists())
        routings = [None] * d.world_size
        dist.all_gather_object(routings, routing)
    else:
        peaks, traces, routings = [peak], [trace_path is not None and trace_path.exists()], [routing]
    if d.rank != 0:
        dist.barrier()
        return None
    try:  # every rank has exported its trace by now (the collectives above): drop the empty staging dir
        (out / runtime.PARTIAL_DIR).rmdir()
    except OSError:
        pass
    loss_l, aux_l = stats.tolist()
    times_l = times.tolist()
    steps_wall = times_l.pop()  # the last entry: the host's wall time of the step loop (max over ranks)
    prof_lo, prof_hi = cfg["profile_step_start"], min(cfg["profile_step_end"], cfg["steps"])
    warm = min(cfg["timing_warmup_steps"], max(n - 1, 0))
    # not timed: warm-up steps, the profiled steps, and the step right after the window (the profiler
    # stops and exports its trace there: seen on H200 as a 4x slower step)
    after = prof_hi if prof_hi > prof_lo else -1
    timed = [i for i in range(warm, n) if not (prof_lo <= i < prof_hi or i == after)] or list(range(warm, n))
    mean_t = sum(times_l[i] for i in timed) / len(timed) if timed else None
    tokens_step = d.dp * d.ep * cfg["microbatches"] * cfg["micro_batch_size"] * cfg["seq_len"]
    tokens_rank = tokens_step / d.world_size if tokens_step % d.world_size else tokens_step // d.world_size
    fpt = model_flops_per_token(cfg)
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform_cpu_name()
    peak_flops = peak_bf16_flops(dev_name) if dev.type == "cuda" else None
    tps_gpu = tokens_rank / mean_t if mean_t else None
    head = runtime.read_manifest(out) or {}
    manifest = {
        **_manifest_head(cfg, d, out),
        "run_id": head.get("run_id"),
        "status": "complete",
        "created_utc": head.get("created_utc") or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": runtime.versions(),
        "device": {"type": dev.type, "name": dev_name, "count": d.world_size, "peak_bf16_flops": peak_flops},
        "toggles": {k: cfg[k] for k in ("sync_free_level", "grouped_gemm_backend", "recompute_layer_ids", "optimizer",
                                        "loss_fusion", "manual_gc", "numa_bind", "dtype", "step_timing", "compile",
                                        "cuda_graphs", "ep_dispatch", "ep_capacity_factor", "ep_overlap",
                                        "ep_overlap_chunks", "ep_overlap_schedule", "ep_placement",
                                        "router_bias_update_rate")},
        "numa": numa,
        "env": {"knobs": env_knobs, "recorded": runtime.recorded_env()},
        "params": {**count_params(cfg), "local_routed_experts": cfg["n_routed_experts"] // d.ep},
        "metrics": {
            "steps": n,
            "tokens_per_step": tokens_step,
            "tokens_per_step_per_gpu": tokens_rank,
            "step_times_s": times_l,
            "step_timing": timer.method if timer is not None else None,  # host_sync | cuda_events | wall_clock
            "steps_wall_s": steps_wall,  # host wall time from the first step's start to the last step's end
            "timed_steps": timed,
            "mean_step_time_s": mean_t,
            "tokens_per_s": tps_gpu * d.world_size if tps_gpu else None,
            "tokens_per_s_per_gpu": tps_gpu,
            "model_flops_per_token": fpt,
            "mfu": (tps_gpu * fpt / peak_flops) if (tps_gpu and peak_flops) else None,
            "loss": loss_l,
            "aux_loss": aux_l,
            "grad_norm": torch.stack(gnorms).tolist() if gnorms else [],  # global, before clipping
            "peak_memory_bytes": peaks,
            "peak_memory_kind": peak_kind,
        },
        "profile": {"step_start": prof_lo, "step_end": prof_hi,
                    "traces": [f"traces/rank{r}.json.gz" for r, ok in enumerate(traces) if ok]},
        "notes": notes,
        "pipeline": pipe.manifest() if pipe is not None else None,  # docs/pipeline.md
        "kernels": experts.kernels_record(cfg),  # what ran each MoE op; auto's backend per pass
        "ep_dispatch": ep_dispatch_record(cfg, d, drops.tolist()),  # docs/trainer.md "Expert parallelism"
        # ep_placement: per MoE layer the experts of each EP rank, the expected rank imbalance before and after
        "ep_placement": (placement.record() if placement is not None else {"mode": "contiguous"}) if d.ep > 1 else None,
        "router_bias": balance,  # router_bias_update_rate: rank 0's final biases per MoE layer (docs/trainer.md)
        "compile": compile_stats(cfg),  # compile=dense: graphs, graph breaks, CUDA-graph skips (trainer/compiling.py)
    }
    routing_path = write_routing(out, routings, cfg, manifest, n,  # before the manifest says complete
                                 placement.record() if placement is not None else None)
    manifest["routing"] = routing_path.name if routing_path is not None else None
    runtime.write_json_atomic(out / "manifest.json", manifest)
    mt = manifest["metrics"]
    mfu = f"{100 * mt['mfu']:.1f}%" if mt["mfu"] is not None else "n/a"
    tps = f"{tps_gpu:,.0f}" if tps_gpu else "n/a"
    print(f"[trainer] wrote {out}: tokens/s/GPU {tps}, MFU {mfu}, "
          f"peak memory {max(peaks) / 2**30:.2f} GiB ({peak_kind}), final loss {loss_l[-1] if loss_l else 'n/a'}",
          flush=True)
    if d.world_size > 1:
        dist.barrier()
    return manifest


def ep_drop_totals(model, device) -> torch.Tensor:
    """[dropped, routed] rows over this rank's MoE layers and all steps (capacity dispatch drops; float64 so
    the all-reduce sums exactly). Read once, at the end of the run: no sync inside a step."""
    dropped, routed = torch.zeros((), dtype=torch.float64, device=device), 0
    for m in model.modules():
        disp = getattr(m, "dispatcher", None)
        if disp is not None:
            routed += disp.routed_rows
            if disp.dropped is not None:
                dropped = dropped + disp.dropped.to(device=device, dtype=torch.float64)
    return torch.stack([dropped, torch.tensor(float(routed), dtype=torch.float64, device=device)])


def ep_dispatch_record(cfg: dict, d: Dist, drops: list[float]) -> dict | None:
    """The manifest's ``ep_dispatch``: the path, its knobs and, over every rank and step, the routed rows and
    the rows the capacity dropped (None without expert parallelism)."""
    if d.ep == 1:
        return None
    dropped, routed = int(drops[0]), int(drops[1])
    return {"path": cfg["ep_dispatch"], "capacity_factor": cfg["ep_capacity_factor"] if cfg["ep_dispatch"] in ("capacity", "symm")
            else None, "overlap": cfg["ep_overlap"], "overlap_chunks": cfg["ep_overlap_chunks"] if cfg["ep_overlap"]
            else 1, "overlap_schedule": cfg["ep_overlap_schedule"] if cfg["ep_overlap"] else None,
            "routed_rows": routed, "dropped_rows": dropped,
            "dropped_share": dropped / routed if routed else 0.0}


def platform_cpu_name() -> str:
    import platform

    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

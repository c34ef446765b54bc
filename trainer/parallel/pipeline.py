"""Pipeline parallelism on ``torch.distributed.pipelining``: stages, schedules, per-action timing.

How a pipelined run is put together (``build_pipeline``):

1. The full model is built and initialised exactly as without PP (same seed -> same weights for every
   layer whichever stage owns it); the layout (``moespec.layout``) says which pieces each
   global stage keeps; this rank keeps the stages its pipeline rank owns and drops the rest.
2. Each kept stage becomes a :class:`StageModule` (embedding / layers / norm + head + loss), wrapped by
   FSDP2 or DDP over the ranks that hold the same stage (``dp x ep`` of that pipeline rank), and a
   :class:`TimedStage` (a ``PipelineStage`` whose forward / backward / backward-for-weights chunk
   methods are timed and wrapped in ``record_function("pipeline/{F|B|W}/s{stage}/mb{mb}")``).
3. The schedule preset picks the ``torch.distributed.pipelining`` class and the stage placement
   (``moespec.schedules.SCHEDULES``).

Shapes are given to the stages up front (static metadata: no inference pass). The last stage's
module returns the micro-batch loss (it gets the targets as a keyword argument), so the schedule's
``loss_fn`` is the identity and the loss is inside the timed forward action.

**MoE aux loss.** The schedule carries only activations between stages, so each MoE layer's
load-balancing loss is attached to that layer's output with :class:`AttachAuxLoss`: identity in
forward, and in backward it adds ``aux_loss_coef * d(aux)/d(inputs of aux)`` (Megatron's
``MoEAuxLossAutoScaler`` idea). With the schedule's 1/microbatches gradient scaling this equals the
non-pipelined ``(loss + coef * aux) / microbatches`` per micro-batch.

**Timing** (:class:`ActionRecorder`): on CPU each action is bracketed by ``time.time_ns()``; on CUDA by
two CUDA events, resolved after the step (the trainer synchronises at the end of every step) against
an anchor event recorded and waited for at step start (the GPU is idle then, so waiting costs nothing)
together with a host ``time.time_ns()``. Nothing synchronises inside the schedule. Every rank appends
its step's actions to ``RUN/pipeline/rank<N>.jsonl`` after the step.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moespec.config import ConfigError
from moespec.layout import PipelineLayout, resolve_layout
from moespec.schedules import SCHEDULES, stage_to_rank

# Schedules that split the backward into B (inputs) and W (weights) (``Schedule.split_backward``). torch
# computes W with autograd.backward on intermediate graph nodes, which bypasses what DDP's reducer and
# FSDP2's unsharded parameters rely on (measured: wrong gradients with either wrapper once dp*ep > 1, and
# with FSDP2 even alone). So their stage modules are not wrapped: the dense gradients are averaged
# over the replica group by one all-reduce after the step (no overlap with compute), the expert
# gradients by ``sync_expert_grads`` as under DDP. The config requires dp_mode=ddp for them.


def schedule_class(preset: str):
    """The torch schedule class of a preset; a one-line ConfigError when this torch lacks it."""
    import torch.distributed.pipelining as pipelining

    if preset not in SCHEDULES:
        raise ConfigError("pipeline_schedule", f"unknown preset {preset!r} (one of {', '.join(SCHEDULES)})")
    name = SCHEDULES[preset].torch_class
    cls = getattr(pipelining, name, None)
    if cls is None:
        raise ConfigError("pipeline_schedule", f"preset {preset!r} needs torch.distributed.pipelining.{name}, "
                                               f"which torch {torch.__version__} does not have")
    return cls


class AttachAuxLoss(torch.autograd.Function):
    """``y = x`` in forward (a copy, so a stage never returns a view of its activations); backward
    passes ``dy`` through to ``x`` and gives ``aux`` the gradient ``scale``, so ``aux`` trains its
    routers as if ``scale * aux`` had been added to the loss."""

    @staticmethod
    def forward(ctx, x, aux, scale: float):
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class StageModule(nn.Module):
    """The pieces of one pipeline stage, taken from the full model: ``embed`` (stage 0), ``layers``
    (``Block``s, keeping their global ``layer_id``), ``norm`` + ``head`` + the loss (last stage).

    Input: token ids [B, S] on the first stage, hidden states [B, S, D] elsewhere. Output: hidden
    states, or on the last stage the micro-batch's mean token cross-entropy (``targets`` keyword).
    ``last_aux`` holds the detached sum of this stage's MoE aux losses of the latest forward.
    """

    def __init__(self, model: nn.Module, pieces: tuple[str, ...], layer_ids: list[int], cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.pieces = pieces
        self.embed = model.embed if "E" in pieces else None
        self.layers = nn.ModuleList(model.layers[i] for i in layer_ids)
        self.norm = model.norm if "L" in pieces else None
        self.head = model.head if "L" in pieces else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.aux_coef = cfg["aux_loss_coef"]
        self.last_aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        from trainer.model.transformer import lm_loss

        if self.embed is not None:
            x = self.embed(x)
        S = x.shape[1]
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        aux_total = torch.zeros((), dtype=torch.float32, device=x.device)
        for layer in self.layers:
            x, aux = layer(x, cos, sin)
            aux_total = aux_total + aux.float()
        self.last_aux = aux_total.detach()
        if self.aux_coef > 0 and aux_total.requires_grad:  # once per stage: the sum of its layers' aux
            x = AttachAuxLoss.apply(x, aux_total, self.aux_coef)
        if self.norm is None:
            return x
        if targets is None:
            raise ValueError("the last pipeline stage needs the targets (keyword 'targets')")
        return lm_loss(self.norm(x), self.head.weight, targets, self.cfg)


@dataclass
class _Pending:
    kind: str
    stage: int
    mb: int
    start: object  # int ns (CPU) or torch.cuda.Event
    end: object


class ActionRecorder:
    """Times pipeline actions and writes them, one JSON object per line, to ``path`` after each step.

    Line: ``{"step", "rank", "pp_rank", "stage", "microbatch", "kind", "start_ns", "end_ns"}`` with times
    in the ``time.time_ns()`` domain (comparable across the ranks of a host).
    """

    def __init__(self, path: Path, rank: int, pp_rank: int, device: torch.device):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "w")  # a new run overwrites; lines are appended step by step
        self.rank, self.pp_rank = rank, pp_rank
        self.cuda = device.type == "cuda"
        self.pending: list[_Pending] = []
        self.step = -1
        self.anchor_ns = 0
        self.anchor_event = None

    def begin_step(self, step: int) -> None:
        self.step = step
        self.pending.clear()
        if self.cuda:
            self.anchor_event = torch.cuda.Event(enable_timing=True)
            self.anchor_event.record()
            self.anchor_event.synchronize()  # step start: the GPU is idle, this costs nothing
            self.anchor_ns = time.time_ns()

    @contextmanager
    def action(self, kind: str, stage: int, mb: int):
        with torch.profiler.record_function(f"pipeline/{kind}/s{stage}/mb{mb}"):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
            else:
                start = time.time_ns()
                yield
                end = time.time_ns()
        self.pending.append(_Pending(kind, stage, mb, start, end))

    def _ns(self, t) -> int:
        if not self.cuda:
            return t
        return self.anchor_ns + round(self.anchor_event.elapsed_time(t) * 1e6)  # ms -> ns

    def end_step(self) -> list[dict]:
        """Resolve the step's actions (after the step's device synchronisation) and append them."""
        if self.cuda and self.pending:
            self.pending[-1].end.synchronize()
        rows = [{"step": self.step, "rank": self.rank, "pp_rank": self.pp_rank, "stage": p.stage,
                 "microbatch": p.mb, "kind": p.kind, "start_ns": self._ns(p.start), "end_ns": self._ns(p.end)}
                for p in self.pending]
        self.file.write("".join(json.dumps(r) + "\n" for r in rows))
        self.file.flush()
        self.pending.clear()
        return rows

    def close(self) -> None:
        self.file.close()


def _timed_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """``PipelineStage`` whose per-microbatch actions are timed by :class:`ActionRecorder` and
        whose forward adds the stage's MoE aux losses to the step's sum."""

        recorder: ActionRecorder
        aux_sum: torch.Tensor

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            with self.recorder.action("F", self.stage_index, fwd_chunk_id):
                out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            aux = getattr(self.submod, "last_aux", None)
            if aux is None and hasattr(self.submod, "module"):  # DDP
                aux = self.submod.module.last_aux
            if aux is not None:
                self.aux_sum = self.aux_sum + aux
            return out

        def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            with self.recorder.action("B", self.stage_index, bwd_chunk_id):
                return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

        def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            with self.recorder.action("W", self.stage_index, bwd_chunk_id):
                return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    return TimedStage


def _identity_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage already returns the loss."""
    return output


class Pipeline:
    """This rank's share of a pipelined model and the schedule that runs it.

    ``modules``: the (DP-wrapped) stage modules; ``core``: the unwrapped ones in an ``nn.ModuleList``
    (for gradient clipping and the expert-gradient all-reduce); :meth:`step` runs one optimizer
    step's forward and backward over all micro-batches.
    """

    def __init__(self, cfg: dict, d, model: nn.Module, out_dir: Path):
        from trainer.parallel.dist import wrap_data_parallel

        self.cfg, self.d = cfg, d
        pp, vpp, preset = cfg["pp"], cfg["vpp"], cfg["pipeline_schedule"]
        spec = SCHEDULES[preset]
        cls = schedule_class(preset)
        self.torch_schedule = cls.__name__
        self.layout: PipelineLayout = resolve_layout(cfg)
        n_stages = self.layout.n_stages
        self.stage_to_rank = stage_to_rank(n_stages, pp, spec.placement)
        self.my_stages = [s for s in range(n_stages) if self.stage_to_rank[s] == d.pp_rank]
        layers = self.layout.stage_layers
        self.microbatches = cfg["microbatches"]
        self.manual_dp = spec.split_backward
        self.recorder = ActionRecorder(Path(out_dir) / "pipeline" / f"rank{d.rank}.jsonl", d.rank, d.pp_rank,
                                       d.device)
        act_dtype = torch.bfloat16 if (cfg["dtype"] == "bf16" and cfg["dp_mode"] == "fsdp") else torch.float32
        mb, S, D = cfg["micro_batch_size"], cfg["seq_len"], cfg["d_model"]
        TimedStage = _timed_stage_class()
        self.core = nn.ModuleList()
        self.modules, self.stages = [], []
        for s in self.my_stages:
            mod = StageModule(model, self.layout.stages[s], layers[s], cfg).to(d.device)
            self.core.append(mod)
            wrapped = mod if spec.split_backward else wrap_data_parallel(mod, cfg, d)
            self.modules.append(wrapped)
            first, last = s == 0, s == n_stages - 1
            x_in = (torch.empty(mb, S, dtype=torch.long, device=d.device) if first else
                    torch.empty(mb, S, D, dtype=act_dtype, device=d.device, requires_grad=True))
            x_out = (torch.empty((), dtype=torch.float32, device=d.device, requires_grad=True) if last else
                     torch.empty(mb, S, D, dtype=act_dtype, device=d.device, requires_grad=True))
            stage = TimedStage(wrapped, s, n_stages, d.device, input_args=x_in, output_args=x_out, group=d.pp_group)
            stage.recorder = self.recorder
            stage.aux_sum = torch.zeros((), device=d.device)
            self.stages.append(stage)
        self.has_first = 0 in self.my_stages
        self.has_last = n_stages - 1 in self.my_stages
        # global rank holding the last stage of data replica 0 (prints the loss); mesh order (pp, dp, ep)
        self.log_rank = self.stage_to_rank[-1] * (d.world_size // pp)
        kw = dict(n_microbatches=self.microbatches, loss_fn=_identity_loss)
        try:
            self.schedule = cls(self.stages[0], **kw) if spec.single_stage else cls(self.stages, **kw)
        except ValueError as err:  # torch's own checks (e.g. microbatches vs rounds)
            raise ConfigError("pipeline_schedule", f"{preset} ({self.torch_schedule}): {err}") from None

    def parameters(self):
        return self.core.parameters()

    def step(self, step: int, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward + backward of one optimizer step (``microbatches`` micro-batches); gradients end up
        averaged over micro-batches (the schedule's ``scale_grads``) and reduced over DP by FSDP/DDP.
        Returns (mean loss, mean aux loss of this rank's stages); the loss is 0 where this rank does
        not hold the last stage."""
        self.recorder.begin_step(step)
        for st in self.stages:
            st.aux_sum = torch.zeros((), device=self.d.device)
        args = (tokens,) if self.has_first else ()
        kwargs = {"targets": targets} if self.has_last else {}
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        autocast = self.cfg["dtype"] == "bf16" and self.cfg["dp_mode"] == "ddp"
        with torch.autocast(self.d.device.type, dtype=torch.bfloat16, enabled=autocast):
            self.schedule.step(*args, target=targets if self.has_last else None, losses=losses,
                               return_outputs=False, **kwargs)
        if self.manual_dp:
            self._average_dense_grads()
        dev = self.d.device
        loss = torch.stack(losses).float().mean() if losses else torch.zeros((), device=dev)
        aux = sum((st.aux_sum for st in self.stages), torch.zeros((), device=dev)) / self.microbatches
        return loss.detach(), aux

    def _average_dense_grads(self) -> None:
        """Unwrapped (split-backward) stages: average dense gradients over the replica group, as DDP
        would (expert gradients: ``sync_expert_grads``)."""
        group = self.d.replica_mesh.get_group()
        n = dist.get_world_size(group)
        grads = [p.grad for name, p in self.core.named_parameters() if ".experts." not in name and p.grad is not None]
        if n == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= n
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    def end_step(self) -> list[dict]:
        """Write this step's actions (call after the step's device synchronisation)."""
        return self.recorder.end_step()

    def close(self) -> None:
        self.recorder.close()

    def manifest(self) -> dict:
        """The run manifest's ``"pipeline"`` object (docs/pipeline.md)."""
        return {"pp": self.cfg["pp"], "vpp": self.cfg["vpp"], "schedule": self.cfg["pipeline_schedule"],
                "torch_schedule": self.torch_schedule, "microbatches": self.microbatches,
                "layout": self.layout.to_string(), "layout_source": _layout_source(self.cfg),
                "stage_layers": self.layout.stage_layers, "stage_modules": self.layout.stage_modules,
                "stage_to_rank": self.stage_to_rank}


def _layout_source(cfg: dict) -> str:
    spec = cfg["pipeline_layout"]
    if spec in (None, "auto"):
        return "auto (measured costs)" if cfg["pipeline_layer_costs"] else "auto (FLOP model)"
    return "uniform" if spec == "uniform" else "given"


def build_pipeline(cfg: dict, d, model: nn.Module, out_dir: Path) -> Pipeline:
    return Pipeline(cfg, d, model, out_dir)


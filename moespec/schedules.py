"""Pipeline schedules: their names, what each one is, the order its ranks run their actions, its bubble in theory.

The trainer runs a schedule (``pipeline_schedule``, one of :data:`PIPELINE_SCHEDULES`) with the
``torch.distributed.pipelining`` class :attr:`Schedule.torch_class`; the analyzer models the ones in
:data:`MODELED` (a bubble formula and an exact action order each) and reads a run known only by its
torch class as :attr:`Schedule.theory`.

**Placement.** With ``pp`` pipeline ranks and ``vpp`` virtual stages per rank there are ``pp * vpp``
global stages. ``loop`` placement puts stage ``s`` on rank ``s % pp`` (interleaved); ``v`` placement
(V-shaped schedules, ``vpp = 2``) puts stages ``s`` and ``2pp - 1 - s`` on rank ``s``.

**Bubble theory.** With p stages, m microbatches per step (gradient accumulation) and v virtual stages per
rank, and the usual unit costs forward = backward-for-inputs = backward-for-weights (F = B = W = 1, so a
microbatch costs 3 on each stage)::

    gpipe, 1f1b          (p - 1) / (m + p - 1)
    interleaved (vpp)    (p - 1) / (v*m + p - 1)            (Narayanan et al., 2021)
    zb1p (ZB-H1)         (p - 1) / (3m + p - 1)             a third of 1F1B's idle time (Qi et al., 2024)
    zbv / zb2p           0 once m >= 2p (the schedules fill the bubble with W passes; memory permitting);
                         with fewer microbatches it is not modelled here (NaN, reported as n/a)

Ratios are of the step's wall time. GA = global batch tokens / (seq x micro-batch x DP), DP = world /
(PP x TP x CP); expert parallelism sits inside DP and does not change it.

**Action orders** (:func:`action_order`) are ``(kind, global stage, microbatch)`` with kind ``F``,
``B`` (backward, or backward for inputs when the schedule splits it) or ``W`` (backward for weights),
following the rules ``torch.distributed.pipelining`` builds each schedule by; they are checked against
the orders the trainer recorded on the GPU (tests/tracelens/test_whatif_pipeline.py, test_memory.py).

Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class ScheduleError(ValueError):
    """A schedule question without an answer (unknown name, impossible sizes); ``str(err)`` is one line."""


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule the trainer can run."""

    name: str            # the trainer's ``pipeline_schedule`` value
    torch_class: str     # its torch.distributed.pipelining class
    placement: str       # "loop" (stage s on rank s % pp) or "v" (stages s and 2pp-1-s on rank s)
    single_stage: bool   # a PipelineScheduleSingle: one stage per rank (vpp must be 1)
    split_backward: bool  # backward split into B (input gradient) and W (weight gradient) actions
    rounds: bool         # microbatches go in rounds of m // max(1, m // pp), so m must be a multiple of the rounds
    theory: str          # the modeled schedule the analyzer reads a run of this torch class as (bubble theory)


_ALL = (
    Schedule("gpipe", "ScheduleGPipe", "loop", True, False, False, "gpipe"),
    Schedule("1f1b", "Schedule1F1B", "loop", True, False, False, "1f1b"),
    Schedule("vpp", "ScheduleInterleaved1F1B", "loop", False, False, True, "vpp"),
    Schedule("looped_bfs", "ScheduleLoopedBFS", "loop", False, False, False, "vpp"),
    Schedule("zb1p", "ScheduleInterleavedZeroBubble", "loop", False, True, True, "zb1p"),
    Schedule("zbv", "ScheduleZBVZeroBubble", "v", False, True, False, "zbv"),
    Schedule("dualpipev", "ScheduleDualPipeV", "v", False, True, False, "zbv"),
)

#: name -> Schedule, the trainer's presets in the order its docs list them
SCHEDULES: dict[str, Schedule] = {s.name: s for s in _ALL}
PIPELINE_SCHEDULES: tuple[str, ...] = tuple(SCHEDULES)
#: the schedules with a bubble formula and an action order here (bubble table order)
MODELED: tuple[str, ...] = ("gpipe", "1f1b", "vpp", "zb1p", "zbv")
SINGLE_STAGE: tuple[str, ...] = tuple(s.name for s in _ALL if s.single_stage)
SPLIT_BACKWARD: tuple[str, ...] = tuple(s.name for s in _ALL if s.split_backward)
V_SHAPED: tuple[str, ...] = tuple(s.name for s in _ALL if s.placement == "v")
#: other names of modeled schedules that :func:`bubble_ratio` accepts (the papers' names)
ALIASES: dict[str, str] = {"interleaved": "vpp", "interleaved1f1b": "vpp", "zbh1": "zb1p", "zb2p": "zbv",
                           "zbh2": "zbv"}
#: torch class name, lower case -> the modeled schedule whose theory stands for it
TORCH_CLASS_THEORY: dict[str, str] = {s.torch_class.lower(): s.theory for s in _ALL}


def canonical(name: str) -> str:
    """A schedule name with its aliases resolved (``interleaved`` -> ``vpp``); unknown names unchanged."""
    return ALIASES.get(name, name)


# ------------------------------------------------------------------------------------ placement
def stage_to_rank(n_stages: int, pp: int, placement: str) -> list[int]:
    """Pipeline rank of every global stage: ``loop`` = ``s % pp`` (interleaved), ``v`` = down the ranks
    and back up (stage s and 2pp-1-s on rank s, for V-shaped schedules)."""
    if placement == "loop":
        return [s % pp for s in range(n_stages)]
    return [s if s < pp else 2 * pp - 1 - s for s in range(n_stages)]


def placement_of(schedule: str) -> str:
    """``v`` for a V-shaped schedule, else ``loop`` (also for names not in :data:`SCHEDULES`)."""
    s = SCHEDULES.get(schedule)
    return s.placement if s is not None else "loop"


# ------------------------------------------------------------------------------------ bubble theory
def bubble_ratio(schedule: str, pp: int, m: int, vpp: int = 1) -> float:
    """The share of a step that pipeline ranks sit idle in theory (module docstring); NaN where the theory
    does not reach (zbv below 2p microbatches). Raises :class:`ScheduleError` for bad sizes or a schedule
    without a formula."""
    if pp < 1 or m < 1 or vpp < 1:
        raise ScheduleError(f"bubble: pp, microbatches and vpp must be >= 1 (got pp={pp}, m={m}, vpp={vpp})")
    idle = pp - 1
    s = canonical(schedule)
    if s in ("gpipe", "1f1b"):
        return idle / (m + idle)
    if s == "vpp":
        return idle / (vpp * m + idle)
    if s == "zb1p":
        return idle / (3 * m + idle)
    if s == "zbv":
        return 0.0 if m >= 2 * pp else math.nan  # below 2p microbatches: not modelled (n/a)
    raise ScheduleError(f"bubble: unknown schedule {schedule!r} (one of {', '.join(MODELED)})")


def gradient_accumulation(global_tokens: int, seq_len: int, mbs: int, world: int, pp: int = 1, tp: int = 1,
                          cp: int = 1) -> tuple[int, int]:
    """(GA, DP) from the global batch in tokens; :class:`ScheduleError` when the numbers do not divide."""
    model_parallel = pp * tp * cp
    if world % model_parallel:
        raise ScheduleError(f"bubble: world size {world} is not divisible by pp*tp*cp = {model_parallel}")
    dp = world // model_parallel
    per_step = seq_len * mbs * dp
    if global_tokens % per_step:
        raise ScheduleError(f"bubble: global tokens {global_tokens} are not a multiple of seq*mbs*dp = {per_step}")
    return global_tokens // per_step, dp


# ------------------------------------------------------------------------------------ action orders
Action = tuple[str, int, int]  # (kind F/B/W, global stage, microbatch)


def action_order(schedule: str, pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    """The order in which pipeline rank ``rank`` runs its actions in one step of a :data:`MODELED` schedule.

    * ``gpipe``: all forwards, then all backwards.
    * ``1f1b`` (Schedule1F1B): ``min(m, pp - rank)`` warm-up forwards, then one backward and one forward
      in turn, then the remaining backwards.
    * ``vpp`` (ScheduleInterleaved1F1B): microbatches go in rounds of ``r = m // max(1, m // pp)``;
      warm-up ``min((vpp-1) r + 2 (pp-1-rank), m vpp)`` forwards; then forward/backward pairs; then the
      remaining backwards. Forward op ``i`` runs local stage ``(i // r) % vpp``, backward op ``i`` local
      stage ``vpp - 1 - ((i - warmup) // r) % vpp``; each stage takes its microbatches in order.
    * ``zb1p`` (ScheduleInterleavedZeroBubble) and ``zbv`` (ScheduleZBVZeroBubble): the rank operations
      torch computes (``_get_1f1b_rank_ops`` with zero bubble, and the ZB-V warm-up / stable / cool-down
      phases), idle slots dropped.

    A schedule without a modeled order raises :class:`ScheduleError`.
    """
    if schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    if schedule == "1f1b":
        return _1f1b_order(pp, m, rank)
    if schedule == "vpp":
        return _interleaved_order(pp, vpp, m, rank)
    if schedule == "zb1p":
        return _zb1p_order(pp, vpp, m, rank)
    if schedule == "zbv":
        return _zbv_order(pp, m, rank)
    raise ScheduleError(f"pipeline_schedule {schedule!r}: no action order modeled (modeled: {', '.join(MODELED)})")


def _1f1b_order(pp: int, m: int, rank: int) -> list[Action]:
    warm = min(m, pp - rank)
    out = [("F", rank, i) for i in range(warm)]
    f = warm
    for b in range(m):
        out.append(("B", rank, b))
        if f < m:
            out.append(("F", rank, f))
            f += 1
    return out


def _interleaved_order(pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    per_round = m // max(1, m // pp)
    total = m * vpp
    warm = min((vpp - 1) * per_round + 2 * (pp - 1 - rank), total)
    fwd_next: dict[int, int] = {}
    bwd_next: dict[int, int] = {}
    out: list[Action] = []

    def fwd(op):
        st = ((op // per_round) % vpp) * pp + rank
        fwd_next[st] = fwd_next.get(st, 0) + 1
        out.append(("F", st, fwd_next[st] - 1))

    def bwd(op):
        st = (vpp - 1 - ((op - warm) // per_round) % vpp) * pp + rank
        bwd_next[st] = bwd_next.get(st, 0) + 1
        out.append(("B", st, bwd_next[st] - 1))

    for op in range(warm):
        fwd(op)
    for op in range(warm, total):
        fwd(op)
        bwd(op)
    for op in range(total, total + warm):
        bwd(op)
    return out


def _zb1p_order(pp: int, v: int, m: int, rank: int) -> list[Action]:
    rounds = max(1, m // pp)
    per_round = m // rounds
    warm = min((v - 1) * per_round + (pp - 1 - rank), m * v)
    total_mb = v * m
    fwd_bwd = total_mb - warm
    cool = total_mb - fwd_bwd

    def f_stage(op: int) -> int:
        return ((op // per_round) % v) * pp + rank

    def b_stage(op: int) -> int:
        return (v - 1 - ((op - warm) // per_round) % v) * pp + rank

    nxt: dict[tuple[str, int], int] = {}
    out: list[Action] = []
    b_ops: list[int] = []
    w_count = 0

    def emit(kind: str, st: int) -> None:
        i = nxt.get((kind, st), 0)
        nxt[(kind, st)] = i + 1
        out.append((kind, st, i))

    for op in range(warm + fwd_bwd + cool):
        if op < warm:
            emit("F", f_stage(op))
            continue
        if op < warm + fwd_bwd:
            emit("F", f_stage(op))
        emit("B", b_stage(op))
        b_ops.append(op)
        if op - warm >= rank:  # num_1f1b_microbatches = rank
            emit("W", b_stage(b_ops[w_count]))
            w_count += 1
    while w_count < len(b_ops):
        emit("W", b_stage(b_ops[w_count]))
        w_count += 1
    return out


def _zbv_order(pp: int, m: int, rank: int) -> list[Action]:
    n_micro = max(2 * pp - 1, m)
    c0, c1 = rank, 2 * pp - 1 - rank
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - rank) - 1):
        out.append(("F", c0, f0)); f0 += 1  # noqa: E702
    for _ in range(rank):
        out.append(("F", c1, f1)); f1 += 1  # noqa: E702
        out.append(("F", c0, f0)); f0 += 1  # noqa: E702
    for _ in range(pp - rank):
        out.append(("F", c1, f1)); f1 += 1  # noqa: E702
        out += [("B", c1, b1), ("W", c1, b1)]
        b1 += 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            out.append(("F", c0, f0)); f0 += 1  # noqa: E702
        out += [("B", c0, b0), ("W", c0, b0)]
        b0 += 1
        out.append(("F", c1, f1)); f1 += 1  # noqa: E702
        out += [("B", c1, b1), ("W", c1, b1)]
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out.append(("B", c0, b0)); b0 += 1  # noqa: E702
        out.append(("B", c1, b1)); b1 += 1  # noqa: E702
    for _ in range(pp - rank):
        out.append(("B", c0, b0)); b0 += 1  # noqa: E702
        out.append(("W", c0, w0)); w0 += 1  # noqa: E702
    while w1 < b1:
        out.append(("W", c1, w1)); w1 += 1  # noqa: E702
    while w0 < b0:
        out.append(("W", c0, w0)); w0 += 1  # noqa: E702
    return [a for a in out if a[2] < m]

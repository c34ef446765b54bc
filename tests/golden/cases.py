"""The golden cases: one tracelens invocation each, over the committed fixture corpus (tests/fixtures).

A case's id is `<input>/<verb>`, and its golden files live in `tests/golden/data/<input>/<verb>/`. CLI
cases give the `tracelens` arguments: `{out}` stands for the case's own empty output directory, and
fixture paths are relative to the checkout's root (the case runs there), as a user who runs the README's
commands sees them. The cases cover every kind of input the corpus has (1-GPU, 2-rank NCCL, expert
parallel, pipeline parallel with 1F1B / interleaved / zero-bubble schedules, CPU-only, AMD, other
devices and torch versions) and every verb whose output is a file or text computed from a trace or
a run dir; similar traces are left out to keep the whole golden test near a minute on 2 cores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FX = "tests/fixtures"


@dataclass(frozen=True)
class Case:
    id: str  # "<input>/<verb>": the golden's directory under data/
    args: tuple[str, ...] = ()  # tracelens arguments ("{out}": the output directory)
    api: Callable[[Path], None] | None = None  # instead of the CLI: a function writing into the output dir


def cli(case_id: str, *args: str) -> Case:
    return Case(case_id, tuple(args))


def _analyze_ranks(paths: list[str]) -> Callable[[Path], None]:
    """`tracelens analyze --workers N` without Dask (whose local cluster takes ~10 s to start here): the
    same rank-by-rank reduction (`tracelens.analyze_ranks`, in this process) and the same writer."""

    def run(out: Path) -> None:
        import tracelens
        from reports.artifacts import write_all

        write_all(tracelens.analyze_ranks(paths, cache=False), out, report=False)

    return run


NCCL = f"{FX}/h200_nccl_2rank"
MOE_LOOP = f"{FX}/h200_moe_1gpu/moe1gpu_loop.json.gz"
MOE_GROUPED = f"{FX}/h200_moe_1gpu/moe1gpu_grouped.json.gz"
CPU_TINY = f"{FX}/cpu_tiny/rank0.json.gz"
EP_L0 = f"{FX}/h200_ep2_run/L0_loop"
EP_L3 = f"{FX}/h200_ep2_run/L3_torch"
H100 = f"{FX}/h100_proxy_loop_mbs8"
PP_1F1B = f"{FX}/h200_pp2_run/1f1b"
PP_VPP2 = f"{FX}/h200_pp2_run/vpp2"
PP_ZB1P = f"{FX}/h200_pp2_run/zb1p"
HTA = f"{FX}/external/hta"
MI250 = f"{HTA}/mi250_minitoy_train_ROCm6_2_kineto.json.gz"
HTA_CPU = f"{HTA}/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"
TRITON = f"{HTA}/triton_example.json.gz"
ALEXNET = f"{HTA}/benchmark_result_2869224_1695835535_trace.json.gz"
HTA_CONTROL = f"{HTA}/trace_diff/control.json.gz"
HTA_TEST = f"{HTA}/trace_diff/test.json.gz"

NC = "--no-cache"


def analyze(case_id: str, *paths: str) -> Case:
    return cli(f"{case_id}/analyze", "analyze", *paths, "-o", "{out}", NC)


def json_verb(case_id: str, verb: str, *args: str) -> Case:
    """A verb that writes its machine output with --json (comm, host, roofline, check, memory, whatif)."""
    return cli(f"{case_id}/{verb}", verb.split("_")[0], *args, "--json", "{out}/" + verb.split("_")[0] + ".json")


CASES: list[Case] = [
    # 2 ranks, NCCL, injected skew: the communication-vs-synchronization split
    analyze("nccl_2rank", NCCL),
    json_verb("nccl_2rank", "comm", NCCL, NC),
    json_verb("nccl_2rank", "check", NCCL, NC, "--fail-on", "warning"),
    Case("nccl_2rank/analyze_ranks", api=_analyze_ranks([NCCL])),
    # one GPU: per-expert loop with host syncs vs grouped GEMM
    analyze("moe1gpu_loop", MOE_LOOP),
    json_verb("moe1gpu_loop", "host", MOE_LOOP, NC),
    analyze("moe1gpu_grouped", MOE_GROUPED),
    json_verb("moe1gpu_grouped", "roofline", MOE_GROUPED, NC),
    cli("moe1gpu_loop_vs_grouped/diff", "diff", MOE_LOOP, MOE_GROUPED, "-o", "{out}", NC),
    # CPU-only, deep op stacks
    analyze("cpu_tiny", CPU_TINY),
    json_verb("cpu_tiny", "roofline", CPU_TINY, NC),
    # expert parallel run dirs (2 x H200): level 0 + loop vs level 3 + torch._grouped_mm
    analyze("ep2_L0_loop", EP_L0),
    json_verb("ep2_L0_loop", "comm", EP_L0, NC),
    json_verb("ep2_L0_loop", "host", EP_L0, NC),
    json_verb("ep2_L0_loop", "memory", EP_L0),
    json_verb("ep2_L0_loop", "whatif_grouped_gemm_torch", EP_L0, "--set", "grouped_gemm_backend=torch"),
    json_verb("ep2_L0_loop", "whatif_mbs2", EP_L0, "--set", "micro_batch_size=2"),
    cli("ep2_L0_vs_L3/diff", "diff", EP_L0, EP_L3, "-o", "{out}", NC,
        "--fail-on", "step_time>+5%", "--fail-on", "host_syncs>0"),
    # one H100, what-if acceptance grid trial: hidden device waits in the replay
    analyze("h100_mbs8", H100),
    json_verb("h100_mbs8", "host", H100, NC),
    json_verb("h100_mbs8", "memory", H100),
    json_verb("h100_mbs8", "whatif_mbs4", H100, "--set", "micro_batch_size=4"),
    json_verb("h100_mbs8", "whatif_torch_sfl3", H100, "--set", "grouped_gemm_backend=torch", "--set", "sync_free_level=3"),
    # pipeline parallel run dirs (2 x H200): 1F1B, interleaved (vpp 2, unbalanced), ZB-H1
    analyze("pp2_1f1b", PP_1F1B),
    json_verb("pp2_1f1b", "comm", PP_1F1B, NC),
    cli("pp2_1f1b/ppvis", "ppvis", PP_1F1B, "-o", "{out}/ppvis.html", "--json", "{out}/ppvis.json", NC),
    json_verb("pp2_1f1b", "memory", PP_1F1B),
    json_verb("pp2_1f1b", "whatif_schedule_zb1p", PP_1F1B, "--set", "pipeline_schedule=zb1p"),
    analyze("pp2_vpp2", PP_VPP2),
    cli("pp2_vpp2/ppvis", "ppvis", PP_VPP2, "-o", "{out}/ppvis.html", "--json", "{out}/ppvis.json", NC),
    json_verb("pp2_vpp2", "check", PP_VPP2, NC, "--fail-on", "never"),
    json_verb("pp2_vpp2", "memory", PP_VPP2),
    cli("pp2_zb1p/ppvis", "ppvis", PP_ZB1P, "-o", "{out}/ppvis.html", "--json", "{out}/ppvis.json", NC),
    # traces recorded elsewhere (HolisticTraceAnalysis test data)
    analyze("hta_mi250", MI250),
    json_verb("hta_mi250", "roofline", MI250, NC),
    analyze("hta_cpu_rank34", HTA_CPU),
    json_verb("hta_cpu_rank34", "check", HTA_CPU, NC),
    analyze("hta_triton", TRITON),
    analyze("hta_alexnet", ALEXNET),
    analyze("hta_a100_control", HTA_CONTROL),
    json_verb("hta_a100_control", "comm", HTA_CONTROL, NC),
    cli("hta_a100_vs_v100/diff", "diff", HTA_CONTROL, HTA_TEST, "-o", "{out}", NC),
    # no trace: the schedule theory and the memory projection of a named trainer config
    cli("config/bubble", "bubble", "--pp", "4", "--vpp", "2", "--ga", "16"),
    json_verb("config/gpu_proxy", "memory", "gpu_proxy", "--world", "8", "--pp", "2", "--ep", "4", "--schedule", "zbv",
              "--mbs", "2", "--device", "H200"),
    json_verb("config/gpu_proxy", "memory_sweep", "gpu_proxy", "--world", "16", "--global-batch", "64", "--device", "H100",
              "--sweep", "--top", "8"),
]

BY_ID = {c.id: c for c in CASES}
assert len(BY_ID) == len(CASES), "case ids must be unique"
assert not [a for a in BY_ID for b in BY_ID if b.startswith(a + "/")], "a case's directory must not hold another's"

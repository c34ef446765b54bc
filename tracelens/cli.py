"""The `tracelens` command line: a thin shell over the Python API.

This module is the one place in the `tracelens` package that reaches the other packages (reports,
and the trainer / autotune as subprocesses), always lazily inside a command, so `import tracelens`
stays free of them. Bad input ends with one line, `tracelens: error: <file>: <problem>`, and exit
status 2; set TRACELENS_DEBUG=1 to see tracebacks of internal errors.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import click

from moespec.schedules import MODELED as _MODELED_SCHEDULES

from . import __version__
from .errors import TraceError
# (from io.scanner, not io.kineto: pandas and pyarrow load after `analyze` has started the scan)
from .io.scanner import decoder


class _FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses 'nan' and 'inf': float() reads them, and nan passes every bound check
    (a memory of nan GiB was "OUT OF MEMORY", a headroom of nan% "does NOT fit")."""

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return v


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"tracelens: error: {message}", err=True)
    sys.exit(code)


def _echo(text: str = "", err: bool = False) -> None:
    """Print text that holds names from a trace: control characters and escape sequences in them are
    shown as visible ``\\xNN`` text, never sent to the terminal (tracelens.names.for_terminal)."""
    from .names import for_terminal

    click.echo(for_terminal(text, keep_newlines=True), err=err)


def _write_json(path: str, doc: dict, echo=_echo, **dumps) -> Path:
    """Write a verb's ``--json`` document (indent 1, as every verb writes it) and say so (``echo=None``:
    silently)."""
    import json

    Path(path).write_text(json.dumps(doc, indent=1, **dumps))
    if echo is not None:
        echo(f"wrote {path}")
    return Path(path)


def _open_report(path: Path) -> None:
    """``--open``: open the page in a browser, or say where it is when no browser can open here
    (headless machine, no DISPLAY, or no browser registered)."""
    uri = Path(path).resolve().as_uri()
    headless = sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    opened = False
    if not headless:
        import webbrowser  # (7 ms of imports every command would pay for --open)

        try:
            opened = webbrowser.get().open(uri)
        except webbrowser.Error:
            opened = False
    if opened:
        click.echo(f"opened {uri} in a browser", err=True)
    else:
        click.echo(f"no browser available: open {uri} yourself", err=True)


def _default_out(paths: tuple[str, ...]) -> Path:
    first = Path(paths[0])
    if first.is_dir():
        from .io.run import MANIFEST

        return first if (first / MANIFEST).exists() else first / "tracelens"
    name = first.name
    for suffix in (".json.gz", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return first.parent / f"{name}.tracelens"


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except TraceError as e:
            _fail(e.one_line())
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except BrokenPipeError:  # `tracelens ... | head`: the reader left; not an error of ours
            # point stdout at devnull so the interpreter's final flush does not raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except MemoryError:
            _fail("out of memory while analyzing; try fewer ranks at once", 3)
        except OSError as e:
            if e.filename is None or os.environ.get("TRACELENS_DEBUG"):
                raise
            # a path the user gave that cannot be read or written (read-only or full output dir, ...)
            _fail(f"{e.filename}: {e.strerror or e}")
        except Exception as e:  # an internal bug: one line by default, the traceback on request
            if os.environ.get("TRACELENS_DEBUG"):
                raise
            _fail(f"internal error: {type(e).__name__}: {e} (set TRACELENS_DEBUG=1 for the traceback)", 3)


# Set by a command once its outputs are written, when what is left of the process is only its teardown: `entry` then
# leaves without it (see `_exit_now`).
_TEARDOWN_SKIPPABLE = False
# True in the `tracelens` program's own process (`entry`), not where `main` runs inside another program (a test's
# CliRunner): what only the program's process may do to the interpreter (`gc.freeze`, for good) checks it
_OWN_PROCESS = False


def entry(argv: list[str] | None = None) -> None:
    """The `tracelens` program (the console script and `python -m tracelens`): `main` as click runs it, then, after
    a command that marked its process done (`analyze`), the exit without the interpreter's teardown."""
    global _OWN_PROCESS
    _OWN_PROCESS = True
    from .allocator import set_for_program

    set_for_program()  # glibc malloc's settings for large tables (tracelens/allocator.py), before any thread
    try:
        main(argv)
    except SystemExit as e:
        if not _TEARDOWN_SKIPPABLE:
            raise
        _exit_now(e.code)
    raise SystemExit(0)  # (click's standalone main always ends in SystemExit; never reached)


def _exit_now(code) -> None:
    """Exit as the interpreter would, less its teardown. `analyze` holds a 200 MB trace's tables and results when it
    is done: freeing them object by object at exit took 0.09-0.11 s of a 1.2 s run (8 %), for memory the OS takes
    back whole. What an exit must still do is done first: the non-daemon threads are waited for (the cache entry's
    store), the `atexit` functions run (logging's flush, `weakref.finalize`'s, e.g. temporary directories), and the
    standard streams are flushed; then `os._exit` with the code `sys.exit` would give."""
    import atexit
    import threading

    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    main_thread = threading.main_thread()
    for t in threading.enumerate():
        if t is not main_thread and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left (BrokenPipeError), a closed stream
            pass
    os._exit(code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tracelens", message="%(prog)s %(version)s\ntrace decoder: " + decoder())
def main() -> None:
    """Profile, explain and tune Mixture-of-Experts training from PyTorch profiler traces."""


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--out", type=click.Path(file_okay=False), help="Output directory (default: the run dir, or NAME.tracelens/ beside a trace file).")
@click.option("--open", "open_browser", is_flag=True, help="Open the report in a browser when done.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-trace cache.")
@click.option("--no-report", is_flag=True, help="Write summary.json and tables only.")
@click.option("--no-tables", is_flag=True, help="Do not write the Parquet/CSV tables.")
@click.option("-j", "--jobs", type=click.IntRange(1, 512), default=None, help="Processes for loading many ranks (default: CPU count).")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
@click.option("--ceilings", type=click.Path(dir_okay=False), default=None,
              help="Measured ceilings JSON (e.g. from `tracelens calibrate`) for the roofline in the report and summary.json.")
@click.option("--all-steps", is_flag=True, help="Read the whole profiled window (every step, start-up and partial steps "
              "included) instead of the steady-state steps.")
@click.option("--workers", type=click.IntRange(1, 4096), default=None,
              help="Analyze rank by rank on a local Dask cluster of N worker processes (needs tracelens[distributed]); "
                   "writes summary.json and tables, no report.")
@click.option("--scheduler", default=None, metavar="ADDR",
              help="Like --workers, on a running Dask cluster (tcp://host:8786) whose workers see the same paths.")
@click.option("--memory-limit", default=None, metavar="SIZE",
              help="With --workers: each worker's memory limit for Dask (e.g. 2GB; default: Dask's 'auto').")
def analyze(paths, out, open_browser, no_cache, no_report, no_tables, jobs, quiet, ceilings, all_steps,
            workers, scheduler, memory_limit):
    """Analyze traces: PATHS are trace files (.json/.json.gz), directories of per-rank traces, or run dirs.

    Writes report.html, summary.json and tables/ (Parquet + CSV) into the output directory. With
    --workers or --scheduler every rank is loaded and reduced as its own Dask task and only the reduced
    per-rank tables meet on this machine: summary.json then holds the per-rank figures, the window, the
    communication and pipeline analyses (not findings, roofline, health or the decomposition).
    """
    from . import load

    t0 = time.perf_counter()
    if memory_limit is not None and workers is None:  # (it was silently not used)
        _fail("--memory-limit sets the memory of --workers' local Dask workers: give --workers N with it")
    if workers is not None or scheduler is not None:
        _analyze_ranks(paths, out, no_cache, no_tables, quiet, ceilings, all_steps, workers, scheduler,
                       memory_limit, t0)
        return
    # `load` first: it starts reading and scanning a large trace in a thread, then imports pandas and the
    # analyses while the scan runs (tracelens/io/prefetch.py); importing them here first would serialize the two
    import gc

    gc.disable()  # the load imports pandas, pyarrow and the analyses: ~130,000 objects, next to no garbage
    try:
        trace = load(list(paths), cache=not no_cache, jobs=jobs, progress=None if not quiet else False)
        from . import analyze as run_analysis
        from reports.artifacts import write_all

        if _OWN_PROCESS:
            # ...which the analysis' collections then do not walk, up to the summary's fork (tracelens.offload freezes
            # everything for it and gives it all back to the oldest generation after: rarely collected there)
            gc.freeze()
    finally:
        gc.enable()
    if not no_report:  # a first run compresses plotly.js for the page: beside the analysis, on the idle CPU
        from reports.common import pack_plotly_beside

        pack_plotly_beside()

    result = run_analysis(trace, window="all" if all_steps else "steady")
    if ceilings and result.has_gpu:
        try:
            result.use_ceilings(ceilings)
        except (OSError, ValueError) as e:
            _fail(f"{ceilings}: {e}")
    out_dir = Path(out) if out else _default_out(paths)
    written = write_all(result, out_dir, report=not no_report, tables=not no_tables)
    if not quiet:
        for w in result.warnings:
            _echo(f"tracelens: warning: {w}", err=True)
        _print_summary(result)
        _echo(f"wrote {out_dir} ({', '.join(p.name for p in written.values())}) in {time.perf_counter() - t0:.2f}s")
    if open_browser and "report" in written:
        _open_report(written["report"])
    global _TEARDOWN_SKIPPABLE
    _TEARDOWN_SKIPPABLE = True


def _analyze_ranks(paths, out, no_cache, no_tables, quiet, ceilings, all_steps, workers, scheduler, memory_limit, t0):
    """`analyze --workers/--scheduler`: tracelens.scale on Dask."""
    from reports.artifacts import write_all

    from .scale import NeedsDask, analyze_ranks

    if workers is not None and scheduler is not None:
        _fail("--workers starts a local cluster and --scheduler uses a running one: give one of them")
    if ceilings:
        _fail("--ceilings feeds the roofline, which --workers/--scheduler leave out: run without them")
    try:
        result = analyze_ranks(list(paths), workers=workers, scheduler=scheduler, cache=not no_cache,
                               window="all" if all_steps else "steady", memory_limit=memory_limit)
    except NeedsDask as e:
        _fail(str(e))
    out_dir = Path(out) if out else _default_out(paths)
    written = write_all(result, out_dir, report=False, tables=not no_tables)
    if not quiet:
        for w in result.warnings:
            _echo(f"tracelens: warning: {w}", err=True)
        if result.timeline.empty:
            _echo(f"window: {result.window.describe()}")
            _echo("no GPU activity in these traces: per-rank host figures need the single-process path")
        else:
            _print_summary(result)
        _echo(f"wrote {out_dir} ({', '.join(p.name for p in written.values())}) in {time.perf_counter() - t0:.2f}s "
              f"[{result.engine}, {len(result.trace.ranks)} ranks]")


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--config", "config", required=True, help="Trainer config: a YAML file or a name under trainer/configs (tiny, gpu_proxy, ...).")
@click.option("--nproc", type=click.IntRange(1, 1024), default=1, show_default=True, help="Processes (GPUs); above 1 the trainer runs under torchrun.")
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False), help="Run directory to write (runs/NAME).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key (repeatable).")
@click.option("--open", "open_browser", is_flag=True, help="Open the report when done.")
@click.argument("trainer_args", nargs=-1, type=click.UNPROCESSED)
def profile(config, nproc, out, overrides, open_browser, trainer_args):
    """Run the MoE trainer with its profiling window, then analyze the run dir (report.html beside it).

    Extra arguments are passed to the trainer (e.g. --sync-free-level 3 --grouped-gemm-backend torch).
    """
    import subprocess

    cmd = [sys.executable, "-m", "trainer.launch", "--config", config, "--nproc", str(nproc), "-o", out]
    for o in overrides:
        cmd += ["--set", o]
    cmd += list(trainer_args)
    _echo("$ " + " ".join(cmd), err=True)
    rc = _run_stoppable(subprocess.Popen(cmd))
    if rc != 0:
        _fail(f"{out}: the trainer exited with status {rc} (see its output above)", 2 if rc == 2 else 1)
    from . import analyze as run_analysis, load
    from reports.artifacts import write_all

    result = run_analysis(load(out))
    written = write_all(result, out)
    for w in result.warnings:
        _echo(f"tracelens: warning: {w}", err=True)
    _print_summary(result)
    _echo(f"wrote {out} ({', '.join(p.name for p in written.values())})")
    if open_browser:
        _open_report(written["report"])


def _run_stoppable(proc) -> int:
    """Wait for the trainer; SIGINT or SIGTERM to us is passed on to it (once) and waited for, so that it stops
    and says so in its manifest, then raises KeyboardInterrupt ("interrupted", exit 130). ``subprocess.call``
    killed it (SIGKILL) 0.25 s after a Ctrl-C, often before it had marked its manifest, and on SIGTERM we died
    alone: the trainer went on training into the run dir."""
    import signal
    import threading

    def stop(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    main_thread = threading.current_thread() is threading.main_thread()
    old = ({sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)
            if signal.getsignal(sig) is not signal.SIG_IGN} if main_thread else {})
    interrupted = None
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt as err:
                if interrupted is None and proc.poll() is None:
                    interrupted = str(err) or "SIGINT"
                    try:
                        proc.send_signal(getattr(signal, interrupted, signal.SIGINT))
                    except OSError:
                        pass
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if interrupted is not None:
        raise KeyboardInterrupt(interrupted)
    return rc


def _manifest(path: str) -> dict | None:
    """The run dir's manifest.json, checked (tracelens.io.manifest); None for a trace or trace directory."""
    from .io.manifest import read_manifest, run_manifest_path

    m = run_manifest_path(path)
    return None if m is None else read_manifest(m)


@main.command()
@click.argument("base", type=click.Path())
@click.argument("new", type=click.Path())
@click.option("-o", "--out", type=click.Path(file_okay=False), help="Write diff.html, diff.md and diff.json here.")
@click.option("--fail-on", "rules", multiple=True, metavar="RULE",
              help="CI gate, repeatable: e.g. 'step_time>+5%' (change) 'host_syncs>0' (the new run) 'gpu.idle>+10%'. Exit 1 if any trips.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-trace cache.")
@click.option("--top", type=click.IntRange(1, 1000), default=10, show_default=True, help="Ops and kernels to list.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the rule verdicts (one line each).")
def diff(base, new, out, rules, no_cache, top, quiet):
    """Compare two traces, trace directories or run dirs (BASE -> NEW), per step.

    Exit status: 0 no rule tripped, 1 a --fail-on rule tripped, 2 bad input or a rule that cannot be evaluated
    (its metric missing on a side, or a change in % from 0). Rule grammar:
    METRIC OP VALUE. A signed value, a percentage or delta(METRIC) tests the change new - base
    (step_time>+5%, delta(host_syncs)>0); an unsigned number or new.METRIC tests the new run's value
    (host_syncs>0: the new run syncs at all). See docs/diff.md.
    """
    from . import analyze as run_analysis, load
    from .analysis.diff import check_rules, diff as run_diff, parse_rule, unevaluated
    from reports import diff as render

    parsed_rules = [parse_rule(r) for r in rules]  # bad rules and manifests fail before any loading
    base_manifest, new_manifest = _manifest(base), _manifest(new)
    a = run_analysis(load(base, cache=not no_cache))
    b = run_analysis(load(new, cache=not no_cache))
    result = run_diff(a, b, base_manifest, new_manifest, base_label=str(base), new_label=str(new))
    verdicts = check_rules(result, parsed_rules)
    if out:
        render.write_all(result, out, verdicts)
    if quiet:
        for v in verdicts:
            _echo(render.rule_line(v))
    else:
        _echo(render.to_text(result, verdicts, top=top))
        if out:
            _echo(f"wrote {out}/diff.html, diff.md, diff.json")
    blind = [f"--fail-on {v['rule']!r}: {why}" for v in verdicts if (why := unevaluated(v))]
    if blind:  # the gate could not look: never a pass (exit 1 still wins: a rule that tripped is a regression)
        click.echo(f"tracelens: error: {'; '.join(blind)} (the rule cannot be evaluated on these inputs)", err=True)
    if any(v["tripped"] for v in verdicts):
        sys.exit(1)
    if blind:
        sys.exit(2)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write every (instance, rank) record and the summaries here.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-trace cache.")
def comm(paths, json_out, no_cache):
    """Communication vs synchronization across ranks: each collective's wait for the last rank and its
    pure communication time, bandwidths (NCCL's busbw), skew and stragglers. See docs/comm.md.

    On a partial rank set (a process group with ranks not loaded) it says so and shows per-rank figures
    only (count, kernel time, bytes); cross-rank columns are '–'."""
    from . import analyze as run_analysis, load
    from .analysis.comm import comm_report

    rep = comm_report(run_analysis(load(list(paths), cache=not no_cache)))
    _echo(rep.to_text())
    if json_out:
        _write_json(json_out, rep.to_dict())


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--step", type=click.IntRange(0), default=None, help="The profiler step (default: every step of the steady-state window).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the summary and every segment of the path here.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-trace cache.")
def critpath(paths, step, json_out, no_cache):
    """The critical path of a step across ranks: the chain of GPU work, idle time and hand-offs between ranks
    (a collective's wait for its last rank, a receive's wait for its sender) that sets the step's time, and
    what it is made of by cause and by rank. See docs/critpath.md.

    Exit status 2 with one line for a step that some rank lacks or ranks whose collectives match nothing."""
    from . import analyze as run_analysis, load
    from .analysis.critical_path import critical_path_of

    cp = critical_path_of(run_analysis(load(list(paths), cache=not no_cache)), step)
    _echo(cp.to_text())
    if json_out:
        _write_json(json_out, cp.to_dict())


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the view, with every (layer, rank, expert) record, here.")
@click.option("--placement-ep", type=click.IntRange(2), default=None,
              help="Predict the balanced expert placement (ep_placement) for this EP size (default: the run's).")
@click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-trace cache.")
def moe(paths, json_out, placement_ep, no_cache):
    """The MoE view: per MoE layer and rank, routed tokens per expert and the expert load imbalance (from the
    run's routing.json), grouped-GEMM rows computed vs routed (padding), expert GEMM time, all-to-all bytes
    per rank pair and their skew, tied to the late rank. See docs/moe.md.

    With a routing file it also predicts, per layer, the rank imbalance under the balanced expert placement
    the trainer's ``ep_placement: balanced`` would run with this file as ``ep_placement_loads``.

    Without a routing file (older runs, other frameworks) it shows what the trace has and says in one line
    what is missing. A truncated routing file, or one from another run: one line, exit 2."""
    import dataclasses

    from . import analyze as run_analysis, load
    from .analysis.moe_view import placement_preview

    a = run_analysis(load(list(paths), cache=not no_cache))
    rep = a.moe()
    if placement_ep is not None:
        run = a.trace.run
        counts = run.routing() if run is not None else None
        if counts is None:
            _fail(f"{paths[0]}: --placement-ep needs the run's routing.json (the expected expert loads), and there is none")
        if counts.n_experts % placement_ep:
            _fail(f"{run.routing_path}: --placement-ep {placement_ep}: its {counts.n_experts} experts do not split "
                  "evenly over that many ranks")
        rep = dataclasses.replace(rep, placement=placement_preview(counts, placement_ep))
    _echo(rep.to_text())
    if json_out:
        _write_json(json_out, rep.to_dict())


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the checks (and the exit status) as JSON here.")
@click.option("--fail-on", type=click.Choice(["error", "warning", "never"]), default="error", show_default=True,
              help="Exit 1 when a check is at least this severe ('never': exit 0 whatever is found).")
@click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-trace cache.")
def check(paths, json_out, fail_on, no_cache):
    """Trace health: missing ranks, rank identity, unlinked or dropped GPU events, missing shapes/stacks,
    partial steps, profiler start-up waits, clock skew, profiler overhead, incomplete runs; each with its
    severity and the figures it invalidates (docs/summary-json.md, `health`).

    Exit status: 0 nothing at or above --fail-on (default: no error); 1 a check at or above it; 2 bad input."""
    from . import analyze as run_analysis, load
    from .analysis.health import health_report

    rep = health_report(run_analysis(load(list(paths), cache=not no_cache)), fail_on)
    click.echo(rep.to_text())
    if json_out:
        _write_json(json_out, rep.to_dict(), echo=click.echo)
    sys.exit(rep.exit_status)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write syncs, idle gaps summary, launch stats and findings here.")
@click.option("--small-us", type=_FiniteFloatRange(min=0, min_open=True), default=10.0, show_default=True, help="Kernels shorter than this count as small.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-trace cache.")
def host(paths, json_out, small_us, no_cache):
    """Host side: device-to-host syncs and the GPU idle they cause, launch latency, idle gaps by cause,
    small kernels, and ranked findings. See docs/host.md."""
    from . import analyze as run_analysis, load
    from .analysis.host import host_report

    rep = host_report(run_analysis(load(list(paths), cache=not no_cache)), small_us)
    _echo(rep.to_text())
    if json_out:
        _write_json(json_out, rep.to_dict(), default=str)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--perfetto", "perfetto_out", type=click.Path(dir_okay=False), required=True,
              help="Write a Perfetto trace (.pftrace) with every rank's GPU streams, CPU threads and analysis tracks.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-trace cache.")
def export(paths, perfetto_out, no_cache):
    """Export traces plus findings (sync waits, exposed comm, host syncs, idle causes) for ui.perfetto.dev."""
    from . import analyze as run_analysis, load
    from .export_perfetto import export_perfetto

    try:
        import perfetto  # noqa: F401
    except ImportError:
        _fail("the perfetto package is not installed: pip install perfetto")
    a = run_analysis(load(list(paths), cache=not no_cache))
    res = export_perfetto(a, perfetto_out)
    _echo(f"wrote {res['path']}: {res['tracks']} tracks, {res['slices']} slices; open it in https://ui.perfetto.dev")


@main.command()
@click.argument("run", type=click.Path())
@click.option("-o", "--out", type=click.Path(), help="ppvis.html path, or a directory to write ppvis.html into (default: RUN/ppvis.html, or NAME.ppvis.html beside a trace file).")
@click.option("--open", "open_browser", is_flag=True, help="Open the page in a browser when done.")
@click.option("--perfetto", "perfetto_out", type=click.Path(dir_okay=False), help="Also write a Perfetto trace: one track per rank and stage, plus bubbles.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write bubbles, stage balance and the statement as JSON.")
@click.option("--step", type=click.IntRange(0), default=None, help="Analyze this step only (default: all but the first, warm-up, step).")
@click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-trace cache.")
@click.option("--no-traces", is_flag=True, help="Do not read RUN/traces: the bubble account then cannot tell communication from host overhead.")
def ppvis(run, out, open_browser, perfetto_out, json_out, step, no_cache, no_traces):
    """Pipeline schedule of RUN (a run dir, or traces with pipeline/{F|B|W}/s<stage>/mb<n> ranges): per-rank
    lanes, bubble ratio per rank vs theory, stage imbalance and the stage to fix. See docs/pipeline.md."""
    from .analysis.pipeline import load_pipeline
    from reports.pipeline import write_ppvis

    res = load_pipeline(run, step=step, cache=not no_cache, traces=not no_traces)
    for w in res.warnings:
        _echo(f"tracelens: warning: {w}", err=True)
    _echo(res.to_text())
    if out and not out.endswith(".html"):
        html_path = Path(out) / "ppvis.html"
    elif out:
        html_path = Path(out)
    elif Path(run).is_dir():
        html_path = Path(run) / "ppvis.html"
    else:
        html_path = _default_out((run,)).with_suffix(".ppvis.html")
    written = [write_ppvis(res, html_path, title=f"tracelens ppvis: {Path(run).resolve().name}")]
    if perfetto_out:
        from .export_perfetto import export_pipeline_perfetto

        written.append(Path(export_pipeline_perfetto(res, perfetto_out)["path"]))
    if json_out:
        written.append(_write_json(json_out, res.to_dict(), echo=None, default=str))
    _echo(f"wrote {', '.join(str(p) for p in written)}")
    if open_browser:
        _open_report(written[0])


@main.command()
@click.option("--pp", type=click.IntRange(1), required=True, help="Pipeline stages.")
@click.option("--vpp", type=click.IntRange(1), default=1, show_default=True, help="Virtual stages per rank (interleaved).")
@click.option("--ga", type=click.IntRange(1), default=None, help="Microbatches per step (gradient accumulation).")
@click.option("--global-tokens", type=click.IntRange(1), default=None, help="Global batch in tokens (GA is derived).")
@click.option("--seq", type=click.IntRange(1), default=None, help="Sequence length (with --global-tokens).")
@click.option("--mbs", type=click.IntRange(1), default=1, show_default=True, help="Micro-batch size (with --global-tokens).")
@click.option("--world", type=click.IntRange(1), default=None, help="World size (with --global-tokens).")
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True)
@click.option("--cp", type=click.IntRange(1), default=1, show_default=True)
def bubble(pp, vpp, ga, global_tokens, seq, mbs, world, tp, cp):
    """Theoretical pipeline bubble ratio per schedule (GPipe, 1F1B, interleaved, ZB-H1, ZBV)."""
    from .analysis.bubble import bubble_report

    if ga is None and not (global_tokens and seq and world):
        _fail("bubble: give --ga, or --global-tokens with --seq and --world (and --mbs, --tp, --cp)")
    if ga is not None and global_tokens is not None:  # --ga won, and the global batch was silently not used
        _fail("bubble: give --ga or --global-tokens (which derives the GA), not both")
    click.echo(bubble_report(pp, vpp, ga, global_tokens=global_tokens, seq=seq, mbs=mbs, world=world, tp=tp,
                             cp=cp).to_text())


@main.command()
@click.argument("space_file", type=click.Path())
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False), help="Sweep directory (results store, trials, report).")
@click.option("--strategy", type=click.Choice(["guided", "grid", "random", "tpe"]), default="guided", show_default=True,
              help="guided: trace-driven; grid: every allowed point; random: shuffled grid; tpe: Optuna (optional).")
@click.option("--resume", is_flag=True, help="Continue a killed sweep in OUT: finished trials are not run again.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random and tpe strategies.")
def autotune(space_file, out, strategy, resume, seed):
    """Run a sweep of real trainer runs over the knobs in SPACE_FILE (YAML; see docs/autotune.md),
    steered by the analyzer's findings, and write OUT/sweep.html, OUT/best.yaml and the results store
    OUT/sweep.sqlite."""
    from autotune.space import SpaceError, load_space
    from autotune.store import StoreError
    from autotune.sweep import SweepError, run_sweep
    from reports import sweep as sweep_report

    try:
        space = load_space(space_file)
        from .progress import bar

        with bar(total=space.max_trials, desc="autotune trials", unit="trial") as b:
            def log(m: str) -> None:
                b.write(m) if not b.disable else click.echo(m)
                if m.startswith("[autotune] trial ") and " -> " in m:
                    b.update(1)

            res = run_sweep(space, out, strategy=strategy, resume=resume, seed=seed, log=log)
    except (SpaceError, SweepError, StoreError) as e:
        _fail(str(e))
    paths = sweep_report.write(res, space)
    if res.best:
        click.echo(f"best: trial {res.best['id']} {res.best['knobs']} -> {space.objective} {res.best['objective']:.6g}")
    click.echo(f"ran {res.ran} trial(s) now, {len(res.trials)} in the store")
    click.echo(f"stopped: {res.stopped}; wrote {', '.join(str(p) for p in paths.values())}")


@main.command()
@click.argument("run", type=click.Path())
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="A changed trainer key (repeatable), e.g. --set micro_batch_size=8 --set grouped_gemm_backend=torch.")
@click.option("--kernel-table", type=click.Path(dir_okay=False),
              help="Grouped-GEMM timings (`tracelens kernels tune --json` rows or the tuner cache) for the backend knob.")
@click.option("--memory-gib", type=_FiniteFloatRange(min=0.001), help="Memory capacity to fit in (default: the GPU's).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the prediction here.")
def whatif(run, sets, kernel_table, memory_gib, json_out):
    """Predict step time, tokens/s/GPU and peak memory of RUN with changed trainer keys, component by
    component, from RUN's profiled step (the host/device replay, calibrated to its measured step time).
    See docs/whatif.md."""
    from .projection.whatif import Model, ProfileError, WhatIfError, parse_sets

    try:
        changes = parse_sets(list(sets))
        m = Model.from_run(run, kernel_table=kernel_table, capacity_gib=memory_gib)
        p = m.predict(changes)
    except (WhatIfError, ProfileError) as e:
        _fail(" ".join(str(e).split()))
    _echo(p.to_text(run))
    if json_out:
        _write_json(json_out, p.to_dict(), default=str)


# ------------------------------------------------------------------ scale-out projection and the sharding planner
def _counts(text: str | None, flag: str) -> list[int] | None:
    """``--gpus 8,16,64`` -> [8, 16, 64]; a bad list is one line naming the flag."""
    if text is None:
        return None
    try:
        out = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        _fail(f"{flag} {text!r}: expected comma-separated whole numbers, e.g. 8,16,64")
    if not out or any(x < 1 for x in out):
        _fail(f"{flag} {text!r}: expected comma-separated whole numbers >= 1")
    return out


def _network_options(f):
    """The network model's flags (docs/whatif.md, "Scale-out projection and the planner"), shared by scaleout and plan."""
    for opt in reversed((
            click.option("--network", "network_path", type=click.Path(dir_okay=False),
                         help="Network description (YAML or JSON: gpus_per_node, inter_node_gbps, inter_node_efficiency, "
                              "inter_node_latency_us, intra_node_busbw_gb_s); flags override it."),
            click.option("--gpus-per-node", type=int, default=None, help="GPUs per node (default 8, assumed)."),
            click.option("--inter-node-gbps", type=float, default=None,
                         help="Inter-node bandwidth per GPU in Gb/s, line rate (default 400, assumed)."),
            click.option("--inter-node-efficiency", type=float, default=None,
                         help="Share of the inter-node line rate a collective reaches (default 0.9, assumed)."),
            click.option("--inter-node-latency-us", type=float, default=None,
                         help="Inter-node latency per message step in us (default 5, assumed)."),
            click.option("--intra-node-busbw", "intra_node_busbw_gb_s", type=float, default=None,
                         help="Intra-node bus bandwidth in GB/s (default: measured from the run's trace)."),
            click.option("--kernel-table", type=click.Path(dir_okay=False),
                         help="Grouped-GEMM timings for the what-if's backend knob (as `tracelens whatif`)."),
            click.option("--memory-gib", type=_FiniteFloatRange(min=0.001),
                         help="Memory capacity per GPU to fit in (default: the run's GPU's)."))):
        f = opt(f)
    return f


def _net_flags(kw: dict) -> dict:
    return {k: kw.pop(k) for k in ("gpus_per_node", "inter_node_gbps", "inter_node_efficiency", "inter_node_latency_us",
                                   "intra_node_busbw_gb_s")}


@main.command()
@click.argument("run", type=click.Path(), required=False)
@click.option("--gpus", "gpus_text", metavar="N,N,...", help="GPU counts to project to, e.g. 8,16,64,256,1024.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="A trainer key for every projected layout (repeatable), e.g. --set ep=8 --set micro_batch_size=8.")
@click.option("--ep", "ep_text", metavar="N,N,...", help="EP sizes of the EP scaling table (default: every one that "
              "divides the experts and the GPUs).")
@click.option("--ep-gpus", "ep_gpus_text", metavar="N,N,...", help="GPU counts of the EP scaling table (default: --gpus).")
@click.option("--pp", "pp_text", metavar="N,N,...", help="Pipeline sizes of the bubble table (default: 2, 4, 8, 16 "
              "up to the layers).")
@click.option("--bubble-gpus", type=click.IntRange(1), default=None,
              help="GPU count of the bubble table (default: the largest of --gpus).")
@click.option("--validate", "measured", type=click.Path(dir_okay=False),
              help="Project every point of a measured.json (benchmarks/bench_whatif_layouts.py format, with 'gpus' per "
                   "point) from its baselines and report the errors; RUN and --gpus are then not needed.")
@_network_options
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the tables (or the validation) here.")
def scaleout(run, gpus_text, sets, ep_text, ep_gpus_text, pp_text, bubble_gpus, measured, json_out, network_path,
             kernel_table, memory_gib, **kw):
    """Project a profiled 1-4 GPU run to more GPUs over several nodes: tokens/s/GPU, the step's parts, the exposed
    all-to-all share, DP scaling efficiency, EP scaling, the bubble per schedule and memory per GPU, with a stated
    network model (intra-node bandwidth measured from the trace, inter-node from --network or flags). See
    docs/whatif.md, "Scale-out projection and the planner"."""
    from .projection import scaleout as SO
    from .projection.measured import MeasuredError
    from .projection.whatif import ProfileError, WhatIfError, parse_sets

    flags = _net_flags(kw)
    try:
        if measured:
            res = SO.validate(measured, kernel_table, network_path, **flags)
            _echo(SO.validation_text(res))
            if json_out:
                _write_json(json_out, res, default=str)
            return
        if run is None or gpus_text is None:
            _fail("scaleout: give RUN and --gpus (or --validate MEASURED.json)")
        gpus = _counts(gpus_text, "--gpus")
        changes = parse_sets(list(sets))
        so = SO.ScaleOut.from_run(run, network_path, kernel_table, memory_gib, **flags)
        for n in gpus:
            so.target(n, changes)  # a count the layout cannot fill: one line, before any table
        rep = SO.report(so, gpus, changes, _counts(ep_text, "--ep"), _counts(ep_gpus_text, "--ep-gpus"),
                        _counts(pp_text, "--pp"), bubble_gpus)
    except (WhatIfError, ProfileError, MeasuredError) as e:
        _fail(" ".join(str(e).split()))
    _echo(rep.to_text())
    if json_out:
        _write_json(json_out, rep.to_dict(), default=str)


@main.command()
@click.argument("config")
@click.option("--gpus", type=click.IntRange(1), required=True, help="GPUs to plan for.")
@click.option("--global-batch", type=click.IntRange(1), required=True, help="Global batch in sequences per step.")
@click.option("--from", "run", type=click.Path(), default=None,
              help="The profiled run dir the speeds are projected from (without it: memory --sweep's order).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key (repeatable).")
@click.option("--mbs", "mbs_text", metavar="N,N,...", default=None,
              help="Micro-batch sizes to enumerate (default 1,2,4,8,16).")
@click.option("--device", "device_name", default=None, help="Device name for its memory (H100, H200, ...; default: "
              "the --from run's GPU).")
@click.option("--device-memory", default=None, help="Device memory, e.g. 80GiB (overrides --device).")
@click.option("--headroom", type=_FiniteFloatRange(0, 0.9), default=0.05, show_default=True,
              help="Share of device memory kept free when deciding what fits.")
@click.option("--top", type=click.IntRange(1, 10000), default=15, show_default=True, help="Layouts to print.")
@_network_options
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write every ranked layout here.")
def plan(config, gpus, global_batch, run, overrides, mbs_text, device_name, device_memory, headroom, top, json_out,
         network_path, kernel_table, memory_gib, **kw):
    """The sharding planner: the DP x EP x PP layouts of CONFIG (a trainer YAML, config name, manifest or run dir) that
    fit --gpus GPUs at --global-batch (memory --sweep's enumeration), ranked by tokens/s/GPU projected from the --from
    profile, each with its bubble, all-to-all share, peak memory and the profile it came from. See docs/whatif.md."""
    from .analysis import memory as M
    from .projection import planner as PL
    from .projection import scaleout as SO
    from .projection.whatif import ProfileError, WhatIfError

    flags = _net_flags(kw)
    if run is None:  # they feed the projection from a profile only: without --from they were silently ignored
        unused = [name for name, v in (("--network", network_path), ("--gpus-per-node", flags["gpus_per_node"]),
                                       ("--inter-node-gbps", flags["inter_node_gbps"]),
                                       ("--inter-node-efficiency", flags["inter_node_efficiency"]),
                                       ("--inter-node-latency-us", flags["inter_node_latency_us"]),
                                       ("--intra-node-busbw", flags["intra_node_busbw_gb_s"]),
                                       ("--kernel-table", kernel_table), ("--memory-gib", memory_gib)) if v is not None]
        if unused:
            _fail(f"plan: {', '.join(unused)} shape(s) the projection from a profile: give --from RUN (without it, "
                  "--device or --device-memory sets what fits)")
    mc = M.load_model_config(config, overrides)
    for w in mc.warnings:
        _echo(f"tracelens: warning: {w}", err=True)
    try:
        so = SO.ScaleOut.from_run(run, network_path, kernel_table, memory_gib, **flags) if run else None
        dev = M.capacity(device_memory, device_name)
        if dev is None and so is not None and so.model.capacity_bytes:
            dev = int(so.model.capacity_bytes)
        if dev is None:
            _fail("plan: give --device or --device-memory (or --from a run whose trace names its GPU)")
        mbs = tuple(_counts(mbs_text, "--mbs") or PL.DEFAULT_MBS)
        res = PL.plan(mc, gpus, global_batch, dev, so, mbs=mbs, headroom=headroom, source=config)
    except (WhatIfError, ProfileError) as e:
        _fail(" ".join(str(e).split()))
    _echo(res.to_text(top=top))
    if json_out:
        _write_json(json_out, res.to_dict(), default=str)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--ceilings", type=click.Path(dir_okay=False), help="Measured ceilings JSON (see docs/roofline.md), overriding the datasheet.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the roofline tables and summary here.")
@click.option("--top", type=click.IntRange(1, 10000), default=15, show_default=True)
@click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-trace cache.")
def roofline(paths, ceilings, json_out, top, no_cache):
    """Roofline: FLOPs and bytes of each op from its recorded shapes, achieved TFLOP/s and TB/s, % of the
    device's ceilings, compute- vs memory-bound. See docs/roofline.md."""
    from . import analyze as run_analysis, load
    from .analysis.roofline import NO_GPU_TEXT

    a = run_analysis(load(list(paths), cache=not no_cache))
    if not a.has_gpu:
        click.echo(NO_GPU_TEXT)
        return
    try:
        r = a.roofline(ceilings=ceilings) if ceilings else a.roofline()
    except (OSError, ValueError) as e:
        _fail(f"{ceilings}: {e}")
    for w in r.warnings:
        _echo(f"tracelens: warning: {w}", err=True)
    _echo(r.to_text(top=top))
    if json_out:
        _write_json(json_out, r.to_dict(), default=str)


@main.command()
@click.argument("config")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a trainer config key (repeatable).")
@click.option("--world", type=int, default=None, help="GPUs (default: the manifest's world size, else pp*tp*cp*dp).")
@click.option("--pp", type=int, default=None, help="Pipeline stages.")
@click.option("--vpp", type=int, default=None, help="Virtual stages per rank (interleaved schedule).")
@click.option("--ep", type=int, default=None, help="Expert parallel size (default: the config's ep).")
@click.option("--tp", type=int, default=None, help="Tensor parallel size (with sequence parallelism).")
@click.option("--cp", type=int, default=None, help="Context parallel size.")
@click.option("--dp", type=int, default=None, help="Data parallel size (gives the world size with pp, tp, cp).")
@click.option("--mbs", type=int, default=None, help="Micro-batch size (default: micro_batch_size).")
@click.option("--seq", type=int, default=None, help="Sequence length (default: seq_len).")
@click.option("--ga", "microbatches", type=int, default=None, help="Microbatches per step (default 1, or 4*pp with pp > 1).")
@click.option("--global-batch", type=int, default=None, help="Global batch in sequences (GA = global / (mbs*dp)); needed by --sweep.")
@click.option("--schedule", type=click.Choice(list(_MODELED_SCHEDULES)), default=None)
@click.option("--recompute", default=None, help="none, full, or comma-separated layer ids (default: recompute_layer_ids).")
@click.option("--sync-free-level", type=int, default=None)
@click.option("--loss-fusion/--no-loss-fusion", default=None)
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default=None)
@click.option("--dp-mode", type=click.Choice(["fsdp", "ddp"]), default=None, help="fsdp = ZeRO-3 (FSDP2), ddp = ZeRO-0.")
@click.option("--zero", type=click.IntRange(0, 3), default=None, help="ZeRO level (overrides --dp-mode).")
@click.option("--device-memory", default=None, help="Device memory, e.g. 80GiB or 141GB.")
@click.option("--device", "device_name", default=None, help="Device name for its memory (H100, H200, B200, MI300X...).")
@click.option("--headroom", type=_FiniteFloatRange(0, 0.9), default=0.05, show_default=True, help="Share of device memory kept free when deciding what fits.")
@click.option("--sweep", "do_sweep", is_flag=True, help="Enumerate layouts for --world that fit the device, ranked by bubble then communication.")
@click.option("--top", type=click.IntRange(1, 10000), default=15, show_default=True, help="Sweep: layouts to print.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the projection (or sweep) as JSON.")
@click.option("-o", "--out", type=click.Path(), default=None, help="Write an HTML report (a .html path, or a directory for memory.html).")
def memory(config, overrides, world, pp, vpp, ep, tp, cp, dp, mbs, seq, microbatches, global_batch, schedule, recompute,
           sync_free_level, loss_fusion, dtype, dp_mode, zero, device_memory, device_name, headroom, do_sweep, top,
           json_out, out):
    """Projected per-GPU memory by component for CONFIG (a trainer YAML, a config name, a run's
    manifest.json or run dir) under a parallel layout; --sweep lists the layouts that fit. See docs/memory.md."""
    from .analysis import memory as M

    if do_sweep:  # the sweep enumerates these itself (docs/memory.md, "Sweep"): given, they were silently not used
        fixed = [name for name, v in (("--pp", pp), ("--vpp", vpp), ("--ep", ep), ("--tp", tp), ("--cp", cp),
                                      ("--mbs", mbs), ("--ga", microbatches), ("--recompute", recompute))
                 if v is not None]
        if fixed:
            _fail(f"memory: --sweep enumerates the layouts itself: {', '.join(fixed)} would not be used (drop "
                  "--sweep to project one layout)")
    mc = M.load_model_config(config, overrides)
    for w in mc.warnings:
        _echo(f"tracelens: warning: {w}", err=True)
    cfg, lay = M.layout_for(mc, source=config, dp_mode=dp_mode, world=world, pp=pp, vpp=vpp, ep=ep, tp=tp, cp=cp,
                            dp=dp, mbs=mbs, seq=seq, microbatches=microbatches, global_batch=global_batch,
                            schedule=schedule, recompute=recompute, sync_free_level=sync_free_level,
                            loss_fusion=loss_fusion, dtype=dtype, zero=zero, sweep=do_sweep)
    dev_bytes = M.capacity(device_memory, device_name)
    if do_sweep:
        if dev_bytes is None or global_batch is None:
            _fail("memory: --sweep needs --device-memory (or --device) and --global-batch")
        from .progress import bar

        with bar(desc="memory sweep (pp x tp x cp groups)", unit=" group") as b:
            def tick(done, total):
                b.total = total
                b.n = done
                b.refresh()

            rep = M.sweep_report(mc, cfg, lay, dev_bytes, global_batch, headroom=headroom, top=top, progress=tick)
    else:
        rep = M.memory_report(mc, cfg, lay, dev_bytes, headroom=headroom)
    click.echo(rep.to_text())
    if json_out:
        _write_json(json_out, rep.to_dict(), echo=click.echo)
    if out:
        from reports.memory import write_memory_report

        path = Path(out) if out.endswith(".html") else Path(out) / "memory.html"
        from .io.run import MANIFEST

        src = Path(mc.source)  # a run dir's manifest is named by its run dir, not by the manifest's file name
        write_memory_report(rep.projections, path, title=f"tracelens memory: {(src.parent if src.name == MANIFEST else src).name}",
                            device_bytes=dev_bytes, measured_bytes=mc.measured_peak_bytes if mc.measured_on_gpu else None)
        click.echo(f"wrote {path}")


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--op", "op_name", default=None, help="Replay this op (e.g. aten::mm).")
@click.option("--index", type=click.IntRange(0), default=0, show_default=True, help="With --op: which call (rank, then time order).")
@click.option("--top", type=click.IntRange(1, 1000), default=None, help="Replay the N op signatures with the most trace time.")
@click.option("-o", "--out", type=click.Path(file_okay=False), default="replay", show_default=True, help="Directory for the scripts.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-trace cache.")
def replay(paths, op_name, index, top, out, no_cache):
    """Write standalone PyTorch scripts that rerun ops of a trace on random inputs of the recorded shapes,
    dtypes and strides and print their time next to the trace's (a minimal reproducer; see docs/replay.md)."""
    from . import load
    from . import replay as R

    if (op_name is None) == (top is None):
        _fail("replay: give exactly one of --op NAME or --top N")
    trace = load(list(paths), cache=not no_cache)
    if op_name is not None:
        call = R.find_call(trace, op_name, index)
        if not call.replayable:
            _fail(f"replay: {call.name} (call {index}) cannot be replayed: {call.reason}")
        path = R.write_script(call, Path(out) / R.script_name(call))
        _echo(f"{call.name} call {index}: dims {json_dumps(call.input_dims)}, trace {call.clock} time "
                   f"{call.trace_us:.3f} us\nwrote {path}  (run: python {path})")
        return
    calls, cands = R.top_calls(trace, top)
    _echo(f"{'op':<38} {'input dims':<44} {'calls':>5} {'mean us':>10}  script / why not")
    for c, r in zip(calls, cands.head(top).itertuples(index=False)):
        where = str(R.write_script(c, Path(out) / R.script_name(c))) if c.replayable else f"cannot replay: {c.reason}"
        _echo(f"{c.name[:38]:<38} {str(r.input_dims)[:44]:<44} {r.count:>5} {r.mean_us:>10.2f}  {where}")
    n_ok = sum(c.replayable for c in calls)
    _echo(f"{n_ok} of {len(calls)} replayable; times are {calls[0].clock if calls else 'gpu'} time per call")


def json_dumps(v) -> str:
    import json

    return json.dumps(v, separators=(",", ":"))


def _import_torch_tools(what: str):
    """torch and the kernels package for a GPU-side command, or a one-line error (exit 2) naming why not."""
    try:
        import torch  # noqa: F401

        import kernels
    except Exception as e:  # ImportError, or a broken install
        _fail(f"{what} needs torch and triton (pip install -e '.[kernels]'): {type(e).__name__}: {e}")
    return kernels


@main.group()
def kernels():
    """The Triton kernels of the trainer (docs/kernels.md)."""


@kernels.command("tune")
@click.option("--shapes", "shapes", multiple=True, metavar="T,K,N,E",
              help="Grouped GEMM [T,K] x [E,K,N] to tune (repeatable). Default: DeepSeek-V2-Lite experts on a GPU.")
@click.option("--config", "config", default=None, help="Tune the expert GEMMs of this trainer config (YAML file or name).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a key of --config (repeatable).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Default: the config's dtype with --config, else bf16.")
@click.option("--passes", multiple=True, type=click.Choice(["fwd", "dx", "dw"]), help="Default: all three.")
@click.option("--backends", "backend_names", multiple=True, metavar="NAME", help="Only these backends (default: all that can run).")
@click.option("--warmup", type=click.IntRange(0), default=None, help="Default 3 on a GPU, 0 on the CPU interpreter.")
@click.option("--reps", type=click.IntRange(1), default=None, help="Timed runs per backend (median). Default 10 on a GPU, 1 on CPU.")
@click.option("--no-save", is_flag=True, help="Do not write the winners to the tuning cache.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write every timing row here.")
def kernels_tune(shapes, config, overrides, dtype, passes, backend_names, warmup, reps, no_save, json_out):
    """Time every grouped-GEMM backend per pass (fwd, dX, dW) on the given shapes and cache the winners
    that grouped_gemm_backend=auto uses. On a CPU it needs TRITON_INTERPRET=1 (tiny shapes only)."""
    import json

    from .gputools import DTYPES, format_tune_rows, parse_shape, winners_by_shape

    if shapes and config:
        _fail("kernels tune: give --shapes or --config, not both")
    if overrides and not config:
        _fail("kernels tune: --set needs --config")
    try:
        todo = [parse_shape(s) for s in shapes]
    except ValueError as e:
        _fail(f"kernels tune: {e}")
    if config:
        from moespec.config import ConfigError, load_config
        from moespec.gemm_shapes import expert_gemm_dtype, expert_gemm_shapes

        try:
            cfg = load_config(config, list(overrides))
        except ConfigError as e:
            _fail(f"{config}: {e}")
        todo = [(g.T, g.K, g.N, g.E) for g in expert_gemm_shapes(cfg)]
        if not todo:
            _fail(f"{config}: no MoE layers (first_k_dense >= n_layers): nothing to tune")
        dtype_name = DTYPES[dtype] if dtype else expert_gemm_dtype(cfg)
    else:
        dtype_name = DTYPES[dtype or "bf16"]
    K = _import_torch_tools("kernels tune")
    import torch

    if torch.cuda.is_available():
        device = "cuda"
    elif K.INTERPRET:
        device = "cpu"
    else:
        _fail("kernels tune: no GPU present, and the Triton interpreter is off; run it on the GPU, or set "
              "TRITON_INTERPRET=1 to tune tiny shapes on the CPU")
    from kernels import backends as B

    unknown = [b for b in backend_names if b not in B.BACKENDS]
    if unknown:
        _fail(f"kernels tune: unknown backend(s) {unknown}; registered: {sorted(B.BACKENDS)}")
    cpu = device == "cpu"
    rows = K.tune_table(todo or None, dtype=dtype_name, device=device, passes=passes or B.PASSES,
                        backends=list(backend_names) or None, warmup=(0 if cpu else 3) if warmup is None else warmup,
                        reps=(1 if cpu else 10) if reps is None else reps, save=not no_save)
    click.echo(f"device {B.device_name(device)}, dtype {dtype_name}" + (" (Triton CPU interpreter)" if cpu else ""))
    for line in format_tune_rows(rows):
        click.echo(line)
    for (T, Kd, N, E), won in winners_by_shape(rows).items():
        click.echo(f"winners T={T} K={Kd} N={N} E={E}: " + ", ".join(f"{p} {b}" for p, b in won.items()))
    if not no_save:
        click.echo(f"cached in {B.cache_path()}")
    if json_out:
        Path(json_out).write_text(json.dumps({"schema_version": 1, "rows": rows}, indent=1))
        click.echo(f"wrote {json_out}")


@main.command()
@click.option("-o", "--out", default="ceilings.json", show_default=True, type=click.Path(dir_okay=False),
              help="Measured-ceilings JSON to write (for roofline/analyze --ceilings).")
@click.option("--cpu", is_flag=True, help="Measure this machine's CPU instead of a GPU (labelled as such).")
@click.option("--size", type=click.IntRange(64), default=None, help="Matmul n for n x n x n (default 8192; 1024 with --cpu).")
@click.option("--mem-mib", type=click.IntRange(1), default=None, help="Buffer for the bandwidth test (default 2048; 256 with --cpu).")
@click.option("--dtypes", multiple=True, type=click.Choice(["bf16", "fp16", "tf32", "fp32"]),
              help="Matmul dtypes (default: bf16 fp16 tf32 fp32; bf16 fp32 with --cpu).")
@click.option("--reps", type=click.IntRange(1), default=10, show_default=True, help="Timed runs per measurement (median).")
def calibrate(out, cpu, size, mem_mib, dtypes, reps):
    """Measure the device's ceilings -- dense matmul TFLOP/s per dtype and memory bandwidth -- and write them
    as a ceilings JSON that `tracelens roofline --ceilings` and `tracelens analyze --ceilings` accept."""
    import json

    from . import devices
    from .gputools import format_ceilings

    _import_torch_tools("calibrate")
    import torch

    from kernels import calibrate as C

    if not cpu and not torch.cuda.is_available():
        _fail("calibrate: no GPU present (torch sees no CUDA device); pass --cpu to measure this machine's CPU instead")
    try:
        m = C.measure(cpu=cpu, n=size, mem_bytes=mem_mib << 20 if mem_mib else None, dtypes=dtypes or None,
                      reps=reps, log=lambda s: click.echo(f"  {s}", err=True))
    except ValueError as e:
        _fail(f"calibrate: {e}")
    doc = C.ceilings_json(m)
    devices.load_measured(doc)  # the file must be one that --ceilings accepts
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    for line in format_ceilings(doc, m["memory"]):
        click.echo(line)
    if cpu:
        click.echo("note: CPU figures (host memory as hbm_tbps); they do not describe a GPU")
    click.echo(f"wrote {out}  (use: tracelens roofline --ceilings {out} RUN)")


def _print_summary(result) -> None:
    from .analyzer import summary_text

    _echo(summary_text(result))


if __name__ == "__main__":  # pragma: no cover
    main()

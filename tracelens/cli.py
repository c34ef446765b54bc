"""The `tracelens` command line: a thin shell over the Python API.

This module is the one place in the `tracelens` package that reaches the other packages (reports,
and the trainer / autotune as subprocesses), always lazily inside a command, so `import tracelens`
stays free of them. Bad input ends with one line, `tracelens: error: <file>: <problem>`, and exit
status 2; set TRACELENS_DEBUG=1 to see tracebacks of internal errors.
"""

from __future__ import annotations

import os
import sys
import time
import webbrowser
from pathlib import Path

import click

from . import __version__
from .errors import TraceError


def _fail(message: str, code: int = 2) -> None:
    click.echo(f"tracelens: error: {message}", err=True)
    sys.exit(code)


def _default_out(paths: tuple[str, ...]) -> Path:
    first = Path(paths[0])
    if first.is_dir():
        return first if (first / "manifest.json").exists() else first / "tracelens"
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
        except MemoryError:
            _fail("out of memory while analyzing; try fewer ranks at once", 3)
        except Exception as e:  # an internal bug: one line by default, the traceback on request
            if os.environ.get("TRACELENS_DEBUG"):
                raise
            _fail(f"internal error: {type(e).__name__}: {e} (set TRACELENS_DEBUG=1 for the traceback)", 3)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tracelens")
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
def analyze(paths, out, open_browser, no_cache, no_report, no_tables, jobs, quiet):
    """Analyze traces: PATHS are trace files (.json/.json.gz), directories of per-rank traces, or run dirs.

    Writes report.html, summary.json and tables/ (Parquet + CSV) into the output directory.
    """
    from . import analyze as run_analysis, load
    from reports.artifacts import write_all

    t0 = time.perf_counter()
    trace = load(list(paths), cache=not no_cache, jobs=jobs, progress=None if not quiet else False)
    result = run_analysis(trace)
    out_dir = Path(out) if out else _default_out(paths)
    written = write_all(result, out_dir, report=not no_report, tables=not no_tables)
    if not quiet:
        for w in result.warnings:
            click.echo(f"tracelens: warning: {w}", err=True)
        _print_summary(result)
        click.echo(f"wrote {out_dir} ({', '.join(p.name for p in written.values())}) in {time.perf_counter() - t0:.2f}s")
    if open_browser and "report" in written:
        webbrowser.open(written["report"].resolve().as_uri())


def _print_summary(result) -> None:
    tl = result.timeline
    if tl.empty:
        click.echo("no GPU activity in these traces (CPU-only): GPU timeline unavailable")
        return
    click.echo(f"{'rank':>4} {'span ms':>10} {'busy %':>7} {'compute ms':>11} {'comm ms':>9} {'exposed ms':>11} {'kernels':>8}")
    for r in tl.itertuples(index=False):
        busy = 100.0 * r.gpu_busy_us / r.span_us if r.span_us else 0.0
        click.echo(f"{r.rank:>4} {r.span_us / 1e3:>10.3f} {busy:>7.1f} {r.compute_us / 1e3:>11.3f} "
                   f"{r.comm_us / 1e3:>9.3f} {r.exposed_comm_us / 1e3:>11.3f} {r.kernel_count:>8}")


if __name__ == "__main__":  # pragma: no cover
    main()

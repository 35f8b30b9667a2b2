"""The `fusion-advisor` command line: one sub-command per user-facing stage."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from advisor.cli_options import (Device, Granularity, Replacement, calls_option, chosen_schedule, device_option,
                                 nproc_option, out_option, region_option, schedule_option, top_option)
from advisor.errors import AdvisorError
from advisor.documents import ANALYSIS_FILE, APPLY_FILE, AnalysisDoc, write_analysis
from advisor.layout import TRACE_DIR, drop_stale_kernels, locate
from advisor.report import render_reports

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Profiler-driven kernel-fusion advisor for PyTorch.",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
err = Console(stderr=True)
PROG = "fusion-advisor"


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        from advisor.version import __version__

        try:
            torch_version = version("torch")  # metadata only: importing torch would take seconds
        except PackageNotFoundError:
            torch_version = "not installed"
        print(f"{PROG} {__version__} (torch {torch_version})")
        raise typer.Exit()


def _verbose(value: bool) -> None:
    """The package's decisions on stderr: what the fusion rules refused and why, each stage's choices
    (the `advisor` loggers at debug level; without -v only their warnings show)."""
    if value:
        import logging

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger = logging.getLogger("advisor")
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                 help="Print the version and exit."),
    verbose: bool = typer.Option(False, "--verbose", "-v", callback=_verbose, is_eager=True,
                                 help="Log the advisor's decisions (what was not fused, and why) on stderr."),
):
    """Profiler-driven kernel-fusion advisor for PyTorch."""


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def profile(
    ctx: typer.Context,
    script: Path = typer.Argument(..., help="Python script to run as __main__ (arguments for it go after `--`)."),
    out: Path = out_option(),
    device: Device = device_option(),
    region: Optional[str] = region_option(),
    calls: Optional[int] = calls_option(),
    schedule: Optional[str] = schedule_option(),
    nproc_per_node: Optional[int] = nproc_option(),
):
    """Run SCRIPT under torch.profiler + ExecutionTraceObserver and write a trace directory.

    Writes OUT/trace/kineto.json.gz, et.json.gz and meta.json (OUT/trace/rank-K/ per rank of a distributed
    job). Exit codes: the script's own when it fails (sys.exit(N) gives N, an exception 1; the partial trace
    is written; with --nproc-per-node the first failed rank's), 2 bad input, 4 the script did no tensor work,
    130 interrupted (Ctrl-C; the trace so far is written).
    """
    _profile(script, list(ctx.args), out, device=device.value, region=region,
             schedule=chosen_schedule(calls, schedule), nproc=nproc_per_node)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    script: Optional[Path] = typer.Argument(None, help="Workload script (default: the bundled demo workload)."),
    out: Path = out_option(),
    device: Device = device_option(),
    region: Optional[str] = region_option(),
    calls: Optional[int] = calls_option(),
    schedule: Optional[str] = schedule_option(),
    top: int = top_option(),
    nproc_per_node: Optional[int] = nproc_option(),
):
    """Profile SCRIPT, then analyse the trace: `profile` and `analyze` in one go."""
    chosen = chosen_schedule(calls, schedule)
    script, args = _script_or_demo(script, list(ctx.args))
    _profile(script, args, out, device=device.value, region=region, schedule=chosen, totals=False,
             nproc=nproc_per_node)
    _report_written(_analyze_and_report(out / TRACE_DIR, out=out, top=top))


@app.command()
def analyze(
    trace: Path = typer.Argument(..., help="OUT or OUT/trace from `profile`, or a Kineto .json/.json.gz."),
    et: Optional[Path] = typer.Option(None, "--et", help="Execution trace file (when TRACE is a bare Kineto file)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where to write analysis.json and the reports "
                                       "(default: OUT, the directory holding the trace/ folder)."),
    top: int = top_option(),
):
    """Find fusion candidates in a trace and estimate what each saves; writes analysis.json and the reports."""
    located = locate(trace)
    _report_written(_analyze_and_report(located.trace, et=et, out=out or located.out, top=top))


@app.command()
def generate(
    source: Path = typer.Argument(..., help="Directory with analysis.json, or a trace (directory or Kineto file) to analyse first."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default: OUT, where analysis.json is)."),
    top: int = top_option(),
):
    """Generate a fused Triton kernel per top candidate, validate each against PyTorch, write OUT/kernels/*.py and OUT/apply.json."""
    import json

    from rich.table import Table

    from advisor.workflows.generate import generate_candidates

    console = Console()
    source = Path(source)
    if not source.exists():
        raise AdvisorError(f"{source} does not exist")
    located = locate(source.parent if source.name == ANALYSIS_FILE else source)
    out_dir = Path(out or located.out)
    if located.analysis.is_file():
        doc = json.loads(located.analysis.read_text())
        if located.analysis.parent != out_dir:  # the report reads it beside apply.json
            write_analysis(out_dir, AnalysisDoc.from_json(doc))
    else:
        from advisor.analysis.api import analyze as run_analysis

        with console.status("analysing trace…"):
            result = run_analysis(located.trace)
        write_analysis(out_dir, result.document)
        doc = result.doc
    table = Table(title=f"generated kernels ({out_dir / 'kernels'})")
    for col in ("#", "pattern", "result", "rel_l2", "file"):
        table.add_column(col)

    shown = []

    def show(r):  # an advisor.records.PatternResult
        shown.append(r)
        ok = "[green]validated[/]" if r.validated else f"[yellow]{r.reason}[/]"
        rel = f"{r.errors['rel_l2']:.2g}" if r.errors and r.validated else ""
        table.add_row(r.candidate, r.title or "", ok, rel, Path(r.kernel_file).name if r.kernel_file else "")

    with console.status("generating and validating kernels…"):
        generate_candidates(doc, Path(out_dir), top=top, on_result=show)
    drop_stale_kernels(out_dir)
    console.print(table)
    n_ok = sum(r.validated for r in shown)
    console.print(f"{n_ok} of {len(shown)} patterns validated; results in [bold]{Path(out_dir) / APPLY_FILE}[/]")
    _report_written(render_reports(out_dir, console, top=top, terminal=False))


@app.command()
def report(
    directory: Path = typer.Argument(..., help="OUT (holding analysis.json, and apply.json if any) or OUT/trace."),
    top: int = top_option(),
):
    """Re-render the terminal and HTML reports from a directory, without re-running anything."""
    _report_written(render_reports(directory, top=top))


@app.command()
def bundle(
    directory: Path = typer.Argument(..., help="OUT of `optimize` or `apply` (holding analysis.json and apply.json)."),
    output: Path = typer.Option(..., "-o", "--output", help="The bundle file to write (e.g. plan.fab)."),
):
    """Write a portable plan bundle: the plan, its kernels and their compiled Triton binaries (patch with
    `advisor.patch(model, FILE)`: no profiling, generating or compiling where GPU, torch and Triton match)."""
    from advisor.workflows.bundle import save

    path = save(directory, output)
    Console().print(f"Bundle: {path}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def apply(
    ctx: typer.Context,
    script: Optional[Path] = typer.Argument(None, help="Workload script (arguments for it go after `--`; default: "
                                            "the bundled demo workload)."),
    top: int = top_option(),
    out: Path = out_option(what="Output directory, the only place written"),
    device: Device = device_option(),
    region: Optional[str] = region_option(),
    iters: int = typer.Option(20, "--iters", min=1, help="Timed iterations (after warm-up) of the steady state."),
    replacement: Replacement = typer.Option(Replacement.kernel, "--replacement", help="kernel: the generated Triton; "
                                            "program: the op program run by PyTorch; subgraph: stand-ins that replay "
                                            "the original ops (checks the patcher)."),
    granularity: Granularity = typer.Option(Granularity.layer, "--granularity", help="Modules captured: layer (one per "
                                            "repeated layer) | pattern (the one containing all of a pattern's "
                                            "occurrences) | occurrence (each) | root (the model)."),
    train: bool = typer.Option(False, "--train", help="The script trains: calls that need gradients run the fused "
                               "kernels with their generated, validated backwards, and the script's own runs (or "
                               "--region) are timed, each a whole training step (GPU)."),
    inductor: bool = typer.Option(False, "--inductor", help="Inductor compiles each capture around the fused "
                                  "kernels (patterns of pointwise, reduction and norm ops only left to it)."),
    autotune: bool = typer.Option(False, "--autotune", help="With --inductor's route: Inductor autotunes its GEMMs "
                                  "and launch configurations (torch.compile's max-autotune-no-cudagraphs; minutes)."),
):
    """Profile, analyse, generate, validate, patch and benchmark SCRIPT; writes OUT/apply.json.

    The script's models are patched as it builds them (its files are never edited): the first calls
    are compared patched vs unpatched, a pattern that changes the outputs is unpatched; then the
    steady-state iteration is timed before and after (GPU only; on the CPU timing is not meaningful).
    """
    from advisor.workflows.user_script import apply_script

    script, args = _script_or_demo(script, list(ctx.args))
    apply_script(script, args, out, top=top, device=device.value, region=region,
                 replacement=replacement.value, iters=iters, granularity=granularity.value, train=train,
                 inductor="max-autotune" if autotune else inductor)
    drop_stale_kernels(out)
    _report_written(render_reports(out, top=top, terminal=False))


def _script_or_demo(script: Optional[Path], args: List[str]) -> tuple:
    """(the script to run, its arguments): the bundled demo workload when no script is named. The demo is
    named by no path in what is printed (`next_step`): an editable reinstall moves the installed file."""
    if script is not None and str(script).startswith("-"):  # `run -- --iters 2`: arguments for the demo
        args, script = [str(script), *args], None
    if script is None:
        from advisor.demo_workload import __file__ as demo

        script = Path(demo)
    return script, args


def _profile(script: Path, args: List[str], out: Path, nproc: Optional[int] = None, **options) -> None:
    """profile_script (or, with `nproc`, that many ranks of it under torch.distributed.run), with Ctrl-C turned
    into exit 130 and a line saying where the partial trace is."""
    from advisor.collect.distributed import trace_dir_for
    from advisor.collect.launch import launch
    from advisor.collect.runner import profile_script
    from advisor.layout import rank_dirs

    try:
        if nproc is not None:
            options.pop("totals", None)
            launch(script, args, out, nproc, **options)
        else:
            profile_script(script, args, out_dir=out, **options)
    except KeyboardInterrupt:
        trace = out / TRACE_DIR if nproc is not None else trace_dir_for(out)[0]
        saved = bool(rank_dirs(trace)) if nproc is not None else (trace / "meta.json").is_file()
        raise AdvisorError(f"interrupted; the trace recorded so far is in {trace} (complete: false)" if saved
                           else "interrupted before the trace was written", exit_code=130) from None


def _analyze_and_report(trace, et=None, out=None, top: int = 10, console=None) -> dict:
    """Analyse, write OUT/analysis.json, print the terminal report and write the HTML and text ones; returns
    the paths written. OUT defaults to the run directory of TRACE (OUT for OUT/trace, see advisor.layout)."""
    from advisor.analysis.api import analyze as run_analysis

    from advisor.layout import rank_dirs

    console = console or Console()
    out_dir = Path(out) if out else locate(trace).out
    if et is None and rank_dirs(trace):  # a distributed run: each rank analysed, then merged
        from advisor.analysis.ranks import analyze_ranks

        with console.status(f"analysing {len(rank_dirs(trace))} ranks' traces…"):
            document = analyze_ranks(Path(trace), out_dir)
    else:
        with console.status("analysing trace…"):
            document = run_analysis(trace, et).document
    paths = {"analysis": write_analysis(out_dir, document)}
    paths.update(render_reports(out_dir, console, top=top))
    for w in document.warnings or ():
        console.print(f"[yellow]warning:[/] {w}")
    return paths


def _report_written(paths: dict) -> None:
    """The last line: where the HTML report is, as `nsys` ends with the file it wrote."""
    Console().print(f"Report: [bold]{paths['html']}[/]  [dim](text version: {paths['txt']})[/]", highlight=False,
                    soft_wrap=True)


# Commands that run no user code: once their files are written, the process ends without tearing down
# the analysis (freeing the graph of a 1M-kernel trace object by object took ~20 s at exit).
FAST_EXIT = {"analyze", "generate", "report", "bundle"}


def _click_exceptions():
    """The exceptions module of the click that typer runs on: typer >= 0.24 bundles its own copy
    (`typer._click`), older typer uses the `click` package, which a venv with recent typer lacks."""
    return sys.modules[typer.BadParameter.__module__]


def _usage_error(e, click_exc) -> int:
    """Print a click usage error as one line (help for a bare `fusion-advisor`); returns the exit code."""
    ctx = getattr(e, "ctx", None)
    no_args = getattr(click_exc, "NoArgsIsHelpError", None)
    if no_args is not None and isinstance(e, no_args):
        print(ctx.get_help() if ctx is not None else "")
        return e.exit_code
    if not isinstance(e, click_exc.UsageError):  # e.g. FileError: no usage hint
        err.print(f"[bold red]error:[/] {e.format_message()}", highlight=False, soft_wrap=True)
        return e.exit_code
    where = ctx.command_path if ctx is not None else PROG
    err.print(f"[bold red]error:[/] {e.format_message()} (see `{where} --help`)", highlight=False, soft_wrap=True)
    return e.exit_code


def main(argv: List[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    click_exc = _click_exceptions()
    aborts = tuple({typer.Abort, getattr(click_exc, "Abort", typer.Abort)})
    try:
        code = app(args=args, prog_name=PROG, standalone_mode=False)
    except AdvisorError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except click_exc.ClickException as e:
        sys.exit(_usage_error(e, click_exc))
    except aborts as e:  # older click turns Ctrl-C into Abort
        sys.exit(130 if isinstance(e.__context__, KeyboardInterrupt) else 1)
    if isinstance(code, int) and code:  # typer.Exit(n), and Ctrl-C (typer turns it into Exit(130))
        if code == 130:
            err.print("interrupted")
        sys.exit(code)
    command = next((a for a in args if not a.startswith("-")), None)
    if command in FAST_EXIT and argv is None:
        import os

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

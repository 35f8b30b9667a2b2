"""The `fusion-advisor` command line: one sub-command per user-facing stage."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from advisor.errors import AdvisorError, NotBuiltYet

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Profiler-driven kernel-fusion advisor for PyTorch.",
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def profile(
    ctx: typer.Context,
    script: Path = typer.Argument(..., help="Python script to run as __main__ (arguments for it go after `--`)."),
    out: Path = typer.Option(Path("advisor_out"), "--out", help="Output directory (the trace goes to OUT/trace/)."),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cpu (exported to the script as FUSION_ADVISOR_DEVICE)."),
    region: Optional[str] = typer.Option(None, "--region", help="Steady-state region: an advisor.region or NVTX range name."),
):
    """Run SCRIPT under torch.profiler + ExecutionTraceObserver and write a trace directory.

    Writes OUT/trace/kineto.json.gz, et.json.gz and meta.json. Exit codes: 1 the script failed
    (partial trace written), 2 bad input, 4 the script did no tensor work.
    """
    from advisor.collect.runner import profile_script

    profile_script(script, list(ctx.args), out_dir=out, device=device, region=region)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    script: Optional[Path] = typer.Argument(None, help="Workload script (default: the bundled demo workload)."),
    out: Path = typer.Option(Path("advisor_out"), "--out", help="Output directory."),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cpu"),
    region: Optional[str] = typer.Option(None, "--region", help="Steady-state region: an advisor.region or NVTX range name."),
    top: int = typer.Option(10, "--top", help="Candidates to show."),
):
    """Profile SCRIPT, then analyse the trace: `profile` and `analyze` in one go."""
    from advisor.collect.runner import profile_script

    args = list(ctx.args)
    if script is not None and str(script).startswith("-"):  # `run -- --iters 2`: arguments for the demo
        args, script = [str(script), *args], None
    if script is None:
        import advisor.demo_workload as demo

        script = Path(demo.__file__)
    profile_script(script, args, out_dir=out, device=device, region=region)
    try:
        from advisor.analyze.api import analyze_cli
    except Exception as e:  # the analysis stage is optional at this point of the pipeline
        raise AdvisorError(
            f"trace written to {out / 'trace'}, but the analysis stage cannot be loaded "
            f"({type(e).__name__}: {e}); run `fusion-advisor analyze {out / 'trace'}` once it is available"
        ) from None
    analyze_cli(out / "trace", et=None, out=None, top=top)


@app.command()
def analyze(
    trace: Path = typer.Argument(..., help="Trace directory from `profile`, or a Kineto .json/.json.gz."),
    et: Optional[Path] = typer.Option(None, "--et", help="Execution trace file (when TRACE is a bare Kineto file)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where to write analysis.json (default: next to the trace)."),
    top: int = typer.Option(10, "--top", help="Candidates to show."),
):
    """Find fusion candidates in a trace and estimate what each saves."""
    from advisor.analyze.api import analyze_cli

    analyze_cli(trace, et=et, out=out, top=top)


@app.command()
def report(directory: Path = typer.Argument(..., help="Directory holding analysis.json (and apply.json).")):
    """Re-render the terminal and HTML reports from a directory, without re-running anything."""
    from advisor.report import render_reports

    render_reports(directory)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def apply(
    ctx: typer.Context,
    script: Path = typer.Argument(..., help="Workload script."),
    top: int = typer.Option(5, "--top"),
    out: Path = typer.Option(Path("advisor_out"), "--out"),
):
    """Profile, analyse, generate, validate, patch and benchmark SCRIPT."""
    raise NotBuiltYet("`apply` is not built yet (issue 5).")


def main(argv: List[str] | None = None) -> None:
    try:
        app(args=argv, standalone_mode=False)
    except AdvisorError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except Exception as e:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Abort):
            sys.exit(1)
        raise

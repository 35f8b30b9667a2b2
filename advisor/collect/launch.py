"""`fusion-advisor profile --nproc-per-node N`: SCRIPT run as N ranks under torch.distributed's elastic launcher
(`torch.distributed.run`, what torchrun runs, in this process), each rank `python -m advisor profile SCRIPT`, which
writes OUT/trace/rank-K (advisor.collect.distributed); then the ranks' steady states are aligned."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from advisor.collect.distributed import align, clear_rank_dirs, rank_env
from advisor.collect.runner import check_script
from advisor.errors import AdvisorError, not_writable
from advisor.layout import RANK_PREFIX, TRACE_DIR, rank_dirs


def _launcher_args(script: Path, args: List[str], out: Path, nproc: int, device: str, region: Optional[str],
                   schedule) -> List[str]:
    """torchrun's command line: N local workers, each `python -m advisor profile SCRIPT ... -- ARGS`."""
    worker = ["profile", str(script), "--out", str(out), "--device", device]
    if region:
        worker += ["--region", region]
    if schedule is not None:
        worker += ["--schedule", f"{schedule.wait},{schedule.warmup},{schedule.active}"]
    return ["--standalone", "--nproc-per-node", str(nproc), "--module", "advisor", *worker, "--", *args]


def launch(script: Path, args: List[str], out: Path, nproc: int, device: str = "auto", region: Optional[str] = None,
           schedule=None, console=None) -> Dict[str, Any]:
    """Run SCRIPT as NPROC ranks under torch.distributed's elastic launcher, each profiled by `profile`; align
    their steady states. Returns `align`'s summary. Raises AdvisorError with the first failed rank's exit code
    (a signal N as 128 + N) and KeyboardInterrupt when interrupted (Ctrl-C, or a rank that was)."""
    from rich.console import Console

    console = console or Console(highlight=False, soft_wrap=True)
    script, out = Path(script), Path(out)
    if args and args[0] == "--":
        args = args[1:]
    if nproc < 1:
        raise AdvisorError(f"--nproc-per-node must be at least 1 (got {nproc})")
    if rank_env() is not None:
        raise AdvisorError("--nproc-per-node inside a torchrun job (RANK and WORLD_SIZE are set): run a plain "
                           "`fusion-advisor profile` in each rank instead")
    check_script(script)
    trace_root = out / TRACE_DIR
    try:
        trace_root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise not_writable(trace_root, e) from None
    clear_rank_dirs(trace_root)
    for name in ("kineto.json.gz", "et.json.gz", "meta.json"):  # a one-process trace here is not this run's
        (trace_root / name).unlink(missing_ok=True)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    console.print(f"[bold]fusion-advisor[/] launching {nproc} rank{'s' if nproc != 1 else ''} of [cyan]{script}[/] "
                  "under torch.distributed.run …")
    sys.stdout.flush()
    try:
        run(parse_args(_launcher_args(script, list(args), out, nproc, device, region, schedule)))
    except ChildFailedError as e:
        # the first rank to fail, by time: the others were stopped by the launcher (SIGTERM, 143) because of it
        failed = sorted(e.failures.items(), key=lambda kv: (kv[1].exitcode < 0, kv[1].timestamp, kv[0]))
        codes = {r: (f.exitcode if f.exitcode >= 0 else 128 - f.exitcode) for r, f in failed}
        if 130 in codes.values():
            raise KeyboardInterrupt from None
        first, code = next(iter(codes.items()))
        others = [r for r in codes if r != first]
        also = f" (then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
        raise AdvisorError(f"rank {first} exited with {code}{also}; the traces written are in {trace_root}",
                           exit_code=code or 1) from None
    except SignalException:
        raise KeyboardInterrupt from None
    summary = align(trace_root)
    dirs = rank_dirs(trace_root)
    for w in summary["warnings"]:
        console.print(f"[yellow]warning:[/] {w}")
    if len(dirs) != nproc:
        raise AdvisorError(f"{nproc} ranks ran but {len(dirs)} wrote a trace under {trace_root}")
    calls = summary["calls"]
    which = f"calls {calls[0]}-{calls[-1]}" if calls and calls == list(range(calls[0], calls[-1] + 1)) else \
        f"calls {calls}"
    console.print(f"{nproc} ranks profiled; steady state: {which} on every rank; traces in [bold]{trace_root}[/]"
                  f"/{RANK_PREFIX}0 … {RANK_PREFIX}{nproc - 1}")
    return summary

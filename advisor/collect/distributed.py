"""Profiling a torch.distributed job: one trace per rank, OUT/trace/rank-K/, the same steady state on every rank.

Two ways in, one result:
  * `fusion-advisor profile --nproc-per-node N SCRIPT`: `advisor.collect.launch` runs torch.distributed's elastic launcher
    (torchrun's own `torch.distributed.run`, in this process) with N local workers, each of them
    `python -m advisor profile SCRIPT` as a rank; then `align` makes the ranks' steady states agree.
  * `torchrun ... -m advisor profile SCRIPT` (or `profile` inside any job that sets RANK and WORLD_SIZE): each
    rank's plain `profile` sees `rank_env()` and writes its own folder; `analyze` aligns the ranks.
Each rank is profiled exactly as one process is (advisor.collect.runner); its meta.json adds `rank`,
`world_size`, `local_rank` and `backend`, read from torch.distributed once the script's process group is up
(`DistributedProbe`), else from torchrun's environment (the backend then null).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

from advisor.errors import AdvisorError
from advisor.jsonio import write_json
from advisor.layout import RANK_PREFIX, TRACE_DIR, rank_dir, rank_dirs

META_KEYS = ("rank", "world_size", "local_rank", "backend")


def rank_env() -> Optional[Dict[str, Any]]:
    """This process's rank as torchrun's environment says (RANK, WORLD_SIZE, LOCAL_RANK), or None outside a job."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError:
        raise AdvisorError(f"RANK={env['RANK']!r}, WORLD_SIZE={env['WORLD_SIZE']!r}, LOCAL_RANK="
                           f"{env.get('LOCAL_RANK')!r}: torchrun's variables must be whole numbers") from None
    if not 0 <= rank < world:
        raise AdvisorError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return {"rank": rank, "world_size": world, "local_rank": local, "backend": None}


class DistributedProbe:
    """Reads rank, world size and backend from torch.distributed at the first nn.Module call after the script's
    process group is up (a script may destroy it before it ends) and once more at the end; `info` holds them,
    the environment's values until then."""

    def __init__(self, env: Dict[str, Any]):
        self.info = dict(env)
        self._seen = False
        self._hook = None

    def _sample(self, *_args) -> None:
        if self._seen:
            return
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self.info.update(rank=dist.get_rank(), world_size=dist.get_world_size(),
                                 backend=str(dist.get_backend()))
                self._seen = True
        except Exception:  # noqa: BLE001 - a probe never breaks the user's script
            pass

    def __enter__(self) -> "DistributedProbe":
        from torch.nn.modules import module as nn_module

        self._hook = nn_module.register_module_forward_pre_hook(self._sample)
        self._patch_destroy()
        return self

    def __exit__(self, *exc) -> None:
        self._sample()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._destroy is not None:
            self._destroy[0].destroy_process_group = self._destroy[1]
            self._destroy = None

    _destroy = None

    def _patch_destroy(self) -> None:
        """torch 2.13: a gloo work queued during a backward holds autograd's stashed context (a Python object) in
        its thread-local state; when the work's thread frees it while the main thread, holding the GIL, joins
        that thread in `destroy_process_group`, both wait forever. Profiling made it common (3 runs of 5 of
        tests/fixtures/ddp_tiny.py hung at the end). Before the script's `destroy_process_group` the GIL is let
        go for a moment, so those threads finish their frees first."""
        try:
            import torch.distributed as dist
        except ImportError:
            return
        if not dist.is_available():
            return
        original = dist.destroy_process_group

        def destroy_process_group(*args, **kwargs):
            import gc
            import time

            gc.collect()
            time.sleep(0.25)  # the GIL released: the gloo threads drop what they hold
            return original(*args, **kwargs)

        self._destroy = (dist, original)
        dist.destroy_process_group = destroy_process_group


def clear_rank_dirs(trace_root: Path) -> None:
    """Remove the rank-K folders a previous distributed run left under TRACE_ROOT (a run of fewer ranks, or one
    process, must not be merged with them)."""
    for d in rank_dirs(trace_root) + [p for p in Path(trace_root).glob(f"{RANK_PREFIX}*") if p.is_dir()]:
        shutil.rmtree(d, ignore_errors=True)


def align(trace_root: Path) -> Dict[str, Any]:
    """Make every rank's steady state the same calls: the iterations (by `steady_state.calls`, the number of the
    call or region in the script) that every rank recorded; a rank's others are left out of its meta.json, listed
    in `steady_state.not_on_every_rank`. Returns {ranks, calls, source, warnings}. Idempotent."""
    dirs = rank_dirs(trace_root)
    metas = [json.loads((d / "meta.json").read_text()) for d in dirs]
    warnings: List[str] = []
    out: Dict[str, Any] = {"ranks": [m.get("rank") for m in metas], "calls": [], "source": None, "warnings": warnings}
    if not metas:
        return out
    steadies = [m.get("steady_state") or {} for m in metas]
    sources = {(s.get("source"), s.get("name")) for s in steadies}
    out["source"] = steadies[0].get("source")
    if len(sources) > 1:
        warnings.append("the ranks found their steady state differently (" + ", ".join(
            f"rank {m.get('rank')}: {s.get('source')} {s.get('name') or ''}".strip() for m, s in zip(metas, steadies))
            + "): each rank's is analysed as found")
        return out
    if any(not s.get("calls") for s in steadies):
        return out  # a trace from before call numbers: nothing to align by
    common = sorted(set.intersection(*(set(s["calls"]) for s in steadies)))
    out["calls"] = common
    if not common:
        warnings.append("no steady-state call was recorded on every rank: each rank's is analysed as found")
        return out
    for d, m, s in zip(dirs, metas, steadies):
        if s["calls"] == common:
            continue
        keep = [k for k, c in enumerate(s["calls"]) if c in set(common)]
        s["not_on_every_rank"] = sorted(set(s.get("not_on_every_rank") or []) | (set(s["calls"]) - set(common)))
        s["iterations"] = [s["iterations"][k] for k in keep]
        s["calls"] = common
        m["steady_state"] = s
        write_json(d / "meta.json", m, indent=2)
        warnings.append(f"rank {m.get('rank')}: calls {s['not_on_every_rank']} left out of its steady state "
                        "(not recorded on every rank)")
    return out


def trace_dir_for(out_dir: Path) -> tuple:
    """(this process's trace folder, its rank fields or None): OUT/trace/rank-K inside a torchrun job."""
    env = rank_env()
    root = Path(out_dir) / TRACE_DIR
    return (rank_dir(root, env["rank"]) if env else root), env

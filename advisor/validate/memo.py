"""Validation results kept on disk: the same kernel, shapes and device pass the same way twice.

A success is recorded under a digest of everything that decides it (the module's source, which `run`
entry point, the validation cases' sizes, the seed, the device's name, torch/triton versions and the
validator's own source), in the kernel cache's sibling `validated/`. Failures are never recorded: they
are re-checked every time. A reused result says so in its note.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from advisor.jsonio import atomic_write

_VALIDATOR = None


def _validator_digest() -> str:
    global _VALIDATOR
    if _VALIDATOR is None:
        h = hashlib.sha256()
        for f in sorted(Path(__file__).parent.glob("*.py")):
            h.update(f.read_bytes())
        _VALIDATOR = h.hexdigest()[:12]
    return _VALIDATOR


def memo_key(gen, module, seed: int, interp: bool) -> str | None:
    """None when the module's source cannot be read (then nothing is reused or recorded)."""
    import inspect

    import triton

    from advisor.validate.shapes import cases

    try:  # the code that runs, not the code generated: a hand-edited module is another kernel
        source = Path(inspect.getsourcefile(module.run)).read_text()
    except (TypeError, OSError):
        return None
    device = "interpreter" if interp else torch.cuda.get_device_name()
    sizes = [(c.name, sorted(c.values.items())) for c in cases(gen.program, interp)]
    parts = [source, gen.code, getattr(module.run, "__name__", "run"), json.dumps(sizes), str(seed), device,
             torch.__version__, triton.__version__, _validator_digest()]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]


def _path(key: str) -> Path:
    from advisor.codegen.cache import cache_dir

    return cache_dir().parent / "validated" / f"{key}.json"


def recall(key: str) -> dict | None:
    """The errors record of an earlier success, with a note that it is reused; None if there is none."""
    try:
        rec = json.loads(_path(key).read_text())
    except (OSError, ValueError):
        return None
    errors = rec.get("errors") or {}
    reused = f"validation reused: passed {rec.get('at', '?')} for the same source, shapes and device"
    errors["note"] = "; ".join(x for x in (errors.get("note"), reused) if x)
    errors["reused"] = True
    return errors


def remember(key: str, errors: dict) -> None:
    atomic_write(_path(key), json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "errors": errors},
                                        default=str))

"""The generator: a candidate's program -> one readable Triton module (kernel + launcher), cached on disk.

    gen = generate(candidate["program"])   # read, lower, print (or reuse the cached module)
    mod = load_module(gen.path)             # mod.run(*inputs) -> outputs, like the aten ops

Pieces: `ir` reads the program (symbolic sizes, views as index maps), `build` evaluates it into an
expression DAG through the lowering table (`advisor.ops.lowering`), `plan` picks the kernel domain,
`printer` prints kernels, `module` adds the launcher, `cache` stores the result by pattern.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from advisor.codegen import cache
from advisor.codegen.cache import load_module
from advisor.codegen.ir import Program
from advisor.codegen.read import read_program
from advisor.ops.lowering import Unsupported

__all__ = ["generate", "Generated", "load_module", "Unsupported", "GENERATOR_VERSION"]


def _version() -> str:
    """A digest of the generator's own source: changing how code is generated invalidates the cache."""
    here = Path(__file__).parent
    files = sorted(here.glob("*.py")) + [here.parent / "ops" / "lowering.py"]
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


GENERATOR_VERSION = _version()


@dataclass
class Generated:
    key: str  # the pattern's cache key
    code: str  # the module's source (`cache.FIRST_LINE` where a kernel file names its candidate)
    cached: bool  # True when an earlier run had generated it already
    program: Program
    kind: str  # "pointwise" | "rows"
    path: Path  # the module on disk (in the cache, or a scratch file when the cache was bypassed)


def generate(program: dict, use_cache: bool = True) -> Generated:
    """Generate (or fetch from the cache) the module for a program; raises Unsupported with a reason."""
    from advisor.codegen.module import module_source
    from advisor.codegen.plan import plan

    prog = read_program(program)
    key = prog.key(GENERATOR_VERSION)
    code, cached, path = cache.fetch_or_write(key, lambda: module_source(plan(prog)), use_cache)
    return Generated(key, code, cached, prog, "rows" if prog.row_ops else "pointwise", path)

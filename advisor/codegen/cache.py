"""On-disk cache of generated modules, keyed by the pattern (the program with sizes as symbols).

Location: $FUSION_ADVISOR_CACHE, else ~/.cache/fusion-advisor; kernels live in its `kernels/`.
Writes are atomic (a temporary file, then os.replace), so concurrent runs never read half a file.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from advisor.interpreter import round_like_the_gpu
from advisor.jsonio import atomic_write  # noqa: F401  (the cache writes through it; tests import it from here)


def cache_dir() -> Path:
    root = os.environ.get("FUSION_ADVISOR_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "fusion-advisor"
    d = base / "kernels"
    d.mkdir(parents=True, exist_ok=True)
    return d


def get(key: str) -> str | None:
    path = cache_dir() / f"{key}.py"
    try:
        return path.read_text()
    except OSError:
        return None


def put(key: str, source: str) -> Path:
    return atomic_write(cache_dir() / f"{key}.py", source)


def scratch(key: str, source: str) -> Path:
    """A module written outside the cache (a unique file each time)."""
    d = cache_dir().parent / "scratch"
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f"{key}_", suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(source)
    return Path(tmp)


def path_of(key: str) -> Path:
    return cache_dir() / f"{key}.py"


def load_module(path: Path, name: str | None = None):
    """Import a generated module from its file (Triton's JIT needs the source on disk)."""
    round_like_the_gpu()  # without a GPU its kernels run in the interpreter: bf16 stores as on the GPU
    path = Path(path)
    name = name or f"fusion_advisor_kernel_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

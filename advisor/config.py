"""The `FUSION_ADVISOR_*` environment variables: each named, defaulted and explained once (`VARIABLES`,
listed for users in docs/CONFIG.md), and read through one accessor, `current()`, into a frozen `Config`.

`current()` reads the environment once and reads it again only when one of these variables changed since:
the package sets some itself for the processes it starts (the profiled script's device, the probe child's
flag) and tests set them after import, so a value fixed at import would be stale. `reload()` forces a new
read. A value that cannot be parsed is refused where it is used (`Config.profile_calls`), not when
another variable is read.

Low in the tree: imports only `advisor.errors`.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from advisor.errors import AdvisorError


@dataclass(frozen=True)
class Variable:
    name: str
    default: str  # as docs/CONFIG.md states it
    meaning: str


CACHE = "FUSION_ADVISOR_CACHE"
CUDA_GRAPHS = "FUSION_ADVISOR_CUDA_GRAPHS"
COMPILE_WORKERS = "FUSION_ADVISOR_COMPILE_WORKERS"
EARLY_CAPTURE = "FUSION_ADVISOR_EARLY_CAPTURE"
TUNE = "FUSION_ADVISOR_TUNE"
DEVICE = "FUSION_ADVISOR_DEVICE"
PROFILE_CALLS = "FUSION_ADVISOR_PROFILE_CALLS"
ONE_PROCESS = "FUSION_ADVISOR_ONE_PROCESS"
ISOLATE = "FUSION_ADVISOR_ISOLATE"
PROBE = "FUSION_ADVISOR_PROBE"

VARIABLES = {v.name: v for v in (
    Variable(CACHE, "~/.cache/fusion-advisor", "root of the on-disk cache: generated kernels, validated kernels, "
             "stored plans, AOTAutograd's inference graphs"),
    Variable(CUDA_GRAPHS, "1", "0 runs captured layers (and training graphs) op by op instead of replaying CUDA graphs"),
    Variable(COMPILE_WORKERS, "one per CPU up to 8 on a GPU; none under the interpreter",
             "worker processes that generate and validate kernels; 0 or 1 works in process; set, that many are "
             "used however few the jobs"),
    Variable(EARLY_CAPTURE, "1", "0 stops `optimize` from capturing the model while its kernels compile"),
    Variable(TUNE, "1", "read by the generated matmul-anchored kernels themselves (they need only torch and triton): "
             "0 skips timing their tile configurations"),
    Variable(DEVICE, "unset", "the device a profiled script should use: exported to it by profile/run/apply --device"),
    Variable(PROFILE_CALLS, "unset", "as --calls N where no command line reaches: profile the first N calls"),
    Variable(ONE_PROCESS, "unset", "any value parses a large execution trace in this process, not a second one"),
    Variable(ISOLATE, "unset (off)", "1 runs every `optimize` not given `isolate=` in a child process first"),
    Variable(PROBE, "unset", "set to 1 by `optimize` in its isolated child's environment; never set it yourself"),
)}


@dataclass(frozen=True)
class Config:
    """The variables as the environment held them when read ({name: value} of those set)."""

    values: tuple  # ((name, value), ...) of the variables set, in VARIABLES' order

    def raw(self, name: str) -> str | None:
        return dict(self.values).get(name)

    @property
    def cache_root(self) -> Path:
        root = self.raw(CACHE)
        return Path(root) if root else Path.home() / ".cache" / "fusion-advisor"

    @property
    def cuda_graphs(self) -> bool:
        return (self.raw(CUDA_GRAPHS) or "1") != "0"

    @property
    def compile_workers(self) -> int | None:
        """The workers asked for (None: not set, the package chooses; an unreadable value asks for none)."""
        text = (self.raw(COMPILE_WORKERS) or "").strip()
        if not text:
            return None
        try:
            return int(text)
        except ValueError:
            return 0

    @property
    def early_capture(self) -> bool:
        return (self.raw(EARLY_CAPTURE) or "1") != "0"

    @property
    def device(self) -> str | None:
        return self.raw(DEVICE) or None

    @property
    def profile_calls(self) -> int | None:
        text = (self.raw(PROFILE_CALLS) or "").strip()
        if not text:
            return None
        try:
            return int(text)
        except ValueError:
            raise AdvisorError(f"{PROFILE_CALLS} must be a whole number (got {self.raw(PROFILE_CALLS)!r})") from None

    @property
    def one_process(self) -> bool:
        return bool(self.raw(ONE_PROCESS))

    @property
    def isolate(self) -> bool:
        return (self.raw(ISOLATE) or "").strip() not in ("", "0")

    @property
    def in_probe(self) -> bool:
        return bool(self.raw(PROBE))


_lock = threading.Lock()
_current: Config | None = None


def _snapshot() -> tuple:
    return tuple((name, os.environ[name]) for name in VARIABLES if name in os.environ)


def current() -> Config:
    """The configuration: read once, and again only when one of the variables changed."""
    global _current
    seen = _snapshot()
    with _lock:
        if _current is None or _current.values != seen:
            _current = Config(seen)
        return _current


def reload() -> Config:
    """Read the environment again now."""
    global _current
    with _lock:
        _current = None
    return current()

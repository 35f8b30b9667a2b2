"""The files fusion-advisor writes: one way to write them (atomically) and one schema version per JSON
file. A reader that finds another version refuses the file (`advisor.report.load`) instead of misreading
it; bump a file's version when a key changes meaning or goes away, not when one is added.

    analysis.json  what `analyze` found; typed as `advisor.documents.AnalysisDoc`, written by its one writer
    apply.json     what was generated, patched and kept; `advisor.documents.ApplyDoc`, one writer
    meta.json      how the trace was collected (collect.runner, collect.in_process); the analyzer reads it
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from advisor.errors import not_writable

ANALYSIS_SCHEMA_VERSION = 1
APPLY_SCHEMA_VERSION = 1
META_SCHEMA_VERSION = 1


def atomic_write(path: Path, text: str | bytes) -> Path:
    """Write `text` (or bytes) to `path` through a temporary file and os.replace: a concurrent reader sees the
    old file or the new one, never half of it. An output that cannot be written raises `NotWritable`."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise not_writable(path, e) from None
    try:
        like_a_new_file(fd)
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise not_writable(path, e) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def like_a_new_file(fd: int) -> None:
    """Give a file mkstemp made (mode 0600) the mode `open` gives a new file (0666 less the umask): the outputs
    are read by other users and tools as report.html is, and a shared cache is shared."""
    os.fchmod(fd, 0o666 & ~current_umask())


def current_umask() -> int:
    try:  # Linux says it without changing it (os.umask sets it: racy with other threads)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: Path, doc: dict, indent: int = 1) -> Path:
    """`doc` as JSON at `path`, atomically; numpy and torch scalars as numbers, sets and tuples as lists,
    anything else as its str()."""
    return atomic_write(path, json.dumps(doc, indent=indent, default=_jsonable))


def _jsonable(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)

"""Stage 5: the terminal, HTML and plain-text reports, rendered from analysis.json (+ apply.json) alone."""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Optional, Tuple

from advisor.errors import AdvisorError, not_writable
from advisor.documents import APPLY_FILE
from advisor.jsonio import ANALYSIS_SCHEMA_VERSION, APPLY_SCHEMA_VERSION
from advisor.layout import locate

TEXT_WIDTH = 120  # report.txt is read in editors and diffs, not in the user's terminal


def _load(path: Path, what: str, schema_version: int) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as ex:
        raise AdvisorError(f"{path} is not valid JSON (line {ex.lineno}, column {ex.colno}): {ex.msg}") from None
    except (OSError, UnicodeDecodeError) as ex:
        raise AdvisorError(f"cannot read {path}: {ex}") from None
    if not isinstance(data, dict):
        raise AdvisorError(f"{path} does not hold {what} (expected a JSON object, got {type(data).__name__})")
    version = data.get("schema_version")
    if version != schema_version:
        raise AdvisorError(f"{path} has schema_version {version!r}; this fusion-advisor reads version {schema_version}")
    return data


def load(directory) -> Tuple[dict, Optional[dict]]:
    """(analysis, apply or None) from a run directory (OUT or OUT/trace); AdvisorError with one line otherwise."""
    d = Path(directory)
    if not d.is_dir():
        raise AdvisorError(f"{d} is not a directory")
    a_path = locate(d).analysis
    if not a_path.is_file():
        raise AdvisorError(f"no analysis.json in {d}; run `fusion-advisor analyze {d}` first")
    d = a_path.parent
    analysis = _load(a_path, "an analysis", ANALYSIS_SCHEMA_VERSION)
    if not isinstance(analysis.get("candidates", []), list):
        raise AdvisorError(f"{a_path}: 'candidates' must be a list")
    p_path = d / APPLY_FILE
    apply = _load(p_path, "apply results", APPLY_SCHEMA_VERSION) if p_path.is_file() else None
    return analysis, apply


def render_reports(directory, console=None, top: int = 10, terminal: bool = True) -> dict:
    """Print the terminal report (unless `terminal` is false) and write report.html and report.txt next to
    analysis.json; returns their paths. The caller says where they are: last, once its own output is done."""
    from rich.console import Console

    from advisor.report.html import write_html
    from advisor.report.terminal import render_terminal

    analysis, apply = load(directory)
    d = locate(directory).analysis.parent
    if terminal:
        render_terminal(analysis, apply, console or Console(), top=top, out=d)

    # A second, recording console at a fixed width: the user's console may be narrow or not record.
    rec = Console(record=True, width=TEXT_WIDTH, file=io.StringIO(), force_terminal=False, color_system=None)
    render_terminal(analysis, apply, rec, top=top, out=d)
    paths = {"html": d / "report.html", "txt": d / "report.txt"}
    path = paths["txt"]
    try:
        path.write_text(rec.export_text(), encoding="utf-8")
        path = paths["html"]
        write_html(analysis, apply, path, out=d)
    except OSError as ex:
        raise not_writable(path, ex) from None
    return paths

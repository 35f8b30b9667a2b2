"""The run folder's JSON documents (`advisor.documents`): one writer each, and the typed records read back
every document the producers write exactly (the committed sample traces' analyses, an `optimize`'s
apply.json); the codec (`advisor.codec`) refuses what it cannot place."""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pytest

from advisor import codec
from advisor.analysis.api import analyze
from advisor.codec import RecordError, flattened, optional
from advisor.documents import ANALYSIS_FILE, APPLY_FILE, AnalysisDoc, ApplyDoc, Selection, SelectionState
from advisor.workflows.selection import DESCRIBE

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "advisor"
SAMPLES = ROOT / "sample_traces"
WRITER = PACKAGE / "documents.py"
WRITES = {"write_json", "atomic_write", "write_text", "write_bytes"}


def _sources():
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py")) if p != WRITER]


def test_one_writer_per_document():
    """The file names are spelled once (advisor.documents), and no other module hands them to a file writer:
    every producer goes through `write_analysis` / `write_apply`."""
    names = {ANALYSIS_FILE: "ANALYSIS_FILE", APPLY_FILE: "APPLY_FILE"}
    spelled, writes = [], []
    for path, tree in _sources():
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names:
                spelled.append(f"{where}:{node.lineno}: {node.value!r} (use advisor.documents.{names[node.value]})")
            if isinstance(node, ast.Call):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                inside = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                if func in WRITES and inside & set(names.values()):
                    writes.append(f"{where}:{node.lineno}: {func}(...) of {', '.join(sorted(inside & set(names.values())))}")
    assert not spelled, "document file names spelled outside advisor/documents.py:\n  " + "\n  ".join(spelled)
    assert not writes, "documents written outside their writer:\n  " + "\n  ".join(writes)


def test_every_producer_uses_the_writer():
    """The modules that make these documents call the writers (a producer that stopped writing would pass the
    test above)."""
    callers = {str(p.relative_to(ROOT)) for p, tree in _sources() for n in ast.walk(tree)
               if isinstance(n, ast.Name) and n.id in ("write_analysis", "write_apply")}
    assert {"advisor/cli.py", "advisor/analysis/ranks.py", "advisor/workflows/live_model.py",
            "advisor/workflows/user_script.py", "advisor/workflows/generate.py",
            "advisor/workflows/plan_cache.py"} <= callers, callers


@pytest.fixture(scope="module")
def sample_analyses() -> dict:
    return {str(t.parent.relative_to(SAMPLES)): analyze(t) for t in sorted(SAMPLES.rglob("trace"))}


def test_sample_analyses_round_trip(sample_analyses):
    """json -> AnalysisDoc -> json gives the same text, key order included, for every committed sample."""
    assert len(sample_analyses) == 21
    for name, a in sample_analyses.items():
        text = json.dumps(a.doc, default=str)
        loaded = json.loads(text)
        doc = AnalysisDoc.from_json(loaded)
        assert json.dumps(doc.to_json()) == text, name
        assert json.dumps(a.document.to_json(), default=str) == text, name
        assert [c.id for c in doc.candidates] == [c["id"] for c in loaded["candidates"]]


def test_an_optimize_apply_json_round_trips(tmp_path):
    import advisor
    from test_patch import inputs, tiny  # (pytest puts tests/ on sys.path)

    model, kw = tiny("llama")
    advisor.optimize(model, {**inputs("llama"), **kw}, top=4, out=tmp_path, reuse=False, interpret=True)
    text = (tmp_path / APPLY_FILE).read_text()
    loaded = json.loads(text)
    doc = ApplyDoc.from_json(loaded)
    assert doc.to_json() == loaded and json.dumps(doc.to_json(), indent=1) == text
    assert doc.patterns and doc.checks and doc.checks[0]["ok"] and "check" not in loaded
    assert isinstance(doc.selection, Selection) and doc.selection.decision
    analysis = (tmp_path / ANALYSIS_FILE).read_text()
    assert json.dumps(AnalysisDoc.from_json(json.loads(analysis)).to_json(), indent=1) == analysis


def test_an_apply_json_written_with_check_reads_as_checks():
    """Bundles and stored plans written before the comparison was named `checks` still load."""
    old = {"schema_version": 1, "patterns": [], "check": {"ok": True}, "end_to_end": None}
    assert ApplyDoc.from_json(old).to_json() == {"schema_version": 1, "patterns": [], "checks": [{"ok": True}]}
    assert "checks" not in ApplyDoc.from_json({"patterns": [], "check": None}).to_json()
    with pytest.raises(RecordError, match=r"keys this version does not know: 'colour'"):
        ApplyDoc.from_json({"patterns": [], "colour": "red"})


def test_selection_states_are_the_enum():
    assert set(DESCRIBE) == set(SelectionState)
    s = Selection.from_json({"decision": "kept every patched pattern", "state": "whole_kept", "kept": ["c1"]})
    assert s.state is SelectionState.WHOLE_KEPT and s.state.outer and s.kept == ("c1",)
    assert s.to_json() == {"decision": "kept every patched pattern", "state": "whole_kept", "kept": ["c1"]}
    with pytest.raises(RecordError, match=r"state 'fastest' is not a known SelectionState"):
        Selection.from_json({"decision": "?", "state": "fastest"})


class Colour(str, Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Pair:
    first: str
    second: int


@dataclass(frozen=True)
class Thing:
    name: str
    colour: Colour
    tags: tuple[str, ...] = ()
    inner: Pair | None = optional()
    pairs: tuple[Pair, ...] = ()
    flat: Pair | None = flattened({"first": "a", "second": "b"})
    note: str | None = None


def test_the_codec_on_nested_enum_optional_and_flattened_fields():
    doc = {"name": "x", "colour": "red", "tags": ["t"], "inner": {"first": "f", "second": 2},
           "pairs": [{"first": "g", "second": 3}], "a": "h", "b": 4, "note": None}
    thing = codec.from_json(Thing, doc)
    assert thing == Thing("x", Colour.RED, ("t",), Pair("f", 2), (Pair("g", 3),), Pair("h", 4), None)
    assert codec.to_json(thing) == doc
    bare = Thing("y", Colour.BLUE)  # optional and flattened fields left None are not written; the others are
    assert codec.to_json(bare) == {"name": "y", "colour": "blue", "tags": [], "pairs": [], "note": None}
    with pytest.raises(RecordError, match=r"colour 'green' is not a known Colour \(one of: red, blue\)"):
        codec.from_json(Thing, {"name": "x", "colour": "green"})
    with pytest.raises(RecordError, match=r"keys this version does not know: 'size'"):
        codec.from_json(Thing, {"name": "x", "colour": "red", "size": 3})
    with pytest.raises(RecordError, match=r"lacks 'colour'"):
        codec.from_json(Thing, {"name": "x"})
    with pytest.raises(RecordError, match=r"has a without b"):
        codec.from_json(Thing, {"name": "x", "colour": "red", "a": "h"})

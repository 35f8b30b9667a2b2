"""One op registry: every op the analyzer may fuse lowers, or is marked not generated with its reason; a
lowering cannot exist for an op the graph never reaches; a candidate holding a not-generated op says so
in analysis.json, and the generator refuses it with that reason."""
from __future__ import annotations

import pytest
import torch

from advisor.analysis.fusion import fusible
from advisor.ops.lowering import TABLE, lowering, why_not_generated
from advisor.ops.registry import OpClass, all_ops, lookup


def test_every_fusible_op_lowers_or_says_why_not():
    missing = []
    for name, info in all_ops().items():
        if not fusible(info):
            continue
        if lowering(name) is None and not info.not_generated:
            missing.append(name)
        if lowering(name) is not None:
            assert not info.not_generated, f"{name} both lowers and is marked not generated"
    assert not missing, f"fusible ops with neither a lowering nor a reason: {missing}"


def test_every_lowering_belongs_to_a_registry_entry():
    for name, low in TABLE.items():
        info = lookup(name)
        assert info is not None and info.lowering is low, name
        assert fusible(info), f"{name} has a lowering the fusion rules never put in a group"
        assert (low.kind == "pointwise") == (info.cls == OpClass.POINTWISE) or info.cls == OpClass.NORM, name
    with pytest.raises(KeyError, match="no registry entry"):
        TABLE["aten::no_such_op"] = TABLE["aten::add"]


def test_reasons_reach_users():
    assert why_not_generated("aten::add") is None and why_not_generated("aten::add_") is None
    assert "interpreter" in why_not_generated("aten::lgamma") and "interpreter" in why_not_generated("aten::erfinv_")
    assert "batch statistics" in why_not_generated("aten::_native_batch_norm_legit")
    assert why_not_generated("aten::group_norm") is None and why_not_generated("aten::native_group_norm") is None
    assert why_not_generated("aten::atan2") is None  # lowered from core tl math


class _Lgamma(torch.nn.Module):
    def forward(self, x, y):
        return torch.lgamma(torch.relu(x + 1.0) + 1.0).exp(), torch.relu(y * 2.0) + 1.0


def test_candidate_with_a_not_generated_op_is_marked(tmp_path):
    from advisor.analysis.api import analyze
    from advisor.collect.in_process import profile_calls
    from advisor.codegen import Unsupported, generate

    model, x, y = _Lgamma(), torch.randn(64), torch.randn(32)
    analysis = analyze(profile_calls(lambda: model(x, y), tmp_path, "cpu", calls=2))
    by_ops = {tuple(op.split("::")[1] for op in c["ops"]): c for c in analysis.doc["candidates"]}
    marked = by_ops[("add", "relu", "add", "lgamma", "exp")]
    assert [g["op"] for g in marked["not_generated"]] == ["aten::lgamma"]
    with pytest.raises(Unsupported, match="lgamma is not generated: no Triton math"):
        generate(marked["program"])
    assert "not_generated" not in by_ops[("mul", "relu", "add")]


# Op names outside advisor/ops that carry no knowledge about the op (allowed): the synthetic reshape the
# matmul generator inserts (its own node, named and given a schema there).
OP_NAME_ALLOWED = {("advisor/codegen/matmul.py", "aten::reshape")}


def _op_name_literals(path) -> list:
    """(line, op name) of every string constant in a file that spells an aten op, docstrings aside."""
    import ast
    import re

    tree = ast.parse(path.read_text(), str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.add(id(first.value))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found += [(node.lineno, m) for m in re.findall(r"aten::\w+", node.value)]
    return found


def test_only_the_registry_spells_op_names():
    """The registry is the only place that knows an aten op: another stage asks it (a tag, a table defined
    there) instead of spelling a set of op names of its own."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spelled = []
    for path in sorted((root / "advisor").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("advisor/ops/"):
            continue
        spelled += [f"{rel}:{line}: {name}" for line, name in _op_name_literals(path)
                    if (rel, name) not in OP_NAME_ALLOWED]
    assert not spelled, "op names spelled outside advisor/ops (ask the registry):\n" + "\n".join(spelled)

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

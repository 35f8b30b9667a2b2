"""A linear read only by a ReLU or GELU runs as one cuBLASLt GEMM with the activation in its epilogue
(`advisor.patching.gemm_epilogues`). Whether that pays is timed on CUDA; on this CPU the decision is forced to
exercise the rewrite (`torch._addmm_activation` runs here too), and the check that guards it is run as is."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import advisor
from advisor.ops.registry import cublaslt_epilogue, torch_function_op
from advisor.patching import gemm_epilogues
from advisor.patching.gemm_epilogues import (EpilogueShape, Verdict, both_ways, cublaslt_epilogue_pays,
                                             epilogue_error, fuse_gemm_epilogues, linear_activation)


class Mlp(torch.nn.Module):
    """The four shapes the pass meets: linear + exact GELU (BERT, ViT), linear without a bias + ReLU (T5),
    linear + tanh GELU (GPT-2's `gelu_pytorch_tanh`), and a linear whose output is read twice (left alone)."""

    def __init__(self, d=32, f=64):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, f)
        self.wi = torch.nn.Linear(f, f, bias=False)
        self.up = torch.nn.Linear(f, f)
        self.both = torch.nn.Linear(f, d)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = self.act(self.wi(h))
        h = F.gelu(self.up(h), approximate="tanh")
        y = self.both(h)
        return torch.relu(y) + y


def forced(shape):
    return Verdict(True, "forced")


def compiled(model, pays=forced):
    seen = {"notes": [], "code": "", "calls": 0}

    def backend(gm, example_inputs):
        seen["notes"] += fuse_gemm_epilogues(gm, pays)
        seen["code"] = gm.code
        seen["calls"] = sum(n.target is linear_activation for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(model, backend=backend), seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_and_activation_become_one_call_with_eager_values(dtype):
    model = Mlp().eval().to(dtype)
    x = torch.randn(2, 8, 32, dtype=dtype)
    run, seen = compiled(copy.deepcopy(model))
    with torch.no_grad():
        got, want = run(x), model(x)
    fused = seen["notes"]
    # exact GELU takes cuBLASLt's tanh approximation only where bf16's rounding hides it
    assert len(fused) == (3 if dtype == torch.bfloat16 else 2)
    assert any("ReLU" in n for n in fused) and any("GELU (tanh)" in n for n in fused)
    assert all("16 x" in n and "forced" in n for n in fused)
    assert seen["calls"] == len(fused)
    assert "torch.relu(y)" in seen["code"]  # the linear read twice kept its own ReLU
    torch.testing.assert_close(got, want, **({"atol": 0.05, "rtol": 0.02} if dtype == torch.bfloat16 else {}))


def test_nothing_is_rewritten_where_it_does_not_pay_or_gradients_are_needed():
    model = Mlp().eval()
    x = torch.randn(2, 8, 32)
    run, seen = compiled(copy.deepcopy(model), lambda s: Verdict(False, "slower"))
    with torch.no_grad():
        run(x)
    assert seen["notes"] == [] and seen["calls"] == 0
    run, seen = compiled(copy.deepcopy(model))
    run(x).sum().backward()  # a graph that trains: its backward would need the activation's input
    assert seen["notes"] == []
    run, seen = compiled(copy.deepcopy(model))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        run(x)  # fp32 operands, a bf16 GEMM: the rewrite would run it in fp32
    assert seen["notes"] == []


def test_the_decision_is_never_taken_off_cuda():
    shape = EpilogueShape(16, 32, 64, torch.bfloat16, "gelu_exact", torch.device("cpu"))
    assert cublaslt_epilogue_pays(shape) == Verdict(False, "not on CUDA")


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_exact"])
def test_the_check_passes_the_epilogue_and_catches_planted_wrong_ones(activation):
    shape = EpilogueShape(64, 96, 128, torch.bfloat16, activation, torch.device("cpu"))
    one, two = both_ways(shape)
    assert epilogue_error(one(), two(), shape.dtype) is None
    planted = {
        "the bias dropped": lambda x, w, b, g: linear_activation(x, w, torch.zeros_like(b), g),
        "the other activation": lambda x, w, b, g: linear_activation(x, w, b, not g),
        "the weight's rows shifted": lambda x, w, b, g: linear_activation(x, w.roll(1, 0), b, g),
    }
    for why, wrong in planted.items():
        bad, ref = both_ways(shape, wrong)
        assert epilogue_error(bad(), ref(), shape.dtype) is not None, why


def test_optimize_runs_the_epilogues_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm_epilogues, "cublaslt_epilogue_pays", forced)
    model = Mlp().eval()
    untouched = copy.deepcopy(model)
    x = torch.randn(2, 8, 32)
    report = advisor.optimize(model, (x,), interpret=True, reuse=False, out=tmp_path)
    notes = report.handle.gemm_epilogues()
    assert notes and all("cuBLASLt" in k for k in notes)
    assert json.loads((tmp_path / "apply.json").read_text())["gemm_epilogues"] == notes
    with torch.no_grad():
        torch.testing.assert_close(model(x), untouched(x))


def test_the_any_shape_compile_runs_them_too(monkeypatch):
    from advisor.patching import any_shape

    asked = []
    monkeypatch.setattr(gemm_epilogues, "cublaslt_epilogue_pays", lambda s: asked.append(s) or forced(s))
    model = Mlp().eval()
    x = torch.randn(2, 8, 32)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(copy.deepcopy(model), backend=any_shape.laid_out_inductor, fullgraph=True)(x)
        torch.testing.assert_close(got, model(x))
    assert {s.activation for s in asked} == {"relu", "gelu"}  # fp32: the exact GELU is left as it is


def test_the_registry_reads_the_activation_functions_and_the_epilogue_pattern():
    assert torch_function_op(F.relu) == "aten::relu" and torch_function_op(F.gelu) == "aten::gelu"
    assert torch_function_op(F.linear) == "aten::linear"
    assert cublaslt_epilogue(("aten::linear", "aten::gelu")) and cublaslt_epilogue(("aten::linear", "aten::relu"))
    assert not cublaslt_epilogue(("aten::linear", "aten::silu")) and not cublaslt_epilogue(("aten::linear",))


def test_analysis_says_a_linear_and_its_activation_are_left_to_cublaslt():
    from advisor.records import Candidate, Kind
    from advisor.status import Status
    from advisor.workflows.kernels import worth_patching

    gelu = Candidate("c1", Kind.EPILOGUE, pattern_id="p1", title="linear epilogue (GELU, fc1)",
                     ops=("aten::linear", "aten::gelu"), est_time_saved_us=0.0)
    swiglu = Candidate("c2", Kind.EPILOGUE, pattern_id="p2", title="linear epilogue (SwiGLU)",
                       ops=("aten::linear", "aten::silu", "aten::mul"), est_time_saved_us=0.0)
    keep, rest = worth_patching([gelu, swiglu])
    assert keep == [] and [r.code for r in rest] == [Status.CUBLASLT, Status.NOT_WORTH]
    assert "cuBLASLt" in rest[0].reason and "gemm_epilogues" in rest[0].reason
    assert "slower than cuBLAS" in rest[1].reason

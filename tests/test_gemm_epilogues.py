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


@pytest.mark.parametrize("weight_kn", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_exact"])
def test_the_check_passes_the_epilogue_and_catches_planted_wrong_ones(activation, weight_kn):
    shape = EpilogueShape(64, 96, 128, torch.bfloat16, activation, torch.device("cpu"), weight_kn)
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


class WrittenOut(torch.nn.Module):
    """The spellings HF models use: GPT-2's Conv1D (`addmm` on the rows, viewed back) and its GELU written out in
    `tanh` and `pow` (`gelu_new`), Phi's linear with the same GELU, `gelu_fast`'s other arrangement of it, an
    eval-mode dropout between the activation and the next GEMM (Whisper), and what must stay: Gemma's
    `gelu(gate) * up` (Inductor fuses the GELU into the product), QuickGELU (a sigmoid, which cuBLASLt has not)."""

    def __init__(self, d=32, f=64):
        super().__init__()
        self.c_fc_w = torch.nn.Parameter(torch.randn(d, f) * d ** -0.5)  # Conv1D: K x N
        self.c_fc_b = torch.nn.Parameter(torch.randn(f) * 0.1)
        self.fc = torch.nn.Linear(f, f)
        self.gate, self.up = torch.nn.Linear(f, f), torch.nn.Linear(f, f)
        self.quick = torch.nn.Linear(f, f)
        self.down = torch.nn.Linear(f, d)

    def forward(self, x):
        h = torch.addmm(self.c_fc_b, x.view(-1, x.size(-1)), self.c_fc_w).view(*x.shape[:-1], -1)
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))
        g = self.fc(h)
        g = 0.5 * g * (1.0 + torch.tanh(g * 0.7978845608 * (1.0 + 0.044715 * g * g)))
        g = F.dropout(g, 0.1, training=False)
        g = F.gelu(self.gate(g), approximate="tanh") * self.up(g)
        q = self.quick(g)
        return self.down(q * torch.sigmoid(1.702 * q))


def test_activations_are_recognised_by_their_values_in_every_spelling():
    model = WrittenOut().eval().to(torch.bfloat16)
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    asked = []
    run, seen = compiled(copy.deepcopy(model), lambda s: asked.append(s) or forced(s))
    with torch.no_grad():
        got, want = run(x), model(x)
    assert len(seen["notes"]) == 2 and all("GELU (tanh)" in n for n in seen["notes"]), seen["notes"]
    assert "_addmm_activation" in seen["code"] and seen["calls"] == 1  # Conv1D's addmm kept its own form
    assert "torch.sigmoid" in seen["code"] and "torch.tanh" not in seen["code"]
    assert [s.weight_kn for s in asked] == [True, False]  # Conv1D's K x N weight timed in its own GEMM layout
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


def test_a_training_dropout_after_the_activation_leaves_it_to_inductor():
    class Mlp2(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

        def forward(self, x):
            return self.fc2(F.dropout(F.gelu(self.fc1(x)), 0.1, training=self.training))

    model = Mlp2().to(torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    for train, sites in ((True, 0), (False, 1)):
        run, seen = compiled(copy.deepcopy(model).train(train))
        with torch.no_grad():
            run(x)
        assert len(seen["notes"]) == sites


def test_the_activation_check_on_values_tells_them_apart():
    from torch.fx import symbolic_trace

    from advisor.patching.gemm_epilogues import activation_of

    def region_of(fn):
        gm = symbolic_trace(fn)
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        found = activation_of(x)
        return found[1] if found else None

    assert region_of(lambda x: torch.relu(x)) == "relu"
    assert region_of(lambda x: x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))) == "gelu_exact"
    assert region_of(lambda x: F.gelu(x, approximate="tanh")) == "gelu"
    assert region_of(lambda x: x * torch.sigmoid(1.702 * x)) is None  # QuickGELU: no cuBLASLt epilogue
    assert region_of(lambda x: F.silu(x)) is None
    assert region_of(lambda x: torch.relu(x * 2.0)) is None  # a ReLU of a scaled product is no ReLU of it
    assert region_of(lambda x: torch.relu(x) * 2.0) == "relu"  # (its reader, a product, then keeps it apart)
    assert region_of(lambda x: torch.relu(x - x.mean())) is None  # a reduction reads it first: no region

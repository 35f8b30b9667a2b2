"""Fuzzing the analyzer's rules over op *arguments* (issue 15 item 1): reductions, row ops and pointwise ops
called every way users call them (no dim, dim as an int, a negative int, a list, a tuple, an empty list,
keepdim, a dtype in a dim's position, the unbiased overload, scalars vs tensors, None and -inf
scalars), recorded by the real profiler + ET observer inside pointwise chains and after matmuls, then
analysed by every rule. The analysis must complete; every row domain the rules give a reduction must be
what its recorded output shape says; every candidate program is generated (or refused with
`Unsupported`, never another exception) and what is generated validates.

A full reduction without a dim (`mask.sum() == mask.numel()`) crashed the matmul-reduction rule; this
test draws it in about one batch in two. Cases are derandomized (FUSION_ADVISOR_FUZZ_SEED overrides).
"""
from __future__ import annotations

import collections
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from advisor.analysis.api import analyze
from advisor.analysis.fusion import node_domain
from advisor.collect.in_process import profile_calls
from advisor.workflows.generate import generate_candidates
from advisor.ops.args import bind
from advisor.ops.registry import OpClass

# Triton's interpreter fails on bitwise ops over bools from scalar loads (see tests/test_fuzz.py): refused there.
INTERPRETER_LIMITS = ("bitwise_or", "bitwise_and", "bitwise_xor")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
EXAMPLES = int(os.environ.get("FUSION_ADVISOR_FUZZ_ARGS_EXAMPLES", "12"))
SEED = os.environ.get("FUSION_ADVISOR_FUZZ_SEED")

# `{h}` is a float tensor of the drawn rank, `{m}` a bool tensor of its shape, `{o}` a float tensor of its shape.
REDUCTIONS = [
    "{h}.sum()", "{h}.sum(-1)", "{h}.sum(dim=[0, -1])", "{h}.sum(dim=(0,))", "{h}.sum(dim=[], keepdim=True)",
    "{h}.sum(-1, keepdim=True)", "{h}.sum(dtype=torch.float64).float()", "{h}.mean()", "{h}.mean(dim=-1)",
    "{h}.mean(dim=0, keepdim=True)", "{h}.amax(dim=-1)", "{h}.amax(dim=0)", "{h}.amin(dim=(-1,))",
    "{h}.prod(-1)", "torch.var({h}, dim=None, correction=0)", "{h}.var(-1, keepdim=True)", "{h}.std(False)",
    "{h}.std(dim=-1, unbiased=True)", "{h}.norm()", "{h}.norm(p=1, dim=-1)",
    "torch.linalg.vector_norm({h}, ord=float('inf'), dim=-1)", "torch.linalg.vector_norm({h}, dim=(0,))",
    "{h}.logsumexp(dim=-1)", "{h}.max()", "{h}.max(dim=-1).values", "{h}.min(-1, keepdim=True).values",
    "{h}.argmax(dim=-1).float()", "{h}.argmax().float()", "{m}.all(dim=-1).float()", "{m}.any().float()",
    "({m}.long().sum() == {m}.numel()).float()", "{h}.softmax(-1)", "torch.log_softmax({h}, dim=-1)",
]
POINTWISE = [
    "{h} * 2.0", "{h} * {o}", "torch.clamp({h}, min=None, max=1.0)", "torch.clamp({h}, min=-1.0)",
    "torch.div({h}, 2.0, rounding_mode=None)", "torch.div({h}, {o}.abs() + 1, rounding_mode='floor')",
    "torch.nan_to_num({h})", "{h}.masked_fill({m}, float('-inf')).softmax(-1)", "torch.where({m}, {h}, 0.0)",
    "torch.where({m}, {h}, {o})", "torch.nn.functional.gelu({h}, approximate='tanh')", "torch.clip({h}, -0.5, 0.5)",
    "torch.atan2({h}, {o})", "torch.round({h}, decimals=1)", "torch.pow({h}.abs() + 1, 2)",
]


class _Variant(torch.nn.Module):
    """relu(x + 1) -> the drawn expression -> * 0.5 (+ 1): the expression sits inside a pointwise chain,
    after a matmul when `matmul` (so the matmul-reduction and epilogue rules see it too)."""

    def __init__(self, expr: str, matmul: bool, width: int):
        super().__init__()
        self.expr, self.matmul = expr, matmul
        self.w = torch.nn.Parameter(torch.randn(width, width) / width ** 0.5) if matmul else None
        self.fn = eval(f"lambda h, m, o: {expr.format(h='h', m='m', o='o')}", {"torch": torch})

    def forward(self, x, m, o):
        h = torch.relu((x @ self.w if self.matmul else x) + 1.0)
        return self.fn(h, m, o) * 0.5 + 1.0


class _Batch(torch.nn.Module):
    def __init__(self, variants):
        super().__init__()
        self.variants = torch.nn.ModuleList(variants)

    def forward(self, inputs):
        return [v(*xs) for v, xs in zip(self.variants, inputs)]


@st.composite
def variant(draw):
    expr = draw(st.sampled_from(REDUCTIONS + POINTWISE))
    rank = draw(st.integers(2 if "[0, -1]" in expr else 1, 3))  # two dims named: they must differ
    shape = tuple(draw(st.sampled_from((1, 3, 8))) for _ in range(rank))
    return expr, draw(st.booleans()) and rank >= 2, shape


def _check_row_domains(graph) -> int:
    """Every reduction the rules treat as R rows of N reduces exactly the last dim: its recorded output is
    the input without (or with size 1 in) that dim. Returns how many reductions the graph held."""
    seen = 0
    for n in graph.nodes:
        if n.cls != OpClass.REDUCTION or not n.reads or not n.writes:
            continue
        seen += 1
        d = node_domain(graph, n)
        assert bind(n.op, n.schema, n.args) is not None, f"{n.op}: no schema for {n.schema!r}"
        if d is None or d.rows is None:
            continue
        shape_in, shape_out = tuple(n.reads[0].shape), tuple(n.writes[0].shape)
        R, N = d.rows
        assert N == shape_in[-1] and R * N == d.numel, (n.op, n.schema, n.args, d)
        if shape_out != shape_in:  # softmax-like row ops keep the shape; reductions drop the last dim
            assert shape_out in (shape_in[:-1], shape_in[:-1] + (1,)), (n.op, n.schema, n.args, shape_out)
    return seen


@pytest.mark.filterwarnings("ignore")
def test_fuzz_op_arguments_through_the_profiler_and_analyzer(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.getbasetemp() / "fuzz-args-cache"))
    drawn: set = set()
    stats = collections.Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=SEED is None, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(st.lists(variant(), min_size=8, max_size=8))
    def case(variants):
        torch.manual_seed(0)
        model = _Batch([_Variant(e, mm, shape[-1]) for e, mm, shape in variants]).eval()
        inputs = [(torch.randn(shape), torch.rand(shape) < 0.3, torch.randn(shape)) for _, _, shape in variants]

        def call():
            with torch.inference_mode():
                return model(inputs)

        out = tmp_path_factory.mktemp("args")
        analysis = analyze(profile_calls(call, out, "cpu", calls=2))
        stats["reductions"] += _check_row_domains(analysis.graph)
        stats["candidates"] += len(analysis.doc["candidates"])
        for entry in generate_candidates(analysis.doc, out)["patterns"]:
            reason = entry["reason"] or ""
            stats["validated"] += bool(entry["validated"])
            assert not reason.startswith("generator error"), entry
            assert entry["validated"] or not entry["kernel_file"] or any(s in reason for s in INTERPRETER_LIMITS), \
                (entry["title"], reason)
        drawn.update(e for e, _, _ in variants)

    if SEED is not None:
        case = hypothesis_seed(int(SEED))(case)
    case()
    print(f"\nargument fuzz: {stats['reductions']} reductions, {stats['candidates']} candidates, "
          f"{stats['validated']} validated kernels, {len(drawn)} of {len(REDUCTIONS + POINTWISE)} variants drawn")
    if EXAMPLES >= 12:
        assert len(drawn) >= 0.75 * len(REDUCTIONS + POINTWISE), sorted(set(REDUCTIONS + POINTWISE) - drawn)

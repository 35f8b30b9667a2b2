"""A linear whose only reader is a ReLU or a GELU runs as one cuBLASLt GEMM with the activation in its epilogue.

Why: Inductor calls cuBLAS for a linear and writes a Triton kernel for the activation after it, so the GEMM's
output is written to memory and read back once more than needed; its Triton GEMMs (`max-autotune`) did not take
the activation either at these shapes. cuBLASLt applies ReLU or GELU to the accumulator before the output is
written (`torch._addmm_activation`, one `..._gelubias_...` kernel). Measured on the H200 (bf16,
docs/experiments/gemm_epilogues): BERT's and Whisper's fc1 (16384 x 768 -> 3072) 0.133 ms against eager's 0.187
and Inductor's 0.187-0.214; ViT-B/16's 0.219 against 0.288; ConvNeXt-T's and Swin-T's first stage
(401408 x 96 -> 384) 0.172 against 0.363-0.378.

cuBLASLt's GELU is the tanh approximation, computed in fp32 on the accumulator. An exact GELU (`approximate=
'none'`) is given it only where the output is bf16 or fp16: there the two differ by less than the format's own
rounding (against an fp32 exact reference: relative L2 0.0017 for the epilogue, 0.0026 for eager's bf16 ops).
ReLU is exact either way.

The rewrite is made on dynamo's graph before AOTAutograd, so every route runs it: our replay, Inductor's around our
kernels (which keeps `aten::_addmm_activation` as a library call), the dynamic-shape compile past the capture
budget. It is made only where the graph is for inference, on CUDA (a linear without a bias gets zeros, made
once per graph: torch takes cuBLASLt's epilogue only with a bias vector), and where the GEMM's shape, timed once per
process both ways on the device, runs faster fused and gives eager's values within the activation's rounding
(`cublaslt_epilogue_pays`).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import GraphModule, Node

from advisor.ops.registry import GEMM_EPILOGUE_ACTIVATIONS, LINEAR, torch_function_op
from advisor.patching.match import node_arg, size_hint, traced_value

# dtypes whose rounding hides the difference between exact GELU and cuBLASLt's tanh approximation
REDUCED_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class EpilogueShape:
    """One linear + activation as the graph holds it: what the decision is timed and cached on."""

    rows: int  # the input's leading dimensions, flattened
    k: int
    n: int
    dtype: torch.dtype
    activation: str  # "relu" | "gelu" (the tanh approximation, cuBLASLt's) | "gelu_exact" (given cuBLASLt's)
    device: torch.device

    def describe(self) -> str:
        return (f"linear {self.rows} x {self.k} -> {self.n} ({str(self.dtype).removeprefix('torch.')}) + "
                f"{ {'relu': 'ReLU', 'gelu': 'GELU (tanh)'}.get(self.activation, 'GELU')}")

    @property
    def use_gelu(self) -> bool:
        return self.activation != "relu"


@dataclass(frozen=True)
class Verdict:
    pays: bool
    why: str  # the timing or the check that decided


def linear_activation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, use_gelu: bool) -> torch.Tensor:
    """act(x @ weight.T + bias) for an input of any rank, by one `aten::_addmm_activation` on its rows."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.aten._addmm_activation.default(bias, rows, weight.t(), use_gelu=use_gelu)
    return out.view(*x.shape[:-1], weight.shape[0])


def fuse_gemm_epilogues(gm: GraphModule, pays: Callable[[EpilogueShape], Verdict] | None = None) -> list[str]:
    """Each linear (with a bias) read only by a ReLU or GELU replaced, where `pays` says so (by default
    `cublaslt_epilogue_pays`), by `linear_activation`; returns one line per site rewritten, saying what and why."""
    decide = pays or cublaslt_epilogue_pays
    notes, zeros = [], {}
    for act in list(gm.graph.nodes):
        found = _site(act)
        if found is None:
            continue
        linear, (x, w, b), shape = found
        verdict = decide(shape)
        if not verdict.pays:
            continue
        with gm.graph.inserting_before(act):
            b = b if b is not None else _zero_bias(gm, shape, traced_value(x), zeros)
            fused = gm.graph.call_function(linear_activation, (x, w, b, shape.use_gelu))
        example = act.meta.get("example_value")
        if example is not None:
            fused.meta["example_value"] = example
        act.replace_all_uses_with(fused)
        gm.graph.erase_node(act)
        gm.graph.erase_node(linear)
        notes.append(f"{shape.describe()}: one cuBLASLt GEMM with the activation in its epilogue ({verdict.why})")
    if notes:
        gm.recompile()
    return notes


def _site(act: Node) -> tuple[Node, tuple, EpilogueShape] | None:
    """(the linear, its tensor arguments, its shape) where `act` is a ReLU or GELU that is the only reader of a
    linear (bias or none), all of one floating dtype; else None."""
    activation = _activation(act)
    if activation is None or not act.args or not isinstance(act.args[0], Node):
        return None
    linear = act.args[0]
    if len(linear.users) != 1 or linear.op != "call_function" or torch_function_op(linear.target) != LINEAR:
        return None
    schema = torch.ops.aten.linear.default._schema
    args = tuple(node_arg(linear, i, name, schema) for i, name in enumerate(("input", "weight", "bias")))
    vals = [traced_value(a) for a in args]
    x, w, b = vals
    out = traced_value(linear)
    if x is None or w is None or out is None or (b is None) != (args[2] is None):
        return None  # a value not traced
    if out.dtype != x.dtype:
        return None  # under autocast: the GEMM runs in another dtype than its operands', which the rewrite would lose
    if (b is not None and b.dim() != 1) or w.dim() != 2 or x.dim() < 2 or \
            len({v.dtype for v in vals if v is not None}) != 1 or not x.dtype.is_floating_point:
        return None
    if any(v.requires_grad for v in vals if v is not None) and torch.is_grad_enabled():
        return None  # (a graph that trains: its backward would need the activation's input)
    if activation == "gelu_exact" and x.dtype not in REDUCED_PRECISION:
        return None  # exact GELU in fp32: the tanh approximation would show
    sizes = [size_hint(s) for s in (*x.shape[:-1], w.shape[1], w.shape[0])]
    if any(s is None for s in sizes):
        return None  # a size with no value traced: nothing to time
    rows = 1
    for s in sizes[:-2]:
        rows *= s
    return linear, args, EpilogueShape(rows, sizes[-2], sizes[-1], x.dtype, activation, x.device)


def _zero_bias(gm: GraphModule, shape: EpilogueShape, x: torch.Tensor, made: dict) -> Node:
    """`shape.n` zeros made once at the graph's start and shared by its sites of that width and dtype: the bias of
    a linear that has none (torch takes cuBLASLt's epilogue only with a bias vector). One small fill a call for
    the whole graph (a real tensor kept as a graph constant would not trace under AOTAutograd's fake tensors)."""
    key = (shape.n, shape.dtype, shape.device)
    if key not in made:
        first = next(n for n in gm.graph.nodes if n.op != "placeholder")
        with gm.graph.inserting_before(first):
            made[key] = gm.graph.call_function(torch.zeros, ((shape.n,),), {"dtype": shape.dtype,
                                                                             "device": shape.device})
        mode = getattr(x, "fake_mode", None)
        if mode is not None:
            with mode:
                made[key].meta["example_value"] = torch.zeros(shape.n, dtype=shape.dtype, device=shape.device)
    return made[key]


def _activation(node: Node) -> str | None:
    """"relu", "gelu" (tanh) or "gelu_exact" for an activation cuBLASLt's epilogue applies; None otherwise."""
    if node.op != "call_function":
        return None
    kind = GEMM_EPILOGUE_ACTIVATIONS.get(torch_function_op(node.target) or "")
    if kind != "gelu":
        return kind
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    return {"none": "gelu_exact", "tanh": "gelu"}.get(approximate) if isinstance(approximate, str) else None


_VERDICTS: dict[EpilogueShape, Verdict] = {}


def cublaslt_epilogue_pays(shape: EpilogueShape, reps: int = 10) -> Verdict:
    """Whether `linear_activation` is faster at `shape` than the linear and the activation as two kernels, and
    gives their values within the activation's rounding: timed once per process (CUDA events, the median of
    `reps` after a warm-up, on random inputs), never on the CPU, never while a CUDA graph is being recorded."""
    if shape.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return Verdict(False, "not on CUDA")
    if shape not in _VERDICTS:
        try:
            with unset_fake_temporarily():
                _VERDICTS[shape] = _timed(shape, reps)
        except (RuntimeError, ValueError) as e:  # out of memory for the question: the graph stays as it is
            _VERDICTS[shape] = Verdict(False, f"not timed: {str(e).splitlines()[0][:120]}")
    return _VERDICTS[shape]


def _timed(shape: EpilogueShape, reps: int) -> Verdict:
    one, two = both_ways(shape)
    with torch.no_grad():
        error = epilogue_error(one(), two(), shape.dtype)
        if error is not None:
            return Verdict(False, f"outputs differ from the linear's and activation's: {error}")
        ms_two, ms_one = _ms(two, reps), _ms(one, reps)
    why = f"{ms_one:.3f} ms against {ms_two:.3f} ms as two kernels"
    return Verdict(ms_one < ms_two, why)


def both_ways(shape: EpilogueShape, fused: Callable = linear_activation) -> tuple[Callable, Callable]:
    """(`fused` on random inputs of `shape`, the linear and the activation on the same inputs) as functions of
    nothing: what is checked and timed. The bias is random (a linear without one gets zeros: as fast on the
    H200); the reference is the graph's own activation."""
    gen = torch.Generator(device=shape.device).manual_seed(0)
    kw = dict(device=shape.device, dtype=shape.dtype, generator=gen)
    x = torch.randn(shape.rows, shape.k, **kw)
    w = torch.randn(shape.n, shape.k, **kw) * shape.k ** -0.5
    b = torch.randn(shape.n, **kw) * 0.1
    act = {"relu": torch.relu, "gelu": lambda y: torch.nn.functional.gelu(y, approximate="tanh"),
           "gelu_exact": torch.nn.functional.gelu}[shape.activation]
    return (lambda: fused(x, w, b, shape.use_gelu)), (lambda: act(torch.nn.functional.linear(x, w, b)))


def epilogue_error(fused: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None where `fused` matches `reference` (the same ops unfused) within the activation's and the output's
    rounding: two units of `dtype`'s last place at each value, plus one at the output's RMS (values near zero);
    else what differs."""
    if fused.shape != reference.shape:
        return f"shape {tuple(fused.shape)} against {tuple(reference.shape)}"
    ref = reference.float()
    d = (fused.float() - ref).abs().nan_to_num(float("inf"))
    tol = torch.finfo(dtype).eps * (2 * ref.abs() + ref.pow(2).mean().sqrt())
    over = d > tol
    if not bool(over.any()):
        return None
    i = int(over.flatten().nonzero()[0])
    return (f"{int(over.sum())} of {d.numel()} values beyond two units of the last place (first: "
            f"{float(fused.flatten()[i]):.4g} against {float(ref.flatten()[i]):.4g})")


def _ms(fn: Callable, reps: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)

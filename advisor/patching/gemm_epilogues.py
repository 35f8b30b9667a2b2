"""A linear whose only reader is a ReLU or a GELU runs as one cuBLASLt GEMM with the activation in its epilogue.

Which ops are a ReLU or a GELU is read from their values, not their spelling: the pointwise region that reads a
linear's (or HF Conv1D's `addmm`'s) output is run on a probe in float64 and compared with each activation
(`activation_of`), so GPT-2's and Phi's GELU written out in `tanh` and `pow` is found as `F.gelu` is. Only an
activation whose readers are GEMMs (or attention, or the graph's output) is taken: where a pointwise op reads it
(Gemma's `gelu(gate) * up`), Inductor fuses the activation into that op's kernel and the epilogue saves nothing.

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

from dataclasses import dataclass
from typing import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import GraphModule, Node

from advisor.ops.registry import ADDMM, IDENTITY_IN_EVAL, LINEAR, MEMORY_BOUND, OpClass, draws_random, graph_node_op, \
    op_class
from advisor.patching.match import node_arg, size_hint, traced_value
from advisor.stopwatch import time_call

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
    weight_kn: bool = False  # the weight stored K x N (HF Conv1D's addmm), not a linear's N x K: another GEMM layout

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
    """Each linear (or `addmm`, HF's Conv1D) read only by a ReLU or GELU replaced, where `pays` says so (by default
    `cublaslt_epilogue_pays`), by one `aten::_addmm_activation`; returns one line per site rewritten, saying what
    and why. The activation is recognised by its values, not its spelling (`activation_of`): GPT-2's GELU written
    out in `tanh` and `pow` is the same GELU as `F.gelu(approximate="tanh")`."""
    decide = pays or cublaslt_epilogue_pays
    notes, zeros = [], {}
    for anchor in list(gm.graph.nodes):
        site = _site(anchor)
        if site is None:
            continue
        verdict = decide(site.shape)
        if not verdict.pays:
            continue
        _rewrite(gm, site, zeros)
        notes.append(f"{site.shape.describe()}: one cuBLASLt GEMM with the activation in its epilogue ({verdict.why})")
    if notes:
        gm.recompile()
    return notes


@dataclass(frozen=True)
class _Site:
    anchor: Node  # the linear or addmm
    view: Node | None  # an addmm's output viewed back to the input's leading dims (Conv1D), which the activation reads
    region: tuple  # the activation's nodes, in graph order; the last is its output
    operands: tuple  # linear: (input, weight, bias or None); addmm: (bias, rows, weight as K x N)
    shape: EpilogueShape


def _site(anchor: Node) -> _Site | None:
    """The site where `anchor` is a linear or addmm whose output (or the one view of it) only an activation
    cuBLASLt's epilogue applies reads, all of one floating dtype, for inference; else None."""
    if anchor.op != "call_function" or not anchor.users:
        return None
    name = graph_node_op(anchor.op, anchor.target)
    if name == LINEAR:
        schema = torch.ops.aten.linear.default._schema
        operands = tuple(node_arg(anchor, i, a, schema) for i, a in enumerate(("input", "weight", "bias")))
        x, w, b = (traced_value(a) for a in operands)
        if x is None or w is None or (b is None) != (operands[2] is None):
            return None
        k, n = w.shape[1], w.shape[0]
    elif name == ADDMM:
        schema = torch.ops.aten.addmm.default._schema
        operands = tuple(node_arg(anchor, i, a, schema) for i, a in enumerate(("self", "mat1", "mat2")))
        if any(node_arg(anchor, i, a, schema) != 1 for i, a in ((3, "beta"), (4, "alpha"))):
            return None
        b, x, w = (traced_value(a) for a in operands)
        if b is None or x is None or w is None:
            return None
        k, n = w.shape[0], w.shape[1]
    else:
        return None
    out = traced_value(anchor)
    vals = [v for v in (x, w, b) if v is not None]
    if out is None or out.dtype != x.dtype:
        return None  # under autocast: the GEMM runs in another dtype than its operands', which the rewrite would lose
    if (b is not None and b.dim() != 1) or w.dim() != 2 or x.dim() < 2 or len({v.dtype for v in vals}) != 1 or \
            not x.dtype.is_floating_point:
        return None
    if any(v.requires_grad for v in vals) and torch.is_grad_enabled():
        return None  # (a graph that trains: its backward would need the activation's input)
    view = next(iter(anchor.users))
    viewed = graph_node_op(view.op, view.target)
    if not (name == ADDMM and len(anchor.users) == 1 and viewed and op_class(viewed) == OpClass.VIEW and
            view.args and view.args[0] is anchor):
        view = None  # (a view commutes with a pointwise activation: the activated product is viewed instead)
    found = activation_of(view or anchor)
    if found is None:
        return None
    region, activation = found
    if not _read_by_unfusible_ops(region[-1]):
        return None  # (Inductor fuses the activation into its reader: nothing saved)
    if activation == "gelu_exact" and x.dtype not in REDUCED_PRECISION:
        return None  # exact GELU in fp32: the tanh approximation would show
    sizes = [size_hint(s) for s in (*x.shape[:-1], k, n)]
    if any(s is None for s in sizes):
        return None  # a size with no value traced: nothing to time
    rows = 1
    for s in sizes[:-2]:
        rows *= s
    shape = EpilogueShape(rows, sizes[-2], sizes[-1], x.dtype, activation, x.device, weight_kn=name == ADDMM)
    return _Site(anchor, view, region, operands, shape)


def _read_by_unfusible_ops(out: Node) -> bool:
    """Whether every op that reads the activation (through views and eval-mode dropout) is one Inductor fuses no
    activation into: a GEMM (BERT's fc2), attention, an output. A pointwise, reduction or norm reader (Gemma's
    `gelu(gate) * up`) takes the activation into its own kernel on Inductor's route, and the GEMM's output makes
    the same round trip either way: there the epilogue would only add its own cost to the GEMM."""
    todo, seen = list(out.users), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        name = graph_node_op(n.op, n.target)
        if name is None:
            continue
        training = n.kwargs.get("training", n.args[2] if len(n.args) > 2 else True)
        if op_class(name) == OpClass.VIEW or (name in IDENTITY_IN_EVAL and training is False):
            todo.extend(n.users)
        elif op_class(name) in MEMORY_BOUND:
            return False
    return True


def _rewrite(gm: GraphModule, site: _Site, zeros: dict) -> None:
    out = site.region[-1]
    graph = gm.graph
    if site.view is None and graph_node_op(site.anchor.op, site.anchor.target) == LINEAR:
        x, w, b = site.operands
        with graph.inserting_before(out):
            b = b if b is not None else _zero_bias(gm, site.shape, traced_value(x), zeros)
            fused = graph.call_function(linear_activation, (x, w, b, site.shape.use_gelu))
        _copy_example(out, fused)
        result = fused
    else:  # addmm: its operands as they are, then the view it had, now of the activated product
        with graph.inserting_before(site.view or out):
            fused = graph.call_function(torch.ops.aten._addmm_activation.default, site.operands,
                                        {"use_gelu": site.shape.use_gelu})
        _copy_example(site.anchor, fused)
        result = fused
        if site.view is not None:
            site.view.args = (fused, *site.view.args[1:])
            result = site.view
    out.replace_all_uses_with(result)
    for n in reversed(site.region):
        graph.erase_node(n)
    graph.erase_node(site.anchor)


def _copy_example(src: Node, dst: Node) -> None:
    if src.meta.get("example_value") is not None:
        dst.meta["example_value"] = src.meta["example_value"]


# The activations told apart by their values (`activation_of`), as the references compute them in float64.
ACTIVATIONS = {"relu": torch.relu, "gelu": lambda y: torch.nn.functional.gelu(y, approximate="tanh"),
               "gelu_exact": torch.nn.functional.gelu}
PROBE = torch.linspace(-12.0, 12.0, 24001, dtype=torch.float64)
MAX_REGION = 24  # pointwise nodes looked at after a GEMM: GPT-2's written-out GELU is 8


def activation_of(value: Node) -> tuple[tuple, str] | None:
    """(the nodes, in graph order, and which of `ACTIVATIONS`) where everything that reads `value` is a pointwise
    region of one input computing one of them, to 1e-9 on `PROBE` in float64, and nothing else reads inside it;
    else None. Pointwise means the registry's class of the op each node runs (random ops excluded), so the
    region's value at each element depends on that element alone, and a 1-D probe shows what it computes."""
    users = set(value.users)
    region: list[Node] = []
    inside = {value}
    ahead = set(users)  # readers of the region not yet reached: once none is left, it can grow no more
    node = value.next
    while ahead and node.op != "output" and len(region) < MAX_REGION:
        ahead.discard(node)
        tensors = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, Node)]
        if tensors and all(a in inside for a in tensors):
            name = graph_node_op(node.op, node.target)
            if name is None or op_class(name) != OpClass.POINTWISE or draws_random(name):
                break  # the region ends at the first reader that is no pointwise op
            region.append(node)
            inside.add(node)
            ahead |= set(node.users)
            closed = users <= set(region) and all(set(r.users) <= inside for r in region[:-1])
            if closed:
                kind = _identify(value, region)
                if kind is not None:
                    return tuple(region), kind
        node = node.next
    return None


def _identify(value: Node, region: list[Node]) -> str | None:
    """Which of `ACTIVATIONS` the region computes from `value` (its last node the result), by running it on
    `PROBE`; None where it is none of them or cannot run on a plain tensor."""
    env = {value: PROBE.clone()}

    def arg(a):
        return env[a] if isinstance(a, Node) else a

    try:
        for n in region:
            args = [arg(a) for a in n.args]
            kwargs = {k: arg(v) for k, v in n.kwargs.items()}
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" \
                else n.target(*args, **kwargs)
        got = env[region[-1]]
    except Exception:  # noqa: BLE001  (an op that runs on no plain tensor, or not with these arguments: not one)
        return None
    if not isinstance(got, torch.Tensor) or got.shape != PROBE.shape:
        return None
    for kind, fn in ACTIVATIONS.items():
        want = fn(PROBE)
        if bool(((got.double() - want).abs() <= 1e-9 * (1 + want.abs())).all()):
            return kind
    return None


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
        ms_two, ms_one = (time_call(f, "cuda", warmup=3, iters=reps).median_ms for f in (two, one))
    why = f"{ms_one:.3f} ms against {ms_two:.3f} ms as two kernels"
    return Verdict(ms_one < ms_two, why)


def both_ways(shape: EpilogueShape, fused: Callable = linear_activation) -> tuple[Callable, Callable]:
    """(`fused` on random inputs of `shape`, the linear and the activation on the same inputs) as functions of
    nothing: what is checked and timed. The bias is random (a linear without one gets zeros: as fast on the
    H200); the reference is the graph's own activation."""
    gen = torch.Generator(device=shape.device).manual_seed(0)
    kw = dict(device=shape.device, dtype=shape.dtype, generator=gen)
    x = torch.randn(shape.rows, shape.k, **kw)
    w = torch.randn(shape.n, shape.k, **kw) * shape.k ** -0.5 if not shape.weight_kn else \
        (torch.randn(shape.k, shape.n, **kw) * shape.k ** -0.5).t()  # (N x K, as `linear` takes it, either way)
    b = torch.randn(shape.n, **kw) * 0.1
    act = ACTIVATIONS[shape.activation]
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

"""Eval conv epilogues: conv2d [-> BatchNorm (eval)] [-> residual add] -> ReLU as one cuDNN call.

No Triton kernel. An eval BatchNorm is a per-channel affine map, so it folds into the conv's weight and bias:
w' = w * g / sqrt(var + eps) per output channel, b' = (b - mean) * g / sqrt(var + eps) + beta. cuDNN then runs
conv + bias + ReLU (`torch.cudnn_convolution_relu`), or conv + bias + residual + ReLU
(`torch.cudnn_convolution_add_relu`), in the conv's own kernel: the conv output never goes to memory and back.
Measured on the H100 (ResNet-50's shapes, bf16 channels_last, batch 128, docs/EXPERIMENTS.md: conv_bn_paths,
docs/EXPERIMENTS.md: conv_bn_paths): 0.053-0.224 ms per conv block against 0.097-0.634 ms eager (conv, BatchNorm, ReLU, add:
5-7 kernels) and 0.115-0.303 ms for conv + one fused pointwise kernel (Inductor's default, and this project's
BatchNorm + ReLU kernel). Folding alone (conv2d with the folded bias, then the ReLU) measured no faster than
eager, so activations other than ReLU (hardswish, SiLU: cuDNN's fused conv has none) are not generated here:
their BatchNorm + activation stays the pointwise kernel.

The fold (in fp32, a few small kernels on the weights) is computed once per set of weights and again, into the same
tensors, when one of them changed (`kernels/derived.py`; CUDA-graph replays refresh it first). Computed on every
call it cost more than the fused conv saves: ResNet-50 came back 6.76 ms against 6.11 ms on the H100 (758 kernels
per call against 120).
Without a GPU (validation in the interpreter, CPU models) the same folded weights run through F.conv2d.
Validation holds the conv's channels and spatial sizes at the recorded ones (the output size follows from the
input's through stride and padding) and varies the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


from advisor.codegen.ir import Program, Sizes, Value, View, Input, Op, torch_dtype
from advisor.codegen.matmul import ANCHOR, MATMUL_DTYPES, Anchored
from advisor.codegen.read import _read_op, read_args, set_outputs
from advisor.ops.lowering import Unsupported
from advisor.ops.registry import CONV_EPILOGUE, conv_epilogue_fits

CONV_REASON = "conv epilogues: cuDNN fuses a conv with BatchNorm (eval), a residual add and a ReLU only"


@dataclass
class ConvEpilogue:
    ctx: Anchored  # the program's IR (what validation draws inputs for and replays)
    x: str
    w: str
    bias: str | None
    norm: dict | None  # {"gamma", "beta", "mean", "var": input id or None, "eps": float}
    z: str | None  # the residual added before the ReLU
    stride: list
    padding: list
    dilation: list
    groups: int
    out_bytes: int  # the conv output eager writes and reads back, at the recorded shapes


def _input_id(v, p: Program, what: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, View) or not isinstance(p.source(v.src), Input) or not v.identity:
        raise Unsupported(f"conv epilogue: the {what} is not a whole input of the group")
    return v.src


def read_conv_epilogue(program: dict) -> ConvEpilogue:
    """The IR and the roles of a conv epilogue program; raises Unsupported saying why it is not one."""
    nodes = program.get("nodes") or []
    if not conv_epilogue_fits([n["op"] for n in nodes]):
        raise Unsupported(f"{CONV_REASON}; this one is {' -> '.join(n['op'].split('::')[-1] for n in nodes)}")
    sizes = Sizes()
    p = Program([], {}, [], [], sizes)
    for k, spec in enumerate(program["inputs"]):
        shape = [sizes.symbol(f"in{k}.{d}", n) for d, n in enumerate(spec["shape"])]
        p.inputs.append(Input(spec["id"], torch_dtype(spec["dtype"]), shape, list(spec["shape"]),
                              list(spec["strides"]), int(spec.get("storage_offset") or 0)))
    conv_spec = nodes[0]
    schema, args = read_args(p, conv_spec)
    x, w = _input_id(args.get("input"), p, "conv input"), _input_id(args.get("weight"), p, "conv weight")
    bias = _input_id(args.get("bias"), p, "conv bias")
    xin = p.source(x)
    if len(xin.shape) != 4 or xin.dtype not in MATMUL_DTYPES:
        raise Unsupported(f"conv epilogue: a {len(xin.shape)}-d {str(xin.dtype)[6:]} input (4-d fp32/bf16/fp16 only)")
    out = conv_spec["outputs"][0]
    batch = xin.shape[0]
    # (symbols are named as inputs' are, "in<k>.<dim>": k past the last input, so they sort after them)
    out_shape = [batch] + [sizes.symbol(f"in{len(p.inputs)}.{d}", n) for d, n in enumerate(out["shape"]) if d]
    op = Op(conv_spec["id"], conv_spec["op"], schema.overload_name or "default", ANCHOR, args, [], False)
    v = Value(out["id"], torch_dtype(out["dtype"]), out_shape, list(out["shape"]), list(out["strides"]), op, 0)
    op.outputs.append(v)
    p.values[v.id] = v
    p.ops.append(op)
    chain, norm, z = v.id, None, None
    for spec in nodes[1:]:
        role = CONV_EPILOGUE[spec["op"]]
        nop = _read_op(p, spec)
        a = nop.args
        main = a.get("input") if role == "norm" else a.get("self")
        if role == "add":
            other = a.get("other")
            if isinstance(main, View) and main.src != chain and isinstance(other, View) and other.src == chain:
                main, other = other, main  # z + conv(x): the chain is the second operand
            if float(a.get("alpha") if a.get("alpha") is not None else 1) != 1:
                raise Unsupported("conv epilogue: a residual add with alpha != 1")
            z = _input_id(other, p, "residual")
            if p.source(z).rec_shape != v.rec_shape:
                raise Unsupported("conv epilogue: the residual is broadcast, not the conv output's shape")
        if not isinstance(main, View) or main.src != chain:
            raise Unsupported(f"conv epilogue: {spec['op']} does not read the conv's chain")
        if role == "norm":
            if a.get("training") or not isinstance(a.get("running_mean"), View) \
                    or not isinstance(a.get("running_var"), View):
                raise Unsupported("conv epilogue: a BatchNorm in training mode (batch statistics) does not fold")
            norm = {"gamma": _input_id(a.get("weight"), p, "BatchNorm weight"),
                    "beta": _input_id(a.get("bias"), p, "BatchNorm bias"),
                    "mean": _input_id(a["running_mean"], p, "running mean"),
                    "var": _input_id(a["running_var"], p, "running variance"), "eps": float(a.get("eps") or 1e-5)}
        p.ops.append(nop)
        chain = nop.outputs[0].id
    set_outputs(p, program["outputs"])
    if [o.id for o in p.outputs] != [chain] or p.inplace and any(isinstance(p.source(iv.src), Input)
                                                              for iv in p.inplace.values()):
        raise Unsupported("conv epilogue: an intermediate escapes the group, or an input is written in place")
    # Only the batch varies in validation: the output's spatial size follows the input's through the conv.
    free = {sizes.find(t) for t in (batch.terms if batch.terms else ())}
    for d in [d for i in p.inputs for d in i.shape] + out_shape[1:]:
        if not ({sizes.find(t) for t in d.terms} & free):
            sizes.pin(d)
    st, pd, dl = (list(args[k]) if isinstance(args.get(k), (list, tuple)) else [args.get(k)] * 2
                  for k in ("stride", "padding", "dilation"))
    nbytes = math.prod(v.rec_shape) * v.dtype.itemsize
    return ConvEpilogue(Anchored(p, {}), x, w, bias, norm, z, st, pd, dl, int(args.get("groups") or 1), nbytes)


def conv_epilogue_source(c: ConvEpilogue) -> str:
    p = c.ctx.prog
    ids = [i.id for i in p.inputs]
    names = {c.x: "x", c.w: "w"}
    if c.bias:
        names[c.bias] = "bias"
    if c.z:
        names[c.z] = "z"
    n = c.norm or {}
    for role in ("gamma", "beta", "mean", "var"):
        if n.get(role):
            names[n[role]] = role
    unpack = ", ".join(names.get(i, "_") for i in ids)
    ops = " -> ".join(o.name for o in p.ops)
    conv_args = "STRIDE, PADDING, DILATION, GROUPS"
    lines = [
        f"# {ops} as one cuDNN call: see advisor/codegen/conv.py.",
        "import torch",
        "import torch.nn.functional as F",
        "",
        "from advisor.kernels.derived import derived  # cached per weights, refreshed when they change",
        "",
        f"STRIDE, PADDING, DILATION, GROUPS = {c.stride!r}, {c.padding!r}, {c.dilation!r}, {c.groups!r}",
        f"EPS = {n.get('eps', 0.0)!r}",
        "DIFFERENTIABLE = False  # cuDNN's fused conv has no backward: a site that trains runs the original ops",
        "",
        "",
        "def _fold(w, bias, gamma, beta, mean, var):",
        '    """The eval BatchNorm folded into the conv: w * scale per output channel, (bias - mean) * scale + beta."""',
        "    scale = torch.rsqrt(var.float() + EPS)",
        "    if gamma is not None:",
        "        scale = scale * gamma.float()",
        "    shift = -mean.float() * scale",
        "    if beta is not None:",
        "        shift = shift + beta.float()",
        "    if bias is not None:",
        "        shift = shift + bias.float() * scale",
        "    w = (w.float() * scale.view(-1, *([1] * (w.dim() - 1)))).to(w.dtype)",
        "    return w, shift.to(w.dtype)",
        "",
        "",
        f"def run({', '.join(ids)}):",
        f'    """{ops}."""',
        f"    {unpack}{',' if len(ids) == 1 else ''} = {', '.join(ids)}",
    ]
    if c.norm:
        lines.append(f"    w, bias = derived(_fold, w, {'bias' if c.bias else 'None'}, {'gamma' if n.get('gamma') else 'None'}, "
                     f"{'beta' if n.get('beta') else 'None'}, mean, var)")
    elif not c.bias:
        lines.append("    bias = None")
    lines.append("    if x.is_cuda and torch.backends.cudnn.enabled:")
    if c.z:
        lines += [f"        return (torch.cudnn_convolution_add_relu(x, w, z, 1.0, bias, {conv_args}),)",
                  f"    return (torch.relu(F.conv2d(x, w, bias, {conv_args}) + z),)"]
    else:
        lines += [f"        return (torch.cudnn_convolution_relu(x, w, bias, {conv_args}),)",
                  f"    return (torch.relu(F.conv2d(x, w, bias, {conv_args})),)"]
    return "\n".join(lines) + "\n"

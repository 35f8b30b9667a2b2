"""The original program run op by op through PyTorch: the ground truth a kernel is compared with.

`mode="native"` replays it in the recorded dtypes (what eager computes); `mode="fp64"` upcasts every
floating input and dtype argument to float64 (the exact answer, up to fp64 rounding). 0-dim float64
and int64 inputs are the model's Python scalars (wrapped numbers), so they are passed as Python
numbers, which keeps torch's type promotion exactly as eager had it.
"""
from __future__ import annotations

import math

import torch

from advisor.analysis.program import as_torch, declared_types
from advisor.codegen.ir import Program, View
from advisor.validate.shapes import Case


def run_reference(prog: Program, case: Case, inputs: dict, mode: str) -> tuple[dict, dict]:
    """({value id: tensor}, {input id: tensor after the run}) for the program on clones of `inputs`."""
    env = {}
    for k, t in inputs.items():
        env[k] = _clone_strided(t, torch.float64 if mode == "fp64" and t.is_floating_point() else t.dtype)
    for op in prog.ops:
        fn = getattr(getattr(torch.ops.aten, op.name.split("::")[1]), op.overload)
        first = next((v for v in op.args.values() if isinstance(v, View)), None)
        if first is not None and first.shape:
            env["__row_width__"] = case.size(prog, first.shape[-1])
        args, kwargs = [], {}
        tensors = [env[v.src] for v in op.args.values() if isinstance(v, View) and env[v.src].dim() > 0]
        for a, declared in zip(fn._schema.arguments, declared_types(fn._schema)):
            if a.name not in op.args:
                continue
            val = _arg(prog, case, env, op.args[a.name], a, declared, mode, tensors)
            if a.kwarg_only:
                kwargs[a.name] = val
            else:
                args.append(val)
        res = fn(*args, **kwargs)
        res = res if isinstance(res, (tuple, list)) else (res,)
        for v, r in zip(op.outputs, res):
            env[v.id] = r
    return env, {k: env[k] for k in inputs}


def _arg(prog: Program, case: Case, env: dict, v, schema_arg, declared: str, mode: str, tensors: list):
    if isinstance(v, View):
        src = prog.source(v.src)
        t = env[v.src]
        if v.src in inputs_of(prog) and t.dim() == 0 and src.dtype in (torch.float64, torch.int64) \
                and schema_arg.alias_info is None:
            return _wrapped(t.item(), tensors)  # a Python scalar in the model
        return view_of(prog, case, t, v)
    if str(schema_arg.type).startswith("Tensor") and isinstance(v, (bool, int, float)):
        return _wrapped(v, tensors)
    if isinstance(v, list) and v and isinstance(v[0], View):
        return [view_of(prog, case, env[x.src], x) for x in v]
    # By the declared type (a parsed schema says `int` for a ScalarType): an explicit cast (`.to(bf16)`) left
    # in the fp64 "exact" answer rejected kernels more accurate than eager (found by tests/test_fuzz.py).
    # No device: the reference runs where its inputs are.
    v = as_torch(v, declared)
    if isinstance(v, torch.dtype) and mode == "fp64" and v.is_floating_point:
        return torch.float64
    if schema_arg.name == "half_to_float" and mode == "fp64":
        return False
    if schema_arg.name == "normalized_shape" and isinstance(v, list) and len(v) == 1:
        return [env["__row_width__"]]  # normalises the last dim, whatever its size in this case
    if schema_arg.name in SIZES_OF_INPUT and tensors:  # native_group_norm's N, C, HxW: its input's, in this case
        return SIZES_OF_INPUT[schema_arg.name](tensors[0].shape)
    return v


# Integer arguments that restate the first input's sizes (`native_group_norm(input, weight, bias, N, C, HxW,
# group, eps)`): recorded as numbers, they must follow the input at every validation shape.
SIZES_OF_INPUT = {"N": lambda s: s[0], "C": lambda s: s[1], "HxW": lambda s: math.prod(s[2:])}


def _wrapped(v, tensors: list) -> torch.Tensor:
    """A stand-in for a number torch wraps into a 0-dim tensor: a CPU scalar tensor that promotes like
    the number would (it never changes the dtype of the tensor operands) and keeps its value in the
    compute dtype (ATen reads CPU scalars in opmath precision)."""
    other = next((t for t in tensors if t.dtype != torch.bool), tensors[0] if tensors else None)
    dt = torch.result_type(other, v) if other is not None else torch.tensor(v, device="cpu").dtype
    if dt in (torch.bfloat16, torch.float16):
        dt = torch.float32
    return torch.tensor(v, dtype=dt, device="cpu")


def inputs_of(prog: Program) -> set:
    return {i.id for i in prog.inputs}


def view_of(prog: Program, case: Case, t: torch.Tensor, v: View) -> torch.Tensor:
    """The tensor a ref reads: `t` seen through the view's index map at the case's sizes."""
    if v.identity:
        return t
    sizes = [case.size(prog, d) for d in v.shape]
    strides = [t.stride(w[0]) * w[1] if w is not None else 0 for w in v.walks()]
    offset = t.storage_offset() + sum(s * t.stride(e) for e, s in enumerate(v.starts) if s)
    return torch.as_strided(t, sizes, strides, offset)


def _clone_strided(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of t's whole storage viewed like t, so reads outside the view still see the same data."""
    whole = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    base = whole.to(dtype, copy=True)
    return torch.as_strided(base, t.shape, t.stride(), t.storage_offset())

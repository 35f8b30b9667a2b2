"""How each aten op lowers to Triton: the table the generator (`advisor.codegen`) compiles programs with.

Pointwise entries turn operand expressions into one Triton expression. The generator has already
cast the operands to the compute dtype given by `promote` (PyTorch's type promotion, with bf16/fp16
computed in fp32 as ATen's opmath does); it casts the result to the output dtype on store.

    common   operands promoted together (torch.result_type); computed in the output's opmath dtype
    float    like common, but integer inputs compute in float (true division, transcendental ops)
    compare  operands promoted together; the result is bool
    logical  operands converted to bool
    none     operands arrive as they are (conversions, where/masked_fill pick their own types)

Row entries (`kind="row"`) decompose reductions, softmax and norms over the last dim into primitive
reductions and pointwise steps through a builder (`b.reduce`, `b.op`); the generator turns that into
a persistent kernel (row in registers) or a looped one (chunked passes) for wide rows.

Only core `tl` math runs in both the GPU compiler (triton 3.6+) and the interpreter, so tanh, expm1,
log1p, pow, round, ... are composed from it in small `@triton.jit` helpers (`advisor.codegen.helpers`),
copied into every generated module that calls them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from advisor.ops.registry import LOWERINGS, lookup


class Unsupported(Exception):
    """The op (with these arguments) has no lowering; the message is the reason users see."""


@dataclass(frozen=True)
class Lowering:
    op: str  # "aten::add" (in-place twins share the entry)
    kind: str  # "pointwise" | "cat" | "row" | "window"
    emit: Callable | None
    promote: str = "common"
    operands: tuple = ("self",)  # schema args that are tensors or numbers taking part in promotion
    positive: tuple = ()  # operands that validation draws strictly positive (log, sqrt, pow, ...)
    shape: str = "broadcast"  # broadcast | cat | reduce | row | norm | group | channel | factory | window: output shapes
    channel: tuple = ()  # per-channel vector operands, indexed by dim 1 of the output (batch norm)


class Args:
    """What an emit function sees: operands as Triton expressions, other arguments as Python values."""

    def __init__(self, values: dict, compute: torch.dtype, out: torch.dtype, tensors=(), raw=None):
        self.__dict__.update(values)
        self.ct, self.out = compute, out
        self.tensors = set(tensors)  # names of the tensor operands (the others are numbers)
        self.raw = raw or {}  # numbers as Python values, before they became literals

    @property
    def is_float(self) -> bool:
        return self.ct.is_floating_point

    def lit(self, v, dtype: torch.dtype | None = None) -> str:
        return lit(v, dtype or self.ct)


def lit(v, dtype: torch.dtype) -> str:
    """A Python number as a Triton literal of `dtype` (floats keep a dot; inf/nan spelled out)."""
    if dtype == torch.bool:
        return "True" if v else "False"
    if not dtype.is_floating_point:
        return str(int(v))
    v = float(v)
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else '-float("inf")'
    return repr(v)


# Every lowering lives in its op's registry entry; TABLE is that, seen as a mapping (see registry.LOWERINGS).
TABLE = LOWERINGS


def _add(name, kind, emit, **kw):
    TABLE[f"aten::{name}"] = Lowering(f"aten::{name}", kind, emit, **kw)


def pw(names: str, emit, promote="common", operands=("self",), **kw):
    for n in names.split():
        _add(n, "pointwise", emit, promote=promote, operands=operands, **kw)


def lowering(name: str) -> Lowering | None:
    """The entry for "aten::add", "aten::add.Tensor" or the in-place "aten::add_" (None if none)."""
    base = name.split(".", 1)[0] if "::" in name and "." in name.split("::", 1)[1] else name
    hit = TABLE.get(base)
    if hit is None and base.endswith("_") and not base.endswith("__"):
        hit = TABLE.get(base[:-1])
    return hit


# Output-shape rules whose kernels take every size as an argument: a kernel made at one batch and sequence
# serves any other (`patching.resize`). Not `group` (channels per group fixed in the kernel), `window` (the
# pooling geometry fixed) or `factory` (literal sizes).
_ANY_ROWS = frozenset({"broadcast", "cat", "reduce", "row", "norm", "channel"})


def serves_any_rows(name: str) -> bool:
    """Whether a kernel generated for this op computes it at any leading sizes (the last dim as recorded)."""
    low = lowering(name)
    return low is not None and low.kind in ("pointwise", "cat", "row") and low.shape in _ANY_ROWS


def why_not_generated(name: str) -> str | None:
    """Why the generator refuses an op ("" never: a reason or None when it has a lowering)."""
    if lowering(name) is not None:
        return None
    info = lookup(name)
    if info is None:
        return "not in the op registry"
    return info.not_generated or f"no Triton lowering for {info.short}"


# ------------------------------------------------------------------------------------- arithmetic
BIN = ("self", "other")
MAX = "tl.maximum({}, {}, propagate_nan=tl.PropagateNan.ALL)"  # torch's max/min/clamp/relu keep NaN
MIN = "tl.minimum({}, {}, propagate_nan=tl.PropagateNan.ALL)"


def _scaled(a, v):  # alpha * v, skipping alpha == 1
    return v if a.alpha == 1 else f"{a.lit(a.alpha)} * {v}"


pw("add", lambda a: f"{a.self} + {_scaled(a, a.other)}", operands=BIN)
pw("sub", lambda a: f"{a.self} - {_scaled(a, a.other)}", operands=BIN)
pw("rsub", lambda a: f"{a.other} - {_scaled(a, a.self)}", operands=BIN)
pw("mul", lambda a: f"{a.self} * {a.other}", operands=BIN)
pw("true_divide", lambda a: f"{a.self} / {a.other}", "float", BIN)
pw("fmod", lambda a: f"{a.self} % {a.other}", operands=BIN)  # Triton's % is C's fmod, as torch.fmod
pw("remainder", lambda a: f"_remainder({a.self}, {a.other})", operands=BIN)
pw("floor_divide", lambda a: _div_floor(a), operands=BIN)


def _div(a):
    mode = getattr(a, "rounding_mode", None)
    if mode is None:
        return f"{a.self} / {a.other}"
    if mode == "trunc":
        return f"_trunc({a.self} / {a.other})" if a.is_float else f"{a.self} // {a.other}"  # // truncates
    if mode == "floor":
        return _div_floor(a)
    raise Unsupported(f"div rounding_mode={mode!r}")


def _div_floor(a):
    return f"_div_floor({a.self}, {a.other})" if a.is_float else f"_div_floor_int({a.self}, {a.other})"


# div with a rounding mode keeps integer dtypes; plain div is true division: the output dtype decides.
pw("div", _div, "common", BIN)


def _pow_scalar(a):
    x, e = a.self, a.raw["exponent"]
    if not a.is_float:
        if isinstance(e, (bool, float)) or not 0 <= e <= 8:
            raise Unsupported(f"integer pow with exponent {e!r}")
        return " * ".join([x] * e) if e else f"tl.zeros_like({x}) + 1"
    special = {0: "tl.zeros_like({x}) + 1.0", 1: "{x}", 2: "{x} * {x}", 3: "{x} * {x} * {x}",
               4: "({x} * {x}) * ({x} * {x})", -1: "1.0 / {x}", -2: "1.0 / ({x} * {x})",
               0.5: "tl.sqrt({x})", -0.5: "tl.rsqrt({x})"}
    if e in special and not isinstance(e, bool):
        return special[e].format(x=x)
    return f"_pow({x}, {a.lit(e)})"


def _pow(a):
    if "exponent" not in a.tensors:
        return _pow_scalar(a)
    if not a.is_float:
        raise Unsupported("integer pow with a tensor exponent")
    if "self" not in a.tensors and a.raw["self"] == 2:
        return f"tl.exp2({a.exponent})"
    return f"_pow({a.self}, {a.exponent})"  # Tensor_Tensor, or Scalar (a literal base)


pw("pow float_power", _pow, operands=("self", "exponent"))

# ------------------------------------------------------------------------------------- unary math
UNARY_FLOAT = {  # integer inputs compute in the default float dtype
    "exp": "tl.exp({})", "exp2": "tl.exp2({})", "expm1": "_expm1({})", "log": "tl.log({})",
    "log2": "tl.log2({})", "log10": "tl.log({}) * 0.4342944819032518", "log1p": "_log1p({})",
    "sqrt": "tl.sqrt({})", "rsqrt": "tl.rsqrt({})", "reciprocal": "1.0 / {}", "sin": "tl.sin({})",
    "cos": "tl.cos({})", "tan": "tl.sin({0}) / tl.cos({0})", "tanh": "_tanh({})",
    "sinh": "0.5 * (_expm1({0}) - _expm1(-{0}))", "cosh": "0.5 * (tl.exp({0}) + tl.exp(-{0}))",
    "asinh": "_asinh({})", "acosh": "tl.log({0} + tl.sqrt({0} * {0} - 1.0))",
    "atanh": "0.5 * _log1p(2.0 * {0} / (1.0 - {0}))", "sigmoid": "1.0 / (1.0 + tl.exp(-{}))",
    "erf": "tl.erf({})", "erfc": "1.0 - tl.erf({})", "atan": "_atan({})",
    # asin/acos as atan2 of the legs; (1 - x)(1 + x) keeps precision near |x| = 1; NaN past it, as torch.
    "asin": "_atan2({0}, tl.sqrt((1.0 - {0}) * (1.0 + {0})))", "acos": "_atan2(tl.sqrt((1.0 - {0}) * (1.0 + {0})), {0})",
}
POSITIVE = {"log", "log2", "log10", "sqrt", "rsqrt", "acosh"}
for _n, _f in UNARY_FLOAT.items():
    pw(_n, lambda a, f=_f: f.format(a.self), "float", positive=("self",) if _n in POSITIVE else ())


def _float_or_same(fmt):  # floor/ceil/round/trunc/frac leave integer tensors as they are
    return lambda a: fmt.format(a.self) if a.is_float else a.self


pw("floor", _float_or_same("tl.floor({})"))
pw("ceil", _float_or_same("tl.ceil({})"))
pw("trunc fix", _float_or_same("_trunc({})"))
pw("frac", lambda a: f"{a.self} - _trunc({a.self})")


def _round(a):
    if not a.is_float:
        return a.self
    d = getattr(a, "decimals", 0)
    if not d:
        return f"_round_half_even({a.self})"
    scale = a.lit(10.0 ** d)
    return f"_round_half_even({a.self} * {scale}) / {scale}"


pw("round", _round)
pw("neg negative", lambda a: f"-{a.self}")
pw("positive clone alias_copy", lambda a: a.self)
pw("abs absolute", lambda a: f"tl.abs({a.self})")
pw("square", lambda a: f"{a.self} * {a.self}")
pw("sign sgn", lambda a: f"({a.self} > 0).to({tl_type(a.ct)}) - ({a.self} < 0).to({tl_type(a.ct)})")
pw("signbit", lambda a: f"({a.self} < 0) | (({a.self} == 0) & (1.0 / {a.self} < 0))", "compare")
pw("isnan", lambda a: f"{a.self} != {a.self}", "compare")
pw("isinf", lambda a: f"tl.abs({a.self}) == float(\"inf\")" if a.is_float else f"{a.self} != {a.self}",
   "compare")
pw("isfinite", lambda a: f"tl.abs({a.self}) < float(\"inf\")" if a.is_float else f"{a.self} == {a.self}",
   "compare")


def _nan_to_num(a):
    fi = torch.finfo(a.out)
    nan = a.lit(0.0 if a.nan is None else a.nan)
    pos = a.lit(fi.max if a.posinf is None else a.posinf)
    neg = a.lit(fi.min if a.neginf is None else a.neginf)
    x = a.self
    return (f"tl.where({x} != {x}, {nan}, tl.where({x} == float(\"inf\"), {pos}, "
            f"tl.where({x} == -float(\"inf\"), {neg}, {x})))")


pw("nan_to_num", _nan_to_num)

# ------------------------------------------------------------------ comparisons, logic, selection
for _n, _o in {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}.items():
    pw(_n, lambda a, o=_o: f"{a.self} {o} {a.other}", "compare", BIN)


def _bitwise(a, o: str) -> str:
    """`self o other`; on bools through int8, because Triton's interpreter keeps the bool of a comparison of
    scalars as float data and then refuses | & ^ with a block of bools (the GPU folds the casts away)."""
    if a.ct != torch.bool:
        return f"{a.self} {o} {a.other}"
    i8 = lambda n: f"{getattr(a, n)}.to(tl.int8)" if n in a.tensors else getattr(a, n)  # noqa: E731
    return f"({i8('self')} {o} {i8('other')}) != 0"


for _n, _o in {"logical_and": "&", "logical_or": "|", "logical_xor": "^"}.items():
    pw(_n, lambda a, o=_o: _bitwise(a, o), "logical", BIN)
pw("logical_not", lambda a: f"{a.self} == 0", "logical")
for _n, _o in {"bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}.items():
    pw(_n, lambda a, o=_o: _bitwise(a, o), operands=BIN)
pw("bitwise_not", lambda a: f"{a.self} == 0" if a.ct == torch.bool else f"~{a.self}")
pw("maximum max", lambda a: MAX.format(a.self, a.other), operands=BIN)
pw("minimum min", lambda a: MIN.format(a.self, a.other), operands=BIN)
pw("fmax", lambda a: f"tl.maximum({a.self}, {a.other})", operands=BIN)  # NaN-ignoring, like fmax
pw("fmin", lambda a: f"tl.minimum({a.self}, {a.other})", operands=BIN)


def _clamp(a):
    x = a.self
    lo, hi = getattr(a, "min", None), getattr(a, "max", None)
    if lo is not None:
        x = MAX.format(x, lo)
    if hi is not None:
        x = MIN.format(x, hi)
    return x


pw("clamp clip", _clamp, operands=("self", "min", "max"))
pw("clamp_min", _clamp, operands=("self", "min"))
pw("clamp_max", _clamp, operands=("self", "max"))
pw("where", lambda a: f"tl.where({a.condition}, {a.self}, {a.other})", operands=("self", "other"))
pw("masked_fill", lambda a: f"tl.where({a.mask}, {a.value}, {a.self})", operands=("self", "value"))
pw("heaviside", lambda a: f"tl.where({a.self} == 0, {a.values}, ({a.self} > 0).to({tl_type(a.ct)}))",
   operands=("self", "values"))
pw("copysign", lambda a: (f"tl.where(({a.other} < 0) | (({a.other} == 0) & (1.0 / {a.other} < 0)), "
                          f"-tl.abs({a.self}), tl.abs({a.self}))"), "float", BIN)
pw("atan2", lambda a: f"_atan2({a.self}, {a.other})", "float", BIN)
pw("hypot", lambda a: f"tl.sqrt({a.self} * {a.self} + {a.other} * {a.other})", "float", BIN)
pw("xlogy", lambda a: (f"tl.where({a.other} != {a.other}, {a.other}, "
                       f"tl.where({a.self} == 0, 0.0, {a.self} * tl.log({a.other})))"), "float", BIN,
   positive=("other",))
pw("lerp", lambda a: (f"tl.where({a.weight} < 0.5, {a.self} + {a.weight} * ({a.end} - {a.self}), "
                      f"{a.end} - ({a.end} - {a.self}) * (1.0 - {a.weight}))"),
   operands=("self", "end", "weight"))
pw("addcmul", lambda a: f"{a.self} + {a.lit(a.value)} * {a.tensor1} * {a.tensor2}",
   operands=("self", "tensor1", "tensor2"))
pw("addcdiv", lambda a: f"{a.self} + {a.lit(a.value)} * ({a.tensor1} / {a.tensor2})",
   operands=("self", "tensor1", "tensor2"))

# ------------------------------------------------------------------------------------ activations
pw("relu", lambda a: MAX.format(a.self, a.lit(0)))
pw("relu6", lambda a: MIN.format(MAX.format(a.self, a.lit(0)), a.lit(6)))
pw("hardtanh", lambda a: MIN.format(MAX.format(a.self, a.lit(a.min_val)), a.lit(a.max_val)))
pw("leaky_relu", lambda a: f"tl.where({a.self} > 0, {a.self}, {a.self} * {a.lit(a.negative_slope)})")
pw("threshold", lambda a: f"tl.where({a.self} <= {a.lit(a.threshold)}, {a.lit(a.value)}, {a.self})")
pw("silu", lambda a: f"{a.self} / (1.0 + tl.exp(-{a.self}))", "float")
pw("hardsigmoid", lambda a: f"{MIN.format(MAX.format(f'{a.self} + 3.0', '0.0'), '6.0')} / 6.0", "float")
pw("hardswish", lambda a: f"{a.self} * {MIN.format(MAX.format(f'{a.self} + 3.0', '0.0'), '6.0')} / 6.0",
   "float")
pw("mish", lambda a: f"{a.self} * _tanh(_softplus({a.self}, 1.0, 20.0))", "float")
pw("softplus", lambda a: f"_softplus({a.self}, {a.lit(a.beta)}, {a.lit(a.threshold)})", "float")


def _gelu(a):
    x = a.self
    if getattr(a, "approximate", "none") == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        return f"0.5 * {x} * (1.0 + _tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})))"
    return f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))"


pw("gelu", _gelu, "float")


def _elu(a, alpha=None, scale=1.0, input_scale=1.0):
    alpha = a.alpha if alpha is None else alpha
    neg = f"{a.lit(alpha * scale)} * _expm1({a.self} * {a.lit(input_scale)})"
    return f"tl.where({a.self} > 0, {a.self} * {a.lit(scale)}, {neg})"


pw("elu", lambda a: _elu(a, a.alpha, a.scale, a.input_scale), "float")
pw("selu", lambda a: _elu(a, 1.6732632423543772, 1.0507009873554805), "float")
pw("celu", lambda a: _elu(a, a.alpha, 1.0, 1.0 / a.alpha), "float")


def _logit(a):
    z = a.self
    if a.eps is not None:
        z = MIN.format(MAX.format(z, a.lit(a.eps)), a.lit(1.0 - a.eps))
    return f"tl.log({z} / (1.0 - {z}))"


pw("logit", _logit, "float")

# ---------------------------------------------------------------- conversions, copies, identities
# The generator casts the result to the output dtype (rounding through bf16/fp16 when narrowing).
pw("_to_copy _autocast_to_reduced_precision", lambda a: a.self, "none")
pw("copy", lambda a: a.src, "none", operands=("src",))  # copy_(self, src): src broadcast into self


def _dropout(a):
    train = getattr(a, "train", False)
    if train not in (False, None) or (a.op == "aten::native_dropout" and train is None):
        raise Unsupported("dropout in training mode is random: nothing to fuse deterministically")
    if a.op == "aten::native_dropout":
        return a.input, f"tl.zeros_like({a.input}) == 0"  # (output, keep-mask of all True)
    return a.input


pw("dropout feature_dropout alpha_dropout native_dropout", _dropout, "none", operands=("input",))
pw("fill", lambda a: f"tl.zeros_like({a.self}) + {a.value}", "none", operands=("self", "value"))
pw("zero", lambda a: f"tl.zeros_like({a.self})", "none")
# No tensor operand: the fill value is the whole expression (a literal in the output's compute dtype),
# broadcast by Triton wherever it meets the block; its shape comes from its `size` argument.
pw("full", lambda a: a.fill_value, operands=("fill_value",), shape="factory")



def _batch_norm(a):
    if getattr(a, "training", False) not in (False, None) or a.running_mean is None:
        raise Unsupported("batch_norm in training mode normalises by batch statistics: not pointwise")
    eps = getattr(a, "eps", getattr(a, "epsilon", 1e-5))
    y = f"({a.input} - {a.running_mean}) * tl.rsqrt({a.running_var} + {a.lit(eps)})"
    y = f"{y} * {a.weight}" if a.weight is not None else y
    return f"{y} + {a.bias}" if a.bias is not None else y


_BN = ("weight", "bias", "running_mean", "running_var")
pw("batch_norm native_batch_norm cudnn_batch_norm miopen_batch_norm _native_batch_norm_legit_no_training",
   _batch_norm, operands=("input",) + _BN, channel=_BN, shape="channel", positive=("running_var",))

# --------------------------------------------------------------------------------------------- cat
_add("cat", "cat", None, promote="none", operands=("tensors",), shape="cat")


# ------------------------------------------------------------------------------------------ windows
# Max-pooling: the max over each output element's window, tap by tap (`Builder.eval_window`), so the chain
# before it is computed at every tap and never written: ResNet's stem (BatchNorm + ReLU + max-pool) is one
# kernel, as Inductor makes it. The spatial sizes are fixed at the recorded ones (`shapes`: rule "window").
_add("max_pool2d", "window", None, promote="none", operands=("self",), shape="window")
_add("max_pool2d_with_indices", "window", None, promote="none", operands=("self",), shape="window")


# ------------------------------------------------------------------------- rows (last-dim ops)
# emit(b, a): `a.self` (and weight, bias) are builder nodes already in the compute dtype; b.reduce
# sums/maxes over the row, b.op applies a pointwise format, b.n is the row width. Outputs in schema order.
def row(names: str, emit, shape="reduce", operands=("self",), promote="row", **kw):
    for n in names.split():
        _add(n, "row", emit, promote=promote, operands=operands, shape=shape, **kw)


def _correction(a) -> float:
    if getattr(a, "correction", None) is not None:
        return float(a.correction)
    return 1.0 if getattr(a, "unbiased", True) in (True, None) else 0.0


def _mean_var(b, a, x, correction):
    mean = b.op("{} / {}", b.reduce("sum", x), b.n)
    d = b.op("{} - {}", x, mean)
    return mean, b.op("{} / ({} - {})", b.reduce("sum", b.op("{} * {}", d, d)), b.n, b.lit(correction))


def _norm(b, a):
    p = getattr(a, "ord", getattr(a, "p", 2))
    p = 2.0 if p is None else float(p)
    ax = b.op("tl.abs({})", a.self)
    if p == 2:
        return (b.op("tl.sqrt({})", b.reduce("sum", b.op("{} * {}", a.self, a.self))),)
    if p == 1:
        return (b.reduce("sum", ax),)
    if math.isinf(p):
        return (b.reduce("max" if p > 0 else "min", ax),)
    return (b.op(f"_pow({{}}, {1.0 / p!r})", b.reduce("sum", b.op(f"_pow({{}}, {p!r})", ax))),)


def _softmax(b, a, log=False, safe=False):
    x = a.self
    m = b.reduce("max", x)
    if log:  # x - max - log(sum(exp(x - max)))
        s = b.reduce("sum", b.op("tl.exp({} - {})", x, m))
        return (b.op("{} - {} - tl.log({})", x, m, s),)
    e = b.op("tl.exp({} - {})", x, m)
    y = b.op("{} / {}", e, b.reduce("sum", e))
    return (b.op('tl.where({} == -float("inf"), 0.0, {})', m, y),) if safe else (y,)


def _logsumexp(b, a):
    m = b.reduce("max", a.self)
    m = b.op('tl.where(tl.abs({0}) == float("inf"), 0.0, {0})', m)  # all -inf rows stay -inf, not NaN
    return (b.op("tl.log({}) + {}", b.reduce("sum", b.op("tl.exp({} - {})", a.self, m)), m),)


def _layer_norm(b, a):
    mean, var = _mean_var(b, a, a.self, 0.0)
    rstd = b.op("tl.rsqrt({} + {})", var, b.lit(a.eps))
    y = b.op("({} - {}) * {}", a.self, mean, rstd)
    if a.weight is not None:
        y = b.op("{} * {}", y, a.weight)
    if a.bias is not None:
        y = b.op("{} + {}", y, a.bias)
    return y, mean, rstd


def _rms_norm(b, a):
    eps = a.eps if a.eps is not None else torch.finfo(a.in_dtype).eps
    ms = b.op("{} / {}", b.reduce("sum", b.op("{} * {}", a.self, a.self)), b.n)
    rstd = b.op("tl.rsqrt({} + {})", ms, b.lit(eps))
    y = b.op("{} * {}", a.self, rstd)
    return (b.op("{} * {}", y, a.weight) if a.weight is not None else y), rstd


def _arg_extreme(kind: str):
    """argmax/argmin: the first column holding the row's max (min); a NaN counts as the extreme, as in torch."""
    def emit(b, a):
        x = b.dag.cast(a.self, torch.int32) if a.self.dtype == torch.bool else a.self
        m = b.reduce(kind, x)
        hit = b.op("({} == {}) | ({} != {})", x, m, x, x, dtype=torch.bool)
        return (b.reduce("min", b.op("tl.where({}, {}, {})", hit, b.cols, b.n, dtype=torch.int32)),)  # a column
    return emit


row("argmax", _arg_extreme("max"), promote="input")
row("argmin", _arg_extreme("min"), promote="input")
row("sum", lambda b, a: (b.reduce("sum", a.self),))
row("mean", lambda b, a: (b.op("{} / {}", b.reduce("sum", a.self), b.n),))
row("amax max", lambda b, a: (b.reduce("max", a.self),))
row("amin min", lambda b, a: (b.reduce("min", a.self),))
row("prod", lambda b, a: (b.reduce("prod", a.self),))
row("all", lambda b, a: (b.reduce("all", a.self),))
row("any", lambda b, a: (b.reduce("any", a.self),))
row("var", lambda b, a: (_mean_var(b, a, a.self, _correction(a))[1],))
row("std", lambda b, a: (b.op("tl.sqrt({})", _mean_var(b, a, a.self, _correction(a))[1]),))
row("var_mean", lambda b, a: _mean_var(b, a, a.self, _correction(a))[::-1])
row("std_mean", lambda b, a: (lambda m, v: (b.op("tl.sqrt({})", v), m))(*_mean_var(b, a, a.self, _correction(a))))
row("linalg_vector_norm norm", _norm)
row("logsumexp", _logsumexp)
row("softmax _softmax", _softmax, shape="row")
row("_safe_softmax", lambda b, a: _softmax(b, a, safe=True), shape="row")
row("log_softmax _log_softmax", lambda b, a: _softmax(b, a, log=True), shape="row")
row("layer_norm", lambda b, a: _layer_norm(b, a)[:1], shape="norm", operands=("input", "weight", "bias"))
row("native_layer_norm", _layer_norm, shape="norm", operands=("input", "weight", "bias"))
# GroupNorm is LayerNorm's arithmetic over a row that is one (sample, group) (the plan's grouped rows,
# `codegen.plan.plan_group_rows`), with weight and bias per channel.
row("group_norm", lambda b, a: _layer_norm(b, a)[:1], shape="group", operands=("input", "weight", "bias"),
    channel=("weight", "bias"))
row("native_group_norm", _layer_norm, shape="group", operands=("input", "weight", "bias"), channel=("weight", "bias"))
row("rms_norm", lambda b, a: _rms_norm(b, a)[:1], shape="norm", operands=("input", "weight"))
row("_fused_rms_norm", _rms_norm, shape="norm", operands=("input", "weight"))


def tl_type(dtype: torch.dtype) -> str:
    return TL_TYPES[dtype]


TL_TYPES = {torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
            torch.bfloat16: "tl.bfloat16", torch.int64: "tl.int64", torch.int32: "tl.int32",
            torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}

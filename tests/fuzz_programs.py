"""Hypothesis strategies for random fusion programs: pointwise and last-dim reduction ops drawn from the
lowering table with valid argument domains, random shapes (size-1 dims, sizes that are no multiple of
any block), broadcasting, strided inputs (transposed, sliced, expanded, views taken inside the
function) and dtypes (fp32/bf16/fp16, some fp64, int and bool where the ops allow them).

A drawn `FuzzProgram` is plain Python source (`program.source`), so a failure prints a function you
can paste and run; `program.function()` compiles it and `program.make_inputs()` builds its inputs with
the drawn layouts.

Numerics are kept well-posed so that any mismatch is the generator's fault, not the program's:
- every float value carries a bound on its magnitude (inputs are drawn in [-3, 3], validation's own
  draws are normal, so the bounds assume 5); ops that would exceed `MAX_BOUND` (or overflow fp16) are
  not drawn;
- ops with a restricted domain get a guarded operand (`log(v.abs() + 0.5)`, `atanh(tanh(v) * 0.5)`);
- ops that are discontinuous (floor, round, sign, comparisons, float->int, remainder, ...) only take
  *exact* operands: values a fused kernel reproduces bit for bit (inputs and what neg/abs/relu/max/min/
  clamp/where make of them), because a kernel that keeps intermediates in fp32 may legitimately land
  on the other side of a step than eager's rounded intermediates;
- divisors are bounded away from zero (`clamp_min(y.abs(), 0.25)`), inputs are never zero.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INTS = (torch.int64, torch.int32)
MAX_BOUND = 200.0  # |value| bound every float value stays under (fp16 overflows at 65504)
INPUT_BOUND = 5.0  # validation draws normal values: |x| > 5 has probability 6e-7 per element
DIMS = (1, 1, 2, 3, 5, 7, 8, 13, 17)  # size-1 dims often; none is a multiple of the interpreter's blocks
ROW_WIDTHS = (1, 2, 3, 5, 8, 13, 17, 33)
MAX_NUMEL = 600
LOW = (torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------ values
@dataclass
class Val:
    name: str
    shape: tuple
    dtype: torch.dtype
    bound: float = INPUT_BOUND  # |v| <= bound (floats and ints)
    exact: bool = True  # a fused kernel computes it bit-identically to eager
    row: bool = False  # the output of a row op (only full-shape values may feed row ops)
    layout_ok: bool = False  # an input an in-place op may write into

    @property
    def cat(self) -> str:
        if self.dtype == torch.bool:
            return "bool"
        return "float" if self.dtype.is_floating_point else "int"


@dataclass
class InputSpec:
    name: str
    shape: tuple  # the shape the program sees
    dtype: torch.dtype
    layout: str  # contig | transposed | sliced | strided | offset | expanded | inner_t | inner_slice | inner_expand
    expand_dims: tuple = ()  # expanded / inner_expand: dims stored with size 1
    pad: int = 0  # sliced: extra columns; strided: the step

    def passed_shape(self) -> tuple:
        s = list(self.shape)
        if self.layout == "inner_t":
            s[-1], s[-2] = s[-2], s[-1]
        elif self.layout == "inner_slice":
            s[-1] += self.pad
        elif self.layout == "inner_expand":
            for d in self.expand_dims:
                s[d] = 1
        return tuple(s)

    def prologue(self) -> str | None:
        """The view the function takes of its argument, when the layout is made inside it."""
        if self.layout == "inner_t":
            return f"{self.name} = {self.name}.transpose(-1, -2)"
        if self.layout == "inner_slice":
            return f"{self.name} = {self.name}[..., 1:{self.shape[-1] + 1}]"
        if self.layout == "inner_expand":
            return f"{self.name} = {self.name}.expand({list(self.shape)})"
        return None


@dataclass
class FuzzProgram:
    inputs: list  # [InputSpec]
    lines: list  # statements, in order
    outputs: list  # variable names returned
    kind: str  # "pointwise" | "rows"
    seed: int = 0
    ops: list = field(default_factory=list)  # fuzz op names used, in order
    looped: bool = False  # rows: run the looped (chunked) row kernel instead of the persistent one
    planted: str | None = None  # the op a planted-bug program is built around

    @property
    def source(self) -> str:
        args = ", ".join(i.name for i in self.inputs)
        body = [p for p in (i.prologue() for i in self.inputs) if p] + list(self.lines)
        ret = ", ".join(self.outputs) + ("," if len(self.outputs) == 1 else "")
        return "\n".join([f"def f({args}):"] + [f"    {line}" for line in body] + [f"    return ({ret})"])

    def function(self):
        ns = {"torch": torch, "F": torch.nn.functional, "math": math}
        exec(compile(self.source, "<fuzz program>", "exec"), ns)
        return ns["f"]

    def describe(self) -> str:
        ins = "; ".join(f"{i.name}: {str(i.dtype)[6:]}{list(i.shape)} {i.layout}"
                        + (f" expand{list(i.expand_dims)}" if i.expand_dims else "") for i in self.inputs)
        extra = ", looped row kernel" if self.looped else ""
        return f"{self.source}\n# inputs: {ins}; seed {self.seed}{extra}"

    def make_inputs(self, device="cpu") -> list:
        g = torch.Generator(device="cpu").manual_seed(self.seed)
        return [_make_input(spec, g).to(device) if device != "cpu" else _make_input(spec, g) for spec in self.inputs]


def _values(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    if not dtype.is_floating_point:
        mag = torch.randint(1, 10, (n,), generator=g)
        return (mag * torch.where(torch.rand(n, generator=g) < 0.5, -1, 1)).to(dtype)
    x = torch.randn(n, dtype=torch.float64, generator=g).clamp(-3, 3).to(dtype)
    return torch.where(x == 0, torch.ones_like(x), x)  # never zero, like validation's draws


def _make_input(spec: InputSpec, g: torch.Generator) -> torch.Tensor:
    shape, lay = list(spec.passed_shape()), spec.layout

    def fresh(s):
        return _values(max(1, math.prod(s)), spec.dtype, g)[: math.prod(s)].reshape(s)

    if lay == "transposed":
        s = shape[:-2] + [shape[-1], shape[-2]]
        return fresh(s).transpose(-1, -2)
    if lay == "sliced":  # a column block of a wider tensor: padding between rows
        return fresh(shape[:-1] + [shape[-1] + spec.pad])[..., spec.pad:]
    if lay == "strided":  # every pad-th column
        return fresh(shape[:-1] + [shape[-1] * spec.pad])[..., ::spec.pad]
    if lay == "offset":  # rows of a taller tensor, starting at row 1
        return fresh([shape[0] + 2] + shape[1:])[1:shape[0] + 1]
    if lay == "expanded":
        s = [1 if d in spec.expand_dims else n for d, n in enumerate(shape)]
        return fresh(s).expand(shape)
    return fresh(shape)


# ---------------------------------------------------------------------------------- the builder
class _Builder:
    """Draws one program, line by line, keeping track of every value's shape, dtype, bound and exactness."""

    def __init__(self, draw, kind: str, base: tuple, dtype: torch.dtype):
        self.draw, self.kind, self.base, self.dtype = draw, kind, base, dtype
        self.vals: list[Val] = []
        self.lines: list[str] = []
        self.ops: list[str] = []
        self.n = 0
        self.required: str | None = None  # planted-bug programs: the value that must be returned
        self.used: set[str] = set()  # names read by some line

    def new(self, expr: str, shape, dtype, bound, exact, op: str, row=False) -> Val:
        self.used.update(re.findall(r"\b(?:v|in)\d+\b", expr))
        name = f"v{self.n}"
        self.n += 1
        self.lines.append(f"{name} = {expr}")
        v = Val(name, tuple(shape), dtype, float(bound), exact, row)
        self.vals.append(v)
        self.ops.append(op)
        return v

    def fits(self, shape) -> bool:
        """A shape values of this program may have: broadcastable to the base shape, or (rows) to one value per row."""
        if shape is None:
            return False
        return fits(shape, self.base) or (self.kind == "rows" and fits(shape, self.base[:-1]))

    def pick(self, pred=lambda v: True, label="operand") -> Val | None:
        c = [v for v in self.vals if pred(v)]
        return self.draw(st.sampled_from(c), label=label) if c else None

    def num(self, choices, label="scalar"):
        return self.draw(st.sampled_from(choices), label=label)


def bshape(a, b):
    if a is None or b is None:
        return None
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


def fits(shape, base) -> bool:
    """Right-aligned, each dim 1 or the base's: a value the program's domain can hold."""
    return len(shape) <= len(base) and all(n in (1, base[len(base) - len(shape) + k]) for k, n in enumerate(shape))


# ---------------------------------------------------------------------------------- op catalogue
# Unary float ops: name -> (format, max operand bound or None, result bound fn, guard)
# guard: "pos" (v.abs() + 0.5), "one" (v.abs() + 1.1), "unit" (torch.tanh(v) * 0.5), "prob" (torch.sigmoid(v))
UNARY = {
    "neg": ("-{}", None, lambda b: b, None),
    "abs": ("{}.abs()", None, lambda b: b, None),
    "exp": ("torch.exp({})", 5.0, lambda b: math.exp(b), None),
    "exp2": ("torch.exp2({})", 7.0, lambda b: 2 ** b, None),
    "expm1": ("torch.expm1({})", 5.0, lambda b: math.exp(b), None),
    "log": ("torch.log({})", None, lambda b: max(1.0, math.log(b + 0.5)), "pos"),
    "log2": ("torch.log2({})", None, lambda b: max(1.0, math.log2(b + 0.5)), "pos"),
    "log10": ("torch.log10({})", None, lambda b: max(1.0, math.log10(b + 0.5)), "pos"),
    "log1p": ("torch.log1p({})", None, lambda b: max(1.0, math.log1p(b + 0.5)), "pos"),
    "sqrt": ("torch.sqrt({})", None, lambda b: math.sqrt(b + 0.5), "pos"),
    "rsqrt": ("torch.rsqrt({})", None, lambda b: 1.5, "pos"),
    "reciprocal": ("torch.reciprocal({})", None, lambda b: 2.0, "pos"),
    "sin": ("torch.sin({})", None, lambda b: 1.0, None),
    "cos": ("torch.cos({})", None, lambda b: 1.0, None),
    "tan": ("torch.tan({})", None, lambda b: 1.6, "unit"),
    "tanh": ("torch.tanh({})", None, lambda b: 1.0, None),
    "sinh": ("torch.sinh({})", 5.0, lambda b: math.exp(b), None),
    "cosh": ("torch.cosh({})", 5.0, lambda b: math.exp(b), None),
    "asinh": ("torch.asinh({})", None, lambda b: max(1.0, math.asinh(b)), None),
    "acosh": ("torch.acosh({})", None, lambda b: max(1.0, math.acosh(b + 1.1)), "one"),
    "atanh": ("torch.atanh({})", None, lambda b: 0.6, "unit"),
    "sigmoid": ("torch.sigmoid({})", None, lambda b: 1.0, None),
    "erf": ("torch.erf({})", None, lambda b: 1.0, None),
    "erfc": ("torch.erfc({})", None, lambda b: 2.0, None),
    "relu": ("torch.relu({})", None, lambda b: b, None),
    "relu6": ("F.relu6({})", None, lambda b: 6.0, None),
    "silu": ("F.silu({})", None, lambda b: b + 0.3, None),
    "gelu": ("F.gelu({})", None, lambda b: b + 0.2, None),
    "gelu_tanh": ("F.gelu({}, approximate='tanh')", None, lambda b: b + 0.2, None),
    "mish": ("F.mish({})", None, lambda b: b + 0.4, None),
    "softplus": ("F.softplus({}, beta=2.0, threshold=4.0)", None, lambda b: b + 1.0, None),
    "hardtanh": ("F.hardtanh({}, -0.5, 0.7)", None, lambda b: 0.7, None),
    "leaky_relu": ("F.leaky_relu({}, 0.2)", None, lambda b: b, None),
    "elu": ("F.elu({}, 1.3)", None, lambda b: b + 1.3, None),
    "selu": ("F.selu({})", None, lambda b: 1.06 * b + 1.8, None),
    "celu": ("F.celu({}, 1.5)", None, lambda b: b + 1.5, None),
    "hardsigmoid": ("F.hardsigmoid({})", None, lambda b: 1.0, None),
    "hardswish": ("F.hardswish({})", None, lambda b: b + 1.0, None),
    "square": ("torch.square({})", 14.0, lambda b: b * b, None),
    "pow2": ("{}.pow(2)", 14.0, lambda b: b * b, None),
    "pow3": ("{}.pow(3)", 5.0, lambda b: b ** 3, None),
    "pow_frac": ("{}.pow(1.7)", 20.0, lambda b: (b + 0.5) ** 1.7, "pos"),
    "pow_neg": ("{}.pow(-1.5)", None, lambda b: 3.0, "pos"),
    "pow_half": ("{}.pow(0.5)", None, lambda b: math.sqrt(b + 0.5), "pos"),
    "pow_base": ("torch.pow(2.0, {})", 7.0, lambda b: 2 ** b, None),
    "logit": ("torch.logit({}, eps=1e-3)", None, lambda b: 7.0, "prob"),
    "clamp": ("torch.clamp({}, -0.5, 0.7)", None, lambda b: 0.7, None),
    "clamp_min": ("torch.clamp_min({}, 0.1)", None, lambda b: max(b, 0.1), None),
    "clamp_max": ("torch.clamp_max({}, 0.1)", None, lambda b: b, None),
    "threshold": ("F.threshold({}, 0.3, -2.0)", None, lambda b: max(b, 2.0), None),
    "nan_to_num": ("torch.nan_to_num({})", None, lambda b: b, None),
    "mul_scalar": ("{} * -0.75", None, lambda b: 0.75 * b, None),
    "add_scalar": ("{} + 1.5", None, lambda b: b + 1.5, None),
    "rsub_scalar": ("2.0 - {}", None, lambda b: b + 2.0, None),
    "div_scalar": ("{} / 3.0", None, lambda b: b / 3.0, None),
    "clone": ("{}.clone()", None, lambda b: b, None),
}
EXACT_UNARY = {"neg", "abs", "relu", "clamp", "clamp_min", "clamp_max", "hardtanh", "relu6", "threshold",
               "clone", "nan_to_num"}
GUARDS = {"pos": "({}.abs() + 0.5)", "one": "({}.abs() + 1.1)", "unit": "(torch.tanh({}) * 0.5)",
          "prob": "torch.sigmoid({})"}
# Discontinuous unary ops: exact operands only.
STEP_UNARY = {"floor": "torch.floor({})", "ceil": "torch.ceil({})", "round": "torch.round({})",
              "round_dec": "torch.round({}, decimals=1)", "trunc": "torch.trunc({})", "frac": "torch.frac({})",
              "sign": "torch.sign({})"}
INT_UNARY = {"neg": "-{}", "abs": "{}.abs()", "sign": "torch.sign({})", "square": "torch.square({})",
             "clamp": "torch.clamp({}, -4, 5)", "bitwise_not": "torch.bitwise_not({})", "add_scalar": "{} + 3",
             "mul_scalar": "{} * -2", "pow2": "{}.pow(2)"}
# Binary float ops: name -> (format, result bound fn(ba, bb) or None when not allowed for those bounds, same dtype required)
BINARY = {
    "add": ("{} + {}", lambda a, b: a + b, False),
    "sub": ("{} - {}", lambda a, b: a + b, False),
    "mul": ("{} * {}", lambda a, b: a * b, False),
    "add_alpha": ("torch.add({}, {}, alpha=2)", lambda a, b: a + 2 * b, False),
    "sub_alpha": ("torch.sub({}, {}, alpha=0.5)", lambda a, b: a + 0.5 * b, False),
    "rsub": ("torch.rsub({}, {}, alpha=2)", lambda a, b: b + 2 * a, False),
    "div": ("{} / torch.clamp_min({}.abs(), 0.25)", lambda a, b: 4 * a, False),
    "maximum": ("torch.maximum({}, {})", lambda a, b: max(a, b), False),
    "minimum": ("torch.minimum({}, {})", lambda a, b: max(a, b), False),
    "fmax": ("torch.fmax({}, {})", lambda a, b: max(a, b), False),
    "fmin": ("torch.fmin({}, {})", lambda a, b: max(a, b), False),
    "hypot": ("torch.hypot({}, {})", lambda a, b: a + b, True),
    "xlogy": ("torch.xlogy({}, {}.abs() + 0.5)", lambda a, b: a * max(1.0, math.log(b + 0.5)), False),
    "copysign": ("torch.copysign({}, {})", lambda a, b: a, False),
    "lerp": ("torch.lerp({}, {}, 0.3)", lambda a, b: max(a, b), True),
    "lerp_tensor": ("torch.lerp({0}, {1}, torch.sigmoid({1}))", lambda a, b: max(a, b), True),
    "addcmul": ("torch.addcmul({0}, {0}, {1}, value=0.5)", lambda a, b: a + 0.5 * a * b, True),
    "addcdiv": ("torch.addcdiv({0}, {0}, {1}.abs() + 1, value=2)", lambda a, b: 3 * a, True),
    "pow_tensor": ("torch.pow({}.abs() + 0.5, torch.tanh({}) * 2)", lambda a, b: (a + 0.5) ** 2 + 4, False),
    "atan_like_where": ("torch.where({0} > {1}, {0}, {1})", lambda a, b: max(a, b), False),
}
EXACT_BINARY = {"maximum", "minimum", "fmax", "fmin", "atan_like_where"}
# Discontinuous binary ops: exact operands; divisors bounded away from zero.
STEP_BINARY = {
    "remainder": "torch.remainder({}, torch.clamp_min({}.abs(), 0.25))",
    "fmod": "torch.fmod({}, torch.clamp_min({}.abs(), 0.25))",
    "floor_divide": "torch.floor_divide({}, torch.clamp_min({}.abs(), 0.25))",
    "div_trunc": "torch.div({}, torch.clamp_min({}.abs(), 0.25), rounding_mode='trunc')",
    "div_floor": "torch.div({}, torch.clamp_min({}.abs(), 0.25), rounding_mode='floor')",
    "heaviside": "torch.heaviside({}, {})",
}
INT_BINARY = {"add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}", "maximum": "torch.maximum({}, {})",
              "minimum": "torch.minimum({}, {})", "remainder": "torch.remainder({}, torch.clamp_min({}.abs(), 1))",
              "floor_divide": "torch.floor_divide({}, torch.clamp_min({}.abs(), 1))",
              "fmod": "torch.fmod({}, torch.clamp_min({}.abs(), 1))",
              "div_trunc": "torch.div({}, torch.clamp_min({}.abs(), 1), rounding_mode='trunc')",
              "bitwise_and": "{} & {}", "bitwise_or": "{} | {}", "bitwise_xor": "{} ^ {}",
              "true_div": "{} / torch.clamp_min({}.abs(), 1)"}
COMPARE = {"eq": "{} == {}", "ne": "{} != {}", "lt": "{} < {}", "le": "{} <= {}", "gt": "{} > {}",
           "ge": "{} >= {}"}
BOOL_BINARY = {"logical_and": "torch.logical_and({}, {})", "logical_or": "torch.logical_or({}, {})",
               "logical_xor": "torch.logical_xor({}, {})", "and": "{} & {}", "or": "{} | {}", "xor": "{} ^ {}"}
ROW_FLOAT = ["sum", "mean", "amax", "amin", "prod", "var", "std", "var_mean", "std_mean", "logsumexp",
             "softmax", "log_softmax", "softmax_f32", "layer_norm", "layer_norm_plain", "rms_norm", "norm2",
             "norm1", "norm_inf"]
ROW_INT = ["sum", "amax", "amin", "prod"]
ROW_BOOL = ["any", "all", "sum"]

FUZZ_OPS = (set(UNARY) | set(STEP_UNARY) | set(BINARY) | set(STEP_BINARY) | {f"int_{k}" for k in INT_UNARY}
            | {f"int_{k}" for k in INT_BINARY} | set(COMPARE) | set(BOOL_BINARY) | set(ROW_FLOAT)
            | {"where", "masked_fill", "to", "logical_not", "isnan", "isinf", "isfinite", "signbit", "any", "all",
               "inplace", "float_power"})


def _bounded(dtype, b) -> bool:
    return b <= MAX_BOUND  # far below fp16's 65504, so bf16/fp16 intermediates never overflow


# ------------------------------------------------------------------------------------- one step
def _step(p: _Builder) -> None:
    """Add one line to the program."""
    draw = p.draw
    full = [v for v in p.vals if v.shape == p.base]
    row_ok = p.kind == "rows" and full and sum(o in ROW_ALL for o in p.ops) < 3
    kinds = ["unary"] * 5 + ["binary"] * 5 + ["step"] + ["bool"] * 2 + ["select"] + ["convert"]
    if row_ok:
        kinds += ["row"] * 4
    if any(v.layout_ok for v in p.vals):
        kinds += ["inplace"]
    kind = draw(st.sampled_from(kinds), label="step kind")
    {"unary": _unary, "binary": _binary, "step": _step_op, "bool": _bool, "select": _select,
     "convert": _convert, "row": _row, "inplace": _inplace}[kind](p)


def _unary(p: _Builder) -> None:
    v = p.pick(label="unary operand")
    if v.cat == "bool":
        return _bool(p)
    if v.cat == "int":
        name = p.num(sorted(INT_UNARY), "int unary")
        if name in ("square", "pow2") and v.bound > 1000:
            name = "neg"
        if name == "bitwise_not" and v.dtype == torch.bool:
            name = "neg"
        bound = {"square": v.bound ** 2, "pow2": v.bound ** 2, "add_scalar": v.bound + 3, "mul_scalar": 2 * v.bound,
                 "clamp": 5, "sign": 1, "bitwise_not": v.bound + 1}.get(name, v.bound)
        p.new(INT_UNARY[name].format(v.name), v.shape, v.dtype, bound, True, f"int_{name}")
        return
    ok = [n for n, (fmt, lim, fn, guard) in UNARY.items() if (lim is None or v.bound <= lim)
          and _bounded(v.dtype, fn(v.bound))]
    name = p.num(sorted(ok), "unary op")
    fmt, lim, fn, guard = UNARY[name]
    arg = GUARDS[guard].format(v.name) if guard else v.name
    exact = v.exact and name in EXACT_UNARY
    p.new(fmt.format(arg), v.shape, v.dtype, fn(v.bound), exact, name)


def _partner(p: _Builder, a: Val, pred) -> Val | None:
    """A second operand broadcasting with `a` inside the program's domain (`a` itself always qualifies when
    `pred` accepts it)."""
    return p.pick(lambda v: pred(v) and p.fits(bshape(a.shape, v.shape)), "second operand")


def _binary(p: _Builder) -> None:
    a = p.pick(lambda v: v.cat != "bool", "binary operand")
    if a is None:
        return _bool(p)
    if a.cat == "int":
        b = _partner(p, a, lambda v: v.cat in ("int", "float"))
        if b.cat == "float":  # int with float: promotes to float
            shape = bshape(a.shape, b.shape)
            if a.bound * b.bound < MAX_BOUND:
                p.new(f"{a.name} * {b.name}", shape, torch.result_type(torch.ones(1, dtype=a.dtype), torch.ones(1, dtype=b.dtype)),
                      a.bound * b.bound, False, "mul")
            else:
                p.new(f"{a.name} + {b.name}", shape, torch.promote_types(a.dtype, b.dtype), a.bound + b.bound, False, "add")
            return
        name = p.num(sorted(INT_BINARY), "int binary")
        if name == "mul" and a.bound * b.bound > 1e6:
            name = "add"
        dt = torch.promote_types(a.dtype, b.dtype)
        bound = {"add": a.bound + b.bound, "sub": a.bound + b.bound, "mul": a.bound * b.bound,
                 "bitwise_and": max(a.bound, b.bound) * 2, "bitwise_or": max(a.bound, b.bound) * 2,
                 "bitwise_xor": max(a.bound, b.bound) * 2, "true_div": a.bound}.get(name, max(a.bound, b.bound))
        if name == "true_div":
            dt = torch.float32
        p.new(INT_BINARY[name].format(a.name, b.name), bshape(a.shape, b.shape), dt, bound, name != "true_div",
              f"int_{name}")
        return
    mixed = p.draw(st.integers(0, 3), label="mixed dtypes") == 0
    b = _partner(p, a, lambda v: v.cat in ("float", "int") and (mixed or v.cat == "int" or v.dtype == a.dtype))
    names = []
    for n, (fmt, fn, same) in BINARY.items():
        if same and (b.dtype != a.dtype or b.cat != "float"):
            continue
        if n in ("pow_tensor",) and (a.bound > 10 or b.cat != "float"):
            continue
        if n in ("fmax", "fmin", "copysign", "hypot", "xlogy", "lerp", "lerp_tensor") and b.cat != "float":
            continue
        if _bounded(a.dtype, fn(a.bound, b.bound)):
            names.append(n)
    if not names:
        return _unary(p)
    name = p.num(sorted(names), "binary op")
    fmt, fn, _ = BINARY[name]
    # torch's own rule: a 0-dim operand does not promote a dimensioned one of its category (bf16 + fp32 0-dim is bf16)
    dt = torch.result_type(torch.empty(a.shape, dtype=a.dtype, device="meta"),
                           torch.empty(b.shape, dtype=b.dtype, device="meta")) if b.cat == "float" else a.dtype
    exact = a.exact and b.exact and name in EXACT_BINARY and a.dtype == b.dtype
    p.new(fmt.format(a.name, b.name), bshape(a.shape, b.shape), dt, fn(a.bound, b.bound), exact, name)


def _step_op(p: _Builder) -> None:
    a = p.pick(lambda v: v.exact and v.cat == "float", "exact operand")
    if a is None:
        return _unary(p)
    if p.draw(st.booleans(), label="binary step op"):
        b = _partner(p, a, lambda v: v.exact and v.cat == "float" and v.dtype == a.dtype)
        name = p.num(sorted(STEP_BINARY), "step binary")
        bound = {"floor_divide": 4 * a.bound + 1, "div_trunc": 4 * a.bound + 1, "div_floor": 4 * a.bound + 1,
                 "heaviside": max(1.0, b.bound)}.get(name, max(a.bound, b.bound))
        if bound > MAX_BOUND:
            return _unary(p)
        p.new(STEP_BINARY[name].format(a.name, b.name), bshape(a.shape, b.shape), a.dtype, bound, True, name)
        return
    name = p.num(sorted(STEP_UNARY), "step unary")
    p.new(STEP_UNARY[name].format(a.name), a.shape, a.dtype, a.bound + 1, name != "round_dec", name)


def _bool(p: _Builder) -> None:
    bools = [v for v in p.vals if v.cat == "bool"]
    r = p.draw(st.integers(0, 3), label="bool kind")
    if bools and (r == 0 or all(v.cat == "bool" for v in p.vals)):
        a = p.pick(lambda v: v.cat == "bool", "bool operand")
        b = _partner(p, a, lambda v: v.cat == "bool")
        name = p.num(sorted(BOOL_BINARY), "bool binary")
        p.new(BOOL_BINARY[name].format(a.name, b.name), bshape(a.shape, b.shape), torch.bool, 1, True, name)
        return
    if bools and r == 1:
        a = p.pick(lambda v: v.cat == "bool", "bool operand")
        p.new(f"torch.logical_not({a.name})", a.shape, torch.bool, 1, True, "logical_not")
        return
    a = p.pick(lambda v: v.cat != "bool", "compared operand")
    if a is None:
        return
    if not a.exact and a.cat == "float":  # inexact values: only tests that cannot flip (finite bounded values)
        name = p.num(["isnan", "isinf", "isfinite"], "finite test")
        p.new(f"torch.{name}({a.name})", a.shape, torch.bool, 1, True, name)
        return
    if a.cat == "float" and p.draw(st.integers(0, 5)) == 0:
        p.new(f"torch.signbit({a.name})", a.shape, torch.bool, 1, True, "signbit")
        return
    name = p.num(sorted(COMPARE), "comparison")
    b = _partner(p, a, lambda v: v.exact and v.cat in ("int", "float"))
    rhs = b.name if p.draw(st.booleans(), label="compare with a tensor") else ("0.5" if a.cat == "float" else "2")
    shape = bshape(a.shape, b.shape) if rhs == b.name else a.shape
    p.new(COMPARE[name].format(a.name, rhs), shape, torch.bool, 1, True, name)


def _select(p: _Builder) -> None:
    cond = p.pick(lambda v: v.cat == "bool", "condition")
    if cond is None:
        return _bool(p)
    a = _partner(p, cond, lambda v: v.cat != "bool")
    if a is None:
        return _bool(p)
    if p.draw(st.booleans(), label="masked_fill"):
        if bshape(a.shape, cond.shape) != a.shape:
            return _unary(p)
        fill = "-1.5" if a.cat == "float" else "-3"
        p.new(f"{a.name}.masked_fill({cond.name}, {fill})", a.shape, a.dtype, max(a.bound, 3), a.exact, "masked_fill")
        return
    b = p.pick(lambda v: v.cat == a.cat and p.fits(bshape(bshape(a.shape, cond.shape), v.shape)), "other branch")
    if b is None:
        return _unary(p)
    shape = bshape(bshape(a.shape, cond.shape), b.shape)
    dt = torch.promote_types(a.dtype, b.dtype)
    p.new(f"torch.where({cond.name}, {a.name}, {b.name})", shape, dt, max(a.bound, b.bound),
          a.exact and b.exact and a.dtype == b.dtype, "where")


def _convert(p: _Builder) -> None:
    a = p.pick(label="converted operand")
    if a.cat == "bool":
        dt = p.draw(st.sampled_from([torch.float32, p.dtype if p.dtype.is_floating_point else torch.float32, torch.int64]))
        p.new(f"{a.name}.to({dt})", a.shape, dt, 1, True, "to")
    elif a.cat == "int":
        floats = [torch.float32, torch.bfloat16, torch.float16] if a.bound <= MAX_BOUND else []
        dt = p.draw(st.sampled_from([d for d in floats + [torch.int32, torch.int64] if d != a.dtype]),
                    label="conversion dtype")  # .to(its own dtype) returns the input itself: no op at all
        p.new(f"{a.name}.to({dt})", a.shape, dt, a.bound, a.bound <= 256, "to")
    else:
        choices = [dt for dt in FLOATS if dt != a.dtype]
        if a.exact:
            choices += [torch.int64, torch.int32, torch.bool]
        dt = p.draw(st.sampled_from(choices), label="conversion dtype")
        # An exact value converts exactly in both (one rounding of the same number, or a truncation).
        p.new(f"{a.name}.to({dt})", a.shape, dt, a.bound + 1 if not dt.is_floating_point else a.bound, a.exact, "to")
    if p.draw(st.integers(0, 9)) == 0 and a.cat == "float" and a.bound < 20:  # float_power computes in fp64
        p.new(f"torch.float_power({a.name}.abs() + 0.5, 1.5)", a.shape, torch.float64, (a.bound + 0.5) ** 1.5, False,
              "float_power")


ROW_ALL = set(ROW_FLOAT) | set(ROW_BOOL) | set(ROW_INT)


def _row(p: _Builder) -> None:
    x = p.pick(lambda v: v.shape == p.base, "row operand")
    keep = p.draw(st.booleans(), label="keepdim")
    n = p.base[-1]
    lead = p.base[:-1] + ((1,) if keep else ())
    k = str(keep)
    if x.cat == "bool":
        name = p.num(ROW_BOOL, "bool row op")
        if name == "sum":
            p.new(f"{x.name}.sum(-1, keepdim={k})", lead, torch.int64, n, True, "sum", row=True)
        else:
            p.new(f"{x.name}.{name}(-1, keepdim={k})", lead, torch.bool, 1, True, name, row=True)
        return
    if x.cat == "int":
        name = p.num(ROW_INT, "int row op")
        if name == "prod":
            p.new(f"torch.clamp({x.name}, -2, 2).prod(-1, keepdim={k})", lead, torch.int64, 2 ** n, True, "prod", row=True)
        else:
            dt = torch.int64 if name == "sum" else x.dtype
            p.new(f"{x.name}.{name}(-1, keepdim={k})", lead, dt, x.bound * (n if name == "sum" else 1), True, name, row=True)
        return
    name = p.num(ROW_FLOAT, "row op")
    b, dt = x.bound, x.dtype
    if name == "sum":
        p.new(f"{x.name}.sum(-1, keepdim={k})", lead, dt, b * n, False, name, row=True)
    elif name == "mean":
        p.new(f"{x.name}.mean(-1, keepdim={k})", lead, dt, b, False, name, row=True)
    elif name in ("amax", "amin"):
        p.new(f"{x.name}.{name}(-1, keepdim={k})", lead, dt, b, x.exact, name, row=True)
    elif name == "prod":
        p.new(f"(torch.tanh({x.name}) * 0.1 + 1).prod(-1, keepdim={k})", lead, dt, 1.1 ** n, False, name, row=True)
    elif name in ("var", "std"):
        c = p.draw(st.sampled_from([0, 1]), label="correction")
        bound = b * b * n if name == "var" else b * math.sqrt(n)
        if bound > MAX_BOUND:
            return _unary(p)
        p.new(f"torch.{name}({x.name}, -1, correction={c}, keepdim={k})", lead, dt, bound, False, name, row=True)
    elif name in ("var_mean", "std_mean"):
        if b * b * n > MAX_BOUND:
            return _unary(p)
        a, m = f"v{p.n}", f"v{p.n + 1}"
        p.lines.append(f"{a}, {m} = torch.{name}({x.name}, -1, keepdim={k})")
        p.used.add(x.name)
        p.n += 2
        p.vals += [Val(a, lead, dt, b * b * n, False, True), Val(m, lead, dt, b, False, True)]
        p.ops.append(name)
    elif name == "logsumexp":
        p.new(f"torch.logsumexp({x.name}, -1, keepdim={k})", p.base[:-1] + ((1,) if keep else ()), dt,
              b + math.log(n) + 1, False, name, row=True)
    elif name in ("softmax", "log_softmax"):
        p.new(f"torch.{name}({x.name}, -1)", p.base, dt, 1.0 if name == "softmax" else 2 * b + math.log(n) + 1,
              False, name, row=True)
    elif name == "softmax_f32":
        p.new(f"torch.softmax({x.name}, -1, dtype=torch.float32)", p.base, torch.float32, 1.0, False, name, row=True)
    elif name in ("layer_norm", "layer_norm_plain", "rms_norm"):
        w = p.pick(lambda v: v.shape == (n,) and v.dtype == dt and v.cat == "float" and v.bound < 10, "norm weight")
        bias = p.pick(lambda v: v.shape == (n,) and v.dtype == dt and v.cat == "float" and v.bound < 10, "norm bias")
        if name == "rms_norm":
            wt = w.name if w is not None else "None"
            p.new(f"F.rms_norm({x.name}, ({n},), {wt}, eps=1e-5)", p.base, dt, math.sqrt(n) * (w.bound if w else 1),
                  False, name, row=True)
        elif name == "layer_norm" and w is not None and bias is not None:
            p.new(f"F.layer_norm({x.name}, ({n},), {w.name}, {bias.name}, 1e-5)", p.base, dt,
                  math.sqrt(n) * w.bound + bias.bound, False, name, row=True)
        else:
            p.new(f"F.layer_norm({x.name}, ({n},), eps=1e-5)", p.base, dt, math.sqrt(n) + 1, False, "layer_norm_plain",
                  row=True)
    elif name.startswith("norm"):
        ord_ = {"norm2": "2", "norm1": "1", "norm_inf": "float('inf')"}[name]
        p.new(f"torch.linalg.vector_norm({x.name}, {ord_}, dim=-1, keepdim={k})", lead, dt, b * n, False, name,
              row=True)


def _inplace(p: _Builder) -> None:
    """An in-place op on an input: later reads see the new values, and the caller's tensor changes."""
    a = p.pick(lambda v: getattr(v, "layout_ok", False), "mutated input")
    if a.cat == "bool":
        return _bool(p)
    b = _partner(p, a, lambda v: v.cat == a.cat and v.dtype == a.dtype and bshape(a.shape, v.shape) == a.shape)
    if a.cat == "float":
        ops = [("mul_", f"{a.name}.mul_({b.name})", a.bound * b.bound), ("add_", f"{a.name}.add_({b.name})", a.bound + b.bound),
               ("relu_", f"{a.name}.relu_()", a.bound), ("sigmoid_", f"{a.name}.sigmoid_()", 1.0),
               ("clamp_", f"{a.name}.clamp_(-1.0, 1.0)", 1.0)]
    else:
        ops = [("add_", f"{a.name}.add_({b.name})", a.bound + b.bound), ("neg_", f"{a.name}.neg_()", a.bound)]
    ops = [o for o in ops if o[2] <= MAX_BOUND]
    name, expr, bound = p.draw(st.sampled_from(ops), label="in-place op")
    p.lines.append(expr)
    p.used.update(re.findall(r"\b(?:v|in)\d+\b", expr))
    p.ops.append("inplace")
    # the input's name now stands for its new value
    a.bound, a.exact = bound, a.exact and (name in ("relu_", "clamp_", "neg_") or a.cat == "int")
    a.layout_ok = False  # once is enough per input (keeps the aliasing simple to read)


# ---------------------------------------------------------------------------------- strategies
def _input_shape(draw, base: tuple, rank_drop_ok=True) -> tuple:
    """A shape that broadcasts to `base`: some leading dims dropped, some dims kept at 1."""
    drop = draw(st.integers(0, len(base) - 1)) if rank_drop_ok and len(base) > 1 and draw(st.integers(0, 3)) == 0 else 0
    shape = list(base[drop:])
    for d in range(len(shape)):
        if shape[d] > 1 and draw(st.integers(0, 5)) == 0:
            shape[d] = 1
    return tuple(shape)


def _layout(draw, shape: tuple, dtype) -> InputSpec:
    opts = ["contig"] * 4
    if len(shape) >= 2 and shape[-1] > 1 and shape[-2] > 1:
        opts += ["transposed", "inner_t"]
    if shape and shape[-1] > 1:
        opts += ["sliced", "strided", "inner_slice"]
    if shape and shape[0] > 1:
        opts += ["offset"]
    big = [d for d, n in enumerate(shape) if n > 1]
    if big:
        opts += ["expanded", "inner_expand"]
    lay = draw(st.sampled_from(opts), label="layout")
    spec = InputSpec("", shape, dtype, lay)
    if lay in ("expanded", "inner_expand"):
        spec.expand_dims = tuple(sorted(draw(st.sets(st.sampled_from(big), min_size=1, max_size=len(big)))))
        if len(spec.expand_dims) == len(shape) and len(shape) and lay == "inner_expand":
            pass
    if lay == "sliced":
        spec.pad = draw(st.integers(1, 3))
    if lay == "strided":
        spec.pad = draw(st.sampled_from([2, 3]))
    if lay == "inner_slice":
        spec.pad = 2
    return spec


@st.composite
def programs(draw, kind: str | None = None, require: str | None = None, min_ops: int = 1, max_ops: int = 7,
             sinks: bool = False):
    """A random FuzzProgram. kind: "pointwise" | "rows" | None (either); require: a fuzz op that must appear
    with an input as its operand and its result returned (see `planted_programs`); sinks: return every
    value nothing reads (no dead code, as in a model: a compiler would drop dead ops before patching)."""
    kind = kind or draw(st.sampled_from(["pointwise", "pointwise", "rows"]), label="program kind")
    rank = draw(st.integers(1, 3), label="rank")
    while True:
        lead = [draw(st.sampled_from(DIMS), label="dim") for _ in range(rank - 1)]
        widths = ROW_WIDTHS if kind == "rows" else DIMS
        if require == "sum":  # a sum over one element is the element: any wrong reduction would pass
            widths = [w for w in widths if w > 1]
        last = draw(st.sampled_from(widths), label="last dim")
        base = tuple(lead + [last])
        if math.prod(base) <= MAX_NUMEL:
            break
        rank = max(1, rank - 1)
    cat = draw(st.sampled_from(["float"] * 8 + ["int", "bool"] + (["fp64"] if kind == "pointwise" else [])),
               label="dtype kind")
    if require:
        cat = "float"
    dtype = {"float": None, "int": None, "bool": torch.bool, "fp64": torch.float64}[cat]
    if cat == "float":
        dtype = draw(st.sampled_from(FLOATS), label="dtype")
    elif cat == "int":
        dtype = draw(st.sampled_from(INTS), label="dtype")
    p = _Builder(draw, kind, base, dtype)
    n_in = draw(st.integers(1, 3), label="inputs")
    specs = []
    for k in range(n_in):
        shape = base if k == 0 else _input_shape(draw, base)
        dt = dtype
        if k > 0 and dtype.is_floating_point and draw(st.integers(0, 5)) == 0:
            dt = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64]), label="mixed dtype")
        if k > 0 and kind == "rows" and draw(st.integers(0, 3)) == 0 and dtype.is_floating_point:
            shape = (base[-1],)  # a weight-like row vector (norm weights and biases)
            dt = dtype
        spec = _layout(draw, shape, dt)
        spec.name = f"in{k}"
        specs.append(spec)
        v = Val(spec.name, shape, dt, 3.0 if dt.is_floating_point else 9.0, True)
        v.bound = INPUT_BOUND if dt.is_floating_point else 9.0
        v.layout_ok = spec.layout in ("contig", "transposed", "sliced", "strided", "offset") and shape == base \
            and draw(st.integers(0, 5)) == 0 and not require
        p.vals.append(v)
    if draw(st.integers(0, 9)) == 0 and dtype.is_floating_point and not require:  # a 0-dim tensor input
        spec = InputSpec(f"in{n_in}", (), torch.float32, "contig")
        specs.append(spec)
        p.vals.append(Val(spec.name, (), torch.float32, INPUT_BOUND, True))
    if require:
        _require(p, require, specs)
    n_ops = draw(st.integers(min_ops, max_ops), label="ops")
    if kind == "rows":  # at least one row op over the full shape
        while not any(o in ROW_ALL for o in p.ops):
            _row(p)
    while len(p.ops) < n_ops or not p.vals[len(specs):]:
        _step(p)
    produced = [v for v in p.vals if not v.name.startswith("in")]
    if kind == "rows":
        produced = [v for v in produced if v.shape == base or v.shape in (base[:-1], base[:-1] + (1,))]
    last = produced[-1]
    extra = draw(st.lists(st.sampled_from(produced), max_size=2, unique_by=lambda v: v.name), label="extra outputs")
    outs = list(dict.fromkeys([last.name] + [v.name for v in extra] + ([p.required] if require else [])))
    if sinks:
        outs = list(dict.fromkeys(outs + [v.name for v in produced if v.name not in p.used]))
    looped = kind == "rows" and draw(st.integers(0, 3)) == 0
    seed = draw(st.integers(0, 2 ** 16), label="seed")
    return FuzzProgram(specs, p.lines, outs, kind, seed, p.ops, looped, require)


# Planted bugs: fuzz ops built around one lowering entry, and the aten op that entry is.
PLANTABLE = {"exp": "aten::exp", "sub": "aten::sub", "mul": "aten::mul", "sigmoid": "aten::sigmoid",
             "sum": "aten::sum", "tanh": "aten::tanh", "rsqrt": "aten::rsqrt"}


def _require(p: _Builder, op: str, specs) -> None:
    """Start the program with `op` applied to float inputs, and return its result: nothing downstream
    can hide a wrong value (a comparison, a multiplication by zero), so validation must see it."""
    floats = [v for v in p.vals if v.cat == "float"]
    a = floats[0]
    if op == "sum":
        p.kind = "rows"
        v = p.new(f"{a.name}.sum(-1, keepdim=True)", a.shape[:-1] + (1,), a.dtype, a.bound * a.shape[-1], False, "sum",
                  row=True)
    elif op in ("sub", "mul"):
        b = p.pick(lambda v: v.cat == "float" and v.dtype == a.dtype and p.fits(bshape(a.shape, v.shape)), "operand")
        fmt = "{} - {}" if op == "sub" else "{} * {}"
        v = p.new(fmt.format(a.name, b.name), bshape(a.shape, b.shape), a.dtype, a.bound * b.bound, False, op)
    else:
        fmt = {"exp": "torch.exp({})", "sigmoid": "torch.sigmoid({})", "tanh": "torch.tanh({})",
               "rsqrt": "torch.rsqrt({}.abs() + 0.5)"}[op]
        v = p.new(fmt.format(a.name), a.shape, a.dtype, UNARY[op][2](a.bound), False, op)
    p.required = v.name


def planted_programs(op: str):
    kind = "rows" if op == "sum" else None
    return programs(kind=kind, require=op, min_ops=1, max_ops=5)

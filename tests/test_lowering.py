"""The lowering table, op by op, against PyTorch: each op is recorded as a one-op program, generated,
run (Triton's interpreter without a GPU) and compared both by `validate` (fp64/native references,
odd shapes, NaN-poisoned outputs) and directly with the PyTorch function on the same inputs."""
import math

import os

import pytest
import torch

from advisor.codegen import generate, load_module
from advisor.codegen.record import record_program
from advisor.ops.lowering import TABLE
from advisor.validate import validate

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter: log(0) etc.
F = torch.nn.functional
aten = torch.ops.aten
SHAPE = (5, 37)  # 185 elements: not a multiple of any block
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2), torch.float16: (3e-3, 2e-3),
       torch.float64: (1e-9, 1e-9)}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.getbasetemp() / "kernel-cache"))

DEV = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _device():
    """Tensors made in a test live where kernels run: the GPU, or the CPU under the interpreter."""
    torch.set_default_device(DEV)
    yield
    torch.set_default_device(None)



def _inputs(n, dtype, positive=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    cpu = {"generator": g, "device": "cpu"}
    out = []
    for k in range(n):
        if dtype == torch.bool:
            x = torch.rand(SHAPE, **cpu) < 0.5
        elif not dtype.is_floating_point:
            x = torch.randint(1, 10, SHAPE, **cpu) * (1 if positive else torch.where(torch.rand(SHAPE, **cpu) < 0.5, -1, 1))
        else:
            x = torch.randn(SHAPE, dtype=torch.float64, **cpu)
            x = (x.abs() + 0.1 if positive else x).to(dtype)
        out.append(x.to(DEV))
    return out


def check(fn, inputs, rtol_atol=None, float_quotient=False):
    """Generate a kernel for fn's program, validate it, and compare it with fn directly. float_quotient:
    compare with fn computed in float32 and rounded once instead (the CPU's bf16/fp16 `div` with
    rounding_mode='trunc' rounds the quotient before truncating it, CUDA's does not: the kernel follows
    CUDA, and an operand scaled by 4 is exact either way)."""
    prog = record_program(fn, *inputs)
    gen = generate(prog)
    mod = load_module(gen.path)
    v = validate(gen, mod)
    assert v.validated, f"{v.reason}\n{gen.code}"
    got = mod.run(*[t.clone() for t in inputs])
    eager = _tuple(fn(*[t.clone() for t in inputs]))
    # The kernel computes bf16/fp16 programs in fp32 registers and rounds each op's result where eager
    # stores it (codegen.build.Builder.finish): it computes what eager computes.
    if float_quotient:
        eager = _tuple(fn(*[t.float() if t.dtype in (torch.bfloat16, torch.float16) else t.clone() for t in inputs]))
        eager = tuple(w.to(g.dtype) for w, g in zip(eager, got))
    for g, e in zip(got, eager):
        assert g.dtype == e.dtype and g.shape == e.shape
        atol, rtol = rtol_atol or TOL.get(e.dtype, (0, 0))
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol, equal_nan=True)
    return gen


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


UNARY = {  # name: (function, strictly positive inputs)
    "abs": (torch.abs, False), "neg": (torch.neg, False), "exp": (torch.exp, False), "exp2": (torch.exp2, False),
    "expm1": (torch.expm1, False), "log": (torch.log, True), "log2": (torch.log2, True),
    "log10": (torch.log10, True), "log1p": (torch.log1p, True), "sqrt": (torch.sqrt, True),
    "rsqrt": (torch.rsqrt, True), "reciprocal": (torch.reciprocal, True), "sin": (torch.sin, False),
    "cos": (torch.cos, False), "tan": (torch.tan, False), "tanh": (torch.tanh, False), "sinh": (torch.sinh, False),
    "cosh": (torch.cosh, False), "asinh": (torch.asinh, False), "sigmoid": (torch.sigmoid, False),
    "erf": (torch.erf, False), "erfc": (torch.erfc, False), "floor": (lambda x: torch.floor(x * 3), False),
    "ceil": (lambda x: torch.ceil(x * 3), False), "round": (lambda x: torch.round(x * 4), False),
    "round_decimals": (lambda x: torch.round(x, decimals=1), False), "trunc": (lambda x: torch.trunc(x * 3), False),
    "frac": (lambda x: torch.frac(x * 3), False), "sign": (torch.sign, False), "square": (torch.square, False),
    "relu": (torch.relu, False), "relu6": (lambda x: F.relu6(x * 4), False), "silu": (F.silu, False),
    "mish": (F.mish, False), "hardswish": (lambda x: F.hardswish(x * 3), False),
    "hardsigmoid": (lambda x: F.hardsigmoid(x * 3), False), "selu": (F.selu, False),
    "celu": (lambda x: F.celu(x, 1.5), False), "elu": (lambda x: F.elu(x, 1.3), False),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), False), "gelu": (F.gelu, False),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), False),
    "softplus": (lambda x: F.softplus(x * 3, beta=2.0, threshold=4.0), False),
    "hardtanh": (lambda x: F.hardtanh(x, -0.5, 0.7), False), "threshold": (lambda x: F.threshold(x, 0.3, -2.0), False),
    "logit": (lambda x: torch.logit(torch.sigmoid(x), eps=1e-3), False), "atanh": (lambda x: torch.atanh(x * 0.5), False),
    "acosh": (lambda x: torch.acosh(x + 1.0), True),
    "pow2": (lambda x: x.pow(2), False), "pow3": (lambda x: x.pow(3), False), "pow_half": (lambda x: x.pow(0.5), True),
    "pow_frac": (lambda x: x.pow(1.7), True), "pow_neg1": (lambda x: x.pow(-1), True),
    "pow_scalar_base": (lambda x: torch.pow(10000.0, x * 0.5), False), "exp2_base": (lambda x: torch.pow(2.0, x), False),
    "clamp": (lambda x: torch.clamp(x, -0.5, 0.7), False), "clamp_min": (lambda x: torch.clamp_min(x, 0.1), False),
    "clamp_max": (lambda x: torch.clamp_max(x, 0.1), False), "nan_to_num": (lambda x: torch.nan_to_num(x.log()), False),
    "isnan": (lambda x: torch.isnan(x.log()), False), "isinf": (lambda x: torch.isinf(1.0 / (x * 0)), False),
    "isfinite": (lambda x: torch.isfinite(x.log()), False), "signbit": (torch.signbit, False),
    "logical_not": (lambda x: torch.logical_not(x > 0), False), "positive": (lambda x: torch.positive(x) * 2, False),
    "clone": (lambda x: torch.clone(x) * 2, False), "dropout_eval": (lambda x: aten.dropout(x, 0.1, False) * 2, False),
    "native_dropout_eval": (lambda x: aten.native_dropout(x, 0.1, False), False),
    "fill": (lambda x: aten.fill.Scalar(x, 2.5), False), "zero_": (lambda x: (x * 2).zero_(), False),
}


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name, dtype):
    fn, positive = UNARY[name]
    if name in ("exp2_base", "pow_scalar_base") and dtype == torch.float16:
        pytest.skip("overflows fp16 by design of the op")
    check(fn, _inputs(1, dtype, positive))


BINARY = {
    "add": lambda x, y: x + y, "add_alpha": lambda x, y: torch.add(x, y, alpha=2), "sub": lambda x, y: x - y,
    "sub_alpha": lambda x, y: torch.sub(x, y, alpha=0.5), "rsub": lambda x, y: torch.rsub(x, y, alpha=2),
    "mul": lambda x, y: x * y, "div": lambda x, y: x / y, "div_trunc": lambda x, y: torch.div(x * 4, y, rounding_mode="trunc"),
    "div_floor": lambda x, y: torch.div(x * 4, y, rounding_mode="floor"), "floor_divide": lambda x, y: torch.floor_divide(x * 4, y),
    "remainder": lambda x, y: torch.remainder(x * 4, y), "fmod": lambda x, y: torch.fmod(x * 4, y),
    "maximum": torch.maximum, "minimum": torch.minimum, "fmax": torch.fmax, "fmin": torch.fmin,
    "eq": lambda x, y: x == y.round(), "ne": lambda x, y: x != y, "lt": lambda x, y: x < y, "le": lambda x, y: x <= y,
    "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y, "logical_and": lambda x, y: torch.logical_and(x > 0, y > 0),
    "logical_or": lambda x, y: torch.logical_or(x > 0, y), "logical_xor": lambda x, y: torch.logical_xor(x, y > 0),
    "copysign": torch.copysign, "hypot": torch.hypot, "xlogy": lambda x, y: torch.xlogy(x, y.abs()),
    "pow_tensor": lambda x, y: torch.pow(x.abs() + 0.5, y), "heaviside": lambda x, y: torch.heaviside(x.round(), y),
    "where": lambda x, y: torch.where(x > 0, x, y), "where_scalar": lambda x, y: torch.where(x > y, x, 0.5),
    "masked_fill": lambda x, y: x.masked_fill(y > 0.5, -1.5), "clamp_tensor": lambda x, y: torch.clamp(x, min=y),
    "lerp": lambda x, y: torch.lerp(x, y, 0.3), "lerp_tensor": lambda x, y: torch.lerp(x, y, torch.sigmoid(x)),
    "addcmul": lambda x, y: torch.addcmul(x, x, y, value=0.5), "addcdiv": lambda x, y: torch.addcdiv(x, x, y.abs() + 1, value=2),
}
INT_OK = {"add", "add_alpha", "sub", "mul", "div", "div_trunc", "div_floor", "floor_divide", "remainder", "fmod",
          "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "where"}


@pytest.mark.parametrize("dtype", FLOATS + [torch.int64], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary(name, dtype):
    if dtype == torch.int64 and name not in INT_OK:
        pytest.skip("float-only op")
    check(BINARY[name], _inputs(2, dtype, seed=1), float_quotient=name == "div_trunc")


@pytest.mark.parametrize("name,fn", [
    ("add.Scalar", lambda x: aten.add.Scalar(x, 2.5)), ("mul.Scalar", lambda x: aten.mul.Scalar(x, -1.5)),
    ("div.Scalar_mode", lambda x: aten.div.Scalar_mode(x * 4, 1.5, rounding_mode="floor")),
    ("remainder.Scalar", lambda x: aten.remainder.Scalar(x * 4, -1.5)), ("eq.Scalar", lambda x: aten.eq.Scalar(x.round(), 1)),
    ("bitwise", lambda x: ((x > 0) & (x < 1)) | ~(x > -0.5) ^ (x > 0.3)),
    ("int_bitwise", lambda x: (x.to(torch.int64) & 3) | (x.to(torch.int64) ^ -2)),
])
def test_scalar_overloads(name, fn):
    check(fn, _inputs(1, torch.float32, seed=2))


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                     (torch.float32, torch.float16), (torch.float32, torch.int64),
                                     (torch.int64, torch.float32), (torch.float32, torch.bool),
                                     (torch.bool, torch.float32), (torch.float64, torch.float32)])
def test_conversions(src, dst):
    gen = check(lambda x: (x * 3).to(dst) if src.is_floating_point else x.to(dst), _inputs(1, src, seed=3))
    if dst in (torch.bfloat16, torch.float16):  # a narrowing conversion rounds, as eager does
        assert "round to" in gen.code


def test_copy_into_input_in_place():
    """copy_ writes src (cast to dst's dtype) into the destination input's own memory."""
    def fn(dst, src):
        dst.copy_(src * 2)
        return dst * 1
    dst, src = torch.zeros(SHAPE, dtype=torch.bfloat16), torch.randn(SHAPE)
    gen = check(fn, [dst, src])
    mod = load_module(gen.path)
    d = torch.zeros(SHAPE, dtype=torch.bfloat16)
    mod.run(d, src)
    torch.testing.assert_close(d, (src * 2).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: str(d)[6:])
def test_full_is_a_constant(dtype):
    """aten::full: a literal at every index, its shape from its arguments; next to a tensor in a cat (the
    zero padding of a slice's gradient) and as an operand of a pointwise op."""
    x = _inputs(1, dtype, seed=5)[0]
    gen = check(lambda x: torch.cat([torch.full((5, 3), 0.0, dtype=x.dtype), x * 2, torch.full((5, 2), -1.5,
                                                                                            dtype=x.dtype)], -1), [x])
    assert "aten::full" in gen.code
    check(lambda x: x + torch.full(SHAPE, 2.5, dtype=x.dtype), [x])


def test_lowering_count():
    """The table covers at least 60 pointwise aten ops (in-place twins not counted)."""
    pointwise = [k for k, v in TABLE.items() if v.kind == "pointwise"]
    assert len(pointwise) >= 60, len(pointwise)
    for op in ("aten::add", "aten::gelu", "aten::where", "aten::masked_fill", "aten::_to_copy", "aten::copy",
               "aten::softplus", "aten::hardswish", "aten::elu", "aten::leaky_relu", "aten::dropout"):
        assert op in TABLE, op


def test_fp32_constants_survive():
    """Literals print at full precision (a silent truncation would only show as a small error)."""
    gen = check(lambda x: x * math.pi + 1e-7, _inputs(1, torch.float32, seed=4))
    assert "3.141592653589793" in gen.code and "1e-07" in gen.code


@pytest.mark.parametrize("dtype", FLOATS + [torch.float64], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name,fn", [
    ("atan", lambda x, y: torch.atan(x * 3)), ("asin", lambda x, y: torch.asin(torch.tanh(x))),
    ("acos", lambda x, y: torch.acos(torch.tanh(x))), ("atan2", torch.atan2),
    ("atan2_axes", lambda x, y: torch.atan2(x * (y > 0), y * (x > 0))),  # zeros on either axis
])
def test_inverse_trigonometry(name, fn, dtype):
    """atan, asin, acos and atan2 from core tl math (libdevice does not run in the interpreter), exact to fp64."""
    check(fn, _inputs(2, dtype, seed=5))


@pytest.mark.parametrize("name,fn,same_as", [
    ("fix", torch.fix, "trunc"), ("clip", lambda x: torch.clip(x, -0.5, 0.7), "clamp"),
    ("absolute", torch.absolute, "abs"), ("negative", torch.negative, "neg"),
])
def test_aliases_are_reached(name, fn, same_as):
    """An alias is its own aten op in the trace: the registry knows it and it lowers like its twin."""
    from advisor.ops.registry import OpClass, lookup

    assert lookup(f"aten::{name}").cls == OpClass.POINTWISE
    assert TABLE[f"aten::{name}"].emit is TABLE[f"aten::{same_as}"].emit
    check(lambda x: fn(x * 3), _inputs(1, torch.float32, seed=6))

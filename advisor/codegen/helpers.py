"""`@triton.jit` helpers the lowering table calls, copied into each generated module that needs them.

They are built from core `tl` math only: libdevice is not available to Triton's interpreter, and the
generated kernels must run there (CI) exactly as on the GPU.
"""
from __future__ import annotations

from advisor.interpreter import patch_interpreter


def _horner(coeffs: list, var: str) -> str:
    """The polynomial c0 + var * (c1 + var * (c2 + ...)) as source text."""
    expr = repr(coeffs[-1])
    for c in reversed(coeffs[:-1]):
        expr = f"{c!r} + {var} * ({expr})"
    return expr


HELPERS = {
    "_tanh": '''
@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1) cancels near 0, so small |x| uses the odd series up to x**9.
    x2 = x * x
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333
                  + x2 * (-0.05396825396825397 + x2 * 0.021869488536155203))))
    return tl.where(tl.abs(x) < 0.125, series, 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
''',
    "_expm1": '''
@triton.jit
def _expm1(x):
    # exp(x) - 1 cancels near 0; Kahan's (u - 1) * x / log(u), u = exp(x), keeps full precision there.
    u = tl.exp(x)
    um1 = u - 1.0
    near0 = tl.where(um1 == 0.0, x, um1 * x / tl.log(u))
    return tl.where(tl.abs(x) < 0.5, near0, um1)
''',
    "_log1p": '''
@triton.jit
def _log1p(x):
    # log(1 + x) loses x when it is tiny; Kahan's log(u) * x / (u - 1), u = 1 + x, does not.
    u = 1.0 + x
    d = u - 1.0
    near0 = tl.where(d == 0.0, x, tl.log(u) * x / d)
    return tl.where(tl.abs(x) < 0.5, near0, tl.log(u))
''',
    "_asinh": '''
@triton.jit
def _asinh(x):
    a = tl.abs(x)
    y = _log1p(a + a * a / (1.0 + tl.sqrt(1.0 + a * a)))
    return tl.where(x < 0, -y, y)
''',
    "_softplus": '''
@triton.jit
def _softplus(x, beta, threshold):
    # log(1 + exp(beta x)) / beta, and x itself past the threshold (where exp would overflow)
    return tl.where(x * beta > threshold, x, _log1p(tl.exp(x * beta)) / beta)
''',
    "_trunc": '''
@triton.jit
def _trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))
''',
    "_round_half_even": '''
@triton.jit
def _round_half_even(x):
    # torch.round rounds ties to even; x - floor(x) is exact, so ties are detected exactly.
    r = tl.floor(x)
    diff = x - r
    odd = r - 2.0 * tl.floor(r * 0.5)
    res = tl.where((diff > 0.5) | ((diff == 0.5) & (odd == 1.0)), r + 1.0, r)
    # floor(-0.3) + 1 is +0.0, but torch.round(-0.3) is -0.0: a zero keeps x's sign (signbit sees it;
    # found by tests/test_fuzz.py)
    return tl.where(res == 0.0, x * 0.0, res)
''',
    "_pow": '''
@triton.jit
def _pow(x, y):
    # |x| ** y through exp2/log2; a negative base needs an integral y, whose parity gives the sign.
    mag = tl.exp2(y * tl.log2(tl.abs(x)))
    y_int = y == tl.floor(y)
    y_odd = y_int & (y - 2.0 * tl.floor(y * 0.5) == 1.0)
    signed = tl.where(y_int, tl.where(y_odd, -mag, mag), float("nan"))
    res = tl.where(x < 0, signed, mag)
    # Nested selects, not `|`: Triton's interpreter cannot `|` a scalar's comparison with a block's.
    return tl.where(y == 0.0, 1.0, tl.where(x == 1.0, 1.0, res))
''',
    "_remainder": '''
@triton.jit
def _remainder(a, b):
    # Python-style modulo (sign of b); Triton's % is C's fmod (sign of a).
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
''',
    "_div_floor": '''
@triton.jit
def _div_floor(a, b):
    # ATen's floor division for floats: exact where floor(a / b) rounds the wrong way.
    mod = a % b
    div = (a - mod) / b
    div = tl.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1.0, div)
    q = tl.floor(div)
    q = tl.where(div - q > 0.5, q + 1.0, q)
    return tl.where(b == 0, a / b, q)
''',
    "_div_floor_int": '''
@triton.jit
def _div_floor_int(a, b):
    q = a // b  # truncates toward zero; step down when the signs differ and it was inexact
    return tl.where((a % b != 0) & ((a < 0) != (b < 0)), q - 1, q)
''',
    "_max_nan": '''
@triton.jit
def _max_nan(a, b):
    # torch's max/amax return NaN for a row holding one; tl.max would skip it
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
''',
    "_min_nan": '''
@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
''',
    "_round_bf16": '''
@triton.jit
def _round_bf16(x):
    # fp32 -> bf16 -> fp32 with ties to even, as torch rounds. x.to(tl.bfloat16) does that on the GPU,
    # but Triton's interpreter truncates, so the rounding is spelled out in bits (NaN stays NaN).
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return tl.where(x != x, x, ((b >> 16) << 16).to(tl.float32, bitcast=True))
''',
    "_mul_combine": '''
@triton.jit
def _mul_combine(a, b):
    return a * b
''',
    "_atan": f'''
@triton.jit
def _atan(x):
    # |x| > 1 folds to pi/2 - atan(1/|x|); past tan(pi/12), atan(a) = pi/6 + atan((sqrt3 a - 1) / (sqrt3 + a));
    # then |t| <= 0.268 and the odd Taylor series to t**29 is exact to fp64 (the next term is below 1e-18).
    a = tl.abs(x)
    big = a > 1.0
    a = tl.where(big, 1.0 / a, a)
    shift = a > 0.2679491924311227
    t = tl.where(shift, (1.7320508075688772 * a - 1.0) / (1.7320508075688772 + a), a)
    z = t * t
    r = t * ({_horner([(-1) ** k / (2 * k + 1) for k in range(15)], "z")})
    r = tl.where(shift, 0.5235987755982988 + r, r)
    r = tl.where(big, 1.5707963267948966 - r, r)
    return tl.where(x < 0, -r, r)
''',
    "_atan2": '''
@triton.jit
def _atan2(y, x):
    # atan(y / x) moved to x's half-plane, with torch's signed zeros: on the x axis (y = +-0) the result
    # is y itself right of the origin and +-pi left of it (x = -0 counts as left); on the y axis, +-pi/2.
    # (Both infinite gives NaN here, +-pi/4 or +-3pi/4 in torch.) Constants only ever meet a tensor in
    # arithmetic, which keeps its dtype: tl.where of two literals would round pi to fp32.
    r = _atan(y / tl.where(x == 0, tl.abs(x), x))  # x = -0 divides like +0: y's sign gives +-pi/2
    r = tl.where(x < 0, tl.where(y < 0, r - 3.141592653589793, r + 3.141592653589793), r)
    left = (x < 0) | ((x == 0) & (1.0 / x < 0))
    r = tl.where(y == 0, tl.where(left, tl.where(1.0 / y < 0, y - 3.141592653589793, y + 3.141592653589793), y), r)
    return tl.where((x != x) | (y != y), x + y, r)
''',
}

# Helpers that call other helpers.
DEPENDS = {"_asinh": ("_log1p",), "_softplus": ("_log1p",), "_atan2": ("_atan",)}


def helper_source(names) -> str:
    """The source of the named helpers and what they call, in a stable order."""
    need = set()
    stack = list(names)
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(DEPENDS.get(n, ()))
    return "".join(HELPERS[n] for n in HELPERS if n in need)


# ------------------------------------------------------------------------------- in the interpreter
# The combine helpers above -> the numpy ufunc that is their one interpreter op (`tl.maximum` with
# PropagateNan.ALL is np.maximum there, `a * b` np.multiply): that ufunc's reduce is their fold.
FOLDS = {"_max_nan": "maximum", "_min_nan": "minimum", "_mul_combine": "multiply"}
_folds: dict = {}  # combine function -> ufunc, or None where it is not one of ours; decided once per function


def reduce_helpers_in_numpy() -> None:
    """Make Triton's interpreter run a `tl.reduce` with `_max_nan`, `_min_nan` or `_mul_combine` as one numpy
    reduce. It reduces with any combine function but its own (tl.max, tl.sum) one element at a time, each
    step a Python call of the helper on two scalars: a 64 x 64 tile's column max took 0.8 s, and SPLADE's
    matmul + amax kernel (256 such tiles per validation case) 190 s of a CI run. The ufunc's reduce is the
    same fold, NaN propagating as before; the GPU still runs the helper. A function is taken for one of
    ours only when its source is the one written here; any other keeps the interpreter's own path.
    Applied before the first interpreted launch (`advisor.interpreter.patch_interpreter`)."""
    patch_interpreter("ReduceOps", "apply_impl", "helpers_in_numpy", _numpy_folds)


def _numpy_folds(elementwise):
    def apply_impl(self, input):
        ufunc = _fold_of(self.combine_fn)
        if ufunc is None or len(input) != 1:
            return elementwise(self, input)
        data = input[0].handle.data
        folded = ufunc.reduce(data, axis=self.axis, dtype=data.dtype, keepdims=self.keep_dims)
        return self.to_tensor(folded, input[0].dtype)

    return apply_impl


def _fold_of(combine_fn):
    fn = getattr(combine_fn, "fn", None)  # the interpreter's @triton.jit function wraps the Python one
    if getattr(fn, "__name__", None) not in FOLDS:
        return None
    if fn not in _folds:
        import inspect
        import textwrap

        import numpy as np

        try:  # the source as written in the generated module, its decorator included
            src = textwrap.dedent(inspect.getsource(fn)).strip()
        except (OSError, TypeError):
            src = None
        _folds[fn] = getattr(np, FOLDS[fn.__name__]) if src == HELPERS[fn.__name__].strip() else None
    return _folds[fn]

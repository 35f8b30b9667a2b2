"""Code generation beyond single ops: broadcasting over strided/expanded inputs, type promotion,
row kernels in both variants, cat, multiple outputs, in-place outputs, the cache, the emitted code."""
import os

import pytest
import torch

from advisor.codegen import Unsupported, generate, load_module
from advisor.codegen.record import record_program
from advisor.validate import validate

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
F = torch.nn.functional


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



def build(fn, *inputs):
    gen = generate(record_program(fn, *inputs))
    return gen, load_module(gen.path)


def run_and_compare(fn, *inputs, atol=1e-5, rtol=1e-5, module=None):
    gen, mod = build(fn, *inputs) if module is None else (None, module)
    got = mod.run(*[t.clone() for t in inputs])
    want = fn(*[t.clone() for t in inputs])
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, equal_nan=True)
    return gen, mod


def assert_validates(gen, mod):
    v = validate(gen, mod)
    assert v.validated, f"{v.reason}\n{gen.code}"
    return v


# ------------------------------------------------------------------------------ strides, broadcasting
def test_transposed_and_expanded_inputs():
    x = torch.randn(33, 20).t()  # non-contiguous
    b = torch.randn(20, 1).expand(20, 33)  # stride 0
    s = torch.randn(33)  # broadcast along rows
    gen, mod = run_and_compare(lambda x, b, s: torch.sigmoid(x * b) + s, x, b, s)
    assert_validates(gen, mod)
    # the same kernel (same pattern) at other sizes and other strides of the same structure
    x2, b2, s2 = torch.randn(7, 9).t(), torch.randn(9, 1).expand(9, 7), torch.randn(7)
    run_and_compare(lambda x, b, s: torch.sigmoid(x * b) + s, x2, b2, s2, module=mod)


def test_contiguous_inputs_load_at_flat_offsets():
    gen, mod = run_and_compare(lambda x, y: x * y + 1, torch.randn(6, 50), torch.randn(6, 50))
    assert "in0_ptr + offs" in gen.code and "in1_ptr + offs" in gen.code
    # a transposed input still computes the right thing: the launcher lays it out like the output
    run_and_compare(lambda x, y: x * y + 1, torch.randn(6, 50), torch.randn(50, 6).t(), module=mod)


def test_launcher_refuses_other_structure():
    _, mod = build(lambda x, y: x + y, torch.randn(4, 8), torch.randn(8))
    with pytest.raises(ValueError):
        mod.run(torch.randn(4, 8), torch.randn(4, 8))  # rank of the second input differs
    with pytest.raises(ValueError):
        mod.run(torch.randn(4, 8), torch.randn(8, dtype=torch.float64))


def test_channels_last_batch_norm_residual_relu():
    x = torch.randn(2, 6, 5, 3).to(memory_format=torch.channels_last)
    r = torch.randn(2, 6, 5, 3).to(memory_format=torch.channels_last)
    w, b, m, v = torch.randn(6), torch.randn(6), torch.randn(6), torch.rand(6) + 0.5

    def fn(x, r, w, b, m, v):
        return torch.relu_(F.batch_norm(x, m, v, w, b, training=False).add_(r))
    gen, mod = run_and_compare(fn, x, r, w, b, m, v)
    assert mod.run(x, r, w, b, m, v)[0].is_contiguous(memory_format=torch.channels_last)
    assert_validates(gen, mod)


# -------------------------------------------------------------------------------- type promotion
@pytest.mark.parametrize("fn,inputs", [
    (lambda a, b: a + b, (torch.randint(-5, 5, (4, 9)), torch.randn(4, 9))),  # int + float -> float
    (lambda a, b: a * b, (torch.randn(4, 9, dtype=torch.bfloat16), torch.randn(4, 9))),  # bf16 * fp32 -> fp32
    (lambda a, b: a + b, (torch.randn(4, 9, dtype=torch.float16), torch.randn(9, dtype=torch.bfloat16))),
    (lambda a: a * 0.5, (torch.randint(-5, 5, (4, 9)),)),  # int * Python float -> default float
    (lambda a, b: a < b, (torch.randint(-5, 5, (4, 9)), torch.randn(4, 9))),  # compare int with float
    (lambda a, b: torch.where(a > 0, a, b), (torch.randn(4, 9, dtype=torch.bfloat16), torch.randn(4, 9))),
    (lambda a, b: a / b, (torch.randint(1, 5, (4, 9)), torch.randint(1, 5, (4, 9)))),  # true division
    (lambda a: (a > 0).sum(-1), (torch.randn(4, 9),)),  # bool sum -> int64
])
def test_type_promotion(fn, inputs):
    inputs = [t.to(DEV) for t in inputs]  # made at collection time, on the CPU
    gen, mod = run_and_compare(fn, *inputs, atol=1e-2, rtol=1e-2)
    assert_validates(gen, mod)


# ---------------------------------------------------------------------------------------- rows
ROW_FNS = {
    "sum": lambda x: x.sum(-1), "mean_keepdim": lambda x: x.mean(-1, keepdim=True), "amax": lambda x: x.amax(-1),
    "amin": lambda x: torch.amin(x, -1, keepdim=True), "var": lambda x: x.var(-1), "std": lambda x: x.std(-1, correction=0),
    "var_mean": lambda x: torch.var_mean(x, -1), "logsumexp": lambda x: torch.logsumexp(x, -1),
    "norm": lambda x: torch.linalg.vector_norm(x, dim=-1), "prod": lambda x: (x * 0.1 + 1).prod(-1),
    "softmax": lambda x: torch.softmax(x * 2, -1), "log_softmax": lambda x: F.log_softmax(x, -1),
    "layer_norm": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5),
    "rms_norm": lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, 1e-6),
    "add_rmsnorm_residual_out": lambda x, w, b: (lambda h: (h, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w))(x + b),
    "softmax_mask_scale": lambda x, w, b: torch.softmax((x * 0.125).masked_fill(b > 0.5, float("-inf")), -1),
    "any": lambda x: (x > 1.5).any(-1),
}


@pytest.mark.parametrize("variant", ["persistent", "looped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", sorted(ROW_FNS))
def test_row_kernels(name, dtype, variant):
    fn = ROW_FNS[name]
    n = 50
    x = torch.randn(3, 4, n, dtype=dtype)
    args = (x, torch.randn(n, dtype=dtype), torch.rand(n, dtype=dtype)) if fn.__code__.co_argcount == 3 else (x,)
    gen, mod = build(fn, *args)
    assert gen.kind == "rows"
    if variant == "looped":  # several chunks with a masked tail, as wide rows would take
        mod.MAX_PERSISTENT_N, mod.LOOP_BLOCK_N = 0, 16
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    got = mod.run(*[a.clone() for a in args])
    want = fn(*[a.float() if a.is_floating_point() else a for a in args])
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float() if g.is_floating_point() else g, w, atol=tol, rtol=tol, equal_nan=True)
    assert_validates(gen, mod)


@pytest.mark.parametrize("big", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize("variant", ["persistent", "looped"])
def test_row_kernels_index_in_64_bits_only_when_offsets_need_it(variant, big):
    """Swin's shifted-window softmax: the scores plus a per-head bias and a per-window mask (broadcast over the
    batch: each row's index is split into its dims by division). The row kernels take BIG_INDEX from the
    launcher's `_int64_needed` as the pointwise kernel does: 32-bit division unless the tensors reach 2**31
    elements (64-bit division is emulated on the GPU). Both index widths give eager's answer."""
    windows, heads, n = 4, 3, 7
    scores = torch.randn(2 * windows, heads, n, n)
    bias, mask = torch.randn(heads, n, n), torch.randn(windows, n, n)

    def fn(s, b, m):
        s = (s + b.unsqueeze(0)).view(-1, windows, heads, n, n) + m.unsqueeze(1).unsqueeze(0)
        return torch.softmax(s.view(-1, heads, n, n), -1)

    gen, mod = build(fn, scores, bias, mask)
    assert gen.kind == "rows"
    for kernel in gen.code.split("@triton.jit")[1:]:
        if "n_rows" in kernel or "_looped(" in kernel:  # the row kernels: no 64-bit cast outside BIG_INDEX's branch
            assert kernel.count("tl.int64") == 1 and "if BIG_INDEX:" in kernel
    assert "big = _int64_needed(" in gen.code and gen.code.count("BIG_INDEX=big") == 2
    if variant == "looped":
        mod.MAX_PERSISTENT_N, mod.LOOP_BLOCK_N = 0, 4
    mod._int64_needed = lambda *tensors: big
    torch.testing.assert_close(mod.run(scores, bias, mask)[0], fn(scores, bias, mask))


@pytest.mark.parametrize("variant", ["persistent", "looped"])
def test_row_max_propagates_nan(variant):
    x = torch.randn(4, 50)
    x[1, 7] = float("nan")
    gen, mod = build(lambda x: (x.amax(-1), torch.amin(x, -1)), x)
    if variant == "looped":
        mod.MAX_PERSISTENT_N, mod.LOOP_BLOCK_N = 0, 16
    for got, want in zip(mod.run(x), (x.amax(-1), x.amin(-1))):
        torch.testing.assert_close(got, want, equal_nan=True)
    assert got[1].isnan()


@pytest.mark.skipif(DEV == "cuda", reason="a patch of Triton's interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32], ids=lambda d: str(d)[6:])
def test_interpreter_folds_the_combine_helpers_in_numpy(dtype, tmp_path):
    """`tl.reduce` with `_max_nan`, `_min_nan`, `_mul_combine` runs as one numpy reduce in the interpreter
    (element by element it took minutes per kernel): the same results, NaN and -0.0 included, as the
    interpreter's own elementwise fold, which a helper of the same name but another source still takes.
    (Not bf16: the interpreter holds it as uint16 bits, which its own maximum compares as integers; the
    generated kernels reduce in fp32.)"""
    import numpy as np
    from triton.runtime import interpreter

    from advisor.codegen.helpers import HELPERS, _fold_of, helper_source

    head = "import triton\nimport triton.language as tl\n"
    path = tmp_path / "folds.py"
    path.write_text(head + helper_source(["_max_nan", "_min_nan", "_mul_combine"]) + '''

@triton.jit
def fold_kernel(x_ptr, o_ptr, KIND: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, 16)[:, None] * 8 + tl.arange(0, 8)[None, :])
    if KIND == 0:
        y = tl.reduce(x, 0, _max_nan)
    elif KIND == 1:
        y = tl.reduce(x, 0, _min_nan)
    else:
        y = tl.reduce(x, 0, _mul_combine)
    tl.store(o_ptr + tl.arange(0, 8), y)
''')
    mod = load_module(path)  # installs the numpy folds
    fast = interpreter.ReduceOps.apply_impl
    elementwise = fast.__closure__[0].cell_contents  # the interpreter's own apply_impl, which it wraps
    assert fast.helpers_in_numpy and not getattr(elementwise, "helpers_in_numpy", False)
    x = torch.randn(128).to(dtype) if dtype.is_floating_point else torch.randint(-3, 4, (128,), dtype=dtype)
    if dtype.is_floating_point:
        x[5], x[17], x[30] = float("nan"), -0.0, 0.0
    for kind in range(3):
        outs = []
        for impl in (fast, elementwise):
            interpreter.ReduceOps.apply_impl = impl
            try:
                out = torch.empty(8, dtype=dtype)
                mod.fold_kernel[(1,)](x, out, KIND=kind)
            finally:
                interpreter.ReduceOps.apply_impl = fast
            outs.append(out)
        assert torch.equal(outs[0].isnan(), outs[1].isnan()) and torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num())
        assert torch.equal(torch.signbit(outs[0]), torch.signbit(outs[1]))
        if kind < 2 and dtype.is_floating_point:
            assert outs[0][5].isnan()  # x[5]'s column: NaN propagates
    other = tmp_path / "other.py"
    other.write_text(head + HELPERS["_max_nan"].replace(", propagate_nan=tl.PropagateNan.ALL", ""))
    assert _fold_of(mod._max_nan) is np.maximum and _fold_of(mod._mul_combine) is np.multiply
    assert _fold_of(load_module(other)._max_nan) is None  # NaN-dropping: not the helper numpy's max folds


def test_looped_kernel_passes():
    """Softmax loops three times over a wide row: max, sum of exp, then the outputs."""
    gen, mod = build(lambda x: torch.softmax(x, -1), torch.randn(2, 40))
    looped = gen.code.split("_looped(")[1]
    assert looped.count("for start in range(0,") == 3
    assert "tl.sum(acc0, axis=0)" in looped and "tl.reduce(acc0, 0, _max_nan)" in looped


def test_row_op_over_non_last_dim_is_refused():
    with pytest.raises(Unsupported, match="only the last dim"):
        generate(record_program(lambda x: torch.softmax(x, 0), torch.randn(4, 8)))


# ----------------------------------------------------------------------------------------- cat
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat_any_dim(dim):
    x, y = torch.randn(4, 6, 5), torch.randn(4, 6, 5)
    fn = lambda x, y: torch.cat([x * 2, torch.sigmoid(y), -x], dim) + 1  # noqa: E731
    gen, mod = run_and_compare(fn, x, y)
    assert_validates(gen, mod)


def test_rotary_halves():
    """Rotary embedding: slices of one input, neg, cat along the last dim, broadcast tables."""
    def rotary(q, cos, sin):
        half = q.shape[-1] // 2
        rot = torch.cat([-q[..., half:], q[..., :half]], -1)
        return q * cos + rot * sin
    q = torch.randn(2, 16, 3, 8).transpose(1, 2)  # (batch, heads, seq, dim) as a transposed view
    cos, sin = torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8)
    gen, mod = run_and_compare(rotary, q, cos, sin)
    assert_validates(gen, mod)


# ------------------------------------------------------------------------- outputs and in-place
def test_several_outputs_of_different_shapes():
    def fn(x, b):
        h = x + b
        return h, torch.tanh(h), b * 2
    gen, mod = run_and_compare(fn, torch.randn(3, 7), torch.randn(7))
    assert_validates(gen, mod)


def test_in_place_on_input_writes_it():
    def fn(x, y):
        x.mul_(2).add_(y)
        return torch.relu(x)
    x, y = torch.randn(5, 9), torch.randn(5, 9)
    gen, mod = build(fn, x.clone(), y)
    xa, xb = x.clone(), x.clone()
    out = mod.run(xa, y)[0]
    want = fn(xb, y)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(xa, xb)  # the input itself was updated, like mul_/add_ do
    assert_validates(gen, mod)


# -------------------------------------------------------------------------------- the artefact
def test_cache_reuses_modules_by_pattern(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path))
    fn = lambda x, b: torch.log(torch.relu(x + b))  # noqa: E731
    first = generate(record_program(fn, torch.randn(100), torch.randn(100)))
    again = generate(record_program(fn, torch.randn(100), torch.randn(100)))
    other_size = generate(record_program(fn, torch.randn(37), torch.randn(37)))
    assert not first.cached and again.cached and other_size.cached  # sizes are not part of the pattern
    assert first.key == other_size.key
    assert len(list((tmp_path / "kernels").glob("*.py"))) == 1
    bf16 = generate(record_program(fn, torch.randn(100, dtype=torch.bfloat16), torch.randn(100, dtype=torch.bfloat16)))
    assert not bf16.cached and bf16.key != first.key


def test_module_imports_only_torch_and_triton():
    gen, _ = build(lambda x: F.gelu(x, approximate="tanh") * x.softmax(-1), torch.randn(4, 30))
    imports = [line for line in gen.code.splitlines() if line.startswith(("import ", "from "))]
    assert imports == ["import torch", "import triton", "import triton.language as tl"]
    assert "libdevice" not in gen.code  # the interpreter cannot run it; the helpers use core tl math


def test_seed_kernel_reads_like_a_tutorial():
    gen, _ = build(lambda x, b: torch.log(torch.relu(x + b)), torch.randn(1000), torch.randn(1000))
    kernel = gen.code.split("@triton.jit")[1].split("\ndef run")[0]
    assert "in0 = tl.load(in0_ptr + offs, mask=mask)" in kernel
    assert "tl.store(out0_ptr + offs, v2, mask=mask)" in kernel
    assert len(kernel.strip().splitlines()) <= 15

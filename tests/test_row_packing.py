"""Short rows share a program: the persistent row kernel works on a [BLOCK_R, BLOCK_N] block, BLOCK_R rows of
under 1024 columns at a time (`_row_config` in the generated module), where it ran one program per row (on the
H100 a bf16 softmax over 301056 rows of 49 took 186 µs so, 4x eager's kernel; 41 µs packed). Each kernel here is
generated, run against eager in fp32 and bf16, validated, and its launches recorded: short rows go several to a
program (row counts that are not a multiple of BLOCK_R, R = 1 too), wide rows still one."""
import os

import pytest
import torch

from advisor.codegen import generate, load_module
from advisor.codegen.record import record_program
from advisor.validate import validate

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
F = torch.nn.functional
DEV = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
bf16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.getbasetemp() / "kernel-cache"))


class _Spy:
    """Stands for a kernel in its module: records each launch's grid and constexprs, then launches it."""

    def __init__(self, kernel, log: list):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append({"grid": grid, **kw})
            return self.kernel[grid](*args, **kw)
        return launch


def build(fn, *inputs):
    """The generated module for fn, its persistent kernel's launches recorded in `mod.launches`."""
    gen = generate(record_program(fn, *inputs))
    assert gen.kind == "rows"
    mod = load_module(gen.path)
    mod.launches = []
    (name,) = [k for k in vars(mod) if k.endswith("_kernel") and hasattr(getattr(mod, k), "__getitem__")]
    setattr(mod, name, _Spy(getattr(mod, name), mod.launches))
    return gen, mod


def check(fn, *inputs, tol=None):
    """Run the kernel on `inputs` against eager, validate it; its launch on `inputs`."""
    inputs = tuple(t.to(DEV) for t in inputs)
    gen, mod = build(fn, *inputs)
    got = mod.run(*[t.clone() for t in inputs])
    want = fn(*[t.clone() for t in inputs])
    want = want if isinstance(want, tuple) else (want,)
    bf = any(t.dtype == bf16 for t in inputs)
    tol = tol or (2e-2 if bf else 1e-5)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if g.is_floating_point():
            torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol, equal_nan=True)
        else:
            assert torch.equal(g, w)
    launch = mod.launches[0]
    v = validate(gen, mod)
    assert v.validated, v.reason
    return gen, mod, launch


def packed(launch, rows: int) -> int:
    """BLOCK_R of a launch over `rows` rows, checked against its grid."""
    assert launch["grid"] == (-(-rows // launch["BLOCK_R"]),)
    return launch["BLOCK_R"]


@pytest.mark.parametrize("dtype", [torch.float32, bf16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, n", [(21, 37), (5, 49), (1, 49), (40, 49)])
def test_softmax_on_short_rows(rows, n, dtype):
    gen, mod, launch = check(lambda x: torch.softmax(x, -1), torch.randn(rows, n, dtype=dtype) * 3)
    assert "rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]" in gen.code
    assert "keep_dims=True" in gen.code.split("_looped(")[0]
    assert launch["BLOCK_N"] == 64 and launch["num_warps"] == 1
    # 1024 elements a program; never more rows than there are (R = 1: one row, nothing packed)
    assert packed(launch, rows) == min(16, 1 << (rows - 1).bit_length())
    assert mod._row_config(49, 301056, 2) == (64, 16, 1)


@pytest.mark.parametrize("dtype", [torch.float32, bf16], ids=["fp32", "bf16"])
def test_layer_norm_with_weight_and_bias(dtype):
    x, w, b = torch.randn(3, 7, 40, dtype=dtype), torch.randn(40, dtype=dtype), torch.randn(40, dtype=dtype)
    _, _, launch = check(lambda x, w, b: F.layer_norm(x, (40,), w, b, 1e-5), x, w, b)
    assert packed(launch, 21) == 16


def test_layer_norm_mean_and_rstd_per_row():
    """native_layer_norm's three outputs: the normalised rows and two per-row values, stored per row."""
    x, w, b = torch.randn(2, 11, 40), torch.randn(40), torch.randn(40)
    _, _, launch = check(lambda x, w, b: torch.native_layer_norm(x, (40,), w, b, 1e-5), x, w, b)
    assert packed(launch, 22) == 16


def test_hf_llama_rms_norm():
    def rms_norm(x, w):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h.to(bf16) * w

    x, w = torch.randn(2, 9, 48, dtype=bf16), torch.randn(48, dtype=bf16)
    _, _, launch = check(rms_norm, x, w)
    assert packed(launch, 18) == 16


@pytest.mark.parametrize("dtype", [torch.float32, bf16], ids=["fp32", "bf16"])
def test_reductions_with_per_row_outputs(dtype):
    x = torch.randn(3, 5, 37, dtype=dtype)
    x[1, 2, 4] = float("nan")  # amax propagates a row's NaN, in its own row only
    _, _, launch = check(lambda x: (x.sum(-1), x.amax(-1), x.argmax(-1), (x > 1.5).any(-1)), x)
    assert packed(launch, 15) == 16


def test_var_mean():
    _, _, launch = check(lambda x: torch.var_mean(x, -1), torch.randn(19, 30))
    assert packed(launch, 19) == 32


def test_rows_from_lead_dims_with_a_per_row_scalar():
    """(B, H, L, 49) attention scores: each row's index unravelled into three lead dims (// and %), a bias
    loaded once per row ([B, H, L, 1]), the rows written back through strides."""
    x, bias = torch.randn(2, 3, 5, 49), torch.randn(2, 3, 5, 1)
    gen, _, launch = check(lambda x, b: torch.softmax(x * 0.125 + b, -1), x, bias)
    assert "//" in gen.code.split("_looped(")[0]
    assert packed(launch, 30) == 16
    _, _, launch = check(lambda x: torch.softmax(x, -1), torch.randn(2, 3, 5, 49, dtype=bf16).transpose(1, 2))
    assert packed(launch, 30) == 16


def test_a_single_row_without_lead_dims():
    """No lead dims: the stores' addresses do not depend on the row, broadcast to the block for tl.store."""
    gen, _, launch = check(lambda x: (torch.softmax(x, -1), x.sum(-1)), torch.randn(49))
    assert "tl.broadcast_to(" in gen.code and packed(launch, 1) == 1


@pytest.mark.parametrize("dtype", [torch.float32, bf16], ids=["fp32", "bf16"])
def test_wide_rows_stay_one_a_program(dtype):
    _, mod, launch = check(lambda x: torch.softmax(x, -1), torch.randn(3, 3000, dtype=dtype))
    assert packed(launch, 3) == 1 and launch["BLOCK_N"] == 4096
    assert launch["num_warps"] == min(8, 4096 * dtype.itemsize // 1024)  # a warp per KB, as before
    assert mod._row_config(1024, 4096, 2) == (1024, 1, 2)
    assert mod._row_config(20000, 8, 2)[1] == 1


def test_the_cost_model_packs_rows_as_the_launcher_does():
    """analysis/cost.py predicts a row kernel's programs with `rows_per_program`; the generated launcher's
    `_row_config` decides them: the two must agree at every width and row count, or the estimates drift."""
    from advisor.analysis.cost import rows_per_program

    _, mod = build(lambda x: torch.softmax(x, -1), torch.randn(4, 49))
    for n in (1, 7, 37, 49, 64, 100, 128, 257, 512, 768, 1024, 3000, 16384):
        for rows in (1, 2, 3, 5, 16, 17, 1000, 301056):
            assert mod._row_config(n, rows, 2)[1] == rows_per_program(n, rows), (n, rows)

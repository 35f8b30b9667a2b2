"""Fuzzing the generator (issue 8): random programs of pointwise and last-dim reduction ops with random
shapes, broadcasting, strides and dtypes (tests/fuzz_programs.py) go through the generator and
validation, and the kernel's outputs on the program's own (strided) inputs are compared with eager
PyTorch calling the same Python function. A deliberately wrong lowering must be rejected by
validation every time.

Two paths into the generator:
- `test_fuzz_generator` (1,500 cases in CI, about 50 s on 2 cores under the interpreter): the program
  recorded from the function by `record_program`, the format the analyzer writes. Modules are cached
  by pattern (on disk by the generator, validated once per pattern here);
- `test_fuzz_through_the_profiler_and_analyzer` (8 batches of 8 programs): the programs run as the
  submodules of one model under the real profiler + ET observer, are analysed, generated, validated
  and patched in, and the patched model is compared with eager.

Sizes: FUSION_ADVISOR_FUZZ_EXAMPLES (main test; nightly e.g. 20000, about 10 minutes per 8,000) and
FUSION_ADVISOR_FUZZ_ANALYZER_EXAMPLES. Cases are derandomized (the same every run, so a failure
reproduces) unless FUSION_ADVISOR_FUZZ_SEED is set (then that seed). A failure prints the program as
a Python function, its inputs' dtypes and layouts, and hypothesis' reproduction blob.
"""
from __future__ import annotations

import collections
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis import seed as hypothesis_seed
from torch.utils._python_dispatch import TorchDispatchMode

from advisor.codegen import Unsupported, generate, load_module
from advisor.codegen.record import record_program
from advisor.ops import lowering
from advisor.validate import _through, _writer, validate
from advisor.validate.compare import compare
from fuzz_programs import FUZZ_OPS, PLANTABLE, programs, planted_programs

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
DEV = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
EXAMPLES = int(os.environ.get("FUSION_ADVISOR_FUZZ_EXAMPLES", "1500" if DEV == "cpu" else "200"))
SEED = os.environ.get("FUSION_ADVISOR_FUZZ_SEED")


# The only refusals accepted: shapes a one-program-per-row kernel cannot cover (an output or a second
# row op whose shape equals the row's only by recorded size; a per-row value read along the row).
REFUSALS = ("is neither a row", "row ops over different shapes", "read across rows")


# Triton's interpreter (triton 3.9) fails on bitwise ops over a bool made by comparing a scalar load (a 0-dim
# or size-1 input): numpy's bitwise_or/and get float data. The GPU compiles the same kernel. Validation
# rejects those kernels on the CPU, which is safe; the fuzz counts them instead of failing.
INTERPRETER_LIMITS = ("'bitwise_or\\' not supported", "'bitwise_and\\' not supported", "'bitwise_or' not supported",
                      "'bitwise_and' not supported", "'bitwise_xor' not supported", "'bitwise_xor\\' not supported")


def fuzz_settings(n: int):
    def wrap(f):
        f = settings(max_examples=n, deadline=None, derandomize=SEED is None, database=None,
                     suppress_health_check=list(HealthCheck), print_blob=True)(f)
        return hypothesis_seed(int(SEED))(f) if SEED is not None else f
    return wrap


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """A kernel cache of this module's own: planted bugs must never reach another test's modules."""
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.getbasetemp() / "fuzz-kernel-cache"))


# ------------------------------------------------------------------------------------------ helpers
def clone_strided(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy with the same strides and storage offset (and the storage around it), optionally in another dtype."""
    dtype = dtype or t.dtype
    whole = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    return torch.as_strided(whole.to(dtype, copy=True), t.shape, t.stride(), t.storage_offset())


def to64(t: torch.Tensor) -> torch.Tensor:
    return clone_strided(t, torch.float64 if t.is_floating_point() else None)


class Float64(TorchDispatchMode):
    """The function as float64 arithmetic: float dtype arguments (`.to(bf16)`, `softmax(dtype=)`) become
    float64, as validation's exact reference does (inputs are converted by the caller)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        up = lambda a: torch.float64 if isinstance(a, torch.dtype) and a.is_floating_point else a  # noqa: E731
        return func(*[up(a) for a in args], **{k: up(v) for k, v in (kwargs or {}).items()})


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaNs included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    return torch.equal(a, b)


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(x == y for n, x, y in zip(a.shape, a.stride(), b.stride()) if n > 1)


class Modules:
    """Generated modules and their validation, by pattern (and kernel variant): a pattern seen again
    (hypothesis repeats and shrinks) is neither regenerated nor revalidated."""

    def __init__(self):
        self.done: dict = {}

    def get(self, gen, looped: bool):
        key = (gen.key, looped)
        if key not in self.done:
            mod = load_module(gen.path, f"fuzz_{gen.key}_{int(looped)}")
            if looped:  # several chunks with a masked tail, as rows wider than 16K columns take
                mod.MAX_PERSISTENT_N, mod.LOOP_BLOCK_N = 0, 4
            self.done[key] = (mod, validate(gen, mod))
        return self.done[key]


def check_program(prog, modules: Modules, stats: collections.Counter | None = None) -> None:
    """Generate + validate the program's kernel; its outputs (and the inputs it writes) must match eager."""
    stats = stats if stats is not None else collections.Counter()
    fn = prog.function()
    inputs = prog.make_inputs(DEV)
    record = record_program(fn, *[clone_strided(t) for t in inputs])
    try:
        gen = generate(record)
    except Unsupported as e:
        # Refusing is safe (nothing is patched) but only for programs outside what a row kernel computes.
        if not any(r in str(e) for r in REFUSALS):
            raise AssertionError(f"the generator refused a program in its domain: {e}\n{prog.describe()}") from None
        stats["refused"] += 1
        return
    mod, check = modules.get(gen, prog.looped)
    if not check.validated and DEV == "cpu" and any(m in (check.reason or "") for m in INTERPRETER_LIMITS):
        stats["interpreter_limit"] += 1  # rejected (so never used): a Triton interpreter bug, not the kernel's
        return
    assert check.validated, f"validation rejected the kernel: {check.reason}\n{prog.describe()}\n{gen.code}"
    args = [clone_strided(t) for t in inputs]
    got = mod.run(*args)
    eager_args, ref_args = [clone_strided(t) for t in inputs], [to64(t) for t in inputs]
    want = fn(*eager_args)
    with Float64():
        ref = fn(*ref_args)
    assert len(got) == len(want), prog.describe()
    where = f"\n{prog.describe()}"
    for k, (g, w, r) in enumerate(zip(got, want, ref)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"output {k}: {g.dtype}{list(g.shape)} vs eager " \
                                                          f"{w.dtype}{list(w.shape)}{where}"
        assert same_layout(g, w), f"output {k}: strides {g.stride()} vs eager {w.stride()}{where}"
        c = compare(g, r, w, f"output {k}", through=_through(gen.program, gen.program.outputs[k].id))
        assert c.ok, c.reason + where
    for k, (a, e, r, orig) in enumerate(zip(args, eager_args, ref_args, inputs)):
        if torch.equal(e, orig):  # not written by the program: the kernel must not write it either
            assert torch.equal(a, orig), f"input {k} was changed by the kernel{where}"
        else:
            c = compare(a, r, e, f"input {k} written in place",
                        through=_through(gen.program, _writer(gen.program, gen.program.inputs[k].id)))
            assert c.ok, c.reason + where
    stats["cases"] += 1
    stats[f"kind:{prog.kind}"] += 1
    stats.update(f"dtype:{str(i.dtype)[6:]}" for i in prog.inputs)
    stats.update(f"layout:{i.layout}" for i in prog.inputs)
    stats.update(f"aten:{n['op']}" for n in record["nodes"])
    stats.update(f"fuzz:{o}" for o in prog.ops)
    stats["looped"] += prog.looped


# ------------------------------------------------------------------------------------------ fuzzing
def test_fuzz_generator():
    """>= 1,000 random programs (derandomized): every kernel validates and matches eager on its own inputs."""
    modules, stats = Modules(), collections.Counter()
    t0 = time.perf_counter()

    @fuzz_settings(EXAMPLES)
    @given(programs())
    def case(prog):
        check_program(prog, modules, stats)

    case()
    elapsed = time.perf_counter() - t0
    print(f"\nfuzz: {stats['cases']} cases checked against eager, {stats['refused']} refused with a reason, "
          f"{stats['interpreter_limit']} hit the interpreter's bitwise bug, {len(modules.done)} distinct kernels, "
          f"{elapsed:.1f} s")
    # The fuzz is only worth its time if it reaches the whole table: dtypes, layouts and ops.
    assert stats["cases"] >= 0.9 * EXAMPLES, (stats["refused"], stats["interpreter_limit"])
    assert stats["interpreter_limit"] <= 0.02 * EXAMPLES, stats["interpreter_limit"]
    for key in ("kind:pointwise", "kind:rows", "dtype:float32", "dtype:bfloat16", "dtype:float16", "dtype:int64",
                "dtype:bool", "dtype:float64", "layout:transposed", "layout:sliced", "layout:strided",
                "layout:expanded", "layout:inner_t", "layout:inner_slice", "layout:inner_expand", "looped",
                "fuzz:inplace"):
        assert stats[key] > 0, f"the fuzz never drew {key}"
    covered = {k[5:] for k in stats if k.startswith("aten:")}
    table = {op for op, low in lowering.TABLE.items() if low.kind in ("pointwise", "row")}
    hit = {op for op in table if any(c == op or c.rstrip("_") == op for c in covered)}
    print(f"fuzz: {len(hit)} of {len(table)} lowering entries exercised")
    drawn = {k[5:] for k in stats if k.startswith("fuzz:")}
    print(f"fuzz: {len(drawn & FUZZ_OPS)} of the strategy's {len(FUZZ_OPS)} ops drawn")
    if EXAMPLES >= 1000:
        assert len(hit) >= 80, sorted(table - hit)
        assert len(FUZZ_OPS - drawn) <= 0.1 * len(FUZZ_OPS), sorted(FUZZ_OPS - drawn)


# ---------------------------------------------------------------------------------- planted bugs
PLANTED_EXAMPLES = 25
def _planted(op: str):
    """A wrong lowering for `op` (the generator's table entry replaced), and a check it was used."""
    good = lowering.TABLE[PLANTABLE[op]]
    wrong = {
        "exp": lambda a: f"tl.exp2({a.self})",
        "sub": lambda a: f"{a.self} + {a.other}",
        "mul": lambda a: f"{a.self} + {a.other}",
        "sigmoid": lambda a: f"1.0 / (1.0 + tl.exp({a.self}))",
        "tanh": lambda a: f"1.0 / (1.0 + tl.exp(-2.0 * {a.self}))",
        "rsqrt": lambda a: f"tl.sqrt({a.self})",
        "sum": lambda b, a: (b.reduce("max", a.self),),
    }[op]
    return lowering.Lowering(good.op, good.kind, wrong, good.promote, good.operands, good.positive, good.shape,
                             good.channel)


@pytest.mark.parametrize("op", sorted(PLANTABLE))
def test_planted_wrong_lowering_is_always_rejected(op, monkeypatch, tmp_path):
    """exp -> exp2, sub -> add, mul -> add, sigmoid/tanh with a wrong sign, rsqrt -> sqrt, sum -> max:
    over random programs that use the op, validation rejects every kernel."""
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path))  # the planted modules stay here
    monkeypatch.setitem(lowering.TABLE, PLANTABLE[op], _planted(op))
    seen = []

    @fuzz_settings(PLANTED_EXAMPLES)
    @given(planted_programs(op))
    def case(prog):
        fn = prog.function()
        try:
            gen = generate(record_program(fn, *[clone_strided(t) for t in prog.make_inputs(DEV)]), use_cache=False)
        except Unsupported as e:  # refused (nothing to reject): draw another program
            assert any(r in str(e) for r in REFUSALS), f"{e}\n{prog.describe()}"
            assume(False)
        check = validate(gen, load_module(gen.path, f"planted_{gen.key}"))
        assert not check.validated, f"a planted wrong {op} passed validation\n{prog.describe()}\n{gen.code}"
        assert check.reason, prog.describe()
        seen.append(check.reason)

    case()
    assert len(seen) >= PLANTED_EXAMPLES


def test_planted_bug_never_reaches_the_cache(monkeypatch, tmp_path):
    """A kernel generated with a patched table (use_cache=False) leaves nothing under the pattern's key,
    so a later run with the good table generates the good kernel."""
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path))
    fn = lambda x, y: torch.exp(x - y)  # noqa: E731
    x, y = torch.randn(7, 5, device=DEV), torch.randn(5, device=DEV)
    with monkeypatch.context() as m:
        m.setitem(lowering.TABLE, "aten::exp", _planted("exp"))
        bad = generate(record_program(fn, x, y), use_cache=False)
        assert not validate(bad, load_module(bad.path, "planted_cache_check")).validated
    assert not list((tmp_path / "kernels").glob("*.py"))
    good = generate(record_program(fn, x, y))
    assert not good.cached and "tl.exp2" not in good.code
    assert validate(good, load_module(good.path)).validated


# ------------------------------------------------------------------------ through the real analyzer
ANALYZER_EXAMPLES = int(os.environ.get("FUSION_ADVISOR_FUZZ_ANALYZER_EXAMPLES", "8"))


class _Program(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


class _Batch(torch.nn.Module):
    """Random programs side by side, one submodule each: one profile analyses them all."""

    def __init__(self, progs):
        super().__init__()
        self.progs = torch.nn.ModuleList(_Program(p.function()) for p in progs)

    def forward(self, inputs):
        return [m(*xs) for m, xs in zip(self.progs, inputs)]


def test_fuzz_through_the_profiler_and_analyzer(tmp_path_factory):
    """Batches of random programs run under torch.profiler + the ET observer, analysed; every candidate's
    kernel validates (or is refused with a reason), is patched in, and the patched model matches eager."""
    from advisor.analysis.api import analyze
    from advisor.collect.in_process import profile_calls
    from advisor.patching import build_plan, occurrence_modules, patch, unpatch
    from advisor.workflows.kernels import kernel_specs

    stats = collections.Counter()
    pure = programs(max_ops=5, sinks=True).filter(lambda p: "inplace" not in p.ops)  # called 4 times: no drifting inputs

    @fuzz_settings(ANALYZER_EXAMPLES)
    @given(st.lists(pure, min_size=8, max_size=8))
    def case(progs):
        out = tmp_path_factory.mktemp("batch")
        model = _Batch(progs)
        inputs = [p.make_inputs(DEV) for p in progs]

        def call():
            with torch.inference_mode():
                return model(inputs)

        eager = call()
        with Float64(), torch.inference_mode():
            ref = model([[to64(t) for t in xs] for xs in inputs])
        analysis = analyze(profile_calls(call, out, DEV, calls=2))
        cands = analysis.doc["candidates"]
        specs, records = kernel_specs(analysis.doc, len(cands), "kernel", out, DEV)
        for r in records:
            ok = r.validated or any(x in (r.reason or "") for x in REFUSALS + INTERPRETER_LIMITS)
            assert ok, f"{r.title}: {r.reason}\n" + "\n".join(p.describe() for p in progs)
        handle = patch(model, build_plan(specs, analysis.doc, occurrence_modules(analysis), "root"))
        call()  # captures
        got = call()
        stats["candidates"] += len(cands)
        stats["validated"] += len(specs)
        stats["patched"] += sum(1 for s in specs if handle.sites(s.key))
        # Not every validated kernel finds a site (x op x, an escaping intermediate one occurrence of the
        # pattern has and another has not): those sites run their original ops, which is safe; counted.
        stats.update(s.title.split(":")[0] for s in specs if not handle.sites(s.key))
        for k, (p, g, w, r) in enumerate(zip(progs, got, eager, ref)):
            for j, (a, b, c) in enumerate(zip(g, w, r)):
                low = min((t.dtype for t in (b,) + tuple(inputs[k]) if t.is_floating_point()),
                          key=lambda d: torch.finfo(d).bits, default=None)
                chk = compare(a, c, b, f"program {k} output {j}", through=low)
                assert chk.ok, f"patched model differs from eager: {chk.reason}\n{p.describe()}"
        unpatch(model)
        again = call()
        assert all(bit_equal(a, b) for x, y in zip(again, eager) for a, b in zip(x, y)), "unpatch changed outputs"

    case()
    print(f"\nanalyzer fuzz: {stats['candidates']} candidates, {stats['validated']} validated kernels, "
          f"{stats['patched']} patched")
    assert stats["candidates"] >= ANALYZER_EXAMPLES * 3 and stats["patched"] >= stats["validated"] * 0.5, stats

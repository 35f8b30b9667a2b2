"""Validation must reject wrong kernels (a planted wrong lowering, a kernel that skips its tail, one
that does not compile), and every candidate of the committed sample traces must end validated or
with a stated reason."""
import json
from pathlib import Path

import os

import pytest
import torch

from advisor.codegen import generate, load_module
from advisor.codegen.cache import atomic_write
from advisor.records import Kind
from advisor.workflows.generate import MATMUL_REASON, generate_candidates
from advisor.codegen.record import record_program
from advisor.ops import lowering
from advisor.validate import TOLERANCES, validate
from advisor.validate.compare import compare

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
ROOT = Path(__file__).resolve().parents[1]
SAMPLES = sorted(p for p in (ROOT / "sample_traces").glob("**/trace") if (p / "kineto.json.gz").exists()
                 or (p / "kineto.json").exists())


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



def seed(dtype=torch.float32, n=3000):
    return record_program(lambda x, b: torch.log(torch.relu(x + b)), torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype))


def planted(gen, tmp_path, old, new):
    """The generated module with one line changed: a wrong kernel to feed validation."""
    assert old in gen.code
    path = atomic_write(tmp_path / f"planted_{abs(hash(new))}.py", gen.code.replace(old, new))
    return load_module(path)


def test_planted_wrong_lowering_is_rejected(monkeypatch):
    good = lowering.TABLE["aten::add"]
    monkeypatch.setitem(lowering.TABLE, "aten::add", lowering.Lowering(
        good.op, good.kind, lambda a: f"{a.self} - {a.other}", good.promote, good.operands))
    gen = generate(seed(), use_cache=False)
    assert "in0 - in1" in gen.code
    v = validate(gen, load_module(gen.path))
    assert not v.validated and ("rel_l2" in v.reason or "NaN/Inf" in v.reason), v.reason


def test_kernel_skipping_the_tail_is_caught_by_poisoning(tmp_path):
    gen = generate(seed())
    mod = planted(gen, tmp_path, "mask = offs < numel", "mask = offs < numel - 1")
    v = validate(gen, mod)
    assert not v.validated and "NaN/Inf" in v.reason, v.reason


def test_row_kernel_skipping_a_column_is_caught(tmp_path):
    gen = generate(record_program(lambda x: torch.softmax(x, -1), torch.randn(6, 40)))
    mod = planted(gen, tmp_path, "col_mask = cols < ", "col_mask = 1 + cols < ")
    assert not validate(gen, mod).validated


def test_unwritten_bool_output_is_caught(tmp_path):
    gen = generate(record_program(lambda x: (x > 0) & (x < 1), torch.randn(500)))
    mod = planted(gen, tmp_path, "mask = offs < numel", "mask = offs < numel // 2")
    v = validate(gen, mod)
    assert not v.validated and "never written" in v.reason, v.reason


def test_kernel_that_does_not_compile_is_skipped_with_reason(tmp_path):
    gen = generate(seed())
    mod = planted(gen, tmp_path, "tl.log(", "tl.no_such_function(")
    v = validate(gen, mod)
    assert not v.validated and v.reason.startswith("kernel failed to compile or run"), v.reason


def test_good_kernel_validates_at_every_case():
    gen = generate(seed(torch.bfloat16))
    v = validate(gen, load_module(gen.path))
    assert v.validated, v.reason
    assert [s["case"] for s in v.errors["shapes"]] == ["recorded", "odd", "ones"]
    assert v.errors["shapes"][2]["inputs"] == [[1], [1]]
    assert v.errors["dtype"] == "bfloat16" and v.errors["rel_l2"] < TOLERANCES[torch.bfloat16].rel_l2


@pytest.mark.skipif(DEV == "cuda", reason="the cap applies to Triton's interpreter only")
def test_interpreter_caps_rows_but_keeps_the_row_width():
    gen = generate(record_program(lambda x: torch.softmax(x, -1), torch.randn(512, 96)))
    v = validate(gen, load_module(gen.path))
    assert v.validated and "fewer rows" in v.errors["note"]
    rows, width = v.errors["shapes"][0]["inputs"][0]
    assert width == 96 and rows < 512


@pytest.mark.skipif(DEV == "cuda", reason="the cap applies to Triton's interpreter only")
def test_interpreter_caps_a_tiled_kernel_by_what_it_reads_and_keeps_two_blocks():
    """A matmul + amax over its rows: its output (one row of the vocabulary) is small, but K and the rows
    it reduces are in no output. Capped under the interpreter by every value it reads or computes, each
    dim of several blocks keeps two (the K loop and the loop over rows carry their sums and maxima from
    step to step), and the recorded sizes stay on the GPU."""
    from advisor.codegen.anchored import generate_anchored
    from advisor.validate.shapes import INTERPRETER_MAX_BLOCK, cases

    fn = lambda h, w: torch.amax(torch.relu(torch.nn.functional.linear(h, w)), 0)  # noqa: E731
    gen = generate_anchored(record_program(fn, torch.randn(512, 256), torch.randn(300, 256)), "matmul_reduction")
    prog, mod = gen.program, load_module(gen.path)
    assert mod._small(1 << 20) == INTERPRETER_MAX_BLOCK  # the kernels' largest block in the interpreter
    rec = cases(prog, interpreter=True)[0]
    (rows, k), (n, k_w) = (rec.shape(prog, i.shape) for i in prog.inputs)
    assert k == k_w and 2 * INTERPRETER_MAX_BLOCK <= min(rows, k, n) and rows < 512 and k < 256 and n < 300
    assert "every value" in rec.note
    gpu = cases(prog, interpreter=False)[0]
    assert [gpu.shape(prog, i.shape) for i in prog.inputs] == [[512, 256], [300, 256]]
    v = validate(gen, mod)
    assert v.validated, v.reason
    assert v.errors["shapes"][0]["inputs"] == [[rows, k], [n, k]]


def test_tolerances_by_dtype():
    assert TOLERANCES[torch.float32].rel_l2 == 1e-5
    assert TOLERANCES[torch.bfloat16].rel_l2 == 1e-2
    assert TOLERANCES[torch.float16].rel_l2 == 1e-3


def test_compare_rules():
    ref = torch.randn(1000, dtype=torch.float64)
    native = ref.float()
    assert compare(ref.float(), ref, native, "x").ok
    assert not compare(ref.float() * 1.001, ref, native, "x").ok  # 1e-3 off in fp32
    bad = ref.float().clone()
    bad[7] = float("nan")
    assert "NaN/Inf" in compare(bad, ref, native, "x").reason
    # bf16: within tolerance, or no worse than twice eager's own error
    assert compare(ref.bfloat16(), ref, ref.bfloat16(), "x").ok
    assert not compare((ref * 1.05).bfloat16(), ref, ref.bfloat16(), "x").ok


def test_compare_in_slices_is_the_whole_comparison(monkeypatch):
    """compare works a slice at a time (validation's compare step held whole outputs in float64 on the
    host); the verdict, the errors and the first mismatch's position must not depend on the slice size."""
    import importlib
    compare_mod = importlib.import_module("advisor.validate.compare")
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(6, 50, generator=g, dtype=torch.float64) * 40
    ref[2, 3] = float("inf")
    native = ref.bfloat16()
    out = (ref * (1 + 1e-3 * torch.randn(6, 50, generator=g, dtype=torch.float64))).bfloat16()
    bad = out.clone()
    bad[4, 17] = float("nan")
    whole = [compare(o, ref, native, "x") for o in (out, bad)]
    monkeypatch.setattr(compare_mod, "CHUNK", 7)
    sliced = [compare(o, ref, native, "x") for o in (out, bad)]
    assert whole[0].ok and sliced[0].ok
    assert sliced[0].rel_l2 == pytest.approx(whole[0].rel_l2, rel=1e-12)
    assert sliced[0].max_abs == whole[0].max_abs and sliced[0].eager_max_abs == whole[0].eager_max_abs
    assert not sliced[1].ok and sliced[1].reason == whole[1].reason
    assert "NaN/Inf at 1 positions" in sliced[1].reason and "first at (4, 17)" in sliced[1].reason


# ------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("trace", SAMPLES, ids=lambda p: str(p.parent.relative_to(ROOT / "sample_traces")))
def test_sample_trace_candidates(trace, tmp_path):
    from advisor.analysis.api import analyze

    doc = analyze(trace).doc
    applied = generate_candidates(doc, tmp_path)
    assert len(applied["patterns"]) == len(doc["candidates"])
    anchored = {c["id"] for c in doc["candidates"] if Kind(c["kind"]).anchored}
    for p in applied["patterns"]:
        if p["validated"]:
            src = Path(p["kernel_file"]).read_text()
            assert src == p["source"] and "def run(" in src and p["errors"]["rel_l2"] is not None
        else:  # the only accepted reasons: attention-op barriers, and matmul-anchored groups the generator
            # refuses with a stated reason (conv epilogues, epilogues that are not elementwise): never a
            # kernel that failed validation or a generator error
            refused = p["candidate"] in anchored and p["kernel_file"] is None and \
                not p["reason"].startswith("generator error")
            assert p["reason"] == MATMUL_REASON or p["reason"].startswith("contains an attention op") or refused, \
                f"{p['candidate']} {p['title']}: {p['reason']}"
    on_disk = json.loads((tmp_path / "apply.json").read_text())
    assert on_disk["schema_version"] == 1 and len(on_disk["patterns"]) == len(applied["patterns"])
    again = generate_candidates(doc, tmp_path)  # a second run generates nothing new
    assert all(p["cached"] for p in again["patterns"] if p["kernel_file"])


def test_validation_memo_reuses_successes_only_for_the_same_source(tmp_path):
    gen = generate(seed())
    mod = load_module(gen.path)
    first = validate(gen, mod, memo=True)
    again = validate(gen, mod, memo=True)
    assert first.validated and not first.errors.get("reused")
    assert again.validated and again.errors["reused"] and "validation reused" in again.errors["note"]
    assert again.errors["rel_l2"] == first.errors["rel_l2"]
    wrong = planted(gen, tmp_path, "mask = offs < numel", "mask = offs < numel - 1")  # same gen, other source
    assert not validate(gen, wrong, memo=True).validated
    assert not validate(gen, wrong, memo=True).validated  # failures are never recorded
    assert not validate(gen, mod, memo=True, seed=3).errors.get("reused")  # another seed: other inputs


def test_gpu_cap_keeps_the_recorded_sizes_divisibility():
    """Capped for a GPU, a recorded multiple of 16 stays one (the variant Triton compiles for the real
    shape is the one validated); other sizes become odd (a masked tail)."""
    from advisor.codegen.read import read_program
    from advisor.validate.shapes import GPU_MAX_NUMEL, cases, domain_numel

    for n, mult16 in ((1 << 26, True), ((1 << 26) + 3, False)):
        prog = read_program(record_program(lambda x, b: torch.log(torch.relu(x + b)),
                                           torch.empty(n, device="meta"), torch.empty(n, device="meta")))
        rec = cases(prog, interpreter=False)[0]
        _, numel = domain_numel(prog, rec)
        assert numel <= GPU_MAX_NUMEL and "GPU: recorded shape capped" in rec.note
        assert (numel % 16 == 0) == mult16 and (mult16 or numel % 2 == 1)

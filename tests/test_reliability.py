"""Reliability (issue 8): bad input gets one clear line (and a non-zero exit where the run cannot go on),
and the user's model is never harmed. Only what the stage tests do not cover already is here:
tests/test_collect.py (missing / non-Python / raising / sys.exit / idle scripts), tests/test_analyze.py
(empty, truncated, non-JSON, foreign-JSON traces, unknown ops), tests/test_codegen.py and
tests/test_validate.py (planted wrong kernels, in-place on inputs), tests/test_patch.py (unpatch,
gradients, guards, copy/save/to/modes with stand-ins) and tests/test_fuzz.py (generated kernels).
"""
from __future__ import annotations

import copy
import gzip
import hashlib
import io
import json
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import advisor
from advisor.cli import main as cli_main
from candidates import candidates_of  # (pytest puts tests/ on sys.path)

ROOT = Path(__file__).resolve().parents[1]
GPU_SEED = ROOT / "sample_traces" / "seed" / "trace"  # recorded on an H100: kernels, runtime calls, ET
CPU_SEED = ROOT / "sample_traces" / "cpu" / "seed" / "trace"
DEV = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.getbasetemp() / "reliability-kernel-cache"))


def cli(argv, capsys) -> tuple[int, str, str]:
    """The CLI in this process: (exit code, stdout, stderr)."""
    code = 0
    try:
        cli_main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def flat(text: str) -> str:
    """Terminal output with rich's line wrapping undone."""
    return " ".join(text.split())


def one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0, err
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    text = " ".join(lines)
    assert lines and lines[0].startswith("error:"), err
    for n in needles:
        assert n in text, err
    # rich wraps one long line to the terminal width: one message, however many screen lines
    assert sum(line.startswith("error:") for line in lines) == 1 and len(text) < 600, err


def doctored(src: Path, dst: Path, edit=None, et: Path | None | bool = True) -> Path:
    """A copy of a trace directory with its Kineto events edited (and another ET, or none)."""
    dst.mkdir(parents=True, exist_ok=True)
    with gzip.open(src / "kineto.json.gz", "rt") as f:
        doc = json.load(f)
    if edit:
        edit(doc)
    with gzip.open(dst / "kineto.json.gz", "wt") as f:
        json.dump(doc, f)
    if et is True:
        shutil.copy(src / "et.json.gz", dst / "et.json.gz")
    elif et:
        shutil.copy(et, dst / "et.json.gz")
    shutil.copy(src / "meta.json", dst / "meta.json")
    return dst


def _args(doc):
    return [e.get("args", {}) for e in doc["traceEvents"]]


def script(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


# ============================================================================================ scripts
def test_worker_threads_are_profiled_and_analysed(tmp_path, capsys):
    """A script whose models run in worker threads: their ops are recorded and analysed (Kineto records
    the profiling thread only unless told otherwise; the ET observer records every thread)."""
    p = script(tmp_path, "threads.py", """
        import threading, torch
        class Block(torch.nn.Module):
            def forward(self, x, b):
                return torch.log(torch.relu(x + b)) * 2
        class Other(torch.nn.Module):
            def forward(self, x):
                return torch.sigmoid(x * 3).sum(-1)
        def work(m, args):
            for _ in range(3):
                m(*args)
        x, b, y = torch.randn(4096), torch.randn(4096), torch.randn(64, 33)
        ts = [threading.Thread(target=work, args=(Block(), (x, b))),
              threading.Thread(target=work, args=(Other(), (y,)))]
        for t in ts: t.start()
        for t in ts: t.join()
    """)
    code, out, err = cli(["profile", p, "--out", tmp_path / "o", "--device", "cpu"], capsys)
    assert code == 0, err
    from advisor.analysis.api import analyze

    doc = analyze(tmp_path / "o").doc
    chains = {" → ".join(o.split("::")[1] for o in c["ops"]) for c in doc["candidates"]}
    assert {"add → relu → log → mul", "mul → sigmoid → sum"} <= chains, (chains, doc.get("warnings"))
    assert not doc["warnings"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the streams of a CPU run are not CUDA "
                                                          "streams, and a CPU-only torch cannot create them")
def test_cuda_streams(tmp_path, capsys):
    p = script(tmp_path, "streams.py", """
        import torch
        class Block(torch.nn.Module):
            def forward(self, x, b):
                return torch.log(torch.relu(x + b)) * 2
        m, s = Block(), torch.cuda.Stream()
        x, b = torch.randn(1 << 16, device="cuda"), torch.randn(1 << 16, device="cuda")
        for _ in range(3):
            with torch.cuda.stream(s):
                m(x, b)
            m(x, b)
        torch.cuda.synchronize()
    """)
    code, _, err = cli(["profile", p, "--out", tmp_path / "o", "--device", "cuda"], capsys)
    assert code == 0, err
    code, out, err = cli(["analyze", tmp_path / "o"], capsys)
    assert code == 0 and "add → relu → log → mul" in flat(out), err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to profile on; "
                                                          "test_gpu_trace_without_kernels covers the analysis side")
def test_no_gpu_work_on_a_gpu_machine(tmp_path, capsys):
    p = script(tmp_path, "cpu_only.py", """
        import torch
        class Block(torch.nn.Module):
            def forward(self, x):
                return torch.relu(x + 1) * 2
        m, x = Block(), torch.randn(1024)
        for _ in range(3):
            m(x)
    """)
    code, out, err = cli(["profile", p, "--out", tmp_path / "o", "--device", "cuda"], capsys)
    assert code == 0
    code, out, err = cli(["analyze", tmp_path / "o"], capsys)
    assert "ran no GPU work" in flat(out + err)


# ============================================================================================= traces
def test_gpu_trace_without_kernels(tmp_path, capsys):
    """Recorded on a GPU machine, but no kernel ran (the model stayed on the CPU): analysed as CPU time,
    with a warning saying so."""
    def cpu_only(doc):
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") not in
                              ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "ac2g",
                               "gpu_user_annotation")]
    d = doctored(GPU_SEED, tmp_path / "t", cpu_only)
    code, out, err = cli(["analyze", d], capsys)
    assert code == 0, err
    doc = json.loads((d / "analysis.json").read_text())
    assert any("no GPU work" in w for w in doc["warnings"]), doc["warnings"]
    assert "no GPU work" in flat(out)


def test_kineto_without_record_function_ids(tmp_path, capsys):
    """An older torch writes no 'Record function id': the ET cannot be joined, so the shape-and-order
    fallback runs (low confidence), with a warning that says why; candidates are still found."""
    def drop(doc):
        for a in _args(doc):
            a.pop("Record function id", None)
    d = doctored(CPU_SEED, tmp_path / "t", drop)
    code, out, err = cli(["analyze", d], capsys)
    assert code == 0, err
    doc = json.loads((d / "analysis.json").read_text())
    assert doc["low_confidence"] and doc["candidates"]
    assert any("Record function id" in w for w in doc["warnings"])
    assert "Record function id" in flat(out)


def test_gpu_kineto_with_external_id_renamed(tmp_path, capsys):
    """Kernels that join no cpu op (their 'External id' renamed): one clear line, exit 2, not an empty report."""
    def rename(doc):
        for a in _args(doc):
            if "External id" in a:
                a["external id"] = a.pop("External id")
    d = doctored(GPU_SEED, tmp_path / "t", rename)
    code, _, err = cli(["analyze", d], capsys)
    one_line_error(code, err, "joins a cpu op", "External id")


def test_kernels_but_no_cpu_ops(tmp_path, capsys):
    def no_cpu(doc):
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") != "cpu_op"]
    for et in (True, None):
        d = doctored(GPU_SEED, tmp_path / f"t{bool(et)}", no_cpu, et=et)
        code, _, err = cli(["analyze", d], capsys)
        one_line_error(code, err, "no cpu_op events")


def test_et_of_another_run_is_refused(tmp_path, capsys):
    """An ET recorded with another workload: its rf_ids meet Kineto ops of other names. Saying so beats
    silently reporting the other workload's candidates as this one's."""
    other = tmp_path / "other.py"
    other.write_text("import torch\nclass O(torch.nn.Module):\n    def forward(self, x):\n"
                     "        return torch.sigmoid(x * 2).sum(-1)\n"
                     "m, x = O(), torch.randn(64, 32)\nfor _ in range(3):\n    m(x)\n")
    code, _, err = cli(["profile", other, "--out", tmp_path / "o", "--device", "cpu"], capsys)
    assert code == 0, err
    d = doctored(CPU_SEED, tmp_path / "t", et=tmp_path / "o" / "trace" / "et.json.gz")
    code, _, err = cli(["analyze", d], capsys)
    one_line_error(code, err, "does not belong")
    # and through --et on the command line
    code, _, err = cli(["analyze", CPU_SEED / "kineto.json.gz", "--et", tmp_path / "o" / "trace" / "et.json.gz",
                        "--out", tmp_path / "x"], capsys)
    one_line_error(code, err, "does not belong")


def test_meta_that_is_not_json(tmp_path, capsys):
    d = doctored(CPU_SEED, tmp_path / "t")
    (d / "meta.json").write_text("{ not json")
    code, _, err = cli(["analyze", d], capsys)
    one_line_error(code, err, "meta", "not valid JSON")


# ==================================================================================== models and ops
def fuse(model, make_inputs, out: Path, granularity: str = "occurrence"):
    """profile -> analyze -> generate + validate -> patch, in this process; returns (analysis, specs, records, handle)."""
    from advisor.analysis.api import analyze
    from advisor.collect.in_process import profile_calls
    from advisor.patching import build_plan, occurrence_modules, patch
    from advisor.workflows.kernels import kernel_specs

    def call():
        with torch.inference_mode():
            return model(*make_inputs())

    a = analyze(profile_calls(call, out, DEV, calls=2))
    specs, records = kernel_specs(a.doc, len(a.doc["candidates"]), "kernel", out, DEV)
    return a, specs, records, patch(model, build_plan(specs, a.doc, occurrence_modules(a), granularity))


def run(model, *xs):
    with torch.inference_mode():
        out = model(*xs)
    return out if isinstance(out, (tuple, list)) else (out,)


def assert_matches(got, want, exact_ints=True):
    """Patched outputs against eager: floats within validation's tolerances (vs float64 eager), the rest exact."""
    from advisor.validate.compare import compare

    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, w.dtype, g.shape, w.shape)
        if g.is_floating_point():
            c = compare(g, w.double(), w, f"output {k}")
            assert c.ok, c.reason
        else:
            assert torch.equal(g, w), k


class Chains(torch.nn.Module):
    """A pointwise chain and a row chain, for any dtype torch can run them in."""

    def forward(self, x, b):
        if x.dtype == torch.bool:
            return (x & ~b) | (x ^ b), (x | b).any(-1)
        if not x.is_floating_point():
            return torch.remainder(x * 3 + b, 5).clamp(-2, 2), (x > b).sum(-1)
        return torch.softmax(torch.relu(x + b) * 2, -1), torch.sigmoid(x * b).sum(-1)


def _inputs(dtype, shape=(6, 33)):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return (torch.rand(shape, generator=g) < 0.5).to(DEV), (torch.rand(shape[-1:], generator=g) < 0.5).to(DEV)
    if not dtype.is_floating_point:
        return (torch.randint(-9, 9, shape, generator=g).to(DEV, dtype),
                torch.randint(-9, 9, shape[-1:], generator=g).to(DEV, dtype))
    return torch.randn(shape, generator=g).to(DEV, dtype), torch.randn(shape[-1:], generator=g).to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool],
                         ids=lambda d: str(d)[6:])
def test_dtypes_through_profile_analyze_generate_patch(dtype, tmp_path):
    """fp64 / fp16 / bf16 / int / bool programs: each candidate is validated (or refused with its reason),
    patched, and the patched model matches eager."""
    model = Chains()
    x, b = _inputs(dtype)
    want = run(model, x, b)
    a, specs, records, h = fuse(model, lambda: (x, b), tmp_path)
    assert a.doc["candidates"], f"no candidate for {dtype}"
    for r in records:
        assert r.validated or r.reason, r
    run(model, x, b)
    assert_matches(run(model, x, b), want)
    assert any(h.sites(s.key) for s in specs), [(r.title, r.reason) for r in records]
    advisor.unpatch(model)
    assert all(torch.equal(g, w) for g, w in zip(run(model, x, b), want))


def test_zero_size_tensors(tmp_path):
    """Zero-size inputs: nothing to fuse when profiled so; a model patched at a real size and then called
    with zero-size inputs returns eager's (empty) results."""
    from advisor.codegen import generate, load_module
    from advisor.codegen.record import record_program
    from advisor.validate import validate

    model = Chains()
    empty = _inputs(torch.float32, (0, 33))
    a, specs, _, _ = fuse(model, lambda: empty, tmp_path / "empty")
    assert not specs and not a.doc["candidates"]
    advisor.unpatch(model)
    x, b = _inputs(torch.float32)
    fuse(model, lambda: (x, b), tmp_path / "full")
    run(model, x, b)
    for shape in ((0, 33), (6, 0)):
        xs = _inputs(torch.float32, shape)
        with advisor.patching.patches_off():
            want = run(model, *xs)
        got = run(model, *xs)
        assert all(g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want)), shape
    # and a program recorded at zero size generates and validates
    gen = generate(record_program(lambda x, b: torch.relu(x + b) * 2, *_inputs(torch.float32, (0, 33))))
    assert validate(gen, load_module(gen.path)).validated


class Strided(torch.nn.Module):
    def forward(self, xt, bias, s):
        return torch.tanh(xt * bias) + s, torch.softmax(xt + s, -1)


def _strided(rows=6, cols=10):
    g = torch.Generator().manual_seed(1)
    xt = torch.randn(cols, rows, generator=g).to(DEV).t()  # transposed
    bias = torch.randn(rows, 1, generator=g).to(DEV).expand(rows, cols)  # stride 0
    s = torch.randn(rows, cols + 3, generator=g).to(DEV)[:, 2:cols + 2]  # a slice: padded rows, an offset
    return xt, bias, s


def test_noncontiguous_and_expanded_inputs(tmp_path):
    model = Strided()
    xs = _strided()
    want = run(model, *xs)
    _, specs, records, h = fuse(model, lambda: xs, tmp_path)
    assert specs and all(r.validated for r in records), [(r.title, r.reason) for r in records]
    run(model, *xs)
    assert_matches(run(model, *xs), want)
    assert all(h.sites(s.key) for s in specs)
    # fresh inputs of the same structure (other values), and contiguous ones: guards decide, results stay right
    for other in (_strided(), tuple(t.contiguous() for t in _strided())):
        with advisor.patching.patches_off():
            ref = run(model, *other)
        assert_matches(run(model, *other), ref)


class InPlace(torch.nn.Module):
    """In-place ops on an input, on an aliasing view of an intermediate, and on a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("last", torch.zeros(6, 16))

    def forward(self, x, b):
        h = x + b
        v = h[:, :8]  # a view: writing it writes h
        v.mul_(2)
        x.mul_(0.5).add_(b)  # the caller's tensor changes
        self.last.copy_(torch.relu(h))
        return torch.sigmoid(h), v * 3


def test_inplace_ops_and_aliasing_views_keep_mutation_semantics(tmp_path):
    """Through generate + validate and through patching: outputs, the mutated input and the buffer all
    end as eager leaves them."""
    g = torch.Generator().manual_seed(2)
    x0, b = torch.randn(6, 16, generator=g).to(DEV), torch.randn(16, generator=g).to(DEV)
    model = InPlace().to(DEV)
    twin = copy.deepcopy(model)
    _, specs, records, h = fuse(model, lambda: (x0.clone(), b), tmp_path)
    assert specs, [(r.title, r.reason) for r in records]
    run(model, x0.clone(), b)
    xa, xb = x0.clone(), x0.clone()
    got, want = run(model, xa, b), run(twin, xb, b)
    assert sum(h.sites(s.key) for s in specs), [(s.title, h.rejected(s.key)) for s in specs]
    assert_matches(got, want)
    assert_matches((xa, model.last), (xb, twin.last))


def test_runtime_shapes_other_than_profiled(tmp_path):
    """Kernels patched at one shape, called at others: guards fall back or the kernel serves the new size;
    either way the results are eager's."""
    model = Chains()
    x, b = _inputs(torch.float32)
    _, specs, _, h = fuse(model, lambda: (x, b), tmp_path)
    assert specs
    run(model, x, b)
    for shape in ((3, 33), (6, 20), (1, 33), (2, 3, 33), (6, 1)):
        xs = _inputs(torch.float32, shape)
        with advisor.patching.patches_off():
            want = run(model, *xs)
        assert_matches(run(model, *xs), want)
    xs = tuple(t.double() for t in _inputs(torch.float32))  # another dtype: the original ops
    with advisor.patching.patches_off():
        want = run(model, *xs)
    assert all(torch.equal(g, w) for g, w in zip(run(model, *xs), want))


def _broken_sigmoid():
    from advisor.ops import lowering

    good = lowering.TABLE["aten::sigmoid"]
    return lowering.Lowering(good.op, good.kind, lambda a: f"tl.no_such_function({a.self})", good.promote,
                             good.operands, good.positive, good.shape, good.channel)


def test_kernel_that_fails_to_compile_is_skipped_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """One candidate's kernel does not compile: it is reported with the reason and not patched; the other
    candidate is generated, validated and patched; the model's outputs stay right."""
    from advisor.ops import lowering

    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path / "cache"))  # the broken module stays here
    monkeypatch.setitem(lowering.TABLE, "aten::sigmoid", _broken_sigmoid())
    model = Chains()
    x, b = _inputs(torch.float32)
    want = run(model, x, b)
    report = advisor.optimize(model, (x, b), out=tmp_path / "opt", interpret=True)
    cands = candidates_of(report.patterns, json.loads((report.out_dir / "analysis.json").read_text()))
    bad = [p for p, c in zip(report.patterns, cands) if "aten::sigmoid" in c["ops"]]  # the broken lowering's
    good = [p for p, c in zip(report.patterns, cands) if "aten::sigmoid" not in c["ops"]]
    assert bad and not any(p["patched"] for p in bad)
    assert all("failed to compile" in (p["reason"] or "") for p in bad), bad
    assert good and all(p["patched"] for p in good), good
    assert_matches(run(model, x, b), want)
    # `generate` on the same analysis: the run goes on past the broken kernel, exit 0
    code, out, err = cli(["generate", tmp_path / "opt", "--out", tmp_path / "gen"], capsys)
    assert code == 0, err
    doc = json.loads((tmp_path / "gen" / "apply.json").read_text())
    assert [p["validated"] for p in doc["patterns"]].count(True) == len(good)


# ========================================================================================= never harm
def _planted_relu():
    """relu lowered as abs: a wrong kernel that compiles and runs, so only validation can catch it."""
    from advisor.ops import lowering

    good = lowering.TABLE["aten::relu"]
    return lowering.Lowering(good.op, good.kind, lambda a: f"tl.abs({a.self})", good.promote, good.operands,
                             good.positive, good.shape, good.channel)


class Seed(torch.nn.Module):
    def forward(self, x, b):
        return torch.log(torch.relu(x + b) + 1.0) * 2


def test_a_kernel_that_failed_validation_is_never_applied(tmp_path, monkeypatch, capsys):
    from advisor.errors import AdvisorError
    from advisor.ops import lowering
    from advisor.patching import patched_modules

    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(lowering.TABLE, "aten::relu", _planted_relu())
    model = Seed()
    x, b = torch.randn(4, 300, device=DEV), torch.randn(300, device=DEV)
    want = run(model, x, b)
    report = advisor.optimize(model, (x, b), out=tmp_path / "opt", interpret=True)
    assert report.patterns and not report.applied, report.patterns
    assert all(not p["validated"] and "rel_l2" in (p["reason"] or "") for p in report.patterns), report.patterns
    assert not patched_modules(model) or not report.manifest
    assert torch.equal(run(model, x, b)[0], want[0])  # bit-identical: nothing of the wrong kernel ran
    kernel = Path(json.loads((tmp_path / "opt" / "apply.json").read_text())["patterns"][0]["kernel_file"])
    assert kernel.is_file() and "NOT validated" in kernel.read_text()  # written for reading, marked
    # The output directory cannot be patched into another model: it names no validated kernel.
    other = Seed()
    with pytest.raises(AdvisorError, match="no validated kernel"):
        advisor.patch(other, tmp_path / "opt")
    assert not patched_modules(other)
    # Nor by listing it in the manifest by hand: the pattern's record says it failed validation.
    doc = json.loads((tmp_path / "opt" / "apply.json").read_text())
    p = doc["patterns"][0]
    doc["manifest"] = [{"module": "Seed", "class": "Seed", "candidate": p["candidate"], "pattern_id": p["pattern_id"],
                        "title": p["title"], "replacement": "kernel", "kernel_file": str(kernel),
                        "guard_spec": {"device_type": DEV}}]
    (tmp_path / "opt" / "apply.json").write_text(json.dumps(doc))
    with pytest.raises(AdvisorError, match="not validated"):
        advisor.patch(other, tmp_path / "opt")
    assert not patched_modules(other)
    assert torch.equal(run(other, x, b)[0], want[0])


def snapshot(root: Path, skip: Path | None = None) -> dict:
    """path -> (sha256, size, mtime_ns) of every file under root (skipping one subtree)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(root))] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns)
        elif p.is_dir():
            out[str(p.relative_to(root)) + "/"] = None
    return out


USER_SCRIPT = """
import json, sys, torch
from helper import Block                      # a module of the user's, next to the script
cfg = json.load(open("config.json"))          # a data file, read relative to the working directory
x, b = torch.randn(cfg["n"]), torch.randn(cfg["n"])
m = Block()
for _ in range(3):
    m(x, b)
"""


def _user_dir(tmp_path: Path) -> Path:
    user = tmp_path / "user"
    user.mkdir()
    (user / "helper.py").write_text("import torch\nclass Block(torch.nn.Module):\n    def forward(self, x, b):\n"
                                    "        return torch.log(torch.relu(x + b) + 1.0) * 2\n")
    (user / "train.py").write_text(USER_SCRIPT)
    (user / "config.json").write_text('{"n": 4096}')
    return user


def _apply(user: Path, out: Path, cache: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "FUSION_ADVISOR_CACHE": str(cache), "TRITON_INTERPRET": "1"}  # the script runs on the CPU (--device cpu)
    return subprocess.Popen([sys.executable, "-m", "advisor", "apply", "train.py", "--out", str(out), "--device", "cpu",
                             *extra], cwd=user, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_apply_writes_only_under_out(tmp_path):
    """`fusion-advisor apply` run from the user's directory, with --out inside it: every file outside --out
    (the script, its module, its data) is byte-for-byte and mtime-for-mtime unchanged, no file appears
    beside them (no __pycache__ either), and --out holds only what apply writes."""
    user = _user_dir(tmp_path)
    before = snapshot(user)
    proc = _apply(user, user / "opt", tmp_path / "cache")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert snapshot(user, skip=user / "opt") == before
    written = {p.relative_to(user / "opt").parts[0] for p in (user / "opt").rglob("*")}
    assert written <= {"trace", "kernels", "analysis.json", "apply.json", "report.html", "report.txt"}, written
    doc = json.loads((user / "opt" / "apply.json").read_text())
    assert doc["manifest"] and all(str(user / "opt") in e["kernel_file"] for e in doc["manifest"])


def test_two_apply_runs_share_the_kernel_cache(tmp_path):
    """Two `apply` runs at once, one kernel cache: both succeed, and the cache ends with complete modules
    (no half-written file, no temporary left) identical to what one run alone writes."""
    user = _user_dir(tmp_path)
    cache = tmp_path / "shared-cache"
    procs = [_apply(user, tmp_path / f"out{k}", cache) for k in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    files = sorted((cache / "kernels").glob("*"))
    assert files and all(f.suffix == ".py" for f in files), files
    alone = tmp_path / "alone-cache"
    p = _apply(user, tmp_path / "out-alone", alone)
    assert p.communicate(timeout=300) and p.returncode == 0
    assert {f.name: f.read_text() for f in files} == {f.name: f.read_text() for f in (alone / "kernels").glob("*")}
    for k in range(2):
        doc = json.loads((tmp_path / f"out{k}" / "apply.json").read_text())
        assert any(r["patched"] for r in doc["patterns"]) and all(c["ok"] for c in doc["checks"])


def _generate_worker(args):
    """Generate every program many times into the shared cache; returns {key: code} as each run saw it."""
    cache, programs, barrier, rounds = args
    os.environ["FUSION_ADVISOR_CACHE"] = cache
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from advisor.codegen import generate

    barrier.wait()
    seen = {}
    for _ in range(rounds):
        for prog in programs:
            gen = generate(prog)
            assert seen.setdefault(gen.key, gen.code) == gen.code
    return seen


def _programs() -> list:
    from advisor.codegen.record import record_program

    F = torch.nn.functional
    fns = [lambda x, b: torch.log(torch.relu(x + b) + 1), lambda x, b: F.gelu(x * b, approximate="tanh"),
           lambda x, b: torch.softmax(x * 0.125 + b, -1), lambda x, b: F.layer_norm(x + b, x.shape[-1:]),
           lambda x, b: (x.sigmoid() * b).sum(-1), lambda x, b: torch.where(x > b, x, b * 2),
           lambda x, b: F.silu(x) * b, lambda x, b: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * b]
    x, b = torch.randn(4, 24), torch.randn(24)
    progs = [record_program(f, x, b) for f in fns]
    return progs + [record_program(f, x.bfloat16(), b.bfloat16()) for f in fns]


def test_concurrent_generation_into_one_cache(tmp_path):
    """Two processes generating the same 16 patterns into one cache at the same moment, over and over:
    every file ends complete, loadable and identical to what each process generated, with no temporary
    file left behind (writes are a temporary file, then an atomic rename)."""
    from advisor.codegen import generate, load_module

    cache = tmp_path / "cache"
    progs = _programs()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Manager().Barrier(2)
    with ctx.Pool(2) as pool:
        seen = pool.map(_generate_worker, [(str(cache), progs, barrier, 6)] * 2)
    assert seen[0] == seen[1] and len(seen[0]) == len(progs)
    files = {f.stem: f for f in (cache / "kernels").iterdir()}
    assert set(files) == set(seen[0]), sorted(files)  # no .tmp leftovers, nothing else
    for key, code in seen[0].items():
        assert files[key].read_text() == code
        mod = load_module(files[key], f"concurrent_{key}")
        assert callable(mod.run)
    # a third generation in this process reads them from the cache, as they are
    os.environ["FUSION_ADVISOR_CACHE"] = str(cache)
    again = [generate(p) for p in progs]
    assert all(g.cached and g.code == seen[0][g.key] for g in again)


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.lin = torch.nn.Linear(32, 32)
        self.register_buffer("scale", torch.full((32,), 0.5))

    def forward(self, x):
        h = self.norm(x + 1.0)
        return torch.nn.functional.gelu(self.lin(h)) * self.scale + h


def launched(model) -> int:
    """Kernel launches so far at every site patched into `model`."""
    from advisor.patching import patched_modules

    logs = {id(f.log()): f.log() for _, f in patched_modules(model)}
    return sum(site.stats["launched"] for log in logs.values() for sites in log.sites.values() for site in sites)


@pytest.fixture(scope="module")
def optimized_small(tmp_path_factory):
    torch.manual_seed(0)
    model = Small().eval().to(DEV)
    x = torch.randn(4, 7, 32, device=DEV)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: (id(p), p.requires_grad) for n, p in model.named_parameters()}
    ref = run(model, x)[0]
    report = advisor.optimize(model, (x,), out=tmp_path_factory.mktemp("small"), interpret=True)
    assert report.applied, report.patterns
    return model, x, ref, state, params, report


def test_unpatch_restores_bit_identical_outputs_and_state_dict(optimized_small):
    """After optimize() with generated kernels: unpatch gives eager's outputs bit for bit, and the
    state_dict (keys, dtypes, values), the parameter objects and the modules are as they were."""
    from advisor.patching import patched_modules

    model, x, ref, state, params, _ = optimized_small
    twin = copy.deepcopy(model)
    assert run(twin, x)[0].shape == ref.shape
    advisor.unpatch(twin)
    assert not patched_modules(twin)
    assert all("forward" not in m.__dict__ for m in twin.modules())
    assert torch.equal(run(twin, x)[0], ref)
    after = twin.state_dict()
    assert list(after) == list(state)
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in state.items())
    assert {n: p.requires_grad for n, p in twin.named_parameters()} == {n: g for n, (_, g) in params.items()}
    # and on the model optimize() patched itself: the parameters are the very same objects
    assert {n: id(p) for n, p in model.named_parameters()} == {n: i for n, (i, _) in params.items()}


def test_patched_model_with_kernels_survives_weights_save_to_copy_and_modes(optimized_small, tmp_path):
    model, x, ref, state, _, report = optimized_small
    model = copy.deepcopy(model)  # a patched copy (the fixture's model stays as it is)
    assert report.applied
    twin = Small().eval().to(DEV)

    # new weights: the capture must read them, not the ones it was made with
    new = {k: v + 0.1 * torch.randn_like(v) for k, v in state.items()}
    model.load_state_dict(new)
    twin.load_state_dict(new)
    before = launched(model)
    assert_matches(run(model, x), run(twin, x))
    assert launched(model) > before  # the kernels ran (not the fallback)
    # a state_dict saved and loaded back
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    model.load_state_dict(torch.load(buf))
    assert_matches(run(model, x), run(twin, x))
    # deepcopy and pickle of the patched model
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert_matches(run(clone, x), run(twin, x))
    # another dtype: outside the validated guard, the original ops run (bit-identical to eager)
    model.to(torch.float64)
    twin.to(torch.float64)
    assert torch.equal(run(model, x.double())[0], run(twin, x.double())[0])
    model.to(torch.float32)
    twin.to(torch.float32)
    assert_matches(run(model, x), run(twin, x))
    # train mode and autograd: outputs and gradients as eager's
    model.train()
    twin.train()
    out, want = model(x), twin(x)
    assert_matches((out.detach(),), (want.detach(),))
    out.pow(2).mean().backward()
    want.pow(2).mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)
    model.eval()
    twin.eval()
    assert_matches(run(model, x), run(twin, x))

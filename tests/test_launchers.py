"""Triton's kernel launchers built ahead (`advisor/validate/launchers.py`): the signatures a validation will
launch are found from its kernel's own launch code on meta tensors, with nothing compiled or launched, and each
distinct one is built once. This CPU has no CUDA driver: a stand-in answers what Triton's JIT asks of one."""
import threading

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
import triton.experimental.gluon  # noqa: F401  (its import asserts what the interpreter made of Triton: done while conftest has it on)

from advisor.codegen import generate, load_module
from advisor.codegen.record import record_program
from advisor.validate import launch_signatures, launchers
from advisor.validate.shapes import cases


class Driver:
    """What `JITFunction.run` asks of the active driver before it compiles; records the launchers made."""

    def __init__(self, fail=()):
        self.made, self.fail = [], fail

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("meta")

    def map_python_to_cpp_type(self, ty):
        return ty

    def launcher_cls(self, src, metadata):
        if src.fn.__name__ in self.fail:
            raise RuntimeError("gcc failed")
        self.made.append((src.fn.__name__, dict(src.signature), dict(src.constants)))


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path / "kernel-cache"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # real JIT functions, not the interpreter's
    d = Driver()
    monkeypatch.setattr(driver, "_active", d)
    return d


def _kernel(fn, *shapes):
    prog = record_program(fn, *[torch.randn(s) for s in shapes])
    gen = generate(prog, use_cache=False)
    return gen, load_module(gen.path)


def test_each_validation_case_gives_its_signature_without_compiling(stand_in):
    gen, module = _kernel(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, (4, 32, 96), (96,))
    found = launch_signatures(gen, module)
    names = [c.name for c in cases(gen.program, False)]
    assert names == ["recorded", "odd", "ones"] and len(found) == 3, found
    (rec_fn, rec, _, _), (odd_fn, odd, _, _), (_, ones, ones_consts, _) = found
    assert rec == odd and rec_fn is odd_fn  # one launcher serves both
    assert rec != ones and any(v == 1 for v in ones_consts.values())  # sizes of 1 are made constants
    assert all(t.startswith("*fp32") for n, t in rec.items() if n.endswith("_ptr"))
    for jit in {id(f.fn): f.fn for f in found}.values():  # nothing compiled: no kernel in any JIT cache
        assert all(not caches[0] for caches in jit.device_caches.values())


def test_collecting_leaves_other_threads_launches_to_the_hook_before(stand_in, monkeypatch):
    from triton import knobs

    gen, module = _kernel(lambda x, b: torch.log(torch.relu(x + b)), (3000,), (3000,))
    seen = []

    def theirs(**kw):
        seen.append(threading.current_thread().name)
        return True  # (skips the compile: this CPU cannot)

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", theirs)
    x = torch.empty(3000, device="meta")
    with launchers.collecting() as found:
        other = threading.Thread(target=module.run, args=(x, x), name="other")
        other.start()
        other.join()
        module.run(x, x)
    assert seen == ["other"] and len(found) == 1
    assert knobs.runtime.jit_cache_hook is theirs  # put back


def test_build_makes_each_distinct_launcher_once(stand_in, monkeypatch):
    monkeypatch.setattr(launchers, "per_signature", lambda: True)  # Triton 3.6's per-signature launchers
    gen, module = _kernel(lambda x, b: torch.log(torch.relu(x + b)), (3000,), (3000,))
    found = launch_signatures(gen, module)
    assert launchers.build(found + found) == len({tuple(f.signature.items()) for f in found}) == 2
    recorded, ones = sorted((c for _, _, c in stand_in.made), key=len)
    assert set(recorded) < set(ones)  # the all-ones case's sizes are constants too
    fn = found[0][0]
    described = [launchers.Launch(fn, {"a": "tensordesc<fp32[16, 16]>"}, {}, None)]  # its launcher depends on how it compiles
    assert launchers.build(described) == 0
    stand_in.fail = (fn.__name__,)
    stand_in.made.clear()
    assert launchers.build(found) == 0 and stand_in.made == []  # a failure is left to the launch


def test_nothing_is_built_where_triton_has_one_launcher_for_all(stand_in, monkeypatch):
    monkeypatch.setattr(launchers, "per_signature", lambda: False)
    gen, module = _kernel(lambda x, b: torch.log(torch.relu(x + b)), (3000,), (3000,))
    assert launchers.build(launch_signatures(gen, module)) == 0 and stand_in.made == []


def test_the_launchers_of_a_real_models_candidates_are_built_before_their_jobs(stand_in, monkeypatch):
    """The H100 Llama trace's candidates, as `generate` hands them to its jobs: every kernel that generates has
    its validation's launchers built (in the order of its cases), and nothing is compiled."""
    from pathlib import Path

    from advisor.analysis.api import analyze
    from advisor.records import candidates_of
    from advisor.workflows import generate as gen_stage

    monkeypatch.setattr(launchers, "per_signature", lambda: True)
    doc = analyze(Path(__file__).resolve().parents[1] / "sample_traces" / "hf_llama" / "trace").doc
    chosen = [c for c in candidates_of(doc) if gen_stage.skip_reason(c) is None]
    assert gen_stage._build_launchers(chosen) == len({(n, tuple(s.items())) for n, s, _ in stand_in.made}) > 0
    kernels = {n for n, _, _ in stand_in.made}
    for c in chosen:
        if not c.kind.anchored:  # a row or pointwise kernel: one launcher at least, its own
            source = generate(c.program).code
            assert any(f"def {name}(" in source for name in kernels), c.title


def test_collections_in_two_threads_share_one_hook(stand_in, monkeypatch):
    """Two threads collecting at once (two `optimize` calls): the first to finish does not take the hook out
    from under the other, whose launches would then compile and launch on meta tensors; the last puts back
    the hook installed before."""
    from triton import knobs

    gen, module = _kernel(lambda x, b: torch.log(torch.relu(x + b)), (3000,), (3000,))
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    x = torch.empty(3000, device="meta")
    inside, finished, results = threading.Event(), threading.Event(), {}

    def second():
        with launchers.collecting() as found:
            inside.set()
            finished.wait(10)  # the first thread's collection has ended meanwhile
            module.run(x, x)
        results["second"] = found

    t = threading.Thread(target=second)
    with launchers.collecting() as first:
        t.start()
        inside.wait(10)
        module.run(x, x)
    finished.set()
    t.join(10)
    assert len(first) == 1 and len(results["second"]) == 1
    assert knobs.runtime.jit_cache_hook is None


def test_a_validations_kernels_compile_at_once_in_threads_and_its_launches_wait_for_them(stand_in, monkeypatch):
    """Its cases' two distinct kernels (recorded = odd, all-ones) compile each once, both at the same time (a
    barrier of two), in the threads `compiling` started, not in this one; a launch inside (of one of them) is
    handed the compile under way instead of starting its own. (Triton's compile itself is stood in for: after
    the interpreter has run in this process, Triton's language module is patched for it.)"""
    import types

    gen, module = _kernel(lambda x, b: torch.log(torch.relu(x + b)), (3000,), (3000,))
    found = launch_signatures(gen, module)
    fn = found[0].fn
    compiled_in, both = [], threading.Barrier(2, timeout=10)

    def compile_(src, target=None, options=None, **_):
        compiled_in.append(threading.current_thread().name)
        both.wait()  # the other compile is under way at the same time
        return types.SimpleNamespace(constants=dict(src.constants))

    monkeypatch.setattr(fn, "compile", compile_)
    x = torch.empty(3000, device="meta")
    with launchers.compiling(found + found) as started:
        assert started == 2
        with pytest.raises(AttributeError):  # handed the stand-in kernel, which cannot launch
            module.run(x, x)
    assert len(compiled_in) == 2 and all(t.startswith("fusion-advisor-compile") for t in compiled_in), compiled_in
    kernels = list(fn.device_caches[0][0].values())
    assert len(kernels) == 2 and sorted(len(k.constants) for k in kernels)[0] < max(len(k.constants) for k in kernels)


def test_compiling_starts_nothing_it_cannot_describe_or_inside_another_async_mode(stand_in):
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    gen, module = _kernel(lambda x, b: torch.log(torch.relu(x + b)), (3000,), (3000,))
    found = launch_signatures(gen, module)
    with launchers.compiling([f._replace(specialization=None) for f in found]) as started:
        assert started == 0
    with ThreadPoolExecutor(1) as pool, AsyncCompileMode(pool), launchers.compiling(found) as started:
        assert started == 0  # the caller's own mode is left alone
    assert all(not caches[0] for caches in found[0].fn.device_caches.values())

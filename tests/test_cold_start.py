"""Cold start (issue 17): kernels generated in worker processes, and portable plan bundles.

Real pipeline throughout: a tiny model optimised under Triton's interpreter, its analysis generated
in process and in spawned workers, its plan bundled and patched from the bundle in a fresh process.
"""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import advisor
from advisor.workflows import bundle, generate

ROOT = Path(__file__).resolve().parents[1]

MODEL = '''
import torch
class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 32)
        self.norm = torch.nn.LayerNorm(32)
    def forward(self, x, b):
        h = self.lin(x)
        h = torch.sigmoid(h + b) * h  # a pointwise chain, then a matmul between it and
        h = self.out(h)
        return self.norm(torch.relu(h * 2.0 + x))  # a residual + LayerNorm chain: two kernels
def build():
    torch.manual_seed(0)
    return Tiny().eval(), (torch.randn(8, 32), torch.randn(32))
'''


def _tiny():
    ns: dict = {}
    exec(MODEL, ns)
    return ns["build"]()


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    out = tmp_path_factory.mktemp("opt")
    model, inputs = _tiny()
    report = advisor.optimize(model, inputs, top=4, out=out, reuse=False, interpret=True)
    assert report.applied, str(report)
    advisor.unpatch(model)
    return report


def _comparable(doc: dict) -> list:
    """apply.json records without what legitimately differs between two runs: where files were written,
    and how long each step took."""
    return [{k: v for k, v in p.items() if k not in ("kernel_file", "cached", "seconds")} for p in doc["patterns"]]


def test_workers_generate_what_one_process_does(optimized, tmp_path, monkeypatch):
    """The same candidates generated in two spawned workers and in process: the same kernels, the same
    validation records, in the same order."""
    from advisor.workflows import workers
    from advisor.workflows.generate import generate_candidates, warm_worker

    doc = json.loads((optimized.out_dir / "analysis.json").read_text())
    assert len(doc["candidates"][:4]) >= 2  # one job would not ask for workers
    monkeypatch.setenv(workers.ENV, "0")
    serial = generate_candidates(doc, tmp_path / "serial", top=4)
    monkeypatch.setenv(workers.ENV, "2")
    pool = workers.start(2, warm_worker)
    assert pool is not None
    pids = set(pool.map(workers._ready, range(8)))
    assert os.getpid() not in pids and len(pids) <= 2
    monkeypatch.setattr(workers, "discard", lambda: None)  # kept, to see who worked
    jobs = []
    real_map = pool.map
    monkeypatch.setattr(pool, "map", lambda fn, *its: jobs.append(fn.__name__) or real_map(fn, *its))
    parallel = generate_candidates(doc, tmp_path / "parallel", top=4)
    monkeypatch.undo()
    workers.discard()
    assert jobs == ["_job"]
    assert sum(p["validated"] for p in serial["patterns"]) >= 2
    assert _comparable(parallel) == _comparable(serial)
    for p in parallel["patterns"]:
        if p["kernel_file"]:
            assert Path(p["kernel_file"]).parent == tmp_path / "parallel" / "kernels"


def test_bundle_patches_a_fresh_process_without_generating(optimized, tmp_path):
    """save_bundle -> a new process patches from the file alone: nothing profiled, generated, validated or
    lowered by AOTAutograd (the bundle's graphs are rebuilt), outputs equal to the unpatched model's."""
    path = advisor.save_bundle(optimized, tmp_path / "plan.fab")
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        header = json.loads(z.read("header.json"))
    assert {"header.json", "plan/analysis.json", "plan/apply.json"} <= names
    assert any(n.startswith("plan/kernels/") for n in names)
    assert any(n.startswith("graphs/") for n in names), "the captures' lowered graphs (aot_cache)"
    assert header["torch"] == torch.__version__ and header["binaries"] == []  # interpreter: no binaries
    code = MODEL + f'''
import json, advisor
import advisor.validate, advisor.workflows.generate as g, advisor.workflows.live_model as lm
import torch._functorch.aot_autograd as aot
calls = []
for mod, name in ((g, "_job"), (g, "generate_results"), (advisor.validate, "validate"), (lm, "profile_calls"),
                  (aot, "aot_module_simplified")):
    f = getattr(mod, name)
    setattr(mod, name, lambda *a, _f=f, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
model, (x, b) = build()
with torch.no_grad():
    want = model(x, b)
    handle = advisor.patch(model, {str(path)!r})
    got = model(x, b)
print(json.dumps({{"calls": calls, "patched": len(handle.manifest()), "err": (got - want).abs().max().item(),
                   "kernels": sorted(advisor.workflows.bundle.kernel_names(advisor.workflows.bundle.load({str(path)!r})))}}))
'''
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FUSION_ADVISOR_CACHE": str(tmp_path / "fresh-cache")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["calls"] == [] and res["patched"] >= 1, res
    assert res["err"] < 1e-4, res
    assert res["kernels"], res


def test_binaries_install_only_where_built_alike(optimized, tmp_path, monkeypatch, capsys, caplog):
    """A bundle's Triton cache entries go into Triton's cache when torch, triton and the GPU match the
    header, and stay out (one line saying why) when they do not."""
    names = bundle.kernel_names(optimized.out_dir)
    assert names
    built = tmp_path / "built"
    entry = built / "ENTRYKEY"
    entry.mkdir(parents=True)
    (entry / f"__grp__{sorted(names)[0]}.json").write_text("{}")
    (entry / f"{sorted(names)[0]}.cubin").write_bytes(b"\x7fELF")
    (built / "OTHER").mkdir()
    (built / "OTHER" / "__grp__unrelated_kernel.json").write_text("{}")
    assert bundle.binary_entries(names, built) == [entry]
    here = {**bundle.environment(), "gpu": "NVIDIA H100 80GB HBM3", "capability": [9, 0]}
    monkeypatch.setattr(bundle, "environment", lambda: dict(here))
    monkeypatch.setattr(bundle, "triton_cache_root", lambda: built)
    path = bundle.save(optimized.out_dir, tmp_path / "plan.fab")
    with zipfile.ZipFile(path) as z:
        assert json.loads(z.read("header.json"))["binaries"] == ["ENTRYKEY"]
    target = tmp_path / "triton-here"
    monkeypatch.setattr(bundle, "triton_cache_root", lambda: target)
    bundle.load(path, tmp_path / "plan-a")
    assert (target / "ENTRYKEY" / f"{sorted(names)[0]}.cubin").read_bytes() == b"\x7fELF"
    assert not list(target.glob(".*"))  # no temporary folder left behind
    shutil_target = tmp_path / "triton-elsewhere"
    monkeypatch.setattr(bundle, "triton_cache_root", lambda: shutil_target)
    here["gpu"] = "NVIDIA A100"
    capsys.readouterr()
    caplog.clear()
    plan = bundle.load(path, tmp_path / "plan-b")
    # a warning of the `advisor` loggers: on stderr where logging is not configured, in caplog under pytest
    err = capsys.readouterr().err.strip().splitlines() + [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert len(err) == 1 and "NVIDIA A100" in err[0] and "compile on first use" in err[0]
    assert not shutil_target.exists() and (plan / "apply.json").is_file()
    applied = json.loads((plan / "apply.json").read_text())
    files = [p["kernel_file"] for p in applied["patterns"] if p.get("kernel_file")]
    assert files and all(Path(f).parent == plan.resolve() / "kernels" and Path(f).is_file() for f in files)


def test_bundle_carries_the_host_modules_this_process_loaded(optimized, tmp_path, monkeypatch):
    """Triton's kernel launchers and CUDA utilities are shared objects gcc builds into Triton's cache on
    first use: those this process loaded from it (its memory map) go into apply.json and the bundle, and
    load installs them; one it never loaded stays out."""
    import importlib.util
    import shutil
    import sysconfig
    import _statistics

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    built = tmp_path / "built"
    for entry in ("LAUNCHERKEY", "UNUSEDKEY"):
        (built / entry).mkdir(parents=True)
        shutil.copy(_statistics.__file__, built / entry / f"_statistics{suffix}")
    assert bundle.loaded_host_modules(built) == []
    spec = importlib.util.spec_from_file_location("_statistics", built / "LAUNCHERKEY" / f"_statistics{suffix}")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # as Triton loads a module it built
    assert bundle.loaded_host_modules(built) == ["LAUNCHERKEY"]
    assert bundle.loaded_host_modules(built, tmp_path / "no-maps") == []

    here = {**bundle.environment(), "gpu": "NVIDIA H100 80GB HBM3", "capability": [9, 0]}
    monkeypatch.setattr(bundle, "environment", lambda: dict(here))
    monkeypatch.setattr(bundle, "triton_cache_root", lambda: built)
    plan = tmp_path / "plan"
    shutil.copytree(optimized.out_dir, plan)
    applied = json.loads((plan / "apply.json").read_text())
    assert applied["host_modules"] == []  # the interpreter's run loads none
    applied["host_modules"] = ["RECORDEDKEY", "../escape"]  # what the plan's own run loaded, elsewhere
    (plan / "apply.json").write_text(json.dumps(applied))
    (built / "RECORDEDKEY").mkdir()
    (built / "RECORDEDKEY" / f"__triton_launcher{suffix}").write_bytes(b"\x7fELF")
    path = bundle.save(plan, tmp_path / "plan.fab")
    with zipfile.ZipFile(path) as z:
        assert json.loads(z.read("header.json"))["host_modules"] == ["LAUNCHERKEY", "RECORDEDKEY"]
    target = tmp_path / "triton-here"
    monkeypatch.setattr(bundle, "triton_cache_root", lambda: target)
    bundle.load(path, tmp_path / "plan-a")
    assert sorted(p.name for p in target.iterdir()) == ["LAUNCHERKEY", "RECORDEDKEY"]
    assert (target / "RECORDEDKEY" / f"__triton_launcher{suffix}").read_bytes() == b"\x7fELF"


def test_bundle_cli(optimized, tmp_path):
    from advisor.cli import main

    ok = subprocess.run([sys.executable, "-m", "advisor", "bundle", str(optimized.out_dir), "-o", str(tmp_path / "p.fab")],
                        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert ok.returncode == 0 and "p.fab" in ok.stdout, ok.stderr
    with pytest.raises(SystemExit) as e:
        main(["bundle", str(tmp_path), "-o", str(tmp_path / "q.fab")])
    assert e.value.code == 2 and not (tmp_path / "q.fab").exists()
    assert not bundle.is_bundle(tmp_path / "p.fab.missing") and bundle.is_bundle(tmp_path / "p.fab")


def test_a_tuned_kernels_compiles_run_ahead_of_its_job_and_the_others_meanwhile(tmp_path, monkeypatch):
    """Issue 17: the tile configs a candidate's validation would compile one after another go to the pool
    first; its job starts once they are done, while the other candidates' jobs need not wait."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from advisor.workflows import generate

    events, lock = [], threading.Lock()

    def log(what):
        with lock:
            events.append(what)

    def ahead(c, job):
        time.sleep(0.2)
        log(f"compiled {c} {job}")

    monkeypatch.setattr(generate, "_ahead_jobs", lambda c: [("recorded", 0), ("recorded", 1)] if c == "tuned" else [])
    monkeypatch.setattr(generate, "_compile_ahead", ahead)
    monkeypatch.setattr(generate, "_job", lambda c, out: log(f"job {c}") or f"record {c}")
    with ThreadPoolExecutor(2) as pool:
        records = generate._pooled(pool, ["tuned", "plain"], tmp_path)
    assert records == ["record tuned", "record plain"]  # in the candidates' order
    assert events.index("job plain") < events.index("compiled tuned ('recorded', 1)")  # did not wait
    assert events.index("job tuned") > max(events.index("compiled tuned ('recorded', 0)"),
                                           events.index("compiled tuned ('recorded', 1)"))


def test_workers_that_cannot_start_fall_back_in_one_line(optimized, tmp_path, monkeypatch, capsys, caplog):
    from advisor.workflows import workers
    from advisor.workflows.generate import generate_candidates

    def refuse(n, warm=None):
        raise OSError("no processes here")

    monkeypatch.setenv(workers.ENV, "2")
    monkeypatch.setattr(workers, "start", refuse)
    doc = json.loads((optimized.out_dir / "analysis.json").read_text())
    assert len(doc["candidates"]) >= 2  # one job would not ask for workers
    done = generate_candidates(doc, tmp_path / "g", top=4)
    # a warning of the `advisor` loggers: on stderr where logging is not configured, in caplog under pytest
    err = capsys.readouterr().err.strip().splitlines() + [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert len(err) == 1 and "compile workers unavailable" in err[0] and "no processes here" in err[0], err
    assert any(p["validated"] for p in done["patterns"])


def test_jobs_done_here_sooner_than_the_workers_start_do_not_wait_for_them(optimized, tmp_path, monkeypatch):
    """On a GPU, two kernels' jobs are done in this process (about 1 s together on the H100) rather than wait
    3-4 s for the compile workers to import torch; three go to the workers; a count the user set in
    $FUSION_ADVISOR_COMPILE_WORKERS is used however few the jobs."""
    from advisor.records import candidates_of
    from advisor.workflows import workers

    [c] = [c for c in candidates_of(json.loads((optimized.out_dir / "analysis.json").read_text()))
           if generate.skip_reason(c) is None][:1]
    started = []
    monkeypatch.delenv(workers.ENV, raising=False)
    monkeypatch.setattr(generate, "interpreted", lambda: False)  # as on a GPU
    monkeypatch.setattr(workers, "_cpus", lambda: 16)
    monkeypatch.setattr(workers, "start", lambda n, warm=None: started.append(n))  # no pool: the caller works here
    monkeypatch.setattr(workers, "discard", lambda: None)
    monkeypatch.setattr(workers, "discard_soon", lambda: started.append("let go"))
    assert generate._in_workers([c, c], tmp_path) is None and started == ["let go"]
    started.clear()
    assert generate._in_workers([c, c, c], tmp_path) is None and started == [3]
    started.clear()
    monkeypatch.setenv(workers.ENV, "2")
    assert generate._in_workers([c, c], tmp_path) is None and started == [2]


def test_only_a_compile_workers_jobs_compile_their_kernels_in_threads(optimized, tmp_path, monkeypatch):
    """A job in `optimize`'s own process runs while the model is captured, whose dynamo trace the compiles'
    Python front end would slow: it validates as before. A compile worker (its start-up, `warm_worker`, ran)
    has nothing else to do: its jobs start their validation's compiles at once (`launchers.compiling`)."""
    from advisor.records import candidates_of

    [c] = [c for c in candidates_of(json.loads((optimized.out_dir / "analysis.json").read_text()))
           if generate.skip_reason(c) is None][:1]
    seen, real = [], generate.validate

    def spy(gen, module, **kw):
        seen.append(kw.get("compile_at_once", False))
        return real(gen, module, **kw)

    monkeypatch.setattr(generate, "validate", spy)
    monkeypatch.setattr(generate, "_IN_WORKER", [False])  # (a worker's flag, set below, goes with the test)
    assert generate._job(c, tmp_path).validated
    monkeypatch.setattr(generate.triton_setup, "start", lambda: None)
    generate.warm_worker()  # as each compile worker starts
    assert generate._job(c, tmp_path).validated
    assert seen == [False, True]


@pytest.mark.parametrize("jobs", [0, 1])
def test_a_generate_of_under_two_jobs_lets_the_starting_pool_go_without_waiting(optimized, tmp_path, monkeypatch, jobs):
    """`optimize` starts the compile workers before profiling; a generate with no job (every candidate not worth
    patching: the MLP block) or one (done in process) neither waits for them to finish starting (4.9 s of the
    MLP block's 5.2 s warm `optimize` on the H100) nor leaves them, each with a CUDA context, alive until exit."""
    import threading

    from advisor.records import candidates_of
    from advisor.workflows import workers
    from advisor.workflows.generate import generate_results

    monkeypatch.setenv(workers.ENV, "2")
    monkeypatch.setattr(_FakePool, "shut", 0)
    monkeypatch.setattr(workers, "_let_go", False)  # restored after: a later start_soon's pool is not let go
    starting = threading.Event()
    release = threading.Event()

    def slow_start(n, warm=None):  # a start still under way: the pool's lock held, as while workers spawn
        with workers._lock:
            starting.set()
            release.wait(30)
            workers._pool, workers._size = _FakePool(), n

    monkeypatch.setattr(workers, "start", slow_start)
    background = threading.Thread(target=workers._start_quietly, args=(2, None))
    background.start()
    assert starting.wait(10)
    cands = candidates_of(json.loads((optimized.out_dir / "analysis.json").read_text()))[:jobs]
    results = generate_results(cands, tmp_path / "g")  # returns while the start is still under way
    assert len(results) == jobs and workers._lock.locked()  # the start still under way: it did not wait
    release.set()
    background.join(10)
    for t in [t for t in threading.enumerate() if t.name == "fusion-advisor-workers-discard"]:
        t.join(10)
    assert workers._pool is None and _FakePool.shut == 1  # let go once started, not kept to exit


def test_a_pool_let_go_before_its_start_began_goes_once_started(monkeypatch):
    from advisor.workflows import workers

    def fake_start(n, warm=None):
        with workers._lock:
            workers._pool, workers._size = _FakePool(), n

    monkeypatch.setattr(workers, "start", fake_start)
    monkeypatch.setattr(_FakePool, "shut", 0)
    monkeypatch.setattr(workers, "_let_go", False)
    workers.discard_soon()  # before the background start took the lock: nothing to drop yet
    workers._start_quietly(2, None)
    assert workers._pool is None and _FakePool.shut == 1


class _FakePool:
    shut = 0

    def shutdown(self, wait=True, cancel_futures=False):
        _FakePool.shut += 1


def test_layers_of_one_class_capture_once(tmp_path):
    """Issue 17: the first patched call traced every layer with dynamo (each instance its own compiled
    function). Instances of one class with one plan now share their class's capture: four BERT layers
    cost one trace per patched class, and each layer still launches its own sites, bit for bit."""
    sys.path.insert(0, str(Path(__file__).parent))
    from candidates import RESIDUAL_LAYERNORM  # noqa: E402
    from test_patch import inputs, plan_for, run, tiny  # noqa: E402

    from advisor.analysis.api import analyze
    from advisor.collect.in_process import profile_calls
    from advisor.patching import patch, patched_modules, timing

    model, kw = tiny("bert", layers=4)
    x = inputs("bert")
    ref = run(model, kw, x)
    a = analyze(profile_calls(lambda: run(model, kw, x), tmp_path, "cpu", calls=1))
    plan, specs = plan_for(a, [RESIDUAL_LAYERNORM], "program")
    seen = []  # a hook one layer had before patching: the class's capture (traced without it) must not serve it
    model.encoder.layer[2].output.dense.register_forward_hook(lambda *_: seen.append(1))
    h = patch(model, plan)
    classes = {type(m).__name__ for _, m in [(q, f.module) for q, f in patched_modules(model)]}
    assert len(patched_modules(model)) == 9 and classes == {"BertEmbeddings", "BertSelfOutput", "BertOutput"}
    before, launches = timing.snapshot(), h.launches()
    out = run(model, kw, x)
    spent = timing.since(before)
    # one per class (and one for the hooked layer), not one per instance (9); fewer where an earlier test in
    # this process left a capture of these classes with this plan that serves them
    assert spent.get("captures", 0) <= 4, spent
    assert torch.equal(out, ref) and seen == [1]
    mine = {id(f) for f in h.forwards.values()}
    ran = {caller for (site, caller), n in h.launches().items()
           if caller in mine and n > launches.get((site, caller), 0)}
    assert len(ran) == 9, "every patched instance ran the fused sites, served by its class's capture"
    assert not h.fallbacks(), h.fallbacks()
    # Train mode changes what dynamo guards on: the eval-mode captures refuse the layer, which captures anew (a
    # new shared capture of its class, owned by it)
    model.encoder.layer[1].train()
    with torch.no_grad():
        model(**x, **kw)
    assert any(f._via is None and f._owns is not None for q, f in patched_modules(model)
               if q.startswith("encoder.layer.1"))
    model.eval()
    assert torch.equal(run(model, kw, x), ref)


def test_blocks_of_one_class_and_several_shapes_trace_once_per_shape(tmp_path):
    """ResNet-50's sixteen bottleneck blocks are eight graphs (each stage's first block, its other blocks): the
    class's first capture refuses the other shapes, and each instance it refused used to trace on its own (16
    traces on the H100's ResNet-50, dynamo 5 s of its cold start). An instance every shared capture refuses
    now owns a new one that the blocks like it join: one trace per graph, each block's own outputs."""
    from torch import nn

    from advisor.patching import patched_modules, timing

    sys.path.insert(0, str(Path(__file__).parent))
    from test_shape_variants import Bottleneck  # noqa: E402  (torchvision's, which stays out of CI)

    class ResNet(nn.Module):  # ResNet-50's stages: 3, 4, 6 and 3 blocks, each stage's first one downsampling
        def __init__(self, w=8):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w), nn.ReLU())
            cin = w
            for i, n in enumerate((3, 4, 6, 3)):  # layer1..layer4, called one after the other
                mid = w * 2 ** i
                setattr(self, f"layer{i + 1}", nn.Sequential(Bottleneck(cin, mid, 1 if i == 0 else 2),
                                                             *[Bottleneck(mid * 4, mid) for _ in range(n - 1)]))
                cin = mid * 4

        def forward(self, x):
            return self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x))))).mean((2, 3))

    torch.manual_seed(0)
    model, x = ResNet().eval(), torch.randn(2, 3, 64, 64)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):  # statistics that are not the identity
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    with torch.no_grad():
        want = model(x)
    before = timing.snapshot()
    advisor.optimize(model, (x,), out=tmp_path / "out", interpret=True, reuse=False)
    blocks = [f for q, f in patched_modules(model) if q.startswith("layer")]
    assert len(blocks) == 16, [q for q, _ in patched_modules(model)]
    assert timing.since(before).get("captures") == 8, timing.since(before)
    assert sum(f._owns is not None for f in blocks) == 8 and sum(f._via is not None for f in blocks) == 8
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-4)
    assert not any(f.fallbacks for f in blocks)


def test_a_failed_substitution_is_rolled_back(tmp_path, monkeypatch):
    """The rewrite copies the graph only before a pattern's first substitution (not before every pattern):
    a substitution that changes the graph and then fails is still put back whole."""
    sys.path.insert(0, str(Path(__file__).parent))
    from candidates import RESIDUAL_LAYERNORM  # noqa: E402
    from test_patch import inputs, plan_for, run, tiny  # noqa: E402

    from advisor.analysis.api import analyze
    from advisor.collect.in_process import profile_calls
    from advisor.patching import capture, forward, patch, rewrite

    model, kw = tiny("bert", layers=1)
    x = inputs("bert", seq=12)  # shapes no other test captured: a fresh rewrite
    ref = run(model, kw, x)
    a = analyze(profile_calls(lambda: run(model, kw, x), tmp_path, "cpu", calls=1))
    plan, specs = plan_for(a, [RESIDUAL_LAYERNORM], "program")
    real = rewrite.substitute

    def half_done(graph, m, pattern, make_site):  # corrupts the graph (outputs negated), then fails
        out = m.outputs[0]
        with graph.inserting_after(out):
            neg = graph.call_function(torch.ops.aten.neg.default, (out,))
        neg.meta["val"] = out.meta.get("val")
        out.replace_all_uses_with(neg, delete_user_cb=lambda u: u is not neg)
        raise RuntimeError("substitution failed half-way")

    monkeypatch.setattr(rewrite, "substitute", half_done)
    monkeypatch.setattr(capture, "_SHARED", {})
    monkeypatch.setattr(forward, "_CLASS", {})
    h = patch(model, plan)
    assert torch.equal(run(model, kw, x), ref)
    assert any("substitution failed half-way" in e for e in h.errors())
    monkeypatch.setattr(rewrite, "substitute", real)


def _patched_llama(tmp_path, monkeypatch, seq: int):
    """A 2-layer HF Llama (KV cache on) patched with stand-ins for its rotary and SwiGLU patterns, nothing
    captured yet (fresh capture registries), and its unpatched logits under inference mode."""
    sys.path.insert(0, str(Path(__file__).parent))
    from candidates import ROTARY, SWIGLU  # noqa: E402
    from test_patch import inputs, plan_for, run, tiny  # noqa: E402

    from advisor.analysis.api import analyze
    from advisor.collect.in_process import profile_calls
    from advisor.patching import capture, forward, patch

    model, _ = tiny("llama", layers=2)
    x = inputs("llama", seq=seq)  # shapes no other test captured
    ref = run(model, {}, x)
    a = analyze(profile_calls(lambda: run(model, {}, x), tmp_path, "cpu", calls=1))
    plan, _ = plan_for(a, [ROTARY, SWIGLU], "program")
    monkeypatch.setattr(capture, "_SHARED", {})
    monkeypatch.setattr(forward, "_CLASS", {})
    return model, x, ref, patch(model, plan)


@pytest.mark.parametrize("first", ["no_grad", "inference_mode"])
def test_inference_mode_and_no_grad_share_one_capture(tmp_path, monkeypatch, first):
    """Issue 17: dynamo guards on each tensor's dispatch keys, which inference mode changes (parameters
    included), so `optimize` captured every patched module twice (no_grad, then inference_mode: 1.6 of
    Llama's 4.6 s warm-cache start on a 2-core CPU). A call in inference mode now runs the no_grad
    capture (inference tensors passed as normal tensors over the same memory): whichever mode comes
    first captures, the other costs no capture, takes the patched path and computes the same logits."""
    from advisor.patching import timing

    model, x, ref, h = _patched_llama(tmp_path, monkeypatch, seq=11)
    modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    second = next(m for m in modes if m != first)
    outs, captures, launched = {}, {}, {}
    for mode in (first, second):
        before, launches = timing.snapshot(), h.launches()
        with modes[mode]():
            outs[mode] = model(**x).logits
        captures[mode] = timing.since(before).get("captures", 0)
        launched[mode] = sum(n - launches.get(k, 0) for k, n in h.launches().items())
    assert captures[first] >= 1 and captures[second] == 0, captures
    assert launched[first] == launched[second] > 0, launched
    assert not h.fallbacks(), h.fallbacks()
    for mode in modes:
        assert torch.equal(outs[mode], ref), mode


def test_inference_tensor_inputs_are_written_in_place():
    """The normal tensor a patched forward hands its capture for an inference tensor is the same memory:
    what the capture writes into it (an in-place op on an input) is in the caller's tensor, as in eager."""
    from advisor.patching.compiled import _as_normal_tensor

    with torch.inference_mode():
        x = torch.arange(12.0).reshape(3, 4)[:, 1:]
    with torch.inference_mode(False):
        alias = _as_normal_tensor(x)
        assert not alias.is_inference() and alias.data_ptr() == x.data_ptr()
        assert alias.stride() == x.stride() and alias.storage_offset() == x.storage_offset()
        alias.mul_(2)
    assert torch.equal(x, torch.arange(12.0).reshape(3, 4)[:, 1:] * 2)
    plain = torch.ones(2)
    assert _as_normal_tensor(plain) is plain


def test_a_reused_plan_captures_once_in_a_new_process(tmp_path):
    """Issue 17, the warm-cache path: `optimize` in a new process on a model and inputs optimised before
    reuses the stored plan, checks it against the unpatched model (one patched call: one capture, where
    it captured again under inference mode before) and hands back a model whose first call in either
    mode costs no capture and computes what the unpatched model does."""
    code = MODEL + '''
import json, advisor, torch
from advisor.patching import timing
model, (x, b) = build()
with torch.no_grad():
    want = model(x, b)
before = timing.snapshot()
report = advisor.optimize(model, (x, b), top=4, interpret=True)
in_optimize = timing.since(before).get("captures", 0)
applied = json.loads((report.out_dir / "apply.json").read_text())
calls = {}
for mode in (torch.no_grad, torch.inference_mode):
    before = timing.snapshot()
    with mode():
        got = model(x, b)
    calls[mode.__name__] = {"captures": timing.since(before).get("captures", 0), "err": (got - want).abs().max().item()}
print(json.dumps({"reused": applied["plan_reused"], "patched": len(report.applied), "in_optimize": in_optimize,
                  "calls": calls}))
'''
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FUSION_ADVISOR_CACHE": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):  # the first stores the plan, the second (a new process) reuses it
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                           cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    first, warm = runs
    assert not first["reused"] and warm["reused"] and warm["patched"] == first["patched"] >= 1, runs
    assert warm["in_optimize"] == 1, warm  # the Tiny model's one patched module, captured once
    for mode, call in warm["calls"].items():
        assert call["captures"] == 0 and call["err"] < 1e-4, (mode, warm)


def test_kernel_files_keep_the_validated_kernels_on_their_lines(optimized, tmp_path):
    """Issue 17: Triton's cache key holds each @triton.jit function's first line number. The kernel file
    the model is patched with must have its kernels on the lines of the module validated (in a worker),
    else the patched model's first call compiles every kernel again (BERT on the H100: 10 compiles, ~9 s).
    What the file says about the candidate is still there: its first line and a block at the end."""
    import inspect

    from advisor.codegen import generate, load_module
    from advisor.records import candidates_of
    from advisor.workflows.generate import _job

    doc = json.loads((optimized.out_dir / "analysis.json").read_text())
    checked = 0
    for c in candidates_of(doc)[:4]:
        entry = _job(c, tmp_path)
        if not entry.validated or c.kind.anchored:
            continue
        validated, written = load_module(generate(c.program).path), load_module(Path(entry.kernel_file))
        kernels = [k for k in vars(validated) if k.endswith("_kernel") or k.endswith("_kernel_looped")]
        assert kernels
        for k in kernels:
            assert inspect.getsourcelines(getattr(written, k).fn) == inspect.getsourcelines(getattr(validated, k).fn)
        text = Path(entry.kernel_file).read_text()
        assert text.splitlines()[0].startswith(f'"""Fused Triton kernel for candidate {c.id}')
        assert "# Validated against PyTorch" in text and "# Replaces: " in text and written.__doc__
        checked += 1
    assert checked


def test_a_validation_says_where_its_seconds_went(optimized, tmp_path, monkeypatch):
    """Issue 17: a row kernel's validation took 4-5 s in its H100 worker and compiling its shape cases ahead
    did not shorten it; each job's record now breaks `validate` into its steps (inputs, references, each
    case's kernel launch, compare), so a cold start's report says which step it is."""
    from advisor.workflows import workers
    from advisor.workflows.generate import generate_candidates

    monkeypatch.setenv(workers.ENV, "0")
    doc = json.loads((optimized.out_dir / "analysis.json").read_text())
    done = generate_candidates(doc, tmp_path, top=2)
    validated = [p for p in done["patterns"] if p["validated"]]
    assert validated
    for p in validated:
        steps = p["seconds"]["validate_steps"]
        cases = [s["case"] for s in p["errors"]["shapes"]]
        assert set(steps) == {"inputs", "reference", "compare"} | {f"kernel {c}" for c in cases}, steps
        assert steps[f"kernel {cases[0]}"] > 0  # the interpreter ran the kernel there
        assert sum(steps.values()) <= p["seconds"]["validate"] + 0.01  # the steps are inside `validate`


@pytest.mark.parametrize("device, starts", [("cuda", True), ("cpu", False)])
def test_apply_starts_the_compile_workers_before_profiling(tmp_path, monkeypatch, device, starts):
    """`fusion-advisor apply` on a GPU starts the kernel workers (3-4 s of imports on the H100) before the
    script is profiled, as `optimize` does, so that they are up when the kernels are generated; on the CPU
    (kernels in the interpreter, generated in process) it starts none."""
    from advisor.workflows import pipeline, user_script

    events = []

    class Stop(Exception):
        pass

    def profile(*a, **k):
        events.append("profile")
        raise Stop

    monkeypatch.setattr(user_script, "resolve_device", lambda d: device)
    monkeypatch.setattr(pipeline, "start_soon", lambda warm: events.append(("workers", warm)))
    monkeypatch.setattr(user_script, "profile_script", profile)
    with pytest.raises(Stop):
        user_script.apply_script(tmp_path / "train.py", [], tmp_path / "out")
    from advisor.workflows.generate import warm_worker
    assert events == ([("workers", warm_worker)] if starts else []) + ["profile"]

"""`advisor.optimize` and `fusion-advisor apply` end to end on the CPU (generated kernels in the interpreter)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import advisor
from advisor.patching import build_plan, patch, patched_modules, patches_off, spec_from_candidate
from advisor.patching.verify import check
from candidates import (ATTENTION, RESIDUAL_LAYERNORM, RESIDUAL_RMSNORM, RMSNORM, ROTARY, SWIGLU, TANH_GELU,
                        Structure, candidates_of, find_candidate, find_candidates, op_names, with_extended)
from test_patch import inputs, run, tiny  # noqa: E402 (pytest puts tests/ on sys.path)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _analysis(out_dir) -> dict:
    return json.loads((Path(out_dir) / "analysis.json").read_text())


def _not_patched(structures, records, out_dir) -> list[Structure]:
    """The structures no patched pattern has, its candidates read from OUT_DIR/analysis.json. An epilogue
    counts as its chain too (`linear → silu → mul` is the SwiGLU chain with its matmul: which of the two
    ranks first, and takes the ops, varies with CPU noise)."""
    doc = _analysis(out_dir)
    patched = with_extended(candidates_of([r for r in records if r.get("patched")], doc), doc)
    return [s for s in structures if not find_candidates(patched, s)]


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    model, kw = tiny("llama")
    x = inputs("llama")
    ref = run(model, kw, x)
    out = tmp_path_factory.mktemp("opt")
    # CPU ranks are noisy: take them all; never a plan an earlier run left in the cache
    report = advisor.optimize(model, {**x, **kw}, top=12, out=out, reuse=False, interpret=True)
    return model, kw, x, ref, report


def test_optimize_patches_llama_and_writes_a_plan(optimized):
    model, kw, x, ref, report = optimized
    assert not _not_patched([RESIDUAL_RMSNORM, RMSNORM, SWIGLU, ROTARY], report.patterns, report.out_dir)
    assert report.check["ok"], report.check
    assert torch.allclose(run(model, kw, x), ref, rtol=1e-5, atol=1e-5)
    doc = json.loads((report.out_dir / "apply.json").read_text())
    assert (report.out_dir / "analysis.json").exists()
    entries = doc["manifest"]
    assert entries and {"module", "class", "pattern", "kernel_file", "guard"} <= set(entries[0])
    assert all(Path(e["kernel_file"]).is_file() and str(report.out_dir) in e["kernel_file"] for e in entries)
    assert doc.get("end_to_end") is None  # no benchmark asked for: not written
    assert "timing not meaningful" in doc["selection"]["decision"]  # on a GPU: only what is faster is kept
    assert "patched" in str(report)


def test_patch_from_an_output_directory(optimized):
    *_, report = optimized
    model, kw = tiny("llama")
    x = inputs("llama")
    ref = run(model, kw, x)
    h = advisor.patch(model, report.out_dir)
    out = run(model, kw, x)
    assert {e["pattern_id"] for e in h.manifest() if e["sites"]} == {r["pattern_id"] for r in report.applied}
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    advisor.unpatch(model)
    assert torch.equal(run(model, kw, x), ref)


def test_a_kernel_that_changes_outputs_is_unpatched(tmp_path):
    """A (deliberately wrong) launcher: the check finds the mismatch, names the pattern, and unpatches it."""
    from advisor.analysis.api import analyze
    from advisor.collect.in_process import profile_calls

    model, kw = tiny("llama", layers=1)
    x = inputs("llama")
    a = analyze(profile_calls(lambda: run(model, kw, x), tmp_path, "cpu", calls=2))
    swiglu = find_candidate(a.doc["candidates"], SWIGLU)
    bad = tmp_path / "bad_kernel.py"
    bad.write_text("import torch\n\ndef run(a, b):\n    return (torch.nn.functional.silu(a) * b * 1.01,)\n")
    specs = [spec_from_candidate(swiglu, "kernel", str(bad), "cpu"),
             spec_from_candidate(find_candidate(a.doc["candidates"], ROTARY), "program")]
    h = patch(model, build_plan(specs, a.doc))

    def call():
        with torch.inference_mode():
            return model(**x, **kw).logits

    chk = check(call, h)
    assert not chk.comparison.ok
    assert list(chk.dropped) == [specs[0].key] and "alone" in chk.dropped[specs[0].key]
    assert [s.key for s in chk.handle.plan.patterns] == [specs[1].key]
    assert len(patched_modules(model)) == 1
    with patches_off():
        ref = call()
    assert torch.equal(call(), ref)  # what is left is exact (the rotary stand-in)


def test_patterns_right_alone_but_not_together_are_left_out_one_by_one(tmp_path, monkeypatch):
    """Each pattern passes alone, the combination does not (rounding that adds up over many layers): the
    check leaves out the one that moves the output most and keeps the rest, instead of dropping every one.
    The comparison is replaced by one that fails whenever more than one pattern runs."""
    from advisor.analysis.api import analyze
    from advisor.validate.outputs import Comparison
    from advisor.collect.in_process import profile_calls
    from advisor.patching import rewrite, verify

    model, kw = tiny("llama", layers=1)
    x = inputs("llama")
    a = analyze(profile_calls(lambda: run(model, kw, x), tmp_path, "cpu", calls=2))
    specs = [spec_from_candidate(find_candidate(a.doc["candidates"], SWIGLU), "program"),
             spec_from_candidate(find_candidate(a.doc["candidates"], ROTARY), "program")]
    error = {specs[0].key: 0.002, specs[1].key: 0.001}

    def compare(ref, out, exact=None):
        keys = rewrite.enabled_keys()
        ok = keys is not None and len(keys) <= 1
        return Comparison(ok, None if ok else "rel_l2 too large together", sum(error[k] for k in keys or error))

    monkeypatch.setattr(verify, "compare_outputs", compare)
    h = patch(model, build_plan(specs, a.doc))

    def call():
        with torch.inference_mode():
            return model(**x, **kw).logits

    chk = check(call, h)
    assert list(chk.dropped) == [specs[0].key] and "together" in chk.dropped[specs[0].key]
    assert [s.key for s in chk.handle.plan.patterns] == [specs[1].key]


@pytest.mark.parametrize("name, must", [
    ("llama", [RESIDUAL_RMSNORM, SWIGLU, ROTARY]),
    ("gpt2", [RESIDUAL_LAYERNORM, TANH_GELU]),
    ("bert", [RESIDUAL_LAYERNORM]),
], ids=["llama", "gpt2", "bert"])
def test_apply_script_end_to_end(name, must, tmp_path):
    from rich.console import Console

    from advisor.workflows.user_script import apply_script

    doc = apply_script(ROOT / "examples" / f"hf_{name}.py", ["--device", "cpu"], tmp_path / name,
                       top=12, device="cpu", console=Console(file=open("/dev/null", "w")))
    assert not _not_patched(must, doc["patterns"], tmp_path / name), \
        [(r["title"], r["status"]) for r in doc["patterns"]]
    assert doc["checks"] and all(c["ok"] for c in doc["checks"])
    assert not doc["errors"]
    assert {e["pattern_id"] for e in doc["manifest"]} == {r["pattern_id"] for r in doc["patterns"] if r["patched"]}
    assert doc["end_to_end"]["timing_meaningful"] is False and "speedup" not in doc["end_to_end"]
    saved = json.loads((tmp_path / name / "apply.json").read_text())
    assert saved["manifest"] == doc["manifest"]
    assert saved["host_modules"] == []  # Triton's launchers this run loaded, for bundles: none in the interpreter


def test_apply_cli(tmp_path):
    """The command itself, in a fresh interpreter (with the program stand-in: no kernel generation)."""
    out = tmp_path / "seed"
    script = tmp_path / "seed.py"
    script.write_text(
        "import torch\n"
        "class Seed(torch.nn.Module):\n"
        "    def forward(self, x, b):\n"
        "        return torch.log(torch.relu(x + b))\n"
        "x, b = torch.randn(4096), torch.randn(4096)\n"
        "m = Seed()\n"
        "for _ in range(3):\n"
        "    m(x, b)\n")
    r = subprocess.run([sys.executable, "-m", "advisor", "apply", str(script), "--out", str(out), "--device", "cpu",
                        "--replacement", "program"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "apply.json").read_text())
    patched = candidates_of([p for p in doc["patterns"] if p["patched"]], _analysis(out))
    assert [(c["kind"], op_names(c)) for c in patched] == [("pointwise", ["add", "relu", "log"])]
    assert doc["manifest"][0]["module"] == "Seed" and doc["manifest"][0]["class"] == "Seed"
    assert doc["checks"][0]["bit_identical"]
    assert "timing not meaningful" in r.stdout


def test_region_timing_reruns_the_script(tmp_path):
    """With an advisor.region steady state the script is re-run and each region occurrence timed."""
    from advisor.workflows.user_script import _script_timing

    script = tmp_path / "regions.py"
    script.write_text("import torch, advisor\n"
                      "x = torch.randn(256)\n"
                      "for _ in range(4):\n"
                      "    with advisor.region('step'):\n"
                      "        torch.log(torch.relu(x) + 1)\n")
    t = _script_timing(script, [], "cpu", {"source": "region", "name": "step"}, None, iters=6)
    assert t["iters"] >= 6 and t["median_ms"] > 0 and t["method"] == "perf_counter per region"
    import advisor

    assert advisor.region.__module__ == "advisor.collect.region"  # put back


def test_a_second_optimize_reuses_the_plan_and_checks_it_again(tmp_path, monkeypatch):
    """Same model class, weights' shapes and inputs in a new model object: the stored plan is patched in
    without profiling, re-checked against the unpatched outputs; other inputs or reuse=False start cold."""
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path / "cache"))
    x = inputs("llama")
    first_model, kw = tiny("llama", layers=1)
    first = advisor.optimize(first_model, {**x, **kw}, top=4, out=tmp_path / "first", interpret=True)
    assert "profile" in first.phases_s and first.applied
    model, kw = tiny("llama", layers=1)
    ref = run(model, kw, x)
    second = advisor.optimize(model, {**x, **kw}, top=4, out=tmp_path / "second", interpret=True)
    doc = json.loads((tmp_path / "second" / "apply.json").read_text())
    assert doc["plan_reused"] and "profile" not in second.phases_s and "check" in second.phases_s
    assert [r["pattern_id"] for r in second.applied] == [r["pattern_id"] for r in first.applied]
    assert second.check["ok"] and torch.allclose(run(model, kw, x), ref, rtol=1e-5, atol=1e-5)
    assert all(e["kernel_file"].startswith(str(tmp_path / "second" / "kernels")) for e in doc["manifest"])
    assert all(Path(e["kernel_file"]).is_file() for e in doc["manifest"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "first", "second"]  # nothing beside OUT
    advisor.unpatch(model)
    assert torch.equal(run(model, kw, x), ref)
    other = advisor.optimize(model, {**inputs("llama", seq=12), **kw}, top=4, out=tmp_path / "other", interpret=True)
    assert "profile" in other.phases_s  # another input shape: another plan
    cold = advisor.optimize(model, {**x, **kw}, top=4, out=tmp_path / "cold", reuse=False, interpret=True)
    assert "profile" in cold.phases_s
    advisor.unpatch(model)


def test_patterns_worth_under_half_a_percent_of_the_best_are_not_patched():
    from advisor.records import Candidate, Kind
    from advisor.status import Status
    from advisor.workflows.kernels import worth_patching

    cands = [Candidate(f"c{i}", kind, pattern_id=f"p{i}", title=t, est_time_saved_us=us)
             for i, (t, kind, us) in enumerate([("GELU", Kind.POINTWISE, 716.0), ("Residual add + LayerNorm", Kind.NORM, 40.7),
                                                 ("mask: sub → ne", Kind.POINTWISE, 0.6),
                                                 ("add → sub", Kind.POINTWISE, 0.0)], 1)]
    keep, rest = worth_patching(cands)
    assert [c.id for c in keep] == ["c1", "c2"]
    assert [r.candidate for r in rest] == ["c3", "c4"] and not any(r.validated for r in rest)
    assert rest[0].reason.startswith("not worth patching: estimated saving 0.6 µs")
    assert [r.code for r in rest] == [Status.NOT_WORTH] * 2 and rest[0].verdict.message == rest[0].reason
    assert rest[1].reason == "not worth patching: estimated to save nothing"
    unestimated = [Candidate(f"c{i}", Kind.POINTWISE, pattern_id=f"p{i}") for i in (5, 6)]
    assert worth_patching(unestimated)[0] == unestimated  # nothing estimated at all: nothing to compare with, all kept
    # A GEMM epilogue the cost model says loses to cuBLAS + one fused kernel is not generated, and says why.
    losing = Candidate("c7", Kind.EPILOGUE, pattern_id="p7", title="linear epilogue (GELU, fc1)", est_time_saved_us=0.0)
    keep, rest = worth_patching([cands[0], losing])
    assert keep == [cands[0]] and "slower than cuBLAS" in rest[0].reason
    # A GPU trace's call of 10 ms: 40.7 µs is 0.4% of it, under what a timing of the model resolves
    keep, rest = worth_patching(cands[:2], call_us=10_000.0)
    assert [c.id for c in keep] == ["c1"] and [r.candidate for r in rest] == ["c2"]
    assert "under 0.5% of a call's GPU time (10 ms)" in rest[0].reason and rest[0].code == Status.NOT_WORTH
    assert [c.id for c in worth_patching(cands[:2], call_us=4_000.0)[0]] == ["c1", "c2"]


def test_patterns_too_small_to_time_alone_are_judged_together():
    """T5's RMSNorm at 180 µs a call of 40 ms beside patterns of 25-50 µs in every layer: each under 0.5% of the
    call, together what torch.compile wins. They are patched as one group (selection times them among every
    pattern on) where their savings add up to that share, and dropped together, saying so, where they do not."""
    from advisor.records import Candidate, Kind
    from advisor.workflows.kernels import worth_patching

    sizes = [("Residual add + LayerNorm", 2500.0), ("RMSNorm", 180.0), ("dropout add", 45.0), ("GELU", 30.0),
             ("mask", 0.4)]
    cands = [Candidate(f"c{i}", Kind.NORM, pattern_id=f"p{i}", title=t, est_time_saved_us=us)
             for i, (t, us) in enumerate(sizes, 1)]
    keep, rest = worth_patching(cands, call_us=40_000.0)
    assert [c.id for c in keep] == ["c1", "c2", "c3", "c4"]  # 255 µs together: over 0.5% of 40 ms
    assert [r.candidate for r in rest] == ["c5"] and "of the best pattern's" in rest[0].reason  # the root guard
    keep, rest = worth_patching(cands[:1] + cands[2:4], call_us=40_000.0)
    assert [c.id for c in keep] == ["c1"] and [r.candidate for r in rest] == ["c3", "c4"]
    assert all("75 µs together with the 1 other patterns" in r.reason for r in rest), rest[0].reason


def test_optimize_with_the_kv_cache_on(tmp_path, monkeypatch):
    """HF's default call returns a DynamicCache: its keys and values are compared, not its identity (that
    unpatched every pattern), and the rotary group ending in the cache's first `cat` (a legacy empty 1-d
    tensor and the keys) is generated and patched."""
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path / "cache"))
    model, _ = tiny("llama", layers=1)
    x = inputs("llama")
    with torch.inference_mode():
        ref = model(**x).logits
    report = advisor.optimize(model, x, top=6, out=tmp_path / "opt", interpret=True)  # CPU ranks are noisy
    assert report.check["ok"], report.check
    assert not _not_patched([RESIDUAL_RMSNORM, ROTARY], report.patterns, report.out_dir), \
        [(p["title"], p["status"]) for p in report.patterns]
    with torch.inference_mode():
        assert torch.allclose(model(**x).logits, ref, rtol=1e-5, atol=1e-5)
    advisor.unpatch(model)


def test_compare_opens_objects_pytree_does_not_know():
    from advisor.validate.outputs import compare_outputs

    class Cache:
        def __init__(self, k):
            self.layers = [{"keys": k}]

    k = torch.randn(2, 3)
    assert compare_outputs((k, Cache(k)), (k.clone(), Cache(k.clone()))).ok
    bad = compare_outputs((k, Cache(k)), (k, Cache(k + 1)))
    assert not bad.ok and "output 2" in bad.reason


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_eager_attention_is_patched_end_to_end(name, tmp_path, monkeypatch):
    """Issue 10's attention class through the patcher: AOTAutograd holds the attention output as a 3-d bmm
    result between views; the fused kernel's 4-d output stands in for it, and the model's outputs match."""
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path / "cache"))
    model, kw = tiny(name)  # two layers: with one, GPT-2's causal-mask ops join the attention group
    model.config._attn_implementation = "eager"
    x = inputs(name)
    ref = run(model, kw, x)
    report = advisor.optimize(model, {**x, **kw}, top=4, out=tmp_path / "opt", interpret=True)
    cands = candidates_of(report.patterns, _analysis(report.out_dir))
    att = [p for p, c in zip(report.patterns, cands) if ATTENTION.matches(c)]
    assert att and att[0]["patched"], [(p["title"], p["status"]) for p in report.patterns]
    assert report.check["ok"]
    assert torch.allclose(run(model, kw, x), ref, rtol=1e-4, atol=1e-5)
    advisor.unpatch(model)
    assert torch.equal(run(model, kw, x), ref)


def test_the_plan_fingerprint_covers_settings_that_change_the_forward():
    """Two GPT-2s of one shape, one with eager attention: different forwards, different plans (an sdpa plan
    reused for the eager model had no attention pattern). The same settings in a new object: same key.
    A call inside `torch.autocast`: its own key."""
    from advisor.workflows import plan_cache

    x = inputs("gpt2")
    keys = []
    for attn in ("sdpa", "sdpa", "eager"):
        model, kw = tiny("gpt2", layers=1)
        model.config._attn_implementation = attn
        keys.append(plan_cache.fingerprint(model, (), {**x, **kw}, "cpu", {"top": 4}))
    assert keys[0] == keys[1] != keys[2]
    model, kw = tiny("gpt2", layers=1)
    model.generation_config._original_object_hash = 12345  # Python's salted hash: new in every process
    assert plan_cache.fingerprint(model, (), {**x, **kw}, "cpu", {"top": 4}) == keys[0]
    model.transformer.ln_f.eps = 1e-3  # a module's own setting
    assert plan_cache.fingerprint(model, (), {**x, **kw}, "cpu", {"top": 4}) != keys[0]
    model.transformer.ln_f.eps = 1e-5
    assert plan_cache.fingerprint(model, (), {**x, **kw}, "cpu", {"top": 4}) == keys[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the ops' dtypes change: a plan of its own
        assert plan_cache.fingerprint(model, (), {**x, **kw}, "cpu", {"top": 4}) != keys[0]


TRAINING_SCRIPT = """
import torch
torch.manual_seed(0)
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(torch.ones(256)), torch.nn.Parameter(torch.zeros(256))
    def forward(self, x):
        return torch.nn.functional.layer_norm(x + 1.0, (256,), self.w, self.b)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), Block())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(64, 256)
for _ in range(4):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_apply_on_a_training_script_says_why_nothing_is_patched(tmp_path):
    """A script that trains as it is (every call needs gradients): patched forwards run their original code
    for such calls unless training is fused, so nothing launches; each pattern says that, and how to fuse
    training, rather than 'its ops were not found in the captured graphs' (nothing was captured)."""
    from advisor.workflows.user_script import apply_script

    script = tmp_path / "train.py"
    script.write_text(TRAINING_SCRIPT)
    doc = apply_script(script, [], tmp_path / "out", top=3)
    tried = [p for p in doc["patterns"] if p.get("validated")]
    assert tried, doc["patterns"]
    assert not any(p["patched"] for p in doc["patterns"])
    assert all("needed gradients" in p["status"] and "train=True" in p["status"] for p in tried), \
        [p["status"] for p in tried]


def test_apply_train_fuses_the_training_script_it_runs(tmp_path):
    """`apply --train`: the script's calls that need gradients run the fused kernels with their generated
    backwards; the first calls are compared with the unpatched model's as for inference, the patterns
    count their sites, and apply.json says it trained (on the CPU the kernels are checked, not timed)."""
    from advisor.patching import autograd as ag
    from advisor.workflows.user_script import apply_script

    script = tmp_path / "train.py"
    script.write_text(TRAINING_SCRIPT)
    ag._BACKWARDS.clear()
    doc = apply_script(script, [], tmp_path / "out", top=3, train=True)
    assert doc["train"] is True
    patched = [p for p in doc["patterns"] if p["patched"]]
    assert patched and all(p["sites"] > 0 for p in patched), [(p["title"], p["status"]) for p in doc["patterns"]]
    assert doc["checks"] and all(c["ok"] for c in doc["checks"]), doc["checks"]
    assert any(b["validated"] and b["launches"] for b in ag.summary()), ag.summary()  # backwards ran fused


def test_apply_train_compares_a_script_whose_calls_draw_random_numbers_at_the_same_draws(tmp_path):
    """A training script with dropout (here `F.dropout(..., training=self.training)`, which no module type
    shows): two calls agree only at the same random state, so the check runs both from one (`_same_draws`),
    says so, and drops nothing: the patched call draws the same masks."""
    from advisor.workflows.user_script import apply_script

    script = tmp_path / "train.py"
    script.write_text(TRAINING_SCRIPT.replace(
        "model = torch.nn.Sequential(torch.nn.Linear(256, 256), Block())",
        "class Drop(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.nn.functional.dropout(x, 0.5, training=self.training)\n"
        "model = torch.nn.Sequential(Drop(), torch.nn.Linear(256, 256), Block())"))
    doc = apply_script(script, [], tmp_path / "out", top=3, train=True)
    assert doc["checks"] and all("draws random numbers" in (c["reason"] or "") for c in doc["checks"]), doc["checks"]
    assert all(c["ok"] for c in doc["checks"]) and not any(c["dropped"] for c in doc["checks"])
    assert [p for p in doc["patterns"] if p["patched"]], [(p["title"], p["status"]) for p in doc["patterns"]]


def test_the_apply_summary_says_each_module_check_once():
    """A script calls its model many times; the summary gave one identical line per call. One per module:
    its state over the calls and the worst call's errors, a mismatch counted."""
    from advisor.workflows.user_script import check_lines

    ok = {"module": "MLPBlock", "ok": True, "bit_identical": False, "rel_l2": 5e-8, "max_abs": 2e-7}
    assert check_lines([ok, dict(ok, rel_l2=9e-8)]) == [
        "check MLPBlock: patched vs unpatched outputs match over 2 calls (worst rel_l2 9e-08, max_abs 2e-07)"]
    same = {"module": "Head", "ok": True, "bit_identical": True}
    bad = dict(ok, ok=False, rel_l2=0.3, max_abs=4.0)
    assert check_lines([ok, same, bad]) == [
        "check MLPBlock: patched vs unpatched outputs MISMATCH in 1 of 2 calls (worst rel_l2 0.3, max_abs 4)",
        "check Head: patched vs unpatched outputs bit-identical"]
    assert check_lines([ok]) == ["check MLPBlock: patched vs unpatched outputs match (rel_l2 5e-08, max_abs 2e-07)"]

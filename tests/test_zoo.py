"""The model zoo (issue 15): `advisor.optimize` on tiny models of many transformers architectures and three
hand-written nets (a conv net, an MLP, a diffusion UNet's blocks: bench/workloads.py's UNetBlocks), each
called as its users call it (tests/zoo_models.py builds them and their inputs: padded attention masks,
decoder inputs, pixel and audio inputs, caches as configured), with real profiles, real generated kernels
(in Triton's interpreter on the CPU) and real patches.

Per model, one test each (ids `test_<check>[<model>]`), in this order on one optimised model:
  optimize_completes  `optimize(model, inputs, interpret=True)` returns a report
  validated           at least one pattern's generated kernel validated
  patched             at least one pattern is patched (it launches on the example inputs)
  same_outputs        the model as optimize left it == a deep copy taken before optimize, on the example inputs
  other_shapes        == the copy on inputs of another batch size / sequence length (vision: batch size)
  train_mode          == the copy in train mode (configs have every dropout at 0), outputs and buffers
  autograd            train mode under autograd: outputs, every parameter's gradient and the buffers
  fused_training      the same, two steps, with training through the fused kernels switched on (train=True)
  whole_stack_training  the same with the whole stack's capture switched on (where the plan has one)
  hooks               forward hooks registered after optimize on the first Linear/Conv inside a layer (inside
                      a patched module where there is one) whose output matters: one scales its output by
                      ~1.5, one counts calls; == the copy with the same hooks, called as often (under
                      inference_mode, as optimize called the model, and under no_grad)
  generate            models that generate: greedy `generate` (prefill, then one token per step with the
                      cache) gives the copy's tokens and scores
  shapes_past_the_budget  with the dynamic-shape compile on (the GPU's default), calls at new batch sizes (and
                      lengths) past the capture budget run it (or say why not) and give the copy's outputs;
                      `generate` its tokens
  unpatch             after `advisor.unpatch(model)` the outputs are bit-identical to the copy's
Float outputs are compared leaf by leaf (logits, hidden states, cache tensors...) with rtol = atol = 1e-4.

Which models run (CI runs the whole suite on a 2-core CPU machine, so the zoo runs a part per run):
  - QUICK, every run: one model per family (LLaMA, GPT-2, BERT, T5, Whisper, ViT, the conv net, the MLP).
  - plus ROTATE more from the rest, chosen by a seed: the rest, in a fixed order, split into chunks of
    ROTATE; a run takes chunk `seed % chunks`, so every model runs once every few commits. The seed
    is FUSION_ADVISOR_ZOO_SEED, by default the checked-out commit's (its hash's first 8 hex digits, 0 outside
    a git checkout): a re-run of one commit tests the same models, whatever the day. The session's header
    prints the seed and its chunk, and models not chosen are skipped with a reason that names it (to re-run
    a choice, set the seed).
  - FUSION_ADVISOR_ZOO=all runs every model; FUSION_ADVISOR_ZOO=quick only QUICK;
    FUSION_ADVISOR_ZOO=llama,bart (names from tests/zoo_models.py) exactly those.
Measured on 2 shared cores, main 7b37561 (optimize and its 10 checks): 1-31 s per model; QUICK 2 min,
a rotation chunk 1.8-2.2 min, so about 4 min per CI run; all 40 models 9.5 min. The 13 added on 2026-11-26
(gemma3, olmo2, cohere, granite, qwen2_moe, modernbert, esm, hubert, dinov2, siglip_vision, beit, convnextv2,
regnet), on 2 cores beside other work: 13-71 s each, all checks passing (tests/zoo_triage.py). The 10 added
on 2026-11-26 (stablelm, nemotron, persimmon, mpt, biogpt, mamba: no attention, a selective scan; mobilebert,
funnel, pegasus, poolformer), so 64 models in all, on 2 cores beside other work (load ~4): 11-57 s each, all
checks passing.
"""
from __future__ import annotations

import copy
import math
import os
import random
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo_models import ARCHS, BY_NAME, Arch  # noqa: E402

import advisor  # noqa: E402
from advisor.patching import patched_modules  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning", "ignore::RuntimeWarning")

QUICK = ("llama", "gpt2", "bert", "t5", "whisper", "vit", "convnet", "mlp")
ROTATE = 8
RTOL = ATOL = 1e-4


def selection(env=os.environ) -> tuple[set, str]:
    """(names of the models this run, why the others are skipped)."""
    want = env.get("FUSION_ADVISOR_ZOO", "").strip().lower()
    if want == "all":
        return set(BY_NAME), ""
    if want == "quick":
        return set(QUICK), "FUSION_ADVISOR_ZOO=quick"
    if want:
        names = {n.strip() for n in want.split(",") if n.strip()}
        unknown = names - set(BY_NAME)
        assert not unknown, f"FUSION_ADVISOR_ZOO names unknown models {sorted(unknown)}; known: {sorted(BY_NAME)}"
        return names, f"FUSION_ADVISOR_ZOO={want}"
    seed, k, chunks, chosen = rotation(env)
    return set(QUICK) | chosen, \
        f"not in this run's rotation (FUSION_ADVISOR_ZOO_SEED={seed}: chunk {k} of {chunks}); FUSION_ADVISOR_ZOO=all runs it"


def rotation(env=os.environ) -> tuple[int, int, int, set]:
    """(the seed, its chunk, how many chunks, the models of that chunk)."""
    seed = int(env.get("FUSION_ADVISOR_ZOO_SEED") or commit_seed())
    rest = sorted(set(BY_NAME) - set(QUICK))
    random.Random(0).shuffle(rest)
    chunks = math.ceil(len(rest) / ROTATE)
    k = seed % chunks
    return seed, k, chunks, set(rest[k * ROTATE:(k + 1) * ROTATE])


def commit_seed() -> int:
    """The checked-out commit's hash as a number (its first 8 hex digits); 0 outside a git checkout."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        return int(head[:8], 16) if head else 0
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


SELECTED, NOT_SELECTED = selection()


# --------------------------------------------------------------------------------------- helpers
def _optimize(model, inputs):
    return advisor.optimize(model, inputs, interpret=True)  # patch although kernels run in the interpreter


def leaves(out, prefix: str = "", seen=None) -> dict:
    """{name: value} of every tensor in an output: ModelOutputs, tuples, dicts and cache objects walked."""
    seen = set() if seen is None else seen
    if isinstance(out, torch.Tensor):
        return {prefix or "output": out}
    if id(out) in seen or isinstance(out, (nn.Module, str, bytes, int, float, bool, type(None), torch.dtype,
                                          torch.device)) or callable(out):
        return {}
    seen.add(id(out))
    if hasattr(out, "keys") and hasattr(out, "__getitem__"):
        items = [(str(k), out[k]) for k in out.keys()]
    elif isinstance(out, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(out)]
    elif hasattr(out, "__dict__"):
        items = list(vars(out).items())
    else:
        return {}
    found = {}
    for k, v in items:
        found.update(leaves(v, f"{prefix}.{k}" if prefix else k, seen))
    return found


def differences(name: str, got, want, exact: bool = False) -> list[str]:
    """Why `got` is not `want` (tensor by tensor), as lines naming the model and the output."""
    g, w = leaves(got), leaves(want)
    if g.keys() != w.keys():
        return [f"{name}: output structure differs: {sorted(g.keys() ^ w.keys())[:6]}"]
    bad = []
    for k in w:
        a, b = g[k], w[k]
        if exact:
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
                bad.append(f"{name}: `{k}` is not bit-identical (max abs diff {diff})")
            continue
        try:
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        except AssertionError as e:
            bad.append(f"{name}: `{k}` differs: " + " ".join(str(e).split()))
    return bad


def run(model, inputs: dict, grad: bool = False, mode=torch.inference_mode):
    torch.manual_seed(1)
    with (torch.enable_grad() if grad else mode()):
        return model(**inputs)


def loss_of(out) -> torch.Tensor:
    floats = [t for t in leaves(out).values() if t.is_floating_point() and t.requires_grad]
    assert floats, "no output requires grad"
    return sum((t.float() ** 2).mean() for t in floats)


def hook_targets(model: nn.Module) -> list[str]:
    """Linear / Conv-like leaf modules (a weight of 2 or more dims, not an embedding) whose qualified name has a
    layer index in it (`encoder.layer.0.attention.self.query`, `blocks.0.conv1`), in module order."""
    return [name for name, m in model.named_modules()
            if not list(m.children()) and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() >= 2 and not isinstance(m, nn.Embedding) and re.search(r"(^|\.)\d+(\.|$)", name)]


def scale(module, args, out):
    """Scales a module's output by 1.5 on average: by a fixed random factor per element in [1.25, 1.75), which no
    normalisation after it can undo (a plain 1.5 vanishes in a LayerNorm right after a conv)."""
    g = torch.Generator().manual_seed(3)
    return out * (1.25 + 0.5 * torch.rand(out.shape, generator=g)).to(out.dtype)


def hook_target(model: nn.Module, inputs: dict, plain, patched: list[str]) -> str:
    """The first of `hook_targets` whose output, scaled by `scale`, visibly changes the model's output (in a tiny
    random model a query projection barely moves a near-uniform softmax, and ConvNeXt's layer scale of 1e-6
    hides its whole residual branch); those inside a patched module (qualified names `patched`) first."""
    names = hook_targets(model)
    inside = [n for n in names if any(q == "" or n.startswith(q + ".") for q in patched)]
    names = inside + [n for n in names if n not in inside]
    assert names, f"no Linear/Conv module with a layer index in {type(model).__name__}"
    for name in names[:12]:
        h = model.get_submodule(name).register_forward_hook(scale)
        try:
            if differences("", run(model, inputs), plain):
                return name
        finally:
            h.remove()
    raise AssertionError(f"scaling none of {names[:12]} changes the output of {type(model).__name__}")


@dataclass
class Optimised:
    arch: Arch
    model: nn.Module
    ref: nn.Module  # deep copy taken before optimize
    inputs: dict
    report: object = None
    error: str | None = None
    seconds: float = 0.0
    unpatched: bool = False
    notes: dict = field(default_factory=dict)

    def ready(self) -> None:
        """Fail (not skip) a check whose model optimize did not produce, or that unpatch already restored."""
        if self.error is not None:
            pytest.fail(f"{self.arch.name}: optimize did not complete: {self.error}", pytrace=False)
        if self.unpatched:
            pytest.fail(f"{self.arch.name}: the model was already unpatched (checks ran out of order)", pytrace=False)


@pytest.fixture(scope="module", params=[a.name for a in ARCHS])
def zoo(request):
    arch = BY_NAME[request.param]
    if arch.name not in SELECTED:
        pytest.skip(NOT_SELECTED)
    model = arch.model()
    state = Optimised(arch, model, copy.deepcopy(model), arch.inputs(*arch.example))
    t0 = time.perf_counter()
    try:
        state.report = _optimize(model, state.inputs)
    except Exception as e:  # noqa: BLE001 - reported by test_optimize_completes, the other checks fail on it
        state.error = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[-1]
        state.notes["traceback"] = traceback.format_exc()
    state.seconds = time.perf_counter() - t0
    yield state
    advisor.unpatch(model)


def _assert_none(bad: list[str]) -> None:
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------------ tests
def test_optimize_completes(zoo, record_property):
    record_property("optimize_s", round(zoo.seconds, 2))
    assert zoo.error is None, f"{zoo.arch.name}: optimize raised {zoo.error}\n{zoo.notes.get('traceback', '')}"


def _statuses(report) -> str:
    return "; ".join(f"{p['candidate']} {p.get('title')}: validated={p.get('validated')} "
                     f"{p.get('status') or p.get('reason')}" for p in report.patterns) or "no patterns"


def test_validated(zoo):
    zoo.ready()
    ok = [p for p in zoo.report.patterns if p.get("validated")]
    assert ok, f"{zoo.arch.name}: no pattern validated ({_statuses(zoo.report)})"


def test_patched(zoo):
    zoo.ready()
    assert zoo.report.applied and patched_modules(zoo.model), \
        f"{zoo.arch.name}: no pattern patched ({_statuses(zoo.report)})"


def test_same_outputs(zoo):
    zoo.ready()
    _assert_none(differences(f"{zoo.arch.name} (example inputs)", run(zoo.model, zoo.inputs), run(zoo.ref, zoo.inputs)))


def test_other_shapes(zoo):
    zoo.ready()
    other = zoo.arch.inputs(*zoo.arch.other)
    _assert_none(differences(f"{zoo.arch.name} (batch, size) = {zoo.arch.other}", run(zoo.model, other),
                             run(zoo.ref, other)))


def test_whole_stack(zoo):
    """The outer capture over the layers (one graph for the whole stack, fusing across layers), which
    selection switches on where it measures faster on a GPU: switched on here, it gives the unpatched
    model's outputs on the example inputs and on other shapes, whatever dynamo makes of the stack."""
    zoo.ready()
    handle = zoo.report.handle
    if not handle.outer:
        pytest.skip(f"{zoo.arch.name}: the plan has no outer capture (one capture holds every pattern)")
    other = zoo.arch.inputs(*zoo.arch.other)
    try:
        handle.set_outer(True)
        bad = differences(f"{zoo.arch.name} (whole stack, example inputs)", run(zoo.model, zoo.inputs),
                          run(zoo.ref, zoo.inputs))
        bad += differences(f"{zoo.arch.name} (whole stack, (batch, size) = {zoo.arch.other})", run(zoo.model, other),
                           run(zoo.ref, other))
    finally:
        handle.set_outer(False)
    _assert_none(bad)


def _buffers(name: str, model, ref) -> list[str]:
    b, r = dict(model.named_buffers()), dict(ref.named_buffers())
    return [f"{name}: buffer `{k}` differs after the call" for k in r
            if r[k].is_floating_point() and not torch.allclose(b[k], r[k], rtol=RTOL, atol=ATOL)]


class _TrainMode:
    """Both models in train mode inside the block; modes, buffers (BatchNorm statistics) and grads restored."""

    def __init__(self, *models):
        self.models = models

    def __enter__(self):
        self.saved = [copy.deepcopy(m.state_dict()) for m in self.models]
        for m in self.models:
            m.train()

    def __exit__(self, *exc):
        for m, sd in zip(self.models, self.saved):
            m.load_state_dict(sd)
            m.eval()
            m.zero_grad(set_to_none=True)


def test_train_mode(zoo):
    zoo.ready()
    name = f"{zoo.arch.name} (train mode)"
    with _TrainMode(zoo.model, zoo.ref):
        with torch.no_grad():
            torch.manual_seed(1)
            got = zoo.model(**zoo.inputs)
            torch.manual_seed(1)
            want = zoo.ref(**zoo.inputs)
        _assert_none(differences(name, got, want) + _buffers(name, zoo.model, zoo.ref))


def _training_step_differences(name: str, model, ref, inputs: dict, rtol: float = RTOL) -> list[str]:
    """Why one training call (forward, backward) through `model` differs from `ref`'s: outputs, buffers and
    every parameter's gradient."""
    got, want = run(model, inputs, grad=True), run(ref, inputs, grad=True)
    loss_of(got).backward()
    loss_of(want).backward()
    bad = differences(name, got, want) + _buffers(name, model, ref)
    ref_params = dict(ref.named_parameters())
    for k, p in model.named_parameters():
        q = ref_params[k]
        if (p.grad is None) != (q.grad is None):
            bad.append(f"{name}: gradient of `{k}` is {'missing' if p.grad is None else 'unexpected'}")
        elif p.grad is not None and not torch.allclose(p.grad, q.grad, rtol=rtol, atol=ATOL):
            bad.append(f"{name}: gradient of `{k}` differs (max abs diff {(p.grad - q.grad).abs().max().item():.3g})")
    return bad


def test_autograd(zoo):
    zoo.ready()
    with _TrainMode(zoo.model, zoo.ref):
        _assert_none(_training_step_differences(f"{zoo.arch.name} (train mode, autograd)", zoo.model, zoo.ref,
                                                zoo.inputs))


def test_fused_training(zoo):
    """Training through the fused kernels (`optimize(..., train=True)`, here switched on on the same patched
    model): generated backwards where they validate, the original ops elsewhere; two steps (the first
    traces the training graphs, the second runs them), each with eager's outputs, buffers and gradients
    (rtol 1e-3: the generated kernels round differently from PyTorch's own)."""
    zoo.ready()
    handle = zoo.report.handle
    handle.train_fused(True)
    try:
        _two_fused_steps(zoo, "fused training")
    finally:
        handle.train_fused(False)


def _two_fused_steps(zoo, what: str) -> None:
    """Two training calls (the first traces the training graphs, the second runs them), each with eager's outputs,
    buffers and gradients (rtol 1e-3: the generated kernels round differently from PyTorch's own)."""
    for step in range(2):
        with _TrainMode(zoo.model, zoo.ref):
            _assert_none(_training_step_differences(f"{zoo.arch.name} ({what}, step {step})", zoo.model, zoo.ref,
                                                    zoo.inputs, rtol=1e-3))


def test_whole_stack_training(zoo):
    """Fused training with the whole stack's capture switched on (what a GPU's selection hands back where the
    stack measured faster): the stack's training graph, its causal mask folded where HF built one while dynamo
    traced; two steps, each with eager's outputs, buffers and gradients."""
    zoo.ready()
    handle = zoo.report.handle
    if not handle.outer:
        pytest.skip(f"{zoo.arch.name}: the plan has no outer capture (one capture holds every pattern)")
    handle.set_outer(True)
    handle.train_fused(True)
    stacks = [f for f in handle.outer if not f.refused]
    captured = {id(f): f._backend.captures if f._backend is not None else 0 for f in stacks}
    try:
        _two_fused_steps(zoo, "whole stack, fused training")
        # each stack trained through a capture of its own, or says why it ran its original forward
        silent = [f for f in stacks if not f.fallbacks and (f._backend is None or f._backend.captures == captured[id(f)])]
        assert not silent, f"{zoo.arch.name}: whole stacks that neither captured for training nor said why: {silent}"
    finally:
        handle.train_fused(False)
        handle.set_outer(False)


def test_hooks(zoo):
    zoo.ready()
    plain = run(zoo.ref, zoo.inputs)
    target = hook_target(zoo.ref, zoo.inputs, plain, [q for q, _ in patched_modules(zoo.model)])
    name = f"{zoo.arch.name} (hooks on {target} added after optimize)"
    calls = {"patched": 0, "copy": 0}
    handles = []
    for which, m in (("patched", zoo.model), ("copy", zoo.ref)):
        sub = m.get_submodule(target)
        handles.append(sub.register_forward_hook(scale))
        handles.append(sub.register_forward_hook(lambda mod, args, out, w=which: calls.__setitem__(w, calls[w] + 1)))
    try:
        bad = []
        # inference_mode is the mode optimize captured in; under no_grad dynamo may capture afresh
        for mode in (torch.inference_mode, torch.no_grad):
            calls.update(patched=0, copy=0)
            got, want = run(zoo.model, zoo.inputs, mode=mode), run(zoo.ref, zoo.inputs, mode=mode)
            where = f"{name}, {mode.__name__}"
            bad += differences(where, got, want)
            if calls["patched"] != calls["copy"]:
                bad.append(f"{where}: the recording hook ran {calls['patched']} time(s), "
                           f"on the unpatched copy {calls['copy']}")
        _assert_none(bad)
    finally:
        for h in handles:
            h.remove()


def test_generate(zoo):
    """Models that generate (causal LMs, encoder-decoders): `generate` (greedy, 4 new tokens, the cache as
    configured: the steps after the first feed one token and the cache) gives the copy's tokens and scores."""
    zoo.ready()
    if not (hasattr(zoo.ref, "can_generate") and zoo.ref.can_generate()):
        pytest.skip(f"{zoo.arch.name}: {type(zoo.ref).__name__} does not generate")
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    name = f"{zoo.arch.name} (generate)"
    with torch.no_grad():
        want, got = zoo.ref.generate(**zoo.inputs, **kw), zoo.model.generate(**zoo.inputs, **kw)
    bad = [] if torch.equal(got.sequences, want.sequences) else \
        [f"{name}: generated tokens {got.sequences.tolist()} != the copy's {want.sequences.tolist()}"]
    _assert_none(bad + differences(name, got.scores, want.scores))


def test_shapes_past_the_budget(zoo):
    """With the dynamic-shape compile on (`optimize(..., dynamic=True)`, the GPU's default), calls at new shapes past
    the capture budget run Inductor's compile of the original forwards (counted) and give the copy's outputs: other
    batch sizes, and other lengths for text models; models that generate give the copy's tokens, their decode steps
    through the same compile."""
    zoo.ready()
    handle = zoo.report.handle
    handle.settle(any_shape=True)  # as optimize leaves a model on a GPU: two more captures, then the compile
    b, size = zoo.arch.other
    shapes = [(b + 1, size), (b + 2, size), (b + 3, size)]
    if zoo.arch.family in ("causal-lm", "encoder", "encoder-decoder"):
        shapes.append((b + 3, size + 2))
    bad = []
    for shape in shapes:
        x = zoo.arch.inputs(*shape)
        bad += differences(f"{zoo.arch.name} past the budget, (batch, size) = {shape}", run(zoo.model, x), run(zoo.ref, x))
    if hasattr(zoo.ref, "can_generate") and zoo.ref.can_generate():
        kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
        with torch.no_grad():
            want, got = zoo.ref.generate(**zoo.inputs, **kw), zoo.model.generate(**zoo.inputs, **kw)
        if not torch.equal(got, want):
            bad.append(f"{zoo.arch.name} (generate past the budget): tokens {got.tolist()} != {want.tolist()}")
    _assert_none(bad)
    # Where Inductor cannot compile a module at symbolic sizes (Segformer's strided convolutions on the CPU: a
    # LoweringException), that forward's calls run its original ops, and the reason is in its fallbacks
    failed = {q: f.any_shape.failed for q, f in handle.forwards.items() if f.any_shape and f.any_shape.failed}
    said = {why for whys in handle.fallbacks().values() for why in whys}
    assert handle.any_shape_calls() or failed, \
        f"{zoo.arch.name}: calls past the budget neither ran the dynamic-shape compile nor said why ({handle.fallbacks()})"
    assert all(why in said for why in failed.values()), f"{zoo.arch.name}: a failed compile not in the fallbacks"


def test_unpatch(zoo):
    zoo.ready()
    advisor.unpatch(zoo.model)
    zoo.unpatched = True
    assert not patched_modules(zoo.model), f"{zoo.arch.name}: modules still patched after unpatch"
    _assert_none(differences(f"{zoo.arch.name} (after unpatch)", run(zoo.model, zoo.inputs), run(zoo.ref, zoo.inputs),
                             exact=True))

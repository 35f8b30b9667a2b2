"""Candidates the trace found but the captured graphs did not (zoo, H100 session 16), on tiny models of the zoo
(random weights, the CPU, kernels in Triton's interpreter, real captures):

- BART's embedding `mul` -> `add` -> `layer_norm` (and ConvNeXt's layer scale -> residual add -> the next
  stage's LayerNorm) were found nowhere: a shorter pattern ranked before them (the residual `add` ->
  `layer_norm`; the `mul` -> `add` of every block) was substituted first and took their ops. The longer
  pattern now goes first (`workflows.kernels.substitution_order`, `patching.containment`).
- Mistral's rotary embedding continued into the KV cache (`... -> cat -> clone`): the `cat` the trace took
  for an intermediate is the cache's new keys, returned by the captured graph, so no kernel writing only
  the clone can replace it. Said as such (`Status.ESCAPES`), not as "computes it differently".
- A ResNet's stem: conv -> BatchNorm -> ReLU -> max-pool is both a conv epilogue's site (cuDNN's fused conv,
  the pool left to eager) and a window chain's (BatchNorm + ReLU + max-pool in one kernel). The window goes first
  there (`patching.plan.patch_order`); every other conv + BatchNorm + ReLU is the conv epilogue's.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo_models import BY_NAME  # noqa: E402

import advisor  # noqa: E402
from advisor.status import Status  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning", "ignore::RuntimeWarning")


def _optimized(name: str, tmp_path, **kw):
    arch = BY_NAME[name]
    model = arch.model()
    report = advisor.optimize(model, arch.inputs(*arch.example), interpret=True, reuse=False,
                              out=tmp_path / name, **kw)
    advisor.unpatch(model)
    return report


def _statuses(report) -> str:
    return "; ".join(f"{p['candidate']} {p['title']}: {p.get('status')}" for p in report.patterns)


def test_a_longer_pattern_takes_its_ops_before_a_shorter_one_inside_it(tmp_path):
    # The whole model as one capture: the embedding's ops and every layer's residual add + LayerNorm in one graph.
    report = _optimized("bart", tmp_path, top=8, granularity="root")
    longer = [p for p in report.patterns if p["title"].endswith("mul → add → layer_norm")]
    shorter = [p for p in report.patterns if p["title"].endswith(": add → layer_norm")]
    assert longer and shorter, _statuses(report)
    assert all(p["status_code"] == Status.PATCHED.value and p["sites"] >= 1 for p in longer + shorter), \
        _statuses(report)


def test_a_pattern_whose_intermediate_the_capture_returns_says_so(tmp_path):
    report = _optimized("mistral", tmp_path)
    into_cache = [p for p in report.patterns if p["title"].startswith("Rotary") and p["title"].endswith("cat → clone")]
    assert into_cache, _statuses(report)
    p = into_cache[0]
    assert p["status_code"] == Status.ESCAPES.value, _statuses(report)
    assert "cat (op 6 of 7)" in p["status"] and "output of the captured graph" in p["status"], p["status"]
    rotary = [q for q in report.patterns if q["title"].endswith("Rotary embedding: mul → neg → cat → mul → add")]
    assert rotary and rotary[0]["status_code"] == Status.PATCHED.value, _statuses(report)  # the part that can be


def test_a_stem_goes_to_the_window_chain_and_the_other_convs_to_the_conv_epilogue(tmp_path):
    report = _optimized("resnet", tmp_path)
    window = [p for p in report.patterns if p["title"].endswith("batch_norm → relu → max_pool2d")]
    conv = [p for p in report.patterns if p["title"].startswith("conv2d epilogue (BatchNorm + ReLU")]
    assert window and conv, _statuses(report)
    assert window[0]["status_code"] == Status.PATCHED.value and window[0]["sites"] == 1, _statuses(report)
    assert any(p["status_code"] == Status.PATCHED.value and p["sites"] >= 1 for p in conv), _statuses(report)


def test_patch_order_puts_extensions_before_their_chain():
    from advisor.patching.plan import PatternSpec, patch_order

    def spec(cid):
        return PatternSpec(candidate=cid, pattern_id=cid, title=cid, program={}, replacement="kernel")

    by_cand = {"bn_relu": {"kind": "norm", "ops": ["aten::batch_norm", "aten::relu_"]},
               "rope": {"kind": "fusion", "ops": ["aten::mul", "aten::add"]},
               "conv": {"kind": "epilogue", "extends": "bn_relu",
                        "ops": ["aten::conv2d", "aten::batch_norm", "aten::relu_"]},
               "pool": {"kind": "norm", "extends": "bn_relu",
                        "ops": ["aten::batch_norm", "aten::relu_", "aten::max_pool2d"]},
               "gelu": {"kind": "epilogue", "extends": "rope", "ops": ["aten::linear", "aten::mul", "aten::add"]}}
    order = patch_order([spec(c) for c in ("bn_relu", "rope", "conv", "gelu", "pool")], by_cand)
    assert [s.candidate for s in order] == ["pool", "conv", "bn_relu", "rope", "gelu"]

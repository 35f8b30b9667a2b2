"""Models as users have them (issue #47): PyTorch's nested-tensor fast path, and models called at many shapes.

`nn.TransformerEncoder` (inside `nn.Transformer` too) called in inference with a `src_key_padding_mask` packs
its layers' inputs into a nested tensor, when the MHA fast path is on (the user's default). The profile runs
with it off (`advisor.fast_paths`), so the layers were patched, and then handed nested tensors: their capture
ran under the same flag off, where `nn.MultiheadAttention` refuses a nested tensor, and `optimize` raised
(before the fast paths were switched off in the profile, PyTorch's execution-trace observer met the nested
tensors, disabled itself, and the profiler's next region killed the interpreter with SIGSEGV). A patched
forward handed a nested tensor now runs its original forward on the caller's fast path, and says why.

Dynamo's recompile limit: a captured module called at more shapes than one capture holds printed dynamo's
warning block on the user's terminal. A capture now holds at most `GRAPHS_PER_CAPTURE` graphs and runs
further shapes without compiling, said in the report; a limit dynamo reaches inside one of our captures
(a frame it compiles where the graph breaks) is noted there, not printed. The user's own `torch.compile`
still warns as before.
"""
from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from torch import nn

import advisor
from advisor.errors import AdvisorError
from advisor.patching import forward as patched_forward, patched_modules
from advisor.status import Status

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    src = torch.randn(2, 8, 32)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[1, 5:] = True  # the second sequence padded after 5 positions
    return model, {"src": src, "src_key_padding_mask": mask}


def test_layers_handed_nested_tensors_run_their_own_ops(tmp_path):
    model, inputs = _encoder()
    untouched = copy.deepcopy(model)
    with torch.no_grad():
        report = advisor.optimize(model, inputs, out=tmp_path, reuse=False, interpret=True)
        got, want = model(**inputs), untouched(**inputs)
    assert torch.equal(got, want)  # PyTorch's own fast path ran: padded positions zero, as unpatched
    assert torch.backends.mha.get_fastpath_enabled()
    doc = json.loads((tmp_path / "apply.json").read_text())
    assert doc["fallbacks"] and all(patched_forward.NESTED_INPUT in why for why in doc["fallbacks"].values()), \
        doc["fallbacks"]
    assert report.patterns and all(p["status_code"] == Status.NOT_CALLED.value and "nested-tensor" in p["status"]
                                   for p in report.patterns), [(p["title"], p["status"]) for p in report.patterns]
    assert "nested-tensor input" in str(report)


def test_a_capture_computing_otherwise_than_eager_is_not_kept(tmp_path):
    """Captured whole, the encoder computes its padded positions (dynamo does not take the nested-tensor path),
    where the eager model leaves them zero: no kernel is to blame, the model is handed back unpatched."""
    model, inputs = _encoder()
    untouched = copy.deepcopy(model)
    with torch.no_grad():
        report = advisor.optimize(model, inputs, out=tmp_path, reuse=False, interpret=True, granularity="root")
        got, want = model(**inputs), untouched(**inputs)
    assert torch.equal(got, want)
    assert report.manifest == [] and not patched_modules(model)
    assert all("no kernel at all" in p["status"] for p in report.patterns), [p["status"] for p in report.patterns]


def test_nested_example_inputs_are_refused_before_profiling():
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    nested = torch.nested.nested_tensor([torch.randn(5, 32), torch.randn(8, 32)])
    with pytest.raises(AdvisorError, match="nested tensor"):
        advisor.optimize(layer, (nested,), interpret=True, reuse=False)
    assert "forward" not in layer.__dict__  # never patched


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.fc(x).relu())


class _ManyLengths(nn.Module):
    """Its blocks are called at one length per input: each length is a graph of each block's capture."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, xs):
        out = []
        for x in xs:
            for block in self.blocks:
                x = block(x)
            out.append(x)
        return out


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def dynamo_warnings():
    """What dynamo logs at WARNING, whether or not a handler prints it."""
    handler, logger = _Records(), logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def test_recompiles_are_bounded_by_the_capture(tmp_path, capfd, dynamo_warnings):
    torch.manual_seed(0)
    model = _ManyLengths().eval()
    untouched = copy.deepcopy(model)
    xs = [torch.randn(2, n, 16) for n in range(2, 2 + patched_forward.GRAPHS_PER_CAPTURE + 3)]
    with torch.no_grad():
        report = advisor.optimize(model, (xs,), out=tmp_path, reuse=False, interpret=True)
        got, want = model(xs), untouched(xs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    err = capfd.readouterr().err
    assert "recompile_limit" not in err and not [m for m in dynamo_warnings if "recompile_limit" in m], err[-2000:]
    fallbacks = json.loads((tmp_path / "apply.json").read_text())["fallbacks"]
    assert any(patched_forward.FULL in why for why in fallbacks.values()), fallbacks  # what it stopped at
    assert patched_forward.FULL in str(report)


def _helper(x):
    torch._dynamo.graph_break()
    return x * 2


def test_dynamo_limits_inside_our_captures_are_noted_and_the_users_own_still_warn(dynamo_warnings):
    """A frame dynamo compiles where the graph breaks (a helper shared by every capture) reaching its limit inside
    one of our captures is ours to account for; the user's own compiled functions warn as dynamo has them."""
    def ours(x):
        return _helper(x) + 1

    compiled = torch.compile(ours, backend="eager", dynamic=False)
    limit = torch._dynamo.config.recompile_limit
    with patched_forward.dynamo_limits_noted() as noted:
        for n in range(1, limit + 3):
            compiled(torch.randn(n))
    assert noted and "recompile_limit" in noted[0], noted
    assert not [m for m in dynamo_warnings if "recompile_limit" in m], dynamo_warnings

    def users(x):
        return x.sin() + 1

    theirs = torch.compile(users, backend="eager", dynamic=False)
    for n in range(1, limit + 3):
        theirs(torch.randn(n))
    assert [m for m in dynamo_warnings if "recompile_limit" in m], dynamo_warnings

"""AOTAutograd's inference graphs kept across processes (`advisor/patching/aot_cache.py`, issue 17).

Real dynamo captures through our backend, real AOTAutograd: a graph lowered once is written as plain data and
a later capture of the same dynamo graph (a new process: the in-process sharing cleared) rebuilds it without
running AOTAutograd, with the same outputs; graphs whose lowering AOTAutograd's runtime would have to wrap (an
input written in place) are never kept; a broken cache file is lowered again.
"""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torch._functorch.aot_autograd as aot_autograd
from advisor.patching import aot_cache, capture, timing
from advisor.patching.capture import Backend, CaptureLog


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSION_ADVISOR_CACHE", str(tmp_path / "cache"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x) + torch.tensor(0.5)  # a constant the lowered graph holds
        return torch.nn.functional.gelu(h)[:, 1:] * 2, h.sum(-1)


class Writes(torch.nn.Module):
    def forward(self, x):
        x.mul_(2)  # an input written in place: AOTAutograd's runtime copies the result back
        return x + 1


def _capture(module, x):
    """A capture as a new process makes it: nothing shared in process, a fresh compiled function."""
    capture._SHARED.clear()
    torch._dynamo.reset()
    backend = Backend([], CaptureLog(), "no patterns")
    with torch.no_grad():
        return torch.compile(type(module).forward, backend=backend, dynamic=False)(module, x)


def _files():
    return sorted(aot_cache.folder().glob("*.pkl")) if aot_cache.folder().is_dir() else []


def test_a_graph_lowered_once_is_rebuilt_without_aotautograd(monkeypatch):
    torch.manual_seed(0)
    block, x = Block().eval(), torch.randn(4, 6, 8)
    with torch.no_grad():
        expected = block(x)
    first = _capture(block, x)
    assert len(_files()) == 1
    hits = timing.SECONDS["aot cache hits"]

    def refused(*a, **k):
        raise AssertionError("AOTAutograd ran for a graph it had lowered before")

    monkeypatch.setattr(aot_autograd, "aot_module_simplified", refused)
    again = _capture(block, x)
    assert timing.SECONDS["aot cache hits"] == hits + 1
    for a, b, c in zip(first, again, expected):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c, rtol=0, atol=0)

    other = torch.randn(4, 6, 8)  # the rebuilt graph computes, it does not replay the first inputs' results
    with torch.no_grad():
        torch.testing.assert_close(_capture(block, other)[0], block(other)[0], rtol=0, atol=0)


def test_other_input_layouts_have_other_keys():
    block = Block().eval()
    _capture(block, torch.randn(4, 6, 8))
    _capture(block, torch.randn(4, 6, 8).transpose(0, 1))
    _capture(block, torch.randn(2, 6, 8))
    assert len(_files()) == 3


def test_a_graph_that_writes_an_input_is_never_kept():
    x = torch.ones(3)
    out = _capture(Writes(), x)
    assert _files() == []
    torch.testing.assert_close(x, torch.full((3,), 2.0))  # the caller's tensor written, as eagerly
    torch.testing.assert_close(out, torch.full((3,), 3.0))


def test_a_broken_cache_file_is_lowered_again():
    block, x = Block().eval(), torch.randn(4, 6, 8)
    _capture(block, x)
    [path] = _files()
    path.write_bytes(b"not a graph")
    hits = timing.SECONDS["aot cache hits"]
    with torch.no_grad():
        torch.testing.assert_close(_capture(block, x)[0], block(x)[0])
    assert timing.SECONDS["aot cache hits"] == hits
    assert path.read_bytes() != b"not a graph"  # written again by the new lowering


def test_plain_data_round_trip_keeps_code_constants_and_layouts():
    def f(x):
        return (x[1:] * torch.tensor([2.0, 3.0, 4.0])).sum(0), x.t()

    g = make_fx(f, tracing_mode="fake")(torch.randn(5, 3))
    back = aot_cache.load(aot_cache.dump(g))
    assert back.code == g.code
    for a, b in zip(g.graph.nodes, back.graph.nodes):
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor):
            assert (va.shape, va.stride(), va.storage_offset(), va.dtype) == \
                (vb.shape, vb.stride(), vb.storage_offset(), vb.dtype)
    x = torch.randn(5, 3)
    for a, b in zip(f(x), back(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_nothing_is_kept_under_autocast():
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    assert aot_cache.key(gm, [torch.randn(2)]) is not None
    with torch.autocast("cpu"):
        assert aot_cache.key(gm, [torch.randn(2)]) is None


def test_a_rebuilt_graph_matches_the_patterns_the_lowered_one_did(tmp_path):
    """The zoo's convnet: its conv + BatchNorm (+ add) + ReLU epilogues are substituted in a graph rebuilt from the
    cache as in the one AOTAutograd lowered (the patterns are built in the state AOTAutograd calls its compilers
    in: under it BatchNorm decomposes to `_native_batch_norm_legit_no_training`, outside it to `native_batch_norm`)."""
    import sys
    from pathlib import Path

    import advisor

    sys.path.insert(0, str(Path(__file__).parent))
    from zoo_models import BY_NAME

    arch = BY_NAME["convnet"]
    model, inputs = arch.model(), arch.inputs(2, 16)
    report = advisor.optimize(model, inputs, out=tmp_path / "out", interpret=True, reuse=False)
    sites = {s.key: report.handle.sites(s.key) for s in report.handle.plan.patterns if report.handle.sites(s.key)}
    assert any(n for k, n in sites.items() if "conv2d epilogue" in report.handle.plan.spec(k).title), sites
    advisor.unpatch(model)

    capture._PATTERNS.clear()  # as in a new process: nothing built, shared or logged
    capture._SHARED.clear()
    capture._LOGS.clear()
    torch._dynamo.reset()
    hits = timing.SECONDS["aot cache hits"]
    again = advisor.patch(model, tmp_path / "out")
    with torch.no_grad():
        got = model(**inputs)
    assert timing.SECONDS["aot cache hits"] > hits
    assert {s.key: again.sites(s.key) for s in again.plan.patterns if again.sites(s.key)} == sites
    advisor.unpatch(model)
    with torch.no_grad():
        torch.testing.assert_close(got, model(**inputs), rtol=1e-4, atol=1e-4)

    # Patterns are kept per decomposition state: each state's BatchNorm graph is matched by its own
    from torch._dispatch.python import enable_python_dispatcher

    from advisor.patching.match import find
    from advisor.patching.program import program_graph

    spec = next(s for s in report.handle.plan.patterns if s.title.startswith("BatchNorm + ReLU"))
    program = spec.shapes()[0][0]
    capture._PATTERNS.clear()
    with enable_python_dispatcher():
        inside = program_graph(program, "cpu")
        assert find(capture.pattern_of(spec, 0, program, "cpu"), inside.graph) is not None
    outside = program_graph(program, "cpu")
    assert {str(n.target) for n in inside.graph.nodes} != {str(n.target) for n in outside.graph.nodes}
    assert find(capture.pattern_of(spec, 0, program, "cpu"), outside.graph) is not None

"""Identity copies dropped from captured inference graphs (advisor/patching/noop_copies.py): eval-mode
dropout's clone goes, a clone anyone could observe stays. Real aten graphs from AOTAutograd and make_fx."""
from __future__ import annotations

import torch
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch.fx.experimental.proxy_tensor import make_fx

from advisor.patching.noop_copies import drop_identity_copies


def clones(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default)


def inference_graph(module, *inputs):
    """The graph AOTAutograd hands an inference compiler (what `capture.Backend` rewrites)."""
    graphs = []

    def compiler(g, _):
        graphs.append(g)
        return make_boxed_func(g.forward)

    def backend(gm, example):
        return aot_module_simplified(gm, example, fw_compiler=compiler, inference_compiler=compiler)

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=backend, dynamic=False)(*inputs)
    return graphs[0]


class Block(torch.nn.Module):
    """Dropout in eval mode between a projection and a residual add, as transformer layers have it."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.proj(x)) + x


def test_eval_dropout_copy_is_dropped_and_outputs_stay():
    torch.manual_seed(0)
    block, x = Block().eval(), torch.randn(3, 5, 16)
    gm = inference_graph(block, x)
    assert clones(gm) == 1  # AOTAutograd's spelling of eval-mode dropout
    args = [block.proj.weight.detach(), block.proj.bias.detach(), x]  # parameters lifted first, as dynamo orders them
    with torch.no_grad():
        expected = block(x)
        torch.testing.assert_close(gm(*args)[0], expected, rtol=0, atol=0)
        assert drop_identity_copies(gm) == 1
        assert clones(gm) == 0
        torch.testing.assert_close(gm(*args)[0], expected, rtol=0, atol=0)


def test_a_returned_clone_stays():
    """Handing back the source instead would make the output alias the caller's input."""
    gm = make_fx(lambda x: (x.clone(), x * 2))(torch.randn(4, 4))
    assert drop_identity_copies(gm) == 0 and clones(gm) == 1
    gm = make_fx(lambda x: x.clone().view(16))(torch.randn(4, 4))  # a view of it returned: the same
    assert drop_identity_copies(gm) == 0 and clones(gm) == 1


def test_a_written_clone_or_source_stays():
    def writes_the_copy(x):
        y = x.clone()
        y.add_(1)
        return y + x

    def writes_the_source(x):
        y = x.clone()
        x.view(-1).mul_(2)  # through a view: the base is written
        return y + 1

    for fn in (writes_the_copy, writes_the_source):
        x = torch.randn(4, 4)
        gm = make_fx(fn)(x.clone())
        assert drop_identity_copies(gm) == 0 and clones(gm) == 1, fn.__name__
        a, b = x.clone(), x.clone()
        torch.testing.assert_close(gm(a), fn(b))


def test_a_layout_changing_clone_stays():
    """`.t().clone(memory_format=contiguous)` makes a transposed tensor contiguous: real work, kept."""
    gm = make_fx(lambda x: x.t().clone(memory_format=torch.contiguous_format) + 1)(torch.randn(4, 6))
    assert drop_identity_copies(gm) == 0 and clones(gm) == 1

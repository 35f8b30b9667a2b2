"""Drop the copies a captured inference graph makes of tensors nobody writes: eval-mode dropout.

In eager, `nn.Dropout` in eval mode returns its input: no kernel. AOTAutograd decomposes it to
`aten.clone`, so every dropout of a captured layer becomes a full copy of an activation: timm's ViT-B
at batch 128 ran three 38.7 MB copies per layer (1.9 ms of a 13 ms call on the H100, `Memcpy DtoD`
in kernel_diff of suite_vit, docs/EXPERIMENTS.md), BERT and GPT-2 three per layer as well. A clone is
dropped, its users reading its source instead, only when that changes nothing anyone can observe:
- it keeps the layout (same shape and strides: a clone that makes a tensor contiguous is real work);
- neither it nor its source is written by any op of the graph (after functionalization the only
  writes are the `copy_`s back into mutated inputs), so the two can never differ;
- no graph output is it or a view of it: an output must not alias the source (a graph input the
  caller holds, or another output) where eager handed back a tensor of its own.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from advisor.patching.match import is_view, layout


def drop_identity_copies(gm: GraphModule) -> int:
    """Remove the identity clones of `gm`'s graph (see the module's docstring); returns how many."""
    graph = gm.graph
    written = {_root(a) for n in graph.nodes for a in _written_args(n)}
    returned = _returned(graph)
    dropped = 0
    for n in list(graph.nodes):
        if n.target is not torch.ops.aten.clone.default or not isinstance(n.args[0], Node):
            continue
        src = n.args[0]
        mine, theirs = layout(n), layout(src)
        if mine is None or theirs is None or mine[0] != theirs[0] or mine[1] != theirs[1] or mine[3] != theirs[3]:
            continue
        if n in written or _root(src) in written or n in returned:
            continue
        n.replace_all_uses_with(src)
        graph.erase_node(n)
        dropped += 1
    if dropped:
        gm.recompile()
    return dropped


def _written_args(n: Node) -> list[Node]:
    """The nodes an op writes into (its schema's mutable arguments)."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
        if isinstance(value, Node):
            out.append(value)
    return out


def _root(n: Node) -> Node:
    """The tensor a chain of views reads (a write through a view writes its base)."""
    while is_view(n) and n.args and isinstance(n.args[0], Node):
        n = n.args[0]
    return n


def _returned(graph) -> set[Node]:
    """Every node whose value leaves the graph: the outputs and, through views, what they view."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    stack, seen = list(out.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_view(n) and n.args and isinstance(n.args[0], Node):
            stack.append(n.args[0])
    return seen

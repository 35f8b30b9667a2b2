"""Host-to-GPU copies inside a captured graph, made recordable as CUDA graphs.

A CUDA graph records a copy from host memory only when the memory is pinned and the copy asynchronous:
a plain `_to_copy(x, device="cuda")` of a CPU tensor stops the recording ("operation not permitted when
stream is capturing"), and the captured module then runs op by op, slower than eager (the H100 zoo's
Mistral: its layers copy a 0-dim step counter to the GPU, its whole stack the tensor constants its mask
code creates). Two sources are made safe, both pinned and never changed while a recording may read them:
- a 0-dim CPU graph input: `graphs.Graphed` keys each recording by its value and keeps it in a pinned
  buffer (see `graphs._host_scalar`);
- a tensor constant of the graph (`get_attr`, read through `lift_fresh_copy`): pinned here, once.
The copy reading one of them becomes `non_blocking`. Any other host tensor is left as it is: its
recording fails, says where (`Graphed.failed`), and that capture runs op by op.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.fx import GraphModule, Node

from advisor.ops.registry import lookup


def _tagged(node: Node, tag: str) -> bool:
    if node.op != "call_function" or not hasattr(node.target, "name"):
        return False
    info = lookup(node.target.name().split(".")[0])
    return info is not None and tag in info.tags


def _attr(gm: GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _set_attr(gm: GraphModule, target: str, value) -> None:
    *path, last = target.split(".")
    owner = gm
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, last, value)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of a real constant. AOTAutograd calls the inference compiler with its fake mode still
    on, where `pin_memory` on a real tensor raises ("Please convert all Tensors to FakeTensors": the
    H100 zoo's Mistral, whose whole-stack graph holds its mask code's constants)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return t.pin_memory()


def _copies_to(gm: GraphModule, device_type: str) -> list[tuple[Node, object, Node | None]]:
    """(copy, source, lift) for each copy in `gm` to a `device_type` device: its source read through a fresh
    copy of a graph constant (`lift`, the `lift_fresh_copy` node, else None)."""
    out = []
    for node in list(gm.graph.nodes):
        device = node.kwargs.get("device") if _tagged(node, "device_copy") else None
        if device is None or torch.device(device).type != device_type:
            continue
        src, lift = node.args[0], None
        if isinstance(src, Node) and _tagged(src, "constant_lift") and isinstance(src.args[0], Node) \
                and src.args[0].op == "get_attr":
            src, lift = src.args[0], src
        out.append((node, src, lift))
    return out


def make_host_copies_recordable(gm: GraphModule, pin: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
    """Rewrites `gm` in place; returns how many host-to-GPU copies became recordable. `pin` pins a
    constant (tests on a machine without a GPU pass a stand-in)."""
    pin = pin or _pinned
    changed = 0
    for node, src, lift in _copies_to(gm, "cuda"):
        if node.kwargs.get("non_blocking"):
            continue
        if lift is not None:
            if len(lift.users) != 1:
                continue  # the fresh host copy is read elsewhere too: the copy reads it, unpinned
            node.replace_input_with(lift, src)  # the copy to the GPU is fresh already
            gm.graph.erase_node(lift)
        if not isinstance(src, Node):
            continue
        if src.op == "get_attr":
            const = _attr(gm, src.target)
            if not isinstance(const, torch.Tensor) or const.device.type != "cpu":
                continue
            _set_attr(gm, src.target, pin(const))
        elif src.op == "placeholder":
            v = src.meta.get("val")
            if not (isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu"):
                continue
        else:
            continue
        node.kwargs = {**node.kwargs, "non_blocking": True}
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def constants_on_device(gm: GraphModule, device_type: str = "cuda") -> int:
    """Each copy of a host tensor constant to the device (`get_attr` -> `_to_copy(device=...)`) made once, here:
    the graph then reads the device copy as its constant. For a graph Inductor compiles, whose own code would
    copy the constant on every call, synchronously, which a CUDA-graph recording refuses. A graph constant never
    changes, so the copy made now is the copy every call made. Returns how many copies went."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    changed = 0
    for node, src, _ in _copies_to(gm, device_type):  # (a fresh copy of the constant read through: dead after)
        if not (isinstance(src, Node) and src.op == "get_attr"):
            continue
        const = _attr(gm, src.target)
        if not isinstance(const, torch.Tensor) or const.device.type != "cpu":
            continue
        try:
            with unset_fake_temporarily():  # (AOTAutograd's fake mode is on while its compilers run)
                value = node.target(const, *node.args[1:], **node.kwargs)
        except Exception:  # left as it was: its recording may fail, and says so
            continue
        name = f"{src.target.replace('.', '_')}_on_{device_type}_{changed}"
        _set_attr(gm, name, value)
        with gm.graph.inserting_before(node):
            moved = gm.graph.get_attr(name)
        moved.meta.update(node.meta)
        node.replace_all_uses_with(moved)
        gm.graph.erase_node(node)
        changed += 1
    if changed:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return changed

"""AOTAutograd's inference graphs kept across processes: a graph dynamo traced before skips AOTAutograd.

A warm-cache `optimize` (its plan reused in a new process), a bundle's `patch` or the user's next run capture
the model again: dynamo traces it, AOTAutograd lowers dynamo's graph to functional aten ops, and we rewrite
that. What AOTAutograd hands the inference compiler depends on dynamo's graph (its code), the inputs' layouts,
grad mode and torch alone, and lowering it was 1.2-2.1 s of Llama's 3.6-6.2 s warm start on the H200
(reports/cold-start/aot-cache). So a plain inference graph (no input it writes, every output a fresh
tensor: AOTAutograd's runtime wrappers then pass arguments and outputs through untouched) is written to
FUSION_ADVISOR_CACHE/graphs/ as plain data (each node's op, target, arguments and its value's layout), and
a later capture of the same dynamo graph (`lookup`) rebuilds it, with fake values for the rewrite, instead of
lowering it again. Anything outside that vocabulary (higher-order ops, symbolic sizes, autocast, tensor
subclasses, tensors over 1 MB held by the graph) is lowered by AOTAutograd every time, as before; a cache file that
does not load is ignored.
"""
from __future__ import annotations

import hashlib
import json
import operator
import pickle
from pathlib import Path

import torch
from torch import fx

from advisor.codegen.cache import cache_dir
from advisor.jsonio import atomic_write
from advisor.patching import timing
from advisor.patching.program import extent

FORMAT = 1


class Unsupported(Exception):
    """Outside what a cached graph may hold."""


def folder() -> Path:
    return cache_dir().parent / "graphs"


def key(gm: fx.GraphModule, example_inputs) -> str | None:
    """The cache key of dynamo graph `gm` called with `example_inputs`, or None where nothing is cached for it
    (inputs other than plain tensors, constants or parameters held by the graph, autocast on)."""
    if any(n.op == "get_attr" for n in gm.graph.nodes) or any(True for _ in gm.parameters()) or \
            any(True for _ in gm.buffers()):
        return None
    if any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        return None
    metas = []
    for x in example_inputs:
        if not isinstance(x, torch.Tensor) or not _plain_tensor(x) or x.layout != torch.strided:
            return None
        metas.append((tuple(x.shape), tuple(x.stride()), int(x.storage_offset()), str(x.dtype), x.device.type,
                      x.requires_grad))
    doc = [FORMAT, torch.__version__, gm.code, metas, torch.is_grad_enabled()]
    return hashlib.sha256(json.dumps(doc, default=str).encode()).hexdigest()[:32]


def _plain_tensor(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return type(x) in (torch.Tensor, torch.nn.Parameter, FakeTensor)


def lookup(k: str | None) -> fx.GraphModule | None:
    """The inference graph stored under key `k`, rebuilt, or None."""
    if k is None:
        return None
    path = folder() / f"{k}.pkl"
    if not path.is_file():
        return None
    try:
        with timing.timed("aot cache"):
            doc = pickle.loads(path.read_bytes())
            if doc.get("format") != FORMAT:
                return None
            return load(doc)
    except Exception:  # noqa: BLE001  (a broken or foreign file: lowered again, and rewritten below)
        return None


def store(k: str | None, g: fx.GraphModule, example_inputs) -> bool:
    """Keep inference graph `g` (AOTAutograd's, before any rewrite) under key `k` where AOTAutograd's runtime does
    nothing around it (`_plain_lowering`) and every node is in the cached vocabulary. Returns whether it was
    written."""
    if k is None or not _plain_lowering(g, example_inputs):
        return False
    try:
        with timing.timed("aot cache"):
            atomic_write(folder() / f"{k}.pkl", pickle.dumps({"format": FORMAT, **dump(g)}))
        return True
    except Exception:  # noqa: BLE001  (outside the vocabulary, a full disk: lowered again next time, never a failure)
        return False


def _plain_lowering(g: fx.GraphModule, example_inputs) -> bool:
    """Whether AOTAutograd's runtime wrappers pass `g`'s arguments and outputs through untouched: no input mutated
    (its wrapper would copy the result back), every output a fresh tensor (no alias of an input or of another
    output, which its wrapper regenerates as views), no effect tokens, and one graph input per dynamo input."""
    try:
        from torch._functorch._aot_autograd.schemas import OutputType
        from torch._guards import TracingContext

        ctx = TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None)
        if meta is None:
            return False
        placeholders = [n for n in g.graph.nodes if n.op == "placeholder"]
        outputs = next(n for n in reversed(g.graph.nodes) if n.op == "output").args[0]
        return (len(placeholders) == len(example_inputs)
                and not any(i.mutates_data or i.mutates_metadata for i in meta.input_info)
                and all(o.output_type == OutputType.non_alias for o in meta.output_info)
                and not meta.num_intermediate_bases and not meta.tokens
                and isinstance(outputs, (tuple, list)) and len(outputs) == len(meta.output_info))
    except Exception:  # noqa: BLE001  (another torch's internals: not cached)
        return False


# ------------------------------------------------------------------------------------------ plain data
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


MAX_CONSTANT_BYTES = 1 << 20  # a tensor the graph holds (a scalar `torch.tensor(...)` made in the forward)


def dump(g: fx.GraphModule) -> dict:
    """The graph as plain data: [(op, name, target, args, kwargs, value layout)] in order, and the tensors it
    holds (`get_attr`: AOTAutograd lifts tensors made from constants in the forward) by name, on the CPU."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    index: dict = {}
    nodes, constants = [], {}
    for n in g.graph.nodes:
        if n.op not in ("placeholder", "call_function", "output", "get_attr"):
            raise Unsupported(n.op)
        if n.op == "get_attr":
            t = getattr(g, n.target, None)
            if not isinstance(t, torch.Tensor) or not _plain_tensor(t) or t.requires_grad or \
                    t.numel() * t.element_size() > MAX_CONSTANT_BYTES:
                raise Unsupported(f"constant {n.target}")
            with unset_fake_temporarily():  # (AOTAutograd's fake mode is on while its compilers run)
                constants[n.target] = (t.detach().cpu().clone(), str(t.device))
        target = _target_name(n.target) if n.op == "call_function" else n.target
        value = None if n.op == "output" else _layout(n.meta.get("val"))
        nodes.append((n.op, n.name, target, _encode(n.args, index), _encode(n.kwargs, index), value))
        index[n] = len(nodes) - 1
    return {"nodes": nodes, "constants": constants}


def load(doc: dict) -> fx.GraphModule:
    """`dump`'s graph rebuilt, each node's value a fake tensor of its layout (all the rewrite reads), its fake mode
    in `meta["fake_mode"]`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    graph = fx.Graph()
    made: list = []
    for op, name, target, args, kwargs, value in doc["nodes"]:
        a, kw = _decode(args, made), _decode(kwargs, made)
        if op == "output":
            node = graph.output(a[0])
        else:
            node = graph.create_node(op, _resolve(target) if op == "call_function" else target, a, kw, name=name)
            node.meta["val"] = _fake(value, mode)
        made.append(node)
    root = torch.nn.Module()
    for name, (t, device) in doc.get("constants", {}).items():
        setattr(root, name, t.to(device))
    gm = fx.GraphModule(root, graph)
    gm.meta["fake_mode"] = mode  # its values' mode (the rewrite runs in it, as inside AOTAutograd)
    return gm


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target._schema.name.split("::")
        return f"ops:{ns}.{name}.{target._overloadname}"
    if getattr(operator, getattr(target, "__name__", ""), None) is target:
        return f"operator:{target.__name__}"
    raise Unsupported(f"target {target}")


def _resolve(name: str):
    kind, path = name.split(":", 1)
    if kind == "operator":
        return getattr(operator, path)
    ns, op, overload = path.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def _encode(x, index: dict):
    if isinstance(x, fx.Node):
        return ("node", index[x])
    if isinstance(x, (list, tuple)):
        return ("list" if isinstance(x, list) else "tuple", [_encode(v, index) for v in x])
    if isinstance(x, dict):
        return ("dict", {k: _encode(v, index) for k, v in x.items()})
    if isinstance(x, _SCALARS):
        return ("const", x)
    raise Unsupported(f"argument {type(x).__name__}")


def _decode(x, made: list):
    kind, v = x
    if kind == "node":
        return made[v]
    if kind in ("list", "tuple"):
        items = [_decode(i, made) for i in v]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _decode(i, made) for k, i in v.items()}
    return v


def _layout(v):
    if isinstance(v, torch.Tensor):
        if not _plain_tensor(v) or v.layout != torch.strided or \
                any(not isinstance(s, int) for s in (*v.shape, *v.stride())):
            raise Unsupported("value layout")
        return ("tensor", tuple(v.shape), tuple(v.stride()), int(v.storage_offset()), v.dtype, str(v.device))
    if isinstance(v, (list, tuple)):
        return ("seq", [_layout(i) for i in v])
    if isinstance(v, (int, float, bool)) or v is None:
        return ("const", v)
    raise Unsupported(f"value {type(v).__name__}")


def _fake(layout, mode):
    kind = layout[0]
    if kind == "const":
        return layout[1]
    if kind == "seq":
        return tuple(_fake(i, mode) for i in layout[1])
    _, shape, stride, offset, dtype, device = layout
    with mode:
        base = torch.empty(offset + extent(shape, stride), dtype=dtype, device=device)
        return base.as_strided(shape, stride, offset)

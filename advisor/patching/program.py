"""An analyzer op program (`candidate["program"]`) as code: an eager reference and an aten FX graph.

The reference runs the program's ops one by one with `torch.ops`, reading every tensor through the
view the program records (`as_strided` relative to the input it comes from). It is what a generated
launcher must compute, so the patcher can use it as a stand-in launcher (tests) and the matcher can
trace it: `program_graph` runs the reference under `make_fx`, so composite ops decompose exactly as
they do in a torch.compile capture (`linear` -> `t` + `addmm`, `layer_norm` -> `native_layer_norm`,
`to` -> `_to_copy`) and no table of such spellings is needed.

Wrapped scalars: eager turns a Python number in `x + 1e-6` into a 0-dim float64/int64 tensor, which
the program lists as an input. The reference passes such inputs on as Python numbers (the eager
semantics), and `program_graph` bakes each one in as a distinctive sentinel literal so the matcher
can bind it to whatever literal the captured graph holds.
"""
from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Any, Sequence

import torch

from advisor.analysis.program import arg_values, as_torch, declared_types, node_schema, tensor_reads
from advisor.graph.dtypes import torch_dtype


def is_scalar_slot(spec: dict) -> bool:
    """A 0-dim float64/int64 input: in eager, almost always a wrapped Python number."""
    return not spec["shape"] and spec["dtype"] in ("float64", "int64")


@lru_cache(maxsize=None)
def _overload(qualname: str, overload: str) -> torch._ops.OpOverload:
    """The op a schema names: ("aten::pow", "Tensor_Scalar") -> torch.ops.aten.pow.Tensor_Scalar."""
    namespace, name = qualname.split("::", 1)
    return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")


def strided_view(t: torch.Tensor, base_spec: dict, ref: dict) -> torch.Tensor:
    """Read `t` (laid out as `base_spec`) through the view `ref` records."""
    same = (list(ref["shape"]) == list(t.shape) and _strides_equal(ref["shape"], ref["strides"], t.stride())
            and ref.get("storage_offset", 0) == base_spec.get("storage_offset", 0))
    if same:
        return t
    delta = ref.get("storage_offset", 0) - base_spec.get("storage_offset", 0)
    return t.as_strided(ref["shape"], ref["strides"], t.storage_offset() + delta)


def _strides_equal(shape, a, b) -> bool:
    return all(d <= 1 or x == y for d, x, y in zip(shape, a, b)) and len(a) == len(b)


def call_node(node: dict, env: dict, device, view=None) -> tuple:
    """Run one program node; `env` maps value ids to (tensor-or-number, layout spec); `view(t, spec, ref)`
    reads a tensor through a ref (default: `as_strided`)."""
    view = view or strided_view
    schema = node_schema(node)
    if schema is None:
        raise ValueError(f"no schema recorded for {node['op']} and none of its overloads fits")
    declared, arguments = declared_types(schema), schema.arguments

    def read(r):
        v, spec = env[r["ref"]]
        return v if not isinstance(v, torch.Tensor) else view(v, spec, r)

    args, kwargs = [], {}
    for i, v in enumerate(arg_values(node, read)):
        v = as_torch(v, declared[i] if i < len(declared) else "", device)
        if i < len(arguments) and arguments[i].kwarg_only:
            kwargs[arguments[i].name] = v
        else:
            args.append(v)
    out = _overload(schema.name, schema.overload_name)(*args, **kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def run_program(program: dict, inputs: Sequence[Any], view=None) -> tuple:
    """The reference: the program's outputs for `inputs` (tensors laid out as the program's inputs);
    `view` as in `call_node`."""
    if len(inputs) != len(program["inputs"]):
        raise TypeError(f"program takes {len(program['inputs'])} inputs, got {len(inputs)}")
    env: dict[str, tuple] = {}
    device = None
    for spec, v in zip(program["inputs"], inputs):
        if isinstance(v, torch.Tensor) and is_scalar_slot(spec) and v.dim() == 0:
            v = v.item()  # eager saw a Python number here
        if isinstance(v, torch.Tensor) and device is None and v.dim() > 0:
            device = v.device
        env[spec["id"]] = (v, spec)
    for node in program["nodes"]:
        outs = call_node(node, env, device, view)
        for spec, o in zip(node["outputs"], outs):
            env[spec["id"]] = (o, {"storage_offset": 0})  # fresh outputs: the trace read them from offset 0
    return tuple(env[o][0] for o in program["outputs"])


def sentinel(k: int, spec: dict):
    """A literal no model contains, standing for wrapped-scalar input k while tracing."""
    return 7919 * 1000 + k if spec["dtype"] == "int64" else 7919.000123 + k / 1024


def is_sentinel(v: Any, program: dict) -> int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    for k, spec in enumerate(program["inputs"]):
        if is_scalar_slot(spec) and v == sentinel(k, spec):
            return k
    return None


def program_graph(program: dict, device: torch.device | str, views: list | None = None) -> torch.fx.GraphModule:
    """The program as an aten FX graph (fake tensors, no data), decomposed as a capture would be.

    Placeholders are one flat storage per tensor input, in input order (wrapped scalars are baked in
    as sentinels); each input is an `as_strided` view of its storage at the program's layout and
    offset, and every read is a view relative to that, so reads below the input's own offset work.
    The graph returns the program's outputs in order. `views`, when given, gets the recorded read (the
    program's ref dict) of each `as_strided` a read adds, in the graph's order (a read that is its tensor's own
    layout adds none).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    specs = program["inputs"]
    tensor_idx = [k for k, s in enumerate(specs) if not is_scalar_slot(s)]

    def fn(*bases):
        vals: list[Any] = [sentinel(k, s) for k, s in enumerate(specs)]
        for k, b in zip(tensor_idx, bases):
            s = specs[k]
            vals[k] = b.as_strided(s["shape"], s["strides"], s.get("storage_offset", 0))

        def view(t, base_spec, ref):
            out = strided_view(t, base_spec, ref)
            if views is not None and out is not t:
                views.append(ref)
            return out
        return run_program(program, vals, view)

    with FakeTensorMode():
        bases = [torch.empty(storage_numel(program, k), dtype=torch_dtype(specs[k]["dtype"]), device=device)
                 for k in tensor_idx]
        gm = make_fx(fn, tracing_mode="real")(*bases)
    gm.graph.eliminate_dead_code()  # unused outputs of multi-output ops (layer_norm's mean, rstd)
    gm.recompile()
    return gm


def extent(shape, strides) -> int:
    """Elements spanned by a strided view, from its first element (0 for an empty view)."""
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * abs(s) for d, s in zip(shape, strides))


def storage_numel(program: dict, k: int) -> int:
    """Elements of storage that input k and every view through which the program reads it need."""
    spec = program["inputs"][k]
    need = spec.get("storage_offset", 0) + extent(spec["shape"], spec["strides"])
    for n in program["nodes"]:
        for a in n["args"]:
            for r in tensor_reads(a):
                if r["ref"] == spec["id"]:
                    need = max(need, r.get("storage_offset", 0) + extent(r["shape"], r["strides"]))
    return max(need, 1)


def program_text(program: dict) -> str:
    """One line per node, for error messages and the manifest."""
    lines = []
    for n in program["nodes"]:
        args = []
        for a in n["args"]:
            if "ref" in a:
                args.append(a["ref"])
            elif "list" in a:
                args.append("[" + ",".join(r["ref"] for r in a["list"]) + "]")
            else:
                v = a.get("value")
                args.append(f"{v:g}" if isinstance(v, float) and math.isfinite(v) else repr(v))
        outs = ",".join(o["id"] for o in n["outputs"])
        lines.append(f"{outs} = {re.sub(r'^aten::', '', n['op'])}({', '.join(args)})")
    return "; ".join(lines)

"""Record a PyTorch function as an analyzer-style program, without a trace: for tests and benchmarks.

    prog = record_program(lambda x, b: torch.log(torch.relu(x + b)), x, b)

Every aten op the function dispatches becomes a node (views are seen through, as the analyzer
does: a read names the last value written to its storage, through the view it was read with).
The function's tensor arguments are the program's inputs, its returned tensors its outputs.
Python numbers that torch wraps into 0-dim tensors are kept as numbers.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from advisor.graph.dtypes import scalar_type_code
from advisor.ops.args import NONE
from advisor.ops.registry import TRANSPARENT, lookup


class _Recorder(TorchDispatchMode):
    def __init__(self, inputs):
        super().__init__()
        self.nodes, self.values = [], {}  # storage key -> value id (the last writer)
        self.inputs = []
        for k, t in enumerate(inputs):
            self.values[_key(t)] = f"in{k}"
            self.inputs.append({"id": f"in{k}", "shape": list(t.shape), "strides": list(t.stride()),
                                "dtype": str(t.dtype)[6:], "storage_offset": t.storage_offset()})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        info = lookup(name)
        if info is not None and info.cls in TRANSPARENT:
            return out  # a view: its result aliases a storage already named
        schema = func._schema
        values = list(args) + [kwargs.get(a.name, a.default_value if a.has_default_value() else None)
                               for a in schema.arguments[len(args):]]
        node_args = [self._arg(v) for v in values]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        k = len(self.nodes)
        outputs = []
        for j, t in enumerate(o for o in outs if isinstance(o, torch.Tensor)):
            vid = f"v{k}" if len(outs) == 1 else f"v{k}_{j}"
            self.values[_key(t)] = vid
            outputs.append({"id": vid, "shape": list(t.shape), "strides": list(t.stride()), "dtype": str(t.dtype)[6:]})
        self.nodes.append({"id": f"n{k}", "op": name, "schema": str(schema), "args": node_args, "outputs": outputs,
                           "inplace": bool(schema.arguments and schema.arguments[0].alias_info is not None
                                           and schema.arguments[0].alias_info.is_write)})
        return out

    def _arg(self, v):
        if isinstance(v, torch.Tensor):
            if v.dim() == 0 and _key(v) not in self.values:
                return {"value": v.item()}  # a Python number torch wrapped
            return {"ref": self.values.get(_key(v), "?"), "shape": list(v.shape), "strides": list(v.stride()),
                    "storage_offset": v.storage_offset()}
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v):
            return {"list": [self._arg(x) for x in v]}
        if isinstance(v, torch.dtype):
            return {"value": scalar_type_code(v)}
        if v is None or isinstance(v, (torch.device, torch.layout, torch.memory_format)):
            return {"value": NONE}
        return {"value": list(v) if isinstance(v, tuple) else v}


def _key(t: torch.Tensor):
    return t.untyped_storage().data_ptr(), t.device


def record_program(fn, *inputs) -> dict:
    """The program `fn(*inputs)` runs; its outputs are the tensors fn returns (a tensor or a tuple)."""
    rec = _Recorder(inputs)
    with rec:
        res = fn(*inputs)
    res = res if isinstance(res, (tuple, list)) else (res,)
    outs = [rec.values[_key(t)] for t in res]
    return {"inputs": rec.inputs, "nodes": rec.nodes, "outputs": outs}

"""A matmul-anchored pattern under autograd: the matmul through PyTorch, its pointwise epilogue fused.

For inference a pattern such as `linear -> silu -> mul` (Llama's SwiGLU: silu(x @ W_gate^T) * up) runs as one
generated kernel, matmul and epilogue. No backward is derived through a matmul (its gradients are matmuls,
which cuBLAS does best), so in a graph that trains such a site used to run all of its original ops. Split
instead (`split`): the anchor ops (linear, matmul, addmm) run as PyTorch's and autograd differentiates them;
the pointwise tail is a program of its own, generated and validated like any kernel (`validate`), then
trained through its derived backward (`autograd.Trainable`: gradients validated against float64, used only
where forward + backward times faster than the tail's original ops). For SwiGLU eager's forward writes
silu(gate) and reads it back and its backward runs three pointwise kernels over the intermediate size, and
keeps silu(gate) for the backward; fused, one kernel each way, and silu(gate) is recomputed, not kept.

Whether the tail's backward is used is decided once per call signature, on a probe of the anchor run
without autograd (the first training call pays one extra matmul): the anchor then runs once per call, either
way. Where the tail cannot be generated, does not validate or is not faster, the site runs its original ops.
"""
from __future__ import annotations

import copy

import torch

from advisor.analysis.program import tensor_reads
from advisor.ops.registry import OpClass, op_class
from advisor.patching.program import run_program

ANCHORS = (OpClass.MATMUL,)


def split(program: dict) -> tuple[dict, dict, list] | None:
    """(anchor program, tail program, sources) where the program is matmul-class nodes reading only its
    inputs, then pointwise nodes, returning only tail values; `sources[k]` says where tail input k comes
    from: ("input", i) the site's input i, ("anchor", j) the anchor program's output j. The anchor program
    takes the site's inputs its `reads` lists (the matmul's operands, no scalar the tail reads). None
    otherwise."""
    nodes = program.get("nodes") or []
    n_anchor = 0
    while n_anchor < len(nodes) and op_class(nodes[n_anchor]["op"]) in ANCHORS:
        n_anchor += 1
    anchors, tail = nodes[:n_anchor], nodes[n_anchor:]
    if not anchors or not tail or any(op_class(n["op"]) != OpClass.POINTWISE for n in tail):
        return None
    inputs = {s["id"]: i for i, s in enumerate(program["inputs"])}
    made = {o["id"]: o for n in anchors for o in n["outputs"]}
    if any(a["ref"] not in inputs for n in anchors for a in _refs(n)):
        return None  # an anchor reading another anchor's output: not the shape of an epilogue
    if any(o in made for o in program["outputs"]):
        return None  # the matmul's own output returned too: the graph keeps it, nothing to recompute
    read = [a["ref"] for n in tail for a in _refs(n)]
    used_inputs = [i for i, s in enumerate(program["inputs"]) if s["id"] in read]
    used_anchors = [v for v in dict.fromkeys(read) if v in made]
    sources = [("input", i) for i in used_inputs] + [("anchor", j) for j in range(len(used_anchors))]
    rename = {v: f"in{len(used_inputs) + j}" for j, v in enumerate(used_anchors)}
    rename.update({program["inputs"][i]["id"]: f"in{k}" for k, i in enumerate(used_inputs)})
    tail_inputs = [{**program["inputs"][i], "id": rename[program["inputs"][i]["id"]]} for i in used_inputs] + \
        [{"id": rename[v], "shape": made[v]["shape"], "strides": made[v]["strides"], "dtype": made[v]["dtype"],
          "storage_offset": 0} for v in used_anchors]
    tail_nodes = copy.deepcopy(tail)
    for n in tail_nodes:
        for a in _refs(n):
            a["ref"] = rename.get(a["ref"], a["ref"])
    anchor_reads = {a["ref"] for n in anchors for a in _refs(n)}
    reads = [i for i, s in enumerate(program["inputs"]) if s["id"] in anchor_reads]
    anchor_program = {"inputs": [program["inputs"][i] for i in reads], "nodes": anchors, "outputs": used_anchors,
                      "reads": reads}
    return anchor_program, {"inputs": tail_inputs, "nodes": tail_nodes, "outputs": list(program["outputs"])}, sources


def _refs(node: dict) -> list[dict]:
    """The node's tensor reads (a list argument's included)."""
    return [r for a in node.get("args", []) for r in tensor_reads(a)]


class EpilogueTrainable:
    """What a matmul-anchored site runs under autograd: PyTorch's anchor, then the fused tail (or None:
    the site's original ops)."""

    def __init__(self, parts: tuple[dict, dict, list], label: str = "", keep_outputs: bool = True):
        self.anchor, self.tail, self.sources = parts
        self.keep_outputs = keep_outputs  # as `Trainable`: whether the backward may keep the site's outputs
        self.label = f"{label} (epilogue, the matmul by PyTorch)"
        self.reason: str | None = None  # why the tail is not used, once known
        self._fused = None  # the tail's Trainable, once built
        self._built = False
        self._use: dict = {}  # call signature -> whether the tail's backward is validated and faster

    def _trainable(self):
        """The tail's `autograd.Trainable`, generated and validated at the first call that trains; None
        where it cannot be (`reason` says why)."""
        from advisor.codegen import generate, load_module  # autograd machinery: loaded when a site trains
        from advisor.patching.autograd import Trainable, module_forward
        from advisor.validate import validate

        if not self._built:
            self._built = True
            try:
                gen = generate(self.tail)
                module = load_module(gen.path)
                check = validate(gen, module)
                if check.validated:
                    self._fused = Trainable(self.tail, module_forward(module.run, self.tail),
                                            keep_outputs=self.keep_outputs, label=self.label,
                                            original=lambda *xs: run_program(self.tail, xs))
                else:
                    self.reason = f"the epilogue's kernel did not validate: {check.reason}"
            except Exception as e:  # an epilogue that cannot be generated keeps the site's original ops
                self.reason = f"the epilogue's kernel was not generated: {type(e).__name__}: {e}"[:300]
        return self._fused

    def _tail_inputs(self, xs, anchors) -> list:
        return [xs[i] if kind == "input" else anchors[i] for kind, i in self.sources]

    def _anchors(self, xs) -> tuple:
        return run_program(self.anchor, [xs[i] for i in self.anchor["reads"]])

    def __call__(self, xs) -> tuple | None:
        fused = self._trainable()
        if fused is None:
            return None
        sig = tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)
        if sig not in self._use:
            with torch.no_grad():
                probe = self._anchors(xs)
            grad = any(sig[i] for i in self.anchor["reads"])  # as autograd will have it: anything it reads does
            probe = [p.detach().requires_grad_(grad) for p in probe]
            bw = fused.backward_for(self._tail_inputs(xs, probe))
            self._use[sig] = bw.used
            if not bw.used:
                self.reason = bw.reason or "the fused epilogue's forward + backward was not faster"
        if not self._use[sig]:
            return None
        return fused(self._tail_inputs(xs, self._anchors(xs)))

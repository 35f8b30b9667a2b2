"""The backward of a fused program, derived: a vector-Jacobian product as one more op program.

    bw = derive(program, needs, scalars, device)   # the vjp as an op program (+ how each grad comes out)
    gen = generate(bw.program)                     # the same generator as the forward's kernel

Derivation asks PyTorch's own autograd, not a table of our own: the forward program is replayed with
its ops (`run_program`) on inputs requiring grad, `torch.autograd.grad` computes the vjp, and every aten
op dispatched on the way (the forward's, recomputed, then the backward's) is recorded as a program
node (`codegen.record`). A backward op the generator has no lowering for (`tanh_backward`,
`native_layer_norm_backward`, `_softmax_backward_data`, ...) is replaced, while recording, by its
decomposition from `torch._decomp` into ops it does lower. So every pointwise op and row op with a
lowering gets its backward without a rule written here, and the backward of a pointwise chain is a
pointwise program, of a row norm a row program.

Save versus recompute, by bytes: intermediates are never saved; the backward recomputes them in
registers (a pointwise or row recompute reads nothing the backward does not read anyway). Two
derivations are compared: one that reads only the forward's inputs, and one that reads the forward's
outputs wherever it would recompute them (residual add + RMSNorm then keeps the sum `h`, one tensor,
instead of both addends); the one keeping fewer bytes between the passes wins, ties going to the
outputs. `saved_bytes` is what the Function keeps, `eager_saved_bytes` an estimate of what eager's
autograd keeps for the same ops, for the report.

Parameter and broadcast gradients: autograd reduces a broadcast operand's gradient over the broadcast
dims (`sum` over leading dims), a column reduction the row generator does not do. The program is cut
there: the kernel writes the per-element product (the "partial") and `Tensor.sum_to_size` reduces it,
which is exactly what that `sum` (and the cast after it) computed. A gradient that is a backward input
itself (the gradient of `x + y` with respect to `y` is the incoming gradient) needs no kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from advisor.analysis.program import tensor_reads
from advisor.codegen.record import _Recorder, _key
from advisor.graph.dtypes import torch_dtype
from advisor.ops.lowering import Unsupported, lowering
from advisor.ops.registry import OpClass, lookup, tagged
from advisor.patching.program import is_scalar_slot, run_program, storage_numel, strided_view


@dataclass
class Grad:
    """How the gradient of one forward input is produced from the backward's results."""

    input: int  # forward input index
    source: str  # "kernel": kernel output `index`; "grad": backward grad input `index`; "zero"
    index: int = 0
    reduce: bool = False  # sum_to_size the input's shape (a broadcast operand: the partial is per element)


@dataclass
class Derived:
    program: dict  # the kernel's program: inputs = the saved forward inputs, then the output grads
    saved: list  # forward input indices the backward reads (what the Function saves)
    grads: list  # [Grad], one per input that needs a gradient
    outputs: int  # forward outputs that take a gradient (float ones), in order
    saved_outputs: list = field(default_factory=list)  # forward output indices it reads instead of recomputing
    saved_bytes: int = 0
    eager_saved_bytes: int = 0
    notes: list = field(default_factory=list)


def differentiable(program: dict) -> list:
    """Indices of the program's float tensor inputs (wrapped scalars are constants, not inputs)."""
    return [k for k, s in enumerate(program["inputs"])
            if not is_scalar_slot(s) and torch_dtype(s["dtype"]).is_floating_point]


def float_outputs(program: dict) -> list:
    dtypes = {o["id"]: o["dtype"] for n in program["nodes"] for o in n["outputs"]}
    dtypes.update({s["id"]: s["dtype"] for s in program["inputs"]})
    return [j for j, vid in enumerate(program["outputs"]) if torch_dtype(dtypes[vid]).is_floating_point]


def example_inputs(program: dict, scalars: dict, device) -> list:
    """Inputs laid out exactly as the program's (strides, storage offset, storage reach); wrapped scalars
    as the 0-dim values the site passes (they end up as literals in the derived program)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for k, s in enumerate(program["inputs"]):
        dt = torch_dtype(s["dtype"])
        if is_scalar_slot(s):
            out.append(torch.tensor(scalars[k], dtype=dt, device=device))
            continue
        n = storage_numel(program, k)
        base = torch.randn(n, generator=g).to(dt) if dt.is_floating_point else torch.ones(n, dtype=dt)
        out.append(base.to(device).as_strided(s["shape"], s["strides"], s.get("storage_offset", 0)))
    return out


def index_view(t: torch.Tensor, spec: dict, ref: dict) -> torch.Tensor:
    """`t` (laid out as `spec`) read through `ref` with the view ops that select it (narrow, select,
    permute, unsqueeze, expand) where they can, else with `as_strided` as the reference reads it.

    Same elements either way; what differs is the backward autograd records. `as_strided`'s writes the
    gradient into a zero buffer of the whole storage, in place, through the view: an index-by-index
    kernel cannot compute that. Narrow's and select's are a zero padding (`slice_backward`, see `rules`),
    permute's and unsqueeze's are views, expand's a sum: all ops the generator lowers."""
    delta = ref.get("storage_offset", 0) - spec.get("storage_offset", 0)
    boxed = _box(t, list(ref["shape"]), list(ref["strides"]), delta)
    return boxed if boxed is not None else strided_view(t, spec, ref)


def _box(t: torch.Tensor, shape: list, strides: list, delta: int) -> torch.Tensor | None:
    """`t.as_strided(shape, strides, offset + delta)` spelled as view ops, or None where it is no box of `t`
    (a view that merges or splits dims, or reads outside `t`)."""
    starts, rest = [0] * t.dim(), delta
    for e in sorted(range(t.dim()), key=lambda e: -t.stride(e)):  # the offset as a start index per dim
        if t.shape[e] > 1 and t.stride(e) > 0:
            starts[e], rest = divmod(rest, t.stride(e)) if rest >= 0 else (0, rest)
    if rest or any(not 0 <= s < max(n, 1) for s, n in zip(starts, t.shape)):
        return None
    walks: dict[int, int] = {}  # ref dim -> the dim of t it walks
    for d, (n, st) in enumerate(zip(shape, strides)):
        if n == 1 or st == 0:
            continue
        cands = [e for e in range(t.dim()) if t.stride(e) == st and t.shape[e] > 1 and e not in walks.values()]
        if not cands:
            return None
        aligned = d + t.dim() - len(shape)
        walks[d] = aligned if aligned in cands else cands[0]
        if starts[walks[d]] + n > t.shape[walks[d]]:
            return None
    v = t
    for d, e in walks.items():
        if (starts[e], shape[d]) != (0, t.shape[e]):
            v = v.narrow(e, starts[e], shape[d])
    for e in sorted(set(range(t.dim())) - set(walks.values()), reverse=True):
        v = v.select(e, starts[e])  # a dim the view does not walk: fixed at its start
    kept = sorted(walks.values())
    v = v.permute([kept.index(walks[d]) for d in sorted(walks)])  # into the ref's order
    for d, n in enumerate(shape):
        if d not in walks:
            v = v.unsqueeze(d)
    v = v.expand(shape)
    ok = all(a == b for n, a, b in zip(shape, strides, v.stride()) if n > 1)
    return v if ok and v.storage_offset() == t.storage_offset() + delta else None


def rules() -> dict:
    """The derivative rules in use: {aten op overload: its decomposition}. Autograd's own formulas produce
    the backward ops (`tanh_backward`, ...); these say what they compute in ops the generator lowers:
    torch's own decompositions, and ours where torch's write into a slice of a buffer (an in-place
    scatter an index-by-index kernel cannot express)."""
    from torch._decomp import core_aten_decompositions  # torch's decomposition tables: loaded for training only

    aten = torch.ops.aten
    table = core_aten_decompositions()
    torch_slice = table[aten.slice_backward.default]

    def slice_backward(grad, input_sizes, dim, start, end, step):
        if step != 1:  # strided slices interleave zeros: torch's scatter (not generated, said so)
            return torch_slice(grad, input_sizes, dim, start, end, step)
        return _zero_padded(grad, input_sizes, dim, _clamped(start, input_sizes[dim]))

    def select_backward(grad, input_sizes, dim, index):
        n = input_sizes[dim % len(input_sizes)]
        return _zero_padded(grad.unsqueeze(dim), input_sizes, dim, index % n)

    return {**table, aten.slice_backward.default: slice_backward, aten.select_backward.default: select_backward}


def _clamped(index: int, size: int) -> int:
    """A slice bound as Python reads it: negative from the end, clamped into [0, size]."""
    return min(max(index + size if index < 0 else index, 0), size)


def _zero_padded(piece: torch.Tensor, sizes, dim: int, start: int) -> torch.Tensor:
    """A tensor of `sizes` holding `piece` at `start` along `dim`, zeros elsewhere: the gradient of a slice
    (or select) as a cat of the piece between two constant blocks, which the generator computes index by
    index (torch's decomposition writes the piece into a zero buffer in place)."""
    dim = dim % len(sizes)
    after = sizes[dim] - start - piece.shape[dim]
    zeros = lambda n: torch.full([*sizes[:dim], n, *sizes[dim + 1:]], 0, dtype=piece.dtype,  # noqa: E731
                                 device=piece.device)
    parts = ([zeros(start)] if start else []) + [piece] + ([zeros(after)] if after > 0 else [])
    return torch.cat(parts, dim) if len(parts) > 1 else piece.clone()


class _Decomposing(_Recorder):
    """The recorder, with every op the generator does not lower (and that is no view) replaced by its
    decomposition, recorded op by op."""
    # A composite the registry sees through (`silu_backward`) must decompose here: the recorder would
    # otherwise skip it as transparent and lose the value it returns.

    def __init__(self, inputs):
        super().__init__(inputs)
        self.table = rules()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        info = lookup(name)
        view = info is not None and info.cls == OpClass.VIEW  # composites (silu_backward) decompose
        if not view and lowering(name) is None:
            with self:  # the decomposition's own ops come back through this mode
                if func in self.table:
                    return self.table[func](*args, **kwargs)
                out = func.decompose(*args, **kwargs)  # CompositeImplicit ops (`to` inside a decomposition)
                if out is not NotImplemented:
                    return out
        return super().__torch_dispatch__(func, types, args, kwargs)


def derive(program: dict, needs: tuple, scalars: dict, device, allow_saved_outputs: bool = True) -> Derived:
    """The vjp of `program` for the inputs flagged in `needs` (one bool per input), as a program.

    `scalars`: input index -> the wrapped scalar's value (baked into the derived program: one backward
    per distinct value, as each site's eps or scale is one literal). `allow_saved_outputs`: the backward
    may read the forward's outputs instead of recomputing them (where that saves fewer bytes; not where
    a later op writes into an output in place). Raises Unsupported with the reason."""
    specs = program["inputs"]
    wrt = [k for k in differentiable(program) if needs[k]]
    if not wrt:
        raise Unsupported("no input of the program needs a gradient")
    outs = float_outputs(program)
    if not outs:
        raise Unsupported("the program has no float output to take a gradient from")
    xs = example_inputs(program, scalars, device)
    with torch.no_grad():
        ref = run_program(program, xs, index_view)
    # Output gradients laid out as their outputs: what autograd mostly hands back (pointwise backwards and
    # flash attention's keep their operand's layout), so the kernel takes them as they come (FusedFunction).
    grads_in = [torch.empty_like(ref[j]).copy_(torch.randn(ref[j].shape, dtype=ref[j].dtype, device=device))
                for j in outs]
    tensors = [k for k, s in enumerate(specs) if not is_scalar_slot(s)]

    forward_values: list = []  # the forward's outputs as recomputed inside the recording

    def vjp(*args):
        ins = list(xs)
        for k, t in zip(tensors, args[:len(tensors)]):
            ins[k] = t.detach().requires_grad_(k in wrt) if k in wrt else t
        with torch.enable_grad():
            res = run_program(program, ins, index_view)
            forward_values.extend(res)
            got = torch.autograd.grad([res[j] for j in outs], [ins[k] for k in wrt], list(args[len(tensors):]),
                                      allow_unused=True)
        return got

    args = [xs[k] for k in tensors] + grads_in
    rec = _Decomposing(args)
    with rec:
        got = vjp(*args)
    recorded = {"inputs": rec.inputs, "nodes": rec.nodes, "outputs": []}
    ids = {}  # grad k -> recorded value id (None: no gradient flows)
    for k, t in zip(wrt, got):
        ids[k] = None if t is None else rec.values.get(_key(t))
        if t is not None and ids[k] is None:
            raise Unsupported(f"the gradient of input {k} is no value the backward computed")
    recompute = _cut(program, recorded, tensors, outs, wrt, ids)
    if not allow_saved_outputs:
        return recompute
    out_ids = {rec.values.get(_key(t)): j for j, t in enumerate(forward_values) if isinstance(t, torch.Tensor)}
    out_ids.pop(None, None)
    reuse = _cut(program, _reading_outputs(recorded, out_ids, forward_values), tensors, outs, wrt, ids)
    # Ties go to the saved outputs: their consumers (a matmul, the next norm) usually keep them alive anyway.
    return reuse if reuse.saved_bytes <= recompute.saved_bytes else recompute


def _reading_outputs(rec: dict, out_ids: dict, values: list) -> dict:
    """The recorded vjp reading the forward's outputs (new inputs `sv{j}`) wherever it reads their
    recomputed values; the recompute nodes nobody reads any more drop out in `_cut`."""
    def swap(a):
        if "ref" in a and a["ref"] in out_ids:
            return {**a, "ref": f"sv{out_ids[a['ref']]}"}
        if "list" in a:
            return {**a, "list": [swap(r) for r in a["list"]]}
        return a

    nodes = [{**n, "args": [swap(a) for a in n["args"]]} for n in rec["nodes"]]
    extra = [{"id": f"sv{j}", "shape": list(values[j].shape), "strides": list(values[j].stride()),
              "dtype": str(values[j].dtype)[6:], "storage_offset": 0} for j in sorted(set(out_ids.values()))]
    return {"inputs": rec["inputs"] + extra, "nodes": nodes, "outputs": []}


def _cut(program: dict, rec: dict, tensors: list, outs: list, wrt: list, ids: dict) -> Derived:
    """Split the recorded vjp into the kernel's program and the column reductions after it."""
    nodes = rec["nodes"]
    producer = {o["id"]: n for n in nodes for o in n["outputs"]}
    tail: set = set()  # node ids downstream of a column reduction
    for n in nodes:
        refs = [r["ref"] for a in n["args"] for r in tensor_reads(a)]
        if _column_reduction(n) or any(producer.get(r, {}).get("id") in tail for r in refs):
            tail.add(n["id"])
    grads: list[Grad] = []
    kernel_outputs: list[str] = []
    n_fw = len(tensors)
    for k in wrt:
        vid, reduce = ids[k], False
        if vid is None:
            grads.append(Grad(k, "zero"))
            continue
        while vid in producer and producer[vid]["id"] in tail:  # walk back to the partial
            n = producer[vid]
            refs = [a for a in n["args"] if "ref" in a]
            # what may follow a column reduction on its way to a grad (the registry's "reduction_tail"; a
            # clone: the gradient of a select that needs no zero padding, see `_zero_padded`)
            if not tagged(n["op"], "reduction_tail") or len(refs) != 1 or any("list" in a for a in n["args"]):
                raise Unsupported(f"a gradient is computed past a reduction over rows by {n['op']}")
            vid, reduce = refs[0]["ref"], True
        if not vid.startswith(("in", "sv")):
            if vid not in kernel_outputs:
                kernel_outputs.append(vid)
            grads.append(Grad(k, "kernel", kernel_outputs.index(vid), reduce))
            continue
        j = int(vid[2:])
        if vid.startswith("sv") or j < n_fw:  # the gradient is a forward value (an odd program)
            raise Unsupported("a gradient equals a forward input or output")
        grads.append(Grad(k, "grad", j - n_fw, reduce))
    head = [n for n in nodes if n["id"] not in tail]
    head = _live(head, kernel_outputs)
    read = {r["ref"] for n in head for a in n["args"] for r in tensor_reads(a)}
    saved = [k for j, k in enumerate(tensors) if f"in{j}" in read]
    saved_outputs = sorted(int(r[2:]) for r in read if r.startswith("sv"))
    kept = [f"in{j}" for j, k in enumerate(tensors) if k in saved] + [f"in{n_fw + i}" for i in range(len(outs))] \
        + [f"sv{j}" for j in saved_outputs]
    by_id = {s["id"]: s for s in rec["inputs"]}
    prog = _renumbered([by_id[i] for i in kept], head, kernel_outputs)
    d = Derived(prog, saved, grads, len(outs), saved_outputs=saved_outputs)
    d.saved_bytes = sum(_bytes(program["inputs"][k]) for k in saved) \
        + sum(_bytes(by_id[f"sv{j}"]) for j in saved_outputs)
    d.eager_saved_bytes = _eager_saved(program)
    return d


def _renumbered(inputs: list, nodes: list, outputs: list) -> dict:
    """The program with its inputs named by position (`in0`, `in1`, ...), as the generator names the
    launcher's arguments and size symbols."""
    names = {s["id"]: f"in{k}" for k, s in enumerate(inputs)}

    def ren(a):
        if "ref" in a and a["ref"] in names:
            return {**a, "ref": names[a["ref"]]}
        if "list" in a:
            return {**a, "list": [ren(r) for r in a["list"]]}
        return a

    return {"inputs": [{**s, "id": names[s["id"]]} for s in inputs],
            "nodes": [{**n, "args": [ren(a) for a in n["args"]]} for n in nodes],
            "outputs": [names.get(o, o) for o in outputs]}


def _column_reduction(n: dict) -> bool:
    """A reduction over other dims than the last one alone (a broadcast operand's gradient)."""
    if not tagged(n["op"], "column_reduction"):
        return False
    src = next((a for a in n["args"] if "ref" in a), None)
    dims = n["args"][1].get("value") if len(n["args"]) > 1 else None
    if src is None:
        return False
    rank = len(src["shape"])
    if not isinstance(dims, list) or not dims:
        return rank > 1
    return sorted(d % rank for d in dims) != [rank - 1]


def _live(nodes: list, outputs: list) -> list:
    """The nodes the outputs need (the recorded forward's own result, say, is dead in the backward)."""
    need, keep = set(outputs), []
    for n in reversed(nodes):
        if any(o["id"] in need for o in n["outputs"]):
            keep.append(n)
            for a in n["args"]:
                for r in tensor_reads(a):
                    need.add(r["ref"])
    return keep[::-1]


def _bytes(spec: dict) -> int:
    return math.prod(spec["shape"]) * torch_dtype(spec["dtype"]).itemsize


def _eager_saved(program: dict) -> int:
    """Bytes eager's autograd would keep for this program: roughly every float intermediate and input
    a backward formula reads (counted as every tensor read by an op that is not a plain add/sub/neg/cast,
    whose backward needs no operand) — an estimate for the report, not a measurement."""
    sizes = {s["id"]: _bytes(s) for s in program["inputs"] if not is_scalar_slot(s)}
    sizes.update({o["id"]: _bytes(o) for n in program["nodes"] for o in n["outputs"]})
    held = set()
    for n in program["nodes"]:
        if tagged(n["op"].rstrip("_"), "saves_nothing"):
            continue
        held |= {a["ref"] for a in n["args"] if "ref" in a and a["ref"] in sizes}
    return sum(sizes[v] for v in held)

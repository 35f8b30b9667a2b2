"""Matmul-anchored kernels: a tiled Triton matmul whose epilogue is the candidate's chain.

    gen = generate_anchored(candidate["program"], candidate["kind"])  # epilogue | attention | matmul_reduction
    mod = load_module(gen.path)                                       # mod.run(*inputs) -> outputs

The program is read like any other (`advisor.codegen.ir`), except that the matmul (`mm`, `addmm`,
`linear`, `matmul`, `bmm`) becomes an *anchor*: an op with no lowering whose value, inside the kernel,
is the fp32 accumulator tile. Everything after it is evaluated by the generator's own `Builder` at the
tile's index, through the same lowering table as the pointwise kernels: there is no second lowering.

The tile walks the anchor's output as (batch, rows, columns): columns are N, rows are the leading
dims flattened (M), and the batch (grid axis 1) the dims the second operand varies along (`bmm`,
batched `matmul`). A read of the anchor's value is only fused at the tile's own element: an epilogue
that shifts, broadcasts or rotates it (rotary embeddings) is refused with that reason. A reshape of
the output that splits rows from columns (GPT-2's Conv1D: `addmm` then `view(B, L, N)`) is kept as
a synthetic `aten::reshape` whose split dims are pinned to their recorded sizes.

`attention.py` (flash-style attention) and `matmul_reduce.py` (matmul + reduction over leading dims)
build on the same reader, builder and printer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from advisor.analysis.program import tensor_reads
from advisor.codegen.build import Builder
from advisor.codegen.dag import Dag, Node
from advisor.codegen.helpers import HELPERS, helper_source
from advisor.codegen.ir import Dim, Input, Op, Program, Sizes, Value, View, torch_dtype
from advisor.codegen.module import COMMON, _run, tensors_expr
from advisor.codegen.plan import Plan, Store, _unravel, size_expr
from advisor.codegen.printer import INDENT, Printer, _ancestors, _closure, signature
from advisor.codegen.read import _read_op, _schema, _view, read_args, set_outputs
from advisor.codegen.shapes import broadcast
from advisor.ops.args import decode, reduced_dims
from advisor.ops.lowering import Lowering, Unsupported, tl_type
from advisor.ops.registry import REDUCE_KINDS, OpClass, is_conv, lookup, op_class, tagged

CONV_REASON = "a conv anchors only a conv epilogue (advisor/codegen/conv.py)"
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Stand-ins for the table's entries: these ops are computed by the kernel template, not lowered.
ANCHOR = Lowering("anchor", "anchor", None, promote="none", operands=(), shape="anchor")
RESHAPE = Lowering("aten::reshape", "reshape", None, promote="none", operands=(), shape="reshape")
REDUCE = Lowering("reduce", "anchor_reduce", None, promote="none", operands=(), shape="reduce_dims")
RESHAPE_SCHEMA = "aten::reshape(Tensor(a) self, SymInt[] shape) -> Tensor(a)"


def is_anchor(name: str) -> bool:
    """A matmul this generator anchors a kernel on (the registry's "matmul_anchor")."""
    return tagged(name, "matmul_anchor")


# ------------------------------------------------------------------------------------------ reading
@dataclass
class Anchor:
    """One matmul: out[*lead, n] = alpha * sum_k a[*lead, k] * b[.., k, n] + beta * bias."""
    op: Op
    a: View  # [*lead, K]
    b: View  # [N, K] when b_nk (linear's weight), else [*batch, K, N]
    b_nk: bool
    bias: View | None
    alpha: float
    beta: float
    lead: list  # [Dim]: the output's leading dims (A's)
    n: Dim
    k: Dim
    b_batch: list  # positions in `lead` that B's batch dims walk (grid axis 1)

    @property
    def dtype(self) -> torch.dtype:
        return self.op.outputs[0].dtype


@dataclass
class Anchored:
    prog: Program
    anchors: dict  # op id -> Anchor
    reshapes: dict = field(default_factory=dict)  # value id -> (anchor op id, split position)


def read_anchored(program: dict) -> Anchored:
    """The IR of a program with matmul anchors (see the module docstring); raises Unsupported."""
    program = _insert_reshapes(program)
    sizes = Sizes()
    p = Program([], {}, [], [], sizes)
    ctx = Anchored(p, {})
    for k, spec in enumerate(program["inputs"]):
        shape = [sizes.symbol(f"in{k}.{d}", n) for d, n in enumerate(spec["shape"])]
        for d in shape:
            if d.value == 1:
                sizes.pin(d)
        p.inputs.append(Input(spec["id"], torch_dtype(spec["dtype"]), shape, list(spec["shape"]),
                              list(spec["strides"]), int(spec.get("storage_offset") or 0)))
    for spec in program["nodes"]:
        name = spec["op"]
        if is_conv(name):
            raise Unsupported(CONV_REASON)
        if is_anchor(name):
            op = _read_anchor(ctx, spec)
        elif op_class(name) == OpClass.MATMUL:
            raise Unsupported(f"{name}: only mm, addmm, linear, matmul, bmm and baddbmm anchors are generated")
        elif spec.get("synthetic") == "reshape":
            op = _read_reshape(ctx, spec)
        elif name in REDUCE_KINDS and _leading_reduction(spec):
            op = _read_reduction(ctx, spec)
        else:
            op = _read_epilogue_op(ctx, spec)
        p.ops.append(op)
    set_outputs(p, program["outputs"])
    if not ctx.anchors:
        raise Unsupported("no matmul anchor in the program")
    return ctx


def _read_epilogue_op(ctx: Anchored, spec: dict) -> Op:
    """An op after the anchor, read by the generator's reader; a view of the matmul output it cannot
    express (a slice or split of the columns: a rotary embedding's rotate-half) says so."""
    try:
        return _read_op(ctx.prog, spec)
    except Unsupported as e:
        outs = {a.op.outputs[0].id for a in ctx.anchors.values()}
        refs = [r["ref"] for arg in spec["args"] for r in tensor_reads(arg)]
        if any(r in outs for r in refs) and "view" in str(e):
            raise Unsupported(f"the epilogue reads the matmul output through a view that is not elementwise "
                              f"(a slice or split of its columns, e.g. rotary embeddings): {e}") from None
        raise


def _read_anchor(ctx: Anchored, spec: dict) -> Op:
    p = ctx.prog
    name = spec["op"]
    schema, args = read_args(p, spec)
    # Which argument is which: the registry's `gemm` roles, by schema position (`w`: linear's [N, K] weight).
    # With a bias (addmm, baddbmm): beta * bias + alpha * (a @ b); linear has neither scalar (both 1).
    roles = lookup(name).gemm.split()
    role = {r: args[schema.arguments[k].name] for k, r in enumerate(roles) if r != "-"}
    a, b_nk = role["a"], "w" in role
    b, bias = role["w"] if b_nk else role["b"], role.get("bias")
    alpha = float(args.get("alpha") if args.get("alpha") is not None else 1)
    beta = float(args.get("beta") if args.get("beta") is not None else 1)
    if not isinstance(a, View) or not isinstance(b, View):
        raise Unsupported(f"{name}: operands are not tensors")
    if not isinstance(bias, View):
        bias = None
    for v in (a, b):
        dt = p.source(v.src).dtype
        if dt not in MATMUL_DTYPES:
            raise Unsupported(f"{name} in {str(dt)[6:]}: only fp32/bf16/fp16 matmuls are generated")
    ra, rb = len(a.shape), len(b.shape)
    if ra < 2 or rb < 2 or (b_nk and rb != 2) or (not b_nk and rb > 2 and rb != ra):
        raise Unsupported(f"{name} of a {ra}-d by a {rb}-d tensor: broadcast matmuls are not generated")
    lead = list(a.shape[:-1])
    k = p.sizes.unify(a.shape[-1], b.shape[1] if b_nk else b.shape[-2])
    n = b.shape[0] if b_nk else b.shape[-1]
    b_batch = []
    if not b_nk and rb > 2:
        for t in range(rb - 2):
            lead[t] = p.sizes.unify(a.shape[t], b.shape[t])  # batch dims must match (no broadcasting)
            b_batch.append(t)
    out_shape = lead + [n]
    if bias is not None and beta != 0:
        full = broadcast(p.sizes, [out_shape, bias.shape])
        if [d.value for d in full] != [d.value for d in out_shape]:
            raise Unsupported(f"{name}: the bias does not broadcast to the output")
        out_shape = full
        lead, n = out_shape[:-1], out_shape[-1]
    out = spec["outputs"][0]
    if [d.value for d in out_shape] != list(out["shape"]):
        raise Unsupported(f"{name}: output shape {out['shape']}, the matmul gives {[d.value for d in out_shape]}")
    op = Op(spec["id"], name, schema.overload_name or "default", ANCHOR, args, [], False)
    v = Value(out["id"], torch_dtype(out["dtype"]), out_shape, list(out["shape"]), list(out["strides"]), op, 0)
    op.outputs.append(v)
    p.values[v.id] = v
    ctx.anchors[op.id] = Anchor(op, a, b, b_nk, bias, alpha, beta, list(lead), n, k, b_batch)
    return op


def _contiguous(shape) -> list:
    strides, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= max(shape[d], 1)
    return strides


def _insert_reshapes(program: dict) -> dict:
    """Reads of an anchor's (dense) output through a reshaping view go through a synthetic reshape."""
    outs = {n["outputs"][0]["id"]: n["outputs"][0] for n in program["nodes"]
            if is_anchor(n["op"]) and n.get("outputs")}
    made: dict = {}
    nodes = []

    def rewrite(ref: dict) -> dict:
        out = outs.get(ref.get("ref"))
        if out is None:
            return ref
        target = _reshape_target(ref, out)
        if target is None:
            return ref
        key = (ref["ref"], tuple(target))
        if key not in made:
            vid = f"{ref['ref']}_r{len(made)}"
            made[key] = vid
            nodes.append({"id": f"{vid}_op", "op": "aten::reshape", "schema": RESHAPE_SCHEMA, "synthetic": "reshape",
                          "args": [{"ref": ref["ref"], "shape": out["shape"], "strides": out["strides"],
                                    "storage_offset": 0}, {"value": list(target)}],
                          "outputs": [{"id": vid, "shape": list(target), "strides": _contiguous(target),
                                       "dtype": out["dtype"]}], "inplace": False})
        return dict(ref, ref=made[key], storage_offset=0)

    for node in program["nodes"]:
        args = []
        for arg in node["args"]:
            if "ref" in arg:
                arg = rewrite(arg)
            elif "list" in arg:
                arg = {"list": [rewrite(r) for r in arg["list"]]}
            args.append(arg)
        nodes.append(dict(node, args=args))
    return dict(program, nodes=nodes)


def _reshape_target(ref: dict, out: dict):
    """The dense shape a ref reads the anchor output as (before any permute), or None if it is no reshape.
    Size-1 dims are left out: the ref reads them as unsqueezes of the reshape."""
    shape, strides = list(ref["shape"]), list(ref["strides"])
    if sorted(s for s in shape if s != 1) == sorted(s for s in out["shape"] if s != 1):
        return None  # same sizes: a permute or an unsqueeze, which views express
    if math.prod(shape) != math.prod(out["shape"]) or int(ref.get("storage_offset") or 0) != 0:
        return None
    dense = _contiguous(out["shape"])
    if any(a != b for n, a, b in zip(out["shape"], out["strides"], dense) if n != 1):
        return None
    live = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -strides[d])
    target = [shape[d] for d in live]
    if any(strides[d] != w for d, w in zip(live, _contiguous(target))):
        return None
    return target


def _read_reshape(ctx: Anchored, spec: dict) -> Op:
    p = ctx.prog
    src = _view(p, spec["args"][0])
    anchor_op = p.values[src.src].op
    anc = ctx.anchors[anchor_op.id]
    target = list(spec["args"][1]["value"])
    m_val, n_val = math.prod(d.value for d in anc.lead), anc.n.value
    split = next((j for j in range(len(target) + 1) if math.prod(target[:j]) == m_val
                  and math.prod(target[j:]) == n_val), None)
    if split is None:
        raise Unsupported("the epilogue reshapes the matmul output across its rows and columns")
    lit = lambda s: Dim((), s, s)  # noqa: E731
    m_live = [s for s in target[:split] if s != 1]
    n_live = [s for s in target[split:] if s != 1]
    lead_live = [d for d in anc.lead if d.value != 1]
    m_sym = len(m_live) == 1 and len(lead_live) == 1
    n_sym = len(n_live) == 1 and not m_sym  # one size the reference can leave to reshape (-1)
    dims, shape_arg = [], []
    for j, s in enumerate(target):
        if s != 1 and j < split and m_sym:
            dims.append(lead_live[0])
            shape_arg.append(-1)
        elif s != 1 and j >= split and n_sym:
            dims.append(anc.n)
            shape_arg.append(-1)
        else:
            dims.append(lit(s))
            shape_arg.append(s)
    if not m_sym:
        for d in anc.lead:
            p.sizes.pin(d)
    if not n_sym:
        p.sizes.pin(anc.n)
    out = spec["outputs"][0]
    op = Op(spec["id"], "aten::reshape", "default", RESHAPE, {"self": src, "shape": shape_arg}, [], False)
    v = Value(out["id"], torch_dtype(out["dtype"]), dims, list(out["shape"]), list(out["strides"]), op, 0)
    op.outputs.append(v)
    p.values[v.id] = v
    ctx.reshapes[v.id] = (anchor_op.id, split)
    return op


def _leading_reduction(spec: dict) -> bool:
    """A reduction that keeps the last dim (SPLADE's amax over the sequence)."""
    try:
        schema = _schema(spec)
    except Unsupported:
        return False
    names = [a.name for a in schema.arguments]
    if "dim" not in names or names.index("dim") >= len(spec["args"]):
        return False
    dims = decode(spec["args"][names.index("dim")].get("value"))
    rank = len(spec["args"][0].get("shape") or [])
    try:
        return rank > 1 and rank - 1 not in reduced_dims(dims, rank)
    except ValueError:  # not a dim argument
        return False


def _read_reduction(ctx: Anchored, spec: dict) -> Op:
    p = ctx.prog
    schema, args = read_args(p, spec)
    x = args["self"]
    rank = len(x.shape)
    dims = list(reduced_dims(args["dim"], rank))
    keep = bool(args.get("keepdim"))
    shape = [Dim((), 1, 1) if d in dims else x.shape[d] for d in range(rank) if keep or d not in dims]
    out = spec["outputs"][0]
    if [d.value for d in shape] != list(out["shape"]):
        raise Unsupported(f"{spec['op']}: output shape {out['shape']} is not the reduced input's")
    op = Op(spec["id"], spec["op"], schema.overload_name or "default", REDUCE, args, [], False)
    v = Value(out["id"], torch_dtype(out["dtype"]), shape, list(out["shape"]), list(out["strides"]), op, 0)
    op.outputs.append(v)
    p.values[v.id] = v
    return op


# ------------------------------------------------------------------------------------------ building
class TileBuilder(Builder):
    """A Builder in which an anchor's value is an accumulator tile, read only at the tile's element."""

    def __init__(self, ctx: Anchored, dag: Dag):
        super().__init__(ctx.prog, dag)
        self.ctx = ctx
        self.tiles: dict = {}  # value id -> its index at the tile's element (anchor and reshape outputs)
        self.accs: dict = {}  # anchor op id -> the accumulator var
        self.own: dict = {}  # anchor op id -> the anchor output's own index at the tile's element
        self.axis_masks: dict = {}  # tile axis -> ({var names along it}, its mask var)

    def set_tile(self, anc: Anchor, acc_name: str, idx: tuple, given: dict | None = None) -> Node:
        """The anchor's accumulator is `acc_name`; the tile's element is `idx` of its output (and, for the
        reshapes in `given`, that index of theirs; the others are derived from idx)."""
        acc = self.dag.add("var", acc_name, dtype=torch.float32, full=True, logical=anc.dtype)
        self.accs[anc.op.id] = acc
        self.own[anc.op.id] = idx
        self.tiles[anc.op.outputs[0].id] = idx
        for vid, (aid, split) in self.ctx.reshapes.items():
            if aid == anc.op.id:
                self.tiles[vid] = (given or {}).get(vid) or self._reshaped(vid, idx, split)
        return acc

    def axis(self, var: Node, d: Dim) -> Node:
        """A tile axis walking dim d: the index 0 when d is a literal 1 (as operand_index reads it)."""
        return self.dag.lit(0) if self.p.sizes.norm(d).literal and d.value == 1 else var

    def flatten(self, idx: tuple, dims: list) -> Node:
        """The row-major flat position of `idx` over `dims`."""
        flat = self.dag.lit(0)
        for d, i in zip(dims, idx):
            flat = self.dag.iadd(self.dag.imul(flat, self.size(d)), i)
        return flat

    def _reshaped(self, vid: str, idx: tuple, split: int) -> tuple:
        """The index of a reshape of the anchor output: its row dims from the flat row, its columns from n."""
        v = self.p.values[vid]
        anc = self.ctx.anchors[self.ctx.reshapes[vid][0]]
        # the rows' own index is several dims (batch, rows): flatten them back (their sizes are pinned)
        m_flat = idx[0] if len(anc.lead) == 1 else self.flatten(idx[:-1], anc.lead)
        rows = _unravel(self, m_flat, v.shape[:split], list(range(split)), "row", "")
        cols = _unravel(self, idx[-1], v.shape[split:], list(range(len(v.shape) - split)), "col", "")
        return tuple(rows) + tuple(cols)

    def eval_op(self, op: Op, slot: int, idx: tuple) -> Node:
        kind = op.low.kind
        if kind in ("anchor", "reshape"):
            vid = op.outputs[0].id
            want = self.tiles.get(vid)
            if want is None:
                raise Unsupported(f"the group reads a second matmul's output ({op.qualname}): one anchor per kernel")
            if not same_index(idx, want):
                raise Unsupported("the epilogue reads the matmul output at another element (a shifted, broadcast "
                                  "or rotated view): not an elementwise epilogue")
            anchor = op if kind == "anchor" else self.p.values[op.args["self"].src].op
            return self.anchor_value(anchor)
        if kind == "anchor_reduce":
            raise Unsupported(f"{op.qualname} inside the epilogue")
        return super().eval_op(op, slot, idx)

    def anchor_value(self, op: Op) -> Node:
        """alpha * acc + beta * bias, in fp32 registers (the output dtype is only its logical type)."""
        key = ("anchor", op.id)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        anc = self.ctx.anchors[op.id]
        f32, dag = torch.float32, self.dag
        val = self.accs[op.id]
        if anc.alpha != 1:
            val = dag.op("{} * {}", dag.lit(anc.alpha, f32), val, dtype=f32, logical=anc.dtype, comment="alpha")
        if anc.bias is not None and anc.beta != 0:
            bias = dag.cast(self.read(anc.bias, self.operand_index(self.own[op.id], anc.bias)), f32)
            if anc.beta != 1:
                bias = dag.op("{} * {}", dag.lit(anc.beta, f32), bias, dtype=f32)
            val = dag.op("{} + {}", val, bias, dtype=f32, logical=anc.dtype, comment=f"{op.qualname} bias")
        self.memo[key] = val
        return val

    def load(self, inp, tidx: tuple, view: View) -> Node:
        """Loads that vary along one axis of the tile only (a bias along the columns) take that axis' mask,
        so they stay [1, BLOCK_N] (or [BLOCK_M, 1]) rather than being broadcast to the whole tile."""
        node = super().load(inp, tidx, view)
        if node.kind != "load" or len(node.inputs) < 2 or not self.axis_masks:
            return node
        offset = node.inputs[0]
        axes = [ax for ax, (names, _) in self.axis_masks.items() if _uses(offset, names)]
        if len(axes) == 1:
            return self.dag.load(node.fmt, offset, self.axis_masks[axes[0]][1], inp.dtype, hint=inp.id)
        return node

    def operand_offset(self, view: View, idx: tuple) -> tuple[str, Node]:
        """(pointer name, offset node) of a matmul operand read at `idx`: it must be a program input."""
        if not isinstance(self.p.source(view.src), Input):
            raise Unsupported("a matmul operand is computed inside the group (prologue fusion is not generated)")
        node = self.read(view, idx)
        return node.fmt, node.inputs[0]


def _uses(x: Node, names: set) -> bool:
    return (x.kind == "var" and x.fmt in names) or any(_uses(i, names) for i in x.inputs)


def same_index(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y or (x.kind == y.kind == "lit" and x.fmt == y.fmt) for x, y in zip(a, b))


def out_index(b: TileBuilder, vid: str) -> tuple:
    """The index of value `vid` at the tile's element: its reads traced back to an anchor, inverted."""
    if vid in b.tiles:
        return b.tiles[vid]
    p = b.p
    v = p.values.get(vid)
    if v is None:
        raise Unsupported(f"output {vid} is an input of the group")
    for a in v.op.args.values():
        for view in (a if isinstance(a, list) else [a]):
            if isinstance(view, View) and view.src in p.values and _reaches(b, view.src):
                src_idx = out_index(b, view.src)
                return _invert(b, view, src_idx, v.shape)
    raise Unsupported(f"output {vid} does not depend on the matmul")


def _reaches(b: TileBuilder, vid: str) -> bool:
    if vid in b.tiles:
        return True
    v = b.p.values.get(vid)
    return v is not None and any(isinstance(x, View) and x.src in b.p.values and _reaches(b, x.src)
                                 for a in v.op.args.values() for x in (a if isinstance(a, list) else [a]))


def _invert(b: TileBuilder, view: View, src_idx: tuple, out_shape: list) -> tuple:
    """The op output's index whose read through `view` lands on `src_idx` of the view's source."""
    p, dag = b.p, b.dag
    src = p.source(view.src)
    lit1 = lambda d: p.sizes.norm(d).literal and d.value == 1  # noqa: E731
    ref = [None] * len(view.dims)
    for r in view.reshapes:  # a whole block, read densely: linearise the source index, unravel it by the ref's steps
        sizes = [view.shape[d].value for d in r.ref_dims]
        dense = [math.prod(sizes[j + 1:]) for j in range(len(sizes))]
        if r.steps != dense or math.prod(sizes) != math.prod(r.extents) or any(view.starts[e] for e in r.src_dims):
            raise Unsupported("the epilogue reads part of the matmul output through a reshaping view")
        lin = dag.isum([dag.imul(src_idx[e], dag.lit(u)) for e, u in zip(r.src_dims, r.units)])
        for j, (d, step) in enumerate(zip(r.ref_dims, r.steps)):
            q = lin if step == 1 else dag.add("op", "{} // {}", (lin, dag.lit(step)))
            ref[d] = q if j == 0 else dag.add("op", "{} % {}", (q, dag.lit(sizes[j])))
    for d, e in enumerate(view.dims):
        if ref[d] is not None:
            continue
        if e is None:
            if not lit1(view.shape[d]):
                raise Unsupported("the epilogue broadcasts the matmul output (an expand, e.g. repeating K/V heads "
                                  "for grouped-query attention): an epilogue writes each output element once, "
                                  "so it is not generated; the pointwise part alone may still fuse")
            ref[d] = dag.lit(0)
        else:
            if view.starts[e] or p.dim_key(view.shape[d]) != p.dim_key(src.shape[e]):
                raise Unsupported("the epilogue reads a slice of the matmul output")
            ref[d] = src_idx[e]
    if view.reshapes:  # reading the view at `ref` lands on src_idx itself (not on an equal expression of it)
        b.landing[(id(view), tuple(id(i) for i in ref))] = tuple(src_idx)
    walked = {e for e in view.dims if e is not None} | {e for r in view.reshapes for e in r.src_dims}
    if any(e not in walked and not lit1(src.shape[e]) for e in range(len(src.shape))):
        raise Unsupported("the epilogue reads part of the matmul output (a select)")
    shift = len(out_shape) - len(view.shape)
    out = []
    for j, d in enumerate(out_shape):
        r = j - shift
        if r < 0 or (lit1(view.shape[r]) and not lit1(d)):
            if not lit1(d):
                raise Unsupported("the epilogue broadcasts the matmul output to a bigger shape")
            out.append(dag.lit(0))
        else:
            out.append(ref[r])
    return tuple(out)


def stores_for(b: TileBuilder, mask: Node, outputs=None) -> list:
    """One store per output, at the tile's element of each."""
    p, dag = b.p, b.dag
    stores = []
    for k, v in enumerate(p.outputs):
        if outputs is not None and k not in outputs:
            continue
        idx = out_index(b, v.id)
        val = b.value_at(v.id, idx)
        offset = dag.isum([dag.imul(i, b.stride(f"out{k}", d)) for d, i in enumerate(idx)])
        stores.append(Store(k, val, offset, mask, v.dtype))
    return stores


# ------------------------------------------------------------------------------------------ printing
RESERVED = {"pid", "pid_m", "pid_n", "pid_b", "rm", "rn", "m", "n", "ka", "kb", "acc", "a_tile", "b_tile", "k0",
            "m0", "y0", "y1", "y2", "y3", "mask", "row_mask", "col_mask", "a_offs", "b_offs", "M", "N", "K", "red",
            "part", "i", "j", "jv", "ri", "rj", "rd", "rdv", "dq", "dk", "dv",
            "q", "kt", "v", "s", "p", "p_v", "l_i", "m_i", "m_new", "m_safe", "alpha", "scores", "out", "start_n",
            "LQ", "LK", "D", "DV", "num_pid_m", "num_pid_n", "num_pid_in_group", "first_pid_m", "group_size_m"}


class TilePrinter(Printer):
    """The generator's printer over an explicit set of roots (the template writes loads and loops)."""

    def __init__(self, plan: Plan, roots: list):
        self.plan = plan
        self.names: dict = {}
        self.taken = set(RESERVED)
        self.needed = _ancestors([r for r in roots if r is not None])
        self.uses: dict = {}
        for x in self.needed:
            for i in x.inputs:
                self.uses[id(i)] = self.uses.get(id(i), 0) + 1
        self.dep: dict = {}

    def depends(self, x: Node, names: set) -> bool:
        """Whether x varies with any of the template variables `names` (loop indices, accumulators)."""
        key = (id(x), frozenset(names))
        hit = self.dep.get(key)
        if hit is None:
            hit = (x.kind == "var" and x.fmt in names) or any(self.depends(i, names) for i in x.inputs)
            self.dep[key] = hit
        return hit

    def offset(self, off: Node, axes: list) -> str:
        """An offset expression with the tile's shape: `+ 0 * axis` for each axis it does not vary along
        (a size-1 dim reads as index 0), so pointer and mask always broadcast to the same block."""
        text = self.expr(off, 1) if not off.is_zero else "0"
        return text + "".join(f" + 0 * {a}" for a in axes if not self.depends(off, {a}))

    def store_lines(self, s, depth: int, axes: list) -> list:
        ind = INDENT * depth
        v, lines = self.expr(s.value), []
        if s.dtype == torch.bfloat16:
            lines = [f"{ind}y{s.out} = {v}",
                     f"{ind}if UPCAST:  # the interpreter truncates fp32 -> bf16: round to nearest even, as the GPU does",
                     f"{ind}{INDENT}y{s.out} = _round_bf16(y{s.out})"]
            v = f"y{s.out}"
        if s.value.dtype != s.dtype and s.dtype != torch.bool:
            v = f"{v}.to({tl_type(s.dtype)})"
        return lines + [f"{ind}tl.store(out{s.out}_ptr + {self.offset(s.offset, axes)}, {v}, mask={self.expr(s.mask)})"]

    def scope(self, roots: list, out: list, depth: int, done: set, inside=lambda x: True) -> None:
        """Lines for what `roots` need that is not done yet, restricted to nodes for which inside(x)."""
        nodes = [x for x in _closure([r for r in roots if r is not None], lambda x: id(x) in done) if inside(x)]
        self.emit(nodes, out, depth, done)


def kernel_params(plan: Plan, needed: list, ptrs: set) -> tuple[list, list]:
    """Kernel parameters and the launcher's expressions for them (inputs, outputs, sizes, strides)."""
    p, b = plan.prog, plan.builder
    used = {x.fmt for x in needed if x.kind in ("load", "arg")} | set(ptrs)
    params, call = [], []
    for i in p.inputs:
        if f"{i.id}_ptr" in used:
            params.append(f"{i.id}_ptr")
            call.append(i.id)
    for k in range(len(p.outputs)):
        params.append(f"out{k}_ptr")
        call.append(f"out{k}")
    for name, d in sorted(b.size_args.items()):
        if name in used:
            params.append(name)
            call.append(size_expr(p, d))
    for name, (t, d) in sorted(b.strides.items()):
        if name in used:
            params.append(name)
            call.append(f"{t}.stride({d})")
    return params, call


def product_expr(prog: Program, dims: list) -> str:
    parts = [size_expr(prog, d) for d in dims if not (prog.sizes.norm(d).literal and d.value == 1)]
    return " * ".join(f"({x})" if "+" in x else x for x in parts) or "1"


def module_name(prog: Program) -> str:
    names = []
    for o in prog.ops:
        if o.low is RESHAPE:
            continue
        nm = o.name.split("::")[1].strip("_").replace("_to_copy", "to")
        if not names or names[-1] != nm:
            names.append(nm)
    return "_".join(names[:5]) + ("_etc" if len(names) > 5 else "") + "_kernel"


def assemble(plan: Plan, kernels: str, launch: list, config: str, extra: str = "") -> str:
    # the table's helpers the kernel calls (incl. _round_bf16: bf16 rounding as the GPU does, in the interpreter)
    helpers = helper_source(h for h in HELPERS if f"{h}(" in kernels or f", {h})" in kernels)
    parts = ["import os\n\nimport torch\nimport triton\nimport triton.language as tl\n",
             "\n" + helpers if helpers else "", "\n\n" + kernels, "\n\n" + _run(plan, launch),
             extra, COMMON, config]
    return "".join(parts).replace("\n\n\n\n", "\n\n\n").strip() + "\n"


TUNE_TEXT = '''

TUNE = os.environ.get("FUSION_ADVISOR_TUNE", "1") != "0"  # time the configs on the first call at a shape
_best = {}


def _interpreted(x):
    """Whether a launch on x runs in Triton's interpreter: on the CPU (fusion-advisor's loader makes these kernels
    run there on CPU tensors), or everywhere where TRITON_INTERPRET=1 was set."""
    return x.device.type == "cpu" or os.environ.get("TRITON_INTERPRET") == "1"


def _small(x):
    """A block size for the interpreter: the size rounded up to a power of two, 16 to 64."""
    return min(64, max(16, triton.next_power_of_2(max(int(x), 1))))


def _tuned(key, launch, tune, configs, default):
    """The fastest of `configs` at `key`, timed once on the GPU (configs that fail to compile are skipped).
    A call that times nothing (tune off) remembers nothing: a later tuned call at `key` still times them."""
    hit = _best.get(key)
    if hit is None:
        if not (tune and TUNE):
            return default
        hit, times = default, []
        for cfg in configs:
            try:
                times.append(triton.testing.do_bench(lambda c=cfg: launch(c), warmup=3, rep=15))
            except Exception:  # too much shared memory for this dtype and tile: skip it
                times.append(float("inf"))
        if min(times) < float("inf"):
            hit = configs[times.index(min(times))]
        _best[key] = hit
    return hit


def _dot_precision(dtype):
    """fp32 operands: exact fp32 products ("ieee"), unless torch allows TF32 for matmuls (then eager uses it
    too). bf16/fp16 operands always use the tensor cores; Triton's default ("tf32") leaves them alone."""
    return "ieee" if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"


def _upcast(x):
    """x is bf16 under the interpreter, whose bf16 tl.dot is wrong and whose fp32 -> bf16 conversion truncates
    (triton 3.9): the kernels then upcast the operands (bf16 -> fp32 is exact, so the products are the
    GPU's) and round what they convert to bf16 to nearest even themselves."""
    return x.dtype == torch.bfloat16 and _interpreted(x)
'''

MATMUL_CONFIG = '''
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): the usual Hopper/Ampere tiles.
CONFIGS = [(128, 256, 64, 8, 8, 3), (256, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4),
           (128, 128, 32, 8, 4, 4), (64, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4), (64, 64, 64, 8, 4, 3)]


def _config(key, launch, tune, interpreted):
    """The launch configuration at key = (M, N, K, dtype): one small tile under the interpreter."""
    if interpreted:
        return (_small(key[0]), _small(key[1]), _small(key[2]), 1, 4, 1)
    return _tuned(key, launch, tune, CONFIGS, CONFIGS[2])
'''


# ------------------------------------------------------------------------------------------ epilogue
def grid_split(anc: Anchor) -> tuple[list, list]:
    """(lead dims on grid axis 1, lead dims flattened into the rows M)."""
    grid = list(anc.b_batch)
    return grid, [d for d in range(len(anc.lead)) if d not in grid]


def tile_index(b: TileBuilder, lead: list, n_dim: Dim, m: Node, n: Node, pid_b: Node, grid: list,
               rows: list) -> tuple:
    """The index at the tile element of an output with leading dims `lead`: grid dims from pid_b, row
    dims from m, then n."""
    bidx = _unravel(b, pid_b, [lead[d] for d in grid], list(range(len(grid))), "b", "")
    midx = _unravel(b, m, [lead[d] for d in rows], list(range(len(rows))), "row", "")
    idx: list = [None] * len(lead)
    for d, x in zip(grid, bidx):
        idx[d] = x
    for d, x in zip(rows, midx):
        idx[d] = x
    return tuple(idx) + (b.axis(n, n_dim),)


def operand_offsets(b: TileBuilder, anc: Anchor, idx: tuple, ka: Node, kb: Node, n: Node) -> tuple:
    """((A pointer, offset at (rows, ka)), (B pointer, offset at (kb, n))) for the tile at `idx`."""
    ka, kb, n = b.axis(ka, anc.k), b.axis(kb, anc.k), b.axis(n, anc.n)
    a = b.operand_offset(anc.a, tuple(idx[:-1]) + (ka,))
    if anc.b_nk:
        bb = b.operand_offset(anc.b, (n, kb))
    else:
        bb = b.operand_offset(anc.b, tuple(idx[d] for d in anc.b_batch) + (kb, n))
    return a, bb


def k_loop(pr: TilePrinter, a: tuple, bb: tuple, depth: int, done: set, rows_mask: str = "m < M") -> list:
    """The K loop: fp32 accumulation of A-tile @ B-tile."""
    ind = INDENT * depth
    lines = [f"{ind}acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # fp32 accumulation, whatever the inputs",
             f"{ind}for k0 in range(0, K, BLOCK_K):",
             f"{ind}{INDENT}ka = k0 + tl.arange(0, BLOCK_K)[None, :]  # columns of A",
             f"{ind}{INDENT}kb = k0 + tl.arange(0, BLOCK_K)[:, None]  # rows of B"]
    pr.scope([a[1], bb[1]], lines, depth + 1, done)
    lines += [f"{ind}{INDENT}a_offs = {pr.offset(a[1], ['m', 'ka'])}",
              f"{ind}{INDENT}b_offs = {pr.offset(bb[1], ['kb', 'n'])}",
              f"{ind}{INDENT}a_tile = tl.load({a[0]} + a_offs, mask=({rows_mask}) & (ka < K), other=0.0)",
              f"{ind}{INDENT}b_tile = tl.load({bb[0]} + b_offs, mask=(kb < K) & (n < N), other=0.0)",
              f"{ind}{INDENT}if UPCAST:",
              f"{ind}{INDENT * 2}a_tile = a_tile.to(tl.float32)",
              f"{ind}{INDENT * 2}b_tile = b_tile.to(tl.float32)",
              f"{ind}{INDENT}acc += tl.dot(a_tile, b_tile, input_precision=DOT_PRECISION)"]
    return lines


def the_anchor(ctx: Anchored, kind: str) -> Anchor:
    if len(ctx.anchors) != 1:
        raise Unsupported(f"{len(ctx.anchors)} matmuls in one {kind} group: one anchor per kernel")
    return next(iter(ctx.anchors.values()))


def epilogue_source(ctx: Anchored) -> str:
    p = ctx.prog
    anc = the_anchor(ctx, "epilogue")
    dag = Dag()
    b = TileBuilder(ctx, dag)
    m, n = dag.var("m", full=True), dag.var("n", full=True)
    ka, kb = dag.var("ka", full=True), dag.var("kb", full=True)
    pid_b = dag.var("pid_b", full=False)
    b.mask = dag.var("mask", full=True)
    b.axis_masks = {"rows": ({"m"}, dag.var("row_mask", full=True)), "cols": ({"n"}, dag.var("col_mask", full=True))}
    grid, rows = grid_split(anc)
    idx = tile_index(b, anc.lead, anc.n, m, n, pid_b, grid, rows)
    b.set_tile(anc, "acc", idx)
    a_op, b_op = operand_offsets(b, anc, idx, ka, kb, n)
    stores = stores_for(b, b.mask)
    plan = Plan("epilogue", p, dag, b, stores)
    pr = TilePrinter(plan, [s.value for s in stores] + [s.offset for s in stores] + [a_op[1], b_op[1]])
    name = module_name(p)
    params, call = kernel_params(plan, pr.needed, {a_op[0], b_op[0]})
    loop_vars = {"ka", "kb", "acc", "mask", "row_mask", "col_mask"}
    lines = ["@triton.jit",
             signature(name, params + ["M", "N", "K", "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr",
                                       "BLOCK_K: tl.constexpr", "GROUP_M: tl.constexpr",
                                       "DOT_PRECISION: tl.constexpr", "UPCAST: tl.constexpr",
                                       "BIG_INDEX: tl.constexpr"]),
             f"{INDENT}# The output tile this program computes, in grouped order: GROUP_M row blocks in flight",
             f"{INDENT}# together walk the same columns of B, which then stay in L2.",
             f"{INDENT}pid = tl.program_id(0)"]
    if grid:
        lines.append(f"{INDENT}pid_b = tl.program_id(1)  # batch: the dims B varies along")
    lines += [f"{INDENT}num_pid_m = tl.cdiv(M, BLOCK_M)",
              f"{INDENT}num_pid_n = tl.cdiv(N, BLOCK_N)",
              f"{INDENT}num_pid_in_group = GROUP_M * num_pid_n",
              f"{INDENT}first_pid_m = (pid // num_pid_in_group) * GROUP_M",
              f"{INDENT}group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)",
              f"{INDENT}pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m",
              f"{INDENT}pid_n = (pid % num_pid_in_group) // group_size_m",
              f"{INDENT}rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
              f"{INDENT}rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
              f"{INDENT}if BIG_INDEX:  # 2**31 elements or more: 64-bit offsets",
              f"{INDENT * 2}rm = rm.to(tl.int64)",
              f"{INDENT * 2}rn = rn.to(tl.int64)"]
    if grid:
        lines.append(f"{INDENT * 2}pid_b = pid_b.to(tl.int64)")
    lines += [f"{INDENT}m = rm[:, None]  # the tile's rows, as a column",
              f"{INDENT}n = rn[None, :]  # the tile's columns, as a row"]
    done: set = set()
    pr.scope([a_op[1], b_op[1]], lines, 1, done, lambda x: not pr.depends(x, loop_vars))
    lines += k_loop(pr, a_op, b_op, 1, done)
    lines += [f"{INDENT}row_mask = m < M",
              f"{INDENT}col_mask = n < N",
              f"{INDENT}mask = row_mask & col_mask"]
    lines.append(f"{INDENT}# epilogue: the group's ops on the accumulator, in registers")
    pr.scope([s.value for s in stores] + [s.offset for s in stores], lines, 1, done)
    for s in stores:
        lines += pr.store_lines(s, 1, ["m", "n"])
    kernel = "\n".join(lines) + "\n"
    launch = matmul_launch(p, anc, name, call, [anc.lead[d] for d in grid], [anc.lead[d] for d in rows],
                           tune=not p.inplace)
    return assemble(plan, kernel, launch, TUNE_TEXT + MATMUL_CONFIG)


def matmul_launch(p: Program, anc: Anchor, name: str, call: list, grid_dims: list, row_dims: list, tune: bool,
                  reduce_grid: bool = False) -> list:
    """The launcher's body: sizes, arguments, and one launch at the (tuned) configuration."""
    from advisor.codegen.module import _wrap

    a_in = anc.a.src
    what = "the reduced dims" if reduce_grid else "the product's leading dims, flattened"
    lines = [f"    M = {product_expr(p, row_dims)}  # rows: {what}",
             f"    N = {size_expr(p, anc.n)}  # columns",
             f"    K = {size_expr(p, anc.k)}  # contraction",
             f"    BATCH = {product_expr(p, grid_dims)}  # grid axis: " + ("the kept dims" if reduce_grid else
                                                                         "the dims B varies along"),
             "    args = (" + _wrap(call + ["M", "N", "K"], ", ", 12, first=12) + ")",
             f"    big = _int64_needed({tensors_expr(p)})",
             f"    precision, upcast = _dot_precision({a_in}.dtype), _upcast({a_in})"]
    if reduce_grid:
        lines += ["",
                  "    def launch(cfg):",
                  "        BLOCK_M, BLOCK_N, BLOCK_K, _, num_warps, num_stages = cfg",
                  f"        {name}[(BATCH, triton.cdiv(N, BLOCK_N))](",
                  "            *args, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_PRECISION=precision,",
                  "            UPCAST=upcast, BIG_INDEX=big, num_warps=num_warps, num_stages=num_stages)",
                  "",
                  "    if N and BATCH:",
                  f"        launch(_config((M, N, K, {a_in}.dtype), launch, {tune}, _interpreted({a_in})))"]
    else:
        lines += ["",
                  "    def launch(cfg):",
                  "        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages = cfg",
                  "        grid = (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N), BATCH)",
                  f"        {name}[grid](*args, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,",
                  "            DOT_PRECISION=precision, UPCAST=upcast, BIG_INDEX=big, num_warps=num_warps,",
                  "            num_stages=num_stages)",
                  "",
                  "    if M and N and BATCH:",
                  f"        launch(_config((M, N, K, {a_in}.dtype), launch, {tune}, _interpreted({a_in})))"]
    return lines

"""A candidate's analysis.json program read into the IR (`advisor.codegen.ir`): inputs as symbolic
sizes, refs as views (index maps), each op checked against its lowering and its output shapes inferred
(`advisor.codegen.shapes`); raises Unsupported with the reason a program cannot be generated."""
from __future__ import annotations

from advisor.analysis.program import arg_values, node_schema
from advisor.codegen.ir import Dim, Input, Op, Program, Reshape, Sizes, Value, View, torch_dtype
from advisor.codegen.shapes import infer_shapes
from advisor.ops.args import by_name
from advisor.ops.lowering import Unsupported, lowering, why_not_generated


def read_program(prog: dict) -> Program:
    """The IR of an analysis.json program; raises Unsupported with the reason it cannot be generated."""
    sizes = Sizes()
    p = Program([], {}, [], [], sizes)
    for k, spec in enumerate(prog["inputs"]):
        shape = [sizes.symbol(f"in{k}.{d}", n) for d, n in enumerate(spec["shape"])]
        for d in shape:
            if d.value == 1:
                sizes.pin(d)  # broadcast structure is part of the pattern
        p.inputs.append(Input(spec["id"], torch_dtype(spec["dtype"]), shape, list(spec["shape"]),
                              list(spec["strides"]), int(spec.get("storage_offset") or 0)))
    for spec in prog["nodes"]:
        p.ops.append(_read_op(p, spec))
    missing = [v for v in prog["outputs"] if v not in p.values]
    if missing:  # e.g. an op that returned its own input (torch.positive): a KeyError here used to escape as a crash
        raise Unsupported(f"output {missing[0]} is not computed by the program (an input returned as it is)")
    set_outputs(p, prog["outputs"])
    return p


def set_outputs(p, output_ids: list) -> None:
    """The program's outputs, then the last version of each input it mutates: a mutated input must end up
    mutated even when nothing in the group reads it afterwards."""
    p.outputs = [p.values[v] for v in output_ids]
    p.returned = len(p.outputs)
    last = {}
    for vid, view in p.inplace.items():
        last[view.src] = vid
    for vid in last.values():
        if p.values[vid] not in p.outputs:
            p.outputs.append(p.values[vid])



def _read_op(p: Program, spec: dict) -> Op:
    name = spec["op"]
    low = lowering(name)
    if low is None:
        raise Unsupported(f"{name} is not generated: {why_not_generated(name)}")
    schema, args = read_args(p, spec)
    overload = schema.overload_name or "default"
    if low.shape == "cat" and any(len(v.shape) > 1 for v in args["tensors"]):
        # torch.cat skips 1-d empty tensors next to others (a legacy rule): transformers' KV cache starts as one.
        args["tensors"] = [v for v in args["tensors"] if [d.value for d in v.shape] != [0]]
    op = Op(spec["id"], name, overload, low, args, [], bool(spec.get("inplace")))
    shapes = infer_shapes(p, op, [o["shape"] for o in spec["outputs"]])
    if len(shapes) < len(spec["outputs"]):
        raise Unsupported(f"{op.qualname}: {len(spec['outputs'])} outputs, the lowering knows {len(shapes)}")
    for slot, (out, shape) in enumerate(zip(spec["outputs"], shapes)):
        if [d.value for d in shape] != list(out["shape"]):
            raise Unsupported(f"{op.qualname}: shape inference gives {[d.value for d in shape]}, "
                              f"the trace recorded {out['shape']}")
        v = Value(out["id"], torch_dtype(out["dtype"]), shape, list(out["shape"]), list(out["strides"]), op, slot)
        p.values[v.id] = v
        op.outputs.append(v)
    if op.inplace:
        _track_inplace(p, op, next(x for x in args.values() if isinstance(x, View)))
    return op


def _track_inplace(p: Program, op: Op, target: View) -> None:
    """An in-place op on an input (or on an earlier in-place result) writes into that input's memory."""
    v = op.outputs[0]
    src = p.source(target.src)
    if isinstance(src, Input):
        p.inplace[v.id] = target
    elif target.src in p.inplace and target.identity:
        p.inplace[v.id] = p.inplace[target.src]
    elif target.src in p.inplace:
        raise Unsupported(f"{op.qualname} writes into a view of an in-place result")
    else:
        return  # in place on an intermediate: just a value
    v.offset = src.offset + sum(s * st for s, st in zip(p.inplace[v.id].starts, src.rec_strides)) \
        if isinstance(src, Input) else src.offset


def read_args(p: Program, spec: dict) -> tuple:
    """(schema, arguments by name): tensors as Views (lists of them), other values decoded."""
    schema = _schema(spec)
    return schema, by_name(schema, arg_values(spec, lambda ref: _view(p, ref)))


def _schema(spec: dict):
    sch = node_schema(spec)
    if sch is None:
        raise Unsupported(f"no schema recorded for {spec['op']} and none of its overloads fits")
    return sch


def _view(p: Program, ref: dict) -> View:
    sid = ref["ref"]
    if sid == "?" or (sid not in p.values and not any(i.id == sid for i in p.inputs)):
        raise Unsupported(f"a ref names {sid!r}, which is neither an input nor an earlier value")
    src = p.source(sid)
    shape, strides, off = list(ref["shape"]), list(ref["strides"]), int(ref.get("storage_offset") or 0)
    base_off = src.offset
    same_strides = all(a == b for n, a, b in zip(shape, strides, src.rec_strides) if n != 1)
    if shape == src.rec_shape and same_strides and off == base_off:
        return View(sid, list(src.shape), list(range(len(shape))), [0] * len(shape), identity=True)
    starts = _starts(off - base_off, src.rec_shape, src.rec_strides)
    if starts is None:
        raise Unsupported(f"reads {sid} at storage offset {off}, which no index of it reaches")
    dims = _walked_dims(shape, strides, src)
    if dims is None or (isinstance(src, Value) and not all(
            0 <= starts[e] <= starts[e] + shape[d] <= src.rec_shape[e] for d, e in enumerate(dims) if e is not None)):
        dims, reshapes = _reshape(sid, src, shape, strides, starts)
    else:
        reshapes = []
    sizes = []
    for d, n in enumerate(shape):
        e = dims[d]
        if e is not None and n == src.rec_shape[e] and starts[e] == 0:
            sizes.append(src.shape[e])
        else:
            sizes.append(Dim((), n, n))
            if e is not None:
                p.sizes.pin(src.shape[e])
    walked = set(dims) | {e for r in reshapes for e in r.src_dims}
    for e, s in enumerate(starts):
        if s or (e not in walked and src.rec_shape[e] > 1):  # a slice's offset; a select of a dim the view drops
            p.sizes.pin(src.shape[e])
    for r in reshapes:  # the block's index arithmetic holds its recorded sizes
        for e in r.src_dims:
            p.sizes.pin(src.shape[e])
    return View(sid, sizes, dims, starts, reshapes=reshapes)


def _walked_dims(shape, strides, src) -> list | None:
    """Per ref dim, the source dim it walks (same stride, preferring the right-aligned position), or
    None when some ref dim matches no source dim's stride (the view merges or splits dims)."""
    used, dims = set(), []
    for d, (n, st) in enumerate(zip(shape, strides)):
        if n == 1 or st == 0:
            dims.append(None)
            continue
        aligned = d + len(src.rec_shape) - len(shape)
        cands = [e for e in range(len(src.rec_strides)) if src.rec_strides[e] == st and src.rec_shape[e] > 1
                 and e not in used]
        if not cands:
            return None
        e = aligned if aligned in cands else cands[0]
        used.add(e)
        dims.append(e)
    return dims


def _reshape(sid: str, src, shape, strides, starts) -> tuple[list, list]:
    """(dims, [Reshape]) of a view that merges or splits its source's dims.

    Each ref dim lands on the source dims its memory steps cross; ref dims landing on common source
    dims, and source dims their largest index carries into, form one block. A block of one ref dim
    walking one source dim stays a plain index map. Blocks need their source dims dense (what .view()
    and .reshape() produce); an input's block also in its logical order, so that the kernel, which
    reads inputs through their run-time strides, reads the same elements as the view did."""
    S, ss = src.rec_shape, src.rec_strides
    live = sorted((e for e in range(len(S)) if S[e] > 1 and ss[e] > 0), key=lambda e: -ss[e])  # outermost first
    why = f"reads {sid} through a view (shape {shape}, strides {strides}) that"
    spans = {}  # ref dim -> [first, last] position in `live` it lands on
    for d, (n, st) in enumerate(zip(shape, strides)):
        if n == 1 or st == 0:
            continue
        hit = [i for i, e in enumerate(live) if ss[e] <= st * (n - 1) and (st < ss[e] * S[e] or st % (ss[e] * S[e]))]
        if st < 0 or not hit:
            raise Unsupported(f"{why} is no merge or split of its dims")
        spans[d] = [min(hit), max(hit)]
    blocks = []  # [first, last] positions in `live`
    for lo, hi in sorted(spans.values()):
        if blocks and lo <= blocks[-1][1]:
            blocks[-1][1] = max(blocks[-1][1], hi)
        else:
            blocks.append([lo, hi])

    def top(lo, hi):  # the block's largest linear index, in units of its innermost stride
        mine = [d for d, (a, b) in spans.items() if lo <= a and b <= hi]
        inner = ss[live[hi]]
        return (sum((shape[d] - 1) * strides[d] for d in mine) // inner
                + sum(starts[e] * ss[e] // inner for e in live[lo:hi + 1]))

    k = len(blocks) - 1
    while k >= 0:  # innermost first: a block whose largest index carries into the next dim out takes it in
        lo, hi = blocks[k]
        if lo == 0 or top(lo, hi) < ss[live[lo]] * S[live[lo]] // ss[live[hi]]:
            k -= 1
        elif k > 0 and blocks[k - 1][1] == lo - 1:
            blocks[k - 1][1] = hi
            del blocks[k]
            k -= 1
        else:
            blocks[k][0] = lo - 1
    out = []
    for lo, hi in blocks:
        mine = [d for d, (a, b) in spans.items() if lo <= a and b <= hi]
        block, inner = live[lo:hi + 1], ss[live[hi]]
        units = {e: ss[e] // inner for e in block}
        if isinstance(src, Value) and top(lo, hi) >= units[block[0]] * S[block[0]]:
            raise Unsupported(f"reads {sid} beyond the {S} elements its op wrote (a view of shape {shape}, "
                              f"strides {strides}): the trace recorded a smaller tensor than the one read")
        if any(ss[a] != ss[b] * S[b] for a, b in zip(block, block[1:])):
            raise Unsupported(f"{why} merges dims that are not adjacent in memory")
        if any(strides[d] % inner for d in mine):
            raise Unsupported(f"{why} steps across its dims' strides")
        if not isinstance(src, Value) and block != sorted(block):
            raise Unsupported(f"{why} merges the input's dims in another order than their logical one "
                              "(make the input contiguous first)")
        out.append((mine, block, units))
    dims, reshapes = [None] * len(shape), []
    for mine, block, units in out:
        if len(mine) == 1 and len(block) == 1 and strides[mine[0]] == ss[block[0]]:
            dims[mine[0]] = block[0]
            continue
        mine.sort(key=lambda d: -strides[d])
        reshapes.append(Reshape(mine, [strides[d] // ss[block[-1]] for d in mine], block,
                                [units[e] for e in block], [S[e] for e in block]))
    return dims, reshapes


def _starts(delta: int, shape, strides):
    """Per-dim start indices whose offsets add up to `delta` (outermost dims first, truncating)."""
    starts = [0] * len(shape)
    for e in sorted(range(len(shape)), key=lambda e: -abs(strides[e])):
        if strides[e] and shape[e] > 1:
            q = int(delta / strides[e])
            starts[e], delta = q, delta - q * strides[e]
    return starts if delta == 0 else None

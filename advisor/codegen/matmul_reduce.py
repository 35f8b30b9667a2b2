"""Matmul + reduction over leading dims (SPLADE's `amax over seq of log1p(relu(h @ W^T + b)) * mask`).

One program owns a block of columns (BLOCK_N vocabulary entries) for one index of the kept leading
dims (a batch row), and loops over the reduced rows (the sequence) a BLOCK_M tile at a time: the
tile's matmul accumulates in fp32, the group's pointwise chain runs on it in registers (through the
generator's Builder and lowering table, like an epilogue), and the tile's column maxima (or sums)
fold into a running [BLOCK_N] vector. Nothing of the B x L x V matmul output is ever written: no
atomics and no second pass are needed, since one program sees every reduced row of its columns.
The grid puts the kept dims on the fast axis, so the programs in flight share a block of W in L2.
"""
from __future__ import annotations

import torch

from advisor.codegen.dag import Dag
from advisor.codegen.matmul import INDENT, TUNE_TEXT, Anchored, TilePrinter, TileBuilder, assemble, \
    k_loop, kernel_params, matmul_launch, module_name, operand_offsets, out_index, the_anchor, tile_index
from advisor.codegen.plan import Plan, _unravel
from advisor.codegen.printer import signature
from advisor.ops.args import reduced_dims
from advisor.ops.lowering import Unsupported, tl_type
from advisor.ops.registry import REDUCE_KINDS

NEUTRAL = {"max": '-float("inf")', "min": 'float("inf")', "sum": "0.0", "mean": "0.0"}

MREDUCE_CONFIG = '''
# (BLOCK_M, BLOCK_N, BLOCK_K, -, num_warps, num_stages): rows per step of the reduction loop, columns per program.
CONFIGS = [(64, 128, 64, 1, 4, 3), (128, 128, 64, 1, 8, 3), (64, 256, 64, 1, 8, 3), (128, 64, 64, 1, 4, 3),
           (64, 64, 64, 1, 4, 3), (32, 128, 64, 1, 4, 4)]


def _config(key, launch, tune, interpreted):
    """The launch configuration at key = (M, N, K, dtype): one small tile under the interpreter."""
    if interpreted:
        return (_small(key[0]), _small(key[1]), _small(key[2]), 1, 4, 1)
    return _tuned(key, launch, tune, CONFIGS, CONFIGS[0])
'''


def matmul_reduce_source(ctx: Anchored) -> str:
    p = ctx.prog
    anc = the_anchor(ctx, "matmul_reduction")
    reds = [o for o in p.ops if o.low.kind == "anchor_reduce"]
    if len(reds) != 1 or p.ops[-1] is not reds[0] or [v.id for v in p.outputs] != [reds[0].outputs[0].id]:
        raise Unsupported("a matmul_reduction group must end in its one reduction, its only output")
    # The tile walks the chain's shape: the anchor output, or a reshape of it that only splits its rows
    # (nn.Linear on a 3-d input, recorded as addmm on the flattened rows and a view).
    tile_out, rid = anc.op.outputs[0], None
    if ctx.reshapes:
        rid, (_, split) = next(iter(ctx.reshapes.items()))
        if len(ctx.reshapes) > 1 or anc.b_batch or split != len(p.values[rid].shape) - 1:
            raise Unsupported("the reduction reads the matmul output through a reshape of its columns")
        tile_out = p.values[rid]
    lead = list(tile_out.shape[:-1])
    red = reds[0]
    kind = REDUCE_KINDS[red.name]
    x = red.args["self"]
    if not x.identity or [p.dim_key(d) for d in x.shape] != [p.dim_key(d) for d in tile_out.shape]:
        raise Unsupported("the reduction reads the chain through a view")
    rank = len(x.shape)
    reduced = list(reduced_dims(red.args["dim"], rank))
    if rid is None and any(d in anc.b_batch for d in reduced):
        raise Unsupported("the reduction runs along a dim the weight varies along")
    keep = bool(red.args.get("keepdim"))
    grid = [d for d in range(len(lead)) if d not in reduced]

    dag = Dag()
    b = TileBuilder(ctx, dag)
    m, n, rn = dag.var("m", full=True), dag.var("n", full=True), dag.var("rn", full=True)
    ka, kb = dag.var("ka", full=True), dag.var("kb", full=True)
    pid_b = dag.var("pid_b", full=False)
    b.mask = dag.var("mask", full=True)
    b.axis_masks = {"rows": ({"m"}, dag.var("row_mask", full=True)), "cols": ({"n"}, dag.var("col_mask", full=True))}
    idx = tile_index(b, lead, anc.n, m, n, pid_b, grid, reduced)
    if rid is None:
        own = idx
        b.set_tile(anc, "acc", idx)
    else:  # the anchor's own row: the reshape's rows flattened (their sizes are pinned), unravelled over its dims
        flat = b.flatten(idx[:-1], lead)
        own = tuple(_unravel(b, flat, anc.lead, list(range(len(anc.lead))), "arow", "")) + (idx[-1],)
        b.set_tile(anc, "acc", own, given={rid: idx})
    a_op, b_op = operand_offsets(b, anc, own, ka, kb, n)
    val = b.value_at(x.src, out_index(b, x.src))
    if not val.dtype or not val.dtype.is_floating_point:
        raise Unsupported(f"{red.qualname} of a {val.dtype} chain: only floating reductions are generated")
    out_idx = [dag.lit(0) if d in reduced else idx[d] for d in range(len(lead)) if keep or d not in reduced]
    out_idx.append(b.axis(rn, anc.n))
    out_off = dag.isum([dag.imul(i, b.stride("out0", d)) for d, i in enumerate(out_idx)])
    plan = Plan("matmul_reduction", p, dag, b, [])
    pr = TilePrinter(plan, [a_op[1], b_op[1], val, out_off])
    name = module_name(p)
    params, call = kernel_params(plan, pr.needed, {a_op[0], b_op[0]})
    per_row = {"m", "ka", "kb", "acc", "mask", "row_mask"}
    out = red.outputs[0]
    lines = ["@triton.jit",
             signature(name, params + ["M", "N", "K", "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr",
                                       "BLOCK_K: tl.constexpr", "DOT_PRECISION: tl.constexpr",
                                       "UPCAST: tl.constexpr", "BIG_INDEX: tl.constexpr"]),
             f"{INDENT}pid_b = tl.program_id(0)  # one index of the kept dims (fast axis: programs in flight share W)",
             f"{INDENT}pid_n = tl.program_id(1)  # a block of columns",
             f"{INDENT}rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
             f"{INDENT}if BIG_INDEX:  # 2**31 elements or more: 64-bit offsets",
             f"{INDENT * 2}rn = rn.to(tl.int64)",
             f"{INDENT * 2}pid_b = pid_b.to(tl.int64)",
             f"{INDENT}n = rn[None, :]  # the columns, as a row",
             f"{INDENT}col_mask = n < N"]
    done: set = set()
    pr.scope([a_op[1], b_op[1], val], lines, 1, done, lambda z: not pr.depends(z, per_row))
    lines += [f"{INDENT}# the running {kind} over the reduced rows, per column: in registers across all row tiles",
              f"{INDENT}red = tl.full([BLOCK_N], {NEUTRAL[kind]}, tl.float32)",
              f"{INDENT}for m0 in range(0, M, BLOCK_M):",
              f"{INDENT * 2}rm = m0 + tl.arange(0, BLOCK_M)",
              f"{INDENT * 2}if BIG_INDEX:",
              f"{INDENT * 3}rm = rm.to(tl.int64)",
              f"{INDENT * 2}m = rm[:, None]  # this tile's rows, as a column"]
    pr.scope([a_op[1], b_op[1]], lines, 2, done, lambda z: not pr.depends(z, {"ka", "kb"}))
    lines += k_loop(pr, a_op, b_op, 2, done)
    lines += [f"{INDENT * 2}row_mask = m < M",
              f"{INDENT * 2}mask = row_mask & col_mask",
              f"{INDENT * 2}# the group's ops on the tile, in registers"]
    pr.scope([val], lines, 2, done)
    masked = f"tl.where(mask, {pr.expr(val)}, {NEUTRAL[kind]})"
    if kind in ("max", "min"):  # NaN-propagating, like torch's amax/amin (tl.max would skip a NaN)
        lines += [f"{INDENT * 2}part = tl.reduce({masked}, 0, _{kind}_nan)",
                  f"{INDENT * 2}red = {'tl.maximum' if kind == 'max' else 'tl.minimum'}(red, part, "
                  "propagate_nan=tl.PropagateNan.ALL)"]
    else:
        lines += [f"{INDENT * 2}red += tl.sum({masked}, axis=0)  # fp32 partial sums"]
    if kind == "mean":
        lines.append(f"{INDENT}red = red / M")
    if out.dtype == torch.bfloat16:
        lines += [f"{INDENT}if UPCAST:  # the interpreter truncates fp32 -> bf16: round to nearest even, as the GPU does",
                  f"{INDENT * 2}red = _round_bf16(red)"]
    pr.scope([out_off], lines, 1, done)
    lines.append(f"{INDENT}tl.store(out0_ptr + {pr.offset(out_off, ['rn'])}, red.to({tl_type(out.dtype)}), mask=rn < N)")
    kernel = "\n".join(lines) + "\n"
    launch = matmul_launch(p, anc, name, call, [lead[d] for d in grid], [lead[d] for d in reduced], tune=True,
                           reduce_grid=True)
    return assemble(plan, kernel, launch, TUNE_TEXT + MREDUCE_CONFIG)


"""Fused attention for eager `softmax(q @ k^T * scale + mask) @ v` groups: a flash-style Triton kernel.

The candidate's program is matmul(Q, K^T) -> pointwise chain (scale, additive mask, where, ...) ->
softmax over the keys -> identities (eval dropout, clone, dtype conversion) -> matmul(., V). One
program per block of query rows and (batch, head): it keeps Q in registers, walks the keys a block
at a time, evaluates the chain on each block of scores through the generator's Builder (so a mask is
just another input, read at (batch, row, key) with its broadcast strides), and keeps the online
softmax (running row max, running sum, rescaled P @ V accumulator). The B x H x L x L scores and
probabilities are never written.

The module also has `run_sdpa`, the same group through `torch.nn.functional.scaled_dot_product_attention`
(when the chain is `* scale` or `/ scale`, then `+ mask`): both are validated, the GPU benchmark keeps
the faster.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from advisor.codegen.dag import Dag
from advisor.codegen.ir import Input, Op, Program, View
from advisor.codegen.matmul import Anchored, Anchor, INDENT, TilePrinter, TileBuilder, assemble, kernel_params, \
    module_name, product_expr, TUNE_TEXT
from advisor.codegen.module import tensors_expr, view_expr
from advisor.codegen.plan import Plan, _unravel, size_expr
from advisor.codegen.printer import signature
from advisor.ops.lowering import Unsupported, tl_type
from advisor.ops.registry import SDPA_MASK, SDPA_SCALE, tagged


@dataclass
class Parts:
    qk: Anchor
    pv: Anchor
    chain: list  # [Op]: pointwise ops on the scores, before the softmax
    softmax: Op
    safe: bool  # _safe_softmax: a row of -inf scores gives 0, not NaN
    after: list  # [Op]: identities between the softmax and P @ V
    scores: str  # the value the chain reads the scores as: Q @ K^T's output, or its head split

    @property
    def scores_id(self) -> str:
        """The value the softmax reads (the chain's end, or the scores themselves)."""
        return self.softmax.args["self"].src


def parse(ctx: Anchored) -> Parts:
    p = ctx.prog
    ops = p.ops
    anchors = [o for o in ops if o.low.kind == "anchor"]
    soft = [o for o in ops if tagged(o.name, "softmax")]
    if len(anchors) != 2 or len(soft) != 1:
        raise Unsupported(f"attention needs two matmuls around one softmax ({len(anchors)} matmuls, "
                          f"{len(soft)} softmaxes)")
    qk, pv = (ctx.anchors[o.id] for o in anchors)
    if ops.index(qk.op) > ops.index(soft[0]) or ops.index(soft[0]) > ops.index(pv.op) or ops[-1] is not pv.op:
        raise Unsupported("attention ops out of order (matmul, pointwise, softmax, matmul)")
    if qk.b_nk or pv.b_nk or pv.bias is not None or pv.alpha != 1:
        raise Unsupported("P @ V with a bias or scale of its own")  # baddbmm's bias and scale on Q @ K^T are fine
    sm = soft[0]
    k0, ks, kp = ops.index(qk.op), ops.index(sm), ops.index(pv.op)
    chain, after = [o for o in ops[k0 + 1:ks] if o.low.kind != "reshape"], ops[ks + 1:kp]
    scores = score_reshape(ctx, qk) or qk.op.outputs[0].id
    score_dims = [p.dim_key(d) for d in p.values[scores].shape]
    on_scores = {scores}
    for o in chain:
        reads = {v.src for a in o.args.values() for v in (a if isinstance(a, list) else [a]) if isinstance(v, View)}
        if o.low.kind != "pointwise":
            raise Unsupported(f"{o.qualname} between the scores and the softmax is not pointwise on the scores")
        if reads & on_scores:
            if [p.dim_key(d) for d in o.outputs[0].shape] != score_dims:
                raise Unsupported(f"{o.qualname} between the scores and the softmax is not pointwise on the scores")
            on_scores.add(o.outputs[0].id)
        elif len(o.outputs[0].shape) > len(score_dims) or any(
                p.dim_key(d) not in ("1", k) for d, k in zip(o.outputs[0].shape[::-1], score_dims[::-1])):
            raise Unsupported(f"{o.qualname} before the softmax neither reads the scores nor broadcasts to them")
    x = sm.args["self"]
    if not x.identity or [p.dim_key(d) for d in x.shape] != score_dims:
        raise Unsupported("the softmax reads the scores through a view")
    if x.src != ([o.outputs[0].id for o in chain if o.outputs[0].id in on_scores] or [scores])[-1]:
        raise Unsupported("the softmax does not read the end of the score chain")
    cur = sm.outputs[0].id
    for o in after:
        if not tagged(o.name, "attention_identity"):
            raise Unsupported(f"{o.qualname} after the softmax: only eval dropout, clones and conversions fuse")
        train = o.args.get("train")
        if "dropout" in o.name and (train is None or train not in (False, 0)):
            raise Unsupported("dropout in training mode after the softmax")
        views = [v for v in o.args.values() if isinstance(v, View)]
        if len(views) != 1 or views[0].src != cur or not views[0].identity:
            raise Unsupported(f"{o.qualname} after the softmax reads something else")
        cur = o.outputs[0].id
    merged = [d.value for d in pv.a.shape] == [d.value for d in qk.op.outputs[0].shape] and pv.a.reshapes
    if pv.a.src != cur or not (pv.a.identity or scores != qk.op.outputs[0].id and merged):
        raise Unsupported("P @ V does not read the softmax output")
    if [v.id for v in p.outputs] != [pv.op.outputs[0].id]:
        raise Unsupported("an intermediate of the attention escapes the group")
    if len(qk.lead) < 1 or [p.dim_key(d) for d in qk.lead] != [p.dim_key(d) for d in pv.lead]:
        raise Unsupported("P @ V does not walk the scores' rows")
    return Parts(qk, pv, chain, sm, tagged(sm.name, "safe_softmax"), after, scores)


def score_reshape(ctx: Anchored, qk: Anchor) -> str | None:
    """The reshape of [B * H, L, L] scores into [B, H, L, L] that the mask is applied on (BLOOM, DeBERTa):
    the same rows and keys, the leading dims split."""
    for vid, (aid, split) in ctx.reshapes.items():
        shape = [d.value for d in ctx.prog.values[vid].shape]
        if aid == qk.op.id and split == len(shape) - 1 and shape[-2] == qk.lead[-1].value:
            return vid
    return None


ATTENTION_CONFIG = '''
# (BLOCK_M, BLOCK_N, num_warps, num_stages): query rows per program, keys per step (timed on the GPU).
CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 32, 4, 2), (128, 32, 4, 2)]


def _config(key, launch, tune, interpreted):
    if interpreted:
        return (_small(key[0]), _small(key[1]), 4, 1)
    return _tuned(key, launch, tune, CONFIGS, CONFIGS[0])
'''


def attention_source(ctx: Anchored) -> str:
    p = ctx.prog
    parts = parse(ctx)
    qk, pv = parts.qk, parts.pv
    dag = Dag()
    b = TileBuilder(ctx, dag)
    i, j, jv = dag.var("i", full=True), dag.var("j", full=True), dag.var("jv", full=True)
    dq, dk, dv = dag.var("dq", full=True), dag.var("dk", full=True), dag.var("dv", full=True)
    pid_b = dag.var("pid_b", full=False)
    b.mask = dag.var("mask", full=True)
    b.axis_masks = {"rows": ({"i"}, dag.var("row_mask", full=True)), "cols": ({"j"}, dag.var("col_mask", full=True))}
    nb = len(qk.lead) - 1
    bidx = tuple(_unravel(b, pid_b, qk.lead[:nb], list(range(nb)), "b", ""))
    i_t, j_t = b.axis(i, qk.lead[-1]), b.axis(j, qk.n)  # a size-1 axis (one query: decoding) is index 0
    tile = bidx + (i_t, j_t)
    given = {}
    if parts.scores != qk.op.outputs[0].id:  # the chain walks the scores with the batch dim split: (b, h) from pid_b
        lead = p.values[parts.scores].shape[:-2]
        given[parts.scores] = tuple(_unravel(b, pid_b, lead, list(range(len(lead))), "b", "_split")) + (i_t, j_t)
    b.set_tile(qk, "s", tile, given)
    q_ptr, q_off = b.operand_offset(qk.a, bidx + (i_t, b.axis(dq, qk.k)))
    k_ptr, k_off = b.operand_offset(qk.b, tuple(bidx[d] for d in qk.b_batch) + (b.axis(dk, qk.k), j_t))
    v_ptr, v_off = b.operand_offset(pv.b, tuple(bidx[d] for d in pv.b_batch) + (b.axis(jv, qk.n), b.axis(dv, pv.n)))
    score = b.value_at(parts.scores_id, given.get(parts.scores, tile))
    out_v = p.outputs[0]
    out_off = dag.isum([dag.imul(x, b.stride("out0", d)) for d, x in enumerate(bidx + (i_t, b.axis(dv, pv.n)))])
    plan = Plan("attention", p, dag, b, [])
    pr = TilePrinter(plan, [q_off, k_off, v_off, score, out_off])
    name = module_name(p).replace("_kernel", "_attention_kernel")
    params, call = kernel_params(plan, pr.needed, {q_ptr, k_ptr, v_ptr})
    loop = {"j", "jv", "s", "mask", "row_mask", "col_mask"}
    lines = ["@triton.jit",
             signature(name, params + ["LQ", "LK", "D", "DV", "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr",
                                       "BLOCK_D: tl.constexpr", "BLOCK_DV: tl.constexpr",
                                       "DOT_PRECISION: tl.constexpr", "UPCAST: tl.constexpr",
                                       "BIG_INDEX: tl.constexpr"]),
             f"{INDENT}pid_m = tl.program_id(0)  # a block of query rows",
             f"{INDENT}pid_b = tl.program_id(1)  # one (batch, head)",
             f"{INDENT}ri = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
             f"{INDENT}rd = tl.arange(0, BLOCK_D)",
             f"{INDENT}rdv = tl.arange(0, BLOCK_DV)",
             f"{INDENT}if BIG_INDEX:  # 2**31 elements or more: 64-bit offsets",
             f"{INDENT * 2}ri = ri.to(tl.int64)",
             f"{INDENT * 2}pid_b = pid_b.to(tl.int64)",
             f"{INDENT}i = ri[:, None]  # query rows, as a column",
             f"{INDENT}dq = rd[None, :]  # head dim along Q's columns",
             f"{INDENT}dk = rd[:, None]  # head dim along K^T's rows",
             f"{INDENT}dv = rdv[None, :]  # head dim along V's and the output's columns"]
    done: set = set()
    pr.scope([q_off, k_off, v_off, score], lines, 1, done, lambda x: not pr.depends(x, loop))
    lines += [f"{INDENT}q = tl.load({q_ptr} + {pr.offset(q_off, ['i', 'dq'])}, mask=(i < LQ) & (dq < D), other=0.0)",
              f"{INDENT}if UPCAST:",
              f"{INDENT * 2}q = q.to(tl.float32)",
              f"{INDENT}m_i = tl.full([BLOCK_M], -float(\"inf\"), tl.float32)  # running max of each row's scores",
              f"{INDENT}l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp(score - m_i)",
              f"{INDENT}acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # running sum of exp(score - m_i) * v",
              f"{INDENT}row_mask = i < LQ",
              f"{INDENT}for start_n in range(0, LK, BLOCK_N):  # one block of keys at a time",
              f"{INDENT * 2}rj = start_n + tl.arange(0, BLOCK_N)",
              f"{INDENT * 2}j = rj[None, :]  # keys, as a row",
              f"{INDENT * 2}jv = rj[:, None]  # keys along V's rows"]
    pr.scope([k_off], lines, 2, done)
    lines += [f"{INDENT * 2}kt = tl.load({k_ptr} + {pr.offset(k_off, ['dk', 'j'])}, mask=(dk < D) & (j < LK), other=0.0)",
              f"{INDENT * 2}if UPCAST:",
              f"{INDENT * 3}kt = kt.to(tl.float32)",
              f"{INDENT * 2}s = tl.dot(q, kt, input_precision=DOT_PRECISION)  # q @ k^T for this block, fp32",
              f"{INDENT * 2}col_mask = j < LK",
              f"{INDENT * 2}mask = row_mask & col_mask"]
    if parts.chain:
        lines.append(f"{INDENT * 2}# the group's ops on the scores: " + ", ".join(o.qualname for o in parts.chain))
    pr.scope([score], lines, 2, done)
    lines += [f"{INDENT * 2}scores = tl.where(col_mask, {pr.expr(score)}, -float(\"inf\"))  # keys past the end weigh 0",
              f"{INDENT * 2}m_new = tl.maximum(m_i, tl.max(scores, 1))",
              f"{INDENT * 2}# a row whose scores are all -inf so far: subtract 0, so exp() gives 0 rather than NaN",
              f"{INDENT * 2}m_safe = tl.where(m_new == -float(\"inf\"), 0.0, m_new)",
              f"{INDENT * 2}alpha = tl.exp(m_i - m_safe)  # rescales what was accumulated under the old max",
              f"{INDENT * 2}p = tl.exp(scores - m_safe[:, None])",
              f"{INDENT * 2}l_i = l_i * alpha + tl.sum(p, 1)"]
    pr.scope([v_off], lines, 2, done)
    lines += [f"{INDENT * 2}v = tl.load({v_ptr} + {pr.offset(v_off, ['jv', 'dv'])}, mask=(jv < LK) & (dv < DV), other=0.0)",
              f"{INDENT * 2}if UPCAST:  # the interpreter: bf16 rounding as the GPU does it, products in fp32",
              f"{INDENT * 3}p_v = _round_bf16(p)",
              f"{INDENT * 3}v = v.to(tl.float32)",
              f"{INDENT * 2}else:",
              f"{INDENT * 3}p_v = p.to(v.dtype)  # probabilities in V's dtype for the product, as eager's are",
              f"{INDENT * 2}acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)",
              f"{INDENT * 2}m_i = m_new"]
    if parts.safe:
        lines.append(f"{INDENT}out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)  # _safe_softmax: "
                     "all -inf rows give 0")
    else:
        lines.append(f"{INDENT}out = acc / l_i[:, None]  # a row whose scores are all -inf: 0 / 0 = NaN, as in torch")
    if out_v.dtype == torch.bfloat16:
        lines += [f"{INDENT}if UPCAST:  # the interpreter truncates fp32 -> bf16: round to nearest even, as the GPU does",
                  f"{INDENT * 2}out = _round_bf16(out)"]
    pr.scope([out_off], lines, 1, done)
    lines.append(f"{INDENT}tl.store(out0_ptr + {pr.offset(out_off, ['i', 'dv'])}, out.to({tl_type(out_v.dtype)}), "
                 f"mask=(i < LQ) & (dv < DV))")
    kernel = "\n".join(lines) + "\n"
    from advisor.codegen.module import _wrap

    launch = [f"    LQ = {size_expr(p, qk.lead[-1])}  # query rows",
              f"    LK = {size_expr(p, qk.n)}  # keys",
              f"    D = {size_expr(p, qk.k)}  # head dim of Q and K",
              f"    DV = {size_expr(p, pv.n)}  # head dim of V",
              f"    BATCH = {product_expr(p, qk.lead[:nb])}  # batch x heads: one grid row each",
              "    args = (" + _wrap(call + ["LQ", "LK", "D", "DV"], ", ", 12, first=12) + ")",
              f"    big = _int64_needed({tensors_expr(p)})",
              f"    precision, upcast = _dot_precision({qk.a.src}.dtype), _upcast({qk.a.src})",
              "    BLOCK_D, BLOCK_DV = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(DV))",
              "",
              "    def launch(cfg):",
              "        BLOCK_M, BLOCK_N, num_warps, num_stages = cfg",
              f"        {name}[(triton.cdiv(LQ, BLOCK_M), BATCH)](",
              "            *args, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,",
              "            DOT_PRECISION=precision, UPCAST=upcast, BIG_INDEX=big, num_warps=num_warps, num_stages=num_stages)",
              "",
              "    if LQ and BATCH:",
              f"        launch(_config((LQ, LK, D, {qk.a.src}.dtype), launch, True, _interpreted({qk.a.src})))"]
    return assemble(plan, kernel, launch, TUNE_TEXT + ATTENTION_CONFIG, sdpa_source(p, parts))


# ------------------------------------------------------------------------------------------ SDPA
def sdpa_args(p: Program, parts: Parts):
    """((operator, scale literal or 0-dim input), mask view or None) when the chain is `* scale` / `/ scale`
    then `+ mask` (the registry's `SDPA_SCALE` and `SDPA_MASK`), else None. The operator is "*" or "/"."""
    if parts.qk.bias is not None or parts.qk.alpha != 1:
        return None  # baddbmm: its own bias and scale
    cur = parts.qk.op.outputs[0].id
    scale, mask = None, None
    for o in parts.chain:
        views = {k: v for k, v in o.args.items() if isinstance(v, View)}
        mine = [k for k, v in views.items() if v.src == cur and v.identity]
        if len(mine) != 1 or (o.name not in SDPA_SCALE and o.name != SDPA_MASK):
            return None
        other = o.args.get("other" if mine[0] == "self" else "self")
        if o.name in SDPA_SCALE and scale is None and mask is None:
            if SDPA_SCALE[o.name] == "/" and (mine[0] != "self" or o.args.get("rounding_mode") is not None):
                return None
            if isinstance(other, (int, float)) and not isinstance(other, bool):
                x = repr(float(other))
            elif isinstance(other, View) and isinstance(p.source(other.src), Input) and not other.shape:
                x = other.src  # a 0-dim tensor input: read on the CPU, applied to q on a device
            else:
                return None
            scale = (SDPA_SCALE[o.name], x)
        elif o.name == SDPA_MASK and mask is None and o.args.get("alpha", 1) == 1 and isinstance(other, View) \
                and isinstance(p.source(other.src), Input) and other.shape:
            mask = other
        else:
            return None
        cur = o.outputs[0].id
    return scale or ("*", "1.0"), mask


def sdpa_source(p: Program, parts: Parts) -> str:
    got = sdpa_args(p, parts)
    q_dt = p.source(parts.qk.a.src).dtype
    same = {p.source(v.src).dtype for v in (parts.qk.a, parts.qk.b, parts.pv.b)} == {q_dt}
    if got is None or not same or p.outputs[0].dtype != q_dt:
        return ""
    scale, mask = got
    args = ", ".join(i.id for i in p.inputs)
    lines = ["", "", f"def run_sdpa({args}):",
             '    """The same attention through torch.nn.functional.scaled_dot_product_attention (the mask as an',
             '    additive bias in the query dtype): the alternative the GPU benchmark measures beside run()."""',
             f"    q = {view_expr(p, parts.qk.a)}",
             f"    k = {view_expr(p, parts.qk.b)}.transpose(-2, -1)",
             f"    v = {view_expr(p, parts.pv.b)}"]
    if mask is not None:
        lines.append(f"    mask = {view_expr(p, mask)}.to(q.dtype)")
    op, x = scale
    if x in {i.id for i in p.inputs}:
        read = f"float({x})"
        lines += [f"    if {x}.device.type == \"cpu\":",
                  f"        scale = {read if op == '*' else f'1.0 / {read}'}",
                  "    else:  # reading a device scalar would synchronise, which a CUDA graph cannot record",
                  f"        q, scale = q {op} {x}, 1.0"]
    else:
        lines.append(f"    scale = {x if op == '*' else f'1.0 / {x}'}")
    lines.append("    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask="
                 f"{'mask' if mask is not None else 'None'}, scale=scale)")
    lines.append("    return out,")
    return "\n".join(lines) + "\n"

"""Matmul-anchored candidates (epilogue, attention, matmul_reduction, padded_matmul): which generator a
program goes to (`detect_kind`), and the generated module with what it saves (`generate_anchored`). The generators
themselves: `matmul.epilogue_source`, `attention.attention_source`, `matmul_reduce.matmul_reduce_source`,
all built on matmul.py's tiles, and `padded.padded_matmul_source` (no kernel: cuBLAS on padded operands)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from advisor.codegen import GENERATOR_VERSION, Generated, cache
from advisor.codegen.attention import attention_source
from advisor.codegen.conv import conv_epilogue_source, read_conv_epilogue
from advisor.codegen.matmul import RESHAPE, Anchored, _leading_reduction, epilogue_source, is_anchor, read_anchored
from advisor.codegen.matmul_reduce import matmul_reduce_source
from advisor.codegen.padded import padded_matmul_source
from advisor.ops.lowering import Unsupported
from advisor.ops.registry import REDUCE_KINDS, is_conv, tagged


@dataclass
class AnchoredGenerated(Generated):
    alternatives: tuple = ()  # other implementations in the module, as `run_<name>` ("sdpa")
    memory_saved_bytes: int = 0  # bytes the fused kernel never allocates at the recorded shapes
    note: str = ""


def detect_kind(program: dict) -> str:
    names = [n["op"] for n in program.get("nodes", [])]
    if any(is_conv(x) for x in names):
        return "epilogue"
    anchors = sum(1 for x in names if is_anchor(x))
    if anchors >= 2 and any(tagged(x, "softmax") or tagged(x, "log_softmax") for x in names):
        return "attention"
    if any(x in REDUCE_KINDS and _leading_reduction(n) for x, n in zip(names, program["nodes"])):
        return "matmul_reduction"
    return "epilogue"


def generate_anchored(program: dict, kind: str | None = None, use_cache: bool = True) -> AnchoredGenerated:
    """Generate (or fetch from the cache) the module of an epilogue / attention / matmul_reduction
    candidate; raises Unsupported with the reason it cannot be generated."""
    if not program or not program.get("nodes"):
        raise Unsupported("the analysis recorded no program for this candidate")
    kind = kind or detect_kind(program)
    if any(is_conv(n["op"]) for n in program["nodes"]):
        return _generate_conv(program, use_cache)
    ctx = read_anchored(program)
    emit = {"epilogue": epilogue_source, "attention": attention_source,
            "matmul_reduction": matmul_reduce_source, "padded_matmul": padded_matmul_source}.get(kind)
    if emit is None:
        raise Unsupported(f"candidate kind {kind!r} has no matmul-anchored generator")
    key = ctx.prog.key(GENERATOR_VERSION + kind)
    code, cached, path = cache.fetch_or_write(key, lambda: emit(ctx), use_cache)
    alts = tuple(a for a in ("sdpa",) if f"def run_{a}(" in code)
    saved, note = saved_memory(ctx, kind)
    return AnchoredGenerated(key, code, cached, ctx.prog, kind, path, alts, saved, note)


def _generate_conv(program: dict, use_cache: bool) -> AnchoredGenerated:
    """A conv epilogue (`codegen.conv`): cuDNN's fused conv on the folded weights, no Triton kernel."""
    conv = read_conv_epilogue(program)
    key = conv.ctx.prog.key(GENERATOR_VERSION + "conv_epilogue.derived-tensors")
    code, cached, path = cache.fetch_or_write(key, lambda: conv_epilogue_source(conv), use_cache)
    return AnchoredGenerated(key, code, cached, conv.ctx.prog, "epilogue", path, (), conv.out_bytes,
                             f"the conv output ({conv.out_bytes / 1e6:.2f} MB at the recorded shapes) is never written: "
                             "cuDNN applies the folded BatchNorm, the add and the ReLU in the conv's kernel")


def saved_memory(ctx: Anchored, kind: str) -> tuple[int, str]:
    """Bytes of the intermediates eager writes and the fused kernel does not, at the recorded shapes."""
    p = ctx.prog
    if kind == "padded_matmul":  # it allocates more, not less: the padded copies and product, freed on return
        return 0, "the padded operands and product are temporaries beside the output, freed when it returns"
    outs = {v.id for v in p.outputs}
    inter = [v for o in p.ops for v in o.outputs if v.id not in outs and o.low is not RESHAPE]
    total = sum(math.prod(v.rec_shape) * v.dtype.itemsize for v in inter)
    anchor_out = [a.op.outputs[0] for a in ctx.anchors.values()]
    big = sum(math.prod(v.rec_shape) * v.dtype.itemsize for v in anchor_out if v.id not in outs)
    what = {"matmul_reduction": "the matmul output (logits)", "attention": "the score matrix",
            "epilogue": "the matmul output"}[kind]
    return total, (f"{what} ({big / 1e6:.2f} MB at the recorded shapes) and the other intermediates "
                   f"({(total - big) / 1e6:.2f} MB) are never allocated")

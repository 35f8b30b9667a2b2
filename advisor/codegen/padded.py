"""Padded GEMMs (`padded_matmul` candidates): the launcher of a GEMM that cuBLAS would run unaligned.

No Triton kernel: the module zero-pads K and N to the 16-byte alignment (`advisor.analysis.alignment`
says why), calls the same aten op on the padded operands, which cuBLAS then runs with its fast kernels,
and hands back the first N columns. Zeros in K add nothing to any product; the padded columns of N are
never handed out, so the result is the unpadded product's (within the GEMM's own rounding: cuBLAS may
split K differently). The padding is worked out from the operands' shapes on every call, so the module
is right at any size (validation runs it at odd ones); the patcher's guards keep it at the recorded ones.

Under autograd the module trains as it is (`DIFFERENTIABLE`): the pads, the product and the slice are
PyTorch's ops, so autograd's backward of the padded product is two more aligned GEMMs (the gradient of
the slice is the output gradient zero-padded, of the pads a slice). What Inductor does for training.

What it returns: the padded product's first N columns as they lie, a strided view (row stride N_padded),
as Inductor's `pad_mm` does: torch.compile hands GPT-2's logits back the same way. Copying them out into
eager's layout cost a second pass over the output (GPT-2's logits on the H100: 2.19 ms for the launcher
with the copy against 1.25 ms without it, docs/EXPERIMENTS.md: padded_matmul; a Triton GEMM writing eager's
layout directly measured 1.87 ms). Values and shape are eager's; what differs is `is_contiguous()` and the
views that need it: `logits.view(-1, V)` (loss code's flattening of batch and sequence) works, because
those dims stay uniformly strided; a view that merges N with another dim (`.view(-1)`) fails, as it does
on torch.compile's output, and `.reshape` copies instead.
"""
from __future__ import annotations

from advisor.codegen.matmul import Anchored, the_anchor
from advisor.ops.lowering import Unsupported
from advisor.ops.registry import GEMM_CALLS

HELPERS = '''

def _round_up(n):
    return -(-n // ALIGN) * ALIGN


def _aligned(t):
    """Whether cuBLAS sees t as aligned: its base and every stride but the unit one a multiple of ALIGN."""
    return t.storage_offset() % ALIGN == 0 and all(s % ALIGN == 0 for n, s in zip(t.shape, t.stride()) if n > 1 and s != 1)


def _padded(t, sizes):
    """t zero-padded at the end of each dim to `sizes`, as a new row-major tensor; t itself when it has those
    sizes and is aligned already. One copy of t, and zeros written into the padding only."""
    sizes = tuple(sizes)
    if tuple(t.shape) == sizes and _aligned(t):
        return t
    out = torch.empty(sizes, dtype=t.dtype, device=t.device)
    out[tuple(slice(0, n) for n in t.shape)].copy_(t)
    for d, (n, p) in enumerate(zip(t.shape, sizes)):
        if p != n:
            out.narrow(d, n, p - n).zero_()
    return out
'''


def padded_matmul_source(ctx: Anchored) -> str:
    p = ctx.prog
    anc = the_anchor(ctx, "padded_matmul")
    if len(p.ops) != 1 or [v.id for v in p.outputs] != [anc.op.outputs[0].id]:
        raise Unsupported("a padded_matmul program is one matmul and its output")
    name = anc.op.name
    if name not in GEMM_CALLS:
        raise Unsupported(f"{name}: no padded form")
    ids = [i.id for i in p.inputs]
    role = {"a": anc.a, "b": anc.b, **({"bias": anc.bias} if anc.bias is not None else {})}
    for r, view in role.items():
        if not view.identity or view.src not in ids:
            raise Unsupported(f"{name} reads its {r} operand through a view: only whole inputs are padded")
    out = p.outputs[0]
    itemsize = out.dtype.itemsize
    align = 16 // itemsize
    # b is [.., K, N], or [N, K] for linear's weight: which of its last two dims is N decides its padding.
    b_sizes = "(n_p, k_p)" if anc.b_nk else "(k_p, n_p)"
    n_of_b = "b.shape[-2]" if anc.b_nk else "b.shape[-1]"
    call = GEMM_CALLS[name].format(bias="bias" if "bias" in role else "None", beta=anc.beta, alpha=anc.alpha)
    unpack = ", ".join(next(r for r, v in role.items() if v.src == i) if any(v.src == i for v in role.values())
                       else "_" for i in ids)
    if len(set(v.src for v in role.values())) != len(role):
        raise Unsupported(f"{name} reads one input as two operands")
    lines = [
        f"# {name} with K and N zero-padded to multiples of {align} elements (16 bytes of {str(out.dtype)[6:]}), so",
        "# that cuBLAS runs its aligned kernels instead of its unaligned one: see advisor/codegen/padded.py.",
        "import torch",
        "",
        f"ALIGN = {align}",
        "DIFFERENTIABLE = True  # PyTorch's own ops: autograd differentiates `run`, its backward GEMMs padded too",
        HELPERS,
        "",
        f"def run({', '.join(ids)}):",
        f'    """{name}: the padded product\'s first N columns (a strided view of it)."""',
        f"    {unpack}{',' if len(ids) == 1 else ''} = {', '.join(ids)}",
        f"    n, k = {n_of_b}, a.shape[-1]",
        "    n_p, k_p = _round_up(n), _round_up(k)",
        "    a = _padded(a, (*a.shape[:-1], k_p))",
        f"    b = _padded(b, (*b.shape[:-2], *{b_sizes}))",
    ]
    if "bias" in role:  # a bias along N (not one broadcast over it) gets the zero columns too
        lines.append("    bias = _padded(bias, (*bias.shape[:-1], n_p)) if bias.dim() and bias.shape[-1] == n else bias")
    lines += [
        f"    result = {call}",
        "    return (result[..., :n],)  # the padded columns are never handed out",
    ]
    return "\n".join(lines) + "\n"

"""Assemble a generated module: imports, helpers, kernel(s), launch heuristics and `run(...)`.

The module imports only torch and triton. `run` takes the subgraph's inputs (same order as the
program), checks they have the structure the kernel was generated for, allocates the outputs with the
recorded dtypes and memory order, writes in-place outputs into the input they overwrite, and returns
the outputs in the program's order.
"""
from __future__ import annotations


from advisor.codegen.helpers import HELPERS, helper_source
from advisor.codegen.ir import Program, _order
from advisor.codegen.plan import Plan, size_expr
from advisor.codegen.printer import pointwise_kernel, row_kernels

COMMON = '''

def _empty(shape, order, dtype, device):
    """A new output, dense in the memory order eager produced (validation swaps in a NaN-filled one)."""
    return torch.empty_permuted(shape, order, dtype=dtype, device=device)


def _like(x, ref):
    """x with ref's shape and memory layout, so it can be read at the output's flat offsets."""
    if x.shape == ref.shape and all(a == b for n, a, b in zip(x.shape, x.stride(), ref.stride()) if n != 1):
        return x
    return torch.empty_like(ref, dtype=x.dtype).copy_(x)


def _int64_needed(*tensors):
    """Offsets past 2**31 elements need 64-bit index math."""
    return max(sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + t.numel() for t in tensors) >= 2**31
'''

POINTWISE_CONFIG = '''

def _pointwise_config(numel):
    """(BLOCK, num_warps): 8-16 elements per thread keep enough loads in flight to saturate HBM."""
    if numel >= 1 << 22:
        return 2048, 8
    return 1024, 4
'''

ROW_CONFIG = '''

MAX_PERSISTENT_N = 16384  # wider rows do not fit in registers: stream them through the looped kernel
# Columns per step of the looped kernel. Its rows are wide and often few (a UNet's GroupNorm: 4 x 32 groups of
# 40960 on 132 SMs), so each program needs many loads in flight: on the H100, GroupNorm + SiLU over
# 4x320x64x64 took 35 us with 2048 a step, 25 with 4096 (eager 67); 2x320x96x96 70 -> 48 us (eager 111);
# 8192 gained at most 4 us more (reports/kernels/groupnorm-loop.json).
LOOP_BLOCK_N = 4096
LOOP_WARPS = 16  # wide rows: more loads in flight per program (H100: 89% vs 84% with 8 on 128K-column rows)


def _row_config(n, rows, itemsize):
    """(BLOCK_N, BLOCK_R, num_warps) of the persistent kernel: BLOCK_R whole rows a program.
    Rows of 1024 columns or more: one a program, a warp per KB of row (H100: 8 warps on 8 KB rows reach 97% of
    copy bandwidth, 16 warps 92%); 16 warps only for huge rows. Shorter rows: 1024 // BLOCK_N of them a program
    (no more than there are), in one warp. One program per short row is bound by how many programs the GPU
    keeps resident, not by bytes (H100, bf16 softmax over 301056 rows of 49: 186 us, 4x eager's 45 us); so
    packed, 41 us. With 2048-4096 elements or 2-4 warps a program it took 57-78 us (rows of 49 are not
    16-byte aligned: elements load one at a time, and more of them per thread won); rows of 64-512 ran at
    copy speed (25 us for 2 x 29 MB) either way."""
    block = triton.next_power_of_2(n)
    block_r = min(max(1, 1024 // block), triton.next_power_of_2(rows))
    if block_r > 1:
        return block, block_r, 1
    return block, 1, max(1, min(8 if block <= 4096 else 16, block * itemsize // 1024))
'''


def kernel_name(prog: Program) -> str:
    names = []
    for o in prog.ops:
        n = o.name.split("::")[1].strip("_").replace("_to_copy", "to")
        if not names or names[-1] != n:
            names.append(n)
    base = "_".join(names[:5]) + ("_etc" if len(names) > 5 else "")
    return f"{base}_kernel"


def module_source(plan: Plan) -> str:
    p = plan.prog
    name = kernel_name(p)
    params, call = _params(plan)
    if plan.kind == "pointwise":
        kernels = pointwise_kernel(plan, name, params)
        launch = _launch_pointwise(plan, name, call)
        config = POINTWISE_CONFIG
    else:
        persistent, looped = row_kernels(plan, name, params)
        kernels = persistent + "\n\n" + looped
        launch = _launch_rows(plan, name, call)
        config = ROW_CONFIG
    helpers = helper_source(n for n in HELPERS if f"{n}(" in kernels or f", {n})" in kernels)
    parts = ["import torch\nimport triton\nimport triton.language as tl\n", "\n" + helpers if helpers else "",
             "\n\n" + kernels,
             "\n\n" + _run(plan, launch), COMMON, config]
    return "".join(parts).replace("\n\n\n\n", "\n\n\n").strip() + "\n"


def _params(plan: Plan) -> tuple[list, list]:
    """Kernel parameters and the launcher expressions passed for them, in the same order."""
    p, b = plan.prog, plan.builder
    from advisor.codegen.printer import Printer

    needed = Printer(plan).needed
    used = {n.fmt for n in needed if n.kind in ("load", "arg")}
    if plan.kind == "rows":
        used.add(_size_name(plan))
    params, call = [], []
    for i in p.inputs:
        if f"{i.id}_ptr" in used:
            params.append(f"{i.id}_ptr")
            call.append(i.id)
    for k in range(len(p.outputs)):
        params.append(f"out{k}_ptr")
        call.append(f"out{k}")
    if plan.kind == "pointwise":
        for g in plan.groups:
            params.append(g.numel)
            call.append(g.numel)
    for name, d in sorted(b.size_args.items()):
        if name not in used:
            continue
        params.append(name)
        call.append(size_expr(p, d))
    for name, (t, d) in sorted(b.strides.items()):
        if name not in used:
            continue
        params.append(name)
        call.append(f"{t}.stride({d})")
    return params, call


def _checks(p: Program) -> list:
    """Conditions under which the kernel computes what the ops would: ranks, dtypes, tied sizes."""
    conds = []
    for k, i in enumerate(p.inputs):
        conds.append(f"{i.id}.dim() == {len(i.shape)}")
        conds.append(f"{i.id}.dtype == {i.dtype}")
        for d, dim in enumerate(i.shape):
            sym = dim.terms[0]
            n = p.sizes.norm(dim)
            if n.literal:
                conds.append(f"{i.id}.shape[{d}] == {dim.value}")
            elif n.terms[0] != sym:
                conds.append(f"{i.id}.shape[{d}] == {size_expr(p, n)}")
    return conds


def _run(plan: Plan, launch: list) -> str:
    p = plan.prog
    args = ", ".join(i.id for i in p.inputs)
    lines = [f"def run({args}):",
             f'    """{_describe(p)}"""',
             f"    device = {p.inputs[0].id}.device" if p.inputs else "    device = torch.device('cuda')"]
    conds = _checks(p)
    if conds:
        lines.append("    if not (" + _wrap(conds, " and ", 8, first=12) + "):")
        lines.append('        raise ValueError("inputs differ from the pattern this kernel was generated for")')
    scalars = [i.id for i in p.inputs if not i.shape]
    if scalars:  # 0-dim inputs are the model's Python scalars (eps, scales): they may live on the CPU
        names = ", ".join(scalars) + ("," if len(scalars) == 1 else "")
        lines.append(f"    {names} = (t.to(device) for t in ({names}))" if len(scalars) > 1 else
                     f"    {scalars[0]} = {scalars[0]}.to(device)")
    for k, v in enumerate(p.outputs):
        if v.id in p.inplace:
            lines.append(f"    out{k} = {view_expr(p, p.inplace[v.id])}  # written in place, like {v.op.qualname}")
        else:
            shape = "(" + ", ".join(size_expr(p, d) for d in v.shape) + ("," if len(v.shape) == 1 else "") + ")"
            order = tuple(_order(v.rec_strides, v.rec_shape))
            lines.append(f"    out{k} = _empty({shape}, {order}, {v.dtype}, device)")
    for g in plan.groups:
        for inp in sorted(g.flat_inputs):
            lines.append(f"    {inp} = _like({inp}, out{g.layout_ref})  # read at the output's flat offsets")
    lines += launch
    ret = ", ".join(f"out{k}" for k in range(p.returned)) + ("," if p.returned == 1 else "")
    lines.append(f"    return {ret}" if p.returned else "    return ()")
    return "\n".join(lines) + "\n"


def view_expr(p: Program, view) -> str:
    """A launcher expression for the tensor a ref reads (torch.as_strided over its input)."""
    if view.identity:
        return view.src
    sizes = ", ".join(size_expr(p, d) for d in view.shape)
    strides = ", ".join("0" if w is None else f"{view.src}.stride({w[0]})" if w[1] == 1 else
                        f"{w[1]} * {view.src}.stride({w[0]})" for w in view.walks())
    off = " + ".join([f"{view.src}.storage_offset()"] + [f"{s} * {view.src}.stride({e})"
                                                          for e, s in enumerate(view.starts) if s])
    return f"torch.as_strided({view.src}, ({sizes},), ({strides},), {off})"


def _launch_pointwise(plan: Plan, name: str, call: list) -> list:
    head = [f"    {g.numel} = out{g.outputs[0]}.numel()" for g in plan.groups]
    numels = [g.numel for g in plan.groups]
    total = numels[0] if len(numels) == 1 else f"max({', '.join(numels)})"
    return head + [
        f"    if {total}:",
        f"        BLOCK, num_warps = _pointwise_config({total})",
        f"        grid = (triton.cdiv({total}, BLOCK),)",
        f"        {name}[grid](" + _wrap(call, ", ", 12, first=len(name) + 15) + ",",
        f"            BLOCK=BLOCK, BIG_INDEX=_int64_needed({tensors_expr(plan.prog)}), num_warps=num_warps)"]


def _launch_rows(plan: Plan, name: str, call: list) -> list:
    p = plan.prog
    n = plan.n_expr or size_expr(p, plan.n)
    r = " * ".join(f"({size_expr(p, d)})" if "+" in size_expr(p, d) else size_expr(p, d) for d in plan.lead) or "1"
    return [f"    N = {n}  # row width",
            f"    R = {r}  # rows",
            "    args = (" + _wrap(call, ", ", 12, first=12) + ")",
            f"    big = _int64_needed({tensors_expr(p)})",
            "    if R and N <= MAX_PERSISTENT_N:",
            f"        BLOCK_N, BLOCK_R, num_warps = _row_config(N, R, {_row_input(plan)}.element_size())",
            "        grid = (triton.cdiv(R, BLOCK_R),)",
            f"        {name}[grid](*args, R, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, BIG_INDEX=big, num_warps=num_warps)",
            "    elif R:",
            f"        {name}_looped[(R,)](*args, BLOCK_N=LOOP_BLOCK_N, BIG_INDEX=big, num_warps=LOOP_WARPS)"]


def tensors_expr(prog: Program) -> str:
    """The generated `run`'s tensors, as its source names them (inputs, then outputs): what `_int64_needed` checks."""
    return ", ".join([i.id for i in prog.inputs if i.shape] + [f"out{k}" for k in range(len(prog.outputs))])


def _row_input(plan: Plan) -> str:
    """The input whose rows the kernel streams (the widest row input), for the launch heuristic."""
    rank = len(plan.lead) + 1
    full = [i for i in plan.prog.inputs if len(i.shape) == rank] or plan.prog.inputs
    return max(full, key=lambda i: i.dtype.itemsize).id


def _size_name(plan: Plan) -> str:
    from advisor.codegen.build import size_name

    if plan.n is None:  # grouped rows: the kernel computes the width from the sizes it is passed
        return ""
    return size_name(plan.prog.sizes.norm(plan.n)) if not plan.prog.sizes.norm(plan.n).literal else ""


def _wrap(items: list, sep: str, indent: int, width: int = 100, first: int = 30) -> str:
    """items joined by sep, in lines of at most `width` columns (the first starts at column `first`)."""
    lines, cur, col = [], "", first
    for it in items:
        piece = it if not cur else sep + it
        if cur and col + len(cur) + len(piece) > width:
            lines.append(cur + sep.rstrip())
            cur, col = it, indent
        else:
            cur += piece
    lines.append(cur)
    return ("\n" + " " * indent).join(lines)


def _describe(p: Program) -> str:
    ops = " -> ".join(o.qualname.split("::")[1] for o in p.ops)
    text = f"Same inputs and outputs as the aten ops it replaces: {ops}."
    return _wrap(text.split(" "), " ", 4, 96, first=7)

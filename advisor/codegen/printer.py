"""Print a plan's DAG as a `@triton.jit` kernel: one named line per value, short index math inline.

Row plans print twice: a persistent kernel (whole rows in registers, BLOCK_R of them per program as a
[BLOCK_R, BLOCK_N] block, each reduction a single `tl.sum`/`tl.max` along the row) and a looped one for wide
rows (one row per program, one pass over the row per level of reductions, accumulating in BLOCK_N-wide
vectors, then a last pass for the outputs).
"""
from __future__ import annotations

import torch

from advisor.codegen.dag import Node
from advisor.codegen.plan import Plan
from advisor.ops.lowering import lit, tl_type

INDENT = "    "


class Printer:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.names: dict[int, str] = {}
        self.taken: set[str] = set()
        roots = [s.value for s in plan.stores] + [s.offset for s in plan.stores]
        self.needed = _ancestors(roots + [s.mask for s in plan.stores if s.mask is not None])
        self.uses: dict[int, int] = {}
        for n in self.needed:
            for i in n.inputs:
                self.uses[id(i)] = self.uses.get(id(i), 0) + 1

    # ------------------------------------------------------------------------------------ naming
    def name(self, n: Node) -> str:
        if id(n) not in self.names:
            base = n.hint or (f"row_{n.meta['kind_']}" if n.kind == "reduce" else "idx" if n.dtype is None else "t")
            name, k = base, 1
            while name in self.taken:
                name, k = f"{base}_{k}", k + 1
            self.taken.add(name)
            self.names[id(n)] = name
        return self.names[id(n)]

    def inline(self, n: Node) -> bool:
        if n.kind in ("var", "arg", "lit"):
            return True
        if n.kind in ("load", "reduce") or n.hint:
            return False
        return self.uses.get(id(n), 0) <= 1 and (n.dtype is None or n.kind == "cast" or not n.comment)

    def expr(self, n: Node, prec: int = 3) -> str:
        """n as an operand; `prec` is how tightly the surrounding operator binds (1: +/-, 2: * // %)."""
        if not self.inline(n):
            return self.name(n)
        text = self.render(n)
        if n.kind in ("var", "arg", "lit") or _atomic(text):
            return text
        return text if n.dtype is None and PREC.get(n.fmt, 0) >= prec else f"({text})"

    def render(self, n: Node) -> str:
        if n.kind in ("var", "arg", "lit"):
            return n.fmt
        if n.kind == "load":
            offset, mask = n.inputs[0], (n.inputs[1] if len(n.inputs) > 1 else None)
            ptr = n.fmt if offset.is_zero else f"{n.fmt} + {self.expr(offset, 1)}"
            text = f"tl.load({ptr}" + (f", mask={self.expr(mask)})" if mask else ")")
            return text + (f".to({tl_type(n.dtype)})" if str(n.dtype) != n.meta["mem"] else "")
        if n.dtype is None and n.fmt in PREC:  # index arithmetic: parenthesise by precedence only
            p = PREC[n.fmt]
            return n.fmt.format(self.expr(n.inputs[0], 3 if n.fmt == "{} % {}" else p),
                                self.expr(n.inputs[1], p + 1))
        if n.dtype is None:  # an index inside a call: tl.maximum(i3 - 8, 0)
            return n.fmt.format(*[self.expr(i, 0) for i in n.inputs])
        return n.fmt.format(*[self.expr(i) for i in n.inputs])

    def line(self, n: Node, out: list, depth: int) -> None:
        text = f"{self.name(n)} = {self.render(n)}"
        if n.comment:
            text = f"{text}  # {n.comment}"
        out.append(INDENT * depth + text)

    def emit(self, nodes, out: list, depth: int, done: set, reduce_text=None) -> None:
        """Lines for `nodes` (in DAG order) and what they need that is not in `done`."""
        want = {id(x) for x in nodes}
        for n in self.plan.dag.nodes:
            if id(n) in done or id(n) not in want or self.inline(n):
                continue
            done.add(id(n))
            if n.kind == "reduce":
                out.append(INDENT * depth + f"{self.name(n)} = {reduce_text(n)}")
            else:
                self.line(n, out, depth)

    def store(self, s, depth: int, shape: str = "", mask: str | None = None) -> str:
        """tl.store of s; `shape`: broadcast the pointer to it (tl.store wants it as wide as the value and
        the mask); `mask`: this mask instead of the store's own."""
        v = self.expr(s.value)
        if s.value.dtype != s.dtype and s.dtype != torch.bool:
            v = f"{v}.to({tl_type(s.dtype)})"
        mask = mask or (self.expr(s.mask) if s.mask is not None else None)
        ptr = f"out{s.out}_ptr" if s.offset.is_zero else f"out{s.out}_ptr + {self.expr(s.offset, 1)}"
        if shape:
            ptr = f"tl.broadcast_to({ptr}, {shape})"
        return f"{INDENT * depth}tl.store({ptr}, {v}" + (f", mask={mask})" if mask else ")")


PREC = {"{} + {}": 1, "{} - {}": 1, "{} * {}": 2, "{} // {}": 2, "{} % {}": 2}


def _atomic(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += ch in "(["
        depth -= ch in ")]"
        if ch == " " and depth == 0:
            return False
    return True


def _ancestors(roots) -> list:
    seen, out, stack = set(), [], list(roots)
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        stack.extend(n.inputs)
    return out


def _closure(nodes, stop) -> list:
    """`nodes` and their ancestors, not descending below nodes for which stop(n) holds."""
    seen, out, stack = set(), [], list(nodes)
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        if not stop(n):
            stack.extend(n.inputs)
    return out


def signature(name: str, params: list) -> str:
    lines, line = [], f"def {name}("
    for k, p in enumerate(params):
        piece = p + (", " if k < len(params) - 1 else "):")
        if len(line) + len(piece) > 100:
            lines.append(line.rstrip())
            line = " " * (len(name) + 5)
        line += piece
    return "\n".join(lines + [line])


# ------------------------------------------------------------------------------------- pointwise
def pointwise_kernel(plan: Plan, name: str, params: list) -> str:
    pr = Printer(plan)
    lines = ["@triton.jit", signature(name, params + ["BLOCK: tl.constexpr", "BIG_INDEX: tl.constexpr"]),
             f"{INDENT}pid = tl.program_id(0)"] + _big_index("pid") + [
             f"{INDENT}offs = pid * BLOCK + tl.arange(0, BLOCK)"]
    for g in plan.groups:
        suffix = g.numel[len("numel"):]
        lines.append(f"{INDENT}mask{suffix} = offs < {g.numel}")
    done: set = set()
    pr.emit(pr.needed, lines, 1, done)
    lines += [pr.store(s, 1) for s in plan.stores]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ rows
ZERO = {"sum": 0, "max": "-inf", "min": "inf", "prod": 1, "all": 1, "any": 0}


def _neutral(kind: str, dtype: torch.dtype) -> str:
    v = ZERO[kind]
    if kind in ("all", "any"):
        return str(v)
    if v in ("-inf", "inf"):
        if dtype.is_floating_point:
            return lit(float(v), dtype)
        info = torch.iinfo(dtype)
        return str(info.min if v == "-inf" else info.max)
    return lit(v, dtype)


def _reduce_expr(kind: str, x: str, dtype: torch.dtype, mask: str = "col_mask") -> str:
    """A reduction along the rows of the persistent kernel's [BLOCK_R, BLOCK_N] block: one per row, kept as
    a [BLOCK_R, 1] column so that it broadcasts back along its row."""
    if kind in ("all", "any"):
        x = f"{x}.to(tl.int32)"
    masked = f"tl.where({mask}, {x}, {_neutral(kind, dtype)})"
    if kind == "prod":
        return f"tl.reduce({masked}, 1, _mul_combine, keep_dims=True)"
    if kind in ("max", "min") and dtype.is_floating_point:
        return f"tl.reduce({masked}, 1, _{kind}_nan, keep_dims=True)"
    fn = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min", "all": "tl.min", "any": "tl.max"}[kind]
    return f"{fn}({masked}, axis=1, keep_dims=True)" + (" != 0" if kind in ("all", "any") else "")


ACC_NOTE = {torch.float32: "fp32 accumulation: bf16/fp16 partial sums would lose digits over a row"}


def row_kernels(plan: Plan, name: str, params: list) -> tuple[str, str]:
    head = [f"{INDENT}row = tl.program_id(0)  # one program per row"] + _big_index("row")
    return _persistent(plan, name, params), _looped(plan, name + "_looped", params, head)


def _big_index(var: str) -> list:
    """Index math in 64 bits only where offsets can pass 2**31 (the launcher's `_int64_needed`): a row kernel
    decomposes each row index into its dims by division, which in 64 bits the GPU emulates in many instructions."""
    return [f"{INDENT}if BIG_INDEX:  # 2**31 elements or more: 64-bit offsets", f"{INDENT * 2}{var} = {var}.to(tl.int64)"]


def _persistent(plan: Plan, name: str, params: list) -> str:
    """The rows in registers, BLOCK_R of them per program (several when rows are short, so that a program
    has about as much work as one 1024-wide row: the launcher's `_row_config`), as a [BLOCK_R, BLOCK_N]
    block: `row` a [BLOCK_R, 1] column, `cols` a [1, BLOCK_N] row, each reduction one per row along axis 1
    kept as a column, per-row values [BLOCK_R, 1] and values that depend on neither (scalar arguments)
    scalars. Rows past the last (R not a multiple of BLOCK_R) recompute the last row, so their loads stay in
    bounds unmasked; their stores are masked off."""
    pr = Printer(plan)
    pr.taken.update({"pid", "rows", "row_mask", "n_rows"})
    body = [f"{INDENT}pid = tl.program_id(0)"] + _big_index("pid") + [
            f"{INDENT}rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]",
            f"{INDENT}row_mask = rows < n_rows",
            f"{INDENT}row = tl.minimum(rows, n_rows - 1)  # rows past the last recompute it; their stores are masked"]
    done: set = set()
    pr.emit(_closure([plan.builder.n], lambda n: n.full), body, 1, done)  # a width computed from sizes (GroupNorm's)
    body += [f"{INDENT}cols = tl.arange(0, BLOCK_N)[None, :]", f"{INDENT}col_mask = cols < {pr.expr(plan.builder.n)}"]
    pr.emit(pr.needed, body, 1, done, lambda n: _reduce_expr(n.meta["kind_"], pr.expr(n.inputs[0]), n.dtype))
    per_row = _row_dependent(plan)
    for s in plan.stores:
        full = s.value.full or s.offset.full
        # An address the same for every row of the block (a single row: no leading dims) or for every column
        # of a row-wide value: broadcast, as tl.store wants the pointer as wide as what it writes.
        wide = id(s.offset) in per_row and s.offset.full == full
        body.append(pr.store(s, 1, "" if wide else "(BLOCK_R, BLOCK_N)" if full else "(BLOCK_R, 1)",
                             "col_mask & row_mask" if full else "row_mask"))
    sig = signature(name, params + ["n_rows", "BLOCK_N: tl.constexpr", "BLOCK_R: tl.constexpr",
                                    "BIG_INDEX: tl.constexpr"])
    return "\n".join(["@triton.jit", sig] + body) + "\n"


def _row_dependent(plan: Plan) -> set:
    """ids of the nodes that vary from row to row (those computed from `row`)."""
    dep: set = set()
    for n in plan.dag.nodes:  # DAG order: inputs first
        if (n.kind == "var" and n.fmt == "row") or any(id(i) in dep for i in n.inputs):
            dep.add(id(n))
    return dep


def _looped(plan: Plan, name: str, params: list, head: list) -> str:
    pr = Printer(plan)
    n_expr = pr.expr(plan.builder.n)
    reduces = [n for n in plan.dag.nodes if n.kind == "reduce" and any(n is x for x in pr.needed)]
    level: dict[int, int] = {}
    for r in reduces:  # DAG order: a reduction's inputs are levelled before it
        deps = [level[id(x)] for x in _closure([r.inputs[0]], lambda n: n.kind == "reduce") if x.kind == "reduce"
                and x is not r and id(x) in level]
        level[id(r)] = 1 + max(deps, default=0)
    lines = ["@triton.jit", signature(name, params + ["BLOCK_N: tl.constexpr", "BIG_INDEX: tl.constexpr"])] + list(head)
    done: set = set()
    scalar = [n for n in pr.needed if not n.full]

    def ready(stage):  # per-row scalars whose reductions are all done by `stage`
        return [n for n in scalar if n.kind != "reduce" and all(
            level.get(id(x), 0) <= stage for x in _closure([n], lambda m: m.kind == "reduce") if x.kind == "reduce")]

    passes = max(level.values(), default=0)
    for p in range(1, passes + 1):
        pr.emit(ready(p - 1), lines, 1, done)
        mine = [r for r in reduces if level[id(r)] == p]
        for k, r in enumerate(mine):
            acc = f"acc{k}"
            init = "tl.full([BLOCK_N], {}, {})".format(_neutral(r.meta["kind_"], r.dtype),
                                                      "tl.int32" if r.meta["kind_"] in ("all", "any") else tl_type(r.dtype))
            note = f"  # {ACC_NOTE[r.dtype]}" if r.dtype in ACC_NOTE and r.meta["kind_"] == "sum" and k == 0 else ""
            lines.append(f"{INDENT}{acc} = {init}{note}")
        lines += _loop_head(n_expr, f"pass {p}: " + ", ".join(pr.name(r) for r in mine))
        inner: set = set(done)
        pr.emit(_closure([r.inputs[0] for r in mine], lambda n: not n.full), lines, 2, inner)
        for k, r in enumerate(mine):
            x = pr.expr(r.inputs[0])
            kind = r.meta["kind_"]
            if kind in ("all", "any"):
                x = f"{x}.to(tl.int32)"
            val = f"tl.where(col_mask, {x}, {_neutral(kind, r.dtype)})"
            nan = ", propagate_nan=tl.PropagateNan.ALL" if r.dtype.is_floating_point else ""
            comb = {"sum": "acc{k} + {v}", "prod": "acc{k} * {v}", "max": "tl.maximum(acc{k}, {v}" + nan + ")",
                    "min": "tl.minimum(acc{k}, {v}" + nan + ")", "all": "tl.minimum(acc{k}, {v})",
                    "any": "tl.maximum(acc{k}, {v})"}[kind]
            lines.append(f"{INDENT * 2}acc{k} = " + comb.format(k=k, v=val))
        for k, r in enumerate(mine):
            done.add(id(r))
            lines.append(f"{INDENT}{pr.name(r)} = {_finish(r.meta['kind_'], f'acc{k}', r.dtype)}")
    pr.emit(ready(passes), lines, 1, done)
    full_stores = [s for s in plan.stores if s.value.full or s.offset.full]
    if full_stores:
        lines += _loop_head(n_expr, "last pass: the outputs")
        inner = set(done)
        pr.emit(_closure([s.value for s in full_stores] + [s.offset for s in full_stores], lambda n: not n.full),
                lines, 2, inner)
        lines += [pr.store(s, 2) for s in full_stores]
    lines += [pr.store(s, 1) for s in plan.stores if s not in full_stores]
    return "\n".join(lines) + "\n"


def _finish(kind: str, acc: str, dtype: torch.dtype) -> str:
    if kind == "prod":
        return f"tl.reduce({acc}, 0, _mul_combine)"
    if kind in ("max", "min") and dtype.is_floating_point:
        return f"tl.reduce({acc}, 0, _{kind}_nan)"
    fn = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min", "all": "tl.min", "any": "tl.max"}[kind]
    return f"{fn}({acc}, axis=0)" + (" != 0" if kind in ("all", "any") else "")


def _loop_head(n_expr: str, what: str) -> list:
    return [f"{INDENT}for start in range(0, {n_expr}, BLOCK_N):  # {what}",
            f"{INDENT * 2}cols = start + tl.arange(0, BLOCK_N)",
            f"{INDENT * 2}col_mask = cols < {n_expr}"]

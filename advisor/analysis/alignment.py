"""GEMMs that cuBLAS runs with an unaligned kernel, and what padding them to alignment costs.

cuBLAS's fast kernels (sm90 `nvjet`, the TMA-based CUTLASS ones) need every matrix's leading dimension
and base address to be 16-byte aligned: a multiple of 8 elements in fp16/bf16, 4 in fp32. When one is
not, it drops to a kernel that loads one element at a time (`cutlass_..._align1`): GPT-2's LM head
(logits [8192, 50257] in bf16, row stride 50257) ran 8.7 ms on the H100 against 1.14 ms for the same
product padded to N = 50264 (what Inductor's `pad_mm` does). The fix needs no kernel of ours: zero-pad
the operands' K and N to the alignment (zeros add nothing to the products), multiply, and keep the
first N columns. M never needs padding: the copies we make are row-major, so M is never a leading
dimension.

`unaligned_gemm(node)` says whether a traced matmul is such a GEMM (from its recorded shapes, strides
and offsets; the registry's `gemm` roles say which argument is which) and what padding it takes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from advisor.graph.dtypes import torch_dtype_name
from advisor.ops.registry import lookup

ALIGN_BYTES = 16
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # the dtypes cuBLAS GEMMs run (and we pad)


@dataclass(frozen=True)
class PaddedGemm:
    """One unaligned GEMM: out[*, M, N] = a[*, M, K] @ b[*, K, N] (+ bias), and its padded form."""

    m: int  # rows of the output, all leading dims flattened
    n: int
    k: int
    batch: int  # bmm / baddbmm batch (1 otherwise)
    dtype: str  # torch's name: bfloat16
    align: int  # elements per 16 bytes
    n_padded: int
    k_padded: int
    unaligned: tuple  # which tensors cuBLAS finds unaligned: "a", "b", "out"
    copy_bytes: int  # HBM bytes the pad copies move (read + write); the output is a view of the padded product
    copies: int  # kernels they take

    @property
    def flops(self) -> float:
        """Of the product as it stands: what the unaligned kernel computes."""
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def padded_flops(self) -> float:
        """Of the padded product: what the aligned kernel computes."""
        return 2.0 * self.batch * self.m * self.n_padded * self.k_padded

    @property
    def padded_dims(self) -> str:
        """`N=50257 → 50264`, `K=1001 → 1004, N=7 → 8`; empty when only a layout is unaligned."""
        dims = [(name, v, p) for name, v, p in (("K", self.k, self.k_padded), ("N", self.n, self.n_padded)) if p != v]
        return ", ".join(f"{name}={v} → {p}" for name, v, p in dims)


def aligned(shape, strides, offset: int, itemsize: int) -> bool:
    """Whether cuBLAS sees this matrix as 16-byte aligned: every stride of a dim longer than 1 other than
    the unit one, and the base address (its offset in elements; the storage itself is aligned), a multiple
    of 16 bytes."""
    align = ALIGN_BYTES // itemsize
    return offset % align == 0 and all(s % align == 0 for d, s in zip(shape, strides) if d > 1 and s != 1)


def unaligned_gemm(node) -> PaddedGemm | None:
    """The padding that gives this matmul node an aligned GEMM, or None when it has one already (or is not
    a GEMM the registry gives roles for, or runs in a dtype cuBLAS has no such kernels for)."""
    info = lookup(node.op)
    if info is None or not info.gemm or not node.writes:
        return None
    roles = info.gemm.split()
    by_role = {roles[u.pos]: u for u in node.reads if u.pos < len(roles)}
    a, b = by_role.get("a"), by_role.get("b") or by_role.get("w")
    out = node.writes[0]
    dtype = torch_dtype_name(out.dtype)
    if a is None or b is None or dtype not in ITEMSIZE or len(a.shape) < 2 or len(b.shape) < 2 or not out.shape:
        return None
    if any(torch_dtype_name(u.dtype) != dtype for u in (a, b)):
        return None
    itemsize = ITEMSIZE[dtype]
    align = ALIGN_BYTES // itemsize
    b_nk = "w" in by_role
    k = a.shape[-1]
    n = b.shape[0] if b_nk else b.shape[-1]
    if out.shape[-1] != n or (b.shape[-1] if b_nk else b.shape[-2]) != k:
        return None
    m = math.prod(a.shape[:-1])
    batch = 1
    if not b_nk and len(b.shape) > 2:  # bmm / batched matmul: the batch dims are b's leading dims
        batch = math.prod(b.shape[:-2])
        m //= max(batch, 1)
    unaligned = tuple(name for name, u in (("a", a), ("b", b), ("out", out))
                      if not aligned(u.shape, u.strides, u.offset, itemsize))
    if not unaligned or m <= 1:  # one row: a GEMV, whose kernels do not need the leading dimension aligned
        return None
    n_p, k_p = _round_up(n, align), _round_up(k, align)
    copies, moved = 0, 0
    if k_p != k or "a" in unaligned:  # a copied to [.., M, K_p], row-major
        copies, moved = copies + 1, moved + a.bytes + batch * m * k_p * itemsize
    if k_p != k or n_p != n or "b" in unaligned:
        copies, moved = copies + 1, moved + b.bytes + batch * k_p * n_p * itemsize
    bias = by_role.get("bias")
    if bias is not None and n_p != n and bias.shape and bias.shape[-1] == n:
        copies, moved = copies + 1, moved + 2 * math.prod(bias.shape) * itemsize
    return PaddedGemm(m, n, k, batch, dtype, align, n_p, k_p, unaligned, moved, copies)


def _round_up(v: int, align: int) -> int:
    return -(-v // align) * align

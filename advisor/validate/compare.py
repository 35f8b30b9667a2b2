"""How close is close enough: the tolerances by dtype, in one place, and the comparison itself.

A kernel output passes when, against the float64 reference,
  rel_l2  = ||out - ref|| / ||ref||       <= max(TOL[dtype].rel_l2,  2 x eager's rel_l2)
  max_abs = max |out - ref|               <= max(TOL[dtype].max_abs x max(1, max|ref|), 2 x eager's max_abs)
where "eager" is the same program run by PyTorch in the native dtypes: the fused kernel must be within
the dtype's tolerance, or no worse than twice what eager itself gets wrong (long bf16 chains). Errors
are measured where both are finite; NaN and +/-Inf must sit at the same positions as in the native
reference or the float64 reference rounded to the output dtype. Integer and bool outputs must match
exactly (or be no worse than eager). Outputs are poisoned (NaN, or an impossible bool byte) before the
kernel runs, so an element it never writes shows up as a mismatch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    rel_l2: float
    max_abs: float  # relative to max(1, max|ref|)


TOLERANCES = {
    torch.float64: Tol(1e-9, 1e-8),
    torch.float32: Tol(1e-5, 1e-4),
    torch.float16: Tol(1e-3, 4e-3),
    torch.bfloat16: Tol(1e-2, 3e-2),
}
EXACT = Tol(0.0, 0.0)
# Programs with a matmul anchor (epilogues, attention, matmul + reduction) in bf16/fp16: a dot
# product rounds its operands (attention's probabilities) and its result, and where a K-term sum cancels
# the result is small next to its terms; eager's own bf16 error then reaches ~1.5e-2 on small outputs
# (one query, head dim 1). Twice the elementwise tolerances; fp32 keeps its own (exact fp32 products,
# or TF32 where eager uses it too, which the "2 x eager" rule covers).
MATMUL_TOLERANCES = {torch.float16: Tol(2e-3, 8e-3), torch.bfloat16: Tol(2e-2, 6e-2)}


@dataclass
class Check:
    ok: bool
    reason: str | None
    rel_l2: float
    max_abs: float
    eager_rel_l2: float
    eager_max_abs: float


# Elements compared per step. The comparison runs where the tensors live (the GPU in a compile worker) in
# float64, a slice at a time: copying whole outputs to the host in float64 was most of a validation on the
# H100 (1-9 s of a 1.4-15 s job, 8 workers converting at once), and a slice bounds the float64 copies'
# memory (8 workers share the card with the user's model; an LM head's logits are 1 GB in float64).
CHUNK = 1 << 22


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.isnan(), t == float("inf"), t == -float("inf")])


def _slices(*tensors: torch.Tensor):
    flat = [t.reshape(-1) for t in tensors]
    for i in range(0, flat[0].numel(), CHUNK):
        yield [f[i:i + CHUNK] for f in flat]


class _Sums:
    """||out - ref||^2, ||ref||^2 and max |out - ref| over the positions where both are finite, accumulated
    as device tensors (one host sync at the end, not one per slice)."""

    def __init__(self, device):
        self.d2 = torch.zeros((), dtype=torch.float64, device=device)
        self.r2 = torch.zeros((), dtype=torch.float64, device=device)
        self.dmax = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor, r: torch.Tensor, finite: torch.Tensor) -> None:
        d = torch.where(finite, x - r, 0.0)
        self.d2 += d.square().sum()
        self.r2 += torch.where(finite, r, 0.0).square().sum()
        self.dmax = torch.maximum(self.dmax, d.abs().max())

    def errors(self) -> tuple[float, float]:
        norm = self.r2.sqrt().item()
        return self.d2.sqrt().item() / (norm if norm > 0 else 1.0), self.dmax.item()


def _first_nonfinite_mismatch(out, ref64) -> tuple[int, tuple, float, float]:
    """Where the kernel's NaN/Inf differ from the reference's rounded to the output dtype: the count and the
    first position (a second pass, taken only when a comparison has already failed)."""
    count, first = 0, None
    for i, (x, r) in enumerate(_slices(out, ref64)):
        bad = (_nonfinite(x.double()) != _nonfinite(r.to(out.dtype).double())).any(0)
        count += int(bad.sum())
        if first is None and bad.any():
            j = int(bad.nonzero()[0, 0])
            first = (i * CHUNK + j, x[j].item(), r[j].item())
    flat, xv, rv = first if first else (0, float("nan"), float("nan"))
    where = tuple(torch.unravel_index(torch.tensor(flat), out.shape)) if out.dim() else ()
    return count, tuple(int(w) for w in where), xv, rv


def compare(out: torch.Tensor, ref64: torch.Tensor, native: torch.Tensor, name: str, matmul: bool = False,
            through: torch.dtype | None = None) -> Check:
    """`matmul`: the program has a matmul anchor, so MATMUL_TOLERANCES apply to bf16/fp16. `through`: the
    lowest float precision the program rounds a value to on the way to this output; a float output is held
    to that dtype's tolerance when it is looser (an fp32 output computed from bf16 intermediates carries
    bf16 error, eager's as much as the kernel's, which keeps intermediates in fp32)."""
    dtype = out.dtype
    if out.shape != ref64.shape:
        return Check(False, f"{name}: shape {tuple(out.shape)}, expected {tuple(ref64.shape)}", *(float("nan"),) * 4)
    if dtype == torch.bool and (out.view(torch.uint8) > 1).any():
        return Check(False, f"{name}: {(out.view(torch.uint8) > 1).sum().item()} elements never written",
                     *(float("nan"),) * 4)
    device = out.device
    ref64, native = ref64.to(device), native.to(device)
    kernel, eager = _Sums(device), _Sums(device)
    like_eager = torch.ones((), dtype=torch.bool, device=device)
    like_rounded = torch.ones((), dtype=torch.bool, device=device)
    any_finite = torch.zeros((), dtype=torch.bool, device=device)
    scale = torch.ones((), dtype=torch.float64, device=device)
    for o, r64, n in _slices(out, ref64, native):
        x, r, e = o.double(), r64.double(), n.to(dtype).double()
        pattern = _nonfinite(x)
        like_eager &= (pattern == _nonfinite(e)).all()
        like_rounded &= (pattern == _nonfinite(r64.to(dtype).double())).all()
        finite = x.isfinite() & r.isfinite()
        kernel.add(x, r, finite)
        eager.add(e, r, e.isfinite() & r.isfinite())
        any_finite |= finite.any()
        scale = torch.maximum(scale, torch.where(finite, r.abs(), 0.0).max())
    if not (like_eager.item() or like_rounded.item()):
        count, where, xv, rv = _first_nonfinite_mismatch(out, ref64)
        return Check(False, f"{name}: NaN/Inf at {count} positions where the reference has "
                            f"none (first at {where}: {xv} vs {rv})", *(float("nan"),) * 4)
    rel, mx = kernel.errors()
    erel, emx = eager.errors()
    tol = (MATMUL_TOLERANCES.get(dtype) if matmul else None) or TOLERANCES.get(dtype, EXACT)
    if through in TOLERANCES and dtype.is_floating_point and TOLERANCES[through].rel_l2 > tol.rel_l2:
        tol = TOLERANCES[through]
    scale = scale.item() if any_finite.item() else 1.0
    lim_rel, lim_abs = max(tol.rel_l2, 2 * erel), max(tol.max_abs * scale, 2 * emx)
    if rel > lim_rel:
        return Check(False, f"{name}: rel_l2 {rel:.3g} exceeds {lim_rel:.3g} for {str(dtype)[6:]}", rel, mx, erel, emx)
    if mx > lim_abs:
        return Check(False, f"{name}: max_abs {mx:.3g} exceeds {lim_abs:.3g} for {str(dtype)[6:]}", rel, mx, erel, emx)
    return Check(True, None, rel, mx, erel, emx)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a fresh output with values no correct kernel leaves behind."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        t.view(torch.uint8).fill_(0xA5)
        return t
    return t.fill_(torch.iinfo(t.dtype).min + 7)

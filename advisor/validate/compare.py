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
# Programs with a matmul anchor (issue 10: epilogues, attention, matmul + reduction) in bf16/fp16: a dot
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


def _errors(x: torch.Tensor, ref: torch.Tensor, finite: torch.Tensor) -> tuple[float, float]:
    d = (x - ref)[finite]
    r = ref[finite]
    if d.numel() == 0:
        return 0.0, 0.0
    norm = r.norm().item()
    return d.norm().item() / (norm if norm > 0 else 1.0), d.abs().max().item()


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.isnan(), t == float("inf"), t == -float("inf")])


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
    x, r, e = out.double().cpu(), ref64.double().cpu(), native.to(dtype).double().cpu()
    r_rounded = ref64.to(dtype).double().cpu()
    pattern = _nonfinite(x)
    if not (torch.equal(pattern, _nonfinite(e)) or torch.equal(pattern, _nonfinite(r_rounded))):
        bad = (pattern != _nonfinite(r_rounded)).any(0)
        where = tuple(i.item() for i in bad.nonzero()[0]) if bad.any() else ()
        return Check(False, f"{name}: NaN/Inf at {bad.sum().item()} positions where the reference has "
                            f"none (first at {where}: {x[where].item()} vs {r[where].item()})", *(float("nan"),) * 4)
    finite = x.isfinite() & r.isfinite()
    rel, mx = _errors(x, r, finite)
    erel, emx = _errors(e, r, e.isfinite() & r.isfinite())
    tol = (MATMUL_TOLERANCES.get(dtype) if matmul else None) or TOLERANCES.get(dtype, EXACT)
    if through in TOLERANCES and dtype.is_floating_point and TOLERANCES[through].rel_l2 > tol.rel_l2:
        tol = TOLERANCES[through]
    scale = max(1.0, r[finite].abs().max().item()) if finite.any() else 1.0
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

"""Patched vs unpatched outputs of a whole model call, with validation's dtype tolerances.

Outputs are walked as pytrees (tuples, dicts, Hugging Face ModelOutputs): tensors are compared like
validation compares a kernel with eager (`advisor.validate.compare.TOLERANCES`: rel_l2, and max_abs
relative to max(1, max|ref|)), integer/bool tensors and everything else must be equal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

# The fallback is validation's table, kept for when the validate package cannot be imported.
_TOL = {torch.float64: (1e-9, 1e-8), torch.float32: (1e-5, 1e-4), torch.float16: (1e-3, 4e-3),
        torch.bfloat16: (1e-2, 3e-2)}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    try:
        from advisor.validate.compare import TOLERANCES

        t = TOLERANCES.get(dtype)
        if t is not None:
            return t.rel_l2, t.max_abs
    except Exception:  # pragma: no cover - validation not importable: same numbers from here
        pass
    return _TOL.get(dtype, (0.0, 0.0))


@dataclass
class Comparison:
    ok: bool
    reason: str | None = None
    rel_l2: float = 0.0
    max_abs: float = 0.0
    exact: bool = True

    def as_dict(self) -> dict:
        return {"ok": self.ok, "reason": self.reason, "rel_l2": self.rel_l2, "max_abs": self.max_abs,
                "bit_identical": self.exact}


def compare_outputs(ref, out) -> Comparison:
    ref_leaves, ref_spec = tree_flatten(ref)
    out_leaves, out_spec = tree_flatten(out)
    if len(ref_leaves) != len(out_leaves):
        return Comparison(False, f"{len(out_leaves)} outputs, expected {len(ref_leaves)}", exact=False)
    worst = Comparison(True)
    for i, (r, o) in enumerate(zip(ref_leaves, out_leaves)):
        c = _compare_one(r, o, f"output {i}")
        worst.exact &= c.exact
        worst.rel_l2, worst.max_abs = max(worst.rel_l2, c.rel_l2), max(worst.max_abs, c.max_abs)
        if not c.ok:
            worst.ok, worst.reason = False, c.reason
            break
    return worst


def _compare_one(r, o, name: str) -> Comparison:
    if not isinstance(r, torch.Tensor):
        same = isinstance(o, type(r)) and (r == o if not isinstance(r, float) or r == r else o != o)
        return Comparison(bool(same), None if same else f"{name}: {o!r} != {r!r}", exact=bool(same))
    if not isinstance(o, torch.Tensor) or o.shape != r.shape or o.dtype != r.dtype:
        what = f"{tuple(o.shape)} {o.dtype}" if isinstance(o, torch.Tensor) else type(o).__name__
        return Comparison(False, f"{name}: {what}, expected {tuple(r.shape)} {r.dtype}", exact=False)
    if torch.equal(r, o):
        return Comparison(True)
    if not r.is_floating_point() and not r.is_complex():
        return Comparison(False, f"{name}: {int((r != o).sum())} elements differ", exact=False)
    rd, od = r.detach().double().cpu(), o.detach().double().cpu()
    finite = rd.isfinite() & od.isfinite()
    if not torch.equal(rd.isfinite(), od.isfinite()):
        return Comparison(False, f"{name}: NaN/Inf at different positions", exact=False)
    d = (od - rd)[finite]
    norm = rd[finite].norm().item()
    rel = d.norm().item() / (norm if norm > 0 else 1.0)
    mx = d.abs().max().item() if d.numel() else 0.0
    tol_rel, tol_abs = tolerance(r.dtype)
    scale = max(1.0, rd[finite].abs().max().item()) if finite.any() else 1.0
    if rel > tol_rel:
        return Comparison(False, f"{name}: rel_l2 {rel:.3g} exceeds {tol_rel:.3g} for {str(r.dtype)[6:]}", rel, mx, False)
    if mx > tol_abs * scale:
        return Comparison(False, f"{name}: max_abs {mx:.3g} exceeds {tol_abs * scale:.3g} for {str(r.dtype)[6:]}",
                          rel, mx, False)
    return Comparison(True, None, rel, mx, False)

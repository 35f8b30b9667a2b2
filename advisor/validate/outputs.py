"""Patched vs unpatched outputs of a whole model call, with validation's dtype tolerances.

Outputs are walked as pytrees (tuples, dicts, Hugging Face ModelOutputs): tensors are compared like
validation compares a kernel (`advisor.validate.compare.TOLERANCES`: rel_l2, and max_abs relative to
max(1, max|ref|)), integer/bool tensors and everything else must be equal. A whole low-precision model
amplifies rounding: a bf16 kernel that rounds once where eager rounds after every op moves 8 layers'
logits by ~2% rel_l2, as much as eager itself is off. So when the patched output is not within the
tolerance of the unpatched one and an exact answer (the same call in float32) is at hand, the rule is
validation's: within the tolerance of the exact answer, or no worse than twice eager's own error.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from advisor.validate.compare import TOLERANCES


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    t = TOLERANCES.get(dtype)
    return (t.rel_l2, t.max_abs) if t is not None else (0.0, 0.0)


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


def compare_outputs(ref, out, exact=None) -> Comparison:
    """`out` (patched) against `ref` (unpatched eager) by the dtype's tolerance; with `exact` (the same call
    in a higher precision) also validation's second rule: no worse than twice eager's own error."""
    ref_leaves, out_leaves = leaves(ref), leaves(out)
    exact_leaves = leaves(exact) if exact is not None else [None] * len(ref_leaves)
    if len(ref_leaves) != len(out_leaves) or len(exact_leaves) != len(ref_leaves):
        return Comparison(False, f"{len(out_leaves)} outputs, expected {len(ref_leaves)}", exact=False)
    worst = Comparison(True)
    for i, (r, o, x) in enumerate(zip(ref_leaves, out_leaves, exact_leaves)):
        c = _compare_one(r, o, f"output {i}", x)
        worst.exact &= c.exact
        worst.rel_l2, worst.max_abs = max(worst.rel_l2, c.rel_l2), max(worst.max_abs, c.max_abs)
        if not c.ok:
            worst.ok, worst.reason = False, c.reason
            break
    return worst


PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device)


def leaves(x, depth: int = 4) -> list:
    """Pytree leaves, with objects pytree does not know (a transformers `DynamicCache` of keys and values)
    opened up through their attributes, so their tensors are compared and not the objects' identities."""
    out = []
    for leaf in tree_flatten(x)[0]:
        if isinstance(leaf, (torch.Tensor, *PLAIN)) or depth == 0:
            out.append(leaf)
        elif isinstance(leaf, (list, tuple)):
            out.extend(leaves(list(leaf), depth - 1))
        elif hasattr(leaf, "__dict__"):
            state = {k: v for k, v in sorted(vars(leaf).items()) if not k.startswith("__")}
            out.append(type(leaf).__qualname__)
            out.extend(leaves(state, depth - 1))
        else:
            out.append(type(leaf).__qualname__)  # opaque: only its type can be compared
    return out


def _compare_one(r, o, name: str, x=None) -> Comparison:
    if not isinstance(r, torch.Tensor):
        same = (o != o) if isinstance(r, float) and r != r else (type(o) is type(r) and o == r)
        return Comparison(bool(same), None if same else f"{name}: {o!r} != {r!r}", exact=bool(same))
    if not isinstance(o, torch.Tensor) or o.shape != r.shape or o.dtype != r.dtype:
        what = f"{tuple(o.shape)} {o.dtype}" if isinstance(o, torch.Tensor) else type(o).__name__
        return Comparison(False, f"{name}: {what}, expected {tuple(r.shape)} {r.dtype}", exact=False)
    if torch.equal(r, o):
        return Comparison(True)
    if not r.is_floating_point() and not r.is_complex():
        return Comparison(False, f"{name}: {int((r != o).sum())} elements differ", exact=False)
    if not _same_finite(r, o):
        return Comparison(False, f"{name}: NaN/Inf at different positions", exact=False)
    tol_rel, tol_abs = tolerance(r.dtype)
    rel, mx, scale = _errors(o, r)
    lim_rel, lim_abs, against = tol_rel, tol_abs * scale, "unpatched"
    if isinstance(x, torch.Tensor) and x.shape == r.shape and (rel > lim_rel or mx > lim_abs):
        # Validation's rule against the exact answer: within tolerance, or no worse than 2x eager's error.
        x = x.to(r.device)
        e_rel, e_mx, scale = _errors(r, x)
        rel, mx, _ = _errors(o, x)
        lim_rel, lim_abs, against = max(tol_rel, 2 * e_rel), max(tol_abs * scale, 2 * e_mx), "float32 reference"
    dt = str(r.dtype)[6:]
    if rel > lim_rel:
        return Comparison(False, f"{name}: rel_l2 {rel:.3g} vs the {against} exceeds {lim_rel:.3g} for {dt}", rel, mx,
                          False)
    if mx > lim_abs:
        return Comparison(False, f"{name}: max_abs {mx:.3g} vs the {against} exceeds {lim_abs:.3g} for {dt}", rel, mx,
                          False)
    return Comparison(True, None, rel, mx, False)


CHUNK = 1 << 24  # elements per step: float64 copies of a chunk, never of a whole 1 GB logits tensor


def _chunks(*ts: torch.Tensor):
    """Matching flat float64 chunks of same-shaped tensors, on their own device (a GPU does this in
    milliseconds; copying logits to the host took most of a GPT-2 cold start)."""
    flat = [t.detach().reshape(-1) for t in ts]
    for i in range(0, flat[0].numel(), CHUNK):
        yield [f[i:i + CHUNK].double() for f in flat]


def _same_finite(r: torch.Tensor, o: torch.Tensor) -> bool:
    return all(bool(torch.equal(a.isfinite(), b.isfinite())) for a, b in _chunks(r, o))


def _errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(rel_l2, max_abs, max(1, max|ref|)) over the elements finite in both."""
    d_sq = r_sq = d_max = r_max = 0.0
    n = 0
    for xc, rc in _chunks(x, ref):
        finite = xc.isfinite() & rc.isfinite()
        d, r = (xc - rc)[finite], rc[finite]
        if d.numel():
            n += d.numel()
            d_sq += float(d.square().sum())
            r_sq += float(r.square().sum())
            d_max, r_max = max(d_max, float(d.abs().max())), max(r_max, float(r.abs().max()))
    if n == 0:
        return 0.0, 0.0, 1.0
    norm = r_sq ** 0.5
    return d_sq ** 0.5 / (norm if norm > 0 else 1.0), d_max, max(1.0, r_max)

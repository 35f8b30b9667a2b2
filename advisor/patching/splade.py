"""The SPLADE head under autograd: a `matmul_reduction` site whose program is
`amax(log1p(relu(linear(hidden, weight, bias))) * mask, dim=1)` trains through the hand-written
`advisor.kernels.splade_head.SpladeHeadFunction` (forward and backward never hold the B x L x V logits)
instead of falling back to eager's ops.

    roles = head_roles(program)          # which program input is hidden / weight / bias / mask, or None
    t = SpladeTrainable(program, roles)  # a site's `trainable`: t(xs) -> (out,), or None: run eager's ops

Like the generated backwards (`autograd.py`), the Function is used only after its output and gradients
matched PyTorch's autograd on eager's ops, in float64 and in the native dtype (`validate.compare`, with
the matmul tolerances), once per (which inputs need gradients, dtypes, device, hidden size, bias or
not): at the site's shape (capped), at odd sizes (sequence and vocabulary not multiples of any tile, a
fully masked batch row, zeros in the mask) and at one token. A mask that requires a gradient, or a
failed validation, runs the site's original ops.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from advisor.graph.dtypes import torch_dtype
from advisor.ops.registry import SPLADE_CHAIN, lookup, tagged


@dataclass(frozen=True)
class HeadRoles:
    """Positions in the program's inputs."""
    hidden: int  # B x L x D
    weight: int  # V x D
    bias: int | None  # V
    mask: int  # B x L x 1 (broadcast over the vocabulary)


def head_roles(program: dict) -> HeadRoles | None:
    """The roles of the inputs when the program is exactly the SPLADE head reduced over the sequence, else None."""
    nodes = program.get("nodes") or []
    # the projection as a trace records it (linear) or as the dispatcher does (addmm / mm on the flattened rows
    # and the transposed weight): the registry's "projection"; then the chain
    if len(nodes) != 5 or not tagged(nodes[0]["op"], "projection") \
            or tuple(n["op"] for n in nodes[1:]) != SPLADE_CHAIN or len(program.get("outputs", [])) != 1:
        return None
    inputs = {s["id"]: k for k, s in enumerate(program["inputs"])}
    linear, relu, log1p, mul, amax = nodes
    out = lambda n: n["outputs"][0]["id"]  # noqa: E731
    refs = lambda n: [a.get("ref") for a in n["args"]]  # noqa: E731
    operands = _projection_operands(linear, program["inputs"], inputs)
    if operands is None:
        return None
    hidden, weight, bias = operands
    if refs(relu)[0] != out(linear) or refs(log1p)[0] != out(relu):
        return None
    factors = refs(mul)[:2]
    if out(log1p) not in factors:
        return None
    mask = inputs.get(factors[1 - factors.index(out(log1p))])
    dim = amax["args"][1].get("value") if len(amax["args"]) > 1 else None
    keep = amax["args"][2].get("value") if len(amax["args"]) > 2 else False
    if mask is None or refs(amax)[0] != out(mul) or program["outputs"] != [out(amax)] or keep:
        return None
    spec = program["inputs"]
    h, w, m = spec[hidden]["shape"], spec[weight]["shape"], spec[mask]["shape"]
    if len(h) != 3 or list(dim or []) not in ([1], [-2]) or len(w) != 2 or w[1] != h[2]:
        return None
    if relu["args"][0]["shape"] != [h[0], h[1], w[0]] or (bias is not None and spec[bias]["shape"] != [w[0]]):
        return None  # the chain runs on B x L x V logits; the bias is one value per vocabulary entry
    if len(m) != 3 or m[2] != 1 or m[0] not in (1, h[0]) or m[1] not in (1, h[1]):
        return None  # the mask must be one value per (batch row, position)
    dtype = spec[hidden]["dtype"]
    if not torch_dtype(dtype).is_floating_point or spec[weight]["dtype"] != dtype \
            or amax["outputs"][0]["dtype"] != dtype or (bias is not None and spec[bias]["dtype"] != dtype):
        return None  # one float dtype through the chain (a float32 mask on bf16 logits would promote it)
    return HeadRoles(hidden, weight, bias, mask)


def _projection_operands(node: dict, specs: list, inputs: dict) -> tuple | None:
    """(hidden, weight, bias or None) input positions of `hidden @ weight^T + bias`, or None. addmm / mm read
    hidden as (B*L) x D rows and weight transposed (D x V); linear reads them as they are. Which argument is
    which: the registry's `gemm` roles (`a`, and `w` for linear's [V, D] weight or `b` for the transposed one)."""
    args = node["args"]
    roles = lookup(node["op"]).gemm.split()
    at = {r: args[k] if k < len(args) else {} for k, r in enumerate(roles)}
    if "w" in roles:  # linear
        ref = {r: a.get("ref") for r, a in at.items()}
        hidden, weight, bias = inputs.get(ref["a"]), inputs.get(ref["w"]), inputs.get(ref["bias"])
        return None if hidden is None or weight is None or (ref["bias"] is not None and bias is None) \
            else (hidden, weight, bias)
    bias, rows, cols = None, at["a"], at["b"]
    if "bias" in roles:  # addmm
        if any(a.get("value", 1) != 1 for a in args[len(roles):]):
            return None  # beta, alpha
        bias = inputs.get(at["bias"].get("ref"))
        if bias is None:
            return None
    hidden, weight = inputs.get(rows.get("ref")), inputs.get(cols.get("ref"))
    if hidden is None or weight is None:
        return None
    h, w = specs[hidden], specs[weight]
    if len(h["shape"]) != 3 or len(w["shape"]) != 2:
        return None
    (B, L, D), (hs_b, hs_l, hs_d) = h["shape"], h["strides"]
    flat = rows["shape"] == [B * L, D] and rows["strides"] == [hs_l, hs_d] and (B == 1 or hs_b == L * hs_l)
    transposed = cols["shape"] == w["shape"][::-1] and cols["strides"] == w["strides"][::-1]
    same_start = rows.get("storage_offset", 0) == h.get("storage_offset", 0) and \
        cols.get("storage_offset", 0) == w.get("storage_offset", 0)
    return (hidden, weight, bias) if flat and transposed and same_start else None


# ------------------------------------------------------------------------------------ the site's trainable
@dataclass
class Record:
    """One validation of the Function (per key), and how often it ran since."""
    validated: bool
    reason: str | None
    errors: dict = field(default_factory=dict)
    launches: int = 0
    label: str = ""
    shapes: list = field(default_factory=list)
    needs: tuple = ()
    saved_bytes: int = 0
    eager_saved_bytes: int = 0


_LOCK = threading.Lock()
_RECORDS: dict[tuple, Record] = {}


class SpladeTrainable:
    """What a SPLADE-head site runs when autograd needs it (`rewrite.Site.trainable`)."""

    def __init__(self, program: dict, roles: HeadRoles, label: str = ""):
        self.program = program
        self.roles = roles
        self.label = label

    def split(self, xs) -> tuple:
        r = self.roles
        return xs[r.hidden], xs[r.weight], xs[r.bias] if r.bias is not None else None, xs[r.mask]

    def record_for(self, hidden, weight, bias, mask) -> Record:
        needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        key = (needs, hidden.dtype, hidden.device.type, hidden.shape[-1], bias is not None)
        rec = _RECORDS.get(key)
        if rec is None:
            with _LOCK:
                rec = _RECORDS.get(key)
                if rec is None:
                    rec = _RECORDS[key] = check(hidden, weight, bias, mask, needs)
                    rec.label = self.label
        return rec

    def __call__(self, xs) -> tuple | None:
        from advisor.kernels.splade_head import SpladeHeadFunction  # Triton: loaded when a head trains

        hidden, weight, bias, mask = self.split(xs)
        if isinstance(mask, torch.Tensor) and mask.requires_grad:
            return None  # the Function gives the mask no gradient: eager's ops do
        rec = self.record_for(hidden, weight, bias, mask)
        if not rec.validated:
            return None
        rec.launches += 1
        return (SpladeHeadFunction.apply(hidden, weight, bias, mask),)


def summary() -> list[dict]:
    """Each validation of the SPLADE head's Function, in `autograd.summary()`'s form."""
    return [{"program": "splade_head", "pattern": r.label, "needs_grad": list(r.needs), "shapes": r.shapes,
             "validated": r.validated, "reason": r.reason, "launches": r.launches, "saved_bytes": r.saved_bytes,
             "saves_outputs": False, "eager_saved_bytes": r.eager_saved_bytes,
             "errors": {k: v for k, v in r.errors.items() if k != "shapes"}} for r in list(_RECORDS.values())]


# ------------------------------------------------------------------------------------ validation
def _cases(B: int, L: int, V: int, interpreted: bool) -> list[tuple[str, int, int, int]]:
    """(name, B, L, V). The site's shape capped so that the float64 reference's logits stay small (the
    hidden size, the matmul's depth, is never changed); odd sizes that leave every tile a tail; one token."""
    if interpreted:
        recorded = (min(B, 2), min(L, 24), min(V, 72))
    else:
        recorded = (min(B, 4), L, min(V, 4099))
    return [("recorded", *recorded), ("odd", 3, 19, 37 if interpreted else 1031), ("ones", 1, 1, 5)]


def _draw(B, L, D, V, dtype, device, g, has_bias):
    """Inputs where about half the logits are positive and no two chain values tie (continuous draws),
    row 1 fully masked and some zeros elsewhere in the mask."""
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, device=device)  # noqa: E731
    hidden, weight = r(B, L, D), r(V, D) / D ** 0.5
    bias = r(V) * 0.5 if has_bias else None
    mask = (torch.rand(B, L, generator=g, dtype=torch.float64, device=device) > 0.25).double()
    if B > 1:
        mask[1] = 0.0
    return [t.to(dtype) if t is not None else None for t in (hidden, weight, bias)] + [mask.to(dtype)[..., None]]


def _grads(fn, xs, needs, gout, dtype):
    """(out, grads of the inputs that need one): fn run on copies of xs in `dtype`."""
    leaves = [x.detach().to(dtype).requires_grad_(n) if x is not None else None for x, n in zip(xs[:3], needs)]
    with torch.enable_grad():
        out = fn(*leaves, xs[3].to(dtype))
        want = [t for t, n in zip(leaves, needs) if n]
        got = torch.autograd.grad(out, want, gout.to(dtype)) if want else ()
    return out.detach(), list(got)


def check(hidden, weight, bias, mask, needs) -> Record:
    """The Function's output and gradients against autograd on eager's ops; never raises."""
    from advisor.kernels.splade_head import SpladeHeadFunction, splade_head_reference
    from advisor.validate import interpreted
    from advisor.validate.compare import compare

    B, L, D = hidden.shape
    V = weight.shape[0]
    dtype, device = hidden.dtype, hidden.device
    rec = Record(False, None, needs=needs, saved_bytes=B * V * (4 + 4),
                 eager_saved_bytes=3 * B * L * V * hidden.element_size())
    g = torch.Generator(device=device).manual_seed(1)
    worst = {"rel_l2": 0.0, "max_abs": 0.0, "eager_rel_l2": 0.0, "eager_max_abs": 0.0}
    for name, b, n, v in _cases(B, L, V, interpreted()):
        xs = _draw(b, n, D, v, dtype, device, g, bias is not None)
        gout = torch.randn(b, v, generator=g, dtype=torch.float64, device=device).to(dtype)
        try:
            mine = _grads(SpladeHeadFunction.apply, xs, needs, gout, dtype)
            ref64 = _grads(splade_head_reference, xs, needs, gout, torch.float64)
            native = _grads(splade_head_reference, xs, needs, gout, dtype)
        except Exception as e:
            rec.reason = f"failed at the {name} shape: {type(e).__name__}: {e}"[:500]
            return rec
        rec.shapes.append([b, n, D, v])
        what = ["output"] + [f"grad of {k}" for k, nd in zip(("hidden", "weight", "bias"), needs) if nd]
        for label, got, r64, nat in zip(what, [mine[0], *mine[1]], [ref64[0], *ref64[1]], [native[0], *native[1]]):
            c = compare(got, r64, nat, f"{label} ({name} shape)", True)
            if not c.ok:
                rec.reason, rec.errors = c.reason, {**worst, "failed": c.reason}
                return rec
            for k in worst:
                worst[k] = max(worst[k], getattr(c, k))
    rec.validated, rec.errors = True, worst
    return rec

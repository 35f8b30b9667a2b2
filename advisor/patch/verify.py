"""Patched vs unpatched on the same inputs; a pattern whose outputs differ is unpatched and says why.

`check(call, handle)`: runs `call()` with patches off (the reference) and on, compares with
validation's dtype tolerances. On a mismatch each pattern is run alone against the reference; the
ones that fail alone are dropped (if none fails alone, the combination is at fault and all are
dropped) and the model is re-patched without them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from advisor.bench.compare import Comparison, compare_outputs
from advisor.patch import Patched, only, patch, patches_off


@dataclass
class Check:
    comparison: Comparison
    dropped: dict = field(default_factory=dict)  # pattern key -> reason
    handle: Patched | None = None  # the (re-)patched model
    output: object = None  # the output to hand back (the reference when anything was dropped)

    def as_dict(self) -> dict:
        return {**self.comparison.as_dict(), "dropped": dict(self.dropped)}


def check(call: Callable[[], object], handle: Patched) -> Check:
    with patches_off():
        ref = call()
    out = call()
    cmp = compare_outputs(ref, out)
    if cmp.ok:
        return Check(cmp, {}, handle, out)
    live = [s.key for s in handle.plan.patterns if handle.sites(s.key)]
    dropped = {}
    for key in live:
        with only({key}):
            alone = compare_outputs(ref, call())
        if not alone.ok:
            dropped[key] = f"outputs differ from the unpatched model with this pattern alone: {alone.reason}"
    if not dropped:
        dropped = {k: f"outputs differ with all patterns applied together: {cmp.reason}" for k in live}
    new = patch(handle.model, handle.plan.without(dropped))
    return Check(cmp, dropped, new, ref)

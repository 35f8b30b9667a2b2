"""Which route a patched model takes on a GPU (`optimize(..., inductor=None)`, the default): our captures as they
are, or Inductor compiling each of them around our kernels (`advisor.patching.stacked`).

Neither wins everywhere. Inductor fuses every region between matmuls, where our patterns cover a few; ours keep
kernels Inductor has no equal for, and skip its compile. So both are checked and selected as `optimize` does
(`Checked`: the outputs compared with the unpatched model's, the states timed against it), and the route whose
state beat the unpatched model by more is kept: each route's speedup is measured in its own interleaved run
against that run's unpatched model, which cancels the drift between the two runs. Inductor's route is taken only
when faster by more than `ROUTE_MARGIN`: it holds more memory (its own recordings) and compiles longer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from advisor import agreement
from advisor.errors import exception_reason

ROUTE_MARGIN = 0.02


@dataclass(frozen=True)
class Checked:
    """One route checked and selected: what `live_model` carries on with."""

    check: object  # verify.Check
    handle: object  # the Patched handle in force
    records: list
    selection: dict | None
    timed: dict | None  # selection's first run, where it timed the state handed back (`benchmark=True` reuses it)


def speedup(selection: dict | None) -> float:
    """The unpatched model's median over the chosen state's, in selection's final run (1.0: nothing kept)."""
    final = (selection or {}).get("final") or {}
    state = (selection or {}).get("state")
    before, after = final.get("before"), final.get(str(state)) if state is not None else None
    return before / after if before and after else 1.0


def choose(ours: Checked, model, check_and_select: Callable[[object], Checked], patch: Callable) -> Checked:
    """The faster of `ours` and Inductor's route (the same plan with `inductor=True`, checked and selected by
    `check_and_select`), with the decision in its selection's `route`. The model is left patched the chosen way."""
    plan = ours.check.handle.plan  # the plan as the check left it, before selection dropped anything
    mine = speedup(ours.selection)
    try:
        theirs = check_and_select(patch(model, dataclasses.replace(plan, inductor=True, enabled=None, outer_on=False)))
        other = speedup(theirs.selection)
    except Exception as e:  # Inductor's route must never cost the user ours
        theirs, other, why = None, None, f"Inductor's route failed: {exception_reason(e, named=(model,))}"
    else:
        why = (f"Inductor compiling the captures around the kernels: {other:.3f}x against {mine:.3f}x with ours "
               f"alone, each over the unpatched model in its own run")
    # In a torch.distributed job every rank takes rank 0's route, and Inductor's only where every rank has it
    taken = agreement.everywhere(theirs is not None, "Inductor's route built") and \
        agreement.agreed(theirs is not None and other > mine * (1 + ROUTE_MARGIN), "route")
    route = {"ours_x": round(mine, 4), "inductor_x": None if other is None else round(other, 4),
             "chosen": "inductor" if taken else "ours",
             "decision": ("took " if taken else "kept ours: ") + why
             + ("" if taken or theirs is None else f" (Inductor's taken only beyond {ROUTE_MARGIN:.0%})")}
    if taken:
        chosen = theirs
    else:
        again = ours.handle.plan
        handle = patch(model, dataclasses.replace(again, enabled=ours.handle.enabled, outer_on=ours.handle.outer_on))
        chosen = dataclasses.replace(ours, handle=handle, timed=None)  # re-captured: its first timing is not this one
    if chosen.selection is not None:
        chosen.selection["route"] = route
    return chosen

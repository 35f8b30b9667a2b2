"""Which route a patched model takes on a GPU (`optimize(..., inductor=None)`, the default): our captures as they
are, or Inductor compiling each of them around our kernels (`advisor.patching.stacked`).

Neither wins everywhere. Inductor fuses every region between matmuls, where our patterns cover a few; ours keep
kernels Inductor has no equal for, and skip its compile. So both are checked and selected as `optimize` does
(`Checked`: the outputs compared with the unpatched model's, the states timed against it), and the route whose
chosen state runs faster is kept. Both are stated as speedups over the faster of the two runs' unpatched medians:
the unpatched model is the noisy one (host-bound: on the H200 its median moved 10.0 -> 16.5 ms between the two runs
of a launch-bound Qwen2, whose patched states, replayed as CUDA graphs, held within 1%), so each route over its own
run's unpatched model chose ours at 2.12 ms against Inductor's 1.52. Inductor's route is taken only when faster by
more than `ROUTE_MARGIN`: it holds more memory (its own recordings) and compiles longer.
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


def timed(selection: dict | None) -> tuple[float | None, float | None]:
    """(unpatched median, chosen state's median) in ms, in selection's final run (None: not timed)."""
    final = (selection or {}).get("final") or {}
    state = (selection or {}).get("state")
    return final.get("before"), final.get(str(state)) if state is not None else None


def choose(ours: Checked, model, check_and_select: Callable[[object], Checked], patch: Callable) -> Checked:
    """The faster of `ours` and Inductor's route (the same plan with `inductor=True`, checked and selected by
    `check_and_select`), with the decision in its selection's `route`. The model is left patched the chosen way."""
    plan = ours.check.handle.plan  # the plan as the check left it, before selection dropped anything
    before, after = timed(ours.selection)
    mine, other = (before / after if before and after else 1.0), None
    try:
        theirs = check_and_select(patch(model, dataclasses.replace(plan, inductor=True, enabled=None, outer_on=False)))
    except Exception as e:  # Inductor's route must never cost the user ours
        theirs, why = None, f"Inductor's route failed: {exception_reason(e, named=(model,))}"
    else:
        their_before, their_after = timed(theirs.selection)
        base = min(b for b in (before, their_before, float("inf")) if b)  # the unpatched model's best median
        mine, other = (base / t if t and base < float("inf") else 1.0 for t in (after, their_after))
        why = (f"Inductor compiling the captures around the kernels: {other:.3f}x ({their_after} ms) against "
               f"{mine:.3f}x ({after} ms) with ours alone, over the unpatched model's {base} ms (the faster of "
               "the two runs')")
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

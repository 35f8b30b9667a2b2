"""What became of each pattern a workflow tried: each `PatternResult` with whether the pattern is
patched, at how many sites, and if not why (its `Verdict`: a `Status` code and a sentence).

Shared by both workflows: `optimize` reads a `Patched` handle, `apply` the handles of every model its
script built (`user_script.Handles`); both answer `sites`, `site_objects`, `rejected` and `plan`.
"""
from __future__ import annotations

import dataclasses

from advisor.records import PatternResult, candidates_of
from advisor.status import Status


def pattern_status(records: list[PatternResult], specs: list, handle, dropped: dict, doc: dict | None = None,
                   launched: dict | None = None, selected: bool = False) -> list[PatternResult]:
    """Each result again, with whether it is patched, where, and if not why (its verdict). `doc`: the
    analysis.json document (which candidate extends which). `launched`: {pattern key: sites whose
    launcher ran on the example inputs}; without it, sites substituted in the captured graphs count.
    `selected`: selection has timed the states (an outer capture left off was then measured slower, not merely
    untried)."""
    by_cand = {s.candidate: s for s in specs}
    plan = getattr(handle, "plan", None)
    captured_keys = {k for t in getattr(plan, "targets", []) for k in t.keys}
    skipped = getattr(plan, "skipped", {}) or {}
    uncaptured = getattr(plan, "uncaptured", {}) or {}
    enabled = getattr(handle, "enabled", None)  # a reused plan: what selection kept when it was stored
    outer_only = plan.outer_only_keys() if plan is not None else set()
    outer_on = getattr(handle, "outer_on", False)
    outer = [(q or "the model", f) for q, f in getattr(handle, "forwards", {}).items() if f.outer]
    outer_names = [q for q, _ in outer]
    outer_refused = next((f.refused for _, f in outer if f.refused), None)
    out = []
    for r in records:
        s = by_cand.get(r.candidate)
        substituted = handle.sites(s.key) if s is not None and handle is not None else 0
        sites = substituted if launched is None or s is None else launched.get(s.key, 0)
        broken = [x.broken for x in handle.site_objects(s.key) if x.broken] if s is not None and handle else []
        r = dataclasses.replace(r, sites=sites,
                                patched=bool(s is not None and sites and s.key not in dropped and not broken))
        code, why = Status.PATCHED, "patched"
        if s is None:  # (a reused plan's record keeps the status its first run found)
            code = r.code or Status.NOT_GENERATED
            why = r.reason or (r.verdict.message if r.verdict else "") or "no kernel"
        elif s.key in dropped:
            code, why = Status.MISMATCH, f"unpatched: {dropped[s.key]}"
        elif broken:
            code, why = Status.LAUNCHER_FAILED, f"launcher failed, original ops run instead: {broken[0]}"
        elif handle is not None and s.key not in captured_keys:
            mods = uncaptured.get(s.key) or []
            where = f"{mods[0]}{f' (+{len(mods) - 1} more)' if len(mods) > 1 else ''}: {skipped.get(mods[0])}" \
                if mods else "no module of the model holds all its ops"
            code, why = Status.NOT_CAPTURED, f"not patched: its occurrences span modules that are not captured ({where})"
        elif s.key in outer_only and not outer_on:
            where = outer_names[0] if outer_names else "the modules holding its occurrences"
            mods = uncaptured.get(s.key) or [where]
            code, why = Status.NOT_KEPT if selected else Status.NOT_CAPTURED, \
                f"not patched: its ops lie in {mods[0]}, which holds several captured layers; fused only by the " \
                f"outer capture of {where}, which " + \
                (f"was not used ({outer_refused})" if outer_refused else
                 "selection measured no faster than the layer captures" if selected else
                 "runs only where selection has timed it faster than the layer captures (on a GPU: "
                 "`advisor.optimize`, and `apply` on a script whose steady state is one module call)")
        elif not sites and handle is not None and not getattr(handle, "reached", True):
            code, why = Status.NOT_CALLED, "not patched: no module of the plan was called"
        elif not substituted and handle is not None and _only_trained(handle):
            code, why = Status.NOT_CALLED, ("not patched: every call of the patched modules needed gradients, and those "
                                            "run the original forward unless training is fused "
                                            "(`fusion-advisor apply --train`, `advisor.optimize(model, inputs, "
                                            "train=True)`)")
        elif not substituted and _only_nested(handle, s.key):
            code, why = Status.NOT_CALLED, ("not patched: every call of the modules holding it had a nested-tensor input "
                                            "(PyTorch's nested-tensor fast path, which a capture cannot follow), and "
                                            "those run the original forward, on that fast path (build "
                                            "nn.TransformerEncoder with enable_nested_tensor=False to fuse its layers)")
        elif not substituted and _left_to_inductor(handle, s.key):
            code, why = Status.LEFT_TO_INDUCTOR, ("left to Inductor: pointwise, reduction and norm ops only, which "
                                                  "Inductor fuses with the ops around them (optimize(..., inductor=True))")
        elif not substituted and _escapes(handle, s.key):
            code, why = Status.ESCAPES, ("not patched: its ops are in the captured graphs, but "
                                         f"{_escapes(handle, s.key)[0].describe()}; the fused kernel writes only "
                                         "the pattern's outputs, so it cannot replace these ops")
        elif not substituted:
            rejected = sorted(set(handle.rejected(s.key))) if handle else []
            code, why = Status.NOT_MATCHED, "not patched: its ops were not found in the captured graphs" \
                + (f" ({'; '.join(rejected)})" if rejected else " (the module computes it differently when captured)")
        elif not sites and enabled is not None and s.key not in enabled:
            code, why = Status.NOT_KEPT, "not kept: selection found the model faster without it (its sites run the original ops)"
        elif not sites:
            code, why = Status.NOT_LAUNCHED, (f"not patched: substituted in {substituted} captured graph(s), but the example "
                                       "inputs never ran it (another model's capture, or a guard on shapes/dtypes)")
        out.append(r.with_verdict(code, why))
    # Overlapping patterns: the first in plan order takes the ops (an epilogue extends a pointwise group).
    extends = {c.id: c.extends for c in candidates_of(doc or {})}
    patched = {r.candidate: r for r in out if r.patched}
    taker = {extends[c]: r for c, r in patched.items() if extends.get(c)}  # a base whose epilogue went first (conv)
    for i, r in enumerate(out):
        base = patched.get(extends.get(r.candidate) or "") or taker.get(r.candidate)
        if not r.patched and r.code == Status.NOT_MATCHED and base is not None:
            out[i] = r.with_verdict(Status.OVERLAP,
                                    f"not patched: {base.candidate} ({(base.title or '').split(':')[0]}) took its ops first")
    return out


def _left_to_inductor(handle, key: str) -> bool:
    return handle is not None and any(key in log.left_to_inductor for log in handle._logs(key))


def _escapes(handle, key: str) -> list:
    """The complete matches of a pattern refused because an intermediate of theirs is used outside them
    (`match.Escape`), over every capture of the handle."""
    if handle is None:
        return []
    return list(dict.fromkeys(e for log in handle._logs(key) for e in log.escapes.get(key, [])))


def _only_trained(handle) -> bool:
    """Whether the patched modules were only ever called needing gradients (a training script as it is)."""
    from advisor.patching.forward import TRAINING_CALL  # dynamo, when a patched handle exists anyway

    whys = [w for per_module in handle.fallbacks().values() for w in per_module]
    return TRAINING_CALL in whys and not any(log.graphs for log in handle._logs())


def _only_nested(handle, key: str) -> bool:
    """Whether every (layer) module holding the pattern ran only its original forward, each call having had a
    nested-tensor input (`forward.NESTED_INPUT`: nn.TransformerEncoder's layers behind its nested-tensor fast path),
    never reaching its capture."""
    from advisor.patching.forward import NESTED_INPUT

    handles = getattr(getattr(handle, "session", None), "handles", None) or [handle]  # `apply`: every model's
    forwards = [h.forwards[q] for h in handles for q, _, specs in getattr(h, "modules", ())
                if any(x.key == key for x in specs)]
    forwards = [f for f in forwards if not f.outer]
    return bool(forwards) and all(NESTED_INPUT in f.fallbacks and f._backend is None for f in forwards)


def interpreter_only(records: list[PatternResult], specs: list) -> list[PatternResult]:
    """The results of a run that patches nothing because its kernels would run in the interpreter."""
    validated = {s.candidate for s in specs}
    out = []
    for r in records:
        r = dataclasses.replace(r, sites=0, patched=False)
        if r.candidate in validated:
            r = r.with_verdict(Status.INTERPRETER,
                               "validated, not patched: without a GPU its kernel runs in Triton's interpreter, "
                               "far slower than the model's own ops (interpret=True patches it anyway, for checks)")
        else:
            r = r.with_verdict(r.code or Status.NOT_GENERATED, r.reason or "no kernel")
        out.append(r)
    return out

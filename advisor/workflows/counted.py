"""What a patched model runs, counted on real calls once `optimize`'s checks are over: the report states that,
not what the checks inferred. Reports had contradicted what ran: a report saying nothing was patched on a model
whose later calls launched fused kernels, and "fused training kept as asked" on a model whose layers could not
train fused, where a training step ran no fused site.

`inference`: one call of the example inputs (no_grad, as `optimize` calls), the launches per pattern and patched
instance; `agree` makes each pattern's record say what that call ran. `training`: one training step (forward and
backward, `training.training_call`, the model left as found), its fused site runs; none makes training run the
original forwards, said so."""
from __future__ import annotations

import dataclasses

from advisor.patching import rewrite
from advisor.patching.capture import launched_sites
from advisor.patching.forward import checking
from advisor.records import PatternResult
from advisor.status import Status


def inference(call, handle) -> dict[str, int]:
    """{pattern key: patched instances whose launcher ran} over one call."""
    with _counts_kept(handle):
        before = handle.launches()
        call()
        return launched_sites(before, handle.launches())


def agree(records: list[PatternResult], specs: list, ran: dict[str, int]) -> list[PatternResult]:
    """Each record as the counted call ran it: sites where its kernel launched, not patched where none did."""
    key_of = {s.candidate: s.key for s in specs}
    out = []
    for r in records:
        key = key_of.get(r.candidate)
        n = ran.get(key, 0) if key is not None else 0
        if r.in_use and not n:
            r = dataclasses.replace(r, sites=0, patched=False).with_verdict(
                Status.NOT_LAUNCHED, "not patched: its kernel launched in no call after the checks (counted on one "
                                     f"call of the example inputs; the checks had found {r.sites} site(s))")
        elif n and not r.in_use:
            before = r.verdict.message if r.verdict else "not patched"
            r = dataclasses.replace(r, sites=n, patched=True, kept=True if r.kept is False else r.kept).with_verdict(
                Status.PATCHED, f"patched: its kernel launched at {n} site(s) in a call after the checks (counted), "
                                f"where they had found: {before}")
        elif n:
            r = dataclasses.replace(r, sites=n)
        out.append(r)
    return out


def training(model, handle, args: tuple, kwargs: dict, device: str, labels=None) -> int | None:
    """Fused site runs over one training step of the example inputs; None where no output needs a gradient."""
    from advisor.workflows.training import _grad_leaves, left_as_found, training_call

    with _counts_kept(handle), left_as_found(model, _grad_leaves((args, kwargs)), device):
        step = training_call(model, args, kwargs, labels)
        if step is None:
            return None
        before = rewrite.fused_runs()
        step()
        return rewrite.fused_runs() - before


class _counts_kept:
    """The counting calls are `optimize`'s, not the user's: the forwards' fallback counts are left as they were,
    and they warn nothing."""

    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        self.saved = {f: dict(f.fallbacks) for f in self.handle.forwards.values()}
        self.quiet = checking()
        self.quiet.__enter__()

    def __exit__(self, *exc):
        self.quiet.__exit__(*exc)
        for f, counts in self.saved.items():
            f.fallbacks.clear()
            f.fallbacks.update(counts)

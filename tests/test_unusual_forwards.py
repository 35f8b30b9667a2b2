"""Forwards unlike the zoo's, as general cases of what a sweep of HF architectures outside the zoo found:

- A recurrence unrolled over time (RWKV's WKV loop) profiles as one pointwise chain of hundreds of ops. Its
  search in the captured graphs backtracked across the repeated ops: `optimize` on a tiny RWKV ran for more
  than nine minutes. One search now stops after `match.SEARCH_BUDGET` units of work and the pattern is left
  unpatched with that reason; the title spells out the first and last ops only.
- A call that draws random numbers in eval mode (ViTMAE's masking) was not checked at all, and reported as
  patched nowhere while its kernels ran: it is now checked at the same random draws.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import advisor
from advisor.patching import match


class Recurrence(nn.Module):
    """A decayed running state over the sequence, step by step, as RWKV's eager WKV kernel writes it."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.decay = nn.Parameter(torch.rand(width))
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        state = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):
            state = torch.exp(-self.decay) * state + torch.sigmoid(x[:, t])
            outs.append(state * 2.0 - 1.0)
        return self.proj(torch.stack(outs, 1))


def optimized(make, x, out):
    """(the model optimised, an untouched copy of it, the report): built from one seed, in eval mode."""
    torch.manual_seed(0)
    model = make().eval()
    untouched = copy.deepcopy(model)
    with torch.no_grad():
        report = advisor.optimize(model, (x,), interpret=True, reuse=False, out=out)
    return model, untouched, report


def test_a_long_repeated_chain_is_given_up_not_searched_for_minutes(monkeypatch, tmp_path):
    monkeypatch.setattr(match, "SEARCH_BUDGET", 2000)  # the tiny graph's search, as RWKV's at full size
    x = torch.randn(2, 24, 16)
    model, untouched, report = optimized(Recurrence, x, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(x), untouched(x))
    long = max(report.results, key=lambda r: (r.title or "").count("→"))
    assert "more …" in long.title and long.title.count("→") < 15  # the chain elided in its title
    assert not long.patched and "gave up matching a pattern of" in long.verdict.message, long.verdict


def test_the_budget_stops_one_search(monkeypatch):
    """The budget is per `find`, in units of the mapping each tried node extends: spent, it raises."""
    monkeypatch.setattr(match, "SEARCH_BUDGET", 10)

    class _P:
        compute = [object()] * 3

    budget = match._Budget(_P())
    state = type("S", (), {"p2g": {1: 1, 2: 2}})()
    budget.spend(state)
    budget.spend(state)
    budget.spend(state)
    with pytest.raises(match.SearchTooLong, match="pattern of 3 ops"):
        budget.spend(state)


class RandomMasking(nn.Module):
    """ViTMAE's encoder in small: a random subset of the tokens kept (torch.rand, in eval mode too), then
    residual add + LayerNorm blocks."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])
        self.norms = nn.ModuleList([nn.LayerNorm(width) for _ in range(2)])

    def forward(self, x):
        keep = torch.rand(x.shape[0], x.shape[1]).argsort(1)[:, : x.shape[1] // 2]
        h = torch.gather(x, 1, keep[..., None].expand(-1, -1, x.shape[2]))
        for fc, norm in zip(self.blocks, self.norms):
            h = norm(h + torch.relu(fc(h)))
        return h


def test_a_call_that_draws_random_numbers_is_checked_at_the_same_draws(tmp_path):
    """ViTMAE draws its mask with torch.rand on every call. The check used to skip such a call ("not
    compared"), so optimize reported every pattern at 0 sites while the model stayed patched and its next
    calls ran the kernels unchecked. Both calls of the check now start from one random state: the patterns
    are checked, counted at their sites, and the caller's random stream moves on as for one call."""
    model, untouched, report = optimized(RandomMasking, torch.randn(2, 16, 32), tmp_path)
    x = torch.randn(2, 16, 32)
    assert "same random draws" in report.check["reason"] and report.check["ok"], report.check
    patched = [r for r in report.results if r.patched]
    assert patched and all(r.sites > 0 for r in patched), [(r.title, r.verdict) for r in report.results]
    with torch.no_grad():
        torch.manual_seed(1)
        got = model(x)
        after = torch.rand(1)
        torch.manual_seed(1)
        want = untouched(x)
        assert torch.equal(torch.rand(1), after)  # one call's draws, patched or not
    torch.testing.assert_close(got, want)


def test_a_new_shape_that_fuses_nothing_is_said(tmp_path):
    """A new capture that matched no pattern ran the module's own ops, and `fallbacks()` said nothing (ConvBERT,
    ViTMAE, LeViT in the sweep). It says so now. Row kernels serve new batches and lengths (`patching.resize`);
    GroupNorm's kernel holds its channels per group as constants, so at batch 3 after batch 2 nothing matches."""
    from advisor.patching.forward import UNPROFILED

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.norm = nn.Conv2d(8, 8, 1), nn.GroupNorm(2, 8)

        def forward(self, x):
            return torch.nn.functional.silu(self.norm(self.conv(x)) + x)

    model, untouched, report = optimized(Block, torch.randn(2, 8, 6, 6), tmp_path)
    with torch.no_grad():
        assert [r for r in report.results if r.patched]
        assert not any(UNPROFILED in why for why in report.handle.fallbacks().values())
        other = torch.randn(3, 8, 6, 6)
        torch.testing.assert_close(model(other), untouched(other))
    said = [why for why in report.handle.fallbacks().values() if UNPROFILED in why]
    assert said, report.handle.fallbacks()

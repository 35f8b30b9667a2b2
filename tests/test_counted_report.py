"""What `optimize`'s report says runs is what a call runs, counted after its checks: per pattern the sites whose
kernel launched in one call, and for fused training the fused site runs of one real training step (a model whose
layers cannot train fused had been reported "fused training kept as asked" while its steps ran none)."""
from __future__ import annotations

import warnings

import torch

import advisor
from advisor.patching import rewrite
from advisor.patching.capture import launched_sites
from test_users_models import batch, llama  # (pytest puts tests/ on sys.path)


def conv_stack() -> torch.nn.Module:
    """Conv -> BatchNorm -> ReLU twice: fused as cuDNN conv epilogues, which have no backward."""
    torch.manual_seed(0)
    layers = []
    for c_in, c_out in ((3, 8), (8, 8)):
        layers += [torch.nn.Conv2d(c_in, c_out, 3, padding=1), torch.nn.BatchNorm2d(c_out), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).eval()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model


def test_training_that_runs_no_fused_site_is_not_reported_kept(tmp_path):
    model, x = conv_stack(), torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = advisor.optimize(model, (x,), out=tmp_path, reuse=False, interpret=True, train=True)
        assert report.applied, report
        fused = rewrite.fused_runs()
        model.train()
        model(x).sum().backward()
    assert rewrite.fused_runs() == fused  # a real step runs no fused site ...
    assert report.training["kept"] is False and report.training["fused_per_step"] == 0, report.training
    assert "ran no fused site" in str(report)  # ... and the report says so


def test_the_report_counts_what_a_call_after_the_checks_launches(tmp_path):
    model = llama(layers=2)
    report = advisor.optimize(model, batch(), out=tmp_path, reuse=False, interpret=True)
    before = report.handle.launches()
    with torch.no_grad():
        model(**batch())
    ran = launched_sites(before, report.handle.launches())
    assert report.runs["sites"] == ran and report.runs["fused_launches_per_call"] == sum(ran.values()) > 0
    by_key = {s.candidate: s.key for s in report.handle.plan.patterns}
    for r in report.results:
        assert r.in_use == bool(ran.get(by_key.get(r.candidate), 0)), r
        if r.in_use:
            assert r.sites == ran[by_key[r.candidate]]
    assert f"runs: {sum(ran.values())} fused kernel launch(es) per call" in str(report)

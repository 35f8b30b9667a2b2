"""The `FUSION_ADVISOR_*` variables (`advisor.config`): every one the package names is defined and documented
there and in docs/CONFIG.md, and the one accessor sees a variable set after import."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from advisor import config
from advisor.errors import AdvisorError

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"FUSION_ADVISOR_[A-Z_]*[A-Z]")


def test_every_variable_the_package_names_is_defined_and_documented():
    named = {m for p in (ROOT / "advisor").rglob("*.py") for m in NAME.findall(p.read_text())}
    documented = set(NAME.findall((ROOT / "docs" / "CONFIG.md").read_text()))
    assert named - set(config.VARIABLES) == set(), "named in the package, missing from advisor.config.VARIABLES"
    assert set(config.VARIABLES) - documented == set(), "in advisor.config, missing from docs/CONFIG.md"
    assert all(v.default and v.meaning for v in config.VARIABLES.values())


def test_a_variable_set_after_import_is_seen(monkeypatch, tmp_path):
    monkeypatch.setenv(config.CACHE, str(tmp_path))
    monkeypatch.setenv(config.CUDA_GRAPHS, "0")
    assert config.current().cache_root == tmp_path and not config.current().cuda_graphs
    monkeypatch.delenv(config.CUDA_GRAPHS)
    assert config.current().cuda_graphs
    assert config.current() is config.current()  # read again only when a variable changed
    monkeypatch.setenv(config.COMPILE_WORKERS, " 3 ")
    assert config.reload().compile_workers == 3


def test_a_bad_value_is_refused_where_it_is_used(monkeypatch):
    monkeypatch.setenv(config.PROFILE_CALLS, "three")
    cfg = config.current()
    assert cfg.cuda_graphs in (True, False)  # the other variables still read
    with pytest.raises(AdvisorError, match="FUSION_ADVISOR_PROFILE_CALLS must be a whole number"):
        cfg.profile_calls

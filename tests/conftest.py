"""Test-wide setup. Triton reads TRITON_INTERPRET when it is first imported, so it is set here,
before any test module imports triton: without a GPU every generated kernel runs in the interpreter."""
import os
import shutil
import tempfile

import pytest

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One fresh kernel/plan cache per test session, as in CI: a plan or validation an earlier session left in
# ~/.cache would otherwise be reused and change what the tests see (tests that need their own set it).
_SESSION_CACHE = None
if "FUSION_ADVISOR_CACHE" not in os.environ:
    _SESSION_CACHE = os.environ["FUSION_ADVISOR_CACHE"] = tempfile.mkdtemp(prefix="fusion-advisor-test-cache-")


def pytest_sessionfinish(session, exitstatus):
    """The session's cache goes with it: every run left one more folder in the temp directory."""
    if _SESSION_CACHE:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture
def keep_traced_masks(monkeypatch):
    """Causal masks a capture builds stay unfolded (`advisor.patching.causal_masks` off). The example Llama's one
    pattern only the whole stack fuses is HF's packed-sequence check (cat, sub, ne, cumsum over the positions),
    which feeds the causal mask HF builds while dynamo traces, and is folded away with it: tests of selection's
    bookkeeping for such patterns keep it, to have one to mark."""
    from advisor.patching import capture

    monkeypatch.setattr(capture, "fold_causal_masks", lambda gm: 0)

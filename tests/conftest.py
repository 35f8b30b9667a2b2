"""Test-wide setup. Nothing sets TRITON_INTERPRET: without a GPU our kernels run in Triton's interpreter
because they are launched on CPU tensors (`advisor.interpreter`), as in a user's process."""
import os
import shutil
import tempfile

import pytest

# Inductor's C++ code unvectorised in tests (`cpp.simdlen = 1`): the same ops and values, without its choice of
# vector tiling, which simplifies every index expression with sympy and at symbolic sizes took over 20 minutes for
# one Funnel layer's dynamic-shape compile on this CPU (test_zoo's shapes past the budget).
if os.environ.get("FUSION_ADVISOR_TEST_VECTORISED") != "1":
    import torch._inductor.config

    torch._inductor.config.cpp.simdlen = 1

# One fresh kernel/plan cache per test session, as in CI: a plan or validation an earlier session left in
# ~/.cache would otherwise be reused and change what the tests see (tests that need their own set it).
_SESSION_CACHE = None
if "FUSION_ADVISOR_CACHE" not in os.environ:
    _SESSION_CACHE = os.environ["FUSION_ADVISOR_CACHE"] = tempfile.mkdtemp(prefix="fusion-advisor-test-cache-")


def pytest_terminal_summary(terminalreporter):
    """The zoo's rotation, printed last (also under -q), so that a run can be repeated (FUSION_ADVISOR_ZOO_SEED)."""
    terminalreporter.write_line(zoo_rotation())


def zoo_rotation() -> str:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_zoo import QUICK, rotation

    want = os.environ.get("FUSION_ADVISOR_ZOO", "").strip()
    if want:
        return f"zoo: FUSION_ADVISOR_ZOO={want}"
    seed, k, chunks, chosen = rotation()
    return (f"zoo: FUSION_ADVISOR_ZOO_SEED={seed} (chunk {k} of {chunks}: {', '.join(sorted(chosen))}; "
            f"and every run: {', '.join(QUICK)})")


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
    import weakref

    from advisor.patching import capture

    monkeypatch.setattr(capture, "fold_causal_masks", lambda gm: 0)
    # Graphs compiled with the masks folded are not served here, nor these after it: captures of one plan and
    # code share a graph (`capture._SHARED`) while any of them is alive, and a model's earlier capture can
    # outlive its last use until the cycle collector's next full run (dynamo's tracing leaves cycles, an
    # AttributeError's traceback among them, whose frames reach the patched forward that compiled); after
    # several test modules that run came later, and the whole stack ran the folded graph.
    monkeypatch.setattr(capture, "_SHARED", weakref.WeakValueDictionary())

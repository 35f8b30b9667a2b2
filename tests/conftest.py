"""Test-wide setup. Triton reads TRITON_INTERPRET when it is first imported, so it is set here,
before any test module imports triton: without a GPU every generated kernel runs in the interpreter."""
import os
import shutil
import tempfile

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One fresh kernel/plan cache per test session, as in CI: a plan or validation an earlier session left in
# ~/.cache would otherwise be reused and change what the tests see (tests that need their own set it).
os.environ.setdefault("FUSION_ADVISOR_CACHE", tempfile.mkdtemp(prefix="fusion-advisor-test-cache-"))

"""Test-wide setup. Triton reads TRITON_INTERPRET when it is first imported, so it is set here,
before any test module imports triton: without a GPU every generated kernel runs in the interpreter."""
import os
import shutil

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

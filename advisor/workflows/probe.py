"""`optimize(..., isolate=True)`: the first `optimize` of a model run in a child process, where the model's own code
may crash the interpreter (a native fast path or a C extension it calls: SIGSEGV, an abort).

The model and example inputs go to a spawned child through a temporary file (`torch.save`); the child runs the
whole `optimize` on them (profile, analysis, kernels, first capture, the checks' fused calls) and exits. All the
parent reads of it is how it ended: exited 0 (it survived, Python errors included, which the parent's own run
meets and reports as it always does), killed by a signal, or another exit status. Survived: the parent runs
`optimize` itself, reusing the child's kernels and stored plan from the on-disk cache. Crashed: the parent leaves
the model unpatched, as it was, and stores why (`ProbeOutcome.decision`, in the report and apply.json). A model or
inputs that cannot be pickled, or that a fresh process cannot load (a class defined in `__main__`), are not
isolated: said so, and `optimize` runs in this process.

Off by default: a probe costs a fresh interpreter (torch's import, the model written to disk and read back, its
capture made twice), and a crash in a model's own path during capture is rare: the one seen (PyTorch's
nested-tensor fast path) is avoided in process (`fast_paths`). For models calling native code of their own
(custom CUDA extensions, third-party fused ops): `isolate=True`, or $FUSION_ADVISOR_ISOLATE=1 for every optimize.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from advisor import config
from advisor.errors import exception_reason

ENV = config.ISOLATE
IN_PROBE = config.PROBE  # set in the child's environment: a model's code can tell it runs there
UNLOADABLE = 86  # the child's exit status when it could not load what it was handed


@dataclass(frozen=True)
class ProbeOutcome:
    """How the first `optimize` in a child process ended, in words (`decision`) and as the child's end."""

    crashed: bool  # the child died: the model stays unpatched
    decision: str
    returncode: int | None = None  # None: no child was run
    signal: str | None = None
    stderr_tail: str = ""

    def to_json(self) -> dict:
        return {"crashed": self.crashed, "decision": self.decision, "returncode": self.returncode,
                "signal": self.signal, "stderr_tail": self.stderr_tail}


def wanted(isolate: bool | None) -> bool:
    """Whether this `optimize` probes first: as asked, else as $FUSION_ADVISOR_ISOLATE says (off when unset)."""
    if isolate is not None:
        return bool(isolate)
    return config.current().isolate


def in_probe() -> bool:
    """Whether this process is an isolated first capture's child."""
    return config.current().in_probe


def first_capture(model: torch.nn.Module, example_inputs, options: dict) -> ProbeOutcome:
    """`optimize(model, example_inputs, **options)` run in a spawned child; how it ended."""
    with tempfile.TemporaryDirectory(prefix="fusion-advisor-probe-") as tmp:
        handed = Path(tmp) / "model.pt"
        try:
            torch.save({"model": model, "inputs": example_inputs,
                        "options": {**options, "out": str(Path(tmp) / "out")}}, handed)
        except Exception as e:  # noqa: BLE001  (a lambda, a lock, an open file among the model's attributes)
            return ProbeOutcome(False, f"not isolated: the model or its inputs cannot be pickled "
                                       f"({exception_reason(e)}); the first capture ran in this process")
        env = {**os.environ, IN_PROBE: "1",
               "PYTHONPATH": os.pathsep.join(p for p in [*sys.path, os.environ.get("PYTHONPATH", "")] if p)}
        done = subprocess.run([sys.executable, "-m", "advisor.workflows.probe_child", str(handed)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=os.getcwd())
    return outcome(done.returncode, done.stderr.decode(errors="replace"))


def outcome(returncode: int, stderr: str) -> ProbeOutcome:
    tail = "\n".join(stderr.strip().splitlines()[-5:])
    if returncode == 0:
        return ProbeOutcome(False, "isolated: the first capture ran in a probe process, which survived",
                            returncode, stderr_tail=tail)
    if returncode == UNLOADABLE:
        last = tail.splitlines()[-1] if tail else "no reason given"
        return ProbeOutcome(False, f"not isolated: a fresh process could not load the model ({last}); the first "
                                   "capture ran in this process", returncode, stderr_tail=tail)
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return ProbeOutcome(True, f"nothing patched: the first capture crashed a probe process ({name}), in the "
                                  "model's own code or ours: left unpatched", returncode, name, tail)
    return ProbeOutcome(True, f"nothing patched: the first capture ended a probe process with exit status "
                              f"{returncode}: left unpatched", returncode, stderr_tail=tail)

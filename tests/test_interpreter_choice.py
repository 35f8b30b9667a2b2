"""Where kernels run is decided per launch from the tensors' device (`advisor.interpreter`), whatever was
imported first and with nothing set in the environment: our kernels launched on CPU tensors run in Triton's
interpreter, and the user's own `@triton.jit` kernels stay Triton's JIT functions. Each case runs in a fresh
process, where the order of the imports is the one under test."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

MODEL = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(32, 32), nn.LayerNorm(32)

    def forward(self, x):
        return torch.softmax(self.norm(x + torch.relu(self.fc(x))) * 2.0, dim=-1)


torch.manual_seed(0)
model = nn.Sequential(Block(), Block()).eval()
x = torch.randn(2, 16, 32)
"""

USERS_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def users_helper(x):
    return x + 1


@triton.jit
def users_kernel(X, BLOCK: tl.constexpr):
    tl.store(X + tl.arange(0, BLOCK), users_helper(tl.load(X + tl.arange(0, BLOCK))))


print("USERS", type(users_kernel).__name__, type(users_helper).__name__)
try:
    users_helper(1)  # outside a kernel, Triton's JIT function refuses the call: nothing left swapped
except RuntimeError as e:
    print("CALL", e)
print("KNOB", triton.knobs.runtime.interpret, "ENV", os.environ.get("TRITON_INTERPRET"))
"""


def _run(code: str, tmp_path, env_extra: dict | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update({"PYTHONPATH": str(ROOT), "FUSION_ADVISOR_CACHE": str(tmp_path / "cache"), **(env_extra or {})})
    script = tmp_path / "script.py"  # a file: Triton's JIT reads a kernel's source from it
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the launches on CPU tensors, without a GPU")
def test_triton_imported_before_advisor_still_patches_and_runs_fused_in_the_interpreter(tmp_path):
    code = ("import os, sys\n"
            "import triton, triton.language  # first, as transformers would\n"
            "import advisor\n" + MODEL +
            "with torch.no_grad():\n"
            "    want = model(x)\n"
            "report = advisor.optimize(model, (x,), interpret=True, reuse=False, out='out')\n"
            "before = report.handle.launches()\n"
            "with torch.no_grad():\n"
            "    got = model(x)\n"
            "launched = sum(n - before.get(k, 0) for k, n in report.handle.launches().items())\n"
            "print('LAUNCHED', launched)\n"
            "torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)\n"
            "print('SAME')\n" + USERS_KERNEL)
    out = _run(code, tmp_path)
    launched = int(next(line for line in out.splitlines() if line.startswith("LAUNCHED")).split()[1])
    assert launched > 0, out
    assert "SAME" in out, out
    # after our kernels ran in the interpreter, the user's kernels are still JIT functions, nothing left swapped
    assert "USERS JITFunction JITFunction" in out, out
    assert "CALL Cannot call @triton.jit'd outside of the scope of a kernel" in out, out
    assert "KNOB False ENV None" in out, out


def test_a_users_kernel_defined_after_import_advisor_is_not_interpreted(tmp_path):
    out = _run("import os\nimport advisor\nimport torch\n" + USERS_KERNEL, tmp_path)
    assert "USERS JITFunction JITFunction" in out, out
    assert "KNOB False ENV None" in out, out  # `import advisor` set nothing


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the launches on CPU tensors, without a GPU")
def test_triton_interpret_set_by_the_user_after_triton_was_imported_still_runs_reductions(tmp_path):
    """The user's TRITON_INTERPRET=1, set after triton was imported: our kernels are then the interpreter's
    own functions, while tl.sum / tl.max are still JIT functions; a launch interprets those too."""
    code = ("import os\n"
            "import triton.language\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "import torch\n"
            "from advisor.codegen import generate, load_module\n"
            "from advisor.codegen.record import record_program\n"
            "x, w, b = torch.randn(6, 40), torch.randn(40), torch.randn(40)\n"
            "fn = lambda x, w, b: torch.softmax(torch.nn.functional.layer_norm(x, (40,), w, b), -1)\n"
            "mod = load_module(generate(record_program(fn, x, w, b), use_cache=False).path)\n"
            "kernels = [v for v in vars(mod).values() if type(v).__name__ == 'InterpretedFunction']\n"
            "print('KERNELS', len(kernels))\n"
            "out = mod.run(x, w, b)\n"
            "out = out[0] if isinstance(out, (tuple, list)) else out\n"
            "torch.testing.assert_close(out, fn(x, w, b), rtol=1e-5, atol=1e-6)\n"
            "print('SAME')\n")
    out = _run(code, tmp_path)
    assert "KERNELS 0" not in out and "SAME" in out, out

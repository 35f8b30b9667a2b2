"""What to do next, as exact commands: the last thing both reports say.

A candidate that an existing PyTorch switch already fuses gets that switch (a fused optimizer, SDPA)
before any generated kernel; otherwise the next stage of the pipeline, with the user's own script,
arguments and output directory filled in (from meta.json beside the trace, when it is there).
"""
from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path
from typing import List, NamedTuple, Optional

from advisor.records import Candidate, Kind
from advisor.report import model as M
from advisor.units import fmt_time


class Step(NamedTuple):
    text: str  # one sentence
    code: str  # the command or the line of Python to run ("" when there is none)


OPTIMIZER_OPS = {"addcdiv", "addcmul", "lerp", "_foreach_addcdiv", "_foreach_lerp", "_foreach_mul", "_fused_adamw"}


def _op_names(c: Candidate) -> set:
    return {str(o).split("::")[-1].rstrip("_") for o in c.ops}


def _existing_fixes(cands: List[Candidate]) -> List[Step]:
    steps = []
    if any(_op_names(c) & OPTIMIZER_OPS for c in cands):
        steps.append(Step("The optimizer's update runs op by op: PyTorch's fused optimizer does it in one kernel.",
                          "torch.optim.AdamW(model.parameters(), lr=lr, fused=True)  # also Adam, SGD"))
    if any(c.kind == Kind.ATTENTION for c in cands):
        steps.append(Step("Attention materialises its score matrix: scaled_dot_product_attention never does.",
                          "torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)"))
    return steps


def _math_attention(analysis: dict) -> List[Step]:
    """Attention that ran SDPA's math backend (analysis.json's `math_attention`): the costliest first."""
    steps = []
    total = M.num((analysis.get("totals") or {}).get("time_us"), 0.0)
    for e in analysis.get("math_attention") or []:
        us = M.num(e.get("time_us"), 0.0)
        share = f" ({us / total:.0%})" if total else ""
        ran = (f"Attention ran SDPA's math backend: {fmt_time(us)} per iteration{share}, "
               f"{M.num(e.get('kernels_per_call'), 0):.0f} kernels a call, the scores through memory in fp32")
        strided = [i for i in e.get("strided_inputs") or [] if isinstance(i, dict)]
        if strided:
            what = ", ".join(f"{i.get('name')} {tuple(i.get('shape') or ())} has a last dimension of stride "
                             f"{i.get('last_stride')}" for i in strided)
            steps.append(Step(f"{ran}. Its {what}, which every fused attention kernel refuses: optimize and apply "
                              "lay it out in the graphs they capture; by hand, make it contiguous before the call.",
                              "; ".join(f"{i.get('name')} = {i.get('name')}.contiguous()" for i in strided)
                              + "  # before scaled_dot_product_attention"))
        else:
            steps.append(Step(f"{ran}. The trace does not show why (a dtype, head size or mask the fused kernels do "
                              "not take): asking for one fused kernel makes SDPA say why it refuses.",
                              "with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):"
                              "  model(**inputs)"))
    return steps


def _script_command(analysis: dict, out: Optional[Path]) -> Optional[str]:
    """`fusion-advisor apply SCRIPT --out OUT -- ARGS` for the script the trace came from, if meta.json says."""
    recorded = (analysis.get("source") or {}).get("meta")  # as the analyzer was given it: maybe relative
    meta = {}
    for path in ([Path(out) / "trace" / "meta.json"] if out else []) + ([Path(recorded)] if recorded else []):
        try:
            meta = json.loads(path.read_text())
            break
        except (OSError, ValueError):
            continue
    script = meta.get("script")
    if not script or meta.get("in_process"):
        return None
    named = [] if _is_the_demo(script) else [script]  # `apply` runs the demo by default
    cmd = ["fusion-advisor", "apply", *named, "--out", str(out or "advisor_out")] + \
        (["--train"] if _trains(analysis, M.candidates(analysis)) else [])
    if meta.get("args"):
        cmd += ["--", *map(str, meta["args"])]
    return shlex.join(cmd)


def _is_the_demo(script: str) -> bool:
    """Whether `script` is the bundled demo workload: its installed path is not one to print (site-packages, or
    a checkout an editable install points at, which a reinstall moves)."""
    demo = importlib.util.find_spec("advisor.demo_workload")  # found, not imported (it imports torch)
    try:
        return bool(demo and demo.origin) and Path(script).resolve() == Path(demo.origin).resolve()
    except OSError:
        return False


def next_steps(analysis: dict, apply: Optional[dict] = None, out: Optional[Path] = None) -> List[Step]:
    cands = M.listed(analysis)
    steps = _math_attention(analysis)
    if not cands:
        return steps
    top = cands[:10]
    steps += _existing_fixes(top)
    where = str(out) if out else "OUT"
    cpu = (analysis.get("totals") or {}).get("time_kind") == "cpu"
    if isinstance(apply, dict) and "end_to_end" in apply:
        sp = M.speedup(apply)
        if sp is not None and sp > 1:
            steps.append(Step(f"Apply made it {sp:.2f}× faster: patch the same model in your own code.",
                              f'advisor.patch(model, "{where}")'))
        elif sp is not None:
            steps.append(Step(f"Apply made it slower ({sp:.2f}×): leave the model as it is, or try torch.compile.",
                              "model = torch.compile(model)"))
        else:
            steps.append(Step("The kernels were checked, not timed (no GPU): run apply on a GPU to see what they save.",
                              _script_command(analysis, out) or f"fusion-advisor apply SCRIPT --out {where}"))
        return steps
    if isinstance(apply, dict):  # generate ran: kernels validated, nothing patched yet
        steps.append(Step("Patch the validated kernels into the model and time it.",
                          _script_command(analysis, out) or f"fusion-advisor apply SCRIPT --out {where}"))
        return steps
    n = min(5, len(cands))
    cmd = _script_command(analysis, out)
    steps.append(Step(f"Generate, validate and patch in kernels for the top {n}, then time the model"
                      + (" (on the CPU they are checked, not timed: use a GPU for timings)." if cpu else "."),
                      cmd or f"fusion-advisor generate {where} --top {n}"))
    if _trains(analysis, cands):
        steps.append(Step("Or in your own process, on the model itself; train=True fuses the backward too (kept only "
                          "where a training call measures faster).",
                          f"report = advisor.optimize(model, example_inputs, top={n}, train=True)"))
    else:
        steps.append(Step("Or in your own process, on the model itself.",
                          f"report = advisor.optimize(model, example_inputs, top={n})"))
    return steps


def _trains(analysis: dict, cands: List[Candidate]) -> bool:
    """Whether the profiled script trains: its steady state is training steps, or a backward ran in it."""
    return bool((analysis.get("steady_state") or {}).get("training_step")) or any(c.phase for c in cands)

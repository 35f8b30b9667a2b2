"""Plans kept on disk per model and inputs, so a second `optimize` of the same model starts warm.

`optimize` stores its finished plan (analysis.json, apply.json, the validated kernels) under the
kernel cache's sibling `plans/<fingerprint>/`. The fingerprint covers what the plan depends on: the
model's module tree (classes and qualified names), each module's plain settings and those of the
configuration objects it holds (an HF config's `_attn_implementation` changes the forward, not the
shapes), its parameters' and buffers' names, shapes, dtypes and devices, the inputs' shapes, dtypes,
strides and non-tensor values, the device's name, the options, and the digest of fusion-advisor's own
source. Weights' values are not in it: a plan is about shapes, and every reuse is checked against the
unpatched model's outputs again.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

from advisor.codegen.cache import cache_dir
from advisor.documents import ANALYSIS_FILE, APPLY_FILE, AnalysisDoc, ApplyDoc, write_analysis, write_apply

FILES = (ANALYSIS_FILE, APPLY_FILE)
WRITE = {ANALYSIS_FILE: lambda d, doc: write_analysis(d, AnalysisDoc.from_json(doc)),
         APPLY_FILE: lambda d, doc: write_apply(d, ApplyDoc.from_json(doc))}
_SOURCE = None


def _source_digest() -> str:
    global _SOURCE
    if _SOURCE is None:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
        _SOURCE = h.hexdigest()[:16]
    return _SOURCE


def fingerprint(model: torch.nn.Module, args: tuple, kwargs: dict, device: str, options: dict,
                parts: dict | None = None) -> str:
    """The plan's key. `parts` (if given) receives a short digest per section, to tell why two keys differ."""
    h = hashlib.sha256()
    section = {}

    def put(kind, *rest):
        text = repr((kind, *rest)).encode()
        h.update(text)
        section.setdefault(kind, hashlib.sha256()).update(text)

    put("advisor", _source_digest(), torch.__version__, sorted(options.items()))
    put("device", torch.cuda.get_device_name() if device == "cuda" else "cpu")
    # autocast changes every traced op's dtype (a plan profiled without it found other patterns, its kernels
    # other dtypes): a call made inside `torch.autocast` has a plan of its own
    put("autocast", torch.is_autocast_enabled(device), str(torch.get_autocast_dtype(device)))
    configs: dict = {}
    for name, mod in model.named_modules():
        put("module", name, type(mod).__module__, type(mod).__qualname__, mod.training, settings(mod))
        for v in vars(mod).values():
            if hasattr(v, "to_dict") and not isinstance(v, (torch.nn.Module, torch.Tensor, dict)):
                configs.setdefault(id(v), v)
    config_settings = [(type(c).__qualname__, settings(c)) for c in configs.values()]
    for name, text in sorted({(name, repr(st)) for name, st in config_settings}):
        put("config:" + name, text)  # by content: which objects are shared does not matter
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        put("tensor", name, tuple(t.shape), str(t.dtype), t.device.type)
    leaves, spec = tree_flatten((args, kwargs))
    put("inputs", str(spec))
    for x in leaves:
        if isinstance(x, torch.Tensor):
            put("inputs", tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.type)
        else:
            put("inputs", repr(x)[:200])
    if parts is not None:
        parts.update({k: v.hexdigest()[:8] for k, v in section.items()})
        parts["config_settings"] = {name: dict(st) for name, st in config_settings}
    return h.hexdigest()[:24]


_PLAIN = (bool, int, float, str, type(None))


def settings(obj) -> list:
    """An object's plain attributes (numbers, strings, flags, and tuples of them), sorted by name."""
    out = []
    for k, v in sorted(vars(obj).items()):
        if "hash" in k:  # e.g. GenerationConfig._original_object_hash: Python's salted hash, new per process
            continue
        if isinstance(v, _PLAIN) or (isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v)):
            out.append((k, repr(v)[:200]))
    return out


def plan_dir(key: str) -> Path:
    return cache_dir().parent / "plans" / key


def store(out_dir: Path, key: str) -> Path:
    """Copy OUT's plan into the cache (kernel paths rewritten to the copy); returns the copy's folder."""
    return copy_plan(Path(out_dir), plan_dir(key))


def fetch(key: str, out_dir: Path) -> bool:
    """Copy a stored plan into OUT (kernel paths rewritten to OUT); False when there is none."""
    src = plan_dir(key)
    if not all((src / f).is_file() for f in FILES):
        return False
    copy_plan(src, Path(out_dir))
    return True


def copy_plan(src: Path, dst: Path) -> Path:
    """Copy the plan in `src` (analysis.json, apply.json, kernels/) into `dst`, kernel paths rewritten to the copy."""
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / ".plan.tmp"  # inside the destination: nothing is written next to a user's OUT
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    kernels = sorted(p.name for p in (src / "kernels").glob("*.py")) if (src / "kernels").is_dir() else []
    if kernels:
        shutil.copytree(src / "kernels", tmp / "kernels")
    new = str(dst.resolve() / "kernels")
    for name in FILES:
        text = (src / name).read_text()
        if '"kernel_file"' in text:
            WRITE[name](tmp, _rebase(json.loads(text), set(kernels), new))
        else:  # nothing to point at the copy (analysis.json): copied as it is, not parsed and written again
            (tmp / name).write_text(text)
    for name in ("kernels", *FILES):  # into place: a concurrent reader sees the old plan or the new one
        target = dst / name
        if target.is_dir():
            shutil.rmtree(target)
        if (tmp / name).exists():
            (tmp / name).replace(target)
    shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _rebase(doc, kernels: set, new: str):
    """Every `kernel_file` naming one of the copied kernels, pointed at the copy."""
    if isinstance(doc, dict):
        return {k: (f"{new}/{Path(v).name}" if k == "kernel_file" and isinstance(v, str) and Path(v).name in kernels
                    else _rebase(v, kernels, new)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_rebase(v, kernels, new) for v in doc]
    return doc

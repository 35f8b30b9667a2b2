"""Portable plan bundles: a plan and its kernels' compiled Triton binaries in one file.

`save` zips an `optimize`/`apply` output folder's plan (analysis.json, apply.json, kernels/*.py) with
the entries of Triton's cache that hold those kernels' binaries, and a header of what they were built
with (torch, triton, Python, GPU name and capability, fusion-advisor). `load` unpacks the plan into
the cache folder and, where this machine matches the header, copies the binaries into Triton's cache,
so that patching with it compiles nothing; where it does not, it says so in one line and the kernels
compile on first use, as they would from a plan folder. It also carries the inference graphs AOTAutograd
lowered for the plan's captures (`patching/aot_cache.py`), which a fresh process then rebuilds instead of
lowering them again (keyed by torch's version, among other things: another torch's are never used).

Which cache entries: Triton names each entry's files after the kernel (`__grp__<name>.json`), and a
plan's kernel names come from its sources, so an entry of every specialisation that ran (the
validation shapes and the model's own) is found without knowing Triton's cache keys. An entry of
another plan's kernel of the same name comes along too: harmless, as Triton looks entries up by key.

Host modules: Triton (3.6 on the lent GPU) launches each kernel through a C module built by gcc on first
use, one per argument signature, and its CUDA utilities likewise, into the same cache. A fresh cache
builds them again at the first launches, half a second or more each (a Llama bundle's first call spent
1.7 s recording its graphs against 0.15 s with a warm cache). Their cache keys hash Triton's generated C
source, which only Triton knows; so the entries are taken from what this process loaded
(`loaded_host_modules`: the shared objects mapped into it from Triton's cache), recorded in apply.json
(`host_modules`) when `optimize` or `apply` ends (the script ran in that process) and read again when the
bundle is written. Each is keyed by
its source and platform, and named for the Python it was built for: a module of another is never loaded.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

from advisor.codegen.cache import cache_dir
from advisor.documents import APPLY_FILE
from advisor.errors import AdvisorError, not_writable
from advisor.interpreter import forced
from advisor.jsonio import like_a_new_file
from advisor.workflows.plan_cache import FILES, copy_plan

FORMAT = 1
MATCH = ("torch", "triton", "gpu", "capability")  # what a compiled binary depends on
_JIT_NAME = re.compile(r"^@triton\.jit\s*\ndef\s+(\w+)\s*\(", re.M)

log = logging.getLogger(__name__)


def environment() -> dict:
    """What this process would build binaries with."""
    import platform

    import torch
    import triton

    from advisor.version import __version__

    gpu = torch.cuda.is_available() and not forced()
    return {"format": FORMAT, "advisor": __version__, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if gpu else None,
            "capability": list(torch.cuda.get_device_capability()) if gpu else None}


def triton_cache_root() -> Path:
    try:
        from triton import knobs  # triton >= 3.4

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        from triton.runtime.cache import default_cache_dir  # older triton

        return Path(os.environ.get("TRITON_CACHE_DIR") or default_cache_dir())


def kernel_names(plan_dir: Path) -> set:
    """The names of the `@triton.jit` functions in a plan's kernel sources."""
    names = set()
    for f in sorted((plan_dir / "kernels").glob("*.py")):
        names.update(_JIT_NAME.findall(f.read_text()))
    return names


def binary_entries(names: set, root: Path | None = None) -> list[Path]:
    """Triton cache entries (folders) holding a compiled kernel named in `names`, sorted."""
    root = root or triton_cache_root()
    if not names or not root.is_dir():
        return []
    wanted = {f"__grp__{n}.json" for n in names}
    return sorted(d for d in root.iterdir() if d.is_dir() and wanted & set(os.listdir(d)))


def loaded_host_modules(root: Path | None = None, maps: Path = Path("/proc/self/maps")) -> list[str]:
    """Triton cache entries (names) holding a shared object this process has loaded (see the docstring
    above: kernel launchers, CUDA utilities). Empty where the process map cannot be read (not Linux)."""
    try:
        root = (root or triton_cache_root()).resolve()
        lines = maps.read_text().splitlines()
    except (OSError, RuntimeError):
        return []
    out, inside = set(), f"{root}/"
    for line in lines:
        if inside not in line or not line.endswith(".so"):  # (a process maps thousands of files: torch's, CUDA's)
            continue
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path (a mapped file's)
        path = Path(fields[5].strip()) if len(fields) == 6 else None
        if path and path.suffix == ".so" and path.is_relative_to(root) and len(path.relative_to(root).parts) == 2:
            out.add(path.relative_to(root).parts[0])
    return sorted(out)


def host_module_entries(folder: Path, root: Path | None = None) -> list[Path]:
    """The host modules' entries to carry: those the plan's run loaded (apply.json `host_modules`) and those
    this process has, still in Triton's cache."""
    root = root or triton_cache_root()
    try:
        named = json.loads((folder / APPLY_FILE).read_text()).get("host_modules") or []
    except (OSError, json.JSONDecodeError):
        named = []
    names = {n for n in named if isinstance(n, str) and Path(n).name == n} | set(loaded_host_modules(root))
    return sorted(root / n for n in names if (root / n).is_dir())


def plan_folder(plan) -> Path:
    """The output folder of an `OptimizeReport`, or a folder given as is (OUT or the folder holding it)."""
    folder = Path(getattr(plan, "out_dir", plan))
    if not all((folder / f).is_file() for f in FILES):
        raise AdvisorError(f"{folder} holds no plan (analysis.json and apply.json from `optimize` or `apply`)")
    return folder


def save(plan, path) -> Path:
    """Write `plan` (an `OptimizeReport` or its output folder) and its kernels' binaries to `path`."""
    folder, path = plan_folder(plan), Path(path)
    header = environment()
    entries = binary_entries(kernel_names(folder)) if header["gpu"] else []
    header["binaries"] = [d.name for d in entries]
    hosts = host_module_entries(folder) if header["gpu"] else []
    header["host_modules"] = [d.name for d in hosts]
    entries = entries + [d for d in hosts if d not in entries]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise not_writable(path, e) from None
    like_a_new_file(fd)
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("header.json", json.dumps(header, indent=1))
            for name in FILES:
                z.write(folder / name, f"plan/{name}")
            for f in sorted((folder / "kernels").glob("*.py")):
                z.write(f, f"plan/kernels/{f.name}")
            for d in entries:
                for f in sorted(d.iterdir()):
                    if f.is_file() and f.name != "lock":
                        z.write(f, f"triton/{d.name}/{f.name}")
            for f in graph_files(folder):
                z.write(f, f"graphs/{f.name}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def graph_files(folder: Path) -> list[Path]:
    """The lowered inference graphs the plan's captures used (apply.json `graphs`, `aot_cache`) still in the cache."""
    try:
        keys = json.loads((folder / APPLY_FILE).read_text()).get("graphs") or []
    except (OSError, json.JSONDecodeError):
        return []
    return [f for f in (graphs_folder() / f"{k}.pkl" for k in keys) if f.is_file()]


def graphs_folder() -> Path:
    from advisor.patching import aot_cache  # function-level, as above

    return aot_cache.folder()


def is_bundle(path) -> bool:
    return isinstance(path, (str, Path)) and Path(path).is_file() and zipfile.is_zipfile(path)


def load(path, dest: Path | None = None) -> Path:
    """Unpack a bundle's plan (into `dest`, else the cache's `bundles/<digest>/`) and install its
    binaries into Triton's cache if they were built here-alike; returns the plan's folder, ready for
    `advisor.patch(model, folder)`."""
    path = Path(path)
    if not is_bundle(path):
        raise AdvisorError(f"{path} is not a fusion-advisor bundle (write one with `fusion-advisor bundle OUT -o FILE`)")
    data = path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        try:
            header = json.loads(z.read("header.json"))
        except KeyError:
            raise AdvisorError(f"{path} is not a fusion-advisor bundle (no header.json)") from None
        if header.get("format") != FORMAT:
            raise AdvisorError(f"{path}: bundle format {header.get('format')}, this fusion-advisor reads {FORMAT}")
        dest = Path(dest) if dest else cache_dir().parent / "bundles" / hashlib.sha256(data).hexdigest()[:16]
        with tempfile.TemporaryDirectory(prefix="fusion-advisor-bundle-") as tmp:
            _extract(z, "plan/", Path(tmp))
            copy_plan(Path(tmp), dest)
            _extract(z, "graphs/", graphs_folder())  # keyed by torch's version: another torch's never match
            if header.get("binaries") or header.get("host_modules"):
                here = environment()
                differ = [f"{k} {header.get(k)} (here {here.get(k)})" for k in MATCH if header.get(k) != here.get(k)]
                if differ:
                    log.warning("fusion-advisor: %s was built with %s: its kernels compile on first use instead",
                                path.name, ", ".join(differ))
                else:
                    install(z, header["binaries"] + list(header.get("host_modules") or []))
    return dest


def patch(model, path):
    """`advisor.patch` from a bundle: its plan unpacked (`load`) and patched in, in the state `optimize`'s
    selection left it (`Plan.enabled`)."""
    from advisor.patching import patch as patch_model  # function-level: dynamo only when a bundle is patched

    return patch_model(model, load(path))


def install(z: zipfile.ZipFile, names: list, root: Path | None = None) -> int:
    """Copy the bundle's Triton cache entries into Triton's cache (each whole, or not at all); returns
    how many were new."""
    root = root or triton_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    new = 0
    for name in names:
        target = root / name
        if target.is_dir():
            continue
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))
        _extract(z, f"triton/{name}/", tmp)
        try:
            os.replace(tmp, target)  # a concurrent run sees the entry whole, or not at all
            new += 1
        except OSError:  # another process installed it first
            shutil.rmtree(tmp, ignore_errors=True)
    return new


def _extract(z: zipfile.ZipFile, prefix: str, into: Path) -> None:
    for info in z.infolist():
        rel = info.filename[len(prefix):] if info.filename.startswith(prefix) else None
        if not rel or info.is_dir() or ".." in Path(rel).parts or Path(rel).is_absolute():
            continue
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(z.read(info))

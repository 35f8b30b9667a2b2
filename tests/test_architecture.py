"""The import structure of `advisor`: no cycle among its files nor among its sub-packages, and no edge the
layering forbids (`FORBIDDEN`).

Every import counts, those inside functions too (a lazy import still ties two files together: it only
moves the failure to the first call). Imports are read from the source (ast), nothing is executed."""
from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "advisor"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_files() -> dict[str, Path]:
    """{dotted module name: file} for every file of the package."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `path` imports anywhere in it. `from advisor.x import y` names the
    module advisor.x.y when y is a submodule, else advisor.x (y is then a name defined there)."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names]
        else:
            continue
        for name in names:
            # `import advisor.x.y` names the deepest module of the package it reaches
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != this:
                found.add(name)
    return found


def file_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {m: imported_modules(p, modules) for m, p in modules.items()}


def room(module: str) -> str:
    """The sub-package (advisor.x) or top-level module a module belongs to."""
    return ".".join(module.split(".")[:2])


def package_graph(files: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for m, targets in files.items():
        rooms.setdefault(room(m), set()).update(room(t) for t in targets if room(t) != room(m))
    # advisor/__init__.py is the façade over everything: it may import any stage, none may import it
    rooms.pop("advisor", None)
    return rooms


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph.get(a, ())) if b in component]
    return " ⇄ ".join(component) + "\n      " + "\n      ".join(edges)


def test_no_cycle_among_files():
    graph = file_graph()
    found = cycles(graph)
    assert not found, "import cycles among advisor's files:\n  " + "\n  ".join(describe(c, graph) for c in found)


def test_no_cycle_among_subpackages():
    graph = package_graph(file_graph())
    found = cycles(graph)
    assert not found, "import cycles among advisor's sub-packages:\n  " + "\n  ".join(describe(c, graph) for c in found)


def test_stages_do_not_import_the_workflows():
    """`advisor.workflows` runs the stages; no stage (nor any shared module below them) imports it: only
    the command line and the façade (advisor/__init__.py) stand above it."""
    graph = package_graph(file_graph())
    above = {"advisor.workflows", "advisor.cli", "advisor.__main__"}
    wrong = sorted(r for r, targets in graph.items() if "advisor.workflows" in targets and r not in above)
    assert not wrong, f"importing advisor.workflows from below it: {wrong}"


# Edges between sub-packages that once crept in against the layering (each stage imports only those before
# it; the reports read analysis.json and apply.json alone), each with where its shared piece lives now.
FORBIDDEN = {
    ("advisor.analysis", "advisor.report"): "analysis writes analysis.json, the reports read it: formatting is "
                                            "advisor.units, analysing and reporting in one go is the CLI's",
    ("advisor.patching", "advisor.measure"): "a call's clock is advisor.stopwatch, comparing a whole call's outputs "
                                           "is advisor.validate.outputs",
    ("advisor.measure", "advisor.validate"): "the timing of whole calls needs no validation: output comparison is "
                                           "advisor.validate.outputs",
    ("advisor.report", "advisor.collect"): "the reports read the run folder through advisor.layout, not the collector",
}


def test_forbidden_edges():
    """The edges in FORBIDDEN stay out, lazy imports included; the message names the files that import."""
    files = file_graph()
    wrong = [f"{m} -> {t}: {why}" for (a, b), why in FORBIDDEN.items()
             for m in sorted(files) if room(m) == a for t in sorted(files[m]) if room(t) == b]
    assert not wrong, "imports against the layering:\n  " + "\n  ".join(wrong)


# The steps after analysis that `optimize` and `apply` share live in `advisor.workflows.pipeline`; a driver that
# called one of these itself would be the step written twice again.
PIPELINE_STEPS = {"analyze", "write_analysis", "occurrence_modules", "kernel_specs", "build_plan", "pattern_status",
                  "final_status", "warm_worker", "start_soon", "triton_setup", "loaded_host_modules"}
DRIVERS = ("advisor/workflows/live_model.py", "advisor/workflows/user_script.py")


def test_drivers_take_the_shared_steps_from_the_pipeline():
    """Neither driver names a step the pipeline holds: each exists once, in `workflows/pipeline.py`."""
    named = {}
    for driver in DRIVERS:
        tree = ast.parse((ROOT / driver).read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
                {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        named[driver] = sorted(names & PIPELINE_STEPS)
    assert not any(named.values()), f"steps of workflows/pipeline.py called from a driver directly: {named}"
    pipeline = {n.id for n in ast.walk(ast.parse((PACKAGE / "workflows" / "pipeline.py").read_text()))
                if isinstance(n, ast.Name)}
    assert PIPELINE_STEPS <= pipeline, PIPELINE_STEPS - pipeline


def test_the_cycle_finder():
    """The cycle finder itself: a two-file loop and a package loop are found, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []
    assert package_graph({"advisor.x.m": {"advisor.y.n"}, "advisor.y.n": {"advisor.x.k"}}) == \
        {"advisor.x": {"advisor.y"}, "advisor.y": {"advisor.x"}}


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (the `test` extra has it)")
def test_ruff_finds_nothing():
    """`ruff check` over the package, the tests and the benchmarks, with pyproject.toml's rules (pyflakes,
    pycodestyle): an unused import or variable, an undefined name, fails here."""
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "advisor", "tests", "bench"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

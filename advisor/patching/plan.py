"""What to patch: patterns (program + launcher) and the modules to capture, and the manifest.

A pattern is patched into the module that contains each of its occurrences: the innermost common
module of the ops of that occurrence (a residual add in layer 0 feeding layer 1's RMSNorm lands on
`model`, a SwiGLU on `mlp`). Occurrence modules come from the analysis' groups in-process; from
analysis.json alone (no per-occurrence modules there) the target is the common module of all of a
candidate's modules, which contains every occurrence too, only coarser.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from advisor.documents import ANALYSIS_FILE, APPLY_FILE
from advisor.errors import AdvisorError
from advisor.ops.registry import OpClass, conv_epilogue_fits, op_class, tagged
from advisor.patching.modules import contains, lca, root_path
from advisor.patching.program import is_scalar_slot, program_text

REPLACEMENTS = ("kernel", "program", "subgraph")


@dataclass(eq=False)
class PatternSpec:
    """One pattern to substitute. Plain data: it is pickled and deep-copied with patched models."""

    candidate: str
    pattern_id: str
    title: str
    program: dict
    replacement: str = "kernel"  # kernel: the generated launcher; program / subgraph: stand-ins (tests)
    kernel_file: str | None = None
    device_type: str | None = None  # what the kernel was validated on (None: any, for stand-ins)
    est_time_saved_us: float = 0.0
    signature: str = ""
    # The pattern at other shapes: [{"index": i (1-based, into the candidate's `variants`), "program",
    # "kernel_file"}], each matched and substituted like `program` with its own kernel.
    variants: list = field(default_factory=list)

    def shapes(self) -> list[tuple[dict, str | None]]:
        """(program, kernel file) of every shape this pattern is patched at, the first one first."""
        return [(self.program, self.kernel_file)] + [(v["program"], v["kernel_file"]) for v in self.variants]

    @property
    def key(self) -> str:
        return f"{self.pattern_id}:{self.replacement}"

    @property
    def anchored(self) -> bool:
        """Whether its program holds a matmul or an attention (its other shapes hold the same ops)."""
        return any(op_class(n["op"]) in (OpClass.MATMUL, OpClass.ATTENTION) for n in self.program.get("nodes") or [])

    def guard(self) -> dict:
        ins = []
        for s in self.program["inputs"]:
            if is_scalar_slot(s):
                ins.append({"id": s["id"], "scalar": True})
            else:
                ins.append({"id": s["id"], "dtype": s["dtype"], "shape": s["shape"], "strides": s["strides"]})
        return {"device_type": self.device_type, "inputs": ins, "no_grad_inputs": True}

    def guard_text(self) -> str:
        dev = self.device_type or "any device"
        parts = []
        for s in self.program["inputs"]:
            if is_scalar_slot(s):
                parts.append(f"{s['id']}: number")
            else:
                parts.append(f"{s['id']}: {s['dtype']}{list(s['shape'])} strides {list(s['strides'])}")
        return f"{dev}; " + "; ".join(parts) + "; no input requires grad"


@dataclass
class Target:
    module: str  # trace path: qualified (`Root.a.b`) or an instance chain
    keys: list[str] = field(default_factory=list)
    outer: bool = False  # captured over the other targets inside it, used only when switched on (selection)


@dataclass
class Plan:
    patterns: list[PatternSpec]
    targets: list[Target]
    skipped: dict = field(default_factory=dict)  # module -> why it is not captured (granularity "layer")
    uncaptured: dict = field(default_factory=dict)  # pattern key -> modules of its occurrences not captured
    outer_on: bool = False  # selection kept the outer captures (apply.json `outer`): patch switches them on
    enabled: frozenset | None = None  # the patterns selection left running (apply.json `enabled`; None: all)
    # inference captures compiled by Inductor around the kernels, in this mode (apply.json `inductor`: True, or a
    # mode of `plan.INDUCTOR_MODES`); False: our route
    inductor: bool | str = False

    def spec(self, key: str) -> PatternSpec:
        return next(p for p in self.patterns if p.key == key)

    def without(self, keys) -> "Plan":
        keys = set(keys)
        pats = [p for p in self.patterns if p.key not in keys]
        tgts = [Target(t.module, [k for k in t.keys if k not in keys], t.outer) for t in self.targets]
        return Plan(pats, [t for t in tgts if t.keys], dict(self.skipped),
                    {k: v for k, v in self.uncaptured.items() if k not in keys}, self.outer_on,
                    None if self.enabled is None else self.enabled - keys, self.inductor)

    def only(self, keys) -> "Plan":
        return self.without({p.key for p in self.patterns} - set(keys))

    def outer_only_keys(self) -> set:
        """Patterns fused only by an outer capture (their occurrences span layers the inner tier captures
        one by one): they run only when selection switches the outer capture on."""
        inner = {k for t in self.targets if not t.outer for k in t.keys}
        return {k for t in self.targets if t.outer for k in t.keys} - inner


def spec_from_candidate(c: dict, replacement: str = "kernel", kernel_file: str | None = None,
                        device_type: str | None = None, variants: list | None = None) -> PatternSpec:
    """The pattern to patch for analysis.json candidate `c`. `variants`: [{"index", "kernel_file"}] of its
    other shapes to patch too (apply.json's records of them, or a manifest's; their programs are read from
    `c`; one whose kernel did not validate is left out); stand-ins patch every shape."""
    if replacement not in REPLACEMENTS:
        raise AdvisorError(f"replacement must be one of {', '.join(REPLACEMENTS)} (got {replacement!r})")
    return PatternSpec(candidate=c["id"], pattern_id=c["pattern_id"], title=c["title"], program=c["program"],
                       replacement=replacement, kernel_file=kernel_file, device_type=device_type,
                       est_time_saved_us=float(c.get("est_time_saved_us") or 0.0), signature=c.get("pattern", ""),
                       variants=_variants(c, replacement, variants))


def _variants(c: dict, replacement: str, chosen: list | None) -> list:
    programs = c.get("variants") or []
    if replacement != "kernel":
        chosen = [{"index": i, "kernel_file": None} for i in range(1, len(programs) + 1)]
    return [{"index": v["index"], "program": programs[v["index"] - 1], "kernel_file": v["kernel_file"]}
            for v in chosen or [] if v.get("validated", True) and 0 < v["index"] <= len(programs)]


def occurrence_modules(analysis) -> dict[str, list[str]]:
    """Candidate id -> the module containing each occurrence (from an in-process `Analysis`)."""
    out: dict[str, list[str]] = {}
    for cid, groups in analysis.groups.items():
        mods = []
        for g in groups:
            m = lca([analysis.graph.nodes[i].module for i in g.members])
            if m and m not in mods:
                mods.append(m)
        out[cid] = mods
    return out


GRANULARITIES = ("layer", "occurrence", "pattern", "root")
# `optimize(..., inductor=MODE)`: Inductor's settings per mode, as torch.compile's modes set them, less its CUDA
# graphs (the captures replay their own): True is Inductor's default; "max-autotune" benchmarks Triton templates
# against cuBLAS per GEMM and tunes the other kernels' launch configurations (minutes of compile time).
INDUCTOR_MODES = {True: {}, "max-autotune": {"max_autotune": True, "coordinate_descent_tuning": True}}


def build_plan(specs: list[PatternSpec], doc: dict, occurrences: dict[str, list[str]] | None = None,
               granularity: str = "occurrence", inductor: bool | str = False) -> Plan:
    """Targets for `specs`: the module of each occurrence (`occurrence`), the one module containing all
    of a pattern's occurrences (`pattern`), or the whole model (`root`). Coarser targets mean fewer,
    larger captures: less per-call overhead (one guard check and one graph call instead of one per
    layer), at the price of a bigger graph for dynamo to capture.

    `layer` (what `optimize` and `apply` use) is `pattern` where that stays inside one repeated layer,
    else `occurrence` widened to the repeated layer it is in (`layer_of`), and every pattern of one
    layer is tried in its siblings (`share_across_layers`); a module that holds several
    repeated layers is not captured in this tier. Instead it becomes one *outer* target (the innermost
    module holding every occurrence, e.g. the decoder stack) over the layer targets, with every
    pattern: its capture fuses what straddles two layers (layer N's last residual add and layer N+1's
    first norm) and replays the stack as one graph, but costs seconds of dynamo per process and
    changes what the model runs (transformers builds its attention masks differently under dynamo: an
    H100 8-layer Llama once ran 31% slower captured whole with every kernel off), so it runs only when
    selection has timed it faster than the layer tier (`Patched.set_outer`)."""
    if granularity not in GRANULARITIES:
        raise AdvisorError(f"granularity must be one of {', '.join(GRANULARITIES)} (got {granularity!r})")
    by_cand = {c["id"]: c for c in doc["candidates"]}
    specs = patch_order(specs, by_cand)
    targets: dict[str, Target] = {}
    for s in specs:
        mods = (occurrences or {}).get(s.candidate)
        if not mods:
            common = lca(by_cand.get(s.candidate, {}).get("modules", []))
            mods = [common] if common else []
        if granularity in ("pattern", "layer") and lca(mods):
            if granularity == "pattern" or not spans_layers(lca(mods), mods):
                mods = [lca(mods)]
            if granularity == "layer":
                mods = list(dict.fromkeys(layer_of(m) for m in mods))
        elif granularity == "root":
            mods = list(dict.fromkeys(root_path(m) for m in mods))
        for m in mods:
            t = targets.setdefault(m, Target(m))
            if s.key not in t.keys:
                t.keys.append(s.key)
    skipped: dict = {}
    uncaptured: dict = {}
    if granularity == "layer":
        every = list(targets)
        for m in [m for m in targets if spans_layers(m, list(targets))]:
            skipped[m] = "holds several repeated layers: fused only by the outer capture of the whole stack"
            for k in targets.pop(m).keys:
                uncaptured.setdefault(k, []).append(m)
        share_across_layers(targets)
        outer = lca(every)
        if outer and (skipped or len(targets) > 1) and outer not in targets:
            targets[outer] = Target(outer, [s.key for s in specs], outer=True)
    return Plan(list(specs), list(targets.values()), skipped, uncaptured, inductor=inductor)


def patch_order(specs: list[PatternSpec], by_cand: dict) -> list[PatternSpec]:
    """The order patterns take the ops of a site in: the analysis's rank, except for patterns that extend a
    pointwise chain (`extends`) where the extension only saves more:
    - a conv epilogue goes before the chain it extends: cuDNN runs the chain inside the conv's own kernel
      (`codegen.conv`), so at every site it saves all the chain's kernels save fused, and more (0.053-0.224 vs
      0.115-0.303 ms per ResNet-50 block on the H100, docs/EXPERIMENTS.md: conv_bn_paths);
    - a chain ending in a window op (BatchNorm + ReLU + max-pool) goes before both the chain and its conv
      epilogues: at the site they share it fuses the pool as well, which eager runs alone (ResNet-50's stem:
      430 us for the NHWC max-pool, 165 us for the whole window kernel on the H100), where the conv epilogue
      would leave that pool to eager.
    A GEMM epilogue keeps its rank: our Triton GEMM against cuBLAS can lose, and a base group that took its sites
    keeps them when selection drops the epilogue."""
    def cand(s: PatternSpec) -> dict:
        return by_cand.get(s.candidate) or {}

    def conv(s: PatternSpec) -> bool:
        c = cand(s)
        return c.get("kind") == "epilogue" and bool(c.get("extends")) and conv_epilogue_fits(c.get("ops") or [])

    def window(s: PatternSpec) -> bool:
        c = cand(s)
        return bool(c.get("extends")) and any(tagged(op, "window") for op in c.get("ops") or [])

    out = list(specs)
    for moves, ahead_of in ((conv, lambda s, t: False), (window, lambda s, t: conv(t))):
        for s in [s for s in out if moves(s)]:
            chain = cand(s)["extends"]
            front = next((i for i, t in enumerate(out) if t.candidate == chain
                          or (ahead_of(s, t) and cand(t).get("extends") == chain)), None)
            if front is not None and out.index(s) > front:
                out.remove(s)
                out.insert(front, s)
    return out


def share_across_layers(targets: dict) -> None:
    """A pattern found in one repeated layer is tried in every sibling captured here (the other entries of
    its ModuleList). The analysis sees a chain as a pattern of its own only where nothing else joined it:
    Llama's input RMSNorm stands alone in layer 0 only, since in every later layer the previous layer's
    residual add joins it across the layer boundary (a pattern only the outer capture fuses), so the
    layer captures left it unfused in all but one layer. The matcher finds it where its ops are and
    nowhere else. Siblings then hold one set of patterns, so layers of one class can share one capture."""
    lists: dict = {}
    for m, t in targets.items():
        if not t.outer and _numbered_prefix(m) == m:  # a layer itself (`model.layers.3`)
            lists.setdefault(m.rsplit(".", 1)[0], []).append(t)
    for layers in lists.values():
        keys = list(dict.fromkeys(k for t in layers for k in t.keys))
        for t in layers:
            t.keys.extend(k for k in keys if k not in t.keys)


def layer_of(module: str) -> str:
    """The repeated layer a module is in (`m.layers.3.mlp.act` -> `m.layers.3`), else the module itself:
    one capture per layer, not one per submodule, since each captured call costs a guard check and
    AOTAutograd's runtime wrapper on the host (36 captured submodules made BERT host-bound)."""
    return _numbered_prefix(module) or module


def spans_layers(outer: str, names: list[str]) -> bool:
    """Whether `names` has modules inside two different numbered children of `outer` (`layers.0`, `layers.1`)."""
    inside = [q[len(outer) + 1:] if outer else q for q in names if q != outer and contains(outer, q)]
    return len({p for p in map(_numbered_prefix, inside) if p}) >= 2


def _numbered_prefix(path: str) -> str | None:
    """`path` up to its first numbered component (a ModuleList entry), or None without one."""
    parts = path.split(".")
    i = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return None if i is None else ".".join(parts[:i + 1])


# ------------------------------------------------------------------------------------ on disk
def manifest_entry(spec: PatternSpec, module: str, cls: str, sites: int | None = None, outer: bool = False) -> dict:
    return {"module": module, "class": cls, "candidate": spec.candidate, "pattern_id": spec.pattern_id,
            "title": spec.title, "pattern": spec.signature, "replacement": spec.replacement,
            "kernel_file": spec.kernel_file, "guard": spec.guard_text(), "guard_spec": spec.guard(),
            "sites": sites, "program": program_text(spec.program), "outer": outer,
            **({"variants": [{"index": v["index"], "kernel_file": v["kernel_file"]} for v in spec.variants]}
               if spec.variants else {})}


def load_plan(out_dir: Path) -> Plan:
    """The plan written by `apply`/`optimize`: apply.json's manifest, programs from analysis.json."""
    out_dir = Path(out_dir)
    analysis_p = _find(out_dir, ANALYSIS_FILE)
    apply_p = _find(out_dir, APPLY_FILE)
    doc = json.loads(analysis_p.read_text())
    applied = json.loads(apply_p.read_text())
    by_pid = {c["pattern_id"]: c for c in doc["candidates"]}
    specs: dict[str, PatternSpec] = {}
    manifest = applied.get("manifest") or []
    validated = any(p.get("validated") and p.get("kernel_file") for p in applied.get("patterns", []))
    if not manifest and applied.get("selection") is not None and validated:
        return Plan([], [])  # selection kept nothing: patching with it changes nothing
    if manifest:
        targets: dict[str, Target] = {}
        records = {p.get("pattern_id"): p for p in applied.get("patterns") or []}
        for e in manifest:
            c = by_pid.get(e["pattern_id"])
            if c is None:
                raise AdvisorError(f"{apply_p}: pattern {e['pattern_id']} is not in {analysis_p}")
            rec = records.get(e["pattern_id"])
            if e.get("replacement", "kernel") == "kernel" and rec is not None and not rec.get("validated"):
                # Never patch a kernel that failed validation, even one a hand-edited manifest names
                # (tests/test_reliability.py).
                raise AdvisorError(f"{apply_p}: the manifest names pattern {e['pattern_id']}, whose kernel was not "
                                   f"validated ({rec.get('reason') or 'no reason recorded'}): refusing to patch it")
            s = spec_from_candidate(c, e.get("replacement", "kernel"), e.get("kernel_file"),
                                    (e.get("guard_spec") or {}).get("device_type"), e.get("variants"))
            specs.setdefault(s.key, s)
            t = targets.setdefault((e["module"], bool(e.get("outer"))), Target(e["module"], outer=bool(e.get("outer"))))
            if s.key not in t.keys:
                t.keys.append(s.key)
        enabled = applied.get("enabled")
        return Plan(list(specs.values()), list(targets.values()), outer_on=bool(applied.get("outer")),
                    enabled=None if enabled is None else frozenset(enabled),
                    inductor=_inductor_mode(applied.get("inductor"), apply_p))
    for p in applied.get("patterns", []):
        c = by_pid.get(p.get("pattern_id")) or next((x for x in doc["candidates"] if x["id"] == p.get("candidate")), None)
        if c is None or not p.get("validated") or not p.get("kernel_file"):
            continue
        s = spec_from_candidate(c, "kernel", p["kernel_file"], p.get("device_type") or doc["device"]["type"],
                                p.get("variants"))
        specs.setdefault(s.key, s)
    if not specs:
        raise AdvisorError(f"{apply_p} lists no validated kernel to patch in")
    return build_plan(list(specs.values()), doc)


def _find(out_dir: Path, name: str) -> Path:
    for p in (out_dir / name, out_dir / "trace" / name):
        if p.exists():
            return p
    raise AdvisorError(f"no {name} in {out_dir} (run `fusion-advisor apply` or `advisor.optimize` first)")


def to_jsonable(plan: Plan) -> dict:
    return {"patterns": [asdict(p) for p in plan.patterns], "targets": [asdict(t) for t in plan.targets]}


def _inductor_mode(recorded, path: Path) -> bool | str:
    """apply.json's `inductor` as a plan holds it: True or a mode name (`plan.INDUCTOR_MODES`), else False. A name
    this version does not know is one clear error here, not Inductor's KeyError at the first call."""
    if isinstance(recorded, str) and recorded not in INDUCTOR_MODES:
        known = ", ".join(repr(m) for m in INDUCTOR_MODES if isinstance(m, str))
        raise AdvisorError(f"{path}: `inductor` is {recorded!r}, a mode this version does not know (known: true, "
                           f"false, {known}); re-run `fusion-advisor apply` or `advisor.optimize` to write it again")
    return recorded if isinstance(recorded, str) else bool(recorded)

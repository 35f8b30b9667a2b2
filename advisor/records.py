"""The records the stages after analysis exchange: a `Candidate` (one analysis.json `candidates` entry), a
`PatternResult` (one apply.json `patterns` entry: what became of one candidate) and its `Verdict` (a
`Status` code and the sentence for people). Frozen: a stage that learns something makes a new record
(`dataclasses.replace`), so a record handed on is never changed behind its reader's back.

Each is built once from its JSON (`from_json`) and written back by `to_json`, keys and values exactly as
the JSON files have them: the files' schemas stay where `advisor.jsonio` versions them. A kind or status
outside the vocabulary, or a key the record does not know, is refused by `from_json` with the key named,
instead of travelling on as text. The nested `graph`, `program`, `errors`, ... stay the JSON's dicts: the
program has its one reader (`advisor.codegen.read`), the rest are shown, not branched on; nobody mutates
them.

Low in the tree: imports only `advisor.status` and `advisor.errors`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from advisor.errors import AdvisorError
from advisor.status import Status


class RecordError(AdvisorError):
    """A JSON record that is not one of ours: an unknown kind, status or key, or a missing key."""


class Kind(str, Enum):
    """What a candidate is, as the analyzer decides it (`advisor.analysis.api._kind`); the values are
    analysis.json's `kind` strings."""

    POINTWISE = "pointwise"
    REDUCTION = "reduction"  # last-dim reductions and softmax: R rows of N
    NORM = "norm"  # LayerNorm, RMSNorm, BatchNorm (its family, however the ops spell it)
    EPILOGUE = "epilogue"  # a matmul/conv with a pointwise group on its output
    ATTENTION = "attention"  # matmul -> scale/mask -> softmax -> matmul
    MATMUL_REDUCTION = "matmul_reduction"  # a matmul reduced over its rows (SPLADE's max over the sequence)
    PADDED_MATMUL = "padded_matmul"  # a GEMM cuBLAS runs unaligned: its operands padded (`advisor.codegen.padded`)

    def __str__(self) -> str:  # json.dumps and f-strings write the value
        return self.value

    @property
    def anchored(self) -> bool:
        """Generated around a matmul (`advisor.codegen.anchored`), not as a pointwise/row kernel."""
        return self in ANCHORED


ANCHORED = frozenset({Kind.EPILOGUE, Kind.ATTENTION, Kind.MATMUL_REDUCTION, Kind.PADDED_MATMUL})


def _enum(cls, value, key: str):
    try:
        return cls(value)
    except ValueError:
        known = ", ".join(m.value for m in cls)
        raise RecordError(f"{key} {value!r} is not a known {cls.__name__} (one of: {known})") from None


def _check_keys(doc: dict, known: tuple, required: tuple, what: str) -> None:
    if not isinstance(doc, dict):
        raise RecordError(f"{what} must be a JSON object, got {type(doc).__name__}")
    unknown = [k for k in doc if k not in known]
    if unknown:
        raise RecordError(f"{what} has keys this version does not know: {', '.join(map(repr, unknown))}")
    missing = [k for k in required if k not in doc]
    if missing:
        raise RecordError(f"{what} lacks {', '.join(map(repr, missing))}")


# analysis.json's candidate keys, in the order the analyzer writes them (`advisor.analysis.api._analysis`).
CANDIDATE_KEYS = ("pattern_id", "pattern", "title", "kind", "ops", "kernels", "modules", "occurrences",
                  "kernels_saved", "bytes_unfused", "bytes_fused", "bytes_saved", "est_time_saved_us",
                  "est_cpu_time_saved_us", "measured_time_us", "intermediate_bytes", "confidence", "graph",
                  "program", "variants", "not_generated", "negligible", "id", "rank", "share_of_iteration", "extends",
                  "phase", "shared", "ranks")
# written only when they say something (a CPU trace's CPU estimate; why the generator must refuse it; a
# training step's part other than the forward; a distributed run's spread over its ranks)
CANDIDATE_OPTIONAL = ("est_cpu_time_saved_us", "variants", "not_generated", "phase", "shared", "ranks")
CANDIDATE_TUPLES = ("ops", "kernels", "modules")


@dataclass(frozen=True)
class Candidate:
    """One fusion candidate of an analysis: a pattern (its `program`, the ops of its first occurrence)
    and what the analyzer estimates fusing its `occurrences` per iteration saves."""

    id: str  # c1, c2, ...: stable between `analyze` and `apply` (numbered by what the shapes decide)
    kind: Kind
    pattern_id: str = ""  # the pattern family (absent from analysis.json before patterns had ids)
    title: str = ""  # display text: never branched on
    pattern: str = ""  # the canonical signature
    ops: tuple = ()  # aten op names of the first occurrence, in order
    kernels: tuple = ()
    modules: tuple = ()
    occurrences: int | float | None = None  # per iteration
    kernels_saved: int | float | None = None
    bytes_unfused: int | float | None = None
    bytes_fused: int | float | None = None
    bytes_saved: int | float | None = None
    est_time_saved_us: float | None = None
    est_cpu_time_saved_us: float | None = None
    measured_time_us: float | None = None
    intermediate_bytes: int | float | None = None
    confidence: str | None = None
    graph: dict | None = None
    program: dict | None = None  # the program format read by `advisor.codegen.read`
    # The pattern's occurrences at other shapes (a convnet's stages): one program each, most frequent first
    # (absent when every occurrence has the first's shapes). Kernels are generated per shape.
    variants: list | None = None
    not_generated: str | None = None  # why the generator must refuse it
    negligible: bool = False
    rank: int | None = None
    share_of_iteration: float | None = None
    extends: str | None = None  # the candidate id this one is built on top of (an epilogue's pointwise group)
    phase: str | None = None  # "backward" | "optimizer": where in a training step it runs (None: the forward)
    # {candidate id: {"occurrences", "est_time_saved_us"}}: its occurrences whose ops that candidate's also hold
    # (per iteration, with their share of the estimate); absent when none are
    shared: dict | None = None
    # a distributed run's merged analysis (advisor.analysis.ranks): `seen_on`, `missing_on`, the estimate per rank
    # (`est_time_saved_us`, keyed by rank) and its `min`, `median`, `max`; absent for one process
    ranks: dict | None = None

    @classmethod
    def from_json(cls, doc: dict) -> "Candidate":
        _check_keys(doc, CANDIDATE_KEYS, ("id", "kind"), f"candidate {doc.get('id', '?')!r}"
                    if isinstance(doc, dict) else "candidate")
        fields = {k: (tuple(v) if k in CANDIDATE_TUPLES else v) for k, v in doc.items()}
        fields["kind"] = _enum(Kind, doc["kind"], "kind")
        return cls(**fields)

    def to_json(self) -> dict:
        out = {}
        for k in CANDIDATE_KEYS:
            v = getattr(self, k)
            if k in CANDIDATE_OPTIONAL and v is None:
                continue
            out[k] = v.value if k == "kind" else list(v) if k in CANDIDATE_TUPLES else v
        return out

    @property
    def has_program(self) -> bool:
        return bool(self.program and self.program.get("nodes"))


def candidates_of(analysis: dict) -> list[Candidate]:
    """The candidates of an analysis.json document, in its order (ranked)."""
    return [Candidate.from_json(c) for c in analysis.get("candidates") or []]


@dataclass(frozen=True)
class Verdict:
    """Why a pattern is or is not in use: the code programs branch on and the sentence people read
    (apply.json's `status_code` and `status`)."""

    code: Status
    message: str

    def __post_init__(self):
        object.__setattr__(self, "code", _enum(Status, self.code, "status_code"))


# apply.json's pattern keys, in the order the workflows write them: the record as generated
# (`workflows.generate`), then what the patching workflows add (`workflows.kernels`, `outcome`, `selection`).
RESULT_KEYS = ("candidate", "pattern_id", "title", "kernel_file", "validated", "reason", "errors", "measured",
               "source", "cached", "device_type", "seconds", "memory_saved_bytes", "alternatives", "launcher_ms",
               "launcher", "launcher_note", "variants", "replacement", "est_time_saved_us", "occurrences", "shared",
               "sites", "patched", "status_code", "status", "applied_alone", "kept")
RESULT_ALWAYS = RESULT_KEYS[:RESULT_KEYS.index("device_type") + 1]  # every record has these; the rest when known


@dataclass(frozen=True)
class PatternResult:
    """What became of one candidate: its kernel (generated, validated, written), then, in `optimize` and
    `apply`, whether it is patched, at how many sites, whether selection kept it, and the verdict.
    A field left None was not reached by this run and is not written."""

    candidate: str  # the candidate id
    pattern_id: str = ""
    title: str | None = None
    kernel_file: str | None = None
    validated: bool = False
    reason: str | None = None  # why no validated kernel (the generator's or validation's words)
    errors: dict | None = None  # validation's error measures
    measured: dict | None = None
    source: str | None = None  # the kernel module's text
    cached: bool | None = None
    device_type: str | None = None
    # Where generate's time went, per job: {"generate": codegen, "validate": Triton's compile at each
    # validation shape + the references} (+ "shapes": the other shapes' jobs, "alternatives": their timing)
    seconds: dict | None = None
    memory_saved_bytes: int | None = None  # matmul-anchored kernels
    alternatives: dict | None = None  # {name: {validated, reason, rel_l2}} (attention's `run_sdpa`)
    launcher_ms: dict | None = None
    launcher: str | None = None
    launcher_note: str | None = None
    # One per candidate variant (its other shapes): {"index", "validated", "kernel_file", "reason"}
    variants: list | None = None
    replacement: str | None = None  # kernel | program | subgraph
    est_time_saved_us: float | None = None
    occurrences: int | float | None = None
    shared: dict | None = None  # the candidate's `shared`: occurrences other candidates' ops also hold
    sites: int | None = None  # sites whose launcher ran
    patched: bool | None = None
    verdict: Verdict | None = None
    applied_alone: dict | None = None  # this pattern timed alone (selection)
    kept: bool | None = None  # selection kept it running

    @classmethod
    def from_json(cls, doc: dict) -> "PatternResult":
        what = f"pattern {doc.get('candidate', '?')!r}" if isinstance(doc, dict) else "pattern"
        _check_keys(doc, RESULT_KEYS, ("candidate",), what)
        if ("status_code" in doc) != ("status" in doc):  # a sentence without its code would be read as words
            raise RecordError(f"{what} has {'status_code' if 'status_code' in doc else 'status'} without "
                              f"{'status' if 'status_code' in doc else 'status_code'}: a verdict is both")
        fields = {k: v for k, v in doc.items() if k not in ("status_code", "status")}
        if "status_code" in doc:
            fields["verdict"] = Verdict(doc["status_code"], doc["status"])
        return cls(**fields)

    def to_json(self) -> dict:
        out = {}
        for k in RESULT_KEYS:
            if k == "status_code":
                if self.verdict is not None:
                    out["status_code"], out["status"] = self.verdict.code.value, self.verdict.message
            elif k != "status" and (k in RESULT_ALWAYS or getattr(self, k) is not None):
                out[k] = getattr(self, k)
        return out

    def with_verdict(self, code: Status, message: str) -> "PatternResult":
        return dataclasses.replace(self, verdict=Verdict(code, message))

    @property
    def code(self) -> Status | None:
        return self.verdict.code if self.verdict else None

    @property
    def in_use(self) -> bool:
        """Patched and not dropped by selection."""
        return bool(self.patched) and self.kept is not False

"""The records the stages after analysis exchange: a `Candidate` (one analysis.json `candidates` entry), a
`PatternResult` (one apply.json `patterns` entry: what became of one candidate) and its `Verdict` (a
`Status` code and the sentence for people). Frozen: a stage that learns something makes a new record
(`dataclasses.replace`), so a record handed on is never changed behind its reader's back.

Each is built once from its JSON (`from_json`) and written back by `to_json`, keys and values exactly as
the JSON files have them, through the one codec (`advisor.codec`): the files' schemas stay where
`advisor.jsonio` versions them. A kind or status outside the vocabulary, or a key the record does not know,
is refused by `from_json` with the key named, instead of travelling on as text. The nested `graph`,
`program`, `errors`, ... stay the JSON's dicts: the program has its one reader (`advisor.codegen.read`),
the rest are shown, not branched on; nobody mutates them.

Low in the tree: imports only `advisor.codec` and `advisor.status`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from advisor import codec
from advisor.codec import RecordError, enum_value, flattened, optional
from advisor.status import Status

__all__ = ["RecordError", "Kind", "ANCHORED", "Candidate", "candidates_of", "Verdict", "PatternResult"]


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
    est_cpu_time_saved_us: float | None = optional()  # a CPU trace's estimate of its own saving
    measured_time_us: float | None = None
    intermediate_bytes: int | float | None = None
    confidence: str | None = None
    graph: dict | None = None
    program: dict | None = None  # the program format read by `advisor.codegen.read`
    # The pattern's occurrences at other shapes (a convnet's stages): one program each, most frequent first
    # (absent when every occurrence has the first's shapes). Kernels are generated per shape.
    variants: list | None = optional()
    not_generated: str | None = optional()  # why the generator must refuse it
    negligible: bool = False
    rank: int | None = None
    share_of_iteration: float | None = None
    extends: str | None = None  # the candidate id this one is built on top of (an epilogue's pointwise group)
    phase: str | None = optional()  # "backward" | "optimizer": where in a training step it runs (None: the forward)
    # {candidate id: {"occurrences", "est_time_saved_us"}}: its occurrences whose ops that candidate's also hold
    # (per iteration, with their share of the estimate); absent when none are
    shared: dict | None = optional()
    # a distributed run's merged analysis (advisor.analysis.ranks): `seen_on`, `missing_on`, the estimate per rank
    # (`est_time_saved_us`, keyed by rank) and its `min`, `median`, `max`; absent for one process
    ranks: dict | None = optional()

    # analysis.json's order (`advisor.analysis.api._analysis`), not the constructor's (id and kind first)
    JSON_ORDER = ("pattern_id", "pattern", "title", "kind", "ops", "kernels", "modules", "occurrences",
                  "kernels_saved", "bytes_unfused", "bytes_fused", "bytes_saved", "est_time_saved_us",
                  "est_cpu_time_saved_us", "measured_time_us", "intermediate_bytes", "confidence", "graph",
                  "program", "variants", "not_generated", "negligible", "id", "rank", "share_of_iteration",
                  "extends", "phase", "shared", "ranks")

    @classmethod
    def from_json(cls, doc: dict) -> "Candidate":
        return codec.from_json(cls, doc, f"candidate {doc.get('id', '?')!r}" if isinstance(doc, dict) else "candidate")

    def to_json(self) -> dict:
        return codec.to_json(self)

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
        object.__setattr__(self, "code", enum_value(Status, self.code, "status_code"))


@dataclass(frozen=True)
class PatternResult:
    """What became of one candidate: its kernel (generated, validated, written), then, in `optimize` and
    `apply`, whether it is patched, at how many sites, whether selection kept it, and the verdict.
    The fields up to `device_type` are always written; one after it left None was not reached by this run
    and is not written."""

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
    seconds: dict | None = optional()
    memory_saved_bytes: int | None = optional()  # matmul-anchored kernels
    alternatives: dict | None = optional()  # {name: {validated, reason, rel_l2}} (attention's `run_sdpa`)
    launcher_ms: dict | None = optional()
    launcher: str | None = optional()
    launcher_note: str | None = optional()
    # One per candidate variant (its other shapes): {"index", "validated", "kernel_file", "reason"}
    variants: list | None = optional()
    replacement: str | None = optional()  # kernel | program | subgraph
    est_time_saved_us: float | None = optional()
    occurrences: int | float | None = optional()
    shared: dict | None = optional()  # the candidate's `shared`: occurrences other candidates' ops also hold
    sites: int | None = optional()  # sites whose launcher ran
    patched: bool | None = optional()
    verdict: Verdict | None = flattened({"code": "status_code", "message": "status"})
    applied_alone: dict | None = optional()  # this pattern timed alone (selection)
    kept: bool | None = optional()  # selection kept it running

    @classmethod
    def from_json(cls, doc: dict) -> "PatternResult":
        return codec.from_json(cls, doc, f"pattern {doc.get('candidate', '?')!r}" if isinstance(doc, dict) else "pattern")

    def to_json(self) -> dict:
        return codec.to_json(self)

    def with_verdict(self, code: Status, message: str) -> "PatternResult":
        return dataclasses.replace(self, verdict=Verdict(code, message))

    @property
    def code(self) -> Status | None:
        return self.verdict.code if self.verdict else None

    @property
    def in_use(self) -> bool:
        """Patched and not dropped by selection."""
        return bool(self.patched) and self.kept is not False

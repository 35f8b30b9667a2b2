"""The two JSON documents of a run folder, typed and frozen, each with its one writer:

    analysis.json  `AnalysisDoc`: what `analyze` found        `write_analysis(out_dir, doc)`
    apply.json     `ApplyDoc`: what was generated, patched,   `write_apply(out_dir, doc)`
                   checked and kept (`generate`, `optimize`, `apply`)

Every producer builds the record and hands it to the writer; nothing else writes these files (a test holds
it: tests/test_documents.py). Records and JSON convert through the one codec (`advisor.codec`): keys in
field order, a field made `optional()` written only when set, an unknown key refused. The nested tables a
document only carries for people (totals, timelines, timings) stay the JSON's dicts.

Low in the tree: imports the codec, the records and the file writer.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from advisor import codec
from advisor.codec import RecordError, optional
from advisor.jsonio import ANALYSIS_SCHEMA_VERSION, APPLY_SCHEMA_VERSION, write_json
from advisor.records import Candidate, PatternResult

ANALYSIS_FILE = "analysis.json"
APPLY_FILE = "apply.json"


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """A group of ops the fusion rules found and did not make a candidate: which ops, and the rule that
    refused it (analysis.json's `refused`; `fusion-advisor -v` logs each)."""

    rule: str  # a short name of the rule (`advisor.analysis.fusion`)
    why: str  # the sentence for people
    ops: tuple = ()  # the aten ops of the group, in order
    occurrences: float = 0  # per steady-state iteration
    module: str | None = optional()  # the module the first one's first op ran in


@dataclass(frozen=True, kw_only=True)
class CommunicationTime:
    """One rank's communication against its compute, per steady-state iteration (analysis.json's
    `communication_time`; measured by `advisor.analysis.overlap`, whose docstring states the rule)."""

    rule: str  # which rule measured it: "gpu_kernels" or "cpu_calling_thread" (`advisor.analysis.overlap`)
    iteration_us: float  # an iteration's wall time: its steady-state window
    communication_us: float  # wall time with a collective in flight
    exposed_us: float  # of that, the time no compute ran beside it: the rank waiting on other ranks
    overlapped_us: float  # of that, the time compute ran beside it
    collectives: float  # collectives started (CPU: calls on the calling thread; GPU: communication kernels)

    @property
    def own_time_us(self) -> float:
        """The iteration less its exposed communication: the rank's own work, which the other ranks wait on."""
        return self.iteration_us - self.exposed_us


@dataclass(frozen=True, kw_only=True)
class RankSummary:
    """One rank of a merged analysis (`DistributedSummary.ranks`): what its own analysis.json holds."""

    rank: int
    local_rank: int | None = None
    backend: str | None = None
    analysis: str  # the rank's own analysis.json
    iterations: int
    time_us: float  # op or kernel time per iteration, communication left out (its totals' `time_us`)
    communication_us: float = 0.0  # summed durations of its communication ops per iteration (totals)
    communication: tuple = ()  # its analysis.json's `communication`: per collective name, count and time
    communication_time: CommunicationTime | None = optional()
    candidates: int = 0
    est_time_saved_us: float | None = None


@dataclass(frozen=True, kw_only=True)
class Straggler:
    """The rank the others wait on: its own time per iteration (`CommunicationTime.own_time_us`) more than
    `margin` above the median of the other ranks' (`advisor.analysis.ranks.straggler`)."""

    rank: int
    own_time_us: float
    others_median_us: float
    excess: float  # own_time_us / others_median_us - 1
    margin: float  # the excess above which a rank is named
    others_us: dict  # {rank as a string: its own time per iteration}


@dataclass(frozen=True, kw_only=True)
class DistributedSummary:
    """A merged analysis's `distributed`: the job, each rank's analysis, and the straggler where there is one
    (written by `advisor.analysis.ranks.merge`)."""

    world_size: int
    backend: str | list | None = None  # one backend, or the list where ranks disagree
    ranks_analysed: tuple[int, ...] = ()
    steady_state_calls: tuple = ()  # the steady-state calls every rank shares
    merged_from: str | None = optional()
    ranks: tuple[RankSummary, ...] = ()
    straggler: Straggler | None = optional()  # absent where the ranks agree
    straggler_rule: str | None = optional()  # what was compared, where communication was measured

    @classmethod
    def from_json(cls, doc: dict) -> "DistributedSummary":
        return codec.from_json(cls, doc, "distributed")

    def to_json(self) -> dict:
        return codec.to_json(self)


@dataclass(frozen=True, kw_only=True)
class AnalysisDoc:
    """analysis.json: the device and steady state the analysis assumed, where the time goes, and the
    candidates, ranked (written by `advisor.analysis.api`, merged over ranks by `advisor.analysis.ranks`)."""

    schema_version: int = ANALYSIS_SCHEMA_VERSION
    source: dict | None = optional()  # the trace files read: kineto, et, meta
    device: dict | None = optional()  # type, name, bandwidth_Bps, launch_us, bandwidth_source
    steady_state: dict | None = optional()  # iterations, where the iteration boundary came from
    totals: dict | None = optional()  # per iteration: kernels, time, by class, memory-bound share
    estimate: dict | None = optional()  # what the estimates are made on (basis, device model)
    unknown_ops: list | None = optional()
    communication: list | None = optional()  # collectives per iteration (a distributed job's trace)
    communication_time: CommunicationTime | None = optional()  # communication against compute, per iteration
    low_confidence: bool | None = optional()  # dataflow guessed from shapes and order (no execution trace)
    warnings: tuple[str, ...] | None = optional()
    timeline: list | None = optional()
    candidates: tuple[Candidate, ...] = ()
    # what the fusion rules found and refused; absent where they refused nothing
    refused: tuple[Refusal, ...] | None = optional()
    # attention that ran SDPA's math backend (a GPU trace), and why where the trace shows it; absent where none did
    math_attention: list | None = optional()
    distributed: DistributedSummary | None = optional()  # a merged analysis: each rank's (`advisor.analysis.ranks`)

    @classmethod
    def from_json(cls, doc: dict) -> "AnalysisDoc":
        return codec.from_json(cls, doc, ANALYSIS_FILE)

    def to_json(self) -> dict:
        return codec.to_json(self)


class SelectionState(str, Enum):
    """A state selection can hand a patched model back in (`advisor.workflows.selection`)."""

    ALL = "all"  # every patched pattern
    KEPT = "kept"  # the patterns shown to save time alone
    CAPTURED = "captured"  # the layer captures replayed, every site on its original ops
    WHOLE = "whole"  # the whole stack as one capture, every pattern
    WHOLE_KEPT = "whole_kept"
    WHOLE_CAPTURED = "whole_captured"

    def __str__(self) -> str:
        return self.value

    @property
    def outer(self) -> bool:
        """The whole stack captured as one graph, not the layer captures."""
        return self.value.startswith("whole")


@dataclass(frozen=True, kw_only=True)
class Selection:
    """What selection handed back, and why (apply.json's `selection`). `state` is None where nothing was
    timed to choose by (every patched pattern kept) or nothing was kept."""

    all_patched: dict | None = optional()  # the every-pattern state as the first timed run measured it
    outer_sites: dict | None = optional()  # {pattern key: sites} the whole-stack capture launched
    outer_check: str | None = optional()  # how the whole-stack capture's outputs compared
    alone_in_layers: str | None = optional()  # why each pattern alone was timed in the layer captures
    states: dict | None = optional()  # {state: median ms} of the first timed run
    final: dict | None = optional()  # the final comparison: {state: median ms, "margin_ms": {...}}
    decision: str
    state: SelectionState | None = optional()
    outer: bool | None = optional()  # the state chosen runs the whole-stack capture
    enabled: tuple[str, ...] | None = optional()  # the pattern keys running (None: every one)
    kept: tuple[str, ...] = ()  # the candidates running
    before_ms: float | None = optional()
    after_ms: float | None = optional()
    # optimize(..., inductor=None) on a GPU: each route's speedup over the unpatched model and the one taken
    route: dict | None = optional()

    @classmethod
    def from_json(cls, doc: dict) -> "Selection":
        return codec.from_json(cls, doc, "selection")

    def to_json(self) -> dict:
        return codec.to_json(self)


@dataclass(frozen=True, kw_only=True)
class ApplyDoc:
    """apply.json: the results per candidate (`patterns`) and, from `optimize` and `apply`, the plan to
    re-apply (`manifest`, `enabled`, `outer`), its checks, selection and timings. A field a producer does
    not reach is not written."""

    schema_version: int = APPLY_SCHEMA_VERSION
    generator: str | None = optional()  # the generator version (`generate`)
    replacement: str | None = optional()  # kernel | program | subgraph
    device: str | None = optional()
    script: str | None = optional()  # `apply`: the user's script and its arguments
    args: tuple[str, ...] | None = optional()
    patterns: tuple[PatternResult, ...] = ()
    manifest: list | None = optional()  # one entry per patched module and pattern (`advisor.patching.plan`)
    # patched vs unpatched outputs, one record per call compared (`optimize` compares one call)
    checks: list | None = optional()
    errors: list | None = optional()  # `apply`: what went wrong re-running the script
    end_to_end: dict | None = optional()
    phases_s: dict | None = optional()  # wall seconds per step
    plan_reused: bool | None = optional()
    plan_key: str | None = optional()
    plan_key_parts: dict | None = optional()
    selection: Selection | None = optional()
    training: dict | None = optional()
    runs: dict | None = optional()
    enabled: tuple[str, ...] | None = optional()  # the pattern keys selection left running (None: every one)
    outer: bool | None = optional()
    # `optimize(..., inductor=True or a mode such as "max-autotune")`: Inductor compiles around the kernels
    inductor: bool | str | None = optional()
    inductor_graphs: dict | None = optional()  # per outcome ("compiled", or why a graph runs op by op): graphs
    attention_layouts: dict | None = optional()  # attention inputs laid out for SDPA's fused kernels, why: graphs
    gemm_epilogues: dict | None = optional()  # linear + activation run as one cuBLASLt GEMM, why: sites
    dynamic: bool | None = optional()  # `optimize`: new shapes past the capture budget run Inductor's dynamic compile
    skipped_targets: dict | None = optional()
    train: bool | None = optional()
    modes: str | None = optional()
    graphs: list | None = optional()
    cuda_graphs_not_used: dict | None = optional()
    fallbacks: dict | None = optional()
    host_modules: list | None = optional()
    decode: dict | None = optional()
    isolation: dict | None = optional()
    distributed: dict | None = optional()

    @classmethod
    def from_json(cls, doc: dict) -> "ApplyDoc":
        if isinstance(doc, dict) and "check" in doc and "checks" not in doc:
            # `optimize` wrote its one comparison as `check` before it was `checks` (plans in bundles and the
            # plan cache outlive that): read as a list of one
            old = doc["check"]
            doc = {**{k: v for k, v in doc.items() if k != "check"}, **({"checks": [old]} if old is not None else {})}
        return codec.from_json(cls, doc, APPLY_FILE)

    def to_json(self) -> dict:
        return codec.to_json(self)

    def replace(self, **changes) -> "ApplyDoc":
        return dataclasses.replace(self, **changes)


def write_analysis(out_dir: Path, doc: AnalysisDoc) -> Path:
    """OUT/analysis.json, atomically; the one writer of that file."""
    return write_json(Path(out_dir) / ANALYSIS_FILE, doc.to_json())


def write_apply(out_dir: Path, doc: ApplyDoc) -> Path:
    """OUT/apply.json, atomically; the one writer of that file."""
    return write_json(Path(out_dir) / APPLY_FILE, doc.to_json())


def read_apply(out_dir: Path) -> ApplyDoc | None:
    """OUT/apply.json as a record; None where there is none, or none this version can read."""
    try:
        return ApplyDoc.from_json(json.loads((Path(out_dir) / APPLY_FILE).read_text()))
    except (OSError, json.JSONDecodeError, RecordError):
        return None

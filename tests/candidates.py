"""Finding fusion candidates in tests by what they are: the `kind` and the aten op sequence (`ops`) that
analysis.json records for each candidate. A title is display text (its wording may change while the
pattern stays the same), so tests select by structure and keep titles for checking what a report shows.
apply.json's pattern records carry neither field: `candidates_of` joins them to their candidates."""
from __future__ import annotations

from dataclasses import dataclass


def op_names(c: dict) -> list[str]:
    """`aten::relu_` -> `relu_`: a candidate's ops, in order, without the namespace."""
    return [op.split("::")[-1] for op in c["ops"]]


def pattern_labels(c: dict) -> list[str]:
    """The op labels of a candidate's canonical signature (`pattern`), in the order of `ops`: a cast reads as
    the dtype it casts to (`to_fp32`), `clamp_min(0)` as `relu`."""
    chain = c["pattern"].split("|")[0]
    return [part.split("(", 1)[0] for part in chain.split("; ")]


def _plain(name: str) -> str:
    """An in-place op counts as its op (`add_` is an add); `_to_copy` keeps its leading underscore."""
    return name.rstrip("_")


@dataclass(frozen=True)
class Structure:
    """What a candidate must be: its kind (pointwise, reduction, norm, epilogue, attention, matmul_reduction),
    its exact op sequence, ops it must contain (in any order), and the op it starts with."""
    kind: str | None = None
    ops: tuple[str, ...] | None = None
    has: tuple[str, ...] = ()
    first: str | None = None

    def matches(self, c: dict) -> bool:
        names = op_names(c)
        plain = [_plain(n) for n in names]
        return ((self.kind is None or c["kind"] == self.kind)
                and (self.ops is None or names == list(self.ops))
                and set(self.has) <= set(plain)
                and (self.first is None or plain[:1] == [self.first]))


# The patterns the tests look for by name, by structure. RMSNorm reads as pow/mean/rsqrt in ops however the
# model spells it; "residual" is an add feeding the row op, the first op of the group.
RMS_OPS = ("pow", "mean", "rsqrt")
RESIDUAL_RMSNORM = Structure(kind="norm", has=RMS_OPS, first="add")
RMSNORM = Structure(kind="norm", has=RMS_OPS, first="pow")  # fp32 (the tests' tiny models): no cast before pow
RESIDUAL_LAYERNORM = Structure(kind="norm", has=("layer_norm",), first="add")
SWIGLU = Structure(kind="pointwise", has=("silu", "mul"))
ROTARY = Structure(kind="pointwise", has=("neg", "cat"))
TANH_GELU = Structure(kind="pointwise", has=("pow", "tanh"))  # GPT-2's GELU, spelled out in pointwise ops
ATTENTION = Structure(kind="attention")
SOFTMAX_MASK = Structure(kind="reduction", ops=("add", "add", "softmax"))  # scores + bias + mask, softmax


def find_candidates(cands: list[dict], structure: Structure | None = None, **fields) -> list[dict]:
    """The candidates that match `structure` (or a Structure of `fields`), in their order."""
    structure = structure or Structure(**{k: tuple(v) if k in ("ops", "has") else v for k, v in fields.items()})
    return [c for c in cands if structure.matches(c)]


def find_candidate(cands: list[dict], structure: Structure | None = None, **fields) -> dict:
    """The one candidate that matches; fails naming every candidate's structure otherwise."""
    hits = find_candidates(cands, structure, **fields)
    assert len(hits) == 1, f"{len(hits)} candidates match {structure or fields}: {describe(cands)}"
    return hits[0]


def describe(cands: list[dict]) -> list[str]:
    """Each candidate as `c3 norm: add → pow → …`, for failure messages."""
    return [f"{c.get('id')} {c['kind']}: {' → '.join(op_names(c))}" for c in cands]


def candidates_of(records: list[dict], doc: dict) -> list[dict]:
    """The analysis.json candidate of each apply.json pattern record (joined on pattern_id), in order."""
    by_pattern = {c["pattern_id"]: c for c in doc["candidates"]}
    return [by_pattern[r["pattern_id"]] for r in records]


def with_extended(cands: list[dict], doc: dict) -> list[dict]:
    """`cands` and the pointwise candidate each epilogue among them extends: a patched `linear → silu → mul`
    epilogue fuses the SwiGLU chain too (which of the two ranks first, and takes the ops, varies with noise)."""
    by_id = {c["id"]: c for c in doc["candidates"]}
    return cands + [by_id[c["extends"]] for c in cands if c.get("extends") in by_id]

"""The records stages exchange after analysis (`advisor.records`): each is read from its JSON and written
back exactly (analysis.json's candidates, apply.json's patterns), and a kind, status or key outside the
vocabulary is refused with the offending value named."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from advisor.analysis.api import analyze
from advisor.jsonio import write_json
from advisor.records import Candidate, Kind, PatternResult, RecordError, Verdict, candidates_of
from advisor.status import Status

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"
TRACES = sorted(SAMPLES.rglob("trace"))


@pytest.fixture(scope="module")
def analyses() -> dict:
    return {str(t.parent.relative_to(SAMPLES)): analyze(t).doc for t in TRACES}


def test_every_sample_candidate_round_trips(analyses):
    assert len(analyses) == 21
    kinds = set()
    for name, doc in analyses.items():
        for c in doc["candidates"]:
            record = Candidate.from_json(c)
            # the same JSON text, key order included: writing records back changes no file
            assert json.dumps(record.to_json()) == json.dumps(c), (name, c["id"])
            kinds.add(record.kind)
        assert [c.id for c in candidates_of(doc)] == [c["id"] for c in doc["candidates"]]
    # every kind is written by some sample (matmul_reduction: SPLADE's head; attention: the eager BERT and GPT-2)
    assert kinds == set(Kind), kinds


def test_pattern_results_round_trip_through_apply_json(analyses, tmp_path):
    """The workflows' stand-in path (no generator): results for a GPU trace's candidates, the negligible
    ones refused with a verdict, then every one given a verdict, written as apply.json and read back."""
    from advisor.workflows.kernels import kernel_specs
    from advisor.workflows.outcome import interpreter_only

    doc = analyses["hf_llama"]
    specs, results = kernel_specs(doc, len(doc["candidates"]), "program", tmp_path, "cuda")
    assert {r.code for r in results} == {None, Status.NOT_WORTH}  # the mask arithmetic is not worth a patch
    final = interpreter_only(results, specs)
    assert all(r.verdict is not None and r.sites == 0 and r.patched is False for r in final)
    kept = dataclasses.replace(final[0], applied_alone={"ms": 1.0, "saved_us_per_iter": 3.0}, kept=True)
    final = [kept.with_verdict(Status.PATCHED, "patched")] + final[1:]
    write_json(tmp_path / "apply.json", {"patterns": [r.to_json() for r in final]})
    written = json.loads((tmp_path / "apply.json").read_text())["patterns"]
    assert [PatternResult.from_json(p) for p in written] == final
    assert list(written[0])[-4:] == ["status_code", "status", "applied_alone", "kept"]  # apply.json's order
    assert written[0]["status_code"] == "patched" and "verdict" not in written[0]
    assert "kept" not in written[1]  # a field the run never reached is not written


def test_a_kind_outside_the_vocabulary_is_refused(analyses):
    c = dict(analyses["cpu/seed"]["candidates"][0], kind="fusion")
    with pytest.raises(RecordError, match=r"kind 'fusion' is not a known Kind \(one of: pointwise, .*matmul_reduction, padded_matmul\)"):
        Candidate.from_json(c)
    with pytest.raises(RecordError, match=r"keys this version does not know: 'colour'"):
        Candidate.from_json(dict(analyses["cpu/seed"]["candidates"][0], colour="red"))
    with pytest.raises(RecordError, match=r"lacks 'kind'"):
        Candidate.from_json({"id": "c1"})


def test_a_status_outside_the_vocabulary_is_refused():
    with pytest.raises(RecordError, match=r"status_code 'maybe' is not a known Status \(one of: patched, "):
        PatternResult.from_json({"candidate": "c1", "status_code": "maybe", "status": "who knows"})
    with pytest.raises(RecordError, match=r"status without status_code"):
        PatternResult.from_json({"candidate": "c1", "status": "not patched: its ops were not found"})
    with pytest.raises(RecordError, match=r"status_code 'kept'"):
        Verdict("kept", "words")
    assert Verdict("not_kept", "slower").code is Status.NOT_KEPT


def test_records_are_frozen(analyses):
    c = Candidate.from_json(analyses["cpu/seed"]["candidates"][0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.kind = Kind.NORM
    r = PatternResult(candidate=c.id, pattern_id=c.pattern_id)
    assert r.with_verdict(Status.NOT_GENERATED, "no kernel") != r and r.verdict is None

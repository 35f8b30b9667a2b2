"""The scale path, on small inputs: the streaming parser against a whole-document parse, its fallback on
layouts it does not know, and the synthetic trace generator round-tripping through the analyzer.
No timings here: bench/scale.py measures those."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

from advisor.analysis.api import analyze
from advisor.trace import load as load_mod
from advisor.trace.load import load_trace

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_traces"
WORKLOADS = ["seed", "mlp_block", "hf_llama", "hf_gpt2", "hf_bert", "timm_vit", "tv_resnet50"]
TRACES = [SAMPLES / d / w for d in ("", "cpu") for w in WORKLOADS]


def _synth():
    spec = importlib.util.spec_from_file_location("synth_trace", ROOT / "bench" / "synth_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _comparable(df: pd.DataFrame) -> pd.DataFrame:
    """Object cells (lists, tuples, scalars) compared by repr; categoricals by value."""
    out = {}
    for c in df.columns:
        col = df[c]
        if isinstance(col.dtype, pd.CategoricalDtype):
            out[c] = col.astype(str).to_numpy()
        elif col.dtype == object:
            out[c] = [repr(x) for x in col]
        else:
            out[c] = col.astype("float64" if col.dtype.kind == "f" else "int64").to_numpy()
    return pd.DataFrame(out)


def assert_same_trace(a, b) -> None:
    for name in ("ops", "kernels", "runtime", "modules"):
        pd.testing.assert_frame_equal(_comparable(getattr(a, name)), _comparable(getattr(b, name)), obj=name)
    cols = ["id", "name", "parent", "rf_id", "schema"]
    pd.testing.assert_frame_equal(_comparable(a.et_nodes[cols]), _comparable(b.et_nodes[cols]), obj="et_nodes")
    pd.testing.assert_frame_equal(_comparable(a.et_args), _comparable(b.et_args), obj="et_args")
    assert a.device_properties == b.device_properties


@pytest.mark.parametrize("path", TRACES, ids=[f"{p.parent.name}/{p.name}" for p in TRACES])
def test_streaming_parse_equals_full_parse(path, monkeypatch):
    full = load_trace(path, stream=False)

    def no_generic(*a, **k):
        raise AssertionError("a chunk of a torch-written trace left the fast path")

    monkeypatch.setattr(load_mod, "_parse_chunk", no_generic)
    streamed = load_trace(path)
    assert len(streamed.ops) and len(streamed.et_nodes)
    assert_same_trace(streamed, full)


def _rewrite(src: Path, dst: Path, **dump) -> Path:
    """A copy of a trace dir with both JSON files re-serialised by json.dumps(**dump)."""
    (dst / "trace").mkdir(parents=True)
    for name in ("kineto.json.gz", "et.json.gz"):
        doc = json.loads(gzip.decompress((src / "trace" / name).read_bytes()))
        (dst / "trace" / name).write_bytes(gzip.compress(json.dumps(doc, **dump).encode()))
    (dst / "trace" / "meta.json").write_bytes((src / "trace" / "meta.json").read_bytes())
    return dst


@pytest.mark.parametrize("dump", [{"separators": (",", ":")}, {"indent": 4}], ids=["minified", "indent4"])
def test_other_layouts_fall_back_to_full_parse(tmp_path, dump):
    src = SAMPLES / "hf_llama"
    other = load_trace(_rewrite(src, tmp_path / "t", **dump))
    assert_same_trace(other, load_trace(src))


def test_chunks_cut_only_between_elements(tmp_path, monkeypatch):
    # Tiny chunks: every element boundary case (a cut right after an element, elements longer than a chunk).
    from advisor.trace import stream

    monkeypatch.setattr(stream, "BLOCK", 4096)
    src = SAMPLES / "hf_llama"  # kernel events of 5 kB and more: longer than a block
    assert_same_trace(load_trace(src), load_trace(src, stream=False))


@pytest.mark.parametrize("name", ["hf_llama", "tv_resnet50"])
def test_nodes_of_one_template_differ_only_in_their_tensors(name, synthetic):
    # The downstream works out per Node.template what depends on the op and its argument shapes, dtypes and
    # scalars alone (signature parts, fusion domains, flops): that must be all two such nodes can differ in.
    from advisor.graph.dataflow import build_graph

    def static(n):
        uses = [(u.pos, u.bytes, u.shape, u.strides, u.dtype, u.offset) for u in n.reads + n.writes]
        return (n.op, n.schema, n.cls, n.inplace, len(n.reads), uses, [a if k == "s" else k for k, a in n.args])

    for path in [SAMPLES / name] + ([synthetic[3]] if name == "hf_llama" else []):
        nodes, seen = build_graph(load_trace(path)).nodes, {}
        for n in nodes:
            assert n.template >= 0
            assert seen.setdefault(n.template, static(n)) == static(n), (path, n.op)
        assert len(seen) < len(nodes)  # layers repeat: templates are shared


def test_truncated_stream_is_an_error(tmp_path):
    from advisor.errors import AdvisorError

    raw = gzip.decompress((SAMPLES / "seed" / "trace" / "kineto.json.gz").read_bytes())
    f = tmp_path / "kineto.json"
    f.write_bytes(raw[: len(raw) * 2 // 3])
    with pytest.raises(AdvisorError, match="not valid JSON"):
        load_trace(f)
    f.write_bytes(raw.replace(b'"dur": ', b'"dur": ,', 1))  # broken inside an event, layout intact
    with pytest.raises(AdvisorError, match="not valid JSON"):
        load_trace(f)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    synth = _synth()
    out = {}
    for copies in (1, 3):
        d = tmp_path_factory.mktemp(f"synth{copies}")
        synth.synthesize(d, copies, SAMPLES / "hf_llama")
        out[copies] = d
    return out


def test_synthetic_trace_keeps_torch_layout(synthetic):
    d = synthetic[3] / "trace"
    meta = json.loads((d / "meta.json").read_text())
    assert len(meta["steady_state"]["iterations"]) == 1 and meta["synthetic"]["copies"] == 3
    kineto = gzip.decompress((d / "kineto.json.gz").read_bytes())
    doc = json.loads(kineto)
    assert kineto.count(b'\n  {\n    "ph": "X", "cat": "kernel"') == sum(e.get("cat") == "kernel" for e in doc["traceEvents"])
    et = json.loads(gzip.decompress((d / "et.json.gz").read_bytes()))
    assert len({n["id"] for n in et["nodes"]}) == len(et["nodes"])  # fresh ids: no two nodes share one
    ext = [e["args"]["External id"] for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
    assert len(set(ext)) == len(ext)


def test_synthetic_copies_multiply_the_candidates(synthetic):
    source = analyze(SAMPLES / "hf_llama").doc
    one, three = analyze(synthetic[1]).doc, analyze(synthetic[3]).doc
    assert three["steady_state"]["iterations"] == 1
    assert three["totals"]["kernels"] == 3 * one["totals"]["kernels"]

    def key(c):
        return c["pattern_id"]

    for base, doc, copies in ((source, one, 1), (one, three, 3)):
        assert sorted(map(key, doc["candidates"])) == sorted(map(key, base["candidates"]))
        by_id = {key(c): c for c in base["candidates"]}
        for c in doc["candidates"]:
            b = by_id[key(c)]
            assert (c["title"], c["ops"], c["kernels"]) == (b["title"], b["ops"], b["kernels"])
            for f in ("occurrences", "kernels_saved", "bytes_unfused", "bytes_fused", "bytes_saved"):
                assert c[f] == copies * b[f], (c["title"], f)
            if base is one:  # the same iteration repeated: times add up too
                assert c["measured_time_us"] == pytest.approx(3 * b["measured_time_us"], rel=1e-9)


def test_profile_calls_stops_the_profiler_early(tmp_path):
    # FUSION_ADVISOR_PROFILE_CALLS / profile_calls: only the first n outermost module calls are profiled.
    from advisor.collect.runner import profile_script

    script = tmp_path / "loop.py"
    script.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.relu(x + 1).exp()\n"
        "m, x = M(), torch.randn(256)\n"
        "for _ in range(8):\n"
        "    m(x)\n"
    )
    meta = profile_script(script, [], out_dir=tmp_path / "out", device="cpu", profile_calls=3)
    assert meta["complete"] and meta["profile_calls"] == 3
    assert meta["steady_state"]["found"] == 3 and len(meta["steady_state"]["iterations"]) == 2
    (c,) = analyze(tmp_path / "out").doc["candidates"]
    assert c["ops"] == ["aten::add", "aten::relu", "aten::exp"] and c["occurrences"] == 1


def test_et_worker_process_gives_the_same_trace(monkeypatch, tmp_path):
    from advisor.errors import AdvisorError

    monkeypatch.setattr(load_mod, "ET_WORKER_BYTES", 0)  # every ET goes to the second process
    src = SAMPLES / "hf_gpt2"
    assert_same_trace(load_trace(src), load_trace(src, stream=False))
    bad = tmp_path / "et.json"
    bad.write_text('{\n  "schema": "1.1.1-chakra.0.0.4",\n  "nodes": [\n      {\n        "id": 1,')
    with pytest.raises(AdvisorError, match="truncated"):
        load_trace(src / "trace" / "kineto.json.gz", et=bad)

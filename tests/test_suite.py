"""bench/suite.py (issue 7) end to end on the CPU with quick shapes, and its reporting on GPU-like results.

The end-to-end run is the one the issue's CPU check asks for: `--quick --device cpu --workloads
seed,mlp_block,hf_llama` in a subprocess (each workload in its own child process, generated kernels in
Triton's interpreter, torch.compile's C++ backend); about 1.5-2 minutes on 2 cores.
"""
from __future__ import annotations

import re
import itertools
import json
import math
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import suite  # noqa: E402
from bench.workloads import NAMES, main_output  # noqa: E402

WORKLOADS = ["seed", "mlp_block", "hf_llama"]
COLUMNS = ["workload", "shape", "eager ms", "torch.compile ms", "compile s", "fusion-advisor ms", "advisor × eager",
           "compile × eager", "advisor cold s: empty cache", "advisor cold s: warm cache",
           "max rel err advisor / compile", "kernels/iter eager / advisor / compile", "patterns kept / patched",
           "status"]


def _run(tmp, *args, timeout=420):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FUSION_ADVISOR_CACHE", None)
    proc = subprocess.run([sys.executable, "-m", "bench.suite", "--quick", "--device", "cpu",
                           "--out", str(tmp), "--logs", str(tmp / "logs"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=str(tmp))
    return proc


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("suite")
    proc = _run(tmp, "--workloads", ",".join(WORKLOADS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp, proc


def test_quick_run_writes_json_lines_as_it_goes(quick_run):
    tmp, proc = quick_run
    lines = (tmp / "bench-cpu-quick.jsonl").read_text().splitlines()
    assert [json.loads(ln)["workload"] for ln in lines] == WORKLOADS


def test_quick_run_json_has_sane_values(quick_run):
    tmp, _ = quick_run
    doc = json.loads((tmp / "bench-cpu-quick.json").read_text())
    assert doc["timing_meaningful"] is False and doc["device"] == "cpu" and doc["quick"] is True
    assert doc["host"]["torch"] and doc["wall_s"] > 0
    by = {r["workload"]: r for r in doc["workloads"]}
    assert list(by) == WORKLOADS
    for name, r in by.items():
        assert r["status"] == "ok", (name, r.get("errors"), r.get("log_tail"))
        assert r["timing_meaningful"] is False and "interpreter" in r["timing_note"]
        for part in ("eager", "advisor", "compile"):
            t = r[part]
            assert t["median_ms"] > 0 and t["spread_ms"] >= 0 and t["timing"]["method"] == "perf_counter", (name, part)
            assert t["timing"]["iters"] >= 3
            assert t["kernels_per_iter"] is None  # no GPU: nothing to count
        # no speedup claims on the CPU
        assert r["advisor"]["speedup"] is None and r["compile"]["speedup"] is None
        assert "end_to_end" not in r["advisor"]
        # cold starts: empty cache (this process), warm cache (a second process), torch.compile's first call
        assert r["advisor"]["cold_empty_s"] > 0 and r["advisor"]["cold_warm_s"] > 0, name
        assert r["compile"]["first_call_s"] > 0
        # (the analyzer ranks by measured times, so a second run may pick a candidate the first did not
        # generate: the cache can grow, and the report says by how much)
        assert r["warm_status"] == "ok" and r["warm"]["cache_files_after"] >= r["warm"]["cache_files_before"]
        # fp32 on the CPU: both agree with eager to rounding
        for part in ("advisor", "compile"):
            assert r[part]["max_rel_err"] is not None and r[part]["max_rel_err"] < 1e-4, (name, part, r[part])
            assert r[part]["nonfinite_mismatch"] == 0
        assert r["advisor"]["check"]["ok"]
        assert isinstance(r["advisor"]["kept"], list)
        for p in r["advisor"]["patterns"]:
            assert {"candidate", "title", "est_us", "measured_us", "kept", "status"} <= set(p)
            assert p["measured_us"] is None  # not timed alone on the CPU
            assert p["kept"] == (p["patched"] and p["candidate"] in r["advisor"]["kept"])
    # the seed chain is one generated kernel; Llama gets several patterns
    assert [p["patched"] for p in by["seed"]["advisor"]["patterns"]] == [True]
    assert by["seed"]["advisor"]["cache_files"] > 0 and by["seed"]["warm"]["cache_files_before"] > 0
    assert by["seed"]["eager"]["output_all_finite"] is False  # log(relu(.)) of negatives: -inf, same in all three
    assert sum(p["patched"] for p in by["hf_llama"]["advisor"]["patterns"]) >= 3
    s = doc["summary"]
    assert s["geomean_advisor"] is None and s["geomean_compile"] is None and "targets" not in s


def test_quick_run_markdown_and_tail(quick_run):
    tmp, proc = quick_run
    md = (tmp / "bench-cpu-quick.md").read_text()
    header = next(ln for ln in md.splitlines() if ln.startswith("| workload |"))
    assert [c.strip() for c in header.strip("|").split("|")] == COLUMNS
    assert "not meaningful" in md and "no speedup is claimed" in md
    rows = _table_rows(md, "| workload |")
    assert len(rows) == 3
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[6] == "—" and cells[7] == "—"  # no speedup columns filled
        assert cells[2].endswith("*") and cells[3].endswith("*") and cells[5].endswith("*")
        assert float(cells[4]) > 0 and float(cells[8]) > 0 and float(cells[9]) > 0  # cold starts
        assert cells[-1] == "ok"
    assert "geometric mean" not in md  # no speedups, no means of them
    assert "### HF `LlamaForCausalLM` (`hf_llama`)" in md and "Residual add + RMSNorm" in md
    out = proc.stdout
    tail = out[out.index("workload  "):]
    assert all(w in tail for w in WORKLOADS) and "no speedup claimed" in tail
    assert "bench-cpu-quick.md" in tail


def _table_rows(md: str, header: str) -> list[str]:
    lines = md.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    rows = []
    for ln in lines[i + 2:]:
        if not ln.startswith("|"):
            break
        rows.append(ln)
    return rows


@pytest.mark.skipif(find_spec("timm") is not None or find_spec("torchvision") is not None,
                    reason="timm or torchvision is installed here (the merged run would be long)")
def test_merge_keeps_earlier_workloads_and_missing_packages_are_not_fatal(quick_run, tmp_path):
    import shutil

    src, _ = quick_run
    for f in src.glob("bench-cpu-quick.*"):
        shutil.copy(f, tmp_path / f.name)
    proc = _run(tmp_path, "--workloads", "tv_resnet50,timm_vit", "--merge", "--no-compile", timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "bench-cpu-quick.json").read_text())
    assert [r["workload"] for r in doc["workloads"]] == ["seed", "mlp_block", "hf_llama", "timm_vit", "tv_resnet50"]
    assert len({r["run"] for r in doc["workloads"]}) == 2
    assert len((tmp_path / "bench-cpu-quick.jsonl").read_text().splitlines()) == 5
    for r in doc["workloads"][3:]:
        pkg = "timm" if r["workload"] == "timm_vit" else "torchvision"
        assert r["status"] == "not installed" and pkg in r["reason"]
    md = (tmp_path / "bench-cpu-quick.md").read_text()
    assert "Rows come from 2 runs (`--merge`)" in md and "not installed: timm is not installed" in md


# ------------------------------------------------------------------ pieces, without child processes
def test_gpu_slug():
    assert suite.gpu_slug("cuda", "NVIDIA H100 80GB HBM3") == "h100"
    assert suite.gpu_slug("cuda", "NVIDIA H200") == "h200"
    assert suite.gpu_slug("cuda", "NVIDIA A100-SXM4-80GB") == "a100"
    assert suite.gpu_slug("cuda", "NVIDIA GeForce RTX 4090") == "4090"
    assert suite.gpu_slug("cpu", "x86_64") == "cpu"


def test_errors_vs_handles_infinities_and_scale():
    ref = torch.tensor([float("-inf"), 1.0, -4.0, 2.0])
    assert suite.errors_vs(ref, ref.clone())["max_rel_err"] == 0.0
    assert ref[0] == float("-inf")  # the reference is never written to
    e = suite.errors_vs(ref, torch.tensor([float("-inf"), 1.0, -4.0, 2.04]))
    assert math.isclose(e["max_rel_err"], 0.01, rel_tol=1e-4) and e["nonfinite_mismatch"] == 0
    assert suite.errors_vs(ref, torch.tensor([0.0, 1.0, -4.0, 2.0]))["nonfinite_mismatch"] == 1
    assert suite.errors_vs(ref, torch.zeros(3))["max_rel_err"] is None


def test_interleaved_and_time_limit():
    calls = []
    t = suite.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, "cpu", 6, 3, 0.0)
    assert t["a"]["iters"] == 6 and t["a"]["rounds"] == 3 and len(t["a"]["round_medians_ms"]) == 3
    # one warm-up call each, then 3 rounds of 3 calls each (1 untimed + 2 timed): a then b, b then a, a then b
    # (ABBA: the second round's b follows the first's, its a the third's); never all of a's rounds first
    runs = [(name, len(list(g))) for name, g in itertools.groupby(calls)]
    assert runs == [("a", 1), ("b", 1), ("a", 3), ("b", 6), ("a", 6), ("b", 3)], runs
    import time

    with pytest.raises(suite.PhaseTimeout):
        with suite.time_limit(0.2, "x", floor=0.1):
            time.sleep(3)
    with suite.time_limit(float("inf"), "no limit"):
        pass


def test_main_output_picks_logits():
    x = torch.ones(2)
    assert main_output(x) is x
    assert main_output((x, None)) is x
    assert main_output({"a": 1}) is None and set(NAMES) >= set(WORKLOADS)


def _gpu_result(name, eager, adv, comp, warm_s, patterns, status="ok"):
    return {"workload": name, "title": name, "shape": "s", "status": status, "errors": {}, "skipped": {},
            "eager": {"median_ms": eager, "spread_ms": 0.02, "kernels_per_iter": {"kernels": 300}},
            "advisor": {"median_ms": adv, "spread_ms": 0.02, "speedup": eager / adv, "cold_empty_s": 9.0,
                        "cold_warm_s": warm_s, "patched": len(patterns), "kept": [p["candidate"] for p in patterns
                                                                                 if p["kept"]],
                        "patterns": patterns, "max_rel_err": 0.004, "decision": "kept: ...",
                        "end_to_end": {"measured_saved_us": 900.0, "est_saved_us_kept": 1000.0, "ratio": 0.9},
                        "kernels_per_iter": {"kernels": 200}},
            "compile": {"median_ms": comp, "spread_ms": 0.03, "speedup": eager / comp, "first_call_s": 16.0,
                        "max_rel_err": 0.005, "kernels_per_iter": {"kernels": 100}},
            "warm_status": "ok"}


def _pat(cid, title, est, meas, kept):
    p = {"candidate": cid, "title": title, "est_us": est, "measured_us": meas, "measured_spread_us": 3.0,
         "patched": True, "kept": kept, "sites": 4, "status": "patched",
         "matmul_epilogue": "epilogue" in title}
    p["measured_over_est"] = meas / est
    p["within_25pct"] = abs(meas / est - 1) <= 0.25
    return p


def test_summary_and_markdown_on_gpu_like_results():
    results = [
        _gpu_result("seed", 2.5, 1.1, 1.12, 0.8, [_pat("c1", "Pointwise chain: add → relu → log", 1400, 1390, True)]),
        _gpu_result("hf_llama", 12.5, 9.0, 8.1, 2.5,
                    [_pat("c1", "Rotary embedding: mul → neg", 230, 120, True),
                     _pat("c4", "linear epilogue (SwiGLU): linear → silu → mul", 39, -15, False)]),
        _gpu_result("hf_bert", 8.4, 8.5, 19.8, 1.0, []),
        {"workload": "timm_vit", "status": "not installed", "reason": "timm is not installed"},
    ]
    results[2]["advisor"]["spread_ms"] = 0.15  # bert: 0.1 ms slower, within the noise
    s = suite.summarise(results, True)
    assert s["geomean_over"] == ["seed", "hf_llama", "hf_bert"] and s["missing"] == ["timm_vit"]
    expect = math.exp((math.log(2.5 / 1.1) + math.log(12.5 / 9.0) + math.log(8.4 / 8.5)) / 3)
    assert math.isclose(s["geomean_advisor"], expect)
    met = [x["met"] for x in s["targets"]]
    assert met[0] is True  # advisor geomean above compile's here
    assert met[1] is True and "hf_bert 0.99× (within the noise" in s["targets"][1]["detail"]  # said, not hidden
    results[2]["advisor"]["median_ms"] = 8.6
    results[2]["advisor"]["speedup"] = 8.4 / 8.6
    s = suite.summarise(results, True)
    met = [x["met"] for x in s["targets"]]
    assert met[1] is False and "hf_bert 0.98× (beyond the noise" in s["targets"][1]["detail"]
    expect = math.exp((math.log(2.5 / 1.1) + math.log(12.5 / 9.0) + math.log(8.4 / 8.6)) / 3)
    assert met[2] is False and "1.39" in s["targets"][2]["detail"]  # Llama below 1.5x
    assert met[3] is False and "hf_llama 2.5 s" in s["targets"][3]["detail"]
    assert met[4] is True and "0 kept of 1 patched" in s["targets"][4]["detail"]
    # issue 16's target is over the kept patterns (llama c4, measured but not kept, is said beside it)
    assert met[5] is False and "hf_llama c1 0.52x" in s["targets"][5]["detail"]
    assert "c4" not in s["targets"][5]["detail"].split("; every")[0]
    assert "resolves ±25% (its spread under a quarter of the estimate) for 2 of them, 1 of those within" \
        in s["targets"][5]["detail"]  # spread 3 µs: every pattern here resolved
    assert "every measured pattern (kept or not): 1 of 3 within" in s["targets"][5]["detail"]
    results[1]["advisor"]["patterns"][0]["measured_spread_us"] = 120.0  # llama c1's rounds moved half its estimate
    detail = suite.summarise(results, True)["targets"][5]["detail"]
    assert "1 of 2 kept within" in detail and "for 1 of them, 1 of those within" in detail
    doc = {"host": {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11"}, "summary": s, "timing_meaningful": True,
           "workloads": results, "quick": False, "generated": "now", "command": "python -m bench.suite",
           "budget_s": 560, "top": 8, "iters": 30, "wall_s": 500}
    md = suite.markdown(doc)
    assert "**geometric mean** (3 workloads)" in md and f"**{expect:.2f}×**" in md
    assert "| no workload slower than eager | **no** |" in md
    assert "2.27×" in md  # seed 2.5 / 1.1
    assert "0.52 (off)" in md and "not installed" in md
    results[1]["advisor"]["patterns"][0]["measured_us"] = 220.0  # now within: 2 of 2 kept, the 80% met
    results[1]["advisor"]["patterns"][0]["measured_over_est"] = 220 / 230
    results[1]["advisor"]["patterns"][0]["within_25pct"] = True
    assert suite.summarise(results, True)["targets"][5]["met"] is True
    tail = suite.tail_table(doc)
    assert "geomean" in tail and "target MISSED: Llama >= 1.5x over eager" in tail
    doc["workloads"] = results + [_gpu_result("hf_bert_eager", 15.2, 8.8, 10.0, 1.5, [])]
    doc["summary"] = s = suite.summarise(doc["workloads"], True)
    assert s["geomean_over"] == ["seed", "hf_llama", "hf_bert"]  # issue 7's mean is not moved by issue 10's
    assert s["anchored"]["geomean_over"] == ["hf_bert_eager"] and math.isclose(s["anchored"]["geomean_advisor"], 15.2 / 8.8)
    md = suite.markdown(doc)
    assert "**geometric mean** (1 workloads, matmul-anchored (issue 10))" in md and "**1.73×**" in md
    assert "anchored" in suite.tail_table(doc)


# ------------------------------------------------------------------ selection, with timings made up
class _FakeChild:
    def __init__(self):
        self.r = {"advisor": {}, "skipped": {}, "errors": {}}

    def left(self):
        return 1e9


@pytest.fixture(scope="module")
def optimized_llama(tmp_path_factory, monkeypatch_module):
    from advisor.workflows.live_model import optimize
    from bench.workloads import build

    monkeypatch_module.setenv("FUSION_ADVISOR_CACHE", str(tmp_path_factory.mktemp("cache")))
    w = build("hf_llama", "cpu", quick=True)
    args, kwargs = w.args_kwargs()

    def call():
        with torch.inference_mode():
            return w.model(*args, **kwargs)

    report = optimize(w.model, w.inputs, top=6, out=tmp_path_factory.mktemp("opt"), interpret=True)
    assert len(report.applied) >= 2
    return w, call, report


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _fake_timings(monkeypatch, saves: dict, before: float, final: dict, noise: float = 0.01):
    """Fake clocks for selection's interleaved runs (time_configs): `before` ms unpatched, final[state] ms for
    each state named there (a state not named measures 1 ms slower than unpatched), and pattern `candidate`
    alone saves[candidate] µs (-5 µs where not named) against the state with no kernel it is measured in
    (the whole stack's where the run has it, else the layer captures')."""
    import advisor.measure.timing as timing

    def T(ms, sign=-1):  # five interleaved rounds spread `noise`; the unpatched model's drift the other way
        rounds = [ms + sign * noise * (i - 2) / 4 for i in range(5)]
        return timing.Timing(ms, 20, "fake clock", rounds, noise, rounds)

    asked = []

    def ms(k, configs):
        if k in final:
            return final[k]
        if re.fullmatch(r"c\d+", k):  # a pattern alone
            base = "whole_captured" if "whole_captured" in configs else "captured"
            return ms(base, configs) - saves.get(k, -5.0) / 1e3
        return before + 1.0

    def time_configs(call, configs, device, iters=20, rounds=5):
        asked.append(sorted(configs))
        return {k: T(before, 1) if k == "before" else T(ms(k, configs)) for k in configs}

    monkeypatch.setattr(timing, "timing_meaningful", lambda device: device == "cuda")
    monkeypatch.setattr(timing, "time_configs", time_configs)
    return asked


def _enabled(model) -> set | None:
    from advisor.patching import patched_modules

    states = {f.enabled for _, f in patched_modules(model)}
    assert len(states) <= 1, states
    return next(iter(states), "unpatched")


def _launches(model) -> dict:
    """{(site, caller): launcher calls so far} over the model's patched forwards (`launched_sites` compares two)."""
    from advisor.patching import patched_modules

    return {site: n for _, f in patched_modules(model) for site, n in f.log().launches().items()}


def test_choose_takes_the_fastest_state_beyond_noise():
    from advisor.workflows.selection import Option, choose, margin_ms

    before = [10.0, 10.1, 9.9]
    opts = [Option("all", None, 9.0, rounds_ms=(9.0, 9.1, 8.9)), Option("kept", frozenset({"a"}), 8.5, rounds_ms=(8.5, 8.6, 8.4)),
            Option("captured", frozenset(), 9.5, rounds_ms=(9.5, 9.6, 9.4))]
    assert choose(10.0, before, opts).name == "kept"
    # 1.5 ms better in the median, but round by round the difference moved 3.4 ms: not shown faster
    wobbly = Option("kept", frozenset({"a"}), 8.5, rounds_ms=(8.5, 11.9, 8.4))
    assert margin_ms(10.0, before, wobbly) == pytest.approx(1.65)
    assert choose(10.0, before, [wobbly]) is None
    # a host-bound model whose rounds moved 8 ms: every round still says 2x, and the pairs say so
    assert choose(11.0, [11.0, 19.0, 10.5], [Option("whole", None, 5.4, True, (5.4, 13.0, 5.1))]).name == "whole"
    assert choose(10.0, before, [Option("all", None, 9.95, rounds_ms=(9.95, 10.05, 9.85))]) is None  # under 1%
    # the unpatched model stalled in one round (a host-bound convnet): the paired spread is wide, but every
    # round shows the captures faster by more than 1%, which is what the spread would hide
    stalled = [7.8, 14.0, 6.5, 7.9, 7.7]
    captured = Option("captured", frozenset(), 5.6, rounds_ms=(5.5, 5.6, 5.5, 5.7, 5.5))
    assert margin_ms(7.8, stalled, captured) > 7.8 - 5.6 and choose(7.8, stalled, [captured]) is captured
    # ... and one round where it was slower: the wide spread decides, as above
    assert choose(7.8, stalled, [Option("captured", frozenset(), 5.6, rounds_ms=(5.5, 5.6, 5.5, 8.0, 5.5))]) is None
    assert choose(10.0, before, []) is None


def test_choose_prefers_fewer_patterns_the_timings_cannot_tell_from_the_fastest():
    from advisor.workflows.selection import Option, choose

    before = [10.0, 10.1, 9.9, 10.0, 10.05]
    every = Option("whole", None, 5.00, True, (5.0, 5.1, 4.9, 5.0, 5.02))
    kept = Option("whole_kept", frozenset({"a"}), 5.02, True, (5.05, 5.0, 5.02, 4.98, 5.03))
    # 20 µs apart in the median, rounds crossing: the one pattern shown to save time alone, not every one
    assert choose(10.0, before, [every, kept]) is kept
    # every pattern faster than the subset in every round by more than 1%: the fastest stays
    clearly = Option("whole", None, 4.5, True, (4.5, 4.6, 4.4, 4.5, 4.52))
    assert choose(10.0, before, [clearly, kept]) is clearly
    # only a subset of the same captures competes: the layer captures alone do not displace the whole stack
    captured = Option("captured", frozenset(), 5.03, False, (5.03, 5.0, 5.05, 5.02, 5.0))
    assert choose(10.0, before, [every, captured]) is every
    # the whole stack with no kernel, level with every kernel in it: the captures alone are handed back
    bare = Option("whole_captured", frozenset(), 5.01, True, (5.0, 5.05, 4.95, 5.01, 5.0))
    assert choose(10.0, before, [every, kept, bare]) is bare
    # ... but not where pattern "a" was shown to save time alone: the state keeping it is handed back
    assert choose(10.0, before, [every, kept, bare], shown=frozenset({"a"})) is kept


def test_patterns_launching_only_in_the_whole_stack_take_their_occurrences_there():
    from advisor.records import PatternResult
    from advisor.workflows.selection import launching

    records = [PatternResult(candidate="c5", patched=True), PatternResult(candidate="c7", patched=False),
               PatternResult(candidate="c3", patched=False)]
    key_of = {"c5": "k5", "c7": "k7", "c3": "k3"}
    assert launching(records, key_of, None) == {"c5"}
    assert launching(records, key_of, {"k5": 16, "k7": 1, "k3": 0}) == {"c5", "c7"}


def test_a_pattern_is_shown_to_save_time_alone_only_beyond_its_rounds():
    from advisor.measure.timing import Timing
    from advisor.records import PatternResult
    from advisor.workflows.selection import _timed_alone

    def T(rounds):
        return Timing(sorted(rounds)[2], 20, "fake clock", rounds, 0.0, rounds)

    r = PatternResult(candidate="c1", pattern_id="p", title="t", kernel_file=None, validated=True)
    base = T([4.20, 4.25, 4.22, 4.30, 4.21])
    steady = _timed_alone(r, T([4.10, 4.15, 4.12, 4.20, 4.11]), base, None).applied_alone
    assert steady["saved_us_per_iter"] == pytest.approx(100) and steady["shown"]
    # 20 µs in the median, rounds from -50 to +60: inside the noise, not shown
    noisy = _timed_alone(r, T([4.25, 4.23, 4.21, 4.26, 4.15]), base, None).applied_alone
    assert 0 < noisy["saved_us_per_iter"] < noisy["spread_us"] / 2 and not noisy["shown"]


def test_select_keeps_only_patterns_that_save_time_alone(optimized_llama, monkeypatch):
    from advisor.patching import patches_off
    from advisor.patching.capture import launched_sites

    w, call, report = optimized_llama
    patched = [p["candidate"] for p in report.patterns if p.get("patched")]
    first = patched[0]
    key = next(s.key for s in report.handle.plan.patterns if s.candidate == first)
    asked = _fake_timings(monkeypatch, {first: 20.0}, before=10.0, final={"all": 9.5, "kept": 9.0, "captured": 9.8})
    c = _FakeChild()
    suite.select_patterns(c, report, w.model, call, "cuda", True)
    adv = c.r["advisor"]
    # one interleaved run of the states (the whole stack, one outer capture over the layers, included) and
    # each pattern alone; then the pattern shown to save time alone, against the first run's leader
    alone = sorted(patched)
    assert asked[-2] == sorted(["all", "before", "captured", "whole", "whole_captured", *alone]), asked
    assert asked[-1] == ["all", "before", "kept", "whole_kept"]
    assert all(p["applied_alone"]["in"] == "whole stack" for p in report.patterns if p.get("patched"))
    assert adv["kept"] == [first] and adv["decision"].startswith("kept the 1 patterns"), adv["decision"]
    assert [p["candidate"] for p in adv["patterns"] if p["kept"]] == [first]
    # the state timed is the state handed back: the pattern shown, and those only the whole stack fuses (never
    # timed alone: nothing says they do not save time; the layer captures chosen here do not launch them)
    outer_only = report.handle.plan.outer_only_keys()
    assert outer_only and _enabled(w.model) == {key} | outer_only
    # the handed-back model runs the kept pattern's kernel, and only it, and computes what eager does
    with patches_off():
        ref = call()
    before = _launches(w.model)
    out = call()
    assert set(launched_sites(before, _launches(w.model))) == {key}
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    # no state beats the unpatched model by more than the noise: it runs eager again
    _fake_timings(monkeypatch, {}, before=10.0, final={"all": 9.8, "captured": 9.75}, noise=0.3)
    c = _FakeChild()
    suite.select_patterns(c, report, w.model, call, "cuda", True)
    assert c.r["advisor"]["kept"] == [] and c.r["advisor"]["decision"].startswith("nothing kept")
    assert all(p["status"].startswith("not kept") for p in report.patterns if p.get("patched"))
    assert _enabled(w.model) == "unpatched"


def test_select_marks_the_patterns_only_the_whole_stack_fuses_patched_when_it_is_chosen(optimized_llama, monkeypatch,
                                                                                       keep_traced_masks):
    """The suite selects as optimize does: when the whole stack measures fastest, the patterns only its outer
    capture fuses (occurrences across layers) are reported patched, not "fused only by the outer capture"."""
    from advisor.patching import patch

    w, call, report = optimized_llama
    report.handle = patch(w.model, report.handle.plan)  # every pattern on again (an earlier test unpatched it)
    keys = {s.candidate: s.key for s in report.handle.plan.patterns}
    outer_only = report.handle.plan.outer_only_keys()
    assert any(p["status"].startswith("not patched: its ops lie in") for p in report.patterns
               if keys.get(p["candidate"]) in outer_only)
    _fake_timings(monkeypatch, {}, before=10.0, final={"all": 9.0, "captured": 9.5, "whole": 6.0})
    c = _FakeChild()
    suite.select_patterns(c, report, w.model, call, "cuda", True)
    adv = c.r["advisor"]
    assert adv["selection"]["state"] == "whole", adv["decision"]
    cross = [p for p in adv["patterns"] if keys.get(p["candidate"]) in outer_only]
    assert cross and all(p["status"] == "patched" and p["kept"] for p in cross), cross
    assert set(adv["kept"]) >= {p["candidate"] for p in cross}


def test_select_keeps_the_captures_alone_when_they_are_what_is_faster(optimized_llama, monkeypatch):
    """Every pattern slower alone, the captured layers faster than eager (their CUDA-graph replay): the
    captures stay with every site on its original ops, and the decision says so."""
    from advisor.patching import patch
    from advisor.status import Status
    from advisor.workflows.selection import keep_faster

    w, call, report = optimized_llama
    handle = patch(w.model, report.handle.plan)
    records = report.results
    _fake_timings(monkeypatch, {}, before=10.0, final={"all": 7.0, "captured": 6.0})
    handle, sel, after = keep_faster(call, handle, "cuda", records)
    assert sel["state"] == "captured" and sel["kept"] == [] and "CUDA graphs" in sel["decision"]
    assert _enabled(w.model) == frozenset()
    assert all(r.code == Status.NOT_KEPT for r in after if r.patched) and after is not records
    # on the CPU nothing is selected: every patched pattern is kept, and said so
    patched = {r.candidate for r in records if r.patched}
    handle = patch(w.model, report.handle.plan)
    _, sel, _ = keep_faster(call, handle, "cpu", records)
    assert patched and set(sel["kept"]) == patched and "not meaningful" in sel["decision"]


def test_keep_faster_hands_back_its_timing_when_it_keeps_the_handle(optimized_llama, monkeypatch):
    """All patterns kept: the handle is the one timed, and the whole timing comes back with the decision,
    so `optimize(benchmark=True)` reports it instead of timing the same configurations again."""
    from advisor.workflows.selection import keep_faster

    w, call, report = optimized_llama
    records = report.results
    patched = {r.candidate for r in records if r.patched}
    asked = _fake_timings(monkeypatch, {cand: 10.0 for cand in patched}, before=10.0, final={"all": 9.0, "captured": 9.5})
    handle, sel, _ = keep_faster(call, report.handle, "cuda", records)
    assert handle is report.handle and set(sel["kept"]) == patched
    assert len(asked) == 1  # every pattern shown to save time alone: one interleaved run decided, no second
    assert sel["timing"]["before_ms"] == 10.0 and sel["timing"]["after_ms"] == 9.0


def test_patterns_alone_are_timed_in_the_layers_where_whole_stack_recordings_would_not_fit(optimized_llama,
                                                                                           monkeypatch):
    """Each state timed inside the whole stack keeps its own recording until selection ends: where those would
    not fit in the GPU's free memory, the patterns alone are timed in the layer captures, and the decision
    says so; the whole stack is still a state to choose."""
    import advisor.workflows.selection as selection
    from advisor.patching import patch

    w, call, report = optimized_llama
    handle = patch(w.model, report.handle.plan)
    patched = {r.candidate for r in report.results if r.patched}
    asked = _fake_timings(monkeypatch, {c: 10.0 for c in patched}, before=10.0,
                          final={"all": 9.0, "captured": 9.5, "whole": 6.0})
    monkeypatch.setattr(selection, "_fits", lambda device, nbytes: False)
    handle, sel, after = selection.keep_faster(call, handle, "cuda", report.results)
    assert "whole" in asked[0] and "alone_in_layers" in sel
    assert all(r.applied_alone["in"] == "layer captures" for r in after if r.patched)
    assert sel["state"] == "whole"


def test_zoo_estimates_say_which_measurements_can_judge_the_estimate():
    """bench/zoo.py's line: within ±25% over every kept pattern (the target), and over those whose
    measurement resolves ±25% at all (a host-bound model's rounds moved by more than a pattern's estimate)."""
    from bench import zoo

    def pattern(est, meas, spread, status="patched"):
        return {"status_code": status, "applied_alone": {"est_saved_us_per_iter": est, "saved_us_per_iter": meas,
                                                         "spread_us": spread}}

    doc = {"results": {"m": {"patterns": [pattern(1000, 1050, 40), pattern(250, 20, 3500), pattern(100, 60, 10),
                                          pattern(100, 100, 1, status="not_kept")]}}}
    line = zoo.estimates(doc)
    assert line.startswith("Estimate vs measured: 1 of 3 kept patterns within ±25%")
    assert "resolves ±25% (its spread under a quarter of the estimate) for 2 of them, 1 of those within" in line


def _states(names, entered: list) -> dict:
    """{name: a context factory that notes each entry into that state in `entered`} (time_configs' states)."""
    import contextlib

    def state(name):
        @contextlib.contextmanager
        def ctx():
            entered.append(name)
            yield
        return ctx
    return {n: state(n) for n in names}


def test_interleaved_rounds_reverse_their_order_every_other_round(monkeypatch):
    """A drift within a round (a host slowing down as it goes) must not always land on the same state:
    the configurations run in order, then reversed, round after round (ABBA)."""
    from advisor.measure import timing

    order = []
    monkeypatch.setattr(timing, "warm_up", lambda *a, **k: None)
    t = timing.time_configs(lambda: None, _states("abc", order), "cpu", iters=4, rounds=4)
    assert order == list("abccbaabccba") and all(len(t[n].rounds_ms) == 4 for n in "abc")


def test_the_warm_up_floor_is_paid_once_per_comparison_not_per_state(monkeypatch):
    """Selection times several states of one call; what its time floor waits for (clocks, the allocator)
    is the GPU's, so the floor is paid once (issue 17: selection is part of the cold start): each state
    still gets its first calls (recordings, tuning) and the states share the rest round by round."""
    from advisor.measure import timing

    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    entered, calls = [], {}

    def call():  # 10 ms a call, by the fake clock, in the state entered last
        clock[0] += 0.01
        calls[entered[-1]] = calls.get(entered[-1], 0) + 1

    names = [f"s{i}" for i in range(8)]
    timing.warm_up(call, _states(names, entered), "cpu", warmup_s=0.5)
    assert min(calls.values()) >= timing.WARMUP
    assert max(calls.values()) - min(calls.values()) <= timing.WARMUP  # shared round by round
    assert 0.5 <= clock[0] < 0.5 + 0.01 * len(names) + 1e-9  # one floor, not eight: 4 s before


def test_a_pattern_alone_is_measured_by_paired_rounds():
    """Both states drift alike round by round (a 2 ms host-bound model: clocks, host stalls): the saving alone is
    the median of the rounds' differences and its spread theirs, which resolve a 0.4 ms saving that the spread of
    either state's rounds (1.5 ms) would call noise."""
    from advisor.measure.timing import Timing
    from advisor.records import PatternResult
    from advisor.workflows.selection import _timed_alone

    base = Timing(2.7, 25, "cuda_events", spread_ms=1.5, rounds_ms=[2.6, 4.1, 2.7, 2.65, 3.0])
    alone = Timing(2.3, 25, "cuda_events", spread_ms=1.5, rounds_ms=[2.2, 3.7, 2.3, 2.3, 2.55])
    got = _timed_alone(PatternResult(candidate="c1", pattern_id="p"), alone, base, None).applied_alone
    assert got["saved_us_per_iter"] == pytest.approx(400.0) and got["spread_us"] == pytest.approx(100.0)


def test_a_pattern_alone_is_its_rounds_fastest_calls():
    """A host stall only ever adds to a call: where two of a round's four calls stalled (a whole stack broken into
    graphs with Python between them), the rounds' medians moved by a millisecond and read a 0.1 ms saving as
    -0.4 ms, and their fastest calls read it as it is; the medians' reading is kept beside it."""
    from advisor.measure.timing import Timing
    from advisor.records import PatternResult
    from advisor.workflows.selection import _timed_alone

    base = Timing(4.0, 20, "cuda_events", rounds_ms=[4.0, 5.1, 4.0, 4.05, 5.0], rounds_low_ms=[4.0, 4.0, 3.98, 4.0, 4.02])
    alone = Timing(3.9, 20, "cuda_events", rounds_ms=[3.9, 6.0, 4.9, 3.95, 5.4], rounds_low_ms=[3.9, 3.9, 3.88, 3.9, 3.91])
    got = _timed_alone(PatternResult(candidate="c1", pattern_id="p"), alone, base, None).applied_alone
    assert got["saved_us_per_iter"] == pytest.approx(100.0) and got["spread_us"] == pytest.approx(10.0)
    assert got["saved_us_round_medians"] == pytest.approx(-400.0)  # median of (100, -900, -900, 100, -400)


def test_bench_times_again_the_kept_patterns_selection_could_not_resolve(optimized_llama, monkeypatch):
    """bench/retime.py: a kept pattern whose saving alone selection measured with a spread of at least a quarter
    of its estimate is timed again, alone against no pattern in the state selection measured it in, and the
    benchmark's figure is the one the estimate is judged by (selection's kept beside it); a resolved one and a
    pattern not kept are left alone, and the model is handed back in the state it was in."""
    import advisor.workflows.selection as selection
    from bench import retime, suite, zoo

    w, call, report = optimized_llama
    handle = report.handle
    key_of = {s.candidate: s.key for s in handle.plan.patterns}
    patterns = report.patterns
    a, b, c = [p for p in patterns if p.get("patched")][:2] + [{"candidate": "c99"}]
    a["applied_alone"] = {"est_saved_us_per_iter": 100.0, "saved_us_per_iter": 300.0, "spread_us": 400.0,
                          "in": "layer captures"}
    b["applied_alone"] = {"est_saved_us_per_iter": 100.0, "saved_us_per_iter": 90.0, "spread_us": 10.0,
                          "in": "layer captures"}
    c["applied_alone"] = dict(a["applied_alone"])
    entered, real_state = [], selection.state

    def state(enabled, outer):
        entered.append((enabled, outer))
        return real_state(enabled, outer)

    monkeypatch.setattr(selection, "state", state)
    monkeypatch.setattr(retime, "ROUNDS", 2)
    monkeypatch.setattr(retime, "CALLS_PER_ROUND", 1)
    before = _enabled(w.model)
    done = retime.retime_unresolved(call, handle, [a, b, c], {a["candidate"], b["candidate"]}, "cpu")
    assert done == [a["candidate"]]
    assert {e for e in entered} == {(frozenset(), False), (frozenset({key_of[a["candidate"]]}), False)}
    assert _enabled(w.model) == before
    r = a["applied_alone"]["retimed"]
    assert r["rounds"] == 2 and isinstance(r["saved_us_per_iter"], float) and r["spread_us"] >= 0
    assert "retimed" not in b["applied_alone"] and "retimed" not in c["applied_alone"]
    # judged by the benchmark's figure: make it 110 µs ± 5 (within, resolved)
    a["applied_alone"]["retimed"].update(saved_us_per_iter=110.0, spread_us=5.0)
    slim = suite.slim_pattern(a)
    assert slim["measured_us"] == 110.0 and slim["measured_by"] == "retimed" and slim["within_25pct"]
    assert slim["selection_measured_us"] == 300.0
    doc = {"results": {"m": {"patterns": [dict(a, status_code="patched"), dict(b, status_code="patched")]}}}
    line = zoo.estimates(doc)
    assert line.startswith("Estimate vs measured: 2 of 2 kept patterns within ±25%") and "1 of them timed again" in line

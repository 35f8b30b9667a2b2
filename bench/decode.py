"""LLM decode on a GPU, as a user runs it: `model.generate(prompt, max_new_tokens=64, do_sample=False)`.

Per (model, batch), in a process of its own: build the model (random weights, bf16), one deep copy per way,
set each way up on its copy, and time end-to-end `generate` of the untouched model and every way,
interleaved, after warm-up, in that one process (CUDA events). Ways:
- `static`: HF's static cache (`generation_config.cache_implementation = "static"`): `generate` compiles
  the decode step with torch.compile (CUDA graphs) itself; the peer to beat;
- `advisor`: `advisor.optimize(model, {"input_ids": prompt})`, defaults;
- `advisor_decode`: the same with `decode=True`;
- `advisor_no_dynamic` (on request): with `dynamic=False` (decode steps past the capture budget run the original
  ops, not Inductor's dynamic-shape compile).
Also: setup seconds (optimize), first `generate` seconds, greedy tokens' agreement with the untouched copy's
(share of generated positions equal), fused launches in one `generate` (advisor ways).

    python -m bench.decode --models llama,qwen2,mistral --batches 1,4 --out reports/decode/decode
"""
from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import child_command, child_env, git_rev, load_results, write_report

DIMS = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=4, vocab_size=32000)
MODELS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
          "mistral": ("MistralConfig", "MistralForCausalLM")}
WAYS = ("static", "advisor", "advisor_decode")


def build(name: str, batch: int, prompt_len: int):
    import torch
    import transformers

    cfg_name, cls_name = MODELS[name]
    cfg = getattr(transformers, cfg_name)(**DIMS)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = getattr(transformers, cls_name)(cfg).to(torch.bfloat16).eval()
        prompt = torch.randint(1, DIMS["vocab_size"], (batch, prompt_len))
    model.generation_config.pad_token_id = 0
    return model, prompt


def agreement(a, b, prompt_len: int) -> float:
    a, b = a[:, prompt_len:], b[:, prompt_len:]
    n = min(a.shape[1], b.shape[1])
    return round(float((a[:, :n] == b[:, :n]).float().mean()), 4)


def child(name: str, batch: int, ways: list[str], result: Path, new_tokens: int, prompt_len: int, iters: int) -> int:
    """Every way in one process, each on a copy of the model, timed interleaved with the untouched copy."""
    import torch

    import advisor
    from bench.common import interleaved, process_warmup

    torch.manual_seed(0)
    process_warmup("cuda")
    model, prompt = build(name, batch, prompt_len)
    untouched = model
    copies = {way: copy.deepcopy(model) for way in ways}

    def gen(m):
        def call():
            with torch.no_grad():
                return m.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return call

    res = {"model": name, "batch": batch, "ways": ways, "prompt": prompt_len, "new_tokens": new_tokens,
           "dims": DIMS, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "per_way": {}}
    eager_tokens = gen(untouched)()
    for way, m in copies.items():
        row = res["per_way"][way] = {}
        t0 = time.perf_counter()
        report = None
        if way == "static":
            m.generation_config.cache_implementation = "static"
        else:
            report = advisor.optimize(m, {"input_ids": prompt}, decode=way == "advisor_decode",
                                      dynamic=False if way == "advisor_no_dynamic" else None)
            row["report"] = str(report)
        torch.cuda.synchronize()
        row["setup_s"] = round(time.perf_counter() - t0, 2)
        handle = report.handle if report is not None else None
        before = handle.launches() if handle is not None else {}
        t0 = time.perf_counter()
        tokens = gen(m)()
        torch.cuda.synchronize()
        row["first_generate_s"] = round(time.perf_counter() - t0, 2)
        if handle is not None:
            after = handle.launches()
            row["fused_launches_first_generate"] = sum(n - before.get(k, 0) for k, n in after.items())
            row["dynamic_compile_calls_first_generate"] = sum(handle.any_shape_calls().values())
        row["agreement_with_eager"] = agreement(tokens, eager_tokens, prompt.shape[1])
    res["timing"] = t = interleaved({"eager": gen(untouched), **{w: gen(m) for w, m in copies.items()}}, "cuda",
                                    iters=iters, rounds=3, warmup_s=0.0)
    res["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    for way in ways:
        res["per_way"][way]["speedup"] = round(t["eager"]["median_ms"] / t[way]["median_ms"], 3)
        print(f"{name} b{batch} {way}: eager {t['eager']['median_ms']:.1f} ms, {t[way]['median_ms']:.1f} ms "
              f"({res['per_way'][way]['speedup']:.2f}x); setup {res['per_way'][way]['setup_s']} s, first generate "
              f"{res['per_way'][way]['first_generate_s']} s, agreement {res['per_way'][way]['agreement_with_eager']}",
              flush=True)
    result.write_text(json.dumps(res, indent=1, default=str))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batches", default="1,4")
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=Path("reports/decode/decode"))
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        name, batch = a.child
        return child(name, int(batch), a.ways.split(","), a.result, a.new_tokens, a.prompt, a.iters)
    doc = load_results(a.out)
    rev = git_rev()
    for name in a.models.split(","):
        for batch in a.batches.split(","):
            key = f"{name} b{batch}"
            result = a.out.parent / f".decode-{name}-{batch}.json"
            result.unlink(missing_ok=True)
            try:
                proc = subprocess.run(child_command("bench.decode", "--child", name, batch, "--ways", a.ways,
                                                     "--result", result, "--prompt", a.prompt, "--new-tokens",
                                                     a.new_tokens, "--iters", a.iters), timeout=a.timeout,
                                      capture_output=True, text=True, env=child_env())
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
            except subprocess.TimeoutExpired:
                tail = [f"timed out after {a.timeout:.0f} s"]
            res = json.loads(result.read_text()) if result.exists() else {"error": "\n".join(tail)}
            result.unlink(missing_ok=True)
            res["commit"] = rev
            doc["results"][key] = res
            print("\n".join(tail[-len(a.ways.split(",")):]), flush=True)
            write_report(a.out, doc)
    write_report(a.out, doc, markdown(doc))
    print(markdown(doc))
    return 0


def markdown(doc: dict) -> str:
    lines = ["| model | batch | way | eager ms | way ms | speedup | setup s | first generate s | agreement | fused launches |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in sorted(doc["results"].items()):
        if "error" in r:
            lines.append(f"| {key} | | | | | error: {r['error'].splitlines()[-1][:80] if r['error'] else ''} | | | | |")
            continue
        t = r["timing"]
        for way, w in r["per_way"].items():
            lines.append(f"| {r['model']} | {r['batch']} | {way} | {t['eager']['median_ms']:.1f} | "
                         f"{t[way]['median_ms']:.1f} | {w['speedup']:.2f}x | {w['setup_s']} | {w['first_generate_s']} | "
                         f"{w['agreement_with_eager']} | {w.get('fused_launches_first_generate', '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

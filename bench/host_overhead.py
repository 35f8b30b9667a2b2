"""Where a patched model's time goes: eager vs captured vs patched, device time and host time.

    python bench/host_overhead.py bert --layers 8 [--seq N] [--granularity layer|pattern] [--attn eager]
                                        [--kernels DIR]

Builds the example's model (examples/hf_*.py sizes on cuda), runs `advisor.optimize` on it with every
validated pattern patched (`select=False`), then times these configurations: eager (patches off),
captured_only (every site on its original ops), patched (CUDA graphs replayed), patched_op_by_op
(`graphs.replay_off`), and each pattern alone. Per call: device time with CUDA events (interleaved
rounds), and the host time to enqueue one call (perf_counter, no synchronisation: when it exceeds the
device time the model is host-bound and per-op Python overhead is what a patch changes). With
`--kernels DIR`, one profiled call per configuration is summarised in DIR/<model>-<attn>-<config>.txt:
every kernel with its count and device time per call, and the device-idle time (what the host's
enqueueing costs). reports/host-overhead-h100.md is this tool's output on an H100.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch


def build(name: str, layers: int, device: str, seq: int | None = None, attn: str = "sdpa"):
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "llama":
        cfg, cls, kw = LlamaConfig(num_hidden_layers=layers, hidden_size=2048, num_attention_heads=16,
                                   intermediate_size=5632, vocab_size=32000), LlamaForCausalLM, {"use_cache": False}
        batch, seq_default = 4, 512
    elif name == "gpt2":
        cfg, cls, kw = GPT2Config(n_layer=layers, n_embd=1024, n_head=16, vocab_size=50257), GPT2LMHeadModel, \
            {"use_cache": False}
        batch, seq_default = 8, 1024
    else:
        cfg, cls, kw = BertConfig(num_hidden_layers=layers), BertModel, {}
        batch, seq_default = 32, 512
    seq = seq or seq_default
    cfg._attn_implementation = attn
    with torch.device(device):
        model = cls(cfg).to(torch.bfloat16).eval()
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    if name == "bert":
        kw["attention_mask"] = torch.ones_like(ids)
    return model, {"input_ids": ids, **kw}


def host_ms(call, n: int = 10) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e3)
        sync()
    return sorted(out)[len(out) // 2]


def kernel_summary(call, device_ms: float) -> str:
    """One profiled call: kernels by device time (per call), their sum, and the idle remainder."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    per: dict = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time_total
    busy = sum(v[1] for v in per.values()) / 1e3
    lines = [f"kernels: {sum(v[0] for v in per.values())}, device busy {busy:.3f} ms of {device_ms:.3f} ms per call "
             f"(idle {device_ms - busy:.3f} ms)", f"{'us':>10} {'count':>6}  kernel"]
    for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{us:10.1f} {n:6d}  {name[:160]}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=["llama", "gpt2", "bert"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--granularity", default=None)
    ap.add_argument("--out", default="/tmp/overhead")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--kernels", default=None, help="folder for one profiled call's kernel summary per config")
    a = ap.parse_args(argv)

    import advisor
    from advisor.bench.timing import time_configs
    from advisor.workflows.selection import each_alone
    from advisor.patching import only, patches_off
    from advisor.patching.graphs import replay_off

    device = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: a smoke run, times say nothing)
    model, inputs = build(a.model, a.layers, device, a.seq, a.attn)

    def call():
        with torch.inference_mode():
            return model(**inputs)

    kw = {"granularity": a.granularity} if a.granularity else {}
    t0 = time.perf_counter()
    report = advisor.optimize(model, inputs, top=a.top, out=a.out, select=False, **kw)  # every pattern patched
    setup_s = time.perf_counter() - t0
    configs = {"eager": patches_off, "captured_only": lambda: only(set()), "patched": contextlib.nullcontext,
               "patched_op_by_op": replay_off}
    configs.update(each_alone(report.handle, [p["candidate"] for p in report.patterns if p.get("patched")]))
    dev = time_configs(call, configs, device, iters=30)
    host = {}
    for name, ctx in configs.items():
        with ctx():
            host[name] = host_ms(call)
            if a.kernels and device == "cuda":
                from pathlib import Path

                Path(a.kernels).mkdir(parents=True, exist_ok=True)
                text = kernel_summary(call, dev[name].median_ms)
                (Path(a.kernels) / f"{a.model}-{a.attn}-{name}.txt").write_text(text)
    res = {"model": a.model, "attn": a.attn, "layers": a.layers, "seq": a.seq, "granularity": a.granularity, "setup_s": round(setup_s, 1),
           "patched_modules": [e["module"] for e in report.manifest],
           "patterns": [(p["candidate"], p["title"].split(":")[0], p.get("sites"), p.get("est_time_saved_us"),
                         p["status"][:60]) for p in report.patterns],
           "check": {k: report.check.get(k) for k in ("ok", "reason", "rel_l2", "dropped")},
           "device_ms": {k: round(v.median_ms, 3) for k, v in dev.items()},
           "spread_ms": {k: round(v.spread_ms, 3) for k, v in dev.items()},
           "host_ms": {k: round(v, 3) for k, v in host.items()}}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()

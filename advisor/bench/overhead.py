"""Where a patched model's time goes: eager vs captured vs patched, device time and host time.

    python -m advisor.bench.overhead bert --layers 8 [--seq N] [--granularity occurrence|pattern|root]

Builds the example's model (examples/hf_*.py sizes on cuda), runs `advisor.optimize` on it (kernels
from the generator), then times, per call: device time with CUDA events (interleaved rounds), and the
host time to enqueue one call (perf_counter, no synchronisation: when it exceeds the device time the
model is host-bound and per-op Python overhead is what a patch changes).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch


def build(name: str, layers: int, device: str, seq: int | None = None):
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
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = cls(cfg).to(torch.bfloat16).eval()
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    if name == "bert":
        kw["attention_mask"] = torch.ones_like(ids)
    return model, {"input_ids": ids, **kw}


def host_ms(call, n: int = 10) -> float:
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return sorted(out)[len(out) // 2]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=["llama", "gpt2", "bert"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--granularity", default=None)
    ap.add_argument("--out", default="/tmp/overhead")
    a = ap.parse_args(argv)

    import advisor
    from advisor.bench.timing import time_configs
    from advisor.patch import only, patches_off

    model, inputs = build(a.model, a.layers, "cuda", a.seq)

    def call():
        with torch.inference_mode():
            return model(**inputs)

    kw = {"granularity": a.granularity} if a.granularity else {}
    t0 = time.perf_counter()
    report = advisor.optimize(model, inputs, top=a.top, out=a.out, **kw)
    setup_s = time.perf_counter() - t0
    configs = {"eager": patches_off, "captured_only": lambda: only(set()), "patched": contextlib.nullcontext}
    dev = time_configs(call, configs, "cuda", iters=30)
    host = {}
    for name, ctx in configs.items():
        with ctx():
            host[name] = host_ms(call)
    res = {"model": a.model, "layers": a.layers, "seq": a.seq, "granularity": a.granularity, "setup_s": round(setup_s, 1),
           "patched_modules": [e["module"] for e in report.manifest],
           "patterns": [(p["title"].split(":")[0], p.get("sites"), p["status"][:60]) for p in report.patterns],
           "device_ms": {k: round(v.median_ms, 3) for k, v in dev.items()},
           "spread_ms": {k: round(v.spread_ms, 3) for k, v in dev.items()},
           "host_ms": {k: round(v, 3) for k, v in host.items()}}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()

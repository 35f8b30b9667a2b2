"""Where the memory a model trained after `optimize` holds beyond eager's goes (issue 19: a training step no
heavier than eager's), on the GPU.

    PYTHONPATH=$PWD python3 bench/train_memory.py --models hf_llama,hf_bert --out $OUT/train-memory

Per model (bench/workloads.py's, one process each): the model built as bench/train.py builds it (trainable, train
mode), `advisor.optimize(model, inputs, train=True)` with the CUDA caching allocator recording where each block
was allocated, then training steps as bench/train.py's (its loss, fused AdamW). After the first step and after
the last: the GPU memory allocated beyond the model's parameters and the optimizer's state, split by the Python
frame that allocated each live block (the innermost frame in advisor/, else the innermost of any) and by memory
pool (the caching allocator's own, or a CUDA-graph pool); every recording our graphs keep (inference or
training, how many); and the training decision `optimize` made (its peaks, fused and original). An eager
copy trained beside it in the same process is the baseline: its steps' peak and what it holds after them.
"""
from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS = 4
# FUSION_BENCH_LORA=1: LoRA adapters as bench/train.py --lora; FUSION_BENCH_TRAIN_MEMORY=F: optimize's
# train_memory (fused training kept up to that much heavier, to see where its memory goes)
LORA = os.environ.get("FUSION_BENCH_LORA") == "1"
TRAIN_MEMORY = float(os.environ.get("FUSION_BENCH_TRAIN_MEMORY", "0"))


def live_blocks(torch) -> dict:
    """{(pool, frame): bytes} over the allocator's active blocks (its snapshot with recorded history)."""
    snap = torch.cuda.memory._snapshot()
    out: dict = collections.Counter()
    for seg in snap.get("segments", []):
        pool = "graph pool" if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0) else "allocator"
        for b in seg.get("blocks", []):
            if not str(b.get("state", "")).startswith("active_allocated"):
                continue
            out[(pool, where(b.get("frames") or []))] += b.get("size", 0)
    return out


def where(frames: list) -> str:
    """The innermost advisor/ frame of an allocation's stack (else bench/, else the innermost Python frame)."""
    for key in ("/advisor/", "/bench/"):
        for f in frames:
            if key in str(f.get("filename", "")):
                return f"{f['filename'].split(key)[-1]}:{f.get('line')} {f.get('name')}"
    py = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    return f"{py[0]['filename'].rsplit('/', 2)[-1]}:{py[0].get('line')} {py[0].get('name')}" if py else "?"


def recordings() -> list:
    from advisor.patching.graphs import _LIVE

    return [{"kind": type(g).__name__, "pool": getattr(g, "pool_kind", None), "recordings": len(g.recordings)}
            for g in list(_LIVE) if g.recordings]


def child(name: str, out: Path) -> int:
    import torch

    import advisor
    from train import _loss, lora
    from workloads import build

    def gb(n):
        return round(n / 2**30, 3)

    def trainer(model, w):
        labels = w.inputs["input_ids"] if type(model).__name__.endswith(("LMHeadModel", "CausalLM")) \
            and isinstance(w.inputs, dict) else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

        def step():
            loss = _loss(model, w.inputs, labels, name)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step, opt

    def held(model, opt) -> int:
        own = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
        state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.is_cuda)
        return own + state

    def built():
        w = build(name, "cuda", False)
        model = w.model.train().requires_grad_(True)
        if LORA:  # as bench/train.py --lora
            model = lora(model)
        return w, model

    res = {"model": name, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "lora": LORA,
           "train_memory": TRAIN_MEMORY}
    torch.manual_seed(0)
    base = torch.cuda.memory_allocated()
    w_e, eager = built()
    step_e, opt_e = trainer(eager, w_e)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(STEPS):
        step_e()
    torch.cuda.synchronize()
    res["eager"] = {"peak_gb_over_start": gb(torch.cuda.max_memory_allocated() - base),
                    "held_beyond_weights_and_optimizer_gb": gb(torch.cuda.memory_allocated() - base - held(eager, opt_e))}
    del step_e, opt_e, eager, w_e
    torch.cuda.empty_cache()

    torch.manual_seed(0)
    base = torch.cuda.memory_allocated()
    w, model = built()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    report = advisor.optimize(model, w.inputs, train=True, train_memory=TRAIN_MEMORY, out=out / f"advisor-{name}")
    torch.cuda.synchronize()
    res["training_decision"] = report.training
    res["after_optimize"] = {"allocated_over_start_gb": gb(torch.cuda.memory_allocated() - base),
                             "recordings": recordings()}
    step, opt = trainer(model, w)
    torch.cuda.reset_peak_memory_stats()
    for i in range(STEPS):
        step()
        torch.cuda.synchronize()
        if i == 0:
            res["after_first_step"] = snapshot(torch, model, opt, base, held, gb)
    res["after_last_step"] = snapshot(torch, model, opt, base, held, gb)
    res["advisor_peak_gb_over_start"] = gb(torch.cuda.max_memory_allocated() - base)
    torch.cuda.memory._record_memory_history(enabled=None)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: v for k, v in res.items() if k != "after_first_step"}, indent=1, default=str)[:6000], flush=True)
    return 0


def snapshot(torch, model, opt, base, held, gb) -> dict:
    blocks = live_blocks(torch)
    top = sorted(blocks.items(), key=lambda kv: -kv[1])[:25]
    return {"held_beyond_weights_and_optimizer_gb": gb(torch.cuda.memory_allocated() - base - held(model, opt)),
            "recordings": recordings(),
            "by_pool_gb": {p: gb(sum(v for (q, _), v in blocks.items() if q == p)) for p in {q for q, _ in blocks}},
            "largest": [{"pool": p, "where": f, "mb": round(v / 2**20, 1)} for (p, f), v in top]}


def main(argv=None) -> int:
    from estimate_check import per_model_main

    return per_model_main(argv, __doc__, __file__, child, "hf_llama,hf_bert", 200)


if __name__ == "__main__":
    sys.exit(main())

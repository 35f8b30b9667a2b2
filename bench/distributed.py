"""Distributed training steps: an HF Llama under DDP and FSDP2, eager / fusion-advisor / torch.compile,
one process per GPU.

    PYTHONPATH=$PWD torchrun --nproc-per-node 2 -m bench.distributed --out $OUT/distributed   # two GPUs, NCCL
    PYTHONPATH=$PWD python3 -m bench.distributed --device cpu --tiny --out /tmp/dist            # CPU smoke (gloo)

Run without torchrun it starts its own ranks (`--nproc-per-node`, 2 by default) through torchrun's launcher.

The model: HF Llama, hidden 2048, 8 layers, 16 heads over 4 key/value heads (GQA), MLP 5632, vocabulary 32000, bf16
weights; each rank trains on its own 4 x 1024 tokens (`--tiny`: hidden 64, 2 layers, 2 x 16 tokens, float32).
Wrappers: `single` (the model alone on each rank, no communication: the advisor's single-GPU speedup measured in the
same run), `ddp` (`DistributedDataParallel`, optimised wrapped) and `fsdp2` (`fully_shard` on every layer, then on
the root; optimised sharded). Modes: `eager`; `advisor` (`advisor.optimize(model, batch, train=True)` on every rank,
its defaults otherwise: the state it keeps is rank 0's, broadcast); `advisor_memory` (the same with
`train_memory=MEMORY_ALLOWED`, bench/train.py's: fused training kept up to 2% heavier than the original forwards'
peak in its check, where the default keeps it only when no heavier); `compile` (`torch.compile` of the wrapped
model). Per wrapper and mode a fresh model (same seed), built, stepped and freed in turn.

One step = forward with labels (the model's own LM loss), backward, AdamW step, zero_grad; step ms is the median of
`--steps` after `--warmup` (bench/train.py's `Clock`: CUDA events), per rank; peak GB is
`torch.cuda.max_memory_allocated` over the timed steps, per rank. Each mode's losses are kept: `loss_rel` is the
largest relative difference of a mode's per-step losses from eager's under the same wrapper (the same data and
seed: FSDP2 trains fused with eager's losses where it is small).

Writes OUT/distributed.json (every number, every rank) and OUT/distributed.md (a table), printing the table.
Run on two H200s (NCCL): reports/distributed/.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path


from bench.train import MEMORY_ALLOWED, Clock  # bench/train.py's step clock and memory allowance

WRAPPERS = ("single", "ddp", "fsdp2")
MODES = ("eager", "advisor", "advisor_memory", "compile")
FULL = {"hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
        "intermediate_size": 5632, "vocab_size": 32000, "max_position_embeddings": 2048, "batch": 4, "seq": 1024}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128, "batch": 2, "seq": 16}


def build(shape: dict, device: str, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # every rank and every mode starts from the same weights
    config = {k: v for k, v in shape.items() if k not in ("batch", "seq")}
    return LlamaForCausalLM(LlamaConfig(**config, use_cache=False)).to(device=device, dtype=dtype).train()


def wrap(model, wrapper: str, device: str):
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device] if device != "cpu" else None)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    return model


def run_mode(wrapper: str, mode: str, shape: dict, device: str, warmup: int, steps: int, out: Path) -> dict:
    """One wrapper and mode on this rank: its step times, peak memory and losses."""
    import torch

    cuda = device != "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    rank = torch.distributed.get_rank()
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), device=device,
                        generator=torch.Generator(device=device).manual_seed(1000 + rank))  # each rank its own batch
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    model = wrap(build(shape, device, dtype), wrapper, device)
    res: dict = {}
    if mode.startswith("advisor"):
        import advisor

        t0 = time.perf_counter()
        report = advisor.optimize(model, batch, train=True, out=out / f"{mode}-{wrapper}", interpret=not cuda,
                                  train_memory=MEMORY_ALLOWED if mode == "advisor_memory" else 0.0)
        res["optimize_s"] = round(time.perf_counter() - t0, 2)
        res["patched"] = [f"{p['candidate']} {p['title']}" for p in report.applied]
        res["training"] = (report.training or {}).get("decision")
        res["lm_loss"] = ((report.training or {}).get("lm_loss") or {}).get("decision")
        res["selection"] = (report.selection or {}).get("decision")
        res["apply_json"] = str(report.out_dir / "apply.json")
    if mode == "compile":
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    clock = Clock("cuda" if cuda else "cpu")
    times, losses = [], []
    from advisor.patching import rewrite

    fused_before = rewrite.fused_runs()
    for k in range(warmup + steps):
        timed = k >= warmup
        clock.sync()
        if cuda and k == warmup:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        clock.start()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ms = clock.ms()
        if k == 0:
            res["first_step_s"] = round(time.perf_counter() - t0, 2)
        if timed:
            times.append(ms)
        losses.append(loss.item())
    res |= {"step_ms": round(statistics.median(times), 3), "step_ms_min": round(min(times), 3),
            "losses": [round(x, 6) for x in losses], "fused_site_runs": rewrite.fused_runs() - fused_before}
    if cuda:
        res["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    if mode.startswith("advisor"):
        advisor.unpatch(model)
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def rank_main(a) -> int:
    import torch
    import torch.distributed as dist

    cuda = a.device != "cpu"
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = f"cuda:{local}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = TINY if a.tiny else FULL
    mine: dict = {}
    for wrapper in a.wrappers.split(","):
        for mode in a.modes.split(","):
            t0 = time.perf_counter()
            try:
                mine[f"{wrapper}/{mode}"] = run_mode(wrapper, mode, shape, device, a.warmup, a.steps, a.out)
            except Exception as e:  # one mode failing (on one rank: the others then time out) ends no other
                mine[f"{wrapper}/{mode}"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            mine[f"{wrapper}/{mode}"]["wall_s"] = round(time.perf_counter() - t0, 1)
            if rank == 0:
                print(f"{wrapper}/{mode}: {mine[f'{wrapper}/{mode}'].get('step_ms', 'failed')} ms (rank 0)", flush=True)
            # written after every mode, so a run stopped at a time limit keeps what it measured
            doc = write(a, mine, shape, device, world)
    if rank == 0:
        print(table(doc))
    dist.destroy_process_group()
    return 0


def write(a, mine: dict, shape: dict, device: str, world: int) -> dict:
    """Every rank's results gathered; rank 0 writes OUT/distributed.json and .md. Returns the document."""
    import torch
    import torch.distributed as dist

    ranks: list = [None] * world
    dist.all_gather_object(ranks, mine)
    doc = {"shape": shape, "device": torch.cuda.get_device_name(device) if device != "cpu" else "cpu",
           "world_size": world, "backend": str(dist.get_backend()), "warmup": a.warmup, "steps": a.steps,
           "torch": torch.__version__, "train_memory_allowed": MEMORY_ALLOWED, "ranks": ranks, "summary": summary(ranks)}
    if dist.get_rank() == 0:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "distributed.json").write_text(json.dumps(doc, indent=1, default=str))
        (a.out / "distributed.md").write_text(markdown(doc))
    return doc


def summary(ranks: list) -> dict:
    """Per wrapper and mode: the slowest rank's step ms (a step ends when every rank's does), the highest peak, the
    speedup over eager under the same wrapper, and the largest relative loss difference from eager's."""
    out: dict = {}
    for key in ranks[0]:
        per = [r[key] for r in ranks]
        if any("step_ms" not in r for r in per):
            out[key] = {"error": next(r.get("error") for r in per if "step_ms" not in r)}
            continue
        wrapper = key.split("/")[0]
        eager = [r.get(f"{wrapper}/eager", {}) for r in ranks]
        step = max(r["step_ms"] for r in per)
        s = {"step_ms": step, "step_ms_per_rank": [r["step_ms"] for r in per],
             "peak_gb_per_rank": [r.get("peak_gb") for r in per], "fused_site_runs": [r["fused_site_runs"] for r in per]}
        if all("step_ms" in e for e in eager):
            s["x_eager"] = round(max(e["step_ms"] for e in eager) / step, 3)
            s["loss_rel"] = max(abs(x - y) / max(abs(y), 1e-12)
                                for r, e in zip(per, eager) for x, y in zip(r["losses"], e["losses"]))
        out[key] = s
    return out


def table(doc: dict) -> str:
    rows = ["| wrapper | mode | step ms (slowest rank) | per rank | × eager | peak GB per rank | loss rel. to eager | "
            "fused site runs |", "|---|---|---|---|---|---|---|---|"]
    for key, s in doc["summary"].items():
        wrapper, mode = key.split("/")
        if "error" in s:
            rows.append(f"| {wrapper} | {mode} | failed: {s['error'][:120]} ||||||")
            continue
        rows.append(f"| {wrapper} | {mode} | {s['step_ms']} | {s['step_ms_per_rank']} | {s.get('x_eager', '—')} | "
                    f"{s['peak_gb_per_rank']} | {_sci(s.get('loss_rel'))} | {s['fused_site_runs']} |")
    return "\n".join(rows)


def _sci(x: float | None) -> str:
    return "—" if x is None else f"{x:.2e}"


def markdown(doc: dict) -> str:
    sh = doc["shape"]
    out = ["# Distributed training steps (bench/distributed.py)", "",
           f"{doc['world_size']} ranks ({doc['backend']}, {doc['device']}); HF Llama hidden {sh['hidden_size']}, "
           f"{sh['num_hidden_layers']} layers, {sh['num_attention_heads']}/{sh['num_key_value_heads']} heads; "
           f"{sh['batch']} x {sh['seq']} tokens per rank. Step = forward with labels, backward, AdamW, zero_grad; "
           f"median of {doc['steps']} steps after {doc['warmup']} (CUDA events), per rank; peak = max allocated over "
           "the timed steps. Per wrapper and mode a fresh model, same seed.", "", table(doc), ""]
    for key, r in doc["ranks"][0].items():
        if r.get("patched") is not None:
            out += [f"- {key}: optimize {r['optimize_s']} s on rank 0; patched {', '.join(r['patched']) or 'nothing'}; "
                    f"{r.get('selection') or ''}; {r.get('training') or ''}; {r.get('lm_loss') or ''}"]
    return "\n".join(out) + "\n"


def launch(a, argv: list) -> int:
    """Not started by torchrun: start `--nproc-per-node` ranks of this script through torchrun's launcher."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc_per_node),
           __file__, *argv]
    return subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}).returncode


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("reports/distributed-h200x2"))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama (CPU smoke run)")
    p.add_argument("--wrappers", default=",".join(WRAPPERS), help=f"comma-separated, of {', '.join(WRAPPERS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks to start when not run by torchrun")
    a = p.parse_args(argv)
    bad = [w for w in a.wrappers.split(",") if w not in WRAPPERS] + [m for m in a.modes.split(",") if m not in MODES]
    if bad:
        print(f"distributed: unknown wrapper or mode: {', '.join(bad)}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        return launch(a, argv)
    return rank_main(a)


if __name__ == "__main__":
    sys.exit(main())

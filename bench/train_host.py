"""One model trained untouched and patched in one process, steps interleaved: where a patched model's
training step loses time (issue 19). Prints both medians and each one's cProfile (top by own time).

    PYTHONPATH=$PWD python3 bench/train_host.py --model hf_bert            # GPU
    PYTHONPATH=$PWD python3 bench/train_host.py --model hf_bert --quick    # CPU smoke run
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="hf_bert")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--train-fused", choices=["on", "off"], default="on", help="the patched model's train_fused")
    a = p.parse_args(argv)
    import advisor  # noqa: F401
    import torch

    from train import Mode, _loss

    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {"eager": Mode(a.model, "eager", device, a.quick, Path("/tmp/train_host")),
              "patched": Mode(a.model, "advisor", device, a.quick, Path("/tmp/train_host"))}
    models["patched"].report.handle.train_fused(a.train_fused == "on")

    def step(name):  # unsynchronised, unlike Mode.step: steps queue up as in a training loop
        m = models[name]
        _loss(m.model, m.w.inputs, m.labels, a.model).backward()
        m.opt.step()
        m.opt.zero_grad(set_to_none=True)

    def timed(name) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step(name)
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / a.steps * 1e3

    for name in models:
        for _ in range(3):
            step(name)
    print("process and model state:", state(torch, models))
    got = {name: [] for name in models}
    for _ in range(a.rounds):
        for name in models:
            got[name].append(timed(name))
    print({name: [round(x, 3) for x in v] for name, v in got.items()})
    print({name: round(statistics.median(v), 3) for name, v in got.items()})
    if device == "cuda":  # which kernels and ops each one's step runs (two steps)
        from torch.profiler import ProfilerActivity, profile

        tables = {}
        for name in models:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    step(name)
                torch.cuda.synchronize()
            tables[name] = {e.key: (e.count, e.device_time_total / 1e3) for e in prof.key_averages()}
        keys = sorted(set(tables["eager"]) | set(tables["patched"]),
                      key=lambda k: -abs(tables["patched"].get(k, (0, 0))[1] - tables["eager"].get(k, (0, 0))[1]))
        print("op or kernel | eager calls, ms | patched calls, ms (two steps; largest differences first)")
        for k in keys[:30]:
            print(f"{k[:90]} | {tables['eager'].get(k)} | {tables['patched'].get(k)}")
        calls = {k: v[0] for k, v in tables["patched"].items() if tables["eager"].get(k, (0,))[0] != v[0]}
        print("ops called a different number of times:",
              {k[:60]: (tables["eager"].get(k, (0,))[0], n) for k, n in list(calls.items())[:40]})
    for name in models:
        prof = cProfile.Profile()
        prof.enable()
        timed(name)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
        print(f"== {name}\n" + "\n".join(out.getvalue().splitlines()[:34]))
    return 0


def state(torch, models: dict) -> dict:
    """What might make one model's ops cost more on the host than the other's: modes and hooks left active,
    threads, the garbage collector's load, and per model the hooks on its parameters and modules."""
    import gc
    import threading

    out = {"torch_function_modes": torch._C._len_torch_function_stack(),
           "dispatch_modes": torch._C._len_torch_dispatch_stack(), "threads": threading.active_count(),
           "gc_objects": len(gc.get_objects()), "grad": torch.is_grad_enabled(),
           "anomaly": torch.is_anomaly_enabled(),
           "saved_tensor_hooks": torch._C._autograd._top_saved_tensors_default_hooks(False) is not None}
    for name, m in models.items():
        params = list(m.model.parameters())
        out[name] = {"params": len(params),
                     "params_with_hooks": sum(bool(p._backward_hooks) or bool(getattr(p, "_post_accumulate_grad_hooks", None))
                                              for p in params),
                     "modules_with_hooks": sum(bool(x._forward_hooks or x._forward_pre_hooks or x._backward_hooks)
                                               for x in m.model.modules()),
                     "contiguous_params": sum(p.is_contiguous() for p in params),
                     "dtypes": sorted({str(p.dtype) for p in params})}
    return out


if __name__ == "__main__":
    sys.exit(main())

"""Where a model's GPU time goes, eager and compiled: top kernels by total time (one-off probe)."""
import sys, json, copy, torch
from torch.profiler import profile, ProfilerActivity
from bench.zoo import MODELS

out = {}
for name in sys.argv[1].split(","):
    torch.manual_seed(0)
    model, inputs, shape = MODELS[name]("cuda", torch.bfloat16)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    comp = torch.compile(copy.deepcopy(model))
    res = {}
    for label, m in (("eager", model), ("compile", comp)):
        with torch.no_grad():
            for _ in range(3):
                m(*args, **kwargs)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    m(*args, **kwargs)
                torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
            if t > 0:
                rows.append((t / 5 / 1000, e.count // 5, e.key[:110]))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        res[label] = {"total_ms": round(total, 3), "top": [(round(a, 4), c, k) for a, c, k in rows[:22]]}
        print(f"== {name} {label}: {total:.3f} ms GPU per call", flush=True)
        for a, c, k in rows[:22]:
            print(f"  {a:8.4f} ms  x{c:4d}  {k}", flush=True)
    out[name] = res
    del model, comp
    torch.cuda.empty_cache()
import os
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "top.json"), "w"), indent=1)

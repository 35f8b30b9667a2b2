#!/usr/bin/env python
"""Where the first patched call's time goes, on the CPU: an 8-layer HF Llama from a tiny config
(hidden 256, 4 heads, 2 KV heads, vocab 1000, batch 2 x 128 with a padded row), Triton's interpreter.

    PYTHONPATH=$PWD python bench/first_call_phases.py build  /tmp/fc          # optimize once, plan + bundle
    FAKE_KERNELS=1 PYTHONPATH=$PWD python bench/first_call_phases.py reuse  /tmp/fc outer   # fresh process
    FAKE_KERNELS=1 PYTHONPATH=$PWD python bench/first_call_phases.py bundle /tmp/fc layer
    NOCACHE=1 FAKE_KERNELS=1 ... bundle /tmp/fc layer                           # called with use_cache=False

`build` leaves the outer capture on in the stored plan and the bundle (as selection does on the H100's
Llama). FAKE_KERNELS=1: sites run their original ops instead of the interpreted kernels (seconds per
launch on the CPU, nothing like a GPU), so what is left is the capture's own cost; PROF=1 writes a
cProfile. Prints `advisor.patching.timing` phases for optimize/patch, for the first call (no_grad) and for
the first call under inference mode after it (`reuse` also prints `optimize`'s check steps). The plan
cache's source digest is pinned so that two checkouts can reuse one stored plan (before/after timings).
"""
import cProfile
import json
import os
import sys
import time

T0 = time.perf_counter()
phase, work = sys.argv[1], sys.argv[2]
outer = len(sys.argv) > 3 and sys.argv[3] == "outer"
os.environ.setdefault("FUSION_ADVISOR_CACHE", work + "/cache")
import torch
t_torch = time.perf_counter()
import advisor
from advisor.workflows import plan_cache as _pc
_pc._SOURCE = "fixed-for-measurement"  # the before and after trees share one stored plan
t_adv0 = time.perf_counter()
import transformers  # noqa
from transformers import LlamaConfig, LlamaForCausalLM
t_tf = time.perf_counter()
t_adv = t_tf

def build():
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=8, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=512, vocab_size=1000, max_position_embeddings=256)
    m = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 128, dtype=torch.long)
    mask[-1, 100:] = 0
    return m, {"input_ids": torch.randint(0, 1000, (2, 128), generator=g), "attention_mask": mask}

sys.path[:0] = [os.getcwd(), os.getcwd() + "/bench"]
from bench.suite import process_warmup
t_w = time.perf_counter()
process_warmup("cpu")
print(f"process warm-up (imports, dynamo first use) {time.perf_counter()-t_w:.2f}")
m, inputs = build()
with torch.no_grad():
    m(**inputs)
t_eager = time.perf_counter()
print(f"imports: torch {t_torch-T0:.2f} advisor {t_adv0-t_torch:.2f} transformers {t_tf-t_adv0:.2f}; build+eager {t_eager-t_adv:.2f}")
if phase == "build":
    r = advisor.optimize(m, inputs, interpret=True, out=work + "/opt")
    print(r)
    print("phases", r.phases_s)
    # as selection on the H100 leaves it: the whole stack captured (its manifest holds the outer sites)
    r.handle.set_outer(True)
    with torch.no_grad():
        m(**inputs)
    from advisor.workflows import plan_cache
    from pathlib import Path
    p = Path(work + "/opt/apply.json")
    d = json.loads(p.read_text())
    d["manifest"] = r.handle.manifest()
    d["outer"] = True
    p.write_text(json.dumps(d))
    plan_cache.store(Path(work + "/opt"), d["plan_key"])
    print("outer manifest entries", sum(1 for e in d["manifest"] if e["outer"]))
    advisor.save_bundle(r, work + "/plan.fab")
    sys.exit(0)
from advisor.patching import timing, rewrite as _rw
from advisor.workflows import live_model as _lm
_orig_site = _rw.Site.__call__
def _site(self, *xs):
    with timing.timed("sites (kernels run)"):
        if os.environ.get("FAKE_KERNELS"):
            return self.fallback(*xs)
        return _orig_site(self, *xs)
_rw.Site.__call__ = _site
for _name in ("check", "float32_reference"):
    _f = getattr(_lm, _name)
    def _w(*a, _f=_f, _name=_name, **k):
        with timing.timed("optimize." + _name):
            return _f(*a, **k)
    setattr(_lm, _name, _w)
prof = cProfile.Profile() if os.environ.get("PROF") else None
def call(mode=torch.no_grad):
    with mode():
        return m(**inputs, **({"use_cache": False} if os.environ.get("NOCACHE") else {}))
if prof:
    prof.enable()
snap0 = timing.snapshot()
t0 = time.perf_counter()
if phase == "reuse":
    r = advisor.optimize(m, inputs, interpret=True, out=work + "/reuse")
    h = r.handle
    print("reused", r.phases_s, "check steps", r.check.get("seconds"), "outer_on", h.outer_on)
else:
    h = advisor.patch(m, work + "/plan.fab")
    print("patch_s", round(time.perf_counter() - t0, 3), "outer_on", h.outer_on)
if outer is not None:
    h.set_outer(outer)
snap1 = timing.snapshot()
t1 = time.perf_counter()
call()
t2 = time.perf_counter()
snap2 = timing.snapshot()
call()
t3 = time.perf_counter()
snap3 = timing.snapshot()
call(torch.inference_mode)  # the other way users call a model: should cost no capture of its own
t4 = time.perf_counter()
snap4 = timing.snapshot()
print("first inference-mode call", round(t4 - t3, 3), "phases:",
      {k: round(snap4.get(k,0)-snap3.get(k,0),3) for k in sorted(snap4) if snap4.get(k,0)-snap3.get(k,0)>5e-4})
print("phases in second call:", {k: round(snap3.get(k,0)-snap2.get(k,0),3) for k in sorted(snap3) if snap3.get(k,0)-snap2.get(k,0)>5e-4})
if prof:
    prof.disable()
    prof.dump_stats(work + f"/{phase}-{'outer' if outer else 'layer'}.prof")
print(f"{phase} {'outer' if outer else 'layer'}: optimize/patch {t1-t0:.2f} first call {t2-t1:.2f} second {t3-t2:.3f} total {t2-t0:.2f}")
print("phases in optimize/patch:", timing.since(snap0) if False else
      {k: round(snap1.get(k,0)-snap0.get(k,0),3) for k in sorted(snap1) if snap1.get(k,0)-snap0.get(k,0)>5e-4})
print("phases in first call:", {k: round(snap2.get(k,0)-snap1.get(k,0),3) for k in sorted(snap2) if snap2.get(k,0)-snap1.get(k,0)>5e-4})
from advisor.patching import patched_modules
print("fallbacks", h.fallbacks(), "graphs", sum(f.log().graphs for _, f in patched_modules(m) if True) )

"""GPU benchmark of matmul-anchored kernels (issue 10): GEMM epilogues, eager attention, the SPLADE head.

    python -m bench.matmul_fusion --out reports/matmul-fusion/matmul_fusion   # writes .md and .json; ~4 min on an H100
    python -m bench.matmul_fusion --out /tmp/smoke --smoke           # tiny shapes in Triton's interpreter (CPU)

Every kernel is made by the generator (`advisor.codegen.anchored.generate_anchored`) from the program a
profiler trace of the model gives the advisor (top-level `aten::linear` / `addmm` / `matmul`, then the
chain), validated (`advisor.validate`: fp64 reference, odd and all-ones shapes) and compared with eager
at the benchmark size before it is timed. Times are `triton.testing.do_bench` medians (L2 cleared
before each call); the fused kernels tune their tile once per shape, before timing. Cases run in
priority order; past --budget-s the rest are skipped (and listed), and STEM.md / STEM.json are
rewritten after every case, so a run stopped by an outer timeout keeps what it finished.

- Epilogues at the suite's Linear shapes (bf16): eager (cuBLAS + the epilogue's eager kernels), cuBLAS +
  the generator's one fused pointwise kernel for the epilogue, cuBLAS alone (the floor), and the fused
  matmul + epilogue. The fused epilogue is kept only where it beats both unfused variants.
- Attention at eager GPT-2 (B 8, H 16, L 1024, causal mask, q/k/v split from one c_attn output) and
  BERT (B 32, H 12, L 512) shapes, d 64: eager, SDPA (the module's `run_sdpa`), the flash-style kernel;
  time and peak extra memory. The fastest validated of SDPA and the kernel is the one to apply.
- SPLADE head (BERT-base MLM head to vocab 30522, batch 32 x seq 256, bf16): eager, torch.compile, and
  ours (eager dense + GELU + LayerNorm, then the matmul + max-over-sequence kernel); time and peak
  extra memory (the logits are never allocated by ours).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

import triton  # noqa: E402
import triton.testing  # noqa: E402

from advisor.codegen import generate, load_module  # noqa: E402
from advisor.codegen.anchored import generate_anchored  # noqa: E402
from advisor.workflows.generate import validate_alternatives  # noqa: E402
from advisor.validate import validate  # noqa: E402

F = torch.nn.functional
BF16 = torch.bfloat16
DEV = "cpu" if SMOKE else "cuda"
TUNE_TOP = 5  # configs timed per fused kernel (--tune-top)
if SMOKE:
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy under the interpreter: log(0) in unused lanes


# ------------------------------------------------------------------------------------------ recording
class Rec:
    """Runs aten ops and (unless record=False) records them as an analyzer-style program: what a trace of
    the model gives the advisor (top-level `aten::linear` / `aten::matmul`, not their decomposition).
    Inputs are named by storage, in order of first use; a view of an input is a ref with its strides."""

    def __init__(self, record: bool = True):
        self.record = record
        self.inputs, self.tensors, self.nodes, self.names = [], [], [], {}

    @staticmethod
    def _key(t):
        return t.untyped_storage().data_ptr(), t.device

    def _ref(self, t: torch.Tensor) -> dict:
        k = self._key(t)
        if k not in self.names:
            vid = f"in{len(self.inputs)}"
            self.names[k] = vid
            self.inputs.append({"id": vid, "shape": list(t.shape), "strides": list(t.stride()),
                                "dtype": str(t.dtype)[6:], "storage_offset": t.storage_offset()})
            self.tensors.append(t)
        return {"ref": self.names[k], "shape": list(t.shape), "strides": list(t.stride()),
                "storage_offset": t.storage_offset()}

    def _arg(self, v):
        if isinstance(v, torch.Tensor):
            return self._ref(v)
        return {"value": "<None>"} if v is None else {"value": list(v) if isinstance(v, tuple) else v}

    def __call__(self, name: str, *args):
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        out = op(*args)
        if self.record:
            k = len(self.nodes)
            node_args = [self._arg(a) for a in args]
            self.nodes.append({"id": f"n{k}", "op": f"aten::{packet}", "schema": str(op._schema), "args": node_args,
                               "outputs": [{"id": f"v{k}", "shape": list(out.shape), "strides": list(out.stride()),
                                            "dtype": str(out.dtype)[6:]}], "inplace": False})
            self.names[self._key(out)] = f"v{k}"
        return out

    def program(self, out: torch.Tensor) -> dict:
        return {"inputs": self.inputs, "nodes": self.nodes, "outputs": [self.names[self._key(out)]]}


EAGER = Rec(record=False)


def rand(*shape, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


# ------------------------------------------------------------------------------------------ measuring
def bench(fn) -> float:
    if SMOKE:  # the interpreter: a single call, only to exercise the code paths
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def peak_mb(fn) -> float | None:
    """Peak memory a call allocates beyond what was allocated before it, MB."""
    if DEV != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 1e6


def close(a, b, tol=2e-2) -> float:
    """rel_l2 of a against b (both computed at the benchmark size); raises past tol."""
    a, b = a.float(), b.float()
    rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    if not rel <= tol:
        raise AssertionError(f"fused result differs from eager: rel_l2 {rel:.3g}")
    return rel


def generated(program: dict, kind: str, validate_program: dict | None = None):
    """(gen, module, validation, alternatives): validated at the small program's sizes when its kernel is
    the same (sizes are symbolic), else at the benchmark's; tiles are tuned later, at the benchmark size."""
    gen = generate_anchored(program, kind)
    check_gen = gen
    if validate_program is not None:
        small = generate_anchored(validate_program, kind)
        if small.key == gen.key:
            check_gen = small
    mod = load_module(gen.path)
    mod.CONFIGS[:] = mod.CONFIGS[:TUNE_TOP]  # the likeliest winners only: the whole run has 5 minutes
    mod.TUNE = False  # validation runs odd sizes: the default tile there, no timing
    check = validate(check_gen, mod)
    alts = validate_alternatives(check_gen, mod) if gen.alternatives else {}
    mod.TUNE, _ = True, mod._best.clear()
    if not check.validated:
        raise RuntimeError(f"did not validate: {check.reason}")
    return gen, mod, check, alts


def tuned(mod) -> list:
    return [list(v) for v in mod._best.values()]


# ------------------------------------------------------------------------------------------ epilogues
def gelu_tanh(r, y):
    """HF's NewGELUActivation (GPT-2), op by op as the trace records it."""
    a = r("mul.Tensor", y, 0.5)
    c = r("mul.Tensor", r("pow.Tensor_Scalar", y, 3.0), 0.044715)
    t = r("tanh", r("mul.Tensor", r("add.Tensor", y, c), 0.7978845608028654))
    return r("mul.Tensor", a, r("add.Tensor", t, 1.0))


def _linear(r, t):
    return r("linear", t["x"], t["w"], t.get("b"))


def _conv1d(r, t):  # GPT-2's Conv1D: addmm on the flattened rows, viewed back to (B, L, N)
    x = t["x"]
    return r("addmm", t["b"], x.view(-1, x.shape[-1]), t["w"]).view(*x.shape[:-1], -1)


# name, workload, shapes, anchor(r, t) -> y, epilogue(r, y, t) -> out. Shapes are (B, L, K) inputs; M = B * L.
EPILOGUES = [
    ("Linear + GELU (16384x4096x4096)", "brief example", {"x": (8, 2048, 4096), "w": (4096, 4096), "b": (4096,)},
     _linear, lambda r, y, t: r("gelu", y)),
    ("Llama SwiGLU gate: silu(x Wg^T) * up", "hf_llama", {"x": (4, 1024, 2048), "w": (5632, 2048), "up": (4, 1024, 5632)},
     _linear, lambda r, y, t: r("mul.Tensor", r("silu", y), t["up"])),
    ("GPT-2 Conv1D (addmm) + GELU(tanh)", "hf_gpt2", {"x": (8, 1024, 1024), "w": (1024, 4096), "b": (4096,)},
     _conv1d, lambda r, y, t: gelu_tanh(r, y)),
    ("BERT intermediate Linear + GELU", "hf_bert", {"x": (32, 512, 768), "w": (3072, 768), "b": (3072,)},
     _linear, lambda r, y, t: r("gelu", y)),
    ("ViT MLP fc1 + GELU", "timm_vit", {"x": (128, 197, 768), "w": (3072, 768), "b": (3072,)},
     _linear, lambda r, y, t: r("gelu", y)),
    ("MLP block fc1 + GELU", "mlp_block", {"x": (8, 2048, 4096), "w": (16384, 4096), "b": (16384,)},
     _linear, lambda r, y, t: r("gelu", y)),
    ("MLP block fc2 + residual", "mlp_block", {"x": (8, 2048, 16384), "w": (4096, 16384), "b": (4096,), "res": (8, 2048, 4096)},
     _linear, lambda r, y, t: r("add.Tensor", t["res"], y)),
    # The zoo's GEMM epilogues (bench/zoo.py's shapes): where the Triton GEMM's cost against cuBLAS is calibrated
    # (analysis/cost.py's TRITON_GEMM_SLOWDOWN) across K from 96 to 1024.
    *[(f"zoo {name} Linear + GELU", name, {"x": x, "w": (n, x[-1]), "b": (n,)}, _linear, lambda r, y, t: r("gelu", y))
      for name, x, n in [("DeiT-S fc1", (64, 197, 384), 1536), ("BERT-base fc1 (RoBERTa, DistilBERT)", (32, 256, 768), 3072),
                         ("BART fc1", (8, 256, 768), 3072), ("ConvNeXt-T stage 1 fc1", (32, 3136, 96), 384),
                         ("ConvNeXt-T stage 2 fc1", (32, 784, 192), 768), ("ConvNeXt-T stage 3 fc1", (32, 196, 384), 1536),
                         ("ConvNeXt-T stage 4 fc1", (32, 49, 768), 3072)]],
    ("zoo Mistral SwiGLU gate", "mistral", {"x": (4, 512, 1024), "w": (2816, 1024), "up": (4, 512, 2816)},
     _linear, lambda r, y, t: r("mul.Tensor", r("silu", y), t["up"])),
]
SMOKE_DIMS = {8: 2, 4: 2, 32: 2, 128: 2, 1024: 24, 2048: 24, 512: 24, 197: 19, 4096: 40, 16384: 56, 5632: 36,
              768: 32, 3072: 48}


def shapes_for(shapes: dict, small: bool) -> dict:
    """The case's shapes, or small ones with the same structure (for validation, or --smoke)."""
    if not small:
        return shapes
    return {k: tuple(SMOKE_DIMS.get(d, min(d, 48)) for d in s) for k, s in shapes.items()}


def run_epilogue(name, workload, shapes, anchor, epilogue) -> dict:
    scale = {"w": 0.02}  # weights like an initialised model: outputs of order 1
    make = lambda shp: {k: rand(*s, scale=scale.get(k, 1.0)) for k, s in shp.items()}  # noqa: E731
    t = make(shapes_for(shapes, SMOKE))
    rec = Rec()
    out = epilogue(rec, anchor(rec, t), t)
    small_rec = Rec()
    ts = make(shapes_for(shapes, True))
    small_out = epilogue(small_rec, anchor(small_rec, ts), ts)
    gen, mod, check, _ = generated(rec.program(out), "epilogue", small_rec.program(small_out))
    fused_args = list(rec.tensors)
    # cuBLAS + the generator's one pointwise kernel for the epilogue: the best unfused alternative
    y0 = anchor(EAGER, t)
    erec = Rec()
    eout = epilogue(erec, y0, t)
    egen = generate(erec.program(eout))
    emod = load_module(egen.path)
    echeck = validate(egen, emod)

    def cublas_plus_epilogue():
        y = anchor(EAGER, t)
        return emod.run(*[y if a is y0 else a for a in erec.tensors])[0]

    eager = lambda: epilogue(EAGER, anchor(EAGER, t), t)  # noqa: E731
    fused = lambda: mod.run(*fused_args)[0]  # noqa: E731
    rel = close(fused(), eager())
    ms = {"eager": bench(eager), "cublas_fused_epilogue": bench(cublas_plus_epilogue) if echeck.validated else None,
          "cublas_only": bench(lambda: anchor(EAGER, t)), "fused": bench(fused)}
    unfused = min(v for k, v in ms.items() if k in ("eager", "cublas_fused_epilogue") and v is not None)
    x = t["x"]
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    n = out.shape[-1]
    return {"case": name, "workload": workload, "kind": "epilogue", "M": m, "N": n, "K": k, "dtype": "bfloat16",
            "ms": ms, "tflops_fused": 2 * m * n * k / (ms["fused"] / 1e3) / 1e12,
            "speedup_vs_best_unfused": unfused / ms["fused"], "keep_fused": ms["fused"] < unfused,
            "validated_rel_l2": check.errors.get("rel_l2"), "vs_eager_rel_l2": rel, "kernel": gen.key,
            "tuned_config": tuned(mod), "epilogue_kernel_validated": echeck.validated}


# ------------------------------------------------------------------------------------------ attention
def attention_ops(r, q, k, v, mask, scale):
    """Eager GPT-2 / BERT attention as transformers' eager path runs it (dropout is off in eval)."""
    s = r("mul.Tensor", r("matmul", q, k.transpose(-1, -2)), scale)
    if mask is not None:
        s = r("add.Tensor", s, mask)
    return r("matmul", r("softmax.int", s, -1), v)


def gpt2_inputs(B, H, L, D):
    """q, k, v split from one c_attn output (B, L, 3 H D) and viewed as heads; a causal additive mask."""
    qkv = rand(B, L, 3 * H * D)
    q, k, v = (x.view(B, L, H, D).transpose(1, 2) for x in qkv.split(H * D, -1))
    causal = torch.ones(L, L, dtype=torch.bool, device=DEV).triu(1)
    mask = torch.zeros(B, 1, L, L, dtype=BF16, device=DEV).masked_fill(causal, torch.finfo(BF16).min)
    return q, k, v, mask


def bert_inputs(B, H, L, D):
    """q, k, v from three Linear outputs (B, L, H D) viewed as heads; no padding, so no mask."""
    q, k, v = (rand(B, L, H * D).view(B, L, H, D).transpose(1, 2) for _ in range(3))
    return q, k, v, None


ATTENTION = [("GPT-2 eager attention (causal mask)", "hf_gpt2", (8, 16, 1024, 64), gpt2_inputs),
             ("BERT eager attention", "hf_bert", (32, 12, 512, 64), bert_inputs)]


def run_attention(name, workload, dims, make) -> dict:
    B, H, L, D = (2, 2, 37, 16) if SMOKE else dims
    q, k, v, mask = make(B, H, L, D)
    scale = 1.0 / math.sqrt(D)
    rec = Rec()
    out = attention_ops(rec, q, k, v, mask, scale)
    gen, mod, check, alts = generated(rec.program(out), "attention")
    args = list(rec.tensors)
    eager = lambda: attention_ops(EAGER, q, k, v, mask, scale)  # noqa: E731
    fused = lambda: mod.run(*args)[0]  # noqa: E731
    sdpa = lambda: mod.run_sdpa(*args)[0]  # noqa: E731
    ref = eager()
    rel = {"fused": close(fused(), ref), "sdpa": close(sdpa(), ref) if "sdpa" in alts else None}
    ms = {"eager": bench(eager), "fused": bench(fused)}
    mb = {"eager": peak_mb(eager), "fused": peak_mb(fused)}
    if alts.get("sdpa", {}).get("validated"):
        ms["sdpa"], mb["sdpa"] = bench(sdpa), peak_mb(sdpa)
    valid = {"fused": ms["fused"], **({"sdpa": ms["sdpa"]} if "sdpa" in ms else {})}
    return {"case": name, "workload": workload, "kind": "attention", "B": B, "H": H, "L": L, "D": D, "dtype": "bfloat16",
            "ms": ms, "peak_extra_MB": mb, "apply": min(valid, key=valid.get), "speedup_vs_eager": ms["eager"] / min(valid.values()),
            "validated_rel_l2": check.errors.get("rel_l2"), "alternatives": alts, "vs_eager_rel_l2": rel,
            "scores_never_written_MB": gen.memory_saved_bytes / 1e6, "kernel": gen.key, "tuned_config": tuned(mod)}


# ------------------------------------------------------------------------------------------ SPLADE
def run_splade() -> dict:
    B, L, Hd, V = (2, 19, 32, 203) if SMOKE else (32, 256, 768, 30522)
    torch.manual_seed(0)
    dense = torch.nn.Linear(Hd, Hd).to(DEV, BF16)
    norm = torch.nn.LayerNorm(Hd, eps=1e-12).to(DEV, BF16)
    w, b = rand(V, Hd, scale=0.02), rand(V, scale=0.02)
    h = rand(B, L, Hd)
    lengths = torch.randint(L // 2, L + 1, (B,), device=DEV)
    mask = (torch.arange(L, device=DEV)[None, :] < lengths[:, None]).to(BF16)

    def transform(x):  # BertPredictionHeadTransform: dense, GELU, LayerNorm
        return norm(F.gelu(dense(x)))

    def tail(r, t, mask3):  # decoder to the vocabulary, then SPLADE's pooling
        x = r("mul.Tensor", r("log1p", r("relu", r("linear", t, w, b))), mask3)
        return r("amax", x, [1])

    def splade(x, m):
        logits = F.linear(transform(x), w, b)
        return torch.amax(torch.log1p(torch.relu(logits)) * m.unsqueeze(-1), dim=1)

    with torch.no_grad():
        rec = Rec()
        out = tail(rec, transform(h), mask.unsqueeze(-1))
        gen, mod, check, _ = generated(rec.program(out), "matmul_reduction")
        mask3 = mask.unsqueeze(-1)
        ours = lambda: mod.run(transform(h), w, b, mask3)[0]  # noqa: E731
        eager = lambda: splade(h, mask)  # noqa: E731
        ref = eager()
        rel = close(ours(), ref)
        res = {"case": "SPLADE head (BERT-base MLM head to vocab, max over seq)", "kind": "matmul_reduction",
               "B": B, "L": L, "hidden": Hd, "V": V, "dtype": "bfloat16", "ms": {}, "peak_extra_MB": {},
               "validated_rel_l2": check.errors.get("rel_l2"), "vs_eager_rel_l2": rel,
               "logits_never_allocated_MB": B * L * V * 2 / 1e6, "kernel": gen.key, "note": gen.note}
        res["ms"]["eager"], res["peak_extra_MB"]["eager"] = bench(eager), peak_mb(eager)
        res["ms"]["fusion_advisor"], res["peak_extra_MB"]["fusion_advisor"] = bench(ours), peak_mb(ours)
        res["ms"]["fused_kernel_only"] = bench(lambda: mod.run(*rec.tensors)[0])
        res["tuned_config"] = tuned(mod)
        if not SMOKE:
            t0 = time.time()
            compiled = torch.compile(splade)
            close(compiled(h, mask), ref)
            res["compile_s"] = time.time() - t0
            res["ms"]["torch_compile"] = bench(lambda: compiled(h, mask))
            res["peak_extra_MB"]["torch_compile"] = peak_mb(lambda: compiled(h, mask))
    return res


# ------------------------------------------------------------------------------------------ report
def _f(x, fmt=".3f"):
    return "" if x is None else format(x, fmt)


def markdown(result: dict) -> str:
    lines = [f"# Matmul-anchored fusion: epilogues, attention, SPLADE ({result['device']})", "",
             f"torch {result['torch']}, triton {result['triton']}; bf16; median of `triton.testing.do_bench` "
             f"(L2 cleared before each call); every fused kernel validated against an fp64 reference first. "
             f"Wall time {result['wall_s']:.0f} s.", ""]
    epi = [r for r in result["cases"] if r.get("kind") == "epilogue"]
    if epi:
        lines += ["## GEMM epilogues", "",
                  "A fused epilogue is kept only where it beats both unfused variants (eager = cuBLAS + the "
                  "epilogue's eager kernels; cuBLAS + 1 = cuBLAS + the generator's one fused epilogue kernel).", "",
                  "| case | M x N x K | eager ms | cuBLAS + 1 ms | cuBLAS alone ms | fused ms | fused TFLOP/s | "
                  "vs best unfused | keep |", "|---|---|---|---|---|---|---|---|---|"]
        for r in epi:
            if "error" in r:
                lines.append(f"| {r['case']} | | | | | | | | {r['error']} |")
                continue
            ms = r["ms"]
            lines.append(f"| {r['case']} | {r['M']} x {r['N']} x {r['K']} | {_f(ms['eager'])} | "
                         f"{_f(ms['cublas_fused_epilogue'])} | {_f(ms['cublas_only'])} | {_f(ms['fused'])} | "
                         f"{r['tflops_fused']:.0f} | {r['speedup_vs_best_unfused']:.2f}x | "
                         f"{'fused' if r['keep_fused'] else 'cuBLAS + epilogue'} |")
        lines.append("")
    att = [r for r in result["cases"] if r.get("kind") == "attention"]
    if att:
        lines += ["## Attention (eager HF paths)", "",
                  "| case | B x H x L x d | eager ms | SDPA ms | fused ms | eager MB | SDPA MB | fused MB | apply | "
                  "vs eager |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in att:
            if "error" in r:
                lines.append(f"| {r['case']} | | | | | | | | | {r['error']} |")
                continue
            ms, mb = r["ms"], r["peak_extra_MB"]
            lines.append(f"| {r['case']} | {r['B']} x {r['H']} x {r['L']} x {r['D']} | {_f(ms['eager'])} | "
                         f"{_f(ms.get('sdpa'))} | {_f(ms['fused'])} | {_f(mb['eager'], '.0f')} | "
                         f"{_f(mb.get('sdpa'), '.0f')} | {_f(mb['fused'], '.0f')} | {r['apply']} | "
                         f"{r['speedup_vs_eager']:.2f}x |")
        lines.append("")
    sp = [r for r in result["cases"] if r.get("kind") == "matmul_reduction"]
    for r in sp:
        lines += ["## SPLADE head: matmul + max over the sequence", ""]
        if "error" in r:
            lines += [f"error: {r['error']}", ""]
            continue
        lines += [f"batch {r['B']} x seq {r['L']}, hidden {r['hidden']} -> vocab {r['V']}; the logits "
                  f"({r['logits_never_allocated_MB']:.0f} MB) are never allocated by the fused kernel.", "",
                  "| variant | ms | peak extra MB |", "|---|---|---|"]
        for k in ("eager", "torch_compile", "fusion_advisor", "fused_kernel_only"):
            if k in r["ms"]:
                lines.append(f"| {k.replace('_', ' ')} | {_f(r['ms'][k])} | {_f(r['peak_extra_MB'].get(k), '.0f')} |")
        if "compile_s" in r:
            lines += ["", f"torch.compile took {r['compile_s']:.1f} s."]
        lines.append("")
    skipped = [r for r in result["cases"] if r.get("skipped")]
    if skipped:
        lines += ["Skipped for the time budget: " + ", ".join(r["case"] for r in skipped), ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path stem: writes STEM.md and STEM.json")
    ap.add_argument("--only", default=None, help="run only cases whose name contains one of these (comma-separated)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip the cases left once this much time has passed")
    ap.add_argument("--tune-top", type=int, default=5, help="tile configs timed per fused kernel (the first N)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in Triton's interpreter, to test the script")
    a = ap.parse_args()
    global TUNE_TOP
    TUNE_TOP = max(1, a.tune_top)
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("bench/matmul_fusion.py needs a CUDA GPU (or --smoke)")
    torch.manual_seed(0)
    t_start = time.time()
    stem = Path(a.out)
    stem = stem.with_suffix("") if stem.suffix in (".md", ".json") else stem
    stem.parent.mkdir(parents=True, exist_ok=True)
    results = []

    def save():  # after every case: a run killed by an outer timeout keeps what it finished
        result = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "CPU (Triton interpreter, smoke test)",
                  "torch": torch.__version__, "triton": triton.__version__, "smoke": SMOKE,
                  "wall_s": time.time() - t_start, "cases": results}
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
        stem.with_suffix(".md").write_text(markdown(result))
        return result

    # the order is the priority when the budget runs out
    plan = [("epilogue", EPILOGUES[0]), ("attention", ATTENTION[0]), ("splade", None), ("epilogue", EPILOGUES[1]),
            ("attention", ATTENTION[1])] + [("epilogue", c) for c in EPILOGUES[2:]]
    for kind, case in plan:
        name = case[0] if case else "SPLADE head"
        if a.only and not any(o.strip().lower() in name.lower() for o in a.only.split(",") if o.strip()):
            continue
        if time.time() - t_start > a.budget_s:
            results.append({"case": name, "kind": kind if kind != "splade" else "matmul_reduction", "skipped": True,
                            "error": "skipped: time budget"})
            continue
        t0 = time.time()
        try:
            with torch.no_grad():
                r = run_epilogue(*case) if kind == "epilogue" else run_attention(*case) if kind == "attention" \
                    else run_splade()
        except Exception as e:  # one broken case must not lose the others
            r = {"case": name, "kind": kind if kind != "splade" else "matmul_reduction",
                 "error": f"{type(e).__name__}: {e}"[:300]}
        r["case_s"] = round(time.time() - t0, 1)
        print(json.dumps(r, default=str), flush=True)
        results.append(r)
        save()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    print(markdown(save()))


if __name__ == "__main__":
    main()

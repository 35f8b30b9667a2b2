"""Linear + GELU/ReLU: cuBLASLt's own epilogue (`torch._addmm_activation`) against eager's two kernels and
Inductor's compile of the same ops, at the users'-size shapes (one-off probe)."""
import json, os, time, torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
from triton.testing import do_bench

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
SHAPES = {  # (tokens, in, out): the first MLP linear of each users'-size row
    "bert_whisper_deberta_fc1": (16384, 768, 3072),
    "vit_b16_fc1": (25216, 768, 3072),
    "gpt_neox_2048_fc1": (4096, 2048, 8192),
    "swin_convnext_stage1": (401408, 96, 384),
    "swin_convnext_stage3": (25088, 384, 1536),
    "convnext_stage4": (6272, 768, 3072),
}
AUTOTUNE = ("bert_whisper_deberta_fc1", "vit_b16_fc1", "gpt_neox_2048_fc1")
res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}


def kernels(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(); torch.cuda.synchronize()
    return [e.key[:120] for e in prof.key_averages() if (getattr(e, "self_device_time_total", 0) or 0) > 0]


for name, (m, k, n) in SHAPES.items():
    x = torch.randn(m, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5
    b = torch.randn(n, device=dev, dtype=dt) * 0.1
    zero = torch.zeros(n, device=dev, dtype=dt)
    ref = F.gelu(F.linear(x.float(), w.float(), b.float()))
    row = {"shape": [m, k, n]}
    gemm_bytes = 2 * (m * k + k * n + m * n)
    row["gemm_alone_ms"] = do_bench(lambda: F.linear(x, w, b), warmup=25, rep=200)
    row["eager_gelu_ms"] = do_bench(lambda: F.gelu(F.linear(x, w, b)), warmup=25, rep=200)
    row["eager_relu_ms"] = do_bench(lambda: F.relu(F.linear(x, w, b)), warmup=25, rep=200)
    lt_gelu = lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)
    lt_relu = lambda: torch._addmm_activation(b, x, w.t())
    lt_relu_nobias = lambda: torch._addmm_activation(zero, x, w.t())
    row["lt_gelu_ms"] = do_bench(lt_gelu, warmup=25, rep=200)
    row["lt_relu_ms"] = do_bench(lt_relu, warmup=25, rep=200)
    row["lt_relu_zero_bias_ms"] = do_bench(lt_relu_nobias, warmup=25, rep=200)
    row["nobias_eager_relu_ms"] = do_bench(lambda: F.relu(F.linear(x, w)), warmup=25, rep=200)
    row["lt_gelu_kernels"] = kernels(lt_gelu)
    row["eager_gelu_kernels"] = kernels(lambda: F.gelu(F.linear(x, w, b)))
    out = lt_gelu().float()
    row["lt_gelu_vs_erf_fp32"] = {"max_abs": float((out - ref).abs().max()),
                                  "rel_l2": float((out - ref).norm() / ref.norm())}
    eag = F.gelu(F.linear(x, w, b)).float()
    row["eager_bf16_vs_erf_fp32"] = {"max_abs": float((eag - ref).abs().max()),
                                     "rel_l2": float((eag - ref).norm() / ref.norm())}
    row["lt_relu_equal_eager"] = bool(torch.equal(lt_relu(), F.relu(F.linear(x, w, b))))
    modes = ("default", "max-autotune-no-cudagraphs") if name in AUTOTUNE else ("default",)
    for mode in modes:
        torch._dynamo.reset()
        f = torch.compile(lambda a, ww, bb: F.gelu(F.linear(a, ww, bb)), mode=mode)
        t0 = time.perf_counter(); f(x, w, b); torch.cuda.synchronize()
        row[f"compile_{mode}_compile_s"] = round(time.perf_counter() - t0, 1)
        row[f"compile_{mode}_gelu_ms"] = do_bench(lambda: f(x, w, b), warmup=25, rep=200)
        row[f"compile_{mode}_kernels"] = kernels(lambda: f(x, w, b))
    row["gemm_bytes_floor_ms_at_4.2TBps"] = gemm_bytes / 4.2e12 * 1e3
    row["flop_floor_ms_at_790TF"] = 2 * m * k * n / 790e12 * 1e3
    res[name] = {kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}
    print(name, json.dumps(res[name]), flush=True)
    del x, w, ref, out, eag
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "gemm_epilogues.json"), "w"), indent=1)

"""Attention under masks: which kernels are exact and how fast (one-off probe)."""
import json, os, torch, torch.nn.functional as F
from triton.testing import do_bench
torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
res = {}

def bench(name, fn, ref=None, rows=None):
    out = fn()
    ms = do_bench(fn, warmup=25, rep=200)
    r = {"ms": round(ms, 4)}
    if ref is not None:
        d = (out.float() - ref.float()).abs()
        r["max_err_all"] = float(d.nan_to_num(999).max())
        if rows is not None:
            r["max_err_valid"] = float(d[rows].nan_to_num(999).max())
        r["nan"] = bool(out.isnan().any())
    res[name] = r
    print(name, r, flush=True)
    return out

# Qwen2 2048: 4 x 1024, 16 heads, 8 kv heads, d 128, last row right-padded by 128
B, L, H, KV, D = 4, 1024, 16, 8, 128
q = torch.randn(B, H, L, D, device=dev, dtype=dt)
k = torch.randn(B, KV, L, D, device=dev, dtype=dt)
v = torch.randn(B, KV, L, D, device=dev, dtype=dt)
lens = torch.tensor([L, L, L, L - 128], device=dev, dtype=torch.int32)
j = torch.arange(L, device=dev)
causal = j[None, :] <= j[:, None]
bmask = (causal[None] & (j[None, None, :] < lens[:, None, None]))[:, None]  # B,1,L,L
valid = torch.ones(B, H, L, dtype=torch.bool, device=dev)
valid[3, :, L - 128:] = False
ref = bench("sdpa_bool", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bmask, enable_gqa=True))
amask = torch.zeros(B, 1, L, L, device=dev, dtype=dt).masked_fill(~bmask, float("-inf"))
bench("sdpa_additive", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=amask, enable_gqa=True), ref, valid)
bench("sdpa_causal_floor", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), ref, valid)
qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # B, L, H, D views
kr, vr = (t.repeat_interleave(H // KV, 1).transpose(1, 2) for t in (k, v))
def eff():
    return torch.ops.aten._efficient_attention_forward(qt, kr, vr, None, None, None, L, L, 0.0, 1, False,
                                                       scale=D ** -0.5, seqlen_k=lens)[0]
try:
    bench("efficient_causal_seqlen_k", lambda: eff().transpose(1, 2), ref, valid)
except Exception as e:
    res["efficient_causal_seqlen_k"] = repr(e)[:300]; print(e)
def fa2():
    return torch.ops.aten._flash_attention_forward(qt, kt, vt, None, None, L, L, 0.0, True, False, scale=D ** -0.5)[0]
try:
    bench("flash2_causal_floor", lambda: fa2().transpose(1, 2), ref, valid)
except Exception as e:
    res["flash2_causal_floor"] = repr(e)[:300]; print(e)
# left padding: first row padded by 100 on the left; what does each kernel give a fully masked row?
p = 100
lmask = (causal[None] & (j[None, None, :] >= torch.tensor([p, 0, 0, 0], device=dev)[:, None, None]))[:, None]
lref = bench("left_sdpa_bool", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=lmask, enable_gqa=True))
res["left_sdpa_bool_padded_rows"] = {"nan": bool(lref[0, :, :p].isnan().any()), "absmax": float(lref[0, :, :p].float().nan_to_num(0).abs().max())}
from torch.nn.attention import sdpa_kernel, SDPBackend
for be in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
    try:
        with sdpa_kernel([be]):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=lmask, enable_gqa=True)
        res[f"left_{be.name}_padded_rows"] = {"nan": bool(o[0, :, :p].isnan().any()), "absmax": float(o[0, :, :p].float().nan_to_num(0).abs().max()),
                                             "err_valid_vs_default": float((o - lref)[0, :, p:].float().abs().max())}
    except Exception as e:
        res[f"left_{be.name}_padded_rows"] = repr(e)[:200]
    print(be, res.get(f"left_{be.name}_padded_rows"), flush=True)
# which backend SDPA picks with the bool mask
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    F.scaled_dot_product_attention(q, k, v, attn_mask=bmask, enable_gqa=True); torch.cuda.synchronize()
res["sdpa_bool_kernels"] = [e.key[:90] for e in prof.key_averages()]

# T5 encoder 768: 32 x 512, 12 heads of 64, position bias [1,12,L,L] + padding [32,1,1,L]
B, L, H, D = 32, 512, 12, 64
q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dt) for _ in range(3))
pb = torch.randn(1, H, L, L, device=dev, dtype=dt)
pad = torch.zeros(B, 1, 1, L, device=dev, dtype=dt); pad[-1, ..., L - 64:] = torch.finfo(dt).min
full = pb + pad
tref = bench("t5_sdpa_full_bias", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=1.0))
bench("t5_sdpa_bias_made_per_call", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=pb + pad, scale=1.0), tref)
bench("t5_sdpa_expanded_pb_only", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=pb.expand(B, H, L, L), scale=1.0))
bench("t5_sdpa_no_bias_floor", lambda: F.scaled_dot_product_attention(q, k, v, scale=1.0))
def eager():
    s = torch.matmul(q, k.transpose(-1, -2)) + full
    return torch.matmul(torch.softmax(s.float(), -1).to(dt), v)
bench("t5_eager_math", eager, tref)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    F.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=1.0); torch.cuda.synchronize()
res["t5_sdpa_kernels"] = [e.key[:90] for e in prof.key_averages()]
try:
    from torch.nn.attention.flex_attention import flex_attention
    padk = pad[:, 0, 0, :].contiguous()
    def score_mod(score, b, h, qi, ki):
        return score + pb[0, h, qi, ki] + padk[b, ki]
    flex = torch.compile(flex_attention)
    bench("t5_flex_score_mod", lambda: flex(q, k, v, score_mod=score_mod, scale=1.0), tref)
except Exception as e:
    res["t5_flex_score_mod"] = repr(e)[:300]; print(e)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "attn.json"), "w"), indent=1)

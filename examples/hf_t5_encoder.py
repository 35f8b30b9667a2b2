"""Hugging Face T5EncoderModel forward pass (random weights, SDPA attention with T5's relative position bias).

cuda: bf16, t5-base dims (d_model 768, 12 heads, d_ff 3072, vocab 32128), 2 layers, batch 32 x seq 512, the last
      row padded by 64 tokens.
cpu:  fp32, d_model 64, 4 heads, d_ff 128, vocab 256, 2 layers, batch 2 x seq 16, the last row padded by 4.
Usage: python examples/hf_t5_encoder.py [--device cuda|cpu] [--iters 3] [--layers N]
"""
import argparse
import os

import torch


def main():
    default_device = os.environ.get("FUSION_ADVISOR_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    ap = argparse.ArgumentParser(description="HF T5 encoder forward")
    ap.add_argument("--device", default=default_device, choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()

    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    if a.device == "cuda":
        dtype, batch, seq, pad = torch.bfloat16, 32, 512, 64
        dims = dict(d_model=768, num_heads=12, d_kv=64, d_ff=3072, vocab_size=32128)
    else:
        dtype, batch, seq, pad = torch.float32, 2, 16, 4
        dims = dict(d_model=64, num_heads=4, d_kv=16, d_ff=128, vocab_size=256)
    config = T5Config(num_layers=a.layers, **dims)
    config._attn_implementation = "sdpa"
    with torch.device(a.device):
        model = T5EncoderModel(config).to(dtype).eval()
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - pad:] = 0
    with torch.inference_mode():
        for _ in range(a.iters):
            out = model(input_ids=ids, attention_mask=mask)
    if a.device == "cuda":
        torch.cuda.synchronize()
    h = out.last_hidden_state
    print(f"hf_t5_encoder: {a.iters} iterations on {a.device}, hidden {tuple(h.shape)} {h.dtype}")


if __name__ == "__main__":
    main()

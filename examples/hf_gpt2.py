"""Hugging Face GPT2LMHeadModel forward pass (random weights, SDPA attention, no KV cache).

cuda: bf16, n_embd 1024, 2 layers, 16 heads, vocab 50257, batch 8 x seq 1024.
cpu:  fp32, n_embd 64, 2 layers, 4 heads, vocab 256, batch 2 x seq 16.
Usage: python examples/hf_gpt2.py [--device cuda|cpu] [--iters 3] [--layers N] [--attn sdpa|eager]
"""
import argparse
import os

import torch


def main():
    default_device = os.environ.get("FUSION_ADVISOR_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    ap = argparse.ArgumentParser(description="HF GPT-2 forward")
    ap.add_argument("--device", default=default_device, choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                    help="attention implementation: eager materialises softmax(q k^T) (what attention fusion targets)")
    a = ap.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if a.device == "cuda":
        dtype, batch, seq = torch.bfloat16, 8, 1024
        dims = dict(n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024)
    else:
        dtype, batch, seq = torch.float32, 2, 16
        dims = dict(n_embd=64, n_head=4, vocab_size=256, n_positions=128, bos_token_id=255, eos_token_id=255)
    config = GPT2Config(n_layer=a.layers, **dims)
    config._attn_implementation = a.attn
    with torch.device(a.device):
        model = GPT2LMHeadModel(config).to(dtype).eval()
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    with torch.inference_mode():
        for _ in range(a.iters):
            out = model(input_ids=ids, use_cache=False)
    if a.device == "cuda":
        torch.cuda.synchronize()
    print(f"hf_gpt2: {a.iters} iterations on {a.device}, logits {tuple(out.logits.shape)} {out.logits.dtype}")


if __name__ == "__main__":
    main()
